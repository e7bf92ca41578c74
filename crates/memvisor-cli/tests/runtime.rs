//! Devices that come, go and change size while a server runs (`blk-add`, `blk-del`,
//! `blk-resize`), end to end in this process: the server's [`Runtime`] behind a control socket,
//! a control client that sends the commands and reads the events, and the test kit's
//! vhost-user client as the frontend, which does I/O through the added disk, hears
//! `CONFIG_CHANGE_MSG` on its back-end channel and reads the new capacity with `GET_CONFIG`.
//! Needs no privilege.

mod common;

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{BIN, DATA, Dir, Guest, InProcess, MIB, Server, wait_for};
use memvisor::{Gpa, PinRegistry, SharedMappings};
use memvisor_cli::control::Client as Control;
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::ProcessState;
use memvisor_vhost::image_lock::{self, Access, LockError, Locked, Locking};
use memvisor_vhost::proto::{self, backend_req, protocol, req};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(10);

fn state() -> ProcessState {
    ProcessState::new(SharedMappings::global(), PinRegistry::global())
}

impl Guest {
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
        self.map_and_start_ring(c);
        ours
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
    let server = InProcess::start(&dir, &state());
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
    assert_eq!(g.request(0, 8, 4096), 0, "read");
    let mut got = [0u8; 4096];
    g.mem.read(Gpa(DATA), &mut got).unwrap();
    assert_eq!(got, [0x5a; 4096]);
    g.mem.write(Gpa(DATA), &[0xa5; 4096]).unwrap();
    assert_eq!(g.request(1, 64, 4096), 0, "write");
    let mut on_disk = [0u8; 4096];
    File::open(&disk)
        .unwrap()
        .read_exact_at(&mut on_disk, 64 * 512)
        .unwrap();
    assert_eq!(on_disk, [0xa5; 4096]);

    // Grown: the frontend hears it, reads the new capacity, and I/O past the old end works.
    assert_eq!(capacity(&frontend), 4 * MIB / 512);
    let last_old = 4 * MIB / 512 + 8;
    assert_eq!(g.request(1, last_old, 4096), 1, "past the end: IOERR");
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
    assert_eq!(g.request(1, last_old, 4096), 0, "inside the new end");
    // Shrunk below that: refused again.
    ctl.execute("blk-resize", json!({"id": "d1", "size": 2 * MIB}))
        .unwrap();
    event(&mut ctl, "DEVICE_RESIZED");
    assert_eq!(
        backend_message(&channel, WAIT),
        Some(backend_req::CONFIG_CHANGE_MSG)
    );
    assert_eq!(capacity(&frontend), 2 * MIB / 512);
    assert_eq!(g.request(0, last_old, 4096), 1, "past the new end: IOERR");
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
    let server = InProcess::start(&dir, &state());
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

/// A size no file can have (2^63 bytes, a whole number of sectors) is refused naming it, and
/// the device keeps its size.
#[test]
fn a_resize_past_what_a_file_can_hold_names_the_size() {
    let dir = Dir::new("huge");
    let server = InProcess::start(&dir, &state());
    let mut ctl = Control::connect(&server.ctl).unwrap();
    let (sock, disk) = (dir.join("d.sock"), dir.image("d.img", MIB));
    ctl.execute("blk-add", json!({"id": "d", "socket": sock, "disk": disk}))
        .unwrap();
    let e = ctl
        .execute("blk-resize", json!({"id": "d", "size": 1u64 << 63}))
        .unwrap_err()
        .to_string();
    assert!(e.contains(&(1u64 << 63).to_string()), "{e}");
    assert_eq!(std::fs::metadata(&disk).unwrap().len(), MIB);
    let info = ctl.execute("query-devices", json!({})).unwrap();
    assert_eq!(info[0]["size"], MIB, "{info}");
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
    let server = InProcess::start(&dir, &state().with_faults(faults));
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
    let dir = Dir::new("bin");
    let (ctl, sock, disk) = (
        dir.join("serve.ctl"),
        dir.join("d.sock"),
        dir.image("d.img", MIB),
    );
    let stop = |mut server: Server| {
        let pid = server.0.id() as i32;
        // SAFETY: a signal to the child this test started.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        assert!(server.0.wait().unwrap().success());
    };
    let serve = Server::quiet(Command::new(BIN).args(["serve", "--control"]).arg(&ctl));
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
    let blk = Server::quiet(
        Command::new(BIN)
            .arg("vhost-user-blk")
            .arg("--socket-path")
            .arg(&sock)
            .arg("--disk")
            .arg(&disk)
            .arg("--control")
            .arg(&ctl),
    );
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
