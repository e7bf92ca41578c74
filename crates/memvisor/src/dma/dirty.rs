//! Dirty page tracking for migration (`VFIO_IOMMU_DIRTY_PAGES`), following type1's rules so
//! that the log never under-reports.
//!
//! While tracking is on, every mapping carries a bitmap with one bit per page of the space's
//! smallest page size. Three kinds of device writes reach guest memory, and each is logged:
//!
//! * **Copies and translations.** `dma_write` sets the bits of the pages it wrote after the bytes
//!   landed; `translate` / `translate_sg` / cursors for WRITE set them at translation time, so a
//!   device must finish a write through a translation before the next read of the log or pin
//!   the pages for the time of the write (below).
//! * **Pins.** A page pinned through `pin_pages` may be written by its device at any time
//!   without telling anyone, whatever the protection it was pinned with. So, as in type1
//!   (`vfio_dma_populate_bitmap` after every read), a pinned page reads dirty **on every read
//!   of the log while it stays pinned**: each read clears the bitmap and marks the pinned pages
//!   again, so the read after the unpin reports it once more (a write just before the unpin is
//!   not lost). It is dirty at the first read after tracking starts if it was pinned before, and
//!   marked when pinned while tracking is on. A `pin_pages` call that fails part way leaves the
//!   pages it had pinned marked, as type1 does: reporting a page too many is safe, clearing a
//!   bit could drop the mark of a write made meanwhile.
//! * **Devices that log nothing.** A device that writes memory behind the space's back — a
//!   hardware device behind a real IOMMU, a process given raw host addresses — makes every
//!   mapped page potentially dirty: type1's "pinned page dirty scope" is then off. Here that
//!   is the case while the space is in [`PinMode::Eager`](super::PinMode) (everything pinned for
//!   such a consumer) or any [`UnloggedDevice`] is attached ([`DmaSpace::attach_unlogged_device`]).
//!   Every read reports every mapped page then, and when the last such device goes while tracking
//!   is on every bitmap is filled, so what it wrote before it left is reported
//!   (`vfio_iommu_populate_bitmap_full`). The default, a Lazy space with no unlogged device, is
//!   the scoped one: it is safe as long as devices write only through the space's own calls.
//!
//! [`DmaSpace::get_and_clear_dirty`] reads and clears the bits of any range made of whole
//! mappings, holes allowed, in the `KVM_GET_DIRTY_LOG` / VFIO layout (bit `i` of word `i / 64`
//! is page `i`); [`DmaSpace::get_and_clear_dirty_into`] writes them into the caller's buffer,
//! so no read allocates, and [`DmaSpace::drain_dirty`] hands the non-zero words to a callback,
//! so a read costs O(dirty words + mappings in the range): each mapping's bitmap is drained
//! through its summary levels (see [`crate::bitmap`]), and no buffer of the range's size is
//! written. A range of more than [`DIRTY_BITMAP_PAGES_MAX`] pages is EINVAL, as in
//! the kernel. [`DmaSpace::unmap_get_dirty`] unmaps and returns the removed range's bits
//! (`VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP`) in one step, so nothing written before the unmap is
//! lost: the unmap returns only after every copy and pin in the range ended (`retire`), so no
//! write lands in a bitmap nobody reads any more.

use super::index::Index;
use super::retire::Plan;
use super::{DmaSpace, Mapping, PinMode, Writer, whole_mappings};
use crate::addr::{Iova, PAGE_4K as PAGE};
use crate::error::{Error, Result};

/// Most pages one dirty bitmap read may cover (the kernel's `DIRTY_BITMAP_PAGES_MAX`,
/// `INT_MAX`): 8 TiB of 4 KiB pages, a 256 MiB bitmap.
pub const DIRTY_BITMAP_PAGES_MAX: u64 = i32::MAX as u64;

/// Which pages a read of the dirty log reports; see the module documentation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DirtyScope {
    /// Pages written through the space's calls and pages pinned (type1's pinned page dirty
    /// scope): every device logs what it writes.
    Logged,
    /// Every mapped page: some device writes without logging (Eager mode or an
    /// [`UnloggedDevice`] attached).
    AllMapped,
}

/// A device attached to a space that writes memory without logging it; while one is attached,
/// every mapped page reads dirty. Dropping it detaches the device.
#[derive(Debug)]
#[must_use = "the device counts as attached only while this is held"]
pub struct UnloggedDevice {
    space: DmaSpace,
}

impl Drop for UnloggedDevice {
    fn drop(&mut self) {
        self.space.scope_change(|w| w.unlogged -= 1);
    }
}

impl Writer {
    pub(super) fn scope(&self) -> DirtyScope {
        if self.mode == PinMode::Eager || self.unlogged > 0 {
            DirtyScope::AllMapped
        } else {
            DirtyScope::Logged
        }
    }
}

impl DmaSpace {
    /// Starts dirty tracking: every mapping gets a clear bitmap, as do mappings made from now
    /// on. Starting twice is harmless (the bitmaps are kept). ENOMEM, tracking still off, if a
    /// bitmap cannot be allocated.
    pub fn start_dirty_tracking(&self) -> Result<()> {
        self.set_tracking(true)
    }

    /// Stops dirty tracking and drops the bitmaps. Called from an unmap notifier of this space,
    /// while its unmap waits, it does nothing: that change would wait for the unmap, which
    /// waits for the notifier.
    pub fn stop_dirty_tracking(&self) {
        // Dropping bitmaps allocates nothing: the only error is the notifier's EBUSY.
        let _ = self.set_tracking(false);
    }

    /// Whether dirty tracking is on.
    pub fn is_dirty_tracking(&self) -> bool {
        self.writer().tracking
    }

    /// Which pages a read of the dirty log reports now.
    pub fn dirty_scope(&self) -> DirtyScope {
        self.writer().scope()
    }

    /// Attaches a device that writes memory without logging it (through host addresses it
    /// keeps, or by DMA the space does not see): every mapped page reads dirty until the
    /// returned guard is dropped.
    pub fn attach_unlogged_device(&self) -> UnloggedDevice {
        self.scope_change(|w| w.unlogged += 1);
        UnloggedDevice {
            space: self.clone(),
        }
    }

    /// Applies `f` to the writer state; if that ends an all-mapped scope while tracking, every
    /// bitmap is filled so what the unlogged device wrote is still reported.
    pub(super) fn scope_change(&self, f: impl FnOnce(&mut Writer)) {
        let mut writer = self.writer();
        let before = writer.scope();
        f(&mut writer);
        scope_ended(&writer, before, &self.shared.current.load().map);
    }

    fn set_tracking(&self, on: bool) -> Result<()> {
        self.change(|map, writer| {
            if writer.tracking == on {
                return Ok(((), false));
            }
            let mut changed = Vec::new();
            let mut pos = map.first_ending_at_or_after(0);
            while let Some(p) = pos {
                let m = map.get(p).3.clone();
                let dirty = match on {
                    true => Some(self.new_bitmap(m.iova)?),
                    false => None,
                };
                changed.push((p, m.with(m.memory.clone(), dirty)));
                pos = map.next(p);
            }
            for (p, m) in changed {
                map.set(p, m);
            }
            writer.tracking = on;
            Ok(((), true))
        })
    }

    /// Returns the dirty bitmap of `[iova, iova + size)` at `page_size` granularity (bit `i` =
    /// page `iova + i * page_size`) and clears it; pinned pages stay dirty (see the module
    /// documentation). The range must not cut a mapping; holes read as clean. EINVAL if
    /// `page_size` is not the smallest supported page size, the range is empty, misaligned,
    /// longer than [`DIRTY_BITMAP_PAGES_MAX`] pages or cuts a mapping, or tracking is off.
    pub fn get_and_clear_dirty(&self, iova: Iova, size: u64, page_size: u64) -> Result<Vec<u64>> {
        let pages = self.check_bitmap(iova, size, page_size)?;
        let mut out = vec![0u64; pages.div_ceil(64) as usize];
        self.get_and_clear_dirty_into(iova, size, page_size, &mut out)?;
        Ok(out)
    }

    /// [`DmaSpace::get_and_clear_dirty`] into `out`, which must hold at least one bit per page
    /// (EINVAL otherwise); the words past the range's are left alone.
    pub fn get_and_clear_dirty_into(
        &self,
        iova: Iova,
        size: u64,
        page_size: u64,
        out: &mut [u64],
    ) -> Result<()> {
        let pages = self.check_bitmap(iova, size, page_size)?;
        check_out(pages, out)?;
        self.drain_mappings(iova, size, &mut Dense(out), |out| {
            out.0[..pages.div_ceil(64) as usize].fill(0)
        })
    }

    /// Reads and clears the dirty bits of `[iova, iova + size)` like
    /// [`DmaSpace::get_and_clear_dirty`], handing them to `f(page, bits)` instead of a bitmap:
    /// bit `b` of `bits` is page `page + b` of the range (counted from `iova` in `page_size`
    /// pages; `page` need not be a multiple of 64). Only non-zero words are handed over; a page
    /// may come in more than one call. Costs O(dirty words + mappings in the range), not
    /// O(size). Same errors as [`DmaSpace::get_and_clear_dirty`], before any call of `f`.
    pub fn drain_dirty(
        &self,
        iova: Iova,
        size: u64,
        page_size: u64,
        f: impl FnMut(u64, u64),
    ) -> Result<()> {
        self.check_bitmap(iova, size, page_size)?;
        self.drain_mappings(iova, size, &mut Sparse(f), |_| {})
    }

    /// The common part of the reads: checks tracking and that the range cuts no mapping,
    /// `prepare`s the sink, then drains each mapping into it.
    fn drain_mappings<S: Sink>(
        &self,
        iova: Iova,
        size: u64,
        sink: &mut S,
        prepare: impl FnOnce(&mut S),
    ) -> Result<()> {
        let writer = self.writer();
        if !writer.tracking {
            return Err(Error::TrackingOff {
                then: "call start_dirty_tracking first",
            });
        }
        let snap = self.shared.current.load();
        let last = iova.0 + (size - 1);
        let mappings = whole_mappings(&snap.map, iova.0, last)?;
        prepare(sink);
        for (start, m) in &mappings {
            self.take_dirty(&writer, m, *start - iova.0, sink);
        }
        Ok(())
    }

    /// Unmaps every mapping inside `[iova, iova + size)` like [`DmaSpace::unmap`] and returns
    /// the bytes unmapped with the removed range's dirty bitmap, read in the same step
    /// (`VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP`). The bitmap's arguments are checked first, as
    /// for [`DmaSpace::get_and_clear_dirty`], and EINVAL if tracking is off (type1's order).
    pub fn unmap_get_dirty(
        &self,
        iova: Iova,
        size: u64,
        page_size: u64,
    ) -> Result<(u64, Vec<u64>)> {
        let pages = self.check_bitmap(iova, size, page_size)?;
        let range = self.check_range(iova, size)?;
        let mut out = vec![0u64; pages.div_ceil(64) as usize];
        let bytes = self.remove_mappings_with(
            range.start().0,
            range.last().0,
            |writer| match writer.tracking {
                true => Ok(()),
                false => Err(Error::TrackingOff {
                    then: "an unmap cannot return dirty bits",
                }),
            },
            |writer, hit| {
                for (start, m) in hit {
                    self.take_dirty(writer, m, *start - iova.0, &mut Dense(&mut out));
                }
            },
        )?;
        Ok((bytes, out))
    }

    /// The number of pages of a bitmap read of `[iova, iova + size)`, after type1's checks.
    fn check_bitmap(&self, iova: Iova, size: u64, page_size: u64) -> Result<u64> {
        let page = self.shared.min_page;
        if page_size != page {
            return Err(Error::Invalid(format!(
                "dirty bitmap page size {page_size:#x} must be the smallest supported page size {page:#x}"
            )));
        }
        self.check_range(iova, size)?;
        let pages = size / page;
        if pages > DIRTY_BITMAP_PAGES_MAX {
            return Err(Error::Invalid(format!(
                "a dirty bitmap of {pages:#x} pages is larger than the kernel's limit of \
                 {DIRTY_BITMAP_PAGES_MAX:#x} pages; read the range in parts"
            )));
        }
        Ok(pages)
    }

    /// Moves `m`'s dirty bits into `out` at bit offset `byte_offset / page`: the logged bits,
    /// cleared as they are taken (through the bitmap's summaries: O(dirty words)), the pages
    /// devices hold pinned (marked again in the bitmap, so the next read reports them too), or,
    /// in the all-mapped scope, every page.
    fn take_dirty(&self, writer: &Writer, m: &Mapping, byte_offset: u64, out: &mut impl Sink) {
        let Some(bitmap) = &m.dirty else { return };
        let page = self.shared.min_page;
        let first = byte_offset / page;
        if writer.scope() == DirtyScope::AllMapped {
            bitmap.drain(|_, _| {});
            out.run(first, bitmap.pages());
        } else {
            bitmap.drain(|p, bits| out.word(first + p, bits));
        }
        let (start, last) = (m.iova.start().0, m.iova.last().0);
        let base = start / page;
        for (s, e, _) in writer.device_pins.counted_in(start / PAGE, last / PAGE + 1) {
            // Pinned 4 KiB IOVA pages, in bits of the space's page size (see `dirty_pages`).
            let from = (s * PAGE).max(start);
            let to = ((e - 1) * PAGE + (PAGE - 1)).min(last);
            let (b0, b1) = (from / page - base, to / page - base + 1);
            bitmap.mark(b0, b1 - b0);
            out.run(first + b0, b1 - b0);
        }
        // Pages guards hold for writing, the same way.
        self.shared
            .holds
            .written_in(start / PAGE, last / PAGE + 1, |s, e| {
                let from = (s * PAGE).max(start);
                let to = ((e - 1) * PAGE + (PAGE - 1)).min(last);
                let (b0, b1) = (from / page - base, to / page - base + 1);
                bitmap.mark(b0, b1 - b0);
                out.run(first + b0, b1 - b0);
            });
    }

    /// Removes the mappings inside `[first, last]` once devices let go of them (`retire`):
    /// `check` runs first under the writer lock (its error changes nothing), `take` with the
    /// writer state and the mappings removed, before their memory can go. Returns the bytes
    /// removed.
    pub(super) fn remove_mappings_with(
        &self,
        first: u64,
        last: u64,
        check: impl FnOnce(&Writer) -> Result<()>,
        take: impl FnOnce(&Writer, &[(u64, std::sync::Arc<Mapping>)]),
    ) -> Result<u64> {
        let (bytes, ()) = self.retire(
            |_| true,
            |map: &mut Index, writer| {
                check(writer)?;
                let hit = whole_mappings(map, first, last)?;
                writer.invalid -= hit
                    .iter()
                    .filter(|(_, m)| m.memory.is_invalidated())
                    .count() as u64;
                map.remove_all(&hit);
                Ok(Plan {
                    ranges: hit.iter().map(|(s, m)| (*s, m.iova.last().0)).collect(),
                    old: hit,
                    made: Vec::new(),
                })
            },
            take,
        )?;
        Ok(bytes)
    }
}

/// If the scope just went from all-mapped to logged while tracking, marks every page of `map`
/// dirty: what the unlogged consumer wrote must still be reported.
pub(super) fn scope_ended(writer: &Writer, before: DirtyScope, map: &Index) {
    if writer.tracking && before == DirtyScope::AllMapped && writer.scope() == DirtyScope::Logged {
        for (_, _, _, m) in map.iter() {
            if let Some(b) = &m.dirty {
                b.mark_all();
            }
        }
    }
}

/// EINVAL unless `out` holds `pages` bits.
fn check_out(pages: u64, out: &[u64]) -> Result<()> {
    let words = pages.div_ceil(64);
    if (out.len() as u64) < words {
        return Err(Error::Invalid(format!(
            "dirty bitmap buffer of {} words is too small for {pages:#x} pages ({words} words)",
            out.len()
        )));
    }
    Ok(())
}

/// Where a read of the log puts its bits: a bitmap of the whole range, or a callback.
trait Sink {
    /// ORs `bits` in at page `first` (bit `b` is page `first + b`).
    fn word(&mut self, first: u64, bits: u64);
    /// Marks pages `first .. first + count`.
    fn run(&mut self, first: u64, count: u64);
}

/// The caller's bitmap of the whole range (bit `i` of word `i / 64` is page `i`).
struct Dense<'a>(&'a mut [u64]);

impl Sink for Dense<'_> {
    fn word(&mut self, first: u64, bits: u64) {
        or_words(self.0, first, &[bits]);
    }

    fn run(&mut self, first: u64, count: u64) {
        set_bits(self.0, first, count);
    }
}

/// A callback `f(page, bits)`; runs come as words of up to 64 pages each.
struct Sparse<F>(F);

impl<F: FnMut(u64, u64)> Sink for Sparse<F> {
    fn word(&mut self, first: u64, bits: u64) {
        (self.0)(first, bits);
    }

    fn run(&mut self, first: u64, count: u64) {
        let end = first + count;
        let mut page = first;
        while page < end {
            let n = (end - page).min(64);
            (self.0)(page, if n == 64 { u64::MAX } else { (1 << n) - 1 });
            page += n;
        }
    }
}

/// ORs `words` (bit 0 = page 0) into `out` starting at bit `first`.
fn or_words(out: &mut [u64], first: u64, words: &[u64]) {
    let shift = (first % 64) as u32;
    let base = (first / 64) as usize;
    for (j, &word) in words.iter().enumerate() {
        if word == 0 {
            continue;
        }
        out[base + j] |= word << shift;
        if shift != 0 && base + j + 1 < out.len() {
            out[base + j + 1] |= word >> (64 - shift);
        }
    }
}

/// Sets bits `[first, first + count)` of `out`.
fn set_bits(out: &mut [u64], first: u64, count: u64) {
    let mut bit = first;
    let end = first + count;
    while bit < end {
        let n = (64 - bit % 64).min(end - bit);
        let mask = if n == 64 {
            u64::MAX
        } else {
            ((1u64 << n) - 1) << (bit % 64)
        };
        out[(bit / 64) as usize] |= mask;
        bit += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_land_at_any_offset() {
        let mut out = vec![0u64; 3];
        set_bits(&mut out, 60, 8);
        assert_eq!(out, vec![0xf << 60, 0xf, 0]);
        let mut out = vec![0u64; 3];
        or_words(&mut out, 70, &[u64::MAX, 1]);
        assert_eq!(out, vec![0, u64::MAX << 6, (u64::MAX >> 58) | 1 << 6]);
    }
}
