//! Adopted memory (`Backing::adopt`): a mapping the test makes itself, with raw `mmap`, goes
//! through everything above a backing — slots, a DMA space (map, translate, copies, pins), the
//! dirty log, a discard — and is never unmapped by memvisor; its keeper lives exactly as long
//! as the backing's last user. Every check `adopt` makes refuses its bad value with EINVAL and
//! a message naming it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memvisor::dma::{LockLimit, PinRegistry};
use memvisor::{
    AdoptedMemory, Backing, BackingKind, DiscardOptions, Discarder, DmaConfig, DmaSpace, Gpa, Iova,
    PageSize, Prot, RejectReason, SlotFlags, SlotSpec, SlotTable,
};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

/// A mapping made by "the VMM": unmapped when dropped, and says so.
struct Mapping {
    ptr: *mut u8,
    len: usize,
    dropped: Arc<AtomicBool>,
}

// SAFETY: the test's mapping is plain memory, usable from any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: u64, flags: libc::c_int, fd: libc::c_int) -> Mapping {
        // SAFETY: a fresh mapping at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        Mapping {
            ptr: p.cast(),
            len: len as usize,
            dropped: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.dropped.store(true, Ordering::SeqCst);
        // SAFETY: our own mapping, dropped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn memfd(size: u64) -> OwnedFd {
    // SAFETY: a NUL-terminated name; the new descriptor is ours.
    let fd = unsafe { libc::memfd_create(c"adopt-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: memfd_create returned a descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own descriptor.
    let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), size as libc::off_t) };
    assert_eq!(rc, 0);
    fd
}

fn allocated(fd: &OwnedFd) -> u64 {
    // SAFETY: fstat writes one struct we own.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(fd.as_raw_fd(), &mut st), 0);
        st.st_blocks as u64 * 512
    }
}

#[test]
fn adopted_private_memory_serves_slots_dma_pins_dirty_log_and_discard() {
    let size = 4 * MIB;
    let m = Mapping::new(size, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
    let (ptr, dropped) = (m.ptr, m.dropped.clone());
    // SAFETY: `m` owns the mapping and is the keeper: it is dropped after the backing's last
    // user; it is private anonymous memory of 4 KiB pages, reached here only by copies.
    let backing =
        Arc::new(unsafe { Backing::adopt(AdoptedMemory::new(ptr, size).keep(m)).unwrap() });
    assert!(backing.is_adopted());
    assert_eq!(backing.as_ptr(), ptr, "adopted, not mapped again");
    assert_eq!(
        backing.kind(),
        &BackingKind::Adopted {
            page_size: PageSize::Size4K,
            shared: false
        }
    );

    // Slots: the guest's writes land in the caller's mapping.
    let slots = SlotTable::new();
    slots
        .insert(SlotSpec::new(0, Gpa(1 << 30), backing.clone()).flags(SlotFlags::LOG_DIRTY))
        .unwrap();
    slots.write(Gpa((1 << 30) + 0x1000), b"guest").unwrap();
    let mut five = [0u8; 5];
    // SAFETY: inside the live mapping; a raw copy, no reference.
    unsafe { std::ptr::copy_nonoverlapping(ptr.add(0x1000), five.as_mut_ptr(), 5) };
    assert_eq!(&five, b"guest");
    assert_eq!(slots.take_dirty_log(0).unwrap()[0], 0b10, "page 1 dirty");

    // DMA: map, translate to the caller's address, copy both ways, pin.
    let registry = PinRegistry::new(LockLimit::Bytes(MIB));
    let dma = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    dma.map_guest(
        Iova(1 << 40),
        &slots.snapshot(),
        Gpa(1 << 30),
        size,
        Prot::RW,
    )
    .unwrap();
    let t = dma
        .translate(Iova((1 << 40) + 0x1000), 5, Prot::READ)
        .unwrap();
    assert_eq!(t.hva.0, ptr as u64 + 0x1000);
    dma.dma_write(Iova((1 << 40) + 0x2000), b"device").unwrap();
    let mut six = [0u8; 6];
    slots.read(Gpa((1 << 30) + 0x2000), &mut six).unwrap();
    assert_eq!(&six, b"device");
    let first_page = (1u64 << 40) / PAGE;
    let hvas = dma.pin_pages(&[first_page + 3], Prot::WRITE).unwrap();
    assert_eq!(hvas[0].0, ptr as u64 + 3 * PAGE);
    assert_eq!(registry.locked_bytes(), PAGE);

    // Discard: pages 1..4 reported; 3 is pinned and kept, 1 and 2 read back as zeros.
    slots.write(Gpa((1 << 30) + 3 * PAGE), b"pinned").unwrap();
    let discarder = Discarder::with_options(
        &slots,
        DiscardOptions {
            registry: Some(registry.clone()),
            ..DiscardOptions::default()
        },
    );
    let out = discarder.report(&[(Gpa((1 << 30) + PAGE), 3 * PAGE)]);
    assert_eq!(
        (out.discarded, out.skipped_pinned),
        (2 * PAGE, PAGE),
        "{out:?}"
    );
    slots.read(Gpa((1 << 30) + 0x1000), &mut five).unwrap();
    slots.read(Gpa((1 << 30) + 0x2000), &mut six).unwrap();
    assert_eq!((five, six), ([0; 5], [0; 6]));
    slots.read(Gpa((1 << 30) + 3 * PAGE), &mut six).unwrap();
    assert_eq!(&six, b"pinned");
    dma.unpin_pages(&[first_page + 3]).unwrap();

    // The keeper lives while any user does: the DMA mapping outlives the table and backing.
    drop((slots, backing, discarder));
    assert!(
        !dropped.load(Ordering::SeqCst),
        "dropped while mapped for DMA"
    );
    dma.dma_write(Iova(1 << 40), b"late").unwrap();
    assert_eq!(dma.unmap(Iova(1 << 40), size).unwrap(), size);
    drop(dma);
    assert!(
        dropped.load(Ordering::SeqCst),
        "keeper dropped with the last user"
    );
}

#[test]
fn memvisor_never_unmaps_adopted_memory() {
    let m = Mapping::new(2 * PAGE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
    // SAFETY: `m` outlives the backing (dropped at the end of the test); private anonymous.
    let b = unsafe { Backing::adopt(AdoptedMemory::new(m.ptr, 2 * PAGE)).unwrap() };
    b.write(PAGE, b"still here").unwrap();
    drop(b);
    let mut buf = [0u8; 10];
    // SAFETY: the caller's mapping is still live (memvisor does not unmap it): reading it
    // would be SIGSEGV otherwise, which is what this test would then die of.
    unsafe { std::ptr::copy_nonoverlapping(m.ptr.add(PAGE as usize), buf.as_mut_ptr(), 10) };
    assert_eq!(&buf, b"still here");
}

#[test]
fn adopted_shared_file_keeps_its_descriptor_and_discards_punch_holes() {
    let fd = memfd(8 * PAGE);
    // The caller maps pages 2..6 of its file.
    // SAFETY: a fresh mapping at an address the kernel picks, of our own memfd.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            (4 * PAGE) as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            (2 * PAGE) as libc::off_t,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let m = Mapping {
        ptr: p.cast(),
        len: (4 * PAGE) as usize,
        dropped: Arc::new(AtomicBool::new(false)),
    };
    let ptr = m.ptr;
    let dup = fd.try_clone().unwrap();
    // SAFETY: `m` is the keeper; the mapping is MAP_SHARED of `fd` from 2 pages, 4 KiB pages.
    let b = Arc::new(unsafe {
        Backing::adopt(
            AdoptedMemory::new(ptr, 4 * PAGE)
                .shared(true)
                .file(dup, 2 * PAGE)
                .keep(m),
        )
        .unwrap()
    });
    assert!(b.is_shared() && b.fd().is_some());
    assert_eq!(b.file_offset(), 2 * PAGE);
    let slots = SlotTable::new();
    slots.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    for i in 0..4 {
        slots.write(Gpa(i * PAGE), &[0xab; PAGE as usize]).unwrap();
    }
    assert_eq!(allocated(&fd), 4 * PAGE);
    let out = Discarder::new(&slots).report(&[(Gpa(PAGE), 2 * PAGE)]);
    assert_eq!(out.discarded, 2 * PAGE, "{out:?}");
    // The holes are in the file at the mapping's offset: pages 3 and 4 of the file.
    assert_eq!(allocated(&fd), 2 * PAGE);
    let mut byte = [0u8; 1];
    // SAFETY: pread into a buffer we own.
    let n = unsafe {
        libc::pread(
            fd.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            (3 * PAGE) as i64,
        )
    };
    assert_eq!((n, byte[0]), (1, 0));
    // SAFETY: as above.
    let n = unsafe {
        libc::pread(
            fd.as_raw_fd(),
            byte.as_mut_ptr().cast(),
            1,
            (2 * PAGE) as i64,
        )
    };
    assert_eq!((n, byte[0]), (1, 0xab));
}

#[test]
fn adopted_private_file_mapping_refuses_discard() {
    let fd = memfd(2 * PAGE);
    let m = Mapping::new(2 * PAGE, libc::MAP_PRIVATE, fd.as_raw_fd());
    let dup = fd.try_clone().unwrap();
    // SAFETY: `m` is the keeper; a private mapping of `fd` from 0.
    let b = unsafe {
        Backing::adopt(AdoptedMemory::new(m.ptr, 2 * PAGE).file(dup, 0).keep(m)).unwrap()
    };
    let slots = SlotTable::new();
    slots.insert(SlotSpec::new(4, Gpa(0), Arc::new(b))).unwrap();
    let out = Discarder::new(&slots).report(&[(Gpa(0), PAGE)]);
    assert_eq!(out.discarded, 0);
    assert_eq!(
        out.rejected[0].reason,
        RejectReason::PrivateFileMapping { slot: 4 }
    );
}

/// `adopt`'s error for `memory`, which must be EINVAL naming `names`.
fn refused(memory: AdoptedMemory, names: &str) {
    // SAFETY: every case here is refused before the memory is used.
    let e = unsafe { Backing::adopt(memory) }.unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert!(e.to_string().contains(names), "{e:?} should name {names}");
}

#[test]
fn adopt_refuses_bad_descriptions() {
    let m = Mapping::new(4 * PAGE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1);
    let addr = m.ptr as u64;
    refused(AdoptedMemory::new(std::ptr::null_mut(), PAGE), "null");
    let odd = m.ptr.wrapping_add(0x10);
    refused(
        AdoptedMemory::new(odd, PAGE),
        &format!("{:#x}", addr + 0x10),
    );
    refused(AdoptedMemory::new(m.ptr, 0), "size is 0");
    refused(AdoptedMemory::new(m.ptr, 0x1800), "0x1800");
    refused(
        AdoptedMemory::new(m.ptr, u64::MAX - 0xfff),
        &format!("{addr:#x}"),
    );
    // A range past the end of the caller's mapping (the page after it is unmapped first).
    // SAFETY: unmapping the last page of our own mapping, which nothing uses.
    unsafe { libc::munmap(m.ptr.add(3 * PAGE as usize).cast(), PAGE as usize) };
    refused(
        AdoptedMemory::new(m.ptr, 4 * PAGE),
        &format!("{addr:#x}+{:#x} is not wholly mapped", 4 * PAGE),
    );
    // A described huge page size the address is not aligned to.
    refused(
        AdoptedMemory::new((addr | PAGE) as *mut u8, 2 * MIB).page_size(PageSize::Size2M),
        &format!("{:#x}", addr | PAGE),
    );

    // Descriptors: shorter than offset + size, offset not page aligned, not a regular file,
    // on a file system of other pages than described.
    let fd = memfd(2 * PAGE);
    let shared = Mapping::new(2 * PAGE, libc::MAP_SHARED, fd.as_raw_fd());
    let with = |fd: OwnedFd, off| {
        AdoptedMemory::new(shared.ptr, 2 * PAGE)
            .shared(true)
            .file(fd, off)
    };
    refused(
        with(fd.try_clone().unwrap(), PAGE),
        "0x1000+0x2000 does not fit in 0x2000",
    );
    refused(with(fd.try_clone().unwrap(), 0x100), "0x100");
    let mut pipe = [0; 2];
    // SAFETY: pipe writes two descriptors we then own.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // SAFETY: both descriptors are new and ours.
    let (r, _w) = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    refused(with(r, 0), "not a regular file");
    let big = Backing::new(BackingKind::Memfd, 2 * MIB).unwrap();
    refused(
        AdoptedMemory::new(big.as_ptr(), 2 * MIB)
            .shared(true)
            .page_size(PageSize::Size2M)
            .file(big.fd().unwrap().try_clone_to_owned().unwrap(), 0),
        "file system of 4 KiB pages",
    );
    drop(m);
}

#[test]
fn adopted_hugetlbfs_memory_discards_whole_huge_pages() {
    let _pool = match memvisor::HugePageReservation::add(PageSize::Size2M, 2) {
        Ok(r) => r,
        Err(e) => {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("skipped: adopted_hugetlbfs_memory_discards_whole_huge_pages: {e}\n")
                    .as_bytes(),
            );
            return;
        }
    };
    // "The VMM's" hugetlbfs memfd mapping: a memvisor backing, kept alive as the keeper.
    let own = Arc::new(Backing::new(BackingKind::Hugetlb(PageSize::Size2M), 4 * MIB).unwrap());
    let fd = own.fd().unwrap().try_clone_to_owned().unwrap();
    let ptr = own.as_ptr();
    // SAFETY: `own` is the keeper; a MAP_SHARED mapping of `fd` from 0, 2 MiB pages.
    let b = Arc::new(unsafe {
        Backing::adopt(
            AdoptedMemory::new(ptr, 4 * MIB)
                .shared(true)
                .page_size(PageSize::Size2M)
                .file(fd, 0)
                .keep(own),
        )
        .unwrap()
    });
    assert_eq!(b.huge_page_size(), Some(PageSize::Size2M));
    let slots = SlotTable::new();
    slots.insert(SlotSpec::new(0, Gpa(0), b.clone())).unwrap();
    // The vm-memory view tells a device model (vhost-user's memory table, say) it is hugetlbfs.
    #[cfg(feature = "vm-memory")]
    {
        use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
        let memory = memvisor::vm_memory::SlotMemory::from_table(&slots);
        let region = memory.regions().find_region(GuestAddress(0)).unwrap();
        assert_eq!(region.is_hugetlbfs(), Some(true));
    }
    slots.write(Gpa(0), &[1; 8]).unwrap();
    slots.write(Gpa(2 * MIB), &[2; 8]).unwrap();
    let blocks = || allocated(&b.fd().unwrap().try_clone_to_owned().unwrap());
    assert_eq!(blocks(), 4 * MIB);
    // Half a huge page is not discarded; a whole one is.
    let out = Discarder::new(&slots).report(&[(Gpa(0), MIB), (Gpa(2 * MIB), 2 * MIB)]);
    assert_eq!(out.discarded, 2 * MIB, "{out:?}");
    assert_eq!(blocks(), 2 * MIB);
    let mut buf = [0u8; 8];
    slots.read(Gpa(0), &mut buf).unwrap();
    assert_eq!(buf, [1; 8]);
    slots.read(Gpa(2 * MIB), &mut buf).unwrap();
    assert_eq!(buf, [0; 8]);
    // The file system's page size must match the description.
    // SAFETY: refused before the memory is used.
    let e = unsafe {
        Backing::adopt(
            AdoptedMemory::new(ptr, 4 * MIB)
                .shared(true)
                .file(b.fd().unwrap().try_clone_to_owned().unwrap(), 0),
        )
    }
    .unwrap_err();
    assert!(e.to_string().contains("file system of 2 MiB pages"), "{e}");
}
