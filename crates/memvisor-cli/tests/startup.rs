//! Start-up never hangs and always ends on SIGTERM (issue 45, item 7), checked on the `memvisor`
//! binary:
//! - a socket path held by a live listener whose accept queue is full (`listen(0)` and one
//!   connection waiting) is refused at once, as a live socket is: the probe does not wait for
//!   room in the queue;
//! - the same, with SIGTERM sent as soon as the server has its signal handlers: it ends within
//!   a second (refusing the path, or stopped by the signal);
//! - a start-up step that waits on something else — the service manager's notification socket
//!   with a full queue (`READY=1` cannot be sent), a `--record-iotlb` FIFO nobody reads — ends
//!   within a second of SIGTERM, exit status 0 (a stop that was asked for), and `READY=1` is
//!   never sent after the stop.
//!
//! "Within a second" is the bound for a back end told to stop, not a speed figure: a
//! server that hangs takes forever, and is killed after 20 s. Nothing here needs root.

mod common;

use common::Dir;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixDatagram, UnixStream};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_memvisor");
/// How long a server told to stop may take: the bound.
const STOP_BOUND: Duration = Duration::from_secs(1);
/// After this, a server still running is taken as hung, killed, and the test fails.
const HUNG: Duration = Duration::from_secs(20);

fn cvt(r: libc::c_int, what: &str) -> libc::c_int {
    assert!(r >= 0, "{what}: {}", std::io::Error::last_os_error());
    r
}

/// A Unix stream socket (non-blocking if asked) and `path` as its address.
fn socket_at(path: &Path, nonblocking: bool) -> (OwnedFd, libc::sockaddr_un) {
    use std::os::unix::ffi::OsStrExt;
    let flags =
        libc::SOCK_STREAM | libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: socket() takes no pointers; the new descriptor is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(cvt(libc::socket(libc::AF_UNIX, flags, 0), "socket")) };
    // SAFETY: sockaddr_un is plain data; all zeros is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    assert!(
        bytes.len() < addr.sun_path.len(),
        "{} is too long",
        path.display()
    );
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    (fd, addr)
}

const ADDR_LEN: libc::socklen_t = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;

/// A listener on `path` with `listen(0)` and one connection waiting in its accept queue, which
/// is then full: a non-blocking connect is refused with EAGAIN (checked), a blocking one waits.
struct BusyListener {
    listener: OwnedFd,
    _waiting: UnixStream,
}

impl BusyListener {
    fn new(path: &Path) -> BusyListener {
        let (listener, addr) = socket_at(path, false);
        // SAFETY: addr is a sockaddr_un of ADDR_LEN bytes that lives across the call.
        cvt(
            unsafe { libc::bind(listener.as_raw_fd(), (&raw const addr).cast(), ADDR_LEN) },
            "bind",
        );
        // SAFETY: no pointers.
        cvt(
            unsafe { libc::listen(listener.as_raw_fd(), 0) },
            "listen(0)",
        );
        let waiting = UnixStream::connect(path).expect("the one connection listen(0) queues");
        // The queue is full: a second, non-blocking connect is refused with EAGAIN.
        let (probe, addr) = socket_at(path, true);
        // SAFETY: as above.
        let r = unsafe { libc::connect(probe.as_raw_fd(), (&raw const addr).cast(), ADDR_LEN) };
        let e = std::io::Error::last_os_error();
        assert!(
            r < 0 && e.raw_os_error() == Some(libc::EAGAIN),
            "the listener's queue must be full (a connect would wait): connect gave {r}, {e}"
        );
        BusyListener {
            listener,
            _waiting: waiting,
        }
    }
    /// Accepts the connection waiting (the listener still works).
    fn accept_one(&self) {
        // SAFETY: accept4 with null address pointers; the new descriptor is owned at once.
        let fd = unsafe {
            libc::accept4(
                self.listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        // SAFETY: a fresh descriptor owned by nothing else.
        drop(unsafe { OwnedFd::from_raw_fd(cvt(fd, "accept")) });
    }
}

/// `memvisor vhost-user-blk --socket-path SOCK --disk DISK ARGS...`, stderr to a file.
fn blk(dir: &Dir, sock: &Path, args: &[&str]) -> (Command, PathBuf) {
    let stderr = dir.join("stderr.log");
    let mut c = Command::new(BIN);
    c.arg("vhost-user-blk")
        .arg("--socket-path")
        .arg(sock)
        .arg("--disk")
        .arg(dir.disk())
        .args(args)
        .env_remove("RUST_LOG")
        .env_remove("MEMVISOR_LOG")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_PID")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap());
    (c, stderr)
}

/// Whether `pid` catches SIGTERM yet (its handler is installed), from /proc; `None` once it
/// has exited.
fn catches_sigterm(pid: u32) -> Option<bool> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    if status
        .lines()
        .any(|l| l.starts_with("State:") && l.contains("zombie"))
    {
        return None;
    }
    let mask = status.lines().find_map(|l| l.strip_prefix("SigCgt:"))?;
    let mask = u64::from_str_radix(mask.trim(), 16).ok()?;
    Some(mask >> (libc::SIGTERM - 1) & 1 == 1)
}

/// Waits until `child` has its SIGTERM handler and `ready()` says so (or it exits first:
/// returns false).
fn wait_until(child: &mut Child, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        if catches_sigterm(child.id()) == Some(true) && ready() {
            return true;
        }
        if start.elapsed() > HUNG {
            let _ = child.kill();
            panic!("memvisor neither started nor exited within {HUNG:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits for `child` to exit; kills it and fails after [`HUNG`].
fn wait_for(child: &mut Child, what: &str, log: &Path) -> (ExitStatus, Duration) {
    let start = Instant::now();
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return (s, start.elapsed());
        }
        if start.elapsed() > HUNG {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what}: memvisor still running after {HUNG:?}: start-up hangs\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn sigterm(child: &Child) {
    // SAFETY: kill only sends a signal, to our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
}

#[test]
fn a_busy_listener_is_refused_at_once_and_left_unharmed() {
    let dir = Dir::new("busy");
    let sock = dir.join("busy.sock");
    let busy = BusyListener::new(&sock);
    let before = std::fs::metadata(&sock).unwrap();
    let (mut cmd, log) = blk(&dir, &sock, &[]);
    let mut child = cmd.spawn().unwrap();
    let (status, took) = wait_for(&mut child, "busy listener", &log);
    let err = std::fs::read_to_string(&log).unwrap();
    println!(
        "start-up: busy listener: {status} after {took:?}: {}",
        err.trim()
    );
    assert!(
        !status.success() && status.signal().is_none(),
        "{status}: {err}"
    );
    assert!(
        err.contains(&format!("{} is in use", sock.display())),
        "the refusal names the path and says it is in use: {err}"
    );
    // The listener's path and socket are untouched, and it still accepts.
    let now = std::fs::metadata(&sock).expect("the busy listener's path is left alone");
    assert_eq!((now.dev(), now.ino()), (before.dev(), before.ino()));
    busy.accept_one();
}

#[test]
fn a_busy_listener_start_ends_within_a_second_of_sigterm() {
    let dir = Dir::new("busy-term");
    let sock = dir.join("busy.sock");
    let _busy = BusyListener::new(&sock);
    let (mut cmd, log) = blk(&dir, &sock, &[]);
    let mut child = cmd.spawn().unwrap();
    // As soon as SIGTERM is the server's to handle (before that it would simply kill it).
    if !wait_until(&mut child, || true) {
        let status = child.wait().unwrap();
        let err = std::fs::read_to_string(&log).unwrap();
        println!(
            "start-up: busy listener + SIGTERM: refused before the handler was seen: {status}"
        );
        assert!(
            !status.success() && err.contains("is in use"),
            "{status}: {err}"
        );
        return;
    }
    sigterm(&child);
    let (status, took) = wait_for(&mut child, "busy listener + SIGTERM", &log);
    let err = std::fs::read_to_string(&log).unwrap();
    println!("start-up: busy listener + SIGTERM: {status}, {took:?} after the signal");
    assert!(took < STOP_BOUND, "{took:?} after SIGTERM: {err}");
    assert!(
        status.signal().is_none(),
        "{status}: it handles SIGTERM itself"
    );
    // Either it refused the path by itself, or the signal stopped it (exit 0, nothing served).
    assert!(
        status.success() || err.contains("is in use"),
        "{status}: {err}"
    );
}

/// A datagram socket standing in for systemd's notification socket, with its queue full: a
/// non-blocking send from a fresh socket is refused with EAGAIN (a blocking one waits).
fn full_notify_socket(path: &Path) -> UnixDatagram {
    let receiver = UnixDatagram::bind(path).unwrap();
    for _ in 0..10_000 {
        let sender = UnixDatagram::unbound().unwrap();
        sender.set_nonblocking(true).unwrap();
        let mut first = true;
        loop {
            match sender.send_to(b"FILLER=1", path) {
                Ok(_) => first = false,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        if first {
            return receiver;
        }
    }
    panic!("could not fill the queue of {}", path.display());
}

fn drain(receiver: &UnixDatagram) -> Vec<String> {
    receiver.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 256];
    let mut out = Vec::new();
    while let Ok(n) = receiver.recv(&mut buf) {
        out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    out
}

#[test]
fn a_full_notify_socket_does_not_keep_sigterm_from_ending_start_up() {
    let dir = Dir::new("notify-full");
    let sock = dir.join("blk.sock");
    let notify = dir.join("notify.sock");
    let receiver = full_notify_socket(&notify);
    let (mut cmd, log) = blk(&dir, &sock, &[]);
    cmd.env("NOTIFY_SOCKET", &notify);
    let mut child = cmd.spawn().unwrap();
    // Every socket listens: the next step is READY=1, which cannot go out.
    assert!(
        wait_until(&mut child, || sock.exists()),
        "memvisor exited: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    sigterm(&child);
    let (status, took) = wait_for(&mut child, "full notify socket + SIGTERM", &log);
    let err = std::fs::read_to_string(&log).unwrap();
    println!("start-up: full NOTIFY_SOCKET + SIGTERM: {status}, {took:?} after the signal");
    assert!(took < STOP_BOUND, "{took:?} after SIGTERM: {err}");
    assert!(
        status.success(),
        "{status}: a stop that was asked for: {err}"
    );
    let sent: Vec<String> = drain(&receiver)
        .into_iter()
        .filter(|m| m != "FILLER=1")
        .collect();
    assert!(
        !sent.iter().any(|m| m == "READY=1"),
        "READY=1 after the stop: {sent:?}"
    );
    assert!(!sock.exists(), "the socket it bound is removed: {err}");
}

#[test]
fn a_start_up_step_that_waits_ends_within_a_second_of_sigterm() {
    // A read-only disk image that is a FIFO nobody writes: opening it waits for a writer. (The
    // socket is bound after the image is opened, so the test waits for the signal handler.)
    let dir = Dir::new("fifo");
    let sock = dir.join("blk.sock");
    let fifo = dir.join("disk.fifo");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    cvt(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, "mkfifo");
    let log = dir.join("stderr.log");
    let mut child = Command::new(BIN)
        .arg("vhost-user-blk")
        .arg("--socket-path")
        .arg(&sock)
        .arg("--disk")
        .arg(&fifo)
        .arg("--read-only")
        .env_remove("RUST_LOG")
        .env_remove("NOTIFY_SOCKET")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_PID")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    assert!(
        wait_until(&mut child, || true),
        "memvisor exited: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    // Still waiting on the FIFO (nothing opened it for writing).
    std::thread::sleep(Duration::from_millis(100));
    assert!(child.try_wait().unwrap().is_none());
    sigterm(&child);
    let (status, took) = wait_for(&mut child, "FIFO + SIGTERM", &log);
    let err = std::fs::read_to_string(&log).unwrap();
    println!("start-up: a step waiting on a FIFO + SIGTERM: {status}, {took:?} after the signal");
    assert!(took < STOP_BOUND, "{took:?} after SIGTERM: {err}");
    assert!(
        status.success(),
        "{status}: a stop that was asked for: {err}"
    );
    assert!(
        err.contains("during start-up"),
        "it says start-up was stopped: {err}"
    );
    assert!(!sock.exists(), "the socket it bound is removed: {err}");
}
