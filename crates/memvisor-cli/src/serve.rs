//! `memvisor vhost-user-blk` (and the devices that follow): serve a device on a vhost-user
//! socket until SIGINT or SIGTERM, then print (and optionally write) what it did.
//!
//! Several `--blk` / `--balloon` devices given to one process share memvisor's process-wide
//! state — one mapping per range of guest memory and one pin registry — so a balloon discard
//! never frees a page the block device has pinned for I/O in flight.
//!
//! `memvisor vfio-user` serves one vfio-user client at a time, one after another, as a
//! deployed device server must (QEMU reconnects after a restart or a migration): every
//! connection gets its own server, DMA table and device, and when its client hangs up or dies
//! the device is stopped and everything mapped, pinned or locked for it is released before the
//! next client is accepted. The process's `VmLck`, `VmPin` and mappings of client memory are
//! read from `/proc/self` before the first client and after each one, and reported.
//!
//! Every server gets its sockets from [`crate::listener`] (a path, `--fd`, or systemd's socket
//! activation; a live socket is never taken over) and tells a service manager it is ready
//! ([`crate::notify`]) once all of them listen. Test-only switches (feature `test-hooks`) are
//! read from `MEMVISOR_TEST_*` environment variables, and exist in no other build.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixListener;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};

use crate::listener::{self, SocketSpec};
use memvisor::dma::PinRegistry;
use memvisor_vhost::balloon::GuestStatsStatus;
use memvisor_vhost::{
    Backend, BackendStats, BalloonDevice, BalloonTarget, Blk, BlkOptions, BlkStats,
};
use serde::Serialize;

/// Set by SIGINT / SIGTERM.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

/// Installs the SIGINT/SIGTERM handler that stops the serving loops.
pub fn stop_on_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Tells a service manager the server is up: every socket listens.
fn ready() {
    crate::notify::notify("READY=1");
}

/// Tells a service manager the server is stopping: its devices have stopped serving.
fn stopping() {
    crate::notify::notify("STOPPING=1");
}

/// What a block back end did, for `--stats`.
#[derive(Serialize)]
pub struct BlkReport {
    /// Socket served.
    pub socket: String,
    /// What the protocol layer saw and the time it spent (connections, messages, IOTLB,
    /// dirty log), under the same names as [`BackendStats`].
    #[serde(flatten)]
    pub backend: BackendStats,
    /// Reads, writes, flushes.
    pub reads: u64,
    /// Writes.
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Bytes read into guest memory.
    pub bytes_read: u64,
    /// Bytes written from guest memory.
    pub bytes_written: u64,
    /// Failed requests.
    pub failed: u64,
    /// Of those, reads and writes the disk refused (EIO, ENOSPC).
    pub io_errors: u64,
    /// Of those, reads and writes whose pages could not be pinned (the locked-memory limit).
    pub pin_errors: u64,
    /// Requests whose chain was an indirect descriptor table.
    pub indirect: u64,
    /// Transfers copied through an aligned buffer (an O_DIRECT image, unaligned guest buffers).
    pub bounced: u64,
    /// Discard requests carried out.
    pub discards: u64,
    /// Write-zeroes requests carried out.
    pub write_zeroes: u64,
    /// Batches of reads and writes handed to the kernel together.
    pub batches: u64,
    /// The most reads and writes out with the kernel at once.
    pub most_in_flight: u64,
    /// Requests by pinned 4 KiB pages, as `[pages up to, requests]`.
    pub npage_histogram: Vec<(u64, u64)>,
}

impl BlkReport {
    fn new(socket: String, b: &BackendStats, s: &BlkStats) -> Self {
        BlkReport {
            socket,
            backend: *b,
            reads: s.reads,
            writes: s.writes,
            flushes: s.flushes,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            failed: s.failed,
            io_errors: s.io_errors,
            pin_errors: s.pin_errors,
            indirect: s.indirect,
            bounced: s.bounced,
            discards: s.discards,
            write_zeroes: s.write_zeroes,
            batches: s.batches,
            most_in_flight: s.most_in_flight,
            npage_histogram: s
                .npage_histogram
                .iter()
                .enumerate()
                .filter(|(_, n)| **n > 0)
                .map(|(i, n)| (1u64 << i, *n))
                .collect(),
        }
    }
}

/// What `memvisor vhost-user-blk` did: the device, and the process's pin registry after it.
#[derive(Serialize)]
pub struct BlkServeReport {
    /// The device.
    #[serde(flatten)]
    pub device: BlkReport,
    /// The process's pin registry when the device had stopped.
    pub pins: PinReport,
    /// The registry and the kernel's count each time a frontend had left, before its memory
    /// was unmapped: one entry per connection.
    pub pins_at_disconnect: Vec<PinCheck>,
    /// What pinning and unpinning requests' pages cost the data path.
    pub pin_cost: PinCostReport,
}

/// The blk data path's pin cost ([`memvisor_vhost::pin_cost::PIN_COST`]), for `--stats`: requests
/// pinned and unpinned and the wall time spent in `DmaSpace::pin_pages` / `unpin_pages` for
/// them, over the whole process.
#[derive(Serialize, Default, Clone, Copy, Debug)]
pub struct PinCostReport {
    pub pins: u64,
    pub pin_ns: u64,
    pub unpins: u64,
    pub unpin_ns: u64,
}

impl PinCostReport {
    /// The counters now.
    pub fn now() -> PinCostReport {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &memvisor_vhost::pin_cost::PIN_COST;
        PinCostReport {
            pins: c.pins.load(Relaxed),
            pin_ns: c.pin_ns.load(Relaxed),
            unpins: c.unpins.load(Relaxed),
            unpin_ns: c.unpin_ns.load(Relaxed),
        }
    }
}

/// Serves a virtio-blk device over `disk` on `socket` until a signal; returns its report.
pub fn blk(
    socket: &SocketSpec,
    disk: &Path,
    options: BlkOptions,
    direct: bool,
    record_iotlb: Option<&Path>,
) -> Result<BlkServeReport> {
    let file = open_disk(disk, options.read_only, direct)?;
    let listener = listener::open(socket)?;
    listener::check_all_claimed()?;
    let mut backend = Backend::new(Blk::new(file, options)?)?;
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("MEMVISOR_TEST_NO_DIRTY_LOG").is_some() {
        log::warn!("TEST ONLY: the migration dirty log stays empty; migrations lose device writes");
        backend.disable_dirty_log_for_tests();
    }
    if let Some(path) = record_iotlb {
        let f = std::fs::File::create(path)
            .with_context(|| format!("cannot create IOTLB recording {}", path.display()))?;
        backend.record_iotlb(Box::new(std::io::BufWriter::new(f)));
    }
    let at_disconnect = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = at_disconnect.clone();
    backend.on_disconnect(Box::new(move || {
        let check = PinCheck::now();
        log::info!("vhost-user-blk: frontend gone, pins {check:?}");
        seen.lock().unwrap_or_else(|e| e.into_inner()).push(check);
    }));
    log::info!(
        "vhost-user-blk: serving {} on {}",
        disk.display(),
        listener.origin
    );
    ready();
    let served = backend.serve(&listener.socket, &STOP);
    stopping();
    served?;
    listener.remove();
    let device = BlkReport::new(listener.name(), &backend.stats, &backend.device().stats);
    drop(backend);
    let pins_at_disconnect = at_disconnect
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Ok(BlkServeReport {
        device,
        pins: PinReport::now(),
        pins_at_disconnect,
        pin_cost: PinCostReport::now(),
    })
}

/// Opens a disk image for a blk device: read-only or read-write, through the page cache or
/// `O_DIRECT`.
pub fn open_disk(disk: &Path, read_only: bool, direct: bool) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = OpenOptions::new();
    o.read(true).write(!read_only);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(disk).map_err(|e| {
        if direct && e.raw_os_error() == Some(libc::EINVAL) {
            anyhow::anyhow!(
                "cannot open disk image {} with O_DIRECT: its file system does not support it; \
                 leave out --direct to go through the page cache",
                disk.display()
            )
        } else {
            anyhow::Error::new(e).context(format!("cannot open disk image {}", disk.display()))
        }
    })
}

/// What a balloon back end did, for `--stats`.
#[derive(Serialize)]
pub struct BalloonReport {
    /// Socket served.
    pub socket: String,
    /// Connections served.
    pub connections: u64,
    /// Messages handled.
    pub messages: u64,
    /// Messages refused.
    pub refused: u64,
    /// Report chains taken.
    pub report_chains: u64,
    /// Chains refused whole.
    pub refused_chains: u64,
    /// Bytes given back to the host (reports and inflation).
    pub discarded: u64,
    /// Bytes kept because a pin held them.
    pub skipped_pinned: u64,
    /// Bytes refused by the discard rules.
    pub rejected: u64,
    /// Pages inflated.
    pub inflated_pages: u64,
    /// Pages deflated.
    pub deflated_pages: u64,
    /// Target at exit, pages.
    pub target_pages: u32,
    /// What the driver said it held at exit, pages (0 once a frontend left: the device was
    /// reset).
    pub actual_pages: u32,
    /// Pages the guest took back below the target by itself (deflate on OOM), summed.
    pub deflated_below_target_pages: u64,
    /// The statistics polling interval (0: the statistics queue was not offered).
    pub stats_interval_secs: u64,
    /// Statistics buffers taken, and those refused.
    pub stats_buffers: u64,
    pub refused_stats: u64,
    /// The guest's latest memory statistics, with their time.
    pub guest_stats: Option<GuestStatsStatus>,
}

/// Everything one `memvisor serve` process did.
#[derive(Serialize, Default)]
pub struct ServeReport {
    /// Block devices.
    pub blk: Vec<BlkReport>,
    /// Balloons.
    pub balloon: Vec<BalloonReport>,
    /// The process's pin registry when the devices had stopped.
    pub pins: PinReport,
}

/// What the process's pin registry ([`PinRegistry::global`]) says, for `--stats`.
#[derive(Serialize, Default)]
pub struct PinReport {
    /// Whether pins are held with long-term pins (`--long-term-pins`).
    pub long_term: bool,
    /// Runs of pages held long-term, and runs the kernel refused that were mlocked instead.
    pub long_term_pins: u64,
    pub long_term_fallbacks: u64,
    /// Bytes pins still charged, and bytes still pinned long-term (the cache's included).
    pub locked_bytes: u64,
    pub long_term_bytes: u64,
    /// The registry's held bytes beside the kernel's `VmLck` and `VmPin`, read at one moment.
    pub check: PinCheck,
}

/// [`PinRegistry::kernel_check`] of the process's registry, for `--stats`: what the registry
/// holds (held = charged + cached) and what `/proc/self/status` says at the same moment.
#[derive(Serialize, Default, Clone, Copy, Debug)]
pub struct PinCheck {
    pub held_bytes: u64,
    pub charged_bytes: u64,
    pub cached_bytes: u64,
    pub long_term_bytes: u64,
    pub vm_lck: Option<u64>,
    pub vm_pin: Option<u64>,
}

impl PinCheck {
    /// The global registry and the kernel now.
    pub fn now() -> PinCheck {
        let k = PinRegistry::global().kernel_check();
        PinCheck {
            held_bytes: k.held_bytes,
            charged_bytes: k.charged_bytes,
            cached_bytes: k.cached_bytes,
            long_term_bytes: k.long_term_bytes,
            vm_lck: k.vm_lck,
            vm_pin: k.vm_pin,
        }
    }
}

impl PinReport {
    /// The global registry now.
    pub fn now() -> PinReport {
        let registry = PinRegistry::global();
        let counts = registry.long_term_counts();
        PinReport {
            long_term: registry.long_term_pins(),
            long_term_pins: counts.pinned,
            long_term_fallbacks: counts.fallbacks,
            locked_bytes: registry.locked_bytes(),
            long_term_bytes: registry.long_term_bytes(),
            check: PinCheck::now(),
        }
    }
}

/// Turns long-term pins on for the process's registry, which every device here pins through
/// (`--long-term-pins`).
pub fn use_long_term_pins() -> Result<()> {
    PinRegistry::global()
        .set_long_term_pins(true)
        .context("--long-term-pins")?;
    log::info!("pins are held with long-term pins (io_uring, FOLL_LONGTERM), not mlock");
    Ok(())
}

/// Devices for [`serve`].
pub struct Devices {
    /// Block devices.
    pub blk: Vec<BlkSpec>,
    /// Balloon sockets.
    pub balloon: Vec<PathBuf>,
    /// Initial balloon target in MiB.
    pub balloon_target_mib: u32,
    /// Control socket: lines `target <MiB>` set the balloon target.
    pub control: Option<PathBuf>,
    /// Offer free page reporting on balloons.
    pub reporting: bool,
    /// Offer the balloons' statistics queue, polled at this interval (zero: not offered).
    pub balloon_stats_interval: Duration,
    /// Offer deflate-on-OOM on balloons.
    pub balloon_deflate_on_oom: bool,
    /// Offer `VIRTIO_F_IOMMU_PLATFORM` on the blk devices.
    pub iommu: bool,
}

/// One block device of `serve --blk`: `SOCKET=DISK[,queues=N][,read-only=on|off]
/// [,serial=TEXT][,direct=on|off][,poll-us=N]`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlkSpec {
    /// vhost-user socket.
    pub socket: PathBuf,
    /// Raw image.
    pub disk: PathBuf,
    /// Queues, read-only and serial (the IOMMU choice is the whole server's).
    pub options: BlkOptions,
    /// Open the image `O_DIRECT`.
    pub direct: bool,
}

impl std::str::FromStr for BlkSpec {
    type Err = anyhow::Error;

    fn from_str(arg: &str) -> Result<BlkSpec> {
        let example = "e.g. --blk run/blk.sock=disk.img,queues=2,serial=disk0,direct=on";
        let mut parts = arg.split(',');
        let first = parts.next().unwrap_or_default();
        let Some((socket, disk)) = first.split_once('=') else {
            anyhow::bail!("--blk {arg:?}: write SOCKET=DISK[,OPTION=VALUE...], {example}");
        };
        if socket.is_empty() || disk.is_empty() {
            anyhow::bail!("--blk {arg:?}: the socket and the disk must both be named, {example}");
        }
        let mut spec = BlkSpec {
            socket: PathBuf::from(socket),
            disk: PathBuf::from(disk),
            options: BlkOptions::default(),
            direct: false,
        };
        let on_off = |key: &str, v: &str| match v {
            "on" | "true" | "yes" => Ok(true),
            "off" | "false" | "no" => Ok(false),
            _ => Err(anyhow::anyhow!(
                "--blk {arg:?}: {key}={v:?}: write on or off"
            )),
        };
        for opt in parts {
            let Some((key, value)) = opt.split_once('=') else {
                anyhow::bail!("--blk {arg:?}: option {opt:?} has no value, {example}");
            };
            match key {
                "queues" => {
                    spec.options.queues = value
                        .parse()
                        .ok()
                        .filter(|q| (1..=64).contains(q))
                        .ok_or_else(|| {
                            anyhow::anyhow!("--blk {arg:?}: queues={value:?}: a number 1 to 64")
                        })?
                }
                "read-only" => spec.options.read_only = on_off(key, value)?,
                "poll-us" => {
                    spec.options.poll_us = value
                        .parse()
                        .ok()
                        .filter(|n| *n <= 1_000_000)
                        .ok_or_else(|| {
                            anyhow::anyhow!(
                                "--blk {arg:?}: poll-us={value:?}: microseconds, 0 to 1000000"
                            )
                        })?
                }
                "direct" => spec.direct = on_off(key, value)?,
                "serial" => {
                    if value.len() > 20 {
                        anyhow::bail!(
                            "--blk {arg:?}: serial {value:?} is {} bytes; virtio-blk's GET_ID \
                             holds 20",
                            value.len()
                        );
                    }
                    spec.options.serial = value.to_string();
                }
                _ => anyhow::bail!(
                    "--blk {arg:?}: unknown option {key:?}; known: queues, read-only, serial, direct, \
                     poll-us"
                ),
            }
        }
        Ok(spec)
    }
}

/// Refuses a socket path named twice (two devices, or a device and the control socket).
fn check_distinct_sockets(devices: &Devices) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    let paths = devices
        .blk
        .iter()
        .map(|b| &b.socket)
        .chain(&devices.balloon)
        .chain(&devices.control);
    for p in paths {
        let key = std::path::absolute(p).unwrap_or_else(|_| p.clone());
        if !seen.insert(key) {
            anyhow::bail!(
                "socket {} is named twice: every device and the control socket need their own",
                p.display()
            );
        }
    }
    Ok(())
}

/// Serves every device in its own thread, all on one memvisor state, until a signal.
pub fn serve(devices: &Devices) -> Result<ServeReport> {
    check_distinct_sockets(devices)?;
    let target = BalloonTarget::default();
    target.set_pages(devices.balloon_target_mib.saturating_mul(256));
    // Every socket first (inherited ones claimed by path), then the threads: a start that
    // fails leaves no device half served.
    let mut blk_sockets = Vec::new();
    for spec in &devices.blk {
        let file = open_disk(&spec.disk, spec.options.read_only, spec.direct)?;
        blk_sockets.push((spec, file, listener::at(&spec.socket)?));
    }
    let mut balloon_sockets = Vec::new();
    for socket in &devices.balloon {
        balloon_sockets.push(listener::at(socket)?);
    }
    let control_socket = match &devices.control {
        Some(path) => Some(listener::at(path)?),
        None => None,
    };
    listener::check_all_claimed()?;
    let mut blk_threads = Vec::new();
    for (spec, file, listener) in blk_sockets {
        let disk = &spec.disk;
        let options = BlkOptions {
            iommu: devices.iommu,
            ..spec.options.clone()
        };
        let mut backend = Backend::new(Blk::new(file, options)?)?;
        log::info!(
            "vhost-user-blk: serving {} on {}",
            disk.display(),
            listener.origin
        );
        blk_threads.push(std::thread::spawn(move || -> Result<BlkReport> {
            backend.serve(&listener.socket, &STOP)?;
            listener.remove();
            Ok(BlkReport::new(
                listener.name(),
                &backend.stats,
                &backend.device().stats,
            ))
        }));
    }
    let mut balloon_threads = Vec::new();
    for listener in balloon_sockets {
        let mut device = BalloonDevice::new(target.clone())
            .with_stats_interval(devices.balloon_stats_interval)
            .with_deflate_on_oom(devices.balloon_deflate_on_oom);
        if !devices.reporting {
            device = device.without_reporting();
        }
        let live = device.live();
        let mut backend = Backend::new(device)?;
        log::info!("vhost-user-balloon: serving on {}", listener.origin);
        balloon_threads.push(std::thread::spawn(move || -> Result<BalloonReport> {
            backend.serve(&listener.socket, &STOP)?;
            listener.remove();
            let d = backend.device();
            let s = d.stats();
            let status = live.status();
            Ok(BalloonReport {
                socket: listener.name(),
                connections: backend.stats.connections,
                messages: backend.stats.messages,
                refused: backend.stats.refused,
                report_chains: s.chains,
                refused_chains: s.refused_chains,
                discarded: s.discarded,
                skipped_pinned: s.skipped_pinned,
                rejected: s.rejected,
                inflated_pages: s.inflated_pages,
                deflated_pages: s.deflated_pages,
                target_pages: 0,
                actual_pages: d.actual_pages(),
                deflated_below_target_pages: status.deflated_below_target_pages,
                stats_interval_secs: status.stats_interval_secs,
                stats_buffers: s.stats_buffers,
                refused_stats: s.refused_stats,
                guest_stats: status.guest_stats,
            })
        }));
    }
    let control = match control_socket {
        Some(listener) => Some(control_thread(listener, target.clone())?),
        None => None,
    };
    ready();
    let blk_ends: Vec<_> = blk_threads
        .into_iter()
        .map(|t| t.join().expect("blk thread panicked"))
        .collect();
    let balloon_ends: Vec<_> = balloon_threads
        .into_iter()
        .map(|t| t.join().expect("balloon thread panicked"))
        .collect();
    stopping();
    let mut report = ServeReport::default();
    for r in blk_ends {
        report.blk.push(r?);
    }
    for r in balloon_ends {
        let mut r = r?;
        r.target_pages = target.pages();
        report.balloon.push(r);
    }
    if let Some(t) = control {
        let _ = t.join();
    }
    report.pins = PinReport::now();
    Ok(report)
}

/// Accepts control connections until a signal: each line `target <MiB>` sets the balloon target
/// and is answered `ok <pages>`; anything else `error: ...`.
fn control_thread(
    listener: listener::Listener,
    target: BalloonTarget,
) -> Result<std::thread::JoinHandle<()>> {
    listener.socket.set_nonblocking(true)?;
    Ok(std::thread::spawn(move || {
        while !STOP.load(Ordering::Relaxed) {
            match listener.socket.accept() {
                Ok((sock, _)) => control_connection(sock, &target),
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
        listener.remove();
    }))
}

fn control_connection(sock: UnixStream, target: &BalloonTarget) {
    let _ = sock.set_nonblocking(false);
    let _ = sock.set_read_timeout(Some(Duration::from_secs(5)));
    let mut out = match sock.try_clone() {
        Ok(s) => s,
        Err(_) => return,
    };
    for line in BufReader::new(sock).lines().map_while(|l| l.ok()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["target", mib] => match mib.parse::<u32>() {
                Ok(m) if m <= u32::MAX / 256 => {
                    target.set_pages(m * 256);
                    format!("ok {}", m * 256)
                }
                _ => format!("error: target {mib:?} is not a size in MiB"),
            },
            _ => format!("error: unknown command {line:?}; say `target <MiB>`"),
        };
        if writeln!(out, "{answer}").is_err() {
            return;
        }
    }
}

/// Writes `value` as JSON to `path`, if given.
pub fn write_json<T: Serialize>(path: Option<&PathBuf>, value: &T) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

/// Starts the servers' log ([`crate::logging`]: `RUST_LOG`); an unusable filter is an error.
pub fn init_logging() -> Result<()> {
    crate::logging::init()
}

/// What the process holds of its clients' memory, from `/proc/self`: read before the first
/// vfio-user client and after each one's cleanup, when it must be back where it started.
#[derive(Serialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcFigures {
    /// `VmLck` and `VmPin` of `/proc/self/status`, KiB.
    pub vm_lck_kb: u64,
    pub vm_pin_kb: u64,
    /// Mappings of memfds in `/proc/self/maps` (QEMU's guest RAM comes as one).
    pub memfd_maps: u64,
    /// Shared mappings of any file (memfds included): all a client's descriptors can become.
    pub shared_file_maps: u64,
}

impl ProcFigures {
    /// This process now; fields that cannot be read stay 0 and the reason is logged.
    pub fn now() -> ProcFigures {
        let mut f = ProcFigures::default();
        match std::fs::read_to_string("/proc/self/status") {
            Ok(status) => {
                for line in status.lines() {
                    let kb = |l: &str| {
                        l.split_whitespace()
                            .nth(1)
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0)
                    };
                    if line.starts_with("VmLck:") {
                        f.vm_lck_kb = kb(line);
                    } else if line.starts_with("VmPin:") {
                        f.vm_pin_kb = kb(line);
                    }
                }
            }
            Err(e) => log::warn!("cannot read /proc/self/status: {e}"),
        }
        match std::fs::read_to_string("/proc/self/maps") {
            Ok(maps) => {
                for line in maps.lines() {
                    // address perms offset dev inode path
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    let (Some(perms), Some(path)) = (fields.get(1), fields.get(5)) else {
                        continue;
                    };
                    if path.starts_with("/memfd:") {
                        f.memfd_maps += 1;
                    }
                    if perms.ends_with('s') && path.starts_with('/') {
                        f.shared_file_maps += 1;
                    }
                }
            }
            Err(e) => log::warn!("cannot read /proc/self/maps: {e}"),
        }
        f
    }
}

/// One vfio-user connection, as it ended.
#[derive(Serialize, Clone, Debug)]
pub struct VfioUserConnection {
    /// How it ended: "ok" (the client hung up, or died) or the error that ended it.
    pub end: String,
    /// Requests, refusals and maps of the connection.
    pub requests: u64,
    pub errors: u64,
    pub dma_maps: u64,
    /// Mappings and device pins the client left behind (the server releases them), and
    /// device pins still held after the device was stopped (must be 0).
    pub mappings_at_end: u64,
    pub pinned_pages_at_hangup: u64,
    pub pinned_pages_at_end: u64,
    /// The process after the server released the connection.
    pub after: ProcFigures,
}

/// What `memvisor vfio-user` did, for `--stats`.
#[derive(Serialize)]
pub struct VfioUserReport {
    /// Socket served.
    pub socket: String,
    /// How the last connection ended: "ok" (the client hung up) or the error that ended it
    /// ("no client connected" if none did).
    pub end: String,
    /// The process before the first client.
    pub baseline: ProcFigures,
    /// Every connection in order, with the process's figures after each one's cleanup.
    pub connections: Vec<VfioUserConnection>,
    /// The last connection's server and device counters (the pin registry's are the
    /// process's).
    #[serde(flatten)]
    pub server: memvisor_vfio_user::ServerStats,
}

/// Serves the `mvdma` reference device to vfio-user clients on `socket`, one after another,
/// until a signal. Each connection gets a new server, DMA table and device; when its client
/// hangs up or dies, the device is stopped and everything mapped, pinned or locked for it is
/// released before the next client is accepted. Returns what every connection did.
pub fn vfio_user(
    socket: &SocketSpec,
    record: Option<&Path>,
    long_term_pins: bool,
) -> Result<VfioUserReport> {
    use std::sync::{Arc, Mutex};
    if long_term_pins {
        use_long_term_pins()?;
    }
    let record = match record {
        Some(path) => Some(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create the recording {}", path.display()))?,
        ),
        None => None,
    };
    let bound = listener::open(socket)?;
    listener::check_all_claimed()?;
    let listener = &bound.socket;
    listener.set_nonblocking(true)?;
    let baseline = ProcFigures::now();
    log::info!(
        "vfio-user: serving mvdma on {}; before any client: {baseline:?}",
        bound.origin
    );
    // A signal ends the connection being served: shutting its socket down wakes the server's
    // read.
    let current: Arc<Mutex<Option<UnixStream>>> = Arc::new(Mutex::new(None));
    let watched = current.clone();
    std::thread::spawn(move || {
        while !STOP.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(s) = watched.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    });
    let mut report = VfioUserReport {
        socket: bound.name(),
        end: "no client connected".into(),
        baseline,
        connections: Vec::new(),
        server: Default::default(),
    };
    ready();
    while let Some(sock) = accept(listener)? {
        sock.set_nonblocking(false)?;
        let n = report.connections.len() + 1;
        log::info!("vfio-user client {n} connected on {}", bound.name());
        *current.lock().unwrap_or_else(|p| p.into_inner()) = Some(sock.try_clone()?);
        if STOP.load(Ordering::Relaxed) {
            // The watcher may have looked before this connection was there.
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
        let (stats, end) = serve_one(sock, record.as_ref())?;
        *current.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let after = ProcFigures::now();
        let end = match end {
            Ok(()) => "ok".to_string(),
            Err(e) => e.to_string(),
        };
        log::info!(
            "vfio-user client {n} gone ({end}): it left {} mappings and {} pages pinned by the \
             device; after release {after:?}",
            stats.mappings_at_end,
            stats.pinned_pages_at_hangup
        );
        report.connections.push(VfioUserConnection {
            end: end.clone(),
            requests: stats.requests,
            errors: stats.errors,
            dma_maps: stats.dma_maps,
            mappings_at_end: stats.mappings_at_end,
            pinned_pages_at_hangup: stats.pinned_pages_at_hangup,
            pinned_pages_at_end: stats.pinned_pages_at_end,
            after,
        });
        report.end = end;
        report.server = stats;
    }
    stopping();
    bound.remove();
    Ok(report)
}

/// The next client, or None once a signal arrived.
fn accept(listener: &UnixListener) -> Result<Option<UnixStream>> {
    loop {
        if STOP.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match listener.accept() {
            Ok((sock, _)) => return Ok(Some(sock)),
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::Interrupted =>
            {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => return Err(e).context("accept on the vfio-user socket"),
        }
    }
}

/// Serves one client with a new server and device; returns once it is gone and (unless a
/// test switch says otherwise) everything it had is released.
fn serve_one(
    sock: UnixStream,
    record: Option<&std::fs::File>,
) -> Result<(
    memvisor_vfio_user::ServerStats,
    memvisor_vfio_user::Result<()>,
)> {
    use memvisor_vfio_user::{DmaDev, Server};
    let mut server = Server::new(sock, memvisor::DmaConfig::default(), DmaDev::new)
        .context("vfio-user server")?;
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("MEMVISOR_TEST_IGNORE_UNMAP").is_some() {
        log::warn!("TEST ONLY: DMA_UNMAP is answered without unmapping");
        server.test_ignore_unmap();
    }
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("MEMVISOR_TEST_UNMAP_BUSY").is_some() {
        log::warn!("TEST ONLY: DMA_UNMAP is refused with EBUSY while the device holds pins");
        server.test_busy_while_pinned();
    }
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("MEMVISOR_TEST_LEAK_ON_HANGUP").is_some() {
        log::warn!("TEST ONLY: a connection's mappings, locks and pins are kept after it ends");
        server.test_leak_on_hangup();
    }
    if let Some(f) = record {
        // Every connection appends to the one recording.
        let f = f.try_clone().context("the recording")?;
        server.record_to(Box::new(std::io::BufWriter::new(f)));
    }
    Ok(server.serve())
}

#[cfg(test)]
mod tests {
    use super::BlkSpec;

    #[test]
    fn a_blk_spec_takes_per_disk_options_and_names_what_it_refuses() {
        let s: BlkSpec = "run/a.sock=disk.img,queues=2,serial=disk0,direct=on,read-only=on"
            .parse()
            .unwrap();
        assert_eq!(s.socket.to_str(), Some("run/a.sock"));
        assert_eq!(s.disk.to_str(), Some("disk.img"));
        assert_eq!((s.options.queues, s.options.serial.as_str()), (2, "disk0"));
        assert!(s.direct && s.options.read_only);
        let plain: BlkSpec = "a.sock=d.img".parse().unwrap();
        assert_eq!(plain.options, memvisor_vhost::BlkOptions::default());
        assert!(!plain.direct);
        for (bad, says) in [
            ("a.sock", "SOCKET=DISK"),
            ("=d.img", "must both be named"),
            ("a=d,queues=0", "queues=\"0\""),
            ("a=d,queues=65", "queues=\"65\""),
            ("a=d,direct=maybe", "on or off"),
            ("a=d,serial=123456789012345678901", "21 bytes"),
            ("a=d,cache=none", "unknown option \"cache\""),
            ("a=d,queues", "has no value"),
        ] {
            let e = bad.parse::<BlkSpec>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
