//! Free page reporting, host side, checked by what the kernel says is resident — smaps' Rss of
//! the backing's mappings, the allocated blocks of a memfd or file, the free huge pages — and by
//! the bytes read back: discarded pages read as zeros, everything else keeps its bytes, pinned
//! pages above all, also while pins race reports. Plus every refusal and dirty marking.
//!
//! Tests here measure process-wide counters, so they run one at a time (`serial()`).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use memvisor::dma::{LockLimit, PinRegistry};
use memvisor::{
    Backing, BackingKind, DiscardOptions, Discarder, DmaConfig, DmaSpace, Gpa, HugePageReservation,
    Iova, PageSize, Prot, RejectReason, Rejected, ReportOutcome, SlotFlags, SlotSpec, SlotTable,
};

const PAGE: u64 = 4096;
mod common;

const MIB: u64 = 1 << 20;
/// Where guest RAM starts in these tests: not 0, so guest and host offsets differ.
const BASE: u64 = 1 << 30;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn rss(b: &Backing) -> u64 {
    common::smaps_sum(b.hva().0, b.hva().0 + b.size(), "Rss")
}

/// Bytes the file behind `b` has allocated.
fn allocated(b: &Backing) -> u64 {
    // SAFETY: fstat writes one struct stat we own; the fd is alive while `b` is.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        assert_eq!(libc::fstat(b.fd().unwrap().as_raw_fd(), &mut st), 0);
        st.st_blocks as u64 * 512
    }
}

/// The nonzero byte page `page` of a test backing is filled with, in round `round`.
fn pattern(page: u64, round: u64) -> u8 {
    ((page * 7 + round * 13) % 255 + 1) as u8
}

fn fill(b: &Backing) {
    for p in 0..b.size() / PAGE {
        b.write(p * PAGE, &[pattern(p, 0); PAGE as usize]).unwrap();
    }
}

/// What a 4 KiB page of a backing holds.
#[derive(Debug, PartialEq, Eq)]
enum Held {
    Zero,
    Pattern,
    Other,
}

fn held(b: &Backing, page: u64, round: u64) -> Held {
    let mut buf = vec![0u8; PAGE as usize];
    b.read(page * PAGE, &mut buf).unwrap();
    if buf.iter().all(|&x| x == 0) {
        Held::Zero
    } else if buf.iter().all(|&x| x == pattern(page, round)) {
        Held::Pattern
    } else {
        Held::Other
    }
}

/// A guest: one slot of `kind` memory at `BASE`, filled.
fn guest(kind: BackingKind, size: u64, flags: SlotFlags) -> (SlotTable, Arc<Backing>) {
    let b = Arc::new(Backing::new(kind, size).unwrap());
    fill(&b);
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(BASE), b.clone()).flags(flags))
        .unwrap();
    (t, b)
}

/// A discarder with a registry of its own, and a Lazy DMA space on that registry mapping the
/// whole backing at IOVA 0 (so IOVA page n is backing page n).
fn with_pins(t: &SlotTable, b: &Arc<Backing>) -> (Discarder, DmaSpace) {
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), b, 0, b.size(), Prot::RW).unwrap();
    let discarder = Discarder::with_options(
        t,
        DiscardOptions {
            registry: Some(registry),
            ..DiscardOptions::default()
        },
    );
    (discarder, d)
}

/// [`with_pins`] on a registry held to `limit`, returned too.
fn with_registry(
    t: &SlotTable,
    b: &Arc<Backing>,
    limit: LockLimit,
) -> (Discarder, DmaSpace, Arc<PinRegistry>) {
    let registry = PinRegistry::new(limit);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    d.map_backing(Iova(0), b, 0, b.size(), Prot::RW).unwrap();
    let discarder = Discarder::with_options(
        t,
        DiscardOptions {
            registry: Some(registry.clone()),
            ..DiscardOptions::default()
        },
    );
    (discarder, d, registry)
}

fn own_registry(t: &SlotTable, use_madv_free: bool) -> Discarder {
    Discarder::with_options(
        t,
        DiscardOptions {
            registry: Some(PinRegistry::new(LockLimit::Unlimited)),
            use_madv_free,
        },
    )
}

/// Checks every page of `b`: those in `gone` (backing page ranges) read as zeros, the rest kept
/// their pattern.
fn check_pages(b: &Backing, gone: &[(u64, u64)]) {
    for p in 0..b.size() / PAGE {
        let want = if gone.iter().any(|&(s, e)| p >= s && p < e) {
            Held::Zero
        } else {
            Held::Pattern
        };
        assert_eq!(held(b, p, 0), want, "{:?} page {p}", b.kind());
    }
}

fn clean(discarded: u64) -> ReportOutcome {
    ReportOutcome {
        discarded,
        ..ReportOutcome::default()
    }
}

#[test]
fn private_anonymous_memory_is_dropped() {
    let _s = serial();
    let (t, b) = guest(BackingKind::PrivateAnon, 4 * MIB, SlotFlags::NONE);
    let d = own_registry(&t, false);
    let before = rss(&b);
    assert_eq!(before, 4 * MIB);
    let out = d.report(&[(Gpa(BASE + MIB), MIB), (Gpa(BASE + 3 * MIB), 5 * PAGE)]);
    assert_eq!(out, clean(MIB + 5 * PAGE));
    assert_eq!(before - rss(&b), MIB + 5 * PAGE);
    check_pages(&b, &[(256, 512), (768, 773)]);
}

#[test]
fn madv_free_frees_lazily() {
    let _s = serial();
    let (t, b) = guest(BackingKind::PrivateAnon, 2 * MIB, SlotFlags::NONE);
    let d = own_registry(&t, true);
    let (rss0, lazy0) = (
        rss(&b),
        common::smaps_sum(b.hva().0, b.hva().0 + b.size(), "LazyFree"),
    );
    let out = d.report(&[(Gpa(BASE), MIB)]);
    assert_eq!(out, clean(MIB));
    let (rss1, lazy1) = (
        rss(&b),
        common::smaps_sum(b.hva().0, b.hva().0 + b.size(), "LazyFree"),
    );
    // Pages still mapped are lazily free; pages the kernel took already left Rss. Pages still
    // in the kernel's per-CPU batches (up to 31 per CPU) show up as neither yet.
    let seen = (lazy1 - lazy0) + (rss0 - rss1);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    assert!(seen <= MIB && seen + 31 * cpus * PAGE >= MIB, "{seen:#x}");
    // A lazily freed page reads as its old bytes or as zeros; the rest is untouched.
    for p in 0..512 {
        let h = held(&b, p, 0);
        assert!(
            h == Held::Pattern || (p < 256 && h == Held::Zero),
            "page {p}: {h:?}"
        );
    }
}

#[test]
fn thp_memory_is_dropped_and_huge_pages_split() {
    let _s = serial();
    let (t, b) = guest(BackingKind::Thp, 6 * MIB, SlotFlags::NONE);
    let d = own_registry(&t, false);
    let before = rss(&b);
    assert_eq!(before, 6 * MIB);
    // One whole 2 MiB block (a THP if the kernel gave one) and 3 pages out of another.
    let out = d.report(&[
        (Gpa(BASE + 2 * MIB), 2 * MIB),
        (Gpa(BASE + 4 * MIB + PAGE), 3 * PAGE),
    ]);
    assert_eq!(out, clean(2 * MIB + 3 * PAGE));
    assert_eq!(before - rss(&b), 2 * MIB + 3 * PAGE);
    check_pages(&b, &[(512, 1024), (1025, 1028)]);
}

#[test]
fn shared_anonymous_memory_is_removed() {
    let _s = serial();
    let (t, b) = guest(BackingKind::SharedAnon, 4 * MIB, SlotFlags::NONE);
    let d = own_registry(&t, false);
    let before = rss(&b);
    assert_eq!(before, 4 * MIB);
    let out = d.report(&[(Gpa(BASE), 2 * MIB), (Gpa(BASE + 3 * MIB + 8 * PAGE), PAGE)]);
    assert_eq!(out, clean(2 * MIB + PAGE));
    assert_eq!(before - rss(&b), 2 * MIB + PAGE);
    check_pages(&b, &[(0, 512), (776, 777)]);
}

#[test]
fn memfd_holes_are_punched() {
    let _s = serial();
    let (t, b) = guest(BackingKind::Memfd, 4 * MIB, SlotFlags::NONE);
    let d = own_registry(&t, false);
    let (blocks, resident) = (allocated(&b), rss(&b));
    assert_eq!(blocks, 4 * MIB);
    let out = d.report(&[
        (Gpa(BASE + MIB), 2 * MIB),
        (Gpa(BASE + 17 * PAGE), 2 * PAGE),
    ]);
    assert_eq!(out, clean(2 * MIB + 2 * PAGE));
    assert_eq!(blocks - allocated(&b), 2 * MIB + 2 * PAGE);
    assert_eq!(resident - rss(&b), 2 * MIB + 2 * PAGE);
    check_pages(&b, &[(256, 768), (17, 19)]);
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("memvisor-discard-{}-{name}", std::process::id()))
}

#[test]
fn shared_file_holes_are_punched_into_the_file() {
    let _s = serial();
    let path = temp_path("shared");
    let kind = BackingKind::File {
        path: path.clone(),
        shared: true,
    };
    let (t, b) = guest(kind, 2 * MIB, SlotFlags::NONE);
    // SAFETY: msync on our own live mapping, so the blocks are allocated on disk now.
    unsafe { libc::msync(b.as_ptr().cast(), b.size() as usize, libc::MS_SYNC) };
    let d = own_registry(&t, false);
    let blocks = allocated(&b);
    let out = d.report(&[(Gpa(BASE + MIB), MIB)]);
    if let Some(Rejected {
        reason: RejectReason::Failed { errno, .. },
        ..
    }) = out.rejected.first()
    {
        common::skipped(&format!(
            "this file system cannot punch holes (errno {errno})"
        ));
        let _ = std::fs::remove_file(&path);
        return;
    }
    assert_eq!(out, clean(MIB));
    assert_eq!(blocks - allocated(&b), MIB);
    check_pages(&b, &[(256, 512)]);
    // The file itself changed: it reads as zeros there for everyone.
    let bytes = std::fs::read(&path).unwrap();
    assert!(bytes[MIB as usize..].iter().all(|&x| x == 0));
    assert_eq!(bytes[0], pattern(0, 0));
    drop((t, b));
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn refusals_say_which_bytes_and_why() {
    let _s = serial();
    // Two slots with a hole between them: [BASE, BASE + 1M) memfd, [BASE + 2M, BASE + 3M) a
    // private file mapping; then a read-only slot at BASE + 4M.
    let path = temp_path("private");
    let low = Arc::new(Backing::new(BackingKind::Memfd, MIB).unwrap());
    let private = Arc::new(
        Backing::new(
            BackingKind::File {
                path: path.clone(),
                shared: false,
            },
            MIB,
        )
        .unwrap(),
    );
    let rom = Arc::new(Backing::new(BackingKind::PrivateAnon, MIB).unwrap());
    for b in [&low, &private, &rom] {
        fill(b);
    }
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(BASE), low.clone())).unwrap();
    t.insert(SlotSpec::new(1, Gpa(BASE + 2 * MIB), private.clone()))
        .unwrap();
    t.insert(SlotSpec::new(2, Gpa(BASE + 4 * MIB), rom.clone()).flags(SlotFlags::READ_ONLY))
        .unwrap();
    let d = own_registry(&t, false);
    let blocks = allocated(&low);
    let rej = |gpa: u64, len: u64, reason: RejectReason| Rejected {
        gpa: Gpa(gpa),
        len,
        reason,
    };
    let partial = RejectReason::PartialPage {
        page_size: PageSize::Size4K,
    };
    let ranges = [
        // Ends 0x800 into a page, crosses the hole into the private file mapping.
        (Gpa(BASE + MIB - 2 * PAGE - 0x800), MIB + 3 * PAGE),
        // Below guest memory.
        (Gpa(0x1000), 0x2000),
        (Gpa(BASE + 0x10), 0),
        (Gpa(u64::MAX - 0xfff), 0x2000),
        (Gpa(BASE + 4 * MIB), PAGE),
        // Past the last slot, up to the top of the address space.
        (Gpa(BASE + 5 * MIB), u64::MAX - (BASE + 5 * MIB) + 1),
        // Less than a page, inside one.
        (Gpa(BASE + 0x10), 0x100),
    ];
    let out = d.report(&ranges);
    let start = BASE + MIB - 2 * PAGE - 0x800;
    assert_eq!(
        out.rejected,
        vec![
            rej(start, 0x800, partial),
            rej(BASE + MIB, MIB, RejectReason::OutsideGuestMemory),
            rej(
                BASE + 2 * MIB,
                PAGE - 0x800,
                RejectReason::PrivateFileMapping { slot: 1 }
            ),
            rej(0x1000, 0x2000, RejectReason::OutsideGuestMemory),
            rej(BASE + 0x10, 0, RejectReason::Empty),
            rej(u64::MAX - 0xfff, 0x2000, RejectReason::Wraps),
            rej(BASE + 4 * MIB, PAGE, RejectReason::ReadOnlySlot { slot: 2 }),
            rej(
                BASE + 5 * MIB,
                u64::MAX - (BASE + 5 * MIB) + 1,
                RejectReason::OutsideGuestMemory
            ),
            rej(BASE + 0x10, 0x100, partial),
        ]
    );
    assert_eq!((out.discarded, out.skipped_pinned), (2 * PAGE, 0));
    assert_eq!(blocks - allocated(&low), 2 * PAGE);
    check_pages(&low, &[(254, 256)]);
    check_pages(&private, &[]);
    check_pages(&rom, &[]);
    assert!(
        RejectReason::PrivateFileMapping { slot: 1 }
            .to_string()
            .contains("change the file for every user")
    );

    // A poisoning guest: nothing is discarded, every range says why.
    let blocks = allocated(&low);
    assert_eq!(blocks, MIB);
    d.set_page_poison(0xaa);
    let out = d.report(&[(Gpa(BASE), MIB), (Gpa(7), 0)]);
    assert_eq!(
        out.rejected,
        vec![
            rej(BASE, MIB, RejectReason::PagePoison { value: 0xaa }),
            rej(7, 0, RejectReason::Empty)
        ]
    );
    assert_eq!(out.discarded, 0);
    assert_eq!(allocated(&low), blocks);
    check_pages(&low, &[(254, 256)]);
    d.set_page_poison(0);
    assert_eq!(d.report(&[(Gpa(BASE), PAGE)]), clean(PAGE));
    drop((t, d, low, private, rom));
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn pinned_pages_are_skipped_and_keep_their_bytes() {
    let _s = serial();
    let (t, b) = guest(BackingKind::PrivateAnon, 2 * MIB, SlotFlags::NONE);
    let (discarder, dma) = with_pins(&t, &b);
    let pinned: Vec<u64> = vec![0, 1, 2, 100, 300, 301, 511];
    dma.pin_pages(&pinned, Prot::RW).unwrap();
    let before = rss(&b);
    let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
    let skipped = pinned.len() as u64 * PAGE;
    assert_eq!(
        out,
        ReportOutcome {
            discarded: 2 * MIB - skipped,
            skipped_pinned: skipped,
            rejected: vec![],
        }
    );
    assert_eq!(before - rss(&b), 2 * MIB - skipped);
    for p in 0..512 {
        let want = if pinned.contains(&p) {
            Held::Pattern
        } else {
            Held::Zero
        };
        assert_eq!(held(&b, p, 0), want, "page {p}");
    }
    // Unpinned, they go with the next report.
    dma.unpin_pages(&pinned).unwrap();
    let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
    assert_eq!(out.skipped_pinned, 0);
    assert_eq!(held(&b, 300, 0), Held::Zero);
}

/// Holds — pins that lock nothing, what a blk request takes for its pages — keep discards off
/// their pages exactly as pins do, with nothing locked: under a registry that may lock nothing
/// at all, where every pin is refused. On THP memory a held page keeps its whole huge page.
#[test]
fn held_pages_are_skipped_and_keep_their_bytes_with_nothing_locked() {
    let _s = serial();
    for kind in [BackingKind::PrivateAnon, BackingKind::Memfd] {
        let (t, b) = guest(kind.clone(), 2 * MIB, SlotFlags::NONE);
        let (discarder, dma, registry) = with_registry(&t, &b, LockLimit::Bytes(0));
        let e = dma.pin_pages(&[5], Prot::RW).unwrap_err();
        assert_eq!(
            e.errno(),
            libc::ENOMEM,
            "{}: a pin needs a lock: {e}",
            kind.name()
        );
        let held_pages: Vec<u64> = vec![0, 1, 2, 100, 300, 301, 511];
        dma.hold_pages(&held_pages, Prot::RW).unwrap();
        let k = registry.kernel_check();
        assert_eq!(
            (k.held_bytes, k.charged_bytes),
            (0, 0),
            "{}: a hold locks nothing",
            kind.name()
        );
        assert_eq!(registry.pin_count(memvisor::Hva(b.hva().0 + 300 * PAGE)), 1);
        let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
        let skipped = held_pages.len() as u64 * PAGE;
        assert_eq!(
            (out.discarded, out.skipped_pinned),
            (2 * MIB - skipped, skipped),
            "{}",
            kind.name()
        );
        for p in 0..512 {
            let want = if held_pages.contains(&p) {
                Held::Pattern
            } else {
                Held::Zero
            };
            assert_eq!(held(&b, p, 0), want, "{}: page {p}", kind.name());
        }
        // Released, they go with the next report.
        dma.unpin_pages(&held_pages).unwrap();
        let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
        assert_eq!(out.skipped_pinned, 0);
        assert_eq!(held(&b, 300, 0), Held::Zero);
    }
    let (t, b) = guest(BackingKind::Thp, 4 * MIB, SlotFlags::NONE);
    let (discarder, dma, _registry) = with_registry(&t, &b, LockLimit::Bytes(0));
    dma.hold_pages(&[700], Prot::RW).unwrap(); // inside the second 2 MiB
    let out = discarder.report(&[(Gpa(BASE + PAGE), 4 * MIB - 2 * PAGE)]);
    assert_eq!(
        (out.discarded, out.skipped_pinned),
        (2 * MIB - PAGE, 2 * MIB - PAGE)
    );
    check_pages(&b, &[(1, 512)]);
    dma.unpin_pages(&[700]).unwrap();
}

/// A page under a live scatter-gather guard is skipped like a held one, and discarded once the
/// guard is gone.
#[test]
fn pages_under_a_live_guard_are_skipped() {
    let _s = serial();
    let (t, b) = guest(BackingKind::PrivateAnon, 2 * MIB, SlotFlags::NONE);
    let (discarder, dma, registry) = with_registry(&t, &b, LockLimit::Bytes(0));
    let walk = dma
        .hold_sg(&[memvisor::dma::SgBuf {
            iova: Iova(300 * PAGE + 10),
            len: PAGE,
            prot: Prot::WRITE,
        }])
        .unwrap();
    let memvisor::dma::SgWalk::Held(guard) = walk else {
        panic!("mapped memory must not miss");
    };
    let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
    assert_eq!(
        (out.discarded, out.skipped_pinned),
        (2 * MIB - 2 * PAGE, 2 * PAGE)
    );
    assert_eq!(held(&b, 300, 0), Held::Pattern);
    assert_eq!(held(&b, 301, 0), Held::Pattern);
    assert_eq!(held(&b, 302, 0), Held::Zero);
    drop(guard);
    assert_eq!(registry.guard_held_pages(), 0);
    let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
    assert_eq!(out.skipped_pinned, 0);
    assert_eq!(held(&b, 300, 0), Held::Zero);
}

/// A page both held and pinned stays locked until the last of the two goes, and is discarded
/// only after both.
#[test]
fn a_page_held_and_pinned_is_kept_until_both_go() {
    let _s = serial();
    let (t, b) = guest(BackingKind::PrivateAnon, 2 * MIB, SlotFlags::NONE);
    let (discarder, dma, registry) = with_registry(&t, &b, LockLimit::Unlimited);
    dma.hold_pages(&[10, 11], Prot::RW).unwrap();
    dma.pin_pages(&[11, 12], Prot::RW).unwrap();
    assert_eq!(registry.locked_bytes(), 2 * PAGE, "only the pin locks");
    dma.unpin_pages(&[11, 12]).unwrap(); // the pin goes; page 11 stays held
    registry.release_cached();
    let out = discarder.report(&[(Gpa(BASE), 2 * MIB)]);
    assert_eq!(out.skipped_pinned, 2 * PAGE);
    assert_eq!(
        (held(&b, 10, 0), held(&b, 11, 0)),
        (Held::Pattern, Held::Pattern)
    );
    assert_eq!(held(&b, 12, 0), Held::Zero);
    dma.unpin_pages(&[10, 11]).unwrap();
    assert_eq!(
        registry.locked_bytes(),
        0,
        "the last of the two let go of the lock"
    );
    registry.release_cached();
    assert_eq!(registry.kernel_check().held_bytes, 0);
    assert_eq!(discarder.report(&[(Gpa(BASE), 2 * MIB)]).skipped_pinned, 0);
}

/// THP memory is pinned in whole huge pages, so a pin inside one keeps all of it: reported as
/// skipped, never half-discarded (MADV_DONTNEED would refuse the locked part anyway).
#[test]
fn a_pin_keeps_its_whole_transparent_huge_page() {
    let _s = serial();
    let (t, b) = guest(BackingKind::Thp, 4 * MIB, SlotFlags::NONE);
    let (discarder, dma) = with_pins(&t, &b);
    dma.pin_pages(&[700], Prot::RW).unwrap(); // inside the second 2 MiB
    let out = discarder.report(&[(Gpa(BASE + PAGE), 4 * MIB - 2 * PAGE)]);
    assert_eq!(
        out,
        ReportOutcome {
            discarded: 2 * MIB - PAGE,
            skipped_pinned: 2 * MIB - PAGE,
            rejected: vec![],
        }
    );
    check_pages(&b, &[(1, 512)]);
    dma.unpin_pages(&[700]).unwrap();
}

/// Pinners pin random pages, write a fresh pattern, wait for reports to go by, check the
/// pattern, unpin — while a reporter reports overlapping ranges of the same memory over and
/// over. A pinned page never loses a byte, however the pins and reports interleave. Private
/// memory (where the kernel itself refuses MADV_DONTNEED
/// on locked pages) and a memfd (where punching a hole would free locked pages too).
#[test]
fn pins_racing_reports_never_lose_bytes() {
    let _s = serial();
    for kind in [BackingKind::PrivateAnon, BackingKind::Memfd] {
        race(kind, Duration::from_secs(2), false);
    }
}

/// The same race with holds (what blk requests take): nothing is locked, so on private memory
/// the kernel would not refuse `MADV_DONTNEED` either; only the registry keeps the reports off.
#[test]
fn holds_racing_reports_never_lose_bytes() {
    let _s = serial();
    for kind in [BackingKind::PrivateAnon, BackingKind::Memfd] {
        race(kind, Duration::from_secs(2), true);
    }
}

/// Sets the flag when dropped, also while unwinding: a failed assertion stops the other
/// threads instead of leaving them waiting.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn race(kind: BackingKind, time: Duration, hold: bool) {
    const PAGES: u64 = 512;
    let (t, b) = guest(kind.clone(), PAGES * PAGE, SlotFlags::NONE);
    let (discarder, dma) = with_pins(&t, &b);
    let reports = AtomicU64::new(0);
    let rounds_done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    // At least `time`, and on until the race ran enough rounds of both sides to mean
    // something: on a busy machine that takes longer, up to a limit.
    let (min_reports, min_rounds) = (2000, 1000);
    let deadline = Instant::now() + time;
    let limit = Instant::now() + time * 30;
    let (pin_rounds, discarded, skipped) = std::thread::scope(|s| {
        let pinners: Vec<_> = (0..2u64)
            .map(|who| {
                let (b, dma, reports, stop) = (&b, &dma, &reports, &stop);
                let rounds_done = &rounds_done;
                s.spawn(move || {
                    let _stop = StopOnDrop(stop);
                    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ who;
                    let mut rounds = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        rounds += 1;
                        // This pinner's pages are those with page % 2 == who.
                        let n = 1 + xorshift(&mut rng) % 4;
                        let first = xorshift(&mut rng) % (PAGES / 2 - n);
                        let pages: Vec<u64> = (first..first + n).map(|i| i * 2 + who).collect();
                        for &p in &pages {
                            b.write(p * PAGE, &[pattern(p, rounds); PAGE as usize])
                                .unwrap();
                        }
                        if hold {
                            dma.hold_pages(&pages, Prot::RW).unwrap();
                        } else {
                            dma.pin_pages(&pages, Prot::RW).unwrap();
                        }
                        for &p in &pages {
                            // Before the pin a report may discard the page, even in the middle
                            // of the write above (the guest would not write memory it reported;
                            // this test does, to make the race tight). From the pin on, nothing
                            // may change it: write the round's pattern again and check it below.
                            if held(b, p, rounds) != Held::Pattern {
                                b.write(p * PAGE, &[pattern(p, rounds); PAGE as usize])
                                    .unwrap();
                            }
                        }
                        let seen = reports.load(Ordering::Acquire);
                        while reports.load(Ordering::Acquire) < seen + 2
                            && !stop.load(Ordering::Relaxed)
                        {
                            std::thread::sleep(Duration::from_micros(20));
                        }
                        for &p in &pages {
                            assert_eq!(held(b, p, rounds), Held::Pattern, "pinned page {p}");
                        }
                        dma.unpin_pages(&pages).unwrap();
                        rounds_done.fetch_add(1, Ordering::Relaxed);
                    }
                    rounds
                })
            })
            .collect();
        let _stop = StopOnDrop(&stop);
        let mut rng = 12345u64;
        let (mut discarded, mut skipped) = (0, 0);
        let enough = || {
            reports.load(Ordering::Relaxed) >= min_reports
                && rounds_done.load(Ordering::Relaxed) >= min_rounds
        };
        while !stop.load(Ordering::Relaxed)
            && (Instant::now() < deadline || (!enough() && Instant::now() < limit))
        {
            let start = xorshift(&mut rng) % PAGES;
            let len = 1 + xorshift(&mut rng) % (PAGES - start);
            let out = discarder.report(&[
                (Gpa(BASE + start * PAGE), len * PAGE),
                (Gpa(BASE), PAGES * PAGE),
            ]);
            assert!(out.rejected.is_empty(), "{:?}", out.rejected);
            assert_eq!(out.discarded + out.skipped_pinned, (len + PAGES) * PAGE);
            discarded += out.discarded;
            skipped += out.skipped_pinned;
            reports.fetch_add(1, Ordering::Release);
        }
        stop.store(true, Ordering::Relaxed);
        let rounds: u64 = pinners.into_iter().map(|p| p.join().unwrap()).sum();
        (rounds, discarded, skipped)
    });
    let reports = reports.load(Ordering::Relaxed);
    println!(
        "{}{}: {reports} reports, {pin_rounds} pin rounds, {discarded} bytes discarded, \
         {skipped} skipped",
        kind.name(),
        if hold { " (holds)" } else { "" }
    );
    assert!(reports >= min_reports, "only {reports} reports");
    assert!(pin_rounds >= min_rounds, "only {pin_rounds} pin rounds");
    assert!(discarded > 0 && skipped > 0);
}

fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn discarded_pages_are_marked_dirty() {
    let _s = serial();
    let (t, b) = guest(BackingKind::Memfd, MIB, SlotFlags::LOG_DIRTY);
    let (discarder, dma) = with_pins(&t, &b);
    t.take_dirty_log(0).unwrap();
    dma.pin_pages(&[5], Prot::READ).unwrap();
    // Pages 3..=7 and half of 8: page 5 is pinned, half of 8 is not a page.
    let out = discarder.report(&[(Gpa(BASE + 3 * PAGE), 5 * PAGE + 0x800)]);
    assert_eq!((out.discarded, out.skipped_pinned), (4 * PAGE, PAGE));
    let log = t.take_dirty_log(0).unwrap();
    assert_eq!(log[0], 0b1101_1000, "{:#b}", log[0]);
    assert!(log[1..].iter().all(|&w| w == 0));
    check_pages(&b, &[(3, 5), (6, 8)]);
}

fn free_2m() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages")
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn huge_pages_go_only_whole_and_unpinned() {
    let _s = serial();
    let _pool = match HugePageReservation::add(PageSize::Size2M, 4) {
        Ok(r) => r,
        Err(e) => {
            common::skipped(&format!("huge_pages_go_only_whole_and_unpinned: {e}"));
            return;
        }
    };
    let huge = 2 * MIB;
    let (t, b) = guest(
        BackingKind::Hugetlb(PageSize::Size2M),
        4 * huge,
        SlotFlags::NONE,
    );
    let (discarder, dma) = with_pins(&t, &b);
    let free = free_2m();
    let partial = RejectReason::PartialPage {
        page_size: PageSize::Size2M,
    };
    // Huge page 1 all but its first 4 KiB, huge page 2 whole.
    let out = discarder.report(&[
        (Gpa(BASE + huge + PAGE), huge - PAGE),
        (Gpa(BASE + 2 * huge), huge),
    ]);
    assert_eq!(out.discarded, huge);
    assert_eq!(
        out.rejected,
        vec![Rejected {
            gpa: Gpa(BASE + huge + PAGE),
            len: huge - PAGE,
            reason: partial
        }]
    );
    assert_eq!(free_2m(), free + 1);
    // The missing 4 KiB of huge page 1 in a later report: no accumulation, still kept.
    let out = discarder.report(&[(Gpa(BASE + huge), PAGE)]);
    assert_eq!(out.discarded, 0);
    assert_eq!(free_2m(), free + 1);
    // Reading a discarded huge page faults a fresh (zeroed) one in again.
    check_pages(&b, &[(1024, 1536)]);
    let free = free_2m();
    // One pinned 4 KiB page keeps its whole huge page.
    dma.pin_pages(&[3 * 512 + 100], Prot::RW).unwrap();
    let out = discarder.report(&[(Gpa(BASE + 3 * huge), huge)]);
    assert_eq!((out.discarded, out.skipped_pinned), (0, huge));
    assert_eq!(free_2m(), free);
    dma.unpin_pages(&[3 * 512 + 100]).unwrap();
    let out = discarder.report(&[(Gpa(BASE + 3 * huge), huge)]);
    assert_eq!(out, clean(huge));
    assert_eq!(free_2m(), free + 1);
    check_pages(&b, &[(1024, 1536), (1536, 2048)]);
    // Huge page 0 in two touching halves of one report: both are free at once, so it goes.
    let free = free_2m();
    let out = discarder.report(&[(Gpa(BASE), huge / 2), (Gpa(BASE + huge / 2), huge / 2)]);
    assert_eq!(out, clean(huge));
    assert_eq!(free_2m(), free + 1);
    check_pages(&b, &[(0, 512), (1024, 1536), (1536, 2048)]);
    drop((discarder, dma, t, b));
}

/// Two empty ranges at one address: the second is merged into the first (zero bytes touching
/// zero bytes). The merge's bound check once computed `len - 1` of the joined length, 0, and a
/// debug build panicked ("attempt to subtract with overflow"; issue 34).
#[test]
fn empty_ranges_at_one_address_merge_without_panicking() {
    let _s = serial();
    let (t, _b) = guest(BackingKind::PrivateAnon, 2 * MIB, SlotFlags::NONE);
    let d = own_registry(&t, false);
    for at in [BASE, 0, u64::MAX] {
        let out = d.report(&[(Gpa(at), 0), (Gpa(at), 0), (Gpa(at), 0)]);
        assert_eq!(out.discarded, 0);
        assert_eq!(
            out.rejected,
            [Rejected {
                gpa: Gpa(at),
                len: 0,
                reason: RejectReason::Empty
            }],
            "at {at:#x}"
        );
    }
}
