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
//! O_DIRECT mode) and qemu-storage-daemon with `aio=threads` and `aio=io_uring`, each through
//! the host page cache (`cache.direct=off`) and O_DIRECT (`cache.direct=on`); and **the limit**:
//! no back end, the same client making the same requests straight on the image through
//! io_uring (blkio-bench's `io_uring` driver with `direct=0|1` and `num-queues=Q`; `qemu-img
//! bench -f raw -i io_uring -t none|writeback`), what the kernel alone does. Every row gets a
//! freshly started back end, so the figures of one row are its own: ops/s from the client; CPU
//! per request of the back end (user + system time of its process over the row, from /proc)
//! and of the client (the rusage of the reaped child); cores used, that CPU over the client's
//! wall time (a row at 1.8 or more is marked core-bound: on 2 cores, client, back end and
//! kernel then compete, while the limit is one process); and for memvisor the time its data
//! path spent holding each request's buffers and letting them go (the device's `holds`,
//! `hold_ns`, `release_ns` in its `--stats`, what `query-stats` reports) and, with registered
//! buffers (`BENCH_BLK_FIXED=1`: `--fixed-buffers`), the share of its reads and writes that
//! went out as io_uring fixed transfers, the share that went the ordinary way and why, and the
//! chunks it registered (`fixed`, `fixed_ordinary`, `fixed_fallbacks`, `chunks_registered`,
//! `register_ns`). Rounds (`--runs N`)
//! each run every row on every back end and the limit; figures are medians over the rounds,
//! and each round starts every row with the next one in turn. The image is read through
//! before every page-cached run, so each starts warm. Before each round's rows it measures the
//! process hop ([`hop`]): what one thread's wake-up by another costs here, and with it the
//! ceiling two such hops leave any back end on each QD1 row (the table "QD1 and the process
//! hop").
//!
//! Needs root and the QEMU root the real-guest trials build (`guest/mkroot.sh`, which this
//! builds when missing): the clients and qemu-storage-daemon run from it. Not in the default
//! run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Ctx, Experiment, Mode, Outcome, Row, Stats, Table, is_root};

mod counts;
mod hop;
use counts::{DeviceCounts, device_counts};

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
    QsdThreads,
    QsdIoUring,
    /// No back end: the same client, the same requests, through libblkio's `io_uring` driver
    /// (blkio-bench) or `qemu-img bench -i io_uring` straight on the image, with the row's cache
    /// mode. What the kernel alone does; the bound every back end is measured against.
    Limit,
}

impl Server {
    fn name(self) -> &'static str {
        match self {
            Server::Memvisor => "memvisor",
            Server::QsdThreads => "qsd aio=threads",
            Server::QsdIoUring => "qsd aio=io_uring",
            Server::Limit => "limit (io_uring on the image)",
        }
    }
}

const SERVERS: [Server; 4] = [
    Server::Memvisor,
    Server::QsdThreads,
    Server::QsdIoUring,
    Server::Limit,
];
const MEMVISOR: usize = 0;
const QSD_THREADS: usize = 1;
const QSD_IO_URING: usize = 2;
const LIMIT: usize = 3;

/// Cores used at or above which a row is marked core-bound: client, back end and kernel share
/// the machine's cores (2 on the project's machine), while the limit runs in one process.
const CORE_BOUND: f64 = 1.8;

/// What the rows are served from: the path every back end and the limit open (relative to the
/// bench directory, which the QEMU root sees as /w) and QEMU's driver for it.
struct Image {
    /// Its name in the tables.
    label: &'static str,
    path: &'static str,
    /// `file` for a regular file, `host_device` for a block device.
    qemu_driver: &'static str,
}

const FILE: Image = Image {
    label: "file",
    path: IMAGE,
    qemu_driver: "file",
};

/// The loop device's node in the bench directory, so the QEMU root (which has no /dev/loop*)
/// sees it as /w/loop.dev.
const LOOP_NODE: &str = "loop.dev";

const LOOP: Image = Image {
    label: "loop device",
    path: LOOP_NODE,
    qemu_driver: "host_device",
};

/// A loop device over the image for one cache mode's rows (`--direct-io=on` for O_DIRECT, so
/// the loop itself does not go through the page cache either), with a node for it in the bench
/// directory. It is detached on every exit path: right after attaching, `losetup -d` is run
/// while this holds the device open, and the kernel then marks it autoclear, so it goes away
/// when its last opener closes it: when this value is dropped, or when the process ends,
/// however it ends.
struct Loop {
    node: PathBuf,
    _open: std::fs::File,
}

impl Loop {
    fn attach(dir: &Path, direct: bool) -> Result<Loop, String> {
        let io = if direct {
            "--direct-io=on"
        } else {
            "--direct-io=off"
        };
        let out = Command::new("losetup")
            .args(["--find", "--show", io])
            .arg(dir.join(IMAGE))
            .output()
            .map_err(|e| format!("cannot run losetup: {e}"))?;
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if !out.status.success() || dev.is_empty() {
            return Err(format!(
                "losetup --find --show {io} failed (no loop support?): {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let open = std::fs::File::open(&dev).map_err(|e| format!("{dev}: {e}"));
        let cleared = Command::new("losetup").args(["-d", &dev]).status();
        let open = open?;
        if !cleared.is_ok_and(|s| s.success()) {
            return Err(format!(
                "losetup -d {dev} (to make it autoclear) failed; detach it by hand"
            ));
        }
        let name = dev.trim_start_matches("/dev/");
        let dio =
            std::fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
        if direct && dio.trim() != "1" {
            return Err(format!(
                "{dev}: the kernel did not take --direct-io=on (loop/dio is {:?}): the image's \
                 file system cannot do O_DIRECT",
                dio.trim()
            ));
        }
        use std::os::unix::fs::MetadataExt;
        let rdev = open.metadata().map_err(|e| format!("{dev}: {e}"))?.rdev();
        let node = dir.join(LOOP_NODE);
        let _ = std::fs::remove_file(&node);
        let made = Command::new("mknod")
            .arg(&node)
            .arg("b")
            .arg(libc::major(rdev).to_string())
            .arg(libc::minor(rdev).to_string())
            .status();
        if !made.is_ok_and(|s| s.success()) {
            return Err(format!("mknod {} for {dev} failed", node.display()));
        }
        Ok(Loop { node, _open: open })
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.node);
        // `_open` closes after this: the last opener, so the kernel detaches the device.
    }
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

/// Starts one back end on `SOCK` in `dir` with `queues` queues, serving `image` (a path
/// relative to `dir`); returns its process (whose pid is the server's own: qemu.sh execs down
/// to qemu-storage-daemon). Not for [`Server::Limit`], which has none.
fn start(
    top: &Path,
    dir: &Path,
    server: Server,
    image: &Image,
    direct: bool,
    queues: u16,
) -> Result<Child, String> {
    let _ = std::fs::remove_file(dir.join(SOCK));
    let _ = std::fs::remove_file(dir.join(STATS));
    let mut cmd = match server {
        Server::Memvisor => {
            let mut c = Command::new(crate::server_binary(top)?);
            c.args(["vhost-user-blk", "--socket", SOCK, "--disk", image.path])
                .args(["--queues", &queues.to_string(), "--stats", STATS]);
            if direct {
                c.arg("--direct");
            }
            // BENCH_BLK_FIXED=1: the memvisor rows with registered buffers (--fixed-buffers),
            // to set side by side with a run without.
            if std::env::var_os("BENCH_BLK_FIXED").is_some_and(|v| v == "1") {
                c.arg("--fixed-buffers");
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
                    "driver={},node-name=file,filename={},cache.direct={},aio={aio}",
                    image.qemu_driver,
                    image.path,
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
        Server::Limit => return Err("the limit row has no back end".into()),
    };
    let child = die_with_bench(&mut cmd)
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

/// Has the child (a back end or a client) get SIGTERM when the bench dies, however it dies, so
/// none outlives it, holding the loop device open (guest/qemu.sh execs down to the program, and
/// the signal setting survives exec).
fn die_with_bench(cmd: &mut Command) -> &mut Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec and makes one prctl call,
    // which is async-signal-safe and touches only the child.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    }
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

/// User + system CPU time of this process's reaped children so far, in ns.
fn children_cpu_ns() -> f64 {
    // SAFETY: getrusage writes only the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_CHILDREN is always valid.
    if unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut ru) } != 0 {
        return f64::NAN;
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e9 + t.tv_usec as f64 * 1e3;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// What one client run gave: its ops/s, its own CPU time (user + system of it and what it
/// waited for: the mounts of guest/qemu.sh, a few ms) and its wall time, start to exit.
struct ClientRun {
    ops: f64,
    cpu_ns: f64,
    wall_ns: f64,
}

/// Runs one row's client, against the back end's socket in `dir` or, for [`Server::Limit`],
/// straight on `image` with the row's cache mode (`direct`).
fn run_client(
    top: &Path,
    dir: &Path,
    case: &Case,
    count: u64,
    limit: Option<(&Image, bool)>,
) -> Result<ClientRun, String> {
    let mut c = Command::new(top.join("guest/qemu.sh"));
    c.arg(top.join("target/guest/root"));
    match case.client {
        Client::QemuImg => {
            c.env("BIN", "qemu-img").arg("bench");
            match limit {
                None => {
                    c.arg("--image-opts").arg(format!(
                        "driver=virtio-blk-vhost-user,path={SOCK},cache.direct=on"
                    ));
                }
                Some((_, direct)) => {
                    c.args(["-f", "raw", "-i", "io_uring"])
                        .args(["-t", if direct { "none" } else { "writeback" }]);
                }
            }
            c.args(["-c", &count.to_string()])
                .args(["-d", &case.depth.to_string()])
                .args(["-s", &case.size.to_string()]);
            if case.write {
                c.arg("-w");
            }
            if let Some((image, _)) = limit {
                c.arg(image.path);
            }
        }
        Client::Blkio => {
            let (driver, path, direct) = match limit {
                None => ("virtio-blk-vhost-user", SOCK, false),
                Some((image, direct)) => ("io_uring", image.path, direct),
            };
            c.env("BIN", format!("/w/{CLIENT}"))
                .args([driver, path, if direct { "1" } else { "0" }])
                .arg(case.queues.to_string())
                .arg(case.depth.to_string())
                .arg(case.size.to_string())
                .arg(if case.write { "randwrite" } else { "randread" })
                .arg(count.to_string());
        }
    }
    let cpu0 = children_cpu_ns();
    let t0 = Instant::now();
    let out = die_with_bench(&mut c)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("cannot run the client: {e}"))?;
    let wall_ns = t0.elapsed().as_nanos() as f64;
    let cpu_ns = children_cpu_ns() - cpu0;
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
    let ops = match case.client {
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
    }?;
    Ok(ClientRun {
        ops,
        cpu_ns,
        wall_ns,
    })
}

/// One row on one back end.
#[derive(Clone, Copy)]
struct Sample {
    ops: f64,
    /// The back end's CPU per request (NaN for the limit, which has none).
    server_ns: f64,
    /// The client's CPU per request.
    client_ns: f64,
    /// (back end + client CPU) / the client's wall time.
    cores: f64,
    /// memvisor's own counters ([`DeviceCounts::NONE`] for the others).
    device: DeviceCounts,
}

impl Sample {
    /// Back end and client CPU per request (the client alone for the limit).
    fn cpu_ns(&self) -> f64 {
        if self.server_ns.is_nan() {
            self.client_ns
        } else {
            self.server_ns + self.client_ns
        }
    }
}

/// A figure of the JSON rows: metric name, unit, and how to read it from a sample.
type Metric = (&'static str, &'static str, fn(&Sample) -> f64);

/// One mode's samples: `[server][case]`, one per round.
type PerServer = Vec<Vec<Vec<Sample>>>;

/// Starts `server` (none for the limit), runs `case` against it, stops it; returns the row's
/// figures.
fn run_row(
    top: &Path,
    dir: &Path,
    server: Server,
    image: &Image,
    direct: bool,
    case: &Case,
    count: u64,
) -> Result<Sample, String> {
    if server == Server::Limit {
        let run = run_client(top, dir, case, count, Some((image, direct)))?;
        return Ok(Sample {
            ops: run.ops,
            server_ns: f64::NAN,
            client_ns: run.cpu_ns / count as f64,
            cores: run.cpu_ns / run.wall_ns,
            device: DeviceCounts::NONE,
        });
    }
    let child = start(top, dir, server, image, direct, case.queues)?;
    let pid = child.id();
    let cpu0 = cpu_ns(pid);
    let run = run_client(top, dir, case, count, None);
    let cpu1 = cpu_ns(pid);
    stop(child);
    let run = run?;
    let device = match server {
        Server::Memvisor => device_counts(dir).unwrap_or(DeviceCounts::NONE),
        _ => DeviceCounts::NONE,
    };
    let server_cpu = cpu1 - cpu0;
    Ok(Sample {
        ops: run.ops,
        server_ns: server_cpu / count as f64,
        client_ns: run.cpu_ns / count as f64,
        cores: (server_cpu + run.cpu_ns) / run.wall_ns,
        device,
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

/// Reads the image (file or device) once so the page-cached rows start warm.
fn warm(path: &Path) {
    if let Ok(mut f) = std::fs::File::open(path) {
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
         in turn, on one 1 GiB image, through the host page cache and O_DIRECT; and the limit: \
         the same clients on the image through io_uring with no back end. Each row starts a \
         fresh back end. ops/s are medians over rounds (--runs) that each run every row on \
         every back end and the limit; CPU per request is the back end's and the client's \
         user+system time; cores used is that CPU over wall time (>= 1.8: core-bound); hold + \
         release is the time memvisor's data path spent holding and releasing each request's \
         buffers (holds, hold_ns, release_ns of its --stats); fixed / ordinary / fallback is \
         the share of its reads and writes sent through registered buffers or not \
         (BENCH_BLK_FIXED=1 turns them on), with the chunks registered; the process hop (one \
         thread waking another, sleeping and spinning) and the ceiling two sleeping hops leave a \
         back end on each QD1 row. Needs root and the QEMU root of the real-guest trials."
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
        let images: [&Image; 2] = [&FILE, &LOOP];
        // samples[mode][image][server][case]: one per round
        let mut samples: Vec<Vec<PerServer>> =
            vec![vec![vec![vec![Vec::new(); CASES.len()]; SERVERS.len()]; images.len()]; 2];
        let total = 2 * rounds as usize * images.len() * SERVERS.len() * CASES.len();
        let mut progress = ctx.progress("blk", total as u64);
        // The process hop, once a round before its rows (a fraction of a second): the physical
        // limit under the QD1 rows, measured in the same run as they are.
        let mut hops = Vec::new();
        for round in 0..rounds {
            match hop::measure() {
                Some(h) => hops.push(h),
                None => out.notes.push(format!(
                    "round {round}: the process hop could not be measured"
                )),
            }
            for (m, direct) in [false, true].into_iter().enumerate() {
                for (i, image) in images.iter().enumerate() {
                    // The loop rows: a device attached for this mode, or skipped visibly.
                    let _device = if image.path == LOOP_NODE {
                        match Loop::attach(&dir, direct) {
                            Ok(l) => Some(l),
                            Err(why) => {
                                let why =
                                    format!("blk: loop-device rows ({}): {why}", mode_name(direct));
                                if !out.skipped.contains(&why) {
                                    out.skipped.push(why);
                                }
                                progress.inc((SERVERS.len() * CASES.len()) as u64);
                                continue;
                            }
                        }
                    } else {
                        None
                    };
                    for (c, case) in CASES.iter().enumerate() {
                        // Each round starts the row with another back end, so what one leaves
                        // behind (dirty pages being written back) does not always fall on the
                        // same next one; the limit takes its turn among them.
                        for k in 0..SERVERS.len() {
                            let s = (k + round as usize) % SERVERS.len();
                            let server = SERVERS[s];
                            // O_DIRECT rows drop what they write from the page cache, and other
                            // work on the machine evicts it: every page-cached run starts warm,
                            // or the first back end of a row pays the disk reads for the others.
                            if !direct {
                                warm(&dir.join(image.path));
                            }
                            let count = case.count / scale;
                            match run_row(&top, &dir, server, image, direct, case, count) {
                                Ok(v) => samples[m][i][s][c].push(v),
                                Err(why) => out.notes.push(format!(
                                    "round {round}: {} {} {} {}: {why}",
                                    server.name(),
                                    image.label,
                                    mode_name(direct),
                                    case.name
                                )),
                            }
                            progress.inc(1);
                        }
                    }
                }
            }
        }
        progress.finish();
        let _ = std::fs::remove_file(dir.join(SOCK));

        for (m, mode) in ["page cache", "O_DIRECT"].into_iter().enumerate() {
            for (i, image) in images.iter().enumerate() {
                if samples[m][i]
                    .iter()
                    .all(|per_case| per_case.iter().all(Vec::is_empty))
                {
                    continue;
                }
                let (ops_t, cpu_t) = tables(&samples[m][i], mode, image, rounds, &mut out.rows);
                out.tables.push(ops_t);
                out.tables.push(cpu_t);
            }
        }
        if !hops.is_empty() {
            let qd1 = hop::table(&samples, &images, &hops, &mut out.rows);
            out.tables.push(qd1);
        }
        Ok(out)
    }
}

/// The cache mode's name.
fn mode_name(direct: bool) -> &'static str {
    if direct { "O_DIRECT" } else { "page cache" }
}

/// A cell of `v` with `prec` decimals, or `-`.
fn cell(v: Option<f64>, prec: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.prec$}"))
}

/// Cores used, marked when the row is core-bound.
fn cores_cell(v: Option<f64>) -> String {
    match v {
        Some(x) if x >= CORE_BOUND => format!("{x:.2} core-bound"),
        other => cell(other, 2),
    }
}

/// memvisor / `other` for one row: the median of each round's own ratio (the back ends of a
/// round ran the row one after another, so a slow spell of the machine that hit one round
/// weighs once); without complete rounds, the ratio of the medians.
fn ratio_of(mv: &[f64], other: &[f64], rounds: u32) -> Option<String> {
    if mv.len() == rounds as usize && other.len() == mv.len() && !mv.is_empty() {
        return Some(super::ratio_cell(&super::ratio(mv, other)));
    }
    let med = |v: &[f64]| (!v.is_empty()).then(|| Stats::from_samples(v).median);
    med(mv)
        .zip(med(other))
        .map(|(a, b)| format!("{:.2}x", a / b))
}

/// The two tables of one cache mode on one image (ops/s and ratios; CPU and cores), and the
/// JSON rows of every figure.
fn tables(
    samples: &PerServer,
    mode: &str,
    image: &Image,
    rounds: u32,
    rows: &mut Vec<Row>,
) -> (Table, Table) {
    let med = |s: usize, c: usize, f: fn(&Sample) -> f64| {
        let v: Vec<f64> = samples[s][c]
            .iter()
            .map(f)
            .filter(|x| x.is_finite())
            .collect();
        (!v.is_empty()).then(|| Stats::from_samples(&v))
    };
    let metrics: [Metric; 13] = [
        ("ops/s", "ops/s", |x| x.ops),
        ("back end cpu per request", "ns", |x| x.server_ns),
        ("client cpu per request", "ns", |x| x.client_ns),
        ("cpu per request", "ns", Sample::cpu_ns),
        ("cores used", "cores", |x| x.cores),
        ("hold per request", "ns", |x| x.device.hold_ns),
        ("release per request", "ns", |x| x.device.release_ns),
        ("fixed share", "%", |x| x.device.fixed_pct),
        ("fixed ordinary share", "%", |x| x.device.ordinary_pct),
        ("fixed fallback share", "%", |x| x.device.fallback_pct),
        ("chunks registered", "chunks", |x| x.device.chunks),
        ("register time", "ns", |x| x.device.register_ns),
        ("evictions", "chunks", |x| x.device.evictions),
    ];
    let mut ops_t = Table::new(
        &format!(
            "vhost-user-blk on the {}, {mode}: ops/s (higher is better), memvisor against the \
             limit and qsd's better configuration; medians of {rounds} rounds",
            image.label
        ),
        &[
            "case",
            "memvisor",
            "qsd aio=threads",
            "qsd aio=io_uring",
            "limit",
            "memvisor / limit",
            "memvisor / best qsd",
        ],
    );
    let mut cpu_t = Table::new(
        &format!(
            "vhost-user-blk on the {}, {mode}: CPU µs per request (back end + client; the \
             limit: the client alone) and cores used; medians of {rounds} rounds",
            image.label
        ),
        &[
            "case",
            "memvisor back end + client µs",
            "memvisor cores",
            "best qsd back end + client µs",
            "best qsd cores",
            "limit µs",
            "limit cores",
            "memvisor hold + release ns",
            "memvisor fixed / ordinary / fallback %",
            "memvisor chunks (register ms)",
        ],
    );
    for (c, case) in CASES.iter().enumerate() {
        for (s, server) in SERVERS.iter().enumerate() {
            for (metric, unit, f) in metrics {
                if let Some(st) = med(s, c, f) {
                    rows.push(Row::new(
                        "blk",
                        &format!("{} {} {mode}", case.name, image.label),
                        server.name(),
                        metric,
                        unit,
                        &st,
                    ));
                }
            }
        }
        let ops = |s: usize| med(s, c, |x| x.ops).map(|st| st.median);
        let us = |s: usize, f: fn(&Sample) -> f64| med(s, c, f).map(|st| st.median / 1e3);
        let cores = |s: usize| med(s, c, |x| x.cores).map(|st| st.median);
        // qsd's better configuration on this row: the one with the higher median ops/s.
        let best = match (ops(QSD_THREADS), ops(QSD_IO_URING)) {
            (Some(t), Some(u)) if t > u => QSD_THREADS,
            (Some(_), None) => QSD_THREADS,
            _ => QSD_IO_URING,
        };
        let by_round = |s: usize| -> Vec<f64> { samples[s][c].iter().map(|x| x.ops).collect() };
        let mv = by_round(MEMVISOR);
        let best_qsd: Vec<f64> = samples[QSD_THREADS][c]
            .iter()
            .zip(&samples[QSD_IO_URING][c])
            .map(|(t, u)| t.ops.max(u.ops))
            .collect();
        let hold = med(MEMVISOR, c, |x| x.device.hold_ns + x.device.release_ns).map(|st| st.median);
        let share = |f: fn(&Sample) -> f64| med(MEMVISOR, c, f).map(|st| st.median);
        let fixed = match (
            share(|x| x.device.fixed_pct),
            share(|x| x.device.ordinary_pct),
            share(|x| x.device.fallback_pct),
        ) {
            (Some(f), Some(o), Some(b)) => format!("{f:.1} / {o:.1} / {b:.1}"),
            _ => "-".into(),
        };
        let chunks = match (share(|x| x.device.chunks), share(|x| x.device.register_ns)) {
            (Some(n), Some(ns)) => format!("{n:.0} ({:.1})", ns / 1e6),
            _ => "-".into(),
        };
        let cpu = |s: usize| {
            let server = us(s, |x| x.server_ns);
            let client = us(s, |x| x.client_ns);
            match (server, client) {
                (Some(a), Some(b)) => format!("{a:.1} + {b:.1}"),
                _ => "-".into(),
            }
        };
        ops_t.push(vec![
            case.name.into(),
            cell(ops(MEMVISOR), 0),
            cell(ops(QSD_THREADS), 0),
            cell(ops(QSD_IO_URING), 0),
            cell(ops(LIMIT), 0),
            ratio_of(&mv, &by_round(LIMIT), rounds).unwrap_or_else(|| "-".into()),
            ratio_of(&mv, &best_qsd, rounds).unwrap_or_else(|| "-".into()),
        ]);
        cpu_t.push(vec![
            case.name.into(),
            cpu(MEMVISOR),
            cores_cell(cores(MEMVISOR)),
            format!(
                "{} ({})",
                cpu(best),
                if best == QSD_THREADS {
                    "threads"
                } else {
                    "io_uring"
                }
            ),
            cores_cell(cores(best)),
            cell(us(LIMIT, |x| x.client_ns), 1),
            cores_cell(cores(LIMIT)),
            cell(hold, 0),
            fixed,
            chunks,
        ]);
    }
    ops_t.note = Some(
        "Sequential rows: qemu-img bench (one queue); random and two-queue rows: blkio-bench \
         (libblkio, a thread per queue). memvisor and qsd through libblkio's \
         virtio-blk-vhost-user driver, each row on a freshly started back end; the limit is the \
         same client and requests with no back end: blkio-bench's io_uring driver (path=, \
         direct=, num-queues=) or qemu-img bench -f raw -i io_uring -t none|writeback, on the \
         same image in the same round. Ratios are medians over rounds of that round's own ratio \
         (lowest–highest in brackets); best qsd is the better of its two configurations in each \
         round. Targets (issue 48): O_DIRECT >= 0.8x the limit, page cache >= 0.5x, and 1.2x \
         the best qsd."
            .into(),
    );
    cpu_t.note = Some(format!(
        "CPU per request: the back end's user + system time over the row (/proc/PID/stat, clock \
         ticks) + the client's (getrusage of the reaped child, with guest/qemu.sh's few ms of \
         mounts), divided by requests. Cores used: that CPU over the client's wall time; at \
         >= {CORE_BOUND} a row is core-bound (client, back end and kernel share the machine's \
         cores while the limit is one process; kernel threads such as loop workers are not \
         counted). Best qsd: the configuration with the higher median ops/s. Hold + release: \
         memvisor's walk of the device space per request (DmaSpace::hold_sg) and its release, \
         wall time from its --stats (holds, hold_ns, release_ns). Fixed / ordinary / \
         fallback: the shares of memvisor's reads and writes sent as io_uring fixed transfers \
         through a registered chunk, sent the ordinary way for want of one (cold, evicted, over \
         two chunks), and sent the ordinary way because the host refused registration (fixed, \
         fixed_ordinary, fixed_fallbacks over reads + writes); all 0 with fixed buffers off \
         (BENCH_BLK_FIXED=1 turns them on). Chunks: 2 MiB chunks registered over the row and \
         the time that took (chunks_registered, register_ns)."
    ));
    (ops_t, cpu_t)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_at_the_core_bound_are_marked() {
        assert_eq!(cores_cell(Some(1.79)), "1.79");
        assert_eq!(cores_cell(Some(1.8)), "1.80 core-bound");
        assert_eq!(cores_cell(None), "-");
    }

    #[test]
    fn ratios_are_per_round_when_rounds_are_complete() {
        // Per round: 2/1 and 1/1: median of the two ratios, not of the medians (1.5/1.0).
        assert_eq!(
            ratio_of(&[2.0, 1.0], &[1.0, 1.0], 2).as_deref(),
            Some("1.50x (1.00–2.00)")
        );
        // A round missing on one side: the ratio of the medians.
        assert_eq!(ratio_of(&[2.0, 4.0], &[2.0], 2).as_deref(), Some("1.50x"));
        assert_eq!(ratio_of(&[], &[1.0], 1), None);
    }
}
