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
    let s = backend.device().stats();
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
    assert_eq!(backend.device().stats().failed, 9);
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
    assert_eq!(backend.device().stats().failed, 1);
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
    assert_eq!(backend.device().stats().failed, 1);
}

/// Every chain is read by the ring's own walker: a malformed one, as a hostile or broken driver
/// may post, fails alone. Its head comes back with nothing written, no status byte is written
/// (a malformed chain's last byte is not to be trusted), the failure is counted, and the next
/// request on the ring is served.
#[test]
fn malformed_chains_fail_alone_and_the_ring_goes_on() {
    use memvisor_testkit::guest_ring::{Desc, VRING_DESC_F_NEXT as NEXT, VRING_DESC_F_WRITE};
    const INDIRECT: u16 = 4;
    const TABLE: u64 = 0x90000;
    let d = |addr, len, flags, next| Desc {
        addr,
        len,
        flags,
        next,
    };
    let disk = image(MIB);
    disk.write_all_at(&[0x3c; 512], 0).unwrap();
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    // An indirect table whose second entry names another indirect table.
    for (k, e) in [d(HDR, 16, NEXT, 1), d(TABLE, 32, INDIRECT, 0)]
        .iter()
        .enumerate()
    {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&e.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&e.len.to_le_bytes());
        raw[12..14].copy_from_slice(&e.flags.to_le_bytes());
        raw[14..].copy_from_slice(&e.next.to_le_bytes());
        g.mem.write(Gpa(TABLE + 16 * k as u64), &raw).unwrap();
    }
    let cases = [
        (
            "a loop",
            vec![0, 1],
            vec![
                d(HDR, 16, NEXT, 1),
                d(STATUS, 1, VRING_DESC_F_WRITE | NEXT, 0),
            ],
        ),
        (
            "a next past the table",
            vec![0],
            vec![d(HDR, 16, NEXT, RING_SIZE + 3)],
        ),
        (
            "an indirect table of 20 bytes",
            vec![0],
            vec![d(TABLE, 20, INDIRECT, 0)],
        ),
        (
            "an indirect table inside one",
            vec![0],
            vec![d(TABLE, 32, INDIRECT, 0)],
        ),
        (
            "an indirect table past guest memory",
            vec![0],
            vec![d(64 * MIB, 48, INDIRECT, 0)],
        ),
    ];
    let n = cases.len() as u64;
    for (what, ids, descs) in cases {
        header(&g, 0, 0);
        let head = g.ring.add_raw(&ids, &descs).unwrap();
        g.ring.publish(head).unwrap();
        g.kick();
        assert_eq!(
            g.wait_used(),
            (head, 0),
            "{what}: returned, nothing written"
        );
        assert_eq!(status(&g), 0xff, "{what}: no status byte written");
        let next = request(&mut g, 0, 0, &[(DATA, 512, true)]);
        assert_eq!(next, (0, 513), "{what}: the next request is served");
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats().failed, n);
    assert_eq!(backend.device().stats().reads, n);
}

/// A driver may make at most the ring's size of heads available beyond those the device took
/// (virtio 1.2, 2.7.6). An available index further ahead is a broken ring: it is stopped and
/// serves nothing more (no stale ring entry is taken for a request), and the back end goes on
/// answering its frontend.
#[test]
fn an_available_index_more_than_the_ring_ahead_stops_the_ring() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(request(&mut g, 0, 0, &[(DATA, 512, true)]), (0, 513));
    // One head taken; an index RING_SIZE + 1 past it.
    g.ring.set_avail_idx(2 + RING_SIZE).unwrap();
    g.kick();
    std::thread::sleep(std::time::Duration::from_millis(200));
    // The driver's index back where its ring is, and a good request: not served.
    g.ring.set_avail_idx(1).unwrap();
    header(&g, 0, 0);
    g.post(&[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        g.ring.get_used().unwrap(),
        None,
        "a stopped ring serves nothing"
    );
    assert_eq!(status(&g), 0xff);
    assert!(
        c.get_u64(memvisor_vhost::proto::req::GET_QUEUE_NUM).is_ok(),
        "the back end still answers"
    );
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats().reads, 1);
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
    let blk = Blk::new(disk.try_clone().unwrap(), options).unwrap();
    let counts = blk.live();
    let (c, t, live) = serve_live(blk);
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
    // Queue 3 is served by a thread of its own.
    let threads: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    assert!(
        threads.iter().any(|t| t == "memvisor-q3"),
        "a worker thread for queue 3 among {threads:?}"
    );
    // Live, while the worker still holds the ring: the read is on queue 3's counters, the
    // kick on ring 3's row, served on its worker.
    let per_queue: Vec<u64> = counts.queues().iter().map(|q| q.reads).collect();
    assert_eq!(per_queue, vec![0, 0, 0, 1]);
    assert_eq!(counts.total().pinned_pages, 0, "nothing pinned once idle");
    let rows = live.queues();
    assert!(rows[3].on_worker && rows[3].running && rows[3].worker_kicks >= 1);
    assert_eq!(rows[3].kicks, rows[3].worker_kicks);
    assert!(rows[..3].iter().all(|r| r.kicks == 0 && !r.running));
    assert!(live.connected());
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
    assert_eq!(backend.device().stats().reads, 1);
    assert!(backend.stats().lent >= 1 && backend.stats().kicks >= 1);
    assert!(!live.connected());
    assert!(
        !live.queues()[3].on_worker,
        "the ring came back from its worker"
    );
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

#[test]
fn a_region_of_any_byte_size_is_mapped_as_whole_pages() {
    // libblkio hands over its rings as a region of 0x3b10 bytes in a memfd of exactly 0x3b10
    // bytes; the specification allows any size. The back end maps the whole pages under it (the
    // last one passes the file's end) and serves requests whose buffers are in it.
    use memvisor_vhost::proto::{self, Region, req};
    use std::os::fd::AsRawFd;
    const SMALL: u64 = 0x3b10;
    const AT: u64 = 64 * MIB;
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let small = memfd(SMALL);
    let pattern: Vec<u8> = (0..0x3a00u32).map(|i| (i * 13 + 1) as u8).collect();
    small.write_all_at(&pattern, 0x100).unwrap();
    let region = Region {
        gpa: AT,
        size: SMALL,
        user_addr: USER + AT,
        mmap_offset: 0,
    };
    let add = proto::single_region_bytes(&region);
    assert_eq!(
        c.ack(req::ADD_MEM_REG, &add, &[small.as_raw_fd()]).unwrap(),
        0,
        "a region of {SMALL:#x} bytes in a file of {SMALL:#x} bytes"
    );
    // OUT from the small region to sector 2, then IN back into it at another offset.
    let (st, _) = request(&mut g, 1, 2, &[(AT + 0x100, 0x3a00, false)]);
    assert_eq!(st, 0);
    let mut on_disk = vec![0u8; 0x3a00];
    disk.read_exact_at(&mut on_disk, 2 * 512).unwrap();
    assert!(
        on_disk == pattern,
        "the image holds what the small region held"
    );
    small.write_all_at(&[0; 0x200], 0x3800).unwrap();
    let (st, n) = request(&mut g, 0, 2, &[(AT + 0x3800, 0x200, true)]);
    assert_eq!((st, n), (0, 0x201));
    let mut back = vec![0u8; 0x200];
    small.read_exact_at(&mut back, 0x3800).unwrap();
    assert!(
        back == pattern[..0x200],
        "the read landed in the small region"
    );
    assert_eq!(c.ack(req::REM_MEM_REG, &add, &[]).unwrap(), 0);

    // A region whose guest address and file offset differ within a page cannot be mapped as
    // pages; one that shares a page with another cannot either; a page wholly past the file's
    // end would fault. Each is refused with EINVAL and leaves the memory as it was.
    let refuse = |r: Region, len: u64, what: &str| {
        let f = memfd(len);
        let got = c
            .ack(
                req::ADD_MEM_REG,
                &proto::single_region_bytes(&r),
                &[f.as_raw_fd()],
            )
            .unwrap();
        assert_ne!(got, 0, "{what} was accepted");
    };
    let at = |gpa: u64, size: u64, off: u64| Region {
        gpa,
        size,
        user_addr: USER + gpa,
        mmap_offset: off,
    };
    refuse(
        at(AT + 0x100, 0x1000, 0),
        0x2000,
        "guest and file offset apart",
    );
    refuse(
        at(4 * MIB - 0x10, 0x1000, 0xff0),
        0x2000,
        "a page shared with the first region",
    );
    refuse(
        at(AT, 0x2001, 0),
        0x1000,
        "a page wholly past the file's end",
    );
    // The first region still serves.
    g.mem.write(Gpa(DATA), &[7; 512]).unwrap();
    assert_eq!(request(&mut g, 1, 0, &[(DATA, 512, false)]).0, 0);
    drop(c);
    t.join().unwrap().1.ok();
}

#[test]
fn a_request_of_more_than_512_pages_in_one_segment_is_served() {
    // The config offers no size_max, so one segment of any length is legal (libblkio sends
    // 4 MiB and 8 MiB in one); pin_pages takes at most 512 pages per call.
    const BIG: u64 = 5 * MIB; // 1280 pages, 1281 with the unaligned start
    const AT: u64 = MIB + 0x200;
    let disk = image(8 * MIB);
    let mut g = Guest::new(8 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let pattern: Vec<u8> = (0..BIG as u32).map(|i| (i % 251) as u8).collect();
    g.mem.write(Gpa(AT), &pattern).unwrap();
    assert_eq!(request(&mut g, 1, 8, &[(AT, BIG as u32, false)]).0, 0);
    let mut on_disk = vec![0u8; BIG as usize];
    disk.read_exact_at(&mut on_disk, 8 * 512).unwrap();
    assert!(on_disk == pattern, "the image holds the 5 MiB written");
    g.mem.write(Gpa(AT), &vec![0; BIG as usize]).unwrap();
    let (st, n) = request(&mut g, 0, 8, &[(AT, BIG as u32, true)]);
    assert_eq!((st, n), (0, BIG as u32 + 1));
    let mut back = vec![0u8; BIG as usize];
    g.mem.read(Gpa(AT), &mut back).unwrap();
    assert!(back == pattern, "the 5 MiB read back");
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats().failed, 0);
}

/// An image opened O_DIRECT in the temporary directory, or why it cannot be.
fn direct_image(bytes: u64) -> Result<(File, std::path::PathBuf), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let dir = std::env::temp_dir();
    let path = dir.join(format!("memvisor-direct-{}.img", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
        .map_err(|e| format!("O_DIRECT on {}: {e}", dir.display()))?;
    f.set_len(bytes).unwrap();
    Ok((f, path))
}

#[test]
fn an_o_direct_image_serves_aligned_buffers_directly_and_copies_unaligned_ones() {
    let (disk, path) = match direct_image(4 * MIB) {
        Ok(d) => d,
        Err(why) => {
            skipped(&format!("an_o_direct_image_...: {why}"));
            return;
        }
    };
    let mut g = Guest::new(4 * MIB);
    let blk = Blk::new(disk, BlkOptions::default()).unwrap();
    let (c, t) = serve(blk);
    setup(&c, &g);
    // Page-aligned buffers go straight to the file; buffers at odd addresses (legal in virtio;
    // no file system's O_DIRECT takes them) are copied through an aligned buffer. Both land on the image, both read back.
    let a: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    let b: Vec<u8> = (0..4608u32).map(|i| (i * 11 + 5) as u8).collect();
    g.mem.write(Gpa(DATA), &a).unwrap();
    g.mem.write(Gpa(DATA + 0x4000 + 101), &b).unwrap();
    assert_eq!(request(&mut g, 1, 0, &[(DATA, 8192, false)]).0, 0);
    assert_eq!(
        request(&mut g, 1, 64, &[(DATA + 0x4000 + 101, 4608, false)]).0,
        0
    );
    let plain = File::open(&path).unwrap();
    let mut on_disk = vec![0u8; 8192];
    plain.read_exact_at(&mut on_disk, 0).unwrap();
    assert!(on_disk == a, "the aligned write reached the image");
    let mut on_disk = vec![0u8; 4608];
    plain.read_exact_at(&mut on_disk, 64 * 512).unwrap();
    assert!(on_disk == b, "the unaligned write reached the image");
    g.mem.write(Gpa(DATA), &[0; 0x8000]).unwrap();
    let (st, n) = request(&mut g, 0, 64, &[(DATA + 0x211, 4608, true)]);
    assert_eq!((st, n), (0, 4609));
    let mut back = vec![0u8; 4608];
    g.mem.read(Gpa(DATA + 0x211), &mut back).unwrap();
    assert!(back == b, "the unaligned read landed");
    let (st, _) = request(&mut g, 0, 0, &[(DATA + 0x4000, 8192, true)]);
    assert_eq!(st, 0);
    let mut back = vec![0u8; 8192];
    g.mem.read(Gpa(DATA + 0x4000), &mut back).unwrap();
    assert!(back == a, "the aligned read landed");
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!(
        (s.bounced, s.failed),
        (2, 0),
        "two transfers copied, none failed"
    );
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn discard_and_write_zeroes_clear_their_ranges_and_refuse_bad_segments() {
    // Segments are (sector, sectors, flags), 16 bytes each, in device-readable buffers.
    let seg = |sector: u64, n: u32, flags: u32| {
        let mut b = sector.to_le_bytes().to_vec();
        b.extend_from_slice(&n.to_le_bytes());
        b.extend_from_slice(&flags.to_le_bytes());
        b
    };
    let disk = image(MIB);
    disk.write_all_at(&[0xab; 64 * 512], 0).unwrap();
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let features = c.get_u64(memvisor_vhost::proto::req::GET_FEATURES).unwrap();
    assert_eq!(features >> 13 & 3, 3, "DISCARD and WRITE_ZEROES offered");
    let run = |g: &mut Guest, kind: u32, segs: &[Vec<u8>]| {
        let bytes: Vec<u8> = segs.concat();
        g.mem.write(Gpa(DATA), &bytes).unwrap();
        request(g, kind, 0, &[(DATA, bytes.len() as u32, false)]).0
    };
    // Two segments in one request are more than the config offers (one): UNSUPP, nothing
    // cleared.
    assert_eq!(run(&mut g, 11, &[seg(0, 8, 0), seg(40, 8, 0)]), 2);
    let mut before = vec![0u8; 64 * 512];
    disk.read_exact_at(&mut before, 0).unwrap();
    assert!(
        before.iter().all(|&b| b == 0xab),
        "a refused discard cleared sectors"
    );
    // Discard sectors 0..8 and 40..48; write zeroes over 16..24, and over 24..32 allowing
    // unmap.
    assert_eq!(run(&mut g, 11, &[seg(0, 8, 0)]), 0);
    assert_eq!(run(&mut g, 11, &[seg(40, 8, 0)]), 0);
    assert_eq!(run(&mut g, 13, &[seg(16, 8, 0)]), 0);
    assert_eq!(run(&mut g, 13, &[seg(24, 8, 1)]), 0);
    let mut img = vec![0u8; 64 * 512];
    disk.read_exact_at(&mut img, 0).unwrap();
    for (i, sector) in img.chunks(512).enumerate() {
        let cleared = matches!(i, 0..8 | 16..32 | 40..48);
        let want = if cleared { 0 } else { 0xab };
        assert!(sector.iter().all(|&b| b == want), "sector {i}");
    }
    // Unmap on a discard and unknown flags are UNSUPP; a range past the end, or a segment
    // that is not 16 bytes, IOERR; nothing changes on the image.
    assert_eq!(run(&mut g, 11, &[seg(8, 8, 1)]), 2);
    assert_eq!(run(&mut g, 13, &[seg(8, 8, 4)]), 2);
    assert_eq!(run(&mut g, 11, &[seg(2040, 16, 0)]), 1);
    assert_eq!(run(&mut g, 13, &[seg(u64::MAX, 1, 0)]), 1);
    assert_eq!(run(&mut g, 13, &[seg(8, 8, 0), seg(u64::MAX, 1, 0)]), 2);
    assert_eq!(run(&mut g, 11, &[seg(8, 8, 0)[..12].to_vec()]), 1);
    let mut again = vec![0u8; 64 * 512];
    disk.read_exact_at(&mut again, 0).unwrap();
    assert!(again == img, "refused requests changed the image");
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!((s.discards, s.write_zeroes, s.failed), (2, 2, 7));
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
    let s = backend.device().stats();
    assert_eq!((s.failed, s.io_errors, s.pin_errors), (1, 1, 0));
    assert_eq!((s.reads, s.writes), (1, 0));
    assert_eq!(
        backend.memory().dma().device_pinned_pages(),
        0,
        "pins left behind"
    );
}

#[test]
fn requests_available_together_are_carried_out_as_one_batch() {
    // Five reads (then five writes) posted before one kick: the device hands them to the kernel
    // together (io_uring) and returns each chain with its own data and status.
    const N: u16 = 5;
    let disk = image(4 * MIB);
    let pattern = |k: u16| -> Vec<u8> {
        (0..4096u32)
            .map(|i| (i as u16 * 3 + k * 41) as u8)
            .collect()
    };
    for k in 0..N {
        disk.write_all_at(&pattern(k), u64::from(k) * 64 * 512)
            .unwrap();
    }
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let post_all = |g: &mut Guest, kind: u32| {
        for k in 0..N {
            let sector = if kind == 0 {
                u64::from(k) * 64
            } else {
                4096 + u64::from(k) * 64
            };
            let hdr = HDR + u64::from(k) * 16;
            let data = DATA + u64::from(k) * 0x2000;
            g.add_request(k, kind, sector, hdr, data, 4096, STATUS + u64::from(k));
        }
        g.kick();
        let mut heads: Vec<u16> = (0..N).map(|_| g.wait_used().0).collect();
        heads.sort_unstable();
        assert_eq!(heads, (0..N).map(|k| 3 * k).collect::<Vec<_>>());
    };
    post_all(&mut g, 0);
    for k in 0..N {
        let mut got = vec![0u8; 4096];
        g.mem
            .read(Gpa(DATA + u64::from(k) * 0x2000), &mut got)
            .unwrap();
        assert!(got == pattern(k), "read {k} landed its own data");
        let mut st = [0xffu8];
        g.mem.read(Gpa(STATUS + u64::from(k)), &mut st).unwrap();
        assert_eq!(st[0], 0, "read {k} status");
    }
    // The same buffers written back elsewhere, as one batch.
    post_all(&mut g, 1);
    for k in 0..N {
        let mut on_disk = vec![0u8; 4096];
        disk.read_exact_at(&mut on_disk, (4096 + u64::from(k) * 64) * 512)
            .unwrap();
        assert!(on_disk == pattern(k), "write {k} reached the image");
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!((s.reads, s.writes, s.failed), (5, 5, 0));
    assert_eq!(
        s.batches, 2,
        "each kick's five requests went to the kernel as one batch"
    );
}

/// Reads a chain of three descriptors at `ids`: header (IN, `sector`), 4 KiB into `data`,
/// status at `status`.
fn read_chain(g: &mut Guest, ids: [u16; 3], sector: u64, data: u64, status: u64) -> u16 {
    use memvisor_testkit::guest_ring::{Desc, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    let hdr = HDR + u64::from(ids[0]) * 16;
    let mut h = [0u8; 16];
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.mem.write(Gpa(hdr), &h).unwrap();
    g.mem.write(Gpa(status), &[0xff]).unwrap();
    let descs = [
        Desc {
            addr: hdr,
            len: 16,
            flags: VRING_DESC_F_NEXT,
            next: ids[1],
        },
        Desc {
            addr: data,
            len: 4096,
            flags: VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
            next: ids[2],
        },
        Desc {
            addr: status,
            len: 1,
            flags: VRING_DESC_F_WRITE,
            next: 0,
        },
    ];
    let head = g.ring.add_raw(&ids, &descs).unwrap();
    g.ring.publish(head).unwrap();
    head
}

#[test]
fn a_restarted_back_end_redoes_the_requests_left_in_flight_oldest_first() {
    use memvisor::{Backing, BackingKind};
    use memvisor_vhost::proto::{Inflight, protocol, req};
    use memvisor_vhost::ring::queue_bytes;
    use std::os::fd::AsRawFd;

    let disk = image(4 * MIB);
    let block = |s: u64| -> Vec<u8> { (0..4096u32).map(|i| (i as u64 * 7 + s) as u8).collect() };
    for s in 0..8u64 {
        disk.write_all_at(&block(s), s * 8 * 512).unwrap();
    }
    let mut g = Guest::new(4 * MIB);
    let entry = |h: u16| 16 + 16 * u64::from(h);

    // The first back end hands out a log and serves two reads.
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    negotiate(&c, &g);
    let ask = Inflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: RING_SIZE,
    };
    let (reply, fds) = c.get_with_fds(req::GET_INFLIGHT_FD, &ask.bytes()).unwrap();
    let got = Inflight::parse(req::GET_INFLIGHT_FD, &reply).unwrap();
    assert_eq!(fds.len(), 1, "the log's memfd comes with the reply");
    assert!(got.mmap_size >= queue_bytes(RING_SIZE));
    let log_fd = fds.into_iter().next().unwrap();
    let log = Backing::from_fd(log_fd.try_clone().unwrap(), 0, got.mmap_size).unwrap();
    assert!(matches!(log.kind(), BackingKind::Received { .. }));
    let set = |c: &memvisor_testkit::vhost::client::Client| {
        c.ack(req::SET_INFLIGHT_FD, &got.bytes(), &[log_fd.as_raw_fd()])
            .unwrap()
    };
    assert_eq!(set(&c), 0);
    start_ring(&c, &g);
    for k in 0..2u16 {
        let at = DATA + u64::from(k) * 0x1000;
        read_chain(
            &mut g,
            [3 * k, 3 * k + 1, 3 * k + 2],
            u64::from(k) * 8,
            at,
            STATUS,
        );
        use std::io::Write;
        g.kick.write_all(&1u64.to_le_bytes()).unwrap();
        g.wait_used();
    }
    let u16_at = |at: u64| {
        let mut b = [0u8; 2];
        log.read(at, &mut b).unwrap();
        u16::from_le_bytes(b)
    };
    assert_eq!(u16_at(8), 1, "version written by the first back end");
    assert_eq!(u16_at(14), 2, "used_idx follows the used ring");
    let mut e = [0u8; 16];
    log.read(entry(0), &mut e).unwrap();
    assert_eq!(e[0], 0, "a completed head is not in flight");
    drop(c);
    let _ = t.join().unwrap();

    // What the first back end would have left had it died: four more chains taken; head 9
    // completed out of order; head 12 completed with its entry not yet cleared (death between
    // the used index and the log); heads 6 and 15 in flight, 15 taken before 6.
    let v = g.vring_addr();
    let used_gpa = v.used - USER;
    let (h6, h9, h12, h15) = (6u16, 9u16, 12u16, 15u16);
    let data_of = |h: u16| DATA + 0x10000 + u64::from(h) * 0x1000;
    let status_of = |h: u16| STATUS + 0x100 + u64::from(h);
    let sector_of = |h: u16| u64::from(h % 8) * 8;
    for h in [h6, h9, h12, h15] {
        let ids = if h == 15 {
            [15, 0, 1]
        } else {
            [h, h + 1, h + 2]
        };
        read_chain(&mut g, ids, sector_of(h), data_of(h), status_of(h));
    }
    for (i, h) in [h9, h12].into_iter().enumerate() {
        let slot = used_gpa + 4 + 8 * (2 + i as u64);
        let mut el = [0u8; 8];
        el[0..4].copy_from_slice(&u32::from(h).to_le_bytes());
        g.mem.write(Gpa(slot), &el).unwrap();
    }
    g.mem.write(Gpa(used_gpa + 2), &4u16.to_le_bytes()).unwrap();
    let mark = |h: u16, counter: u64, inflight: u8| {
        log.write(entry(h) + 8, &counter.to_le_bytes()).unwrap();
        log.write(entry(h), &[inflight]).unwrap();
    };
    mark(h15, 10, 1);
    mark(h6, 11, 1);
    mark(h9, 12, 0);
    mark(h12, 13, 1);
    log.write(12, &h12.to_le_bytes()).unwrap();
    log.write(14, &3u16.to_le_bytes()).unwrap();
    // The driver sees the two completions the dead back end published.
    let mut early: Vec<u16> = (0..2).map(|_| g.wait_used().0).collect();
    early.sort_unstable();
    assert_eq!(early, vec![h9, h12]);

    // A new back end on the frontend's log: 15 then 6 are redone, with no kick, and nothing
    // else; then the ring goes on from the right index.
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    negotiate(&c, &g);
    assert_eq!(set(&c), 0);
    let st = |n: u32| memvisor_vhost::proto::vring_state_bytes(0, n);
    for (request, payload, fds) in [
        (req::SET_VRING_NUM, st(u32::from(RING_SIZE)), vec![]),
        (req::SET_VRING_ADDR, v.bytes(), vec![]),
        (req::SET_VRING_BASE, st(4), vec![]),
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
        assert_eq!(
            c.ack(request, &payload, &fds).unwrap(),
            0,
            "{}",
            req::name(request)
        );
    }
    let redone: Vec<u16> = (0..2).map(|_| g.wait_used().0).collect();
    assert_eq!(redone, vec![h15, h6], "in flight, oldest first");
    for h in [h15, h6] {
        let mut got = vec![0u8; 4096];
        g.mem.read(Gpa(data_of(h)), &mut got).unwrap();
        assert!(got == block(sector_of(h) / 8), "head {h} read its block");
        let mut s = [0xffu8];
        g.mem.read(Gpa(status_of(h)), &mut s).unwrap();
        assert_eq!(s[0], 0, "head {h} status");
    }
    assert_eq!(u16_at(14), 6, "the log's used_idx caught up");
    for h in [h6, h12, h15] {
        log.read(entry(h), &mut e).unwrap();
        assert_eq!(e[0], 0, "head {h} no longer in flight");
    }
    // A new request after them: taken at available index 6, counted after every head that was
    // still in flight (6's counter, 11, plus one).
    read_chain(&mut g, [3, 4, 5], 0, DATA, STATUS);
    {
        use std::io::Write;
        g.kick.write_all(&1u64.to_le_bytes()).unwrap();
    }
    assert_eq!(g.wait_used().0, 3);
    assert_eq!(status(&g), 0);
    log.read(entry(3), &mut e).unwrap();
    assert_eq!(u64::from_le_bytes(e[8..16].try_into().unwrap()), 12);
    let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
    assert_ne!(pf & protocol::INFLIGHT_SHMFD, 0);
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats().failed, 0);
}

#[test]
fn bad_inflight_requests_are_refused_and_change_nothing() {
    use memvisor_vhost::proto::{Inflight, req};
    use std::os::fd::AsRawFd;
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(image(MIB), BlkOptions::default()).unwrap());
    // Not negotiated yet: refused (the frontend waits for data, so the connection ends).
    let ask = Inflight {
        mmap_size: 0,
        mmap_offset: 0,
        num_queues: 1,
        queue_size: RING_SIZE,
    };
    assert!(c.get_with_fds(req::GET_INFLIGHT_FD, &ask.bytes()).is_err());
    drop(c);
    let _ = t.join().unwrap();

    let (c, t) = serve(Blk::new(image(MIB), BlkOptions::default()).unwrap());
    negotiate(&c, &g);
    let small = memfd(64);
    for (d, why) in [
        (
            Inflight {
                mmap_size: 64,
                ..ask
            },
            "too small for its queues",
        ),
        (
            Inflight {
                mmap_size: 4096,
                num_queues: 0,
                ..ask
            },
            "no queue",
        ),
        (
            Inflight {
                mmap_size: 4096,
                queue_size: 0,
                ..ask
            },
            "queues of no heads",
        ),
    ] {
        let r = c
            .ack(req::SET_INFLIGHT_FD, &d.bytes(), &[small.as_raw_fd()])
            .unwrap();
        assert_eq!(r, libc::EINVAL as u64, "a log {why} is refused with EINVAL");
    }
    // No descriptor at all.
    let r = c.ack(req::SET_INFLIGHT_FD, &ask.bytes(), &[]).unwrap();
    assert_eq!(r, libc::EINVAL as u64);
    // More queues than the device has: refused, and the back end still answers.
    let many = Inflight {
        num_queues: 2,
        ..ask
    };
    assert!(c.get_with_fds(req::GET_INFLIGHT_FD, &many.bytes()).is_err());
    drop(c);
    let _ = t.join().unwrap();
    // The device still serves a frontend that does it right.
    let (c, t) = serve(Blk::new(image(MIB), BlkOptions::default()).unwrap());
    negotiate(&c, &g);
    let (reply, fds) = c.get_with_fds(req::GET_INFLIGHT_FD, &ask.bytes()).unwrap();
    assert_eq!((reply.len(), fds.len()), (Inflight::SIZE, 1));
    drop(c);
    let _ = t.join().unwrap();
}

#[test]
fn a_polling_device_serves_requests_made_available_without_a_kick() {
    // After a kicked request, the driver publishes a read and does not kick (as it may when the
    // device asked not to be notified). With polling the device finds it; without, it waits
    // for the kick.
    for poll_us in [500_000u32, 0] {
        let disk = image(MIB);
        disk.write_all_at(&[0x5a; 4096], 0).unwrap();
        let mut g = Guest::new(4 * MIB);
        let options = BlkOptions {
            poll_us,
            ..BlkOptions::default()
        };
        let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), options).unwrap());
        setup(&c, &g);
        read_chain(&mut g, [0, 1, 2], 0, DATA, STATUS);
        {
            use std::io::Write;
            g.kick.write_all(&1u64.to_le_bytes()).unwrap();
        }
        g.wait_used();
        g.mem.write(Gpa(DATA), &[0u8; 4096]).unwrap();
        read_chain(&mut g, [0, 1, 2], 0, DATA, STATUS);
        let mut served = false;
        for _ in 0..100 {
            if g.ring.get_used().unwrap().is_some() {
                served = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(
            served,
            poll_us > 0,
            "poll-us {poll_us}: served with no kick"
        );
        if !served {
            use std::io::Write;
            g.kick.write_all(&1u64.to_le_bytes()).unwrap();
            g.wait_used();
        }
        assert_eq!(status(&g), 0);
        let mut got = [0u8; 4096];
        g.mem.read(Gpa(DATA), &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0x5a));
        drop(c);
        let (backend, _) = t.join().unwrap();
        assert_eq!(backend.stats().poll_hits > 0, poll_us > 0);
    }
}

#[test]
fn the_hold_counters_count_each_request_held_and_let_go() {
    // Per device: two reads and two writes, each walked and held once, let go once.
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    for sector in [0, 8] {
        assert_eq!(request(&mut g, 1, sector, &[(DATA, 4096, false)]).0, 0);
        assert_eq!(request(&mut g, 0, sector, &[(DATA, 4096, true)]).0, 0);
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!(s.failed, 0);
    assert_eq!(s.holds, 4, "one walk per request");
    assert!(
        s.hold_ns > 0 && s.release_ns > 0,
        "holding took no time: {s:?}"
    );
    assert_eq!(s.pinned_pages, 0, "every hold let go");
}

#[test]
fn a_probed_image_refuses_a_write_that_would_give_sector_0_a_format_header() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let guarded = BlkOptions {
        guard_first_sector: true,
        ..BlkOptions::default()
    };
    let (c, _t) = serve(Blk::new(disk.try_clone().unwrap(), guarded).unwrap());
    setup(&c, &g);
    // A qcow2 header (magic, version 3) at the start of a 4 KiB write.
    let mut block = vec![0u8; 4096];
    block[0..4].copy_from_slice(b"QFI\xfb");
    block[4..8].copy_from_slice(&3u32.to_be_bytes());
    g.mem.write(Gpa(DATA), &block).unwrap();
    // Split over two buffers, the header in the first 8 bytes: refused, the image untouched.
    let bufs = [(DATA, 8, false), (DATA + 8, 4088, false)];
    assert_eq!(request(&mut g, 1, 0, &bufs).0, 1, "IOERR for sector 0");
    let mut first = [0u8; 8];
    disk.read_exact_at(&mut first, 0).unwrap();
    assert_eq!(first, [0u8; 8], "nothing written");
    // The same bytes anywhere but sector 0 are data like any other.
    assert_eq!(request(&mut g, 1, 1, &bufs).0, 0, "sector 1");
    disk.read_exact_at(&mut first, 512).unwrap();
    assert_eq!(&first[..4], b"QFI\xfb");
    // Sector 0 without a header (an MBR, zeros) is written.
    g.mem.write(Gpa(DATA), &[0u8; 8]).unwrap();
    g.mem.write(Gpa(DATA + 510), &[0x55, 0xaa]).unwrap();
    assert_eq!(request(&mut g, 1, 0, &bufs).0, 0, "an MBR");

    // Unguarded (format=raw): the header is written.
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, _t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    g.mem.write(Gpa(DATA), &block).unwrap();
    assert_eq!(request(&mut g, 1, 0, &bufs).0, 0, "format=raw");
    disk.read_exact_at(&mut first, 0).unwrap();
    assert_eq!(&first[..4], b"QFI\xfb");
}
