//! virtio-blk over a raw image: a file or a host block device ([`crate::disk`]).
//!
//! A request is one descriptor chain: a 16-byte header the driver wrote (type, reserved,
//! sector), data buffers, and a status byte the device writes last. Supported: `IN` (read),
//! `OUT` (write), `FLUSH`, `GET_ID`, and on a writable disk `WRITE_ZEROES` and (where the
//! storage can) `DISCARD`, limits in the config space; anything else is answered `UNSUPP`.
//!
//! **Data path.** The data buffers are guest addresses; the device turns them into host
//! addresses through memvisor's [`DmaSpace`] (`translate_sg`, which checks each buffer lies in
//! mapped guest memory with the right permission) and hands them to `preadv` / `pwritev` on the
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
//! held with [`DmaSpace::hold_pages`] and released after it (the `vfio_pin_pages` pattern of the
//! kernel patch "vfio iommu type1: Improve vfio_iommu_type1_pin_pages performance"), so a
//! balloon discard in the same process skips them instead of freeing memory the kernel is
//! copying into, and an unmap waits for the request. A hold counts the pages in the pin
//! registry, which is what discards look at, and locks and charges nothing: the transfer goes
//! through this process's own mapping, where the kernel faults pages in as it copies and pins
//! them itself for `O_DIRECT`. An `mlock` would add only a charge to `RLIMIT_MEMLOCK` and, past
//! it, a guest I/O error (issue 45: systemd's default 8 MiB is 2,048 pages, one queue 128
//! requests of up to 254 segments). So no locked-memory limit reaches the guest: there is no
//! refused pin to wait for. The holds' page counts go into [`BlkStats::npage_histogram`].
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

use memvisor::dma::PIN_PAGES_MAX;
use memvisor::{Access, DmaSpace, Iova, Prot};
use virtio_queue::{QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress};

use crate::backend::Device;
use crate::disk::{AlignedBuf, Disk, IN_FLIGHT, advance};
use crate::error::{Error, Result};
use crate::memory::FrontendMemory;
use crate::ring::{Desc as Buf, Ring};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;

mod device;
mod ranges;
mod stats;

use stats::BlkCounters;
pub use stats::{BlkLive, BlkStats};

/// virtio device id of a block device.
pub const DEVICE_ID: u32 = 2;

const SECTOR: u64 = 512;
const T_IN: u32 = 0;
const T_OUT: u32 = 1;
const T_FLUSH: u32 = 4;
const T_GET_ID: u32 = 8;
const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
const S_OK: u8 = 0;
const S_IOERR: u8 = 1;
const S_UNSUPP: u8 = 2;
const ID_BYTES: usize = 20;

const F_SEG_MAX: u32 = 2;
const F_BLK_SIZE: u32 = 6;
const F_FLUSH: u32 = 9;
const F_MQ: u32 = 12;
const F_DISCARD: u32 = 13;
const F_WRITE_ZEROES: u32 = 14;
const F_VERSION_1: u32 = 32;
const F_RING_INDIRECT: u32 = 28;
/// Descriptor flag: the buffer is a table of descriptors.
const VRING_DESC_F_INDIRECT: u16 = 4;

/// Segments per request the device accepts (config `seg_max`).
const SEG_MAX: u32 = 254;
/// Sectors one discard or write-zeroes segment may cover (config `max_discard_sectors`,
/// `max_write_zeroes_sectors`): 2 GiB, so a segment's bytes fit an `off_t` step.
const MAX_RANGE_SECTORS: u32 = 1 << 22;
/// Segments in one discard or write-zeroes request (config `max_discard_seg`,
/// `max_write_zeroes_seg`): one, as QEMU's virtio-blk and qemu-storage-daemon offer, whose
/// drivers and tests (QEMU's vhost-user-blk qtest) expect a request of more to be `UNSUPP`.
const MAX_RANGE_SEGS: u32 = 1;
/// Write-zeroes flag: the device may deallocate the range (a hole reads as zeros).
const WZ_UNMAP: u32 = 1;

/// How the device was set up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlkOptions {
    /// Queues offered (`num-queues` on QEMU's side may be fewer).
    pub queues: u16,
    /// Serial number returned by `GET_ID` (at most 20 bytes).
    pub serial: String,
    /// Serve the image read-only.
    pub read_only: bool,
    /// Offer `VIRTIO_F_IOMMU_PLATFORM`: the device can sit behind a vIOMMU (then without
    /// indirect descriptors, whose tables virtio-queue reads at guest physical addresses).
    pub iommu: bool,
    /// Microseconds the serving loop polls the rings after the last request before it sleeps
    /// until a kick ([`Device::poll`]); 0: no polling.
    pub poll_us: u32,
    /// Refuse (`IOERR`) a write of sector 0 whose bytes carry another format's header
    /// ([`crate::image_format::probe`]), as QEMU does for an image it probed as raw: set it when
    /// the image's format was probed rather than given (`format=raw`), so a guest cannot turn
    /// its raw disk into an image that the next program to probe it reads as qcow2, with a
    /// backing file of the guest's choosing.
    pub guard_first_sector: bool,
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
        }
    }
}

/// A virtio-blk device over a raw image.
pub struct Blk {
    disk: Disk,
    sectors: u64,
    options: BlkOptions,
    acked: u64,
    fail_misses: bool,
    /// Reads and writes the kernel is carrying out, by the key their transfer went with.
    out: Vec<Option<Out>>,
    /// Keys free for the next transfer.
    free: Vec<usize>,
    /// What it has done so far, per queue, shared with its queue workers ([`Blk::live`]).
    live: BlkLive,
}

/// A read or write handed to the kernel: where its chain goes back, and what it holds.
struct Out {
    ring: u16,
    head: u16,
    status_at: u64,
    ready: Ready,
    /// Bytes moved by earlier, short, completions.
    done: u64,
}

impl Blk {
    /// A device over `disk` (its length, rounded down to whole sectors, is the capacity).
    /// Opened `O_DIRECT`, the image is read and written without the host page cache (see
    /// [`crate::disk`]); the device then offers the file's `O_DIRECT` offset alignment (or a
    /// block device's logical block size, if larger) as its block size.
    pub fn new(disk: File, options: BlkOptions) -> Result<Blk> {
        let disk = Disk::new(disk)?;
        let len = disk.len()?;
        if options.queues == 0 {
            return Err(Error::Invalid(
                "a block device needs at least one queue".into(),
            ));
        }
        let live = BlkLive::new(options.queues);
        Ok(Blk {
            disk,
            sectors: len / SECTOR,
            options,
            acked: 0,
            fail_misses: false,
            out: (0..IN_FLIGHT).map(|_| None).collect(),
            free: (0..IN_FLIGHT).rev().collect(),
            live,
        })
    }

    fn config(&self) -> [u8; 60] {
        let mut c = [0u8; 60];
        c[0..8].copy_from_slice(&self.sectors.to_le_bytes()); // capacity
        c[12..16].copy_from_slice(&SEG_MAX.to_le_bytes()); // seg_max
        let block = self.disk.block_size();
        c[20..24].copy_from_slice(&(block as u32).to_le_bytes()); // blk_size
        if let Some(t) = self.disk.topology() {
            c[24..32].copy_from_slice(&t.config()); // physical_block_exp .. opt_io_size
        }
        c[34..36].copy_from_slice(&self.options.queues.to_le_bytes()); // num_queues
        // The storage's own limits, capped at ours; never below one block.
        let sectors =
            |bytes: u64| (bytes / SECTOR).clamp(block / SECTOR, MAX_RANGE_SECTORS.into()) as u32;
        if let (false, Some((max, unit))) = (self.options.read_only, self.disk.discard_limits()) {
            c[36..40].copy_from_slice(&sectors(max).to_le_bytes()); // max_discard_sectors
            c[40..44].copy_from_slice(&MAX_RANGE_SEGS.to_le_bytes()); // max_discard_seg
            c[44..48].copy_from_slice(&sectors(unit).to_le_bytes()); // discard_sector_alignment
        }
        if !self.options.read_only {
            let max = sectors(self.disk.write_zeroes_max());
            c[48..52].copy_from_slice(&max.to_le_bytes()); // max_write_zeroes_sectors
            c[52..56].copy_from_slice(&MAX_RANGE_SEGS.to_le_bytes()); // max_write_zeroes_seg
            c[56] = 1; // write_zeroes_may_unmap
        }
        c
    }

    /// Starts one request chain: done at once (the status and the bytes written into the
    /// chain; the status byte is written whatever happened, if the chain has a place for it), or
    /// a read or write ready for the kernel, finished by [`Blk::complete`].
    fn request(&mut self, q: u16, dma: &DmaSpace, bufs: &[Buf]) -> Started {
        // The status byte is the last byte of the last descriptor; a descriptor that runs past
        // the top of the address space has none (its end would wrap to a low address the chain
        // never named).
        let Some(status_at) = bufs
            .last()
            .filter(|b| b.write && b.len >= 1 && bufs.len() >= 2)
            .and_then(|b| b.addr.checked_add(u64::from(b.len) - 1))
        else {
            self.count(q).failed.add(1);
            log::warn!(
                "blk: chain of {} descriptors has no writable status byte inside the address space",
                bufs.len()
            );
            return Started::Done(0);
        };
        let result = match self.serve(q, dma, &bufs[0], &bufs[1..bufs.len() - 1]) {
            Ok(Served::Ready(ready)) => return Started::Ready(status_at, ready),
            Ok(Served::Done(code, written)) => Ok((code, written)),
            Err(f) => Err(f),
        };
        Started::Done(self.finish(q, dma, status_at, result).1)
    }

    /// Ends a request: counts a failure, writes the status byte at `status_at`; returns the
    /// status and the bytes written into the chain.
    fn finish(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        status_at: u64,
        result: std::result::Result<(u8, u32), Failure>,
    ) -> (u8, u32) {
        let (code, written) = match result {
            Ok(r) => r,
            #[cfg(feature = "test-hooks")]
            Err(Failure::Io(e)) if dma.faults().hide_io_errors => {
                log::warn!("TEST ONLY: answering OK for a request whose I/O failed: {e}");
                (S_OK, 0)
            }
            Err(f) => {
                let c = self.count(q);
                c.failed.add(1);
                match f {
                    Failure::Io(e) => {
                        c.io_errors.add(1);
                        log::warn!("blk: request failed on the disk: {e}");
                    }
                    Failure::Pin(e) => {
                        c.pin_errors.add(1);
                        log::warn!("blk: request failed, its pages could not be pinned: {e}");
                    }
                    Failure::Other(e) => log::warn!("blk: request failed: {e}"),
                }
                (S_IOERR, 0)
            }
        };
        match dma.dma_write(Iova(status_at), &[code]) {
            Ok(()) => (code, written + 1),
            Err(e) => {
                log::warn!("blk: cannot write the status byte at {status_at:#x}: {e}");
                (code, written)
            }
        }
    }

    /// Ends a read or write the kernel has carried out (`moved`: its bytes, or why not):
    /// unpins its pages, counts it and ends the request.
    fn end_transfer(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        status_at: u64,
        ready: Ready,
        moved: Result<u64>,
    ) -> (u8, u32) {
        unpin_all(dma, &ready.pages);
        self.count(q).pinned_pages.sub(ready.pages.len() as u64);
        let result = moved.map_err(|e| io_failure(e, &ready)).map(|n| {
            debug_assert_eq!(n, ready.total);
            self.account(q, ready.pages.len(), ready.to_guest, n);
            (S_OK, if ready.to_guest { n as u32 } else { 0 })
        });
        self.finish(q, dma, status_at, result)
    }

    /// Counts a read or write that moved `n` bytes over `pages` pinned pages.
    fn account(&self, q: u16, pages: usize, to_guest: bool, n: u64) {
        let c = self.count(q);
        c.record_pages(pages);
        if to_guest {
            c.reads.add(1);
            c.bytes_read.add(n);
        } else {
            c.writes.add(1);
            c.bytes_written.add(n);
        }
    }

    /// Queue `q`'s counters.
    fn count(&self, q: u16) -> &BlkCounters {
        self.live.queue(q)
    }

    /// The device's counters, per queue, to read from any thread while it serves.
    pub fn live(&self) -> BlkLive {
        self.live.clone()
    }

    /// What the device has done so far, all queues together.
    pub fn stats(&self) -> BlkStats {
        self.live.total()
    }

    /// Carries out the request of header descriptor `hdr_buf` with `data` buffers.
    fn serve(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        hdr_buf: &Buf,
        data: &[Buf],
    ) -> std::result::Result<Served, Failure> {
        if hdr_buf.write || hdr_buf.len < 16 {
            return Err(Error::BadChain(format!(
                "first descriptor ({} bytes, {}) is not a 16-byte readable header",
                hdr_buf.len,
                if hdr_buf.write {
                    "writable"
                } else {
                    "readable"
                }
            ))
            .into());
        }
        let mut hdr = [0u8; 16];
        dma.dma_read(Iova(hdr_buf.addr), &mut hdr)
            .map_err(|e| Failure::Other(e.into()))?;
        let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("4"));
        let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8"));
        let (code, written) = match kind {
            T_IN | T_OUT => {
                let to_guest = kind == T_IN;
                if !to_guest && self.options.read_only {
                    return Err(Error::BadChain("write to a read-only disk".into()).into());
                }
                if !to_guest && sector == 0 && self.options.guard_first_sector {
                    if let Some(format) = first_sector_format(dma, data)? {
                        log::warn!(
                            "blk: refused a write of sector 0 that carries a {format} header: \
                             the image was probed as raw (say format=raw to allow it)"
                        );
                        self.count(q).failed.add(1);
                        return Ok(Served::Done(S_IOERR, 0));
                    }
                }
                match self.transfer(q, dma, data, sector, to_guest)? {
                    Transferred::Ready(ready) => return Ok(Served::Ready(ready)),
                    Transferred::Done(n) => (S_OK, if to_guest { n } else { 0 }),
                }
            }
            T_FLUSH => {
                self.disk.sync_data().map_err(Failure::Io)?;
                self.count(q).flushes.add(1);
                (S_OK, 0)
            }
            T_DISCARD | T_WRITE_ZEROES if !self.options.read_only => self
                .ranges(q, dma, data, kind == T_WRITE_ZEROES)
                .map_err(|e| match e {
                    Error::Os { .. } => Failure::Io(e),
                    other => Failure::Other(other),
                })?,
            T_GET_ID => {
                let Some(b) = data.first().filter(|b| b.write) else {
                    return Err(Error::BadChain("GET_ID without a writable buffer".into()).into());
                };
                let mut id = [0u8; ID_BYTES];
                let s = self.options.serial.as_bytes();
                let n = s.len().min(ID_BYTES);
                id[..n].copy_from_slice(&s[..n]);
                let n = (b.len as usize).min(ID_BYTES);
                dma.dma_write(Iova(b.addr), &id[..n])
                    .map_err(|e| Failure::Other(e.into()))?;
                (S_OK, n as u32)
            }
            other => {
                log::debug!("blk: request type {other} not supported");
                self.count(q).failed.add(1);
                (S_UNSUPP, 0)
            }
        };
        Ok(Served::Done(code, written))
    }

    /// Moves the data buffers of a read (`to_guest`) or write between guest memory and the
    /// image at `sector`; returns the bytes moved.
    fn transfer(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        data: &[Buf],
        sector: u64,
        to_guest: bool,
    ) -> std::result::Result<Transferred, Failure> {
        let mut total: u64 = 0;
        for b in data {
            if b.write != to_guest {
                return Err(Error::BadChain(format!(
                    "data buffer at {:#x} is {} for a {}",
                    b.addr,
                    if b.write {
                        "device-writable"
                    } else {
                        "device-readable"
                    },
                    if to_guest { "read" } else { "write" }
                ))
                .into());
            }
            total += u64::from(b.len);
        }
        if total % SECTOR != 0 {
            return Err(Error::BadChain(format!(
                "transfer of {total} bytes is not whole {SECTOR}-byte sectors"
            ))
            .into());
        }
        sector
            .checked_add(total / SECTOR)
            .filter(|&e| e <= self.sectors)
            .ok_or_else(|| {
                Error::BadChain(format!(
                    "sectors {sector}+{} pass the disk's end ({} sectors)",
                    total / SECTOR,
                    self.sectors
                ))
            })?;
        // Pin every guest page under the transfer for the duration of the system call.
        let mut pages = Vec::new();
        for b in data {
            if b.len == 0 {
                continue;
            }
            let first = b.addr / 4096;
            let end = b.addr.checked_add(u64::from(b.len) - 1).ok_or_else(|| {
                Error::BadChain(format!(
                    "data buffer at {:#x} of {} bytes runs past the top of the address space",
                    b.addr, b.len
                ))
            })?;
            let last = end / 4096;
            pages.extend(first..=last);
        }
        pages.sort_unstable();
        pages.dedup();
        let prot = if to_guest { Prot::WRITE } else { Prot::READ };
        pin_all(dma, &pages, prot).map_err(Failure::Pin)?;
        let c = self.count(q);
        c.pinned_pages.add(pages.len() as u64);
        c.most_pinned_pages.raise(c.pinned_pages.get());
        let ready = Ready {
            pages,
            iov: Vec::new(),
            sector,
            to_guest,
            total,
        };
        let (ready, result) = match self.prepare(q, dma, data, ready) {
            Prepared::Iov(ready) => return Ok(Transferred::Ready(ready)),
            Prepared::Done(ready, n) => (ready, Ok(n)),
            Prepared::Failed(ready, e) => (ready, Err(e)),
        };
        unpin_all(dma, &ready.pages);
        self.count(q).pinned_pages.sub(ready.pages.len() as u64);
        let n = result.map_err(|e| io_failure(e, &ready))?;
        self.account(q, ready.pages.len(), to_guest, n);
        Ok(Transferred::Done(n as u32))
    }

    /// Turns a pinned transfer's buffers into host iovecs for the kernel; a transfer `O_DIRECT`
    /// cannot take as it is goes through [`Blk::bounce`] here and now. A failed one comes back
    /// with the error, for its pages to be unpinned.
    fn prepare(&mut self, q: u16, dma: &DmaSpace, data: &[Buf], mut ready: Ready) -> Prepared {
        let (to_guest, total) = (ready.to_guest, ready.total);
        #[cfg(feature = "test-hooks")]
        if !to_guest && dma.faults().drop_writes {
            return Prepared::Done(ready, total);
        }
        let access = if to_guest {
            Access::Write
        } else {
            Access::Read
        };
        let mut iov = Vec::new();
        for b in data {
            if b.len == 0 {
                continue;
            }
            let segments = match dma.translate_sg(Iova(b.addr), u64::from(b.len), access) {
                Ok(s) => s,
                Err(e) => return Prepared::Failed(ready, e.into()),
            };
            for s in segments {
                iov.push(libc::iovec {
                    iov_base: s.hva.0 as usize as *mut libc::c_void,
                    iov_len: s.len as usize,
                });
            }
        }
        let offset = ready.sector * SECTOR;
        if !self.disk.fits(&iov, offset, total) {
            return match self.bounce(q, dma, data, offset, to_guest, total) {
                Ok(n) => Prepared::Done(ready, n),
                Err(e) => Prepared::Failed(ready, e),
            };
        }
        ready.iov = iov;
        Prepared::Iov(ready)
    }

    /// Takes the available chains of queue `index`: requests done at once go back to the used
    /// ring, reads and writes ready for the kernel into `batch` (run when it is full, and by
    /// the caller at the end). Sets `any` when something went back. Returns the IOTLB misses
    /// that stopped it, if any (the chain put back).
    fn take(
        &mut self,
        index: u16,
        queue: &mut Ring,
        memory: &FrontendMemory,
        batch: &mut Vec<(u16, u64, Ready)>,
        any: &mut bool,
    ) -> Result<Option<Vec<memvisor::dma::Miss>>> {
        // Rings, descriptors and indirect tables are all read at device addresses, through
        // the device space (the IOTLB behind a vIOMMU).
        let dma = memory.dma().clone();
        let mem = dma.memory();
        let ask = memory.is_iotlb() && !self.fail_misses;
        loop {
            // Heads a back end before this one left in flight come first (the driver kicked
            // for them long ago), then the available ring.
            let redo = queue.resubmit();
            let (head, bufs, indirect, cut) = match redo {
                Some(head) => match queue.chain(&mem, head) {
                    Ok((bufs, indirect)) => (head, bufs, indirect, mem.take_miss()),
                    Err(e) => {
                        if let (true, Some(m)) = (ask, mem.take_miss()) {
                            queue.resubmit_later(head);
                            return Ok(Some(vec![m]));
                        }
                        self.count(index).failed.add(1);
                        log::warn!("blk: queue {index}: request {head} left in flight: {e}");
                        if let Err(e) = queue.add_used(&mem, head, 0) {
                            log::warn!("blk: queue {index}: cannot return head {head}: {e}");
                        }
                        *any = true;
                        continue;
                    }
                },
                None => {
                    let chain = match queue.iter(&mem) {
                        Ok(mut avail) => avail.next(),
                        Err(e) => {
                            if let (true, Some(m)) = (ask, mem.take_miss()) {
                                return Ok(Some(vec![m]));
                            }
                            return Err(Error::BadRing(format!(
                                "queue {index}: available ring unusable: {e}"
                            )));
                        }
                    };
                    let Some(chain) = chain else {
                        if let (true, Some(m)) = (ask, mem.take_miss()) {
                            return Ok(Some(vec![m]));
                        }
                        // With event indexes, re-arm and look once more for a late arrival.
                        if queue.enable_notification(&mem).unwrap_or(false) {
                            continue;
                        }
                        break;
                    };
                    let head = chain.head_index();
                    let flags_at = queue.desc_table() + 16 * u64::from(head) + 12;
                    let indirect = mem
                        .read_obj::<u16>(GuestAddress(flags_at))
                        .is_ok_and(|f| f & VRING_DESC_F_INDIRECT != 0);
                    let bufs: Vec<Buf> = chain
                        .map(|d| Buf {
                            addr: d.addr().0,
                            len: d.len(),
                            write: d.is_write_only(),
                        })
                        .collect();
                    // virtio-queue ends a chain at a descriptor it cannot read: a miss in the
                    // table (or an indirect table) cut it short.
                    (head, bufs, indirect, mem.take_miss())
                }
            };
            // Behind a vIOMMU every buffer must be translatable before anything is done; else
            // (and for a chain cut short) put the chain back and let the back end ask — for
            // every unmapped page of the chain's buffers at once, not one round trip per page
            // ([`crate::miss`]).
            if ask {
                let mut misses: Vec<memvisor::dma::Miss> = cut.into_iter().collect();
                for b in &bufs {
                    let access = if b.write { Access::Write } else { Access::Read };
                    crate::miss::misses_in(&mem, b.addr, u64::from(b.len), access, &mut misses);
                }
                if !misses.is_empty() {
                    match redo {
                        Some(head) => queue.resubmit_later(head),
                        None => queue.go_to_previous_position(),
                    }
                    return Ok(Some(misses));
                }
            }
            if redo.is_none() {
                queue.taken(head);
            }
            self.count(index).indirect.add(u64::from(indirect));
            let written = match cut {
                Some(m) => {
                    // Cut short, with no one to ask: there is no status byte to write.
                    self.count(index).failed.add(1);
                    log::warn!(
                        "blk: queue {index}: descriptor chain {head} unreadable at iova {:#x}",
                        m.iova.0
                    );
                    0
                }
                None => match self.request(index, &dma, &bufs) {
                    Started::Done(written) => written,
                    Started::Ready(status_at, ready) => {
                        batch.push((head, status_at, ready));
                        if batch.len() + self.disk.in_flight() >= IN_FLIGHT {
                            self.launch(index, queue, &dma, batch, any);
                            if self.free.is_empty() {
                                // As many out as the device keeps: the rest of the ring waits
                                // for completions, after which the back end comes back.
                                break;
                            }
                        }
                        continue;
                    }
                },
            };
            if let Err(e) = queue.add_used(&mem, head, written) {
                log::warn!("blk: queue {index}: cannot return head {head}: {e}");
            }
            *any = true;
        }
        Ok(None)
    }

    /// Hands the reads and writes of `batch` (taken from ring `index`) to the kernel; those
    /// that cannot go through io_uring, or a lone one with nothing else out, are carried out at
    /// once and their chains returned.
    fn launch(
        &mut self,
        index: u16,
        queue: &mut Ring,
        dma: &DmaSpace,
        batch: &mut Vec<(u16, u64, Ready)>,
        any: &mut bool,
    ) {
        if batch.is_empty() {
            return;
        }
        let alone = batch.len() == 1 && self.disk.in_flight() == 0;
        let mem = dma.memory();
        for (head, status_at, mut ready) in batch.drain(..) {
            let offset = ready.sector * SECTOR;
            if !alone {
                if let Some(key) = self.free.pop() {
                    // SAFETY: the iovecs name guest memory this request translated and pinned
                    // (`transfer`); the pins are let go only when the transfer comes back from
                    // the kernel (`Device::complete`), and the back end waits for that before
                    // any message may unmap the memory; the iovecs stay in `Out` meanwhile; no
                    // Rust reference covers that memory.
                    if unsafe {
                        self.disk
                            .start(&ready.iov, offset, ready.to_guest, key as u64)
                    } {
                        self.out[key] = Some(Out {
                            ring: index,
                            head,
                            status_at,
                            ready,
                            done: 0,
                        });
                        continue;
                    }
                    self.free.push(key);
                }
            }
            // SAFETY: as above, for the length of this call.
            let moved = unsafe {
                self.disk
                    .rw_vectored(&mut ready.iov, offset, ready.to_guest)
            };
            let (_, written) = self.end_transfer(index, dma, status_at, ready, moved);
            if let Err(e) = queue.add_used(&mem, head, written) {
                log::warn!("blk: queue {index}: cannot return head {head}: {e}");
            }
            *any = true;
        }
        let c = self.live.queue(index);
        if self.disk.submit() > 0 {
            c.batches.add(1);
        }
        c.most_in_flight.raise(self.disk.in_flight() as u64);
    }

    /// Moves a transfer whose buffers `O_DIRECT` cannot take as they are through an aligned
    /// buffer of our own: guest memory is copied with `dma_read` / `dma_write` (the pages stay
    /// pinned meanwhile), the file is read or written whole from the buffer.
    fn bounce(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        data: &[Buf],
        offset: u64,
        to_guest: bool,
        total: u64,
    ) -> Result<u64> {
        let a = self
            .disk
            .direct()
            .expect("only an O_DIRECT image refuses a transfer");
        if offset % a.offset != 0 || total % a.offset != 0 {
            return Err(Error::BadChain(format!(
                "transfer of {total} bytes at byte {offset} is not whole {}-byte blocks of the \
                 O_DIRECT image (the device's blk_size)",
                a.offset
            )));
        }
        let align = a.memory.max(a.offset).next_power_of_two() as usize;
        let mut buf = AlignedBuf::new(total as usize, align).ok_or_else(|| {
            Error::Invalid(format!(
                "cannot allocate a {total}-byte bounce buffer aligned to {align}"
            ))
        })?;
        let bytes = buf.as_mut_slice();
        if to_guest {
            self.disk.read_at(bytes, offset)?;
        }
        let mut pos = 0usize;
        for b in data.iter().filter(|b| b.len > 0) {
            let piece = &mut bytes[pos..pos + b.len as usize];
            if to_guest {
                dma.dma_write(Iova(b.addr), piece)?;
            } else {
                dma.dma_read(Iova(b.addr), piece)?;
            }
            pos += b.len as usize;
        }
        if !to_guest {
            self.disk.write_at(bytes, offset)?;
        }
        self.count(q).bounced.add(1);
        Ok(total)
    }

    /// The image (for tests).
    pub fn disk(&self) -> &File {
        self.disk.file()
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
        // kernel never writes into memory after it was unmapped.
        while self.disk.in_flight() > 0 {
            let n = self.disk.finished(true).len();
            log::error!("blk: dropped with transfers out; {n} ended now, their pins kept");
        }
    }
}

/// A read or write whose pages are pinned and whose iovecs point at them: ready for the
/// kernel, which carries it out at once or in a batch through io_uring ([`Blk::process`]).
struct Ready {
    /// The IOVA pages pinned for it (unpinned when it ends).
    pages: Vec<u64>,
    /// Host addresses of its buffers; empty until [`Blk::prepare`].
    iov: Vec<libc::iovec>,
    sector: u64,
    to_guest: bool,
    total: u64,
}

// SAFETY: a Ready's iovecs are host addresses of guest memory mapped in this process, not
// references: which thread holds them changes nothing about what they name, which stays
// mapped and pinned until the request ends (the back end lets no memory go while transfers are
// out).
unsafe impl Send for Ready {}

/// What [`Blk::prepare`] made of a transfer: iovecs for the kernel, done already (bounced, or
/// dropped by a test hook) with the bytes moved, or failed (its pages still to be unpinned).
enum Prepared {
    Iov(Ready),
    Done(Ready, u64),
    Failed(Ready, Error),
}

/// What [`Blk::transfer`] made of a read or write: done (bytes into the chain), or ready.
enum Transferred {
    Done(u32),
    Ready(Ready),
}

/// What [`Blk::serve`] made of a request: done (status, bytes into the chain), or ready.
enum Served {
    Done(u8, u32),
    Ready(Ready),
}

/// What [`Blk::request`] made of a chain: done (bytes written into the chain, its status byte
/// among them), or a transfer ready for the kernel with the address of its status byte.
enum Started {
    Done(u32),
    Ready(u64, Ready),
}

/// The failure of a read or write the disk refused, with what it was.
fn io_failure(e: Error, r: &Ready) -> Failure {
    match e {
        Error::Os { .. } => Failure::Io(Error::Transfer {
            to_guest: r.to_guest,
            bytes: r.total,
            sector: r.sector,
            source: Box::new(e),
        }),
        other => Failure::Other(other),
    }
}

/// Why a request failed: the disk refused its I/O, its pages could not be pinned, or anything
/// else (a bad chain, guest memory out of reach).
enum Failure {
    Io(Error),
    Pin(Error),
    Other(Error),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Other(e)
    }
}

/// The format whose header the first sector a write carries would begin with (the first 512
/// bytes of its data buffers), if any.
fn first_sector_format(
    dma: &DmaSpace,
    data: &[Buf],
) -> std::result::Result<Option<&'static str>, Failure> {
    let mut head = [0u8; SECTOR as usize];
    let mut got = 0;
    for b in data {
        if got == head.len() {
            break;
        }
        let n = (b.len as usize).min(head.len() - got);
        dma.dma_read(Iova(b.addr), &mut head[got..got + n])
            .map_err(|e| Failure::Other(e.into()))?;
        got += n;
    }
    Ok(crate::image_format::probe(&head[..got]))
}

/// Holds `pages` (sorted, distinct IOVA pages) for one request ([`DmaSpace::hold_pages`]: a
/// pin that locks nothing), in calls of at most [`PIN_PAGES_MAX`] pages: a request may be any
/// size (the config offers no `size_max`), while one call takes at most type1's 512 entries. A
/// refused call releases what the calls before it held, so a failed request leaves nothing held.
fn pin_all(dma: &DmaSpace, pages: &[u64], prot: Prot) -> Result<()> {
    let start = std::time::Instant::now();
    for (i, batch) in pages.chunks(PIN_PAGES_MAX).enumerate() {
        #[cfg(feature = "test-hooks")]
        let held = crate::hooks::blk_hold(dma, batch, prot);
        #[cfg(not(feature = "test-hooks"))]
        let held = dma.hold_pages(batch, prot);
        if let Err(e) = held {
            unpin_all(dma, &pages[..i * PIN_PAGES_MAX]);
            return Err(e.into());
        }
    }
    crate::pin_cost::PIN_COST.pinned(start);
    Ok(())
}

/// Releases what [`pin_all`] held, in the same batches.
fn unpin_all(dma: &DmaSpace, pages: &[u64]) {
    let start = std::time::Instant::now();
    for batch in pages.chunks(PIN_PAGES_MAX) {
        if let Err(e) = dma.unpin_pages(batch) {
            log::error!("blk: unpinning {} pages: {e}", batch.len());
        }
    }
    crate::pin_cost::PIN_COST.unpinned(start);
}
