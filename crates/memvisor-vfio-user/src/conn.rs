//! One client connection: framing over the socket, and requests this side sends.
//!
//! Messages are read by one thread only (the server loop). The mechanics are
//! [`memvisor_wire`]'s, shared with vhost-user: a message starts with its header, read with
//! `recvmsg` so the descriptors attached to its first byte come with it; the rest is read with
//! plain reads. vfio-user's own part is its header ([`Frame`] for [`Header`]) and [`LIMITS`].
//!
//! Writes come from the server loop (replies) and from the device's engine (`DMA_READ` /
//! `DMA_WRITE` for memory mapped without a descriptor), so each message is written whole under
//! a lock. Replies to the server's own requests arrive in the same stream;
//! the loop hands each to the thread waiting on its id.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::time::Duration;

use memvisor_wire::frame::protocol_error;
use memvisor_wire::{Frame, Limits, WireError};

use crate::error::{Error, Result};
use crate::lock;
use crate::proto::{self, HEADER, Header, MAX_FDS, MAX_MESSAGE, cmd, flags};

/// vfio-user's 16-byte header, as the wire layer frames it: its `size` counts the whole
/// message, so a size below the header's own is refused before anything else is read.
impl Frame for Header {
    const PROTOCOL: &'static str = "vfio-user";
    const SIZE: usize = HEADER;

    fn parse_frame(bytes: &[u8]) -> std::result::Result<Header, WireError> {
        let header = Header::parse(bytes.try_into().expect("HEADER bytes"));
        if (header.size as usize) < HEADER {
            return Err(protocol_error::<Header>(format!(
                "{}: message size {}, smaller than the {HEADER}-byte header",
                header.describe(),
                header.size
            )));
        }
        Ok(header)
    }

    fn body_len(&self) -> usize {
        self.size as usize - HEADER
    }

    fn describe(&self) -> String {
        format!("{} (id {})", cmd::name(self.command), self.id)
    }
}

/// What one message may carry: [`MAX_FDS`] descriptors (the `max_msg_fds` this server
/// announces), [`MAX_MESSAGE`] bytes in all.
pub const LIMITS: Limits = Limits {
    max_fds: MAX_FDS,
    max_body: MAX_MESSAGE - HEADER,
};

/// One received message: its header, the bytes after the header (`body`), and the
/// descriptors that came with it.
pub type Message = memvisor_wire::Message<Header>;

/// The connection.
#[derive(Debug)]
pub struct Conn {
    sock: UnixStream,
    writer: Mutex<()>,
    pending: Mutex<HashMap<u16, SyncSender<Message>>>,
    next_id: AtomicU16,
    /// Set while the device resets ([`Conn::cancel_requests`]): requests fail at once.
    cancelled: AtomicBool,
}

impl Conn {
    /// A connection over `sock`, with no request of its own outstanding yet.
    pub fn new(sock: UnixStream) -> Conn {
        Conn {
            sock,
            writer: Mutex::new(()),
            pending: Mutex::new(HashMap::new()),
            next_id: AtomicU16::new(0x8000),
            cancelled: AtomicBool::new(false),
        }
    }

    /// Receives one message. [`WireError::Disconnected`] when the client closed the socket
    /// between messages.
    pub fn recv(&self) -> Result<Message> {
        Ok(memvisor_wire::recv::<Header>(&self.sock, LIMITS)?)
    }

    /// Sends one message, whole.
    pub fn send(&self, header: Header, body: &[&[u8]], fds: &[&OwnedFd]) -> Result<()> {
        let mut b = Vec::with_capacity(header.size as usize);
        b.extend_from_slice(&header.to_bytes());
        for part in body {
            b.extend_from_slice(part);
        }
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        let _w = lock(&self.writer);
        Ok(memvisor_wire::send(&self.sock, &b, &raw)?)
    }

    /// Replies to `to` with `body` (and descriptors).
    pub fn reply(&self, to: &Header, body: &[&[u8]], fds: &[&OwnedFd]) -> Result<()> {
        let size = HEADER + body.iter().map(|p| p.len()).sum::<usize>();
        let h = Header {
            id: to.id,
            command: to.command,
            size: size as u32,
            flags: flags::REPLY,
            error: 0,
        };
        self.send(h, body, fds)
    }

    /// An error reply to `to` carrying `errno`.
    pub fn reply_error(&self, to: &Header, errno: i32) -> Result<()> {
        let h = Header {
            id: to.id,
            command: to.command,
            size: HEADER as u32,
            flags: flags::REPLY | flags::ERROR,
            error: errno as u32,
        };
        self.send(h, &[], &[])
    }

    /// Sends a request of this side's own and waits up to `timeout` for its reply, which the
    /// server loop delivers with [`Conn::deliver`].
    pub fn request(&self, command: u16, body: &[&[u8]], timeout: Duration) -> Result<Message> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx): (SyncSender<Message>, Receiver<Message>) = sync_channel(1);
        {
            // Checked under the lock `cancel_requests` empties the table with: a request
            // either sees the flag or is in the table when it is emptied.
            let mut pending = lock(&self.pending);
            if self.cancelled.load(Ordering::Relaxed) {
                return Err(Error::Refused {
                    errno: libc::ECANCELED,
                    why: format!("{} (id {id}): the device is resetting", cmd::name(command)),
                });
            }
            pending.insert(id, tx);
        }
        let size = HEADER + body.iter().map(|p| p.len()).sum::<usize>();
        let h = Header {
            id,
            command,
            size: size as u32,
            flags: flags::COMMAND,
            error: 0,
        };
        let sent = self.send(h, body, &[]);
        let got = sent.and_then(|()| {
            rx.recv_timeout(timeout).map_err(|e| Error::Refused {
                errno: libc::ETIMEDOUT,
                why: match e {
                    RecvTimeoutError::Timeout => format!(
                        "{} (id {id}): no reply from the client in {timeout:?}",
                        cmd::name(command)
                    ),
                    RecvTimeoutError::Disconnected => format!(
                        "{} (id {id}): the connection ended before the client replied",
                        cmd::name(command)
                    ),
                },
            })
        });
        lock(&self.pending).remove(&id);
        let m = got?;
        if m.header.flags & flags::ERROR != 0 {
            return Err(Error::Refused {
                // vfio-user.rst: the errno "may be zero even if the Error bit is set": it
                // failed all the same.
                errno: if m.header.error == 0 {
                    libc::EIO
                } else {
                    m.header.error as i32
                },
                why: format!(
                    "{}: the client answered errno {}",
                    cmd::name(command),
                    m.header.error
                ),
            });
        }
        Ok(m)
    }

    /// Hands a reply to the thread waiting for it. A reply nobody waits for (late, or never
    /// asked for) is dropped with a warning: the stream itself is still in step.
    pub fn deliver(&self, m: Message) {
        let id = m.header.id;
        match lock(&self.pending).remove(&id) {
            Some(tx) => {
                let _ = tx.send(m);
            }
            None => log::warn!(
                "a reply to {} with id {id} that no request waits for; dropped",
                proto::cmd::name(m.header.command)
            ),
        }
    }

    /// Wakes every thread waiting for a reply to its request: none will come (the server loop,
    /// which delivers replies, has stopped). Their requests fail at once instead of after
    /// their timeout.
    pub fn fail_pending(&self) {
        lock(&self.pending).clear();
    }

    /// Fails the requests waiting for a reply and every new one, until
    /// [`Conn::resume_requests`]: for a device reset on the thread that delivers replies,
    /// which could not deliver the replies the device waits for while it resets.
    pub fn cancel_requests(&self) {
        let mut pending = lock(&self.pending);
        self.cancelled.store(true, Ordering::Relaxed);
        pending.clear();
    }

    /// Lets requests go again after [`Conn::cancel_requests`].
    pub fn resume_requests(&self) {
        let _pending = lock(&self.pending);
        self.cancelled.store(false, Ordering::Relaxed);
    }

    /// Shuts the socket down, waking the server loop.
    pub fn shutdown(&self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

/// Whether `fd` was opened for writing (`fcntl(F_GETFL)`).
pub(crate) fn opened_for_writing(fd: &OwnedFd) -> Result<bool> {
    // SAFETY: F_GETFL reads the descriptor's flags; the descriptor is ours and open.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 {
        return Err(Error::Refused {
            errno: libc::EBADF,
            why: format!(
                "fcntl(F_GETFL) on a DMA_MAP descriptor: {}",
                std::io::Error::last_os_error()
            ),
        });
    }
    Ok(flags & libc::O_ACCMODE != libc::O_RDONLY)
}
