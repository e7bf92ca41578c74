//! The guest memory the page report experiment discards, and the ways it is discarded. A
//! [`Guest`] is one kind of backing mapped as guest RAM at 4 GiB (plus a small slot for the
//! balloon's ring), with the pin registry the discarder and the pins share; it can drop all of
//! its memory with the raw system call ([`Guest::raw_discard`]), populate it again with a
//! pattern word per 4 KiB page ([`Guest::repopulate`]), and say how much of it is resident as
//! the kernel counts it for the kind ([`Guest::resident`]).
//!
//! The reports themselves go as the guest's driver sends them, 32 blocks of 2 MiB each
//! ([`report_batches`]): straight to a [`Discarder`] ([`report_all`]) or through the
//! virtio-balloon device's queue ([`report_via_queue`]). [`touch_pages`] times the guest
//! touching its memory again. A [`PinPlan`] says which pages the pinned variant pins through a
//! DMA space ([`pin`], [`unpin`]) and which bytes must survive the report.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Instant;

use memvisor::balloon::{Balloon, VIRTIO_BALLOON_F_REPORTING, VIRTIO_F_VERSION_1};
use memvisor::dma::{LockLimit, PIN_PAGES_MAX, PinMode, PinRegistry};
use memvisor::{
    Backing, BackingKind, BackingOptions, DiscardOptions, Discarder, DmaConfig, DmaSpace, Gpa,
    Iova, PageSize, Prot, SlotSpace, SlotSpec, SlotTable,
};
use memvisor_testkit::guest_ring::GuestRing;

use super::{BASE, BLOCK, BLOCKS_PER_REPORT, Kind, PAGE, PIN_EVERY, QUEUE_SIZE, RING};
use crate::hugepages::{self, Reservation};

/// One kind of guest memory: the backing, its slot table and the pin registry the discarder
/// and the pins share. Fields drop in order, so the backing is unmapped before the huge page
/// pool shrinks back.
pub(super) struct Guest {
    pub(super) kind: Kind,
    pub(super) backing: Arc<Backing>,
    slots: SlotTable,
    pub(super) registry: Arc<PinRegistry>,
    _pool: Option<Reservation>,
}

impl Guest {
    pub(super) fn new(kind: Kind, size: u64) -> Result<Guest, String> {
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
            &BackingOptions {
                populate: false,
                ..Default::default()
            },
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

    pub(super) fn size(&self) -> u64 {
        self.backing.size()
    }

    pub(super) fn discarder(&self, use_madv_free: bool) -> Discarder {
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
    pub(super) fn raw_discard(&self, offset: u64, len: u64) -> anyhow::Result<()> {
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
    pub(super) fn repopulate(&self) -> anyhow::Result<()> {
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
    pub(super) fn fill_pages(&self, first: u64, n: u64) {
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
    pub(super) fn check_pages(&self, first: u64, n: u64) -> Option<(u64, u64)> {
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
    pub(super) fn resident(&self) -> anyhow::Result<u64> {
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
    pub(super) fn smaps(&self, fields: &[&str]) -> anyhow::Result<Vec<u64>> {
        let start = self.backing.hva().0;
        smaps_sum(start, start + self.size(), fields)
    }
}

/// The pattern word of 4 KiB page `page`: never zero, different for neighbouring pages.
pub(super) fn word(page: u64) -> u64 {
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
pub(super) fn report_all(d: &Discarder, size: u64) -> anyhow::Result<(u64, u64, f64)> {
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
pub(super) fn report_via_queue(g: &Guest, size: u64) -> anyhow::Result<(u64, u64, f64)> {
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
pub(super) fn touch_pages(b: &Backing) -> (f64, f64) {
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
pub(super) struct PinPlan {
    pub(super) kept: Vec<(u64, u64)>,
    pub(super) pins: Vec<u64>,
    /// "every 10th 4 KiB page", ...
    pub(super) what: String,
}

impl PinPlan {
    pub(super) fn kept_bytes(&self) -> u64 {
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

pub(super) fn pin_plan(kind: Kind, size: u64) -> PinPlan {
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
pub(super) fn pin(g: &Guest, plan: &PinPlan) -> anyhow::Result<DmaSpace> {
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

pub(super) fn unpin(dma: &DmaSpace, plan: &PinPlan) -> anyhow::Result<()> {
    for pages in plan.pins.chunks(PIN_PAGES_MAX) {
        dma.unpin_pages(pages)?;
    }
    dma.unmap_all()?;
    Ok(())
}
