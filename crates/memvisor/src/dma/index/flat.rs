//! The sorted index in two forms: a flat array for a space with few mappings, the persistent chunks
//! of [`RangeMap`] for a big one, behind one set of lookups ([`Ranges`]).
//!
//! **Why a flat form.** [`RangeMap`] is built so that a change to a space of 100,000 mappings
//! copies O(n / 256) pointers: every level (the piece list, the chunk, the value group) sits behind
//! an `Arc`, and an edit goes through `Arc::make_mut` at each one, an atomic compare-and-swap even
//! when nothing shares it. An IOTLB in strict mode holds few mappings (the requests in flight and
//! the rings: tens to a few hundred) and changes one per message, each change made twice, on the
//! writer's working copy and on its spare (`publish`). There the sharing buys nothing — the writer
//! edits a snapshot in place only when it holds the only reference to the whole snapshot
//! (`Arc::get_mut` after the grace wait), so no inner level is ever shared while it is edited — and
//! the atomics, the value slots and the levels were most of an edit.
//!
//! So a small index is a [`Flat`]: the same sorted arrays as one of [`RangeMap`]'s chunks (ends,
//! starts and hot values in fixed arrays, padded with `u64::MAX`, plus `tops`, the end of each
//! group of [`GROUP`] entries), at most [`CAP`] entries, with the values in slots beside them (a
//! byte per entry says which; four words say which slots are free), all held by value inside the
//! snapshot (8.6 KiB with memvisor's 8-byte hot word and `Arc` value). An edit is a binary search
//! and a move of the entries after it, no atomic and no allocation; copying the index (a working
//! copy taken while a reader holds the spare) copies the array and counts the values, as the first
//! edit of a copied chunk did. A lookup reads the same lines in the same order as a one-chunk
//! [`RangeMap`]'s, one pointer less: the array is in the snapshot; with at most 64 entries it reads
//! one line of `tops`, not four.
//!
//! **When it converts.** An insert into a flat index holding `flat_max` entries ([`CAP`] in
//! the product) makes it chunked; a removal that leaves a chunked index with `flat_max / 2` or
//! fewer makes it flat again. The gap between the two is the hysteresis: a space that hovers around
//! one threshold converts at most once per `flat_max / 2` changes, each conversion a copy of its
//! entries: into chunks half full in one pass ([`RangeMap::from_sorted`]), or back into a new flat
//! array. Both copies of the writer see the same changes in the same order, so they convert at the
//! same step. Readers see neither form: every lookup answers the same in both (the property tests
//! in `tests` and here hold each against a model).
//!
//! A position ([`Pos`]) is valid only in the index it came from, in the form it had then.

use super::rangemap::{GROUP, Pos, RangeMap, at_or_below, below};

/// Most entries a flat index holds: 32 groups, so that `tops` is four cache lines (as in a
/// [`RangeMap`] chunk) and the free value slots four words. A strict guest's IOTLB holds fewer
/// at nearly every update: the recorded `blk` stream holds at most 267 live entries, more than
/// 256 at 1% of its updates, more than 64 at 25% of them, which 64 (this constant until
/// session 31) sent to the chunked form and its `Arc::make_mut`s. An insert or a removal moves
/// the entries after its slot, and a guest reuses the IOVAs it freed last, just below the ones
/// it keeps: 69% of that stream's inserts have 1 to 3 entries after them, whatever the size.
/// (A first 256, in session 26, cost more than 64: it converted by inserting each entry into a
/// chunk, at ~770 instructions each, where [`RangeMap::from_sorted`] now writes them in one
/// pass, and searched again where an insert now takes the place [`Ranges::place`] found.)
pub const CAP: usize = 256;
const GROUPS: usize = CAP / GROUP;
/// Lines of `tops`.
const LINES: usize = GROUPS / GROUP;
/// Words of `used`, one bit per value slot.
const WORDS: usize = CAP / u64::BITS as usize;

/// Entries an insert or removal moves with a loop of its own rather than four `memmove`s:
/// each call costs about as much as moving a few entries by hand, and an IOTLB's edits land
/// near the end of the array (a guest reuses the IOVAs it freed last).
const SHORT_MOVE: usize = 8;

/// Where a range goes in a [`Ranges`], as [`Ranges::place`] found it: a slot of the flat
/// form, or [`Place::UNKNOWN`]. A hint, never trusted: an insert checks it against the
/// neighbours it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place(usize);

impl Place {
    /// No place known: an insert searches.
    pub const UNKNOWN: Place = Place(usize::MAX);
}

/// At most [`CAP`] disjoint ranges, sorted, in slots `0..len`; unused slots end and start at
/// `u64::MAX`. Aligned so that `tops` and every group's ends and starts start a cache line.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
pub struct Flat<H, V> {
    /// `tops[g]` = `lasts[g * GROUP + GROUP - 1]`.
    tops: [u64; GROUPS],
    len: usize,
    lasts: [u64; CAP],
    starts: [u64; CAP],
    hots: [H; CAP],
    /// `slot[i]`: where the `i`th range's value is in `values`. The values stay in their
    /// slots while the ranges move around them: an edit moves a byte per entry, not a value.
    slot: [u8; CAP],
    /// Bit `s % 64` of word `s / 64`: `values[s]` holds a value.
    used: [u64; WORDS],
    values: [Option<V>; CAP],
}

/// Group `g`'s ends (`lasts`) or starts.
#[inline(always)]
fn line(keys: &[u64; CAP], g: usize) -> &[u64; GROUP] {
    keys[g * GROUP..][..GROUP].try_into().expect("8 keys")
}

/// `tops` is four lines of [`GROUP`] keys (the group search reads the top of each of the first
/// three), and a slot's number fits the byte `slot` keeps.
const _: () = assert!(GROUPS == LINES * GROUP && CAP <= u8::MAX as usize + 1);

impl<H: Copy + Default, V: Clone> Flat<H, V> {
    fn new() -> Self {
        Flat {
            tops: [u64::MAX; GROUPS],
            len: 0,
            lasts: [u64::MAX; CAP],
            starts: [u64::MAX; CAP],
            hots: [H::default(); CAP],
            slot: [0; CAP],
            used: [0; WORDS],
            values: std::array::from_fn(|_| None),
        }
    }

    /// The group holding the first range that ends at or after `key`; `GROUPS` if none. As a
    /// [`RangeMap`] chunk's: three compares on the top of every 8th group pick a line of
    /// `tops` (their loads overlap), then its 8 tops are counted. With at most `GROUP * GROUP`
    /// ranges the line is the first (a branch the lookups of a small space always take): the
    /// other three lines are not read.
    #[inline(always)]
    fn group(&self, key: u64) -> usize {
        let t = &self.tops;
        let q = if self.len <= GROUP * GROUP {
            0
        } else {
            (1..LINES)
                .map(|q| usize::from(t[q * GROUP - 1] < key))
                .sum()
        };
        let line: &[u64; GROUP] = t[q * GROUP..][..GROUP].try_into().expect("8 tops");
        q * GROUP + below(line, key)
    }

    /// See [`RangeMap::lookup`]: with at most [`GROUP`] ranges it skips the group search.
    #[inline(always)]
    pub fn lookup(&self, key: u64) -> Option<(Pos, u64, u64, H)> {
        let g = if self.len <= GROUP {
            0
        } else {
            self.group(key)
        };
        if g == GROUPS {
            return None;
        }
        // As `Chunk::find_in`: the first range of the group ending at or after `key` holds it
        // iff more of the group's starts are at or below `key` than ends are below it.
        let j = below(line(&self.lasts, g), key);
        let s = at_or_below(line(&self.starts, g), key);
        let i = g * GROUP + j;
        // Unused slots start at u64::MAX: for that key alone the count can point at one.
        (j < s && (key != u64::MAX || i < self.len))
            .then(|| (Pos::at(i), self.starts[i], self.lasts[i], self.hots[i]))
    }

    /// The position of the first range that ends at or after `key`.
    pub fn first_ending_at_or_after(&self, key: u64) -> Option<Pos> {
        let g = self.group(key);
        if g == GROUPS {
            return None;
        }
        // Unused slots end at u64::MAX and never count: past `len` only if none ends there.
        let i = g * GROUP + below(line(&self.lasts, g), key);
        (i < self.len).then(|| Pos::at(i))
    }

    #[inline]
    pub fn bounds(&self, pos: Pos) -> (u64, u64, H) {
        let i = pos.index();
        debug_assert!(i < self.len, "a position in this map");
        (self.starts[i], self.lasts[i], self.hots[i])
    }

    #[inline]
    pub fn get(&self, pos: Pos) -> (u64, u64, H, &V) {
        let i = pos.index();
        (self.starts[i], self.lasts[i], self.hots[i], self.value(i))
    }

    #[inline]
    fn value(&self, i: usize) -> &V {
        self.values[usize::from(self.slot[i])]
            .as_ref()
            .expect("a range's slot holds its value")
    }

    /// Takes the value of the `i`th range out of its slot, which is free then.
    fn take_value(&mut self, i: usize) -> V {
        let s = usize::from(self.slot[i]);
        self.used[s / 64] &= !(1 << (s % 64));
        self.values[s]
            .take()
            .expect("a range's slot holds its value")
    }

    #[inline]
    pub fn next(&self, pos: Pos) -> Option<Pos> {
        let i = pos.index() + 1;
        (i < self.len).then(|| Pos::at(i))
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, H, &V)> {
        (0..self.len).map(|i| (self.starts[i], self.lasts[i], self.hots[i], self.value(i)))
    }

    /// Where `[start, last]` goes: `Ok(i)`, the slot an insert puts it in, if it overlaps no
    /// range; else `Err(i)`, the first range it overlaps. One search answers both.
    fn place(&self, start: u64, last: u64) -> Result<usize, usize> {
        let len = self.len;
        let i = self.starts[..len].partition_point(|&s| s < start);
        if i > 0 && self.lasts[i - 1] >= start {
            return Err(i - 1);
        }
        if i < len && self.starts[i] <= last {
            return Err(i);
        }
        Ok(i)
    }

    /// Adds `[start, last]` (overlapping nothing); the caller checked there is room. `hint`
    /// is where it goes if the caller knows ([`Flat::place`] on this array or on one holding
    /// the same ranges): taken only if the neighbours there say so, so that any other hint
    /// costs a search and never misplaces a range.
    #[inline(always)]
    fn insert(&mut self, hint: usize, start: u64, last: u64, hot: H, value: V) {
        let len = self.len;
        debug_assert!(len < CAP && start <= last);
        let fits = hint <= len
            && (hint == 0 || self.lasts[hint - 1] < start)
            && (hint == len || last < self.starts[hint]);
        let i = match fits {
            true => hint,
            false => self.starts[..len].partition_point(|&s| s < start),
        };
        if len - i <= SHORT_MOVE {
            // A few entries (an IOTLB's usual insert): moved one by one, all four arrays in
            // one loop, instead of four calls to `memmove`.
            for j in (i..len).rev() {
                self.lasts[j + 1] = self.lasts[j];
                self.starts[j + 1] = self.starts[j];
                self.hots[j + 1] = self.hots[j];
                self.slot[j + 1] = self.slot[j];
            }
        } else {
            self.lasts.copy_within(i..len, i + 1);
            self.starts.copy_within(i..len, i + 1);
            self.hots.copy_within(i..len, i + 1);
            self.slot.copy_within(i..len, i + 1);
        }
        let s = self.free_slot();
        self.values[usize::from(s)] = Some(value);
        self.slot[i] = s;
        self.lasts[i] = last;
        self.starts[i] = start;
        self.hots[i] = hot;
        self.len = len + 1;
        self.fix_tops(i, len + 1);
    }

    /// Drops every range and value, resetting only the slots that held one.
    fn clear(&mut self) {
        for (w, used) in self.used.iter_mut().enumerate() {
            while *used != 0 {
                let b = used.trailing_zeros() as usize;
                self.values[w * 64 + b] = None;
                *used &= *used - 1;
            }
        }
        let len = std::mem::take(&mut self.len);
        self.lasts[..len].fill(u64::MAX);
        self.starts[..len].fill(u64::MAX);
        self.hots[..len].fill(H::default());
        self.tops[..len.div_ceil(GROUP)].fill(u64::MAX);
    }

    /// Takes a free value slot; there is one, as fewer than [`CAP`] ranges are held.
    #[inline(always)]
    fn free_slot(&mut self) -> u8 {
        let w = self
            .used
            .iter()
            .position(|&u| u != u64::MAX)
            .expect("a free slot");
        let b = (!self.used[w]).trailing_zeros();
        self.used[w] |= 1 << b;
        (w * 64 + b as usize) as u8
    }

    /// Removes the range at slot `i` and returns its value.
    fn remove(&mut self, i: usize) -> V {
        let len = self.len;
        debug_assert!(i < len);
        let value = self.take_value(i);
        if len - i <= SHORT_MOVE {
            // As in `insert`: a few entries moved in one loop.
            for j in i + 1..len {
                self.slot[j - 1] = self.slot[j];
                self.lasts[j - 1] = self.lasts[j];
                self.starts[j - 1] = self.starts[j];
                self.hots[j - 1] = self.hots[j];
            }
        } else {
            self.slot.copy_within(i + 1..len, i);
            self.lasts.copy_within(i + 1..len, i);
            self.starts.copy_within(i + 1..len, i);
            self.hots.copy_within(i + 1..len, i);
        }
        self.lasts[len - 1] = u64::MAX;
        self.starts[len - 1] = u64::MAX;
        self.hots[len - 1] = H::default();
        self.len = len - 1;
        self.fix_tops(i, len);
        value
    }

    /// Removes the `n` ranges at slots `i..i + n` (their values dropped) in one move of the
    /// entries after them.
    fn remove_run(&mut self, i: usize, n: usize) {
        let len = self.len;
        debug_assert!(n > 0 && i + n <= len);
        for k in i..i + n {
            drop(self.take_value(k));
        }
        self.slot.copy_within(i + n..len, i);
        self.lasts.copy_within(i + n..len, i);
        self.starts.copy_within(i + n..len, i);
        self.hots.copy_within(i + n..len, i);
        self.lasts[len - n..len].fill(u64::MAX);
        self.starts[len - n..len].fill(u64::MAX);
        self.hots[len - n..len].fill(H::default());
        self.len = len - n;
        self.fix_tops(i, len);
    }

    /// Rewrites the tops of the groups of slots `[from, to)`, the ones an edit moved.
    fn fix_tops(&mut self, from: usize, to: usize) {
        for g in from / GROUP..to.div_ceil(GROUP) {
            self.tops[g] = self.lasts[g * GROUP + GROUP - 1];
        }
    }
}

/// Disjoint inclusive ranges with a hot value `H` and a value `V` each: [`Flat`] while they are
/// few, [`RangeMap`] when they are many (see the module documentation).
#[derive(Clone, Debug)]
pub struct Ranges<H, V> {
    repr: Repr<H, V>,
    /// An insert into a flat form holding this many makes it chunked; at half of it, a
    /// removal makes it flat again. [`CAP`] but in tests, which convert at a few entries.
    flat_max: usize,
}

/// The flat form is held by value, on purpose: a lookup reaches it with no pointer to follow,
/// and an index is made (a new space, a flush) with no allocation.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
enum Repr<H, V> {
    Flat(Flat<H, V>),
    Chunked(RangeMap<H, V>),
}

impl<H: Copy + Default, V: Clone> Default for Ranges<H, V> {
    fn default() -> Self {
        Ranges::with_flat_max(CAP)
    }
}

impl<H: Copy + Default, V: Clone> Ranges<H, V> {
    /// Empty, flat, converting at `flat_max` entries (1 to [`CAP`]).
    pub fn with_flat_max(flat_max: usize) -> Self {
        assert!((1..=CAP).contains(&flat_max), "flat_max {flat_max}");
        Ranges {
            repr: Repr::Flat(Flat::new()),
            flat_max,
        }
    }

    /// Drops every range: a flat form is emptied where it is, a chunked one replaced by an
    /// empty flat form.
    pub fn clear(&mut self) {
        match &mut self.repr {
            Repr::Flat(f) => f.clear(),
            Repr::Chunked(_) => self.repr = Repr::Flat(Flat::new()),
        }
    }

    /// Whether the flat form holds the ranges; if it does, checks its own invariants
    /// (padding, tops, value slots).
    #[cfg(test)]
    pub fn is_flat(&self) -> bool {
        let Repr::Flat(f) = &self.repr else {
            return false;
        };
        let mut slots: Vec<u8> = f.slot[..f.len].to_vec();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(slots.len(), f.len, "two ranges share a value slot");
        for s in 0..CAP {
            let used = f.used[s / 64] & 1 << (s % 64) != 0;
            assert_eq!(used, slots.contains(&(s as u8)), "slot {s} in use");
            assert_eq!(
                f.values[s].is_some(),
                used,
                "slot {s} holds a value iff in use"
            );
        }
        for i in f.len..CAP {
            assert_eq!((f.starts[i], f.lasts[i]), (u64::MAX, u64::MAX), "padding");
        }
        for g in 0..GROUPS {
            assert_eq!(
                f.tops[g],
                f.lasts[g * GROUP + GROUP - 1],
                "top of group {g}"
            );
        }
        true
    }

    pub fn len(&self) -> usize {
        match &self.repr {
            Repr::Flat(f) => f.len,
            Repr::Chunked(m) => m.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The position of the range holding `key`.
    #[inline]
    pub fn find(&self, key: u64) -> Option<Pos> {
        self.lookup(key).map(|(pos, ..)| pos)
    }

    /// The range holding `key`: its position, start, last and hot value (see
    /// [`RangeMap::lookup`]).
    #[inline(always)]
    pub fn lookup(&self, key: u64) -> Option<(Pos, u64, u64, H)> {
        match &self.repr {
            Repr::Flat(f) => f.lookup(key),
            Repr::Chunked(m) => m.lookup(key),
        }
    }

    /// The position of the first range that ends at or after `key`.
    #[inline]
    pub fn first_ending_at_or_after(&self, key: u64) -> Option<Pos> {
        match &self.repr {
            Repr::Flat(f) => f.first_ending_at_or_after(key),
            Repr::Chunked(m) => m.first_ending_at_or_after(key),
        }
    }

    /// The range at `pos`: start, last, hot value.
    #[inline]
    pub fn bounds(&self, pos: Pos) -> (u64, u64, H) {
        match &self.repr {
            Repr::Flat(f) => f.bounds(pos),
            Repr::Chunked(m) => m.bounds(pos),
        }
    }

    /// The range at `pos`: start, last, hot value, value.
    #[inline]
    pub fn get(&self, pos: Pos) -> (u64, u64, H, &V) {
        match &self.repr {
            Repr::Flat(f) => f.get(pos),
            Repr::Chunked(m) => m.get(pos),
        }
    }

    /// The position after `pos`, in address order.
    #[inline]
    pub fn next(&self, pos: Pos) -> Option<Pos> {
        match &self.repr {
            Repr::Flat(f) => f.next(pos),
            Repr::Chunked(m) => m.next(pos),
        }
    }

    /// All ranges in address order: start, last, hot value, value.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, H, &V)> {
        let (flat, chunked) = match &self.repr {
            Repr::Flat(f) => (Some(f), None),
            Repr::Chunked(m) => (None, Some(m)),
        };
        (flat.into_iter().flat_map(Flat::iter)).chain(chunked.into_iter().flat_map(RangeMap::iter))
    }

    /// Whether `[start, last]` overlaps no range: `Ok` with where it goes, to pass to
    /// [`Ranges::insert_at`], or `Err` with the first range it overlaps.
    pub fn place(&self, start: u64, last: u64) -> Result<Place, Pos> {
        match &self.repr {
            Repr::Flat(f) => f.place(start, last).map(Place).map_err(Pos::at),
            Repr::Chunked(m) => match m.first_ending_at_or_after(start) {
                Some(pos) if m.bounds(pos).0 <= last => Err(pos),
                _ => Ok(Place::UNKNOWN),
            },
        }
    }

    /// Adds `[start, last]`; the caller guarantees it overlaps nothing already there. `place`
    /// is what [`Ranges::place`] said for it on this map, or on one holding the same ranges (a
    /// copy the same changes were made to), and spares the search; any other place
    /// ([`Place::UNKNOWN`]) is checked against its neighbours and found again.
    pub fn insert_at(&mut self, place: Place, start: u64, last: u64, hot: H, value: V) {
        match &mut self.repr {
            Repr::Flat(f) if f.len < self.flat_max => f.insert(place.0, start, last, hot, value),
            Repr::Flat(f) => {
                // Full: the entries and the new one move, in order, into chunks half full,
                // built in one pass (inserted one by one, each would cost a chunk insert).
                let len = f.len;
                let i = f.starts[..len].partition_point(|&s| s < start);
                let mut all = Vec::with_capacity(len + 1);
                all.extend((0..i).map(|k| (f.starts[k], f.lasts[k], f.hots[k], f.take_value(k))));
                all.push((start, last, hot, value));
                all.extend((i..len).map(|k| (f.starts[k], f.lasts[k], f.hots[k], f.take_value(k))));
                self.repr = Repr::Chunked(RangeMap::from_sorted(all));
            }
            Repr::Chunked(m) => m.insert(start, last, hot, value),
        }
    }

    /// Removes the range at `pos` and returns its value.
    pub fn remove_at(&mut self, pos: Pos) -> V {
        match &mut self.repr {
            Repr::Flat(f) => f.remove(pos.index()),
            Repr::Chunked(m) => {
                let value = m.remove_at(pos);
                if m.len() <= self.flat_max / 2 {
                    // Few left: back to the flat form (its values counted again, the chunks'
                    // dropped with the map unless a snapshot shares them).
                    let mut flat = Flat::new();
                    for (i, (start, last, hot, v)) in m.iter().enumerate() {
                        flat.insert(i, start, last, hot, v.clone());
                    }
                    self.repr = Repr::Flat(flat);
                }
                value
            }
        }
    }

    /// In the flat form, the `n` ranges from the one starting at `first` on, as (their first
    /// slot, their starts, their lasts); `None` in the chunked form, or if no range starts at
    /// `first` or fewer than `n` follow it. For [`Ranges::remove_flat_run`].
    pub fn flat_run(&self, first: u64, n: usize) -> Option<(usize, &[u64], &[u64])> {
        let Repr::Flat(f) = &self.repr else {
            return None;
        };
        let (pos, start, ..) = f.lookup(first)?;
        let i = pos.index();
        (start == first && i + n <= f.len).then(|| (i, &f.starts[i..i + n], &f.lasts[i..i + n]))
    }

    /// Removes the `n` ranges at slots `i..i + n` of the flat form (as [`Ranges::flat_run`]
    /// found them) in one move, dropping their values: a flat form stays flat.
    pub fn remove_flat_run(&mut self, i: usize, n: usize) {
        match &mut self.repr {
            Repr::Flat(f) => f.remove_run(i, n),
            Repr::Chunked(_) => unreachable!("a run found in the flat form"),
        }
    }

    /// Replaces the hot value and value of the range at `pos`.
    pub fn set(&mut self, pos: Pos, hot: H, value: V) {
        match &mut self.repr {
            Repr::Flat(f) => {
                let i = pos.index();
                f.hots[i] = hot;
                f.values[usize::from(f.slot[i])] = Some(value);
            }
            Repr::Chunked(m) => m.set(pos, hot, value),
        }
    }

    /// See [`RangeMap::reindex`]; a flat form has no index to build.
    pub fn reindex(&mut self) {
        if let Repr::Chunked(m) = &mut self.repr {
            m.reindex();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// start -> (last, value); the hot value is always `start ^ 0x5a5a`.
    type Model = BTreeMap<u64, (u64, u32)>;

    /// Everything `map` answers against `model`: its ranges in order (by `iter` and by walking
    /// with `next`), and `find`, `lookup` and `first_ending_at_or_after` at every range's
    /// edges, middle and neighbours and at `probes`.
    fn check(map: &Ranges<u64, u32>, model: &Model, probes: &[u64]) {
        assert_eq!(map.len(), model.len());
        assert_eq!(map.is_empty(), model.is_empty());
        let expected: Vec<_> = model.iter().map(|(&s, &(l, v))| (s, l, v)).collect();
        let listed: Vec<_> = map.iter().map(|(s, l, _, &v)| (s, l, v)).collect();
        assert_eq!(listed, expected);
        let mut walked = Vec::new();
        let mut pos = map.first_ending_at_or_after(0);
        while let Some(p) = pos {
            let (s, l, h, &v) = map.get(p);
            assert_eq!(map.bounds(p), (s, l, h));
            walked.push((s, l, v));
            pos = map.next(p);
        }
        assert_eq!(walked, expected);
        let mut keys = probes.to_vec();
        for (&s, &(l, _)) in model {
            keys.extend([s, l, s + (l - s) / 2, s.wrapping_sub(1), l.wrapping_add(1)]);
        }
        for key in keys {
            let holder = model
                .range(..=key)
                .next_back()
                .filter(|(_, (l, _))| *l >= key)
                .map(|(&s, &(l, v))| (s, l, v));
            let found = map.lookup(key).map(|(p, s, l, h)| {
                assert_eq!(h, s ^ 0x5a5a, "hot value follows its range");
                assert_eq!(map.bounds(p), (s, l, h));
                (s, l, *map.get(p).3)
            });
            assert_eq!(found, holder, "lookup({key:#x})");
            assert_eq!(map.find(key).map(|p| map.get(p).0), holder.map(|h| h.0));
            let first_end = holder.or_else(|| {
                let (&s, &(l, v)) = model.range(key.checked_add(1)?..).next()?;
                Some((s, l, v))
            });
            let got = map.first_ending_at_or_after(key).map(|p| {
                let (s, l, _, &v) = map.get(p);
                (s, l, v)
            });
            assert_eq!(got, first_end, "first_ending_at_or_after({key:#x})");
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Insert a range of `width + 1` keys at `slot * 8` if it overlaps nothing.
        Insert { slot: u64, width: u64 },
        /// Insert ranges of one key at `n` consecutive slots from `slot`, where free.
        Run { slot: u64, n: u64 },
        /// Remove the range starting at (or after) `slot * 8`.
        Remove { slot: u64 },
        /// Remove `n` ranges from the one at (or after) `slot * 8`.
        RemoveRun { slot: u64, n: usize },
        /// Give the range at (or after) `slot * 8` a new value.
        Set { slot: u64 },
        /// Keep a clone; later checks verify it did not change.
        Snapshot,
        /// Drop every range.
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        let slot = 0u64..400;
        prop_oneof![
            6 => (slot.clone(), 0u64..8).prop_map(|(slot, width)| Op::Insert { slot, width }),
            1 => (slot.clone(), 1u64..160).prop_map(|(slot, n)| Op::Run { slot, n }),
            5 => slot.clone().prop_map(|slot| Op::Remove { slot }),
            1 => (slot.clone(), 1usize..80).prop_map(|(slot, n)| Op::RemoveRun { slot, n }),
            1 => slot.prop_map(|slot| Op::Set { slot }),
            1 => Just(Op::Snapshot),
            1 => Just(Op::Clear),
        ]
    }

    /// The form `map` must have: flat until an insert finds `flat_max` entries, chunked until
    /// a removal leaves `flat_max / 2` or fewer.
    struct Form {
        flat: bool,
        flat_max: usize,
        conversions: [u32; 2],
    }

    impl Form {
        fn inserted(&mut self, len_before: usize) {
            if self.flat && len_before == self.flat_max {
                self.flat = false;
                self.conversions[0] += 1;
            }
        }
        fn removed(&mut self, len_after: usize) {
            if !self.flat && len_after <= self.flat_max / 2 {
                self.flat = true;
                self.conversions[1] += 1;
            }
        }
    }

    /// Inserts `[s, l]` if it overlaps nothing, at the place `place` found or, for a third of
    /// the keys, at a wrong one (which the insert must find out and search past); checks what
    /// `place` says against the model.
    fn insert(map: &mut Ranges<u64, u32>, model: &mut Model, form: &mut Form, s: u64, l: u64) {
        let overlapped = (model.iter())
            .find(|(_, (e, _))| *e >= s)
            .filter(|(start, _)| **start <= l)
            .map(|(&start, _)| start);
        match map.place(s, l) {
            Err(pos) => assert_eq!(Some(map.bounds(pos).0), overlapped, "place({s}, {l})"),
            Ok(place) => {
                assert_eq!(overlapped, None, "place({s}, {l})");
                let place = match s % 3 {
                    0 => Place((s as usize / 8) % (CAP + 2)),
                    _ => place,
                };
                let v = (model.len() as u32 * 7).wrapping_add(s as u32);
                form.inserted(map.len());
                map.insert_at(place, s, l, s ^ 0x5a5a, v);
                model.insert(s, (l, v));
            }
        }
    }

    fn remove(map: &mut Ranges<u64, u32>, model: &mut Model, form: &mut Form, s: u64) {
        let pos = map.find(s).expect("a range of the map");
        assert_eq!(map.bounds(pos).0, s);
        assert_eq!(Some(map.remove_at(pos)), model.remove(&s).map(|(_, v)| v));
        form.removed(map.len());
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
        /// Both forms, and the conversions between them both ways, against a model; the form
        /// follows the thresholds, and clones taken on the way do not change.
        #[test]
        fn both_forms_and_their_conversions_answer_as_a_btree_map(
            ops in proptest::collection::vec(op(), 1..80),
            flat_max in prop_oneof![Just(1usize), Just(2), Just(5), Just(8), Just(9), Just(40), Just(70), Just(CAP)],
        ) {
            let mut map = Ranges::with_flat_max(flat_max);
            let mut model = Model::new();
            let mut form = Form { flat: true, flat_max, conversions: [0; 2] };
            let mut held = Vec::new();
            for op in ops {
                match op {
                    Op::Insert { slot, width } => {
                        insert(&mut map, &mut model, &mut form, slot * 8, slot * 8 + width);
                    }
                    Op::Run { slot, n } => {
                        for k in 0..n {
                            let s = (slot + k) * 8;
                            insert(&mut map, &mut model, &mut form, s, s);
                        }
                    }
                    Op::Remove { slot } => {
                        if let Some(&s) = model.range(slot * 8..).next().map(|(s, _)| s) {
                            remove(&mut map, &mut model, &mut form, s);
                        }
                        prop_assert!(map.find(slot * 8 + 1).is_none_or(|p| map.bounds(p).0 != slot * 8 + 1));
                    }
                    Op::RemoveRun { slot, n } => {
                        let starts: Vec<u64> = model.range(slot * 8..).take(n).map(|(&s, _)| s).collect();
                        for s in starts {
                            remove(&mut map, &mut model, &mut form, s);
                        }
                    }
                    Op::Set { slot } => {
                        if let Some((&s, &(l, v))) = model.range(slot * 8..).next() {
                            let pos = map.find(s).expect("a range of the map");
                            map.set(pos, s ^ 0x5a5a, v + 1_000_000);
                            model.insert(s, (l, v + 1_000_000));
                        }
                    }
                    Op::Snapshot => held.push((map.clone(), model.clone())),
                    Op::Clear => {
                        map.clear();
                        model.clear();
                        form.flat = true;
                    }
                }
                map.reindex();
                prop_assert_eq!(map.is_flat(), form.flat, "form after {} entries", map.len());
                check(&map, &model, &[0, u64::MAX]);
            }
            for (snap, model) in &held {
                check(snap, model, &[]);
            }
        }
    }

    /// A full flat form, and ranges at the very top of the space (`u64::MAX` is also what
    /// unused slots hold), in both forms.
    #[test]
    fn a_full_flat_form_and_ranges_at_the_top_of_the_space() {
        for flat_max in [CAP, 4] {
            let mut map = Ranges::with_flat_max(flat_max);
            let mut model = Model::new();
            let mut form = Form {
                flat: true,
                flat_max,
                conversions: [0; 2],
            };
            insert(&mut map, &mut model, &mut form, u64::MAX - 9, u64::MAX);
            insert(&mut map, &mut model, &mut form, 0, 0);
            check(&map, &model, &[1, u64::MAX, u64::MAX - 10]);
            for k in 1..CAP as u64 - 2 {
                insert(&mut map, &mut model, &mut form, k * 16, k * 16 + 3);
                check(&map, &model, &[u64::MAX]);
            }
            assert_eq!(map.len(), CAP - 1);
            insert(
                &mut map,
                &mut model,
                &mut form,
                u64::MAX - 20,
                u64::MAX - 11,
            );
            assert_eq!(map.is_flat(), flat_max == CAP);
            check(&map, &model, &[u64::MAX, u64::MAX - 10]);
            remove(&mut map, &mut model, &mut form, u64::MAX - 9);
            check(&map, &model, &[u64::MAX, u64::MAX - 9]);
            while let Some(&s) = model.keys().next() {
                remove(&mut map, &mut model, &mut form, s);
                check(&map, &model, &[u64::MAX]);
            }
            assert!(map.is_flat());
            assert_eq!(form.conversions, [u32::from(flat_max < CAP); 2]);
        }
    }
}
