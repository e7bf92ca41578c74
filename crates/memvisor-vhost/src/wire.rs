//! Messages on the Unix socket: a 12-byte header, a payload, and file descriptors passed with
//! `SCM_RIGHTS`.
//!
//! A frontend sends each message in one `sendmsg`, descriptors attached to its first byte; so
//! the header is read with `recvmsg` (collecting up to [`MAX_FDS`] descriptors, close-on-exec),
//! then the payload with plain reads. A header with a wrong version, a payload larger than
//! [`MAX_PAYLOAD`], or more descriptors than fit (the kernel drops the rest and says so) puts
//! the stream out of step: that is [`Error::Protocol`] and the connection ends. Received
//! descriptors are [`OwnedFd`]s from the moment they arrive, so every path that refuses a
//! message closes them.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use crate::error::{Error, Result};
use crate::proto::{self, HEADER, Header, MAX_PAYLOAD};

/// Descriptors one message may carry: a memory table's worth.
pub const MAX_FDS: usize = proto::MAX_TABLE_REGIONS;

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

/// Receives one message. [`Error::Disconnected`] when the frontend closed the socket cleanly
/// between messages.
pub fn recv(sock: &UnixStream) -> Result<Message> {
    let mut hdr = [0u8; HEADER];
    let (n, fds) = recv_with_fds(sock, &mut hdr)?;
    if n == 0 {
        return Err(Error::Disconnected);
    }
    if n < HEADER {
        (&*sock)
            .read_exact(&mut hdr[n..])
            .map_err(|e| io_error("read header", e))?;
    }
    let header = Header::parse(&hdr);
    if header.flags & proto::flags::VERSION_MASK != proto::flags::VERSION {
        return Err(Error::Protocol(format!(
            "header flags {:#x} of {}: version {} is not 1",
            header.flags,
            proto::req::name(header.request),
            header.flags & proto::flags::VERSION_MASK
        )));
    }
    if header.size as usize > MAX_PAYLOAD {
        return Err(Error::Protocol(format!(
            "{}: payload of {} bytes, at most {MAX_PAYLOAD}",
            proto::req::name(header.request),
            header.size
        )));
    }
    let mut payload = vec![0u8; header.size as usize];
    (&*sock)
        .read_exact(&mut payload)
        .map_err(|e| io_error("read payload", e))?;
    Ok(Message {
        header,
        payload,
        fds,
    })
}

/// Sends a reply to `request` with `payload`.
pub fn reply(sock: &UnixStream, request: u32, payload: &[u8]) -> Result<()> {
    let mut b = Header::reply(request, payload.len()).to_vec();
    b.extend_from_slice(payload);
    (&*sock)
        .write_all(&b)
        .map_err(|e| io_error("send reply", e))
}

fn io_error(op: &'static str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::Disconnected
    } else {
        Error::Os { op, source: e }
    }
}

/// `recvmsg` into `buf`, collecting descriptors.
fn recv_with_fds(sock: &UnixStream, buf: &mut [u8]) -> Result<(usize, Vec<OwnedFd>)> {
    let got =
        memvisor_wire::recv_with_fds(sock, buf, MAX_FDS).map_err(|e| io_error("recvmsg", e))?;
    if got.truncated {
        // `got.fds` closes what did arrive.
        return Err(Error::Protocol(format!(
            "a message carried more than {MAX_FDS} file descriptors"
        )));
    }
    Ok((got.len, got.fds))
}

/// Sends `data` with descriptors (tests and the bad-frontend client use it).
pub fn send_with_fds(sock: &UnixStream, data: &[u8], fds: &[i32]) -> Result<()> {
    memvisor_wire::send_with_fds(sock, data, fds).map_err(|e| io_error("sendmsg", e))
}
