//! virtio-blk on a host block device: a loop device (`losetup`) over a temporary file, served
//! through the whole vhost-user path as tests/blk.rs serves files. The device must report the
//! loop device's size and block sizes in its config space, offer what the device can do, and
//! carry discards and zeroing to it. Needs root and loop devices; without them each test says
//! `skipped: <test>: <reason>` and passes.

mod common;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::proto::{self, req};
use memvisor_vhost::{Blk, BlkOptions};

const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;
const F_TOPOLOGY: u64 = 1 << 10;
const F_DISCARD: u64 = 1 << 13;
const F_WRITE_ZEROES: u64 = 1 << 14;

/// A loop device over a file of its own; detached and the file removed when dropped, so a
/// failing test leaves nothing behind.
struct Loop {
    dev: PathBuf,
    backing: PathBuf,
}

impl Loop {
    /// A loop device over a new `bytes`-byte file (with `--sector-size sector` if given), or
    /// why there is none here (printed as the test's skip line by the caller).
    fn new(test: &str, bytes: u64, sector: Option<u32>) -> Result<Loop, String> {
        // SAFETY: geteuid has no arguments and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            return Err("needs root to set up a loop device".into());
        }
        if !Path::new("/dev/loop-control").exists() {
            return Err("no /dev/loop-control (no loop device support)".into());
        }
        let backing =
            std::env::temp_dir().join(format!("memvisor-blkdev-{test}-{}.img", std::process::id()));
        let f = File::create(&backing).map_err(|e| format!("{}: {e}", backing.display()))?;
        f.set_len(bytes).unwrap();
        drop(f);
        let mut cmd = Command::new("losetup");
        cmd.args(["--find", "--show"]);
        if let Some(s) = sector {
            cmd.args(["--sector-size", &s.to_string()]);
        }
        let out = match cmd.arg(&backing).output() {
            Ok(o) => o,
            Err(e) => {
                let _ = std::fs::remove_file(&backing);
                return Err(format!("cannot run losetup: {e}"));
            }
        };
        if !out.status.success() {
            let _ = std::fs::remove_file(&backing);
            return Err(format!(
                "losetup --find --show{} failed: {}",
                sector.map_or(String::new(), |s| format!(" --sector-size {s}")),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Ok(Loop { dev, backing })
    }

    /// The device, read-write, `O_DIRECT` if `direct`.
    fn open(&self, direct: bool) -> File {
        OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(if direct { libc::O_DIRECT } else { 0 })
            .open(&self.dev)
            .unwrap()
    }

    /// A number from the loop device's queue in sysfs.
    fn queue(&self, name: &str) -> u64 {
        let dev = self.dev.file_name().unwrap().to_str().unwrap();
        std::fs::read_to_string(format!("/sys/block/{dev}/queue/{name}"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.dev).status();
        let _ = std::fs::remove_file(&self.backing);
    }
}

/// The loop device for `test`, or `None` after printing why the test is skipped.
fn loop_or_skip(test: &str, bytes: u64, sector: Option<u32>) -> Option<Loop> {
    match Loop::new(test, bytes, sector) {
        Ok(l) => Some(l),
        Err(why) => {
            skipped(&format!("{test}: {why}"));
            None
        }
    }
}

/// Posts header, data buffers and status; returns (status, bytes the device reported written).
fn request(g: &mut Guest, kind: u32, sector: u64, data: &[(u64, u32, bool)]) -> (u8, u32) {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    g.mem.write(Gpa(HDR), &h).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    let mut bufs = vec![(HDR, 16, false)];
    bufs.extend_from_slice(data);
    bufs.push((STATUS, 1, true));
    g.post(&bufs);
    let (_, written) = g.wait_used();
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    (s[0], written)
}

/// A discard (11) or write-zeroes (13) request of one segment.
fn range(g: &mut Guest, kind: u32, sector: u64, sectors: u32, flags: u32) -> u8 {
    let mut seg = sector.to_le_bytes().to_vec();
    seg.extend_from_slice(&sectors.to_le_bytes());
    seg.extend_from_slice(&flags.to_le_bytes());
    g.mem.write(Gpa(DATA + 0x30000), &seg).unwrap();
    request(g, kind, 0, &[(DATA + 0x30000, 16, false)]).0
}

/// The device's whole config space (60 bytes).
fn config(c: &memvisor_testkit::vhost::client::Client) -> Vec<u8> {
    let cfg = c
        .get(req::GET_CONFIG, &proto::config_bytes(0, 0, &[0; 60]))
        .unwrap();
    cfg[12..].to_vec()
}

fn u32_at(c: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(c[at..at + 4].try_into().unwrap())
}

/// Image bytes through a descriptor of our own (the backing file, or the device).
fn read(f: &File, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, offset).unwrap();
    b
}

#[test]
fn a_loop_device_is_served_with_its_size_block_sizes_and_discard() {
    let test = "a_loop_device_is_served_with_its_size_block_sizes_and_discard";
    let Some(lo) = loop_or_skip(test, 8 * MIB, None) else {
        return;
    };
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(lo.open(false), BlkOptions::default()).unwrap());
    setup(&c, &g);

    // What the guest is told: the size (fstat says 0 for a block device), the block sizes
    // and limits sysfs gives for this loop device.
    let features = c.get_u64(req::GET_FEATURES).unwrap();
    let cfg = config(&c);
    let logical = lo.queue("logical_block_size");
    let physical = lo.queue("physical_block_size");
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        8 * MIB / 512,
        "capacity in sectors"
    );
    assert_eq!(u64::from(u32_at(&cfg, 20)), logical, "blk_size");
    assert_ne!(
        features & F_TOPOLOGY,
        0,
        "TOPOLOGY offered for a block device"
    );
    assert_eq!(1u64 << cfg[24], physical / logical, "physical_block_exp");
    assert_eq!(
        u64::from(u16::from_le_bytes(cfg[26..28].try_into().unwrap())),
        lo.queue("minimum_io_size") / logical,
        "min_io_size"
    );
    assert_eq!(
        u64::from(u32_at(&cfg, 28)),
        lo.queue("optimal_io_size") / logical,
        "opt_io_size"
    );
    let discard_max = lo.queue("discard_max_bytes");
    assert!(
        discard_max > 0,
        "a loop device over a file on {} discards (punches holes)",
        std::env::temp_dir().display()
    );
    assert_eq!(
        features & (F_DISCARD | F_WRITE_ZEROES),
        F_DISCARD | F_WRITE_ZEROES
    );
    assert_eq!(
        u64::from(u32_at(&cfg, 36)),
        (discard_max / 512).min(1 << 22),
        "max_discard_sectors: the device's, capped at the device model's 2 GiB"
    );
    assert_eq!(
        u64::from(u32_at(&cfg, 44)),
        lo.queue("discard_granularity").max(logical) / 512,
        "discard_sector_alignment: the discard granularity"
    );
    let wz = lo.queue("write_zeroes_max_bytes");
    let want_wz = if wz == 0 {
        1 << 22
    } else {
        (wz / 512).min(1 << 22)
    };
    assert_eq!(
        u64::from(u32_at(&cfg, 48)),
        want_wz,
        "max_write_zeroes_sectors"
    );

    // Data written through the device reaches the file behind the loop device (after FLUSH),
    // and reads back; the last sector too (the whole capacity is usable).
    let pattern: Vec<u8> = (0..64 * 512u32).map(|i| (i * 13 + 1) as u8 | 1).collect();
    g.mem.write(Gpa(DATA), &pattern).unwrap();
    assert_eq!(request(&mut g, 1, 0, &[(DATA, 64 * 512, false)]).0, 0);
    assert_eq!(
        request(&mut g, 1, 8 * MIB / 512 - 8, &[(DATA, 4096, false)]).0,
        0
    );
    assert_eq!(request(&mut g, 4, 0, &[]).0, 0, "flush");
    let backing = File::open(&lo.backing).unwrap();
    assert!(
        read(&backing, 0, pattern.len()) == pattern,
        "the image holds the write"
    );
    assert!(
        read(&backing, 8 * MIB - 4096, 4096) == pattern[..4096],
        "the last sector"
    );
    assert_eq!(
        request(&mut g, 1, 8 * MIB / 512 - 7, &[(DATA, 4096, false)]).0,
        1,
        "a write past the end is IOERR"
    );

    // Discard sectors 8..16 (BLKDISCARD; the loop driver punches a hole, which reads as zeros:
    // virtio's DISCARD itself promises no zeros), write zeroes over 24..32 without unmap and
    // 32..40 with it; the rest keeps its data, on the device and in the file.
    assert_eq!(range(&mut g, 11, 8, 8, 0), 0, "discard");
    assert_eq!(range(&mut g, 13, 24, 8, 0), 0, "write zeroes");
    assert_eq!(range(&mut g, 13, 32, 8, 1), 0, "write zeroes, unmap");
    assert_eq!(
        range(&mut g, 11, 8 * MIB / 512 - 4, 8, 0),
        1,
        "past the end"
    );
    assert_eq!(request(&mut g, 4, 0, &[]).0, 0, "flush");
    g.mem.write(Gpa(DATA), &[0xee; 64 * 512]).unwrap();
    assert_eq!(
        request(&mut g, 0, 0, &[(DATA, 64 * 512, true)]),
        (0, 64 * 512 + 1)
    );
    let mut through_device = vec![0u8; 64 * 512];
    g.mem.read(Gpa(DATA), &mut through_device).unwrap();
    let in_file = read(&backing, 0, 64 * 512);
    for (i, (dev, file)) in through_device
        .chunks(512)
        .zip(in_file.chunks(512))
        .enumerate()
    {
        let want: &[u8] = if matches!(i, 8..16 | 24..40) {
            &[0; 512]
        } else {
            &pattern[i * 512..(i + 1) * 512]
        };
        assert!(dev == want, "sector {i} read through the device");
        assert!(
            file == want,
            "sector {i} of the file behind the loop device"
        );
    }
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!(
        (s.discards, s.write_zeroes, s.failed, s.io_errors),
        (1, 2, 2, 0)
    );
}

#[test]
fn a_read_only_loop_device_offers_no_discard_and_refuses_writes() {
    let test = "a_read_only_loop_device_offers_no_discard_and_refuses_writes";
    let Some(lo) = loop_or_skip(test, MIB, None) else {
        return;
    };
    let ro = File::open(&lo.dev).unwrap();
    let mut g = Guest::new(4 * MIB);
    let options = BlkOptions {
        read_only: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(ro, options).unwrap());
    setup(&c, &g);
    let features = c.get_u64(req::GET_FEATURES).unwrap();
    assert_eq!(features & (F_DISCARD | F_WRITE_ZEROES), 0);
    assert_ne!(features & (1 << 5), 0, "VIRTIO_BLK_F_RO");
    let cfg = config(&c);
    assert_eq!(u64::from_le_bytes(cfg[0..8].try_into().unwrap()), MIB / 512);
    assert_eq!(u32_at(&cfg, 36), 0, "no max_discard_sectors");
    assert_eq!(range(&mut g, 11, 0, 8, 0), 2, "discard is UNSUPP");
    assert_eq!(request(&mut g, 1, 0, &[(DATA, 512, false)]).0, 1);
    drop(c);
    let _ = t.join().unwrap();
}

#[test]
fn a_4096_byte_sector_loop_device_has_blk_size_4096() {
    let test = "a_4096_byte_sector_loop_device_has_blk_size_4096";
    let Some(lo) = loop_or_skip(test, 4 * MIB, Some(4096)) else {
        return;
    };
    assert_eq!(
        lo.queue("logical_block_size"),
        4096,
        "losetup --sector-size"
    );
    // O_DIRECT: statx's alignment (or, where the kernel reports none for a block device, the
    // logical block size) is 4096 for offsets.
    let disk = memvisor_vhost::disk::Disk::new(lo.open(true)).unwrap();
    let align = disk.direct().expect("opened O_DIRECT");
    assert_eq!(align.offset, 4096, "O_DIRECT offset alignment");
    assert_eq!(disk.block_size(), 4096);
    drop(disk);

    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(lo.open(true), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let cfg = config(&c);
    assert_eq!(u32_at(&cfg, 20), 4096, "blk_size");
    assert_eq!(
        u64::from_le_bytes(cfg[0..8].try_into().unwrap()),
        4 * MIB / 512,
        "capacity stays in 512-byte sectors"
    );
    assert_eq!(
        u32_at(&cfg, 44) % 8,
        0,
        "discard alignment in whole 4 KiB blocks"
    );

    // Whole blocks go straight to the device; a buffer at an odd address (legal in virtio) is
    // copied through an aligned buffer, as on an O_DIRECT file; both land.
    let a: Vec<u8> = (0..8192u32).map(|i| (i * 7 + 3) as u8).collect();
    g.mem.write(Gpa(DATA), &a).unwrap();
    g.mem.write(Gpa(DATA + 0x4000 + 101), &a).unwrap();
    assert_eq!(request(&mut g, 1, 8, &[(DATA, 8192, false)]).0, 0);
    assert_eq!(
        request(&mut g, 1, 32, &[(DATA + 0x4000 + 101, 8192, false)]).0,
        0
    );
    // Offsets or lengths that are not whole 4 KiB blocks cannot reach an O_DIRECT 4 KiB
    // device: IOERR (as on an O_DIRECT file whose alignment the guest ignored), nothing
    // written; so are discards and zeroing of part of a block.
    assert_eq!(request(&mut g, 1, 1, &[(DATA, 4096, false)]).0, 1);
    assert_eq!(request(&mut g, 1, 8, &[(DATA, 512, false)]).0, 1);
    assert_eq!(range(&mut g, 11, 9, 7, 0), 1);
    assert_eq!(range(&mut g, 13, 8, 4, 0), 1);
    let dev = lo.open(false);
    assert!(read(&dev, 8 * 512, 8192) == a, "the aligned write");
    assert!(read(&dev, 32 * 512, 8192) == a, "the copied write");
    // Whole blocks: zeroed.
    assert_eq!(range(&mut g, 13, 16, 8, 0), 0);
    assert_eq!(range(&mut g, 11, 32, 8, 0), 0);
    assert!(read(&dev, 8 * 512, 4096) == a[..4096], "untouched");
    assert!(read(&dev, 16 * 512, 4096) == [0u8; 4096], "zeroed block");
    assert!(
        read(&dev, 32 * 512, 4096) == [0u8; 4096],
        "discarded block (loop: a hole)"
    );
    assert!(read(&dev, 40 * 512, 4096) == a[4096..], "untouched");
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    assert_eq!((s.bounced, s.writes, s.failed), (1, 2, 4));

    // Through the page cache the same device takes 512-byte requests: the kernel reads and
    // writes the 4 KiB block around them.
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(lo.open(false), BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(u32_at(&config(&c), 20), 4096, "blk_size");
    g.mem.write(Gpa(DATA), &[0x5a; 512]).unwrap();
    assert_eq!(request(&mut g, 1, 9, &[(DATA, 512, false)]).0, 0);
    g.mem.write(Gpa(DATA), &[0; 4096]).unwrap();
    assert_eq!(request(&mut g, 0, 8, &[(DATA, 4096, true)]).0, 0);
    let mut back = vec![0u8; 4096];
    g.mem.read(Gpa(DATA), &mut back).unwrap();
    assert!(back[..512] == a[..512], "the sector before");
    assert!(back[512..1024] == [0x5a; 512], "the 512-byte write");
    assert!(back[1024..] == a[1024..4096], "the sectors after");
    drop(c);
    let _ = t.join().unwrap();
}

/// `blk-resize` on a block device: its size is its own, so a size other than the one it has is
/// refused by value; once the device grew on the host, a resize without a size reads the new
/// size, which the config space then shows.
#[test]
fn a_block_device_is_resized_by_reading_its_size_again() {
    use memvisor_vhost::Device as _;
    let test = "a_block_device_is_resized_by_reading_its_size_again";
    let Some(lo) = loop_or_skip(test, 4 * MIB, None) else {
        return;
    };
    let blk = Blk::new(lo.open(false), BlkOptions::default()).unwrap();
    let cap = blk.capacity();
    assert!(cap.is_block_device());
    let capacity = |b: &Blk| {
        let mut c = [0u8; 8];
        b.read_config(0, &mut c);
        u64::from_le_bytes(c)
    };
    assert_eq!(capacity(&blk), 4 * MIB / 512);
    let e = cap.resize(Some(8 * MIB)).unwrap_err().to_string();
    assert!(
        e.contains(&format!("size {}", 8 * MIB)) && e.contains("block device"),
        "{e}"
    );
    assert_eq!(cap.resize(Some(4 * MIB)).unwrap().size, 4 * MIB);
    // The host grows it: the backing file, then the loop device's idea of its size.
    File::options()
        .write(true)
        .open(&lo.backing)
        .unwrap()
        .set_len(8 * MIB)
        .unwrap();
    let out = Command::new("losetup")
        .arg("-c")
        .arg(&lo.dev)
        .output()
        .unwrap();
    assert!(out.status.success(), "losetup -c: {out:?}");
    assert_eq!(capacity(&blk), 4 * MIB / 512, "not before it is asked");
    let r = cap.resize(None).unwrap();
    assert_eq!((r.before, r.size), (4 * MIB, 8 * MIB));
    assert_eq!(capacity(&blk), 8 * MIB / 512);
}
