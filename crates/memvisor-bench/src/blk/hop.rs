//! The process hop: what it costs one thread to wake another that sleeps, on this machine —
//! the physical limit under every queue-depth-1 row of `memvisor bench blk`.
//!
//! **Model.** At queue depth 1 the limit row is one process that submits a request and sleeps
//! until it ends. Any back end in another process adds two hops to that: the client's kick
//! wakes the back end, and the back end's call wakes the client. Each hop is a write into a
//! descriptor the other side sleeps on, then the other side's wake-up — on a VM, a halted vCPU
//! brought back through the hypervisor. [`measure`] times it: two threads pass a byte back and
//! forth over a socket pair, each sleeping in a blocking read, and the same pair spinning on
//! an atomic instead (the hop when neither side sleeps: what polling on both sides approaches).
//! [`ceiling`] turns the sleeping hop into the most a back end that added nothing but those two
//! hops could reach at depth 1: the limit's time per request over that time plus two hops.
//! A row under its ceiling has work of its own to lose; a row at its ceiling has only the hops
//! left, which no back end removes without spinning. [`table`] sets both beside each QD1 row's
//! memvisor / limit.
//!
//! Threads, not processes: the wake-up is the scheduler's either way (a C ping-pong over
//! eventfds measured both on the project's machine on 2026-11-29, 19-30 µs a round trip for
//! each, inside the noise of each other), and threads need no second program.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use super::{CASES, Image, LIMIT, MEMVISOR, PerServer, Row, Stats, Table};

/// What one measurement found: the one-way hop, in nanoseconds, of each kind (the best batch).
#[derive(Clone, Copy, Debug)]
pub(super) struct Hops {
    /// Both sides sleep in a blocking read between messages.
    pub sleeping_ns: f64,
    /// Both sides spin on a shared counter.
    pub spinning_ns: f64,
}

/// Round trips per batch, and batches per measurement. The best batch is kept: the hop itself,
/// not whatever else ran on the machine's cores meanwhile (a spinning pair with a third task on
/// 2 cores waits for time slices), so the ceiling made from it is an upper bound.
const ROUND_TRIPS: u32 = 1000;
const BATCHES: usize = 9;

/// Measures both hops: the best of [`BATCHES`] batches of [`ROUND_TRIPS`] round trips, halved. `None` when the socket pair or the thread cannot be made.
pub(super) fn measure() -> Option<Hops> {
    let mut sleeping = Vec::with_capacity(BATCHES);
    let mut spinning = Vec::with_capacity(BATCHES);
    for _ in 0..BATCHES {
        sleeping.push(sleeping_round_trips(ROUND_TRIPS)? / f64::from(2 * ROUND_TRIPS));
        spinning.push(spinning_round_trips(ROUND_TRIPS)? / f64::from(2 * ROUND_TRIPS));
    }
    Some(Hops {
        sleeping_ns: best(&sleeping),
        spinning_ns: best(&spinning),
    })
}

/// The most a back end adding only two hops of `hop_ns` could reach at queue depth 1, as a
/// share of a limit making `limit_ops` requests a second one at a time.
pub(super) fn ceiling(limit_ops: f64, hop_ns: f64) -> f64 {
    let per_request = 1e9 / limit_ops;
    per_request / (per_request + 2.0 * hop_ns)
}

/// The process hop and what it leaves of each QD1 row: the hop's medians over the rounds, and
/// per QD1 row the limit's time per request, the ceiling two sleeping hops leave a back end
/// in another process ([`ceiling`]), and memvisor against the limit beside it. Pushes the
/// JSON rows of the hops and ceilings.
pub(super) fn table(
    samples: &[Vec<PerServer>],
    images: &[&Image],
    hops: &[Hops],
    rows: &mut Vec<Row>,
) -> Table {
    let sleeping = Stats::from_samples(&hops.iter().map(|h| h.sleeping_ns).collect::<Vec<_>>());
    let spinning = Stats::from_samples(&hops.iter().map(|h| h.spinning_ns).collect::<Vec<_>>());
    for (variant, st) in [("sleeping", &sleeping), ("spinning", &spinning)] {
        rows.push(Row::new("blk", "process hop", variant, "hop", "ns", st));
    }
    let mut t = Table::new(
        &format!(
            "QD1 and the process hop: one thread waking another costs {:.1} µs sleeping, {:.2} µs \
             spinning (each round's best batch, median of {} rounds); a back end in another process adds two hops to \
             each QD1 request",
            sleeping.median / 1e3,
            spinning.median / 1e3,
            hops.len()
        ),
        &[
            "case",
            "limit µs per request",
            "ceiling with two sleeping hops",
            "memvisor / limit",
        ],
    );
    for (m, mode) in ["page cache", "O_DIRECT"].into_iter().enumerate() {
        for (i, image) in images.iter().enumerate() {
            for (c, case) in CASES.iter().enumerate() {
                if case.depth != 1 || case.queues != 1 {
                    continue;
                }
                let ops =
                    |s: usize| -> Vec<f64> { samples[m][i][s][c].iter().map(|x| x.ops).collect() };
                let (limit, mv) = (ops(LIMIT), ops(MEMVISOR));
                if limit.is_empty() {
                    continue;
                }
                let limit_ops = Stats::from_samples(&limit).median;
                let ceiling = ceiling(limit_ops, sleeping.median);
                let name = format!("{} {} {mode}", case.name, image.label);
                let st = Stats::from_samples(&[ceiling]);
                rows.push(Row::new(
                    "blk",
                    &name,
                    "two sleeping hops",
                    "hop ceiling",
                    "x",
                    &st,
                ));
                let ratio =
                    super::ratio_of(&mv, &limit, limit.len() as u32).unwrap_or_else(|| "-".into());
                t.push(vec![
                    name,
                    format!("{:.1}", 1e6 / limit_ops),
                    format!("{ceiling:.2}x"),
                    ratio,
                ]);
            }
        }
    }
    t.note = Some(
        "The hop: two threads pass a byte back and forth over a socket pair, each sleeping in a \
         blocking read (sleeping), or both spinning on one counter (spinning); the best of 9 \
         batches of 1,000 round trips, halved, measured before each round's rows (the best, so \
         that the ceiling is an upper bound). Ceiling: the \
         limit's time per request over that time plus two sleeping hops (the client's kick \
         waking the back end, the back end's call waking the client), the most a back end that \
         added nothing else could reach; polling (--poll-us) turns the kick's hop into a \
         spinning one where a core is free."
            .into(),
    );
    t
}

fn best(v: &[f64]) -> f64 {
    v.iter().copied().fold(f64::INFINITY, f64::min)
}

/// `n` round trips of one byte between this thread and a peer, both sleeping in a blocking
/// read; the wall time in nanoseconds.
fn sleeping_round_trips(n: u32) -> Option<f64> {
    let (mut here, mut there) = UnixStream::pair().ok()?;
    let peer = std::thread::Builder::new()
        .name("hop-peer".into())
        .spawn(move || {
            let mut b = [0u8; 1];
            for _ in 0..n {
                if there.read_exact(&mut b).is_err() || there.write_all(&b).is_err() {
                    return;
                }
            }
        })
        .ok()?;
    let mut b = [0u8; 1];
    let t0 = Instant::now();
    for _ in 0..n {
        here.write_all(&b).ok()?;
        here.read_exact(&mut b).ok()?;
    }
    let ns = t0.elapsed().as_nanos() as f64;
    peer.join().ok()?;
    Some(ns)
}

/// `n` round trips between this thread and a peer spinning on one counter (odd: the peer's
/// turn; even: ours); the wall time in nanoseconds.
fn spinning_round_trips(n: u32) -> Option<f64> {
    let turn = Arc::new(AtomicU64::new(0));
    let theirs = turn.clone();
    let peer = std::thread::Builder::new()
        .name("hop-peer".into())
        .spawn(move || {
            for i in 0..u64::from(n) {
                while theirs.load(Ordering::Acquire) != 2 * i + 1 {
                    std::hint::spin_loop();
                }
                theirs.store(2 * i + 2, Ordering::Release);
            }
        })
        .ok()?;
    let t0 = Instant::now();
    for i in 0..u64::from(n) {
        turn.store(2 * i + 1, Ordering::Release);
        while turn.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
    }
    let ns = t0.elapsed().as_nanos() as f64;
    peer.join().ok()?;
    Some(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_is_the_limits_time_over_that_time_and_two_hops() {
        // 20,000 requests a second: 50 µs each; two hops of 12.5 µs make 75 µs: 2/3.
        assert!((ceiling(20_000.0, 12_500.0) - 2.0 / 3.0).abs() < 1e-12);
        // No hop: the limit itself.
        assert_eq!(ceiling(20_000.0, 0.0), 1.0);
    }

    #[test]
    fn both_hops_are_measured() {
        let h = measure().expect("a socket pair and a thread");
        // No ordering between them is asserted: on one core, or a loaded machine, a spinning
        // peer waits for its time slice and can cost more than a sleeping one.
        assert!(h.sleeping_ns.is_finite() && h.sleeping_ns > 0.0, "{h:?}");
        assert!(h.spinning_ns.is_finite() && h.spinning_ns > 0.0, "{h:?}");
    }
}
