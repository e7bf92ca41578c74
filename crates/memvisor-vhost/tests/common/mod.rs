//! A test frontend: guest memory in a memfd, a driver-side ring in it (memvisor's
//! `GuestRing`), eventfds, and a back end served on the other end of a socket pair.
#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::thread::JoinHandle;

use memvisor::{Backing, Gpa, SlotSpec, SlotTable};
use memvisor_testkit::guest_ring::{Desc, GuestRing, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::proto::{self, Region, VringAddr, protocol, req};
use memvisor_vhost::{Backend, Device};

pub const MIB: u64 = 1 << 20;
/// Where the "frontend" claims to have guest memory mapped.
pub const USER: u64 = 0x7f00_0000_0000;
pub const RING_AT: u64 = 0x1000;
pub const RING_SIZE: u16 = 16;

pub fn memfd(size: u64) -> File {
    memfd_named(size, c"vhost-test")
}

pub fn memfd_named(size: u64, name: &std::ffi::CStr) -> File {
    // SAFETY: valid C string, plain flags; the descriptor is owned by the File.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh descriptor.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).unwrap();
    f
}

pub fn eventfd() -> File {
    // SAFETY: plain flags; the descriptor is owned by the File.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fresh descriptor.
    unsafe { File::from_raw_fd(fd) }
}

/// The guest: its memory (the test's own mapping of the memfd) and a ring in it.
pub struct Guest {
    pub file: File,
    pub size: u64,
    pub mem: SlotTable,
    pub ring: GuestRing,
    pub kick: File,
    pub call: File,
}

impl Guest {
    pub fn new(size: u64) -> Guest {
        Guest::with_file(memfd(size), size)
    }

    pub fn with_file(file: File, size: u64) -> Guest {
        let dup = OwnedFd::from(file.try_clone().unwrap());
        let backing = Arc::new(Backing::from_fd(dup, 0, size).unwrap());
        let mem = SlotTable::new();
        mem.insert(SlotSpec::new(0, Gpa(0), backing)).unwrap();
        let ring = GuestRing::new(&mem, Gpa(RING_AT), RING_SIZE).unwrap();
        Guest {
            file,
            size,
            mem,
            ring,
            kick: eventfd(),
            call: eventfd(),
        }
    }

    pub fn region(&self) -> Region {
        Region {
            gpa: 0,
            size: self.size,
            user_addr: USER,
            mmap_offset: 0,
        }
    }

    pub fn vring_addr(&self) -> VringAddr {
        let n = u64::from(RING_SIZE);
        let desc = RING_AT;
        let avail = desc + 16 * n;
        let used = avail + (6 + 2 * n).next_multiple_of(4);
        VringAddr {
            index: 0,
            flags: 0,
            desc: USER + desc,
            used: USER + used,
            avail: USER + avail,
            log: 0,
        }
    }

    /// Posts a chain of (gpa, len, device-writable) buffers and kicks.
    pub fn post(&mut self, bufs: &[(u64, u32, bool)]) -> u16 {
        // Tests wait for each chain before posting the next: descriptors 0.. are free.
        let free: Vec<u16> = (0..bufs.len() as u16).collect();
        let descs: Vec<Desc> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, w))| Desc {
                addr,
                len,
                flags: if w { VRING_DESC_F_WRITE } else { 0 }
                    | if i + 1 < bufs.len() {
                        VRING_DESC_F_NEXT
                    } else {
                        0
                    },
                next: free.get(i + 1).copied().unwrap_or(0),
            })
            .collect();
        let head = self.ring.add_raw(&free, &descs).unwrap();
        self.ring.publish(head).unwrap();
        self.kick.write_all(&1u64.to_le_bytes()).unwrap();
        head
    }

    /// Makes available, without a kick, virtio-blk request `k` of a batch: a 16-byte header
    /// of `kind` (0 read, 1 write) for `sector` at `hdr`, one data buffer (`data`, `len`) and
    /// the status byte at `status` (set to 0xff first), in descriptors `3k`, `3k + 1`, `3k + 2`.
    /// Returns the head. [`Guest::kick`] then sends the batch.
    #[allow(dead_code)] // not every test binary posts batches
    #[allow(clippy::too_many_arguments)]
    pub fn add_request(
        &mut self,
        k: u16,
        kind: u32,
        sector: u64,
        hdr: u64,
        data: u64,
        len: u32,
        status: u64,
    ) -> u16 {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write(Gpa(hdr), &h).unwrap();
        self.mem.write(Gpa(status), &[0xff]).unwrap();
        let ids = [3 * k, 3 * k + 1, 3 * k + 2];
        let to_guest = if kind == 0 { VRING_DESC_F_WRITE } else { 0 };
        let descs = [
            Desc {
                addr: hdr,
                len: 16,
                flags: VRING_DESC_F_NEXT,
                next: ids[1],
            },
            Desc {
                addr: data,
                len,
                flags: VRING_DESC_F_NEXT | to_guest,
                next: ids[2],
            },
            Desc {
                addr: status,
                len: 1,
                flags: VRING_DESC_F_WRITE,
                next: 0,
            },
        ];
        let head = self.ring.add_raw(&ids, &descs).unwrap();
        self.ring.publish(head).unwrap();
        head
    }

    /// Kicks the ring: the device looks at what was made available.
    #[allow(dead_code)]
    pub fn kick(&mut self) {
        self.kick.write_all(&1u64.to_le_bytes()).unwrap();
    }

    /// Kicks requests `0..n` made available with [`Guest::add_request`] (the statuses of
    /// request `k` at `status + k`), waits for all `n` chains to come back, and returns their
    /// status bytes.
    #[allow(dead_code)]
    pub fn kick_and_wait(&mut self, n: u16, status: u64) -> Vec<u8> {
        self.kick();
        for _ in 0..n {
            self.wait_used();
        }
        (0..n)
            .map(|k| {
                let mut s = [0u8];
                self.mem.read(Gpa(status + u64::from(k)), &mut s).unwrap();
                s[0]
            })
            .collect()
    }

    /// Waits for the device to return a chain; returns (head, bytes written).
    pub fn wait_used(&mut self) -> (u16, u32) {
        for _ in 0..500 {
            if let Some(u) = self.ring.get_used().unwrap() {
                return u;
            }
            let mut p = libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            unsafe { libc::poll(&mut p, 1, 10) };
            if p.revents != 0 {
                let mut b = [0u8; 8];
                let _ = self.call.read(&mut b);
            }
        }
        panic!("the device did not return the chain within 5 s");
    }
}

/// Says "skipped: <what>" where the test runner shows it: on the process's real stderr (libtest
/// captures `println!` and `eprintln!` of passing tests, not a write to `io::stderr()`), in one
/// write so that tests running beside this one do not cut the line.
pub fn skipped(what: &str) {
    let _ = std::io::stderr().write_all(format!("skipped: {what}\n").as_bytes());
}

/// A blk request's 16-byte header: request type `kind`, `sector`.
pub fn blk_header(kind: u32, sector: u64) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(&kind.to_le_bytes());
    h[8..16].copy_from_slice(&sector.to_le_bytes());
    h
}

/// The byte of guest memory at guest address `at`.
pub fn byte_at(g: &Guest, at: u64) -> u8 {
    let mut s = [0u8];
    g.mem.read(Gpa(at), &mut s).unwrap();
    s[0]
}

/// A 1 MiB memfd image.
pub fn mib_disk() -> File {
    let f = memfd(MIB);
    f.set_len(MIB).unwrap();
    f
}

/// One 512-byte read of sector 0 through ring 0 (header at 0x10000, data at 0x20000, status at
/// 0x30000); returns its status byte.
pub fn read_one(g: &mut Guest) -> u8 {
    g.mem.write(Gpa(0x10000), &blk_header(0, 0)).unwrap();
    g.mem.write(Gpa(0x30000), &[0xff]).unwrap();
    g.post(&[
        (0x10000, 16, false),
        (0x20000, 512, true),
        (0x30000, 1, true),
    ]);
    g.wait_used();
    byte_at(g, 0x30000)
}

/// Mappings of the memfd named `name` in this process (from /proc/self/maps).
pub fn mappings_of(name: &str) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.contains(&format!("/memfd:{name} ")))
        .count()
}

/// A back end after its loop ended, and how it ended.
pub type Served<D> = (Backend<D>, memvisor_vhost::Result<()>);

/// A back end for `device` on one end of a socket pair, in its own thread; the thread returns
/// the back end and how its loop ended when the client side closes.
pub fn serve<D: Device + 'static>(device: D) -> (Client, JoinHandle<Served<D>>) {
    let (c, t, _) = serve_live(device);
    (c, t)
}

/// [`serve`], with the back end's live counters to read while it serves.
pub fn serve_live<D: Device + 'static>(
    device: D,
) -> (Client, JoinHandle<Served<D>>, memvisor_vhost::BackendLive) {
    let (a, b) = UnixStream::pair().unwrap();
    let mut backend = Backend::new(
        device,
        &memvisor_vhost::ProcessState::new(
            memvisor::SharedMappings::global(),
            memvisor::PinRegistry::global(),
        ),
    )
    .unwrap();
    let live = backend.live();
    let t = std::thread::spawn(move || {
        let stop = AtomicBool::new(false);
        let r = backend.run(&b, &stop);
        (backend, r)
    });
    (Client::from_stream(a), t, live)
}

/// Negotiates features and protocol features, sends the memory table and starts ring 0.
pub fn setup(c: &Client, g: &Guest) {
    negotiate(c, g);
    start_ring(c, g);
}

/// Features, protocol features and the memory table, no ring.
pub fn negotiate(c: &Client, g: &Guest) {
    negotiate_without(c, g, 0)
}

/// VHOST_F_LOG_ALL: the frontend logs dirty pages (migration).
#[allow(dead_code)]
pub const F_LOG_ALL: u64 = 1 << 26;

/// [`negotiate`] with the feature bits `clear` left out (e.g. [`F_LOG_ALL`], which keeps
/// registered buffers off).
pub fn negotiate_without(c: &Client, g: &Guest, clear: u64) {
    let f = c.get_u64(req::GET_FEATURES).unwrap() & !clear;
    c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[]).unwrap();
    let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
    assert_ne!(pf & protocol::REPLY_ACK, 0);
    c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
        .unwrap();
    let table = proto::mem_table_bytes(&[g.region()]);
    assert_eq!(
        c.ack(req::SET_MEM_TABLE, &table, &[g.file.as_raw_fd()])
            .unwrap(),
        0
    );
}

pub fn start_ring(c: &Client, g: &Guest) {
    start_ring_at(c, g, 0)
}

/// Starts the guest's ring as the device's queue `index`.
pub fn start_ring_at(c: &Client, g: &Guest, index: u32) {
    let st = |n: u32| proto::vring_state_bytes(index, n);
    let addr = VringAddr {
        index,
        ..g.vring_addr()
    };
    let i = u64::from(index);
    let ok = |request: u32, payload: &[u8], fds: &[i32]| {
        assert_eq!(
            c.ack(request, payload, fds).unwrap(),
            0,
            "{}",
            req::name(request)
        );
    };
    ok(req::SET_VRING_NUM, &st(RING_SIZE as u32), &[]);
    ok(req::SET_VRING_ADDR, &addr.bytes(), &[]);
    ok(req::SET_VRING_BASE, &st(0), &[]);
    ok(req::SET_VRING_CALL, &i.to_le_bytes(), &[g.call.as_raw_fd()]);
    ok(req::SET_VRING_KICK, &i.to_le_bytes(), &[g.kick.as_raw_fd()]);
    ok(req::SET_VRING_ENABLE, &st(1), &[]);
}

/// A request into a buffer that is taken away right after its kick, seen when the taking away
/// is acknowledged: it has ended whole (status 0, every byte `full`) or has not started
/// (status 0xff, the buffer still zeros). Returns whether it had ended.
pub fn ended_at_ack(round: u32, status: u8, data: &[u8], full: u8) -> bool {
    match status {
        0 => {
            assert!(data.iter().all(|&b| b == full), "round {round}: torn");
            true
        }
        0xff => {
            assert!(data.iter().all(|&b| b == 0), "round {round}: written");
            false
        }
        s => panic!("round {round}: status {s:#x} at the acknowledgement"),
    }
}

/// After the acknowledgement: the request's status did not change, or it failed if it had not
/// started, and the guard written into the buffer then is intact.
pub fn untouched_after_ack(round: u32, at_ack: u8, end: u8, data: &[u8], guard: u8) {
    assert!(
        end == at_ack || (at_ack == 0xff && end == 1),
        "round {round}: status {end:#x} after {at_ack:#x}"
    );
    assert!(
        data.iter().all(|&b| b == guard),
        "round {round}: the device wrote the buffer after it was taken away"
    );
}

// ---- locked-memory limits, for the tests that run the back end under RLIMIT_MEMLOCK

/// Drops CAP_IPC_LOCK from the calling thread's effective set; returns whether it had it.
pub fn drop_ipc_lock() -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget writes two Data words (version 3) into `data`, which we own.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    const IPC_LOCK: u32 = 1 << 14;
    if data[0].effective & IPC_LOCK == 0 {
        return false;
    }
    data[0].effective &= !IPC_LOCK;
    // SAFETY: capset reads the header and two Data words; it changes only this thread's set.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
    true
}

/// Sets RLIMIT_MEMLOCK's soft limit for the whole process (this binary runs this test alone).
pub fn set_memlock(bytes: u64) {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `rl`, setrlimit reads one.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl), 0);
        rl.rlim_cur = bytes.min(rl.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl), 0);
    }
}
