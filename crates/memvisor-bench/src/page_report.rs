//! `memvisor bench report`: "mm / virtio: Provide support for free page reporting" (seed 004b),
//! free page reporting on the host side.
//!
//! The series (Linux's `mm/page_reporting` with `virtio_balloon`) lets a guest hand free blocks of
//! its memory back to the host: up to 32 blocks of 2 MiB (`pageblock_order`) per report, each
//! report acknowledged before the guest reuses the blocks. The host's work is
//! [`Discarder::report`](memvisor::Discarder::report): drop the memory behind every block,
//! except pages pinned for DMA. This experiment reports
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
//! - `balloon queue`: the same reports through the virtio-balloon device
//!   ([`Balloon`](memvisor::balloon::Balloon)): the guest's ring gets each report as a chain of
//!   32 buffers, the device pops and checks it, hands it to the discarder and returns it used;
//!   the gap to `discard` is the queue's cost;
//! - `discard, 10% pinned`: the same with a tenth of the memory pinned first through a Lazy
//!   [`DmaSpace`](memvisor::DmaSpace) (`pin_pages`) on a registry the discarder shares: every tenth 4 KiB page for the
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
//!
//! This file runs the variants and keeps their samples; the guest memory, the reports and the
//! pins are in [`memory`], the tables, rows, charts and notes made from the samples in [`layout`].

mod layout;
mod memory;

use std::collections::BTreeMap;
use std::time::Instant;

use memvisor::{BackingKind, PageSize};

use super::seeds::{SEED_004B, Seed};
use super::{Ctx, Experiment, Mode, Outcome, Stats, limits};
use layout::tables;
use memory::{Guest, pin, pin_plan, report_all, report_via_queue, touch_pages, unpin, word};

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
