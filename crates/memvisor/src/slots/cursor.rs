//! A [`SlotCursor`]: one thread's view of the table, remembering the last slot it hit.
//!
//! A hit costs one load of the table's generation and a bounds check against the remembered
//! entry; a miss, or a changed generation, searches the current snapshot's address index. A
//! cursor whose guesses keep failing switches to searching every address for a while (the
//! `adapt` module); the answers are the same either way.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::adapt::Adapt;
use crate::addr::Gpa;
use crate::error::Result;

use super::index::Entry;
use super::table::Shared;
use super::{GpaTranslation, Snapshot};

/// One thread's view of the table, remembering the last slot it hit (as KVM's per-vCPU
/// `last_used_slot` does).
///
/// Keep one per vCPU or device thread; it is `Send` but not shared. It holds the snapshot it last
/// used, so the memory of slots removed since stays mapped until its next lookup (or until it is
/// dropped) — call [`SlotCursor::refresh`] from an idle thread to let go sooner.
pub struct SlotCursor {
    pub(super) shared: Arc<Shared>,
    pub(super) snapshot: Arc<Snapshot>,
    pub(super) generation: u64,
    pub(super) hit: Entry,
    /// The generation `hit` belongs to; [`NO_HIT`] when there is none (and always while
    /// searching), so the hit test needs no separate "have a hit" check.
    pub(super) hit_generation: u64,
    /// Whether the cursor remembers its last slot or searches every address, and the count
    /// that ends the mode.
    pub(super) adapt: Adapt,
}

/// A generation no table reaches.
pub(super) const NO_HIT: u64 = u64::MAX;

impl fmt::Debug for SlotCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotCursor")
            .field("generation", &self.generation)
            .field("last_slot", &self.hit.id)
            .finish()
    }
}

impl SlotCursor {
    /// Where `gpa` lives on the host.
    ///
    /// Remembering (the start): a hit on the last slot costs a load and one compare of each
    /// kind joined without short-circuits, one branch, and one store (the miss count back to
    /// 0); a miss searches the snapshot's bucket index inline and remembers the entry found,
    /// computing the answer before the store so the return value does not wait on it. After 8
    /// misses in a row the cursor searches every address and remembers nothing for 16,384
    /// lookups, then tries remembering again (the `adapt` module): over a few slots a cursor
    /// that only remembered was slower than a plain binary search on random addresses.
    /// Either way the answer is the current snapshot's.
    ///
    /// Always inlined: the modes' few instructions took it past LLVM's own threshold, and as
    /// a call the hit cost half as much again (figures: `docs/measurements.md`, "Slot cursor").
    #[inline(always)]
    pub fn lookup(&mut self, gpa: Gpa) -> Option<GpaTranslation> {
        let generation = self.shared.generation.0.load(Ordering::Acquire);
        let h = &self.hit;
        // `gpa - start` wraps above `last - start` when gpa is below the slot. Never true while
        // searching (`hit_generation` is NO_HIT then), so this branch is predictable there.
        if (generation == self.hit_generation)
            & (gpa.0.wrapping_sub(h.start) <= h.last.wrapping_sub(h.start))
        {
            self.adapt.hit();
            return Some(h.translate(gpa.0));
        }
        if generation != self.generation {
            self.reload();
        }
        // One search for both ways of working (two inline copies cost a hit-heavy stream more
        // than the mode's branch); what is remembered of the answer differs.
        let (i, e) = self
            .snapshot
            .buckets
            .search(&self.snapshot.entries, gpa.0)?;
        let t = e.translate(gpa.0);
        if self.adapt.searching() {
            if self.adapt.searched() {
                self.remember(i);
            }
        } else {
            self.hit = *e;
            self.hit_generation = self.generation;
            if self.adapt.missed() {
                self.hit_generation = NO_HIT;
            }
        }
        Some(t)
    }

    /// Goes back to remembering, starting with the entry at `i`.
    #[cold]
    #[inline(never)]
    fn remember(&mut self, i: usize) {
        self.hit = self.snapshot.entries[i];
        self.hit_generation = self.generation;
    }

    /// Moves to the table's current snapshot if it changed, letting go of the old one.
    pub fn refresh(&mut self) {
        if self.shared.generation.0.load(Ordering::Acquire) != self.generation {
            self.reload();
        }
    }

    #[cold]
    #[inline(never)]
    fn reload(&mut self) {
        self.snapshot = self.shared.current.load_full();
        self.generation = self.snapshot.generation;
        self.hit = Entry::NONE;
        self.hit_generation = NO_HIT;
    }

    /// The snapshot the cursor answers from (after a refresh).
    pub fn snapshot(&mut self) -> &Arc<Snapshot> {
        self.refresh();
        &self.snapshot
    }

    /// [`Snapshot::read`] on the current snapshot.
    pub fn read(&mut self, gpa: Gpa, buf: &mut [u8]) -> Result<()> {
        self.snapshot().read(gpa, buf)
    }

    /// [`Snapshot::write`] on the current snapshot.
    pub fn write(&mut self, gpa: Gpa, buf: &[u8]) -> Result<()> {
        self.snapshot().write(gpa, buf)
    }
}
