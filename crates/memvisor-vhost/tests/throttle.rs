//! The blk throttle seen from a frontend: a device throttled to a byte rate or a request rate
//! serves at that rate (within ±10% over about 2 s: a correctness check of the throttle, not a
//! speed target), lifting the limit lets requests run freely again, the queues of a device
//! share its one throttle, and a frontend that leaves while a request waits for the throttle
//! ends the connection at once.

mod common;

use std::time::{Duration, Instant};

use common::*;
use memvisor::Gpa;
use memvisor_vhost::{Blk, BlkOptions, ThrottleConfig};

const HDR: u64 = 0x10_0000;
const STATUS: u64 = 0x11_0000;
const DATA: u64 = 0x20_0000;
const IN: u32 = 0;
const OUT: u32 = 1;

/// Requests of `len` bytes (reads, or writes) one at a time for `secs`; returns (bytes/s,
/// requests/s).
fn drive(g: &mut Guest, write: bool, len: u32, secs: f64) -> (f64, f64) {
    let sectors = 32 * MIB / 512;
    let step = u64::from(len) / 512;
    let start = Instant::now();
    let (mut n, mut bytes) = (0u64, 0u64);
    while start.elapsed().as_secs_f64() < secs {
        let sector = (n * step) % (sectors - step);
        g.add_request(
            0,
            if write { OUT } else { IN },
            sector,
            HDR,
            DATA,
            len,
            STATUS,
        );
        g.kick();
        used(g);
        let mut s = [0xffu8];
        g.mem.read(Gpa(STATUS), &mut s).unwrap();
        assert_eq!(s[0], 0, "request {n} failed");
        n += 1;
        bytes += u64::from(len);
    }
    let t = start.elapsed().as_secs_f64();
    (bytes as f64 / t, n as f64 / t)
}

/// Waits for the device to return the chain, looking every 20 µs (the test ring's driver does
/// not ask for interrupts in a way the device honours at once, and [`Guest::wait_used`] looks
/// only every 10 ms: too coarse to measure a rate).
fn used(g: &mut Guest) {
    let end = Instant::now() + Duration::from_secs(5);
    while g.ring.get_used().unwrap().is_none() {
        assert!(
            Instant::now() < end,
            "the device did not return the chain within 5 s"
        );
        std::thread::sleep(Duration::from_micros(20));
    }
}

fn within(measured: f64, limit: f64) -> bool {
    (measured - limit).abs() <= 0.10 * limit
}

#[test]
fn a_throttled_device_serves_at_its_limit_and_freely_once_lifted() {
    let blk = Blk::new(memfd(32 * MIB), BlkOptions::default()).unwrap();
    let throttle = blk.live().throttle().clone();
    let (c, t) = serve(blk);
    let mut g = Guest::new(64 * MIB);
    setup(&c, &g);

    // Unthrottled first, for the comparison: 64 KiB reads.
    let (free_bps, _) = drive(&mut g, false, 65536, 0.3);

    let bps = 8 * MIB;
    throttle
        .set(ThrottleConfig {
            bps,
            ..Default::default()
        })
        .unwrap();
    let (got, _) = drive(&mut g, false, 65536, 2.0);
    eprintln!("bps {bps}: measured {got:.0} B/s (unthrottled {free_bps:.0})");
    assert!(
        within(got, bps as f64),
        "bps {bps}: measured {got:.0} B/s, not within 10%"
    );
    assert!(
        free_bps > 2.0 * bps as f64,
        "unthrottled {free_bps:.0} B/s is too slow to tell the throttle worked"
    );

    // A request rate, writes of 4 KiB.
    let iops = 200;
    throttle
        .set(ThrottleConfig {
            iops_wr: iops,
            ..Default::default()
        })
        .unwrap();
    let (_, got) = drive(&mut g, true, 4096, 2.0);
    eprintln!("iops_wr {iops}: measured {got:.1}/s");
    assert!(
        within(got, iops as f64),
        "iops_wr {iops}: measured {got:.1} requests/s, not within 10%"
    );
    // A rate whose waits are often shorter than a pass over the ring: a wait already over
    // when the timer is set must still bring the loop back (it once stalled the ring).
    let iops = 2000;
    throttle
        .set(ThrottleConfig {
            iops,
            ..Default::default()
        })
        .unwrap();
    let (_, got) = drive(&mut g, false, 4096, 1.5);
    eprintln!("iops {iops}: measured {got:.1}/s");
    assert!(
        within(got, iops as f64),
        "iops {iops}: measured {got:.1} requests/s, not within 10%"
    );
    let write_limit = 200;
    throttle
        .set(ThrottleConfig {
            iops_wr: write_limit,
            ..Default::default()
        })
        .unwrap();
    // Reads are not limited by a write limit: they run far above it (compared with the write
    // limit, not with the 2,000/s above, which a loaded 2-core machine may not reach unthrottled).
    let (_, reads) = drive(&mut g, false, 4096, 0.3);
    assert!(
        reads > 5.0 * write_limit as f64,
        "reads at {reads:.0}/s under a write limit of {write_limit}/s"
    );

    // Lifted: back to free running.
    throttle.set(ThrottleConfig::default()).unwrap();
    let (lifted, _) = drive(&mut g, false, 65536, 0.3);
    assert!(
        lifted > 2.0 * bps as f64,
        "after lifting, {lifted:.0} B/s is still near the old limit"
    );
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(
        end.is_ok() || matches!(end, Err(memvisor_vhost::Error::Wire(_))),
        "{end:?}"
    );
}

#[test]
fn a_frontend_leaving_while_a_request_waits_ends_the_connection_at_once() {
    let blk = Blk::new(memfd(MIB), BlkOptions::default()).unwrap();
    let throttle = blk.live().throttle().clone();
    let (c, t) = serve(blk);
    let mut g = Guest::new(64 * MIB);
    setup(&c, &g);
    // One request a second: the first goes, the second waits about 900 ms.
    throttle
        .set(ThrottleConfig {
            iops: 1,
            ..Default::default()
        })
        .unwrap();
    g.add_request(0, IN, 0, HDR, DATA, 4096, STATUS);
    g.kick();
    g.wait_used();
    g.add_request(0, IN, 8, HDR, DATA, 4096, STATUS);
    g.kick();
    std::thread::sleep(Duration::from_millis(50));
    let left = Instant::now();
    drop(c);
    let (_, end) = t.join().unwrap();
    assert!(
        left.elapsed() < Duration::from_millis(400),
        "the back end took {:?} to end after its frontend left",
        left.elapsed()
    );
    assert!(
        end.is_ok() || matches!(end, Err(memvisor_vhost::Error::Wire(_))),
        "{end:?}"
    );
    // The waiting request was never taken: its status byte is untouched.
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    assert_eq!(s[0], 0xff);
}

/// TEST ONLY switch `MEMVISOR_TEST_IGNORE_THROTTLE`: the throttle is accepted and shown, and
/// never holds a request back (the guest trial's negative control relies on it).
#[cfg(feature = "test-hooks")]
#[test]
fn the_ignore_throttle_fault_keeps_the_limit_and_never_delays() {
    let blk = Blk::new(memfd(32 * MIB), BlkOptions::default()).unwrap();
    let throttle = blk.live().throttle().clone();
    let state = memvisor_vhost::ProcessState::new(
        memvisor::SharedMappings::global(),
        memvisor::PinRegistry::global(),
    )
    .with_faults(memvisor::faults::Faults {
        ignore_throttle: true,
        ..Default::default()
    });
    let mut backend = memvisor_vhost::Backend::new(blk, &state).unwrap();
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let t = std::thread::spawn(move || {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let _ = backend.run(&b, &stop);
    });
    let c = memvisor_testkit::vhost::client::Client::from_stream(a);
    let mut g = Guest::new(64 * MIB);
    setup(&c, &g);
    throttle
        .set(ThrottleConfig {
            iops: 20,
            ..Default::default()
        })
        .unwrap();
    let (_, got) = drive(&mut g, false, 4096, 0.5);
    assert_eq!(throttle.config().iops, 20);
    assert!(
        got > 200.0,
        "{got:.1} requests/s: the fault must never delay"
    );
    drop(c);
    t.join().unwrap();
}

/// Where ring 1 of a two-queue device has its driver ring (with its own eventfds).
const RING1: u64 = 0x8000;

#[test]
fn the_queues_of_a_device_share_one_throttle() {
    use memvisor_testkit::guest_ring::GuestRing;
    use memvisor_vhost::proto::{self, VringAddr, req};
    use std::io::Write;
    use std::os::fd::AsRawFd;

    let options = BlkOptions {
        queues: 2,
        ..Default::default()
    };
    let blk = Blk::new(memfd(32 * MIB), options).unwrap();
    let throttle = blk.live().throttle().clone();
    let (c, t) = serve(blk);
    let mut g = Guest::new(64 * MIB);
    negotiate(&c, &g);
    start_ring(&c, &g);
    let mut ring1 = GuestRing::new(&g.mem, Gpa(RING1), RING_SIZE).unwrap();
    let (kick1, call1) = (eventfd(), eventfd());
    let n = u64::from(RING_SIZE);
    let avail = RING1 + 16 * n;
    let addr = VringAddr {
        index: 1,
        flags: 0,
        desc: USER + RING1,
        avail: USER + avail,
        used: USER + avail + (6 + 2 * n).next_multiple_of(4),
        log: 0,
    };
    let st = |v: u32| proto::vring_state_bytes(1, v);
    c.send(req::SET_VRING_NUM, 0, &st(u32::from(RING_SIZE)), &[])
        .unwrap();
    c.send(req::SET_VRING_ADDR, 0, &addr.bytes(), &[]).unwrap();
    c.send(req::SET_VRING_BASE, 0, &st(0), &[]).unwrap();
    c.send(
        req::SET_VRING_CALL,
        0,
        &1u64.to_le_bytes(),
        &[call1.as_raw_fd()],
    )
    .unwrap();
    c.send(
        req::SET_VRING_KICK,
        0,
        &1u64.to_le_bytes(),
        &[kick1.as_raw_fd()],
    )
    .unwrap();
    assert_eq!(c.ack(req::SET_VRING_ENABLE, &st(1), &[]).unwrap(), 0);

    let iops = 200;
    throttle
        .set(ThrottleConfig {
            iops,
            ..Default::default()
        })
        .unwrap();
    // Alternate: a read on ring 0, then one on ring 1 (its own header, data and status).
    let (hdr1, status1, data1) = (HDR + 0x100, STATUS + 0x100, DATA + 0x10_0000);
    let start = Instant::now();
    let mut done = 0u64;
    while start.elapsed() < Duration::from_secs(2) {
        g.add_request(0, IN, 0, HDR, DATA, 4096, STATUS);
        g.kick();
        used(&mut g);
        let mut h = [0u8; 16];
        h[8..16].copy_from_slice(&8u64.to_le_bytes());
        g.mem.write(Gpa(hdr1), &h).unwrap();
        g.mem.write(Gpa(status1), &[0xff]).unwrap();
        let descs = [
            memvisor_testkit::guest_ring::Desc {
                addr: hdr1,
                len: 16,
                flags: memvisor_testkit::guest_ring::VRING_DESC_F_NEXT,
                next: 1,
            },
            memvisor_testkit::guest_ring::Desc {
                addr: data1,
                len: 4096,
                flags: memvisor_testkit::guest_ring::VRING_DESC_F_NEXT
                    | memvisor_testkit::guest_ring::VRING_DESC_F_WRITE,
                next: 2,
            },
            memvisor_testkit::guest_ring::Desc {
                addr: status1,
                len: 1,
                flags: memvisor_testkit::guest_ring::VRING_DESC_F_WRITE,
                next: 0,
            },
        ];
        let head = ring1.add_raw(&[0, 1, 2], &descs).unwrap();
        ring1.publish(head).unwrap();
        (&kick1).write_all(&1u64.to_le_bytes()).unwrap();
        let end = Instant::now() + Duration::from_secs(5);
        while ring1.get_used().unwrap().is_none() {
            assert!(
                Instant::now() < end,
                "ring 1 did not return its chain within 5 s"
            );
            std::thread::sleep(Duration::from_micros(20));
        }
        let mut s = [0xffu8];
        g.mem.read(Gpa(status1), &mut s).unwrap();
        assert_eq!(s[0], 0);
        done += 2;
    }
    let got = done as f64 / start.elapsed().as_secs_f64();
    eprintln!("iops {iops} over two queues: measured {got:.1}/s");
    // One throttle for both: their sum is the limit (two throttles would give twice it).
    assert!(
        within(got, iops as f64),
        "two queues together at {got:.1}/s"
    );
    drop(c);
    let _ = t.join().unwrap();
}
