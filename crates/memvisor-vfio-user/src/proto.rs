//! The vfio-user wire format: a 16-byte header and one fixed layout per command, little-endian.
//!
//! Every message starts with `id: u16, command: u16, size: u32` (the whole message, header
//! included), `flags: u32` (bits 0-3 the type: 0 command, 1 reply; bit 4 NO_REPLY; bit 5 ERROR)
//! and `error: u32` (an errno, in error replies). The bodies follow Linux's VFIO ioctl structs
//! (`struct vfio_iommu_type1_dma_map`, `vfio_region_info`, `vfio_irq_set`, ...) with pointers
//! replaced by descriptors (passed with `SCM_RIGHTS`) or by data that follows inline. Parsing
//! checks each body's size against its layout and its `argsz`; it never trusts a length field
//! to index memory. Facts from the vfio-user specification (QEMU `docs/interop/vfio-user.rst`)
//! and QEMU 11.1's client (`hw/vfio-user/protocol.h`).

use memvisor_wire::Size;

use crate::error::{Error, Result};

/// Bytes in a message header.
pub const HEADER: usize = 16;

/// Most bytes of data one region or DMA read/write carries (`max_data_xfer_size`, which this
/// server announces; QEMU's default too).
pub const MAX_DATA_XFER: usize = 1 << 20;

/// Largest message accepted: a data transfer and its header, or a region-info reply's worth.
pub const MAX_MESSAGE: usize = MAX_DATA_XFER + 64;

/// Most descriptors one message may carry (`max_msg_fds`, QEMU's upper bound).
pub const MAX_FDS: usize = 16;

/// Commands (the header's `command`).
pub mod cmd {
    /// Negotiates the protocol version and capabilities (the first message).
    pub const VERSION: u16 = 1;
    /// Adds a DMA mapping, with the memory's descriptor or none (remote memory).
    pub const DMA_MAP: u16 = 2;
    /// Removes DMA mappings, optionally returning their dirty bitmap.
    pub const DMA_UNMAP: u16 = 3;
    /// Asks for the device's flags and its numbers of regions and interrupt kinds.
    pub const DEVICE_GET_INFO: u16 = 4;
    /// Asks for one region's size, flags and capabilities.
    pub const DEVICE_GET_REGION_INFO: u16 = 5;
    /// Asks for descriptors that reach a region without messages.
    pub const DEVICE_GET_REGION_IO_FDS: u16 = 6;
    /// Asks for one interrupt kind's count and flags.
    pub const DEVICE_GET_IRQ_INFO: u16 = 7;
    /// Sets up, triggers, masks or unmasks interrupts.
    pub const DEVICE_SET_IRQS: u16 = 8;
    /// Reads bytes of a device region.
    pub const REGION_READ: u16 = 9;
    /// Writes bytes of a device region.
    pub const REGION_WRITE: u16 = 10;
    /// The server asks the client for bytes of memory mapped without a descriptor.
    pub const DMA_READ: u16 = 11;
    /// The server writes bytes of memory mapped without a descriptor through the client.
    pub const DMA_WRITE: u16 = 12;
    /// Resets the device.
    pub const DEVICE_RESET: u16 = 13;
    /// Starts, stops or reads dirty page logging (the protocol's old migration interface).
    pub const DIRTY_PAGES: u16 = 14;
    /// Several small posted region writes in one message.
    pub const REGION_WRITE_MULTI: u16 = 15;
    /// Gets or sets a device feature (the newer migration interface among them).
    pub const DEVICE_FEATURE: u16 = 16;

    /// The command's name, for logs and error messages.
    pub fn name(c: u16) -> &'static str {
        match c {
            VERSION => "VERSION",
            DMA_MAP => "DMA_MAP",
            DMA_UNMAP => "DMA_UNMAP",
            DEVICE_GET_INFO => "DEVICE_GET_INFO",
            DEVICE_GET_REGION_INFO => "DEVICE_GET_REGION_INFO",
            DEVICE_GET_REGION_IO_FDS => "DEVICE_GET_REGION_IO_FDS",
            DEVICE_GET_IRQ_INFO => "DEVICE_GET_IRQ_INFO",
            DEVICE_SET_IRQS => "DEVICE_SET_IRQS",
            REGION_READ => "REGION_READ",
            REGION_WRITE => "REGION_WRITE",
            DMA_READ => "DMA_READ",
            DMA_WRITE => "DMA_WRITE",
            DEVICE_RESET => "DEVICE_RESET",
            DIRTY_PAGES => "DIRTY_PAGES",
            REGION_WRITE_MULTI => "REGION_WRITE_MULTI",
            DEVICE_FEATURE => "DEVICE_FEATURE",
            _ => "unknown command",
        }
    }
}

/// Header flags.
pub mod flags {
    /// The bits that hold the message's type.
    pub const TYPE_MASK: u32 = 0xf;
    /// Type: a command.
    pub const COMMAND: u32 = 0;
    /// Type: a reply to a command.
    pub const REPLY: u32 = 1;
    /// The sender wants no reply (posted writes).
    pub const NO_REPLY: u32 = 0x10;
    /// A reply that reports a failure; `error` holds the errno.
    pub const ERROR: u32 = 0x20;
}

/// A message header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    /// The message's id; a reply carries its command's.
    pub id: u16,
    /// The command (`cmd::*`).
    pub command: u16,
    /// The whole message, header included.
    pub size: u32,
    /// Type and option bits (`flags::*`).
    pub flags: u32,
    /// The errno of an error reply; 0 otherwise.
    pub error: u32,
}

impl Header {
    /// The header in `b`, as sent; its fields are checked by whoever reads the message.
    pub fn parse(b: &[u8; HEADER]) -> Header {
        Header {
            id: u16::from_le_bytes([b[0], b[1]]),
            command: u16::from_le_bytes([b[2], b[3]]),
            size: u32_at(b, 4),
            flags: u32_at(b, 8),
            error: u32_at(b, 12),
        }
    }

    /// The header as it goes on the wire.
    pub fn to_bytes(self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..2].copy_from_slice(&self.id.to_le_bytes());
        b[2..4].copy_from_slice(&self.command.to_le_bytes());
        b[4..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..12].copy_from_slice(&self.flags.to_le_bytes());
        b[12..16].copy_from_slice(&self.error.to_le_bytes());
        b
    }

    /// Whether this is a reply (to a command this side sent).
    pub fn is_reply(&self) -> bool {
        self.flags & flags::TYPE_MASK == flags::REPLY
    }

    /// Whether the sender wants no reply (posted region writes).
    pub fn no_reply(&self) -> bool {
        self.flags & flags::NO_REPLY != 0
    }
}

/// The little-endian `u32` at byte `at` (panics past the end: callers check sizes first).
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// The little-endian `u64` at byte `at` (panics past the end: callers check sizes first).
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks a body is at least `want` bytes (the fixed part of its layout).
fn need(command: u16, body: &[u8], want: usize) -> Result<()> {
    Size::AtLeast(want).check(cmd::name(command), body.len())?;
    Ok(())
}

/// Checks a VFIO-style `argsz`: at least the fixed part, and no more than was sent.
fn check_argsz(command: u16, argsz: u32, fixed: usize, body: usize) -> Result<()> {
    if (argsz as usize) < fixed || argsz as usize > body {
        return Err(Error::Invalid(format!(
            "{}: argsz {argsz} must be between {fixed} and the {body} bytes sent",
            cmd::name(command)
        )));
    }
    Ok(())
}

/// `VFIO_USER_VERSION`: `major: u16, minor: u16`, then a NUL-terminated JSON object.
#[derive(Debug, PartialEq, Eq)]
pub struct Version {
    /// Major protocol version (0).
    pub major: u16,
    /// Minor protocol version.
    pub minor: u16,
    /// The JSON text (without its NUL), empty if none was sent.
    pub json: String,
}

impl Version {
    /// The body of a `VERSION` message or reply; EINVAL if it is short or its JSON not UTF-8.
    pub fn parse(body: &[u8]) -> Result<Version> {
        need(cmd::VERSION, body, 4)?;
        let text = &body[4..];
        let text = text.split(|&c| c == 0).next().unwrap_or(&[]);
        let json = std::str::from_utf8(text)
            .map_err(|e| Error::Invalid(format!("VERSION: capabilities are not UTF-8: {e}")))?;
        Ok(Version {
            major: u16::from_le_bytes([body[0], body[1]]),
            minor: u16::from_le_bytes([body[2], body[3]]),
            json: json.to_string(),
        })
    }

    /// The body as it goes on the wire, the JSON NUL-terminated.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(5 + self.json.len());
        b.extend_from_slice(&self.major.to_le_bytes());
        b.extend_from_slice(&self.minor.to_le_bytes());
        b.extend_from_slice(self.json.as_bytes());
        b.push(0);
        b
    }
}

/// `DMA_MAP` flags (`VFIO_DMA_MAP_FLAG_*`).
pub mod map_flags {
    /// The device may read the memory.
    pub const READ: u32 = 1;
    /// The device may write the memory.
    pub const WRITE: u32 = 2;
}

/// `DMA_UNMAP` flags (`VFIO_DMA_UNMAP_FLAG_*`, as Linux numbers them).
pub mod unmap_flags {
    /// Return the range's dirty bitmap in the reply.
    pub const GET_DIRTY_BITMAP: u32 = 1;
    /// Unmap everything (`iova` and `size` must be 0).
    pub const ALL: u32 = 2;
}

/// `VFIO_USER_DMA_MAP`: `argsz, flags: u32, offset, iova, size: u64`; the memory's descriptor
/// (0 or 1) comes with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaMap {
    /// Bytes of the request's body as the client counts them.
    pub argsz: u32,
    /// `map_flags::*`.
    pub flags: u32,
    /// Offset of the mapped range in the descriptor's file.
    pub offset: u64,
    /// The IOVA the mapping starts at.
    pub iova: u64,
    /// Its length in bytes.
    pub size: u64,
}

impl DmaMap {
    /// Bytes of the body.
    pub const SIZE: usize = 32;

    /// The body of a `DMA_MAP`; EINVAL if it is short or its `argsz` wrong.
    pub fn parse(body: &[u8]) -> Result<DmaMap> {
        need(cmd::DMA_MAP, body, Self::SIZE)?;
        let m = DmaMap {
            argsz: u32_at(body, 0),
            flags: u32_at(body, 4),
            offset: u64_at(body, 8),
            iova: u64_at(body, 16),
            size: u64_at(body, 24),
        };
        check_argsz(cmd::DMA_MAP, m.argsz, Self::SIZE, body.len())?;
        Ok(m)
    }

    /// The body as it goes on the wire.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.extend_from_slice(&self.argsz.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        b.extend_from_slice(&self.offset.to_le_bytes());
        b.extend_from_slice(&self.iova.to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        b
    }
}

/// `VFIO_USER_DMA_UNMAP`: `argsz, flags: u32, iova, size: u64`, then with GET_DIRTY_BITMAP a
/// `struct vfio_bitmap` (`pgsize, size: u64`); the reply echoes it (size = bytes unmapped) and
/// adds the bitmap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DmaUnmap {
    /// Bytes of the request's body as the client counts them.
    pub argsz: u32,
    /// `unmap_flags::*`.
    pub flags: u32,
    /// The first IOVA to unmap.
    pub iova: u64,
    /// Bytes to unmap; in the reply, bytes unmapped.
    pub size: u64,
    /// `(pgsize, bitmap bytes)` when GET_DIRTY_BITMAP is set.
    pub bitmap: Option<(u64, u64)>,
}

impl DmaUnmap {
    /// Bytes of the body without the bitmap description.
    pub const SIZE: usize = 24;
    /// Bytes of the bitmap description (`pgsize, size: u64`).
    pub const BITMAP: usize = 16;

    /// The body of a `DMA_UNMAP`; EINVAL for unknown flags, a short body or a wrong `argsz`.
    pub fn parse(body: &[u8]) -> Result<DmaUnmap> {
        need(cmd::DMA_UNMAP, body, Self::SIZE)?;
        let flags = u32_at(body, 4);
        let mut u = DmaUnmap {
            argsz: u32_at(body, 0),
            flags,
            iova: u64_at(body, 8),
            size: u64_at(body, 16),
            bitmap: None,
        };
        let known = unmap_flags::GET_DIRTY_BITMAP | unmap_flags::ALL;
        if flags & !known != 0 {
            return Err(Error::BadDma(format!(
                "DMA_UNMAP: unknown flags {:#x} (known: GET_DIRTY_BITMAP 0x1, ALL 0x2)",
                flags & !known
            )));
        }
        if flags & unmap_flags::GET_DIRTY_BITMAP != 0 {
            need(cmd::DMA_UNMAP, body, Self::SIZE + Self::BITMAP)?;
            u.bitmap = Some((u64_at(body, 24), u64_at(body, 32)));
            check_argsz(
                cmd::DMA_UNMAP,
                u.argsz,
                Self::SIZE + Self::BITMAP,
                body.len(),
            )?;
        } else {
            check_argsz(cmd::DMA_UNMAP, u.argsz, Self::SIZE, body.len())?;
        }
        Ok(u)
    }

    /// The body as it goes on the wire (the bitmap description when there is one).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE + Self::BITMAP);
        b.extend_from_slice(&self.argsz.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        b.extend_from_slice(&self.iova.to_le_bytes());
        b.extend_from_slice(&self.size.to_le_bytes());
        if let Some((pgsize, size)) = self.bitmap {
            b.extend_from_slice(&pgsize.to_le_bytes());
            b.extend_from_slice(&size.to_le_bytes());
        }
        b
    }
}

/// `DEVICE_GET_INFO` flags (`VFIO_DEVICE_FLAGS_*`).
pub mod device_flags {
    /// The device can be reset.
    pub const RESET: u32 = 1;
    /// A PCI device.
    pub const PCI: u32 = 2;
}

/// `DEVICE_GET_REGION_INFO` flags (`VFIO_REGION_INFO_FLAG_*`).
pub mod region_flags {
    /// The region can be read.
    pub const READ: u32 = 1;
    /// The region can be written.
    pub const WRITE: u32 = 2;
    /// The region can be mapped (its descriptor comes with the reply).
    pub const MMAP: u32 = 4;
    /// Capabilities follow the reply's fixed part.
    pub const CAPS: u32 = 8;
}

/// `DEVICE_GET_IRQ_INFO` flags (`VFIO_IRQ_INFO_*`).
pub mod irq_info_flags {
    /// The interrupts can be signalled through eventfds.
    pub const EVENTFD: u32 = 1;
    /// They can be masked.
    pub const MASKABLE: u32 = 2;
    /// They mask themselves when they fire (level-triggered).
    pub const AUTOMASKED: u32 = 4;
    /// Their count cannot change once set up.
    pub const NORESIZE: u32 = 8;
}

/// `DEVICE_SET_IRQS` flags (`VFIO_IRQ_SET_*`): one data type, one action.
pub mod irq_set_flags {
    /// No data: the action applies to every interrupt in the range.
    pub const DATA_NONE: u32 = 1;
    /// One byte per interrupt: the action applies where it is 1.
    pub const DATA_BOOL: u32 = 2;
    /// One eventfd per interrupt, as descriptors (-1 removes one).
    pub const DATA_EVENTFD: u32 = 4;
    /// The data-type bits.
    pub const DATA_MASK: u32 = 7;
    /// Mask the interrupts.
    pub const ACTION_MASK: u32 = 8;
    /// Unmask them.
    pub const ACTION_UNMASK: u32 = 16;
    /// Trigger them, or set the eventfds that signal them.
    pub const ACTION_TRIGGER: u32 = 32;
    /// The action bits.
    pub const ACTION_ALL: u32 = 56;
}

/// Reads the `(argsz, index)` of a GET_REGION_INFO / GET_IRQ_INFO request: `argsz, flags,
/// index: u32` first.
pub fn info_request(command: u16, body: &[u8]) -> Result<(u32, u32)> {
    need(command, body, 12)?;
    let argsz = u32_at(body, 0);
    if (argsz as usize) < 16 {
        return Err(Error::Invalid(format!(
            "{}: argsz {argsz} is smaller than the 16-byte reply",
            cmd::name(command)
        )));
    }
    Ok((argsz, u32_at(body, 8)))
}

/// `VFIO_USER_DEVICE_SET_IRQS`: `argsz, flags, index, start, count: u32`, then for BOOL data
/// `count` bytes; eventfds come as descriptors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IrqSet {
    /// Bytes of the request's body as the client counts them.
    pub argsz: u32,
    /// One `irq_set_flags::DATA_*` and one `ACTION_*`.
    pub flags: u32,
    /// The interrupt kind (INTx, MSI, MSI-X, ...).
    pub index: u32,
    /// The first interrupt of that kind the request is about.
    pub start: u32,
    /// How many, from `start`.
    pub count: u32,
}

impl IrqSet {
    /// Bytes of the fixed part.
    pub const SIZE: usize = 20;

    /// The fixed part of a `DEVICE_SET_IRQS`; EINVAL if it is short, its `argsz` wrong, or its
    /// flags name other than one data type and one action.
    pub fn parse(body: &[u8]) -> Result<IrqSet> {
        need(cmd::DEVICE_SET_IRQS, body, Self::SIZE)?;
        let s = IrqSet {
            argsz: u32_at(body, 0),
            flags: u32_at(body, 4),
            index: u32_at(body, 8),
            start: u32_at(body, 12),
            count: u32_at(body, 16),
        };
        check_argsz(cmd::DEVICE_SET_IRQS, s.argsz, Self::SIZE, body.len())?;
        let data = s.flags & irq_set_flags::DATA_MASK;
        let action = s.flags & irq_set_flags::ACTION_ALL;
        if data.count_ones() != 1 || action.count_ones() != 1 || s.flags & !0x3f != 0 {
            return Err(Error::BadIrq(format!(
                "DEVICE_SET_IRQS: flags {:#x} must name exactly one data type and one action",
                s.flags
            )));
        }
        Ok(s)
    }
}

/// `REGION_READ` / `REGION_WRITE`: `offset: u64, region, count: u32`, then (writes, read
/// replies) `count` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionAccess {
    /// Byte offset in the region.
    pub offset: u64,
    /// The region's index.
    pub region: u32,
    /// Bytes to read or written.
    pub count: u32,
}

impl RegionAccess {
    /// Bytes of the fixed part.
    pub const SIZE: usize = 16;

    /// The fixed part of a `REGION_READ` or `REGION_WRITE`; EINVAL if it is short, asks for more
    /// than [`MAX_DATA_XFER`], or (a write) carries other than `count` bytes of data.
    pub fn parse(command: u16, body: &[u8]) -> Result<RegionAccess> {
        need(command, body, Self::SIZE)?;
        let a = RegionAccess {
            offset: u64_at(body, 0),
            region: u32_at(body, 8),
            count: u32_at(body, 12),
        };
        if a.count as usize > MAX_DATA_XFER {
            return Err(Error::BadRegion(format!(
                "{}: count {} is above max_data_xfer_size {MAX_DATA_XFER}",
                cmd::name(command),
                a.count
            )));
        }
        if command == cmd::REGION_WRITE && body.len() != Self::SIZE + a.count as usize {
            return Err(Error::BadRegion(format!(
                "REGION_WRITE: count {} but {} bytes of data",
                a.count,
                body.len() - Self::SIZE
            )));
        }
        Ok(a)
    }

    /// The fixed part as it goes on the wire.
    pub fn to_bytes(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.region.to_le_bytes());
        b[12..16].copy_from_slice(&self.count.to_le_bytes());
        b
    }
}

/// One write of a `REGION_WRITE_MULTI`: `offset: u64, region, count: u32, data: [u8; 8]`.
pub const WRITE_MULTI_ONE: usize = 24;
/// Most writes in one `REGION_WRITE_MULTI` (QEMU's `VFIO_USER_MULTI_MAX`).
pub const WRITE_MULTI_MAX: u64 = 200;

/// The fixed part of a `DMA_READ` / `DMA_WRITE` body (server to client, for memory mapped
/// without a descriptor): `offset: u64` (the IOVA), `count: u64`, then the data (in the write
/// request and in the read reply). This is the specification's layout and the one QEMU 11.1's
/// client reads, as the real-guest trial shows: early versions of QEMU's client patches had a
/// `u32` count with the data at 12, which QEMU 11.1 answers with E2BIG.
pub const DMA_RW: usize = 16;

/// A `DMA_READ` request body: read `count` bytes at `iova`.
pub fn dma_read_request(iova: u64, count: u64) -> [u8; DMA_RW] {
    let mut b = [0u8; DMA_RW];
    b[0..8].copy_from_slice(&iova.to_le_bytes());
    b[8..16].copy_from_slice(&count.to_le_bytes());
    b
}

/// A `DMA_WRITE` request body: write `data` at `iova`.
pub fn dma_write_request(iova: u64, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(DMA_RW + data.len());
    b.extend_from_slice(&dma_read_request(iova, data.len() as u64));
    b.extend_from_slice(data);
    b
}

/// The data of a `DMA_READ` reply to a request for `count` bytes at `iova`. EINVAL if the body
/// is too short for `count` bytes or names another range (a client that answers something it
/// was not asked).
pub fn dma_read_reply(body: &[u8], iova: u64, count: usize) -> Result<&[u8]> {
    Size::AtLeast(DMA_RW + count).check("DMA_READ reply", body.len())?;
    let (at, n) = (u64_at(body, 0), u64_at(body, 8));
    if at != iova || n != count as u64 {
        return Err(Error::BadDma(format!(
            "DMA_READ reply for {n} bytes at {at:#x}, asked {count} bytes at {iova:#x}"
        )));
    }
    Ok(&body[DMA_RW..DMA_RW + count])
}

#[cfg(test)]
mod tests {
    use super::*;
    use memvisor_wire::WireError;

    #[test]
    fn refusals_say_what_kind_of_thing_was_wrong() {
        let e = dma_read_reply(&[0; 8], 0x1000, 4).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Wire(WireError::BadSize {
                    got: 8,
                    want: Size::AtLeast(_),
                    ..
                })
            ),
            "{e:?}"
        );
        let mut body = vec![0u8; DMA_RW + 4];
        body[0..8].copy_from_slice(&0x2000u64.to_le_bytes());
        body[8..16].copy_from_slice(&4u64.to_le_bytes());
        let e = dma_read_reply(&body, 0x1000, 4).unwrap_err();
        assert!(matches!(e, Error::BadDma(_)), "{e:?}");
        assert_eq!(e.errno(), libc::EINVAL);
    }

    #[test]
    fn header_round_trips() {
        let h = Header {
            id: 7,
            command: cmd::DMA_MAP,
            size: 48,
            flags: flags::REPLY | flags::ERROR,
            error: 22,
        };
        assert_eq!(Header::parse(&h.to_bytes()), h);
        assert!(h.is_reply());
    }

    #[test]
    fn short_bodies_and_bad_argsz_are_refused() {
        let m = DmaMap {
            argsz: 32,
            flags: 3,
            offset: 0,
            iova: 0x1000,
            size: 0x1000,
        };
        assert_eq!(DmaMap::parse(&m.to_bytes()).unwrap(), m);
        let e = DmaMap::parse(&m.to_bytes()[..31]).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("31 bytes"), "{e}");
        let big = DmaMap { argsz: 64, ..m };
        let e = DmaMap::parse(&big.to_bytes()).unwrap_err();
        assert!(e.to_string().contains("argsz 64"), "{e}");
    }

    #[test]
    fn unmap_flags_follow_linux() {
        let u = DmaUnmap {
            argsz: 24,
            flags: unmap_flags::ALL,
            iova: 0,
            size: 0,
            bitmap: None,
        };
        assert_eq!(DmaUnmap::parse(&u.to_bytes()).unwrap(), u);
        let bad = DmaUnmap { flags: 4, ..u };
        assert!(
            DmaUnmap::parse(&bad.to_bytes())
                .unwrap_err()
                .to_string()
                .contains("0x4")
        );
        // GET_DIRTY_BITMAP needs the bitmap struct after the fixed part.
        let dirty = DmaUnmap {
            flags: unmap_flags::GET_DIRTY_BITMAP,
            ..u
        };
        assert!(DmaUnmap::parse(&dirty.to_bytes()).is_err());
        let dirty = DmaUnmap {
            argsz: 40,
            bitmap: Some((4096, 8)),
            ..dirty
        };
        assert_eq!(DmaUnmap::parse(&dirty.to_bytes()).unwrap(), dirty);
    }

    #[test]
    fn region_write_count_must_match_its_data() {
        let a = RegionAccess {
            offset: 0,
            region: 0,
            count: 4,
        };
        let mut b = a.to_bytes().to_vec();
        b.extend_from_slice(&[1, 2, 3]);
        assert!(RegionAccess::parse(cmd::REGION_WRITE, &b).is_err());
        b.push(4);
        assert_eq!(RegionAccess::parse(cmd::REGION_WRITE, &b).unwrap(), a);
        let huge = RegionAccess {
            count: u32::MAX,
            ..a
        };
        assert!(RegionAccess::parse(cmd::REGION_READ, &huge.to_bytes()).is_err());
    }

    #[test]
    fn set_irqs_needs_one_data_type_and_one_action() {
        let mut b = Vec::new();
        for v in [
            20u32,
            irq_set_flags::DATA_EVENTFD | irq_set_flags::ACTION_TRIGGER,
            1,
            0,
            1,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        assert!(IrqSet::parse(&b).is_ok());
        b[4..8].copy_from_slice(
            &(irq_set_flags::DATA_EVENTFD
                | irq_set_flags::DATA_NONE
                | irq_set_flags::ACTION_TRIGGER)
                .to_le_bytes(),
        );
        assert!(IrqSet::parse(&b).is_err());
    }

    #[test]
    fn version_reads_json_up_to_nul() {
        let v = Version {
            major: 0,
            minor: 1,
            json: r#"{"capabilities":{}}"#.into(),
        };
        assert_eq!(Version::parse(&v.to_bytes()).unwrap(), v);
        assert!(Version::parse(&[0, 0, 0xff, 0xfe, 0]).is_ok());
        assert!(Version::parse(&[0, 0, 0, 0, 0xff, 0xfe]).is_err());
    }

    #[test]
    fn dma_rw_bodies_have_the_specs_layout() {
        let r = dma_read_request(0x1234_5000, 77);
        assert_eq!((u64_at(&r, 0), u64_at(&r, 8)), (0x1234_5000, 77));
        let w = dma_write_request(0x2000, &[1, 2, 3]);
        assert_eq!(w.len(), DMA_RW + 3);
        assert_eq!((u64_at(&w, 0), u64_at(&w, 8)), (0x2000, 3));
        assert_eq!(&w[16..], &[1, 2, 3]);
        let mut reply = dma_read_request(0x2000, 3).to_vec();
        reply.extend_from_slice(&[9, 8, 7]);
        assert_eq!(dma_read_reply(&reply, 0x2000, 3).unwrap(), &[9, 8, 7]);
        let e = dma_read_reply(&reply, 0x3000, 3).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("0x3000"), "{e}");
        assert_eq!(
            dma_read_reply(&reply[..18], 0x2000, 3).unwrap_err().errno(),
            libc::EINVAL
        );
    }
}
