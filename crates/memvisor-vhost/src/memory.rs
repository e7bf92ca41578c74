//! The frontend's guest memory, as memvisor holds it.
//!
//! A frontend describes guest RAM as regions: a guest physical range, the file descriptor and
//! offset it lives at, and the address the frontend itself has it mapped at (its "user
//! address"; vring addresses arrive in those). [`FrontendMemory`] turns each region into
//! memvisor objects and nothing else:
//!
//! * a [`Backing`] for the descriptor, through the process's [`SharedMappings`] — so two devices
//!   of one VMM share one mapping, and one device's pins hold against another's discards. The
//!   process state (those mappings and the pin registry) is handed in as a [`ProcessState`]
//!   by whoever runs the back ends; this module never reaches for a global;
//! * a slot in a [`SlotTable`] (GPA -> host address), which a device model of guest physical
//!   memory (the balloon's) reads through the vm-memory adapter ([`SlotSpace`]);
//! * a mapping in a [`DmaSpace`] at IOVA = GPA, through which devices translate, copy and pin
//!   their buffers and read their rings. Without an IOMMU the device's addresses are guest
//!   physical, so the space is the identity over the slots; under an IOMMU the same space holds
//!   the IOTLB's entries instead, and device code does not change.
//!
//! **Rings** are read at device addresses: the queue is handed the space's vm-memory view
//! ([`DmaSpace::memory`]), so descriptor tables, available and used rings and indirect
//! tables are all translated like any buffer. The region list itself is kept only to turn user
//! addresses into guest physical ones (ring addresses without an IOMMU, IOTLB updates).
//!
//! **Dirty logging** (migration). While logging, the device space tracks dirty pages (device
//! writes through translations, `dma_write`, the used ring, and pins — pinned pages stay dirty)
//! and every slot logs writes made through the slot table (a device model of guest physical
//! memory). [`FrontendMemory::drain_dirty`] reads and clears both and ORs them into the
//! frontend's shared log at guest physical pages: memvisor's tracking is the one source of
//! truth and the vhost-user log its view. A new memory table keeps logging on. An IOTLB entry's
//! pages are logged at the guest physical pages behind it, found by the host address in a
//! sorted index of the slots.
//!
//! **Behind a vIOMMU** (`VIRTIO_F_IOMMU_PLATFORM`), the device's addresses are IOVAs the guest's
//! IOMMU hands out, and the device space holds the frontend's IOTLB instead of the identity:
//! [`FrontendMemory::iotlb_update`] maps an IOVA range to the memory behind the frontend's user
//! address, found in the region table (the region's slot, its backing and the offset in it),
//! and removes whatever the range overlapped in the same step ([`DmaSpace::iotlb_map`]),
//! [`FrontendMemory::iotlb_invalidate`] removes any range ([`DmaSpace::invalidate_range`], which
//! cuts entries at its edges — IOTLB semantics, not type1's whole-mapping unmap). A new memory
//! table empties the IOTLB: entries are a cache the frontend refills on a miss. For the same
//! reason a full IOTLB never refuses an update: the device space holds at most
//! `DmaConfig::max_mappings` entries (VFIO's 65,535), and an update that finds it full first
//! retires the oldest entries the space holds ([`DmaSpace::oldest`]), a 64th of them at once
//! so that the search is paid once per many updates — invalidations like the guest's own, so
//! in-flight copies and pins are waited for and dirty bits kept — as Linux's vhost retires its
//! oldest entry at `max_iotlb_entries`. A frontend whose guest maps more than that at once
//! gets misses for the retired ranges again, never an error. The age is the space's own (the
//! order it made its mappings in): this module keeps no record of the updates.
//!
//! **Regions are byte-granular** in the specification (libblkio hands over its rings as a
//! region of 0x3b10 bytes in a memfd of exactly that size); memvisor maps, slots and translates
//! whole 4 KiB pages. Each region is held as sent (for `REM_MEM_REG` and user addresses) and as
//! its *cover*: the whole pages under it, mapped from the file. The cover's last page may reach
//! past the file's end, as libvhost-user's `mmap(size + offset)` does: the kernel maps that page
//! and its bytes past the end read as zeros (only a page wholly past the end would fault).
//!
//! **Checks.** A region is refused (EINVAL, state unchanged) if it is empty, wraps, overlaps
//! another in guest physical or user address space, shares a page with another (its cover
//! would overlap theirs), starts at a guest address and file offset that differ within a page
//! (no page mapping could serve it), or if its descriptor fails [`Backing::from_fd`]'s checks
//! (not a regular file, a page wholly past the file's end). A `SET_MEM_TABLE` is applied whole
//! or not at all.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use vm_memory::GuestAddressSpace;

use memvisor::{
    Backing, DmaConfig, DmaSpace, Gpa, Iova, PinRegistry, Prot, SharedLog, SharedMappings,
    SlotFlags, SlotSpace, SlotSpec, SlotTable,
};

use crate::error::{Error, Result};
use crate::proto::Region;

/// Regions a frontend may add with `ADD_MEM_REG` (answered to `GET_MAX_MEM_SLOTS`).
pub const MAX_REGIONS: usize = 32;

/// One region as received, the whole pages under it, and the slot they became, with the
/// slot's memory: an IOTLB update maps from it without a look at the slot table (the slot
/// starts at the cover's first page, offset 0 in this memory, and is never read-only).
#[derive(Clone, Debug)]
struct Held {
    region: Region,
    cover: Region,
    slot: u32,
    backing: Arc<Backing>,
}

/// The frontend's memory: regions, slots, and the device address space over them.
pub struct FrontendMemory {
    held: Vec<Held>,
    slots: SlotTable,
    space: SlotSpace,
    dma: Arc<DmaSpace>,
    logging: bool,
    iotlb: bool,
    /// The process state this memory maps through (and, in a test-hooks build, the faults it
    /// injects).
    state: ProcessState,
}

/// The share of a full IOTLB's entries retired at once, oldest first: a 64th (1,023 of
/// VFIO's 65,535), so that the pass over every entry that finds them is paid once per that
/// many updates, and the guest loses 1.6% of its translations to misses.
const RETIRE_SHARE: usize = 64;

impl std::fmt::Debug for FrontendMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrontendMemory")
            .field("regions", &self.held.len())
            .finish()
    }
}

/// What the back ends of one process share, made once by the server and handed to each back
/// end: the mappings of the descriptors frontends send ([`SharedMappings`]: one mapping per
/// file range, so pins made through one device hold against another's discards) and the pin
/// registry every device space pins through. A server passes
/// `ProcessState::new(SharedMappings::global(), PinRegistry::global())`; a test may pass tables
/// of its own.
#[derive(Clone, Debug)]
pub struct ProcessState {
    /// The process's mappings of received descriptors.
    pub mappings: SharedMappings,
    /// The pin registry the back ends' device spaces pin through.
    pub registry: Arc<PinRegistry>,
    /// TEST ONLY (feature `test-hooks`): the faults the server parsed once
    /// ([`Faults::from_env`](memvisor::faults::Faults::from_env)), given to every back end, slot
    /// table and device space built over this state, and read by the devices
    /// ([`FrontendMemory::faults`]).
    #[cfg(feature = "test-hooks")]
    pub faults: memvisor::faults::Faults,
}

impl ProcessState {
    /// The state of a process whose back ends map through `mappings` and pin through
    /// `registry`.
    pub fn new(mappings: SharedMappings, registry: Arc<PinRegistry>) -> ProcessState {
        ProcessState {
            mappings,
            registry,
            #[cfg(feature = "test-hooks")]
            faults: memvisor::faults::Faults::default(),
        }
    }

    /// TEST ONLY (feature `test-hooks`): this state with `faults` injected into everything
    /// built over it.
    #[cfg(feature = "test-hooks")]
    pub fn with_faults(self, faults: memvisor::faults::Faults) -> ProcessState {
        ProcessState { faults, ..self }
    }

    /// The configuration of a new device space over this state: its pin registry (and, in a
    /// test-hooks build, its faults).
    fn dma_config(&self) -> DmaConfig {
        DmaConfig {
            registry: Some(self.registry.clone()),
            #[cfg(feature = "test-hooks")]
            faults: self.faults,
            ..DmaConfig::default()
        }
    }
}

impl FrontendMemory {
    /// The pin registry this memory's device spaces pin through (the process state's): what
    /// a discard of this memory must ask, so that no page a device holds is given back.
    pub(crate) fn registry(&self) -> &Arc<PinRegistry> {
        &self.state.registry
    }

    /// No memory yet; descriptors will be mapped through `state`'s mappings, and the device
    /// space pins through its registry.
    pub fn new(state: &ProcessState) -> Result<Self> {
        #[cfg(feature = "test-hooks")]
        let slots = SlotTable::with_faults(MAX_REGIONS as u32, state.faults);
        #[cfg(not(feature = "test-hooks"))]
        let slots = SlotTable::with_max_slots(MAX_REGIONS as u32);
        Ok(FrontendMemory {
            held: Vec::new(),
            state: state.clone(),
            space: SlotSpace::new(slots.clone()),
            slots,
            dma: Arc::new(DmaSpace::new(state.dma_config())?),
            logging: false,
            iotlb: false,
        })
    }

    /// TEST ONLY (feature `test-hooks`): the faults the back end injects, for its devices.
    #[cfg(feature = "test-hooks")]
    pub fn faults(&self) -> &memvisor::faults::Faults {
        &self.state.faults
    }

    /// Whether the device space is the frontend's IOTLB (else the identity over guest memory).
    pub fn is_iotlb(&self) -> bool {
        self.iotlb
    }

    /// Switches the device space between the identity over guest memory and an IOTLB (empty
    /// until the frontend sends updates).
    pub fn set_iotlb(&mut self, on: bool) -> Result<()> {
        if on == self.iotlb {
            return Ok(());
        }
        let dma = self.fresh_space(on)?;
        self.iotlb = on;
        self.dma = dma;
        Ok(())
    }

    /// A new device space for the held regions: empty for an IOTLB, else the identity.
    fn fresh_space(&self, iotlb: bool) -> Result<Arc<DmaSpace>> {
        let dma = Arc::new(DmaSpace::new(self.state.dma_config())?);
        if self.logging {
            dma.start_dirty_tracking()?;
        }
        if !iotlb {
            let snap = self.slots.snapshot();
            for h in &self.held {
                let r = &h.cover;
                dma.map_guest(Iova(r.gpa), &snap, Gpa(r.gpa), r.size, Prot::RW)?;
            }
        }
        Ok(dma)
    }

    /// `IOTLB_MSG` UPDATE: IOVAs `[iova, iova + size)` reach the memory the frontend has at
    /// `uaddr`, with `prot`. EINVAL if the range is not whole pages or the memory is not inside
    /// one region.
    pub fn iotlb_update(&mut self, iova: u64, size: u64, uaddr: u64, prot: Prot) -> Result<()> {
        if !self.iotlb {
            return Err(Error::NotNegotiated {
                request: "IOTLB_MSG update",
                feature: "VIRTIO_F_IOMMU_PLATFORM",
            });
        }
        if iova % PAGE != 0 || size % PAGE != 0 || uaddr % PAGE != 0 {
            return Err(Error::BadIotlb(format!(
                "IOTLB update iova {iova:#x} size {size:#x} user address {uaddr:#x}: not whole 4 KiB pages"
            )));
        }
        let i = self.region_index(uaddr, size, "IOTLB update")?;
        let h = &self.held[i];
        // The region's slot maps its cover from offset 0 of the region's memory (`Held`).
        let offset = h.region.gpa + (uaddr - h.region.user_addr) - h.cover.gpa;
        loop {
            let backing = &self.held[i].backing;
            match (self.dma).iotlb_map(Iova(iova), backing, offset, size, prot) {
                Ok(()) => break,
                Err(memvisor::Error::NoSpace { .. }) => self.retire_oldest()?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Makes room in a full IOTLB: invalidates its oldest entries, a [`RETIRE_SHARE`]th of
    /// them.
    fn retire_oldest(&mut self) -> Result<()> {
        let count = (self.dma.len() / RETIRE_SHARE).max(1);
        let oldest = self.dma.oldest(count);
        if oldest.is_empty() {
            // Nothing to retire: the update alone needs more entries than the space has.
            return Err(Error::BadIotlb(format!(
                "IOTLB update needs more than the {} entries an IOTLB holds",
                DmaConfig::default().max_mappings
            )));
        }
        for range in oldest {
            self.dma.invalidate_range(range.start(), range.len())?;
        }
        Ok(())
    }

    /// `IOTLB_MSG` INVALIDATE: removes every translation in `[iova, iova + size)` (any range;
    /// a size reaching past 2^64 means "to the end"); returns the bytes removed.
    pub fn iotlb_invalidate(&mut self, iova: u64, size: u64) -> Result<u64> {
        if size == 0 {
            return Ok(0);
        }
        let first = iova & !(PAGE - 1);
        let last = iova.saturating_add(size - 1) | (PAGE - 1);
        // [first, last] may be the whole 64-bit space, whose size a u64 cannot hold: halves.
        let mut removed = 0;
        let mid = 1u64 << 63;
        for (a, b) in [(first, last.min(mid - 1)), (first.max(mid), last)] {
            if a <= b {
                removed += self.dma.invalidate_range(Iova(a), b - a + 1)?;
            }
        }
        Ok(removed)
    }

    /// Where each slot's memory is in this process, sorted by host address, for turning the
    /// host address behind an IOTLB entry back into guest physical pages (the dirty log's
    /// unit): (host address, length, guest physical address).
    fn host_index(&self) -> Vec<(u64, u64, u64)> {
        let snap = self.slots.snapshot();
        let mut v: Vec<(u64, u64, u64)> = snap
            .slots()
            .map(|s| (s.hva().0, s.range().len(), s.range().start().0))
            .collect();
        v.sort_unstable();
        v
    }

    /// Starts dirty logging (`VHOST_F_LOG_ALL` acked).
    pub fn start_logging(&mut self) -> Result<()> {
        self.dma.start_dirty_tracking()?;
        self.logging = true;
        self.set_slot_logging(true)
    }

    /// Stops dirty logging; what was logged and not drained is dropped.
    pub fn stop_logging(&mut self) -> Result<()> {
        self.logging = false;
        self.dma.stop_dirty_tracking();
        self.set_slot_logging(false)
    }

    /// Whether dirty logging is on.
    pub fn is_logging(&self) -> bool {
        self.logging
    }

    fn set_slot_logging(&self, on: bool) -> Result<()> {
        let flags = if on {
            SlotFlags::LOG_DIRTY
        } else {
            SlotFlags::NONE
        };
        let ids: Vec<u32> = self.held.iter().map(|h| h.slot).collect();
        self.slots.update(|edit| {
            for id in &ids {
                edit.set_flags(*id, flags)?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// Reads and clears everything written since the last drain — device writes and pins in
    /// the device space, ring writes in the slots — and ORs it into `log` at guest physical
    /// pages. Returns the pages marked (a page written both ways counts twice). Pages past the
    /// log's end are dropped with a warning: the frontend sized its log too small. Costs
    /// O(dirty words + regions + IOTLB entries), not O(guest size): every bitmap is drained
    /// through its summary levels and only its non-zero words reach the log.
    pub fn drain_dirty(&self, log: &SharedLog) -> Result<u64> {
        if !self.logging {
            return Ok(0);
        }
        let mut marked = 0;
        let mut outside = 0;
        let mut add = |(m, o): (u64, u64)| {
            marked += m;
            outside += o;
        };
        if self.iotlb {
            // Device writes are tracked per IOTLB entry (IOVA pages): log them at the guest
            // physical pages behind each entry.
            let hosts = self.host_index();
            let to_gpa = |hva: u64| {
                let i = hosts
                    .partition_point(|&(h, _, _)| h <= hva)
                    .checked_sub(1)?;
                let (h, len, gpa) = hosts[i];
                (hva - h < len).then(|| gpa + (hva - h))
            };
            for m in self.dma.mappings() {
                let (Some(hva), start) = (m.hva(), m.iova().start()) else {
                    continue;
                };
                let gpa = to_gpa(hva.0);
                if gpa.is_none() {
                    log::warn!("IOTLB entry at iova {start} is in no guest memory");
                }
                // Drained even when it is in no guest memory: the bits are cleared either way.
                self.dma
                    .drain_dirty(start, m.iova().len(), PAGE, |page, bits| {
                        if let Some(gpa) = gpa {
                            add(log.or_words(gpa / PAGE + page, &[bits]));
                        }
                    })?;
            }
        }
        for h in &self.held {
            let first = h.cover.gpa / PAGE;
            if !self.iotlb {
                self.dma
                    .drain_dirty(Iova(h.cover.gpa), h.cover.size, PAGE, |page, bits| {
                        add(log.or_words(first + page, &[bits]))
                    })?;
            }
            self.slots.drain_dirty_log(h.slot, |page, bits| {
                add(log.or_words(first + page, &[bits]))
            })?;
        }
        if outside > 0 {
            log::warn!(
                "dirty log covers {} pages; {outside} dirty pages past its end were not logged",
                log.pages()
            );
        }
        Ok(marked)
    }

    /// Guest memory as vm-memory sees it (for virtqueues).
    pub fn space(&self) -> &SlotSpace {
        &self.space
    }

    /// The slot table (GPA -> host).
    pub fn slots(&self) -> &SlotTable {
        &self.slots
    }

    /// The device address space: IOVA = GPA over every region.
    pub fn dma(&self) -> &Arc<DmaSpace> {
        &self.dma
    }

    /// Regions held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether no region is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// The regions held, as the frontend described them.
    pub fn regions(&self) -> Vec<Region> {
        self.held.iter().map(|h| h.region).collect()
    }

    /// `SET_MEM_TABLE`: replaces every region, all or nothing.
    pub fn set_table(&mut self, regions: &[Region], fds: Vec<OwnedFd>) -> Result<()> {
        if fds.len() != regions.len() {
            return Err(Error::BadRegion(format!(
                "SET_MEM_TABLE: {} regions but {} file descriptors",
                regions.len(),
                fds.len()
            )));
        }
        let mut places: Vec<(Region, Region)> = Vec::with_capacity(regions.len());
        for r in regions {
            let p = (*r, page_cover(r)?);
            if let Some(o) = places.iter().find(|o| overlaps(o, &p)) {
                return Err(overlap_error(r, &o.0));
            }
            places.push(p);
        }
        let covers: Vec<Region> = places.iter().map(|p| p.1).collect();
        let backings = map_all(&self.state.mappings, &covers, fds)?;
        let held: Vec<Held> = (places.into_iter().zip(backings).enumerate())
            .map(|(i, ((region, cover), backing))| Held {
                region,
                cover,
                slot: i as u32,
                backing,
            })
            .collect();
        let old: Vec<u32> = self.held.iter().map(|h| h.slot).collect();
        let flags = self.slot_flags();
        self.slots.update(|edit| {
            for id in &old {
                edit.remove(*id)?;
            }
            for h in &held {
                let spec = SlotSpec::new(h.slot, Gpa(h.cover.gpa), h.backing.clone());
                edit.insert(spec.flags(flags))?;
            }
            Ok(())
        })?;
        // A fresh device space over the new slots (an IOTLB starts empty); swapped in only when
        // complete.
        let previous = std::mem::replace(&mut self.held, held.clone());
        let dma = match self.fresh_space(self.iotlb) {
            Ok(d) => d,
            Err(e) => {
                self.held = previous;
                // Put the old slots back: the frontend's previous table stays in force.
                let _ = self.restore(&held);
                return Err(e);
            }
        };
        self.dma = dma;
        self.forget_old_views();
        Ok(())
    }

    fn slot_flags(&self) -> SlotFlags {
        if self.logging {
            SlotFlags::LOG_DIRTY
        } else {
            SlotFlags::NONE
        }
    }

    /// Puts back the held regions after a failed table change that had replaced them with
    /// `new` in the slot table.
    fn restore(&self, new: &[Held]) -> Result<()> {
        let old: Vec<(u32, Gpa, Arc<Backing>)> = {
            let snap = self.slots.snapshot();
            self.held
                .iter()
                .filter_map(|h| {
                    snap.slot(h.slot)
                        .map(|s| (h.slot, Gpa(h.cover.gpa), s.backing().clone()))
                })
                .collect()
        };
        self.slots.update(|edit| {
            for h in new {
                let _ = edit.remove(h.slot);
            }
            for (id, gpa, b) in &old {
                edit.insert(SlotSpec::new(*id, *gpa, b.clone()))?;
            }
            Ok(())
        })?;
        Ok(())
    }

    /// `ADD_MEM_REG`: one more region.
    pub fn add(&mut self, region: Region, fd: OwnedFd) -> Result<()> {
        let cover = page_cover(&region)?;
        if let Some(o) =
            (self.held.iter()).find(|h| overlaps(&(h.region, h.cover), &(region, cover)))
        {
            return Err(overlap_error(&region, &o.region));
        }
        if self.held.len() >= MAX_REGIONS {
            return Err(Error::BadRegion(format!(
                "ADD_MEM_REG: already {MAX_REGIONS} regions, the most this back end takes"
            )));
        }
        let slot = (0..MAX_REGIONS as u32)
            .find(|id| self.held.iter().all(|h| h.slot != *id))
            .expect("fewer regions than slots");
        let backing = map_all(&self.state.mappings, &[cover], vec![fd])?.remove(0);
        let spec = SlotSpec::new(slot, Gpa(cover.gpa), backing.clone());
        self.slots.insert(spec.flags(self.slot_flags()))?;
        let snap = self.slots.snapshot();
        if !self.iotlb {
            if let Err(e) =
                self.dma
                    .map_guest(Iova(cover.gpa), &snap, Gpa(cover.gpa), cover.size, Prot::RW)
            {
                let _ = self.slots.remove(slot);
                return Err(e.into());
            }
        }
        self.held.push(Held {
            region,
            cover,
            slot,
            backing,
        });
        Ok(())
    }

    /// `REM_MEM_REG`: removes the region with this guest address, size and user address.
    pub fn remove(&mut self, region: Region) -> Result<()> {
        let Some(i) = self.held.iter().position(|h| {
            h.region.gpa == region.gpa
                && h.region.size == region.size
                && h.region.user_addr == region.user_addr
        }) else {
            return Err(Error::BadRegion(format!(
                "REM_MEM_REG: no region at guest {:#x} size {:#x} user address {:#x}",
                region.gpa, region.size, region.user_addr
            )));
        };
        if self.iotlb {
            // Entries into the region go with it; the frontend refills what it still maps.
            self.dma.unmap_all()?;
        } else {
            let cover = self.held[i].cover;
            self.dma.unmap(Iova(cover.gpa), cover.size)?;
        }
        let h = self.held.remove(i);
        self.slots.remove(h.slot)?;
        self.forget_old_views();
        Ok(())
    }

    /// Drops every region (reset, disconnect). Fails only if a device still holds pins.
    pub fn clear(&mut self) -> Result<()> {
        self.dma.unmap_all()?;
        let ids: Vec<u32> = self.held.iter().map(|h| h.slot).collect();
        self.slots.update(|edit| {
            for id in &ids {
                edit.remove(*id)?;
            }
            Ok(())
        })?;
        self.held.clear();
        self.forget_old_views();
        Ok(())
    }

    /// The vm-memory view caches the last snapshot it built until asked again; asking now lets
    /// removed regions' mappings go as soon as nothing else holds them.
    fn forget_old_views(&self) {
        drop(self.space.memory());
    }

    /// The guest physical address of `len` bytes at the frontend's user address `uaddr`; EFAULT
    /// ([`Error::Unmapped`]) if they are not inside one region.
    pub fn user_to_gpa(&self, uaddr: u64, len: u64, what: &str) -> Result<u64> {
        let h = self.region_of(uaddr, len, what)?;
        Ok(h.region.gpa + (uaddr - h.region.user_addr))
    }

    /// The region holding `len` bytes at the frontend's user address `uaddr`; EFAULT
    /// ([`Error::Unmapped`]) if they are not inside one region.
    fn region_of(&self, uaddr: u64, len: u64, what: &str) -> Result<&Held> {
        Ok(&self.held[self.region_index(uaddr, len, what)?])
    }

    /// [`FrontendMemory::region_of`], as the region's place in `held`.
    fn region_index(&self, uaddr: u64, len: u64, what: &str) -> Result<usize> {
        for (i, h) in self.held.iter().enumerate() {
            let r = &h.region;
            let off = uaddr.wrapping_sub(r.user_addr);
            if uaddr >= r.user_addr && off < r.size && len <= r.size - off {
                return Ok(i);
            }
        }
        Err(Error::Unmapped {
            what: what.to_string(),
            addr: uaddr,
            len,
        })
    }
}

/// The page size of guest physical memory and of the dirty log.
use memvisor::PAGE_4K as PAGE;

fn check_region(r: &Region) -> Result<()> {
    if r.size == 0 {
        return Err(Error::BadRegion(format!(
            "memory region at guest {:#x} has size 0",
            r.gpa
        )));
    }
    if r.gpa.checked_add(r.size).is_none() || r.user_addr.checked_add(r.size).is_none() {
        return Err(Error::BadRegion(format!(
            "memory region guest {:#x} user {:#x} size {:#x} wraps past 2^64",
            r.gpa, r.user_addr, r.size
        )));
    }
    Ok(())
}

/// The whole 4 KiB pages under a region, checked first by [`check_region`]: the guest address
/// and file offset rounded down to a page, the end rounded up. EINVAL if the guest address and
/// the file offset differ within a page (no page of the file could sit at a page of the guest) or
/// the rounded end passes 2^64.
fn page_cover(r: &Region) -> Result<Region> {
    check_region(r)?;
    let lead = r.gpa % PAGE;
    if r.mmap_offset % PAGE != lead {
        return Err(Error::BadRegion(format!(
            "memory region guest {:#x} at file offset {:#x}: the two differ within a 4 KiB page, \
             so no page of the file can be mapped at a page of the guest",
            r.gpa, r.mmap_offset
        )));
    }
    let size = (r.size + lead).checked_next_multiple_of(PAGE);
    let Some(size) = size.filter(|s| (r.gpa - lead).checked_add(*s).is_some()) else {
        return Err(Error::BadRegion(format!(
            "memory region guest {:#x} size {:#x}: its last page passes 2^64",
            r.gpa, r.size
        )));
    };
    Ok(Region {
        gpa: r.gpa - lead,
        size,
        // User addresses are turned into guest ones through the region as sent.
        user_addr: r.user_addr,
        mmap_offset: r.mmap_offset - lead,
    })
}

/// Whether two regions, each as (region, cover), overlap in guest physical or user address
/// space, or share a guest page (their covers overlap).
fn overlaps((a, a_cover): &(Region, Region), (b, b_cover): &(Region, Region)) -> bool {
    let cross = |x: u64, xs: u64, y: u64, ys: u64| x < y + ys && y < x + xs;
    cross(a.gpa, a.size, b.gpa, b.size)
        || cross(a.user_addr, a.size, b.user_addr, b.size)
        || cross(a_cover.gpa, a_cover.size, b_cover.gpa, b_cover.size)
}

fn overlap_error(r: &Region, o: &Region) -> Error {
    Error::BadRegion(format!(
        "memory region guest {:#x}+{:#x} (user {:#x}) overlaps region guest {:#x}+{:#x} (user {:#x})",
        r.gpa, r.size, r.user_addr, o.gpa, o.size, o.user_addr
    ))
}

/// Maps every region's descriptor, all or nothing (a failure drops what was mapped).
fn map_all(
    mappings: &SharedMappings,
    regions: &[Region],
    fds: Vec<OwnedFd>,
) -> Result<Vec<Arc<Backing>>> {
    regions
        .iter()
        .zip(fds)
        .map(|(r, fd)| {
            mappings.map(fd, r.mmap_offset, r.size).map_err(|e| {
                Error::BadRegion(format!(
                    "memory region guest {:#x} size {:#x} offset {:#x}: {e}",
                    r.gpa, r.size, r.mmap_offset
                ))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use memvisor::{BackingKind, Prot};

    use super::*;

    const UADDR: u64 = 0x7f00_0000_0000;

    fn iotlb() -> FrontendMemory {
        let state = ProcessState::new(SharedMappings::global(), PinRegistry::global());
        let mut mem = FrontendMemory::new(&state).unwrap();
        let backing = Backing::new(BackingKind::Memfd, 1 << 20).unwrap();
        let fd = backing.fd().unwrap().try_clone_to_owned().unwrap();
        let region = Region {
            gpa: 0,
            size: 1 << 20,
            user_addr: UADDR,
            mmap_offset: 0,
        };
        mem.set_table(&[region], vec![fd]).unwrap();
        mem.set_iotlb(true).unwrap();
        mem
    }

    fn mapped(mem: &FrontendMemory, page: u64) -> bool {
        mem.dma()
            .translate(Iova(page * PAGE), 8, Prot::READ)
            .is_ok()
    }

    #[test]
    fn a_full_iotlb_retires_its_oldest_entries_instead_of_refusing_an_update() {
        let mut mem = iotlb();
        let limit = u64::from(DmaConfig::default().max_mappings);
        let share = limit / RETIRE_SHARE as u64;
        // Every IOVA page reaches the same guest page: entries cost no memory. Made from the
        // top down, so the oldest entries are the highest IOVAs, not the lowest.
        for page in (0..limit).rev() {
            mem.iotlb_update(page * PAGE, PAGE, UADDR, Prot::RW)
                .unwrap();
        }
        assert_eq!(mem.dma().len() as u64, limit);
        // Full: the next update retires the oldest 64th, pages limit - share to limit - 1.
        mem.iotlb_update(limit * PAGE, PAGE, UADDR, Prot::RW)
            .unwrap();
        assert_eq!(mem.dma().len() as u64, limit - share + 1);
        assert!(
            (limit - share..limit).all(|p| !mapped(&mem, p)),
            "the oldest entries were not the ones retired"
        );
        assert!(
            mapped(&mem, 0) && mapped(&mem, limit - share - 1) && mapped(&mem, limit),
            "a newer entry was retired"
        );
        // Room is left now: the next updates retire nothing until the space is full again.
        for page in limit + 1..limit + share {
            mem.iotlb_update(page * PAGE, PAGE, UADDR, Prot::RW)
                .unwrap();
        }
        assert_eq!(mem.dma().len() as u64, limit);
        assert!(
            mapped(&mem, limit - share - 1),
            "an entry was retired while there was room"
        );
        // Full again: the oldest left are pages limit - share - 1 downwards.
        mem.iotlb_update((limit + share) * PAGE, PAGE, UADDR, Prot::RW)
            .unwrap();
        assert!(!mapped(&mem, limit - share - 1) && !mapped(&mem, limit - 2 * share));
        assert!(mapped(&mem, limit - 2 * share - 1) && mapped(&mem, limit + share));
    }
}
