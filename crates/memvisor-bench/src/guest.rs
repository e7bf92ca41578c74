//! `memvisor bench guest`: what the real-guest trials measured, as tables and a chart.
//!
//! The trials (`guest/trial.sh`) boot a Debian kernel under QEMU 11.1 (TCG) on memvisor's
//! vhost-user back ends; they need root and a few minutes, so this experiment is not part of the
//! default run. It runs `guest/trial.sh blk`, `blk --peer` and `balloon` from the current
//! directory when it can (root, the script present), and otherwise reports the artifacts the
//! last trials left in `target/guest/run/` — or says, in the skipped list, what to run.
//!
//! Shown: the blk trial's guest-side times beside qemu-storage-daemon's export serving the same
//! guest and image (TCG makes the guest's CPU the bottleneck, so this compares correctness and
//! gross cost, not device speed); the pinned-page histogram of the blk requests a real guest
//! sent (the question behind "vfio iommu type1: Improve vfio_iommu_type1_pin_pages
//! performance", seed 002); the guest memory's allocated bytes over the balloon trial.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{Better, Chart, ChartGroup, Ctx, Experiment, Outcome, Row, Stats, Table, is_root};

pub struct Guest;

const RUN: &str = "target/guest/run";

/// Seconds a guest line reports: the number before " s" after `key`.
fn seconds_after(console: &str, key: &str) -> Option<f64> {
    let line = console.lines().find(|l| l.contains(key))?;
    let rest = &line[line.find(key)? + key.len()..];
    rest.split_whitespace().find_map(|w| w.parse::<f64>().ok())
}

fn read(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// Runs one trial if possible; returns why not otherwise.
fn run_trial(args: &[&str]) -> Result<(), String> {
    if !Path::new("guest/trial.sh").exists() {
        return Err("guest/trial.sh not found: run from the memvisor source tree".into());
    }
    if !is_root() {
        return Err("needs root (QEMU runs in a mount namespace and a chroot)".into());
    }
    // The trials run the server binary: built (or found) the way `bench blk` finds it.
    let here = std::env::current_dir().map_err(|e| format!("no current directory: {e}"))?;
    let server = crate::server_binary(&here)?;
    let status = Command::new("guest/trial.sh")
        .args(args)
        .env("MEMVISOR", server)
        .stdout(std::process::Stdio::null())
        .status()
        .map_err(|e| format!("cannot run guest/trial.sh: {e}"))?;
    if !status.success() {
        return Err(format!("guest/trial.sh {} failed", args.join(" ")));
    }
    Ok(())
}

fn row(case: &str, variant: &str, metric: &str, unit: &str, v: f64) -> Row {
    Row::new(
        "guest",
        case,
        variant,
        metric,
        unit,
        &Stats {
            median: v,
            min: v,
            max: v,
            runs: 1,
        },
    )
}

impl Experiment for Guest {
    fn name(&self) -> &'static str {
        "guest"
    }

    fn title(&self) -> &'static str {
        "A real Linux guest on memvisor's vhost-user back ends (QEMU 11.1 TCG, Debian kernel)"
    }

    fn about(&self) -> &'static str {
        "Runs guest/trial.sh blk, blk --peer and balloon (root; about 2.5 minutes) or reads what \
         they left in target/guest/run. blk: the guest writes 32 MiB of random data with \
         O_DIRECT, drops its caches and reads it back (sequential O_DIRECT, page cache, 300 random \
         4 KiB O_DIRECT reads) and compares; memvisor's back end beside qemu-storage-daemon's \
         export on the same image and guest. balloon: one memvisor process serves blk and \
         balloon; the guest fills and frees 512 MiB, then follows a 256 MiB inflate and a \
         deflate; the host samples the guest memory's allocated bytes twice a second."
    }

    fn run(&self, _ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let mut out = Outcome::default();
        for args in [&["blk"][..], &["blk", "--peer"], &["balloon"]] {
            if let Err(why) = run_trial(args) {
                out.notes.push(format!(
                    "did not run guest/trial.sh {}: {why}; reporting its last artifacts if any",
                    args.join(" ")
                ));
                break;
            }
        }
        let run = PathBuf::from(RUN);

        // blk beside the peer.
        let mut blk = Table::new(
            "blk trial, seconds as the guest measured them (lower is better; one run each)",
            &[
                "back end",
                "write 32 MiB (1 MiB + 4 KiB O_DIRECT)",
                "read 32 MiB (64 KiB O_DIRECT)",
                "300 random 4 KiB O_DIRECT reads",
                "verdict",
            ],
        );
        let mut found = false;
        for (dir, name) in [("blk", "memvisor"), ("blk-peer", "qemu-storage-daemon")] {
            let Some(console) = read(&run.join(dir).join("console.log")) else {
                out.skipped.push(format!(
                    "blk trial against {name}: no {RUN}/{dir}/console.log; run guest/trial.sh blk{} as root",
                    if name == "memvisor" { "" } else { " --peer" }
                ));
                continue;
            };
            found = true;
            let cell = |v: Option<f64>| v.map_or("-".into(), |s| format!("{s:.2}"));
            let w = seconds_after(&console, "WRITTEN in");
            let r = seconds_after(&console, "64k read in");
            let q = seconds_after(&console, "reads: 300 in");
            let verdict = console
                .lines()
                .find(|l| l.starts_with("RESULT blk"))
                .map_or("no verdict".into(), |l| {
                    l.trim_start_matches("RESULT blk ").trim().to_string()
                });
            for (metric, v) in [("write", w), ("sequential read", r), ("random reads", q)] {
                if let Some(v) = v {
                    out.rows.push(row("blk", name, metric, "s", v));
                }
            }
            blk.push(vec![name.into(), cell(w), cell(r), cell(q), verdict]);
        }
        if found {
            blk.note = Some(
                "QEMU runs the guest with TCG here (a stock Linux does not boot on this machine's \
                 /dev/kvm), so guest CPU time dominates these figures."
                    .into(),
            );
            out.tables.push(blk);
        }

        // The npage histogram of the guest's requests.
        if let Some(stats) = read(&run.join("blk/stats.json")) {
            let v: serde_json::Value = serde_json::from_str(&stats)?;
            let mut t = Table::new(
                &format!(
                    "blk requests by pinned 4 KiB pages, from the real guest (the question of {})",
                    super::seeds::SEED_002.named()
                ),
                &["pages (up to)", "requests", "share"],
            );
            let hist: Vec<(u64, u64)> = v["npage_histogram"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|p| Some((p[0].as_u64()?, p[1].as_u64()?)))
                        .collect()
                })
                .unwrap_or_default();
            let total: u64 = hist.iter().map(|h| h.1).sum::<u64>().max(1);
            for (pages, n) in &hist {
                t.push(vec![
                    pages.to_string(),
                    n.to_string(),
                    format!("{:.1}%", *n as f64 * 100.0 / total as f64),
                ]);
                out.rows.push(row(
                    "blk npages",
                    &format!("<= {pages}"),
                    "requests",
                    "count",
                    *n as f64,
                ));
            }
            t.note = Some(format!(
                "{} reads and {} writes; every request's pages were pinned through \
                 DmaSpace::pin_pages for the duration of its preadv/pwritev.",
                v["reads"], v["writes"]
            ));
            out.tables.push(t);
        }

        // Balloon: memory over time.
        match read(&run.join("balloon/memory.csv")) {
            None => out.skipped.push(format!(
                "balloon trial: no {RUN}/balloon/memory.csv; run guest/trial.sh balloon as root"
            )),
            Some(csv) => {
                let samples: Vec<(f64, f64, String)> = csv
                    .lines()
                    .filter_map(|l| {
                        let mut f = l.split(',');
                        let t = f.next()?.parse().ok()?;
                        let b: f64 = f.next()?.parse().ok()?;
                        Some((t, b / (1 << 20) as f64, f.next().unwrap_or("").to_string()))
                    })
                    .collect();
                let peak = samples
                    .iter()
                    .filter(|s| s.2 == "report")
                    .map(|s| s.1)
                    .fold(0.0, f64::max);
                let after_peak: Vec<&(f64, f64, String)> = samples
                    .iter()
                    .skip_while(|s| s.1 < peak)
                    .take_while(|s| s.2 == "report")
                    .collect();
                let low = after_peak.iter().map(|s| s.1).fold(peak, f64::min);
                let t_peak = after_peak.first().map_or(0.0, |s| s.0);
                let t_80 = after_peak
                    .iter()
                    .find(|s| peak - s.1 >= 0.8 * 512.0)
                    .map(|s| s.0 - t_peak);
                let inflated = samples
                    .iter()
                    .filter(|s| s.2 == "inflate")
                    .map(|s| s.1)
                    .fold(f64::MAX, f64::min);
                let mut t = Table::new(
                    "balloon trial: guest memory allocated on the host (memfd blocks)",
                    &["measure", "value"],
                );
                t.push(vec![
                    "peak after filling 512 MiB".into(),
                    format!("{peak:.0} MiB"),
                ]);
                t.push(vec![
                    "lowest after freeing it".into(),
                    format!("{low:.0} MiB"),
                ]);
                t.push(vec![
                    "given back".into(),
                    format!(
                        "{:.0} MiB ({:.0}% of 512 MiB)",
                        peak - low,
                        (peak - low) / 5.12
                    ),
                ]);
                t.push(vec![
                    "80% given back after".into(),
                    t_80.map_or("not reached".into(), |s| {
                        format!("{s:.1} s from the peak sample")
                    }),
                ]);
                if inflated < f64::MAX {
                    t.push(vec![
                        "lowest while inflated to 256 MiB".into(),
                        format!("{inflated:.0} MiB"),
                    ]);
                }
                if let Some(stats) = read(&run.join("balloon/stats.json")) {
                    let v: serde_json::Value = serde_json::from_str(&stats)?;
                    let b = &v["balloon"][0];
                    t.push(vec![
                        "back end".into(),
                        format!(
                            "{} report chains, {} MiB discarded, {} MiB skipped (pinned), {} pages \
                             inflated, {} deflated",
                            b["chains"],
                            b["discarded"].as_u64().unwrap_or(0) >> 20,
                            b["skipped_pinned"].as_u64().unwrap_or(0) >> 20,
                            b["inflated_pages"],
                            b["deflated_pages"]
                        ),
                    ]);
                }
                out.rows
                    .push(row("balloon", "memvisor", "given back", "MiB", peak - low));
                out.tables.push(t);
                // Two-second buckets for the chart.
                // Lower is more given back to the host, which is the balloon's job.
                let mut chart = Chart::new(
                    "Guest memory allocated on the host during the balloon trial",
                    "seconds since the trial started, phase",
                    "MiB of guest memory allocated on the host",
                    Better::Lower,
                    false,
                );
                let mut next = 0.0;
                for s in &samples {
                    if s.0 >= next {
                        chart.groups.push(ChartGroup {
                            label: format!("{:.0}s {}", s.0, s.2),
                            bars: vec![("allocated".into(), s.1)],
                        });
                        next = s.0 + 2.0;
                    }
                }
                out.charts.push(("guest-balloon-memory".into(), chart));
            }
        }
        Ok(out)
    }
}
