//! Dirty bitmaps: one bit per page, set by writers without locks, read-and-cleared by migration.
//!
//! A [`DirtyBitmap`] covers a fixed number of pages. Writers mark a run of pages with one atomic
//! OR per 64-bit word the run touches (not one atomic per page), so a 1 MiB write costs four
//! atomics at 4 KiB granularity. [`DirtyBitmap::take`] swaps each word with zero, so a page
//! written concurrently with a take is reported either by this take or by the next one — never
//! lost. The layout (bit `i` of word `i / 64` is page `i`) is the one KVM's `KVM_GET_DIRTY_LOG`
//! and VFIO's `VFIO_IOMMU_DIRTY_PAGES` return, so a VMM can pass the words straight on.
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

/// One bit per page, lock-free to set, atomically read-and-cleared.
#[derive(Debug)]
pub struct DirtyBitmap {
    words: Box<[AtomicU64]>,
    pages: u64,
}

impl DirtyBitmap {
    /// A clear bitmap for `pages` pages.
    pub fn new(pages: u64) -> Self {
        let words = pages.div_ceil(64) as usize;
        DirtyBitmap {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            pages,
        }
    }

    /// A clear bitmap for `pages` pages, or `None` if its memory cannot be had (the caller
    /// answers ENOMEM, as the kernel does when a dirty bitmap cannot be allocated).
    pub fn try_new(pages: u64) -> Option<Self> {
        let words = usize::try_from(pages.div_ceil(64)).ok()?;
        let mut v: Vec<AtomicU64> = Vec::new();
        v.try_reserve_exact(words).ok()?;
        v.extend((0..words).map(|_| AtomicU64::new(0)));
        Some(DirtyBitmap {
            words: v.into_boxed_slice(),
            pages,
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

    /// Marks pages `first .. first + count` dirty; the part past the end is ignored.
    pub fn mark(&self, first: u64, count: u64) {
        let end = first.saturating_add(count).min(self.pages);
        let mut page = first;
        while page < end {
            let word = page / 64;
            let bit = page % 64;
            let n = (64 - bit).min(end - page);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            self.words[word as usize].fetch_or(mask, Ordering::Relaxed);
            page += n;
        }
    }

    /// Whether page `page` is marked.
    pub fn is_marked(&self, page: u64) -> bool {
        page < self.pages
            && self.words[(page / 64) as usize].load(Ordering::Relaxed) >> (page % 64) & 1 == 1
    }

    /// Returns the bitmap and clears it, word by word, atomically per word. A word that reads
    /// clean is not written: a plain load costs a fraction of an atomic swap, and most of a
    /// large guest's bitmap is clean at every read. A bit set between the load and the next
    /// word's is not lost; it stays for the next call.
    pub fn take(&self) -> Vec<u64> {
        self.words
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
}
