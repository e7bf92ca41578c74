//! `memvisor vhost-user-blk`, `memvisor serve` and `memvisor vfio-user`: serve devices on
//! their sockets until SIGINT or SIGTERM, then print (and optionally write) what they did.
//!
//! Several `--blk` / `--balloon` devices given to one process share memvisor's process-wide
//! state — one mapping per range of guest memory and one pin registry — so a balloon discard
//! never frees a page the block device has pinned for I/O in flight. Each device is served by
//! its own thread; the main thread waits for them and, on SIGUSR1, writes the `--stats` report
//! as it stands (to the `--stats` file, or to stderr), without stopping anything. With
//! `--control PATH` a control socket answers `query-devices`, `query-stats` and
//! `balloon-set-target`, adds, deletes and resizes blk devices while the server runs
//! (`blk-add`, `blk-del`, `blk-resize`: [`crate::runtime`]), and sends an event when a frontend
//! connects or disconnects and when a device comes, goes or changes size ([`crate::control`],
//! [`crate::status`]).
//!
//! `memvisor vfio-user` serves one vfio-user client at a time, one after another, as a
//! deployed device server must (QEMU reconnects after a restart or a migration): every
//! connection gets its own server, DMA table and device, and when its client hangs up or dies
//! the device is stopped and everything mapped, pinned or locked for it is released before the
//! next client is accepted. The process's `VmLck`, `VmPin` and mappings of client memory are
//! read from `/proc/self` before the first client and after each one, and reported. With
//! `--control PATH` its control socket answers `query-devices` and `query-stats` and sends the
//! frontend events ([`crate::vfio_status`]); SIGUSR1 writes its report as it stands.
//!
//! Every server gets its sockets from [`crate::listener`] (a path, `--fd`, or systemd's socket
//! activation; a live socket is never taken over) and tells a service manager it is ready
//! ([`crate::notify`]) once all of them listen.
//!
//! **SIGINT/SIGTERM end start-up at any point.** No start-up step of memvisor's own waits (the
//! socket probe connects without waiting; `READY=1` is not waited on once a stop was asked),
//! and the serving loops end at once when the stop came before them; a stop during start-up is
//! a stop like any other: exit status 0. A step that waits on something outside memvisor
//! anyway (an image or recording path that is a FIFO nobody opens, a hung network file
//! system) is covered by a watch: a start-up still going [`START_UP_GRACE`] after the signal
//! ends the process there, exit status 0, after removing the sockets it bound; nothing was
//! served, and no report is written.
//!
//! Test-only switches (feature `test-hooks`) are read from `MEMVISOR_TEST_*` environment
//! variables once, by `start_server` in main.rs (`memvisor::faults::Faults::from_env`), and given to every
//! back end, DMA space and server built here; they exist in no other build.

use std::fs::OpenOptions;
use std::os::unix::net::UnixListener;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::devices::{BalloonSpec, BlkSpec};
use crate::listener::{self, SocketSpec};
use crate::runtime::Runtime;
use crate::status::{BlkServeReport, PinCheck, PinChecks, Registry, ServeReport};
use crate::vfio_status::VfioStatus;
pub use crate::vfio_status::{ProcFigures, VfioUserConnection, VfioUserReport};
use memvisor::dma::PinRegistry;
use memvisor_vhost::{Backend, ProcessState};
use serde::Serialize;

/// Set by SIGINT / SIGTERM.
static STOP: AtomicBool = AtomicBool::new(false);
/// Set by SIGUSR1: write the report now.
static REPORT: AtomicBool = AtomicBool::new(false);
/// Set when start-up is over: every socket listens, and the serving loops watch `STOP`.
static SERVING: AtomicBool = AtomicBool::new(false);

/// How long start-up may go on after SIGINT/SIGTERM before the watch ends the process.
pub const START_UP_GRACE: Duration = Duration::from_millis(300);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

extern "C" fn on_report_signal(_: libc::c_int) {
    REPORT.store(true, Ordering::Relaxed);
}

/// Installs the handlers: SIGINT/SIGTERM stop the serving loops, SIGUSR1 asks for the report.
pub fn stop_on_signals() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
    // SAFETY: as above.
    unsafe {
        libc::signal(
            libc::SIGUSR1,
            on_report_signal as *const () as libc::sighandler_t,
        )
    };
    watch_start_up();
}

/// Ends the process if a stop was asked during start-up and start-up is still going
/// [`START_UP_GRACE`] later (module documentation); stands down once start-up is over.
fn watch_start_up() {
    let watch = std::thread::Builder::new()
        .name("start-up watch".into())
        .spawn(|| {
            while !STOP.load(Ordering::Relaxed) {
                if SERVING.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let asked = std::time::Instant::now();
            while asked.elapsed() < START_UP_GRACE {
                if SERVING.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            log::warn!(
                "stopped by a signal during start-up, while a start-up step was still waiting \
                 ({START_UP_GRACE:?} after the signal); nothing was served"
            );
            listener::remove_bound();
            std::process::exit(0);
        });
    if let Err(e) = watch {
        log::warn!("cannot start the start-up watch ({e}); a stop during start-up may wait");
    }
}

/// Tells a service manager the server is up: every socket listens. Start-up is over: the
/// serving loops see a stop from here on. Not sent once a stop was asked (nor waited on
/// then, if the manager's queue is full).
fn ready() {
    SERVING.store(true, Ordering::Relaxed);
    if STOP.load(Ordering::Relaxed) {
        log::info!("stopped by a signal during start-up: not telling the service manager READY=1");
        return;
    }
    crate::notify::notify_within("READY=1", crate::notify::WAIT, &|| {
        STOP.load(Ordering::Relaxed)
    });
}

/// Tells a service manager the server is stopping: its devices have stopped serving. Not
/// waited on for long: the process is on its way out.
fn stopping() {
    crate::notify::notify_within("STOPPING=1", Duration::from_millis(100), &|| false);
}

/// Writes `value` to `path` whole (a reader never sees half a report), or to stderr if no
/// path was given: what SIGUSR1 asks for.
fn report_now<T: Serialize>(path: Option<&Path>, value: &T) {
    let r = match path {
        Some(p) => {
            let tmp = p.with_extension("tmp");
            serde_json::to_string_pretty(value)
                .map_err(anyhow::Error::from)
                .and_then(|text| Ok(std::fs::write(&tmp, text)?))
                .and_then(|()| Ok(std::fs::rename(&tmp, p)?))
                .map(|()| log::info!("SIGUSR1: statistics written to {}", p.display()))
        }
        None => serde_json::to_string_pretty(value)
            .map(|text| eprintln!("{text}"))
            .map_err(anyhow::Error::from),
    };
    if let Err(e) = r {
        log::error!("SIGUSR1: cannot write the statistics: {e:#}");
    }
}

/// Starts the control socket's thread, if there is one: it answers with `handler`.
fn start_control(
    listener: Option<listener::Listener>,
    handler: Arc<dyn crate::control::Handler>,
    events: crate::control::Events,
) -> Option<JoinHandle<()>> {
    let listener = listener?;
    log::info!("control socket on {}", listener.origin);
    Some(std::thread::spawn(move || {
        if let Err(e) = crate::control::serve(&listener.socket, handler, events, &STOP) {
            log::error!("control socket: {e:#}");
        }
        listener.remove();
    }))
}

/// Waits until a signal stops the server (or, without a control socket to add devices, until
/// every device's thread has ended); meanwhile, each SIGUSR1 calls `report`. Then stops the
/// control socket and every device.
fn run_until_stopped(
    runtime: &Runtime,
    control: Option<JoinHandle<()>>,
    report: impl Fn(),
) -> Result<()> {
    let fixed = control.is_none();
    let ended = || STOP.load(Ordering::Relaxed) || (fixed && runtime.all_finished());
    while !ended() {
        if REPORT.swap(false, Ordering::Relaxed) {
            report();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stopping();
    STOP.store(true, Ordering::Relaxed);
    if let Some(t) = control {
        let _ = t.join();
    }
    runtime.finish()
}

/// Starts the Prometheus endpoint, if asked for: it answers with what `query-stats` says.
fn start_metrics(
    addr: Option<&crate::metrics::Addr>,
    registry: &Arc<Registry>,
) -> Result<Option<crate::metrics::Metrics>> {
    let Some(addr) = addr else {
        return Ok(None);
    };
    let registry = registry.clone();
    let all = serde_json::json!({});
    Ok(Some(crate::metrics::start(addr, move || {
        registry.query_stats(&all).unwrap_or_default()
    })?))
}

/// Serves a virtio-blk device over `disk` on `socket` until a signal; returns its report. With
/// `control`, a control socket answers for it as `blk0` (and resizes it: `blk-resize`); with
/// `metrics`, the Prometheus endpoint serves its figures; SIGUSR1 writes the report to `stats`.
#[allow(clippy::too_many_arguments)] // the server's settings, each its own option
pub fn blk(
    socket: &SocketSpec,
    spec: BlkSpec,
    iommu: bool,
    record_iotlb: Option<&Path>,
    control: Option<&Path>,
    stats: Option<&Path>,
    metrics: Option<&crate::metrics::Addr>,
    state: &ProcessState,
) -> Result<BlkServeReport> {
    let file = open_disk(&spec.disk, spec.options.read_only, spec.direct)?;
    claim_image(&file, &spec)?;
    let listener = listener::open(socket)?;
    let control_socket = control.map(listener::at).transpose()?;
    listener::check_all_claimed()?;
    let id = spec.id.clone().unwrap_or_else(|| "blk0".into());
    let at_disconnect = PinChecks::default();
    let seen = at_disconnect.clone();
    let pins = state.registry.clone();
    let registry = Arc::new(Registry::new(state.registry.clone()));
    log::info!(
        "vhost-user-blk: serving {} on {}",
        spec.disk.display(),
        listener.origin
    );
    let reserved = control.map(Path::to_path_buf).into_iter().collect();
    let runtime = Arc::new(Runtime::new(
        registry.clone(),
        state,
        iommu,
        false,
        reserved,
    ));
    runtime.start_blk(id, spec, file, listener, |backend| {
        if let Some(path) = record_iotlb {
            record_iotlb_to(backend, path)?;
        }
        backend.on_disconnect(Box::new(move || {
            let check = PinCheck::now(&pins);
            log::info!("vhost-user-blk: frontend gone, pins {check:?}");
            seen.lock().unwrap_or_else(|e| e.into_inner()).push(check);
        }));
        Ok(())
    })?;
    let control = start_control(control_socket, runtime.clone(), registry.events.clone());
    let _metrics = start_metrics(metrics, &registry)?;
    ready();
    run_until_stopped(&runtime, control, || {
        if let Some(r) = BlkServeReport::now(&registry, &at_disconnect) {
            report_now(stats, &r);
        }
    })?;
    BlkServeReport::now(&registry, &at_disconnect).context("no device")
}

/// How long a conflicting lock may take to go before the image is refused: a holder that was
/// just killed (a back end restarted at once after a crash) keeps its locks until the kernel
/// has closed its files, which for a file with io_uring requests in flight happens after the
/// process is gone, once they end.
const LOCK_GRACE: Duration = Duration::from_secs(1);

/// Claims a blk device's image before it is served, on the file that will serve it: QEMU's
/// image locks (`locking=`; held until the file is closed; a conflict is retried for
/// one second, `LOCK_GRACE`), then a look at its first bytes for another format's header (unless
/// `format=raw`). A refusal names the image and what to do.
pub fn claim_image(file: &std::fs::File, spec: &BlkSpec) -> Result<()> {
    use memvisor_vhost::image_lock::{self, Access, LockError, Locked};
    let access = Access::disk(spec.options.read_only);
    let since = std::time::Instant::now();
    let mut waited = false;
    let locked = loop {
        match image_lock::lock(file, &spec.disk, access, spec.locking) {
            Err(LockError::Conflict { .. }) if since.elapsed() < LOCK_GRACE => {
                waited = true;
                std::thread::sleep(Duration::from_millis(50));
            }
            other => break other?,
        }
    };
    if waited {
        log::info!(
            "{}: a conflicting image lock went after {} ms (its holder was closing the image)",
            spec.disk.display(),
            since.elapsed().as_millis()
        );
    }
    match locked {
        Locked::Held => log::debug!(
            "{}: image locks held (QEMU's bytes {:?})",
            spec.disk.display(),
            access.bytes().collect::<Vec<_>>()
        ),
        Locked::Off => log::info!(
            "{}: locking=off: no image locks; nothing stops another program writing it",
            spec.disk.display()
        ),
        Locked::Unsupported => {}
    }
    memvisor_vhost::image_format::check(file, &spec.disk, spec.format)?;
    Ok(())
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
                 leave out direct=on (--direct) to go through the page cache",
                disk.display()
            )
        } else {
            anyhow::Error::new(e).context(format!("cannot open disk image {}", disk.display()))
        }
    })
}

/// Turns long-term pins on for the process's registry, which every device here pins through
/// (`--long-term-pins`).
pub fn use_long_term_pins(registry: &PinRegistry) -> Result<()> {
    registry
        .set_long_term_pins(true)
        .context("--long-term-pins")?;
    log::info!("pins are held with long-term pins (io_uring, FOLL_LONGTERM), not mlock");
    Ok(())
}

/// Says at start what the locked-memory limit means for the block devices about to be served:
/// nothing. Their requests hold guest pages in the pin registry without locking them (see
/// `memvisor_vhost::blk` and docs/limits.md), so `RLIMIT_MEMLOCK` never turns into a guest I/O
/// error and needs no raising for them; `--long-term-pins` (`long_term_pins`) has nothing to
/// hold there.
pub fn note_blk_locked_memory(long_term_pins: bool) {
    let limit = match memvisor::LockLimit::Rlimit.resolve() {
        Some((bytes, _)) => format!("RLIMIT_MEMLOCK ({} KiB)", bytes >> 10),
        None => "the locked-memory limit (none here: CAP_IPC_LOCK or unlimited)".to_string(),
    };
    log::info!(
        "blk: requests hold guest pages without locking them; {limit} does not apply to them \
         (no LimitMEMLOCK= or CAP_IPC_LOCK needed for block devices)"
    );
    if long_term_pins {
        log::warn!(
            "--long-term-pins has no effect on block devices: their requests lock nothing (the \
             pages are held in the pin registry only), so nothing of theirs is pinned long-term"
        );
    }
}

/// Warns at start when the locked-memory limit is below what the `mvdma` device locks at once
/// in its pin mode: [`PIN_PAGES_MAX`](memvisor::dma::PIN_PAGES_MAX) pages of source and as
/// many of destination. A pin the limit refuses fails that DMA descriptor.
pub fn warn_vfio_user_locked_memory() {
    let worst = 2 * memvisor::dma::PIN_PAGES_MAX as u64 * 4096;
    let limit = memvisor::LockLimit::Rlimit
        .resolve()
        .map(|(bytes, _)| bytes);
    if let Some(bytes) = limit.filter(|&b| b < worst) {
        log::warn!(
            "RLIMIT_MEMLOCK is {} KiB, below the {} KiB the mvdma device locks for one copy in \
             pin mode (512 pages of source and 512 of destination; more on huge-page memory): \
             such copies will fail. Raise it (LimitMEMLOCK={}K or more in the systemd unit, \
             `ulimit -l`) or grant CAP_IPC_LOCK (AmbientCapabilities=CAP_IPC_LOCK)",
            bytes >> 10,
            worst >> 10,
            worst >> 10
        );
    }
}

/// What [`serve`] serves.
#[derive(Default)]
pub struct Devices {
    /// Block devices.
    pub blk: Vec<BlkSpec>,
    /// Balloons.
    pub balloon: Vec<BalloonSpec>,
    /// The control socket.
    pub control: Option<PathBuf>,
    /// Offer `VIRTIO_F_IOMMU_PLATFORM` on the blk devices.
    pub iommu: bool,
    /// Where SIGUSR1 writes the report (stderr if not given).
    pub stats: Option<PathBuf>,
    /// The Prometheus endpoint (`--metrics`), if any.
    pub metrics: Option<crate::metrics::Addr>,
}

impl Devices {
    /// Each device's id: its spec's, or its type and number.
    fn ids(&self) -> Result<(Vec<String>, Vec<String>)> {
        let blk: Vec<String> = self
            .blk
            .iter()
            .enumerate()
            .map(|(i, b)| b.id.clone().unwrap_or_else(|| format!("blk{i}")))
            .collect();
        let balloon: Vec<String> = self
            .balloon
            .iter()
            .enumerate()
            .map(|(i, b)| b.id.clone().unwrap_or_else(|| format!("balloon{i}")))
            .collect();
        let mut seen = std::collections::HashSet::new();
        for id in blk.iter().chain(&balloon) {
            if id.is_empty() || !seen.insert(id) {
                bail!("device id {id:?} is empty or named twice: every device needs its own");
            }
        }
        Ok((blk, balloon))
    }

    /// Refuses a socket path or descriptor named twice (two devices, or a device and the
    /// control socket).
    fn check_distinct_sockets(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        let specs = self
            .blk
            .iter()
            .map(|b| b.socket.clone())
            .chain(self.balloon.iter().map(|b| b.socket.clone()))
            .chain(self.control.iter().cloned().map(SocketSpec::Path));
        for spec in specs {
            let key = match &spec {
                SocketSpec::Path(p) => {
                    SocketSpec::Path(std::path::absolute(p).unwrap_or_else(|_| p.clone()))
                }
                SocketSpec::Activated => continue,
                fd => fd.clone(),
            };
            if !seen.insert(format!("{key}")) {
                bail!(
                    "socket {spec} is named twice: every device and the control socket need their own"
                );
            }
        }
        Ok(())
    }

    /// The paths the devices and the control socket name: a socket systemd passed bound to
    /// one of them is theirs ([`listener::open_device`]).
    fn socket_paths(&self) -> Vec<PathBuf> {
        let path = |s: &SocketSpec| match s {
            SocketSpec::Path(p) => Some(p.clone()),
            _ => None,
        };
        self.blk
            .iter()
            .filter_map(|b| path(&b.socket))
            .chain(self.balloon.iter().filter_map(|b| path(&b.socket)))
            .chain(self.control.iter().cloned())
            .collect()
    }
}

/// Each blk device's serial: the one given, or its id ([`crate::devices::default_serial`]),
/// which no other device of the process has. Two the same (given so) get a warning: the
/// guest's /dev/disk/by-id names would collide.
fn serials(blk: &[BlkSpec], ids: &[String]) -> Vec<String> {
    let serials: Vec<String> = blk
        .iter()
        .zip(ids)
        .map(|(b, id)| match b.options.serial.as_str() {
            "" => crate::devices::default_serial(id),
            s => s.to_string(),
        })
        .collect();
    for (i, s) in serials.iter().enumerate() {
        if let Some(j) = serials[..i].iter().position(|t| t == s) {
            log::warn!(
                "blk devices {} and {} both have serial {s:?}: the guest's /dev/disk/by-id \
                 names collide; give each its own serial=",
                ids[j],
                ids[i]
            );
        }
    }
    serials
}

/// Serves every device in its own thread, all on one memvisor state, until a signal. With a
/// control socket, devices may be added and deleted meanwhile ([`crate::runtime`]), and there
/// may be none at start.
pub fn serve(devices: &Devices, state: &ProcessState) -> Result<ServeReport> {
    devices.check_distinct_sockets()?;
    let (blk_ids, balloon_ids) = devices.ids()?;
    // Every socket first (inherited ones claimed by path), then the threads: a start that
    // fails leaves no device half served.
    let paths = devices.socket_paths();
    let all_ids: Vec<String> = blk_ids.iter().chain(&balloon_ids).cloned().collect();
    let open = |socket: &SocketSpec, id: &String| {
        let others: Vec<String> = all_ids.iter().filter(|i| *i != id).cloned().collect();
        listener::open_device(socket, id, &others, &paths)
    };
    let mut blk_sockets = Vec::new();
    for (spec, id) in devices.blk.iter().zip(&blk_ids) {
        let file = open_disk(&spec.disk, spec.options.read_only, spec.direct)?;
        claim_image(&file, spec)?;
        blk_sockets.push((spec, file, open(&spec.socket, id)?));
    }
    let mut balloon_sockets = Vec::new();
    for (spec, id) in devices.balloon.iter().zip(&balloon_ids) {
        balloon_sockets.push((spec, open(&spec.socket, id)?));
    }
    let control_socket = devices.control.as_deref().map(listener::at).transpose()?;
    listener::check_all_claimed()?;
    let registry = Arc::new(Registry::new(state.registry.clone()));
    let reserved = devices.control.iter().cloned().collect();
    let runtime = Arc::new(Runtime::new(
        registry.clone(),
        state,
        devices.iommu,
        true,
        reserved,
    ));
    let serials = serials(&devices.blk, &blk_ids);
    let started = (|| -> Result<()> {
        for (((spec, file, listener), id), serial) in
            blk_sockets.into_iter().zip(blk_ids).zip(serials)
        {
            let mut spec = spec.clone();
            spec.options.serial = serial;
            runtime.start_blk(id, spec, file, listener, |_| Ok(()))?;
        }
        for ((spec, listener), id) in balloon_sockets.into_iter().zip(balloon_ids) {
            runtime.start_balloon(id, spec, listener)?;
        }
        Ok(())
    })();
    if let Err(e) = started {
        let _ = runtime.finish();
        return Err(e);
    }
    if devices.blk.is_empty() && devices.balloon.is_empty() {
        log::info!("no device at start: add them on the control socket (blk-add)");
    }
    let control = start_control(control_socket, runtime.clone(), registry.events.clone());
    let _metrics = start_metrics(devices.metrics.as_ref(), &registry)?;
    ready();
    run_until_stopped(&runtime, control, || {
        report_now(devices.stats.as_deref(), &registry.report())
    })?;
    Ok(registry.report())
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

/// Serves the `mvdma` reference device to vfio-user clients on `socket`, one after another,
/// until a signal (or a control client's `quit`). Each connection gets a new server, DMA table
/// and device; when its client hangs up or dies, the device is stopped and everything mapped,
/// pinned or locked for it is released before the next client is accepted. With `control`, a
/// control socket answers for the device ([`crate::vfio_status`]); SIGUSR1 writes the report
/// as it stands to `stats` (stderr if not given). Returns what every connection did.
pub fn vfio_user(
    socket: &SocketSpec,
    control: Option<&Path>,
    stats: Option<&Path>,
    record: Option<&Path>,
    long_term_pins: bool,
    state: &ProcessState,
) -> Result<VfioUserReport> {
    use std::sync::Mutex;
    if long_term_pins {
        use_long_term_pins(&state.registry)?;
    }
    warn_vfio_user_locked_memory();
    let record = match record {
        Some(path) => Some(
            std::fs::File::create(path)
                .with_context(|| format!("cannot create the recording {}", path.display()))?,
        ),
        None => None,
    };
    let bound = listener::open(socket)?;
    if let (Some(c), Some(p)) = (control, &bound.path) {
        if std::path::absolute(c).ok() == std::path::absolute(p).ok() {
            bail!(
                "socket {} is named twice: the vfio-user socket and the control socket need \
                 their own",
                c.display()
            );
        }
    }
    let control_socket = control.map(listener::at).transpose()?;
    listener::check_all_claimed()?;
    let listener = &bound.socket;
    listener.set_nonblocking(true)?;
    let baseline = ProcFigures::now();
    log::info!(
        "vfio-user: serving mvdma on {}; before any client: {baseline:?}",
        bound.origin
    );
    let status = Arc::new(VfioStatus::new(
        bound.name(),
        baseline,
        state.registry.clone(),
    ));
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
    let control = control_socket.map(|l| {
        log::info!("control socket on {}", l.origin);
        let status = status.clone();
        std::thread::spawn(move || {
            let events = status.events.clone();
            if let Err(e) = crate::control::serve(&l.socket, status, events, &STOP) {
                log::error!("control socket: {e:#}");
            }
            l.remove();
        })
    });
    ready();
    let served = std::thread::scope(|scope| {
        let clients = scope.spawn(|| -> Result<()> {
            while let Some(sock) = accept(listener)? {
                sock.set_nonblocking(false)?;
                *current.lock().unwrap_or_else(|p| p.into_inner()) = Some(sock.try_clone()?);
                if STOP.load(Ordering::Relaxed) {
                    // The watcher may have looked before this connection was there.
                    let _ = sock.shutdown(std::net::Shutdown::Both);
                }
                let (stats, end) = serve_one(sock, record.as_ref(), state, &status)?;
                *current.lock().unwrap_or_else(|p| p.into_inner()) = None;
                let after = ProcFigures::now();
                let end = match end {
                    Ok(()) => "ok".to_string(),
                    Err(e) => e.to_string(),
                };
                log::info!(
                    "vfio-user client gone ({end}): it left {} mappings and {} pages pinned by \
                     the device; after release {after:?}",
                    stats.mappings_at_end,
                    stats.pinned_pages_at_hangup
                );
                let connection = VfioUserConnection {
                    end,
                    requests: stats.requests,
                    errors: stats.errors,
                    dma_maps: stats.dma_maps,
                    mappings_at_end: stats.mappings_at_end,
                    pinned_pages_at_hangup: stats.pinned_pages_at_hangup,
                    pinned_pages_at_end: stats.pinned_pages_at_end,
                    after,
                };
                status.disconnected(connection, stats);
            }
            Ok(())
        });
        while !clients.is_finished() {
            if REPORT.swap(false, Ordering::Relaxed) {
                report_now(stats, &status.report());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        clients
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("the vfio-user thread panicked")))
    });
    stopping();
    STOP.store(true, Ordering::Relaxed);
    if let Some(t) = control {
        let _ = t.join();
    }
    bound.remove();
    served?;
    Ok(status.report())
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
    state: &ProcessState,
    status: &VfioStatus,
) -> Result<(
    memvisor_vfio_user::ServerStats,
    memvisor_vfio_user::Result<()>,
)> {
    use memvisor_vfio_user::{DmaDev, Server};
    let config = memvisor::DmaConfig {
        registry: Some(state.registry.clone()),
        #[cfg(feature = "test-hooks")]
        faults: state.faults,
        ..memvisor::DmaConfig::default()
    };
    #[cfg_attr(not(feature = "test-hooks"), allow(unused_mut))]
    let mut server = Server::new(sock, config, state.mappings.clone(), DmaDev::new)
        .context("vfio-user server")?;
    if let Some(f) = record {
        #[cfg(feature = "test-hooks")]
        {
            // Every connection appends to the one recording.
            let f = f.try_clone().context("the recording")?;
            server.record_to(Box::new(std::io::BufWriter::new(f)));
        }
        #[cfg(not(feature = "test-hooks"))]
        {
            let _ = f;
            anyhow::bail!("recording DMA traffic needs a test-hooks build");
        }
    }
    let number = status.connected(server.port().clone());
    log::info!("vfio-user client {number} connected");
    Ok(server.serve())
}

/// Writes the back end's IOTLB traffic to `path` with the test kit's recorder (test-hooks builds;
/// the product has no recorder).
fn record_iotlb_to<D: memvisor_vhost::Device + 'static>(
    backend: &mut Backend<D>,
    path: &Path,
) -> Result<()> {
    #[cfg(feature = "test-hooks")]
    {
        let f = std::fs::File::create(path)
            .with_context(|| format!("cannot create IOTLB recording {}", path.display()))?;
        let recorder =
            memvisor_testkit::vhost::record::Recorder::new(Box::new(std::io::BufWriter::new(f)));
        backend.record_iotlb(Box::new(recorder));
        Ok(())
    }
    #[cfg(not(feature = "test-hooks"))]
    {
        let _ = backend;
        anyhow::bail!(
            "recording IOTLB traffic to {} needs a test-hooks build",
            path.display()
        )
    }
}
