//! Holds of in-flight requests, counted apart from the registry so that requests on different
//! queues share no lock.
//!
//! A hold (see the module above, "Holds") locks nothing: all it must do is be seen — by a
//! discard, which skips the host pages under it, and by an unmap, which waits for the IOVA
//! pages under it. Counting every request's holds in the registry's one table would make every
//! request of every queue take the registry's one lock twice. So a DMA space keeps the holds of
//! its scatter-gather guards (`dma::sg`) in a [`Holds`] table of its own, split into shards:
//! each thread counts into its own shard (chosen once per thread, round robin), so two queue
//! threads never wait for each other, and each shard's lock is held for one request's few runs.
//!
//! Who looks: a discard goes through [`PinRegistry::with_unheld_in`](super::PinRegistry),
//! which, under the registry's lock, also takes every shard of every table registered with it
//! ([`PinRegistry::register_holds`](super::PinRegistry)) and leaves out the pages they count;
//! an unmap looks at the IOVA pages of its own space's table after it closed the range
//! (`dma::retire`). Locking order: the registry's lock, then the table list, then a shard;
//! a guard takes a shard alone, never the registry's lock while it holds one.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::counts::RunCounts;
use crate::sync::lock;

/// Shards per table: more than the queues a device runs, so threads rarely share one.
const SHARDS: usize = 16;

/// What one shard counts, in 4 KiB page numbers.
#[derive(Default)]
pub(crate) struct Shard {
    /// IOVA pages held (what an unmap waits for).
    pub iova: RunCounts,
    /// IOVA pages held for the device to write (dirty on every read of the log while held).
    pub written: RunCounts,
    /// Host pages held (what a discard skips).
    pub host: RunCounts,
}

#[repr(align(128))]
struct Padded(Mutex<Shard>);

/// The holds of one DMA space's guards, by shard.
pub(crate) struct Holds {
    shards: Box<[Padded]>,
    /// Set once a guard was taken: until then a change need not look (nor keep its old
    /// snapshot to undo with).
    used: AtomicBool,
    /// Set while a change waits for holds to go: a guard that lets go must wake it.
    pub waiting: AtomicBool,
}

impl Default for Holds {
    fn default() -> Self {
        Holds {
            shards: (0..SHARDS)
                .map(|_| Padded(Mutex::new(Shard::default())))
                .collect(),
            used: AtomicBool::new(false),
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
        if !self.used.load(Ordering::Relaxed) {
            self.used.store(true, Ordering::SeqCst);
        }
        MY_SHARD.with(|s| *s)
    }

    /// Whether any guard was ever taken on the table.
    pub fn used(&self) -> bool {
        self.used.load(Ordering::SeqCst)
    }

    /// Runs `f` on shard `i`, under its lock.
    pub fn with<R>(&self, i: usize, f: impl FnOnce(&mut Shard) -> R) -> R {
        f(&mut lock(&self.shards[i].0))
    }

    /// Whether any shard holds an IOVA page of `[start, end)` (4 KiB page numbers).
    pub fn any_iova(&self, start: u64, end: u64) -> bool {
        self.shards
            .iter()
            .any(|s| lock(&s.0).iova.any_counted(start, end))
    }

    /// Calls `f` with every run of IOVA pages held for writing in `[start, end)`.
    pub fn written_in(&self, start: u64, end: u64, mut f: impl FnMut(u64, u64)) {
        for s in self.shards.iter() {
            for (a, b, _) in lock(&s.0).written.counted_in(start, end) {
                f(a, b);
            }
        }
    }

    /// IOVA pages (4 KiB numbers) held, each once per shard.
    pub fn iova_pages(&self) -> u64 {
        self.shards.iter().map(|s| lock(&s.0).iova.pages()).sum()
    }

    /// Host pages (4 KiB numbers) held, each once per shard.
    pub fn host_pages(&self) -> u64 {
        self.shards.iter().map(|s| lock(&s.0).host.pages()).sum()
    }

    /// Holds on host page `page`, over all shards.
    pub fn host_count(&self, page: u64) -> u64 {
        self.shards
            .iter()
            .map(|s| lock(&s.0).host.count(page))
            .sum()
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
    let mut runs = runs;
    for shard in shards {
        if shard.host.pages() == 0 {
            continue;
        }
        runs = runs
            .into_iter()
            .flat_map(|(a, b)| shard.host.gaps(a, b))
            .collect();
    }
    runs
}
