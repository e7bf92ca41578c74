//! A minimal vfio-user client: enough of QEMU's side to drive a server from tests, from the
//! hostile client ([`super::fuzz`]) and by hand. It sends whatever it is told to, well formed
//! or not, and checks nothing of what it sends.
//!
//! The server sends requests of its own in the same stream (`DMA_READ` / `DMA_WRITE`, for
//! memory mapped without a descriptor). [`Client::reply`] answers each one it meets while it
//! waits for the reply to its own request — reads with zeros, writes with an empty reply, or,
//! when told to, with an error — so the server's device never waits for a client that is busy
//! waiting for the server.

use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use memvisor_wire::WireError;

use memvisor_vfio_user::conn::{LIMITS, Message};
use memvisor_vfio_user::error::Result;
use memvisor_vfio_user::proto::{self, DMA_RW, HEADER, Header, cmd, flags};

/// A reply: the errno of an error reply (0 if none) and the body.
pub type Answer = (u32, Vec<u8>);

/// A connection to a vfio-user server.
#[derive(Debug)]
pub struct Client {
    sock: UnixStream,
    id: u16,
    /// Answer the server's own requests with this errno instead of serving them (0: serve).
    pub refuse_server_requests: u32,
    /// The server's requests answered so far.
    pub server_requests: u64,
}

impl Client {
    /// Connects to the server listening at `path`.
    pub fn connect(path: &Path) -> Result<Client> {
        let sock = UnixStream::connect(path)
            .map_err(|e| WireError::io("connect to the vfio-user server", e))?;
        Ok(Client::from_stream(sock))
    }

    /// A client over a connected socket; a reply that takes over 10 s is an error.
    pub fn from_stream(sock: UnixStream) -> Client {
        let _ = sock.set_read_timeout(Some(Duration::from_secs(10)));
        Client {
            sock,
            id: 0,
            refuse_server_requests: 0,
            server_requests: 0,
        }
    }

    /// The socket.
    pub fn socket(&self) -> &UnixStream {
        &self.sock
    }

    /// Sends a command with header `flags` (normally [`flags::COMMAND`]); returns its id.
    pub fn send(&mut self, command: u16, fl: u32, body: &[u8], fds: &[RawFd]) -> Result<u16> {
        self.id = self.id.wrapping_add(1);
        let h = Header {
            id: self.id,
            command,
            size: (HEADER + body.len()) as u32,
            flags: fl,
            error: 0,
        };
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(body);
        self.raw(&b, fds)?;
        Ok(self.id)
    }

    /// Sends bytes as they are.
    pub fn raw(&self, bytes: &[u8], fds: &[RawFd]) -> Result<()> {
        Ok(memvisor_wire::send(&self.sock, bytes, fds)?)
    }

    /// Waits for the next reply, answering the server's own requests met on the way.
    pub fn reply(&mut self) -> Result<Message> {
        loop {
            let m = memvisor_wire::recv::<Header>(&self.sock, LIMITS)?;
            if m.header.is_reply() {
                return Ok(m);
            }
            self.serve_request(&m)?;
        }
    }

    /// Sends a command and waits for its reply.
    pub fn call(&mut self, command: u16, body: &[u8], fds: &[RawFd]) -> Result<Answer> {
        let id = self.send(command, flags::COMMAND, body, fds)?;
        let m = self.reply()?;
        if m.header.id != id || m.header.command != command {
            return Err(memvisor_wire::frame::protocol_error::<Header>(format!(
                "a reply to {} (id {}, flags {:#x}) where {} (id {id}) was asked",
                cmd::name(m.header.command),
                m.header.id,
                m.header.flags,
                cmd::name(command)
            ))
            .into());
        }
        let errno = if m.header.flags & flags::ERROR != 0 {
            m.header.error.max(1)
        } else {
            0
        };
        Ok((errno, m.body))
    }

    /// Answers a `DMA_READ` / `DMA_WRITE` (or anything else) the server sent.
    fn serve_request(&mut self, m: &Message) -> Result<()> {
        self.server_requests += 1;
        let h = m.header;
        let mut reply = Header {
            id: h.id,
            command: h.command,
            size: HEADER as u32,
            flags: flags::REPLY,
            error: 0,
        };
        let mut body = Vec::new();
        let known = matches!(h.command, cmd::DMA_READ | cmd::DMA_WRITE) && m.body.len() >= DMA_RW;
        if self.refuse_server_requests != 0 || !known {
            reply.flags |= flags::ERROR;
            reply.error = if known {
                self.refuse_server_requests
            } else {
                libc::ENOSYS as u32
            };
        } else if h.command == cmd::DMA_READ {
            let count = proto::u64_at(&m.body, 8).min(proto::MAX_DATA_XFER as u64) as usize;
            body.extend_from_slice(&m.body[..DMA_RW]);
            body.resize(DMA_RW + count, 0);
        } else {
            body.extend_from_slice(&m.body[..DMA_RW]);
        }
        reply.size = (HEADER + body.len()) as u32;
        let mut b = reply.to_bytes().to_vec();
        b.extend_from_slice(&body);
        self.raw(&b, &[])
    }
}
