//! `mvdma`: a reference PCI device with a DMA engine, to drive the type1 model from a guest.
//!
//! Small and documented so a guest program can drive it with nothing but its registers: a
//! copy engine that walks a table of scatter-gather descriptors in guest memory, reads each
//! source range, checksums it, writes it to the destination and raises an MSI when the table
//! is done. Every address it touches is an IOVA in the server's
//! [`DmaSpace`](memvisor::DmaSpace); two modes run the two device paths of the kernel patches
//! the project reproduces:
//!
//! * **copy** (`MODE` 0): `dma_read` / `dma_write` through a 64 KiB bounce buffer, as the patch
//!   "use vfio_iova_rw() to read/write IOVAs from CPU side" does with `vfio_dma_rw`: nothing
//!   pinned. Memory the client mapped without a descriptor is reached the same way, through
//!   `DMA_READ` / `DMA_WRITE` requests ([`Port::dma_read`]).
//! * **pin** (`MODE` 1): each piece of a descriptor (at most 512 pages of source and of
//!   destination) is pinned, both sides in one walk (`DmaSpace::pin_sg`, which also gives
//!   their host segments), for the duration of its copy and unpinned after,
//!   the `vfio_pin_pages` path of the patch "vfio iommu type1: Improve
//!   vfio_iommu_type1_pin_pages performance"; the page count of every call is kept as a
//!   histogram. A piece in memory mapped without a descriptor cannot be pinned (EFAULT): the
//!   descriptor's rest is copied as in copy mode, and counted (`pin_fallbacks`).
//!
//! A descriptor is checked whole before a byte moves: if any part of its source is not mapped
//! readable or its destination writable, it fails with that errno in its status and nothing is
//! written — DMA to an IOVA the guest unmapped is reported, not performed. An unmap of memory
//! the engine is using is answered once the engine let go: the unmap notifier waits for the
//! piece in flight, and the rest of that descriptor fails (the range is closed to new pins and
//! copies at once).
//!
//! PCI identity: vendor 0x1234, device 0x11f0, class 0x0880 (other system peripheral); BAR0 is
//! 4 KiB of 32-bit non-prefetchable memory; one MSI vector (64-bit capable); no INTx, no
//! ROM, no MSI-X.
//!
//! BAR0 registers (little-endian; 32-bit unless noted):
//!
//! | offset | name | access | meaning |
//! |---|---|---|---|
//! | 0x00 | ID | RO | 0x6d76646d ("mvdm") |
//! | 0x04 | VERSION | RO | 1 |
//! | 0x08 | DESC | RW, 64-bit | IOVA of the descriptor table |
//! | 0x10 | COUNT | RW | descriptors in the table, 1..=4096 |
//! | 0x14 | MODE | RW | 0 copy, 1 pin |
//! | 0x18 | DOORBELL | WO | 1 starts the table (ignored while busy; counted as refused) |
//! | 0x1c | STATUS | RO | 0 idle, 1 busy, 2 done, 3 done with failed descriptors or an unreadable table |
//! | 0x20 | ERRNO | RO | errno of the first failure of the last run |
//! | 0x24 | DONE | RO | descriptors that succeeded in the last run |
//! | 0x28 | SEQ | RO | runs completed |
//! | 0x30 | BYTES | RO, 64-bit | bytes copied, all runs |
//!
//! A descriptor is 32 bytes: `src: u64, dst: u64, len: u32` (1 byte .. 64 MiB), then the device
//! writes `status: u32` (0 or an errno) and `sum: u64`, the FNV-1a 64 hash of the bytes it read
//! from `src` — so a guest checks both directions: the sum proves what the device read, the
//! destination what it wrote.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use memvisor::dma::{PIN_PAGES_MAX, Segment, SgBuf, SgWalk, read_pinned, write_pinned};
use memvisor::{Hva, Iova, Prot};
use serde::Serialize;

use crate::error::{Error, Result};
use crate::lock;
use crate::proto::{irq_info_flags, region_flags};
use crate::server::{Device, IrqInfo, PCI_DEVICE, Port, RegionInfo};

/// PCI vendor id (0x1234, the id QEMU's own test devices use).
pub const VENDOR: u16 = 0x1234;
/// PCI device id.
pub const DEVICE: u16 = 0x11f0;
/// Bytes of BAR0.
pub const BAR0_SIZE: u64 = 4096;
/// Bytes of one descriptor.
pub const DESC_SIZE: u64 = 32;
/// Most descriptors in one table.
pub const MAX_DESCS: u32 = 4096;
/// Largest descriptor.
pub const MAX_LEN: u32 = 64 << 20;

/// Register offsets in BAR0 (the table in the module documentation says what each holds).
pub mod reg {
    /// The device's identity, 0x6d76646d ("mvdm"), read-only.
    pub const ID: u64 = 0x00;
    /// The register layout's version (1), read-only.
    pub const VERSION: u64 = 0x04;
    /// The IOVA of the descriptor table (64-bit).
    pub const DESC: u64 = 0x08;
    /// Descriptors in the table, 1..=4096.
    pub const COUNT: u64 = 0x10;
    /// 0 copy, 1 pin.
    pub const MODE: u64 = 0x14;
    /// Write 1 to start the table.
    pub const DOORBELL: u64 = 0x18;
    /// The engine's state ([`super::status`]), read-only.
    pub const STATUS: u64 = 0x1c;
    /// The errno of the last run's first failure, read-only.
    pub const ERRNO: u64 = 0x20;
    /// Descriptors that succeeded in the last run, read-only.
    pub const DONE: u64 = 0x24;
    /// Runs completed, read-only.
    pub const SEQ: u64 = 0x28;
    /// Bytes copied over all runs (64-bit), read-only.
    pub const BYTES: u64 = 0x30;
}

/// `STATUS` values.
pub mod status {
    /// No table has run yet.
    pub const IDLE: u32 = 0;
    /// A table is running.
    pub const BUSY: u32 = 1;
    /// The last table ran and every descriptor succeeded.
    pub const DONE: u32 = 2;
    /// The last table ran with failed descriptors, or its table could not be read.
    pub const FAILED: u32 = 3;
}

const ID_VALUE: u32 = 0x6d76_646d;
const CONFIG_SIZE: usize = 256;
const MSI_CAP: usize = 0x40;
/// PCI region indices (VFIO's order).
const BAR0_REGION: u32 = 0;
const CONFIG_REGION: u32 = 7;
const NUM_REGIONS: usize = 9;
/// PCI interrupt indices: INTx, MSI, MSI-X, ERR, REQ.
const MSI_INDEX: u32 = 1;
const NUM_IRQS: usize = 5;
const BOUNCE: usize = 64 << 10;
use memvisor::PAGE_4K as PAGE;

/// What the device counted.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DmaDevStats {
    /// Tables run.
    pub runs: u64,
    /// Doorbells refused (busy, bad COUNT or MODE).
    pub refused: u64,
    /// Descriptors that succeeded.
    pub descriptors_ok: u64,
    /// Descriptors that failed (an errno in their status).
    pub descriptors_failed: u64,
    /// Bytes copied.
    pub bytes: u64,
    /// Descriptors run in copy mode.
    pub copy_descriptors: u64,
    /// Descriptors run in pin mode.
    pub pin_descriptors: u64,
    /// Pin calls (one walk pinning a piece's source and destination).
    pub pin_calls: u64,
    /// The pin calls by page count, `[npage, calls]` sorted by npage.
    pub npage_histogram: Vec<(u64, u64)>,
    /// Pin-mode pieces that fell back to copying because their memory is the client's
    /// (mapped without a descriptor, so nothing to pin).
    pub pin_fallbacks: u64,
    /// Unmap notifications received (an unmap touched pinned pages).
    pub unmap_notifications: u64,
}

/// Registers the engine and the register file share.
#[derive(Debug, Default)]
struct Regs {
    status: AtomicU32,
    errno: AtomicU32,
    done: AtomicU32,
    seq: AtomicU32,
    bytes: AtomicU64,
}

/// One table to run.
struct Job {
    desc: u64,
    count: u32,
    pin: bool,
}

/// Engine state the unmap notifier and reset wait on.
#[derive(Debug, Default)]
struct Flight {
    busy: bool,
    /// The engine is sending a finished table's interrupt. A new doorbell is already accepted
    /// (a driver may ring it the moment it sees STATUS), but a reset waits for this too, so
    /// that the interrupt is sent and counted before the device counts as stopped.
    signalling: bool,
    /// Pins held right now, by the engine thread.
    pinning: bool,
}

struct Shared {
    port: Arc<Port>,
    regs: Regs,
    stats: Mutex<DmaDevStats>,
    flight: Mutex<Flight>,
    changed: Condvar,
}

/// The device.
pub struct DmaDev {
    shared: Arc<Shared>,
    config: [u8; CONFIG_SIZE],
    /// Bits of each config byte the guest may write.
    writable: [u8; CONFIG_SIZE],
    desc: u64,
    count: u32,
    mode: u32,
    jobs: Option<Sender<Job>>,
    engine: Option<JoinHandle<()>>,
}

impl DmaDev {
    /// The device on `port`; its engine thread starts now.
    pub fn new(port: Arc<Port>) -> DmaDev {
        let shared = Arc::new(Shared {
            port,
            regs: Regs::default(),
            stats: Mutex::new(DmaDevStats::default()),
            flight: Mutex::new(Flight::default()),
            changed: Condvar::new(),
        });
        // An unmap that reaches pinned pages waits for the piece in flight: the engine
        // unpins at the end of every piece, so this returns within one piece's copy.
        let s = Arc::downgrade(&shared);
        shared.port.dma().add_unmap_notifier(move |_, _| {
            if let Some(s) = s.upgrade() {
                lock(&s.stats).unmap_notifications += 1;
                let mut f = lock(&s.flight);
                while f.pinning {
                    f = s.changed.wait(f).unwrap_or_else(|p| p.into_inner());
                }
            }
        });
        let (tx, rx) = channel();
        let engine_shared = shared.clone();
        let engine = std::thread::Builder::new()
            .name("mvdma-engine".into())
            .spawn(move || engine(engine_shared, rx))
            .expect("spawn the DMA engine thread");
        let (config, writable) = config_space();
        DmaDev {
            shared,
            config,
            writable,
            desc: 0,
            count: 0,
            mode: 0,
            jobs: Some(tx),
            engine: Some(engine),
        }
    }

    fn bar_read(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let r = &self.shared.regs;
        let v: u64 = match offset & !3 {
            reg::ID => ID_VALUE.into(),
            reg::VERSION => 1,
            reg::DESC => self.desc,
            0x0c => self.desc >> 32,
            reg::COUNT => self.count.into(),
            reg::MODE => self.mode.into(),
            reg::STATUS => r.status.load(Ordering::Acquire).into(),
            reg::ERRNO => r.errno.load(Ordering::Acquire).into(),
            reg::DONE => r.done.load(Ordering::Acquire).into(),
            reg::SEQ => r.seq.load(Ordering::Acquire).into(),
            reg::BYTES => r.bytes.load(Ordering::Relaxed),
            0x34 => r.bytes.load(Ordering::Relaxed) >> 32,
            _ => 0,
        };
        // 1, 2, 4 or 8 bytes from a register boundary; an 8-byte read of a 64-bit register
        // gets all of it.
        let bytes = if buf.len() == 8 && offset % 8 == 0 {
            v.to_le_bytes()
        } else {
            ((v as u32) as u64).to_le_bytes()
        };
        let at = (offset & 3) as usize;
        if at + buf.len() > 8 || (buf.len() != 8 && at + buf.len() > 4) {
            return Err(Error::BadRegion(format!(
                "mvdma BAR0: a {}-byte read at {offset:#x} crosses a register",
                buf.len()
            )));
        }
        buf.copy_from_slice(&bytes[at..at + buf.len()]);
        Ok(())
    }

    fn bar_write(&mut self, offset: u64, data: &[u8]) -> Result<()> {
        let value = match data.len() {
            4 => u32::from_le_bytes(data.try_into().expect("4 bytes")) as u64,
            8 => u64::from_le_bytes(data.try_into().expect("8 bytes")),
            n => {
                return Err(Error::BadRegion(format!(
                    "mvdma BAR0: a {n}-byte write at {offset:#x}; registers take 4 or 8 bytes"
                )));
            }
        };
        match (offset, data.len()) {
            (reg::DESC, 8) => self.desc = value,
            (reg::DESC, 4) => self.desc = (self.desc & !0xffff_ffff) | value,
            (0x0c, 4) => self.desc = (self.desc & 0xffff_ffff) | (value << 32),
            (reg::COUNT, 4) => self.count = value as u32,
            (reg::MODE, 4) => self.mode = value as u32,
            (reg::DOORBELL, 4) if value == 1 => self.ring(),
            (reg::DOORBELL, 4) => {}
            _ => {
                return Err(Error::BadRegion(format!(
                    "mvdma BAR0: {offset:#x} is not a writable register (or the wrong width, {} \
                     bytes)",
                    data.len()
                )));
            }
        }
        Ok(())
    }

    fn ring(&mut self) {
        let regs = &self.shared.regs;
        let mut f = lock(&self.shared.flight);
        let ok = !f.busy && (1..=MAX_DESCS).contains(&self.count) && self.mode <= 1;
        if !ok {
            drop(f);
            lock(&self.shared.stats).refused += 1;
            log::info!(
                "mvdma doorbell refused: busy {}, COUNT {} (1..={MAX_DESCS}), MODE {} (0 or 1)",
                self.shared.regs.status.load(Ordering::Relaxed) == status::BUSY,
                self.count,
                self.mode
            );
            return;
        }
        f.busy = true;
        regs.status.store(status::BUSY, Ordering::Release);
        drop(f);
        let job = Job {
            desc: self.desc,
            count: self.count,
            pin: self.mode == 1,
        };
        if let Some(tx) = &self.jobs {
            let _ = tx.send(job);
        }
    }

    /// Waits until no table is running and the last one's interrupt has been sent.
    fn wait_idle(&self) {
        let mut f = lock(&self.shared.flight);
        while f.busy || f.signalling {
            f = self
                .shared
                .changed
                .wait(f)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    fn config_write(&mut self, offset: usize, data: &[u8]) {
        for (i, &b) in data.iter().enumerate() {
            let at = offset + i;
            let w = self.writable[at];
            self.config[at] = (self.config[at] & !w) | (b & w);
        }
    }
}

impl Drop for DmaDev {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(e) = self.engine.take() {
            let _ = e.join();
        }
    }
}

impl Device for DmaDev {
    fn flags(&self) -> u32 {
        PCI_DEVICE
    }

    fn regions(&self) -> Vec<RegionInfo> {
        let mut r = vec![RegionInfo::default(); NUM_REGIONS];
        let rw = region_flags::READ | region_flags::WRITE;
        r[BAR0_REGION as usize] = RegionInfo {
            size: BAR0_SIZE,
            flags: rw,
        };
        r[CONFIG_REGION as usize] = RegionInfo {
            size: CONFIG_SIZE as u64,
            flags: rw,
        };
        r
    }

    fn irqs(&self) -> Vec<IrqInfo> {
        let mut i = vec![IrqInfo::default(); NUM_IRQS];
        i[MSI_INDEX as usize] = IrqInfo {
            count: 1,
            flags: irq_info_flags::EVENTFD | irq_info_flags::NORESIZE,
        };
        i
    }

    fn read(&mut self, region: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        match region {
            BAR0_REGION => self.bar_read(offset, buf),
            _ => {
                let at = offset as usize;
                buf.copy_from_slice(&self.config[at..at + buf.len()]);
                Ok(())
            }
        }
    }

    fn write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        match region {
            BAR0_REGION => self.bar_write(offset, data),
            _ => {
                self.config_write(offset as usize, data);
                Ok(())
            }
        }
    }

    fn reset(&mut self) -> Result<()> {
        self.wait_idle();
        self.desc = 0;
        self.count = 0;
        self.mode = 0;
        let r = &self.shared.regs;
        r.status.store(status::IDLE, Ordering::Release);
        r.errno.store(0, Ordering::Relaxed);
        r.done.store(0, Ordering::Relaxed);
        let (config, _) = config_space();
        self.config = config;
        Ok(())
    }

    fn stats(&self) -> serde_json::Value {
        serde_json::to_value(&*lock(&self.shared.stats)).unwrap_or_default()
    }
}

/// The power-on config space and its writable bits.
fn config_space() -> ([u8; CONFIG_SIZE], [u8; CONFIG_SIZE]) {
    let mut c = [0u8; CONFIG_SIZE];
    let mut w = [0u8; CONFIG_SIZE];
    let put16 = |c: &mut [u8; CONFIG_SIZE], at: usize, v: u16| {
        c[at..at + 2].copy_from_slice(&v.to_le_bytes())
    };
    put16(&mut c, 0x00, VENDOR);
    put16(&mut c, 0x02, DEVICE);
    // Command: memory space, bus master, INTx disable are the guest's to set.
    w[0x04] = 0x06;
    w[0x05] = 0x04;
    put16(&mut c, 0x06, 0x0010); // status: a capability list
    c[0x08] = 1; // revision
    c[0x0a] = 0x80; // subclass: other
    c[0x0b] = 0x08; // class: system peripheral
    // BAR0: 32-bit memory, size 4 KiB: the low 12 bits read 0 whatever is written.
    w[0x11] = 0xf0;
    w[0x12] = 0xff;
    w[0x13] = 0xff;
    put16(&mut c, 0x2c, VENDOR);
    put16(&mut c, 0x2e, DEVICE);
    c[0x34] = MSI_CAP as u8;
    w[0x3c] = 0xff; // interrupt line; pin 0: no INTx
    // MSI: one vector, 64-bit addresses.
    c[MSI_CAP] = 0x05;
    c[MSI_CAP + 1] = 0;
    put16(&mut c, MSI_CAP + 2, 0x0080);
    w[MSI_CAP + 2] = 0x71; // enable, multiple message enable
    for b in &mut w[MSI_CAP + 4..MSI_CAP + 14] {
        *b = 0xff;
    }
    w[MSI_CAP + 4] = 0xfc; // address: dword aligned
    (c, w)
}

/// FNV-1a, 64-bit.
pub fn fnv1a(mut h: u64, data: &[u8]) -> u64 {
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// FNV-1a's starting value.
pub const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

fn engine(s: Arc<Shared>, jobs: Receiver<Job>) {
    let mut bounce = vec![0u8; BOUNCE];
    for job in jobs {
        let (done, first_err) = run_table(&s, &job, &mut bounce);
        let r = &s.regs;
        r.done.store(done, Ordering::Relaxed);
        r.errno
            .store(first_err.unwrap_or(0) as u32, Ordering::Relaxed);
        r.status.store(
            if first_err.is_some() {
                status::FAILED
            } else {
                status::DONE
            },
            Ordering::Release,
        );
        r.seq.fetch_add(1, Ordering::AcqRel);
        lock(&s.stats).runs += 1;
        {
            let mut f = lock(&s.flight);
            f.busy = false;
            f.signalling = true;
            s.changed.notify_all();
        }
        s.port.signal(MSI_INDEX, 0);
        let mut f = lock(&s.flight);
        f.signalling = false;
        s.changed.notify_all();
    }
}

/// Runs one table; returns the descriptors that succeeded and the first errno.
fn run_table(s: &Shared, job: &Job, bounce: &mut [u8]) -> (u32, Option<i32>) {
    let mut done = 0;
    let mut first_err = None;
    for i in 0..job.count as u64 {
        let at = match job.desc.checked_add(i * DESC_SIZE) {
            Some(a) => a,
            None => return (done, Some(libc::EINVAL)),
        };
        let mut d = [0u8; 24];
        if let Err(e) = s.port.dma_read(Iova(at), &mut d) {
            // The table itself is unreadable: nothing more can be reported through it.
            log::info!("mvdma: descriptor {i} at iova {at:#x} unreadable: {e}");
            return (done, Some(first_err.unwrap_or(e.errno())));
        }
        let src = u64::from_le_bytes(d[0..8].try_into().expect("8"));
        let dst = u64::from_le_bytes(d[8..16].try_into().expect("8"));
        let len = u32::from_le_bytes(d[16..20].try_into().expect("4"));
        let result = run_one(s, job.pin, src, dst, len, bounce);
        let (st, sum) = match result {
            Ok(sum) => {
                done += 1;
                (0, sum)
            }
            Err(e) => {
                log::info!(
                    "mvdma: descriptor {i} (src {src:#x} dst {dst:#x} len {len}) failed: {e}"
                );
                first_err.get_or_insert(e.errno());
                (e.errno() as u32, 0)
            }
        };
        {
            let mut st_ = lock(&s.stats);
            if st == 0 {
                st_.descriptors_ok += 1;
                st_.bytes += len as u64;
            } else {
                st_.descriptors_failed += 1;
            }
        }
        if st == 0 {
            s.regs.bytes.fetch_add(len as u64, Ordering::Relaxed);
        }
        let mut out = [0u8; 12];
        out[0..4].copy_from_slice(&st.to_le_bytes());
        out[4..12].copy_from_slice(&sum.to_le_bytes());
        if let Err(e) = s.port.dma_write(Iova(at + 20), &out) {
            log::info!("mvdma: descriptor {i} at iova {at:#x}: status not writable: {e}");
            return (done, Some(first_err.unwrap_or(e.errno())));
        }
    }
    (done, first_err)
}

fn run_one(s: &Shared, pin: bool, src: u64, dst: u64, len: u32, bounce: &mut [u8]) -> Result<u64> {
    if len == 0 || len > MAX_LEN {
        return Err(Error::BadDescriptor(format!(
            "descriptor length {len}: must be 1..={MAX_LEN}"
        )));
    }
    let dma = s.port.dma();
    let len = len as u64;
    dma.check_access(Iova(src), len, Prot::READ)?;
    dma.check_access(Iova(dst), len, Prot::WRITE)?;
    {
        let mut st = lock(&s.stats);
        if pin {
            st.pin_descriptors += 1;
        } else {
            st.copy_descriptors += 1;
        }
    }
    let mut sum = FNV_START;
    let mut off = 0u64;
    let mut pin = pin;
    while off < len {
        if pin {
            // At most 512 pages of each side per piece.
            let room = |a: u64| PIN_PAGES_MAX as u64 * PAGE - (a % PAGE);
            let n = (len - off).min(room(src + off)).min(room(dst + off));
            match copy_pinned(s, src + off, dst + off, n, sum, bounce) {
                Ok(next) => sum = next,
                Err(Error::Memory(memvisor::Error::Remote { .. })) => {
                    // Memory the client mapped without a descriptor cannot be pinned (there
                    // is no host address): carry on copying through the client, as a
                    // libvfio-user device falls back from vfu_sgl_get to vfu_sgl_read.
                    lock(&s.stats).pin_fallbacks += 1;
                    pin = false;
                    continue;
                }
                Err(e) => return Err(e),
            }
            off += n;
        } else {
            let n = (len - off).min(bounce.len() as u64) as usize;
            let buf = &mut bounce[..n];
            s.port.dma_read(Iova(src + off), buf)?;
            sum = fnv1a(sum, buf);
            s.port.dma_write(Iova(dst + off), buf)?;
            off += n as u64;
        }
    }
    Ok(sum)
}

fn record_pin(s: &Shared, npage: usize) {
    let mut st = lock(&s.stats);
    st.pin_calls += 1;
    let h = &mut st.npage_histogram;
    match h.binary_search_by_key(&(npage as u64), |e| e.0) {
        Ok(i) => h[i].1 += 1,
        Err(i) => h.insert(i, (npage as u64, 1)),
    }
}

/// Copies `n` bytes (at most 512 pages each side) with both sides pinned for the duration:
/// one [`DmaSpace::pin_sg`](memvisor::DmaSpace::pin_sg) walk pins both and gives their host
/// segments; the guard unpins them when it drops.
fn copy_pinned(
    s: &Shared,
    src: u64,
    dst: u64,
    n: u64,
    mut sum: u64,
    bounce: &mut [u8],
) -> Result<u64> {
    let dma = s.port.dma();
    lock(&s.flight).pinning = true;
    let result = (|| -> Result<u64> {
        let bufs = [
            SgBuf {
                iova: Iova(src),
                len: n,
                prot: Prot::READ,
            },
            SgBuf {
                iova: Iova(dst),
                len: n,
                prot: Prot::WRITE,
            },
        ];
        let guard = match dma.pin_sg(&bufs)? {
            SgWalk::Held(guard) => guard,
            SgWalk::Missed(m) => {
                // Checked mapped just before; unmapped since (the range closed under us).
                return Err(memvisor::Error::Fault {
                    space: "iova",
                    addr: m[0].iova.0,
                    start: m[0].iova.0,
                    len: n,
                }
                .into());
            }
        };
        record_pin(s, guard.buffer_pages(0..1) as usize);
        record_pin(s, guard.buffer_pages(1..2) as usize);
        let (mut from, mut to) = (
            guard.buffer(0).iter().copied(),
            guard.buffer(1).iter().copied(),
        );
        let (mut sseg, mut dseg) = (from.next(), to.next());
        let mut off = 0u64;
        while let (Some(a), Some(b)) = (sseg, dseg) {
            // One piece inside one host segment of each side.
            let k = a.len.min(b.len).min(bounce.len() as u64);
            let buf = &mut bounce[..k as usize];
            // SAFETY: `a.hva .. a.hva + k` lies in a source segment the guard holds pinned
            // until it drops, after the copy.
            unsafe { read_pinned(a.hva, buf) };
            sum = fnv1a(sum, buf);
            // SAFETY: `b.hva .. b.hva + k` lies in a destination segment pinned with WRITE.
            unsafe { write_pinned(buf, b.hva) };
            off += k;
            let rest = |s: Segment| {
                (s.len > k).then(|| Segment {
                    hva: Hva(s.hva.0 + k),
                    len: s.len - k,
                })
            };
            sseg = rest(a).or_else(|| from.next());
            dseg = rest(b).or_else(|| to.next());
        }
        debug_assert_eq!(off, n);
        Ok(sum)
    })();
    let mut f = lock(&s.flight);
    f.pinning = false;
    s.changed.notify_all();
    result
}
