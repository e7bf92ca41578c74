//! Devices pinning, copying and translating in a range while another thread takes it away and
//! maps it again, round after round: no unmap fails, and nothing reaches memory once it is gone.
//!
//! Two windows of one backing take turns behind the same IOVAs. Each round maps one window (as
//! two mappings, so that some copies cross from one to the other),
//! lets the devices run on it, then takes it away (an unmap, or an IOTLB invalidation, in turn)
//! and, the moment that returns, fills the window with a guard byte no device ever writes.
//! Before the window is mapped again, two rounds later, it must still hold nothing but guard
//! bytes: a device write that landed after the unmap returned would have overwritten some. A
//! device read that returns guard bytes read the window after its unmap returned. Every few
//! hundred rounds the devices pause, and the pin registry's count of locked memory must equal
//! what the kernel shows as `VmLck`.
//!
//! This file holds one test so the process's `VmLck` is this test's alone.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread;

use memvisor::dma::{LockLimit, PinRegistry, read_pinned, write_pinned};
use memvisor::{Backing, BackingKind, DmaConfig, DmaSpace, Iova, Prot};

mod common;

const PAGE: u64 = 4096;
/// Pages of one window, mapped at IOVA 0.
const PAGES: u64 = 4;
const WINDOW: u64 = PAGES * PAGE;
const ROUNDS: u64 = 100_000;
/// Devices pause this often for the `VmLck` check.
const CHECK_EVERY: u64 = 500;
const DEVICES: usize = 1;
/// The byte devices write; the window starts each mapping as zeros.
const WRITTEN: u8 = 0x5a;
/// The byte the window is filled with once it is taken away.
const GUARD: u8 = 0xee;
/// Bytes per device access, but for the copies across the two mappings.
const PIECE: usize = 64;
/// Where those copies start: half a page before the second mapping.
const ACROSS: u64 = WINDOW / 2 - PAGE / 2;

/// Fails on the guard byte (a read after the unmap returned) or anything no one wrote.
fn check_read(what: &str, round: u64, iova: u64, bytes: &[u8]) {
    for &b in bytes {
        assert!(
            b == 0 || b == WRITTEN,
            "{what} at iova {iova:#x} in round {round} read {b:#x}: {}",
            if b == GUARD {
                "the guard, written after the unmap returned"
            } else {
                "bytes no one wrote"
            }
        );
    }
}

/// Fails unless `r` is Ok or the answer for a hole (the range is being taken away).
fn allowed<T>(what: &str, r: memvisor::Result<T>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) if e.errno() == libc::EINVAL || e.errno() == libc::EFAULT => None,
        Err(e) => panic!("{what}: {e} (errno {}) is not a hole's answer", e.errno()),
    }
}

/// One device: pins a page and copies through it, copies with `dma_read` / `dma_write` and
/// through a cursor, and translates, in turn, until `stop`.
fn device(d: DmaSpace, n: usize, state: Arc<State>) {
    let mut cursor = d.cursor();
    let mut x = n as u64 * 7919 + 1;
    let mut buf = [0u8; PIECE];
    let written = [WRITTEN; PAGE as usize];
    let mut across = [0u8; PAGE as usize];
    while !state.stop.load(Ordering::Acquire) {
        if state.pause.load(Ordering::Acquire) {
            state.paused.fetch_add(1, Ordering::AcqRel);
            while state.pause.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            state.paused.fetch_sub(1, Ordering::AcqRel);
            cursor.refresh();
            continue;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let round = state.round.load(Ordering::Acquire);
        let iova = (x % (WINDOW - PIECE as u64)) & !7;
        match x % 5 {
            0 => {
                let page = iova / PAGE;
                if let Some(hvas) = allowed("pin_pages", d.pin_pages(&[page], Prot::RW)) {
                    let hva = memvisor::Hva(hvas[0].0 + (iova % PAGE).min(PAGE - PIECE as u64));
                    // SAFETY: the page is pinned (read and write) until the unpin below.
                    unsafe { read_pinned(hva, &mut buf) };
                    check_read("a pinned read", round, iova, &buf);
                    // SAFETY: as above.
                    unsafe { write_pinned(&[WRITTEN; PIECE], hva) };
                    d.unpin_pages(&[page]).unwrap();
                }
            }
            // Copies across the two mappings of the window: never a thread's last hit, so each
            // takes the path that checks a snapshot, and long enough that one is often running
            // when an unmap starts.
            1 => {
                allowed("dma_write", d.dma_write(Iova(ACROSS), &written));
            }
            2 => {
                if allowed("dma_read", d.dma_read(Iova(ACROSS), &mut across)).is_some() {
                    check_read("dma_read", round, ACROSS, &across);
                }
            }
            3 => {
                allowed("cursor write", cursor.write(Iova(iova), &[WRITTEN; PIECE]));
                if allowed("cursor read", cursor.read(Iova(iova), &mut buf)).is_some() {
                    check_read("a cursor read", round, iova, &buf);
                }
            }
            _ => {
                allowed("translate", d.translate(Iova(iova), 1, Prot::WRITE));
            }
        }
        state.ops.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Default)]
struct State {
    stop: AtomicBool,
    pause: AtomicBool,
    paused: AtomicUsize,
    round: AtomicU64,
    ops: AtomicU64,
}

#[test]
fn no_unmap_fails_and_nothing_reaches_memory_after_it_returns() {
    // At most two windows' pages are pinned at once; with the lock cache, a little more.
    if !common::may_lock(4 * WINDOW + (1 << 20), "the unmap race") {
        return;
    }
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let d = DmaSpace::new(DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    let notified = Arc::new(AtomicU64::new(0));
    let n = notified.clone();
    d.add_unmap_notifier(move |_, _| {
        n.fetch_add(1, Ordering::Relaxed);
    });
    let b = Arc::new(Backing::new(BackingKind::Memfd, 2 * WINDOW).unwrap());
    b.write(0, &[GUARD; 2 * WINDOW as usize]).unwrap();
    let state = Arc::new(State::default());
    let devices: Vec<_> = (0..DEVICES)
        .map(|i| {
            let (d, s) = (d.clone(), state.clone());
            thread::spawn(move || device(d, i, s))
        })
        .collect();

    let mut window = vec![0u8; WINDOW as usize];
    let baseline = common::vm_lck();
    for round in 0..ROUNDS {
        let at = (round % 2) * WINDOW;
        b.read(at, &mut window).unwrap();
        assert!(
            window.iter().all(|&x| x == GUARD),
            "round {round}: a device wrote window {} after it was taken away two rounds ago",
            round % 2
        );
        b.write(at, &vec![0u8; WINDOW as usize]).unwrap();
        state.round.store(round, Ordering::Release);
        // Two mappings, so copies can cross from one to the other.
        let half = WINDOW / 2;
        d.map_backing(Iova(0), &b, at, half, Prot::RW).unwrap();
        d.map_backing(Iova(half), &b, at + half, half, Prot::RW)
            .unwrap();
        // Let the devices at it for a moment.
        let until = state.ops.load(Ordering::Relaxed) + 8;
        while state.ops.load(Ordering::Relaxed) < until {
            thread::yield_now();
        }
        let gone = match round % 2 {
            0 => d.unmap(Iova(0), WINDOW),
            _ => d.invalidate_range(Iova(0), WINDOW),
        };
        assert_eq!(
            gone.unwrap(),
            WINDOW,
            "round {round}: the unmap must succeed"
        );
        b.write(at, &window_of(GUARD)).unwrap();

        if round % CHECK_EVERY == CHECK_EVERY - 1 {
            state.pause.store(true, Ordering::Release);
            while state.paused.load(Ordering::Acquire) < DEVICES {
                thread::yield_now();
            }
            assert_eq!(d.device_pinned_pages(), 0, "round {round}");
            assert_eq!(
                registry.locked_bytes() + registry.cached_bytes(),
                common::vm_lck() - baseline,
                "round {round}: the registry and VmLck disagree"
            );
            state.pause.store(false, Ordering::Release);
        }
    }
    state.stop.store(true, Ordering::Release);
    for t in devices {
        t.join().unwrap();
    }
    let ops = state.ops.load(Ordering::Relaxed);
    println!(
        "{ROUNDS} rounds, {ops} device operations, {} unmap notifications",
        notified.load(Ordering::Relaxed)
    );
    assert!(ops > ROUNDS * 8, "the devices ran");
    assert_eq!(registry.locked_bytes(), 0);
}

fn window_of(byte: u8) -> Vec<u8> {
    vec![byte; WINDOW as usize]
}
