//! `memvisor bench report`: seed 004b, free page reporting on the host side.
//!
//! Seed 004b (Linux's `mm/page_reporting` with `virtio_balloon`) lets a guest hand free blocks of
//! its memory back to the host: up to 32 blocks of 2 MiB (`pageblock_order`) per report, each
//! report acknowledged before the guest reuses the blocks. The host's work is [`Discarder::report`]:
//! drop the memory behind every block, except pages pinned for DMA. This experiment reports
//! 1 GiB (`--quick`; 4 GiB with `--full` where memory allows) of populated guest memory that way,
//! for four kinds of backing — private anonymous 4 KiB (with `MADV_NOHUGEPAGE`, so 4 KiB also
//! where THP is "always"), THP (`MADV_HUGEPAGE`, 2 MiB aligned), a memfd (shared, 4 KiB) and
//! hugetlbfs 2 MiB (huge pages reserved for the run; skipped with the reason when that fails) —
//! one slot table per kind, the backing as its one slot.
//!
//! Every run of every variant starts from the same state, every page resident and dirty: the
//! whole backing dropped, then populated with a non-zero pattern word per 4 KiB page (untimed;
//! the variant after `discard` starts from the refault touch, which faulted every page back
//! in); then resident bytes are read, the discard is timed, and resident bytes are read again. Resident bytes are what the kernel says: smaps `Rss`
//! of the mapping for private anonymous and THP memory, smaps `Private_Hugetlb + Shared_Hugetlb`
//! for hugetlbfs (hugetlb pages are not in `Rss`), the memfd's allocated blocks (`st_blocks`).
//! Variants:
//!
//! - `discard`: `Discarder::report`, 32 blocks of 2 MiB per call, until the whole range is
//!   reported;
//! - `balloon queue`: the same reports through the virtio-balloon device ([`Balloon`]): the
//!   guest's ring gets each report as a chain of 32 buffers, the device pops and checks it, hands
//!   it to the discarder and returns it used; the gap to `discard` is the queue's cost;
//! - `discard, 10% pinned`: the same with a tenth of the memory pinned first through a Lazy
//!   [`DmaSpace`] (`pin_pages`) on a registry the discarder shares: every tenth 4 KiB page for the
//!   4 KiB kinds (runs of a few pages every tenth run if one-page runs would need more memory
//!   areas than `vm.max_map_count` allows: each locked run is an area of its own), one 4 KiB page
//!   in every tenth 2 MiB unit for THP and hugetlbfs, where a pin keeps its whole huge page. The
//!   run checks that exactly the pinned bytes were skipped, that every byte of the pinned memory
//!   kept its pattern (an error otherwise) and that everything else was reclaimed;
//! - `MADV_FREE` (private anonymous and THP): the discarder with `use_madv_free`; resident bytes
//!   stay until the kernel reclaims, so the run reads smaps `LazyFree` too;
//! - `floor (one syscall)` and `floor (2 MiB steps)`: the raw system calls memvisor makes —
//!   `madvise(MADV_DONTNEED)` for private memory, `fallocate(PUNCH_HOLE|KEEP_SIZE)` for the memfd
//!   and hugetlbfs — once over the whole range, and once per 2 MiB block. The discarder joins
//!   a report's touching blocks and makes one call per 2 MiB of 4 KiB memory (the second floor's
//!   calls, so the gap to it is memvisor's bookkeeping) or per 64 MiB of huge pages.
//!
//! The seed's own numbers are guest page-fault benchmarks: what reported memory costs when the
//! guest touches it again. The refault table times one volatile byte write per 4 KiB page over
//! resident memory (no fault), after `discard` (a fault that maps a zeroed page — or a zeroed
//! 2 MiB huge page for THP and hugetlbfs) and after `MADV_FREE` without memory pressure (the
//! page is still there: no fault, no zeroing). Target (checked and printed, not asserted):
//! discarding a 1 GiB report of 4 KiB private anonymous memory at 10 GB/s or more, and
//! everything not pinned reclaimed. Rows carry medians over runs; a metric whose median is zero
//! (resident bytes after a full discard, say) is shown in the table but not emitted as a row.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use memvisor::balloon::guest::GuestRing;
use memvisor::balloon::{Balloon, VIRTIO_BALLOON_F_REPORTING, VIRTIO_F_VERSION_1};
use memvisor::dma::{LockLimit, PIN_PAGES_MAX, PinMode, PinRegistry};
use memvisor::{
    Backing, BackingKind, BackingOptions, DiscardOptions, Discarder, DmaConfig, DmaSpace, Gpa,
    Iova, PageSize, Prot, SlotSpace, SlotSpec, SlotTable,
};

use super::hugepages::{self, Reservation};
use super::seeds::{SEED_004B, Seed};
use super::{Better, Chart, ChartGroup, Ctx, Experiment, Mode, Outcome, Row, Stats, Table, limits};

pub struct PageReport;

use memvisor::PAGE_4K as PAGE;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// One reported block: order 9, Linux's `pageblock_order` on x86-64.
const BLOCK: u64 = 2 * MIB;
/// Blocks per report: Linux's `PAGE_REPORTING_CAPACITY`.
const BLOCKS_PER_REPORT: usize = 32;
/// Where guest RAM starts: above 4 GiB, as on a PC with a PCI hole below.
const BASE: u64 = 4 * GIB;
/// Where the balloon's ring lives in guest memory, and its size.
const RING: u64 = 0;
const QUEUE_SIZE: u16 = 64;
/// One pinned unit in this many.
const PIN_EVERY: u64 = 10;

/// The target for 4 KiB private anonymous memory, GB/s.
const TARGET_GBPS: f64 = 10.0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Anon4K,
    Thp,
    Memfd,
    Hugetlb,
}

const KINDS: [Kind; 4] = [Kind::Anon4K, Kind::Thp, Kind::Memfd, Kind::Hugetlb];

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Anon4K => "4 KiB private anon",
            Kind::Thp => "THP",
            Kind::Memfd => "memfd",
            Kind::Hugetlb => "hugetlbfs 2 MiB",
        }
    }

    fn backing_kind(self) -> BackingKind {
        match self {
            Kind::Anon4K => BackingKind::PrivateAnon,
            Kind::Thp => BackingKind::Thp,
            Kind::Memfd => BackingKind::Memfd,
            Kind::Hugetlb => BackingKind::Hugetlb(PageSize::Size2M),
        }
    }

    /// Private memory is discarded with madvise, file-backed memory by punching holes.
    fn private(self) -> bool {
        matches!(self, Kind::Anon4K | Kind::Thp)
    }

    /// What one pin keeps resident: a 4 KiB page, or the whole huge page around it.
    fn unit(self) -> u64 {
        match self {
            Kind::Anon4K | Kind::Memfd => PAGE,
            Kind::Thp | Kind::Hugetlb => PageSize::Size2M.bytes(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Discard,
    Queue,
    Pinned,
    MadvFree,
    Floor,
    FloorSteps,
}

const VARIANTS: [Variant; 6] = [
    Variant::Discard,
    Variant::Queue,
    Variant::Pinned,
    Variant::MadvFree,
    Variant::Floor,
    Variant::FloorSteps,
];

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Discard => "discard",
            Variant::Queue => "balloon queue",
            Variant::Pinned => "discard, 10% pinned",
            Variant::MadvFree => "MADV_FREE",
            Variant::Floor => "floor (one syscall)",
            Variant::FloorSteps => "floor (2 MiB steps)",
        }
    }

    fn applies_to(self, kind: Kind) -> bool {
        self != Variant::MadvFree || kind.private()
    }
}

/// One kind of guest memory: the backing, its slot table and the pin registry the discarder
/// and the pins share. Fields drop in order, so the backing is unmapped before the huge page
/// pool shrinks back.
struct Guest {
    kind: Kind,
    backing: Arc<Backing>,
    slots: SlotTable,
    registry: Arc<PinRegistry>,
    _pool: Option<Reservation>,
}

impl Guest {
    fn new(kind: Kind, size: u64) -> Result<Guest, String> {
        let pool = match kind {
            Kind::Hugetlb => {
                let pages = size / PageSize::Size2M.bytes();
                hugepages::pool(pages)?
            }
            _ => None,
        };
        let backing = Backing::with_options(
            kind.backing_kind(),
            size,
            &BackingOptions { populate: false },
        )
        .map_err(|e| e.to_string())?;
        if kind == Kind::Anon4K {
            // SAFETY: the range is exactly the backing's live mapping; the hint changes how the
            // kernel backs it, never its contents or the mapping itself.
            let rc = unsafe {
                libc::madvise(
                    backing.as_ptr().cast(),
                    size as usize,
                    libc::MADV_NOHUGEPAGE,
                )
            };
            if rc != 0 {
                return Err(format!(
                    "madvise(MADV_NOHUGEPAGE): {}",
                    std::io::Error::last_os_error()
                ));
            }
        }
        let backing = Arc::new(backing);
        let slots = SlotTable::new();
        let ring = Backing::new(
            BackingKind::PrivateAnon,
            GuestRing::bytes(QUEUE_SIZE).next_multiple_of(PAGE),
        )
        .map_err(|e| e.to_string())?;
        slots
            .insert(SlotSpec::new(0, Gpa(BASE), backing.clone()))
            .and_then(|()| slots.insert(SlotSpec::new(1, Gpa(RING), Arc::new(ring))))
            .map_err(|e| e.to_string())?;
        Ok(Guest {
            kind,
            backing,
            slots,
            registry: PinRegistry::new(LockLimit::Unlimited),
            _pool: pool,
        })
    }

    fn size(&self) -> u64 {
        self.backing.size()
    }

    fn discarder(&self, use_madv_free: bool) -> Discarder {
        Discarder::with_options(
            &self.slots,
            DiscardOptions {
                registry: Some(self.registry.clone()),
                use_madv_free,
            },
        )
    }

    /// A negotiated balloon device and the guest's ring, set up.
    fn balloon(&self) -> anyhow::Result<(Balloon, GuestRing)> {
        let options = DiscardOptions {
            registry: Some(self.registry.clone()),
            use_madv_free: false,
        };
        let mut dev = Balloon::new(SlotSpace::new(self.slots.clone()), options, QUEUE_SIZE)?;
        dev.ack_features(1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BALLOON_F_REPORTING)?;
        let ring = GuestRing::new(&self.slots, Gpa(RING), QUEUE_SIZE)?;
        ring.configure(dev.queue_mut());
        Ok((dev, ring))
    }

    /// The raw discard of `[offset, offset + len)` of the backing: one system call.
    fn raw_discard(&self, offset: u64, len: u64) -> anyhow::Result<()> {
        let rc = if self.kind.private() {
            // SAFETY: the range lies inside the backing's live mapping; MADV_DONTNEED changes
            // the pages' contents to zeros, never the mapping, and nothing here holds a Rust
            // reference into it.
            unsafe {
                libc::madvise(
                    self.backing.as_ptr().add(offset as usize).cast(),
                    len as usize,
                    libc::MADV_DONTNEED,
                )
            }
        } else {
            let fd = self
                .backing
                .fd()
                .ok_or_else(|| anyhow::anyhow!("{} backing without a file", self.kind.label()))?;
            // SAFETY: fallocate only changes the file behind our own descriptor, inside its
            // size; the mapping stays valid and reads the hole as zeros.
            unsafe {
                libc::fallocate(
                    fd.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            }
        };
        if rc != 0 {
            anyhow::bail!(
                "{} of {} at {offset:#x}+{len:#x}: {}",
                if self.kind.private() {
                    "madvise(MADV_DONTNEED)"
                } else {
                    "fallocate(PUNCH_HOLE)"
                },
                self.kind.label(),
                std::io::Error::last_os_error()
            );
        }
        Ok(())
    }

    /// Drops everything, then faults every page in and writes the pattern word at the start of
    /// every 4 KiB page: the state every run starts from.
    fn repopulate(&self) -> anyhow::Result<()> {
        self.raw_discard(0, self.size())?;
        self.backing.populate()?;
        let p = self.backing.as_ptr();
        for page in 0..self.size() / PAGE {
            // SAFETY: page * PAGE < size, so the 8 aligned bytes lie inside the live mapping;
            // a raw volatile write, no reference to guest memory is formed.
            unsafe {
                p.add((page * PAGE) as usize)
                    .cast::<u64>()
                    .write_volatile(word(page))
            };
        }
        Ok(())
    }

    /// Writes every 8 bytes of the 4 KiB pages `[first, first + n)` with their pattern word.
    fn fill_pages(&self, first: u64, n: u64) {
        let p = self.backing.as_ptr();
        for page in first..first + n {
            for w in 0..PAGE / 8 {
                // SAFETY: the page lies inside the backing (callers pass pages below
                // size / PAGE); raw aligned volatile write, no reference.
                unsafe {
                    p.add((page * PAGE + w * 8) as usize)
                        .cast::<u64>()
                        .write_volatile(word(page))
                };
            }
        }
    }

    /// The first page of `[first, first + n)` whose bytes are not all its pattern word, and
    /// the word found there.
    fn check_pages(&self, first: u64, n: u64) -> Option<(u64, u64)> {
        let p = self.backing.as_ptr();
        for page in first..first + n {
            for w in 0..PAGE / 8 {
                // SAFETY: as in fill_pages; a raw volatile read.
                let got = unsafe {
                    p.add((page * PAGE + w * 8) as usize)
                        .cast::<u64>()
                        .read_volatile()
                };
                if got != word(page) {
                    return Some((page, got));
                }
            }
        }
        None
    }

    /// Resident bytes of the backing, as the kernel counts them for this kind.
    fn resident(&self) -> anyhow::Result<u64> {
        match self.kind {
            Kind::Anon4K | Kind::Thp => Ok(self.smaps(&["Rss"])?[0]),
            Kind::Hugetlb => Ok(self
                .smaps(&["Private_Hugetlb", "Shared_Hugetlb"])?
                .iter()
                .sum()),
            Kind::Memfd => {
                let fd = self
                    .backing
                    .fd()
                    .ok_or_else(|| anyhow::anyhow!("memfd backing without a file"))?;
                // SAFETY: an all-zero `struct stat` is a valid value for fstat to overwrite.
                let mut st: libc::stat = unsafe { std::mem::zeroed() };
                // SAFETY: fstat writes one struct stat we own; the fd lives as long as the
                // backing.
                if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
                    anyhow::bail!("fstat(memfd): {}", std::io::Error::last_os_error());
                }
                Ok(st.st_blocks as u64 * 512)
            }
        }
    }

    /// The smaps `fields`, in bytes, summed over the memory areas of the backing.
    fn smaps(&self, fields: &[&str]) -> anyhow::Result<Vec<u64>> {
        let start = self.backing.hva().0;
        smaps_sum(start, start + self.size(), fields)
    }
}

/// The pattern word of 4 KiB page `page`: never zero, different for neighbouring pages.
fn word(page: u64) -> u64 {
    (page + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// `fields` (size lines such as `Rss`, in KiB there) summed over the areas of /proc/self/smaps
/// that overlap `[start, end)`, in bytes.
fn smaps_sum(start: u64, end: u64, fields: &[&str]) -> anyhow::Result<Vec<u64>> {
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut sums = vec![0u64; fields.len()];
    let mut inside = false;
    for line in smaps.lines() {
        let area = line
            .split_once(' ')
            .and_then(|(range, _)| range.split_once('-'))
            .and_then(|(s, e)| {
                Some((
                    u64::from_str_radix(s, 16).ok()?,
                    u64::from_str_radix(e, 16).ok()?,
                ))
            });
        if let Some((s, e)) = area {
            inside = s < end && start < e;
            continue;
        }
        if !inside {
            continue;
        }
        if let Some((name, value)) = line.split_once(':') {
            if let Some(i) = fields.iter().position(|f| *f == name) {
                let kib: u64 = value.trim().trim_end_matches("kB").trim().parse()?;
                sums[i] += kib * 1024;
            }
        }
    }
    Ok(sums)
}

/// The whole guest as the guest's driver reports it: 2 MiB blocks, 32 to a report.
fn report_batches(size: u64) -> Vec<Vec<(Gpa, u64)>> {
    let blocks: Vec<(Gpa, u64)> = (0..size)
        .step_by(BLOCK as usize)
        .map(|at| (Gpa(BASE + at), BLOCK.min(size - at)))
        .collect();
    blocks
        .chunks(BLOCKS_PER_REPORT)
        .map(<[_]>::to_vec)
        .collect()
}

/// Reports the whole guest as the guest's driver would: 32 blocks of 2 MiB per report.
/// Returns bytes discarded, skipped because pinned, and the seconds it took; any refused byte
/// is an error (the memory here is all discardable).
fn report_all(d: &Discarder, size: u64) -> anyhow::Result<(u64, u64, f64)> {
    let (mut discarded, mut skipped) = (0, 0);
    let mut refused = Vec::new();
    let reports = report_batches(size);
    let start = Instant::now();
    for ranges in &reports {
        let out = d.report(ranges);
        discarded += out.discarded;
        skipped += out.skipped_pinned;
        refused.extend(out.rejected);
    }
    let secs = start.elapsed().as_secs_f64();
    if let Some(r) = refused.first() {
        let bytes: u64 = refused.iter().map(|r| r.len).sum();
        anyhow::bail!(
            "the reports refused {bytes} bytes, first {:#x}+{:#x}: {}",
            r.gpa.0,
            r.len,
            r.reason
        );
    }
    Ok((discarded, skipped, secs))
}

/// The same reports as [`report_all`], through the virtio-balloon device: for each, the guest
/// puts its 32 blocks on the ring as one chain, and the device pops, checks and discards it and
/// returns it used. The time includes the guest's ring writes (a few hundred bytes a report).
fn report_via_queue(g: &Guest, size: u64) -> anyhow::Result<(u64, u64, f64)> {
    let (mut dev, mut ring) = g.balloon()?;
    let reports: Vec<Vec<(u64, u32)>> = report_batches(size)
        .iter()
        .map(|r| r.iter().map(|&(gpa, len)| (gpa.0, len as u32)).collect())
        .collect();
    let start = Instant::now();
    for bufs in &reports {
        let head = ring.add_inbuf(bufs)?;
        ring.publish(head)?;
        let done = dev.process_queue()?;
        if ring.get_used()? != Some((head, 0)) {
            anyhow::bail!("the balloon did not return report {head}");
        }
        for c in done.chains {
            if let Err(e) = c.result {
                anyhow::bail!("the balloon refused report {}: {e}", c.head);
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let stats = dev.stats();
    if stats.rejected != 0 {
        anyhow::bail!("the balloon's discards refused {} bytes", stats.rejected);
    }
    Ok((stats.discarded, stats.skipped_pinned, secs))
}

/// Page faults this process has taken that needed no I/O (`ru_minflt`).
fn minor_faults() -> u64 {
    // SAFETY: an all-zero `struct rusage` is a valid value for getrusage to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes one struct rusage we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    usage.ru_minflt as u64
}

/// Writes one byte into every 4 KiB page of `b`, in address order: ns per page, and page
/// faults per page.
fn touch_pages(b: &Backing) -> (f64, f64) {
    let p = b.as_ptr();
    let pages = b.size() / PAGE;
    let faults = minor_faults();
    let start = Instant::now();
    for page in 0..pages {
        // SAFETY: page * PAGE + 8 < size: inside the live mapping; a raw volatile write (past
        // the pattern word), no reference to guest memory.
        unsafe { p.add((page * PAGE + 8) as usize).write_volatile(0x5a) };
    }
    let ns = start.elapsed().as_nanos() as f64 / pages as f64;
    (ns, (minor_faults() - faults) as f64 / pages as f64)
}

/// Where the pins of the pinned variant go: runs of `(first 4 KiB page, pages)` that must keep
/// their bytes, and the pages handed to `pin_pages`.
struct PinPlan {
    kept: Vec<(u64, u64)>,
    pins: Vec<u64>,
    /// "every 10th 4 KiB page", ...
    what: String,
}

impl PinPlan {
    fn kept_bytes(&self) -> u64 {
        self.kept.iter().map(|&(_, n)| n * PAGE).sum()
    }
}

/// Memory areas this process may still create, with room to spare for everything else.
fn spare_map_areas() -> u64 {
    let max: u64 = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(65530);
    let used = std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count() as u64)
        .unwrap_or(0);
    max.saturating_sub(used).saturating_sub(4096)
}

fn pin_plan(kind: Kind, size: u64) -> PinPlan {
    let unit_pages = kind.unit() / PAGE;
    if unit_pages > 1 {
        // One 4 KiB page in the middle of every tenth huge page: the pin keeps all of it.
        let units = size / kind.unit();
        let chosen: Vec<u64> = (0..units).step_by(PIN_EVERY as usize).collect();
        return PinPlan {
            kept: chosen
                .iter()
                .map(|&u| (u * unit_pages, unit_pages))
                .collect(),
            pins: chosen
                .iter()
                .map(|&u| u * unit_pages + unit_pages / 2)
                .collect(),
            what: "one 4 KiB page in every 10th 2 MiB unit (each keeps its huge page)".into(),
        };
    }
    // Every tenth page, or runs of `run` pages every tenth run: each locked run splits the
    // mapping into two more areas, and the kernel allows only vm.max_map_count of them.
    let pages = size / PAGE;
    let budget = spare_map_areas().max(2);
    let mut run = 1;
    while 2 * pages.div_ceil(PIN_EVERY * run) > budget {
        run *= 2;
    }
    let kept: Vec<(u64, u64)> = (0..pages)
        .step_by((PIN_EVERY * run) as usize)
        .map(|p| (p, run.min(pages - p)))
        .collect();
    let pins = kept.iter().flat_map(|&(p, n)| p..p + n).collect();
    let what = if run == 1 {
        "every 10th 4 KiB page".to_string()
    } else {
        format!("runs of {run} 4 KiB pages, every 10th run (vm.max_map_count)")
    };
    PinPlan { kept, pins, what }
}

/// Pins `plan` through a Lazy DMA space on the guest's registry; the space holds the pins until
/// it is unpinned.
fn pin(g: &Guest, plan: &PinPlan) -> anyhow::Result<DmaSpace> {
    let dma = DmaSpace::new(DmaConfig {
        pin_mode: PinMode::Lazy,
        registry: Some(g.registry.clone()),
        ..DmaConfig::default()
    })?;
    dma.map_backing(Iova(0), &g.backing, 0, g.size(), Prot::RW)?;
    for pages in plan.pins.chunks(PIN_PAGES_MAX) {
        dma.pin_pages(pages, Prot::RW)?;
    }
    Ok(dma)
}

fn unpin(dma: &DmaSpace, plan: &PinPlan) -> anyhow::Result<()> {
    for pages in plan.pins.chunks(PIN_PAGES_MAX) {
        dma.unpin_pages(pages)?;
    }
    dma.unmap_all()?;
    Ok(())
}

/// The samples of one variant on one kind.
#[derive(Default)]
struct Samples {
    secs: Vec<f64>,
    metrics: BTreeMap<&'static str, Vec<f64>>,
}

impl Samples {
    fn push(&mut self, metric: &'static str, value: f64) {
        self.metrics.entry(metric).or_default().push(value);
    }

    fn median(&self, metric: &str) -> Option<f64> {
        self.metrics
            .get(metric)
            .map(|s| Stats::from_samples(s).median)
    }

    fn gbps(&self, size: u64) -> Stats {
        let gb = size as f64 / 1e9;
        let s = Stats::from_samples(&self.secs);
        Stats {
            median: gb / s.median,
            min: gb / s.max,
            max: gb / s.min,
            runs: s.runs,
        }
    }
}

const RESIDENT_BEFORE: &str = "resident before";
const RESIDENT_AFTER: &str = "resident after";
const DISCARDED: &str = "discarded";
const SKIPPED: &str = "skipped pinned";
const PINNED: &str = "pinned";
const LAZY_FREE: &str = "LazyFree";
const TOUCH_RESIDENT: &str = "touch resident";
const TOUCH_DISCARDED: &str = "touch after discard";
const TOUCH_FREED: &str = "touch after MADV_FREE";

/// What one kind measured: samples per variant, and refault samples.
struct KindResult {
    variants: Vec<(Variant, Samples)>,
    touch: Samples,
    /// Page faults per 4 KiB page while touching, by touch.
    faults_after: Samples,
    plan_what: String,
    /// Runs where skipped bytes differed from the pinned bytes: (skipped, pinned).
    skip_mismatch: Vec<(u64, u64)>,
    /// AnonHugePages before the discard, THP only: (min, max) over runs.
    thp_backed: Option<(u64, u64)>,
    /// Why the pinned variant did not run, if it did not.
    pins_skipped: Option<String>,
}

fn measure_kind(
    g: &Guest,
    runs: u32,
    progress: &mut super::Progress,
) -> anyhow::Result<KindResult> {
    let size = g.size();
    let plan = pin_plan(g.kind, size);
    // The pins mlock what they keep: without root, RLIMIT_MEMLOCK must cover it.
    let pins_skipped = limits::check_lock(plan.kept_bytes()).err().map(|why| {
        progress.inc(u64::from(runs));
        format!("{}, {}: {why}", g.kind.label(), Variant::Pinned.name())
    });
    let mut variants: Vec<(Variant, Samples)> = VARIANTS
        .iter()
        .filter(|v| v.applies_to(g.kind))
        .filter(|&&v| v != Variant::Pinned || pins_skipped.is_none())
        .map(|&v| (v, Samples::default()))
        .collect();
    let mut touch = Samples::default();
    let mut faults_after = Samples::default();
    let mut skip_mismatch = Vec::new();
    let mut thp_backed: Option<(u64, u64)> = None;
    let mib = |b: u64| b as f64 / MIB as f64;
    for _ in 0..runs {
        // Whether every page is resident and dirty already: the refault touch after `discard`
        // faults all of them back in, so the variant after it need not populate again.
        let mut populated = false;
        // Variants interleave within a run, so slow phases of a noisy host hit all of them.
        for (variant, samples) in &mut variants {
            if !std::mem::take(&mut populated) {
                g.repopulate()?;
            }
            if *variant == Variant::Discard {
                touch.push(TOUCH_RESIDENT, touch_pages(&g.backing).0);
            }
            // Read before pinning (a pin of resident memory changes nothing resident): with
            // every tenth 4 KiB page locked, smaps lists tens of thousands of areas.
            let before = g.resident()?;
            let pins = if *variant == Variant::Pinned {
                for &(first, n) in &plan.kept {
                    g.fill_pages(first, n);
                }
                Some(pin(g, &plan).map_err(|e| {
                    anyhow::anyhow!(
                        "{}: pinning {} MiB ({}): {e:#} (pins mlock: they need \
                         CAP_IPC_LOCK or a high enough RLIMIT_MEMLOCK)",
                        g.kind.label(),
                        plan.kept_bytes() / MIB,
                        plan.what
                    )
                })?)
            } else {
                None
            };
            if g.kind == Kind::Thp && *variant == Variant::Discard {
                let huge = g.smaps(&["AnonHugePages"])?[0];
                thp_backed =
                    Some(thp_backed.map_or((huge, huge), |(lo, hi)| (lo.min(huge), hi.max(huge))));
            }
            let (discarded, skipped, secs) = match variant {
                Variant::Discard | Variant::Pinned => report_all(&g.discarder(false), size)?,
                Variant::Queue => report_via_queue(g, size)?,
                Variant::MadvFree => report_all(&g.discarder(true), size)?,
                Variant::Floor => {
                    let start = Instant::now();
                    g.raw_discard(0, size)?;
                    (size, 0, start.elapsed().as_secs_f64())
                }
                Variant::FloorSteps => {
                    let start = Instant::now();
                    for off in (0..size).step_by(BLOCK as usize) {
                        g.raw_discard(off, BLOCK.min(size - off))?;
                    }
                    (size, 0, start.elapsed().as_secs_f64())
                }
            };
            let after = g.resident()?;
            samples.secs.push(secs);
            samples.push(RESIDENT_BEFORE, mib(before));
            samples.push(RESIDENT_AFTER, mib(after));
            samples.push(DISCARDED, mib(discarded));
            match variant {
                Variant::Discard => {
                    let (ns, faults) = touch_pages(&g.backing);
                    touch.push(TOUCH_DISCARDED, ns);
                    faults_after.push(TOUCH_DISCARDED, faults);
                    populated = true;
                }
                Variant::MadvFree => {
                    samples.push(LAZY_FREE, mib(g.smaps(&[LAZY_FREE])?[0]));
                    let (ns, faults) = touch_pages(&g.backing);
                    touch.push(TOUCH_FREED, ns);
                    faults_after.push(TOUCH_FREED, faults);
                }
                Variant::Pinned => {
                    let kept = plan.kept_bytes();
                    samples.push(SKIPPED, mib(skipped));
                    samples.push(PINNED, mib(kept));
                    if skipped != kept {
                        skip_mismatch.push((skipped, kept));
                    }
                    for &(first, n) in &plan.kept {
                        if let Some((page, got)) = g.check_pages(first, n) {
                            anyhow::bail!(
                                "{}: pinned 4 KiB page {page} lost its content across a report \
                                 (found {got:#x}, wrote {:#x})",
                                g.kind.label(),
                                word(page)
                            );
                        }
                    }
                    if let Some(dma) = pins {
                        unpin(&dma, &plan)?;
                    }
                }
                Variant::Queue | Variant::Floor | Variant::FloorSteps => {}
            }
            progress.inc(1);
        }
    }
    // Leave nothing resident behind for the next kind.
    g.raw_discard(0, size)?;
    Ok(KindResult {
        variants,
        touch,
        faults_after,
        plan_what: plan.what,
        skip_mismatch,
        thp_backed,
        pins_skipped,
    })
}

/// Guest size for the mode: 1 GiB, or 4 GiB with `--full` when free memory holds it (one kind
/// is resident at a time); what was skipped and why; `Err` when not even 1 GiB fits.
fn guest_size(mode: Mode) -> Result<(u64, Option<String>), String> {
    limits::check_free(GIB).map_err(|why| format!("1 GiB per kind: {why}"))?;
    if mode == Mode::Quick {
        return Ok((GIB, None));
    }
    Ok(match limits::check_free(4 * GIB) {
        Ok(()) => (4 * GIB, None),
        Err(why) => (GIB, Some(format!("4 GiB per kind: {why}; ran 1 GiB"))),
    })
}

impl Experiment for PageReport {
    fn name(&self) -> &'static str {
        "report"
    }

    fn title(&self) -> &'static str {
        "Free page reporting, host side: discard GB/s, resident memory, pins kept"
    }

    fn about(&self) -> &'static str {
        "The host side only. 1 GiB \
         (4 GiB with --full) of populated guest memory — private anonymous 4 KiB, THP, memfd, \
         hugetlbfs 2 MiB — is reported as the guest driver does, 32 blocks of 2 MiB per \
         report, to Discarder::report; with nothing pinned, with 10% pinned through a DMA \
         space (pinned bytes must be skipped and keep their content), and with MADV_FREE for \
         private memory. One raw madvise/fallocate over the whole range, and one per 2 MiB, \
         are the floors. Resident bytes before and after come from smaps (Rss; \
         Private/Shared_Hugetlb for hugetlbfs) or the memfd's st_blocks. A second table times \
         touching the memory again: one byte per 4 KiB page, resident vs after discard (a \
         zero-filling fault) vs after MADV_FREE — the cost the seed's page_fault benchmarks \
         saw. Target: >= 10 GB/s discarding 4 KiB private anonymous memory; everything not \
         pinned reclaimed."
    }

    fn seeds(&self) -> &'static [Seed] {
        &[SEED_004B]
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(match ctx.mode {
            Mode::Quick => 3,
            Mode::Full => 5,
        });
        let mut out = Outcome::default();
        let size = match guest_size(ctx.mode) {
            Ok((size, smaller)) => {
                out.skipped.extend(smaller);
                size
            }
            Err(why) => {
                out.skipped.push(why);
                return Ok(out);
            }
        };
        let steps: u64 = KINDS
            .iter()
            .map(|&k| VARIANTS.iter().filter(|v| v.applies_to(k)).count() as u64)
            .sum::<u64>()
            * runs as u64;
        let mut progress = ctx.progress("report", steps);
        let mut results = Vec::new();
        for kind in KINDS {
            let n = VARIANTS.iter().filter(|v| v.applies_to(kind)).count() as u64;
            let guest = match Guest::new(kind, size) {
                Ok(g) => g,
                Err(why) => {
                    out.skipped.push(format!("{}: {why}", kind.label()));
                    progress.inc(n * runs as u64);
                    continue;
                }
            };
            let result = measure_kind(&guest, runs, &mut progress)?;
            out.skipped.extend(result.pins_skipped.clone());
            results.push((kind, result));
        }
        progress.finish();
        tables(&mut out, size, runs, &results);
        Ok(out)
    }
}

fn tables(out: &mut Outcome, size: u64, runs: u32, results: &[(Kind, KindResult)]) {
    let mib_size = size / MIB;
    let mut table = Table::new(
        &format!(
            "Discarding a {mib_size} MiB report, {BLOCKS_PER_REPORT} x 2 MiB blocks per report \
             (higher GB/s is better)"
        ),
        &[
            "memory",
            "variant",
            "GB/s",
            "ms",
            "resident before MiB",
            "resident after MiB",
            "discarded MiB",
            "skipped pinned MiB",
            "vs floor",
        ],
    );
    let mut pins = Table::new(
        "Pinned pages across a report (10% pinned)",
        &[
            "memory",
            "pinned",
            "pinned MiB",
            "skipped MiB",
            "skipped = pinned",
            "resident after MiB",
            "not pinned, still resident MiB",
            "pinned bytes kept",
        ],
    );
    let mut refault = Table::new(
        "Touching the memory again: ns per 4 KiB page, one byte written per page (lower is better)",
        &[
            "memory",
            "touch resident",
            "after discard",
            "after MADV_FREE",
            "discard overhead",
            "MADV_FREE overhead",
            "faults/page after discard",
            "faults/page after MADV_FREE",
        ],
    );
    let mut gbps_chart = Chart::new(
        &format!("Discarding {mib_size} MiB of reported free pages"),
        "memory",
        "GB/s discarded (1 GB = 1e9 bytes)",
        Better::Higher,
        true,
    );
    let mut touch_chart = Chart::new(
        "Touching memory again after it was given back",
        "memory",
        "ns per 4 KiB page touched",
        Better::Lower,
        true,
    );
    let gb = size as f64 / 1e9;
    for (kind, r) in results {
        let case = kind.label();
        let floor = r
            .variants
            .iter()
            .find(|(v, _)| *v == Variant::Floor)
            .map(|(_, s)| s.gbps(size).median);
        let mut bars = Vec::new();
        for (variant, s) in &r.variants {
            let rate = s.gbps(size);
            let time = Stats::from_samples(&s.secs);
            out.rows.push(Row::new(
                "report",
                case,
                variant.name(),
                "discard throughput",
                "GB/s",
                &rate,
            ));
            out.rows.push(Row::new(
                "report",
                case,
                variant.name(),
                "discard time",
                "s",
                &time,
            ));
            for (metric, samples) in &s.metrics {
                let stats = Stats::from_samples(samples);
                if stats.median > 0.0 {
                    out.rows.push(Row::new(
                        "report",
                        case,
                        variant.name(),
                        metric,
                        "MiB",
                        &stats,
                    ));
                }
            }
            let cell = |m: &str| s.median(m).map_or(String::new(), |v| format!("{v:.0}"));
            table.push(vec![
                case.into(),
                variant.name().into(),
                format!("{:.1}", rate.median),
                format!("{:.1}", time.median * 1e3),
                cell(RESIDENT_BEFORE),
                cell(RESIDENT_AFTER),
                cell(DISCARDED),
                cell(SKIPPED),
                floor.map_or(String::new(), |f| {
                    format!("{:.0}%", 100.0 * rate.median / f)
                }),
            ]);
            bars.push((variant.name().to_string(), gb / time.median));
            if *variant == Variant::Pinned {
                let (pinned, skipped, after) = (
                    s.median(PINNED).unwrap_or(0.0),
                    s.median(SKIPPED).unwrap_or(0.0),
                    s.median(RESIDENT_AFTER).unwrap_or(0.0),
                );
                pins.push(vec![
                    case.into(),
                    r.plan_what.clone(),
                    format!("{pinned:.1}"),
                    format!("{skipped:.1}"),
                    if r.skip_mismatch.is_empty() {
                        "yes".into()
                    } else {
                        format!("NO in {} of {runs} runs", r.skip_mismatch.len())
                    },
                    format!("{after:.1}"),
                    format!("{:.1}", after - pinned),
                    "yes (checked every byte)".into(),
                ]);
            }
        }
        gbps_chart.groups.push(ChartGroup {
            label: case.into(),
            bars,
        });
        let t = |m: &str| r.touch.median(m);
        for (metric, samples) in &r.touch.metrics {
            out.rows.push(Row::new(
                "report",
                case,
                metric,
                "touch",
                "ns per 4 KiB page",
                &Stats::from_samples(samples),
            ));
        }
        for (metric, samples) in &r.faults_after.metrics {
            let stats = Stats::from_samples(samples);
            if stats.median > 0.0 {
                out.rows.push(Row::new(
                    "report",
                    case,
                    metric,
                    "page faults",
                    "per 4 KiB page",
                    &stats,
                ));
            }
        }
        let ns = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.1}"));
        let faults = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.3}"));
        let over = |v: Option<f64>| match (v, t(TOUCH_RESIDENT)) {
            (Some(v), Some(base)) => format!("{:+.1} ns ({:.1}x)", v - base, v / base),
            _ => "n/a".into(),
        };
        refault.push(vec![
            case.into(),
            ns(t(TOUCH_RESIDENT)),
            ns(t(TOUCH_DISCARDED)),
            ns(t(TOUCH_FREED)),
            over(t(TOUCH_DISCARDED)),
            over(t(TOUCH_FREED)),
            faults(r.faults_after.median(TOUCH_DISCARDED)),
            faults(r.faults_after.median(TOUCH_FREED)),
        ]);
        touch_chart.groups.push(ChartGroup {
            label: case.into(),
            bars: [TOUCH_RESIDENT, TOUCH_DISCARDED, TOUCH_FREED]
                .iter()
                .filter_map(|m| t(m).map(|v| (m.to_string(), v)))
                .collect(),
        });
        if let Some((lo, hi)) = r.thp_backed {
            out.notes.push(format!(
                "THP: {}–{} MiB of the {mib_size} MiB were backed by transparent huge pages \
                 before the discard (smaps AnonHugePages)",
                lo / MIB,
                hi / MIB
            ));
        }
        for (skipped, pinned) in &r.skip_mismatch {
            out.notes.push(format!(
                "{case}: a run skipped {skipped} bytes as pinned, but {pinned} bytes were pinned"
            ));
        }
    }
    table.note = Some(format!(
        "{runs} runs; GB/s = reported bytes / s (1 GB = 1e9 bytes), also for the \
         pinned variant, which discards only 90% of them. Resident: smaps Rss of the mapping \
         (private anon, THP), smaps Private_Hugetlb + Shared_Hugetlb (hugetlbfs), st_blocks \
         (memfd). vs floor: GB/s as a share of one raw madvise(MADV_DONTNEED) / \
         fallocate(PUNCH_HOLE) over the whole range. The 2 MiB floor makes one call per reported \
         block; the discarder joins touching blocks and makes one call per 2 MiB of 4 KiB \
         memory (the same calls: the gap is memvisor's bookkeeping — slot lookup, the pin check \
         under the registry lock, the outcome) or per 64 MiB of huge pages. MADV_FREE leaves pages resident \
         until the kernel needs them: its resident-after is not a leak."
    ));
    pins.note = Some(
        "Pins go through a Lazy DMA space (pin_pages, 512 pages per call) on the registry the \
         discarder checks. 'not pinned, still resident' is resident after minus pinned bytes: \
         0 means everything not pinned was reclaimed. Every 8 bytes of the pinned memory are \
         compared with what was written before the report; any difference stops the experiment \
         with an error."
            .into(),
    );
    refault.note = Some(
        "One volatile byte write per 4 KiB page in address order. After discard every \
         page faults and the kernel zero-fills it (for THP and hugetlbfs one 2 MiB huge page per \
         512 pages, the cost spread over them); after MADV_FREE without memory pressure the \
         pages are still there, so no fault and no zeroing (faults per page: the process's \
         minor faults during the touch) — what is left is the CPU setting again the accessed \
         and dirty bits MADV_FREE cleared, one page-table walk per 4 KiB page (two levels of \
         tables in a VM), nearly nothing per 2 MiB page. Seed 004b measured this cost inside \
         a guest: will-it-scale page_fault1 (THP) 1012402 -> 1010227 iterations and \
         page_fault2 361855 -> 359749 with reporting enabled (1 task), the loss it blames on \
         faults on reported pages and host zeroing, and less of it with MADV_FREE."
            .into(),
    );
    if let Some((_, r)) = results.iter().find(|(k, _)| *k == Kind::Anon4K) {
        let mut lines = Vec::new();
        if let Some((_, s)) = r.variants.iter().find(|(v, _)| *v == Variant::Discard) {
            let rate = s.gbps(size).median;
            lines.push(format!(
                "target: discard of a {mib_size} MiB report on 4 KiB private anonymous memory \
                 >= {TARGET_GBPS} GB/s: {rate:.1} GB/s, {}",
                if rate >= TARGET_GBPS { "met" } else { "MISSED" }
            ));
        }
        out.notes.extend(lines);
    }
    let leftovers: Vec<String> = results
        .iter()
        .flat_map(|(k, r)| {
            r.variants.iter().filter_map(move |(v, s)| {
                let kept = match v {
                    Variant::Discard => 0.0,
                    Variant::Pinned => s.median(PINNED)?,
                    _ => return None,
                };
                let left = s.median(RESIDENT_AFTER)? - kept;
                (left.abs() >= 1.0).then(|| format!("{}, {} ({left:.1} MiB)", k.label(), v.name()))
            })
        })
        .collect();
    out.notes.push(if leftovers.is_empty() {
        "target: everything not pinned reclaimed: met for every kind".into()
    } else {
        format!(
            "target: everything not pinned reclaimed: MISSED for {}",
            leftovers.join(", ")
        )
    });
    out.tables.push(table);
    if !pins.rows.is_empty() {
        out.tables.push(pins);
    }
    out.tables.push(refault);
    out.charts.push(("report-gbps".into(), gbps_chart));
    out.charts.push(("report-touch".into(), touch_chart));
}
