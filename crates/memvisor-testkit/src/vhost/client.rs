//! A minimal vhost-user frontend: enough of QEMU's side to drive a back end from tests, from the
//! hostile-frontend trial ([`super::fuzz`]) and by hand. It sends whatever it is told to, well
//! formed or not; it checks nothing.

use std::io::Read;
use std::os::fd::RawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use memvisor_wire::frame::protocol_error;

use memvisor_vhost::error::{Error, Result};
use memvisor_vhost::proto::{self, HEADER, Header, flags};
use memvisor_vhost::wire;

/// A connection to a back end.
#[derive(Debug)]
pub struct Client {
    sock: UnixStream,
}

impl Client {
    /// Connects to the back end listening at `path`.
    pub fn connect(path: &Path) -> Result<Client> {
        let sock = UnixStream::connect(path).map_err(|source| Error::Os {
            op: "connect to the back end",
            source,
        })?;
        Ok(Client::from_stream(sock))
    }

    /// A client over a connected socket.
    pub fn from_stream(sock: UnixStream) -> Client {
        // A back end that stops answering must not hang a test forever.
        let _ = sock.set_read_timeout(Some(Duration::from_secs(10)));
        Client { sock }
    }

    /// Sends a request with `extra` header flags (e.g. [`flags::NEED_REPLY`]).
    pub fn send(&self, request: u32, extra: u32, payload: &[u8], fds: &[RawFd]) -> Result<()> {
        let mut b = request.to_le_bytes().to_vec();
        b.extend_from_slice(&(flags::VERSION | extra).to_le_bytes());
        b.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        b.extend_from_slice(payload);
        self.raw(&b, fds)
    }

    /// Sends bytes as they are.
    pub fn raw(&self, bytes: &[u8], fds: &[RawFd]) -> Result<()> {
        wire::send_with_fds(&self.sock, bytes, fds)
    }

    /// Receives a reply: its header and payload.
    pub fn reply(&self) -> Result<(Header, Vec<u8>)> {
        let mut h = [0u8; HEADER];
        (&self.sock)
            .read_exact(&mut h)
            .map_err(|source| Error::Os {
                op: "read reply header",
                source,
            })?;
        let header = Header::parse(&h);
        if header.size as usize > proto::MAX_PAYLOAD {
            return Err(protocol_error::<Header>(format!("reply of {} bytes", header.size)).into());
        }
        let mut p = vec![0u8; header.size as usize];
        (&self.sock)
            .read_exact(&mut p)
            .map_err(|source| Error::Os {
                op: "read reply payload",
                source,
            })?;
        Ok((header, p))
    }

    /// A request that answers with data.
    pub fn get(&self, request: u32, payload: &[u8]) -> Result<Vec<u8>> {
        self.send(request, 0, payload, &[])?;
        let (h, p) = self.reply()?;
        if h.request != request {
            return Err(protocol_error::<Header>(format!(
                "reply to {} answers request {}",
                proto::req::name(request),
                h.request
            ))
            .into());
        }
        Ok(p)
    }

    /// A request that answers with data and descriptors (`GET_INFLIGHT_FD`).
    pub fn get_with_fds(
        &self,
        request: u32,
        payload: &[u8],
    ) -> Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> {
        self.send(request, 0, payload, &[])?;
        let m = wire::recv(&self.sock)?;
        if m.header.request != request {
            return Err(protocol_error::<Header>(format!(
                "reply to {} answers request {}",
                proto::req::name(request),
                m.header.request
            ))
            .into());
        }
        Ok((m.payload, m.fds))
    }

    /// A `u64` answer.
    pub fn get_u64(&self, request: u32) -> Result<u64> {
        let p = self.get(request, &[])?;
        proto::u64_payload(request, &p)
    }

    /// A request with `NEED_REPLY`; returns the back end's ack (0: done).
    pub fn ack(&self, request: u32, payload: &[u8], fds: &[RawFd]) -> Result<u64> {
        self.send(request, flags::NEED_REPLY, payload, fds)?;
        let (h, p) = self.reply()?;
        if h.request != request {
            return Err(protocol_error::<Header>(format!(
                "ack for {} answers request {}",
                proto::req::name(request),
                h.request
            ))
            .into());
        }
        proto::u64_payload(request, &p)
    }

    /// The socket.
    pub fn socket(&self) -> &UnixStream {
        &self.sock
    }
}
