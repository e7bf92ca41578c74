//! `memvisor bench qmp`: the round trip of one QMP command on a live server's control socket,
//! beside qemu-storage-daemon's monitor where it runs here.
//!
//! Starts each server with one disk (a 64 MiB image) and a QMP socket: memvisor as
//! `memvisor vhost-user-blk --control` (the binary [`crate::server_binary`] gives; no root),
//! qemu-storage-daemon from the real-guest harness's QEMU root (`guest/qemu.sh`; root and
//! `target/guest/root` needed, skipped with the reason otherwise) with the same image exported
//! as vhost-user-blk and `--monitor` on a socket. Connects as any QMP client does (reads the
//! greeting, sends `qmp_capabilities`), then sends the disk's statistics query — memvisor's
//! `query-stats`, qsd's `query-blockstats` — and waits for its answer, one at a time, many
//! times. A round trip is timed from just before the command is written to just after its answer
//! line is read. memvisor's answer carries more than qsd's (its pin registry, `/proc/self/status`
//! and `/proc/self/maps`, the latency histograms), so the rows compare what an operator's poll
//! costs on each, not equal work. Each run gives the median and the 99th percentile of its round
//! trips; the rows are the median of those over the runs (min and max beside). Not in the
//! default run: it starts server binaries, which the benchmark builds when missing or stale.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Ctx, Experiment, Mode, Outcome, Row, Stats, Table};

pub struct Qmp;

const NAME: &str = "qmp";
const DIR: &str = "target/bench-qmp";

/// The server, stopped (SIGKILL, then reaped) however the experiment ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A QMP client in command mode, line by line.
struct Session {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    line: String,
}

impl Session {
    fn connect(path: &Path) -> Result<Session, String> {
        let sock = UnixStream::connect(path).map_err(|e| format!("{}: {e}", path.display()))?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let writer = sock.try_clone().map_err(|e| e.to_string())?;
        let mut s = Session {
            reader: BufReader::new(sock),
            writer,
            line: String::new(),
        };
        let greeting = s.read()?;
        if !greeting.starts_with("{\"QMP\"") {
            return Err(format!("not a QMP greeting: {greeting}"));
        }
        s.round_trip("{\"execute\":\"qmp_capabilities\"}")?;
        Ok(s)
    }

    fn read(&mut self) -> Result<String, String> {
        self.line.clear();
        match self.reader.read_line(&mut self.line) {
            Ok(0) => Err("the control socket closed".into()),
            Ok(_) => Ok(self.line.clone()),
            Err(e) => Err(format!("reading the control socket: {e}")),
        }
    }

    /// Sends `command` and reads its answer (no event can come: nothing connects to the
    /// device); an error answer is an error.
    fn round_trip(&mut self, command: &str) -> Result<(), String> {
        // One write per command, as a QMP client makes it (`writeln!` would write the newline
        // on its own, a second system call inside the round trip measured).
        (self.writer)
            .write_all(format!("{command}\n").as_bytes())
            .map_err(|e| e.to_string())?;
        self.line.clear();
        self.reader
            .read_line(&mut self.line)
            .map_err(|e| format!("reading the control socket: {e}"))?;
        if !self.line.starts_with("{\"return\"") {
            return Err(format!("{command} answered {}", self.line.trim()));
        }
        Ok(())
    }
}

/// The servers compared: memvisor, and qemu-storage-daemon where it runs here.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Peer {
    Memvisor,
    Qsd,
}

impl Peer {
    fn name(self) -> &'static str {
        match self {
            Peer::Memvisor => "memvisor",
            Peer::Qsd => "qemu-storage-daemon",
        }
    }

    /// The command that asks for the disk's statistics.
    fn command(self) -> &'static str {
        match self {
            Peer::Memvisor => "{\"execute\":\"query-stats\"}",
            Peer::Qsd => "{\"execute\":\"query-blockstats\"}",
        }
    }

    /// Why it cannot run here, if it cannot.
    fn missing(self, top: &Path) -> Option<String> {
        match self {
            Peer::Memvisor => None,
            Peer::Qsd if !crate::is_root() => {
                Some("qemu-storage-daemon: needs root (it runs in the QEMU root, chroot)".into())
            }
            Peer::Qsd
                if !top
                    .join("target/guest/root/usr/bin/qemu-storage-daemon")
                    .exists() =>
            {
                Some(
                    "qemu-storage-daemon: target/guest/root is not built (guest/trial.sh builds \
                     it on first use)"
                        .into(),
                )
            }
            Peer::Qsd => None,
        }
    }
}

/// Starts `peer` with one disk and a QMP socket in `dir` (relative paths: qsd runs in a chroot
/// whose working directory is `dir`); returns it and the socket's path.
fn start(top: &Path, dir: &Path, peer: Peer) -> Result<(Server, PathBuf), String> {
    const IMAGE: &str = "disk.img";
    const SOCK: &str = "blk.sock";
    const CTL: &str = "ctl.sock";
    let image = std::fs::File::create(dir.join(IMAGE)).map_err(|e| e.to_string())?;
    image.set_len(64 << 20).map_err(|e| e.to_string())?;
    let (sock, ctl) = (dir.join(SOCK), dir.join(CTL));
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(&ctl);
    let mut cmd = match peer {
        Peer::Memvisor => {
            let mut c = Command::new(crate::server_binary(top)?);
            c.args(["vhost-user-blk", "--socket", SOCK, "--disk", IMAGE])
                .args(["--control", CTL])
                .env("RUST_LOG", "warn");
            c
        }
        Peer::Qsd => {
            let mut c = Command::new(top.join("guest/qemu.sh"));
            c.env("BIN", "qemu-storage-daemon")
                .arg(top.join("target/guest/root"))
                .arg("--blockdev")
                .arg(format!("driver=file,node-name=file,filename={IMAGE}"))
                .args(["--blockdev", "driver=raw,node-name=disk,file=file"])
                .arg("--export")
                .arg(format!(
                    "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path={SOCK},\
                     writable=on"
                ))
                .arg("--chardev")
                .arg(format!("socket,id=mon,path={CTL},server=on,wait=off"))
                .args(["--monitor", "chardev=mon"]);
            c
        }
    };
    let child = cmd
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", peer.name()))?;
    let server = Server(child);
    let t0 = Instant::now();
    while !ctl.exists() {
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!("{}: {} never appeared", peer.name(), ctl.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok((server, ctl))
}

/// `runs` runs of `trips` round trips of `peer`'s statistics query: each run's median and p99
/// (µs).
fn measure(
    ctx: &mut Ctx,
    top: &Path,
    peer: Peer,
    runs: u32,
    trips: usize,
) -> anyhow::Result<(Stats, Stats)> {
    let dir = PathBuf::from(DIR).join(peer.name());
    std::fs::create_dir_all(&dir)?;
    let (_server, ctl) = start(top, &dir, peer).map_err(anyhow::Error::msg)?;
    let mut session = Session::connect(&ctl).map_err(anyhow::Error::msg)?;
    // Warm up: the first answers pay for page faults and lazy set-up.
    for _ in 0..50 {
        session
            .round_trip(peer.command())
            .map_err(anyhow::Error::msg)?;
    }
    let (mut medians, mut p99s) = (Vec::new(), Vec::new());
    let mut progress = ctx.progress(&format!("{NAME} {}", peer.name()), u64::from(runs));
    for _ in 0..runs {
        let mut us = Vec::with_capacity(trips);
        for _ in 0..trips {
            let t0 = Instant::now();
            session
                .round_trip(peer.command())
                .map_err(anyhow::Error::msg)?;
            us.push(t0.elapsed().as_nanos() as f64 / 1000.0);
        }
        us.sort_by(f64::total_cmp);
        medians.push(quantile(&us, 0.5));
        p99s.push(quantile(&us, 0.99));
        progress.inc(1);
    }
    progress.finish();
    Ok((Stats::from_samples(&medians), Stats::from_samples(&p99s)))
}

/// The `q` quantile of `sorted` (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

impl Experiment for Qmp {
    fn name(&self) -> &'static str {
        NAME
    }

    fn title(&self) -> &'static str {
        "QMP: a disk-statistics round trip on a live server's control socket, beside qsd"
    }

    fn about(&self) -> &'static str {
        "Starts `memvisor vhost-user-blk --control` and qemu-storage-daemon (root, the harness's \
         QEMU root) with one disk each, negotiates as a QMP client, then times query-stats \
         (memvisor) and query-blockstats (qsd) round trips one at a time; per run the median and \
         the 99th percentile, the rows the median over the runs."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(5);
        let trips = match ctx.mode {
            Mode::Quick => 500,
            Mode::Full => 10_000,
        };
        let top = std::env::current_dir()?;
        let mut out = Outcome::default();
        let mut table = Table::new(
            "QMP round trip on the control socket, one disk served: µs (lower is better)",
            &["server", "command", "median µs", "p99 µs", "round trips"],
        );
        let mut ranges = Vec::new();
        for peer in [Peer::Memvisor, Peer::Qsd] {
            if let Some(why) = peer.missing(&top) {
                out.skipped.push(why);
                continue;
            }
            let (median, p99) = measure(ctx, &top, peer, runs, trips)?;
            let case = "disk statistics round trip";
            for (metric, stats) in [("median", &median), ("p99", &p99)] {
                out.rows
                    .push(Row::new(NAME, case, peer.name(), metric, "µs", stats));
            }
            let command = peer.command();
            let command = command
                .trim_start_matches("{\"execute\":\"")
                .trim_end_matches("\"}");
            table.push(vec![
                peer.name().into(),
                command.into(),
                format!("{:.1}", median.median),
                format!("{:.1}", p99.median),
                format!("{runs} × {trips}"),
            ]);
            ranges.push(format!(
                "{}: median {:.1}–{:.1}, p99 {:.1}–{:.1}",
                peer.name(),
                median.min,
                median.max,
                p99.min,
                p99.max
            ));
        }
        table.note = Some(format!(
            "{runs} runs of {trips} round trips after 50 to warm up, the servers one after the \
             other; a run's figures are its median and 99th percentile, the table's the median \
             over the runs (min–max: {}). memvisor's answer carries more (pins, /proc figures, \
             latency histograms) than qsd's query-blockstats",
            ranges.join("; ")
        ));
        out.tables.push(table);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::quantile;

    #[test]
    fn quantiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&[7.0], 0.99), 7.0);
    }
}
