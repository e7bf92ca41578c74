//! Discard gates: memory an I/O engine keeps pinned on its own, outside the registry's counts,
//! and gives up when a discard asks.
//!
//! **Model.** An io_uring with registered (fixed) buffers keeps their pages pinned in the
//! kernel for as long as they stay registered, whether or not a transfer uses them. A discard
//! (`MADV_DONTNEED`, a punched hole) of such a page succeeds: the process's mapping gets a new
//! page and the pinned one lives on in the kernel's table, so a later `READ_FIXED` fills the
//! orphan and the guest reads zeros. A [`DiscardGate`] is how such an engine takes part in
//! pin-aware discard: registered with the [`PinRegistry`](super::PinRegistry)
//! ([`PinRegistry::register_gate`](super::PinRegistry::register_gate)), it is asked before each
//! discarded chunk to take the range out of its tables ([`DiscardGate::evict`]); what it cannot
//! give up — a transfer is in flight there, or its owner did not answer in time — it names,
//! and the discard skips it, as it skips held pages. While the discard runs (under the
//! registry's lock), [`DiscardGate::pinned_runs`] says what is still registered, and that is
//! skipped too; an evicted range stays out of the engine's tables until
//! [`DiscardGate::reopen`], after the discard.
//!
//! The registry keeps gates weakly: a gate goes when its engine drops it.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::sync::lock;

/// An owner of pinned memory that can give it up before a discard.
pub trait DiscardGate: Send + Sync {
    /// Takes host bytes `[hva, hva + len)` out of the engine's tables, waiting at most `wait`
    /// for the thread that owns them. Returns the runs `(first byte, bytes)` it could not give
    /// up (I/O in flight, no answer in time), which must not be discarded. Until
    /// [`DiscardGate::reopen`] the range is not registered again.
    fn evict(&self, hva: u64, len: u64, wait: Duration) -> Vec<(u64, u64)>;
    /// The runs `(first byte, bytes)` in `[start, end)` still registered (kernel-pinned).
    fn pinned_runs(&self, start: u64, end: u64) -> Vec<(u64, u64)>;
    /// The discard of `[hva, hva + len)` is over: the engine may register it again.
    fn reopen(&self, hva: u64, len: u64);
}

/// The gates a registry asks, kept weakly.
#[derive(Default)]
pub(crate) struct Gates(Mutex<Vec<Weak<dyn DiscardGate>>>);

impl Gates {
    pub(crate) fn register(&self, gate: Weak<dyn DiscardGate>) {
        let mut all = lock(&self.0);
        all.retain(|g| g.strong_count() > 0);
        all.push(gate);
    }

    /// The live gates.
    pub(crate) fn live(&self) -> Vec<Arc<dyn DiscardGate>> {
        lock(&self.0).iter().filter_map(Weak::upgrade).collect()
    }
}

/// The page runs `free` (4 KiB page numbers, `[first, end)`) less every page any byte run of
/// `keep` (`(first byte, bytes)`) touches.
pub(crate) fn subtract(free: &[(u64, u64)], keep: &[(u64, u64)]) -> Vec<(u64, u64)> {
    const PAGE: u64 = crate::addr::PAGE_4K;
    let mut keep: Vec<(u64, u64)> = keep
        .iter()
        .filter(|k| k.1 > 0)
        .map(|&(s, n)| (s / PAGE, (s + n).div_ceil(PAGE)))
        .collect();
    keep.sort_unstable();
    let mut out = Vec::new();
    for &(s, e) in free {
        let mut at = s;
        for &(ks, ke) in &keep {
            if ke <= at || ks >= e {
                continue;
            }
            if ks > at {
                out.push((at, ks));
            }
            at = at.max(ke);
        }
        if at < e {
            out.push((at, e));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::subtract;

    #[test]
    fn kept_bytes_take_their_whole_pages_out_of_the_free_runs() {
        // Pages [0, 10) and [20, 30) free; bytes of pages 2..4 (a partial page at each end)
        // and of page 25, and a run outside both, kept.
        let free = [(0, 10), (20, 30)];
        let keep = [
            (2 * 4096 + 1, 4096 * 2),
            (25 * 4096, 4096),
            (100 * 4096, 4096),
        ];
        assert_eq!(
            subtract(&free, &keep),
            vec![(0, 2), (5, 10), (20, 25), (26, 30)]
        );
        assert_eq!(subtract(&free, &[]), free.to_vec());
        assert!(subtract(&free, &[(0, 40 * 4096)]).is_empty());
    }
}
