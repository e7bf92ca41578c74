//! The dirty log never under-reports: type1's rules for pinned pages (dirty on every read while
//! pinned, whatever the protection; dirty at the start of tracking), the all-mapped scope of
//! devices that log nothing, unmap returning the removed range's bits, the kernel's bitmap
//! limits, and a migration loop run against devices that pin, write and unpin concurrently.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;

use memvisor::dma::{DIRTY_BITMAP_PAGES_MAX, DirtyScope, LockLimit, PinMode, PinRegistry};
use memvisor::{
    Backing, BackingKind, BackingOptions, DmaConfig, DmaSpace, Gpa, Iova, Prot, SlotSpec, SlotTable,
};

mod common;

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

/// The tests pin memory and one of them reads VmLck: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn space() -> DmaSpace {
    DmaSpace::new(DmaConfig {
        registry: Some(PinRegistry::new(LockLimit::Unlimited)),
        ..DmaConfig::default()
    })
    .unwrap()
}

/// The page numbers set in `words`.
fn pages_of(words: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    for (i, w) in words.iter().enumerate() {
        for b in 0..64 {
            if w >> b & 1 == 1 {
                out.push(i as u64 * 64 + b);
            }
        }
    }
    out
}

/// A space with `pages` pages of fresh memory mapped at IOVA 0.
fn mapped(pages: u64) -> (DmaSpace, Arc<Backing>) {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, pages * PAGE).unwrap());
    let d = space();
    d.map_backing(Iova(0), &b, 0, b.size(), Prot::RW).unwrap();
    (d, b)
}

fn read(d: &DmaSpace, pages: u64) -> Vec<u64> {
    pages_of(&d.get_and_clear_dirty(Iova(0), pages * PAGE, PAGE).unwrap())
}

#[test]
fn a_pinned_page_reads_dirty_on_every_read_while_pinned_whatever_its_prot() {
    let _s = serial();
    let (d, _b) = mapped(16);
    d.start_dirty_tracking().unwrap();
    for prot in [Prot::READ, Prot::WRITE, Prot::RW] {
        d.pin_pages(&[3, 4], prot).unwrap();
        for round in 0..3 {
            assert_eq!(read(&d, 16), vec![3, 4], "{prot:?}, read {round}");
        }
        d.unpin_pages(&[3, 4]).unwrap();
        // A write just before the unpin is not lost: the read after the unpin reports it.
        assert_eq!(read(&d, 16), vec![3, 4], "{prot:?}, after unpin");
        assert_eq!(read(&d, 16), Vec::<u64>::new(), "{prot:?}, clean again");
    }
}

#[test]
fn pages_pinned_before_tracking_starts_are_dirty_at_the_first_read() {
    let _s = serial();
    let (d, _b) = mapped(16);
    d.pin_pages(&[9], Prot::READ).unwrap();
    d.start_dirty_tracking().unwrap();
    assert_eq!(read(&d, 16), vec![9]);
    d.unpin_pages(&[9]).unwrap();
}

#[test]
fn an_unlogged_device_makes_every_mapped_page_dirty_until_it_goes_and_once_after() {
    let _s = serial();
    let (d, b) = mapped(16);
    let other = Arc::new(Backing::new(BackingKind::PrivateAnon, 4 * PAGE).unwrap());
    d.map_backing(Iova(64 * PAGE), &other, 0, other.size(), Prot::READ)
        .unwrap();
    d.start_dirty_tracking().unwrap();
    assert_eq!(d.dirty_scope(), DirtyScope::Logged);
    let all: Vec<u64> = (0..16).chain(64..68).collect();
    let dev = d.attach_unlogged_device();
    assert_eq!(d.dirty_scope(), DirtyScope::AllMapped);
    assert_eq!(read(&d, 68), all);
    assert_eq!(read(&d, 68), all);
    drop(dev);
    assert_eq!(d.dirty_scope(), DirtyScope::Logged);
    // What it wrote before it went is still reported, once.
    assert_eq!(read(&d, 68), all);
    assert_eq!(read(&d, 68), Vec::<u64>::new());
    // Eager mode serves a consumer that logs nothing: the same scope.
    d.set_pin_mode(PinMode::Eager).unwrap();
    assert_eq!(d.dirty_scope(), DirtyScope::AllMapped);
    assert_eq!(read(&d, 68), all);
    d.set_pin_mode(PinMode::Lazy).unwrap();
    assert_eq!(read(&d, 68), all);
    assert_eq!(read(&d, 68), Vec::<u64>::new());
    drop(b);
}

#[test]
fn unmap_returns_the_removed_ranges_dirty_bits() {
    let _s = serial();
    let (d, b) = mapped(16);
    d.map_backing(Iova(32 * PAGE), &b, 0, 8 * PAGE, Prot::RW)
        .unwrap();
    // Tracking off: EINVAL, nothing unmapped.
    let e = d.unmap_get_dirty(Iova(0), 16 * PAGE, PAGE).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    assert_eq!(d.len(), 2);
    d.start_dirty_tracking().unwrap();
    d.dma_write(Iova(5 * PAGE + 100), &[1; 8]).unwrap();
    d.dma_write(Iova(33 * PAGE), &[1; 8]).unwrap();
    // The bitmap's arguments are checked before anything is unmapped.
    let e = d.unmap_get_dirty(Iova(0), 16 * PAGE, 2 * MIB).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = d.unmap_get_dirty(Iova(0), 8 * PAGE, PAGE).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "cuts the mapping: {e}");
    assert_eq!(d.len(), 2);
    let (bytes, bits) = d.unmap_get_dirty(Iova(0), 16 * PAGE, PAGE).unwrap();
    assert_eq!(bytes, 16 * PAGE);
    assert_eq!(pages_of(&bits), vec![5]);
    assert_eq!(d.len(), 1);
    // Offsets are relative to the unmapped range's start.
    let (_, bits) = d.unmap_get_dirty(Iova(30 * PAGE), 12 * PAGE, PAGE).unwrap();
    assert_eq!(pages_of(&bits), vec![3]);
}

#[test]
fn bitmap_reads_past_the_kernels_limit_are_einval_and_allocate_nothing() {
    let _s = serial();
    let (d, _b) = mapped(16);
    d.start_dirty_tracking().unwrap();
    let too_many = (DIRTY_BITMAP_PAGES_MAX + 1) * PAGE;
    let e = d.get_and_clear_dirty(Iova(0), too_many, PAGE).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    let e = d
        .get_and_clear_dirty(Iova(0), u64::MAX - PAGE + 1, PAGE)
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    // Into a caller's buffer: too small is EINVAL; words past the range are left alone.
    d.dma_write(Iova(PAGE), &[1]).unwrap();
    let mut out = [u64::MAX; 2];
    let e = d
        .get_and_clear_dirty_into(Iova(0), 128 * PAGE, PAGE, &mut out[..1])
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
    d.get_and_clear_dirty_into(Iova(0), 16 * PAGE, PAGE, &mut out[..1])
        .unwrap();
    assert_eq!(out, [0b10, u64::MAX]);
    // A mapping too large to track is refused when tracking would need its bitmap.
    let huge = (DIRTY_BITMAP_PAGES_MAX + 1) * PAGE;
    // SAFETY: the mapping is never translated or copied from; only its bitmap is asked for.
    let e =
        unsafe { d.map_raw(Iova(1 << 50), memvisor::Hva(1 << 46), huge, Prot::RW) }.unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");
}

/// A pre-copy migration against live devices, checked the way a migration is judged: by the
/// bytes that arrive. The migration thread copies all of guest memory to a destination, then,
/// round after round, reads and clears the log and copies the pages it reports, while device
/// threads pin pages (with any protection), write through the pins and unpin, or `dma_write`.
/// After the devices stop, one last round. The destination must then equal the source: a write
/// the log missed, or reported before the write was done and not again, leaves a page behind.
#[test]
fn a_migration_loop_leaves_the_destination_equal_to_the_source() {
    let _s = serial();
    const PAGES: u64 = 8192; // 32 MiB in four mappings
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, PAGES * PAGE).unwrap());
    let d = space();
    for i in 0..4 {
        let len = PAGES / 4 * PAGE;
        d.map_backing(Iova(i * len), &b, i * len, len, Prot::RW)
            .unwrap();
    }
    d.start_dirty_tracking().unwrap();
    let mut dest = vec![0u8; (PAGES * PAGE) as usize];
    b.read(0, &mut dest).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let devices: Vec<_> = (0..2u64)
        .map(|id| {
            let (d, stop, rounds) = (d.clone(), stop.clone(), rounds.clone());
            thread::spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ id;
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) || ops < 500 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let page = x % (PAGES - 4);
                    if x >> 60 < 12 {
                        let n = (x >> 20) % 4 + 1;
                        let pages: Vec<u64> = (page..page + n).collect();
                        let prot = [Prot::READ, Prot::WRITE, Prot::RW][(x >> 30) as usize % 3];
                        let hvas = d.pin_pages(&pages, prot).unwrap();
                        // Hold the pin across a round before writing: the write then comes
                        // after a read that saw the page pinned, the case a log that reports
                        // pins only at read time gets wrong.
                        let seen = rounds.load(Ordering::SeqCst);
                        for _ in 0..10_000 {
                            if rounds.load(Ordering::SeqCst) > seen || stop.load(Ordering::Relaxed)
                            {
                                break;
                            }
                            thread::yield_now();
                        }
                        for hva in &hvas {
                            // SAFETY: the page is pinned in a live mapping of our backing; a
                            // device writes it through the host address pin_pages returned.
                            unsafe { (hva.0 as *mut u64).write_volatile(x ^ hva.0) };
                        }
                        d.unpin_pages(&pages).unwrap();
                    } else {
                        d.dma_write(Iova(page * PAGE + 8), &x.to_le_bytes())
                            .unwrap();
                    }
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let round = |dest: &mut [u8]| {
        for p in read(&d, PAGES) {
            let at = (p * PAGE) as usize;
            b.read(p * PAGE, &mut dest[at..at + PAGE as usize]).unwrap();
        }
        rounds.fetch_add(1, Ordering::SeqCst);
    };
    for _ in 0..300 {
        round(&mut dest);
        thread::yield_now();
    }
    stop.store(true, Ordering::Relaxed);
    let ops: u64 = devices.into_iter().map(|t| t.join().unwrap()).sum();
    round(&mut dest); // the final round, devices stopped
    let mut source = vec![0u8; dest.len()];
    b.read(0, &mut source).unwrap();
    let stale: Vec<usize> = (0..PAGES as usize)
        .filter(|&p| {
            let r = p * PAGE as usize..(p + 1) * PAGE as usize;
            source[r.clone()] != dest[r]
        })
        .collect();
    assert!(
        stale.is_empty(),
        "{} pages differ between source and destination after 301 rounds and {ops} device \
         operations, e.g. {:?}",
        stale.len(),
        &stale[..stale.len().min(8)]
    );
    assert_eq!(d.device_pinned_pages(), 0);
}

/// A guest range mapped from THP memory at an offset inside a huge page: pins lock whole huge
/// pages of the backing, dirty bits are exactly the 4 KiB pages used.
#[test]
fn map_guest_pieces_inside_huge_pages_pin_and_log_in_the_right_units() {
    let _s = serial();
    let b = Arc::new(
        Backing::with_options(
            BackingKind::Thp,
            8 * MIB,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let slots = SlotTable::new();
    slots
        .insert(SlotSpec::new(0, Gpa(1 << 30), b.clone()))
        .unwrap();
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    // 3 MiB of guest memory starting 12 KiB into the second huge page.
    let gpa = Gpa((1 << 30) + 2 * MIB + 3 * PAGE);
    d.map_guest(Iova(0), &slots.snapshot(), gpa, 3 * MIB, Prot::RW)
        .unwrap();
    d.start_dirty_tracking().unwrap();
    // IOVA page 0 is backing page 515; IOVA page 509 is backing page 1024, the first of the
    // third huge page.
    d.pin_pages(&[0, 509], Prot::WRITE).unwrap();
    assert_eq!(registry.locked_bytes(), 4 * MIB, "two whole huge pages");
    d.dma_write(Iova(700 * PAGE + 5), &[1; 10]).unwrap();
    assert_eq!(read(&d, 768), vec![0, 509, 700]);
    assert_eq!(read(&d, 768), vec![0, 509]);
    d.unpin_pages(&[0, 509]).unwrap();
    assert_eq!(registry.locked_bytes(), 0);
}

/// The pages `drain_dirty` hands over for `[iova, iova + pages)`, sorted, each once.
fn drained(d: &DmaSpace, iova: u64, pages: u64) -> Vec<u64> {
    let mut out = std::collections::BTreeSet::new();
    d.drain_dirty(Iova(iova * PAGE), pages * PAGE, PAGE, |first, mut bits| {
        while bits != 0 {
            let p = first + u64::from(bits.trailing_zeros());
            assert!(p < pages, "page {p} is past the range");
            out.insert(p);
            bits &= bits - 1;
        }
    })
    .unwrap();
    out.into_iter().collect()
}

#[test]
fn drain_dirty_reports_what_get_and_clear_dirty_does_writes_pins_and_all_mapped() {
    let _s = serial();
    // Mappings at page offsets that are not multiples of 64, with holes between them.
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 1024 * PAGE).unwrap());
    let d = space();
    for (at, len) in [(3, 5), (70, 200), (300, 700)] {
        d.map_backing(Iova(at * PAGE), &b, at * PAGE, len * PAGE, Prot::RW)
            .unwrap();
    }
    // Arguments and tracking are checked before any call.
    let e = d
        .drain_dirty(Iova(0), 1024 * PAGE, PAGE, |_, _| {})
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "tracking off: {e}");
    d.start_dirty_tracking().unwrap();
    let e = d
        .drain_dirty(Iova(0), 4 * PAGE, PAGE, |_, _| {})
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "cuts a mapping: {e}");
    let e = d
        .drain_dirty(Iova(0), 1024 * PAGE, 2 * MIB, |_, _| {})
        .unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "page size: {e}");
    d.pin_pages(&[100], Prot::READ).unwrap();
    let write = |pages: &[u64]| {
        for &p in pages {
            d.dma_write(Iova(p * PAGE + 8), &[7; 8]).unwrap();
        }
    };
    let writes = [3, 7, 70, 133, 134, 269, 300, 363, 364, 999];
    let mut want: Vec<u64> = writes.iter().chain(&[100]).copied().collect();
    want.sort();
    write(&writes);
    let dense = read(&d, 1000);
    assert_eq!(dense, want);
    write(&writes);
    assert_eq!(drained(&d, 0, 1000), dense);
    // The pinned page stays dirty; the writes were cleared.
    assert_eq!(drained(&d, 0, 1000), vec![100]);
    assert_eq!(read(&d, 1000), vec![100]);
    // A range that starts inside the space: pages count from its start.
    write(&[333]);
    assert_eq!(drained(&d, 300, 700), vec![33]);
    d.unpin_pages(&[100]).unwrap();
    assert_eq!(drained(&d, 0, 1000), vec![100]);
    assert_eq!(drained(&d, 0, 1000), Vec::<u64>::new());
    // All-mapped scope: every mapped page, by either read.
    let all: Vec<u64> = (3..8).chain(70..270).chain(300..1000).collect();
    let dev = d.attach_unlogged_device();
    assert_eq!(drained(&d, 0, 1000), all);
    assert_eq!(read(&d, 1000), all);
    drop(dev);
    assert_eq!(drained(&d, 0, 1000), all);
    assert_eq!(drained(&d, 0, 1000), Vec::<u64>::new());
}
