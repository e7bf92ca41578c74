//! The `memvisor` command. `memvisor bench` picks experiments from the registry
//! ([`bench::all`]), runs them one after another with a shared [`Ctx`], prints each one's tables as
//! it finishes and writes the report. Human-readable output goes to stdout, or to stderr with
//! `--json` so that stdout carries exactly one JSON object. A failing experiment does not stop the
//! others; the report covers those that succeeded and the exit code is non-zero.
//!
//! The servers (`vhost-user-blk`, `serve`, `vfio-user`) follow the vhost-user specification's
//! back end conventions: `--socket-path` (alias `--socket`), `--fd N`, systemd socket
//! activation, `--print-capabilities`, sd_notify readiness, `RUST_LOG`
//! (docs/deploying.md). Test-only switches are not options: a `test-hooks` build reads them
//! from `MEMVISOR_TEST_*` environment variables, once (`serve::test_faults`).

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use memvisor_cli::bench::{self, Ctx, Experiment, Mode, machine::Machine, report};
use memvisor_cli::listener::SocketSpec;
use memvisor_cli::{capabilities, serve};
use std::io::{self, IsTerminal, Write};
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
    /// Reproduce the kernel patches' measurements (the seeds, listed in the report) side by side
    /// and write report.md, results.json and SVG charts
    Bench(BenchArgs),
    /// Serve a virtio-blk device over a raw image or a block device on a vhost-user socket (until
    /// SIGINT/SIGTERM)
    #[command(name = "vhost-user-blk")]
    VhostUserBlk(BlkArgs),
    /// Serve several vhost-user devices from one process, sharing one memvisor state
    Serve(ServeArgs),
    /// Ask a running server through its --control socket: query-devices, query-stats,
    /// balloon-set-target target-mib=N; or wait for an event
    Ctl(CtlArgs),
    /// Serve the mvdma reference DMA device to vfio-user clients (QEMU's vfio-user-pci), one
    /// after another, until SIGINT/SIGTERM; each client's memory and pins are released when it
    /// goes
    #[command(name = "vfio-user")]
    VfioUser(VfioUserArgs),
    /// Act as a hostile vhost-user frontend: send malformed messages to a back end for a while
    #[command(name = "vhost-user-fuzz")]
    VhostUserFuzz(FuzzArgs),
    /// Act as a hostile vfio-user client: send malformed and well-formed messages to a server
    /// for a while, reconnecting whenever it hangs up
    #[command(name = "vfio-user-fuzz")]
    VfioUserFuzz(FuzzArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// A virtio-blk device (repeatable): options separated by commas, the socket's name may be
    /// left out: socket=PATH, disk=FILE (raw image or block device), id=NAME (for the control socket; default
    /// blk0, blk1, ...), queues=N (1-64, default 1), read-only=on, serial=TEXT (GET_ID, at most
    /// 20 bytes; default: the device's id), direct=on (open the image O_DIRECT; default: the
    /// host page cache), poll-us=N (poll the rings N µs before sleeping; default 0),
    /// locking=on|off|auto (QEMU's image locks, as its file.locking; default auto),
    /// format=raw (serve an image whose first bytes look like qcow2, VMDK, LUKS, ...)
    #[arg(long, value_name = "socket=PATH,disk=FILE[,OPTION=VALUE...]")]
    blk: Vec<memvisor_cli::devices::BlkSpec>,
    /// A virtio-balloon device (repeatable; QEMU: vhost-user-test-device-pci,virtio-id=5,
    /// num_vqs=3,config_size=16, num_vqs=4 with stats-interval): socket=PATH, id=NAME (default
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
    /// Print the device types this server hosts as JSON (a list of the vhost-user
    /// specification's capabilities objects) and exit
    #[arg(long)]
    print_capabilities: bool,
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
    /// Print the back end's capabilities as JSON (the vhost-user specification's) and exit
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
    /// Write every DMA_MAP / DMA_UNMAP to FILE, for `memvisor bench vfio-user --replay FILE`
    #[arg(long, value_name = "FILE")]
    record: Option<PathBuf>,
    /// Hold the pages the device pins with the kernel's long-term pin (FOLL_LONGTERM, through
    /// io_uring) instead of mlock: cheaper for a page not pinned before (figures in the README).
    /// Needs io_uring (seccomp profiles often forbid it); the kernel shows such pages in VmPin,
    /// not VmLck
    #[arg(long)]
    long_term_pins: bool,
}

#[derive(Args)]
struct CtlArgs {
    /// The server's control socket (its --control PATH)
    #[arg(long, value_name = "PATH")]
    control: PathBuf,
    /// The command: query-devices, query-stats, balloon-set-target, query-commands
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
struct FuzzArgs {
    /// Socket of the back end or server to attack
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// How long to keep at it
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Seed of the message generator (the same seed sends the same messages)
    #[arg(long, default_value_t = 1)]
    seed: u64,
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
    /// Offer VIRTIO_F_IOMMU_PLATFORM: the device may sit behind a vIOMMU (QEMU:
    /// iommu_platform=on,ats=on on the device, -device intel-iommu,device-iotlb=on)
    #[arg(long)]
    iommu: bool,
    /// After the last request, keep looking at the rings for new ones for this many
    /// microseconds before sleeping until a kick: lower latency at low queue depth for a
    /// busy core. Default 0: sleep at once
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
    /// Write the IOTLB traffic (memory tables, updates, invalidates, misses) to FILE, for
    /// `memvisor bench iotlb --replay FILE`
    #[arg(long, value_name = "FILE")]
    record_iotlb: Option<PathBuf>,
}

#[derive(Args)]
struct BenchArgs {
    /// Experiments to run, in this order: lookup, translate, rw, pin, map-unmap, pin-pages,
    /// report, iotlb, vfio-user (the default: all of these); and, only when named, guest
    /// (real-guest trials) and blk (the blk back end beside qemu-storage-daemon under libblkio),
    /// both need root and minutes; scale (cost against size: dirty log drains at guest sizes up
    /// to 1 TiB of sparse memory, translate, map+unmap, IOTLB and pin rows); and kvm (memslot
    /// updates, MMIO exits and dirty harvests through memvisor-kvm): needs /dev/kvm
    #[arg(value_name = "EXPERIMENT")]
    experiments: Vec<String>,
    /// Small sizes: the whole suite in minutes (the default; the README gives its time)
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    /// The seeds' sizes, where memory allows
    #[arg(long)]
    full: bool,
    /// Directory for the report, created if missing
    #[arg(long, value_name = "DIR", default_value = "target/memvisor-report")]
    out: PathBuf,
    /// Print one JSON object with all results on stdout; tables go to stderr
    #[arg(long)]
    json: bool,
    /// Repetitions per measurement, overriding each experiment's default
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    runs: Option<u32>,
    /// A recorded IOTLB stream for the iotlb experiment (`vhost-user-blk --record-iotlb`);
    /// repeatable. Default: the real-guest trials' recordings under target/guest/run, if any
    #[arg(long, value_name = "FILE")]
    replay: Vec<PathBuf>,
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Bench(args) => run_bench(&args),
        Command::VhostUserBlk(args) => run_blk(&args),
        Command::VhostUserFuzz(args) => run_fuzz(&args),
        Command::VfioUserFuzz(args) => run_vfio_user_fuzz(&args),
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

/// What every server does first: the log, the signals, the sockets systemd passed.
fn start_server() -> Result<()> {
    serve::init_logging()?;
    memvisor_cli::listener::take_from_environment()?;
    serve::stop_on_signals();
    Ok(())
}

fn run_blk(args: &BlkArgs) -> Result<()> {
    if args.socket.print_capabilities {
        return print_capabilities(capabilities::vhost_user_blk());
    }
    start_server()?;
    let Some(disk) = args.disk.as_ref() else {
        bail!("--disk FILE is required");
    };
    if args.long_term_pins {
        serve::use_long_term_pins()?;
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
    let spec = memvisor_cli::devices::BlkSpec {
        id: None,
        socket: args.socket.socket_path.clone().unwrap_or_default(),
        disk: disk.clone(),
        options: memvisor_vhost::BlkOptions {
            queues: args.queues,
            serial,
            read_only: args.read_only,
            iommu: false,
            poll_us: args.poll_us,
            guard_first_sector: false,
        },
        direct: args.direct,
        locking: args.locking,
        format: args.format.unwrap_or_default(),
    };
    let report = serve::blk(
        &args.socket.spec(),
        spec,
        args.iommu,
        args.record_iotlb.as_deref(),
        args.control.as_deref(),
        args.stats.as_deref(),
    )?;
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    serve::write_json(args.stats.as_ref(), &report)
}

fn run_serve(args: &ServeArgs) -> Result<()> {
    if args.print_capabilities {
        return print_capabilities(capabilities::serve());
    }
    let mut config = match &args.config {
        Some(path) => memvisor_cli::devices::Config::read(path)?,
        None => Default::default(),
    };
    config.blk.extend(args.blk.iter().cloned());
    config.balloon.extend(args.balloon.iter().cloned());
    if config.blk.is_empty() && config.balloon.is_empty() {
        bail!(
            "nothing to serve: give --blk socket=PATH,disk=FILE and/or --balloon socket=PATH \
             (or a --config file that names devices)"
        );
    }
    start_server()?;
    if args.long_term_pins || config.long_term_pins {
        serve::use_long_term_pins()?;
    }
    if !config.blk.is_empty() {
        serve::note_blk_locked_memory(args.long_term_pins || config.long_term_pins);
    }
    let stats = args.stats.clone().or(config.stats);
    let devices = serve::Devices {
        blk: config.blk,
        balloon: config.balloon,
        control: args.control.clone().or(config.control),
        iommu: args.iommu || config.iommu,
        stats: stats.clone(),
    };
    let report = serve::serve(&devices)?;
    eprintln!("{}", serde_json::to_string_pretty(&report)?);
    serve::write_json(stats.as_ref(), &report)
}

fn run_vfio_user(args: &VfioUserArgs) -> Result<()> {
    if args.socket.print_capabilities {
        return print_capabilities(capabilities::vfio_user());
    }
    start_server()?;
    let report = serve::vfio_user(
        &args.socket.spec(),
        args.record.as_deref(),
        args.long_term_pins,
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

fn run_fuzz(args: &FuzzArgs) -> Result<()> {
    let stats = memvisor_vhost::fuzz::run(
        &args.socket,
        args.seed,
        std::time::Duration::from_secs(args.seconds),
    )
    .with_context(|| format!("fuzzing the back end at {}", args.socket.display()))?;
    println!(
        "vhost-user-fuzz: {} connections, {} messages, {} replies ({} refusals), {} hang-ups",
        stats.connections, stats.messages, stats.replies, stats.refusals, stats.hangups
    );
    Ok(())
}

fn run_vfio_user_fuzz(args: &FuzzArgs) -> Result<()> {
    let s = memvisor_vfio_user::fuzz::run(
        &args.socket,
        args.seed,
        std::time::Duration::from_secs(args.seconds),
    )
    .with_context(|| format!("fuzzing the vfio-user server at {}", args.socket.display()))?;
    println!(
        "vfio-user-fuzz (seed {}): {} connections, {} messages, {} replies ({} refusals), {} \
         hang-ups, {} abandoned, {} tables started, {} DMA_READ/DMA_WRITE answered",
        args.seed,
        s.connections,
        s.messages,
        s.replies,
        s.refusals,
        s.hangups,
        s.abandoned,
        s.tables,
        s.server_requests
    );
    Ok(())
}

/// The registered experiments named on the command line, in that order; all of them if none.
fn select(names: &[String]) -> Result<Vec<Box<dyn Experiment>>> {
    let mut registry = bench::all();
    if names.is_empty() {
        return Ok(registry);
    }
    registry.extend(bench::on_request());
    let known: Vec<&str> = registry.iter().map(|e| e.name()).collect();
    if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
        bail!(
            "unknown experiment `{bad}`; known experiments: {} (omit names to run all but guest)",
            known.join(", ")
        );
    }
    let mut selected = Vec::new();
    for name in names {
        if let Some(i) = registry.iter().position(|e| e.name() == name) {
            selected.push(registry.remove(i));
        }
    }
    Ok(selected)
}

fn run_bench(args: &BenchArgs) -> Result<()> {
    let experiments = select(&args.experiments)?;
    let mode = if args.full { Mode::Full } else { Mode::Quick };
    std::fs::create_dir_all(&args.out).with_context(|| {
        format!(
            "cannot create output directory {}; pass a writable one with --out",
            args.out.display()
        )
    })?;
    let machine = Machine::detect();
    let mut human: Box<dyn Write> = if args.json {
        Box::new(io::stderr())
    } else {
        Box::new(io::stdout())
    };
    writeln!(
        human,
        "{}\nmode: {}\n{}",
        machine.describe(),
        mode.as_str(),
        report::READING
    )?;

    // Progress bars only for a person watching: never in captured or piped output, nor with
    // --json, whose stderr carries the tables instead.
    let progress = !args.json && io::stdout().is_terminal() && io::stderr().is_terminal();
    let mut ctx = Ctx::new(mode, args.runs).with_progress(progress);
    ctx.replay = args.replay.clone();
    let mut sections = Vec::new();
    let mut failed = Vec::new();
    for (i, experiment) in experiments.iter().enumerate() {
        human.flush()?;
        eprintln!(
            "[{}/{}] running {}",
            i + 1,
            experiments.len(),
            experiment.name()
        );
        match experiment.run(&mut ctx) {
            Ok(outcome) => {
                let section = report::Section {
                    experiment: experiment.as_ref(),
                    outcome,
                };
                write!(human, "{}", section.to_text())?;
                sections.push(section);
            }
            Err(err) => {
                eprintln!("error: experiment `{}` failed: {err:#}", experiment.name());
                failed.push(experiment.name());
            }
        }
    }

    let skipped: Vec<String> = sections
        .iter()
        .filter(|s| !s.outcome.skipped.is_empty())
        .map(|s| format!("{} ({})", s.experiment.name(), s.outcome.skipped.len()))
        .collect();
    if !skipped.is_empty() {
        writeln!(
            human,
            "\nskipped cases in: {}; why: the `skipped:` lines above (also in report.md)",
            skipped.join(", ")
        )?;
    }
    let paths = report::write(&args.out, &machine, mode, &sections)?;
    if args.json {
        println!("{}", report::to_json(&machine, mode, &sections)?);
    }
    writeln!(human, "\nreport written to {}", paths[0].display())?;
    human.flush()?;
    if !failed.is_empty() {
        bail!(
            "{} experiment(s) failed: {}; see the messages above (the report covers the others)",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}
