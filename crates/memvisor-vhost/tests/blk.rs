//! virtio-blk through the whole vhost-user path: a test frontend sets up memory and a ring the
//! way QEMU does, posts requests as a guest driver would, and checks guest memory and the image.

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::{Blk, BlkOptions};

const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;

/// A disk image: a memfd, so parallel tests never share a file.
fn image(bytes: u64) -> File {
    memfd(bytes)
}

fn header(g: &Guest, kind: u32, sector: u64) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.mem.write(Gpa(HDR), &h).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
}

fn status(g: &Guest) -> u8 {
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    s[0]
}

/// Posts header, data buffers and status; returns (status, bytes the device reported written).
fn request(g: &mut Guest, kind: u32, sector: u64, data: &[(u64, u32, bool)]) -> (u8, u32) {
    header(g, kind, sector);
    let mut bufs = vec![(HDR, 16, false)];
    bufs.extend_from_slice(data);
    bufs.push((STATUS, 1, true));
    g.post(&bufs);
    let (_, written) = g.wait_used();
    (status(g), written)
}

#[test]
fn writes_and_reads_move_between_guest_memory_and_the_image() {
    let disk = image(4 * MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);

    // OUT: 3 buffers, 12 KiB + 512 B, from guest memory to sector 8, crossing pages unaligned.
    let pattern: Vec<u8> = (0..12800u32).map(|i| (i * 31 + 7) as u8).collect();
    g.mem.write(Gpa(DATA + 100), &pattern).unwrap();
    let bufs = [
        (DATA + 100, 4096, false),
        (DATA + 4196, 8192, false),
        (DATA + 12388, 512, false),
    ];
    assert_eq!(request(&mut g, 1, 8, &bufs), (0, 1));
    let mut on_disk = vec![0u8; pattern.len()];
    disk.read_exact_at(&mut on_disk, 8 * 512).unwrap();
    assert!(
        on_disk == pattern,
        "the image does not hold what the guest wrote"
    );

    // IN: back into another place, two buffers.
    let back = DATA + 0x10000 + 3;
    let bufs = [(back, 6400, true), (back + 6400, 6400, true)];
    assert_eq!(request(&mut g, 0, 8, &bufs), (0, 12801));
    let mut got = vec![0u8; pattern.len()];
    g.mem.read(Gpa(back), &mut got).unwrap();
    assert!(
        got == pattern,
        "guest memory does not hold what the image has"
    );

    // GET_ID and FLUSH.
    assert_eq!(request(&mut g, 8, 0, &[(DATA, 20, true)]), (0, 21));
    let mut id = [0u8; 20];
    g.mem.read(Gpa(DATA), &mut id).unwrap();
    assert_eq!(&id[..8], b"memvisor");
    assert_eq!(request(&mut g, 4, 0, &[]).0, 0);

    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = &backend.device().stats;
    assert_eq!((s.reads, s.writes, s.flushes, s.failed), (1, 1, 1, 0));
    assert_eq!((s.bytes_read, s.bytes_written), (12800, 12800));
    // The write touched 4 pages (unaligned 12.5 KiB), the read 4: both in the 4-page bucket.
    assert_eq!(s.npage_histogram, vec![0, 0, 2]);
    assert_eq!(
        backend.memory().dma().device_pinned_pages(),
        0,
        "pins left behind"
    );
}

#[test]
fn bad_requests_are_answered_ioerr_and_the_queue_keeps_working() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    disk.write_all_at(&[0xaa; 512], 0).unwrap();

    // Past the end of the disk (2048 sectors).
    assert_eq!(request(&mut g, 0, 2048, &[(DATA, 512, true)]).0, 1);
    assert_eq!(request(&mut g, 0, u64::MAX, &[(DATA, 512, true)]).0, 1);
    // Not whole sectors.
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 100, true)]).0, 1);
    // A read into a driver-readable buffer, a write from a device-writable one.
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 512, false)]).0, 1);
    assert_eq!(request(&mut g, 1, 0, &[(DATA, 512, true)]).0, 1);
    // A buffer outside guest memory, and one that runs off its end.
    assert_eq!(request(&mut g, 0, 0, &[(64 * MIB, 512, true)]).0, 1);
    assert_eq!(request(&mut g, 0, 0, &[(4 * MIB - 256, 512, true)]).0, 1);
    // Unknown type.
    assert_eq!(request(&mut g, 77, 0, &[]).0, 2);
    // Nothing was read into guest memory by any of them.
    let mut d = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert!(d.iter().all(|&b| b == 0));
    // A chain with no status descriptor: the device cannot answer it, but returns it.
    header(&g, 0, 0);
    g.post(&[(HDR, 16, false)]);
    g.wait_used();
    // A good request still works.
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 512, true)]), (0, 513));
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert_eq!(d, [0xaa; 512]);

    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats.failed, 9);
    assert_eq!(
        backend.memory().dma().device_pinned_pages(),
        0,
        "pins left behind"
    );
}

/// Found by the `blk_chain` fuzz target: a status descriptor whose end runs past the top of the
/// address space. Its last byte was computed with a plain add, which panicked in a debug build
/// and in a release build wrapped to a low guest address outside the chain and wrote the status
/// there.
#[test]
fn a_status_descriptor_past_the_top_of_the_address_space_is_not_written() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    // Where a wrapped end would land: 0xffff_ffff_ffff_4000 + 0xfffe - 1 = 0x3ffd (mod 2^64).
    let wrapped = 0x3ffd;
    g.mem.write(Gpa(wrapped), &[0x77]).unwrap();
    header(&g, 0, 0);
    g.post(&[(HDR, 16, false), (0xffff_ffff_ffff_4000, 0xfffe, true)]);
    let (_, written) = g.wait_used();
    assert_eq!(written, 0, "nothing was written into the chain");
    let mut b = [0u8];
    g.mem.read(Gpa(wrapped), &mut b).unwrap();
    assert_eq!(b[0], 0x77, "the status went to a wrapped address");
    // The queue still serves a good request.
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 512, true)]), (0, 513));
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats.failed, 1);
}

/// The same wrap for a data buffer: the pages to pin were computed from `addr + len - 1` with a
/// plain add (found reading the code beside the fuzzer's find).
#[test]
fn a_data_buffer_past_the_top_of_the_address_space_is_refused() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    let top = (u64::MAX - 255, 512, true);
    assert_eq!(request(&mut g, 0, 0, &[top]).0, 1, "IOERR");
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 512, true)]), (0, 513));
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats.failed, 1);
}

#[test]
fn every_queue_of_a_multiqueue_device_serves_requests() {
    let disk = image(MIB);
    disk.write_all_at(&[0x3c; 512], 512 * 5).unwrap();
    let mut g = Guest::new(4 * MIB);
    let options = BlkOptions {
        queues: 4,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), options).unwrap());
    assert_eq!(
        c.get_u64(memvisor_vhost::proto::req::GET_QUEUE_NUM)
            .unwrap(),
        4
    );
    negotiate(&c, &g);
    // The guest's one ring, as the device's last queue: queues 0-2 stay unused.
    start_ring_at(&c, &g, 3);
    assert_eq!(request(&mut g, 0, 5, &[(DATA, 512, true)]), (0, 513));
    let mut d = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert_eq!(d, [0x3c; 512]);
    // num_queues in the config space.
    let cfg = c
        .get(
            memvisor_vhost::proto::req::GET_CONFIG,
            &memvisor_vhost::proto::config_bytes(34, 0, &[0, 0]),
        )
        .unwrap();
    assert_eq!(&cfg[12..], &4u16.to_le_bytes());
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats.reads, 1);
}

#[test]
fn a_region_is_removed_only_after_the_request_on_it_ended() {
    // Issue 31's rule for REM_MEM_REG: a request into a region the frontend removes right after
    // the kick has ended (done whole) or has not started (it then fails) when the removal is
    // acknowledged, and nothing lands in the region's memory after that.
    use memvisor_vhost::proto::{self, Region, req};
    use std::os::fd::AsRawFd;
    const LEN: u64 = 0x40000;
    const HIGH: u64 = 64 * MIB; // the second region's guest physical address
    let disk = image(MIB);
    disk.write_all_at(&[0x5a; LEN as usize], 0).unwrap();
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    let (mut before, mut after) = (0, 0);
    for round in 0..6 {
        let high = memfd(MIB);
        let region = Region {
            gpa: HIGH,
            size: MIB,
            user_addr: USER + HIGH,
            mmap_offset: 0,
        };
        let bytes = proto::single_region_bytes(&region);
        assert_eq!(
            c.ack(req::ADD_MEM_REG, &bytes, &[high.as_raw_fd()])
                .unwrap(),
            0
        );
        header(&g, 0, 0); // IN, sector 0
        g.post(&[
            (HDR, 16, false),
            (HIGH, LEN as u32, true),
            (STATUS, 1, true),
        ]);
        assert_eq!(c.ack(req::REM_MEM_REG, &bytes, &[]).unwrap(), 0);
        // Acknowledged: the request has ended, or has not started.
        let at_ack = status(&g);
        let mut data = vec![0u8; LEN as usize];
        high.read_exact_at(&mut data, 0).unwrap();
        if ended_at_ack(round, at_ack, &data, 0x5a) {
            before += 1;
        } else {
            after += 1;
        }
        high.write_all_at(&[0xee; LEN as usize], 0).unwrap();
        g.wait_used();
        high.read_exact_at(&mut data, 0).unwrap();
        untouched_after_ack(round, at_ack, status(&g), &data, 0xee);
    }
    println!("{before} requests ended before the acknowledgement, {after} failed after it");
    drop(c);
    t.join().unwrap().1.ok();
}

/// A disk whose I/O fails (here an image open read-only, so every pwritev fails with EBADF; on a
/// real disk EIO or ENOSPC): the request is answered IOERR, counted as an I/O error, nothing
/// stays pinned, and the next request on the same queue works.
#[test]
fn a_failing_disk_fails_that_request_alone() {
    use std::os::fd::AsRawFd;
    let disk = image(MIB);
    disk.write_all_at(&[0x5a; 512], 0).unwrap();
    let read_only = File::open(format!("/proc/self/fd/{}", disk.as_raw_fd())).unwrap();
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(read_only, BlkOptions::default()).unwrap());
    setup(&c, &g);
    g.mem.write(Gpa(DATA), &[0x11; 4096]).unwrap();
    assert_eq!(request(&mut g, 1, 0, &[(DATA, 4096, false)]), (1, 1));
    let mut on_disk = [0u8; 512];
    disk.read_exact_at(&mut on_disk, 0).unwrap();
    assert_eq!(on_disk, [0x5a; 512], "the failed write changed the image");
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 512, true)]), (0, 513));
    let mut d = [0u8; 512];
    g.mem.read(Gpa(DATA), &mut d).unwrap();
    assert_eq!(d, [0x5a; 512]);

    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = &backend.device().stats;
    assert_eq!((s.failed, s.io_errors, s.pin_errors), (1, 1, 0));
    assert_eq!((s.reads, s.writes), (1, 0));
    assert_eq!(
        backend.memory().dma().device_pinned_pages(),
        0,
        "pins left behind"
    );
}
