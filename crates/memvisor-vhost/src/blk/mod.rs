//! virtio-blk over a raw image: a file or a host block device ([`crate::disk`]).
//!
//! A request is one descriptor chain: a 16-byte header the driver wrote (type, reserved,
//! sector), data buffers, and a status byte the device writes last, laid out in descriptors
//! however the driver likes (`request::frame` cuts them apart). Supported: `IN` (read),
//! `OUT` (write), `FLUSH`, `GET_ID`, and on a writable disk `WRITE_ZEROES` and (where the
//! storage can) `DISCARD`, limits in the config space; anything else is answered `UNSUPP`.
//!
//! **Data path.** The chain's buffers are guest addresses; one walk of memvisor's [`DmaSpace`]
//! per request ([`DmaSpace::hold_sg`]) checks each lies in mapped guest memory with the right
//! permission, holds its pages and turns it into host addresses, and the device hands those to
//! `preadv` / `pwritev` on the
//! image ([`crate::disk`]): the kernel copies straight between the file and guest memory, no
//! bounce buffer — unless the image is `O_DIRECT` and the guest's buffers are not aligned as it
//! needs, which the virtio specification allows; such a transfer is copied through an aligned
//! buffer of ours (counted in [`BlkStats::bounced`]).
//!
//! **Many in flight.** The reads and writes a driver made available are taken off the ring,
//! translated, pinned and handed to the kernel without waiting (io_uring, [`Disk::start`]), up
//! to [`IN_FLIGHT`] at once; the device goes back to the ring while they run, and each ends when
//! the kernel says so ([`Device::complete`], in the order they finish): unpinned, its status
//! written, its chain returned. A lone request with nothing else out is done at once with
//! `preadv` / `pwritev`, the cheapest way for a driver at queue depth 1. The back end waits for
//! every transfer to end before it handles a message ([`crate::backend`]), so none outlives
//! the message handling that may unmap its memory next (an IOTLB invalidation, a new memory
//! table).
//! Headers, the status byte and `GET_ID`'s string go through `dma_read` / `dma_write`.
//!
//! **Restart.** Requests complete in the order the kernel finishes them, so the device offers
//! the inflight log (`INFLIGHT_SHMFD`, [`crate::ring`]): each chain is marked in flight when
//! taken and cleared when returned, and a back end started after a crash redoes the chains its
//! predecessor left, oldest first, before reading the available ring.
//!
//! **Pins are holds; nothing is locked.** Before the system call the request's guest pages are
//! held by its guard ([`memvisor::dma::SgGuard`]) and released when the request ends and the
//! guard drops (the `vfio_pin_pages` pattern of the kernel patch "vfio iommu type1: Improve
//! vfio_iommu_type1_pin_pages performance"), with no lock another queue's requests need, so a
//! balloon discard in the same process skips them instead of freeing memory the kernel is
//! copying into, and an unmap waits for the request. A hold counts the pages in the pin
//! registry, which is what discards look at, and locks and charges nothing: the transfer goes
//! through this process's own mapping, where the kernel faults pages in as it copies and pins
//! them itself for `O_DIRECT`. An `mlock` would add only a charge to `RLIMIT_MEMLOCK` and, past
//! it, a guest I/O error (issue 45: systemd's default 8 MiB is 2,048 pages, one queue 128
//! requests of up to 254 segments). So no locked-memory limit reaches the guest: there is no
//! refused pin to wait for. The holds' page counts go into [`BlkStats::npage_histogram`], the
//! time the walks and releases take into [`BlkStats::hold_ns`] and [`BlkStats::release_ns`].
//!
//! **Registered buffers** (opt-in, [`BlkOptions::fixed_buffers`]): a transfer whose buffers lie
//! in one 2 MiB chunk of guest memory registered with the queue's io_uring goes out as
//! `READ_FIXED` / `WRITE_FIXED`, and the kernel pins nothing for it; memvisor holds nothing
//! either: its buffers are only translated, and its chunk counts it in flight until it ends, so
//! a balloon discard in this process evicts the chunk first and skips it while busy (`fixed`;
//! why that is enough: `device`, `claim_fixed`). Any other transfer (two chunks, a cold chunk,
//! dirty logging on, a chunk the host refused) is held and walked the ordinary way.
//!
//! **Misses.** Behind a vIOMMU the walk runs before the chain is taken off the ring: a buffer
//! the IOTLB does not map yet comes back as misses (every unmapped page of the chain at once,
//! [`crate::miss`]), the chain is put back and the back end asks the frontend; nothing is held
//! meanwhile. Without a vIOMMU a buffer outside guest memory fails its request.
//!
//! The parts: the request's header and its outcome (`request`), its data moving to and from
//! the image (`io`), discards and write-zeroes (`ranges`), the config space and features
//! (`config`), the ring side (`device`), the counters and latency histograms (`stats`) and the
//! I/O limits (`throttle`: a request that must wait stays on its ring).
//!
//! **Bad requests** (a chain without a header or status byte, a buffer outside guest memory or
//! with the wrong direction, a read past the end of the disk, a length that is not whole
//! sectors) are answered `IOERR` with nothing read or written, and logged; the queue keeps
//! working. A corrupt available ring stops the queue ([`Device::process`] returns an error).
//!
//! **A failing disk** (`preadv` / `pwritev` refused: EIO from the file system, ENOSPC on a full
//! one, a short count followed by an error) fails that request alone with `IOERR`, counted in
//! [`BlkStats::io_errors`]; a read may have filled part of its own buffers, nothing else is
//! touched, and the next request goes to the disk again. **A hold refused** — a buffer that
//! left guest memory or its permission (an IOTLB invalidation racing the request), memory whose
//! host address stays invalidated past the live-update wait — fails the request with `IOERR`
//! before any I/O, with nothing of it held (a hold is all or nothing), counted in
//! [`BlkStats::pin_errors`]; no host limit is among the reasons.

use std::fs::File;
use std::os::unix::fs::FileExt;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};

#[cfg(doc)]
use crate::backend::Device;
use crate::disk::{Disk, IN_FLIGHT};
use crate::error::{Error, Result};
#[cfg(doc)]
use memvisor::DmaSpace;

mod capacity;
mod config;
mod device;
mod fixed;
mod io;
mod ranges;
mod request;
mod stats;
mod throttle;

pub use capacity::{BlkCapacity, Resized};
pub use fixed::probe as probe_fixed_buffers;
use io::Out;
use stats::BlkCounters;
pub use stats::{BlkLive, BlkStats, Histogram, LATENCY_BOUNDS_NS, Op, QueueLatency};
pub use throttle::{Throttle, ThrottleConfig, VALUE_MAX as THROTTLE_VALUE_MAX};

/// virtio device id of a block device.
pub const DEVICE_ID: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;

const SECTOR: u64 = 512;
const S_OK: u8 = VIRTIO_BLK_S_OK as u8;
const S_IOERR: u8 = VIRTIO_BLK_S_IOERR as u8;
const S_UNSUPP: u8 = VIRTIO_BLK_S_UNSUPP as u8;

/// Sectors one discard or write-zeroes segment may cover (config `max_discard_sectors`,
/// `max_write_zeroes_sectors`): 2 GiB, so a segment's bytes fit an `off_t` step.
const MAX_RANGE_SECTORS: u32 = 1 << 22;
/// Segments in one discard or write-zeroes request (config `max_discard_seg`,
/// `max_write_zeroes_seg`): one, as QEMU's virtio-blk and qemu-storage-daemon offer, whose
/// drivers and tests (QEMU's vhost-user-blk qtest) expect a request of more to be `UNSUPP`.
const MAX_RANGE_SEGS: u32 = 1;
/// Write-zeroes flag: the device may deallocate the range (a hole reads as zeros).
const WZ_UNMAP: u32 = VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP;

/// How the device was set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkOptions {
    /// Queues offered (`num-queues` on QEMU's side may be fewer).
    pub queues: u16,
    /// Serial number returned by `GET_ID` (at most 20 bytes).
    pub serial: String,
    /// Serve the image read-only.
    pub read_only: bool,
    /// Offer `VIRTIO_F_IOMMU_PLATFORM`: the device can sit behind a vIOMMU (its rings,
    /// descriptors, indirect tables and buffers are then all at I/O virtual addresses, read
    /// through the IOTLB).
    pub iommu: bool,
    /// Microseconds the serving loop polls the rings after the last request before it sleeps
    /// until a kick ([`Device::poll`]); 0: no polling.
    pub poll_us: u32,
    /// Refuse (`IOERR`) a write of sector 0 whose bytes carry another format's header
    /// ([`crate::image_format::probe`]), as QEMU does for an image it probed as raw: set it when
    /// the image's format was probed rather than given (`format=raw`), so a guest cannot turn
    /// its raw disk into an image that the next program to probe it reads as qcow2, with a
    /// backing file of the guest's choosing. Such a write is copied out of guest memory and
    /// checked in the copy that is written, so the guest cannot change it after the check.
    pub guard_first_sector: bool,
    /// Reads and writes go out as io_uring fixed transfers (`READ_FIXED` / `WRITE_FIXED`)
    /// through guest memory registered in 2 MiB chunks (module `blk::fixed`): no page pinning per
    /// request in the kernel, at the cost of keeping the chunks the guest used pinned (charged
    /// to `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`). Only memfd, hugetlbfs and received shared
    /// memory is registered, never while dirty pages are logged; a chunk the host refuses goes
    /// the ordinary way, counted. Opt-in: memory the frontend discards on its own side (a
    /// balloon in the frontend punching holes in the memfd) would leave the registered pages
    /// orphaned; discards in this process (memvisor's balloon) evict the chunk first.
    pub fixed_buffers: bool,
}

impl Default for BlkOptions {
    fn default() -> Self {
        BlkOptions {
            queues: 1,
            serial: "memvisor".into(),
            read_only: false,
            iommu: false,
            poll_us: 0,
            guard_first_sector: false,
            fixed_buffers: false,
        }
    }
}

/// A virtio-blk device over a raw image.
pub struct Blk {
    disk: Disk,
    /// Whole sectors served, which `blk-resize` may change while it serves ([`BlkCapacity`]).
    capacity: BlkCapacity,
    options: BlkOptions,
    acked: u64,
    fail_misses: bool,
    /// Reads and writes the kernel is carrying out, by the key their transfer went with.
    out: Vec<Option<Out>>,
    /// Keys free for the next transfer.
    free: Vec<usize>,
    /// What it has done so far, per queue, shared with its queue workers ([`Blk::live`]).
    live: BlkLive,
    /// TEST ONLY ([`Faults::silent_resize`](memvisor::faults::Faults::silent_resize)): a
    /// capacity change is not told to the frontend.
    #[cfg(feature = "test-hooks")]
    silent_resize: bool,
    /// TEST ONLY ([`Blk::on_register`]): called before cold chunks are registered.
    #[cfg(feature = "test-hooks")]
    before_register: Option<Box<dyn FnMut() + Send>>,
    /// Wakes the serving loop when a request the throttle deferred may go (made on the first
    /// deferral; [`throttle`]).
    wake: Option<throttle::Wake>,
    /// Said once: no timer for the throttle, so it lets requests through.
    no_wake: bool,
    /// Rings (a bit each) with requests the throttle held back, not looked at since.
    deferred: u64,
    /// A ring was processed since the last [`Device::complete`].
    looked: bool,
    /// Safety timers fired with no ring looked at since the last deferral.
    idle_fires: u8,
    /// Registered buffers on this device's ring, with `fixed_buffers`: made on the first pass
    /// (on the ring's thread).
    fixed: Option<fixed::BlkFixed>,
    /// Reused for each request: the chain's buffers as the space sees them.
    sg: Vec<memvisor::dma::SgBuf>,
    /// Reused for each request: its translation, with registered buffers.
    xlate: memvisor::dma::SgScratch,
    /// iovec vectors of requests that ended, for the next ones.
    iovs: io::Iovs,
    /// Walk vectors of guards that ended, for the next walks (`Blk::hold`).
    scratches: Vec<memvisor::dma::SgScratch>,
    /// Reused for each pass: the chain being taken, the transfers made ready, those ended.
    chain: Vec<crate::ring::Desc>,
    batch: Vec<(u16, io::Ready)>,
    ended: Vec<(u64, Result<u64>)>,
    /// The clock as the pass being served began ([`Blk::pass_clock`]); `None` between passes.
    pass_at: Option<std::time::Instant>,
    /// Guards of reads and writes that ended, with their queue and held pages, let go
    /// together ([`Blk::release_ended`]).
    ending: Vec<(u16, u64, memvisor::dma::SgGuard)>,
    /// Reads and writes that ended, with their queue and start, whose latencies are recorded
    /// at the same clock read ([`Blk::release_ended`]).
    latencies: Vec<(u16, stats::Op, std::time::Instant)>,
    /// TEST ONLY: the device's clock reads ([`Blk::clock_reads`]).
    #[cfg(feature = "test-hooks")]
    clock_reads: crate::live::Counter,
}

impl Blk {
    /// A device over `disk` (its length, rounded down to whole sectors, is the capacity).
    /// Opened `O_DIRECT`, the image is read and written without the host page cache (see
    /// [`crate::disk`]); the device then offers the file's `O_DIRECT` offset alignment (or a
    /// block device's logical block size, if larger) as its block size.
    pub fn new(disk: File, options: BlkOptions) -> Result<Blk> {
        let second = disk.try_clone().map_err(|source| Error::Os {
            op: "duplicate the disk image's descriptor",
            source,
        })?;
        let disk = Disk::new(disk)?;
        let len = disk.len()?;
        let capacity = BlkCapacity::new(
            second,
            disk.block_device().is_some(),
            options.read_only,
            disk.block_size(),
            len,
        );
        if options.queues == 0 {
            return Err(Error::Invalid(
                "a block device needs at least one queue".into(),
            ));
        }
        let live = BlkLive::new(options.queues);
        Ok(Blk {
            disk,
            capacity,
            options,
            acked: 0,
            fail_misses: false,
            out: (0..IN_FLIGHT).map(|_| None).collect(),
            free: (0..IN_FLIGHT).rev().collect(),
            live,
            #[cfg(feature = "test-hooks")]
            silent_resize: false,
            #[cfg(feature = "test-hooks")]
            before_register: None,
            wake: None,
            no_wake: false,
            deferred: 0,
            looked: false,
            idle_fires: 0,
            fixed: None,
            sg: Vec::new(),
            xlate: memvisor::dma::SgScratch::default(),
            iovs: io::Iovs::default(),
            scratches: Vec::new(),
            chain: Vec::new(),
            batch: Vec::new(),
            ended: Vec::new(),
            pass_at: None,
            ending: Vec::new(),
            latencies: Vec::new(),
            #[cfg(feature = "test-hooks")]
            clock_reads: crate::live::Counter::default(),
        })
    }

    /// Reads the clock (every clock read of the device's own goes through here: a test can
    /// count them, [`Blk::clock_reads`]).
    #[inline]
    fn now(&self) -> std::time::Instant {
        #[cfg(feature = "test-hooks")]
        self.clock_reads.add(1);
        std::time::Instant::now()
    }

    /// The clock as the pass being served began: the serving loop's own read of it
    /// ([`Device::pass_began`]), or, without one, a read made here once a pass. Requests the
    /// pass takes start from it, and the throttle weighs them at it.
    fn pass_clock(&mut self) -> std::time::Instant {
        match self.pass_at {
            Some(t) => t,
            None => {
                let t = self.now();
                self.pass_at = Some(t);
                t
            }
        }
    }

    /// TEST ONLY (feature `test-hooks`): the clock reads the device made itself so far (not
    /// the serving loop's one a pass, which it is handed): to count them per request.
    #[cfg(feature = "test-hooks")]
    pub fn clock_reads(&self) -> u64 {
        self.clock_reads.get()
    }

    /// Queue `q`'s counters.
    fn count(&self, q: u16) -> &BlkCounters {
        self.live.queue(q)
    }

    /// The device's counters, per queue, to read from any thread while it serves.
    pub fn live(&self) -> BlkLive {
        self.live.clone()
    }

    /// Its capacity, to change while it serves ([`BlkCapacity::resize`]).
    pub fn capacity(&self) -> BlkCapacity {
        self.capacity.clone()
    }

    /// What the device has done so far, all queues together.
    pub fn stats(&self) -> BlkStats {
        self.live.total()
    }

    /// The image (for tests).
    pub fn disk(&self) -> &File {
        self.disk.file()
    }

    /// TEST ONLY (feature `test-hooks`): `f` runs on the ring's thread each time registered
    /// buffers are about to register the chunks requests found cold, so a test can see what
    /// the driver sees at that moment (its replies published or not).
    #[cfg(feature = "test-hooks")]
    pub fn on_register(&mut self, f: impl FnMut() + Send + 'static) {
        self.before_register = Some(Box::new(f));
    }

    /// Reads image bytes (for tests).
    pub fn read_disk(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.disk.file().read_exact_at(buf, offset)
    }
}

impl Drop for Blk {
    fn drop(&mut self) {
        // The back end waits for every transfer before it lets memory go; a device dropped
        // with some still out (a caller that never let the back end finish) waits here, so the
        // kernel never writes into memory after it was unmapped. Only the thread that made
        // the io_uring may reap it (SINGLE_ISSUER): a queue worker ends its transfers before it
        // hands its copy back, so one dropped elsewhere with some out is a bug, said, not
        // waited on forever.
        if self.disk.stranded() {
            log::error!(
                "blk: dropped on another thread than its io_uring's with {} transfers out",
                self.disk.in_flight()
            );
            return;
        }
        while self.disk.in_flight() > 0 {
            let n = self.disk.finished(true).len();
            log::error!("blk: dropped with transfers out; {n} ended now");
        }
    }
}
