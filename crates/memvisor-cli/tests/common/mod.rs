//! What the CLI's integration tests share: a scratch directory of their own, a server binary
//! started quietly and killed on drop, waiting for its sockets, a test guest (a memfd with one
//! ring in it) that a vhost-user frontend drives, and a server with a control socket run in
//! the test's own process. Each test binary uses only some of these.
#![allow(dead_code)]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use memvisor::{Backing, Gpa, SlotSpec, SlotTable};
use memvisor_cli::control;
use memvisor_cli::runtime::Runtime;
use memvisor_cli::status::Registry;
use memvisor_testkit::guest_ring::{Desc, GuestRing, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::ProcessState;
use memvisor_vhost::proto::{self, Region, VringAddr, req};

/// The `memvisor` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_memvisor");
pub const MIB: u64 = 1 << 20;
/// The test guest's memory size.
pub const MEM: u64 = 1 << 20;
/// Where the frontend claims to have guest memory mapped.
pub const USER: u64 = 0x7f00_0000_0000;
pub const RING_AT: u64 = 0x1000;
pub const RING_SIZE: u16 = 16;
/// Where a request's header, data and status byte sit in guest memory.
pub const HDR: u64 = 0x10000;
pub const DATA: u64 = 0x20000;
pub const STATUS: u64 = 0x80000;

/// A fresh directory under the temporary directory, removed on drop. Named after the test and
/// the process, so tests of one binary and test binaries running side by side never share one.
pub struct Dir(PathBuf);

impl Dir {
    pub fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("memvisor-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }

    pub fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }

    /// A 16 MiB raw image.
    pub fn disk(&self) -> PathBuf {
        self.image("disk.img", 16 << 20)
    }

    /// A raw image `name` of `len` bytes.
    pub fn image(&self, name: &str, len: u64) -> PathBuf {
        let p = self.join(name);
        File::create(&p).unwrap().set_len(len).unwrap();
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A server process, killed if a test fails before it stops it.
pub struct Server(pub Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Server {
    /// `cmd` started with warnings only in its log and its output dropped.
    pub fn quiet(cmd: &mut Command) -> Server {
        Server(
            cmd.env("RUST_LOG", "warn")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        )
    }

    /// Waits for the process to end by itself; its exit status's success.
    pub fn wait_exit(&mut self, within: Duration) -> bool {
        let t0 = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status.success();
            }
            assert!(
                t0.elapsed() < within,
                "the server did not stop within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Waits (20 s at most) until `path` exists.
pub fn wait_for(path: &Path) {
    let t0 = Instant::now();
    while !path.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{path:?} never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn eventfd() -> File {
    // SAFETY: plain flags; the descriptor is owned by the File.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor, owned by nothing else.
    unsafe { File::from_raw_fd(fd) }
}

/// The guest side: 1 MiB of memory in a memfd and one ring in it.
pub struct Guest {
    pub file: File,
    pub mem: SlotTable,
    pub ring: GuestRing,
    pub kick: File,
    pub call: File,
}

impl Guest {
    pub fn new() -> Guest {
        // SAFETY: a constant C string; the result is checked.
        let fd = unsafe { libc::memfd_create(c"cli-test-guest".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor, owned by nothing else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(MEM).unwrap();
        let backing =
            Arc::new(Backing::from_fd(OwnedFd::from(file.try_clone().unwrap()), 0, MEM).unwrap());
        let mem = SlotTable::new();
        mem.insert(SlotSpec::new(0, Gpa(0), backing)).unwrap();
        let ring = GuestRing::new(&mem, Gpa(RING_AT), RING_SIZE).unwrap();
        Guest {
            file,
            mem,
            ring,
            kick: eventfd(),
            call: eventfd(),
        }
    }

    /// The memory table and ring 0, set up and enabled: what QEMU sends once features are
    /// agreed, before the driver runs.
    pub fn map_and_start_ring(&self, c: &Client) {
        let region = Region {
            gpa: 0,
            size: MEM,
            user_addr: USER,
            mmap_offset: 0,
        };
        let table = proto::mem_table_bytes(&[region]);
        assert_eq!(
            c.ack(req::SET_MEM_TABLE, &table, &[self.file.as_raw_fd()])
                .unwrap(),
            0
        );
        let n = u64::from(RING_SIZE);
        let avail = RING_AT + 16 * n;
        let addr = VringAddr {
            index: 0,
            flags: 0,
            desc: USER + RING_AT,
            avail: USER + avail,
            used: USER + avail + (6 + 2 * n).next_multiple_of(4),
            log: 0,
        };
        let st = |v: u32| proto::vring_state_bytes(0, v);
        for (r, p, fds) in [
            (
                req::SET_VRING_NUM,
                st(u32::from(RING_SIZE)).to_vec(),
                vec![],
            ),
            (req::SET_VRING_ADDR, addr.bytes().to_vec(), vec![]),
            (req::SET_VRING_BASE, st(0).to_vec(), vec![]),
            (
                req::SET_VRING_CALL,
                0u64.to_le_bytes().to_vec(),
                vec![self.call.as_raw_fd()],
            ),
            (
                req::SET_VRING_KICK,
                0u64.to_le_bytes().to_vec(),
                vec![self.kick.as_raw_fd()],
            ),
            (req::SET_VRING_ENABLE, st(1).to_vec(), vec![]),
        ] {
            assert_eq!(c.ack(r, &p, &fds).unwrap(), 0, "{}", req::name(r));
        }
    }

    /// One request of `kind` at `sector` over `len` bytes at DATA; returns its status.
    pub fn request(&mut self, kind: u32, sector: u64, len: u32) -> u8 {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write(Gpa(HDR), &h).unwrap();
        self.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        // IN (0) and GET_ID (8): the device writes the data buffer.
        let to_guest = kind == 0 || kind == 8;
        let bufs = [(HDR, 16, false), (DATA, len, to_guest), (STATUS, 1, true)];
        let descs: Vec<Desc> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, w))| Desc {
                addr,
                len,
                flags: if w { VRING_DESC_F_WRITE } else { 0 }
                    | if i < 2 { VRING_DESC_F_NEXT } else { 0 },
                next: i as u16 + 1,
            })
            .collect();
        let head = self.ring.add_raw(&[0, 1, 2], &descs).unwrap();
        self.ring.publish(head).unwrap();
        self.kick.write_all(&1u64.to_le_bytes()).unwrap();
        let t0 = Instant::now();
        while self.ring.get_used().unwrap().is_none() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no completion");
            let mut b = [0u8; 8];
            let mut p = libc::pollfd {
                fd: self.call.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            if unsafe { libc::poll(&mut p, 1, 10) } > 0 {
                let _ = self.call.read(&mut b);
            }
        }
        let mut s = [0u8];
        self.mem.read(Gpa(STATUS), &mut s).unwrap();
        s[0]
    }
}

/// A server with no device at start and a control socket, in this process.
pub struct InProcess {
    pub runtime: Arc<Runtime>,
    stop: Arc<AtomicBool>,
    control: Option<std::thread::JoinHandle<()>>,
    pub ctl: PathBuf,
}

impl InProcess {
    pub fn start(dir: &Dir, state: &ProcessState) -> InProcess {
        let ctl = dir.join("ctl.sock");
        let registry = Arc::new(Registry::new(state.registry.clone()));
        let runtime = Arc::new(Runtime::new(
            registry.clone(),
            state,
            false,
            true,
            vec![ctl.clone()],
        ));
        let listener = memvisor_cli::listener::at(&ctl).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (handler, events, flag) = (runtime.clone(), registry.events.clone(), stop.clone());
        let control = std::thread::spawn(move || {
            control::serve(&listener.socket, handler, events, &flag).unwrap();
        });
        InProcess {
            runtime,
            stop,
            control: Some(control),
            ctl,
        }
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.control.take() {
            let _ = t.join();
        }
        let _ = self.runtime.finish();
    }
}
