//! A VMM's vm-memory guest RAM adopted as memvisor memory (feature `vm-memory-mmap`).
//!
//! A VMM built on rust-vmm maps guest RAM itself, as `GuestRegionMmap`s collected in a
//! `GuestMemoryMmap`. This module hands those same mappings to memvisor without mapping
//! anything again: each region becomes an adopted [`Backing`] ([`Backing::from_guest_region`])
//! whose keeper is the region's `Arc<MmapRegion>`, so the mapping lives as long as either side
//! uses it and vm-memory unmaps it (if it owns it) when both are done. A region with a file
//! (memfd, hugetlbfs, shared file) gives the backing a duplicate of its descriptor and its
//! offset, so a vhost-user front end built on memvisor can send it; its page size is its file
//! system's. A whole `GuestMemoryMmap` becomes a [`SlotTable`] with one slot per region at the
//! region's guest address ([`SlotTable::from_guest_memory`]); one region at a time, for
//! hotplug, is [`SlotSpec::from_guest_region`].
//!
//! Safe to call: a `GuestRegionMmap` already carries vm-memory's promise that its mapping is
//! valid while it lives (for an `MmapRegion` built over a raw pointer, that promise was made to
//! vm-memory by its builder). What memvisor's `adopt` checks is checked here too. vm-memory's
//! own dirty bitmap of a region (`B`) is not marked by memvisor's writes: memvisor keeps its own
//! dirty log (`SlotFlags::LOG_DIRTY`).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use vm_memory::bitmap::Bitmap;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion, GuestRegionMmap};

use crate::addr::{Gpa, PageSize};
use crate::backing::{AdoptedMemory, Backing, file_identity};
use crate::error::{Error, Result};
use crate::slots::{SlotId, SlotSpec, SlotTable};

impl Backing {
    /// The memory of a vm-memory region, adopted: no new mapping; the region's mapping is kept
    /// alive (its `Arc<MmapRegion>`) as long as the backing. A region with a file gives the
    /// backing a duplicate of its descriptor and its offset. EOPNOTSUPP for a region not mapped
    /// read-write (map it read-write and make its slot `SlotFlags::READ_ONLY`); the checks of
    /// [`Backing::adopt`] otherwise.
    pub fn from_guest_region<B>(region: &GuestRegionMmap<B>) -> Result<Backing>
    where
        B: Bitmap + Send + Sync + 'static,
    {
        let mmap = region.get_mmap();
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        if mmap.prot() & rw != rw {
            return Err(Error::Unsupported {
                what: "adopting a vm-memory region not mapped read-write",
                why: format!(
                    "region at guest {:#x} has prot {:#x}; map it read-write and give its slot \
                     SlotFlags::READ_ONLY",
                    region.start_addr().0,
                    mmap.prot()
                ),
            });
        }
        let shared = mmap.flags() & libc::MAP_SHARED != 0;
        let file = match mmap.file_offset() {
            Some(f) => {
                let fd = f.file().try_clone().map_err(|source| Error::Os {
                    op: "dup (vm-memory region's file)",
                    source,
                })?;
                Some((OwnedFd::from(fd), f.start()))
            }
            None => None,
        };
        let page_size = match &file {
            Some((fd, _)) => file_identity(fd)?.1,
            None => anon_page_size(mmap.flags(), mmap.is_hugetlbfs())?,
        };
        let mut memory = AdoptedMemory::new(mmap.as_ptr(), mmap.size() as u64)
            .shared(shared)
            .page_size(page_size);
        if let Some((fd, offset)) = file {
            memory = memory.file(fd, offset);
        }
        let memory = memory.keep(mmap);
        // SAFETY: the keeper is the region's Arc<MmapRegion>, which keeps its mapping of
        // `size` bytes at `as_ptr` valid and read-write (prot checked above) as long as the
        // backing lives; `shared`, the page size and the file come from the region's own mmap
        // flags and descriptor. vm-memory reaches the memory only through volatile accesses.
        unsafe { Backing::adopt(memory) }
    }
}

impl SlotSpec {
    /// A slot `id` over a vm-memory region's memory at the region's guest address (adopted with
    /// [`Backing::from_guest_region`]): what a VMM's memory hotplug inserts.
    pub fn from_guest_region<B>(id: SlotId, region: &GuestRegionMmap<B>) -> Result<SlotSpec>
    where
        B: Bitmap + Send + Sync + 'static,
    {
        let backing = Backing::from_guest_region(region)?;
        Ok(SlotSpec::new(
            id,
            Gpa(region.start_addr().0),
            Arc::new(backing),
        ))
    }
}

impl SlotTable {
    /// A slot table over a VMM's whole `GuestMemoryMmap`: slot `i` is its `i`-th region (in
    /// guest address order) at the region's guest address. All or nothing: an error from any
    /// region (see [`Backing::from_guest_region`]) returns no table.
    pub fn from_guest_memory<B>(memory: &GuestMemoryMmap<B>) -> Result<SlotTable>
    where
        B: Bitmap + Send + Sync + 'static,
    {
        let specs = memory
            .iter()
            .enumerate()
            .map(|(i, region)| SlotSpec::from_guest_region(i as SlotId, region))
            .collect::<Result<Vec<_>>>()?;
        let table = SlotTable::new();
        table.update(|edit| specs.into_iter().try_for_each(|spec| edit.insert(spec)))?;
        Ok(table)
    }
}

/// The page size of an anonymous vm-memory region: hugetlbfs pages for `MAP_HUGETLB` (the size
/// its flags name, else the system's default), 4 KiB otherwise.
fn anon_page_size(flags: i32, hugetlbfs: Option<bool>) -> Result<PageSize> {
    if flags & libc::MAP_HUGETLB == 0 && hugetlbfs != Some(true) {
        return Ok(PageSize::Size4K);
    }
    match (flags >> libc::MAP_HUGE_SHIFT) & libc::MAP_HUGE_MASK {
        21 => Ok(PageSize::Size2M),
        30 => Ok(PageSize::Size1G),
        0 => default_huge_page_size(),
        bits => Err(Error::Unsupported {
            what: "huge page size of a vm-memory region",
            why: format!("2^{bits} bytes; memvisor knows 2 MiB and 1 GiB"),
        }),
    }
}

/// `Hugepagesize` of /proc/meminfo: what `MAP_HUGETLB` without a size gets.
fn default_huge_page_size() -> Result<PageSize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").map_err(|source| Error::Os {
        op: "read /proc/meminfo",
        source,
    })?;
    let kib = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("Hugepagesize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    match kib {
        Some(2048) => Ok(PageSize::Size2M),
        Some(1_048_576) => Ok(PageSize::Size1G),
        other => Err(Error::Unsupported {
            what: "the default huge page size",
            why: format!("/proc/meminfo says {other:?} KiB; memvisor knows 2 MiB and 1 GiB"),
        }),
    }
}
