//! The migration dirty log: with `VHOST_F_LOG_ALL` acked and a log from `SET_LOG_BASE`, every
//! guest page the device writes — data, status byte, used ring — is marked at its guest physical
//! page before the driver is told, and nothing it only read is.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::proto::{self, F_LOG_ALL, protocol, req};
use memvisor_vhost::{Backend, Blk, BlkOptions};

const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;

fn logged(log: &std::fs::File, pages: u64) -> Vec<u64> {
    let mut b = vec![0u8; pages.div_ceil(8) as usize];
    log.read_exact_at(&mut b, 0).unwrap();
    (0..pages)
        .filter(|p| b[(p / 8) as usize] >> (p % 8) & 1 == 1)
        .collect()
}

/// A read of 3 pages at DATA + 0x800 (4 pages touched), with logging on; returns the pages the
/// log holds afterwards.
fn read_with_log(disable: bool) -> (Vec<u64>, u64) {
    let disk = memfd(MIB);
    let mut g = Guest::new(4 * MIB);
    let device = Blk::new(disk, BlkOptions::default()).unwrap();
    let state = memvisor_vhost::ProcessState::new(
        memvisor::SharedMappings::global(),
        memvisor::PinRegistry::global(),
    );
    #[cfg(feature = "test-hooks")]
    let state = state.with_faults(memvisor::faults::Faults {
        no_dirty_log: disable,
        ..Default::default()
    });
    #[cfg(not(feature = "test-hooks"))]
    assert!(!disable, "the switch needs the test-hooks feature");
    let mut backend = Backend::new(device, &state).unwrap();
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let r = backend.run(&b, &stop);
        (backend, r)
    });
    let c = memvisor_testkit::vhost::client::Client::from_stream(a);
    // Negotiate like QEMU migrating: LOG_ALL among the features, LOG_SHMFD among the protocol's.
    let f = c.get_u64(req::GET_FEATURES).unwrap();
    assert_ne!(f & F_LOG_ALL, 0, "LOG_ALL offered");
    let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
    assert_ne!(pf & protocol::LOG_SHMFD, 0, "LOG_SHMFD offered");
    c.send(req::SET_FEATURES, 0, &(f & !F_LOG_ALL).to_le_bytes(), &[])
        .unwrap();
    c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
        .unwrap();
    let table = proto::mem_table_bytes(&[g.region()]);
    assert_eq!(
        c.ack(req::SET_MEM_TABLE, &table, &[g.file.as_raw_fd()])
            .unwrap(),
        0
    );
    start_ring(&c, &g);
    // A request before logging starts is not logged.
    let req_in = |g: &mut Guest, at: u64| {
        let mut h = [0u8; 16];
        h[0] = 0; // IN
        g.mem.write(Gpa(HDR), &h).unwrap();
        g.post(&[(HDR, 16, false), (at, 3 * 4096, true), (STATUS, 1, true)]);
        g.wait_used();
    };
    req_in(&mut g, DATA);

    // Migration starts: the log (4 MiB of guest = 1024 pages = 128 bytes), then LOG_ALL.
    let log = memfd(4096);
    let mut p = 128u64.to_le_bytes().to_vec();
    p.extend_from_slice(&0u64.to_le_bytes());
    c.send(req::SET_LOG_BASE, 0, &p, &[log.as_raw_fd()])
        .unwrap();
    let (h, reply) = c.reply().unwrap();
    assert_eq!((h.request, reply), (req::SET_LOG_BASE, vec![0; 8]));
    // Acked, so the back end has it before the guest kicks (kicks and messages are separate
    // channels with no order between them).
    assert_eq!(c.ack(req::SET_FEATURES, &f.to_le_bytes(), &[]).unwrap(), 0);
    req_in(&mut g, DATA + 0x800);
    // GET_VRING_BASE stops the ring: after its reply everything is in the log.
    let base = c
        .get(req::GET_VRING_BASE, &proto::vring_state_bytes(0, 0))
        .unwrap();
    assert_eq!(base, proto::vring_state_bytes(0, 2));
    let pages = logged(&log, 1024);
    drop(c);
    let (backend, _) = t.join().unwrap();
    (pages, backend.stats().logged_pages)
}

#[test]
fn device_writes_are_logged_at_their_guest_pages_and_reads_are_not() {
    let (pages, n) = read_with_log(false);
    let page = |a: u64| a / 4096;
    // Data: 3 pages from DATA + 0x800 touch pages DATA/4096 .. +3; the status byte's page; the
    // used ring's page (the ring sits at RING_AT, its used part in the same page).
    let mut want: Vec<u64> = (page(DATA)..=page(DATA + 0x800 + 3 * 4096 - 1)).collect();
    want.push(page(STATUS));
    want.push(page(RING_AT));
    want.sort_unstable();
    assert_eq!(pages, want, "logged pages");
    assert!(
        !pages.contains(&page(HDR)),
        "a page the device only read was logged"
    );
    assert!(n >= want.len() as u64);
}

/// The switch exists only with the `test-hooks` feature:
/// `cargo test -p memvisor-vhost --features test-hooks`.
#[cfg(feature = "test-hooks")]
#[test]
fn with_the_test_switch_nothing_reaches_the_log() {
    let (pages, n) = read_with_log(true);
    assert_eq!((pages, n), (vec![], 0));
}
