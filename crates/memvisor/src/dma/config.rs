//! What a DMA space is made with and reports: its limits and rules ([`DmaConfig`], with the
//! kernel rule for live updates, [`VaddrRule`]) and `VFIO_IOMMU_GET_INFO`'s answer
//! ([`DmaInfo`]). Plain data; the space (the parent module) checks and uses it.

use std::sync::Arc;
use std::time::Duration;

use super::{Grouping, PIN_BATCH, PinMode, PinRegistry};
use crate::addr::{Iova, PageSize, Range};

/// Limits and behaviour of a [`DmaSpace`](super::DmaSpace), fixed at creation.
#[derive(Clone, Debug)]
pub struct DmaConfig {
    /// Most mappings at once (VFIO's `dma_entry_limit`, default 65535).
    pub max_mappings: u32,
    /// Lowest and highest usable IOVA (inclusive), like an IOMMU's aperture.
    pub aperture: (Iova, Iova),
    /// Holes in the aperture no mapping may touch (MSI windows and the like).
    pub reserved: Vec<Range<Iova>>,
    /// Supported page sizes as a bitmap (VFIO's `iova_pgsizes`); the smallest sets the alignment
    /// of every IOVA, size and host address.
    pub page_sizes: u64,
    /// How long a translation of an invalidated host address waits for `update_vaddr` before
    /// failing with EBUSY. Zero fails at once. Used by [`VaddrRule::Wait`].
    pub vaddr_wait: Duration,
    /// Which kernel's rule for invalidated host addresses the space follows.
    pub vaddr_rule: VaddrRule,
    /// Whether `map` pins (Eager) or only `pin_pages` does (Lazy); see
    /// [`DmaSpace::set_pin_mode`](super::DmaSpace::set_pin_mode).
    pub pin_mode: PinMode,
    /// Pages per pinning step ([`PIN_BATCH`]); 1 pins and unpins a page at a time, the
    /// baseline the benchmarks measure against.
    pub pin_batch: usize,
    /// Read physical frames when pinning whole mappings and keep them in the extents (needs
    /// CAP_SYS_ADMIN, as /proc/self/pagemap hides frames from everyone else).
    pub frames: bool,
    /// How `pin_pages` groups the pages it is given ([`Grouping::Adaptive`]).
    pub grouping: Grouping,
    /// The pin registry; `None` is the process's ([`PinRegistry::global`]).
    pub registry: Option<Arc<PinRegistry>>,
    /// Small mappings (up to 127 pages, 508 KiB) the space must hold before it keeps a page
    /// table of them, one word per 4 KiB page; default 64. Below a quarter of this many the
    /// table is dropped again; 0 keeps it always. With the table a cursor's miss costs a
    /// fraction of a search (five to eight times less), but every change to a small mapping
    /// copies a 4 KiB leaf, which makes an IOTLB update in a small table dearer (figures:
    /// `docs/measurements.md`, "DMA page table"). Set 0 for a small table that rarely changes and
    /// misses often.
    pub page_table_from: u32,
    /// How long an unmap, IOTLB invalidation or vaddr invalidation waits for devices to
    /// release the pins they hold in the range it takes away (default 1 s). The range is closed
    /// to new pins, translations and copies from the moment the change starts; past this bound
    /// the change is undone and fails with EBUSY, and the caller must stop the device that keeps
    /// its pins (see `retire`). Keep it below the peer's own reply timeout (QEMU's vfio-user
    /// client waits 5 s for a reply).
    pub unpin_wait: Duration,
    /// TEST ONLY (feature `test-hooks`): the faults the space and what is built on it inject
    /// (its dirty bitmaps; a vfio-user server's unmap and hang-up switches; a vhost-user
    /// device's switches). Off by default.
    #[cfg(feature = "test-hooks")]
    pub faults: crate::faults::Faults,
}

impl Default for DmaConfig {
    fn default() -> Self {
        DmaConfig {
            max_mappings: 65535,
            aperture: (Iova(0), Iova(u64::MAX)),
            reserved: Vec::new(),
            page_sizes: PageSize::Size4K.bytes()
                | PageSize::Size2M.bytes()
                | PageSize::Size1G.bytes(),
            vaddr_wait: Duration::ZERO,
            vaddr_rule: VaddrRule::Wait,
            pin_mode: PinMode::Lazy,
            pin_batch: PIN_BATCH,
            frames: false,
            grouping: Grouping::Adaptive,
            registry: None,
            page_table_from: 64,
            unpin_wait: Duration::from_secs(1),
            #[cfg(feature = "test-hooks")]
            faults: crate::faults::Faults::default(),
        }
    }
}

/// What happens to device access while a host address is invalidated for a live update
/// (between [`DmaSpace::invalidate_vaddr`](super::DmaSpace::invalidate_vaddr) and
/// [`DmaSpace::update_vaddr`](super::DmaSpace::update_vaddr)). Linux changed the
/// rule in 6.3 (and in 6.1.20 of the 6.1 stable series); a VMM picks the one it was written for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum VaddrRule {
    /// Linux 5.12 to 6.2: an access that reaches an invalidated mapping waits for its update
    /// (here up to [`DmaConfig::vaddr_wait`]; the kernel waits without limit until the process
    /// is killed), then fails: EBUSY for translation and `pin_pages`, EFAULT for
    /// `dma_read` / `dma_write`. Other mappings work as usual, and invalidation is allowed
    /// while devices that pin are attached (their pins are asked back first).
    #[default]
    Wait,
    /// Linux 6.3 on: while any mapping's host address is invalidated, `dma_read`, `dma_write`
    /// and `pin_pages` fail at once with EBUSY, whatever mapping they name (translation still
    /// fails only on the invalidated mapping, at once). Invalidation is refused with EBUSY
    /// while a device that pins is attached, i.e. an unmap notifier is registered.
    Refuse,
}

/// What `VFIO_IOMMU_GET_INFO` reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DmaInfo {
    /// Supported page sizes (bitmap).
    pub page_sizes: u64,
    /// Where mappings may go: the aperture minus the reserved ranges, in order, as inclusive
    /// `(first, last)` pairs like `struct vfio_iova_range` (the whole space has 2^64 bytes).
    pub iova_ranges: Vec<(Iova, Iova)>,
    /// The mapping count limit.
    pub max_mappings: u32,
    /// Mappings that can still be made (`VFIO_IOMMU_TYPE1_INFO_DMA_AVAIL`).
    pub available: u32,
}
