//! The merged dirty log on a real KVM guest: a real-mode guest writes into pages of some slots,
//! a host "device" thread writes through the table into pages of others (and of one the guest
//! also writes), and one read-and-clear per slot must report exactly the pages written; a page
//! written between KVM's read and its clear must show up in the next round. The negative check:
//! memvisor's own log alone (no KVM bitmap) must miss every page the guest wrote.
//!
//! Run with manual dirty-log protection (read, then clear in chunks) and with KVM's classic
//! read-and-clear. Skips (printing "skipped: ... no /dev/kvm") without /dev/kvm.

mod common;

use std::collections::BTreeMap;

use common::*;
use memvisor::{Gpa, SlotFlags, SlotId, SlotSpec};
use memvisor_kvm::Options;

const SLOT: u64 = 0x10000;
/// Slots 1..=4 at 0x20000, 0x30000, ... each 64 KiB (16 pages), all logging dirty pages.
fn base(id: SlotId) -> u64 {
    0x10000 + u64::from(id) * SLOT
}

fn run(options: Options, name: &str) {
    let Some(kvm) = kvm_or_skip(name) else { return };
    let mut g = guest(&kvm, options, 4 * SLOT);
    for id in 1..=4u32 {
        g.slots
            .insert(
                SlotSpec::new(id, Gpa(base(id)), g.memory.clone())
                    .window(u64::from(id - 1) * SLOT, SLOT)
                    .flags(SlotFlags::LOG_DIRTY),
            )
            .unwrap();
    }
    assert_eq!(
        g.slots.manual_protect(),
        options.manual_protect && g.slots.caps().manual_protect && options.dirty_ring.is_none()
    );
    assert_eq!(g.slots.rings().is_some(), options.dirty_ring.is_some());
    println!(
        "{name}: caps {:?}, manual protect {}, region2 {}",
        g.slots.caps(),
        g.slots.manual_protect(),
        g.slots.uses_region2()
    );
    // Fresh slots: nothing dirty.
    for log in g.slots.take_dirty_logs().unwrap().logs {
        assert_eq!(
            pages(&log.words),
            Vec::<u64>::new(),
            "slot {} at start",
            log.slot
        );
    }

    // Round 1: the guest writes slots 1 and 2; a device thread writes slots 3 and 4 and page 9
    // of slot 2, at the same time.
    let guest_pages: &[(SlotId, u64)] = &[(1, 0), (1, 3), (1, 15), (2, 1), (2, 8)];
    let device_pages: &[(SlotId, u64)] = &[(3, 2), (3, 5), (4, 0), (4, 15), (2, 9)];
    let table = g.slots.table().clone();
    let device = std::thread::spawn(move || {
        let mut cursor = table.cursor();
        for &(id, page) in device_pages {
            let gpa = base(id) + page * 4096 + 100;
            cursor.write(Gpa(gpa), &[0x5a; 64]).unwrap();
        }
    });
    for &(id, page) in guest_pages {
        let p = probe(&mut g.vcpu, segment(base(id) + page * 4096));
        assert_eq!(
            p.write_exit, None,
            "the guest's write to slot {id} page {page} exited"
        );
    }
    device.join().unwrap();
    let mut want: BTreeMap<SlotId, Vec<u64>> = BTreeMap::new();
    for &(id, page) in guest_pages.iter().chain(device_pages) {
        want.entry(id).or_default().push(page);
    }
    want.values_mut().for_each(|v| v.sort());
    let got: BTreeMap<SlotId, Vec<u64>> = g
        .slots
        .take_dirty_logs()
        .unwrap()
        .logs
        .into_iter()
        .map(|l| (l.slot, pages(&l.words)))
        .collect();
    assert_eq!(
        got, want,
        "round 1: the merged log is exactly what the guest and the device wrote"
    );
    println!("{name}: round 1 merged log {got:?}");
    // The guest's writes are in memory.
    let mut word = [0u8; 2];
    g.slots
        .table()
        .read(Gpa(base(1) + 3 * 4096), &mut word)
        .unwrap();
    assert_eq!(u16::from_le_bytes(word), segment(base(1) + 3 * 4096));
    // Read and cleared: the next round starts empty.
    for log in g.slots.take_dirty_logs().unwrap().logs {
        assert_eq!(
            pages(&log.words),
            Vec::<u64>::new(),
            "slot {} after the take",
            log.slot
        );
    }

    // Negative check: memvisor's own log alone misses the guest's writes; the merged log, which
    // adds KVM's bitmap, has them (taking memvisor's log does not take KVM's).
    probe(&mut g.vcpu, segment(base(1) + 5 * 4096));
    table_write(&g, 3, 7);
    let own = g.slots.table().take_dirty_log(1).unwrap();
    assert_eq!(
        pages(&own),
        Vec::<u64>::new(),
        "memvisor's own log must miss the guest's write"
    );
    let own3 = g.slots.table().take_dirty_log(3).unwrap();
    assert_eq!(
        pages(&own3),
        vec![7],
        "memvisor's own log has the device's write"
    );
    assert_eq!(
        pages(&g.slots.take_dirty_log(1).unwrap()),
        vec![5],
        "KVM's bitmap has it"
    );
    println!(
        "{name}: negative check: memvisor's log alone missed the guest's page 5 of slot 1: ok"
    );

    // A guest write between KVM's read and its clear: not in this round (it came after the
    // read), in the next one (the clear clears only what was read).
    // The window is reached through a test hook (`take_dirty_log_with`, feature `test-hooks`).
    #[cfg(feature = "test-hooks")]
    {
        probe(&mut g.vcpu, segment(base(1) + 2 * 4096));
        let vcpu = &mut g.vcpu;
        let this = g
            .slots
            .take_dirty_log_with(1, || {
                probe(vcpu, segment(base(1) + 11 * 4096));
            })
            .unwrap();
        assert_eq!(
            pages(&this),
            vec![2],
            "this round: the page written before the read"
        );
        let next = g.slots.take_dirty_log(1).unwrap();
        assert_eq!(
            pages(&next),
            vec![11],
            "next round: the page written between read and clear"
        );
        println!(
            "{name}: write between read and clear: round n {:?}, round n+1 {:?}",
            pages(&this),
            pages(&next)
        );
    }
    #[cfg(not(feature = "test-hooks"))]
    skipped(&format!(
        "{name}: write between read and clear: needs --features test-hooks \
         (cargo test -p memvisor-kvm --features test-hooks --test dirty_log)"
    ));

    // Turning logging off and on again: a flags-only update; the log restarts empty and works.
    g.slots.set_flags(2, SlotFlags::NONE).unwrap();
    assert!(
        g.slots.take_dirty_log(2).is_err(),
        "no log while logging is off"
    );
    g.slots.set_flags(2, SlotFlags::LOG_DIRTY).unwrap();
    probe(&mut g.vcpu, segment(base(2) + 4 * 4096));
    assert_eq!(pages(&g.slots.take_dirty_log(2).unwrap()), vec![4]);

    // Re-created in place (read-only on and off: KVM deletes and re-creates, and its log of the
    // old memslot goes with it): every page of the slot is reported once, then the log goes on.
    probe(&mut g.vcpu, segment(base(4) + 6 * 4096));
    g.slots
        .set_flags(4, SlotFlags::LOG_DIRTY | SlotFlags::READ_ONLY)
        .unwrap();
    let p = probe(&mut g.vcpu, segment(base(4) + 8 * 4096));
    assert_eq!(
        p.write_exit,
        Some(base(4) + 8 * 4096),
        "a read-only slot's write exits"
    );
    g.slots.set_flags(4, SlotFlags::LOG_DIRTY).unwrap();
    assert_eq!(
        pages(&g.slots.take_dirty_log(4).unwrap()),
        (0..16).collect::<Vec<_>>()
    );
    probe(&mut g.vcpu, segment(base(4) + 9 * 4096));
    assert_eq!(pages(&g.slots.take_dirty_log(4).unwrap()), vec![9]);
}

fn table_write(g: &Guest, id: SlotId, page: u64) {
    g.slots
        .table()
        .write(Gpa(base(id) + page * 4096), &[1, 2, 3])
        .unwrap();
}

#[test]
fn merged_log_with_manual_protect_reports_exactly_the_pages_written() {
    run(
        Options {
            // One word per clear: the chunking is exercised on 16-page slots.
            clear_chunk_pages: 64,
            ..Options::default()
        },
        "dirty log (manual protect)",
    );
}

#[test]
fn merged_log_with_classic_get_dirty_log_reports_exactly_the_pages_written() {
    run(
        Options {
            manual_protect: false,
            region2: false,
            ..Options::default()
        },
        "dirty log (classic, region v1)",
    );
}

/// Ring sizes to try, smallest first: KVM's minimum depends on the host (PML reserves more).
const RING_SIZES: [u32; 4] = [256, 512, 1024, 2048];

/// A guest on dirty rings of the smallest size KVM takes, or `None` (skipped, said why).
fn ring_guest(name: &str, memory: u64) -> Option<Guest> {
    let kvm = kvm_or_skip(name)?;
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    if vm.check_extension_raw(kvm_bindings::KVM_CAP_DIRTY_LOG_RING_ACQ_REL.into()) <= 0 {
        skipped(&format!("{name}: KVM lacks KVM_CAP_DIRTY_LOG_RING_ACQ_REL"));
        return None;
    }
    drop(vm);
    for entries in RING_SIZES {
        let options = with_env_faults(Options {
            dirty_ring: Some(entries),
            ..Options::default()
        });
        match try_guest(&kvm, options, memory) {
            Ok(g) => return Some(g),
            Err(e) if e.errno() == libc::EINVAL => continue,
            Err(e) if e.errno() == libc::EOPNOTSUPP && pvm() => {
                assert!(e.to_string().contains("use the dirty bitmap"), "{e}");
                skipped(&format!(
                    "{name}: dirty rings unsound on this KVM (PVM overruns them): {e}"
                ));
                return None;
            }
            Err(e) => panic!("{name}: {e}"),
        }
    }
    panic!("{name}: KVM took none of the ring sizes {RING_SIZES:?}");
}

#[test]
fn merged_log_with_dirty_rings_reports_exactly_the_pages_written() {
    let Some(g) = ring_guest("dirty log (dirty ring)", 64 * 4096) else {
        return;
    };
    let entries = g.slots.rings().unwrap().entries();
    drop(g);
    run(
        with_env_faults(Options {
            dirty_ring: Some(entries),
            ..Options::default()
        }),
        "dirty log (dirty ring)",
    );
}

#[test]
fn a_full_dirty_ring_is_harvested_on_the_vcpu_thread_and_nothing_is_lost() {
    // The smallest ring KVM takes, and every page below 1 MiB the guest can reach past its code
    // slot (224 pages, the most this real-mode guest can dirty): with a 256-entry ring the vCPU
    // exits with the ring full.
    let Some(mut g) = ring_guest("dirty ring full", 0xE0000) else {
        return;
    };
    g.slots
        .insert(
            SlotSpec::new(1, Gpa(0x20000), g.memory.clone())
                .window(0, 0xE0000)
                .flags(SlotFlags::LOG_DIRTY),
        )
        .unwrap();
    let all: Vec<u64> = (0..0xE0).collect();
    for round in 0..3 {
        for &p in &all {
            probe(&mut g.vcpu, segment(0x20000 + p * 4096));
        }
        assert_eq!(
            pages(&g.slots.take_dirty_log(1).unwrap()),
            all,
            "round {round}"
        );
    }
    let entries = g.slots.rings().unwrap().entries();
    println!(
        "dirty ring full: {entries}-entry ring, 3 rounds of 224 pages, {} ring-full exits, \
         every page reported each round",
        g.vcpu.ring_full_exits()
    );
    if entries == 256 {
        assert!(
            g.vcpu.ring_full_exits() > 0,
            "224 pages must fill a 256-entry ring"
        );
    }
}

/// The flags of the entries of a vCPU's dirty ring that name one page, read through a mapping
/// of the ring of the test's own (KVM's flags: 1 dirty, 2 collected, 0 reset by KVM).
#[cfg(feature = "test-hooks")]
fn ring_flags(vcpu: &memvisor_kvm::Vcpu, entries: u32, slot: u32, offset: u64) -> Vec<u32> {
    use std::os::fd::AsRawFd;
    let len = entries as usize * size_of::<kvm_bindings::kvm_dirty_gfn>();
    // SAFETY: a new shared read-only mapping of the vCPU fd's ring, at the offset KVM documents
    // (KVM_DIRTY_LOG_PAGE_OFFSET pages), unmapped below; nothing else is at the address.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            vcpu.fd().as_raw_fd(),
            kvm_bindings::KVM_DIRTY_LOG_PAGE_OFFSET as libc::off_t * 4096,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED, "mmap of the dirty ring");
    let ring = ptr.cast::<kvm_bindings::kvm_dirty_gfn>();
    let mut flags = Vec::new();
    for i in 0..entries as usize {
        // SAFETY: i < entries, inside the mapping; volatile reads of memory KVM writes.
        let (f, s, o) = unsafe {
            let e = ring.add(i);
            (
                std::ptr::read_volatile(&raw const (*e).flags),
                std::ptr::read_volatile(&raw const (*e).slot),
                std::ptr::read_volatile(&raw const (*e).offset),
            )
        };
        if (s, o) == (slot, offset) {
            flags.push(f);
        }
    }
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(ptr, len) };
    flags
}

/// A vCPU's full-ring harvest has collected a page (marked its entry RESET) and not yet called
/// `KVM_RESET_DIRTY_RINGS` when the migration thread reads the slot's log. That read reports
/// the page, and its caller copies it at once: KVM must have reset the entry by then (api.rst,
/// KVM_CAP_DIRTY_LOG_RING: the reset is what write-protects the page again), or a guest write
/// after the copy and before the vCPU's reset finds the page writable and pushes nothing.
#[cfg(feature = "test-hooks")]
#[test]
fn a_page_another_harvest_collected_is_reported_only_once_kvm_reset_its_entry() {
    let name = "dirty ring: a read inside a vCPU's harvest";
    let Some(mut g) = ring_guest(name, 16 * 4096) else {
        return;
    };
    const BASE: u64 = 0x20000;
    g.slots
        .insert(
            SlotSpec::new(1, Gpa(BASE), g.memory.clone())
                .window(0, 16 * 4096)
                .flags(SlotFlags::LOG_DIRTY),
        )
        .unwrap();
    assert_eq!(
        pages(&g.slots.take_dirty_log(1).unwrap()),
        Vec::<u64>::new()
    );
    let kvm_slot = g.slots.kvm_slot(1).unwrap();
    let rings = g.slots.rings().unwrap().clone();
    let entries = rings.entries();
    probe(&mut g.vcpu, segment(BASE + 3 * 4096));
    assert_eq!(
        ring_flags(&g.vcpu, entries, kvm_slot, 3),
        vec![1],
        "page 3 pushed"
    );
    let (mut during, mut flags) = (Vec::new(), Vec::new());
    rings
        .harvest_with(|| {
            // The migration thread reads page 3 (and would copy it now), then the guest writes it
            // again.
            during = pages(&g.slots.take_dirty_log(1).unwrap());
            flags = ring_flags(&g.vcpu, entries, kvm_slot, 3);
            let p = probe(&mut g.vcpu, segment(BASE + 3 * 4096));
            assert_eq!(p.write_exit, None);
        })
        .unwrap();
    let after = pages(&g.slots.take_dirty_log(1).unwrap());
    println!(
        "{name}: the read inside the harvest {during:?} (page 3's entry flags then {flags:?}), \
         the next read {after:?}"
    );
    assert_eq!(during, vec![3]);
    assert!(
        flags.first() == Some(&0),
        "page 3 was reported while its ring entry was still {flags:?} (2: collected, not reset \
         by KVM): the page is not write-protected again when the caller copies it"
    );
    assert_eq!(
        after,
        vec![3],
        "the write after the read that reported page 3"
    );
}

#[test]
fn a_dirty_ring_larger_than_kvm_takes_is_refused_with_kvms_errno_naming_the_size() {
    let name = "dirty ring too big";
    let Some(kvm) = kvm_or_skip(name) else { return };
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    let max = vm.check_extension_raw(kvm_bindings::KVM_CAP_DIRTY_LOG_RING_ACQ_REL.into());
    if max <= 0 {
        skipped(&format!("{name}: KVM lacks KVM_CAP_DIRTY_LOG_RING_ACQ_REL"));
        return;
    }
    // Twice the largest ring KVM offers: a power of two, above every minimum.
    let entries = (max as u32 / 16) * 2;
    let bytes = u64::from(entries) * 16;
    // KVM's own answer for that size (kvm_vm_ioctl_enable_dirty_log_ring: E2BIG).
    let cap = kvm_bindings::kvm_enable_cap {
        cap: kvm_bindings::KVM_CAP_DIRTY_LOG_RING_ACQ_REL,
        args: [bytes, 0, 0, 0],
        ..Default::default()
    };
    let kernel = vm
        .enable_cap(&cap)
        .expect_err("KVM took a ring above its own maximum")
        .errno();
    drop(vm);
    // The refusal of the size, not PVM's (a test-hooks build lets rings through on PVM; no
    // guest runs here).
    #[allow(unused_mut)]
    let mut options = Options {
        dirty_ring: Some(entries),
        ..Options::default()
    };
    #[cfg(feature = "test-hooks")]
    {
        options.faults.rings_on_pvm = true;
    }
    if pvm() && !cfg!(feature = "test-hooks") {
        skipped(&format!(
            "{name}: PVM refuses rings first (run with --features test-hooks)"
        ));
        return;
    }
    let vm = std::sync::Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let err = memvisor_kvm::KvmSlots::with_options(vm, memvisor::SlotTable::new(), options)
        .expect_err("a ring above KVM's maximum was taken");
    println!("{name}: KVM answers {kernel} for {bytes} bytes; the binding: {err}");
    assert_eq!(
        err.errno(),
        kernel,
        "the binding must refuse a {entries}-entry ring with the errno KVM gives: {err}"
    );
    assert!(err.to_string().contains(&entries.to_string()), "{err}");
}

#[test]
fn many_pages_cleared_in_chunks() {
    // A 704 KiB slot (176 pages: two full words and 48 pages of a third) with clear chunks of
    // 64 pages: a clean word between dirty ones, and a last chunk that ends at the slot's end
    // in the middle of a word (the one place KVM takes a count that is no multiple of 64).
    let Some(kvm) = kvm_or_skip("dirty log chunks") else {
        return;
    };
    let mut g = guest(
        &kvm,
        Options {
            clear_chunk_pages: 64,
            ..Options::default()
        },
        0x10_0000,
    );
    g.slots
        .insert(
            SlotSpec::new(1, Gpa(0x20000), g.memory.clone())
                .window(0, 0xB0000)
                .flags(SlotFlags::LOG_DIRTY),
        )
        .unwrap();
    let written = [0u64, 63, 130, 175, 150];
    for &p in &written {
        probe(&mut g.vcpu, segment(0x20000 + p * 4096));
    }
    let mut want = written.to_vec();
    want.sort();
    assert_eq!(pages(&g.slots.take_dirty_log(1).unwrap()), want);
    // Cleared: written again, each page shows again (KVM write-protected it in the clear).
    for &p in &written[..3] {
        probe(&mut g.vcpu, segment(0x20000 + p * 4096));
    }
    assert_eq!(pages(&g.slots.take_dirty_log(1).unwrap()), vec![0, 63, 130]);
    assert_eq!(
        pages(&g.slots.take_dirty_log(1).unwrap()),
        Vec::<u64>::new()
    );
}
