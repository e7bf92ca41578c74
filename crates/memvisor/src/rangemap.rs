//! A persistent map of disjoint `u64` ranges, cheap to copy and change.
//!
//! Readers of memvisor's tables hold immutable snapshots; a writer publishes a changed copy. For a
//! handful of ranges a sorted array copied on every change is fine, but an IOMMU address space
//! can hold 100 000 mappings that a guest changes one 4 KiB page at a time, and copying all of
//! them per change is not. [`RangeMap`] is a two-level B-tree-like array: ranges sorted into
//! chunks of at most [`MAX_CHUNK`] entries, each chunk behind an `Arc`. Cloning the map copies
//! only the chunk pointers (and their first keys); changing it copies only the chunk it touches
//! (`Arc::make_mut`), splitting chunks that grow too big and dropping chunks that become empty.
//! So a publish costs O(n / chunk) pointer copies plus O(chunk), and a lookup is two binary
//! searches over contiguous arrays: the chunks' first keys, then the chunk's starts.
//!
//! The map does not check for overlap: its owner validates a change before making it.

use std::sync::Arc;

/// Most entries in a chunk; a chunk that would grow past it is split in two halves.
pub const MAX_CHUNK: usize = 256;

/// Where an entry lives: chunk and position in it. Valid only for the map it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pos {
    chunk: u32,
    index: u32,
}

impl Pos {
    /// The first position; a placeholder that is only valid in a non-empty map.
    pub const FIRST: Pos = Pos { chunk: 0, index: 0 };
}

#[derive(Clone, Debug)]
struct Chunk<V> {
    starts: Vec<u64>,
    lasts: Vec<u64>,
    values: Vec<V>,
}

/// Disjoint inclusive ranges `[start, last]`, each with a value.
#[derive(Clone, Debug)]
pub struct RangeMap<V> {
    /// `firsts[c]` is the start of chunk `c`'s first range.
    firsts: Vec<u64>,
    chunks: Vec<Arc<Chunk<V>>>,
    len: usize,
}

impl<V> Default for RangeMap<V> {
    fn default() -> Self {
        RangeMap {
            firsts: Vec::new(),
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<V: Clone> RangeMap<V> {
    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The position of the range holding `key`.
    #[inline]
    pub fn find(&self, key: u64) -> Option<Pos> {
        let c = self.firsts.partition_point(|&f| f <= key).checked_sub(1)?;
        let chunk = &self.chunks[c];
        let i = chunk.starts.partition_point(|&s| s <= key).checked_sub(1)?;
        (key <= chunk.lasts[i]).then_some(Pos {
            chunk: c as u32,
            index: i as u32,
        })
    }

    /// The position of the first range that ends at or after `key`.
    pub fn first_ending_at_or_after(&self, key: u64) -> Option<Pos> {
        let c = self.firsts.partition_point(|&f| f <= key).saturating_sub(1);
        let chunk = self.chunks.get(c)?;
        let i = chunk.lasts.partition_point(|&l| l < key);
        if i < chunk.lasts.len() {
            Some(Pos {
                chunk: c as u32,
                index: i as u32,
            })
        } else {
            // Every range of this chunk ends before `key`: the next chunk's first is the one.
            (c + 1 < self.chunks.len()).then_some(Pos {
                chunk: c as u32 + 1,
                index: 0,
            })
        }
    }

    /// The range at `pos`: start, last, value.
    #[inline]
    pub fn get(&self, pos: Pos) -> (u64, u64, &V) {
        let chunk = &self.chunks[pos.chunk as usize];
        let i = pos.index as usize;
        (chunk.starts[i], chunk.lasts[i], &chunk.values[i])
    }

    /// The position after `pos`, in address order.
    #[inline]
    pub fn next(&self, pos: Pos) -> Option<Pos> {
        let chunk = &self.chunks[pos.chunk as usize];
        if (pos.index as usize) + 1 < chunk.starts.len() {
            Some(Pos {
                chunk: pos.chunk,
                index: pos.index + 1,
            })
        } else {
            ((pos.chunk as usize) + 1 < self.chunks.len()).then_some(Pos {
                chunk: pos.chunk + 1,
                index: 0,
            })
        }
    }

    /// All ranges in address order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64, &V)> {
        self.chunks.iter().flat_map(|c| {
            c.starts
                .iter()
                .zip(&c.lasts)
                .zip(&c.values)
                .map(|((&s, &l), v)| (s, l, v))
        })
    }

    /// Adds `[start, last]`. The caller guarantees it overlaps nothing already there.
    pub fn insert(&mut self, start: u64, last: u64, value: V) {
        debug_assert!(start <= last);
        self.len += 1;
        if self.chunks.is_empty() {
            self.firsts.push(start);
            self.chunks.push(Arc::new(Chunk {
                starts: vec![start],
                lasts: vec![last],
                values: vec![value],
            }));
            return;
        }
        let c = self
            .firsts
            .partition_point(|&f| f <= start)
            .saturating_sub(1);
        let chunk = Arc::make_mut(&mut self.chunks[c]);
        let i = chunk.starts.partition_point(|&s| s < start);
        chunk.starts.insert(i, start);
        chunk.lasts.insert(i, last);
        chunk.values.insert(i, value);
        self.firsts[c] = chunk.starts[0];
        if chunk.starts.len() > MAX_CHUNK {
            let half = chunk.starts.len() / 2;
            let upper = Chunk {
                starts: chunk.starts.split_off(half),
                lasts: chunk.lasts.split_off(half),
                values: chunk.values.split_off(half),
            };
            self.firsts.insert(c + 1, upper.starts[0]);
            self.chunks.insert(c + 1, Arc::new(upper));
        }
    }

    /// Removes the range that starts exactly at `start` and returns its value.
    pub fn remove(&mut self, start: u64) -> Option<V> {
        let pos = self.find(start)?;
        let c = pos.chunk as usize;
        if self.chunks[c].starts[pos.index as usize] != start {
            return None;
        }
        let chunk = Arc::make_mut(&mut self.chunks[c]);
        let i = pos.index as usize;
        chunk.starts.remove(i);
        chunk.lasts.remove(i);
        let value = chunk.values.remove(i);
        if chunk.starts.is_empty() {
            self.chunks.remove(c);
            self.firsts.remove(c);
        } else {
            self.firsts[c] = chunk.starts[0];
        }
        self.len -= 1;
        Some(value)
    }

    /// Replaces the value of the range at `pos`.
    pub fn set(&mut self, pos: Pos, value: V) {
        let chunk = Arc::make_mut(&mut self.chunks[pos.chunk as usize]);
        chunk.values[pos.index as usize] = value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// A plain model: start -> (last, value).
    fn check(map: &RangeMap<u32>, model: &BTreeMap<u64, (u64, u32)>) {
        assert_eq!(map.len(), model.len());
        let listed: Vec<_> = map.iter().map(|(s, l, &v)| (s, (l, v))).collect();
        let expected: Vec<_> = model.iter().map(|(&s, &lv)| (s, lv)).collect();
        assert_eq!(listed, expected);
        for (&s, &(l, v)) in model {
            for key in [s, l, s + (l - s) / 2] {
                let (fs, fl, &fv) = map.get(map.find(key).unwrap());
                assert_eq!((fs, fl, fv), (s, l, v), "find({key})");
            }
            if let Some(before) = s.checked_sub(1) {
                if !model.values().any(|&(l2, _)| l2 == before) {
                    assert!(map.find(before).is_none() || map.get(map.find(before).unwrap()).1 < s);
                }
            }
        }
    }

    #[test]
    fn many_inserts_and_removes_split_and_drop_chunks() {
        let mut map = RangeMap::default();
        let mut model = BTreeMap::new();
        // 2000 ranges of 3 keys with 1-key holes, inserted in a scattered order.
        let n = 2000u64;
        for k in 0..n {
            let i = k * 7919 % n;
            map.insert(i * 4, i * 4 + 2, i as u32);
            model.insert(i * 4, (i * 4 + 2, i as u32));
        }
        assert!(map.chunks.len() > n as usize / MAX_CHUNK);
        assert!(map.chunks.iter().all(|c| c.starts.len() <= MAX_CHUNK));
        check(&map, &model);
        assert!(map.find(3).is_none() && map.find(n * 4).is_none());
        // a clone shares chunks and is unaffected by changes to the original
        let before = map.clone();
        for i in (0..n).filter(|i| i % 3 != 0) {
            assert_eq!(map.remove(i * 4), Some(i as u32));
            model.remove(&(i * 4));
        }
        assert_eq!(map.remove(1), None, "not a range start");
        check(&map, &model);
        assert_eq!(before.len(), n as usize);
        assert_eq!(before.get(before.find(4 * 5).unwrap()).2, &5);
        // remove everything
        for i in (0..n).filter(|i| i % 3 == 0) {
            map.remove(i * 4).unwrap();
        }
        assert!(map.is_empty() && map.chunks.is_empty());
    }

    #[test]
    fn walking_and_range_queries() {
        let mut map = RangeMap::default();
        for i in 0..600u64 {
            map.insert(i * 10, i * 10 + 4, i as u32);
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
        map.set(p, 99);
        assert_eq!(map.get(map.find(22).unwrap()).2, &99);
    }

    #[test]
    fn ranges_at_the_top_of_the_space() {
        let mut map = RangeMap::default();
        map.insert(u64::MAX - 9, u64::MAX, 1u32);
        map.insert(0, 0, 2);
        assert_eq!(map.get(map.find(u64::MAX).unwrap()).2, &1);
        assert_eq!(map.get(map.find(0).unwrap()).2, &2);
        assert!(map.find(1).is_none());
        assert_eq!(map.remove(u64::MAX - 9), Some(1));
    }
}
