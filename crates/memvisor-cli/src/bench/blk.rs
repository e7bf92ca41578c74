//! `memvisor bench blk`: memvisor's vhost-user-blk back end beside qemu-storage-daemon's export,
//! both driven by the same client — `qemu-img bench` through QEMU's blkio driver (libblkio's
//! virtio-blk-vhost-user) — on the same 1 GiB image, in turn, in one run.
//!
//! Back ends: memvisor (`vhost-user-blk`, `--direct` in the O_DIRECT mode) and
//! qemu-storage-daemon with `aio=threads` and `aio=io_uring`, each through the host page cache
//! (`cache.direct=off`) and O_DIRECT (`cache.direct=on`). Rows: 4 KiB reads at queue depth 1 and
//! 32, 4 KiB writes at 32, 128 KiB reads at 8 (qemu-img bench's sequential pattern). Each round
//! starts every back end in turn and runs every row against it; figures are medians over the
//! rounds. Besides ops/s, the back end's CPU time per request (user + system time of its
//! process over the row, from /proc). The page-cached image is read once before the rounds.
//!
//! Needs root and the QEMU root the real-guest trials build (`guest/mkroot.sh`, which this
//! builds when missing): qemu-img and qemu-storage-daemon run from it. Not in the default run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Ctx, Experiment, Mode, Outcome, Row, Stats, Table};

pub struct BlkBench;

const DIR: &str = "target/bench-blk";
const IMAGE: &str = "disk.img";
const SOCK: &str = "blk.sock";
const IMAGE_BYTES: u64 = 1 << 30;

/// One row: request size, queue depth, write or read, requests per run (full mode).
struct Case {
    name: &'static str,
    size: u64,
    depth: u32,
    write: bool,
    count: u64,
}

const CASES: [Case; 4] = [
    Case {
        name: "4 KiB QD1 read",
        size: 4096,
        depth: 1,
        write: false,
        count: 40_000,
    },
    Case {
        name: "4 KiB QD32 read",
        size: 4096,
        depth: 32,
        write: false,
        count: 200_000,
    },
    Case {
        name: "4 KiB QD32 write",
        size: 4096,
        depth: 32,
        write: true,
        count: 100_000,
    },
    Case {
        name: "128 KiB QD8 read",
        size: 128 << 10,
        depth: 8,
        write: false,
        count: 8_000,
    },
];

#[derive(Clone, Copy, PartialEq)]
enum Server {
    Memvisor,
    QsdThreads,
    QsdIoUring,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Memvisor => "memvisor",
            Server::QsdThreads => "qsd aio=threads",
            Server::QsdIoUring => "qsd aio=io_uring",
        }
    }
}

const SERVERS: [Server; 3] = [Server::Memvisor, Server::QsdThreads, Server::QsdIoUring];

fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The tree's top directory (where guest/ and target/ are), absolute.
fn top() -> Result<PathBuf, String> {
    let here = std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?;
    if here.join("guest/qemu.sh").exists() {
        Ok(here)
    } else {
        Err("guest/qemu.sh not found: run from the memvisor source tree".into())
    }
}

/// Starts one back end on `SOCK` in `dir`; returns its process (whose pid is the server's own:
/// qemu.sh execs down to qemu-storage-daemon).
fn start(top: &Path, dir: &Path, server: Server, direct: bool) -> Result<Child, String> {
    let _ = std::fs::remove_file(dir.join(SOCK));
    let mut cmd = match server {
        Server::Memvisor => {
            let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
            let mut c = Command::new(exe);
            c.args(["vhost-user-blk", "--socket", SOCK, "--disk", IMAGE]);
            if direct {
                c.arg("--direct");
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
                    "type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path={SOCK},writable=on"
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

/// Runs one qemu-img bench; returns (ops/s, back end CPU ns per request).
fn bench_one(
    top: &Path,
    dir: &Path,
    pid: u32,
    case: &Case,
    count: u64,
) -> Result<(f64, f64), String> {
    let mut c = Command::new(top.join("guest/qemu.sh"));
    c.env("BIN", "qemu-img")
        .arg(top.join("target/guest/root"))
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
    let cpu0 = cpu_ns(pid);
    let out = c
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run qemu-img bench: {e}"))?;
    let cpu1 = cpu_ns(pid);
    let text = String::from_utf8_lossy(&out.stdout);
    let secs = text
        .lines()
        .find_map(|l| l.strip_prefix("Run completed in "))
        .and_then(|r| r.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .ok_or_else(|| {
            format!(
                "qemu-img bench gave no time: {} {}",
                text.trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })?;
    Ok((count as f64 / secs, (cpu1 - cpu0) / count as f64))
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

impl Experiment for BlkBench {
    fn name(&self) -> &'static str {
        "blk"
    }

    fn title(&self) -> &'static str {
        "vhost-user-blk under libblkio (qemu-img bench): memvisor beside qemu-storage-daemon"
    }

    fn about(&self) -> &'static str {
        "qemu-img bench through QEMU's blkio driver (libblkio virtio-blk-vhost-user, \
         cache.direct=on on the client) against memvisor's vhost-user-blk and \
         qemu-storage-daemon's export (aio=threads, aio=io_uring), in turn, on one 1 GiB image, \
         through the host page cache and O_DIRECT. Rows: 4 KiB reads at QD1 and QD32, 4 KiB \
         writes at QD32, 128 KiB reads at QD8 (sequential). ops/s are medians over rounds that \
         each run every back end; CPU is the back end's user+system time per request. Needs \
         root and the QEMU root of the real-guest trials."
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
                "blk: needs root (qemu-img and qemu-storage-daemon run in the QEMU root, in a \
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
        if let Err(why) = make_image(&dir) {
            out.skipped.push(format!("blk: {why}"));
            return Ok(out);
        }
        let rounds = ctx.runs.unwrap_or(match ctx.mode {
            Mode::Quick => 2,
            Mode::Full => 5,
        });
        let scale = match ctx.mode {
            Mode::Quick => 4,
            Mode::Full => 1,
        };
        // samples[mode][server][case] = (ops/s, cpu ns per request) per round
        let mut samples = vec![vec![vec![Vec::new(); CASES.len()]; SERVERS.len()]; 2];
        warm(&dir);
        let mut progress = ctx.progress(
            "blk",
            (2 * rounds as usize * SERVERS.len() * CASES.len()) as u64,
        );
        for round in 0..rounds {
            for (m, direct) in [false, true].into_iter().enumerate() {
                for (s, &server) in SERVERS.iter().enumerate() {
                    let child = match start(&top, &dir, server, direct) {
                        Ok(c) => c,
                        Err(why) => {
                            out.notes.push(format!("round {round}: {why}"));
                            continue;
                        }
                    };
                    let pid = child.id();
                    for (c, case) in CASES.iter().enumerate() {
                        match bench_one(&top, &dir, pid, case, case.count / scale) {
                            Ok(v) => samples[m][s][c].push(v),
                            Err(why) => out.notes.push(format!(
                                "{} {} {}: {why}",
                                server.name(),
                                if direct { "O_DIRECT" } else { "page cache" },
                                case.name
                            )),
                        }
                        progress.inc(1);
                    }
                    stop(child);
                }
            }
        }
        progress.finish();
        let _ = std::fs::remove_file(dir.join(SOCK));

        for (m, mode) in ["page cache", "O_DIRECT"].into_iter().enumerate() {
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
                    "qsd io_uring CPU µs",
                ],
            );
            for (c, case) in CASES.iter().enumerate() {
                let med = |s: usize, k: usize| {
                    let v: Vec<f64> = samples[m][s][c]
                        .iter()
                        .map(|p: &(f64, f64)| if k == 0 { p.0 } else { p.1 })
                        .collect();
                    (!v.is_empty()).then(|| Stats::from_samples(&v))
                };
                for (s, server) in SERVERS.iter().enumerate() {
                    for (k, metric, unit) in [(0, "ops/s", "ops/s"), (1, "cpu per request", "ns")] {
                        if let Some(st) = med(s, k) {
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
                let ops = |s: usize| med(s, 0).map(|st| st.median);
                let cpu = |s: usize| med(s, 1).map(|st| st.median / 1e3);
                let cell =
                    |v: Option<f64>, prec: usize| v.map_or("-".into(), |x| format!("{x:.prec$}"));
                let best_qsd = ops(1).into_iter().chain(ops(2)).reduce(f64::max);
                let ratio = ops(0).zip(best_qsd).map(|(a, b)| a / b);
                t.push(vec![
                    case.name.into(),
                    cell(ops(0), 0),
                    cell(ops(1), 0),
                    cell(ops(2), 0),
                    ratio.map_or("-".into(), |r| format!("{r:.2}x")),
                    cell(cpu(0), 1),
                    cell(cpu(2), 1),
                ]);
            }
            t.note = Some(
                "The client is qemu-img bench through libblkio (one queue, sequential offsets); \
                 the target is 1.2x the best qsd on every row."
                    .into(),
            );
            out.tables.push(t);
        }
        Ok(out)
    }
}
