//! Frontend messages that must leave the back end's rings where they were: a refused or an
//! accepted REM_MEM_REG, a new kick eventfd for a running ring; a memory table failing at its
//! third region; GET_CONFIG of a bad range answered with no payload (vhost-user.rst). Those
//! behind a vIOMMU are in iommu.rs.

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
