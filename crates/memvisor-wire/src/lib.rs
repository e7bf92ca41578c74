//! The Unix-socket wire layer memvisor's two front ends share.
//!
//! vhost-user and vfio-user are both message protocols on a Unix stream: a fixed header that
//! says how long the message is, the rest of the message, and file descriptors (guest memory,
//! eventfds) attached with `SCM_RIGHTS` to the message's first byte. What the headers hold and
//! what the messages mean differ; how a message comes off the socket and goes onto it does not.
//! This crate is that common part, so both front ends frame, limit and fail the same way:
//!
//! * [`fds`]: the one `recvmsg` / `sendmsg` that carries descriptors.
//! * [`frame`]: one message off the stream (header, descriptors, body, within [`Limits`]) for
//!   any header that implements [`Frame`], and one message onto it.
//! * [`error`]: [`WireError`], what can go wrong on the wire (the peer left, a stream out of
//!   step, a payload of the wrong size, a socket error) with its errno. Each front end's error
//!   type wraps it, so callers match the same variants in both.
//! * [`rng`]: the seeded random source both hostile clients draw their messages from.
//!
//! Each protocol keeps its own header layout, request names and message meanings.

#![cfg(target_os = "linux")]
// docs.rs (`--cfg docsrs`): each feature-gated item is labelled with the feature it needs.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
pub mod fds;
pub mod frame;
pub mod rng;

pub use error::{Size, WireError};
pub use fds::{Received, recv_with_fds, send_with_fds};
pub use frame::{Frame, Limits, Message, recv, send};
