//! The guest's side of free page reporting, for tests: a split virtqueue driver written after
//! Linux's `drivers/virtio/virtio_ring.c`, and a reporter written after `mm/page_reporting.c`
//! with `virtio_balloon`'s `virtballoon_free_page_report`.
//!
//! The ring lives in guest memory and is only ever touched through the slot table's `read` and
//! `write`, as a guest's stores would reach it: a descriptor table of 16-byte entries
//! (`addr: le64, len: le32, flags: le16, next: le16`), an available ring (`flags, idx,
//! ring[size]`, all le16) and a used ring (`flags, idx`, then `id: le32, len: le32` per entry).
//! Free descriptors are kept on a list as Linux does; a chain's descriptors go back to it when the
//! device returns the chain.
//!
//! [`Reporter`] does what Linux does once free memory has settled: it takes free blocks of order
//! 9 or more (2 MiB and up, each aligned to its size), puts up to 32 of them on the queue as one
//! chain of device-writable buffers, rings the doorbell, and waits for the used entry before it
//! reports the next batch — and before the blocks may be reused.

use std::collections::HashMap;
use std::sync::atomic::{Ordering, fence};
use std::sync::mpsc::{Receiver, Sender};
use std::time::Duration;

use memvisor::balloon::virtio_queue::{Queue, QueueT};
use memvisor::{Gpa, SlotTable};

pub const VRING_DESC_F_NEXT: u16 = 1;
pub const VRING_DESC_F_WRITE: u16 = 2;
/// Linux's `PAGE_REPORTING_CAPACITY`: blocks per report.
pub const REPORT_CAPACITY: usize = 32;
/// Linux's default `page_reporting_order` (`pageblock_order` on x86-64): 2 MiB.
pub const MIN_ORDER: u32 = 9;

/// A raw descriptor, as the driver writes it.
#[derive(Clone, Copy, Debug)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub flags: u16,
    pub next: u16,
}

/// A split virtqueue in guest memory, driver side.
pub struct SplitRing {
    mem: SlotTable,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    free: Vec<u16>,
    /// Descriptors of each chain in flight, by head.
    in_flight: HashMap<u16, Vec<u16>>,
    avail_idx: u16,
    last_used: u16,
}

impl SplitRing {
    /// Bytes of guest memory a ring of `size` entries needs (rings 4-aligned).
    pub fn bytes(size: u16) -> u64 {
        let n = u64::from(size);
        16 * n + (6 + 2 * n).next_multiple_of(4) + 6 + 8 * n
    }

    /// A ring of `size` entries laid out at `at` in guest memory, zeroed.
    pub fn new(mem: &SlotTable, at: Gpa, size: u16) -> Self {
        let n = u64::from(size);
        let desc = at.0;
        let avail = desc + 16 * n;
        let used = avail + (6 + 2 * n).next_multiple_of(4);
        mem.write(at, &vec![0; Self::bytes(size) as usize]).unwrap();
        SplitRing {
            mem: mem.clone(),
            size,
            desc,
            avail,
            used,
            free: (0..size).rev().collect(),
            in_flight: HashMap::new(),
            avail_idx: 0,
            last_used: 0,
        }
    }

    /// What the transport does when the driver sets the queue up.
    pub fn configure(&self, q: &mut Queue) {
        q.set_size(self.size);
        q.set_desc_table_address(Some(self.desc as u32), Some((self.desc >> 32) as u32));
        q.set_avail_ring_address(Some(self.avail as u32), Some((self.avail >> 32) as u32));
        q.set_used_ring_address(Some(self.used as u32), Some((self.used >> 32) as u32));
        q.set_ready(true);
    }

    /// Writes descriptor `index` as given: anything, malformed included.
    pub fn write_desc(&self, index: u16, d: Desc) {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&d.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&d.len.to_le_bytes());
        raw[12..14].copy_from_slice(&d.flags.to_le_bytes());
        raw[14..].copy_from_slice(&d.next.to_le_bytes());
        self.mem
            .write(Gpa(self.desc + 16 * u64::from(index)), &raw)
            .unwrap();
    }

    /// Puts `bufs` (address, length) on the queue as one chain of device-writable buffers, like
    /// `virtqueue_add_inbuf`; `None` when too few descriptors are free. The chain is not visible
    /// to the device until [`SplitRing::publish`].
    pub fn add_inbuf(&mut self, bufs: &[(u64, u32)]) -> Option<u16> {
        if bufs.is_empty() || bufs.len() > self.free.len() {
            return None;
        }
        let ids: Vec<u16> = (0..bufs.len()).map(|_| self.free.pop().unwrap()).collect();
        for (i, &(addr, len)) in bufs.iter().enumerate() {
            let last = i + 1 == bufs.len();
            self.write_desc(
                ids[i],
                Desc {
                    addr,
                    len,
                    flags: VRING_DESC_F_WRITE | if last { 0 } else { VRING_DESC_F_NEXT },
                    next: if last { 0 } else { ids[i + 1] },
                },
            );
        }
        let head = ids[0];
        self.in_flight.insert(head, ids);
        Some(head)
    }

    /// Puts chain `descs` at descriptor indexes `ids` as given (flags and links included) and
    /// returns its head: for malformed chains. The ids stay in flight until returned.
    pub fn add_raw(&mut self, ids: &[u16], descs: &[Desc]) -> u16 {
        for (&id, &d) in ids.iter().zip(descs) {
            self.free.retain(|&f| f != id);
            self.write_desc(id, d);
        }
        self.in_flight.insert(ids[0], ids.to_vec());
        ids[0]
    }

    /// Makes `head` available to the device: the ring entry, then (after a barrier, as
    /// `virtio_wmb`) the index.
    pub fn publish(&mut self, head: u16) {
        let slot = u64::from(self.avail_idx % self.size);
        self.mem
            .write(Gpa(self.avail + 4 + 2 * slot), &head.to_le_bytes())
            .unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx);
    }

    /// Writes the available index directly (to corrupt it in tests).
    pub fn set_avail_idx(&self, idx: u16) {
        fence(Ordering::SeqCst);
        self.mem
            .write(Gpa(self.avail + 2), &idx.to_le_bytes())
            .unwrap();
    }

    /// Writes `used_event` (with `VIRTIO_RING_F_EVENT_IDX`): interrupt me once the used index
    /// passes this.
    pub fn set_used_event(&self, idx: u16) {
        let at = self.avail + 4 + 2 * u64::from(self.size);
        self.mem.write(Gpa(at), &idx.to_le_bytes()).unwrap();
    }

    fn read_u32(&self, at: u64) -> u32 {
        let mut b = [0u8; 4];
        self.mem.read(Gpa(at), &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    /// The next used entry `(head, len)`, if the device returned one; its descriptors go back on
    /// the free list.
    pub fn get_used(&mut self) -> Option<(u16, u32)> {
        let mut idx = [0u8; 2];
        self.mem.read(Gpa(self.used + 2), &mut idx).unwrap();
        fence(Ordering::SeqCst);
        if u16::from_le_bytes(idx) == self.last_used {
            return None;
        }
        let slot = u64::from(self.last_used % self.size);
        let id = self.read_u32(self.used + 4 + 8 * slot);
        let len = self.read_u32(self.used + 8 + 8 * slot);
        self.last_used = self.last_used.wrapping_add(1);
        let head = u16::try_from(id).expect("device returned an id past u16");
        let ids = self
            .in_flight
            .remove(&head)
            .unwrap_or_else(|| panic!("device returned head {head}, which is not in flight"));
        self.free.extend(ids);
        Some((head, len))
    }
}

/// A guest's free page reporter: up to 32 blocks of order >= 9 per report, one report in flight,
/// each waited for. The device side runs elsewhere; `doorbell` is its notification and `irq` its
/// interrupt.
pub struct Reporter {
    pub ring: SplitRing,
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
            self.ring.publish(head);
            self.doorbell.send(()).unwrap();
            // Like virtio_balloon: wait until the device hands the chain back.
            loop {
                if let Some((used, _)) = self.ring.get_used() {
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
