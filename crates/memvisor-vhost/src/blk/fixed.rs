//! Guest memory as io_uring registered (fixed) buffers, per ring, in 2 MiB chunks of host
//! addresses, and the discard gate that takes a chunk out before the balloon frees it.
//!
//! **Model.** A ring's table has [`SLOTS`] slots, empty at first (sparse). A transfer whose
//! buffers lie in one 2 MiB chunk of host memory (keyed by host address, so IOTLB changes never
//! touch the table) goes out as `READ_FIXED` / `WRITE_FIXED` through the chunk's slot; the
//! chunk is registered on the first transfer that touches it (lazily: registering all of RAM
//! would fault it in and pin it, defeating the balloon). Anything else — buffers over two
//! chunks, a chunk that could not be registered (RLIMIT_MEMLOCK, EFAULT, EOPNOTSUPP), a chunk
//! being evicted or discarded, a full table — goes the ordinary way and is counted; no host
//! limit ever fails a request.
//!
//! **Discard.** A registered chunk stays pinned in the kernel whether or not a transfer uses
//! it, so a discard of it would orphan the pinned page. [`Shared`] is the ring's
//! [`DiscardGate`]: asked to evict a range, it calls every chunk there with a transfer in
//! flight busy (skipped by the discard), marks the others evicting, wakes the ring's thread
//! through its completion eventfd (only that thread may change the table, SINGLE_ISSUER) and
//! waits a bounded time for it to empty their slots ([`FixedChunks::service`]). The chunks
//! stay closed to registration until the discard reopens them. All of it under one mutex, so
//! a transfer counted in flight and an eviction always see each other.
//!
//! WIP (issue 48): not reachable from the product yet — no option turns it on, and the blk
//! launch path does not call it.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use memvisor::DiscardGate;

use crate::disk::Disk;

/// Bytes in a chunk: one registered buffer.
pub const CHUNK: u64 = 2 << 20;
/// Slots in a ring's table (the kernel's IORING_MAX_REG_BUFFERS): 32 GiB of 2 MiB chunks.
pub const SLOTS: u32 = 1 << 14;

#[derive(Debug)]
struct Chunk {
    slot: u32,
    in_flight: u32,
    evicting: bool,
}

#[derive(Default)]
struct Table {
    chunks: HashMap<u64, Chunk>,
    free: Vec<u32>,
    /// Chunks a discard is working on, with how many discards: not registered meanwhile.
    closed: HashMap<u64, u32>,
    /// Chunks to empty, for the ring's thread.
    pending: Vec<u64>,
    /// Chunks whose registration failed: not tried again.
    refused: std::collections::HashSet<u64>,
    made: bool,
}

/// What the ring's thread and discards share: the table and the way to wake the thread.
pub struct Shared {
    table: Mutex<Table>,
    emptied: Condvar,
    waker: Mutex<Option<File>>,
    /// TEST ONLY ([`memvisor::faults::Faults::fixed_no_evict`]): evictions are ignored.
    no_evict: bool,
}

/// What [`FixedChunks`] did, for the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedCounts {
    pub fixed: u64,
    pub fallbacks: u64,
    pub chunks_registered: u64,
    pub evictions: u64,
    pub evict_busy: u64,
}

/// A ring's registered chunks.
pub struct FixedChunks {
    shared: Arc<Shared>,
    pub counts: FixedCounts,
}

fn chunk_range(c: u64) -> (u64, u64) {
    (c * CHUNK, CHUNK)
}

impl FixedChunks {
    /// An empty table; `no_evict` is the test-only fault.
    pub fn new(no_evict: bool) -> FixedChunks {
        FixedChunks {
            shared: Arc::new(Shared {
                table: Mutex::new(Table::default()),
                emptied: Condvar::new(),
                waker: Mutex::new(None),
                no_evict,
            }),
            counts: FixedCounts::default(),
        }
    }

    /// The gate to register with the pin registry.
    pub fn gate(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// On the ring's thread: the slot a transfer of `iov` goes through, inside host memory
    /// `[region.0, region.1)`, registering its chunk if needed; the chunk counts it in flight
    /// until [`FixedChunks::release`]. `None`: it goes the ordinary way (counted).
    pub fn acquire(
        &mut self,
        disk: &mut Disk,
        iov: &[libc::iovec],
        region: (u64, u64),
    ) -> Option<u16> {
        let got = self.try_acquire(disk, iov, region);
        match got {
            Some(_) => self.counts.fixed += 1,
            None => self.counts.fallbacks += 1,
        }
        got
    }

    fn try_acquire(
        &mut self,
        disk: &mut Disk,
        iov: &[libc::iovec],
        region: (u64, u64),
    ) -> Option<u16> {
        let first = iov.first()?.iov_base as u64;
        let c = first / CHUNK;
        let (base, len) = chunk_range(c);
        let inside = iov.iter().all(|v| {
            let s = v.iov_base as u64;
            s >= base && s + v.iov_len as u64 <= base + len
        });
        if !inside || base < region.0 || base + len > region.1 {
            return None;
        }
        let mut t = self.shared.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ch) = t.chunks.get_mut(&c) {
            if ch.evicting {
                return None;
            }
            ch.in_flight += 1;
            return u16::try_from(ch.slot).ok();
        }
        if t.closed.contains_key(&c) || t.refused.contains(&c) {
            return None;
        }
        if !t.made {
            t.made = true;
            if let Err(e) = disk.fixed_table(SLOTS) {
                log::info!("blk: no registered buffers ({e}); transfers go the ordinary way");
                t.refused.insert(c);
                return None;
            }
            t.free = (0..SLOTS).rev().collect();
            *self.shared.waker.lock().unwrap_or_else(|e| e.into_inner()) = disk.waker();
        }
        let slot = t.free.pop()?;
        // SAFETY: the chunk lies in guest memory `region`, which stays mapped until the memory
        // table changes, and every slot is emptied before that (`clear_all`).
        if let Err(e) = unsafe { disk.register_fixed(slot, base, len) } {
            log::info!("blk: chunk at {base:#x} not registered ({e}); it goes the ordinary way");
            t.free.push(slot);
            t.refused.insert(c);
            return None;
        }
        self.counts.chunks_registered += 1;
        t.chunks.insert(
            c,
            Chunk {
                slot,
                in_flight: 1,
                evicting: false,
            },
        );
        u16::try_from(slot).ok()
    }

    /// A transfer through the chunk holding host address `first` ended.
    pub fn release(&self, first: u64) {
        let mut t = self.shared.table.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ch) = t.chunks.get_mut(&(first / CHUNK)) {
            ch.in_flight = ch.in_flight.saturating_sub(1);
        }
    }

    /// On the ring's thread, when woken: empties the slots discards asked for.
    pub fn service(&mut self, disk: &mut Disk) {
        let mut t = self.shared.table.lock().unwrap_or_else(|e| e.into_inner());
        let pending = std::mem::take(&mut t.pending);
        for c in pending {
            let Some(ch) = t.chunks.get(&c) else { continue };
            if ch.in_flight > 0 {
                continue;
            }
            let slot = ch.slot;
            match disk.clear_fixed(slot) {
                Ok(()) => {
                    t.chunks.remove(&c);
                    t.free.push(slot);
                    self.counts.evictions += 1;
                }
                Err(e) => log::error!("blk: cannot empty registered slot {slot}: {e}"),
            }
        }
        drop(t);
        self.shared.emptied.notify_all();
    }

    /// Empties every slot (the memory table changes; nothing is in flight then).
    pub fn clear_all(&mut self, disk: &mut Disk) {
        let mut t = self.shared.table.lock().unwrap_or_else(|e| e.into_inner());
        let chunks: Vec<(u64, u32)> = t.chunks.iter().map(|(&c, ch)| (c, ch.slot)).collect();
        for (c, slot) in chunks {
            if disk.clear_fixed(slot).is_ok() {
                t.chunks.remove(&c);
                t.free.push(slot);
            }
        }
        t.refused.clear();
        drop(t);
        self.shared.emptied.notify_all();
    }
}

impl DiscardGate for Shared {
    fn evict(&self, hva: u64, len: u64, wait: Duration) -> Vec<(u64, u64)> {
        if self.no_evict {
            return Vec::new();
        }
        let (first, last) = (hva / CHUNK, (hva + len).div_ceil(CHUNK));
        let mut busy = Vec::new();
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        let mut asked = Vec::new();
        for c in first..last {
            *t.closed.entry(c).or_default() += 1;
            let Some(ch) = t.chunks.get_mut(&c) else {
                continue;
            };
            if ch.in_flight > 0 {
                busy.push(chunk_range(c));
                continue;
            }
            if !ch.evicting {
                ch.evicting = true;
                t.pending.push(c);
            }
            asked.push(c);
        }
        if asked.is_empty() {
            return busy;
        }
        if let Some(w) = self
            .waker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            let _ = (&*w).write(&1u64.to_ne_bytes());
        }
        let deadline = Instant::now() + wait;
        loop {
            let left: Vec<u64> = asked
                .iter()
                .copied()
                .filter(|c| t.chunks.contains_key(c))
                .collect();
            let now = Instant::now();
            if left.is_empty() || now >= deadline {
                busy.extend(left.into_iter().map(chunk_range));
                return busy;
            }
            t = self
                .emptied
                .wait_timeout(t, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn pinned_runs(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        if self.no_evict {
            return Vec::new();
        }
        let t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        (start / CHUNK..end.div_ceil(CHUNK))
            .filter(|c| t.chunks.contains_key(c))
            .map(chunk_range)
            .collect()
    }

    fn reopen(&self, hva: u64, len: u64) {
        if self.no_evict {
            return;
        }
        let mut t = self.table.lock().unwrap_or_else(|e| e.into_inner());
        for c in hva / CHUNK..(hva + len).div_ceil(CHUNK) {
            if let Some(n) = t.closed.get_mut(&c) {
                *n -= 1;
                if *n == 0 {
                    t.closed.remove(&c);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
