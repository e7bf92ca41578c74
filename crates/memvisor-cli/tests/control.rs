//! The control socket of a running `memvisor serve`, end to end: a test frontend drives the
//! blk device through vhost-user while a control client asks the server what it is doing.
//! Needs no privilege (a few pages are pinned, well inside the default locked-memory limit).

mod common;

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, DATA, Dir, Guest, Server, wait_for};
use memvisor::Gpa;
use memvisor_cli::control::Client as Control;
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::proto::req;
use serde_json::{Value, json};

/// Features and ring 0: what QEMU sends before the driver runs.
impl Guest {
    fn connect(&self, c: &Client) {
        let f = c.get_u64(req::GET_FEATURES).unwrap();
        c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[]).unwrap();
        let pf = c.get_u64(req::GET_PROTOCOL_FEATURES).unwrap();
        c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])
            .unwrap();
        self.map_and_start_ring(c);
    }
}

fn device<'a>(stats: &'a Value, id: &str) -> &'a Value {
    stats["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {stats}"))
}

#[test]
fn a_running_server_reports_its_devices_live_and_takes_commands() {
    let dir = Dir::new("live");
    let (blk, balloon, ctl, stats) = (
        dir.join("blk.sock"),
        dir.join("balloon.sock"),
        dir.join("ctl.sock"),
        dir.join("stats.json"),
    );
    let disk = dir.join("disk.img");
    let image = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&disk)
        .unwrap();
    image.set_len(4 << 20).unwrap();
    image.write_all_at(&[0x5a; 4096], 8 * 512).unwrap();
    let server = Server::quiet(
        Command::new(BIN)
            .arg("serve")
            .arg("--blk")
            .arg(format!(
                "socket={},disk={},serial=d0,id=root",
                blk.display(),
                disk.display()
            ))
            .arg("--balloon")
            .arg(format!("{},stats-interval=1", balloon.display()))
            .arg("--control")
            .arg(&ctl)
            .arg("--stats")
            .arg(&stats),
    );
    wait_for(&ctl);
    let mut control = Control::connect(&ctl).unwrap();
    let commands = &control.execute("query-commands", json!({})).unwrap();
    assert!(
        commands
            .as_array()
            .unwrap()
            .contains(&json!({"name": "query-stats"})),
        "{commands}"
    );

    // What the server serves, as it was set up.
    let devices = control.execute("query-devices", json!({})).unwrap();
    assert_eq!(devices[0]["id"], "root");
    assert_eq!(devices[0]["type"], "vhost-user-blk");
    assert_eq!(
        (&devices[0]["serial"], &devices[0]["queues"]),
        (&json!("d0"), &json!(1))
    );
    assert_eq!(devices[1]["id"], "balloon0");
    assert_eq!(devices[1]["stats-interval"], 1);
    assert_eq!(devices[0]["connected"], false);

    // A frontend connects: an event, then requests the counters show while it is still there.
    let mut g = Guest::new();
    let frontend = Client::connect(&blk).unwrap();
    let event = control.next_event(Duration::from_secs(10)).unwrap();
    assert_eq!(event["event"], "FRONTEND_CONNECTED");
    assert_eq!(event["data"]["device"], "root");
    g.connect(&frontend);
    assert_eq!(g.request(0, 8, 4096), 0, "read");
    let mut got = [0u8; 4096];
    g.mem.read(Gpa(DATA), &mut got).unwrap();
    assert_eq!(got, [0x5a; 4096]);
    g.mem.write(Gpa(DATA), &[0xa5; 4096]).unwrap();
    assert_eq!(g.request(1, 64, 4096), 0, "write");
    assert_eq!(g.request(1, 1 << 40, 4096), 1, "a write past the end fails");

    let s = control
        .execute("query-stats", json!({"device": "root"}))
        .unwrap();
    assert_eq!(
        s["devices"].as_array().unwrap().len(),
        1,
        "one device asked for"
    );
    let root = device(&s, "root");
    assert_eq!(root["connected"], true);
    let b = &root["blk"];
    assert_eq!(
        (&b["reads"], &b["writes"], &b["failed"]),
        (&json!(1), &json!(1), &json!(1))
    );
    assert_eq!(
        (&b["bytes_read"], &b["bytes_written"]),
        (&json!(4096), &json!(4096))
    );
    assert_eq!(b["pinned_pages"], 0, "nothing pinned between requests");
    assert_eq!(root["queues"][0]["blk"]["reads"], 1, "per queue");
    assert_eq!(root["queues"][0]["running"], true);
    assert!(root["queues"][0]["kicks"].as_u64().unwrap() >= 3);
    assert!(root["backend"]["messages"].as_u64().unwrap() >= 10);
    assert!(s["process"]["pins"]["check"]["held_bytes"].is_u64());
    let mut on_disk = [0u8; 4096];
    image.read_exact_at(&mut on_disk, 64 * 512).unwrap();
    assert_eq!(on_disk, [0xa5; 4096]);

    // SIGUSR1: the --stats report, written now, the server going on.
    // SAFETY: a signal to the child this test started.
    let sent = unsafe { libc::kill(server.0.id() as i32, libc::SIGUSR1) };
    assert_eq!(sent, 0);
    wait_for(&stats);
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(
        (&report["blk"][0]["reads"], &report["blk"][0]["writes"]),
        (&json!(1), &json!(1))
    );
    assert_eq!(report["balloon"][0]["stats_interval_secs"], 1);

    // The balloon's target, set by command, seen in its live status; bad arguments refused.
    let set = control
        .execute("balloon-set-target", json!({"target-mib": 64}))
        .unwrap();
    assert_eq!(set, json!({"devices": ["balloon0"], "target_pages": 16384}));
    let r = control
        .execute("query-stats", json!({"device": "balloon0"}))
        .unwrap();
    assert_eq!(device(&r, "balloon0")["type"], "vhost-user-balloon");
    let report: Value = {
        // SAFETY: as above.
        unsafe { libc::kill(server.0.id() as i32, libc::SIGUSR1) };
        let t0 = Instant::now();
        loop {
            let text = std::fs::read_to_string(&stats).unwrap_or_default();
            let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            if v["balloon"][0]["target_pages"] == 16384 {
                break v;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "target not in the report: {v}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert_eq!(report["balloon"][0]["target_pages"], 16384);
    for (command, args, says) in [
        (
            "balloon-set-target",
            json!({"target-mib": -1}),
            "\"target-mib\" is -1",
        ),
        (
            "balloon-set-target",
            json!({"target-mib": 1 << 24}),
            "0 to 16777215",
        ),
        ("balloon-set-target", json!({}), "needs \"target-mib\""),
        (
            "balloon-set-target",
            json!({"target-mib": 1, "device": "root"}),
            "not a balloon",
        ),
        (
            "query-stats",
            json!({"device": "nope"}),
            "DeviceNotFound: no device \"nope\"",
        ),
        (
            "query-stats",
            json!({"device": 3}),
            "must be a device id string",
        ),
        ("reboot", json!({}), "CommandNotFound"),
    ] {
        let e = control.execute(command, args).unwrap_err().to_string();
        assert!(e.contains(says), "{command}: {e}");
    }

    // The frontend leaves: an event, and the device shows it.
    drop(frontend);
    let event = control.next_event(Duration::from_secs(10)).unwrap();
    assert_eq!(event["event"], "FRONTEND_DISCONNECTED");
    assert_eq!(event["data"]["device"], "root");
    let s = control.execute("query-stats", json!({})).unwrap();
    assert_eq!(device(&s, "root")["connected"], false);
    assert_eq!(device(&s, "root")["queues"][0]["running"], false);

    // `memvisor ctl`, the command-line client, runs a command and waits for an event.
    let out = Command::new(BIN)
        .args(["ctl", "--control"])
        .arg(&ctl)
        .args(["query-stats", "device=root"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(device(&v, "root")["blk"]["writes"], 1);
    let mut waiter = Command::new(BIN)
        .args(["ctl", "--control"])
        .arg(&ctl)
        .args(["--wait-event", "FRONTEND_CONNECTED", "--timeout", "20"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Frontends come and go until the waiter, once connected, has seen one arrive.
    let t0 = Instant::now();
    let status = loop {
        drop(Client::connect(&blk).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        if let Some(status) = waiter.try_wait().unwrap() {
            break status;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "ctl --wait-event saw nothing"
        );
    };
    assert!(status.success());
    let mut line = String::new();
    waiter
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut line)
        .unwrap();
    let e: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(e["event"], "FRONTEND_CONNECTED");
    let out = Command::new(BIN)
        .args(["ctl", "--control"])
        .arg(&ctl)
        .args(["balloon-set-target", "target-mib=lots"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"target-mib\" is \"lots\""));
}

#[test]
fn a_config_file_serves_what_the_command_line_would() {
    let dir = Dir::new("config");
    let disk = dir.join("disk.img");
    File::create(&disk).unwrap().set_len(1 << 20).unwrap();
    let (blk, ctl) = (dir.join("blk.sock"), dir.join("ctl.sock"));
    let config = dir.join("memvisor.json");
    std::fs::write(
        &config,
        json!({
            "blk": [{"socket": blk, "disk": disk, "queues": 2, "read-only": true}],
            "control": ctl,
        })
        .to_string(),
    )
    .unwrap();
    let _server = Server::quiet(Command::new(BIN).args(["serve", "--config"]).arg(&config));
    wait_for(&ctl);
    let devices = memvisor_cli::control::request(&ctl, "query-devices", json!({})).unwrap();
    assert_eq!(devices[0]["id"], "blk0");
    assert_eq!(
        (&devices[0]["queues"], &devices[0]["read-only"]),
        (&json!(2), &json!(true))
    );

    // A bad configuration is refused before anything is served, naming what is wrong.
    std::fs::write(
        &config,
        r#"{"blk": [{"socket": "x.sock", "disk": "d", "queues": 0}]}"#,
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("blk[0]: queues=\"0\""), "{err}");
}

/// What the device answers GET_ID with (its serial), read from the guest's buffer.
fn get_id(g: &mut Guest) -> String {
    assert_eq!(g.request(8, 0, 20), 0, "GET_ID status");
    let mut id = [0u8; 20];
    g.mem.read(Gpa(DATA), &mut id).unwrap();
    String::from_utf8_lossy(&id)
        .trim_end_matches('\0')
        .to_string()
}

#[test]
fn disks_without_a_serial_answer_get_id_with_their_own_ids() {
    let dir = Dir::new("serials");
    let (a, b) = (dir.join("a.img"), dir.join("b.img"));
    for d in [&a, &b] {
        File::create(d).unwrap().set_len(1 << 20).unwrap();
    }
    let (sa, sb, ctl) = (dir.join("a.sock"), dir.join("b.sock"), dir.join("ctl.sock"));
    let _server = Server::quiet(
        Command::new(BIN)
            .arg("serve")
            .arg("--blk")
            .arg(format!("socket={},disk={}", sa.display(), a.display()))
            .arg("--blk")
            .arg(format!(
                "socket={},disk={},id=data",
                sb.display(),
                b.display()
            ))
            .arg("--control")
            .arg(&ctl),
    );
    wait_for(&ctl);
    let mut ids = Vec::new();
    for sock in [&sa, &sb] {
        let mut g = Guest::new();
        let c = Client::connect(sock).unwrap();
        g.connect(&c);
        ids.push(get_id(&mut g));
    }
    assert_eq!(ids, ["blk0", "data"]);
    let devices = memvisor_cli::control::request(&ctl, "query-devices", json!({})).unwrap();
    assert_eq!(
        (&devices[0]["serial"], &devices[1]["serial"]),
        (&json!("blk0"), &json!("data"))
    );
}

/// Runs `serve` until it fails or its socket appears (then kills it, leaving the socket file
/// behind: use a socket once after it served); returns its stderr if it failed.
fn serve_fails(args: &[String], sock: &Path) -> Option<String> {
    let mut child = Command::new(BIN)
        .arg("serve")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        if let Some(_status) = child.try_wait().unwrap() {
            let mut err = String::new();
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut err)
                .unwrap();
            return Some(err);
        }
        if sock.exists() {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "serve neither failed nor listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_held_image_and_a_qcow2_image_are_refused_by_name() {
    let dir = Dir::new("images");
    let img = dir.join("disk.img");
    File::create(&img).unwrap().set_len(1 << 20).unwrap();
    let first = dir.join("first.sock");
    let _server = Server::quiet(Command::new(BIN).arg("serve").arg("--blk").arg(format!(
        "socket={},disk={}",
        first.display(),
        img.display()
    )));
    wait_for(&first);
    let second = dir.join("second.sock");
    let blk = |extra: &str| {
        vec![
            "--blk".to_string(),
            format!("socket={},disk={}{extra}", second.display(), img.display()),
        ]
    };
    // A second writer, and a reader, are refused while the first serves the image.
    for extra in ["", ",read-only=on", ",locking=on"] {
        let err = serve_fails(&blk(extra), &second).expect("a second server started");
        assert!(
            err.contains(&format!("{}: cannot take the", img.display()))
                && err.contains("\"write\" lock")
                && err.contains("locking=off"),
            "{extra}: {err}"
        );
        assert!(!second.exists(), "a refused server left its socket");
    }
    // locking=off goes beside it.
    assert!(serve_fails(&blk(",locking=off"), &second).is_none());

    // A qcow2 header (what qemu-img create -f qcow2 writes first) is refused, naming the
    // format; format=raw serves it.
    let q = dir.join("vm.qcow2");
    let mut h = vec![0u8; 1 << 20];
    h[0..4].copy_from_slice(b"QFI\xfb");
    h[4..8].copy_from_slice(&3u32.to_be_bytes());
    std::fs::write(&q, &h).unwrap();
    let third = dir.join("third.sock");
    let blk = |extra: &str| {
        vec![
            "--blk".to_string(),
            format!("socket={},disk={}{extra}", third.display(), q.display()),
        ]
    };
    let err = serve_fails(&blk(""), &third).expect("a qcow2 image was served");
    assert!(
        err.contains(&format!("{}: the image is in qcow2 format", q.display())),
        "{err}"
    );
    let err = serve_fails(&blk(",format=qcow2"), &third).expect("format=qcow2 taken");
    assert!(err.contains("format=\"qcow2\""), "{err}");
    assert!(serve_fails(&blk(",format=raw"), &third).is_none());
}
