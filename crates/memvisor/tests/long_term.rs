//! Long-term pins (`PinRegistry::set_long_term_pins`), checked against the kernel's view: the
//! process's `VmPin` must grow and shrink by exactly what the registry says it holds that way,
//! and no page may be mlocked (`VmFlags: lo`) unless the kernel refused the long-term pin. Pins
//! and unpins through a DMA space, the lock cache, partial unpins, the fallback to mlock, the
//! locked-memory limit, whole mappings over 1 GiB, and discards around pinned pages.
//!
//! `VmPin` is process-wide, so the tests here run one at a time (`serial()`), and no other test
//! binary shares their process.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

use memvisor::dma::{LockLimit, PinMode, PinRegistry};
use memvisor::{
    Backing, BackingKind, BackingOptions, DiscardOptions, Discarder, DmaConfig, DmaSpace, Gpa,
    HugePageReservation, Iova, PageSize, Prot, SlotSpec, SlotTable,
};

use proptest::prelude::*;

mod common;

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// `VmPin` of /proc/self/status, in bytes.
fn vm_pin() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmPin in /proc/self/status")
        * 1024
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

/// A registry with long-term pins on, or None (and a visible skip) where this process may not
/// use them or may not lock `bytes`.
fn registry(limit: LockLimit, bytes: u64, test: &str) -> Option<Arc<PinRegistry>> {
    if !common::may_lock(bytes, test) {
        return None;
    }
    let registry = PinRegistry::new(limit);
    match registry.set_long_term_pins(true) {
        Ok(()) => Some(registry),
        Err(e) => {
            assert_eq!(e.errno(), libc::EOPNOTSUPP, "{e}");
            assert!(!registry.long_term_pins());
            common::skipped(&format!("{test}: {e}"));
            None
        }
    }
}

/// A space of `mode` on `registry` over `pages` pages of fresh populated memory at IOVA 0.
fn space(registry: &Arc<PinRegistry>, mode: PinMode, pages: u64) -> (DmaSpace, Arc<Backing>) {
    let b = Arc::new(
        Backing::with_options(
            BackingKind::PrivateAnon,
            pages * PAGE,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    (space_over(registry, mode, &b), b)
}

/// A space of `mode` on `registry` with all of `b` mapped at IOVA 0.
fn space_over(registry: &Arc<PinRegistry>, mode: PinMode, b: &Arc<Backing>) -> DmaSpace {
    let d = DmaSpace::new(DmaConfig {
        pin_mode: mode,
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), b, 0, b.size(), Prot::RW).unwrap();
    d
}

/// `count` hugetlbfs pages of `page` reserved for the test, a backing over all of them and a
/// Lazy space over that; `None` (the test reported skipped) if the pool cannot grow.
fn hugetlb_space(
    registry: &Arc<PinRegistry>,
    page: PageSize,
    count: u64,
    test: &str,
) -> Option<(HugePageReservation, Arc<Backing>, DmaSpace)> {
    let pool = match HugePageReservation::add(page, count) {
        Ok(pool) => pool,
        Err(e) => {
            common::skipped(&format!("{test}: {e}"));
            return None;
        }
    };
    let b = Arc::new(Backing::new(BackingKind::Hugetlb(page), count * page.bytes()).unwrap());
    let d = space_over(registry, PinMode::Lazy, &b);
    Some((pool, b, d))
}

#[test]
fn a_device_pin_is_a_long_term_pin_and_no_lock() {
    let _s = serial();
    let Some(registry) = registry(LockLimit::Unlimited, MIB, "a_device_pin_is_a_long_term_pin")
    else {
        return;
    };
    let (d, b) = space(&registry, PinMode::Lazy, 64);
    let base = vm_pin();
    let areas = common::vmas(b.hva().0, b.hva().0 + b.size()).len();
    d.pin_pages(&[5, 6, 7, 20], Prot::RW).unwrap();
    assert_eq!(vm_pin() - base, 4 * PAGE);
    assert_eq!(registry.long_term_bytes(), 4 * PAGE);
    assert_eq!(registry.locked_bytes(), 4 * PAGE);
    assert!(locked_pages(&b).is_empty(), "nothing is mlocked");
    assert_eq!(
        common::vmas(b.hva().0, b.hva().0 + b.size()).len(),
        areas,
        "no memory area was split"
    );
    // A second pin of a page nests; only the last unpin lets go.
    d.pin_pages(&[6], Prot::RW).unwrap();
    assert_eq!(vm_pin() - base, 4 * PAGE);
    // The device's unpin leaves its pins cached: uncharged, still pinned in the kernel.
    d.unpin_pages(&[5, 6, 7, 20]).unwrap();
    assert_eq!(registry.locked_bytes(), PAGE);
    assert_eq!(registry.cached_bytes(), 3 * PAGE);
    assert_eq!(vm_pin() - base, 4 * PAGE);
    // The next pin of a cached page takes it back without pinning again.
    d.pin_pages(&[20], Prot::RW).unwrap();
    assert_eq!(registry.cached_bytes(), 2 * PAGE);
    assert_eq!(vm_pin() - base, 4 * PAGE);
    d.unpin_pages(&[6, 20]).unwrap();
    d.release_cached_locks();
    assert_eq!(vm_pin(), base);
    assert_eq!(registry.long_term_bytes(), 0);
    assert_eq!(registry.locked_bytes(), 0);
}

/// A buffer is unpinned whole, with its last page: what a partial unpin lets go stays pinned
/// in the kernel (and in `VmPin`, which `long_term_bytes` follows) until then, and nothing is
/// registered anew — a new registration would pin whatever the addresses map by then, not
/// necessarily the pages a device was given.
#[test]
fn unpinning_part_of_a_run_keeps_its_buffer_until_the_last_page() {
    let _s = serial();
    let Some(registry) = registry(LockLimit::Unlimited, MIB, "unpinning_part_of_a_run") else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let (d, b) = space(&registry, PinMode::Lazy, 64);
    let base = vm_pin();
    // One call, one run of 8 pages: one buffer in the kernel.
    let run: Vec<u64> = (8..16).collect();
    d.pin_pages(&run, Prot::RW).unwrap();
    assert_eq!(vm_pin() - base, 8 * PAGE);
    let whole = vec![(8 * PAGE, 8 * PAGE)];
    assert_eq!(kernel_buffers(&b), whole);
    // The middle of the run goes: the registry holds 6 pages, the kernel still pins 8.
    d.unpin_pages(&[11, 12]).unwrap();
    assert_eq!(registry.locked_bytes(), 6 * PAGE);
    assert_eq!(kernel_buffers(&b), whole);
    assert_eq!(vm_pin() - base, 8 * PAGE);
    assert_eq!(registry.long_term_bytes(), 8 * PAGE);
    // Pinned again, they are taken back as they are.
    d.pin_pages(&[11, 12], Prot::RW).unwrap();
    assert_eq!(kernel_buffers(&b), whole);
    // Let go page by page: the buffer goes with the last.
    for (i, p) in run.iter().enumerate() {
        d.unpin_pages(&[*p]).unwrap();
        let want = if i == run.len() - 1 { 0 } else { 8 * PAGE };
        assert_eq!(vm_pin() - base, want, "after unpinning {p}");
        assert_eq!(registry.long_term_bytes(), want);
    }
    assert!(kernel_buffers(&b).is_empty());
}

/// A pin that takes back part of a buffer and needs pages past it pins only those anew; let
/// go again in another order, every page stays held until its own last unpin.
#[test]
fn a_page_pinned_again_is_held_whatever_became_of_its_old_buffer() {
    let _s = serial();
    let Some(registry) = registry(LockLimit::Unlimited, MIB, "a_page_pinned_again") else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let (d, b) = space(&registry, PinMode::Lazy, 64);
    let base = vm_pin();
    d.pin_pages(&(0..8).collect::<Vec<_>>(), Prot::RW).unwrap();
    d.pin_pages(&[8], Prot::RW).unwrap();
    // Pages 4-8 go in one call: page 8's buffer is unpinned, the first stays whole.
    d.unpin_pages(&[4, 5, 6, 7, 8]).unwrap();
    assert_eq!(kernel_buffers(&b), vec![(0, 8 * PAGE)]);
    // Pages 6-9 again: 6 and 7 from the first buffer, 8 and 9 as a new one.
    d.pin_pages(&[6, 7, 8, 9], Prot::RW).unwrap();
    assert_eq!(
        kernel_buffers(&b),
        vec![(0, 8 * PAGE), (8 * PAGE, 2 * PAGE)]
    );
    d.unpin_pages(&[0, 1, 2, 3, 6, 7]).unwrap();
    assert_eq!(kernel_buffers(&b), vec![(8 * PAGE, 2 * PAGE)]);
    assert_eq!(vm_pin() - base, 2 * PAGE);
    d.unpin_pages(&[8, 9]).unwrap();
    assert_eq!(vm_pin(), base);
}

#[test]
fn memory_the_kernel_will_not_pin_long_term_is_mlocked_instead() {
    let _s = serial();
    let Some(registry) = registry(LockLimit::Unlimited, MIB, "memory_the_kernel_will_not_pin")
    else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let (d, b) = space(&registry, PinMode::Lazy, 16);
    // A read-only page cannot be pinned for writing (EFAULT from the kernel): mlocked.
    // SAFETY: the page lies in the test's own backing, which nothing else uses.
    let rc = unsafe {
        libc::mprotect(
            (b.hva().0 + 3 * PAGE) as *mut libc::c_void,
            PAGE as usize,
            libc::PROT_READ,
        )
    };
    assert_eq!(rc, 0);
    let base = vm_pin();
    d.pin_pages(&[3], Prot::READ).unwrap();
    assert_eq!(locked_pages(&b), BTreeSet::from([3]));
    assert_eq!(vm_pin(), base);
    assert_eq!(registry.locked_bytes(), PAGE);
    assert_eq!(registry.long_term_counts().fallbacks, 1);
    assert_eq!(registry.long_term_counts().pinned, 0);
    // Its neighbours are pinned long-term, in the same registry, side by side.
    d.pin_pages(&[2, 4], Prot::RW).unwrap();
    assert_eq!(vm_pin() - base, 2 * PAGE);
    assert_eq!(registry.long_term_counts().pinned, 2);
    assert_eq!(locked_pages(&b), BTreeSet::from([3]));
    assert_eq!(registry.locked_bytes(), 3 * PAGE);
    // Turned off, new pins are mlocks; the long-term ones stay until unpinned.
    registry.set_long_term_pins(false).unwrap();
    assert!(!registry.long_term_pins());
    d.pin_pages(&[9], Prot::RW).unwrap();
    assert_eq!(locked_pages(&b), BTreeSet::from([3, 9]));
    assert_eq!(vm_pin() - base, 2 * PAGE);
    d.unpin_pages(&[2, 3, 4, 9]).unwrap();
    assert!(locked_pages(&b).is_empty());
    assert_eq!(vm_pin(), base);
    assert_eq!(registry.locked_bytes(), 0);
    assert_eq!(registry.long_term_bytes(), 0);
}

#[test]
fn the_limit_refuses_long_term_pins_with_enomem_and_leaves_nothing() {
    let _s = serial();
    let Some(registry) = registry(LockLimit::Bytes(4 * PAGE), MIB, "the_limit_refuses") else {
        return;
    };
    let (d, _b) = space(&registry, PinMode::Lazy, 64);
    let base = vm_pin();
    d.pin_pages(&[0, 1, 2], Prot::RW).unwrap();
    let err = d.pin_pages(&[10, 11], Prot::RW).unwrap_err();
    assert_eq!(err.errno(), libc::ENOMEM, "{err}");
    assert_eq!(vm_pin() - base, 3 * PAGE);
    assert_eq!(registry.locked_bytes(), 3 * PAGE);
    d.unpin_pages(&[0, 1, 2]).unwrap();
    d.release_cached_locks();
    assert_eq!(vm_pin(), base);
}

/// The buffers this process's io_uring tables hold inside `b`, as (offset in `b`, bytes), from
/// the kernel's own listing (`/proc/self/fdinfo` of each io_uring descriptor).
fn kernel_buffers(b: &Backing) -> Vec<(u64, u64)> {
    let (start, end) = (b.hva().0, b.hva().0 + b.size());
    let mut out = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let is_ring = std::fs::read_link(fd.path())
            .is_ok_and(|t| t.to_string_lossy() == "anon_inode:[io_uring]");
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ));
        let (true, Ok(info)) = (is_ring, info) else {
            continue;
        };
        // Registered buffers are listed as "   3: 0x7f282e738000/8192".
        for line in info.lines() {
            let Some((addr, len)) =
                (line.trim().split_once(": 0x")).and_then(|(_, b)| b.split_once('/'))
            else {
                continue;
            };
            let addr = u64::from_str_radix(addr, 16).unwrap();
            if (start..end).contains(&addr) {
                out.push((addr - start, len.parse::<u64>().unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// Fresh populated THP memory of `bytes` and whether the kernel backed it all with huge pages
/// (else a visible skip for `test`).
fn thp_or_skip(bytes: u64, test: &str) -> Option<Arc<Backing>> {
    let thp = Arc::new(
        Backing::with_options(
            BackingKind::Thp,
            bytes,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let huge = common::smaps_sum(thp.hva().0, thp.hva().0 + bytes, "AnonHugePages");
    if huge < bytes {
        common::skipped(&format!(
            "{test}: THP gave {} KiB of huge pages here, not {}",
            huge / 1024,
            bytes / 1024
        ));
        return None;
    }
    Some(thp)
}

/// On THP memory a pin holds its whole huge page, long-term as with mlock: `VmPin` grows by
/// 2 MiB, and the huge page stays mapped huge through the pin and the unpin.
#[test]
fn a_long_term_pin_inside_a_transparent_huge_page_holds_it_whole() {
    let _s = serial();
    let test = "a_long_term_pin_inside_a_transparent_huge_page";
    let Some(registry) = registry(LockLimit::Unlimited, 4 * MIB, test) else {
        return;
    };
    let Some(thp) = thp_or_skip(4 * MIB, test) else {
        return;
    };
    let huge_kib = || common::smaps_sum(thp.hva().0, thp.hva().0 + 4 * MIB, "AnonHugePages") / 1024;
    let d = space_over(&registry, PinMode::Lazy, &thp);
    let base = vm_pin();
    d.pin_pages(&[600], Prot::RW).unwrap();
    assert_eq!(vm_pin() - base, 2 * MIB);
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    assert!(locked_pages(&thp).is_empty());
    assert_eq!(huge_kib(), 4096, "still mapped huge while pinned");
    d.unpin_pages(&[600]).unwrap();
    d.release_cached_locks();
    assert_eq!(vm_pin(), base);
    assert_eq!(huge_kib(), 4096, "still mapped huge after the unpin");
}

/// A buffer over two transparent huge pages that loses one stays whole, and charged whole,
/// until the other goes too.
#[test]
fn unpinning_one_huge_page_of_a_buffer_keeps_it_whole_and_charged() {
    let _s = serial();
    let test = "unpinning_one_huge_page_of_a_buffer";
    let Some(registry) = registry(LockLimit::Unlimited, 4 * MIB, test) else {
        return;
    };
    let Some(thp) = thp_or_skip(4 * MIB, test) else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let d = space_over(&registry, PinMode::Lazy, &thp);
    let base = vm_pin();
    // Two pages on either side of the huge page boundary: one buffer over both huge pages.
    d.pin_pages(&[511, 512], Prot::RW).unwrap();
    assert_eq!(kernel_buffers(&thp), vec![(0, 4 * MIB)]);
    assert_eq!(vm_pin() - base, 4 * MIB);
    d.unpin_pages(&[511]).unwrap();
    assert_eq!(kernel_buffers(&thp), vec![(0, 4 * MIB)]);
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    assert_eq!(registry.long_term_bytes(), 4 * MIB);
    assert_eq!(vm_pin() - base, 4 * MIB);
    d.unpin_pages(&[512]).unwrap();
    assert_eq!(vm_pin(), base);
    assert!(kernel_buffers(&thp).is_empty());
}

/// Memory pinned in 4 KiB units may still be backed by a transparent huge page (THP
/// `always`, a VMM's own `MADV_HUGEPAGE`, a shmem file with huge pages). The kernel charges a
/// huge page to the first buffer of a table that touches it and to no other, so two pins of
/// pages of one huge page must not share a table: unpinning the charged one would uncharge a
/// huge page the other still pins. Each is charged the huge page instead (`VmPin` above what
/// the registry holds, never below what the kernel pins).
#[test]
fn pins_of_4k_units_inside_one_huge_page_keep_it_charged() {
    let _s = serial();
    let test = "pins_of_4k_units_inside_one_huge_page";
    let Some(registry) = registry(LockLimit::Unlimited, 4 * MIB, test) else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let Some(thp) = thp_or_skip(4 * MIB, test) else {
        return;
    };
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    // The registry pins this memory in 4 KiB units, as it would private anonymous memory.
    // SAFETY: `thp` stays mapped for the space's life (nothing here unmaps it).
    unsafe { d.map_raw(Iova(0), thp.hva(), 4 * MIB, Prot::RW) }.unwrap();
    let base = vm_pin();
    d.pin_pages(&[5], Prot::RW).unwrap();
    d.pin_pages(&[7], Prot::RW).unwrap();
    assert_eq!(kernel_buffers(&thp).len(), 2);
    assert_eq!(registry.long_term_bytes(), 2 * PAGE);
    d.unpin_pages(&[5]).unwrap();
    assert!(
        vm_pin() - base >= 2 * MIB,
        "page 7 still pins its huge page, charged {} KiB",
        (vm_pin() - base) / 1024
    );
    d.unpin_pages(&[7]).unwrap();
    assert_eq!(vm_pin(), base);
}

/// On hugetlbfs a huge page never splits, and the kernel pins (and charges) it whole when any
/// page of it is pinned: a pin holding one huge page registers one 4 KiB page of it, not 512
/// (or 262,144 for 1 GiB pages). Holding more than one huge page at once registers them whole.
#[test]
fn a_long_term_pin_of_one_hugetlbfs_page_registers_one_page_of_it() {
    let _s = serial();
    let test = "a_long_term_pin_of_one_hugetlbfs_page";
    let Some(registry) = registry(LockLimit::Unlimited, 4 * MIB, test) else {
        return;
    };
    let Some((_pool, h, d)) = hugetlb_space(&registry, PageSize::Size2M, 2, test) else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let base = vm_pin();
    d.pin_pages(&[600], Prot::RW).unwrap();
    assert_eq!(kernel_buffers(&h), vec![(2 * MIB, PAGE)]);
    assert_eq!(
        vm_pin() - base,
        2 * MIB,
        "the kernel charges the whole huge page"
    );
    assert_eq!(registry.long_term_bytes(), 2 * MIB);
    assert_eq!(registry.locked_bytes(), 2 * MIB);
    // The device writes through the pinned page and the process sees it: the same memory.
    let hva = d.pin_pages(&[700], Prot::RW).unwrap()[0];
    assert_eq!(
        kernel_buffers(&h).len(),
        1,
        "a held huge page is not registered again"
    );
    // SAFETY: page 700 of the backing, pinned just above and alive until the unpin below.
    unsafe { std::ptr::write_volatile(hva.0 as *mut u8, 0x5a) };
    let mut byte = [0u8];
    h.read(700 * PAGE, &mut byte).unwrap();
    assert_eq!(byte[0], 0x5a);
    d.unpin_pages(&[600, 700]).unwrap();
    assert_eq!(vm_pin(), base);
    assert!(kernel_buffers(&h).is_empty());
    // Two huge pages held at once: one buffer over both, whole until both go.
    d.pin_pages(&[511, 512], Prot::RW).unwrap();
    assert_eq!(kernel_buffers(&h), vec![(0, 4 * MIB)]);
    assert_eq!(vm_pin() - base, 4 * MIB);
    d.unpin_pages(&[511]).unwrap();
    assert_eq!(vm_pin() - base, 4 * MIB);
    d.unpin_pages(&[512]).unwrap();
    assert_eq!(vm_pin(), base);
}

/// The same on 1 GiB hugetlbfs pages, where registering the whole huge page cost 0.4-0.7 ms on
/// the reference machine (against 0.7 µs for one page of it).
#[test]
fn a_long_term_pin_of_one_gib_hugetlbfs_page_registers_one_page_of_it() {
    let _s = serial();
    let test = "a_long_term_pin_of_one_gib_hugetlbfs_page";
    let Some(registry) = registry(LockLimit::Unlimited, 1 << 30, test) else {
        return;
    };
    let Some((_pool, h, d)) = hugetlb_space(&registry, PageSize::Size1G, 1, test) else {
        return;
    };
    let base = vm_pin();
    d.pin_pages(&[12345], Prot::RW).unwrap();
    assert_eq!(kernel_buffers(&h), vec![(0, PAGE)]);
    assert_eq!(vm_pin() - base, 1 << 30);
    d.unpin_pages(&[12345]).unwrap();
    d.release_cached_locks();
    assert_eq!(vm_pin(), base);
    assert!(kernel_buffers(&h).is_empty());
}

/// An Eager space pins whole mappings when they are made; one over 1 GiB (the kernel's largest
/// io_uring buffer) is pinned as several buffers and let go whole at unmap.
#[test]
fn an_eager_mapping_over_a_gib_is_pinned_long_term_whole() {
    let _s = serial();
    let size = 1024 * MIB + 8 * MIB;
    let Some(registry) = registry(LockLimit::Unlimited, size, "an_eager_mapping_over_a_gib") else {
        return;
    };
    let base = vm_pin();
    let (d, b) = space(&registry, PinMode::Eager, size / PAGE);
    assert_eq!(vm_pin() - base, size);
    assert_eq!(registry.long_term_bytes(), size);
    assert!(locked_pages(&b).is_empty());
    // In steps of 64 MiB, one kernel buffer each (not 2 MiB: 16,384 buffers would stop at
    // 32 GiB).
    assert_eq!(registry.long_term_counts().pinned, size.div_ceil(64 * MIB));
    d.unmap(Iova(0), size).unwrap();
    assert_eq!(vm_pin(), base);
    assert_eq!(registry.locked_bytes(), 0);
}

/// A discard skips pages pinned long-term and keeps their bytes (the kernel would let
/// `MADV_DONTNEED` take them from the process, so the registry is all that stops it), and the
/// pins its cache holds are let go first, so that memory is really given back.
#[test]
fn a_discard_skips_long_term_pinned_pages_and_frees_the_cached_ones() {
    let _s = serial();
    let Some(registry) = registry(LockLimit::Unlimited, 4 * MIB, "a_discard_skips") else {
        return;
    };
    let (d, b) = space(&registry, PinMode::Lazy, 512);
    for p in 0..512 {
        b.write(p * PAGE, &[(p % 251 + 1) as u8; PAGE as usize])
            .unwrap();
    }
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    let discarder = Discarder::with_options(
        &t,
        DiscardOptions {
            registry: Some(registry.clone()),
            ..DiscardOptions::default()
        },
    );
    let base = vm_pin();
    d.pin_pages(&[10, 11, 300], Prot::RW).unwrap();
    d.pin_pages(&[40], Prot::RW).unwrap();
    d.unpin_pages(&[40]).unwrap(); // cached
    assert_eq!(vm_pin() - base, 4 * PAGE);
    let out = discarder.report(&[(Gpa(0), 2 * MIB)]);
    assert_eq!(out.skipped_pinned, 3 * PAGE);
    assert_eq!(out.discarded, 2 * MIB - 3 * PAGE);
    assert_eq!(vm_pin() - base, 3 * PAGE, "the cached pin was let go");
    let mut page = vec![0u8; PAGE as usize];
    for p in 0..512 {
        b.read(p * PAGE, &mut page).unwrap();
        let want = if [10, 11, 300].contains(&p) {
            (p % 251 + 1) as u8
        } else {
            0
        };
        assert!(page.iter().all(|&x| x == want), "page {p}");
    }
    d.unpin_pages(&[10, 11, 300]).unwrap();
    d.release_cached_locks();
    assert_eq!(vm_pin(), base);
}

/// A page a device let go of while the rest of its buffer is held stays pinned by the kernel;
/// a discard must leave it alone, or the page a later pin takes back from the buffer would no
/// longer be the one the process maps.
#[test]
fn a_discard_skips_pages_whose_buffer_is_still_pinned() {
    let _s = serial();
    let Some(registry) = registry(
        LockLimit::Unlimited,
        MIB,
        "a_discard_skips_pages_whose_buffer",
    ) else {
        return;
    };
    registry.set_lock_cache(0, 0);
    let (d, b) = space(&registry, PinMode::Lazy, 64);
    b.write(11 * PAGE, &[0x5a; 2 * PAGE as usize]).unwrap();
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    let discarder = Discarder::with_options(
        &t,
        DiscardOptions {
            registry: Some(registry.clone()),
            ..DiscardOptions::default()
        },
    );
    d.pin_pages(&(8..16).collect::<Vec<_>>(), Prot::RW).unwrap();
    d.unpin_pages(&[11, 12]).unwrap();
    let out = discarder.report(&[(Gpa(11 * PAGE), 2 * PAGE)]);
    assert_eq!(out.discarded, 0);
    assert_eq!(out.skipped_pinned, 2 * PAGE);
    let mut page = vec![0u8; 2 * PAGE as usize];
    b.read(11 * PAGE, &mut page).unwrap();
    assert!(page.iter().all(|&x| x == 0x5a), "the pages were kept");
    // Once the buffer goes whole, the same report discards them.
    d.unpin_pages(&[8, 9, 10, 13, 14, 15]).unwrap();
    let out = discarder.report(&[(Gpa(11 * PAGE), 2 * PAGE)]);
    assert_eq!(out.discarded, 2 * PAGE);
}

#[derive(Clone, Debug)]
enum Op {
    /// pin_pages of `len` pages from `page`.
    Pin { page: u64, len: u64 },
    /// unpin_pages of the n-th pin still held, or of `keep..` of its pages only (a partial
    /// unpin: the rest stays pinned until the pin's last op).
    Unpin { nth: usize, keep: u64 },
    /// The lock cache's entries bound.
    Cache { entries: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u64..60, 1u64..6).prop_map(|(page, len)| Op::Pin { page, len }),
        4 => (0usize..8, 0u64..4).prop_map(|(nth, keep)| Op::Unpin { nth, keep }),
        1 => (0usize..4).prop_map(|entries| Op::Cache { entries }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Any sequence of pins, whole and partial unpins and cache bounds: the kernel's `VmPin`
    /// is exactly what the registry says it pins long-term, the account exactly the pinned
    /// pages, nothing is mlocked but what the kernel would not pin long-term, and when every
    /// pin is gone and the cache emptied, nothing is left pinned.
    #[test]
    fn vm_pin_follows_any_sequence_exactly(ops in proptest::collection::vec(op(), 1..40)) {
        let _s = serial();
        let Some(registry) = registry(LockLimit::Unlimited, MIB, "vm_pin_follows_any_sequence")
        else {
            return Ok(());
        };
        let (d, b) = space(&registry, PinMode::Lazy, 64);
        let base = vm_pin();
        // Pins held, each as the pages not yet unpinned.
        let mut held: Vec<Vec<u64>> = Vec::new();
        for op in ops {
            match op {
                Op::Pin { page, len } => {
                    let pages: Vec<u64> = (page..page + len).collect();
                    d.pin_pages(&pages, Prot::RW).unwrap();
                    held.push(pages);
                }
                Op::Unpin { nth, keep } => {
                    if held.is_empty() {
                        continue;
                    }
                    let i = nth % held.len();
                    let keep = (keep as usize).min(held[i].len() - 1);
                    let gone: Vec<u64> = held[i].drain(keep..).collect();
                    d.unpin_pages(&gone).unwrap();
                    if held[i].is_empty() {
                        held.remove(i);
                    }
                }
                Op::Cache { entries } => registry.set_lock_cache(64 * PAGE, entries),
            }
            let pinned: BTreeSet<u64> = held.iter().flatten().copied().collect();
            prop_assert_eq!(registry.locked_bytes(), pinned.len() as u64 * PAGE);
            prop_assert_eq!(vm_pin() - base, registry.long_term_bytes());
            // Parts of buffers let go stay pinned until the rest of their buffer goes.
            prop_assert!(
                registry.long_term_bytes() >= registry.locked_bytes() + registry.cached_bytes()
            );
            // Nothing is mlocked unless a pin fell back to it: past 32 buffers within 2 MiB of
            // memory THP may back (this machine's settings decide), no table may take more.
            prop_assert!(
                locked_pages(&b).is_empty() || registry.long_term_counts().fallbacks > 0
            );
        }
        for pages in held {
            d.unpin_pages(&pages).unwrap();
        }
        d.release_cached_locks();
        prop_assert_eq!(vm_pin(), base);
        prop_assert_eq!(registry.long_term_bytes(), 0);
    }
}
