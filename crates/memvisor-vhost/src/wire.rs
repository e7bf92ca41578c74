//! Messages on the Unix socket: vhost-user's 12-byte header, a payload, and file descriptors
//! passed with `SCM_RIGHTS`.
//!
//! The mechanics are [`memvisor_wire`]'s, shared with vfio-user: the header is read with
//! `recvmsg` (collecting up to [`MAX_FDS`] descriptors, close-on-exec), then the payload with
//! plain reads. What is vhost-user's own is here: the header ([`Frame`] for [`Header`]), whose
//! version must be 1, and the limits, a payload of at most [`MAX_PAYLOAD`] bytes. A header with
//! a wrong version, a larger payload, or more descriptors than fit (the kernel drops the rest
//! and says so) puts the stream out of step: that is [`WireError::Protocol`] and the connection
//! ends. Received descriptors are [`OwnedFd`]s from the moment they arrive, so every path that
//! refuses a message closes them.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use memvisor_wire::frame::protocol_error;
use memvisor_wire::{Frame, Limits, WireError};

use crate::error::{Error, Result};
use crate::proto::{self, HEADER, Header, MAX_PAYLOAD};

/// Descriptors one message may carry: a memory table's worth.
pub const MAX_FDS: usize = proto::MAX_TABLE_REGIONS;

/// What one message may carry.
pub const LIMITS: Limits = Limits {
    max_fds: MAX_FDS,
    max_body: MAX_PAYLOAD,
};

impl Frame for Header {
    const PROTOCOL: &'static str = "vhost-user";
    const SIZE: usize = HEADER;

    fn parse_frame(bytes: &[u8]) -> std::result::Result<Header, WireError> {
        let header = Header::parse(bytes.try_into().expect("HEADER bytes"));
        if header.flags & proto::flags::VERSION_MASK != proto::flags::VERSION {
            return Err(protocol_error::<Header>(format!(
                "header flags {:#x} of {}: version {} is not 1",
                header.flags,
                proto::req::name(header.request),
                header.flags & proto::flags::VERSION_MASK
            )));
        }
        Ok(header)
    }

    fn body_len(&self) -> usize {
        self.size as usize
    }

    fn describe(&self) -> String {
        proto::req::name(self.request).into()
    }
}

/// One received message.
#[derive(Debug)]
pub struct Message {
    /// Its header.
    pub header: Header,
    /// `header.size` bytes.
    pub payload: Vec<u8>,
    /// Descriptors that came with it.
    pub fds: Vec<OwnedFd>,
}

impl Message {
    /// Whether the frontend asked for a `REPLY_ACK`.
    pub fn needs_reply(&self) -> bool {
        self.header.flags & proto::flags::NEED_REPLY != 0
    }

    /// The one descriptor the request must carry.
    pub fn take_fd(&mut self, what: &str) -> Result<OwnedFd> {
        match self.fds.len() {
            1 => Ok(self.fds.pop().expect("one fd")),
            n => Err(Error::Invalid(format!(
                "{}: {n} file descriptors for {what}, expected 1",
                proto::req::name(self.header.request)
            ))),
        }
    }
}

/// Receives one message. [`WireError::Disconnected`] when the frontend closed the socket
/// cleanly between messages.
pub fn recv(sock: &UnixStream) -> Result<Message> {
    let m = memvisor_wire::recv::<Header>(sock, LIMITS)?;
    Ok(Message {
        header: m.header,
        payload: m.body,
        fds: m.fds,
    })
}

/// Sends a reply to `request` with `payload`.
pub fn reply(sock: &UnixStream, request: u32, payload: &[u8]) -> Result<()> {
    let mut b = Header::reply(request, payload.len()).to_vec();
    b.extend_from_slice(payload);
    Ok(memvisor_wire::send(sock, &b, &[])?)
}

/// Sends a reply to `request` with `payload` and descriptors.
pub fn reply_with_fds(sock: &UnixStream, request: u32, payload: &[u8], fds: &[i32]) -> Result<()> {
    let mut b = Header::reply(request, payload.len()).to_vec();
    b.extend_from_slice(payload);
    Ok(memvisor_wire::send(sock, &b, fds)?)
}

/// Sends `data` with descriptors (tests and the bad-frontend client use it).
pub fn send_with_fds(sock: &UnixStream, data: &[u8], fds: &[i32]) -> Result<()> {
    Ok(memvisor_wire::send(sock, data, fds)?)
}
