//! A [`Snapshot`]: the table at one generation, immutable, and guest memory reached through it.
//!
//! A snapshot is built whole by each change and swapped in; readers hold an `Arc` to it, so
//! the slots (and their backings) it names stay mapped while anyone can still reach them.
//! Lookups search its address index; [`Snapshot::read`], [`Snapshot::write`] and
//! [`Snapshot::copy_within`] first prove the whole range is in slots (and writable), then copy,
//! and writes mark the dirty bitmaps of slots that log.

use std::fmt;
use std::sync::Arc;

use crate::addr::{Gpa, PageSize};
use crate::copy;
use crate::error::{Error, Result};

use super::index::{Buckets, Entry};
use super::{GpaTranslation, Slot, SlotFlags, SlotId};

/// An immutable view of the table at one generation.
pub struct Snapshot {
    pub(super) generation: u64,
    pub(super) entries: Box<[Entry]>,
    /// Where every search by address starts; built from `entries`.
    pub(super) buckets: Buckets,
    pub(super) slots: Box<[Arc<Slot>]>,
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
    pub(super) fn build(generation: u64, slots: Vec<Arc<Slot>>) -> Snapshot {
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
