//! CPU access to IOVAs without pinning (seed 004a, Linux's `vfio_dma_rw`).
//!
//! An emulated device often just needs to copy a descriptor or a buffer from or to an IOVA
//! range. Pinning for that — fault in, lock, copy, unlock — costs far more than the copy. Here
//! [`DmaSpace::dma_read`] and [`DmaSpace::dma_write`] check the whole range against one snapshot
//! (mapped, contiguous, READ resp. READ and WRITE allowed, host address valid) and then copy piece by
//! piece with raw-pointer copies. The snapshot holds every mapping's memory, so an unmap racing
//! the copy cannot unmap memory under it: the copy completes against the old mappings or, if it
//! started after the unmap, fails with EINVAL. Nothing is copied when any check fails.

use super::{DmaSnapshot, DmaSpace, Prot, VaddrRule};
use crate::addr::Iova;
use crate::copy;
use crate::error::{Error, Result};

impl DmaSpace {
    /// Copies from `[iova, iova + buf.len())` into `buf`. Nothing is copied if any check fails:
    /// EINVAL for an empty buffer or if any byte is unmapped (type1's `vfio_dma_rw`); EPERM if a
    /// mapping does not allow READ; EFAULT if a host address is invalidated (after waiting up to
    /// `vaddr_wait`).
    pub fn dma_read(&self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        let len = buf.len();
        self.copy_pieces(iova, len, Prot::READ, |hva, at, n| {
            // SAFETY: copy_pieces hands out only ranges inside valid mappings of the snapshot it
            // holds, which keeps their memory mapped (or, for raw mappings, the caller promised
            // to); buf is caller memory, never guest memory.
            unsafe { copy::from_guest(hva as usize as *const u8, &mut buf[at..at + n]) }
        })
    }

    /// Copies `buf` to `[iova, iova + buf.len())`, marking the pages dirty when tracking is on.
    /// Errors as [`DmaSpace::dma_read`], except that the mappings must allow READ and WRITE
    /// (type1 checks READ for every CPU access, WRITE too for a write).
    pub fn dma_write(&self, iova: Iova, buf: &[u8]) -> Result<()> {
        self.copy_pieces(iova, buf.len(), Prot::RW, |hva, at, n| {
            // SAFETY: as in dma_read; the mappings allow WRITE.
            unsafe { copy::to_guest(&buf[at..at + n], hva as usize as *mut u8) }
        })
    }

    /// Checks `[iova, iova + len)` for `need` against one snapshot, then calls
    /// `copy(host address, offset in the caller's buffer, bytes)` for each piece.
    fn copy_pieces(
        &self,
        iova: Iova,
        len: usize,
        need: Prot,
        mut copy: impl FnMut(u64, usize, usize),
    ) -> Result<()> {
        if len == 0 {
            return Err(Error::ZeroSize { what: "dma copy" });
        }
        let min_page = self.shared.min_page;
        self.with_snapshot(|snap| {
            self.refuse_while_invalid(snap, iova.0)?;
            let mut at = 0usize;
            snap.for_each_piece(iova.0, len as u64, need, min_page, |hva, n| {
                copy(hva, at, n as usize);
                at += n as usize;
            })
        })
        .map_err(|e| as_type1_rw(e, iova, len))
    }
}

impl DmaSpace {
    /// Under [`VaddrRule::Refuse`], EBUSY while any mapping of `snap` has its host address
    /// invalidated (Linux 6.3's container-wide check in `vfio_dma_rw` and `pin_pages`).
    pub(super) fn refuse_while_invalid(&self, snap: &DmaSnapshot, iova: u64) -> Result<()> {
        if snap.invalid > 0 && self.shared.config.vaddr_rule == VaddrRule::Refuse {
            return Err(Error::Refused {
                addr: iova,
                why: format!(
                    "{} mapping(s) of the space have their host address invalidated; \
                     VaddrRule::Refuse, as Linux 6.3 on, refuses all device access until \
                     update_vaddr",
                    snap.invalid
                ),
            });
        }
        Ok(())
    }
}

/// `vfio_dma_rw`'s answers where they differ from translation's: an unmapped byte is EINVAL
/// (translation says EFAULT, like an IOMMU fault), an invalidated host address EFAULT.
fn as_type1_rw(e: Error, iova: Iova, len: usize) -> Error {
    match e {
        Error::Fault { addr, .. } => Error::NotMapped {
            addr,
            start: iova.0,
            len: len as u64,
        },
        Error::Busy { addr, .. } => Error::Fault {
            space: "iova (host address invalidated)",
            addr,
            start: iova.0,
            len: len as u64,
        },
        other => other,
    }
}
