//! `memvisor bench iotlb`: what a vIOMMU's IOTLB traffic costs the back end.
//!
//! Behind a guest IOMMU a vhost-user back end learns every translation from the frontend: it
//! sends MISS, QEMU answers with an `IOTLB_MSG` UPDATE (one guest page, usually 4 KiB), the device
//! uses the translation, and the guest's unmap arrives as INVALIDATE. This experiment replays such
//! a stream against memvisor's device space ([`FrontendMemory`]: IOVA -> frontend user address
//! -> slot -> host address, permissions, cutting invalidation) and, side by side, against
//! vm-memory's own IOTLB (`vm_memory::iommu::Iotlb`, a range map from IOVA to guest physical
//! address; it keeps no host address, pins or dirty state, so it does less per message).
//!
//! Streams: two synthetic ones always (strict: every buffer mapped page by page and invalidated
//! after use, as `iommu.strict=1` does; lazy: no per-buffer invalidation, the whole space flushed
//! every 256 buffers, as the guest's flush queue does), and recordings of real guests when there
//! are any: `--replay FILE`, else `target/guest/run/*/iotlb.rec` written by the vIOMMU trials
//! (`memvisor vhost-user-blk --record-iotlb`).
//!
//! memvisor is replayed twice: on a bare space, and with guards in use, as in a real back end
//! (blk takes a scatter-gather guard per request: `DmaSpace::hold_sg`): after each update the
//! page is held once and let go, as a request would, outside the timings. A space whose guards
//! were ever used must look at their holds on every invalidation, so that row shows what a
//! real device pays.
//!
//! Reported per stream: ns per UPDATE, per INVALIDATE and per first translation after an update
//! (the device's translate-after-miss), each timed one by one with the clock's own cost
//! subtracted; messages per second for the whole stream replayed without timers; and, as the
//! floor every message pays anyway, one message round trip over a Unix socket between two
//! threads (what QEMU's `REPLY_ACK` wait costs before the back end does any work).
//!
//! **Cold caches.** Replayed back to back, a message finds everything it touches in the cache
//! the last one left warm. A real back end does not: between two messages it sleeps in `poll`
//! while the guest (and, for QEMU, its vCPU threads) run, and the next message finds the index
//! cold. In the strict `blk` trial (`guest/trial.sh blk --iommu=strict`, a TCG guest) the back end
//! measured 0.5-2 µs for most updates and 1-5 µs for most invalidations, several times the warm
//! replay's figure. So memvisor with guards in use and vm-memory are also replayed with the
//! caches made cold before every [`COLD_EVERY`]th update or invalidation: [`COLD_BYTES`] are
//! written, a byte per cache line (8 times this machine's 512 KiB L2, the size that brought the
//! replay to the trial's figures, 2026-11-30), and only those messages are timed.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use memvisor::dma::{SgBuf, SgWalk};
use memvisor::{Backing, BackingKind, Iova, Prot};
use memvisor_testkit::vhost::record::{self, Event};
use memvisor_vhost::FrontendMemory;
use memvisor_vhost::proto::Region;
use vm_memory::GuestAddress;
use vm_memory::Permissions;
use vm_memory::iommu::Iotlb;

use super::{
    Better, Chart, ChartGroup, Ctx, Experiment, Outcome, Row, Stats, Table, clock_cost, measure,
};

pub struct IotlbReplay;

/// Bytes written to make the caches cold before a timed message of a cold replay.
const COLD_BYTES: usize = 4 << 20;
/// A cold replay times (and makes the caches cold before) one update or invalidation in this
/// many, so that it takes seconds, not minutes.
const COLD_EVERY: u64 = 32;

use memvisor::PAGE_4K as PAGE;

/// One stream to replay.
struct Stream {
    name: String,
    events: Vec<Event>,
    /// Messages per second the guest sent, for recordings.
    recorded_rate: Option<f64>,
}

impl Experiment for IotlbReplay {
    fn name(&self) -> &'static str {
        "iotlb"
    }
    fn title(&self) -> &'static str {
        "vIOMMU IOTLB traffic: update, invalidate, translate-after-miss"
    }
    fn about(&self) -> &'static str {
        "Replays IOTLB message streams (synthetic strict and lazy guests, and recordings of real \
         guests when present) against memvisor's device space and vm-memory's Iotlb; ns per \
         update, invalidate and first translation, messages per second, and a Unix socket round \
         trip as the floor."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(5);
        let buffers = match ctx.mode {
            super::Mode::Quick => 2_000,
            super::Mode::Full => 20_000,
        };
        let mut streams = vec![synthetic(true, buffers), synthetic(false, buffers)];
        let mut out = Outcome::default();
        for path in recordings(ctx) {
            match std::fs::read_to_string(&path)
                .map_err(anyhow::Error::from)
                .and_then(|t| Ok(record::parse(&t)?))
            {
                Ok(events) if events.iter().any(|e| matches!(e, Event::Update { .. })) => {
                    let rate = recorded_rate(&events);
                    streams.push(Stream {
                        name: format!("recorded: {}", short_name(&path)),
                        events,
                        recorded_rate: rate,
                    });
                }
                Ok(_) => out
                    .skipped
                    .push(format!("{}: no IOTLB updates recorded", path.display())),
                Err(e) => out.skipped.push(format!("{}: {e}", path.display())),
            }
        }
        let clock = clock_cost();
        let floor = measure(runs, round_trip_ns);
        let mut table = Table::new(
            "IOTLB replay: ns per message (lower is better), messages per second (higher is better)",
            &[
                "stream",
                "messages",
                "IOTLB",
                "update ns",
                "invalidate ns",
                "translate after miss ns",
                "messages/s",
                "guest sent/s",
            ],
        );
        let mut chart = Chart::new(
            "IOTLB update cost by message stream",
            "IOTLB message stream replayed",
            "ns per UPDATE message",
            Better::Lower,
            false,
        );
        let mut progress = ctx.progress("iotlb", (streams.len() * KINDS.len()) as u64);
        for s in &streams {
            let messages = s
                .events
                .iter()
                .filter(|e| !matches!(e, Event::Region { .. } | Event::Table))
                .count();
            let mut group = ChartGroup {
                label: s.name.clone(),
                bars: Vec::new(),
            };
            for kind in KINDS {
                let variant = kind.name();
                let mut per = [Vec::new(), Vec::new(), Vec::new()];
                for _ in 0..runs {
                    let t = replay(&s.events, kind, Some(clock))?;
                    for (samples, v) in per.iter_mut().zip(t.per_op) {
                        samples.push(v);
                    }
                }
                // Without timers a cold kind replays as its warm twin does: not measured again.
                let whole = match kind.cold() {
                    true => None,
                    false => Some(measure(runs, || {
                        let t0 = Instant::now();
                        replay(&s.events, kind, None).map(|_| ()).unwrap_or(());
                        messages as f64 / t0.elapsed().as_secs_f64()
                    })),
                };
                let stats: Vec<Stats> = per.iter().map(|v| Stats::from_samples(v)).collect();
                for (k, metric) in ["update", "invalidate", "translate after miss"]
                    .iter()
                    .enumerate()
                {
                    if stats[k].median.is_nan() {
                        continue;
                    }
                    out.rows
                        .push(Row::new("iotlb", &s.name, variant, metric, "ns", &stats[k]));
                }
                if let Some(whole) = &whole {
                    out.rows.push(Row::new(
                        "iotlb", &s.name, variant, "messages", "1/s", whole,
                    ));
                }
                let cell = |st: &Stats| {
                    if st.median.is_nan() {
                        "-".to_string()
                    } else {
                        format!("{:.0}", st.median)
                    }
                };
                table.push(vec![
                    s.name.clone(),
                    messages.to_string(),
                    variant.into(),
                    cell(&stats[0]),
                    cell(&stats[1]),
                    cell(&stats[2]),
                    whole.map_or("-".into(), |w| format!("{:.0}", w.median)),
                    s.recorded_rate.map_or("-".into(), |r| format!("{r:.0}")),
                ]);
                group.bars.push((variant.into(), stats[0].median));
                progress.inc(1);
            }
            chart.groups.push(group);
        }
        progress.finish();
        out.rows.push(Row::new(
            "iotlb",
            "floor",
            "unix socket round trip",
            "round trip",
            "ns",
            &floor,
        ));
        table.note = Some(format!(
            "{runs} replays. Each update, invalidate and first translation is timed \
             alone; the clock's own cost ({clock:.0} ns, measured) is subtracted. messages/s: the \
             whole stream replayed without timers (MISS lines count as messages; replay does \
             nothing for them). Floor: one 64-byte message and its 8-byte ack over a Unix socket \
             between two threads, {:.0} ns, paid by every message before any \
             back end work. Caches cold: one update or invalidation in {COLD_EVERY} timed, each \
             after {} MiB were written a byte per cache line, as the guest's run between two \
             messages leaves them (the first translation after it is not timed). vm-memory's \
             Iotlb maps IOVA to guest physical addresses only (no host address, permissions per \
             entry, no pins or dirty log).",
            floor.median,
            COLD_BYTES >> 20
        ));
        out.tables.push(table);
        out.charts.push(("iotlb_update".into(), chart));
        Ok(out)
    }
}

/// `--replay` files, else the trials' recordings.
fn recordings(ctx: &Ctx) -> Vec<PathBuf> {
    if !ctx.replay.is_empty() {
        return ctx.replay.clone();
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("target/guest/run")
        .into_iter()
        .flatten()
        .flatten()
        .map(|d| d.path().join("iotlb.rec"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    found
}

fn short_name(path: &std::path::Path) -> String {
    let dir = path.parent().and_then(|p| p.file_name());
    dir.unwrap_or(path.as_os_str())
        .to_string_lossy()
        .into_owned()
}

/// Messages per second over the recording's span.
fn recorded_rate(events: &[Event]) -> Option<f64> {
    let times: Vec<u64> = events
        .iter()
        .filter_map(|e| match *e {
            Event::Update { t, .. } | Event::Invalidate { t, .. } | Event::Miss { t, .. } => {
                Some(t)
            }
            Event::Region { .. } | Event::Table => None,
        })
        .collect();
    let span = times.last()?.saturating_sub(*times.first()?);
    (span > 0).then(|| times.len() as f64 / (span as f64 / 1e9))
}

/// A synthetic guest: `buffers` DMA buffers of 1 to 64 pages (most of one page, as the real
/// blk trial's histogram), IOVAs handed out top-down below 4 GiB and reused; each page missed
/// and updated one by one. `strict`: each buffer invalidated after use; else the whole space
/// every 256 buffers.
fn synthetic(strict: bool, buffers: usize) -> Stream {
    const MEM: u64 = 1 << 30;
    const UADDR: u64 = 0x7f00_0000_0000;
    let mut events = vec![
        Event::Table,
        Event::Region {
            gpa: 0,
            size: MEM,
            uaddr: UADDR,
        },
    ];
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut top = 1u64 << 32;
    for b in 0..buffers {
        let pages = match next() % 100 {
            0..=87 => 1,
            88..=97 => 1 + next() % 16,
            _ => 1 + next() % 64,
        };
        if top < (1 << 31) {
            top = 1 << 32;
        }
        top -= pages * PAGE;
        let iova = top;
        let perm = if next() % 2 == 0 { 1 } else { 3 };
        for p in 0..pages {
            let gpa = (next() % (MEM / PAGE)) * PAGE;
            events.push(Event::Miss {
                t: 0,
                iova: iova + p * PAGE,
                perm,
            });
            events.push(Event::Update {
                t: 0,
                iova: iova + p * PAGE,
                size: PAGE,
                uaddr: UADDR + gpa,
                perm,
            });
        }
        if strict {
            events.push(Event::Invalidate {
                t: 0,
                iova,
                size: pages * PAGE,
            });
        } else if b % 256 == 255 {
            events.push(Event::Invalidate {
                t: 0,
                iova: 0,
                size: u64::MAX,
            });
            top = 1 << 32;
        }
    }
    Stream {
        name: format!("synthetic {}", if strict { "strict" } else { "lazy" }),
        events,
        recorded_rate: None,
    }
}

/// Mean ns per update, invalidate and first translation in one replay (NaN for a kind that
/// did not occur).
struct Timings {
    per_op: [f64; 3],
}

/// Every kind, in the table's order.
const KINDS: [Kind; 5] = [
    Kind::Bare,
    Kind::Guards,
    Kind::Peer,
    Kind::GuardsCold,
    Kind::PeerCold,
];

/// Which IOTLB a replay runs on, and how.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// memvisor's device space, no guard ever taken.
    Bare,
    /// memvisor's, each updated page held by a guard once after its update (as a request).
    Guards,
    /// vm-memory's `Iotlb`.
    Peer,
    /// As `Guards`, timing one message in [`COLD_EVERY`], each with the caches made cold.
    GuardsCold,
    /// As `Peer`, the same way.
    PeerCold,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Bare => "memvisor",
            Kind::Guards => "memvisor, guards in use",
            Kind::Peer => "vm-memory Iotlb",
            Kind::GuardsCold => "memvisor, guards in use, caches cold",
            Kind::PeerCold => "vm-memory Iotlb, caches cold",
        }
    }

    fn peer(self) -> bool {
        matches!(self, Kind::Peer | Kind::PeerCold)
    }

    fn guards(self) -> bool {
        matches!(self, Kind::Guards | Kind::GuardsCold)
    }

    fn cold(self) -> bool {
        matches!(self, Kind::GuardsCold | Kind::PeerCold)
    }
}

/// Makes the caches cold: writes a byte in every cache line of a buffer of [`COLD_BYTES`].
struct Chill(Vec<u8>);

impl Chill {
    fn new() -> Chill {
        Chill(vec![0; COLD_BYTES])
    }

    fn run(&mut self) {
        for line in self.0.chunks_mut(64) {
            line[0] = line[0].wrapping_add(1);
        }
        std::hint::black_box(&mut self.0);
    }
}

/// The IOTLB under test.
enum Side {
    Memvisor(FrontendMemory),
    Peer(Iotlb, Vec<Region>),
}

impl Side {
    fn new(peer: bool, regions: &[Region]) -> anyhow::Result<Side> {
        if peer {
            return Ok(Side::Peer(Iotlb::new(), regions.to_vec()));
        }
        let mut mem = FrontendMemory::new(&memvisor_vhost::ProcessState::new(
            memvisor::SharedMappings::global(),
            memvisor::PinRegistry::global(),
        ))?;
        // The frontend's memory as descriptors (sparse memfds: nothing is touched); the
        // memory table maps its own view of them.
        let mut fds = Vec::new();
        for r in regions {
            let b = Backing::new(BackingKind::Memfd, r.size)?;
            fds.push(
                b.fd()
                    .expect("a memfd backing has a descriptor")
                    .try_clone_to_owned()?,
            );
        }
        mem.set_table(regions, fds)?;
        mem.set_iotlb(true)?;
        Ok(Side::Memvisor(mem))
    }

    fn update(&mut self, iova: u64, size: u64, uaddr: u64, perm: u8) -> anyhow::Result<()> {
        match self {
            Side::Memvisor(mem) => {
                let prot = match perm {
                    1 => Prot::READ,
                    2 => Prot::WRITE,
                    _ => Prot::RW,
                };
                mem.iotlb_update(iova, size, uaddr, prot)?;
            }
            Side::Peer(tlb, regions) => {
                let gpa = regions
                    .iter()
                    .find(|r| uaddr.wrapping_sub(r.user_addr) < r.size)
                    .map(|r| r.gpa + (uaddr - r.user_addr))
                    .ok_or_else(|| {
                        anyhow::anyhow!("update of user address {uaddr:#x}: no region")
                    })?;
                tlb.set_mapping(
                    GuestAddress(iova),
                    GuestAddress(gpa),
                    size as usize,
                    permissions(perm),
                )
                .map_err(|e| anyhow::anyhow!("vm-memory Iotlb: {e}"))?;
            }
        }
        Ok(())
    }

    fn invalidate(&mut self, iova: u64, size: u64) -> anyhow::Result<()> {
        match self {
            Side::Memvisor(mem) => {
                mem.iotlb_invalidate(iova, size)?;
            }
            Side::Peer(tlb, _) => {
                // Its range is [iova, iova + size) in u64: clamp "to the end".
                let size = size.min(u64::MAX - iova);
                tlb.invalidate_mapping(GuestAddress(iova), size as usize);
            }
        }
        Ok(())
    }

    /// The host (memvisor) or guest physical (peer) address of `[iova, iova + size)`.
    fn translate(&self, iova: u64, size: u64, perm: u8) -> Option<u64> {
        match self {
            Side::Memvisor(mem) => {
                let access = if perm & 2 != 0 {
                    Prot::WRITE
                } else {
                    Prot::READ
                };
                mem.dma()
                    .translate(Iova(iova), size, access)
                    .ok()
                    .map(|t| t.hva.0)
            }
            Side::Peer(tlb, _) => {
                Iotlb::lookup(tlb, GuestAddress(iova), size as usize, permissions(perm))
                    .ok()
                    .and_then(|mut it| it.next())
                    .map(|m| m.base.0)
            }
        }
    }
}

fn permissions(perm: u8) -> Permissions {
    match perm {
        1 => Permissions::Read,
        2 => Permissions::Write,
        _ => Permissions::ReadWrite,
    }
}

/// Replays `events` on a fresh IOTLB; with `clock` (the cost of one timer read, ns), times
/// each operation (a cold kind: one update or invalidation in [`COLD_EVERY`], after making the
/// caches cold, and no translation).
fn replay(events: &[Event], kind: Kind, clock: Option<f64>) -> anyhow::Result<Timings> {
    let peer = kind.peer();
    let mut side: Option<Side> = None;
    let mut regions = Vec::new();
    let mut sum = [0f64; 3];
    let mut count = [0u64; 3];
    let mut chill = kind.cold().then(Chill::new);
    let mut changes = 0u64;
    let mut timed = |k: usize, f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<()> {
        if let Some(chill) = chill.as_mut() {
            // Cold: only the chosen changes are timed, each right after the caches went cold.
            if k == 2 || clock.is_none() {
                return f();
            }
            changes += 1;
            if changes % COLD_EVERY != 0 {
                return f();
            }
            chill.run();
        }
        match clock {
            Some(c) => {
                let t0 = Instant::now();
                f()?;
                sum[k] += (t0.elapsed().as_nanos() as f64 - c).max(0.0);
                count[k] += 1;
                Ok(())
            }
            None => f(),
        }
    };
    for e in events {
        match *e {
            Event::Table => {
                side = None;
                regions.clear();
            }
            Event::Region { gpa, size, uaddr } => {
                regions.push(Region {
                    gpa,
                    size,
                    user_addr: uaddr,
                    mmap_offset: 0,
                });
            }
            Event::Update {
                iova,
                size,
                uaddr,
                perm,
                ..
            } => {
                if side.is_none() {
                    side = Some(Side::new(peer, &regions)?);
                }
                let s = side.as_mut().expect("just set");
                timed(0, &mut || s.update(iova, size, uaddr, perm))?;
                let mut hit = None;
                timed(2, &mut || {
                    hit = s.translate(iova, size, perm);
                    Ok(())
                })?;
                if hit.is_none() {
                    anyhow::bail!("iova {iova:#x} not translated right after its update");
                }
                if let (true, Side::Memvisor(mem)) = (kind.guards(), &*s) {
                    request(mem, iova, size, perm)?;
                }
            }
            Event::Invalidate { iova, size, .. } => {
                if let Some(s) = side.as_mut() {
                    timed(1, &mut || s.invalidate(iova, size))?;
                }
            }
            Event::Miss { .. } => {}
        }
    }
    let per_op = std::array::from_fn(|k| {
        if count[k] == 0 {
            f64::NAN
        } else {
            sum[k] / count[k] as f64
        }
    });
    Ok(Timings { per_op })
}

/// What a device's request does with a page just updated: holds it (one scatter-gather
/// walk) and lets go.
fn request(mem: &FrontendMemory, iova: u64, size: u64, perm: u8) -> anyhow::Result<()> {
    let prot = if perm & 2 != 0 {
        Prot::WRITE
    } else {
        Prot::READ
    };
    let buf = SgBuf {
        iova: Iova(iova),
        len: size,
        prot,
    };
    match mem.dma().hold_sg(&[buf])? {
        SgWalk::Held(guard) => drop(guard),
        SgWalk::Missed(m) => anyhow::bail!("iova {iova:#x} missed right after its update: {m:?}"),
    }
    Ok(())
}

/// ns per round trip: a 64-byte message one way, an 8-byte ack back, between two threads.
fn round_trip_ns() -> f64 {
    const N: usize = 20_000;
    let Ok((mut a, mut b)) = UnixStream::pair() else {
        return f64::NAN;
    };
    let echo = std::thread::spawn(move || {
        let mut m = [0u8; 64];
        for _ in 0..N {
            if b.read_exact(&mut m).is_err() || b.write_all(&m[..8]).is_err() {
                return;
            }
        }
    });
    let msg = [7u8; 64];
    let mut ack = [0u8; 8];
    let t0 = Instant::now();
    for _ in 0..N {
        if a.write_all(&msg).is_err() || a.read_exact(&mut ack).is_err() {
            return f64::NAN;
        }
    }
    let ns = t0.elapsed().as_nanos() as f64 / N as f64;
    let _ = echo.join();
    ns
}
