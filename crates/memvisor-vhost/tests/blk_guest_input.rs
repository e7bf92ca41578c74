//! What the blk back end does with requests a hostile guest or an unusual but conforming
//! driver may post: a write's data in the header's descriptor, a guarded sector 0 changed
//! after its check, the used length of a failed read, a registered-buffer read that finds
//! the image ended. Each test states what the VIRTIO specification (1.3) asks.

mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::{Blk, BlkOptions};

const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;

fn image(bytes: u64) -> File {
    memfd(bytes)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32).map(|i| (i * 31 + seed) as u8 | 1).collect()
}

/// Message framing (VIRTIO 1.3, 2.6.4): "The device MUST NOT make assumptions about the
/// particular arrangement of descriptors." A 1024-byte write of sector 4 whose first 512 bytes
/// share the header's descriptor: both halves land in place (before the chain was framed, the
/// second half was written at sector 4 and the write answered OK).
#[test]
fn a_write_whose_first_data_shares_the_header_descriptor_lands_in_place() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, _t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let a = pattern(512, 7);
    let b = pattern(512, 100);
    g.mem.write(Gpa(HDR), &blk_header(1, 4)).unwrap();
    g.mem.write(Gpa(HDR + 16), &a).unwrap();
    g.mem.write(Gpa(DATA), &b).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[
        (HDR, 16 + 512, false),
        (DATA, 512, false),
        (STATUS, 1, true),
    ]);
    g.wait_used();
    let status = byte_at(&g, STATUS);
    let mut on_disk = vec![0u8; 1024];
    disk.read_exact_at(&mut on_disk, 4 * 512).unwrap();
    assert!(
        status != 0 || (on_disk[..512] == a[..] && on_disk[512..] == b[..]),
        "status {status} (OK); sector 4 holds the second buffer: {}, sector 5 is empty: {}",
        on_disk[..512] == b[..],
        on_disk[512..].iter().all(|&x| x == 0)
    );
}

/// `guard_first_sector` checks the first 512 bytes of a write of sector 0 in guest memory, and
/// the kernel later writes from that same guest memory: a guest can change the bytes between
/// the check and the write. Here without a second vCPU racing: a read into the buffer is made
/// available just before the write of sector 0 from it, in one kick. The write is checked when
/// it is taken off the ring (the buffer still zeros); the read lands in the buffer (a qcow2
/// header the guest wrote at sector 8, which is allowed) before the write goes out with it.
/// QEMU's raw driver writes sector 0 from the copy it checked, for this reason ("a malicious
/// guest might be overwriting its original buffer in the background", block/raw-format.c).
#[test]
fn a_guarded_sector_0_cannot_get_a_header_after_its_check() {
    let disk = image(MIB);
    let mut qcow2 = vec![0u8; 512];
    qcow2[0..4].copy_from_slice(b"QFI\xfb");
    qcow2[4..8].copy_from_slice(&3u32.to_be_bytes());
    // What the guest put at sector 8 (any sector but 0 is data like any other).
    disk.write_all_at(&qcow2, 8 * 512).unwrap();
    let mut g = Guest::new(4 * MIB);
    let guarded = BlkOptions {
        guard_first_sector: true,
        ..BlkOptions::default()
    };
    let (c, _t) = serve(Blk::new(disk.try_clone().unwrap(), guarded).unwrap());
    setup(&c, &g);
    for round in 0..20 {
        g.mem.write(Gpa(DATA), &[0u8; 512]).unwrap();
        // 0: read sector 8 into DATA; 1: write sector 0 from DATA.
        g.add_request(0, 0, 8, HDR, DATA, 512, STATUS);
        g.add_request(1, 1, 0, HDR + 16, DATA, 512, STATUS + 1);
        let st = g.kick_and_wait(2, STATUS);
        let mut first = [0u8; 4];
        disk.read_exact_at(&mut first, 0).unwrap();
        assert!(
            &first != b"QFI\xfb",
            "round {round}: statuses {st:?}: the probed-raw image's sector 0 now holds a qcow2 \
             header"
        );
    }
    // A write of sector 0 with no data has nothing to check or copy: done, OK.
    g.mem.write(Gpa(HDR), &blk_header(1, 0)).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[(HDR, 16, false), (STATUS, 1, true)]);
    g.wait_used();
    assert_eq!(byte_at(&g, STATUS), 0, "an empty guarded write of sector 0");
}

/// Used length (split-ring.tex, "The Virtqueue Used Ring", device normative): "The device MUST
/// write at least len bytes to descriptor, beginning at the first device-writable buffer"; len
/// may be an underestimate, never an overestimate. A read refused with IOERR writes only the
/// status byte, after its 512-byte data buffer, and reports len 1: it claims the data
/// buffer's first byte was written.
#[test]
fn a_failed_read_does_not_claim_its_data_buffer_was_written() {
    let disk = image(MIB);
    let mut g = Guest::new(4 * MIB);
    let (c, _t) = serve(Blk::new(disk.try_clone().unwrap(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    g.mem.write(Gpa(HDR), &blk_header(0, 2048)).unwrap(); // past the end (2048 sectors)
    g.mem.write(Gpa(DATA), &[0xee; 512]).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    g.post(&[(HDR, 16, false), (DATA, 512, true), (STATUS, 1, true)]);
    let (_, len) = g.wait_used();
    assert_eq!(byte_at(&g, STATUS), 1, "IOERR");
    assert_eq!(byte_at(&g, DATA), 0xee, "the data buffer is untouched");
    assert_eq!(
        len, 0,
        "used len {len}: more than the device wrote from the first device-writable byte on"
    );
}

/// With `fixed_buffers`, a lone read through a registered chunk that the kernel ends with 0
/// bytes (the image ended: a file shorter than the capacity the device still serves, e.g.
/// cut by another program before `blk-resize`) is taken as done: `fixed_now` only treats
/// `0 < n < total` as short. The ordinary paths (`rw_vectored`, the io_uring completion) answer
/// the same read IOERR ("the image ended at byte ..."). In a debug build `settle`'s
/// `debug_assert_eq!(n, total)` panics the back end's thread (the request is never answered);
/// in a release build the guest gets status OK with its buffer never filled.
#[test]
fn a_fixed_read_that_finds_the_image_ended_is_not_ok() {
    let disk = image(4 * MIB);
    disk.write_all_at(&[0x5a; 4096], 0).unwrap();
    let mut g = Guest::new(16 * MIB);
    let options = BlkOptions {
        fixed_buffers: true,
        ..BlkOptions::default()
    };
    let blk = Blk::new(disk.try_clone().unwrap(), options).unwrap();
    let blk_live = blk.live();
    let (c, t) = serve(blk);
    // Without VHOST_F_LOG_ALL, which keeps registered buffers off (as blk_fixed.rs does).
    negotiate_without(&c, &g, F_LOG_ALL);
    start_ring(&c, &g);
    let read = |g: &mut Guest, sector: u64| {
        g.mem.write(Gpa(HDR), &blk_header(0, sector)).unwrap();
        g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        g.mem.write(Gpa(DATA), &[0xee; 4096]).unwrap();
        g.post(&[(HDR, 16, false), (DATA, 4096, true), (STATUS, 1, true)]);
        g.wait_used();
        byte_at(g, STATUS)
    };
    // Warm up: the first read finds DATA's chunk cold; it is registered after the reply.
    for _ in 0..4 {
        assert_eq!(read(&mut g, 0), 0);
    }
    let warm = blk_live.total();
    if warm.fixed == 0 {
        skipped(&format!(
            "a fixed read at the image's end: nothing went fixed on this host: {warm:?}"
        ));
        return;
    }
    eprintln!(
        "warm-up: fixed {} ordinary {} fallbacks {}",
        warm.fixed, warm.fixed_ordinary, warm.fixed_fallbacks
    );
    // The image is cut to 1 MiB; the device still serves 4 MiB until told.
    disk.set_len(MIB).unwrap();
    // Sector 4096 (2 MiB) is past the image's end, inside the capacity.
    let (tx, rx) = std::sync::mpsc::channel();
    let mut g2 = g;
    let h = std::thread::spawn(move || {
        let s = read(&mut g2, 4096);
        let mut d = [0u8; 8];
        g2.mem.read(Gpa(DATA), &mut d).unwrap();
        tx.send((s, d)).unwrap();
    });
    match rx.recv_timeout(std::time::Duration::from_secs(8)) {
        Ok((s, d)) => assert_ne!(
            s, 0,
            "a read past the image's end answered OK; the buffer still holds {d:02x?}"
        ),
        Err(_) => {
            drop(c);
            let served = t.join();
            let _ = h.join();
            panic!(
                "the read past the image's end was never answered; the back end's thread {}",
                if served.is_err() { "panicked" } else { "ended" }
            );
        }
    }
}
