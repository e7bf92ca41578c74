//! A block device as a disk: what the kernel says about it, read when the disk is opened, and
//! the one operation a block device needs its own call for (discard).
//!
//! **Size.** A regular file's length is its size; a block device's (an LVM volume, an NVMe
//! namespace, a partition, a loop device) is 0 in `fstat`, so its size comes from the
//! `BLKGETSIZE64` ioctl.
//!
//! **Block sizes and hints.** The logical block size (`BLKSSZGET`: the smallest unit the device
//! addresses; a request must be whole ones of it), the physical block size (`BLKPBSZGET`: the
//! unit it writes without reading first), the offset of the first physical block from the
//! start (`BLKALIGNOFF`: a partition may begin in the middle of one) and the I/O hints
//! (`BLKIOMIN`, `BLKIOOPT`). The blk device passes them to the guest in its config space
//! (`blk_size`, and the topology fields with `VIRTIO_BLK_F_TOPOLOGY`), as the guest's own
//! block layer would read them from a disk of its own.
//!
//! **What it can do with a range** is in sysfs, under the device's queue
//! (`/sys/dev/block/MAJ:MIN/queue/`; a partition has none, its disk's is one directory up):
//! `discard_max_bytes` (0: the device cannot discard), `discard_granularity`, and
//! `write_zeroes_max_bytes` (0: no zeroing command; the kernel then writes zeros itself).
//! Without sysfs (a container without `/sys`) the device is taken to discard nothing.
//!
//! **Discard** is `BLKDISCARD`: the kernel has no `fallocate` mode for a plain discard on a
//! block device (on one, `FALLOC_FL_PUNCH_HOLE` means "zero the range, unmapping where the
//! device can", and fails on a device without a zeroing command; Linux `block/fops.c`). A
//! discard promises nothing about what the range reads afterwards — nor does virtio's
//! `DISCARD`; only `WRITE_ZEROES` promises zeros. A loop device over a file punches a hole in
//! the file, which reads as zeros; an SSD may return the old data, zeros or ones. Zeroing goes
//! through `fallocate` as for a file ([`crate::disk`]), and the kernel carries it to the device.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use crate::error::{Error, Result};

/// The block-device ioctls (`linux/fs.h`), numbered for this architecture.
mod nr {
    const BLK: u32 = 0x12;
    vmm_sys_util::ioctl_io_nr!(BLKSSZGET, BLK, 104);
    vmm_sys_util::ioctl_ior_nr!(BLKGETSIZE64, BLK, 114, libc::size_t);
    vmm_sys_util::ioctl_io_nr!(BLKDISCARD, BLK, 119);
    vmm_sys_util::ioctl_io_nr!(BLKIOMIN, BLK, 120);
    vmm_sys_util::ioctl_io_nr!(BLKIOOPT, BLK, 121);
    vmm_sys_util::ioctl_io_nr!(BLKALIGNOFF, BLK, 122);
    vmm_sys_util::ioctl_io_nr!(BLKPBSZGET, BLK, 123);
}

/// What the kernel says about a block device, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockDev {
    /// The device's size.
    pub bytes: u64,
    /// Logical block size: offsets and lengths of every request are multiples of it.
    pub logical: u32,
    /// Physical block size: the unit the device writes without reading first.
    pub physical: u32,
    /// Where the first physical block starts, from the device's start.
    pub alignment_offset: u32,
    /// Smallest I/O the device prefers (0: no hint).
    pub io_min: u32,
    /// Largest I/O the device prefers (0: no hint).
    pub io_opt: u32,
    /// Most bytes one discard may cover; 0 when the device cannot discard.
    pub discard_max: u64,
    /// The unit the device discards in (0: not said).
    pub discard_granularity: u64,
    /// Most bytes one zeroing command may cover; 0 when the device has no such command (the
    /// kernel then writes zeros).
    pub write_zeroes_max: u64,
}

/// The block device behind `file`, or `None` when it is not one (a regular file).
pub fn probe(file: &File) -> Result<Option<BlockDev>> {
    let meta = file.metadata().map_err(|source| Error::Os {
        op: "stat the disk image",
        source,
    })?;
    if !meta.file_type().is_block_device() {
        return Ok(None);
    }
    let (major, minor) = (libc::major(meta.rdev()), libc::minor(meta.rdev()));
    let queue = |name: &str| -> Option<u64> {
        // A partition's directory has no queue of its own; its disk's is the parent directory
        // (sysfs resolves `..` after the link).
        ["queue", "../queue"].iter().find_map(|dir| {
            std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/{dir}/{name}"))
                .ok()?
                .trim()
                .parse()
                .ok()
        })
    };
    let discard_max = queue("discard_max_bytes");
    if discard_max.is_none() {
        log::info!(
            "disk: no /sys/dev/block/{major}:{minor}/queue to read the block device's discard \
             limits from: it is served without DISCARD"
        );
    }
    let logical = get::<libc::c_int>(file, nr::BLKSSZGET(), "BLKSSZGET (logical block size)")?;
    let align = get::<libc::c_int>(file, nr::BLKALIGNOFF(), "BLKALIGNOFF (alignment offset)")?;
    Ok(Some(BlockDev {
        bytes: size(file)?,
        logical: u32::try_from(logical).unwrap_or(512).max(512),
        physical: get::<libc::c_uint>(file, nr::BLKPBSZGET(), "BLKPBSZGET (physical block size)")?,
        // -1: the device's own alignment cannot be met at all; serve it as aligned at 0.
        alignment_offset: u32::try_from(align).unwrap_or(0),
        io_min: get::<libc::c_uint>(file, nr::BLKIOMIN(), "BLKIOMIN (minimum I/O size)")?,
        io_opt: get::<libc::c_uint>(file, nr::BLKIOOPT(), "BLKIOOPT (optimal I/O size)")?,
        discard_max: discard_max.unwrap_or(0),
        discard_granularity: queue("discard_granularity").unwrap_or(0),
        write_zeroes_max: queue("write_zeroes_max_bytes").unwrap_or(0),
    }))
}

/// The block device's size now (`BLKGETSIZE64`).
pub fn size(file: &File) -> Result<u64> {
    get::<u64>(
        file,
        nr::BLKGETSIZE64(),
        "BLKGETSIZE64 (size of the block device)",
    )
}

/// Discards `len` bytes at `offset` (`BLKDISCARD`; both multiples of the logical block size).
/// The kernel drops the range from the device's page cache first.
pub fn discard(file: &File, offset: u64, len: u64) -> std::io::Result<()> {
    let range: [u64; 2] = [offset, len];
    loop {
        // SAFETY: BLKDISCARD reads two u64 (start, length) from `range`, which outlives the
        // call; the descriptor is our own.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), nr::BLKDISCARD() as _, range.as_ptr()) };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Integers the `BLK*GET` ioctls write: each writes exactly one of its type.
trait Out: Copy + Default {}
impl Out for libc::c_int {}
impl Out for libc::c_uint {}
impl Out for u64 {}

/// Runs an ioctl that writes one `T`; `what` names it in the error.
fn get<T: Out>(file: &File, request: libc::c_ulong, what: &'static str) -> Result<T> {
    let mut v = T::default();
    // SAFETY: each caller pairs a request with the integer type it writes (int for BLKSSZGET
    // and BLKALIGNOFF, unsigned int for BLKPBSZGET, BLKIOMIN, BLKIOOPT, u64 for
    // BLKGETSIZE64); the kernel writes that one value into `v`, which outlives the call.
    let r = unsafe { libc::ioctl(file.as_raw_fd(), request as _, &mut v as *mut T) };
    if r < 0 {
        return Err(Error::Os {
            op: what,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(v)
}
