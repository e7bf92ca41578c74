//! `memvisor bench vfio-user`: a vfio-user DMA table under a real guest's map/unmap stream.
//!
//! The vfio-user trial records every `DMA_MAP` / `DMA_UNMAP` QEMU sent to memvisor's server
//! (`memvisor vfio-user --record`, lines `M iova size offset prot`, `U iova size`, `A`). This
//! experiment replays such streams — the recordings under `target/guest/run/*/dma.rec`, and a
//! synthetic one shaped like the trial's scale phase (4,096 single-page maps a page apart, then
//! their unmaps) — three ways:
//!
//! * **server path**: what the server does per message — a fresh descriptor (`dup`, as each
//!   message brings one), [`SharedMappings::map_within`], `DmaSpace::map_backing`; `unmap`;
//! * **DmaSpace only**: the same maps on a backing made once: the table's own cost;
//! * **libvfio-user** (the C reference server's DMA table, `peers/libvfio-user/`), when its
//!   replay program has been built (`peers/libvfio-user/build.sh`): without descriptors (its
//!   table only) and with one mmapped per map (its server path).
//!
//! ns per map and per unmap are medians of per-message timings with the clock's cost removed.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use memvisor::{Backing, DmaConfig, DmaSpace, Iova, Prot, SharedMappings};

use super::{Ctx, Experiment, Outcome, Row, Stats, Table, clock_cost, measure};

pub struct VfioUserReplay;

const NAME: &str = "vfio-user";
const PEER: &str = "target/peers/replay-libvfio-user";

#[derive(Clone, Copy, Debug)]
enum Op {
    Map { iova: u64, size: u64, offset: u64 },
    Unmap { iova: u64, size: u64 },
    All,
}

fn parse(text: &str) -> anyhow::Result<Vec<Op>> {
    let num = |s: Option<&str>, line: usize| -> anyhow::Result<u64> {
        let s = s.ok_or_else(|| anyhow::anyhow!("line {line}: a field is missing"))?;
        let s = s.trim_start_matches("0x");
        u64::from_str_radix(s, 16).map_err(|e| anyhow::anyhow!("line {line}: {s:?}: {e}"))
    };
    let mut ops = Vec::new();
    for (i, l) in text.lines().enumerate() {
        let mut f = l.split_whitespace();
        match f.next() {
            None => {}
            Some(c) if c.starts_with('#') => {}
            Some("M") => ops.push(Op::Map {
                iova: num(f.next(), i + 1)?,
                size: num(f.next(), i + 1)?,
                offset: num(f.next(), i + 1)?,
            }),
            Some("U") => ops.push(Op::Unmap {
                iova: num(f.next(), i + 1)?,
                size: num(f.next(), i + 1)?,
            }),
            Some("A") => ops.push(Op::All),
            // Maps without a descriptor (a few at boot, or all of private guest RAM) are not
            // replayed: both peers' tables are measured with mapped files.
            Some("R") => {}
            Some(other) => anyhow::bail!("line {}: unknown record {other:?}", i + 1),
        }
    }
    Ok(ops)
}

fn synthetic(pages: u64) -> Vec<Op> {
    let mut ops: Vec<Op> = (0..pages)
        .map(|i| Op::Map {
            iova: 0x1_0000_0000 + i * 8192,
            size: 4096,
            offset: 0x100_0000 + i * 4096,
        })
        .collect();
    ops.extend((0..pages).map(|i| Op::Unmap {
        iova: 0x1_0000_0000 + i * 8192,
        size: 4096,
    }));
    ops
}

fn memfd(size: u64) -> anyhow::Result<OwnedFd> {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"memvisor-bench-vfio-user".as_ptr(), libc::MFD_CLOEXEC) };
    anyhow::ensure!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our descriptor; sparse, nothing is allocated.
    let r = unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) };
    anyhow::ensure!(r == 0, "ftruncate: {}", std::io::Error::last_os_error());
    Ok(fd)
}

/// Per-message timings of one replay: (map ns samples, unmap ns samples, refused).
fn replay(
    ops: &[Op],
    mem: &OwnedFd,
    server_path: bool,
    clock: f64,
) -> anyhow::Result<(Vec<f64>, Vec<f64>, u64)> {
    let dma = DmaSpace::new(DmaConfig::default())?;
    let file_len = {
        // SAFETY: fstat into a zeroed struct on our descriptor.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        unsafe { libc::fstat(mem.as_raw_fd(), &mut st) };
        st.st_size as u64
    };
    let whole: Option<Arc<Backing>> = if server_path {
        None
    } else {
        Some(Arc::new(Backing::from_fd(mem.try_clone()?, 0, file_len)?))
    };
    let (mut maps, mut unmaps, mut refused) = (Vec::new(), Vec::new(), 0);
    for op in ops {
        match *op {
            Op::Map { iova, size, offset } => {
                let t = Instant::now();
                let r = match &whole {
                    None => {
                        let fd = mem.try_clone()?;
                        SharedMappings::global()
                            .map_within(fd, offset, size)
                            .and_then(|(b, off)| {
                                dma.map_backing(Iova(iova), &b, off, size, Prot::RW)
                            })
                    }
                    Some(b) => dma.map_backing(Iova(iova), b, offset, size, Prot::RW),
                };
                maps.push((t.elapsed().as_nanos() as f64 - clock).max(0.0));
                refused += r.is_err() as u64;
            }
            Op::Unmap { iova, size } => {
                let t = Instant::now();
                let r = dma.unmap(Iova(iova), size);
                unmaps.push((t.elapsed().as_nanos() as f64 - clock).max(0.0));
                refused += r.is_err() as u64;
            }
            Op::All => {
                dma.unmap_all()?;
            }
        }
    }
    Ok((maps, unmaps, refused))
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// libvfio-user's replay of `path`: medians over `runs` of (ns per map, ns per unmap).
fn peer(path: &Path, mmap: bool, runs: u32) -> Option<(f64, f64)> {
    let mut cmd = std::process::Command::new(PEER);
    if mmap {
        cmd.arg("--mmap");
    }
    let out = cmd.arg(path).arg(runs.to_string()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let (mut m, mut u) = (Vec::new(), Vec::new());
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        m.push(v["ns_per_map"].as_f64()?);
        u.push(v["ns_per_unmap"].as_f64()?);
    }
    Some((median(&mut m), median(&mut u)))
}

impl Experiment for VfioUserReplay {
    fn name(&self) -> &'static str {
        NAME
    }
    fn title(&self) -> &'static str {
        "vfio-user DMA table: a real guest's DMA_MAP/DMA_UNMAP stream replayed"
    }
    fn about(&self) -> &'static str {
        "Replays the DMA_MAP/DMA_UNMAP streams the vfio-user trial recorded (and a synthetic \
         4,096-page stream) against memvisor's server path (descriptor, shared file mapping, \
         DmaSpace), DmaSpace alone, and libvfio-user's DMA table when its replay program is built \
         (peers/libvfio-user/build.sh); ns per map and per unmap."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(5);
        let mut out = Outcome::default();
        let dir = std::env::temp_dir().join(format!("memvisor-vfio-user-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let synth = dir.join("synthetic-4096-pages.rec");
        let mut text = String::new();
        for op in synthetic(4096) {
            match op {
                Op::Map { iova, size, offset } => {
                    text += &format!("M {iova:#x} {size:#x} {offset:#x} rw\n")
                }
                Op::Unmap { iova, size } => text += &format!("U {iova:#x} {size:#x}\n"),
                Op::All => text += "A\n",
            }
        }
        std::fs::write(&synth, text)?;
        let mut streams: Vec<(String, PathBuf)> =
            vec![("synthetic: 4,096 page maps".into(), synth)];
        for p in recordings(ctx) {
            let name = p
                .parent()
                .and_then(|d| d.file_name())
                .map_or("recording".into(), |d| d.to_string_lossy().into_owned());
            streams.push((format!("recorded: {name}"), p));
        }
        let clock = clock_cost();
        let have_peer = Path::new(PEER).is_file();
        if !have_peer {
            out.skipped.push(format!(
                "libvfio-user: no {PEER}; build it with peers/libvfio-user/build.sh (needs its \
                 source and meson)"
            ));
        }
        let mut table = Table::new(
            "vfio-user DMA table replay: ns per message (lower is better)",
            &[
                "stream", "maps", "unmaps", "table", "map ns", "unmap ns", "refused",
            ],
        );
        let mut progress = ctx.progress(NAME, streams.len() as u64);
        for (name, path) in &streams {
            let ops = match std::fs::read_to_string(path)
                .map_err(anyhow::Error::from)
                .and_then(|t| parse(&t))
            {
                Ok(ops) => ops,
                Err(e) => {
                    out.skipped.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            let maps = ops.iter().filter(|o| matches!(o, Op::Map { .. })).count();
            let unmaps = ops.iter().filter(|o| matches!(o, Op::Unmap { .. })).count();
            let end = ops
                .iter()
                .filter_map(|o| match o {
                    Op::Map { offset, size, .. } => Some(offset + size),
                    _ => None,
                })
                .max()
                .unwrap_or(4096);
            let mem = memfd(end.div_ceil(2 << 20) * (2 << 20))?;
            for (variant, server_path) in [
                ("memvisor server path", true),
                ("memvisor DmaSpace only", false),
            ] {
                let (mut m, mut u, mut refused) = (Vec::new(), Vec::new(), 0);
                for _ in 0..runs {
                    let (mut a, mut b, r) = replay(&ops, &mem, server_path, clock)?;
                    m.push(median(&mut a));
                    u.push(median(&mut b));
                    refused = r;
                }
                // A stream with no maps (or no unmaps) has no figure for them: no row, and a
                // dash in the table rather than NaN.
                let mut cell = |count: usize, what: &str, samples: &[f64]| {
                    if count == 0 {
                        return "—".to_string();
                    }
                    let stats = Stats::from_samples(samples);
                    out.rows
                        .push(Row::new(NAME, name, variant, what, "ns", &stats));
                    format!("{:.0}", stats.median)
                };
                let (map_ns, unmap_ns) = (cell(maps, "map", &m), cell(unmaps, "unmap", &u));
                table.push(vec![
                    name.clone(),
                    maps.to_string(),
                    unmaps.to_string(),
                    variant.into(),
                    map_ns,
                    unmap_ns,
                    refused.to_string(),
                ]);
            }
            if have_peer {
                for (variant, mmap) in [
                    ("libvfio-user, no fd", false),
                    ("libvfio-user, fd + mmap", true),
                ] {
                    match peer(path, mmap, runs) {
                        Some((m, u)) => {
                            let one = |v: f64| measure(1, || v);
                            out.rows
                                .push(Row::new(NAME, name, variant, "map", "ns", &one(m)));
                            out.rows
                                .push(Row::new(NAME, name, variant, "unmap", "ns", &one(u)));
                            table.push(vec![
                                name.clone(),
                                maps.to_string(),
                                unmaps.to_string(),
                                variant.into(),
                                format!("{m:.0}"),
                                format!("{u:.0}"),
                                "-".into(),
                            ]);
                        }
                        None => out.skipped.push(format!(
                            "{variant}: its replay of {} failed",
                            path.display()
                        )),
                    }
                }
            }
            progress.inc(1);
        }
        progress.finish();
        let _ = std::fs::remove_dir_all(&dir);
        table.note = Some(format!(
            "{runs} replays; a replay's own figure is its median per message; the clock's cost \
             ({clock:.0} ns) is subtracted. Refused: maps and unmaps the table refused in the \
             replay (a recording holds only what the server accepted, so 0 is expected). \
             libvfio-user removes only exact whole regions and answers ENOENT for anything else; \
             its figure is its replay program's median."
        ));
        out.tables.push(table);
        Ok(out)
    }
}

/// `--replay` files that parse as vfio-user recordings, else the trials' recordings.
fn recordings(ctx: &Ctx) -> Vec<PathBuf> {
    if !ctx.replay.is_empty() {
        return ctx
            .replay
            .iter()
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("dma"))
            })
            .cloned()
            .collect();
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("target/guest/run")
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join("dma.rec"))
        .filter(|p| p.is_file() && !p.to_string_lossy().contains("negative"))
        .collect();
    found.sort();
    found
}
