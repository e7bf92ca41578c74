//! A guest's side of a virtqueue, for tests, benchmarks and examples: a split virtqueue driver
//! written after Linux's `drivers/virtio/virtio_ring.c`, over a memvisor slot table (it drives
//! the balloon's reporting queue and the vhost-user devices' rings in the tests).
//!
//! The ring lives in guest memory and is only touched through the slot table's `read` and
//! `write`, as a guest's stores would reach it: a descriptor table of 16-byte entries (`addr:
//! le64, len: le32, flags: le16, next: le16`), an available ring (`flags, idx, ring[size],
//! used_event`, le16 each) and a used ring (`flags, idx`, then `id: le32, len: le32` per entry,
//! then `avail_event`). Free descriptors are kept on a list, as Linux does; a chain's descriptors
//! go back on it when the device returns the chain. Besides well-formed chains
//! ([`GuestRing::add_inbuf`]) it writes anything a broken or hostile guest might
//! ([`GuestRing::add_raw`], [`GuestRing::set_avail_idx`]), so the device can be tested against
//! it.
//!
//! It is not a guest: a report in Linux is made by `mm/page_reporting.c` (up to 32 free blocks of
//! order 9 or more per chain, one chain in flight, waited for) on top of this ring, and the
//! test and benchmark code that drives this ring plays that part.

use std::collections::HashMap;
use std::sync::atomic::{Ordering, fence};

use virtio_queue::{Queue, QueueT};

use memvisor::slots::SlotTable;
use memvisor::{Error, Gpa, Result};

/// Descriptor flag: another descriptor follows (`next` is valid).
pub const VRING_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: the device writes this buffer (driver-readable otherwise).
pub const VRING_DESC_F_WRITE: u16 = 2;

/// A descriptor as the driver writes it, malformed ones included.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// Guest physical address of the buffer (or of an indirect table).
    pub addr: u64,
    /// Length of the buffer in bytes.
    pub len: u32,
    /// `VRING_DESC_F_*` flags.
    pub flags: u16,
    /// The next descriptor's index, when `flags` has `VRING_DESC_F_NEXT`.
    pub next: u16,
}

/// A split virtqueue in guest memory, driver side.
#[derive(Debug)]
pub struct GuestRing {
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

impl GuestRing {
    /// Bytes of guest memory a ring of `size` entries takes (each part 4-byte aligned).
    pub fn bytes(size: u16) -> u64 {
        let n = u64::from(size);
        16 * n + (6 + 2 * n).next_multiple_of(4) + 6 + 8 * n
    }

    /// A ring of `size` entries (a power of two) laid out at `at` (16-byte aligned) in guest
    /// memory, zeroed. EINVAL for a bad size or alignment; EFAULT if the memory is not there.
    pub fn new(mem: &SlotTable, at: Gpa, size: u16) -> Result<Self> {
        if !size.is_power_of_two() || size > 32768 {
            return Err(Error::BadConfig(format!(
                "ring size {size} is not a power of two from 1 to 32768"
            )));
        }
        if at.0 % 16 != 0 {
            return Err(Error::Misaligned {
                what: "ring address",
                value: at.0,
                align: 16,
            });
        }
        let n = u64::from(size);
        let bytes = Self::bytes(size);
        // The whole ring must fit below 2^64 before any of its addresses is computed.
        if at.0.checked_add(bytes - 1).is_none() {
            return Err(Error::RangeWraps {
                what: "ring",
                start: at.0,
                len: bytes,
            });
        }
        let desc = at.0;
        let avail = desc + 16 * n;
        let used = avail + (6 + 2 * n).next_multiple_of(4);
        mem.write(at, &vec![0; bytes as usize])?;
        Ok(GuestRing {
            mem: mem.clone(),
            size,
            desc,
            avail,
            used,
            free: (0..size).rev().collect(),
            in_flight: HashMap::new(),
            avail_idx: 0,
            last_used: 0,
        })
    }

    /// What the transport does when the driver sets the queue up: size, ring addresses, ready.
    pub fn configure(&self, q: &mut Queue) {
        let split = |a: u64| (Some(a as u32), Some((a >> 32) as u32));
        q.set_size(self.size);
        let (lo, hi) = split(self.desc);
        q.set_desc_table_address(lo, hi);
        let (lo, hi) = split(self.avail);
        q.set_avail_ring_address(lo, hi);
        let (lo, hi) = split(self.used);
        q.set_used_ring_address(lo, hi);
        q.set_ready(true);
    }

    /// Free descriptors.
    pub fn free_descriptors(&self) -> usize {
        self.free.len()
    }

    /// Writes descriptor `index` as given.
    pub fn write_desc(&self, index: u16, d: Desc) -> Result<()> {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&d.addr.to_le_bytes());
        raw[8..12].copy_from_slice(&d.len.to_le_bytes());
        raw[12..14].copy_from_slice(&d.flags.to_le_bytes());
        raw[14..].copy_from_slice(&d.next.to_le_bytes());
        self.mem
            .write(Gpa(self.desc + 16 * u64::from(index % self.size)), &raw)
    }

    /// Puts `bufs` (guest address, length) on the ring as one chain of device-writable buffers,
    /// as `virtqueue_add_inbuf` does, and returns its head. The device sees it after
    /// [`GuestRing::publish`]. ENOSPC when fewer descriptors are free than `bufs` has.
    pub fn add_inbuf(&mut self, bufs: &[(u64, u32)]) -> Result<u16> {
        if bufs.is_empty() || bufs.len() > self.free.len() {
            return Err(Error::NoSpace {
                what: "ring descriptors",
                count: bufs.len() as u64,
                limit: self.free.len() as u64,
                hint: "wait for the device to return chains in flight",
            });
        }
        let ids = self.free.split_off(self.free.len() - bufs.len());
        for (i, &(addr, len)) in bufs.iter().enumerate() {
            let next = ids.get(i + 1).copied();
            let flags = VRING_DESC_F_WRITE | next.map_or(0, |_| VRING_DESC_F_NEXT);
            let d = Desc {
                addr,
                len,
                flags,
                next: next.unwrap_or(0),
            };
            if let Err(e) = self.write_desc(ids[i], d) {
                self.free.extend(ids);
                return Err(e);
            }
        }
        let head = ids[0];
        self.in_flight.insert(head, ids);
        Ok(head)
    }

    /// Writes `descs` at descriptor indexes `ids` exactly as given — flags and links included,
    /// malformed or not — and returns the head, `ids[0]`. The ids leave the free list until the
    /// device returns the head.
    pub fn add_raw(&mut self, ids: &[u16], descs: &[Desc]) -> Result<u16> {
        let Some(&head) = ids.first() else {
            return Err(Error::Invalid(
                "add_raw needs at least one descriptor".into(),
            ));
        };
        for (&id, &d) in ids.iter().zip(descs) {
            self.write_desc(id, d)?;
            self.free.retain(|&f| f != id);
        }
        self.in_flight.insert(head, ids.to_vec());
        Ok(head)
    }

    /// Makes chain `head` available: the ring entry, a barrier (`virtio_wmb`), then the index.
    pub fn publish(&mut self, head: u16) -> Result<()> {
        let slot = u64::from(self.avail_idx % self.size);
        self.mem
            .write(Gpa(self.avail + 4 + 2 * slot), &head.to_le_bytes())?;
        self.avail_idx = self.avail_idx.wrapping_add(1);
        self.set_avail_idx(self.avail_idx)
    }

    /// Writes the available index as given (a corrupt one, to test a device).
    pub fn set_avail_idx(&self, idx: u16) -> Result<()> {
        fence(Ordering::SeqCst);
        self.mem.write(Gpa(self.avail + 2), &idx.to_le_bytes())
    }

    /// Writes `used_event` (with `VIRTIO_RING_F_EVENT_IDX`): interrupt the guest once the used
    /// index passes `idx`.
    /// The device's `avail_event` (after the used ring's entries): with event indexes, the
    /// driver kicks only when its available index passes this.
    pub fn avail_event(&self) -> Result<u16> {
        let mut b = [0u8; 2];
        self.mem
            .read(Gpa(self.used + 4 + 8 * u64::from(self.size)), &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Writes the driver's `used_event` (after the available ring's entries): with event
    /// indexes, the device interrupts only when its used index passes `idx`.
    pub fn set_used_event(&self, idx: u16) -> Result<()> {
        let at = self.avail + 4 + 2 * u64::from(self.size);
        self.mem.write(Gpa(at), &idx.to_le_bytes())
    }

    fn read_u32(&self, at: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.mem.read(Gpa(at), &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// The next used entry `(head, len)`, if the device returned one; the chain's descriptors go
    /// back on the free list. EINVAL if the device returned a head that is not in flight.
    pub fn get_used(&mut self) -> Result<Option<(u16, u32)>> {
        let mut idx = [0u8; 2];
        self.mem.read(Gpa(self.used + 2), &mut idx)?;
        fence(Ordering::SeqCst);
        if u16::from_le_bytes(idx) == self.last_used {
            return Ok(None);
        }
        let slot = u64::from(self.last_used % self.size);
        let id = self.read_u32(self.used + 4 + 8 * slot)?;
        let len = self.read_u32(self.used + 8 + 8 * slot)?;
        let ids = u16::try_from(id)
            .ok()
            .and_then(|head| Some((head, self.in_flight.remove(&head)?)));
        let Some((head, ids)) = ids else {
            return Err(Error::Protocol(format!(
                "device returned descriptor {id} in used entry {}, which is not a chain in flight",
                self.last_used
            )));
        };
        self.last_used = self.last_used.wrapping_add(1);
        self.free.extend(ids);
        Ok(Some((head, len)))
    }
}
