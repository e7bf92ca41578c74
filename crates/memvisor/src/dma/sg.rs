//! Scatter-gather guards: one walk per request.
//!
//! A device request names a few buffers — IOVA ranges, each read or written by the device. To
//! do its I/O the device needs three things of them: their host addresses, the pages kept from
//! a discard and an unmap while the I/O runs, and the written pages marked dirty. An
//! [`SgGuard`] gets all three from one walk of the address index ([`DmaSpace::hold_sg`]): for
//! each piece of each buffer it checks the mapping's permission, records the piece's host
//! segment and counts its pages as held; dropping the guard lets them go and marks the written
//! pages dirty. Nothing is copied and no page number list is built.
//!
//! **Misses are an outcome.** Behind a vIOMMU a buffer whose IOVA is not mapped yet is normal:
//! the back end asks the frontend for an IOTLB entry and tries again. So an unmapped range is
//! not an error: the walk goes on to find every unmapped 4 KiB page of the request (up to
//! [`SG_MISSES_MAX`]) and returns them as [`SgWalk::Missed`], holding nothing. What no IOTLB
//! entry can fix is an error with type1's errno: a wrapping range or a buffer asking for no
//! access (EINVAL), a mapping without the permission (EPERM), a peer's memory (EFAULT), a host
//! address invalidated past the live-update wait (EBUSY).
//!
//! **No lock another queue needs.** A hold locks nothing (see `crate::pin`, "Holds"): it only
//! has to be seen. The guard counts its pages in the space's hold table, in the shard of the
//! calling thread (`pin::holds`), never under the space's writer lock nor the registry's: two
//! queue threads holding requests at once do not wait for each other. The pages are counted in
//! batches of at most [`PIN_PAGES_MAX`](super::PIN_PAGES_MAX) (type1's 512), each batch walked
//! on a fresh snapshot under its shard's lock, so no lock is held long for a huge request.
//! A discard takes every shard before it looks (it skips held host pages); an unmap closes
//! its range first and then looks at the shards (it waits for held IOVA pages, asking the
//! unmap notifiers as for `pin_pages`): a walk either counted its pages before the unmap looked
//! or ran on a snapshot where the range is closed. [`DmaSpace::pin_sg`] locks the pages as
//! well, through the registry, as `pin_pages` does, for devices that want them resident.
//!
//! **Per queue, no allocation.** A queue thread keeps an [`SgScratch`]: its shard (by queue
//! number, so two queues never share one) and the vectors of its last guard, given back with
//! [`SgScratch::recycle`]. Walking with it ([`DmaSpace::hold_sg_into`],
//! [`DmaCursor::hold_sg_into`]) allocates nothing once the vectors have grown to the
//! requests' size (a miss, an error, a dirty log or a pin still may). A device that only
//! needs the host addresses (its pages kept by other means) translates into the scratch with
//! [`DmaCursor::translate_sg_into`]: no hold, no allocation.

use std::sync::Arc;

use super::index::{Hot, word_answer};
use super::{DmaCursor, DmaSpace, Mapping, Prot};
use crate::addr::{Hva, Iova, PAGE_4K as PAGE};
use crate::error::{Error, Result};
use crate::pin::PinRequest;
use crate::pin::holds::Held;

use super::translate::{Segment, mark_dirty, refused};

/// Most misses one walk reports (4 MiB of 4 KiB pages); the rest are found on the retry.
pub const SG_MISSES_MAX: usize = 1024;

/// One buffer of a request: `len` bytes at `iova`, which the device reads (`Prot::READ`) or
/// writes (`Prot::WRITE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SgBuf {
    /// First byte.
    pub iova: Iova,
    /// Bytes; a buffer of 0 bytes is skipped.
    pub len: u64,
    /// What the device does with it.
    pub prot: Prot,
}

/// The first access a walk or a view could not translate because nothing was mapped there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Miss {
    /// The first unmapped IOVA of the access (not the access's start: asking an IOTLB for the
    /// start again would loop when only the tail is missing).
    pub iova: Iova,
    /// The access that needed it.
    pub access: Prot,
}

/// What a walk of a request found.
#[derive(Debug)]
#[must_use]
pub enum SgWalk {
    /// Every buffer is mapped with its permission: held until the guard drops.
    Held(SgGuard),
    /// Some are not mapped (one miss per unmapped 4 KiB page, in order); nothing is held.
    Missed(Vec<Miss>),
}

/// One piece counted in the hold table, and the buffer it belongs to.
#[derive(Debug)]
struct Counted {
    buffer: usize,
    held: Held,
}

/// The pages of a request's buffers, held until dropped, and their host segments. See the
/// module documentation.
#[derive(Debug)]
pub struct SgGuard {
    space: DmaSpace,
    shard: usize,
    counted: Vec<Counted>,
    segments: Vec<Segment>,
    /// Per buffer, the end of its segments in `segments`.
    ends: Vec<usize>,
    /// Registry pins ([`DmaSpace::pin_sg`]).
    pins: Vec<PinRequest>,
    /// Written pieces of mappings that log dirty pages: marked again when the guard drops.
    dirty: Vec<(Arc<Mapping>, u64, u64)>,
}

impl SgGuard {
    /// The host segments of every buffer, in order (adjacent pieces contiguous on the host
    /// merged within a buffer).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The host segments of buffer `i` (empty for a buffer of 0 bytes).
    pub fn buffer(&self, i: usize) -> &[Segment] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.segments[start..self.ends[i]]
    }

    /// 4 KiB pages held, counted once per piece.
    pub fn pages(&self) -> u64 {
        self.counted.iter().map(|c| c.held.pages).sum()
    }

    /// Distinct 4 KiB IOVA pages under buffers `buffers` (a page two of them share counted
    /// once).
    pub fn buffer_pages(&self, buffers: std::ops::Range<usize>) -> u64 {
        let pieces = || {
            (self.counted.iter())
                .filter(|c| buffers.contains(&c.buffer))
                .map(|c| (c.held.iova, c.held.iova + c.held.pages))
        };
        // Pieces in ascending order (the usual request: buffers one after another) are
        // counted as they come, with no list sorted.
        if pieces().is_sorted() {
            return count_runs(pieces());
        }
        let mut runs: Vec<(u64, u64)> = (self.counted.iter())
            .filter(|c| buffers.contains(&c.buffer))
            .map(|c| (c.held.iova, c.held.iova + c.held.pages))
            .collect();
        runs.sort_unstable();
        count_runs(runs)
    }

    /// Lets go of everything counted so far (a walk that failed or missed).
    fn release(&mut self) {
        for req in self.pins.drain(..) {
            self.space.shared.registry.unpin(&req);
        }
        let page = self.space.shared.min_page;
        for (m, iova, n) in self.dirty.drain(..) {
            mark_dirty(&m, iova, n, page);
        }
        if self.counted.is_empty() {
            return;
        }
        let holds = &self.space.shared.holds;
        holds.with(self.shard, |s| {
            for c in &self.counted {
                let found = s.remove(&c.held);
                debug_assert!(found, "a guard let go of pages it did not hold");
            }
        });
        self.counted.clear();
        if holds.waiting.load(std::sync::atomic::Ordering::SeqCst) {
            // A change waits for holds to go (`retire`): wake it, under the lock it waits with.
            let _writer = self.space.writer();
            self.space.shared.settled.notify_all();
        }
    }
}

impl Drop for SgGuard {
    fn drop(&mut self) {
        self.release();
    }
}

/// A queue's reusable state for its walks (see the module documentation): its shard of the
/// hold table and the vectors a guard needs, kept between requests.
#[derive(Debug, Default)]
pub struct SgScratch {
    /// The queue it belongs to (its shard: [`Holds::shard_for`](crate::pin::holds::Holds)).
    queue: usize,
    counted: Vec<Counted>,
    segments: Vec<Segment>,
    ends: Vec<usize>,
}

impl SgScratch {
    /// The scratch of queue `queue` (any number; queues below 16 each get a shard of their
    /// own). Allocates nothing until used.
    pub fn for_queue(queue: u16) -> SgScratch {
        SgScratch {
            queue: usize::from(queue),
            ..SgScratch::default()
        }
    }

    /// Makes it queue `queue`'s (its shard), keeping its vectors: a pool of scratches can
    /// serve any queue.
    pub fn set_queue(&mut self, queue: u16) {
        self.queue = usize::from(queue);
    }

    /// The host segments of every buffer of the last [`DmaCursor::translate_sg_into`], in
    /// order (adjacent pieces contiguous on the host merged within a buffer).
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The host segments of buffer `i` of the last [`DmaCursor::translate_sg_into`] (empty
    /// for a buffer of 0 bytes).
    pub fn buffer(&self, i: usize) -> &[Segment] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] };
        &self.segments[start..self.ends[i]]
    }

    /// Lets go of `guard` (as dropping it does) and keeps its vectors for the next walk.
    pub fn recycle(&mut self, mut guard: SgGuard) {
        guard.release();
        // Keep the bigger of each pair: a walk's vectors grow to the biggest request's size.
        if guard.segments.capacity() > self.segments.capacity() {
            std::mem::swap(&mut self.segments, &mut guard.segments);
        }
        if guard.counted.capacity() > self.counted.capacity() {
            std::mem::swap(&mut self.counted, &mut guard.counted);
        }
        if guard.ends.capacity() > self.ends.capacity() {
            std::mem::swap(&mut self.ends, &mut guard.ends);
        }
        self.segments.clear();
        self.counted.clear();
        self.ends.clear();
    }
}

/// Pages under `runs` (`[start, end)` page numbers in ascending order), each counted once.
fn count_runs(runs: impl IntoIterator<Item = (u64, u64)>) -> u64 {
    let (mut pages, mut covered) = (0, 0);
    for (s, e) in runs {
        let s = s.max(covered);
        if e > s {
            pages += e - s;
            covered = e;
        }
    }
    pages
}

/// Why one try of a walk stopped.
enum Stop {
    Failed(Error),
    /// A mapping's host address is invalidated: wait for the update and walk again.
    Invalidated(u64),
}

impl DmaSpace {
    /// Holds the pages of a request's buffers and returns their host segments, in one walk of
    /// the address index: a pin that locks nothing (as [`DmaSpace::hold_pages`]), for a device
    /// whose I/O goes through this process's own mapping. Unmapped buffers come back as
    /// [`SgWalk::Missed`] with nothing held; the errors are in the module documentation. Takes
    /// no lock another thread's requests need.
    pub fn hold_sg(&self, bufs: &[SgBuf]) -> Result<SgWalk> {
        self.walk_sg(bufs, false, None)
    }

    /// [`DmaSpace::hold_sg`] with a queue's `scratch`: its pages counted in the queue's own
    /// shard, and the guard's vectors taken from the scratch (give them back with
    /// [`SgScratch::recycle`]), so that a walk allocates nothing once they have grown.
    pub fn hold_sg_into(&self, bufs: &[SgBuf], scratch: &mut SgScratch) -> Result<SgWalk> {
        self.walk_sg(bufs, false, Some(scratch))
    }

    /// [`DmaSpace::hold_sg`], and the pages locked and charged as [`DmaSpace::pin_pages`]
    /// locks them (ENOMEM past the locked-memory limit, with nothing held): for a device that
    /// needs its pages resident. The locking goes through the process's pin registry.
    pub fn pin_sg(&self, bufs: &[SgBuf]) -> Result<SgWalk> {
        self.walk_sg(bufs, true, None)
    }

    fn walk_sg(
        &self,
        bufs: &[SgBuf],
        lock: bool,
        mut scratch: Option<&mut SgScratch>,
    ) -> Result<SgWalk> {
        for b in bufs {
            check_buf(b)?;
        }
        let mut deadline = None;
        loop {
            match self.try_walk(bufs, lock, scratch.as_deref_mut()) {
                Ok(walk) => return Ok(walk),
                Err(Stop::Failed(e)) => return Err(e),
                Err(Stop::Invalidated(iova)) => {
                    let d = *deadline.get_or_insert_with(|| self.vaddr_deadline());
                    if self.vaddr_wait().is_zero() || !self.wait_for_vaddr(Iova(iova), d) {
                        return Err(Error::Busy {
                            addr: iova,
                            why: "its host address is invalidated for a live update; hold it \
                                  after update_vaddr"
                                .into(),
                        });
                    }
                }
            }
        }
    }

    fn try_walk(
        &self,
        bufs: &[SgBuf],
        lock: bool,
        scratch: Option<&mut SgScratch>,
    ) -> std::result::Result<SgWalk, Stop> {
        let holds = &self.shared.holds;
        let min_page = self.shared.min_page;
        let mut guard = match scratch {
            Some(s) => SgGuard {
                space: self.clone(),
                shard: holds.shard_for(s.queue),
                counted: std::mem::take(&mut s.counted),
                segments: std::mem::take(&mut s.segments),
                ends: std::mem::take(&mut s.ends),
                pins: Vec::new(),
                dirty: Vec::new(),
            },
            None => SgGuard {
                space: self.clone(),
                shard: holds.my_shard(),
                counted: Vec::new(),
                segments: Vec::new(),
                ends: Vec::with_capacity(bufs.len()),
                pins: Vec::new(),
                dirty: Vec::new(),
            },
        };
        let mut misses: Vec<Miss> = Vec::new();
        let mut lock_pieces: Vec<(Arc<Mapping>, u64, u64)> = Vec::new();
        // Buffer and offset the next batch starts at.
        let (mut at_buf, mut at_off) = (0usize, 0u64);
        while at_buf < bufs.len() {
            let stop = holds.with(guard.shard, |shard| {
                let snap = self.shared.current.load();
                let mut batch = 0u64;
                while at_buf < bufs.len() {
                    let b = bufs[at_buf];
                    if at_off >= b.len {
                        guard.ends.push(guard.segments.len());
                        (at_buf, at_off) = (at_buf + 1, 0);
                        continue;
                    }
                    let iova = b.iova.0 + at_off;
                    let end = b.iova.0 + (b.len - 1);
                    // The page table first (a small mapping's page, a big one's whole
                    // granule): it answers only for host memory allowed to the buffer that
                    // logs no dirty pages, so the record is not needed. Pinning needs it.
                    let fast = if lock {
                        None
                    } else {
                        snap.page_answer(iova, 1, b.prot)
                    };
                    let found = match fast {
                        Some((hot, start, last)) => Some((start, last, hot, None)),
                        None => snap.entry(iova).map(|(s, l, h, m)| (s, l, h, Some(m))),
                    };
                    let Some((start, last, hot, m)) = found else {
                        if misses.len() < SG_MISSES_MAX {
                            misses.push(Miss {
                                iova: Iova(iova),
                                access: if b.prot.contains(Prot::WRITE) {
                                    Prot::WRITE
                                } else {
                                    Prot::READ
                                },
                            });
                        }
                        // On to the next 4 KiB page: one miss per unmapped page.
                        let next = (iova & !(PAGE - 1)).saturating_add(PAGE);
                        at_off = if next > end { b.len } else { next - b.iova.0 };
                        continue;
                    };
                    if !hot.prot().contains(b.prot) || hot.remote() {
                        if !misses.is_empty() {
                            // Ask for what is missing first; the retry reports this.
                            return Ok(true);
                        }
                        return Err(Stop::Failed(refused(iova, start, last, hot, b.prot)));
                    }
                    if !hot.valid() {
                        return Err(Stop::Invalidated(iova));
                    }
                    // The piece inside this mapping, cut to what the batch has room for.
                    let room = (super::PIN_PAGES_MAX as u64 - batch) * PAGE - (iova % PAGE);
                    let n = (end.min(last) - iova + 1).min(room);
                    let hva = iova.wrapping_add(hot.delta());
                    at_off += n;
                    if !misses.is_empty() {
                        continue;
                    }
                    // Whole pages of the space's page size, counted in 4 KiB page numbers.
                    let first = iova / min_page * min_page;
                    let stop = (iova + (n - 1)) / min_page * min_page + min_page;
                    let pages = (stop - first) / PAGE;
                    let (ip, hp) = (first / PAGE, hva.wrapping_sub(iova - first) / PAGE);
                    let write = b.prot.contains(Prot::WRITE);
                    let held = Held {
                        iova: ip,
                        host: hp,
                        pages,
                        write,
                    };
                    shard.add(held);
                    guard.counted.push(Counted {
                        buffer: at_buf,
                        held,
                    });
                    let merged = guard.segments.len() > guard.ends.last().copied().unwrap_or(0)
                        && guard
                            .segments
                            .last()
                            .is_some_and(|s| s.hva.0.wrapping_add(s.len) == hva);
                    match guard.segments.last_mut() {
                        Some(s) if merged => s.len += n,
                        _ => guard.segments.push(Segment {
                            hva: Hva(hva),
                            len: n,
                        }),
                    }
                    if let (true, Some(m)) = (write && hot.dirty(), m) {
                        mark_dirty(m, iova, n, min_page);
                        guard.dirty.push((m.clone(), iova, n));
                    }
                    if let (true, Some(m)) = (lock, m) {
                        lock_pieces.push((
                            m.clone(),
                            first.wrapping_add(hot.delta()),
                            stop - first,
                        ));
                    }
                    batch += pages.min(super::PIN_PAGES_MAX as u64);
                    if batch >= super::PIN_PAGES_MAX as u64 {
                        // The next batch on a fresh snapshot, the shard's lock let go between.
                        return Ok(false);
                    }
                }
                Ok(false)
            });
            match stop {
                Ok(true) => break,
                Ok(false) => {}
                Err(stop) => return Err(stop),
            }
        }
        if !misses.is_empty() {
            guard.dirty.clear();
            return Ok(SgWalk::Missed(misses));
        }
        for (m, hva, len) in lock_pieces {
            let req = PinRequest {
                lock: true,
                ..self.shared.device_request(&m, hva, len)
            };
            // Outside the shard's lock: the registry's lock comes before a shard's.
            self.shared.registry.pin_only(&req).map_err(Stop::Failed)?;
            guard.pins.push(req);
        }
        Ok(SgWalk::Held(guard))
    }

    /// IOVA pages (4 KiB) held by scatter-gather guards now, counted once per shard.
    pub fn guard_held_pages(&self) -> u64 {
        self.shared.holds.iova_pages()
    }
}

/// A buffer's own errors, before any walk: no access asked (EINVAL), a wrapping range
/// (EINVAL).
fn check_buf(b: &SgBuf) -> Result<()> {
    if b.prot == Prot::default() {
        return Err(Error::NoAccess {
            what: format!("buffer at iova {} of {:#x} bytes", b.iova, b.len),
        });
    }
    if b.len > 0 && b.iova.0.checked_add(b.len - 1).is_none() {
        return Err(Error::RangeWraps {
            what: "scatter-gather buffer",
            start: b.iova.0,
            len: b.len,
        });
    }
    Ok(())
}

impl DmaCursor {
    /// [`DmaSpace::hold_sg_into`]. The hold walks the space's current snapshot, not the
    /// cursor's: an unmap must see the pages counted or the walk see the range closed.
    pub fn hold_sg_into(&mut self, bufs: &[SgBuf], scratch: &mut SgScratch) -> Result<SgWalk> {
        self.space.hold_sg_into(bufs, scratch)
    }

    /// Translates a request's buffers into `scratch` ([`SgScratch::buffer`] per buffer) from
    /// the cursor's snapshot (refreshed first), holding nothing and allocating nothing once
    /// the scratch has grown: for a device that keeps the pages from a discard and an unmap by
    /// other means. Fails whole, like [`DmaSpace::translate_sg`], if any byte is unmapped
    /// (EFAULT), not allowed (EPERM) or invalidated (EBUSY at once, no wait), and on the
    /// buffer errors of [`DmaSpace::hold_sg`]; written pages are marked dirty when tracking
    /// is on.
    pub fn translate_sg_into(&mut self, bufs: &[SgBuf], scratch: &mut SgScratch) -> Result<()> {
        scratch.segments.clear();
        scratch.ends.clear();
        self.refresh();
        for b in bufs {
            // Most buffers lie in one small mapping or one granule of a big one: the page
            // table's word, read through the cursor's region, answers for all of it, and the
            // buffer is one segment. Its checks are in the answer: an access asked (`prot` not
            // empty), allowed, on a valid mapping that logs no dirty pages, and the whole
            // length inside (which also refuses length 0 and a wrapping range, the table
            // ending below 512 GiB).
            let word = self.table_word(b.iova.0);
            if let Some((hot, _, last)) = word_answer(b.iova.0, b.len, word, b.prot) {
                if (b.len.wrapping_sub(1) <= last - b.iova.0) & (b.prot != Prot::default()) {
                    scratch.segments.push(Segment {
                        hva: Hva(b.iova.0.wrapping_add(hot.delta())),
                        len: b.len,
                    });
                    scratch.ends.push(scratch.segments.len());
                    continue;
                }
            }
            self.translate_buf_apart(b, scratch)?;
        }
        Ok(())
    }

    /// [`DmaCursor::translate_sg_into`] for a buffer the page table does not answer. Out of
    /// the loop and marked cold, though it is every buffer's path for a client above the
    /// table's window: inline (the cache check alone, or all of it), it cost a request the
    /// table answers more instructions (callgrind, header, data and status: 342 before the
    /// cache, 357-362 inline, 339 here), while the call costs a request above the window ~70
    /// of the ~700 the cache saves it (1,506 before, 755 inline, 827 here).
    #[cold]
    #[inline(never)]
    fn translate_buf_apart(&mut self, b: &SgBuf, scratch: &mut SgScratch) -> Result<()> {
        // Not in the table (a mapping above its window, as a client's own addresses are for
        // libblkio, or a mid-sized one): the mappings the last two buffers the table did not
        // answer were found in, as a request's header and status share one.
        if let Some(hva) = self.hit_answer(b.iova.0, b.len, b.prot) {
            scratch.segments.push(Segment {
                hva: Hva(hva),
                len: b.len,
            });
            scratch.ends.push(scratch.segments.len());
            return Ok(());
        }
        // Everything else: the buffer's own errors, then the sorted index, piece by piece.
        check_buf(b)?;
        if b.len == 0 {
            scratch.ends.push(scratch.segments.len());
            return Ok(());
        }
        let from = scratch.segments.len();
        let segments = &mut scratch.segments;
        let found = self.snapshot.for_each_piece(
            b.iova.0,
            b.len,
            b.prot,
            self.space.shared.min_page,
            Hot::VALID,
            |_, hva, n, _| {
                let hva = hva.expect("only host memory passes Hot::VALID");
                // Merged only with a piece of the same buffer.
                let merge = segments.len() > from;
                match segments.last_mut() {
                    Some(s) if merge && s.hva.0.wrapping_add(s.len) == hva => s.len += n,
                    _ => segments.push(Segment {
                        hva: Hva(hva),
                        len: n,
                    }),
                }
                true
            },
        )?;
        self.remember(&found);
        scratch.ends.push(scratch.segments.len());
        Ok(())
    }
}
