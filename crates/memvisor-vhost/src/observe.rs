//! A seam through which a back end reports its IOTLB traffic to an observer, for the lab.
//!
//! Behind a vIOMMU the frontend's memory table, its IOTLB UPDATEs and INVALIDATEs and the back
//! end's MISSes are what a benchmark wants to replay. The back end calls an [`IotlbObserver`],
//! if one was given, as each of these happens; the product itself never installs one. The
//! observer that writes the traffic down, its file format and the replay live in the test kit
//! (`memvisor-testkit`'s `vhost::record`). Only a build with the `test-hooks` feature exposes
//! the seam (`Backend::record_iotlb`); otherwise the trait is private and the observer slot
//! stays empty.

use crate::proto::Region;

/// Told of a connection's IOTLB traffic as the back end handles it. Methods must not block for
/// long and must not fail the back end: an observer that cannot keep up drops what it cannot
/// keep.
pub trait IotlbObserver: Send {
    /// The memory table changed; `regions` is all of it, and the events after refer to it.
    fn table(&mut self, regions: &[Region]);
    /// IOTLB UPDATE of `size` bytes at `iova` to the frontend address `uaddr`, with the
    /// vhost-user permission `perm` (1 read, 2 write, 3 both).
    fn update(&mut self, iova: u64, size: u64, uaddr: u64, perm: u8);
    /// IOTLB INVALIDATE of `size` bytes at `iova`.
    fn invalidate(&mut self, iova: u64, size: u64);
    /// The back end asked the frontend for `iova` with permission `perm` (a MISS).
    fn miss(&mut self, iova: u64, perm: u8);
    /// A connection ended: write out anything held back.
    fn flush(&mut self);
}
