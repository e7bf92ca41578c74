//! `memvisor vhost-user-blk` (and the devices that follow): serve a device on a vhost-user
//! socket until SIGINT or SIGTERM, then print (and optionally write) what it did.
//!
//! Several `--blk` / `--balloon` devices given to one process share memvisor's process-wide
//! state — one mapping per range of guest memory and one pin registry — so a balloon discard
//! never frees a page the block device has pinned for I/O in flight.

use std::fs::OpenOptions;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::{Context, Result};
use memvisor_vhost::{Backend, BackendStats, Blk, BlkOptions, BlkStats};
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

/// Binds `path`, replacing a stale socket left by an earlier run.
pub fn listen(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        std::fs::remove_file(path)
            .with_context(|| format!("{} exists and cannot be removed", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| {
        format!(
            "cannot listen on {}: is the directory writable?",
            path.display()
        )
    })
}

/// What a block back end did, for `--stats`.
#[derive(Serialize)]
pub struct BlkReport {
    /// Socket served.
    pub socket: String,
    /// Protocol counts.
    pub connections: u64,
    /// Messages handled.
    pub messages: u64,
    /// Messages refused.
    pub refused: u64,
    /// Kicks.
    pub kicks: u64,
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
    /// Requests by pinned 4 KiB pages, as `[pages up to, requests]`.
    pub npage_histogram: Vec<(u64, u64)>,
}

impl BlkReport {
    fn new(socket: &Path, b: &BackendStats, s: &BlkStats) -> Self {
        BlkReport {
            socket: socket.display().to_string(),
            connections: b.connections,
            messages: b.messages,
            refused: b.refused,
            kicks: b.kicks,
            reads: s.reads,
            writes: s.writes,
            flushes: s.flushes,
            bytes_read: s.bytes_read,
            bytes_written: s.bytes_written,
            failed: s.failed,
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

/// Serves a virtio-blk device over `disk` on `socket` until a signal; returns its report.
pub fn blk(socket: &Path, disk: &Path, options: BlkOptions) -> Result<BlkReport> {
    let file = OpenOptions::new()
        .read(true)
        .write(!options.read_only)
        .open(disk)
        .with_context(|| format!("cannot open disk image {}", disk.display()))?;
    let listener = listen(socket)?;
    let mut backend = Backend::new(Blk::new(file, options)?)?;
    log::info!(
        "vhost-user-blk: serving {} on {}",
        disk.display(),
        socket.display()
    );
    backend.serve(&listener, &STOP)?;
    let _ = std::fs::remove_file(socket);
    Ok(BlkReport::new(
        socket,
        &backend.stats,
        &backend.device().stats,
    ))
}

/// Writes `value` as JSON to `path`, if given.
pub fn write_json<T: Serialize>(path: Option<&PathBuf>, value: &T) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, serde_json::to_string_pretty(value)?)
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    Ok(())
}

/// A logger to stderr: `MEMVISOR_LOG=debug|info|warn|error` (default info).
pub fn init_logging() {
    struct Stderr(log::LevelFilter);
    impl log::Log for Stderr {
        fn enabled(&self, m: &log::Metadata) -> bool {
            m.level() <= self.0
        }
        fn log(&self, r: &log::Record) {
            if self.enabled(r.metadata()) {
                eprintln!(
                    "memvisor[{}] {}: {}",
                    std::process::id(),
                    r.level(),
                    r.args()
                );
            }
        }
        fn flush(&self) {}
    }
    let level = match std::env::var("MEMVISOR_LOG").as_deref() {
        Ok("debug") => log::LevelFilter::Debug,
        Ok("warn") => log::LevelFilter::Warn,
        Ok("error") => log::LevelFilter::Error,
        Ok("trace") => log::LevelFilter::Trace,
        _ => log::LevelFilter::Info,
    };
    let logger: &'static Stderr = Box::leak(Box::new(Stderr(level)));
    if log::set_logger(logger).is_ok() {
        log::set_max_level(level);
    }
}
