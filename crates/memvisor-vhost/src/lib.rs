//! vhost-user back ends on memvisor's guest memory.
//!
//! A vhost-user frontend (QEMU) runs the guest and hands a device's virtqueues to a back-end
//! process over a Unix socket: it sends the guest's memory as file descriptors, the rings'
//! addresses, and eventfds for kicks and interrupts. This crate is that back-end process's
//! protocol layer and two devices, with memvisor as the memory underneath:
//!
//! * [`wire`] frames messages and passes descriptors; [`proto`] parses each payload from bytes,
//!   checking sizes. Both are this crate's own: rust-vmm's `vhost` 0.18 keeps its socket
//!   endpoint private and its back-end request handler has no way to receive `IOTLB_MSG`
//!   (rust-vmm/vhost issue 312), which the IOMMU support built on this layer needs.
//! * [`memory`] turns the frontend's memory table into memvisor backings, slots and a
//!   [`memvisor::DmaSpace`] — the one memory model; the front end adds none of its own.
//! * [`backend`] is the protocol state machine and the serving loop; a [`device::Device`] only
//!   knows its features, config space and queues.
//! * [`balloon`] is virtio-balloon (free page reporting, inflate, deflate, the statistics queue,
//!   deflate on OOM) through memvisor's balloon model and pin-aware discard.
//! * [`blk`] is virtio-blk over a raw image with `preadv`/`pwritev` straight into guest memory,
//!   pages held in memvisor's pin registry (not locked) for the duration of each request;
//!   [`disk`] is the image file or block device, through the page cache or `O_DIRECT`; [`blockdev`] reads what the
//!   kernel says about a block device (size, block sizes, discard limits).
//! * [`image_lock`] takes QEMU's image locks on a disk image, so memvisor, QEMU and
//!   qemu-storage-daemon never open one image for writing twice; [`image_format`] refuses an
//!   image whose first bytes are another format's header (qcow2, VMDK, LUKS, ...).
//! * [`ring`] is a started virtqueue as a device sees it: the split queue and, when the
//!   frontend keeps one, the inflight log that lets a restarted back end redo what was in
//!   flight.
//! * `worker` lends each running ring past the first to a thread of its own between messages,
//!   so a device with several queues uses several cores.
//! * [`miss`] collects the unmapped pages of a request behind a vIOMMU, so the back end asks
//!   for them together, and remembers what it asked for.
//! * `observe` (public with the `test-hooks` feature only) is the seam through which the test
//!   kit's recorder sees a connection's IOTLB traffic, for `memvisor-bench iotlb` to replay.
//! * [`live`] holds the counters of a back end, its rings and its device, which other threads
//!   read while it serves (a control socket's live statistics).
//! * `hooks` (feature `test-hooks` only) holds the two switches of `memvisor::faults::Faults`
//!   (given in `ProcessState::with_faults`) that break the back end on purpose for the real-guest
//!   trials' negative controls and take more than a flag's test where they act.
//!
//! Virtqueues are read with rust-vmm's `virtio-queue` over the device space's vm-memory view
//! ([`memvisor::DmaMemory`]), addressed like the device's buffers (IOVAs behind a vIOMMU).
//! Every message and every descriptor is untrusted input: a refused one leaves the back end's
//! state as it was and gets a failure the frontend sees — an error reply, or the connection
//! closed when the frontend asked for no reply — or, for a descriptor, an `IOERR` status on the
//! ring.

#![cfg(target_os = "linux")]
// docs.rs (`--cfg docsrs`): each feature-gated item is labelled with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod balloon;
pub mod blk;
pub mod blockdev;
pub mod device;
pub mod disk;
pub mod error;
#[cfg(feature = "test-hooks")]
mod hooks;
pub mod image_format;
pub mod image_lock;
pub mod live;
pub mod memory;
pub mod miss;
#[cfg(feature = "test-hooks")]
pub mod observe;
#[cfg(not(feature = "test-hooks"))]
mod observe;
pub mod proto;
pub mod ring;
pub mod wire;
mod worker;

pub use backend::Backend;
pub use balloon::{BalloonDevice, BalloonLive, BalloonStatus, BalloonTarget};
pub use blk::{Blk, BlkCapacity, BlkLive, BlkOptions, BlkStats, Throttle, ThrottleConfig};
pub use device::Device;
pub use error::{Error, Result};
pub use live::{BackendLive, BackendStats, QueueStats};
pub use memory::{FrontendMemory, ProcessState};
pub use memvisor_wire::WireError;
pub use ring::Ring;
