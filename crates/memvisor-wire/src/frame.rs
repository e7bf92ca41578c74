//! Framing: one message off a Unix stream, and one message onto it.
//!
//! Both protocols frame a message the same way: a fixed-size header that says how many bytes
//! follow, then those bytes, with any descriptors attached to the header's first byte. Only the
//! header differs (vhost-user: 12 bytes, the payload size; vfio-user: 16 bytes, the whole
//! message's size), so a protocol describes its header with [`Frame`] and [`recv`] does the
//! rest:
//!
//! 1. the header with `recvmsg`, collecting up to [`Limits::max_fds`] descriptors; nothing at
//!    all means the peer closed the socket between messages ([`WireError::Disconnected`]);
//!    more descriptors than that puts the stream out of step ([`WireError::Protocol`]);
//! 2. the rest of the header, if `recvmsg` returned only part of it, with plain reads;
//! 3. [`Frame::parse_frame`], where the protocol refuses a header it cannot frame;
//! 4. a body longer than [`Limits::max_body`] is refused before anything is allocated for it
//!    (a hostile peer cannot make the receiver reserve gigabytes); the body itself is read
//!    with plain reads.
//!
//! End-of-file or a reset inside a message is a disconnect, like a clean close: see
//! [`WireError::io`]. Sending is [`send`]: one `sendmsg` with the descriptors, and plain writes
//! for whatever it did not take; the caller keeps a message whole by holding its own lock.

use std::io::Read;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use crate::error::WireError;
use crate::fds;

/// A protocol's fixed header, as far as framing needs it.
pub trait Frame: Sized {
    /// The protocol's name in errors ("vhost-user").
    const PROTOCOL: &'static str;
    /// Bytes of the header on the wire (at most [`MAX_HEADER`]).
    const SIZE: usize;

    /// Parses a header whose [`Frame::SIZE`] bytes have all arrived. A header the protocol
    /// cannot frame (a version it does not speak, a size smaller than the header) is
    /// [`WireError::Protocol`].
    fn parse_frame(bytes: &[u8]) -> Result<Self, WireError>;

    /// Bytes that follow the header.
    fn body_len(&self) -> usize;

    /// The message in words, for errors: its request or command name (and id).
    fn describe(&self) -> String;
}

/// The largest header [`recv`] reads.
pub const MAX_HEADER: usize = 64;

/// What one message may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Descriptors attached to one message.
    pub max_fds: usize,
    /// Bytes after the header.
    pub max_body: usize,
}

/// One received message.
#[derive(Debug)]
pub struct Message<H> {
    /// Its header.
    pub header: H,
    /// The [`Frame::body_len`] bytes after the header.
    pub body: Vec<u8>,
    /// Descriptors that came with it.
    pub fds: Vec<OwnedFd>,
}

/// A framing error of protocol `H`.
pub fn protocol_error<H: Frame>(why: String) -> WireError {
    WireError::Protocol {
        protocol: H::PROTOCOL,
        why,
    }
}

/// Receives one message. [`WireError::Disconnected`] when the peer closed the socket cleanly
/// between messages.
pub fn recv<H: Frame>(sock: &UnixStream, limits: Limits) -> Result<Message<H>, WireError> {
    const { assert!(H::SIZE <= MAX_HEADER) };
    let mut buf = [0u8; MAX_HEADER];
    let hdr = &mut buf[..H::SIZE];
    let got =
        fds::recv_with_fds(sock, hdr, limits.max_fds).map_err(|e| WireError::io("recvmsg", e))?;
    if got.len == 0 {
        return Err(WireError::Disconnected);
    }
    if got.truncated {
        // Dropping `got.fds` closes what did arrive.
        return Err(protocol_error::<H>(format!(
            "a message carried more than {} file descriptors",
            limits.max_fds
        )));
    }
    if got.len < H::SIZE {
        (&*sock)
            .read_exact(&mut hdr[got.len..])
            .map_err(|e| WireError::io("read header", e))?;
    }
    let header = H::parse_frame(hdr)?;
    let len = header.body_len();
    if len > limits.max_body {
        return Err(protocol_error::<H>(format!(
            "{}: {len} bytes after the header, at most {}",
            header.describe(),
            limits.max_body
        )));
    }
    let mut body = vec![0u8; len];
    (&*sock)
        .read_exact(&mut body)
        .map_err(|e| WireError::io("read body", e))?;
    Ok(Message {
        header,
        body,
        fds: got.fds,
    })
}

/// Sends one message, `fds` attached to its first byte. The caller keeps concurrent senders
/// from interleaving.
pub fn send(sock: &UnixStream, data: &[u8], fds: &[RawFd]) -> Result<(), WireError> {
    fds::send_with_fds(sock, data, fds).map_err(|e| WireError::io("sendmsg", e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// A toy header: one byte of body length, one of version (must be 1).
    #[derive(Debug)]
    struct Toy(u8);

    impl Frame for Toy {
        const PROTOCOL: &'static str = "toy";
        const SIZE: usize = 2;
        fn parse_frame(b: &[u8]) -> Result<Toy, WireError> {
            if b[1] != 1 {
                return Err(protocol_error::<Toy>(format!("version {}", b[1])));
            }
            Ok(Toy(b[0]))
        }
        fn body_len(&self) -> usize {
            self.0.into()
        }
        fn describe(&self) -> String {
            "toy message".into()
        }
    }

    const LIMITS: Limits = Limits {
        max_fds: 2,
        max_body: 8,
    };

    #[test]
    fn a_message_arrives_whole_with_its_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let (r, _w) = UnixStream::pair().unwrap();
        send(&a, &[3, 1, b'a', b'b', b'c'], &[r.as_raw_fd()]).unwrap();
        let m = recv::<Toy>(&b, LIMITS).unwrap();
        assert_eq!((m.body.as_slice(), m.fds.len()), (&b"abc"[..], 1));
    }

    #[test]
    fn a_header_in_pieces_is_read_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        (&a).write_all(&[1]).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            (&a).write_all(&[1, b'x']).unwrap();
        });
        let m = recv::<Toy>(&b, LIMITS).unwrap();
        assert_eq!(m.body, b"x");
        t.join().unwrap();
    }

    #[test]
    fn what_cannot_be_framed_is_a_protocol_error() {
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &[0, 2], &[]).unwrap();
        let e = recv::<Toy>(&b, LIMITS).unwrap_err();
        assert!(
            matches!(
                e,
                WireError::Protocol {
                    protocol: "toy",
                    ..
                }
            ),
            "{e:?}"
        );
        send(&a, &[9, 1], &[]).unwrap();
        let e = recv::<Toy>(&b, LIMITS).unwrap_err();
        assert_eq!(
            e.to_string(),
            "toy protocol: toy message: 9 bytes after the header, at most 8"
        );
        let (r, _w) = UnixStream::pair().unwrap();
        send(&a, &[0, 1], &[r.as_raw_fd(); 3]).unwrap();
        let e = recv::<Toy>(&b, LIMITS).unwrap_err();
        assert!(e.ends_connection(), "{e:?}");
    }

    #[test]
    fn a_close_between_or_inside_messages_is_a_disconnect() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        assert!(matches!(
            recv::<Toy>(&b, LIMITS),
            Err(WireError::Disconnected)
        ));
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &[4, 1, b'a'], &[]).unwrap();
        drop(a);
        assert!(matches!(
            recv::<Toy>(&b, LIMITS),
            Err(WireError::Disconnected)
        ));
    }
}
