//! The benchmark framework behind `memvisor bench`. An [`Experiment`] reproduces one seed: it runs
//! the baseline and optimized variants in the same process and returns an [`Outcome`] made of raw
//! [`Row`]s (one per case × variant × metric, each the median of several runs, see [`measure`]),
//! human-readable [`Table`]s in the seed's shape, bar [`Chart`]s, notes and skipped cases.
//! Experiments get a [`Ctx`] that says how big to go ([`Mode`]), how many repetitions the user
//! asked for, and hands out terminal [`Progress`] bars. The registry is [`all`]; the report
//! writer ([`report`]) and the chart renderer ([`charts`]) turn outcomes into files.

mod blk;
mod blk_throttle;
pub mod charts;
mod guest;
mod hugepages;
mod iotlb;
mod kvm;
mod kvm_exits;
pub mod limits;
mod lookup;
pub mod machine;
mod map_unmap;
mod page_report;
mod pin;
mod pin_pages;
// Issue 47's QMP round trip: on request (`memvisor bench qmp`), it starts the server binary.
mod qmp;
pub mod report;
mod rw;
// Issue 38's scale table: on request (`memvisor bench scale`).
mod scale;
pub mod seeds;
mod translate;
mod vfio_user;

pub use charts::{Better, Chart, ChartGroup};
use serde::Serialize;
use std::time::{Duration, Instant};

/// Experiments run only when named: they need root and minutes (`memvisor bench guest`,
/// `memvisor bench blk`), terabytes of address space (`memvisor bench scale`), /dev/kvm
/// (`memvisor bench kvm`), or the server binary (`memvisor bench qmp`).
pub fn on_request() -> Vec<Box<dyn Experiment>> {
    vec![
        Box::new(guest::Guest),
        Box::new(blk::BlkBench),
        Box::new(scale::Scale),
        Box::new(kvm::KvmMemslots),
        Box::new(qmp::Qmp),
    ]
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
/// To add one: write `src/<name>.rs` with a type implementing [`Experiment`], declare it
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
        Box::new(blk_throttle::BlkThrottle),
    ]
}

/// Whether the benchmark runs as root (the experiments that start QEMU or qemu-storage-daemon
/// in the harness's root need it).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no arguments and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The server binary for the experiments that start one (`memvisor-bench blk`): `$MEMVISOR` if
/// set, else `target/release/memvisor` under the source tree `top`, which `cargo build --release
/// -p memvisor-cli` brings up to date first (the benchmark is not the server; it drives it as a
/// user would). Without cargo, an existing binary is used as it is.
pub fn server_binary(top: &std::path::Path) -> Result<std::path::PathBuf, String> {
    if let Some(bin) = std::env::var_os("MEMVISOR") {
        return Ok(bin.into());
    }
    let bin = top.join("target/release/memvisor");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let built = std::process::Command::new(cargo)
        .current_dir(top)
        .args([
            "build",
            "--release",
            "-p",
            "memvisor-cli",
            "--bin",
            "memvisor",
        ])
        .status();
    match built {
        Ok(s) if s.success() => Ok(bin),
        _ if bin.exists() => Ok(bin),
        Ok(s) => Err(format!(
            "cargo build --release -p memvisor-cli failed ({s}); build the server, or set \
             MEMVISOR=PATH to one"
        )),
        Err(e) => Err(format!(
            "no {} and cannot run cargo to build it ({e}); set MEMVISOR=PATH to a server \
             binary",
            bin.display()
        )),
    }
}

/// How big the experiments go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Small sizes: the whole suite in minutes (the README gives its time on one machine).
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
    /// One paragraph: how it measures. Which seed it reproduces is [`Experiment::seeds`].
    fn about(&self) -> &'static str;
    /// The seed documents this experiment reproduces; none by default.
    fn seeds(&self) -> &'static [seeds::Seed] {
        &[]
    }
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

/// A ratio for a table cell, its lowest–highest across runs in brackets when there was more
/// than one: `1.12x (0.95–1.30)` (an en dash, so the range does not read as a subtraction).
pub fn ratio_cell(s: &Stats) -> String {
    if s.runs > 1 {
        format!("{:.2}x ({:.2}–{:.2})", s.median, s.min, s.max)
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
    /// A context that draws no progress bars; see [`Ctx::with_progress`].
    pub fn new(mode: Mode, runs: Option<u32>) -> Ctx {
        Ctx {
            mode,
            runs,
            replay: Vec::new(),
            draw_progress: false,
        }
    }

    /// Whether [`Ctx::progress`] bars may be drawn. The runner turns this on only when both
    /// stdout and stderr are terminals and `--json` was not given, so captured or piped output
    /// never carries a bar.
    pub fn with_progress(mut self, draw: bool) -> Ctx {
        self.draw_progress = draw;
        self
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
            enabled: self.draw_progress,
            bar: None,
        }
    }
}

/// A progress bar on stderr, drawn by `indicatif`. Experiments call [`Progress::inc`] between
/// measurements, never inside a timed loop, so drawing costs nothing that is measured. The bar
/// appears only once a task has run for [`PROGRESS_DELAY`] (quick tasks draw nothing), is
/// redrawn at most 20 times a second (indicatif's rate limit) and is cleared when finished or
/// dropped. When the context says not to draw, no bar is ever created.
#[derive(Debug)]
pub struct Progress {
    label: String,
    total: u64,
    done: u64,
    start: Instant,
    enabled: bool,
    bar: Option<indicatif::ProgressBar>,
}

/// How long a task runs before its bar appears.
pub const PROGRESS_DELAY: Duration = Duration::from_secs(1);

impl Progress {
    /// Records `n` more steps done, and draws the bar if it is due.
    pub fn inc(&mut self, n: u64) {
        self.done = self.done.saturating_add(n);
        if !self.enabled {
            return;
        }
        if let Some(bar) = &self.bar {
            bar.set_position(self.done);
        } else if self.start.elapsed() >= PROGRESS_DELAY {
            let bar = indicatif::ProgressBar::with_draw_target(
                Some(self.total),
                indicatif::ProgressDrawTarget::stderr(),
            )
            .with_style(progress_style())
            .with_prefix(self.label.clone())
            .with_elapsed(self.start.elapsed())
            .with_position(self.done);
            bar.tick();
            self.bar = Some(bar);
        }
    }

    /// Clears the bar's line if it was drawn. Idempotent; also done on drop.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `lookup: populate [#######-----------------------]  25% 2/8 3s`: no time-left estimate, which
/// misleads over a handful of uneven steps.
fn progress_style() -> indicatif::ProgressStyle {
    const TEMPLATE: &str = "{prefix} [{bar:30}] {percent:>3}% {pos}/{len} {elapsed}";
    indicatif::ProgressStyle::with_template(TEMPLATE)
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("#-")
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
        assert_eq!(ratio_cell(&r), "2.00x (1.50–4.00)");
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

    /// A bar appears only when the runner allows it and the task has run long enough, follows
    /// the steps done, and is gone after `finish`.
    #[test]
    fn progress_is_quiet_unless_allowed_and_late() {
        let long_ago = Instant::now() - 2 * PROGRESS_DELAY;

        let mut quiet = Ctx::new(Mode::Quick, None).progress("quiet", 10);
        quiet.start = long_ago;
        quiet.inc(3);
        assert_eq!(quiet.done, 3);
        assert!(quiet.bar.is_none(), "Ctx::new never draws");

        let ctx = Ctx::new(Mode::Quick, None).with_progress(true);
        let mut fresh = ctx.progress("fresh", 10);
        fresh.inc(3);
        assert!(fresh.bar.is_none(), "nothing drawn within the first second");

        let mut late = ctx.progress("late", 10);
        late.start = long_ago;
        late.inc(3);
        late.inc(4);
        let bar = late.bar.as_ref().expect("a bar once the delay has passed");
        assert_eq!((bar.position(), bar.length()), (7, Some(10)));
        assert!(
            bar.elapsed() >= 2 * PROGRESS_DELAY,
            "elapsed counts from the start"
        );
        late.finish();
        assert!(late.bar.is_none());
        late.finish();
    }
}
