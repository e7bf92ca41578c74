//! `memvisor bench scale`: what a dirty log drain costs against the guest's size (issue 38's
//! scale table, its log-drain rows).
//!
//! For guests of 1, 16, 256 and 1024 GiB — sparse memfds: the address space and the bitmaps are
//! real, the memory is never touched — it times one drain of the migration log with one dirty
//! page and with 1% of the pages dirty (every 100th), three ways, side by side in one run:
//!
//! * **full scan (before)**: the drain as it was before the summary levels: every word of a
//!   [`DirtyBitmap`] loaded, the non-zero ones swapped ([`DirtyBitmap::take_by_full_scan`],
//!   kept for this comparison), and the resulting bitmap ORed into a vhost-user [`SharedLog`]
//!   (what `FrontendMemory::drain_dirty` did per region).
//! * **summary drain**: the same bitmap drained through its summary levels
//!   ([`DirtyBitmap::drain`]), each non-zero word ORed into the log.
//! * **space drain**: end to end through a [`DmaSpace`] with the guest mapped in one mapping and
//!   tracking on, pages marked by write translations: [`DmaSpace::drain_dirty`] into the log —
//!   the vhost-user drain's path without an IOMMU (its lock, mapping lookup and callback
//!   included).
//! * **dense read**: the same space read with [`DmaSpace::get_and_clear_dirty`], which returns
//!   a bitmap of the whole range (VFIO's and KVM's interface), ORed into the log: the bits are
//!   found through the summaries, but the returned vector costs O(guest size) to allocate and
//!   fill — the reason the drains above use callbacks.
//!
//! A second table gives the writer's side: what marking one page costs, at each size, with the
//! summary levels (`DirtyBitmap::mark`: the page word's OR plus a load per summary level) beside
//! the old mark's body (one atomic OR on a word array of the same size), for the same page over
//! and over (a device writing one buffer) and for pages spread over the whole guest (cache
//! misses on every level).
//!
//! Pages are marked before each drain and not timed. A drain with one dirty page is timed
//! [`REPS`] times per run (the run's median counts), a 1% drain once per run; the table gives the
//! median over runs, and the words each drain read. The goal: the one-page drain at 1024 GiB
//! within 2x of the same drain at 1 GiB.
//!
//! **The other rows** (the end of this file): translate and map+unmap at 1e3, 1e5 and 1e6 live
//! 4 KiB mappings, IOTLB update and invalidate at 1e2 and 1e5 live entries, pin+unpin of 1, 512
//! and 262,144 pages — each at every size in the same run, its growth from the smallest size
//! set beside its structure's bound (log n for lookups and index updates, linear in the pages
//! touched), in a table and a log-log chart with the bound's ideal slope dashed.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use memvisor::bitmap::DirtyBitmap;
use memvisor::{Backing, BackingKind, DmaConfig, DmaSpace, Iova, PAGE_4K, Prot, SharedLog};

use super::{
    Better, Chart, ChartGroup, Ctx, Experiment, Mode, Outcome, Row, Stats, Table, ns_per_op,
};

pub struct Scale;

const GIB: u64 = 1 << 30;
const SIZES_GIB: [u64; 4] = [1, 16, 256, 1024];
/// One-page drains timed per run (their median is the run's figure).
const REPS: usize = 201;
/// The 1% case marks every `SPREAD`th page.
const SPREAD: u64 = 100;

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    FullScan,
    Summary,
    Space,
    Dense,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::FullScan => "full scan (before)",
            Variant::Summary => "summary drain",
            Variant::Space => "space drain",
            Variant::Dense => "dense read",
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Dirty {
    OnePage,
    OnePercent,
}

impl Dirty {
    fn name(self) -> &'static str {
        match self {
            Dirty::OnePage => "1 dirty page",
            Dirty::OnePercent => "1% dirty",
        }
    }
}

/// One guest size's structures.
struct Guest {
    pages: u64,
    bitmap: DirtyBitmap,
    space: DmaSpace,
    log: SharedLog,
    _memory: Arc<Backing>,
}

impl Guest {
    fn new(gib: u64) -> anyhow::Result<Guest> {
        let size = gib * GIB;
        let pages = size / PAGE_4K;
        let memory = Arc::new(Backing::new(BackingKind::Memfd, size)?);
        let space = DmaSpace::new(DmaConfig::default())?;
        space.map_backing(Iova(0), &memory, 0, size, Prot::RW)?;
        space.start_dirty_tracking()?;
        let log_bytes = pages / 8;
        let log = SharedLog::new(
            Arc::new(Backing::new(BackingKind::Memfd, log_bytes)?),
            log_bytes,
        )?;
        Ok(Guest {
            pages,
            bitmap: DirtyBitmap::new(pages),
            space,
            log,
            _memory: memory,
        })
    }

    /// The pages dirtied before a drain: one in the middle, or every [`SPREAD`]th.
    fn dirty_pages(&self, dirty: Dirty, rep: u64) -> Vec<u64> {
        match dirty {
            // A different page each time, so no drain finds its path in cache from the last.
            Dirty::OnePage => vec![(self.pages / 2 + rep * 4099) % self.pages],
            Dirty::OnePercent => (0..self.pages).step_by(SPREAD as usize).collect(),
        }
    }

    fn mark(&self, variant: Variant, pages: &[u64]) -> anyhow::Result<()> {
        match variant {
            Variant::FullScan | Variant::Summary => {
                for &p in pages {
                    self.bitmap.mark(p, 1);
                }
            }
            Variant::Space | Variant::Dense => {
                let mut cursor = self.space.cursor();
                for &p in pages {
                    cursor.translate(Iova(p * PAGE_4K), 8, Prot::WRITE)?;
                }
            }
        }
        Ok(())
    }

    /// One drain into the log; returns (ns, pages logged, words read by a bitmap drain).
    fn drain(&self, variant: Variant) -> anyhow::Result<(f64, u64, u64)> {
        let mut marked = 0;
        let mut read = 0;
        let start = Instant::now();
        match variant {
            Variant::FullScan => {
                let words = self.bitmap.take_by_full_scan();
                marked += self.log.or_words(0, &words).0;
                read = words.len() as u64;
            }
            Variant::Summary => {
                read = self
                    .bitmap
                    .drain(|page, bits| marked += self.log.or_words(page, &[bits]).0);
            }
            Variant::Space => {
                self.space
                    .drain_dirty(Iova(0), self.pages * PAGE_4K, PAGE_4K, |page, bits| {
                        marked += self.log.or_words(page, &[bits]).0
                    })?;
            }
            Variant::Dense => {
                let words =
                    self.space
                        .get_and_clear_dirty(Iova(0), self.pages * PAGE_4K, PAGE_4K)?;
                marked += self.log.or_words(0, &words).0;
            }
        }
        let ns = start.elapsed().as_nanos() as f64;
        if variant == Variant::FullScan {
            // The scan leaves the summary bits set; clear them, untimed, so every variant starts
            // from a clean bitmap.
            self.bitmap.drain(|_, _| {});
        }
        Ok((ns, marked, read))
    }

    /// One run's figure for `variant` at `dirty`: ns of a drain, words read.
    fn run(&self, variant: Variant, dirty: Dirty) -> anyhow::Result<(f64, u64)> {
        let reps = match dirty {
            Dirty::OnePage => REPS,
            Dirty::OnePercent => 1,
        };
        let mut ns = Vec::with_capacity(reps);
        let mut words = 0;
        for rep in 0..reps {
            let pages = self.dirty_pages(dirty, rep as u64);
            self.mark(variant, &pages)?;
            let (t, marked, read) = self.drain(variant)?;
            anyhow::ensure!(
                marked == pages.len() as u64,
                "{}: the drain logged {marked} pages of {}",
                variant.name(),
                pages.len()
            );
            ns.push(t);
            words = read;
        }
        Ok((Stats::from_samples(&ns).median, words))
    }
}

/// Pages for the mark table: the same page, or [`MARK_SPREAD`] pages spread over the guest.
const MARK_SPREAD: usize = 1 << 16;

/// ns per mark of `pages` (cycled), with the summary levels or as the old mark did.
fn time_marks(guest: &Guest, words: &[AtomicU64], pages: &[u64], summary: bool, runs: u32) -> f64 {
    let mask = pages.len() - 1;
    ns_per_op(runs, |iters| {
        let start = Instant::now();
        for i in 0..iters as usize {
            let p = black_box(pages[i & mask]);
            if summary {
                guest.bitmap.mark(p, 1);
            } else {
                words[(p / 64) as usize].fetch_or(1 << (p % 64), Ordering::Relaxed);
            }
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    })
    .median
}

impl Experiment for Scale {
    fn name(&self) -> &'static str {
        "scale"
    }

    fn title(&self) -> &'static str {
        "cost against size: dirty log drains, translate, map+unmap, IOTLB, pin+unpin"
    }

    fn about(&self) -> &'static str {
        "For sparse guests of 1, 16, 256 and 1024 GiB, one drain of the migration dirty log \
         into a vhost-user shared log with one dirty page and with 1% of the pages dirty: the \
         old full scan of the bitmap, the summary drain of the same bitmap, and the drain end to \
         end through a DmaSpace (DmaSpace::drain_dirty), and the dense read \
         (get_and_clear_dirty, a bitmap of the whole range). Medians over runs; one-page drains are \
         the median of 201 per run. Then translate and map+unmap at 1e3, 1e5 and 1e6 live \
         mappings, IOTLB update and invalidate at 1e2 and 1e5 live entries, pin+unpin of 1, 512 \
         and 262,144 pages, each against its structure's bound (log n, linear in pages)."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(match ctx.mode {
            Mode::Quick => 3,
            Mode::Full => 7,
        });
        let variants = [
            Variant::FullScan,
            Variant::Summary,
            Variant::Space,
            Variant::Dense,
        ];
        let cases = [Dirty::OnePage, Dirty::OnePercent];
        let mut out = Outcome::default();
        let mut progress = ctx.progress(
            "scale",
            (SIZES_GIB.len() * cases.len() * variants.len()) as u64 * u64::from(runs),
        );
        let mut table = Table::new(
            &format!("Dirty log drain by guest size (median of {runs} runs; lower is better)"),
            &[
                "guest",
                "dirty",
                "full scan (before) µs",
                "summary drain µs",
                "space drain µs",
                "dense read µs",
                "before / after",
                "words read: scan",
                "words read: summary",
            ],
        );
        let mut marks = Table::new(
            &format!("Marking one page dirty (ns per mark, median of {runs} runs)"),
            &[
                "guest",
                "same page: old mark",
                "same page: with summaries",
                "spread pages: old mark",
                "spread pages: with summaries",
            ],
        );
        let mut one_page_space = Vec::new();
        let mut groups: Vec<ChartGroup> = Vec::new();
        for &gib in &SIZES_GIB {
            let guest = match Guest::new(gib) {
                Ok(g) => g,
                Err(why) => {
                    out.skipped.push(format!("{gib} GiB: {why}"));
                    progress.inc((cases.len() * variants.len()) as u64 * u64::from(runs));
                    continue;
                }
            };
            {
                // The old mark's word array, as large as the bitmap's page words.
                let words: Vec<AtomicU64> =
                    (0..guest.pages / 64).map(|_| AtomicU64::new(0)).collect();
                let same = vec![guest.pages / 2];
                let spread: Vec<u64> = (0..MARK_SPREAD as u64)
                    .map(|i| (i * 2_654_435_761) % guest.pages)
                    .collect();
                let mut cells = vec![format!("{gib} GiB")];
                for pages in [&same, &spread] {
                    for summary in [false, true] {
                        let ns = time_marks(&guest, &words, pages, summary, runs);
                        cells.push(format!("{ns:.1}"));
                    }
                }
                marks.push(cells);
                guest.bitmap.drain(|_, _| {});
            }
            for &dirty in &cases {
                let mut medians = Vec::new();
                let mut words = Vec::new();
                for &variant in &variants {
                    let mut ns = Vec::new();
                    let mut read = 0;
                    for _ in 0..runs {
                        let (t, w) = guest.run(variant, dirty)?;
                        ns.push(t);
                        read = w;
                        progress.inc(1);
                    }
                    let stats = Stats::from_samples(&ns);
                    out.rows.push(Row::new(
                        "scale",
                        &format!("{gib} GiB, {}", dirty.name()),
                        variant.name(),
                        "drain",
                        "ns",
                        &stats,
                    ));
                    medians.push(stats.median);
                    words.push(read);
                }
                if dirty == Dirty::OnePage {
                    one_page_space.push((gib, medians[2]));
                    groups.push(ChartGroup {
                        label: format!("{gib} GiB"),
                        bars: variants
                            .iter()
                            .zip(&medians)
                            .map(|(v, &m)| (v.name().to_string(), m / 1e3))
                            .collect(),
                    });
                }
                table.push(vec![
                    format!("{gib} GiB"),
                    dirty.name().to_string(),
                    format!("{:.2}", medians[0] / 1e3),
                    format!("{:.2}", medians[1] / 1e3),
                    format!("{:.2}", medians[2] / 1e3),
                    format!("{:.2}", medians[3] / 1e3),
                    format!("{:.1}x", medians[0] / medians[2]),
                    words[0].to_string(),
                    words[1].to_string(),
                ]);
            }
        }
        progress.finish();
        table.note = Some(
            "before / after = full scan ÷ space drain. Words read: page words loaded by the \
             scan; page and summary words visited by the summary drain (the space drain reads \
             the same)."
                .into(),
        );
        out.tables.push(table);
        marks.note = Some(
            "old mark = one relaxed atomic OR on the page's word (the mark before the summary \
             levels); with summaries = DirtyBitmap::mark: the same OR, then one load per \
             summary level and an OR where a summary bit was clear. Spread: 65,536 pages \
             scattered over the guest, cycled."
                .into(),
        );
        out.tables.push(marks);
        if let (Some(&(g0, small)), Some(&(g1, large))) =
            (one_page_space.first(), one_page_space.last())
        {
            let ratio = large / small;
            out.notes.push(format!(
                "One dirty page, space drain: {:.2} µs at {g0} GiB, {:.2} µs at {g1} GiB: {ratio:.2}x \
                 (goal: within 2x) — {}.",
                small / 1e3,
                large / 1e3,
                if ratio <= 2.0 { "met" } else { "missed" }
            ));
        }
        let mut chart = Chart::new(
            "Drain with one dirty page",
            "guest size",
            "µs per drain (median)",
            Better::Lower,
            true,
        );
        chart.groups = groups;
        out.charts.push(("scale-drain-one-page".into(), chart));
        let mut sizes_progress = ctx.progress("scale: sizes", 8);
        size_rows(runs, || sizes_progress.inc(1), &mut out);
        sizes_progress.finish();
        Ok(out)
    }
}

// ---- Cost against the number of mappings, IOTLB entries and pinned pages ----
//
// The other rows of the scale table. Each operation is timed at each size in the same run, and
// its growth from the smallest size is set beside its structure's bound: log n for a lookup or
// an update in an index of n entries, linear in the pages touched for a pin. A row "within
// bound" grew no more than 1.5x its bound's growth (the slack is noise on this shared machine).

/// Live mappings for translate and map+unmap.
const MAPPINGS: [u64; 3] = [1_000, 100_000, 1_000_000];
/// Live IOTLB entries for update and invalidate.
const IOTLB_ENTRIES: [u64; 2] = [100, 100_000];
/// Pages pinned and unpinned per operation.
const PIN_PAGES: [u64; 3] = [1, 512, 262_144];
/// Random slots cycled through (a power of two).
const SLOTS: usize = 1 << 12;
/// IOTLB updates (then invalidations) timed per batch.
const IOTLB_BATCH: usize = 64;

/// What bounds an operation's growth.
#[derive(Clone, Copy)]
enum Bound {
    /// log n (a lookup or update in an index of n entries).
    Log,
    /// Linear in the pages touched.
    Linear,
}

impl Bound {
    fn name(self) -> &'static str {
        match self {
            Bound::Log => "log n",
            Bound::Linear => "linear",
        }
    }

    /// How much the bound grows from size `n0` to `n`.
    fn growth(self, n0: u64, n: u64) -> f64 {
        match self {
            // log2 of the entry count, at least 1 (a lookup in one entry still costs one step).
            Bound::Log => (n as f64).log2().max(1.0) / (n0 as f64).log2().max(1.0),
            Bound::Linear => n as f64 / n0 as f64,
        }
    }
}

/// `SLOTS` pseudo-random numbers below `n` (xorshift; the same every run).
fn random_slots(n: u64) -> Vec<u64> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    (0..SLOTS)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n
        })
        .collect()
}

/// A space of `n` live 4 KiB mappings of one sparse memfd, mapping `i` at IOVA `2 i` pages
/// (odd pages are holes to map into), and that memfd.
fn many_mappings(n: u64) -> anyhow::Result<(DmaSpace, Arc<Backing>)> {
    let space = DmaSpace::new(DmaConfig {
        max_mappings: (2 * n + 2 * SLOTS as u64).min(u64::from(u32::MAX)) as u32,
        ..DmaConfig::default()
    })?;
    let memory = Arc::new(Backing::new(BackingKind::Memfd, n * PAGE_4K)?);
    for i in 0..n {
        space.map_backing(
            Iova(2 * i * PAGE_4K),
            &memory,
            i * PAGE_4K,
            PAGE_4K,
            Prot::RW,
        )?;
    }
    Ok((space, memory))
}

/// One measured point: operation, size, median ns per operation over the runs.
struct Point {
    op: &'static str,
    bound: Bound,
    size: u64,
    stats: Stats,
}

/// ns per translate of a random mapped IOVA, and per map+unmap of one 4 KiB mapping in a
/// random hole, at `n` live mappings.
fn lookup_points(n: u64, runs: u32) -> anyhow::Result<[Stats; 2]> {
    let (space, memory) = many_mappings(n)?;
    let slots = random_slots(n);
    let mask = SLOTS - 1;
    let mut misses = 0u64;
    let translate = ns_per_op(runs, |iters| {
        let start = Instant::now();
        for k in 0..iters as usize {
            let iova = Iova(2 * slots[k & mask] * PAGE_4K + 8);
            match space.translate(iova, 8, Prot::READ) {
                Ok(t) => {
                    black_box(t.hva);
                }
                Err(_) => misses += 1,
            }
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    });
    anyhow::ensure!(misses == 0, "{misses} translations of mapped IOVAs failed");
    let mut failed = None;
    let map_unmap = ns_per_op(runs, |iters| {
        let start = Instant::now();
        for k in 0..iters as usize {
            let i = slots[k & mask];
            let iova = Iova((2 * i + 1) * PAGE_4K);
            let r = space
                .map_backing(iova, &memory, i * PAGE_4K, PAGE_4K, Prot::RW)
                .and_then(|()| space.unmap(iova, PAGE_4K));
            if let Err(e) = r {
                failed.get_or_insert(e);
            }
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    });
    if let Some(e) = failed {
        anyhow::bail!("map+unmap at {n} mappings: {e}");
    }
    anyhow::ensure!(
        space.len() as u64 == n,
        "map+unmap left {} mappings",
        space.len()
    );
    Ok([translate, map_unmap])
}

/// ns per IOTLB update (a 4 KiB entry into a hole) and per invalidation (of that entry), at `n`
/// live entries: a space used as an IOTLB, as the vhost-user back end's (which updates with a
/// map and invalidates with `invalidate_range`).
fn iotlb_points(n: u64, runs: u32) -> anyhow::Result<[Stats; 2]> {
    let (space, memory) = many_mappings(n)?;
    let slots = random_slots(n);
    let (mut update, mut invalidate) = (Vec::new(), Vec::new());
    let mut batch: Vec<u64> = Vec::with_capacity(IOTLB_BATCH);
    for _ in 0..runs {
        let (mut t_up, mut t_inv, mut ops) = (0.0, 0.0, 0u64);
        let mut k = 0;
        // About 30 ms of each per run.
        while ops < 20_000 {
            batch.clear();
            for _ in 0..IOTLB_BATCH {
                let i = slots[k % SLOTS];
                k += 1;
                if !batch.contains(&i) {
                    batch.push(i);
                }
            }
            let start = Instant::now();
            for &i in &batch {
                space.map_backing(
                    Iova((2 * i + 1) * PAGE_4K),
                    &memory,
                    i * PAGE_4K,
                    PAGE_4K,
                    Prot::RW,
                )?;
            }
            let mid = Instant::now();
            for &i in &batch {
                space.invalidate_range(Iova((2 * i + 1) * PAGE_4K), PAGE_4K)?;
            }
            t_inv += mid.elapsed().as_nanos() as f64;
            t_up += (mid - start).as_nanos() as f64;
            ops += batch.len() as u64;
        }
        update.push(t_up / ops as f64);
        invalidate.push(t_inv / ops as f64);
    }
    anyhow::ensure!(
        space.len() as u64 == n,
        "the IOTLB rows left {} entries",
        space.len()
    );
    Ok([
        Stats::from_samples(&update),
        Stats::from_samples(&invalidate),
    ])
}

/// ns per pin and unpin of `pages` consecutive 4 KiB pages (`pin_pages` / `unpin_pages`, in
/// calls of at most `PIN_PAGES_MAX`), in a space mapping enough memfd memory, once faulted in.
fn pin_point(pages: u64, runs: u32) -> anyhow::Result<Stats> {
    use memvisor::dma::{LockLimit, PIN_PAGES_MAX, PinRegistry};
    let bytes = pages * PAGE_4K;
    super::limits::check_lock(bytes).map_err(|why| anyhow::anyhow!("{why}"))?;
    super::limits::check_free(bytes).map_err(|why| anyhow::anyhow!("{why}"))?;
    let space = DmaSpace::new(DmaConfig {
        registry: Some(PinRegistry::new(LockLimit::Unlimited)),
        ..DmaConfig::default()
    })?;
    let memory = Arc::new(Backing::new(BackingKind::Memfd, bytes)?);
    space.map_backing(Iova(0), &memory, 0, bytes, Prot::RW)?;
    let list: Vec<u64> = (0..pages).collect();
    let pin_unpin = || -> anyhow::Result<()> {
        for chunk in list.chunks(PIN_PAGES_MAX) {
            black_box(space.pin_pages(chunk, Prot::RW)?);
        }
        for chunk in list.chunks(PIN_PAGES_MAX) {
            space.unpin_pages(chunk)?;
        }
        Ok(())
    };
    // The first pin faults the memory in: not timed.
    pin_unpin()?;
    let mut failed = None;
    let mut timed = |iters: u64| {
        let start = Instant::now();
        for _ in 0..iters {
            if let Err(e) = pin_unpin() {
                failed.get_or_insert(e);
            }
        }
        start.elapsed().as_nanos() as f64 / iters as f64
    };
    // Small pins are timed in batches sized to ~30 ms; a large one alone (it takes that long).
    let stats = if pages <= PIN_PAGES_MAX as u64 {
        ns_per_op(runs, timed)
    } else {
        super::measure(runs, || timed(1))
    };
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(stats)
}

/// The translate, map+unmap, IOTLB and pin rows: a table, one log-log chart per group with
/// its bound's ideal slope, rows into `out`; sizes that cannot run are skipped with the reason.
fn size_rows(runs: u32, mut progress: impl FnMut(), out: &mut Outcome) {
    let mut points: Vec<Point> = Vec::new();
    let mut push = |points: &mut Vec<Point>, op, bound, size, stats: Stats| {
        out.rows.push(Row::new(
            "scale",
            &format!("{size}"),
            op,
            "cost",
            "ns",
            &stats,
        ));
        points.push(Point {
            op,
            bound,
            size,
            stats,
        });
    };
    for &n in &MAPPINGS {
        match lookup_points(n, runs) {
            Ok([t, m]) => {
                push(&mut points, "translate", Bound::Log, n, t);
                push(&mut points, "map+unmap", Bound::Log, n, m);
            }
            Err(why) => out
                .skipped
                .push(format!("translate, map+unmap at {n} mappings: {why}")),
        }
        progress();
    }
    for &n in &IOTLB_ENTRIES {
        match iotlb_points(n, runs) {
            Ok([u, i]) => {
                push(&mut points, "IOTLB update", Bound::Log, n, u);
                push(&mut points, "IOTLB invalidate", Bound::Log, n, i);
            }
            Err(why) => out.skipped.push(format!("IOTLB at {n} entries: {why}")),
        }
        progress();
    }
    for &n in &PIN_PAGES {
        match pin_point(n, runs) {
            Ok(s) => push(&mut points, "pin+unpin", Bound::Linear, n, s),
            Err(why) => out.skipped.push(format!("pin+unpin of {n} pages: {why}")),
        }
        progress();
    }

    let mut table = Table::new(
        &format!("Cost against size (median of {runs} runs; lower is better)"),
        &[
            "operation",
            "size",
            "ns per op",
            "growth from the smallest",
            "bound",
            "bound's growth",
            "within bound",
        ],
    );
    let groups: [(&str, &str, &str, &[&str]); 3] = [
        (
            "scale-lookup",
            "Translate and map+unmap against live mappings",
            "live 4 KiB mappings",
            &["translate", "map+unmap"],
        ),
        (
            "scale-iotlb",
            "IOTLB update and invalidate against live entries",
            "live IOTLB entries",
            &["IOTLB update", "IOTLB invalidate"],
        ),
        (
            "scale-pin",
            "Pin+unpin against pages",
            "pages pinned and unpinned",
            &["pin+unpin"],
        ),
    ];
    for (id, title, x_title, ops) in groups {
        let mut chart = Chart::new(
            title,
            x_title,
            "ns per operation (median)",
            Better::Lower,
            true,
        );
        let mut sizes: Vec<u64> = points
            .iter()
            .filter(|p| ops.contains(&p.op))
            .map(|p| p.size)
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        chart.groups = sizes
            .iter()
            .map(|&s| ChartGroup {
                label: s.to_string(),
                bars: Vec::new(),
            })
            .collect();
        for op in ops {
            let row: Vec<&Point> = points.iter().filter(|p| p.op == *op).collect();
            let Some(first) = row.first() else {
                continue;
            };
            for p in &row {
                let growth = p.stats.median / first.stats.median;
                let bound = p.bound.growth(first.size, p.size);
                table.push(vec![
                    p.op.to_string(),
                    p.size.to_string(),
                    format!("{:.1}", p.stats.median),
                    format!("{growth:.2}x"),
                    p.bound.name().to_string(),
                    format!("{bound:.2}x"),
                    if p.size == first.size {
                        "-".to_string()
                    } else if growth <= 1.5 * bound {
                        "yes".to_string()
                    } else {
                        format!("no ({:.1}x the bound)", growth / bound)
                    },
                ]);
                let g = sizes.iter().position(|&s| s == p.size).unwrap_or(0);
                chart.groups[g]
                    .bars
                    .push((p.op.to_string(), p.stats.median));
                chart.groups[g].bars.push((
                    format!("ideal ({}) for {}", p.bound.name(), p.op),
                    first.stats.median * bound,
                ));
            }
        }
        chart.sizes = Some(sizes.iter().map(|&s| s as f64).collect());
        out.charts.push((id.into(), chart));
    }
    table.note = Some(
        "growth = ns per op at this size ÷ ns per op at the row's smallest size; bound's growth = \
         log2 n ÷ log2 n0 for lookups and index updates, n ÷ n0 for pages; within bound = growth \
         ≤ 1.5 × the bound's growth. Translate: DmaSpace::translate of a random mapped IOVA; \
         map+unmap: one 4 KiB mapping into a random hole and out; IOTLB: a space used as an \
         IOTLB (update = a 4 KiB map, invalidate = invalidate_range), batches of 64; pin+unpin: \
         pin_pages then unpin_pages of consecutive pages in calls of 512, memory faulted in."
            .into(),
    );
    out.tables.push(table);
}
