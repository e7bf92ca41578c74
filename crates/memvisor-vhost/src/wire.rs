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
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
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
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * size_of::<libc::c_int>()) as u32) } as usize;
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: msg describes `buf` and `control`, both alive and writable for this call.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(io_error("recvmsg", e));
        }
    };
    let mut fds = Vec::new();
    // SAFETY: the CMSG_* macros walk the control buffer the kernel filled, within
    // msg_controllen; each SCM_RIGHTS payload is an array of descriptors now owned by us.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<libc::c_int>();
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                    / size_of::<libc::c_int>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        // `fds` closes what did arrive.
        return Err(Error::Protocol(format!(
            "a message carried more than {MAX_FDS} file descriptors"
        )));
    }
    Ok((n, fds))
}

/// Sends `data` with descriptors (tests and the bad-frontend client use it).
pub fn send_with_fds(sock: &UnixStream, data: &[u8], fds: &[i32]) -> Result<()> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8).max(1)];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut _,
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields set below point at live buffers.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: the control buffer has room for one header and `fds`, as CMSG_SPACE said.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    // SAFETY: msg describes live buffers; sendmsg only reads them.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(Error::last_os("sendmsg"));
    }
    if (n as usize) < data.len() {
        (&*sock)
            .write_all(&data[n as usize..])
            .map_err(|e| io_error("send", e))?;
    }
    Ok(())
}
