//! The server and the mvdma device driven by a client in the test, over a socket pair: the
//! handshake QEMU does, DMA both ways through memory passed as a memfd, and bad requests, each
//! answered with its errno while the connection stays in step.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};

use common::*;

use memvisor::DmaConfig;
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor_vfio_user::dmadev::{self, fnv1a, reg, status};
use memvisor_vfio_user::proto::{self, DmaMap, DmaUnmap, HEADER, Header, cmd, flags};
use memvisor_vfio_user::{Result, Server};

fn wait_irq(fd: &OwnedFd) {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polls one live pollfd.
    let ready = unsafe { libc::poll(&mut p, 1, 10_000) };
    assert_eq!(ready, 1, "no MSI in 10 s");
    let mut v = [0u8; 8];
    // SAFETY: reads 8 bytes into a live buffer.
    let read = unsafe { libc::read(fd.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
    assert_eq!(read, 8);
}

const DESC: u64 = 0x10_0000;
const SRC: u64 = 0x20_0000;
const DST: u64 = 0x40_0000;

/// Writes one descriptor at guest offset `DESC + 32 * i` (the memfd maps IOVA 0 at offset 0).
fn put_desc(mem: &OwnedFd, i: u64, src: u64, dst: u64, len: u32) {
    put_desc_at(mem, DESC + 32 * i, src, dst, len);
}

fn run_table(c: &mut Client, irq: &OwnedFd, count: u32, mode: u32) -> u32 {
    c.region_write(0, reg::DESC, &DESC.to_le_bytes());
    c.region_write(0, reg::COUNT, &count.to_le_bytes());
    c.region_write(0, reg::MODE, &mode.to_le_bytes());
    c.region_write(0, reg::DOORBELL, &1u32.to_le_bytes());
    wait_irq(irq);
    c.reg32(reg::STATUS)
}

#[test]
fn dma_both_ways_in_copy_and_pin_mode() {
    let (mut c, t) = start();
    handshake(&mut c);
    // Device info as QEMU needs it: PCI, >= 8 regions, >= 3 irqs.
    let info = c.ok(
        cmd::DEVICE_GET_INFO,
        &[16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        &[],
    );
    assert_eq!(proto::u32_at(&info, 4) & proto::device_flags::PCI, 2);
    assert!(proto::u32_at(&info, 8) >= 8 && proto::u32_at(&info, 12) >= 3);
    let cfg = c.region_read(7, 0, 256);
    assert_eq!(u16::from_le_bytes([cfg[0], cfg[1]]), dmadev::VENDOR);
    assert_eq!(cfg[0x34], 0x40, "capability list starts with MSI");
    // BAR sizing: all ones reads back the size mask.
    c.region_write(7, 0x10, &u32::MAX.to_le_bytes());
    let bar = u32::from_le_bytes(c.region_read(7, 0x10, 4).try_into().unwrap());
    assert_eq!(bar, !(dmadev::BAR0_SIZE as u32 - 1));
    assert_eq!(c.reg32(reg::ID), 0x6d76_646d);

    let irq = msi(&mut c);

    let mem = memfd(8 << 20);
    assert_eq!(c.map(&mem, 0, 0, 8 << 20), 0);
    for mode in [0u32, 1] {
        // Unaligned lengths and addresses, across page boundaries.
        let cases = [
            (SRC + 3, DST + 4091, 1u32),
            (SRC + 100, DST + 8192 + 7, 5000),
            (SRC, DST + 65536 + 1, 1 << 20),
        ];
        for (i, &(s, d, len)) in cases.iter().enumerate() {
            let data: Vec<u8> = (0..len)
                .map(|k| {
                    (k as u8)
                        .wrapping_mul(31)
                        .wrapping_add(i as u8 + mode as u8)
                })
                .collect();
            pwrite(&mem, s, &data);
            put_desc(&mem, i as u64, s, d, len);
        }
        assert_eq!(run_table(&mut c, &irq, 3, mode), status::DONE);
        assert_eq!(c.reg32(reg::DONE), 3);
        for (i, &(s, d, len)) in cases.iter().enumerate() {
            let want = pread(&mem, s, len as usize);
            assert_eq!(
                pread(&mem, d, len as usize),
                want,
                "mode {mode} descriptor {i}"
            );
            let st = pread(&mem, DESC + 32 * i as u64 + 20, 12);
            assert_eq!(proto::u32_at(&st, 0), 0);
            assert_eq!(proto::u64_at(&st, 4), fnv1a(dmadev::FNV_START, &want));
        }
    }
    drop(c);
    let (stats, end) = t.join().unwrap();
    end.unwrap();
    let d = &stats.device;
    assert_eq!(d["descriptors_ok"], 6);
    assert_eq!(d["pin_descriptors"], 3);
    // 1 MiB from an offset 65537 bytes in: pieces of 512 pages each side, plus the small ones.
    assert!(d["pin_calls"].as_u64().unwrap() >= 6);
    assert_eq!(stats.pinned_pages_at_end, 0);
    assert_eq!(stats.locked_bytes_at_end, 0);
    assert_eq!(stats.irqs_signalled, 2);
}

/// A driver may poll STATUS instead of waiting for the interrupt, and hang up the moment it
/// reads DONE: the interrupt the device sends for that table is still counted. (The engine
/// reports DONE before it signals, so that a driver's next doorbell is not refused; the
/// server's count is read after the device is stopped, which waits for the signal.)
#[test]
fn an_interrupt_is_counted_when_the_client_polls_and_hangs_up() {
    for round in 0..20 {
        let (mut c, t) = start();
        handshake(&mut c);
        let _irq = msi(&mut c);
        let mem = memfd(8 << 20);
        assert_eq!(c.map(&mem, 0, 0, 8 << 20), 0);
        put_desc(&mem, 0, SRC, DST, 4096);
        c.region_write(0, reg::DESC, &DESC.to_le_bytes());
        c.region_write(0, reg::COUNT, &1u32.to_le_bytes());
        c.region_write(0, reg::MODE, &0u32.to_le_bytes());
        c.region_write(0, reg::DOORBELL, &1u32.to_le_bytes());
        let done = loop {
            let st = c.reg32(reg::STATUS);
            if st != status::BUSY {
                break st;
            }
        };
        assert_eq!(done, status::DONE, "round {round}");
        drop(c);
        let (stats, end) = t.join().unwrap();
        end.unwrap();
        assert_eq!(stats.device["runs"], 1, "round {round}");
        assert_eq!(stats.irqs_signalled, 1, "round {round}");
    }
}

#[test]
fn dma_to_unmapped_iovas_fails_and_writes_nothing() {
    let (mut c, t) = start();
    handshake(&mut c);
    let irq = msi(&mut c);
    let mem = memfd(8 << 20);
    // IOVA 0 .. 6 MiB mapped; a page at 7 MiB mapped and unmapped again.
    assert_eq!(c.map(&mem, 0, 0, 6 << 20), 0);
    assert_eq!(c.map(&mem, 7 << 20, 7 << 20, 4096), 0);
    assert_eq!(c.unmap(7 << 20, 4096, 0), (0, 4096));
    pwrite(&mem, 7 << 20, &[0x5a; 4096]);
    pwrite(&mem, (6 << 20) - 4096, &[0xee; 4096]);
    for mode in [0, 1] {
        put_desc(&mem, 0, SRC, 7 << 20, 4096); // into the unmapped page
        put_desc(&mem, 1, 7 << 20, DST, 4096); // from it
        put_desc(&mem, 2, SRC, (6 << 20) - 4096, 8192); // past the end of the mapping
        put_desc(&mem, 3, SRC, DST, 100); // a good one
        assert_eq!(run_table(&mut c, &irq, 4, mode), status::FAILED);
        assert_eq!(c.reg32(reg::DONE), 1);
        assert_eq!(c.reg32(reg::ERRNO), libc::EFAULT as u32);
        for i in 0..3 {
            assert_ne!(
                proto::u32_at(&pread(&mem, DESC + 32 * i + 20, 4), 0),
                0,
                "descriptor {i}"
            );
        }
        assert_eq!(
            pread(&mem, 7 << 20, 4096),
            vec![0x5a; 4096],
            "the unmapped page was written"
        );
        assert_eq!(
            pread(&mem, (6 << 20) - 4096, 4096),
            vec![0xee; 4096],
            "half of a refused write landed"
        );
    }
    drop(c);
    let (stats, end) = t.join().unwrap();
    end.unwrap();
    assert_eq!(stats.device["descriptors_failed"], 6);
}

#[test]
fn bad_requests_get_their_errno_and_the_stream_stays_in_step() {
    let (mut c, t) = start();
    // Before VERSION: refused.
    assert_eq!(
        c.call(cmd::DEVICE_GET_INFO, &[16, 0, 0, 0], &[]).0,
        libc::EINVAL as u32
    );
    handshake(&mut c);
    let mem = memfd(1 << 20);
    // Short DMA_MAP body.
    assert_eq!(
        c.call(cmd::DMA_MAP, &[0u8; 20], &[mem.as_raw_fd()]).0,
        libc::EINVAL as u32
    );
    // No descriptor and no access: type1 wants READ or WRITE.
    let m = DmaMap {
        argsz: 32,
        flags: 0,
        offset: 0,
        iova: 0x1000,
        size: 0x1000,
    };
    assert_eq!(
        c.call(cmd::DMA_MAP, &m.to_bytes(), &[]).0,
        libc::EINVAL as u32
    );
    // Type1's rules: misaligned, zero, past the file's end, overlap.
    assert_eq!(c.map(&mem, 0, 0x1001, 0x1000), libc::EINVAL as u32);
    assert_eq!(c.map(&mem, 0, 0x1000, 0), libc::EINVAL as u32);
    assert_eq!(c.map(&mem, 0, 0x1000, 2 << 20), libc::EINVAL as u32);
    assert_eq!(c.map(&mem, 0, 0x10000, 0x4000), 0);
    assert_eq!(c.map(&mem, 0, 0x12000, 0x1000), libc::EEXIST as u32);
    // Unmap: cutting a mapping is EINVAL and keeps it; nothing there is success with 0 bytes.
    assert_eq!(c.unmap(0x10000, 0x1000, 0).0, libc::EINVAL as u32);
    assert_eq!(c.unmap(0x100000, 0x100000, 0), (0, 0));
    assert_eq!(
        c.unmap(0x1000, 0x1000, proto::unmap_flags::ALL).0,
        libc::EINVAL as u32
    );
    assert_eq!(c.unmap(0, 0, 8).0, libc::EINVAL as u32);
    // The dirty bitmap with an unmap needs dirty tracking on (type1's rule): EINVAL, and the
    // mapping stays.
    let dirty = DmaUnmap {
        argsz: 40,
        flags: proto::unmap_flags::GET_DIRTY_BITMAP,
        iova: 0x10000,
        size: 0x4000,
        bitmap: Some((4096, 8)),
    };
    assert_eq!(
        c.call(cmd::DMA_UNMAP, &dirty.to_bytes(), &[]).0,
        libc::EINVAL as u32
    );
    // Regions: out of bounds, an index the device lacks, a count above the transfer limit.
    let far = proto::RegionAccess {
        offset: 4090,
        region: 0,
        count: 8,
    }
    .to_bytes();
    assert_eq!(c.call(cmd::REGION_READ, &far, &[]).0, libc::EINVAL as u32);
    let none = proto::RegionAccess {
        offset: 0,
        region: 5,
        count: 4,
    }
    .to_bytes();
    assert_eq!(c.call(cmd::REGION_READ, &none, &[]).0, libc::EINVAL as u32);
    // A descriptor where none belongs, unknown and unsupported commands.
    assert_eq!(
        c.call(cmd::DEVICE_RESET, &[], &[mem.as_raw_fd()]).0,
        libc::EINVAL as u32
    );
    assert_eq!(c.call(99, &[1, 2, 3], &[]).0, libc::ENOSYS as u32);
    assert_eq!(
        c.call(cmd::DEVICE_FEATURE, &[0; 8], &[]).0,
        libc::ENOTSUP as u32
    );
    // SET_IRQS past the index's vectors, and with the wrong number of descriptors.
    let mut set = Vec::new();
    for v in [20u32, 0x24, 1, 1, 1] {
        set.extend_from_slice(&v.to_le_bytes());
    }
    let e = eventfd();
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set, &[e.as_raw_fd()]).0,
        libc::EINVAL as u32
    );
    set[12..16].copy_from_slice(&0u32.to_le_bytes());
    assert_eq!(
        c.call(cmd::DEVICE_SET_IRQS, &set, &[e.as_raw_fd(), e.as_raw_fd()])
            .0,
        libc::EINVAL as u32
    );
    // Still in step, and the good mapping is intact.
    assert_eq!(c.unmap(0x10000, 0x4000, 0), (0, 0x4000));
    assert_eq!(c.reg32(reg::ID), 0x6d76_646d);
    // A message larger than any the protocol allows ends the connection.
    let h = Header {
        id: 1,
        command: cmd::REGION_WRITE,
        size: u32::MAX,
        flags: 0,
        error: 0,
    };
    memvisor_wire::send_with_fds(&c.sock, &h.to_bytes(), &[]).unwrap();
    let (stats, end) = t.join().unwrap();
    assert_eq!(end.unwrap_err().errno(), libc::EPROTO);
    assert_eq!(stats.dma_maps, 1);
    assert_eq!(stats.dma_unmaps_empty, 1);
}

#[test]
fn thousands_of_page_maps_share_one_file_mapping() {
    let (mut c, t) = start();
    handshake(&mut c);
    let mem = memfd(64 << 20);
    for i in 0..4096u64 {
        assert_eq!(c.map(&mem, i * 4096, 0x1_0000_0000 + i * 8192, 4096), 0);
    }
    assert!(!memvisor::SharedMappings::global().is_empty());
    assert_eq!(c.unmap(0, 0, proto::unmap_flags::ALL), (0, 4096 * 4096));
    drop(c);
    let (stats, end) = t.join().unwrap();
    end.unwrap();
    assert_eq!(stats.peak_mappings, 4096);
}

/// The client's own memory, mapped without a descriptor: the test plays QEMU and answers the
/// server's `DMA_READ` / `DMA_WRITE` requests from it, as QEMU's `vfio_user_dma_read/write` do.
struct PeerMemory {
    base: u64,
    bytes: Vec<u8>,
    /// Answer every request with this errno instead.
    fail: Option<u32>,
    reads: u64,
    writes: u64,
    largest: usize,
}

impl PeerMemory {
    /// Rings the doorbell and serves the device's requests until it raises its MSI. The
    /// device may send its first request before the server answers the doorbell, so that
    /// reply is taken here too (QEMU's proxy sorts replies from requests the same way).
    fn run(&mut self, c: &mut Client, irq: &OwnedFd) {
        let mut b = proto::RegionAccess {
            offset: reg::DOORBELL,
            region: 0,
            count: 4,
        }
        .to_bytes()
        .to_vec();
        b.extend_from_slice(&1u32.to_le_bytes());
        c.send(cmd::REGION_WRITE, &b, &[]);
        let mut answered = false;
        loop {
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
            let ready = unsafe { libc::poll(p.as_mut_ptr(), 2, 10_000) };
            assert!(ready > 0, "stuck");
            if p[1].revents & libc::POLLIN != 0 {
                answered |= self.answer(c);
                continue;
            }
            if p[0].revents & libc::POLLIN != 0 && answered {
                wait_irq(irq);
                return;
            }
        }
    }

    /// Answers one request from the device; true if the message was instead the reply to
    /// the doorbell.
    fn answer(&mut self, c: &mut Client) -> bool {
        let (h, body) = read_msg(&c.sock);
        if h.is_reply() {
            assert_eq!((h.id, h.flags & flags::ERROR), (c.id, 0), "doorbell reply");
            return true;
        }
        // QEMU refuses a body under 16 bytes (sizeof(VFIOUserDMARW) - header).
        assert!(body.len() >= proto::DMA_RW, "{} bytes", body.len());
        let (iova, count) = (proto::u64_at(&body, 0), proto::u64_at(&body, 8) as usize);
        self.largest = self.largest.max(count);
        let at = (iova - self.base) as usize;
        let mut reply = Header {
            id: h.id,
            command: h.command,
            size: 0,
            flags: flags::REPLY,
            error: 0,
        };
        let mut out = Vec::new();
        if let Some(errno) = self.fail {
            reply.flags |= flags::ERROR;
            reply.error = errno;
        } else if h.command == cmd::DMA_READ {
            assert_eq!(body.len(), proto::DMA_RW);
            out = body.clone();
            out.extend_from_slice(&self.bytes[at..at + count]);
            self.reads += 1;
        } else {
            assert_eq!(h.command, cmd::DMA_WRITE);
            // QEMU answers E2BIG unless count <= size - sizeof(VFIOUserDMARW).
            assert_eq!(body.len(), proto::DMA_RW + count);
            self.bytes[at..at + count].copy_from_slice(&body[proto::DMA_RW..]);
            self.writes += 1;
        }
        reply.size = (HEADER + out.len()) as u32;
        let mut b = reply.to_bytes().to_vec();
        b.extend_from_slice(&out);
        memvisor_wire::send_with_fds(&c.sock, &b, &[]).unwrap();
        false
    }
}

/// Memory QEMU does not share arrives as maps without a descriptor; the device's copies reach
/// it with DMA_READ / DMA_WRITE in pieces of the client's max_data_xfer_size, across the
/// boundary with memory it has mapped, in both modes (pin mode falls back to copying: there is
/// nothing to pin), and every rule of the table still applies before a message is sent.
#[test]
fn maps_without_a_descriptor_are_served_through_the_client() {
    let (mut c, t) = start();
    let v = proto::Version {
        major: 0,
        minor: 0,
        json: r#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":4096}}"#.into(),
    };
    c.ok(cmd::VERSION, &v.to_bytes(), &[]);
    let irq = msi(&mut c);
    let mem = memfd(8 << 20);
    assert_eq!(c.map(&mem, 0, 0, 8 << 20), 0);
    // [8 MiB, 12 MiB): the client's, read-write; [12 MiB, 12 MiB + 4 KiB): the client's, read-only.
    let remote = |c: &mut Client, iova: u64, size: u64, fl: u32| {
        let m = DmaMap {
            argsz: 32,
            flags: fl,
            offset: 0,
            iova,
            size,
        };
        c.call(cmd::DMA_MAP, &m.to_bytes(), &[]).0
    };
    const R: u64 = 8 << 20;
    assert_eq!(remote(&mut c, R, 4 << 20, 3), 0);
    assert_eq!(remote(&mut c, R + (4 << 20), 4096, 1), 0);
    assert_eq!(remote(&mut c, R, 4096, 3), libc::EEXIST as u32, "overlap");
    let mut peer = PeerMemory {
        base: R,
        bytes: (0..(4 << 20) + 4096).map(|k| (k % 251) as u8).collect(),
        fail: None,
        reads: 0,
        writes: 0,
        largest: 0,
    };
    for mode in [0u32, 1] {
        let o = mode as u64 * (1 << 20);
        let cases = [
            (SRC + o + 5, R + o + (1 << 19) + 3, 70_000u32), // local -> peer
            (R + o + (2 << 20) + 9, DST + o + 1, 10_000),    // peer -> local
            (R - 4096, R + (3 << 20) + o / 2 - 100, 3 * 4096), // local+peer -> peer
        ];
        for (i, &(s, _, len)) in cases.iter().enumerate() {
            if s < R {
                let data: Vec<u8> = (0..len).map(|k| (k as u8) ^ (i as u8 * 77)).collect();
                pwrite(&mem, s, &data);
            }
        }
        for (i, &(s, d, len)) in cases.iter().enumerate() {
            put_desc(&mem, i as u64, s, d, len);
        }
        c.region_write(0, reg::DESC, &DESC.to_le_bytes());
        c.region_write(0, reg::COUNT, &3u32.to_le_bytes());
        c.region_write(0, reg::MODE, &mode.to_le_bytes());
        // What each source holds now, before the device moves anything.
        let src: Vec<Vec<u8>> = cases
            .iter()
            .map(|&(s, _, len)| {
                (s..s + len as u64)
                    .map(|a| match a < R {
                        true => pread(&mem, a, 1)[0],
                        false => peer.bytes[(a - R) as usize],
                    })
                    .collect()
            })
            .collect();
        peer.run(&mut c, &irq);
        assert_eq!(c.reg32(reg::STATUS), status::DONE, "mode {mode}");
        for (i, &(_, d, len)) in cases.iter().enumerate() {
            let got: Vec<u8> = match d < R {
                true => pread(&mem, d, len as usize),
                false => peer.bytes[(d - R) as usize..(d - R) as usize + len as usize].to_vec(),
            };
            assert!(
                got == src[i],
                "mode {mode} descriptor {i}: destination differs"
            );
            let st = pread(&mem, DESC + 32 * i as u64 + 20, 12);
            assert_eq!(proto::u32_at(&st, 0), 0, "mode {mode} descriptor {i}");
            assert_eq!(proto::u64_at(&st, 4), fnv1a(dmadev::FNV_START, &src[i]));
        }
    }
    assert_eq!(
        peer.largest, 4096,
        "pieces of the client's max_data_xfer_size"
    );
    let (reads, writes) = (peer.reads, peer.writes);
    assert!(reads > 0 && writes > 0);

    // The table's rules come before any message: a write into the read-only page, and a
    // source running past the client's memory, fail with no request sent.
    put_desc(&mem, 0, SRC, R + (4 << 20), 16);
    put_desc(&mem, 1, R + (4 << 20), DST, 8192);
    c.region_write(0, reg::COUNT, &2u32.to_le_bytes());
    c.region_write(0, reg::MODE, &0u32.to_le_bytes());
    let before = (peer.reads, peer.writes);
    peer.run(&mut c, &irq);
    assert_eq!(c.reg32(reg::STATUS), status::FAILED);
    assert_eq!(
        (peer.reads, peer.writes),
        before,
        "no request for refused descriptors"
    );
    let st = |i: u64| proto::u32_at(&pread(&mem, DESC + 32 * i + 20, 4), 0);
    assert_eq!((st(0), st(1)), (libc::EPERM as u32, libc::EFAULT as u32));
    // The client's errno becomes the descriptor's status.
    peer.fail = Some(libc::ENODEV as u32);
    put_desc(&mem, 0, R, DST, 16);
    c.region_write(0, reg::COUNT, &1u32.to_le_bytes());
    peer.run(&mut c, &irq);
    assert_eq!(c.reg32(reg::STATUS), status::FAILED);
    assert_eq!(st(0), libc::ENODEV as u32);
    peer.fail = None;
    // Unmapped like any other mapping, whole only.
    assert_eq!(c.unmap(R, 4096, 0).0, libc::EINVAL as u32, "cuts a mapping");
    assert_eq!(c.unmap(R, 4 << 20, 0), (0, 4 << 20));

    drop(c);
    let (stats, end) = t.join().unwrap();
    end.unwrap();
    assert_eq!(stats.dma_maps_remote, 2);
    assert_eq!(stats.peer_reads, reads);
    assert_eq!(stats.peer_writes, writes);
    assert_eq!(stats.peer_errors, 1);
    assert!(stats.device["pin_fallbacks"].as_u64().unwrap() >= 3);
    assert_eq!(stats.pinned_pages_at_end, 0);
    assert_eq!(stats.locked_bytes_at_end, 0);
}

/// A device that pins a page when its first register is written and lets go only when reset.
struct Stubborn {
    port: std::sync::Arc<memvisor_vfio_user::Port>,
    pinned: Vec<u64>,
    resets: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

impl memvisor_vfio_user::Device for Stubborn {
    fn flags(&self) -> u32 {
        memvisor_vfio_user::server::PCI_DEVICE
    }
    fn regions(&self) -> Vec<memvisor_vfio_user::RegionInfo> {
        vec![memvisor_vfio_user::RegionInfo {
            size: 4096,
            flags: proto::region_flags::READ | proto::region_flags::WRITE,
        }]
    }
    fn irqs(&self) -> Vec<memvisor_vfio_user::IrqInfo> {
        Vec::new()
    }
    fn read(&mut self, _: u32, _: u64, buf: &mut [u8]) -> Result<()> {
        buf.fill(0);
        Ok(())
    }
    fn write(&mut self, _: u32, _: u64, data: &[u8]) -> Result<()> {
        let page = u64::from_le_bytes(data.try_into().expect("8 bytes"));
        self.port.dma().pin_pages(&[page], memvisor::Prot::RW)?;
        self.pinned.push(page);
        Ok(())
    }
    fn reset(&mut self) -> Result<()> {
        self.resets
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        for page in self.pinned.drain(..) {
            self.port.dma().unpin_pages(&[page])?;
        }
        Ok(())
    }
    fn stats(&self) -> serde_json::Value {
        serde_json::Value::Null
    }
}

#[test]
fn a_device_that_keeps_its_pins_is_stopped_and_the_unmap_still_succeeds() {
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let config = DmaConfig {
        registry: Some(PinRegistry::new(LockLimit::Unlimited)),
        unpin_wait: std::time::Duration::from_millis(50),
        ..DmaConfig::default()
    };
    let resets = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let r = resets.clone();
    let server = Server::new(b, config, memvisor::SharedMappings::global(), move |port| {
        Stubborn {
            port,
            pinned: Vec::new(),
            resets: r,
        }
    })
    .unwrap();
    let t = std::thread::spawn(move || server.serve());
    let mut c = Client { sock: a, id: 0 };
    handshake(&mut c);
    let mem = memfd(1 << 20);
    assert_eq!(c.map(&mem, 0, 0x10000, 0x4000), 0);
    // The device pins page 0x11 (iova 0x11000) through a register write.
    c.region_write(0, 0, &0x11u64.to_le_bytes());
    // It never answers the unmap notifier: the server stops it, and the unmap is done, not
    // refused (QEMU would take a refusal as done while the device kept writing).
    assert_eq!(c.unmap(0x10000, 0x4000, 0), (0, 0x4000));
    assert_eq!(resets.load(std::sync::atomic::Ordering::SeqCst), 1);
    drop(c);
    let (stats, end) = t.join().unwrap();
    end.unwrap();
    assert_eq!(stats.device_stops, 1);
    assert_eq!(stats.dma_unmap_errors, 0);
    assert_eq!(stats.pinned_pages_at_end, 0);
    assert_eq!(stats.locked_bytes_at_end, 0);
}
