//! `memvisor bench map-unmap`: "vfio/type1: optimize vfio_unpin_pages_remote() for large folio"
//! (seed 001), DMA MAP and UNMAP throughput by memory kind.
//!
//! The patch made VFIO unpin a large folio (a huge page) in one step instead of 4 KiB page by
//! page, and measured `VFIO_IOMMU_MAP_DMA` / `UNMAP_DMA` of 16 GB in GB/s for three kinds of
//! memory: anonymous with MADV_HUGEPAGE, MAP_POPULATE (here: shared anonymous, populated) and
//! hugetlbfs 2 MiB. Here an Eager [`DmaSpace`](memvisor::DmaSpace) maps (pins) and unmaps (unpins) the same amount
//! in one call each. Variants: page at a time (`pin_batch = 1`: one mlock per page on the way in,
//! one munlock and accounting update per page on the way out — the seed's "before") against the
//! default batches of 512 in and one munlock per run out (extent / huge-page aware), each with
//! and without reading physical frames. The raw cost of one `mlock` / `munlock` over the whole
//! range is the physical limit; the seed's kernel figures are the reference. Memory is populated
//! once per kind and reused by every run; page-at-a-time runs go last because mlocking 4 KiB
//! inside a transparent huge page splits its mapping. `--full` maps the seed's 16 GiB where free
//! memory allows, less (by halves) where not; without the right to lock that much (root or
//! RLIMIT_MEMLOCK) the experiment is skipped with the reason.

use std::sync::Arc;
use std::time::Instant;

use memvisor::dma::PIN_BATCH;
use memvisor::{Backing, BackingKind, BackingOptions, Iova, PageSize, Prot};

use super::hugepages::{self, Reservation};
use super::pin::{can_read_frames, eager_space, mean_std};
use super::seeds::{SEED_001, Seed};
use super::{Better, Chart, ChartGroup, Ctx, Experiment, Mode, Outcome, Row, Stats, Table, limits};

pub struct MapUnmap;

const MIB: u64 = 1 << 20;

/// The seed's kernel figures for 16 GB (MAP GB/s, UNMAP GB/s): before and after the series.
const SEED: [(&str, [f64; 2], [f64; 2]); 3] = [
    ("MADV_HUGEPAGE", [333.5, 115.1], [591.2, 327.6]),
    ("MAP_POPULATE", [58.6, 52.9], [55.0, 52.3]),
    ("HUGETLBFS", [305.3, 113.8], [498.3, 326.2]),
];

struct Variant {
    name: &'static str,
    batch: usize,
    frames: bool,
}

const VARIANTS: [Variant; 4] = [
    Variant {
        name: "extent-aware",
        batch: PIN_BATCH,
        frames: false,
    },
    Variant {
        name: "extent-aware + frames",
        batch: PIN_BATCH,
        frames: true,
    },
    Variant {
        name: "per-page",
        batch: 1,
        frames: false,
    },
    Variant {
        name: "per-page + frames",
        batch: 1,
        frames: true,
    },
];

/// Seconds for one mlock and one munlock of the whole backing: the floor for MAP and UNMAP.
fn raw_lock_unlock(memory: &Backing) -> anyhow::Result<(f64, f64)> {
    let (p, len) = (
        memory.as_ptr().cast::<libc::c_void>(),
        memory.size() as usize,
    );
    let start = Instant::now();
    // SAFETY: the range is the live backing; mlock/munlock change residency, not contents.
    if unsafe { libc::mlock(p, len) } != 0 {
        anyhow::bail!("mlock: {}", std::io::Error::last_os_error());
    }
    let locked = start.elapsed().as_secs_f64();
    let start = Instant::now();
    // SAFETY: as above.
    unsafe { libc::munlock(p, len) };
    Ok((locked, start.elapsed().as_secs_f64()))
}

impl Experiment for MapUnmap {
    fn name(&self) -> &'static str {
        "map-unmap"
    }

    fn title(&self) -> &'static str {
        "DMA MAP / UNMAP throughput: per-page vs extent and huge-page aware"
    }

    fn about(&self) -> &'static str {
        "An Eager DmaSpace \
         maps and unmaps populated memory in one call each — MADV_HUGEPAGE (private THP), \
         MAP_POPULATE (shared anonymous) and hugetlbfs 2 MiB — page at a time (one mlock in, \
         one munlock and accounting update out per page) vs batches of 512 in and one munlock \
         per run out, with and without physical frames. GB/s = bytes / seconds; one raw \
         mlock/munlock of the whole range is the floor, the seed's kernel figures the \
         reference. Targets: huge-page UNMAP >= 10x per-page; THP and hugetlbfs MAP without \
         frames >= 100 GB/s; with frames >= 20 GB/s on THP."
    }

    fn seeds(&self) -> &'static [Seed] {
        &[SEED_001]
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let (wanted, default_runs) = match ctx.mode {
            Mode::Quick => (512 * MIB, 3),
            Mode::Full => (16 * 1024 * MIB, 5),
        };
        let runs = ctx.runs_or(default_runs);
        let frames_ok = can_read_frames();
        let mut out = Outcome::default();
        // One kind of memory at a time is populated: halve it until it fits in free memory.
        let mut size = wanted;
        while size > 512 * MIB && limits::check_free(size).is_err() {
            size /= 2;
        }
        if let Err(why) = limits::check_free(size) {
            out.skipped
                .push(format!("all cases, {} MiB: {why}", size / MIB));
            return Ok(out);
        }
        if size < wanted {
            let why = limits::check_free(wanted).unwrap_err();
            out.skipped.push(format!(
                "{} MiB per kind: {why}; ran {} MiB",
                wanted / MIB,
                size / MIB
            ));
        }
        // Every variant pins (mlocks) all of it at once.
        if let Err(why) = limits::check_lock(size) {
            out.skipped
                .push(format!("all cases, {} MiB: {why}", size / MIB));
            return Ok(out);
        }
        if !frames_ok {
            out.skipped.push(
                "variants with frames: reading /proc/self/pagemap frames needs CAP_SYS_ADMIN"
                    .into(),
            );
        }
        let mut table = Table::new(
            &format!(
                "MAP / UNMAP of {} MiB (means of {runs} runs, as the seed reports them; higher \
                 GB/s is better)",
                size / MIB
            ),
            &[
                "memory",
                "variant",
                "MAP time",
                "MAP GB/s",
                "UNMAP time",
                "UNMAP GB/s",
                "UNMAP vs per-page",
            ],
        );
        let y_title = format!("GB/s (bytes / mean time of {runs} runs)");
        let mut map_chart = Chart::new(
            "DMA MAP throughput",
            "memory",
            &y_title,
            Better::Higher,
            true,
        );
        let mut unmap_chart = Chart::new(
            "DMA UNMAP throughput",
            "memory",
            &y_title,
            Better::Higher,
            true,
        );
        let mut progress = ctx.progress("map-unmap", 3 * VARIANTS.len() as u64 * runs as u64);
        for (seed_name, seed_before, seed_after) in SEED {
            let memory = match memory_for(seed_name, size) {
                Ok(m) => m,
                Err(why) => {
                    out.skipped.push(format!("{seed_name}: {why}"));
                    progress.inc(VARIANTS.len() as u64 * runs as u64);
                    continue;
                }
            };
            let (memory, pool) = memory;
            // The floor first, while transparent huge pages are still mapped whole.
            let (lock_s, unlock_s) = raw_lock_unlock(&memory)?;
            let gb = size as f64 / 1e9;
            let mut rows = Vec::new();
            let mut map_bars = Vec::new();
            let mut unmap_bars = Vec::new();
            for v in &VARIANTS {
                if v.frames && !frames_ok {
                    progress.inc(runs as u64);
                    continue;
                }
                let (mut maps, mut unmaps) = (Vec::new(), Vec::new());
                for _ in 0..runs {
                    let dma = eager_space(v.batch, v.frames)?;
                    let start = Instant::now();
                    dma.map_backing(Iova(0), &memory, 0, size, Prot::RW)?;
                    maps.push(start.elapsed().as_secs_f64());
                    let start = Instant::now();
                    dma.unmap(Iova(0), size)?;
                    unmaps.push(start.elapsed().as_secs_f64());
                    progress.inc(1);
                }
                for (metric, samples) in [("MAP", &maps), ("UNMAP", &unmaps)] {
                    let mut s = Stats::from_samples(samples);
                    out.rows.push(Row::new(
                        "map-unmap",
                        seed_name,
                        v.name,
                        &format!("{metric} time"),
                        "s",
                        &s,
                    ));
                    (s.median, s.min, s.max) = (gb / s.median, gb / s.max, gb / s.min);
                    out.rows.push(Row::new(
                        "map-unmap",
                        seed_name,
                        v.name,
                        &format!("{metric} throughput"),
                        "GB/s",
                        &s,
                    ));
                }
                let (map_s, _) = mean_std(&maps);
                let (unmap_s, _) = mean_std(&unmaps);
                rows.push((v, map_s, unmap_s));
                map_bars.push((v.name.to_string(), gb / map_s));
                unmap_bars.push((v.name.to_string(), gb / unmap_s));
            }
            let per_page = |frames: bool| {
                rows.iter()
                    .find(|(v, _, _)| v.batch == 1 && v.frames == frames)
                    .map(|r| r.2)
            };
            for (v, map_s, unmap_s) in &rows {
                let ratio = per_page(v.frames)
                    .map(|p| format!("{:.1}x", p / unmap_s))
                    .unwrap_or_default();
                table.push(vec![
                    seed_name.into(),
                    v.name.into(),
                    seconds(*map_s),
                    format!("{:.1}", gb / map_s),
                    seconds(*unmap_s),
                    format!("{:.1}", gb / unmap_s),
                    ratio,
                ]);
            }
            table.push(vec![
                seed_name.into(),
                "raw mlock / munlock (floor)".into(),
                seconds(lock_s),
                format!("{:.1}", gb / lock_s),
                seconds(unlock_s),
                format!("{:.1}", gb / unlock_s),
                String::new(),
            ]);
            for (label, [map, unmap]) in [
                ("kernel before the patch (16 GB)", seed_before),
                ("kernel after the patch (16 GB)", seed_after),
            ] {
                table.push(vec![
                    seed_name.into(),
                    label.into(),
                    String::new(),
                    format!("{map:.1}"),
                    String::new(),
                    format!("{unmap:.1}"),
                    String::new(),
                ]);
            }
            map_chart.groups.push(ChartGroup {
                label: seed_name.into(),
                bars: map_bars,
            });
            unmap_chart.groups.push(ChartGroup {
                label: seed_name.into(),
                bars: unmap_bars,
            });
            // Free the huge pages before the pool shrinks back.
            drop(memory);
            drop(pool);
        }
        progress.finish();
        table.note = Some(format!(
            "Times and GB/s are means of {runs} runs, not medians; GB/s = bytes / mean time \
             (1 GB = 1e9 bytes, as in the seed); the raw mlock / munlock floor is one run. \
             Per-page UNMAP is one munlock and one accounting update per 4 KiB page; \
             extent-aware UNMAP is one per run. The kernel rows are the figures of {} \
             for 16 GB on its own machine, for reference only.",
            SEED_001.named()
        ));
        out.tables.push(table);
        out.charts.push(("map-unmap-map".into(), map_chart));
        out.charts.push(("map-unmap-unmap".into(), unmap_chart));
        Ok(out)
    }
}

/// Populated memory of the seed's kind, and the huge page reservation it needs (restored on
/// drop); `Err` says why the kind cannot run here.
fn memory_for(kind: &str, size: u64) -> Result<(Arc<Backing>, Option<Reservation>), String> {
    let populate = BackingOptions {
        populate: true,
        ..Default::default()
    };
    let (kind, pool) = match kind {
        "MADV_HUGEPAGE" => (BackingKind::Thp, None),
        "MAP_POPULATE" => (BackingKind::SharedAnon, None),
        _ => {
            let pages = size / PageSize::Size2M.bytes();
            (
                BackingKind::Hugetlb(PageSize::Size2M),
                hugepages::pool(pages)?,
            )
        }
    };
    let memory = Backing::with_options(kind, size, &populate).map_err(|e| e.to_string())?;
    Ok((Arc::new(memory), pool))
}

/// A time for a table cell, with its unit: seconds, or milliseconds where four decimals of a
/// second would read as 0.0000.
fn seconds(s: f64) -> String {
    if s >= 0.01 {
        format!("{s:.4} s")
    } else {
        format!("{:.3} ms", s * 1e3)
    }
}
