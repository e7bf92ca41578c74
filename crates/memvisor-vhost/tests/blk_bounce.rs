//! One request as large as a guest can make costs the back end a bounded amount of memory.
//! A test binary of its own: it measures the process's peak resident set, which other tests
//! running beside it would raise.

mod common;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::{Blk, BlkOptions};

const HDR: u64 = 0x10000;
const STATUS: u64 = 0x80000;

/// Peak resident set of this process, in bytes.
fn max_rss() -> u64 {
    // SAFETY: a rusage is plain integers, for which all zeros is a value.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one rusage into `u`, which we own.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    u.ru_maxrss as u64 * 1024
}

/// A request's size is bounded only by the disk's capacity: nothing enforces `seg_max` (254,
/// offered) or any transfer size, and an indirect table may hold 32768 descriptors of up to
/// 4 GiB each, all naming the same guest buffer. On an `O_DIRECT` image a buffer at an odd
/// address sends the whole transfer through `Blk::bounce`, which allocates and fills one
/// buffer of the request's full size. Here a guest with 8 MiB of memory makes the back end
/// allocate and fill 256 MiB in one read (64 descriptors of 4 MiB at one unaligned address);
/// with a 100 GiB image and a host with the memory to overcommit, the same request with more
/// descriptors takes tens of GiB of the host. QEMU refuses a request over
/// BDRV_REQUEST_MAX_BYTES and a chain over VIRTQUEUE_MAX_SIZE (1024) descriptors.
/// It measures the peak RSS: a test binary of its own.
#[test]
fn one_bounced_request_does_not_make_the_back_end_allocate_its_whole_size() {
    use memvisor_testkit::guest_ring::{Desc, VRING_DESC_F_NEXT as NEXT, VRING_DESC_F_WRITE};
    use std::os::unix::fs::OpenOptionsExt;
    const INDIRECT: u16 = 4;
    const TABLE: u64 = 0x600000;
    const BUF: u64 = 0x100001; // odd: O_DIRECT cannot take it, the transfer is bounced
    const PIECE: u32 = 4 << 20;
    const PIECES: u64 = 64;
    let path = std::env::temp_dir().join(format!("memvisor-bounce-{}.img", std::process::id()));
    let disk = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&path)
    {
        Ok(f) => f,
        Err(e) => {
            skipped(&format!(
                "one bounced request: O_DIRECT in the temporary directory: {e}"
            ));
            return;
        }
    };
    disk.set_len(1 << 30).unwrap(); // sparse 1 GiB
    let mut g = Guest::new(8 * MIB);
    let (c, t) = serve(Blk::new(disk, BlkOptions::default()).unwrap());
    setup(&c, &g);
    g.mem.write(Gpa(HDR), &blk_header(0, 0)).unwrap();
    g.mem.write(Gpa(STATUS), &[0xff]).unwrap();
    let mut table = vec![(HDR, 16u32, NEXT)];
    table.extend((0..PIECES).map(|_| (BUF, PIECE, NEXT | VRING_DESC_F_WRITE)));
    table.push((STATUS, 1, VRING_DESC_F_WRITE));
    for (k, &(addr, len, flags)) in table.iter().enumerate() {
        let next = if flags & NEXT != 0 { k as u16 + 1 } else { 0 };
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&addr.to_le_bytes());
        raw[8..12].copy_from_slice(&len.to_le_bytes());
        raw[12..14].copy_from_slice(&flags.to_le_bytes());
        raw[14..].copy_from_slice(&next.to_le_bytes());
        g.mem.write(Gpa(TABLE + 16 * k as u64), &raw).unwrap();
    }
    let before = max_rss();
    let d = Desc {
        addr: TABLE,
        len: 16 * table.len() as u32,
        flags: INDIRECT,
        next: 0,
    };
    let head = g.ring.add_raw(&[0], &[d]).unwrap();
    g.ring.publish(head).unwrap();
    g.kick();
    let mut used = None;
    for _ in 0..6000 {
        if let Some(u) = g.ring.get_used().unwrap() {
            used = Some(u);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let (_, len) = used.expect("answered within 60 s");
    let grew = max_rss().saturating_sub(before);
    let status = byte_at(&g, STATUS);
    drop(c);
    let (backend, _) = t.join().unwrap();
    let s = backend.device().stats();
    let _ = std::fs::remove_file(&path);
    assert!(
        grew < 64 * MIB,
        "one read of {} MiB into an 8 MiB guest grew the back end's peak RSS by {} MiB \
         (status {status}, used len {len}, bounced {})",
        (PIECES * u64::from(PIECE)) >> 20,
        grew >> 20,
        s.bounced
    );
}
