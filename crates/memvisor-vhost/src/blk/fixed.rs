//! Guest memory as io_uring registered (fixed) buffers, per ring, in 2 MiB chunks of host
//! addresses, and the discard gate that takes a chunk out before the balloon frees it.
//!
//! **Model.** A ring's table has [`SLOTS`] slots, empty at first (sparse). Host memory is cut
//! into 2 MiB chunks (by host address, so IOTLB changes never touch the table), and what is
//! registered is a chunk's **span**: the part of the chunk inside one region of guest memory,
//! the whole chunk inside a big region, less at a region's edges, and all of a region smaller
//! than a chunk (a libblkio client's bounce buffer of 128 KiB, a region the back end mapped at
//! an address not 2 MiB aligned). Two regions sharing a chunk have a span each. A transfer
//! whose buffers lie in one span goes out as `READ_FIXED` / `WRITE_FIXED` (`READV_FIXED` /
//! `WRITEV_FIXED` for more than one buffer) through the span's slot. Spans are registered
//! **lazily** and **off the request**: the first transfer that touches a span goes the
//! ordinary way (hold + `READV`) and names the span cold; once the pass's replies are on the
//! used ring and its drivers told (`Device::after_replies`), the ring's thread registers the
//! cold spans ([`FixedChunks::register_cold`], a few per pass: a cold chunk costs ~2 ms to
//! fault in and pin), so no reply waits for a registration. Registering all of RAM up front
//! would fault it in and pin it, defeating the balloon.
//!
//! **What goes the ordinary way, counted.** A refusal of the host — the ring's table or a
//! chunk's registration refused (RLIMIT_MEMLOCK, ENOMEM, EFAULT, EOPNOTSUPP, EPERM), a kernel
//! without vectored fixed transfers — is a *fallback* ([`FixedCounts::fallbacks`]); the rest —
//! buffers over two spans, a span cold, being evicted or waiting to come back, memory that may
//! not be registered, dirty logging on — is *ordinary* ([`FixedCounts::ordinary`]). Only reads
//! and writes are counted, once the request's header says it is one ([`BlkFixed::tally`]): a
//! `GET_ID`, `DISCARD` or `WRITE_ZEROES` whose buffer was claimed moves no data through it, so
//! the shares describe the data path. No host limit ever fails a request.
//!
//! **Discard.** A registered chunk stays pinned in the kernel whether or not a transfer uses
//! it, so a discard of it would orphan the pinned page. [`Shared`] is the ring's
//! [`DiscardGate`]: asked to evict a range, it calls every chunk there with a transfer in
//! flight busy (skipped by the discard), marks the others evicting, wakes the ring's thread
//! through its completion eventfd (only that thread may change the table, SINGLE_ISSUER) and
//! waits a bounded time for it to empty their slots ([`FixedChunks::service`]). The chunks
//! stay closed to registration until the discard reopens them, and an evicted chunk is
//! registered again only after [`REREGISTER_AFTER`] transfers touched it (registering faults
//! the whole chunk back in). All of it under one mutex, so a transfer counted in flight and an
//! eviction always see each other.
//!
//! **The device's side** ([`BlkFixed`]): which host ranges may be registered — memfd,
//! hugetlbfs and received shared descriptors; not private anonymous memory, whose pages in
//! swap cache could lose a write the kernel made through a pin it lets go without dirtying
//! the page — followed from the slot table's generation, every slot emptied when it changes
//! (a new memory table, dirty logging turned on or off).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use memvisor::{BackingKind, DiscardGate, PinRegistry};

use crate::disk::Disk;
use crate::memory::FrontendMemory;

/// Bytes in a chunk: one registered buffer.
pub const CHUNK: u64 = 2 << 20;
/// Slots in a ring's table (the kernel's IORING_MAX_REG_BUFFERS): 32 GiB of 2 MiB chunks.
pub const SLOTS: u32 = 1 << 14;
/// Transfers an evicted chunk must see before it is registered again.
pub const REREGISTER_AFTER: u32 = 16;
/// Cold chunks registered per pass at most (~2 ms each), so a burst over fresh memory does not
/// stall the ring for long.
const REGISTER_PER_PASS: usize = 8;

/// A registered span, keyed in [`Table::chunks`] by its first byte.
#[derive(Debug)]
struct Chunk {
    /// One past its last byte: the span never reaches past its chunk.
    end: u64,
    slot: u32,
    in_flight: u32,
    evicting: bool,
}

/// Spans are keyed by their first byte (a host address); `closed` by chunk number, the unit a
/// discard closes.
#[derive(Default)]
struct Table {
    chunks: BTreeMap<u64, Chunk>,
    free: Vec<u32>,
    /// Chunks a discard is working on, with how many discards: not registered meanwhile.
    closed: HashMap<u64, u32>,
    /// Spans to empty, for the ring's thread.
    pending: Vec<u64>,
    /// Spans whose registration the host refused: not tried again until the memory changes.
    refused: HashSet<u64>,
    /// Spans a transfer found cold, to register after the pass, as `(first byte, end)`; and
    /// their first bytes as a set.
    cold: Vec<(u64, u64)>,
    queued: HashSet<u64>,
    /// Spans evicted, with the transfers that touched them since.
    cooling: HashMap<u64, u32>,
    /// The ring the table was made on ([`Disk::ring_epoch`]); `None`: no table yet.
    epoch: Option<u64>,
    /// The ring refused a table: nothing is registered on it.
    no_table: bool,
}

/// What the ring's thread and discards share: the table and the way to wake the thread.
pub struct Shared {
    table: Mutex<Table>,
    emptied: Condvar,
    waker: Mutex<Option<File>>,
    /// Chunks a discard found with a transfer in flight (or not given up in time).
    evict_busy: AtomicU64,
    /// TEST ONLY ([`memvisor::faults::Faults::fixed_no_evict`]): evictions are ignored.
    no_evict: bool,
}

/// What [`FixedChunks`] did, for the counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FixedCounts {
    /// Transfers that went through a registered chunk.
    pub fixed: u64,
    /// Transfers that went the ordinary way because the host refused registration.
    pub fallbacks: u64,
    /// Transfers that went the ordinary way for another reason (see the module's top).
    pub ordinary: u64,
    pub chunks_registered: u64,
    /// Nanoseconds spent registering chunks.
    pub register_ns: u64,
    pub evictions: u64,
    pub evict_busy: u64,
}

/// Why a transfer goes the ordinary way.
enum Why {
    Host,
    Other,
}

/// How a claim went, counted once the request's header says it moves data
/// ([`BlkFixed::tally`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tally {
    Fixed,
    Fallback,
    Ordinary,
}

impl Tally {
    /// How a claim that came to `got` goes into the counts.
    fn of(got: &std::result::Result<u16, Why>) -> Tally {
        match got {
            Ok(_) => Tally::Fixed,
            Err(Why::Host) => Tally::Fallback,
            Err(Why::Other) => Tally::Ordinary,
        }
    }
}

impl FixedCounts {
    /// Counts one transfer as `how` went.
    fn add(&mut self, how: Tally) {
        match how {
            Tally::Fixed => self.fixed += 1,
            Tally::Fallback => self.fallbacks += 1,
            Tally::Ordinary => self.ordinary += 1,
        }
    }
}

/// A ring's registered chunks.
pub struct FixedChunks {
    shared: Arc<Shared>,
    pub counts: FixedCounts,
    /// The kernel refused a vectored fixed transfer: only one-buffer transfers go fixed.
    no_vectored: bool,
}

/// The span holding host address `at` in `region` (`[start, end)`, which holds `at`): its
/// chunk cut to the region.
fn span(at: u64, region: (u64, u64)) -> (u64, u64) {
    let base = at / CHUNK * CHUNK;
    (base.max(region.0), base.saturating_add(CHUNK).min(region.1))
}

/// The spans registered in chunks `[first, last)`, as runs `(first byte, bytes)`.
fn spans_in(t: &Table, first: u64, last: u64) -> Vec<(u64, u64)> {
    let keys = first.saturating_mul(CHUNK)..last.saturating_mul(CHUNK);
    t.chunks
        .range(keys)
        .map(|(&s, ch)| (s, ch.end - s))
        .collect()
}

fn lock(t: &Mutex<Table>) -> std::sync::MutexGuard<'_, Table> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

impl FixedChunks {
    /// An empty table; `no_evict` is the test-only fault.
    pub fn new(no_evict: bool) -> FixedChunks {
        FixedChunks {
            shared: Arc::new(Shared {
                table: Mutex::new(Table::default()),
                emptied: Condvar::new(),
                waker: Mutex::new(None),
                evict_busy: AtomicU64::new(0),
                no_evict,
            }),
            counts: FixedCounts::default(),
            no_vectored: false,
        }
    }

    /// The gate to register with the pin registry.
    pub fn gate(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// On the ring's thread: the slot a transfer of `iov` goes through, inside host memory
    /// `[region.0, region.1)`; the span counts it in flight until released ([`Claim`]).
    /// `None`: it goes the ordinary way (counted); a cold span is queued for
    /// [`FixedChunks::register_cold`].
    #[cfg(test)]
    pub fn acquire(
        &mut self,
        disk: &mut Disk,
        iov: &[libc::iovec],
        region: (u64, u64),
    ) -> Option<u16> {
        let got = self.try_acquire(disk, iov, region);
        self.counts.add(Tally::of(&got));
        got.ok()
    }

    /// `FixedChunks::acquire` without counting: the slot, or why the transfer goes the
    /// ordinary way.
    fn try_acquire(
        &mut self,
        disk: &mut Disk,
        iov: &[libc::iovec],
        region: (u64, u64),
    ) -> Result<u16, Why> {
        let first = iov.first().ok_or(Why::Other)?.iov_base as u64;
        if iov.len() > 1 && self.no_vectored {
            return Err(Why::Host);
        }
        if first < region.0 || first >= region.1 {
            return Err(Why::Other);
        }
        let c = first / CHUNK;
        let (start, end) = span(first, region);
        let inside = iov.iter().all(|v| {
            let s = v.iov_base as u64;
            s >= start && s.checked_add(v.iov_len as u64).is_some_and(|e| e <= end)
        });
        if !inside {
            return Err(Why::Other);
        }
        let epoch = disk.ring_epoch().ok_or(Why::Host)?;
        let mut t = lock(&self.shared.table);
        if t.epoch.is_some_and(|e| e != epoch) {
            // The ring was made again (the device moved to another thread with nothing out):
            // the old ring's table went with it.
            forget(&mut t);
            self.shared.emptied.notify_all();
        }
        if let Some(ch) = t.chunks.get_mut(&start) {
            if ch.evicting || ch.end != end {
                return Err(Why::Other);
            }
            ch.in_flight += 1;
            return u16::try_from(ch.slot).map_err(|_| Why::Other);
        }
        if t.no_table || t.refused.contains(&start) {
            return Err(Why::Host);
        }
        if t.closed.contains_key(&c) {
            return Err(Why::Other);
        }
        if let Some(n) = t.cooling.get_mut(&start) {
            *n += 1;
            if *n < REREGISTER_AFTER {
                return Err(Why::Other);
            }
            t.cooling.remove(&start);
        }
        if t.queued.insert(start) {
            t.cold.push((start, end));
        }
        Err(Why::Other)
    }

    /// On the ring's thread, after a pass's replies went out: registers up to a few of the
    /// spans transfers found cold. A refusal is remembered (the span stays on the ordinary
    /// way, counted as a fallback) and logged.
    pub fn register_cold(&mut self, disk: &mut Disk) {
        let mut t = lock(&self.shared.table);
        if t.cold.is_empty() {
            return;
        }
        let epoch = match disk.ring_epoch() {
            Some(e) => e,
            None => {
                t.no_table = true;
                t.cold.clear();
                t.queued.clear();
                return;
            }
        };
        if t.epoch != Some(epoch) {
            forget(&mut t);
            if let Err(e) = disk.fixed_table(SLOTS) {
                log::info!("blk: no registered buffers ({e}); transfers go the ordinary way");
                t.no_table = true;
                t.cold.clear();
                t.queued.clear();
                return;
            }
            t.free = (0..SLOTS).rev().collect();
            t.epoch = Some(epoch);
            *self.shared.waker.lock().unwrap_or_else(|e| e.into_inner()) = disk.waker();
        }
        let n = t.cold.len().min(REGISTER_PER_PASS);
        let batch: Vec<(u64, u64)> = t.cold.drain(..n).collect();
        for (base, end) in batch {
            t.queued.remove(&base);
            if t.chunks.contains_key(&base)
                || t.closed.contains_key(&(base / CHUNK))
                || t.refused.contains(&base)
            {
                continue;
            }
            let Some(slot) = t.free.pop() else {
                // A full table: the span stays on the ordinary way.
                continue;
            };
            let start = Instant::now();
            // SAFETY: the span lies in one region of guest memory (`try_acquire` cut it to
            // the region), which stays mapped until the memory table changes, and every slot
            // is emptied before the next transfer after that ([`BlkFixed::follow`]); the
            // ring's end empties them all.
            let r = unsafe { disk.register_fixed(slot, base, end - base) };
            self.counts.register_ns += u64::try_from(start.elapsed().as_nanos()).unwrap_or(0);
            match r {
                Ok(()) => {
                    self.counts.chunks_registered += 1;
                    t.chunks.insert(
                        base,
                        Chunk {
                            end,
                            slot,
                            in_flight: 0,
                            evicting: false,
                        },
                    );
                }
                Err(e) => {
                    if t.refused.is_empty() {
                        log::info!(
                            "blk: chunk at {base:#x} not registered ({e}); it goes the ordinary \
                             way (said once)"
                        );
                    }
                    t.free.push(slot);
                    t.refused.insert(base);
                }
            }
        }
    }

    /// The kernel refused a vectored fixed transfer (a kernel before 6.15): from now on only
    /// one-buffer transfers go fixed.
    pub fn refuse_vectored(&mut self) {
        if !self.no_vectored {
            log::info!(
                "blk: the kernel has no READV_FIXED/WRITEV_FIXED; those go the ordinary way"
            );
        }
        self.no_vectored = true;
    }

    /// A transfer through the span holding host address `first` ended (the device's
    /// transfers let go by dropping their [`Claim`]).
    #[cfg(test)]
    pub fn release(&self, first: u64) {
        self.shared.release(first);
    }

    /// On the ring's thread, when woken: empties the slots discards asked for.
    pub fn service(&mut self, disk: &mut Disk) {
        let mut t = lock(&self.shared.table);
        if t.pending.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut t.pending);
        for base in pending {
            let Some(ch) = t.chunks.get(&base) else {
                continue;
            };
            if ch.in_flight > 0 {
                continue;
            }
            let slot = ch.slot;
            match disk.clear_fixed(slot) {
                Ok(()) => {
                    t.chunks.remove(&base);
                    t.free.push(slot);
                    t.cooling.insert(base, 0);
                    self.counts.evictions += 1;
                }
                Err(e) => log::error!("blk: cannot empty registered slot {slot}: {e}"),
            }
        }
        drop(t);
        self.shared.emptied.notify_all();
    }

    /// Empties every slot (the memory table changes; nothing is in flight then) and forgets
    /// what was refused, cold or cooling.
    pub fn clear_all(&mut self, disk: &mut Disk) {
        let mut t = lock(&self.shared.table);
        let chunks: Vec<u32> = t.chunks.values().map(|ch| ch.slot).collect();
        for slot in chunks {
            if let Err(e) = disk.clear_fixed(slot) {
                log::error!("blk: cannot empty registered slot {slot}: {e}");
            }
            t.free.push(slot);
        }
        t.chunks.clear();
        t.refused.clear();
        t.cold.clear();
        t.queued.clear();
        t.cooling.clear();
        t.pending.clear();
        drop(t);
        self.shared.emptied.notify_all();
    }

    /// The counts since the last call, with the busy chunks discards met.
    pub fn take_counts(&mut self) -> FixedCounts {
        let mut c = std::mem::take(&mut self.counts);
        c.evict_busy = self.shared.evict_busy.swap(0, Ordering::Relaxed);
        c
    }
}

/// The ring the table lived on is gone: nothing is registered.
fn forget(t: &mut Table) {
    t.chunks.clear();
    t.free.clear();
    t.pending.clear();
    t.epoch = None;
}

/// Whether this host lets a blk device register guest memory with io_uring: a ring, a sparse
/// buffer table and a vectored fixed opcode (Linux 6.15) made and probed once, for `serve` to
/// refuse `fixed-buffers=on` with the reason before any guest starts. (A chunk the host still
/// refuses later, past `RLIMIT_MEMLOCK`, goes the ordinary way.)
pub fn probe() -> std::result::Result<(), String> {
    let ring = io_uring::IoUring::new(2)
        .map_err(|e| format!("io_uring cannot be set up ({e}; kernel.io_uring_disabled?)"))?;
    ring.submitter()
        .register_buffers_sparse(1)
        .map_err(|e| format!("io_uring refuses a sparse registered-buffer table ({e})"))?;
    let mut p = io_uring::Probe::new();
    ring.submitter()
        .register_probe(&mut p)
        .map_err(|e| format!("io_uring cannot say which operations it has ({e})"))?;
    for (code, name) in [
        (io_uring::opcode::ReadFixed::CODE, "READ_FIXED"),
        (io_uring::opcode::WriteFixed::CODE, "WRITE_FIXED"),
    ] {
        if !p.is_supported(code) {
            return Err(format!("this kernel's io_uring has no {name}"));
        }
    }
    Ok(())
}

/// Whether memory of this kind may be registered (see the module's top).
fn eligible(kind: &BackingKind) -> bool {
    matches!(
        kind,
        BackingKind::Memfd | BackingKind::Hugetlb(_) | BackingKind::Received { .. }
    )
}

/// A blk device's registered buffers on its ring: the table, its gate in the process's pin
/// registry, and the host ranges the memory table allows.
pub struct BlkFixed {
    chunks: FixedChunks,
    /// The slot table's generation the ranges were read at.
    generation: Option<u64>,
    /// Host ranges of guest memory that may be registered.
    regions: Vec<(u64, u64)>,
    /// Dirty logging is on: every transfer goes the ordinary way, whose guard marks the pages.
    logging: bool,
    /// How the last claim went, not counted until the request is known to be a read or write.
    pending: Option<Tally>,
    /// The queue whose counters its counts go to.
    pub queue: u16,
}

impl BlkFixed {
    /// An empty table whose gate [`PinRegistry::global`] asks before every discard (the
    /// balloon and free page reporting of a `memvisor serve` process go through it).
    pub fn new(no_evict: bool) -> BlkFixed {
        let chunks = FixedChunks::new(no_evict);
        let gate: Arc<dyn DiscardGate> = chunks.gate();
        PinRegistry::global().register_gate(Arc::downgrade(&gate));
        BlkFixed {
            chunks,
            generation: None,
            regions: Vec::new(),
            logging: false,
            pending: None,
            queue: 0,
        }
    }

    /// Before a pass: follows the memory table; when it changed, every slot is emptied.
    pub fn follow(&mut self, disk: &mut Disk, memory: &FrontendMemory) {
        let slots = memory.slots();
        let g = slots.generation();
        if self.generation == Some(g) {
            return;
        }
        self.chunks.clear_all(disk);
        self.generation = Some(g);
        self.logging = memory.is_logging();
        self.regions = slots
            .snapshot()
            .slots()
            .filter(|s| {
                let ok = eligible(s.backing().kind());
                if !ok {
                    log::warn!(
                        "blk: guest memory at {:#x} is {:?}, not memfd, hugetlbfs or a shared \
                         descriptor: its transfers do not use registered buffers",
                        s.hva().0,
                        s.backing().kind()
                    );
                }
                ok
            })
            .map(|s| {
                let r = s.range();
                (s.hva().0, s.hva().0 + r.len())
            })
            .collect();
    }

    /// The slot a transfer of `iov` goes through, or `None`; how it went is counted by
    /// [`BlkFixed::tally`].
    pub fn acquire(&mut self, disk: &mut Disk, iov: &[libc::iovec]) -> Option<u16> {
        let first = iov.first().map_or(0, |v| v.iov_base as u64);
        let region = self
            .regions
            .iter()
            .find(|r| first >= r.0 && first < r.1)
            .copied();
        let (slot, tally) = match region {
            Some(region) if !self.logging => {
                let got = self.chunks.try_acquire(disk, iov, region);
                (got.as_ref().ok().copied(), Tally::of(&got))
            }
            _ => (None, Tally::Ordinary),
        };
        self.pending = Some(tally);
        slot
    }

    /// [`BlkFixed::acquire`] as a [`Claim`], which lets the chunk go when dropped.
    pub fn claim(&mut self, disk: &mut Disk, iov: &[libc::iovec]) -> Option<Claim> {
        let slot = self.acquire(disk, iov)?;
        Some(Claim {
            gate: self.chunks.gate(),
            first: iov.first().map_or(0, |v| v.iov_base as u64),
            slot,
            usable: true,
        })
    }

    /// A new request: whatever the last claim was, it is not this request's.
    pub fn begin(&mut self) {
        self.pending = None;
    }

    /// Whether a transfer may go through a registered chunk at all now (not while dirty
    /// pages are logged, nor without memory that may be registered); if not, it goes the
    /// ordinary way ([`BlkFixed::tally`] counts it).
    pub fn may_claim(&mut self) -> bool {
        let ok = !self.logging && !self.regions.is_empty();
        if !ok {
            self.pending = Some(Tally::Ordinary);
        }
        ok
    }

    /// The request claimed for last is a read or write about to go: counts how its claim
    /// went (fixed, fallback or ordinary). A request that moves no data (`GET_ID`, `DISCARD`,
    /// `WRITE_ZEROES`, a refused write) is never tallied: its claim is forgotten at the next
    /// [`BlkFixed::begin`].
    pub fn tally(&mut self) {
        if let Some(how) = self.pending.take() {
            self.chunks.counts.add(how);
        }
    }

    /// A transfer [`BlkFixed::acquire`] counted as fixed did not go so after all.
    pub fn uncount_fixed(&mut self) {
        self.chunks.counts.fixed = self.chunks.counts.fixed.saturating_sub(1);
    }

    /// A transfer went the ordinary way because the kernel refused it as a fixed one.
    pub fn count_fallback(&mut self) {
        self.chunks.counts.fallbacks += 1;
    }

    /// See [`FixedChunks::refuse_vectored`].
    pub fn refuse_vectored(&mut self) {
        self.chunks.refuse_vectored();
    }

    /// After a pass's replies went out (`Device::after_replies`): registers cold chunks.
    pub fn after_replies(&mut self, disk: &mut Disk) {
        self.chunks.register_cold(disk);
    }

    /// TEST ONLY: whether chunks wait to be registered.
    #[cfg(feature = "test-hooks")]
    pub fn has_cold(&self) -> bool {
        !lock(&self.chunks.shared.table).cold.is_empty()
    }

    /// When the ring's thread wakes: evictions discards asked for.
    pub fn service(&mut self, disk: &mut Disk) {
        self.chunks.service(disk);
    }

    /// The counts since the last call.
    pub fn take_counts(&mut self) -> FixedCounts {
        self.chunks.take_counts()
    }
}

/// A transfer counted in flight on its registered chunk ([`BlkFixed::claim`]) until dropped:
/// while it lives the chunk stays registered and a discard skips it (busy). Through `slot`
/// while `usable`; a transfer the kernel refused as a fixed one goes on the ordinary way with
/// the claim kept, since the claim, not a hold, is what keeps its pages from a discard.
pub struct Claim {
    gate: Arc<Shared>,
    /// A host address inside the chunk.
    first: u64,
    pub slot: u16,
    pub usable: bool,
}

impl Claim {
    /// The registered buffer the transfer goes through, unless the kernel refused that.
    pub fn slot(&self) -> Option<u16> {
        self.usable.then_some(self.slot)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.gate.release(self.first);
    }
}

impl Shared {
    /// A transfer through the span holding host address `first` ended.
    fn release(&self, first: u64) {
        let mut t = lock(&self.table);
        if let Some((_, ch)) = t.chunks.range_mut(..=first).next_back() {
            if first < ch.end {
                ch.in_flight = ch.in_flight.saturating_sub(1);
            }
        }
    }

    /// [`DiscardGate::evict`]'s work: the busy runs.
    fn evict_range(&self, hva: u64, len: u64, wait: Duration) -> Vec<(u64, u64)> {
        let (first, last) = (hva / CHUNK, (hva + len).div_ceil(CHUNK));
        let mut busy = Vec::new();
        let mut t = lock(&self.table);
        for c in first..last {
            *t.closed.entry(c).or_default() += 1;
        }
        let mut asked = Vec::new();
        for run in spans_in(&t, first, last) {
            let Some(ch) = t.chunks.get_mut(&run.0) else {
                continue;
            };
            if ch.in_flight > 0 {
                busy.push(run);
                continue;
            }
            if !ch.evicting {
                ch.evicting = true;
                t.pending.push(run.0);
            }
            asked.push(run);
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
            let left: Vec<(u64, u64)> = asked
                .iter()
                .copied()
                .filter(|(base, _)| t.chunks.contains_key(base))
                .collect();
            let now = Instant::now();
            if left.is_empty() || now >= deadline {
                busy.extend(left);
                return busy;
            }
            t = self
                .emptied
                .wait_timeout(t, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl DiscardGate for Shared {
    fn evict(&self, hva: u64, len: u64, wait: Duration) -> Vec<(u64, u64)> {
        if self.no_evict {
            return Vec::new();
        }
        let busy = self.evict_range(hva, len, wait);
        self.evict_busy
            .fetch_add(busy.len() as u64, Ordering::Relaxed);
        busy
    }

    fn pinned_runs(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        if self.no_evict {
            return Vec::new();
        }
        let t = lock(&self.table);
        spans_in(&t, start / CHUNK, end.div_ceil(CHUNK))
    }

    fn reopen(&self, hva: u64, len: u64) {
        if self.no_evict {
            return;
        }
        let mut t = lock(&self.table);
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
