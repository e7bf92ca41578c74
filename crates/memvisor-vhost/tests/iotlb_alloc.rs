//! An IOTLB update and its invalidation allocate nothing once warm: the writer reuses its
//! spare snapshot, its removed mapping records and its vectors (memvisor's `dma::iotlb`,
//! `dma::publish`), and the frontend's list of updates is a ring of fixed size.
//!
//! A counting global allocator counts this thread's allocations only, so the test harness's
//! other threads do not disturb the count; the test is alone in its binary for that reason.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use memvisor::{Backing, BackingKind, PinRegistry, Prot, SharedMappings};
use memvisor_vhost::proto::Region;
use memvisor_vhost::{FrontendMemory, ProcessState};

struct Counting;

thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call goes to the system allocator unchanged; counting touches a const
// thread-local `Cell` with no destructor, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as the caller promised for `layout`.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
        // SAFETY: as the caller promised for `ptr`, `layout` and `new_size`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocations() -> u64 {
    COUNT.with(Cell::get)
}

const UADDR: u64 = 0x7f00_0000_0000;
const PAGE: u64 = 4096;
const MEM: u64 = 64 << 20;

/// A strict guest's traffic: one page updated at an IOVA handed out top-down, translated,
/// then invalidated; adds each step's allocations to `counts` (update, translate, invalidate).
fn cycle(mem: &mut FrontendMemory, k: u64, counts: &mut [u64; 3]) {
    let iova = (1 << 32) - (1 + k % 512) * PAGE;
    let uaddr = UADDR + (k * 7919 % (MEM / PAGE)) * PAGE;
    let prot = if k % 2 == 0 { Prot::READ } else { Prot::RW };
    let a0 = allocations();
    mem.iotlb_update(iova, PAGE, uaddr, prot).unwrap();
    let a1 = allocations();
    let t = mem
        .dma()
        .translate(memvisor::Iova(iova), 8, Prot::READ)
        .unwrap();
    let a2 = allocations();
    assert_eq!(t.hva.0 % PAGE, 0);
    assert_eq!(mem.iotlb_invalidate(iova, PAGE).unwrap(), PAGE);
    let a3 = allocations();
    counts[0] += a1 - a0;
    counts[1] += a2 - a1;
    counts[2] += a3 - a2;
}

#[test]
fn an_iotlb_update_and_invalidate_allocate_nothing_once_warm() {
    let state = ProcessState::new(SharedMappings::global(), PinRegistry::global());
    let mut mem = FrontendMemory::new(&state).unwrap();
    let backing = Backing::new(BackingKind::Memfd, MEM).unwrap();
    let fd = backing.fd().unwrap().try_clone_to_owned().unwrap();
    let region = Region {
        gpa: 0,
        size: MEM,
        user_addr: UADDR,
        mmap_offset: 0,
    };
    mem.set_table(&[region], vec![fd]).unwrap();
    mem.set_iotlb(true).unwrap();
    // The rings, mapped once for good as a driver maps them: the index never empties (an
    // emptied index lets go of its chunk list, and its first insert allocates it again).
    mem.iotlb_update(1 << 40, 4 * PAGE, UADDR, Prot::RW)
        .unwrap();
    let mut warm = [0; 3];
    for k in 0..1_000 {
        cycle(&mut mem, k, &mut warm);
    }
    let mut counts = [0; 3];
    for k in 1_000..11_000 {
        cycle(&mut mem, k, &mut counts);
    }
    assert_eq!(
        counts, [0; 3],
        "allocations in 10,000 cycles: [update, translate, invalidate]"
    );
}
