//! `fixed_buffers` through the whole vhost-user path: the same batches of reads and writes,
//! served once the ordinary way (hold + `READV`/`WRITEV`) and once through registered chunks
//! (`READ_FIXED`/`WRITE_FIXED`), leave the same bytes in guest memory and on the image, with
//! every status OK; the fixed run did go fixed (counted), the ordinary one did not. And a new
//! memory table empties the registered slots (the kernel's own listing says so).

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use memvisor::Gpa;
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::{Blk, BlkOptions, BlkStats};

/// Requests posted together (3 descriptors each in a 16-entry ring).
const N: u16 = 5;
const HDR: u64 = 0x10000;
const STATUS: u64 = 0x11000;
/// Data buffers: spread over the guest's 2 MiB chunks, some at a chunk's end.
const DATA: u64 = 0x100000;

/// Buffer of request `k` in round `round`: length and guest address.
fn buffer(round: u32, k: u16) -> (u64, u32) {
    let len = 4096u32 << ((u32::from(k) + round) % 5); // 4 KiB .. 64 KiB
    let at = DATA + (u64::from(k) * 3 + u64::from(round)) % 7 * (2 * MIB) + 8192;
    (at, len)
}

fn pattern(round: u32, k: u16, len: u32) -> Vec<u8> {
    let mut x = 0x2545_f491_4f6c_dd1du64 ^ (u64::from(round) << 16) ^ u64::from(k);
    (0..len / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

/// Posts `N` requests of `kind` before one kick; returns their statuses.
fn batch(g: &mut Guest, kind: u32, round: u32, sector: impl Fn(u16) -> u64) -> Vec<u8> {
    for k in 0..N {
        let (at, len) = buffer(round, k);
        let hdr = HDR + u64::from(k) * 16;
        g.add_request(k, kind, sector(k), hdr, at, len, STATUS + u64::from(k));
    }
    g.kick_and_wait(N, STATUS)
}

/// Features (with or without dirty logging), protocol features, the memory table, the ring.
fn connect(c: &Client, g: &Guest, log_all: bool) {
    negotiate_without(c, g, if log_all { 0 } else { F_LOG_ALL });
    start_ring(c, g);
}

/// Runs the rounds with or without fixed buffers (and dirty logging); returns the guest
/// memory read back, the image, and the device's counters.
fn run(fixed: bool, log_all: bool) -> (Vec<u8>, Vec<u8>, BlkStats) {
    let disk = memfd(16 * MIB);
    let seed: Vec<u8> = (0..16 * MIB as u32).map(|i| (i * 7 % 253) as u8).collect();
    disk.write_all_at(&seed, 0).unwrap();
    let mut g = Guest::new(16 * MIB);
    let options = BlkOptions {
        fixed_buffers: fixed,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), options).unwrap());
    connect(&c, &g, log_all);
    let mut seen = Vec::new();
    for round in 0..12u32 {
        let sector = |k: u16| (u64::from(round) * 97 + u64::from(k) * 211) % 30_000;
        // Reads of the image into guest memory, then writes of new bytes from it.
        assert_eq!(batch(&mut g, 0, round, sector), vec![0; N as usize]);
        for k in 0..N {
            let (at, len) = buffer(round, k);
            let mut got = vec![0u8; len as usize];
            g.mem.read(Gpa(at), &mut got).unwrap();
            seen.extend_from_slice(&got);
            g.mem.write(Gpa(at), &pattern(round, k, len)).unwrap();
        }
        let wsector = |k: u16| 16_000 + sector(k) / 2;
        assert_eq!(batch(&mut g, 1, round, wsector), vec![0; N as usize]);
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let mut image = vec![0u8; 16 * MIB as usize];
    disk.read_exact_at(&mut image, 0).unwrap();
    (seen, image, backend.device().stats())
}

#[test]
fn fixed_and_ordinary_transfers_move_the_same_bytes() {
    let (seen_plain, image_plain, plain) = run(false, false);
    let (seen_fixed, image_fixed, fixed) = run(true, false);
    assert_eq!(
        plain.fixed + plain.fixed_fallbacks + plain.fixed_ordinary,
        0
    );
    assert!(seen_plain == seen_fixed, "reads brought different bytes");
    assert!(image_plain == image_fixed, "writes left different images");
    assert_eq!(fixed.failed, 0);
    if fixed.fixed == 0 && fixed.fixed_fallbacks > 0 {
        println!(
            "skipped: fixed_and_ordinary_transfers_move_the_same_bytes: the host refused \
             every registration ({} fallbacks; RLIMIT_MEMLOCK?)",
            fixed.fixed_fallbacks
        );
        return;
    }
    assert!(
        fixed.fixed > 0 && fixed.chunks_registered > 0,
        "nothing went fixed: {fixed:?}"
    );
    // Every transfer that went out through io_uring was counted one way or the other.
    assert!(
        fixed.fixed + fixed.fixed_fallbacks + fixed.fixed_ordinary <= fixed.reads + fixed.writes
    );
    assert!(fixed.register_ns > 0);
    println!(
        "fixed {} ordinary {} fallbacks {} chunks {} ({} us registering)",
        fixed.fixed,
        fixed.fixed_ordinary,
        fixed.fixed_fallbacks,
        fixed.chunks_registered,
        fixed.register_ns / 1000
    );
}

#[test]
fn while_dirty_pages_are_logged_nothing_goes_fixed() {
    let (seen_plain, image_plain, _) = run(false, true);
    let (seen, image, s) = run(true, true);
    assert!(seen == seen_plain && image == image_plain);
    assert_eq!((s.fixed, s.chunks_registered, s.failed), (0, 0, 0), "{s:?}");
    assert!(
        s.fixed_ordinary > 0,
        "the transfers were not looked at: {s:?}"
    );
}

/// A driver at queue depth 1: each request alone, carried out at once through its registered
/// chunk once the chunk is warm, moving the same bytes.
#[test]
fn lone_requests_go_fixed_too() {
    let disk = memfd(4 * MIB);
    let seed: Vec<u8> = (0..4 * MIB as u32).map(|i| (i * 11 % 241) as u8).collect();
    disk.write_all_at(&seed, 0).unwrap();
    let mut g = Guest::new(16 * MIB);
    let options = BlkOptions {
        fixed_buffers: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), options).unwrap());
    connect(&c, &g, false);
    let at = 4 * MIB + 4096;
    for i in 0..20u64 {
        let sector = i * 16;
        g.add_request(0, 0, sector, HDR, at, 8192, STATUS);
        g.kick();
        g.wait_used();
        let mut s = [0u8];
        g.mem.read(Gpa(STATUS), &mut s).unwrap();
        assert_eq!(s[0], 0, "read {i}");
        let mut got = vec![0u8; 8192];
        g.mem.read(Gpa(at), &mut got).unwrap();
        let o = (sector * 512) as usize;
        assert!(got[..] == seed[o..o + 8192], "read {i}: the bytes");
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!((s.failed, s.batches), (0, 0), "{s:?}");
    if s.fixed == 0 && s.fixed_fallbacks > 0 {
        println!("skipped: lone_requests_go_fixed_too: the host refused registration");
        return;
    }
    // The first goes the ordinary way (its chunk cold), the rest through the chunk.
    assert_eq!((s.fixed, s.fixed_ordinary), (19, 1), "{s:?}");
    // Only the one that went the ordinary way was held.
    assert_eq!(s.holds, 1, "{s:?}");
}

/// A transfer through a registered chunk is translated and counted in flight on its chunk,
/// never held: the device's hold counter counts only the transfers that went the ordinary way.
/// (Were the hold put back on the fixed path, `holds` would count every request.)
#[test]
fn fixed_transfers_take_no_hold() {
    let (_, _, s) = run(true, false);
    assert_eq!(s.failed, 0, "{s:?}");
    if s.fixed == 0 && s.fixed_fallbacks > 0 {
        println!("skipped: fixed_transfers_take_no_hold: the host refused registration");
        return;
    }
    assert!(s.fixed > 0, "nothing went fixed: {s:?}");
    assert_eq!(
        s.holds + s.fixed,
        s.reads + s.writes,
        "every transfer is either held or fixed, not both: {s:?}"
    );
    // The plain run holds every one.
    let (_, _, p) = run(false, false);
    assert_eq!((p.holds, p.fixed), (p.reads + p.writes, 0), "{p:?}");
}

/// The fixed / ordinary / fallback shares describe the data path: a `GET_ID`, `DISCARD` or
/// `WRITE_ZEROES` whose buffer lies in a chunk (cold here, which would send a read the ordinary
/// way) moves no data through it and is counted in none of them; a read is.
#[test]
fn requests_that_move_no_data_are_not_in_the_fixed_shares() {
    const GET_ID: u32 = 8;
    const DISCARD: u32 = 11;
    const WRITE_ZEROES: u32 = 13;
    let disk = memfd(4 * MIB);
    disk.write_all_at(&vec![5u8; 4 * MIB as usize], 0).unwrap();
    let mut g = Guest::new(16 * MIB);
    let options = BlkOptions {
        fixed_buffers: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk, options).unwrap());
    connect(&c, &g, false);
    // Each request's one buffer in a chunk of its own, never touched before.
    for (i, kind) in [GET_ID, DISCARD, WRITE_ZEROES].into_iter().enumerate() {
        let at = 4 * MIB + i as u64 * 2 * MIB + 4096;
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        g.mem.write(Gpa(HDR), &h).unwrap();
        g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        let buf = if kind == GET_ID {
            (at, 20, true)
        } else {
            // One range: sector 8, 8 sectors, no flags.
            let mut seg = [0u8; 16];
            seg[0..8].copy_from_slice(&8u64.to_le_bytes());
            seg[8..12].copy_from_slice(&8u32.to_le_bytes());
            g.mem.write(Gpa(at), &seg).unwrap();
            (at, 16, false)
        };
        g.post(&[(HDR, 16, false), buf, (STATUS, 1, true)]);
        g.wait_used();
        let mut s = [0xffu8];
        g.mem.read(Gpa(STATUS), &mut s).unwrap();
        assert_eq!(s[0], 0, "request type {kind}: status");
    }
    // A read into a cold chunk of its own goes the ordinary way, counted.
    g.add_request(0, 0, 0, HDR, 10 * MIB + 4096, 4096, STATUS);
    assert_eq!(g.kick_and_wait(1, STATUS), vec![0]);
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!((s.discards, s.write_zeroes, s.reads), (1, 1, 1), "{s:?}");
    assert_eq!(
        (s.fixed, s.fixed_ordinary, s.fixed_fallbacks),
        (0, 1, 0),
        "only the read is in the shares: {s:?}"
    );
}

/// A lone request whose chunk is cold has its reply out — the used index published and the
/// driver called — before the chunk is registered (~2 ms a chunk): registration runs once the
/// pass's replies are out (`Device::after_replies`), never ahead of them. The hook sees what
/// the driver would see when the registration starts; the test reads nothing from the call
/// descriptor until then.
#[cfg(feature = "test-hooks")]
#[test]
fn a_cold_chunk_is_registered_after_the_reply_that_found_it() {
    use std::os::fd::AsRawFd;
    let mut g = Guest::new(16 * MIB);
    let options = BlkOptions {
        fixed_buffers: true,
        ..BlkOptions::default()
    };
    let mut blk = Blk::new(memfd(4 * MIB), options).unwrap();
    let memory = g.file.try_clone().unwrap();
    let used_idx_at = g.vring_addr().used - USER + 2;
    let call = g.call.try_clone().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    blk.on_register(move || {
        let mut idx = [0u8; 2];
        memory.read_exact_at(&mut idx, used_idx_at).unwrap();
        let mut p = libc::pollfd {
            fd: call.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        let called = unsafe { libc::poll(&mut p, 1, 0) } > 0;
        let _ = tx.send((u16::from_le_bytes(idx), called));
    });
    let (c, t) = serve(blk);
    connect(&c, &g, false);
    // A call the setup left pending would read as this request's.
    let mut p = libc::pollfd {
        fd: g.call.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    if unsafe { libc::poll(&mut p, 1, 0) } > 0 {
        let mut b = [0u8; 8];
        std::io::Read::read(&mut g.call, &mut b).unwrap();
    }
    g.add_request(0, 0, 0, HDR, 4 * MIB + 4096, 4096, STATUS);
    g.kick();
    let seen = rx.recv_timeout(std::time::Duration::from_secs(5));
    g.wait_used();
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!(s.failed, 0, "{s:?}");
    // (A host that refuses the registration still has it tried here, after the reply.)
    let seen = seen.expect("no cold chunk was registered");
    assert_eq!(
        seen,
        (1, true),
        "(used index, driver called) as the chunk the request found cold was registered"
    );
}

/// Clock reads per request (feature `test-hooks` counts the device's own): a read or write
/// starts from its pass's clock (the serving loop's, handed to the device) and ends at one
/// read shared by the requests that end together, so it reads the clock at most once for its
/// latency; a held one adds the two that time its walk (`hold_ns`) and at most one for its
/// release (the guards that end together are let go and timed together). Before issue 48:
/// two a request for the latency, and two more for each walk and each release.
#[cfg(feature = "test-hooks")]
#[test]
fn a_request_reads_the_clock_at_most_once_beyond_its_walk() {
    for fixed in [true, false] {
        let mut g = Guest::new(16 * MIB);
        let options = BlkOptions {
            fixed_buffers: fixed,
            ..BlkOptions::default()
        };
        let (c, t) = serve(Blk::new(memfd(16 * MIB), options).unwrap());
        connect(&c, &g, false);
        for round in 0..12u32 {
            let sector = |k: u16| (u64::from(round) * 97 + u64::from(k) * 211) % 30_000;
            assert_eq!(batch(&mut g, round % 2, round, sector), vec![0; N as usize]);
        }
        drop(c);
        let (backend, _) = t.join().unwrap();
        let (s, reads) = (backend.device().stats(), backend.device().clock_reads());
        let requests = s.reads + s.writes;
        println!(
            "fixed buffers {fixed}: {reads} clock reads over {requests} requests ({} fixed, {} \
             held)",
            s.fixed, s.holds
        );
        assert_eq!(requests, 12 * u64::from(N), "{s:?}");
        assert!(
            reads <= requests + 3 * s.holds,
            "{reads} clock reads for {requests} requests, {} of them held",
            s.holds
        );
    }
}
