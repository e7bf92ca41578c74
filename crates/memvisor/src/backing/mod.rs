//! Host memory that guest RAM lives in.
//!
//! A [`Backing`] is one mapping in this process, created and unmapped by memvisor. Its kind
//! decides everything the layers above need to know about the memory: the page size the kernel
//! backs it with (4 KiB, or 2 MiB / 1 GiB for hugetlbfs), whether it is shared (visible through a
//! file descriptor that can be handed to another process, e.g. a vhost-user back end) and, later,
//! how a page of it is given back to the host. The kinds:
//!
//! | kind | mmap | page size | shared | fd |
//! |---|---|---|---|---|
//! | [`BackingKind::PrivateAnon`] | `MAP_PRIVATE\|MAP_ANONYMOUS` | 4 KiB | no | no |
//! | [`BackingKind::SharedAnon`] | `MAP_SHARED\|MAP_ANONYMOUS` | 4 KiB | yes | no |
//! | [`BackingKind::Memfd`] | `memfd_create` + `MAP_SHARED` | 4 KiB | yes | yes |
//! | [`BackingKind::Thp`] | private anonymous, 2 MiB aligned, `MADV_HUGEPAGE` | 4 KiB (THP may back it with 2 MiB) | no | no |
//! | [`BackingKind::Hugetlb`] | `memfd_create(MFD_HUGETLB)` + `MAP_SHARED` | 2 MiB or 1 GiB | yes | yes |
//! | [`BackingKind::File`] | a regular file, `MAP_SHARED` or `MAP_PRIVATE` | 4 KiB | as asked | yes |
//! | [`BackingKind::Received`] | a descriptor from another process (a VMM's memfd, hugetlbfs or shared file), `MAP_SHARED` from a file offset | the file's | yes | yes |
//! | [`BackingKind::Adopted`] | none: the caller's own mapping ([`Backing::adopt`]), never unmapped by memvisor | as the caller says | as the caller says | if the caller gives it |
//!
//! Memory a VMM has mapped itself is adopted rather than created (module `adopt`): the caller
//! describes its mapping ([`AdoptedMemory`]) and promises it stays mapped while the backing
//! lives; memvisor checks what it can (alignment, the descriptor's file covers the range, the
//! range is mapped), never unmaps it, and drops the caller's keeper object with the backing.
//! Memory memvisor creates can be placed ([`BackingOptions`], module `placement`): a NUMA policy
//! (`mbind`), `MAP_NORESERVE`, and KSM merging (`MADV_MERGEABLE`), each refused with a typed
//! error on a kind where it has no meaning.
//!
//! A received descriptor comes from a peer that is not trusted (a vhost-user or vfio-user
//! frontend): [`Backing::from_fd`] checks it is a regular file at least as long as the range
//! asked for (touching a page past the end of a file is `SIGBUS`, not an error), that offset and
//! size are whole pages of the file system's page size, and maps it. A peer can still shrink the
//! file afterwards; that is the one thing a process that maps another's memory cannot rule out
//! (`F_SEAL_SHRINK` would, but QEMU does not seal its memory). [`SharedMappings`] maps one range
//! of one file once per process, so every device that receives the same guest memory shares one
//! backing — and the pins of one are seen by the discards of another.
//!
//! THP pages can be split by the kernel at any time, so a THP backing reports 4 KiB: the
//! guarantee, not the hope. Every mapping starts on a 2 MiB boundary, so that the kernel (and
//! KVM's stage-2 tables) can use huge pages wherever the guest layout allows.
//!
//! A backing is shared between the slot table, DMA mappings and readers through `Arc`; it is
//! unmapped when the last of them drops it, never earlier. Its memory is only reached with raw
//! pointers (see `copy`), never through Rust references.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use crate::addr::{Hva, PageSize};
use crate::copy;
use crate::error::{Error, Result};
use crate::sync::lock;

mod adopt;
mod placement;

pub use adopt::AdoptedMemory;
pub use placement::{NumaMode, NumaPolicy};

/// Which kind of host memory to create.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackingKind {
    /// Private anonymous memory: the plain `malloc`-like case.
    PrivateAnon,
    /// Shared anonymous memory: survives fork, shared with children.
    SharedAnon,
    /// A memfd: shared memory with a file descriptor to hand to another process.
    Memfd,
    /// Private anonymous memory, 2 MiB aligned, with the transparent-huge-page hint.
    Thp,
    /// hugetlbfs pages of the given size (2 MiB or 1 GiB), through a `MFD_HUGETLB` memfd.
    Hugetlb(PageSize),
    /// A regular file at `path`, created or extended to the backing's size.
    /// `shared: false` maps it copy-on-write: writes stay in this process.
    File {
        /// The file to map.
        path: PathBuf,
        /// `true` maps it shared (writes reach the file and its other users); `false` copy-on-write.
        shared: bool,
    },
    /// A shared file descriptor received from another process, mapped from a file offset (see
    /// [`Backing::from_fd`]); `page_size` is the file system's (hugetlbfs: its huge page size).
    Received {
        /// The file system's page size: 4 KiB, or hugetlbfs's huge page size.
        page_size: PageSize,
    },
    /// A mapping the caller made and still owns, adopted with [`Backing::adopt`]: memvisor
    /// never unmaps it. `page_size` and `shared` are what the caller said of it.
    Adopted {
        /// The page size the kernel backs it with: 4 KiB, or its hugetlbfs page size.
        page_size: PageSize,
        /// `true` for a `MAP_SHARED` mapping, `false` for `MAP_PRIVATE`.
        shared: bool,
    },
}

impl BackingKind {
    /// Short name for tables and messages.
    pub fn name(&self) -> &'static str {
        match self {
            BackingKind::PrivateAnon => "private-anon",
            BackingKind::SharedAnon => "shared-anon",
            BackingKind::Memfd => "memfd",
            BackingKind::Thp => "thp",
            BackingKind::Hugetlb(PageSize::Size1G) => "hugetlb-1g",
            BackingKind::Hugetlb(_) => "hugetlb-2m",
            BackingKind::File { shared: true, .. } => "file-shared",
            BackingKind::File { shared: false, .. } => "file-private",
            BackingKind::Received { .. } => "received-fd",
            BackingKind::Adopted { shared: true, .. } => "adopted-shared",
            BackingKind::Adopted { shared: false, .. } => "adopted-private",
        }
    }
}

/// How to create a backing.
///
/// Build it with `..Default::default()` for the fields you do not set. The placement options
/// are applied before `populate`, so populated pages land where the policy says.
#[derive(Clone, Debug, Default)]
pub struct BackingOptions {
    /// Fault every page in at creation (`MADV_POPULATE_WRITE`, or touching each page on kernels
    /// older than 5.14), so the first guest access does not pay for it.
    pub populate: bool,
    /// The NUMA nodes the memory's pages come from, and how (`mbind(2)`). EINVAL
    /// ([`Error::NoSuchNode`]) for a node that is not online; refused
    /// ([`Error::BadOption`]) for file kinds, whose page cache a policy does not place.
    pub numa: Option<NumaPolicy>,
    /// `MAP_NORESERVE`: no swap space is reserved, so memory can be overcommitted (the kernel
    /// ignores it under `vm.overcommit_memory=2`). For private anonymous, THP, shared anonymous
    /// and private file memory; refused ([`Error::BadOption`]) for memfds (never reserved),
    /// shared files (page cache) and hugetlbfs (a missing huge page would be SIGBUS at a guest
    /// access instead of an error at creation).
    pub noreserve: bool,
    /// `MADV_MERGEABLE`: KSM may merge identical pages. For private memory only: the kernel
    /// accepts it on shared memory and silently does nothing, so memvisor refuses it there
    /// ([`Error::BadOption`]); EOPNOTSUPP on a kernel without KSM.
    pub mergeable: bool,
}

/// Host memory for guest RAM: one mapping, unmapped on drop.
#[derive(Debug)]
pub struct Backing {
    ptr: NonNull<u8>,
    size: u64,
    /// Bytes mapped: `size`, rounded up to whole huge pages for THP.
    mapped: usize,
    kind: BackingKind,
    page_size: PageSize,
    fd: Option<OwnedFd>,
    /// Where in the file behind `fd` the mapping starts (0 unless received or adopted).
    file_offset: u64,
    /// Set for an adopted mapping: the caller owns it (memvisor never unmaps it), and this
    /// holds the caller's keeper, dropped with the backing.
    adopted: Option<Keeper>,
}

/// What keeps an adopted mapping alive: the caller's object, dropped after the backing's last
/// user is gone (or nothing, when the caller keeps the mapping alive by other means).
pub(crate) struct Keeper(#[allow(dead_code)] Option<Box<dyn Send + Sync>>);

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Keeper(caller's object)"
        } else {
            "Keeper(none)"
        })
    }
}

// SAFETY: a Backing owns its mapping; the pointer is never used to build references, and all
// access goes through raw copies whose callers check bounds. The mapping is valid from any thread.
unsafe impl Send for Backing {}
// SAFETY: as above; shared access only ever copies through raw pointers.
unsafe impl Sync for Backing {}

const ALIGN_2M: u64 = PageSize::Size2M.bytes();

impl Backing {
    /// Creates `size` bytes of `kind` memory, not populated.
    pub fn new(kind: BackingKind, size: u64) -> Result<Backing> {
        Self::with_options(kind, size, &BackingOptions::default())
    }

    /// Creates `size` bytes of `kind` memory.
    ///
    /// `size` must be a non-zero multiple of the kind's page size (EINVAL otherwise). hugetlbfs
    /// memory needs enough free huge pages of its size: when they are missing the error says how
    /// many and how to reserve them (see also [`HugePageReservation`]).
    pub fn with_options(kind: BackingKind, size: u64, options: &BackingOptions) -> Result<Backing> {
        let page_size = match kind {
            BackingKind::Hugetlb(PageSize::Size4K) => {
                return Err(Error::Unsupported {
                    what: "hugetlbfs with 4 KiB pages",
                    why: "use Hugetlb(Size2M) or Hugetlb(Size1G)".into(),
                });
            }
            BackingKind::Hugetlb(p) => p,
            BackingKind::Received { .. } => {
                return Err(Error::Unsupported {
                    what: "creating a Received backing",
                    why: "map a descriptor from another process with Backing::from_fd".into(),
                });
            }
            BackingKind::Adopted { .. } => {
                return Err(Error::Unsupported {
                    what: "creating an Adopted backing",
                    why: "adopt a mapping of your own with Backing::adopt".into(),
                });
            }
            _ => PageSize::Size4K,
        };
        placement::check(&kind, options)?;
        if size == 0 {
            return Err(Error::ZeroSize { what: "backing" });
        }
        page_size.check("backing size", size)?;
        // THP memory is mapped in whole huge pages: pins lock it a huge page at a time, and the
        // last huge page must not reach past the mapping into someone else's memory. The tail
        // past `size` is never handed out.
        let mapped = match kind {
            BackingKind::Thp => size.checked_next_multiple_of(ALIGN_2M).unwrap_or(size),
            _ => size,
        };
        let len = usize::try_from(mapped).map_err(|_| Error::OutOfBounds {
            what: "backing size",
            start: 0,
            len: size,
            limit: usize::MAX as u64,
        })?;

        let fd = match &kind {
            BackingKind::PrivateAnon | BackingKind::SharedAnon | BackingKind::Thp => None,
            BackingKind::Memfd => Some(memfd(libc::MFD_CLOEXEC, size)?),
            BackingKind::Hugetlb(p) => {
                let free = free_huge_pages(*p)?;
                let needed = size / p.bytes();
                if free < needed {
                    return Err(Error::HugePagesUnavailable {
                        page_size: *p,
                        needed,
                        free,
                    });
                }
                let flag = match p {
                    PageSize::Size1G => libc::MFD_HUGE_1GB,
                    _ => libc::MFD_HUGE_2MB,
                };
                Some(memfd(libc::MFD_CLOEXEC | libc::MFD_HUGETLB | flag, size)?)
            }
            BackingKind::File { path, .. } => {
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(false)
                    .open(path)
                    .map_err(|source| Error::Os {
                        op: "open backing file",
                        source,
                    })?;
                let current = file
                    .metadata()
                    .map_err(|source| Error::Os {
                        op: "stat backing file",
                        source,
                    })?
                    .len();
                if current < size {
                    file.set_len(size).map_err(|source| Error::Os {
                        op: "extend backing file",
                        source,
                    })?;
                }
                Some(OwnedFd::from(file))
            }
            BackingKind::Received { .. } | BackingKind::Adopted { .. } => {
                unreachable!("refused above")
            }
        };

        let (share, anon) = match &kind {
            BackingKind::PrivateAnon | BackingKind::Thp => (libc::MAP_PRIVATE, true),
            BackingKind::SharedAnon => (libc::MAP_SHARED, true),
            BackingKind::Memfd | BackingKind::Hugetlb(_) => (libc::MAP_SHARED, false),
            BackingKind::File { shared, .. } => (
                if *shared {
                    libc::MAP_SHARED
                } else {
                    libc::MAP_PRIVATE
                },
                false,
            ),
            BackingKind::Received { .. } | BackingKind::Adopted { .. } => {
                unreachable!("refused above")
            }
        };
        let share = share
            | if options.noreserve {
                libc::MAP_NORESERVE
            } else {
                0
            };
        let ptr = map_aligned(len, share, anon, fd.as_ref(), 0, page_size).map_err(|e| {
            match (&kind, e.errno()) {
                // Lost a race for the pages between the check above and the mmap.
                (BackingKind::Hugetlb(p), libc::ENOMEM) => Error::HugePagesUnavailable {
                    page_size: *p,
                    needed: size / p.bytes(),
                    free: free_huge_pages(*p).unwrap_or(0),
                },
                _ => e,
            }
        })?;
        let backing = Backing {
            ptr,
            size,
            mapped: len,
            kind,
            page_size,
            fd,
            file_offset: 0,
            adopted: None,
        };
        if backing.kind == BackingKind::Thp {
            backing.madvise(libc::MADV_HUGEPAGE, "madvise(MADV_HUGEPAGE)")?;
        }
        placement::apply(&backing, options)?;
        if options.populate {
            backing.populate()?;
        }
        Ok(backing)
    }

    /// Maps `size` bytes of the file behind `fd`, from `file_offset`, shared: memory another
    /// process (a VMM) hands over, e.g. in a vhost-user memory table. The descriptor is
    /// checked, not trusted: EINVAL if it is not a regular file (memfds and hugetlbfs files are),
    /// if `file_offset` or `size` is not a multiple of the file's page size, or if a page of the
    /// range lies wholly past the file's end (the last page may pass it: the kernel maps that
    /// page, and its bytes past the end read as zeros, as a frontend's own mapping of a
    /// byte-sized region does); EACCES (from mmap) if it is not open for reading and writing. The backing
    /// keeps the descriptor; the kind is [`BackingKind::Received`] with the page size of the file
    /// system (hugetlbfs: its huge page size).
    pub fn from_fd(fd: OwnedFd, file_offset: u64, size: u64) -> Result<Backing> {
        let (st, page_size) = file_identity(&fd)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return Err(Error::Invalid(format!(
                "memory descriptor is not a regular file (mode {:o}); send a memfd, hugetlbfs \
                 or shared file",
                st.st_mode
            )));
        }
        if size == 0 {
            return Err(Error::ZeroSize { what: "backing" });
        }
        page_size.check("received memory offset", file_offset)?;
        page_size.check("received memory size", size)?;
        let file_len = st.st_size.max(0) as u64;
        let mappable = mappable_end(file_len, page_size);
        if file_offset
            .checked_add(size)
            .is_none_or(|end| end > mappable)
        {
            return Err(Error::OutOfBounds {
                what: "received memory range (a page wholly past the end of the file: touching it would be SIGBUS)",
                start: file_offset,
                len: size,
                limit: file_len,
            });
        }
        let len = usize::try_from(size).map_err(|_| Error::OutOfBounds {
            what: "backing size",
            start: 0,
            len: size,
            limit: usize::MAX as u64,
        })?;
        let ptr = map_aligned(
            len,
            libc::MAP_SHARED,
            false,
            Some(&fd),
            file_offset,
            page_size,
        )?;
        Ok(Backing {
            ptr,
            size,
            mapped: len,
            kind: BackingKind::Received { page_size },
            page_size,
            fd: Some(fd),
            file_offset,
            adopted: None,
        })
    }

    /// Where the mapping starts in the file behind [`Backing::fd`]: 0 for memory memvisor
    /// created, the offset it was given for a received descriptor.
    pub fn file_offset(&self) -> u64 {
        self.file_offset
    }

    /// Faults every page in for writing.
    pub fn populate(&self) -> Result<()> {
        match self.madvise(libc::MADV_POPULATE_WRITE, "madvise(MADV_POPULATE_WRITE)") {
            Err(e) if e.errno() == libc::EINVAL => {
                // Kernels before 5.14 lack MADV_POPULATE_WRITE: touch one byte per page.
                let step = self.page_size.bytes() as usize;
                for off in (0..self.size as usize).step_by(step) {
                    // SAFETY: off < size, inside our live mapping; a volatile read-then-write of
                    // the same value faults the page in for writing without changing it.
                    unsafe {
                        let p = self.ptr.as_ptr().add(off);
                        p.write_volatile(p.read_volatile());
                    }
                }
                Ok(())
            }
            other => other,
        }
    }

    fn madvise(&self, advice: libc::c_int, op: &'static str) -> Result<()> {
        // SAFETY: the range is exactly our own live mapping; madvise does not invalidate it.
        let rc = unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.mapped, advice) };
        if rc == 0 {
            Ok(())
        } else {
            Err(Error::last_os(op))
        }
    }

    /// Host address of the first byte.
    #[inline]
    pub fn hva(&self) -> Hva {
        Hva::from_ptr(self.ptr.as_ptr())
    }

    /// Raw pointer to the first byte. Never turn it into a reference: the memory is shared.
    #[inline]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Size in bytes.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The page size the kernel backs this memory with (the guaranteed one: 4 KiB for THP).
    #[inline]
    pub fn page_size(&self) -> PageSize {
        self.page_size
    }

    /// The huge page size the kernel backs (or may back) this memory with: the hugetlbfs page
    /// size, 2 MiB for THP (best effort: the kernel may split or not find them), else `None`.
    pub fn huge_page_size(&self) -> Option<PageSize> {
        match self.kind {
            BackingKind::Hugetlb(p) => Some(p),
            BackingKind::Thp => Some(PageSize::Size2M),
            BackingKind::Received { page_size } | BackingKind::Adopted { page_size, .. }
                if page_size.bytes() > 4096 =>
            {
                Some(page_size)
            }
            _ => None,
        }
    }

    /// Whether the kernel may back this memory's 4 KiB pages with larger folios (transparent
    /// huge pages of any size), by its THP settings for anonymous or for shmem memory.
    /// hugetlbfs and THP backings, whose pins hold whole huge pages, answer false. A tmpfs
    /// file from a mount with its own `huge=` option is judged by the shmem settings.
    pub(crate) fn may_have_large_folios(&self) -> bool {
        let (anon, shmem) = thp_allowed();
        match &self.kind {
            BackingKind::Hugetlb(_) | BackingKind::Thp => false,
            BackingKind::Received { page_size } | BackingKind::Adopted { page_size, .. }
                if page_size.bytes() > 4096 =>
            {
                false
            }
            BackingKind::PrivateAnon
            | BackingKind::File { shared: false, .. }
            | BackingKind::Adopted { shared: false, .. } => anon,
            _ => shmem,
        }
    }

    /// What kind of memory this is.
    #[inline]
    pub fn kind(&self) -> &BackingKind {
        &self.kind
    }

    /// Whether another mapping of the same memory (another process, a second mmap of the fd)
    /// sees writes made here.
    pub fn is_shared(&self) -> bool {
        match &self.kind {
            BackingKind::SharedAnon
            | BackingKind::Memfd
            | BackingKind::Hugetlb(_)
            | BackingKind::Received { .. } => true,
            BackingKind::File { shared, .. } | BackingKind::Adopted { shared, .. } => *shared,
            BackingKind::PrivateAnon | BackingKind::Thp => false,
        }
    }

    /// Whether this is a mapping the caller owns ([`Backing::adopt`]), which memvisor never
    /// unmaps.
    pub fn is_adopted(&self) -> bool {
        self.adopted.is_some()
    }

    /// The file descriptor behind the memory (memfd, hugetlbfs memfd, file), to pass to another
    /// process; `None` for anonymous memory (and for adopted memory given without one).
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|f| f.as_fd())
    }

    /// Copies `buf.len()` bytes at `offset` into `buf`. EFAULT, nothing copied, if the range
    /// passes the end of the backing.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let p = self.checked_ptr(offset, buf.len())?;
        // SAFETY: checked_ptr proved offset..offset+len lies in our live mapping.
        unsafe { copy::from_guest(p, buf) };
        Ok(())
    }

    /// Copies `buf` into the backing at `offset`. EFAULT, nothing copied, if the range passes
    /// the end of the backing.
    pub fn write(&self, offset: u64, buf: &[u8]) -> Result<()> {
        let p = self.checked_ptr(offset, buf.len())?;
        // SAFETY: checked_ptr proved offset..offset+len lies in our live mapping.
        unsafe { copy::to_guest(buf, p) };
        Ok(())
    }

    fn checked_ptr(&self, offset: u64, len: usize) -> Result<*mut u8> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => {
                // SAFETY: offset < size, so the result stays inside our mapping.
                Ok(unsafe { self.ptr.as_ptr().add(offset as usize) })
            }
            _ => Err(Error::Fault {
                space: "backing offset",
                addr: offset.max(self.size),
                start: offset,
                len: len as u64,
            }),
        }
    }
}

impl Drop for Backing {
    fn drop(&mut self) {
        if self.adopted.is_some() {
            // The caller's mapping: it stays; the keeper (a field) is dropped after this.
            return;
        }
        // SAFETY: we own this mapping, and every user holds an Arc to us, so none is left.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
    }
}

fn memfd(flags: libc::c_uint, size: u64) -> Result<OwnedFd> {
    // SAFETY: the name is a valid NUL-terminated string; flags are plain bits.
    let raw = unsafe { libc::memfd_create(c"memvisor".as_ptr(), flags) };
    if raw < 0 {
        return Err(Error::last_os("memfd_create"));
    }
    // SAFETY: memfd_create returned a new descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(raw) };
    file.set_len(size).map_err(|source| Error::Os {
        op: "ftruncate memfd",
        source,
    })?;
    Ok(OwnedFd::from(file))
}

/// Maps `len` bytes starting on a boundary of max(2 MiB, page size).
fn map_aligned(
    len: usize,
    share: libc::c_int,
    anon: bool,
    fd: Option<&OwnedFd>,
    file_offset: u64,
    page: PageSize,
) -> Result<NonNull<u8>> {
    let align = ALIGN_2M.max(page.bytes()) as usize;
    let prot = libc::PROT_READ | libc::PROT_WRITE;
    // Reserve an address window with room to align, then place the real mapping in it.
    let window = len.checked_add(align).ok_or(Error::OutOfBounds {
        what: "backing size",
        start: 0,
        len: len as u64,
        limit: (usize::MAX - align) as u64,
    })?;
    // SAFETY: a fresh PROT_NONE reservation at an address the kernel picks; touches nothing.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            window,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(Error::last_os("mmap (address reservation)"));
    }
    let start = (base as usize).next_multiple_of(align);
    let flags = share | libc::MAP_FIXED | if anon { libc::MAP_ANONYMOUS } else { 0 };
    let raw_fd = fd.map_or(-1, |f| f.as_raw_fd());
    // SAFETY: [start, start+len) lies inside the reservation we own, so MAP_FIXED replaces only
    // our own PROT_NONE pages.
    let p = unsafe {
        libc::mmap(
            start as *mut _,
            len,
            prot,
            flags,
            raw_fd,
            file_offset as libc::off_t,
        )
    };
    let err = (p == libc::MAP_FAILED).then(|| Error::last_os("mmap"));
    // Give back what is left of the reservation (all of it if the real mmap failed).
    let (keep_start, keep_end) = if err.is_some() {
        (start, start)
    } else {
        (start, start + len)
    };
    // SAFETY: both pieces are parts of our reservation that the real mapping does not use.
    unsafe {
        if keep_start > base as usize {
            libc::munmap(base, keep_start - base as usize);
        }
        let window_end = base as usize + window;
        if window_end > keep_end {
            libc::munmap(keep_end as *mut _, window_end - keep_end);
        }
    }
    match err {
        Some(e) => Err(e),
        None => Ok(NonNull::new(p.cast()).expect("mmap returned null without MAP_FAILED")),
    }
}

/// The process's received mappings, by file and range: a range of a file that is already mapped
/// (and still alive) is handed out again instead of being mapped a second time.
///
/// Two vhost-user devices of one VMM each receive the guest's memory as their own descriptors;
/// mapped twice, the memory would have two host addresses, and a pin made through one mapping
/// would be invisible to a discard through the other (pins are known by host address). Through
/// [`SharedMappings::map`] both get the same [`Backing`]. Files are told apart by device and
/// inode; only the same offset and size match (a VMM sends the same table to each device).
///
/// A `SharedMappings` is a handle: its clones share one table. A server makes the process's
/// ([`SharedMappings::global`]) once and hands a clone to every front end; a front end never
/// reaches for the global itself, so tests and embedders can give it a table of their own.
#[derive(Debug, Default, Clone)]
pub struct SharedMappings {
    live: Arc<Mutex<HashMap<FileRange, Weak<Backing>>>>,
}

/// A range of a file: device, inode, offset, size.
type FileRange = (u64, u64, u64, u64);

impl SharedMappings {
    /// A handle on the process's table (the same one at every call): what a server passes to
    /// its front ends so that all of them share one.
    pub fn global() -> SharedMappings {
        static GLOBAL: OnceLock<SharedMappings> = OnceLock::new();
        GLOBAL.get_or_init(SharedMappings::default).clone()
    }

    /// The backing for `size` bytes of the file behind `fd` from `file_offset`: the live one if
    /// this range of this file is mapped already (then `fd` is closed), else a new one made by
    /// [`Backing::from_fd`], with its checks.
    pub fn map(&self, fd: OwnedFd, file_offset: u64, size: u64) -> Result<Arc<Backing>> {
        let (st, _) = file_identity(&fd)?;
        let key = (st.st_dev, st.st_ino, file_offset, size);
        let mut live = lock(&self.live);
        live.retain(|_, b| b.strong_count() > 0);
        if let Some(b) = live.get(&key).and_then(Weak::upgrade) {
            return Ok(b);
        }
        let backing = Arc::new(Backing::from_fd(fd, file_offset, size)?);
        live.insert(key, Arc::downgrade(&backing));
        Ok(backing)
    }

    /// The backing and the offset in it for `size` bytes of the file behind `fd` from
    /// `file_offset`, where a peer sends a descriptor with every small map (vfio-user's
    /// `DMA_MAP`: one per 4 KiB page a guest maps through its IOMMU). A live mapping of the same
    /// file that covers the range is handed out again (then `fd` is closed); otherwise the whole
    /// file is mapped once, with [`Backing::from_fd`]'s checks, so thousands of small maps cost
    /// one `mmap` and one descriptor rather than one each. EINVAL if the range passes the
    /// file's end.
    pub fn map_within(
        &self,
        fd: OwnedFd,
        file_offset: u64,
        size: u64,
    ) -> Result<(Arc<Backing>, u64)> {
        let (st, page_size) = file_identity(&fd)?;
        let end = file_offset.checked_add(size).ok_or(Error::RangeWraps {
            what: "received memory range",
            start: file_offset,
            len: size,
        })?;
        let mut live = lock(&self.live);
        for (&(dev, ino, off, len), b) in live.iter() {
            if (dev, ino) == (st.st_dev, st.st_ino) && off <= file_offset && end <= off + len {
                if let Some(b) = b.upgrade() {
                    return Ok((b, file_offset - off));
                }
            }
        }
        live.retain(|_, b| b.strong_count() > 0);
        let file_len = st.st_size.max(0) as u64;
        let whole = mappable_end(file_len, page_size);
        if end > whole {
            return Err(Error::OutOfBounds {
                what: "received memory range (a page wholly past the end of the file: touching it would be SIGBUS)",
                start: file_offset,
                len: size,
                limit: file_len,
            });
        }
        let backing = Arc::new(Backing::from_fd(fd, 0, whole)?);
        live.insert((st.st_dev, st.st_ino, 0, whole), Arc::downgrade(&backing));
        Ok((backing, file_offset))
    }

    /// Live mappings in the table.
    pub fn len(&self) -> usize {
        let live = lock(&self.live);
        live.values().filter(|b| b.strong_count() > 0).count()
    }

    /// Whether no mapping is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// `fstat` and the page size of the file system behind `fd` (hugetlbfs: its huge pages).
/// How far a file of `file_len` bytes can be mapped and touched: to the end of the page holding
/// its last byte. The kernel faults a page in if any of it is inside the file (the rest reads
/// as zeros) and raises SIGBUS only for a page wholly past the end.
fn mappable_end(file_len: u64, page_size: PageSize) -> u64 {
    file_len
        .checked_next_multiple_of(page_size.bytes())
        .unwrap_or(file_len)
}

pub(crate) fn file_identity(fd: &OwnedFd) -> Result<(libc::stat, PageSize)> {
    // SAFETY: fstat and fstatfs write only into the structs we pass; the fd is ours.
    let (st, sfs) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd.as_raw_fd(), &mut st) != 0 {
            return Err(Error::last_os("fstat (memory descriptor)"));
        }
        let mut sfs: libc::statfs = std::mem::zeroed();
        if libc::fstatfs(fd.as_raw_fd(), &mut sfs) != 0 {
            return Err(Error::last_os("fstatfs (memory descriptor)"));
        }
        (st, sfs)
    };
    let page = if sfs.f_type == libc::HUGETLBFS_MAGIC {
        match sfs.f_bsize as u64 {
            b if b == PageSize::Size2M.bytes() => PageSize::Size2M,
            b if b == PageSize::Size1G.bytes() => PageSize::Size1G,
            b => {
                return Err(Error::Unsupported {
                    what: "hugetlbfs page size",
                    why: format!("{b} bytes; memvisor knows 2 MiB and 1 GiB"),
                });
            }
        }
    } else {
        PageSize::Size4K
    };
    Ok((st, page))
}

fn hugepage_dir(page: PageSize) -> String {
    format!(
        "/sys/kernel/mm/hugepages/hugepages-{}kB",
        page.bytes() / 1024
    )
}

fn read_counter(path: &str) -> Result<u64> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Os {
        op: "read huge page counter",
        source,
    })?;
    text.trim().parse().map_err(|_| Error::Unsupported {
        what: "huge page counters",
        why: format!("{path} holds {text:?}, not a number"),
    })
}

/// Whether the kernel's THP settings may let anonymous and shmem memory have large folios, by
/// any setting for them not `never` (nor `deny`): the top-level one, or a per-size one
/// (Linux 6.8 and later; `inherit` reads the top level). Erring towards yes: the per-size shmem
/// settings govern anonymous shared memory only, memfds the top-level one. Read once per
/// process; `MADV_COLLAPSE`, which ignores the settings, is not foreseen.
fn thp_allowed() -> (bool, bool) {
    static ALLOWED: OnceLock<(bool, bool)> = OnceLock::new();
    *ALLOWED.get_or_init(|| {
        const DIR: &str = "/sys/kernel/mm/transparent_hugepage";
        // The bracketed choice of a sysfs setting, e.g. "always [madvise] never".
        let chosen = |path: &std::path::Path| -> Option<String> {
            let text = std::fs::read_to_string(path).ok()?;
            let (_, rest) = text.split_once('[')?;
            Some(rest.split_once(']')?.0.to_string())
        };
        let on = |v: &str| !matches!(v, "never" | "deny");
        let top = [
            chosen(std::path::Path::new(&format!("{DIR}/enabled"))),
            chosen(std::path::Path::new(&format!("{DIR}/shmem_enabled"))),
        ];
        let mut allowed = [0, 1].map(|i| top[i].as_deref().is_some_and(on));
        for size in std::fs::read_dir(DIR).into_iter().flatten().flatten() {
            if !size.file_name().to_string_lossy().starts_with("hugepages-") {
                continue;
            }
            for (i, file) in ["enabled", "shmem_enabled"].into_iter().enumerate() {
                if let Some(v) = chosen(&size.path().join(file)) {
                    let v = if v == "inherit" {
                        top[i].clone().unwrap_or_default()
                    } else {
                        v
                    };
                    allowed[i] |= on(&v);
                }
            }
        }
        (allowed[0], allowed[1])
    })
}

/// Huge pages of `page` size that are free and not promised to another mapping.
pub fn free_huge_pages(page: PageSize) -> Result<u64> {
    let dir = hugepage_dir(page);
    if !std::path::Path::new(&dir).exists() {
        return Err(Error::Unsupported {
            what: "huge pages of this size",
            why: format!("{dir} does not exist (kernel without {page} hugetlb support)"),
        });
    }
    let free = read_counter(&format!("{dir}/free_hugepages"))?;
    let resv = read_counter(&format!("{dir}/resv_hugepages"))?;
    Ok(free.saturating_sub(resv))
}

/// `MemAvailable` of /proc/meminfo, in bytes: what could become huge pages without swapping.
fn available_memory() -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").map_err(|source| Error::Os {
        op: "read /proc/meminfo",
        source,
    })?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| Error::Unsupported {
            what: "MemAvailable",
            why: "/proc/meminfo does not say".into(),
        })
}

static POOL_LOCK: Mutex<()> = Mutex::new(());

/// A temporary increase of the kernel's huge page pool, undone on drop.
///
/// For tests, benchmarks and simple tools that run as root: `add(Size2M, n)` grows
/// `nr_hugepages` by `n` (so concurrent reservations never take each other's pages) and checks
/// the kernel really found them; dropping shrinks the pool by the same amount. Pages still in
/// use at that point stay until their mapping goes (the kernel turns them into surplus pages).
#[derive(Debug)]
pub struct HugePageReservation {
    page: PageSize,
    count: u64,
}

impl HugePageReservation {
    /// Adds `count` pages of `page` size to the pool. Needs root (EACCES otherwise); fails with
    /// ENOMEM, restoring the pool, if the kernel cannot find that many contiguous free blocks.
    pub fn add(page: PageSize, count: u64) -> Result<Self> {
        let _guard = lock(&POOL_LOCK);
        let path = format!("{}/nr_hugepages", hugepage_dir(page));
        let before = free_huge_pages(page)?;
        let nr = read_counter(&path)?;
        // Never ask the kernel for more than memory holds: it would try to take all of it.
        let fits = available_memory()? / page.bytes();
        let target = match nr.checked_add(count) {
            Some(target) if count <= fits => target,
            _ => {
                return Err(Error::HugePagesUnavailable {
                    page_size: page,
                    needed: count,
                    free: before + fits,
                });
            }
        };
        write_counter(&path, target)?;
        let got = read_counter(&path)?.saturating_sub(nr);
        if got < count {
            write_counter(&path, nr)?;
            return Err(Error::HugePagesUnavailable {
                page_size: page,
                needed: count,
                free: before + got,
            });
        }
        Ok(HugePageReservation { page, count })
    }
}

impl Drop for HugePageReservation {
    fn drop(&mut self) {
        let _guard = lock(&POOL_LOCK);
        let path = format!("{}/nr_hugepages", hugepage_dir(self.page));
        if let Ok(nr) = read_counter(&path) {
            let _ = write_counter(&path, nr.saturating_sub(self.count));
        }
    }
}

fn write_counter(path: &str, value: u64) -> Result<()> {
    std::fs::write(path, value.to_string()).map_err(|source| Error::Os {
        op: "write nr_hugepages",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_must_be_a_nonzero_page_multiple() {
        let e = Backing::new(BackingKind::PrivateAnon, 0).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        let e = Backing::new(BackingKind::Memfd, 0x1800).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("0x1800"), "{e}");
    }

    #[test]
    fn mappings_start_on_2m_boundaries() {
        for kind in [
            BackingKind::PrivateAnon,
            BackingKind::Thp,
            BackingKind::Memfd,
        ] {
            let b = Backing::new(kind.clone(), 0x30_0000).unwrap();
            assert!(
                b.hva().is_aligned(PageSize::Size2M),
                "{kind:?} at {:?}",
                b.hva()
            );
        }
    }

    #[test]
    fn read_write_are_bounds_checked() {
        let b = Backing::new(BackingKind::PrivateAnon, 0x2000).unwrap();
        b.write(0x1ffc, &[1, 2, 3, 4]).unwrap();
        let mut out = [0u8; 4];
        b.read(0x1ffc, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        let e = b.write(0x1ffd, &[0; 4]).unwrap_err();
        assert_eq!(e.errno(), libc::EFAULT);
        assert!(b.read(u64::MAX, &mut out).is_err());
    }
}
