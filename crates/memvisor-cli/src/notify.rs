//! Readiness for service managers: the `sd_notify` protocol, without libsystemd.
//!
//! The model: when `NOTIFY_SOCKET` is set (systemd does for `Type=notify` units), the server
//! sends one datagram `READY=1` to it once every socket it serves is listening, so a unit that
//! starts after it (QEMU, libvirt) finds the sockets there; and `STOPPING=1` when a signal has
//! told it to stop. The variable names a Unix datagram socket by path (`/run/...`) or, starting
//! with `@`, by an abstract name. Without the variable nothing is sent. A variable that is set
//! but cannot be used is logged and otherwise ignored: the server works without it, and the
//! service manager times the unit out, which says more than a server that refuses to start.
//!
//! **Sending never hangs.** A datagram to a socket whose queue is full waits for room, and a
//! blocking send is restarted after a signal, so a manager that does not read (or a stand-in
//! that never does) would keep the server from ever serving or stopping. The datagram is sent
//! without waiting; while the queue is full it is tried again every 10 ms for a bounded time,
//! or until the caller gives up (a server told to stop does not wait to say it is ready), and
//! then logged as not sent.

use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

/// How long [`notify`] keeps trying while the manager's queue is full.
pub const WAIT: Duration = Duration::from_secs(5);

/// Sends `state` (e.g. `READY=1`) to `$NOTIFY_SOCKET`, if set, trying for up to [`WAIT`]
/// while its queue is full; returns whether it was sent.
pub fn notify(state: &str) -> bool {
    notify_within(state, WAIT, &|| false)
}

/// [`notify`], trying for up to `wait` while the queue is full, and no longer once `give_up()`
/// says so.
pub fn notify_within(state: &str, wait: Duration, give_up: &dyn Fn() -> bool) -> bool {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let target = target.to_string_lossy().into_owned();
    match send(&target, state, wait, give_up) {
        Ok(()) => {
            log::debug!("told the service manager ({target}): {state}");
            true
        }
        Err(e) => {
            log::warn!("NOTIFY_SOCKET={target:?}: cannot send {state:?}: {e}");
            false
        }
    }
}

fn send(
    target: &str,
    state: &str,
    wait: Duration,
    give_up: &dyn Fn() -> bool,
) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    sock.set_nonblocking(true)?;
    let send_once = || -> std::io::Result<()> {
        if let Some(name) = target.strip_prefix('@') {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        } else if target.starts_with('/') {
            sock.send_to(state.as_bytes(), target)?;
        } else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "neither a path (/...) nor an abstract name (@...)",
            ));
        }
        Ok(())
    };
    let start = Instant::now();
    loop {
        match send_once() {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                ) =>
            {
                if give_up() {
                    return Err(std::io::Error::new(
                        e.kind(),
                        "its queue is full, and the server is stopping: not waiting for room",
                    ));
                }
                if start.elapsed() >= wait {
                    return Err(std::io::Error::new(
                        e.kind(),
                        format!(
                            "its queue stayed full for {wait:?}: is the service manager reading it?"
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}
