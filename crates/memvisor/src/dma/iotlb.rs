//! IOTLB invalidation: removing the translations of any range, cutting mappings at its edges.
//!
//! type1 unmaps whole mappings only (a range that cuts one is EINVAL): a VFIO user maps and
//! unmaps the same ranges. An IOTLB is different — vhost's `VHOST_IOTLB_INVALIDATE`, a vIOMMU's
//! page-selective invalidation — the guest's IOMMU driver maps a 2 MiB buffer and may invalidate
//! 4 KiB of it, or invalidate the whole address space at once (lazy mode) across thousands of
//! entries. [`DmaSpace::invalidate_range`] gives a space that semantic: every translation inside
//! the range goes, and a mapping that reaches past an edge is replaced by its part outside, with
//! the same host memory, protection and dirty bits, in the same published step — a device never
//! sees the outside part unmapped.
//!
//! An update is [`DmaSpace::iotlb_map`]: whatever the range held goes, and the new entry is
//! made, as one step. A guest hands out IOVAs it invalidated, so the range is nearly always
//! empty: the update then takes the writer lock once, looks the range up once on the writer's
//! spare copy (the search that finds it empty also finds where the entry goes) and inserts
//! there, in place (`publish`) — no invalidation, no second trip through the lock, no vector.
//! Only a range that still holds something goes the long way, an invalidation (which waits for
//! devices as below) and then the insert.
//!
//! The range is closed to devices at once, and the invalidation returns only once copies in
//! flight there ended and pins devices held there were released, asked back through the unmap
//! notifiers (`retire`): a device must never reach memory through a translation the guest took
//! away. Pins in the parts kept stay where they are. A device that keeps its pins in the range
//! past [`DmaConfig::unpin_wait`](super::DmaConfig::unpin_wait) gets the invalidation undone
//! (EBUSY, nothing changed). In Eager mode the remaining parts are pinned before the removed
//! ones are unpinned, so no page the space keeps is unlocked in between.

use std::sync::Arc;

use super::index::Index;
use super::{DmaSpace, Host, Mapping, Memory, NewMapping, OnOverlap, Prot};
use crate::addr::{Hva, Iova, Range};
use crate::backing::Backing;
use crate::error::Result;

impl DmaSpace {
    /// An IOTLB update: `[iova, iova + size)` maps `size` bytes of `backing` from `offset`
    /// with `prot`, after whatever the range held was removed (as [`DmaSpace::invalidate_range`]
    /// removes it, waiting for devices). One step under the writer lock when the range is empty
    /// (see the module documentation). Errors as [`DmaSpace::map_backing`]'s (EINVAL for a bad
    /// range or window, ENOSPC when the space is full: nothing changed then), and EBUSY from
    /// the invalidation.
    pub fn iotlb_map(
        &self,
        iova: Iova,
        backing: &Arc<Backing>,
        offset: u64,
        size: u64,
        prot: Prot,
    ) -> Result<()> {
        let range = self.check_new_range(iova, size, prot)?;
        let host = self.backing_host(backing, offset, size)?;
        let mut new = [NewMapping {
            iova: range,
            memory: Memory::Local(host),
        }];
        let writer = self.settled_writer()?;
        // An empty range (nearly always): inserted in one step, with one search for the check
        // and the place. Else nothing changed, and the range is emptied first.
        if self.insert_with(writer, range, prot, &mut new, OnOverlap::Report)? {
            return Ok(());
        }
        self.invalidate_range(iova, size)?;
        self.insert(range, prot, &mut new)
    }

    /// Removes every translation in `[iova, iova + size)` (IOTLB semantics, see the module
    /// documentation); returns the bytes removed (0 if nothing was mapped there). EINVAL if the
    /// range is empty, wraps or is not page aligned; EBUSY, nothing changed, if devices keep
    /// pins in the range past [`DmaConfig::unpin_wait`](super::DmaConfig::unpin_wait).
    pub fn invalidate_range(&self, iova: Iova, size: u64) -> Result<u64> {
        let range = self.check_range(iova, size)?;
        let (first, last) = (range.start().0, range.last().0);
        let page = self.shared.min_page;
        let (bytes, ()) = self.retire(
            |map| {
                map.first_ending_at_or_after(first)
                    .is_some_and(|p| map.bounds(p).0 <= last)
            },
            |map, writer| {
                // The writer's vectors, for their capacity: an invalidation allocates nothing.
                // With none touched, `retire` gives them back.
                let mut plan = std::mem::take(&mut writer.scratch);
                touched_into(map, first, last, &mut plan.old);
                if plan.old.is_empty() {
                    return Ok(plan);
                }
                // Only the first mapping can start before the range, only the last end after it.
                let mut keep: [Option<Mapping>; 2] = [None, None];
                if let (Some((start, m)), Some((_, end_m))) = (plan.old.first(), plan.old.last()) {
                    if *start < first {
                        keep[0] = Some(piece(m, *start, first - 1, writer.next_id, page)?);
                        writer.next_id += 1;
                    }
                    let end = end_m.iova.last().0;
                    if end > last {
                        keep[1] = Some(piece(end_m, last + 1, end, writer.next_id, page)?);
                        writer.next_id += 1;
                    }
                }
                if writer.mode == super::PinMode::Eager {
                    let kept = keep.iter().flatten();
                    let pinned = self.pin_all(kept.filter(|m| m.memory.host().is_some()))?;
                    writer.eager.extend(pinned);
                }
                writer.invalid -= (plan.old.iter())
                    .filter(|(_, m)| m.memory.is_invalidated())
                    .count() as u64;
                writer.invalid += keep
                    .iter()
                    .flatten()
                    .filter(|m| m.memory.is_invalidated())
                    .count() as u64;
                let ranges =
                    (plan.old.iter()).map(|(s, m)| ((*s).max(first), m.iova.last().0.min(last)));
                plan.ranges.extend(ranges);
                plan.made.extend(keep.iter().flatten().map(|m| m.id));
                map.remove_all(&plan.old);
                for m in keep.into_iter().flatten() {
                    map.insert(m);
                }
                Ok(plan)
            },
            |_, _| {},
        )?;
        Ok(bytes)
    }
}

/// Appends to `out` every whole mapping that `[first, last]` touches, as (start, mapping), in
/// address order: one lookup and a walk (the span of those mappings holds no others).
fn touched_into(map: &Index, first: u64, last: u64, out: &mut Vec<(u64, Arc<Mapping>)>) {
    let mut pos = map.first_ending_at_or_after(first);
    while let Some(p) = pos {
        let (start, _, _, m) = map.get(p);
        if start > last {
            break;
        }
        out.push((start, m.clone()));
        pos = map.next(p);
    }
}

/// The part `[from, to]` of `m` as a new mapping with id `id` (dirty bits per `page` bytes): same host memory at the same
/// offset, same protection, the same dirty bits for its pages.
fn piece(m: &Arc<Mapping>, from: u64, to: u64, id: u64, page: u64) -> Result<Mapping> {
    let start = m.iova.start().0;
    let iova = Range::new("dma mapping", Iova(from), to - from + 1)?;
    let memory = match &m.memory {
        Memory::Local(h) => Memory::Local(Host {
            hva: Hva(h.hva.0 + (from - start)),
            owner: h.owner.clone(),
        }),
        other => other.clone(),
    };
    let dirty = m.dirty.as_ref().map(|old| {
        // Bits count IOVA pages from the page of each mapping's first byte (`dirty_pages`).
        let pages = super::dirty_pages(iova, page);
        let b = crate::bitmap::DirtyBitmap::new(pages);
        let skip = from / page - start / page;
        for p in 0..pages {
            if old.is_marked(skip + p) {
                b.mark(p, 1);
            }
        }
        Arc::new(b)
    });
    Ok(Mapping {
        id,
        iova,
        prot: m.prot,
        memory,
        dirty,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::PAGE_4K as PAGE;
    use crate::backing::BackingKind;
    use crate::dma::{SgBuf, SgWalk};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    /// Four readers translate (the space's miss path, a cursor) and hold pages (a walk that
    /// keeps its guard a while) at random while the writer churns IOTLB updates and
    /// invalidations, as a strict-mode guest does, up to 10^6 of them or a few seconds: every
    /// answer is the one host address its page is ever mapped to, so an answer read from a
    /// snapshot freed, or edited in place, under a reader shows; and every change returns.
    /// Between requests a reader does other work, as a device thread does (a writer waits for
    /// readers announced on the snapshot it replaces, `current`: readers that never leave
    /// their reads could hold it up on a loaded machine).
    #[test]
    fn readers_see_only_right_answers_while_a_million_iotlb_changes_churn() {
        const PAGES: u64 = 64;
        const CHANGES: u64 = 1_000_000;
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, PAGES * PAGE).unwrap());
        let d = DmaSpace::new(crate::dma::DmaConfig {
            page_table_from: 0,
            // A reader descheduled while it holds a page must not fail the writer (EBUSY).
            unpin_wait: Duration::from_secs(60),
            ..crate::dma::DmaConfig::default()
        })
        .unwrap();
        // Page p of the IOVA space is only ever mapped to page PAGES - 1 - p of the backing.
        let host = |p: u64| b.hva().0 + (PAGES - 1 - p) * PAGE;
        let stop = AtomicBool::new(false);
        let answers = AtomicU64::new(0);
        let deadline =
            Instant::now() + Duration::from_secs(if cfg!(debug_assertions) { 4 } else { 2 });
        let mut changes = 0u64;
        std::thread::scope(|s| {
            for r in 0..4u64 {
                let (d, stop, answers, host) = (&d, &stop, &answers, &host);
                s.spawn(move || {
                    let mut cursor = d.cursor();
                    let mut x = r * 7 + 1;
                    let mut seen = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        // The rest of a request, outside any read.
                        for _ in 0..200 {
                            std::hint::spin_loop();
                        }
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let p = (x >> 33) % PAGES;
                        let off = ((x >> 20) % PAGE) & !7;
                        let iova = Iova(p * PAGE + off);
                        if let Ok(t) = d.translate(iova, 8, Prot::READ) {
                            assert_eq!(t.hva.0, host(p) + off, "translate of page {p}");
                            seen += 1;
                        }
                        cursor.refresh();
                        if let Ok(t) = cursor.translate(iova, 8, Prot::WRITE) {
                            assert_eq!(t.hva.0, host(p) + off, "cursor on page {p}");
                            seen += 1;
                        }
                        if x & 3 == 0 {
                            let buf = SgBuf {
                                iova: Iova(p * PAGE),
                                len: PAGE,
                                prot: Prot::READ,
                            };
                            if let Ok(SgWalk::Held(g)) = d.hold_sg(&[buf]) {
                                // Held: the page stays mapped until the guard goes.
                                for _ in 0..(x >> 40) % 64 {
                                    std::hint::spin_loop();
                                }
                                assert_eq!(g.segments()[0].hva.0, host(p), "walk of page {p}");
                                seen += 1;
                            }
                        }
                    }
                    answers.fetch_add(seen, Ordering::Relaxed);
                });
            }
            // Stops the readers however the writer ends, a failed assertion included.
            struct Stop<'a>(&'a AtomicBool);
            impl Drop for Stop<'_> {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                }
            }
            let _stop = Stop(&stop);
            let mut x = 99u64;
            while changes < CHANGES && (changes % 1024 != 0 || Instant::now() < deadline) {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                let p = (x >> 33) % PAGES;
                if x & (1 << 20) != 0 {
                    d.iotlb_map(Iova(p * PAGE), &b, (PAGES - 1 - p) * PAGE, PAGE, Prot::RW)
                        .unwrap();
                } else {
                    let n = 1 + (x >> 40) % 4;
                    d.invalidate_range(Iova(p * PAGE), n * PAGE).unwrap();
                }
                changes += 1;
            }
        });
        eprintln!(
            "{changes} IOTLB changes, {} right answers read meanwhile",
            answers.load(Ordering::Relaxed)
        );
        assert!(changes >= 1_000, "only {changes} changes");
        assert!(answers.load(Ordering::Relaxed) > 0);
        assert_eq!(d.guard_held_pages(), 0);
    }
}
