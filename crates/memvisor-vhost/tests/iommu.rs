//! Behind a vIOMMU: ring and buffer addresses are IOVAs the frontend's IOTLB messages map; a
//! missing translation is asked for with a MISS on the back-end channel; invalidated or never
//! mapped IOVAs fail the request that names them and nothing else. IOTLB messages a frontend
//! could send wrong, a ring stopped while its start waits for the IOTLB, and a frontend that
//! stops reading its back-end channel.

mod common;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::proto::{self, F_IOMMU_PLATFORM, IotlbMsg, VringAddr, iotlb, protocol, req};
use memvisor_vhost::{Blk, BlkOptions};

const IO: u64 = 0x4000_0000; // where the guest's IOMMU puts things
const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;

fn update(
    c: &memvisor_testkit::vhost::client::Client,
    iova: u64,
    gpa: u64,
    size: u64,
    perm: u8,
) -> u64 {
    let m = IotlbMsg {
        iova,
        size,
        uaddr: USER + gpa,
        perm,
        kind: iotlb::UPDATE,
    };
    c.ack(req::IOTLB_MSG, &m.bytes(), &[]).unwrap()
}

fn read_status(g: &Guest) -> u8 {
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    s[0]
}

/// The guest's ring addresses as IOVAs at `IO`.
fn io_vring_addr(g: &Guest) -> VringAddr {
    let gpa_addr = g.vring_addr();
    VringAddr {
        desc: IO + RING_AT,
        avail: IO + (gpa_addr.avail - USER),
        used: IO + (gpa_addr.used - USER),
        ..gpa_addr
    }
}

/// Starts the guest's ring with its addresses as IOVAs at `IO` (which the caller has mapped).
fn start_ring_behind_iommu(c: &memvisor_testkit::vhost::client::Client, g: &Guest) {
    let io_addr = io_vring_addr(g);
    let st = |n: u32| proto::vring_state_bytes(0, n);
    for (r, p, fds) in [
        (req::SET_VRING_NUM, st(RING_SIZE as u32), vec![]),
        (req::SET_VRING_ADDR, io_addr.bytes(), vec![]),
        (req::SET_VRING_BASE, st(0), vec![]),
        (
            req::SET_VRING_CALL,
            0u64.to_le_bytes().to_vec(),
            vec![g.call.as_raw_fd()],
        ),
        (
            req::SET_VRING_KICK,
            0u64.to_le_bytes().to_vec(),
            vec![g.kick.as_raw_fd()],
        ),
        (req::SET_VRING_ENABLE, st(1), vec![]),
    ] {
        assert_eq!(c.ack(r, &p, &fds).unwrap(), 0, "{}", req::name(r));
    }
}

/// Features (the IOMMU platform and indirect descriptors offered), protocol features, the
/// back-end channel and the memory table; returns the frontend's end of the channel.
fn connect_behind_iommu(c: &memvisor_testkit::vhost::client::Client, g: &Guest) -> UnixStream {
    let f = c.get_u64(req::GET_FEATURES).unwrap();
    assert_ne!(f & F_IOMMU_PLATFORM, 0);
    assert_ne!(f & (1 << 28), 0, "indirect descriptors behind an IOMMU too");
    c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[]).unwrap();
    let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
    c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
        .unwrap();
    assert_ne!(pf & protocol::BACKEND_REQ, 0);
    let (ours, theirs) = UnixStream::pair().unwrap();
    assert_eq!(
        c.ack(req::SET_BACKEND_REQ_FD, &[], &[theirs.as_raw_fd()])
            .unwrap(),
        0
    );
    let table = proto::mem_table_bytes(&[g.region()]);
    assert_eq!(
        c.ack(req::SET_MEM_TABLE, &table, &[g.file.as_raw_fd()])
            .unwrap(),
        0
    );
    ours
}

/// A blk device behind an IOMMU over a 1 MiB image whose first page is `fill`, served and
/// connected ([`connect_behind_iommu`]), and the guest.
fn blk_behind_iommu(
    fill: u8,
) -> (
    memvisor_testkit::vhost::client::Client,
    std::thread::JoinHandle<Served<Blk>>,
    Guest,
    UnixStream,
) {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(iommu_blk(&[fill; 4096]));
    let ours = connect_behind_iommu(&c, &g);
    (c, t, g, ours)
}

/// A blk device that negotiates the IOMMU, over a 1 MiB image that starts with `data`.
fn iommu_blk(data: &[u8]) -> Blk {
    let disk = memfd(MIB);
    std::os::unix::fs::FileExt::write_all_at(&disk, data, 0).unwrap();
    let options = BlkOptions {
        iommu: true,
        ..BlkOptions::default()
    };
    Blk::new(disk, options).unwrap()
}

#[test]
fn rings_and_buffers_go_through_the_iotlb() {
    let (c, t, mut g, ours) = blk_behind_iommu(0x5a);

    // The ring at IOVA IO + RING_AT, not yet in the IOTLB: the back end asks for it.
    let io_addr = io_vring_addr(&g);
    let st = |n: u32| proto::vring_state_bytes(0, n);
    assert_eq!(
        c.ack(req::SET_VRING_NUM, &st(RING_SIZE as u32), &[])
            .unwrap(),
        0
    );
    assert_eq!(
        c.ack(req::SET_VRING_ADDR, &io_addr.bytes(), &[]).unwrap(),
        0
    );
    let mut miss = [0u8; 12 + 32];
    (&ours).read_exact(&mut miss).unwrap();
    let m = IotlbMsg::parse(&miss[12..]).unwrap();
    assert_eq!((m.kind, m.iova), (iotlb::MISS, IO + RING_AT), "{m:?}");
    assert_eq!(c.ack(req::SET_VRING_BASE, &st(0), &[]).unwrap(), 0);
    assert_eq!(
        c.ack(
            req::SET_VRING_CALL,
            &0u64.to_le_bytes(),
            &[g.call.as_raw_fd()]
        )
        .unwrap(),
        0
    );
    assert_eq!(
        c.ack(
            req::SET_VRING_KICK,
            &0u64.to_le_bytes(),
            &[g.kick.as_raw_fd()]
        )
        .unwrap(),
        0
    );
    assert_eq!(c.ack(req::SET_VRING_ENABLE, &st(1), &[]).unwrap(), 0);
    // The update arrives: the ring starts.
    assert_eq!(update(&c, IO + RING_AT, RING_AT, 4096, 3), 0);

    // Header, data and status at IOVAs.
    for (iova, gpa, perm) in [
        (IO + HDR, HDR, 1),
        (IO + DATA, DATA, 3),
        (IO + STATUS, STATUS, 3),
    ] {
        assert_eq!(update(&c, iova, gpa, 4096, perm), 0);
    }
    let post_read = |g: &mut Guest, data_iova: u64| {
        g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
        g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        g.mem.write(Gpa(DATA), &[0u8; 512]).unwrap();
        g.post(&[
            (IO + HDR, 16, false),
            (data_iova, 512, true),
            (IO + STATUS, 1, true),
        ]);
        g.wait_used();
    };
    post_read(&mut g, IO + DATA);
    assert_eq!(read_status(&g), 0);
    let mut d = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert_eq!(
        d, [0x5a; 512],
        "the data landed at the guest page behind the IOVA"
    );

    // A hostile guest names an IOVA it never mapped: the back end asks (MISS), nobody answers,
    // after the wait that request fails and nothing is written.
    post_read(&mut g, IO + 0x7000_0000);
    assert_eq!(read_status(&g), 1);
    // Invalidated (part of a larger range, cutting nothing else): fails too.
    let inv = IotlbMsg {
        iova: IO + DATA,
        size: 4096,
        uaddr: 0,
        perm: 0,
        kind: iotlb::INVALIDATE,
    };
    assert_eq!(c.ack(req::IOTLB_MSG, &inv.bytes(), &[]).unwrap(), 0);
    post_read(&mut g, IO + DATA);
    assert_eq!(read_status(&g), 1);
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert_eq!(d, [0; 512], "nothing reached a page the guest took back");
    // Mapped again read-only for the device: a read request (device writes) still fails.
    assert_eq!(update(&c, IO + DATA, DATA, 4096, 1), 0);
    post_read(&mut g, IO + DATA);
    assert_eq!(read_status(&g), 1);
    // And read-write: works.
    assert_eq!(update(&c, IO + DATA, DATA, 4096, 3), 0);
    post_read(&mut g, IO + DATA);
    assert_eq!(read_status(&g), 0);
    // A whole-space invalidation (lazy mode) removes everything.
    let all = IotlbMsg {
        iova: 0,
        size: u64::MAX,
        uaddr: 0,
        perm: 0,
        kind: iotlb::INVALIDATE,
    };
    assert_eq!(c.ack(req::IOTLB_MSG, &all.bytes(), &[]).unwrap(), 0);
    drop(c);
    let (backend, _) = t.join().unwrap();
    // The ring, the never-mapped IOVA and the invalidated one; not the read-only mapping (a
    // translation without the access is no miss).
    assert_eq!(backend.stats().iotlb_misses, 3);
    assert_eq!(backend.stats().iotlb_invalidates, 2);
    assert!(backend.memory().dma().is_empty());
}

#[test]
fn behind_the_iommu_device_writes_are_logged_at_guest_pages_not_iovas() {
    use memvisor_vhost::proto::F_LOG_ALL;
    use std::os::unix::fs::FileExt;
    let mut g = Guest::new(4 * MIB);
    let options = BlkOptions {
        iommu: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(memfd(MIB), options).unwrap());
    let f = c.get_u64(req::GET_FEATURES).unwrap();
    c.send(req::SET_FEATURES, 0, &(f & !F_LOG_ALL).to_le_bytes(), &[])
        .unwrap();
    let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
    c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
        .unwrap();
    let table = proto::mem_table_bytes(&[g.region()]);
    assert_eq!(
        c.ack(req::SET_MEM_TABLE, &table, &[g.file.as_raw_fd()])
            .unwrap(),
        0
    );
    // Everything the device touches mapped up front: ring page, header, data, status.
    for (iova, gpa) in [
        (IO + RING_AT, RING_AT),
        (IO + HDR, HDR),
        (IO + DATA, DATA),
        (IO + STATUS, STATUS),
    ] {
        assert_eq!(update(&c, iova, gpa, 4096, 3), 0);
    }
    start_ring_behind_iommu(&c, &g);
    let log = memfd(4096);
    let mut p = 128u64.to_le_bytes().to_vec();
    p.extend_from_slice(&0u64.to_le_bytes());
    c.send(req::SET_LOG_BASE, 0, &p, &[log.as_raw_fd()])
        .unwrap();
    c.reply().unwrap();
    assert_eq!(c.ack(req::SET_FEATURES, &f.to_le_bytes(), &[]).unwrap(), 0);
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap();
    g.post(&[
        (IO + HDR, 16, false),
        (IO + DATA, 512, true),
        (IO + STATUS, 1, true),
    ]);
    g.wait_used();
    assert_eq!(read_status(&g), 0);
    let base = c
        .get(req::GET_VRING_BASE, &proto::vring_state_bytes(0, 0))
        .unwrap();
    assert_eq!(base, proto::vring_state_bytes(0, 1));
    let mut b = [0u8; 128];
    log.read_exact_at(&mut b, 0).unwrap();
    let pages: Vec<u64> = (0..1024u64)
        .filter(|p| b[(p / 8) as usize] >> (p % 8) & 1 == 1)
        .collect();
    assert_eq!(pages, vec![RING_AT / 4096, DATA / 4096, STATUS / 4096]);
    drop(c);
    t.join().unwrap().1.ok();
}

#[test]
fn an_invalidation_is_acknowledged_only_after_the_request_on_its_range_ended() {
    // A read request of 256 KiB into IOVAs the frontend invalidates right after the kick. The
    // back end serves the socket and the rings on one thread, and a request releases its pins
    // before the next message is read, so the acknowledgement comes after the request wrote
    // its data and completed, or before it started (it then misses and fails). Either way,
    // nothing lands in the buffer once the acknowledgement arrived.
    const LEN: u64 = 0x40000;
    let disk = memfd(MIB);
    std::os::unix::fs::FileExt::write_all_at(&disk, &[0x5a; LEN as usize], 0).unwrap();
    let mut g = Guest::new(4 * MIB);
    let options = BlkOptions {
        iommu: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk, options).unwrap());
    negotiate(&c, &g);
    for (iova, gpa, size) in [
        (IO + RING_AT, RING_AT, 4096),
        (IO + HDR, HDR, 4096),
        (IO + STATUS, STATUS, 4096),
    ] {
        assert_eq!(update(&c, iova, gpa, size, 3), 0);
    }
    start_ring_behind_iommu(&c, &g);
    let inv = IotlbMsg {
        iova: IO + DATA,
        size: LEN,
        uaddr: 0,
        perm: 0,
        kind: iotlb::INVALIDATE,
    };
    let (mut before, mut after) = (0, 0);
    for round in 0..6 {
        assert_eq!(update(&c, IO + DATA, DATA, LEN, 3), 0);
        g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
        g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        g.mem.write(Gpa(DATA), &[0u8; LEN as usize]).unwrap();
        g.post(&[
            (IO + HDR, 16, false),
            (IO + DATA, LEN as u32, true),
            (IO + STATUS, 1, true),
        ]);
        assert_eq!(c.ack(req::IOTLB_MSG, &inv.bytes(), &[]).unwrap(), 0);
        // Acknowledged: the request has ended, or has not started.
        let at_ack = read_status(&g);
        let mut data = vec![0u8; LEN as usize];
        g.mem.read(Gpa(DATA), &mut data).unwrap();
        if ended_at_ack(round, at_ack, &data, 0x5a) {
            before += 1;
        } else {
            after += 1;
        }
        g.mem.write(Gpa(DATA), &[0xee; LEN as usize]).unwrap();
        g.wait_used();
        g.mem.read(Gpa(DATA), &mut data).unwrap();
        untouched_after_ack(round, at_ack, read_status(&g), &data, 0xee);
    }
    println!("{before} requests ended before the acknowledgement, {after} failed after it");
    drop(c);
    t.join().unwrap().1.ok();
}

/// An indirect descriptor table is at an IOVA like everything else: read through the IOTLB,
/// asked for with a MISS when it is not there, and the request completes once it is.
#[test]
fn indirect_tables_are_read_through_the_iotlb() {
    use memvisor_testkit::guest_ring::{Desc, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    const VRING_DESC_F_INDIRECT: u16 = 4;
    const TABLE: u64 = 0x90000;
    let (c, t, mut g, ours) = blk_behind_iommu(0x3c);
    // Ring and buffers mapped; the indirect table's page not yet.
    for (iova, gpa, perm) in [
        (IO + RING_AT, RING_AT, 3),
        (IO + HDR, HDR, 1),
        (IO + DATA, DATA, 3),
        (IO + STATUS, STATUS, 3),
    ] {
        assert_eq!(update(&c, iova, gpa, 4096, perm), 0);
    }
    start_ring_behind_iommu(&c, &g);

    // The guest writes the table (header, data, status) at guest page TABLE and posts one
    // descriptor naming it at its IOVA.
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    let entries = [
        (IO + HDR, 16u32, VRING_DESC_F_NEXT, 1u16),
        (IO + DATA, 512, VRING_DESC_F_WRITE | VRING_DESC_F_NEXT, 2),
        (IO + STATUS, 1, VRING_DESC_F_WRITE, 0),
    ];
    for (k, (addr, len, flags, next)) in entries.into_iter().enumerate() {
        let mut e = [0u8; 16];
        e[0..8].copy_from_slice(&addr.to_le_bytes());
        e[8..12].copy_from_slice(&len.to_le_bytes());
        e[12..14].copy_from_slice(&flags.to_le_bytes());
        e[14..16].copy_from_slice(&next.to_le_bytes());
        g.mem.write(Gpa(TABLE + 16 * k as u64), &e).unwrap();
    }
    let indirect = Desc {
        addr: IO + TABLE,
        len: 48,
        flags: VRING_DESC_F_INDIRECT,
        next: 0,
    };
    let head = g.ring.add_raw(&[0], &[indirect]).unwrap();
    g.ring.publish(head).unwrap();
    std::io::Write::write_all(&mut g.kick, &1u64.to_le_bytes()).unwrap();

    // The table is not in the IOTLB: the back end asks for exactly it, for reading.
    ours.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut miss = [0u8; 12 + 32];
    (&ours)
        .read_exact(&mut miss)
        .expect("a MISS for the indirect table within 5 s");
    let m = IotlbMsg::parse(&miss[12..]).unwrap();
    assert_eq!(
        (m.kind, m.iova, m.perm),
        (iotlb::MISS, IO + TABLE, iotlb::ACCESS_RO),
        "{m:?}"
    );
    assert_eq!(
        read_status(&g),
        0xff,
        "nothing done before the table is there"
    );
    // The update arrives: the request is served from the chain in the table.
    assert_eq!(update(&c, IO + TABLE, TABLE, 4096, 1), 0);
    let (used_head, written) = g.wait_used();
    assert_eq!((used_head, written), (head, 513));
    assert_eq!(read_status(&g), 0);
    let mut d = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert_eq!(
        d, [0x3c; 512],
        "the data landed behind the IOVA the table named"
    );
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.stats().iotlb_misses, 1);
    assert_eq!(backend.device().stats().indirect, 1);
}

/// 256 KiB of data (64 pages of 4 KiB) for the pipelined-miss tests.
const WIDE: u64 = 0x40000;

/// A blk device behind an IOMMU whose image starts with [`WIDE`] bytes of a pattern (byte `k`
/// is `k / 4096 + 1`), served with at most `batch` misses asked at once, connected; ring,
/// header and status mapped and the ring started.
fn wide_blk_behind_iommu(
    batch: usize,
) -> (
    memvisor_testkit::vhost::client::Client,
    std::thread::JoinHandle<Served<Blk>>,
    Guest,
    UnixStream,
) {
    let g = Guest::new(4 * MIB);
    let (a, b) = UnixStream::pair().unwrap();
    let mut backend = memvisor_vhost::backend::Backend::new(
        iommu_blk(&wide_pattern()),
        &memvisor_vhost::ProcessState::new(
            memvisor::SharedMappings::global(),
            memvisor::PinRegistry::global(),
        ),
    )
    .unwrap();
    backend.set_miss_batch(batch);
    let t = std::thread::spawn(move || {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let r = backend.run(&b, &stop);
        (backend, r)
    });
    let c = memvisor_testkit::vhost::client::Client::from_stream(a);
    let ours = connect_behind_iommu(&c, &g);
    for (iova, gpa, perm) in [
        (IO + RING_AT, RING_AT, 3),
        (IO + HDR, HDR, 1),
        (IO + STATUS, STATUS, 3),
    ] {
        assert_eq!(update(&c, iova, gpa, 4096, perm), 0);
    }
    start_ring_behind_iommu(&c, &g);
    (c, t, g, ours)
}

fn wide_pattern() -> Vec<u8> {
    (0..WIDE).map(|k| (k / 4096 + 1) as u8).collect()
}

/// Posts a read of [`WIDE`] bytes from sector 0 into IOVA `IO + DATA` (the data buffer and
/// status cleared first).
fn post_wide_read(g: &mut Guest) {
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.mem.write(Gpa(DATA), &vec![0u8; WIDE as usize]).unwrap();
    g.post(&[
        (IO + HDR, 16, false),
        (IO + DATA, WIDE as u32, true),
        (IO + STATUS, 1, true),
    ]);
}

/// The MISS messages that arrive on the back-end channel within `wait` of each other.
/// A frontend whose IOTLB holds one data page: it answers each MISS with an UPDATE, after an
/// INVALIDATE of the other page of the request (as a full IOTLB retiring its oldest entry
/// would), so the request never finds both mapped at once. The request fails once the miss
/// wait ran out over all its retries, instead of asking without end; the ring then serves the
/// next request.
#[test]
fn a_request_whose_answered_pages_are_taken_away_again_fails_instead_of_asking_forever() {
    let (c, t, mut g, ours) = blk_behind_iommu(0x5a);
    assert_eq!(update(&c, IO + RING_AT, RING_AT, 4096, 3), 0);
    assert_eq!(update(&c, IO + HDR, HDR, 4096, 1), 0);
    assert_eq!(update(&c, IO + STATUS, STATUS, 4096, 3), 0);
    start_ring_behind_iommu(&c, &g);
    let pages = [IO + DATA, IO + DATA + 4096];
    let post = |g: &mut Guest| {
        g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
        g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        g.post(&[
            (IO + HDR, 16, false),
            (pages[0], 8192, true),
            (IO + STATUS, 1, true),
        ]);
    };
    post(&mut g);
    let start = std::time::Instant::now();
    let mut answered = 0;
    ours.set_read_timeout(Some(std::time::Duration::from_millis(50)))
        .unwrap();
    let mut msg = [0u8; 12 + 32];
    while read_status(&g) == 0xff && start.elapsed() < std::time::Duration::from_secs(20) {
        if (&ours).read_exact(&mut msg).is_err() {
            continue;
        }
        let m = IotlbMsg::parse(&msg[12..]).unwrap();
        assert_eq!(m.kind, iotlb::MISS, "{m:?}");
        let other = pages[usize::from(m.iova == pages[0])];
        let inv = IotlbMsg {
            iova: other,
            size: 4096,
            uaddr: 0,
            perm: 0,
            kind: iotlb::INVALIDATE,
        };
        assert_eq!(c.ack(req::IOTLB_MSG, &inv.bytes(), &[]).unwrap(), 0);
        assert_eq!(update(&c, m.iova, m.iova - IO, 4096, 3), 0);
        answered += 1;
    }
    let took = start.elapsed();
    assert_eq!(
        read_status(&g),
        1,
        "after {took:?} and {answered} answers the request is still waiting"
    );
    g.wait_used();
    assert!(answered > 4, "the request went round only {answered} times");
    assert!(
        took >= std::time::Duration::from_millis(1500),
        "failed after {took:?}"
    );
    // Both pages mapped: the next request is served.
    assert_eq!(update(&c, pages[0], DATA, 8192, 3), 0);
    post(&mut g);
    g.wait_used();
    assert_eq!(read_status(&g), 0);
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert!(backend.stats().iotlb_misses >= answered);
}

fn read_misses(ours: &UnixStream, wait: std::time::Duration) -> Vec<IotlbMsg> {
    ours.set_read_timeout(Some(wait)).unwrap();
    let mut out = Vec::new();
    let mut msg = [0u8; 12 + 32];
    while (&*ours).read_exact(&mut msg).is_ok() {
        assert_eq!(
            u32::from_le_bytes(msg[..4].try_into().unwrap()),
            proto::backend_req::IOTLB_MSG
        );
        let m = IotlbMsg::parse(&msg[12..]).unwrap();
        assert_eq!(m.kind, iotlb::MISS, "{m:?}");
        out.push(m);
    }
    out
}

/// A chain whose 256 KiB buffer misses on 62 of its 64 pages: the back end asks for all 62 in
/// one go (in order, each once, for writing), asks nothing more while the updates trickle in,
/// and the request completes once they all arrived. A second request missing on two
/// invalidated pages asks for exactly those two.
#[test]
fn a_chain_missing_on_many_pages_asks_for_all_of_them_at_once() {
    let (c, t, mut g, ours) = wide_blk_behind_iommu(memvisor_vhost::miss::MAX_MISSES);
    // Pages 10 and 11 of the buffer are mapped already; the other 62 are not.
    assert_eq!(
        update(&c, IO + DATA + 10 * 4096, DATA + 10 * 4096, 8192, 3),
        0
    );
    post_wide_read(&mut g);
    let misses = read_misses(&ours, std::time::Duration::from_millis(500));
    let want: Vec<u64> = (0..64)
        .filter(|p| !(10..12).contains(p))
        .map(|p| IO + DATA + p * 4096)
        .collect();
    let got: Vec<u64> = misses.iter().map(|m| m.iova).collect();
    assert_eq!(got, want, "every unmapped page, in order, each once");
    assert!(misses.iter().all(|m| m.perm == iotlb::ACCESS_RW));
    assert_eq!(read_status(&g), 0xff, "nothing done before the updates");

    // The answers arrive one by one, last page first: no MISS is sent again meanwhile, and the
    // request waits for the last of them.
    for (k, &iova) in want.iter().rev().enumerate() {
        assert_eq!(update(&c, iova, iova - IO, 4096, 3), 0);
        if k == want.len() / 2 {
            assert!(
                read_misses(&ours, std::time::Duration::from_millis(100)).is_empty(),
                "asked again for a page already asked for"
            );
            assert_eq!(read_status(&g), 0xff);
        }
    }
    let (_, written) = g.wait_used();
    assert_eq!(written, WIDE as u32 + 1);
    assert_eq!(read_status(&g), 0);
    let mut d = vec![0u8; WIDE as usize];
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert!(d == wide_pattern(), "the data landed behind every IOVA");
    assert!(read_misses(&ours, std::time::Duration::from_millis(100)).is_empty());

    // Two pages invalidated (a strict guest unmapping): the next request asks for those two.
    for p in [3u64, 40] {
        let inv = IotlbMsg {
            iova: IO + DATA + p * 4096,
            size: 4096,
            uaddr: 0,
            perm: 0,
            kind: iotlb::INVALIDATE,
        };
        assert_eq!(c.ack(req::IOTLB_MSG, &inv.bytes(), &[]).unwrap(), 0);
    }
    post_wide_read(&mut g);
    let misses = read_misses(&ours, std::time::Duration::from_millis(500));
    let got: Vec<u64> = misses.iter().map(|m| m.iova).collect();
    assert_eq!(got, [IO + DATA + 3 * 4096, IO + DATA + 40 * 4096]);
    for iova in got {
        assert_eq!(update(&c, iova, iova - IO, 4096, 3), 0);
    }
    g.wait_used();
    assert_eq!(read_status(&g), 0);
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.stats().iotlb_misses, 64);
}

/// One request of [`WIDE`] bytes whose every data page misses, answered as a frontend does:
/// each MISS read off the back-end channel is answered with an UPDATE (acknowledged) on the
/// front channel. Returns (µs from the kick to the used entry, MISS messages).
fn wide_request_behind_strict_guest(
    c: &memvisor_testkit::vhost::client::Client,
    g: &mut Guest,
    ours: &UnixStream,
) -> (f64, usize) {
    let inv = IotlbMsg {
        iova: IO + DATA,
        size: WIDE,
        uaddr: 0,
        perm: 0,
        kind: iotlb::INVALIDATE,
    };
    assert_eq!(c.ack(req::IOTLB_MSG, &inv.bytes(), &[]).unwrap(), 0);
    ours.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let start = std::time::Instant::now();
    post_wide_read(g);
    let mut misses = 0;
    let mut msg = [0u8; 12 + 32];
    while misses < 64 {
        (&*ours).read_exact(&mut msg).expect("a MISS within 5 s");
        let m = IotlbMsg::parse(&msg[12..]).unwrap();
        assert_eq!(update(c, m.iova, m.iova - IO, 4096, 3), 0);
        misses += 1;
    }
    g.wait_used();
    let us = start.elapsed().as_secs_f64() * 1e6;
    assert_eq!(read_status(g), 0);
    (us, misses)
}

/// Measurement, not a check (run with `--ignored --nocapture`, release): a 256 KiB read whose
/// 64 data pages all miss behind a strict guest, the frontend answering each MISS at once over
/// the socket. Misses asked one at a time (as before) against all together, requests
/// alternating between the two back ends; medians.
#[test]
#[ignore]
fn measure_miss_latency_one_at_a_time_against_together() {
    let rounds: usize = std::env::var("ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(201);
    let mut one = wide_blk_behind_iommu(1);
    let mut all = wide_blk_behind_iommu(memvisor_vhost::miss::MAX_MISSES);
    let (mut t_one, mut t_all) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let (us, n) = wide_request_behind_strict_guest(&one.0, &mut one.2, &one.3);
        assert_eq!(n, 64);
        t_one.push(us);
        let (us, n) = wide_request_behind_strict_guest(&all.0, &mut all.2, &all.3);
        assert_eq!(n, 64);
        t_all.push(us);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (m1, ma) = (median(&mut t_one), median(&mut t_all));
    println!(
        "256 KiB read, 64 pages missing, {rounds} requests each: one miss at a time {m1:.0} µs, \
         all misses together {ma:.0} µs (median; {:.1}x)",
        m1 / ma
    );
    for (c, t, ..) in [one, all] {
        drop(c);
        t.join().unwrap().1.ok();
    }
}

/// IOTLB messages a spec-reading frontend could send wrong: each refused (non-zero ack)
/// or harmless, and the back end still answers.
#[test]
fn odd_iotlb_and_inflight_messages_are_refused_or_harmless() {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(iommu_blk(&[0x5a; 4096]));
    let _ours = connect_behind_iommu(&c, &g);
    let m = |iova: u64, size: u64, gpa: u64, perm: u8, kind: u8| {
        IotlbMsg {
            iova,
            size,
            uaddr: USER + gpa,
            perm,
            kind,
        }
        .bytes()
    };
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("update size 0", m(IO, 0, 0, 3, iotlb::UPDATE), false),
        (
            "update wrapping iova",
            m(u64::MAX - 0xfff, 0x2000, 0, 3, iotlb::UPDATE),
            false,
        ),
        (
            "update past the region",
            m(IO, 8 * MIB, 0, 3, iotlb::UPDATE),
            false,
        ),
        ("update perm 0", m(IO, 0x1000, 0, 0, iotlb::UPDATE), false),
        ("update perm 4", m(IO, 0x1000, 0, 4, iotlb::UPDATE), false),
        ("type 0", m(IO, 0x1000, 0, 3, 0), false),
        ("type miss", m(IO, 0x1000, 0, 3, iotlb::MISS), false),
        ("type access fail", m(IO, 0x1000, 0, 3, 4), false),
        (
            "invalidate never mapped",
            m(IO, 0x1000, 0, 0, iotlb::INVALIDATE),
            true,
        ),
        ("invalidate size 0", m(IO, 0, 0, 0, iotlb::INVALIDATE), true),
        (
            "invalidate wrapping",
            m(u64::MAX, u64::MAX, 0, 0, iotlb::INVALIDATE),
            true,
        ),
        (
            "short payload",
            m(IO, 0x1000, 0, 3, iotlb::UPDATE)[..25].to_vec(),
            false,
        ),
        ("good update", m(IO, 0x1000, 0, 3, iotlb::UPDATE), true),
    ];
    for (what, p, ok) in &cases {
        let a = c
            .ack(req::IOTLB_MSG, p, &[])
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(a == 0, *ok, "{what}: ack {a}");
    }
    // Inflight descriptions: shapes that cannot be mapped.
    let f = memfd(MIB);
    let inf = |size: u64, off: u64, nq: u16, qs: u16| {
        proto::Inflight {
            mmap_size: size,
            mmap_offset: off,
            num_queues: nq,
            queue_size: qs,
        }
        .bytes()
    };
    for (what, p) in [
        ("offset wraps", inf(4096, u64::MAX - 4095, 1, 16)),
        ("offset past the file", inf(4096, 4 * MIB, 1, 16)),
        ("size too small", inf(64, 0, 1, 256)),
        ("0 queues", inf(4096, 0, 0, 16)),
        ("queue size 0", inf(4096, 0, 1, 0)),
    ] {
        let a = c
            .ack(req::SET_INFLIGHT_FD, &p, &[f.as_raw_fd()])
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_ne!(a, 0, "inflight {what}: accepted");
    }
    assert!(c.get_u64(req::GET_FEATURES).is_ok());
    drop(c);
    let _ = t.join().unwrap();
}

/// An UPDATE that translates a waiting ring which then cannot start (its descriptor table
/// misaligned): the update itself was applied, yet it is answered as a failure, and the
/// ring's own failure is reported nowhere else.
#[test]
fn an_applied_update_is_not_answered_as_a_failure_because_a_ring_cannot_start() {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(iommu_blk(&[0x5a; 4096]));
    let _ours = connect_behind_iommu(&c, &g);
    let st = |n: u32| proto::vring_state_bytes(0, n);
    let addr = VringAddr {
        desc: IO + RING_AT + 8,
        ..io_vring_addr(&g)
    };
    for (r, p, fds) in [
        (req::SET_VRING_NUM, st(RING_SIZE as u32), vec![]),
        (req::SET_VRING_ADDR, addr.bytes(), vec![]),
        (req::SET_VRING_BASE, st(0), vec![]),
        (
            req::SET_VRING_KICK,
            0u64.to_le_bytes().to_vec(),
            vec![g.kick.as_raw_fd()],
        ),
    ] {
        assert_eq!(c.ack(r, &p, &fds).unwrap(), 0, "{}", req::name(r));
    }
    let a = update(&c, IO + RING_AT, RING_AT, 4096, 3);
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        a, 0,
        "the IOTLB update was applied but acknowledged as failed"
    );
}

/// A ring whose IOVAs are not translated yet waits for an UPDATE with its kick put aside.
/// GET_VRING_BASE stops it; an UPDATE arriving afterwards must not start it again.
#[test]
fn an_iotlb_update_after_get_vring_base_does_not_restart_the_stopped_ring() {
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(iommu_blk(&[0x5a; 4096]));
    let _ours = connect_behind_iommu(&c, &g);
    for (iova, gpa, perm) in [
        (IO + HDR, HDR, 1),
        (IO + DATA, DATA, 3),
        (IO + STATUS, STATUS, 3),
    ] {
        assert_eq!(update(&c, iova, gpa, 4096, perm), 0);
    }
    start_ring_behind_iommu(&c, &g);
    let st = |n: u32| proto::vring_state_bytes(0, n);
    // The frontend stops the ring.
    let base = c.get(req::GET_VRING_BASE, &st(0)).unwrap();
    assert_eq!(base, st(0));
    // The driver still posts a request; then the ring's page gets its translation.
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[
        (IO + HDR, 16, false),
        (IO + DATA, 512, true),
        (IO + STATUS, 1, true),
    ]);
    assert_eq!(update(&c, IO + RING_AT, RING_AT, 4096, 3), 0);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        s[0], 0xff,
        "a ring stopped by GET_VRING_BASE was started by a later IOTLB update and served \
         a request"
    );
}

/// A frontend that does not read its back-end channel (or is blocked waiting for a reply
/// of ours) must not stop the back end answering: MISS messages are written with a
/// blocking write_all on that channel.
#[test]
fn a_full_backend_channel_does_not_hang_the_back_end() {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(iommu_blk(&[0x5a; 4096]));
    let ours = connect_behind_iommu(&c, &g);
    c.socket()
        .set_read_timeout(Some(std::time::Duration::from_secs(3)))
        .unwrap();
    let mut answered = 0;
    let mut failure = None;
    for i in 0..20_000u64 {
        // Ring addresses at three fresh IOVA pages: three MISS messages each time.
        let x = 0x1_0000_0000 + i * 0x4000;
        let a = VringAddr {
            index: 0,
            flags: 0,
            desc: x,
            avail: x + 0x1000,
            used: x + 0x2000,
            log: 0,
        };
        match c.ack(req::SET_VRING_ADDR, &a.bytes(), &[]) {
            Ok(0) => answered += 1,
            Ok(n) => panic!("SET_VRING_ADDR {i} refused: {n}"),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    // Unblock the back end's thread before judging.
    drop(ours);
    drop(c);
    let _ = t.join();
    assert!(
        failure.is_none(),
        "the back end stopped answering after {answered} messages: {failure:?}"
    );
}
