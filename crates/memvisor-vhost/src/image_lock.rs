//! Image locks: the byte-range locks QEMU takes on a disk image, taken here the same way, so
//! that memvisor, QEMU and qemu-storage-daemon each see when another has the image open and
//! refuse what would corrupt it (two writers on one file system).
//!
//! **The model.** A program that opens an image asks for permissions on it and says which
//! permissions it lets others have at the same time. The four permissions, numbered as in
//! QEMU (`BLK_PERM_*` in include/block/block-common.h): 0 *consistent read* (reads see what
//! the image holds, nobody changes it behind the reader's back), 1 *write*, 2 *write
//! unchanged* (writes that leave the data as it was), 3 *resize*. Each is published as a lock
//! on one byte of the image file, never on its data:
//!
//! - byte `100 + P`: "I hold permission P";
//! - byte `200 + P`: "I do not let anyone else hold permission P".
//!
//! Every lock is a shared (read) lock, so any number of programs may say the same thing. To
//! hold P, a program checks that nobody has a lock on `200 + P` (nobody refuses to share P);
//! to refuse P to others, it checks that nobody has a lock on `100 + P` (nobody holds P). The
//! check asks the kernel whether an exclusive lock on that byte would be granted
//! (`F_OFD_GETLK`): it would not be exactly when another open file holds a lock there. The
//! locks are taken first and checked after, so of two programs opening together at least one
//! sees the other.
//!
//! The byte layout and the rules are QEMU's (block/file-posix.c, `raw_apply_lock_bytes` and
//! `raw_check_lock_bytes`, by Fam Zheng, Red Hat); this is memvisor's own code for them.
//!
//! **What memvisor asks for** is what a QEMU VM asks for with a virtio-blk `-drive` (measured
//! in /proc/locks, QEMU 11.1): a writable disk holds consistent read and write (bytes 100 and
//! 101) and does not share write (201); a read-only disk holds consistent read (100) and does
//! not share write either (201): the guest's file system caches what it read, so a writer
//! beside it would show the guest a disk changing under it. Everything else is shared. So a
//! second writer is refused, two readers are fine, and a reader and a writer refuse each
//! other, whichever comes first. (A qemu-storage-daemon export holds 100 and 101 and shares
//! write; memvisor refuses to open beside it for writing, as a QEMU VM does.)
//!
//! **Open file description locks** (`F_OFD_SETLK`): they belong to the open file, not to the
//! process, so two disks of one process on the same image see each other, closing some other
//! descriptor of the file drops nothing, and they go when the file is closed (the disk
//! dropped) — there is nothing to release by hand.
//!
//! **`locking=`**, as QEMU's `file.locking`: `on` takes the locks and fails where the file
//! system cannot (`EINVAL`, `EOPNOTSUPP`, `ENOLCK`: some network and FUSE file systems);
//! `auto` (the default) takes them where it can and goes on without them elsewhere; `off`
//! takes none and checks nothing.

use std::fmt;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// First byte of "I hold permission P" (QEMU's `RAW_LOCK_PERM_BASE`).
pub const PERM_BASE: i64 = 100;
/// First byte of "I do not share permission P" (QEMU's `RAW_LOCK_SHARED_BASE`).
pub const SHARED_BASE: i64 = 200;

/// One of QEMU's block permissions; the discriminant is its bit number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Permission {
    /// Reads see the image as it is (`BLK_PERM_CONSISTENT_READ`).
    ConsistentRead = 0,
    /// Writes (`BLK_PERM_WRITE`).
    Write = 1,
    /// Writes that leave the data unchanged (`BLK_PERM_WRITE_UNCHANGED`).
    WriteUnchanged = 2,
    /// Changing the image's size (`BLK_PERM_RESIZE`).
    Resize = 3,
}

impl Permission {
    /// All four, by bit number.
    pub const ALL: [Permission; 4] = [
        Permission::ConsistentRead,
        Permission::Write,
        Permission::WriteUnchanged,
        Permission::Resize,
    ];

    /// The name QEMU uses in its messages.
    pub fn name(self) -> &'static str {
        match self {
            Permission::ConsistentRead => "consistent read",
            Permission::Write => "write",
            Permission::WriteUnchanged => "write unchanged",
            Permission::Resize => "resize",
        }
    }

    /// The byte that says "I hold this permission".
    pub fn held_byte(self) -> i64 {
        PERM_BASE + self as i64
    }

    /// The byte that says "I do not share this permission".
    pub fn unshared_byte(self) -> i64 {
        SHARED_BASE + self as i64
    }

    /// What a holder of the permission does, for messages ("open for ...").
    fn doing(self) -> &'static str {
        match self {
            Permission::ConsistentRead => "open for reading",
            Permission::Write => "open for writing",
            Permission::WriteUnchanged => "open for writing (unchanged data)",
            Permission::Resize => "open to resize it",
        }
    }

    /// What another process may not do, for messages ("lets no other process ...").
    fn deed(self) -> &'static str {
        match self {
            Permission::ConsistentRead => "read it consistently",
            Permission::Write => "write to it",
            Permission::WriteUnchanged => "write to it",
            Permission::Resize => "resize it",
        }
    }
}

impl fmt::Display for Permission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What one opener of an image asks for: the permissions it holds, and those it refuses to
/// share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// Permissions held.
    pub held: &'static [Permission],
    /// Permissions nobody else may hold meanwhile.
    pub unshared: &'static [Permission],
}

impl Access {
    /// What a disk served to a guest asks for (see the module's top comment): consistent read,
    /// write unless `read_only`, and write shared with nobody.
    pub fn disk(read_only: bool) -> Access {
        Access {
            held: if read_only {
                &[Permission::ConsistentRead]
            } else {
                &[Permission::ConsistentRead, Permission::Write]
            },
            unshared: &[Permission::Write],
        }
    }

    /// Every byte this access locks, in order.
    pub fn bytes(&self) -> impl Iterator<Item = i64> + '_ {
        self.held
            .iter()
            .map(|p| p.held_byte())
            .chain(self.unshared.iter().map(|p| p.unshared_byte()))
    }
}

/// Whether to lock (`locking=` on a disk; QEMU's `file.locking`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Locking {
    /// Lock where the file system can; go on without locks where it cannot.
    #[default]
    Auto,
    /// Lock, and fail where the file system cannot.
    On,
    /// Neither lock nor check.
    Off,
}

impl std::str::FromStr for Locking {
    type Err = String;

    fn from_str(s: &str) -> Result<Locking, String> {
        match s {
            "auto" => Ok(Locking::Auto),
            "on" | "true" | "yes" => Ok(Locking::On),
            "off" | "false" | "no" => Ok(Locking::Off),
            _ => Err(format!("locking={s:?}: write on, off or auto")),
        }
    }
}

impl fmt::Display for Locking {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Locking::Auto => "auto",
            Locking::On => "on",
            Locking::Off => "off",
        })
    }
}

/// Which side of the rule another process broke.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conflict {
    /// We need the permission; another process refuses to share it (it locks `200 + P`).
    NotShared,
    /// We refuse to share the permission; another process holds it (it locks `100 + P`).
    Held,
}

/// Why an image could not be locked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LockError {
    /// Another program has the image open in a way ours cannot go beside (EAGAIN).
    #[error("{}", conflict_message(image, *permission, *conflict))]
    Conflict {
        /// The image.
        image: PathBuf,
        /// The permission in dispute.
        permission: Permission,
        /// Who refused whom.
        conflict: Conflict,
    },
    /// `locking=on`, and the image's file system does not do open file description locks.
    #[error(
        "{}: cannot lock the image: its file system does not support OFD locks ({source}); \
         use locking=auto to go on without locks there, or locking=off",
        image.display()
    )]
    Unsupported {
        /// The image.
        image: PathBuf,
        /// What `fcntl` said.
        source: std::io::Error,
    },
    /// `fcntl` failed in another way.
    #[error("{}: cannot lock the image ({op}): {source}", image.display())]
    Os {
        /// The image.
        image: PathBuf,
        /// What was being done.
        op: &'static str,
        /// What `fcntl` said.
        source: std::io::Error,
    },
}

impl LockError {
    /// The errno: EAGAIN for a conflict (what `fcntl` answers a lock it cannot grant), the
    /// system's own otherwise.
    pub fn errno(&self) -> i32 {
        match self {
            LockError::Conflict { .. } => libc::EAGAIN,
            LockError::Unsupported { source, .. } | LockError::Os { source, .. } => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
        }
    }
}

fn conflict_message(image: &Path, p: Permission, conflict: Conflict) -> String {
    let who = "another process (QEMU, qemu-storage-daemon or memvisor)";
    let (lock, what) = match conflict {
        Conflict::NotShared => (
            format!("the {:?} lock", p.name()),
            format!("has the image open and lets no other process {}", p.deed()),
        ),
        Conflict::Held => (
            format!("the shared {:?} lock", p.name()),
            format!("has the image {}", p.doing()),
        ),
    };
    format!(
        "{}: cannot take {lock}: {who} {what}; stop it or use locking=off",
        image.display()
    )
}

/// What [`lock`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locked {
    /// The locks are held (until the file is closed).
    Held,
    /// `locking=off`: nothing taken.
    Off,
    /// `locking=auto` on a file system without OFD locks: nothing taken.
    Unsupported,
}

/// Takes the locks `access` needs on `file` (the image at `image`, for messages) and checks
/// that no other open file of the image conflicts. On a conflict or an error the locks just
/// taken are dropped again, and the file holds none.
pub fn lock(
    file: &File,
    image: &Path,
    access: Access,
    locking: Locking,
) -> Result<Locked, LockError> {
    if locking == Locking::Off {
        return Ok(Locked::Off);
    }
    let fd = file.as_raw_fd();
    let os = |op, source: std::io::Error| {
        let unsupported = matches!(
            source.raw_os_error(),
            Some(libc::EINVAL | libc::EOPNOTSUPP | libc::ENOLCK)
        );
        if unsupported {
            LockError::Unsupported {
                image: image.to_path_buf(),
                source,
            }
        } else {
            LockError::Os {
                image: image.to_path_buf(),
                op,
                source,
            }
        }
    };
    let result = (|| {
        for byte in access.bytes() {
            match set(fd, byte, libc::F_RDLCK as i16) {
                Ok(()) => {}
                // Another open file holds an exclusive lock on the byte (QEMU takes only
                // shared ones, but any program may): that permission is not to be had.
                Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EACCES)) => {
                    return Err(conflict_on(image, byte));
                }
                Err(e) => return Err(os("take a lock byte", e)),
            }
        }
        for &p in access.held {
            if taken_by_other(fd, p.unshared_byte()).map_err(|e| os("test a lock byte", e))? {
                return Err(LockError::Conflict {
                    image: image.to_path_buf(),
                    permission: p,
                    conflict: Conflict::NotShared,
                });
            }
        }
        for &p in access.unshared {
            if taken_by_other(fd, p.held_byte()).map_err(|e| os("test a lock byte", e))? {
                return Err(LockError::Conflict {
                    image: image.to_path_buf(),
                    permission: p,
                    conflict: Conflict::Held,
                });
            }
        }
        Ok(Locked::Held)
    })();
    match result {
        Ok(l) => Ok(l),
        Err(e) => {
            unlock(file, access);
            match e {
                LockError::Unsupported { image, source } if locking == Locking::Auto => {
                    log::warn!(
                        "{}: served without image locks (locking=auto): the file system does \
                         not support OFD locks ({source}); QEMU or another server could open \
                         it for writing too",
                        image.display()
                    );
                    Ok(Locked::Unsupported)
                }
                e => Err(e),
            }
        }
    }
}

/// The conflict a refused lock on `byte` means: someone else holds or refuses to share the
/// byte's permission.
fn conflict_on(image: &Path, byte: i64) -> LockError {
    let (permission, conflict) = Permission::ALL
        .iter()
        .find_map(|&p| {
            if p.held_byte() == byte {
                Some((p, Conflict::Held))
            } else if p.unshared_byte() == byte {
                Some((p, Conflict::NotShared))
            } else {
                None
            }
        })
        .unwrap_or((Permission::Write, Conflict::Held));
    LockError::Conflict {
        image: image.to_path_buf(),
        permission,
        conflict,
    }
}

/// Drops the locks `access` takes on `file` (closing the file does the same).
pub fn unlock(file: &File, access: Access) {
    for byte in access.bytes() {
        // Unlocking a byte not locked is no error; a file system without locks has none.
        let _ = set(file.as_raw_fd(), byte, libc::F_UNLCK as i16);
    }
}

fn one_byte(byte: i64, kind: i16) -> libc::flock {
    // SAFETY: flock is plain data; all zero is a valid value.
    let mut l: libc::flock = unsafe { std::mem::zeroed() };
    l.l_type = kind;
    l.l_whence = libc::SEEK_SET as i16;
    l.l_start = byte;
    l.l_len = 1;
    l.l_pid = 0; // OFD requests must say 0
    l
}

fn set(fd: i32, byte: i64, kind: i16) -> std::io::Result<()> {
    let l = one_byte(byte, kind);
    // SAFETY: F_OFD_SETLK reads the flock we pass, which lives for the call.
    if unsafe { libc::fcntl(fd, libc::F_OFD_SETLK, &l) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether an open file other than `fd`'s holds a lock on `byte`: an exclusive lock there
/// would not be granted.
fn taken_by_other(fd: i32, byte: i64) -> std::io::Result<bool> {
    let mut l = one_byte(byte, libc::F_WRLCK as i16);
    // SAFETY: F_OFD_GETLK reads and rewrites the flock we pass, which lives for the call.
    if unsafe { libc::fcntl(fd, libc::F_OFD_GETLK, &mut l) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(l.l_type != libc::F_UNLCK as i16)
}

/// Whether an open file other than `file` holds a lock on `byte` (for this module's tests).
#[cfg(test)]
fn byte_taken_by_other(file: &File, byte: i64) -> std::io::Result<bool> {
    taken_by_other(file.as_raw_fd(), byte)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An image no other test sees: a memfd, named by its /proc path so it can be opened
    /// again as another open file (the way a second program opens it).
    fn image() -> (File, PathBuf) {
        // SAFETY: the name is a NUL-terminated literal; the result is checked.
        let fd = unsafe { libc::memfd_create(c"image".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just made and is owned by nothing else.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.set_len(4096).unwrap();
        let p = PathBuf::from(format!("/proc/self/fd/{fd}"));
        (f, p)
    }

    fn open(p: &Path, write: bool) -> File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(write)
            .open(p)
            .unwrap()
    }

    #[test]
    fn bytes_are_qemus() {
        // A writable QEMU -drive shows 100-101 and 201 in /proc/locks; a read-only one 100
        // and 201.
        assert_eq!(
            Access::disk(false).bytes().collect::<Vec<_>>(),
            [100, 101, 201]
        );
        assert_eq!(Access::disk(true).bytes().collect::<Vec<_>>(), [100, 201]);
        assert_eq!(Permission::Resize.unshared_byte(), 203);
        assert_eq!(Permission::WriteUnchanged.held_byte(), 102);
    }

    #[test]
    fn locks_are_visible_to_another_open_file_only() {
        let (_d, p) = image();
        let a = open(&p, true);
        let b = open(&p, false);
        assert_eq!(
            lock(&a, &p, Access::disk(false), Locking::On).unwrap(),
            Locked::Held
        );
        for byte in [100, 101, 201] {
            assert!(byte_taken_by_other(&b, byte).unwrap(), "byte {byte}");
            assert!(!byte_taken_by_other(&a, byte).unwrap(), "own byte {byte}");
        }
        for byte in [102, 103, 200, 202, 203] {
            assert!(!byte_taken_by_other(&b, byte).unwrap(), "byte {byte}");
        }
        unlock(&a, Access::disk(false));
        assert!(!byte_taken_by_other(&b, 101).unwrap());
    }

    #[test]
    fn conflicts_name_the_image_and_permission() {
        let (_d, p) = image();
        let a = open(&p, true);
        lock(&a, &p, Access::disk(false), Locking::Auto).unwrap();
        let b = open(&p, true);
        let e = lock(&b, &p, Access::disk(false), Locking::Auto).unwrap_err();
        assert!(
            matches!(
                e,
                LockError::Conflict {
                    permission: Permission::Write,
                    conflict: Conflict::NotShared,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(e.errno(), libc::EAGAIN);
        let text = e.to_string();
        assert!(text.starts_with(&format!("{}: cannot take the \"write\" lock", p.display())));
        assert!(text.contains("locking=off"), "{text}");
        // The refused opener holds nothing afterwards.
        for byte in [100, 101, 201] {
            assert!(!byte_taken_by_other(&a, byte).unwrap(), "byte {byte} left");
        }
        // Off takes nothing and checks nothing.
        assert_eq!(
            lock(&b, &p, Access::disk(false), Locking::Off).unwrap(),
            Locked::Off
        );
    }

    #[test]
    fn a_holder_of_write_refuses_one_that_will_not_share_it() {
        // As qemu-storage-daemon's writable export: holds 100-101, shares everything.
        let (_d, p) = image();
        let a = open(&p, true);
        let sharing_writer = Access {
            held: &[Permission::ConsistentRead, Permission::Write],
            unshared: &[],
        };
        lock(&a, &p, sharing_writer, Locking::On).unwrap();
        let b = open(&p, false);
        let e = lock(&b, &p, Access::disk(true), Locking::On).unwrap_err();
        assert!(
            matches!(
                e,
                LockError::Conflict {
                    permission: Permission::Write,
                    conflict: Conflict::Held,
                    ..
                }
            ),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("cannot take the shared \"write\" lock")
        );
        assert!(e.to_string().contains("open for writing"));
    }

    #[test]
    fn locking_parses_as_qemu_does() {
        assert_eq!("on".parse::<Locking>().unwrap(), Locking::On);
        assert_eq!("off".parse::<Locking>().unwrap(), Locking::Off);
        assert_eq!("auto".parse::<Locking>().unwrap(), Locking::Auto);
        let e = "maybe".parse::<Locking>().unwrap_err();
        assert!(e.contains("\"maybe\""), "{e}");
    }
}
