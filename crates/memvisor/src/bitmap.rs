//! Dirty bitmaps: one bit per page, set by writers without locks, read-and-cleared by migration.
//!
//! A [`DirtyBitmap`] covers a fixed number of pages. Writers mark a run of pages with one atomic
//! OR per 64-bit word the run touches (not one atomic per page), so a 1 MiB write costs four
//! atomics at 4 KiB granularity. [`DirtyBitmap::take`] swaps each word with zero, so a page
//! written concurrently with a take is reported either by this take or by the next one — never
//! lost. The layout (bit `i` of word `i / 64` is page `i`) is the one KVM's `KVM_GET_DIRTY_LOG`
//! and VFIO's `VFIO_IOMMU_DIRTY_PAGES` return, so a VMM can pass the words straight on.

use std::sync::atomic::{AtomicU64, Ordering};

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

    /// Returns the bitmap and clears it, word by word, atomically per word.
    pub fn take(&self) -> Vec<u64> {
        self.words
            .iter()
            .map(|w| w.swap(0, Ordering::Relaxed))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
