//! CPU access to IOVAs without pinning (Linux's `vfio_dma_rw`, from the patch series "use
//! vfio_iova_rw() to read/write IOVAs from CPU side").
//!
//! An emulated device often just needs to copy a descriptor or a buffer from or to an IOVA
//! range. Pinning for that — fault in, lock, copy, unlock — costs far more than the copy. Here
//! [`DmaSpace::dma_read`] and [`DmaSpace::dma_write`] check the whole range against one snapshot
//! (mapped, contiguous, READ resp. READ and WRITE allowed, host address valid) and then copy piece by
//! piece with raw-pointer copies. The copy announces itself first (`grace`) and the snapshot
//! holds every mapping's memory, so an unmap racing the copy cannot take memory away under it:
//! the copy completes against the old mappings before the unmap returns or, if it started after
//! the unmap began, fails with EINVAL. Nothing is copied when any check fails.
//!
//! A copy that lies whole in the mapping this thread last hit (by a copy or a translation, at
//! the space's current generation, allowing the access, not logging dirty pages for a write)
//! takes a shortcut: no snapshot, no lookup, just the bounds and the generation. What keeps the
//! memory mapped then is the `grace` handshake — the copy announces itself in its thread's slot
//! and every change waits for announced copies before it drops the old snapshot — so such a copy
//! has ended before a racing unmap returns, and nothing is held after the call.
//!
//! A peer's memory ([`DmaSpace::map_remote`], a vfio-user map without a descriptor) has no host
//! address here: [`DmaSpace::dma_read_via`] / [`DmaSpace::dma_write_via`] check the range the
//! same way, copy the pieces in host memory and hand each piece in the peer's memory to the
//! caller's transport, so one device model serves both kinds of mapping.

use std::sync::Arc;

use super::index::{DmaSnapshot, Hot};
use super::translate::{copy_on_last_hit, mark_dirty, remember};
use super::{DmaSpace, Mapping, Prot};
use crate::addr::Iova;
use crate::copy;
use crate::error::{Error, Result};

impl DmaSpace {
    /// Copies from `[iova, iova + buf.len())` into `buf`. Nothing is copied if any check fails:
    /// EINVAL for an empty buffer or if any byte is unmapped (type1's `vfio_dma_rw`); EPERM if a
    /// mapping does not allow READ; EFAULT if a host address is invalidated (after waiting up to
    /// `vaddr_wait`) or a mapping is a peer's memory ([`DmaSpace::map_remote`]).
    #[inline]
    pub fn dma_read(&self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        if self.read_on_last_hit(iova, buf) {
            return Ok(());
        }
        self.dma_read_slow(iova, buf)
    }

    /// Copies `buf` to `[iova, iova + buf.len())`, marking the pages dirty when tracking is on.
    /// Errors as [`DmaSpace::dma_read`], except that the mappings must allow READ and WRITE
    /// (type1 checks READ for every CPU access, WRITE too for a write).
    #[inline]
    pub fn dma_write(&self, iova: Iova, buf: &[u8]) -> Result<()> {
        if self.write_on_last_hit(iova, buf) {
            return Ok(());
        }
        self.dma_write_slow(iova, buf)
    }

    /// `dma_read` on the thread's last hit, if the whole range lies in it ([`copy_on_last_hit`]).
    #[inline(always)]
    fn read_on_last_hit(&self, iova: Iova, buf: &mut [u8]) -> bool {
        let len = buf.len() as u64;
        copy_on_last_hit(&self.shared.head.0, iova.0, len, Prot::READ.0, |hva| {
            // SAFETY: copy_on_last_hit hands out the host address of a range inside a mapping
            // of the current generation that allows READ, and keeps its memory mapped until
            // the copy returns; buf is caller memory, never guest memory.
            unsafe { copy::from_guest(hva as usize as *const u8, buf) }
        })
    }

    /// `dma_write` on the thread's last hit, as `read_on_last_hit`. The hit never allows WRITE
    /// in a mapping that logs dirty pages, so there is nothing to mark.
    #[inline(always)]
    fn write_on_last_hit(&self, iova: Iova, buf: &[u8]) -> bool {
        let len = buf.len() as u64;
        copy_on_last_hit(&self.shared.head.0, iova.0, len, Prot::RW.0, |hva| {
            // SAFETY: as in read_on_last_hit; the mapping allows READ and WRITE.
            unsafe { copy::to_guest(buf, hva as usize as *mut u8) }
        })
    }

    #[inline(never)]
    fn dma_read_slow(&self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        self.dma_read_with(
            iova,
            buf,
            |_, _| unreachable!("host memory only"),
            Hot::VALID,
        )
    }

    #[inline(never)]
    fn dma_write_slow(&self, iova: Iova, buf: &[u8]) -> Result<()> {
        self.dma_write_with(
            iova,
            buf,
            |_, _| unreachable!("host memory only"),
            Hot::VALID,
        )
    }

    /// [`DmaSpace::dma_read`] over mappings of host memory and of a peer's memory
    /// ([`DmaSpace::map_remote`]) alike: pieces in host memory are copied here, each piece in a
    /// peer's memory is handed to `remote(iova, part of buf)` to fetch (a vfio-user server sends
    /// `DMA_READ`). The whole range is checked first, as for `dma_read`; then the pieces in host
    /// memory are copied, and after them the peer's pieces in order (a change of the space
    /// waits for copies in host memory, but must not wait for the peer). An error from `remote`
    /// stops the copy and is returned, with the host pieces and the peer's pieces before it
    /// already copied.
    pub fn dma_read_via<E: From<Error>>(
        &self,
        iova: Iova,
        buf: &mut [u8],
        remote: impl FnMut(Iova, &mut [u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if self.read_on_last_hit(iova, buf) {
            return Ok(());
        }
        self.dma_read_with(iova, buf, remote, Hot::VALID | Hot::REMOTE)
    }

    /// [`DmaSpace::dma_write`] over host and peer memory alike; each piece in a peer's memory
    /// is handed to `remote(iova, part of buf)` to store (a vfio-user server sends `DMA_WRITE`).
    /// Dirty pages are marked for both kinds. Errors as [`DmaSpace::dma_read_via`].
    pub fn dma_write_via<E: From<Error>>(
        &self,
        iova: Iova,
        buf: &[u8],
        remote: impl FnMut(Iova, &[u8]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if self.write_on_last_hit(iova, buf) {
            return Ok(());
        }
        self.dma_write_with(iova, buf, remote, Hot::VALID | Hot::REMOTE)
    }

    fn dma_read_with<E: From<Error>>(
        &self,
        iova: Iova,
        buf: &mut [u8],
        mut remote: impl FnMut(Iova, &mut [u8]) -> std::result::Result<(), E>,
        usable: u64,
    ) -> std::result::Result<(), E> {
        let len = buf.len();
        self.copy_pieces(iova, len, Prot::READ, usable, |addr, hva, at, n| {
            let part = &mut buf[at..at + n];
            match hva {
                // SAFETY: copy_pieces hands out only ranges inside valid mappings of the
                // snapshot it holds, which keeps their memory mapped (or, for raw mappings, the
                // caller promised to); buf is caller memory, never guest memory.
                Some(hva) => unsafe { copy::from_guest(hva as usize as *const u8, part) },
                None => return remote(Iova(addr), part),
            }
            Ok(())
        })
    }

    fn dma_write_with<E: From<Error>>(
        &self,
        iova: Iova,
        buf: &[u8],
        mut remote: impl FnMut(Iova, &[u8]) -> std::result::Result<(), E>,
        usable: u64,
    ) -> std::result::Result<(), E> {
        self.copy_pieces(iova, buf.len(), Prot::RW, usable, |addr, hva, at, n| {
            let part = &buf[at..at + n];
            match hva {
                // SAFETY: as in dma_read_with; the mappings allow WRITE.
                Some(hva) => unsafe { copy::to_guest(part, hva as usize as *mut u8) },
                None => return remote(Iova(addr), part),
            }
            Ok(())
        })
    }

    /// Checks `[iova, iova + len)` for `need` against one snapshot, then calls
    /// `copy(iova, host address or None for a peer's memory, offset in the caller's buffer,
    /// bytes)` for each piece, stopping at the first error it returns. The pieces in host
    /// memory are copied first, announced (`grace`), so a change that takes them away returns
    /// only after they landed; the pieces in a peer's memory follow, in order, once the
    /// announcement ended (they wait on the peer, and the peer may be waiting for a change).
    /// A copy that falls in one mapping of host memory becomes the thread's last hit, for the
    /// next copy's shortcut.
    fn copy_pieces<E: From<Error>>(
        &self,
        iova: Iova,
        len: usize,
        need: Prot,
        usable: u64,
        mut copy: impl FnMut(u64, Option<u64>, usize, usize) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        if len == 0 {
            return Err(Error::ZeroSize { what: "dma copy" }.into());
        }
        let (min_page, id) = (self.shared.min_page, self.shared.head.0.id);
        let mut failed = None;
        // Pieces in a peer's memory, for after the announced part: (iova, offset, bytes, mapping).
        let mut later: Vec<(u64, usize, usize, Arc<Mapping>)> = Vec::new();
        self.with_snapshot_copying(|snap| {
            self.refuse_while_invalid(snap, iova.0)?;
            later.clear();
            let mut at = 0usize;
            let first = snap.for_each_piece(
                iova.0,
                len as u64,
                need,
                min_page,
                usable,
                |addr, hva, n, m| {
                    let now = hva.is_some();
                    match hva {
                        Some(_) if failed.is_none() => {
                            failed = copy(addr, hva, at, n as usize).err();
                        }
                        Some(_) => {}
                        None => later.push((addr, at, n as usize, m.clone())),
                    }
                    at += n as usize;
                    now
                },
            )?;
            if first.holds_host(iova.0, len as u64) {
                remember(id, snap, &first, true);
            }
            Ok(())
        })
        .map_err(|e| E::from(as_type1_rw(e, iova, len)))?;
        if let Some(e) = failed {
            return Err(e);
        }
        for (addr, at, n, m) in later {
            copy(addr, None, at, n)?;
            if need.contains(Prot::WRITE) {
                mark_dirty(&m, addr, n as u64, min_page);
            }
        }
        Ok(())
    }
}

impl DmaSpace {
    /// Under [`VaddrRule::Refuse`](super::VaddrRule::Refuse), EBUSY while any mapping of `snap`
    /// has its host address invalidated (Linux 6.3's container-wide check in `vfio_dma_rw` and
    /// `pin_pages`).
    pub(super) fn refuse_while_invalid(&self, snap: &DmaSnapshot, iova: u64) -> Result<()> {
        if !self.copies_allowed(snap) {
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
