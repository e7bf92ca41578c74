//! A frontend that dies mid-migration — memory table set, ring running, dirty log mapped and
//! logging on — leaves nothing behind in a back end serving a socket: its guest memory and its
//! log are unmapped, no page stays pinned, and the next frontend is served without its writes
//! reaching the dead frontend's log. (The real-guest trial `guest/trial.sh mig --frontend-dies`
//! does the same with QEMU SIGKILLed.)

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use memvisor::Gpa;
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::proto::{self, F_LOG_ALL, protocol, req};
use memvisor_vhost::{Backend, Blk, BlkOptions};

const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x30000;

/// One 4 KiB read request through ring 0 into DATA; returns the status byte.
fn read_page(g: &mut Guest) -> u8 {
    let h = [0u8; 16]; // IN, sector 0
    g.mem.write(Gpa(HDR), &h).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[(HDR, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
    g.wait_used();
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    s[0]
}

fn log_bytes(log: &File) -> Vec<u8> {
    let mut b = vec![0u8; 128];
    log.read_exact_at(&mut b, 0).unwrap();
    b
}

#[test]
fn a_frontend_that_dies_mid_migration_leaves_no_mapping_of_its_memory_or_log() {
    let dir = std::env::temp_dir().join(format!("memvisor-vhost-hangup-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("blk.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let t = std::thread::spawn(move || {
        let disk = memfd(MIB);
        let mut b = Backend::new(
            Blk::new(disk, BlkOptions::default()).unwrap(),
            &memvisor_vhost::ProcessState::new(
                memvisor::SharedMappings::global(),
                memvisor::PinRegistry::global(),
            ),
        )
        .unwrap();
        b.serve(&listener, &s2).unwrap();
        b
    });

    let mut g = Guest::with_file(memfd_named(4 * MIB, c"hangup-mem"), 4 * MIB);
    let log = memfd_named(4096, c"hangup-log");
    assert_eq!(mappings_of("hangup-mem"), 1, "the test's own mapping");
    assert_eq!(
        mappings_of("hangup-log"),
        0,
        "the test does not map the log"
    );

    // A frontend migrating, as QEMU does: LOG_SHMFD, the table, the ring, then the log (4 MiB of
    // guest = 1024 pages = 128 bytes) and LOG_ALL.
    let c = Client::connect(&path).unwrap();
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
    let mut p = 128u64.to_le_bytes().to_vec();
    p.extend_from_slice(&0u64.to_le_bytes());
    c.send(req::SET_LOG_BASE, 0, &p, &[log.as_raw_fd()])
        .unwrap();
    let (h, reply) = c.reply().unwrap();
    assert_eq!((h.request, reply), (req::SET_LOG_BASE, vec![0; 8]));
    assert_eq!(c.ack(req::SET_FEATURES, &f.to_le_bytes(), &[]).unwrap(), 0);
    assert_eq!(read_page(&mut g), 0);
    let logged = log_bytes(&log);
    assert_ne!(logged[(DATA / 4096 / 8) as usize], 0, "the read was logged");
    // The back end's mapping may be in pieces: locks its lock cache keeps split it.
    assert!(
        mappings_of("hangup-mem") > 1,
        "the back end maps guest memory"
    );
    assert_eq!(mappings_of("hangup-log"), 1, "the back end maps the log");

    // The frontend dies: no GET_VRING_BASE, no LOG_ALL off, the socket just closes.
    drop(c);

    // The next frontend is accepted only after the back end let go of the last one, so its
    // first answer orders the checks after that.
    let c = Client::connect(&path).unwrap();
    c.get_u64(req::GET_FEATURES).unwrap();
    assert_eq!(
        mappings_of("hangup-mem"),
        1,
        "the dead frontend's memory is still mapped"
    );
    assert_eq!(
        mappings_of("hangup-log"),
        0,
        "the dead frontend's log is still mapped"
    );
    let mut g2 = Guest::new(4 * MIB);
    setup(&c, &g2);
    assert_eq!(read_page(&mut g2), 0);
    assert_eq!(
        log_bytes(&log),
        logged,
        "the next frontend's request reached the dead frontend's log"
    );
    drop(c);

    stop.store(true, Ordering::Relaxed);
    let b = t.join().unwrap();
    assert_eq!(b.stats().connections, 2);
    assert!(b.memory().is_empty(), "the last frontend's memory is held");
    assert!(
        !b.memory().is_logging(),
        "dirty logging outlived its frontend"
    );
    assert_eq!(b.memory().dma().device_pinned_pages(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}
