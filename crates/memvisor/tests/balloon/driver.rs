//! The guest's free page reporting for tests, written after Linux's `mm/page_reporting.c` with
//! `virtio_balloon`'s `virtballoon_free_page_report`, on memvisor's guest-side ring
//! ([`GuestRing`]).
//!
//! [`Reporter`] does what Linux does once free memory has settled: it takes free blocks of order
//! 9 or more (2 MiB and up, each aligned to its size), puts up to 32 of them on the queue as one
//! chain of device-writable buffers, rings the doorbell, and waits for the used entry before it
//! reports the next batch — and before the blocks may be reused. [`buddy_blocks`] is the buddy
//! allocator's part: which blocks a set of freed 2 MiB blocks merges into.

use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use memvisor::Gpa;
use memvisor_testkit::guest_ring::GuestRing;

/// Linux's `PAGE_REPORTING_CAPACITY`: blocks per report.
pub const REPORT_CAPACITY: usize = 32;
/// Linux's default `page_reporting_order` (`pageblock_order` on x86-64): 2 MiB.
pub const MIN_ORDER: u32 = 9;

/// A guest's free page reporter: up to 32 blocks of order >= 9 per report, one report in flight,
/// each waited for. The device side runs elsewhere; `doorbell` is its notification and `irq` its
/// interrupt.
pub struct Reporter {
    pub ring: GuestRing,
    pub doorbell: Sender<()>,
    pub irq: Receiver<()>,
}

impl Reporter {
    /// Reports `blocks` (guest address, bytes) in batches of [`REPORT_CAPACITY`]; returns the
    /// number of reports made. Panics on a block Linux would never report.
    pub fn report(&mut self, blocks: &[(Gpa, u64)]) -> usize {
        for &(gpa, len) in blocks {
            assert!(
                len.is_power_of_two() && len >= 4096 << MIN_ORDER && gpa.0 % len == 0,
                "Linux reports only aligned blocks of order >= {MIN_ORDER}: {:#x}+{len:#x}",
                gpa.0
            );
        }
        let mut reports = 0;
        for batch in blocks.chunks(REPORT_CAPACITY) {
            let bufs: Vec<(u64, u32)> = batch
                .iter()
                .map(|&(g, l)| (g.0, u32::try_from(l).unwrap()))
                .collect();
            let head = self.ring.add_inbuf(&bufs).expect("queue has room");
            self.ring.publish(head).unwrap();
            self.doorbell.send(()).unwrap();
            // Like virtio_balloon: wait until the device hands the chain back.
            loop {
                if let Some((used, _)) = self.ring.get_used().unwrap() {
                    assert_eq!(used, head, "one report in flight at a time");
                    break;
                }
                self.irq
                    .recv_timeout(Duration::from_secs(10))
                    .expect("device did not return the report within 10 s");
            }
            reports += 1;
        }
        reports
    }
}

/// A buddy allocator's view of free memory in `[base, base + size)`: freed 2 MiB blocks merge
/// with their free buddy up to `max_order` (Linux: 10, 4 MiB), as `__free_one_page` does.
pub fn buddy_blocks(base: u64, free_2m: &[u64], max_order: u32) -> Vec<(Gpa, u64)> {
    let unit = 4096u64 << MIN_ORDER;
    let mut free: Vec<u64> = free_2m.to_vec();
    free.sort_unstable();
    free.dedup();
    let mut blocks: Vec<(u64, u64)> = free.iter().map(|&i| (i * unit, unit)).collect();
    for _ in MIN_ORDER..max_order {
        let mut merged = Vec::new();
        let mut i = 0;
        while i < blocks.len() {
            let (off, len) = blocks[i];
            let buddy = off ^ len;
            if off % (2 * len) == 0 && blocks.get(i + 1) == Some(&(buddy, len)) {
                merged.push((off, 2 * len));
                i += 2;
            } else {
                merged.push((off, len));
                i += 1;
            }
        }
        blocks = merged;
    }
    blocks
        .into_iter()
        .map(|(o, l)| (Gpa(base + o), l))
        .collect()
}
