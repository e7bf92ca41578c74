//! `memvisor bench qmp`: the round trip of one QMP command on a live server's control socket.
//!
//! Starts the server (`memvisor vfio-user --control`, the binary [`crate::server_binary`] gives;
//! no root, no guest), connects to its control socket as any QMP client does (reads the
//! greeting, sends `qmp_capabilities`), then sends `query-stats` and waits for its answer, one
//! at a time, many times. A round trip is timed from just before the command is written to just
//! after its answer line is read: the server parses the command, reads its live figures (the
//! DMA table, the pin registry, `/proc/self/status` and `/proc/self/maps`) and writes the
//! answer through its writer thread. Each run gives the median and the 99th percentile of its
//! round trips; the rows are the median of those over the runs (min and max beside). Not in
//! the default run: it starts the server binary, which the benchmark builds when it is missing
//! or stale.

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
        writeln!(self.writer, "{command}").map_err(|e| e.to_string())?;
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

fn start(dir: &Path) -> Result<(Server, PathBuf), String> {
    let top = std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?;
    let bin = crate::server_binary(&top)?;
    let (sock, ctl) = (dir.join("vfio.sock"), dir.join("ctl.sock"));
    let _ = std::fs::remove_file(&sock);
    let _ = std::fs::remove_file(&ctl);
    let child = Command::new(&bin)
        .arg("vfio-user")
        .arg("--socket")
        .arg(&sock)
        .arg("--control")
        .arg(&ctl)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
    let server = Server(child);
    let t0 = Instant::now();
    while !ctl.exists() {
        if t0.elapsed() > Duration::from_secs(20) {
            return Err(format!("{} never appeared", ctl.display()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok((server, ctl))
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
        "QMP: a query-stats round trip on a live server's control socket"
    }

    fn about(&self) -> &'static str {
        "Starts `memvisor vfio-user --control`, negotiates as a QMP client, then times \
         query-stats round trips one at a time; per run the median and the 99th percentile, \
         the rows the median over the runs."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(5);
        let trips = match ctx.mode {
            Mode::Quick => 500,
            Mode::Full => 10_000,
        };
        let dir = PathBuf::from(DIR);
        std::fs::create_dir_all(&dir)?;
        let (_server, ctl) = start(&dir).map_err(anyhow::Error::msg)?;
        let mut session = Session::connect(&ctl).map_err(anyhow::Error::msg)?;
        let command = "{\"execute\":\"query-stats\"}";
        // Warm up: the first answers pay for page faults and lazy set-up.
        for _ in 0..50 {
            session.round_trip(command).map_err(anyhow::Error::msg)?;
        }
        let (mut medians, mut p99s) = (Vec::new(), Vec::new());
        let mut progress = ctx.progress(NAME, u64::from(runs));
        for _ in 0..runs {
            let mut us = Vec::with_capacity(trips);
            for _ in 0..trips {
                let t0 = Instant::now();
                session.round_trip(command).map_err(anyhow::Error::msg)?;
                us.push(t0.elapsed().as_nanos() as f64 / 1000.0);
            }
            us.sort_by(f64::total_cmp);
            medians.push(quantile(&us, 0.5));
            p99s.push(quantile(&us, 0.99));
            progress.inc(1);
        }
        progress.finish();
        let median = Stats::from_samples(&medians);
        let p99 = Stats::from_samples(&p99s);
        let mut out = Outcome::default();
        let case = "query-stats round trip";
        for (metric, stats) in [("median", &median), ("p99", &p99)] {
            out.rows
                .push(Row::new(NAME, case, "memvisor", metric, "µs", stats));
        }
        let mut table = Table::new(
            "QMP round trip on the control socket: µs (lower is better)",
            &["command", "median µs", "p99 µs", "round trips"],
        );
        table.push(vec![
            "query-stats (vfio-user, no client)".into(),
            format!("{:.1}", median.median),
            format!("{:.1}", p99.median),
            format!("{runs} × {trips}"),
        ]);
        table.note = Some(format!(
            "{runs} runs of {trips} round trips after 50 to warm up; a run's figures are its \
             median and 99th percentile, the table's the median over the runs (min–max: median \
             {:.1}–{:.1}, p99 {:.1}–{:.1})",
            median.min, median.max, p99.min, p99.max
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
