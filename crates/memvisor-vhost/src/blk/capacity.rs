//! A blk device's capacity, which may change while it serves (`blk-resize`).
//!
//! **Model.** The capacity lives in one shared cell, [`BlkCapacity`], which the device, its
//! queue workers and the server's control thread all hold. The control thread resizes: it
//! grows or shrinks a file image (`set_len`), or reads the size again (a block device resized
//! on the host, a file another program changed), and stores the new count of sectors. The
//! device reads the cell for every range check and for its config space, so a request past the
//! new end is refused (`IOERR`) as any out-of-range request is, and `GET_CONFIG` shows the new
//! `capacity`. The cell also carries a "changed" mark the back end's serving loop takes
//! ([`crate::Device::config_changed`]), which makes the back end send
//! `VHOST_USER_BACKEND_CONFIG_CHANGE_MSG` on the back-end channel (the path the balloon's target
//! takes), and a count of marks taken, so the control thread can wait until the back end has
//! acted on its change.

use std::fs::File;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};

use super::SECTOR;
use crate::error::{Error, Result};

/// A blk device's capacity, shared by the device, its workers and whoever resizes it.
/// Cloning shares it.
#[derive(Clone, Debug)]
pub struct BlkCapacity(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// The image (a second descriptor of the device's open file).
    file: File,
    /// The image is a host block device (its size is its own: it is read, never set).
    block_device: bool,
    /// Served read-only: the image's size is not changed.
    read_only: bool,
    /// A size must be a multiple of this (the device's `blk_size`, at least a sector).
    block_size: u64,
    /// Whole sectors the device serves.
    sectors: AtomicU64,
    /// Changed since the back end last asked.
    changed: AtomicBool,
    /// Changes the back end has taken.
    taken: AtomicU64,
    /// One resize at a time.
    resizing: Mutex<()>,
}

/// What a resize did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resized {
    /// Bytes the device serves now (whole sectors of the image).
    pub size: u64,
    /// Bytes it served before.
    pub before: u64,
}

impl BlkCapacity {
    pub(super) fn new(
        file: File,
        block_device: bool,
        read_only: bool,
        block_size: u64,
        bytes: u64,
    ) -> BlkCapacity {
        BlkCapacity(Arc::new(Inner {
            file,
            block_device,
            read_only,
            block_size: block_size.max(SECTOR),
            sectors: AtomicU64::new(bytes / SECTOR),
            changed: AtomicBool::new(false),
            taken: AtomicU64::new(0),
            resizing: Mutex::new(()),
        }))
    }

    /// Whole sectors served now.
    pub fn sectors(&self) -> u64 {
        self.0.sectors.load(SeqCst)
    }

    /// Bytes served now.
    pub fn bytes(&self) -> u64 {
        self.sectors() * SECTOR
    }

    /// Whether the image is a host block device.
    pub fn is_block_device(&self) -> bool {
        self.0.block_device
    }

    /// Changes the capacity: a file image is set to `size` bytes (grown with a hole, or cut);
    /// with no `size` (and for a block device, whose `size` may only be the size it has) the
    /// image's size is read again. The device serves the image's whole sectors from here on and
    /// the change is marked for the back end to tell its frontend. A `size` of 0, not a multiple
    /// of the device's block, or on a read-only device, is refused with the value named, and
    /// nothing changes.
    pub fn resize(&self, size: Option<u64>) -> Result<Resized> {
        let i = &self.0;
        let _one = i.resizing.lock().unwrap_or_else(|e| e.into_inner());
        let before = self.bytes();
        if let Some(s) = size {
            if s == 0 || s % i.block_size != 0 {
                return Err(Error::Invalid(format!(
                    "size {s}: a disk's size is a whole, non-zero number of its {}-byte blocks",
                    i.block_size
                )));
            }
            if i.block_device {
                let now = self.read_len()?;
                if s != now {
                    return Err(Error::Invalid(format!(
                        "size {s}: the image is a block device of {now} bytes, whose size is \
                         changed on the host (e.g. lvextend); then send blk-resize without a size"
                    )));
                }
            } else if s != before || s != self.read_len()? {
                if i.read_only {
                    return Err(Error::Invalid(format!(
                        "size {s}: the device is read-only; its image is not resized"
                    )));
                }
                i.file.set_len(s).map_err(|source| Error::Os {
                    op: "resize the disk image",
                    source,
                })?;
            }
        }
        let len = self.read_len()?;
        i.sectors.store(len / SECTOR, SeqCst);
        i.changed.store(true, SeqCst);
        Ok(Resized {
            size: self.bytes(),
            before,
        })
    }

    /// The image's length now.
    fn read_len(&self) -> Result<u64> {
        crate::disk::image_len(&self.0.file, self.0.block_device)
    }

    /// How many changes the back end has taken so far (its serving loop takes each once); a
    /// resizer reads it before, and waits for it to move.
    pub fn changes_taken(&self) -> u64 {
        self.0.taken.load(SeqCst)
    }

    /// Whether the capacity changed since the last call (the back end then tells the frontend).
    pub(super) fn take_change(&self) -> bool {
        let changed = self.0.changed.swap(false, SeqCst);
        if changed {
            self.0.taken.fetch_add(1, SeqCst);
        }
        changed
    }

    /// Forgets a change no frontend is there to hear (the device was reset).
    pub(super) fn forget_change(&self) {
        if self.0.changed.swap(false, SeqCst) {
            self.0.taken.fetch_add(1, SeqCst);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(len: u64) -> (tempfile_path::Path, File) {
        let p = tempfile_path::Path::new();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&p.0)
            .unwrap();
        f.set_len(len).unwrap();
        (p, f)
    }

    mod tempfile_path {
        pub struct Path(pub std::path::PathBuf);
        impl Path {
            pub fn new() -> Path {
                use std::sync::atomic::{AtomicU32, Ordering};
                static N: AtomicU32 = AtomicU32::new(0);
                let n = N.fetch_add(1, Ordering::Relaxed);
                Path(
                    std::env::temp_dir()
                        .join(format!("memvisor-capacity-{}-{n}.img", std::process::id())),
                )
            }
        }
        impl Drop for Path {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
    }

    #[test]
    fn a_file_grows_and_shrinks_and_the_change_is_marked_once() {
        let (p, f) = image(1 << 20);
        let c = BlkCapacity::new(f, false, false, 512, 1 << 20);
        assert!(!c.take_change());
        let r = c.resize(Some(3 << 20)).unwrap();
        assert_eq!((r.before, r.size), (1 << 20, 3 << 20));
        assert_eq!(std::fs::metadata(&p.0).unwrap().len(), 3 << 20);
        assert_eq!(c.sectors(), (3 << 20) / 512);
        assert!(c.take_change());
        assert!(!c.take_change());
        assert_eq!(c.changes_taken(), 1);
        c.resize(Some(4096)).unwrap();
        assert_eq!(std::fs::metadata(&p.0).unwrap().len(), 4096);
        assert_eq!(c.bytes(), 4096);
    }

    #[test]
    fn bad_sizes_are_refused_by_value_and_change_nothing() {
        let (p, f) = image(1 << 20);
        let c = BlkCapacity::new(f, false, false, 4096, 1 << 20);
        for bad in [0, 1000, 4096 + 512] {
            let e = c.resize(Some(bad)).unwrap_err().to_string();
            assert!(e.contains(&format!("size {bad}")), "{e}");
        }
        assert_eq!(std::fs::metadata(&p.0).unwrap().len(), 1 << 20);
        assert!(!c.take_change());
        let (_q, g) = image(1 << 20);
        let ro = BlkCapacity::new(g, false, true, 512, 1 << 20);
        let e = ro.resize(Some(2 << 20)).unwrap_err().to_string();
        assert!(e.contains("read-only"), "{e}");
    }

    #[test]
    fn without_a_size_the_length_is_read_again_in_whole_sectors() {
        let (p, f) = image(1 << 20);
        let c = BlkCapacity::new(f, false, false, 512, 1 << 20);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p.0)
            .unwrap()
            .set_len((2 << 20) + 100)
            .unwrap();
        let r = c.resize(None).unwrap();
        assert_eq!(r.size, 2 << 20);
        assert!(c.take_change());
    }
}
