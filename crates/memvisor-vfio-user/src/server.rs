//! The server: one client connection, its DMA table and its interrupts, and a [`Device`].
//!
//! The model is VFIO's, carried over a socket. The client (QEMU's `vfio-user-pci`) programs the
//! device's IOMMU with `DMA_MAP` / `DMA_UNMAP` exactly as the guest's IOMMU programming, or the
//! guest's RAM layout, dictates; each becomes a call on one [`DmaSpace`] with VFIO type1's
//! rules and errnos — the table every DMA the device does goes through. Memory arrives as a
//! descriptor with each map; [`SharedMappings::map_within`] maps each file once, so a guest
//! that maps thousands of 4 KiB pages costs thousands of table entries, not thousands of
//! `mmap`s and open descriptors.
//!
//! Choices where the protocol leaves room, each the kernel's:
//! * Unmapping a range with nothing mapped in it succeeds and reports 0 bytes, as type1 does
//!   (QEMU unmaps the whole IOVA space in power-of-two chunks when the guest's IOMMU comes up;
//!   libvfio-user answers those with ENOENT, which QEMU logs and ignores).
//! * An unmap that cuts a mapping is EINVAL and changes nothing; so is `UNMAP_ALL` with a
//!   non-zero range.
//! * `DMA_UNMAP` is answered only once the device can no longer touch the range: the table
//!   closes it at once, the device finishes what it copies there and gives back its pins
//!   there (asked through its unmap notifier), and the reply goes after that. A device that
//!   keeps its pins past [`DmaConfig::unpin_wait`] is stopped (reset) and the unmap tried
//!   again: a client such as QEMU treats a refused unmap as done, so EBUSY would tell it the
//!   memory is gone while the device still writes it. Only a device that holds pins even
//!   after its reset gets the client an EBUSY.
//! * A map without a descriptor (memory QEMU does not share: ROM, or guest RAM that is not a
//!   shared memory backend) becomes a peer-memory mapping ([`DmaSpace::map_remote`]): the
//!   table checks it like any other, and the device's copies through [`Port::dma_read`] /
//!   [`Port::dma_write`] reach it with `DMA_READ` / `DMA_WRITE` requests to the client, at most
//!   `max_data_xfer_size` bytes each. Pinning it fails with EFAULT, as in libvfio-user.
//!   Those requests go out from the device's own thread and their replies come back through
//!   this loop, which therefore never waits for the device.
//!
//! Everything the client sends is untrusted: a request that is refused gets an error reply
//! with its errno and leaves the server as it was; only a message that cannot be framed ends
//! the connection. Region accesses are bounds-checked here, before the device sees them.

use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memvisor::dma::PinRegistry;
use memvisor::{DmaConfig, DmaSpace, Iova, Prot, SharedMappings};
use memvisor_wire::{Size, WireError};
use serde::Serialize;

use crate::conn::{Conn, Message};
use crate::error::{Error, Result};
use crate::lock;
use crate::proto::{
    self, DmaMap, DmaUnmap, IrqSet, MAX_DATA_XFER, MAX_FDS, RegionAccess, Version, cmd,
    device_flags, irq_set_flags, map_flags, unmap_flags,
};

/// A region a device offers (`struct vfio_region_info`, without capabilities or mmap).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RegionInfo {
    /// Bytes; 0 for a region the device does not have.
    pub size: u64,
    /// `proto::region_flags` (READ, WRITE).
    pub flags: u32,
}

/// An interrupt index a device offers (`struct vfio_irq_info`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IrqInfo {
    /// Vectors; 0 for an index the device does not use.
    pub count: u32,
    /// `proto::irq_info_flags`.
    pub flags: u32,
}

/// A device behind the server: its regions, interrupts, register accesses and reset. DMA and
/// interrupts go through the [`Port`] it is given when it is made.
pub trait Device: Send {
    /// `DEVICE_GET_INFO` flags (`proto::device_flags`).
    fn flags(&self) -> u32;
    /// Regions by index (for PCI: BARs 0-5, ROM, config space, VGA).
    fn regions(&self) -> Vec<RegionInfo>;
    /// Interrupt indices (for PCI: INTx, MSI, MSI-X, ERR, REQ).
    fn irqs(&self) -> Vec<IrqInfo>;
    /// Reads `buf.len()` bytes of `region` at `offset` (checked against the region's size).
    fn read(&mut self, region: u32, offset: u64, buf: &mut [u8]) -> Result<()>;
    /// Writes `data` to `region` at `offset` (checked against the region's size).
    fn write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()>;
    /// Back to the power-on state: DMA stopped, pins released.
    fn reset(&mut self) -> Result<()>;
    /// The device's own counters, for the server's report.
    fn stats(&self) -> serde_json::Value;
}

/// How long a `DMA_READ` / `DMA_WRITE` waits for the client's reply (QEMU's own default
/// message timeout, `x-msg-timeout`).
const PEER_TIMEOUT: Duration = Duration::from_secs(5);

/// What a device reaches the outside through: the DMA table and the interrupts.
#[derive(Debug)]
pub struct Port {
    dma: Arc<DmaSpace>,
    registry: Arc<PinRegistry>,
    irqs: Mutex<Vec<Vec<Option<OwnedFd>>>>,
    signalled: AtomicU64,
    conn: Arc<Conn>,
    /// Most bytes per `DMA_READ` / `DMA_WRITE`: ours, or the client's if smaller.
    max_xfer: AtomicUsize,
    peer: PeerCounts,
}

/// `DMA_READ` / `DMA_WRITE` traffic.
#[derive(Debug, Default)]
struct PeerCounts {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes: AtomicU64,
    errors: AtomicU64,
}

impl Port {
    /// The device's DMA space: every IOVA the client mapped, with type1's rules.
    pub fn dma(&self) -> &Arc<DmaSpace> {
        &self.dma
    }

    /// Copies guest memory at `iova` into `buf` through the DMA table: from mapped files
    /// directly, from memory the client mapped without a descriptor with `DMA_READ` requests.
    /// Errors as [`DmaSpace::dma_read`] (checked whole first), or the client's errno.
    pub fn dma_read(&self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        self.dma
            .dma_read_via(iova, buf, |at, part: &mut [u8]| self.peer_read(at, part))
    }

    /// Copies `data` to guest memory at `iova` through the DMA table, as [`Port::dma_read`]
    /// (`DMA_WRITE` for memory mapped without a descriptor); marks written pages dirty.
    pub fn dma_write(&self, iova: Iova, data: &[u8]) -> Result<()> {
        self.dma
            .dma_write_via(iova, data, |at, part: &[u8]| self.peer_write(at, part))
    }

    fn peer_read(&self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        let max = self.max_xfer.load(Ordering::Relaxed);
        let mut at = iova.0;
        for chunk in buf.chunks_mut(max) {
            let body = proto::dma_read_request(at, chunk.len() as u64);
            let r = self
                .conn
                .request(cmd::DMA_READ, &[&body], PEER_TIMEOUT)
                .and_then(|m| {
                    chunk.copy_from_slice(proto::dma_read_reply(&m.body, at, chunk.len())?);
                    Ok(())
                });
            self.count_peer(&self.peer.reads, chunk.len(), &r);
            r?;
            at += chunk.len() as u64;
        }
        Ok(())
    }

    fn peer_write(&self, iova: Iova, data: &[u8]) -> Result<()> {
        let max = self.max_xfer.load(Ordering::Relaxed);
        let mut at = iova.0;
        for chunk in data.chunks(max) {
            let body = proto::dma_write_request(at, chunk);
            let r = self
                .conn
                .request(cmd::DMA_WRITE, &[&body], PEER_TIMEOUT)
                .map(|_| ());
            self.count_peer(&self.peer.writes, chunk.len(), &r);
            r?;
            at += chunk.len() as u64;
        }
        Ok(())
    }

    fn count_peer(&self, kind: &AtomicU64, bytes: usize, r: &Result<()>) {
        match r {
            Ok(()) => {
                kind.fetch_add(1, Ordering::Relaxed);
                self.peer.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
            }
            Err(_) => {
                self.peer.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Signals vector `vector` of interrupt index `index` (writes its eventfd); false if the
    /// client has not given one.
    pub fn signal(&self, index: u32, vector: u32) -> bool {
        let irqs = lock(&self.irqs);
        let Some(fd) = irqs
            .get(index as usize)
            .and_then(|v| v.get(vector as usize))
            .and_then(Option::as_ref)
        else {
            return false;
        };
        let one = 1u64.to_ne_bytes();
        // Counted before the write: the client may act on the interrupt at once — even hang
        // up, which ends the connection and reads the count — before this thread runs again.
        self.signalled.fetch_add(1, Ordering::Relaxed);
        // SAFETY: writes 8 bytes from a live buffer to a descriptor we own.
        let n = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), 8) };
        if n != 8 {
            self.signalled.fetch_sub(1, Ordering::Relaxed);
        }
        n == 8
    }
}

/// What the server counted; written as JSON at the end of a connection.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ServerStats {
    /// Requests handled.
    pub requests: u64,
    /// Error replies sent (and failed posted writes).
    pub errors: u64,
    /// `DMA_MAP`s that made a mapping.
    pub dma_maps: u64,
    /// `DMA_MAP`s refused.
    pub dma_map_errors: u64,
    /// `DMA_UNMAP`s that removed something.
    pub dma_unmaps: u64,
    /// `DMA_UNMAP`s of a range with nothing mapped (answered: 0 bytes).
    pub dma_unmaps_empty: u64,
    /// `DMA_UNMAP`s refused.
    pub dma_unmap_errors: u64,
    /// Times the device was stopped because it kept its pins in a range being unmapped.
    pub device_stops: u64,
    /// Most mappings at once.
    pub peak_mappings: u64,
    /// `DMA_MAP`s without a descriptor: memory reached with `DMA_READ` / `DMA_WRITE`.
    pub dma_maps_remote: u64,
    /// `DMA_READ` requests the device's copies sent to the client.
    pub peer_reads: u64,
    /// `DMA_WRITE` requests the device's copies sent to the client.
    pub peer_writes: u64,
    /// Data bytes those requests carried.
    pub peer_bytes: u64,
    /// Those that failed (client error or no reply).
    pub peer_errors: u64,
    /// Mappings when the connection ended (before the server dropped them).
    pub mappings_at_end: u64,
    /// Nanoseconds spent in `DMA_MAP` handling, from parse to table change.
    pub map_ns: u64,
    /// Nanoseconds spent in `DMA_UNMAP` handling, from parse to table change.
    pub unmap_ns: u64,
    /// `REGION_READ`s answered (the device's registers and config space).
    pub region_reads: u64,
    /// `REGION_WRITE`s answered.
    pub region_writes: u64,
    /// Interrupts signalled through eventfds.
    pub irqs_signalled: u64,
    /// Pages the device had pinned when the connection ended (before it was stopped).
    pub pinned_pages_at_hangup: u64,
    /// Pages the device still had pinned after it was stopped: must be 0.
    pub pinned_pages_at_end: u64,
    /// Bytes the process still had locked after the server dropped its mappings: must be 0.
    pub locked_bytes_at_end: u64,
    /// Runs of pages the registry held with long-term pins
    /// ([`PinRegistry::long_term_counts`]; 0 unless turned on).
    pub long_term_pins: u64,
    /// Runs the kernel refused to pin long-term, mlocked instead.
    pub long_term_fallbacks: u64,
    /// Bytes long-term pins still held after the server dropped its mappings: must be 0.
    pub long_term_bytes_at_end: u64,
    /// The device's counters.
    pub device: serde_json::Value,
}

/// The reply body and descriptors of a handled request.
type Reply = Vec<u8>;

/// A vfio-user server for one connection.
pub struct Server<D: Device> {
    conn: Arc<Conn>,
    port: Arc<Port>,
    device: D,
    stats: ServerStats,
    record: Option<Box<dyn Write + Send>>,
    /// The process's mappings of client memory (handed in by [`Server::new`]).
    mappings: SharedMappings,
    versioned: bool,
    /// TEST ONLY (feature `test-hooks`,
    /// [`Faults::ignore_unmap`](memvisor::faults::Faults::ignore_unmap) in the config's faults):
    /// ranges "unmapped" but left in the table, dropped when a map needs the room — a broken IOMMU
    /// that forgets to invalidate. The device keeps reaching memory the guest took away; the
    /// real-guest trial's negative control shows it notices.
    #[cfg(feature = "test-hooks")]
    zombies: Option<Vec<(u64, u64)>>,
    /// TEST ONLY (feature `test-hooks`,
    /// [`Faults::unmap_busy`](memvisor::faults::Faults::unmap_busy)): answer `DMA_UNMAP` with
    /// EBUSY, changing nothing, while the device holds pins (`pin_pages`) or its requests hold
    /// pages (`pin_sg` guards), as before issue 31, instead of waiting for them. A client that takes a refused unmap as done then has its device write memory it
    /// took back; the real-guest trial's race phase must catch that.
    #[cfg(feature = "test-hooks")]
    busy_while_pinned: bool,
    /// TEST ONLY (feature `test-hooks`,
    /// [`Faults::leak_on_hangup`](memvisor::faults::Faults::leak_on_hangup)): when the connection
    /// ends, neither stop the device nor unmap anything: the port (its DMA table, every mapping of
    /// the client's memory, the locks and pins in it, the socket) is kept in [`LEAKED`] for the
    /// life of the process. The client-dies trial's `/proc` checks must catch it.
    #[cfg(feature = "test-hooks")]
    leak_on_hangup: bool,
}

/// TEST ONLY (feature `test-hooks`): the ports of connections a server with
/// [`Faults::leak_on_hangup`](memvisor::faults::Faults::leak_on_hangup) kept, with their DMA
/// tables and everything mapped, locked or pinned through them.
#[cfg(feature = "test-hooks")]
static LEAKED: Mutex<Vec<Arc<Port>>> = Mutex::new(Vec::new());

impl<D: Device> Server<D> {
    /// A server on `sock` whose device `make` builds around the [`Port`]. The DMA space follows
    /// VFIO type1 with `config` (its page sizes are announced to the client as `pgsizes`; its
    /// pin registry, `None` for the process's, is the one the device pins through). The
    /// client's memory is mapped through `mappings`, which the process's servers share (a
    /// server program passes [`SharedMappings::global`], made once).
    pub fn new(
        sock: UnixStream,
        config: DmaConfig,
        mappings: SharedMappings,
        make: impl FnOnce(Arc<Port>) -> D,
    ) -> Result<Server<D>> {
        let registry = config.registry.clone().unwrap_or_else(PinRegistry::global);
        #[cfg(feature = "test-hooks")]
        let faults = config.faults;
        let dma = Arc::new(DmaSpace::new(config)?);
        let conn = Arc::new(Conn::new(sock));
        let port = Arc::new(Port {
            dma,
            registry,
            irqs: Mutex::new(Vec::new()),
            signalled: AtomicU64::new(0),
            conn: conn.clone(),
            max_xfer: AtomicUsize::new(MAX_DATA_XFER),
            peer: PeerCounts::default(),
        });
        let device = make(port.clone());
        Ok(Server {
            conn,
            port,
            device,
            stats: ServerStats::default(),
            record: None,
            mappings,
            versioned: false,
            #[cfg(feature = "test-hooks")]
            zombies: faults.ignore_unmap.then(Vec::new),
            #[cfg(feature = "test-hooks")]
            busy_while_pinned: faults.unmap_busy,
            #[cfg(feature = "test-hooks")]
            leak_on_hangup: faults.leak_on_hangup,
        })
    }

    /// Runs `unmap` on the table. If the device keeps its pins in the range past the table's
    /// bound (EBUSY, nothing changed), stops the device, which lets go of every pin, and runs
    /// it once more.
    fn take_back<T>(&mut self, unmap: impl Fn(&DmaSpace) -> memvisor::Result<T>) -> Result<T> {
        #[cfg(feature = "test-hooks")]
        if self.busy_while_pinned
            && self.port.dma.device_pinned_pages() + self.port.dma.guard_held_pages() > 0
        {
            return Err(memvisor::Error::Busy {
                addr: 0,
                why: "TEST ONLY: the device holds pins".into(),
            }
            .into());
        }
        match unmap(&self.port.dma) {
            Err(e @ memvisor::Error::Busy { .. }) => {
                log::error!("DMA_UNMAP: {e}; stopping the device and unmapping again");
                self.stats.device_stops += 1;
                if let Err(e) = self.device.reset() {
                    log::warn!("device reset for an unmap: {e}");
                }
                Ok(unmap(&self.port.dma)?)
            }
            r => Ok(r?),
        }
    }

    /// Writes every `DMA_MAP` / `DMA_UNMAP` to `out`, one line each (`M iova size offset prot`,
    /// `U iova size`, `A`; hex), for replay in benchmarks (`memvisor-bench vfio-user`). A
    /// test-hooks build only: the product records nothing.
    #[cfg(feature = "test-hooks")]
    pub fn record_to(&mut self, out: Box<dyn Write + Send>) {
        self.record = Some(out);
    }

    /// The device's port.
    pub fn port(&self) -> &Arc<Port> {
        &self.port
    }

    /// Serves until the client disconnects; then stops the device (releasing its pins), drops
    /// every mapping and returns the counts. An error that ends the connection early is
    /// returned after the same cleanup.
    pub fn serve(mut self) -> (ServerStats, Result<()>) {
        let end = self.run();
        // The device's own requests (DMA_READ / DMA_WRITE) can neither go out nor get a reply
        // now: new ones fail at the socket, those waiting fail at once.
        self.conn.shutdown();
        self.conn.fail_pending();
        #[cfg(feature = "test-hooks")]
        let release = !self.leak_on_hangup;
        #[cfg(not(feature = "test-hooks"))]
        let release = true;
        self.stats.pinned_pages_at_hangup = self.port.dma.device_pinned_pages();
        // Whatever ended the connection, nothing stays pinned, mapped or locked.
        if release {
            if let Err(e) = self.device.reset() {
                log::warn!("device reset at disconnect: {e}");
            }
        }
        self.stats.mappings_at_end = self.port.dma.len() as u64;
        self.stats.pinned_pages_at_end = self.port.dma.device_pinned_pages();
        if release {
            match self.port.dma.unmap_all() {
                // The recording's table empties here too, so a recording of several
                // connections replays as they happened.
                Ok(n) if n > 0 => self.record(format_args!("A")),
                Ok(_) => {}
                Err(e) => log::warn!("unmap at disconnect: {e}"),
            }
        } else {
            #[cfg(feature = "test-hooks")]
            {
                log::warn!(
                    "TEST ONLY: the connection's {} mappings, their locks and pins are kept",
                    self.stats.mappings_at_end
                );
                lock(&LEAKED).push(self.port.clone());
            }
        }
        self.stats.locked_bytes_at_end = self.port.registry.locked_bytes();
        let counts = self.port.registry.long_term_counts();
        self.stats.long_term_pins = counts.pinned;
        self.stats.long_term_fallbacks = counts.fallbacks;
        self.stats.long_term_bytes_at_end = self.port.registry.long_term_bytes();
        self.stats.irqs_signalled = self.port.signalled.load(Ordering::Relaxed);
        let peer = &self.port.peer;
        self.stats.peer_reads = peer.reads.load(Ordering::Relaxed);
        self.stats.peer_writes = peer.writes.load(Ordering::Relaxed);
        self.stats.peer_bytes = peer.bytes.load(Ordering::Relaxed);
        self.stats.peer_errors = peer.errors.load(Ordering::Relaxed);
        self.stats.device = self.device.stats();
        if let Some(r) = self.record.as_mut() {
            let _ = r.flush();
        }
        (self.stats, end)
    }

    fn run(&mut self) -> Result<()> {
        loop {
            let m = match self.conn.recv() {
                Ok(m) => m,
                Err(Error::Wire(WireError::Disconnected)) => return Ok(()),
                Err(e) => return Err(e),
            };
            if m.header.is_reply() {
                self.conn.deliver(m);
                continue;
            }
            let h = m.header;
            self.stats.requests += 1;
            let result = if h.flags & proto::flags::TYPE_MASK != proto::flags::COMMAND {
                Err(Error::Invalid(format!(
                    "{}: message type {:#x} is neither command (0) nor reply (1)",
                    cmd::name(h.command),
                    h.flags & proto::flags::TYPE_MASK
                )))
            } else {
                self.handle(m)
            };
            match result {
                Ok(body) if !h.no_reply() => self.conn.reply(&h, &[&body], &[])?,
                Ok(_) => {}
                Err(Error::Wire(e)) if e.ends_connection() => return Err(e.into()),
                Err(e) => {
                    self.stats.errors += 1;
                    log::info!("{} (id {}) refused: {e}", cmd::name(h.command), h.id);
                    if h.no_reply() {
                        log::warn!(
                            "posted {} failed with errno {}: {e}",
                            cmd::name(h.command),
                            e.errno()
                        );
                    } else {
                        self.conn.reply_error(&h, e.errno())?;
                    }
                }
            }
        }
    }

    fn handle(&mut self, m: Message) -> Result<Reply> {
        let c = m.header.command;
        if !self.versioned && c != cmd::VERSION {
            return Err(Error::Invalid(format!(
                "{}: VERSION must be the first command",
                cmd::name(c)
            )));
        }
        if !m.fds.is_empty() && !matches!(c, cmd::DMA_MAP | cmd::DEVICE_SET_IRQS) {
            return Err(Error::Invalid(format!(
                "{}: {} file descriptors where the command takes none",
                cmd::name(c),
                m.fds.len()
            )));
        }
        match c {
            cmd::VERSION => self.version(&m.body),
            cmd::DMA_MAP => self.dma_map(m),
            cmd::DMA_UNMAP => self.dma_unmap(&m.body),
            cmd::DEVICE_GET_INFO => self.device_info(&m.body),
            cmd::DEVICE_GET_REGION_INFO => self.region_info(&m.body),
            cmd::DEVICE_GET_IRQ_INFO => self.irq_info(&m.body),
            cmd::DEVICE_SET_IRQS => self.set_irqs(m),
            cmd::REGION_READ => self.region_read(&m.body),
            cmd::REGION_WRITE => self.region_write(&m.body),
            cmd::REGION_WRITE_MULTI => self.region_write_multi(&m.body),
            cmd::DEVICE_RESET => {
                // The device may be waiting for replies to its own DMA_READ / DMA_WRITE, which
                // only this thread delivers: they fail at once while it resets, or the reset
                // would wait out each one's timeout (vfio-user.rst: never stall command
                // processing waiting for replies on the other channel).
                self.conn.cancel_requests();
                let r = self.device.reset();
                self.conn.resume_requests();
                r?;
                Ok(Vec::new())
            }
            cmd::DMA_READ | cmd::DMA_WRITE => Err(Error::Invalid(format!(
                "{}: only the server sends it (DMA to memory mapped without a descriptor)",
                cmd::name(c)
            ))),
            cmd::DEVICE_GET_REGION_IO_FDS | cmd::DIRTY_PAGES | cmd::DEVICE_FEATURE => {
                Err(Error::Refused {
                    errno: libc::ENOTSUP,
                    why: format!("{}: not supported by this server", cmd::name(c)),
                })
            }
            _ => Err(Error::Refused {
                errno: libc::ENOSYS,
                why: format!("unknown command {c}"),
            }),
        }
    }

    fn version(&mut self, body: &[u8]) -> Result<Reply> {
        let v = Version::parse(body)?;
        if v.major != 0 {
            return Err(Error::Refused {
                errno: libc::ENOTSUP,
                why: format!("VERSION: major {} (this server speaks 0)", v.major),
            });
        }
        if !v.json.is_empty() {
            let caps = serde_json::from_str::<serde_json::Value>(&v.json).map_err(|e| {
                Error::Invalid(format!(
                    "VERSION: capabilities are not JSON ({e}): {}",
                    v.json
                ))
            })?;
            // The client's limit on what it receives, if it says one.
            if let Some(max) = caps["capabilities"]["max_data_xfer_size"].as_u64() {
                if max == 0 {
                    return Err(Error::Invalid(
                        "VERSION: max_data_xfer_size 0; DMA_READ/DMA_WRITE need at least 1 byte"
                            .into(),
                    ));
                }
                let ours = MAX_DATA_XFER as u64;
                self.port
                    .max_xfer
                    .store(max.min(ours) as usize, Ordering::Relaxed);
            }
        }
        self.versioned = true;
        let info = self.port.dma.info();
        let caps = serde_json::json!({
            "capabilities": {
                "max_msg_fds": MAX_FDS,
                "max_data_xfer_size": MAX_DATA_XFER,
                "pgsizes": info.page_sizes,
                "max_dma_maps": info.max_mappings,
            }
        });
        Ok(Version {
            major: 0,
            minor: 0,
            json: caps.to_string(),
        }
        .to_bytes())
    }

    fn record(&mut self, line: std::fmt::Arguments<'_>) {
        if let Some(r) = self.record.as_mut() {
            if let Err(e) = r.write_fmt(line).and_then(|()| r.write_all(b"\n")) {
                log::warn!("recording stopped: {e}");
                self.record = None;
            }
        }
    }

    fn dma_map(&mut self, mut m: Message) -> Result<Reply> {
        let t = Instant::now();
        let r = self.try_dma_map(&mut m);
        self.stats.map_ns += t.elapsed().as_nanos() as u64;
        match &r {
            Ok(_) => {
                self.stats.dma_maps += 1;
                self.stats.peak_mappings = self.stats.peak_mappings.max(self.port.dma.len() as u64);
            }
            Err(_) => self.stats.dma_map_errors += 1,
        }
        r
    }

    fn try_dma_map(&mut self, m: &mut Message) -> Result<Reply> {
        let map = DmaMap::parse(&m.body)?;
        let known = map_flags::READ | map_flags::WRITE;
        if map.flags & !known != 0 {
            return Err(Error::BadDma(format!(
                "DMA_MAP at iova {:#x}: unknown flags {:#x} (READ 0x1, WRITE 0x2)",
                map.iova,
                map.flags & !known
            )));
        }
        let mut prot = Prot::default();
        if map.flags & map_flags::READ != 0 {
            prot = prot | Prot::READ;
        }
        if map.flags & map_flags::WRITE != 0 {
            prot = prot | Prot::WRITE;
        }
        let p = match (prot.contains(Prot::READ), prot.contains(Prot::WRITE)) {
            (true, true) => "rw",
            (true, false) => "r",
            _ => "w",
        };
        let fd = match m.fds.len() {
            1 => m.fds.pop().expect("one fd"),
            0 => {
                #[cfg(feature = "test-hooks")]
                self.drop_zombies(map.iova, map.size);
                self.port.dma.map_remote(Iova(map.iova), map.size, prot)?;
                self.stats.dma_maps_remote += 1;
                self.record(format_args!("R {:#x} {:#x} {p}", map.iova, map.size));
                return Ok(Vec::new());
            }
            n => {
                return Err(Error::BadDma(format!(
                    "DMA_MAP at iova {:#x}: {n} file descriptors, expected 0 or 1",
                    map.iova
                )));
            }
        };
        #[cfg(feature = "test-hooks")]
        self.drop_zombies(map.iova, map.size);
        // Type1's checks on the IOVA range come first (size 0, alignment, overlap, count),
        // before the client's file is looked at or mapped (the file range is checked there).
        self.port.dma.check_map(Iova(map.iova), map.size, prot)?;
        // A device write through a descriptor the client opened read-only would write what
        // the client itself cannot (a mapping of the same file made for another map or
        // another connection would otherwise let it): EACCES, as mmap gives.
        if prot.contains(Prot::WRITE) && !crate::conn::opened_for_writing(&fd)? {
            return Err(Error::Refused {
                errno: libc::EACCES,
                why: format!(
                    "DMA_MAP at iova {:#x} asks WRITE of a descriptor opened read-only",
                    map.iova
                ),
            });
        }
        let (backing, offset) = self.mappings.map_within(fd, map.offset, map.size)?;
        self.port
            .dma
            .map_backing(Iova(map.iova), &backing, offset, map.size, prot)?;
        self.record(format_args!(
            "M {:#x} {:#x} {:#x} {p}",
            map.iova, map.size, map.offset
        ));
        Ok(Vec::new())
    }

    /// TEST ONLY ([`Faults::ignore_unmap`](memvisor::faults::Faults::ignore_unmap)): really unmaps
    /// the "unmapped" ranges a new map of `[iova, iova + size)` needs.
    #[cfg(feature = "test-hooks")]
    fn drop_zombies(&mut self, iova: u64, size: u64) {
        let Some(z) = self.zombies.as_mut() else {
            return;
        };
        let end = iova.saturating_add(size);
        let hit = |&(i, n): &(u64, u64)| i < end && iova < i.saturating_add(n);
        for &(i, n) in z.iter().filter(|e| hit(e)) {
            let _ = self.port.dma.unmap(Iova(i), n);
        }
        z.retain(|e| !hit(e));
    }

    fn dma_unmap(&mut self, body: &[u8]) -> Result<Reply> {
        let t = Instant::now();
        let r = self.try_dma_unmap(body);
        self.stats.unmap_ns += t.elapsed().as_nanos() as u64;
        match &r {
            Ok((_, 0)) => self.stats.dma_unmaps_empty += 1,
            Ok(_) => self.stats.dma_unmaps += 1,
            Err(_) => self.stats.dma_unmap_errors += 1,
        }
        r.map(|(body, _)| body)
    }

    fn try_dma_unmap(&mut self, body: &[u8]) -> Result<(Reply, u64)> {
        let mut u = DmaUnmap::parse(body)?;
        #[cfg(feature = "test-hooks")]
        if let Some(z) = self.zombies.as_mut() {
            if u.flags & unmap_flags::ALL == 0 {
                z.push((u.iova, u.size));
                return Ok((u.to_bytes(), u.size));
            }
        }
        let mut bitmap = Vec::new();
        let bytes = if u.flags & unmap_flags::ALL != 0 {
            if u.iova != 0 || u.size != 0 || u.bitmap.is_some() {
                return Err(Error::BadDma(format!(
                    "DMA_UNMAP ALL with iova {:#x} size {:#x}{}: ALL takes neither a range nor \
                     a dirty bitmap",
                    u.iova,
                    u.size,
                    if u.bitmap.is_some() {
                        " and GET_DIRTY_BITMAP"
                    } else {
                        ""
                    }
                )));
            }
            let b = self.take_back(|dma| dma.unmap_all())?;
            self.record(format_args!("A"));
            b
        } else if let Some((pgsize, room)) = u.bitmap {
            // The room first: an unmap cannot be undone, and type1 refuses a bitmap of the
            // wrong size before it unmaps anything (a page size of 0 is the space's to refuse).
            let need = (u.size / pgsize.max(1)).div_ceil(8);
            if pgsize != 0 && room < need {
                return Err(Error::BadDma(format!(
                    "DMA_UNMAP: dirty bitmap of {room} bytes, {need} needed"
                )));
            }
            let (b, words) =
                self.take_back(|dma| dma.unmap_get_dirty(Iova(u.iova), u.size, pgsize))?;
            for w in words {
                bitmap.extend_from_slice(&w.to_le_bytes());
            }
            bitmap.truncate(need as usize);
            self.record(format_args!("U {:#x} {:#x}", u.iova, u.size));
            b
        } else {
            let b = self.take_back(|dma| dma.unmap(Iova(u.iova), u.size))?;
            self.record(format_args!("U {:#x} {:#x}", u.iova, u.size));
            b
        };
        u.size = bytes;
        let mut reply = u.to_bytes();
        reply.extend_from_slice(&bitmap);
        Ok((reply, bytes))
    }

    fn device_info(&mut self, body: &[u8]) -> Result<Reply> {
        if body.len() < 4 || proto::u32_at(body, 0) < 16 {
            return Err(Error::Invalid(format!(
                "DEVICE_GET_INFO: argsz must be at least 16 (body of {} bytes)",
                body.len()
            )));
        }
        let mut r = Vec::with_capacity(16);
        for v in [
            16,
            self.device.flags(),
            self.device.regions().len() as u32,
            self.device.irqs().len() as u32,
        ] {
            r.extend_from_slice(&v.to_le_bytes());
        }
        Ok(r)
    }

    fn region_info(&mut self, body: &[u8]) -> Result<Reply> {
        let (_, index) = proto::info_request(cmd::DEVICE_GET_REGION_INFO, body)?;
        let regions = self.device.regions();
        let info = regions.get(index as usize).ok_or_else(|| {
            Error::BadRegion(format!(
                "DEVICE_GET_REGION_INFO: region {index}, the device has {}",
                regions.len()
            ))
        })?;
        let mut r = Vec::with_capacity(32);
        for v in [32, info.flags, index, 0] {
            r.extend_from_slice(&v.to_le_bytes());
        }
        r.extend_from_slice(&info.size.to_le_bytes());
        r.extend_from_slice(&0u64.to_le_bytes());
        Ok(r)
    }

    fn irq_info(&mut self, body: &[u8]) -> Result<Reply> {
        let (_, index) = proto::info_request(cmd::DEVICE_GET_IRQ_INFO, body)?;
        let irqs = self.device.irqs();
        let info = irqs.get(index as usize).ok_or_else(|| {
            Error::BadIrq(format!(
                "DEVICE_GET_IRQ_INFO: index {index}, the device has {}",
                irqs.len()
            ))
        })?;
        let mut r = Vec::with_capacity(16);
        for v in [16, info.flags, index, info.count] {
            r.extend_from_slice(&v.to_le_bytes());
        }
        Ok(r)
    }

    fn set_irqs(&mut self, m: Message) -> Result<Reply> {
        let s = IrqSet::parse(&m.body)?;
        let irqs = self.device.irqs();
        let info = irqs.get(s.index as usize).ok_or_else(|| {
            Error::BadIrq(format!(
                "DEVICE_SET_IRQS: index {}, the device has {}",
                s.index,
                irqs.len()
            ))
        })?;
        let data = s.flags & irq_set_flags::DATA_MASK;
        let action = s.flags & irq_set_flags::ACTION_ALL;
        // EVENTFD: one descriptor per vector, or none to take the vectors' eventfds away
        // (QEMU's way of sending a run of -1); other data types take none.
        let fds_ok = match data {
            irq_set_flags::DATA_EVENTFD => m.fds.is_empty() || m.fds.len() == s.count as usize,
            _ => m.fds.is_empty(),
        };
        if !fds_ok {
            return Err(Error::BadIrq(format!(
                "DEVICE_SET_IRQS index {}: {} file descriptors for count {} (EVENTFD takes one \
                 per vector or none; other data types none)",
                s.index,
                m.fds.len(),
                s.count
            )));
        }
        // VFIO: DATA_NONE + TRIGGER with count 0 turns the whole index off.
        if s.count == 0 {
            if data == irq_set_flags::DATA_NONE && action == irq_set_flags::ACTION_TRIGGER {
                let mut all = lock(&self.port.irqs);
                if let Some(v) = all.get_mut(s.index as usize) {
                    v.clear();
                }
                return Ok(Vec::new());
            }
            return Err(Error::BadIrq(format!(
                "DEVICE_SET_IRQS index {}: count 0 only with DATA_NONE|ACTION_TRIGGER",
                s.index
            )));
        }
        let end = s.start as u64 + s.count as u64;
        if end > info.count as u64 {
            return Err(Error::BadIrq(format!(
                "DEVICE_SET_IRQS index {}: vectors {}..{end}, the index has {}",
                s.index, s.start, info.count
            )));
        }
        let bools = &m.body[IrqSet::SIZE..];
        if data == irq_set_flags::DATA_BOOL && bools.len() < s.count as usize {
            return Err(Error::BadIrq(format!(
                "DEVICE_SET_IRQS index {}: {} bool bytes for count {}",
                s.index,
                bools.len(),
                s.count
            )));
        }
        // The device has no level-triggered interrupts to mask: MASK and UNMASK are accepted
        // and change nothing, as for an edge-triggered vector in VFIO.
        if action != irq_set_flags::ACTION_TRIGGER {
            return Ok(Vec::new());
        }
        if data == irq_set_flags::DATA_EVENTFD {
            let mut all = lock(&self.port.irqs);
            if all.len() <= s.index as usize {
                all.resize_with(s.index as usize + 1, Vec::new);
            }
            let v = &mut all[s.index as usize];
            if v.len() < end as usize {
                v.resize_with(end as usize, || None);
            }
            for slot in &mut v[s.start as usize..end as usize] {
                *slot = None;
            }
            for (i, fd) in m.fds.into_iter().enumerate() {
                v[s.start as usize + i] = Some(fd);
            }
        } else {
            // DATA_NONE / DATA_BOOL with TRIGGER fire the vectors now (a loopback test of the
            // client's wiring).
            for i in 0..s.count {
                if data == irq_set_flags::DATA_NONE || bools[i as usize] != 0 {
                    self.port.signal(s.index, s.start + i);
                }
            }
        }
        Ok(Vec::new())
    }

    /// Checks a region access lies inside the region and the region allows it.
    fn check_access(&self, command: u16, a: &RegionAccess, need: u32) -> Result<()> {
        let regions = self.device.regions();
        let info = regions.get(a.region as usize).copied().unwrap_or_default();
        let end = a.offset.checked_add(a.count as u64);
        if end.is_none_or(|e| e > info.size) {
            return Err(Error::BadRegion(format!(
                "{}: region {} bytes {:#x}+{} outside its {:#x} bytes",
                cmd::name(command),
                a.region,
                a.offset,
                a.count,
                info.size
            )));
        }
        if info.flags & need == 0 {
            return Err(Error::BadRegion(format!(
                "{}: region {} does not allow it (flags {:#x})",
                cmd::name(command),
                a.region,
                info.flags
            )));
        }
        Ok(())
    }

    fn region_read(&mut self, body: &[u8]) -> Result<Reply> {
        let a = RegionAccess::parse(cmd::REGION_READ, body)?;
        self.check_access(cmd::REGION_READ, &a, proto::region_flags::READ)?;
        let mut r = a.to_bytes().to_vec();
        r.resize(RegionAccess::SIZE + a.count as usize, 0);
        self.device
            .read(a.region, a.offset, &mut r[RegionAccess::SIZE..])?;
        self.stats.region_reads += 1;
        Ok(r)
    }

    fn region_write(&mut self, body: &[u8]) -> Result<Reply> {
        let a = RegionAccess::parse(cmd::REGION_WRITE, body)?;
        self.check_access(cmd::REGION_WRITE, &a, proto::region_flags::WRITE)?;
        self.device
            .write(a.region, a.offset, &body[RegionAccess::SIZE..])?;
        self.stats.region_writes += 1;
        Ok(a.to_bytes().to_vec())
    }

    fn region_write_multi(&mut self, body: &[u8]) -> Result<Reply> {
        Size::AtLeast(8).check("REGION_WRITE_MULTI", body.len())?;
        let n = proto::u64_at(body, 0);
        let want = 8 + n.min(proto::WRITE_MULTI_MAX) as usize * proto::WRITE_MULTI_ONE;
        if n > proto::WRITE_MULTI_MAX || body.len() < want {
            return Err(Error::BadRegion(format!(
                "REGION_WRITE_MULTI: {n} writes in {} bytes (at most {}, {} bytes each)",
                body.len(),
                proto::WRITE_MULTI_MAX,
                proto::WRITE_MULTI_ONE
            )));
        }
        // Check all, then write all: a bad entry refuses the message whole.
        let mut writes = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            let e = &body[8 + i * proto::WRITE_MULTI_ONE..][..proto::WRITE_MULTI_ONE];
            let a = RegionAccess {
                offset: proto::u64_at(e, 0),
                region: proto::u32_at(e, 8),
                count: proto::u32_at(e, 12),
            };
            if a.count > 8 {
                return Err(Error::BadRegion(format!(
                    "REGION_WRITE_MULTI write {i}: count {} above 8",
                    a.count
                )));
            }
            self.check_access(cmd::REGION_WRITE_MULTI, &a, proto::region_flags::WRITE)?;
            writes.push((a, &e[16..16 + a.count as usize]));
        }
        for (a, data) in writes {
            self.device.write(a.region, a.offset, data)?;
            self.stats.region_writes += 1;
        }
        Ok(Vec::new())
    }
}

/// The `DEVICE_GET_INFO` flags of a resettable PCI device.
pub const PCI_DEVICE: u32 = device_flags::PCI | device_flags::RESET;
