//! The Prometheus endpoint (`--metrics ADDR`): the server's counters and latency histograms
//! in the Prometheus text exposition format, version 0.0.4, for a fleet's scraper.
//!
//! **Model.** What is exposed is exactly what `query-stats` answers ([`crate::status`]): the
//! endpoint asks for it on each scrape and writes it out again as metric families, so the
//! control socket, the `--stats` report and a scrape never disagree. Per blk device
//! (`device` label): requests and bytes by `op`, failures, the pin counters and every other
//! number of the device's `blk` block, the throttle in force, and the latency histogram per
//! `queue` and `op` (`memvisor_blk_request_duration_seconds`, cumulative `_bucket{le}` from the
//! device's log-scale buckets, `_sum`, `_count`); per device the back end's numbers; for the
//! process its pin registry. Numbers whose nature the JSON does not say are `untyped`.
//!
//! **Where.** Off unless asked. `127.0.0.1:PORT` or `[::1]:PORT` — loopback only: the figures
//! name disks and sockets, and the endpoint has no authentication, so any other address is
//! refused with an error naming it (put a proxy in front to publish them) — or `unix:PATH`.
//!
//! **The server** is a tiny HTTP/1.0–1.1 responder on its own thread: it reads a request head,
//! answers a `GET` (of any path) or `HEAD` with the text and `Connection: close`, anything
//! else with 405, and closes. One scrape at a time, each bounded (2 seconds for any read or
//! write, 5 for the whole request head) so a silent or trickling client cannot hold the
//! thread. No web framework: a scrape is one request with no body, and a framework (hyper,
//! axum, tiny_http) would bring an async runtime or a thread pool and dozens of crates into a
//! storage daemon for it.

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Where the endpoint listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Addr {
    /// A loopback TCP address.
    Tcp(SocketAddr),
    /// A Unix socket path.
    Unix(PathBuf),
}

/// Reads `--metrics`: `unix:PATH`, or a loopback `IP:PORT`.
pub fn parse(s: &str) -> Result<Addr> {
    if let Some(path) = s.strip_prefix("unix:") {
        if path.is_empty() {
            bail!("--metrics {s:?}: unix: needs a path (unix:/run/memvisor/metrics.sock)");
        }
        return Ok(Addr::Unix(path.into()));
    }
    let a: SocketAddr = s.parse().with_context(|| {
        format!("--metrics {s:?} is not an address: give 127.0.0.1:PORT, [::1]:PORT or unix:PATH")
    })?;
    if !a.ip().is_loopback() {
        bail!(
            "--metrics {a}: not a loopback address; the endpoint has no authentication, so it \
             listens on 127.0.0.1:PORT, [::1]:PORT or unix:PATH only"
        );
    }
    Ok(Addr::Tcp(a))
}

/// A running endpoint; dropping it removes its Unix socket (the thread ends with the process).
pub struct Metrics {
    unix: Option<PathBuf>,
    /// Where it listens, as bound (a TCP port 0 becomes the port given).
    pub local: String,
}

impl Drop for Metrics {
    fn drop(&mut self) {
        if let Some(p) = &self.unix {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// Listens on `addr` and answers each scrape with [`render`] of what `stats` says then (the
/// `query-stats` answer).
pub fn start(addr: &Addr, stats: impl Fn() -> Value + Send + 'static) -> Result<Metrics> {
    let answer = move |s: &mut dyn Conn| respond(s, &render(&stats()));
    match addr {
        Addr::Tcp(a) => {
            let l =
                TcpListener::bind(a).with_context(|| format!("--metrics {a}: cannot listen"))?;
            let local = l.local_addr()?.to_string();
            log::info!("metrics on http://{local}/metrics");
            answer_each(move || l.accept().map(|(c, _)| c), answer)?;
            Ok(Metrics { unix: None, local })
        }
        Addr::Unix(p) => {
            let l = UnixListener::bind(p)
                .with_context(|| format!("--metrics unix:{}: cannot listen", p.display()))?;
            log::info!("metrics on unix:{}", p.display());
            answer_each(move || l.accept().map(|(c, _)| c), answer)?;
            Ok(Metrics {
                unix: Some(p.clone()),
                local: format!("unix:{}", p.display()),
            })
        }
    }
}

/// On a thread of its own, answers each connection `accept` gives, one at a time, each with
/// read and write timeouts so a silent client cannot hold the thread.
fn answer_each<C: Conn + 'static>(
    mut accept: impl FnMut() -> io::Result<C> + Send + 'static,
    answer: impl Fn(&mut dyn Conn) + Send + 'static,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            loop {
                match accept() {
                    Ok(mut c) => {
                        let _ = c.set_read_timeout(Some(READ_TIME));
                        let _ = c.set_write_timeout(Some(READ_TIME));
                        answer(&mut c);
                    }
                    // A failed accept loses only that connection; one that goes on failing
                    // (EMFILE at the fd limit) is tried again a little later, not in a spin.
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        log::warn!("metrics: accept: {e}; trying again in 100 ms");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        })?;
    Ok(())
}

/// A connection: a TCP or Unix stream.
trait Conn: Read + Write {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()>;
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()>;
}

/// How long one read or write of a scrape may wait.
const READ_TIME: Duration = Duration::from_secs(2);

impl Conn for TcpStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        TcpStream::set_write_timeout(self, t)
    }
}

impl Conn for UnixStream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_read_timeout(self, t)
    }
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        UnixStream::set_write_timeout(self, t)
    }
}

/// How long a client has to send its whole request head.
const HEAD_TIME: Duration = Duration::from_secs(5);

/// Reads one request head (at most 16 KiB, within [`HEAD_TIME`]) and answers it.
fn respond(c: &mut dyn Conn, body: &str) {
    let t0 = Instant::now();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        // A read timeout alone lets a client that sends a byte now and then hold the thread.
        let left = HEAD_TIME.saturating_sub(t0.elapsed());
        if left.is_zero() || c.set_read_timeout(Some(left.min(READ_TIME))).is_err() {
            break;
        }
        match c.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > 16 * 1024 {
            break;
        }
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let method = line.split(|&b| b == b' ').next().unwrap_or_default();
    let (status, body) = match method {
        b"GET" => ("200 OK", body),
        b"HEAD" => ("200 OK", ""),
        _ => ("405 Method Not Allowed", "only GET and HEAD are answered\n"),
    };
    let len = if method == b"HEAD" { 0 } else { body.len() };
    let reply = format!(
        "HTTP/1.0 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {len}\r\nConnection: close\r\n\r\n{body}"
    );
    let _ = c.write_all(reply.as_bytes());
}

/// Metric families in the order first seen: name, type, help, sample lines. A counter's
/// family is named with its `_total`, as its samples are (what Prometheus' and python's
/// parsers expect of the 0.0.4 format).
#[derive(Default)]
struct Families(Vec<(String, &'static str, String, Vec<String>)>);

impl Families {
    fn family(&mut self, name: &str, kind: &'static str, help: &str) -> &mut Vec<String> {
        let i = match self.0.iter().position(|f| f.0 == name) {
            Some(i) => i,
            None => {
                self.0.push((name.into(), kind, help.into(), Vec::new()));
                self.0.len() - 1
            }
        };
        &mut self.0[i].3
    }

    /// One sample of family `name` (`suffix` for a histogram's parts).
    #[allow(clippy::too_many_arguments)]
    fn sample(
        &mut self,
        name: &str,
        kind: &'static str,
        help: &str,
        suffix: &str,
        labels: &[(&str, &str)],
        value: f64,
    ) {
        let mut line = format!("{name}{suffix}");
        if !labels.is_empty() {
            let l: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                .collect();
            let _ = write!(line, "{{{}}}", l.join(","));
        }
        let _ = write!(line, " {}", number(value));
        self.family(name, kind, help).push(line);
    }

    fn text(&self) -> String {
        let mut out = String::new();
        for (name, kind, help, lines) in &self.0 {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for l in lines {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

/// A label value escaped as the format asks (backslash, double quote, newline).
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn number(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        format!("{v}")
    }
}

/// A JSON key as a metric name part: letters, digits and `_` only.
fn name_part(k: &str) -> String {
    k.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// Every number of `obj` not in `skip` as an untyped metric `prefix_<key>`.
fn numbers(f: &mut Families, prefix: &str, obj: &Value, skip: &[&str], labels: &[(&str, &str)]) {
    let Some(map) = obj.as_object() else {
        return;
    };
    for (k, v) in map {
        if skip.contains(&k.as_str()) {
            continue;
        }
        let v = match v {
            Value::Number(n) => n.as_f64(),
            Value::Bool(b) => Some(f64::from(u8::from(*b))),
            _ => None,
        };
        if let Some(v) = v {
            let name = format!("{prefix}_{}", name_part(k));
            f.sample(&name, "untyped", &format!("query-stats {k}"), "", labels, v);
        }
    }
}

/// The `query-stats` answer `stats` in the text format 0.0.4.
pub fn render(stats: &Value) -> String {
    let mut f = Families::default();
    let empty = Vec::new();
    for d in stats["devices"].as_array().unwrap_or(&empty) {
        let id = d["id"].as_str().unwrap_or_default();
        let ty = d["type"].as_str().unwrap_or_default();
        let dev = [("device", id)];
        f.sample(
            "memvisor_device_connected",
            "gauge",
            "1 while a frontend is connected",
            "",
            &[("device", id), ("type", ty)],
            f64::from(u8::from(d["connected"].as_bool().unwrap_or(false))),
        );
        numbers(&mut f, "memvisor_backend", &d["backend"], &[], &dev);
        let blk = &d["blk"];
        if blk.is_object() {
            blk_counters(&mut f, id, blk);
        }
        if let Some(t) = d["throttle"].as_object() {
            for (k, v) in t {
                f.sample(
                    "memvisor_blk_throttle",
                    "gauge",
                    "The limit in force, by blk-set-throttle argument (0: none)",
                    "",
                    &[("device", id), ("limit", k)],
                    v.as_f64().unwrap_or(0.0),
                );
            }
        }
        for q in d["latency"].as_array().unwrap_or(&empty) {
            let queue = q["queue"].to_string();
            for op in ["read", "write", "flush"] {
                histogram(
                    &mut f,
                    &[("device", id), ("queue", &queue), ("op", op)],
                    &q[op],
                );
            }
        }
    }
    numbers(&mut f, "memvisor_pins", &stats["process"]["pins"], &[], &[]);
    f.text()
}

fn blk_counters(f: &mut Families, id: &str, blk: &Value) {
    let n = |k: &str| blk[k].as_f64().unwrap_or(0.0);
    for (op, k) in [
        ("read", "reads"),
        ("write", "writes"),
        ("flush", "flushes"),
        ("discard", "discards"),
        ("write_zeroes", "write_zeroes"),
    ] {
        f.sample(
            "memvisor_blk_requests_total",
            "counter",
            "Requests completed, by operation",
            "",
            &[("device", id), ("op", op)],
            n(k),
        );
    }
    for (op, k) in [("read", "bytes_read"), ("write", "bytes_written")] {
        f.sample(
            "memvisor_blk_bytes_total",
            "counter",
            "Bytes moved between guest memory and the image",
            "",
            &[("device", id), ("op", op)],
            n(k),
        );
    }
    for (kind, k) in [
        ("any", "failed"),
        ("io", "io_errors"),
        ("pin", "pin_errors"),
    ] {
        f.sample(
            "memvisor_blk_errors_total",
            "counter",
            "Requests answered IOERR or UNSUPP (any), of them failed image I/O (io) and \
             buffers that could not be held (pin)",
            "",
            &[("device", id), ("kind", kind)],
            n(k),
        );
    }
    let shown = [
        "reads",
        "writes",
        "flushes",
        "discards",
        "write_zeroes",
        "bytes_read",
        "bytes_written",
        "failed",
        "io_errors",
        "pin_errors",
    ];
    numbers(f, "memvisor_blk", blk, &shown, &[("device", id)]);
}

/// One latency histogram (`{bounds_ns, counts, count, sum_ns}`) as cumulative buckets in
/// seconds.
fn histogram(f: &mut Families, labels: &[(&str, &str)], h: &Value) {
    const NAME: &str = "memvisor_blk_request_duration_seconds";
    const HELP: &str = "Time from a request's buffers being held to its end (flush: its fdatasync)";
    let empty = Vec::new();
    let bounds = h["bounds_ns"].as_array().unwrap_or(&empty);
    let counts = h["counts"].as_array().unwrap_or(&empty);
    let mut cumulative = 0u64;
    for (b, c) in bounds.iter().zip(counts) {
        cumulative += c.as_u64().unwrap_or(0);
        let le = number(b.as_f64().unwrap_or(0.0) / 1e9);
        let mut l = labels.to_vec();
        l.push(("le", &le));
        f.sample(NAME, "histogram", HELP, "_bucket", &l, cumulative as f64);
    }
    let count = h["count"].as_f64().unwrap_or(0.0);
    let mut l = labels.to_vec();
    l.push(("le", "+Inf"));
    f.sample(NAME, "histogram", HELP, "_bucket", &l, count);
    let sum = h["sum_ns"].as_f64().unwrap_or(0.0) / 1e9;
    f.sample(NAME, "histogram", HELP, "_sum", labels, sum);
    f.sample(NAME, "histogram", HELP, "_count", labels, count);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_loopback_or_a_unix_path_is_taken() {
        assert_eq!(
            parse("127.0.0.1:9100").unwrap(),
            Addr::Tcp("127.0.0.1:9100".parse().unwrap())
        );
        assert!(matches!(parse("[::1]:9100").unwrap(), Addr::Tcp(_)));
        assert_eq!(
            parse("unix:/run/m.sock").unwrap(),
            Addr::Unix("/run/m.sock".into())
        );
        let e = parse("0.0.0.0:9100").unwrap_err().to_string();
        assert!(e.contains("0.0.0.0:9100") && e.contains("loopback"), "{e}");
        let e = parse("10.1.2.3:80").unwrap_err().to_string();
        assert!(e.contains("10.1.2.3:80"), "{e}");
        let e = format!("{:#}", parse("localhost").unwrap_err());
        assert!(e.contains("\"localhost\""), "{e}");
        assert!(parse("unix:").is_err());
    }

    #[test]
    fn a_histogram_is_cumulative_in_seconds_and_labels_are_escaped() {
        let stats = json!({
            "devices": [{
                "id": "d\"1", "type": "vhost-user-blk", "connected": true,
                "backend": {"messages": 7},
                "blk": {"reads": 3, "writes": 1, "bytes_read": 4096, "pinned_pages": 2},
                "throttle": {"bps": 100},
                "latency": [{"queue": 0,
                    "read": {"bounds_ns": [1024, 2048], "counts": [1, 2, 4], "count": 7, "sum_ns": 2_000_000_000u64},
                    "write": {"bounds_ns": [1024, 2048], "counts": [0, 0, 0], "count": 0, "sum_ns": 0},
                    "flush": {"bounds_ns": [1024, 2048], "counts": [0, 0, 0], "count": 0, "sum_ns": 0}}]
            }],
            "process": {"pins": {"pinned_pages": 5}}
        });
        let t = render(&stats);
        let has = |l: &str| assert!(t.lines().any(|x| x == l), "no line {l:?} in\n{t}");
        has(r#"memvisor_blk_requests_total{device="d\"1",op="read"} 3"#);
        has(r#"memvisor_blk_bytes_total{device="d\"1",op="read"} 4096"#);
        has(
            r#"memvisor_blk_request_duration_seconds_bucket{device="d\"1",queue="0",op="read",le="0.000001024"} 1"#,
        );
        has(
            r#"memvisor_blk_request_duration_seconds_bucket{device="d\"1",queue="0",op="read",le="0.000002048"} 3"#,
        );
        has(
            r#"memvisor_blk_request_duration_seconds_bucket{device="d\"1",queue="0",op="read",le="+Inf"} 7"#,
        );
        has(r#"memvisor_blk_request_duration_seconds_sum{device="d\"1",queue="0",op="read"} 2"#);
        has(r#"memvisor_blk_pinned_pages{device="d\"1"} 2"#);
        has(r#"memvisor_blk_throttle{device="d\"1",limit="bps"} 100"#);
        has(r#"memvisor_backend_messages{device="d\"1"} 7"#);
        has("memvisor_pins_pinned_pages 5");
        has("# TYPE memvisor_blk_request_duration_seconds histogram");
        // Each family's HELP and TYPE once.
        assert_eq!(
            t.matches("# TYPE memvisor_blk_requests_total counter")
                .count(),
            1
        );
    }

    #[test]
    fn a_client_trickling_an_endless_head_is_cut_off() {
        let (mut server, client) = UnixStream::pair().unwrap();
        server
            .set_read_timeout(Some(Duration::from_secs(2)))
            .unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        // One byte every 50 ms, never the blank line that ends a head: each read is well
        // inside the read timeout, so only a limit on the whole head ends this.
        let trickle = std::thread::spawn(move || {
            let mut client = client;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                if client.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            respond(&mut server, "body\n");
            let _ = tx.send(());
        });
        let ended = rx.recv_timeout(Duration::from_secs(30));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = trickle.join();
        assert!(
            ended.is_ok(),
            "a client sending a byte now and then held the metrics thread"
        );
    }
}
