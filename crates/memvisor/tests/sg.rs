//! Scatter-gather guards (`DmaSpace::hold_sg` / `pin_sg`): one walk gives a request's host
//! segments and holds its pages; dropping the guard lets them go. Checked against
//! `translate_sg`, the registry's counts, the dirty log, an unmap racing a held request and two
//! threads holding at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use memvisor::dma::{LockLimit, PinRegistry, SgBuf, SgGuard, SgWalk};
use memvisor::{Backing, BackingKind, DmaConfig, DmaSpace, Hva, Iova, Prot};

const PAGE: u64 = 4096;

fn mem(pages: u64) -> Arc<Backing> {
    Arc::new(Backing::new(BackingKind::PrivateAnon, pages * PAGE).unwrap())
}

/// A space over its own registry with `b` mapped at `iova`; unmaps wait 50 ms for holds.
fn space(b: &Arc<Backing>, iova: u64, limit: LockLimit) -> (DmaSpace, Arc<PinRegistry>) {
    let registry = PinRegistry::new(limit);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        unpin_wait: Duration::from_millis(50),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(iova), b, 0, b.size(), Prot::RW).unwrap();
    (d, registry)
}

fn buf(iova: u64, len: u64, prot: Prot) -> SgBuf {
    SgBuf {
        iova: Iova(iova),
        len,
        prot,
    }
}

fn held(walk: memvisor::Result<SgWalk>) -> SgGuard {
    match walk.unwrap() {
        SgWalk::Held(g) => g,
        SgWalk::Missed(m) => panic!("unexpected misses {m:?}"),
    }
}

#[test]
fn a_guard_holds_its_pages_and_gives_them_back_on_drop() {
    let b = mem(64);
    let (d, registry) = space(&b, 0x10_0000, LockLimit::Bytes(0));
    // Two buffers in the same mapping, one crossing a page boundary.
    let bufs = [
        buf(0x10_0000 + 100, 16, Prot::READ),
        buf(0x10_0000 + 3 * PAGE - 8, 2 * PAGE, Prot::WRITE),
    ];
    let g = held(d.hold_sg(&bufs));
    let at = |off: u64| Hva(b.hva().0 + off);
    assert_eq!(registry.pin_count(at(0)), 1);
    assert_eq!(registry.pin_count(at(2 * PAGE)), 1);
    assert_eq!(registry.pin_count(at(4 * PAGE)), 1);
    assert_eq!(registry.pin_count(at(5 * PAGE)), 0);
    assert_eq!(d.guard_held_pages(), 1 + 3);
    assert_eq!(registry.guard_held_pages(), 4);
    assert_eq!(g.pages(), 4);
    // A hold locks and charges nothing, so a limit of 0 refuses none.
    assert_eq!(registry.locked_bytes(), 0);
    drop(g);
    assert_eq!(registry.pin_count(at(0)), 0);
    assert_eq!(registry.pin_count(at(2 * PAGE)), 0);
    assert_eq!(d.guard_held_pages(), 0);
    assert_eq!(registry.guard_held_pages(), 0);
}

#[test]
fn segments_are_those_translate_sg_gives() {
    // Three mappings of pieces of one backing, out of host order, so a buffer spans mappings
    // that are contiguous in IOVA but not on the host.
    let b = mem(32);
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0x1_0000), &b, 8 * PAGE, 4 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(0x1_0000 + 4 * PAGE), &b, 0, 4 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(0x1_0000 + 8 * PAGE), &b, 4 * PAGE, 4 * PAGE, Prot::RW)
        .unwrap();
    let bufs = [
        buf(0x1_0000 + 10, 9 * PAGE, Prot::WRITE),
        buf(0x1_0000 + 11 * PAGE, 100, Prot::READ),
        buf(0x1_0000, 0, Prot::READ),
        buf(0x1_0000 + 2 * PAGE, 6 * PAGE, Prot::READ),
    ];
    let g = held(d.hold_sg(&bufs));
    let mut all = Vec::new();
    for (i, bf) in bufs.iter().enumerate() {
        let access = if bf.prot == Prot::WRITE {
            Prot::WRITE
        } else {
            Prot::READ
        };
        let want = match bf.len {
            0 => Vec::new(),
            n => d.translate_sg(bf.iova, n, access).unwrap(),
        };
        assert_eq!(g.buffer(i), &want[..], "buffer {i}");
        all.extend(want);
    }
    assert_eq!(g.segments(), &all[..]);
    assert!(g.buffer(0).len() >= 2, "spans mappings: {:?}", g.buffer(0));
}

#[test]
fn written_pages_are_dirty_and_stay_dirty_while_held() {
    let b = mem(16);
    let (d, _registry) = space(&b, 0, LockLimit::Unlimited);
    d.start_dirty_tracking().unwrap();
    let bits = |d: &DmaSpace| d.get_and_clear_dirty(Iova(0), 16 * PAGE, PAGE).unwrap()[0];
    assert_eq!(bits(&d), 0);
    let g = held(d.hold_sg(&[
        buf(3 * PAGE + 5, PAGE, Prot::WRITE),
        buf(10 * PAGE, 10, Prot::READ),
    ]));
    // Pages 3 and 4 written, page 10 only read.
    assert_eq!(bits(&d), 0b11 << 3);
    // Still held: a later read of the log reports them again (the device may write any time).
    assert_eq!(bits(&d), 0b11 << 3);
    drop(g);
    // Marked once more as the guard lets go, then clean.
    assert_eq!(bits(&d), 0b11 << 3);
    assert_eq!(bits(&d), 0);
}

#[test]
fn an_unmapped_buffer_is_a_miss_and_nothing_is_held() {
    let b = mem(8);
    let (d, registry) = space(&b, 0x10_0000, LockLimit::Unlimited);
    let walk = d
        .hold_sg(&[
            buf(0x10_0000, PAGE, Prot::READ),
            buf(0x10_0000 + 7 * PAGE, 3 * PAGE, Prot::WRITE),
        ])
        .unwrap();
    let SgWalk::Missed(misses) = walk else {
        panic!("a buffer past the mapping must miss");
    };
    let pages: Vec<(u64, Prot)> = misses.iter().map(|m| (m.iova.0, m.access)).collect();
    assert_eq!(
        pages,
        vec![
            (0x10_0000 + 8 * PAGE, Prot::WRITE),
            (0x10_0000 + 9 * PAGE, Prot::WRITE)
        ],
        "one miss per unmapped page, from the first unmapped byte"
    );
    assert_eq!(d.guard_held_pages(), 0);
    assert_eq!(registry.pin_count(Hva(b.hva().0)), 0);
}

#[test]
fn bad_buffers_get_type1_errnos_naming_the_address() {
    let b = mem(8);
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::READ).unwrap();
    d.map_remote(Iova(0x10_0000), PAGE, Prot::RW).unwrap();
    let err = |bufs: &[SgBuf]| d.hold_sg(bufs).unwrap_err();
    let e = err(&[buf(u64::MAX - 10, 100, Prot::READ)]);
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(
        e.to_string().contains(&format!("{:#x}", u64::MAX - 10)),
        "{e}"
    );
    let e = err(&[buf(0x10, 10, Prot::default())]);
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    // Mapped read-only, written: EPERM, and what was counted before it is let go.
    let e = err(&[buf(0, 10, Prot::READ), buf(PAGE + 0x20, 10, Prot::WRITE)]);
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    assert!(e.to_string().contains("0x1020"), "{e}");
    let e = err(&[buf(0x10_0000, 10, Prot::READ)]);
    assert_eq!(e.errno(), libc::EFAULT, "{e}");
    assert_eq!(d.guard_held_pages(), 0);
    assert_eq!(registry.pin_count(Hva(b.hva().0)), 0);
}

#[test]
fn pin_sg_locks_and_charges_and_gives_back() {
    let b = mem(8);
    let (d, registry) = space(&b, 0, LockLimit::Bytes(0));
    let e = d.pin_sg(&[buf(0, PAGE, Prot::READ)]).unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    assert_eq!(d.guard_held_pages(), 0, "a refused pin holds nothing");
    registry.set_limit(LockLimit::Unlimited);
    let g = held(d.pin_sg(&[buf(0, 2 * PAGE, Prot::READ)]));
    assert_eq!(registry.locked_bytes(), 2 * PAGE);
    drop(g);
    assert_eq!(registry.locked_bytes(), 0);
    assert_eq!(registry.pin_count(Hva(b.hva().0)), 0);
}

#[test]
fn an_unmap_waits_for_a_held_request_and_is_busy_while_it_stays() {
    let b = mem(8);
    let (d, _registry) = space(&b, 0, LockLimit::Unlimited);
    let g = held(d.hold_sg(&[buf(PAGE, 10, Prot::WRITE)]));
    let e = d.unmap(Iova(0), 8 * PAGE).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY, "{e}");
    assert_eq!(d.len(), 1, "undone whole");
    // A request that ends while the unmap waits lets it through.
    let stop = Arc::new(AtomicBool::new(false));
    let seen = stop.clone();
    d.add_unmap_notifier(move |_, _| seen.store(true, Ordering::SeqCst));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            drop(g);
        });
        assert_eq!(d.unmap(Iova(0), 8 * PAGE).unwrap(), 8 * PAGE);
    });
    assert_eq!(d.guard_held_pages(), 0);
    // A walk after the unmap misses.
    assert!(matches!(
        d.hold_sg(&[buf(PAGE, 10, Prot::READ)]).unwrap(),
        SgWalk::Missed(_)
    ));
}

#[test]
fn two_threads_hold_different_requests_at_once() {
    let b = mem(64);
    let (d, registry) = space(&b, 0, LockLimit::Bytes(0));
    let both = Barrier::new(2);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (d, both, b) = (&d, &both, &b);
            s.spawn(move || {
                for round in 0..2000u64 {
                    let first = (t * 32 + round % 30) * PAGE;
                    let g = held(d.hold_sg(&[buf(first, 2 * PAGE, Prot::WRITE)]));
                    assert_eq!(g.segments()[0].hva.0, b.hva().0 + first);
                    if round == 0 {
                        // Both hold at the same moment: neither waits for the other.
                        both.wait();
                        assert!(d.guard_held_pages() >= 4);
                        both.wait();
                    }
                }
            });
        }
    });
    assert_eq!(d.guard_held_pages(), 0);
    assert_eq!(registry.guard_held_pages(), 0);
}

#[test]
fn a_request_larger_than_a_batch_is_held_whole() {
    let b = mem(1200);
    let (d, registry) = space(&b, 0, LockLimit::Unlimited);
    let g = held(d.hold_sg(&[
        buf(0, 1100 * PAGE, Prot::READ),
        buf(1100 * PAGE, 100 * PAGE, Prot::WRITE),
    ]));
    assert_eq!(g.pages(), 1200);
    assert_eq!(
        g.segments().len(),
        2,
        "per buffer, merged: {:?}",
        g.segments()
    );
    assert_eq!(d.guard_held_pages(), 1200);
    drop(g);
    assert_eq!(registry.pin_count(Hva(b.hva().0 + 600 * PAGE)), 0);
}
