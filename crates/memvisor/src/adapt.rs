//! How a [`SlotCursor`](crate::SlotCursor) chooses between remembering its last slot and
//! searching every address.
//!
//! A cursor is built for a thread that keeps touching one slot: it remembers the last one it
//! found, and a hit costs one bounds check. When the addresses are random that check mostly
//! fails, and over a few slots it is a coin toss: each wrong guess (a branch misprediction)
//! costs more than the search it could have saved. A remembering cursor over 2-8 slots was
//! 0.35-0.85x a plain binary search on random addresses.
//!
//! So the cursor watches its answers. [`Adapt`] counts misses in a row while the cursor
//! remembers; after [`SEARCH_AFTER`] it tells the cursor to search every address and keep
//! nothing of the answers but an identity (the slot's position). While searching it counts
//! answers in a row from one slot, and after [`REMEMBER_AFTER`] it tells the cursor to
//! remember again. The policy is about cost only: the cursor answers the same in either mode,
//! from its current snapshot.
//!
//! The thresholds: random addresses over `n` slots give a run of 8 misses within a few dozen
//! lookups when `n` > 2 (a few hundred at 2), while a thread with 15 hits in 16 sees one once
//! in 2^32 runs. A run of 32 answers from one slot comes once in ~2^31 lookups over 2 slots at
//! random; a thread that settles in a slot pays the search 32 times more before it remembers.
//!
//! [`DmaCursor`](crate::DmaCursor) does not use it. Its misses over many mappings are
//! predictable (nearly all miss), so there is no misprediction to save, and the run count
//! costs more than the four stores of a remembered answer it would skip: 88 instructions per
//! miss against 78, and 0.83x the speed in a bare loop over 100,000 mappings.

/// Misses in a row after which a remembering cursor starts searching.
pub(crate) const SEARCH_AFTER: u32 = 8;

/// Answers in a row from one slot or mapping after which a searching cursor remembers again.
pub(crate) const REMEMBER_AFTER: u32 = 32;

/// An identity no answer has.
const NONE: u64 = u64::MAX;

/// One cursor's mode and the run it is counting.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Adapt {
    /// Remembering: misses in a row. Searching: answers in a row from `last`.
    streak: u32,
    /// Searching: the identity of the last answer.
    last: u64,
    searching: bool,
}

impl Adapt {
    /// A cursor starts out remembering.
    pub(crate) const NEW: Adapt = Adapt {
        streak: 0,
        last: NONE,
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
        self.streak = 0;
    }

    /// A remembering cursor missed and remembered the new answer. True when it should start
    /// searching (then it is searching).
    #[inline(always)]
    pub(crate) fn missed(&mut self) -> bool {
        self.streak += 1;
        if self.streak < SEARCH_AFTER {
            return false;
        }
        self.searching = true;
        self.streak = 0;
        self.last = NONE;
        true
    }

    /// A searching cursor found the answer identified by `id`. True when it should remember
    /// that answer (then it is remembering).
    #[inline(always)]
    pub(crate) fn searched(&mut self, id: u64) -> bool {
        // A count, not a branch: whether the answer repeats is as random as the addresses.
        let same = (id == self.last) as u32;
        self.streak = (self.streak & same.wrapping_neg()) + 1;
        self.last = id;
        if self.streak < REMEMBER_AFTER {
            return false;
        }
        self.searching = false;
        self.streak = 0;
        true
    }

    /// The cursor moved to a new snapshot: identities from the old one mean nothing.
    #[inline(always)]
    pub(crate) fn forget(&mut self) {
        self.last = NONE;
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
    fn a_run_from_one_answer_ends_the_search_and_another_answer_breaks_the_run() {
        let mut a = Adapt::NEW;
        while !a.missed() {}
        for _ in 0..REMEMBER_AFTER - 1 {
            assert!(!a.searched(7));
        }
        assert!(!a.searched(8), "another answer starts a new run");
        for _ in 0..REMEMBER_AFTER - 2 {
            assert!(!a.searched(8));
        }
        a.forget();
        assert!(!a.searched(8), "after a new snapshot the run starts again");
        for _ in 0..REMEMBER_AFTER - 2 {
            assert!(!a.searched(8));
        }
        assert!(a.searching());
        assert!(a.searched(8));
        assert!(!a.searching());
    }
}
