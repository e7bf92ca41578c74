//! Errors of the vhost-user layer: what a frontend did wrong, or what memvisor refused.
//!
//! Each carries an errno (for logs and replies) and names the bad value. A refusal says what
//! kind of thing was wrong (a ring, a region, an IOTLB message, a descriptor chain, a feature
//! not negotiated, a request not implemented), so a caller can match on it; all of these are
//! EINVAL, as they are in C back ends. A message the back end
//! refuses leaves its state as it was; only a broken stream ends the connection: the frontend
//! left or the stream is out of step ([`WireError::ends_connection`]), or a socket error.
//!
//! What the wire itself reports is [`WireError`], shared with vfio-user, wrapped as
//! [`Error::Wire`].

use memvisor_wire::WireError;

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// What the wire layer reports: the frontend left, a stream out of step, a payload of the
    /// wrong size, a socket error.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A request this back end does not implement (an unknown request, rings without a kick
    /// descriptor, a write to a read-only config space); the frontend can go on without it
    /// (EINVAL).
    #[error("{0}")]
    Unsupported(String),
    /// Feature bits that were not offered, or a request that needs a feature the frontend did
    /// not negotiate (EINVAL).
    #[error("{0}")]
    NotNegotiated(String),
    /// A ring that does not exist, or a ring request that does not fit the ring's size, state
    /// or addresses (EINVAL).
    #[error("{0}")]
    BadRing(String),
    /// A memory table, memory region or dirty log the back end cannot take: too many, not
    /// whole pages, overlapping, unmappable, or an address in none (EINVAL).
    #[error("{0}")]
    BadRegion(String),
    /// An IOTLB message of an unknown type or permission, or not in whole pages (EINVAL).
    #[error("{0}")]
    BadIotlb(String),
    /// A descriptor chain the device refuses (no readable header, a buffer in the wrong
    /// direction, sectors past the disk's end): that request fails with an error status on its
    /// ring, the ring goes on (EINVAL).
    #[error("{0}")]
    BadChain(String),
    /// Any other request that breaks a rule of the protocol or of this device (EINVAL), in
    /// words.
    #[error("{0}")]
    Invalid(String),
    /// memvisor refused a memory operation; its errno stands.
    #[error(transparent)]
    Memory(#[from] memvisor::Error),
    /// A system call off the wire failed: the disk image, `poll`, `accept`, a memfd.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// Device addresses the IOTLB has no translation for yet, one per unmapped page a request
    /// needs ([`crate::miss`]): the back end sends a MISS for each it has not asked for already
    /// and retries when the frontend's updates have covered them (EFAULT if they never do).
    #[error("IOTLB miss at {}", describe_misses(misses))]
    IotlbMiss {
        /// The first unmapped address of each page, in the order the request needs them
        /// (never empty).
        misses: Vec<memvisor::dma::Miss>,
    },
}

impl Error {
    /// The errno a C back end would report.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Wire(e) => e.errno(),
            Error::Unsupported(_)
            | Error::NotNegotiated(_)
            | Error::BadRing(_)
            | Error::BadRegion(_)
            | Error::BadIotlb(_)
            | Error::BadChain(_)
            | Error::Invalid(_) => libc::EINVAL,
            Error::Memory(e) => e.errno(),
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::IotlbMiss { .. } => libc::EFAULT,
        }
    }

    /// One miss as an error.
    pub(crate) fn miss(m: memvisor::dma::Miss) -> Error {
        Error::IotlbMiss { misses: vec![m] }
    }

    pub(crate) fn last_os(op: &'static str) -> Error {
        Error::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }
}

fn describe_misses(misses: &[memvisor::dma::Miss]) -> String {
    let Some(m) = misses.first() else {
        return "no page".into();
    };
    let access = if m.access.contains(memvisor::Prot::WRITE) {
        "write"
    } else {
        "read"
    };
    match misses.len() {
        1 => format!("iova {:#x} ({access})", m.iova.0),
        n => format!("iova {:#x} ({access}) and {} more pages", m.iova.0, n - 1),
    }
}
