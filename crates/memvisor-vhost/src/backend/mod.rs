//! The back end of one vhost-user socket: the protocol state machine, the vrings, and the loop
//! that serves one frontend after another.
//!
//! **Model.** A [`Device`] knows its virtio features, config space and how to process a queue;
//! everything else is here. One thread serves one socket: it `poll`s the connection and the
//! kick descriptors of started rings, handles each message in order and processes a queue when
//! its kick fires, so device code never races the protocol (a memory table never changes while
//! a request is being processed, and pins taken for a request are released before the next
//! message is read). Several sockets are several threads, sharing memvisor's process-wide
//! state: one mapping per range of guest memory, one pin registry.
//!
//! **Rings.** A ring is configured by `SET_VRING_NUM`/`ADDR`/`BASE`, starts when its kick
//! descriptor arrives (`SET_VRING_KICK`) and stops at `GET_VRING_BASE`, which answers with the
//! next index the device would have taken. With protocol features negotiated a ring also needs
//! `SET_VRING_ENABLE 1` before it is processed. A ring is kept at device addresses: without an
//! IOMMU the frontend's virtual addresses are turned into guest physical ones through the memory
//! table at `SET_VRING_ADDR` time; behind a vIOMMU they are IOVAs and stay so. The queue reads
//! them through the device space's vm-memory view, so a ring whose IOVAs the IOTLB cannot
//! translate waits for the frontend's update (a MISS goes out) before it starts or goes on.
//! With `INFLIGHT_SHMFD` the back end allocates the inflight log on `GET_INFLIGHT_FD` and maps
//! the one the frontend kept on `SET_INFLIGHT_FD`; a ring starting over a log redoes what a
//! killed predecessor left in flight ([`crate::ring`]).
//!
//! **Bad messages.** Every request is checked before it changes anything, and a refusal always
//! reaches the frontend as a failure it sees: a non-zero `REPLY_ACK` when it asked for one,
//! else the connection ends, logged with the reason (QEMU sends `SET_VRING_NUM`, `_BASE`,
//! `_KICK` and more without asking; carrying on would leave its guest waiting forever on a ring
//! that was never set up). A failed request whose reply is data (`GET_*`), or a stream that
//! cannot be framed, ends the connection too. When a connection ends, for whatever reason, the
//! device is reset and every mapping of that frontend dropped: the next frontend starts clean.
//!
//! This file is long because the serving loop, the rings' life cycle and the IOTLB misses share
//! the back end's state; the answer to each message is apart, in `handle`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};

use memvisor_wire::WireError;
use virtio_queue::{Queue, QueueT};

pub use crate::device::Device;
use crate::device::Processed;
use crate::error::{Error, Result};
pub use crate::live::{BackendLive, BackendStats};
use crate::memory::{FrontendMemory, MAX_REGIONS, ProcessState};
use crate::observe::IotlbObserver;
use crate::proto::{self, F_IOMMU_PLATFORM, F_LOG_ALL, F_PROTOCOL_FEATURES, protocol, req};
use crate::ring::{InflightRegion, Ring};
use crate::wire::{self, Message};
use crate::worker::{Lent, Worker};

mod handle;
pub(crate) mod service;

use memvisor::Prot;
use memvisor::{Backing, SharedLog};
use service::Pass;
use std::sync::Arc;

/// How long a ring waits for the frontend to answer an IOTLB miss before the request fails:
/// in all, over every retry that misses again before the ring puts a chain back
/// ([`Vring::miss_deadline_now`]).
const MISS_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a message on the back-end channel may wait for the frontend to take it before the
/// channel is given up ([`Backend::send_backend_req`]).
const BACKEND_REQ_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// What the back end offers by itself.
const PROTOCOL: u64 = protocol::MQ
    | protocol::REPLY_ACK
    | protocol::BACKEND_REQ
    | protocol::CONFIGURE_MEM_SLOTS
    | protocol::RESET_DEVICE;

#[derive(Default)]
struct Vring {
    size: u16,
    /// Device addresses of desc, avail, used: IOVAs behind a vIOMMU, else guest physical
    /// (the device space's identity), so the queue reads them through the space's view.
    addr: Option<(u64, u64, u64)>,
    /// Ring addresses whose IOVAs the IOTLB could not translate yet (a MISS went out), and the
    /// kick that came meanwhile: the ring starts when an UPDATE covers them.
    pending: Option<proto::VringAddr>,
    pending_kick: Option<File>,
    /// A request missed in the IOTLB: the ring waits for updates until this deadline.
    miss_deadline: Option<std::time::Instant>,
    /// When the ring's current run of misses began, and its used-index stores then: until
    /// the ring puts a chain back, every retry that misses again shares one [`MISS_WAIT`]. So
    /// a request whose pages cannot all be in the IOTLB at once (each update answering one
    /// makes a full IOTLB retire another) fails, rather than asking without end. Cleared when
    /// a pass misses nothing and when the ring starts.
    missing_since: Option<(std::time::Instant, u64)>,
    /// The pages the waiting request needs and no update has covered yet: the ring retries
    /// when this is empty ([`crate::miss`]).
    awaiting: Vec<u64>,
    base: u16,
    kick: Option<File>,
    call: Option<File>,
    err: Option<File>,
    enabled: bool,
    started: bool,
    queue: Option<Ring>,
}

impl Vring {
    /// The deadline for the miss just met: [`MISS_WAIT`] after the first miss since the ring
    /// last put a chain back (its used-index stores unchanged), or from now.
    fn miss_deadline_now(&mut self) -> std::time::Instant {
        let now = std::time::Instant::now();
        let stores = self.queue.as_ref().map_or(0, Ring::used_index_stores);
        let since = match self.missing_since {
            Some((since, at)) if at == stores => since,
            _ => {
                self.missing_since = Some((now, stores));
                now
            }
        };
        since + MISS_WAIT
    }
}

/// One socket's back end.
pub struct Backend<D: Device> {
    device: D,
    /// Shared with ring workers while they run; changed only when the back end holds it
    /// alone again ([`crate::worker`]).
    memory: Arc<FrontendMemory>,
    vrings: Vec<Vring>,
    /// Rings lent to worker threads between messages.
    workers: Vec<Worker<D>>,
    acked: u64,
    protocol_acked: u64,
    backend_req: Option<UnixStream>,
    /// IOTLB pages asked for with a MISS that no update has covered yet ([`crate::miss`]).
    asked: crate::miss::Asked,
    /// At most this many pages of one request asked for at once ([`Backend::set_miss_batch`]).
    miss_batch: usize,
    /// Set by the frontend's `SET_STATUS`.
    status: u8,
    /// The frontend's dirty log (`SET_LOG_BASE`).
    log: Option<Arc<SharedLog>>,
    /// The inflight log (`GET_INFLIGHT_FD` / `SET_INFLIGHT_FD`): what each ring has taken and
    /// not completed, kept by the frontend across back-end restarts ([`crate::ring`]).
    inflight: Option<InflightRegion>,
    /// Test-only: never write the dirty log (the migration trial's negative control).
    log_disabled: bool,
    /// Who is told of the IOTLB traffic, if anyone (`Backend::record_iotlb`, test-hooks
    /// builds only; always `None` otherwise).
    record: Option<Box<dyn IotlbObserver>>,
    /// Called when a frontend has left, before its memory is dropped
    /// ([`Backend::on_disconnect`]).
    on_disconnect: Vec<Box<dyn FnMut() + Send>>,
    /// Called when a frontend has connected, and when it has left and everything it had is
    /// released ([`Backend::on_connection`]).
    on_connection: Vec<Box<dyn FnMut(bool) + Send>>,
    /// What it counted, readable from other threads ([`Backend::live`]).
    live: BackendLive,
    /// Test-only ([`Faults::leak_on_hangup`](memvisor::faults::Faults::leak_on_hangup)): what
    /// departed frontends left, kept.
    #[cfg(feature = "test-hooks")]
    leaked: Vec<Box<dyn std::any::Any + Send>>,
}

impl<D: Device + 'static> Backend<D> {
    /// A back end for `device`, mapping frontends' memory through `state` (the process's
    /// mappings and pin registry, which the server makes once for all its back ends; in a
    /// test-hooks build also the faults it injects, acted on here and handed to the device
    /// through its memory: `FrontendMemory::faults`, a test-hooks-only method).
    pub fn new(mut device: D, state: &ProcessState) -> Result<Self> {
        let n = device.queues() as usize;
        let memory = FrontendMemory::new(state)?;
        #[cfg(feature = "test-hooks")]
        let log_disabled = state.faults.no_dirty_log;
        #[cfg(not(feature = "test-hooks"))]
        let log_disabled = false;
        device.attach(&memory)?;
        Ok(Backend {
            device,
            memory: Arc::new(memory),
            vrings: (0..n).map(|_| Vring::default()).collect(),
            workers: Vec::new(),
            acked: 0,
            protocol_acked: 0,
            backend_req: None,
            asked: crate::miss::Asked::default(),
            miss_batch: crate::miss::MAX_MISSES,
            status: 0,
            log: None,
            inflight: None,
            log_disabled,
            record: None,
            on_disconnect: Vec::new(),
            on_connection: Vec::new(),
            live: BackendLive::new(n),
            #[cfg(feature = "test-hooks")]
            leaked: Vec::new(),
        })
    }

    /// How many unmapped pages of one request (or ring) the back end asks for at once behind a
    /// vIOMMU, between 1 and [`crate::miss::MAX_MISSES`] (the default; other values are
    /// clamped). 1 asks for one page per round trip to the frontend, as the back end did before
    /// misses were pipelined: kept to measure the difference side by side.
    pub fn set_miss_batch(&mut self, pages: usize) {
        self.miss_batch = pages.clamp(1, crate::miss::MAX_MISSES);
    }

    /// Calls `f(true)` each time a frontend has connected, before its first message is read,
    /// and `f(false)` when it has left and everything it had is released (the live counters
    /// already say so).
    pub fn on_connection(&mut self, f: Box<dyn FnMut(bool) + Send>) {
        self.on_connection.push(f);
    }

    /// Calls `f` each time a frontend has left, before its memory is unmapped: the moment to
    /// see what the process holds for it, idle (the memlock trial compares registry and VmLck).
    pub fn on_disconnect(&mut self, f: Box<dyn FnMut() + Send>) {
        self.on_disconnect.push(f);
    }

    /// The back end's counters, to read from any thread while it serves ([`crate::live`]).
    pub fn live(&self) -> BackendLive {
        self.live.clone()
    }

    /// The back end's totals now.
    pub fn stats(&self) -> BackendStats {
        self.live.stats()
    }

    /// Tells `observer` of the memory tables and IOTLB traffic (updates, invalidates, misses)
    /// from now on: the test kit's recorder writes them down for `memvisor-bench iotlb` to
    /// replay. A test-hooks build only ([`crate::observe`]).
    #[cfg(feature = "test-hooks")]
    pub fn record_iotlb(&mut self, observer: Box<dyn IotlbObserver>) {
        self.record = Some(observer);
    }

    /// Writes the memory table as it is now to the IOTLB recording, if there is one.
    fn record_table(&mut self) {
        if let Some(r) = self.record.as_mut() {
            r.table(&self.memory.regions());
        }
    }

    /// ORs what memvisor tracked since the last call into the frontend's log.
    fn drain_log(&mut self) -> Result<()> {
        let log = self.log.as_deref().filter(|_| !self.log_disabled);
        drain_log(&self.memory, log, &self.live)
    }

    /// The device apart from the rings held on this thread, for the ring service.
    fn split(&mut self) -> (&mut D, Held<'_>, &FrontendMemory) {
        let name = self.device.name();
        let log = self.log.as_deref().filter(|_| !self.log_disabled);
        let held = Held {
            vrings: &mut self.vrings,
            memory: &self.memory,
            log,
            live: &self.live,
            name,
        };
        (&mut self.device, held, &self.memory)
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The frontend's memory as held now.
    pub fn memory(&self) -> &FrontendMemory {
        &self.memory
    }

    /// Serves frontends on `listener` one after another until `stop` is set.
    pub fn serve(&mut self, listener: &UnixListener, stop: &AtomicBool) -> Result<()> {
        listener.set_nonblocking(true).map_err(|source| Error::Os {
            op: "set listener non-blocking",
            source,
        })?;
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((sock, _)) => {
                    sock.set_nonblocking(false).map_err(|source| Error::Os {
                        op: "set socket blocking",
                        source,
                    })?;
                    self.live.protocol().connections.add(1);
                    log::info!("{}: frontend connected", self.device.name());
                    self.on_connection.iter_mut().for_each(|f| f(true));
                    match self.run(&sock, stop) {
                        Ok(()) | Err(Error::Wire(WireError::Disconnected)) => {
                            log::info!("{}: frontend disconnected", self.device.name())
                        }
                        Err(e) => log::warn!("{}: connection ended: {e}", self.device.name()),
                    }
                    self.on_disconnect.iter_mut().for_each(|f| f());
                    self.disconnect();
                    self.publish_rings();
                    self.on_connection.iter_mut().for_each(|f| f(false));
                    if let Some(r) = self.record.as_mut() {
                        r.flush();
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    poll_one(listener.as_raw_fd(), 200);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(Error::Os {
                        op: "accept",
                        source,
                    });
                }
            }
        }
        Ok(())
    }

    /// Serves one connected frontend until it leaves, the stream breaks, or `stop` is set;
    /// returns after every transfer the device had out has ended.
    pub fn run(&mut self, sock: &UnixStream, stop: &AtomicBool) -> Result<()> {
        self.live.set_connected(true);
        self.start_workers();
        let r = self.serve_connection(sock, stop);
        self.stop_workers();
        self.reap(true);
        self.live.set_connected(false);
        r
    }

    fn serve_connection(&mut self, sock: &UnixStream, stop: &AtomicBool) -> Result<()> {
        let mut window: Option<service::PollWindow> = None;
        // Whether the last wake-up brought work: then the window follows it and polling starts.
        let mut work = false;
        // What each wake-up polls, kept between wake-ups (no allocation per wake-up).
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut rings: Vec<usize> = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            if self.device.config_changed() {
                self.notify_config_change()?;
            }
            // A queue the device's own timer wants processed (the balloon's statistics).
            if let Some(i) = self.device.due().map(usize::from) {
                if i < self.vrings.len() {
                    self.process(i)?;
                }
            }
            // Rings whose miss went unanswered: fail the request that missed, go on.
            let now = std::time::Instant::now();
            for i in 0..self.vrings.len() {
                if self.vrings[i].miss_deadline.is_some_and(|d| d <= now) {
                    self.vrings[i].miss_deadline = None;
                    let unanswered = std::mem::take(&mut self.vrings[i].awaiting);
                    self.asked.forget(&unanswered);
                    log::warn!("{}: ring {i}: IOTLB miss unanswered", self.device.name());
                    self.device.set_fail_misses(true);
                    let r = self.process(i);
                    self.device.set_fail_misses(false);
                    r?;
                }
            }
            // The polling window: made when the device polls (its maximum is fixed).
            if window.as_ref().map(|w| w.max()) != self.device.poll() {
                window = self.device.poll().map(service::PollWindow::new);
            }
            if let (Some(w), true) = (window.as_mut(), std::mem::take(&mut work)) {
                self.poll_rings(sock, w)?;
            }
            fds.clear();
            fds.push(libc::pollfd {
                fd: sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
            // The device's completions, if it has work out.
            let done_fd = self.device.completion_fd();
            if let Some(fd) = done_fd {
                fds.push(libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                });
            }
            self.publish_rings();
            let first_ring = fds.len();
            rings.clear();
            for (i, v) in self.vrings.iter().enumerate() {
                // A ring lent to a worker (no queue here) is the worker's to wake.
                if let (true, true, Some(k)) = (v.started, v.queue.is_some(), &v.kick) {
                    fds.push(libc::pollfd {
                        fd: k.as_raw_fd(),
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    rings.push(i);
                }
            }
            // SAFETY: `fds` is a live array of pollfd of the given length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
            if n < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(Error::Os {
                    op: "poll",
                    source: e,
                });
            }
            if done_fd.is_some() && fds[1].revents & libc::POLLIN != 0 {
                work |= self.reap(false);
                // Chains left on a ring while the device had as many out as it keeps.
                for i in 0..self.vrings.len() {
                    if self.has_requests(i) {
                        work = true;
                        self.process(i)?;
                    }
                }
            }
            for (slot, &ring) in fds[first_ring..].iter().zip(&rings) {
                if slot.revents & libc::POLLIN != 0 {
                    // A kick for a request the poll already served brings no work.
                    work |= self.has_requests(ring);
                    self.kicked(ring)?;
                }
            }
            if let (Some(w), true) = (window.as_mut(), work) {
                w.woke_to_work();
            }
            if fds[0].revents != 0 {
                let msg = wire::recv(sock)?;
                self.message(sock, msg)?;
            }
        }
        Ok(())
    }

    /// After work: serves rings with new requests and ends finished transfers, looking again
    /// and again until the window passed since the last work or a message arrives (messages
    /// come first: one may take memory away; [`service::spin`]).
    fn poll_rings(&mut self, sock: &UnixStream, window: &mut service::PollWindow) -> Result<()> {
        service::spin(window, sock.as_raw_fd(), |step| match step {
            service::Step::Round => {
                let mut found = self.reap(false);
                for i in 0..self.vrings.len() {
                    if self.has_requests(i) {
                        self.live.ring(i).poll_hits.add(1);
                        self.process(i)?;
                        found = true;
                    }
                }
                Ok(found)
            }
            service::Step::Quiet => {
                let mem = self.memory.dma().memory();
                for v in &mut self.vrings {
                    if let (true, true, Some(q)) = (v.started, v.enabled, v.queue.as_mut()) {
                        q.start_polling(&mem);
                    }
                }
                Ok(false)
            }
            service::Step::Rearm => {
                let mem = self.memory.dma().memory();
                let mut late = false;
                for v in &mut self.vrings {
                    if let Some(q) = v.queue.as_mut() {
                        late |= q.stop_polling(&mem);
                    }
                }
                Ok(late)
            }
        })
    }

    /// Tells the live counters which rings run (for readers on other threads).
    fn publish_rings(&self) {
        for (i, v) in self.vrings.iter().enumerate() {
            let running = v.started && v.enabled;
            self.live.ring(i).running.store(running, Ordering::Relaxed);
        }
    }

    /// Whether ring `i` runs and its driver made requests available it has not taken.
    fn has_requests(&self, i: usize) -> bool {
        let v = &self.vrings[i];
        let (true, true, None, Some(q)) = (v.started, v.enabled, v.miss_deadline, &v.queue) else {
            return false;
        };
        service::has_requests(q, &self.memory)
    }

    /// Ends the device's work that has ended (with `wait`, all of it): chains go back to their
    /// rings, what they wrote into the frontend's dirty log, and their drivers are notified.
    /// Returns whether anything ended.
    fn reap(&mut self, wait: bool) -> bool {
        let (device, mut held, memory) = self.split();
        service::complete(device, &mut held, memory, wait)
    }

    /// The frontend's memory, to change: no worker holds it between messages.
    fn memory_mut(&mut self) -> &mut FrontendMemory {
        Arc::get_mut(&mut self.memory)
            .expect("ring workers give the memory back before any message is handled")
    }

    /// Stops the ring workers and takes their rings back (each ends its transfers first).
    fn stop_workers(&mut self) {
        for w in std::mem::take(&mut self.workers) {
            let Some(r) = w.stop() else {
                continue;
            };
            let i = usize::from(r.index);
            let v = &mut self.vrings[i];
            v.queue = Some(r.ring);
            if r.broken {
                v.started = false;
            }
            self.live.ring(i).on_worker.store(false, Ordering::Relaxed);
            self.device.join_worker(r.device);
        }
    }

    /// Lends each running ring past the first to a worker thread of its own, when the device
    /// has more than one queue and can serve one on its own ([`crate::worker`]).
    fn start_workers(&mut self) {
        if self.vrings.len() < 2 || self.memory.is_iotlb() || !self.workers.is_empty() {
            return;
        }
        for i in 1..self.vrings.len() {
            let v = &self.vrings[i];
            let ready = v.started && v.enabled && v.miss_deadline.is_none() && v.queue.is_some();
            let Some(kick) = v.kick.as_ref().filter(|_| ready) else {
                continue;
            };
            let Some(device) = self.device.queue_worker() else {
                return;
            };
            let dup = |f: Option<&File>| f.and_then(|f| f.try_clone().ok());
            let Some(kick) = dup(Some(kick)) else {
                continue;
            };
            let (call, err) = (dup(v.call.as_ref()), dup(v.err.as_ref()));
            let log = self.log.clone().filter(|_| !self.log_disabled);
            let v = &mut self.vrings[i];
            let ring = v.queue.take().expect("checked above");
            let lent = Lent {
                index: i as u16,
                ring,
                device,
                memory: self.memory.clone(),
                log,
                live: self.live.clone(),
                kick,
                call,
                err,
            };
            // Counted before the worker can serve a request, as `running` is.
            let r = self.live.ring(i);
            r.on_worker.store(true, Ordering::Relaxed);
            match Worker::start(lent) {
                Ok(w) => {
                    r.lent.add(1);
                    self.workers.push(w);
                }
                Err(e) => {
                    r.on_worker.store(false, Ordering::Relaxed);
                    // The lent ring went with the failed start: stop and say so.
                    log::error!("{}: ring {i}: {e}", self.device.name());
                    self.vrings[i].started = false;
                }
            }
        }
    }

    /// Handles one message and sends what it needs back. Every transfer the device has out
    /// ends first, and the ring workers stop: the message may take memory away or change a
    /// ring. Afterwards the running rings go back to their workers.
    pub fn message(&mut self, sock: &UnixStream, msg: Message) -> Result<()> {
        self.stop_workers();
        self.reap(true);
        let r = self.handle_message(sock, msg);
        self.live.set_config_channel(self.hears_config_changes());
        // Published before a worker can serve a request: a reader that saw the request end
        // sees its ring running.
        self.publish_rings();
        self.start_workers();
        r
    }

    fn handle_message(&mut self, sock: &UnixStream, msg: Message) -> Result<()> {
        self.live.protocol().messages.add(1);
        let request = msg.header.request;
        let ack = msg.needs_reply() && self.protocol_acked & protocol::REPLY_ACK != 0;
        match self.handle(msg) {
            Ok(Some(reply)) if request == req::GET_INFLIGHT_FD => {
                // The log's memfd goes with the reply; `handle` just made it.
                let fd = self.inflight.as_ref().and_then(|r| r.fd());
                let fds: Vec<i32> = fd.iter().map(|f| f.as_raw_fd()).collect();
                wire::reply_with_fds(sock, request, &reply, &fds)
            }
            Ok(Some(reply)) => wire::reply(sock, request, &reply),
            Ok(None) if ack => wire::reply(sock, request, &0u64.to_le_bytes()),
            Ok(None) => Ok(()),
            Err(e) => {
                self.live.protocol().refused.add(1);
                log::warn!(
                    "{}: {} refused: {e}",
                    self.device.name(),
                    req::name(request)
                );
                if request == req::GET_CONFIG {
                    // vhost-user.rst: "vhost-user back-end uses zero length of payload to
                    // indicate an error to the vhost-user front-end".
                    return wire::reply(sock, request, &[]);
                }
                if has_reply(request) {
                    // The frontend waits for data we cannot give: the conversation is over.
                    return Err(e);
                }
                if ack {
                    wire::reply(sock, request, &(e.errno() as u64).to_le_bytes())?;
                    return Ok(());
                }
                // No reply asked for: hanging up is the only failure the frontend will see.
                log::warn!(
                    "{}: closing the connection: {} was refused and the frontend asked for no \
                     reply, so it would go on as if it had been applied",
                    self.device.name(),
                    req::name(request)
                );
                Err(e)
            }
        }
    }

    /// The device addresses of a ring's parts: the IOVAs as sent behind a vIOMMU, else the
    /// guest physical addresses behind the frontend's user addresses.
    fn ring_addresses(&self, a: &proto::VringAddr) -> Result<(u64, u64, u64)> {
        if self.memory.is_iotlb() {
            return Ok((a.desc, a.avail, a.used));
        }
        let [d, av, u] = ring_parts(self.vrings[a.index as usize].size);
        Ok((
            self.memory.user_to_gpa(a.desc, d, "descriptor table")?,
            self.memory.user_to_gpa(a.avail, av, "available ring")?,
            self.memory.user_to_gpa(a.used, u, "used ring")?,
        ))
    }

    /// The pages of ring `i` the device space cannot reach yet (IOTLB misses to ask for; empty
    /// if none): the descriptor table and available ring for reading, the used ring for
    /// writing.
    fn ring_misses(&self, i: usize) -> Vec<memvisor::dma::Miss> {
        let mut misses = Vec::new();
        let Some((desc, avail, used)) = self.vrings[i].addr else {
            return misses;
        };
        let [d, a, u] = ring_parts(self.vrings[i].size);
        let view = self.memory.dma().memory();
        for (addr, len, access) in [
            (desc, d, Prot::READ),
            (avail, a, Prot::READ),
            (used, u, Prot::WRITE),
        ] {
            crate::miss::misses_in(&view, addr, len, access, &mut misses);
        }
        misses
    }

    /// After an IOTLB update: rings waiting for a translation try again.
    fn retry_pending_rings(&mut self) -> Result<()> {
        for i in 0..self.vrings.len() {
            if self.vrings[i].pending.is_none() {
                continue;
            }
            let misses = self.ring_misses(i);
            if misses.is_empty() {
                self.vrings[i].pending = None;
                if let Some(kick) = self.vrings[i].pending_kick.take() {
                    // A ring that cannot start fails alone (told on its error eventfd): the
                    // update that let it try was applied, and is answered so.
                    if let Err(e) = self.start_ring(i, kick) {
                        log::warn!("{}: ring {i} not started: {e}", self.device.name());
                        if let Some(err) = &mut self.vrings[i].err {
                            let _ = err.write(&1u64.to_le_bytes());
                        }
                    }
                }
            } else {
                self.send_misses(None, &misses);
            }
        }
        Ok(())
    }

    /// IOTLB `MISS` messages on the back-end channel for `misses` (read access, or read and
    /// write for a write), all in one write: one per page (a page needed for reading and
    /// writing is asked for once, for writing), for the first [`Backend::set_miss_batch`]
    /// pages, each not asked for already ([`crate::miss::Asked`]). With `ring`, that ring waits for updates covering every one
    /// of these pages, asked now or before, before it retries.
    fn send_misses(&mut self, ring: Option<usize>, misses: &[memvisor::dma::Miss]) {
        let mut b = Vec::new();
        let mut first = None;
        for m in &crate::miss::one_per_page(misses, self.miss_batch) {
            if let Some(i) = ring {
                let page = crate::miss::page_of(m.iova.0);
                let awaiting = &mut self.vrings[i].awaiting;
                if !awaiting.contains(&page) {
                    awaiting.push(page);
                }
            }
            if !self.asked.ask(m) {
                continue;
            }
            let iova = m.iova.0;
            first.get_or_insert(iova);
            let perm = if m.access == Prot::WRITE {
                proto::iotlb::ACCESS_RW
            } else {
                proto::iotlb::ACCESS_RO
            };
            self.live.protocol().iotlb_misses.add(1);
            if let Some(r) = self.record.as_mut() {
                r.miss(iova, perm);
            }
            let msg = proto::IotlbMsg {
                iova,
                size: 0,
                uaddr: 0,
                perm,
                kind: proto::iotlb::MISS,
            }
            .bytes();
            let header = proto::Header {
                request: proto::backend_req::IOTLB_MSG,
                flags: proto::flags::VERSION,
                size: msg.len() as u32,
            };
            b.extend_from_slice(&header.bytes());
            b.extend_from_slice(&msg);
        }
        let Some(iova) = first else {
            return;
        };
        if self.backend_req.is_none() {
            log::warn!(
                "{}: IOTLB miss at iova {iova:#x} but no back-end channel to ask on",
                self.device.name()
            );
            return;
        }
        self.send_backend_req(&b, "IOTLB miss message");
    }

    /// Writes `bytes` (whole messages) on the back-end channel. One the frontend does not take
    /// within [`BACKEND_REQ_WAIT`] (it stopped reading) gives the channel up: a message may
    /// have gone in part, and nothing after it could be told apart; the back end goes on
    /// without it (misses then fail their requests at their deadline, as with no channel).
    fn send_backend_req(&mut self, bytes: &[u8], what: &str) {
        let Some(ch) = self.backend_req.as_ref() else {
            return;
        };
        if let Err(e) = (&*ch).write_all(bytes) {
            log::warn!(
                "{}: {what} on the back-end channel: {e}; the channel is given up",
                self.device.name()
            );
            self.backend_req = None;
        }
    }

    /// An IOTLB update of `[iova, iova + size)` arrived: the pages it covers are answered;
    /// rings whose every page is answered retry.
    fn iotlb_answered(&mut self, iova: u64, size: u64) -> Result<()> {
        self.asked.covered(iova, size);
        for v in &mut self.vrings {
            v.awaiting
                .retain(|&page| !crate::miss::covers(iova, size, page));
        }
        self.retry_pending_rings()?;
        for i in 0..self.vrings.len() {
            if self.vrings[i].awaiting.is_empty() && self.vrings[i].miss_deadline.take().is_some() {
                self.process(i)?;
            }
        }
        Ok(())
    }

    /// Whether the frontend opened the back-end channel and negotiated what
    /// `CONFIG_CHANGE_MSG` needs.
    fn hears_config_changes(&self) -> bool {
        let wanted = protocol::BACKEND_REQ | protocol::CONFIG;
        self.backend_req.is_some() && self.protocol_acked & wanted == wanted
    }

    /// `CONFIG_CHANGE_MSG` on the back-end channel, if the frontend opened one.
    fn notify_config_change(&mut self) -> Result<()> {
        let wanted = protocol::BACKEND_REQ | protocol::CONFIG;
        if self.backend_req.is_none() {
            log::info!(
                "{}: config changed, but the frontend has no back-end channel to hear it",
                self.device.name()
            );
            return Ok(());
        }
        if self.protocol_acked & wanted != wanted {
            return Ok(());
        }
        let b = proto::Header {
            request: proto::backend_req::CONFIG_CHANGE_MSG,
            flags: proto::flags::VERSION,
            size: 0,
        }
        .bytes();
        self.send_backend_req(&b, "config change message");
        Ok(())
    }

    fn offered(&self) -> u64 {
        let log = if self.device.supports_dirty_log() {
            F_LOG_ALL
        } else {
            0
        };
        self.device.features() | F_PROTOCOL_FEATURES | log
    }

    fn protocol_offered(&self) -> u64 {
        let log = if self.device.supports_dirty_log() {
            protocol::LOG_SHMFD
        } else {
            0
        };
        let offered = PROTOCOL | self.device.protocol_features() | log;
        #[cfg(feature = "test-hooks")]
        if self.memory.faults().no_inflight {
            return offered & !protocol::INFLIGHT_SHMFD;
        }
        offered
    }

    /// The largest ring the device takes ([`Device::queue_max`]); a test-hooks build may lower
    /// it ([`Faults::max_queue_size`](memvisor::faults::Faults::max_queue_size), the queue-size
    /// trials' negative control).
    fn queue_max(&self) -> u16 {
        let max = self.device.queue_max();
        #[cfg(feature = "test-hooks")]
        if let Some(cap) = self.memory.faults().max_queue_size {
            return max.min(cap);
        }
        max
    }

    fn ring(&mut self, request: u32, index: u32) -> Result<&mut Vring> {
        let n = self.vrings.len();
        self.vrings
            .get_mut(index as usize)
            .ok_or_else(|| Error::NoSuchRing {
                request: req::name(request),
                index,
                rings: n,
            })
    }

    fn start_ring(&mut self, i: usize, kick: File) -> Result<()> {
        let event_idx = self.acked & proto::F_EVENT_IDX != 0;
        let mem = self.memory.dma().memory();
        let max = self.queue_max();
        let v = &mut self.vrings[i];
        let Some((desc, avail, used)) = v.addr else {
            return Err(Error::BadRing(format!(
                "SET_VRING_KICK for ring {i} before SET_VRING_ADDR"
            )));
        };
        let mut q = Queue::new(max).map_err(queue_error)?;
        q.set_size(if v.size == 0 { q.max_size() } else { v.size });
        q.set_desc_table_address(Some(desc as u32), Some((desc >> 32) as u32));
        q.set_avail_ring_address(Some(avail as u32), Some((avail >> 32) as u32));
        q.set_used_ring_address(Some(used as u32), Some((used >> 32) as u32));
        q.set_next_avail(v.base);
        q.set_next_used(v.base);
        q.set_event_idx(event_idx);
        q.set_ready(true);
        if !q.is_valid(&mem) {
            return Err(Error::BadRing(format!(
                "ring {i}: size {} at desc {desc:#x} avail {avail:#x} used {used:#x} is misaligned \
                 or outside the device's memory",
                q.size()
            )));
        }
        let ring = Ring::new(q, self.inflight.as_ref().map(|r| (r, i as u16)), &mem)?;
        log::info!(
            "{}: ring {i} started: {} entries{}",
            self.device.name(),
            ring.size(),
            if ring.has_inflight_log() {
                ", inflight log"
            } else {
                ""
            }
        );
        let redo = ring.pending_resubmits() > 0;
        v.queue = Some(ring);
        v.missing_since = None;
        v.kick = Some(kick);
        v.started = true;
        // A back end before this one may have returned chains and died before it told the
        // driver; with event indexes nothing here would tell it later (the used index it
        // waits for is behind us). One interrupt now: a spurious one costs the driver a look
        // at the used ring.
        if let Some(c) = &mut v.call {
            let _ = c.write(&1u64.to_le_bytes());
        }
        if redo {
            // The driver kicked for these long ago and will not again: serve them now (or
            // when the ring is enabled).
            self.process(i)?;
        }
        Ok(())
    }

    /// A kick on ring `i`: clear the eventfd, process if enabled.
    fn kicked(&mut self, i: usize) -> Result<()> {
        if let Some(k) = &mut self.vrings[i].kick {
            let mut b = [0u8; 8];
            // An eventfd read of 8 bytes clears it; EAGAIN cannot happen after POLLIN.
            let _ = k.read(&mut b);
        }
        self.live.ring(i).kicks.add(1);
        self.process(i)
    }

    /// Serves ring `i`. A device keeps a bounded number of requests in flight (blk:
    /// [`crate::disk::IN_FLIGHT`]) and leaves the rest on the ring; when transfers ended during
    /// a pass (their completions read: nothing will wake the loop for them) and the ring still
    /// holds requests, it goes round again, or they would wait for a kick that never comes.
    fn process(&mut self, i: usize) -> Result<()> {
        while self.process_once(i)? {}
        Ok(())
    }

    /// One pass of [`Backend::process`]; returns whether to go round again.
    fn process_once(&mut self, i: usize) -> Result<bool> {
        let v = &mut self.vrings[i];
        if !(v.started && v.enabled) || v.miss_deadline.is_some() {
            return Ok(false);
        }
        if v.queue.is_none() {
            return Ok(false);
        }
        // Behind a vIOMMU the ring itself may have lost its translation (an invalidation):
        // ask for it before the queue reads a byte, as for a buffer.
        if self.memory.is_iotlb() {
            let misses = self.ring_misses(i);
            if !misses.is_empty() {
                let v = &mut self.vrings[i];
                v.miss_deadline = Some(v.miss_deadline_now());
                self.send_misses(Some(i), &misses);
                return Ok(false);
            }
        }
        let (device, mut held, memory) = self.split();
        let live = held.live;
        let r = service::pass(device, &mut held, i as u16, memory, live.ring(i));
        let v = &mut self.vrings[i];
        match r {
            Ok(Pass {
                processed: Processed::Missed { misses },
                ..
            }) => {
                // The chain was put back; ask for the translations (all its pages at once) and
                // wait for them. Chains completed before it may be waiting for their interrupt:
                // send it (a spurious one costs the driver a look at the used ring).
                v.miss_deadline = Some(v.miss_deadline_now());
                if let Some(c) = &mut v.call {
                    let _ = c.write(&1u64.to_le_bytes());
                }
                self.send_misses(Some(i), &misses);
                Ok(false)
            }
            Ok(pass) => {
                v.missing_since = None;
                Ok(pass.again)
            }
            Err(e) => {
                // The ring is broken (corrupt indexes): stop it and tell the frontend.
                log::warn!("{}: ring {i} stopped: {e}", self.device.name());
                v.started = false;
                if let Some(err) = &mut v.err {
                    let _ = err.write(&1u64.to_le_bytes());
                }
                Ok(false)
            }
        }
    }

    /// Stops rings whose memory lies in a region about to go. Behind a vIOMMU ring addresses
    /// are IOVAs: a ring there loses its translation with the region and asks again.
    fn stop_rings_in(&mut self, gpa: u64, size: u64) {
        if self.memory.is_iotlb() {
            return;
        }
        for v in &mut self.vrings {
            let inside =
                |(d, a, u): (u64, u64, u64)| [d, a, u].iter().any(|x| x.wrapping_sub(gpa) < size);
            if v.addr.is_some_and(inside) {
                // Where it got to is kept: GET_VRING_BASE answers it, and a restart goes on
                // from there, not from the last SET_VRING_BASE.
                if let Some(q) = v.queue.take() {
                    v.base = q.next_avail();
                }
                v.started = false;
            }
        }
    }

    fn reset(&mut self) -> Result<()> {
        for v in &mut self.vrings {
            *v = Vring::default();
        }
        self.asked.clear();
        self.device.reset();
        self.acked = 0;
        self.status = 0;
        Ok(())
    }

    /// A frontend left: forget everything it set up.
    fn disconnect(&mut self) {
        #[cfg(feature = "test-hooks")]
        crate::hooks::leak_on_hangup(&mut self.leaked, &self.memory, self.log.take());
        let _ = self.reset();
        self.log = None;
        self.inflight = None;
        if self.memory.is_logging() {
            let _ = self.memory_mut().stop_logging();
        }
        self.protocol_acked = 0;
        self.backend_req = None;
        self.live.set_config_channel(false);
        if let Err(e) = self.memory_mut().clear() {
            log::warn!(
                "{}: dropping the frontend's memory: {e}",
                self.device.name()
            );
        }
    }
}

/// The rings held on the back end's thread (those not lent to a worker), for the ring service.
struct Held<'a> {
    vrings: &'a mut [Vring],
    memory: &'a FrontendMemory,
    log: Option<&'a SharedLog>,
    live: &'a BackendLive,
    name: &'static str,
}

impl service::Rings for Held<'_> {
    fn ring(&mut self, index: u16) -> Option<&mut Ring> {
        self.vrings.get_mut(usize::from(index))?.queue.as_mut()
    }

    fn log(&mut self) {
        // After requests ended a failure can only be reported: they are done either way.
        if let Err(e) = drain_log(self.memory, self.log, self.live) {
            log::error!("{}: dirty log: {e}", self.name);
        }
    }

    fn notify(&mut self, index: u16) {
        let call = self
            .vrings
            .get_mut(usize::from(index))
            .and_then(|v| v.call.as_mut());
        if let Some(c) = call {
            let _ = c.write(&1u64.to_le_bytes());
        }
    }
}

/// ORs what memvisor tracked since the last call into `log`, counted as the protocol thread's.
fn drain_log(memory: &FrontendMemory, log: Option<&SharedLog>, live: &BackendLive) -> Result<()> {
    if let Some(log) = log {
        let t0 = std::time::Instant::now();
        let pages = memory.drain_dirty(log)?;
        let p = live.protocol();
        p.logged_pages.add(pages);
        p.log_ns.add(t0.elapsed().as_nanos() as u64);
        p.log_drains.add(1);
    }
    Ok(())
}

fn queue_error(e: virtio_queue::Error) -> Error {
    Error::BadRing(format!("virtqueue: {e}"))
}

/// Requests whose reply is data, not an ack.
/// The bytes of a split ring's descriptor table, available ring and used ring for `size`
/// entries (a size not set yet counts as 1), with the event index words.
fn ring_parts(size: u16) -> [u64; 3] {
    let n = u64::from(size.max(1));
    [16 * n, 6 + 2 * n, 6 + 8 * n]
}

fn has_reply(request: u32) -> bool {
    matches!(
        request,
        req::GET_FEATURES
            | req::GET_PROTOCOL_FEATURES
            | req::GET_VRING_BASE
            | req::GET_QUEUE_NUM
            | req::GET_CONFIG
            | req::GET_MAX_MEM_SLOTS
            | req::GET_STATUS
            | req::SET_LOG_BASE
            | req::GET_INFLIGHT_FD
    )
}

/// Waits up to `ms` for `fd` to be readable; returns whether it is.
fn poll_one(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, ms) > 0 }
}
