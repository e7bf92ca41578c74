//! The blk data path allocates nothing per request once warm: 1,000 reads and writes through
//! the whole back end (socket, ring, device, io_uring), after a warm-up, make no heap
//! allocation in the back end's thread — the ordinary way (hold + `READV`/`WRITEV`) and through
//! registered buffers alike, on a memfd image (transfers complete at submission) and on an
//! `O_DIRECT` file (they complete later). The device reuses its chain, walk and iovec vectors and its lists
//! of ended transfers (`blk::device`, `blk::io`, `disk`).
//!
//! A counting global allocator counts every thread's allocations but the test's own (the
//! driver side: the test's guest ring), so it is alone in its binary; the count is armed only
//! while the measured requests run.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use common::*;
use memvisor_vhost::{Blk, BlkOptions, BlkStats};

struct Counting;

static ARMED: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's allocations are not counted (the test's driver side).
    static DRIVER: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if ARMED.load(Ordering::Relaxed) && !DRIVER.try_with(Cell::get).unwrap_or(true) {
        COUNT.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every call goes to the system allocator unchanged; counting touches atomics and a
// const thread-local `Cell` with no destructor, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as the caller promised for `layout`.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: as the caller promised for `ptr`, `layout` and `new_size`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Requests posted together (3 descriptors each in the 16-entry ring).
const N: u16 = 5;
const HDR: u64 = 0x10000;
const STATUS: u64 = 0x11000;
const DATA: u64 = 0x100000;
/// Requests measured.
const MEASURED: u32 = 1000;

/// One batch of `N` reads (`round` even) or writes of 4 to 16 KiB inside one 2 MiB chunk
/// each; asserts every status OK.
fn batch(g: &mut Guest, round: u32) {
    let kind = round % 2;
    for k in 0..N {
        let len = 4096u32 << ((u32::from(k) + round) % 3);
        let at = DATA + u64::from(k) * 2 * MIB + 8192;
        let sector = (u64::from(round) * 131 + u64::from(k) * 64) % 30_000;
        let (hdr, status) = (HDR + u64::from(k) * 16, STATUS + u64::from(k));
        g.add_request(k, kind, sector, hdr, at, len, status);
    }
    assert_eq!(
        g.kick_and_wait(N, STATUS),
        vec![0; usize::from(N)],
        "round {round}: statuses"
    );
}

/// Features without dirty logging (`VHOST_F_LOG_ALL`, which keeps registered buffers off),
/// protocol features, the memory table, the ring.
fn connect(c: &memvisor_testkit::vhost::client::Client, g: &Guest) {
    negotiate_without(c, g, F_LOG_ALL);
    start_ring(c, g);
}

/// The image: a memfd (its transfers complete as they are submitted), or with `direct` a
/// file under the target directory opened `O_DIRECT` (completions come later, from the
/// kernel's deferred work); `None` where the file system refuses `O_DIRECT`.
fn image(direct: bool) -> Option<std::fs::File> {
    let fill = |f: &std::fs::File| f.write_all_at(&vec![7u8; 16 * MIB as usize], 0).unwrap();
    if !direct {
        let d = memfd(16 * MIB);
        fill(&d);
        return Some(d);
    }
    use std::os::unix::fs::OpenOptionsExt;
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("blk_alloc.img");
    let f = std::fs::File::create(&path).unwrap();
    fill(&f);
    f.sync_all().unwrap();
    let d = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .ok();
    let _ = std::fs::remove_file(&path);
    d
}

/// Serves warm-up then measured requests; returns the measured requests' allocations in the
/// back end and the device's counters.
fn run(fixed: bool, disk: std::fs::File) -> (u64, BlkStats) {
    let mut g = Guest::new(16 * MIB);
    let options = BlkOptions {
        fixed_buffers: fixed,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk, options).unwrap());
    connect(&c, &g);
    for round in 0..100 {
        batch(&mut g, round);
    }
    COUNT.store(0, Ordering::SeqCst);
    ARMED.store(true, Ordering::SeqCst);
    for round in 0..MEASURED / u32::from(N) {
        batch(&mut g, round);
    }
    ARMED.store(false, Ordering::SeqCst);
    let n = COUNT.load(Ordering::SeqCst);
    drop(c);
    let (backend, _) = t.join().unwrap();
    (n, backend.device().stats())
}

#[test]
fn a_blk_request_allocates_nothing_once_warm() {
    DRIVER.with(|d| d.set(true));
    for direct in [false, true] {
        let what = if direct { "O_DIRECT file" } else { "memfd" };
        let (Some(a), Some(b)) = (image(direct), image(direct)) else {
            println!(
                "skipped: a_blk_request_allocates_nothing_once_warm ({what}): the target \
                 directory's file system refuses O_DIRECT"
            );
            continue;
        };
        let (plain, s) = run(false, a);
        assert_eq!(s.failed, 0, "{s:?}");
        let (fixed, f) = run(true, b);
        assert_eq!(f.failed, 0, "{f:?}");
        println!(
            "{what}: allocations over {MEASURED} requests: ordinary {plain}, registered \
             buffers {fixed} ({} of {} went fixed)",
            f.fixed,
            f.reads + f.writes
        );
        assert_eq!(plain, 0, "{what}: the ordinary way allocates per request");
        assert_eq!(fixed, 0, "{what}: the fixed way allocates per request");
    }
}
