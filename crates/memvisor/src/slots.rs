//! The memslot table: guest physical addresses to host virtual addresses.
//!
//! A VM's RAM is a set of slots, each mapping a guest-physical range onto part of a [`Backing`].
//! The table is read far more often than it changes — every emulated device access, every vCPU
//! exit that touches guest memory translates an address — so readers never lock:
//!
//! * The slots live in an immutable [`Snapshot`], sorted by guest address. A change (insert,
//!   remove, flag change, or any batch of them through [`SlotTable::update`]) builds a new
//!   snapshot and swaps it in atomically; writers serialize on a mutex among themselves only.
//! * A snapshot holds an `Arc` to every backing it names, so memory a reader can still reach stays
//!   mapped until the last reader drops the snapshot: a concurrent remove never makes a reader
//!   touch unmapped memory.
//! * A snapshot carries a bucket index over its slots, built with it: the guest range they span
//!   cut into equal power-of-two buckets (at most two per slot), each naming the one or two slots
//!   that can hold its addresses and where the second starts. A lookup by address — a cursor's
//!   miss or a plain lookup — searches there: one subtraction and shift, one bucket load, one
//!   compare, one entry load, at any slot count; a binary search only among the slots of a
//!   crowded bucket.
//! * A [`SlotCursor`] (one per vCPU or device thread) remembers the last slot it hit and the
//!   generation of the snapshot it came from (KVM's per-vCPU `last_used_slot`, from the patch
//!   "KVM: Cache the last used slot index per vCPU"). A hit
//!   costs one load of the table's generation counter — a cache line only writers write — and a
//!   bounds check; nothing shared is written on a lookup, so cursors on different threads never
//!   contend. When the generation moved, the cursor reloads the snapshot and searches again: a
//!   stale cursor is slower once, never wrong.
//! * A cursor whose hit test keeps failing (random addresses over a few slots, where guessing
//!   wrong costs more than the search) stops remembering and searches every address for a
//!   while, then tries remembering again (the `adapt` module). The answers are the same either
//!   way; only their cost differs.
//!
//! Guest memory is reached through the table with [`SlotTable::read`], [`SlotTable::write`] and
//! [`SlotTable::copy_within`], which may cross slot boundaries. They check the whole range first
//! — unmapped memory is EFAULT, a write into a read-only slot is EFAULT as in KVM — and copy only
//! if all of it is there. Writes through the table mark the slot's dirty bitmap when the slot has
//! [`SlotFlags::LOG_DIRTY`]: device-model writes that KVM's own dirty log cannot see.
//!
//! This file is long because the table, its snapshots' bucket index and the cursor share the
//! snapshot's private layout (the cursor's hit and miss paths read it directly), and their unit
//! tests sit beside them.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::BitOr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::adapt::Adapt;
use crate::addr::{Gpa, Hva, PageSize, Range};
use crate::backing::Backing;
use crate::bitmap::DirtyBitmap;
use crate::copy;
use crate::error::{Error, Result};
use crate::sync::lock;

/// A slot's number, as in KVM's `kvm_userspace_memory_region.slot`.
pub type SlotId = u32;

/// KVM's `KVM_USER_MEM_SLOTS` on x86-64: the default bound on slot ids.
pub const DEFAULT_MAX_SLOTS: u32 = 32764;

/// Slot flags.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct SlotFlags(u32);

impl SlotFlags {
    /// No flags: readable and writable, no dirty logging.
    pub const NONE: SlotFlags = SlotFlags(0);
    /// Guest memory the guest (and writes through the table) may not change (KVM_MEM_READONLY).
    pub const READ_ONLY: SlotFlags = SlotFlags(1);
    /// Keep a dirty bitmap of pages written through the table (KVM_MEM_LOG_DIRTY_PAGES).
    pub const LOG_DIRTY: SlotFlags = SlotFlags(2);

    /// Whether every flag in `other` is set.
    #[inline]
    pub const fn contains(self, other: SlotFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for SlotFlags {
    type Output = SlotFlags;
    fn bitor(self, rhs: SlotFlags) -> SlotFlags {
        SlotFlags(self.0 | rhs.0)
    }
}

impl fmt::Debug for SlotFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        if self.contains(SlotFlags::READ_ONLY) {
            names.push("READ_ONLY");
        }
        if self.contains(SlotFlags::LOG_DIRTY) {
            names.push("LOG_DIRTY");
        }
        write!(
            f,
            "SlotFlags({})",
            if names.is_empty() {
                "NONE".to_string()
            } else {
                names.join("|")
            }
        )
    }
}

/// What to install: `size` bytes of `backing` starting at `offset`, seen by the guest at `gpa`.
#[derive(Clone, Debug)]
pub struct SlotSpec {
    pub id: SlotId,
    pub gpa: Gpa,
    pub size: u64,
    pub backing: Arc<Backing>,
    pub offset: u64,
    pub flags: SlotFlags,
}

impl SlotSpec {
    /// The whole of `backing` at `gpa`, no flags.
    pub fn new(id: SlotId, gpa: Gpa, backing: Arc<Backing>) -> Self {
        SlotSpec {
            id,
            gpa,
            size: backing.size(),
            backing,
            offset: 0,
            flags: SlotFlags::NONE,
        }
    }

    /// Only `size` bytes of the backing, from `offset`.
    pub fn window(mut self, offset: u64, size: u64) -> Self {
        self.offset = offset;
        self.size = size;
        self
    }

    /// With these flags.
    pub fn flags(mut self, flags: SlotFlags) -> Self {
        self.flags = flags;
        self
    }
}

/// An installed slot. Immutable: a flag change installs a new `Slot`.
#[derive(Debug)]
pub struct Slot {
    id: SlotId,
    range: Range<Gpa>,
    backing: Arc<Backing>,
    offset: u64,
    flags: SlotFlags,
    dirty: Option<Arc<DirtyBitmap>>,
}

impl Slot {
    /// The slot's id.
    pub fn id(&self) -> SlotId {
        self.id
    }
    /// The guest-physical range it covers.
    pub fn range(&self) -> Range<Gpa> {
        self.range
    }
    /// Host address of the slot's first byte.
    pub fn hva(&self) -> Hva {
        Hva(self.backing.hva().0 + self.offset)
    }
    /// The memory behind it.
    pub fn backing(&self) -> &Arc<Backing> {
        &self.backing
    }
    /// Offset of the slot's first byte in the backing.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Its flags.
    pub fn flags(&self) -> SlotFlags {
        self.flags
    }
    /// The dirty bitmap writes through the table (and discards) mark, when the slot logs them.
    pub(crate) fn dirty_bitmap(&self) -> Option<&Arc<DirtyBitmap>> {
        self.dirty.as_ref()
    }
    /// Whether both slots mark one and the same dirty log: true for the slots before and after
    /// a flag change that keeps `LOG_DIRTY` (the log goes on), false for a slot inserted anew,
    /// even with the same spec (it starts a log of its own, and the old one's marks stay with
    /// the old slot), and false when either does not log. For a binding that copies the table
    /// elsewhere (KVM's memslots) and must not lose the marks of a replaced slot.
    pub fn shares_dirty_log(&self, other: &Slot) -> bool {
        match (&self.dirty, &other.dirty) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// The answer to a slot lookup: where a guest physical address lives on the host (a device's
/// I/O virtual address translates to a [`dma::Translation`](crate::dma::Translation) instead).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpaTranslation {
    /// Host address of the guest address.
    pub hva: Hva,
    /// Bytes from there to the end of the slot: the host memory is contiguous for this long.
    pub len: u64,
    /// The slot that holds it.
    pub slot: SlotId,
    /// Whether the slot refuses writes.
    pub read_only: bool,
}

/// The part of a slot a lookup needs, packed for the search (32 bytes).
#[derive(Clone, Copy, Debug)]
struct Entry {
    start: u64,
    last: u64,
    /// hva - gpa, wrapping: the host address of `gpa` is `gpa + delta`.
    delta: u64,
    id: SlotId,
    /// 1 if the slot refuses writes: a whole word, so the entry has no padding and is copied
    /// as four words (a `bool` here made the cursor's copy byte-wise, and slower).
    read_only: u32,
}

impl Entry {
    /// Matches no address: `start > last`.
    const NONE: Entry = Entry {
        start: 1,
        last: 0,
        delta: 0,
        id: 0,
        read_only: 0,
    };

    #[inline(always)]
    fn contains(&self, gpa: u64) -> bool {
        gpa >= self.start && gpa <= self.last
    }

    #[inline(always)]
    fn translate(&self, gpa: u64) -> GpaTranslation {
        GpaTranslation {
            hva: Hva(gpa.wrapping_add(self.delta)),
            len: self.last - gpa + 1,
            slot: self.id,
            read_only: self.read_only != 0,
        }
    }
}

/// A snapshot's bucket index: the guest range from the first slot's start to the last slot's
/// end, cut into at most [`Buckets::PER_SLOT`] buckets per slot of one power-of-two size, each
/// naming the entries that can hold an address in it. Finding an address's slot is then one
/// subtraction and shift, one load of its bucket, one compare against where its second entry
/// starts and one load of the entry: two dependent loads where a binary search has one per
/// halving (six at 64 slots, twelve at 4096). Where slots crowd into one bucket (small slots next
/// to a large one, say) the lookup searches that bucket's entries only: never more entries than
/// a binary search over all of them, after one extra load.
struct Buckets {
    /// The first slot's start: bucket `k` covers `base + (k << shift)` and the `(1 << shift) - 1`
    /// bytes after it.
    base: u64,
    shift: u32,
    /// Empty when there are no slots.
    table: Box<[Bucket]>,
}

/// The entries that can hold an address of one bucket: `lo`, the last to start at or before the
/// bucket's first address, through `hi`, the last to start at or before its last address. There
/// is always one at or before the first address: the first bucket starts at the first entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Bucket {
    /// `hi`'s start: at or below it an address is `hi`'s (if anyone's), else `lo`'s.
    split: u64,
    lo: u32,
    hi: u32,
}

impl Buckets {
    /// Buckets per slot, at most. Two rather than one, so that slots of equal size that are no
    /// power of two still give one or two entries per bucket; 16 bytes per bucket, so the index
    /// is at most as big as the entries (32 bytes each).
    const PER_SLOT: u64 = 2;

    fn build(entries: &[Entry]) -> Buckets {
        let (Some(first), Some(last)) = (entries.first(), entries.last()) else {
            return Buckets {
                base: 0,
                shift: 0,
                table: Box::new([]),
            };
        };
        let base = first.start;
        let span = last.last - base;
        let cap = entries.len() as u64 * Self::PER_SLOT;
        // The smallest bucket size that needs no more than `cap` buckets; `span >> 63` is at
        // most 1 and `cap` at least 2, so there is one.
        let shift = (0..64).find(|&s| span >> s < cap).unwrap_or(63);
        let table = (0..=span >> shift)
            .map(|k| {
                // No overflow: `k << shift <= span`, so the bucket's first address is at most
                // the last slot's last byte.
                let first_addr = base + (k << shift);
                let last_addr = first_addr.saturating_add((1 << shift) - 1);
                // Both at least 1: the first entry starts at `base`, at or below either.
                let lo = entries.partition_point(|e| e.start <= first_addr) - 1;
                let hi = entries.partition_point(|e| e.start <= last_addr) - 1;
                // Indexes fit: a table holds fewer than `u32::MAX` slots (ids are u32s).
                Bucket {
                    split: entries[hi].start,
                    lo: lo as u32,
                    hi: hi as u32,
                }
            })
            .collect();
        Buckets { base, shift, table }
    }

    /// The entry holding `gpa`, if any. Above the last slot the address lands past the table's
    /// end or in the last bucket, whose entries' bounds then refuse it. (Below the first slot a
    /// wrapping subtraction could land in the table when it spans more than half the address
    /// space, hence the checked one.)
    #[inline(always)]
    fn find<'a>(&self, entries: &'a [Entry], gpa: u64) -> Option<&'a Entry> {
        self.search(entries, gpa).map(|(_, e)| e)
    }

    /// The position in `entries` of the one holding `gpa`, and that entry, if any:
    /// [`Buckets::find`]'s search.
    #[inline(always)]
    fn search<'a>(&self, entries: &'a [Entry], gpa: u64) -> Option<(usize, &'a Entry)> {
        let k = gpa.checked_sub(self.base)? >> self.shift;
        let b = *self.table.get(usize::try_from(k).ok()?)?;
        let (lo, hi) = (b.lo as usize, b.hi as usize);
        let i = if hi - lo <= 1 {
            // `lo` starts at or below `gpa`; so does `hi` when it is `lo`. Take `hi` if it
            // starts at or below `gpa` (`split`, in the bucket: no load of `hi` first): a mask,
            // not a branch, as the answer is random for random addresses.
            let take_hi = (b.split <= gpa) as usize;
            lo + ((hi - lo) & take_hi.wrapping_neg())
        } else {
            // Crowded bucket: search its entries only. `lo` qualifies, so the count is >= 1.
            lo + entries.get(lo..=hi)?.partition_point(|e| e.start <= gpa) - 1
        };
        let e = entries.get(i)?;
        (gpa <= e.last).then_some((i, e))
    }
}

/// An immutable view of the table at one generation.
pub struct Snapshot {
    generation: u64,
    entries: Box<[Entry]>,
    /// Where every search by address starts; built from `entries`.
    buckets: Buckets,
    slots: Box<[Arc<Slot>]>,
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot")
            .field("generation", &self.generation)
            .field("slots", &self.slots.len())
            .finish()
    }
}

impl Snapshot {
    fn build(generation: u64, slots: Vec<Arc<Slot>>) -> Snapshot {
        let entries: Box<[Entry]> = slots
            .iter()
            .map(|s| Entry {
                start: s.range.start().0,
                last: s.range.last().0,
                delta: s.hva().0.wrapping_sub(s.range.start().0),
                id: s.id,
                read_only: s.flags.contains(SlotFlags::READ_ONLY).into(),
            })
            .collect();
        Snapshot {
            generation,
            buckets: Buckets::build(&entries),
            entries,
            slots: slots.into_boxed_slice(),
        }
    }

    /// Counts changes: every published change gets a larger number.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Number of slots.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether there are no slots.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The slots in guest-address order.
    pub fn slots(&self) -> impl Iterator<Item = &Arc<Slot>> {
        self.slots.iter()
    }

    /// The slot with this id.
    pub fn slot(&self, id: SlotId) -> Option<&Arc<Slot>> {
        self.slots.iter().find(|s| s.id == id)
    }

    /// Position (in guest-address order) of the slot holding `gpa`, found through the bucket
    /// index: two dependent loads at any slot count.
    #[inline]
    pub fn find(&self, gpa: Gpa) -> Option<usize> {
        self.buckets.search(&self.entries, gpa.0).map(|(i, _)| i)
    }

    /// The entry of the slot holding `gpa`, found through the bucket index: what a cursor's miss
    /// and a plain lookup do.
    #[inline(always)]
    fn find_entry_indexed(&self, gpa: Gpa) -> Option<&Entry> {
        self.buckets.find(&self.entries, gpa.0)
    }

    /// The slots that hold any of `[first, last]` (inclusive), in guest-address order: two
    /// binary searches.
    pub(crate) fn overlapping(&self, first: Gpa, last: Gpa) -> &[Arc<Slot>] {
        let from = self.entries.partition_point(|e| e.last < first.0);
        let to = self.entries.partition_point(|e| e.start <= last.0);
        &self.slots[from..to.max(from)]
    }

    /// Translates `gpa` if the slot at `index` holds it; the check a hint or cursor makes.
    #[inline]
    pub fn translate_at(&self, index: usize, gpa: Gpa) -> Option<GpaTranslation> {
        let e = self.entries.get(index)?;
        e.contains(gpa.0).then(|| e.translate(gpa.0))
    }

    /// Where `gpa` lives on the host, or `None` if no slot holds it.
    #[inline]
    pub fn lookup(&self, gpa: Gpa) -> Option<GpaTranslation> {
        self.find_entry_indexed(gpa).map(|e| e.translate(gpa.0))
    }

    /// Checks that `[gpa, gpa + len)` is all in slots (and writable when `write`), then calls
    /// `piece(index, gpa, host pointer, bytes)` for each slot-sized piece in order. EFAULT, with
    /// no call made, if any byte is missing or read-only.
    fn for_each_piece(
        &self,
        gpa: Gpa,
        len: u64,
        write: bool,
        mut piece: impl FnMut(usize, u64, *mut u8, u64),
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let fault = |addr: u64| Error::Fault {
            space: "gpa",
            addr,
            start: gpa.0,
            len,
        };
        let last = gpa.0.checked_add(len - 1).ok_or(fault(u64::MAX))?;
        let first = self.find(gpa).ok_or(fault(gpa.0))?;
        // Pass 1: the pieces are consecutive entries; prove they are all there.
        let mut i = first;
        loop {
            let e = &self.entries[i];
            if write && e.read_only != 0 {
                return Err(Error::ReadOnly {
                    what: format!("slot {}", e.id),
                    addr: e.start.max(gpa.0),
                    start: gpa.0,
                    len,
                });
            }
            if last <= e.last {
                break;
            }
            i += 1;
            match self.entries.get(i) {
                Some(next) if next.start == e.last + 1 => {}
                _ => return Err(fault(e.last + 1)),
            }
        }
        // Pass 2: hand out the pieces.
        let mut addr = gpa.0;
        for (index, e) in self.entries[first..=i].iter().enumerate() {
            let n = last.min(e.last) - addr + 1;
            piece(
                first + index,
                addr,
                addr.wrapping_add(e.delta) as usize as *mut u8,
                n,
            );
            addr = addr.wrapping_add(n);
        }
        Ok(())
    }

    /// The slots that hold `[gpa, gpa + len)`, in order, each with the guest address and length
    /// of its piece. EFAULT if any byte is in no slot.
    pub fn pieces(&self, gpa: Gpa, len: u64) -> Result<Vec<(Arc<Slot>, Gpa, u64)>> {
        let mut out = Vec::new();
        self.for_each_piece(gpa, len, false, |index, addr, _, n| {
            out.push((self.slots[index].clone(), Gpa(addr), n))
        })?;
        Ok(out)
    }

    /// Copies guest memory at `gpa` into `buf`; EFAULT and nothing copied if any of it is not in
    /// a slot.
    pub fn read(&self, gpa: Gpa, buf: &mut [u8]) -> Result<()> {
        let mut done = 0usize;
        self.for_each_piece(gpa, buf.len() as u64, false, |_, _, host, n| {
            let n = n as usize;
            // SAFETY: for_each_piece proved host..host+n lies in a slot of this snapshot, whose
            // backing this snapshot keeps mapped; buf is caller memory, never guest memory.
            unsafe { copy::from_guest(host, &mut buf[done..done + n]) };
            done += n;
        })
    }

    /// Copies `buf` into guest memory at `gpa`; EFAULT and nothing copied if any of it is not in
    /// a slot or is in a read-only slot. Marks dirty pages in slots that log them.
    pub fn write(&self, gpa: Gpa, buf: &[u8]) -> Result<()> {
        let mut done = 0usize;
        self.for_each_piece(gpa, buf.len() as u64, true, |index, addr, host, n| {
            let n = n as usize;
            // SAFETY: for_each_piece proved host..host+n lies in a writable slot of this
            // snapshot, whose backing it keeps mapped; buf is caller memory.
            unsafe { copy::to_guest(&buf[done..done + n], host) };
            self.mark_dirty(index, addr, n as u64);
            done += n;
        })
    }

    /// Copies `len` bytes of guest memory from `src` to `dst` with memmove semantics (the ranges
    /// may overlap). EFAULT, nothing copied, if either range is not all there or `dst` is
    /// read-only.
    pub fn copy_within(&self, src: Gpa, dst: Gpa, len: u64) -> Result<()> {
        // Cut both ranges at every slot boundary of either, then copy chunk by chunk; walking
        // backwards when dst is above src keeps overlapping copies correct.
        let mut src_pieces = Vec::new();
        self.for_each_piece(src, len, false, |_, _, host, n| src_pieces.push((host, n)))?;
        let mut dst_pieces = Vec::new();
        self.for_each_piece(dst, len, true, |index, addr, host, n| {
            dst_pieces.push((index, addr, host, n))
        })?;
        let mut chunks = Vec::with_capacity(src_pieces.len() + dst_pieces.len());
        let (mut si, mut di, mut s_used, mut d_used) = (0, 0, 0u64, 0u64);
        while si < src_pieces.len() && di < dst_pieces.len() {
            let (s_host, s_len) = src_pieces[si];
            let (_, _, d_host, d_len) = dst_pieces[di];
            let n = (s_len - s_used).min(d_len - d_used);
            chunks.push((
                s_host.wrapping_add(s_used as usize),
                d_host.wrapping_add(d_used as usize),
                n as usize,
            ));
            s_used += n;
            d_used += n;
            if s_used == s_len {
                si += 1;
                s_used = 0;
            }
            if d_used == d_len {
                di += 1;
                d_used = 0;
            }
        }
        let copy_chunk = |&(s, d, n): &(*mut u8, *mut u8, usize)| {
            // SAFETY: both pointers come from pieces for_each_piece proved are inside slots of
            // this snapshot (dst writable), whose backings it keeps mapped; ptr::copy allows
            // overlap.
            unsafe { copy::within_guest(s, d, n) }
        };
        if dst > src {
            chunks.iter().rev().for_each(copy_chunk);
        } else {
            chunks.iter().for_each(copy_chunk);
        }
        for (index, addr, _, n) in dst_pieces {
            self.mark_dirty(index, addr, n);
        }
        Ok(())
    }

    fn mark_dirty(&self, index: usize, gpa: u64, len: u64) {
        if let Some(bitmap) = &self.slots[index].dirty {
            let page = PageSize::Size4K.shift();
            let rel = gpa - self.entries[index].start;
            let first = rel >> page;
            let last = (rel + len - 1) >> page;
            bitmap.mark(first, last - first + 1);
        }
    }
}

#[repr(align(128))]
struct Padded<T>(T);

struct Shared {
    /// Generation of `current`; bumped after each swap. On its own cache line: only writers
    /// write it, every cursor lookup reads it.
    generation: Padded<AtomicU64>,
    current: ArcSwap<Snapshot>,
    writer: Mutex<()>,
    max_slots: u32,
    /// TEST ONLY: the faults the table's dirty bitmaps are built with.
    #[cfg(feature = "test-hooks")]
    faults: crate::faults::Faults,
}

/// The memslot table. Cloning gives another handle to the same table.
#[derive(Clone)]
pub struct SlotTable {
    shared: Arc<Shared>,
}

impl fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotTable")
            .field("snapshot", &*self.shared.current.load())
            .field("max_slots", &self.shared.max_slots)
            .finish()
    }
}

impl Default for SlotTable {
    fn default() -> Self {
        Self::new()
    }
}

impl SlotTable {
    /// An empty table accepting slot ids `0..32764`, like KVM on x86-64.
    pub fn new() -> Self {
        Self::with_max_slots(DEFAULT_MAX_SLOTS)
    }

    /// An empty table accepting slot ids `0..max_slots`.
    pub fn with_max_slots(max_slots: u32) -> Self {
        SlotTable {
            shared: Arc::new(Shared {
                generation: Padded(AtomicU64::new(0)),
                current: ArcSwap::from_pointee(Snapshot::build(0, Vec::new())),
                writer: Mutex::new(()),
                max_slots,
                #[cfg(feature = "test-hooks")]
                faults: crate::faults::Faults::default(),
            }),
        }
    }

    /// TEST ONLY (feature `test-hooks`): an empty table like [`SlotTable::with_max_slots`]
    /// whose dirty bitmaps are built with `faults`
    /// ([`Faults::no_dirty_summary`](crate::faults::Faults::no_dirty_summary)).
    #[cfg(feature = "test-hooks")]
    pub fn with_faults(max_slots: u32, faults: crate::faults::Faults) -> Self {
        SlotTable {
            shared: Arc::new(Shared {
                generation: Padded(AtomicU64::new(0)),
                current: ArcSwap::from_pointee(Snapshot::build(0, Vec::new())),
                writer: Mutex::new(()),
                max_slots,
                faults,
            }),
        }
    }

    /// The largest number of slots (and one past the largest id) the table accepts.
    pub fn max_slots(&self) -> u32 {
        self.shared.max_slots
    }

    /// Applies a batch of changes and publishes them as one new snapshot, or — if `edit`
    /// returns an error — publishes nothing. Writers are serialized; readers are never blocked.
    pub fn update<T>(&self, edit: impl FnOnce(&mut SlotEdit) -> Result<T>) -> Result<T> {
        let _writer = lock(&self.shared.writer);
        let current = self.shared.current.load_full();
        #[allow(unused_mut)]
        let mut draft = SlotEdit::from_snapshot(&current, self.shared.max_slots);
        #[cfg(feature = "test-hooks")]
        {
            draft.faults = self.shared.faults;
        }
        let value = edit(&mut draft)?;
        let generation = current.generation + 1;
        let slots = draft
            .by_gpa
            .values()
            .map(|id| draft.by_id[id].clone())
            .collect();
        self.shared
            .current
            .store(Arc::new(Snapshot::build(generation, slots)));
        self.shared
            .generation
            .0
            .store(generation, Ordering::Release);
        Ok(value)
    }

    /// Installs one slot. EINVAL for a bad id, size, alignment or a window past the backing's
    /// end; EEXIST if the id is taken or the guest range overlaps another slot.
    pub fn insert(&self, spec: SlotSpec) -> Result<()> {
        self.update(|t| t.insert(spec))
    }

    /// Removes a slot; ENOENT if there is none with this id. Its backing stays mapped until the
    /// last reader of an older snapshot lets go.
    pub fn remove(&self, id: SlotId) -> Result<()> {
        self.update(|t| t.remove(id).map(drop))
    }

    /// Changes a slot's flags; ENOENT if there is none with this id.
    pub fn set_flags(&self, id: SlotId, flags: SlotFlags) -> Result<()> {
        self.update(|t| t.set_flags(id, flags))
    }

    /// The generation of the current snapshot: one load, no reference taken. A view built from
    /// a snapshot of this generation is still current.
    pub fn generation(&self) -> u64 {
        self.shared.generation.0.load(Ordering::Acquire)
    }

    /// The current snapshot, to use for many lookups or to keep memory mapped.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.shared.current.load_full()
    }

    /// A cursor for one thread's lookups.
    pub fn cursor(&self) -> SlotCursor {
        let snapshot = self.snapshot();
        SlotCursor {
            generation: snapshot.generation,
            shared: self.shared.clone(),
            snapshot,
            hit: Entry::NONE,
            hit_generation: NO_HIT,
            adapt: Adapt::NEW,
        }
    }

    /// Where `gpa` lives on the host (the current snapshot's bucket index).
    pub fn lookup(&self, gpa: Gpa) -> Option<GpaTranslation> {
        self.shared.current.load().lookup(gpa)
    }

    /// See [`Snapshot::read`].
    pub fn read(&self, gpa: Gpa, buf: &mut [u8]) -> Result<()> {
        self.shared.current.load().read(gpa, buf)
    }

    /// See [`Snapshot::write`].
    pub fn write(&self, gpa: Gpa, buf: &[u8]) -> Result<()> {
        self.shared.current.load().write(gpa, buf)
    }

    /// See [`Snapshot::copy_within`].
    pub fn copy_within(&self, src: Gpa, dst: Gpa, len: u64) -> Result<()> {
        self.shared.current.load().copy_within(src, dst, len)
    }

    /// Returns the slot's dirty bitmap (one bit per 4 KiB page, KVM_GET_DIRTY_LOG layout) and
    /// clears it. ENOENT if there is no such slot or it does not log dirty pages.
    pub fn take_dirty_log(&self, id: SlotId) -> Result<Vec<u64>> {
        let snapshot = self.shared.current.load();
        let slot = snapshot.slot(id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        match &slot.dirty {
            Some(bitmap) => Ok(bitmap.take()),
            None => Err(Error::NotFound {
                what: "dirty log of slot",
                id: id.into(),
            }),
        }
    }

    /// Reads and clears the slot's dirty bitmap like [`SlotTable::take_dirty_log`], handing
    /// each non-zero word to `f(page, bits)` (bit `b` is the slot's page `page + b`; `page` is
    /// a multiple of 64) in increasing order. Costs O(dirty words), not O(slot size): no
    /// bitmap of the slot's size is built. ENOENT as for [`SlotTable::take_dirty_log`], before
    /// any call of `f`.
    pub fn drain_dirty_log(&self, id: SlotId, f: impl FnMut(u64, u64)) -> Result<()> {
        let snapshot = self.shared.current.load();
        let slot = snapshot.slot(id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        match &slot.dirty {
            Some(bitmap) => {
                bitmap.drain(f);
                Ok(())
            }
            None => Err(Error::NotFound {
                what: "dirty log of slot",
                id: id.into(),
            }),
        }
    }
}

/// A batch of changes being prepared by [`SlotTable::update`].
pub struct SlotEdit {
    by_id: BTreeMap<SlotId, Arc<Slot>>,
    /// Guest start address -> id; slots never overlap, so this orders them.
    by_gpa: BTreeMap<u64, SlotId>,
    max_slots: u32,
    /// TEST ONLY: the table's faults, for the bitmaps this batch starts.
    #[cfg(feature = "test-hooks")]
    faults: crate::faults::Faults,
}

impl SlotEdit {
    fn from_snapshot(snapshot: &Snapshot, max_slots: u32) -> Self {
        SlotEdit {
            by_id: snapshot.slots.iter().map(|s| (s.id, s.clone())).collect(),
            by_gpa: snapshot
                .slots
                .iter()
                .map(|s| (s.range.start().0, s.id))
                .collect(),
            max_slots,
            #[cfg(feature = "test-hooks")]
            faults: crate::faults::Faults::default(),
        }
    }

    /// A clear dirty bitmap for `pages` pages, with the table's faults in a test-hooks build.
    fn new_bitmap(&self, pages: u64) -> DirtyBitmap {
        let bitmap = DirtyBitmap::new(pages);
        #[cfg(feature = "test-hooks")]
        let bitmap = bitmap.with_faults(&self.faults);
        bitmap
    }

    /// Adds a slot to the batch; see [`SlotTable::insert`].
    pub fn insert(&mut self, spec: SlotSpec) -> Result<()> {
        if spec.id >= self.max_slots {
            return Err(Error::LimitExceeded {
                what: "slot id",
                value: spec.id.into(),
                limit: self.max_slots.into(),
            });
        }
        let range = Range::new("slot", spec.gpa, spec.size)?;
        PageSize::Size4K.check("slot guest address", spec.gpa.0)?;
        let page = spec.backing.page_size();
        page.check("slot size", spec.size)?;
        page.check("slot offset in backing", spec.offset)?;
        match spec.offset.checked_add(spec.size) {
            Some(end) if end <= spec.backing.size() => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: "slot window in backing",
                    start: spec.offset,
                    len: spec.size,
                    limit: spec.backing.size(),
                });
            }
        }
        if self.by_id.contains_key(&spec.id) {
            return Err(Error::AlreadyExists {
                what: "slot",
                id: spec.id.into(),
            });
        }
        // The slot starting closest below our last byte is the only one that can overlap.
        if let Some((_, &other)) = self.by_gpa.range(..=range.last().0).next_back() {
            let other = &self.by_id[&other];
            if other.range.overlaps(&range) {
                return Err(Error::Overlap {
                    what: "slot",
                    start: range.start().0,
                    last: range.last().0,
                    existing: format!("slot {}", other.id),
                    existing_start: other.range.start().0,
                    existing_last: other.range.last().0,
                });
            }
        }
        let dirty = spec
            .flags
            .contains(SlotFlags::LOG_DIRTY)
            .then(|| Arc::new(self.new_bitmap(spec.size >> PageSize::Size4K.shift())));
        self.by_gpa.insert(range.start().0, spec.id);
        self.by_id.insert(
            spec.id,
            Arc::new(Slot {
                id: spec.id,
                range,
                backing: spec.backing,
                offset: spec.offset,
                flags: spec.flags,
                dirty,
            }),
        );
        Ok(())
    }

    /// Removes a slot from the batch and returns it; ENOENT if there is none with this id.
    pub fn remove(&mut self, id: SlotId) -> Result<Arc<Slot>> {
        let slot = self.by_id.remove(&id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        self.by_gpa.remove(&slot.range.start().0);
        Ok(slot)
    }

    /// Changes a slot's flags. Turning LOG_DIRTY on starts a clear bitmap; leaving it on keeps
    /// the bitmap (no marks are lost); turning it off drops it.
    pub fn set_flags(&mut self, id: SlotId, flags: SlotFlags) -> Result<()> {
        let old = self.by_id.get(&id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        let dirty = match (&old.dirty, flags.contains(SlotFlags::LOG_DIRTY)) {
            (Some(bitmap), true) => Some(bitmap.clone()),
            (None, true) => Some(Arc::new(
                self.new_bitmap(old.range.len() >> PageSize::Size4K.shift()),
            )),
            (_, false) => None,
        };
        let new = Slot {
            id,
            range: old.range,
            backing: old.backing.clone(),
            offset: old.offset,
            flags,
            dirty,
        };
        self.by_id.insert(id, Arc::new(new));
        Ok(())
    }

    /// Number of slots in the batch's result so far.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether the batch's result is empty so far.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

/// One thread's view of the table, remembering the last slot it hit (as KVM's per-vCPU
/// `last_used_slot` does).
///
/// Keep one per vCPU or device thread; it is `Send` but not shared. It holds the snapshot it last
/// used, so the memory of slots removed since stays mapped until its next lookup (or until it is
/// dropped) — call [`SlotCursor::refresh`] from an idle thread to let go sooner.
pub struct SlotCursor {
    shared: Arc<Shared>,
    snapshot: Arc<Snapshot>,
    generation: u64,
    hit: Entry,
    /// The generation `hit` belongs to; [`NO_HIT`] when there is none (and always while
    /// searching), so the hit test needs no separate "have a hit" check.
    hit_generation: u64,
    /// Whether the cursor remembers its last slot or searches every address, and the count
    /// that ends the mode.
    adapt: Adapt,
}

/// A generation no table reaches.
const NO_HIT: u64 = u64::MAX;

impl fmt::Debug for SlotCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotCursor")
            .field("generation", &self.generation)
            .field("last_slot", &self.hit.id)
            .finish()
    }
}

impl SlotCursor {
    /// Where `gpa` lives on the host.
    ///
    /// Remembering (the start): a hit on the last slot costs a load and one compare of each
    /// kind joined without short-circuits, one branch, and one store (the miss count back to
    /// 0); a miss searches the snapshot's bucket index inline and remembers the entry found,
    /// computing the answer before the store so the return value does not wait on it. After 8
    /// misses in a row the cursor searches every address and remembers nothing for 16,384
    /// lookups, then tries remembering again (the `adapt` module): over a few slots a cursor
    /// that only remembered was slower than a plain binary search on random addresses.
    /// Either way the answer is the current snapshot's.
    ///
    /// Always inlined: the modes' few instructions took it past LLVM's own threshold, and as
    /// a call the hit cost half as much again (figures: `docs/measurements.md`, "Slot cursor").
    #[inline(always)]
    pub fn lookup(&mut self, gpa: Gpa) -> Option<GpaTranslation> {
        let generation = self.shared.generation.0.load(Ordering::Acquire);
        let h = &self.hit;
        // `gpa - start` wraps above `last - start` when gpa is below the slot. Never true while
        // searching (`hit_generation` is NO_HIT then), so this branch is predictable there.
        if (generation == self.hit_generation)
            & (gpa.0.wrapping_sub(h.start) <= h.last.wrapping_sub(h.start))
        {
            self.adapt.hit();
            return Some(h.translate(gpa.0));
        }
        if generation != self.generation {
            self.reload();
        }
        // One search for both ways of working (two inline copies cost a hit-heavy stream more
        // than the mode's branch); what is remembered of the answer differs.
        let (i, e) = self
            .snapshot
            .buckets
            .search(&self.snapshot.entries, gpa.0)?;
        let t = e.translate(gpa.0);
        if self.adapt.searching() {
            if self.adapt.searched() {
                self.remember(i);
            }
        } else {
            self.hit = *e;
            self.hit_generation = self.generation;
            if self.adapt.missed() {
                self.hit_generation = NO_HIT;
            }
        }
        Some(t)
    }

    /// Goes back to remembering, starting with the entry at `i`.
    #[cold]
    #[inline(never)]
    fn remember(&mut self, i: usize) {
        self.hit = self.snapshot.entries[i];
        self.hit_generation = self.generation;
    }

    /// Moves to the table's current snapshot if it changed, letting go of the old one.
    pub fn refresh(&mut self) {
        if self.shared.generation.0.load(Ordering::Acquire) != self.generation {
            self.reload();
        }
    }

    #[cold]
    #[inline(never)]
    fn reload(&mut self) {
        self.snapshot = self.shared.current.load_full();
        self.generation = self.snapshot.generation;
        self.hit = Entry::NONE;
        self.hit_generation = NO_HIT;
    }

    /// The snapshot the cursor answers from (after a refresh).
    pub fn snapshot(&mut self) -> &Arc<Snapshot> {
        self.refresh();
        &self.snapshot
    }

    /// [`Snapshot::read`] on the current snapshot.
    pub fn read(&mut self, gpa: Gpa, buf: &mut [u8]) -> Result<()> {
        self.snapshot().read(gpa, buf)
    }

    /// [`Snapshot::write`] on the current snapshot.
    pub fn write(&mut self, gpa: Gpa, buf: &[u8]) -> Result<()> {
        self.snapshot().write(gpa, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backing;
    use proptest::prelude::*;

    /// Entries for `(start, len)` slots, which must be sorted and not overlap.
    fn entries(slots: &[(u64, u64)]) -> Vec<Entry> {
        slots
            .iter()
            .enumerate()
            .map(|(i, &(start, len))| Entry {
                start,
                last: start + (len - 1),
                delta: 0,
                id: i as SlotId,
                read_only: 0,
            })
            .collect()
    }

    /// The plainest model: the entry whose bounds hold `gpa`, by looking at every one.
    fn model(entries: &[Entry], gpa: u64) -> Option<SlotId> {
        entries
            .iter()
            .find(|e| e.start <= gpa && gpa <= e.last)
            .map(|e| e.id)
    }

    /// The bucket index, alone and through `Snapshot::find`, against the model at every slot
    /// edge (start - 1, start, last, last + 1), at every bucket's first and last address, at
    /// both ends of the address space and at `probes`.
    fn check(slots: &[(u64, u64)], probes: &[u64]) {
        let entries = entries(slots);
        let buckets = Buckets::build(&entries);
        assert!(buckets.table.len() as u64 <= entries.len() as u64 * Buckets::PER_SLOT);
        let mut addrs = vec![0, u64::MAX];
        addrs.extend_from_slice(probes);
        for e in &entries {
            addrs.extend([e.start, e.last]);
            addrs.extend(e.start.checked_sub(1));
            addrs.extend(e.last.checked_add(1));
        }
        for k in 0..buckets.table.len() as u64 {
            let first = buckets.base + (k << buckets.shift);
            addrs.extend([first, first.saturating_add((1 << buckets.shift) - 1)]);
        }
        let snapshot = Snapshot {
            generation: 0,
            buckets: Buckets::build(&entries),
            entries: entries.clone().into_boxed_slice(),
            slots: Box::new([]),
        };
        for gpa in addrs {
            let want = model(&entries, gpa);
            let got = buckets.find(&entries, gpa).map(|e| e.id);
            assert_eq!(got, want, "bucket index at {gpa:#x}, slots {slots:x?}");
            let got = snapshot.find(Gpa(gpa)).map(|i| entries[i].id);
            assert_eq!(got, want, "Snapshot::find at {gpa:#x}, slots {slots:x?}");
        }
    }

    /// `(start, len)` slots laid out from `start`, each `gap` after the previous one's end.
    fn run(start: u64, sizes: &[u64], gap: u64) -> Vec<(u64, u64)> {
        let mut at = start;
        sizes
            .iter()
            .map(|&len| {
                let slot = (at, len);
                at += len + gap;
                slot
            })
            .collect()
    }

    #[test]
    fn bucket_index_matches_the_model_on_fixed_layouts() {
        const K: u64 = 1 << 10;
        const M: u64 = 1 << 20;
        const G: u64 = 1 << 30;
        check(&[], &[1, 4096]);
        check(&[(0, 4096)], &[]);
        check(&[(1 << 40, 4096)], &[]);
        check(&[(0, u64::MAX)], &[1 << 63]);
        check(&[(1, u64::MAX)], &[1 << 63]);
        check(&[(u64::MAX - 4095, 4096)], &[]);
        check(&[(0, 4096), (u64::MAX - 4095, 4096)], &[1 << 63]);
        // Back to back, power-of-two and other sizes, with and without gaps, from 0 and not.
        for n in [1, 2, 3, 7, 8, 64, 65, 513] {
            for (start, size, gap) in [
                (0, 64 * K, 0),
                (0, 64 * K, 4 * K),
                (12 * K, 3 * 4 * K, 0),
                (G, 5 * M, 7 * M),
            ] {
                check(&run(start, &vec![size; n], gap), &[]);
            }
        }
        // A PC's layout: small slots below 1 MiB and below 4 GiB crowd the buckets a large slot
        // above 4 GiB sizes.
        check(
            &[
                (0, 640 * K),
                (768 * K, 128 * K),
                (M, 2 * G - M),
                (4 * G - 256 * K, 256 * K),
                (4 * G, 62 * G),
            ],
            &[],
        );
        // Many small slots, then one huge one.
        let mut crowded = run(0, &[4096; 100], 4096);
        crowded.push((G, 1 << 50));
        check(&crowded, &[]);
    }

    /// A table of `n` slots of 64 KiB back to back from 0, and a random address in one of them.
    fn table(n: u64) -> (SlotTable, impl FnMut(u64) -> Gpa) {
        let t = SlotTable::new();
        let b = Arc::new(Backing::new(crate::BackingKind::PrivateAnon, n << 16).unwrap());
        for i in 0..n {
            t.insert(SlotSpec::new(i as SlotId, Gpa(i << 16), b.clone()).window(i << 16, 1 << 16))
                .unwrap();
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let addr = move |slot: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Gpa((slot << 16) + (x & 0xffff))
        };
        (t, addr)
    }

    fn searching(c: &SlotCursor) -> bool {
        c.adapt.searching()
    }

    #[test]
    fn a_cursor_searches_under_random_addresses_and_remembers_a_thread_that_settles() {
        let (t, mut addr) = table(4);
        let mut c = t.cursor();
        // Each lookup checked against the table's own answer; `None`: a random slot.
        let mut lookups = |c: &mut SlotCursor, slot: Option<u64>, count: u64| {
            for i in 0..count {
                let gpa = addr(slot.unwrap_or(i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62));
                assert_eq!(c.lookup(gpa), t.lookup(gpa), "at {gpa:?}");
            }
        };
        lookups(&mut c, None, 200);
        assert!(searching(&c), "200 random addresses over 4 slots");
        // Settling in slot 2: within SEARCH_FOR lookups the cursor tries remembering again, and
        // as they all come from slot 2 it stays.
        lookups(&mut c, Some(2), u64::from(crate::adapt::SEARCH_FOR));
        assert!(!searching(&c));
        assert_eq!((c.hit.id, c.hit_generation), (2, c.generation));
        // A table change while searching: the cursor searches the new snapshot.
        lookups(&mut c, None, 200);
        assert!(searching(&c));
        t.remove(1).unwrap();
        lookups(&mut c, None, 200);
        assert!(searching(&c), "still searching after the change");
        assert_eq!(c.generation, t.generation());
        // Random addresses through a try at remembering: back to searching after it.
        lookups(&mut c, None, u64::from(crate::adapt::SEARCH_FOR) + 200);
        assert!(
            searching(&c),
            "a failed try at remembering ends in a search"
        );
        // 15 hits in 16, the misses anywhere: never searching.
        let mut c = t.cursor();
        for i in 0..20_000u64 {
            lookups(&mut c, Some(if i % 16 == 15 { i / 16 % 4 } else { 0 }), 1);
            assert!(!searching(&c), "searching after {i} lookups, 15 in 16 hits");
        }
    }

    proptest! {
        #[test]
        fn bucket_index_matches_the_model_on_random_layouts(
            first in prop_oneof![Just(0u64), 0..1u64 << 40, (1u64 << 62)..1u64 << 63],
            slots in prop::collection::vec(
                // (gap before, len), in pages, from tiny to huge.
                (prop_oneof![Just(0u64), 1..16u64, 1..1u64 << 30],
                 prop_oneof![1..16u64, 1..1u64 << 30]),
                0..48,
            ),
            probes in prop::collection::vec(any::<u64>(), 16),
        ) {
            let mut at = first;
            let mut layout = Vec::new();
            for (gap, len) in slots {
                at += gap * 4096;
                layout.push((at, len * 4096));
                at += len * 4096;
            }
            check(&layout, &probes);
        }
    }
}
