//! No host limit on locked memory reaches the guest (issue 45): a blk device under an
//! `RLIMIT_MEMLOCK` far below one request, without `CAP_IPC_LOCK`, serves batches of large
//! writes and reads with every status OK and every byte right, queue after queue of them.
//!
//! The limit is the process's, so this file is its own test binary with this one test: nothing
//! else runs beside it. `CAP_IPC_LOCK` is per thread: the test thread drops it before it starts
//! the back end's thread, which inherits the smaller set.

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::{Blk, BlkOptions};

const PAGE: u64 = 4096;
/// The limit: 16 pages, a sixteenth of one request below.
const LIMIT: u64 = 64 << 10;
/// Bytes per request: 64 pages, what a guest's 256 KiB O_DIRECT write sends.
const REQ: u32 = 256 << 10;
/// Requests posted together (3 descriptors each in a 16-entry ring).
const N: u16 = 5;
const HDR: u64 = 0x10000;
const STATUS: u64 = 0x11000;
const OUT: u64 = 0x100000;
const IN: u64 = 0x280000;

/// This process's locked memory (`VmLck`), in bytes.
fn vm_lck() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .expect("VmLck in /proc/self/status");
    kib * 1024
}

/// The bytes of request `k` in round `round`.
fn pattern(round: u32, k: u16) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (u64::from(round) << 20) ^ u64::from(k);
    (0..REQ / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

/// Posts `N` requests of `kind` (0 read, 1 write) before one kick, request `k` at sector
/// `sector(k)` with its data at `data + k * REQ`; waits for all and returns their statuses.
fn batch(g: &mut Guest, kind: u32, sector: impl Fn(u16) -> u64, data: u64) -> Vec<u8> {
    for k in 0..N {
        let at = data + u64::from(k) * u64::from(REQ);
        let hdr = HDR + u64::from(k) * 16;
        g.add_request(k, kind, sector(k), hdr, at, REQ, STATUS + u64::from(k));
    }
    g.kick_and_wait(N, STATUS)
}

#[test]
fn requests_far_past_the_locked_memory_limit_all_succeed_with_their_data() {
    if !drop_ipc_lock() {
        eprintln!("(no CAP_IPC_LOCK to drop: running under the process's own rlimit)");
    }
    set_memlock(LIMIT);
    let before = vm_lck();
    let disk = memfd(16 * MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    const ROUNDS: u32 = 8;
    let sectors_per_req = u64::from(REQ) / 512;
    for round in 0..ROUNDS {
        // N writes of 256 KiB at once, each 16 times the limit, then N reads back into other
        // buffers: every one OK, and the queue goes on to the next round.
        let at = |k: u16| (u64::from(round) * u64::from(N) + u64::from(k)) % 48 * sectors_per_req;
        for k in 0..N {
            g.mem
                .write(Gpa(OUT + u64::from(k) * u64::from(REQ)), &pattern(round, k))
                .unwrap();
        }
        assert_eq!(
            batch(&mut g, 1, at, OUT),
            vec![0; N as usize],
            "round {round}: writes"
        );
        assert_eq!(
            batch(&mut g, 0, at, IN),
            vec![0; N as usize],
            "round {round}: reads"
        );
        for k in 0..N {
            let want = pattern(round, k);
            let mut got = vec![0u8; REQ as usize];
            g.mem
                .read(Gpa(IN + u64::from(k) * u64::from(REQ)), &mut got)
                .unwrap();
            assert!(
                got == want,
                "round {round}: read {k} brought back its write"
            );
            disk.read_exact_at(&mut got, at(k) * 512).unwrap();
            assert!(got == want, "round {round}: write {k} is on the image");
        }
        assert_eq!(vm_lck(), before, "round {round}: the device locked memory");
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!(
        (s.writes, s.reads, s.failed, s.pin_errors),
        (
            u64::from(ROUNDS * u32::from(N)),
            u64::from(ROUNDS * u32::from(N)),
            0,
            0
        )
    );
    assert!(
        s.most_pinned_pages * PAGE > LIMIT,
        "the requests held {} pages at most: not past the limit, the test proves nothing",
        s.most_pinned_pages
    );
    assert_eq!(s.pinned_pages, 0, "holds left behind");
    assert_eq!(backend.memory().dma().device_pinned_pages(), 0);
}
