//! The Prometheus endpoint and `blk-set-throttle` of a running `memvisor serve`: a scrape over
//! a Unix socket and over loopback TCP parses with a real Prometheus parser (python's
//! `prometheus_client`; the test says it is skipped when python lacks it) and carries the
//! counters, the latency histograms and the throttle set through the control socket; a
//! non-loopback address is refused; invalid limits are refused naming the value.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, Dir, Server, wait_for};
use memvisor_cli::control::Client as Control;
use serde_json::{Value, json};

/// One HTTP GET over `s`; returns the status line and the body.
fn get(mut s: impl Read + Write) -> (String, String) {
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").expect("no end of head");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// The families python's prometheus_client parser reads from `text`: name -> (type, samples as
/// [name, labels, value]); `None` (and a visible skip) when python lacks the library.
fn parse_with_prometheus(test: &str, text: &str) -> Option<Value> {
    let script = "import sys, json\n\
        from prometheus_client.parser import text_string_to_metric_families as p\n\
        print(json.dumps({f.name: [f.type, [[s.name, s.labels, s.value] for s in f.samples]] \
        for f in p(sys.stdin.read())}))";
    let has = Command::new("python3")
        .args(["-c", "import prometheus_client"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has {
        eprintln!(
            "skipped: {test}: python3 with prometheus_client is needed (pip install prometheus_client)"
        );
        return None;
    }
    let mut py = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    py.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
    let out = py.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the Prometheus parser refused:\n{text}"
    );
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

fn serve(d: &Dir, metrics: &str) -> Server {
    let disk = d.disk();
    Server(
        Command::new(BIN)
            .args(["serve", "--blk"])
            .arg(format!(
                "socket={},disk={},id=vda,queues=2",
                d.join("blk.sock").display(),
                disk.display()
            ))
            .arg("--control")
            .arg(d.join("ctl.sock"))
            .args(["--metrics", metrics])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn a_scrape_parses_and_carries_counters_histograms_and_the_throttle() {
    let d = Dir::new("metrics-unix");
    let sock = d.join("metrics.sock");
    let _server = serve(&d, &format!("unix:{}", sock.display()));
    wait_for(&d.join("ctl.sock"));
    wait_for(&sock);
    let mut ctl = Control::connect(&d.join("ctl.sock")).unwrap();
    let r = ctl
        .execute(
            "blk-set-throttle",
            json!({"id": "vda", "bps": 8_388_608, "iops_wr": 500, "iops_wr_max": 1000}),
        )
        .unwrap();
    assert_eq!(r, json!({}));
    // Refused as QEMU refuses, naming the value; the throttle in force stays.
    let e = format!(
        "{:#}",
        ctl.execute(
            "blk-set-throttle",
            json!({"id": "vda", "bps": 100, "bps_max": 50})
        )
        .unwrap_err()
    );
    assert!(e.contains("bps_max is 50"), "{e}");
    let e = format!(
        "{:#}",
        ctl.execute(
            "blk-set-throttle",
            json!({"id": "vda", "iops": 2_000_000_000_000_000u64})
        )
        .unwrap_err()
    );
    assert!(e.contains("iops is 2000000000000000"), "{e}");
    let e = format!(
        "{:#}",
        ctl.execute("blk-set-throttle", json!({"id": "vda", "bsp": 1}))
            .unwrap_err()
    );
    assert!(e.contains("bsp"), "{e}");
    let stats = ctl.execute("query-stats", json!({})).unwrap();
    let dev = &stats["devices"][0];
    assert_eq!(dev["throttle"]["bps"], 8_388_608);
    assert_eq!(dev["throttle"]["iops_wr_max"], 1000);
    let lat = dev["latency"].as_array().unwrap();
    assert_eq!(lat.len(), 2, "one latency entry per queue: {lat:?}");
    let h = &lat[1]["flush"];
    assert_eq!(
        h["counts"].as_array().unwrap().len(),
        h["bounds_ns"].as_array().unwrap().len() + 1
    );

    let (status, body) = get(UnixStream::connect(&sock).unwrap());
    assert!(status.contains("200"), "{status}");
    let Some(families) = parse_with_prometheus(
        "a_scrape_parses_and_carries_counters_histograms_and_the_throttle",
        &body,
    ) else {
        return;
    };
    let family = |name: &str, kind: &str| -> Vec<Value> {
        let f = &families[name];
        assert_eq!(f[0], kind, "{name} in\n{body}");
        f[1].as_array().unwrap().clone()
    };
    let requests = family("memvisor_blk_requests", "counter");
    assert!(
        requests
            .iter()
            .any(|s| s[0] == "memvisor_blk_requests_total"
                && s[1]["device"] == "vda"
                && s[1]["op"] == "read")
    );
    family("memvisor_blk_bytes", "counter");
    let hist = family("memvisor_blk_request_duration_seconds", "histogram");
    // Two queues, three operations, each with 25 buckets, a sum and a count.
    assert_eq!(hist.len(), 2 * 3 * (25 + 2), "{body}");
    assert!(
        hist.iter()
            .any(|s| s[1]["queue"] == "1" && s[1]["op"] == "write" && s[1]["le"] == "+Inf")
    );
    let throttle = family("memvisor_blk_throttle", "gauge");
    assert!(
        throttle
            .iter()
            .any(|s| s[1]["limit"] == "bps" && s[2].as_f64() == Some(8_388_608.0))
    );
}

#[test]
fn loopback_tcp_is_served_and_other_addresses_are_refused() {
    let d = Dir::new("metrics-tcp");
    let refused = Command::new(BIN)
        .args(["serve", "--blk"])
        .arg(format!(
            "socket={},disk={}",
            d.join("blk.sock").display(),
            d.disk().display()
        ))
        .args(["--metrics", "0.0.0.0:9100"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success());
    assert!(
        err.contains("0.0.0.0:9100") && err.contains("loopback"),
        "{err}"
    );

    // A port free a moment ago.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = serve(&d, &format!("127.0.0.1:{port}"));
    wait_for(&d.join("ctl.sock"));
    let t0 = Instant::now();
    let s = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(e) => {
                assert!(t0.elapsed() < Duration::from_secs(10), "port {port}: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    let (status, body) = get(s);
    assert!(status.starts_with("HTTP/1.0 200"), "{status}");
    assert!(
        body.contains("memvisor_blk_requests_total{device=\"vda\",op=\"write\"} 0"),
        "{body}"
    );
    if let Some(f) = parse_with_prometheus(
        "loopback_tcp_is_served_and_other_addresses_are_refused",
        &body,
    ) {
        assert!(f["memvisor_blk_request_duration_seconds"].is_array());
    }
}

/// A limit of the wrong JSON type is refused naming the argument and its value, and a device
/// id that is not a string is named too.
#[test]
fn a_throttle_argument_of_the_wrong_type_is_named() {
    let d = Dir::new("metrics-types");
    let sock = d.join("metrics.sock");
    let _server = serve(&d, &format!("unix:{}", sock.display()));
    wait_for(&d.join("ctl.sock"));
    let mut ctl = Control::connect(&d.join("ctl.sock")).unwrap();
    for (args, names) in [
        (json!({"id": "vda", "bps": "100"}), ["\"bps\"", "\"100\""]),
        (json!({"id": "vda", "iops_wr": -1}), ["\"iops_wr\"", "-1"]),
        (json!({"id": 7, "bps": 100}), ["\"id\"", "7"]),
    ] {
        let e = format!(
            "{:#}",
            ctl.execute("blk-set-throttle", args.clone()).unwrap_err()
        );
        for n in names {
            assert!(e.contains(n), "{args}: {e}");
        }
    }
    // QEMU's names: `device` for the id is taken; a throttle group is refused by name.
    assert_eq!(
        ctl.execute("blk-set-throttle", json!({"device": "vda", "bps": 1 << 20}))
            .unwrap(),
        json!({})
    );
    let e = format!(
        "{:#}",
        ctl.execute(
            "blk-set-throttle",
            json!({"device": "vda", "bps": 1 << 20, "group": "g1"})
        )
        .unwrap_err()
    );
    assert!(e.contains("\"group\" is \"g1\""), "{e}");
    let stats = ctl
        .execute("query-stats", json!({"device": "vda"}))
        .unwrap();
    assert_eq!(stats["devices"][0]["throttle"]["bps"], 1 << 20, "{stats}");
}
