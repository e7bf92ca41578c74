//! IOTLB invalidation (`DmaSpace::invalidate_range`): any range goes, mappings are cut at its
//! edges and keep their host memory, protection and dirty bits outside it; pins refuse it.

use std::sync::Arc;

use memvisor::dma::{DmaConfig, PinMode};
use memvisor::{Backing, BackingKind, DmaSpace, Iova, Prot};

#[path = "common/mod.rs"]
mod common;

const P: u64 = 4096;

/// Tests that lock memory run one at a time: VmLck is per process.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn space(pages: u64) -> (DmaSpace, Arc<Backing>) {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, pages * P).unwrap());
    (DmaSpace::default(), b)
}

fn hva(dma: &DmaSpace, page: u64) -> Option<u64> {
    dma.translate(Iova(page * P), 1, Prot::READ)
        .ok()
        .map(|t| t.hva.0)
}

#[test]
fn invalidating_the_middle_of_a_mapping_keeps_both_ends_where_they_were() {
    let (dma, b) = space(16);
    dma.map_backing(Iova(0), &b, 0, 16 * P, Prot::RW).unwrap();
    let before: Vec<Option<u64>> = (0..16).map(|p| hva(&dma, p)).collect();
    assert_eq!(dma.invalidate_range(Iova(4 * P), 4 * P).unwrap(), 4 * P);
    for p in 0..16 {
        let want = if (4..8).contains(&p) {
            None
        } else {
            before[p as usize]
        };
        assert_eq!(hva(&dma, p), want, "page {p}");
    }
    assert_eq!(dma.info().max_mappings - dma.info().available, 2);
    // The kept parts keep their protection: a write through page 9 works, and type1 unmap of
    // a kept part as a whole works.
    dma.dma_write(Iova(9 * P), b"still mapped").unwrap();
    let mut got = [0u8; 12];
    b.read(9 * P, &mut got).unwrap();
    assert_eq!(&got, b"still mapped");
    assert_eq!(dma.unmap(Iova(8 * P), 8 * P).unwrap(), 8 * P);
}

#[test]
fn a_range_across_mappings_and_holes_removes_what_it_covers_and_nothing_else() {
    let (dma, b) = space(16);
    dma.map_backing(Iova(0), &b, 0, 4 * P, Prot::READ).unwrap();
    dma.map_backing(Iova(8 * P), &b, 8 * P, 4 * P, Prot::RW)
        .unwrap();
    dma.map_backing(Iova(20 * P), &b, 12 * P, 4 * P, Prot::RW)
        .unwrap();
    assert_eq!(dma.invalidate_range(Iova(2 * P), 8 * P).unwrap(), 4 * P);
    let mapped: Vec<u64> = (0..24).filter(|&p| hva(&dma, p).is_some()).collect();
    assert_eq!(mapped, vec![0, 1, 10, 11, 20, 21, 22, 23]);
    // The cut READ-only part stays read-only.
    assert!(dma.translate(Iova(P), 1, Prot::WRITE).is_err());
    // Nothing mapped there: 0 bytes, nothing changed. The whole space: everything.
    assert_eq!(dma.invalidate_range(Iova(100 * P), P).unwrap(), 0);
    assert_eq!(
        dma.invalidate_range(Iova(0), u64::MAX - 4095).unwrap(),
        8 * P
    );
    assert_eq!(dma.info().max_mappings - dma.info().available, 0);
    // Misaligned, empty and wrapping ranges are EINVAL.
    for (i, s) in [(1, P), (0, 0), (P, u64::MAX)] {
        assert_eq!(
            dma.invalidate_range(Iova(i), s).unwrap_err().errno(),
            libc::EINVAL
        );
    }
}

#[test]
fn dirty_bits_outside_the_range_survive_the_cut() {
    let (dma, b) = space(16);
    dma.map_backing(Iova(0), &b, 0, 16 * P, Prot::RW).unwrap();
    dma.start_dirty_tracking().unwrap();
    dma.dma_write(Iova(P), b"x").unwrap();
    dma.dma_write(Iova(10 * P), b"y").unwrap();
    dma.invalidate_range(Iova(4 * P), 4 * P).unwrap();
    assert_eq!(
        dma.get_and_clear_dirty(Iova(0), 4 * P, P).unwrap(),
        vec![0b10]
    );
    assert_eq!(
        dma.get_and_clear_dirty(Iova(8 * P), 8 * P, P).unwrap(),
        vec![0b100]
    );
}

#[test]
fn pins_kept_in_the_range_refuse_the_invalidation_and_pins_outside_it_do_not_matter() {
    let _s = serial();
    let dma = DmaSpace::new(DmaConfig {
        unpin_wait: std::time::Duration::from_millis(5),
        ..DmaConfig::default()
    })
    .unwrap();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * P).unwrap());
    dma.map_backing(Iova(0), &b, 0, 16 * P, Prot::RW).unwrap();
    dma.start_dirty_tracking().unwrap();
    dma.pin_pages(&[5], Prot::RW).unwrap();
    let e = dma.invalidate_range(Iova(4 * P), 4 * P).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    assert!((0..16).all(|p| hva(&dma, p).is_some()), "nothing changed");
    // The undo keeps the dirty bits, including those of the kept parts.
    let bits = dma.get_and_clear_dirty(Iova(0), 16 * P, P).unwrap();
    assert_eq!(bits, vec![1 << 5], "the pinned page, and nothing else");
    dma.unpin_pages(&[5]).unwrap();
    // A pin outside the range stays with the part kept, and is released through it.
    dma.pin_pages(&[12], Prot::RW).unwrap();
    assert_eq!(dma.invalidate_range(Iova(4 * P), 4 * P).unwrap(), 4 * P);
    assert_eq!(dma.device_pinned_pages(), 1);
    dma.unpin_pages(&[12]).unwrap();
    assert_eq!(dma.device_pinned_pages(), 0);
}

#[test]
fn in_eager_mode_the_kept_parts_stay_locked_and_the_removed_part_is_unlocked() {
    let _s = serial();
    let dma = DmaSpace::new(DmaConfig {
        pin_mode: PinMode::Eager,
        ..DmaConfig::default()
    })
    .unwrap();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * P).unwrap());
    let before = common::vm_lck();
    dma.map_backing(Iova(0), &b, 0, 64 * P, Prot::RW).unwrap();
    assert_eq!(common::vm_lck() - before, 64 * P);
    dma.invalidate_range(Iova(8 * P), 16 * P).unwrap();
    assert_eq!(
        common::vm_lck() - before,
        48 * P,
        "bytes locked after the cut"
    );
    dma.unmap_all().unwrap();
    assert_eq!(common::vm_lck(), before);
}

#[test]
fn an_update_maps_an_empty_range_beside_its_neighbours_and_replaces_what_a_held_one_held() {
    let (dma, b) = space(64);
    // Empty ranges, in the order a guest hands IOVAs out (top down) and in gaps between
    // entries: each maps its page and leaves the others as they were.
    for p in [40u64, 30, 20, 25, 35, 10] {
        dma.iotlb_map(Iova(p * P), &b, p * P, P, Prot::RW).unwrap();
    }
    let base = b.hva().0;
    for p in 0..48 {
        let want = [10u64, 20, 25, 30, 35, 40]
            .contains(&p)
            .then_some(base + p * P);
        assert_eq!(hva(&dma, p), want, "page {p}");
    }
    // A held range: an update over the middle of an 8-page mapping cuts it, keeps both ends
    // where they were, and maps the new page where it says.
    dma.map_backing(Iova(0), &b, 0, 8 * P, Prot::READ).unwrap();
    dma.iotlb_map(Iova(3 * P), &b, 60 * P, P, Prot::RW).unwrap();
    for p in 0..8 {
        let want = if p == 3 { 60 } else { p };
        assert_eq!(hva(&dma, p), Some(base + want * P), "page {p}");
    }
    assert!(dma.translate(Iova(3 * P), 1, Prot::WRITE).is_ok());
    assert!(dma.translate(Iova(2 * P), 1, Prot::WRITE).is_err());
    // The same page again (an update over itself): replaced.
    dma.iotlb_map(Iova(3 * P), &b, 61 * P, P, Prot::READ)
        .unwrap();
    assert_eq!(hva(&dma, 3), Some(base + 61 * P));
    assert!(dma.translate(Iova(3 * P), 1, Prot::WRITE).is_err());
}

#[test]
fn a_full_space_takes_an_update_over_a_held_range_and_refuses_one_over_an_empty_range() {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 8 * P).unwrap());
    let dma = DmaSpace::new(DmaConfig {
        max_mappings: 4,
        ..DmaConfig::default()
    })
    .unwrap();
    for p in 0..4 {
        dma.iotlb_map(Iova(p * P), &b, p * P, P, Prot::RW).unwrap();
    }
    // Held: what it holds goes first, so there is room.
    dma.iotlb_map(Iova(2 * P), &b, 7 * P, P, Prot::RW).unwrap();
    assert_eq!(hva(&dma, 2), Some(b.hva().0 + 7 * P));
    // Empty: ENOSPC, nothing changed.
    let e = dma.iotlb_map(Iova(9 * P), &b, 0, P, Prot::RW).unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC, "{e}");
    assert_eq!(hva(&dma, 9), None);
    assert_eq!(dma.len(), 4);
}

#[test]
fn the_oldest_mappings_are_the_first_made_and_a_cut_makes_its_parts_new() {
    let (dma, b) = space(16);
    let ranges = |v: Vec<memvisor::Range<Iova>>| -> Vec<(u64, u64)> {
        v.iter().map(|r| (r.start().0 / P, r.len() / P)).collect()
    };
    assert!(dma.oldest(4).is_empty(), "an empty space has nothing old");
    // Made in an order that is not the IOVAs': pages 8-11, then 0, then 4-5, then 12.
    dma.iotlb_map(Iova(8 * P), &b, 0, 4 * P, Prot::RW).unwrap();
    dma.iotlb_map(Iova(0), &b, 0, P, Prot::RW).unwrap();
    dma.iotlb_map(Iova(4 * P), &b, 0, 2 * P, Prot::READ)
        .unwrap();
    dma.iotlb_map(Iova(12 * P), &b, 0, P, Prot::RW).unwrap();
    assert_eq!(ranges(dma.oldest(2)), [(8, 4), (0, 1)]);
    assert_eq!(ranges(dma.oldest(0)), []);
    assert_eq!(ranges(dma.oldest(9)), [(8, 4), (0, 1), (4, 2), (12, 1)]);
    // Cutting page 9 out of 8-11 leaves two parts, made now: the newest two.
    dma.invalidate_range(Iova(9 * P), P).unwrap();
    assert_eq!(
        ranges(dma.oldest(9)),
        [(0, 1), (4, 2), (12, 1), (8, 1), (10, 2)]
    );
}
