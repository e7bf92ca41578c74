//! DMA address spaces: the VFIO type1 (v2) mapping model in userspace.
//!
//! A [`DmaSpace`] is what a device sees: I/O virtual addresses (IOVAs) mapped onto host memory,
//! one [`Mapping`] per successful `map` call. It follows the rules and error codes of Linux's
//! VFIO type1 IOMMU driver (v2), so code written against VFIO behaves the same here:
//!
//! * `map` needs a non-zero size, IOVA / host address / size aligned to the smallest supported
//!   page size and READ and/or WRITE (EINVAL); then, in `vfio_dma_do_map`'s order, no overlap
//!   with an existing mapping (EEXIST), room under the mapping count limit (ENOSPC) and a range
//!   inside the allowed IOVA ranges, the aperture minus reserved holes (EINVAL). A guest range
//!   spanning several slots becomes one mapping per slot, all or nothing.
//! * `unmap` removes whole mappings only: a range that would cut a mapping at its start or end is
//!   EINVAL; a range with nothing in it unmaps 0 bytes.
//! * Live update (`invalidate_vaddr`, then `update_vaddr`) swaps the host memory behind an
//!   unchanged IOVA range, e.g. when a VMM re-execs. In between, nothing touches the old
//!   address; [`VaddrRule`] says whether accesses wait for the update (up to
//!   [`DmaConfig::vaddr_wait`], Linux 5.12–6.2) or every copy and pin fails at once with EBUSY
//!   (Linux 6.3 on).
//!
//! The repository's docs/type1.md lists every errno with the kernel function it follows, and
//! the few places memvisor chooses otherwise.
//!
//! Pinning hangs off mappings: in [`PinMode::Eager`] every mapping is pinned whole when it is
//! made (replayed over existing mappings when the mode switches), in [`PinMode::Lazy`] only what
//! emulated devices ask for through `pin_pages` is. Pins are counted per host page by the
//! process-wide [`PinRegistry`] and per IOVA page for devices. An unmap (or IOTLB or vaddr
//! invalidation) closes its range to devices at once and returns only once no device can still
//! touch it: copies in flight have ended and devices holding pins there were asked to release
//! them and did (`retire`, `device_pins`).
//!
//! Readers never lock. The mappings live in an immutable snapshot (`index`) — a persistent
//! two-level range map, so one change copies O(n / 256) pointers, not the whole table —
//! swapped in atomically after every change (`current`: readers announce themselves, the
//! writer waits for them); writers serialize among themselves, and edit in place the snapshot
//! they last replaced once no reader holds it (`publish`). A mapping holds
//! an `Arc` to the memory it maps, so memory a reader can still reach through an old snapshot
//! stays mapped (a plain copy on its thread's last hit holds none: a change waits for those
//! instead, `grace`).
//! A device's request takes its buffers' host segments and holds in one walk, with no lock
//! another queue needs ([`SgGuard`], `sg`).
//! Translation for devices (`translate`, `translate_sg`, per-thread [`DmaCursor`]), CPU copies
//! (`dma_read` / `dma_write`, as Linux's `vfio_dma_rw`) and dirty tracking are in the submodules.

mod config;
mod current;
mod device_pins;
mod dirty;
mod grace;
mod index;
mod iotlb;
mod mode;
mod publish;
mod retire;
mod rw;
mod sg;
mod translate;
mod vaddr;
#[cfg(feature = "vm-memory")]
mod vm_memory;

use std::collections::HashMap;
use std::fmt;
use std::ops::BitOr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::addr::{Gpa, Hva, Iova, PageSize, Range};
use crate::backing::Backing;
use crate::bitmap::DirtyBitmap;
use crate::error::{Error, Result};
use crate::pin::counts::RunCounts;
use crate::pin::holds::Holds;
use crate::slots::{SlotFlags, Snapshot};
use crate::sync::lock;
use current::{Current, WriteToken};
use device_pins::Notifiers;
use index::{DmaSnapshot, Index};
use publish::working_map;

pub use config::{DmaConfig, DmaInfo, VaddrRule};
pub use device_pins::{Grouping, NotifierId, PIN_PAGES_MAX, read_pinned, write_pinned};
pub use dirty::{DIRTY_BITMAP_PAGES_MAX, DirtyScope, UnloggedDevice};
pub use mode::{Extent, PinMode};
// The pin registry lives in `crate::pin`; these names stay here too, where users first met them.
pub use crate::pin::{HostExtent, KernelCheck, LockLimit, LongTermCounts, PIN_BATCH, PinRegistry};
pub use sg::{Miss, SG_MISSES_MAX, SgBuf, SgGuard, SgScratch, SgWalk};
pub use translate::{DmaCursor, Segment, Translation};
#[cfg(feature = "vm-memory")]
pub use vm_memory::{DmaMemory, DmaSlices};

/// What a mapping allows a device to do.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Prot(u8);

impl Prot {
    /// Device reads (memory -> device).
    pub const READ: Prot = Prot(1);
    /// Device writes (device -> memory).
    pub const WRITE: Prot = Prot(2);
    /// Both.
    pub const RW: Prot = Prot(3);

    /// Whether every bit of `other` is set.
    #[inline]
    pub const fn contains(self, other: Prot) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Prot {
    type Output = Prot;
    fn bitor(self, rhs: Prot) -> Prot {
        Prot(self.0 | rhs.0)
    }
}

impl fmt::Debug for Prot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self.0 {
            0 => "none",
            1 => "READ",
            2 => "WRITE",
            _ => "READ|WRITE",
        })
    }
}

/// The host memory behind a mapping.
#[derive(Clone, Debug)]
struct Host {
    hva: Hva,
    /// Keeps the memory mapped; `None` for caller-managed memory (`map_raw`).
    owner: Option<Arc<Backing>>,
}

impl Host {
    /// The unit pins lock memory in: the huge page size of hugetlbfs and THP memory (mlock of
    /// part of a transparent huge page splits its mapping for good), else 4 KiB.
    fn granule(&self) -> u64 {
        self.owner
            .as_ref()
            .and_then(|b| b.huge_page_size())
            .map_or(PageSize::Size4K.bytes(), |p| p.bytes())
    }

    /// Whether the kernel may back the memory's 4 KiB pages with larger folios: by its THP
    /// settings, and always for caller-managed memory, whose kind is unknown.
    fn large_folios(&self) -> bool {
        (self.owner.as_ref()).is_none_or(|b| b.may_have_large_folios())
    }

    /// Whether the memory's huge pages never split: its guaranteed page is a huge page
    /// (hugetlbfs), unlike THP, which the kernel may back with 4 KiB pages.
    fn unsplittable(&self) -> bool {
        (self.owner.as_ref()).is_some_and(|b| b.page_size().bytes() > PageSize::Size4K.bytes())
    }
}

/// Where a mapping's memory is.
#[derive(Clone, Debug)]
enum Memory {
    /// In this process, at a host address.
    Local(Host),
    /// Invalidated for a live update: nothing reaches the old memory until `update_vaddr`.
    Invalidated,
    /// In a peer this process cannot address (a vfio-user map without a descriptor): only
    /// [`DmaSpace::dma_read_via`] / [`DmaSpace::dma_write_via`] reach it, through the
    /// caller's transport; translation and pinning fail with EFAULT.
    Remote,
}

impl Memory {
    fn host(&self) -> Option<&Host> {
        match self {
            Memory::Local(h) => Some(h),
            Memory::Invalidated | Memory::Remote => None,
        }
    }

    fn is_invalidated(&self) -> bool {
        matches!(self, Memory::Invalidated)
    }
}

/// The bits of a mapping's dirty bitmap over `iova` at `page` bytes a bit. Bits count pages of
/// the IOVA space, not of the mapping: bit 0 is the page holding the mapping's first byte, so a
/// mapping that starts or ends inside a page (a guest range cut at a slot's edge) still has a
/// bit for every page it touches, and its bits line up with a bitmap read at any page-aligned
/// IOVA.
pub(super) fn dirty_pages(iova: Range<Iova>, page: u64) -> u64 {
    iova.last().0 / page - iova.start().0 / page + 1
}

/// One mapping: an IOVA range, its protection and where its memory is.
/// Immutable; a change installs a new record with the same [`Mapping::id`].
#[derive(Debug)]
pub struct Mapping {
    id: u64,
    iova: Range<Iova>,
    prot: Prot,
    memory: Memory,
    dirty: Option<Arc<DirtyBitmap>>,
}

impl Mapping {
    /// Stays the same for the mapping's whole life, across vaddr updates: the key pins and
    /// other per-mapping state hang off.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// The IOVA range.
    pub fn iova(&self) -> Range<Iova> {
        self.iova
    }
    /// What devices may do.
    pub fn prot(&self) -> Prot {
        self.prot
    }
    /// Host address of the first byte; `None` while invalidated for a live update, and for
    /// a peer's memory ([`DmaSpace::map_remote`]).
    pub fn hva(&self) -> Option<Hva> {
        self.memory.host().map(|h| h.hva)
    }
    /// The backing that holds the memory, when memvisor owns it.
    pub fn backing(&self) -> Option<&Arc<Backing>> {
        self.memory.host().and_then(|h| h.owner.as_ref())
    }
    /// Whether the memory is a peer's, reachable only through the caller's transport
    /// ([`DmaSpace::map_remote`]).
    pub fn is_remote(&self) -> bool {
        matches!(self.memory, Memory::Remote)
    }

    fn with(&self, memory: Memory, dirty: Option<Arc<DirtyBitmap>>) -> Mapping {
        Mapping {
            id: self.id,
            iova: self.iova,
            prot: self.prot,
            memory,
            dirty,
        }
    }
}

#[repr(align(128))]
struct Padded<T>(T);

struct Writer {
    /// The right to publish a snapshot (`current`).
    token: WriteToken,
    next_id: u64,
    tracking: bool,
    /// Devices attached that write memory without telling the space ([`UnloggedDevice`]).
    unlogged: usize,
    /// Mappings whose host address is invalidated.
    invalid: u64,
    mode: PinMode,
    /// Pins held for whole mappings in Eager mode, by mapping id.
    eager: HashMap<u64, mode::Pinned>,
    /// IOVA pages (4 KiB numbers) devices pinned through `pin_pages`, counted.
    device_pins: RunCounts,
    /// A change taking memory back from devices, waiting for their pins (`retire`); no other
    /// change starts until it ends.
    retiring: Option<retire::Retiring>,
    /// The snapshot the last change replaced, kept to be edited in place by the next one
    /// (see [`DmaSpace::publish`]).
    spare: Option<publish::Spare>,
    /// The records an insert makes, kept for its capacity (an IOTLB update allocates none).
    made: Vec<Arc<Mapping>>,
    /// Records of removed mappings that nothing else held any more, emptied (no memory, no
    /// bitmap), for the next inserts to fill in place: an IOTLB in strict mode makes and
    /// removes one mapping per message. At most [`FREE_RECORDS`].
    free: Vec<Arc<Mapping>>,
    /// What an invalidation takes away ([`retire::Plan`]), kept for its vectors' capacity.
    scratch: retire::Plan,
}

/// The most removed records kept for reuse: a flat index's worth (a strict 64-page buffer's).
const FREE_RECORDS: usize = 64;

/// What every translation reads first, on a cache line of its own: the generation (bumped
/// after each published change) and the space's process-unique id (per-thread caches of
/// plain `translate` are keyed by it; an address could be reused by a later space).
struct Head {
    generation: AtomicU64,
    id: u64,
}

/// Ids of spaces, never reused in a process.
static NEXT_SPACE_ID: AtomicU64 = AtomicU64::new(1);

struct Shared {
    head: Padded<Head>,
    current: Current<DmaSnapshot>,
    writer: Mutex<Writer>,
    /// Signalled after every vaddr update, for translations waiting on an invalidated range.
    updated: (Mutex<()>, Condvar),
    /// Signalled, with `writer`, when devices unpin while a change waits for them and when that
    /// change ends (`retire`).
    settled: Condvar,
    config: DmaConfig,
    allowed: Vec<(Iova, Iova)>,
    /// The smallest page size of the bitmap: a power of two.
    min_page: u64,
    registry: Arc<PinRegistry>,
    notifiers: Notifiers,
    /// What scatter-gather guards hold (`sg`), by thread shard.
    holds: Arc<Holds>,
}

/// An I/O virtual address space with VFIO type1 semantics. Cloning gives another handle.
#[derive(Clone)]
pub struct DmaSpace {
    shared: Arc<Shared>,
}

impl fmt::Debug for DmaSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let snap = self.shared.current.load();
        f.debug_struct("DmaSpace")
            .field("generation", &snap.generation)
            .field("mappings", &snap.map.len())
            .field("page_table", &snap.map.pages)
            .finish()
    }
}

impl Default for DmaSpace {
    fn default() -> Self {
        Self::new(DmaConfig::default()).expect("the default configuration is valid")
    }
}

/// A mapping about to be made: where, what, how.
struct NewMapping {
    iova: Range<Iova>,
    memory: Memory,
}

/// What inserting new mappings does when one overlaps a mapping already there.
#[derive(Clone, Copy)]
enum OnOverlap {
    /// Fail with EEXIST, as type1's map does.
    Fail,
    /// Change nothing and say so (an IOTLB update, which then removes what is there first).
    Report,
}

impl DmaSpace {
    /// A space with these limits. EINVAL if the page size bitmap is empty or lacks 4 KiB-multiple
    /// sizes, or the aperture is empty.
    pub fn new(config: DmaConfig) -> Result<Self> {
        if config.page_sizes == 0 || config.page_sizes.trailing_zeros() < 12 {
            return Err(Error::BadConfig(format!(
                "page size bitmap {:#x} must contain sizes of 4 KiB or more",
                config.page_sizes
            )));
        }
        let (lo, hi) = config.aperture;
        if lo > hi {
            return Err(Error::BadConfig(format!("aperture {lo}..={hi} is empty")));
        }
        let min_page = 1u64 << config.page_sizes.trailing_zeros();
        let allowed = allowed_ranges(lo, hi, &config.reserved);
        let registry = config.registry.clone().unwrap_or_else(PinRegistry::global);
        let holds = Arc::new(Holds::default());
        registry.register_holds(&holds);
        let id = NEXT_SPACE_ID.fetch_add(1, Ordering::Relaxed);
        let first = Arc::new(DmaSnapshot {
            generation: 0,
            map: Index::new(config.page_table_from.into()),
            invalid: 0,
        });
        let (current, token) = Current::new(first, id);
        Ok(DmaSpace {
            shared: Arc::new(Shared {
                head: Padded(Head {
                    generation: AtomicU64::new(0),
                    id,
                }),
                current,
                writer: Mutex::new(Writer {
                    token,
                    next_id: 1,
                    tracking: false,
                    unlogged: 0,
                    invalid: 0,
                    mode: config.pin_mode,
                    eager: HashMap::new(),
                    device_pins: RunCounts::default(),
                    retiring: None,
                    spare: None,
                    made: Vec::new(),
                    free: Vec::new(),
                    scratch: retire::Plan::default(),
                }),
                updated: (Mutex::new(()), Condvar::new()),
                settled: Condvar::new(),
                config,
                allowed,
                min_page,
                registry,
                notifiers: Notifiers::default(),
                holds,
            }),
        })
    }

    /// TEST ONLY (feature `test-hooks`): the faults this space's config gives it and what is
    /// built on it ([`DmaConfig::faults`]).
    #[cfg(feature = "test-hooks")]
    pub fn faults(&self) -> &crate::faults::Faults {
        &self.shared.config.faults
    }

    /// The space's limits, like `VFIO_IOMMU_GET_INFO`.
    pub fn info(&self) -> DmaInfo {
        let count = self.shared.current.load().map.len() as u32;
        DmaInfo {
            page_sizes: self.shared.config.page_sizes,
            iova_ranges: self.shared.allowed.clone(),
            max_mappings: self.shared.config.max_mappings,
            available: self.shared.config.max_mappings.saturating_sub(count),
        }
    }

    /// Number of mappings.
    pub fn len(&self) -> usize {
        self.shared.current.load().map.len()
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.shared.current.load().map.is_empty()
    }

    /// All mappings, in IOVA order.
    pub fn mappings(&self) -> Vec<Arc<Mapping>> {
        self.shared
            .current
            .load()
            .map
            .iter()
            .map(|(_, _, _, m)| m.clone())
            .collect()
    }

    /// The IOVA ranges of the `count` mappings made longest ago, oldest first: what an IOTLB
    /// that must make room retires, as Linux's vhost retires its oldest entry. Age is the
    /// order mappings were made in (their ids): the parts an invalidation leaves of a
    /// mapping it cut are new mappings, and a vaddr update keeps a mapping's age. One pass
    /// over every mapping, on a counted snapshot (no change waits for it): for a full space,
    /// not for a hot path.
    pub fn oldest(&self, count: usize) -> Vec<Range<Iova>> {
        let snap = self.shared.current.load_full();
        let mut all: Vec<(u64, Range<Iova>)> =
            snap.map.iter().map(|(_, _, _, m)| (m.id, m.iova)).collect();
        if count < all.len() {
            all.select_nth_unstable_by_key(count, |&(id, _)| id);
            all.truncate(count);
        }
        all.sort_unstable_by_key(|&(id, _)| id);
        all.into_iter().map(|(_, range)| range).collect()
    }

    /// Maps `size` bytes of `backing` from `offset` at `iova`.
    pub fn map_backing(
        &self,
        iova: Iova,
        backing: &Arc<Backing>,
        offset: u64,
        size: u64,
        prot: Prot,
    ) -> Result<()> {
        let host = self.backing_host(backing, offset, size)?;
        self.insert_one(iova, size, prot, Memory::Local(host))
    }

    /// Type1's checks of a new mapping of `[iova, iova + size)` with `prot`, in type1's order,
    /// without making it: EINVAL for size 0, a misaligned or wrapping range or no access;
    /// EEXIST where it overlaps a mapping; ENOSPC past [`DmaConfig::max_mappings`]; EINVAL
    /// outside the allowed ranges. For a caller that must set up the memory before it maps it
    /// (a vfio-user server mapping a client's file): a map that type1 would refuse for its
    /// range is refused before that, and with type1's errno. The map checks again.
    pub fn check_map(&self, iova: Iova, size: u64, prot: Prot) -> Result<()> {
        let range = self.check_new_range(iova, size, prot)?;
        let count = {
            let snap = self.shared.current.load();
            if let Err(pos) = snap.map.place(range.start().0, range.last().0) {
                let (start, last, _) = snap.map.bounds(pos);
                return Err(overlap(range, start, last));
            }
            snap.map.len() as u64 + 1
        };
        let limit = self.shared.config.max_mappings;
        if count > limit as u64 {
            return Err(too_many(count, limit.into()));
        }
        self.check_allowed(range)
    }

    /// Maps `[iova, iova + size)` to memory of a peer that this process cannot address: a
    /// vfio-user client's map without a file descriptor (memory QEMU does not share, such as
    /// ROM or private guest RAM). The mapping takes part in everything else — type1's checks
    /// and errnos, the count limit, unmap, dirty logging — but only
    /// [`DmaSpace::dma_read_via`] / [`DmaSpace::dma_write_via`] reach its bytes, through the
    /// transport the caller passes them; translation, `pin_pages` and plain `dma_read` /
    /// `dma_write` fail with EFAULT ([`Error::Remote`]), as libvfio-user's `vfu_sgl_get` does.
    pub fn map_remote(&self, iova: Iova, size: u64, prot: Prot) -> Result<()> {
        self.insert_one(iova, size, prot, Memory::Remote)
    }

    /// Makes one mapping of `memory` at `[iova, iova + size)` after type1's checks.
    fn insert_one(&self, iova: Iova, size: u64, prot: Prot, memory: Memory) -> Result<()> {
        let range = self.check_new_range(iova, size, prot)?;
        let mut new = [NewMapping {
            iova: range,
            memory,
        }];
        self.insert(range, prot, &mut new)
    }

    /// Maps the guest range `[gpa, gpa + size)` of `slots` at `iova`: one mapping per slot the
    /// range crosses, all or nothing. EFAULT if part of the range is in no slot, or a slot is
    /// read-only and `prot` asks for WRITE.
    pub fn map_guest(
        &self,
        iova: Iova,
        slots: &Snapshot,
        gpa: Gpa,
        size: u64,
        prot: Prot,
    ) -> Result<()> {
        let range = self.check_new_range(iova, size, prot)?;
        let mut new = Vec::new();
        for (slot, piece_gpa, len) in slots.pieces(gpa, size)? {
            if prot.contains(Prot::WRITE) && slot.flags().contains(SlotFlags::READ_ONLY) {
                return Err(Error::ReadOnly {
                    what: format!("slot {}", slot.id()),
                    addr: piece_gpa.0,
                    start: gpa.0,
                    len: size,
                });
            }
            let in_slot = piece_gpa.0 - slot.range().start().0;
            let host = self.backing_host(slot.backing(), slot.offset() + in_slot, len)?;
            let start = Iova(range.start().0 + (piece_gpa.0 - gpa.0));
            new.push(NewMapping {
                iova: Range::new("dma mapping", start, len)?,
                memory: Memory::Local(host),
            });
        }
        self.insert(range, prot, &mut new)
    }

    /// Maps `size` bytes of host memory at `hva` that the caller manages itself.
    ///
    /// # Safety
    /// `hva .. hva + size` must stay mapped readable (and writable, for WRITE) until this
    /// mapping is unmapped or its vaddr invalidated, and until every snapshot, cursor and copy
    /// that saw it has finished: memvisor will read and write it on devices' behalf.
    pub unsafe fn map_raw(&self, iova: Iova, hva: Hva, size: u64, prot: Prot) -> Result<()> {
        let host = self.raw_host(hva, size)?;
        self.insert_one(iova, size, prot, Memory::Local(host))
    }

    /// Unmaps every mapping inside `[iova, iova + size)` and returns the bytes unmapped (0 if
    /// there were none). EINVAL, nothing unmapped, if the range cuts a mapping at either end.
    /// The range is closed to new pins, translations and copies at once; the call returns once
    /// copies in flight there have ended and devices holding pins there have released them
    /// (the unmap notifiers ask them to, again and again). EBUSY, nothing unmapped, if a device
    /// keeps its pins past [`DmaConfig::unpin_wait`]: stop that device and try again. Pins the
    /// space holds itself (Eager mode) are dropped with the mappings.
    pub fn unmap(&self, iova: Iova, size: u64) -> Result<u64> {
        let range = self.check_range(iova, size)?;
        self.remove_mappings(range.start().0, range.last().0)
    }

    /// Unmaps everything, as [`DmaSpace::unmap`]; returns the bytes unmapped. EBUSY, nothing
    /// unmapped, if devices keep pins past [`DmaConfig::unpin_wait`].
    pub fn unmap_all(&self) -> Result<u64> {
        self.remove_mappings(0, u64::MAX)
    }

    fn remove_mappings(&self, first: u64, last: u64) -> Result<u64> {
        self.remove_mappings_with(first, last, |_| Ok(()), |_, _| {})
    }

    fn check_range(&self, iova: Iova, size: u64) -> Result<Range<Iova>> {
        let page = self.shared.min_page;
        let range = Range::new("dma range", iova, size)?;
        for (what, value) in [("iova", iova.0), ("size", size)] {
            // A power of two: a mask, not a division (tens of cycles on an IOTLB's path).
            if value & (page - 1) != 0 {
                return Err(Error::Misaligned {
                    what,
                    value,
                    align: page,
                });
            }
        }
        Ok(range)
    }

    fn check_new_range(&self, iova: Iova, size: u64, prot: Prot) -> Result<Range<Iova>> {
        if prot == Prot::default() {
            return Err(Error::NoAccess {
                what: format!("mapping at iova {iova}"),
            });
        }
        self.check_range(iova, size)
    }

    /// EINVAL unless `range` lies inside one of the allowed IOVA ranges (type1's
    /// `vfio_iommu_iova_dma_valid`).
    fn check_allowed(&self, range: Range<Iova>) -> Result<()> {
        if !self
            .shared
            .allowed
            .iter()
            .any(|&(lo, hi)| lo <= range.start() && range.last() <= hi)
        {
            return Err(Error::OutsideAllowed {
                range,
                allowed: self.shared.allowed.clone(),
            });
        }
        Ok(())
    }

    fn backing_host(&self, backing: &Arc<Backing>, offset: u64, size: u64) -> Result<Host> {
        match offset.checked_add(size) {
            Some(end) if end <= backing.size() => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: "dma mapping window in backing",
                    start: offset,
                    len: size,
                    limit: backing.size(),
                });
            }
        }
        let mut host = self.raw_host(Hva(backing.hva().0 + offset), size)?;
        host.owner = Some(backing.clone());
        Ok(host)
    }

    fn raw_host(&self, hva: Hva, size: u64) -> Result<Host> {
        if hva.0 & (self.shared.min_page - 1) != 0 {
            return Err(Error::Misaligned {
                what: "host address",
                value: hva.0,
                align: self.shared.min_page,
            });
        }
        Range::new("host range", hva, size)?;
        Ok(Host { hva, owner: None })
    }

    /// Checks and inserts new mappings, the pieces of `range`, in one publish. The checks run
    /// in type1's order (`vfio_dma_do_map`): overlap (EEXIST), then the mapping count (ENOSPC),
    /// then the allowed IOVA ranges (EINVAL).
    /// Each new mapping's memory is moved into its record: its owner is not counted twice.
    fn insert(&self, range: Range<Iova>, prot: Prot, new: &mut [NewMapping]) -> Result<()> {
        let writer = self.settled_writer()?;
        self.insert_with(writer, range, prot, new, OnOverlap::Fail)
            .map(|_| ())
    }

    /// [`DmaSpace::insert`] under `writer` (settled). Returns whether it inserted: with
    /// [`OnOverlap::Report`], a new mapping that overlaps one already there is no error but
    /// `false`, nothing changed (an IOTLB update over an entry, which removes it first).
    fn insert_with(
        &self,
        writer: std::sync::MutexGuard<'_, Writer>,
        range: Range<Iova>,
        prot: Prot,
        new: &mut [NewMapping],
        on_overlap: OnOverlap,
    ) -> Result<bool> {
        let limit = self.shared.config.max_mappings;
        self.change_with(writer, |map, writer| {
            // The search that finds an overlap also finds where a lone new mapping goes (the
            // pieces of a longer one go in one by one, each moving the others' places).
            let mut place = index::Place::UNKNOWN;
            for n in new.iter() {
                let (first, last) = (n.iova.start().0, n.iova.last().0);
                match (map.place(first, last), on_overlap) {
                    (Ok(p), _) => place = p,
                    (Err(_), OnOverlap::Report) => return Ok((false, false)),
                    (Err(pos), OnOverlap::Fail) => {
                        let (start, last, _) = map.bounds(pos);
                        return Err(overlap(n.iova, start, last));
                    }
                }
            }
            if new.len() != 1 {
                place = index::Place::UNKNOWN;
            }
            let count = map.len() as u64 + new.len() as u64;
            if count > limit as u64 {
                return Err(too_many(count, limit.into()));
            }
            self.check_allowed(range)?;
            let mut made = std::mem::take(&mut writer.made);
            made.clear();
            for n in new.iter_mut() {
                let dirty = match writer.tracking {
                    true => Some(self.new_bitmap(n.iova)?),
                    false => None,
                };
                let id = writer.next_id;
                writer.next_id += 1;
                let record = Mapping {
                    id,
                    iova: n.iova,
                    prot,
                    memory: std::mem::replace(&mut n.memory, Memory::Invalidated),
                    dirty,
                };
                made.push(match writer.free.pop() {
                    Some(mut free) => {
                        *Arc::get_mut(&mut free).expect("a free record is the writer's alone") =
                            record;
                        free
                    }
                    None => Arc::new(record),
                });
            }
            if writer.mode == PinMode::Eager {
                let made = made.iter().map(|m| &**m);
                let pinned = self.pin_all(made.filter(|m| m.memory.host().is_some()))?;
                writer.eager.extend(pinned);
            }
            for m in made.drain(..) {
                map.insert_at(place, m);
            }
            writer.made = made;
            Ok((true, true))
        })
    }

    /// A clear dirty bitmap for a mapping over `iova`; ENOMEM if its memory cannot be had.
    fn new_bitmap(&self, iova: Range<Iova>) -> Result<Arc<DirtyBitmap>> {
        let pages = dirty_pages(iova, self.shared.min_page);
        if pages > DIRTY_BITMAP_PAGES_MAX {
            // type1's vfio_dma_bitmap_alloc refuses such a mapping the same way.
            return Err(Error::Invalid(format!(
                "a mapping of {pages:#x} pages is too large to track: a dirty bitmap holds at \
                 most {DIRTY_BITMAP_PAGES_MAX:#x} pages"
            )));
        }
        let bitmap = DirtyBitmap::try_new(pages);
        #[cfg(feature = "test-hooks")]
        let bitmap = bitmap.map(|b| b.with_faults(&self.shared.config.faults));
        bitmap.map(Arc::new).ok_or(Error::OutOfMemory {
            what: "dirty bitmap",
            bytes: pages.div_ceil(8),
        })
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        lock(&self.shared.writer)
    }

    /// Keeps `record`, a removed mapping's, for reuse if nothing else holds it and the writer
    /// has room; emptied first, so it keeps no memory mapped and no bitmap.
    fn keep_record(writer: &mut Writer, mut record: Arc<Mapping>) {
        if writer.free.len() >= FREE_RECORDS {
            return;
        }
        if let Some(m) = Arc::get_mut(&mut record) {
            m.memory = Memory::Remote;
            m.dirty = None;
            writer.free.push(record);
        }
    }
}

impl Drop for Shared {
    /// The last handle is gone: give back every pin the space and its devices still hold, so
    /// nothing stays locked or charged.
    fn drop(&mut self) {
        let writer = self.writer.get_mut().unwrap_or_else(|e| e.into_inner());
        let eager = std::mem::take(&mut writer.eager);
        let device_pins = std::mem::take(&mut writer.device_pins);
        self.drop_eager(eager);
        self.drop_device_pins(&device_pins);
    }
}

/// The mappings lying in `[first, last]`, as (start, mapping); EINVAL if the range cuts one at
/// either end.
fn whole_mappings(map: &Index, first: u64, last: u64) -> Result<Vec<(u64, Arc<Mapping>)>> {
    let mut out = Vec::new();
    whole_mappings_into(map, first, last, &mut out)?;
    Ok(out)
}

/// [`whole_mappings`], appended to `out`.
fn whole_mappings_into(
    map: &Index,
    first: u64,
    last: u64,
    out: &mut Vec<(u64, Arc<Mapping>)>,
) -> Result<()> {
    let mut pos = map.first_ending_at_or_after(first);
    while let Some(p) = pos {
        let (start, end, _, m) = map.get(p);
        if start > last {
            break;
        }
        if start < first || end > last {
            return Err(Error::SplitsMapping {
                first,
                last,
                start,
                end,
            });
        }
        out.push((start, m.clone()));
        pos = map.next(p);
    }
    Ok(())
}

/// The aperture `[lo, hi]` minus the reserved ranges, as sorted disjoint inclusive pairs.
fn allowed_ranges(lo: Iova, hi: Iova, reserved: &[Range<Iova>]) -> Vec<(Iova, Iova)> {
    let mut holes: Vec<(u64, u64)> = reserved.iter().map(|r| (r.start().0, r.last().0)).collect();
    holes.sort_unstable();
    let mut out = Vec::new();
    let mut next = Some(lo.0);
    for (start, last) in holes {
        let Some(from) = next else { break };
        if last < from || start > hi.0 {
            continue;
        }
        if start > from {
            out.push((Iova(from), Iova(start - 1)));
        }
        next = last.checked_add(1);
    }
    if let Some(from) = next.filter(|&f| f <= hi.0) {
        out.push((Iova(from), hi));
    }
    out
}

/// EEXIST: a new mapping `new` overlaps the mapping `[start, last]`.
fn overlap(new: Range<Iova>, start: u64, last: u64) -> Error {
    Error::Overlap {
        what: "dma mapping",
        start: new.start().0,
        last: new.last().0,
        existing: "mapping".into(),
        existing_start: start,
        existing_last: last,
    }
}

/// ENOSPC: `count` mappings would pass the space's `limit`.
fn too_many(count: u64, limit: u64) -> Error {
    Error::NoSpace {
        what: "dma mappings",
        count,
        limit,
        hint: "unmap some or raise DmaConfig::max_mappings",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allowed_ranges_cut_holes() {
        let r = |s: u64, len: u64| Range::new("t", Iova(s), len).unwrap();
        let p = |a: u64, b: u64| (Iova(a), Iova(b));
        let got = allowed_ranges(
            Iova(0),
            Iova(0xffff),
            &[r(0x8000, 0x9000), r(0x1000, 0x1000)],
        );
        assert_eq!(got, vec![p(0, 0xfff), p(0x2000, 0x7fff)]);
        let got = allowed_ranges(Iova(0x1000), Iova(0x4fff), &[r(0, 0x2000)]);
        assert_eq!(got, vec![p(0x2000, 0x4fff)]);
        let all = allowed_ranges(Iova(0), Iova(u64::MAX), &[]);
        assert_eq!(all, vec![p(0, u64::MAX)]);
        let top = allowed_ranges(Iova(0), Iova(u64::MAX), &[r(u64::MAX - 0xfff, 0x1000)]);
        assert_eq!(top, vec![p(0, u64::MAX - 0x1000)]);
        assert!(allowed_ranges(Iova(0), Iova(0xfff), &[r(0, 0x1000)]).is_empty());
    }
}
