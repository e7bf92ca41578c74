//! A queue's walk with its own scratch (`SgScratch`): the same segments as the plain walk and
//! `translate_sg`, the holds counted and let go, and no allocation per request once the
//! scratch has grown, counted by a global allocator that counts this thread's allocations.
//!
//! This file holds the allocator, so its tests run here alone.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use memvisor::dma::{SgBuf, SgGuard, SgScratch, SgWalk};
use memvisor::{Backing, BackingKind, DmaConfig, DmaCursor, DmaSpace, Iova, Prot};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

/// A buffer of `len` bytes at `iova` that the device accesses as `prot`.
fn buf(iova: u64, len: u64, prot: Prot) -> SgBuf {
    SgBuf {
        iova: Iova(iova),
        len,
        prot,
    }
}

/// The system allocator, counting the allocations of threads that turned counting on.
struct Counting;

thread_local! {
    /// This thread's allocations while counting, or `None` while not counting.
    static COUNT: Cell<Option<u64>> = const { Cell::new(None) };
}

// SAFETY: every call goes straight to the system allocator with the caller's arguments; the
// count is a thread-local `Cell` with a const initializer, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is `System.alloc`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is `System.dealloc`'s.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is `System.realloc`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

fn count() {
    // `try_with`: the slot may be gone while the thread is torn down.
    let _ = COUNT.try_with(|c| c.set(c.get().map(|n| n + 1)));
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Allocations `f` made on this thread.
fn allocations(f: impl FnOnce()) -> u64 {
    COUNT.with(|c| c.set(Some(0)));
    f();
    COUNT.with(|c| c.replace(None)).expect("counting")
}

/// A space with 64 small mappings (one page each, every other page a hole, from 1 GiB) and
/// one big one (8 MiB at 16 MiB): what a vIOMMU maps, and guest RAM.
fn space() -> (DmaSpace, Arc<Backing>) {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * MIB).unwrap());
    let d = DmaSpace::new(DmaConfig::default()).unwrap();
    for i in 0..64 {
        d.map_backing(Iova((1 << 30) + 2 * i * PAGE), &b, i * PAGE, PAGE, Prot::RW)
            .unwrap();
    }
    d.map_backing(Iova(16 * MIB), &b, 8 * MIB, 8 * MIB, Prot::RW)
        .unwrap();
    (d, b)
}

/// Request `i`'s buffers: a header, a data buffer (sometimes two) and a status byte, as a
/// block request's, in the big mapping and in the small ones.
fn request(i: u64, out: &mut Vec<SgBuf>) {
    out.clear();
    let small = |k: u64| (1 << 30) + 2 * (k % 64) * PAGE;
    let big = 16 * MIB + (i * 7919 % 2040) * PAGE;
    out.push(buf(small(i), 16, Prot::READ));
    out.push(buf(big, 4 * PAGE, Prot::WRITE));
    if i % 3 == 0 {
        out.push(buf(small(i + 1), PAGE, Prot::WRITE));
    }
    out.push(buf(small(i + 2) + PAGE - 1, 1, Prot::WRITE));
}

fn held(walk: memvisor::Result<SgWalk>) -> SgGuard {
    match walk.unwrap() {
        SgWalk::Held(g) => g,
        SgWalk::Missed(m) => panic!("unexpected misses {m:?}"),
    }
}

#[test]
fn the_scratch_walk_gives_the_plain_walks_segments_and_counts_back_to_zero() {
    let (d, _b) = space();
    let mut cursor = d.cursor();
    let mut scratch = SgScratch::for_queue(0);
    let mut bufs = Vec::new();
    for i in 0..200 {
        request(i, &mut bufs);
        let plain = held(d.hold_sg(&bufs));
        let mine = held(cursor.hold_sg_into(&bufs, &mut scratch));
        cursor.translate_sg_into(&bufs, &mut scratch).unwrap();
        for (k, b) in bufs.iter().enumerate() {
            let want = d.translate_sg(b.iova, b.len, b.prot).unwrap();
            assert_eq!(plain.buffer(k), want, "request {i}, buffer {k}: hold_sg");
            assert_eq!(
                mine.buffer(k),
                want,
                "request {i}, buffer {k}: hold_sg_into"
            );
            assert_eq!(
                scratch.buffer(k),
                want,
                "request {i}, buffer {k}: translate_sg_into"
            );
        }
        assert_eq!(mine.pages(), plain.pages());
        assert!(d.guard_held_pages() > 0);
        drop(plain);
        scratch.recycle(mine);
        assert_eq!(d.guard_held_pages(), 0, "request {i}: all let go");
    }
    // The errors of the plain walk: unmapped, and no access asked.
    let hole = [SgBuf {
        iova: Iova((1 << 30) + PAGE),
        len: 8,
        prot: Prot::READ,
    }];
    assert!(cursor.translate_sg_into(&hole, &mut scratch).is_err());
    assert!(matches!(
        cursor.hold_sg_into(&hole, &mut scratch).unwrap(),
        SgWalk::Missed(_)
    ));
    let none = [SgBuf {
        prot: Prot::default(),
        ..hole[0]
    }];
    assert!(cursor.translate_sg_into(&none, &mut scratch).is_err());
    assert!(cursor.hold_sg_into(&none, &mut scratch).is_err());
}

#[test]
fn a_thousand_requests_allocate_nothing_after_warm_up() {
    let (d, _b) = space();
    let mut cursor = d.cursor();
    let mut scratch = SgScratch::for_queue(1);
    let mut bufs = Vec::with_capacity(8);
    let mut run = |from: u64, to: u64| {
        for i in from..to {
            request(i, &mut bufs);
            let guard = held(cursor.hold_sg_into(&bufs, &mut scratch));
            scratch.recycle(guard);
            cursor.translate_sg_into(&bufs, &mut scratch).unwrap();
        }
    };
    // Warm-up: the vectors grow to the biggest request's size (a data buffer across a
    // granule's edge is two pieces, one more to count), and the shard's list to its own.
    run(0, 1000);
    let n = allocations(|| run(1000, 2000));
    assert_eq!(n, 0, "allocations in 1,000 requests after warm-up");
    // The counter counts: the plain walk allocates its guard's vectors every time.
    let plain = allocations(|| {
        for i in 0..10 {
            request(i, &mut Vec::with_capacity(8));
            drop(held(d.hold_sg(&[SgBuf {
                iova: Iova(16 * MIB),
                len: PAGE,
                prot: Prot::READ,
            }])));
        }
    });
    assert!(
        plain >= 10,
        "the plain walk allocated {plain} times in 10 requests"
    );
}

/// The checks after a hit in the read-only mapping at `ro`, of `len` bytes, with a writable
/// mapping right after it in IOVA and apart on the host: a read there makes it the hit and a
/// second read is answered as the space answers it; a write there is refused (EPERM); a read
/// from it into the next mapping gets two segments, the second on the next mapping's memory.
fn read_only_hit(d: &DmaSpace, cursor: &mut DmaCursor, scratch: &mut SgScratch, ro: u64, len: u64) {
    let read = [buf(ro, 16, Prot::READ), buf(ro + 64, 16, Prot::READ)];
    cursor.translate_sg_into(&read, scratch).unwrap();
    let want = d.translate_sg(Iova(ro + 64), 16, Prot::READ).unwrap();
    assert_eq!(scratch.buffer(1), want, "a second buffer in the hit");
    let write = [buf(ro, 16, Prot::READ), buf(ro + 8, 8, Prot::WRITE)];
    let err = cursor.translate_sg_into(&write, scratch).unwrap_err();
    assert_eq!(
        err.errno(),
        libc::EPERM,
        "a write in the read-only hit: {err}"
    );
    let across = [buf(ro, 16, Prot::READ), buf(ro + len - 8, 16, Prot::READ)];
    cursor.translate_sg_into(&across, scratch).unwrap();
    let want = d.translate_sg(Iova(ro + len - 8), 16, Prot::READ).unwrap();
    assert_eq!(want.len(), 2, "the two mappings are apart on the host");
    assert_eq!(scratch.buffer(1), &want[..], "a buffer past the hit's end");
}

/// A cursor's `translate_sg_into` after the cursor hit a mapping: a write in a read-only
/// mapping is refused (EPERM), a buffer that runs past the mapping's end takes the next
/// mapping's host page (or fails where nothing is mapped), a buffer that asks for no access
/// is refused, and a write in a mapping that logs dirty pages is marked.
#[test]
fn translate_sg_into_checks_each_buffer_whatever_the_cursor_hit_last() {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * MIB).unwrap());
    // The page table kept from the first small mapping: its words answer for them.
    let d = DmaSpace::new(DmaConfig {
        page_table_from: 0,
        ..DmaConfig::default()
    })
    .unwrap();
    // Two IOVA-adjacent pages on host pages apart: a read-only one, then a writable one.
    let ro = 1u64 << 30;
    d.map_backing(Iova(ro), &b, 5 * PAGE, PAGE, Prot::READ)
        .unwrap();
    d.map_backing(Iova(ro + PAGE), &b, 9 * PAGE, PAGE, Prot::RW)
        .unwrap();
    let big = 16 * MIB;
    d.map_backing(Iova(big), &b, 8 * MIB, 8 * MIB, Prot::RW)
        .unwrap();
    let mut cursor = d.cursor();
    let mut scratch = SgScratch::for_queue(0);
    read_only_hit(&d, &mut cursor, &mut scratch, ro, PAGE);
    // In guest RAM (the page table's huge words answer there): a buffer that asks for no
    // access is refused (EINVAL), an empty one has no segment, and one that runs past the
    // mapping's end is refused (EFAULT) rather than answered from its granule.
    let none = [buf(big, 8, Prot::default())];
    let err = cursor.translate_sg_into(&none, &mut scratch).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL, "no access asked: {err}");
    let empty = [buf(big, 0, Prot::READ), buf(big + 8, 8, Prot::READ)];
    cursor.translate_sg_into(&empty, &mut scratch).unwrap();
    assert!(
        scratch.buffer(0).is_empty(),
        "an empty buffer has no segment"
    );
    assert_eq!(scratch.buffer(1).len(), 1);
    let past = [buf(big + 8 * MIB - 8, 16, Prot::READ)];
    let err = cursor.translate_sg_into(&past, &mut scratch).unwrap_err();
    assert_eq!(err.errno(), libc::EFAULT, "past the mapping's end: {err}");
    // While dirty pages are logged, a write inside the mapping a translation just hit is
    // still marked.
    d.start_dirty_tracking().unwrap();
    cursor.translate(Iova(big), 16, Prot::READ).unwrap();
    let wrote = [buf(big + 3 * PAGE, 64, Prot::WRITE)];
    cursor.translate_sg_into(&wrote, &mut scratch).unwrap();
    let bits = d.get_and_clear_dirty(Iova(big), 8 * MIB, PAGE).unwrap();
    assert_eq!(bits[0], 1 << 3, "only the page written is dirty");
    assert!(
        bits[1..].iter().all(|&w| w == 0),
        "only the page written is dirty"
    );
}

/// The same checks where the page table cannot answer: a client whose device addresses are its
/// own process addresses (libblkio's, far above the table's 512 GiB), so each buffer that
/// neither of the cursor's last two hits holds goes to the sorted index, and the mapping found
/// there becomes the last hit. A hit answers only a buffer inside it, allowed, while no dirty
/// pages are logged, and only in the generation it was found in.
#[test]
fn translate_sg_into_above_the_page_table_answers_from_its_last_two_mappings_alone() {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * MIB).unwrap());
    let d = DmaSpace::new(DmaConfig::default()).unwrap();
    let high = 0x7f12_3400_0000u64;
    // Two IOVA-adjacent 16 KiB mappings on host memory apart: read-only, then writable; and
    // a 6 MiB one, as libblkio's ring region and buffer region are.
    d.map_backing(Iova(high), &b, 0, 4 * PAGE, Prot::READ)
        .unwrap();
    d.map_backing(Iova(high + 4 * PAGE), &b, 8 * PAGE, 4 * PAGE, Prot::RW)
        .unwrap();
    let big = high + 4 * MIB;
    d.map_backing(Iova(big), &b, 8 * MIB, 6 * MIB, Prot::RW)
        .unwrap();
    let mut cursor = d.cursor();
    let mut scratch = SgScratch::for_queue(0);
    // A request's shape: header, data, status; header and status in one mapping.
    let request = [
        buf(high + 4 * PAGE + 0x100, 16, Prot::READ),
        buf(big + 3 * PAGE, PAGE, Prot::WRITE),
        buf(high + 4 * PAGE + 0x110, 1, Prot::WRITE),
    ];
    cursor.translate_sg_into(&request, &mut scratch).unwrap();
    for (i, r) in request.iter().enumerate() {
        let want = d.translate_sg(r.iova, r.len, r.prot).unwrap();
        assert_eq!(scratch.buffer(i), &want[..], "buffer {i} of the request");
    }
    read_only_hit(&d, &mut cursor, &mut scratch, high, 4 * PAGE);
    // Inside the hit: no access asked is refused, an empty buffer has no segment, and a buffer
    // past the mapping's end is refused.
    let hit_big = [buf(big, 8, Prot::READ)];
    cursor.translate_sg_into(&hit_big, &mut scratch).unwrap();
    let none = [buf(big, 8, Prot::READ), buf(big + 8, 8, Prot::default())];
    let err = cursor.translate_sg_into(&none, &mut scratch).unwrap_err();
    assert_eq!(err.errno(), libc::EINVAL, "no access asked: {err}");
    let empty = [buf(big, 8, Prot::READ), buf(big + 8, 0, Prot::READ)];
    cursor.translate_sg_into(&empty, &mut scratch).unwrap();
    assert!(
        scratch.buffer(1).is_empty(),
        "an empty buffer has no segment"
    );
    let past = [
        buf(big, 8, Prot::READ),
        buf(big + 6 * MIB - 8, 16, Prot::READ),
    ];
    let err = cursor.translate_sg_into(&past, &mut scratch).unwrap_err();
    assert_eq!(err.errno(), libc::EFAULT, "past the mapping's end: {err}");
    // While dirty pages are logged, a write in the mapping the last buffer was found in is
    // marked.
    d.start_dirty_tracking().unwrap();
    let wrote = [
        buf(big, 16, Prot::READ),
        buf(big + 3 * PAGE, 64, Prot::WRITE),
    ];
    cursor.translate_sg_into(&wrote, &mut scratch).unwrap();
    let bits = d.get_and_clear_dirty(Iova(big), 6 * MIB, PAGE).unwrap();
    assert_eq!(bits[0], 1 << 3, "only the page written is dirty");
    assert!(
        bits[1..].iter().all(|&w| w == 0),
        "only the page written is dirty"
    );
    // A change to the space ends the hit: a buffer in a mapping since unmapped is refused.
    d.stop_dirty_tracking();
    cursor.translate_sg_into(&hit_big, &mut scratch).unwrap();
    d.unmap(Iova(big), 6 * MIB).unwrap();
    let err = cursor
        .translate_sg_into(&hit_big, &mut scratch)
        .unwrap_err();
    assert_eq!(err.errno(), libc::EFAULT, "unmapped since the hit: {err}");
}
