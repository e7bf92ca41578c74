//! The vfio-user message parser and server state machine: the input is a sequence of messages,
//! each `command: u8` (1-16 are the protocol's, the rest taken as they are), `how: u8` (bits 0-1
//! the number of 64 KiB memfds passed, bit 2 a header that lies about its size, bit 3 a
//! message type other than command, bit 4 a 16-bit length), the length and the body. They go
//! over a socket pair to a `Server` with the mvdma device serving in its own thread. The client
//! side answers the server's own requests (peer DMA) with EFAULT so nothing waits out a
//! timeout. Then the client hangs up: the server must have answered or hung up, never panicked,
//! and ends with nothing mapped, pinned or locked.
#![no_main]

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use libfuzzer_sys::fuzz_target;
use memvisor::DmaConfig;
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor_fuzz::{Bytes, memfd};
use memvisor_vfio_user::proto::{HEADER, Header, flags};
use memvisor_vfio_user::{DmaDev, Server};

/// Reads the server's messages; answers its requests with EFAULT.
fn client_side(sock: UnixStream) {
    loop {
        let mut h = [0u8; HEADER];
        if (&sock).read_exact(&mut h).is_err() {
            return;
        }
        let h = Header::parse(&h);
        let body = (h.size as usize).saturating_sub(HEADER);
        let mut skip = vec![0u8; body.min(2 << 20)];
        if (&sock).read_exact(&mut skip).is_err() {
            return;
        }
        if !h.is_reply() {
            let r = Header {
                id: h.id,
                command: h.command,
                size: HEADER as u32,
                flags: flags::REPLY | flags::ERROR,
                error: libc::EFAULT as u32,
            };
            let _ = (&sock).write_all(&r.to_bytes());
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let (front, back) = UnixStream::pair().expect("socket pair");
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let config = DmaConfig {
        registry: Some(registry.clone()),
        ..DmaConfig::default()
    };
    let server = Server::new(back, config, memvisor::SharedMappings::global(), DmaDev::new).expect("server");
    let served = std::thread::spawn(move || server.serve());
    let reader = front.try_clone().expect("dup the socket");
    let client = std::thread::spawn(move || client_side(reader));
    let mut b = Bytes::new(data);
    let mut id = 0u16;
    while !b.is_empty() {
        let c = b.u8();
        let command = if c % 32 < 17 {
            u16::from(c % 17)
        } else {
            u16::from(c)
        };
        let how = b.u8();
        let len = if how & 0x10 != 0 {
            usize::from(b.u16())
        } else {
            usize::from(b.u8())
        };
        let body = b.take(len);
        let size = if how & 4 != 0 {
            b.u32()
        } else {
            (HEADER + body.len()) as u32
        };
        id = id.wrapping_add(1);
        let h = Header {
            id,
            command,
            size,
            flags: if how & 8 != 0 {
                u32::from(b.u8())
            } else {
                flags::COMMAND
            },
            error: 0,
        };
        let mut msg = h.to_bytes().to_vec();
        msg.extend_from_slice(body);
        let fds: Vec<OwnedFd> = (0..how & 3)
            .map(|_| OwnedFd::from(memfd(64 << 10)))
            .collect();
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        if memvisor_wire::send_with_fds(&front, &msg, &raw).is_err() {
            break;
        }
    }
    let _ = front.shutdown(std::net::Shutdown::Write);
    let (stats, _) = served.join().expect("the server panicked");
    assert_eq!(
        stats.pinned_pages_at_end, 0,
        "pins left after the device stopped"
    );
    assert_eq!(
        stats.locked_bytes_at_end, 0,
        "memory left locked after the unmap"
    );
    drop(front);
    client.join().expect("client side");
    assert_eq!(registry.locked_bytes(), 0, "memory left locked");
    memvisor_fuzz::check_leaks();
});
