//! The slot table's rules (every EINVAL / EEXIST / ENOENT / EFAULT case), cross-slot access,
//! dirty logging and cursor correctness after changes.

use std::sync::Arc;

use memvisor::slots::DEFAULT_MAX_SLOTS;
use memvisor::{Backing, BackingKind, Gpa, SlotFlags, SlotSpec, SlotTable};

const PAGE: u64 = 0x1000;

fn anon(size: u64) -> Arc<Backing> {
    Arc::new(Backing::new(BackingKind::PrivateAnon, size).unwrap())
}

fn errno<T: std::fmt::Debug>(r: memvisor::Result<T>) -> i32 {
    r.unwrap_err().errno()
}

#[test]
fn insert_rejects_bad_geometry_with_einval() {
    let t = SlotTable::new();
    let b = anon(4 * PAGE);
    // zero size
    assert_eq!(
        errno(t.insert(SlotSpec::new(0, Gpa(0), b.clone()).window(0, 0))),
        libc::EINVAL
    );
    // misaligned guest address, size, offset
    assert_eq!(
        errno(t.insert(SlotSpec::new(0, Gpa(0x800), b.clone()))),
        libc::EINVAL
    );
    assert_eq!(
        errno(t.insert(SlotSpec::new(0, Gpa(0), b.clone()).window(0, 0x1800))),
        libc::EINVAL
    );
    assert_eq!(
        errno(t.insert(SlotSpec::new(0, Gpa(0), b.clone()).window(0x10, PAGE))),
        libc::EINVAL
    );
    // window past the backing's end, including an offset that would overflow
    let e = t
        .insert(SlotSpec::new(0, Gpa(0), b.clone()).window(PAGE, 4 * PAGE))
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(
        e.to_string().contains("0x4000"),
        "message names the limit: {e}"
    );
    assert_eq!(
        errno(t.insert(SlotSpec::new(0, Gpa(0), b.clone()).window(u64::MAX - 0xfff, PAGE))),
        libc::EINVAL
    );
    // guest range wrapping past the top of the address space
    let e = t
        .insert(SlotSpec::new(0, Gpa(u64::MAX - 0xfff), b.clone()))
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("wraps"), "{e}");
    // id beyond the limit
    let e = t
        .insert(SlotSpec::new(DEFAULT_MAX_SLOTS, Gpa(0), b.clone()))
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("32764"), "{e}");
    // nothing was installed by any of these
    assert!(t.snapshot().is_empty());
    assert_eq!(t.snapshot().generation(), 0);
}

#[test]
fn slot_may_end_at_the_top_of_the_guest_address_space() {
    let t = SlotTable::new();
    let b = anon(PAGE);
    t.insert(SlotSpec::new(0, Gpa(u64::MAX - 0xfff), b.clone()))
        .unwrap();
    let tr = t.lookup(Gpa(u64::MAX)).unwrap();
    assert_eq!(tr.len, 1);
    assert_eq!(tr.hva.0, b.hva().0 + 0xfff);
    t.write(Gpa(u64::MAX - 1), &[7, 8]).unwrap();
    let mut out = [0; 2];
    t.read(Gpa(u64::MAX - 1), &mut out).unwrap();
    assert_eq!(out, [7, 8]);
    // one byte past the top cannot be addressed: EFAULT, nothing copied
    assert_eq!(errno(t.write(Gpa(u64::MAX), &[1, 2])), libc::EFAULT);
    t.read(Gpa(u64::MAX), &mut out[..1]).unwrap();
    assert_eq!(out[0], 8);
}

#[test]
fn overlaps_and_duplicate_ids_are_eexist() {
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0x10_0000), anon(4 * PAGE)))
        .unwrap();
    for gpa in [0x10_0000 - PAGE, 0x10_0000, 0x10_3000] {
        let e = t
            .insert(SlotSpec::new(1, Gpa(gpa), anon(2 * PAGE)))
            .unwrap_err();
        assert_eq!(e.errno(), libc::EEXIST, "gpa {gpa:#x}");
        assert!(e.to_string().contains("slot 0"), "{e}");
    }
    // a range that swallows the existing one entirely
    assert_eq!(
        errno(t.insert(SlotSpec::new(1, Gpa(0), anon(0x20_0000)))),
        libc::EEXIST
    );
    // adjacent on both sides is fine
    t.insert(SlotSpec::new(1, Gpa(0x10_0000 - PAGE), anon(PAGE)))
        .unwrap();
    t.insert(SlotSpec::new(2, Gpa(0x10_4000), anon(PAGE)))
        .unwrap();
    // duplicate id at a free address
    assert_eq!(
        errno(t.insert(SlotSpec::new(2, Gpa(0x80_0000), anon(PAGE)))),
        libc::EEXIST
    );
    assert_eq!(t.snapshot().len(), 3);
}

#[test]
fn unknown_ids_are_enoent() {
    let t = SlotTable::new();
    assert_eq!(errno(t.remove(5)), libc::ENOENT);
    assert_eq!(errno(t.set_flags(5, SlotFlags::READ_ONLY)), libc::ENOENT);
    assert_eq!(errno(t.take_dirty_log(5)), libc::ENOENT);
    t.insert(SlotSpec::new(5, Gpa(0), anon(PAGE))).unwrap();
    // a slot that does not log has no dirty log
    assert_eq!(errno(t.take_dirty_log(5)), libc::ENOENT);
}

#[test]
fn a_failed_batch_publishes_nothing() {
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), anon(PAGE))).unwrap();
    let e = t
        .update(|edit| {
            edit.insert(SlotSpec::new(1, Gpa(PAGE), anon(PAGE)))?;
            edit.remove(0)?;
            edit.insert(SlotSpec::new(2, Gpa(PAGE), anon(PAGE))) // overlaps slot 1
        })
        .unwrap_err();
    assert_eq!(e.errno(), libc::EEXIST);
    let s = t.snapshot();
    assert_eq!(s.len(), 1);
    assert_eq!(s.generation(), 1);
    assert!(t.lookup(Gpa(0)).is_some() && t.lookup(Gpa(PAGE)).is_none());
}

#[test]
fn the_largest_slot_count_is_supported_and_one_more_is_refused() {
    let t = SlotTable::new();
    let b = anon(DEFAULT_MAX_SLOTS as u64 * PAGE);
    t.update(|edit| {
        for id in 0..DEFAULT_MAX_SLOTS {
            let off = id as u64 * PAGE;
            // every other page left as a hole, so lookups must find the right slot
            edit.insert(SlotSpec::new(id, Gpa(2 * off), b.clone()).window(off, PAGE))?;
        }
        Ok(())
    })
    .unwrap();
    let snap = t.snapshot();
    assert_eq!(snap.len(), DEFAULT_MAX_SLOTS as usize);
    let mut cursor = t.cursor();
    for id in (0..DEFAULT_MAX_SLOTS)
        .step_by(97)
        .chain([DEFAULT_MAX_SLOTS - 1])
    {
        let gpa = Gpa(2 * id as u64 * PAGE + 0x123);
        let tr = cursor.lookup(gpa).unwrap();
        assert_eq!(tr.slot, id);
        assert_eq!(tr.hva.0, b.hva().0 + id as u64 * PAGE + 0x123);
        assert_eq!(tr.len, PAGE - 0x123);
        assert!(
            t.lookup(Gpa(gpa.0 + PAGE)).is_none(),
            "hole after slot {id}"
        );
    }
    let e = t
        .insert(SlotSpec::new(DEFAULT_MAX_SLOTS, Gpa(1 << 40), anon(PAGE)))
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    // a smaller limit is enforced too
    let small = SlotTable::with_max_slots(2);
    small.insert(SlotSpec::new(1, Gpa(0), anon(PAGE))).unwrap();
    assert_eq!(
        errno(small.insert(SlotSpec::new(2, Gpa(PAGE), anon(PAGE)))),
        libc::EINVAL
    );
}

/// Three slots: [0, 2 pages) and [2, 5 pages) adjacent, then a hole, then [8, 9 pages).
fn three_slots() -> (SlotTable, [Arc<Backing>; 3]) {
    let t = SlotTable::new();
    let b = [anon(2 * PAGE), anon(3 * PAGE), anon(PAGE)];
    t.insert(SlotSpec::new(0, Gpa(0), b[0].clone())).unwrap();
    t.insert(SlotSpec::new(1, Gpa(2 * PAGE), b[1].clone()))
        .unwrap();
    t.insert(SlotSpec::new(2, Gpa(8 * PAGE), b[2].clone()))
        .unwrap();
    (t, b)
}

#[test]
fn reads_and_writes_cross_slot_boundaries() {
    let (t, b) = three_slots();
    let data: Vec<u8> = (0..3 * PAGE).map(|i| (i * 7 % 251) as u8).collect();
    t.write(Gpa(PAGE + 0x10), &data).unwrap();
    let mut back = vec![0; data.len()];
    t.read(Gpa(PAGE + 0x10), &mut back).unwrap();
    assert_eq!(back, data);
    // the bytes really went to both backings, split at the slot boundary
    let split = (PAGE - 0x10) as usize;
    let mut first = vec![0; split];
    b[0].read(PAGE + 0x10, &mut first).unwrap();
    assert_eq!(first, data[..split]);
    let mut second = vec![0; data.len() - split];
    b[1].read(0, &mut second).unwrap();
    assert_eq!(second, data[split..]);
}

#[test]
fn access_touching_a_hole_faults_and_copies_nothing() {
    let (t, b) = three_slots();
    b[1].write(3 * PAGE - 4, &[9; 4]).unwrap();
    // a write that starts in slot 1 and runs into the hole at page 5
    let e = t.write(Gpa(5 * PAGE - 4), &[1; 8]).unwrap_err();
    assert_eq!(e.errno(), libc::EFAULT);
    assert!(
        e.to_string().contains("0x5000"),
        "names the first missing address: {e}"
    );
    let mut tail = [0; 4];
    b[1].read(3 * PAGE - 4, &mut tail).unwrap();
    assert_eq!(tail, [9; 4], "nothing of the failed write landed");
    // reads likewise fail whole, leaving the buffer untouched
    let mut buf = [0xee; 8];
    assert_eq!(errno(t.read(Gpa(5 * PAGE - 4), &mut buf)), libc::EFAULT);
    assert_eq!(buf, [0xee; 8]);
    assert_eq!(errno(t.read(Gpa(6 * PAGE), &mut buf)), libc::EFAULT);
    // zero-length access is a no-op even in a hole
    t.read(Gpa(6 * PAGE), &mut []).unwrap();
}

#[test]
fn read_only_slots_refuse_writes_with_efault() {
    let (t, b) = three_slots();
    b[1].write(0, &[5; 16]).unwrap();
    t.set_flags(1, SlotFlags::READ_ONLY).unwrap();
    assert!(t.lookup(Gpa(2 * PAGE)).unwrap().read_only);
    // a write spanning slot 0 (writable) and slot 1 (read-only) changes neither
    let e = t.write(Gpa(2 * PAGE - 8), &[1; 16]).unwrap_err();
    assert_eq!(e.errno(), libc::EFAULT);
    assert!(e.to_string().contains("read-only slot 1"), "{e}");
    let mut out = [0; 16];
    t.read(Gpa(2 * PAGE - 8), &mut out).unwrap();
    assert_eq!(out, [[0; 8], [5; 8]].concat()[..]);
    assert_eq!(errno(t.copy_within(Gpa(0), Gpa(2 * PAGE), 8)), libc::EFAULT);
    // and back to writable
    t.set_flags(1, SlotFlags::NONE).unwrap();
    t.write(Gpa(2 * PAGE - 8), &[1; 16]).unwrap();
}

#[test]
fn copy_within_is_a_memmove_across_slots() {
    let (t, _b) = three_slots();
    let data: Vec<u8> = (0..5 * PAGE).map(|i| (i % 253) as u8).collect();
    t.write(Gpa(0), &data).unwrap();
    // forward overlap: dst above src by 0x180, crossing the 0/1 slot boundary
    let mut model = vec![0u8; 5 * PAGE as usize];
    t.read(Gpa(0), &mut model).unwrap();
    t.copy_within(Gpa(0x800), Gpa(0x980), 2 * PAGE).unwrap();
    model.copy_within(0x800..0x800 + 2 * PAGE as usize, 0x980);
    let mut got = vec![0u8; model.len()];
    t.read(Gpa(0), &mut got).unwrap();
    assert_eq!(got, model);
    // backward overlap: dst below src
    t.copy_within(Gpa(0x1f00), Gpa(0x1e00), 2 * PAGE).unwrap();
    model.copy_within(0x1f00..0x1f00 + 2 * PAGE as usize, 0x1e00);
    t.read(Gpa(0), &mut got).unwrap();
    assert_eq!(got, model);
    // into the isolated slot 2, and a source in the hole
    t.copy_within(Gpa(0x100), Gpa(8 * PAGE), PAGE).unwrap();
    let mut last = vec![0; PAGE as usize];
    t.read(Gpa(8 * PAGE), &mut last).unwrap();
    assert_eq!(last, model[0x100..0x100 + PAGE as usize]);
    assert_eq!(
        errno(t.copy_within(Gpa(6 * PAGE), Gpa(0), 16)),
        libc::EFAULT
    );
}

#[test]
fn dirty_log_marks_exactly_the_pages_written_through_the_table() {
    let (t, _b) = three_slots();
    t.set_flags(1, SlotFlags::LOG_DIRTY).unwrap();
    // one byte before slot 1 (slot 0, not logging) through the first byte of slot 1's page 1
    t.write(Gpa(2 * PAGE - 1), &vec![1; PAGE as usize + 2])
        .unwrap();
    assert_eq!(t.take_dirty_log(1).unwrap(), vec![0b11]);
    assert_eq!(t.take_dirty_log(1).unwrap(), vec![0], "take clears");
    t.copy_within(Gpa(0), Gpa(4 * PAGE + 8), 8).unwrap();
    // keeping LOG_DIRTY on while adding READ_ONLY keeps the marks
    t.set_flags(1, SlotFlags::LOG_DIRTY | SlotFlags::READ_ONLY)
        .unwrap();
    assert_eq!(t.take_dirty_log(1).unwrap(), vec![0b100]);
    t.set_flags(1, SlotFlags::NONE).unwrap();
    assert_eq!(errno(t.take_dirty_log(1)), libc::ENOENT);
    let t2 = SlotTable::new();
    t2.insert(SlotSpec::new(0, Gpa(0), anon(2 * PAGE)).flags(SlotFlags::LOG_DIRTY))
        .unwrap();
    t2.write(Gpa(PAGE), &[1]).unwrap();
    assert_eq!(t2.take_dirty_log(0).unwrap(), vec![0b10]);
}

#[test]
fn a_cursor_never_returns_a_removed_or_moved_slot() {
    let t = SlotTable::new();
    let a = anon(2 * PAGE);
    t.insert(SlotSpec::new(0, Gpa(0x10_0000), a.clone()))
        .unwrap();
    let mut c = t.cursor();
    let first = c.lookup(Gpa(0x10_0010)).unwrap();
    assert_eq!(first.hva.0, a.hva().0 + 0x10);
    // removed: the cursor's cached slot must not answer
    t.remove(0).unwrap();
    assert_eq!(c.lookup(Gpa(0x10_0010)), None);
    // moved: same backing at another guest address
    t.insert(SlotSpec::new(0, Gpa(0x40_0000), a.clone()))
        .unwrap();
    assert_eq!(c.lookup(Gpa(0x10_0010)), None);
    assert_eq!(c.lookup(Gpa(0x40_0010)).unwrap().hva, first.hva);
    // replaced: another backing at the old address
    let b = anon(2 * PAGE);
    t.update(|e| {
        e.remove(0)?;
        e.insert(SlotSpec::new(0, Gpa(0x40_0000), b.clone()))
    })
    .unwrap();
    assert_eq!(c.lookup(Gpa(0x40_0010)).unwrap().hva.0, b.hva().0 + 0x10);
    // made read-only: the cached translation must say so
    t.set_flags(0, SlotFlags::READ_ONLY).unwrap();
    assert!(c.lookup(Gpa(0x40_0010)).unwrap().read_only);
}

#[test]
fn a_snapshot_keeps_removed_memory_mapped() {
    let t = SlotTable::new();
    let b = anon(PAGE);
    b.write(0, b"still here").unwrap();
    t.insert(SlotSpec::new(0, Gpa(0), b)).unwrap();
    let old = t.snapshot();
    t.remove(0).unwrap();
    // the table let go of the backing; the snapshot still holds it
    let mut out = [0; 10];
    old.read(Gpa(0), &mut out).unwrap();
    assert_eq!(&out, b"still here");
    assert_eq!(errno(t.read(Gpa(0), &mut out)), libc::EFAULT);
}

/// What the property test below does to a table of 8 slots and one cursor.
#[derive(Debug, Clone)]
enum Step {
    /// `count` lookups: in slot `slot`, or in any slot (`None`), some outside every slot.
    Lookups {
        slot: Option<u64>,
        count: u16,
        seed: u64,
    },
    Remove(u32),
    /// Put slot `id` (back) at guest page `page` (every slot is 16 pages; the page table spans
    /// 8 x 32 pages, so places overlap and the insert may be refused: that is a step too).
    Insert {
        id: u32,
        page: u64,
    },
    ReadOnly(u32),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (proptest::option::of(0..8u64), 1..200u16, any::<u64>())
            .prop_map(|(slot, count, seed)| Step::Lookups { slot, count, seed }),
        // Longer than a searching cursor's search (16,384 lookups): it tries remembering again
        // within the step.
        1 => (proptest::option::of(0..8u64), any::<u64>())
            .prop_map(|(slot, seed)| Step::Lookups { slot, count: 17_000, seed }),
        1 => (0..8u32).prop_map(Step::Remove),
        1 => (0..8u32, 0..256u64).prop_map(|(id, page)| Step::Insert { id, page }),
        1 => (0..8u32).prop_map(Step::ReadOnly),
    ]
}

proptest::proptest! {
    /// A cursor answers what the table answers, whether it remembers its last slot or searches
    /// every address (random addresses make it search; after a while it tries remembering
    /// again), across removals, moves and flag changes in either mode.
    #[test]
    fn a_cursor_answers_as_the_table_does_in_either_mode(
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        let t = SlotTable::new();
        let b = anon(8 * 16 * PAGE);
        let spec = |id: u32, page: u64| {
            SlotSpec::new(id, Gpa(page * PAGE), b.clone()).window(u64::from(id) * 16 * PAGE, 16 * PAGE)
        };
        for id in 0..8u32 {
            t.insert(spec(id, u64::from(id) * 32)).unwrap();
        }
        let mut c = t.cursor();
        for s in steps {
            match s {
                Step::Lookups { slot, count, mut seed } => {
                    for _ in 0..count {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        // Slot k's first place is page 32k; 32 pages a slot, half of them a hole.
                        let k = slot.unwrap_or(seed >> 61);
                        let gpa = Gpa(k * 32 * PAGE + (seed & 0x1f_ffff) % (32 * PAGE));
                        proptest::prop_assert_eq!(c.lookup(gpa), t.lookup(gpa), "at {:?}", gpa);
                    }
                }
                Step::Remove(id) => {
                    let _ = t.remove(id);
                }
                Step::Insert { id, page } => {
                    let _ = t.insert(spec(id, page));
                }
                Step::ReadOnly(id) => {
                    let _ = t.set_flags(id, SlotFlags::READ_ONLY);
                }
            }
        }
    }
}

#[test]
fn drain_dirty_log_hands_over_the_dirty_words_of_a_large_slot_and_clears_them() {
    // 4 GiB of address space (a memfd: the pages are never touched but the written ones).
    let b = Arc::new(Backing::new(BackingKind::Memfd, 4 << 30).unwrap());
    let t = SlotTable::new();
    assert_eq!(errno(t.drain_dirty_log(0, |_, _| {})), libc::ENOENT);
    t.insert(SlotSpec::new(0, Gpa(1 << 32), b).flags(SlotFlags::LOG_DIRTY))
        .unwrap();
    let pages = [0u64, 65, 66, 300_000, (1 << 20) - 1];
    for p in pages {
        t.write(Gpa((1 << 32) + p * PAGE + 10), &[1, 2]).unwrap();
    }
    let drain = || {
        let mut words = Vec::new();
        t.drain_dirty_log(0, |first, bits| words.push((first, bits)))
            .unwrap();
        words
    };
    assert_eq!(
        drain(),
        vec![
            (0, 1),
            (64, 0b110),
            (300_000 / 64 * 64, 1 << (300_000 % 64)),
            ((1 << 20) - 64, 1 << 63)
        ]
    );
    assert_eq!(drain(), vec![], "the drain clears");
    t.write(Gpa((1 << 32) + 5 * PAGE), &[1]).unwrap();
    assert_eq!(
        t.take_dirty_log(0).unwrap()[0],
        1 << 5,
        "take sees the same bits"
    );
    assert_eq!(drain(), vec![]);
}

#[test]
fn a_flag_change_shares_the_dirty_log_and_a_slot_inserted_again_does_not() {
    let t = SlotTable::new();
    let b = anon(2 * PAGE);
    let spec = SlotSpec::new(0, Gpa(0), b.clone()).flags(SlotFlags::LOG_DIRTY);
    t.insert(spec.clone()).unwrap();
    let first = t.snapshot().slot(0).unwrap().clone();
    // The same flags again: the log goes on.
    t.set_flags(0, SlotFlags::LOG_DIRTY).unwrap();
    let flagged = t.snapshot().slot(0).unwrap().clone();
    assert!(!Arc::ptr_eq(&first, &flagged));
    assert!(first.shares_dirty_log(&flagged));
    // Removed and inserted again with the same spec: a log of its own.
    t.update(|e| {
        e.remove(0)?;
        e.insert(spec.clone())
    })
    .unwrap();
    let again = t.snapshot().slot(0).unwrap().clone();
    assert!(!flagged.shares_dirty_log(&again));
    // No log on either side: nothing shared.
    t.set_flags(0, SlotFlags::NONE).unwrap();
    let off = t.snapshot().slot(0).unwrap().clone();
    assert!(!off.shares_dirty_log(&off));
}
