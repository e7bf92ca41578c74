//! Pinning host memory for DMA: the process-wide registry, batched pins, extents, unpin by run,
//! and the lock cache.
//!
//! In a process, a pin is a promise that a host page stays resident and where it is until it is
//! unpinned: the page is faulted in and locked — `mlock` does both, writable for private writable
//! memory, like `MADV_POPULATE_WRITE` — and, when the consumer programs a real IOMMU or does
//! IOVA-as-PA DMA, its physical frame read from `/proc/self/pagemap`. mlock does not nest — one munlock undoes any
//! number of mlocks — so nesting lives here: one [`PinRegistry`] per process counts pins per host
//! page ([`RunCounts`](counts) keyed by page number), across every DMA space, mapping and
//! device. Only a 0 -> 1 transition locks and is charged to the locked-memory account, only a
//! 1 -> 0 transition unlocks and is released; a page pinned through two IOVAs is locked and
//! charged once.
//!
//! **Holds.** A pin whose request does not ask for a lock (`PinRequest::lock` false, a device's
//! `hold_pages`) only counts its pages: nothing is locked, faulted in or charged, so no limit
//! can refuse it. What a hold keeps is what discarding looks at — `with_unheld_in` hands out
//! only pages neither locked nor counted — so a balloon in the same process never discards a
//! page under a hold. That is all a device needs whose access goes through this process's own
//! mapping (`preadv` / `pwritev`, io_uring, the CPU): the kernel faults the pages in as it
//! copies, and pins them itself for an `O_DIRECT` transfer. A lock is needed only where
//! memory must stay resident where it is without the kernel's help: DMA by physical frame
//! (Eager mappings, frames read from pagemap) and device pins of consumers that ask for it
//! (`pin_pages`). Pins and holds share the counts: a page both pinned and held stays locked
//! until the last of them goes.
//!
//! **Pinning goes in steps** of a batch of pages (512 by default, one 4 KiB page of pagemap entries
//! — the batch of the kernel patch "vfio/type1: Batch page pinning"). Per step, under the lock:
//! find the pages no one has pinned yet, check the limit, mlock those pages — one call per run of
//! them — and count; then, outside the lock, read the step's frames with one `pread` and extend the
//! extents (runs contiguous in both virtual and physical address) kept across steps. If any step
//! fails, every earlier step of the call is unpinned again: a pin is all or nothing. There is no
//! separate `MADV_POPULATE` pass: mlock faults pages in itself, and a second walk over 4 KiB pages
//! that are already present cost as much as the mlock (figures for this module:
//! `docs/measurements.md`, "Pins").
//!
//! **Unpinning goes by run** (as in "vfio/type1: optimize vfio_unpin_pages_remote() for large
//! folio"): one walk of the counts, one munlock and one accounting
//! update per run that drops to zero, however many pages or huge pages it spans. A batch of one
//! page turns both directions into the page-at-a-time baseline the benchmarks compare against.
//!
//! **Huge pages are whole units.** Counts are kept per 4 KiB page exactly as pinned, so any
//! pattern of pins and unpins balances; but a hugetlbfs page cannot be locked or unlocked in
//! part, and mlocking part of a transparent huge page splits its mapping into 4 KiB entries for
//! good. So what is locked and charged is the memory's huge page (the granule): it is locked
//! when the first of its 4 KiB pages is pinned and unlocked when the last one is unpinned —
//! decided per run by looking only at the run's two end units. A single pinned 4 KiB page of
//! THP memory therefore locks and charges 2 MiB, as it does on hugetlbfs.
//!
//! **The lock cache.** Locking one page in the middle of a larger memory area makes the kernel
//! split the area in three, and unlocking it merges them again: an mlock plus munlock of one
//! page costs ten times or more what a pin's own bookkeeping does, almost all of it that split
//! and merge — and devices pin and unpin the same few pages
//! (rings, bounce buffers, I/O buffers) over and over. So when a device's pin (`pin_pages`)
//! goes, its locks stay — whole units, no longer charged to the account, which says what is
//! pinned — in a bounded cache ([`Idle`]), and the next pin of that memory takes them back
//! without a system call. Pins of whole mappings (Eager mode) are unlocked at once: they go at
//! unmap time, when their memory may go too.
//!
//! *Bounds.* The cache holds at most 64 entries by default: every entry can split off two
//! kernel memory areas, and scattered locked areas make every other mlock and munlock of the
//! process dearer, more so the more there are;
//! 64 is also far below `vm.max_map_count`. It holds at most 64 MiB (32 huge pages), and at
//! most a quarter of any finite locked-memory limit, the registry's or the kernel's, so that it
//! never crowds out the locks other code in the process needs. Past a bound the least recently
//! used entry is unlocked. When pins keep missing it — pages spread over more memory than it
//! holds, as with guest I/O buffers all over a guest — the cache steps aside (see `CacheGate`)
//! instead of making every miss dearer, and comes back when pins hit again.
//!
//! *Limits.* The kernel must never see more locked than the limit: before an mlock the cache
//! gives up entries until the registry's locks plus the new ones fit, and if the kernel still
//! refuses (its count covers every lock of the process), every cache — of every registry — is
//! emptied and the mlock tried once more; a pin never fails because of cached locks.
//!
//! **Long-term pins** ([`PinRegistry::set_long_term_pins`], off by default). A registry can
//! hold pages with the kernel's own pin instead of mlock — `pin_user_pages(FOLL_LONGTERM)`, the
//! pin VFIO type1 takes, reached through an io_uring buffer table (`longterm`). It changes no
//! memory area, so a pin that misses the lock cache costs several times less than the mlock's
//! pin and unpin. Everything above holds as it is — counts, units, the cache, the
//! account, limits: "locked" below means held either way, and a page the kernel will not pin
//! long-term is mlocked. The kernel shows such pages in `VmPin`, not `VmLck`, and lets
//! `MADV_DONTNEED` detach them from the process instead of refusing it. On hugetlbfs a unit
//! held alone is pinned through one of its pages (the kernel pins the huge page whole), so a
//! 1 GiB page costs what a 4 KiB one does.
//!
//! *Lifetime.* Cached locks go before anything could trip over them: a discard unlocks those in
//! its range first (`MADV_DONTNEED` and `MADV_REMOVE` refuse locked memory), an unmap, vaddr or
//! IOTLB invalidation those in its mappings' memory (which may be unmapped right after, and a
//! later pin of other memory at the same address must really lock it), a dropped space those
//! in all of its mappings, and [`PinRegistry::release_cached`] all of them.
//!
//! Locking order: a DMA space's writer lock, then this registry's lock, then the hold tables
//! (`holds`); nothing here calls up.
//! Whoever must not race a pin (discarding memory) takes the registry's lock too.
//!
//! This file is long because the registry's state, its pin and unpin steps and the lock cache's
//! admission all work under one lock on the same invariants (pin counts, locked set, account);
//! the parts that stand alone are the submodules (`account`, `counts`, `locked`, `longterm`).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

mod account;
pub(crate) mod counts;
mod gate;
pub(crate) mod holds;
mod locked;
mod longterm;

use crate::addr::{Hva, PAGE_4K as PAGE};
use crate::error::{Error, Result};
use crate::sync::lock;
use account::{Account, Capability, capable};
use counts::RunCounts;
use holds::Holds;
use locked::{Idle, Locked};
use longterm::LongTerm;

pub use account::LockLimit;
pub use gate::DiscardGate;
pub(crate) use gate::subtract as subtract_kept;

/// Pages per step when pinning: one 4 KiB page of pagemap entries, as in the kernel patch
/// "vfio/type1: Batch page pinning".
pub const PIN_BATCH: usize = 512;

/// Pages per step when pinning long-term (64 MiB): each step is one buffer in the kernel's
/// tables, of which there are 16,384, so steps of [`PIN_BATCH`] would pin at most 32 GiB
/// long-term; 64 MiB steps reach 1 TiB, and hold the registry's lock about a millisecond each.
const LONG_TERM_STEP: u64 = 16384;

/// Default bound of the lock cache in bytes; see the module documentation.
const LOCK_CACHE_BYTES: u64 = 64 << 20;

/// Default bound of the lock cache in entries; see the module documentation.
const LOCK_CACHE_ENTRIES: usize = 64;

/// Locks freed in one piece larger than this are unlocked at once, never cached: what one
/// `pin_pages` call can pin (512 pages, or the two huge pages they can touch) fits.
const KEEP_MAX_PAGES: u64 = 1024;

/// One piece of pinned memory, contiguous in host virtual address and, when frames were asked
/// for, in physical frame numbers: the unit a hardware IOMMU would be programmed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostExtent {
    /// First byte.
    pub hva: Hva,
    /// Bytes.
    pub len: u64,
    /// Physical frame number of the first page, when frames were read.
    pub pfn: Option<u64>,
}

/// What to pin.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PinRequest {
    /// First byte, page aligned.
    pub hva: u64,
    /// Bytes, a page multiple.
    pub len: u64,
    /// The memory's page size: pins are rounded out to it.
    pub granule: u64,
    /// Whether the memory's huge pages never split (hugetlbfs, not THP): the kernel pins such
    /// a page whole when any page of it is pinned long-term.
    pub unsplittable: bool,
    /// Whether the kernel may back 4 KiB units of the memory with larger folios (transparent
    /// huge pages): long-term buffers within the same 2 MiB then go to different tables.
    pub large_folios: bool,
    /// Pages per step; 1 is the page-at-a-time baseline.
    pub batch: usize,
    /// Read physical frames and return extents split where frames are not consecutive.
    pub frames: bool,
    /// On unpin, keep the locks no pin needs any more in the lock cache instead of unlocking
    /// them (a device's short-lived pins); whoever sets it must have the cache emptied over the
    /// memory before the memory can go ([`PinRegistry::release_cached_in`]).
    pub keep: bool,
    /// Hold the pages resident (lock them, or pin them long-term) and charge them. False: a
    /// *hold* — the pages are counted, so discards skip them, and nothing is locked or charged
    /// (see the module documentation, "Holds").
    pub lock: bool,
}

impl PinRequest {
    /// The 4 KiB pages the pin counts (`hva` and `len` are page multiples; the end may be
    /// the top of the address space).
    fn pages(&self) -> (u64, u64) {
        (self.hva / PAGE, self.hva / PAGE + self.len.div_ceil(PAGE))
    }

    /// Pages `[start, end)` rounded out to whole units: what pinning them locks.
    fn units(&self, start: u64, end: u64) -> (u64, u64) {
        let unit = self.unit();
        (start / unit * unit, end.div_ceil(unit) * unit)
    }

    /// The granule in pages.
    fn unit(&self) -> u64 {
        (self.granule / PAGE).max(1)
    }

    /// Pages of a huge page the kernel pins whole: the unit where huge pages never split,
    /// else 1.
    fn folio(&self) -> u64 {
        if self.unsplittable { self.unit() } else { 1 }
    }
}

/// The units (granule-aligned page ranges of `unit` pages) that the run `[s, e)` — pages whose
/// count just dropped to zero — frees, as one range: those with no other counted page. Only the
/// run's two end units can hold other pages, so only they are looked at.
fn whole_units(pages: &RunCounts, s: u64, e: u64, unit: u64) -> Option<(u64, u64)> {
    let mut us = s / unit * unit;
    let mut ue = e.div_ceil(unit) * unit;
    if us < s && pages.any_counted(us, s) {
        us += unit;
    }
    if e < ue && pages.any_counted(e, ue) {
        ue -= unit;
    }
    (us < ue).then_some((us, ue))
}

/// Whether a failed mlock may have failed for want of room under a locked-memory limit
/// (ENOMEM past `RLIMIT_MEMLOCK`, EAGAIN when some pages could not be locked).
fn lacks_room(e: &Error) -> bool {
    matches!(e, Error::Os { .. }) && matches!(e.errno(), libc::ENOMEM | libc::EAGAIN)
}

struct State {
    /// Pins per 4 KiB host page.
    pages: RunCounts,
    /// What is held on the pins' behalf (mlocked, or pinned long-term): whole units around
    /// pinned pages, the lock cache, and locks whose munlock failed. The kernel's `VmLck` plus
    /// `VmPin` for this memory is exactly this.
    locked: Locked,
    /// The part of `locked` no pin needs: the lock cache. The account charges `locked` minus
    /// this.
    idle: Idle,
    /// The cache's bounds: bytes (0: no cache) and entries.
    cache_bytes: u64,
    cache_entries: usize,
    /// How useful the cache has been lately.
    gate: CacheGate,
    /// Scratch lists kept between calls, so that a pin or unpin allocates nothing.
    zero: Vec<(u64, u64)>,
    taken: Vec<(u64, u64, u64)>,
    new: Vec<(u64, u64)>,
    pieces: Vec<(u64, u64, u64)>,
    gaps: Vec<(u64, u64)>,
    /// Runs a munlock failed for (the kernel could not split the area, e.g. at
    /// `vm.max_map_count`): still locked and charged, tried again at the next pin or unpin.
    stuck: Vec<(u64, u64)>,
    account: Account,
    /// The part of `locked` held by long-term pins instead of mlocks, once they were turned on.
    long_term: Option<LongTerm>,
    /// Whether new locks are long-term pins (else mlocks).
    use_long_term: bool,
    long_term_counts: LongTermCounts,
    /// TEST ONLY: [`Faults::count_refused_locks`](crate::faults::Faults::count_refused_locks).
    #[cfg(feature = "test-hooks")]
    count_refused_locks: bool,
}

impl State {
    /// Unlocks and releases what the pages of `runs` (no longer pinned) held locked: the units
    /// of every lock around them that no pin is left in — or, with `keep`, moves them to the
    /// lock cache (released from the account, still locked). A munlock that fails leaves its
    /// pages locked, charged and remembered in `stuck`.
    fn release(&mut self, runs: &[(u64, u64)], keep: bool) {
        let keep = keep && self.cache_bytes > 0 && self.cache_entries > 0 && self.gate.admit();
        for &(s, e) in runs {
            for unit in self.locked.units_around(s, e).iter() {
                let Some((us, ue)) = whole_units(&self.pages, s, e, unit) else {
                    continue;
                };
                // A unit freed whole may hold cached pages already (the same memory pinned in
                // two granules): count them as charged, like the rest of the unit.
                let cached = self.idle.remove_in(us, ue);
                self.account.force_charge(cached * PAGE);
                if keep && ue - us <= KEEP_MAX_PAGES {
                    let (locked, idle, account) = (&self.locked, &mut self.idle, &mut self.account);
                    for (a, b, u) in locked.pieces_iter(us, ue) {
                        account.release((b - a) * PAGE);
                        idle.insert(a, b, u);
                    }
                    continue;
                }
                let mut pieces = std::mem::take(&mut self.pieces);
                self.locked.remove_into(us, ue, &mut pieces);
                for &(a, b, u) in &pieces {
                    if self.unlock_pages(a, b).is_ok() {
                        self.account.release((b - a) * PAGE);
                    } else {
                        self.locked.insert(a, b, u);
                        self.stuck.push((a, b));
                    }
                }
                self.pieces = pieces;
            }
        }
        if keep {
            self.trim_cache();
        }
    }

    /// The account charges exactly what is locked for pins: everything locked but the cache.
    fn check_account(&self) {
        debug_assert_eq!(
            self.account.locked(),
            (self.locked.pages() - self.idle.pages()) * PAGE
        );
    }

    /// Tries the failed munlocks again (their pages may since have been pinned again, which
    /// keeps them).
    fn retry_stuck(&mut self) {
        if self.stuck.is_empty() {
            return;
        }
        let stuck = std::mem::take(&mut self.stuck);
        let free: Vec<(u64, u64)> = stuck
            .iter()
            .flat_map(|&(s, e)| self.pages.gaps(s, e))
            .collect();
        self.release(&free, false);
    }

    /// The most bytes the cache may hold now: its bound, and a quarter of any finite limit.
    fn cache_cap(&self) -> u64 {
        let cap = self.cache_bytes;
        self.account.cap().map_or(cap, |limit| cap.min(limit / 4))
    }

    /// Unlocks the least recently used cached locks until the cache is within its bounds.
    fn trim_cache(&mut self) {
        let cap = self.cache_cap();
        let entries = self.gate.entries(self.cache_entries);
        while self.idle.pages() * PAGE > cap || self.idle.len() > entries {
            if !self.evict_oldest() {
                break;
            }
            self.gate.evicted();
        }
    }

    /// Unlocks the least recently used cached lock; false if the cache is empty.
    fn evict_oldest(&mut self) -> bool {
        match self.idle.pop_oldest() {
            Some((s, e, _)) => {
                self.unlock_cached(s, e);
                true
            }
            None => false,
        }
    }

    /// Unlocks every cached lock overlapping pages `[start, end)`.
    fn release_cached_in(&mut self, start: u64, end: u64) {
        if self.idle.is_empty() {
            return;
        }
        for (s, e, _) in self.idle.remove_overlapping(start, end) {
            self.unlock_cached(s, e);
        }
    }

    /// Unlocks `[start, end)`, just taken out of the cache. If the munlock fails the pages stay
    /// locked: charged and remembered in `stuck`, like any lock that could not be undone.
    fn unlock_cached(&mut self, start: u64, end: u64) {
        if self.unlock_pages(start, end).is_ok() {
            self.locked.remove(start, end);
        } else {
            self.account.force_charge((end - start) * PAGE);
            self.stuck.push((start, end));
        }
    }

    /// Makes units `[us, ue)` (of `unit` pages) held for a pin: cached locks there are taken
    /// back, what is not locked is locked, and both are charged. All or nothing. If the kernel
    /// refuses the mlock for want of room, the cache is emptied and the mlock tried once more.
    fn hold(&mut self, us: u64, ue: u64, req: &PinRequest) -> Result<()> {
        let done = self.hold_once_more(us, ue, req);
        #[cfg(feature = "test-hooks")]
        if let Err(e) = &done {
            self.test_count_refused(us, ue, e);
        }
        done
    }

    /// TEST ONLY (feature `test-hooks`): with
    /// [`Faults::count_refused_locks`](crate::faults::Faults::count_refused_locks) (set with
    /// [`PinRegistry::set_faults`]), a hold refused for want of room leaves the pages it asked for
    /// charged (a rollback that forgets to uncount), so the registry's account says more is
    /// locked than `VmLck`. A negative control for the registry-equals-`VmLck` checks; nothing
    /// else should use it.
    #[cfg(feature = "test-hooks")]
    fn test_count_refused(&mut self, us: u64, ue: u64, e: &Error) {
        let on = self.count_refused_locks;
        if !on || !(lacks_room(e) || matches!(e, Error::LockLimit { .. })) {
            return;
        }
        let gaps = self.locked.gaps(us, ue);
        for (s, e) in gaps {
            self.account.force_charge((e - s) * PAGE);
        }
    }

    /// [`State::hold`]: if the kernel refuses the mlock for want of room, the cache is emptied
    /// and the mlock tried once more.
    fn hold_once_more(&mut self, us: u64, ue: u64, req: &PinRequest) -> Result<()> {
        match self.try_hold(us, ue, req) {
            Err(e) if lacks_room(&e) => {
                // The kernel's limit may have changed (a lower rlimit, CAP_IPC_LOCK dropped).
                self.account.refresh();
                if self.idle.is_empty() {
                    return Err(e);
                }
                while self.evict_oldest() {}
                self.try_hold(us, ue, req)
            }
            done => done,
        }
    }

    fn try_hold(&mut self, us: u64, ue: u64, req: &PinRequest) -> Result<()> {
        let mut taken = std::mem::take(&mut self.taken);
        let mut new = std::mem::take(&mut self.new);
        taken.clear();
        new.clear();
        let done = self.try_hold_with(us, ue, req, &mut taken, &mut new);
        self.taken = taken;
        self.new = new;
        done
    }

    /// [`State::try_hold`], with `taken` (empty) to collect what the cache gives back and `new`
    /// (empty) what must be locked anew.
    fn try_hold_with(
        &mut self,
        us: u64,
        ue: u64,
        req: &PinRequest,
        taken: &mut Vec<(u64, u64, u64)>,
        new: &mut Vec<(u64, u64)>,
    ) -> Result<()> {
        self.idle.take(us, ue, taken);
        if !taken.is_empty() {
            self.gate.hit();
        }
        let taken_bytes: u64 = taken.iter().map(|(s, e, _)| (e - s) * PAGE).sum();
        if !self.locked.covers(us, ue) {
            self.locked.gaps_into(us, ue, new);
        }
        let new_bytes: u64 = new.iter().map(|(s, e)| (e - s) * PAGE).sum();
        if let Err(e) = self.account.charge(taken_bytes + new_bytes) {
            self.idle.give_back(taken);
            return Err(e);
        }
        if new.is_empty() {
            return Ok(());
        }
        self.make_room(new_bytes);
        for (i, &(s, e)) in new.iter().enumerate() {
            if let Err(err) = self.lock_pages(s, e, req) {
                // A failed mlock may have locked part of its range (the areas before the one
                // that could not be split or faulted in): undo it with the others.
                self.account.release(taken_bytes + new_bytes);
                for &(s, e) in &new[..=i] {
                    if self.unlock_pages(s, e).is_err() {
                        self.locked.insert(s, e, req.unit());
                        self.account.force_charge((e - s) * PAGE);
                        self.stuck.push((s, e));
                    }
                }
                self.idle.give_back(taken);
                return Err(err);
            }
        }
        for &(s, e) in new.iter() {
            self.locked.insert(s, e, req.unit());
        }
        Ok(())
    }

    /// Holds pages `[s, e)`, none of them held yet: what lies in a long-term buffer (let go
    /// earlier, pinned until the rest of the buffer goes) is taken back as it is; the rest is
    /// pinned long-term when those are on and the kernel takes it, else mlocked, as `req` says
    /// its memory is pinned. On error part of the range may be held: the caller lets go of all
    /// of it ([`State::unlock_pages`]).
    fn lock_pages(&mut self, s: u64, e: u64, req: &PinRequest) -> Result<()> {
        let Some(long_term) = self.long_term.as_mut() else {
            return mlock(s, e);
        };
        let mut gaps = std::mem::take(&mut self.gaps);
        gaps.clear();
        long_term.revive(s, e, &mut gaps);
        let mut done = Ok(());
        for &(a, b) in &gaps {
            if self.use_long_term {
                // Refused — a page that cannot be pinned for writing (read-only memory, a
                // MAP_SHARED ext4 file), the user's locked-memory limit, full tables — it is
                // locked the other way.
                if long_term.pin(a, b, req.folio(), req.large_folios).is_ok() {
                    self.long_term_counts.pinned += 1;
                    continue;
                }
                self.long_term_counts.fallbacks += 1;
            }
            if let Err(err) = mlock(a, b) {
                done = Err(err);
                break;
            }
        }
        self.gaps = gaps;
        done
    }

    /// Lets go of pages `[s, e)`: munlocks what lies in no long-term buffer, then lets the
    /// buffers go of the rest (a buffer is unpinned with its last page). On error (a munlock
    /// failed) no long-term pin was let go.
    fn unlock_pages(&mut self, s: u64, e: u64) -> Result<()> {
        let Some(long_term) = self.long_term.as_mut().filter(|l| l.pages() > 0) else {
            return munlock(s, e);
        };
        let mut gaps = std::mem::take(&mut self.gaps);
        gaps.clear();
        long_term.gaps(s, e, &mut gaps);
        let mut done = Ok(());
        for &(a, b) in &gaps {
            if let Err(err) = munlock(a, b) {
                done = Err(err);
                break;
            }
        }
        if done.is_ok() {
            gaps.clear();
            long_term.unpin(s, e, &mut gaps);
        }
        self.gaps = gaps;
        done
    }

    /// Unlocks cached locks, oldest first, until what is locked plus `bytes` more fits under
    /// the limit (the registry's and the kernel's, as last read).
    fn make_room(&mut self, bytes: u64) {
        if let Some(limit) = self.account.cap() {
            while self.locked.pages() * PAGE + bytes > limit && self.evict_oldest() {}
        }
    }
}

/// Whether the lock cache pays: it counts, over epochs of [`CacheGate::EPOCH`] events, the pins it
/// served (hits) and the entries it had to unlock unused (evictions). When the last epoch had
/// more than four evictions per hit — pins spread over more memory than the cache holds, as
/// with guest I/O buffers all over guest memory — every cached entry costs without paying back:
/// each one splits off kernel memory areas, which makes every other mlock and munlock dearer,
/// and evicting it costs the munlock the unpin
/// would have made. Then the cache goes into bypass: it admits only every [`CacheGate::PROBE`]-th
/// unpin's locks and holds an eighth of its entries, which keeps measuring, and it comes back
/// when an epoch sees hits again.
#[derive(Debug, Default)]
struct CacheGate {
    hits: u32,
    evictions: u32,
    bypass: bool,
    /// Unpins since the last one admitted in bypass.
    skipped: u32,
}

impl CacheGate {
    const EPOCH: u32 = 64;
    const PROBE: u32 = 8;

    fn hit(&mut self) {
        self.hits += 1;
        self.tick();
    }

    fn evicted(&mut self) {
        self.evictions += 1;
        self.tick();
    }

    fn tick(&mut self) {
        if self.hits + self.evictions >= Self::EPOCH {
            self.bypass = self.hits.saturating_mul(4) < self.evictions;
            self.hits = 0;
            self.evictions = 0;
        }
    }

    /// Whether an unpin may keep its locks.
    fn admit(&mut self) -> bool {
        if !self.bypass {
            return true;
        }
        self.skipped += 1;
        if self.skipped < Self::PROBE {
            return false;
        }
        self.skipped = 0;
        true
    }

    /// The entries the cache may hold, out of `max`.
    fn entries(&self, max: usize) -> usize {
        if self.bypass { (max / 8).max(1) } else { max }
    }
}

/// What long-term pins did ([`PinRegistry::long_term_counts`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LongTermCounts {
    /// Runs of pages held with a long-term pin (one per run a pin had to hold anew).
    pub pinned: u64,
    /// Runs the kernel would not pin long-term, mlocked instead (read-only memory, a
    /// `MAP_SHARED` file on a filesystem without long-term pins, the user's locked-memory
    /// limit, every buffer table full).
    pub fallbacks: u64,
}

/// The registry's and the kernel's count of locked memory at one moment
/// ([`PinRegistry::kernel_check`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCheck {
    /// Bytes the registry holds locked or pinned long-term: pinned units, the lock cache, and
    /// locks a munlock could not undo.
    pub held_bytes: u64,
    /// The part of it charged to the account (everything but the lock cache).
    pub charged_bytes: u64,
    /// The part of it in the lock cache.
    pub cached_bytes: u64,
    /// The part of it held by long-term pins.
    pub long_term_bytes: u64,
    /// The process's `VmLck` from `/proc/self/status` (memory mlocked), in bytes (`None` where
    /// the kernel does not show it).
    pub vm_lck: Option<u64>,
    /// The process's `VmPin` from `/proc/self/status` (pages pinned long-term), in bytes
    /// (`None` where the kernel does not show it).
    pub vm_pin: Option<u64>,
}

/// The value of a `Name:   N kB` line of `/proc/self/status`, in KiB.
fn status_kib(status: &str, name: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Every registry of the process, so that one the kernel refuses an mlock can empty the others'
/// caches (the kernel counts every lock of the process against one rlimit).
static REGISTRIES: Mutex<Vec<Weak<PinRegistry>>> = Mutex::new(Vec::new());

/// Pin counts for every host page of the process, the locked-memory account and the lock cache.
///
/// mlock is process-wide, so there should be one registry per process: [`PinRegistry::global`],
/// which every [`DmaSpace`](crate::DmaSpace) uses unless its config names another. Separate
/// registries are safe only over memory no other registry pins (tests, benchmarks).
pub struct PinRegistry {
    state: Mutex<State>,
    /// Whether the lock cache held anything when `state` was last unlocked (written under the
    /// lock, by [`StateGuard`]'s drop): [`PinRegistry::release_cached_in`] reads it first
    /// and skips the lock when the cache is empty, as it nearly always is for an IOTLB (whose
    /// every invalidated mapping asks).
    cached: AtomicBool,
    pagemap: OnceLock<std::result::Result<File, String>>,
    /// The hold tables of the spaces' guards (`holds`): discards look at them too.
    holds: Mutex<Vec<Weak<Holds>>>,
    /// Engines that keep memory pinned on their own and give it up before a discard.
    gates: gate::Gates,
}

impl std::fmt::Debug for PinRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("PinRegistry")
            .field("pinned_pages", &st.pages.pages())
            .field("locked_bytes", &st.account.locked())
            .field("cached_bytes", &(st.idle.pages() * PAGE))
            .field("limit", &st.account.limit())
            .field("long_term_pins", &st.use_long_term)
            .finish()
    }
}

impl Drop for PinRegistry {
    /// Unlocks what the cache still holds (spaces empty it over their memory when they go, so
    /// normally nothing).
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        while st.evict_oldest() {}
    }
}

/// The registry's state, locked; on unlocking it records whether the lock cache holds
/// anything (`PinRegistry::cached`), so that a release over memory with nothing cached takes
/// no lock.
struct StateGuard<'a> {
    state: MutexGuard<'a, State>,
    cached: &'a AtomicBool,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Drop for StateGuard<'_> {
    /// Runs before the mutex is unlocked (the guard field drops after this).
    fn drop(&mut self) {
        self.cached
            .store(!self.state.idle.is_empty(), Ordering::Release);
    }
}

impl PinRegistry {
    /// A registry of its own, held to `limit`, with the lock cache at its default bounds
    /// (64 MiB, 64 entries; see [`PinRegistry::set_lock_cache`]).
    pub fn new(limit: LockLimit) -> Arc<Self> {
        let registry = Arc::new(PinRegistry {
            state: Mutex::new(State {
                pages: RunCounts::default(),
                locked: Locked::default(),
                idle: Idle::default(),
                cache_bytes: LOCK_CACHE_BYTES,
                cache_entries: LOCK_CACHE_ENTRIES,
                gate: CacheGate::default(),
                stuck: Vec::new(),
                zero: Vec::new(),
                taken: Vec::new(),
                new: Vec::new(),
                pieces: Vec::new(),
                account: Account::new(limit),
                gaps: Vec::new(),
                long_term: None,
                use_long_term: false,
                long_term_counts: LongTermCounts::default(),
                #[cfg(feature = "test-hooks")]
                count_refused_locks: false,
            }),
            cached: AtomicBool::new(false),
            pagemap: OnceLock::new(),
            holds: Mutex::new(Vec::new()),
            gates: gate::Gates::default(),
        });
        let mut all = lock(&REGISTRIES);
        all.retain(|r| r.strong_count() > 0);
        all.push(Arc::downgrade(&registry));
        registry
    }

    /// The process's registry, held to `RLIMIT_MEMLOCK` unless [`PinRegistry::set_limit`] says
    /// otherwise.
    pub fn global() -> Arc<Self> {
        static GLOBAL: OnceLock<Arc<PinRegistry>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| PinRegistry::new(LockLimit::Rlimit))
            .clone()
    }

    /// TEST ONLY (feature `test-hooks`): the registry's switches from `faults`
    /// ([`Faults::count_refused_locks`](crate::faults::Faults::count_refused_locks)). The
    /// registry is process state made before the server knows its faults, so they are set once
    /// it does, before anything pins.
    #[cfg(feature = "test-hooks")]
    pub fn set_faults(&self, faults: &crate::faults::Faults) {
        self.lock().count_refused_locks = faults.count_refused_locks;
    }

    /// Changes the limit. Pins already held stay; the next pin is checked against the new one,
    /// and the lock cache shrinks at once to fit it.
    pub fn set_limit(&self, limit: LockLimit) {
        let mut st = self.lock();
        st.account.set_limit(limit);
        st.trim_cache();
        st.make_room(0);
    }

    /// The limit pins are held to.
    pub fn limit(&self) -> LockLimit {
        self.lock().account.limit()
    }

    /// Turns long-term pins on or off for the pages pins hold from now on.
    ///
    /// On, a page is held with the kernel's own long-term pin (`pin_user_pages` with
    /// `FOLL_LONGTERM`, what VFIO type1 pins guest memory with), reached through an io_uring
    /// buffer table, instead of `mlock`: no memory area is split or merged, so a pin of a page
    /// no lock holds costs about a sixth of an mlock. The kernel then counts those pages in
    /// `VmPin` instead of `VmLck`, and without `CAP_IPC_LOCK` charges them to the user's
    /// locked memory. A page the kernel will not pin this way — memory that cannot be written,
    /// `MAP_SHARED` files on filesystems such as ext4, past the user's limit or the table's
    /// 16,384 buffers — is mlocked as before. Pages held already stay held the way they were.
    ///
    /// Know before turning it on: `MADV_DONTNEED` (or `munmap`) of memory a long-term pin holds
    /// succeeds, and the pinned page lives on apart from the process's mapping until it is
    /// unpinned, so what a device then writes there is lost — as under VFIO type1. memvisor's
    /// own discards skip pinned pages either way; a VMM that discards guest memory behind
    /// memvisor's back would, with mlocks, have been refused (EINVAL).
    ///
    /// Fails (EOPNOTSUPP, with the reason) where the process may not use io_uring (a seccomp
    /// profile, `kernel.io_uring_disabled`); pins then stay mlocks.
    pub fn set_long_term_pins(&self, on: bool) -> Result<()> {
        let mut st = self.lock();
        if on && st.long_term.is_none() {
            st.long_term = Some(LongTerm::open()?);
        }
        st.use_long_term = on;
        Ok(())
    }

    /// Whether pins hold new pages with long-term pins ([`PinRegistry::set_long_term_pins`]).
    pub fn long_term_pins(&self) -> bool {
        self.lock().use_long_term
    }

    /// How often pins were held long-term, and how often the kernel refused and they were
    /// mlocked instead, since the registry was made.
    pub fn long_term_counts(&self) -> LongTermCounts {
        self.lock().long_term_counts
    }

    /// Bytes the kernel pins long-term for this registry: what it shows of the registry in the
    /// process's `VmPin` where the memory's huge pages are the registry's units. Pages held
    /// long-term (the lock cache's included) are in it, and so are pages let go of whose
    /// buffer still holds others: the kernel unpins a buffer whole, with its last page.
    /// Memory pinned in 4 KiB units but backed by transparent huge pages shows more in
    /// `VmPin` (each buffer is charged its huge pages whole).
    pub fn long_term_bytes(&self) -> u64 {
        self.lock()
            .long_term
            .as_ref()
            .map_or(0, |l| l.pages() * PAGE)
    }

    /// What the registry holds locked and what the kernel says the process holds, read at the
    /// same moment: under the registry's lock, so no pin or unpin comes in between. Where the
    /// process locks memory only through this registry, `held_bytes` equals `vm_lck + vm_pin`
    /// (with long-term pins over THP memory `vm_pin` can be more; see
    /// [`PinRegistry::long_term_bytes`]).
    pub fn kernel_check(&self) -> KernelCheck {
        let st = self.lock();
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        KernelCheck {
            held_bytes: st.locked.pages() * PAGE,
            charged_bytes: st.account.locked(),
            cached_bytes: st.idle.pages() * PAGE,
            long_term_bytes: st.long_term.as_ref().map_or(0, |l| l.pages() * PAGE),
            vm_lck: status_kib(&status, "VmLck:").map(|k| k * 1024),
            vm_pin: status_kib(&status, "VmPin:").map(|k| k * 1024),
        }
    }

    /// Bytes locked by pins now (each page once, however often it is pinned): what is charged
    /// against the limit. The lock cache is not in it; see [`PinRegistry::cached_bytes`].
    pub fn locked_bytes(&self) -> u64 {
        self.lock().account.locked()
    }

    /// Bytes the lock cache keeps locked although no pin holds them. The kernel's count of this
    /// registry's locks (the process's `VmLck`, plus `VmPin` for long-term pins) is
    /// [`PinRegistry::locked_bytes`] plus this.
    pub fn cached_bytes(&self) -> u64 {
        self.lock().idle.pages() * PAGE
    }

    /// The cached locks as `(first byte, bytes)`, in address order.
    pub fn cached(&self) -> Vec<(Hva, u64)> {
        self.lock()
            .idle
            .runs()
            .map(|(s, e, _)| (Hva(s * PAGE), (e - s) * PAGE))
            .collect()
    }

    /// Bounds the lock cache to `max_bytes` and `max_entries` (either 0 turns it off), unlocking
    /// the oldest cached locks past the new bounds at once.
    pub fn set_lock_cache(&self, max_bytes: u64, max_entries: usize) {
        let mut st = self.lock();
        st.cache_bytes = max_bytes;
        st.cache_entries = max_entries;
        st.trim_cache();
    }

    /// The lock cache's bounds: `(bytes, entries)`.
    pub fn lock_cache(&self) -> (u64, usize) {
        let st = self.lock();
        (st.cache_bytes, st.cache_entries)
    }

    /// Unlocks everything the lock cache holds: afterwards the registry holds locked exactly
    /// what is pinned. Call it when devices will not pin again for a while.
    pub fn release_cached(&self) {
        let mut st = self.lock();
        while st.evict_oldest() {}
        st.check_account();
    }

    /// Unlocks the cached locks overlapping host bytes `[start, end)`: their memory is about to
    /// be unmapped or changed.
    pub(crate) fn release_cached_in(&self, start: u64, end: u64) {
        // Acquire: pairs with the store made under the lock when an entry came in, so an entry
        // cached before this call (by an unpin that happened before it) is seen. An entry
        // cached concurrently could as well have come just after the locked release.
        if !self.cached.load(Ordering::Acquire) {
            return;
        }
        let mut st = self.lock();
        st.release_cached_in(start / PAGE, end.div_ceil(PAGE));
        st.check_account();
    }

    /// How many pins and holds keep the host page containing `hva`, those of in-flight
    /// scatter-gather guards included.
    pub fn pin_count(&self, hva: Hva) -> u64 {
        let page = hva.0 / PAGE;
        let own = self.lock().pages.count(page);
        own + self
            .hold_tables()
            .iter()
            .map(|h| h.host_count(page))
            .sum::<u64>()
    }

    /// Host pages (4 KiB) that in-flight scatter-gather guards hold, each once per table.
    pub fn guard_held_pages(&self) -> u64 {
        self.hold_tables().iter().map(|h| h.host_pages()).sum()
    }

    /// Makes a space's hold table seen by discards ([`PinRegistry::with_unheld_in`]).
    pub(crate) fn register_holds(&self, holds: &std::sync::Arc<Holds>) {
        let mut all = lock(&self.holds);
        all.retain(|h| h.strong_count() > 0);
        all.push(std::sync::Arc::downgrade(holds));
    }

    /// Makes a [`DiscardGate`] asked before every discard of this registry's memory, for as
    /// long as it lives.
    pub fn register_gate(&self, gate: Weak<dyn DiscardGate>) {
        self.gates.register(gate);
    }

    /// The live discard gates.
    pub(crate) fn discard_gates(&self) -> Vec<std::sync::Arc<dyn DiscardGate>> {
        self.gates.live()
    }

    /// The live hold tables.
    fn hold_tables(&self) -> Vec<std::sync::Arc<Holds>> {
        lock(&self.holds).iter().filter_map(Weak::upgrade).collect()
    }

    /// The pinned runs of host memory as `(first byte, bytes, count)`, in address order.
    pub fn pinned(&self) -> Vec<(Hva, u64, u64)> {
        self.lock()
            .pages
            .runs()
            .map(|(s, e, c)| (Hva(s * PAGE), (e - s) * PAGE, c))
            .collect()
    }

    /// Calls `f`, under the registry's lock (no pin can come in between), with the runs of
    /// pages in bytes `[start, end)` that nothing holds: no pin or hold, no lock cache entry (the cache
    /// is emptied over the range first), no long-term buffer — whose pages the kernel keeps
    /// pinned until the whole buffer goes, those no pin holds any more included: discarding
    /// one would part the process's page from the pinned one, and a later pin that takes the
    /// page back from its buffer would hold the wrong page. Page numbers are 4 KiB (`hva /
    /// 4096`). A pin that races `f` either held its pages before `f` ran or holds (and faults
    /// in) them after `f` is done with them. Discarding uses this; keep `f` short, pins wait.
    pub(crate) fn with_unheld_in<R>(
        &self,
        start: u64,
        end: u64,
        f: impl FnOnce(&[(u64, u64)]) -> R,
    ) -> R {
        let mut st = self.lock();
        let (first, last) = (start / PAGE, end.div_ceil(PAGE));
        st.release_cached_in(first, last);
        st.check_account();
        // Neither locked nor counted: a hold (a pin that locks nothing) counts its pages only.
        let unlocked: Vec<(u64, u64)> = st
            .locked
            .gaps(first, last)
            .into_iter()
            .flat_map(|(s, e)| st.pages.gaps(s, e))
            .collect();
        // Nor held by a guard: every shard of every table stays locked until `f` is done, so
        // a guard either counted its pages before this or counts them after `f`.
        let tables = self.hold_tables();
        let shards: Vec<_> = tables.iter().flat_map(|t| t.lock_all()).collect();
        let unlocked = holds::host_gaps(&shards, unlocked);
        match st.long_term.as_mut().filter(|l| l.pages() > 0) {
            Some(long_term) => {
                let mut free = Vec::new();
                for (s, e) in unlocked {
                    long_term.gaps(s, e, &mut free);
                }
                f(&free)
            }
            None => f(&unlocked),
        }
    }

    fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            state: lock(&self.state),
            cached: &self.cached,
        }
    }

    /// Pins `req` in steps, all or nothing, and returns its extents: one for the whole range
    /// unless frames were asked for.
    pub(crate) fn pin(&self, req: &PinRequest) -> Result<Vec<HostExtent>> {
        let mut extents = Extents::default();
        self.pin_steps(req, &mut extents)?;
        if !req.frames {
            extents.0.push(HostExtent {
                hva: Hva(req.hva),
                len: req.len,
                pfn: None,
            });
        }
        Ok(extents.0)
    }

    /// Pins `req` (which asks for no frames) in steps, all or nothing; no extents.
    pub(crate) fn pin_only(&self, req: &PinRequest) -> Result<()> {
        debug_assert!(!req.frames);
        self.pin_steps(req, &mut Extents::default())
    }

    /// Pins `req` in steps, all or nothing, adding to `extents` when frames are asked for.
    fn pin_steps(&self, req: &PinRequest, extents: &mut Extents) -> Result<()> {
        let pagemap = if req.frames {
            Some(self.pagemap()?)
        } else {
            None
        };
        let (first, end) = req.pages();
        let mut step = req.batch.max(1) as u64;
        if req.lock && end - first > step {
            // Refuse up front when the whole call cannot fit, before any work; each step
            // still checks again under the lock, since other pins may come in between.
            let mut st = self.lock();
            if st.use_long_term && step > 1 {
                // Each step is one kernel buffer: larger steps keep a large mapping within
                // the buffer tables (16,384 buffers of 2 MiB would stop at 32 GiB).
                step = step.max(LONG_TERM_STEP);
            }
            let (us, ue) = req.units(first, end);
            let unlocked: u64 = st.locked.gaps(us, ue).iter().map(|(s, e)| e - s).sum();
            let new = unlocked + st.idle.pages_in(us, ue);
            st.account.check(new * PAGE)?;
        }
        let mut at = first;
        while at < end {
            let step_end = end.min(at.saturating_add(step));
            let mut pinned = self.pin_step(req, at, step_end);
            if pinned.as_ref().is_err_and(lacks_room) && release_cached_everywhere() {
                // The kernel counts every lock of the process: other registries' caches may
                // have been in the way.
                pinned = self.pin_step(req, at, step_end);
            }
            let step_pinned = pinned.is_ok();
            let done = pinned.and_then(|()| match pagemap {
                Some(file) => extents.read_frames(file, req, at, step_end),
                None => Ok(()),
            });
            if let Err(e) = done {
                // A step that failed pinned nothing; a step whose frames could not be read did.
                let pinned_to = if step_pinned { step_end } else { at };
                if pinned_to > first {
                    self.unpin_pages(first, pinned_to, req);
                }
                return Err(e);
            }
            at = step_end;
        }
        Ok(())
    }

    /// Pins pages `[start, end)`: holds (locking, faulting in and charging what no lock holds
    /// yet) their whole units and counts the pages. On error nothing of the step stays pinned
    /// or charged.
    fn pin_step(&self, req: &PinRequest, start: u64, end: u64) -> Result<()> {
        let mut st = self.lock();
        st.retry_stuck();
        if req.lock {
            let (us, ue) = req.units(start, end);
            st.hold(us, ue, req)?;
        }
        st.pages.add(start, end);
        st.check_account();
        Ok(())
    }

    /// Unpins what `req` pinned.
    pub(crate) fn unpin(&self, req: &PinRequest) {
        let (first, end) = req.pages();
        self.unpin_pages(first, end, req);
    }

    /// Drops one pin from each page of `[first, end)`: one munlock and one release per run of
    /// units that no pin holds any more (or into the lock cache, with `req.keep`), or a page at
    /// a time when the batch is 1.
    fn unpin_pages(&self, first: u64, end: u64, req: &PinRequest) {
        let step = if req.batch <= 1 { 1 } else { end - first };
        let mut at = first;
        while at < end {
            let step_end = end.min(at.saturating_add(step));
            let mut st = self.lock();
            st.retry_stuck();
            let mut zero = std::mem::take(&mut st.zero);
            zero.clear();
            match st.pages.sub_reporting(at, step_end, &mut zero) {
                Ok(()) => st.release(&zero, req.keep),
                // Callers only unpin what they pinned; a hole here is a bookkeeping bug, and
                // unlocking someone else's pages would be worse than leaving this one.
                Err(page) => debug_assert!(false, "unpin of page {page:#x}, which is not pinned"),
            }
            st.zero = zero;
            st.check_account();
            at = step_end;
        }
    }

    fn pagemap(&self) -> Result<&File> {
        let opened = self.pagemap.get_or_init(|| {
            if !capable(Capability::SysAdmin) {
                return Err("CAP_SYS_ADMIN".into());
            }
            File::open("/proc/self/pagemap").map_err(|e| e.to_string())
        });
        opened.as_ref().map_err(|why| match why.as_str() {
            "CAP_SYS_ADMIN" => Error::NeedsCapability {
                what: "reading physical frames from /proc/self/pagemap",
                capability: "CAP_SYS_ADMIN",
            },
            other => Error::Unsupported {
                what: "/proc/self/pagemap",
                why: other.to_string(),
            },
        })
    }
}

/// Empties the lock cache of every registry of the process (none of their locks held by the
/// caller); returns whether any held something.
fn release_cached_everywhere() -> bool {
    let all: Vec<Arc<PinRegistry>> = lock(&REGISTRIES).iter().filter_map(Weak::upgrade).collect();
    let mut any = false;
    for r in all {
        let mut st = r.lock();
        any |= !st.idle.is_empty();
        while st.evict_oldest() {}
    }
    any
}

/// Extents under construction, kept across steps so a run continues into the next batch.
#[derive(Default)]
struct Extents(Vec<HostExtent>);

impl Extents {
    /// Reads the frames of the requested part of pages `[start, end)`, 512 entries per `pread`,
    /// and extends the extents with them.
    fn read_frames(&mut self, file: &File, req: &PinRequest, start: u64, end: u64) -> Result<()> {
        let start = start.max(req.hva / PAGE);
        let end = end.min((req.hva + req.len) / PAGE);
        let mut buf = [0u64; PIN_BATCH];
        let mut at = start;
        while at < end {
            let n = ((end - at) as usize).min(PIN_BATCH);
            let bytes = pread_entries(file, at, &mut buf[..n])?;
            for (i, &entry) in buf[..bytes].iter().enumerate() {
                let page = at + i as u64;
                if entry >> 63 == 0 {
                    return Err(Error::Unsupported {
                        what: "physical frames",
                        why: format!("page at {:#x} is not present although pinned", page * PAGE),
                    });
                }
                self.push(page * PAGE, entry & ((1 << 55) - 1));
            }
            at += bytes as u64;
        }
        Ok(())
    }

    fn push(&mut self, hva: u64, pfn: u64) {
        if let Some(last) = self.0.last_mut() {
            let pages = last.len / PAGE;
            if last.hva.0 + last.len == hva && last.pfn.map(|p| p + pages) == Some(pfn) {
                last.len += PAGE;
                return;
            }
        }
        self.0.push(HostExtent {
            hva: Hva(hva),
            len: PAGE,
            pfn: Some(pfn),
        });
    }
}

/// Reads pagemap entries for the pages from `page` into `out`; returns how many were read.
fn pread_entries(file: &File, page: u64, out: &mut [u64]) -> Result<usize> {
    let mut raw = [0u8; PIN_BATCH * 8];
    let raw = &mut raw[..out.len() * 8];
    let got = file.read_at(raw, page * 8).map_err(|source| Error::Os {
        op: "pread(/proc/self/pagemap)",
        source,
    })?;
    if got < 8 {
        return Err(Error::Unsupported {
            what: "physical frames",
            why: format!("pagemap has no entry for {:#x}", page * PAGE),
        });
    }
    for (o, chunk) in out.iter_mut().zip(raw[..got].chunks_exact(8)) {
        *o = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
    }
    Ok(got / 8)
}

fn mlock(start: u64, end: u64) -> Result<()> {
    // SAFETY: mlock changes residency only, never contents or mappings.
    let rc = unsafe {
        libc::mlock(
            (start * PAGE) as *const libc::c_void,
            ((end - start) * PAGE) as usize,
        )
    };
    if rc != 0 {
        return Err(Error::last_os("mlock while pinning"));
    }
    Ok(())
}

/// Unlocks pages `[start, end)`. It fails with ENOMEM when the kernel cannot split an area
/// (`vm.max_map_count`) or part of the range is no longer mapped; the pages that could not be
/// unlocked then stay locked.
fn munlock(start: u64, end: u64) -> Result<()> {
    // SAFETY: munlock changes residency only, never contents or mappings.
    let rc = unsafe {
        libc::munlock(
            (start * PAGE) as *const libc::c_void,
            ((end - start) * PAGE) as usize,
        )
    };
    if rc != 0 {
        return Err(Error::last_os("munlock while unpinning"));
    }
    Ok(())
}
