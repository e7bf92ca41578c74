//! The image a block device serves: a file, read and written through the host page cache or,
//! opened `O_DIRECT`, straight between the storage and the request's memory.
//!
//! **Vectored I/O.** A request's buffers are guest memory the device has translated and pinned;
//! [`Disk::rw_vectored`] hands their host addresses to `preadv` / `pwritev` and steps past
//! partial transfers, so the kernel copies between the file and guest memory with no copy of
//! ours in between.
//!
//! **Many at once.** A driver keeps many requests in flight (Linux: up to the queue's depth);
//! [`Disk::transfer_all`] hands a batch of them to the kernel together through io_uring
//! (`IORING_OP_READV` / `WRITEV`, the `io-uring` crate) and waits for all, so a slow disk
//! serves them side by side instead of one after another. A batch of one, a transfer of more
//! iovecs than one call takes, or a process where io_uring cannot be set up (a seccomp profile
//! forbidding it) goes through `preadv` / `pwritev` as before.
//!
//! **`O_DIRECT` asks for alignment.** Each buffer's address and length must be a multiple of
//! the file's memory alignment, the file offset and length a multiple of its offset alignment
//! (`statx` `STATX_DIOALIGN`; 512 bytes where the file system does not say). A Linux guest
//! submits whole sectors from aligned pages, so its requests go straight through; the virtio
//! specification lets a driver place buffers at any address, so a request whose buffers are not
//! aligned is copied through an [`AlignedBuf`] instead (the caller's choice, after
//! [`Disk::fits`]). The device offers the offset alignment as its block size (`blk_size`), so a
//! guest never sends an offset the file cannot take; one that does anyway gets `IOERR`.

use std::alloc::Layout;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::error::{Error, Result};

/// What `O_DIRECT` needs of a transfer, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Align {
    /// Buffer addresses and lengths.
    pub memory: u64,
    /// File offsets and transfer lengths.
    pub offset: u64,
}

/// The image file and how it was opened.
pub struct Disk {
    file: File,
    direct: Option<Align>,
    /// The io_uring batches go through, made on first use; `None` after it could not be.
    ring: Option<Option<io_uring::IoUring>>,
}

impl std::fmt::Debug for Disk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disk")
            .field("file", &self.file)
            .field("direct", &self.direct)
            .finish()
    }
}

/// Reads and writes in flight at once: the size of the io_uring, and of a batch.
pub const IN_FLIGHT: usize = 64;

/// One transfer of a batch: iovecs naming its memory, the file offset, and whether it reads
/// the file (into the memory) or writes it.
pub struct Transfer<'a> {
    pub iov: &'a mut Vec<libc::iovec>,
    pub offset: u64,
    pub read: bool,
}

/// iovecs per system call (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

impl Disk {
    /// The image behind `file`; whether it bypasses the page cache is read from the file's own
    /// flags (`O_DIRECT`), and its alignment from `statx`.
    pub fn new(file: File) -> Result<Disk> {
        // SAFETY: F_GETFL only reads the flags of a descriptor we own.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(Error::Os {
                op: "read the disk image's flags",
                source: std::io::Error::last_os_error(),
            });
        }
        let direct = (flags & libc::O_DIRECT != 0).then(|| dio_align(&file));
        Ok(Disk {
            file,
            direct,
            ring: None,
        })
    }

    /// The alignment `O_DIRECT` needs, if the image was opened so.
    pub fn direct(&self) -> Option<Align> {
        self.direct
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Bytes in the image.
    pub fn len(&self) -> Result<u64> {
        Ok(self
            .file
            .metadata()
            .map_err(|source| Error::Os {
                op: "stat the disk image",
                source,
            })?
            .len())
    }

    /// Whether the image is empty.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Whether `len` bytes at byte `offset` from buffers `iov` can go to the file as they are:
    /// always through the page cache; with `O_DIRECT`, when every piece is aligned.
    pub fn fits(&self, iov: &[libc::iovec], offset: u64, len: u64) -> bool {
        let Some(a) = self.direct else {
            return true;
        };
        offset % a.offset == 0
            && len % a.offset == 0
            && iov
                .iter()
                .all(|v| v.iov_base as u64 % a.memory == 0 && v.iov_len as u64 % a.memory == 0)
    }

    /// Moves data between the file at byte `offset` and the buffers `iov` (file to buffers if
    /// `read`), in calls of at most `IOV_MAX` buffers; returns the bytes moved, which is all of
    /// them unless the file ends first (then EIO). `iov` is consumed: its entries are advanced.
    ///
    /// # Safety
    /// Every entry of `iov` must name memory that stays mapped, with the access the transfer
    /// needs, for the whole call, and that no Rust reference covers.
    pub unsafe fn rw_vectored(
        &self,
        iov: &mut [libc::iovec],
        offset: u64,
        read: bool,
    ) -> Result<u64> {
        let mut done: u64 = 0;
        let mut start = 0usize;
        while start < iov.len() {
            let off = (offset + done) as libc::off_t;
            let count = (iov.len() - start).min(IOV_MAX) as libc::c_int;
            // SAFETY: the caller vouches for every iovec; the kernel copies between the file
            // and those addresses.
            let r = unsafe {
                let v = iov[start..].as_ptr();
                if read {
                    libc::preadv(self.file.as_raw_fd(), v, count, off)
                } else {
                    libc::pwritev(self.file.as_raw_fd(), v, count, off)
                }
            };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Os {
                    op: if read { "preadv" } else { "pwritev" },
                    source: e,
                });
            }
            if r == 0 {
                return Err(Error::Os {
                    op: if read { "preadv" } else { "pwritev" },
                    source: std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!("the image ended at byte {off} during a transfer"),
                    ),
                });
            }
            done += r as u64;
            // Step past what the call moved: whole iovecs, then part of one.
            let mut left = r as usize;
            while left > 0 {
                let e = &mut iov[start];
                if left >= e.iov_len {
                    left -= e.iov_len;
                    start += 1;
                } else {
                    // SAFETY: left < iov_len: the pointer stays inside the segment.
                    e.iov_base = unsafe { e.iov_base.cast::<u8>().add(left).cast() };
                    e.iov_len -= left;
                    left = 0;
                }
            }
        }
        Ok(done)
    }

    /// Carries out every transfer of `jobs` (at most [`IN_FLIGHT`]) and returns, in the same
    /// order, the bytes each moved (all of them) or why it failed. With more than one, they go
    /// to the kernel together through io_uring and this waits for every completion before it
    /// returns; a short transfer is finished with `preadv` / `pwritev`.
    ///
    /// # Safety
    /// As [`Disk::rw_vectored`], for every transfer, until this returns.
    pub unsafe fn transfer_all(&mut self, jobs: &mut [Transfer]) -> Vec<Result<u64>> {
        let mut moved: Vec<Option<Result<u64>>> = (0..jobs.len()).map(|_| None).collect();
        if jobs.len() > 1 {
            let fd = io_uring::types::Fd(self.file.as_raw_fd());
            if let Some(ring) = self.ring() {
                let mut queued = 0;
                for (i, j) in jobs.iter().enumerate().take(IN_FLIGHT) {
                    if j.iov.len() > IOV_MAX {
                        continue;
                    }
                    let n = j.iov.len() as u32;
                    let entry = if j.read {
                        io_uring::opcode::Readv::new(fd, j.iov.as_ptr(), n)
                            .offset(j.offset)
                            .build()
                    } else {
                        io_uring::opcode::Writev::new(fd, j.iov.as_ptr(), n)
                            .offset(j.offset)
                            .build()
                    };
                    // SAFETY: the entry names iovecs that live in `jobs` until this function
                    // returns, which is after every completion was reaped below; the memory
                    // they name is the caller's promise.
                    if unsafe { ring.submission().push(&entry.user_data(i as u64)) }.is_err() {
                        break;
                    }
                    queued += 1;
                }
                reap(ring, queued, &mut moved, jobs);
            }
        }
        let mut out = Vec::with_capacity(jobs.len());
        for (j, m) in jobs.iter_mut().zip(moved) {
            let want: u64 = j.iov.iter().map(|v| v.iov_len as u64).sum();
            let result = match m {
                // Not taken by io_uring: at once.
                // SAFETY: the caller's promise for this transfer's memory.
                None => unsafe { self.rw_vectored(j.iov, j.offset, j.read) },
                Some(Ok(n)) if n < want => {
                    advance(j.iov, n as usize);
                    // SAFETY: as above, for the rest of the same memory.
                    unsafe { self.rw_vectored(j.iov, j.offset + n, j.read) }.map(|m| n + m)
                }
                Some(r) => r,
            };
            out.push(result);
        }
        out
    }

    /// The io_uring, made on first use; `None` (said once in the log) where it cannot be.
    fn ring(&mut self) -> Option<&mut io_uring::IoUring> {
        self.ring
            .get_or_insert_with(|| match io_uring::IoUring::new(IN_FLIGHT as u32) {
                Ok(r) => Some(r),
                Err(e) => {
                    log::warn!(
                        "blk: io_uring cannot be set up ({e}): requests are carried out one \
                         after another"
                    );
                    None
                }
            })
            .as_mut()
    }

    /// Reads `buf.len()` bytes at `offset` into memory of our own (a bounce buffer).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|source| Error::Os {
                op: "read the disk image",
                source,
            })
    }

    /// Writes `buf` at `offset` from memory of our own (a bounce buffer).
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.file
            .write_all_at(buf, offset)
            .map_err(|source| Error::Os {
                op: "write the disk image",
                source,
            })
    }

    /// Punches a hole over `len` bytes at `offset` (`DISCARD`): the file system may free the
    /// blocks, and the range reads as zeros. A file system that cannot punch holes ignores it:
    /// a discard is a hint.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        match self.fallocate(
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset,
            len,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r.map_err(|source| Error::Os {
                op: "punch a hole in the disk image (discard)",
                source,
            }),
        }
    }

    /// Zeroes `len` bytes at `offset` (`WRITE_ZEROES`): a hole where `unmap` allows it, else
    /// the file system's zero range; where neither is supported, zeros are written.
    pub fn zero(&self, offset: u64, len: u64, unmap: bool) -> Result<()> {
        let mode = if unmap {
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
        } else {
            libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
        };
        match self.fallocate(mode, offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => self.write_zeros(offset, len),
            Err(source) => Err(Error::Os {
                op: "zero a range of the disk image (write zeroes)",
                source,
            }),
        }
    }

    fn fallocate(&self, mode: libc::c_int, offset: u64, len: u64) -> std::io::Result<()> {
        loop {
            // SAFETY: fallocate on our own descriptor; no memory is passed.
            let r = unsafe {
                libc::fallocate(
                    self.file.as_raw_fd(),
                    mode,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            };
            if r == 0 {
                return Ok(());
            }
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }

    /// Writes zeros over the range, 1 MiB at a time, from an aligned buffer (so `O_DIRECT`
    /// takes it).
    fn write_zeros(&self, offset: u64, len: u64) -> Result<()> {
        const STEP: u64 = 1 << 20;
        let mut buf = AlignedBuf::new(STEP as usize, 4096)
            .ok_or_else(|| Error::Invalid("cannot allocate a 1 MiB buffer of zeros".into()))?;
        let zeros = buf.as_mut_slice();
        let mut done = 0;
        while done < len {
            let n = (len - done).min(STEP);
            self.write_at(&zeros[..n as usize], offset + done)?;
            done += n;
        }
        Ok(())
    }

    /// `fdatasync`.
    pub fn sync_data(&self) -> Result<()> {
        self.file.sync_data().map_err(|source| Error::Os {
            op: "fdatasync the disk image",
            source,
        })
    }
}

/// Waits for `queued` completions on `ring` and records each in `moved` at its job's index.
/// The kernel owns the jobs' memory until then, so this does not give up: an error of the wait
/// itself (never seen; EINTR is the one expected) is logged and the wait tried again.
fn reap(
    ring: &mut io_uring::IoUring,
    queued: usize,
    moved: &mut [Option<Result<u64>>],
    jobs: &[Transfer],
) {
    let mut reaped = 0;
    while reaped < queued {
        if let Err(e) = ring.submit_and_wait(queued - reaped) {
            if e.kind() != std::io::ErrorKind::Interrupted {
                log::error!("blk: waiting for io_uring completions: {e}; waiting again");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            continue;
        }
        for cqe in ring.completion() {
            let i = cqe.user_data() as usize;
            let r = cqe.result();
            moved[i] = Some(if r < 0 {
                Err(Error::Os {
                    op: if jobs[i].read {
                        "preadv (io_uring)"
                    } else {
                        "pwritev (io_uring)"
                    },
                    source: std::io::Error::from_raw_os_error(-r),
                })
            } else {
                Ok(r as u64)
            });
            reaped += 1;
        }
    }
}

/// Steps `iov` past `n` bytes: whole entries go, then part of one.
fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
    let whole = iov
        .iter()
        .take_while(|v| {
            let all = n >= v.iov_len;
            if all {
                n -= v.iov_len;
            }
            all
        })
        .count();
    iov.drain(..whole);
    if n > 0 {
        let v = &mut iov[0];
        // SAFETY: n < iov_len: the pointer stays inside the segment.
        v.iov_base = unsafe { v.iov_base.cast::<u8>().add(n).cast() };
        v.iov_len -= n;
    }
}

/// The file's `O_DIRECT` alignment from `statx` (`STATX_DIOALIGN`, Linux 6.1), or 512 bytes
/// for both where the kernel or file system does not report it.
fn dio_align(file: &File) -> Align {
    let fallback = Align {
        memory: 512,
        offset: 512,
    };
    // SAFETY: an all-zero statx is a valid value for the kernel to fill in.
    let mut st: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: statx of our own descriptor (empty path, AT_EMPTY_PATH) writes only into `st`.
    let r = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            libc::STATX_DIOALIGN,
            &mut st,
        )
    };
    if r != 0 || st.stx_mask & libc::STATX_DIOALIGN == 0 || st.stx_dio_offset_align == 0 {
        return fallback;
    }
    Align {
        memory: u64::from(st.stx_dio_mem_align).max(1),
        offset: u64::from(st.stx_dio_offset_align),
    }
}

/// A buffer of our own memory at a chosen alignment, for `O_DIRECT` transfers whose guest
/// buffers are not aligned.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: Layout,
}

impl AlignedBuf {
    /// `len` zeroed bytes aligned to `align` (a power of two); `None` if that is no layout or
    /// the allocation fails.
    pub fn new(len: usize, align: usize) -> Option<AlignedBuf> {
        let layout = Layout::from_size_align(len.max(1), align).ok()?;
        // SAFETY: the layout has a non-zero size.
        let ptr = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, layout })
    }

    /// The bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: our own allocation of layout.size() initialised bytes, borrowed mutably
        // through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout and not freed before.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
