//! A persistent map of disjoint `u64` ranges, cheap to copy and change, quick to search.
//!
//! Readers of memvisor's tables hold immutable snapshots; a writer publishes a changed copy. For a
//! handful of ranges a sorted array copied on every change is fine, but an IOMMU address space
//! can hold 100 000 mappings that a guest changes one 4 KiB page at a time, and copying all of
//! them per change is not. [`RangeMap`] is a B-tree-like array: ranges sorted into chunks of at
//! most [`MAX_CHUNK`] entries, each chunk behind an `Arc`, the chunk pointers in pieces of
//! [`PIECE`] behind an `Arc` each. Changing the map copies (`Arc::make_mut`) only what it
//! touches: the list of pieces, one piece, one chunk's bounds, and one group of the chunk's
//! values (values sit in slots, 16 to an `Arc`'d group, so a chunk copy copies 16 group
//! pointers, not 256 values). Splitting a chunk that grows too big, or dropping one that
//! becomes empty, rebuilds the pieces after it. What makes a copy dear is not the bytes but the
//! reference counts: each pointer copied is an atomic increment now, and a decrement when the
//! old snapshot goes, each on a line of its own. At 100 000 ranges (391 chunks) a change
//! copies 13 + 32 + 16 + 16 pointers, where one flat array of chunks holding their values
//! inline copied 391 + 256.
//!
//! Each entry has a small `Copy` "hot" value kept inline next to its bounds, and a cold value of
//! any type kept apart; a lookup reads only bounds and the hot value. The layout is built for a
//! lookup that misses every cache: a chunk stores its bounds in fixed arrays right behind the
//! chunk pointer — the ends (`lasts`), and (start, hot value) pairs — in groups of [`GROUP`]
//! entries, one 64-byte line of ends per group, plus `tops`, the end of each group's last entry.
//! A lookup finds the chunk through a bucket table over the chunks' first keys (one 16-byte
//! entry per bucket says which chunk holds the bucket's lowest key and where the next one
//! starts, if it starts there; a binary search when keys are too skewed for buckets), picks a
//! group with a few compares on `tops`, then counts that group's ends and starts below the key,
//! reading its line of ends and its two lines of pairs at once. So the only dependent steps
//! that can miss the cache are the bucket, the piece and chunk pointers, the chunk's `tops`
//! and the group's lines. Unused slots hold `u64::MAX` ends and starts. The bucket table is rebuilt by
//! [`RangeMap::reindex`] after changes that move a chunk's first key (rare: splits, emptied
//! chunks, a new first range); until then lookups binary-search. Small maps skip steps: one
//! chunk needs no chunk search, at most 64 ranges use one line of `tops`, at most 8 one group.
//!
//! The counts are written so that they compile to compare/add-with-carry chains on baseline
//! x86_64 (see [`below`]); nothing here needs SSE4.2 or POPCNT.
//!
//! The map does not check for overlap: its owner validates a change before making it.
//!
//! This file is long because its unit and property tests, a third of it, check the structure's
//! private layout (chunks, groups, tops, buckets) and so sit beside it.

use std::sync::Arc;

/// Most entries in a chunk; a chunk that would grow past it is split.
pub const MAX_CHUNK: usize = 256;
/// Entries per group: one cache line of `u64` ends.
pub const GROUP: usize = 8;
const GROUPS: usize = MAX_CHUNK / GROUP;
/// Value slots per value group (see [`Head`]).
const VALUE_GROUP: usize = 16;
const VALUE_GROUPS: usize = MAX_CHUNK / VALUE_GROUP;
/// Chunk pointers per piece (see [`RangeMap`]).
const PIECE: usize = 32;

/// Where an entry lives: chunk and position in it. Valid only for the map it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pos {
    chunk: u32,
    index: u32,
}

impl Pos {
    /// The first position; a placeholder that is only valid in a non-empty map.
    pub const FIRST: Pos = Pos { chunk: 0, index: 0 };

    /// Entry `index` of a map of one array (`flat`).
    #[inline(always)]
    pub fn at(index: usize) -> Pos {
        Pos {
            chunk: 0,
            index: index as u32,
        }
    }

    /// The entry's place in its chunk (or flat array).
    #[inline(always)]
    pub fn index(self) -> usize {
        self.index as usize
    }
}

/// An entry's start and hot value, side by side: the lines a lookup reads last.
#[derive(Clone, Copy, Debug)]
struct Item<H> {
    start: u64,
    hot: H,
}

/// Up to [`MAX_CHUNK`] entries in order, in slots `0..len`; the arrays are inline so the chunk
/// pointer leads straight to them. Aligned so that every group's ends and (for 8-byte hot values)
/// pairs start a cache line.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
struct Chunk<H, V> {
    /// `tops[g]` = `lasts[g * GROUP + GROUP - 1]`.
    tops: [u64; GROUPS],
    /// What a lookup does not read, on a line of its own.
    head: Head<V>,
    lasts: [u64; MAX_CHUNK],
    items: [Item<H>; MAX_CHUNK],
}

/// A chunk's values sit in slots, [`VALUE_GROUP`] to a group behind an `Arc`, in no order;
/// `slot[i]` names the slot of the chunk's `i`th range. Copying a chunk then copies 16 group
/// pointers, not one value per range, and changing one value copies only its group.
#[derive(Clone, Debug)]
#[repr(C, align(64))]
struct Head<V> {
    len: usize,
    /// Bit `b` of `used[g]`: slot `g * VALUE_GROUP + b` holds a value.
    used: [u16; VALUE_GROUPS],
    /// Groups with no slot in use are `None`.
    groups: [Option<Arc<ValueGroup<V>>>; VALUE_GROUPS],
    slot: [u8; MAX_CHUNK],
}

type ValueGroup<V> = [Option<V>; VALUE_GROUP];

/// Up to [`PIECE`] chunk pointers (see [`RangeMap`]).
type Piece<H, V> = Arc<[Arc<Chunk<H, V>>]>;

impl<V: Clone> Head<V> {
    fn new() -> Self {
        Head {
            len: 0,
            used: [0; VALUE_GROUPS],
            groups: std::array::from_fn(|_| None),
            slot: [0; MAX_CHUNK],
        }
    }

    /// The value of the chunk's `i`th range.
    #[inline]
    fn value(&self, i: usize) -> &V {
        let s = usize::from(self.slot[i]);
        self.groups[s / VALUE_GROUP]
            .as_ref()
            .and_then(|g| g[s % VALUE_GROUP].as_ref())
            .expect("a range's slot holds its value")
    }

    /// Puts `value` in a free slot and returns it. The chunk has a free slot: it holds fewer
    /// than `MAX_CHUNK` values.
    fn take_slot(&mut self, value: V) -> u8 {
        let g = self
            .used
            .iter()
            .position(|&u| u != u16::MAX)
            .expect("a chunk with room has a free slot");
        let b = (!self.used[g]).trailing_zeros() as usize;
        self.used[g] |= 1 << b;
        let group = self.groups[g].get_or_insert_with(|| Arc::new(std::array::from_fn(|_| None)));
        Arc::make_mut(group)[b] = Some(value);
        (g * VALUE_GROUP + b) as u8
    }

    /// Empties slot `s` and returns its value.
    fn free_slot(&mut self, s: u8) -> V {
        let (g, b) = (usize::from(s) / VALUE_GROUP, usize::from(s) % VALUE_GROUP);
        self.used[g] &= !(1 << b);
        let group = self.groups[g].as_mut().expect("a used slot's group");
        if self.used[g] == 0 {
            // The group's last value: drop this chunk's hold on the group instead of copying
            // it (a shared group stays whole for the snapshots that still hold it).
            let value = group[b].clone().expect("a used slot holds a value");
            self.groups[g] = None;
            return value;
        }
        Arc::make_mut(group)[b]
            .take()
            .expect("a used slot holds a value")
    }

    /// Replaces the value of the chunk's `i`th range.
    fn set(&mut self, i: usize, value: V) {
        let s = usize::from(self.slot[i]);
        let group = self.groups[s / VALUE_GROUP]
            .as_mut()
            .expect("a range's slot's group");
        Arc::make_mut(group)[s % VALUE_GROUP] = Some(value);
    }
}

/// How many of a group's 8 sorted `keys` are below `key`.
///
/// Counted as 8 minus the keys at or above it, on purpose: LLVM vectorizes a plain sum of
/// `k < key` into eight scalar compares packed into a vector and a software popcount when the
/// target lacks SSE4.2's 64-bit compare (as the x86_64 baseline does), several times the
/// latency; this form stays a chain of compare and add-with-carry. (Checked on the `find`
/// machine code; `cfg!(target_feature = "sse4.2")` builds get vector compares either way.)
#[inline(always)]
pub fn below(keys: &[u64; GROUP], key: u64) -> usize {
    GROUP - keys.iter().map(|&k| usize::from(k >= key)).sum::<usize>()
}

/// How many of a group's 8 sorted `keys` are at or below `key`.
#[inline(always)]
pub fn at_or_below(keys: &[u64; GROUP], key: u64) -> usize {
    GROUP - keys.iter().map(|&k| usize::from(k > key)).sum::<usize>()
}

impl<H: Copy + Default, V: Clone> Chunk<H, V> {
    fn new() -> Self {
        Chunk {
            tops: [u64::MAX; GROUPS],
            lasts: [u64::MAX; MAX_CHUNK],
            items: [Item {
                start: u64::MAX,
                hot: H::default(),
            }; MAX_CHUNK],
            head: Head::new(),
        }
    }

    /// The group holding the first range that ends at or after `key`; `GROUPS` if none. Three
    /// compares on the top of every 8th group pick a line of `tops` (their loads overlap), then
    /// its 8 entries are counted.
    #[inline(always)]
    fn group(&self, key: u64) -> usize {
        let t = &self.tops;
        let q = usize::from(t[7] < key) + usize::from(t[15] < key) + usize::from(t[23] < key);
        self.group_in(q, key)
    }

    /// [`Chunk::group`] when it is known to be in the `q`th line of `tops`: at most
    /// `GROUP * GROUP` entries (so groups from 8 on are empty) and `q` = 0, say.
    #[inline(always)]
    fn group_in(&self, q: usize, key: u64) -> usize {
        let line: &[u64; GROUP] = self.tops[q * GROUP..][..GROUP].try_into().expect("8 tops");
        q * GROUP + below(line, key)
    }

    /// The group's ends and its pairs' starts.
    #[inline(always)]
    fn group_keys(&self, g: usize) -> ([u64; GROUP], [u64; GROUP]) {
        let base = g * GROUP;
        let lasts: [u64; GROUP] = self.lasts[base..][..GROUP].try_into().expect("8 ends");
        let items = &self.items[base..][..GROUP];
        (lasts, std::array::from_fn(|i| items[i].start))
    }

    /// The first slot whose range ends at or after `key`; `len` if none.
    #[inline]
    fn first_ending_at_or_after(&self, key: u64) -> usize {
        let g = self.group(key);
        if g == GROUPS {
            return self.head.len;
        }
        // Unused slots end at u64::MAX and never count: the result is at most `len`.
        g * GROUP + below(&self.group_keys(g).0, key)
    }

    /// The slot whose range holds `key`, if any, looking in group `g` only: the group holding
    /// the first range that ends at or after `key` ([`Chunk::group`]), or 0 when the chunk has
    /// at most [`GROUP`] entries.
    #[inline(always)]
    fn find_in(&self, g: usize, key: u64) -> Option<usize> {
        if g == GROUPS {
            return None;
        }
        // The first range of the group ending at or after `key` holds it iff it starts at or
        // before `key`, i.e. iff more of the group's (sorted) starts are <= key than ends are
        // below it. Counting every start reads the group's pairs while its ends are still
        // loading, instead of reading one pair after the ends arrive.
        let (lasts, starts) = self.group_keys(g);
        let j = below(&lasts, key);
        let s = at_or_below(&starts, key);
        let i = g * GROUP + j;
        // Unused slots start (and end) at u64::MAX, so for that key alone the count can point
        // at one: check `len` then (only then, it is on another line).
        (j < s && (key != u64::MAX || i < self.head.len)).then_some(i)
    }

    fn insert(&mut self, i: usize, start: u64, last: u64, hot: H, value: V) {
        let len = self.head.len;
        debug_assert!(len < MAX_CHUNK && i <= len);
        self.lasts.copy_within(i..len, i + 1);
        self.items.copy_within(i..len, i + 1);
        self.head.slot.copy_within(i..len, i + 1);
        self.lasts[i] = last;
        self.items[i] = Item { start, hot };
        self.head.slot[i] = self.head.take_slot(value);
        self.head.len += 1;
        self.fix_tops_in(i, len + 1);
    }

    fn remove(&mut self, i: usize) -> V {
        let len = self.head.len;
        let value = self.head.free_slot(self.head.slot[i]);
        self.lasts.copy_within(i + 1..len, i);
        self.items.copy_within(i + 1..len, i);
        self.head.slot.copy_within(i + 1..len, i);
        self.clear(len - 1..len);
        self.head.len -= 1;
        self.fix_tops_in(i, len);
        value
    }

    /// Moves slots `at..` into a new chunk.
    fn split_off(&mut self, at: usize) -> Self {
        let mut upper = Chunk::new();
        let n = self.head.len - at;
        upper.lasts[..n].copy_from_slice(&self.lasts[at..self.head.len]);
        upper.items[..n].copy_from_slice(&self.items[at..self.head.len]);
        for k in 0..n {
            let value = self.head.free_slot(self.head.slot[at + k]);
            upper.head.slot[k] = upper.head.take_slot(value);
        }
        upper.head.len = n;
        upper.fix_tops();
        self.clear(at..self.head.len);
        self.head.len = at;
        self.fix_tops();
        upper
    }

    /// Marks the slots `range` unused (slots past `len` already are).
    fn clear(&mut self, range: std::ops::Range<usize>) {
        self.lasts[range.clone()].fill(u64::MAX);
        self.items[range].fill(Item {
            start: u64::MAX,
            hot: H::default(),
        });
    }

    fn fix_tops(&mut self) {
        self.fix_tops_in(0, MAX_CHUNK);
    }

    /// [`Chunk::fix_tops`] for the groups of slots `[from, to)` only, the slots an insert or a
    /// removal moved (`from < to`): the other groups' tops stand. An IOTLB's chunk holds a few
    /// dozen entries: rewriting all 32 tops was a good part of each edit.
    fn fix_tops_in(&mut self, from: usize, to: usize) {
        for g in from / GROUP..to.div_ceil(GROUP).min(GROUPS) {
            self.tops[g] = self.lasts[g * GROUP + GROUP - 1];
        }
    }
}

/// Disjoint inclusive ranges `[start, last]`, each with a hot value `H` (read by every lookup,
/// kept inline; small and `Copy`) and a value `V` (kept apart).
#[derive(Debug)]
pub struct RangeMap<H, V> {
    /// `firsts[c]` is the start of chunk `c`'s first range; one per chunk.
    firsts: Vec<u64>,
    /// The chunk pointers, [`PIECE`] to a piece behind an `Arc` (the last piece may hold
    /// fewer): copying the map copies a pointer per piece, and changing a chunk copies only
    /// its piece. Chunk `c` is `pieces[c / PIECE][c % PIECE]`.
    pieces: Vec<Piece<H, V>>,
    len: usize,
    /// A shortcut into `firsts`, valid for the `firsts` it was built from: every change to
    /// `firsts` drops it, [`RangeMap::reindex`] builds it again.
    top: Option<TopIndex>,
    /// The chunk of the last range removed, emptied, kept for the next insert into the empty
    /// map; not part of the map (no piece points to it). An IOTLB of a guest in strict mode
    /// empties and refills often, and a new chunk is 6.8 KiB to allocate (64-byte aligned) and
    /// fill. Only kept when the map owned it alone; never cloned.
    empty: Option<Arc<Chunk<H, V>>>,
}

impl<H: Clone, V: Clone> Clone for RangeMap<H, V> {
    fn clone(&self) -> Self {
        RangeMap {
            firsts: self.firsts.clone(),
            pieces: self.pieces.clone(),
            len: self.len,
            top: self.top.clone(),
            empty: None,
        }
    }
}

/// Buckets over the range of chunk first keys, so that finding a key's chunk is one load (plus
/// the chunk pointer) instead of a binary search's chain of dependent loads. Bucket `b` covers
/// keys from `base + (b << shift)`; the last bucket also takes every key above. Each bucket
/// says which chunk holds its lowest key and the first key of the chunk starting in it, if
/// one does: with keys spread over their range (buckets outnumber chunks two to one) that is
/// all a lookup needs. Buckets where two or more chunks start fall back to a binary search
/// over the chunks' first keys.
#[derive(Clone, Debug)]
struct TopIndex {
    base: u64,
    shift: u32,
    buckets: Arc<[Bucket]>,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    /// The first key of chunk `chunk + 1` if that chunk starts in this bucket; unused (and
    /// `u64::MAX`) when none does.
    split: u64,
    /// The chunk holding the bucket's lowest key: the last one starting at or below it.
    chunk: u32,
    /// How many chunks start in the bucket past its lowest key.
    starts: u32,
}

impl TopIndex {
    /// Fewer chunks than this are searched directly.
    const MIN_CHUNKS: usize = 8;

    fn build(firsts: &[u64]) -> Option<TopIndex> {
        let n = firsts.len();
        if n < TopIndex::MIN_CHUNKS || u32::try_from(n).is_err() {
            return None;
        }
        let base = firsts[0];
        let span = firsts[n - 1] - base;
        let count = (2 * n).next_power_of_two();
        let log = count.trailing_zeros();
        // The smallest shift that puts the last chunk's first key in bucket `count - 1` or
        // below; `b << shift` never overflows since `b < 2^log` and `shift <= 64 - log`.
        let shift = (u64::BITS - span.leading_zeros()).saturating_sub(log);
        // `upto[b]`: how many chunks start at or below bucket b's lowest key.
        let low = |b: u64| base.saturating_add(b << shift);
        let mut upto = Vec::with_capacity(count + 1);
        let mut c = 0;
        for b in 0..count as u64 {
            while c < n && firsts[c] <= low(b) {
                c += 1;
            }
            upto.push(c);
        }
        upto.push(n);
        let buckets = upto
            .windows(2)
            .map(|w| {
                let (lo, hi) = (w[0], w[1]);
                Bucket {
                    // lo >= 1: firsts[0] = base is the lowest key of bucket 0.
                    split: if hi > lo { firsts[lo] } else { u64::MAX },
                    chunk: (lo - 1) as u32,
                    starts: (hi - lo) as u32,
                }
            })
            .collect();
        Some(TopIndex {
            base,
            shift,
            buckets,
        })
    }

    /// The chunk whose first key is the last one at or before `key`.
    #[inline(always)]
    fn chunk_for(&self, firsts: &[u64], key: u64) -> Option<usize> {
        let off = key.checked_sub(self.base)?;
        let last = self.buckets.len() - 1;
        let b = usize::try_from(off >> self.shift).map_or(last, |b| b.min(last));
        let bucket = self.buckets[b];
        let c = bucket.chunk as usize;
        if bucket.starts > 1 {
            // Keys bunched together: search the chunks starting in this bucket.
            let after = &firsts[c + 1..=c + bucket.starts as usize];
            return Some(c + after.partition_point(|&f| f <= key));
        }
        // Without a branch on whether a chunk starts here: that is a coin toss for random keys.
        Some(c + (usize::from(bucket.starts != 0) & usize::from(key >= bucket.split)))
    }
}

impl<H, V> Default for RangeMap<H, V> {
    fn default() -> Self {
        RangeMap {
            firsts: Vec::new(),
            pieces: Vec::new(),
            len: 0,
            top: None,
            empty: None,
        }
    }
}

impl<H: Copy + Default, V: Clone> RangeMap<H, V> {
    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many chunks there are.
    #[inline(always)]
    fn chunk_count(&self) -> usize {
        self.firsts.len()
    }

    /// Chunk `c`, if there is one.
    #[inline(always)]
    fn chunk(&self, c: usize) -> Option<&Chunk<H, V>> {
        self.pieces.get(c / PIECE)?.get(c % PIECE).map(|c| &**c)
    }

    /// Chunk `c` to change: its piece and itself are copied first if shared.
    fn chunk_mut(&mut self, c: usize) -> &mut Chunk<H, V> {
        let piece = Arc::make_mut(&mut self.pieces[c / PIECE]);
        Arc::make_mut(&mut piece[c % PIECE])
    }

    /// Every chunk, in order.
    fn chunks(&self) -> impl Iterator<Item = &Chunk<H, V>> {
        self.pieces.iter().flat_map(|p| p.iter().map(|c| &**c))
    }

    /// Changes the list of chunks with `edit`, which sees chunks `c / PIECE * PIECE ..` as a
    /// vector starting with chunk `c` at index `c % PIECE`; the pieces from `c`'s on are
    /// built again. For splits and emptied chunks only: it copies every chunk pointer after
    /// `c`'s piece.
    fn edit_chunks(&mut self, c: usize, edit: impl FnOnce(&mut Vec<Arc<Chunk<H, V>>>)) {
        let p = c / PIECE;
        let mut tail: Vec<Arc<Chunk<H, V>>> = self.pieces[p.min(self.pieces.len())..]
            .iter()
            .flat_map(|piece| piece.iter().cloned())
            .collect();
        self.pieces.truncate(p);
        edit(&mut tail);
        self.pieces.extend(tail.chunks(PIECE).map(Arc::from));
        self.top = None;
    }

    /// The chunk whose first key is the last one at or before `key`.
    #[inline]
    fn chunk_for(&self, key: u64) -> Option<usize> {
        match &self.top {
            Some(top) => top.chunk_for(&self.firsts, key),
            // No index: too few chunks for one (count their first keys at or below `key`, which
            // a miss-heavy stream does not mispredict), or a writer's map before `reindex`.
            None if self.firsts.len() < TopIndex::MIN_CHUNKS => {
                let n = self
                    .firsts
                    .iter()
                    .map(|&f| usize::from(f <= key))
                    .sum::<usize>();
                n.checked_sub(1)
            }
            None => self.firsts.partition_point(|&f| f <= key).checked_sub(1),
        }
    }

    /// Builds the index over the chunks' first keys if a change dropped it. Lookups are right
    /// without it, only slower: call it once after a batch of changes, before publishing.
    pub fn reindex(&mut self) {
        if self.top.is_none() {
            self.top = TopIndex::build(&self.firsts);
        }
    }

    /// Sets the first key of chunk `c` after a change to it, dropping the index if it moved.
    fn refirst(&mut self, c: usize) {
        let first = self.chunk(c).expect("chunk c").items[0].start;
        if self.firsts[c] != first {
            self.firsts[c] = first;
            self.top = None;
        }
    }

    /// The position of the range holding `key`.
    #[cfg(test)]
    pub fn find(&self, key: u64) -> Option<Pos> {
        self.lookup(key).map(|(pos, ..)| pos)
    }

    /// The range holding `key`: its position, start, last and hot value. The lookup behind
    /// every translation, so written to be inlined: with one chunk it skips the chunk search;
    /// with at most `GROUP * GROUP` ranges in all (every chunk then has at most that many, so
    /// only the first line of `tops` is in use) it counts that line only, and with at most
    /// [`GROUP`] it skips the group search.
    #[inline(always)]
    pub fn lookup(&self, key: u64) -> Option<(Pos, u64, u64, H)> {
        let c = if self.chunk_count() > 1 {
            self.chunk_for(key)?
        } else {
            0
        };
        let chunk = self.chunk(c)?;
        let g = if self.len <= GROUP {
            0
        } else if self.len <= GROUP * GROUP {
            chunk.group_in(0, key)
        } else {
            chunk.group(key)
        };
        let i = chunk.find_in(g, key)?;
        let item = chunk.items[i];
        let pos = Pos {
            chunk: c as u32,
            index: i as u32,
        };
        Some((pos, item.start, chunk.lasts[i], item.hot))
    }

    /// The position of the first range that ends at or after `key`.
    pub fn first_ending_at_or_after(&self, key: u64) -> Option<Pos> {
        let c = self.chunk_for(key).unwrap_or(0);
        let chunk = self.chunk(c)?;
        let i = chunk.first_ending_at_or_after(key);
        if i < chunk.head.len {
            Some(Pos {
                chunk: c as u32,
                index: i as u32,
            })
        } else {
            // Every range of this chunk ends before `key`: the next chunk's first is the one.
            (c + 1 < self.chunk_count()).then_some(Pos {
                chunk: c as u32 + 1,
                index: 0,
            })
        }
    }

    /// The range at `pos`: start, last, hot value (not the value: a lookup reads only these).
    #[inline]
    pub fn bounds(&self, pos: Pos) -> (u64, u64, H) {
        let chunk = self
            .chunk(pos.chunk as usize)
            .expect("a position in this map");
        let i = pos.index as usize;
        let item = chunk.items[i];
        (item.start, chunk.lasts[i], item.hot)
    }

    /// The range at `pos`: start, last, hot value, value.
    #[inline]
    pub fn get(&self, pos: Pos) -> (u64, u64, H, &V) {
        let chunk = self
            .chunk(pos.chunk as usize)
            .expect("a position in this map");
        let i = pos.index as usize;
        let item = chunk.items[i];
        (item.start, chunk.lasts[i], item.hot, chunk.head.value(i))
    }

    /// The position after `pos`, in address order.
    #[inline]
    pub fn next(&self, pos: Pos) -> Option<Pos> {
        let chunk = self.chunk(pos.chunk as usize)?;
        if (pos.index as usize) + 1 < chunk.head.len {
            Some(Pos {
                chunk: pos.chunk,
                index: pos.index + 1,
            })
        } else {
            ((pos.chunk as usize) + 1 < self.chunk_count()).then_some(Pos {
                chunk: pos.chunk + 1,
                index: 0,
            })
        }
    }

    /// All ranges in address order: start, last, hot value, value.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, H, &V)> {
        self.chunks().flat_map(|c| {
            (0..c.head.len).map(move |i| {
                (
                    c.items[i].start,
                    c.lasts[i],
                    c.items[i].hot,
                    c.head.value(i),
                )
            })
        })
    }

    /// A map of `ranges`, sorted and disjoint (start, last, hot value, value), built in one
    /// pass into chunks half full, as splits leave them, so that the inserts that follow do
    /// not split at once; each chunk's values fill its value groups in order, each group made
    /// whole and shared once. For a flat index converting: one insert per range would cost a
    /// chunk insert each, and the first insert into the middle of a full chunk a split.
    pub fn from_sorted(ranges: impl IntoIterator<Item = (u64, u64, H, V)>) -> Self {
        const FILL: usize = MAX_CHUNK / 2;
        let mut chunks: Vec<Arc<Chunk<H, V>>> = Vec::new();
        let mut chunk: Option<Chunk<H, V>> = None;
        let mut group: ValueGroup<V> = std::array::from_fn(|_| None);
        let mut after = None;
        let mut len = 0;
        for (start, last, hot, value) in ranges {
            debug_assert!(
                start <= last && after.is_none_or(|a| start > a),
                "sorted, disjoint"
            );
            after = Some(last);
            if chunk.as_ref().is_some_and(|c| c.head.len == FILL) {
                chunks.push(Arc::new(chunk.take().expect("a filled chunk")));
            }
            let c = chunk.get_or_insert_with(Chunk::new);
            let i = c.head.len;
            c.lasts[i] = last;
            c.items[i] = Item { start, hot };
            c.head.slot[i] = i as u8;
            c.head.used[i / VALUE_GROUP] |= 1 << (i % VALUE_GROUP);
            group[i % VALUE_GROUP] = Some(value);
            c.head.len = i + 1;
            if (i + 1) % VALUE_GROUP == 0 {
                c.head.groups[i / VALUE_GROUP] = Some(Arc::new(std::mem::replace(
                    &mut group,
                    std::array::from_fn(|_| None),
                )));
            }
            len += 1;
        }
        if let Some(mut c) = chunk {
            let n = c.head.len;
            if n % VALUE_GROUP != 0 {
                c.head.groups[n / VALUE_GROUP] = Some(Arc::new(group));
            }
            chunks.push(Arc::new(c));
        }
        for c in &mut chunks {
            Arc::get_mut(c).expect("a new chunk").fix_tops();
        }
        RangeMap {
            firsts: chunks.iter().map(|c| c.items[0].start).collect(),
            pieces: chunks.chunks(PIECE).map(Arc::from).collect(),
            len,
            top: None,
            empty: None,
        }
    }

    /// Adds `[start, last]`. The caller guarantees it overlaps nothing already there.
    pub fn insert(&mut self, start: u64, last: u64, hot: H, value: V) {
        debug_assert!(start <= last);
        self.len += 1;
        if self.pieces.is_empty() {
            let mut chunk = match self.empty.take() {
                Some(c) => c,
                None => Arc::new(Chunk::new()),
            };
            Arc::get_mut(&mut chunk)
                .expect("a chunk kept empty is the map's alone")
                .insert(0, start, last, hot, value);
            self.firsts.push(start);
            self.pieces.push(Arc::from([chunk]));
            self.top = None;
            return;
        }
        let c = self.chunk_for(start).unwrap_or(0);
        let last_chunk = c + 1 == self.chunk_count();
        let chunk = self.chunk_mut(c);
        let i = chunk.items[..chunk.head.len].partition_point(|it| it.start < start);
        let split = if chunk.head.len < MAX_CHUNK {
            None
        } else if last_chunk && i == chunk.head.len {
            // Appending past the end of the map (ascending inserts): start a new chunk and
            // leave this one full, rather than leaving a trail of half-full chunks.
            Some(MAX_CHUNK)
        } else if c == 0 && i == 0 {
            // Likewise for descending inserts at the front.
            Some(0)
        } else {
            Some(MAX_CHUNK / 2)
        };
        match split {
            None => {
                chunk.insert(i, start, last, hot, value);
                self.refirst(c);
            }
            Some(at) => {
                let mut upper = chunk.split_off(at);
                if i < at || (i == at && at == 0) {
                    chunk.insert(i, start, last, hot, value);
                } else {
                    upper.insert(i - at, start, last, hot, value);
                }
                self.firsts[c] = chunk.items[0].start;
                self.firsts.insert(c + 1, upper.items[0].start);
                let upper = Arc::new(upper);
                self.edit_chunks(c, |tail| tail.insert(c % PIECE + 1, upper));
            }
        }
    }

    /// Removes the range that starts exactly at `start` and returns its value.
    #[cfg(test)]
    fn remove(&mut self, start: u64) -> Option<V> {
        let pos = self.find(start)?;
        (self.bounds(pos).0 == start).then(|| self.remove_at(pos))
    }

    /// Removes the range at `pos` and returns its value.
    pub fn remove_at(&mut self, pos: Pos) -> V {
        let c = pos.chunk as usize;
        let i = pos.index as usize;
        self.len -= 1;
        if self.len == 0 {
            // The last range: the map lets go of its pieces, and keeps the chunk, emptied, for
            // the next insert if nothing else holds it (no snapshot shares it).
            let mut chunk = self.pieces[0][0].clone();
            let empty = self.empty.take();
            *self = RangeMap::default();
            return match Arc::get_mut(&mut chunk) {
                Some(only) => {
                    let value = only.remove(i);
                    self.empty = Some(chunk);
                    value
                }
                None => {
                    self.empty = empty;
                    chunk.head.value(i).clone()
                }
            };
        }
        let only = self.chunk(c).expect("chunk c");
        if only.head.len == 1 {
            // The chunk goes whole: take its value without copying the chunk (a few KiB) to
            // change it first.
            let value = only.head.value(i).clone();
            self.edit_chunks(c, |tail| {
                tail.remove(c % PIECE);
            });
            self.firsts.remove(c);
            return value;
        }
        let value = self.chunk_mut(c).remove(i);
        self.refirst(c);
        value
    }

    /// Replaces the hot value and value of the range at `pos`.
    pub fn set(&mut self, pos: Pos, hot: H, value: V) {
        let chunk = self.chunk_mut(pos.chunk as usize);
        chunk.items[pos.index as usize].hot = hot;
        chunk.head.set(pos.index as usize, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    type Model = BTreeMap<u64, (u64, u32)>;

    /// The structure's own invariants: chunk sizes, order, padding, tops, firsts.
    fn invariants(map: &RangeMap<u64, u32>) {
        assert_eq!(map.firsts.len(), map.chunks().count());
        // every piece full but the last, which is not empty
        if let Some((last, full)) = map.pieces.split_last() {
            assert!(full.iter().all(|p| p.len() == PIECE));
            assert!(!last.is_empty() && last.len() <= PIECE);
        }
        assert_eq!(map.chunks().map(|c| c.head.len).sum::<usize>(), map.len());
        let mut prev_last: Option<u64> = None;
        for (c, chunk) in map.chunks().enumerate() {
            assert!(chunk.head.len > 0 && chunk.head.len <= MAX_CHUNK);
            // the ranges' slots are distinct, in use, and hold values; no other slot is
            let head = &chunk.head;
            let mut slots: Vec<u8> = head.slot[..head.len].to_vec();
            slots.sort_unstable();
            slots.dedup();
            assert_eq!(slots.len(), head.len, "two ranges share a value slot");
            for s in 0..MAX_CHUNK {
                let (g, b) = (s / VALUE_GROUP, s % VALUE_GROUP);
                let used = head.used[g] & 1 << b != 0;
                assert_eq!(used, slots.contains(&(s as u8)), "slot {s} in use");
                let held = head.groups[g].as_ref().is_some_and(|g| g[b].is_some());
                assert_eq!(held, used, "slot {s} holds a value iff in use");
                assert_eq!(head.groups[g].is_some(), head.used[g] != 0, "group {g}");
            }
            assert_eq!(map.firsts[c], chunk.items[0].start);
            for i in 0..chunk.head.len {
                let (s, l) = (chunk.items[i].start, chunk.lasts[i]);
                assert!(s <= l);
                assert!(
                    prev_last.is_none_or(|p| p < s),
                    "ranges overlap or are out of order"
                );
                prev_last = Some(l);
                assert_eq!(
                    chunk.items[i].hot,
                    s ^ 0x5a5a,
                    "hot value follows its range"
                );
            }
            for i in chunk.head.len..MAX_CHUNK {
                assert_eq!((chunk.lasts[i], chunk.items[i].start), (u64::MAX, u64::MAX));
            }
            for g in 0..GROUPS {
                assert_eq!(chunk.tops[g], chunk.lasts[g * GROUP + GROUP - 1]);
            }
        }
    }

    /// Compares everything the map answers with a plain model: start -> (last, value), with and
    /// without its top index.
    fn check(map: &RangeMap<u64, u32>, model: &Model, probes: &[u64]) {
        let mut indexed = map.clone();
        indexed.reindex();
        assert_eq!(
            indexed.top.is_some(),
            map.chunk_count() >= TopIndex::MIN_CHUNKS
        );
        check_one(&indexed, model, probes);
        let mut plain = map.clone();
        plain.top = None;
        check_one(&plain, model, probes);
    }

    fn check_one(map: &RangeMap<u64, u32>, model: &Model, probes: &[u64]) {
        invariants(map);
        assert_eq!(map.len(), model.len());
        let listed: Vec<_> = map.iter().map(|(s, l, _, &v)| (s, (l, v))).collect();
        let expected: Vec<_> = model.iter().map(|(&s, &lv)| (s, lv)).collect();
        assert_eq!(listed, expected);
        // walking with next() visits the same ranges
        let mut walked = Vec::new();
        let mut pos = map.first_ending_at_or_after(0);
        while let Some(p) = pos {
            let (s, l, _, &v) = map.get(p);
            walked.push((s, (l, v)));
            pos = map.next(p);
        }
        assert_eq!(walked, expected);
        let mut keys: Vec<u64> = probes.to_vec();
        for (&s, &(l, _)) in model {
            keys.extend([s, l, s + (l - s) / 2, s.wrapping_sub(1), l.wrapping_add(1)]);
        }
        for key in keys {
            let holder = model
                .range(..=key)
                .next_back()
                .filter(|(_, (l, _))| *l >= key)
                .map(|(&s, &(l, v))| (s, l, v));
            let found = map.find(key).map(|p| {
                let (s, l, h, &v) = map.get(p);
                assert_eq!(h, s ^ 0x5a5a);
                (s, l, v)
            });
            assert_eq!(found, holder, "find({key:#x})");
            // ranges are disjoint and sorted: the holder, else the first starting after key
            let first_end = holder.or_else(|| {
                let after = model.range(key.checked_add(1)?..).next()?;
                Some((*after.0, after.1.0, after.1.1))
            });
            let got = map.first_ending_at_or_after(key).map(|p| {
                let (s, l, _, &v) = map.get(p);
                (s, l, v)
            });
            assert_eq!(got, first_end, "first_ending_at_or_after({key:#x})");
        }
    }

    fn insert(map: &mut RangeMap<u64, u32>, model: &mut Model, start: u64, last: u64, v: u32) {
        map.insert(start, last, start ^ 0x5a5a, v);
        model.insert(start, (last, v));
    }

    /// `n` ranges of 3 keys with 1-key holes (range `i` at `4 * i`, value `i`), inserted in a
    /// scattered order, and their model.
    fn scattered(n: u64) -> (RangeMap<u64, u32>, Model) {
        let mut map = RangeMap::default();
        let mut model = BTreeMap::new();
        for k in 0..n {
            let i = k * 7919 % n;
            insert(&mut map, &mut model, i * 4, i * 4 + 2, i as u32);
        }
        (map, model)
    }

    /// A map built in one pass answers as the same ranges inserted one by one, holds chunks
    /// half full but the last, and takes changes after (a flat index converting, then edited).
    #[test]
    fn a_map_built_from_sorted_ranges() {
        for n in [
            0u64,
            1,
            8,
            15,
            16,
            17,
            127,
            128,
            129,
            257,
            600,
            32 * 128,
            32 * 128 + 1,
        ] {
            let model: Model = (0..n).map(|i| (i * 4, (i * 4 + 2, i as u32))).collect();
            let mut map =
                RangeMap::from_sorted(model.iter().map(|(&s, &(l, v))| (s, l, s ^ 0x5a5a, v)));
            let sizes: Vec<usize> = map.chunks().map(|c| c.head.len).collect();
            let full = sizes
                .split_last()
                .is_none_or(|(_, full)| full.iter().all(|&len| len == MAX_CHUNK / 2));
            assert!(full, "{n} ranges: chunks of {sizes:?}");
            check(&map, &model, &[u64::MAX]);
            let mut model = model;
            insert(&mut map, &mut model, n * 4 + 10, n * 4 + 10, 7);
            insert(&mut map, &mut model, 3, 3, 8);
            if n > 2 {
                assert_eq!(map.remove(4), model.remove(&4).map(|(_, v)| v));
            }
            check(&map, &model, &[]);
        }
    }

    #[test]
    fn chunks_split_and_drop_across_pieces_and_values_follow_their_ranges() {
        // Enough scattered ranges for several pieces of chunk pointers.
        let n = 24_000u64;
        let (mut map, mut model) = scattered(n);
        assert!(map.pieces.len() >= 3, "{} pieces", map.pieces.len());
        check(&map, &model, &[]);
        let before = map.clone();
        let before_model = model.clone();
        // Empty whole chunks in the first and a middle piece (their pointers leave the
        // pieces), change values in place, and split chunks again in between.
        let drop_chunk = |map: &RangeMap<u64, u32>, c: usize| -> Vec<u64> {
            let chunk = map.chunk(c).unwrap();
            (0..chunk.head.len).map(|i| chunk.items[i].start).collect()
        };
        for c in [1, PIECE + 3, 0] {
            for start in drop_chunk(&map, c) {
                assert_eq!(map.remove(start), Some((start / 4) as u32));
                model.remove(&start);
            }
        }
        for i in (0..n).step_by(5) {
            if let Some(pos) = map.find(i * 4) {
                map.set(pos, (i * 4) ^ 0x5a5a, i as u32 + 1_000_000);
                model.insert(i * 4, (i * 4 + 2, i as u32 + 1_000_000));
            }
        }
        for i in 0..n / 8 {
            let start = n * 4 + i * 4;
            insert(&mut map, &mut model, start, start, 7);
        }
        check(&map, &model, &[]);
        // the clone taken before still answers what it held
        check(&before, &before_model, &[]);
    }

    #[test]
    fn the_last_chunk_emptied_is_kept_for_the_next_insert_unless_shared() {
        let mut map = RangeMap::default();
        let mut model = Model::new();
        insert(&mut map, &mut model, 0, 9, 1);
        insert(&mut map, &mut model, 16, 17, 2);
        let chunk = Arc::as_ptr(&map.pieces[0][0]);
        for start in [16, 0] {
            assert_eq!(map.remove(start), model.remove(&start).map(|(_, v)| v));
        }
        assert!(map.is_empty() && map.pieces.is_empty());
        assert!(map.empty.as_ref().is_some_and(|c| c.head.len == 0));
        check(&map, &model, &[0, 16]);
        insert(&mut map, &mut model, 20, 29, 3);
        assert_eq!(
            Arc::as_ptr(&map.pieces[0][0]),
            chunk,
            "the kept chunk is used again"
        );
        assert!(map.empty.is_none());
        check(&map, &model, &[0, 20, 29, 30]);
        // Shared with a clone (a snapshot a reader holds): the chunk is not emptied in place,
        // nor kept, and the clone still holds its range.
        let before = map.clone();
        let before_model = model.clone();
        assert_eq!(map.remove(20), Some(3));
        model.remove(&20);
        assert!(map.empty.is_none());
        check(&map, &model, &[20]);
        check(&before, &before_model, &[20]);
    }

    #[test]
    fn many_inserts_and_removes_split_and_drop_chunks() {
        let n = 2000u64;
        let (mut map, mut model) = scattered(n);
        assert!(map.chunk_count() > n as usize / MAX_CHUNK);
        check(&map, &model, &[3, n * 4, u64::MAX]);
        // a clone shares chunks and is unaffected by changes to the original
        let before = map.clone();
        for i in (0..n).filter(|i| i % 3 != 0) {
            assert_eq!(map.remove(i * 4), Some(i as u32));
            model.remove(&(i * 4));
        }
        assert_eq!(map.remove(1), None, "not a range start");
        check(&map, &model, &[]);
        assert_eq!(before.len(), n as usize);
        assert_eq!(before.get(before.find(4 * 5).unwrap()).3, &5);
        // remove everything
        for i in (0..n).filter(|i| i % 3 == 0) {
            map.remove(i * 4).unwrap();
        }
        assert!(map.is_empty() && map.pieces.is_empty());
    }

    #[test]
    fn few_ranges_left_in_many_chunks() {
        // Removals never merge chunks: a map can hold few ranges spread over many chunks, and
        // the lookups that count only the first group or the first line of tops must still
        // search the right chunk.
        for keep in [
            1u64,
            5,
            GROUP as u64,
            9,
            40,
            (GROUP * GROUP) as u64,
            65,
            100,
        ] {
            let mut map = RangeMap::default();
            let mut model = BTreeMap::new();
            let n = 12 * MAX_CHUNK as u64;
            for i in 0..n {
                insert(&mut map, &mut model, i * 4, i * 4 + 1, i as u32);
            }
            let step = n / keep;
            for i in (0..n).filter(|i| i % step != step / 2 || i / step >= keep) {
                map.remove(i * 4).unwrap();
                model.remove(&(i * 4));
            }
            assert_eq!(map.len(), keep as usize);
            assert!(map.chunk_count() > 1 || keep == 1);
            check(&map, &model, &[0, 1, n * 4, u64::MAX]);
        }
    }

    #[test]
    fn ascending_and_descending_inserts_fill_chunks() {
        for descending in [false, true] {
            let mut map = RangeMap::default();
            let mut model = BTreeMap::new();
            let n = 10 * MAX_CHUNK as u64 + 3;
            for k in 0..n {
                let i = if descending { n - 1 - k } else { k };
                insert(&mut map, &mut model, i * 2, i * 2, i as u32);
            }
            assert_eq!(
                map.chunk_count(),
                11,
                "full chunks, descending: {descending}"
            );
            check(&map, &model, &[]);
        }
    }

    #[test]
    fn walking_and_range_queries() {
        let mut map = RangeMap::default();
        for i in 0..600u64 {
            map.insert(i * 10, i * 10 + 4, 0u8, i as u32);
        }
        let mut pos = map.find(0).unwrap();
        let mut seen = 1;
        while let Some(p) = map.next(pos) {
            assert!(map.get(p).0 > map.get(pos).1);
            pos = p;
            seen += 1;
        }
        assert_eq!(seen, 600);
        // first range ending at or after a key in a hole, at a chunk edge, and past the end
        assert_eq!(map.get(map.first_ending_at_or_after(7).unwrap()).0, 10);
        assert_eq!(map.get(map.first_ending_at_or_after(4).unwrap()).0, 0);
        for i in 0..599u64 {
            let p = map.first_ending_at_or_after(i * 10 + 5).unwrap();
            assert_eq!(map.get(p).0, (i + 1) * 10);
        }
        assert!(map.first_ending_at_or_after(5995).is_none());
        let p = map.find(20).unwrap();
        map.set(p, 7, 99);
        assert_eq!(map.get(map.find(22).unwrap()).2, 7);
        assert_eq!(map.get(map.find(22).unwrap()).3, &99);
    }

    #[test]
    fn ranges_at_the_top_of_the_space() {
        let mut map = RangeMap::default();
        let mut model = BTreeMap::new();
        insert(&mut map, &mut model, u64::MAX - 9, u64::MAX, 1);
        insert(&mut map, &mut model, 0, 0, 2);
        check(&map, &model, &[1, u64::MAX, u64::MAX - 10]);
        assert_eq!(map.remove(u64::MAX - 9), Some(1));
        model.remove(&(u64::MAX - 9));
        // u64::MAX is the padding value too: it must not be found in unused slots
        check(&map, &model, &[u64::MAX, u64::MAX - 1]);
        for i in 0..20 {
            insert(
                &mut map,
                &mut model,
                u64::MAX - 100 + i * 3,
                u64::MAX - 100 + i * 3 + 1,
                i as u32,
            );
        }
        check(&map, &model, &[u64::MAX]);
    }

    #[test]
    fn top_index_with_clustered_and_extreme_keys() {
        let mut map = RangeMap::default();
        let mut model = BTreeMap::new();
        // three clusters far apart, one at the very top: most buckets are empty, a few hold
        // many chunks
        for i in 0..3000u64 {
            let base = [0, 1 << 40, u64::MAX - (1 << 20)][(i % 3) as usize];
            let s = base + (i / 3) * 16;
            insert(&mut map, &mut model, s, s + 7, i as u32);
        }
        let probes: Vec<u64> = (0..64)
            .map(|k| k << 58)
            .chain([u64::MAX, 1 << 40])
            .collect();
        check(&map, &model, &probes);
        // every change drops the index, and lookups stay right until it is rebuilt
        map.reindex();
        assert!(map.top.is_some());
        let first = map.firsts[5];
        map.remove(first).unwrap();
        model.remove(&first);
        assert!(map.top.is_none(), "a chunk's first key moved");
        check_one(&map, &model, &probes);
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Insert a range of `width + 1` keys at `slot * 8` if it overlaps nothing.
        Insert { slot: u64, width: u64 },
        /// Insert `n` ranges of one key at consecutive slots from `slot`, up or down.
        Run { slot: u64, n: u64, down: bool },
        /// Remove the range starting at (or after) `slot * 8`.
        Remove { slot: u64 },
        /// Remove `n` ranges from the one at (or after) `slot * 8`.
        RemoveRun { slot: u64, n: usize },
        /// Keep a clone; later checks verify it did not change.
        Snapshot,
    }

    fn op() -> impl Strategy<Value = Op> {
        let slot = 0u64..2000;
        prop_oneof![
            4 => (slot.clone(), 0u64..8).prop_map(|(slot, width)| Op::Insert { slot, width }),
            1 => (slot.clone(), 1u64..700, any::<bool>())
                .prop_map(|(slot, n, down)| Op::Run { slot, n, down }),
            3 => slot.clone().prop_map(|slot| Op::Remove { slot }),
            1 => (slot, 1usize..400).prop_map(|(slot, n)| Op::RemoveRun { slot, n }),
            1 => Just(Op::Snapshot),
        ]
    }

    fn free(model: &Model, start: u64, last: u64) -> bool {
        model
            .range(..=last)
            .next_back()
            .is_none_or(|(_, (l, _))| *l < start)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]
        #[test]
        fn range_map_matches_a_btree_map(ops in proptest::collection::vec(op(), 1..40)) {
            let mut map = RangeMap::default();
            let mut model = Model::new();
            let mut snapshots = Vec::new();
            let mut v = 0u32;
            for op in ops {
                match op {
                    Op::Insert { slot, width } => {
                        let (s, l) = (slot * 8, slot * 8 + width);
                        if free(&model, s, l) {
                            v += 1;
                            insert(&mut map, &mut model, s, l, v);
                        }
                    }
                    Op::Run { slot, n, down } => {
                        for k in 0..n {
                            let s = if down { slot.saturating_sub(k) } else { slot + k } * 8;
                            if free(&model, s, s) {
                                v += 1;
                                insert(&mut map, &mut model, s, s, v);
                            }
                        }
                    }
                    Op::Remove { slot } => {
                        let start = model.range(slot * 8..).next().map(|(&s, _)| s);
                        if let Some(s) = start {
                            prop_assert_eq!(map.remove(s), model.remove(&s).map(|(_, v)| v));
                        }
                        prop_assert_eq!(map.remove(slot * 8 + 1), None);
                    }
                    Op::RemoveRun { slot, n } => {
                        let starts: Vec<u64> =
                            model.range(slot * 8..).take(n).map(|(&s, _)| s).collect();
                        for s in starts {
                            prop_assert_eq!(map.remove(s), model.remove(&s).map(|(_, v)| v));
                        }
                    }
                    Op::Snapshot => {
                        snapshots.push((map.clone(), model.clone()));
                        map.reindex();
                    }
                }
            }
            check(&map, &model, &[0, u64::MAX]);
            for (snap, model) in &snapshots {
                check(snap, model, &[]);
            }
        }
    }
}
