//! Holds of in-flight requests, counted apart from the registry so that requests on different
//! queues share no lock.
//!
//! A hold (see the module above, "Holds") locks nothing: all it must do is be seen — by a
//! discard, which skips the host pages under it, and by an unmap, which waits for the IOVA
//! pages under it. Counting every request's holds in the registry's one table would make every
//! request of every queue take the registry's one lock twice. So a DMA space keeps the holds of
//! its scatter-gather guards (`dma::sg`) in a [`Holds`] table of its own, split into shards:
//! a queue that walks with its own scratch (`dma::SgScratch`) counts into the shard of its
//! queue number ([`Holds::shard_for`]), so two queues (of the first [`SHARDS`]) never share
//! one; a walk without one counts into its thread's shard (chosen once per thread, round
//! robin). Either way queue threads rarely wait for each other, and each shard's lock is held
//! for one request's few runs.
//!
//! Who looks: a discard goes through [`PinRegistry::with_unheld_in`](super::PinRegistry),
//! which, under the registry's lock, also takes every shard of every table registered with it
//! ([`PinRegistry::register_holds`](super::PinRegistry)) and leaves out the pages they count;
//! an unmap looks at the IOVA pages of its own space's table after it closed the range
//! (`dma::retire`). Locking order: the registry's lock, then the table list, then a shard;
//! a guard takes a shard alone, never the registry's lock while it holds one.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering, fence};
use std::sync::{Mutex, MutexGuard};

use crate::sync::lock;

/// Shards per table: more than the queues a device runs, so threads rarely share one.
pub(crate) const SHARDS: usize = 16;
const _: () = assert!(
    SHARDS <= u32::BITS as usize,
    "a bit of `Holds::in_use` per shard"
);

/// One piece a guard holds: 4 KiB IOVA pages `[iova, iova + pages)` over host pages from
/// `host`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Held {
    pub iova: u64,
    pub host: u64,
    pub pages: u64,
    /// Held for the device to write (dirty on every read of the log while held).
    pub write: bool,
}

/// What one shard holds: the pieces of the requests in flight on its threads, a few dozen at
/// most — a list, so that holding and letting go cost a push and a swap, not a tree update.
#[derive(Default)]
pub(crate) struct Shard {
    held: Vec<Held>,
}

impl Shard {
    /// Holds a piece.
    pub fn add(&mut self, h: Held) {
        self.held.push(h);
    }

    /// Lets go of a piece held before; false if none like it is held.
    pub fn remove(&mut self, h: &Held) -> bool {
        match self.held.iter().rposition(|x| x == h) {
            Some(i) => {
                self.held.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

/// The union of `runs` (`[start, end)` pairs), sorted and merged.
fn union(mut runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for (s, e) in runs {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

#[repr(align(128))]
struct Padded(Mutex<Shard>);

/// The holds of one DMA space's guards, by shard.
pub(crate) struct Holds {
    shards: Box<[Padded]>,
    /// Bit `i` set once a guard was taken on shard `i` (never cleared): a change looks at
    /// those shards only, and at none (nor keeps its old snapshot to undo with) while it is 0.
    /// One thread or two take guards on a device's table, so an unmap locks one shard or two
    /// instead of all sixteen.
    in_use: AtomicU32,
    /// Set while a change waits for holds to go: a guard that lets go must wake it.
    pub waiting: AtomicBool,
}

impl Default for Holds {
    fn default() -> Self {
        Holds {
            shards: (0..SHARDS)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            in_use: AtomicU32::new(0),
            waiting: AtomicBool::new(false),
        }
    }
}

/// Shards handed out to threads, round robin.
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static MY_SHARD: usize = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
}

impl Holds {
    /// The calling thread's shard number.
    pub fn my_shard(&self) -> usize {
        self.mark_in_use(MY_SHARD.with(|s| *s))
    }

    /// The shard of queue `queue`: queues below [`SHARDS`] each have their own.
    pub fn shard_for(&self, queue: usize) -> usize {
        self.mark_in_use(queue % SHARDS)
    }

    /// Records that guards are taken on shard `i` (before the walk that takes them), and
    /// returns `i`.
    fn mark_in_use(&self, i: usize) -> usize {
        let bit = 1u32 << i;
        if self.in_use.load(Ordering::Relaxed) & bit == 0 {
            self.in_use.fetch_or(bit, Ordering::SeqCst);
            // Store, fence, then (in the walk) load the snapshot; a change publishes, fences
            // (`grace`) and then reads `in_use`. In the single order of the two fences either
            // the change sees this shard, or this thread's walks load what it published (and
            // so never hold what it took away). Once per shard and table.
            fence(Ordering::SeqCst);
        }
        i
    }

    /// Whether any guard was ever taken on the table.
    pub fn used(&self) -> bool {
        self.in_use.load(Ordering::SeqCst) != 0
    }

    /// The shards guards were ever taken on.
    fn shards_in_use(&self) -> impl Iterator<Item = &Padded> {
        let in_use = self.in_use.load(Ordering::SeqCst);
        (self.shards.iter().enumerate())
            .filter(move |(i, _)| in_use & (1 << i) != 0)
            .map(|(_, s)| s)
    }

    /// Runs `f` on shard `i`, under its lock.
    pub fn with<R>(&self, i: usize, f: impl FnOnce(&mut Shard) -> R) -> R {
        f(&mut lock(&self.shards[i].0))
    }

    /// Whether any shard holds an IOVA page of `[start, end)` (4 KiB page numbers).
    /// Locks only the shards in use (see [`Holds::my_shard`]).
    pub fn any_iova(&self, start: u64, end: u64) -> bool {
        self.shards_in_use()
            .any(|s| (lock(&s.0).held.iter()).any(|h| h.iova < end && start < h.iova + h.pages))
    }

    /// Calls `f` with every run of IOVA pages held for writing in `[start, end)`.
    pub fn written_in(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64)) {
        for s in self.shards.iter() {
            for h in lock(&s.0).held.iter().filter(|h| h.write) {
                let (a, b) = (h.iova.max(start), (h.iova + h.pages).min(end));
                if a < b {
                    f(a, b);
                }
            }
        }
    }

    /// IOVA pages (4 KiB numbers) held, each once.
    pub fn iova_pages(&self) -> u64 {
        let runs = self.runs(|h| (h.iova, h.iova + h.pages));
        union(runs).iter().map(|(s, e)| e - s).sum()
    }

    /// Host pages (4 KiB numbers) held, each once.
    pub fn host_pages(&self) -> u64 {
        let runs = self.runs(|h| (h.host, h.host + h.pages));
        union(runs).iter().map(|(s, e)| e - s).sum()
    }

    /// Holds on host page `page`, over all shards.
    pub fn host_count(&self, page: u64) -> u64 {
        let runs = self.runs(|h| (h.host, h.host + h.pages));
        runs.iter().filter(|(s, e)| *s <= page && page < *e).count() as u64
    }

    fn runs(&self, f: impl Fn(&Held) -> (u64, u64)) -> Vec<(u64, u64)> {
        (self.shards.iter())
            .flat_map(|s| lock(&s.0).held.iter().map(&f).collect::<Vec<_>>())
            .collect()
    }

    /// Every shard, locked (in order): no guard of the table counts or lets go meanwhile.
    pub fn lock_all(&self) -> Vec<MutexGuard<'_, Shard>> {
        self.shards.iter().map(|s| lock(&s.0)).collect()
    }
}

/// The parts of the runs `runs` no shard of `shards` holds a host page of.
pub(crate) fn host_gaps(
    shards: &[MutexGuard<'_, Shard>],
    runs: Vec<(u64, u64)>,
) -> Vec<(u64, u64)> {
    let held = union(
        (shards.iter())
            .flat_map(|s| s.held.iter().map(|h| (h.host, h.host + h.pages)))
            .collect(),
    );
    if held.is_empty() {
        return runs;
    }
    let mut out = Vec::new();
    for (mut s, e) in runs {
        for &(hs, he) in &held {
            if he <= s || hs >= e {
                continue;
            }
            if hs > s {
                out.push((s, hs));
            }
            s = s.max(he);
        }
        if s < e {
            out.push((s, e));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queues_below_the_shard_count_never_share_a_shard_and_taking_one_marks_the_table_used() {
        let h = Holds::default();
        assert!(!h.used());
        let shards: std::collections::HashSet<usize> =
            (0..SHARDS).map(|q| h.shard_for(q)).collect();
        assert_eq!(shards.len(), SHARDS);
        assert!(h.used(), "a change must look at the shards from now on");
    }
}
