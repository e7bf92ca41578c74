//! One request: the chain's header, what the request asks for, and how it ends.
//!
//! A chain is a 16-byte header the driver wrote (type, reserved, sector), data buffers, and a
//! status byte the device writes last — the last byte of the chain. Those are byte streams, not
//! descriptors: a driver may put the header and a write's data in one descriptor, a read's data
//! and the status byte in one, or a header in two (VIRTIO 1.2, 2.6.4, "Message Framing": the
//! device must not assume how descriptors are arranged). So a chain is first cut where the
//! header ends and where the status byte begins ([`frame`]); every step after it (the throttle,
//! the walk that holds or claims the pages, the request) sees header descriptors, data
//! descriptors and one 1-byte status descriptor. The chain every known driver sends (a
//! 16-byte header descriptor, a 1-byte status descriptor) is recognised without a change.
//!
//! The request's buffers were held in one walk before it gets here (`device`); [`Blk::request`]
//! reads the header and carries out what it names, or hands a read or write to `io`. Whatever
//! happens becomes one [`Outcome`]; [`Blk::finish`] counts it and writes the status byte.

use memvisor::{DmaSpace, Iova};
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_ID_BYTES, VIRTIO_BLK_T_DISCARD, VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID,
    VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT, VIRTIO_BLK_T_WRITE_ZEROES,
};

use super::io::{Pages, Ready, ns_between};
use super::stats::Op;
use super::{Blk, S_IOERR, S_OK, S_UNSUPP};
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

/// Where a framed chain's request lies ([`frame`]): the number of descriptors its 16-byte
/// header takes (the data descriptors follow them, and the last descriptor is the status
/// byte), or why the chain holds no request.
pub(super) type Framing = std::result::Result<usize, String>;

/// Cuts the descriptors of a chain (in order, as the ring gave them) where its 16-byte header
/// ends and where its status byte, the chain's last device-writable byte, begins, so that the
/// header, the data and the status byte each have descriptors of their own. Zero-length
/// descriptors are dropped on the way, and header pieces side by side in memory are joined.
/// The chain's bytes are unchanged: only where descriptors begin and end. A chain with no
/// writable byte is left with no status descriptor ([`Blk::request`] says so); one whose
/// readable bytes are fewer than 16, or that has a readable descriptor after a writable one
/// (VIRTIO 1.2, 2.7.4: writable descriptors come last), is an error.
#[inline]
pub(super) fn frame(bufs: &mut Vec<Buf>) -> Framing {
    // What every known driver sends: nothing to cut.
    if let (Some(h), Some(s)) = (bufs.first(), bufs.last()) {
        if bufs.len() >= 2 && !h.write && h.len == 16 && s.write && s.len == 1 {
            return Ok(1);
        }
    }
    cut(bufs)
}

/// [`frame`] for a chain laid out otherwise: the cuts themselves.
#[cold]
fn cut(bufs: &mut Vec<Buf>) -> Framing {
    bufs.retain(|b| b.len > 0);
    let readable = bufs.iter().take_while(|b| !b.write).count();
    if bufs[readable..].iter().any(|b| !b.write) {
        return Err("a device-readable descriptor follows a device-writable one".into());
    }
    // The status byte: a descriptor of its own at the last writable byte (none if the last
    // byte lies past the address space: `request` then finds no status byte).
    if let Some(last) = bufs.last().copied().filter(|b| b.write && b.len > 1) {
        if let Some(at) = last.addr.checked_add(u64::from(last.len) - 1) {
            let n = bufs.len();
            bufs[n - 1].len -= 1;
            bufs.push(Buf {
                addr: at,
                len: 1,
                write: true,
            });
        }
    }
    // The header: the first 16 readable bytes.
    let mut need: u32 = 16;
    let mut pieces = 0;
    while need > 0 {
        if pieces == readable {
            return Err(format!(
                "{} readable bytes before the writable ones: no 16-byte header",
                16 - need
            ));
        }
        let b = bufs[pieces];
        if b.len > need {
            let Some(rest) = b.addr.checked_add(u64::from(need)) else {
                return Err(format!(
                    "header descriptor at {:#x} wraps the address space",
                    b.addr
                ));
            };
            bufs[pieces].len = need;
            bufs.insert(
                pieces + 1,
                Buf {
                    addr: rest,
                    len: b.len - need,
                    write: false,
                },
            );
            need = 0;
        } else {
            need -= b.len;
        }
        pieces += 1;
    }
    while pieces > 1 && bufs[0].addr.checked_add(u64::from(bufs[0].len)) == Some(bufs[1].addr) {
        bufs[0].len += bufs[1].len;
        bufs.remove(1);
        pieces -= 1;
    }
    Ok(pieces)
}

/// Reads a request's 16-byte header from its header descriptors (`frame`'s first ones).
pub(super) fn read_header(dma: &DmaSpace, pieces: &[Buf]) -> memvisor::Result<[u8; 16]> {
    let mut hdr = [0u8; 16];
    let mut at = 0;
    for b in pieces {
        let n = (b.len as usize).min(hdr.len() - at);
        dma.dma_read(Iova(b.addr), &mut hdr[at..at + n])?;
        at += n;
    }
    Ok(hdr)
}

/// A chain's status byte: its address, and the writable bytes before it (a read's data, a
/// `GET_ID` buffer), which the used length counts only when all of them were written.
#[derive(Clone, Copy)]
pub(super) struct Status {
    pub at: u64,
    pub before: u64,
}

impl Blk {
    /// Starts one request chain, framed (`framing`), whose buffers `held` keeps (or could not
    /// hold). Returns its status byte (`None`: the chain has none) and what became of it.
    pub(super) fn request(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        bufs: &[Buf],
        framing: &Framing,
        held: Result<Pages, Failure>,
    ) -> (Option<Status>, Outcome) {
        // The status byte is the last descriptor's last byte (`frame` made it one byte long);
        // a descriptor that runs past the top of the address space has none (its end would
        // wrap to a low address the chain never named).
        let Some(at) = bufs
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
        let last = bufs.len() - 1;
        let status = Status {
            at,
            before: bufs[..last]
                .iter()
                .filter(|b| b.write)
                .map(|b| u64::from(b.len))
                .sum(),
        };
        let header = match framing {
            Ok(header) => *header,
            Err(why) => return (Some(status), Error::BadChain(why.clone()).into()),
        };
        let outcome = match held {
            Ok(guard) => self.serve(q, dma, &bufs[..header], &bufs[header..last], guard, at),
            Err(f) => Outcome::Failed(f),
        };
        (Some(status), outcome)
    }

    /// Carries out the request of header descriptors `hdr_bufs` with `data` buffers (the
    /// walk's buffers from `hdr_bufs.len()` on).
    fn serve(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        hdr_bufs: &[Buf],
        data: &[Buf],
        kept: Pages,
        status_at: u64,
    ) -> Outcome {
        let hdr = match read_header(dma, hdr_bufs) {
            Ok(hdr) => hdr,
            Err(e) => return Error::from(e).into(),
        };
        let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("4"));
        let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8"));
        match kind {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let to_guest = kind == VIRTIO_BLK_T_IN;
                if !to_guest && self.options.read_only {
                    return Error::BadChain("write to a read-only disk".into()).into();
                }
                // A write of sector 0 with the guard on is checked in the copy that is written
                // (`Blk::bounce`), never in guest memory the guest may change after the check.
                let check_first = !to_guest && sector == 0 && self.options.guard_first_sector;
                // A read or write that goes: its claim (made before the header was read)
                // counts in the fixed / ordinary / fallback shares; no other request's does.
                if let Some(f) = self.fixed.as_mut() {
                    f.tally();
                }
                self.transfer(
                    q,
                    dma,
                    hdr_bufs.len(),
                    data,
                    kept,
                    sector,
                    to_guest,
                    status_at,
                    check_first,
                )
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
                // The id fills the first 20 writable bytes, across descriptors.
                if data.first().is_none_or(|b| !b.write) {
                    return Error::BadChain("GET_ID without a writable buffer".into()).into();
                }
                let mut id = [0u8; ID_BYTES];
                let s = self.options.serial.as_bytes();
                let n = s.len().min(ID_BYTES);
                id[..n].copy_from_slice(&s[..n]);
                let mut put = 0;
                for b in data.iter().take_while(|b| b.write) {
                    if put == ID_BYTES {
                        break;
                    }
                    let n = (b.len as usize).min(ID_BYTES - put);
                    if let Err(e) = dma.dma_write(Iova(b.addr), &id[put..put + n]) {
                        return Error::from(e).into();
                    }
                    put += n;
                }
                Outcome::Done(S_OK, put as u32)
            }
            other => {
                log::debug!("blk: request type {other} not supported");
                self.count(q).failed.add(1);
                Outcome::Done(S_UNSUPP, 0)
            }
        }
    }

    /// Ends a request: counts a failure, writes the status byte (if the chain has one);
    /// returns the used length: the bytes written from the chain's first writable byte on
    /// without a gap (VIRTIO 1.2, 2.7.8: never more than the device wrote there), so the
    /// status byte counts only after all the writable bytes before it. Not for
    /// [`Outcome::Ready`], which ends when the kernel is done with it ([`Blk::end_transfer`]).
    pub(super) fn finish(
        &mut self,
        q: u16,
        dma: &DmaSpace,
        status: Option<Status>,
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
        let Some(status) = status else {
            return 0;
        };
        match dma.dma_write(Iova(status.at), &[code]) {
            Ok(()) if u64::from(written) == status.before => written + 1,
            Ok(()) => written,
            Err(e) => {
                log::warn!("blk: cannot write the status byte at {:#x}: {e}", status.at);
                written
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::{Buf, frame};

    /// The chain's bytes in order: each byte's address and direction.
    fn bytes(bufs: &[Buf]) -> Vec<(u64, bool)> {
        bufs.iter()
            .flat_map(|b| (0..u64::from(b.len)).map(move |i| (b.addr + i, b.write)))
            .collect()
    }

    /// Chains of up to 10 descriptors, 0 to 40 bytes each, 4 KiB apart, readable first and then
    /// writable (or, one time in four, in any order).
    fn chains() -> impl Strategy<Value = Vec<Buf>> {
        (
            prop::collection::vec((0u32..40, any::<bool>()), 1..10),
            0usize..10,
            0u8..4,
        )
            .prop_map(|(descs, split, shuffle)| {
                descs
                    .into_iter()
                    .enumerate()
                    .map(|(i, (len, w))| Buf {
                        addr: 0x1000 * (i as u64 + 1),
                        len,
                        write: if shuffle == 0 { w } else { i >= split },
                    })
                    .collect()
            })
    }

    proptest! {
        /// `frame` moves no byte: the chain's bytes are the same, in the same order; the header
        /// is its first 16 readable bytes, in readable descriptors; the status byte is the
        /// last writable byte, in a descriptor of its own. A chain with too few readable bytes
        /// or a readable byte after a writable one is refused.
        #[test]
        fn framing_cuts_descriptors_and_moves_no_byte(chain in chains()) {
            let before = bytes(&chain);
            let mut framed = chain.clone();
            let result = frame(&mut framed);
            let readable = before.iter().take_while(|b| !b.1).count();
            let ordered = before[readable..].iter().all(|b| b.1);
            match result {
                Ok(header) => {
                    prop_assert!(ordered && readable >= 16, "framed {chain:?}");
                    prop_assert_eq!(bytes(&framed), before.clone());
                    prop_assert!(framed[..header].iter().all(|b| !b.write));
                    prop_assert_eq!(framed[..header].iter().map(|b| b.len).sum::<u32>(), 16);
                    if before.last().is_some_and(|b| b.1) {
                        let last = framed.last().unwrap();
                        prop_assert_eq!((last.addr, last.len, last.write), (before.last().unwrap().0, 1, true));
                    }
                }
                Err(_) => prop_assert!(!ordered || readable < 16, "refused {chain:?}"),
            }
        }
    }
}
