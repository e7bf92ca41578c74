//! A frontend that sends malformed and hostile messages: each is refused with a non-zero
//! `REPLY_ACK`, nothing changes, and the device keeps working. Framing errors end the
//! connection; a back end serving a socket then takes the next frontend, clean.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::*;
use memvisor_vhost::proto::{self, Region, VringAddr, req};
use memvisor_vhost::{Blk, BlkOptions, Error, WireError};

#[test]
fn hostile_messages_are_refused_and_change_nothing() {
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(read_one(&mut g), 0);

    let fd = g.file.as_raw_fd();
    let small = memfd(MIB);
    let mut pipe = [0; 2];
    // SAFETY: pipe fills the array with two new descriptors.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    // SAFETY: fresh descriptors, owned here.
    let _pipe = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    let r = |gpa: u64, size: u64, user: u64, off: u64| Region {
        gpa,
        size,
        user_addr: user,
        mmap_offset: off,
    };
    let table = |rs: &[Region]| proto::mem_table_bytes(rs);
    let st = |i: u32, n: u32| proto::vring_state_bytes(i, n);
    let addr = |desc: u64| {
        VringAddr {
            desc,
            ..g.vring_addr()
        }
        .bytes()
    };
    let nine: Vec<Region> = (0..9).map(|i| r(i * MIB, MIB, USER + i * MIB, 0)).collect();
    let cases: Vec<(&str, u32, Vec<u8>, Vec<i32>)> = vec![
        (
            "table of 9 regions",
            req::SET_MEM_TABLE,
            table(&nine),
            vec![fd; 8],
        ),
        (
            "table: region past the file's end",
            req::SET_MEM_TABLE,
            table(&[r(0, 4 * MIB, USER, 0)]),
            vec![small.as_raw_fd()],
        ),
        (
            "table: offset past the end",
            req::SET_MEM_TABLE,
            table(&[r(0, MIB, USER, 4 * MIB)]),
            vec![fd],
        ),
        (
            "table: unaligned offset",
            req::SET_MEM_TABLE,
            table(&[r(0, MIB, USER, 12)]),
            vec![fd],
        ),
        (
            "table: a pipe",
            req::SET_MEM_TABLE,
            table(&[r(0, MIB, USER, 0)]),
            vec![pipe[0]],
        ),
        (
            "table: fewer fds than regions",
            req::SET_MEM_TABLE,
            table(&[r(0, MIB, USER, 0), r(MIB, MIB, USER + MIB, MIB)]),
            vec![fd],
        ),
        (
            "table: overlapping guest ranges",
            req::SET_MEM_TABLE,
            table(&[r(0, 2 * MIB, USER, 0), r(MIB, MIB, USER + 4 * MIB, 0)]),
            vec![fd, fd],
        ),
        (
            "table: overlapping user ranges",
            req::SET_MEM_TABLE,
            table(&[r(0, MIB, USER, 0), r(2 * MIB, MIB, USER, 0)]),
            vec![fd, fd],
        ),
        (
            "table: wrapping region",
            req::SET_MEM_TABLE,
            table(&[r(u64::MAX - 4095, 8192, USER, 0)]),
            vec![fd],
        ),
        (
            "table: empty region",
            req::SET_MEM_TABLE,
            table(&[r(0, 0, USER, 0)]),
            vec![fd],
        ),
        (
            "table: truncated payload",
            req::SET_MEM_TABLE,
            table(&[r(0, MIB, USER, 0)])[..20].to_vec(),
            vec![fd],
        ),
        (
            "add region overlapping guest memory",
            req::ADD_MEM_REG,
            proto::single_region_bytes(&r(MIB, MIB, USER + 64 * MIB, 0)),
            vec![fd],
        ),
        (
            "add region without fd",
            req::ADD_MEM_REG,
            proto::single_region_bytes(&r(64 * MIB, MIB, USER + 64 * MIB, 0)),
            vec![],
        ),
        (
            "remove a region never added",
            req::REM_MEM_REG,
            proto::single_region_bytes(&r(64 * MIB, MIB, USER + 64 * MIB, 0)),
            vec![],
        ),
        ("vring num 0", req::SET_VRING_NUM, st(0, 0), vec![]),
        ("vring num 3", req::SET_VRING_NUM, st(0, 3), vec![]),
        ("vring num 65536", req::SET_VRING_NUM, st(0, 65536), vec![]),
        ("vring 7 of 1", req::SET_VRING_NUM, st(7, 16), vec![]),
        ("vring 2^32-1", req::SET_VRING_BASE, st(u32::MAX, 0), vec![]),
        (
            "vring base 70000",
            req::SET_VRING_BASE,
            st(0, 70000),
            vec![],
        ),
        (
            "vring addr outside memory",
            req::SET_VRING_ADDR,
            addr(USER + 64 * MIB),
            vec![],
        ),
        (
            "vring addr wrapping",
            req::SET_VRING_ADDR,
            addr(u64::MAX - 8),
            vec![],
        ),
        (
            "vring moved while running",
            req::SET_VRING_ADDR,
            addr(USER + 0x2000),
            vec![],
        ),
        (
            "kick with no-fd flag and an fd",
            req::SET_VRING_KICK,
            (0x100u64).to_le_bytes().to_vec(),
            vec![fd],
        ),
        (
            "kick without an fd",
            req::SET_VRING_KICK,
            0u64.to_le_bytes().to_vec(),
            vec![],
        ),
        (
            "call for ring 9",
            req::SET_VRING_CALL,
            9u64.to_le_bytes().to_vec(),
            vec![fd],
        ),
        ("enable 2", req::SET_VRING_ENABLE, st(0, 2), vec![]),
        (
            "features never offered",
            req::SET_FEATURES,
            (1u64 << 63).to_le_bytes().to_vec(),
            vec![],
        ),
        (
            "protocol features never offered",
            req::SET_PROTOCOL_FEATURES,
            (1u64 << 40).to_le_bytes().to_vec(),
            vec![],
        ),
        ("short u64", req::SET_FEATURES, vec![1, 2, 3], vec![]),
        (
            "set config on a read-only config",
            req::SET_CONFIG,
            proto::config_bytes(0, 0, &[1, 2]),
            vec![],
        ),
        (
            "set config past 256 bytes",
            req::SET_CONFIG,
            proto::config_bytes(250, 0, &[0; 10]),
            vec![],
        ),
        ("unknown request 99", 99, vec![], vec![]),
        (
            "IOTLB message (no IOMMU offered)",
            req::IOTLB_MSG,
            vec![0; 40],
            vec![],
        ),
    ];
    let regions_before = 1;
    for (what, request, payload, fds) in &cases {
        let ack = c
            .ack(*request, payload, fds)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_ne!(ack, 0, "{what}: accepted");
        // The device still works after every refusal, on the same memory.
        assert_eq!(read_one(&mut g), 0, "{what}: the device broke");
    }
    // GET_CONFIG past the config space is answered with no payload (vhost-user.rst: a zero
    // length payload says the request failed), and the connection goes on.
    let r = c
        .get(req::GET_CONFIG, &proto::config_bytes(300, 0, &[0; 8]))
        .unwrap();
    assert!(
        r.is_empty(),
        "GET_CONFIG past the config space answered {r:?}"
    );
    assert_eq!(read_one(&mut g), 0, "GET_CONFIG: the device broke");
    drop(c);
    let (backend, end) = t.join().unwrap();
    // It ended because the frontend hung up, not on a message.
    assert!(matches!(end, Err(Error::Wire(_))), "{end:?}");
    assert_eq!(backend.memory().len(), regions_before, "memory changed");
    assert_eq!(backend.stats().refused as usize, cases.len() + 1);
    assert_eq!(backend.memory().dma().device_pinned_pages(), 0);
}

#[test]
fn framing_errors_end_the_connection() {
    for (what, bytes) in [
        ("version 2", {
            let mut b = req::GET_FEATURES.to_le_bytes().to_vec();
            b.extend_from_slice(&2u32.to_le_bytes());
            b.extend_from_slice(&0u32.to_le_bytes());
            b
        }),
        ("payload of 1 GiB", {
            let mut b = req::SET_FEATURES.to_le_bytes().to_vec();
            b.extend_from_slice(&1u32.to_le_bytes());
            b.extend_from_slice(&(1u32 << 30).to_le_bytes());
            b
        }),
        ("a header cut short", vec![1, 0, 0]),
    ] {
        let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
        c.raw(&bytes, &[]).unwrap();
        if what == "a header cut short" {
            drop(c);
        }
        let (_, end) = t.join().unwrap();
        assert!(end.is_err(), "{what}: {end:?}");
    }
    // More descriptors than a message may carry.
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    let f = memfd(MIB);
    let fds = vec![f.as_raw_fd(); 12];
    c.send(req::SET_MEM_TABLE, 0, &proto::mem_table_bytes(&[]), &fds)
        .unwrap();
    let (backend, end) = t.join().unwrap();
    assert!(
        matches!(end, Err(Error::Wire(WireError::Protocol { .. }))),
        "{end:?}"
    );
    assert!(backend.memory().is_empty());
}

/// A blk back end serving frontends one after another on a socket in a fresh directory, until
/// `stop` is set; the thread returns the back end.
fn serve_on_socket(
    tag: &str,
) -> (
    std::path::PathBuf,
    std::path::PathBuf,
    Arc<AtomicBool>,
    std::thread::JoinHandle<memvisor_vhost::Backend<Blk>>,
) {
    let dir = std::env::temp_dir().join(format!("memvisor-vhost-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("blk.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let t = std::thread::spawn(move || {
        let mut b = memvisor_vhost::Backend::new(
            Blk::new(mib_disk(), BlkOptions::default()).unwrap(),
            &memvisor_vhost::ProcessState::new(
                memvisor::SharedMappings::global(),
                memvisor::PinRegistry::global(),
            ),
        )
        .unwrap();
        b.serve(&listener, &s2).unwrap();
        b
    });
    (dir, path, stop, t)
}

#[test]
fn a_frontend_that_leaves_and_comes_back_gets_a_clean_device() {
    let (dir, path, stop, t) = serve_on_socket("reconnect");
    let connect = || memvisor_testkit::vhost::client::Client::connect(&path).unwrap();

    let mut g = Guest::with_file(memfd_named(4 * MIB, c"reconnect-1"), 4 * MIB);
    assert_eq!(mappings_of("reconnect-1"), 1, "the test's own mapping");
    let c = connect();
    setup(&c, &g);
    assert_eq!(
        mappings_of("reconnect-1"),
        2,
        "the back end maps the guest's memory"
    );
    assert_eq!(read_one(&mut g), 0);
    assert_eq!(read_one(&mut g), 0);
    // Leaves in the middle: ring running, memory mapped.
    drop(c);

    // The next frontend finds a device reset: ring 0 at index 0 (the old one had taken two
    // requests), and the old frontend's memory unmapped.
    let c = connect();
    let base = c
        .get(req::GET_VRING_BASE, &proto::vring_state_bytes(0, 0))
        .unwrap();
    assert_eq!(base, proto::vring_state_bytes(0, 0));
    assert_eq!(
        mappings_of("reconnect-1"),
        1,
        "the old frontend's memory is still mapped"
    );
    let mut g2 = Guest::new(4 * MIB);
    setup(&c, &g2);
    assert_eq!(read_one(&mut g2), 0);
    drop(c);
    drop(g);

    stop.store(true, Ordering::Relaxed);
    let b = t.join().unwrap();
    assert_eq!(b.stats().connections, 2);
    assert!(
        b.memory().is_empty(),
        "the last frontend's memory is still mapped"
    );
    assert_eq!(b.memory().dma().device_pinned_pages(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn seconds_of_random_hostile_traffic_leave_a_working_back_end() {
    let (dir, path, stop, t) = serve_on_socket("fuzz");
    let secs = std::env::var("MEMVISOR_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let stats =
        memvisor_testkit::vhost::fuzz::run(&path, 0x5eed, std::time::Duration::from_secs(secs))
            .unwrap();
    println!("fuzz: {stats:?}");
    assert!(stats.messages > 100 && stats.refusals > 0, "{stats:?}");

    let mut g = Guest::new(4 * MIB);
    let c = memvisor_testkit::vhost::client::Client::connect(&path).unwrap();
    setup(&c, &g);
    assert_eq!(read_one(&mut g), 0);
    drop(c);
    stop.store(true, Ordering::Relaxed);
    let b = t.join().unwrap();
    assert!(b.memory().is_empty());
    assert_eq!(b.memory().dma().device_pinned_pages(), 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_running_ring_may_be_told_its_own_addresses_again() {
    // QEMU re-sends SET_VRING_ADDR with the log flag when migration starts.
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let again = VringAddr {
        flags: 1,
        ..g.vring_addr()
    };
    assert_eq!(c.ack(req::SET_VRING_ADDR, &again.bytes(), &[]).unwrap(), 0);
    assert_eq!(read_one(&mut g), 0);
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.stats().refused, 0);
}
