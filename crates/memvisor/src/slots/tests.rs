//! Unit tests of the address index against a plain model, and of the cursor's two ways of
//! working; the table's behaviour through its public API is tested in `tests/slots_model.rs`.

use std::sync::Arc;

use proptest::prelude::*;

use super::index::{Buckets, Entry};
use super::*;
use crate::Backing;
use crate::addr::Gpa;

/// Entries for `(start, len)` slots, which must be sorted and not overlap.
fn entries(slots: &[(u64, u64)]) -> Vec<Entry> {
    slots
        .iter()
        .enumerate()
        .map(|(i, &(start, len))| Entry {
            start,
            last: start + (len - 1),
            delta: 0,
            id: i as SlotId,
            read_only: 0,
        })
        .collect()
}

/// The plainest model: the entry whose bounds hold `gpa`, by looking at every one.
fn model(entries: &[Entry], gpa: u64) -> Option<SlotId> {
    entries
        .iter()
        .find(|e| e.start <= gpa && gpa <= e.last)
        .map(|e| e.id)
}

/// The bucket index, alone and through `Snapshot::find`, against the model at every slot
/// edge (start - 1, start, last, last + 1), at every bucket's first and last address, at
/// both ends of the address space and at `probes`.
fn check(slots: &[(u64, u64)], probes: &[u64]) {
    let entries = entries(slots);
    let buckets = Buckets::build(&entries);
    assert!(buckets.table.len() as u64 <= entries.len() as u64 * Buckets::PER_SLOT);
    let mut addrs = vec![0, u64::MAX];
    addrs.extend_from_slice(probes);
    for e in &entries {
        addrs.extend([e.start, e.last]);
        addrs.extend(e.start.checked_sub(1));
        addrs.extend(e.last.checked_add(1));
    }
    for k in 0..buckets.table.len() as u64 {
        let first = buckets.base + (k << buckets.shift);
        addrs.extend([first, first.saturating_add((1 << buckets.shift) - 1)]);
    }
    let snapshot = Snapshot {
        generation: 0,
        buckets: Buckets::build(&entries),
        entries: entries.clone().into_boxed_slice(),
        slots: Box::new([]),
    };
    for gpa in addrs {
        let want = model(&entries, gpa);
        let got = buckets.find(&entries, gpa).map(|e| e.id);
        assert_eq!(got, want, "bucket index at {gpa:#x}, slots {slots:x?}");
        let got = snapshot.find(Gpa(gpa)).map(|i| entries[i].id);
        assert_eq!(got, want, "Snapshot::find at {gpa:#x}, slots {slots:x?}");
    }
}

/// `(start, len)` slots laid out from `start`, each `gap` after the previous one's end.
fn run(start: u64, sizes: &[u64], gap: u64) -> Vec<(u64, u64)> {
    let mut at = start;
    sizes
        .iter()
        .map(|&len| {
            let slot = (at, len);
            at += len + gap;
            slot
        })
        .collect()
}

#[test]
fn bucket_index_matches_the_model_on_fixed_layouts() {
    const K: u64 = 1 << 10;
    const M: u64 = 1 << 20;
    const G: u64 = 1 << 30;
    check(&[], &[1, 4096]);
    check(&[(0, 4096)], &[]);
    check(&[(1 << 40, 4096)], &[]);
    check(&[(0, u64::MAX)], &[1 << 63]);
    check(&[(1, u64::MAX)], &[1 << 63]);
    check(&[(u64::MAX - 4095, 4096)], &[]);
    check(&[(0, 4096), (u64::MAX - 4095, 4096)], &[1 << 63]);
    // Back to back, power-of-two and other sizes, with and without gaps, from 0 and not.
    for n in [1, 2, 3, 7, 8, 64, 65, 513] {
        for (start, size, gap) in [
            (0, 64 * K, 0),
            (0, 64 * K, 4 * K),
            (12 * K, 3 * 4 * K, 0),
            (G, 5 * M, 7 * M),
        ] {
            check(&run(start, &vec![size; n], gap), &[]);
        }
    }
    // A PC's layout: small slots below 1 MiB and below 4 GiB crowd the buckets a large slot
    // above 4 GiB sizes.
    check(
        &[
            (0, 640 * K),
            (768 * K, 128 * K),
            (M, 2 * G - M),
            (4 * G - 256 * K, 256 * K),
            (4 * G, 62 * G),
        ],
        &[],
    );
    // Many small slots, then one huge one.
    let mut crowded = run(0, &[4096; 100], 4096);
    crowded.push((G, 1 << 50));
    check(&crowded, &[]);
}

/// A table of `n` slots of 64 KiB back to back from 0, and a random address in one of them.
fn table(n: u64) -> (SlotTable, impl FnMut(u64) -> Gpa) {
    let t = SlotTable::new();
    let b = Arc::new(Backing::new(crate::BackingKind::PrivateAnon, n << 16).unwrap());
    for i in 0..n {
        t.insert(SlotSpec::new(i as SlotId, Gpa(i << 16), b.clone()).window(i << 16, 1 << 16))
            .unwrap();
    }
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let addr = move |slot: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        Gpa((slot << 16) + (x & 0xffff))
    };
    (t, addr)
}

fn searching(c: &SlotCursor) -> bool {
    c.adapt.searching()
}

#[test]
fn a_cursor_searches_under_random_addresses_and_remembers_a_thread_that_settles() {
    let (t, mut addr) = table(4);
    let mut c = t.cursor();
    // Each lookup checked against the table's own answer; `None`: a random slot.
    let mut lookups = |c: &mut SlotCursor, slot: Option<u64>, count: u64| {
        for i in 0..count {
            let gpa = addr(slot.unwrap_or(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62));
            assert_eq!(c.lookup(gpa), t.lookup(gpa), "at {gpa:?}");
        }
    };
    lookups(&mut c, None, 200);
    assert!(searching(&c), "200 random addresses over 4 slots");
    // Settling in slot 2: within SEARCH_FOR lookups the cursor tries remembering again, and
    // as they all come from slot 2 it stays.
    lookups(&mut c, Some(2), u64::from(crate::adapt::SEARCH_FOR));
    assert!(!searching(&c));
    assert_eq!((c.hit.id, c.hit_generation), (2, c.generation));
    // A table change while searching: the cursor searches the new snapshot.
    lookups(&mut c, None, 200);
    assert!(searching(&c));
    t.remove(1).unwrap();
    lookups(&mut c, None, 200);
    assert!(searching(&c), "still searching after the change");
    assert_eq!(c.generation, t.generation());
    // Random addresses through a try at remembering: back to searching after it.
    lookups(&mut c, None, u64::from(crate::adapt::SEARCH_FOR) + 200);
    assert!(
        searching(&c),
        "a failed try at remembering ends in a search"
    );
    // 15 hits in 16, the misses anywhere: never searching.
    let mut c = t.cursor();
    for i in 0..20_000u64 {
        lookups(&mut c, Some(if i % 16 == 15 { i / 16 % 4 } else { 0 }), 1);
        assert!(!searching(&c), "searching after {i} lookups, 15 in 16 hits");
    }
}

proptest! {
    #[test]
    fn bucket_index_matches_the_model_on_random_layouts(
        first in prop_oneof![Just(0u64), 0..1u64 << 40, (1u64 << 62)..1u64 << 63],
        slots in prop::collection::vec(
            // (gap before, len), in pages, from tiny to huge.
            (prop_oneof![Just(0u64), 1..16u64, 1..1u64 << 30],
             prop_oneof![1..16u64, 1..1u64 << 30]),
            0..48,
        ),
        probes in prop::collection::vec(any::<u64>(), 16),
    ) {
        let mut at = first;
        let mut layout = Vec::new();
        for (gap, len) in slots {
            at += gap * 4096;
            layout.push((at, len * 4096));
            at += len * 4096;
        }
        check(&layout, &probes);
    }
}
