//! The `memvisor-bench` command. It picks experiments from the registry
//! ([`memvisor_bench::all`]), runs them one after another with a shared [`Ctx`], prints each
//! one's tables as it finishes and writes the report. Human-readable output goes to stdout, or
//! to stderr with `--json` so that stdout carries exactly one JSON object. A failing experiment
//! does not stop the others; the report covers those that succeeded and the exit code is
//! non-zero. With no arguments it runs the quick suite (the README's first command).

use anyhow::{Context, Result, bail};
use clap::Parser;
use memvisor_bench::{self as bench, Ctx, Experiment, Mode, machine::Machine, report};
use std::io::{self, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "memvisor-bench",
    version,
    about = "Reproduce the kernel patches' measurements (the seeds, listed in the report) side by \
             side and write report.md, results.json and SVG charts"
)]
struct BenchArgs {
    /// Experiments to run, in this order: lookup, translate, rw, pin, map-unmap, pin-pages,
    /// report, iotlb, vfio-user, blk-throttle (the default: all of these); and, only when named, guest
    /// (real-guest trials) and blk (the blk back end beside qemu-storage-daemon under libblkio),
    /// both need root and minutes; scale (cost against size: dirty log drains at guest sizes up
    /// to 1 TiB of sparse memory, translate, map+unmap, IOTLB and pin rows); and kvm (memslot
    /// updates, MMIO exits and dirty harvests through memvisor-kvm): needs /dev/kvm; and qmp (a
    /// query-stats round trip on a live server's QMP control socket: median, p99)
    #[arg(value_name = "EXPERIMENT")]
    experiments: Vec<String>,
    /// Small sizes: the whole suite in minutes (the default; the README gives its time)
    #[arg(long, conflicts_with = "full")]
    quick: bool,
    /// The seeds' sizes, where memory allows
    #[arg(long)]
    full: bool,
    /// Directory for the report, created if missing
    #[arg(long, value_name = "DIR", default_value = "target/memvisor-report")]
    out: PathBuf,
    /// Print one JSON object with all results on stdout; tables go to stderr
    #[arg(long)]
    json: bool,
    /// Repetitions per measurement, overriding each experiment's default
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    runs: Option<u32>,
    /// A recorded IOTLB stream for the iotlb experiment (`memvisor vhost-user-blk --record-iotlb`, a test-hooks server);
    /// repeatable. Default: the real-guest trials' recordings under target/guest/run, if any
    #[arg(long, value_name = "FILE")]
    replay: Vec<PathBuf>,
}

fn main() -> ExitCode {
    match run_bench(&BenchArgs::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The registered experiments named on the command line, in that order; all of them if none.
fn select(names: &[String]) -> Result<Vec<Box<dyn Experiment>>> {
    let mut registry = bench::all();
    if names.is_empty() {
        return Ok(registry);
    }
    registry.extend(bench::on_request());
    let known: Vec<&str> = registry.iter().map(|e| e.name()).collect();
    if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
        bail!(
            "unknown experiment `{bad}`; known experiments: {} (omit names to run all but guest)",
            known.join(", ")
        );
    }
    let mut selected = Vec::new();
    for name in names {
        if let Some(i) = registry.iter().position(|e| e.name() == name) {
            selected.push(registry.remove(i));
        }
    }
    Ok(selected)
}

fn run_bench(args: &BenchArgs) -> Result<()> {
    let experiments = select(&args.experiments)?;
    let mode = if args.full { Mode::Full } else { Mode::Quick };
    std::fs::create_dir_all(&args.out).with_context(|| {
        format!(
            "cannot create output directory {}; pass a writable one with --out",
            args.out.display()
        )
    })?;
    let machine = Machine::detect();
    let mut human: Box<dyn Write> = if args.json {
        Box::new(io::stderr())
    } else {
        Box::new(io::stdout())
    };
    writeln!(
        human,
        "{}\nmode: {}\n{}",
        machine.describe(),
        mode.as_str(),
        report::READING
    )?;

    // Progress bars only for a person watching: never in captured or piped output, nor with
    // --json, whose stderr carries the tables instead.
    let progress = !args.json && io::stdout().is_terminal() && io::stderr().is_terminal();
    let mut ctx = Ctx::new(mode, args.runs).with_progress(progress);
    ctx.replay = args.replay.clone();
    let mut sections = Vec::new();
    let mut failed = Vec::new();
    for (i, experiment) in experiments.iter().enumerate() {
        human.flush()?;
        eprintln!(
            "[{}/{}] running {}",
            i + 1,
            experiments.len(),
            experiment.name()
        );
        match experiment.run(&mut ctx) {
            Ok(outcome) => {
                let section = report::Section {
                    experiment: experiment.as_ref(),
                    outcome,
                };
                write!(human, "{}", section.to_text())?;
                sections.push(section);
            }
            Err(err) => {
                eprintln!("error: experiment `{}` failed: {err:#}", experiment.name());
                failed.push(experiment.name());
            }
        }
    }

    let skipped: Vec<String> = sections
        .iter()
        .filter(|s| !s.outcome.skipped.is_empty())
        .map(|s| format!("{} ({})", s.experiment.name(), s.outcome.skipped.len()))
        .collect();
    if !skipped.is_empty() {
        writeln!(
            human,
            "\nskipped cases in: {}; why: the `skipped:` lines above (also in report.md)",
            skipped.join(", ")
        )?;
    }
    let paths = report::write(&args.out, &machine, mode, &sections)?;
    if args.json {
        println!("{}", report::to_json(&machine, mode, &sections)?);
    }
    writeln!(human, "\nreport written to {}", paths[0].display())?;
    human.flush()?;
    if !failed.is_empty() {
        bail!(
            "{} experiment(s) failed: {}; see the messages above (the report covers the others)",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}
