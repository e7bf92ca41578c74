//! Two ways the merged dirty log used to lose or withhold writes (issue 45, item 6), on a real
//! KVM guest:
//! - **A slot replaced in place** by an identical one (removed and inserted again in one batch,
//!   or in one sync): the table gives the new slot a fresh log of its own, so a page written
//!   through the table before the replacement is in no log the table still has. The next
//!   `take_dirty_log` must still hold it, beside the page the guest wrote; and a flag change
//!   that keeps the slot's log (no replacement) must not be reported as one.
//! - **A slot split in two** in one batch: the new slot over the half split off must report
//!   the pages of that half written before the split (KVM drops the old memslot's bitmap, the
//!   table the old slot's log).
//! - **A slot KVM refused** staying in the table: the other slots' logs go on, and the refused
//!   slot's log fails with KVM's refusal, naming it.
//!
//! Skips (printing "skipped: ... no /dev/kvm") without /dev/kvm.

mod common;

use common::*;
use memvisor::{Gpa, SlotFlags, SlotSpec};
use memvisor_kvm::{Error, Options};

/// Slot 1: 16 pages at guest 0x20000, logging.
const BASE: u64 = 0x20000;
const PAGES: u64 = 16;

fn spec(g: &Guest) -> SlotSpec {
    SlotSpec::new(1, Gpa(BASE), g.memory.clone())
        .window(0, PAGES * 4096)
        .flags(SlotFlags::LOG_DIRTY)
}

fn table_write(g: &Guest, gpa: u64) {
    g.slots.table().write(Gpa(gpa), &[1, 2, 3]).unwrap();
}

fn guest_write(g: &mut Guest, gpa: u64) {
    let p = probe(&mut g.vcpu, segment(gpa));
    assert_eq!(p.write_exit, None, "the guest's write to {gpa:#x} exited");
}

/// How the slot is replaced by an identical one.
#[derive(Clone, Copy, Debug)]
enum Replace {
    /// `slots.update(|e| { e.remove(1)?; e.insert(same) })`: one batch through the binding.
    OneBatch,
    /// `table.remove(1); table.insert(same)` through another handle, then one `sync`.
    OneSync,
}

fn replaced_in_place(options: Options, how: Replace, name: &str) {
    let Some(kvm) = kvm_or_skip(name) else { return };
    let mut g = guest(&kvm, options, PAGES * 4096);
    g.slots.insert(spec(&g)).unwrap();
    assert_eq!(
        pages(&g.slots.take_dirty_log(1).unwrap()),
        Vec::<u64>::new()
    );

    // Page 3 through the table (marks the slot's own memvisor log), page 4 by the guest (KVM's
    // bitmap), then the slot replaced by an identical one.
    table_write(&g, BASE + 3 * 4096);
    guest_write(&mut g, BASE + 4 * 4096);
    match how {
        Replace::OneBatch => {
            let same = spec(&g);
            g.slots
                .update(|e| {
                    e.remove(1)?;
                    e.insert(same)
                })
                .unwrap();
        }
        Replace::OneSync => {
            let table = g.slots.table().clone();
            table.remove(1).unwrap();
            table.insert(spec(&g)).unwrap();
            g.slots.sync().unwrap();
        }
    }
    let got = pages(&g.slots.take_dirty_log(1).unwrap());
    println!("{name}: slot replaced in place ({how:?}): the next log holds pages {got:?}");
    assert!(
        got.contains(&3) && got.contains(&4),
        "{how:?}: page 3 (written through the table) and page 4 (by the guest) must both be \
         reported after the replacement, got {got:?}"
    );
    // Reported whole, once (the binding cannot know what the new slot's memory holds).
    assert_eq!(got, (0..PAGES).collect::<Vec<_>>(), "{how:?}");
    // The log goes on exactly after that.
    table_write(&g, BASE + 7 * 4096);
    guest_write(&mut g, BASE + 6 * 4096);
    assert_eq!(pages(&g.slots.take_dirty_log(1).unwrap()), vec![6, 7]);

    // A flag change that keeps logging keeps the slot's log: no replacement, nothing reported
    // beyond the pages written.
    table_write(&g, BASE + 5 * 4096);
    guest_write(&mut g, BASE + 9 * 4096);
    g.slots.set_flags(1, SlotFlags::LOG_DIRTY).unwrap();
    assert_eq!(pages(&g.slots.take_dirty_log(1).unwrap()), vec![5, 9]);
}

#[test]
fn a_slot_replaced_in_place_in_one_batch_loses_no_write() {
    replaced_in_place(
        Options::default(),
        Replace::OneBatch,
        "dirty log: replaced slot (manual protect)",
    );
}

#[test]
fn a_slot_replaced_in_place_in_one_sync_loses_no_write() {
    replaced_in_place(
        Options::default(),
        Replace::OneSync,
        "dirty log: replaced slot (manual protect)",
    );
}

#[test]
fn a_slot_replaced_in_place_loses_no_write_with_classic_get_dirty_log() {
    let options = Options {
        manual_protect: false,
        ..Options::default()
    };
    for how in [Replace::OneBatch, Replace::OneSync] {
        replaced_in_place(options, how, "dirty log: replaced slot (classic)");
    }
}

/// A logging slot of 32 pages split in one batch: slot 1 keeps its first 16 pages, a new slot 2
/// takes the other 16 (the same memory at the same guest addresses). A page of the second half
/// written before the split, by the guest (KVM's bitmap of the old memslot, which KVM drops with
/// it) or through the table (the old slot's memvisor log), must be in slot 2's next log.
fn split_in_two(options: Options, name: &str) {
    let Some(kvm) = kvm_or_skip(name) else { return };
    let mut g = guest(&kvm, options, 2 * PAGES * 4096);
    let whole = SlotSpec::new(1, Gpa(BASE), g.memory.clone())
        .window(0, 2 * PAGES * 4096)
        .flags(SlotFlags::LOG_DIRTY);
    g.slots.insert(whole).unwrap();
    assert_eq!(
        pages(&g.slots.take_dirty_log(1).unwrap()),
        Vec::<u64>::new()
    );
    // Old slot 1's pages 20 (the guest) and 25 (the table): pages 4 and 9 of slot 2 after the
    // split.
    guest_write(&mut g, BASE + 20 * 4096);
    table_write(&g, BASE + 25 * 4096);
    let (first, second) = (
        SlotSpec::new(1, Gpa(BASE), g.memory.clone())
            .window(0, PAGES * 4096)
            .flags(SlotFlags::LOG_DIRTY),
        SlotSpec::new(2, Gpa(BASE + PAGES * 4096), g.memory.clone())
            .window(PAGES * 4096, PAGES * 4096)
            .flags(SlotFlags::LOG_DIRTY),
    );
    g.slots
        .update(|e| {
            e.remove(1)?;
            e.insert(first)?;
            e.insert(second)
        })
        .unwrap();
    let two = pages(&g.slots.take_dirty_log(2).unwrap());
    println!("{name}: after the split, slot 2's log holds pages {two:?}");
    assert!(
        two.contains(&4) && two.contains(&9),
        "the guest's write to old page 20 and the table's to old page 25 (slot 2's pages 4 and \
         9) were dropped with the old memslot: slot 2's log after the split is {two:?}"
    );
    // The log goes on exactly after that.
    guest_write(&mut g, BASE + 30 * 4096);
    assert_eq!(pages(&g.slots.take_dirty_log(2).unwrap()), vec![14]);
}

#[test]
fn a_logging_slot_split_in_two_loses_no_write_to_the_part_split_off() {
    split_in_two(Options::default(), "dirty log: split slot (manual protect)");
    split_in_two(
        Options {
            manual_protect: false,
            ..Options::default()
        },
        "dirty log: split slot (classic)",
    );
}

#[test]
fn a_refused_slot_does_not_stop_the_other_slots_logs() {
    let name = "dirty log: refused slot";
    let Some(kvm) = kvm_or_skip(name) else { return };
    let mut g = guest(&kvm, Options::default(), 4 * PAGES * 4096);
    for id in 1..=2u32 {
        let gpa = BASE + u64::from(id - 1) * PAGES * 4096;
        g.slots
            .insert(
                SlotSpec::new(id, Gpa(gpa), g.memory.clone())
                    .window(u64::from(id - 1) * PAGES * 4096, PAGES * 4096)
                    .flags(SlotFlags::LOG_DIRTY),
            )
            .unwrap();
    }
    // Slot 9: a guest address past any the CPU can map (bit 62). The table takes it; KVM
    // refuses it (EINVAL: its last frame is above the largest KVM maps). It stays in the table.
    const FAR: u64 = 1 << 62;
    let err = g
        .slots
        .insert(
            SlotSpec::new(9, Gpa(FAR), g.memory.clone())
                .window(2 * PAGES * 4096, PAGES * 4096)
                .flags(SlotFlags::LOG_DIRTY),
        )
        .unwrap_err();
    println!("{name}: KVM refused slot 9: {err}");
    assert!(
        matches!(
            err,
            Error::Memslot {
                slot: 9,
                gpa: FAR,
                ..
            }
        ),
        "not KVM's refusal of slot 9: {err:?}"
    );
    assert!(g.slots.table().snapshot().slot(9).is_some());

    // Writes to the healthy slots, by the guest and through the table.
    let slot2 = BASE + PAGES * 4096;
    guest_write(&mut g, BASE + 2 * 4096);
    table_write(&g, slot2 + 5 * 4096);
    guest_write(&mut g, slot2 + 11 * 4096);
    let one = g.slots.take_dirty_log(1);
    let two = g.slots.take_dirty_log(2);
    println!(
        "{name}: beside it, slot 1's log {:?}, slot 2's log {:?}",
        one.as_ref().map(|w| pages(w)).map_err(|e| e.to_string()),
        two.as_ref().map(|w| pages(w)).map_err(|e| e.to_string())
    );
    assert_eq!(
        pages(&one.expect("slot 1's log beside a refused slot")),
        vec![2]
    );
    assert_eq!(
        pages(&two.expect("slot 2's log beside a refused slot")),
        vec![5, 11]
    );

    // The refused slot's own log fails, naming it, with KVM's errno.
    let err = g.slots.take_dirty_log(9).unwrap_err();
    println!("{name}: slot 9's log: {err}");
    assert!(
        matches!(
            err,
            Error::Memslot {
                slot: 9,
                gpa: FAR,
                ..
            }
        ),
        "slot 9's log must fail with KVM's refusal of slot 9: {err:?}"
    );
    assert!(err.to_string().contains("memvisor slot 9"), "{err}");
    assert_eq!(err.errno(), libc::EINVAL, "{err}");
    // The batch call gives every other slot's log and names the refused one, whose log it
    // cannot give: one bad slot stops no other slot's logging there either.
    guest_write(&mut g, BASE + 8 * 4096);
    let batch = g.slots.take_dirty_logs().unwrap();
    let got: Vec<(u32, Vec<u64>)> = batch
        .logs
        .iter()
        .map(|l| (l.slot, pages(&l.words)))
        .collect();
    assert_eq!(got, vec![(1, vec![8]), (2, vec![])]);
    assert_eq!(batch.refused.len(), 1, "{:?}", batch.refused);
    assert!(
        matches!(batch.refused[0], Error::Memslot { slot: 9, .. }),
        "{:?}",
        batch.refused
    );
    // A sync still says KVM lacks slot 9.
    assert!(matches!(
        g.slots.sync(),
        Err(Error::Memslot { slot: 9, .. })
    ));

    // Slot 9 removed: nothing is refused any more, and the next write is the only news.
    g.slots.remove(9).unwrap();
    guest_write(&mut g, BASE + 9 * 4096);
    let batch = g.slots.take_dirty_logs().unwrap();
    let got: Vec<(u32, Vec<u64>)> = batch
        .logs
        .iter()
        .map(|l| (l.slot, pages(&l.words)))
        .collect();
    assert_eq!(got, vec![(1, vec![9]), (2, vec![])]);
    assert!(batch.refused.is_empty(), "{:?}", batch.refused);
}
