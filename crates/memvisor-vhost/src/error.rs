//! Errors of the vhost-user layer: what a frontend did wrong, or what memvisor refused.
//!
//! Each carries an errno (for logs and `REPLY_ACK`) and names the bad value. A refusal says
//! what kind of thing was wrong, so a caller can match on it, and its errno is the one the
//! kernel's vhost or VFIO gives for the same mistake: `EOPNOTSUPP` for a request or feature
//! this back end does not implement or offer, `EBUSY` for a change to a ring while it runs,
//! `EFAULT` for an address in no memory, `EINVAL` for a value out of range. An OS error keeps
//! its [`std::io::Error`] (and so its errno) as the source. A message the back end refuses
//! leaves its state as it was; only a broken stream ends the connection: the frontend left or
//! the stream is out of step ([`WireError::ends_connection`]), or a socket error.
//!
//! A request behind a vIOMMU that needs a translation the IOTLB does not hold yet is not an
//! error: it is an outcome of processing a queue ([`crate::device::Processed::Missed`]).
//!
//! What the wire itself reports is [`WireError`], shared with vfio-user, wrapped as
//! [`Error::Wire`].

use memvisor_wire::WireError;

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// What the wire layer reports: the frontend left, a stream out of step, a payload of the
    /// wrong size, a socket error.
    #[error(transparent)]
    Wire(#[from] WireError),
    /// A request this back end does not implement (an unknown request, rings without a kick
    /// descriptor, a write to a read-only config space); the frontend can go on without it
    /// (EOPNOTSUPP).
    #[error("{request}: {why}")]
    Unsupported {
        /// The request, or what was asked (`request 99`, `config write`).
        request: String,
        /// What is not implemented.
        why: String,
    },
    /// Feature bits the back end did not offer (EOPNOTSUPP, as the kernel's vhost answers
    /// `SET_FEATURES`).
    #[error("{request} {asked:#x}: bits {unknown:#x} were not offered")]
    NotOffered {
        /// `SET_FEATURES` or `SET_PROTOCOL_FEATURES`.
        request: &'static str,
        /// The bits asked for.
        asked: u64,
        /// Those of them not offered.
        unknown: u64,
    },
    /// A request that needs a feature the frontend did not negotiate (EINVAL).
    #[error("{request} without {feature} negotiated")]
    NotNegotiated {
        /// The request.
        request: &'static str,
        /// The feature it needs.
        feature: &'static str,
    },
    /// A ring index past the device's queues (EINVAL).
    #[error("{request}: ring {index} does not exist (the device has {rings})")]
    NoSuchRing {
        /// The request naming it.
        request: &'static str,
        /// The index asked for.
        index: u32,
        /// How many rings the device has.
        rings: usize,
    },
    /// A change to a ring while it runs (EBUSY, as the kernel's vhost answers).
    #[error("{request} changes ring {index} while it runs")]
    RingRunning {
        /// The request.
        request: &'static str,
        /// The ring.
        index: u32,
    },
    /// A ring request that does not fit the ring's size, state or addresses (EINVAL).
    #[error("{0}")]
    BadRing(String),
    /// A memory table, memory region or dirty log the back end cannot take: too many, not
    /// whole pages, overlapping, unmappable (EINVAL).
    #[error("{0}")]
    BadRegion(String),
    /// A frontend's user address in none of its memory regions (EFAULT).
    #[error("{what} at user address {addr:#x} (+{len:#x}) is in no memory region")]
    Unmapped {
        /// What was to be there (a ring's part, a log, an IOTLB entry).
        what: String,
        /// The address.
        addr: u64,
        /// How many bytes from it.
        len: u64,
    },
    /// An IOTLB message of an unknown type or permission, or not in whole pages (EINVAL).
    #[error("{0}")]
    BadIotlb(String),
    /// A descriptor chain the device refuses: one it cannot walk (a loop, a `next` past its
    /// table, an indirect table inside another), which goes back with nothing written and no
    /// status, or one whose request it refuses (no readable header, a buffer in the wrong
    /// direction, sectors past the disk's end), which fails with an error status. Either way
    /// only that request fails and the ring goes on (EINVAL).
    #[error("{0}")]
    BadChain(String),
    /// A descriptor whose table entry is in no guest memory the device can read (EFAULT).
    #[error("descriptor {index} at {addr:#x} unreadable: {why}")]
    DescriptorUnreadable {
        /// Its index in its table.
        index: u16,
        /// Where its entry would be.
        addr: u64,
        /// What the memory said.
        why: String,
    },
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
    /// A guest's read or write of the disk failed: which one, and the error underneath (its
    /// errno stands).
    #[error("{} of {bytes} bytes at sector {sector}: {source}", if *.to_guest { "read" } else { "write" })]
    Transfer {
        /// A read (into the guest) or a write.
        to_guest: bool,
        /// Bytes asked for.
        bytes: u64,
        /// The first sector.
        sector: u64,
        /// What failed.
        source: Box<Error>,
    },
}

impl Error {
    /// The errno a C back end (or VFIO) would report.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Wire(e) => e.errno(),
            Error::Unsupported { .. } | Error::NotOffered { .. } => libc::EOPNOTSUPP,
            Error::RingRunning { .. } => libc::EBUSY,
            Error::Unmapped { .. } | Error::DescriptorUnreadable { .. } => libc::EFAULT,
            Error::NotNegotiated { .. }
            | Error::NoSuchRing { .. }
            | Error::BadRing(_)
            | Error::BadRegion(_)
            | Error::BadIotlb(_)
            | Error::BadChain(_)
            | Error::Invalid(_) => libc::EINVAL,
            Error::Memory(e) => e.errno(),
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Transfer { source, .. } => source.errno(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_its_value_and_gives_the_kernels_errno() {
        let e = Error::NotOffered {
            request: "SET_FEATURES",
            asked: 0x1_0000_0001,
            unknown: 0x1,
        };
        assert_eq!(e.errno(), libc::EOPNOTSUPP);
        assert!(e.to_string().contains("0x1"), "{e}");
        let e = Error::RingRunning {
            request: "SET_VRING_ADDR",
            index: 3,
        };
        assert_eq!(e.errno(), libc::EBUSY);
        assert!(e.to_string().contains("ring 3"), "{e}");
        let e = Error::Unmapped {
            what: "used ring".into(),
            addr: 0xdead_0000,
            len: 0x1000,
        };
        assert_eq!(e.errno(), libc::EFAULT);
        assert!(e.to_string().contains("0xdead0000"), "{e}");
        let e = Error::NoSuchRing {
            request: "SET_VRING_NUM",
            index: 9,
            rings: 2,
        };
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains("ring 9"), "{e}");
    }

    #[test]
    fn a_failed_transfer_keeps_the_os_error_and_its_errno() {
        let os = Error::Os {
            op: "preadv",
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        };
        let e = Error::Transfer {
            to_guest: false,
            bytes: 4096,
            sector: 8,
            source: Box::new(os),
        };
        assert_eq!(e.errno(), libc::ENOSPC);
        assert!(
            e.to_string().starts_with("write of 4096 bytes at sector 8"),
            "{e}"
        );
        // The chain of sources reaches the OS error itself.
        let mut s: &dyn std::error::Error = &e;
        while let Some(next) = s.source() {
            s = next;
        }
        let io = s
            .downcast_ref::<std::io::Error>()
            .expect("an io::Error at the end");
        assert_eq!(io.raw_os_error(), Some(libc::ENOSPC));
    }
}
