//! What can go wrong on the wire, for both front ends.
//!
//! A front end's own error type wraps [`WireError`] (`#[error(transparent)] Wire(#[from]
//! WireError)`), so everything the wire layer reports reads and matches the same in vhost-user
//! and vfio-user. Two failures always end a connection ([`WireError::ends_connection`]): the
//! peer left ([`WireError::Disconnected`], which is also what end-of-file and a reset in the
//! middle of a message become: the peer is gone either way), and a stream that can no longer
//! be framed ([`WireError::Protocol`]: the next byte cannot be trusted to start a message). A
//! payload of the wrong size for its layout ([`WireError::BadSize`]) is refused and the stream
//! stays in step. A socket error ([`WireError::Io`]) is reported as it came; what to do about
//! it is the caller's to decide.
//!
//! Each carries the errno a C implementation would give, through [`WireError::errno`].

use std::fmt;
use std::io;

/// How many bytes a payload's layout needs; the `want` of [`WireError::BadSize`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Size {
    /// Exactly this many.
    Exactly(usize),
    /// This many or more (a fixed part, then a variable one).
    AtLeast(usize),
    /// From the first to the second, both included.
    Between(usize, usize),
}

impl Size {
    /// Whether `got` bytes fit.
    pub fn fits(self, got: usize) -> bool {
        match self {
            Size::Exactly(n) => got == n,
            Size::AtLeast(n) => got >= n,
            Size::Between(lo, hi) => (lo..=hi).contains(&got),
        }
    }

    /// Checks that the `got` bytes of message `what` fit: [`WireError::BadSize`] if not.
    pub fn check(self, what: &'static str, got: usize) -> Result<(), WireError> {
        if self.fits(got) {
            return Ok(());
        }
        Err(WireError::BadSize {
            what,
            got,
            want: self,
        })
    }
}

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Size::Exactly(n) => write!(f, "{n}"),
            Size::AtLeast(n) => write!(f, "at least {n}"),
            Size::Between(lo, hi) => write!(f, "{lo} to {hi}"),
        }
    }
}

/// What went wrong on the wire.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The peer closed the connection, or reset it (ECONNRESET).
    #[error("the peer closed the connection")]
    Disconnected,
    /// A payload of the wrong size for its message's layout (EINVAL). The message is refused;
    /// the stream is still in step.
    #[error("{what}: payload of {got} bytes, expected {want}")]
    BadSize {
        /// The message (request or command name).
        what: &'static str,
        /// Bytes received.
        got: usize,
        /// Bytes the layout needs.
        want: Size,
    },
    /// A message that cannot be framed (a header the protocol does not know, an oversized
    /// message, descriptors lost, a reply to nothing): the stream is out of step and the
    /// connection ends (EPROTO).
    #[error("{protocol} protocol: {why}")]
    Protocol {
        /// "vhost-user" or "vfio-user".
        protocol: &'static str,
        /// What was wrong, naming the bad value.
        why: String,
    },
    /// A socket operation failed.
    #[error("{op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

impl WireError {
    /// The errno a C implementation would report.
    pub fn errno(&self) -> i32 {
        match self {
            WireError::Disconnected => libc::ECONNRESET,
            WireError::BadSize { .. } => libc::EINVAL,
            WireError::Protocol { .. } => libc::EPROTO,
            WireError::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }

    /// A socket error while doing `op`: end-of-file in the middle of a message and a reset
    /// connection are [`WireError::Disconnected`] (the peer is gone), anything else is
    /// [`WireError::Io`].
    pub fn io(op: &'static str, source: io::Error) -> WireError {
        match source.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                WireError::Disconnected
            }
            _ => WireError::Io { op, source },
        }
    }

    /// Whether the connection must end: the peer left, or the stream is out of step.
    pub fn ends_connection(&self) -> bool {
        matches!(self, WireError::Disconnected | WireError::Protocol { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_of_file_and_reset_are_a_disconnect() {
        for kind in [io::ErrorKind::UnexpectedEof, io::ErrorKind::ConnectionReset] {
            let e = WireError::io("read", io::Error::from(kind));
            assert!(matches!(e, WireError::Disconnected), "{kind:?}: {e:?}");
            assert_eq!(e.errno(), libc::ECONNRESET);
        }
        let e = WireError::io("sendmsg", io::Error::from_raw_os_error(libc::EPIPE));
        assert!(matches!(e, WireError::Io { op: "sendmsg", .. }), "{e:?}");
        assert_eq!(e.errno(), libc::EPIPE);
    }

    #[test]
    fn a_bad_size_names_what_was_wanted() {
        let e = WireError::BadSize {
            what: "IOTLB_MSG",
            got: 3,
            want: Size::Between(26, 64),
        };
        assert_eq!(
            e.to_string(),
            "IOTLB_MSG: payload of 3 bytes, expected 26 to 64"
        );
        assert_eq!(e.errno(), libc::EINVAL);
    }

    #[test]
    fn sizes_fit_as_they_read() {
        assert!(Size::Exactly(8).check("x", 8).is_ok());
        assert!(Size::Exactly(8).check("x", 9).is_err());
        assert!(Size::AtLeast(8).check("x", 9).is_ok());
        assert!(Size::AtLeast(8).check("x", 7).is_err());
        assert!(Size::Between(26, 64).check("x", 64).is_ok());
        assert!(Size::Between(26, 64).check("x", 25).is_err());
        assert!(Size::Between(26, 64).check("x", 65).is_err());
    }
}
