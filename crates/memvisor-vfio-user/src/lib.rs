//! A vfio-user device server on memvisor's DMA model.
//!
//! vfio-user carries VFIO to a device that lives in another process: the client (QEMU's
//! `vfio-user-pci`) runs the guest and forwards, over a Unix socket, what the guest's kernel
//! would have asked of the VFIO driver — the device's regions and interrupts, and the IOMMU
//! programming as `DMA_MAP` / `DMA_UNMAP` with the guest's memory as file descriptors. The
//! server is the device. Here the server's IOMMU is a [`memvisor::DmaSpace`]: the VFIO type1
//! model, with its rules and errnos, between every device access and guest memory.
//!
//! * [`proto`] is the wire format, parsed from bytes with every size checked; [`conn`] frames
//!   messages and passes descriptors (through `memvisor-wire`, shared with the vhost-user back
//!   ends).
//! * [`server`] is the protocol state machine and the DMA table; a [`server::Device`] only knows
//!   its regions, interrupts and registers, and reaches guest memory through its
//!   [`server::Port`].
//! * [`dmadev`] is `mvdma`, a reference PCI device with a scatter-gather copy engine, in a
//!   `dma_read`/`dma_write` mode and a `pin_pages` mode.
//!
//! A client for tests and a hostile one live in the test kit (`memvisor-testkit`), not here.
//!
//! The protocol layer is this project's own. rust-vmm's `vfio_user` 0.1.7 was read for it and
//! falls short for a server facing QEMU: its error replies carry errno 0 for most errors, its
//! unmap flags put UNMAP_ALL where Linux has the dirty-bitmap bit, a refused message can leave
//! the stream out of step, and malformed input can panic it.

#![cfg(target_os = "linux")]
// docs.rs (`--cfg docsrs`): each feature-gated item is labelled with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod conn;
pub mod dmadev;
pub mod error;
pub mod proto;
pub mod server;

pub use dmadev::{DmaDev, DmaDevStats};
pub use error::{Error, Result};
pub use memvisor_wire::WireError;
pub use server::{Device, IrqInfo, Port, RegionInfo, Server, ServerStats};

/// Locks `m` even if a thread panicked holding it: the server's mutexes guard bookkeeping
/// (the connection's writer, the device's state, statistics) that each change leaves
/// consistent, and one failed device thread must not take the others down with it.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
