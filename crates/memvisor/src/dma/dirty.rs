//! Dirty page tracking for migration (VFIO_IOMMU_DIRTY_PAGES).
//!
//! While tracking is on, every mapping carries a bitmap with one bit per page of the space's
//! smallest page size. `dma_write` sets the bits of the pages it wrote after the bytes landed,
//! and `translate` / `translate_sg` for WRITE set them at translation time (a device writes
//! after translating, so the final read of the log must come after devices are quiesced, as in
//! any pre-copy migration). Bits are set a 64-bit word at a time. With tracking off a mapping
//! has no bitmap and the hot path pays one branch. [`DmaSpace::get_and_clear_dirty`] reads and
//! clears the bits of any range made of whole mappings, holes allowed, in the
//! `KVM_GET_DIRTY_LOG` / VFIO layout.

use super::{DmaSpace, index_set, whole_mappings};
use crate::addr::Iova;
use crate::error::{Error, Result};

impl DmaSpace {
    /// Starts dirty tracking: every mapping gets a clear bitmap, as do mappings made from now
    /// on. Starting twice is harmless (the bitmaps are kept).
    pub fn start_dirty_tracking(&self) {
        self.set_tracking(true);
    }

    /// Stops dirty tracking and drops the bitmaps.
    pub fn stop_dirty_tracking(&self) {
        self.set_tracking(false);
    }

    /// Whether dirty tracking is on.
    pub fn is_dirty_tracking(&self) -> bool {
        self.shared
            .writer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .tracking
    }

    fn set_tracking(&self, on: bool) {
        self.change(|map, writer| {
            if writer.tracking == on {
                return Ok(((), false));
            }
            writer.tracking = on;
            let mut pos = map.first_ending_at_or_after(0);
            while let Some(p) = pos {
                let m = map.get(p).3.clone();
                let dirty = on.then(|| self.new_bitmap(m.iova.len()));
                index_set(map, p, m.with(m.host.clone(), dirty));
                pos = map.next(p);
            }
            Ok(((), true))
        })
        .expect("changing tracking cannot fail")
    }

    /// Returns the dirty bitmap of `[iova, iova + size)` at `page_size` granularity (bit `i` =
    /// page `iova + i * page_size`) and clears it. The range must not cut a mapping; holes read
    /// as clean. EINVAL if tracking is off, `page_size` is not the smallest supported page
    /// size, or the range is misaligned or cuts a mapping.
    pub fn get_and_clear_dirty(&self, iova: Iova, size: u64, page_size: u64) -> Result<Vec<u64>> {
        let page = self.shared.min_page;
        if page_size != page {
            return Err(Error::Invalid(format!(
                "dirty bitmap page size {page_size:#x} must be the smallest supported page size {page:#x}"
            )));
        }
        let range = self.check_range(iova, size)?;
        if !self.is_dirty_tracking() {
            return Err(Error::Invalid(
                "dirty tracking is off; call start_dirty_tracking first".into(),
            ));
        }
        let snap = self.shared.current.load();
        let mappings = whole_mappings(&snap.map, range.start().0, range.last().0)?;
        let bits = size / page;
        let mut out = vec![0u64; bits.div_ceil(64) as usize];
        for (start, m) in mappings {
            let Some(bitmap) = &m.dirty else { continue };
            let offset = (start - iova.0) / page;
            let shift = (offset % 64) as u32;
            let base = (offset / 64) as usize;
            for (j, word) in bitmap.take().into_iter().enumerate() {
                if word == 0 {
                    continue;
                }
                out[base + j] |= word << shift;
                if shift != 0 && base + j + 1 < out.len() {
                    out[base + j + 1] |= word >> (64 - shift);
                }
            }
        }
        Ok(out)
    }
}
