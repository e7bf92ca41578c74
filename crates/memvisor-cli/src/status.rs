//! What a running server says about itself: its devices, their live counters and the process's
//! pins — as answers on the control socket ([`crate::control`]: `query-devices`, `query-stats`,
//! `balloon-set-target`) and as the `--stats` report, written at exit and on SIGUSR1.
//!
//! **Model.** Every served device is a [`Device`] in the server's [`Registry`]: its id, socket
//! and options, and handles on the counters its threads keep ([`memvisor_vhost::live`]):
//! the back end's ([`BackendLive`]) and the device's own ([`BlkLive`], [`BalloonLive`]). Reading
//! them never stops or slows a device; every answer and every report is built from them, so the
//! control socket, SIGUSR1 and the report at exit say the same thing under the same names.
//! Devices come and go while the server runs (`blk-add`, `blk-del`: [`crate::runtime`]): the
//! list is behind a lock, taken only to look a device up or to add or remove one.

use std::sync::{Arc, Mutex};

use memvisor::dma::PinRegistry;
use memvisor_vhost::{
    BackendLive, BackendStats, BalloonLive, BalloonStatus, BalloonTarget, BlkCapacity, BlkLive,
    BlkStats, ThrottleConfig,
};
use serde::Serialize;
use serde_json::{Value, json};

use crate::control::{CommandError, Events, Handler, unknown_command};
use crate::devices::{BalloonSpec, BlkSpec};

/// A served device.
pub struct Device {
    /// The name commands use (`blk0`, `balloon0`, or the spec's `id`).
    pub id: String,
    /// Its socket, as shown.
    pub socket: String,
    /// The back end's counters.
    pub backend: BackendLive,
    /// What kind of device, with its own options and counters.
    pub kind: Kind,
}

/// A device's kind, options and own counters.
pub enum Kind {
    /// virtio-blk.
    Blk {
        spec: BlkSpec,
        iommu: bool,
        live: BlkLive,
        /// Its capacity, which `blk-resize` changes.
        capacity: BlkCapacity,
    },
    /// virtio-balloon.
    Balloon {
        spec: BalloonSpec,
        live: BalloonLive,
        target: BalloonTarget,
    },
}

impl Device {
    fn type_name(&self) -> &'static str {
        match self.kind {
            Kind::Blk { .. } => "vhost-user-blk",
            Kind::Balloon { .. } => "vhost-user-balloon",
        }
    }

    /// Its `query-devices` entry: what it is and how it was set up.
    pub fn info(&self) -> Value {
        let mut v = json!({
            "id": self.id,
            "type": self.type_name(),
            "socket": self.socket,
            "connected": self.backend.connected(),
        });
        match &self.kind {
            Kind::Blk {
                spec,
                iommu,
                capacity,
                ..
            } => {
                let o = &spec.options;
                v["disk"] = json!(spec.disk.display().to_string());
                v["size"] = json!(capacity.bytes());
                v["queues"] = json!(o.queues);
                v["read-only"] = json!(o.read_only);
                v["serial"] = json!(o.serial);
                v["direct"] = json!(spec.direct);
                v["poll-us"] = json!(o.poll_us);
                v["fixed-buffers"] = json!(o.fixed_buffers);
                v["iommu"] = json!(iommu);
                v["locking"] = json!(spec.locking.to_string());
                if spec.format == memvisor_vhost::image_format::FormatChoice::Raw {
                    v["format"] = json!("raw");
                }
            }
            Kind::Balloon { spec, .. } => {
                v["reporting"] = json!(spec.reporting);
                v["stats-interval"] = json!(spec.stats_interval_secs);
                v["deflate-on-oom"] = json!(spec.deflate_on_oom);
            }
        }
        v
    }

    /// Its `query-stats` entry: the back end's totals, the device's own counts, and one row
    /// per queue.
    pub fn stats(&self) -> Value {
        let mut v = json!({
            "id": self.id,
            "type": self.type_name(),
            "connected": self.backend.connected(),
            "backend": self.backend.stats(),
        });
        let mut queues: Vec<Value> = self
            .backend
            .queues()
            .into_iter()
            .map(|q| json!(q))
            .collect();
        match &self.kind {
            Kind::Blk { live, .. } => {
                v["blk"] = json!(live.total());
                for (row, blk) in queues.iter_mut().zip(live.queues()) {
                    row["blk"] = json!(blk);
                }
                v["latency"] = json!(live.latency());
                v["throttle"] = json!(live.throttle().config());
            }
            Kind::Balloon { live, .. } => v["balloon"] = json!(live.status()),
        }
        v["queues"] = Value::Array(queues);
        v
    }
}

/// The devices one server process serves, where its events go, and the pin registry they pin
/// through (the process's, handed in by the server).
pub struct Registry {
    pub devices: Mutex<Vec<Device>>,
    pub events: Events,
    pub pins: Arc<PinRegistry>,
}

impl Registry {
    /// No devices yet; their pins are held in `pins`.
    pub fn new(pins: Arc<PinRegistry>) -> Registry {
        Registry {
            devices: Mutex::new(Vec::new()),
            events: Events::default(),
            pins,
        }
    }

    /// The device list, locked.
    pub fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Device>> {
        self.devices.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds `device`, unless its id or its socket is taken (by a device served now).
    pub fn add(&self, device: Device) -> Result<(), CommandError> {
        let mut devices = self.lock();
        if device.id.is_empty() || devices.iter().any(|d| d.id == device.id) {
            return Err(CommandError::generic(format!(
                "device id {:?} is empty or taken: every device needs its own",
                device.id
            )));
        }
        if devices.iter().any(|d| d.socket == device.socket) {
            return Err(CommandError::generic(format!(
                "socket {} is served by another device already",
                device.socket
            )));
        }
        devices.push(device);
        Ok(())
    }

    /// Takes the device `id` out of the list, if there is one.
    pub fn remove(&self, id: &str) -> Option<Device> {
        let mut devices = self.lock();
        let i = devices.iter().position(|d| d.id == id)?;
        Some(devices.remove(i))
    }

    /// The device `id` in `devices`, or an error naming the ids there are.
    pub fn find<'a>(devices: &'a [Device], id: &str) -> Result<&'a Device, CommandError> {
        devices.iter().find(|d| d.id == id).ok_or_else(|| {
            let ids: Vec<&str> = devices.iter().map(|d| d.id.as_str()).collect();
            CommandError::no_device(format!(
                "no device {id:?}; the devices are: {}",
                ids.join(", ")
            ))
        })
    }

    /// The optional `device` argument: that device, or every one.
    fn selected<'a>(devices: &'a [Device], args: &Value) -> Result<Vec<&'a Device>, CommandError> {
        match args.get("device") {
            None => Ok(devices.iter().collect()),
            Some(Value::String(id)) => Ok(vec![Self::find(devices, id)?]),
            Some(other) => Err(CommandError::generic(format!(
                "\"device\" is {other}; it must be a device id string"
            ))),
        }
    }

    /// `query-stats`: every device's (or one's) counters, and the process's pins.
    pub fn query_stats(&self, args: &Value) -> Result<Value, CommandError> {
        let devices: Vec<Value> = Self::selected(&self.lock(), args)?
            .iter()
            .map(|d| d.stats())
            .collect();
        Ok(json!({
            "devices": devices,
            "process": {"pins": PinReport::now(&self.pins)},
        }))
    }

    /// `balloon-set-target`: `target-mib` for one balloon (`device`) or every one.
    fn set_target(&self, args: &Value) -> Result<Value, CommandError> {
        let mib = match args.get("target-mib") {
            Some(Value::Number(n)) => n.as_u64(),
            Some(_) => None,
            None => {
                return Err(CommandError::generic(
                    "balloon-set-target needs \"target-mib\": the MiB the guest should give up",
                ));
            }
        };
        let pages = mib
            .filter(|m| *m <= u64::from(u32::MAX / 256))
            .map(|m| m as u32 * 256)
            .ok_or_else(|| {
                CommandError::generic(format!(
                    "\"target-mib\" is {}; a whole number of MiB, 0 to {}",
                    args["target-mib"],
                    u32::MAX / 256
                ))
            })?;
        let devices = self.lock();
        let balloons: Vec<(&Device, &BalloonTarget)> = Self::selected(&devices, args)?
            .into_iter()
            .filter_map(|d| match &d.kind {
                Kind::Balloon { target, .. } => Some((d, target)),
                Kind::Blk { .. } => None,
            })
            .collect();
        if balloons.is_empty() {
            return Err(match args.get("device") {
                Some(id) => CommandError::generic(format!("device {id} is not a balloon")),
                None => CommandError::no_device("this server has no balloon"),
            });
        }
        for (d, target) in &balloons {
            target.set_pages(pages);
            log::info!(
                "control: balloon {} target {pages} pages ({} MiB)",
                d.id,
                pages / 256
            );
        }
        let ids: Vec<&str> = balloons.iter().map(|(d, _)| d.id.as_str()).collect();
        Ok(json!({"devices": ids, "target_pages": pages}))
    }

    /// `blk-set-throttle`: `id` and QEMU's `block_set_io_throttle` limits (absent or 0: no
    /// limit; all zero lifts the throttle), checked as QEMU checks them
    /// ([`memvisor_vhost::blk::throttle`](memvisor_vhost::ThrottleConfig)).
    fn set_throttle(&self, args: &Value) -> Result<Value, CommandError> {
        // QEMU's block_set_io_throttle names the device by `id` or, in older scripts, `device`.
        let id = match args.get("id").or_else(|| args.get("device")) {
            Some(Value::String(id)) => id.as_str(),
            None => {
                return Err(CommandError::generic(
                    "blk-set-throttle needs \"id\" (or \"device\"): the id of a blk device",
                ));
            }
            Some(other) => {
                return Err(CommandError::generic(format!(
                    "blk-set-throttle: \"id\" is {other}; the id of a blk device, a string"
                )));
            }
        };
        let devices = self.lock();
        let d = Self::find(&devices, id)?;
        let Kind::Blk { live, .. } = &d.kind else {
            return Err(CommandError::generic(format!(
                "device {id:?} is not a blk device"
            )));
        };
        let mut limits = args.as_object().cloned().unwrap_or_default();
        limits.remove("id");
        limits.remove("device");
        if let Some(group) = limits.get("group") {
            return Err(CommandError::generic(format!(
                "blk-set-throttle {id}: \"group\" is {group}: throttle groups are not \
                 supported, each disk has a throttle of its own; leave \"group\" out"
            )));
        }
        // Every limit is a whole number; serde's own error would not name the argument (an
        // unknown one is left to serde, which names it).
        let known = json!(ThrottleConfig::default());
        if let Some((k, v)) = limits
            .iter()
            .find(|(k, v)| known.get(k.as_str()).is_some() && !v.is_u64())
        {
            return Err(CommandError::generic(format!(
                "blk-set-throttle {id}: \"{k}\" is {v}; a whole number from 0 (0: no limit)"
            )));
        }
        let config: ThrottleConfig = serde_json::from_value(Value::Object(limits))
            .map_err(|e| CommandError::generic(format!("blk-set-throttle {id}: {e}")))?;
        live.throttle()
            .set(config.clone())
            .map_err(|e| CommandError::generic(format!("blk-set-throttle {id}: {e}")))?;
        log::info!("control: blk {id} throttle {}", json!(config));
        Ok(json!({}))
    }

    /// The `--stats` report of a `serve` process, now.
    pub fn report(&self) -> ServeReport {
        let mut r = ServeReport::default();
        for d in self.lock().iter() {
            match &d.kind {
                Kind::Blk { live, .. } => r.blk.push(BlkReport {
                    socket: d.socket.clone(),
                    backend: d.backend.stats(),
                    blk: live.total(),
                }),
                Kind::Balloon { live, .. } => r.balloon.push(BalloonReport {
                    socket: d.socket.clone(),
                    backend: d.backend.stats(),
                    status: live.status(),
                }),
            }
        }
        r.pins = PinReport::now(&self.pins);
        r
    }
}

impl Handler for Registry {
    fn commands(&self) -> Vec<&'static str> {
        // The protocol's own (qmp_capabilities, query-commands, quit) are control.rs's.
        vec![
            "query-devices",
            "query-stats",
            "balloon-set-target",
            "blk-set-throttle",
        ]
    }

    fn arguments(&self, command: &str) -> Option<&'static [&'static str]> {
        match command {
            "query-devices" | "query-stats" => Some(&["device"]),
            "balloon-set-target" => Some(&["device", "target-mib"]),
            // blk-set-throttle checks its own (QEMU's limits).
            _ => None,
        }
    }

    fn execute(&self, command: &str, args: &Value) -> Result<Value, CommandError> {
        match command {
            "query-devices" => Ok(json!(
                Self::selected(&self.lock(), args)?
                    .iter()
                    .map(|d| d.info())
                    .collect::<Vec<_>>()
            )),
            "query-stats" => self.query_stats(args),
            "balloon-set-target" => self.set_target(args),
            "blk-set-throttle" => self.set_throttle(args),
            other => Err(unknown_command(other, &self.commands())),
        }
    }
}

/// The callback that turns a back end's connections into events: `FRONTEND_CONNECTED` and,
/// once everything the frontend had is released, `FRONTEND_DISCONNECTED`.
pub fn connection_events(events: &Events, id: &str, socket: &str) -> Box<dyn FnMut(bool) + Send> {
    let data = json!({"device": id, "socket": socket});
    let events = events.clone();
    Box::new(move |connected| {
        let name = if connected {
            "FRONTEND_CONNECTED"
        } else {
            "FRONTEND_DISCONNECTED"
        };
        events.emit(name, data.clone());
    })
}

/// What a block back end did, for `--stats`: the protocol's counts and the device's, flat.
#[derive(Serialize)]
pub struct BlkReport {
    /// Socket served.
    pub socket: String,
    /// Connections, messages, IOTLB, dirty log ([`BackendStats`]).
    #[serde(flatten)]
    pub backend: BackendStats,
    /// Requests, bytes, failures, batches, the pinned-page histogram ([`BlkStats`]).
    #[serde(flatten)]
    pub blk: BlkStats,
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

impl BlkServeReport {
    /// The report of the one device in `registry`, now.
    pub fn now(registry: &Registry, at_disconnect: &Mutex<Vec<PinCheck>>) -> Option<Self> {
        let device = registry.report().blk.into_iter().next()?;
        Some(BlkServeReport {
            pins: PinReport::now(&registry.pins),
            pins_at_disconnect: at_disconnect
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            pin_cost: PinCostReport::of(&device.blk),
            device,
        })
    }
}

/// What a balloon back end did, for `--stats`: the protocol's counts and the balloon's status
/// (target, actual, statistics, what the model counted), flat.
#[derive(Serialize)]
pub struct BalloonReport {
    /// Socket served.
    pub socket: String,
    /// Connections, messages, refusals ([`BackendStats`]).
    #[serde(flatten)]
    pub backend: BackendStats,
    /// The balloon now ([`BalloonStatus`]; `actual_pages` is 0 once a frontend left: the
    /// device was reset).
    #[serde(flatten)]
    pub status: BalloonStatus,
}

/// Everything one `memvisor serve` process did.
#[derive(Serialize, Default)]
pub struct ServeReport {
    /// Block devices.
    pub blk: Vec<BlkReport>,
    /// Balloons.
    pub balloon: Vec<BalloonReport>,
    /// The process's pin registry now.
    pub pins: PinReport,
}

/// The blk device's hold cost ([`BlkStats::holds`], `hold_ns`, `release_ns`), for `--stats`:
/// requests whose buffers were walked and held, and the wall time spent holding them and
/// letting them go, under the names the benchmark reads.
#[derive(Serialize, Default, Clone, Copy, Debug)]
pub struct PinCostReport {
    pub pins: u64,
    pub pin_ns: u64,
    pub unpins: u64,
    pub unpin_ns: u64,
}

impl PinCostReport {
    /// The device's counters.
    pub fn of(s: &BlkStats) -> PinCostReport {
        PinCostReport {
            pins: s.holds,
            pin_ns: s.hold_ns,
            unpins: s.holds,
            unpin_ns: s.release_ns,
        }
    }
}

/// What the process's pin registry (the one the server hands its devices) says, for `--stats`.
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
/// holds (held = charged + cached: the lock cache keeps recently unpinned pages locked) and
/// what `/proc/self/status` says at the same moment.
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
    /// `registry` and the kernel now.
    pub fn now(registry: &PinRegistry) -> PinCheck {
        let k = registry.kernel_check();
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
    /// `registry` now.
    pub fn now(registry: &PinRegistry) -> PinReport {
        let counts = registry.long_term_counts();
        PinReport {
            long_term: registry.long_term_pins(),
            long_term_pins: counts.pinned,
            long_term_fallbacks: counts.fallbacks,
            locked_bytes: registry.locked_bytes(),
            long_term_bytes: registry.long_term_bytes(),
            check: PinCheck::now(registry),
        }
    }
}

/// A shared list of [`PinCheck`]s taken at each disconnect.
pub type PinChecks = Arc<Mutex<Vec<PinCheck>>>;
