//! The vhost-user wire format: request numbers, feature bits, and the payloads this back end
//! reads and writes, parsed from bytes at fixed little-endian offsets.
//!
//! Every payload comes from an untrusted frontend, so every parser checks the length it was
//! given against the layout (`docs/interop/vhost-user.rst` in QEMU) and says which request and
//! which size were wrong. Nothing here is reinterpreted in place: fields are read one by one out
//! of the received bytes, which needs no `unsafe` and no alignment.

use memvisor_wire::Size;

use crate::error::{Error, Result};

/// Front-end requests this back end knows, by number.
#[allow(missing_docs)]
pub mod req {
    pub const GET_FEATURES: u32 = 1;
    pub const SET_FEATURES: u32 = 2;
    pub const SET_OWNER: u32 = 3;
    pub const RESET_OWNER: u32 = 4;
    pub const SET_MEM_TABLE: u32 = 5;
    pub const SET_LOG_BASE: u32 = 6;
    pub const SET_LOG_FD: u32 = 7;
    pub const SET_VRING_NUM: u32 = 8;
    pub const SET_VRING_ADDR: u32 = 9;
    pub const SET_VRING_BASE: u32 = 10;
    pub const GET_VRING_BASE: u32 = 11;
    pub const SET_VRING_KICK: u32 = 12;
    pub const SET_VRING_CALL: u32 = 13;
    pub const SET_VRING_ERR: u32 = 14;
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    pub const GET_QUEUE_NUM: u32 = 17;
    pub const SET_VRING_ENABLE: u32 = 18;
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    pub const IOTLB_MSG: u32 = 22;
    pub const GET_CONFIG: u32 = 24;
    pub const SET_CONFIG: u32 = 25;
    pub const GET_INFLIGHT_FD: u32 = 31;
    pub const SET_INFLIGHT_FD: u32 = 32;
    pub const RESET_DEVICE: u32 = 34;
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    pub const ADD_MEM_REG: u32 = 37;
    pub const REM_MEM_REG: u32 = 38;
    pub const SET_STATUS: u32 = 39;
    pub const GET_STATUS: u32 = 40;

    /// The request's name for messages and logs.
    pub fn name(request: u32) -> &'static str {
        match request {
            GET_FEATURES => "GET_FEATURES",
            SET_FEATURES => "SET_FEATURES",
            SET_OWNER => "SET_OWNER",
            RESET_OWNER => "RESET_OWNER",
            SET_MEM_TABLE => "SET_MEM_TABLE",
            SET_LOG_BASE => "SET_LOG_BASE",
            SET_LOG_FD => "SET_LOG_FD",
            SET_VRING_NUM => "SET_VRING_NUM",
            SET_VRING_ADDR => "SET_VRING_ADDR",
            SET_VRING_BASE => "SET_VRING_BASE",
            GET_VRING_BASE => "GET_VRING_BASE",
            SET_VRING_KICK => "SET_VRING_KICK",
            SET_VRING_CALL => "SET_VRING_CALL",
            SET_VRING_ERR => "SET_VRING_ERR",
            GET_PROTOCOL_FEATURES => "GET_PROTOCOL_FEATURES",
            SET_PROTOCOL_FEATURES => "SET_PROTOCOL_FEATURES",
            GET_QUEUE_NUM => "GET_QUEUE_NUM",
            SET_VRING_ENABLE => "SET_VRING_ENABLE",
            SET_BACKEND_REQ_FD => "SET_BACKEND_REQ_FD",
            IOTLB_MSG => "IOTLB_MSG",
            GET_CONFIG => "GET_CONFIG",
            SET_CONFIG => "SET_CONFIG",
            GET_INFLIGHT_FD => "GET_INFLIGHT_FD",
            SET_INFLIGHT_FD => "SET_INFLIGHT_FD",
            RESET_DEVICE => "RESET_DEVICE",
            GET_MAX_MEM_SLOTS => "GET_MAX_MEM_SLOTS",
            ADD_MEM_REG => "ADD_MEM_REG",
            REM_MEM_REG => "REM_MEM_REG",
            SET_STATUS => "SET_STATUS",
            GET_STATUS => "GET_STATUS",
            _ => "unknown request",
        }
    }
}

/// Back-end requests (back end to frontend, on the `SET_BACKEND_REQ_FD` channel).
pub mod backend_req {
    /// An IOTLB miss.
    pub const IOTLB_MSG: u32 = 1;
    /// The device's config space changed; the frontend re-reads it.
    pub const CONFIG_CHANGE_MSG: u32 = 2;
}

/// Header flag bits.
pub mod flags {
    /// The protocol version this back end speaks, in the low two bits.
    pub const VERSION: u32 = 0x1;
    /// Mask of the version bits.
    pub const VERSION_MASK: u32 = 0x3;
    /// Set on replies.
    pub const REPLY: u32 = 0x4;
    /// The front end wants a `REPLY_ACK` for a request that has no reply of its own.
    pub const NEED_REPLY: u32 = 0x8;
}

/// Virtio feature bit of vhost-user: protocol features can be negotiated.
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// Virtio feature bit: the device's addresses go through the platform's IOMMU
/// (`VIRTIO_F_IOMMU_PLATFORM` / `ACCESS_PLATFORM`); with vhost-user, through the IOTLB.
pub const F_IOMMU_PLATFORM: u64 = 1 << 33;
/// vhost feature bit: log every write to guest memory (`VHOST_F_LOG_ALL`), during migration.
pub const F_LOG_ALL: u64 = 1 << 26;

/// Protocol feature bits.
#[allow(missing_docs)]
pub mod protocol {
    pub const MQ: u64 = 1 << 0;
    pub const LOG_SHMFD: u64 = 1 << 1;
    pub const REPLY_ACK: u64 = 1 << 3;
    pub const BACKEND_REQ: u64 = 1 << 5;
    pub const CONFIG: u64 = 1 << 9;
    pub const INFLIGHT_SHMFD: u64 = 1 << 12;
    pub const RESET_DEVICE: u64 = 1 << 13;
    pub const CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
    pub const STATUS: u64 = 1 << 16;
}

/// Bytes of the header: request, flags, payload size.
pub const HEADER: usize = 12;
/// The largest payload accepted; a bigger one is a broken or hostile frontend and ends the
/// connection (the stream cannot be resynchronised).
pub const MAX_PAYLOAD: usize = 4096;
/// Regions (and descriptors) a `SET_MEM_TABLE` may carry.
pub const MAX_TABLE_REGIONS: usize = 8;
/// Bit of a kick/call/err payload that says "no descriptor follows".
pub const VRING_NOFD: u64 = 0x100;
/// Largest config space a frontend may read or write.
pub const MAX_CONFIG: u32 = 256;

/// A received message's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Request number ([`req`]).
    pub request: u32,
    /// [`flags`].
    pub flags: u32,
    /// Payload bytes that follow.
    pub size: u32,
}

impl Header {
    /// Parses 12 header bytes.
    pub fn parse(b: &[u8; HEADER]) -> Header {
        Header {
            request: u32_at(b, 0),
            flags: u32_at(b, 4),
            size: u32_at(b, 8),
        }
    }

    /// The 12 bytes of a reply header to `request` with `size` payload bytes.
    pub fn reply(request: u32, size: usize) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&request.to_le_bytes());
        b[4..8].copy_from_slice(&(flags::VERSION | flags::REPLY).to_le_bytes());
        b[8..12].copy_from_slice(&(size as u32).to_le_bytes());
        b
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks that `payload` of `request` is exactly `want` bytes.
pub fn exact(request: u32, payload: &[u8], want: usize) -> Result<()> {
    Size::Exactly(want).check(req::name(request), payload.len())?;
    Ok(())
}

/// A `u64` payload.
pub fn u64_payload(request: u32, payload: &[u8]) -> Result<u64> {
    exact(request, payload, 8)?;
    Ok(u64_at(payload, 0))
}

/// One memory region of a memory table or of `ADD_MEM_REG` / `REM_MEM_REG`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Guest physical address of the first byte.
    pub gpa: u64,
    /// Bytes.
    pub size: u64,
    /// Where the frontend has it mapped (its own virtual address): ring addresses are given in
    /// these.
    pub user_addr: u64,
    /// Offset of the region in the descriptor's file.
    pub mmap_offset: u64,
}

const REGION: usize = 32;

impl Region {
    fn parse(b: &[u8]) -> Region {
        Region {
            gpa: u64_at(b, 0),
            size: u64_at(b, 8),
            user_addr: u64_at(b, 16),
            mmap_offset: u64_at(b, 24),
        }
    }
}

/// `SET_MEM_TABLE`: a region count, padding, then the regions.
pub fn mem_table(payload: &[u8]) -> Result<Vec<Region>> {
    Size::AtLeast(8).check("SET_MEM_TABLE", payload.len())?;
    let n = u32_at(payload, 0) as usize;
    if n > MAX_TABLE_REGIONS {
        return Err(Error::BadRegion(format!(
            "SET_MEM_TABLE with {n} regions: at most {MAX_TABLE_REGIONS} \
             (use ADD_MEM_REG for more)"
        )));
    }
    // QEMU sends the payload sized for the regions it fills.
    let want = 8 + n * REGION;
    Size::AtLeast(want).check("SET_MEM_TABLE", payload.len())?;
    Ok((0..n)
        .map(|i| Region::parse(&payload[8 + i * REGION..]))
        .collect())
}

/// `ADD_MEM_REG` / `REM_MEM_REG`: padding, then one region.
pub fn single_region(request: u32, payload: &[u8]) -> Result<Region> {
    exact(request, payload, 8 + REGION)?;
    Ok(Region::parse(&payload[8..]))
}

/// `SET_VRING_NUM`, `SET_VRING_BASE`, `GET_VRING_BASE`, `SET_VRING_ENABLE`: index and a number.
pub fn vring_state(request: u32, payload: &[u8]) -> Result<(u32, u32)> {
    exact(request, payload, 8)?;
    Ok((u32_at(payload, 0), u32_at(payload, 4)))
}

/// `SET_LOG_BASE`: the log's size and its offset in the descriptor's file.
pub fn log_base(payload: &[u8]) -> Result<(u64, u64)> {
    exact(req::SET_LOG_BASE, payload, 16)?;
    Ok((u64_at(payload, 0), u64_at(payload, 8)))
}

/// `GET_INFLIGHT_FD` / `SET_INFLIGHT_FD`: the inflight log's description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Inflight {
    /// Bytes of the log (0 in a `GET_INFLIGHT_FD` request).
    pub mmap_size: u64,
    /// Where it starts in the memfd.
    pub mmap_offset: u64,
    /// Queues it covers.
    pub num_queues: u16,
    /// Heads per queue.
    pub queue_size: u16,
}

impl Inflight {
    /// Bytes on the wire: two u64 and two u16, padded to 8 as QEMU's struct is.
    pub const SIZE: usize = 24;

    /// Parses the payload of `request`; the padding may be left out (20 bytes).
    pub fn parse(request: u32, payload: &[u8]) -> Result<Inflight> {
        if payload.len() != Self::SIZE && payload.len() != 20 {
            return Err(Error::Invalid(format!(
                "{}: payload of {} bytes, expected {} (an inflight description)",
                req::name(request),
                payload.len(),
                Self::SIZE
            )));
        }
        Ok(Inflight {
            mmap_size: u64_at(payload, 0),
            mmap_offset: u64_at(payload, 8),
            num_queues: u16::from_le_bytes([payload[16], payload[17]]),
            queue_size: u16::from_le_bytes([payload[18], payload[19]]),
        })
    }

    /// The payload's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::SIZE);
        b.extend_from_slice(&self.mmap_size.to_le_bytes());
        b.extend_from_slice(&self.mmap_offset.to_le_bytes());
        b.extend_from_slice(&self.num_queues.to_le_bytes());
        b.extend_from_slice(&self.queue_size.to_le_bytes());
        b.resize(Self::SIZE, 0);
        b
    }
}

/// `IOTLB_MSG` (both directions): the IOTLB entry or request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IotlbMsg {
    /// First IOVA.
    pub iova: u64,
    /// Bytes.
    pub size: u64,
    /// The frontend's user address behind `iova` (UPDATE).
    pub uaddr: u64,
    /// 1 read-only, 2 write-only, 3 read-write (the device's access).
    pub perm: u8,
    /// 1 MISS, 2 UPDATE, 3 INVALIDATE, 4 ACCESS_FAIL.
    pub kind: u8,
}

/// `IOTLB_MSG` types.
pub mod iotlb {
    /// The back end has no translation (back end to frontend).
    pub const MISS: u8 = 1;
    /// A translation (frontend to back end).
    pub const UPDATE: u8 = 2;
    /// Translations to remove.
    pub const INVALIDATE: u8 = 3;
    /// A miss's access: read only (`VHOST_ACCESS_RO`).
    pub const ACCESS_RO: u8 = 1;
    /// A miss's access: read and write (`VHOST_ACCESS_RW`).
    pub const ACCESS_RW: u8 = 3;
}

impl IotlbMsg {
    /// Parses the payload (`struct vhost_iotlb_msg`, 26 bytes and padding).
    pub fn parse(payload: &[u8]) -> Result<IotlbMsg> {
        Size::Between(26, 64).check("IOTLB_MSG", payload.len())?;
        Ok(IotlbMsg {
            iova: u64_at(payload, 0),
            size: u64_at(payload, 8),
            uaddr: u64_at(payload, 16),
            perm: payload[24],
            kind: payload[25],
        })
    }

    /// The 32 bytes as sent.
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(32);
        for v in [self.iova, self.size, self.uaddr] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(self.perm);
        b.push(self.kind);
        b.resize(32, 0);
        b
    }
}

/// A vring state reply.
pub fn vring_state_bytes(index: u32, num: u32) -> Vec<u8> {
    let mut b = index.to_le_bytes().to_vec();
    b.extend_from_slice(&num.to_le_bytes());
    b
}

/// `SET_VRING_ADDR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VringAddr {
    /// Queue index.
    pub index: u32,
    /// Bit 0: log the used ring at `log`.
    pub flags: u32,
    /// Descriptor table, in the frontend's user addresses (IOVAs under an IOMMU).
    pub desc: u64,
    /// Used ring, likewise.
    pub used: u64,
    /// Available ring, likewise.
    pub avail: u64,
    /// Guest physical address of the used ring, for the dirty log.
    pub log: u64,
}

/// Parses `SET_VRING_ADDR`.
pub fn vring_addr(payload: &[u8]) -> Result<VringAddr> {
    exact(req::SET_VRING_ADDR, payload, 40)?;
    Ok(VringAddr {
        index: u32_at(payload, 0),
        flags: u32_at(payload, 4),
        desc: u64_at(payload, 8),
        used: u64_at(payload, 16),
        avail: u64_at(payload, 24),
        log: u64_at(payload, 32),
    })
}

/// `GET_CONFIG` / `SET_CONFIG`: offset, size, flags, then `size` bytes.
pub fn config(request: u32, payload: &[u8]) -> Result<(u32, u32, &[u8])> {
    Size::AtLeast(12).check(req::name(request), payload.len())?;
    let (offset, size) = (u32_at(payload, 0), u32_at(payload, 4));
    if offset.checked_add(size).is_none_or(|end| end > MAX_CONFIG) {
        return Err(Error::Invalid(format!(
            "{}: config bytes {offset}+{size} pass the {MAX_CONFIG}-byte config space",
            req::name(request)
        )));
    }
    let data = &payload[12..];
    Size::Exactly(12 + size as usize).check(req::name(request), payload.len())?;
    Ok((offset, size, data))
}

/// A `GET_CONFIG` reply: the request's offset, size and flags, then the bytes.
pub fn config_bytes(offset: u32, flags: u32, data: &[u8]) -> Vec<u8> {
    let mut b = offset.to_le_bytes().to_vec();
    b.extend_from_slice(&(data.len() as u32).to_le_bytes());
    b.extend_from_slice(&flags.to_le_bytes());
    b.extend_from_slice(data);
    b
}

impl Region {
    /// The region's 32 bytes as sent.
    pub fn bytes(&self) -> [u8; REGION] {
        let mut b = [0u8; REGION];
        for (i, v) in [self.gpa, self.size, self.user_addr, self.mmap_offset]
            .into_iter()
            .enumerate()
        {
            b[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// A `SET_MEM_TABLE` payload.
pub fn mem_table_bytes(regions: &[Region]) -> Vec<u8> {
    let mut b = (regions.len() as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&[0; 4]);
    for r in regions {
        b.extend_from_slice(&r.bytes());
    }
    b
}

/// An `ADD_MEM_REG` / `REM_MEM_REG` payload.
pub fn single_region_bytes(r: &Region) -> Vec<u8> {
    let mut b = vec![0u8; 8];
    b.extend_from_slice(&r.bytes());
    b
}

impl VringAddr {
    /// The 40 bytes as sent.
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = self.index.to_le_bytes().to_vec();
        b.extend_from_slice(&self.flags.to_le_bytes());
        for v in [self.desc, self.used, self.avail, self.log] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memvisor_wire::WireError;

    #[test]
    fn refusals_say_what_kind_of_thing_was_wrong() {
        let e = u64_payload(req::SET_FEATURES, &[0; 7]).unwrap_err();
        assert!(
            matches!(
                e,
                Error::Wire(WireError::BadSize {
                    what: "SET_FEATURES",
                    got: 7,
                    want: Size::Exactly(8)
                })
            ),
            "{e:?}"
        );
        let mut t = vec![0u8; 8];
        t[0] = 9;
        assert!(matches!(mem_table(&t), Err(Error::BadRegion(_))));
        let past = config_bytes(300, 0, &[]);
        assert!(matches!(
            config(req::GET_CONFIG, &past),
            Err(Error::Invalid(_))
        ));
    }

    #[test]
    fn short_long_and_oversized_payloads_are_refused_by_name() {
        let e = u64_payload(req::SET_FEATURES, &[0; 7]).unwrap_err();
        assert!(e.to_string().contains("SET_FEATURES"), "{e}");
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(vring_addr(&[0; 41]).is_err());
        let mut t = vec![0u8; 8];
        t[0] = 9;
        assert!(mem_table(&t).unwrap_err().to_string().contains("9 regions"));
        t[0] = 2;
        assert!(mem_table(&t).is_err(), "two regions promised, none sent");
        t.extend_from_slice(&[0; 64]);
        assert_eq!(mem_table(&t).unwrap().len(), 2);
        let mut c = vec![0u8; 12];
        c[0..4].copy_from_slice(&250u32.to_le_bytes());
        c[4..8].copy_from_slice(&10u32.to_le_bytes());
        c.extend_from_slice(&[0; 10]);
        assert!(
            config(req::GET_CONFIG, &c)
                .unwrap_err()
                .to_string()
                .contains("250+10")
        );
        c[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(config(req::GET_CONFIG, &c).is_err(), "offset + size wraps");
    }
}
