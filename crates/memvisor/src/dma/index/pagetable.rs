//! A persistent table of one 64-bit word per 4 KiB page: a lookup that indexes, never searches.
//!
//! The sorted index ([`RangeMap`](super::rangemap::RangeMap)) finds any range in any address
//! space, but with 100 000 scattered 4 KiB mappings — what a guest behind a vIOMMU makes — a
//! random lookup walks a bucket, a chunk pointer, a line of group tops and a group's lines, most
//! of them cache misses, one after the other. A radix table indexed by address bits answers the
//! same question with a fixed walk whose upper levels stay in cache (SPDK's two-level
//! translation map answers in a few ns this way, but for 2 MiB units only; this one keeps a
//! word per 4 KiB page, so it can hold what a vIOMMU maps).
//!
//! **Shape.** Four levels over the low [`WINDOW`] (512 GiB) of the address space: a root of 64
//! children of 8 GiB, each of 64 children of 128 MiB, each of 64 leaves of 2 MiB, each leaf an
//! array of 512 words (4 KiB), one per page. A word of 0 means "nothing here"; what a non-zero
//! word means is the owner's business. Addresses at or above the window are never in the
//! table. A lookup is a window check and four dependent loads, the last the only one likely to
//! miss the cache.
//!
//! **Huge words.** A mapping bigger than a leaf (guest RAM) would cost a leaf per 2 MiB of
//! words all alike. Instead, each whole 2 MiB granule it covers holds one **huge word** at the
//! mid level, beside the leaf pointer, like a PMD block entry in a CPU's page table: a lookup
//! that finds one stops there, three dependent loads from the table (two from a [`Region`]).
//! A granule holds a huge word or a leaf, never both (mappings do not overlap, and only a
//! mapping covering the whole granule gets a huge word). Huge words need no leaf, so they are
//! outside the budget. [`PageTable::word`] says which kind of word answered.
//!
//! **Persistence.** Every node is behind an `Arc`, as the sorted index's chunks are: cloning the
//! table is one reference count; changing a clone copies the path to the leaf it touches
//! (`Arc::make_mut`: a 4 KiB leaf and up to three 64-pointer nodes, whose children's counts are
//! bumped) and leaves every other snapshot as it was. Fan-out 64 above the leaves keeps that
//! copy small; 512 at the leaves keeps a leaf one page of memory.
//!
//! **Regions.** A reader that keeps translating in one 8 GiB region (a guest's IOVAs mostly lie
//! in one) can hold that root child as a [`Region`] and walk two levels from it: no window check,
//! two dependent loads fewer. A region belongs to the table it was taken from, like any other
//! part of a snapshot.
//!
//! **Budget.** A leaf costs 4 KiB however few of its words are used, so a guest that scatters
//! single pages 2 MiB apart would make the table cost 4 KiB per page it maps. The table refuses
//! a fill that would need a new leaf beyond [`LEAF_FLOOR`] leaves plus one per [`LEAF_SHARE`]
//! words held: at most 4 KiB per 16 pages beyond the first 256 KiB. A refused fill changes
//! nothing; the owner then answers those addresses the slow way. Empty leaves and nodes are
//! freed as their last word is cleared.

use std::sync::Arc;

/// The addresses the table covers: `[0, WINDOW)`.
pub const WINDOW: u64 = 1 << 39;
/// Leaves the table may always have.
pub const LEAF_FLOOR: u64 = 64;
/// Words held per leaf allowed beyond [`LEAF_FLOOR`].
pub const LEAF_SHARE: u64 = 16;

const PAGE_SHIFT: u32 = 12;
const LEAF_WORDS: usize = 512;
const LEAF_SPAN: u64 = (LEAF_WORDS as u64) << PAGE_SHIFT;
/// The bytes one huge word covers: a granule, what one leaf would cover.
pub const HUGE_SPAN: u64 = LEAF_SPAN;
const FANOUT: usize = 64;
/// Shifts of the index bits of the mid, upper and root levels.
const MID_SHIFT: u32 = 21;
const UPPER_SHIFT: u32 = 27;
const ROOT_SHIFT: u32 = 33;

#[derive(Clone)]
struct Leaf {
    words: [u64; LEAF_WORDS],
    /// Non-zero words.
    used: u32,
}

#[derive(Clone)]
struct Node<C> {
    children: [Option<Arc<C>>; FANOUT],
    /// Children present.
    used: u32,
}

impl<C> Node<C> {
    fn new() -> Self {
        Node {
            children: std::array::from_fn(|_| None),
            used: 0,
        }
    }
}

/// One granule's place in a mid node: its leaf, or its huge word (non-zero), or neither.
#[derive(Clone, Default)]
struct Slot {
    leaf: Option<Arc<Leaf>>,
    huge: u64,
}

/// The mid level: per 2 MiB granule, a leaf or a huge word, side by side in one 16-byte slot
/// so that a lookup reads one line for both.
#[derive(Clone)]
struct Mid {
    slots: [Slot; FANOUT],
    /// Slots holding a leaf or a huge word.
    used: u32,
}

impl Mid {
    fn new() -> Self {
        Mid {
            slots: std::array::from_fn(|_| Slot::default()),
            used: 0,
        }
    }

    #[inline(always)]
    fn word(&self, addr: u64) -> Word {
        let slot = &self.slots[child(addr, MID_SHIFT)];
        if slot.huge != 0 {
            return Word {
                bits: slot.huge,
                huge: true,
            };
        }
        Word {
            bits: slot
                .leaf
                .as_deref()
                .map_or(0, |l| l.words[word_index(addr)]),
            huge: false,
        }
    }
}

/// What a lookup found: a page's word, or the huge word of its 2 MiB granule; `bits` 0 for
/// nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Word {
    pub bits: u64,
    /// Whether `bits` is a huge word (it answers for the whole granule).
    pub huge: bool,
}

impl Word {
    const NONE: Word = Word {
        bits: 0,
        huge: false,
    };
}

type Upper = Node<Mid>;
type Root = Node<Upper>;

#[inline(always)]
fn child(addr: u64, shift: u32) -> usize {
    ((addr >> shift) as usize) & (FANOUT - 1)
}

#[inline(always)]
fn word_index(addr: u64) -> usize {
    ((addr >> PAGE_SHIFT) as usize) & (LEAF_WORDS - 1)
}

/// The child at `i`, created empty if missing (`created` says whether it was).
fn child_mut<'a, C: Clone>(
    node: &'a mut Node<C>,
    i: usize,
    new: fn() -> C,
    created: &mut bool,
) -> &'a mut C {
    let slot = &mut node.children[i];
    if slot.is_none() {
        node.used += 1;
        *created = true;
    }
    Arc::make_mut(slot.get_or_insert_with(|| Arc::new(new())))
}

/// One word per 4 KiB page of `[0, WINDOW)`, 0 where nothing was filled.
#[derive(Clone)]
pub struct PageTable {
    root: Arc<Root>,
    leaves: u64,
    words: u64,
    /// Huge words held.
    huge: u64,
}

impl Default for PageTable {
    fn default() -> Self {
        PageTable {
            root: Arc::new(Root::new()),
            leaves: 0,
            words: 0,
            huge: 0,
        }
    }
}

impl std::fmt::Debug for PageTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageTable")
            .field("leaves", &self.leaves)
            .field("words", &self.words)
            .field("huge", &self.huge)
            .finish()
    }
}

/// The table's part over one 8 GiB region (one child of the root), held on its own: a reader
/// that stays in the region (a cursor; a guest's IOVAs mostly lie in one such region) walks two
/// levels from it instead of four from the table, skipping the window check and two dependent
/// loads. It is a snapshot of that part, as the table it came from is: take it again from the
/// table that replaces it.
#[derive(Clone)]
pub struct Region {
    /// `addr >> ROOT_SHIFT` for the addresses of the region; `u64::MAX` for none.
    tag: u64,
    upper: Option<Arc<Upper>>,
}

impl Region {
    /// No region: holds no address.
    pub const NONE: Region = Region {
        tag: u64::MAX,
        upper: None,
    };

    /// Whether `addr` lies in the region.
    #[inline(always)]
    pub fn holds(&self, addr: u64) -> bool {
        addr >> ROOT_SHIFT == self.tag
    }

    /// [`PageTable::word`] for `addr`, which the region holds.
    #[inline(always)]
    pub fn word(&self, addr: u64) -> Word {
        debug_assert!(self.holds(addr));
        let mid = self
            .upper
            .as_deref()
            .and_then(|upper| upper.children[child(addr, UPPER_SHIFT)].as_deref());
        mid.map_or(Word::NONE, |m| m.word(addr))
    }
}

impl PageTable {
    /// The word of the page holding `addr` in its leaf; 0 if none (a huge word is not read:
    /// see [`PageTable::word`]). For tests: lookups use [`PageTable::word`].
    #[cfg(test)]
    pub fn get(&self, addr: u64) -> u64 {
        self.leaf(addr).map_or(0, |l| l.words[word_index(addr)])
    }

    /// The word that answers for `addr`: its granule's huge word if it has one, else its
    /// page's word (0 if none).
    #[inline(always)]
    pub fn word(&self, addr: u64) -> Word {
        self.mid(addr).map_or(Word::NONE, |m| m.word(addr))
    }

    /// The huge word of the granule holding `addr`; 0 if none.
    #[cfg(test)]
    pub fn huge_word(&self, addr: u64) -> u64 {
        self.mid(addr)
            .map_or(0, |m| m.slots[child(addr, MID_SHIFT)].huge)
    }

    /// The region holding `addr`: [`Region::NONE`] above the window.
    pub fn region(&self, addr: u64) -> Region {
        if addr >= WINDOW {
            return Region::NONE;
        }
        Region {
            tag: addr >> ROOT_SHIFT,
            upper: self.root.children[child(addr, ROOT_SHIFT)].clone(),
        }
    }

    #[inline(always)]
    fn mid(&self, addr: u64) -> Option<&Mid> {
        if addr >= WINDOW {
            return None;
        }
        let upper = self.root.children[child(addr, ROOT_SHIFT)].as_deref()?;
        upper.children[child(addr, UPPER_SHIFT)].as_deref()
    }

    #[inline(always)]
    fn leaf(&self, addr: u64) -> Option<&Leaf> {
        self.mid(addr)?.slots[child(addr, MID_SHIFT)]
            .leaf
            .as_deref()
    }

    /// Leaves allocated.
    #[cfg(test)]
    pub fn leaves(&self) -> u64 {
        self.leaves
    }

    /// Non-zero words held.
    #[cfg(test)]
    pub fn words(&self) -> u64 {
        self.words
    }

    /// Huge words held.
    #[cfg(test)]
    pub fn huge_words(&self) -> u64 {
        self.huge
    }

    /// The leaf-sized pieces of `[first, first + pages * 4 KiB)`: (start, pages) each.
    fn pieces(first: u64, pages: u64) -> impl Iterator<Item = (u64, u64)> {
        let end = first + (pages << PAGE_SHIFT);
        let mut at = first;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let stop = ((at / LEAF_SPAN) + 1).saturating_mul(LEAF_SPAN).min(end);
            let piece = (at, (stop - at) >> PAGE_SHIFT);
            at = stop;
            Some(piece)
        })
    }

    /// Sets the words of the `pages` pages from `first` (4 KiB aligned): the `k`-th page's to
    /// `word(k)`, which must not be 0. Returns false and changes nothing if the pages reach past
    /// [`WINDOW`] or would take the table past its budget.
    pub fn fill(&mut self, first: u64, pages: u64, word: impl Fn(u64) -> u64) -> bool {
        debug_assert_eq!(first % (1 << PAGE_SHIFT), 0);
        let i = word_index(first);
        if first < WINDOW && pages > 0 && pages <= (LEAF_WORDS - i) as u64 {
            // Inside one leaf (a vIOMMU's page, nearly always): one walk to read whether the
            // leaf is there, one to write.
            if self.leaf(first).is_none() && !self.may_add_leaves(1, pages) {
                return false;
            }
            self.fill_piece(first, pages as usize, 0, &word);
            return true;
        }
        let fits = pages
            .checked_shl(PAGE_SHIFT)
            .and_then(|len| first.checked_add(len))
            .is_some_and(|end| end <= WINDOW);
        if !fits || pages == 0 {
            return pages == 0;
        }
        let new_leaves = Self::pieces(first, pages)
            .filter(|&(at, _)| self.leaf(at).is_none())
            .count() as u64;
        if new_leaves > 0 && !self.may_add_leaves(new_leaves, pages) {
            return false;
        }
        let mut k = 0;
        for (at, n) in Self::pieces(first, pages) {
            self.fill_piece(at, n as usize, k, &word);
            k += n;
        }
        true
    }

    /// Whether the budget allows `new` more leaves for `pages` more words.
    fn may_add_leaves(&self, new: u64, pages: u64) -> bool {
        self.leaves + new <= LEAF_FLOOR + (self.words + pages) / LEAF_SHARE
    }

    /// Sets the words of the `n` pages from `at`, all in one leaf (made if missing), the
    /// `j`-th to `word(k + j)`.
    #[inline(always)]
    fn fill_piece(&mut self, at: u64, n: usize, k: u64, word: &impl Fn(u64) -> u64) {
        let root = Arc::make_mut(&mut self.root);
        let upper = child_mut(root, child(at, ROOT_SHIFT), Upper::new, &mut false);
        let mid = child_mut(upper, child(at, UPPER_SHIFT), Mid::new, &mut false);
        let slot = &mut mid.slots[child(at, MID_SHIFT)];
        debug_assert_eq!(slot.huge, 0, "pages in a granule with a huge word");
        if slot.leaf.is_none() {
            mid.used += 1;
            self.leaves += 1;
        }
        let leaf = Arc::make_mut(slot.leaf.get_or_insert_with(|| Arc::new(Leaf::new())));
        let i = word_index(at);
        for (j, slot) in leaf.words[i..i + n].iter_mut().enumerate() {
            let w = word(k + j as u64);
            debug_assert_ne!(w, 0, "a filled word is never 0");
            if *slot == 0 {
                leaf.used += 1;
                self.words += 1;
            }
            *slot = w;
        }
    }

    /// Sets the words of the `pages` pages from `first` to 0, freeing leaves and nodes left
    /// empty. Pages outside the table are ignored.
    pub fn clear(&mut self, first: u64, pages: u64) {
        if first >= WINDOW || pages == 0 {
            return;
        }
        let i = word_index(first);
        if pages <= (LEAF_WORDS - i) as u64 {
            // Inside one leaf (a vIOMMU's page, nearly always).
            self.clear_held(first, i..i + pages as usize);
            return;
        }
        let end = first.saturating_add(pages.saturating_mul(1 << PAGE_SHIFT));
        let pages = (end.min(WINDOW) - first) >> PAGE_SHIFT;
        for (at, n) in Self::pieces(first, pages) {
            let i = word_index(at);
            self.clear_held(at, i..i + n as usize);
        }
    }

    /// Clears the words `range` of the leaf holding `at` if any of them is set: untouched
    /// leaves are not copied.
    #[inline(always)]
    fn clear_held(&mut self, at: u64, range: std::ops::Range<usize>) {
        let held = self
            .leaf(at)
            .is_some_and(|l| l.words[range.clone()].iter().any(|&w| w != 0));
        if held {
            self.clear_piece(at, range);
        }
    }

    fn clear_piece(&mut self, at: u64, range: std::ops::Range<usize>) {
        let (ri, ui, mi) = (
            child(at, ROOT_SHIFT),
            child(at, UPPER_SHIFT),
            child(at, MID_SHIFT),
        );
        let root = Arc::make_mut(&mut self.root);
        let Some(upper) = root.children[ri].as_mut().map(Arc::make_mut) else {
            return;
        };
        let Some(mid) = upper.children[ui].as_mut().map(Arc::make_mut) else {
            return;
        };
        let Some(leaf) = mid.slots[mi].leaf.as_mut().map(Arc::make_mut) else {
            return;
        };
        for slot in &mut leaf.words[range] {
            if *slot != 0 {
                *slot = 0;
                leaf.used -= 1;
                self.words -= 1;
            }
        }
        if leaf.used > 0 {
            return;
        }
        mid.slots[mi].leaf = None;
        mid.used -= 1;
        self.leaves -= 1;
        if mid.used > 0 {
            return;
        }
        upper.children[ui] = None;
        upper.used -= 1;
        if upper.used == 0 {
            root.children[ri] = None;
            root.used -= 1;
        }
    }

    /// Sets the huge words of the `granules` 2 MiB granules from `first` (aligned to 2 MiB):
    /// the `k`-th one's to `word(k)`, which must not be 0. Granules at or above [`WINDOW`]
    /// are left out; the others must hold no leaf (their pages belong to one mapping).
    pub fn fill_huge(&mut self, first: u64, granules: u64, word: impl Fn(u64) -> u64) {
        debug_assert_eq!(first % HUGE_SPAN, 0);
        for k in 0..granules {
            let Some(at) = (k.checked_mul(HUGE_SPAN))
                .and_then(|o| first.checked_add(o))
                .filter(|&a| a < WINDOW)
            else {
                return;
            };
            let w = word(k);
            debug_assert_ne!(w, 0, "a huge word is never 0");
            let root = Arc::make_mut(&mut self.root);
            let upper = child_mut(root, child(at, ROOT_SHIFT), Upper::new, &mut false);
            let mid = child_mut(upper, child(at, UPPER_SHIFT), Mid::new, &mut false);
            let slot = &mut mid.slots[child(at, MID_SHIFT)];
            debug_assert!(slot.leaf.is_none(), "a huge word over a granule with pages");
            if slot.huge == 0 {
                mid.used += 1;
                self.huge += 1;
            }
            slot.huge = w;
        }
    }

    /// Sets the huge words of the `granules` granules from `first` (aligned) to 0, freeing
    /// nodes left empty. Granules outside the table are ignored.
    pub fn clear_huge(&mut self, first: u64, granules: u64) {
        debug_assert_eq!(first % HUGE_SPAN, 0);
        for k in 0..granules {
            let Some(at) = (k.checked_mul(HUGE_SPAN))
                .and_then(|o| first.checked_add(o))
                .filter(|&a| a < WINDOW)
            else {
                return;
            };
            // Untouched nodes are not copied.
            if self
                .mid(at)
                .is_none_or(|m| m.slots[child(at, MID_SHIFT)].huge == 0)
            {
                continue;
            }
            let (ri, ui, mi) = (
                child(at, ROOT_SHIFT),
                child(at, UPPER_SHIFT),
                child(at, MID_SHIFT),
            );
            let root = Arc::make_mut(&mut self.root);
            let Some(upper) = root.children[ri].as_mut().map(Arc::make_mut) else {
                continue;
            };
            let Some(mid) = upper.children[ui].as_mut().map(Arc::make_mut) else {
                continue;
            };
            mid.slots[mi].huge = 0;
            mid.used -= 1;
            self.huge -= 1;
            if mid.used > 0 {
                continue;
            }
            upper.children[ui] = None;
            upper.used -= 1;
            if upper.used == 0 {
                root.children[ri] = None;
                root.used -= 1;
            }
        }
    }
}

impl Leaf {
    fn new() -> Self {
        Leaf {
            words: [0; LEAF_WORDS],
            used: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const P: u64 = 4096;

    /// Checks the table against `model` (page address -> word) at every page the model holds
    /// and at `probes`, and its counts against a walk of its nodes.
    fn check(t: &PageTable, model: &BTreeMap<u64, u64>, probes: &[u64]) {
        for (&a, &w) in model {
            assert_eq!(t.get(a), w, "page {a:#x}");
            assert_eq!(t.get(a + P - 1), w, "last byte of page {a:#x}");
        }
        for &a in probes {
            let want = model.get(&(a & !(P - 1))).copied().unwrap_or(0);
            assert_eq!(t.get(a), want, "probe {a:#x}");
        }
        assert_eq!(t.words(), model.len() as u64);
        let (mut leaves, mut words) = (0, 0);
        assert_eq!(
            t.root.used as usize,
            t.root.children.iter().flatten().count()
        );
        for upper in t.root.children.iter().flatten() {
            assert!(upper.used > 0, "an empty node is freed");
            assert_eq!(upper.used as usize, upper.children.iter().flatten().count());
            for mid in upper.children.iter().flatten() {
                assert!(mid.used > 0, "an empty node is freed");
                let held = mid.slots.iter();
                assert_eq!(
                    mid.used as usize,
                    held.filter(|s| s.leaf.is_some() || s.huge != 0).count()
                );
                for slot in &mid.slots {
                    assert!(
                        slot.leaf.is_none() || slot.huge == 0,
                        "a leaf or a huge word"
                    );
                }
                for leaf in mid.slots.iter().filter_map(|s| s.leaf.as_deref()) {
                    let n = leaf.words.iter().filter(|&&w| w != 0).count() as u32;
                    assert!(n > 0, "an empty leaf is freed");
                    assert_eq!(leaf.used, n);
                    leaves += 1;
                    words += u64::from(n);
                }
            }
        }
        assert_eq!((t.leaves(), t.words()), (leaves, words));
    }

    #[test]
    fn fill_get_clear_across_leaves_and_nodes() {
        let mut t = PageTable::default();
        let mut model = BTreeMap::new();
        // Across a leaf boundary (2 MiB) and an upper boundary (8 GiB).
        for first in [LEAF_SPAN - 3 * P, (8 << 30) - 2 * P, WINDOW - 4 * P] {
            assert!(t.fill(first, 4, |k| (0x1000 * (k + 1)) | 3));
            for k in 0..4 {
                model.insert(first + k * P, (0x1000 * (k + 1)) | 3);
            }
        }
        let probes = [0, P, LEAF_SPAN, 8 << 30, WINDOW, WINDOW + P, u64::MAX];
        check(&t, &model, &probes);
        t.clear(LEAF_SPAN - 3 * P, 2);
        model.remove(&(LEAF_SPAN - 3 * P));
        model.remove(&(LEAF_SPAN - 2 * P));
        check(&t, &model, &probes);
        t.clear(0, WINDOW / P);
        model.clear();
        check(&t, &model, &probes);
        assert_eq!(t.leaves(), 0);
    }

    #[test]
    fn outside_the_window_is_refused_whole() {
        let mut t = PageTable::default();
        assert!(!t.fill(WINDOW - P, 2, |_| 1));
        assert!(!t.fill(WINDOW, 1, |_| 1));
        assert!(!t.fill(!(P - 1), 1, |_| 1));
        assert!(!t.fill(0, u64::MAX, |_| 1));
        check(&t, &BTreeMap::new(), &[WINDOW - P, 0]);
        // Clearing there is a no-op, not a panic.
        t.clear(WINDOW - P, u64::MAX);
        t.clear(!(P - 1), 1);
    }

    #[test]
    fn a_clone_is_a_snapshot() {
        let mut t = PageTable::default();
        assert!(t.fill(0, 3, |k| k + 1));
        let old = t.clone();
        assert!(t.fill(P, 1, |_| 9));
        t.clear(0, 1);
        assert!(t.fill(LEAF_SPAN, 1, |_| 7));
        assert_eq!([old.get(0), old.get(P), old.get(LEAF_SPAN)], [1, 2, 0]);
        assert_eq!([t.get(0), t.get(P), t.get(LEAF_SPAN)], [0, 9, 7]);
    }

    #[test]
    fn scattered_pages_hit_the_budget_and_change_nothing() {
        let mut t = PageTable::default();
        let mut model = BTreeMap::new();
        // One page per leaf: the floor's leaves and the few the pages earn, then refusals.
        let tries = 4 * LEAF_FLOOR;
        let mut refused = 0;
        for i in 0..tries {
            let a = i * LEAF_SPAN;
            if t.fill(a, 1, |_| 5) {
                model.insert(a, 5);
            } else {
                refused += 1;
            }
            assert!(t.leaves() <= LEAF_FLOOR + t.words() / LEAF_SHARE);
        }
        assert!(t.leaves() >= LEAF_FLOOR);
        assert_eq!(refused, tries - t.leaves());
        check(&t, &model, &[(tries - 1) * LEAF_SPAN]);
        // Pages in leaves that exist are always taken; dense pages earn new leaves.
        assert!(t.fill(P, 1, |_| 6));
        model.insert(P, 6);
        let dense = LEAF_FLOOR * LEAF_SPAN;
        assert!(t.fill(dense, LEAF_SHARE, |_| 8));
        for k in 0..LEAF_SHARE {
            model.insert(dense + k * P, 8);
        }
        check(&t, &model, &[]);
    }

    #[test]
    fn huge_words_answer_for_their_granule_and_keep_nodes_right() {
        let mut t = PageTable::default();
        // Pages in the granule below, then 3 huge words across an upper boundary (128 MiB).
        let first = (128 << 20) - 2 * HUGE_SPAN;
        assert!(t.fill(first - P, 1, |_| 5));
        t.fill_huge(first, 3, |k| (0x10_0000 * (k + 1)) | 3);
        let old = t.clone();
        assert_eq!(t.huge_words(), 3);
        for k in 0..3 {
            for a in [first + k * HUGE_SPAN, first + (k + 1) * HUGE_SPAN - 1] {
                let w = t.word(a);
                assert_eq!(
                    w,
                    Word {
                        bits: (0x10_0000 * (k + 1)) | 3,
                        huge: true
                    },
                    "{a:#x}"
                );
                assert_eq!(t.region(a).word(a), w, "the region's answer at {a:#x}");
                assert_eq!(t.get(a), 0, "no leaf under a huge word");
            }
        }
        assert_eq!(
            t.word(first - P),
            Word {
                bits: 5,
                huge: false
            }
        );
        assert_eq!(t.word(first + 3 * HUGE_SPAN), Word::NONE);
        // Past the window: left out, no panic.
        t.fill_huge(WINDOW - HUGE_SPAN, 2, |_| 7);
        assert_eq!(t.huge_words(), 4);
        assert_eq!(t.word(WINDOW).bits, 0);
        t.clear_huge(WINDOW - HUGE_SPAN, 2);
        t.clear_huge(first, 2);
        assert_eq!(t.huge_words(), 1);
        assert_eq!(t.word(first).bits, 0);
        assert!(t.word(first + 2 * HUGE_SPAN).huge);
        t.clear_huge(first + 2 * HUGE_SPAN, 1);
        t.clear(first - P, 1);
        // Every node freed: the root has no child left.
        assert_eq!(
            (t.root.used, t.leaves(), t.words(), t.huge_words()),
            (0, 0, 0, 0)
        );
        // The clone taken before is a snapshot.
        assert!(old.word(first).huge && old.word(first - P).bits == 5);
        check(&old, &BTreeMap::from([(first - P, 5)]), &[]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Fill(u64, u64, u64),
        Clear(u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        // Pages clustered around a few leaf and node boundaries, so that pieces cross them.
        let page = prop_oneof![
            0u64..2048,
            (8u64 << 18) - 600..(8u64 << 18) + 600,
            (WINDOW >> 12) - 700..(WINDOW >> 12),
        ];
        prop_oneof![
            (page.clone(), 1u64..600, 1u64..1000).prop_map(|(p, n, w)| Op::Fill(p * P, n, w)),
            (page, 1u64..1200).prop_map(|(p, n)| Op::Clear(p * P, n)),
        ]
    }

    proptest! {
        #[test]
        fn page_table_matches_a_btree_map(ops in proptest::collection::vec(op(), 1..40)) {
            let mut t = PageTable::default();
            let mut model = BTreeMap::new();
            let mut snapshots = Vec::new();
            for op in ops {
                snapshots.push((t.clone(), model.clone()));
                match op {
                    Op::Fill(first, n, w) => {
                        let fits = first + n * P <= WINDOW;
                        let filled = t.fill(first, n, |k| w * 4096 + k + 1);
                        // The budget floor is never reached by these sizes.
                        prop_assert_eq!(filled, fits);
                        if filled {
                            for k in 0..n {
                                model.insert(first + k * P, w * 4096 + k + 1);
                            }
                        }
                    }
                    Op::Clear(first, n) => {
                        t.clear(first, n);
                        for k in 0..n {
                            model.remove(&(first + k * P));
                        }
                    }
                }
                check(&t, &model, &[0, WINDOW - 1, WINDOW]);
            }
            // Every earlier clone still reads as it was.
            for (t, model) in &snapshots {
                check(t, model, &[]);
            }
        }
    }
}
