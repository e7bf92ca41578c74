//! The inflight log's reconnect step for split rings (vhost-user.rst, "Inflight I/O tracking"):
//! when `used_idx` lags the used ring's `idx` by a batch of k, the k entries of the batch list
//! starting at `last_batch_head` (linked through `desc[i].next`) are done and not redone; a
//! log naming more heads in flight than the driver made available is set aside.

mod common;

use std::os::unix::fs::FileExt;

use common::*;
use memvisor::{DmaConfig, DmaMemory, DmaSpace, Gpa, Iova, Prot};
use memvisor_vhost::Ring;
use memvisor_vhost::ring::InflightRegion;
use virtio_queue::{Queue, QueueOwnedT, QueueT};

fn device_view(g: &Guest) -> DmaMemory {
    let dma = DmaSpace::new(DmaConfig::default()).unwrap();
    dma.map_guest(Iova(0), &g.mem.snapshot(), Gpa(0), g.size, Prot::RW)
        .unwrap();
    dma.memory()
}

fn entry(h: u16) -> u64 {
    16 + 16 * u64::from(h)
}

#[test]
fn a_batch_published_before_a_crash_is_not_redone() {
    let mut g = Guest::new(MIB);
    let mem = device_view(&g);
    let log = InflightRegion::create(1, RING_SIZE).unwrap();
    let file = std::fs::File::from(log.fd().unwrap().try_clone_to_owned().unwrap());

    // The driver makes two chains available; the predecessor takes both (logged in flight).
    let mut q = Queue::new(RING_SIZE).unwrap();
    g.ring.configure(&mut q);
    let mut ring = Ring::new(q, Some((&log, 0)), &mem).unwrap();
    for i in 0..2u64 {
        let h = g.ring.add_inbuf(&[(0x10000 + 0x1000 * i, 512)]).unwrap();
        g.ring.publish(h).unwrap();
    }
    let mut heads = Vec::new();
    while let Some(chain) = ring.iter(&mem).unwrap().next() {
        heads.push(chain.head_index());
    }
    for &h in &heads {
        ring.taken(h);
    }
    let (a, b) = (heads[0], heads[1]);

    // It completes them as one batch, as vhost-user.rst describes: desc[a].next = old head,
    // last_batch_head = a; desc[b].next = a, last_batch_head = b; the used ring's idx goes up
    // by 2 ... and it dies before clearing the entries and before writing used_idx.
    file.write_all_at(&a.to_le_bytes(), entry(b) + 6).unwrap();
    file.write_all_at(&b.to_le_bytes(), 12).unwrap();
    ring.deref_queue().add_used(&mem, a, 0).unwrap();
    ring.deref_queue().add_used(&mem, b, 0).unwrap();
    drop(ring);
    // The driver consumed both.
    assert_eq!(g.ring.get_used().unwrap().map(|u| u.0), Some(a));
    assert_eq!(g.ring.get_used().unwrap().map(|u| u.0), Some(b));
    let mut u = [0u8; 2];
    file.read_exact_at(&mut u, 14).unwrap();
    assert_eq!(
        u16::from_le_bytes(u),
        0,
        "the log's used_idx lags by the batch"
    );

    // A new back end on that log.
    let mut q = Queue::new(RING_SIZE).unwrap();
    g.ring.configure(&mut q);
    let ring = Ring::new(q, Some((&log, 0)), &mem).unwrap();
    assert_eq!(
        (ring.pending_resubmits(), ring.next_avail()),
        (0, 2),
        "a head the driver already got back (and consumed) is redone, and the next available \
         index passes the driver's"
    );
}

trait DerefQueue {
    fn deref_queue(&mut self) -> &mut Queue;
}
impl DerefQueue for Ring {
    fn deref_queue(&mut self) -> &mut Queue {
        self
    }
}

/// A log that names more heads in flight than the driver has made available past the used
/// index (avail.idx - used.idx) cannot be right: its heads were never made available (or came
/// back already). Here the ring is new (nothing made available) and the log says 3 in flight.
#[test]
fn a_log_with_more_in_flight_than_made_available_resubmits_nothing() {
    let g = Guest::new(MIB);
    let mem = device_view(&g);
    let log = InflightRegion::create(1, RING_SIZE).unwrap();
    let file = std::fs::File::from(log.fd().unwrap().try_clone_to_owned().unwrap());
    file.write_all_at(&1u16.to_le_bytes(), 8).unwrap(); // version
    file.write_all_at(&RING_SIZE.to_le_bytes(), 10).unwrap(); // desc_num
    for h in [3u16, 5, 7] {
        file.write_all_at(&u64::from(h).to_le_bytes(), entry(h) + 8)
            .unwrap();
        file.write_all_at(&[1], entry(h)).unwrap();
    }
    let mut q = Queue::new(RING_SIZE).unwrap();
    g.ring.configure(&mut q);
    match Ring::new(q, Some((&log, 0)), &mem) {
        Err(_) => {}
        Ok(ring) => assert_eq!(
            (ring.pending_resubmits(), ring.next_avail()),
            (0, 0),
            "heads the driver never made available are redone (avail.idx 0, used.idx 0)"
        ),
    }
}
