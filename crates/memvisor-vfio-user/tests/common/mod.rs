//! A test client of the vfio-user server over a socket pair: raw messages in and out, the
//! requests the tests make (region access, DMA_MAP / DMA_UNMAP, MSI), and the memfds and
//! eventfds they pass.
#![allow(dead_code)]

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;

use memvisor::DmaConfig;
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor_vfio_user::proto::{self, DmaMap, DmaUnmap, HEADER, Header, cmd, flags};
use memvisor_vfio_user::{DmaDev, Result, Server, ServerStats};

pub struct Client {
    pub sock: UnixStream,
    pub id: u16,
}

/// A reply: the errno (0 if none) and the body.
pub type Answer = (u32, Vec<u8>);

/// One message from the server: its header and body.
pub fn read_msg(sock: &UnixStream) -> (Header, Vec<u8>) {
    let mut h = [0u8; HEADER];
    (&*sock).read_exact(&mut h).unwrap();
    let h = Header::parse(&h);
    let mut body = vec![0u8; h.size as usize - HEADER];
    (&*sock).read_exact(&mut body).unwrap();
    (h, body)
}

impl Client {
    pub fn send(&mut self, command: u16, body: &[u8], fds: &[i32]) {
        self.id += 1;
        let h = Header {
            id: self.id,
            command,
            size: (HEADER + body.len()) as u32,
            flags: flags::COMMAND,
            error: 0,
        };
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(body);
        memvisor_wire::send_with_fds(&self.sock, &b, fds).unwrap();
    }

    pub fn recv(&mut self) -> Answer {
        let (h, body) = read_msg(&self.sock);
        assert!(h.is_reply(), "{h:?}");
        assert_eq!(h.id, self.id, "reply to the last request");
        let errno = if h.flags & flags::ERROR != 0 {
            h.error
        } else {
            0
        };
        (errno, body)
    }

    pub fn call(&mut self, command: u16, body: &[u8], fds: &[i32]) -> Answer {
        self.send(command, body, fds);
        self.recv()
    }

    pub fn ok(&mut self, command: u16, body: &[u8], fds: &[i32]) -> Vec<u8> {
        let (e, b) = self.call(command, body, fds);
        assert_eq!(e, 0, "{} failed with errno {e}", cmd::name(command));
        b
    }

    pub fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) {
        self.ok(
            cmd::REGION_WRITE,
            &region_write_body(region, offset, data),
            &[],
        );
    }

    pub fn region_read(&mut self, region: u32, offset: u64, count: u32) -> Vec<u8> {
        let b = proto::RegionAccess {
            offset,
            region,
            count,
        }
        .to_bytes();
        self.ok(cmd::REGION_READ, &b, &[])[16..].to_vec()
    }

    pub fn reg32(&mut self, offset: u64) -> u32 {
        u32::from_le_bytes(self.region_read(0, offset, 4).try_into().unwrap())
    }

    /// DMA_MAP of `size` bytes of `fd` from `offset` at `iova`, READ | WRITE; its errno.
    pub fn map(&mut self, fd: &OwnedFd, offset: u64, iova: u64, size: u64) -> u32 {
        self.map_flags(Some(fd), 3, offset, iova, size)
    }

    /// DMA_MAP with `flags`, through `fd` or (None) with no descriptor; its errno.
    pub fn map_flags(
        &mut self,
        fd: Option<&OwnedFd>,
        flags: u32,
        offset: u64,
        iova: u64,
        size: u64,
    ) -> u32 {
        let m = DmaMap {
            argsz: 32,
            flags,
            offset,
            iova,
            size,
        };
        let fds: Vec<i32> = fd.iter().map(|f| f.as_raw_fd()).collect();
        self.call(cmd::DMA_MAP, &m.to_bytes(), &fds).0
    }

    /// DMA_UNMAP with `flags`: its errno and the bytes it says it unmapped.
    pub fn unmap(&mut self, iova: u64, size: u64, flags: u32) -> (u32, u64) {
        let u = DmaUnmap {
            argsz: 24,
            flags,
            iova,
            size,
            bitmap: None,
        };
        let (e, b) = self.call(cmd::DMA_UNMAP, &u.to_bytes(), &[]);
        let size = if e == 0 { proto::u64_at(&b, 16) } else { 0 };
        (e, size)
    }
}

/// A REGION_WRITE's body: `data` at `offset` of `region`.
pub fn region_write_body(region: u32, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut b = proto::RegionAccess {
        offset,
        region,
        count: data.len() as u32,
    }
    .to_bytes()
    .to_vec();
    b.extend_from_slice(data);
    b
}

/// A server with the mvdma device on one end of a socket pair, `before` run on it before it
/// serves; the client on the other end, before any handshake.
pub fn start_with(
    before: impl FnOnce(&Server<DmaDev>),
) -> (Client, JoinHandle<(ServerStats, Result<()>)>) {
    let (a, b) = UnixStream::pair().unwrap();
    // A registry of its own: tests run in parallel, and each checks that its server ends with
    // nothing locked.
    let config = DmaConfig {
        registry: Some(PinRegistry::new(LockLimit::Unlimited)),
        ..DmaConfig::default()
    };
    let server = Server::new(b, config, memvisor::SharedMappings::global(), DmaDev::new).unwrap();
    before(&server);
    let t = std::thread::spawn(move || server.serve());
    (Client { sock: a, id: 0 }, t)
}

pub fn start() -> (Client, JoinHandle<(ServerStats, Result<()>)>) {
    start_with(|_| {})
}

/// The VERSION exchange QEMU makes, checked as QEMU checks the reply.
pub fn handshake(c: &mut Client) {
    let v = proto::Version {
        major: 0,
        minor: 0,
        json: r#"{"capabilities":{"max_msg_fds":16,"pgsizes":4096}}"#.into(),
    };
    let r = c.ok(cmd::VERSION, &v.to_bytes(), &[]);
    let got = proto::Version::parse(&r).unwrap();
    assert_eq!((got.major, got.minor), (0, 0));
    let caps: serde_json::Value = serde_json::from_str(&got.json).unwrap();
    assert_eq!(caps["capabilities"]["max_msg_fds"], 16);
    // QEMU rejects a VERSION reply larger than its request.
    assert!(r.len() <= v.to_bytes().len() + 150, "{} bytes", r.len());
}

pub fn memfd(size: u64) -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vfio-user-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd is a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our descriptor.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
    fd
}

pub fn pwrite(fd: &OwnedFd, off: u64, data: &[u8]) {
    // SAFETY: writes from a live buffer to our descriptor.
    let n = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), off as i64) };
    assert_eq!(n as usize, data.len());
}

pub fn pread(fd: &OwnedFd, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    // SAFETY: reads into a live buffer from our descriptor.
    let n = unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr().cast(), len, off as i64) };
    assert_eq!(n as usize, len);
    b
}

pub fn eventfd() -> OwnedFd {
    // SAFETY: eventfd with valid flags; checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor we own.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

/// Gives the device's MSI vector an eventfd, as QEMU does when the guest enables MSI.
pub fn msi(c: &mut Client) -> OwnedFd {
    let irq = eventfd();
    let mut set = Vec::new();
    // argsz, EVENTFD | TRIGGER, index 1 (MSI), start 0, count 1
    for v in [20u32, 0x24, 1, 0, 1] {
        set.extend_from_slice(&v.to_le_bytes());
    }
    c.ok(cmd::DEVICE_SET_IRQS, &set, &[irq.as_raw_fd()]);
    irq
}

/// Writes one mvdma descriptor (source, destination, length, status) at offset `at` of `mem`.
pub fn put_desc_at(mem: &OwnedFd, at: u64, src: u64, dst: u64, len: u32) {
    let mut d = Vec::new();
    d.extend_from_slice(&src.to_le_bytes());
    d.extend_from_slice(&dst.to_le_bytes());
    d.extend_from_slice(&len.to_le_bytes());
    d.extend_from_slice(&u32::MAX.to_le_bytes());
    d.extend_from_slice(&0u64.to_le_bytes());
    pwrite(mem, at, &d);
}
