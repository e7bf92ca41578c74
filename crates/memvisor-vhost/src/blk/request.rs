//! One request: the chain's header, what the request asks for, and how it ends.
//!
//! A chain is a 16-byte header the driver wrote (type, reserved, sector), data buffers, and a
//! status byte the device writes last — the last byte of the last descriptor. The request's
//! buffers were held in one walk before it gets here (`device`); [`Blk::request`] reads the
//! header and carries out what it names, or hands a read or write to `io`. Whatever happens
//! becomes one [`Outcome`]; [`Blk::finish`] counts it and writes the status byte.

use memvisor::{DmaSpace, Iova};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};

use super::io::{Pages, Ready, ns_between};
use super::stats::Op;
use super::{Blk, S_IOERR, S_OK, S_UNSUPP, SECTOR};
use crate::error::Error;
use crate::ring::Desc as Buf;

const ID_BYTES: usize = VIRTIO_BLK_ID_BYTES as usize;

/// What became of a request, or of a step of one.
pub(super) enum Outcome {
    /// Done: its status and the bytes written into the chain (the status byte not among
    /// them).
    Done(u8, u32),
    /// A read or write whose buffers are kept (held, or claimed in a registered chunk), ready
    /// for the kernel.
    Ready(Ready),
    /// Failed: answered `IOERR`.
    Failed(Failure),
}

/// Why a request failed: the disk refused its I/O, its buffers could not be held, or anything
/// else (a bad chain, guest memory out of reach).
pub(super) enum Failure {
    Io(Error),
    Hold(Error),
    Other(Error),
}

impl From<Error> for Outcome {
    fn from(e: Error) -> Outcome {
        Outcome::Failed(Failure::Other(e))
    }
}

impl Blk {
    /// Starts one request chain whose buffers `held` keeps (or could not hold). Returns the
    /// address of its status byte (`None`: the chain has none) and what became of it.
    pub(super) fn request(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        bufs: &[Buf],
        held: Result<Pages, Failure>,
    ) -> (Option<u64>, Outcome) {
        // The status byte is the last byte of the last descriptor; a descriptor that runs past
        // the top of the address space has none (its end would wrap to a low address the chain
        // never named).
        let Some(status_at) = bufs
            .last()
            .filter(|b| b.write && b.len >= 1 && bufs.len() >= 2)
            .and_then(|b| b.addr.checked_add(u64::from(b.len) - 1))
        else {
            let why = format!(
                "chain of {} descriptors has no writable status byte inside the address space",
                bufs.len()
            );
            return (None, Error::BadChain(why).into());
        };
        let outcome = match held {
            Ok(guard) => self.serve(q, dma, &bufs[0], &bufs[1..bufs.len() - 1], guard, status_at),
            Err(f) => Outcome::Failed(f),
        };
        (Some(status_at), outcome)
    }

    /// Carries out the request of header descriptor `hdr_buf` with `data` buffers.
    fn serve(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        hdr_buf: &Buf,
        data: &[Buf],
        kept: Pages,
        status_at: u64,
    ) -> Outcome {
        if hdr_buf.write || hdr_buf.len < 16 {
            return Error::BadChain(format!(
                "first descriptor ({} bytes, {}) is not a 16-byte readable header",
                hdr_buf.len,
                if hdr_buf.write {
                    "writable"
                } else {
                    "readable"
                }
            ))
            .into();
        }
        let mut hdr = [0u8; 16];
        if let Err(e) = dma.dma_read(Iova(hdr_buf.addr), &mut hdr) {
            return Error::from(e).into();
        }
        let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("4"));
        let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8"));
        match kind {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let to_guest = kind == VIRTIO_BLK_T_IN;
                if !to_guest && self.options.read_only {
                    return Error::BadChain("write to a read-only disk".into()).into();
                }
                if !to_guest && sector == 0 && self.options.guard_first_sector {
                    match first_sector_format(dma, data) {
                        Ok(Some(format)) => {
                            log::warn!(
                                "blk: refused a write of sector 0 that carries a {format} \
                                 header: the image was probed as raw (say format=raw to allow it)"
                            );
                            self.count(q).failed.add(1);
                            return Outcome::Done(S_IOERR, 0);
                        }
                        Ok(None) => {}
                        Err(e) => return e.into(),
                    }
                }
                // A read or write that goes: its claim (made before the header was read)
                // counts in the fixed / ordinary / fallback shares; no other request's does.
                if let Some(f) = self.fixed.as_mut() {
                    f.tally();
                }
                self.transfer(q, dma, data, kept, sector, to_guest, status_at)
            }
            VIRTIO_BLK_T_FLUSH => {
                // Timed on its own (two clock reads): a flush is its fdatasync, which takes
                // far longer than they do.
                let flush_start = self.now();
                match self.disk.sync_data() {
                    Ok(()) => {
                        let ns = ns_between(flush_start, self.now());
                        let c = self.count(q);
                        c.flushes.add(1);
                        c.record_latency(Op::Flush, ns);
                        Outcome::Done(S_OK, 0)
                    }
                    Err(e) => Outcome::Failed(Failure::Io(e)),
                }
            }
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES if !self.options.read_only => {
                match self.ranges(q, dma, data, kind == VIRTIO_BLK_T_WRITE_ZEROES) {
                    Ok((code, written)) => Outcome::Done(code, written),
                    Err(e @ Error::Os { .. }) => Outcome::Failed(Failure::Io(e)),
                    Err(e) => e.into(),
                }
            }
            VIRTIO_BLK_T_GET_ID => {
                let Some(b) = data.first().filter(|b| b.write) else {
                    return Error::BadChain("GET_ID without a writable buffer".into()).into();
                };
                let mut id = [0u8; ID_BYTES];
                let s = self.options.serial.as_bytes();
                let n = s.len().min(ID_BYTES);
                id[..n].copy_from_slice(&s[..n]);
                let n = (b.len as usize).min(ID_BYTES);
                match dma.dma_write(Iova(b.addr), &id[..n]) {
                    Ok(()) => Outcome::Done(S_OK, n as u32),
                    Err(e) => Error::from(e).into(),
                }
            }
            other => {
                log::debug!("blk: request type {other} not supported");
                self.count(q).failed.add(1);
                Outcome::Done(S_UNSUPP, 0)
            }
        }
    }

    /// Ends a request: counts a failure, writes the status byte at `status_at` (if the chain
    /// has one); returns the bytes written into the chain. Not for [`Outcome::Ready`], which
    /// ends when the kernel is done with it ([`Blk::end_transfer`]).
    pub(super) fn finish(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        status_at: Option<u64>,
        outcome: Outcome,
    ) -> u32 {
        let (code, written) = match outcome {
            Outcome::Done(code, written) => (code, written),
            Outcome::Ready(_) => unreachable!("a transfer ends through end_transfer"),
            #[cfg(feature = "test-hooks")]
            Outcome::Failed(Failure::Io(e)) if dma.faults().hide_io_errors => {
                log::warn!("TEST ONLY: answering OK for a request whose I/O failed: {e}");
                (S_OK, 0)
            }
            Outcome::Failed(f) => {
                let c = self.count(q);
                c.failed.add(1);
                match f {
                    Failure::Io(e) => {
                        c.io_errors.add(1);
                        log::warn!("blk: request failed on the disk: {e}");
                    }
                    Failure::Hold(e) => {
                        c.pin_errors.add(1);
                        log::warn!("blk: request failed, its pages could not be held: {e}");
                    }
                    Failure::Other(e) => log::warn!("blk: request failed: {e}"),
                }
                (S_IOERR, 0)
            }
        };
        let Some(status_at) = status_at else {
            return 0;
        };
        match dma.dma_write(Iova(status_at), &[code]) {
            Ok(()) => written + 1,
            Err(e) => {
                log::warn!("blk: cannot write the status byte at {status_at:#x}: {e}");
                written
            }
        }
    }
}

/// The format whose header the first sector a write carries would begin with (the first 512
/// bytes of its data buffers), if any.
fn first_sector_format(dma: &DmaSpace, data: &[Buf]) -> Result<Option<&'static str>, Error> {
    let mut head = [0u8; SECTOR as usize];
    let mut got = 0;
    for b in data {
        if got == head.len() {
            break;
        }
        let n = (b.len as usize).min(head.len() - got);
        dma.dma_read(Iova(b.addr), &mut head[got..got + n])?;
        got += n;
    }
    Ok(crate::image_format::probe(&head[..got]))
}
