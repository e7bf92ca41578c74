//! rust-vmm's vm-memory traits over the slot table (cargo feature `vm-memory`).
//!
//! rust-vmm crates (virtio-queue, vhost-user back ends, boot loaders) reach guest memory through
//! vm-memory 0.18's traits. This module lets them run on memvisor's slots, with one type per
//! layer of vm-memory's model:
//!
//! | vm-memory | memvisor | what it is |
//! |---|---|---|
//! | [`GuestMemoryRegion`] | [`SlotRegion`] | one slot: its guest range, host address, backing fd, dirty log |
//! | [`GuestMemoryBackend`] | [`SlotRegions`] | all slots of one [`Snapshot`], in guest-address order |
//! | [`GuestMemory`] (and so [`Bytes<GuestAddress>`]) | [`SlotMemory`] | the same, with access permissions: writes to read-only slots fail |
//! | [`GuestAddressSpace`] | [`SlotSpace`] | the live table: each `memory()` is the current snapshot's view |
//! | [`Bitmap`] | [`DirtyBitmap`] / [`DirtySlice`] | a slot's dirty log, marked by every write through a region's slices |
//!
//! **Lifetime.** A view is built from one snapshot and is immutable, as vm-memory requires of a
//! `GuestMemoryBackend`. It holds an `Arc` to the snapshot and each region an `Arc` to its slot,
//! so every backing it names stays mapped for as long as the view (or any [`VolatileSlice`]
//! borrowed from it) lives, even if the slot is removed from the table meanwhile — the same rule
//! as for any snapshot. A view does not follow later changes: build a new one, or hand devices a
//! [`SlotSpace`], which rebuilds the view once per table generation and otherwise returns the
//! cached one (one atomic load to check).
//!
//! **Read-only slots** ([`SlotFlags::READ_ONLY`]). vm-memory 0.18 carries permissions only on
//! [`GuestMemory`]: its `Bytes<GuestAddress>` methods ask `get_slices` for write access before
//! writing. [`SlotMemory`] refuses such a request when any slot the range reaches (up to the
//! first hole) is read-only, so `write`, `write_slice`, `write_obj`, `store` and
//! `read_volatile_from` fail before a byte is written; so do the write methods of a region's own
//! `Bytes<MemoryRegionAddress>`. The error is [`GuestMemoryError::IOError`] of kind
//! `PermissionDenied` wrapping memvisor's [`Error::ReadOnly`] (errno EFAULT, as KVM). What cannot
//! be checked: the physical layer ([`SlotMemory::regions`], also returned by
//! `physical_memory()`) is vm-memory's permission-less `GuestMemoryBackend`, so `Bytes` called on
//! it, and any [`VolatileSlice`] or host address taken from a region, can write a read-only slot —
//! exactly as with `GuestMemoryMmap`. Use [`SlotMemory`] where permissions matter.
//!
//! **Dirty logging** ([`SlotFlags::LOG_DIRTY`]). A logging slot's region carries its dirty bitmap
//! (the one [`crate::SlotTable::take_dirty_log`] returns) as its vm-memory [`Bitmap`]: every write
//! through a [`VolatileSlice`] it hands out — so every `Bytes` write, through either layer — marks
//! the 4 KiB pages it touched, like memvisor's own writes. Writes through a raw host address
//! ([`GuestMemoryRegion::get_host_address`]) are not seen; vm-memory leaves those to the caller
//! (mark them with `region.bitmap().mark_dirty(offset, len)`). A view marks the bitmap of the
//! snapshot it was built from: a slot whose logging is switched off and on again gets a new
//! bitmap, which only views built after the change mark.
//!
//! **Semantics follow vm-memory, not memvisor**, so rust-vmm code sees what it expects: an access
//! that runs into a hole copies up to the hole (`read`/`write` return the count,
//! `read_slice`/`write_slice` fail with `PartialBuffer` after copying that much), where
//! [`Snapshot::write`] checks the whole range first and copies nothing. Accesses never build a
//! `&[u8]` over guest memory: they copy through [`VolatileSlice`]s.
//!
//! **Hotplug.** [`SlotSpace::insert_region`] and [`SlotSpace::remove_region`] are vm-memory's
//! `GuestMemoryMmap::insert_region` / `remove_region` (same arguments, same refusals) and the
//! `GuestMemoryAtomic::lock().replace()` that publishes the result, in one call: the table is
//! the collection and its writer mutex is the lock, so each change is one atomic table update.
//! A caller holding an older `memory()` keeps its consistent old view (and the removed region
//! stays mapped until that view is dropped); the next `memory()` sees the change. vm-memory's
//! two steps let two hotplugs that both start from the same `memory()` publish one and lose the
//! other; here the second one is applied to the first one's result. Refusals are memvisor's
//! [`Error`], with the errno KVM would give: an overlap is [`Error::Overlap`] (EEXIST,
//! vm-memory's `MemoryRegionOverlap`), a `(base, size)` that is no region is [`Error::NotFound`]
//! (ENOENT) or, when `base` lies in a region that does not start there or has another size,
//! [`Error::Invalid`] (EINVAL) naming that region (both vm-memory's `NoMemoryRegion`); a size of 0
//! is [`Error::ZeroSize`].
//!
//! **Not supported:** IOMMU translation (use [`crate::DmaSpace`] for I/O virtual addresses);
//! vm-memory's `GuestRegionCollection` constructors (build a [`crate::SlotTable`] instead);
//! vm-memory's xen mappings.

use std::fmt;
use std::fs::File;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use ::vm_memory::bitmap::{BS, Bitmap, BitmapSlice, WithBitmapSlice};
use ::vm_memory::guest_memory::{GuestMemoryBackendSliceIterator, GuestMemorySliceIterator};
use ::vm_memory::{
    AtomicAccess, Bytes, FileOffset, GuestAddress, GuestAddressSpace, GuestMemory,
    GuestMemoryBackend, GuestMemoryError, GuestMemoryRegion, GuestUsize, MemoryRegionAddress,
    Permissions, ReadVolatile, VolatileSlice, WriteVolatile,
};
use arc_swap::ArcSwap;

use crate::addr::{Gpa, PageSize};
use crate::backing::BackingKind;
use crate::bitmap::DirtyBitmap;
use crate::error::Error;
use crate::slots::{Slot, SlotFlags, SlotId, SlotSpec, SlotTable, Snapshot};

type GuestResult<T> = ::vm_memory::GuestMemoryResult<T>;

const PAGE_SHIFT: u32 = PageSize::Size4K.shift();

/// A slot's dirty log seen from `offset` bytes into the slot: vm-memory's [`BitmapSlice`] over
/// memvisor's [`DirtyBitmap`] (one bit per 4 KiB page of the slot).
#[derive(Clone, Copy)]
pub struct DirtySlice<'a> {
    bitmap: &'a DirtyBitmap,
    offset: usize,
}

impl fmt::Debug for DirtySlice<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DirtySlice")
            .field("pages", &self.bitmap.pages())
            .field("offset", &self.offset)
            .finish()
    }
}

/// Marks the pages holding bytes `offset .. offset + len` of the bitmap's slot.
fn mark_bytes(bitmap: &DirtyBitmap, offset: usize, len: usize) {
    if len == 0 {
        return;
    }
    let first = (offset as u64) >> PAGE_SHIFT;
    let last = (offset as u64).saturating_add(len as u64 - 1) >> PAGE_SHIFT;
    bitmap.mark(first, last - first + 1);
}

impl<'a> WithBitmapSlice<'a> for DirtyBitmap {
    type S = DirtySlice<'a>;
}

/// Offsets are bytes from the start of the slot; a write marks every 4 KiB page it touches.
impl Bitmap for DirtyBitmap {
    fn mark_dirty(&self, offset: usize, len: usize) {
        mark_bytes(self, offset, len);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.is_marked((offset as u64) >> PAGE_SHIFT)
    }

    fn slice_at(&self, offset: usize) -> DirtySlice<'_> {
        DirtySlice {
            bitmap: self,
            offset,
        }
    }
}

impl<'b> WithBitmapSlice<'b> for DirtySlice<'_> {
    type S = Self;
}

impl BitmapSlice for DirtySlice<'_> {}

impl Bitmap for DirtySlice<'_> {
    fn mark_dirty(&self, offset: usize, len: usize) {
        // vm-memory hands back offsets it derived from this slice; wrapping (as its own slices
        // do) can at worst mark a page too many, never touch memory.
        mark_bytes(self.bitmap, self.offset.wrapping_add(offset), len);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.bitmap.dirty_at(self.offset.wrapping_add(offset))
    }

    fn slice_at(&self, offset: usize) -> Self {
        DirtySlice {
            bitmap: self.bitmap,
            offset: self.offset.wrapping_add(offset),
        }
    }
}

/// One slot as a vm-memory [`GuestMemoryRegion`]. Keeps the slot (and so its backing) alive.
pub struct SlotRegion {
    slot: Arc<Slot>,
    /// The backing's fd, duplicated on first use of `file_offset`.
    file: OnceLock<Option<FileOffset>>,
}

impl fmt::Debug for SlotRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRegion")
            .field("slot", &self.slot.id())
            .field("range", &self.slot.range())
            .field("flags", &self.slot.flags())
            .finish()
    }
}

impl SlotRegion {
    fn new(slot: Arc<Slot>) -> Self {
        SlotRegion {
            slot,
            file: OnceLock::new(),
        }
    }

    /// The memvisor slot behind the region.
    pub fn slot(&self) -> &Arc<Slot> {
        &self.slot
    }

    /// Whether writes through [`SlotMemory`] and this region's `Bytes` are refused.
    pub fn is_read_only(&self) -> bool {
        self.slot.flags().contains(SlotFlags::READ_ONLY)
    }

    /// The error for a write of `len` bytes at `start` that reaches this read-only region.
    fn read_only_error(&self, start: u64, len: usize) -> GuestMemoryError {
        let first = self.slot.range().start().0;
        let error = Error::ReadOnly {
            what: format!("slot {}", self.slot.id()),
            addr: first.max(start),
            start,
            len: len as u64,
        };
        GuestMemoryError::IOError(io::Error::new(io::ErrorKind::PermissionDenied, error))
    }

    /// Refuses a region-relative write if the slot is read-only.
    fn check_write(&self, addr: MemoryRegionAddress, len: usize) -> GuestResult<()> {
        if self.is_read_only() {
            let start = self.slot.range().start().0.wrapping_add(addr.0);
            return Err(self.read_only_error(start, len));
        }
        Ok(())
    }
}

impl GuestMemoryRegion for SlotRegion {
    type B = Option<DirtyBitmap>;

    fn len(&self) -> GuestUsize {
        self.slot.range().len()
    }

    fn start_addr(&self) -> GuestAddress {
        GuestAddress(self.slot.range().start().0)
    }

    /// The slot's dirty log from its first byte, or `None` if the slot does not log.
    fn bitmap(&self) -> BS<'_, Self::B> {
        self.slot.dirty_bitmap().map(|b| b.slice_at(0))
    }

    fn get_host_address(&self, addr: MemoryRegionAddress) -> GuestResult<*mut u8> {
        self.check_address(addr)
            .map(|addr| (self.slot.hva().0 + addr.0) as usize as *mut u8)
            .ok_or(GuestMemoryError::InvalidBackendAddress)
    }

    /// For memfd, hugetlbfs and file backings: a duplicate of the backing's fd and the slot's
    /// offset in it (what a vhost-user front end sends). `None` for anonymous memory, or if the
    /// fd could not be duplicated.
    fn file_offset(&self) -> Option<&FileOffset> {
        self.file
            .get_or_init(|| {
                let fd = self.slot.backing().fd()?.try_clone_to_owned().ok()?;
                Some(FileOffset::new(File::from(fd), self.slot.offset()))
            })
            .as_ref()
    }

    fn get_slice(
        &self,
        offset: MemoryRegionAddress,
        count: usize,
    ) -> GuestResult<VolatileSlice<'_, BS<'_, Self::B>>> {
        match offset.0.checked_add(count as u64) {
            Some(end) if end <= self.len() => {}
            _ => return Err(GuestMemoryError::InvalidBackendAddress),
        }
        let host = (self.slot.hva().0 + offset.0) as usize as *mut u8;
        let bitmap = self.bitmap().slice_at(offset.0 as usize);
        // SAFETY: offset + count <= len, so host..host + count lies inside the slot's window of
        // its backing, which stays mapped while the slice lives: the slice borrows `self`, which
        // holds an Arc to the slot and the slot one to the backing. Guest memory is only ever
        // accessed with raw copies (memvisor's own and the VolatileSlice's), never references.
        Ok(unsafe { VolatileSlice::with_bitmap(host, count, bitmap, None) })
    }

    fn is_hugetlbfs(&self) -> Option<bool> {
        Some(matches!(
            self.slot.backing().kind(),
            BackingKind::Hugetlb(_)
                | BackingKind::Received {
                    page_size: PageSize::Size2M | PageSize::Size1G
                }
                | BackingKind::Adopted {
                    page_size: PageSize::Size2M | PageSize::Size1G,
                    ..
                }
        ))
    }
}

/// The region's own accesses (offsets from the slot's start), through its volatile slice; the
/// write methods refuse a read-only slot.
impl Bytes<MemoryRegionAddress> for SlotRegion {
    type E = GuestMemoryError;

    fn write(&self, buf: &[u8], addr: MemoryRegionAddress) -> GuestResult<usize> {
        self.check_write(addr, buf.len())?;
        Ok(self.as_volatile_slice()?.write(buf, addr.0 as usize)?)
    }

    fn read(&self, buf: &mut [u8], addr: MemoryRegionAddress) -> GuestResult<usize> {
        Ok(self.as_volatile_slice()?.read(buf, addr.0 as usize)?)
    }

    fn write_slice(&self, buf: &[u8], addr: MemoryRegionAddress) -> GuestResult<()> {
        self.check_write(addr, buf.len())?;
        Ok(self
            .as_volatile_slice()?
            .write_slice(buf, addr.0 as usize)?)
    }

    fn read_slice(&self, buf: &mut [u8], addr: MemoryRegionAddress) -> GuestResult<()> {
        Ok(self.as_volatile_slice()?.read_slice(buf, addr.0 as usize)?)
    }

    fn read_volatile_from<F: ReadVolatile>(
        &self,
        addr: MemoryRegionAddress,
        src: &mut F,
        count: usize,
    ) -> GuestResult<usize> {
        self.check_write(addr, count)?;
        Ok(self
            .as_volatile_slice()?
            .read_volatile_from(addr.0 as usize, src, count)?)
    }

    fn read_exact_volatile_from<F: ReadVolatile>(
        &self,
        addr: MemoryRegionAddress,
        src: &mut F,
        count: usize,
    ) -> GuestResult<()> {
        self.check_write(addr, count)?;
        Ok(self
            .as_volatile_slice()?
            .read_exact_volatile_from(addr.0 as usize, src, count)?)
    }

    fn write_volatile_to<F: WriteVolatile>(
        &self,
        addr: MemoryRegionAddress,
        dst: &mut F,
        count: usize,
    ) -> GuestResult<usize> {
        Ok(self
            .as_volatile_slice()?
            .write_volatile_to(addr.0 as usize, dst, count)?)
    }

    fn write_all_volatile_to<F: WriteVolatile>(
        &self,
        addr: MemoryRegionAddress,
        dst: &mut F,
        count: usize,
    ) -> GuestResult<()> {
        Ok(self
            .as_volatile_slice()?
            .write_all_volatile_to(addr.0 as usize, dst, count)?)
    }

    fn store<T: AtomicAccess>(
        &self,
        val: T,
        addr: MemoryRegionAddress,
        order: Ordering,
    ) -> GuestResult<()> {
        self.check_write(addr, std::mem::size_of::<T>())?;
        Ok(self
            .as_volatile_slice()?
            .store(val, addr.0 as usize, order)?)
    }

    fn load<T: AtomicAccess>(&self, addr: MemoryRegionAddress, order: Ordering) -> GuestResult<T> {
        Ok(self.as_volatile_slice()?.load(addr.0 as usize, order)?)
    }
}

/// The slots of one snapshot as a vm-memory [`GuestMemoryBackend`]: the physical layer, without
/// permissions (see the module docs). `find_region` is the snapshot's binary search.
pub struct SlotRegions {
    snapshot: Arc<Snapshot>,
    /// One per slot, in the snapshot's (guest-address) order, so `find`'s index is valid here.
    regions: Box<[SlotRegion]>,
    any_read_only: bool,
}

impl fmt::Debug for SlotRegions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotRegions")
            .field("generation", &self.snapshot.generation())
            .field("regions", &self.regions)
            .finish()
    }
}

impl SlotRegions {
    /// The snapshot the regions come from.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.snapshot
    }

    /// The error for a write of `[addr, addr + count)` if any slot it reaches before the first
    /// hole is read-only. A hole is not an error here: the slice iterator reports it.
    fn check_writable(&self, addr: GuestAddress, count: usize) -> GuestResult<()> {
        if !self.any_read_only || count == 0 {
            return Ok(());
        }
        let last = addr.0.saturating_add(count as u64 - 1);
        let Some(mut i) = self.snapshot.find(Gpa(addr.0)) else {
            return Ok(());
        };
        loop {
            let region = &self.regions[i];
            if region.is_read_only() {
                return Err(region.read_only_error(addr.0, count));
            }
            let region_last = region.last_addr().0;
            if last <= region_last {
                return Ok(());
            }
            i += 1;
            match self.regions.get(i) {
                Some(next) if next.start_addr().0 == region_last + 1 => {}
                _ => return Ok(()),
            }
        }
    }
}

impl GuestMemoryBackend for SlotRegions {
    type R = SlotRegion;

    fn num_regions(&self) -> usize {
        self.regions.len()
    }

    fn find_region(&self, addr: GuestAddress) -> Option<&SlotRegion> {
        self.snapshot.find(Gpa(addr.0)).map(|i| &self.regions[i])
    }

    fn iter(&self) -> impl Iterator<Item = &SlotRegion> {
        self.regions.iter()
    }
}

/// Guest memory for rust-vmm crates: a snapshot of the slot table as a vm-memory
/// [`GuestMemory`], so [`Bytes<GuestAddress>`] and [`GuestAddressSpace`] (for `&SlotMemory` and
/// `Arc<SlotMemory>`) come with it. Writes that reach a read-only slot fail.
///
/// Region-level questions (`find_region`, `get_host_address`, `checked_offset`, ...) are asked
/// of [`SlotMemory::regions`], the [`GuestMemoryBackend`] underneath.
#[derive(Debug)]
pub struct SlotMemory {
    regions: SlotRegions,
}

impl SlotMemory {
    /// A view of `snapshot`; it keeps the snapshot, and so every backing it names, alive.
    pub fn new(snapshot: Arc<Snapshot>) -> Self {
        let regions: Box<[SlotRegion]> = snapshot
            .slots()
            .map(|slot| SlotRegion::new(slot.clone()))
            .collect();
        let any_read_only = regions.iter().any(SlotRegion::is_read_only);
        SlotMemory {
            regions: SlotRegions {
                snapshot,
                regions,
                any_read_only,
            },
        }
    }

    /// A view of the table's current snapshot.
    pub fn from_table(table: &SlotTable) -> Self {
        Self::new(table.snapshot())
    }

    /// The physical layer: vm-memory's region interface, without permission checks.
    pub fn regions(&self) -> &SlotRegions {
        &self.regions
    }

    /// The snapshot the view was built from.
    pub fn snapshot(&self) -> &Arc<Snapshot> {
        &self.regions.snapshot
    }
}

impl From<Arc<Snapshot>> for SlotMemory {
    fn from(snapshot: Arc<Snapshot>) -> Self {
        Self::new(snapshot)
    }
}

impl GuestMemory for SlotMemory {
    type PhysicalMemory = SlotRegions;
    type Bitmap = Option<DirtyBitmap>;

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        GuestMemoryBackend::check_range(&self.regions, addr, count)
            && (!access.has_write() || self.regions.check_writable(addr, count).is_ok())
    }

    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> GuestResult<impl GuestMemorySliceIterator<'a, BS<'a, Self::Bitmap>>> {
        if access.has_write() {
            self.regions.check_writable(addr, count)?;
        }
        let slices: GuestMemoryBackendSliceIterator<'a, SlotRegions> =
            GuestMemoryBackend::get_slices(&self.regions, addr, count);
        Ok(slices)
    }

    /// The permission-less physical layer (see the module docs on read-only slots).
    fn physical_memory(&self) -> Option<&SlotRegions> {
        Some(&self.regions)
    }
}

/// The live slot table as a vm-memory [`GuestAddressSpace`]: hand it to a device and each
/// `memory()` returns a view of the table's current snapshot. The view is rebuilt once per table
/// change and shared otherwise; a caller keeps the view it got (and its memory mapped) until it
/// drops it. Cloning gives another handle to the same cache.
#[derive(Clone)]
pub struct SlotSpace {
    table: SlotTable,
    current: Arc<ArcSwap<SlotMemory>>,
}

impl fmt::Debug for SlotSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotSpace")
            .field("generation", &self.current.load().snapshot().generation())
            .finish()
    }
}

impl SlotSpace {
    /// An address space following `table`.
    pub fn new(table: SlotTable) -> Self {
        let current = Arc::new(ArcSwap::from_pointee(SlotMemory::from_table(&table)));
        SlotSpace { table, current }
    }

    /// The table it follows.
    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    /// Hotplugs memory: installs `region` as a slot and publishes the change atomically (see the
    /// module docs on hotplug). The port of vm-memory's
    /// `let m = atomic.memory().insert_region(r)?; atomic.lock().unwrap().replace(m);`.
    ///
    /// Returns a view of the table with the region in it: the one this change published, or a
    /// later one if another writer changed the table meanwhile. Refused, with nothing
    /// published, as [`SlotTable::insert`] refuses: EEXIST for an overlap ([`Error::Overlap`]
    /// names both ranges) or a slot id in use, EINVAL for a size of 0, a misaligned address,
    /// size or offset, or a window past the backing's end.
    pub fn insert_region(&self, region: SlotSpec) -> Result<Arc<SlotMemory>, Error> {
        self.table.insert(region)?;
        Ok(self.memory())
    }

    /// Hot-unplugs the region that starts at `base` and is `size` bytes long, publishing the
    /// change atomically (see the module docs on hotplug). The port of vm-memory's
    /// `let (m, r) = atomic.memory().remove_region(base, size)?; atomic.lock().unwrap().replace(m);`.
    ///
    /// Returns a view without the region (this change's, or a later one) and the removed
    /// region, which keeps its backing mapped until it and every older view are dropped — the
    /// moment to tell KVM or a vhost-user peer first. Refused, with nothing published: EINVAL
    /// ([`Error::ZeroSize`]) for `size` 0; ENOENT ([`Error::NotFound`]) if no region holds
    /// `base`; EINVAL ([`Error::Invalid`], naming the region) if the region holding `base`
    /// does not start there or is not `size` bytes: vm-memory removes whole regions only.
    pub fn remove_region(
        &self,
        base: GuestAddress,
        size: GuestUsize,
    ) -> Result<(Arc<SlotMemory>, Arc<SlotRegion>), Error> {
        if size == 0 {
            return Err(Error::ZeroSize {
                what: "region to remove",
            });
        }
        let removed = self.table.update(|edit| {
            // Writers hold the table's writer lock while the batch runs, so the snapshot read
            // here is the one the batch starts from: the lookup and the removal are one step.
            let id = whole_region(&self.table.snapshot(), base, size)?;
            edit.remove(id)
        })?;
        Ok((self.memory(), Arc::new(SlotRegion::new(removed))))
    }
}

/// The id of the slot that is exactly `[base, base + size)` in `snapshot`.
fn whole_region(
    snapshot: &Snapshot,
    base: GuestAddress,
    size: GuestUsize,
) -> Result<SlotId, Error> {
    let i = snapshot.find(Gpa(base.0)).ok_or(Error::NotFound {
        what: "guest memory region holding address",
        id: base.0,
    })?;
    let slot = snapshot.slots().nth(i).ok_or(Error::NotFound {
        what: "guest memory region holding address",
        id: base.0,
    })?;
    let range = slot.range();
    if range.start().0 != base.0 || range.len() != size {
        return Err(not_whole_region(slot, base, size));
    }
    Ok(slot.id())
}

/// The error for a removal of `[base, base + size)` that names only part of `slot`, or more.
fn not_whole_region(slot: &Slot, base: GuestAddress, size: GuestUsize) -> Error {
    let range = slot.range();
    Error::Invalid(format!(
        "remove_region({base:#x}, {size:#x}): {base:#x} is in slot {} at {:#x} of {:#x} bytes; \
         a region is removed whole: pass its start and size",
        slot.id(),
        range.start().0,
        range.len(),
        base = base.0,
    ))
}

impl GuestAddressSpace for SlotSpace {
    type M = SlotMemory;
    type T = Arc<SlotMemory>;

    fn memory(&self) -> Arc<SlotMemory> {
        let cached = self.current.load_full();
        if cached.snapshot().generation() == self.table.generation() {
            return cached;
        }
        // Two threads may both rebuild; each gets a consistent view and the cache ends up with
        // one of them (an older one only costs the next caller another rebuild).
        let fresh = Arc::new(SlotMemory::from_table(&self.table));
        self.current.store(fresh.clone());
        fresh
    }
}
