//! The vfio-user server's figures and its control socket (`memvisor vfio-user --control PATH`).
//!
//! **Model.** `memvisor vfio-user` serves one client at a time, one after another
//! ([`crate::serve::vfio_user`]). [`VfioStatus`] is what it knows, shared between the serving
//! loop and the control socket: the report so far ([`VfioUserReport`]: the process's figures
//! before the first client, and per finished connection its counters and the figures after its
//! cleanup), and the connection being served now, through its [`Port`], whose DMA table and
//! device pins are read live. The serving loop calls [`VfioStatus::connected`] and
//! [`VfioStatus::disconnected`]; they keep the report and send `FRONTEND_CONNECTED` /
//! `FRONTEND_DISCONNECTED` (`{"device": "mvdma0", "socket", "connection": N}`), the second only
//! once everything the client had is released. The control socket ([`crate::control`]) runs
//! `query-devices` and `query-stats` here, in the shapes the vhost-user servers use
//! (`crate::status`); SIGUSR1 writes [`VfioStatus::report`].
//!
//! The counters a connection's server keeps for itself (requests, maps, errors) are its own
//! until it ends; what is live here is what the port shows while it runs: mappings, pages the
//! device pins and pages its requests hold, and the process's locks and `/proc` figures.

use std::sync::{Arc, Mutex, MutexGuard};

use memvisor::dma::PinRegistry;
use memvisor_vfio_user::Port;
use serde::Serialize;
use serde_json::{Value, json};

use crate::control::{CommandError, Events, Handler, unknown_command};
use crate::status::PinReport;

/// The one device a vfio-user server serves, as the control socket names it.
pub const DEVICE_ID: &str = "mvdma0";
/// Its type, for `query-devices`.
pub const DEVICE_TYPE: &str = "vfio-user-mvdma";

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
#[derive(Serialize, Clone)]
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

/// The connection being served.
struct Current {
    /// Its number, from 1.
    number: usize,
    port: Arc<Port>,
}

/// What a vfio-user server knows, for its control socket and SIGUSR1.
pub struct VfioStatus {
    /// Where the events go.
    pub events: Events,
    registry: Arc<PinRegistry>,
    report: Mutex<VfioUserReport>,
    current: Mutex<Option<Current>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl VfioStatus {
    /// A server on `socket` (its name) that has not served anyone yet; the process was as
    /// `baseline` before; its devices pin through `registry`.
    pub fn new(socket: String, baseline: ProcFigures, registry: Arc<PinRegistry>) -> VfioStatus {
        VfioStatus {
            events: Events::default(),
            registry,
            report: Mutex::new(VfioUserReport {
                socket,
                end: "no client connected".into(),
                baseline,
                connections: Vec::new(),
                server: Default::default(),
            }),
            current: Mutex::new(None),
        }
    }

    fn event_data(&self, number: usize) -> Value {
        json!({"device": DEVICE_ID, "socket": lock(&self.report).socket, "connection": number})
    }

    /// A client connected, served through `port`; returns its number (from 1).
    pub fn connected(&self, port: Arc<Port>) -> usize {
        let number = lock(&self.report).connections.len() + 1;
        *lock(&self.current) = Some(Current { number, port });
        self.events
            .emit("FRONTEND_CONNECTED", self.event_data(number));
        number
    }

    /// The client is gone and everything it had released: `connection` is how it ended,
    /// `server` its server's counters.
    pub fn disconnected(
        &self,
        connection: VfioUserConnection,
        server: memvisor_vfio_user::ServerStats,
    ) {
        let number = {
            let mut r = lock(&self.report);
            r.end = connection.end.clone();
            r.connections.push(connection);
            r.server = server;
            r.connections.len()
        };
        *lock(&self.current) = None;
        self.events
            .emit("FRONTEND_DISCONNECTED", self.event_data(number));
    }

    /// The report as it stands (what SIGUSR1 writes, and `--stats` at exit).
    pub fn report(&self) -> VfioUserReport {
        lock(&self.report).clone()
    }

    fn info(&self) -> Value {
        let r = lock(&self.report);
        json!({
            "id": DEVICE_ID,
            "type": DEVICE_TYPE,
            "socket": r.socket,
            "connected": lock(&self.current).is_some(),
            "connections": r.connections.len(),
        })
    }

    /// The device's figures now: the connection being served (live, from its port) and the
    /// report so far.
    fn stats(&self) -> Value {
        let mut v = self.info();
        v["now"] = match &*lock(&self.current) {
            Some(c) => {
                let dma = c.port.dma();
                json!({
                    "connection": c.number,
                    "mappings": dma.len(),
                    "device_pinned_pages": dma.device_pinned_pages(),
                    "guard_held_pages": dma.guard_held_pages(),
                })
            }
            None => Value::Null,
        };
        v["report"] = json!(self.report());
        v
    }

    /// Checks a command's `device` argument: absent, or this server's one device.
    fn check_device(args: &Value) -> Result<(), CommandError> {
        match args.get("device") {
            None => Ok(()),
            Some(Value::String(id)) if id == DEVICE_ID => Ok(()),
            Some(Value::String(id)) => Err(CommandError::no_device(format!(
                "no device {id:?}: this vfio-user server has one, {DEVICE_ID:?}"
            ))),
            Some(other) => Err(CommandError::generic(format!(
                "\"device\" is {other}; it must be a device id string"
            ))),
        }
    }
}

impl Handler for VfioStatus {
    fn commands(&self) -> Vec<&'static str> {
        vec!["query-devices", "query-stats"]
    }

    fn arguments(&self, command: &str) -> Option<&'static [&'static str]> {
        matches!(command, "query-devices" | "query-stats").then_some(&["device"][..])
    }

    fn execute(&self, command: &str, args: &Value) -> Result<Value, CommandError> {
        match command {
            "query-devices" => {
                Self::check_device(args)?;
                Ok(json!([self.info()]))
            }
            "query-stats" => {
                Self::check_device(args)?;
                Ok(json!({
                    "devices": [self.stats()],
                    "process": {
                        "pins": PinReport::now(&self.registry),
                        "figures": ProcFigures::now(),
                    },
                }))
            }
            other => Err(unknown_command(other, &crate::control::commands(self))),
        }
    }
}
