//! A read or write moving between guest memory and the image.
//!
//! The request's buffers come held, with their host segments, from the one walk the device
//! made of them ([`SgGuard`]) — or, with registered buffers, translated only and counted in
//! flight on the registered chunk they lie in ([`Claim`], no hold: `device` says why none is
//! needed). The data buffers' segments become iovecs for the kernel; a
//! transfer an `O_DIRECT` image cannot take as it is (buffers not aligned as it needs) is
//! copied through an aligned buffer of ours instead ([`Blk::bounce`]). Ready transfers go to
//! the kernel together (io_uring, [`Disk::start`]) or, alone, at once (`preadv` / `pwritev`);
//! each ends in [`Blk::end_transfer`], where its claim drops, and its guard goes with those of
//! the transfers that ended with it ([`Blk::release_ended`]), before their chains go back.

use std::time::Instant;

use memvisor::dma::SgGuard;
use memvisor::{DmaSpace, Iova};

use super::fixed::Claim;
use super::request::{Failure, Outcome, Status};
use super::stats::Op;
use super::{Blk, S_OK, SECTOR};
#[cfg(doc)]
use crate::disk::Disk;
use crate::disk::{AlignedBuf, IN_FLIGHT};
use crate::error::{Error, Result};
use crate::ring::{Desc as Buf, Ring};

/// How a request's pages are kept from a discard and an unmap while the kernel moves them.
pub(super) enum Pages {
    /// Held by the walk's guard (the ordinary way).
    Held(SgGuard),
    /// Counted in flight on the registered chunk they all lie in, with the data buffers'
    /// iovecs: nothing held.
    Chunk(Claim, Vec<libc::iovec>),
}

/// A read or write whose pages are kept and whose iovecs point at them: ready for the
/// kernel, which carries it out at once or in a batch through io_uring.
pub(super) struct Ready {
    /// Holds the request's pages until it ends (`None`: it went through a registered chunk,
    /// which `fixed` keeps).
    guard: Option<SgGuard>,
    /// 4 KiB pages under its data buffers.
    pages: u64,
    /// Of them, held by the guard.
    held: u64,
    /// Host addresses of its data buffers.
    pub iov: Vec<libc::iovec>,
    pub sector: u64,
    pub to_guest: bool,
    pub total: u64,
    /// Where the status byte goes.
    pub status_at: u64,
    /// When the pass that took it off its ring began (its latency runs from here: one clock
    /// read a pass, [`Blk::pass_clock`]).
    started: Instant,
    /// Goes through a registered buffer, whose chunk counts the transfer in flight until it
    /// ends ([`super::fixed`]).
    pub fixed: Option<Claim>,
    /// TEST ONLY: the locked pins the blk hook took on top of the guard's holds
    /// ([`Faults::locked_blk_pins`](memvisor::faults::Faults::locked_blk_pins)).
    #[cfg(feature = "test-hooks")]
    _hook: Option<HookPins>,
}

// SAFETY: a Ready's iovecs are host addresses of guest memory mapped in this process, not
// references: which thread holds them changes nothing about what they name, which stays
// mapped and held until the request ends (its guard) and the back end lets no memory go while
// transfers are out.
unsafe impl Send for Ready {}

/// iovec vectors of requests that ended, kept empty for the next ones (no allocation per
/// request once they have grown).
#[derive(Default)]
pub(super) struct Iovs(Vec<Vec<libc::iovec>>);

// SAFETY: the vectors kept are empty: no address in them is ever read again.
unsafe impl Send for Iovs {}

impl Iovs {
    /// An empty vector, from the kept ones if there is one.
    pub fn take(&mut self) -> Vec<libc::iovec> {
        self.0.pop().unwrap_or_default()
    }

    /// Keeps `v`, emptied, for a later request.
    pub fn give(&mut self, mut v: Vec<libc::iovec>) {
        v.clear();
        self.0.push(v);
    }
}

/// A read or write handed to the kernel: where its chain goes back, and what it holds.
pub(super) struct Out {
    pub ring: u16,
    pub head: u16,
    pub ready: Ready,
    /// Bytes moved by earlier, short, completions.
    pub done: u64,
}

impl Blk {
    /// Moves the data buffers of a read (`to_guest`) or write between guest memory and the
    /// image at `sector`: done here (bounced, or failed), or ready for the kernel. `data` are
    /// the walk's buffers from `first` on (after the header's). A write with `check_first` set
    /// (of sector 0, with `guard_first_sector`) is bounced, its first sector checked in the copy.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn transfer(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        first: usize,
        data: &[Buf],
        kept: Pages,
        sector: u64,
        to_guest: bool,
        status_at: u64,
        check_first: bool,
    ) -> Outcome {
        let started = self.pass_clock();
        let mut total: u64 = 0;
        for b in data {
            // A zero-length descriptor moves nothing, whichever way it points.
            if b.write != to_guest && b.len > 0 {
                return Error::BadChain(format!(
                    "data buffer at {:#x} is {} for a {}",
                    b.addr,
                    if b.write {
                        "device-writable"
                    } else {
                        "device-readable"
                    },
                    if to_guest { "read" } else { "write" }
                ))
                .into();
            }
            total += u64::from(b.len);
        }
        if total % SECTOR != 0 {
            return Error::BadChain(format!(
                "transfer of {total} bytes is not whole {SECTOR}-byte sectors"
            ))
            .into();
        }
        if sector
            .checked_add(total / SECTOR)
            .is_none_or(|e| e > self.capacity.sectors())
        {
            return Error::BadChain(format!(
                "sectors {sector}+{} pass the disk's end ({} sectors)",
                total / SECTOR,
                self.capacity.sectors()
            ))
            .into();
        }
        #[cfg(feature = "test-hooks")]
        let hook = match dma
            .faults()
            .locked_blk_pins
            .then(|| HookPins::take(dma, data, to_guest))
            .transpose()
        {
            Ok(h) => h,
            Err(e) => return Outcome::Failed(Failure::Hold(e.into())),
        };
        let (guard, fixed, iov, pages, held) = match kept {
            Pages::Held(guard) => {
                // The data buffers are the guard's buffers `first..`.
                let mut iov = self.iovs.take();
                iov.extend(
                    (first..first + data.len())
                        .flat_map(|i| guard.buffer(i))
                        .map(|s| libc::iovec {
                            iov_base: s.hva.0 as usize as *mut libc::c_void,
                            iov_len: s.len as usize,
                        }),
                );
                let pages = guard.buffer_pages(first..first + data.len());
                (Some(guard), None, iov, pages, pages)
            }
            Pages::Chunk(claim, iov) => {
                let pages = iov
                    .iter()
                    .map(|v| {
                        let s = v.iov_base as u64;
                        (s + v.iov_len as u64).div_ceil(memvisor::PAGE_4K) - s / memvisor::PAGE_4K
                    })
                    .sum();
                (None, Some(claim), iov, pages, 0)
            }
        };
        let c = self.count(q);
        c.pinned_pages.add(held);
        c.most_pinned_pages.raise(c.pinned_pages.get());
        let ready = Ready {
            guard,
            pages,
            held,
            iov,
            sector,
            to_guest,
            total,
            status_at,
            started,
            fixed,
            #[cfg(feature = "test-hooks")]
            _hook: hook,
        };
        #[cfg(feature = "test-hooks")]
        if !to_guest && dma.faults().drop_writes {
            return self.settle(q, ready, Ok(total));
        }
        let offset = sector * SECTOR;
        if (check_first && total > 0) || !self.disk.fits(&ready.iov, offset, total) {
            if ready.fixed.is_some() {
                if let Some(f) = self.fixed.as_mut() {
                    f.uncount_fixed();
                }
            }
            let moved = self.bounce(q, dma, data, offset, to_guest, total, check_first);
            return self.settle(q, ready, moved);
        }
        Outcome::Ready(ready)
    }

    /// Ends a read or write the kernel has carried out (`moved`: its bytes, or why not):
    /// counts it, writes its status byte, and leaves its pages to be let go, and its latency
    /// to be recorded, with the others that end with it ([`Blk::release_ended`]); returns the
    /// bytes written into the chain, status byte included.
    pub(super) fn end_transfer(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        ready: Ready,
        moved: Result<u64>,
    ) -> u32 {
        let status = Status {
            at: ready.status_at,
            // A read's data are the writable bytes before its status byte; a write has none.
            before: if ready.to_guest { ready.total } else { 0 },
        };
        let outcome = self.settle(q, ready, moved);
        self.finish(q, dma, Some(status), outcome)
    }

    /// What a read or write that moved `moved` came to: counted, its guard (if held) and its
    /// latency left for [`Blk::release_ended`].
    fn settle(&mut self, q: u16, ready: Ready, moved: Result<u64>) -> Outcome {
        let Ready {
            guard,
            pages,
            held,
            sector,
            to_guest,
            total,
            started,
            fixed,
            iov,
            ..
        } = ready;
        self.iovs.give(iov);
        // Its chunk may be given up to a discard from now on.
        drop(fixed);
        if let Some(guard) = guard {
            self.ending.push((q, held, guard));
        }
        let op = if to_guest { Op::Read } else { Op::Write };
        self.latencies.push((q, op, started));
        match moved {
            Ok(n) => {
                debug_assert_eq!(n, total);
                self.account(q, pages, to_guest, n);
                Outcome::Done(S_OK, if to_guest { n as u32 } else { 0 })
            }
            Err(e @ Error::Os { .. }) => Outcome::Failed(Failure::Io(Error::Invalid(format!(
                "{} of {total} bytes at sector {sector}: {e}",
                if to_guest { "read" } else { "write" },
            )))),
            Err(e) => e.into(),
        }
    }

    /// Ends the reads and writes that ended since the last call, together: lets their guards
    /// go, their vectors kept for the next walks (`Blk::hold`), and records their latencies.
    /// Called before their chains go back (on the used ring at once, or handed to the back end
    /// at the end of [`Device::complete_into`](crate::Device::complete_into)), so, as when
    /// each guard dropped as its transfer ended, every guard is gone (its written pages marked
    /// dirty) before its chain is on the used ring, the dirty log drained or a message handled.
    /// The clock is read once for them all, after the guards went (their latencies end there),
    /// and once before when there are guards: the time letting them go takes goes to each
    /// queue's `release_ns`, a run of one queue's guards timed at once (one more read for each
    /// change of queue), not two clock reads a request.
    pub(super) fn release_ended(&mut self) {
        if self.ending.is_empty() {
            if !self.latencies.is_empty() {
                let end = self.now();
                self.record_latencies(end);
            }
            return;
        }
        let mut ending = std::mem::take(&mut self.ending);
        let mut from = self.now();
        let mut run = None;
        for (q, held, guard) in ending.drain(..) {
            if let Some(r) = run.filter(|&r| r != q) {
                let to = self.now();
                self.count(r).release_ns.add(ns_between(from, to));
                from = to;
            }
            run = Some(q);
            let mut scratch = memvisor::dma::SgScratch::for_queue(q);
            scratch.recycle(guard);
            if self.scratches.len() < IN_FLIGHT {
                self.scratches.push(scratch);
            }
            self.count(q).pinned_pages.sub(held);
        }
        if let Some(r) = run {
            let to = self.now();
            self.count(r).release_ns.add(ns_between(from, to));
            from = to;
        }
        self.ending = ending;
        self.record_latencies(from);
    }

    /// Records the latencies of the reads and writes that ended, each from its pass's start
    /// to `end`.
    fn record_latencies(&mut self, end: Instant) {
        for (q, op, started) in self.latencies.drain(..) {
            self.live
                .queue(q)
                .record_latency(op, ns_between(started, end));
        }
    }

    /// Counts a read or write that moved `n` bytes over `pages` held pages.
    fn account(&self, q: u16, pages: u64, to_guest: bool, n: u64) {
        let c = self.count(q);
        c.record_pages(pages as usize);
        if to_guest {
            c.reads.add(1);
            c.bytes_read.add(n);
        } else {
            c.writes.add(1);
            c.bytes_written.add(n);
        }
    }

    /// Hands the reads and writes of `batch` (taken from ring `index`) to the kernel; those
    /// that cannot go through io_uring, or a lone one with nothing else out, are carried out at
    /// once and their chains returned.
    pub(super) fn launch(
        &mut self,
        index: u16,
        queue: &mut Ring,
        dma: &DmaSpace,
        batch: &mut Vec<(u16, Ready)>,
        any: &mut bool,
    ) {
        if batch.is_empty() {
            return;
        }
        let alone = batch.len() == 1 && self.disk.in_flight() == 0;
        let mem = dma.memory();
        for (head, mut ready) in batch.drain(..) {
            let offset = ready.sector * SECTOR;
            if !alone {
                if let Some(key) = self.free.pop() {
                    let slot = ready.fixed.as_ref().and_then(Claim::slot);
                    // SAFETY: the iovecs name guest memory this request's guard holds, or its
                    // claim keeps (`Ready`); either goes only when the transfer comes back from
                    // the kernel (`Device::complete`), an unmap waits for a guard, a discard
                    // skips a claimed chunk, and the back end waits for every transfer before
                    // any message may unmap the memory; the iovecs stay in `Out` meanwhile; no
                    // Rust reference covers that memory. Through a registered slot, every iovec
                    // lies in the slot's chunk (`BlkFixed::claim`).
                    let started = unsafe {
                        match slot {
                            Some(s) => self.disk.start_fixed(
                                &ready.iov,
                                offset,
                                ready.to_guest,
                                key as u64,
                                s,
                            ),
                            None => self
                                .disk
                                .start(&ready.iov, offset, ready.to_guest, key as u64),
                        }
                    };
                    if started {
                        self.out[key] = Some(Out {
                            ring: index,
                            head,
                            ready,
                            done: 0,
                        });
                        continue;
                    }
                    self.free.push(key);
                }
                // Done at once below, the ordinary way (its claim still keeps its pages).
                if let (Some(f), Some(c)) = (self.fixed.as_mut(), ready.fixed.as_mut()) {
                    if c.usable {
                        c.usable = false;
                        f.uncount_fixed();
                    }
                }
            }
            let moved = match alone.then(|| self.fixed_now(&mut ready, offset)).flatten() {
                Some(moved) => moved,
                // SAFETY: as above, for the length of this call.
                None => unsafe {
                    self.disk
                        .rw_vectored(&mut ready.iov, offset, ready.to_guest)
                },
            };
            // Done at once: its pages let go and its latency ended (its one clock read, two
            // with a guard) before its chain goes back.
            let written = self.end_transfer(index, dma, ready, moved);
            self.release_ended();
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
        // Chunks the batch found cold are registered once the pass's replies are out
        // (`Device::after_replies`), not here, where they would delay them.
        self.count_fixed(index);
    }

    /// A lone read or write through its registered chunk, carried out at once (a driver at
    /// queue depth 1): what it moved, or `None` if it did not go that way (nothing moved). A
    /// short transfer is finished the ordinary way; one the kernel refuses as a fixed
    /// transfer goes again the ordinary way, counted as a fallback.
    fn fixed_now(&mut self, ready: &mut Ready, offset: u64) -> Option<Result<u64>> {
        let f = self.fixed.as_mut()?;
        let claim = ready.fixed.as_mut()?;
        let slot = claim.slot()?;
        // SAFETY: the iovecs name guest memory this request's claim keeps, inside the slot's
        // registered chunk (`BlkFixed::claim`), for the length of this call.
        let moved = unsafe {
            self.disk
                .rw_fixed_now(&ready.iov, offset, ready.to_guest, slot)
        };
        match moved {
            None => {
                // Done the ordinary way by the caller; the claim still keeps the pages.
                claim.usable = false;
                f.uncount_fixed();
                None
            }
            Some(Err(Error::Os { source, .. }))
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EINVAL | libc::EOPNOTSUPP | libc::EFAULT)
                ) =>
            {
                if ready.iov.len() > 1 {
                    f.refuse_vectored();
                }
                claim.usable = false;
                f.uncount_fixed();
                f.count_fallback();
                None
            }
            // Nothing moved before the end: the image ended there (the ordinary ways say the
            // same).
            Some(Ok(0)) if ready.total > 0 => Some(Err(crate::disk::image_ended(
                if ready.to_guest { "read" } else { "write" },
                offset,
            ))),
            Some(Ok(n)) if n > 0 && n < ready.total => {
                crate::disk::advance(&mut ready.iov, n as usize);
                // SAFETY: as above: the rest of the same held memory.
                let rest = unsafe {
                    self.disk
                        .rw_vectored(&mut ready.iov, offset + n, ready.to_guest)
                };
                Some(rest.map(|m| n + m))
            }
            Some(r) => Some(r),
        }
    }

    /// Adds what the registered buffers did since the last call to queue `q`'s counters.
    pub(super) fn count_fixed(&mut self, q: u16) {
        let Some(f) = self.fixed.as_mut() else {
            return;
        };
        let d = f.take_counts();
        let c = self.live.queue(q);
        c.fixed.add(d.fixed);
        c.fixed_fallbacks.add(d.fallbacks);
        c.fixed_ordinary.add(d.ordinary);
        c.chunks_registered.add(d.chunks_registered);
        c.register_ns.add(d.register_ns);
        c.evictions.add(d.evictions);
        c.evict_busy.add(d.evict_busy);
    }

    /// Moves a transfer through an aligned buffer of our own, when the kernel cannot be handed
    /// the guest's buffers as they are: an `O_DIRECT` image and buffers not aligned as it needs,
    /// or a write of sector 0 whose first 512 bytes must be checked (`check_first`, the
    /// `guard_first_sector` option: checked in the copy that is then written, so the guest
    /// cannot change them between the check and the write, as it could in its own memory).
    /// Guest memory is copied with `dma_read` / `dma_write` (the pages stay held meanwhile),
    /// the file read or written from the buffer, [`BOUNCE_MAX`] bytes at a time: however
    /// large a request a guest makes, it costs the back end no more memory than that.
    #[allow(clippy::too_many_arguments)]
    fn bounce(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        data: &[Buf],
        offset: u64,
        to_guest: bool,
        total: u64,
        check_first: bool,
    ) -> Result<u64> {
        let (block, align) = match self.disk.direct() {
            Some(a) => (
                a.offset,
                a.memory.max(a.offset).next_power_of_two() as usize,
            ),
            None => (SECTOR, memvisor::PAGE_4K as usize),
        };
        if offset % block != 0 || total % block != 0 {
            return Err(Error::BadChain(format!(
                "transfer of {total} bytes at byte {offset} is not whole {block}-byte blocks of the \
                 O_DIRECT image (the device's blk_size)"
            )));
        }
        // Whole blocks, so each window is a transfer O_DIRECT takes.
        let window = total.min(BOUNCE_MAX.max(block) / block * block);
        let mut buf = AlignedBuf::new(window as usize, align).ok_or_else(|| {
            Error::Invalid(format!(
                "cannot allocate a {window}-byte bounce buffer aligned to {align}"
            ))
        })?;
        let mut pieces = data.iter().filter(|b| b.len > 0);
        // Where the copy stands in the data buffers: the current one and how far into it.
        let mut piece = pieces.next();
        let mut into: u64 = 0;
        let mut done: u64 = 0;
        while done < total {
            let n = window.min(total - done);
            let bytes = &mut buf.as_mut_slice()[..n as usize];
            if to_guest {
                self.disk.read_at(bytes, offset + done)?;
            }
            let mut pos = 0usize;
            while pos < bytes.len() {
                let b = piece.expect("the data buffers hold `total` bytes");
                let take = ((u64::from(b.len) - into) as usize).min(bytes.len() - pos);
                let at = Iova(b.addr + into);
                let part = &mut bytes[pos..pos + take];
                if to_guest {
                    dma.dma_write(at, part)?;
                } else {
                    dma.dma_read(at, part)?;
                }
                pos += take;
                into += take as u64;
                if into == u64::from(b.len) {
                    piece = pieces.next();
                    into = 0;
                }
            }
            if check_first && done == 0 {
                let first = &bytes[..bytes.len().min(SECTOR as usize)];
                if let Some(format) = crate::image_format::probe(first) {
                    return Err(Error::BadChain(format!(
                        "refused a write of sector 0 that carries a {format} header: the \
                         image was probed as raw (say format=raw to allow it)"
                    )));
                }
            }
            if !to_guest {
                self.disk.write_at(bytes, offset + done)?;
            }
            done += n;
        }
        self.count(q).bounced.add(1);
        Ok(total)
    }
}

/// The most a bounced transfer copies at a time ([`Blk::bounce`]): the back end's memory for
/// one, whatever the request's size.
const BOUNCE_MAX: u64 = 1 << 20;

/// Nanoseconds from `from` to `to` (0 if `to` is earlier).
pub(super) fn ns_between(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

/// TEST ONLY (feature `test-hooks`): with
/// [`Faults::locked_blk_pins`](memvisor::faults::Faults::locked_blk_pins), the blk device pins
/// its requests' data pages as it did before issue 45, on top of the guard's holds: locked
/// (`pin_pages`, mlock or a long-term pin) and charged to `RLIMIT_MEMLOCK`, a pin the limit
/// refuses answered `IOERR`. The real-guest memlock trial's negative control must then see I/O
/// errors in the guest. Calls of at most 512 pages, given back when the request ends.
#[cfg(feature = "test-hooks")]
struct HookPins {
    dma: DmaSpace,
    pages: Vec<u64>,
}

#[cfg(feature = "test-hooks")]
impl HookPins {
    fn take(dma: &DmaSpace, data: &[Buf], to_guest: bool) -> memvisor::Result<HookPins> {
        use memvisor::PAGE_4K;
        use memvisor::dma::PIN_PAGES_MAX;
        let mut pages: Vec<u64> = data
            .iter()
            .filter(|b| b.len > 0)
            .flat_map(|b| {
                b.addr / PAGE_4K..=(b.addr.saturating_add(u64::from(b.len) - 1)) / PAGE_4K
            })
            .collect();
        pages.sort_unstable();
        pages.dedup();
        let prot = if to_guest {
            memvisor::Prot::WRITE
        } else {
            memvisor::Prot::READ
        };
        let mut held = HookPins {
            dma: dma.clone(),
            pages: Vec::new(),
        };
        for batch in pages.chunks(PIN_PAGES_MAX) {
            dma.pin_pages(batch, prot)?;
            held.pages.extend_from_slice(batch);
        }
        Ok(held)
    }
}

#[cfg(feature = "test-hooks")]
impl Drop for HookPins {
    fn drop(&mut self) {
        for batch in self.pages.chunks(memvisor::dma::PIN_PAGES_MAX) {
            if let Err(e) = self.dma.unpin_pages(batch) {
                log::error!("blk: unpinning {} pages: {e}", batch.len());
            }
        }
    }
}
