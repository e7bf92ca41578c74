//! The `memvisor` command: the servers and their control client, nothing else. The benchmark
//! is `memvisor-bench` (crate memvisor-bench), the hostile clients `memvisor-testkit` (crate
//! memvisor-testkit); neither is linked here.
//!
//! The servers (`vhost-user-blk`, `serve`, `vfio-user`) follow the vhost-user specification's
//! back end conventions: `--socket-path` (alias `--socket`), `--fd N`, systemd socket
//! activation (`LISTEN_FDS`, `LISTEN_FDNAMES`), `--print-capabilities`, sd_notify readiness,
//! `RUST_LOG` (docs/deploying.md). Test-only switches are not options: a `test-hooks` build
//! reads them from `MEMVISOR_TEST_*` environment variables, once (`start_server`).
//!
//! Two things happen before the arguments are parsed. **The program's name picks the
//! server**: run as `memvisor-vhost-user-blk` or `memvisor-vfio-user` (a link to `memvisor`,
//! as a JSON descriptor's `binary` names it: management software runs that binary with the
//! conventions' options only, no subcommand), it is `memvisor vhost-user-blk` /
//! `memvisor vfio-user` ([`capabilities::server_named`]). **`--print-capabilities` wins**:
//! anywhere among a server's arguments it prints the capabilities and exits 0, whatever else
//! is there, unknown or invalid ([`capabilities::requested`]), as the specification asks.

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use memvisor::{PinRegistry, SharedMappings};
use memvisor_cli::listener::SocketSpec;
use memvisor_cli::{capabilities, serve};
use memvisor_vhost::ProcessState;
use std::io::{self, Write};
use std::os::fd::RawFd;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "memvisor",
    version,
    about = "Guest memory and DMA mapping for userspace VMMs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a virtio-blk device over a raw image or a block device on a vhost-user socket (until
    /// SIGINT/SIGTERM)
    #[command(name = "vhost-user-blk")]
    VhostUserBlk(BlkArgs),
    /// Serve several vhost-user devices from one process, sharing one memvisor state
    Serve(ServeArgs),
    /// Ask a running server through its --control socket (QMP: the greeting is read and
    /// capabilities negotiated first): query-devices, query-stats, balloon-set-target
    /// target-mib=N, query-commands, quit; or wait for an event
    Ctl(CtlArgs),
    /// Serve the mvdma reference DMA device to vfio-user clients (QEMU's vfio-user-pci), one
    /// after another, until SIGINT/SIGTERM; each client's memory and pins are released when it
    /// goes
    #[command(name = "vfio-user")]
    VfioUser(VfioUserArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// A virtio-blk device (repeatable): options separated by commas, the socket's name may be
    /// left out: socket=PATH (or fd=N: an inherited listening socket; neither: --socket-path /
    /// --fd, or the systemd socket named after the id in LISTEN_FDNAMES), disk=FILE (raw image or block device), id=NAME (for the control socket; default
    /// blk0, blk1, ...), queues=N (1-64, default 1), read-only=on, serial=TEXT (GET_ID, at most
    /// 20 bytes; default: the device's id), direct=on (open the image O_DIRECT; default: the
    /// host page cache), poll-us=N (poll the rings up to N µs before sleeping, adapting;
    /// default 0), locking=on|off|auto (QEMU's image locks, as its file.locking; default auto),
    /// format=raw (serve an image whose first bytes look like qcow2, VMDK, LUKS, ...),
    /// fixed-buffers=on (reads and writes go out as io_uring READ_FIXED/WRITE_FIXED through
    /// guest memory registered in 2 MiB chunks as the guest touches them: no pinning per
    /// request, but the chunks stay pinned, charged to RLIMIT_MEMLOCK without CAP_IPC_LOCK;
    /// only memfd, hugetlbfs or shared-descriptor memory, never while migrating; a chunk the
    /// host refuses goes the ordinary way. Opt-in: QEMU does not disable RAM discard for
    /// vhost-user (hw/virtio/vhost-user.c has no ram_block_discard_disable), so a balloon or
    /// virtio-mem in the frontend would orphan registered pages; memvisor's own balloon evicts
    /// chunks first. See docs/blk-bench.md)
    #[arg(long, value_name = "socket=PATH,disk=FILE[,OPTION=VALUE...]")]
    blk: Vec<memvisor_cli::devices::BlkSpec>,
    /// A virtio-balloon device (repeatable; QEMU: vhost-user-test-device-pci,virtio-id=5,
    /// num_vqs=3,config_size=16, num_vqs=4 with stats-interval): socket=PATH (or fd=N, or
    /// neither, as --blk), id=NAME (default
    /// balloon0, ...), target-mib=N (initial target, default 0), reporting=off (no free page
    /// reporting), stats-interval=SECS (offer the statistics queue, polled every SECS; default
    /// 0: not offered), deflate-on-oom=on (default off, as in QEMU)
    #[arg(long, value_name = "socket=PATH[,OPTION=VALUE...]")]
    balloon: Vec<memvisor_cli::devices::BalloonSpec>,
    /// Read devices and settings from a JSON file (the same names: {"blk": [{"socket": ...,
    /// "disk": ...}], "balloon": [...], "control": PATH, "iommu": true, "long-term-pins": true,
    /// "stats": FILE}); devices given on the command line are added
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Control socket: JSON commands, one per line (query-devices, query-stats,
    /// balloon-set-target) and events; `memvisor ctl` is its client
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Offer VIRTIO_F_IOMMU_PLATFORM on the blk devices: they may sit behind a vIOMMU
    #[arg(long)]
    iommu: bool,
    /// No effect: the block devices' requests hold guest pages in the pin registry without
    /// locking them (see docs/limits.md), and the balloon pins nothing, so there is nothing to
    /// pin long-term; accepted so existing command lines and config files keep working
    #[arg(long)]
    long_term_pins: bool,
    /// Write what the devices did as JSON on exit, and whenever SIGUSR1 comes
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// The socket of the one device that leaves out socket=/fd= (--socket-path PATH or
    /// --fd N; the vhost-user conventions' options, here for that device); --print-capabilities
    /// prints {"type": "block", "features": []} and exits
    #[command(flatten)]
    socket: SocketArgs,
    /// Serve Prometheus metrics (text format 0.0.4: query-stats' counters and the latency
    /// histograms) over HTTP GET on 127.0.0.1:PORT, [::1]:PORT or unix:PATH; loopback only
    #[arg(long, value_name = "ADDR", value_parser = memvisor_cli::metrics::parse)]
    metrics: Option<memvisor_cli::metrics::Addr>,
}

/// Where a server listens: the vhost-user specification's `--socket-path` / `--fd`, or, with
/// neither, the socket systemd passes (socket activation).
#[derive(Args)]
struct SocketArgs {
    /// Unix socket to listen on; a socket systemd passed for this path is used, a live one
    /// refused, a stale one replaced
    #[arg(long = "socket-path", visible_alias = "socket", value_name = "PATH")]
    socket_path: Option<PathBuf>,
    /// Listen on the inherited listening socket N instead (from the parent, e.g. libvirt)
    #[arg(long, value_name = "N", conflicts_with = "socket_path")]
    fd: Option<RawFd>,
    /// Print the back end's capabilities as JSON (the vhost-user specification's) and exit 0,
    /// ignoring every other option and argument
    #[arg(long)]
    print_capabilities: bool,
}

impl SocketArgs {
    fn spec(&self) -> SocketSpec {
        SocketSpec::from_args(self.socket_path.as_deref(), self.fd)
    }
}

#[derive(Args)]
struct VfioUserArgs {
    /// The socket (QEMU: -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":PATH}}')
    #[command(flatten)]
    socket: SocketArgs,
    /// Write what the server and device did as JSON on exit: the last connection's maps,
    /// unmaps, DMA and pin histogram, and per connection how it ended and the process's VmLck,
    /// VmPin and mappings of client memory after it
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// Write every DMA_MAP / DMA_UNMAP to FILE, for `memvisor-bench vfio-user` to replay
    /// (test-hooks builds only)
    #[cfg(feature = "test-hooks")]
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Hold the pages the device pins with the kernel's long-term pin (FOLL_LONGTERM, through
    /// io_uring) instead of mlock: cheaper for a page not pinned before (figures in the README).
    /// Needs io_uring (seccomp profiles often forbid it); the kernel shows such pages in VmPin,
    /// not VmLck
    #[arg(long)]
    long_term_pins: bool,
    /// Answer QMP on a control socket at PATH: query-devices, query-stats (live), quit, and the
    /// events FRONTEND_CONNECTED / FRONTEND_DISCONNECTED; `memvisor ctl` is its client
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
}

#[derive(Args)]
struct CtlArgs {
    /// The server's control socket (its --control PATH)
    #[arg(long, value_name = "PATH")]
    control: PathBuf,
    /// The command: query-devices, query-stats, balloon-set-target, query-commands, quit
    #[arg(value_name = "COMMAND", required_unless_present = "wait_event")]
    command: Option<String>,
    /// Its arguments, NAME=VALUE (a value that reads as JSON is taken as such: numbers,
    /// true, false), e.g. target-mib=256 or device=blk0
    #[arg(value_name = "NAME=VALUE", requires = "command")]
    arguments: Vec<String>,
    /// Instead of a command, wait for the next event named NAME (e.g. FRONTEND_CONNECTED) and
    /// print it
    #[arg(long, value_name = "NAME", conflicts_with = "command")]
    wait_event: Option<String>,
    /// How long --wait-event waits
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    timeout: u64,
}

#[derive(Args)]
struct BlkArgs {
    /// The socket (QEMU: -chardev socket,path=PATH)
    #[command(flatten)]
    socket: SocketArgs,
    /// The disk to serve: a raw image file or a block device (an LVM volume, an NVMe
    /// namespace, a partition, a loop device)
    #[arg(
        long,
        visible_alias = "blk-file",
        value_name = "FILE",
        required_unless_present = "print_capabilities"
    )]
    disk: Option<PathBuf>,
    /// Queues to offer
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    queues: u16,
    /// Serial number the device answers GET_ID with (at most 20 bytes; default: `mv-` and 16
    /// hex digits of a hash of the disk's canonical path, stable across restarts and unique
    /// per disk, so two back ends' disks in one guest do not collide in /dev/disk/by-id)
    #[arg(long)]
    serial: Option<String>,
    /// Serve the image read-only
    #[arg(long)]
    read_only: bool,
    /// QEMU's image locks (as its file.locking): on takes them and fails where the file system
    /// cannot, auto (the default) goes on without them there, off takes none. They keep QEMU,
    /// qemu-storage-daemon and memvisor from opening one image for writing twice
    #[arg(long, value_name = "on|off|auto", default_value = "auto")]
    locking: memvisor_vhost::image_lock::Locking,
    /// raw: serve the image even if its first bytes look like another format's header (qcow2,
    /// VMDK, LUKS, ...), which is refused otherwise. raw is the only format
    #[arg(long, value_name = "raw")]
    format: Option<memvisor_vhost::image_format::FormatChoice>,
    /// Open the image O_DIRECT: no host page cache, what a real disk under a VM wants (QEMU's
    /// cache.direct=on). The device then offers the file's O_DIRECT block size; guest buffers
    /// that are not aligned for it are copied through an aligned buffer. Default: the host page
    /// cache, as qemu-storage-daemon's default cache.direct=off
    #[arg(long)]
    direct: bool,
    /// Reads and writes go out as io_uring READ_FIXED/WRITE_FIXED through guest memory
    /// registered in 2 MiB chunks (as serve's --blk fixed-buffers=on; see there)
    #[arg(long)]
    fixed_buffers: bool,
    /// Offer VIRTIO_F_IOMMU_PLATFORM: the device may sit behind a vIOMMU (QEMU:
    /// iommu_platform=on,ats=on on the device, -device intel-iommu,device-iotlb=on)
    #[arg(long)]
    iommu: bool,
    /// After work, keep looking at the rings for new requests for up to this many
    /// microseconds before sleeping until a kick: lower latency at low queue depth for a
    /// busy core. The maximum of a window that adapts: it drops to 0 when requests come
    /// further apart than this (an idle queue sleeps) and grows back when they come closer.
    /// Default 0: sleep at once
    #[arg(long, value_name = "US", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    poll_us: u32,
    /// No effect: the requests in flight hold guest pages in the pin registry without locking
    /// them (see docs/limits.md), so there is nothing to pin long-term; accepted so existing
    /// command lines keep working
    #[arg(long)]
    long_term_pins: bool,
    /// Write what the device did (requests, bytes, pinned-page histogram, pins) as JSON on
    /// exit, and whenever SIGUSR1 comes
    #[arg(long, value_name = "FILE")]
    stats: Option<PathBuf>,
    /// Control socket: JSON commands, one per line (query-devices, query-stats) and events;
    /// `memvisor ctl` is its client. The device is blk0
    #[arg(long, value_name = "PATH")]
    control: Option<PathBuf>,
    /// Serve Prometheus metrics (text format 0.0.4: query-stats' counters and the latency
    /// histograms) over HTTP GET on 127.0.0.1:PORT, [::1]:PORT or unix:PATH; loopback only
    #[arg(long, value_name = "ADDR", value_parser = memvisor_cli::metrics::parse)]
    metrics: Option<memvisor_cli::metrics::Addr>,
    /// Write the IOTLB traffic (memory tables, updates, invalidates, misses) to FILE, for
    /// `memvisor-bench iotlb --replay FILE` (test-hooks builds only: the recorder is the test
    /// kit's)
    #[cfg(feature = "test-hooks")]
    #[arg(long, value_name = "FILE")]
    record_iotlb: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = capabilities::server_named(std::env::args_os().collect());
    if let Some(caps) = capabilities::requested(&args) {
        return match print_capabilities(caps) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("error: {err:#}");
                ExitCode::FAILURE
            }
        };
    }
    let result = match Cli::parse_from(args).command {
        Command::VhostUserBlk(args) => run_blk(&args),
        Command::Serve(args) => run_serve(&args),
        Command::VfioUser(args) => run_vfio_user(&args),
        Command::Ctl(args) => run_ctl(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Prints `--print-capabilities` JSON on stdout.
fn print_capabilities(caps: serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&caps)?);
    Ok(())
}

/// What every server does first: the log, the signals, the sockets systemd passed; and the
/// process state every device shares (its mappings of guest memory and its pin registry), made
/// here once and handed to each (in a test-hooks build, with the faults the environment asks
/// for).
fn start_server() -> Result<ProcessState> {
    serve::init_logging()?;
    memvisor_cli::listener::take_from_environment()?;
    serve::stop_on_signals();
    let state = ProcessState::new(SharedMappings::global(), PinRegistry::global());
    // TEST ONLY: the `MEMVISOR_TEST_*` switches, parsed (and logged) here once and given to
    // everything built over the state.
    #[cfg(feature = "test-hooks")]
    let state = {
        let faults = memvisor::faults::Faults::from_env();
        state.registry.set_faults(&faults);
        state.with_faults(faults)
    };
    Ok(state)
}

fn run_blk(args: &BlkArgs) -> Result<()> {
    let state = start_server()?;
    let Some(disk) = args.disk.as_ref() else {
        bail!("--disk FILE is required");
    };
    if args.long_term_pins {
        serve::use_long_term_pins(&state.registry)?;
    }
    serve::note_blk_locked_memory(args.long_term_pins);
    let serial = match &args.serial {
        Some(s) => s.clone(),
        None => memvisor_cli::devices::path_serial(disk),
    };
    if serial.len() > 20 {
        bail!(
            "--serial {serial:?} is {} bytes; virtio-blk's GET_ID holds 20",
            serial.len()
        );
    }
    log::info!("{}: serial {serial:?} (GET_ID)", disk.display());
    if args.fixed_buffers {
        if let Err(why) = memvisor_vhost::blk::probe_fixed_buffers() {
            bail!("--fixed-buffers: {why}; leave it off");
        }
    }
    let spec = memvisor_cli::devices::BlkSpec {
        id: None,
        socket: args.socket.spec(),
        disk: disk.clone(),
        options: memvisor_vhost::BlkOptions {
            queues: args.queues,
            serial,
            read_only: args.read_only,
            iommu: false,
            poll_us: args.poll_us,
            guard_first_sector: false,
            fixed_buffers: args.fixed_buffers,
        },
        direct: args.direct,
        locking: args.locking,
        format: args.format.unwrap_or_default(),
    };
    // The recording options exist in a test-hooks build only.
    #[cfg(feature = "test-hooks")]
    let record_iotlb = args.record_iotlb.as_deref();
    #[cfg(not(feature = "test-hooks"))]
    let record_iotlb = None;
    let report = serve::blk(
        &args.socket.spec(),
        spec,
        args.iommu,
        record_iotlb,
        args.control.as_deref(),
        args.stats.as_deref(),
        args.metrics.as_ref(),
        &state,
    )?;
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    serve::write_json(args.stats.as_ref(), &report)
}

fn run_serve(args: &ServeArgs) -> Result<()> {
    let mut config = match &args.config {
        Some(path) => memvisor_cli::devices::Config::read(path)?,
        None => Default::default(),
    };
    config.blk.extend(args.blk.iter().cloned());
    config.balloon.extend(args.balloon.iter().cloned());
    let control = args.control.clone().or(config.control.clone());
    if config.blk.is_empty() && config.balloon.is_empty() && control.is_none() {
        bail!(
            "nothing to serve: give --blk socket=PATH,disk=FILE and/or --balloon socket=PATH \
             (or a --config file that names devices), or --control PATH to add them later \
             (blk-add)"
        );
    }
    give_top_level_socket(&args.socket, &mut config)?;
    let state = start_server()?;
    if args.long_term_pins || config.long_term_pins {
        serve::use_long_term_pins(&state.registry)?;
    }
    if !config.blk.is_empty() {
        serve::note_blk_locked_memory(args.long_term_pins || config.long_term_pins);
    }
    let stats = args.stats.clone().or(config.stats);
    let devices = serve::Devices {
        blk: config.blk,
        balloon: config.balloon,
        control,
        iommu: args.iommu || config.iommu,
        stats: stats.clone(),
        metrics: args.metrics.clone(),
    };
    let report = serve::serve(&devices, &state)?;
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    serve::write_json(stats.as_ref(), &report)
}

/// `serve --socket-path PATH` / `--fd N`: the socket of the one device that leaves out
/// `socket=` and `fd=`, as if it said `socket=PATH` / `fd=N` (one mechanism: the device's
/// socket). Refused when no device, or more than one, leaves its socket out.
fn give_top_level_socket(
    args: &SocketArgs,
    config: &mut memvisor_cli::devices::Config,
) -> Result<()> {
    let spec = args.spec();
    if spec == SocketSpec::Activated {
        return Ok(());
    }
    let mut open: Vec<&mut SocketSpec> = config
        .blk
        .iter_mut()
        .map(|b| &mut b.socket)
        .chain(config.balloon.iter_mut().map(|b| &mut b.socket))
        .filter(|s| **s == SocketSpec::Activated)
        .collect();
    match open.as_mut_slice() {
        [one] => {
            **one = spec;
            Ok(())
        }
        [] => bail!(
            "--socket-path/--fd names the socket of the one device that leaves out socket= and \
             fd=, and every device names its own; drop --socket-path/--fd or a device's socket="
        ),
        many => bail!(
            "--socket-path/--fd names the socket of the one device that leaves out socket= and \
             fd=, and {} devices leave it out; give each its own socket=PATH or fd=N",
            many.len()
        ),
    }
}

fn run_vfio_user(args: &VfioUserArgs) -> Result<()> {
    let state = start_server()?;
    #[cfg(feature = "test-hooks")]
    let record = args.record.as_deref();
    #[cfg(not(feature = "test-hooks"))]
    let record = None;
    let report = serve::vfio_user(
        &args.socket.spec(),
        args.control.as_deref(),
        args.stats.as_deref(),
        record,
        args.long_term_pins,
        &state,
    )?;
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    serve::write_json(args.stats.as_ref(), &report)
}

fn run_ctl(args: &CtlArgs) -> Result<()> {
    use memvisor_cli::control::Client;
    let mut client = Client::connect(&args.control)?;
    if let Some(name) = &args.wait_event {
        let deadline = std::time::Instant::now() + Duration::from_secs(args.timeout);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let event = client
                .next_event(left)
                .with_context(|| format!("waiting for the event {name}"))?;
            if event["event"] == name.as_str() {
                println!("{event}");
                return Ok(());
            }
        }
    }
    let command = args.command.as_deref().unwrap_or_default();
    let mut arguments = serde_json::Map::new();
    for a in &args.arguments {
        let Some((name, value)) = a.split_once('=') else {
            bail!("argument {a:?}: write NAME=VALUE, e.g. target-mib=256");
        };
        let value = serde_json::from_str(value)
            .unwrap_or_else(|_| serde_json::Value::String(value.to_string()));
        arguments.insert(name.to_string(), value);
    }
    let answer = client.execute(command, serde_json::Value::Object(arguments))?;
    let text = serde_json::to_string_pretty(&answer)? + "\n";
    match io::stdout().write_all(text.as_bytes()) {
        // A reader that stopped early (`| head`) is not an error.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}
