//! The benchmark framework behind `memvisor bench`. An [`Experiment`] reproduces one seed: it runs
//! the baseline and optimized variants in the same process and returns an [`Outcome`] made of raw
//! [`Row`]s (one per case × variant × metric, each the median of several runs, see [`measure`]),
//! human-readable [`Table`]s in the seed's shape, bar [`Chart`]s, notes and skipped cases.
//! Experiments get a [`Ctx`] that says how big to go ([`Mode`]), how many repetitions the user
//! asked for, and hands out terminal [`Progress`] bars. The registry is [`all`]; the report
//! writer ([`report`]) and the SVG renderer ([`svg`]) turn outcomes into files.

mod guest;
mod hugepages;
mod iotlb;
pub mod limits;
mod lookup;
pub mod machine;
mod map_unmap;
mod page_report;
mod pin;
mod pin_pages;
pub mod report;
mod rw;
pub mod svg;
mod translate;
mod vfio_user;

use serde::Serialize;
use std::io::Write;
use std::time::{Duration, Instant};

/// Experiments run only when named: they need root and minutes (`memvisor bench guest`).
pub fn on_request() -> Vec<Box<dyn Experiment>> {
    vec![Box::new(guest::Guest)]
}

/// ns one `Instant::now()` + `elapsed()` pair costs (median of many).
pub fn clock_cost() -> f64 {
    let mut v: Vec<f64> = (0..10_001)
        .map(|_| {
            let t0 = Instant::now();
            t0.elapsed().as_nanos() as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Every registered experiment, in the order `memvisor bench` runs them.
/// To add one: write `src/bench/<name>.rs` with a type implementing [`Experiment`], declare it
/// with `mod <name>;` above, and push `Box::new(<name>::TheType)` here.
pub fn all() -> Vec<Box<dyn Experiment>> {
    vec![
        Box::new(lookup::Lookup),
        Box::new(translate::Translate),
        Box::new(rw::Rw),
        Box::new(pin::Pin),
        Box::new(map_unmap::MapUnmap),
        Box::new(pin_pages::PinPages),
        Box::new(page_report::PageReport),
        Box::new(iotlb::IotlbReplay),
        Box::new(vfio_user::VfioUserReplay),
    ]
}

/// How big the experiments go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Small sizes: the whole suite in about 4 minutes on 2 cores.
    Quick,
    /// The seeds' sizes, where the machine's memory allows.
    Full,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Quick => "quick",
            Mode::Full => "full",
        }
    }
}

/// One experiment: reproduces one seed's table. Must be cheap to construct; work happens in `run`.
pub trait Experiment {
    /// Command-line name, e.g. `lookup`.
    fn name(&self) -> &'static str;
    /// One line, e.g. "memslot lookup: per-vCPU cursor vs VM-wide hint".
    fn title(&self) -> &'static str;
    /// One paragraph: which seed this reproduces and how it measures.
    fn about(&self) -> &'static str;
    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome>;
}

/// Everything an experiment produced.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub rows: Vec<Row>,
    pub tables: Vec<Table>,
    /// `(file stem, chart)`; the stem becomes `<stem>.svg` in the output directory, so it must be
    /// unique across experiments (start it with the experiment name) and use only `[A-Za-z0-9_-]`.
    pub charts: Vec<(String, Chart)>,
    pub notes: Vec<String>,
    /// Cases that were not run, each with the reason, e.g. "hugetlbfs 1G: needs root".
    pub skipped: Vec<String>,
}

/// One measured number, as it appears in `results.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    pub experiment: String,
    pub case: String,
    pub variant: String,
    pub metric: String,
    pub unit: String,
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: u32,
}

impl Row {
    pub fn new(
        experiment: &str,
        case: &str,
        variant: &str,
        metric: &str,
        unit: &str,
        stats: &Stats,
    ) -> Row {
        Row {
            experiment: experiment.to_string(),
            case: case.to_string(),
            variant: variant.to_string(),
            metric: metric.to_string(),
            unit: unit.to_string(),
            median: stats.median,
            min: stats.min,
            max: stats.max,
            runs: stats.runs,
        }
    }
}

/// Summary of repeated measurements of one quantity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: u32,
}

impl Stats {
    /// Median (mean of the two middle values for an even count), min and max.
    ///
    /// # Panics
    /// If `samples` is empty.
    pub fn from_samples(samples: &[f64]) -> Stats {
        assert!(
            !samples.is_empty(),
            "Stats::from_samples needs at least one sample"
        );
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Stats {
            median,
            min: sorted[0],
            max: sorted[n - 1],
            runs: u32::try_from(n).unwrap_or(u32::MAX),
        }
    }
}

/// Median of the per-run ratios `a[i] / b[i]`, with their min and max: the spread of a ratio
/// whose two sides were measured in the same runs.
pub fn ratio(a: &[f64], b: &[f64]) -> Stats {
    let r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
    Stats::from_samples(&r)
}

/// A ratio for a table cell, the min-max across runs in brackets when there was more than one:
/// `1.12x (0.95-1.30)`.
pub fn ratio_cell(s: &Stats) -> String {
    if s.runs > 1 {
        format!("{:.2}x ({:.2}-{:.2})", s.median, s.min, s.max)
    } else {
        format!("{:.2}x", s.median)
    }
}

/// `n` different values from `draw`, in the order drawn (a repeat is drawn again). `draw` must
/// be able to produce at least `n` different values.
pub fn distinct(n: usize, mut draw: impl FnMut() -> u64) -> Vec<u64> {
    let mut seen = std::collections::HashSet::with_capacity(n);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let v = draw();
        if seen.insert(v) {
            out.push(v);
        }
    }
    out
}

/// Calls `f` `runs` times (at least once); each call returns one measured value.
pub fn measure(runs: u32, mut f: impl FnMut() -> f64) -> Stats {
    let samples: Vec<f64> = (0..runs.max(1)).map(|_| f()).collect();
    Stats::from_samples(&samples)
}

/// Median cost per operation in ns over `runs` runs of `batch(iters)`, which performs the
/// operation `iters` times and returns the ns each took. A short first call sizes `iters` so
/// each run lasts about 30 ms: long enough to average out scheduler noise on a shared machine,
/// short enough for the quick suite.
pub fn ns_per_op(runs: u32, mut batch: impl FnMut(u64) -> f64) -> Stats {
    let iters = iters_for(batch(1 << 12));
    measure(runs, || batch(iters))
}

/// How many operations of `ns_per_op` ns each make about 30 ms.
pub fn iters_for(ns_per_op: f64) -> u64 {
    ((30e6 / ns_per_op.max(0.01)) as u64).clamp(1 << 6, 1 << 26)
}

/// Formats a number with about three significant digits and a k/M/G suffix for big values:
/// `0`, `0.25`, `12.3`, `950`, `1.25k`, `3M`. Used for tick and value labels.
pub fn short_num(v: f64) -> String {
    if !v.is_finite() {
        return "n/a".to_string();
    }
    let a = v.abs();
    if a == 0.0 {
        return "0".to_string();
    }
    if a < 1e-3 {
        return format!("{v:.1e}");
    }
    if a >= 1e12 {
        return format!("{v:.2e}");
    }
    let (scaled, suffix) = if a >= 1e9 {
        (v / 1e9, "G")
    } else if a >= 1e6 {
        (v / 1e6, "M")
    } else if a >= 1e4 {
        (v / 1e3, "k")
    } else {
        (v, "")
    };
    let digits = scaled.abs().log10().floor() as i32;
    let decimals = (2 - digits).clamp(0, 6) as usize;
    let mut s = format!("{scaled:.decimals$}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    s + suffix
}

/// A table for the terminal and for `report.md`.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub title: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
    /// Printed under the table, e.g. how the ratio was computed.
    pub note: Option<String>,
}

impl Table {
    pub fn new(title: &str, headers: &[&str]) -> Table {
        Table {
            title: title.to_string(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            ..Table::default()
        }
    }

    pub fn push(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn columns(&self) -> usize {
        self.rows
            .iter()
            .map(Vec::len)
            .chain([self.headers.len()])
            .max()
            .unwrap_or(0)
    }

    fn cell(row: &[String], col: usize) -> &str {
        row.get(col).map_or("", String::as_str)
    }

    /// A column is right-aligned when every non-empty body cell looks like a number.
    fn numeric(&self, col: usize) -> bool {
        let mut cells = self
            .rows
            .iter()
            .map(|r| Self::cell(r, col))
            .filter(|c| !c.is_empty())
            .peekable();
        cells.peek().is_some() && cells.all(looks_numeric)
    }

    /// Columns padded for a monospace terminal, numbers right-aligned.
    pub fn to_text(&self) -> String {
        let cols = self.columns();
        let width = |c: usize| {
            self.rows
                .iter()
                .chain([&self.headers])
                .map(|r| Self::cell(r, c).chars().count())
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..cols).map(width).collect();
        let right: Vec<bool> = (0..cols).map(|c| self.numeric(c)).collect();
        let line = |row: &[String]| {
            let cells: Vec<String> = (0..cols)
                .map(|c| {
                    let (s, w) = (Self::cell(row, c), widths[c]);
                    if right[c] {
                        format!("{s:>w$}")
                    } else {
                        format!("{s:<w$}")
                    }
                })
                .collect();
            cells.join("  ").trim_end().to_string() + "\n"
        };
        let mut out = format!("{}\n", self.title);
        out += &line(&self.headers);
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        out += &line(&rule);
        for row in &self.rows {
            out += &line(row);
        }
        if let Some(note) = &self.note {
            out += &format!("{note}\n");
        }
        out
    }

    /// A bold title line, a GitHub-flavoured markdown table, and the note as a paragraph.
    pub fn to_markdown(&self) -> String {
        let cols = self.columns();
        let line = |row: &[String]| {
            let cells: Vec<String> = (0..cols)
                .map(|c| Self::cell(row, c).replace('|', "\\|"))
                .collect();
            format!("| {} |\n", cells.join(" | "))
        };
        let mut out = format!("**{}**\n\n", self.title);
        out += &line(&self.headers);
        let align: Vec<&str> = (0..cols)
            .map(|c| if self.numeric(c) { "---:" } else { ":---" })
            .collect();
        out += &format!("|{}|\n", align.join("|"));
        for row in &self.rows {
            out += &line(row);
        }
        if let Some(note) = &self.note {
            out += &format!("\n{note}\n");
        }
        out
    }
}

/// "12", "-3.5", "1.25k", "2.0x", "45 %", "+7%" look numeric; "per-vCPU", "n/a" do not.
fn looks_numeric(s: &str) -> bool {
    let s = s.trim_start_matches(['-', '+', '.']);
    s.starts_with(|c: char| c.is_ascii_digit())
}

/// A grouped bar chart, rendered to SVG by [`svg::render`]: one group per case, one bar per
/// variant, one colour per variant across all groups.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    /// Y axis label, e.g. "ns per lookup".
    pub unit: String,
    pub log_scale: bool,
    pub groups: Vec<ChartGroup>,
}

#[derive(Debug, Clone, Default)]
pub struct ChartGroup {
    pub label: String,
    /// `(variant, value)`.
    pub bars: Vec<(String, f64)>,
}

/// What an experiment gets from the runner.
#[derive(Debug)]
pub struct Ctx {
    pub mode: Mode,
    /// `--runs N`, if given.
    pub runs: Option<u32>,
    /// `--replay FILE`s: recorded IOTLB streams for the `iotlb` experiment.
    pub replay: Vec<std::path::PathBuf>,
    draw_progress: bool,
}

impl Ctx {
    /// Progress bars are drawn only when stderr is a terminal.
    pub fn new(mode: Mode, runs: Option<u32>) -> Ctx {
        // SAFETY: isatty only inspects the descriptor number; an invalid or closed fd 2 just
        // yields 0, and no memory is passed.
        let tty = unsafe { libc::isatty(2) } == 1;
        Ctx {
            mode,
            runs,
            replay: Vec::new(),
            draw_progress: tty,
        }
    }

    /// The user's `--runs`, else the experiment's `default`; never 0.
    pub fn runs_or(&self, default: u32) -> u32 {
        self.runs.unwrap_or(default).max(1)
    }

    /// A progress bar for a task of `total` steps; see [`Progress`].
    pub fn progress(&self, label: &str, total: u64) -> Progress {
        Progress {
            label: label.to_string(),
            total,
            done: 0,
            start: Instant::now(),
            last_draw: None,
            enabled: self.draw_progress,
            finished: false,
        }
    }
}

/// A progress bar on stderr. It stays invisible for the first second (quick tasks draw nothing),
/// then redraws at most ten times per second as [`Progress::inc`] is called, and clears its line
/// when finished or dropped. Nothing is drawn when stderr is not a terminal.
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    start: Instant,
    last_draw: Option<Instant>,
    enabled: bool,
    finished: bool,
}

const PROGRESS_DELAY: Duration = Duration::from_secs(1);
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

impl Progress {
    /// Records `n` more steps done.
    pub fn inc(&mut self, n: u64) {
        self.done = self.done.saturating_add(n);
        if !self.enabled || self.finished {
            return;
        }
        let now = Instant::now();
        let due = match self.last_draw {
            None => now.duration_since(self.start) >= PROGRESS_DELAY,
            Some(last) => now.duration_since(last) >= PROGRESS_INTERVAL,
        };
        if due {
            self.last_draw = Some(now);
            let line = progress_line(&self.label, self.done, self.total, now - self.start);
            let mut err = std::io::stderr().lock();
            // A progress bar that cannot be drawn is not worth failing the benchmark for.
            let _ = write!(err, "\r{line}\x1b[K");
            let _ = err.flush();
        }
    }

    /// Clears the bar's line if it was drawn. Idempotent; also done on drop.
    pub fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        if self.last_draw.is_some() {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

fn progress_line(label: &str, done: u64, total: u64, elapsed: Duration) -> String {
    const WIDTH: usize = 30;
    let frac = if total == 0 {
        0.0
    } else {
        (done as f64 / total as f64).min(1.0)
    };
    let filled = (frac * WIDTH as f64).round() as usize;
    format!(
        "{label} [{}{}] {:>3}% {done}/{total} {:.0}s",
        "#".repeat(filled),
        "-".repeat(WIDTH - filled),
        (frac * 100.0).floor(),
        elapsed.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_of_odd_and_even_counts() {
        let s = Stats::from_samples(&[5.0, 1.0, 3.0]);
        assert_eq!((s.median, s.min, s.max, s.runs), (3.0, 1.0, 5.0, 3));
        let s = Stats::from_samples(&[4.0, 1.0, 10.0, 2.0]);
        assert_eq!((s.median, s.min, s.max, s.runs), (3.0, 1.0, 10.0, 4));
        assert_eq!(Stats::from_samples(&[7.0]).median, 7.0);
    }

    #[test]
    fn measure_calls_f_runs_times() {
        let mut calls = 0;
        let s = measure(4, || {
            calls += 1;
            calls as f64
        });
        assert_eq!(
            (calls, s.median, s.min, s.max, s.runs),
            (4, 2.5, 1.0, 4.0, 4)
        );
        let mut ctx = Ctx::new(Mode::Quick, None);
        assert_eq!(ctx.runs_or(5), 5);
        ctx.runs = Some(2);
        assert_eq!(ctx.runs_or(5), 2);
    }

    #[test]
    fn ratios_carry_their_spread() {
        let r = ratio(&[2.0, 3.0, 4.0], &[1.0, 2.0, 1.0]);
        assert_eq!((r.median, r.min, r.max, r.runs), (2.0, 1.5, 4.0, 3));
        assert_eq!(ratio_cell(&r), "2.00x (1.50-4.00)");
        assert_eq!(ratio_cell(&ratio(&[3.0], &[2.0])), "1.50x");
    }

    #[test]
    fn distinct_values_in_drawn_order() {
        let mut x = 0;
        let v = distinct(4, || {
            x += 1;
            x / 2
        });
        assert_eq!(v, [0, 1, 2, 3]);
    }

    #[test]
    fn short_num_is_readable() {
        let got: Vec<String> = [
            0.0,
            0.25,
            12.34,
            950.0,
            1234.0,
            12_345.0,
            3e6,
            -2.5e9,
            f64::NAN,
        ]
        .into_iter()
        .map(short_num)
        .collect();
        assert_eq!(
            got,
            [
                "0", "0.25", "12.3", "950", "1234", "12.3k", "3M", "-2.5G", "n/a"
            ]
        );
    }

    fn sample_table() -> Table {
        let mut t = Table::new("lookups", &["vCPUs", "variant", "ns"]);
        t.push(vec!["1".into(), "binary search".into(), "12.5".into()]);
        t.push(vec!["16".into(), "cursor".into(), "3".into()]);
        t.note = Some("median of 5 runs".into());
        t
    }

    #[test]
    fn table_text_aligns_columns() {
        let text = sample_table().to_text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "lookups",
                "vCPUs  variant          ns",
                "-----  -------------  ----",
                "    1  binary search  12.5",
                "   16  cursor            3",
                "median of 5 runs",
            ]
        );
    }

    #[test]
    fn table_markdown_shape() {
        let md = sample_table().to_markdown();
        let lines: Vec<&str> = md.lines().collect();
        assert_eq!(
            lines,
            [
                "**lookups**",
                "",
                "| vCPUs | variant | ns |",
                "|---:|:---|---:|",
                "| 1 | binary search | 12.5 |",
                "| 16 | cursor | 3 |",
                "",
                "median of 5 runs",
            ]
        );
        // Short rows are padded and pipes in cells escaped, so every row has the same columns.
        let mut t = sample_table();
        t.push(vec!["a|b".into()]);
        let md = t.to_markdown();
        assert!(md.contains("| a\\|b |  |  |\n"), "{md}");
        for line in md.lines().filter(|l| l.starts_with('|')) {
            let pipes = line.matches('|').count() - line.matches("\\|").count();
            assert_eq!(pipes, 4, "{line}");
        }
    }

    #[test]
    fn progress_line_and_quiet_start() {
        let line = progress_line("pin", 50, 200, Duration::from_secs(3));
        let bar = format!("{}{}", "#".repeat(8), "-".repeat(22));
        assert_eq!(line, format!("pin [{bar}]  25% 50/200 3s"));
        assert!(progress_line("x", 9, 0, Duration::ZERO).contains("  0% 9/0"));
        assert!(progress_line("x", 500, 100, Duration::ZERO).contains("100%"));
        let mut p = Ctx::new(Mode::Quick, None).progress("quick", 10);
        p.inc(3);
        p.inc(7);
        assert_eq!(p.done, 10);
        assert!(
            p.last_draw.is_none(),
            "nothing drawn within the first second"
        );
        p.finish();
        assert!(p.finished);
    }
}
