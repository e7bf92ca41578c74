//! What the device offers: its feature bits and its config space (`struct virtio_blk_config`
//! of the virtio specification, 5.2.4), written as the struct it is.
//!
//! The capacity is the image's whole sectors; `seg_max` the segments a request may have;
//! `blk_size` the image's block (its `O_DIRECT` alignment, or a block device's logical block);
//! the topology, when the image is a block device, its physical block and I/O sizes; the
//! discard and write-zeroes limits the storage's own, capped at ours. Feature bits and field
//! meanings are the kernel's (`virtio-bindings`).

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_F_BLK_SIZE, VIRTIO_BLK_F_DISCARD, VIRTIO_BLK_F_FLUSH, VIRTIO_BLK_F_MQ,
    VIRTIO_BLK_F_RO, VIRTIO_BLK_F_SEG_MAX, VIRTIO_BLK_F_TOPOLOGY, VIRTIO_BLK_F_WRITE_ZEROES,
};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ring::{VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC};
use vm_memory::ByteValued;

use super::{Blk, MAX_RANGE_SECTORS, MAX_RANGE_SEGS, SECTOR};

/// Segments per request the device accepts (config `seg_max`).
pub(super) const SEG_MAX: u32 = 254;

/// `struct virtio_blk_config`, little-endian fields in the specification's order. The
/// specification's struct is 60 bytes; `_tail` makes the padding Rust would add after it
/// explicit (a driver reading there gets zeros, as past the end).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct Config {
    capacity: u64,
    size_max: u32,
    seg_max: u32,
    geometry_cylinders: u16,
    geometry_heads: u8,
    geometry_sectors: u8,
    blk_size: u32,
    physical_block_exp: u8,
    alignment_offset: u8,
    min_io_size: u16,
    opt_io_size: u32,
    writeback: u8,
    unused0: u8,
    num_queues: u16,
    max_discard_sectors: u32,
    max_discard_seg: u32,
    discard_sector_alignment: u32,
    max_write_zeroes_sectors: u32,
    max_write_zeroes_seg: u32,
    write_zeroes_may_unmap: u8,
    unused1: [u8; 3],
    _tail: [u8; 4],
}

const _: () = assert!(std::mem::size_of::<Config>() == 64);

// SAFETY: `Config` is `repr(C)`, made of integers and byte arrays only, laid out with no
// implicit padding (the size assertion above; `_tail` is the padding made a field), so every
// byte pattern is a valid value and every byte of a value is initialized.
unsafe impl ByteValued for Config {}

impl Blk {
    /// The features the device offers.
    pub(super) fn offered_features(&self) -> u64 {
        let bit = |b: u32| 1u64 << b;
        let mut f = bit(VIRTIO_F_VERSION_1)
            | bit(VIRTIO_BLK_F_SEG_MAX)
            | bit(VIRTIO_BLK_F_BLK_SIZE)
            | bit(VIRTIO_BLK_F_FLUSH)
            | bit(VIRTIO_RING_F_INDIRECT_DESC)
            | bit(VIRTIO_RING_F_EVENT_IDX);
        if self.options.queues > 1 {
            f |= bit(VIRTIO_BLK_F_MQ);
        }
        if self.options.read_only {
            f |= bit(VIRTIO_BLK_F_RO);
        } else {
            f |= bit(VIRTIO_BLK_F_WRITE_ZEROES);
            // A block device that cannot discard is not offered DISCARD.
            if self.disk.discard_limits().is_some() {
                f |= bit(VIRTIO_BLK_F_DISCARD);
            }
        }
        if self.disk.topology().is_some() {
            f |= bit(VIRTIO_BLK_F_TOPOLOGY);
        }
        if self.options.iommu {
            f |= crate::proto::F_IOMMU_PLATFORM;
        }
        f
    }

    /// The config space's bytes.
    pub(super) fn config_space(&self) -> Vec<u8> {
        let block = self.disk.block_size();
        let mut c = Config {
            capacity: self.capacity.sectors().to_le(),
            seg_max: SEG_MAX.to_le(),
            blk_size: (block as u32).to_le(),
            num_queues: self.options.queues.to_le(),
            ..Config::default()
        };
        if let Some(t) = self.disk.topology() {
            let t = t.config();
            c.physical_block_exp = t[0];
            c.alignment_offset = t[1];
            c.min_io_size = u16::from_le_bytes([t[2], t[3]]).to_le();
            c.opt_io_size = u32::from_le_bytes([t[4], t[5], t[6], t[7]]).to_le();
        }
        // The storage's own limits, capped at ours; never below one block.
        let sectors =
            |bytes: u64| (bytes / SECTOR).clamp(block / SECTOR, MAX_RANGE_SECTORS.into()) as u32;
        if let (false, Some((max, unit))) = (self.options.read_only, self.disk.discard_limits()) {
            c.max_discard_sectors = sectors(max).to_le();
            c.max_discard_seg = MAX_RANGE_SEGS.to_le();
            c.discard_sector_alignment = sectors(unit).to_le();
        }
        if !self.options.read_only {
            c.max_write_zeroes_sectors = sectors(self.disk.write_zeroes_max()).to_le();
            c.max_write_zeroes_seg = MAX_RANGE_SEGS.to_le();
            c.write_zeroes_may_unmap = 1;
        }
        c.as_slice().to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields lie where the specification puts them.
    #[test]
    fn fields_lie_at_the_specification_offsets() {
        let c = Config {
            capacity: 0x0102_0304_0506_0708,
            seg_max: 254,
            blk_size: 4096,
            opt_io_size: 0x55,
            num_queues: 3,
            max_discard_sectors: 7,
            max_write_zeroes_seg: 9,
            write_zeroes_may_unmap: 1,
            ..Config::default()
        };
        let b = c.as_slice();
        assert_eq!(b[0..8], 0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(b[12..16], 254u32.to_le_bytes());
        assert_eq!(b[20..24], 4096u32.to_le_bytes());
        assert_eq!(b[28..32], 0x55u32.to_le_bytes());
        assert_eq!(b[34..36], 3u16.to_le_bytes());
        assert_eq!(b[36..40], 7u32.to_le_bytes());
        assert_eq!(b[52..56], 9u32.to_le_bytes());
        assert_eq!(b[56], 1);
    }
}
