//! memvisor-kvm: a memvisor [`SlotTable`](memvisor::SlotTable) as the memory of a KVM VM.
//!
//! The vCPU side of a VMM, on the same slot table the device side already uses:
//!
//! ```text
//! memslots  KvmSlots: the table mirrored into KVM's memslots (sync on call, KVM's rules and
//!           errors, KVM slot numbers within KVM_CAP_NR_MEMSLOTS), and one dirty log per slot:
//!           KVM's bitmap (manual protect, cleared in chunks) merged with memvisor's own and
//!           with device spaces' (DmaSpace dirty tracking)
//! ring      per-vCPU dirty rings (KVM_CAP_DIRTY_LOG_RING_ACQ_REL): the vCPUs' pages from
//!           rings instead of the bitmap, behind the same dirty-log call; refused on PVM
//!           (it overruns them); elsewhere a ring KVM overran is reported, not waited on
//! vcpu      Vcpu: a vCPU with its thread's SlotCursor, handed to the MMIO / port I/O handler
//! error     KVM's refusals with errno and the refused values; memvisor's errors passed on
//! ```
//!
//! Data flows one way: this crate reads the table's snapshots and drives KVM; the core crate
//! knows nothing of KVM. See `docs/kvm.md` for a walk-through and `examples/kvm_vmm.rs` for a
//! VMM in a few dozen lines.
#![cfg(target_os = "linux")]
// docs.rs (`--cfg docsrs`): each feature-gated item is labelled with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
pub mod memslots;
pub mod ring;
pub mod vcpu;

pub use error::{Error, Result};
pub use memslots::{DirtyLogs, KvmCaps, KvmSlots, Options, SlotLog, SyncReport};
pub use ring::Rings;
pub use vcpu::{Control, ExitHandler, Stop, Vcpu};

/// docs/kvm.md's Rust blocks, compiled as doctests so they cannot go stale (the core crate's
/// `tests/docs_compiled.rs` checks every page with a compiled block is included somewhere).
#[cfg(doctest)]
#[doc = include_str!("../../../docs/kvm.md")]
struct DocsKvm;
