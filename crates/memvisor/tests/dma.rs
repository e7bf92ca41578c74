//! The VFIO type1 (v2) semantics table of DESIGN.md, row by row, with the exact errno; the
//! boundaries of the 64-bit IOVA space and the limits; translation and dirty bits.

use std::sync::Arc;
use std::time::{Duration, Instant};

use memvisor::dma::Segment;
use memvisor::{
    Backing, BackingKind, DmaConfig, DmaSpace, Gpa, Iova, Prot, Range, SlotFlags, SlotSpec,
    SlotTable,
};

mod common;

const PAGE: u64 = 4096;

fn mem(pages: u64) -> Arc<Backing> {
    Arc::new(Backing::new(BackingKind::PrivateAnon, pages * PAGE).unwrap())
}

fn errno<T: std::fmt::Debug>(r: memvisor::Result<T>) -> i32 {
    r.unwrap_err().errno()
}

/// A space that keeps its page table from its first small mapping on.
fn always_paged() -> DmaSpace {
    DmaSpace::new(DmaConfig {
        page_table_from: 0,
        ..DmaConfig::default()
    })
    .unwrap()
}

#[test]
fn map_rejects_bad_arguments_with_einval() {
    let d = DmaSpace::default();
    let b = mem(4);
    assert_eq!(
        errno(d.map_backing(Iova(0), &b, 0, 0, Prot::RW)),
        libc::EINVAL,
        "size 0"
    );
    assert_eq!(
        errno(d.map_backing(Iova(0x800), &b, 0, PAGE, Prot::RW)),
        libc::EINVAL,
        "iova"
    );
    assert_eq!(
        errno(d.map_backing(Iova(0), &b, 0, 0x1800, Prot::RW)),
        libc::EINVAL,
        "size"
    );
    assert_eq!(
        errno(d.map_backing(Iova(0), &b, 0x10, PAGE, Prot::RW)),
        libc::EINVAL,
        "vaddr"
    );
    let e = d
        .map_backing(Iova(0), &b, 0, PAGE, Prot::default())
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("READ, WRITE"), "{e}");
    let e = d
        .map_backing(Iova(u64::MAX - 0xfff), &b, 0, 2 * PAGE, Prot::RW)
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "wraps");
    assert!(e.to_string().contains("wraps"), "{e}");
    assert_eq!(
        errno(d.map_backing(Iova(0), &b, 2 * PAGE, 4 * PAGE, Prot::RW)),
        libc::EINVAL,
        "past backing"
    );
    // SAFETY: the mapping is refused, so memvisor never touches the address.
    let e = unsafe { d.map_raw(Iova(0), memvisor::Hva(u64::MAX - 0xfff), 2 * PAGE, Prot::RW) };
    assert_eq!(errno(e), libc::EINVAL, "host range wraps");
    assert!(d.is_empty());
}

#[test]
fn overlapping_maps_are_eexist_and_adjacent_ones_fine() {
    let d = DmaSpace::default();
    let b = mem(32);
    d.map_backing(Iova(0x10000), &b, 0, 4 * PAGE, Prot::RW)
        .unwrap();
    for iova in [0x10000 - PAGE, 0x10000, 0x13000] {
        let e = d
            .map_backing(Iova(iova), &b, 0, 2 * PAGE, Prot::RW)
            .unwrap_err();
        assert_eq!(e.errno(), libc::EEXIST, "{iova:#x}");
    }
    assert_eq!(
        errno(d.map_backing(Iova(0), &b, 0, 32 * PAGE, Prot::RW)),
        libc::EEXIST,
        "covers"
    );
    d.map_backing(Iova(0x10000 - PAGE), &b, 0, PAGE, Prot::READ)
        .unwrap();
    d.map_backing(Iova(0x14000), &b, 0, PAGE, Prot::WRITE)
        .unwrap();
    assert_eq!(d.len(), 3);
}

#[test]
fn the_mapping_count_limit_is_exactly_reached_then_enospc() {
    let d = DmaSpace::new(DmaConfig {
        max_mappings: 8,
        ..Default::default()
    })
    .unwrap();
    let b = mem(1);
    for i in 0..8 {
        d.map_backing(Iova(i * PAGE), &b, 0, PAGE, Prot::RW)
            .unwrap();
    }
    assert_eq!(d.info().available, 0);
    let e = d
        .map_backing(Iova(100 * PAGE), &b, 0, PAGE, Prot::RW)
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOSPC);
    assert!(e.to_string().contains("limit of 8"), "{e}");
    // a guest range that would become several mappings is refused whole
    d.unmap(Iova(0), 2 * PAGE).unwrap();
    let t = SlotTable::new();
    for (id, gpa) in [(0, 0), (1, PAGE), (2, 2 * PAGE)] {
        t.insert(SlotSpec::new(id, Gpa(gpa), mem(1))).unwrap();
    }
    assert_eq!(
        errno(d.map_guest(Iova(1 << 30), &t.snapshot(), Gpa(0), 3 * PAGE, Prot::RW)),
        libc::ENOSPC
    );
    assert_eq!(d.len(), 6);
    d.map_guest(Iova(1 << 30), &t.snapshot(), Gpa(0), 2 * PAGE, Prot::RW)
        .unwrap();
    assert_eq!(d.len(), 8);
    // the default limit is VFIO's
    assert_eq!(DmaSpace::default().info().max_mappings, 65535);
}

#[test]
fn reserved_ranges_and_the_aperture_are_einval() {
    let reserved = Range::new("msi", Iova(0xfee0_0000), 0x10_0000).unwrap();
    let d = DmaSpace::new(DmaConfig {
        aperture: (Iova(0), Iova((1 << 39) - 1)),
        reserved: vec![reserved],
        ..Default::default()
    })
    .unwrap();
    let info = d.info();
    assert_eq!(
        info.iova_ranges,
        vec![
            (Iova(0), Iova(0xfedf_ffff)),
            (Iova(0xfef0_0000), Iova((1 << 39) - 1))
        ]
    );
    let b = mem(2);
    for iova in [
        0xfee0_0000,
        0xfedf_f000,
        0xfeef_f000,
        1 << 39,
        (1 << 39) - PAGE,
    ] {
        let r = d.map_backing(Iova(iova), &b, 0, 2 * PAGE, Prot::RW);
        assert_eq!(errno(r), libc::EINVAL, "{iova:#x}");
    }
    d.map_backing(Iova(0xfedf_e000), &b, 0, 2 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova((1 << 39) - 2 * PAGE), &b, 0, 2 * PAGE, Prot::RW)
        .unwrap();
}

#[test]
fn mappings_may_end_at_the_top_of_the_iova_space() {
    let d = DmaSpace::default();
    let b = mem(2);
    let top = u64::MAX - 2 * PAGE + 1;
    d.map_backing(Iova(top), &b, 0, 2 * PAGE, Prot::RW).unwrap();
    d.dma_write(Iova(u64::MAX - 3), &[1, 2, 3, 4]).unwrap();
    let mut out = [0; 4];
    d.dma_read(Iova(u64::MAX - 3), &mut out).unwrap();
    assert_eq!(out, [1, 2, 3, 4]);
    let t = d.translate(Iova(u64::MAX), 100, Prot::READ).unwrap();
    assert_eq!(t.len, 1);
    assert_eq!(t.hva.0, b.hva().0 + 2 * PAGE - 1);
    // one byte past the top cannot be accessed
    assert_eq!(errno(d.dma_read(Iova(u64::MAX), &mut out)), libc::EINVAL);
    assert_eq!(d.unmap(Iova(top), 2 * PAGE).unwrap(), 2 * PAGE);
}

#[test]
fn unmap_follows_v2_rules() {
    let d = DmaSpace::default();
    let b = mem(8);
    d.map_backing(Iova(0x10000), &b, 0, 4 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(0x20000), &b, 0, 2 * PAGE, Prot::RW)
        .unwrap();
    // cutting a mapping at its start or its end is EINVAL and unmaps nothing
    assert_eq!(errno(d.unmap(Iova(0x11000), 3 * PAGE)), libc::EINVAL);
    assert_eq!(errno(d.unmap(Iova(0x10000), 2 * PAGE)), libc::EINVAL);
    assert_eq!(
        errno(d.unmap(Iova(0x10000), 0x11000)),
        libc::EINVAL,
        "cuts the second"
    );
    assert_eq!(d.len(), 2);
    // bad arguments
    assert_eq!(errno(d.unmap(Iova(0x10000), 0)), libc::EINVAL);
    assert_eq!(errno(d.unmap(Iova(0x10800), PAGE)), libc::EINVAL);
    // nothing there: success, 0 bytes
    assert_eq!(d.unmap(Iova(0x40000), 16 * PAGE).unwrap(), 0);
    // a range covering both (and holes) unmaps both and returns the bytes
    assert_eq!(d.unmap(Iova(0), 0x100000).unwrap(), 6 * PAGE);
    assert!(d.is_empty());
    d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(PAGE), &b, 0, 3 * PAGE, Prot::RW)
        .unwrap();
    assert_eq!(d.unmap_all().unwrap(), 4 * PAGE);
    assert_eq!(d.unmap_all().unwrap(), 0);
}

#[test]
fn rw_and_translate_check_mapping_and_permission() {
    let d = DmaSpace::default();
    let b = mem(4);
    d.map_backing(Iova(0), &b, 0, 2 * PAGE, Prot::READ).unwrap();
    d.map_backing(Iova(2 * PAGE), &b, 2 * PAGE, PAGE, Prot::WRITE)
        .unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(errno(d.dma_write(Iova(0), &buf)), libc::EPERM);
    assert_eq!(errno(d.dma_read(Iova(2 * PAGE), &mut buf)), libc::EPERM);
    assert_eq!(errno(d.translate(Iova(0), 8, Prot::WRITE)), libc::EPERM);
    assert_eq!(errno(d.dma_read(Iova(3 * PAGE), &mut buf)), libc::EINVAL);
    assert_eq!(
        errno(d.translate(Iova(3 * PAGE), 8, Prot::READ)),
        libc::EFAULT
    );
    // a write spanning the READ-only and WRITE mappings is refused whole
    b.write(2 * PAGE - 4, &[7; 8]).unwrap();
    assert_eq!(errno(d.dma_write(Iova(2 * PAGE - 4), &[1; 8])), libc::EPERM);
    let mut check = [0; 8];
    b.read(2 * PAGE - 4, &mut check).unwrap();
    assert_eq!(check, [7; 8]);
    // a read running past the last mapping fails before copying
    let mut big = vec![0xee; 3 * PAGE as usize];
    assert_eq!(errno(d.dma_read(Iova(0), &mut big)), libc::EPERM);
    assert!(big.iter().all(|&x| x == 0xee));
    assert_eq!(errno(d.translate(Iova(0), 0, Prot::READ)), libc::EINVAL);
}

/// The page table starts with the eighth small mapping (all eight entered at once) and is
/// dropped when fewer than two are left; a translation through the space, a fresh cursor and a
/// cursor kept throughout gives the current mapping's host address in every state, never a
/// removed one's.
#[test]
fn the_page_table_starts_and_stops_with_the_small_mappings_and_never_answers_stale() {
    let d = DmaSpace::new(DmaConfig {
        page_table_from: 8,
        ..Default::default()
    })
    .unwrap();
    let b = mem(16);
    let iova = |i: u64| Iova(2 * i * PAGE);
    let mut kept = d.cursor();
    let mut check = |d: &DmaSpace, i: u64, host_page: Option<u64>| {
        let mut fresh = d.cursor();
        for at in [iova(i), Iova(iova(i).0 + PAGE - 8)] {
            let answers = [
                d.translate(at, 8, Prot::READ),
                fresh.translate(at, 8, Prot::READ),
                kept.translate(at, 8, Prot::READ),
            ];
            for got in answers {
                match host_page {
                    Some(p) => {
                        let want = b.hva().0 + p * PAGE + (at.0 - iova(i).0);
                        assert_eq!(got.unwrap().hva.0, want, "iova {:#x}", at.0);
                    }
                    None => assert_eq!(errno(got), libc::EFAULT, "iova {:#x}", at.0),
                }
            }
        }
    };
    // The words the page table holds, from the space's Debug output.
    let words = |d: &DmaSpace| {
        let text = format!("{d:?}");
        let at = text
            .find("words: ")
            .expect("the page table in the Debug output")
            + 7;
        text[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    };
    for i in 0..8 {
        d.map_backing(iova(i), &b, i * PAGE, PAGE, Prot::RW)
            .unwrap();
        assert_eq!(words(&d), if i < 7 { 0 } else { 8 }, "after mapping {i}");
        for j in 0..=i {
            check(&d, j, Some(j));
        }
    }
    // Down to one small mapping: the table goes.
    for i in 0..7 {
        d.unmap(iova(i), PAGE).unwrap();
        assert_eq!(
            words(&d),
            if i < 6 { 7 - i } else { 0 },
            "after unmapping {i}"
        );
        check(&d, i, None);
        check(&d, 7, Some(7));
    }
    // The same IOVAs mapped to other pages, below the start (no table) and past it again.
    for i in 0..7 {
        d.map_backing(iova(i), &b, (8 + i) * PAGE, PAGE, Prot::RW)
            .unwrap();
        assert_eq!(words(&d), if i < 6 { 0 } else { 8 }, "after remapping {i}");
        for j in 0..=i {
            check(&d, j, Some(8 + j));
        }
        check(&d, 7, Some(7));
    }
}

#[test]
fn reads_and_writes_span_mappings_and_sg_lists_merge_host_contiguous_pieces() {
    let d = DmaSpace::default();
    let b = mem(8);
    // iova [0, 2p) -> b[0, 2p); [2p, 3p) -> b[2p, 3p) (contiguous on host); [3p, 4p) -> b[6p, 7p)
    d.map_backing(Iova(0), &b, 0, 2 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(2 * PAGE), &b, 2 * PAGE, PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(3 * PAGE), &b, 6 * PAGE, PAGE, Prot::RW)
        .unwrap();
    let data: Vec<u8> = (0..3 * PAGE).map(|i| (i % 251) as u8).collect();
    d.dma_write(Iova(PAGE / 2), &data).unwrap();
    let mut back = vec![0; data.len()];
    d.dma_read(Iova(PAGE / 2), &mut back).unwrap();
    assert_eq!(back, data);
    let mut tail = vec![0; PAGE as usize / 2];
    b.read(6 * PAGE, &mut tail).unwrap();
    assert_eq!(tail, data[data.len() - PAGE as usize / 2..]);
    let sg = d
        .translate_sg(Iova(PAGE / 2), 3 * PAGE, Prot::READ)
        .unwrap();
    assert_eq!(
        sg,
        vec![
            Segment {
                hva: memvisor::Hva(b.hva().0 + PAGE / 2),
                len: 5 * PAGE / 2
            },
            Segment {
                hva: memvisor::Hva(b.hva().0 + 6 * PAGE),
                len: PAGE / 2
            },
        ]
    );
    assert_eq!(
        errno(d.translate_sg(Iova(3 * PAGE), 2 * PAGE, Prot::READ)),
        libc::EFAULT
    );
}

#[test]
fn map_guest_makes_one_mapping_per_slot_piece() {
    let t = SlotTable::new();
    let (a, b) = (mem(2), mem(2));
    t.insert(SlotSpec::new(0, Gpa(0x100000), a.clone()))
        .unwrap();
    t.insert(SlotSpec::new(1, Gpa(0x102000), b.clone()).flags(SlotFlags::READ_ONLY))
        .unwrap();
    let d = DmaSpace::default();
    // WRITE over a read-only slot: EFAULT, nothing mapped
    assert_eq!(
        errno(d.map_guest(Iova(0), &t.snapshot(), Gpa(0x101000), 2 * PAGE, Prot::RW)),
        libc::EFAULT
    );
    assert!(d.is_empty());
    // a hole in guest memory: EFAULT
    assert_eq!(
        errno(d.map_guest(Iova(0), &t.snapshot(), Gpa(0x103000), 2 * PAGE, Prot::READ)),
        libc::EFAULT
    );
    d.map_guest(
        Iova(0x8000),
        &t.snapshot(),
        Gpa(0x101000),
        2 * PAGE,
        Prot::READ,
    )
    .unwrap();
    let maps = d.mappings();
    assert_eq!(maps.len(), 2);
    assert_eq!(maps[0].hva().unwrap().0, a.hva().0 + PAGE);
    assert_eq!(maps[1].hva().unwrap().0, b.hva().0);
    assert_eq!(maps[1].iova().start(), Iova(0x9000));
    b.write(0, b"slot1").unwrap();
    let mut out = [0; 5];
    d.dma_read(Iova(0x9000), &mut out).unwrap();
    assert_eq!(&out, b"slot1");
    // the mapping keeps the backing alive after the slot is gone
    t.remove(1).unwrap();
    drop(b);
    d.dma_read(Iova(0x9000), &mut out).unwrap();
    assert_eq!(&out, b"slot1");
}

#[test]
fn vaddr_invalidate_and_update() {
    let d = DmaSpace::default();
    let (old, new) = (mem(2), mem(2));
    old.write(0, b"old").unwrap();
    new.write(0, b"new").unwrap();
    d.map_backing(Iova(0x10000), &old, 0, 2 * PAGE, Prot::RW)
        .unwrap();
    let id = d.mappings()[0].id();
    // update of a valid mapping, of nothing, of a different size
    assert_eq!(
        errno(d.update_vaddr(Iova(0x10000), 2 * PAGE, &new, 0)),
        libc::EINVAL
    );
    assert_eq!(
        errno(d.update_vaddr(Iova(0x40000), 2 * PAGE, &new, 0)),
        libc::ENOENT
    );
    assert_eq!(
        errno(d.invalidate_vaddr(Iova(0x10000), PAGE)),
        libc::EINVAL,
        "cuts it"
    );
    assert_eq!(
        d.invalidate_vaddr(Iova(0x10000), 2 * PAGE).unwrap(),
        2 * PAGE
    );
    assert_eq!(
        errno(d.invalidate_vaddr(Iova(0x10000), 2 * PAGE)),
        libc::EINVAL,
        "already"
    );
    // while invalid: translation EBUSY, copies EFAULT, and the old memory is not touched
    assert_eq!(
        errno(d.translate(Iova(0x10000), 8, Prot::READ)),
        libc::EBUSY
    );
    assert_eq!(
        errno(d.cursor().translate(Iova(0x10000), 8, Prot::READ)),
        libc::EBUSY
    );
    assert_eq!(errno(d.dma_write(Iova(0x10000), b"xxx")), libc::EFAULT);
    assert_eq!(
        errno(d.translate_sg(Iova(0x10000), 8, Prot::READ)),
        libc::EBUSY
    );
    assert_eq!(d.mappings()[0].hva(), None);
    assert_eq!(
        errno(d.update_vaddr(Iova(0x10000), PAGE, &new, 0)),
        libc::EINVAL,
        "size differs"
    );
    assert_eq!(
        errno(d.update_vaddr(Iova(0x11000), PAGE, &new, 0)),
        libc::EINVAL,
        "iova differs"
    );
    d.update_vaddr(Iova(0x10000), 2 * PAGE, &new, 0).unwrap();
    let mut out = [0; 3];
    d.dma_read(Iova(0x10000), &mut out).unwrap();
    assert_eq!(&out, b"new");
    old.read(0, &mut out).unwrap();
    assert_eq!(&out, b"old");
    assert_eq!(d.mappings()[0].id(), id, "the mapping keeps its identity");
    // an invalidated mapping can still be unmapped
    d.invalidate_vaddr(Iova(0x10000), 2 * PAGE).unwrap();
    assert_eq!(d.unmap(Iova(0x10000), 2 * PAGE).unwrap(), 2 * PAGE);
}

#[test]
fn translation_waits_for_a_vaddr_update_up_to_the_configured_time() {
    let d = DmaSpace::new(DmaConfig {
        vaddr_wait: Duration::from_secs(5),
        ..Default::default()
    })
    .unwrap();
    let (old, new) = (mem(1), mem(1));
    new.write(0, b"fresh").unwrap();
    d.map_backing(Iova(0), &old, 0, PAGE, Prot::RW).unwrap();
    d.invalidate_vaddr(Iova(0), PAGE).unwrap();
    let updater = {
        let (d, new) = (d.clone(), new.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            d.update_vaddr(Iova(0), PAGE, &new, 0).unwrap();
        })
    };
    let mut out = [0; 5];
    d.dma_read(Iova(0), &mut out).unwrap();
    assert_eq!(
        &out, b"fresh",
        "the read waited for the update and saw the new memory"
    );
    updater.join().unwrap();
    // with nobody updating, the wait ends with EBUSY after the configured time
    let short = DmaSpace::new(DmaConfig {
        vaddr_wait: Duration::from_millis(30),
        ..Default::default()
    })
    .unwrap();
    short.map_backing(Iova(0), &old, 0, PAGE, Prot::RW).unwrap();
    short.invalidate_vaddr(Iova(0), PAGE).unwrap();
    let start = Instant::now();
    assert_eq!(errno(short.translate(Iova(0), 1, Prot::READ)), libc::EBUSY);
    assert!(start.elapsed() >= Duration::from_millis(30));
}

#[test]
fn a_cursor_follows_changes() {
    let d = DmaSpace::default();
    let (a, b) = (mem(1), mem(1));
    d.map_backing(Iova(0), &a, 0, PAGE, Prot::RW).unwrap();
    let mut c = d.cursor();
    assert_eq!(
        c.translate(Iova(8), 8, Prot::READ).unwrap().hva.0,
        a.hva().0 + 8
    );
    assert_eq!(c.translate(Iova(8), 8, Prot::WRITE).unwrap().len, 8);
    d.unmap(Iova(0), PAGE).unwrap();
    assert_eq!(errno(c.translate(Iova(8), 8, Prot::READ)), libc::EFAULT);
    d.map_backing(Iova(0), &b, 0, PAGE, Prot::READ).unwrap();
    assert_eq!(
        c.translate(Iova(8), 8, Prot::READ).unwrap().hva.0,
        b.hva().0 + 8
    );
    assert_eq!(errno(c.translate(Iova(8), 8, Prot::WRITE)), libc::EPERM);
}

#[test]
fn dirty_bits_are_exactly_the_pages_written() {
    let d = DmaSpace::default();
    let b = mem(200);
    d.map_backing(Iova(0), &b, 0, 100 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(100 * PAGE), &b, 100 * PAGE, 30 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(200 * PAGE), &b, 150 * PAGE, 10 * PAGE, Prot::RW)
        .unwrap();
    assert_eq!(
        errno(d.get_and_clear_dirty(Iova(0), 130 * PAGE, PAGE)),
        libc::EINVAL,
        "off"
    );
    d.dma_write(Iova(0), &[1]).unwrap(); // before tracking: not recorded
    d.start_dirty_tracking().unwrap();
    // across the first mapping boundary: pages 99, 100, 101
    d.dma_write(Iova(99 * PAGE + 10), &vec![1; 2 * PAGE as usize])
        .unwrap();
    d.translate(Iova(5 * PAGE), 1, Prot::WRITE).unwrap();
    d.translate(Iova(6 * PAGE), 1, Prot::READ).unwrap(); // reads mark nothing
    d.cursor()
        .translate(Iova(129 * PAGE), 1, Prot::WRITE)
        .unwrap();
    d.translate_sg(Iova(200 * PAGE), 2 * PAGE, Prot::WRITE)
        .unwrap();
    let pages = |words: &[u64]| -> Vec<u64> {
        (0..words.len() as u64 * 64)
            .filter(|&i| words[(i / 64) as usize] >> (i % 64) & 1 == 1)
            .collect()
    };
    // the range is made of whole mappings with a hole: 0 .. 210 pages
    let bits = d.get_and_clear_dirty(Iova(0), 210 * PAGE, PAGE).unwrap();
    assert_eq!(bits.len(), 4);
    assert_eq!(pages(&bits), vec![5, 99, 100, 101, 129, 200, 201]);
    assert_eq!(
        pages(&d.get_and_clear_dirty(Iova(0), 210 * PAGE, PAGE).unwrap()),
        Vec::<u64>::new(),
        "cleared"
    );
    // a range of one mapping in the middle, so bits are shifted into place
    d.dma_write(Iova(101 * PAGE), &[1]).unwrap();
    assert_eq!(
        pages(
            &d.get_and_clear_dirty(Iova(100 * PAGE), 30 * PAGE, PAGE)
                .unwrap()
        ),
        vec![1]
    );
    // rules: smallest page size only, no cutting a mapping
    assert_eq!(
        errno(d.get_and_clear_dirty(Iova(0), 130 * PAGE, 2 << 20)),
        libc::EINVAL
    );
    assert_eq!(
        errno(d.get_and_clear_dirty(Iova(PAGE), 99 * PAGE, PAGE)),
        libc::EINVAL
    );
    // mappings made while tracking are tracked; stopping drops the bits
    d.map_backing(Iova(300 * PAGE), &b, 0, PAGE, Prot::RW)
        .unwrap();
    d.dma_write(Iova(300 * PAGE), &[1]).unwrap();
    assert_eq!(
        pages(&d.get_and_clear_dirty(Iova(300 * PAGE), PAGE, PAGE).unwrap()),
        vec![0]
    );
    d.stop_dirty_tracking();
    assert_eq!(
        errno(d.get_and_clear_dirty(Iova(300 * PAGE), PAGE, PAGE)),
        libc::EINVAL
    );
}

/// Where type1 answers differently from what one might guess, memvisor answers as type1 does.
#[test]
fn errnos_and_their_order_follow_type1() {
    let b = mem(8);
    let d = DmaSpace::new(DmaConfig {
        max_mappings: 2,
        aperture: (Iova(0), Iova(0xff_ffff)),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(2 * PAGE), &b, PAGE, PAGE, Prot::WRITE)
        .unwrap();
    // vfio_dma_do_map: overlap (EEXIST) before the entry limit (ENOSPC) before the valid
    // IOVA ranges (EINVAL). `check_map` answers each as the map does, mapping nothing.
    let far = Iova(1 << 40);
    assert_eq!(
        errno(d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW)),
        libc::EEXIST
    );
    assert_eq!(errno(d.check_map(Iova(0), PAGE, Prot::RW)), libc::EEXIST);
    assert_eq!(
        errno(d.map_backing(far, &b, 0, PAGE, Prot::RW)),
        libc::ENOSPC
    );
    assert_eq!(errno(d.check_map(far, PAGE, Prot::RW)), libc::ENOSPC);
    d.unmap(Iova(2 * PAGE), PAGE).unwrap();
    assert_eq!(
        errno(d.map_backing(far, &b, 0, PAGE, Prot::RW)),
        libc::EINVAL
    );
    assert_eq!(errno(d.check_map(far, PAGE, Prot::RW)), libc::EINVAL);
    assert_eq!(errno(d.check_map(Iova(PAGE), 0, Prot::RW)), libc::EINVAL);
    d.check_map(Iova(2 * PAGE), PAGE, Prot::RW).unwrap();
    assert_eq!(d.len(), 1, "check_map maps nothing");
    // vfio_dma_rw: nothing mapped or nothing to copy is EINVAL; a CPU write needs READ too.
    d.map_backing(Iova(2 * PAGE), &b, PAGE, PAGE, Prot::WRITE)
        .unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(errno(d.dma_read(Iova(PAGE), &mut buf)), libc::EINVAL);
    assert_eq!(errno(d.dma_write(Iova(PAGE - 8), &buf)), libc::EINVAL);
    assert_eq!(errno(d.dma_read(Iova(0), &mut [])), libc::EINVAL);
    assert_eq!(errno(d.dma_write(Iova(0), &[])), libc::EINVAL);
    assert_eq!(errno(d.dma_write(Iova(2 * PAGE), &buf)), libc::EPERM);
    d.dma_write(Iova(0), &buf).unwrap();
    // Translation is a device's IOMMU lookup, not vfio_dma_rw: unmapped is EFAULT there.
    assert_eq!(errno(d.translate(Iova(PAGE), 8, Prot::READ)), libc::EFAULT);
    // VFIO_DMA_MAP_FLAG_VADDR looks up the range: one that overlaps an invalidated mapping
    // without starting at it is EINVAL, one that touches nothing ENOENT.
    d.invalidate_vaddr(Iova(0), PAGE).unwrap();
    let e = d.update_vaddr(Iova(0), 2 * PAGE, &b, 0).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = d.update_vaddr(Iova(PAGE), PAGE, &b, 0).unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "{e}");
    d.update_vaddr(Iova(0), PAGE, &b, 0).unwrap();
}

/// The two kernels' rules for an invalidated host address, each as a VMM would see it.
#[test]
fn vaddr_rules_follow_the_kernel_version_chosen() {
    use memvisor::dma::VaddrRule;
    for rule in [VaddrRule::Wait, VaddrRule::Refuse] {
        let b = mem(8);
        let d = DmaSpace::new(DmaConfig {
            vaddr_rule: rule,
            vaddr_wait: Duration::from_millis(20),
            registry: Some(memvisor::dma::PinRegistry::new(
                memvisor::dma::LockLimit::Unlimited,
            )),
            ..DmaConfig::default()
        })
        .unwrap();
        d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::RW).unwrap();
        d.map_backing(Iova(16 * PAGE), &b, 4 * PAGE, 4 * PAGE, Prot::RW)
            .unwrap();
        d.invalidate_vaddr(Iova(0), 4 * PAGE).unwrap();
        let mut buf = [0u8; 8];
        // The other mapping: usable under Wait (5.12-6.2), refused under Refuse (6.3 on).
        let other = d.dma_read(Iova(16 * PAGE), &mut buf);
        let pin = d.pin_pages(&[16], Prot::READ);
        // The invalidated mapping itself.
        let start = Instant::now();
        let own = d.dma_read(Iova(0), &mut buf);
        let waited = start.elapsed();
        match rule {
            VaddrRule::Wait => {
                other.unwrap();
                pin.unwrap();
                d.unpin_pages(&[16]).unwrap();
                assert_eq!(own.unwrap_err().errno(), libc::EFAULT);
                assert!(waited >= Duration::from_millis(20), "waited {waited:?}");
            }
            VaddrRule::Refuse => {
                assert_eq!(other.unwrap_err().errno(), libc::EBUSY);
                assert_eq!(pin.unwrap_err().errno(), libc::EBUSY);
                assert_eq!(own.unwrap_err().errno(), libc::EBUSY);
                assert!(waited < Duration::from_millis(20), "waited {waited:?}");
            }
        }
        // Translation fails only on the invalidated mapping, under both rules.
        d.translate(Iova(16 * PAGE), 8, Prot::READ).unwrap();
        assert_eq!(errno(d.translate(Iova(0), 8, Prot::READ)), libc::EBUSY);
        d.update_vaddr(Iova(0), 4 * PAGE, &b, 0).unwrap();
        d.dma_read(Iova(16 * PAGE), &mut buf).unwrap();
        // Invalidation with a device that pins attached: asked back under Wait, refused under
        // Refuse.
        let id = d.add_unmap_notifier(|_, _| {});
        let got = d.invalidate_vaddr(Iova(0), 4 * PAGE);
        match rule {
            VaddrRule::Wait => assert_eq!(got.unwrap(), 4 * PAGE),
            VaddrRule::Refuse => assert_eq!(got.unwrap_err().errno(), libc::EBUSY),
        }
        assert!(d.remove_unmap_notifier(id));
    }
}

/// type1 ignores an unpin of a page that is not pinned; memvisor refuses the whole call, so a
/// device's bookkeeping bug cannot drop a pin another device holds. A documented choice.
#[test]
fn unpinning_a_page_that_is_not_pinned_is_einval_and_unpins_nothing() {
    let b = mem(8);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(memvisor::dma::PinRegistry::new(
            memvisor::dma::LockLimit::Unlimited,
        )),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    d.pin_pages(&[1, 2], Prot::RW).unwrap();
    let e = d.unpin_pages(&[1, 2, 3]).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert_eq!(d.device_pinned_pages(), 2, "nothing was unpinned");
    d.unpin_pages(&[1, 2]).unwrap();
}

/// A peer's memory (vfio-user's map without a descriptor): a full mapping in every rule, but its
/// bytes are reached only through the transport handed to `dma_read_via` / `dma_write_via`.
#[test]
fn remote_mappings_follow_type1_and_reach_memory_only_through_the_peer() {
    use std::cell::RefCell;
    let d = DmaSpace::default();
    let b = mem(8);
    b.write(0, &[0xaa; 4 * PAGE as usize]).unwrap();
    // [0, 4 pages) host memory, [4, 8) the peer's, RW; [8, 9) the peer's, read-only.
    d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::RW).unwrap();
    d.map_remote(Iova(4 * PAGE), 4 * PAGE, Prot::RW).unwrap();
    d.map_remote(Iova(8 * PAGE), PAGE, Prot::READ).unwrap();
    // type1's checks apply as to any map
    assert_eq!(
        errno(d.map_remote(Iova(5 * PAGE), PAGE, Prot::RW)),
        libc::EEXIST
    );
    assert_eq!(
        errno(d.map_remote(Iova(0x800), PAGE, Prot::RW)),
        libc::EINVAL
    );
    assert_eq!(errno(d.map_remote(Iova(0), 0, Prot::RW)), libc::EINVAL);
    assert!(d.mappings()[1].is_remote() && d.mappings()[1].hva().is_none());

    // Nothing that needs a host address reaches it: EFAULT, naming the mapping.
    let e = d.translate(Iova(5 * PAGE), 8, Prot::READ).unwrap_err();
    assert_eq!(e.errno(), libc::EFAULT);
    assert!(e.to_string().contains("0x4000, 0x7fff"), "{e}");
    assert_eq!(
        errno(d.cursor().translate(Iova(5 * PAGE), 8, Prot::READ)),
        libc::EFAULT
    );
    assert_eq!(errno(d.pin_pages(&[4], Prot::READ)), libc::EFAULT);
    let mut buf = vec![0u8; 2 * PAGE as usize];
    assert_eq!(errno(d.dma_read(Iova(3 * PAGE), &mut buf)), libc::EFAULT);
    assert_eq!(errno(d.dma_write(Iova(3 * PAGE), &buf)), libc::EFAULT);
    assert_eq!(d.device_pinned_pages(), 0);

    // A device can check a whole request over both kinds before it moves a byte.
    d.check_access(Iova(3 * PAGE), 6 * PAGE, Prot::READ)
        .unwrap();
    assert_eq!(
        errno(d.check_access(Iova(3 * PAGE), 6 * PAGE, Prot::WRITE)),
        libc::EPERM
    );
    assert_eq!(
        errno(d.check_access(Iova(8 * PAGE), PAGE + 1, Prot::READ)),
        libc::EFAULT
    );

    // Through the peer: host pieces copied here, the peer's handed over with their IOVAs.
    let peer = RefCell::new(vec![0x55u8; 5 * PAGE as usize]); // the peer's memory at 4 pages
    let calls = RefCell::new(Vec::new());
    let read = |iova: Iova, part: &mut [u8]| -> memvisor::Result<()> {
        calls.borrow_mut().push((iova.0, part.len()));
        let at = (iova.0 - 4 * PAGE) as usize;
        part.copy_from_slice(&peer.borrow()[at..at + part.len()]);
        Ok(())
    };
    let mut buf = vec![0u8; 2 * PAGE as usize];
    d.dma_read_via(Iova(3 * PAGE), &mut buf, read).unwrap();
    assert!(buf[..PAGE as usize].iter().all(|&x| x == 0xaa));
    assert!(buf[PAGE as usize..].iter().all(|&x| x == 0x55));
    assert_eq!(*calls.borrow(), vec![(4 * PAGE, PAGE as usize)]);

    d.start_dirty_tracking().unwrap();
    let write = |iova: Iova, part: &[u8]| -> memvisor::Result<()> {
        let at = (iova.0 - 4 * PAGE) as usize;
        peer.borrow_mut()[at..at + part.len()].copy_from_slice(part);
        Ok(())
    };
    d.dma_write_via(Iova(4 * PAGE - 10), &[7u8; 20], write)
        .unwrap();
    let mut host = [0u8; 10];
    b.read(4 * PAGE - 10, &mut host).unwrap();
    assert_eq!(host, [7; 10]);
    assert_eq!(&peer.borrow()[..10], &[7; 10]);
    // the device wrote the peer's page too: it is dirty like any other
    assert_eq!(
        d.get_and_clear_dirty(Iova(0), 4 * PAGE, PAGE).unwrap(),
        vec![0b1000]
    );
    assert_eq!(
        d.get_and_clear_dirty(Iova(4 * PAGE), 4 * PAGE, PAGE)
            .unwrap(),
        vec![0b1]
    );

    // Checks come first: a write to the read-only remote page or past the end moves nothing.
    let never = |_: Iova, _: &[u8]| -> memvisor::Result<()> { panic!("must not be called") };
    assert_eq!(
        d.dma_write_via(Iova(8 * PAGE), &[1], never)
            .unwrap_err()
            .errno(),
        libc::EPERM
    );
    assert_eq!(
        d.dma_write_via(Iova(8 * PAGE), &[1; 2 * PAGE as usize], never)
            .unwrap_err()
            .errno(),
        libc::EPERM
    );
    // The peer's error stops the copy and is returned as it is.
    let refuse = |iova: Iova, _: &mut [u8]| -> memvisor::Result<()> {
        Err(memvisor::Error::Fault {
            space: "peer",
            addr: iova.0,
            start: iova.0,
            len: 1,
        })
    };
    let mut one = [0u8; 1];
    assert_eq!(
        d.dma_read_via(Iova(5 * PAGE), &mut one, refuse)
            .unwrap_err()
            .errno(),
        libc::EFAULT
    );

    // There is no host address to invalidate or update; unmap works as for any mapping.
    assert_eq!(
        errno(d.invalidate_vaddr(Iova(4 * PAGE), 4 * PAGE)),
        libc::EINVAL
    );
    assert_eq!(
        errno(d.update_vaddr(Iova(4 * PAGE), 4 * PAGE, &b, 0)),
        libc::EINVAL
    );
    assert_eq!(
        errno(d.unmap(Iova(5 * PAGE), PAGE)),
        libc::EINVAL,
        "cuts it"
    );
    assert_eq!(d.unmap(Iova(4 * PAGE), 4 * PAGE).unwrap(), 4 * PAGE);
    assert_eq!(d.len(), 2);
}

/// Eager mode pins every mapping with host memory and leaves a peer's alone.
#[test]
fn eager_mode_pins_around_remote_mappings() {
    use memvisor::dma::{LockLimit, PinMode, PinRegistry};
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    let b = mem(4);
    d.map_remote(Iova(0), 4 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(8 * PAGE), &b, 0, 4 * PAGE, Prot::RW)
        .unwrap();
    if let Err(e) = d.set_pin_mode(PinMode::Eager) {
        assert_eq!(e.errno(), libc::ENOMEM, "{e}");
        common::skipped(&format!(
            "needs RLIMIT_MEMLOCK of 16 KiB or more to pin ({e})"
        ));
        return;
    }
    assert_eq!(registry.locked_bytes(), 4 * PAGE);
    d.map_remote(Iova(16 * PAGE), PAGE, Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), 4 * PAGE);
    assert_eq!(errno(d.extents(Iova(0))), libc::EINVAL);
    assert_eq!(d.extents(Iova(8 * PAGE)).unwrap().len(), 1);
    d.unmap_all().unwrap();
    assert_eq!(registry.locked_bytes(), 0);
}

/// Plain `translate` remembers the last mapping per thread; nothing it remembers may outlive a
/// change: unmap, remap elsewhere, a second space at the same IOVA, dirty logging turned on.
#[test]
fn plain_translate_never_answers_from_a_stale_hit() {
    // Page tables kept from the first mapping: the stale answers this looks for would come
    // from them as well as from the sorted index.
    let a = always_paged();
    let b = always_paged();
    let (ma, mb) = (mem(4), mem(4));
    a.map_backing(Iova(0), &ma, 0, 4 * PAGE, Prot::RW).unwrap();
    b.map_backing(Iova(0), &mb, PAGE, 2 * PAGE, Prot::READ)
        .unwrap();
    let hva = |d: &DmaSpace, iova: u64, acc| d.translate(Iova(iova), 8, acc).map(|t| t.hva.0);
    let base_a = hva(&a, 0, Prot::READ).unwrap();
    assert_eq!(
        hva(&a, PAGE + 1, Prot::READ).unwrap(),
        base_a + PAGE + 1,
        "hit"
    );
    // Another space at the same IOVA: its own answer, its own protection.
    let base_b = hva(&b, 0, Prot::READ).unwrap();
    assert_ne!(base_a, base_b);
    assert_eq!(errno(b.translate(Iova(0), 8, Prot::WRITE)), libc::EPERM);
    assert_eq!(
        errno(b.translate(Iova(2 * PAGE), 8, Prot::READ)),
        libc::EFAULT
    );
    assert_eq!(hva(&a, 8, Prot::WRITE).unwrap(), base_a + 8);
    // Unmapped: EFAULT at once, though the thread hit it just before.
    a.unmap(Iova(0), 4 * PAGE).unwrap();
    assert_eq!(errno(a.translate(Iova(8), 8, Prot::READ)), libc::EFAULT);
    // Mapped again elsewhere in the backing: the new address.
    a.map_backing(Iova(0), &ma, 2 * PAGE, 2 * PAGE, Prot::RW)
        .unwrap();
    assert_eq!(hva(&a, 8, Prot::READ).unwrap(), base_a + 2 * PAGE + 8);
    // A hit for reads must not let writes skip the dirty log once it is on.
    a.start_dirty_tracking().unwrap();
    assert_eq!(hva(&a, PAGE, Prot::READ).unwrap(), base_a + 3 * PAGE);
    a.translate(Iova(PAGE + 3), 1, Prot::WRITE).unwrap();
    a.translate(Iova(PAGE + 5), 1, Prot::WRITE).unwrap();
    assert_eq!(
        a.get_and_clear_dirty(Iova(0), 2 * PAGE, PAGE).unwrap(),
        vec![0b10]
    );
    // Another thread has its own memory of hits.
    let a2 = a.clone();
    std::thread::spawn(move || {
        assert_eq!(a2.translate(Iova(4), 4, Prot::READ).unwrap().len, 4);
    })
    .join()
    .unwrap();
    // Lengths are clipped at the mapping's end on a hit too.
    assert_eq!(
        a.translate(Iova(2 * PAGE - 3), 100, Prot::READ)
            .unwrap()
            .len,
        3
    );
    assert_eq!(errno(a.translate(Iova(0), 0, Prot::READ)), libc::EINVAL);
}

/// A cursor's `read` / `write` answer exactly as `dma_read` / `dma_write`, on its shortcut
/// (inside the last mapping hit) and off it.
#[test]
fn cursor_copies_follow_dma_read_and_dma_write() {
    let d = DmaSpace::default();
    let b = mem(8);
    d.map_backing(Iova(0), &b, 0, 2 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(2 * PAGE), &b, 2 * PAGE, PAGE, Prot::READ)
        .unwrap();
    let mut c = d.cursor();
    c.write(Iova(10), &[1, 2, 3]).unwrap(); // slow path, then remembered
    c.write(Iova(PAGE - 1), &[4, 5]).unwrap(); // shortcut, across a page inside the mapping
    let mut got = [0u8; 3];
    c.read(Iova(10), &mut got).unwrap();
    assert_eq!(got, [1, 2, 3]);
    let mut two = [0u8; 2];
    b.read(PAGE - 1, &mut two).unwrap();
    assert_eq!(two, [4, 5]);
    // Across two mappings (the shortcut does not cover it): one piece each.
    let mut span = [0u8; 8];
    c.read(Iova(2 * PAGE - 4), &mut span).unwrap();
    // Errors are dma_read's: EPERM on the read-only mapping, EINVAL past the end, empty EINVAL.
    assert_eq!(errno(c.write(Iova(2 * PAGE - 4), &[0; 8])), libc::EPERM);
    assert_eq!(errno(c.write(Iova(2 * PAGE + 4), &[0; 1])), libc::EPERM);
    assert_eq!(errno(c.read(Iova(3 * PAGE - 4), &mut [0; 8])), libc::EINVAL);
    assert_eq!(errno(c.read(Iova(0), &mut [])), libc::EINVAL);
    // Past the end of the mapping hit: not taken by the shortcut.
    c.read(Iova(0), &mut [0; 1]).unwrap();
    assert_eq!(errno(c.write(Iova(2 * PAGE - 1), &[0; 2])), libc::EPERM);
    // Dirty pages are marked on the shortcut too.
    d.start_dirty_tracking().unwrap();
    c.write(Iova(5), &[9]).unwrap(); // stale generation: slow path
    c.write(Iova(PAGE + 5), &[9]).unwrap(); // shortcut
    assert_eq!(
        d.get_and_clear_dirty(Iova(0), 2 * PAGE, PAGE).unwrap(),
        vec![0b11]
    );
    // After an unmap the shortcut is gone: dma_read's EINVAL at once.
    d.unmap(Iova(0), 2 * PAGE).unwrap();
    assert_eq!(errno(c.read(Iova(10), &mut got)), libc::EINVAL);
}

/// Under Linux 6.3's rule, an invalidated host address anywhere stops every copy, the
/// cursor's shortcut included.
#[test]
fn cursor_copies_stop_while_a_vaddr_is_invalidated_under_the_refuse_rule() {
    let d = DmaSpace::new(DmaConfig {
        vaddr_rule: memvisor::dma::VaddrRule::Refuse,
        ..DmaConfig::default()
    })
    .unwrap();
    let b = mem(2);
    d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(PAGE), &b, PAGE, PAGE, Prot::RW).unwrap();
    let mut c = d.cursor();
    c.read(Iova(8), &mut [0; 4]).unwrap();
    d.invalidate_vaddr(Iova(PAGE), PAGE).unwrap();
    assert_eq!(errno(c.read(Iova(8), &mut [0; 4])), libc::EBUSY);
    assert_eq!(errno(c.write(Iova(8), &[0; 4])), libc::EBUSY);
    d.update_vaddr(Iova(PAGE), PAGE, &b, PAGE).unwrap();
    c.read(Iova(8), &mut [0; 4]).unwrap();
}

/// Plain `dma_read` / `dma_write` take the thread's last hit as a shortcut; it must never
/// outlive a change nor skip a check: unmap, protection, the dirty log, the refuse rule (also
/// when a translation made the hit).
#[test]
fn plain_copies_never_take_a_stale_shortcut() {
    let d = DmaSpace::new(DmaConfig {
        vaddr_rule: memvisor::dma::VaddrRule::Refuse,
        page_table_from: 0,
        ..DmaConfig::default()
    })
    .unwrap();
    let b = mem(8);
    d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(4 * PAGE), &b, 4 * PAGE, PAGE, Prot::READ)
        .unwrap();
    d.map_backing(Iova(8 * PAGE), &b, 5 * PAGE, PAGE, Prot::RW)
        .unwrap();
    d.dma_write(Iova(8), &[1, 2]).unwrap();
    d.dma_write(Iova(3 * PAGE), &[3]).unwrap(); // the shortcut
    let mut one = [0u8; 1];
    d.dma_read(Iova(3 * PAGE), &mut one).unwrap();
    assert_eq!(one, [3]);
    // Read-only: a read remembers it, a write must still be refused.
    d.dma_read(Iova(4 * PAGE), &mut one).unwrap();
    assert_eq!(errno(d.dma_write(Iova(4 * PAGE), &[1])), libc::EPERM);
    // Past the end of the mapping last hit: not the shortcut, and EINVAL where unmapped.
    d.dma_read(Iova(8 * PAGE), &mut one).unwrap();
    assert_eq!(
        errno(d.dma_read(Iova(9 * PAGE - 1), &mut [0; 2])),
        libc::EINVAL
    );
    // Logged writes are marked, one after another in the same mapping.
    d.start_dirty_tracking().unwrap();
    d.dma_write(Iova(PAGE), &[1]).unwrap();
    d.dma_write(Iova(2 * PAGE), &[1]).unwrap();
    d.dma_read(Iova(0), &mut one).unwrap();
    d.dma_write(Iova(3 * PAGE), &[1]).unwrap();
    assert_eq!(
        d.get_and_clear_dirty(Iova(0), 4 * PAGE, PAGE).unwrap(),
        vec![0b1110]
    );
    // Another mapping's vaddr invalidated under Linux 6.3's rule: every copy is EBUSY.
    d.dma_read(Iova(0), &mut one).unwrap();
    d.invalidate_vaddr(Iova(8 * PAGE), PAGE).unwrap();
    assert_eq!(errno(d.dma_read(Iova(0), &mut one)), libc::EBUSY);
    // A translation still answers there and becomes the last hit, but not one copies take.
    d.translate(Iova(0), 1, Prot::READ).unwrap();
    assert_eq!(errno(d.dma_read(Iova(0), &mut one)), libc::EBUSY);
    assert_eq!(errno(d.dma_write(Iova(0), &[1])), libc::EBUSY);
    d.update_vaddr(Iova(8 * PAGE), PAGE, &b, 5 * PAGE).unwrap();
    // Unmapped: EINVAL at once, though the thread copied there just before.
    d.dma_read(Iova(0), &mut one).unwrap();
    d.unmap(Iova(0), 4 * PAGE).unwrap();
    assert_eq!(errno(d.dma_read(Iova(0), &mut one)), libc::EINVAL);
    assert_eq!(errno(d.dma_write(Iova(0), &[1])), libc::EINVAL);
}

/// Translations of small mappings are answered through a page index beside the sorted one; it
/// has edges (2 MiB leaves, 8 GiB nodes, a 512 GiB window, a 127-page size limit, a budget of
/// leaves that scattered pages exhaust). At each of them, and after unmaps and remaps, every
/// path answers exactly: plain `translate`, a long-lived cursor, and a fresh cursor per probe.
/// A cursor walks its page-table region from the snapshot it holds; after a change it must
/// walk the new snapshot's, never the old region's words.
#[test]
fn a_cursor_never_answers_from_a_snapshot_it_let_go() {
    let b = mem(16);
    let base = b.hva().0;
    // A page table from the first mapping, so the cursor's regions are in play.
    let d = always_paged();
    let (a, x) = (0x10_0000, 0x20_0000);
    d.map_backing(Iova(a), &b, 0, PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(x), &b, PAGE, PAGE, Prot::RW).unwrap();
    let mut cursor = d.cursor();
    let hva = |cursor: &mut memvisor::dma::DmaCursor, iova: u64| {
        cursor.translate(Iova(iova), 8, Prot::READ).map(|t| t.hva.0)
    };
    assert_eq!(hva(&mut cursor, a).unwrap(), base);
    assert_eq!(hva(&mut cursor, x).unwrap(), base + PAGE);
    d.unmap(Iova(x), PAGE).unwrap();
    // The first translation after the change moves the cursor to the new snapshot (through
    // `a`, a miss in the same region); the next must not find `x` in the old region.
    assert_eq!(hva(&mut cursor, a).unwrap(), base);
    assert_eq!(errno(hva(&mut cursor, x)), libc::EFAULT);
    d.map_backing(Iova(x), &b, 2 * PAGE, PAGE, Prot::RW)
        .unwrap();
    assert_eq!(hva(&mut cursor, a).unwrap(), base);
    assert_eq!(hva(&mut cursor, x).unwrap(), base + 2 * PAGE);
}

#[test]
fn translations_are_exact_at_every_edge_of_the_page_index() {
    const MIB2: u64 = 2 << 20;
    const WINDOW: u64 = 1 << 39;
    let b = mem(1024);
    let base = b.hva().0;
    let d = DmaSpace::default();
    // (iova, pages, backing page)
    let mut maps = vec![
        (MIB2 - 2 * PAGE, 4, 0),
        ((8 << 30) - PAGE, 2, 4),
        (WINDOW - 2 * PAGE, 2, 8),
        (WINDOW, 3, 10),
        (1 << 30, 127, 16),
        ((1 << 30) + 128 * PAGE, 128, 150),
        (u64::MAX - PAGE + 1, 1, 300),
    ];
    // Single pages 2 MiB apart: far more leaves than the index's budget allows.
    maps.extend((0..300).map(|i| ((64 << 30) + i * MIB2 + PAGE, 1, 400 + i)));
    for &(iova, pages, at) in &maps {
        d.map_backing(Iova(iova), &b, at * PAGE, pages * PAGE, Prot::RW)
            .unwrap();
    }
    let mut cursor = d.cursor();
    let check = |cursor: &mut memvisor::dma::DmaCursor, maps: &[(u64, u64, u64)], shift: u64| {
        for &(iova, pages, at) in maps {
            let end = iova.wrapping_add(pages * PAGE);
            for probe in [iova, iova + pages * PAGE / 2 + 8, end.wrapping_sub(1)] {
                let want = (
                    base + (at + shift) * PAGE + (probe - iova),
                    64.min(end.wrapping_sub(probe)),
                );
                for access in [Prot::READ, Prot::WRITE] {
                    let got = [
                        d.translate(Iova(probe), 64, access),
                        cursor.translate(Iova(probe), 64, access),
                        d.cursor().translate(Iova(probe), 64, access),
                    ];
                    for (how, t) in got.into_iter().enumerate() {
                        let t = t.unwrap_or_else(|e| panic!("{probe:#x} path {how}: {e}"));
                        assert_eq!((t.hva.0, t.len), want, "{probe:#x} path {how}");
                    }
                }
            }
        }
    };
    // The space and `cursor` refuse `access` at `probe` with `want`.
    let refuse = |cursor: &mut memvisor::dma::DmaCursor, probe: u64, access: Prot, want: i32| {
        assert_eq!(errno(d.translate(Iova(probe), 8, access)), want);
        assert_eq!(errno(cursor.translate(Iova(probe), 8, access)), want);
    };
    // The space and `cursor` fault on `probe`.
    let faults = |cursor: &mut memvisor::dma::DmaCursor, probe: u64| {
        refuse(cursor, probe, Prot::READ, libc::EFAULT);
    };
    let unmapped = |cursor: &mut memvisor::dma::DmaCursor, maps: &[(u64, u64, u64)]| {
        for &(iova, pages, _) in maps {
            for probe in [iova, iova + (pages * PAGE - 1)] {
                faults(cursor, probe);
                assert_eq!(
                    errno(d.cursor().translate(Iova(probe), 8, Prot::READ)),
                    libc::EFAULT
                );
            }
        }
    };
    check(&mut cursor, &maps, 0);
    // Neighbours of the mappings stay unmapped.
    for probe in [MIB2 - 2 * PAGE - 1, MIB2 + 2 * PAGE, (1 << 30) + 127 * PAGE] {
        faults(&mut cursor, probe);
    }
    // Every other mapping goes; the rest still answer, the gone ones fault.
    let (gone, kept): (Vec<_>, Vec<_>) = maps.iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let gone: Vec<_> = gone.into_iter().map(|(_, m)| *m).collect();
    let kept: Vec<_> = kept.into_iter().map(|(_, m)| *m).collect();
    for &(iova, pages, _) in &gone {
        d.unmap(Iova(iova), pages * PAGE).unwrap();
    }
    check(&mut cursor, &kept, 0);
    unmapped(&mut cursor, &gone);
    // Mapped again one backing page further on: the new addresses, never the old.
    for &(iova, pages, at) in &gone {
        d.map_backing(Iova(iova), &b, (at + 1) * PAGE, pages * PAGE, Prot::RW)
            .unwrap();
    }
    check(&mut cursor, &gone, 1);
    check(&mut cursor, &kept, 0);
    // Read-only now: writes are refused on every path, reads still answer.
    let (iova, pages, at) = gone[0];
    d.unmap(Iova(iova), pages * PAGE).unwrap();
    d.map_backing(Iova(iova), &b, at * PAGE, pages * PAGE, Prot::READ)
        .unwrap();
    refuse(&mut cursor, iova, Prot::WRITE, libc::EPERM);
    assert_eq!(
        d.translate(Iova(iova), 8, Prot::READ).unwrap().hva.0,
        base + at * PAGE
    );
    d.unmap_all().unwrap();
    unmapped(&mut cursor, &maps);
}

/// With a 2 MiB dirty page size, guest memory cut at a slot edge that is not 2 MiB aligned
/// makes mappings that start or end inside a bitmap page. Every byte a device writes must
/// still reach the bit of the 2 MiB page that holds it, whichever mapping piece it went
/// through, through every path that marks pages: copies, translations, a cursor, pins (issue
/// 34: the bitmap was sized and indexed from each piece's start, and a write at 0x1000 or
/// 0x350000 was lost).
#[test]
fn dirty_bits_cover_mapping_pieces_that_do_not_fill_a_page() {
    const HUGE: u64 = 2 << 20;
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), mem(0x101))).unwrap();
    t.insert(SlotSpec::new(1, Gpa(0x101000), mem(0x2ff)))
        .unwrap();
    let d = DmaSpace::new(DmaConfig {
        page_sizes: HUGE,
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_guest(Iova(0), &t.snapshot(), Gpa(0), 2 * HUGE, Prot::RW)
        .unwrap();
    let pieces: Vec<_> = d
        .mappings()
        .iter()
        .map(|m| (m.iova().start().0, m.iova().last().0))
        .collect();
    assert_eq!(pieces, [(0, 0x100fff), (0x101000, 0x3f_ffff)]);
    d.start_dirty_tracking().unwrap();
    d.get_and_clear_dirty(Iova(0), 2 * HUGE, HUGE).unwrap();
    type Write = fn(&DmaSpace, u64);
    let ways: [(&str, Write); 4] = [
        ("dma_write", |d, at| d.dma_write(Iova(at), &[1]).unwrap()),
        ("translate", |d, at| {
            d.translate(Iova(at), 1, Prot::WRITE).unwrap();
        }),
        ("cursor write", |d, at| {
            d.cursor().write(Iova(at), &[1]).unwrap()
        }),
        ("pin_pages", |d, at| {
            let page = at / PAGE; // pin_pages counts in IOVA pages
            d.pin_pages(&[page], Prot::RW).unwrap();
            d.unpin_pages(&[page]).unwrap();
        }),
    ];
    for (way, write) in ways {
        for (at, bit) in [
            (0x1000, 0),
            (0x100fff, 0),
            (0x102000, 0),
            (0x1f_ffff, 0),
            (0x20_0000, 1),
            (0x35_0000, 1),
            (0x3f_ffff, 1),
        ] {
            write(&d, at);
            let words = d.get_and_clear_dirty(Iova(0), 2 * HUGE, HUGE).unwrap();
            assert_eq!(words[0], 1 << bit, "{way} at {at:#x}");
        }
    }
    // And an unmap returning the bits reports it.
    d.dma_write(Iova(0x1000), &[1]).unwrap();
    let (bytes, words) = d.unmap_get_dirty(Iova(0), 2 * HUGE, HUGE).unwrap();
    assert_eq!((bytes, words[0]), (2 * HUGE, 1));
}
