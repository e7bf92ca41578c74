//! Exhausted limits and values at the edges, each a regression test of a way pinning once went
//! wrong: a failed `mlock` or `munlock` (the process's `vm.max_map_count`, a file truncated under
//! its mapping), THP memory that does not end on a huge page, the same page pinned through two
//! granules, and arithmetic at the top of the address space. After every step the registry's
//! locked bytes must equal what the kernel says this process has locked (`VmLck`), so the tests
//! here run one at a time (`serial()`) and nothing else in this binary locks memory.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use memvisor::dma::{LockLimit, PinMode, PinRegistry};
use memvisor::{
    Backing, BackingKind, BackingOptions, DiscardOptions, Discarder, DmaConfig, DmaSpace, Gpa, Hva,
    Iova, Prot, RejectReason, SlotSpec, SlotTable,
};

mod common;

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A Lazy space on a registry of its own, without a limit.
fn space() -> (DmaSpace, Arc<PinRegistry>) {
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    (d, registry)
}

/// Asserts that what the registry charges plus what its lock cache holds is exactly what the
/// kernel holds locked beyond `base`.
#[track_caller]
fn assert_accounted(registry: &PinRegistry, base: u64, step: &str) {
    assert_eq!(
        registry.locked_bytes() + registry.cached_bytes(),
        common::vm_lck() - base,
        "{step}: the registry's locked and cached bytes differ from the kernel's VmLck"
    );
}

/// Fills the process's memory map up to `vm.max_map_count` (within one area of slack), so that
/// any split of an area fails with ENOMEM; dropping it gives the room back.
struct MapFiller {
    base: *mut libc::c_void,
    len: usize,
}

impl MapFiller {
    fn new() -> MapFiller {
        let max: usize = std::fs::read_to_string("/proc/sys/vm/max_map_count")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let len = (max + 16) * 2 * PAGE as usize;
        // SAFETY: a fresh private reservation the kernel places; nothing else uses it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        assert_ne!(base, libc::MAP_FAILED);
        // Every other page readable: each mprotect splits off one more area, until the kernel
        // refuses.
        for i in 0..max + 16 {
            // SAFETY: the page lies inside our own reservation.
            let rc = unsafe {
                libc::mprotect(
                    base.cast::<u8>().add((2 * i + 1) * PAGE as usize).cast(),
                    PAGE as usize,
                    libc::PROT_READ,
                )
            };
            if rc != 0 {
                assert_eq!(
                    std::io::Error::last_os_error().raw_os_error(),
                    Some(libc::ENOMEM)
                );
                return MapFiller { base, len };
            }
        }
        panic!("vm.max_map_count was never reached");
    }
}

impl Drop for MapFiller {
    fn drop(&mut self) {
        // SAFETY: our own reservation, used by nothing else.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

#[test]
fn a_munlock_that_fails_keeps_its_pages_accounted_and_is_retried() {
    let _s = serial();
    let base = common::vm_lck();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * PAGE).unwrap());
    let slots = SlotTable::new();
    slots.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    let (d, registry) = space();
    // Without the lock cache, the unpin itself unlocks (the cached case is the next test).
    registry.set_lock_cache(0, 0);
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    d.pin_pages(&[8, 9, 10], Prot::RW).unwrap();
    assert_accounted(&registry, base, "pinned 3 pages");
    {
        let _full = MapFiller::new();
        // Unlocking the middle page needs the locked area split in three: the kernel says no.
        d.unpin_pages(&[9]).unwrap();
        assert_eq!(registry.locked_bytes(), 3 * PAGE);
        assert_accounted(&registry, base, "unpin with vm.max_map_count reached");
        // A discard must leave the still-locked page alone instead of failing on it.
        let discarder = Discarder::with_options(
            &slots,
            DiscardOptions {
                registry: Some(registry.clone()),
                ..DiscardOptions::default()
            },
        );
        let out = discarder.report(&[(Gpa(0), b.size())]);
        assert!(
            !out.rejected
                .iter()
                .any(|r| matches!(r.reason, RejectReason::Failed { .. })),
            "{out:?}"
        );
        assert_eq!(out.skipped_pinned, 3 * PAGE);
    }
    // With room in the map again, the next unpin retries the failed munlock first.
    d.unpin_pages(&[8, 10]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
    assert_accounted(&registry, base, "unpinned all");
}

#[test]
fn a_cached_lock_whose_munlock_fails_stays_accounted_and_is_retried() {
    let _s = serial();
    let base = common::vm_lck();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * PAGE).unwrap());
    let slots = SlotTable::new();
    slots.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    let (d, registry) = space();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    d.pin_pages(&[8, 9, 10], Prot::RW).unwrap();
    // The unpin keeps the middle page locked in the cache: no munlock, nothing to fail.
    d.unpin_pages(&[9]).unwrap();
    assert_eq!(registry.locked_bytes(), 2 * PAGE);
    assert_eq!(registry.cached_bytes(), PAGE);
    assert_accounted(&registry, base, "unpinned into the cache");
    {
        let _full = MapFiller::new();
        // A discard over it must unlock the cached page first, and the kernel cannot split the
        // area: the page stays locked, is charged (a lock that could not be undone) and is
        // skipped — never a failed MADV_DONTNEED.
        let discarder = Discarder::with_options(
            &slots,
            DiscardOptions {
                registry: Some(registry.clone()),
                ..DiscardOptions::default()
            },
        );
        let out = discarder.report(&[(Gpa(0), b.size())]);
        assert!(
            !out.rejected
                .iter()
                .any(|r| matches!(r.reason, RejectReason::Failed { .. })),
            "{out:?}"
        );
        assert_eq!(out.skipped_pinned, 3 * PAGE);
        assert_eq!(registry.cached_bytes(), 0);
        assert_eq!(registry.locked_bytes(), 3 * PAGE);
        assert_accounted(&registry, base, "cache eviction failed");
    }
    // With room in the map again, the next unpin retries the failed munlock first.
    d.unpin_pages(&[8, 10]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
    assert_accounted(&registry, base, "unpinned all");
    registry.release_cached();
    assert_eq!(common::vm_lck(), base, "nothing stays locked");
}

#[test]
fn a_failed_mlock_is_undone_whole() {
    let _s = serial();
    let base = common::vm_lck();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * PAGE).unwrap());
    let (d, registry) = space();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    {
        let _full = MapFiller::new();
        let e = d.pin_pages(&[20, 21], Prot::RW).unwrap_err();
        assert_eq!(e.errno(), libc::ENOMEM, "{e}");
        assert_eq!(registry.locked_bytes(), 0);
        assert_eq!(d.device_pinned_pages(), 0);
        assert_accounted(&registry, base, "failed pin");
    }
    d.pin_pages(&[20, 21], Prot::RW).unwrap();
    assert_accounted(&registry, base, "pin after room came back");
    d.unpin_pages(&[20, 21]).unwrap();
    assert_accounted(&registry, base, "unpinned");
}

#[test]
fn pinning_a_file_truncated_under_its_mapping_fails_and_locks_nothing() {
    let _s = serial();
    let base = common::vm_lck();
    let dir = std::env::temp_dir().join(format!("memvisor-limits-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("truncated");
    let b = Arc::new(
        Backing::new(
            BackingKind::File {
                path: path.clone(),
                shared: true,
            },
            32 * PAGE,
        )
        .unwrap(),
    );
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(16 * PAGE)
        .unwrap();
    let (d, registry) = space();
    d.set_pin_mode(PinMode::Eager).unwrap();
    let e = d
        .map_backing(Iova(0), &b, 0, b.size(), Prot::RW)
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    assert!(d.is_empty());
    assert_eq!(registry.locked_bytes(), 0);
    assert_accounted(&registry, base, "failed pin of a truncated file");
    drop(d);
    drop(b);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn thp_memory_that_ends_inside_a_huge_page_locks_only_its_own_memory() {
    let _s = serial();
    if !common::may_lock(2 * MIB, "thp_memory_that_ends_inside_a_huge_page") {
        return;
    }
    let base = common::vm_lck();
    let b = Arc::new(
        Backing::with_options(
            BackingKind::Thp,
            3 * MIB,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let (d, registry) = space();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    let last = b.size() / PAGE - 1;
    d.pin_pages(&[last], Prot::RW).unwrap();
    // The last huge page is locked whole, and all of it is the backing's own memory.
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    assert_accounted(&registry, base, "pinned the last page");
    let end = b.hva().0 + 4 * MIB;
    for vma in common::vmas(b.hva().0 + 2 * MIB, end) {
        assert!(
            vma.end <= end || !vma.has_flag("lo"),
            "locked past the backing"
        );
    }
    d.unpin_pages(&[last]).unwrap();
    assert_accounted(&registry, base, "unpinned");
    assert_eq!(registry.locked_bytes(), 0);
}

#[test]
fn one_page_pinned_through_a_4k_and_a_2m_granule_is_unlocked_with_its_last_pin() {
    let _s = serial();
    if !common::may_lock(
        2 * MIB + PAGE,
        "one_page_pinned_through_a_4k_and_a_2m_granule",
    ) {
        return;
    }
    let base = common::vm_lck();
    let b = Arc::new(
        Backing::with_options(
            BackingKind::Thp,
            4 * MIB,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let (d, registry) = space();
    // IOVA 0: the backing (pins lock whole huge pages); IOVA 1 GiB: the same memory as raw
    // memory (pins lock 4 KiB pages).
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    const RAW: u64 = 1 << 30;
    // SAFETY: `b` outlives the space's use of it: the space is dropped first.
    unsafe { d.map_raw(Iova(RAW), b.hva(), b.size(), Prot::RW) }.unwrap();
    let raw_page = |p: u64| RAW / PAGE + p;
    for order in [[0usize, 1], [1, 0]] {
        d.pin_pages(&[raw_page(3)], Prot::RW).unwrap();
        assert_accounted(&registry, base, "4 KiB pin");
        d.pin_pages(&[7], Prot::RW).unwrap();
        assert_eq!(registry.locked_bytes(), 2 * MIB);
        assert_accounted(&registry, base, "2 MiB pin beside it");
        d.pin_pages(&[3], Prot::RW).unwrap();
        assert_accounted(&registry, base, "the same page through both");
        d.unpin_pages(&[3]).unwrap();
        let unpins = [raw_page(3), 7];
        for i in order {
            d.unpin_pages(&[unpins[i]]).unwrap();
            assert_accounted(&registry, base, "one of the two unpinned");
        }
        assert_eq!(registry.locked_bytes(), 0, "order {order:?}");
    }
    drop(d);
}

#[test]
fn a_huge_vaddr_wait_waits_instead_of_overflowing() {
    let _s = serial();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * PAGE).unwrap());
    let d = DmaSpace::new(DmaConfig {
        vaddr_wait: Duration::MAX,
        registry: Some(PinRegistry::new(LockLimit::Unlimited)),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    d.invalidate_vaddr(Iova(0), b.size()).unwrap();
    let updater = {
        let (d, b) = (d.clone(), b.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            d.update_vaddr(Iova(0), b.size(), &b, 0).unwrap();
        })
    };
    let t = d.translate(Iova(PAGE), 8, memvisor::Prot::READ).unwrap();
    assert_eq!(t.hva, Hva(b.hva().0 + PAGE));
    d.pin_pages(&[2], Prot::READ).unwrap();
    d.unpin_pages(&[2]).unwrap();
    updater.join().unwrap();
}

#[test]
fn a_pin_batch_of_usize_max_pins_in_one_step() {
    let _s = serial();
    if !common::may_lock(64 * PAGE, "a_pin_batch_of_usize_max_pins_in_one_step") {
        return;
    }
    let base = common::vm_lck();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * PAGE).unwrap());
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        pin_batch: usize::MAX,
        pin_mode: PinMode::Eager,
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), b.size());
    assert_accounted(&registry, base, "eager map");
    d.unmap_all().unwrap();
    assert_accounted(&registry, base, "unmapped");
}

#[test]
fn a_write_pin_at_the_top_of_the_iova_space_is_tracked() {
    let _s = serial();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 4 * PAGE).unwrap());
    let (d, _registry) = space();
    let top = u64::MAX - b.size() + 1;
    d.map_backing(Iova(top), &b, 0, b.size(), Prot::RW).unwrap();
    d.start_dirty_tracking().unwrap();
    let last = u64::MAX / PAGE;
    d.pin_pages(&[last], Prot::WRITE).unwrap();
    let bits = d.get_and_clear_dirty(Iova(top), b.size(), PAGE).unwrap();
    assert_eq!(bits, vec![0b1000]);
    d.unpin_pages(&[last]).unwrap();
}

#[test]
fn reports_whose_ranges_add_up_past_2_to_the_64_are_refused_not_overflowed() {
    let _s = serial();
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * PAGE).unwrap());
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    let discarder = Discarder::with_options(
        &t,
        DiscardOptions {
            registry: Some(PinRegistry::new(LockLimit::Unlimited)),
            ..DiscardOptions::default()
        },
    );
    let half = 1u64 << 63;
    // Touching halves of the whole space, then the same huge range again and again.
    let out = discarder.report(&[
        (Gpa(0), half),
        (Gpa(half), half),
        (Gpa(0), u64::MAX),
        (Gpa(0), u64::MAX),
        (Gpa(0), u64::MAX),
    ]);
    assert_eq!(out.discarded, 4 * b.size());
    assert_eq!(
        out.rejected_bytes(),
        u64::MAX,
        "saturates rather than wraps"
    );
}

#[test]
fn a_huge_page_reservation_too_big_for_memory_is_refused_up_front() {
    let _s = serial();
    if !common::is_root() {
        common::skipped(
            "a_huge_page_reservation_too_big_for_memory_is_refused_up_front: needs root to \
             change the huge page pool",
        );
        return;
    }
    // With one page reserved the pool is not empty, so `pool + count` can pass 2^64.
    let _one = match memvisor::HugePageReservation::add(memvisor::PageSize::Size2M, 1) {
        Ok(r) => r,
        Err(e) => {
            common::skipped(&format!(
                "a_huge_page_reservation_too_big_for_memory_is_refused_up_front: cannot reserve \
                 one 2 MiB huge page: {e}"
            ));
            return;
        }
    };
    let before = memvisor::backing::free_huge_pages(memvisor::PageSize::Size2M).unwrap();
    for count in [u64::MAX, u64::MAX / 2, 1 << 40] {
        let e = memvisor::HugePageReservation::add(memvisor::PageSize::Size2M, count).unwrap_err();
        assert_eq!(e.errno(), libc::ENOMEM, "{e}");
    }
    assert_eq!(
        memvisor::backing::free_huge_pages(memvisor::PageSize::Size2M).unwrap(),
        before
    );
}

/// Drops CAP_IPC_LOCK from the calling thread's effective capabilities (capabilities are per
/// thread), so that the kernel holds this thread's mlocks to RLIMIT_MEMLOCK; returns whether
/// the thread had it.
fn drop_ipc_lock() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two Data words (version 3) into `data`, which we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    const IPC_LOCK: u32 = 1 << 14;
    if data[0].effective & IPC_LOCK == 0 {
        return false;
    }
    data[0].effective &= !IPC_LOCK;
    // SAFETY: capset reads the header and two Data words; it changes only this thread's set.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
    true
}

/// RLIMIT_MEMLOCK's soft limit set for the whole process until dropped.
struct SoftMemlock(libc::rlimit);

impl SoftMemlock {
    fn set(bytes: u64) -> SoftMemlock {
        let mut old = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into `old`, setrlimit reads one.
        unsafe {
            assert_eq!(libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut old), 0);
            let new = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: old.rlim_max,
            };
            assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &new), 0);
        }
        SoftMemlock(old)
    }
}

impl Drop for SoftMemlock {
    fn drop(&mut self) {
        // SAFETY: setrlimit reads one rlimit; the old soft limit is within the hard one.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &self.0) };
    }
}

/// A non-root process with `ulimit -l 64` (or root without CAP_IPC_LOCK): cached locks count in
/// the kernel's VmLck, so they must never push it past the limit, and never make a pin fail
/// that would fit without them — neither this registry's cache nor another registry's.
#[test]
fn a_small_rlimit_is_shared_with_the_cache_without_spurious_failures() {
    let _s = serial();
    std::thread::spawn(|| {
        let had = drop_ipc_lock();
        if !had {
            eprintln!("(no CAP_IPC_LOCK to drop: running under the process's own rlimit)");
        }
        const LIMIT: u64 = 16; // pages: 64 KiB
        let base = common::vm_lck();
        if base != 0 {
            common::skipped(&format!(
                "a_small_rlimit_is_shared_with_the_cache_without_spurious_failures: {base} \
                 bytes are locked in this process already"
            ));
            return;
        }
        let _limit = SoftMemlock::set(LIMIT * PAGE);
        let within = |step: &str| {
            let now = common::vm_lck();
            assert!(now <= LIMIT * PAGE, "{step}: VmLck {now} past the limit");
        };
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 256 * PAGE).unwrap());
        let registry = PinRegistry::new(LockLimit::Rlimit);
        let d = DmaSpace::new(DmaConfig {
            registry: Some(registry.clone()),
            ..DmaConfig::default()
        })
        .unwrap();
        d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
        for i in 0..64 {
            d.pin_pages(&[i * 3], Prot::RW).unwrap();
            within("single pins");
            d.unpin_pages(&[i * 3]).unwrap();
            assert_accounted(&registry, 0, "single unpins");
        }
        assert!(registry.cached_bytes() > 0, "the cache is in use");
        assert!(registry.cached_bytes() <= LIMIT / 4 * PAGE);
        // The whole limit in one call: the cache makes room, no ENOMEM.
        let all: Vec<u64> = (200..200 + LIMIT).collect();
        d.pin_pages(&all, Prot::RW).unwrap();
        assert_eq!(common::vm_lck(), LIMIT * PAGE);
        assert_eq!(registry.cached_bytes(), 0);
        // One page more does not fit: the registry refuses, naming the rlimit.
        let e = d.pin_pages(&[100], Prot::RW).unwrap_err();
        assert_eq!(e.errno(), libc::ENOMEM);
        assert!(e.to_string().contains("RLIMIT_MEMLOCK"), "{e}");
        d.unpin_pages(&all).unwrap();
        within("unpinned");

        // Another registry's cache in the way: its locks count in the same VmLck, so the
        // kernel refuses the mlock; every cache is emptied and the mlock tried again.
        let other = PinRegistry::new(LockLimit::Unlimited);
        let d2 = DmaSpace::new(DmaConfig {
            registry: Some(other.clone()),
            ..DmaConfig::default()
        })
        .unwrap();
        let b2 = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * PAGE).unwrap());
        d2.map_backing(Iova(0), &b2, 0, b2.size(), Prot::RW)
            .unwrap();
        for p in [1, 3, 5] {
            d2.pin_pages(&[p], Prot::RW).unwrap();
            d2.unpin_pages(&[p]).unwrap();
        }
        assert_eq!(other.cached_bytes(), 3 * PAGE);
        registry.release_cached();
        d.pin_pages(&all, Prot::RW).unwrap();
        assert_eq!(
            other.cached_bytes(),
            0,
            "the other registry's cache gave way"
        );
        assert_eq!(common::vm_lck(), LIMIT * PAGE);
        d.unpin_pages(&all).unwrap();
        drop((d, d2));
        assert_eq!(common::vm_lck(), 0, "nothing stays locked");
    })
    .join()
    .unwrap();
}

/// RLIMIT_MEMLOCK lowered below what the registry holds while it holds it (`prlimit --pid` on a
/// serving back end): the kernel keeps what is locked, a pin that needs a new lock fails whole
/// with ENOMEM, a pin of memory already held still works, and once the limit is back pins
/// succeed again. At every step the registry's held bytes, read with `VmLck` at the same
/// moment ([`PinRegistry::kernel_check`]), equal `VmLck`.
#[test]
fn a_limit_lowered_below_what_is_locked_fails_new_pins_whole_and_keeps_the_count() {
    let _s = serial();
    std::thread::spawn(|| {
        drop_ipc_lock();
        if common::vm_lck() != 0 {
            common::skipped(
                "a_limit_lowered_below_what_is_locked_fails_new_pins_whole_and_keeps_the_count: \
                 memory is locked in this process already",
            );
            return;
        }
        let agree = |registry: &PinRegistry, step: &str| {
            let k = registry.kernel_check();
            assert_eq!(
                Some(k.held_bytes),
                k.vm_lck,
                "{step}: registry holds {} bytes, VmLck says {:?} ({k:?})",
                k.held_bytes,
                k.vm_lck
            );
            assert_eq!(k.held_bytes, k.charged_bytes + k.cached_bytes, "{step}");
        };
        let _limit = SoftMemlock::set(256 * PAGE);
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 512 * PAGE).unwrap());
        let registry = PinRegistry::new(LockLimit::Rlimit);
        let d = DmaSpace::new(DmaConfig {
            registry: Some(registry.clone()),
            ..DmaConfig::default()
        })
        .unwrap();
        d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
        let held: Vec<u64> = (0..32).collect();
        d.pin_pages(&held, Prot::RW).unwrap();
        for p in [100, 102, 104] {
            d.pin_pages(&[p], Prot::RW).unwrap();
            d.unpin_pages(&[p]).unwrap();
        }
        agree(&registry, "before");
        let before = registry.kernel_check().held_bytes;
        assert!(before > 32 * PAGE, "the cache holds locks too");
        {
            // Lower than what is locked now.
            let _low = SoftMemlock::set(8 * PAGE);
            // New memory in several runs: refused whole, nothing of it pinned or locked.
            let runs: Vec<u64> = (200..216).chain(300..304).collect();
            let e = d.pin_pages(&runs, Prot::RW).unwrap_err();
            assert_eq!(e.errno(), libc::ENOMEM, "{e}");
            assert!(
                runs.iter()
                    .all(|&p| registry.pin_count(Hva(b.hva().0 + p * PAGE)) == 0)
            );
            agree(&registry, "refused under the lowered limit");
            // Memory the registry holds already: no new lock, it still pins.
            d.pin_pages(&held[..4], Prot::RW).unwrap();
            d.unpin_pages(&held[..4]).unwrap();
            agree(&registry, "held memory pinned again");
            d.unpin_pages(&held).unwrap();
            agree(&registry, "unpinned under the lowered limit");
        }
        // The limit back: the same pin succeeds.
        let runs: Vec<u64> = (200..216).chain(300..304).collect();
        d.pin_pages(&runs, Prot::RW).unwrap();
        agree(&registry, "pinned after the limit came back");
        d.unpin_pages(&runs).unwrap();
        drop(d);
        assert_eq!(common::vm_lck(), 0, "nothing stays locked");
    })
    .join()
    .unwrap();
}
