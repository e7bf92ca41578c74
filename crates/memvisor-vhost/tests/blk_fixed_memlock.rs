//! `fixed_buffers` under a locked-memory limit: without `CAP_IPC_LOCK` and with
//! `RLIMIT_MEMLOCK` at 8 MiB (systemd's default, CI's unprivileged run), a guest whose requests
//! touch 28 MiB of memory gets at most 4 chunks registered; every other transfer goes the
//! ordinary way, counted as a fallback, and every request succeeds with its data.
//!
//! The limit is the process's, so this file is its own test binary with this one test.

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use memvisor::Gpa;
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::{Blk, BlkOptions};

const LIMIT: u64 = 8 << 20;
const CHUNK: u64 = 2 << 20;
/// Requests posted together (3 descriptors each in a 16-entry ring).
const N: u16 = 5;
const LEN: u32 = 64 << 10;
const HDR: u64 = 0x10000;
const STATUS: u64 = 0x11000;

/// Features without dirty logging, protocol features, the memory table, the ring.
fn connect(c: &Client, g: &Guest) {
    negotiate_without(c, g, F_LOG_ALL);
    start_ring(c, g);
}

/// Guest address of request `k` of batch `b`: chunk `2 + 5b + k` (chunks 2 to 15), 8 KiB in.
fn data_at(b: u64, k: u16) -> u64 {
    (2 + 5 * b + u64::from(k)) % 14 * CHUNK + 2 * CHUNK + 8192
}

#[test]
fn past_the_locked_memory_limit_fixed_transfers_fall_back_and_all_succeed() {
    if !drop_ipc_lock() {
        eprintln!("(no CAP_IPC_LOCK to drop: running under the process's own rlimit)");
    }
    set_memlock(LIMIT);
    let disk = memfd(16 * MIB);
    let seed: Vec<u8> = (0..16 * MIB as u32).map(|i| (i * 13 % 251) as u8).collect();
    disk.write_all_at(&seed, 0).unwrap();
    let mut g = Guest::new(32 * MIB);
    let options = BlkOptions {
        fixed_buffers: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), options).unwrap());
    connect(&c, &g);
    for round in 0..4u64 {
        for b in 0..3u64 {
            let sector = |k: u16| (round * 131 + b * 17 + u64::from(k) * 29) % 200 * 128;
            for k in 0..N {
                let hdr = HDR + u64::from(k) * 16;
                g.add_request(
                    k,
                    0,
                    sector(k),
                    hdr,
                    data_at(b, k),
                    LEN,
                    STATUS + u64::from(k),
                );
            }
            let statuses = g.kick_and_wait(N, STATUS);
            for k in 0..N {
                assert_eq!(
                    statuses[usize::from(k)],
                    0,
                    "round {round} batch {b} request {k}: status"
                );
                let mut got = vec![0u8; LEN as usize];
                g.mem.read(Gpa(data_at(b, k)), &mut got).unwrap();
                let at = (sector(k) * 512) as usize;
                assert!(
                    got[..] == seed[at..at + LEN as usize],
                    "round {round} batch {b} request {k}: the bytes read"
                );
            }
        }
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    println!(
        "fixed {} fallbacks {} ordinary {} chunks {}",
        s.fixed, s.fixed_fallbacks, s.fixed_ordinary, s.chunks_registered
    );
    assert_eq!((s.failed, s.pin_errors), (0, 0));
    assert!(
        s.chunks_registered * CHUNK <= LIMIT,
        "{} chunks registered under an {LIMIT}-byte limit",
        s.chunks_registered
    );
    assert!(
        s.fixed_fallbacks > 0,
        "14 chunks of 2 MiB went through an 8 MiB limit with no fallback: {s:?}"
    );
}
