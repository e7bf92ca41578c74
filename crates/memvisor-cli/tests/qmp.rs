//! The control socket as QMP, end to end, on `memvisor vfio-user --control`: the project's own
//! client (`memvisor_cli::control::Client`) watches a test vfio-user client map memory, and a
//! real QMP client (python's `qemu.qmp`, when installed) negotiates, queries and gets an event.
//! Needs no privilege: the memory mapped is a memfd the server maps, nothing is pinned.

mod common;

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::{BIN, Dir, Server, wait_for};
use memvisor_cli::control::Client as Control;
use memvisor_testkit::vfio_user::client::Client as VfioClient;
use memvisor_vfio_user::proto::{self, DmaMap, cmd};
use serde_json::{Value, json};

/// `memvisor vfio-user` on `dir/vfio.sock` with its control socket `dir/ctl.sock`.
fn start(dir: &Dir) -> (Server, PathBuf, PathBuf) {
    let (sock, ctl) = (dir.join("vfio.sock"), dir.join("ctl.sock"));
    let server = Server::quiet(
        Command::new(BIN)
            .arg("vfio-user")
            .arg("--socket")
            .arg(&sock)
            .arg("--control")
            .arg(&ctl)
            .arg("--stats")
            .arg(dir.join("stats.json")),
    );
    wait_for(&sock);
    wait_for(&ctl);
    (server, sock, ctl)
}

fn memfd(size: u64) -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"memvisor-qmp-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on a descriptor we own.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
    fd
}

fn device(stats: &Value) -> &Value {
    &stats["devices"][0]
}

#[test]
fn vfio_user_control_socket_shows_a_client_map_live_and_quit_stops_the_server() {
    let dir = Dir::new("qmp-vfio");
    let (mut server, sock, ctl) = start(&dir);
    let mut control = Control::connect(&ctl).unwrap();
    assert_eq!(control.greeting["capabilities"], json!([]));
    let names = control.execute("query-commands", json!({})).unwrap();
    for name in ["qmp_capabilities", "quit", "query-devices", "query-stats"] {
        assert!(
            names.as_array().unwrap().contains(&json!({"name": name})),
            "{names}"
        );
    }
    let devices = control.execute("query-devices", json!({})).unwrap();
    assert_eq!(devices[0]["id"], "mvdma0");
    assert_eq!(devices[0]["connected"], false);
    let e = control
        .execute("query-stats", json!({"device": "blk0"}))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("DeviceNotFound:"), "{e}");

    // A vfio-user client connects and maps 1 MiB: the live figures show it.
    let mut client = VfioClient::connect(&sock).unwrap();
    let event = control.next_event(Duration::from_secs(10)).unwrap();
    assert_eq!(event["event"], "FRONTEND_CONNECTED", "{event}");
    assert_eq!(event["data"]["device"], "mvdma0");
    let version = proto::Version {
        major: 0,
        minor: 0,
        json: r#"{"capabilities":{"max_msg_fds":16,"pgsizes":4096}}"#.into(),
    };
    assert_eq!(
        client
            .call(cmd::VERSION, &version.to_bytes(), &[])
            .unwrap()
            .0,
        0
    );
    let before = control.execute("query-stats", json!({})).unwrap();
    assert_eq!(device(&before)["connected"], true);
    assert_eq!(device(&before)["now"]["mappings"], 0, "{before}");
    let mem = memfd(1 << 20);
    let map = DmaMap {
        argsz: 32,
        flags: 3,
        offset: 0,
        iova: 0x10_0000,
        size: 1 << 20,
    };
    assert_eq!(
        client
            .call(cmd::DMA_MAP, &map.to_bytes(), &[mem.as_raw_fd()])
            .unwrap()
            .0,
        0
    );
    let during = control.execute("query-stats", json!({})).unwrap();
    assert_eq!(device(&during)["now"]["mappings"], 1, "{during}");
    assert!(during["process"]["figures"]["memfd_maps"].as_u64().unwrap() >= 1);

    // SIGUSR1 writes the report as it stands, the server goes on.
    let stats = dir.join("stats.json");
    // SAFETY: kill(2) on our own child, which has not been reaped.
    let sent = unsafe { libc::kill(server.0.id() as i32, libc::SIGUSR1) };
    assert_eq!(sent, 0);
    wait_for(&stats);
    let written: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(written["connections"], json!([]), "{written}");
    std::fs::remove_file(&stats).unwrap();

    // The client goes: its connection is in the report, with its map, and nothing is live.
    drop(client);
    let event = control.next_event(Duration::from_secs(10)).unwrap();
    assert_eq!(event["event"], "FRONTEND_DISCONNECTED", "{event}");
    let after = control.execute("query-stats", json!({})).unwrap();
    let report = &device(&after)["report"];
    assert_eq!(device(&after)["now"], Value::Null, "{after}");
    assert_eq!(report["connections"][0]["dma_maps"], 1, "{after}");
    assert_eq!(report["connections"][0]["end"], "ok", "{after}");

    // quit answers, then the server stops as for SIGTERM: exit 0, sockets removed, --stats
    // written.
    assert_eq!(control.execute("quit", json!({})).unwrap(), json!({}));
    assert!(server.wait_exit(Duration::from_secs(20)));
    assert!(!sock.exists() && !ctl.exists());
    let written: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    assert_eq!(written["connections"][0]["dma_maps"], 1, "{written}");
}

/// The python program the interop test runs: connects with `qemu.qmp.QMPClient` (which reads
/// the greeting and negotiates), runs query-stats, makes a frontend connect (a plain connection
/// to the vfio-user socket) and waits for its event, then quits the server.
const PYTHON_CLIENT: &str = r#"
import asyncio, socket, sys
from qemu.qmp import QMPClient

async def main(ctl, sock):
    qmp = QMPClient("memvisor-test")
    await qmp.connect(ctl)
    assert qmp.greeting.QMP.capabilities == [], qmp.greeting
    stats = await qmp.execute("query-stats")
    assert stats["devices"][0]["id"] == "mvdma0", stats
    names = [c["name"] for c in await qmp.execute("query-commands")]
    assert "query-stats" in names and "quit" in names, names
    # The client's own listener, registered before it connected, keeps every event.
    assert qmp.events.empty()
    frontend = socket.socket(socket.AF_UNIX)
    frontend.connect(sock)
    event = await asyncio.wait_for(qmp.events.get(), 10)
    assert event["event"] == "FRONTEND_CONNECTED", event
    assert event["data"]["device"] == "mvdma0", event
    assert await qmp.execute("quit") == {}
    try:
        await qmp.disconnect()
    except EOFError:
        # The server closed the stream after answering quit, as QEMU does; QEMU's own
        # python/qemu/machine expects this EOF after a quit too.
        pass
    frontend.close()
    print("qemu.qmp: greeting, negotiation, query-stats, event, quit: ok")

asyncio.run(asyncio.wait_for(main(sys.argv[1], sys.argv[2]), 30))
"#;

#[test]
fn python_qemu_qmp_client_connects_queries_gets_an_event_and_quits() {
    let has_qmp = Command::new("python3")
        .args(["-c", "import qemu.qmp"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_qmp {
        eprintln!(
            "skipped: python_qemu_qmp_client_connects_queries_gets_an_event_and_quits: python \
             qemu.qmp not installed"
        );
        return;
    }
    let dir = Dir::new("qmp-python");
    let (mut server, sock, ctl) = start(&dir);
    let script = dir.join("client.py");
    std::fs::File::create(&script)
        .unwrap()
        .write_all(PYTHON_CLIENT.as_bytes())
        .unwrap();
    let out = Command::new("python3")
        .arg(&script)
        .arg(&ctl)
        .arg(&sock)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python qemu.qmp client failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprint!("{}", String::from_utf8_lossy(&out.stdout));
    // Its quit stopped the server.
    assert!(server.wait_exit(Duration::from_secs(20)));
}
