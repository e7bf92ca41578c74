//! Errors of the vfio-user server: what a client sent wrong, or what memvisor refused.
//!
//! Each has the errno a VFIO kernel driver would give for the same request, which is what the
//! error reply carries, and a message naming the bad value. A refusal says what kind of thing
//! was wrong (a DMA request, a region access, an interrupt setting, a device descriptor), so a
//! caller can match on it. A refused request leaves the server
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
#[non_exhaustive]
pub enum Error {
    /// A `DMA_MAP` / `DMA_UNMAP` with flags, descriptors or a dirty bitmap type1 would refuse,
    /// or a `DMA_READ` reply that answers another range (EINVAL). Refusals of the DMA table
    /// itself are [`Error::Memory`], with type1's errno.
    #[error("{0}")]
    BadDma(String),
    /// An access to a device region (or a register in it) that does not exist, is outside the
    /// region, is not allowed by its flags, or is too large (EINVAL).
    #[error("{0}")]
    BadRegion(String),
    /// An interrupt index, vector range, flag set or descriptor count the device refuses
    /// (EINVAL).
    #[error("{0}")]
    BadIrq(String),
    /// A DMA descriptor of the reference device the engine refuses (EINVAL); the run stops
    /// there.
    #[error("{0}")]
    BadDescriptor(String),
    /// Any other request that breaks a rule of the protocol or of the device (EINVAL), in
    /// words.
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
    /// What the wire layer reports: the client left, a stream out of step, a body of the wrong
    /// size, a socket error.
    #[error(transparent)]
    Wire(#[from] WireError),
}

impl Error {
    /// The errno a VFIO driver would return.
    pub fn errno(&self) -> i32 {
        match self {
            Error::BadDma(_)
            | Error::BadRegion(_)
            | Error::BadIrq(_)
            | Error::BadDescriptor(_)
            | Error::Invalid(_) => libc::EINVAL,
            Error::Refused { errno, .. } => *errno,
            Error::Memory(e) => e.errno(),
            Error::Wire(e) => e.errno(),
        }
    }
}
