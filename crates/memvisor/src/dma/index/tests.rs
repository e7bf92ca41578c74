//! The page table against the sorted index: after every change the table holds exactly the
//! words of the small mappings below its window and the huge words of the big mappings' whole
//! granules, no table answer reaches past its mapping, and copies taken on the way do not
//! change. Each property runs with the sorted index converting between its flat and chunked
//! forms (`flat`) at a few mappings as well as at the product's threshold, so both forms and
//! the conversions both ways are held against the same checks.

use super::*;
use crate::addr::{Hva, Iova, Range};
use proptest::prelude::*;

/// What the index is asked to do; `slot`s are 256 pages apart, so mappings never overlap
/// (an insert at a taken slot is skipped).
#[derive(Clone, Debug)]
enum Op {
    /// Map `pages` pages at `slot` (above the page table's window if `high`), with memory
    /// of kind `kind` (0 local, 1 invalidated, 2 remote) at host page `host`.
    Insert {
        slot: u64,
        pages: u64,
        high: bool,
        kind: u8,
        host: u64,
    },
    /// Remap the mapping at or after `slot` to host page `host` (same range).
    Set { slot: u64, host: u64 },
    /// Remove the mapping at or after `slot`.
    Remove { slot: u64 },
    /// Remove `n` mappings from the one at or after `slot`, as an unmap does.
    RemoveRun { slot: u64, n: usize },
    /// Map a big mapping (128 to 2,048 pages, so 0 to 3 whole granules) at big slot `slot`
    /// (16 MiB apart; slot 0 `high` straddles the window's end), `offset` pages into it.
    InsertBig {
        slot: u64,
        offset: u64,
        pages: u64,
        high: bool,
        kind: u8,
        host: u64,
    },
    /// Replace the big mapping at or after big slot `slot` (same range): host page `host`,
    /// memory kind `kind`, logging dirty pages if `dirty`.
    SetBig {
        slot: u64,
        host: u64,
        kind: u8,
        dirty: bool,
    },
    /// Remove the big mapping at or after big slot `slot`.
    RemoveBig { slot: u64 },
    /// Keep a copy: later checks verify it did not change.
    Snapshot,
    /// Drop every mapping (a whole-space IOTLB flush).
    Clear,
}

/// Big slot `slot`'s IOVA: 16 MiB apart, from 8 GiB, or across the window's end if `high`.
fn big_iova(slot: u64, high: bool) -> u64 {
    let base = if high { WINDOW - (6 << 20) } else { 8 << 30 };
    base + slot * (16 << 20)
}

fn op() -> impl Strategy<Value = Op> {
    let slot = 0u64..48;
    prop_oneof![
        6 => (slot.clone(), prop_oneof![4 => 1u64..=3, 1 => Just(TABLE_PAGES_MAX), 1 => Just(200u64)],
              any::<bool>(), 0u8..3, 0u64..1024)
            .prop_map(|(slot, pages, high, kind, host)| Op::Insert {
                slot,
                pages,
                high: high && slot % 4 == 0,
                kind,
                host,
            }),
        1 => (slot.clone(), 0u64..1024).prop_map(|(slot, host)| Op::Set { slot, host }),
        3 => slot.clone().prop_map(|slot| Op::Remove { slot }),
        1 => (slot, 1usize..30).prop_map(|(slot, n)| Op::RemoveRun { slot, n }),
        1 => Just(Op::Snapshot),
        1 => Just(Op::Clear),
        2 => (0u64..6, 0u64..600, 128u64..=2048, any::<bool>(), prop_oneof![4 => Just(0u8), 1 => 1u8..3], 0u64..1024)
            .prop_map(|(slot, offset, pages, high, kind, host)| Op::InsertBig {
                slot,
                offset,
                pages,
                high: high && slot < 2,
                kind,
                host,
            }),
        1 => (0u64..6, 0u64..1024, prop_oneof![3 => Just(0u8), 1 => 1u8..3], any::<bool>())
            .prop_map(|(slot, host, kind, dirty)| Op::SetBig { slot, host, kind, dirty }),
        1 => (0u64..6).prop_map(|slot| Op::RemoveBig { slot }),
    ]
}

/// Makes an `InsertBig` on `index` if its range is free; whether it did.
fn insert_big(index: &mut Index, op: &Op, id: &mut u64) -> bool {
    let Op::InsertBig {
        slot,
        offset,
        pages,
        high,
        kind,
        host,
    } = *op
    else {
        return false;
    };
    let start = big_iova(slot, high) + offset * PAGE;
    let last = start + pages * PAGE - 1;
    let free = index
        .first_ending_at_or_after(start)
        .is_none_or(|p| index.get(p).0 > last);
    if free {
        *id += 1;
        index.insert(mapping(*id, start, pages, kind, host));
    }
    free
}

/// Slot `slot`'s IOVA: slots 256 pages apart, room for the largest mapping inserted (200
/// pages); `high` ones above the page table's window.
fn slot_iova(slot: u64, high: bool) -> u64 {
    let base = if high { WINDOW + (1 << 30) } else { 1 << 30 };
    base + slot * 256 * PAGE
}

fn mapping(id: u64, start: u64, pages: u64, kind: u8, host: u64) -> Mapping {
    let memory = match kind {
        0 => Memory::Local(Host {
            hva: Hva(0x7f00_0000_0000 + host * PAGE),
            owner: None,
        }),
        1 => Memory::Invalidated,
        _ => Memory::Remote,
    };
    Mapping {
        id,
        iova: Range::new("mapping", Iova(start), pages * PAGE).expect("a valid range"),
        prot: if id % 2 == 0 { Prot::RW } else { Prot::READ },
        memory,
        dirty: None,
    }
}

/// Every word the page table must hold, from the sorted index: each page of each small
/// mapping below the window while the table is kept, none otherwise. Checks that the
/// table holds exactly these (each one, and no others: the count), that it is kept as
/// the thresholds say, and that the small-mapping count is right.
/// Applies a `Set`, `Remove` or `RemoveRun` (the ops both properties apply the same way).
fn change(index: &mut Index, op: &Op) -> std::result::Result<(), TestCaseError> {
    match *op {
        Op::Set { slot, host } => {
            if let Some(p) = index.first_ending_at_or_after(slot_iova(slot, false)) {
                let (start, last, _, m) = index.get(p);
                let pages = (last - start) / PAGE + 1;
                let kind = if m.memory.host().is_some() { 0 } else { 2 };
                let m = mapping(m.id, start, pages, kind, host);
                index.set(p, m);
            }
        }
        Op::Remove { slot } => {
            if let Some(p) = index.first_ending_at_or_after(slot_iova(slot, false)) {
                let start = index.get(p).0;
                prop_assert!(index.remove(start).is_some());
            }
        }
        Op::RemoveRun { slot, n } => {
            let from_iova = slot_iova(slot, false);
            let hit: Vec<(u64, Arc<Mapping>)> = index
                .iter()
                .filter(|(s, ..)| *s >= from_iova)
                .take(n)
                .map(|(s, _, _, m)| (s, m.clone()))
                .collect();
            index.remove_all(&hit);
        }
        Op::SetBig {
            slot,
            host,
            kind,
            dirty,
        } => {
            let p = index.first_ending_at_or_after(big_iova(slot, false));
            if let Some(p) = p.filter(|&p| table_pages(index.get(p).0, index.get(p).1).is_none()) {
                let (start, last, _, m) = index.get(p);
                let mut m = mapping(m.id, start, (last - start) / PAGE + 1, kind, host);
                if dirty {
                    m.dirty = Some(Arc::new(crate::bitmap::DirtyBitmap::new(1)));
                }
                index.set(p, m);
            }
        }
        Op::RemoveBig { slot } => {
            let p = index.first_ending_at_or_after(big_iova(slot, false));
            if let Some(p) = p.filter(|&p| table_pages(index.get(p).0, index.get(p).1).is_none()) {
                let start = index.get(p).0;
                prop_assert!(index.remove(start).is_some());
            }
        }
        Op::Clear => index.clear(),
        Op::Insert { .. } | Op::InsertBig { .. } | Op::Snapshot => {}
    }
    Ok(())
}

/// The huge words `index` must hold, from the sorted index, and that every table answer lies
/// in the mapping holding the address, with its hot word: probed at each mapping's edges and
/// granule edges.
fn check_huge(index: &Index) -> std::result::Result<(), TestCaseError> {
    let mut huge = 0;
    for (start, last, hot, _) in index.ranges.iter() {
        let mut probes = vec![start, last, start.wrapping_sub(1), last.wrapping_add(1)];
        if table_pages(start, last).is_none() {
            if let Some((first, granules)) = huge_granules(start, last) {
                for g in 0..granules {
                    let at = first + g * HUGE_SPAN;
                    let answers = hot.valid() && !hot.dirty() && at < WINDOW;
                    huge += u64::from(answers);
                    let want = if answers { hot.0 } else { 0 };
                    prop_assert_eq!(index.pages.huge_word(at), want, "huge word at {:#x}", at);
                    probes.extend([at, at + HUGE_SPAN - 1, at.wrapping_sub(1), at + HUGE_SPAN]);
                }
            }
        }
        for iova in probes {
            for len in [1, PAGE, HUGE_SPAN] {
                let Some((h, s, l)) = word_answer(iova, len, index.pages.word(iova), Prot::READ)
                else {
                    continue;
                };
                let Some(p) = index.find(iova) else {
                    return Err(TestCaseError::fail(format!("answer at unmapped {iova:#x}")));
                };
                let (ms, ml, mh) = index.bounds(p);
                prop_assert!(
                    ms <= s && s <= iova && iova <= l && l <= ml,
                    "answer [{:#x}, {:#x}] for {:#x} in mapping [{:#x}, {:#x}]",
                    s,
                    l,
                    iova,
                    ms,
                    ml
                );
                prop_assert!(
                    len - 1 <= l - iova || !index.pages.word(iova).huge,
                    "a huge word answered an access past its granule at {:#x}",
                    iova
                );
                prop_assert_eq!(h.0, mh.0 & !Hot::LEFT, "hot word at {:#x}", iova);
                prop_assert!(!mh.dirty());
            }
        }
    }
    prop_assert_eq!(index.pages.huge_words(), huge, "huge words held");
    Ok(())
}

fn check(index: &Index, paged: bool) -> std::result::Result<(), TestCaseError> {
    prop_assert_eq!(index.paged, paged, "page table kept");
    let mut small = 0;
    let mut words = 0;
    for (start, last, hot, _) in index.ranges.iter() {
        let Some(pages) = table_pages(start, last) else {
            continue;
        };
        small += 1;
        for k in 0..pages {
            let page = start + k * PAGE;
            let want = if paged && last < WINDOW {
                words += 1;
                hot.0 | (pages - k) << Hot::LEFT_SHIFT
            } else {
                0
            };
            prop_assert_eq!(
                index.pages.get(page),
                want,
                "word of page {:#x} of [{:#x}, {:#x}]",
                page,
                start,
                last
            );
        }
    }
    prop_assert_eq!(index.small, small, "small mappings counted");
    prop_assert_eq!(index.pages.words(), words, "words held");
    check_huge(index)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    /// The page table against the sorted index after every change, on indexes that keep
    /// their table from 4 or 8 small mappings (and drop it below 1 or 2) and on one that
    /// always keeps it; and every copy taken on the way unchanged by later changes.
    #[test]
    fn the_page_table_holds_exactly_the_small_mappings_words(
        ops in proptest::collection::vec(op(), 1..60),
        from in prop_oneof![Just(0u64), Just(4u64), Just(8u64)],
        flat_max in prop_oneof![Just(flat::CAP), Just(1usize), Just(3), Just(8)],
    ) {
        let mut index = Index::with_flat_max(from, flat_max);
        let mut paged = from == 0;
        let mut id = 0;
        let mut snapshots = Vec::new();
        for op in ops {
            match op {
                Op::Insert { slot, pages, high, kind, host } => {
                    let start = slot_iova(slot, high);
                    let last = start + pages * PAGE - 1;
                    let free = index.first_ending_at_or_after(start)
                        .is_none_or(|p| index.get(p).0 > last);
                    if free {
                        id += 1;
                        index.insert(mapping(id, start, pages, kind, host));
                        if !paged && table_pages(start, last).is_some() {
                            paged = index.small >= from;
                        }
                    }
                }
                Op::InsertBig { .. } => {
                    insert_big(&mut index, &op, &mut id);
                }
                Op::Set { .. } | Op::Remove { .. } | Op::RemoveRun { .. } | Op::SetBig { .. }
                | Op::RemoveBig { .. } => change(&mut index, &op)?,
                Op::Clear => {
                    change(&mut index, &op)?;
                    paged = from == 0;
                }
                Op::Snapshot => {
                    index.reindex();
                    snapshots.push((index.clone(), paged));
                }
            }
            if paged && index.small * 4 < from {
                paged = false;
            }
            check(&index, paged)?;
        }
        for (snap, paged) in &snapshots {
            check(snap, *paged)?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
    /// Two copies taking turns as the writer's working copy and spare (`publish`): each change
    /// is made to one copy, its log replayed on the other, and the two then hold the same
    /// mappings (the same records), the same page-table words and the same counts; clones
    /// taken on the way (the snapshots readers hold) are unchanged by the in-place edits.
    #[test]
    fn a_replayed_log_makes_the_spare_equal_to_the_copy_it_was_taken_from(
        ops in proptest::collection::vec(op(), 1..60),
        from in prop_oneof![Just(0u64), Just(4u64), Just(8u64)],
        turns in proptest::collection::vec(any::<bool>(), 60),
        flat_max in prop_oneof![Just(flat::CAP), Just(1usize), Just(3), Just(8)],
    ) {
        let mut copies = [Index::with_flat_max(from, flat_max), Index::with_flat_max(from, flat_max)];
        let mut id = 0;
        let mut held = Vec::new();
        let mut flat_seen = true;
        for (k, op) in ops.into_iter().enumerate() {
            // Which copy is edited this time: usually the other one (they take turns), and
            // sometimes a clone of the current one (a reader held the spare).
            let edit = k % 2;
            if turns[k] {
                copies[edit] = copies[1 - edit].clone();
            }
            let index = &mut copies[edit];
            match op {
                Op::Insert { slot, pages, high, kind, host } => {
                    let start = slot_iova(slot, high);
                    let last = start + pages * PAGE - 1;
                    if index.first_ending_at_or_after(start).is_none_or(|p| index.get(p).0 > last) {
                        id += 1;
                        index.insert(mapping(id, start, pages, kind, host));
                    }
                }
                Op::InsertBig { .. } => {
                    insert_big(index, &op, &mut id);
                }
                Op::Set { .. } | Op::Remove { .. } | Op::RemoveRun { .. } | Op::SetBig { .. }
                | Op::RemoveBig { .. } | Op::Clear => change(index, &op)?,
                Op::Snapshot => {
                    index.reindex();
                    let seen = words(index);
                    held.push((index.clone(), seen));
                }
            }
            index.reindex();
            let log = copies[edit].take_log();
            copies[1 - edit].replay(log);
            copies[1 - edit].reindex();
            prop_assert!(copies[edit].log.is_empty() && copies[1 - edit].log.is_empty());
            prop_assert_eq!(words(&copies[0]), words(&copies[1]), "after change {}", k);
            prop_assert_eq!(copies[0].ranges.is_flat(), copies[1].ranges.is_flat());
            prop_assert_eq!(
                copies[0].ranges.is_flat(),
                copies[0].len() <= flat_max / 2 || (copies[0].len() <= flat_max && flat_seen),
                "form at {} mappings", copies[0].len()
            );
            flat_seen = copies[0].ranges.is_flat();
            prop_assert_eq!(
                (copies[0].small, copies[0].paged, copies[0].big),
                (copies[1].small, copies[1].paged, copies[1].big)
            );
            check(&copies[1 - edit], copies[edit].paged)?;
        }
        for (snap, seen) in &held {
            prop_assert_eq!(&words(snap), seen, "a held copy changed");
        }
    }
}

/// Every entry of `index` (start, last, hot word, record address) with the page-table word of
/// each of its pages.
fn words(index: &Index) -> Vec<(u64, u64, u64, usize, Vec<u64>)> {
    index
        .ranges
        .iter()
        .map(|(s, l, h, m)| {
            let pages = ((l - s) / PAGE + 1).min(TABLE_PAGES_MAX + 1);
            let mut w: Vec<u64> = (0..pages).map(|k| index.pages.get(s + k * PAGE)).collect();
            // And the huge words of its granules.
            let granules = (l / HUGE_SPAN).saturating_sub(s / HUGE_SPAN) + 1;
            w.extend((0..granules.min(8)).map(|g| index.pages.huge_word(s + g * HUGE_SPAN)));
            (s, l, h.0, Arc::as_ptr(m) as usize, w)
        })
        .collect()
}
