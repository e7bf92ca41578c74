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
    ZeroSize {
        /// What the empty range was for ("slot", "mapping", ...).
        what: &'static str,
    },

    /// `start + len - 1` does not fit in 64 bits.
    #[error("{what}: range {start:#x} + {len:#x} wraps past the top of the 64-bit address space")]
    RangeWraps {
        /// What the value belongs to ("slot", "mapping", ...), for the message.
        what: &'static str,
        /// The range's first byte.
        start: u64,
        /// Its length in bytes.
        len: u64,
    },

    /// A value that must be a multiple of a page size is not.
    #[error("{what} {value:#x} is not a multiple of {align:#x}")]
    Misaligned {
        /// What the value is ("slot size", "iova", ...).
        what: &'static str,
        /// The value given.
        value: u64,
        /// The alignment it must be a multiple of.
        align: u64,
    },

    /// A range that must lie inside something else does not.
    #[error("{what}: {start:#x}+{len:#x} does not fit in {limit:#x} bytes")]
    OutOfBounds {
        /// What the value belongs to ("slot", "mapping", ...), for the message.
        what: &'static str,
        /// The range's start, relative to what it must fit in.
        start: u64,
        /// Its length in bytes.
        len: u64,
        /// The size it must fit in.
        limit: u64,
    },

    /// A numbered object (slot id, ...) beyond the supported maximum.
    #[error("{what} {value} is out of range: the limit is {limit} (ids 0..{limit})")]
    LimitExceeded {
        /// What is numbered ("slot id", ...).
        what: &'static str,
        /// The number given.
        value: u64,
        /// One past the largest number allowed.
        limit: u64,
    },

    /// A range overlaps one that already exists.
    #[error(
        "{what} [{start:#x}, {last:#x}] overlaps existing {existing} [{existing_start:#x}, {existing_last:#x}]"
    )]
    Overlap {
        /// What was being added ("slot", "mapping").
        what: &'static str,
        /// Its first address.
        start: u64,
        /// Its last address (inclusive).
        last: u64,
        /// The one it overlaps, named ("slot 3").
        existing: String,
        /// That one's first address.
        existing_start: u64,
        /// That one's last address (inclusive).
        existing_last: u64,
    },

    /// An id that is already taken.
    #[error("{what} {id} already exists; remove it first or pick another id")]
    AlreadyExists {
        /// What kind of object ("slot", ...).
        what: &'static str,
        /// The id that is taken.
        id: u64,
    },

    /// An id or address that names nothing.
    #[error("{what} {id:#x} does not exist")]
    NotFound {
        /// What kind of object was looked for ("slot", "dirty log of slot", ...).
        what: &'static str,
        /// The id or address asked for.
        id: u64,
    },

    /// Access to an address nothing is mapped at (checked before anything is copied).
    #[error(
        "nothing is mapped at {space} {addr:#x} (accessing {start:#x}+{len:#x}); nothing was copied"
    )]
    Fault {
        /// The address space ("gpa", "iova").
        space: &'static str,
        /// The first address nothing is mapped at.
        addr: u64,
        /// Start of the access asked for.
        start: u64,
        /// Length of the access in bytes.
        len: u64,
    },

    /// A CPU copy (`dma_read` / `dma_write`) over an IOVA nothing is mapped at (type1's
    /// `vfio_dma_rw` says EINVAL, not EFAULT).
    #[error(
        "nothing is mapped at iova {addr:#x} (copying {start:#x}+{len:#x}); nothing was copied; \
         map the range first"
    )]
    NotMapped {
        /// The first IOVA nothing is mapped at.
        addr: u64,
        /// Start of the copy asked for.
        start: u64,
        /// Length of the copy in bytes.
        len: u64,
    },

    /// An access the mapping's protection does not allow (VFIO: EPERM).
    #[error(
        "{access} access to iova {addr:#x} refused: the mapping [{start:#x}, {last:#x}] allows {allowed}"
    )]
    PermissionDenied {
        /// The access refused ("read", "write").
        access: &'static str,
        /// The IOVA accessed.
        addr: u64,
        /// First IOVA of the mapping that holds it.
        start: u64,
        /// Last IOVA of that mapping (inclusive).
        last: u64,
        /// What the mapping allows, in words.
        allowed: String,
    },

    /// A count limit would be exceeded (VFIO: ENOSPC for the DMA mapping limit).
    #[error("{what}: {count} would exceed the limit of {limit}; {hint}")]
    NoSpace {
        /// What is counted ("DMA mappings", ...).
        what: &'static str,
        /// The count the request would reach.
        count: u64,
        /// The most allowed.
        limit: u64,
        /// What to do about it.
        hint: &'static str,
    },

    /// An access that needs a host address reached a mapping whose memory is a peer's
    /// ([`DmaSpace::map_remote`](crate::DmaSpace::map_remote)); EFAULT, as libvfio-user's
    /// `vfu_sgl_get` answers for regions mapped without a descriptor.
    #[error(
        "iova {addr:#x} is in mapping [{start:#x}, {last:#x}], a peer's memory with no host \
         address here; reach it with dma_read_via / dma_write_via through the peer"
    )]
    Remote {
        /// The IOVA accessed.
        addr: u64,
        /// First IOVA of the peer's mapping.
        start: u64,
        /// Last IOVA of the peer's mapping (inclusive).
        last: u64,
    },

    /// The memory is temporarily unusable, e.g. its host address was invalidated for a live
    /// update and not yet replaced.
    #[error("iova {addr:#x} is busy: {why}")]
    Busy {
        /// The IOVA whose memory is busy.
        addr: u64,
        /// Why, and for how long it was waited for.
        why: String,
    },

    /// Refused at once because something else in the space is busy (EBUSY), e.g. device access
    /// while any host address is invalidated under [`VaddrRule::Refuse`](crate::dma::VaddrRule).
    #[error("access at iova {addr:#x} refused: {why}")]
    Refused {
        /// The IOVA of the refused access.
        addr: u64,
        /// What else is busy.
        why: String,
    },

    /// A range that would cut a mapping at either end (EINVAL): type1 v2 unmaps, invalidates
    /// and reads dirty bits of whole mappings only. `[first, last]` is the range asked for,
    /// `[start, end]` the mapping it cuts; widen the range to hold the whole mapping.
    #[error(
        "range [{first:#x}, {last:#x}] would split mapping [{start:#x}, {end:#x}]; type1 v2 unmaps \
         whole mappings only"
    )]
    SplitsMapping {
        /// First IOVA of the range asked for.
        first: u64,
        /// Last IOVA of the range asked for (inclusive).
        last: u64,
        /// First IOVA of the mapping it would cut.
        start: u64,
        /// Last IOVA of the mapping it would cut (inclusive).
        end: u64,
    },

    /// A new mapping outside the IOVA ranges the space allows, its aperture minus its reserved
    /// holes (EINVAL, type1's `vfio_iommu_iova_dma_valid`); pick an IOVA inside `allowed`.
    #[error(
        "iova range {range:?} is outside the allowed ranges {allowed:?} (aperture minus reserved)"
    )]
    OutsideAllowed {
        /// The IOVA range of the new mapping.
        range: Range<Iova>,
        /// The ranges the space allows, as inclusive `(first, last)` pairs.
        allowed: Vec<(Iova, Iova)>,
    },

    /// A live-update step on a mapping in the wrong state (EINVAL): invalidating a host address
    /// that is already invalidated or a peer's memory, updating one that is not invalidated, or
    /// an update that does not name the whole mapping. `addr` is the mapping's IOVA.
    #[error("{why}")]
    VaddrState {
        /// The mapping's IOVA.
        addr: u64,
        /// Which step, and the state the mapping is in.
        why: String,
    },

    /// A mapping or pin that allows neither READ nor WRITE (EINVAL).
    #[error("{what} needs READ, WRITE or both")]
    NoAccess {
        /// What was asked for without access ("map", "pin", ...).
        what: String,
    },

    /// A dirty-page request while dirty tracking is off (EINVAL); start tracking first.
    #[error("dirty tracking is off; {then}")]
    TrackingOff {
        /// What to do first.
        then: &'static str,
    },

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
        /// What is read-only ("slot 3", a mapping).
        what: String,
        /// The first read-only address written.
        addr: u64,
        /// Start of the write asked for.
        start: u64,
        /// Length of the write in bytes.
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
        /// Bytes the pin would lock.
        asked: u64,
        /// Bytes already locked.
        locked: u64,
        /// Bytes locked if the pin went ahead.
        total: u64,
        /// The limit in bytes.
        limit: u64,
        /// Which limit (`RLIMIT_MEMLOCK`, or one the registry was given).
        limit_kind: &'static str,
    },

    /// More entries in one call than the interface takes (VFIO: E2BIG).
    #[error("{what}: {count} entries in one call, the most is {limit}; split the call")]
    TooBig {
        /// What the call carries ("pages", "entries").
        what: &'static str,
        /// Entries given.
        count: u64,
        /// The most one call takes.
        limit: u64,
    },

    /// The process lacks a capability the request needs (EPERM).
    #[error("{what} needs {capability}; run as root or grant it, or don't ask for it")]
    NeedsCapability {
        /// What asked for it.
        what: &'static str,
        /// The capability missing (`CAP_IPC_LOCK`, ...).
        capability: &'static str,
    },

    /// Memory for memvisor's own bookkeeping could not be had (ENOMEM).
    #[error("{what}: could not allocate {bytes:#x} bytes; track fewer or smaller mappings")]
    OutOfMemory {
        /// What could not be allocated ("dirty bitmap", ...).
        what: &'static str,
        /// Its size in bytes.
        bytes: u64,
    },

    /// Huge pages of the requested size are not available.
    #[error(
        "need {needed} free {page_size} huge pages but only {free} are free; reserve more as root: \
         echo <count> > /sys/kernel/mm/hugepages/hugepages-{kib}kB/nr_hugepages",
        kib = page_size.bytes() / 1024
    )]
    HugePagesUnavailable {
        /// The huge page size asked for.
        page_size: PageSize,
        /// Pages of that size needed.
        needed: u64,
        /// Pages of that size free.
        free: u64,
    },

    /// A NUMA node that is not online on this machine (EINVAL, as `mbind(2)` answers).
    #[error("NUMA node {node} is not online here (online nodes: {online}); pick one of those")]
    NoSuchNode {
        /// The node asked for.
        node: u32,
        /// The nodes that are online, as the kernel lists them (`0-1,3`).
        online: String,
    },

    /// A backing option given for a kind of memory where it means nothing, or does harm
    /// (EINVAL).
    #[error("{option} has no meaning for {kind} memory: {why}")]
    BadOption {
        /// The option ("noreserve", "mergeable", "numa").
        option: &'static str,
        /// The backing kind's name.
        kind: &'static str,
        /// Why, and what to do instead.
        why: &'static str,
    },

    /// A feature this kernel or machine does not have.
    #[error("{what} is not supported here: {why}")]
    Unsupported {
        /// The feature.
        what: &'static str,
        /// Why it is missing here, and what to use instead.
        why: String,
    },

    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os {
        /// The system call or operation that failed ("mmap", ...).
        op: &'static str,
        /// The OS error, with its errno.
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
            | Error::Invalid(_)
            | Error::NoSuchNode { .. }
            | Error::BadOption { .. } => libc::EINVAL,
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
