//! A frontend that dies leaves the back end writing to a closed back-end channel: that write
//! must fail with EPIPE, not raise SIGPIPE, so a process that did not ignore SIGPIPE (a VMM
//! embedding this crate from C; Rust's own runtime ignores it) outlives its frontend. This test
//! restores SIGPIPE's default action, so it has a test binary of its own: if the back end
//! raised the signal, the whole process would die and the test fail.

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;

use common::*;
use memvisor_vhost::proto::{self, F_IOMMU_PLATFORM, VringAddr, protocol, req};
use memvisor_vhost::{Blk, BlkOptions};

#[test]
fn an_iotlb_miss_on_a_closed_back_end_channel_does_not_raise_sigpipe() {
    // SAFETY: sets a signal's disposition to its default; no handler runs.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };

    let g = Guest::new(4 * MIB);
    let options = BlkOptions {
        iommu: true,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(memfd(MIB), options).unwrap());
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
    drop(theirs);
    let table = proto::mem_table_bytes(&[g.region()]);
    assert_eq!(
        c.ack(req::SET_MEM_TABLE, &table, &[g.file.as_raw_fd()])
            .unwrap(),
        0
    );
    // The frontend's end of the back-end channel goes, as when QEMU dies.
    drop(ours);

    // Ring addresses the empty IOTLB cannot translate: the back end sends a MISS on the closed
    // channel, then answers.
    let st = |n: u32| proto::vring_state_bytes(0, n);
    assert_eq!(c.ack(req::SET_VRING_NUM, &st(16), &[]).unwrap(), 0);
    let addr = VringAddr {
        desc: 0x4000_0000,
        avail: 0x4000_1000,
        used: 0x4000_2000,
        ..g.vring_addr()
    };
    assert_eq!(c.ack(req::SET_VRING_ADDR, &addr.bytes(), &[]).unwrap(), 0);
    assert_eq!(
        c.get_u64(req::GET_FEATURES).unwrap(),
        f,
        "the back end answers"
    );
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert!(backend.stats().iotlb_misses >= 1, "no MISS was sent");
}
