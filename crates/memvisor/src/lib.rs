//! memvisor: guest memory and DMA mapping for userspace VMMs and device back ends.
//!
//! What the Linux kernel does for virtual machines in KVM's memslots, VFIO's type1 IOMMU driver
//! and the balloon's free page reporting, memvisor does as a library, in layers that only ever
//! look down:
//!
//! ```text
//! addr     Gpa / Iova / Hva, page sizes, ranges that never wrap
//! adapt    when a slot cursor remembers its last slot and when it searches every address
//! backing  host memory: anonymous, memfd, THP, hugetlbfs, file          (owns mmap/munmap)
//! slots    guest physical -> host virtual: lock-free snapshots, per-vCPU cursors
//! pin      host pages held for DMA: the process-wide registry, mlock or long-term pins
//! dma      I/O virtual -> host: the VFIO type1 model, translation, dma_read/write, dirty pages
//! discard  free page reporting, host side: reported guest memory given back, pinned pages kept
//! vm_memory  (feature `vm-memory`) rust-vmm's vm-memory traits over the slot table (and, as
//!          dma::DmaMemory, over the device space, addressed by IOVA)
//! vm_memory_mmap  (feature `vm-memory-mmap`) a VMM's GuestRegionMmap / GuestMemoryMmap adopted
//!          as backings and slots, its mapping kept
//! balloon  (feature `virtio-balloon`) virtio-balloon free page reporting queue -> discard
//! ```
//!
//! Every fallible call returns [`Error`], whose [`Error::errno`] is what KVM or VFIO would
//! return for the same mistake. Guest memory is only ever copied through raw pointers; memvisor
//! never hands out `&[u8]` over memory the guest or a device can change underneath it.
#![cfg(target_os = "linux")]
// docs.rs (`--cfg docsrs`): each feature-gated item is labelled with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod adapt;
pub mod addr;
pub mod backing;
#[cfg(feature = "virtio-balloon")]
pub mod balloon;
pub mod bitmap;
mod copy;
pub mod discard;
pub mod dma;
pub mod error;
#[cfg(feature = "test-hooks")]
pub mod faults;
mod pin;
pub mod slots;
mod sync;
#[cfg(feature = "vm-memory")]
pub mod vm_memory;
#[cfg(feature = "vm-memory-mmap")]
pub mod vm_memory_mmap;

#[cfg(feature = "vm-memory")]
pub use crate::vm_memory::{DirtySlice, SlotMemory, SlotRegion, SlotRegions, SlotSpace};
pub use addr::{Gpa, Hva, Iova, PAGE_4K, PageSize, Range};
pub use backing::{
    AdoptedMemory, Backing, BackingKind, BackingOptions, HugePageReservation, NumaMode, NumaPolicy,
    SharedMappings,
};
pub use bitmap::SharedLog;
pub use discard::{DiscardOptions, Discarder, RejectReason, Rejected, ReportOutcome};
#[cfg(feature = "vm-memory")]
pub use dma::DmaMemory;
pub use dma::{DmaConfig, DmaCursor, DmaInfo, DmaSpace, Prot};
pub use error::{Error, Result};
pub use pin::{DiscardGate, LockLimit, PinRegistry};
pub use slots::{GpaTranslation, SlotCursor, SlotFlags, SlotId, SlotSpec, SlotTable, Snapshot};

/// The README's library example, compiled and run as a doctest so it cannot go stale.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeExample;

/// The Rust blocks of the pages under docs/, compiled and run the same way. Every page there
/// with a Rust block must be included here: `tests/docs_compiled.rs` checks it.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/api.md")]
struct DocsApi;
