//! The control socket against qmp-spec.rst, as a client other than memvisor's own would drive
//! it: CRLF line ends, a lexical error resetting the parser, unknown arguments refused before
//! any side effect, single-quoted strings; and blk-del racing blk-add never leaving an unlisted
//! device serving.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{Dir, InProcess, MIB};
use memvisor::{PinRegistry, SharedMappings};
use memvisor_cli::control::Client as Control;
use memvisor_vhost::ProcessState;
use serde_json::{Value, json};

/// A raw connection: the greeting read (its raw bytes returned), nothing negotiated.
fn raw(ctl: &std::path::Path) -> (UnixStream, Vec<u8>) {
    let s = UnixStream::connect(ctl).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let line = read_raw_line(&s).expect("a greeting");
    (s, line)
}

/// Bytes up to and including the next `\n` (None on timeout or EOF).
fn read_raw_line(mut s: &UnixStream) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {
                line.push(b[0]);
                if b[0] == b'\n' {
                    return Some(line);
                }
            }
        }
    }
}

/// Reads answers until one with `id`; None if none within the read timeout.
fn answer_with_id(s: &UnixStream, id: &Value) -> Option<Value> {
    loop {
        let line = read_raw_line(s)?;
        let v: Value = serde_json::from_slice(&line).unwrap();
        if v.get("id") == Some(id) {
            return Some(v);
        }
    }
}

/// qmp-spec.rst, "General Definitions": "All interactions transmitted by the Server are
/// json-objects, always terminating with CRLF." libvirt's QMP reader splits on "\r\n".
#[test]
fn server_messages_end_with_crlf() {
    let dir = Dir::new("qmp-crlf");
    let s = InProcess::start(
        &dir,
        &ProcessState::new(SharedMappings::global(), PinRegistry::global()),
    );
    let (mut c, greeting) = raw(&s.ctl);
    assert!(
        greeting.ends_with(b"\r\n"),
        "greeting ends with {:?}",
        String::from_utf8_lossy(&greeting[greeting.len().saturating_sub(4)..])
    );
    c.write_all(b"{\"execute\": \"qmp_capabilities\", \"id\": 1}")
        .unwrap();
    let answer = read_raw_line(&c).unwrap();
    assert!(
        answer.ends_with(b"\r\n"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );
}

/// qmp-spec.rst, "Forcing the JSON parser into known-good state": "Incomplete or invalid input
/// can leave the server's JSON parser in a state where it can't parse additional commands. To
/// get it back into known-good state, the client should provoke a lexical error. The cleanest
/// way to do that is sending an ASCII control character other than \t, \r, or \n. [...] it
/// should send a 0xFF byte."
#[test]
fn a_control_character_or_0xff_brings_the_parser_back() {
    let dir = Dir::new("qmp-resync");
    let s = InProcess::start(
        &dir,
        &ProcessState::new(SharedMappings::global(), PinRegistry::global()),
    );
    for reset in [&b"\x1b"[..], b"\xff"] {
        let (mut c, _) = raw(&s.ctl);
        // An incomplete command (its arguments never closed), then the reset, then a command.
        c.write_all(b"{\"execute\": \"qmp_capabilities\", \"arguments\": {")
            .unwrap();
        c.write_all(reset).unwrap();
        c.write_all(b"\n{\"execute\": \"qmp_capabilities\", \"id\": \"after-reset\"}\n")
            .unwrap();
        let a = answer_with_id(&c, &json!("after-reset"));
        assert!(
            a.is_some(),
            "after {reset:?} the next command got no answer within 5 s: the framer never resets"
        );
    }
}

/// qmp-spec.rst: "the server will accept an extension of 'single-quoted' strings in place of the
/// usual "double-quoted" json-string".
#[test]
fn single_quoted_strings_are_accepted() {
    let dir = Dir::new("qmp-squote");
    let s = InProcess::start(
        &dir,
        &ProcessState::new(SharedMappings::global(), PinRegistry::global()),
    );
    let (mut c, _) = raw(&s.ctl);
    c.write_all(b"{'execute': 'qmp_capabilities', 'id': 'sq'}\n")
        .unwrap();
    let line = read_raw_line(&c).expect("an answer");
    let a: Value = serde_json::from_slice(&line).unwrap();
    assert_eq!(a, json!({"return": {}, "id": "sq"}));
}

/// qmp-spec.rst, "Compatibility Considerations": "The QMP Server performs a type check on the
/// arguments to a command. It generates an error if [...] it does not understand a key that the
/// Client included. [...] Clients can assume that, when such validation errors occur, they will
/// be reported before the command generated any side effect."
/// A misspelt `size` makes blk-resize succeed without resizing (and emit DEVICE_RESIZED).
#[test]
fn an_unknown_argument_is_refused_not_ignored() {
    let dir = Dir::new("qmp-extra");
    let s = InProcess::start(
        &dir,
        &ProcessState::new(SharedMappings::global(), PinRegistry::global()),
    );
    let disk = dir.image("d.img", MIB);
    let sock = dir.join("d.sock");
    let mut ctl = Control::connect(&s.ctl).unwrap();
    ctl.execute("blk-add", json!({"id": "d", "socket": sock, "disk": disk}))
        .unwrap();
    let r = ctl.execute("blk-resize", json!({"id": "d", "szie": 4 * MIB}));
    let len = std::fs::metadata(&disk).unwrap().len();
    assert!(
        r.is_err(),
        "blk-resize with \"szie\" answered {r:?}; the image is still {len} bytes"
    );
    for (cmd, args) in [
        ("blk-del", json!({"id": "d", "froce": true})),
        ("query-stats", json!({"devcie": "d"})),
        ("query-devices", json!({"bogus": 1})),
    ] {
        let r = ctl.execute(cmd, args.clone());
        assert!(r.is_err(), "{cmd} {args} answered {r:?}");
    }
}

/// blk-del of the id a concurrent blk-add is starting: the del must either fail or really
/// delete (the device's thread stopped, its socket removed). Between Registry::add and the
/// Served push in Runtime::spawn a blk-del finds the device listed but no thread to stop: it
/// answers {} and DEVICE_DELETED while the device goes on serving, unlisted.
#[test]
fn blk_del_racing_blk_add_never_leaves_an_unlisted_device_serving() {
    let dir = Dir::new("qmp-race");
    let s = InProcess::start(
        &dir,
        &ProcessState::new(SharedMappings::global(), PinRegistry::global()),
    );
    let disk = dir.image("d.img", MIB);
    // Unraced, blk-del removes the socket before it answers.
    {
        let sock = dir.join("seq.sock");
        let mut c = Control::connect(&s.ctl).unwrap();
        c.execute("blk-add", json!({"id": "d", "socket": sock, "disk": disk}))
            .unwrap();
        c.execute("blk-del", json!({"id": "d"})).unwrap();
        assert!(!sock.exists() && UnixStream::connect(&sock).is_err());
    }
    let t0 = Instant::now();
    let mut rounds = 0;
    while t0.elapsed() < Duration::from_secs(10) && rounds < 40 {
        rounds += 1;
        let sock = dir.join(&format!("d{rounds}.sock"));
        let done = Arc::new(AtomicBool::new(false));
        let deleter = {
            let (ctl, done) = (s.ctl.clone(), done.clone());
            std::thread::spawn(move || {
                let mut c = Control::connect(&ctl).unwrap();
                loop {
                    if c.execute("blk-del", json!({"id": "d"})).is_ok() {
                        return true;
                    }
                    if done.load(Ordering::Relaxed) {
                        return c.execute("blk-del", json!({"id": "d"})).is_ok();
                    }
                }
            })
        };
        std::thread::sleep(Duration::from_millis(2));
        let mut adder = Control::connect(&s.ctl).unwrap();
        adder
            .execute("blk-add", json!({"id": "d", "socket": sock, "disk": disk}))
            .unwrap();
        done.store(true, Ordering::Relaxed);
        assert!(
            deleter.join().unwrap(),
            "round {rounds}: the device was never deleted"
        );
        // Deleted: its thread has ended, so its socket is gone and nobody listens there.
        let listening = UnixStream::connect(&sock).is_ok();
        assert!(
            !sock.exists() && !listening,
            "round {rounds}: blk-del answered {{}} but device d still serves {} (listening: \
             {listening}); query-devices: {}",
            sock.display(),
            adder.execute("query-devices", json!({})).unwrap()
        );
    }
    eprintln!("{rounds} rounds, no orphan");
}
