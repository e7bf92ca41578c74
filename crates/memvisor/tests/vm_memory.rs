//! The vm-memory adapter against the traits: every generic check runs on memvisor's
//! `SlotMemory` and on vm-memory's own `GuestMemoryMmap` with the same layout, so the two must
//! behave the same. Then what only memvisor has: read-only slots, its translation, its dirty log.
#![cfg(feature = "vm-memory")]

use std::io;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use memvisor::{
    Backing, BackingKind, DmaConfig, DmaSpace, Gpa, Iova, Prot, SlotFlags, SlotMemory, SlotSpace,
    SlotSpec, SlotTable, Snapshot,
};
use vm_memory::bitmap::{AtomicBitmap, Bitmap};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryMmap, GuestMemoryRegion, MemoryRegionAddress, Permissions,
};

#[path = "../examples/vm_memory.rs"]
mod example;

const KIB: u64 = 1 << 10;
/// Two adjacent 64 KiB regions, a 128 KiB hole, a third region.
const LAYOUT: [(u64, u64); 3] = [(0, 64 * KIB), (64 * KIB, 64 * KIB), (256 * KIB, 64 * KIB)];
const BOUNDARY: u64 = 64 * KIB;
const HOLE: u64 = 128 * KIB;
const END: u64 = 320 * KIB;

/// The layout as memvisor slots (slot i = region i), each with `flags[i]`.
fn slots(flags: [SlotFlags; 3]) -> SlotTable {
    let table = SlotTable::new();
    for (i, ((gpa, size), flags)) in LAYOUT.into_iter().zip(flags).enumerate() {
        let kind = if i == 0 {
            BackingKind::Memfd
        } else {
            BackingKind::PrivateAnon
        };
        let backing = Arc::new(Backing::new(kind, size).unwrap());
        table
            .insert(SlotSpec::new(i as u32, Gpa(gpa), backing).flags(flags))
            .unwrap();
    }
    table
}

fn memvisor(flags: [SlotFlags; 3]) -> (SlotTable, SlotMemory) {
    let table = slots(flags);
    let mem = SlotMemory::from_table(&table);
    (table, mem)
}

fn plain() -> (SlotTable, SlotMemory) {
    memvisor([SlotFlags::NONE; 3])
}

fn mmap() -> GuestMemoryMmap<AtomicBitmap> {
    let ranges: Vec<_> = LAYOUT
        .iter()
        .map(|&(gpa, size)| (GuestAddress(gpa), size as usize))
        .collect();
    GuestMemoryMmap::from_ranges(&ranges).unwrap()
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn is_invalid_address(e: &GuestMemoryError, at: u64) -> bool {
    matches!(e, GuestMemoryError::InvalidGuestAddress(a) if a.0 == at)
}

// ---- generic checks, written against vm-memory's traits only ----

fn objects(mem: &impl GuestMemory) {
    mem.write_obj(0x1122_3344_5566_7788u64, GuestAddress(0x100))
        .unwrap();
    assert_eq!(
        mem.read_obj::<u64>(GuestAddress(0x100)).unwrap(),
        0x1122_3344_5566_7788
    );
    // An object straddling the region boundary.
    let at = GuestAddress(BOUNDARY - 3);
    mem.write_obj(0xdead_beef_cafe_f00du64, at).unwrap();
    assert_eq!(mem.read_obj::<u64>(at).unwrap(), 0xdead_beef_cafe_f00d);
    assert_eq!(mem.read_obj::<u8>(at).unwrap(), 0x0d);
    // Atomics (naturally aligned, one region).
    mem.store(0xabcd_u32, GuestAddress(0x200), Ordering::Release)
        .unwrap();
    assert_eq!(
        mem.load::<u32>(GuestAddress(0x200), Ordering::Acquire)
            .unwrap(),
        0xabcd
    );
    // The last object that fits, and one byte more.
    let last = GuestAddress(END - 8);
    mem.write_obj(1u64, last).unwrap();
    assert_eq!(mem.read_obj::<u64>(last).unwrap(), 1);
    assert!(mem.write_obj(1u64, GuestAddress(END - 7)).is_err());
}

fn slices_across_regions(mem: &impl GuestMemory) {
    let data = pattern(4096, 7);
    let at = GuestAddress(BOUNDARY - 1000);
    mem.write_slice(&data, at).unwrap();
    let mut back = vec![0u8; data.len()];
    mem.read_slice(&mut back, at).unwrap();
    assert_eq!(back, data);
    assert_eq!(mem.read(&mut back, at).unwrap(), data.len());
    // Each region holds its part: 1000 bytes below the boundary, the rest above.
    let mut low = vec![0u8; 1000];
    mem.read_slice(&mut low, at).unwrap();
    assert_eq!(low, data[..1000]);
    let mut high = vec![0u8; 3096];
    mem.read_slice(&mut high, GuestAddress(BOUNDARY)).unwrap();
    assert_eq!(high, data[1000..]);
    // The slice iterator cuts at the boundary.
    let lens: Vec<usize> = mem
        .get_slices(at, data.len(), Permissions::Read)
        .unwrap()
        .map(|s| s.unwrap().len())
        .collect();
    assert_eq!(lens, [1000, 3096]);
    // Streams in and out.
    let src = pattern(3000, 99);
    mem.read_exact_volatile_from(
        GuestAddress(BOUNDARY - 1500),
        &mut src.as_slice(),
        src.len(),
    )
    .unwrap();
    let mut out = Vec::new();
    mem.write_all_volatile_to(GuestAddress(BOUNDARY - 1500), &mut out, src.len())
        .unwrap();
    assert_eq!(out, src);
    // Zero-length accesses succeed anywhere.
    assert_eq!(mem.write(&[], GuestAddress(HOLE)).unwrap(), 0);
}

fn holes(mem: &impl GuestMemory) {
    let mut buf = [0u8; 16];
    let e = mem.read_slice(&mut buf, GuestAddress(HOLE)).unwrap_err();
    assert!(is_invalid_address(&e, HOLE), "{e:?}");
    let e = mem.write_obj(1u32, GuestAddress(HOLE + 0x100)).unwrap_err();
    assert!(is_invalid_address(&e, HOLE + 0x100), "{e:?}");
    let e = mem.read_obj::<u64>(GuestAddress(END)).unwrap_err();
    assert!(is_invalid_address(&e, END), "{e:?}");
    assert!(mem.read_obj::<u8>(GuestAddress(u64::MAX)).is_err());
    // Running into the hole: vm-memory copies up to it, then reports the short count.
    let data = pattern(512, 3);
    let at = GuestAddress(HOLE - 256);
    assert_eq!(mem.write(&data, at).unwrap(), 256);
    let e = mem.write_slice(&data, at).unwrap_err();
    assert!(
        matches!(
            e,
            GuestMemoryError::PartialBuffer {
                expected: 512,
                completed: 256
            }
        ),
        "{e:?}"
    );
    let mut back = vec![0u8; 512];
    assert_eq!(mem.read(&mut back, at).unwrap(), 256);
    assert_eq!(back[..256], data[..256]);
    assert!(!mem.check_range(at, 512, Permissions::Read));
    assert!(mem.check_range(at, 256, Permissions::ReadWrite));
    assert!(mem.check_range(GuestAddress(0), HOLE as usize, Permissions::Write));
}

fn regions(mem: &impl GuestMemoryBackend) {
    assert_eq!(mem.num_regions(), 3);
    let found: Vec<_> = mem.iter().map(|r| (r.start_addr().0, r.len())).collect();
    assert_eq!(found, LAYOUT);
    assert_eq!(mem.last_addr(), GuestAddress(END - 1));
    for (i, &(start, len)) in LAYOUT.iter().enumerate() {
        for addr in [start, start + 1, start + len / 2, start + len - 1] {
            let r = mem.find_region(GuestAddress(addr)).unwrap();
            assert_eq!(
                (r.start_addr().0, r.len()),
                LAYOUT[i],
                "region of {addr:#x}"
            );
            let (r2, off) = mem.to_region_addr(GuestAddress(addr)).unwrap();
            assert_eq!(r2.start_addr(), r.start_addr());
            assert_eq!(off, MemoryRegionAddress(addr - start));
        }
    }
    for addr in [HOLE, HOLE + 1, 256 * KIB - 1, END, u64::MAX] {
        assert!(mem.find_region(GuestAddress(addr)).is_none(), "{addr:#x}");
        assert!(!mem.address_in_range(GuestAddress(addr)));
        assert!(mem.get_host_address(GuestAddress(addr)).is_err());
    }
    // checked_offset: the result must be guest memory; hopping over a hole is fine.
    let base = GuestAddress(0x10);
    assert_eq!(mem.checked_offset(base, 0x100), Some(GuestAddress(0x110)));
    assert_eq!(
        mem.checked_offset(base, (BOUNDARY - 0x10) as usize),
        Some(GuestAddress(BOUNDARY))
    );
    assert_eq!(mem.checked_offset(base, (HOLE - 0x10) as usize), None);
    assert_eq!(
        mem.checked_offset(base, (256 * KIB - 0x10) as usize),
        Some(GuestAddress(256 * KIB))
    );
    assert_eq!(mem.checked_offset(base, (END - 0x10) as usize), None);
    assert_eq!(mem.checked_offset(base, usize::MAX), None);
    // Host addresses are contiguous within a region.
    let h = mem.get_host_address(GuestAddress(0x1000)).unwrap() as usize;
    let h2 = mem.get_host_address(GuestAddress(0x1fff)).unwrap() as usize;
    assert_eq!(h2 - h, 0xfff);
    // Region-level access, relative to the region's start.
    let r = mem.find_region(GuestAddress(256 * KIB)).unwrap();
    r.write_obj(0x5a5au16, MemoryRegionAddress(0x10)).unwrap();
    assert_eq!(
        r.read_obj::<u16>(MemoryRegionAddress(0x10)).unwrap(),
        0x5a5a
    );
    assert!(
        r.write_obj(0u16, MemoryRegionAddress(64 * KIB - 1))
            .is_err()
    );
    assert!(r.get_slice(MemoryRegionAddress(64 * KIB - 4), 8).is_err());
    assert_eq!(r.as_volatile_slice().unwrap().len(), 64 * KIB as usize);
    assert!(!r.is_hugetlbfs().unwrap_or(false));
}

/// Writes through each kind of access and returns which 4 KiB pages of regions 0 and 1 ended
/// up dirty, read through vm-memory's own bitmap interface.
fn dirty_pages(mem: &impl GuestMemory) -> [Vec<usize>; 2] {
    let base = BOUNDARY;
    mem.write_obj(1u8, GuestAddress(base + 0x10)).unwrap(); // page 0
    mem.write_slice(&[1; 0x1002], GuestAddress(base + 0x2fff))
        .unwrap(); // pages 2..=4
    mem.store(1u64, GuestAddress(base + 0x6008), Ordering::SeqCst)
        .unwrap(); // page 6
    mem.read_exact_volatile_from(GuestAddress(base + 0x8000), &mut &[1u8; 8][..], 8)
        .unwrap(); // page 8
    // A write across the boundary also dirties the last page of region 0.
    mem.write_obj(1u64, GuestAddress(base - 4)).unwrap();
    // Reads mark nothing.
    let mut buf = [0u8; 64];
    mem.read_slice(&mut buf, GuestAddress(base + 0xa000))
        .unwrap();
    let physical = mem.physical_memory().unwrap();
    [0, base].map(|start| {
        let region = physical.find_region(GuestAddress(start)).unwrap();
        (0..16)
            .filter(|page| region.bitmap().dirty_at(page * 4096))
            .collect()
    })
}

#[test]
fn objects_read_and_write_alike() {
    objects(&plain().1);
    objects(&mmap());
}

#[test]
fn slices_cross_region_boundaries_alike() {
    slices_across_regions(&plain().1);
    slices_across_regions(&mmap());
}

#[test]
fn holes_fail_alike() {
    holes(&plain().1);
    holes(&mmap());
}

#[test]
fn regions_translate_alike() {
    let (_table, mem) = plain();
    regions(mem.regions());
    regions(mem.physical_memory().unwrap());
    regions(&mmap());
}

#[test]
fn dirty_pages_are_marked_alike() {
    let expected = [vec![15], vec![0, 2, 3, 4, 6, 8]];
    let (table, mem) = memvisor([SlotFlags::LOG_DIRTY; 3]);
    assert_eq!(dirty_pages(&mem), expected);
    assert_eq!(dirty_pages(&mmap()), expected);
    // The marks are memvisor's dirty log: take_dirty_log returns and clears them.
    assert_eq!(table.take_dirty_log(1).unwrap()[0], 0b1_0101_1101);
    assert_eq!(table.take_dirty_log(0).unwrap()[0], 1 << 15);
    assert_eq!(table.take_dirty_log(1).unwrap()[0], 0);
    // Without LOG_DIRTY a region has no bitmap and marks nothing.
    let (_, mem) = plain();
    assert_eq!(dirty_pages(&mem), [Vec::<usize>::new(), Vec::new()]);
    assert!(mem.regions().iter().all(|r| r.bitmap().is_none()));
}

// ---- memvisor specifics ----

#[test]
fn host_addresses_match_memvisor_translation() {
    let (table, mem) = plain();
    for addr in [0, 0x1234, BOUNDARY - 1, BOUNDARY, 256 * KIB + 0x42, END - 1] {
        let host = mem.regions().get_host_address(GuestAddress(addr)).unwrap();
        let t = table.lookup(Gpa(addr)).unwrap();
        assert_eq!(host as u64, t.hva.0, "gpa {addr:#x}");
        let r = mem.regions().find_region(GuestAddress(addr)).unwrap();
        assert_eq!(r.slot().id(), t.slot);
        assert_eq!(r.start_addr().0 + r.len() - addr, t.len);
    }
    // Bytes written through vm-memory are memvisor's bytes, and the other way round.
    mem.write_slice(b"from vm-memory", GuestAddress(BOUNDARY - 5))
        .unwrap();
    let mut buf = [0u8; 14];
    table.read(Gpa(BOUNDARY - 5), &mut buf).unwrap();
    assert_eq!(&buf, b"from vm-memory");
    table.write(Gpa(256 * KIB), b"from memvisor").unwrap();
    let mut buf = [0u8; 13];
    mem.read_slice(&mut buf, GuestAddress(256 * KIB)).unwrap();
    assert_eq!(&buf, b"from memvisor");
}

fn assert_read_only(e: &GuestMemoryError) {
    let GuestMemoryError::IOError(io) = e else {
        panic!("expected a read-only error, got {e:?}");
    };
    assert_eq!(io.kind(), io::ErrorKind::PermissionDenied, "{io}");
    let inner = io.get_ref().unwrap().downcast_ref::<memvisor::Error>();
    assert_eq!(inner.unwrap().errno(), libc::EFAULT, "{io}");
}

#[test]
fn read_only_slots_refuse_writes() {
    let ro = SlotFlags::READ_ONLY;
    let (table, mem) = memvisor([SlotFlags::NONE, ro, SlotFlags::NONE]);
    table.write(Gpa(0), &[0xee; 16]).unwrap();
    let at = GuestAddress(BOUNDARY + 0x100);
    assert_read_only(&mem.write_obj(1u32, at).unwrap_err());
    assert_read_only(&mem.write_slice(&[1; 8], at).unwrap_err());
    assert_read_only(&mem.write(&[1; 8], at).unwrap_err());
    assert_read_only(&mem.store(1u32, at, Ordering::SeqCst).unwrap_err());
    assert_read_only(
        &mem.read_volatile_from(at, &mut &[1u8; 8][..], 8)
            .unwrap_err(),
    );
    // A write that starts in a writable slot and runs into the read-only one writes nothing.
    let e = mem
        .write_slice(&[1; 32], GuestAddress(BOUNDARY - 16))
        .unwrap_err();
    assert_read_only(&e);
    assert!(e.to_string().contains("read-only slot 1"), "{e}");
    let mut buf = [0xffu8; 16];
    table.read(Gpa(BOUNDARY - 16), &mut buf).unwrap();
    assert_eq!(buf, [0; 16]);
    // Reads work; permissions are answered per access.
    assert_eq!(mem.read_obj::<u32>(at).unwrap(), 0);
    assert!(mem.check_range(at, 8, Permissions::Read));
    assert!(!mem.check_range(at, 8, Permissions::Write));
    assert!(!mem.check_range(
        GuestAddress(0),
        2 * BOUNDARY as usize,
        Permissions::ReadWrite
    ));
    assert!(mem.check_range(GuestAddress(0), BOUNDARY as usize, Permissions::ReadWrite));
    assert!(mem.get_slices(at, 8, Permissions::Write).is_err());
    // The region's own Bytes refuse too.
    let region = mem.regions().find_region(at).unwrap();
    assert!(region.is_read_only());
    assert_read_only(&region.write_obj(1u8, MemoryRegionAddress(0)).unwrap_err());
    assert_read_only(
        &region
            .store(1u8, MemoryRegionAddress(0), Ordering::SeqCst)
            .unwrap_err(),
    );
    // The physical layer is vm-memory's permission-less GuestMemoryBackend (documented): it
    // writes, as GuestMemoryMmap would.
    mem.regions().write_obj(7u8, at).unwrap();
    assert_eq!(mem.read_obj::<u8>(at).unwrap(), 7);
}

#[test]
fn a_view_keeps_removed_slots_mapped() {
    let (table, mem) = plain();
    mem.write_obj(42u64, GuestAddress(256 * KIB)).unwrap();
    let host = mem
        .regions()
        .get_host_address(GuestAddress(256 * KIB))
        .unwrap();
    table.remove(2).unwrap();
    assert!(table.lookup(Gpa(256 * KIB)).is_none());
    // The view still has the slot, and its memory is still mapped.
    assert_eq!(mem.read_obj::<u64>(GuestAddress(256 * KIB)).unwrap(), 42);
    assert_eq!(
        mem.regions()
            .get_host_address(GuestAddress(256 * KIB))
            .unwrap(),
        host
    );
    assert_eq!(SlotMemory::from_table(&table).regions().num_regions(), 2);
}

#[test]
fn slot_space_follows_the_table() {
    let (table, _) = plain();
    let space = SlotSpace::new(table.clone());
    let first = space.memory();
    assert!(
        Arc::ptr_eq(&first, &space.memory()),
        "unchanged table: cached view"
    );
    table.remove(1).unwrap();
    let second = space.memory();
    assert_eq!(second.regions().num_regions(), 2);
    assert_eq!(first.regions().num_regions(), 3, "a view is a snapshot");
    assert!(Arc::ptr_eq(&second, &space.clone().memory()));
    let e = second.read_obj::<u8>(GuestAddress(BOUNDARY)).unwrap_err();
    assert!(is_invalid_address(&e, BOUNDARY));
}

#[test]
fn regions_expose_backing_files() {
    let (_table, mem) = plain();
    let r = mem.regions().find_region(GuestAddress(0)).unwrap();
    let fo = r.file_offset().expect("a memfd slot has a file");
    assert_eq!(fo.start(), 0);
    assert_eq!(fo.file().metadata().unwrap().len(), 64 * KIB);
    let anon = mem.regions().find_region(GuestAddress(BOUNDARY)).unwrap();
    assert!(anon.file_offset().is_none());
}

#[test]
fn views_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<SlotMemory>();
    check::<SlotSpace>();
    let _: fn(Arc<Snapshot>) -> SlotMemory = SlotMemory::from;
}

#[test]
fn example_runs() {
    example::main().unwrap();
}

// ---- the device space's view (IOVA-addressed) ----

/// The layout's slots mapped into a device space at IOVA = GPA, as a device without an IOMMU
/// sees them.
fn identity_space(table: &SlotTable) -> DmaSpace {
    let dma = DmaSpace::new(DmaConfig::default()).unwrap();
    let snap = table.snapshot();
    for (gpa, size) in LAYOUT {
        dma.map_guest(Iova(gpa), &snap, Gpa(gpa), size, Prot::RW)
            .unwrap();
    }
    dma
}

#[test]
fn the_device_view_behaves_as_the_slots_at_iova_equal_gpa() {
    let table = slots([SlotFlags::NONE; 3]);
    let dma = identity_space(&table);
    let view = dma.memory();
    objects(&view);
    slices_across_regions(&view);
    holes(&view);
    assert!(view.physical_memory().is_none(), "addresses are IOVAs");
}

/// Where [`two_mappings`] maps slot 0's first 64 KiB; slot 2's follow at `IO + 64 KiB`.
const IO: u64 = 0x1_0000_0000;

/// Three slots, and a device space with slot 0's first 64 KiB at [`IO`] (`first`) and slot 2's
/// right after it (`second`): two guest pages far apart, adjacent by IOVA.
fn two_mappings(first: Prot, second: Prot) -> (SlotTable, DmaSpace) {
    let table = slots([SlotFlags::NONE; 3]);
    let snap = table.snapshot();
    let dma = DmaSpace::new(DmaConfig::default()).unwrap();
    dma.map_guest(Iova(IO), &snap, Gpa(0), 64 * KIB, first)
        .unwrap();
    dma.map_guest(Iova(IO + 64 * KIB), &snap, Gpa(256 * KIB), 64 * KIB, second)
        .unwrap();
    (table, dma)
}

#[test]
fn the_device_view_translates_checks_and_remembers_misses() {
    // Slot 0's memory read-only at IO, slot 2's read-write right after it.
    let (table, dma) = two_mappings(Prot::READ, Prot::RW);
    table.write(Gpa(0x40), &pattern(64, 5)).unwrap();
    let view = dma.memory();
    let mut back = [0u8; 64];
    view.read_slice(&mut back, GuestAddress(IO + 0x40)).unwrap();
    assert_eq!(
        back[..],
        pattern(64, 5)[..],
        "read at the IOVA, from the guest page"
    );
    // A read crossing from one mapping into the next reads both guest pages.
    view.write_slice(&[7u8; 32], GuestAddress(IO + 64 * KIB))
        .unwrap();
    let mut across = [0u8; 64];
    view.read_slice(&mut across, GuestAddress(IO + 64 * KIB - 32))
        .unwrap();
    assert_eq!(across[32..], [7u8; 32]);
    let mut at_gpa = [0u8; 32];
    table.read(Gpa(256 * KIB), &mut at_gpa).unwrap();
    assert_eq!(at_gpa, [7u8; 32], "the write landed behind the IOVA");
    // Not allowed: a permission error, no miss.
    let e = view.write_obj(1u32, GuestAddress(IO)).unwrap_err();
    assert!(
        matches!(&e, GuestMemoryError::IOError(io) if io.kind() == io::ErrorKind::PermissionDenied),
        "{e:?}"
    );
    assert!(!view.check_range(GuestAddress(IO), 4, Permissions::Write));
    assert_eq!(view.take_miss(), None);
    // Running off the end: the miss is the first unmapped byte, not the access's start.
    let end = IO + 128 * KIB;
    assert!(view.read_obj::<u64>(GuestAddress(end - 4)).is_err());
    let miss = view.take_miss().unwrap();
    assert_eq!((miss.iova, miss.access), (Iova(end), Prot::READ));
    assert_eq!(view.take_miss(), None, "taken once");
    // The view keeps the snapshot it was built from.
    dma.unmap(Iova(IO), 64 * KIB).unwrap();
    view.read_slice(&mut back, GuestAddress(IO + 0x40)).unwrap();
    assert!(
        dma.memory()
            .read_slice(&mut back, GuestAddress(IO + 0x40))
            .is_err()
    );
}

#[test]
fn a_views_read_value_reads_what_read_obj_reads_with_memvisors_errors() {
    let (table, dma) = two_mappings(Prot::READ, Prot::RW);
    table.write(Gpa(0x40), &pattern(16, 3)).unwrap();
    table.write(Gpa(64 * KIB - 8), &pattern(8, 9)).unwrap();
    table.write(Gpa(256 * KIB), &pattern(8, 11)).unwrap();
    let view = dma.memory();
    for at in [IO + 0x40, IO + 0x41, IO + 64 * KIB - 8, IO + 64 * KIB - 3] {
        // `at + 64 KiB - 3` lies across the two mappings: two guest pages far apart.
        let want = view.read_obj::<u128>(GuestAddress(at)).unwrap();
        assert_eq!(view.read_value::<u128>(Iova(at)).unwrap(), want, "{at:#x}");
        let want = view.read_obj::<u16>(GuestAddress(at)).unwrap();
        assert_eq!(view.read_value::<u16>(Iova(at)).unwrap(), want, "{at:#x}");
    }
    assert_eq!(
        view.read_value::<u64>(Iova(IO + 0x40)).unwrap(),
        u64::from_le_bytes(pattern(8, 3).try_into().unwrap())
    );
    // Off the end: EFAULT, and the miss is the first unmapped byte.
    let end = IO + 128 * KIB;
    let e = view.read_value::<u64>(Iova(end - 4)).unwrap_err();
    assert_eq!(e.errno(), libc::EFAULT, "{e}");
    let miss = view.take_miss().unwrap();
    assert_eq!((miss.iova, miss.access), (Iova(end), Prot::READ));
    // A range past the top of the address space: EINVAL naming it, no miss.
    let e = view.read_value::<u64>(Iova(u64::MAX - 3)).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains("0xfffffffffffffffc"), "{e}");
    assert_eq!(view.take_miss(), None);
    // The view keeps its snapshot: what it read stays readable there after an unmap.
    dma.unmap(Iova(IO), 64 * KIB).unwrap();
    assert_eq!(
        view.read_value::<u64>(Iova(IO + 0x40)).unwrap(),
        u64::from_le_bytes(pattern(8, 3).try_into().unwrap())
    );
    assert!(dma.memory().read_value::<u64>(Iova(IO + 0x40)).is_err());
}

#[test]
fn a_views_write_value_writes_what_write_obj_writes_as_a_device_write() {
    let (table, dma) = two_mappings(Prot::RW, Prot::READ);
    dma.start_dirty_tracking().unwrap();
    let view = dma.memory();
    view.write_value(Iova(IO + 0x2003), 0x0102_0304_0506_0708u64)
        .unwrap();
    let mut back = [0u8; 8];
    table.read(Gpa(0x2003), &mut back).unwrap();
    assert_eq!(back, 0x0102_0304_0506_0708u64.to_ne_bytes());
    let words = dma.get_and_clear_dirty(Iova(IO), 64 * KIB, 4096).unwrap();
    assert_eq!(words[0], 1 << 2, "the page written, and only it, is dirty");
    // Into the read-only mapping: EPERM, nothing written there, no miss.
    let e = view
        .write_value(Iova(IO + 64 * KIB + 8), u32::MAX)
        .unwrap_err();
    assert_eq!(e.errno(), libc::EPERM, "{e}");
    let mut ro = [0u8; 4];
    table.read(Gpa(256 * KIB + 8), &mut ro).unwrap();
    assert_eq!(ro, [0; 4]);
    assert_eq!(view.take_miss(), None);
    // Off the end of the space: EFAULT, the miss its first byte, for WRITE.
    let e = view.write_value(Iova(IO + 128 * KIB), 1u16).unwrap_err();
    assert_eq!(e.errno(), libc::EFAULT, "{e}");
    let miss = view.take_miss().unwrap();
    assert_eq!(
        (miss.iova, miss.access),
        (Iova(IO + 128 * KIB), Prot::WRITE)
    );
    // A range past the top: EINVAL.
    let e = view.write_value(Iova(u64::MAX), 1u16).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
}

#[test]
fn writes_through_the_device_view_are_device_writes_for_the_dirty_log() {
    let table = slots([SlotFlags::NONE; 3]);
    let dma = identity_space(&table);
    dma.start_dirty_tracking().unwrap();
    let view = dma.memory();
    view.write_obj(1u16, GuestAddress(0x3000)).unwrap();
    view.read_obj::<u64>(GuestAddress(0x5000)).unwrap();
    let words = dma.get_and_clear_dirty(Iova(0), 64 * KIB, 4096).unwrap();
    assert_eq!(words[0], 1 << 3, "the page written, not the page read");
}

/// A view answers a repeated access from the thread's last hit, and only a hit taken in the
/// snapshot it holds may answer: not one from an older view of a mapping since replaced, nor
/// one a newer view took, nor a read's hit for a write the dirty log must see.
#[test]
fn a_views_repeated_accesses_answer_only_from_its_own_generation() {
    const IO: u64 = 0x2_0000_0000;
    let table = slots([SlotFlags::NONE; 3]);
    let snap = table.snapshot();
    table.write(Gpa(0x100), &[1u8; 8]).unwrap();
    table.write(Gpa(256 * KIB + 0x100), &[2u8; 8]).unwrap();
    let dma = DmaSpace::new(DmaConfig::default()).unwrap();
    dma.map_guest(Iova(IO), &snap, Gpa(0), 64 * KIB, Prot::RW)
        .unwrap();
    let old = dma.memory();
    let at = GuestAddress(IO + 0x100);
    // Twice: the second is answered from the hit the first left.
    assert_eq!(old.read_obj::<u64>(at).unwrap(), 0x0101_0101_0101_0101);
    assert_eq!(old.read_obj::<u64>(at).unwrap(), 0x0101_0101_0101_0101);
    // The same IOVA now names slot 2's memory.
    dma.unmap(Iova(IO), 64 * KIB).unwrap();
    dma.map_guest(Iova(IO), &snap, Gpa(256 * KIB), 64 * KIB, Prot::RW)
        .unwrap();
    let new = dma.memory();
    assert_eq!(
        new.read_obj::<u64>(at).unwrap(),
        0x0202_0202_0202_0202,
        "a new view is not answered by the old view's hit"
    );
    assert_eq!(
        old.read_obj::<u64>(at).unwrap(),
        0x0101_0101_0101_0101,
        "the old view keeps its snapshot, whatever hit the new one left"
    );
    let mut plain = [0u8; 8];
    dma.dma_read(Iova(IO + 0x100), &mut plain).unwrap();
    assert_eq!(
        plain, [2u8; 8],
        "a plain read after the old view's hit sees the space as it is"
    );
    // With the dirty log on, a read's hit does not answer a write: the write marks its page.
    dma.start_dirty_tracking().unwrap();
    let tracked = dma.memory();
    tracked.read_obj::<u64>(GuestAddress(IO + 0x3000)).unwrap();
    tracked.write_obj(9u8, GuestAddress(IO + 0x3008)).unwrap();
    let words = dma.get_and_clear_dirty(Iova(IO), 64 * KIB, 4096).unwrap();
    assert_eq!(words[0], 1 << 3, "the page written after a read in it");
}
