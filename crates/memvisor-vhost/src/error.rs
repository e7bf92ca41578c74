//! Errors of the vhost-user layer: what a frontend did wrong, or what memvisor refused.
//!
//! Each carries an errno (for logs and replies) and names the bad value. A message the back end
//! refuses leaves its state as it was; only a broken stream ([`Error::Protocol`], an I/O error)
//! ends the connection.

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A payload of the wrong size for its request (EINVAL).
    #[error("{request}: payload of {got} bytes, expected {want}")]
    BadSize {
        /// The request.
        request: &'static str,
        /// Bytes received.
        got: usize,
        /// Bytes the layout needs.
        want: String,
    },
    /// A request that breaks a rule of the protocol or of this device (EINVAL), in words.
    #[error("{0}")]
    Invalid(String),
    /// A message that cannot be framed (bad version, oversized, descriptors lost): the stream is
    /// out of step and the connection ends (EPROTO).
    #[error("vhost-user protocol: {0}")]
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
    /// A device address the IOTLB has no translation for yet: the back end sends a MISS and
    /// retries when the frontend's update arrives (EFAULT if it never does).
    #[error("IOTLB miss at iova {iova:#x} ({})", if *write { "write" } else { "read" })]
    IotlbMiss {
        /// The address.
        iova: u64,
        /// Whether the device writes it.
        write: bool,
    },
    /// The frontend closed the connection.
    #[error("frontend disconnected")]
    Disconnected,
}

impl Error {
    /// The errno a C back end would report.
    pub fn errno(&self) -> i32 {
        match self {
            Error::BadSize { .. } | Error::Invalid(_) => libc::EINVAL,
            Error::Protocol(_) => libc::EPROTO,
            Error::Memory(e) => e.errno(),
            Error::Os { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Error::Disconnected => libc::ECONNRESET,
            Error::IotlbMiss { .. } => libc::EFAULT,
        }
    }

    pub(crate) fn last_os(op: &'static str) -> Error {
        Error::Os {
            op,
            source: std::io::Error::last_os_error(),
        }
    }
}
