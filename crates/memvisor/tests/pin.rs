//! The pinning engine, checked against the kernel's view: which pages are really mlocked
//! (`VmFlags: lo` in /proc/self/smaps), what the account says, and a plain per-page model.
//! Pin modes with replay and rollback, the locked-memory limit, pin_pages and its errors, the
//! unmap notifier, extents over THP and hugetlbfs memory, and pins under concurrent map/unmap.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use memvisor::dma::{Grouping, LockLimit, PinMode, PinRegistry};
use memvisor::{
    Backing, BackingKind, BackingOptions, DmaConfig, DmaSpace, Gpa, HugePageReservation, Iova,
    PageSize, Prot, SlotSpec, SlotTable,
};
use proptest::prelude::*;

mod common;

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

fn mem(pages: u64) -> Arc<Backing> {
    Arc::new(Backing::new(BackingKind::PrivateAnon, pages * PAGE).unwrap())
}

/// A space with a registry of its own (tests run in parallel over separate memory). Pins that
/// devices keep fail an unmap after 5 ms, not the default second.
fn space(mode: PinMode, limit: LockLimit) -> (DmaSpace, Arc<PinRegistry>) {
    space_waiting(mode, limit, std::time::Duration::from_millis(5))
}

/// [`space`] whose unmaps wait `unpin_wait` for devices to let their pins go.
fn space_waiting(
    mode: PinMode,
    limit: LockLimit,
    unpin_wait: std::time::Duration,
) -> (DmaSpace, Arc<PinRegistry>) {
    let registry = PinRegistry::new(limit);
    let d = DmaSpace::new(DmaConfig {
        pin_mode: mode,
        registry: Some(registry.clone()),
        unpin_wait,
        ..DmaConfig::default()
    })
    .unwrap();
    (d, registry)
}

/// The pages of `b` the kernel has mlocked, by index.
fn locked_pages(b: &Backing) -> BTreeSet<u64> {
    let (base, end) = (b.hva().0, b.hva().0 + b.size());
    common::vmas(base, end)
        .iter()
        .filter(|v| v.has_flag("lo"))
        .flat_map(|v| (v.start.max(base)..v.end.min(end)).step_by(PAGE as usize))
        .map(|addr| (addr - base) / PAGE)
        .collect()
}

/// The pages of `b` the registry keeps locked in its lock cache, by index.
fn cached_pages(registry: &PinRegistry, b: &Backing) -> BTreeSet<u64> {
    let (base, end) = (b.hva().0, b.hva().0 + b.size());
    registry
        .cached()
        .into_iter()
        .flat_map(|(h, len)| (h.0..h.0 + len).step_by(PAGE as usize))
        .filter(|&a| a >= base && a < end)
        .map(|a| (a - base) / PAGE)
        .collect()
}

fn errno<T: std::fmt::Debug>(r: memvisor::Result<T>) -> i32 {
    r.unwrap_err().errno()
}

fn iova_pages(iova: u64, n: u64) -> Vec<u64> {
    (iova / PAGE..iova / PAGE + n).collect()
}

#[derive(Clone, Debug)]
enum Op {
    /// Eager-map backing pages `[page, page + len)` at a fresh IOVA.
    Map { page: u64, len: u64 },
    /// Unmap the n-th live mapping.
    Unmap { nth: usize },
    /// pin_pages of `len` pages from `page` of the n-th live mapping.
    PinPages { nth: usize, page: u64, len: u64 },
    /// unpin_pages of the n-th earlier pin_pages call still held.
    UnpinPages { nth: usize },
}

const MODEL_PAGES: u64 = 48;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..MODEL_PAGES, 1..16u64).prop_map(|(page, len)| Op::Map {
            page,
            len: len.min(MODEL_PAGES - page)
        }),
        any::<usize>().prop_map(|nth| Op::Unmap { nth }),
        (any::<usize>(), 0..16u64, 1..6u64).prop_map(|(nth, page, len)| Op::PinPages {
            nth,
            page,
            len
        }),
        any::<usize>().prop_map(|nth| Op::UnpinPages { nth }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Overlapping Eager mappings of one backing at many IOVAs, plus device pins on top: after
    /// every step the kernel's locked pages, the account and the per-page counts equal a plain
    /// per-page model.
    #[test]
    fn pin_counts_match_the_model(ops in prop::collection::vec(op(), 1..40)) {
        if !common::may_lock(MODEL_PAGES * PAGE, "pin_counts_match_the_model") {
            return Ok(());
        }
        let b = mem(MODEL_PAGES);
        let (d, registry) = space(PinMode::Eager, LockLimit::Unlimited);
        let mut model = vec![0u64; MODEL_PAGES as usize];
        // live mappings: (iova, first backing page, pages); held device pins: (iova pages, backing pages)
        let mut live: Vec<(u64, u64, u64)> = Vec::new();
        let mut held: Vec<(Vec<u64>, Vec<u64>)> = Vec::new();
        let mut next_iova = 0x100_0000u64;
        for op in ops {
            match op {
                Op::Map { page, len } => {
                    d.map_backing(Iova(next_iova), &b, page * PAGE, len * PAGE, Prot::RW).unwrap();
                    live.push((next_iova, page, len));
                    (page..page + len).for_each(|p| model[p as usize] += 1);
                    next_iova += 0x10_0000;
                }
                Op::Unmap { nth } if !live.is_empty() => {
                    let (iova, page, len) = live[nth % live.len()];
                    let pinned = held.iter().any(|(ip, _)| ip[0] >= iova / PAGE && ip[0] < iova / PAGE + len);
                    let r = d.unmap(Iova(iova), len * PAGE);
                    if pinned {
                        // nobody registered a notifier: the device keeps its pins
                        prop_assert_eq!(r.unwrap_err().errno(), libc::EBUSY);
                    } else {
                        prop_assert_eq!(r.unwrap(), len * PAGE);
                        live.retain(|m| m.0 != iova);
                        (page..page + len).for_each(|p| model[p as usize] -= 1);
                    }
                }
                Op::PinPages { nth, page, len } if !live.is_empty() => {
                    let (iova, first, mlen) = live[nth % live.len()];
                    let page = page % mlen;
                    let len = len.min(mlen - page);
                    let pages = iova_pages(iova + page * PAGE, len);
                    let hvas = d.pin_pages(&pages, Prot::WRITE).unwrap();
                    let backing_pages: Vec<u64> = (first + page..first + page + len).collect();
                    for (h, bp) in hvas.iter().zip(&backing_pages) {
                        prop_assert_eq!(h.0, b.hva().0 + bp * PAGE);
                        model[*bp as usize] += 1;
                    }
                    held.push((pages, backing_pages));
                }
                Op::UnpinPages { nth } if !held.is_empty() => {
                    let (pages, backing_pages) = held.remove(nth % held.len());
                    d.unpin_pages(&pages).unwrap();
                    backing_pages.iter().for_each(|&p| model[p as usize] -= 1);
                }
                _ => {}
            }
            let want: BTreeSet<u64> = (0..MODEL_PAGES).filter(|&p| model[p as usize] > 0).collect();
            // The kernel locks what is pinned plus the lock cache (pages devices pinned before),
            // the account charges what is pinned.
            let cached = cached_pages(&registry, &b);
            prop_assert!(cached.is_disjoint(&want), "cached pages are pinned: {:?}", cached);
            prop_assert_eq!(locked_pages(&b), &want | &cached, "mlocked pages");
            prop_assert_eq!(registry.cached_bytes(), cached.len() as u64 * PAGE);
            prop_assert_eq!(registry.locked_bytes(), want.len() as u64 * PAGE, "account");
            for p in 0..MODEL_PAGES {
                prop_assert_eq!(registry.pin_count(memvisor::Hva(b.hva().0 + p * PAGE)), model[p as usize]);
            }
        }
        for (pages, _) in held {
            d.unpin_pages(&pages).unwrap();
        }
        d.unmap_all().unwrap();
        // The unmap unlocked the cache over the memory it took away.
        prop_assert!(locked_pages(&b).is_empty());
        prop_assert_eq!(registry.locked_bytes(), 0);
        prop_assert_eq!(registry.cached_bytes(), 0);
    }
}

#[test]
fn a_page_mapped_twice_is_locked_and_charged_once() {
    let b = mem(8);
    let (d, registry) = space(PinMode::Eager, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, 8 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(0x10_0000), &b, 0, 8 * PAGE, Prot::READ)
        .unwrap();
    assert_eq!(registry.locked_bytes(), 8 * PAGE);
    assert_eq!(registry.pin_count(b.hva()), 2);
    d.unmap(Iova(0), 8 * PAGE).unwrap();
    assert_eq!(
        locked_pages(&b).len(),
        8,
        "still pinned through the second IOVA"
    );
    d.unmap(Iova(0x10_0000), 8 * PAGE).unwrap();
    assert!(locked_pages(&b).is_empty());
    assert_eq!(registry.locked_bytes(), 0);
}

#[test]
fn lazy_maps_pin_nothing_and_eager_replays_and_unpins() {
    let b = mem(16);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(0x10_0000), &b, 8 * PAGE, 8 * PAGE, Prot::READ)
        .unwrap();
    assert!(locked_pages(&b).is_empty());
    assert_eq!(errno(d.extents(Iova(0))), libc::EINVAL);
    d.set_pin_mode(PinMode::Eager).unwrap();
    assert_eq!(d.pin_mode(), PinMode::Eager);
    let want: BTreeSet<u64> = (0..4).chain(8..16).collect();
    assert_eq!(locked_pages(&b), want);
    assert_eq!(registry.locked_bytes(), 12 * PAGE);
    let ext = d.extents(Iova(0x10_0000)).unwrap();
    assert_eq!(ext.len(), 1, "one extent without frames: {ext:?}");
    assert_eq!(
        (ext[0].iova, ext[0].hva, ext[0].len, ext[0].pfn),
        (
            Iova(0x10_0000),
            memvisor::Hva(b.hva().0 + 8 * PAGE),
            8 * PAGE,
            None
        )
    );
    d.set_pin_mode(PinMode::Lazy).unwrap();
    assert!(locked_pages(&b).is_empty());
    assert_eq!(registry.locked_bytes(), 0);
}

#[test]
fn the_limit_refuses_with_enomem_and_leaves_nothing_pinned_or_mapped() {
    let b = mem(16);
    let (d, registry) = space(PinMode::Eager, LockLimit::Bytes(8 * PAGE));
    d.map_backing(Iova(0), &b, 0, 6 * PAGE, Prot::RW).unwrap();
    let e = d
        .map_backing(Iova(0x10_0000), &b, 6 * PAGE, 4 * PAGE, Prot::RW)
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM);
    let msg = e.to_string();
    assert!(
        msg.contains("0x4000 more") && msg.contains("0x8000") && msg.contains("0x6000 already"),
        "{msg}"
    );
    assert_eq!(d.len(), 1, "the refused mapping is not there");
    assert_eq!(registry.locked_bytes(), 6 * PAGE);
    assert_eq!(locked_pages(&b), (0..6).collect());
    // Pages already pinned cost nothing: a second IOVA over them fits.
    d.map_backing(Iova(0x20_0000), &b, 0, 6 * PAGE, Prot::RW)
        .unwrap();
    // A guest range over two slots where only the first piece fits: the first piece's pin is
    // rolled back.
    let b2 = mem(4);
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), b.clone()).window(12 * PAGE, 2 * PAGE))
        .unwrap();
    t.insert(SlotSpec::new(1, Gpa(2 * PAGE), b2.clone()))
        .unwrap();
    let e = d
        .map_guest(Iova(0x30_0000), &t.snapshot(), Gpa(0), 6 * PAGE, Prot::RW)
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM);
    assert_eq!(registry.locked_bytes(), 6 * PAGE);
    assert_eq!(locked_pages(&b), (0..6).collect());
    assert!(locked_pages(&b2).is_empty());
    // A batch of one page makes the same call fail part way through its steps, with the same
    // all-or-nothing result.
    let (d1, r1) = {
        let registry = PinRegistry::new(LockLimit::Bytes(3 * PAGE));
        let d = DmaSpace::new(DmaConfig {
            pin_mode: PinMode::Eager,
            pin_batch: 1,
            registry: Some(registry.clone()),
            ..DmaConfig::default()
        })
        .unwrap();
        (d, registry)
    };
    let b3 = mem(4);
    assert_eq!(
        errno(d1.map_backing(Iova(0), &b3, 0, 4 * PAGE, Prot::RW)),
        libc::ENOMEM
    );
    assert_eq!(r1.locked_bytes(), 0);
    assert!(locked_pages(&b3).is_empty());
}

#[test]
fn a_failed_replay_leaves_the_space_lazy_and_nothing_pinned() {
    let b = mem(16);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Bytes(10 * PAGE));
    for i in 0..3 {
        d.map_backing(Iova(i * 0x10_0000), &b, i * 5 * PAGE, 5 * PAGE, Prot::RW)
            .unwrap();
    }
    assert_eq!(errno(d.set_pin_mode(PinMode::Eager)), libc::ENOMEM);
    assert_eq!(d.pin_mode(), PinMode::Lazy);
    assert_eq!(registry.locked_bytes(), 0);
    assert!(locked_pages(&b).is_empty());
    d.unmap(Iova(0x20_0000), 5 * PAGE).unwrap();
    d.set_pin_mode(PinMode::Eager).unwrap();
    assert_eq!(registry.locked_bytes(), 10 * PAGE);
}

#[test]
fn pin_pages_refuses_bad_requests_with_type1_errnos() {
    let b = mem(8);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::READ).unwrap();
    let e = d.pin_pages(&[0, 4], Prot::READ).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "page 4 is not mapped");
    assert!(e.to_string().contains("0x4000"), "{e}");
    assert_eq!(errno(d.pin_pages(&[1], Prot::WRITE)), libc::EPERM);
    let many: Vec<u64> = (0..513).collect();
    let e = d.pin_pages(&many, Prot::READ).unwrap_err();
    assert_eq!(e.errno(), libc::E2BIG);
    assert!(e.to_string().contains("513"), "{e}");
    assert_eq!(errno(d.pin_pages(&[], Prot::READ)), libc::EINVAL);
    assert_eq!(errno(d.pin_pages(&[0], Prot::default())), libc::EINVAL);
    assert_eq!(errno(d.pin_pages(&[u64::MAX], Prot::READ)), libc::EINVAL);
    assert_eq!(registry.locked_bytes(), 0, "failed calls pin nothing");
    assert_eq!(d.device_pinned_pages(), 0);
    // unpinning what is not pinned
    d.pin_pages(&[2], Prot::READ).unwrap();
    assert_eq!(errno(d.unpin_pages(&[2, 2])), libc::EINVAL);
    assert_eq!(
        d.device_pinned_pages(),
        1,
        "the failed unpin changed nothing"
    );
    d.unpin_pages(&[2]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
}

#[test]
fn pin_pages_nests_per_page_in_every_grouping() {
    for grouping in [Grouping::PerPage, Grouping::Runs, Grouping::Adaptive] {
        let b = mem(64);
        let registry = PinRegistry::new(LockLimit::Unlimited);
        let d = DmaSpace::new(DmaConfig {
            grouping,
            registry: Some(registry.clone()),
            ..DmaConfig::default()
        })
        .unwrap();
        d.map_backing(Iova(0), &b, 0, 32 * PAGE, Prot::RW).unwrap();
        d.map_backing(Iova(32 * PAGE), &b, 32 * PAGE, 32 * PAGE, Prot::RW)
            .unwrap();
        // a run across the two mappings, single pages, and a repeat
        let pages: Vec<u64> = (28..36).chain([40, 50, 50]).collect();
        let hvas = d.pin_pages(&pages, Prot::RW).unwrap();
        for (p, h) in pages.iter().zip(&hvas) {
            assert_eq!(h.0, b.hva().0 + p * PAGE, "{grouping:?}");
        }
        assert_eq!(registry.pin_count(memvisor::Hva(b.hva().0 + 50 * PAGE)), 2);
        assert_eq!(d.device_pinned_pages(), 10);
        let want: BTreeSet<u64> = (28..36).chain([40, 50]).collect();
        assert_eq!(locked_pages(&b), want, "{grouping:?}");
        d.unpin_pages(&[50]).unwrap();
        assert!(locked_pages(&b).contains(&50));
        assert_eq!(registry.pin_count(memvisor::Hva(b.hva().0 + 50 * PAGE)), 1);
        d.unpin_pages(&pages[..pages.len() - 1]).unwrap();
        assert_eq!(registry.locked_bytes(), 0);
        // Unpinned, the locks stay in the cache (all of them, unless a small RLIMIT_MEMLOCK
        // keeps the cache to a quarter of it) until released.
        let cached = cached_pages(&registry, &b);
        assert!(
            cached.is_subset(&want) && !cached.is_empty(),
            "{grouping:?}"
        );
        assert_eq!(locked_pages(&b), cached, "{grouping:?}");
        d.release_cached_locks();
        assert!(locked_pages(&b).is_empty(), "{grouping:?}");
        assert_eq!(registry.cached_bytes(), 0);
    }
}

#[test]
fn unmap_asks_devices_to_unpin_and_is_busy_when_they_do_not() {
    let b = mem(16);
    // The space asks again after 1 ms, then 2, 4, ... until `unpin_wait`. The 5 ms of the
    // other tests' spaces let a loaded machine (a build beside the tests) reach the bound
    // before the second ask, and "asked again" failed; 100 ms leaves room for several.
    let wait = std::time::Duration::from_millis(100);
    let (d, registry) = space_waiting(PinMode::Lazy, LockLimit::Unlimited, wait);
    d.map_backing(Iova(0x10_0000), &b, 0, 8 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(0x20_0000), &b, 8 * PAGE, 8 * PAGE, Prot::RW)
        .unwrap();
    d.pin_pages(&[0x100, 0x101, 0x203], Prot::RW).unwrap();

    // A device that does not let go: asked again and again until the bound, then EBUSY,
    // nothing unmapped, pins intact.
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    let stubborn = d.add_unmap_notifier(move |iova, size| seen.lock().unwrap().push((iova, size)));
    let e = d.unmap(Iova(0x10_0000), 0x20_0000).unwrap_err();
    assert_eq!(e.errno(), libc::EBUSY);
    assert!(e.to_string().contains("stop the device"), "{e}");
    {
        let calls = calls.lock().unwrap();
        let ranges = [(Iova(0x10_0000), 8 * PAGE), (Iova(0x20_0000), 8 * PAGE)];
        assert_eq!(
            calls[..2],
            ranges,
            "called once per pinned mapping with its range"
        );
        assert!(calls.len() > 2, "asked again while the pins stayed");
        assert!(calls.iter().all(|c| ranges.contains(c)), "{calls:?}");
    }
    assert_eq!(d.len(), 2);
    assert_eq!(d.device_pinned_pages(), 3);
    // The unmap was undone whole: the range translates, pins and copies again.
    d.dma_write(Iova(0x10_0000), b"back").unwrap();
    d.pin_pages(&[0x102], Prot::RW).unwrap();
    d.unpin_pages(&[0x102]).unwrap();
    assert_eq!(
        errno(d.invalidate_vaddr(Iova(0x20_0000), 8 * PAGE)),
        libc::EBUSY
    );
    assert!(d.translate(Iova(0x20_0000), 1, Prot::READ).is_ok());
    assert_eq!(errno(d.unmap_all()), libc::EBUSY);
    assert!(d.remove_unmap_notifier(stubborn));

    // A device that unpins what it is told about: the unmap goes through.
    let dev = d.clone();
    d.add_unmap_notifier(move |iova, size| {
        let pages: Vec<u64> = (iova.0 / PAGE..(iova.0 + size) / PAGE).collect();
        for p in pages {
            while dev.unpin_pages(&[p]).is_ok() {}
        }
    });
    assert_eq!(d.unmap(Iova(0x10_0000), 0x20_0000).unwrap(), 16 * PAGE);
    assert_eq!(d.device_pinned_pages(), 0);
    assert_eq!(registry.locked_bytes(), 0);
    assert!(locked_pages(&b).is_empty());
}

#[test]
fn dropping_the_space_gives_every_pin_back() {
    let b = mem(8);
    let registry = PinRegistry::new(LockLimit::Unlimited);
    {
        let d = DmaSpace::new(DmaConfig {
            pin_mode: PinMode::Eager,
            registry: Some(registry.clone()),
            ..DmaConfig::default()
        })
        .unwrap();
        d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::RW).unwrap();
        d.map_backing(Iova(0x10_0000), &b, 4 * PAGE, 4 * PAGE, Prot::RW)
            .unwrap();
        d.pin_pages(&[0x100, 0x100, 0x101], Prot::READ).unwrap();
        assert_eq!(locked_pages(&b).len(), 8);
    }
    assert_eq!(registry.locked_bytes(), 0);
    assert!(locked_pages(&b).is_empty());
}

#[test]
fn live_update_moves_eager_pins_to_the_new_memory() {
    let old = mem(4);
    let new = mem(4);
    let (d, registry) = space(PinMode::Eager, LockLimit::Unlimited);
    d.map_backing(Iova(0), &old, 0, 4 * PAGE, Prot::RW).unwrap();
    assert_eq!(locked_pages(&old).len(), 4);
    d.invalidate_vaddr(Iova(0), 4 * PAGE).unwrap();
    assert!(locked_pages(&old).is_empty());
    assert_eq!(registry.locked_bytes(), 0);
    assert_eq!(errno(d.pin_pages(&[0], Prot::READ)), libc::EBUSY);
    d.update_vaddr(Iova(0), 4 * PAGE, &new, 0).unwrap();
    assert_eq!(locked_pages(&new).len(), 4);
    assert_eq!(registry.locked_bytes(), 4 * PAGE);
}

/// Frame numbers of `pages` pages from `hva`, read independently of memvisor.
fn frames(hva: u64, pages: u64) -> Vec<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open("/proc/self/pagemap").unwrap();
    let mut raw = vec![0u8; pages as usize * 8];
    f.read_exact_at(&mut raw, hva / PAGE * 8).unwrap();
    raw.chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap()) & ((1 << 55) - 1))
        .collect()
}

/// Checks that `extents` are exactly the maximal physically contiguous runs of the mapping.
fn assert_exact_extents(d: &DmaSpace, iova: u64, b: &Backing, len: u64) {
    let ext = d.extents(Iova(iova)).unwrap();
    let pfns = frames(b.hva().0, len / PAGE);
    let mut want = Vec::new();
    let mut start = 0;
    for i in 1..=pfns.len() {
        if i == pfns.len() || pfns[i] != pfns[i - 1] + 1 {
            want.push((
                iova + start as u64 * PAGE,
                (i - start) as u64 * PAGE,
                pfns[start],
            ));
            start = i;
        }
    }
    let got: Vec<_> = ext
        .iter()
        .map(|x| (x.iova.0, x.len, x.pfn.unwrap()))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn extents_are_the_physically_contiguous_runs() {
    if !common::is_root() {
        common::skipped(
            "extents_are_the_physically_contiguous_runs: reading frames needs CAP_SYS_ADMIN (run as root)",
        );
        return;
    }
    let frames_space = || {
        DmaSpace::new(DmaConfig {
            pin_mode: PinMode::Eager,
            frames: true,
            registry: Some(PinRegistry::new(LockLimit::Unlimited)),
            ..DmaConfig::default()
        })
        .unwrap()
    };
    // THP: every huge page the kernel gave us is one physically contiguous 2 MiB unit.
    let thp = Arc::new(
        Backing::with_options(
            BackingKind::Thp,
            8 * MIB,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let d = frames_space();
    d.map_backing(Iova(0), &thp, 0, 8 * MIB, Prot::RW).unwrap();
    assert_exact_extents(&d, 0, &thp, 8 * MIB);
    let pfns = frames(thp.hva().0, 8 * MIB / PAGE);
    let huge = (0..4)
        .filter(|h| {
            let p = &pfns[h * 512..(h + 1) * 512];
            p[0] % 512 == 0 && p.windows(2).all(|w| w[1] == w[0] + 1)
        })
        .count();
    if huge == 0 {
        println!(
            "THP gave no huge pages here (fragmented memory?): extents were checked as 4 KiB runs"
        );
    }
    for x in d.extents(Iova(0)).unwrap() {
        // a huge page never straddles two extents
        let pfn = x.pfn.unwrap();
        if x.len >= 2 * MIB {
            assert!(pfn % 512 == 0 || x.iova.0 % (2 * MIB) != 0, "{x:?}");
        }
    }
    // 4 KiB memory: pages are wherever the allocator put them; the extents still match.
    let small = mem(256);
    d.map_backing(Iova(0x1000_0000), &small, 0, 256 * PAGE, Prot::RW)
        .unwrap();
    assert_exact_extents(&d, 0x1000_0000, &small, 256 * PAGE);

    // hugetlbfs: each 2 MiB page is one contiguous unit, charged whole even when pinned in part.
    let _pool = match HugePageReservation::add(PageSize::Size2M, 2) {
        Ok(r) => r,
        Err(e) => {
            common::skipped(&format!(
                "extents_are_the_physically_contiguous_runs: hugetlbfs extents: {e}"
            ));
            return;
        }
    };
    let h = Arc::new(Backing::new(BackingKind::Hugetlb(PageSize::Size2M), 4 * MIB).unwrap());
    let d = frames_space();
    d.map_backing(Iova(0), &h, 0, 4 * MIB, Prot::RW).unwrap();
    assert_exact_extents(&d, 0, &h, 4 * MIB);
    for x in d.extents(Iova(0)).unwrap() {
        assert_eq!(x.len % (2 * MIB), 0, "{x:?}");
        assert_eq!(x.pfn.unwrap() % 512, 0, "{x:?}");
    }
    d.unmap_all().unwrap();
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &h, 0, 4 * MIB, Prot::RW).unwrap();
    d.pin_pages(&[3], Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), 2 * MIB, "the whole huge page");
    d.pin_pages(&[7, 600], Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), 4 * MIB);
    d.unpin_pages(&[3]).unwrap();
    assert_eq!(
        registry.locked_bytes(),
        4 * MIB,
        "page 7 holds the first huge page"
    );
    d.unpin_pages(&[7]).unwrap();
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    d.unpin_pages(&[600]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
}

/// Devices pin and unpin overlapping pages while another thread maps and unmaps (Eager) and the
/// notifier unpins on demand: at the end every count and the account are zero and nothing in
/// the backing is locked.
#[test]
fn pins_stay_exact_under_concurrent_map_and_unmap() {
    if !common::may_lock(64 * PAGE, "pins_stay_exact_under_concurrent_map_and_unmap") {
        return;
    }
    let b = mem(64);
    let (d, registry) = space(PinMode::Eager, LockLimit::Unlimited);
    // Mapping k (k = 0..4) maps backing pages [k*12, k*12 + 28) at iova k << 20: they overlap.
    let base = |k: u64| k << 20;
    let stop = Arc::new(AtomicBool::new(false));
    // Pins each device thread holds, so the notifier can give them back.
    let held: Arc<Vec<Mutex<Vec<Vec<u64>>>>> =
        Arc::new((0..2).map(|_| Mutex::new(Vec::new())).collect());
    let dev = d.clone();
    let held_n = held.clone();
    let notified = Arc::new(AtomicUsize::new(0));
    let notified_n = notified.clone();
    d.add_unmap_notifier(move |iova, size| {
        notified_n.fetch_add(1, Ordering::Relaxed);
        let (lo, hi) = (iova.0 / PAGE, (iova.0 + size) / PAGE);
        for h in held_n.iter() {
            h.lock().unwrap().retain(|pages| {
                if pages[0] >= lo && pages[0] < hi {
                    dev.unpin_pages(pages).unwrap();
                    false
                } else {
                    true
                }
            });
        }
    });
    let pins = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for t in 0..2usize {
            let (d, stop, held, pins) = (d.clone(), stop.clone(), held.clone(), pins.clone());
            s.spawn(move || {
                let mut x = t as u64 + 1;
                while !stop.load(Ordering::Relaxed) {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let k = (x >> 33) % 4;
                    let first = (x >> 40) % 24;
                    let pages = iova_pages(base(k) + first * PAGE, 1 + (x >> 50) % 4);
                    let mut mine = held[t].lock().unwrap();
                    if d.pin_pages(&pages, Prot::RW).is_ok() {
                        pins.fetch_add(1, Ordering::Relaxed);
                        mine.push(pages);
                    }
                    if mine.len() > 8 {
                        let p = mine.remove(0);
                        d.unpin_pages(&p).unwrap();
                    }
                }
            });
        }
        let (d, stop, b, pins, notified) = (
            d.clone(),
            stop.clone(),
            b.clone(),
            pins.clone(),
            notified.clone(),
        );
        s.spawn(move || {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            let mut round = 0u64;
            while round < 300
                || ((pins.load(Ordering::Relaxed) < 300 || notified.load(Ordering::Relaxed) < 10)
                    && std::time::Instant::now() < deadline)
            {
                round += 1;
                let k = round % 4;
                let _ = d.map_backing(Iova(base(k)), &b, k * 12 * PAGE, 28 * PAGE, Prot::RW);
                if round % 3 == 2 {
                    let _ = d.unmap(Iova(base((round / 3) % 4)), 28 * PAGE);
                }
            }
            stop.store(true, Ordering::Relaxed);
        });
    });
    assert!(
        pins.load(Ordering::Relaxed) > 0,
        "the devices pinned something"
    );
    assert!(
        notified.load(Ordering::Relaxed) > 0,
        "some unmap met device pins"
    );
    for h in held.iter() {
        for pages in h.lock().unwrap().drain(..) {
            d.unpin_pages(&pages).unwrap();
        }
    }
    assert_eq!(d.device_pinned_pages(), 0);
    d.unmap_all().unwrap();
    assert_eq!(registry.locked_bytes(), 0);
    assert!(registry.pinned().is_empty());
    assert!(locked_pages(&b).is_empty());
}

/// Threads race to pin under one limit: the account never passes it, every refusal is ENOMEM,
/// and what is charged at the end is exactly what is still pinned.
#[test]
fn the_limit_holds_under_concurrent_pins() {
    const LIMIT_PAGES: u64 = 64;
    let registry = PinRegistry::new(LockLimit::Bytes(LIMIT_PAGES * PAGE));
    let over = AtomicBool::new(false);
    let stop = AtomicBool::new(false);
    let (refused, pinned) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if registry.locked_bytes() > LIMIT_PAGES * PAGE {
                    over.store(true, Ordering::Relaxed);
                }
            }
        });
        let workers: Vec<_> = (0..3u64)
            .map(|t| {
                let (registry, refused, pinned) = (&registry, &refused, &pinned);
                s.spawn(move || {
                    let b = mem(32);
                    let d = DmaSpace::new(DmaConfig {
                        pin_mode: PinMode::Eager,
                        pin_batch: 8,
                        registry: Some(registry.clone()),
                        ..DmaConfig::default()
                    })
                    .unwrap();
                    for round in 0..200u64 {
                        let len = 8 + (round * 7 + t) % 24;
                        match d.map_backing(Iova(0), &b, 0, len * PAGE, Prot::RW) {
                            Ok(()) => {
                                pinned.fetch_add(1, Ordering::Relaxed);
                                d.unmap(Iova(0), len * PAGE).unwrap();
                            }
                            Err(e) => {
                                assert_eq!(e.errno(), libc::ENOMEM, "{e}");
                                refused.fetch_add(1, Ordering::Relaxed);
                                assert!(
                                    locked_pages(&b).is_empty(),
                                    "a refused pin left pages locked"
                                );
                            }
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(
        !over.load(Ordering::Relaxed),
        "the account went past the limit"
    );
    assert!(pinned.load(Ordering::Relaxed) > 0);
    println!(
        "{} pins, {} refused at the limit",
        pinned.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed)
    );
    assert_eq!(registry.locked_bytes(), 0);
}

/// KiB of `b` the kernel maps with transparent huge pages (AnonHugePages over its areas).
fn anon_huge_kib(b: &Backing) -> u64 {
    common::smaps_sum(b.hva().0, b.hva().0 + b.size(), "AnonHugePages") / 1024
}

/// `size` bytes of populated THP memory that the kernel gave all as huge pages, for `test`; or
/// None, having said why it is skipped (no room to lock a huge page, or THP fell short).
fn whole_thp(size: u64, test: &str) -> Option<Arc<Backing>> {
    if !common::may_lock(2 * MIB, test) {
        return None;
    }
    let thp = Arc::new(
        Backing::with_options(
            BackingKind::Thp,
            size,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let got = anon_huge_kib(&thp);
    if got < size / 1024 {
        common::skipped(&format!(
            "{test}: THP gave {got} KiB of huge pages here, not {}",
            size / 1024
        ));
        return None;
    }
    Some(thp)
}

/// Pinning one 4 KiB page of THP memory locks its whole huge page, so the huge page survives
/// the pin and the unpin (mlock of part of it would split its mapping for good).
#[test]
fn a_pin_inside_a_transparent_huge_page_keeps_it_whole() {
    let Some(thp) = whole_thp(
        4 * MIB,
        "a_pin_inside_a_transparent_huge_page_keeps_it_whole",
    ) else {
        return;
    };
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &thp, 0, 4 * MIB, Prot::RW).unwrap();
    d.pin_pages(&[1], Prot::RW).unwrap();
    assert_eq!(
        registry.locked_bytes(),
        2 * MIB,
        "the whole huge page is locked"
    );
    assert_eq!(locked_pages(&thp), (0..512).collect());
    assert_eq!(anon_huge_kib(&thp), 4096, "still mapped huge while pinned");
    d.unpin_pages(&[1]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
    assert_eq!(
        anon_huge_kib(&thp),
        4096,
        "still mapped huge after the unpin"
    );
}

// The lock cache: what a device's unpin leaves locked, and everything that must unlock it.

/// A lazy space over `pages` pages of fresh memory mapped at IOVA 0, on a registry of its own.
fn lazy(pages: u64) -> (DmaSpace, Arc<PinRegistry>, Arc<Backing>) {
    let b = mem(pages);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, pages * PAGE, Prot::RW)
        .unwrap();
    (d, registry, b)
}

#[test]
fn a_device_unpin_keeps_its_lock_cached_and_the_next_pin_takes_it_back() {
    let (d, registry, b) = lazy(64);
    d.pin_pages(&[5], Prot::RW).unwrap();
    assert_eq!(locked_pages(&b), BTreeSet::from([5]));
    assert_eq!(registry.locked_bytes(), PAGE);
    d.unpin_pages(&[5]).unwrap();
    // Not pinned, not charged — but still locked, and the cache says so.
    assert_eq!(registry.locked_bytes(), 0);
    assert_eq!(registry.pin_count(memvisor::Hva(b.hva().0 + 5 * PAGE)), 0);
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([5]));
    assert_eq!(locked_pages(&b), BTreeSet::from([5]));
    // The next pin of the page is served from the cache: charged again, no longer cached.
    let areas = common::vmas(b.hva().0, b.hva().0 + b.size()).len();
    d.pin_pages(&[5], Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), PAGE);
    assert_eq!(registry.cached_bytes(), 0);
    assert_eq!(locked_pages(&b), BTreeSet::from([5]));
    assert_eq!(
        common::vmas(b.hva().0, b.hva().0 + b.size()).len(),
        areas,
        "the memory areas did not change: nothing was locked anew"
    );
    // A neighbour is not in the cache: it is locked on its own.
    d.pin_pages(&[6], Prot::RW).unwrap();
    assert_eq!(locked_pages(&b), BTreeSet::from([5, 6]));
    d.unpin_pages(&[5, 6]).unwrap();
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([5, 6]));
    d.release_cached_locks();
    assert!(locked_pages(&b).is_empty());
    assert_eq!(registry.cached_bytes(), 0);
    assert_eq!(registry.locked_bytes(), 0);
}

#[test]
fn the_lock_cache_keeps_the_most_recent_within_its_bounds() {
    let (d, registry, b) = lazy(64);
    registry.set_lock_cache(64 * PAGE, 4);
    assert_eq!(registry.lock_cache(), (64 * PAGE, 4));
    for p in (0..20).map(|i| i * 3) {
        d.pin_pages(&[p], Prot::RW).unwrap();
        d.unpin_pages(&[p]).unwrap();
        assert!(registry.cached().len() <= 4, "{:?}", registry.cached());
        assert_eq!(locked_pages(&b), cached_pages(&registry, &b));
    }
    // Least recently used out first: the last four stay.
    assert_eq!(
        cached_pages(&registry, &b),
        BTreeSet::from([48, 51, 54, 57])
    );
    // A byte bound: two pages.
    registry.set_lock_cache(2 * PAGE, 4);
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([54, 57]));
    assert_eq!(locked_pages(&b), BTreeSet::from([54, 57]));
    // A hit makes an entry the most recent: 54 is used again, so 57 goes first.
    d.pin_pages(&[54], Prot::RW).unwrap();
    d.unpin_pages(&[54]).unwrap();
    d.pin_pages(&[60], Prot::RW).unwrap();
    d.unpin_pages(&[60]).unwrap();
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([54, 60]));
    // Off: nothing stays locked after an unpin.
    registry.set_lock_cache(0, 0);
    assert!(locked_pages(&b).is_empty());
    d.pin_pages(&[7], Prot::RW).unwrap();
    d.unpin_pages(&[7]).unwrap();
    assert!(locked_pages(&b).is_empty());
    // The default bound holds however many pages went through.
    let (bytes, entries) = PinRegistry::new(LockLimit::Unlimited).lock_cache();
    assert_eq!((bytes, entries), (64 * MIB, 64), "the documented defaults");
    registry.set_lock_cache(bytes, entries);
    for p in 0..64 {
        d.pin_pages(&[p], Prot::RW).unwrap();
        d.unpin_pages(&[p]).unwrap();
    }
    assert!(registry.cached().len() <= entries);
    assert_eq!(locked_pages(&b), cached_pages(&registry, &b));
}

/// Pins spread over more memory than the cache holds make it step aside (it admits only a few
/// probes), so that scattered cached locks do not make every mlock dearer; pins of the same
/// pages bring it back.
#[test]
fn a_cache_that_only_misses_steps_aside_and_comes_back() {
    let (d, registry, b) = lazy(2048);
    for i in 0..1024u64 {
        let p = i * 517 % 1024;
        d.pin_pages(&[p], Prot::RW).unwrap();
        d.unpin_pages(&[p]).unwrap();
    }
    let held = registry.cached().len();
    assert!(
        held <= registry.lock_cache().1 / 8,
        "{held} entries held while every pin missed"
    );
    assert_eq!(locked_pages(&b), cached_pages(&registry, &b));
    // Stepped aside, it admits one unpin in eight: of 16 new pages, two stay locked.
    for p in 1024..1040 {
        d.pin_pages(&[p], Prot::RW).unwrap();
        d.unpin_pages(&[p]).unwrap();
    }
    let kept = cached_pages(&registry, &b).range(1024..).count();
    assert_eq!(kept, 2, "{:?}", registry.cached());
    // The same few pages over and over: hits again, and the cache keeps them.
    for _ in 0..200 {
        for p in [1, 2, 3] {
            d.pin_pages(&[p], Prot::RW).unwrap();
            d.unpin_pages(&[p]).unwrap();
        }
    }
    for p in [1, 2, 3] {
        assert!(
            cached_pages(&registry, &b).contains(&p),
            "page {p} not cached"
        );
    }
}

#[test]
fn unmap_invalidation_and_drop_unlock_the_cache_over_their_memory() {
    let b = mem(32);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, 8 * PAGE, Prot::RW).unwrap();
    d.map_backing(Iova(0x10_0000), &b, 8 * PAGE, 8 * PAGE, Prot::RW)
        .unwrap();
    d.map_backing(Iova(0x20_0000), &b, 16 * PAGE, 16 * PAGE, Prot::RW)
        .unwrap();
    for p in [2, 0x102, 0x203, 0x20c] {
        d.pin_pages(&[p], Prot::RW).unwrap();
        d.unpin_pages(&[p]).unwrap();
    }
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([2, 10, 19, 28]));
    // The unmapped mapping's memory loses its cached locks; the others keep theirs.
    d.unmap(Iova(0), 8 * PAGE).unwrap();
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([10, 19, 28]));
    assert_eq!(locked_pages(&b), BTreeSet::from([10, 19, 28]));
    // A vaddr invalidation: its memory may be unmapped before the update.
    d.invalidate_vaddr(Iova(0x10_0000), 8 * PAGE).unwrap();
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([19, 28]));
    // An IOTLB invalidation of part of a mapping takes the whole mapping's cache.
    d.invalidate_range(Iova(0x20_0000), PAGE).unwrap();
    assert!(cached_pages(&registry, &b).is_empty());
    assert!(locked_pages(&b).is_empty());
    // Dropping the space unlocks what its devices left cached.
    d.pin_pages(&[0x205], Prot::RW).unwrap();
    d.unpin_pages(&[0x205]).unwrap();
    assert_eq!(locked_pages(&b), BTreeSet::from([21]));
    drop(d);
    assert!(locked_pages(&b).is_empty());
    assert_eq!(registry.cached_bytes(), 0);
    assert_eq!(registry.locked_bytes(), 0);
}

/// Pages of `[start, start + pages * 4096)` the kernel has mlocked, by index.
fn locked_in(start: u64, pages: u64) -> BTreeSet<u64> {
    let end = start + pages * PAGE;
    common::vmas(start, end)
        .iter()
        .filter(|v| v.has_flag("lo"))
        .flat_map(|v| (v.start.max(start)..v.end.min(end)).step_by(PAGE as usize))
        .map(|a| (a - start) / PAGE)
        .collect()
}

/// A cached lock must not outlive its memory: after an unmap, the caller may unmap the memory
/// and map something else at the same address, and a pin there must really lock it.
#[test]
fn a_pin_of_new_memory_at_an_old_address_really_locks() {
    const PAGES: u64 = 16;
    let len = (PAGES * PAGE) as usize;
    let fresh = |at: *mut libc::c_void, flags: libc::c_int| {
        // SAFETY: an anonymous private mapping, at `at` only over our own earlier mapping.
        let p = unsafe {
            libc::mmap(
                at,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p
    };
    let at = fresh(std::ptr::null_mut(), 0);
    let hva = memvisor::Hva(at as u64);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    // SAFETY: the memory stays mapped until the mapping is gone (unmapped below first).
    unsafe { d.map_raw(Iova(0), hva, PAGES * PAGE, Prot::RW) }.unwrap();
    d.pin_pages(&[3], Prot::RW).unwrap();
    d.unpin_pages(&[3]).unwrap();
    assert_eq!(locked_in(hva.0, PAGES), BTreeSet::from([3]));
    d.unmap(Iova(0), PAGES * PAGE).unwrap();
    assert_eq!(registry.cached_bytes(), 0);
    // New memory at the same address (MAP_FIXED replaces the old mapping and its lock).
    assert_eq!(fresh(at, libc::MAP_FIXED), at);
    assert!(locked_in(hva.0, PAGES).is_empty());
    // SAFETY: as above.
    unsafe { d.map_raw(Iova(0), hva, PAGES * PAGE, Prot::RW) }.unwrap();
    d.pin_pages(&[3], Prot::RW).unwrap();
    assert_eq!(
        locked_in(hva.0, PAGES),
        BTreeSet::from([3]),
        "the pin of the new memory locked it"
    );
    d.unpin_pages(&[3]).unwrap();
    d.unmap_all().unwrap();
    assert!(locked_in(hva.0, PAGES).is_empty());
    // SAFETY: our own mapping, no longer used by the space.
    unsafe { libc::munmap(at, len) };
}

#[test]
fn thp_locks_are_cached_as_whole_huge_pages() {
    let Some(thp) = whole_thp(4 * MIB, "thp_locks_are_cached_as_whole_huge_pages") else {
        return;
    };
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &thp, 0, 4 * MIB, Prot::RW).unwrap();
    d.pin_pages(&[700], Prot::RW).unwrap();
    d.unpin_pages(&[700]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
    assert_eq!(
        registry.cached(),
        vec![(memvisor::Hva(thp.hva().0 + 2 * MIB), 2 * MIB)],
        "the whole huge page"
    );
    assert_eq!(locked_pages(&thp), (512..1024).collect());
    // Another 4 KiB page of the same huge page is served from the cache, charged whole.
    d.pin_pages(&[1000], Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    assert_eq!(registry.cached_bytes(), 0);
    d.unpin_pages(&[1000]).unwrap();
    assert_eq!(anon_huge_kib(&thp), 4096, "still mapped huge");
    // Evicting unlocks the whole huge page: it stays mapped huge.
    registry.release_cached();
    assert!(locked_pages(&thp).is_empty());
    assert_eq!(
        anon_huge_kib(&thp),
        4096,
        "still mapped huge after the eviction"
    );
}

#[test]
fn hugetlbfs_locks_are_cached_as_whole_huge_pages() {
    let _pool = match HugePageReservation::add(PageSize::Size2M, 2) {
        Ok(r) => r,
        Err(e) => {
            common::skipped(&format!(
                "hugetlbfs_locks_are_cached_as_whole_huge_pages: no 2 MiB hugetlbfs pages here: {e}"
            ));
            return;
        }
    };
    let h = Arc::new(Backing::new(BackingKind::Hugetlb(PageSize::Size2M), 4 * MIB).unwrap());
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &h, 0, 4 * MIB, Prot::RW).unwrap();
    d.pin_pages(&[3, 600], Prot::RW).unwrap();
    d.unpin_pages(&[3]).unwrap();
    assert_eq!(registry.cached(), vec![(h.hva(), 2 * MIB)]);
    d.unpin_pages(&[600]).unwrap();
    assert_eq!(registry.cached_bytes(), 4 * MIB);
    assert_eq!(registry.locked_bytes(), 0);
    // (The kernel neither marks hugetlbfs areas locked nor counts them in VmLck: an mlock
    // there only faults the pages in, so only the registry's view can be checked.)
    d.pin_pages(&[5], Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    assert_eq!(
        registry.cached(),
        vec![(memvisor::Hva(h.hva().0 + 2 * MIB), 2 * MIB)]
    );
    d.unpin_pages(&[5]).unwrap();
    drop(d);
    assert_eq!(registry.cached_bytes(), 0);
}

/// A discard must find only pinned pages locked: the cache over the reported range is unlocked
/// first (the kernel refuses MADV_DONTNEED on locked memory).
#[test]
fn a_discard_unlocks_cached_locks_and_skips_only_pins() {
    let b = Arc::new(
        Backing::with_options(
            BackingKind::PrivateAnon,
            512 * PAGE,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    for p in [10, 20, 30] {
        d.pin_pages(&[p], Prot::RW).unwrap();
    }
    d.unpin_pages(&[10, 20]).unwrap();
    assert_eq!(cached_pages(&registry, &b), BTreeSet::from([10, 20]));
    let discarder = memvisor::Discarder::with_options(
        &t,
        memvisor::DiscardOptions {
            registry: Some(registry.clone()),
            ..memvisor::DiscardOptions::default()
        },
    );
    let out = discarder.report(&[(Gpa(0), b.size())]);
    assert!(out.rejected.is_empty(), "{out:?}");
    assert_eq!(out.skipped_pinned, PAGE, "only the pinned page");
    assert_eq!(out.discarded, b.size() - PAGE);
    assert_eq!(registry.cached_bytes(), 0);
    assert_eq!(locked_pages(&b), BTreeSet::from([30]));
    d.unpin_pages(&[30]).unwrap();
}

/// Under a limit, pins come first: the cache holds at most a quarter of the limit, and gives
/// way whenever a pin needs the room, so the kernel never holds more than the limit.
#[test]
fn under_a_limit_the_cache_gives_way_to_pins() {
    const LIMIT: u64 = 16;
    let b = mem(64);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Bytes(LIMIT * PAGE));
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    for p in 0..32 {
        d.pin_pages(&[p * 2], Prot::RW).unwrap();
        d.unpin_pages(&[p * 2]).unwrap();
        assert!(registry.cached_bytes() <= LIMIT / 4 * PAGE);
    }
    assert_eq!(registry.cached_bytes(), LIMIT / 4 * PAGE);
    d.pin_pages(&[1, 3, 5, 7, 9, 11, 13], Prot::RW).unwrap();
    assert!(locked_pages(&b).len() as u64 <= LIMIT);
    // The whole limit in one call: every cached lock has to go first.
    let all: Vec<u64> = (32..32 + LIMIT - 7).collect();
    d.pin_pages(&all, Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), LIMIT * PAGE);
    assert_eq!(registry.cached_bytes(), 0);
    assert_eq!(locked_pages(&b).len() as u64, LIMIT);
    assert_eq!(errno(d.pin_pages(&[60], Prot::RW)), libc::ENOMEM);
    d.unpin_pages(&all).unwrap();
    // A lower limit shrinks the cache at once.
    registry.set_limit(LockLimit::Bytes(8 * PAGE));
    assert!(registry.cached_bytes() <= 2 * PAGE);
    assert!(locked_pages(&b).len() as u64 <= 8);
}

#[test]
fn an_unmap_closes_the_range_and_waits_for_a_device_that_lets_go_late() {
    let b = mem(8);
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        unpin_wait: std::time::Duration::from_secs(60),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &b, 0, 8 * PAGE, Prot::RW).unwrap();
    d.pin_pages(&[1], Prot::RW).unwrap();
    let (asked, told) = std::sync::mpsc::channel();
    let asked = Mutex::new(asked);
    d.add_unmap_notifier(move |iova, size| {
        let _ = asked.lock().unwrap().send((iova, size));
    });
    let released = Arc::new(AtomicBool::new(false));
    let device = {
        let (d, released) = (d.clone(), released.clone());
        std::thread::spawn(move || {
            assert_eq!(told.recv().unwrap(), (Iova(0), 8 * PAGE));
            // While the unmap waits, the range is a hole for everything new.
            assert_eq!(errno(d.pin_pages(&[2], Prot::READ)), libc::EINVAL);
            assert_eq!(errno(d.translate(Iova(0), 1, Prot::READ)), libc::EFAULT);
            assert_eq!(errno(d.dma_read(Iova(0), &mut [0; 8])), libc::EINVAL);
            assert_eq!(errno(d.dma_write(Iova(0), &[0; 8])), libc::EINVAL);
            std::thread::sleep(std::time::Duration::from_millis(20));
            released.store(true, Ordering::SeqCst);
            d.unpin_pages(&[1]).unwrap();
        })
    };
    assert_eq!(d.unmap(Iova(0), 8 * PAGE).unwrap(), 8 * PAGE);
    assert!(
        released.load(Ordering::SeqCst),
        "the unmap returned before the device let go"
    );
    device.join().unwrap();
    assert_eq!(registry.locked_bytes(), 0);
    assert!(d.is_empty());
}

#[test]
fn a_notifier_that_changes_its_own_space_gets_ebusy_not_a_deadlock() {
    let b = mem(8);
    let (d, registry) = space(PinMode::Lazy, LockLimit::Unlimited);
    d.map_backing(Iova(0), &b, 0, 4 * PAGE, Prot::RW).unwrap();
    d.pin_pages(&[1], Prot::RW).unwrap();
    let got = Arc::new(Mutex::new(Vec::new()));
    let (dev, seen) = (d.clone(), got.clone());
    d.add_unmap_notifier(move |_, _| {
        let e = dev.map_backing(Iova(0x10_0000), &b, 0, PAGE, Prot::RW);
        seen.lock().unwrap().push(errno(e));
        let _ = dev.unpin_pages(&[1]);
    });
    assert_eq!(d.unmap(Iova(0), 4 * PAGE).unwrap(), 4 * PAGE);
    assert_eq!(*got.lock().unwrap(), vec![libc::EBUSY]);
    assert_eq!(registry.locked_bytes(), 0);
}
