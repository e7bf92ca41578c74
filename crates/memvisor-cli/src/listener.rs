//! Where a server's listening socket comes from: the vhost-user specification's "Backend program
//! conventions" (`--socket-path PATH`, `--fd N`) and systemd's socket activation (`LISTEN_FDS`).
//!
//! The model: a server names its socket one of three ways ([`SocketSpec`]).
//!
//! * A path. If systemd passed a listening socket already bound to that path (socket
//!   activation), that one is used, so a unit file and the command line can name the same
//!   path. Otherwise memvisor binds the path itself — but never takes a path from someone
//!   else: a path where a listener answers (`connect()` succeeds, or its queue of connections
//!   waiting to be accepted is full: `EAGAIN`, a busy server) is refused with an error naming
//!   it; a path that is not a socket is refused; only a stale socket (nothing listening:
//!   `ECONNREFUSED`) is replaced. A socket memvisor bound is removed when its [`Listener`] is
//!   dropped (at exit, or when a later step of the start fails), if the path still names it.
//! * `--fd N`: a listening Unix stream socket the parent left open as descriptor N. It is
//!   checked (open, a socket, Unix, stream, listening) before use and never unlinked.
//! * Neither ([`SocketSpec::Activated`]): a socket systemd passed (`LISTEN_PID` is this process,
//!   `LISTEN_FDS` counts them from fd 3). A server with one device takes the one passed. A
//!   device of `serve` takes the one whose name in `LISTEN_FDNAMES` (systemd's
//!   `FileDescriptorName=`, `systemd-socket-activate --fdname=`) is its id ([`open_device`]);
//!   failing that, the only passed socket not bound to a path another device names.
//!
//! The sockets systemd passes are taken from the environment once, the first time one is asked
//! for (`LISTEN_*` are then removed, so children do not see them). Each is claimed by at most
//! one device, whichever way it is named (path, `--fd`, name); [`check_all_claimed`] refuses a
//! start that would leave one unused, which is a unit file and a command line that disagree.
//!
//! The live check connects to the path without waiting (a non-blocking socket: a blocking
//! `connect()` to a listener whose queue is full waits for room, forever if it never accepts,
//! and is restarted after SIGTERM): a memvisor server on it sees one connection that closes
//! at once, which it takes as a frontend that left. A server that goes away between the check
//! and the bind leaves the path to the next start; the check is not atomic, and cannot be.
//!
//! A socket memvisor bound is also listed until its [`Listener`] removes it, so that a stop
//! during start-up that cannot wait for the listeners to be dropped still removes their paths
//! ([`remove_bound`]).
//!
//! **A path appears only once it is listening.** `bind()` creates the path before `listen()`
//! makes it connectable, and a launcher that waits for the path and then starts QEMU (or
//! `memvisor ctl`) can land in between and get ECONNREFUSED. So memvisor binds and listens on
//! a hidden name in the same directory (`.mv-PID-N`) and renames it to the path with
//! `RENAME_NOREPLACE` (a path someone bound meanwhile is not replaced: EEXIST, as `bind()`
//! would have said EADDRINUSE). A path too long for that name, or a file system without
//! `RENAME_NOREPLACE`, is bound directly.

use std::io;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, anyhow, bail};

/// How a server's socket is named on its command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketSpec {
    /// `--socket-path PATH` (or `--socket PATH`; a device's `socket=PATH`).
    Path(PathBuf),
    /// `--fd N` (a device's `fd=N`): an inherited listening socket.
    Fd(RawFd),
    /// Neither: a socket systemd passed (`LISTEN_FDS`, `LISTEN_FDNAMES`).
    Activated,
}

impl std::fmt::Display for SocketSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SocketSpec::Path(p) => write!(f, "{}", p.display()),
            SocketSpec::Fd(fd) => write!(f, "fd {fd}"),
            SocketSpec::Activated => write!(f, "a socket systemd passes"),
        }
    }
}

impl SocketSpec {
    /// From the two options of a server's command line (clap keeps them exclusive).
    pub fn from_args(path: Option<&Path>, fd: Option<RawFd>) -> SocketSpec {
        match (path, fd) {
            (Some(p), _) => SocketSpec::Path(p.to_path_buf()),
            (None, Some(fd)) => SocketSpec::Fd(fd),
            (None, None) => SocketSpec::Activated,
        }
    }
}

/// A listening socket and where it came from.
pub struct Listener {
    /// The socket.
    pub socket: UnixListener,
    /// Its path, if it is bound to one (an inherited socket may be abstract or unnamed).
    pub path: Option<PathBuf>,
    /// Device and inode of the socket file, if memvisor bound it (then it is removed at exit).
    bound_here: Option<(u64, u64)>,
    /// How it came, for messages: "PATH", "fd N (PATH)", "systemd fd N (PATH)".
    pub origin: String,
}

impl Listener {
    /// The socket's name in reports and logs: its path, or its origin if it has none.
    pub fn name(&self) -> String {
        match &self.path {
            Some(p) => p.display().to_string(),
            None => self.origin.clone(),
        }
    }

    /// Removes the socket file if memvisor bound it and the path still names that socket
    /// (also done on drop, so a start that fails half-way leaves no socket behind).
    pub fn remove(&self) {
        let (Some(path), Some((dev, ino))) = (&self.path, self.bound_here) else {
            return;
        };
        lock_bound().retain(|(p, d, i)| !(p == path && *d == dev && *i == ino));
        remove_if_same(path, dev, ino);
    }
}

/// Removes `path` if it still names the socket file `dev`/`ino`.
fn remove_if_same(path: &Path, dev: u64, ino: u64) {
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if m.dev() == dev && m.ino() == ino {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Sockets bound here and not yet removed: path, device, inode.
static BOUND: Mutex<Vec<(PathBuf, u64, u64)>> = Mutex::new(Vec::new());

fn lock_bound() -> std::sync::MutexGuard<'static, Vec<(PathBuf, u64, u64)>> {
    BOUND.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes every socket memvisor bound that is still there (each only if its path still names
/// it): for a process that ends without dropping its [`Listener`]s (a stop during start-up).
pub fn remove_bound() {
    for (path, dev, ino) in std::mem::take(&mut *lock_bound()) {
        remove_if_same(&path, dev, ino);
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.remove();
    }
}

/// A socket systemd passed: its descriptor and its name in `LISTEN_FDNAMES`, if any.
#[derive(Clone, Debug)]
struct Passed {
    fd: RawFd,
    name: Option<String>,
}

/// The sockets systemd passed and no device has claimed yet; `None` until first read.
static ACTIVATED: Mutex<Option<Vec<Passed>>> = Mutex::new(None);

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: RawFd = 3;

/// Runs `f` on the unclaimed activated sockets, reading them from the environment first if
/// this is the first call.
fn with_activated<T>(f: impl FnOnce(&mut Vec<Passed>) -> T) -> Result<T> {
    let mut guard = ACTIVATED.lock().unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        *guard = Some(read_listen_fds()?);
    }
    Ok(f(guard.as_mut().expect("just filled")))
}

/// `LISTEN_FDS` and `LISTEN_FDNAMES` for this process, as sd_listen_fds_with_names(3) reads
/// them; the variables are removed.
fn read_listen_fds() -> Result<Vec<Passed>> {
    let pid = std::env::var("LISTEN_PID").ok();
    let count = std::env::var("LISTEN_FDS").ok();
    let names = std::env::var("LISTEN_FDNAMES").ok();
    // SAFETY: first called by take_from_environment() before the server starts any thread,
    // so nothing reads the environment while it changes (remove_var's only requirement).
    unsafe {
        std::env::remove_var("LISTEN_PID");
        std::env::remove_var("LISTEN_FDS");
        std::env::remove_var("LISTEN_FDNAMES");
    }
    let (Some(pid), Some(count)) = (pid, count) else {
        return Ok(Vec::new());
    };
    if pid.trim().parse::<u32>().ok() != Some(std::process::id()) {
        // Meant for another process (the variables leaked through a parent): not ours.
        return Ok(Vec::new());
    }
    let n: RawFd = count
        .trim()
        .parse()
        .ok()
        .filter(|n| (0..=1024).contains(n))
        .ok_or_else(|| anyhow!("LISTEN_FDS={count:?} is not a count of descriptors (0-1024)"))?;
    let fds: Vec<RawFd> = (LISTEN_FDS_START..LISTEN_FDS_START + n).collect();
    for &fd in &fds {
        // Not passed on to anything this process starts.
        set_cloexec(fd).with_context(|| format!("LISTEN_FDS={n}: descriptor {fd}"))?;
    }
    // One name per descriptor, separated by colons; systemd's "unknown" is no name.
    let names: Vec<Option<String>> = match names {
        None => vec![None; fds.len()],
        Some(names) => {
            let list: Vec<&str> = names.split(':').collect();
            if list.len() != fds.len() {
                bail!(
                    "LISTEN_FDNAMES={names:?} names {} sockets and LISTEN_FDS={n} passes {}; \
                     the service manager must name each (or none)",
                    list.len(),
                    fds.len()
                );
            }
            list.into_iter()
                .map(|s| (!s.is_empty() && s != "unknown").then(|| s.to_string()))
                .collect()
        }
    };
    Ok(fds
        .into_iter()
        .zip(names)
        .map(|(fd, name)| Passed { fd, name })
        .collect())
}

fn set_cloexec(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor number reads and sets its flags; no memory is involved.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// An `int` socket option of `fd`.
fn sockopt(fd: RawFd, name: libc::c_int) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: value and len are locals of the sizes the kernel is told; it writes at most len
    // bytes to value.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(value)
    }
}

/// Checks that `fd` is an open, listening Unix stream socket; says what it is otherwise.
fn check_listening(fd: RawFd, what: &str) -> Result<()> {
    if (0..=2).contains(&fd) {
        bail!("{what}: descriptors 0, 1 and 2 are stdin, stdout and stderr, not a socket");
    }
    // SAFETY: fcntl(F_GETFD) only reads the descriptor's flags.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        bail!("{what}: descriptor {fd} is not open in this process");
    }
    let domain = sockopt(fd, libc::SO_DOMAIN).map_err(|e| {
        if e.raw_os_error() == Some(libc::ENOTSOCK) {
            anyhow!("{what}: descriptor {fd} is not a socket")
        } else {
            anyhow!("{what}: descriptor {fd}: {e}")
        }
    })?;
    if domain != libc::AF_UNIX {
        bail!("{what}: descriptor {fd} is not a Unix socket (domain {domain})");
    }
    if sockopt(fd, libc::SO_TYPE)? != libc::SOCK_STREAM {
        bail!("{what}: descriptor {fd} is not a stream socket");
    }
    if sockopt(fd, libc::SO_ACCEPTCONN)? == 0 {
        bail!("{what}: descriptor {fd} is a socket that is not listening (call listen() on it)");
    }
    Ok(())
}

/// Wraps a checked, claimed descriptor.
fn adopt(fd: RawFd, origin: &str) -> Result<Listener> {
    check_listening(fd, origin)?;
    set_cloexec(fd)?;
    // SAFETY: fd is open and a listening Unix stream socket (checked above); it was handed to
    // this process for this use and claimed once (by --fd, or taken out of the activated
    // list), so nothing else here owns or closes it.
    let socket = unsafe { UnixListener::from_raw_fd(fd) };
    let path = socket
        .local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(Path::to_path_buf));
    let origin = match &path {
        Some(p) => format!("{origin} ({})", p.display()),
        None => origin.to_string(),
    };
    Ok(Listener {
        socket,
        path,
        bound_here: None,
        origin,
    })
}

/// The path an inherited descriptor is bound to, if any.
fn bound_path(fd: RawFd) -> Option<PathBuf> {
    // Borrow without taking ownership: a listener built from a dup, dropped at once.
    // SAFETY: dup only creates a new descriptor for the same socket.
    let dup = unsafe { libc::dup(fd) };
    if dup < 0 {
        return None;
    }
    // SAFETY: dup is a fresh descriptor owned by nothing else; the listener closes it.
    let l = unsafe { UnixListener::from_raw_fd(dup) };
    l.local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(Path::to_path_buf))
}

/// Opens the listening socket `spec` names.
pub fn open(spec: &SocketSpec) -> Result<Listener> {
    match spec {
        SocketSpec::Fd(fd) => {
            // If systemd passed it too, it is claimed here.
            with_activated(|fds| fds.retain(|p| p.fd != *fd))?;
            adopt(*fd, &format!("--fd {fd}"))
        }
        SocketSpec::Activated => {
            let fds = with_activated(std::mem::take)?;
            match fds.as_slice() {
                [p] => adopt(p.fd, &passed_origin(p)),
                [] => bail!(
                    "no socket to listen on: give --socket-path PATH or --fd N, or start under \
                     systemd socket activation (LISTEN_FDS)"
                ),
                many => {
                    // Put them back: the error names them, nothing was taken.
                    let n = many.len();
                    with_activated(|f| *f = fds.clone())?;
                    bail!(
                        "systemd passed {n} sockets (LISTEN_FDS={n}) and no --socket-path says \
                         which to use"
                    )
                }
            }
        }
        SocketSpec::Path(path) => at(path),
    }
}

/// How a socket systemd passed is named in messages: "systemd socket NAME (fd N)".
fn passed_origin(p: &Passed) -> String {
    match &p.name {
        Some(name) => format!("systemd socket {name} (fd {})", p.fd),
        None => format!("systemd socket (fd {})", p.fd),
    }
}

/// Opens the socket of `serve`'s device `id`: as [`open`] for a path or a descriptor. A device
/// that names neither ([`SocketSpec::Activated`]) takes the socket systemd passed under the
/// name `id` (`LISTEN_FDNAMES`); failing that, the only passed socket left that is neither
/// named after one of `other_ids` nor bound to one of `other_paths` (what the server's other
/// devices and its control socket name, which claim theirs whatever the order).
pub fn open_device(
    spec: &SocketSpec,
    id: &str,
    other_ids: &[String],
    other_paths: &[PathBuf],
) -> Result<Listener> {
    if *spec != SocketSpec::Activated {
        return open(spec);
    }
    let others: Vec<PathBuf> = other_paths.iter().map(|p| absolute(p)).collect();
    let taken = with_activated(|fds| {
        if let Some(i) = fds.iter().position(|p| p.name.as_deref() == Some(id)) {
            return Ok(fds.remove(i));
        }
        let free: Vec<usize> = (0..fds.len())
            .filter(|&i| fds[i].name.as_ref().is_none_or(|n| !other_ids.contains(n)))
            .filter(|&i| bound_path(fds[i].fd).is_none_or(|p| !others.contains(&absolute(&p))))
            .collect();
        let names: Vec<String> = fds.iter().map(passed_origin).collect();
        match free.as_slice() {
            [i] => Ok(fds.remove(*i)),
            [] => Err(anyhow!(
                "device {id} names no socket and systemd passed none for it (passed and \
                 unclaimed: {}); give it socket=PATH or fd=N (or serve's --socket-path / --fd), \
                 or pass a socket named {id} (FileDescriptorName={id} in the .socket unit)",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            )),
            _ => Err(anyhow!(
                "device {id} names no socket and systemd passed several it could take ({}); \
                 name its socket {id} (FileDescriptorName={id} in the .socket unit) or give \
                 socket=PATH",
                names.join(", ")
            )),
        }
    })??;
    adopt(taken.fd, &passed_origin(&taken))
}

/// Listens on `path`: the socket systemd passed for it, or one bound here (see the module
/// comment for what is refused).
pub fn at(path: &Path) -> Result<Listener> {
    let want = absolute(path);
    let passed = with_activated(|fds| {
        let i = fds
            .iter()
            .position(|p| bound_path(p.fd).is_some_and(|p| absolute(&p) == want))?;
        Some(fds.remove(i))
    })?;
    if let Some(p) = passed {
        return adopt(p.fd, &passed_origin(&p));
    }
    bind(path)
}

/// `path` made absolute against the current directory, for comparing with inherited sockets.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Binds `path`, replacing only a stale socket.
fn bind(path: &Path) -> Result<Listener> {
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => bail!("cannot check {shown} before listening on it: {e}"),
        Ok(m) if !m.file_type().is_socket() => bail!(
            "{shown} exists and is not a socket; memvisor does not remove it: choose another \
             --socket-path or remove the file yourself"
        ),
        Ok(_) => match connect_without_waiting(path) {
            Ok(()) => bail!(
                "{shown} is in use: a server is listening on it (connect() succeeded); stop \
                 that server or choose another socket path"
            ),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => bail!(
                "{shown} is in use: a server is listening on it (busy: its queue of connections \
                 waiting to be accepted is full); stop that server or choose another socket path"
            ),
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                log::info!("{shown}: replacing a stale socket (nothing listens on it)");
                std::fs::remove_file(path)
                    .with_context(|| format!("{shown} is a stale socket and cannot be removed"))?;
            }
            Err(e) => bail!(
                "{shown} is a socket that cannot be checked ({e}); memvisor does not remove \
                 it: choose another socket path or remove it yourself"
            ),
        },
    }
    let socket = bind_listening(path)
        .with_context(|| format!("cannot listen on {shown}: is the directory writable?"))?;
    let m = std::fs::symlink_metadata(path)
        .with_context(|| format!("{shown} vanished right after it was bound"))?;
    lock_bound().push((path.to_path_buf(), m.dev(), m.ino()));
    Ok(Listener {
        socket,
        path: Some(path.to_path_buf()),
        bound_here: Some((m.dev(), m.ino())),
        origin: shown.to_string(),
    })
}

/// Connects to the socket at `path` without waiting and closes the connection: `Ok` if a
/// listener took it; `EAGAIN` if a listener is there whose queue is full (a blocking connect
/// would wait for it to accept); `ECONNREFUSED` if nothing listens; another error otherwise.
fn connect_without_waiting(path: &Path) -> io::Result<()> {
    use std::os::fd::{AsRawFd, OwnedFd};
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data, for which all zeros is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    // sun_path ends with a NUL, and a path with a NUL in it names another file.
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "the path does not fit a Unix socket address (107 bytes at most, no NUL)",
        ));
    }
    for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let flags = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: socket() takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns; it is closed on return.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    loop {
        // SAFETY: addr is a sockaddr_un that lives across the call, passed with its size; the
        // kernel only reads it.
        let r = unsafe {
            libc::connect(
                socket.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        // A non-blocking connect does not wait, so EINTR is at most a signal's moment.
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Binds and listens on a hidden name beside `path`, then renames it to `path` without
/// replacing anything there, so that `path` never exists unconnectable (module documentation).
fn bind_listening(path: &Path) -> io::Result<UnixListener> {
    use std::os::unix::ffi::OsStrExt;
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let hidden = path.with_file_name(format!(".mv-{}-{n}", std::process::id()));
    // sun_path holds 107 bytes and a NUL; a path near that limit is bound directly.
    if hidden.as_os_str().len() > 107 {
        return UnixListener::bind(path);
    }
    let _ = std::fs::remove_file(&hidden);
    let socket = UnixListener::bind(&hidden)?;
    let from = std::ffi::CString::new(hidden.as_os_str().as_bytes());
    let to = std::ffi::CString::new(path.as_os_str().as_bytes());
    let (Ok(from), Ok(to)) = (from, to) else {
        let _ = std::fs::remove_file(&hidden);
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    };
    // SAFETY: two NUL-terminated paths that live across the call; renameat2 only reads them.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r != 0 {
        let e = io::Error::last_os_error();
        let _ = std::fs::remove_file(&hidden);
        // A file system without RENAME_NOREPLACE: bind the path directly, as before.
        if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
            return UnixListener::bind(path);
        }
        return Err(e);
    }
    Ok(socket)
}

/// Refuses to go on with sockets systemd passed that no device took: the unit file and the
/// command line disagree.
pub fn check_all_claimed() -> Result<()> {
    let left = with_activated(|fds| fds.clone())?;
    if left.is_empty() {
        return Ok(());
    }
    let names: Vec<String> = left
        .iter()
        .map(|p| {
            let fd = p.fd;
            let name = p
                .name
                .as_ref()
                .map(|n| format!(" named {n}"))
                .unwrap_or_default();
            match bound_path(fd) {
                Some(path) => format!("fd {fd}{name} ({})", path.display()),
                None => format!("fd {fd}{name}"),
            }
        })
        .collect();
    bail!(
        "systemd passed sockets no device uses: {}; name each one's path on the command line \
         (--socket-path, --blk, --balloon, --control) or name each socket after its device's \
         id (LISTEN_FDNAMES)",
        names.join(", ")
    )
}

/// Reads the sockets systemd passed, and removes `LISTEN_*` from the environment. Servers call
/// it first thing, before they start a thread (changing the environment is safe only then);
/// later calls do nothing.
pub fn take_from_environment() -> Result<()> {
    with_activated(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("memvisor-listener-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn leftovers(d: &Path) -> Vec<String> {
        std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".mv-"))
            .collect()
    }

    #[test]
    fn a_bound_path_is_listening_and_leaves_no_hidden_name() {
        let d = dir().join("a");
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("s.sock");
        let listener = at(&path).unwrap();
        UnixStream::connect(&path).expect("the path exists, so it must be listening");
        assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));
        drop(listener);
        assert!(
            !path.exists(),
            "the socket memvisor bound is removed when dropped"
        );
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_rename_never_replaces_what_appeared_at_the_path_meanwhile() {
        let d = dir().join("b");
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("taken");
        std::fs::write(&path, b"someone else's").unwrap();
        let err = bind_listening(&path).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EEXIST), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"someone else's");
        assert!(leftovers(&d).is_empty(), "{:?}", leftovers(&d));
        let _ = std::fs::remove_dir_all(&d);
    }
}
