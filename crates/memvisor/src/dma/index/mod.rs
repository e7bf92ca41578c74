//! The DMA index: where a space's mappings are looked up, and the one word a lookup reads.
//!
//! A [`DmaSnapshot`] is one generation of a space's mappings. Its [`Index`] keeps them twice:
//!
//! * in the sorted index (`flat`): every mapping's IOVA range, its [`Hot`] word and its
//!   record, found by a search that reads a few cache lines; a flat array edited in place
//!   while the space holds few mappings (an IOTLB), a persistent range map (`rangemap`) when
//!   it holds many;
//! * for the small mappings a vIOMMU makes, in a persistent page table (`pagetable`): one word
//!   per 4 KiB page, the mapping's hot word plus the pages left to its end, found by indexing
//!   with the address's bits, no search;
//! * for big mappings (guest RAM), in the same table: one **huge word** per whole 2 MiB granule
//!   the mapping covers, its hot word, like a PMD block entry; the granules at its ends that it
//!   covers only in part are left to the sorted index.
//!
//! The hot word packs what every translation needs — `hva - iova`, the protection, whether the
//! memory is the host's, a peer's or invalidated, and whether it logs dirty pages — so a lookup
//! never reads the mapping record. [`Hot::of`] is the only place a word is made from a mapping;
//! the decoding (the `Hot` accessors, [`word_answer`], [`DmaSnapshot::page_answer`]) is here
//! too, and the translation paths (`translate`, `rw`) use only these. They are `#[inline]` /
//! `#[inline(always)]` on purpose: they sit on the device hot path, where a call would pass the
//! answer through memory.
//!
//! Changes go through [`Index`]'s methods only, which keep the two structures in step; the
//! space's writer (the parent module) checks a change before making it, as neither structure
//! checks for overlap. The property tests (`tests`) hold the page table against the sorted
//! index.

mod flat;
mod pagetable;
mod rangemap;
#[cfg(test)]
mod tests;

use std::sync::Arc;

#[cfg(test)]
use super::Host;
use super::{Mapping, Memory, Prot};
use crate::addr::PAGE_4K as PAGE;
pub(super) use flat::Place;
use flat::Ranges;
use pagetable::PageTable;

use pagetable::HUGE_SPAN;
pub(super) use pagetable::{Region, WINDOW, Word};
pub(super) use rangemap::Pos;

/// What the index keeps inline per mapping, packed in one word: the fields every translation
/// needs, next to the range, so a lookup never touches the mapping record (with 100 000 mappings
/// the records are megabytes away). The high bits are `hva - iova` (wrapping); both are
/// multiples of the smallest page size (4 KiB or more), so its low 12 bits are free for the
/// protection and two flags.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Hot(u64);

impl Hot {
    const PROT: u64 = 0b11;
    pub(super) const VALID: u64 = 1 << 2;
    const DIRTY: u64 = 1 << 3;
    pub(super) const REMOTE: u64 = 1 << 4;
    const FLAGS: u64 = 0xfff;

    /// The hot word of `mapping`: the only place it is derived.
    pub(super) fn of(mapping: &Mapping) -> Hot {
        let start = mapping.iova.start().0;
        let (delta, valid) = match &mapping.memory {
            Memory::Local(h) => (h.hva.0.wrapping_sub(start), Hot::VALID),
            Memory::Invalidated => (0, 0),
            Memory::Remote => (0, Hot::REMOTE),
        };
        debug_assert_eq!(delta & Hot::FLAGS, 0, "iova and hva are page aligned");
        let dirty = if mapping.dirty.is_some() {
            Hot::DIRTY
        } else {
            0
        };
        Hot(delta | u64::from(mapping.prot.0) | valid | dirty)
    }

    /// The word itself, for tests that compare copies.
    #[cfg(test)]
    pub(super) fn bits(self) -> u64 {
        self.0
    }

    /// hva - iova, wrapping; meaningless unless `valid`.
    #[inline]
    pub(super) fn delta(self) -> u64 {
        self.0 & !Hot::FLAGS
    }

    #[inline]
    pub(super) fn prot(self) -> Prot {
        Prot((self.0 & Hot::PROT) as u8)
    }

    /// Whether the mapping has a host address (not invalidated for a live update).
    #[inline]
    pub(super) fn valid(self) -> bool {
        self.0 & Hot::VALID != 0
    }

    /// Whether the mapping's memory is a peer's ([`Memory::Remote`]).
    #[inline]
    pub(super) fn remote(self) -> bool {
        self.0 & Hot::REMOTE != 0
    }

    /// Whether the mapping has a dirty bitmap.
    #[inline]
    pub(super) fn dirty(self) -> bool {
        self.0 & Hot::DIRTY != 0
    }

    /// Whether the mapping's memory is of a kind in `kinds` (`VALID`, `REMOTE` or both).
    #[inline(always)]
    pub(super) fn is_any(self, kinds: u64) -> bool {
        self.0 & kinds != 0
    }
}

/// Pages a mapping may span and still be entered in the page table: the pages left to its
/// end, 1 to 127, fit the hot word's free bits 5..=11.
const TABLE_PAGES_MAX: u64 = 127;

impl Hot {
    /// In a page-table word: the pages from this one to the mapping's end.
    const LEFT_SHIFT: u32 = 5;
    const LEFT: u64 = 0x7f << Hot::LEFT_SHIFT;
}

/// The index: every mapping's IOVA range, hot word and record in the sorted [`Ranges`]; and,
/// for the small mappings a vIOMMU makes (at most [`TABLE_PAGES_MAX`] pages, below the page
/// table's window, while its budget allows), one word per 4 KiB page in a [`PageTable`]: the
/// mapping's hot word plus the pages left to its end. A translation reads the page table first
/// and the sorted index only where it holds nothing; everything else (spans, walks, changes)
/// reads the sorted index, which is the record. The two change together, only here.
///
/// The page table is kept only while the space holds many small mappings: from
/// [`DmaConfig::page_table_from`](super::DmaConfig::page_table_from) of them on (it starts
/// filled with all of them that its window and budget allow) until they fall below a quarter
/// of that (it is dropped whole). The table is persistent, so a change to a kept one copies a
/// 4 KiB leaf unless the writer edits its spare copy in place (`publish`): that made an update
/// in a small table that churns (a vIOMMU in strict mode, mapping and unmapping a buffer's
/// pages around each request) dearer, for most of the cost of each cursor miss saved (figures:
/// `docs/measurements.md`, "DMA page table"). Kept or not, every word the table holds is current.
///
/// Every change goes through a method that logs it ([`Op`]), so that the writer can make it
/// again on its spare copy ([`Index::replay`]); a published index's log is empty.
#[derive(Clone)]
pub(super) struct Index {
    ranges: Ranges<Hot, Arc<Mapping>>,
    /// The changes made to this copy since [`Index::take_log`], for the writer to make the
    /// same changes to its spare copy ([`Index::replay`]); empty in a published snapshot.
    log: Vec<Op>,
    /// Read directly by the cursor (`translate`), which keeps a [`Region`] of it; changed only
    /// here.
    pub(super) pages: PageTable,
    /// Mappings held of at most [`TABLE_PAGES_MAX`] pages ([`table_pages`]), whether or not
    /// the window and the budget let the table take them.
    small: u64,
    /// Whether the page table keeps the small mappings' words (else it holds none).
    paged: bool,
    /// Mappings of more than [`TABLE_PAGES_MAX`] pages: their whole granules hold huge words,
    /// whether or not `paged`.
    big: u64,
    /// [`DmaConfig::page_table_from`](super::DmaConfig::page_table_from).
    table_from: u64,
}

/// One change to an [`Index`], as its log keeps it: by start address, not position, so that it
/// can be made again on another copy holding the same mappings.
#[derive(Clone)]
pub(super) enum Op {
    /// Insert the mapping; the place is where the logging copy put it (a hint, checked).
    Insert(Arc<Mapping>, Place),
    /// Replace the record of the mapping starting there (same range).
    Set(u64, Arc<Mapping>),
    Remove(u64),
    /// Remove the mappings side by side from the one starting there, this many, in one move
    /// (the flat form only).
    RemoveRun(u64, usize),
    Clear,
}

/// The most changes a log may hold for the writer to make them again on its spare
/// (`publish`); a longer change (an unmap of many mappings apart) costs as much as a copy of
/// the nodes it touches, so the spare is let go instead, and the next change copies the
/// current snapshot. Emptying the index is one op ([`Op::Clear`]) whatever it held.
pub(super) const REPLAY_MAX: usize = 16;

impl Op {
    /// Whether the change drops no mapping: a copy that has not made it yet holds no mapping
    /// the copy that has made it does not.
    pub(super) fn drops_nothing(&self) -> bool {
        matches!(self, Op::Insert(..))
    }
}

impl std::ops::Deref for Index {
    type Target = Ranges<Hot, Arc<Mapping>>;
    fn deref(&self) -> &Self::Target {
        &self.ranges
    }
}

impl Index {
    /// An empty index that keeps a page table from `table_from` small mappings on.
    pub(super) fn new(table_from: u64) -> Index {
        Index {
            ranges: Ranges::default(),
            log: Vec::new(),
            pages: PageTable::default(),
            small: 0,
            paged: table_from == 0,
            big: 0,
            table_from,
        }
    }

    /// [`Index::new`] whose sorted index turns from flat to chunked at `flat_max` mappings,
    /// for tests that cross both ways with a few.
    #[cfg(test)]
    pub(super) fn with_flat_max(table_from: u64, flat_max: usize) -> Index {
        Index {
            ranges: Ranges::with_flat_max(flat_max),
            ..Index::new(table_from)
        }
    }

    /// Drops every mapping.
    pub(super) fn clear(&mut self) {
        self.apply_clear();
        self.log.push(Op::Clear);
    }

    /// Empties the index where it is: the flat form's arrays are reset over the entries it
    /// held, not made anew (a lazy guest's flush empties the whole space each time).
    fn apply_clear(&mut self) {
        self.ranges.clear();
        self.pages = PageTable::default();
        self.small = 0;
        self.big = 0;
        self.paged = self.table_from == 0;
    }

    /// The changes made since the last call, in order; the log is left empty.
    pub(super) fn take_log(&mut self) -> Vec<Op> {
        std::mem::take(&mut self.log)
    }

    /// Makes `ops`, the log of a copy that held the same mappings as this one, here too (not
    /// logged), then keeps the emptied vector as this copy's log, for its capacity.
    pub(super) fn replay(&mut self, mut ops: Vec<Op>) {
        // An IOTLB's change is nearly always one op: taken with `pop`, which costs less than
        // a `drain`'s set-up and tail handling.
        if ops.len() == 1 {
            let op = ops.pop().expect("one op");
            self.apply(op);
        } else {
            for op in ops.drain(..) {
                self.apply(op);
            }
        }
        debug_assert!(
            self.log.is_empty(),
            "a copy replayed onto has no changes of its own"
        );
        if ops.capacity() > self.log.capacity() {
            self.log = ops;
        }
    }

    /// Makes one logged change here (not logged again).
    fn apply(&mut self, op: Op) {
        match op {
            Op::Insert(m, place) => self.apply_insert(m, place),
            Op::Set(start, m) => {
                let pos = self
                    .ranges
                    .find(start)
                    .expect("the same mappings as the log's");
                self.apply_set(pos, m);
            }
            Op::Remove(start) => {
                self.apply_remove(start)
                    .expect("the same mappings as the log's");
            }
            Op::RemoveRun(first, n) => {
                assert!(
                    self.apply_remove_run(first, n, None),
                    "the same mappings as the log's"
                );
            }
            Op::Clear => self.apply_clear(),
        }
    }

    /// Puts `mapping` into the index.
    pub(super) fn insert(&mut self, mapping: impl Into<Arc<Mapping>>) {
        self.insert_at(Place::UNKNOWN, mapping.into());
    }

    /// [`Index::insert`] at `place`, which `place` (of the sorted index) gave for its range
    /// in this index: no second search, here or in the copy the log is replayed on.
    pub(super) fn insert_at(&mut self, place: Place, mapping: Arc<Mapping>) {
        self.log.push(Op::Insert(mapping.clone(), place));
        self.apply_insert(mapping, place);
    }

    fn apply_insert(&mut self, mapping: Arc<Mapping>, place: Place) {
        let (start, last) = (mapping.iova.start().0, mapping.iova.last().0);
        let hot = Hot::of(&mapping);
        self.ranges.insert_at(place, start, last, hot, mapping);
        if table_pages(start, last).is_none() {
            self.big += 1;
            enter_huge(&mut self.pages, start, last, hot);
            return;
        }
        self.small += 1;
        if self.paged {
            enter_pages(&mut self.pages, start, last, hot);
        } else if self.small >= self.table_from {
            // Start the table with every small mapping there is, this one included.
            self.paged = true;
            for (start, last, hot, _) in self.ranges.iter() {
                if table_pages(start, last).is_some() {
                    enter_pages(&mut self.pages, start, last, hot);
                }
            }
        }
    }

    /// Replaces the mapping at `pos` with `mapping` (same range).
    pub(super) fn set(&mut self, pos: Pos, mapping: Mapping) {
        let mapping = Arc::new(mapping);
        self.log
            .push(Op::Set(mapping.iova.start().0, mapping.clone()));
        self.apply_set(pos, mapping);
    }

    fn apply_set(&mut self, pos: Pos, mapping: Arc<Mapping>) {
        let (start, last) = (mapping.iova.start().0, mapping.iova.last().0);
        let hot = Hot::of(&mapping);
        if table_pages(start, last).is_none() {
            enter_huge(&mut self.pages, start, last, hot);
        } else if self.paged {
            enter_pages(&mut self.pages, start, last, hot);
        }
        self.ranges.set(pos, hot, mapping);
    }

    /// Removes the mapping starting at `start`.
    pub(super) fn remove(&mut self, start: u64) -> Option<Arc<Mapping>> {
        let removed = self.apply_remove(start)?;
        self.log.push(Op::Remove(start));
        Some(removed)
    }

    fn apply_remove(&mut self, start: u64) -> Option<Arc<Mapping>> {
        let pos = self.ranges.find(start)?;
        let (first, last, _) = self.ranges.bounds(pos);
        if first != start {
            return None;
        }
        if let Some(pages) = table_pages(start, last) {
            self.small -= 1;
            // A table not kept holds no page words: nothing to clear then.
            if self.paged && self.small * 4 < self.table_from {
                // Too few left: drop the page words whole, keeping the huge words.
                self.paged = false;
                self.pages = PageTable::default();
                if self.big > 0 {
                    for (s, l, hot, _) in self.ranges.iter() {
                        if s != start && table_pages(s, l).is_none() {
                            enter_huge(&mut self.pages, s, l, hot);
                        }
                    }
                }
            } else if self.paged {
                self.pages.clear(start, pages);
            }
        } else {
            self.big -= 1;
            if let Some((first, granules)) = huge_granules(start, last) {
                self.pages.clear_huge(first, granules);
            }
        }
        Some(self.ranges.remove_at(pos))
    }

    /// Removes the mappings `hit` (as (start, mapping), in address order, each in the index):
    /// all at once if they are all there is and more than [`REPLAY_MAX`]; in one move (one
    /// logged op) if they sit side by side in the flat form, as the mappings an invalidation
    /// or unmap finds in its range do (an IOTLB buffer's pages); else from the last down, so
    /// that no removal shifts the entries the next ones take out. A few are removed one by one
    /// even when they are all: the copy keeps its chunk (and the writer's spare, which makes
    /// the same removals, its own) for the next insert, where starting again from nothing
    /// allocates both anew — what an IOTLB in strict mode does after each request.
    pub(super) fn remove_all(&mut self, hit: &[(u64, Arc<Mapping>)]) {
        if hit.len() == self.len() && hit.len() > REPLAY_MAX {
            self.clear();
            return;
        }
        if let [(first, _), _, ..] = hit {
            if self.apply_remove_run(*first, hit.len(), Some(hit)) {
                self.log.push(Op::RemoveRun(*first, hit.len()));
                return;
            }
        }
        for (start, _) in hit.iter().rev() {
            self.remove(*start).expect("a mapping of the index");
        }
    }

    /// Removes the `n` mappings side by side from the one starting at `first` in one move, if
    /// the sorted index is flat and holds them (and, with `hit`, they are those, in order), and
    /// the removals would not drop the page table (which [`Index::apply_remove`] rebuilds from
    /// the ranges); returns whether it did. The counts and page-table words go entry by entry,
    /// as in [`Index::apply_remove`].
    fn apply_remove_run(
        &mut self,
        first: u64,
        n: usize,
        hit: Option<&[(u64, Arc<Mapping>)]>,
    ) -> bool {
        let Some((i, starts, lasts)) = self.ranges.flat_run(first, n) else {
            return false;
        };
        if hit.is_some_and(|hit| !hit.iter().map(|h| &h.0).eq(starts)) {
            return false;
        }
        let small = (starts.iter().zip(lasts))
            .filter(|&(&s, &l)| table_pages(s, l).is_some())
            .count() as u64;
        if self.paged && (self.small - small) * 4 < self.table_from {
            return false;
        }
        for (&start, &last) in starts.iter().zip(lasts) {
            if let Some(pages) = table_pages(start, last) {
                if self.paged {
                    self.pages.clear(start, pages);
                }
            } else {
                self.big -= 1;
                if let Some((first, granules)) = huge_granules(start, last) {
                    self.pages.clear_huge(first, granules);
                }
            }
        }
        self.small -= small;
        self.ranges.remove_flat_run(i, n);
        true
    }

    /// See [`Ranges::reindex`].
    pub(super) fn reindex(&mut self) {
        self.ranges.reindex();
    }

    /// The hot word in a page-table `word`.
    #[inline(always)]
    fn page_hot(word: u64) -> Hot {
        Hot(word & !Hot::LEFT)
    }

    /// The last byte of the mapping whose page-table `word` (non-zero) `iova`'s page holds.
    #[inline(always)]
    fn page_last(iova: u64, word: u64) -> u64 {
        let left = (word & Hot::LEFT) >> Hot::LEFT_SHIFT;
        (iova & !(PAGE - 1))
            .wrapping_add(left * PAGE)
            .wrapping_sub(1)
    }
}

/// The pages of a mapping `[start, last]` if the page table can take it (at most
/// [`TABLE_PAGES_MAX`]).
fn table_pages(start: u64, last: u64) -> Option<u64> {
    let pages = (last - start) / PAGE + 1;
    (pages <= TABLE_PAGES_MAX).then_some(pages)
}

/// The whole 2 MiB granules of a mapping `[start, last]`, as (first, count), if any.
fn huge_granules(start: u64, last: u64) -> Option<(u64, u64)> {
    // In granule numbers, so that nothing overflows at the top of the address space.
    let first = start.div_ceil(HUGE_SPAN);
    let end = last / HUGE_SPAN + u64::from(last % HUGE_SPAN == HUGE_SPAN - 1);
    (end > first).then(|| (first * HUGE_SPAN, end - first))
}

/// Writes the huge words of a big mapping `[start, last]` with `hot` where they can answer (a
/// host address, no dirty log); else clears them, so the sorted index answers.
fn enter_huge(table: &mut PageTable, start: u64, last: u64, hot: Hot) {
    let Some((first, granules)) = huge_granules(start, last) else {
        return;
    };
    if hot.valid() && !hot.dirty() {
        table.fill_huge(first, granules, |_| hot.0);
    } else {
        table.clear_huge(first, granules);
    }
}

/// Writes the page-table words of a mapping `[start, last]` with `hot`, if it is small; where
/// the table refuses, clears them, so the sorted index answers.
fn enter_pages(table: &mut PageTable, start: u64, last: u64, hot: Hot) {
    let Some(pages) = table_pages(start, last) else {
        return;
    };
    if !table.fill(start, pages, |k| hot.0 | (pages - k) << Hot::LEFT_SHIFT) {
        table.clear(start, pages);
    }
}

/// The mappings at one generation.
pub(super) struct DmaSnapshot {
    pub(super) generation: u64,
    pub(super) map: Index,
    /// Mappings whose host address is invalidated.
    pub(super) invalid: u64,
}

impl DmaSnapshot {
    /// The page table's answer for an access of `len` bytes (> 0) needing `need` at `iova`,
    /// as (hot word, first byte, last byte) of a part of the mapping holding `iova`, when it
    /// answers outright: the page is a small mapping's or in a big one's whole granule,
    /// allowed, with a host address, and not logging dirty pages (whose marking needs the
    /// sorted index's position). A small mapping's answer runs to the mapping's end; a huge
    /// word's is its granule, and it answers only an access that ends in it. Anything else —
    /// no entry, a refusal and its exact error, an access past a granule — is the sorted
    /// index's, the record.
    #[inline(always)]
    pub(super) fn page_answer(&self, iova: u64, len: u64, need: Prot) -> Option<(Hot, u64, u64)> {
        // A table not kept holds no page words, and huge words only for big mappings: with
        // neither, the sorted index answers without a walk to an empty root first.
        if !self.map.paged && self.map.big == 0 {
            return None;
        }
        word_answer(iova, len, self.map.pages.word(iova), need)
    }

    /// The index entry holding `iova`, as (start, last, hot word, mapping).
    pub(super) fn entry(&self, iova: u64) -> Option<(u64, u64, Hot, &Arc<Mapping>)> {
        self.map.find(iova).map(|p| self.map.get(p))
    }
}

/// [`DmaSnapshot::page_answer`] from the table's `word` for `iova`.
#[inline(always)]
pub(super) fn word_answer(iova: u64, len: u64, word: Word, need: Prot) -> Option<(Hot, u64, u64)> {
    let hot = Index::page_hot(word.bits);
    if !(hot.prot().contains(need) & hot.valid() & !hot.dirty()) {
        return None;
    }
    if word.huge {
        // A huge word holds no count of what is left: it answers for its granule alone.
        let first = iova & !(HUGE_SPAN - 1);
        let last = first + (HUGE_SPAN - 1);
        return (len.wrapping_sub(1) <= last - iova).then_some((hot, first, last));
    }
    // Valid, so the word is a page's (an empty word is 0): the pages left are at least one.
    Some((hot, iova & !(PAGE - 1), Index::page_last(iova, word.bits)))
}
