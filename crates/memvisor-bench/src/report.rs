//! Turns finished experiments into output. A [`Section`] is one experiment together with its
//! [`Outcome`]; the same list of sections is printed as text on the terminal
//! ([`Section::to_text`]), serialized as the single JSON object of `--json` and `results.json`
//! ([`to_json`]), and written as `report.md` plus one `<stem>.svg` per chart ([`write()`]).
//! Which seeds an experiment reproduces comes from [`Experiment::seeds`] alone, for all three.

use super::machine::Machine;
use super::seeds::{self, Seed};
use super::{Experiment, Mode, Outcome, Row, charts};
use anyhow::{Context, Result, bail};
use serde::Serialize;
use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

/// How to read the numbers, said once at the top of report.md and of the terminal output;
/// tables that report means instead say so in their title and note.
pub const READING: &str = "Every figure is the median of its runs (a run's own figure averages \
    its many operations, e.g. ns per call; a ratio is the median of the per-run ratios) unless \
    its table says means, and a bracketed range such as (0.95–1.30) goes from the lowest to the \
    highest value across those runs.";

/// One experiment that ran, with what it produced.
pub struct Section<'a> {
    pub experiment: &'a dyn Experiment,
    pub outcome: Outcome,
}

impl Section<'_> {
    /// Tables, chart files, notes and skipped cases, for the terminal.
    pub fn to_text(&self) -> String {
        let (e, o) = (self.experiment, &self.outcome);
        let heading = format!(
            "{} — {}{}",
            e.name(),
            e.title(),
            seeds::heading_suffix(e.seeds())
        );
        let mut out = format!("\n== {heading} ==\n");
        if o.tables.is_empty() && !o.skipped.is_empty() {
            out += "\nnothing measured: every case was skipped\n\n";
        }
        for table in &o.tables {
            out += &format!("\n{}", table.to_text());
        }
        if !o.charts.is_empty() {
            out += "\n";
        }
        for (stem, _) in &o.charts {
            out += &format!("chart: {stem}.svg\n");
        }
        for note in &o.notes {
            out += &format!("note: {note}\n");
        }
        for skipped in &o.skipped {
            out += &format!("skipped: {skipped}\n");
        }
        out
    }
}

#[derive(Serialize)]
struct Results<'a> {
    machine: &'a Machine,
    mode: Mode,
    experiments: Vec<ExperimentInfo>,
    results: Vec<&'a Row>,
}

/// What `results.json` says about each experiment that ran; its rows carry its `name`.
#[derive(Serialize)]
struct ExperimentInfo {
    name: &'static str,
    title: &'static str,
    /// The seeds it reproduces, as in report.md: empty for memvisor's own measurements.
    seeds: &'static [Seed],
}

/// `{"machine": {...}, "mode": "quick"|"full", "experiments": [{"name", "title", "seeds"}, ...],
/// "results": [row, ...]}`, pretty-printed.
pub fn to_json(machine: &Machine, mode: Mode, sections: &[Section]) -> Result<String> {
    let experiments = sections
        .iter()
        .map(|s| ExperimentInfo {
            name: s.experiment.name(),
            title: s.experiment.title(),
            seeds: s.experiment.seeds(),
        })
        .collect();
    let results = Results {
        machine,
        mode,
        experiments,
        results: sections.iter().flat_map(|s| &s.outcome.rows).collect(),
    };
    Ok(serde_json::to_string_pretty(&results)?)
}

/// Writes `report.md`, `results.json` and the charts into `dir` (which must exist) and returns the
/// paths written, `report.md` first.
pub fn write(
    dir: &Path,
    machine: &Machine,
    mode: Mode,
    sections: &[Section],
) -> Result<Vec<PathBuf>> {
    let mut files = vec![
        (dir.join("report.md"), markdown(machine, mode, sections)),
        (
            dir.join("results.json"),
            to_json(machine, mode, sections)? + "\n",
        ),
    ];
    let mut stems = HashSet::new();
    for s in sections {
        for (stem, chart) in &s.outcome.charts {
            let valid = !stem.is_empty()
                && stem
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !valid {
                bail!(
                    "experiment `{}` named a chart `{stem}`: chart stems must be non-empty and use only letters, digits, '-' and '_'",
                    s.experiment.name()
                );
            }
            if !stems.insert(stem.as_str()) {
                bail!(
                    "chart stem `{stem}` is used twice (last by experiment `{}`): start stems with the experiment name to keep them unique",
                    s.experiment.name()
                );
            }
            files.push((dir.join(format!("{stem}.svg")), charts::render(chart)?));
        }
    }
    for (path, contents) in &files {
        fs::write(path, contents).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(files.into_iter().map(|(path, _)| path).collect())
}

fn markdown(machine: &Machine, mode: Mode, sections: &[Section]) -> String {
    let mut out = format!(
        "# memvisor benchmark report\n\n{}\n\nMode: {} · {} · memvisor {}\n\n{READING}\n",
        machine.describe(),
        mode.as_str(),
        machine.date,
        machine.memvisor_version
    );
    for s in sections {
        let (e, o) = (s.experiment, &s.outcome);
        let suffix = seeds::heading_suffix(e.seeds());
        out += &format!("\n## {} — {}{suffix}\n\n", e.name(), e.title());
        if let Some(line) = seeds::reproduces_line(e.seeds()) {
            out += &format!("{line} ");
        }
        out += &format!("{}\n", e.about());
        if o.tables.is_empty() && !o.skipped.is_empty() {
            out += "\nNothing measured: every case was skipped (see below).\n";
        }
        for table in &o.tables {
            out += &format!("\n{}", table.to_markdown());
        }
        for (stem, chart) in &o.charts {
            let alt = chart.title.replace('[', "(").replace(']', ")");
            out += &format!("\n![{alt}]({stem}.svg)\n");
        }
        for (heading, items) in [("Notes", &o.notes), ("Skipped", &o.skipped)] {
            if !items.is_empty() {
                out += &format!("\n{heading}:\n\n");
                for item in items {
                    out += &format!("- {item}\n");
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Better, Chart, ChartGroup, Ctx, Row, Table, measure};

    /// A tiny experiment that exercises every part of an [`Outcome`].
    struct Fake;

    impl Experiment for Fake {
        fn name(&self) -> &'static str {
            "fake"
        }
        fn title(&self) -> &'static str {
            "counting <fast>"
        }
        fn about(&self) -> &'static str {
            "Counts; exists only to test the framework."
        }
        fn seeds(&self) -> &'static [Seed] {
            &[seeds::SEED_000, seeds::SEED_001]
        }
        fn run(&self, ctx: &mut Ctx) -> Result<Outcome> {
            let mut out = Outcome::default();
            let mut table = Table::new("loop time", &["case", "variant", "ns"]);
            let mut groups = Vec::new();
            let mut progress = ctx.progress("fake", 2);
            for case in ["small", "big"] {
                let mut bars = Vec::new();
                for (variant, base) in [("slow", 100.0), ("fast", 10.0)] {
                    let mut i = 0.0;
                    let stats = measure(ctx.runs_or(3), || {
                        i += 1.0;
                        base + i
                    });
                    out.rows
                        .push(Row::new("fake", case, variant, "time", "ns", &stats));
                    let median = format!("{:.1}", stats.median);
                    table.push(vec![case.into(), variant.into(), median]);
                    bars.push((variant.into(), stats.median));
                }
                groups.push(ChartGroup {
                    label: case.into(),
                    bars,
                });
                progress.inc(1);
            }
            let mut chart = Chart::new("loop [time]", "case", "ns per loop", Better::Lower, true);
            chart.groups = groups;
            out.tables.push(table);
            out.charts.push(("fake-loop".into(), chart));
            out.notes.push("a note".into());
            out.skipped.push("huge: needs root".into());
            Ok(out)
        }
    }

    fn fake_section(runs: Option<u32>) -> Section<'static> {
        let outcome = Fake.run(&mut Ctx::new(Mode::Quick, runs)).unwrap();
        Section {
            experiment: &Fake,
            outcome,
        }
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let unique = format!("memvisor-{tag}-{}", std::process::id());
        let dir = std::env::temp_dir().join(unique);
        let _ = fs::remove_dir_all(&dir); // left over from an aborted run
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn writes_markdown_json_and_svg() {
        let dir = temp_dir("report");
        let machine = Machine::detect();
        let sections = [fake_section(None)];
        let paths = write(&dir, &machine, Mode::Full, &sections).unwrap();
        let names: Vec<_> = paths
            .iter()
            .map(|p| p.strip_prefix(&dir).unwrap())
            .collect();
        assert_eq!(
            names,
            [
                Path::new("report.md"),
                Path::new("results.json"),
                Path::new("fake-loop.svg")
            ]
        );
        let md = fs::read_to_string(&paths[0]).unwrap();
        for want in [
            "# memvisor benchmark report",
            &machine.describe(),
            "Mode: full",
            READING,
            "## fake — counting <fast> (“vfio/type1: Batch page pinning”, seed 000; \
             “vfio/type1: optimize vfio_unpin_pages_remote() for large folio”, seed 001)\n\n\
             Reproduces seed 000, “vfio/type1: \
             Batch page pinning” (shared/seeds/000_bacae2283cd0fb79.txt); seed 001, “vfio/type1: \
             optimize vfio_unpin_pages_remote() for large folio” \
             (shared/seeds/001_a6f90f1f11b89d32.txt). Counts; exists",
            "**loop time**",
            "| small | slow | 102.0 |",
            "![loop (time)](fake-loop.svg)",
            "Notes:\n\n- a note\n",
            "Skipped:\n\n- huge: needs root\n",
        ] {
            assert!(md.contains(want), "report.md lacks {want:?}:\n{md}");
        }
        let json: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&paths[1]).unwrap()).unwrap();
        assert_eq!(json["mode"], "full");
        assert_eq!(json["results"].as_array().unwrap().len(), 4);
        // The JSON names the same seeds, with the same titles, as the Markdown.
        let seeds = json["experiments"][0]["seeds"].as_array().unwrap();
        assert_eq!(seeds.len(), 2);
        for seed in seeds {
            let (id, title) = (
                seed["id"].as_str().unwrap(),
                seed["title"].as_str().unwrap(),
            );
            assert!(md.contains(&format!("seed {id}, “{title}”")), "{id}: {md}");
        }
        assert!(fs::read_to_string(&paths[2]).unwrap().starts_with("<svg"));
        fs::remove_dir_all(&dir).unwrap();

        let text = sections[0].to_text();
        for want in [
            "== fake — counting <fast> (“vfio/type1: Batch page pinning”, seed 000; \
             “vfio/type1: optimize vfio_unpin_pages_remote() for large folio”, seed 001) ==",
            "loop time",
            "chart: fake-loop.svg",
            "note: a note",
            "skipped: huge: needs root",
        ] {
            assert!(text.contains(want), "text lacks {want:?}:\n{text}");
        }
    }

    #[test]
    fn an_experiment_that_skipped_everything_says_so() {
        let mut section = fake_section(None);
        section.outcome.tables.clear();
        let text = section.to_text();
        assert!(
            text.contains("nothing measured: every case was skipped"),
            "{text}"
        );
        assert!(text.contains("skipped: huge: needs root"), "{text}");
        let md = markdown(&Machine::detect(), Mode::Quick, &[section]);
        assert!(md.contains("Nothing measured"), "{md}");
        assert!(md.contains("Skipped:\n\n- huge: needs root\n"), "{md}");
    }

    #[test]
    fn json_has_exact_field_names() {
        let text = to_json(&Machine::detect(), Mode::Quick, &[fake_section(Some(5))]).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let keys = |v: &serde_json::Value| {
            let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
            keys.sort();
            keys.join(" ")
        };
        assert_eq!(keys(&json), "experiments machine mode results");
        let experiment = &json["experiments"][0];
        assert_eq!(keys(experiment), "name seeds title");
        assert_eq!(experiment["name"], "fake");
        assert_eq!(keys(&experiment["seeds"][1]), "file id title");
        assert_eq!(experiment["seeds"][1]["id"], "001");
        assert_eq!(experiment["seeds"][1]["file"], "001_a6f90f1f11b89d32.txt");
        assert_eq!(json["mode"], "quick");
        assert_eq!(
            keys(&json["machine"]),
            "caches cores cpu_core cpu_id cpu_model date hostname kernel memory_gib memvisor_version thp virtual_machine"
        );
        let row = &json["results"][0];
        assert_eq!(
            keys(row),
            "case experiment max median metric min runs unit variant"
        );
        assert_eq!(
            (row["experiment"].as_str(), row["runs"].as_u64()),
            (Some("fake"), Some(5))
        );
        let stats = ["median", "min", "max"].map(|k| row[k].as_f64().unwrap());
        assert_eq!(stats, [103.0, 101.0, 105.0]);
    }

    #[test]
    fn rejects_bad_or_duplicate_stems() {
        let dir = temp_dir("stems");
        for stems in [&["../evil"][..], &["same", "same"], &[""]] {
            let mut section = fake_section(None);
            section.outcome.charts = stems
                .iter()
                .map(|s| {
                    (
                        s.to_string(),
                        Chart::new("t", "x", "y", Better::Lower, false),
                    )
                })
                .collect();
            assert!(write(&dir, &Machine::detect(), Mode::Quick, &[section]).is_err());
            assert!(!dir.join("report.md").exists(), "nothing written on error");
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
