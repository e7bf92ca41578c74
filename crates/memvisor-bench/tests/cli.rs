//! End-to-end checks of the `memvisor-bench` binary: argument parsing, error reporting and the
//! quick runs' JSON, run as a child process exactly as a user would.

use std::process::{Command, Output};
use std::sync::Mutex;

/// Held by the tests that grow the hugetlb pool when run as root, so that one never sees
/// another's pages.
static HUGETLB_POOL: Mutex<()> = Mutex::new(());

fn lock_pool() -> std::sync::MutexGuard<'static, ()> {
    HUGETLB_POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Prints "skipped: <what>" on the process's real stderr. libtest captures `eprintln!` of
/// passing tests (it shows only with `--nocapture`); a write to `io::stderr()` it does not.
fn say_skipped(what: &str) {
    use std::io::Write;
    // One write: `writeln!` writes each piece apart, and tests running beside this one would
    // cut the line.
    let _ = std::io::stderr().write_all(format!("skipped: {what}\n").as_bytes());
}

/// Whether report.md lists `case` as skipped ("- <case>: needs ..."); if so the test says so on
/// stderr and leaves the case's checks out. A case may be skipped for RLIMIT_MEMLOCK only when
/// this process (and so the benchmark it started) may not lock 1 GiB.
fn skipped(report: &str, case: &str) -> bool {
    let Some(why) = report
        .lines()
        .find_map(|l| l.strip_prefix("- ")?.strip_prefix(case)?.strip_prefix(": "))
        .filter(|why| why.starts_with("needs "))
    else {
        return false;
    };
    if why.contains("RLIMIT_MEMLOCK") {
        assert!(
            memvisor_bench::limits::check_lock(1 << 30).is_err(),
            "{case} skipped, yet this process may lock 1 GiB: {why}"
        );
    }
    say_skipped(&format!("{case}: {why}"));
    true
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_memvisor-bench"))
        .args(args)
        .output()
        .expect("run the memvisor-bench binary")
}

/// A row's statistics are a positive median between its min and max.
fn check_stats(r: &serde_json::Value) {
    let (min, median, max) = (
        r["min"].as_f64().unwrap(),
        r["median"].as_f64().unwrap(),
        r["max"].as_f64().unwrap(),
    );
    assert!(median.is_finite() && median > 0.0, "{r}");
    assert!(min <= median && median <= max, "{r}");
}

/// `memvisor-bench EXP --quick --json --runs 1 --out OUT_DIR`: must succeed; its stdout parsed.
fn quick_json(experiment: &str, out_dir: &std::path::Path) -> serde_json::Value {
    let out = bench(&[
        experiment,
        "--quick",
        "--json",
        "--runs",
        "1",
        "--out",
        out_dir.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON object")
}

#[test]
fn bench_help_lists_options() {
    let out = bench(&["--help"]);
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for flag in [
        "[EXPERIMENT]...",
        "--quick",
        "--full",
        "--out <DIR>",
        "--json",
        "--runs <N>",
    ] {
        assert!(help.contains(flag), "help lacks {flag}:\n{help}");
    }
}

#[test]
fn unknown_experiment_fails_listing_known_ones() {
    let out_dir =
        std::env::temp_dir().join(format!("memvisor-bench-unknown-{}", std::process::id()));
    let out = bench(&["no-such-experiment", "--out", out_dir.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        out.stdout.is_empty(),
        "nothing on stdout when the arguments are wrong"
    );
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(
        err.contains("unknown experiment `no-such-experiment`"),
        "{err}"
    );
    assert!(err.contains("known experiments: "), "{err}");
    for e in memvisor_bench::all() {
        assert!(err.contains(e.name()), "{err}");
    }
    assert!(
        !out_dir.exists(),
        "nothing is written before the arguments are checked"
    );
}

#[test]
fn quick_and_full_conflict() {
    let out = bench(&["--quick", "--full"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("cannot be used with")
    );
}

/// The CI smoke run: `memvisor-bench lookup --quick --json` gives well-formed rows for every
/// variant and writes the report.
#[test]
fn lookup_json_has_rows_for_every_variant() {
    let out_dir =
        std::env::temp_dir().join(format!("memvisor-bench-lookup-{}", std::process::id()));
    let json = quick_json("lookup", &out_dir);
    assert_eq!(json["mode"], "quick");
    let rows = json["results"].as_array().expect("results array");
    for variant in ["binary", "vm-hint", "cursor", "vm-memory"] {
        for metric in ["Populate memory time", "Iteration 2 time", "lookup"] {
            let found: Vec<_> = rows
                .iter()
                .filter(|r| r["variant"] == variant && r["metric"] == metric)
                .collect();
            assert!(!found.is_empty(), "no {metric} row for {variant}");
            for r in found {
                assert_eq!(r["experiment"], "lookup");
                check_stats(r);
                assert!(r["runs"].as_u64().unwrap() >= 1, "{r}");
                assert!(
                    !r["case"].as_str().unwrap().is_empty()
                        && !r["unit"].as_str().unwrap().is_empty()
                );
            }
        }
    }
    let report = std::fs::read_to_string(out_dir.join("report.md")).expect("report.md written");
    assert!(report.contains("Seed 003"), "report has the seed table");
    // The seed reference: the same id and title in results.json and in report.md.
    let experiments = json["experiments"].as_array().expect("experiments array");
    assert_eq!(experiments.len(), 1);
    assert_eq!(experiments[0]["name"], "lookup");
    let seed = &experiments[0]["seeds"][0];
    assert_eq!(seed["id"], "003");
    let title = seed["title"].as_str().expect("seed title");
    assert!(
        report.contains(&format!("Reproduces seed 003, “{title}”")),
        "{report}"
    );
    for (chart, y_title) in [
        ("lookup-iteration2.svg", "ms per pass"),
        ("lookup-ns.svg", "ns per lookup"),
    ] {
        let svg = std::fs::read_to_string(out_dir.join(chart)).expect("chart written");
        assert!(svg.starts_with("<svg"), "{chart}");
        // Says which way is better, what the y axis measures, and names the variants.
        for want in ["lower is better", y_title, "cursor", "vm-memory"] {
            assert!(svg.contains(want), "{chart} lacks {want:?}");
        }
    }
    std::fs::remove_dir_all(out_dir).unwrap();
}

/// `memvisor-bench pin-pages --quick --json --runs 1` gives pin and unpin rows for every
/// variant, on the single calls and on both replays, and writes its charts.
#[test]
fn pin_pages_json_has_rows_for_every_variant() {
    let out_dir =
        std::env::temp_dir().join(format!("memvisor-bench-pin-pages-{}", std::process::id()));
    let json = {
        let _pool = lock_pool();
        quick_json("pin-pages", &out_dir)
    };
    let rows = json["results"].as_array().expect("results array");
    let report = std::fs::read_to_string(out_dir.join("report.md")).expect("report.md written");
    // Without root, a small RLIMIT_MEMLOCK skips the cases whose pins it cannot hold.
    let cases: Vec<(&str, &str)> = [
        ("4 KiB, 1 page", "pin"),
        ("4 KiB, 512 pages", "unpin"),
        ("THP, 512 pages", "pin"),
        ("replay vfio-ccw guest boot", "pin+unpin per call"),
        ("replay fio", "pin+unpin per call"),
    ]
    .into_iter()
    .filter(|(case, _)| !skipped(&report, case))
    .collect();
    let ran = |case: &str| cases.iter().any(|c| c.0 == case);
    for variant in ["per-page", "runs", "adaptive"] {
        for &(case, metric) in &cases {
            let r = rows
                .iter()
                .find(|r| r["variant"] == variant && r["case"] == case && r["metric"] == metric)
                .unwrap_or_else(|| panic!("no {case} / {metric} row for {variant}"));
            assert_eq!(r["experiment"], "pin-pages");
            assert_eq!(r["unit"], "ns");
            let median = r["median"].as_f64().unwrap();
            assert!(median.is_finite() && median > 0.0, "{r}");
        }
    }
    if ran("4 KiB, 1 page") {
        assert!(
            report.contains("seed before"),
            "report has the seed's figures"
        );
        assert!(out_dir.join("pin-pages-call.svg").exists());
    }
    if ran("replay fio") {
        assert!(out_dir.join("pin-pages-replay.svg").exists());
    }
    std::fs::remove_dir_all(out_dir).unwrap();
}

/// `memvisor-bench report --quick --json --runs 1`: for every kind of memory the discard
/// reclaims everything, and with a tenth pinned it skips exactly the pinned bytes and reclaims
/// the rest. hugetlbfs is checked when it ran (it needs root to reserve huge pages).
#[test]
fn report_json_reclaims_all_but_the_pins() {
    let out_dir =
        std::env::temp_dir().join(format!("memvisor-bench-report-{}", std::process::id()));
    let json = {
        let _pool = lock_pool();
        quick_json("report", &out_dir)
    };
    let report = std::fs::read_to_string(out_dir.join("report.md")).expect("report.md written");
    let rows: Vec<&serde_json::Value> = json["results"]
        .as_array()
        .expect("results array")
        .iter()
        .filter(|r| r["experiment"] == "report")
        .collect();
    for r in &rows {
        check_stats(r);
    }
    let metric = |case: &str, variant: &str, metric: &str| {
        rows.iter()
            .find(|r| r["case"] == case && r["variant"] == variant && r["metric"] == metric)
            .map(|r| r["median"].as_f64().unwrap())
    };
    let mut kinds = vec!["4 KiB private anon", "THP", "memfd"];
    if metric("hugetlbfs 2 MiB", "discard", "discard throughput").is_some() {
        kinds.push("hugetlbfs 2 MiB");
    }
    let mut pinned_ran = false;
    for kind in kinds {
        let pinned = "discard, 10% pinned";
        // Without root the pins need a large RLIMIT_MEMLOCK; report.md says when it was short.
        let pins_skipped = skipped(&report, &format!("{kind}, {pinned}"));
        for variant in [
            "discard",
            "balloon queue",
            pinned,
            "floor (one syscall)",
            "floor (2 MiB steps)",
        ] {
            if variant == pinned && pins_skipped {
                continue;
            }
            assert!(
                metric(kind, variant, "discard throughput").is_some(),
                "no {kind} / {variant} throughput row"
            );
        }
        // Nothing left resident after a discard: the (zero) resident-after row is left out.
        let before = metric(kind, "discard", "resident before").expect("resident before");
        assert!(before >= 1024.0, "{kind}: {before} MiB resident before");
        assert_eq!(metric(kind, "discard", "resident after"), None, "{kind}");
        // Through the virtio queue too: all of it discarded, nothing left.
        let queued = metric(kind, "balloon queue", "discarded").expect("queue discarded");
        assert_eq!(queued, before, "{kind}");
        assert_eq!(
            metric(kind, "balloon queue", "resident after"),
            None,
            "{kind}"
        );
        assert!(
            metric(kind, "touch after discard", "touch").is_some(),
            "{kind}"
        );
        if pins_skipped {
            continue;
        }
        pinned_ran = true;
        let skipped = metric(kind, pinned, "skipped pinned").expect("skipped pinned");
        let kept = metric(kind, pinned, "pinned").expect("pinned");
        let after = metric(kind, pinned, "resident after").expect("resident after");
        assert!(
            skipped > 0.0 && skipped == kept,
            "{kind}: {skipped} vs {kept}"
        );
        assert!(
            after < before && (after - kept).abs() < 1.0,
            "{kind}: {after}"
        );
    }
    assert!(metric("4 KiB private anon", "MADV_FREE", "LazyFree").is_some());
    assert_eq!(
        report.contains("Pinned pages across a report"),
        pinned_ran,
        "{report}"
    );
    for chart in ["report-gbps.svg", "report-touch.svg"] {
        assert!(out_dir.join(chart).exists(), "{chart}");
    }
    std::fs::remove_dir_all(out_dir).unwrap();
}

/// 2 MiB huge pages in the kernel's pool.
fn nr_hugepages() -> u64 {
    std::fs::read_to_string("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
        .expect("read nr_hugepages")
        .trim()
        .parse()
        .expect("nr_hugepages is a number")
}

/// Ctrl-C while `memvisor-bench pin-pages` holds extra huge pages (it reserves them first
/// thing, as root) puts the pool back to its size before and ends the process by SIGINT.
#[test]
fn ctrl_c_gives_the_hugetlb_pool_back() {
    use std::os::unix::process::ExitStatusExt;
    use std::time::{Duration, Instant};
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        say_skipped("ctrl_c_gives_the_hugetlb_pool_back needs root (it grows the hugetlb pool)");
        return;
    }
    let _pool = lock_pool();
    let before = nr_hugepages();
    let out_dir =
        std::env::temp_dir().join(format!("memvisor-bench-sigint-{}", std::process::id()));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_memvisor-bench"));
    cmd.args(["pin-pages", "--quick", "--runs", "1", "--out"])
        .arg(&out_dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    // A test run started in the background of a script inherits SIGINT ignored, and memvisor
    // rightly leaves an ignored signal ignored; Ctrl-C at a terminal is not ignored, so the
    // child gets the default action back, as a terminal's foreground job has it.
    // SAFETY: between fork and exec only signal(2), which is async-signal-safe, is called.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start memvisor");
    let start = Instant::now();
    while nr_hugepages() <= before {
        let gone = child.try_wait().expect("poll memvisor");
        if gone.is_some() || start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            say_skipped(
                "ctrl_c_gives_the_hugetlb_pool_back: the pool never grew (no free \
                 memory for huge pages?)",
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let pid = libc::pid_t::try_from(child.id()).expect("a pid fits pid_t");
    // SAFETY: kill only sends a signal, to our own child, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let status = child.wait().expect("wait for memvisor");
    assert_eq!(status.signal(), Some(libc::SIGINT), "{status:?}");
    assert_eq!(nr_hugepages(), before, "the pool is back to its size");
    let _ = std::fs::remove_dir_all(out_dir);
}
