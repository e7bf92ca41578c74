//! How the page report experiment lays out what it measured. Its three tables — the discards,
//! the pins kept across a report, the refault touches — are rows of [`TABLES`]: each names its
//! title, which lines it has (one per variant that ran, one per kind where pins ran, one per
//! kind) and its columns, a header and a function from a [`Line`] to the cell. [`tables`] renders
//! them all the same way, then adds the rows of `results.json`, the two charts and the notes on
//! the targets.

use super::{
    BLOCKS_PER_REPORT, DISCARDED, Kind, KindResult, MIB, PINNED, RESIDENT_AFTER, RESIDENT_BEFORE,
    SKIPPED, Samples, TARGET_GBPS, TOUCH_DISCARDED, TOUCH_FREED, TOUCH_RESIDENT, Variant,
};
use crate::seeds::SEED_004B;
use crate::{Better, Chart, ChartGroup, Outcome, Row, Stats, Table};

/// One line of a table: a kind's results, and for the discard table one of its variants.
struct Line<'a> {
    kind: Kind,
    r: &'a KindResult,
    /// The variant the line is about, with its samples (the first for the per-kind tables).
    variant: Variant,
    s: &'a Samples,
    size: u64,
    runs: u32,
}

impl Line<'_> {
    fn median(&self, metric: &str) -> f64 {
        self.s.median(metric).unwrap_or(0.0)
    }

    /// A MiB figure, blank where the variant did not measure it.
    fn mib(&self, metric: &str) -> String {
        self.s
            .median(metric)
            .map_or(String::new(), |v| format!("{v:.0}"))
    }

    fn touch(&self, metric: &str) -> Option<f64> {
        self.r.touch.median(metric)
    }

    /// A touch in ns per page, or n/a.
    fn ns(&self, metric: &str) -> String {
        self.touch(metric)
            .map_or("n/a".into(), |v| format!("{v:.1}"))
    }

    /// A touch compared with touching resident memory: "+12.3 ns (4.5x)".
    fn over(&self, metric: &str) -> String {
        match (self.touch(metric), self.touch(TOUCH_RESIDENT)) {
            (Some(v), Some(base)) => format!("{:+.1} ns ({:.1}x)", v - base, v / base),
            _ => "n/a".into(),
        }
    }

    fn faults(&self, metric: &str) -> String {
        let v = self.r.faults_after.median(metric);
        v.map_or("n/a".into(), |v| format!("{v:.3}"))
    }
}

/// Which lines a table has.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Lines {
    /// One per variant that ran, kind by kind.
    Variants,
    /// One per kind where the pinned variant ran.
    Pinned,
    /// One per kind.
    Kinds,
}

type Cell = for<'a, 'b> fn(&'b Line<'a>) -> String;

/// One table of the experiment: the renderer ([`tables`]) makes each from its lines, one cell
/// per column.
struct TableSpec {
    /// The title, given the guest size in MiB.
    title: fn(u64) -> String,
    lines: Lines,
    columns: &'static [(&'static str, Cell)],
    /// The note under the table, given the runs.
    note: fn(u32) -> String,
}

const TABLES: [TableSpec; 3] = [
    TableSpec {
        title: |mib| {
            format!(
                "Discarding a {mib} MiB report, {BLOCKS_PER_REPORT} x 2 MiB blocks per report \
                 (higher GB/s is better)"
            )
        },
        lines: Lines::Variants,
        columns: &[
            ("memory", |l| l.kind.label().into()),
            ("variant", |l| l.variant.name().into()),
            ("GB/s", |l| format!("{:.1}", l.s.gbps(l.size).median)),
            ("ms", |l| {
                format!("{:.1}", Stats::from_samples(&l.s.secs).median * 1e3)
            }),
            ("resident before MiB", |l| l.mib(RESIDENT_BEFORE)),
            ("resident after MiB", |l| l.mib(RESIDENT_AFTER)),
            ("discarded MiB", |l| l.mib(DISCARDED)),
            ("skipped pinned MiB", |l| l.mib(SKIPPED)),
            ("vs floor", |l| {
                let floor = l.r.variants.iter().find(|(v, _)| *v == Variant::Floor);
                floor.map_or(String::new(), |(_, f)| {
                    let share = l.s.gbps(l.size).median / f.gbps(l.size).median;
                    format!("{:.0}%", 100.0 * share)
                })
            }),
        ],
        note: |runs| {
            format!(
                "{runs} runs; GB/s = reported bytes / s (1 GB = 1e9 bytes), also for the \
                 pinned variant, which discards only 90% of them. Resident: smaps Rss of the \
                 mapping (private anon, THP), smaps Private_Hugetlb + Shared_Hugetlb \
                 (hugetlbfs), st_blocks (memfd). vs floor: GB/s as a share of one raw \
                 madvise(MADV_DONTNEED) / fallocate(PUNCH_HOLE) over the whole range. The 2 MiB \
                 floor makes one call per reported block; the discarder joins touching blocks \
                 and makes one call per 2 MiB of 4 KiB memory (the same calls: the gap is \
                 memvisor's bookkeeping — slot lookup, the pin check under the registry lock, \
                 the outcome) or per 64 MiB of huge pages. MADV_FREE leaves pages resident \
                 until the kernel needs them: its resident-after is not a leak."
            )
        },
    },
    TableSpec {
        title: |_| "Pinned pages across a report (10% pinned)".into(),
        lines: Lines::Pinned,
        columns: &[
            ("memory", |l| l.kind.label().into()),
            ("pinned", |l| l.r.plan_what.clone()),
            ("pinned MiB", |l| format!("{:.1}", l.median(PINNED))),
            ("skipped MiB", |l| format!("{:.1}", l.median(SKIPPED))),
            ("skipped = pinned", |l| match l.r.skip_mismatch.len() {
                0 => "yes".into(),
                n => format!("NO in {n} of {} runs", l.runs),
            }),
            ("resident after MiB", |l| {
                format!("{:.1}", l.median(RESIDENT_AFTER))
            }),
            ("not pinned, still resident MiB", |l| {
                format!("{:.1}", l.median(RESIDENT_AFTER) - l.median(PINNED))
            }),
            ("pinned bytes kept", |_| "yes (checked every byte)".into()),
        ],
        note: |_| {
            "Pins go through a Lazy DMA space (pin_pages, 512 pages per call) on the registry \
             the discarder checks. 'not pinned, still resident' is resident after minus pinned \
             bytes: 0 means everything not pinned was reclaimed. Every 8 bytes of the pinned \
             memory are compared with what was written before the report; any difference \
             stops the experiment with an error."
                .into()
        },
    },
    TableSpec {
        title: |_| {
            "Touching the memory again: ns per 4 KiB page, one byte written per page (lower is \
             better)"
                .into()
        },
        lines: Lines::Kinds,
        columns: &[
            ("memory", |l| l.kind.label().into()),
            ("touch resident", |l| l.ns(TOUCH_RESIDENT)),
            ("after discard", |l| l.ns(TOUCH_DISCARDED)),
            ("after MADV_FREE", |l| l.ns(TOUCH_FREED)),
            ("discard overhead", |l| l.over(TOUCH_DISCARDED)),
            ("MADV_FREE overhead", |l| l.over(TOUCH_FREED)),
            ("faults/page after discard", |l| l.faults(TOUCH_DISCARDED)),
            ("faults/page after MADV_FREE", |l| l.faults(TOUCH_FREED)),
        ],
        note: |_| {
            format!(
                "One volatile byte write per 4 KiB page in address order. After discard every \
                 page faults and the kernel zero-fills it (for THP and hugetlbfs one 2 MiB huge \
                 page per 512 pages, the cost spread over them); after MADV_FREE without memory \
                 pressure the pages are still there, so no fault and no zeroing (faults per page: \
                 the process's minor faults during the touch) — what is left is the CPU setting \
                 again the accessed and dirty bits MADV_FREE cleared, one page-table walk per \
                 4 KiB page (two levels of tables in a VM), nearly nothing per 2 MiB page. {} \
                 measured this cost inside a guest: will-it-scale page_fault1 (THP) 1012402 -> \
                 1010227 iterations and page_fault2 361855 -> 359749 with reporting enabled (1 \
                 task), the loss it blames on faults on reported pages and host zeroing, and less \
                 of it with MADV_FREE.",
                SEED_004B.named()
            )
        },
    },
];

/// The rows, tables, charts and notes of every kind's results.
pub(super) fn tables<'a>(
    out: &mut Outcome,
    size: u64,
    runs: u32,
    results: &'a [(Kind, KindResult)],
) {
    let mib_size = size / MIB;
    let mut lines: Vec<(Lines, Line<'a>)> = Vec::new();
    for (kind, r) in results {
        let line = |v: &'a (Variant, Samples)| Line {
            kind: *kind,
            r,
            variant: v.0,
            s: &v.1,
            size,
            runs,
        };
        for v in &r.variants {
            lines.push((Lines::Variants, line(v)));
            if v.0 == Variant::Pinned {
                lines.push((Lines::Pinned, line(v)));
            }
        }
        lines.extend(r.variants.first().map(|v| (Lines::Kinds, line(v))));
    }
    for spec in &TABLES {
        let headers: Vec<&str> = spec.columns.iter().map(|(h, _)| *h).collect();
        let mut table = Table::new(&(spec.title)(mib_size), &headers);
        for (_, line) in lines.iter().filter(|(which, _)| *which == spec.lines) {
            table.push(spec.columns.iter().map(|(_, cell)| cell(line)).collect());
        }
        table.note = Some((spec.note)(runs));
        if spec.lines != Lines::Pinned || !table.rows.is_empty() {
            out.tables.push(table);
        }
    }

    // results.json: every variant's throughput, time and non-zero MiB figures, then the touches.
    let mut row = |case: &str, variant: &str, metric: &str, unit: &str, stats: Stats| {
        out.rows
            .push(Row::new("report", case, variant, metric, unit, &stats));
    };
    for (kind, r) in results {
        let case = kind.label();
        for (variant, s) in &r.variants {
            let time = Stats::from_samples(&s.secs);
            row(
                case,
                variant.name(),
                "discard throughput",
                "GB/s",
                s.gbps(size),
            );
            row(case, variant.name(), "discard time", "s", time);
            for (metric, samples) in &s.metrics {
                let stats = Stats::from_samples(samples);
                if stats.median > 0.0 {
                    row(case, variant.name(), metric, "MiB", stats);
                }
            }
        }
        for (metric, samples) in &r.touch.metrics {
            let stats = Stats::from_samples(samples);
            row(case, metric, "touch", "ns per 4 KiB page", stats);
        }
        for (metric, samples) in &r.faults_after.metrics {
            let stats = Stats::from_samples(samples);
            if stats.median > 0.0 {
                row(case, metric, "page faults", "per 4 KiB page", stats);
            }
        }
    }

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
        let bars = r.variants.iter().map(|(variant, s)| {
            let secs = Stats::from_samples(&s.secs).median;
            (variant.name().to_string(), gb / secs)
        });
        gbps_chart.groups.push(ChartGroup {
            label: kind.label().into(),
            bars: bars.collect(),
        });
        let touches = [TOUCH_RESIDENT, TOUCH_DISCARDED, TOUCH_FREED].iter();
        touch_chart.groups.push(ChartGroup {
            label: kind.label().into(),
            bars: touches
                .filter_map(|m| r.touch.median(m).map(|v| (m.to_string(), v)))
                .collect(),
        });
    }
    out.charts.push(("report-gbps".into(), gbps_chart));
    out.charts.push(("report-touch".into(), touch_chart));
    notes(out, size, results);
}

/// THP coverage, pin mismatches, and whether the targets were met.
fn notes(out: &mut Outcome, size: u64, results: &[(Kind, KindResult)]) {
    let mib_size = size / MIB;
    for (kind, r) in results {
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
                "{}: a run skipped {skipped} bytes as pinned, but {pinned} bytes were pinned",
                kind.label()
            ));
        }
    }
    let anon = results.iter().find(|(k, _)| *k == Kind::Anon4K);
    let discard = anon.and_then(|(_, r)| r.variants.iter().find(|(v, _)| *v == Variant::Discard));
    if let Some((_, s)) = discard {
        let rate = s.gbps(size).median;
        out.notes.push(format!(
            "target: discard of a {mib_size} MiB report on 4 KiB private anonymous memory \
             >= {TARGET_GBPS} GB/s: {rate:.1} GB/s, {}",
            if rate >= TARGET_GBPS { "met" } else { "MISSED" }
        ));
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
}
