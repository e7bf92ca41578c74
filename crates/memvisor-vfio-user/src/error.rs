//! Errors of the vfio-user server: what a client sent wrong, or what memvisor refused.
//!
//! Each has the errno a VFIO kernel driver would give for the same request, which is what the
//! error reply carries, and a message naming the bad value. A refused request leaves the server
//! as it was; only a stream that is out of step ([`Error::Protocol`]) or broken ends the
//! connection.

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A body shorter than its command's layout (EINVAL).
    #[error("{command}: body of {got} bytes, the layout needs {want}")]
    BadSize {
        /// The command.
        command: &'static str,
        /// Bytes received.
        got: usize,
        /// Bytes the fixed layout needs.
        want: usize,
    },
    /// A request that breaks a rule of the protocol or of the device (EINVAL), in words.
    #[error("{0}")]
    Invalid(String),
    /// A request with an errno of its own (ENOSYS, ENOTTY, ENOSPC ...), in words.
    #[error("{why}")]
    Refused {
        /// The errno.
        errno: i32,
        /// What was refused and why.
        why: String,
    },
    /// The stream cannot be framed any more (oversized message, lost descriptors, a reply to
    /// nothing): the connection ends (EPROTO).
    #[error("vfio-user protocol: {0}")]
    Protocol(String),
    /// memvisor refused a memory operation; its errno stands.
    #[error(transparent)]
    Memory(#[from] memvisor::Error),
    /// A system call failed.
    #[error("{op}: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        source: std::io::Error,
    },
    /// The client closed the connection.
    #[error("client disconnected")]
    Disconnected,
}

impl Error {
    /// The errno a VFIO driver would return.
    pub fn errno(&self) -> i32 {
        match self {
            Error::BadSize { .. } | Error::Invalid(_) => libc::EINVAL,
            Error::Refused { errno, .. } => *errno,
            Error::Protocol(_) => libc::EPROTO,
            Error::Memory(e) => e.errno(),
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Disconnected => libc::ECONNRESET,
        }
    }

    pub(crate) fn os(op: &'static str, source: std::io::Error) -> Error {
        if source.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::Disconnected
        } else {
            Error::Os { op, source }
        }
    }
}
