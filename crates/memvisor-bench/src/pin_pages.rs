//! `memvisor bench pin-pages`: "vfio iommu type1: Improve vfio_iommu_type1_pin_pages
//! performance" (seed 002), grouping the pages of a `pin_pages` call into runs.
//!
//! An emulated device pins the pages it hands to asynchronous I/O with
//! `DmaSpace::pin_pages(&[iova page numbers], prot)`, at most 512 per call. The patch split each
//! call into runs of consecutive page numbers and pinned every run at once; its author measured
//! one call of 1 and of 512 pages, and a reviewer then showed from vfio-ccw traces that most
//! calls — and 87% of the runs inside them — are single pages. This experiment compares the
//! three `Grouping`s of the engine side by side, each in a `DmaSpace` of its own (own pin
//! registry, no lock limit) over the very same memory: `per-page` (the baseline), `runs` (split
//! first, then pin each run: the seed's patch) and `adaptive` (find runs while pinning).
//!
//! **Part 1, one call.** A `pin_pages` call of 1 page and of 512 contiguous pages (2 MiB
//! aligned, so one huge page on THP and hugetlbfs memory) on populated 4 KiB, THP and
//! hugetlbfs 2 MiB memory. Every timed call pins pages no one holds, so it takes the 0->1 path
//! (`mlock` of what is new — on THP and hugetlbfs the whole 2 MiB page); right after, `unpin_pages` takes
//! them back to 0 (`munlock`). Pin and unpin are timed separately, call by call, and the calls
//! rotate through a 64 MiB mapping so that consecutive calls touch different pages (and huge
//! pages). Every variant has its own backing, so nothing one variant does to the memory can
//! change what another measures; a note reports whether the THP backings kept their huge pages
//! (memvisor locks THP memory in whole huge pages so that they do). The seed's own kernel
//! figures are printed next to ours.
//!
//! **Part 2, replay.** The patch's two `@npage` histograms (BASE kernel: vfio-ccw guest boot, and
//! fio) drive a deterministic sequence of calls (xorshift PRNG, fixed seed): npage drawn from the
//! histogram, uniform inside a bucket. A multi-page call is cut into runs whose lengths are drawn
//! from the seed's `vfio_iommu_type1_pin_contiguous_pages` histogram less the single-page runs
//! that its single-page calls account for (the seed traced both on the same boot + fio run),
//! clipped to what is left of the call; the runs are placed at random, never touching each
//! other, in 256 MiB of populated 4 KiB memory. The replay keeps a queue of [`QUEUE`] outstanding calls, like a
//! device with queued I/O: call `i` is pinned, then call `i - QUEUE` unpinned. The generated
//! npage and run-length distributions are printed next to the seed's. A third workload replays
//! the npage histogram of memvisor's own vfio-user device (`mvdma`) in pin mode under a real
//! Linux guest (`guest/trial.sh vfio-user`): from this machine's last trial if there is one,
//! else the recording shipped in `data/mvdma-npage.txt`; there every call is one run. The
//! workloads and their histograms are in [`workload`].
//!
//! Parts 1 and 2 run with the pin registry's lock cache off, so every call locks and unlocks
//! as the seed's kernel path does. **Part 3** ([`one`]) measures the cache: one page pinned
//! and unpinned with and without it, beside the raw `mlock` + `munlock`, and the replays of
//! part 2 with and without it.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use memvisor::dma::{Grouping, LockLimit, PinRegistry};
use memvisor::{Backing, BackingKind, BackingOptions, DmaConfig, DmaSpace, Iova, PageSize, Prot};

use super::hugepages;
use super::seeds::{SEED_002, Seed};
use super::{
    Better, Chart, ChartGroup, Ctx, Experiment, Mode, Outcome, Row, Stats, Table, limits, ratio,
    ratio_cell,
};

#[path = "pin_one.rs"]
mod one;
mod workload;

use workload::{
    BOOT_NPAGE, Buckets, FIO_NPAGE, MULTI_RUNS, SEED_CALLS, SEED_RUNS, SEED_SINGLE_CALLS,
    hist_shares, mvdma_npage, replay_calls, run_lengths, shares,
};

pub struct PinPages;

const NAME: &str = "pin-pages";
use memvisor::PAGE_4K as PAGE;
const HUGE: u64 = 2 << 20;
/// 2 MiB chunks per part-1 backing: the 512-page calls rotate through them.
const CHUNKS: u64 = 16;
/// Part-1 backing size (32 MiB).
const CASE_SIZE: u64 = CHUNKS * HUGE;
/// Part-2 backing size.
const REPLAY_SIZE: u64 = 256 << 20;
/// Outstanding calls during the replay.
const QUEUE: usize = 4;
/// Replay calls per block in which the variants take turns (see [`interleaved`]).
const REPLAY_BLOCK: usize = 500;
/// Step between the pages of consecutive 1-page calls: odd, so every page comes up once per
/// 8192 calls, and more than 512, so consecutive calls land in different 2 MiB chunks.
const STRIDE: u64 = 517;

const VARIANTS: [(Grouping, &str); 3] = [
    (Grouping::PerPage, "per-page"),
    (Grouping::Runs, "runs"),
    (Grouping::Adaptive, "adaptive"),
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Memory {
    Small,
    Thp,
    Hugetlb,
}

impl Memory {
    fn label(self) -> &'static str {
        match self {
            Memory::Small => "4 KiB",
            Memory::Thp => "THP",
            Memory::Hugetlb => "hugetlbfs 2 MiB",
        }
    }

    fn kind(self) -> BackingKind {
        match self {
            Memory::Small => BackingKind::PrivateAnon,
            Memory::Thp => BackingKind::Thp,
            Memory::Hugetlb => BackingKind::Hugetlb(PageSize::Size2M),
        }
    }

    /// The seed's figures in ns, `[1 page, 512 pages]`, before and after the patch.
    fn seed(self) -> ([f64; 2], [f64; 2]) {
        match self {
            Memory::Small => ([1638.0, 223_651.0], [1735.0, 167_286.0]),
            Memory::Thp => ([1668.0, 222_330.0], [1934.0, 126_900.0]),
            Memory::Hugetlb => ([1526.0, 208_151.0], [1713.0, 102_188.0]),
        }
    }

    /// Bytes one call of `pages` pages locks: those pages, or on THP and hugetlbfs every huge
    /// page they touch (the calls here start on a huge page).
    fn locked_by(self, pages: u64) -> u64 {
        match self {
            Memory::Small => pages * PAGE,
            Memory::Thp | Memory::Hugetlb => (pages * PAGE).next_multiple_of(HUGE),
        }
    }

    /// The seed's row label.
    fn seed_label(self) -> &'static str {
        match self {
            Memory::Small => "no huge pages",
            Memory::Thp => "THP",
            Memory::Hugetlb => "HugeTLB",
        }
    }
}

/// One `DmaSpace` with its own registry and the given grouping, mapping all of `backing` at
/// IOVA 0. The registry's lock cache is off, so that every call locks what is new and every
/// unpin unlocks it, as the seed's kernel did (part 3 measures the cache).
fn space(grouping: Grouping, backing: &Arc<Backing>) -> anyhow::Result<DmaSpace> {
    let registry = PinRegistry::new(LockLimit::Unlimited);
    registry.set_lock_cache(0, 0);
    let dma = DmaSpace::new(DmaConfig {
        grouping,
        registry: Some(registry),
        ..Default::default()
    })?;
    dma.map_backing(Iova(0), backing, 0, backing.size(), Prot::RW)?;
    Ok(dma)
}

/// Pins each call of `calls` and unpins it right away; returns the ns spent pinning and
/// unpinning.
fn pin_then_unpin(dma: &DmaSpace, calls: &[Vec<u64>]) -> anyhow::Result<(u128, u128)> {
    let (mut pin, mut unpin) = (0u128, 0u128);
    for pages in calls {
        let t0 = Instant::now();
        let hvas = dma.pin_pages(pages, Prot::RW)?;
        let t1 = Instant::now();
        dma.unpin_pages(pages)?;
        let t2 = Instant::now();
        black_box(hvas);
        pin += (t1 - t0).as_nanos();
        unpin += (t2 - t1).as_nanos();
    }
    Ok((pin, unpin))
}

/// Replays `calls` with [`QUEUE`] calls outstanding, unpinning the last ones at the end;
/// returns the ns spent pinning and unpinning.
fn replay(dma: &DmaSpace, calls: &[Vec<u64>]) -> anyhow::Result<(u128, u128)> {
    let (mut pin, mut unpin) = (0u128, 0u128);
    for (i, pages) in calls.iter().enumerate() {
        let t0 = Instant::now();
        let hvas = dma.pin_pages(pages, Prot::RW)?;
        let t1 = Instant::now();
        black_box(hvas);
        if i >= QUEUE {
            dma.unpin_pages(&calls[i - QUEUE])?;
            unpin += t1.elapsed().as_nanos();
        }
        pin += (t1 - t0).as_nanos();
    }
    for pages in &calls[calls.len().saturating_sub(QUEUE)..] {
        let t = Instant::now();
        dma.unpin_pages(pages)?;
        unpin += t.elapsed().as_nanos();
    }
    Ok((pin, unpin))
}

/// The most bytes [`replay`] of `calls` holds pinned at once: [`QUEUE`] + 1 calls (at most: a
/// page in two of them is locked once).
fn peak_pinned(calls: &[Vec<u64>]) -> u64 {
    let pages = |w: &[Vec<u64>]| w.iter().map(Vec::len).sum::<usize>() as u64;
    calls
        .windows(QUEUE + 1)
        .map(pages)
        .max()
        .unwrap_or_else(|| pages(calls))
        * PAGE
}

/// How one variant goes through a list of calls: [`pin_then_unpin`] or [`replay`].
type Driver = fn(&DmaSpace, &[Vec<u64>]) -> anyhow::Result<(u128, u128)>;

/// Runs `calls` through every space of `spaces` (one per variant) in blocks of `block` calls,
/// the variants taking turns on each block (and a different one going first in each block), so
/// that a noisy neighbour or a drifting clock hits all of them alike. Returns per variant the
/// mean ns per call spent pinning and unpinning.
fn interleaved(
    spaces: &[DmaSpace],
    calls: &[Vec<u64>],
    block: usize,
    drive: Driver,
) -> anyhow::Result<Vec<(f64, f64)>> {
    let mut sums = vec![(0u128, 0u128); spaces.len()];
    for (b, chunk) in calls.chunks(block.max(1)).enumerate() {
        for k in 0..spaces.len() {
            let v = (b + k) % spaces.len();
            let (p, u) = drive(&spaces[v], chunk)?;
            sums[v].0 += p;
            sums[v].1 += u;
        }
    }
    let n = calls.len().max(1) as f64;
    Ok(sums
        .into_iter()
        .map(|(p, u)| (p as f64 / n, u as f64 / n))
        .collect())
}

/// Bytes of `backing` that THP currently maps with huge pages (smaps' AnonHugePages).
fn thp_bytes(backing: &Backing) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let (lo, hi) = (backing.hva().0, backing.hva().0 + backing.size());
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        if let Some(vma) = vma_range(line) {
            inside = vma.0 >= lo && vma.1 <= hi;
        } else if inside {
            if let Some(kb) = line.strip_prefix("AnonHugePages:") {
                let kb = kb.trim().trim_end_matches("kB").trim();
                total += kb.parse::<u64>().ok()? * 1024;
            }
        }
    }
    Some(total)
}

/// The `start-end` of an smaps header line (`7f..-7f.. rw-p ...`); `None` for other lines.
fn vma_range(line: &str) -> Option<(u64, u64)> {
    let (range, _) = line.split_once(' ')?;
    let (s, e) = range.split_once('-')?;
    Some((
        u64::from_str_radix(s, 16).ok()?,
        u64::from_str_radix(e, 16).ok()?,
    ))
}

/// One memory kind × call size of part 1, with a backing and a space per variant, so nothing
/// one variant does to its memory (such as splitting a THP's mapping) changes what the others
/// measure.
struct Case {
    memory: Memory,
    pages: u64,
    backings: Vec<Arc<Backing>>,
    spaces: Vec<DmaSpace>,
    /// Per variant: per-run mean ns of pin and of unpin.
    pin: Vec<Vec<f64>>,
    unpin: Vec<Vec<f64>>,
}

impl Case {
    fn new(memory: Memory, pages: u64) -> anyhow::Result<Case> {
        let mut backings = Vec::new();
        let mut spaces = Vec::new();
        for &(grouping, _) in &VARIANTS {
            let backing = Arc::new(Backing::with_options(
                memory.kind(),
                CASE_SIZE,
                &BackingOptions {
                    populate: true,
                    ..Default::default()
                },
            )?);
            spaces.push(space(grouping, &backing)?);
            backings.push(backing);
        }
        Ok(Case {
            memory,
            pages,
            backings,
            spaces,
            pin: vec![Vec::new(); VARIANTS.len()],
            unpin: vec![Vec::new(); VARIANTS.len()],
        })
    }

    /// MiB of each variant's backing that THP maps with huge pages now.
    fn thp_mib(&self) -> Option<Vec<u64>> {
        if self.memory != Memory::Thp {
            return None;
        }
        self.backings
            .iter()
            .map(|b| thp_bytes(b).map(|x| x >> 20))
            .collect()
    }

    fn label(&self) -> String {
        format!(
            "{}, {} page{}",
            self.memory.label(),
            self.pages,
            if self.pages == 1 { "" } else { "s" }
        )
    }

    /// The calls of run `run`: `iters` of them, each on pages the previous one did not touch.
    fn calls(&self, run: u64, iters: u64) -> Vec<Vec<u64>> {
        let total = CASE_SIZE / PAGE;
        (run * iters..(run + 1) * iters)
            .map(|g| {
                if self.pages == 1 {
                    vec![g * STRIDE % total]
                } else {
                    let first = g % CHUNKS * (HUGE / PAGE);
                    (first..first + self.pages).collect()
                }
            })
            .collect()
    }
}

impl Experiment for PinPages {
    fn name(&self) -> &'static str {
        NAME
    }

    fn title(&self) -> &'static str {
        "pin_pages for emulated devices: per-page vs run grouping vs adaptive"
    }

    fn about(&self) -> &'static str {
        "Part 1: \
         ns for one pin_pages call of 1 page and of 512 contiguous (2 MiB aligned) pages on \
         populated 4 KiB, THP and hugetlbfs 2 MiB memory, each call on pages no one holds \
         (0->1: mlock of what is new), pin and unpin (munlock) timed separately, calls \
         rotating through 64 MiB; the seed's kernel figures alongside. Part 2: a replay of the \
         seed's two vfio-ccw npage histograms (guest boot, fio) with run lengths drawn from its \
         pin_contiguous_pages histogram, 4 calls outstanding, in 256 MiB of 4 KiB memory. \
         Variants: per-page (baseline), runs (split first, then pin each run: the seed's \
         patch), adaptive (runs found while pinning); the registry's lock cache is off in \
         parts 1 and 2. Part 3: one page pinned and unpinned with and without the lock \
         cache (the same page again and again, and a new page each call), beside the raw \
         mlock + munlock, and part 2's replays with and without it. Targets: 512 pages at \
         least 3x faster grouped than per-page; adaptive never more than 5% slower than \
         per-page on either replay; one page with the cache: pin <= 1.7 us, unpin <= 1 us."
    }

    fn seeds(&self) -> &'static [Seed] {
        &[SEED_002]
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let full = ctx.mode == Mode::Full;
        let runs = ctx.runs_or(if full { 11 } else { 5 });
        let scale = if full { 4 } else { 1 };
        let (iters_one, iters_many) = (2048 * scale, 2 * CHUNKS * scale);
        let replay_len = if full { 20_000 } else { 6_000 };
        let mut out = Outcome::default();

        // The huge pages must outlive the backings built on them: declared first, dropped last.
        let pool = hugepages::pool(2 * VARIANTS.len() as u64 * CHUNKS);
        let mut memories = vec![Memory::Small, Memory::Thp];
        match &pool {
            Ok(_) => memories.push(Memory::Hugetlb),
            Err(why) => out
                .skipped
                .push(format!("{}: {why}", Memory::Hugetlb.label())),
        }
        let mut cases = Vec::new();
        for &memory in &memories {
            for pages in [1, 512] {
                // Pins mlock: without root, RLIMIT_MEMLOCK must cover one call.
                if let Err(why) = limits::check_lock(memory.locked_by(pages)) {
                    let s = if pages == 1 { "" } else { "s" };
                    out.skipped
                        .push(format!("{}, {pages} page{s}: {why}", memory.label()));
                    continue;
                }
                match Case::new(memory, pages) {
                    Ok(c) => cases.push(c),
                    Err(e) if memory == Memory::Hugetlb => {
                        out.skipped.push(format!("{}: {e:#}", memory.label()));
                        break;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        let thp_before: Vec<Option<Vec<u64>>> = cases.iter().map(Case::thp_mib).collect();

        let guest = Arc::new(Backing::with_options(
            BackingKind::PrivateAnon,
            REPLAY_SIZE,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )?);
        let replay_spaces = VARIANTS
            .iter()
            .map(|&(g, _)| space(g, &guest))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // The seed's two workloads (runs inside a call drawn from its run histogram), and the
        // mvdma device's pin mode under a real guest (each call one run of IOVA pages).
        let (mvdma, mvdma_source) = mvdma_npage()?;
        let workloads: [(&str, &Buckets, u64, Option<&Buckets>); 3] = [
            (
                "vfio-ccw guest boot",
                BOOT_NPAGE,
                0x5eed_0002_b007u64,
                Some(MULTI_RUNS),
            ),
            ("fio", FIO_NPAGE, 0x5eed_0002_0f10u64, Some(MULTI_RUNS)),
            (
                "vfio-user mvdma, real guest",
                &mvdma,
                0x5eed_00f1_0d3au64,
                None,
            ),
        ];
        // Each workload's calls, if the process may lock what the replay holds pinned at once.
        let (mut kept, mut traces) = (Vec::new(), Vec::new());
        for workload in workloads {
            let (name, hist, seed, runs) = workload;
            let calls = replay_calls(hist, runs, replay_len, REPLAY_SIZE / PAGE, seed);
            match limits::check_lock(peak_pinned(&calls)) {
                Ok(()) => {
                    kept.push(workload);
                    traces.push(calls);
                }
                Err(why) => out.skipped.push(format!("replay {name}: {why}")),
            }
        }
        let workloads = kept;
        if cases.is_empty() && workloads.is_empty() {
            return Ok(out);
        }

        let progress_steps = u64::from(runs) * (cases.len() + traces.len()) as u64;
        let mut progress = ctx.progress(NAME, progress_steps);
        // Per workload, per variant: per-run mean ns per call of pin and of unpin.
        let mut replay_pin = vec![vec![Vec::new(); VARIANTS.len()]; workloads.len()];
        let mut replay_unpin = replay_pin.clone();
        for run in 0..runs {
            for case in &mut cases {
                let (iters, block) = if case.pages == 1 {
                    (iters_one, 256)
                } else {
                    (iters_many, 4)
                };
                let calls = case.calls(u64::from(run), iters);
                let means = interleaved(&case.spaces, &calls, block, pin_then_unpin)?;
                for (v, (p, u)) in means.into_iter().enumerate() {
                    case.pin[v].push(p);
                    case.unpin[v].push(u);
                }
                progress.inc(1);
            }
            for (w, calls) in traces.iter().enumerate() {
                let means = interleaved(&replay_spaces, calls, REPLAY_BLOCK, replay)?;
                for (v, (p, u)) in means.into_iter().enumerate() {
                    replay_pin[w][v].push(p);
                    replay_unpin[w][v].push(u);
                }
                progress.inc(1);
            }
        }
        progress.finish();
        let thp_after: Vec<Option<Vec<u64>>> = cases.iter().map(Case::thp_mib).collect();

        // Part 1 tables, rows and chart.
        let mut pin_table = Table::new(
            "Part 1: ns per pin_pages call on pages no one holds (0->1; lower is better)",
            &[
                "Memory",
                "Pages",
                "per-page",
                "runs",
                "adaptive",
                "per-page / runs",
                "per-page / adaptive",
                "seed before",
                "seed after",
                "seed before / after",
            ],
        );
        let mut unpin_table = Table::new(
            "Part 1: ns per unpin_pages call right after (1->0; lower is better)",
            &[
                "Memory",
                "Pages",
                "per-page",
                "runs",
                "adaptive",
                "per-page / runs",
                "per-page / adaptive",
            ],
        );
        let mut chart = Chart::new(
            "Part 1: pin_pages calls of 1 and of 512 pages",
            "memory, pages per call",
            "ns per pin_pages call",
            Better::Lower,
            true,
        );
        let mut target_one = Vec::new();
        for case in &cases {
            let label = case.label();
            let idx = usize::from(case.pages != 1);
            let (before, after) = case.memory.seed();
            for (metric, data, table) in [
                ("pin", &case.pin, &mut pin_table),
                ("unpin", &case.unpin, &mut unpin_table),
            ] {
                let stats: Vec<Stats> = data.iter().map(|s| Stats::from_samples(s)).collect();
                for ((_, name), s) in VARIANTS.iter().zip(&stats) {
                    out.rows.push(Row::new(NAME, &label, name, metric, "ns", s));
                }
                let by_runs = ratio(&data[0], &data[1]);
                let by_adaptive = ratio(&data[0], &data[2]);
                let mut cells = vec![case.memory.label().to_string(), case.pages.to_string()];
                cells.extend(stats.iter().map(|s| format!("{:.0}", s.median)));
                cells.push(ratio_cell(&by_runs));
                cells.push(ratio_cell(&by_adaptive));
                if metric == "pin" {
                    cells.push(format!("{:.0}", before[idx]));
                    cells.push(format!("{:.0}", after[idx]));
                    cells.push(format!("{:.2}x", before[idx] / after[idx]));
                    chart.groups.push(ChartGroup {
                        label: label.clone(),
                        bars: VARIANTS
                            .iter()
                            .zip(&stats)
                            .map(|((_, n), s)| (n.to_string(), s.median))
                            .collect(),
                    });
                    if case.pages == 512 {
                        target_one.push(format!(
                            "{}: runs {:.1}x, adaptive {:.1}x",
                            case.memory.label(),
                            by_runs.median,
                            by_adaptive.median
                        ));
                    }
                }
                table.push(cells);
            }
        }
        let seed_rows = [Memory::Small, Memory::Thp, Memory::Hugetlb]
            .map(|m| {
                let (b, a) = m.seed();
                format!(
                    "{} {:.0}/{:.0} -> {:.0}/{:.0}",
                    m.seed_label(),
                    b[0],
                    b[1],
                    a[0],
                    a[1]
                )
            })
            .join("; ");
        pin_table.note = Some(format!(
            "Each call pins pages no one holds (mlock of what is new; on THP and \
             hugetlbfs the whole 2 MiB page), and is undone by unpin_pages right after, timed \
             apart (see the next table). A run's figure is its ns per call over {iters_one} \
             calls (1 page) or {iters_many} calls (512 pages, 2 MiB aligned, rotating over \
             {CHUNKS} huge-page chunks); {runs} runs, variants interleaved in every run. Each \
             call's two clock reads (about 20–40 ns) are included. Seed columns: the patch author's kernel figures for \
             vfio_iommu_type1_pin_pages before/after the patch, on other hardware ({seed_rows}); \
             compare ratios, not ns. Target: 512 pages >= 3x faster grouped than per-page."
        ));
        unpin_table.note = Some(
            "unpin_pages of the call just pinned: munlock of what goes back to 0 (per page for \
             per-page, per run otherwise); the seed measured only pinning."
                .into(),
        );
        if !cases.is_empty() {
            out.tables.push(pin_table);
            out.tables.push(unpin_table);
            out.charts.push(("pin-pages-call".into(), chart));
        }

        // Part 2: replay.
        let mut replay_table = Table::new(
            &format!(
                "Part 2: replay of recorded npage histograms (vfio-ccw from {}, mvdma under a \
                 real guest), ns per call ({QUEUE} calls outstanding; lower is better)",
                SEED_002.named()
            ),
            &[
                "Workload",
                "Metric",
                "per-page",
                "runs",
                "adaptive",
                "runs / per-page",
                "adaptive / per-page",
            ],
        );
        let mut replay_chart = Chart::new(
            "Part 2: replayed npage histograms, pin + unpin",
            "workload replayed",
            "ns per call, pin + unpin",
            Better::Lower,
            false,
        );
        let mut target_two = Vec::new();
        for (w, (workload, ..)) in workloads.iter().enumerate() {
            let total: Vec<Vec<f64>> = replay_pin[w]
                .iter()
                .zip(&replay_unpin[w])
                .map(|(p, u)| p.iter().zip(u).map(|(a, b)| a + b).collect())
                .collect();
            for (metric, data) in [
                ("pin+unpin", &total),
                ("pin", &replay_pin[w]),
                ("unpin", &replay_unpin[w]),
            ] {
                let case = format!("replay {workload}");
                let stats: Vec<Stats> = data.iter().map(|s| Stats::from_samples(s)).collect();
                for ((_, name), s) in VARIANTS.iter().zip(&stats) {
                    out.rows.push(Row::new(
                        NAME,
                        &case,
                        name,
                        &format!("{metric} per call"),
                        "ns",
                        s,
                    ));
                }
                let runs_ratio = ratio(&data[1], &data[0]);
                let adaptive_ratio = ratio(&data[2], &data[0]);
                let mut cells = vec![workload.to_string(), metric.to_string()];
                cells.extend(stats.iter().map(|s| format!("{:.0}", s.median)));
                cells.push(ratio_cell(&runs_ratio));
                cells.push(ratio_cell(&adaptive_ratio));
                replay_table.push(cells);
                if metric == "pin+unpin" {
                    replay_chart.groups.push(ChartGroup {
                        label: workload.to_string(),
                        bars: VARIANTS
                            .iter()
                            .zip(&stats)
                            .map(|((_, n), s)| (n.to_string(), s.median))
                            .collect(),
                    });
                    target_two.push(format!(
                        "{workload}: adaptive / per-page {:.3}",
                        adaptive_ratio.median
                    ));
                }
            }
        }
        replay_table.note = Some(format!(
            "{replay_len} calls per workload, the same sequence for every variant and run; call i \
             is pinned, then call i-{QUEUE} unpinned (a device with {QUEUE} I/Os queued). A \
             run's figure is its ns per call (pin and unpin timed apart, clock reads included); \
             {runs} runs. Target: adaptive / per-page <= \
             1.05 on the seed's two. The mvdma workload is the npage histogram of memvisor's \
             vfio-user reference device in pin mode under a real Linux guest (from \
             {mvdma_source}): each call pins one run of IOVA pages."
        ));
        if !workloads.is_empty() {
            out.tables.push(replay_table);
            out.charts.push(("pin-pages-replay".into(), replay_chart));
        }

        let mut dist = Table::new(
            "Part 2: generated vs recorded distributions (% of calls or runs)",
            &[
                "Distribution",
                "1",
                "2–3",
                "4–7",
                "8–15",
                "16–512",
                "pages / call",
                "runs / call",
            ],
        );
        let pct = |v: [f64; 5]| v.map(|x| format!("{x:.2}%"));
        for (w, &(workload, hist, _, runs)) in workloads.iter().enumerate() {
            let calls = &traces[w];
            let seed = if runs.is_some() {
                "seed (BASE)"
            } else {
                "recorded"
            };
            let runs_of: Vec<u64> = calls.iter().flat_map(|c| run_lengths(c)).collect();
            let n = calls.len() as f64;
            let pages: usize = calls.iter().map(Vec::len).sum();
            let mut seed_row = vec![format!("{workload} npage, {seed}")];
            seed_row.extend(pct(hist_shares(hist)));
            dist.push(seed_row);
            let mut row = vec![format!("{workload} npage, generated")];
            row.extend(pct(shares(calls.iter().map(|c| c.len() as u64))));
            row.push(format!("{:.2}", pages as f64 / n));
            row.push(format!("{:.2}", runs_of.len() as f64 / n));
            dist.push(row);
            let mut row = vec![format!("{workload} run length, generated")];
            row.extend(pct(shares(runs_of.iter().copied())));
            dist.push(row);
        }
        let mut row = vec!["pin_contiguous_pages npage, seed (boot + fio)".to_string()];
        row.extend(pct(hist_shares(SEED_RUNS)));
        row.push(String::new());
        row.push(format!(
            "{:.2}",
            SEED_RUNS.iter().map(|b| b.2).sum::<u64>() as f64 / SEED_CALLS as f64
        ));
        dist.push(row);
        dist.note = Some(format!(
            "npage uniform inside each bucket; a multi-page call is cut into runs drawn from \
             the seed's pin_contiguous_pages histogram minus one single run per single-page \
             call (same boot + fio trace: {} single runs minus {}), clipped to what is left of the \
             call, placed at random in {} MiB without touching each other; run lengths here are \
             measured on the generated page lists. The seed's run histogram is for boot and fio \
             together (mostly fio). Its two histograms cannot both hold exactly with sizes \
             uniform inside buckets (calls would hold ~2.6 pages, runs ~1.5 x 1.31 per call = \
             ~2.0), so long runs come out rarer than in the seed. The mvdma rows: npage drawn \
             from the recorded histogram as it is (one bucket per npage), one run per call.",
            SEED_RUNS[0].2,
            SEED_SINGLE_CALLS,
            REPLAY_SIZE >> 20
        ));
        out.tables.push(dist);

        if !target_one.is_empty() {
            out.notes.push(format!(
                "target 1 (512 pages >= 3x faster grouped than per-page, pin): {}",
                target_one.join("; ")
            ));
        }
        if !target_two.is_empty() {
            out.notes.push(format!(
                "target 2 (adaptive <= 5% slower than per-page on the seed's two replays, pin+unpin; mvdma shown beside them): {}",
                target_two.join("; ")
            ));
        }
        for (case, (before, after)) in cases.iter().zip(thp_before.iter().zip(&thp_after)) {
            if let (Some(b), Some(a)) = (before, after) {
                let each: Vec<String> = VARIANTS
                    .iter()
                    .zip(b.iter().zip(a))
                    .map(|((_, name), (b, a))| format!("{name} {b} -> {a}"))
                    .collect();
                out.notes.push(format!(
                    "THP backings of '{}', MiB of {} mapped by huge pages before -> after the \
                     runs: {} (an mlock of less than a whole 2 MiB would split the huge page's \
                     PMD for good; memvisor locks THP in whole huge pages)",
                    case.label(),
                    CASE_SIZE >> 20,
                    each.join(", ")
                ));
            }
        }
        // Backings and spaces go before the huge-page pool shrinks again.
        drop(cases);
        drop(pool);
        drop(replay_spaces);
        let replays: Vec<(&str, &[Vec<u64>])> = workloads
            .iter()
            .zip(&traces)
            .map(|(w, calls)| (w.0, calls.as_slice()))
            .collect();
        one::run(runs, full, &replays, &mut out)?;
        Ok(out)
    }
}
