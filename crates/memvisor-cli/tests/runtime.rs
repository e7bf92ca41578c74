//! Devices that come, go and change size while a server runs (`blk-add`, `blk-del`,
//! `blk-resize`), end to end in this process: the server's [`Runtime`] behind a control socket,
//! a control client that sends the commands and reads the events, and the test kit's
//! vhost-user client as the frontend, which does I/O through the added disk, hears
//! `CONFIG_CHANGE_MSG` on its back-end channel and reads the new capacity with `GET_CONFIG`.
//! Needs no privilege.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use memvisor::{Backing, Gpa, PinRegistry, SharedMappings, SlotSpec, SlotTable};
use memvisor_cli::control::{self, Client as Control};
use memvisor_cli::runtime::Runtime;
use memvisor_cli::status::Registry;
use memvisor_testkit::guest_ring::{Desc, GuestRing, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::ProcessState;
use memvisor_vhost::image_lock::{self, Access, LockError, Locked, Locking};
use memvisor_vhost::proto::{self, Region, VringAddr, backend_req, protocol, req};
use serde_json::{Value, json};

const MEM: u64 = 1 << 20;
const USER: u64 = 0x7f00_0000_0000;
const RING_AT: u64 = 0x1000;
const RING_SIZE: u16 = 16;
const HDR: u64 = 0x10000;
const DATA: u64 = 0x20000;
const STATUS: u64 = 0x80000;
const MIB: u64 = 1 << 20;
const WAIT: Duration = Duration::from_secs(10);

struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("memvisor-rt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Dir(d)
    }
    fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
    fn image(&self, name: &str, len: u64) -> PathBuf {
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

/// A server with no device at start and a control socket, in this process.
struct Server {
    runtime: Arc<Runtime>,
    stop: Arc<AtomicBool>,
    control: Option<std::thread::JoinHandle<()>>,
    ctl: PathBuf,
}

impl Server {
    fn start(dir: &Dir, state: &ProcessState) -> Server {
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
        Server {
            runtime,
            stop,
            control: Some(control),
            ctl,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.control.take() {
            let _ = t.join();
        }
        let _ = self.runtime.finish();
    }
}

fn state() -> ProcessState {
    ProcessState::new(SharedMappings::global(), PinRegistry::global())
}

fn eventfd() -> File {
    // SAFETY: plain flags; the descriptor is owned by the File.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor, owned by nothing else.
    unsafe { File::from_raw_fd(fd) }
}

/// The guest side: 1 MiB of memory in a memfd and one ring in it.
struct Guest {
    file: File,
    mem: SlotTable,
    ring: GuestRing,
    kick: File,
    call: File,
}

impl Guest {
    fn new() -> Guest {
        // SAFETY: a constant C string; the result is checked.
        let fd = unsafe { libc::memfd_create(c"rt-guest".as_ptr(), libc::MFD_CLOEXEC) };
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

    /// Features (all protocol features offered, `CONFIG` and `BACKEND_REQ` among them), the
    /// back-end channel, memory table, ring 0: what QEMU sends before the driver runs. Returns
    /// the frontend's end of the back-end channel.
    fn connect(&self, c: &Client) -> UnixStream {
        let f = c.get_u64(req::GET_FEATURES).unwrap();
        c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[]).unwrap();
        let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
        let wanted = protocol::CONFIG | protocol::BACKEND_REQ | protocol::REPLY_ACK;
        assert_eq!(pf & wanted, wanted, "the blk back end offers CONFIG");
        c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
            .unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        assert_eq!(
            c.ack(req::SET_BACKEND_REQ_FD, &[], &[theirs.as_raw_fd()])
                .unwrap(),
            0
        );
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
        ours
    }

    /// One request of `kind` (0 read, 1 write) at `sector` over 4 KiB at DATA; its status.
    fn request(&mut self, kind: u32, sector: u64) -> u8 {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&kind.to_le_bytes());
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write(Gpa(HDR), &h).unwrap();
        self.mem.write(Gpa(STATUS), &[0xff]).unwrap();
        let bufs = [(HDR, 16, false), (DATA, 4096, kind == 0), (STATUS, 1, true)];
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
            assert!(t0.elapsed() < WAIT, "no completion");
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

/// The capacity in the device's config space, in sectors.
fn capacity(c: &Client) -> u64 {
    let cfg = c
        .get(req::GET_CONFIG, &proto::config_bytes(0, 0, &[0; 8]))
        .unwrap();
    u64::from_le_bytes(cfg[12..20].try_into().unwrap())
}

/// The next message on the back-end channel within `wait`: its request number.
fn backend_message(ch: &UnixStream, wait: Duration) -> Option<u32> {
    ch.set_read_timeout(Some(wait)).unwrap();
    let mut h = [0u8; 12];
    (&*ch).read_exact(&mut h).ok()?;
    Some(u32::from_le_bytes(h[0..4].try_into().unwrap()))
}

/// The next event named `name`, skipping others.
fn event(c: &mut Control, name: &str) -> Value {
    let t0 = Instant::now();
    loop {
        let left = WAIT.saturating_sub(t0.elapsed());
        let e = c
            .next_event(left)
            .unwrap_or_else(|e| panic!("no {name}: {e}"));
        if e["event"] == name {
            return e["data"].clone();
        }
    }
}

/// Whether another program could take the image's write locks now (QEMU's bytes, as the
/// server takes them): `Ok(true)` free, `Ok(false)` held by someone, `Err` where the file
/// system has no such locks.
fn lock_free(image: &Path) -> Result<bool, String> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .unwrap();
    match image_lock::lock(&f, image, Access::disk(false), Locking::default()) {
        Ok(Locked::Held) => Ok(true),
        Ok(other) => Err(format!("{other:?}")),
        Err(LockError::Conflict { .. }) => Ok(false),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn a_disk_added_at_run_time_serves_io_resizes_and_deletes_releasing_everything() {
    let dir = Dir::new("life");
    let server = Server::start(&dir, &state());
    let mut ctl = Control::connect(&server.ctl).unwrap();
    let (sock, disk) = (dir.join("d1.sock"), dir.image("d1.img", 4 * MIB));
    File::options()
        .write(true)
        .open(&disk)
        .unwrap()
        .write_all_at(&[0x5a; 4096], 8 * 512)
        .unwrap();

    // No device at start; one added.
    assert_eq!(ctl.execute("query-devices", json!({})).unwrap(), json!([]));
    let add = json!({"id": "d1", "socket": sock, "disk": disk, "format": "raw"});
    assert_eq!(ctl.execute("blk-add", add.clone()).unwrap(), json!({}));
    let added = event(&mut ctl, "DEVICE_ADDED");
    assert_eq!(added["id"], "d1");
    assert_eq!(added["type"], "vhost-user-blk");
    let info = ctl.execute("query-devices", json!({})).unwrap();
    assert_eq!(info[0]["size"], 4 * MIB);
    // The same id, the same socket, the same image (its locks) are each refused, by name.
    let e = ctl.execute("blk-add", add.clone()).unwrap_err().to_string();
    assert!(e.contains("\"d1\""), "{e}");
    let other = dir.join("d2.sock");
    let e = ctl
        .execute("blk-add", json!({"id": "d2", "socket": sock, "disk": disk}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("d1.sock"), "{e}");
    let e = ctl
        .execute(
            "blk-add",
            json!({"id": "d2", "socket": other, "disk": disk}),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("d1.img"), "{e}");
    assert!(!other.exists(), "a refused add leaves no socket");
    let e = ctl
        .execute(
            "blk-add",
            json!({"id": "d2", "socket": other, "disk": disk, "queues": 0}),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("queues"), "{e}");
    let lock_works = lock_free(&disk);
    if let Ok(free) = &lock_works {
        assert!(!free, "the served image's locks are held");
    }

    // A frontend does I/O through it.
    let mut g = Guest::new();
    let frontend = Client::connect(&sock).unwrap();
    assert_eq!(event(&mut ctl, "FRONTEND_CONNECTED")["device"], "d1");
    let channel = g.connect(&frontend);
    assert_eq!(g.request(0, 8), 0, "read");
    let mut got = [0u8; 4096];
    g.mem.read(Gpa(DATA), &mut got).unwrap();
    assert_eq!(got, [0x5a; 4096]);
    g.mem.write(Gpa(DATA), &[0xa5; 4096]).unwrap();
    assert_eq!(g.request(1, 64), 0, "write");
    let mut on_disk = [0u8; 4096];
    File::open(&disk)
        .unwrap()
        .read_exact_at(&mut on_disk, 64 * 512)
        .unwrap();
    assert_eq!(on_disk, [0xa5; 4096]);

    // Grown: the frontend hears it, reads the new capacity, and I/O past the old end works.
    assert_eq!(capacity(&frontend), 4 * MIB / 512);
    let last_old = 4 * MIB / 512 + 8;
    assert_eq!(g.request(1, last_old), 1, "past the end: IOERR");
    ctl.execute("blk-resize", json!({"id": "d1", "size": 8 * MIB}))
        .unwrap();
    let r = event(&mut ctl, "DEVICE_RESIZED");
    assert_eq!(
        r,
        json!({"id": "d1", "size": 8 * MIB, "told-frontend": true})
    );
    assert_eq!(
        backend_message(&channel, WAIT),
        Some(backend_req::CONFIG_CHANGE_MSG)
    );
    assert_eq!(capacity(&frontend), 8 * MIB / 512);
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 8 * MIB);
    assert_eq!(g.request(1, last_old), 0, "inside the new end");
    // Shrunk below that: refused again.
    ctl.execute("blk-resize", json!({"id": "d1", "size": 2 * MIB}))
        .unwrap();
    event(&mut ctl, "DEVICE_RESIZED");
    assert_eq!(
        backend_message(&channel, WAIT),
        Some(backend_req::CONFIG_CHANGE_MSG)
    );
    assert_eq!(capacity(&frontend), 2 * MIB / 512);
    assert_eq!(g.request(0, last_old), 1, "past the new end: IOERR");
    // Bad sizes are named, nothing changes.
    for bad in [json!(0), json!(1000), json!(-512), json!("1M")] {
        let e = ctl
            .execute("blk-resize", json!({"id": "d1", "size": bad}))
            .unwrap_err()
            .to_string();
        assert!(e.contains(&bad.to_string()), "{e}");
    }
    let e = ctl
        .execute("blk-resize", json!({"id": "nope"}))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("DeviceNotFound") && e.contains("nope"), "{e}");
    assert_eq!(capacity(&frontend), 2 * MIB / 512);
    // Without a size: the length is read again (another program grew the file).
    File::options()
        .write(true)
        .open(&disk)
        .unwrap()
        .set_len(3 * MIB)
        .unwrap();
    ctl.execute("blk-resize", json!({"id": "d1"})).unwrap();
    assert_eq!(event(&mut ctl, "DEVICE_RESIZED")["size"], 3 * MIB);
    assert_eq!(capacity(&frontend), 3 * MIB / 512);

    // Deleting is refused while the frontend is there, naming the device; forced, it
    // disconnects the frontend and releases the socket and the image.
    let e = ctl
        .execute("blk-del", json!({"id": "d1"}))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("GenericError") && e.contains("\"d1\""), "{e}");
    assert!(sock.exists());
    ctl.execute("blk-del", json!({"id": "d1", "force": true}))
        .unwrap();
    // The command answers once everything is released.
    assert!(!sock.exists(), "the socket path is removed");
    match lock_works {
        Ok(_) => assert_eq!(lock_free(&disk), Ok(true), "the image's locks are free"),
        Err(why) => println!("skipped: image lock check: {why}"),
    }
    assert_eq!(event(&mut ctl, "FRONTEND_DISCONNECTED")["device"], "d1");
    assert_eq!(event(&mut ctl, "DEVICE_DELETED"), json!({"id": "d1"}));
    // The frontend sees its connection closed.
    frontend.socket().set_read_timeout(Some(WAIT)).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(frontend.socket().read(&mut b).unwrap(), 0);
    assert_eq!(ctl.execute("query-devices", json!({})).unwrap(), json!([]));
    let pins = ctl.execute("query-stats", json!({})).unwrap();
    assert_eq!(pins["devices"], json!([]));

    // The same image and socket can be served again at once.
    ctl.execute("blk-add", add).unwrap();
    assert_eq!(event(&mut ctl, "DEVICE_ADDED")["id"], "d1");
    ctl.execute("blk-del", json!({"id": "d1"})).unwrap();
    assert!(!sock.exists());
}

#[test]
fn a_resize_with_no_frontend_or_one_without_config_is_not_told() {
    let dir = Dir::new("untold");
    let server = Server::start(&dir, &state());
    let mut ctl = Control::connect(&server.ctl).unwrap();
    let (sock, disk) = (dir.join("d.sock"), dir.image("d.img", MIB));
    ctl.execute("blk-add", json!({"id": "d", "socket": sock, "disk": disk}))
        .unwrap();
    ctl.execute("blk-resize", json!({"id": "d", "size": 2 * MIB}))
        .unwrap();
    let r = event(&mut ctl, "DEVICE_RESIZED");
    assert_eq!(
        r,
        json!({"id": "d", "size": 2 * MIB, "told-frontend": false})
    );
    // A frontend that negotiated no protocol features: not told either, and the capacity is
    // right when it reads it.
    let frontend = Client::connect(&sock).unwrap();
    event(&mut ctl, "FRONTEND_CONNECTED");
    let f = frontend.get_u64(req::GET_FEATURES).unwrap();
    frontend
        .send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[])
        .unwrap();
    ctl.execute("blk-resize", json!({"id": "d", "size": 3 * MIB}))
        .unwrap();
    assert_eq!(event(&mut ctl, "DEVICE_RESIZED")["told-frontend"], false);
    assert_eq!(capacity(&frontend), 3 * MIB / 512);
}

/// `MEMVISOR_TEST_SILENT_RESIZE`: the capacity changes, no message goes out, and the event
/// still says the frontend was told (what the real-guest trial's negative control relies on).
#[cfg(feature = "test-hooks")]
#[test]
fn the_silent_resize_fault_changes_the_capacity_and_tells_no_one() {
    let dir = Dir::new("silent");
    let faults = memvisor::faults::Faults {
        silent_resize: true,
        ..Default::default()
    };
    let server = Server::start(&dir, &state().with_faults(faults));
    let mut ctl = Control::connect(&server.ctl).unwrap();
    let (sock, disk) = (dir.join("d.sock"), dir.image("d.img", MIB));
    ctl.execute("blk-add", json!({"id": "d", "socket": sock, "disk": disk}))
        .unwrap();
    let g = Guest::new();
    let frontend = Client::connect(&sock).unwrap();
    let channel = g.connect(&frontend);
    ctl.execute("blk-resize", json!({"id": "d", "size": 2 * MIB}))
        .unwrap();
    let r = event(&mut ctl, "DEVICE_RESIZED");
    assert_eq!(r["told-frontend"], true);
    assert_eq!(backend_message(&channel, Duration::from_secs(1)), None);
    assert_eq!(capacity(&frontend), 2 * MIB / 512);
}

/// The binary: `memvisor serve` starts with only a control socket and takes disks then;
/// `memvisor vhost-user-blk` resizes its one disk and refuses to add another.
#[test]
fn the_servers_take_the_run_time_commands() {
    const BIN: &str = env!("CARGO_BIN_EXE_memvisor");
    let dir = Dir::new("bin");
    let (ctl, sock, disk) = (
        dir.join("serve.ctl"),
        dir.join("d.sock"),
        dir.image("d.img", MIB),
    );
    let wait_for = |p: &Path| {
        let t0 = Instant::now();
        while !p.exists() {
            assert!(t0.elapsed() < WAIT, "{p:?} never appeared");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let stop = |mut child: std::process::Child| {
        // SAFETY: a signal to the child this test started.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
        assert!(child.wait().unwrap().success());
    };
    let serve = std::process::Command::new(BIN)
        .args(["serve", "--control"])
        .arg(&ctl)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&ctl);
    let mut c = Control::connect(&ctl).unwrap();
    c.execute("blk-add", json!({"socket": sock, "disk": disk}))
        .unwrap();
    assert_eq!(event(&mut c, "DEVICE_ADDED")["id"], "blk0");
    assert!(sock.exists());
    c.execute("blk-resize", json!({"id": "blk0", "size": 2 * MIB}))
        .unwrap();
    assert_eq!(event(&mut c, "DEVICE_RESIZED")["size"], 2 * MIB);
    stop(serve);
    assert!(!sock.exists() && !ctl.exists());

    let ctl = dir.join("blk.ctl");
    let blk = std::process::Command::new(BIN)
        .arg("vhost-user-blk")
        .arg("--socket-path")
        .arg(&sock)
        .arg("--disk")
        .arg(&disk)
        .arg("--control")
        .arg(&ctl)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&ctl);
    let mut c = Control::connect(&ctl).unwrap();
    c.execute("blk-resize", json!({"id": "blk0", "size": 3 * MIB}))
        .unwrap();
    assert_eq!(event(&mut c, "DEVICE_RESIZED")["size"], 3 * MIB);
    let e = c
        .execute(
            "blk-add",
            json!({"socket": dir.join("x.sock"), "disk": disk}),
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("one device"), "{e}");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), 3 * MIB);
    stop(blk);
}
