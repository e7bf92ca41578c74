//! The image a block device serves: a file or a host block device, read and written through
//! the host page cache or, opened `O_DIRECT`, straight between the storage and the request's
//! memory.
//!
//! **A block device** (an LVM volume, an NVMe namespace, a partition, a loop device) is served
//! like a file, with what [`crate::blockdev`] reads from the kernel: its size (`BLKGETSIZE64`;
//! `fstat` says 0), its logical block size as the smallest unit of a request
//! ([`Disk::block_size`]), its physical block size, alignment and I/O hints
//! ([`Disk::topology`]), and what it can do with a range ([`Disk::discard_limits`],
//! [`Disk::write_zeroes_max`]). A discard goes to the device with `BLKDISCARD` (a file's punches
//! a hole); zeroing goes through `fallocate` for both.
//!
//! **Vectored I/O.** A request's buffers are guest memory the device has translated and pinned;
//! [`Disk::rw_vectored`] hands their host addresses to `preadv` / `pwritev` and steps past
//! partial transfers, so the kernel copies between the file and guest memory with no copy of
//! ours in between.
//!
//! **Many at once.** A driver keeps many requests in flight (Linux: up to the queue's depth);
//! [`Disk::start`] hands each to the kernel through io_uring (`IORING_OP_READV` / `WRITEV`, the
//! `io-uring` crate) without waiting, [`Disk::submit`] passes all started together in one system
//! call, and [`Disk::finished`] returns those that have ended, in the order they end — so a slow
//! disk serves them side by side, and the device takes new requests while older ones are out.
//! The io_uring signals an eventfd ([`Disk::completion_fd`]) for the serving loop to wait on.
//!
//! **One thread per ring.** A ring is made on the first transfer, on the thread that serves the
//! queue, and only that thread enters it: it is set up `IORING_SETUP_SINGLE_ISSUER |
//! DEFER_TASKRUN` (Linux 6.1), so the kernel finishes transfers only when that thread asks,
//! with no interrupt of it meanwhile; a kernel that refuses (EINVAL) gets `COOP_TASKRUN`, then no
//! flag ([`RingSetup`], [`Disk::ring_setup`], said once in the log). With `DEFER_TASKRUN`
//! a completion lands in the completion queue only on an `io_uring_enter` with `GETEVENTS`;
//! the eventfd is still signalled when one is due (Linux's "signal registered eventfd to
//! process deferred task work", 2022), so [`Disk::finished`] clears the eventfd and then always
//! enters with `GETEVENTS` while transfers are out: one cleared without that enter would never
//! fire again for work already queued, a lost wake-up. A `Disk` that moves to another thread
//! with nothing out makes a new ring there; with transfers out it cannot reap them from
//! there (the kernel refuses with EEXIST), so the thread that started them ends them first
//! (a queue worker drains at exit).
//! A transfer of more iovecs than one call takes, or a process where io_uring cannot be set up
//! (a seccomp profile forbidding it), goes through `preadv` / `pwritev` at once.
//!
//! **`O_DIRECT` asks for alignment.** Each buffer's address and length must be a multiple of
//! the file's memory alignment, the file offset and length a multiple of its offset alignment
//! (`statx` `STATX_DIOALIGN`; where the kernel does not say — some report 0 for a block
//! device — 512 bytes for a file and the logical block size for a block device). A Linux guest
//! submits whole sectors from aligned pages, so its requests go straight through; the virtio
//! specification lets a driver place buffers at any address, so a request whose buffers are not
//! aligned is copied through an [`AlignedBuf`] instead (the caller's choice, after
//! [`Disk::fits`]). The device offers the offset alignment as its block size (`blk_size`), so a
//! guest never sends an offset the file cannot take; one that does anyway gets `IOERR`.

use std::alloc::Layout;
use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use crate::blockdev::{self, BlockDev};
use crate::error::{Error, Result};

/// Bytes in a virtio-blk sector, the unit of offsets on the wire.
const SECTOR: u64 = 512;

/// What `O_DIRECT` needs of a transfer, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Align {
    /// Buffer addresses and lengths.
    pub memory: u64,
    /// File offsets and transfer lengths.
    pub offset: u64,
}

/// A block device's layout as the guest should see it, in blocks of [`Disk::block_size`]
/// (the virtio-blk topology fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    /// log2 of the blocks in one physical block.
    pub physical_block_exp: u8,
    /// The first block that starts a physical block.
    pub alignment_offset: u8,
    /// Smallest I/O the device prefers, in blocks (0: no hint).
    pub min_io_size: u16,
    /// Largest I/O the device prefers, in blocks (0: no hint).
    pub opt_io_size: u32,
}

impl Topology {
    /// The fields as they lie in the virtio-blk config space (bytes 24..32).
    pub fn config(&self) -> [u8; 8] {
        let mut c = [0u8; 8];
        c[0] = self.physical_block_exp;
        c[1] = self.alignment_offset;
        c[2..4].copy_from_slice(&self.min_io_size.to_le_bytes());
        c[4..8].copy_from_slice(&self.opt_io_size.to_le_bytes());
        c
    }
}

/// How a ring was set up: the io_uring setup flags the kernel took, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingSetup {
    /// `SINGLE_ISSUER | DEFER_TASKRUN | TASKRUN_FLAG`: completions run only when the owner
    /// enters with `GETEVENTS`, which it does only while the kernel says some wait (Linux 6.1).
    DeferTaskrun,
    /// `COOP_TASKRUN`: completions run at the owner's next kernel entry, without interrupting
    /// it (Linux 5.19).
    CoopTaskrun,
    /// No flag.
    Plain,
}

impl RingSetup {
    /// The setups tried in turn, best first.
    pub const ALL: [RingSetup; 3] = [
        RingSetup::DeferTaskrun,
        RingSetup::CoopTaskrun,
        RingSetup::Plain,
    ];

    fn build(self) -> std::io::Result<io_uring::IoUring> {
        let mut b = io_uring::IoUring::builder();
        match self {
            RingSetup::DeferTaskrun => {
                // TASKRUN_FLAG: the kernel raises IORING_SQ_TASKRUN while deferred completions
                // wait to be posted, so `finished` enters only then (Linux 5.19).
                b.setup_single_issuer()
                    .setup_defer_taskrun()
                    .setup_taskrun_flag();
            }
            RingSetup::CoopTaskrun => {
                b.setup_coop_taskrun();
            }
            RingSetup::Plain => {}
        }
        b.build(IN_FLIGHT as u32)
    }
}

impl std::fmt::Display for RingSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RingSetup::DeferTaskrun => "SINGLE_ISSUER|DEFER_TASKRUN",
            RingSetup::CoopTaskrun => "COOP_TASKRUN",
            RingSetup::Plain => "no setup flags",
        })
    }
}

/// The image file and how it was opened.
pub struct Disk {
    file: File,
    /// What the kernel said about it when it is a block device.
    block: Option<BlockDev>,
    direct: Option<Align>,
    /// The io_uring transfers go through, made on first use; `None` after it could not be.
    ring: Option<Option<io_uring::IoUring>>,
    /// The eventfd the io_uring signals when a transfer has ended.
    done_fd: Option<File>,
    /// How the ring was set up, and the thread that made it (the only one that may enter it).
    setup: Option<RingSetup>,
    owner: Option<std::thread::ThreadId>,
    /// The setups to try, best first ([`RingSetup::ALL`]; one alone in tests).
    setups: &'static [RingSetup],
    /// Transfers started and not reaped; of them, queued and not yet submitted.
    in_flight: usize,
    queued: usize,
    /// Rings made so far: a registered-buffer table belongs to the ring it was made on.
    epoch: u64,
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
pub const IN_FLIGHT: usize = 128;

/// iovecs per system call (the kernel's UIO_MAXIOV).
const IOV_MAX: usize = 1024;

impl Disk {
    /// The image behind `file`, a regular file or a block device; whether it bypasses the page
    /// cache is read from the file's own flags (`O_DIRECT`), and its alignment from `statx`.
    pub fn new(file: File) -> Result<Disk> {
        let block = blockdev::probe(&file)?;
        // SAFETY: F_GETFL only reads the flags of a descriptor we own.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        if flags < 0 {
            return Err(Error::Os {
                op: "read the disk image's flags",
                source: std::io::Error::last_os_error(),
            });
        }
        let direct =
            (flags & libc::O_DIRECT != 0).then(|| dio_align(&file, block.map(|b| b.logical)));
        Ok(Disk {
            file,
            block,
            direct,
            ring: None,
            done_fd: None,
            setup: None,
            owner: None,
            setups: &RingSetup::ALL,
            in_flight: 0,
            queued: 0,
            epoch: 0,
        })
    }

    /// How its io_uring was set up; `None` before the first transfer or without io_uring.
    pub fn ring_setup(&self) -> Option<RingSetup> {
        self.setup.filter(|_| matches!(self.ring, Some(Some(_))))
    }

    /// Tries only `setup` when the ring is made (tests: each path, whatever the kernel takes).
    #[cfg(test)]
    pub(crate) fn only_setup(&mut self, setup: &'static [RingSetup]) {
        self.setups = setup;
    }

    /// Whether this thread may enter the ring (it made it, or there is none yet).
    fn on_owner(&self) -> bool {
        self.owner.is_none_or(|t| t == std::thread::current().id())
    }

    /// Whether a transfer is out that only the ring's own thread can reap, and this is not it.
    pub fn stranded(&self) -> bool {
        self.in_flight > 0 && !self.on_owner()
    }

    /// The alignment `O_DIRECT` needs, if the image was opened so.
    pub fn direct(&self) -> Option<Align> {
        self.direct
    }

    /// The file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// What the kernel said about the block device, if the image is one.
    pub fn block_device(&self) -> Option<&BlockDev> {
        self.block.as_ref()
    }

    /// The smallest unit of a request's offset and length, in bytes: a block device's logical
    /// block size, the `O_DIRECT` offset alignment, and never less than a 512-byte sector. The
    /// device offers it as its `blk_size`.
    pub fn block_size(&self) -> u64 {
        let logical = self.block.map_or(SECTOR, |b| u64::from(b.logical));
        let direct = self.direct.map_or(SECTOR, |a| a.offset);
        logical.max(direct).max(SECTOR)
    }

    /// A block device's physical block size, alignment and I/O hints in blocks of
    /// [`Disk::block_size`] (each clamped to its virtio field); `None` for a file.
    pub fn topology(&self) -> Option<Topology> {
        let b = self.block?;
        let block = self.block_size();
        let blocks = |bytes: u32| u64::from(bytes) / block;
        let per_physical = blocks(b.physical).max(1);
        Some(Topology {
            physical_block_exp: per_physical.ilog2() as u8,
            alignment_offset: blocks(b.alignment_offset).min(u64::from(u8::MAX)) as u8,
            min_io_size: blocks(b.io_min).min(u64::from(u16::MAX)) as u16,
            opt_io_size: blocks(b.io_opt).min(u64::from(u32::MAX)) as u32,
        })
    }

    /// Whether a discard can do anything, and if so its limits: (most bytes in one, the unit
    /// the storage discards in). A file may always be asked (a file system that cannot punch
    /// holes ignores it); a block device only when the kernel says it discards.
    pub fn discard_limits(&self) -> Option<(u64, u64)> {
        match self.block {
            None => Some((u64::MAX, self.block_size())),
            Some(b) if b.discard_max > 0 => {
                Some((b.discard_max, b.discard_granularity.max(self.block_size())))
            }
            Some(_) => None,
        }
    }

    /// Most bytes one zeroing may cover: a block device's own limit where it has a zeroing
    /// command; otherwise no limit of the storage's (the kernel, or [`Disk::zero`], writes
    /// zeros).
    pub fn write_zeroes_max(&self) -> u64 {
        match self.block {
            Some(b) if b.write_zeroes_max > 0 => b.write_zeroes_max,
            _ => u64::MAX,
        }
    }

    /// Bytes in the image: a file's length, a block device's size.
    pub fn len(&self) -> Result<u64> {
        image_len(&self.file, self.block.is_some())
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
                return Err(image_ended(
                    if read { "preadv" } else { "pwritev" },
                    offset + done,
                ));
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

    /// Hands a transfer to the kernel and returns at once (io_uring `IORING_OP_READV` /
    /// `WRITEV`, queued until [`Disk::submit`]); its end comes back from [`Disk::finished`]
    /// with `key`. `false` when it cannot go this way — io_uring unavailable, more than
    /// `IOV_MAX` buffers, [`IN_FLIGHT`] already out — and the caller does it at once with
    /// [`Disk::rw_vectored`].
    ///
    /// # Safety
    /// As [`Disk::rw_vectored`], until the transfer comes back from [`Disk::finished`]; and
    /// `iov`'s entries themselves must stay where they are (the kernel reads them when it
    /// starts the transfer).
    pub unsafe fn start(&mut self, iov: &[libc::iovec], offset: u64, read: bool, key: u64) -> bool {
        if iov.len() > IOV_MAX || iov.is_empty() || self.in_flight >= IN_FLIGHT {
            return false;
        }
        let fd = io_uring::types::Fd(self.file.as_raw_fd());
        let Some(ring) = self.ring() else {
            return false;
        };
        let n = iov.len() as u32;
        let entry = if read {
            io_uring::opcode::Readv::new(fd, iov.as_ptr(), n)
                .offset(offset)
                .build()
        } else {
            io_uring::opcode::Writev::new(fd, iov.as_ptr(), n)
                .offset(offset)
                .build()
        }
        .user_data(key);
        // SAFETY: the caller keeps the iovecs and the memory they name until the completion is
        // reaped.
        let ok = unsafe { ring.submission().push(&entry) }.is_ok();
        self.in_flight += usize::from(ok);
        self.queued += usize::from(ok);
        ok
    }

    /// Which ring this thread would use (made now if it is not yet, or made again if the
    /// `Disk` moved to this thread with nothing out): a number that changes with every new
    /// ring, whose registered buffers start empty. `None` without io_uring.
    pub fn ring_epoch(&mut self) -> Option<u64> {
        self.ring()?;
        Some(self.epoch)
    }

    /// Makes the ring's registered-buffer table: `slots` empty slots (sparse), filled one
    /// chunk at a time by [`Disk::register_fixed`]. Only on the ring's thread.
    pub fn fixed_table(&mut self, slots: u32) -> std::io::Result<()> {
        let ring = self
            .ring()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
        ring.submitter().register_buffers_sparse(slots)
    }

    /// Registers host bytes `[base, base + len)` as buffer `slot` (the kernel pins them,
    /// charged to RLIMIT_MEMLOCK without CAP_IPC_LOCK).
    ///
    /// # Safety
    /// The range must stay mapped until [`Disk::clear_fixed`] of the slot or the ring's end.
    pub unsafe fn register_fixed(&mut self, slot: u32, base: u64, len: u64) -> std::io::Result<()> {
        let ring = self
            .ring()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
        let iov = [libc::iovec {
            iov_base: base as usize as *mut libc::c_void,
            iov_len: len as usize,
        }];
        // SAFETY: the caller keeps the range mapped while it is registered.
        unsafe { ring.submitter().register_buffers_update(slot, &iov, None) }
    }

    /// Empties buffer `slot`; the kernel unpins its pages once no transfer uses them.
    pub fn clear_fixed(&mut self, slot: u32) -> std::io::Result<()> {
        let ring = self
            .ring()
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
        let iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }];
        // SAFETY: an empty entry names no memory.
        unsafe { ring.submitter().register_buffers_update(slot, &iov, None) }
    }

    /// As [`Disk::start`], through registered buffer `slot`, in which every entry of `iov`
    /// lies (`READ_FIXED` / `WRITE_FIXED` for one entry, `READV_FIXED` / `WRITEV_FIXED`, Linux
    /// 6.15, for more): the kernel pins nothing per transfer.
    ///
    /// # Safety
    /// As [`Disk::start`]; and `slot` registered over memory holding every entry of `iov`.
    pub unsafe fn start_fixed(
        &mut self,
        iov: &[libc::iovec],
        offset: u64,
        read: bool,
        key: u64,
        slot: u16,
    ) -> bool {
        if iov.len() > IOV_MAX || iov.is_empty() || self.in_flight >= IN_FLIGHT {
            return false;
        }
        let fd = io_uring::types::Fd(self.file.as_raw_fd());
        let Some(ring) = self.ring() else {
            return false;
        };
        let n = iov.len() as u32;
        use io_uring::opcode::{ReadFixed, ReadvFixed, WriteFixed, WritevFixed};
        let entry = match (iov.len(), read) {
            (1, true) => ReadFixed::new(fd, iov[0].iov_base.cast(), iov[0].iov_len as u32, slot)
                .offset(offset)
                .build(),
            (1, false) => WriteFixed::new(fd, iov[0].iov_base.cast(), iov[0].iov_len as u32, slot)
                .offset(offset)
                .build(),
            (_, true) => ReadvFixed::new(fd, iov.as_ptr(), n, slot)
                .offset(offset)
                .build(),
            (_, false) => WritevFixed::new(fd, iov.as_ptr(), n, slot)
                .offset(offset)
                .build(),
        }
        .user_data(key);
        // SAFETY: as `start`.
        let ok = unsafe { ring.submission().push(&entry) }.is_ok();
        self.in_flight += usize::from(ok);
        self.queued += usize::from(ok);
        ok
    }

    /// One transfer through registered buffer `slot` carried out at once, as
    /// [`Disk::rw_vectored`] does for a lone request: started on the ring and waited for.
    /// Returns the bytes moved (possibly short: the caller goes on from there). `None` when it
    /// cannot go this way (other transfers out, no ring), nothing having moved.
    ///
    /// # Safety
    /// As [`Disk::start_fixed`], for the length of this call.
    pub unsafe fn rw_fixed_now(
        &mut self,
        iov: &[libc::iovec],
        offset: u64,
        read: bool,
        slot: u16,
    ) -> Option<Result<u64>> {
        const KEY: u64 = u64::MAX;
        // SAFETY: the caller's contract, and the transfer is reaped below before returning.
        if self.in_flight > 0 || !unsafe { self.start_fixed(iov, offset, read, KEY, slot) } {
            return None;
        }
        loop {
            for (key, r) in self.finished(true) {
                if key == KEY {
                    return Some(r);
                }
                log::error!("blk: a transfer ended under key {key} while none other was out");
            }
        }
    }

    /// Another handle on the completion eventfd: a write to it wakes the ring's thread (a
    /// discard asking it to give registered memory up).
    pub fn waker(&self) -> Option<File> {
        self.done_fd.as_ref()?.try_clone().ok()
    }

    /// Passes the transfers [`Disk::start`] queued to the kernel (one system call for all);
    /// returns how many went.
    pub fn submit(&mut self) -> usize {
        let queued = std::mem::take(&mut self.queued);
        if queued == 0 {
            return 0;
        }
        if !self.on_owner() {
            log::error!("blk: io_uring submit from a thread other than the ring's; not done");
            self.queued = queued;
            return 0;
        }
        if let Some(Some(ring)) = self.ring.as_mut() {
            while let Err(e) = ring.submit() {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    // EBUSY (completions to reap first) or worse: the entries stay queued and
                    // go with the next submit, which `finished` makes.
                    log::debug!("blk: io_uring submit: {e}");
                    self.queued = queued;
                    return 0;
                }
            }
        }
        queued
    }

    /// Transfers started and not yet come back.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The descriptor that becomes readable when a transfer has ended (an eventfd registered
    /// with the io_uring); `None` before the first transfer, or without io_uring.
    pub fn completion_fd(&self) -> Option<std::os::fd::RawFd> {
        self.ring.as_ref()?.as_ref()?;
        self.done_fd.as_ref().map(|f| f.as_raw_fd())
    }

    /// Transfers that have ended, with their keys: the bytes each moved (a short count is for
    /// the caller to go on from) or why it failed. With `wait`, blocks until at least one has
    /// ended if any is out. The kernel owns a transfer's memory until it comes back here, so a
    /// wait does not give up: an error of the wait itself (EINTR is the one expected) is
    /// logged and the wait tried again.
    pub fn finished(&mut self, wait: bool) -> Vec<(u64, Result<u64>)> {
        let mut out = Vec::new();
        self.finished_into(wait, &mut out);
        out
    }

    /// [`Disk::finished`] into `out` (emptied first), which the caller keeps between calls.
    pub fn finished_into(&mut self, wait: bool, out: &mut Vec<(u64, Result<u64>)>) {
        out.clear();
        if self.in_flight > 0 && !self.on_owner() {
            log::error!(
                "blk: {} transfers out on another thread's io_uring cannot be reaped here",
                self.in_flight
            );
            return;
        }
        if let Some(f) = self.done_fd.as_ref() {
            let mut b = [0u8; 8];
            // Cleared before the completions are read: one that lands after it signals again.
            let _ = (&*f).read(&mut b);
        }
        let queued = std::mem::take(&mut self.queued);
        let in_flight = self.in_flight;
        let deferred = self.setup == Some(RingSetup::DeferTaskrun);
        let Some(Some(ring)) = self.ring.as_mut() else {
            return;
        };
        loop {
            let want = usize::from(wait && out.is_empty() && in_flight > 0);
            // Deferred completions are posted only by an enter with GETEVENTS; the kernel
            // raises IORING_SQ_TASKRUN (TASKRUN_FLAG) as soon as one waits, so a look that
            // finds it down and nothing to submit enters not at all: one system call per
            // completion batch rather than one per look (a polling loop looks often).
            let pending = ring.submission().taskrun();
            let entered = if deferred && in_flight > 0 && want == 0 && !pending && queued == 0 {
                None
            } else if deferred && in_flight > 0 && want == 0 {
                // Enter with GETEVENTS, waiting for none, submitting what is queued.
                let to_submit = ring.submission().len() as u32;
                // SAFETY: no argument is passed; the entries queued are the caller's, kept
                // valid until reaped (`start`'s contract).
                Some(unsafe {
                    ring.submitter().enter::<libc::sigset_t>(
                        to_submit,
                        0,
                        io_uring::EnterFlags::GETEVENTS.bits(),
                        None,
                    )
                })
            } else if queued > 0 || want > 0 {
                Some(ring.submit_and_wait(want))
            } else {
                None
            };
            if let Some(Err(e)) = entered {
                if e.kind() != std::io::ErrorKind::Interrupted {
                    log::error!("blk: waiting for io_uring completions: {e}; waiting again");
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                continue;
            }
            for cqe in ring.completion() {
                let r = cqe.result();
                out.push((
                    cqe.user_data(),
                    if r < 0 {
                        Err(Error::Os {
                            op: "read or write (io_uring)",
                            source: std::io::Error::from_raw_os_error(-r),
                        })
                    } else {
                        Ok(r as u64)
                    },
                ));
            }
            if !(wait && out.is_empty() && in_flight > 0) {
                break;
            }
        }
        self.in_flight -= out.len();
    }

    /// The io_uring, made on first use on this thread with an eventfd for its completions, with
    /// the best setup the kernel takes; made again if the `Disk` moved to another thread with
    /// nothing out. `None` (said once in the log) where it cannot be made, or on a thread that
    /// is not its own while transfers are out.
    fn ring(&mut self) -> Option<&mut io_uring::IoUring> {
        if matches!(self.ring, Some(Some(_))) && !self.on_owner() {
            if self.in_flight > 0 || self.queued > 0 {
                return None;
            }
            // The new ring is made before the old one closes, so its eventfd has another
            // number and a watcher keyed by the number (the throttle's) sees the change.
            let old = (self.ring.take(), self.done_fd.take());
            self.owner = None;
            self.ring();
            drop(old);
        }
        if self.ring.is_none() {
            let mut made = Err(std::io::Error::from_raw_os_error(libc::EINVAL));
            for &setup in self.setups {
                made = setup.build().map(|r| (r, setup));
                match &made {
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => continue,
                    _ => break,
                }
            }
            let made = made.and_then(|(r, setup)| {
                // SAFETY: eventfd takes no pointers; the result is checked.
                let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // SAFETY: a descriptor eventfd just returned, owned by nothing else.
                let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
                r.submitter().register_eventfd(f.as_raw_fd())?;
                Ok((r, f, setup))
            });
            self.ring = Some(match made {
                Ok((r, f, setup)) => {
                    log::info!("blk: io_uring set up with {setup}");
                    self.done_fd = Some(f);
                    self.setup = Some(setup);
                    self.owner = Some(std::thread::current().id());
                    self.epoch += 1;
                    Some(r)
                }
                Err(e) => {
                    log::warn!(
                        "blk: io_uring cannot be set up ({e}): requests are carried out one \
                         after another"
                    );
                    None
                }
            });
        }
        self.ring.as_mut()?.as_mut()
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

    /// Discards `len` bytes at `offset` (`DISCARD`). In a file, a hole is punched: the file
    /// system may free the blocks, and the range reads as zeros. A block device is told with
    /// `BLKDISCARD`; what the range reads afterwards is the device's affair (a loop device over
    /// a file punches a hole; an SSD may keep the old data). Storage that cannot discard
    /// ignores it: a discard is a hint.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        let (done, op) = if self.block.is_some() {
            (
                blockdev::discard(&self.file, offset, len),
                "discard a range of the block device (BLKDISCARD)",
            )
        } else {
            (
                self.fallocate(
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                ),
                "punch a hole in the disk image (discard)",
            )
        };
        match done {
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
            r => r.map_err(|source| Error::Os { op, source }),
        }
    }

    /// Zeroes `len` bytes at `offset` (`WRITE_ZEROES`), with `fallocate` for a file and a block
    /// device alike: a hole where `unmap` allows it (on a block device: the device's zeroing
    /// command, unmapping where it can), else a zero range (on a block device the kernel writes
    /// zeros where the device has no command); where neither is supported, zeros are written.
    pub fn zero(&self, offset: u64, len: u64, unmap: bool) -> Result<()> {
        let punch = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        let zero_range = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        let modes: &[libc::c_int] = if unmap {
            &[punch, zero_range]
        } else {
            &[zero_range]
        };
        for &mode in modes {
            match self.fallocate(mode, offset, len) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => continue,
                Err(source) => {
                    return Err(Error::Os {
                        op: "zero a range of the disk image (write zeroes)",
                        source,
                    });
                }
            }
        }
        self.write_zeros(offset, len)
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

/// Steps `iov` past `n` bytes: whole entries go, then part of one.
pub fn advance(iov: &mut Vec<libc::iovec>, mut n: usize) {
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

/// The file's `O_DIRECT` alignment from `statx` (`STATX_DIOALIGN`, Linux 6.1), where the
/// kernel or file system does not report it (some kernels report 0 for a block device) 512
/// bytes of memory and, for offsets, 512 bytes or a block device's `logical` block size. An
/// offset alignment is never below the logical block size.
fn dio_align(file: &File, logical: Option<u32>) -> Align {
    let logical = logical.map_or(SECTOR, u64::from);
    let fallback = Align {
        memory: 512,
        offset: logical,
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
        offset: u64::from(st.stx_dio_offset_align).max(logical),
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

/// Bytes in the image open as `file`: a file's length, or a block device's size.
pub(crate) fn image_len(file: &File, block_device: bool) -> Result<u64> {
    if block_device {
        return blockdev::size(file);
    }
    Ok(file
        .metadata()
        .map_err(|source| Error::Os {
            op: "stat the disk image",
            source,
        })?
        .len())
}

#[cfg(test)]
mod tests {
    use super::Topology;

    /// Each topology field at its own place in the config space (bytes 24..32: exp, offset,
    /// min_io le16, opt_io le32), with values that tell swapped fields apart: a device of
    /// 512-byte logical and 4096-byte physical blocks (exp 3), aligned at 3,584 bytes (7
    /// blocks), preferring 512-byte and 64 KiB I/O.
    #[test]
    fn topology_fields_lie_where_virtio_blk_reads_them() {
        let t = Topology {
            physical_block_exp: 3,
            alignment_offset: 7,
            min_io_size: 1,
            opt_io_size: 128,
        };
        assert_eq!(t.config(), [3, 7, 1, 0, 128, 0, 0, 0]);
        let wide = Topology {
            physical_block_exp: 0,
            alignment_offset: 0,
            min_io_size: 0x0102,
            opt_io_size: 0x0304_0506,
        };
        assert_eq!(wide.config(), [0, 0, 2, 1, 6, 5, 4, 3]);
    }
}

#[cfg(test)]
mod ring_tests;

/// The error of a transfer the kernel ended with 0 bytes moved before its end: the image is
/// shorter than the transfer reached (cut by another program, or shrunk under the device).
/// The request fails with `IOERR`; it is never answered as done.
pub(crate) fn image_ended(op: &'static str, at: u64) -> Error {
    Error::Os {
        op,
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!("the image ended at byte {at} during a transfer"),
        ),
    }
}
