//! Memory the caller mapped itself, adopted as a [`Backing`].
//!
//! A VMM that already maps its guest RAM (with its own NUMA binding, hugetlbfs sizes, KSM
//! advice) hands memvisor a description of the mapping, an [`AdoptedMemory`], and gets a
//! `Backing` over it that everything above (slots, DMA spaces, pins, discards, dirty logs)
//! uses like one memvisor made. The difference is ownership: memvisor never unmaps an adopted
//! mapping. The caller promises it stays mapped at least as long as the backing lives; the
//! easy way to keep that promise is to give the object that owns the mapping to the backing as
//! its keeper ([`AdoptedMemory::keep`]), which the backing drops when its last user is gone.
//!
//! What memvisor cannot see it takes on trust (the `# Safety` section of [`Backing::adopt`]);
//! what it can check it checks before adopting: the address is not null and is page aligned,
//! the size is whole pages and does not wrap, every page of the range is mapped in this
//! process, and a descriptor given with it is a regular file on a file system of the stated
//! page size whose length covers the range from its offset. With the descriptor, a vhost-user
//! front end can still send the memory to a back end, and discards punch holes in the file.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use crate::addr::PageSize;
use crate::error::{Error, Result};

use super::{Backing, BackingKind, Keeper, file_identity, mappable_end};

/// A description of a mapping the caller owns, for [`Backing::adopt`].
///
/// Built with [`AdoptedMemory::new`] (private 4 KiB pages, no descriptor, no keeper) and the
/// setters below; nothing is checked until `adopt`.
pub struct AdoptedMemory {
    ptr: *mut u8,
    size: u64,
    page_size: PageSize,
    shared: bool,
    file: Option<(OwnedFd, u64)>,
    keeper: Option<Box<dyn Send + Sync>>,
}

impl std::fmt::Debug for AdoptedMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdoptedMemory")
            .field("ptr", &self.ptr)
            .field("size", &self.size)
            .field("page_size", &self.page_size)
            .field("shared", &self.shared)
            .field("file", &self.file)
            .field("keeper", &self.keeper.is_some())
            .finish()
    }
}

impl AdoptedMemory {
    /// The `size` bytes mapped at `ptr`: by default private (`MAP_PRIVATE`), 4 KiB pages, with
    /// no descriptor and no keeper.
    pub fn new(ptr: *mut u8, size: u64) -> Self {
        AdoptedMemory {
            ptr,
            size,
            page_size: PageSize::Size4K,
            shared: false,
            file: None,
            keeper: None,
        }
    }

    /// Whether the mapping is `MAP_SHARED` (`true`) or `MAP_PRIVATE` (`false`, the default).
    pub fn shared(mut self, shared: bool) -> Self {
        self.shared = shared;
        self
    }

    /// The page size the kernel backs the mapping with: 4 KiB (the default), or its hugetlbfs
    /// page size.
    pub fn page_size(mut self, page_size: PageSize) -> Self {
        self.page_size = page_size;
        self
    }

    /// The file the mapping maps, and where in it the mapping starts. The backing owns `fd`
    /// (give it a duplicate if you keep yours); it is what [`Backing::fd`] hands to a
    /// vhost-user front end, and what discards punch holes in.
    pub fn file(mut self, fd: OwnedFd, file_offset: u64) -> Self {
        self.file = Some((fd, file_offset));
        self
    }

    /// An object to keep alive as long as the backing: typically what owns the mapping (an
    /// `Arc` of the caller's region, a guard that unmaps on drop). Dropped with the backing.
    pub fn keep(mut self, keeper: impl Send + Sync + 'static) -> Self {
        self.keeper = Some(Box::new(keeper));
        self
    }
}

impl Backing {
    /// Adopts a mapping the caller made: a backing over it that memvisor never unmaps.
    ///
    /// Checked, each an EINVAL error naming the bad value, nothing adopted: a null or not
    /// page-aligned address, a zero or not page-aligned size, a range that wraps, a range not
    /// wholly mapped in this process; for a descriptor: not a regular file, a file system page
    /// size other than `page_size`, a file offset not page aligned, a file shorter than the
    /// range (a page wholly past its end).
    ///
    /// # Safety
    ///
    /// The caller promises, for as long as the returned backing (or any `Arc` of it, any slot
    /// or DMA mapping over it) lives:
    /// - `[ptr, ptr + size)` is one or more mappings of this process, readable and writable,
    ///   that nothing unmaps, remaps (`mremap`, `MAP_FIXED` over it) or `mprotect`s to less
    ///   than read-write — the keeper, if given, is dropped only after the backing's last user;
    /// - the description is true: `shared` says `MAP_SHARED`; `page_size` is the page size the
    ///   kernel backs it with; a descriptor given is the file mapped, from that offset (private
    ///   memory without a descriptor is anonymous);
    /// - the caller reaches the memory only through raw pointers or volatile accesses, never
    ///   through a Rust reference (`&[u8]`), since devices and the guest write it concurrently.
    ///
    /// memvisor may then discard pages of it (free page reporting), pin and unpin them (mlock),
    /// and read and write it from any thread.
    pub unsafe fn adopt(memory: AdoptedMemory) -> Result<Backing> {
        let AdoptedMemory {
            ptr,
            size,
            page_size,
            shared,
            file,
            keeper,
        } = memory;
        let ptr = NonNull::new(ptr).ok_or_else(|| {
            Error::Invalid(
                "adopted memory: the host address is null; give the mapping's address".into(),
            )
        })?;
        let addr = ptr.as_ptr() as usize as u64;
        page_size.check("adopted memory host address", addr)?;
        if size == 0 {
            return Err(Error::ZeroSize {
                what: "adopted memory",
            });
        }
        page_size.check("adopted memory size", size)?;
        let len = match addr.checked_add(size) {
            Some(end) if end <= usize::MAX as u64 => size as usize,
            _ => {
                return Err(Error::RangeWraps {
                    what: "adopted memory",
                    start: addr,
                    len: size,
                });
            }
        };
        // SAFETY: msync(MS_ASYNC) only checks that every page of the range is mapped (ENOMEM
        // otherwise) and schedules nothing; it neither reads nor changes the memory.
        if unsafe { libc::msync(ptr.as_ptr().cast(), len, libc::MS_ASYNC) } != 0 {
            let e = std::io::Error::last_os_error();
            return Err(Error::Invalid(format!(
                "adopted memory {addr:#x}+{size:#x} is not wholly mapped in this process \
                 (msync: {e}); give a range of a live mapping"
            )));
        }
        let (fd, file_offset) = match file {
            None => (None, 0),
            Some((fd, file_offset)) => {
                check_file(&fd, file_offset, size, page_size)?;
                (Some(fd), file_offset)
            }
        };
        Ok(Backing {
            ptr,
            size,
            mapped: len,
            kind: BackingKind::Adopted { page_size, shared },
            page_size,
            fd,
            file_offset,
            adopted: Some(Keeper(keeper)),
        })
    }
}

/// The descriptor of adopted memory: a regular file of `page_size` pages that covers
/// `[file_offset, file_offset + size)`.
fn check_file(fd: &OwnedFd, file_offset: u64, size: u64, page_size: PageSize) -> Result<()> {
    let (st, fs_page) = file_identity(fd)?;
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(Error::Invalid(format!(
            "adopted memory's descriptor is not a regular file (mode {:o}); give the memfd, \
             hugetlbfs or regular file the memory maps",
            st.st_mode
        )));
    }
    if fs_page != page_size {
        return Err(Error::Invalid(format!(
            "adopted memory is described with {page_size} pages, but its file is on a file \
             system of {fs_page} pages; give the file's page size"
        )));
    }
    page_size.check("adopted memory file offset", file_offset)?;
    let file_len = st.st_size.max(0) as u64;
    if file_offset
        .checked_add(size)
        .is_none_or(|end| end > mappable_end(file_len, page_size))
    {
        return Err(Error::OutOfBounds {
            what: "adopted memory's file range (the file must cover the mapping)",
            start: file_offset,
            len: size,
            limit: file_len,
        });
    }
    Ok(())
}
