//! `DISCARD` and `WRITE_ZEROES`: requests whose data buffers are a list of ranges (sector,
//! sectors, flags; 16 bytes each) rather than bytes to move. Every range is checked (alignment
//! to the disk's block, the disk's end, the flags virtio allows) before any is carried out, so a
//! bad request changes nothing; the disk ([`Disk::discard`], [`Disk::zero`]) does the rest with
//! what the file or block device offers.

use memvisor::{DmaSpace, Iova};

use super::{Blk, MAX_RANGE_SECTORS, MAX_RANGE_SEGS, S_OK, S_UNSUPP, SECTOR, WZ_UNMAP};
#[cfg(doc)]
use crate::disk::Disk;
use crate::error::{Error, Result};
use crate::ring::Desc as Buf;

impl Blk {
    /// `DISCARD` ([`Disk::discard`]: a hole, or `BLKDISCARD`; `UNSUPP` where not offered) or
    /// `WRITE_ZEROES` ([`Disk::zero`]; with unmap allowed, a hole). The segments (sector,
    /// sectors, flags; 16 bytes each) are the data buffers' bytes. Every segment is checked
    /// before any is carried out; an unknown flag, or `unmap` on a discard, is `UNSUPP` as the
    /// specification asks. Storage that cannot discard ignores a discard (a hint).
    pub(super) fn ranges(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        data: &[Buf],
        zeroes: bool,
    ) -> Result<(u8, u32)> {
        let what = if zeroes { "write-zeroes" } else { "discard" };
        if !zeroes && self.disk.discard_limits().is_none() {
            self.count(q).failed.add(1);
            return Ok((S_UNSUPP, 0));
        }
        let mut bytes = Vec::new();
        for b in data {
            if b.write {
                return Err(Error::BadChain(format!(
                    "{what} segment buffer at {:#x} is device-writable",
                    b.addr
                )));
            }
            let at = bytes.len();
            if at + b.len as usize > (MAX_RANGE_SEGS as usize) * 16 {
                // More segments than the config offers: not supported, as QEMU answers.
                log::debug!("blk: {what} request of more than {MAX_RANGE_SEGS} segments");
                self.count(q).failed.add(1);
                return Ok((S_UNSUPP, 0));
            }
            bytes.resize(at + b.len as usize, 0);
            dma.dma_read(Iova(b.addr), &mut bytes[at..])?;
        }
        if bytes.is_empty() || bytes.len() % 16 != 0 {
            return Err(Error::BadChain(format!(
                "{what} request of {} bytes is not whole 16-byte segments",
                bytes.len()
            )));
        }
        let align = self.disk.block_size() / SECTOR;
        let mut segs = Vec::with_capacity(bytes.len() / 16);
        for seg in bytes.chunks_exact(16) {
            let sector = u64::from_le_bytes(seg[0..8].try_into().expect("8"));
            let n = u32::from_le_bytes(seg[8..12].try_into().expect("4"));
            let flags = u32::from_le_bytes(seg[12..16].try_into().expect("4"));
            let allowed = if zeroes { WZ_UNMAP } else { 0 };
            if flags & !allowed != 0 {
                log::debug!("blk: {what} segment flags {flags:#x} not supported");
                self.count(q).failed.add(1);
                return Ok((S_UNSUPP, 0));
            }
            if n > MAX_RANGE_SECTORS
                || sector % align != 0
                || u64::from(n) % align != 0
                || sector
                    .checked_add(u64::from(n))
                    .is_none_or(|e| e > self.capacity.sectors())
            {
                return Err(Error::BadChain(format!(
                    "{what} of sectors {sector}+{n}: past the disk's end ({} sectors), over \
                     {MAX_RANGE_SECTORS} sectors, or not whole {align}-sector blocks",
                    self.capacity.sectors()
                )));
            }
            segs.push((
                sector * SECTOR,
                u64::from(n) * SECTOR,
                flags & WZ_UNMAP != 0,
            ));
        }
        for (offset, len, unmap) in segs {
            if len == 0 {
                continue;
            }
            if zeroes {
                self.disk.zero(offset, len, unmap)?;
            } else {
                self.disk.discard(offset, len)?;
            }
        }
        if zeroes {
            self.count(q).write_zeroes.add(1);
        } else {
            self.count(q).discards.add(1);
        }
        Ok((S_OK, 0))
    }
}
