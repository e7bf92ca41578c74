//! CPU access to IOVAs without pinning (seed 004a, Linux's `vfio_dma_rw`).
//!
//! An emulated device often just needs to copy a descriptor or a buffer from or to an IOVA
//! range. Pinning for that — fault in, lock, copy, unlock — costs far more than the copy. Here
//! [`DmaSpace::dma_read`] and [`DmaSpace::dma_write`] check the whole range against one snapshot
//! (mapped, contiguous, READ resp. WRITE allowed, host address valid) and then copy piece by
//! piece with raw-pointer copies. The snapshot holds every mapping's memory, so an unmap racing
//! the copy cannot unmap memory under it: the copy completes against the old mappings or, if it
//! started after the unmap, fails with EFAULT. Nothing is copied when any check fails.

use super::{Access, DmaSpace};
use crate::addr::Iova;
use crate::copy;
use crate::error::{Error, Result};

impl DmaSpace {
    /// Copies from `[iova, iova + buf.len())` into `buf`. EFAULT, nothing copied, if any byte is
    /// unmapped or its host address invalidated (after waiting up to `vaddr_wait`); EPERM if a
    /// mapping does not allow READ.
    pub fn dma_read(&self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        let len = buf.len();
        self.copy_pieces(iova, len, Access::Read, |hva, at, n| {
            // SAFETY: copy_pieces hands out only ranges inside valid mappings of the snapshot it
            // holds, which keeps their memory mapped (or, for raw mappings, the caller promised
            // to); buf is caller memory, never guest memory.
            unsafe { copy::from_guest(hva as usize as *const u8, &mut buf[at..at + n]) }
        })
    }

    /// Copies `buf` to `[iova, iova + buf.len())`, marking the pages dirty when tracking is on.
    /// EFAULT, nothing copied, if any byte is unmapped or invalidated; EPERM if a mapping does
    /// not allow WRITE.
    pub fn dma_write(&self, iova: Iova, buf: &[u8]) -> Result<()> {
        self.copy_pieces(iova, buf.len(), Access::Write, |hva, at, n| {
            // SAFETY: as in dma_read; the mappings allow WRITE.
            unsafe { copy::to_guest(&buf[at..at + n], hva as usize as *mut u8) }
        })
    }

    /// Checks `[iova, iova + len)` for `access` against one snapshot, then calls
    /// `copy(host address, offset in the caller's buffer, bytes)` for each piece.
    fn copy_pieces(
        &self,
        iova: Iova,
        len: usize,
        access: Access,
        mut copy: impl FnMut(u64, usize, usize),
    ) -> Result<()> {
        let min_page = self.shared.min_page;
        self.with_snapshot(|snap| {
            let mut at = 0usize;
            snap.for_each_piece(iova.0, len as u64, access, min_page, |hva, n| {
                copy(hva, at, n as usize);
                at += n as usize;
            })
        })
        .map_err(|e| busy_is_fault(e, iova, len))
    }
}

/// `vfio_dma_rw` reports an invalidated host address as EFAULT, not EBUSY.
fn busy_is_fault(e: Error, iova: Iova, len: usize) -> Error {
    match e {
        Error::Busy { addr, .. } => Error::Fault {
            space: "iova (host address invalidated)",
            addr,
            start: iova.0,
            len: len as u64,
        },
        other => other,
    }
}
