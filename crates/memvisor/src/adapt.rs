//! How a [`SlotCursor`](crate::SlotCursor) chooses between remembering its last slot and
//! searching every address.
//!
//! A cursor is built for a thread that keeps touching one slot: it remembers the last one it
//! found, and a hit costs one bounds check. When the addresses are random that check mostly
//! fails, and over a few slots it is a coin toss: each wrong guess (a branch misprediction)
//! costs more than the search it could have saved. A remembering cursor over 2-8 slots was
//! slower than a plain binary search on random addresses (figures for this module:
//! `docs/measurements.md`, "Slot cursor").
//!
//! So the cursor watches its misses. [`Adapt`] counts misses in a row while the cursor
//! remembers; after [`SEARCH_AFTER`] it tells the cursor to search every address and remember
//! nothing. A searching cursor cannot tell whether remembering would pay again without
//! watching its answers, and watching them (a run count of answers from one slot, the first
//! version) cost 7 instructions a lookup, a quarter of a search over a few slots. So it
//! searches for a fixed count, [`SEARCH_FOR`] lookups, one decrement each, and then tries
//! remembering again: a thread still on random addresses is back to searching after its next
//! row of misses, and a thread that settled in a slot stays.
//!
//! The thresholds: random addresses over `n` slots give a row of 8 misses within a few dozen
//! lookups when `n` > 2 (~510 on average at 2), while a thread with 15 hits in 16 sees one
//! once in 2^32 rows. A try that fails costs those remembering lookups, a few hundred on
//! average at 2 slots: ~2% of the 16,384 searches before it (and about what a cursor that
//! searches for good costs); a thread that settles pays a search instead of a hit for at most
//! 16,384 lookups.
//!
//! [`DmaCursor`](crate::DmaCursor) does not use it. Its misses over many mappings are
//! predictable (nearly all miss), so there is no misprediction to save; with the first
//! version's run count its misses cost 88 instructions against 78, and were slower in a bare
//! loop over 100,000 mappings.

/// Misses in a row after which a remembering cursor starts searching.
pub(crate) const SEARCH_AFTER: u32 = 8;

/// Searches after which a searching cursor tries remembering again.
pub(crate) const SEARCH_FOR: u32 = 16384;

/// One cursor's mode and the count that ends it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Adapt {
    /// Remembering: misses in a row. Searching: searches left.
    count: u32,
    searching: bool,
}

impl Adapt {
    /// A cursor starts out remembering.
    pub(crate) const NEW: Adapt = Adapt {
        count: 0,
        searching: false,
    };

    /// Whether the cursor should search every address and remember nothing.
    #[inline(always)]
    pub(crate) fn searching(&self) -> bool {
        self.searching
    }

    /// The cursor's remembered answer held the address.
    #[inline(always)]
    pub(crate) fn hit(&mut self) {
        self.count = 0;
    }

    /// A remembering cursor missed and remembered the new answer. True when it should start
    /// searching (then it is searching).
    #[inline(always)]
    pub(crate) fn missed(&mut self) -> bool {
        self.count += 1;
        if self.count < SEARCH_AFTER {
            return false;
        }
        self.searching = true;
        self.count = SEARCH_FOR;
        true
    }

    /// A searching cursor searched. True when it should remember this answer and try
    /// remembering again (then it is remembering).
    #[inline(always)]
    pub(crate) fn searched(&mut self) -> bool {
        self.count -= 1;
        if self.count != 0 {
            return false;
        }
        self.searching = false;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn misses_in_a_row_start_a_search_and_a_hit_breaks_the_row() {
        let mut a = Adapt::NEW;
        for _ in 0..SEARCH_AFTER - 1 {
            assert!(!a.missed());
        }
        a.hit();
        for _ in 0..SEARCH_AFTER - 1 {
            assert!(!a.missed());
        }
        assert!(!a.searching());
        assert!(a.missed());
        assert!(a.searching());
    }

    #[test]
    fn a_search_lasts_its_count_then_the_cursor_tries_remembering() {
        let mut a = Adapt::NEW;
        while !a.missed() {}
        for _ in 0..SEARCH_FOR - 1 {
            assert!(!a.searched());
        }
        assert!(a.searching());
        assert!(a.searched());
        assert!(!a.searching());
        // Remembering again from a clean count: it takes a full row of misses to search.
        for _ in 0..SEARCH_AFTER - 1 {
            assert!(!a.missed());
        }
        assert!(a.missed());
    }
}
