//! The test-hooks faults reach what they break through construction alone: a slot table built
//! with `Faults::no_dirty_summary` (the migration trial's `--no-summary` negative control) has
//! drains miss the pages written through it, and the same table built without faults reports
//! them. Needs `--features test-hooks`; without it this file is empty.
#![cfg(feature = "test-hooks")]

use std::sync::Arc;

use memvisor::faults::Faults;
use memvisor::{Backing, BackingKind, Gpa, SlotFlags, SlotSpec, SlotTable};

/// The pages of slot 0 a drain reports after a write of 3 pages at page 70 of a 256-page slot
/// in a table built with `faults`.
fn drained_after_a_write(faults: Faults) -> Vec<u64> {
    let table = SlotTable::with_faults(8, faults);
    let backing = Arc::new(Backing::new(BackingKind::PrivateAnon, 256 * 4096).unwrap());
    table
        .insert(SlotSpec::new(0, Gpa(0x10_0000), backing).flags(SlotFlags::LOG_DIRTY))
        .unwrap();
    table
        .write(Gpa(0x10_0000 + 70 * 4096), &[0xa5; 3 * 4096])
        .unwrap();
    let mut pages = Vec::new();
    table
        .drain_dirty_log(0, |first, mut bits| {
            while bits != 0 {
                pages.push(first + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        })
        .unwrap();
    pages
}

#[test]
fn without_faults_a_drain_reports_the_written_pages() {
    assert_eq!(drained_after_a_write(Faults::default()), vec![70, 71, 72]);
}

#[test]
fn with_no_dirty_summary_a_drain_misses_the_written_pages() {
    let faults = Faults {
        no_dirty_summary: true,
        ..Faults::default()
    };
    assert_eq!(drained_after_a_write(faults), Vec::<u64>::new());
}
