//! A VMM's vm-memory guest RAM adopted as memvisor slots (feature `vm-memory-mmap`): the same
//! memory (no copy, no second mapping), kept alive by memvisor after the VMM drops its
//! `GuestMemoryMmap`, with a file region's descriptor and offset carried over, and a region
//! that is not read-write refused.
#![cfg(feature = "vm-memory-mmap")]

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;

use memvisor::{Backing, BackingKind, Discarder, Gpa, PageSize, SlotSpec, SlotTable};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

fn memfd(size: u64) -> File {
    // SAFETY: a NUL-terminated name; the new descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"vm-memory-mmap".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: memfd_create returned a descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

#[test]
fn guest_memory_mmap_becomes_a_slot_table_over_the_same_memory() {
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), 2 * MIB as usize),
        (GuestAddress(4 * MIB), MIB as usize),
    ])
    .unwrap();
    let table = SlotTable::from_guest_memory(&mem).unwrap();
    let snap = table.snapshot();
    for (i, region) in mem.iter().enumerate() {
        let slot = snap.slot(i as u32).unwrap();
        assert_eq!(slot.range().start().0, region.start_addr().0);
        assert_eq!(slot.backing().size(), region.len());
        assert_eq!(
            slot.backing().as_ptr(),
            region.as_ptr(),
            "no second mapping"
        );
        assert!(slot.backing().is_adopted());
        assert_eq!(
            slot.backing().kind(),
            &BackingKind::Adopted {
                page_size: PageSize::Size4K,
                shared: false
            }
        );
    }
    // Writes through either side are seen by the other.
    mem.write_slice(b"from vm-memory", GuestAddress(4 * MIB + 8))
        .unwrap();
    let mut buf = [0u8; 14];
    table.read(Gpa(4 * MIB + 8), &mut buf).unwrap();
    assert_eq!(&buf, b"from vm-memory");
    table.write(Gpa(2 * MIB - 3), b"memvisor").unwrap_err(); // the hole at 2 MiB: EFAULT
    table.write(Gpa(16), b"memvisor").unwrap();
    let mut eight = [0u8; 8];
    mem.read_slice(&mut eight, GuestAddress(16)).unwrap();
    assert_eq!(&eight, b"memvisor");

    // The VMM drops its memory: the table keeps every region's mapping alive.
    let mmap = mem.find_region(GuestAddress(0)).unwrap().get_mmap();
    let before = Arc::strong_count(&mmap);
    drop(mem);
    assert_eq!(
        Arc::strong_count(&mmap),
        before - 1,
        "only the VMM's reference went"
    );
    drop(snap);
    table.read(Gpa(16), &mut eight).unwrap();
    assert_eq!(&eight, b"memvisor");
    drop(table);
    assert_eq!(
        Arc::strong_count(&mmap),
        1,
        "the table's keeper went with it"
    );
}

#[test]
fn a_file_region_carries_its_descriptor_and_offset() {
    let file = memfd(8 * PAGE);
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges_with_files([(
        GuestAddress(MIB),
        (4 * PAGE) as usize,
        Some(FileOffset::new(file.try_clone().unwrap(), 2 * PAGE)),
    )])
    .unwrap();
    let region = mem.find_region(GuestAddress(MIB)).unwrap();
    let b = Backing::from_guest_region(region).unwrap();
    assert_eq!(b.file_offset(), 2 * PAGE);
    let fd = b.fd().expect("the region's file, duplicated");
    assert_ne!(
        fd.as_raw_fd(),
        file.as_raw_fd(),
        "a duplicate, owned by the backing"
    );
    // vm-memory maps files MAP_SHARED unless told otherwise: the slot is shared, so a discard
    // punches a hole in the file at the region's offset.
    assert!(b.is_shared());
    let table = SlotTable::new();
    table
        .insert(SlotSpec::from_guest_region(7, region).unwrap())
        .unwrap();
    table.write(Gpa(MIB), &[0x5a; PAGE as usize]).unwrap();
    let mut byte = [0u8; 1];
    // SAFETY: pread into a buffer we own.
    let n = unsafe {
        libc::pread(
            file.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            (2 * PAGE) as i64,
        )
    };
    assert_eq!(
        (n, byte[0]),
        (1, 0x5a),
        "the region's page 0 is the file's page 2"
    );
    let out = Discarder::new(&table).report(&[(Gpa(MIB), PAGE)]);
    assert_eq!(out.discarded, PAGE, "{out:?}");
    // SAFETY: as above.
    let n = unsafe {
        libc::pread(
            file.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            (2 * PAGE) as i64,
        )
    };
    assert_eq!((n, byte[0]), (1, 0));
}

#[test]
fn a_region_not_mapped_read_write_is_refused() {
    let ro = MmapRegionBuilder::<()>::new((2 * PAGE) as usize)
        .with_mmap_prot(libc::PROT_READ)
        .build()
        .unwrap();
    let region = GuestRegionMmap::new(ro, GuestAddress(0x10_0000)).unwrap();
    let e = Backing::from_guest_region(&region).unwrap_err();
    assert_eq!(e.errno(), libc::EOPNOTSUPP);
    assert!(e.to_string().contains("0x100000"), "{e}");
    let mem = GuestMemoryMmap::from_regions(vec![region]).unwrap();
    assert_eq!(
        SlotTable::from_guest_memory(&mem).unwrap_err().errno(),
        libc::EOPNOTSUPP
    );
}
