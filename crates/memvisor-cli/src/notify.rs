//! Readiness for service managers: the `sd_notify` protocol, without libsystemd.
//!
//! The model: when `NOTIFY_SOCKET` is set (systemd does for `Type=notify` units), the server
//! sends one datagram `READY=1` to it once every socket it serves is listening, so a unit that
//! starts after it (QEMU, libvirt) finds the sockets there; and `STOPPING=1` when a signal has
//! told it to stop. The variable names a Unix datagram socket by path (`/run/...`) or, starting
//! with `@`, by an abstract name. Without the variable nothing is sent. A variable that is set
//! but cannot be used is logged and otherwise ignored: the server works without it, and the
//! service manager times the unit out, which says more than a server that refuses to start.

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to `$NOTIFY_SOCKET`, if set; returns whether it was sent.
pub fn notify(state: &str) -> bool {
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return false;
    };
    let target = target.to_string_lossy().into_owned();
    match send(&target, state) {
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

fn send(target: &str, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
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
}
