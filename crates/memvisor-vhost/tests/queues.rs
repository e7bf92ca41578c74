//! Queue sizes over vhost-user, as a frontend sets them: every size the virtio specification
//! allows a split ring (a power of two up to 32768) is taken and served; anything else is
//! refused with a failure the frontend sees — a non-zero `REPLY_ACK` when it asked for a reply,
//! the connection closed when it did not (QEMU sends `SET_VRING_NUM` without asking), never a
//! silence after which its guest waits forever. The inflight log is sized for the queue size
//! the frontend names, and a ring full of requests — more than the device keeps in flight — is
//! served whole, the rest waiting on the ring.

mod common;

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use common::*;
use memvisor::{Backing, Gpa, SlotTable};
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::proto::{self, Inflight, VringAddr, flags, protocol, req};
use memvisor_vhost::ring::queue_bytes;
use memvisor_vhost::{Blk, BlkOptions, Device, Error, FrontendMemory, Ring, WireError};

const VRING_DESC_F_NEXT: u16 = 1;
const VRING_DESC_F_WRITE: u16 = 2;
const VRING_DESC_F_INDIRECT: u16 = 4;
/// virtio-blk request types.
const IN: u32 = 0;
/// Where the ring goes in guest memory, and where request headers, indirect tables, status
/// bytes and data go: room for 32768 of each.
const RING: u64 = 0x10_0000;
const HDRS: u64 = 0x20_0000;
const TABLES: u64 = 0x30_0000;
const STATUS: u64 = 0x50_0000;
const DATA: u64 = 0x60_0000;
const GUEST: u64 = 0x60_0000 + 32768 * 512;

/// A connection that ended because the frontend left, not because the back end hung up.
fn clean(end: &memvisor_vhost::Result<()>) -> bool {
    matches!(end, Ok(()) | Err(Error::Wire(WireError::Disconnected)))
}

fn image(bytes: u64) -> File {
    memfd(bytes)
}

/// A sector's pattern: each 512-byte sector of the image says its own number.
fn sector_bytes(sector: u64) -> Vec<u8> {
    (0..512u64)
        .map(|i| (sector.wrapping_mul(131) ^ i) as u8)
        .collect()
}

fn st(index: u32, n: u32) -> Vec<u8> {
    proto::vring_state_bytes(index, n)
}

/// Ring 0's addresses in the frontend's (claimed) address space for a ring of `size` at
/// [`RING`], each part 4-byte aligned.
fn addr(size: u16) -> VringAddr {
    addr_of(0, size)
}

/// [`addr`] for the device's ring `index`.
fn addr_of(index: u32, size: u16) -> VringAddr {
    let n = u64::from(size);
    let desc = RING;
    let avail = desc + 16 * n;
    let used = avail + (6 + 2 * n).next_multiple_of(4);
    VringAddr {
        index,
        flags: 0,
        desc: USER + desc,
        used: USER + used,
        avail: USER + avail,
        log: 0,
    }
}

/// Sets ring 0 up as QEMU does, asking no reply: size, addresses, base, call, kick, enable.
fn start(c: &Client, g: &Guest, size: u16) {
    start_at(c, g, 0, size)
}

/// [`start`] for the device's ring `index` (over the same guest ring at [`RING`]).
fn start_at(c: &Client, g: &Guest, index: u32, size: u16) {
    let i = u64::from(index).to_le_bytes();
    c.send(req::SET_VRING_NUM, 0, &st(index, u32::from(size)), &[])
        .unwrap();
    c.send(req::SET_VRING_ADDR, 0, &addr_of(index, size).bytes(), &[])
        .unwrap();
    c.send(req::SET_VRING_BASE, 0, &st(index, 0), &[]).unwrap();
    c.send(req::SET_VRING_CALL, 0, &i, &[g.call.as_raw_fd()])
        .unwrap();
    c.send(req::SET_VRING_KICK, 0, &i, &[g.kick.as_raw_fd()])
        .unwrap();
    c.send(req::SET_VRING_ENABLE, 0, &st(index, 1), &[])
        .unwrap();
}

/// The driver's side of a split ring at [`RING`], laid out as [`addr`] says; every request
/// is one descriptor (an indirect table), the request's number its head. (memvisor's
/// `GuestRing` keeps a free list whose upkeep grows with the ring's square: too slow for
/// 32768 entries.)
struct Driver {
    mem: SlotTable,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    avail_idx: u16,
    last_used: u16,
}

impl Driver {
    fn new(g: &Guest, size: u16) -> Driver {
        let a = addr(size);
        let d = Driver {
            mem: g.mem.clone(),
            size,
            desc: a.desc - USER,
            avail: a.avail - USER,
            used: a.used - USER,
            avail_idx: 0,
            last_used: 0,
        };
        let end = d.used + 6 + 8 * u64::from(size);
        g.mem
            .write(Gpa(RING), &vec![0u8; (end - RING) as usize])
            .unwrap();
        d
    }

    /// Writes head `k` as one indirect descriptor naming `table` (`n` entries).
    fn add_indirect(&self, k: u16, table: u64, n: u32) {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&table.to_le_bytes());
        raw[8..12].copy_from_slice(&(16 * n).to_le_bytes());
        raw[12..14].copy_from_slice(&VRING_DESC_F_INDIRECT.to_le_bytes());
        self.mem
            .write(Gpa(self.desc + 16 * u64::from(k)), &raw)
            .unwrap();
    }

    /// Makes head `k` available (the ring entry, then the index).
    fn publish(&mut self, k: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        self.mem
            .write(Gpa(self.avail + 4 + 2 * slot), &k.to_le_bytes())
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.mem
            .write(Gpa(self.avail + 2), &self.avail_idx.to_le_bytes())
            .unwrap();
        // With event indexes: an interrupt for the next completion.
        self.mem
            .write(
                Gpa(self.avail + 4 + 2 * u64::from(self.size)),
                &self.last_used.to_le_bytes(),
            )
            .unwrap();
    }

    /// The next used entry's head, if the device returned one.
    fn get_used(&mut self) -> Option<u16> {
        let mut b = [0u8; 2];
        self.mem.read(Gpa(self.used + 2), &mut b).unwrap();
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        if u16::from_le_bytes(b) == self.last_used {
            return None;
        }
        let slot = u64::from(self.last_used % self.size);
        let mut id = [0u8; 4];
        self.mem
            .read(Gpa(self.used + 4 + 8 * slot), &mut id)
            .unwrap();
        self.last_used = self.last_used.wrapping_add(1);
        self.mem
            .write(
                Gpa(self.avail + 4 + 2 * u64::from(self.size)),
                &self.last_used.to_le_bytes(),
            )
            .unwrap();
        Some(u32::from_le_bytes(id) as u16)
    }
}

/// Whether the back end still answers on `c` (a round trip).
fn answers(c: &Client) -> bool {
    c.get_u64(req::GET_QUEUE_NUM).is_ok()
}

/// Puts request `k` on `ring`: a read of sector `sector` through an indirect table of three
/// descriptors (header, 512 bytes of data, status), with descriptor `k` as its head, as Linux
/// does with `VIRTIO_RING_F_INDIRECT_DESC`. Not published.
fn read_indirect(g: &Guest, ring: &Driver, k: u16, sector: u64) {
    let k64 = u64::from(k);
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&IN.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.mem.write(Gpa(HDRS + 16 * k64), &h).unwrap();
    g.mem.write(Gpa(STATUS + k64), &[0xff]).unwrap();
    g.mem.write(Gpa(DATA + 512 * k64), &[0u8; 512]).unwrap();
    let table = TABLES + 48 * k64;
    let descs = [
        (HDRS + 16 * k64, 16, VRING_DESC_F_NEXT, 1u16),
        (
            DATA + 512 * k64,
            512,
            VRING_DESC_F_WRITE | VRING_DESC_F_NEXT,
            2,
        ),
        (STATUS + k64, 1, VRING_DESC_F_WRITE, 0),
    ];
    for (i, (a, len, f, next)) in descs.into_iter().enumerate() {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&a.to_le_bytes());
        raw[8..12].copy_from_slice(&(len as u32).to_le_bytes());
        raw[12..14].copy_from_slice(&f.to_le_bytes());
        raw[14..].copy_from_slice(&next.to_le_bytes());
        g.mem.write(Gpa(table + 16 * i as u64), &raw).unwrap();
    }
    ring.add_indirect(k, table, 3);
}

/// Collects `n` used entries from `ring` (10 s at most); returns the heads.
fn collect(g: &mut Guest, ring: &mut Driver, n: usize) -> Vec<u16> {
    let mut heads = Vec::with_capacity(n);
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while heads.len() < n {
        while let Some(head) = ring.get_used() {
            heads.push(head);
        }
        if heads.len() >= n {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "{} of {n} requests served after 10 s: the rest hang",
            heads.len()
        );
        let mut p = libc::pollfd {
            fd: g.call.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        unsafe { libc::poll(&mut p, 1, 10) };
        if p.revents != 0 {
            let mut b = [0u8; 8];
            let _ = std::io::Read::read(&mut g.call, &mut b);
        }
    }
    heads
}

/// Checks request `k` read `sector`: status 0 and the sector's bytes.
fn check_read(g: &Guest, k: u16, sector: u64) {
    let k64 = u64::from(k);
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS + k64), &mut s).unwrap();
    assert_eq!(s[0], 0, "request {k}: status");
    let mut d = vec![0u8; 512];
    g.mem.read(Gpa(DATA + 512 * k64), &mut d).unwrap();
    assert!(d == sector_bytes(sector), "request {k}: wrong data");
}

fn blk_with_image(sectors: u64) -> Blk {
    let disk = image(sectors * 512);
    for s in 0..sectors {
        disk.write_all_at(&sector_bytes(s), s * 512).unwrap();
    }
    Blk::new(disk, BlkOptions::default()).unwrap()
}

#[test]
fn every_split_ring_size_is_taken_and_served() {
    for size in [1u16, 256, 1024, 32768] {
        let mut g = Guest::new(GUEST);
        let (c, t) = serve(blk_with_image(64));
        negotiate(&c, &g);
        start(&c, &g, size);
        assert!(answers(&c), "ring of {size}: the back end hung up");
        let mut ring = Driver::new(&g, size);
        // Twice round the ring (or 2 requests for a ring of 1), one at a time: the indexes
        // wrap at the ring's size.
        let rounds = (2 * usize::from(size)).clamp(2, 2048);
        for r in 0..rounds {
            let k = (r % usize::from(size)) as u16;
            let sector = r as u64 % 64;
            read_indirect(&g, &ring, k, sector);
            ring.publish(k);
            g.kick.write_all(&1u64.to_le_bytes()).unwrap();
            assert_eq!(collect(&mut g, &mut ring, 1), [k], "ring of {size}");
            check_read(&g, k, sector);
        }
        drop(c);
        let (_, end) = t.join().unwrap();
        assert!(clean(&end), "ring of {size}: {end:?}");
    }
}

/// Sizes the specification does not allow a split ring: refused whether the frontend asks for
/// a reply (a non-zero ack, the connection goes on) or not (the connection closes).
const BAD: [u32; 4] = [0, 3, 1000, 65536];

#[test]
fn a_bad_size_without_need_reply_closes_the_connection() {
    for size in BAD {
        let g = Guest::new(4 * MIB);
        let (c, t) = serve(blk_with_image(64));
        negotiate(&c, &g);
        c.send(req::SET_VRING_NUM, 0, &st(0, size), &[]).unwrap();
        // The frontend learns it at its next message: the back end has hung up.
        assert!(!answers(&c), "size {size}: the connection went on");
        let (backend, end) = t.join().unwrap();
        assert!(
            matches!(end, Err(Error::BadRing(_))),
            "size {size}: {end:?}"
        );
        assert_eq!(backend.stats().refused, 1, "size {size}");
    }
}

#[test]
fn a_bad_size_with_need_reply_is_nacked_and_the_ring_still_works() {
    let mut g = Guest::new(GUEST);
    let (c, t) = serve(blk_with_image(64));
    negotiate(&c, &g);
    for size in BAD {
        let ack = c.ack(req::SET_VRING_NUM, &st(0, size), &[]).unwrap();
        assert_eq!(ack, libc::EINVAL as u64, "size {size}");
    }
    // A ring that does not exist, with a good size: refused too.
    let ack = c.ack(req::SET_VRING_NUM, &st(7, 1024), &[]).unwrap();
    assert_eq!(ack, libc::EINVAL as u64);
    // The same connection then sets a good size and is served.
    assert_eq!(c.ack(req::SET_VRING_NUM, &st(0, 1024), &[]).unwrap(), 0);
    start(&c, &g, 1024);
    let mut ring = Driver::new(&g, 1024);
    read_indirect(&g, &ring, 1000, 5);
    ring.publish(1000);
    g.kick.write_all(&1u64.to_le_bytes()).unwrap();
    assert_eq!(collect(&mut g, &mut ring, 1), [1000]);
    check_read(&g, 1000, 5);
    drop(c);
    let (backend, end) = t.join().unwrap();
    assert!(clean(&end), "{end:?}");
    assert_eq!(backend.stats().refused as usize, BAD.len() + 1);
}

#[test]
fn a_ring_whose_addresses_do_not_fit_is_refused_where_the_frontend_sees_it() {
    // 1 MiB of guest memory cannot hold a ring of 32768 at RING (it needs 896 KiB past 1 MiB).
    let g = Guest::new(MIB + 0x1000);
    // Without a reply asked for: the connection closes.
    let (c, t) = serve(blk_with_image(64));
    negotiate(&c, &g);
    c.send(req::SET_VRING_NUM, 0, &st(0, 32768), &[]).unwrap();
    c.send(req::SET_VRING_ADDR, 0, &addr(32768).bytes(), &[])
        .unwrap();
    assert!(!answers(&c), "the connection went on");
    let (_, end) = t.join().unwrap();
    assert!(end.is_err(), "{end:?}");
    // With one: a non-zero ack, and the connection goes on.
    let (c, t) = serve(blk_with_image(64));
    negotiate(&c, &g);
    assert_eq!(c.ack(req::SET_VRING_NUM, &st(0, 32768), &[]).unwrap(), 0);
    let ack = c
        .ack(req::SET_VRING_ADDR, &addr(32768).bytes(), &[])
        .unwrap();
    assert_ne!(ack, 0, "a ring past the end of guest memory was taken");
    assert!(answers(&c));
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(clean(&end), "{end:?}");
}

/// A device that says it takes rings of at most 256 entries.
struct Small;

impl Device for Small {
    fn name(&self) -> &'static str {
        "small"
    }
    fn features(&self) -> u64 {
        1 << 32
    }
    fn queues(&self) -> u16 {
        1
    }
    fn queue_max(&self) -> u16 {
        256
    }
    fn set_features(&mut self, _: u64) -> memvisor_vhost::Result<()> {
        Ok(())
    }
    fn read_config(&self, _: u32, data: &mut [u8]) {
        data.fill(0);
    }
    fn process(
        &mut self,
        _: u16,
        _: &mut Ring,
        _: &FrontendMemory,
    ) -> memvisor_vhost::Result<memvisor_vhost::device::Processed> {
        Ok(memvisor_vhost::device::Processed::served(false))
    }
    fn reset(&mut self) {}
}

#[test]
fn a_size_above_the_devices_own_maximum_is_refused_the_same_way() {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(Small);
    negotiate(&c, &g);
    assert_eq!(c.ack(req::SET_VRING_NUM, &st(0, 256), &[]).unwrap(), 0);
    assert_eq!(
        c.ack(req::SET_VRING_NUM, &st(0, 512), &[]).unwrap(),
        libc::EINVAL as u64
    );
    c.send(req::SET_VRING_NUM, 0, &st(0, 512), &[]).unwrap();
    assert!(!answers(&c), "the connection went on");
    let (backend, end) = t.join().unwrap();
    assert!(matches!(end, Err(Error::BadRing(_))), "{end:?}");
    assert_eq!(backend.stats().refused, 2);
}

/// The spec's layout ("Inflight I/O tracking", split rings): per queue a 16-byte header
/// (features u64, version, desc_num, last_batch_head, used_idx u16) and a 16-byte entry per
/// head (inflight u8, padding, next u16, counter u64), each queue's part 64-byte aligned, as
/// QEMU's libvhost-user computes it.
fn spec_queue_bytes(queue_size: u64) -> u64 {
    (16 + 16 * queue_size).next_multiple_of(64)
}

#[test]
fn the_inflight_log_is_sized_for_the_queue_size_asked() {
    assert_eq!(queue_bytes(1024), spec_queue_bytes(1024));
    assert_eq!(queue_bytes(32768), spec_queue_bytes(32768));
    for (queues, size) in [(1u16, 1024u16), (1, 32768), (4, 1024), (4, 32768)] {
        let g = Guest::new(4 * MIB);
        let (c, t) = serve(
            Blk::new(
                image(MIB),
                BlkOptions {
                    queues,
                    ..BlkOptions::default()
                },
            )
            .unwrap(),
        );
        negotiate(&c, &g);
        let ask = Inflight {
            mmap_size: 0,
            mmap_offset: 0,
            num_queues: queues,
            queue_size: size,
        };
        let (reply, fds) = c.get_with_fds(req::GET_INFLIGHT_FD, &ask.bytes()).unwrap();
        let got = Inflight::parse(req::GET_INFLIGHT_FD, &reply).unwrap();
        let need = u64::from(queues) * spec_queue_bytes(u64::from(size));
        assert!(
            got.mmap_size >= need && got.mmap_size < need + 4096,
            "{queues} queues of {size}: a log of {} bytes, the layout needs {need}",
            got.mmap_size
        );
        assert_eq!((got.num_queues, got.queue_size), (queues, size));
        let len = File::from(fds.into_iter().next().unwrap())
            .metadata()
            .unwrap()
            .len();
        assert!(
            len >= got.mmap_offset + got.mmap_size,
            "memfd of {len} bytes"
        );
        drop(c);
        let _ = t.join().unwrap();
    }
}

/// A head past 256 left in flight in a 1024-entry ring's log is redone: the log covers every
/// head of the ring, not a fixed number.
#[test]
fn the_inflight_log_covers_every_head_of_a_1024_entry_ring() {
    let size = 1024u16;
    let mut g = Guest::new(GUEST);
    let (c, t) = serve(blk_with_image(64));
    negotiate(&c, &g);
    let ask = Inflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: size,
    };
    let (reply, fds) = c.get_with_fds(req::GET_INFLIGHT_FD, &ask.bytes()).unwrap();
    let got = Inflight::parse(req::GET_INFLIGHT_FD, &reply).unwrap();
    let log = Backing::from_fd(fds.into_iter().next().unwrap(), 0, got.mmap_size).unwrap();
    // What a killed predecessor left: head 1000 taken (counter 7) and not completed, the used
    // index 0; the driver had made it available at index 0.
    let mut ring = Driver::new(&g, size);
    read_indirect(&g, &ring, 1000, 9);
    ring.publish(1000);
    log.write(8, &1u16.to_le_bytes()).unwrap(); // version
    log.write(10, &size.to_le_bytes()).unwrap(); // desc_num
    let entry = 16 + 16 * 1000;
    log.write(entry + 8, &7u64.to_le_bytes()).unwrap();
    log.write(entry, &[1]).unwrap();
    // The ring starts at the used index with the one head to redo: no kick needed.
    c.send(req::SET_VRING_NUM, 0, &st(0, u32::from(size)), &[])
        .unwrap();
    c.send(req::SET_VRING_ADDR, 0, &addr(size).bytes(), &[])
        .unwrap();
    c.send(req::SET_VRING_BASE, 0, &st(0, 0), &[]).unwrap();
    c.send(
        req::SET_VRING_CALL,
        0,
        &0u64.to_le_bytes(),
        &[g.call.as_raw_fd()],
    )
    .unwrap();
    c.send(
        req::SET_VRING_KICK,
        0,
        &0u64.to_le_bytes(),
        &[g.kick.as_raw_fd()],
    )
    .unwrap();
    c.send(req::SET_VRING_ENABLE, 0, &st(0, 1), &[]).unwrap();
    assert_eq!(collect(&mut g, &mut ring, 1), [1000]);
    check_read(&g, 1000, 9);
    let mut e = [0u8];
    log.read(entry, &mut e).unwrap();
    assert_eq!(e[0], 0, "head 1000 still marked in flight");
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(clean(&end), "{end:?}");
}

/// A log made for smaller queues than the ring: refused when the ring starts (the kick), and
/// QEMU asks no reply for the kick, so the connection closes.
#[test]
fn a_ring_larger_than_its_inflight_log_closes_the_connection() {
    let g = Guest::new(GUEST);
    let (c, t) = serve(blk_with_image(64));
    negotiate(&c, &g);
    let ask = Inflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: 256,
    };
    c.get_with_fds(req::GET_INFLIGHT_FD, &ask.bytes()).unwrap();
    // As `start`, but the back end may close the connection at any of these messages, so a
    // later send may find the socket closed (EPIPE): that is the outcome under test.
    let i = 0u64.to_le_bytes();
    let sends = [
        c.send(req::SET_VRING_NUM, 0, &st(0, 1024), &[]),
        c.send(req::SET_VRING_ADDR, 0, &addr_of(0, 1024).bytes(), &[]),
        c.send(req::SET_VRING_BASE, 0, &st(0, 0), &[]),
        c.send(req::SET_VRING_CALL, 0, &i, &[g.call.as_raw_fd()]),
        c.send(req::SET_VRING_KICK, 0, &i, &[g.kick.as_raw_fd()]),
        c.send(req::SET_VRING_ENABLE, 0, &st(0, 1), &[]),
    ];
    for r in sends {
        assert!(
            matches!(r, Ok(()) | Err(Error::Wire(_))),
            "a send failed other than on a closed socket: {r:?}"
        );
    }
    assert!(!answers(&c), "the connection went on");
    let (_, end) = t.join().unwrap();
    assert!(matches!(end, Err(Error::BadRing(_))), "{end:?}");
}

/// A 1024-entry ring with all 1024 requests made available at once, one kick: every one is
/// served with the right data, although the device keeps at most `IN_FLIGHT` (128) in flight
/// — the rest wait on the ring and are taken as earlier ones complete, with no kick. Twice,
/// so the second round's indexes wrap. Ring 0 is served on the back end's own thread.
#[test]
fn a_full_ring_of_1024_requests_is_served_whole() {
    full_ring(1, 0, 1024);
}

/// The same on a ring past the first, which a worker thread serves.
#[test]
fn a_full_ring_of_1024_requests_on_a_worker_is_served_whole() {
    full_ring(2, 1, 1024);
}

/// The same for the largest ring, 32768 requests at once.
#[test]
fn a_full_ring_of_32768_requests_is_served_whole() {
    full_ring(1, 0, 32768);
}

fn full_ring(queues: u16, index: u32, size: u16) {
    assert!(usize::from(size) > memvisor_vhost::disk::IN_FLIGHT);
    let mut g = Guest::new(GUEST);
    let disk = image(4096 * 512);
    for s in 0..4096 {
        disk.write_all_at(&sector_bytes(s), s * 512).unwrap();
    }
    let blk = Blk::new(
        disk,
        BlkOptions {
            queues,
            ..BlkOptions::default()
        },
    )
    .unwrap();
    let (c, t) = serve(blk);
    negotiate(&c, &g);
    start_at(&c, &g, index, size);
    // A round trip: every message handled, the ring lent to its worker if it has one.
    assert!(answers(&c));
    let mut ring = Driver::new(&g, size);
    for round in 0..2u64 {
        let sector = |k: u16| (u64::from(k) * 3 + round * 1024) % 4096;
        for k in 0..size {
            read_indirect(&g, &ring, k, sector(k));
        }
        for k in 0..size {
            ring.publish(k);
        }
        g.kick.write_all(&1u64.to_le_bytes()).unwrap();
        let mut heads = collect(&mut g, &mut ring, usize::from(size));
        heads.sort_unstable();
        assert!(
            heads.iter().copied().eq(0..size),
            "ring {index} of {size}, round {round}: every head returned once"
        );
        for k in 0..size {
            check_read(&g, k, sector(k));
        }
    }
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(clean(&end), "{end:?}");
}

/// The ack path for another request QEMU sends without a reply: a kick refused (the ring's
/// addresses never set) is nacked, not closed, when the frontend asks for a reply.
#[test]
fn a_refused_kick_with_need_reply_is_nacked() {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(blk_with_image(64));
    negotiate(&c, &g);
    let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
    assert_ne!(pf & protocol::REPLY_ACK, 0);
    c.send(
        req::SET_VRING_KICK,
        flags::NEED_REPLY,
        &0u64.to_le_bytes(),
        &[g.kick.as_raw_fd()],
    )
    .unwrap();
    let (_, p) = c.reply().unwrap();
    assert_ne!(proto::u64_payload(req::SET_VRING_KICK, &p).unwrap(), 0);
    assert!(answers(&c));
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(clean(&end), "{end:?}");
}
