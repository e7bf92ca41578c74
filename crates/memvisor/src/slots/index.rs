//! The address index a snapshot carries: one packed [`Entry`] per slot, in guest-address order,
//! and the [`Buckets`] over them, and the [`GpaTranslation`] a lookup answers.
//!
//! An entry holds what a lookup needs of its slot (bounds, the host-minus-guest delta, id and
//! read-only bit) in 32 bytes, so a cursor copies its last hit as four words. The buckets cut
//! the guest range the slots span into equal power-of-two pieces, at most two per slot, each
//! naming the one or two entries that can hold its addresses: finding an address's slot is a
//! subtraction, a shift and two dependent loads at any slot count.

use crate::addr::Hva;

use super::SlotId;

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
pub(super) struct Entry {
    pub(super) start: u64,
    pub(super) last: u64,
    /// hva - gpa, wrapping: the host address of `gpa` is `gpa + delta`.
    pub(super) delta: u64,
    pub(super) id: SlotId,
    /// 1 if the slot refuses writes: a whole word, so the entry has no padding and is copied
    /// as four words (a `bool` here made the cursor's copy byte-wise, and slower).
    pub(super) read_only: u32,
}

impl Entry {
    /// Matches no address: `start > last`.
    pub(super) const NONE: Entry = Entry {
        start: 1,
        last: 0,
        delta: 0,
        id: 0,
        read_only: 0,
    };

    #[inline(always)]
    pub(super) fn contains(&self, gpa: u64) -> bool {
        gpa >= self.start && gpa <= self.last
    }

    #[inline(always)]
    pub(super) fn translate(&self, gpa: u64) -> GpaTranslation {
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
pub(super) struct Buckets {
    /// The first slot's start: bucket `k` covers `base + (k << shift)` and the `(1 << shift) - 1`
    /// bytes after it.
    pub(super) base: u64,
    pub(super) shift: u32,
    /// Empty when there are no slots.
    pub(super) table: Box<[Bucket]>,
}

/// The entries that can hold an address of one bucket: `lo`, the last to start at or before the
/// bucket's first address, through `hi`, the last to start at or before its last address. There
/// is always one at or before the first address: the first bucket starts at the first entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Bucket {
    /// `hi`'s start: at or below it an address is `hi`'s (if anyone's), else `lo`'s.
    split: u64,
    lo: u32,
    hi: u32,
}

impl Buckets {
    /// Buckets per slot, at most. Two rather than one, so that slots of equal size that are no
    /// power of two still give one or two entries per bucket; 16 bytes per bucket, so the index
    /// is at most as big as the entries (32 bytes each).
    pub(super) const PER_SLOT: u64 = 2;

    pub(super) fn build(entries: &[Entry]) -> Buckets {
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
    pub(super) fn find<'a>(&self, entries: &'a [Entry], gpa: u64) -> Option<&'a Entry> {
        self.search(entries, gpa).map(|(_, e)| e)
    }

    /// The position in `entries` of the one holding `gpa`, and that entry, if any:
    /// [`Buckets::find`]'s search.
    #[inline(always)]
    pub(super) fn search<'a>(&self, entries: &'a [Entry], gpa: u64) -> Option<(usize, &'a Entry)> {
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
