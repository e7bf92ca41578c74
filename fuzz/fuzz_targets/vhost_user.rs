//! The vhost-user message parser and state machine: the input is a sequence of messages, each
//! `request: u8` (an index into the known requests, or a raw number when the top bit is set),
//! `how: u8` (bit 0 asks for a reply, bits 1-2 the number of descriptors, bit 3 eventfds rather
//! than memfds, bit 4 a header that lies about its size), `len: u8` and `len` payload bytes.
//! They go over a socket pair to a `Backend<Blk>` serving in its own thread; memory tables get
//! 64 KiB memfds (the size the seeds' regions claim). Then the frontend hangs up and the run
//! ends: the back end must answer or hang up, never panic, and drop everything it was given.
#![no_main]

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicBool;

use libfuzzer_sys::fuzz_target;
use memvisor_fuzz::{Bytes, eventfd, memfd};
use memvisor_vhost::proto::{flags, req};
use memvisor_vhost::{Backend, Blk, BlkOptions, wire};

const REQUESTS: [u32; 28] = [
    req::GET_FEATURES,
    req::SET_FEATURES,
    req::SET_OWNER,
    req::RESET_OWNER,
    req::SET_MEM_TABLE,
    req::SET_LOG_BASE,
    req::SET_LOG_FD,
    req::SET_VRING_NUM,
    req::SET_VRING_ADDR,
    req::SET_VRING_BASE,
    req::GET_VRING_BASE,
    req::SET_VRING_KICK,
    req::SET_VRING_CALL,
    req::SET_VRING_ERR,
    req::GET_PROTOCOL_FEATURES,
    req::SET_PROTOCOL_FEATURES,
    req::GET_QUEUE_NUM,
    req::SET_VRING_ENABLE,
    req::SET_BACKEND_REQ_FD,
    req::IOTLB_MSG,
    req::GET_CONFIG,
    req::SET_CONFIG,
    req::RESET_DEVICE,
    req::GET_MAX_MEM_SLOTS,
    req::ADD_MEM_REG,
    req::REM_MEM_REG,
    req::SET_STATUS,
    req::GET_STATUS,
];

fuzz_target!(|data: &[u8]| {
    let (front, back) = UnixStream::pair().expect("socket pair");
    let disk = memfd(64 << 10);
    let server = std::thread::spawn(move || {
        let mut backend =
            Backend::new(
                Blk::new(disk, BlkOptions::default()).expect("blk"),
                &memvisor_vhost::ProcessState::new(
                    memvisor::SharedMappings::global(),
                    memvisor::PinRegistry::global(),
                ),
            )
            .expect("back end");
        let stop = AtomicBool::new(false);
        let _ = backend.run(&back, &stop);
        // The back end and its socket go here, so the frontend's read below ends.
    });
    // Replies are drained in a thread of their own so neither side blocks on a full socket.
    let reader = front.try_clone().expect("dup the socket");
    let drain = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while matches!((&reader).read(&mut buf), Ok(n) if n > 0) {}
    });
    let mut b = Bytes::new(data);
    while !b.is_empty() {
        let r = b.u8();
        let request = if r & 0x80 != 0 {
            u32::from(r & 0x7f)
        } else {
            REQUESTS[usize::from(r) % REQUESTS.len()]
        };
        let how = b.u8();
        let len = usize::from(b.u8());
        let payload = b.take(len);
        let mut flags = flags::VERSION;
        if how & 1 != 0 {
            flags |= flags::NEED_REPLY;
        }
        let size = if how & 0x10 != 0 {
            u32::from(b.u16())
        } else {
            payload.len() as u32
        };
        let mut msg = request.to_le_bytes().to_vec();
        msg.extend_from_slice(&flags.to_le_bytes());
        msg.extend_from_slice(&size.to_le_bytes());
        msg.extend_from_slice(payload);
        let fds: Vec<OwnedFd> = (0..(how >> 1) & 3)
            .map(|_| {
                if how & 8 != 0 {
                    OwnedFd::from(eventfd())
                } else {
                    OwnedFd::from(memfd(64 << 10))
                }
            })
            .collect();
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        if wire::send_with_fds(&front, &msg, &raw).is_err() {
            break;
        }
    }
    let _ = front.shutdown(std::net::Shutdown::Write);
    server.join().expect("the back end panicked");
    drop(front);
    drain.join().expect("drain");
    memvisor_fuzz::check_leaks();
});
