//! Devices that come, go and change size while a server runs: `blk-add`, `blk-del` and
//! `blk-resize` on the control socket, and the start of every device served.
//!
//! **Model.** A [`Runtime`] owns the serving threads of one server process: each device is
//! served by its own thread, which runs its back end on its socket until the device's own stop
//! flag is set (by `blk-del`, or by [`Runtime::finish`] when the process stops). The devices
//! themselves — what the control socket reports — are in the [`Registry`]; the runtime adds a
//! device there when its thread starts and takes it out when its thread has ended. A device
//! added at run time goes through exactly the start a device named on the command line goes
//! through: the options parser ([`Options::from_json`], [`BlkSpec::from_options`]), the image's
//! open, locks and format check ([`open_disk`], [`claim_image`]), a socket from
//! [`crate::listener`] (a live socket is never taken over), and an id and a socket no other
//! device of the process has.
//!
//! **Deleting releases everything.** `blk-del` is refused while a frontend is connected, unless
//! forced; forced, the back end's serving loop sees the stop and ends the connection as if the
//! frontend had left: the rings stop, the transfers out end, the frontend's memory is unmapped
//! and its pins released, the connection closed. Then the thread removes the socket path, drops
//! the back end and with it the image's descriptors (its locks go with the last one); the
//! command answers once all that is done, so another process may open the image at once.
//!
//! **Resizing** changes the device's capacity cell ([`memvisor_vhost::BlkCapacity`]) and waits (at most
//! [`TOLD_WAIT`]) for the back end's serving loop to take the change and send
//! `CONFIG_CHANGE_MSG` to a frontend that negotiated it; the `DEVICE_RESIZED` event says whether
//! it did (`told-frontend`).
//!
//! Events: `DEVICE_ADDED {"id", "type", "socket"}`, `DEVICE_DELETED {"id"}`,
//! `DEVICE_RESIZED {"id", "size", "told-frontend"}`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;
use memvisor_vhost::image_format::FormatChoice;
use memvisor_vhost::{
    Backend, BalloonDevice, BalloonTarget, Blk, BlkOptions, Device as _, ProcessState,
};
use serde_json::{Value, json};

use crate::control::{CommandError, Handler, unknown_command};
use crate::devices::{BalloonSpec, BlkSpec, Options};
use crate::listener::{self, Listener, SocketSpec};
use crate::serve::{claim_image, open_disk};
use crate::status::{Device, Kind, Registry, connection_events};

/// How long `blk-resize` waits for the back end to take the change (its serving loop looks at
/// least every 200 ms, between messages).
pub const TOLD_WAIT: Duration = Duration::from_secs(2);

/// A device's serving thread and the flag that stops it.
struct Served {
    id: String,
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<()>>,
}

/// The serving threads of one server process, and the run-time commands on its devices.
pub struct Runtime {
    /// The devices served, as the control socket reports them.
    pub registry: Arc<Registry>,
    state: ProcessState,
    iommu: bool,
    served: Mutex<Vec<Served>>,
    /// Paths no device may take (the control socket's).
    reserved: Vec<PathBuf>,
    /// `blk-add` and `blk-del` are taken (`memvisor serve`); the single-device server takes
    /// only `blk-resize`.
    hotplug: bool,
    /// One `blk-add` at a time: its checks and its start are one step.
    adding: Mutex<()>,
}

/// `path` made absolute, for comparing sockets.
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

impl Runtime {
    /// No device served yet; they pin through `state`, blk devices offer
    /// `VIRTIO_F_IOMMU_PLATFORM` if `iommu`. With `hotplug`, devices may be added and deleted
    /// while the server runs; `reserved` are socket paths no device may take.
    pub fn new(
        registry: Arc<Registry>,
        state: &ProcessState,
        iommu: bool,
        hotplug: bool,
        reserved: Vec<PathBuf>,
    ) -> Runtime {
        Runtime {
            registry,
            state: state.clone(),
            iommu,
            served: Mutex::new(Vec::new()),
            reserved: reserved.iter().map(|p| absolute(p)).collect(),
            hotplug,
            adding: Mutex::new(()),
        }
    }

    fn served(&self) -> std::sync::MutexGuard<'_, Vec<Served>> {
        self.served.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts serving blk device `id` over `file` (opened and claimed) on `listener`;
    /// `setup` may add to its back end before it serves. Its serial is its id when none was
    /// given.
    pub fn start_blk(
        &self,
        id: String,
        mut spec: BlkSpec,
        file: std::fs::File,
        listener: Listener,
        setup: impl FnOnce(&mut Backend<Blk>) -> Result<()>,
    ) -> Result<()> {
        if spec.options.serial.is_empty() {
            spec.options.serial = crate::devices::default_serial(&id);
        }
        let options = BlkOptions {
            iommu: self.iommu,
            guard_first_sector: spec.format == FormatChoice::Probe,
            ..spec.options.clone()
        };
        let device = Blk::new(file, options)?;
        let live = device.live();
        let capacity = device.capacity();
        let mut backend = Backend::new(device, &self.state)?;
        setup(&mut backend)?;
        let events = self.registry.events.clone();
        backend.on_connection(connection_events(&events, &id, &listener.name()));
        log::info!(
            "vhost-user-blk {id}: serving {} ({} bytes) on {}",
            spec.disk.display(),
            capacity.bytes(),
            listener.origin
        );
        let device = Device {
            id: id.clone(),
            socket: listener.name(),
            backend: backend.live(),
            kind: Kind::Blk {
                spec,
                iommu: self.iommu,
                live,
                capacity,
            },
        };
        self.spawn(id, device, backend, listener)
    }

    /// Starts serving balloon `id` on `listener`.
    pub fn start_balloon(&self, id: String, spec: &BalloonSpec, listener: Listener) -> Result<()> {
        let target = BalloonTarget::default();
        target.set_pages(spec.target_mib * 256);
        let mut device = BalloonDevice::new(target.clone())
            .with_stats_interval(Duration::from_secs(spec.stats_interval_secs.into()))
            .with_deflate_on_oom(spec.deflate_on_oom);
        if !spec.reporting {
            device = device.without_reporting();
        }
        let live = device.live();
        let queues = device.queues();
        let mut backend = Backend::new(device, &self.state)?;
        let events = self.registry.events.clone();
        backend.on_connection(connection_events(&events, &id, &listener.name()));
        log::info!(
            "vhost-user-balloon {id}: serving on {} ({queues} rings)",
            listener.origin
        );
        let device = Device {
            id: id.clone(),
            socket: listener.name(),
            backend: backend.live(),
            kind: Kind::Balloon {
                spec: spec.clone(),
                live,
                target,
            },
        };
        self.spawn(id, device, backend, listener)
    }

    /// Lists `device` and starts its thread.
    fn spawn<D: memvisor_vhost::Device + Send + 'static>(
        &self,
        id: String,
        device: Device,
        mut backend: Backend<D>,
        listener: Listener,
    ) -> Result<()> {
        self.registry
            .add(device)
            .map_err(|e| anyhow::anyhow!("{}", e.desc))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("device {id}"))
            .spawn(move || -> Result<()> {
                let served = backend.serve(&listener.socket, &flag);
                listener.remove();
                // The device and its image's descriptors go here, before the thread ends.
                drop(backend);
                Ok(served?)
            });
        match thread {
            Ok(thread) => {
                self.served().push(Served { id, stop, thread });
                Ok(())
            }
            Err(e) => {
                self.registry.remove(&id);
                Err(anyhow::anyhow!(
                    "cannot start a thread for device {id}: {e}"
                ))
            }
        }
    }

    /// Whether every device's thread has ended (each on an error: only a stop ends them
    /// otherwise).
    pub fn all_finished(&self) -> bool {
        self.served().iter().all(|s| s.thread.is_finished())
    }

    /// Stops every device and waits for its thread; the first error any of them ended with.
    pub fn finish(&self) -> Result<()> {
        let served = std::mem::take(&mut *self.served());
        for s in &served {
            s.stop.store(true, Ordering::Relaxed);
        }
        let mut first = Ok(());
        for s in served {
            let r = s
                .thread
                .join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("device {}'s thread panicked", s.id)));
            if let Err(e) = r {
                log::error!("device {}: {e:#}", s.id);
                if first.is_ok() {
                    first = Err(e);
                }
            }
        }
        first
    }

    /// `blk-add`: the `--blk` options as an object; serves the device at once.
    pub fn blk_add(&self, args: &Value) -> Result<Value, CommandError> {
        let _one = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        let generic = |e: anyhow::Error| CommandError::generic(format!("blk-add: {e:#}"));
        let options = Options::from_json("blk-add".into(), args).map_err(generic)?;
        let spec = BlkSpec::from_options(options).map_err(generic)?;
        let id = match &spec.id {
            Some(id) => id.clone(),
            None => self.free_id("blk"),
        };
        let (other_ids, other_paths) = self.check_new(&id, &spec.socket)?;
        let file = open_disk(&spec.disk, spec.options.read_only, spec.direct).map_err(generic)?;
        claim_image(&file, &spec).map_err(generic)?;
        // The one way a device's socket is opened, at start or now: by path, by an inherited
        // fd, or a socket systemd passed named after the device (`listener::open_device`).
        let listener =
            listener::open_device(&spec.socket, &id, &other_ids, &other_paths).map_err(generic)?;
        let socket = listener.name();
        self.start_blk(id.clone(), spec, file, listener, |_| Ok(()))
            .map_err(generic)?;
        self.registry.events.emit(
            "DEVICE_ADDED",
            json!({"id": id, "type": "vhost-user-blk", "socket": socket}),
        );
        Ok(json!({}))
    }

    /// The first `blkN` no device has.
    fn free_id(&self, prefix: &str) -> String {
        let devices = self.registry.lock();
        (0..)
            .map(|n| format!("{prefix}{n}"))
            .find(|id| devices.iter().all(|d| &d.id != id))
            .expect("a free number")
    }

    /// Refuses an id or a socket path a device or the control socket has; returns the other
    /// devices' ids and socket paths (a socket systemd passed that is bound to one of those, or
    /// named after one, is not this device's).
    fn check_new(
        &self,
        id: &str,
        socket: &SocketSpec,
    ) -> Result<(Vec<String>, Vec<PathBuf>), CommandError> {
        let devices = self.registry.lock();
        if id.is_empty() || devices.iter().any(|d| d.id == id) {
            return Err(CommandError::generic(format!(
                "blk-add: device id {id:?} is empty or taken: every device needs its own"
            )));
        }
        if let SocketSpec::Path(path) = socket {
            let want = absolute(path);
            let taken = devices
                .iter()
                .any(|d| absolute(Path::new(&d.socket)) == want);
            if taken || self.reserved.contains(&want) {
                return Err(CommandError::generic(format!(
                    "blk-add: socket {} is taken by another device or the control socket",
                    path.display()
                )));
            }
        }
        let ids = devices.iter().map(|d| d.id.clone()).collect();
        let paths = devices
            .iter()
            .map(|d| PathBuf::from(&d.socket))
            .chain(self.reserved.iter().cloned())
            .collect();
        Ok((ids, paths))
    }

    /// `blk-del {"id", "force"}`: stops the device and releases everything it had.
    pub fn blk_del(&self, args: &Value) -> Result<Value, CommandError> {
        // Not while a blk-add is between listing its device and starting its thread: the
        // delete would find the device and no thread to stop, which would go on serving.
        let _one = self.adding.lock().unwrap_or_else(|e| e.into_inner());
        let id = string_arg(args, "blk-del", "id")?;
        let force = match args.get("force") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(CommandError::generic(format!(
                    "blk-del: \"force\" is {other}; true or false"
                )));
            }
        };
        let device = {
            let devices = self.registry.lock();
            let d = Registry::find(&devices, id)?;
            if !matches!(d.kind, Kind::Blk { .. }) {
                return Err(CommandError::generic(format!(
                    "blk-del: device {id:?} is not a blk device"
                )));
            }
            if d.backend.connected() && !force {
                return Err(CommandError::generic(format!(
                    "blk-del: device {id:?} has a frontend connected on {}; stop it first, or \
                     give \"force\": true to disconnect it",
                    d.socket
                )));
            }
            drop(devices);
            self.registry.remove(id)
        };
        let Some(device) = device else {
            return Err(CommandError::no_device(format!(
                "blk-del: device {id:?} was deleted meanwhile"
            )));
        };
        let served = {
            let mut all = self.served();
            all.iter().position(|s| s.id == id).map(|i| all.remove(i))
        };
        if let Some(s) = served {
            s.stop.store(true, Ordering::Relaxed);
            match s.thread.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => log::warn!("device {id}: it had ended: {e:#}"),
                Err(_) => log::error!("device {id}: its thread panicked"),
            }
        }
        // Its last descriptor of the image (the capacity's) goes here: the locks are free.
        drop(device);
        log::info!("control: device {id} deleted");
        self.registry
            .events
            .emit("DEVICE_DELETED", json!({"id": id}));
        Ok(json!({}))
    }

    /// `blk-resize {"id", "size"?}`: a new size for a file image, or the image's size read
    /// again; the frontend is told if it can hear it.
    pub fn blk_resize(&self, args: &Value) -> Result<Value, CommandError> {
        let id = string_arg(args, "blk-resize", "id")?;
        let size = match args.get("size") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                CommandError::generic(format!(
                    "blk-resize: \"size\" is {v}; a whole number of bytes"
                ))
            })?),
        };
        let (capacity, backend) = {
            let devices = self.registry.lock();
            let d = Registry::find(&devices, id)?;
            match &d.kind {
                Kind::Blk { capacity, .. } => (capacity.clone(), d.backend.clone()),
                Kind::Balloon { .. } => {
                    return Err(CommandError::generic(format!(
                        "blk-resize: device {id:?} is not a blk device"
                    )));
                }
            }
        };
        let taken = capacity.changes_taken();
        let r = capacity.resize(size).map_err(|e| {
            // The checks name the size; a failure of the host's call says only what it did.
            let to = match (&e, size) {
                (memvisor_vhost::Error::Os { .. }, Some(s)) => format!(" to {s} bytes"),
                _ => String::new(),
            };
            CommandError::generic(format!("blk-resize {id}{to}: {e}"))
        })?;
        let since = Instant::now();
        let mut took = false;
        while backend.connected() && since.elapsed() < TOLD_WAIT {
            if capacity.changes_taken() > taken {
                took = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let told = took && backend.hears_config_changes();
        log::info!(
            "control: device {id} resized from {} to {} bytes; frontend told: {told}",
            r.before,
            r.size
        );
        self.registry.events.emit(
            "DEVICE_RESIZED",
            json!({"id": id, "size": r.size, "told-frontend": told}),
        );
        Ok(json!({}))
    }
}

/// The string argument `name` of `command`.
fn string_arg<'a>(args: &'a Value, command: &str, name: &str) -> Result<&'a str, CommandError> {
    match args.get(name) {
        Some(Value::String(s)) => Ok(s),
        None => Err(CommandError::generic(format!(
            "{command} needs \"{name}\": the device's id"
        ))),
        Some(other) => Err(CommandError::generic(format!(
            "{command}: \"{name}\" is {other}; a device id string"
        ))),
    }
}

impl Handler for Runtime {
    fn commands(&self) -> Vec<&'static str> {
        let mut c = self.registry.commands();
        if self.hotplug {
            c.extend(["blk-add", "blk-del"]);
        }
        c.push("blk-resize");
        c
    }

    fn arguments(&self, command: &str) -> Option<&'static [&'static str]> {
        match command {
            "blk-del" => Some(&["id", "force"]),
            "blk-resize" => Some(&["id", "size"]),
            // blk-add checks its own (the --blk options).
            "blk-add" => None,
            other => self.registry.arguments(other),
        }
    }

    fn execute(&self, command: &str, args: &Value) -> Result<Value, CommandError> {
        match command {
            "blk-add" if self.hotplug => self.blk_add(args),
            "blk-del" if self.hotplug => self.blk_del(args),
            "blk-resize" => self.blk_resize(args),
            "blk-add" | "blk-del" => Err(CommandError::generic(format!(
                "{command}: this server serves one device; run `memvisor serve --control PATH` \
                 to add and delete devices while it runs"
            ))),
            other if self.registry.commands().contains(&other) => {
                self.registry.execute(other, args)
            }
            other => Err(unknown_command(other, &self.commands())),
        }
    }
}
