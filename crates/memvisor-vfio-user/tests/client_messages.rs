//! A client's messages at the edges of vfio-user.rst and VFIO type1: a reset while the
//! device waits for the client's DMA replies, an error reply with errno 0, a DMA_UNMAP
//! refused for its bitmap, a map over a region whatever its file range, WRITE through a
//! read-only descriptor; and edge messages that must get type1's errnos.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use memvisor_vfio_user::dmadev::{reg, status};
use memvisor_vfio_user::proto::{self, DmaMap, DmaUnmap, HEADER, Header, cmd, flags};
use memvisor_vfio_user::{DmaDev, Result, Server, ServerStats};

/// A client past the VERSION handshake, `before` run on the server first.
fn ready_with(
    before: impl FnOnce(&Server<DmaDev>),
) -> (Client, JoinHandle<(ServerStats, Result<()>)>) {
    let (mut c, t) = start_with(before);
    handshake(&mut c);
    (c, t)
}

fn ready() -> (Client, JoinHandle<(ServerStats, Result<()>)>) {
    ready_with(|_| {})
}

/// Answers one request of the server's (DMA_READ / DMA_WRITE) with a reply carrying `error`
/// (Some: an error reply with that errno), or data for a read. Returns the header if the
/// message was instead a reply to one of the client's own requests.
fn answer_one(c: &Client, error: Option<u32>) -> Option<(Header, Vec<u8>)> {
    let (h, body) = read_msg(&c.sock);
    if h.is_reply() {
        return Some((h, body));
    }
    let count = proto::u64_at(&body, 8) as usize;
    let mut reply = Header {
        id: h.id,
        command: h.command,
        size: 0,
        flags: flags::REPLY,
        error: 0,
    };
    let mut out = Vec::new();
    if let Some(e) = error {
        reply.flags |= flags::ERROR;
        reply.error = e;
    } else if h.command == cmd::DMA_READ {
        out = body[..proto::DMA_RW].to_vec();
        out.extend(std::iter::repeat_n(0xab, count));
    }
    reply.size = (HEADER + out.len()) as u32;
    let mut b = reply.to_bytes().to_vec();
    b.extend_from_slice(&out);
    memvisor_wire::send_with_fds(&c.sock, &b, &[]).unwrap();
    None
}

const DESC: u64 = 0x10_0000;
const DST: u64 = 0x40_0000;
const R: u64 = 8 << 20;

/// vfio-user.rst, Header: "*Error* in a reply message is an optional UNIX errno value. It may
/// be zero even if the Error bit is set in Flags." A DMA_READ the client refuses that way is
/// still a failure: the descriptor must not read as done (status 0).
#[test]
fn an_error_reply_with_errno_zero_still_fails_the_dma() {
    let (mut c, t) = ready();
    let irq = msi(&mut c);
    let mem = memfd(8 << 20);
    assert_eq!(c.map_flags(Some(&mem), 3, 0, 0, 8 << 20), 0);
    assert_eq!(c.map_flags(None, 3, 0, R, 1 << 20), 0);
    pwrite(&mem, DST, &[0x11; 64]);
    put_desc_at(&mem, DESC, R, DST, 64);
    c.region_write(0, reg::DESC, &DESC.to_le_bytes());
    c.region_write(0, reg::COUNT, &1u32.to_le_bytes());
    c.region_write(0, reg::MODE, &0u32.to_le_bytes());
    c.send(
        cmd::REGION_WRITE,
        &region_write_body(0, reg::DOORBELL, &1u32.to_le_bytes()),
        &[],
    );
    // Answer the device's DMA_READ with ERROR set and errno 0, until the doorbell's reply
    // and the MSI have both come.
    let mut answered = false;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(Instant::now() < deadline, "stuck");
        let mut p = [
            libc::pollfd {
                fd: irq.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: c.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: polls two live pollfds.
        unsafe { libc::poll(p.as_mut_ptr(), 2, 1000) };
        if p[1].revents & libc::POLLIN != 0 {
            answered |= answer_one(&c, Some(0)).is_some();
            continue;
        }
        if p[0].revents & libc::POLLIN != 0 && answered {
            break;
        }
    }
    assert_eq!(pread(&mem, DST, 64), vec![0x11; 64], "nothing was copied");
    let st = proto::u32_at(&pread(&mem, DESC + 20, 4), 0);
    let run = c.reg32(reg::STATUS);
    let errno = c.reg32(reg::ERRNO);
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(run, status::FAILED);
    assert_ne!(
        st, 0,
        "the descriptor's status reads 0 (done) though its source was never read \
         (run STATUS {run}, ERRNO {errno})"
    );
}

/// type1 (`vfio_dma_do_unmap`) checks the dirty bitmap's size (`verify_bitmap_size`) before it
/// unmaps anything; memvisor's type1.md: "unmap_get_dirty ... EINVAL, nothing unmapped". A
/// refused request leaves the server as it was (error.rs). Here a bitmap too small for the range
/// is refused with EINVAL after the range was unmapped.
#[test]
fn an_unmap_refused_for_its_bitmap_size_unmaps_nothing() {
    let (mut c, t) = ready_with(|s| s.port().dma().start_dirty_tracking().unwrap());
    let mem = memfd(1 << 20);
    assert_eq!(c.map_flags(Some(&mem), 3, 0, 0x10000, 0x4000), 0);
    let dirty = DmaUnmap {
        argsz: 40,
        flags: proto::unmap_flags::GET_DIRTY_BITMAP,
        iova: 0x10000,
        size: 0x4000,
        bitmap: Some((4096, 0)), // 4 pages need 1 byte (type1: 8)
    };
    let e = c.call(cmd::DMA_UNMAP, &dirty.to_bytes(), &[]).0;
    assert_eq!(e, libc::EINVAL as u32);
    let after = c.unmap(0x10000, 0x4000, 0);
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        after,
        (0, 0x4000),
        "the refused unmap took the mapping away"
    );
}

/// vfio-user.rst, DMA_MAP: "A command to map over an existing region must be failed by the
/// server with EEXIST" (type1 checks overlap before it touches the vaddr). With a descriptor
/// whose offset is past the file's end the server answers EINVAL instead: it maps the file
/// (`map_within`) before type1's checks of the IOVA range.
#[test]
fn a_map_over_an_existing_region_is_eexist_whatever_its_file_range() {
    let (mut c, t) = ready();
    let mem = memfd(1 << 20);
    assert_eq!(c.map_flags(Some(&mem), 3, 0, 0x10000, 0x4000), 0);
    let e = c.map_flags(Some(&mem), 3, 2 << 20, 0x12000, 0x1000);
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        e,
        libc::EEXIST as u32,
        "map over an existing region: errno {e}"
    );
}

/// vfio-user.rst, Socket: "it is still illegal for implementations to stall command or reply
/// processing indefinitely while waiting for replies on the other channel". server.rs: the
/// device's DMA_READ / DMA_WRITE "replies come back through this loop, which therefore never
/// waits for the device". DEVICE_RESET makes the loop wait for the device (wait_idle) while the
/// device waits for a DMA_READ reply only the loop can read: each request of the table stalls
/// for its whole 5 s timeout.
#[test]
fn a_reset_while_the_device_reads_client_memory_is_not_stalled() {
    let (mut c, t) = ready();
    let _irq = msi(&mut c);
    let mem = memfd(8 << 20);
    assert_eq!(c.map_flags(Some(&mem), 3, 0, 0, 8 << 20), 0);
    assert_eq!(c.map_flags(None, 3, 0, R, 1 << 20), 0);
    for i in 0..2u64 {
        put_desc_at(&mem, DESC + 32 * i, R + i * 4096, DST + i * 4096, 64);
    }
    c.region_write(0, reg::DESC, &DESC.to_le_bytes());
    c.region_write(0, reg::COUNT, &2u32.to_le_bytes());
    c.region_write(0, reg::MODE, &0u32.to_le_bytes());
    c.send(
        cmd::REGION_WRITE,
        &region_write_body(0, reg::DOORBELL, &1u32.to_le_bytes()),
        &[],
    );
    // The doorbell's reply and the device's first DMA_READ, in either order; the DMA_READ is
    // answered after the client's reset request goes out (a client's threads race like this).
    let mut doorbell = false;
    let mut first: Option<(Header, Vec<u8>)> = None;
    while !(doorbell && first.is_some()) {
        let (h, b) = read_msg(&c.sock);
        if h.is_reply() {
            doorbell = true;
        } else {
            first = Some((h, b));
        }
    }
    let started = Instant::now();
    c.send(cmd::DEVICE_RESET, &[], &[]);
    let (h, b) = first.unwrap();
    let mut out = b[..proto::DMA_RW].to_vec();
    out.extend(std::iter::repeat_n(0xab, proto::u64_at(&b, 8) as usize));
    let reply = Header {
        id: h.id,
        command: h.command,
        size: (HEADER + out.len()) as u32,
        flags: flags::REPLY,
        error: 0,
    };
    let mut m = reply.to_bytes().to_vec();
    m.extend_from_slice(&out);
    memvisor_wire::send_with_fds(&c.sock, &m, &[]).unwrap();
    // Serve the device's requests promptly until the reset is answered.
    let reset = loop {
        if let Some((h, _)) = answer_one(&c, None) {
            break h;
        }
    };
    let took = started.elapsed();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(reset.command, cmd::DEVICE_RESET);
    assert!(
        took < Duration::from_secs(3),
        "DEVICE_RESET answered after {took:?} (QEMU gives up after 5 s)"
    );
}

/// The descriptor's access mode is not honoured either when `SharedMappings` hands out a live
/// mapping of the same file: a connection that sends an O_RDONLY descriptor with READ|WRITE is
/// refused (EACCES) when alone, and accepted — with a writable mapping — when another
/// connection of the process has the same file mapped.
#[test]
fn a_writable_map_of_a_read_only_descriptor_does_not_depend_on_other_connections() {
    let mem = memfd(1 << 20);
    let path = format!("/proc/self/fd/{}\0", mem.as_raw_fd());
    // SAFETY: opens a NUL-terminated path; checked.
    let ro = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    assert!(ro >= 0);
    // SAFETY: a new descriptor we own.
    let ro = unsafe { OwnedFd::from_raw_fd(ro) };
    let (mut b, tb) = ready();
    let alone = b.map_flags(Some(&ro), 3, 0, 0x10000, 0x4000);
    let (mut a, ta) = ready();
    assert_eq!(a.map_flags(Some(&mem), 3, 0, 0x10000, 0x4000), 0);
    let shared = b.map_flags(Some(&ro), 3, 0, 0x10000, 0x4000);
    drop((a, b));
    let _ = (ta.join().unwrap(), tb.join().unwrap());
    assert_eq!(
        (alone, shared),
        (libc::EACCES as u32, libc::EACCES as u32),
        "READ|WRITE map of an O_RDONLY descriptor: alone errno {alone}, while another \
         connection maps the file errno {shared}"
    );
}

/// Edge messages that were right already: type1's errnos, region access bounds, VERSION
/// JSON, message type 2, SET_IRQS with short data; a size below the header ends the
/// connection with EPROTO.
#[test]
fn edge_messages_get_type1s_errnos_and_the_connection_goes_on() {
    let (mut c, t) = ready();
    let mem = memfd(1 << 20);
    // Wrap, top of the space, size 0 unmap, ALL with a range.
    assert_eq!(
        c.map_flags(None, 3, 0, u64::MAX - 0xfff, 0x2000),
        libc::EINVAL as u32
    );
    assert_eq!(
        c.map_flags(None, 3, 0, u64::MAX - 0xfff, 0x1000),
        0,
        "last page of the space"
    );
    assert_eq!(c.unmap(u64::MAX - 0xfff, 0x1000, 0), (0, 0x1000));
    assert_eq!(c.unmap(0x1000, 0, 0).0, libc::EINVAL as u32);
    assert_eq!(c.unmap(0x2000, u64::MAX - 0xfff, 0).0, libc::EINVAL as u32);
    assert_eq!(
        c.map_flags(Some(&mem), 4, 0, 0x1000, 0x1000),
        libc::EINVAL as u32
    );
    // Region access edges.
    let z = proto::RegionAccess {
        offset: 256,
        region: 7,
        count: 0,
    }
    .to_bytes();
    assert_eq!(c.call(cmd::REGION_READ, &z, &[]).0, 0);
    let far = proto::RegionAccess {
        offset: u64::MAX - 1,
        region: 7,
        count: 4,
    }
    .to_bytes();
    assert_eq!(c.call(cmd::REGION_READ, &far, &[]).0, libc::EINVAL as u32);
    let idx = proto::RegionAccess {
        offset: 0,
        region: u32::MAX,
        count: 4,
    }
    .to_bytes();
    assert_eq!(c.call(cmd::REGION_READ, &idx, &[]).0, libc::EINVAL as u32);
    let big = proto::RegionAccess {
        offset: 0,
        region: 0,
        count: (1 << 20) + 1,
    }
    .to_bytes();
    assert_eq!(c.call(cmd::REGION_READ, &big, &[]).0, libc::EINVAL as u32);
    for (off, n) in [(0u64, 3u32), (1, 2), (4, 8), (0x30, 8), (0xffc, 4), (0, 16)] {
        let a = proto::RegionAccess {
            offset: off,
            region: 0,
            count: n,
        }
        .to_bytes();
        let _ = c.call(cmd::REGION_READ, &a, &[]);
    }
    // Malformed VERSION JSON again after the handshake, and a non-object.
    let v = proto::Version {
        major: 0,
        minor: 0,
        json: "{".into(),
    };
    assert_eq!(
        c.call(cmd::VERSION, &v.to_bytes(), &[]).0,
        libc::EINVAL as u32
    );
    let v = proto::Version {
        major: 0,
        minor: 0,
        json: "[1,2]".into(),
    };
    assert_eq!(c.call(cmd::VERSION, &v.to_bytes(), &[]).0, 0);
    // Message type 2.
    c.id += 1;
    let h = Header {
        id: c.id,
        command: cmd::DEVICE_RESET,
        size: 16,
        flags: 2,
        error: 0,
    };
    memvisor_wire::send_with_fds(&c.sock, &h.to_bytes(), &[]).unwrap();
    assert_eq!(c.recv().0, libc::EINVAL as u32);
    // SET_IRQS DATA_BOOL with short data; count 0 de-assign.
    let mut set = Vec::new();
    for v in [21u32, 0x22, 1, 0, 1] {
        set.extend_from_slice(&v.to_le_bytes());
    }
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set, &[]).0,
        libc::EINVAL as u32
    );
    set.push(1);
    assert_eq!(c.call(cmd::DEVICE_SET_IRQS, &set, &[]).0, 0);
    // Refused maps, again and again: each refused the same way.
    for _ in 0..50 {
        let e = eventfd();
        let e2 = eventfd();
        assert_ne!(c.map_flags(Some(&e), 3, 0, 0x1000, 0x1000), 0);
        let m = DmaMap {
            argsz: 32,
            flags: 3,
            offset: 0,
            iova: 0x1000,
            size: 0x1000,
        };
        assert_eq!(
            c.call(
                cmd::DMA_MAP,
                &m.to_bytes(),
                &[e.as_raw_fd(), e2.as_raw_fd()]
            )
            .0,
            libc::EINVAL as u32
        );
        assert_eq!(
            c.call(cmd::DEVICE_GET_INFO, &[16, 0, 0, 0], &[e.as_raw_fd()])
                .0,
            libc::EINVAL as u32
        );
        assert_ne!(c.map_flags(Some(&mem), 3, 0, 0x1001, 0x1000), 0);
        assert_ne!(c.map_flags(Some(&mem), 3, 0, 0x1000, 4 << 20), 0);
    }
    // Size below the header ends the connection.
    let h = Header {
        id: 9,
        command: cmd::DEVICE_RESET,
        size: 8,
        flags: 0,
        error: 0,
    };
    memvisor_wire::send_with_fds(&c.sock, &h.to_bytes(), &[]).unwrap();
    let (stats, end) = t.join().unwrap();
    assert_eq!(end.unwrap_err().errno(), libc::EPROTO);
    assert_eq!(stats.mappings_at_end, 0);
}

#[test]
fn pipelined_requests_and_a_hang_up_mid_message() {
    let (mut c, t) = ready();
    let mem = memfd(1 << 20);
    // 64 requests before reading any reply, some posted.
    for i in 0..64u64 {
        let m = DmaMap {
            argsz: 32,
            flags: 3,
            offset: i * 4096,
            iova: 0x100000 + i * 4096,
            size: 4096,
        };
        c.id += 1;
        let posted = i % 2 == 0;
        let h = Header {
            id: 7, // reused on purpose
            command: cmd::DMA_MAP,
            size: (HEADER + 32) as u32,
            flags: if posted { flags::NO_REPLY } else { 0 },
            error: 0,
        };
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(&m.to_bytes());
        memvisor_wire::send_with_fds(&c.sock, &b, &[mem.as_raw_fd()]).unwrap();
    }
    for _ in 0..32 {
        let (h, _) = read_msg(&c.sock);
        assert_eq!((h.id, h.flags), (7, flags::REPLY));
    }
    c.id = 0;
    assert_eq!(c.unmap(0, 0x200000, 0).0, 0);
    // Half a DMA_MAP, its descriptor attached, then the client leaves.
    let h = Header {
        id: 1,
        command: cmd::DMA_MAP,
        size: 48,
        flags: 0,
        error: 0,
    };
    let mut b = h.to_bytes().to_vec();
    b.extend_from_slice(&[0u8; 10]);
    memvisor_wire::send_with_fds(&c.sock, &b, &[mem.as_raw_fd()]).unwrap();
    drop(c);
    let (stats, end) = t.join().unwrap();
    end.unwrap();
    assert_eq!((stats.dma_maps, stats.mappings_at_end), (64, 0));
}
