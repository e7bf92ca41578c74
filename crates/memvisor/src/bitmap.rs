//! Dirty bitmaps: one bit per page, set by writers without locks, read-and-cleared by migration.
//!
//! A [`DirtyBitmap`] covers a fixed number of pages. Writers mark a run of pages with one atomic
//! OR per 64-bit word the run touches (not one atomic per page), so a 1 MiB write costs four
//! atomics at 4 KiB granularity. The layout (bit `i` of word `i / 64` is page `i`) is the one
//! KVM's `KVM_GET_DIRTY_LOG` and VFIO's `VFIO_IOMMU_DIRTY_PAGES` return, so a VMM can pass the
//! words straight on.
//!
//! **Summary levels.** Above the page words sit summary levels: bit `j` of level `k + 1` says
//! "word `j` of level `k` may be non-zero"; each level has 1/64 of the words of the one below,
//! up to a top level of one word (a 1 TiB guest of 4 KiB pages: 4 Mi page words, then 64 Ki,
//! 1 Ki, 16 and 1 summary words). A drain ([`DirtyBitmap::drain`]) starts at the top and goes
//! down only where a summary bit is set, so reading and clearing a bitmap costs the words on the
//! paths to the dirty words — O(dirty words × levels) — not O(pages). A summary bit may be set
//! over a clean word (a page marked and drained, or a stale bit left by
//! [`DirtyBitmap::take_by_full_scan`]): that costs one visit, never a lost page.
//!
//! **Order of sets and clears; never under-report.** A writer sets the page bit first (an
//! atomic OR), then goes up: at each summary level it loads the word and, only if its bit is
//! clear, ORs it in. A drain goes down: it swaps a word with zero and, for each bit that was set,
//! visits (loads, and if non-zero swaps) the word below. So a drain clears a summary bit
//! *before* it reads the words under it, and a writer sets a summary bit *after* the bit under
//! it. Every one of these accesses is `SeqCst`. The writer's "load, set only if clear" against
//! the drain's "clear the parent, then read the child" is the store-buffering pattern: with
//! weaker orderings the writer could read its parent bit as still set while the drain, having
//! just cleared that parent, reads the child word from before the writer's OR — and the page
//! would wait, unseen, under a clear parent. In the single total order of `SeqCst` accesses
//! that cannot happen: either the writer's parent load comes after the drain's clear (it sees the
//! bit clear and sets it again: the next drain finds the page), or before it, and then the
//! drain's later swap of the child word comes after the writer's OR of it and takes the bit. On
//! x86 this costs nothing over weaker orderings (an atomic OR is a locked instruction either way
//! and a `SeqCst` load is a plain load); marking a page that is in an already marked region
//! costs its OR plus one load per summary level, all of them in cache.
//!
//! The result, for a page marked by a `mark` that returned before a drain began: that drain
//! reports it, or a drain running at the same time does. A page marked during a drain is
//! reported by this drain or, at the latest, by the first drain that begins after the `mark`
//! returned — never lost. (Unlike the single OR of a bitmap without summaries, a mark is not
//! instantaneous: while a thread is between its page bit and its summary bits, drains may not
//! see the page yet. Migration's last drain comes after the devices stopped, so after every
//! mark returned.) A page is reported once per mark: the swap that returns its bit clears it.
//!
//! A [`SharedLog`] is the other end: a dirty log that lives in memory another process reads and
//! clears — vhost-user's `SET_LOG_BASE` area, one bit per 4 KiB guest physical page, bit
//! `page % 8` of byte `page / 8`. memvisor does not track dirty pages in it; its own bitmaps are
//! drained into it ([`SharedLog::or_words`]), so there is one source of truth and the shared log
//! is its view for the frontend. Bits are set with atomic OR, byte by byte, because the frontend
//! reads and clears the same bytes with atomic exchanges while the device runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use crate::backing::Backing;

/// One bit per page, lock-free to set, atomically read-and-cleared in time that grows with the
/// dirty words, not with the pages (see the module documentation).
#[derive(Debug)]
pub struct DirtyBitmap {
    /// `levels[0]`: one bit per page; `levels[k + 1]`: one bit per word of `levels[k]`. The
    /// last level has at most one word.
    levels: Box<[Box<[AtomicU64]>]>,
    pages: u64,
    /// TEST ONLY ([`Faults::no_dirty_summary`](crate::faults::Faults::no_dirty_summary)): marks
    /// set the page bits and no summary bit, so drains miss them.
    #[cfg(feature = "test-hooks")]
    no_summary: bool,
}

/// The number of words of each level for `pages` pages: page words first, then summaries up to
/// a level of one word.
fn level_sizes(pages: u64) -> Vec<u64> {
    let mut n = pages.div_ceil(64);
    let mut sizes = vec![n];
    while n > 1 {
        n = n.div_ceil(64);
        sizes.push(n);
    }
    sizes
}

/// The mask of bits `lo .. hi` of one word (`lo < hi <= 64`).
fn mask(lo: u64, hi: u64) -> u64 {
    let n = hi - lo;
    if n == 64 {
        u64::MAX
    } else {
        ((1u64 << n) - 1) << lo
    }
}

impl DirtyBitmap {
    /// A clear bitmap for `pages` pages.
    pub fn new(pages: u64) -> Self {
        let levels = level_sizes(pages)
            .into_iter()
            .map(|n| (0..n).map(|_| AtomicU64::new(0)).collect())
            .collect();
        DirtyBitmap {
            levels,
            pages,
            #[cfg(feature = "test-hooks")]
            no_summary: false,
        }
    }

    /// TEST ONLY (feature `test-hooks`): this bitmap with `faults` applied: with
    /// [`Faults::no_dirty_summary`](crate::faults::Faults::no_dirty_summary) its marks set the
    /// page bits and no summary bit, so drains miss them — the negative control of the migration
    /// trial (`guest/trial.sh mig --no-summary`), which must then find stale memory.
    #[cfg(feature = "test-hooks")]
    pub fn with_faults(mut self, faults: &crate::faults::Faults) -> Self {
        self.no_summary = faults.no_dirty_summary;
        self
    }

    /// A clear bitmap for `pages` pages, or `None` if its memory cannot be had (the caller
    /// answers ENOMEM, as the kernel does when a dirty bitmap cannot be allocated).
    pub fn try_new(pages: u64) -> Option<Self> {
        let mut levels = Vec::new();
        for n in level_sizes(pages) {
            let n = usize::try_from(n).ok()?;
            let mut v: Vec<AtomicU64> = Vec::new();
            v.try_reserve_exact(n).ok()?;
            v.extend((0..n).map(|_| AtomicU64::new(0)));
            levels.push(v.into_boxed_slice());
        }
        Some(DirtyBitmap {
            levels: levels.into_boxed_slice(),
            pages,
            #[cfg(feature = "test-hooks")]
            no_summary: false,
        })
    }

    /// Marks every page.
    pub fn mark_all(&self) {
        self.mark(0, self.pages);
    }

    /// Number of pages covered.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Marks pages `first .. first + count` dirty; the part past the end is ignored. The page
    /// bits first, then each summary level above them (see the module documentation).
    pub fn mark(&self, first: u64, count: u64) {
        let end = first.saturating_add(count).min(self.pages);
        if first >= end {
            return;
        }
        #[cfg(feature = "test-hooks")]
        let levels = if self.no_summary {
            1
        } else {
            self.levels.len()
        };
        #[cfg(not(feature = "test-hooks"))]
        let levels = self.levels.len();
        // Bits `lo .. hi` of the current level.
        let (mut lo, mut hi) = (first, end);
        for (k, level) in self.levels[..levels].iter().enumerate() {
            let mut bit = lo;
            while bit < hi {
                let word = &level[(bit / 64) as usize];
                let n = (64 - bit % 64).min(hi - bit);
                let m = mask(bit % 64, bit % 64 + n);
                // Page bits are always ORed (a mark must release the write before it); a summary
                // bit only when it reads clear, so the hot path is one load per level.
                if k == 0 || word.load(Ordering::SeqCst) & m != m {
                    word.fetch_or(m, Ordering::SeqCst);
                }
                bit += n;
            }
            lo /= 64;
            hi = (hi - 1) / 64 + 1;
        }
    }

    /// Whether page `page` is marked.
    pub fn is_marked(&self, page: u64) -> bool {
        page < self.pages
            && self.levels[0][(page / 64) as usize].load(Ordering::Relaxed) >> (page % 64) & 1 == 1
    }

    /// Reads and clears the bitmap through its summary levels: calls `f(page, bits)` for each
    /// non-zero word, in increasing order, with `page` the page of its bit 0 (a multiple of 64).
    /// Returns the words it read, summary words included: one per level for a clean bitmap, and
    /// for each dirty word at most one more per level (the cost, for tests and benchmarks).
    pub fn drain(&self, mut f: impl FnMut(u64, u64)) -> u64 {
        let top = self.levels.len() - 1;
        let mut read = 0;
        for i in 0..self.levels[top].len() {
            self.drain_word(top, i, &mut f, &mut read);
        }
        read
    }

    /// Clears word `i` of level `level` and, below a summary word, every word its bits name.
    fn drain_word(&self, level: usize, i: usize, f: &mut impl FnMut(u64, u64), read: &mut u64) {
        let word = &self.levels[level][i];
        *read += 1;
        // A word that reads clean is not written: a drain that read it a moment earlier would
        // have found it clean too.
        if word.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut bits = word.swap(0, Ordering::SeqCst);
        if level == 0 {
            if bits != 0 {
                f(i as u64 * 64, bits);
            }
            return;
        }
        while bits != 0 {
            let below = i * 64 + bits.trailing_zeros() as usize;
            self.drain_word(level - 1, below, f, read);
            bits &= bits - 1;
        }
    }

    /// Returns the bitmap and clears it ([`DirtyBitmap::drain`] into a zeroed vector of one
    /// word per 64 pages; the vector costs O(pages), the reading does not).
    pub fn take(&self) -> Vec<u64> {
        let mut out = vec![0u64; self.levels[0].len()];
        self.drain(|page, bits| out[(page / 64) as usize] = bits);
        out
    }

    /// The drain as it was before the summary levels: every page word loaded, the non-zero
    /// ones swapped with zero, O(pages). Kept only so `memvisor bench scale` can put the two
    /// side by side in one run; it leaves the summary bits set (the next drain visits those
    /// words, finds them clean, and clears the bits).
    #[doc(hidden)]
    pub fn take_by_full_scan(&self) -> Vec<u64> {
        self.levels[0]
            .iter()
            .map(|w| {
                if w.load(Ordering::Relaxed) == 0 {
                    0
                } else {
                    w.swap(0, Ordering::Relaxed)
                }
            })
            .collect()
    }
}

/// A dirty log shared with another process; see the module documentation.
#[derive(Debug)]
pub struct SharedLog {
    memory: Arc<Backing>,
    bytes: u64,
}

impl SharedLog {
    /// A log over the first `bytes` bytes of `memory` (a received descriptor's mapping). EINVAL
    /// if `memory` is shorter.
    pub fn new(memory: Arc<Backing>, bytes: u64) -> crate::Result<Self> {
        if bytes > memory.size() {
            return Err(crate::Error::OutOfBounds {
                what: "dirty log",
                start: 0,
                len: bytes,
                limit: memory.size(),
            });
        }
        Ok(SharedLog { memory, bytes })
    }

    /// Pages the log covers.
    pub fn pages(&self) -> u64 {
        self.bytes * 8
    }

    fn byte(&self, i: u64) -> &AtomicU8 {
        debug_assert!(i < self.bytes);
        // SAFETY: i < bytes <= the mapping's size, so the pointer is inside the live mapping
        // that `self.memory` keeps; u8 needs no alignment; every access to the log, ours and the
        // frontend's, is atomic, which is what an `AtomicU8` reference permits.
        unsafe { AtomicU8::from_ptr(self.memory.as_ptr().add(i as usize)) }
    }

    /// Marks page `page`; false if the log does not reach it.
    pub fn mark(&self, page: u64) -> bool {
        if page >= self.pages() {
            return false;
        }
        self.byte(page / 8)
            .fetch_or(1 << (page % 8), Ordering::Release);
        true
    }

    /// ORs a bitmap in [`DirtyBitmap`]'s layout (bit `i` of word `i / 64` is page `i`) into the
    /// log from page `first`; returns the pages marked, and how many of them lay past the log's
    /// end (and were dropped — the caller reports that: a frontend that sized its log too small).
    pub fn or_words(&self, first: u64, words: &[u64]) -> (u64, u64) {
        let (mut marked, mut outside) = (0, 0);
        for (i, &w) in words.iter().enumerate() {
            if w == 0 {
                continue;
            }
            let base = first + 64 * i as u64;
            if base % 8 == 0 {
                // Whole bytes of the log: one atomic OR per non-zero byte.
                for (b, &byte) in w.to_le_bytes().iter().enumerate() {
                    if byte == 0 {
                        continue;
                    }
                    let at = base / 8 + b as u64;
                    if at < self.bytes {
                        self.byte(at).fetch_or(byte, Ordering::Release);
                        marked += u64::from(byte.count_ones());
                    } else {
                        outside += u64::from(byte.count_ones());
                    }
                }
            } else {
                let mut bits = w;
                while bits != 0 {
                    let page = base + u64::from(bits.trailing_zeros());
                    if self.mark(page) {
                        marked += 1;
                    } else {
                        outside += 1;
                    }
                    bits &= bits - 1;
                }
            }
        }
        (marked, outside)
    }

    /// Whether page `page` is marked (tests, and a frontend's view).
    pub fn is_marked(&self, page: u64) -> bool {
        page < self.pages() && self.byte(page / 8).load(Ordering::Acquire) >> (page % 8) & 1 == 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn a_shared_log_takes_words_at_any_page_and_drops_what_lies_past_its_end() {
        use crate::backing::BackingKind;
        let mem = Arc::new(Backing::new(BackingKind::Memfd, 4096).unwrap());
        let log = SharedLog::new(mem.clone(), 16).unwrap(); // 128 pages
        assert_eq!(log.pages(), 128);
        assert_eq!(log.or_words(64, &[0b1011, 1 << 63]), (3, 1));
        assert_eq!(log.or_words(3, &[0b11]), (2, 0));
        let marked: Vec<u64> = (0..128).filter(|&p| log.is_marked(p)).collect();
        assert_eq!(marked, vec![3, 4, 64, 65, 67]);
        // The layout is vhost-user's: bit page % 8 of byte page / 8.
        let mut b = [0u8; 16];
        mem.read(0, &mut b).unwrap();
        assert_eq!(b[0], 0b0001_1000);
        assert_eq!(b[8], 0b0000_1011);
        assert!(!log.mark(128));
        assert!(SharedLog::new(mem, 4097).is_err());
    }

    fn marked(b: &DirtyBitmap) -> Vec<u64> {
        (0..b.pages()).filter(|&p| b.is_marked(p)).collect()
    }

    #[test]
    fn marks_exactly_the_run_across_words() {
        let b = DirtyBitmap::new(200);
        b.mark(60, 70);
        assert_eq!(marked(&b), (60..130).collect::<Vec<_>>());
        b.mark(0, 1);
        b.mark(199, 5);
        assert!(b.is_marked(0) && b.is_marked(199) && !b.is_marked(1));
    }

    #[test]
    fn take_returns_and_clears() {
        let b = DirtyBitmap::new(128);
        b.mark(64, 64);
        let words = b.take();
        assert_eq!(words, vec![0, u64::MAX]);
        assert!(marked(&b).is_empty());
        assert_eq!(b.take(), vec![0, 0]);
    }

    #[test]
    fn huge_counts_do_not_overflow() {
        let b = DirtyBitmap::new(10);
        b.mark(5, u64::MAX);
        assert_eq!(marked(&b), (5..10).collect::<Vec<_>>());
    }

    /// Pages reported by one drain, in the order reported.
    fn drained(b: &DirtyBitmap) -> (Vec<u64>, u64) {
        let mut pages = Vec::new();
        let read = b.drain(|first, mut bits| {
            assert_eq!(first % 64, 0);
            while bits != 0 {
                pages.push(first + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        });
        (pages, read)
    }

    #[test]
    fn summary_levels_shrink_by_64_up_to_one_word() {
        assert_eq!(level_sizes(0), vec![0]);
        assert_eq!(level_sizes(64), vec![1]);
        assert_eq!(level_sizes(65), vec![2, 1]);
        assert_eq!(level_sizes(64 * 64 * 64 + 1), vec![4097, 65, 2, 1]);
        // A 1 TiB guest of 4 KiB pages.
        assert_eq!(level_sizes(1 << 28), vec![1 << 22, 1 << 16, 1 << 10, 16, 1]);
        assert_eq!(drained(&DirtyBitmap::new(0)), (vec![], 0));
    }

    #[test]
    fn a_drain_reports_every_marked_page_once_in_order_and_clears_the_summaries() {
        let b = DirtyBitmap::new(64 * 64 * 64 * 3);
        let pages = [
            0,
            63,
            64,
            4095,
            4096,
            262_143,
            262_144,
            64 * 64 * 64 * 3 - 1,
        ];
        for &p in pages.iter().rev() {
            b.mark(p, 1);
        }
        b.mark(500_000, 200);
        let mut want: Vec<u64> = pages.to_vec();
        want.extend(500_000..500_200);
        want.sort();
        let (got, _) = drained(&b);
        assert_eq!(got, want);
        assert!(marked(&b).is_empty());
        // Every summary word is clear again: the next drain reads only the top word.
        assert!(
            b.levels
                .iter()
                .all(|l| l.iter().all(|w| w.load(Ordering::Relaxed) == 0))
        );
        assert_eq!(drained(&b), (vec![], 1));
        b.mark_all();
        assert_eq!(drained(&b).0, (0..b.pages()).collect::<Vec<_>>());
    }

    #[test]
    fn a_drain_reads_only_the_summary_words_and_dirty_words_on_the_way() {
        // 2^24 pages (64 GiB of 4 KiB pages): 2^18 page words under 4096, 64 and 1 summary words.
        let b = DirtyBitmap::new(1 << 24);
        assert_eq!(b.levels.len(), 4);
        assert_eq!(drained(&b).1, 1, "a clean bitmap costs its top word");
        b.mark(12_345_678, 1);
        assert_eq!(
            drained(&b),
            (vec![12_345_678], 4),
            "one page: one word per level"
        );
        // Two pages in one page word share the whole path; two far apart share only the top.
        b.mark(64 * 1000, 1);
        b.mark(64 * 1000 + 5, 1);
        assert_eq!(drained(&b).1, 4);
        b.mark(0, 1);
        b.mark((1 << 24) - 1, 1);
        assert_eq!(drained(&b), (vec![0, (1 << 24) - 1], 1 + 3 + 3));
        // 1% of the pages, one in a hundred: the drain reads each dirty page word once and each
        // summary word above one, and no other word.
        let pages: Vec<u64> = (0..1 << 24).step_by(100).collect();
        for &p in &pages {
            b.mark(p, 1);
        }
        let on_paths: usize = [64u64, 64 * 64, 64 * 64 * 64, 1 << 24]
            .iter()
            .map(|per| pages.iter().map(|p| p / per).collect::<HashSet<_>>().len())
            .sum();
        let (got, read) = drained(&b);
        assert_eq!(got, pages);
        assert_eq!(read, on_paths as u64);
        assert!(read < (1 << 18), "fewer words than a full scan's");
    }

    #[test]
    fn the_full_scan_leaves_stale_summaries_that_cost_a_visit_and_lose_nothing() {
        let b = DirtyBitmap::new(1 << 20);
        b.mark(777, 1);
        let words = b.take_by_full_scan();
        assert_eq!(words[777 / 64], 1 << (777 % 64));
        // 2^14 page words under 256, 4 and 1 summary words.
        assert_eq!(drained(&b), (vec![], 4), "the stale path is visited once");
        assert_eq!(drained(&b), (vec![], 1));
    }

    /// Two writers mark disjoint pages of a fresh bitmap of `pages` pages (each page once) in a
    /// scattered order and publish how many they have marked; the drainer drains in rounds.
    /// Every page a writer had published before a round began must have been reported by the
    /// end of that round, and no page twice. Returns the rounds.
    fn race(pages: u64) -> u32 {
        use std::sync::atomic::AtomicUsize;
        const WRITERS: u64 = 2;
        let b = DirtyBitmap::new(pages);
        let each = pages / WRITERS;
        let order: Vec<Vec<u64>> = (0..WRITERS)
            .map(|w| {
                (0..each)
                    .map(|i| (i * 40_503 % each) * WRITERS + w)
                    .collect()
            })
            .collect();
        let published: Vec<AtomicUsize> = (0..WRITERS).map(|_| AtomicUsize::new(0)).collect();
        let mut seen = vec![0u8; pages as usize];
        let mut rounds = 0;
        std::thread::scope(|s| {
            for (w, mine) in order.iter().enumerate() {
                let (b, published) = (&b, &published);
                s.spawn(move || {
                    for (n, &p) in mine.iter().enumerate() {
                        b.mark(p, 1);
                        published[w].store(n + 1, Ordering::Release);
                    }
                });
            }
            loop {
                let before: Vec<usize> = published
                    .iter()
                    .map(|p| p.load(Ordering::Acquire))
                    .collect();
                let (got, _) = drained(&b);
                for p in got {
                    seen[p as usize] += 1;
                }
                for (w, &n) in before.iter().enumerate() {
                    for &p in &order[w][..n] {
                        assert_eq!(seen[p as usize], 1, "page {p} lost in round {rounds}");
                    }
                }
                rounds += 1;
                if before.iter().all(|&n| n as u64 == each) {
                    break;
                }
            }
        });
        assert!(seen.iter().all(|&n| n == 1));
        assert_eq!(drained(&b), (vec![], 1));
        rounds
    }

    #[test]
    fn concurrent_writers_and_a_drainer_lose_no_page_and_report_each_once() {
        // Small bitmaps (3 levels; the top word is cleared and set again all the time) many
        // times over, then a larger one (4 levels).
        let mut rounds = 0;
        for _ in 0..300 {
            rounds += race(64 * 64 * 4);
        }
        rounds += race(64 * 64 * 64 * 2);
        assert!(
            rounds > 600,
            "the drains ran beside the writers ({rounds} rounds)"
        );
    }
}
