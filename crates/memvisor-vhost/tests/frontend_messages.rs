//! Frontend messages that must leave the back end's rings where they were: a refused or an
//! accepted REM_MEM_REG, a new kick eventfd for a running ring, GET_VRING_BASE while a start
//! waits for the IOTLB; an IOTLB update answered for itself; a frontend that stops reading its
//! back-end channel; GET_CONFIG of a bad range answered with no payload (vhost-user.rst).

mod common;

use std::io::Write;
use std::os::fd::AsRawFd;

use common::*;
use memvisor::Gpa;
use memvisor_vhost::proto::{self, Region, req};
use memvisor_vhost::{Blk, BlkOptions};

const STATUS: u64 = 0x30000;

fn running(live: &memvisor_vhost::BackendLive) -> bool {
    live.queues()[0].running
}

/// A REM_MEM_REG that names no held region (right guest address and size, wrong user
/// address) is refused with a non-zero ack: it must change nothing. The ring in that guest
/// range must still run.
#[test]
fn a_refused_rem_mem_reg_leaves_the_running_ring_alone() {
    let mut g = Guest::new(4 * MIB);
    let (c, t, live) = serve_live(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(read_one(&mut g), 0);
    assert!(running(&live));
    let wrong = Region {
        user_addr: USER + 64 * MIB,
        ..g.region()
    };
    let ack = c
        .ack(req::REM_MEM_REG, &proto::single_region_bytes(&wrong), &[])
        .unwrap();
    assert_ne!(ack, 0, "a region never added was removed");
    assert_eq!(live.stats().refused, 1);
    // The live row is published just after the ack goes out.
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(
        running(&live),
        "REM_MEM_REG was refused, yet ring 0 was stopped"
    );
    drop(c);
    let _ = t.join().unwrap();
}

/// REM_MEM_REG of the region holding a running ring stops it; GET_VRING_BASE must then still
/// answer the next available index the ring reached (2), not the SET_VRING_BASE value (0).
#[test]
fn get_vring_base_after_rem_mem_reg_reports_the_rings_progress() {
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(read_one(&mut g), 0);
    assert_eq!(read_one(&mut g), 0);
    let ack = c
        .ack(
            req::REM_MEM_REG,
            &proto::single_region_bytes(&g.region()),
            &[],
        )
        .unwrap();
    assert_eq!(ack, 0);
    let base = c
        .get(req::GET_VRING_BASE, &proto::vring_state_bytes(0, 0))
        .unwrap();
    assert_eq!(
        base,
        proto::vring_state_bytes(0, 2),
        "two requests were taken; GET_VRING_BASE must say 2"
    );
    drop(c);
    let _ = t.join().unwrap();
}

/// A new kick eventfd for a running ring (as the kernel's VHOST_SET_VRING_KICK allows) must
/// not rewind the ring to the SET_VRING_BASE value: requests already completed would be done
/// again and the used index would go backwards.
#[test]
fn a_new_kick_fd_for_a_running_ring_does_not_rewind_it() {
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(read_one(&mut g), 0);
    assert_eq!(read_one(&mut g), 0);
    // Mark the completed request's status: a second execution would overwrite it.
    g.mem.write(Gpa(STATUS), &[0xaa]).unwrap();
    let mut k2 = eventfd();
    assert_eq!(
        c.ack(req::SET_VRING_KICK, &0u64.to_le_bytes(), &[k2.as_raw_fd()])
            .unwrap(),
        0
    );
    k2.write_all(&1u64.to_le_bytes()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    let base = c
        .get(req::GET_VRING_BASE, &proto::vring_state_bytes(0, 0))
        .unwrap();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(
        s[0], 0xaa,
        "completed requests were executed again after SET_VRING_KICK (GET_VRING_BASE {base:?})"
    );
}

// ---- behind a vIOMMU

mod iommu {
    use super::*;
    use memvisor_testkit::vhost::client::Client;
    use memvisor_vhost::proto::{F_IOMMU_PLATFORM, IotlbMsg, VringAddr, iotlb, protocol};
    use std::os::unix::net::UnixStream;

    const IO: u64 = 0x4000_0000;
    const HDR: u64 = 0x10000;
    const DATA: u64 = 0x20000;
    const ST: u64 = 0x80000;

    fn update(c: &Client, iova: u64, gpa: u64, size: u64, perm: u8) -> u64 {
        let m = IotlbMsg {
            iova,
            size,
            uaddr: USER + gpa,
            perm,
            kind: iotlb::UPDATE,
        };
        c.ack(req::IOTLB_MSG, &m.bytes(), &[]).unwrap()
    }

    fn io_vring_addr(g: &Guest) -> VringAddr {
        let a = g.vring_addr();
        VringAddr {
            desc: IO + RING_AT,
            avail: IO + (a.avail - USER),
            used: IO + (a.used - USER),
            ..a
        }
    }

    fn iommu_blk() -> Blk {
        let d = memfd(MIB);
        std::os::unix::fs::FileExt::write_all_at(&d, &[0x5a; 4096], 0).unwrap();
        Blk::new(
            d,
            BlkOptions {
                iommu: true,
                ..BlkOptions::default()
            },
        )
        .unwrap()
    }

    fn connect(c: &Client, g: &Guest) -> UnixStream {
        let f = c.get_u64(req::GET_FEATURES).unwrap();
        assert_ne!(f & F_IOMMU_PLATFORM, 0);
        c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[]).unwrap();
        let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
        assert_ne!(pf & protocol::BACKEND_REQ, 0);
        c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
            .unwrap();
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

    /// IOTLB messages a spec-reading frontend could send wrong: each refused (non-zero ack)
    /// or harmless, and the back end still answers.
    #[test]
    fn odd_iotlb_and_inflight_messages_are_refused_or_harmless() {
        let g = Guest::new(4 * MIB);
        let (c, t) = serve(iommu_blk());
        let _ours = connect(&c, &g);
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
        let (c, t) = serve(iommu_blk());
        let _ours = connect(&c, &g);
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
        let (c, t) = serve(iommu_blk());
        let _ours = connect(&c, &g);
        for (iova, gpa, perm) in [(IO + HDR, HDR, 1), (IO + DATA, DATA, 3), (IO + ST, ST, 3)] {
            assert_eq!(update(&c, iova, gpa, 4096, perm), 0);
        }
        let st = |n: u32| proto::vring_state_bytes(0, n);
        for (r, p, fds) in [
            (req::SET_VRING_NUM, st(RING_SIZE as u32), vec![]),
            (req::SET_VRING_ADDR, io_vring_addr(&g).bytes(), vec![]),
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
        // The frontend stops the ring.
        let base = c.get(req::GET_VRING_BASE, &st(0)).unwrap();
        assert_eq!(base, st(0));
        // The driver still posts a request; then the ring's page gets its translation.
        g.mem.write(Gpa(HDR), &[0u8; 16]).unwrap();
        g.mem.write(Gpa(ST), &[0xff]).unwrap();
        g.post(&[
            (IO + HDR, 16, false),
            (IO + DATA, 512, true),
            (IO + ST, 1, true),
        ]);
        assert_eq!(update(&c, IO + RING_AT, RING_AT, 4096, 3), 0);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let mut s = [0u8];
        g.mem.read(Gpa(ST), &mut s).unwrap();
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
        let (c, t) = serve(iommu_blk());
        let ours = connect(&c, &g);
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
}

// ---- checks expected to hold (kept if they pass, as evidence)

/// A SET_MEM_TABLE whose third region cannot be mapped is refused whole: the first two are
/// not left mapped, and the old table stays in force.
#[test]
fn a_table_failing_at_its_third_region_maps_nothing_and_keeps_the_old_one() {
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    let f = memfd_named(2 * MIB, c"third-region");
    let mut pipe = [0; 2];
    // SAFETY: pipe fills the array with two new descriptors.
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let r = |gpa: u64, user: u64, off: u64| Region {
        gpa,
        size: MIB,
        user_addr: user,
        mmap_offset: off,
    };
    let table = proto::mem_table_bytes(&[
        r(0, USER + 256 * MIB, 0),
        r(MIB, USER + 257 * MIB, MIB),
        r(2 * MIB, USER + 258 * MIB, 0),
    ]);
    let ack = c
        .ack(
            req::SET_MEM_TABLE,
            &table,
            &[f.as_raw_fd(), f.as_raw_fd(), pipe[0]],
        )
        .unwrap();
    assert_ne!(ack, 0);
    assert_eq!(
        mappings_of("third-region"),
        0,
        "the refused table left mappings"
    );
    assert_eq!(read_one(&mut g), 0, "the old table is gone");
    // SAFETY: our descriptors.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
    drop(c);
    let (b, _) = t.join().unwrap();
    assert_eq!(b.stats().refused, 1);
}

/// GET_CONFIG that cannot be answered: the spec says the back end answers with a payload of
/// zero length ("vhost-user back-end uses zero length of payload to indicate an error").
#[test]
fn a_bad_get_config_is_answered_with_an_empty_payload() {
    let g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    negotiate(&c, &g);
    let r = c.get(req::GET_CONFIG, &proto::config_bytes(300, 0, &[0; 8]));
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(
        matches!(&r, Ok(p) if p.is_empty()),
        "GET_CONFIG past the config space: {r:?}; the back end ended with {end:?}"
    );
}
