//! Every file descriptor a refused (or descriptor-less) vhost-user message carries is closed.
//! A test binary of its own: it counts this process's open descriptors, which tests running
//! beside it would change.

mod common;

use std::os::fd::AsRawFd;

use common::*;
use memvisor_vhost::proto::{self, Region, req};
use memvisor_vhost::{Blk, BlkOptions};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Every descriptor a refused (or descriptor-less) message carries is closed.
#[test]
fn fd_accounting_refused_messages_close_their_descriptors() {
    let mut g = Guest::new(4 * MIB);
    let (c, t) = serve(Blk::new(mib_disk(), BlkOptions::default()).unwrap());
    setup(&c, &g);
    assert_eq!(read_one(&mut g), 0);
    let e = eventfd();
    let m = memfd(MIB);
    let (fe, fm) = (e.as_raw_fd(), m.as_raw_fd());
    let r = |gpa: u64, size: u64, user: u64| Region {
        gpa,
        size,
        user_addr: user,
        mmap_offset: 0,
    };
    let before = open_fds();
    let cases: Vec<(u32, Vec<u8>, Vec<i32>, bool)> = vec![
        (
            req::SET_VRING_KICK,
            9u64.to_le_bytes().to_vec(),
            vec![fe],
            false,
        ),
        (
            req::SET_VRING_CALL,
            0x100u64.to_le_bytes().to_vec(),
            vec![fe],
            false,
        ),
        (
            req::SET_VRING_ERR,
            9u64.to_le_bytes().to_vec(),
            vec![fe],
            false,
        ),
        (
            req::ADD_MEM_REG,
            proto::single_region_bytes(&r(MIB, MIB, USER + 64 * MIB)),
            vec![fm],
            false,
        ),
        (
            req::ADD_MEM_REG,
            proto::single_region_bytes(&r(64 * MIB, MIB, USER + 64 * MIB)),
            vec![fm, fm],
            false,
        ),
        (
            req::SET_MEM_TABLE,
            proto::mem_table_bytes(&[r(0, MIB, USER)]),
            vec![fm, fm],
            false,
        ),
        (
            req::SET_MEM_TABLE,
            proto::mem_table_bytes(&[
                r(0, MIB, USER),
                r(MIB, MIB, USER + MIB),
                r(2 * MIB, MIB, USER + 2 * MIB),
            ]),
            vec![fm, fm, fe],
            false,
        ),
        (
            req::REM_MEM_REG,
            proto::single_region_bytes(&r(64 * MIB, MIB, USER + 64 * MIB)),
            vec![fm],
            false,
        ),
        (req::SET_LOG_FD, vec![], vec![fe], true),
        (req::SET_OWNER, vec![], vec![fe, fm], true),
        (req::SET_INFLIGHT_FD, vec![0; 24], vec![fm], false),
        (
            req::SET_VRING_ENABLE,
            proto::vring_state_bytes(0, 1),
            vec![fe],
            true,
        ),
    ];
    for (i, (request, payload, fds, ok)) in cases.iter().enumerate() {
        let ack = c.ack(*request, payload, fds).unwrap();
        assert_eq!(ack == 0, *ok, "case {i} {}: ack {ack}", req::name(*request));
    }
    assert_eq!(read_one(&mut g), 0);
    let after = open_fds();
    drop(c);
    let _ = t.join().unwrap();
    assert_eq!(after, before, "descriptors left open by refused messages");
}
