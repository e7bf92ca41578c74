//! The vhost-user balloon over a socket: the statistics queue's buffer goes back to the driver
//! on the device's own timer (no kick asks for it), the figures reach the live status, and
//! `actual` is kept live with what the guest took back below the target.

mod common;

use std::time::{Duration, Instant};

use common::*;
use memvisor::Gpa;
use memvisor::balloon::stats::{FREE_MEMORY, TOTAL_MEMORY};
use memvisor::balloon::{
    VIRTIO_BALLOON_F_DEFLATE_ON_OOM, VIRTIO_BALLOON_F_REPORTING, VIRTIO_BALLOON_F_STATS_VQ,
};
use memvisor_vhost::proto::{self, req};
use memvisor_vhost::{BalloonDevice, BalloonLive, BalloonTarget, Device};

/// Where the test driver keeps its statistics buffer.
const STATS_AT: u64 = 0x10_0000;

fn write_stats(g: &Guest, entries: &[(u16, u64)]) -> u32 {
    let bytes: Vec<u8> = entries
        .iter()
        .flat_map(|&(t, v)| [t.to_le_bytes().to_vec(), v.to_le_bytes().to_vec()].concat())
        .collect();
    g.mem.write(Gpa(STATS_AT), &bytes).unwrap();
    bytes.len() as u32
}

/// Polls `f` for up to 5 s.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn features_and_queues_follow_the_options() {
    let bit = |b: u32| 1u64 << b;
    let plain = BalloonDevice::new(BalloonTarget::default());
    assert_eq!(plain.queues(), 3, "inflate, deflate, reporting");
    let (c, t) = serve(plain);
    let f = c.get_u64(req::GET_FEATURES).unwrap();
    assert_eq!(f & bit(VIRTIO_BALLOON_F_STATS_VQ), 0);
    assert_eq!(f & bit(VIRTIO_BALLOON_F_DEFLATE_ON_OOM), 0);
    assert_ne!(f & bit(VIRTIO_BALLOON_F_REPORTING), 0);
    drop(c);
    let (_, _) = t.join().unwrap();

    let all = BalloonDevice::new(BalloonTarget::default())
        .with_stats_interval(Duration::from_secs(1))
        .with_deflate_on_oom(true);
    assert_eq!(all.queues(), 4, "inflate, deflate, statistics, reporting");
    // Without reporting the last ring's slot stays (QEMU's generic device sets up a fixed
    // num_vqs); the feature is what is withheld.
    let without = BalloonDevice::new(BalloonTarget::default())
        .with_stats_interval(Duration::from_secs(1))
        .without_reporting();
    assert_eq!(without.queues(), 4);
    assert_eq!(without.features() & bit(VIRTIO_BALLOON_F_REPORTING), 0);
    assert_eq!(all.without_reporting().queues(), 4);
    let all = BalloonDevice::new(BalloonTarget::default())
        .with_stats_interval(Duration::from_secs(1))
        .with_deflate_on_oom(true);
    let (c, t) = serve(all);
    let f = c.get_u64(req::GET_FEATURES).unwrap();
    assert_ne!(f & bit(VIRTIO_BALLOON_F_STATS_VQ), 0);
    assert_ne!(f & bit(VIRTIO_BALLOON_F_DEFLATE_ON_OOM), 0);
    drop(c);
    let (_, _) = t.join().unwrap();
}

#[test]
fn the_statistics_buffer_goes_back_each_interval_and_the_figures_reach_the_live_status() {
    let interval = Duration::from_millis(1000);
    let device = BalloonDevice::new(BalloonTarget::default()).with_stats_interval(interval);
    let live: BalloonLive = device.live();
    let (c, t) = serve(device);
    let mut g = Guest::new(4 * MIB);
    negotiate(&c, &g);
    // Queue 2 is the statistics queue once it is negotiated (reporting moves to 3).
    start_ring_at(&c, &g, 2);
    eventually("statistics queue negotiated", || live.status().stats_queue);

    // The primed buffer: held, not returned before the interval is over.
    let len = write_stats(
        &g,
        &[(FREE_MEMORY, 100 * MIB), (TOTAL_MEMORY, 4 * MIB), (77, 1)],
    );
    let t0 = Instant::now();
    let head = g.post(&[(STATS_AT, len, false)]);
    eventually("first figures", || live.status().guest_stats.is_some());
    let s = live.status().guest_stats.unwrap();
    assert_eq!(s.values["free_memory"], 100 * MIB);
    assert_eq!((s.updates, s.unknown_tags), (1, 1));
    assert_eq!(g.wait_used(), (head, 0));
    let waited = t0.elapsed();
    assert!(
        waited >= interval - Duration::from_millis(50) && waited < interval * 3,
        "returned after {waited:?}, interval {interval:?}"
    );

    // The driver's answer: fresh figures, returned again an interval later.
    let len = write_stats(&g, &[(FREE_MEMORY, 60 * MIB), (TOTAL_MEMORY, 4 * MIB)]);
    let t1 = Instant::now();
    let head = g.post(&[(STATS_AT, len, false)]);
    eventually("second figures", || {
        live.status().guest_stats.is_some_and(|s| s.updates == 2)
    });
    assert_eq!(
        live.status().guest_stats.unwrap().values["free_memory"],
        60 * MIB
    );
    assert_eq!(g.wait_used(), (head, 0));
    assert!(t1.elapsed() >= interval - Duration::from_millis(50));

    // A buffer cut short is refused: the figures stay, the exchange goes on.
    let head = g.post(&[(STATS_AT, len - 1, false)]);
    assert_eq!(g.wait_used(), (head, 0));
    let s = live.status().guest_stats.unwrap();
    assert_eq!((s.updates, s.values["free_memory"]), (2, 60 * MIB));
    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().stats().refused_stats, 1);
    assert_eq!(backend.device().stats().stats_buffers, 3);
}

#[test]
fn actual_is_live_and_a_deflation_below_the_target_is_counted() {
    let target = BalloonTarget::default();
    let device = BalloonDevice::new(target.clone()).with_deflate_on_oom(true);
    let live = device.live();
    let (c, t) = serve(device);
    let g = Guest::new(4 * MIB);
    negotiate(&c, &g);
    assert!(live.status().deflate_on_oom);
    let actual = |pages: u32| {
        let p = proto::config_bytes(4, 0, &pages.to_le_bytes());
        assert_eq!(c.ack(req::SET_CONFIG, &p, &[]).unwrap(), 0);
    };
    // The target the device tells the driver: num_pages in its config space.
    let told = || {
        let r = c
            .get(req::GET_CONFIG, &proto::config_bytes(0, 0, &[0; 4]))
            .unwrap();
        u32::from_le_bytes(r[12..16].try_into().unwrap())
    };
    target.set_pages(1000);
    // The live status shows the target as set at once; the driver is told within 200 ms.
    assert_eq!(live.status().target_pages, 1000);
    eventually("target told", || told() == 1000);
    actual(1000);
    assert_eq!(live.actual_pages(), 1000);
    assert_eq!(live.status().deflated_below_target_pages, 0);
    // The guest takes 256 pages back by itself (OOM): below the target.
    actual(744);
    assert_eq!(live.actual_pages(), 744);
    assert_eq!(live.status().deflated_below_target_pages, 256);
    // Following a lowered target is not below it.
    target.set_pages(500);
    eventually("target told", || told() == 500);
    actual(500);
    assert_eq!(live.status().deflated_below_target_pages, 256);
    // Part above, part below the target: only the part below counts.
    target.set_pages(600);
    eventually("target told", || told() == 600);
    actual(600);
    actual(400);
    assert_eq!(live.status().deflated_below_target_pages, 456);
    drop(c);
    let (_, _) = t.join().unwrap();
}
