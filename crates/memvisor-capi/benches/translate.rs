//! The Rust half of the side-by-side translate benchmark (c/bench/run.sh): the same mappings
//! and the same address sequence as c/bench/translate.c, through `DmaSpace::translate` and a
//! `DmaCursor`, so the C API's figures stand beside what a Rust caller pays.
//!
//! N mappings of one 4 KiB page each (IOVA 2*i pages; host page i*7919 % N), 64-byte reads at
//! addresses from xorshift64 with the C file's seed. Each run times `--iters` translations
//! after one untimed pass, in the thread's CPU time; the median of `--runs` runs, ns per translation. Every answer is
//! checked once before the runs. Output lines: `N variant median min max`.

use std::hint::black_box;
use std::sync::Arc;

use memvisor::{Backing, BackingKind, DmaConfig, DmaSpace, Iova, Prot};

const PAGE: u64 = 4096;
const NADDR: usize = 1 << 16;
const ACCESS: u64 = 64;

/// The C file's `addresses`: (iova, mapping) pairs.
fn addresses(n: u64) -> Vec<(u64, u64)> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..NADDR)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let m = x % n;
            let off = (x >> 32) % (PAGE - ACCESS);
            (2 * m * PAGE + off, m)
        })
        .collect()
}

/// The thread's CPU time in ns (CLOCK_THREAD_CPUTIME_ID, as the C half): on a shared machine
/// the wall clock counts the time other processes had the core.
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn host_page(i: u64, n: u64) -> u64 {
    i * 7919 % n
}

fn report(n: u64, name: &str, runs: usize, mut run: impl FnMut() -> f64) {
    run();
    let mut t: Vec<f64> = (0..runs).map(|_| run()).collect();
    t.sort_by(f64::total_cmp);
    println!(
        "{n} {name} {:.2} {:.2} {:.2}",
        t[runs / 2],
        t[0],
        t[runs - 1]
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (mut runs, mut iters) = (5usize, 2_000_000u64);
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--runs" => runs = args.get(i + 1).ok_or("--runs N")?.parse()?,
            "--iters" => iters = args.get(i + 1).ok_or("--iters N")?.parse()?,
            "--bench" => {
                i += 1;
                continue;
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
        i += 2;
    }
    if runs == 0 || iters == 0 {
        return Err("--runs and --iters must be at least 1".into());
    }
    for n in [64u64, 1000, 100_000] {
        let addrs = addresses(n);
        let ram = Arc::new(Backing::new(BackingKind::PrivateAnon, n * PAGE)?);
        let dma = DmaSpace::new(DmaConfig {
            max_mappings: n.max(65535) as u32,
            ..DmaConfig::default()
        })?;
        for i in 0..n {
            dma.map_backing(
                Iova(2 * i * PAGE),
                &ram,
                host_page(i, n) * PAGE,
                PAGE,
                Prot::RW,
            )?;
        }
        let mut cursor = dma.cursor();
        let base = ram.hva().raw();
        for &(iova, m) in &addrs {
            let want = base + host_page(m, n) * PAGE + iova % PAGE;
            let a = dma.translate(Iova(iova), ACCESS, Prot::READ)?.hva.raw();
            let b = cursor.translate(Iova(iova), ACCESS, Prot::READ)?.hva.raw();
            assert!(a == want && b == want, "{iova:#x} translated wrongly");
        }
        let mask = NADDR as u64 - 1;
        report(n, "rust_DmaSpace::translate", runs, || {
            let start = now_ns();
            for i in 0..iters {
                let iova = addrs[(i & mask) as usize].0;
                let t = dma.translate(Iova(iova), ACCESS, Prot::READ).unwrap();
                black_box(t.hva);
            }
            (now_ns() - start) as f64 / iters as f64
        });
        report(n, "rust_DmaCursor::translate", runs, || {
            let start = now_ns();
            for i in 0..iters {
                let iova = addrs[(i & mask) as usize].0;
                let t = cursor.translate(Iova(iova), ACCESS, Prot::READ).unwrap();
                black_box(t.hva);
            }
            (now_ns() - start) as f64 / iters as f64
        });
        // The same call behind a function the optimiser may not inline, as a C caller meets
        // it: the figure a caller in another crate or language compares with.
        report(n, "rust_DmaCursor::translate_not_inlined", runs, || {
            let start = now_ns();
            for i in 0..iters {
                let iova = addrs[(i & mask) as usize].0;
                black_box(cursor_translate(&mut cursor, iova));
            }
            (now_ns() - start) as f64 / iters as f64
        });
    }
    Ok(())
}

#[inline(never)]
fn cursor_translate(cursor: &mut memvisor::DmaCursor, iova: u64) -> u64 {
    cursor
        .translate(Iova(iova), ACCESS, Prot::READ)
        .map_or(0, |t| t.hva.raw())
}
