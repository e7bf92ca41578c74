//! Errors of the vfio-user server: what a client sent wrong, or what memvisor refused.
//!
//! Each has the errno a VFIO kernel driver would give for the same request, which is what the
//! error reply carries, and a message naming the bad value. A refused request leaves the server
//! as it was; only a client that left or a stream that is out of step
//! ([`WireError::ends_connection`]) ends the connection.
//!
//! What the wire itself reports is [`WireError`], shared with vhost-user, wrapped as
//! [`Error::Wire`].

use memvisor_wire::WireError;

/// Result of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// What went wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// What the wire layer reports: the client left, a stream out of step, a body of the wrong
    /// size, a socket error.
    #[error(transparent)]
    Wire(#[from] WireError),
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
    /// memvisor refused a memory operation; its errno stands.
    #[error(transparent)]
    Memory(#[from] memvisor::Error),
}

impl Error {
    /// The errno a VFIO driver would return.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Wire(e) => e.errno(),
            Error::Invalid(_) => libc::EINVAL,
            Error::Refused { errno, .. } => *errno,
            Error::Memory(e) => e.errno(),
        }
    }
}
