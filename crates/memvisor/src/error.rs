//! Errors: one type for the whole library, each case carrying the values that were wrong.
//!
//! memvisor follows the rules and error codes of Linux's KVM memslot and VFIO type1 interfaces, so
//! code written against those kernels sees the same errno here: [`Error::errno`] gives it. The
//! message names the offending address, size or limit and, where there is one, what to do about
//! it. Nothing in memvisor panics on bad input; every refusal is one of these.

use std::io;

use crate::addr::{Iova, PageSize, Range};

/// What went wrong, with the numbers that were wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A size of zero where a range is needed.
    #[error("{what}: size is 0; a range needs at least one byte")]
    ZeroSize { what: &'static str },

    /// `start + len - 1` does not fit in 64 bits.
    #[error("{what}: range {start:#x} + {len:#x} wraps past the top of the 64-bit address space")]
    RangeWraps {
        what: &'static str,
        start: u64,
        len: u64,
    },

    /// A value that must be a multiple of a page size is not.
    #[error("{what} {value:#x} is not a multiple of {align:#x}")]
    Misaligned {
        what: &'static str,
        value: u64,
        align: u64,
    },

    /// A range that must lie inside something else does not.
    #[error("{what}: {start:#x}+{len:#x} does not fit in {limit:#x} bytes")]
    OutOfBounds {
        what: &'static str,
        start: u64,
        len: u64,
        limit: u64,
    },

    /// A numbered object (slot id, ...) beyond the supported maximum.
    #[error("{what} {value} is out of range: the limit is {limit} (ids 0..{limit})")]
    LimitExceeded {
        what: &'static str,
        value: u64,
        limit: u64,
    },

    /// A range overlaps one that already exists.
    #[error(
        "{what} [{start:#x}, {last:#x}] overlaps existing {existing} [{existing_start:#x}, {existing_last:#x}]"
    )]
    Overlap {
        what: &'static str,
        start: u64,
        last: u64,
        existing: String,
        existing_start: u64,
        existing_last: u64,
    },

    /// An id that is already taken.
    #[error("{what} {id} already exists; remove it first or pick another id")]
    AlreadyExists { what: &'static str, id: u64 },

    /// An id or address that names nothing.
    #[error("{what} {id:#x} does not exist")]
    NotFound { what: &'static str, id: u64 },

    /// Access to an address nothing is mapped at (checked before anything is copied).
    #[error(
        "nothing is mapped at {space} {addr:#x} (accessing {start:#x}+{len:#x}); nothing was copied"
    )]
    Fault {
        space: &'static str,
        addr: u64,
        start: u64,
        len: u64,
    },

    /// A CPU copy (`dma_read` / `dma_write`) over an IOVA nothing is mapped at (type1's
    /// `vfio_dma_rw` says EINVAL, not EFAULT).
    #[error(
        "nothing is mapped at iova {addr:#x} (copying {start:#x}+{len:#x}); nothing was copied; \
         map the range first"
    )]
    NotMapped { addr: u64, start: u64, len: u64 },

    /// An access the mapping's protection does not allow (VFIO: EPERM).
    #[error(
        "{access} access to iova {addr:#x} refused: the mapping [{start:#x}, {last:#x}] allows {allowed}"
    )]
    PermissionDenied {
        access: &'static str,
        addr: u64,
        start: u64,
        last: u64,
        allowed: String,
    },

    /// A count limit would be exceeded (VFIO: ENOSPC for the DMA mapping limit).
    #[error("{what}: {count} would exceed the limit of {limit}; {hint}")]
    NoSpace {
        what: &'static str,
        count: u64,
        limit: u64,
        hint: &'static str,
    },

    /// An access that needs a host address reached a mapping whose memory is a peer's
    /// ([`DmaSpace::map_remote`](crate::DmaSpace::map_remote)); EFAULT, as libvfio-user's
    /// `vfu_sgl_get` answers for regions mapped without a descriptor.
    #[error(
        "iova {addr:#x} is in mapping [{start:#x}, {last:#x}], a peer's memory with no host \
         address here; reach it with dma_read_via / dma_write_via through the peer"
    )]
    Remote { addr: u64, start: u64, last: u64 },

    /// The memory is temporarily unusable, e.g. its host address was invalidated for a live
    /// update and not yet replaced.
    #[error("iova {addr:#x} is busy: {why}")]
    Busy { addr: u64, why: String },

    /// Refused at once because something else in the space is busy (EBUSY), e.g. device access
    /// while any host address is invalidated under [`VaddrRule::Refuse`](crate::dma::VaddrRule).
    #[error("access at iova {addr:#x} refused: {why}")]
    Refused { addr: u64, why: String },

    /// A range that would cut a mapping at either end (EINVAL): type1 v2 unmaps, invalidates
    /// and reads dirty bits of whole mappings only. `[first, last]` is the range asked for,
    /// `[start, end]` the mapping it cuts; widen the range to hold the whole mapping.
    #[error(
        "range [{first:#x}, {last:#x}] would split mapping [{start:#x}, {end:#x}]; type1 v2 unmaps \
         whole mappings only"
    )]
    SplitsMapping {
        first: u64,
        last: u64,
        start: u64,
        end: u64,
    },

    /// A new mapping outside the IOVA ranges the space allows, its aperture minus its reserved
    /// holes (EINVAL, type1's `vfio_iommu_iova_dma_valid`); pick an IOVA inside `allowed`.
    #[error(
        "iova range {range:?} is outside the allowed ranges {allowed:?} (aperture minus reserved)"
    )]
    OutsideAllowed {
        range: Range<Iova>,
        allowed: Vec<(Iova, Iova)>,
    },

    /// A live-update step on a mapping in the wrong state (EINVAL): invalidating a host address
    /// that is already invalidated or a peer's memory, updating one that is not invalidated, or
    /// an update that does not name the whole mapping. `addr` is the mapping's IOVA.
    #[error("{why}")]
    VaddrState { addr: u64, why: String },

    /// A mapping or pin that allows neither READ nor WRITE (EINVAL).
    #[error("{what} needs READ, WRITE or both")]
    NoAccess { what: String },

    /// A dirty-page request while dirty tracking is off (EINVAL); start tracking first.
    #[error("dirty tracking is off; {then}")]
    TrackingOff { then: &'static str },

    /// A release of pins that are not held (EINVAL): an IOVA page `pin_pages` did not pin, or a
    /// whole mapping outside Eager mode.
    #[error("{0}")]
    NotPinned(String),

    /// A configuration no space or device can be built with (EINVAL), said in words.
    #[error("{0}")]
    BadConfig(String),

    /// The other side of a virtio queue broke the protocol, or the queue is unusable (EINVAL);
    /// the message says what, and whether the device must be reset.
    #[error("{0}")]
    Protocol(String),

    /// Any other request that breaks a rule of the interface (EINVAL), said in words.
    #[error("{0}")]
    Invalid(String),

    /// A write to memory that is mapped read-only (KVM refuses with EFAULT too).
    #[error("{addr:#x} is in read-only {what}; the write of {start:#x}+{len:#x} copied nothing")]
    ReadOnly {
        what: String,
        addr: u64,
        start: u64,
        len: u64,
    },

    /// Pinning would lock more memory than the limit allows (VFIO: ENOMEM). Nothing of the call
    /// that failed stays pinned.
    #[error(
        "pinning {asked:#x} more bytes would lock {total:#x} bytes, over the {limit_kind} limit of \
         {limit:#x} ({locked:#x} already locked); unpin or unmap something, raise the limit, or \
         run with CAP_IPC_LOCK"
    )]
    LockLimit {
        asked: u64,
        locked: u64,
        total: u64,
        limit: u64,
        limit_kind: &'static str,
    },

    /// More entries in one call than the interface takes (VFIO: E2BIG).
    #[error("{what}: {count} entries in one call, the most is {limit}; split the call")]
    TooBig {
        what: &'static str,
        count: u64,
        limit: u64,
    },

    /// The process lacks a capability the request needs (EPERM).
    #[error("{what} needs {capability}; run as root or grant it, or don't ask for it")]
    NeedsCapability {
        what: &'static str,
        capability: &'static str,
    },

    /// Memory for memvisor's own bookkeeping could not be had (ENOMEM).
    #[error("{what}: could not allocate {bytes:#x} bytes; track fewer or smaller mappings")]
    OutOfMemory { what: &'static str, bytes: u64 },

    /// Huge pages of the requested size are not available.
    #[error(
        "need {needed} free {page_size} huge pages but only {free} are free; reserve more as root: \
         echo <count> > /sys/kernel/mm/hugepages/hugepages-{kib}kB/nr_hugepages",
        kib = page_size.bytes() / 1024
    )]
    HugePagesUnavailable {
        page_size: PageSize,
        needed: u64,
        free: u64,
    },

    /// A feature this kernel or machine does not have.
    #[error("{what} is not supported here: {why}")]
    Unsupported { what: &'static str, why: String },

    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os {
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// The errno Linux (KVM / VFIO type1) gives for the same condition.
    pub fn errno(&self) -> i32 {
        match self {
            Error::ZeroSize { .. }
            | Error::RangeWraps { .. }
            | Error::Misaligned { .. }
            | Error::OutOfBounds { .. }
            | Error::LimitExceeded { .. }
            | Error::NotMapped { .. }
            | Error::SplitsMapping { .. }
            | Error::OutsideAllowed { .. }
            | Error::VaddrState { .. }
            | Error::NoAccess { .. }
            | Error::TrackingOff { .. }
            | Error::NotPinned(_)
            | Error::BadConfig(_)
            | Error::Protocol(_)
            | Error::Invalid(_) => libc::EINVAL,
            Error::PermissionDenied { .. } | Error::NeedsCapability { .. } => libc::EPERM,
            Error::LockLimit { .. } => libc::ENOMEM,
            Error::TooBig { .. } => libc::E2BIG,
            Error::NoSpace { .. } => libc::ENOSPC,
            Error::Busy { .. } | Error::Refused { .. } => libc::EBUSY,
            Error::Overlap { .. } | Error::AlreadyExists { .. } => libc::EEXIST,
            Error::NotFound { .. } => libc::ENOENT,
            Error::Fault { .. } | Error::ReadOnly { .. } | Error::Remote { .. } => libc::EFAULT,
            Error::HugePagesUnavailable { .. } | Error::OutOfMemory { .. } => libc::ENOMEM,
            Error::Unsupported { .. } => libc::EOPNOTSUPP,
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// The last OS error, tagged with the call that failed.
    pub(crate) fn last_os(op: &'static str) -> Self {
        Error::Os {
            op,
            source: io::Error::last_os_error(),
        }
    }
}

/// memvisor's result type.
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn os_error_keeps_its_errno() {
        let e = Error::Os {
            op: "mmap",
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        assert_eq!(e.errno(), libc::ENOMEM);
        assert!(e.to_string().starts_with("mmap failed"));
    }

    #[test]
    fn huge_page_message_says_how_to_reserve() {
        let e = Error::HugePagesUnavailable {
            page_size: PageSize::Size2M,
            needed: 4,
            free: 1,
        };
        assert_eq!(e.errno(), libc::ENOMEM);
        let msg = e.to_string();
        assert!(msg.contains("hugepages-2048kB/nr_hugepages"), "{msg}");
        assert!(msg.contains("need 4"), "{msg}");
    }
}
