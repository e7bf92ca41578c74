//! rust-vmm's vm-memory traits over the device address space (cargo feature `vm-memory`).
//!
//! A device behind an IOMMU sees I/O virtual addresses everywhere: in its ring addresses, in
//! every descriptor, in an indirect descriptor table. rust-vmm's virtio-queue reads all of those
//! through one vm-memory [`GuestMemory`]. [`DmaMemory`] is that [`GuestMemory`], addressed by
//! IOVA: each access is translated by the [`DmaSpace`] — the same translation, permissions,
//! dirty tracking and errors as [`DmaSpace::translate`] — and then copied through
//! [`VolatileSlice`]s over the host memory behind it. Without an IOMMU the space is the identity
//! over guest memory (IOVA = GPA), so one view serves both cases and a device never turns a
//! device address into a guest physical one.
//!
//! **Why not vm-memory's `IommuMemory`.** vm-memory 0.18 (feature `iommu`) offers
//! `IommuMemory`, which keeps an IOTLB of its own in front of a physical `GuestMemoryBackend`.
//! Here the space already *is* the IOTLB: a second cache would have to be invalidated in step
//! with it, and the two could disagree in the window between. [`DmaMemory`] implements the trait
//! `IommuMemory` implements ([`GuestMemory`]) directly over the one translation memvisor keeps.
//!
//! **Lifetime.** A view is built from one snapshot of the space ([`DmaSpace::memory`]) and holds
//! it, so the memory of every mapping it can reach stays mapped while the view, or any slice
//! borrowed from it, lives — as a [`crate::DmaCursor`] does. A view does not follow later changes,
//! and an unmap does not wait for views: build a view for one pass over a queue, on the thread
//! that also applies the unmaps and invalidations, and drop it before applying them (what the
//! vhost-user back end does). A view kept past an unmap would still read the old memory, which a
//! device must not touch once the unmap is answered.
//!
//! **Repeated accesses.** A ring pass reads the same few pages over and over (the rings, the
//! descriptor table, the request headers), so each access first asks the mapping its thread hit
//! last, as [`DmaSpace::translate`] does, but checked against the generation of the view's own
//! snapshot: a hit taken in that snapshot names a mapping the view keeps mapped. Only where that
//! fails does it read the page table or, for addresses the table does not cover (libblkio's are
//! its own process addresses, above the table's 512 GiB), search the sorted index.
//!
//! **Small values.** A device that walks its own rings reads and writes 2-, 8- and 16-byte
//! values (an available ring entry, a used element, a descriptor). Through the vm-memory
//! traits each costs a slice iterator and an error chain around one piece, more than the
//! translation; [`DmaMemory::read_value`] and [`DmaMemory::write_value`] make the same
//! translation (same hit, checks, dirty marking and misses) and one device copy. The
//! vhost-user back end reads every chain and available ring entry, and writes every used
//! element, this way.
//!
//! **Misses.** A translation that fails because nothing is mapped (EFAULT,
//! [`crate::Error::Fault`]) is a miss an IOTLB can fill: the view remembers the first one
//! ([`DmaMemory::take_miss`]) before failing the access with
//! [`GuestMemoryError::InvalidGuestAddress`]. virtio-queue ends a descriptor chain silently on a
//! failed read, so a device asks the view after walking a chain whether the chain was cut short
//! by a miss (then it puts the chain back and asks for the translation) or is really malformed.
//! A permission failure (EPERM) is no miss: the access fails with an `IOError` of kind
//! `PermissionDenied` wrapping memvisor's error, as [`crate::SlotMemory`] does for read-only slots.
//!
//! **Dirty pages.** Writes through the view are device writes: the translation marks their pages
//! dirty when the space tracks them ([`DmaSpace::start_dirty_tracking`]), so the view carries no
//! vm-memory bitmap of its own (`Bitmap = ()`).
//!
//! **Physical layer.** There is none to hand out: addresses are IOVAs, so
//! [`GuestMemory::physical_memory`] is `None` (the associated type names [`SlotRegions`] only
//! because the trait needs one).

use std::io;
use std::iter::FusedIterator;
use std::sync::{Arc, Mutex};

use ::vm_memory::bitmap::BS;
use ::vm_memory::guest_memory::GuestMemorySliceIterator;
use ::vm_memory::{GuestAddress, GuestMemory, GuestMemoryError, Permissions, VolatileSlice};

use super::sg::Miss;
use super::{DmaSnapshot, DmaSpace, Prot};
use crate::addr::Iova;
use crate::error::Error;
use crate::vm_memory::SlotRegions;

/// The device address space at one snapshot as a vm-memory [`GuestMemory`] addressed by IOVA.
/// See the module docs.
pub struct DmaMemory {
    space: DmaSpace,
    snapshot: Arc<DmaSnapshot>,
    miss: Mutex<Option<Miss>>,
}

impl std::fmt::Debug for DmaMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaMemory")
            .field("generation", &self.snapshot.generation)
            .field("miss", &self.peek_miss())
            .finish()
    }
}

impl DmaSpace {
    /// A vm-memory view of the space as it is now, addressed by IOVA (see [`DmaMemory`]).
    pub fn memory(&self) -> DmaMemory {
        DmaMemory {
            space: self.clone(),
            snapshot: self.shared.current.load_full(),
            miss: Mutex::new(None),
        }
    }
}

impl DmaMemory {
    /// The first access since the last call that failed because nothing was mapped, if any;
    /// the view forgets it.
    pub fn take_miss(&self) -> Option<Miss> {
        self.miss.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn peek_miss(&self) -> Option<Miss> {
        *self.miss.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first byte of `[iova, iova + len)` the view cannot give `access` to, and why;
    /// `Ok(())` if every byte is reachable. Remembers a miss as an access would.
    pub fn check(&self, iova: Iova, len: u64, access: Prot) -> crate::Result<()> {
        self.pieces(iova, len, access, "view access", |_, _| {})
    }

    /// Reads a `T` at `iova` in the view's snapshot, as a device reads it: translated like every
    /// access of the view (its thread's last hit first), a miss remembered, and the bytes copied
    /// with memvisor's device copies (a racing guest write leaves any mix of old and new
    /// bytes, never undefined behaviour). What vm-memory's `Bytes::read_obj` does through
    /// [`GuestMemory::get_slices`], without its slice iterator and error chain around each
    /// piece: reading a split ring's 16-byte descriptor this way costs a translation and one
    /// copy. Errors as [`DmaMemory::check`] for READ: EFAULT where nothing is mapped (a miss),
    /// EPERM where a mapping does not allow READ, EINVAL where the range wraps.
    #[inline(always)]
    pub fn read_value<T: ::vm_memory::ByteValued>(&self, iova: Iova) -> crate::Result<T> {
        let mut value = T::zeroed();
        let bytes = value.as_mut_slice();
        self.pieces(
            iova,
            bytes.len() as u64,
            Prot::READ,
            "view read",
            |hva, at| {
                // SAFETY: `pieces` hands out host addresses of the view's snapshot, which the view
                // holds while `self` is borrowed: the piece's bytes at `hva` stay mapped and
                // readable for the copy, and they are guest memory, never `value` (a local). `at`
                // lies inside `bytes`.
                unsafe { crate::copy::from_guest(hva, &mut bytes[at]) }
            },
        )?;
        Ok(value)
    }

    /// Writes `value` at `iova` in the view's snapshot, as a device writes it: translated for
    /// WRITE like every write of the view (its pages marked dirty while the space logs them), a
    /// miss remembered, the bytes copied with memvisor's device copies. The write counterpart of
    /// [`DmaMemory::read_value`] (a used ring's 8-byte element), with its errors for WRITE. A
    /// value across two mappings is written piece by piece, as vm-memory's `write_slice` does:
    /// a piece that fails leaves the pieces before it written.
    #[inline(always)]
    pub fn write_value<T: ::vm_memory::ByteValued>(
        &self,
        iova: Iova,
        value: T,
    ) -> crate::Result<()> {
        let bytes = value.as_slice();
        self.pieces(
            iova,
            bytes.len() as u64,
            Prot::WRITE,
            "view write",
            |hva, at| {
                // SAFETY: as in `read_value`: the piece's bytes at `hva` stay mapped and writable
                // for the copy, they are guest memory, never `value`, and `at` lies inside `bytes`.
                unsafe { crate::copy::to_guest(&bytes[at], hva) }
            },
        )
    }

    /// Translates `[iova, iova + len)` for `access` piece by piece (one piece per mapping it
    /// crosses), handing each piece's host address and its place in the range to `each`; the
    /// first failure ends it (a miss remembered). `what` names the access in a wrapping range's
    /// error.
    #[inline(always)]
    fn pieces(
        &self,
        iova: Iova,
        len: u64,
        access: Prot,
        what: &'static str,
        mut each: impl FnMut(*mut u8, std::ops::Range<usize>),
    ) -> crate::Result<()> {
        let Some(end) = iova.0.checked_add(len) else {
            return Err(Error::RangeWraps {
                what,
                start: iova.0,
                len,
            });
        };
        let (mut at, mut done) = (iova.0, 0usize);
        while at < end {
            let t = self.translate(at, end - at, access)?;
            // `t.len` is at most `end - at`: the pieces stay inside `[0, len)`.
            let n = t.len as usize;
            each(t.hva.0 as usize as *mut u8, done..done + n);
            done += n;
            at += t.len;
        }
        Ok(())
    }

    /// One translation in the view's snapshot, remembering a miss. Inlined into each access,
    /// so that a hit's answer is not moved through a `Result` in memory (it was half the cost
    /// of a descriptor read); the miss is noted out of line.
    #[inline(always)]
    fn translate(&self, iova: u64, len: u64, access: Prot) -> crate::Result<super::Translation> {
        let r = self
            .space
            .translate_held(&self.snapshot, Iova(iova), len, access);
        if let Err(e) = &r {
            self.note_miss(e, access);
        }
        r
    }

    /// Remembers a failed translation's address if it was a miss (nothing mapped).
    #[cold]
    #[inline(never)]
    fn note_miss(&self, e: &Error, access: Prot) {
        if let Error::Fault { addr, .. } = e {
            let mut m = self.miss.lock().unwrap_or_else(|e| e.into_inner());
            m.get_or_insert(Miss {
                iova: Iova(*addr),
                access,
            });
        }
    }
}

/// vm-memory's permissions as the one access memvisor checks: a write needs WRITE (and a
/// read-modify-write, `ReadWrite`, is checked as a write: the device space's WRITE mappings
/// are the ones that allow both for a device).
fn access_of(p: Permissions) -> Prot {
    if p.has_write() {
        Prot::WRITE
    } else {
        Prot::READ
    }
}

/// The vm-memory error for a failed translation at `iova`.
fn guest_error(iova: u64, e: Error) -> GuestMemoryError {
    match e {
        Error::Fault { .. } => GuestMemoryError::InvalidGuestAddress(GuestAddress(iova)),
        Error::PermissionDenied { .. } => {
            GuestMemoryError::IOError(io::Error::new(io::ErrorKind::PermissionDenied, e))
        }
        e => GuestMemoryError::IOError(io::Error::other(e)),
    }
}

/// The slices of one access: one per mapping the range crosses; the first failure ends it.
pub struct DmaSlices<'a> {
    view: &'a DmaMemory,
    at: u64,
    left: u64,
    access: Prot,
}

impl<'a> Iterator for DmaSlices<'a> {
    type Item = ::vm_memory::GuestMemoryResult<VolatileSlice<'a, ()>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        match self.view.translate(self.at, self.left, self.access) {
            Ok(t) => {
                self.at = self.at.wrapping_add(t.len);
                self.left -= t.len;
                // SAFETY: the translation is of the view's snapshot, which the view holds for
                // 'a: every mapping in it keeps its backing, and so these `t.len` bytes at
                // `t.hva`, mapped. Guest memory is shared with the guest; `VolatileSlice` only
                // ever accesses it with volatile copies, never through a reference.
                Some(Ok(unsafe {
                    VolatileSlice::new(t.hva.0 as usize as *mut u8, t.len as usize)
                }))
            }
            Err(e) => {
                let at = self.at;
                self.left = 0;
                Some(Err(guest_error(at, e)))
            }
        }
    }
}

impl FusedIterator for DmaSlices<'_> {}

impl<'a> GuestMemorySliceIterator<'a, ()> for DmaSlices<'a> {}

impl GuestMemory for DmaMemory {
    type PhysicalMemory = SlotRegions;
    type Bitmap = ();

    fn check_range(&self, addr: GuestAddress, count: usize, access: Permissions) -> bool {
        count == 0
            || self
                .check(Iova(addr.0), count as u64, access_of(access))
                .is_ok()
    }

    fn get_slices<'a>(
        &'a self,
        addr: GuestAddress,
        count: usize,
        access: Permissions,
    ) -> ::vm_memory::GuestMemoryResult<impl GuestMemorySliceIterator<'a, BS<'a, Self::Bitmap>>>
    {
        if addr.0.checked_add(count as u64).is_none() {
            return Err(GuestMemoryError::GuestAddressOverflow);
        }
        Ok(DmaSlices {
            view: self,
            at: addr.0,
            left: count as u64,
            access: access_of(access),
        })
    }

    fn physical_memory(&self) -> Option<&SlotRegions> {
        None
    }
}
