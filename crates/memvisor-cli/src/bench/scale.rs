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

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use memvisor::bitmap::DirtyBitmap;
use memvisor::{Access, Backing, BackingKind, DmaConfig, DmaSpace, Iova, PAGE_4K, Prot, SharedLog};

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
                    cursor.translate(Iova(p * PAGE_4K), 8, Access::Write)?;
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
        "dirty log drain against guest size: full scan vs summary levels"
    }

    fn about(&self) -> &'static str {
        "For sparse guests of 1, 16, 256 and 1024 GiB, one drain of the migration dirty log \
         into a vhost-user shared log with one dirty page and with 1% of the pages dirty: the \
         old full scan of the bitmap, the summary drain of the same bitmap, and the drain end to \
         end through a DmaSpace (DmaSpace::drain_dirty), and the dense read \
         (get_and_clear_dirty, a bitmap of the whole range). Medians over runs; one-page drains are \
         the median of 201 per run."
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
        Ok(out)
    }
}
