//! IOTLB misses asked for together: every page a request still needs, in one go.
//!
//! **Model.** Behind a vIOMMU a request's buffers are IOVAs. When the device space cannot
//! translate some of them, the back end asks the frontend with `IOTLB_MSG` MISS messages on the
//! back-end channel and the frontend answers each with an UPDATE on the front channel. The
//! vhost-user specification lets a back end have several misses outstanding (each MISS is a
//! message of its own; nothing ties an UPDATE to the MISS before it). So instead of asking for
//! the first unmapped page, waiting a round trip, retrying and missing on the next page (64
//! round trips one after another for a 256 KiB buffer of 4 KiB IOMMU pages), a device collects
//! the unmapped pages of the whole chain ([`misses_in`], up to [`MAX_MISSES`]) and the back end
//! sends them together, then retries the ring once updates covered every page it waits for.
//!
//! [`Asked`] is the back end's record of what it asked for and no UPDATE has covered yet, at
//! 4 KiB page granularity (the smallest IOMMU page; an UPDATE for a larger page covers several
//! entries at once): a page already asked for is not asked again — unless a write is needed now
//! and only a read was asked. An UPDATE over a page counts as the answer whatever permission it
//! grants (a guest that maps a buffer read-only has answered; the retry then fails the request
//! with the permission error, as before). A page whose answer never came is forgotten when the
//! ring's wait ends ([`Asked::forget`]), so a later request may ask again.

use std::collections::BTreeMap;

use memvisor::dma::Miss;
use memvisor::{DmaMemory, Iova, PAGE_4K, Prot};

/// At most this many pages are asked for per request (4 MiB of 4 KiB pages, 44 KiB of MISS
/// messages, well inside a Unix socket's buffer); the rest are asked for on the retry.
pub const MAX_MISSES: usize = 1024;

/// The page (4 KiB) an IOVA is in.
pub fn page_of(iova: u64) -> u64 {
    iova & !(PAGE_4K - 1)
}

/// Appends to `out` one miss per unmapped 4 KiB page of `[iova, iova + len)` for `access`,
/// in order, until `out` holds [`MAX_MISSES`]. Stops at the first byte that fails for another
/// reason (a permission: no update can fix that by asking) or at a range that wraps.
pub fn misses_in(mem: &DmaMemory, iova: u64, len: u64, access: Prot, out: &mut Vec<Miss>) {
    let Some(end) = iova.checked_add(len) else {
        return;
    };
    let mut at = iova;
    while at < end && out.len() < MAX_MISSES {
        if mem.check(Iova(at), end - at, access).is_ok() {
            return;
        }
        let Some(m) = mem.take_miss() else {
            return;
        };
        out.push(m);
        // Past the page that missed: the next check finds the next unmapped page, if any.
        match page_of(m.iova.0).checked_add(PAGE_4K) {
            Some(next) => at = next,
            None => return,
        }
    }
}

/// The first `limit` pages of `misses`, one miss each, in order of first appearance: the
/// first miss of the page, made a write if any miss of the page is one.
pub fn one_per_page(misses: &[Miss], limit: usize) -> Vec<Miss> {
    let mut out: Vec<Miss> = Vec::new();
    // Page -> its place in `out` (up to MAX_MISSES pages: a map, not a scan of `out`).
    let mut at: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    for m in misses {
        let page = page_of(m.iova.0);
        match at.get(&page) {
            Some(&k) if m.access == Prot::WRITE => out[k].access = Prot::WRITE,
            Some(_) => {}
            None if out.len() < limit => {
                at.insert(page, out.len());
                out.push(*m);
            }
            None => {}
        }
    }
    out
}

/// Pages asked for and not yet covered by an UPDATE: page -> whether write access was asked.
#[derive(Default, Debug)]
pub struct Asked {
    pages: BTreeMap<u64, bool>,
}

impl Asked {
    /// Whether `miss` needs a MISS message: its page was not asked for, or only for reading
    /// and it needs writing. Records it as asked.
    pub fn ask(&mut self, miss: &Miss) -> bool {
        let write = miss.access == Prot::WRITE;
        let page = page_of(miss.iova.0);
        match self.pages.get(&page) {
            Some(&asked_write) if asked_write || !write => false,
            _ => {
                self.pages.insert(page, write);
                true
            }
        }
    }

    /// An UPDATE of `[iova, iova + size)` arrived: the pages it covers are answered.
    pub fn covered(&mut self, iova: u64, size: u64) {
        for page in covered_pages(&self.pages, iova, size) {
            self.pages.remove(&page);
        }
    }

    /// Forgets `pages` (their wait ended without an answer).
    pub fn forget(&mut self, pages: &[u64]) {
        for p in pages {
            self.pages.remove(p);
        }
    }

    /// Forgets everything (the frontend left, or reset the device).
    pub fn clear(&mut self) {
        self.pages.clear();
    }

    /// Pages asked for and not answered.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether nothing is outstanding.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }
}

/// Whether `page` lies in `[iova, iova + size)` (a page an UPDATE covers; a size of 0 covers
/// nothing, a range running past the top of the space covers to the top).
pub fn covers(iova: u64, size: u64, page: u64) -> bool {
    size > 0 && page >= page_of(iova) && page - iova.min(page) < size
}

fn covered_pages(pages: &BTreeMap<u64, bool>, iova: u64, size: u64) -> Vec<u64> {
    if size == 0 {
        return Vec::new();
    }
    let last = iova.saturating_add(size - 1);
    pages
        .range(page_of(iova)..=last)
        .map(|(&p, _)| p)
        .filter(|&p| covers(iova, size, p))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use memvisor::{Backing, BackingKind, DmaConfig, DmaSpace, Prot};
    use std::sync::Arc;

    fn miss(iova: u64, access: Prot) -> Miss {
        Miss {
            iova: Iova(iova),
            access,
        }
    }

    /// A 64 KiB range with pages 1, 2, 5 and 15 mapped: every other page is one miss, in
    /// order; a write needs writable pages, a read-only mapping is no miss but ends the walk.
    #[test]
    fn one_miss_per_unmapped_page_in_order() {
        let space = DmaSpace::new(DmaConfig::default()).unwrap();
        let memory = Arc::new(Backing::new(BackingKind::Memfd, 16 * PAGE_4K).unwrap());
        for p in [1, 2, 5, 15] {
            space
                .map_backing(Iova(p * PAGE_4K), &memory, p * PAGE_4K, PAGE_4K, Prot::RW)
                .unwrap();
        }
        let mem = space.memory();
        let mut out = Vec::new();
        // From the middle of page 0 to the middle of page 15.
        misses_in(&mem, 100, 15 * PAGE_4K, Prot::READ, &mut out);
        let pages: Vec<u64> = out.iter().map(|m| m.iova.0 / PAGE_4K).collect();
        assert_eq!(pages, [0, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14]);
        assert_eq!(out[0].iova.0, 100, "the first miss names the first byte");
        assert!(out.iter().all(|m| m.access == Prot::READ));
        assert_eq!(mem.take_miss(), None, "nothing left behind in the view");

        // All mapped: no miss. A range past the top of the space: none either.
        out.clear();
        misses_in(&mem, PAGE_4K, 2 * PAGE_4K, Prot::WRITE, &mut out);
        misses_in(&mem, u64::MAX - 10, 100, Prot::READ, &mut out);
        assert!(out.is_empty(), "{out:?}");

        // Page 7 read-only: a write walk asks for 6, then stops at 7 (no update fixes that).
        space
            .map_backing(Iova(7 * PAGE_4K), &memory, 7 * PAGE_4K, PAGE_4K, Prot::READ)
            .unwrap();
        let mem = space.memory();
        misses_in(&mem, 5 * PAGE_4K, 4 * PAGE_4K, Prot::WRITE, &mut out);
        assert_eq!(out, [miss(6 * PAGE_4K, Prot::WRITE)]);
    }

    /// A huge buffer asks for at most MAX_MISSES pages at a time.
    #[test]
    fn a_huge_buffer_asks_for_a_bounded_number() {
        let space = DmaSpace::new(DmaConfig::default()).unwrap();
        let mem = space.memory();
        let mut out = Vec::new();
        misses_in(&mem, 0, 1 << 40, Prot::READ, &mut out);
        assert_eq!(out.len(), MAX_MISSES);
        assert_eq!(
            out.last().unwrap().iova.0,
            (MAX_MISSES as u64 - 1) * PAGE_4K
        );
    }

    #[test]
    fn each_page_is_asked_once_until_answered() {
        let mut asked = Asked::default();
        assert!(asked.ask(&miss(0x1000, Prot::READ)));
        assert!(!asked.ask(&miss(0x1800, Prot::READ)), "same page");
        assert!(asked.ask(&miss(0x1000, Prot::WRITE)), "a write is more");
        assert!(!asked.ask(&miss(0x1004, Prot::READ)), "write covers read");
        assert!(asked.ask(&miss(0x3000, Prot::READ)));
        assert!(asked.ask(&miss(0x5000, Prot::WRITE)));
        assert_eq!(asked.len(), 3);
        // An update of 0x1800..0x3001 covers pages 0x1000 (partly), 0x2000 and 0x3000.
        asked.covered(0x1800, 0x1801);
        assert_eq!(asked.len(), 1);
        assert!(
            asked.ask(&miss(0x1000, Prot::READ)),
            "answered: may ask again"
        );
        // A size of 0 covers nothing; a range to the top of the space covers to the top.
        asked.covered(0x5000, 0);
        assert_eq!(asked.len(), 2);
        asked.covered(0x4fff, u64::MAX);
        assert_eq!(asked.len(), 1);
        asked.forget(&[0x1000]);
        assert!(asked.is_empty());
        assert!(asked.ask(&miss(u64::MAX, Prot::READ)));
        asked.covered(u64::MAX - 0xfff, 0x1000);
        assert!(asked.is_empty());
    }

    #[test]
    fn one_miss_per_page_the_stronger_access() {
        let ms = [
            miss(0x1000, Prot::READ),
            miss(0x1128, Prot::WRITE),
            miss(0x3000, Prot::READ),
            miss(0x1f00, Prot::READ),
            miss(0x5000, Prot::WRITE),
        ];
        assert_eq!(
            one_per_page(&ms, 10),
            [
                miss(0x1000, Prot::WRITE),
                miss(0x3000, Prot::READ),
                miss(0x5000, Prot::WRITE)
            ]
        );
        assert_eq!(
            one_per_page(&ms, 1),
            [miss(0x1000, Prot::WRITE)],
            "the limit counts pages"
        );
    }

    #[test]
    fn covers_is_exact_at_the_edges() {
        assert!(covers(0x1000, 0x1000, 0x1000));
        assert!(!covers(0x1000, 0x1000, 0x2000));
        assert!(covers(0x1fff, 1, 0x1000), "a byte of the page covers it");
        assert!(!covers(0x1000, 0, 0x1000));
        assert!(!covers(0x3000, 0x1000, 0x2000));
        assert!(covers(0, u64::MAX, !0xfff));
    }
}
