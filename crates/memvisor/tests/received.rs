//! Memory received from another process as a file descriptor (`Backing::from_fd`,
//! `SharedMappings`): the checks a hostile sender meets, the file offset, and one mapping per
//! range of a file in the process.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use memvisor::{
    Backing, BackingKind, Discarder, Gpa, PageSize, SharedMappings, SlotSpec, SlotTable,
};

const MIB: u64 = 1 << 20;

fn memfd(size: u64) -> File {
    // SAFETY: a valid C string and plain flags; the new descriptor is owned by the File.
    let fd = unsafe { libc::memfd_create(c"received-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: memfd_create returned a fresh descriptor nothing else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

fn owned(f: &File) -> OwnedFd {
    OwnedFd::from(f.try_clone().unwrap())
}

#[test]
fn a_received_range_maps_the_file_from_its_offset() {
    let f = memfd(4 * MIB);
    f.write_all_at(b"at one MiB", MIB).unwrap();
    let b = Backing::from_fd(owned(&f), MIB, 2 * MIB).unwrap();
    assert_eq!(
        b.kind(),
        &BackingKind::Received {
            page_size: PageSize::Size4K
        }
    );
    assert_eq!(
        (b.size(), b.file_offset(), b.page_size()),
        (2 * MIB, MIB, PageSize::Size4K)
    );
    assert!(b.is_shared());
    let mut got = [0u8; 10];
    b.read(0, &mut got).unwrap();
    assert_eq!(&got, b"at one MiB");
    // Writes through the mapping reach the file: the sender sees them.
    b.write(4096, b"from memvisor").unwrap();
    let mut back = [0u8; 13];
    f.read_exact_at(&mut back, MIB + 4096).unwrap();
    assert_eq!(&back, b"from memvisor");
}

#[test]
fn hostile_descriptors_and_ranges_are_refused_with_einval() {
    let f = memfd(4 * MIB);
    // Past the end of the file: mapping it would SIGBUS on the first touch.
    let e = Backing::from_fd(owned(&f), 3 * MIB, 2 * MIB).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains("past the end of the file"), "{e}");
    // Wrapping offset + size.
    let e = Backing::from_fd(owned(&f), u64::MAX - 4095, 8192).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    // Not page aligned.
    let e = Backing::from_fd(owned(&f), 100, MIB).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = Backing::from_fd(owned(&f), 0, MIB + 1).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = Backing::from_fd(owned(&f), 0, 0).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    // Not a regular file: a pipe.
    let mut fds = [0; 2];
    // SAFETY: pipe writes two new descriptors into the array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors are fresh and owned here.
    let (r, _w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let e = Backing::from_fd(r, 0, 4096).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains("not a regular file"), "{e}");
    // Read-only descriptor: mmap says EACCES.
    let path = format!("/proc/self/fd/{}", f.as_raw_fd());
    let ro = File::open(path).unwrap();
    let e = Backing::from_fd(OwnedFd::from(ro), 0, MIB).unwrap_err();
    assert_eq!(e.errno(), libc::EACCES, "{e}");
}

#[test]
fn a_file_whose_last_page_is_partial_maps_that_page() {
    // A frontend may hand over a file of any byte size (libblkio: 0x3b10 bytes). Its last page
    // maps (the kernel faults it in; bytes past the end read as zeros); a page wholly past the
    // end is refused, as touching it would be SIGBUS.
    let f = memfd(0x3b10);
    f.write_all_at(&[0x77; 0x10], 0x3b00).unwrap();
    let b = Backing::from_fd(owned(&f), 0, 0x4000).unwrap();
    let mut tail = [0xffu8; 0x20];
    b.read(0x3b00, &mut tail).unwrap();
    assert_eq!(tail[..0x10], [0x77; 0x10], "the file's last bytes");
    assert_eq!(tail[0x10..], [0; 0x10], "past the end of the file: zeros");
    let e = Backing::from_fd(owned(&f), 0, 0x5000).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains("wholly past the end"), "{e}");
    // Mapping within a file maps the whole of its last page too.
    let (whole, off) = SharedMappings::default()
        .map_within(owned(&f), 0x3000, 0x1000)
        .unwrap();
    assert_eq!((whole.size(), off), (0x4000, 0x3000));
}

#[test]
fn one_range_of_one_file_is_mapped_once_per_process() {
    let table = SharedMappings::default();
    let f = memfd(8 * MIB);
    // Two descriptors of the same file, as two devices receive them.
    let a = table.map(owned(&f), 0, 4 * MIB).unwrap();
    let b = table.map(owned(&f), 0, 4 * MIB).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    // Another range of it, or another file, is another mapping.
    let c = table.map(owned(&f), 4 * MIB, 4 * MIB).unwrap();
    assert!(!Arc::ptr_eq(&a, &c));
    let g = memfd(8 * MIB);
    let d = table.map(owned(&g), 0, 4 * MIB).unwrap();
    assert!(!Arc::ptr_eq(&a, &d));
    assert_eq!(table.len(), 3);
    // When the last user drops it, the next receiver maps it afresh.
    drop((a, b));
    assert_eq!(table.len(), 2);
    let again = table.map(owned(&f), 0, 4 * MIB).unwrap();
    again.write(0, b"x").unwrap();
    // Refusals go through the same checks.
    assert_eq!(
        table.map(owned(&f), 6 * MIB, 4 * MIB).unwrap_err().errno(),
        libc::EINVAL
    );
}

#[test]
fn discarding_received_memory_punches_the_file_at_the_mapped_offset() {
    let f = memfd(8 * MIB);
    let ones = vec![1u8; (8 * MIB) as usize];
    f.write_all_at(&ones, 0).unwrap();
    // Guest memory = file bytes [2 MiB, 6 MiB), at GPA 0.
    let backing = Arc::new(Backing::from_fd(owned(&f), 2 * MIB, 4 * MIB).unwrap());
    let slots = SlotTable::new();
    slots.insert(SlotSpec::new(0, Gpa(0), backing)).unwrap();
    let out = Discarder::new(&slots).report(&[(Gpa(MIB), MIB)]);
    assert_eq!(out.discarded, MIB, "{out:?}");
    // File bytes [3 MiB, 4 MiB) are zeros; everything else is untouched.
    let mut file = vec![0u8; (8 * MIB) as usize];
    f.read_exact_at(&mut file, 0).unwrap();
    let zero = |a: u64, b: u64| file[a as usize..b as usize].iter().all(|&x| x == 0);
    let one = |a: u64, b: u64| file[a as usize..b as usize].iter().all(|&x| x == 1);
    assert!(one(0, 3 * MIB), "bytes before the discarded range changed");
    assert!(
        zero(3 * MIB, 4 * MIB),
        "the discarded range is not zero in the file"
    );
    assert!(
        one(4 * MIB, 8 * MIB),
        "bytes after the discarded range changed"
    );
    let mut through = [9u8; 4];
    slots.read(Gpa(MIB), &mut through).unwrap();
    assert_eq!(through, [0; 4]);
}
