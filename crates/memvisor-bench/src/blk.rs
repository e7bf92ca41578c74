//! `memvisor bench blk`: memvisor's vhost-user-blk back end beside qemu-storage-daemon's export,
//! both driven by the same libblkio clients (virtio-blk-vhost-user) on the same 1 GiB image, in
//! turn, in one run.
//!
//! Clients: `qemu-img bench` through QEMU's blkio driver for the sequential one-queue rows (the
//! figures of issue 35), and `blkio-bench` (guest/blkio-bench.c, built by
//! guest/build-client.sh into the QEMU root's libraries) for random offsets and for two queues —
//! libblkio with `num-queues=2` and a thread per queue, which qemu-img bench cannot do (it
//! drives one queue; fio's libblkio engine could, but Debian's fio lacks it).
//!
//! Back ends: memvisor (`vhost-user-blk`, `--queues` as the row needs, `--direct` in the
//! O_DIRECT mode), memvisor with `--long-term-pins` on the rows with 32 requests in flight, and
//! qemu-storage-daemon with `aio=threads` and `aio=io_uring`, each through the host page cache
//! (`cache.direct=off`) and O_DIRECT (`cache.direct=on`). Every row gets a freshly started back
//! end, so the figures of one row are its own: ops/s from the client, the back end's CPU time
//! per request (user + system time of its process over the row, from /proc), and for memvisor
//! the time its data path spent holding each request's buffers and letting them go (the
//! device's `holds`, `hold_ns`, `release_ns` in its `--stats`, what `query-stats` reports). Rounds (`--runs N`) each run every row on every back end;
//! figures are medians over the rounds, and each round starts every row with the next back end
//! in turn. The image is read through before every page-cached run, so each starts warm.
//!
//! Needs root and the QEMU root the real-guest trials build (`guest/mkroot.sh`, which this
//! builds when missing): the clients and qemu-storage-daemon run from it. Not in the default
//! run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Ctx, Experiment, Mode, Outcome, Row, Stats, Table, is_root};

pub struct BlkBench;

const DIR: &str = "target/bench-blk";
const IMAGE: &str = "disk.img";
const SOCK: &str = "blk.sock";
const STATS: &str = "memvisor-stats.json";
const CLIENT: &str = "blkio-bench";
const IMAGE_BYTES: u64 = 1 << 30;

/// Which client drives a row.
#[derive(Clone, Copy, PartialEq)]
enum Client {
    /// qemu-img bench: one queue, sequential offsets.
    QemuImg,
    /// blkio-bench: random offsets, any number of queues.
    Blkio,
}

/// One row: request size, queue depth (per queue), queues, write or read, the client (which
/// says sequential or random), requests per run (full mode).
struct Case {
    name: &'static str,
    size: u64,
    depth: u32,
    queues: u16,
    write: bool,
    client: Client,
    count: u64,
}

impl Case {
    /// Requests in flight over all queues.
    fn in_flight(&self) -> u32 {
        self.depth * u32::from(self.queues)
    }
}

const fn seq(name: &'static str, size: u64, depth: u32, write: bool, count: u64) -> Case {
    Case {
        name,
        size,
        depth,
        queues: 1,
        write,
        client: Client::QemuImg,
        count,
    }
}

const fn rand(name: &'static str, depth: u32, queues: u16, write: bool, count: u64) -> Case {
    Case {
        name,
        size: 4096,
        depth,
        queues,
        write,
        client: Client::Blkio,
        count,
    }
}

const CASES: [Case; 10] = [
    seq("4 KiB QD1 read", 4096, 1, false, 40_000),
    seq("4 KiB QD32 read", 4096, 32, false, 200_000),
    seq("4 KiB QD32 write", 4096, 32, true, 100_000),
    seq("128 KiB QD8 read", 128 << 10, 8, false, 8_000),
    rand("4 KiB QD1 randread", 1, 1, false, 40_000),
    rand("4 KiB QD32 randread", 32, 1, false, 200_000),
    rand("4 KiB QD1 randwrite", 1, 1, true, 40_000),
    rand("4 KiB QD32 randwrite", 32, 1, true, 100_000),
    rand("4 KiB 2 queues x QD16 randread", 16, 2, false, 200_000),
    rand("4 KiB 2 queues x QD16 randwrite", 16, 2, true, 100_000),
];

#[derive(Clone, Copy, PartialEq)]
enum Server {
    Memvisor,
    /// memvisor with `--long-term-pins`: run on the rows with 32 in flight only, for the pin
    /// cost beside the lock cache's.
    MemvisorLongTerm,
    QsdThreads,
    QsdIoUring,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Memvisor => "memvisor",
            Server::MemvisorLongTerm => "memvisor long-term pins",
            Server::QsdThreads => "qsd aio=threads",
            Server::QsdIoUring => "qsd aio=io_uring",
        }
    }

    fn runs(self, case: &Case) -> bool {
        self != Server::MemvisorLongTerm || case.in_flight() >= 32
    }
}

const SERVERS: [Server; 4] = [
    Server::Memvisor,
    Server::MemvisorLongTerm,
    Server::QsdThreads,
    Server::QsdIoUring,
];
const MEMVISOR: usize = 0;
const LONG_TERM: usize = 1;
const QSD_THREADS: usize = 2;
const QSD_IO_URING: usize = 3;

/// The tree's top directory (where guest/ and target/ are), absolute.
fn top() -> Result<PathBuf, String> {
    let here = std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?;
    if here.join("guest/qemu.sh").exists() {
        Ok(here)
    } else {
        Err("guest/qemu.sh not found: run from the memvisor source tree".into())
    }
}

/// Starts one back end on `SOCK` in `dir` with `queues` queues; returns its process (whose pid
/// is the server's own: qemu.sh execs down to qemu-storage-daemon).
fn start(
    top: &Path,
    dir: &Path,
    server: Server,
    direct: bool,
    queues: u16,
) -> Result<Child, String> {
    let _ = std::fs::remove_file(dir.join(SOCK));
    let _ = std::fs::remove_file(dir.join(STATS));
    let mut cmd = match server {
        Server::Memvisor | Server::MemvisorLongTerm => {
            let mut c = Command::new(crate::server_binary(top)?);
            c.args(["vhost-user-blk", "--socket", SOCK, "--disk", IMAGE])
                .args(["--queues", &queues.to_string(), "--stats", STATS]);
            if direct {
                c.arg("--direct");
            }
            if server == Server::MemvisorLongTerm {
                c.arg("--long-term-pins");
            }
            c.env("RUST_LOG", "warn");
            c
        }
        Server::QsdThreads | Server::QsdIoUring => {
            let aio = if server == Server::QsdThreads {
                "threads"
            } else {
                "io_uring"
            };
            let mut c = Command::new(top.join("guest/qemu.sh"));
            c.env("BIN", "qemu-storage-daemon")
                .arg(top.join("target/guest/root"))
                .arg("--blockdev")
                .arg(format!(
                    "driver=file,node-name=file,filename={IMAGE},cache.direct={},aio={aio}",
                    if direct { "on" } else { "off" }
                ))
                .args(["--blockdev", "driver=raw,node-name=disk,file=file"])
                .arg("--export")
                .arg(format!(
                    "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path={SOCK},\
                     writable=on,num-queues={queues}"
                ));
            c
        }
    };
    let child = cmd
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", server.name()))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while !dir.join(SOCK).exists() {
        if Instant::now() > deadline {
            stop(child);
            return Err(format!(
                "{} did not create its socket in 10 s",
                server.name()
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(child)
}

fn stop(mut child: Child) {
    // SAFETY: kill of a child we spawned and have not reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    let _ = child.wait();
}

/// User + system CPU time of process `pid` so far, in ns (from /proc/PID/stat).
fn cpu_ns(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        f.get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the state.
    // SAFETY: sysconf has no side effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / hz * 1e9
}

/// Runs one row's client against the back end in `dir`; returns its ops/s.
fn run_client(top: &Path, dir: &Path, case: &Case, count: u64) -> Result<f64, String> {
    let mut c = Command::new(top.join("guest/qemu.sh"));
    c.arg(top.join("target/guest/root"));
    match case.client {
        Client::QemuImg => {
            c.env("BIN", "qemu-img")
                .args(["bench", "--image-opts"])
                .arg(format!(
                    "driver=virtio-blk-vhost-user,path={SOCK},cache.direct=on"
                ))
                .args(["-c", &count.to_string()])
                .args(["-d", &case.depth.to_string()])
                .args(["-s", &case.size.to_string()]);
            if case.write {
                c.arg("-w");
            }
        }
        Client::Blkio => {
            c.env("BIN", format!("/w/{CLIENT}"))
                .arg(SOCK)
                .arg(case.queues.to_string())
                .arg(case.depth.to_string())
                .arg(case.size.to_string())
                .arg(if case.write { "randwrite" } else { "randread" })
                .arg(count.to_string());
        }
    }
    let out = c
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run the client: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let failed = || {
        format!(
            "the client gave no figure: {} {}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    };
    if !out.status.success() {
        return Err(failed());
    }
    match case.client {
        Client::QemuImg => text
            .lines()
            .find_map(|l| l.strip_prefix("Run completed in "))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|secs| count as f64 / secs)
            .ok_or_else(failed),
        Client::Blkio => text
            .split_whitespace()
            .find_map(|w| w.strip_prefix("ops_per_sec="))
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(failed),
    }
}

/// memvisor's hold and release time per request from its `--stats` file: (hold ns, release
/// ns). These are the device's own counters (`holds`, `hold_ns`, `release_ns` of
/// `memvisor_vhost::blk::BlkStats`, flattened into the report's top level: the same names
/// `query-stats` gives), not the `pin_cost` object kept for older readers.
fn hold_cost(dir: &Path) -> Option<(f64, f64)> {
    let text = std::fs::read_to_string(dir.join(STATS)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    hold_cost_of(&v)
}

/// [`hold_cost`] of a parsed report.
fn hold_cost_of(v: &serde_json::Value) -> Option<(f64, f64)> {
    let get = |k: &str| v.get(k).and_then(|x| x.as_u64());
    let holds = get("holds").filter(|&n| n > 0)?;
    Some((
        get("hold_ns")? as f64 / holds as f64,
        get("release_ns")? as f64 / holds as f64,
    ))
}

/// One row on one back end.
#[derive(Clone, Copy)]
struct Sample {
    ops: f64,
    cpu_ns: f64,
    hold_ns: f64,
    release_ns: f64,
}

/// A figure of the JSON rows: metric name, unit, and how to read it from a sample.
type Metric = (&'static str, &'static str, fn(&Sample) -> f64);

/// One mode's samples: `[server][case]`, one per round.
type PerServer = Vec<Vec<Vec<Sample>>>;

/// Starts `server`, runs `case` against it, stops it; returns the row's figures.
fn run_row(
    top: &Path,
    dir: &Path,
    server: Server,
    direct: bool,
    case: &Case,
    count: u64,
) -> Result<Sample, String> {
    let child = start(top, dir, server, direct, case.queues)?;
    let pid = child.id();
    let cpu0 = cpu_ns(pid);
    let ops = run_client(top, dir, case, count);
    let cpu1 = cpu_ns(pid);
    stop(child);
    let ops = ops?;
    let (hold_ns, release_ns) = match server {
        Server::Memvisor | Server::MemvisorLongTerm => {
            hold_cost(dir).unwrap_or((f64::NAN, f64::NAN))
        }
        _ => (f64::NAN, f64::NAN),
    };
    Ok(Sample {
        ops,
        cpu_ns: (cpu1 - cpu0) / count as f64,
        hold_ns,
        release_ns,
    })
}

/// Creates the image (written through once, so reads meet data, not holes).
fn make_image(dir: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let path = dir.join(IMAGE);
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == IMAGE_BYTES) {
        return Ok(());
    }
    use std::io::Write;
    let mut f = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let chunk: Vec<u8> = (0..1u32 << 20).map(|i| (i * 131 + 7) as u8).collect();
    for _ in 0..IMAGE_BYTES >> 20 {
        f.write_all(&chunk)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    f.sync_all().map_err(|e| format!("{}: {e}", path.display()))
}

/// Reads the image once so the page-cached rows start warm.
fn warm(dir: &Path) {
    if let Ok(mut f) = std::fs::File::open(dir.join(IMAGE)) {
        let _ = std::io::copy(&mut f, &mut std::io::sink());
    }
}

/// Builds blkio-bench (guest/build-client.sh, cached) and puts it beside the image, where the
/// QEMU root sees it as /w/blkio-bench.
fn build_client(top: &Path, dir: &Path) -> Result<(), String> {
    let out = top.join("target/guest/client");
    let built = Command::new(top.join("guest/build-client.sh"))
        .arg(top.join("target/guest/root"))
        .arg(&out)
        .stdout(Stdio::null())
        .status();
    if !built.is_ok_and(|s| s.success()) {
        return Err("guest/build-client.sh could not build blkio-bench".into());
    }
    std::fs::copy(out.join(CLIENT), dir.join(CLIENT))
        .map(|_| ())
        .map_err(|e| format!("copying {CLIENT}: {e}"))
}

impl Experiment for BlkBench {
    fn name(&self) -> &'static str {
        "blk"
    }

    fn title(&self) -> &'static str {
        "vhost-user-blk under libblkio clients: memvisor beside qemu-storage-daemon"
    }

    fn about(&self) -> &'static str {
        "libblkio clients (virtio-blk-vhost-user): qemu-img bench for sequential one-queue rows, \
         blkio-bench (guest/blkio-bench.c) for random offsets and two queues, against \
         memvisor's vhost-user-blk and qemu-storage-daemon's export (aio=threads, aio=io_uring), \
         in turn, on one 1 GiB image, through the host page cache and O_DIRECT. Each row starts \
         a fresh back end. ops/s are medians over rounds (--runs) that each run every row on \
         every back end; CPU is the back end's user+system time per request; pin cost is the \
         time memvisor's data path spent holding and releasing each request's buffers (holds, \
         hold_ns, release_ns of its --stats; and --long-term-pins on the rows with 32 in flight). Needs root and the QEMU root of the \
         real-guest trials."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let mut out = Outcome::default();
        let top = match top() {
            Ok(t) => t,
            Err(why) => {
                out.skipped.push(format!("blk: {why}"));
                return Ok(out);
            }
        };
        if !is_root() {
            out.skipped.push(
                "blk: needs root (the clients and qemu-storage-daemon run in the QEMU root, in a \
                 mount namespace)"
                    .into(),
            );
            return Ok(out);
        }
        let root = top.join("target/guest/root");
        let built = Command::new(top.join("guest/mkroot.sh"))
            .arg(&root)
            .stdout(Stdio::null())
            .status();
        if !built.is_ok_and(|s| s.success()) {
            out.skipped
                .push("blk: guest/mkroot.sh could not build the QEMU root".into());
            return Ok(out);
        }
        let dir = top.join(DIR);
        if let Err(why) = make_image(&dir).and_then(|()| build_client(&top, &dir)) {
            out.skipped.push(format!("blk: {why}"));
            return Ok(out);
        }
        let rounds = ctx.runs_or(match ctx.mode {
            Mode::Quick => 1,
            Mode::Full => 3,
        });
        let scale = match ctx.mode {
            Mode::Quick => 4,
            Mode::Full => 1,
        };
        // samples[mode][server][case]: one per round
        let mut samples: Vec<PerServer> =
            vec![vec![vec![Vec::new(); CASES.len()]; SERVERS.len()]; 2];
        let runs_per_round: usize = SERVERS
            .iter()
            .map(|s| CASES.iter().filter(|c| s.runs(c)).count())
            .sum();
        let mut progress = ctx.progress("blk", (2 * rounds as usize * runs_per_round) as u64);
        for round in 0..rounds {
            for (m, direct) in [false, true].into_iter().enumerate() {
                for (c, case) in CASES.iter().enumerate() {
                    // Each round starts the row with another back end, so what one leaves
                    // behind (dirty pages being written back) does not always fall on the same
                    // next one.
                    for k in 0..SERVERS.len() {
                        let s = (k + round as usize) % SERVERS.len();
                        let server = SERVERS[s];
                        if !server.runs(case) {
                            continue;
                        }
                        // O_DIRECT rows drop what they write from the page cache, and other
                        // work on the machine evicts it: every page-cached run starts warm, or
                        // the first back end of a row pays the disk reads for the others.
                        if !direct {
                            warm(&dir);
                        }
                        match run_row(&top, &dir, server, direct, case, case.count / scale) {
                            Ok(v) => samples[m][s][c].push(v),
                            Err(why) => out.notes.push(format!(
                                "round {round}: {} {} {}: {why}",
                                server.name(),
                                if direct { "O_DIRECT" } else { "page cache" },
                                case.name
                            )),
                        }
                        progress.inc(1);
                    }
                }
            }
        }
        progress.finish();
        let _ = std::fs::remove_file(dir.join(SOCK));

        for (m, mode) in ["page cache", "O_DIRECT"].into_iter().enumerate() {
            let med = |s: usize, c: usize, f: fn(&Sample) -> f64| {
                let v: Vec<f64> = samples[m][s][c]
                    .iter()
                    .map(f)
                    .filter(|x| x.is_finite())
                    .collect();
                (!v.is_empty()).then(|| Stats::from_samples(&v))
            };
            let metrics: [Metric; 4] = [
                ("ops/s", "ops/s", |x| x.ops),
                ("cpu per request", "ns", |x| x.cpu_ns),
                ("hold per request", "ns", |x| x.hold_ns),
                ("release per request", "ns", |x| x.release_ns),
            ];
            let cell =
                |v: Option<f64>, prec: usize| v.map_or("-".into(), |x| format!("{x:.prec$}"));
            let mut t = Table::new(
                &format!(
                    "vhost-user-blk, {mode}: ops/s (higher is better) and the back end's CPU µs \
                     per request; medians of {rounds} rounds"
                ),
                &[
                    "case",
                    "memvisor",
                    "qsd aio=threads",
                    "qsd aio=io_uring",
                    "memvisor / best qsd",
                    "memvisor CPU µs",
                    "qsd threads CPU µs",
                    "qsd io_uring CPU µs",
                ],
            );
            let mut pins = Table::new(
                &format!(
                    "vhost-user-blk, {mode}: what holding its pages costs memvisor per request, \
                     the one walk (hold_sg) + release in ns; medians of {rounds} rounds"
                ),
                &[
                    "case",
                    "hold + release ns",
                    "share of memvisor CPU",
                    "long-term: hold + release ns",
                    "long-term ops/s",
                    "long-term CPU µs",
                ],
            );
            for (c, case) in CASES.iter().enumerate() {
                for (s, server) in SERVERS.iter().enumerate() {
                    for (metric, unit, f) in metrics {
                        if let Some(st) = med(s, c, f) {
                            out.rows.push(Row::new(
                                "blk",
                                &format!("{} {mode}", case.name),
                                server.name(),
                                metric,
                                unit,
                                &st,
                            ));
                        }
                    }
                }
                let ops = |s: usize| med(s, c, |x| x.ops).map(|st| st.median);
                let cpu = |s: usize| med(s, c, |x| x.cpu_ns).map(|st| st.median / 1e3);
                let pin = |s: usize| med(s, c, |x| x.hold_ns + x.release_ns).map(|st| st.median);
                let best_qsd = ops(QSD_THREADS)
                    .into_iter()
                    .chain(ops(QSD_IO_URING))
                    .reduce(f64::max);
                // The ratio is the median of each round's own ratio (the back ends of a round
                // ran the row one after another), so a slow spell of the machine that hit one
                // round weighs once; without complete rounds, the ratio of the medians.
                let mv: Vec<f64> = samples[m][MEMVISOR][c].iter().map(|x| x.ops).collect();
                let best: Vec<f64> = samples[m][QSD_THREADS][c]
                    .iter()
                    .zip(&samples[m][QSD_IO_URING][c])
                    .map(|(t, u)| t.ops.max(u.ops))
                    .collect();
                let ratio = if mv.len() == rounds as usize && best.len() == mv.len() {
                    Some(super::ratio_cell(&super::ratio(&mv, &best)))
                } else {
                    ops(MEMVISOR)
                        .zip(best_qsd)
                        .map(|(a, b)| format!("{:.2}x", a / b))
                };
                t.push(vec![
                    case.name.into(),
                    cell(ops(MEMVISOR), 0),
                    cell(ops(QSD_THREADS), 0),
                    cell(ops(QSD_IO_URING), 0),
                    ratio.unwrap_or_else(|| "-".into()),
                    cell(cpu(MEMVISOR), 1),
                    cell(cpu(QSD_THREADS), 1),
                    cell(cpu(QSD_IO_URING), 1),
                ]);
                if case.in_flight() >= 32 {
                    let share = pin(MEMVISOR)
                        .zip(cpu(MEMVISOR))
                        .map(|(p, c)| format!("{:.0}%", p / (c * 1e3) * 100.0));
                    pins.push(vec![
                        case.name.into(),
                        cell(pin(MEMVISOR), 0),
                        share.unwrap_or_else(|| "-".into()),
                        cell(pin(LONG_TERM), 0),
                        cell(ops(LONG_TERM), 0),
                        cell(cpu(LONG_TERM), 1),
                    ]);
                }
            }
            t.note = Some(
                "Sequential rows: qemu-img bench through libblkio (one queue). Random and \
                 two-queue rows: blkio-bench (libblkio, a thread per queue). Each row on a \
                 freshly started back end. The ratio is the median over rounds of memvisor / the \
                 better qsd of that round (lowest–highest in brackets); the target is 1.2x on \
                 every row."
                    .into(),
            );
            pins.note = Some(
                "Wall time inside the request's one walk of the device space (DmaSpace::hold_sg: \
                 hold and translate) and its release, per request, from memvisor's --stats \
                 (the device's holds, hold_ns and release_ns, as query-stats gives them); the share is of memvisor's CPU time per request in the \
                 table above. Long-term: the same rows served with --long-term-pins."
                    .into(),
            );
            out.tables.push(t);
            out.tables.push(pins);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hold_cost_reads_the_device_counters() {
        let v = serde_json::json!({
            "holds": 4, "hold_ns": 2000, "release_ns": 1000,
            "pin_cost": {"pins": 1, "pin_ns": 9, "unpins": 1, "unpin_ns": 9}
        });
        assert_eq!(hold_cost_of(&v), Some((500.0, 250.0)));
        // No request held: no figure rather than a division by zero.
        let idle = serde_json::json!({"holds": 0, "hold_ns": 0, "release_ns": 0});
        assert_eq!(hold_cost_of(&idle), None);
        assert_eq!(hold_cost_of(&serde_json::json!({"pin_cost": {}})), None);
    }
}
