//! What pinning costs the blk data path: process-wide counters of the requests whose pages
//! [`crate::blk`] pinned and unpinned (`DmaSpace::pin_pages` / `unpin_pages`, in calls of at
//! most 512 pages) and the wall time spent doing it, over every device, queue and thread of
//! the process. Relaxed atomics: each figure is a plain sum, read once the traffic is over
//! (`memvisor vhost-user-blk --stats` shows them as `pin_cost`; `memvisor bench blk` divides
//! them by the requests of a row).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Requests pinned and unpinned, and the nanoseconds spent on each side.
pub struct PinCost {
    /// Requests whose pages were pinned.
    pub pins: AtomicU64,
    /// Nanoseconds spent pinning them.
    pub pin_ns: AtomicU64,
    /// Requests whose pages were unpinned.
    pub unpins: AtomicU64,
    /// Nanoseconds spent unpinning them.
    pub unpin_ns: AtomicU64,
}

impl PinCost {
    /// One request's pages pinned, the pinning having begun at `start`.
    pub(crate) fn pinned(&self, start: Instant) {
        add(&self.pins, &self.pin_ns, start);
    }

    /// One request's pages unpinned, the unpinning having begun at `start`.
    pub(crate) fn unpinned(&self, start: Instant) {
        add(&self.unpins, &self.unpin_ns, start);
    }
}

fn add(count: &AtomicU64, ns: &AtomicU64, start: Instant) {
    let spent = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    count.fetch_add(1, Ordering::Relaxed);
    ns.fetch_add(spent, Ordering::Relaxed);
}

/// The process's counters.
pub static PIN_COST: PinCost = PinCost {
    pins: AtomicU64::new(0),
    pin_ns: AtomicU64::new(0),
    unpins: AtomicU64::new(0),
    unpin_ns: AtomicU64::new(0),
};
