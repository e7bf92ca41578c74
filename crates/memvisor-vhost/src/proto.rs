//! The vhost-user wire format: request numbers, feature bits, and the payloads this back end
//! reads and writes.
//!
//! Each payload with a layout of its own is a `#[repr(C)]` struct declared field by field as
//! `docs/interop/vhost-user.rst` (QEMU) lays it out, its size checked at compile time against
//! the specification's. Every payload comes from an untrusted frontend, so every parser checks
//! the length it was given against the struct and says which request and which size were
//! wrong. Nothing is reinterpreted in place: the fields are read one after another, in their
//! declared order, out of the received bytes (little-endian), and written back the same way,
//! which needs no `unsafe` and no alignment.

use memvisor_wire::Size;
use virtio_bindings::{virtio_config, virtio_ring};

use crate::error::{Error, Result};

/// Front-end requests this back end knows, by number.
pub mod req {
    /// The virtio and vhost-user feature bits the back end offers.
    pub const GET_FEATURES: u32 = 1;
    /// The feature bits the driver accepted.
    pub const SET_FEATURES: u32 = 2;
    /// The frontend takes the back end (a session starts).
    pub const SET_OWNER: u32 = 3;
    /// The frontend gives the back end up (obsolete; treated as a reset).
    pub const RESET_OWNER: u32 = 4;
    /// The guest's memory: regions with a file descriptor each.
    pub const SET_MEM_TABLE: u32 = 5;
    /// The dirty log for migration, a shared memory file descriptor.
    pub const SET_LOG_BASE: u32 = 6;
    /// An eventfd to signal when the log was written (unused by this back end).
    pub const SET_LOG_FD: u32 = 7;
    /// A ring's size.
    pub const SET_VRING_NUM: u32 = 8;
    /// A ring's descriptor table, available and used ring addresses.
    pub const SET_VRING_ADDR: u32 = 9;
    /// The next available index a ring starts from.
    pub const SET_VRING_BASE: u32 = 10;
    /// Stops a ring; answers with the next available index.
    pub const GET_VRING_BASE: u32 = 11;
    /// The eventfd the driver's kicks arrive on; starts the ring.
    pub const SET_VRING_KICK: u32 = 12;
    /// The eventfd that interrupts the driver.
    pub const SET_VRING_CALL: u32 = 13;
    /// The eventfd that tells the frontend a ring broke.
    pub const SET_VRING_ERR: u32 = 14;
    /// The protocol feature bits the back end offers ([`super::protocol`]).
    pub const GET_PROTOCOL_FEATURES: u32 = 15;
    /// The protocol feature bits the frontend accepted.
    pub const SET_PROTOCOL_FEATURES: u32 = 16;
    /// How many queues the device has.
    pub const GET_QUEUE_NUM: u32 = 17;
    /// Enables or disables a ring (with protocol features).
    pub const SET_VRING_ENABLE: u32 = 18;
    /// The socket for the back end's own requests ([`super::backend_req`]).
    pub const SET_BACKEND_REQ_FD: u32 = 21;
    /// An IOTLB update or invalidation behind a vIOMMU ([`super::IotlbMsg`]).
    pub const IOTLB_MSG: u32 = 22;
    /// Reads the device's config space.
    pub const GET_CONFIG: u32 = 24;
    /// Writes the device's config space.
    pub const SET_CONFIG: u32 = 25;
    /// Asks the back end for a new inflight log.
    pub const GET_INFLIGHT_FD: u32 = 31;
    /// Hands the back end the inflight log the frontend kept.
    pub const SET_INFLIGHT_FD: u32 = 32;
    /// Resets the device to its state before feature negotiation.
    pub const RESET_DEVICE: u32 = 34;
    /// How many memory regions the back end takes.
    pub const GET_MAX_MEM_SLOTS: u32 = 36;
    /// Adds one memory region.
    pub const ADD_MEM_REG: u32 = 37;
    /// Removes one memory region.
    pub const REM_MEM_REG: u32 = 38;
    /// The virtio device status byte the driver set.
    pub const SET_STATUS: u32 = 39;
    /// Reads the virtio device status byte back.
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
pub const F_IOMMU_PLATFORM: u64 = 1 << virtio_config::VIRTIO_F_ACCESS_PLATFORM;
/// Virtio feature bit: a modern (virtio 1.0) device (`VIRTIO_F_VERSION_1`).
pub const F_VERSION_1: u64 = 1 << virtio_config::VIRTIO_F_VERSION_1;
/// Virtio feature bit: used and available event indexes (`VIRTIO_RING_F_EVENT_IDX`).
pub const F_EVENT_IDX: u64 = 1 << virtio_ring::VIRTIO_RING_F_EVENT_IDX;
/// Virtio feature bit: indirect descriptor tables (`VIRTIO_RING_F_INDIRECT_DESC`).
pub const F_INDIRECT_DESC: u64 = 1 << virtio_ring::VIRTIO_RING_F_INDIRECT_DESC;
/// vhost feature bit: log every write to guest memory (`VHOST_F_LOG_ALL`), during migration.
pub const F_LOG_ALL: u64 = 1 << 26;

/// Protocol feature bits.
pub mod protocol {
    /// Several queues (`GET_QUEUE_NUM`).
    pub const MQ: u64 = 1 << 0;
    /// A dirty log in shared memory (`SET_LOG_BASE`).
    pub const LOG_SHMFD: u64 = 1 << 1;
    /// A reply to any request that sets `NEED_REPLY`.
    pub const REPLY_ACK: u64 = 1 << 3;
    /// The back end's own channel (`SET_BACKEND_REQ_FD`).
    pub const BACKEND_REQ: u64 = 1 << 5;
    /// The config space over the protocol (`GET_CONFIG`, `SET_CONFIG`).
    pub const CONFIG: u64 = 1 << 9;
    /// The inflight log (`GET_INFLIGHT_FD`, `SET_INFLIGHT_FD`).
    pub const INFLIGHT_SHMFD: u64 = 1 << 12;
    /// `RESET_DEVICE` is understood.
    pub const RESET_DEVICE: u64 = 1 << 13;
    /// Memory regions one at a time (`ADD_MEM_REG`, `REM_MEM_REG`).
    pub const CONFIGURE_MEM_SLOTS: u64 = 1 << 15;
    /// The device status byte (`SET_STATUS`, `GET_STATUS`).
    pub const STATUS: u64 = 1 << 16;
}

/// Bytes of the header: request, flags, payload size ([`Header`]).
pub const HEADER: usize = std::mem::size_of::<Header>();
/// The largest payload accepted; a bigger one is a broken or hostile frontend and ends the
/// connection (the stream cannot be resynchronised).
pub const MAX_PAYLOAD: usize = 4096;
/// Regions (and descriptors) a `SET_MEM_TABLE` may carry.
pub const MAX_TABLE_REGIONS: usize = 8;
/// Bit of a kick/call/err payload that says "no descriptor follows".
pub const VRING_NOFD: u64 = 0x100;
/// Largest config space a frontend may read or write.
pub const MAX_CONFIG: u32 = 256;

/// A message's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
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
        let mut f = Fields(b);
        Header {
            request: f.u32(),
            flags: f.u32(),
            size: f.u32(),
        }
    }

    /// The header's bytes as sent.
    pub fn bytes(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        let fields = [self.request, self.flags, self.size].map(u32::to_le_bytes);
        for (out, v) in b.chunks_exact_mut(4).zip(fields) {
            out.copy_from_slice(&v);
        }
        b
    }

    /// The 12 bytes of a reply header to `request` with `size` payload bytes.
    pub fn reply(request: u32, size: usize) -> [u8; HEADER] {
        Header {
            request,
            flags: flags::VERSION | flags::REPLY,
            size: size as u32,
        }
        .bytes()
    }
}

/// The fields of a payload, read one after another (little-endian) in the order its
/// `#[repr(C)]` struct declares them. The caller has checked the payload's size; reading past
/// its end is a bug here, never the frontend's doing.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .expect("the payload's size was checked against its struct");
        self.0 = rest;
        *head
    }

    fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }

    /// Skips `n` bytes of padding.
    fn skip(&mut self, n: usize) {
        self.0 = &self.0[n..];
    }
}

// The structs' sizes are the specification's.
const _: () = {
    assert!(std::mem::size_of::<Header>() == 12);
    assert!(std::mem::size_of::<Region>() == 32);
    assert!(std::mem::size_of::<Inflight>() == 24);
    assert!(std::mem::size_of::<IotlbMsg>() == 32);
    assert!(std::mem::size_of::<VringAddr>() == 40);
    assert!(std::mem::size_of::<VringState>() == 8);
    assert!(std::mem::size_of::<LogBase>() == 16);
    assert!(std::mem::size_of::<ConfigHeader>() == 12);
};

/// `SET_VRING_NUM`, `SET_VRING_BASE`, `GET_VRING_BASE`, `SET_VRING_ENABLE`: a ring's index and
/// a number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct VringState {
    /// The ring.
    pub index: u32,
    /// The number (a size, an index, 0 or 1).
    pub num: u32,
}

/// `SET_LOG_BASE`: the dirty log's size and its offset in the descriptor's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct LogBase {
    /// Bytes of the log.
    pub mmap_size: u64,
    /// Where it starts in the file.
    pub mmap_offset: u64,
}

/// The head of a `GET_CONFIG` / `SET_CONFIG` payload; the config bytes follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct ConfigHeader {
    /// The first byte of the config space.
    pub offset: u32,
    /// How many bytes.
    pub size: u32,
    /// `VHOST_SET_CONFIG_TYPE_*`.
    pub flags: u32,
}

/// Checks that `payload` of `request` is exactly `want` bytes.
pub fn exact(request: u32, payload: &[u8], want: usize) -> Result<()> {
    Size::Exactly(want).check(req::name(request), payload.len())?;
    Ok(())
}

/// A `u64` payload.
pub fn u64_payload(request: u32, payload: &[u8]) -> Result<u64> {
    exact(request, payload, 8)?;
    Ok(Fields(payload).u64())
}

/// One memory region of a memory table or of `ADD_MEM_REG` / `REM_MEM_REG`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
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

const REGION: usize = std::mem::size_of::<Region>();

impl Region {
    fn parse(f: &mut Fields<'_>) -> Region {
        Region {
            gpa: f.u64(),
            size: f.u64(),
            user_addr: f.u64(),
            mmap_offset: f.u64(),
        }
    }
}

/// `SET_MEM_TABLE`: a region count, padding, then the regions.
pub fn mem_table(payload: &[u8]) -> Result<Vec<Region>> {
    Size::AtLeast(8).check("SET_MEM_TABLE", payload.len())?;
    let n = Fields(payload).u32() as usize;
    if n > MAX_TABLE_REGIONS {
        return Err(Error::BadRegion(format!(
            "SET_MEM_TABLE with {n} regions: at most {MAX_TABLE_REGIONS} \
             (use ADD_MEM_REG for more)"
        )));
    }
    // QEMU sends the payload sized for the regions it fills.
    let want = 8 + n * REGION;
    Size::AtLeast(want).check("SET_MEM_TABLE", payload.len())?;
    let mut f = Fields(payload);
    f.skip(8);
    Ok((0..n).map(|_| Region::parse(&mut f)).collect())
}

/// `ADD_MEM_REG` / `REM_MEM_REG`: padding, then one region.
pub fn single_region(request: u32, payload: &[u8]) -> Result<Region> {
    exact(request, payload, 8 + REGION)?;
    let mut f = Fields(payload);
    f.skip(8);
    Ok(Region::parse(&mut f))
}

/// `SET_VRING_NUM`, `SET_VRING_BASE`, `GET_VRING_BASE`, `SET_VRING_ENABLE`: index and a number.
pub fn vring_state(request: u32, payload: &[u8]) -> Result<(u32, u32)> {
    exact(request, payload, std::mem::size_of::<VringState>())?;
    let mut f = Fields(payload);
    let s = VringState {
        index: f.u32(),
        num: f.u32(),
    };
    Ok((s.index, s.num))
}

/// `SET_LOG_BASE`: the log's size and its offset in the descriptor's file.
pub fn log_base(payload: &[u8]) -> Result<(u64, u64)> {
    exact(req::SET_LOG_BASE, payload, std::mem::size_of::<LogBase>())?;
    let mut f = Fields(payload);
    let l = LogBase {
        mmap_size: f.u64(),
        mmap_offset: f.u64(),
    };
    Ok((l.mmap_size, l.mmap_offset))
}

/// `GET_INFLIGHT_FD` / `SET_INFLIGHT_FD`: the inflight log's description.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
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
    pub const SIZE: usize = std::mem::size_of::<Inflight>();

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
        let mut f = Fields(payload);
        Ok(Inflight {
            mmap_size: f.u64(),
            mmap_offset: f.u64(),
            num_queues: f.u16(),
            queue_size: f.u16(),
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

/// `IOTLB_MSG` (both directions): the IOTLB entry or request (`struct vhost_iotlb_msg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
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
        let mut f = Fields(payload);
        Ok(IotlbMsg {
            iova: f.u64(),
            size: f.u64(),
            uaddr: f.u64(),
            perm: f.u8(),
            kind: f.u8(),
        })
    }

    /// The 32 bytes as sent (the fields, then the struct's padding).
    pub fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(std::mem::size_of::<IotlbMsg>());
        for v in [self.iova, self.size, self.uaddr] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.push(self.perm);
        b.push(self.kind);
        b.resize(std::mem::size_of::<IotlbMsg>(), 0);
        b
    }
}

/// A vring state reply.
pub fn vring_state_bytes(index: u32, num: u32) -> Vec<u8> {
    let s = VringState { index, num };
    let mut b = s.index.to_le_bytes().to_vec();
    b.extend_from_slice(&s.num.to_le_bytes());
    b
}

/// `SET_VRING_ADDR`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
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
    exact(
        req::SET_VRING_ADDR,
        payload,
        std::mem::size_of::<VringAddr>(),
    )?;
    let mut f = Fields(payload);
    Ok(VringAddr {
        index: f.u32(),
        flags: f.u32(),
        desc: f.u64(),
        used: f.u64(),
        avail: f.u64(),
        log: f.u64(),
    })
}

/// `GET_CONFIG` / `SET_CONFIG`: offset, size, flags, then `size` bytes.
pub fn config(request: u32, payload: &[u8]) -> Result<(u32, u32, &[u8])> {
    const HEAD: usize = std::mem::size_of::<ConfigHeader>();
    Size::AtLeast(HEAD).check(req::name(request), payload.len())?;
    let mut f = Fields(payload);
    let h = ConfigHeader {
        offset: f.u32(),
        size: f.u32(),
        flags: f.u32(),
    };
    let (offset, size) = (h.offset, h.size);
    if offset.checked_add(size).is_none_or(|end| end > MAX_CONFIG) {
        return Err(Error::Invalid(format!(
            "{}: config bytes {offset}+{size} pass the {MAX_CONFIG}-byte config space",
            req::name(request)
        )));
    }
    let data = &payload[HEAD..];
    Size::Exactly(HEAD + size as usize).check(req::name(request), payload.len())?;
    Ok((offset, size, data))
}

/// A `GET_CONFIG` reply: the request's offset, size and flags, then the bytes.
pub fn config_bytes(offset: u32, flags: u32, data: &[u8]) -> Vec<u8> {
    let h = ConfigHeader {
        offset,
        size: data.len() as u32,
        flags,
    };
    let mut b = Vec::with_capacity(std::mem::size_of::<ConfigHeader>() + data.len());
    for v in [h.offset, h.size, h.flags] {
        b.extend_from_slice(&v.to_le_bytes());
    }
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
    fn each_struct_reads_back_what_it_wrote_at_the_specifications_offsets() {
        let h = Header {
            request: req::SET_VRING_ADDR,
            flags: flags::VERSION | flags::NEED_REPLY,
            size: 40,
        };
        let b = h.bytes();
        assert_eq!(&b[8..12], &40u32.to_le_bytes(), "size is the third word");
        assert_eq!(Header::parse(&b), h);
        let a = VringAddr {
            index: 1,
            flags: 1,
            desc: 0x1000,
            used: 0x2000,
            avail: 0x3000,
            log: 0x4000,
        };
        let b = a.bytes();
        assert_eq!(&b[16..24], &0x2000u64.to_le_bytes(), "used before avail");
        assert_eq!(vring_addr(&b).unwrap(), a);
        let m = IotlbMsg {
            iova: 0x10_0000,
            size: 0x1000,
            uaddr: 0x7f00_0000_0000,
            perm: iotlb::ACCESS_RW,
            kind: iotlb::UPDATE,
        };
        let b = m.bytes();
        assert_eq!(
            (b.len(), b[24], b[25]),
            (32, iotlb::ACCESS_RW, iotlb::UPDATE)
        );
        assert_eq!(IotlbMsg::parse(&b).unwrap(), m);
        let i = Inflight {
            mmap_size: 4096,
            mmap_offset: 0,
            num_queues: 2,
            queue_size: 256,
        };
        assert_eq!(
            Inflight::parse(req::SET_INFLIGHT_FD, &i.bytes()).unwrap(),
            i
        );
        // QEMU may leave the padding out.
        assert_eq!(
            Inflight::parse(req::SET_INFLIGHT_FD, &i.bytes()[..20]).unwrap(),
            i
        );
        let r = Region {
            gpa: 0,
            size: 1 << 20,
            user_addr: 0x7f00_0000_0000,
            mmap_offset: 0x1000,
        };
        assert_eq!(mem_table(&mem_table_bytes(&[r, r])).unwrap(), vec![r, r]);
        assert_eq!(
            single_region(req::ADD_MEM_REG, &single_region_bytes(&r)).unwrap(),
            r
        );
        let c = config_bytes(4, 0, &[1, 2, 3]);
        assert_eq!(
            config(req::SET_CONFIG, &c).unwrap(),
            (4, 3, &[1u8, 2, 3][..])
        );
    }

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
