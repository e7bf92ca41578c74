//! Chains laid out in every way a conforming driver may lay them out: an indirect table after
//! direct descriptors (the ring's walk), and a blk request's header, data and status byte in
//! descriptors of any size (the device's framing). Checked against VIRTIO 1.2/1.3, 2.6.4 and
//! 2.7.

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;

use common::*;
use memvisor::{DmaConfig, DmaMemory, DmaSpace, Gpa, Iova, Prot};
use memvisor_testkit::guest_ring::{Desc, VRING_DESC_F_NEXT as NEXT, VRING_DESC_F_WRITE as WRITE};
use memvisor_vhost::ring::Desc as Buf;
use memvisor_vhost::{Blk, BlkOptions, Ring};
use virtio_queue::{Queue, QueueT};

const INDIRECT: u16 = 4;
const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;
const TABLE: u64 = 0x90000;

fn d(addr: u64, len: u32, flags: u16, next: u16) -> Desc {
    Desc {
        addr,
        len,
        flags,
        next,
    }
}

fn raw(e: &Desc) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[..8].copy_from_slice(&e.addr.to_le_bytes());
    r[8..12].copy_from_slice(&e.len.to_le_bytes());
    r[12..14].copy_from_slice(&e.flags.to_le_bytes());
    r[14..].copy_from_slice(&e.next.to_le_bytes());
    r
}

/// Writes an indirect table at `at`.
fn table(g: &Guest, at: u64, descs: &[Desc]) {
    for (k, e) in descs.iter().enumerate() {
        g.mem.write(Gpa(at + 16 * k as u64), &raw(e)).unwrap();
    }
}

fn device_view(g: &Guest) -> DmaMemory {
    let dma = DmaSpace::new(DmaConfig::default()).unwrap();
    dma.map_guest(Iova(0), &g.mem.snapshot(), Gpa(0), g.size, Prot::RW)
        .unwrap();
    dma.memory()
}

fn ring(g: &Guest) -> Ring {
    let mut q = Queue::new(RING_SIZE).unwrap();
    g.ring.configure(&mut q);
    Ring::plain(q)
}

fn buf(addr: u64, len: u32, write: bool) -> Buf {
    Buf { addr, len, write }
}

// ---------------------------------------------------------------------------------------------
// 2.7.5.3.2: "The device MUST handle the case of zero or more normal chained descriptors
// followed by a single descriptor with flags & VIRTQ_DESC_F_INDIRECT."

#[test]
fn a_direct_descriptor_followed_by_an_indirect_one_is_walked_into_the_table() {
    let mut g = Guest::new(MIB);
    let mem = device_view(&g);
    let r = ring(&g);
    table(
        &g,
        TABLE,
        &[d(DATA, 512, WRITE | NEXT, 1), d(STATUS, 1, WRITE, 0)],
    );
    let head = g
        .ring
        .add_raw(&[0, 1], &[d(HDR, 16, NEXT, 1), d(TABLE, 32, INDIRECT, 0)])
        .unwrap();
    let mut out = Vec::new();
    let got = r.read_chain(&mem, head, &mut out);
    assert!(got.is_ok(), "refused: {got:?}");
    assert_eq!(
        out,
        vec![
            buf(HDR, 16, false),
            buf(DATA, 512, true),
            buf(STATUS, 1, true)
        ],
        "the indirect table's descriptors follow the direct one"
    );
}

/// The same through the blk back end: a read whose header is a direct descriptor and whose
/// data and status are in an indirect table the next descriptor names. That descriptor has
/// VIRTQ_DESC_F_WRITE set, which the device MUST ignore (2.7.5.3.2).
#[test]
fn blk_serves_a_read_whose_data_and_status_are_in_a_trailing_indirect_table() {
    let disk = memfd(MIB);
    disk.write_all_at(&[0x5a; 512], 0).unwrap();
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    // The status descriptor has no NEXT flag: its `next` (0xabcd) means nothing to the device.
    let tbl = [d(DATA, 512, WRITE | NEXT, 1), d(STATUS, 1, WRITE, 0xabcd)];
    table(&g, TABLE, &tbl);
    let head = g
        .ring
        .add_raw(
            &[0, 1],
            &[d(HDR, 16, NEXT, 1), d(TABLE, 32, INDIRECT | WRITE, 0)],
        )
        .unwrap();
    g.ring.publish(head).unwrap();
    g.kick();
    let used = g.wait_used();
    let mut st = [0u8];
    g.mem.read(Gpa(STATUS), &mut st).unwrap();
    let mut tb = [0u8; 32];
    g.mem.read(Gpa(TABLE), &mut tb).unwrap();
    let mut data = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut data).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        tb[16..],
        raw(&tbl[1]),
        "the device wrote into the indirect descriptor table (2.7.5.1: a device MUST NOT \
         write to any descriptor table entry)"
    );
    assert_eq!((used, st[0]), ((head, 513), 0), "served, status OK");
    assert!(data.iter().all(|&b| b == 0x5a), "the sector was read");
}

// ---------------------------------------------------------------------------------------------
// 2.6.4 (Message Framing): "The device MUST NOT make assumptions about the particular
// arrangement of descriptors." A blk request's header, data and status are a byte stream.

fn blk_with_disk() -> (
    File,
    Guest,
    memvisor_testkit::vhost::client::Client,
    std::thread::JoinHandle<Served<Blk>>,
) {
    let disk = memfd(MIB);
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    (disk, g, c, t)
}

/// A write whose header and data are one 528-byte readable descriptor, then the status.
#[test]
fn blk_write_with_header_and_data_in_one_descriptor_reaches_the_image() {
    let (disk, mut g, c, t) = blk_with_disk();
    let mut req = vec![0u8; 16 + 512];
    req[0] = 1; // OUT
    req[8..16].copy_from_slice(&3u64.to_le_bytes()); // sector 3
    req[16..].fill(0xa7);
    g.mem.write(Gpa(HDR), &req).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[(HDR, 528, false), (STATUS, 1, true)]);
    let _ = g.wait_used();
    let mut st = [0u8];
    g.mem.read(Gpa(STATUS), &mut st).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    let mut on_disk = [0u8; 512];
    disk.read_exact_at(&mut on_disk, 3 * 512).unwrap();
    let reached = on_disk.iter().all(|&b| b == 0xa7);
    assert!(
        st[0] != 0 || reached,
        "status OK (0) but the 512 bytes never reached sector 3: a silent lost write"
    );
    assert!(reached, "status {}: the write was not carried out", st[0]);
}

/// A read whose data and status are one 513-byte writable descriptor.
#[test]
fn blk_read_with_data_and_status_in_one_descriptor_fills_the_data() {
    let (disk, mut g, c, t) = blk_with_disk();
    disk.write_all_at(&[0x3c; 512], 0).unwrap();
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap(); // IN, sector 0
    g.mem.write(Gpa(DATA), &[0u8; 513]).unwrap();
    g.mem.write(Gpa(DATA + 512), &[0xff]).unwrap();
    g.post(&[(HDR, 16, false), (DATA, 513, true)]);
    let (_, written) = g.wait_used();
    let mut got = [0u8; 513];
    g.mem.read(Gpa(DATA), &mut got).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    let filled = got[..512].iter().all(|&b| b == 0x3c);
    assert!(
        got[512] != 0 || filled,
        "status OK (0), {written} bytes reported written, but the data was never read into \
         the buffer"
    );
    assert!(filled, "status {}: the read was not carried out", got[512]);
}

/// A header split over two descriptors (8 + 8 bytes).
#[test]
fn blk_read_with_a_header_in_two_descriptors_is_served() {
    let (disk, mut g, c, t) = blk_with_disk();
    disk.write_all_at(&[0x3c; 512], 0).unwrap();
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[
        (HDR, 8, false),
        (HDR + 8, 8, false),
        (DATA, 512, true),
        (STATUS, 1, true),
    ]);
    let _ = g.wait_used();
    let mut st = [0u8];
    g.mem.read(Gpa(STATUS), &mut st).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(st[0], 0, "status");
}

/// A zero-length device-readable descriptor after the header of a read: the readable part
/// is still the 16-byte header (2.6.4: no assumption about the arrangement).
#[test]
fn blk_read_with_a_zero_length_readable_descriptor_after_the_header_is_served() {
    let (disk, mut g, c, t) = blk_with_disk();
    disk.write_all_at(&[0x3c; 512], 0).unwrap();
    g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[
        (HDR, 16, false),
        (HDR + 16, 0, false),
        (DATA, 512, true),
        (STATUS, 1, true),
    ]);
    let used = g.wait_used();
    let mut st = [0u8];
    g.mem.read(Gpa(STATUS), &mut st).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!((st[0], used.1), (0, 513), "status, bytes written");
}

/// A header in two descriptors that are not side by side in memory (8 + 8 bytes: the sector
/// is all in the second), and a
/// `GET_ID` answer over two writable descriptors (8 + 12 bytes), with the status byte in the
/// second: the header is read across its pieces, the id written across its.
#[test]
fn blk_reads_a_header_from_pieces_apart_and_writes_an_id_across_buffers() {
    let (disk, mut g, c, t) = blk_with_disk();
    disk.write_all_at(&[0x3c; 512], 5 * 512).unwrap();
    let mut hdr = [0u8; 16];
    hdr[8..16].copy_from_slice(&5u64.to_le_bytes()); // IN, sector 5
    g.mem.write(Gpa(HDR), &hdr[..8]).unwrap();
    g.mem.write(Gpa(HDR + 0x1000), &hdr[8..]).unwrap();
    g.mem.write(Gpa(DATA), &[0u8; 512]).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[
        (HDR, 8, false),
        (HDR + 0x1000, 8, false),
        (DATA, 512, true),
        (STATUS, 1, true),
    ]);
    let (_, len) = g.wait_used();
    let mut st = [0u8];
    g.mem.read(Gpa(STATUS), &mut st).unwrap();
    let mut got = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut got).unwrap();
    assert_eq!((st[0], len), (0, 513), "status and used length of the read");
    assert!(
        got.iter().all(|&b| b == 0x3c),
        "sector 5 read through a split header"
    );

    // GET_ID (type 8): the 20-byte id over 8 + 13 writable bytes, the last one the status.
    let mut hdr = [0u8; 16];
    hdr[0] = 8;
    g.mem.write(Gpa(HDR), &hdr).unwrap();
    g.mem.write(Gpa(DATA), &[0xee; 8]).unwrap();
    g.mem.write(Gpa(DATA + 0x1000), &[0xee; 13]).unwrap();
    g.post(&[(HDR, 16, false), (DATA, 8, true), (DATA + 0x1000, 13, true)]);
    let (_, len) = g.wait_used();
    let mut a = [0u8; 8];
    let mut b = [0u8; 13];
    g.mem.read(Gpa(DATA), &mut a).unwrap();
    g.mem.read(Gpa(DATA + 0x1000), &mut b).unwrap();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        (b[12], len),
        (0, 21),
        "GET_ID's status byte and used length"
    );
    assert!(
        a.iter().chain(&b[..12]).all(|&x| x != 0xee),
        "the id fills both buffers: {a:02x?} {b:02x?}"
    );
}
