//! Descriptors on a Unix socket: one `recvmsg` / `sendmsg` that carries `SCM_RIGHTS`.
//!
//! vhost-user and vfio-user both send guest memory and eventfds as descriptors attached
//! (`SCM_RIGHTS`) to the first byte of a message that is written with one `sendmsg`. A receiver
//! therefore reads each message's fixed header with [`recv_with_fds`], which collects whatever
//! descriptors came with it, and the rest of the message with plain reads ([`crate::frame`]
//! does that). This module is that pair of system calls and nothing else.
//!
//! Received descriptors are [`OwnedFd`]s (close-on-exec) from the moment they arrive, so a
//! caller that refuses a message closes them by dropping it. More descriptors than the caller
//! has room for is reported, not hidden: the kernel closes the surplus, and the stream can no
//! longer be trusted to be in step with what the peer meant.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// What [`recv_with_fds`] received.
#[derive(Debug)]
pub struct Received {
    /// Bytes read into the buffer; 0 when the peer closed the socket.
    pub len: usize,
    /// Descriptors that came with them.
    pub fds: Vec<OwnedFd>,
    /// The peer sent more descriptors than `max_fds`; the kernel closed the rest.
    pub truncated: bool,
}

/// One `recvmsg` into `buf`, collecting up to `max_fds` descriptors. Retries on EINTR.
pub fn recv_with_fds(sock: &UnixStream, buf: &mut [u8], max_fds: usize) -> io::Result<Received> {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE((max_fds * size_of::<libc::c_int>()) as u32) } as usize;
    // u64 words keep the control buffer aligned for cmsghdr.
    let mut control = vec![0u64; space.div_ceil(8).max(1)];
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
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
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
    Ok(Received {
        len: n,
        fds,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// Sends `data` with `fds` attached to its first byte; the rest, if `sendmsg` took only part,
/// with plain writes. Never raises SIGPIPE (EPIPE instead).
pub fn send_with_fds(sock: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
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
    let n = loop {
        // SAFETY: msg describes live buffers; sendmsg only reads them.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    if n < data.len() {
        (&*sock).write_all(&data[n..])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::fd::AsFd;

    #[test]
    fn descriptors_travel_with_the_first_byte() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, w) = UnixStream::pair().unwrap();
        send_with_fds(&a, b"hello world", &[r.as_raw_fd(), w.as_raw_fd()]).unwrap();
        let mut head = [0u8; 5];
        let got = recv_with_fds(&b, &mut head, 4).unwrap();
        assert_eq!((got.len, got.fds.len(), got.truncated), (5, 2, false));
        assert_eq!(&head, b"hello");
        let mut rest = [0u8; 6];
        (&b).read_exact(&mut rest).unwrap();
        assert_eq!(&rest, b" world");
        // The received descriptors are live copies: a write through one arrives at the other end.
        let w2 = UnixStream::from(got.fds.into_iter().nth(1).unwrap());
        (&w2).write_all(b"x").unwrap();
        let mut one = [0u8; 1];
        (&r).read_exact(&mut one).unwrap();
        assert_eq!(one[0], b'x');
        let _ = w.as_fd();
    }

    #[test]
    fn more_descriptors_than_room_is_reported() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, _w) = UnixStream::pair().unwrap();
        send_with_fds(&a, b"m", &[r.as_raw_fd(); 3]).unwrap();
        let mut buf = [0u8; 1];
        let got = recv_with_fds(&b, &mut buf, 1).unwrap();
        assert!(got.truncated, "{got:?}");
        assert!(got.fds.len() < 3, "{got:?}");
    }

    #[test]
    fn a_closed_peer_reads_zero() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        let mut buf = [0u8; 4];
        let got = recv_with_fds(&b, &mut buf, 1).unwrap();
        assert_eq!((got.len, got.fds.len()), (0, 0));
    }
}
