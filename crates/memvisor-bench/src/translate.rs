//! `memvisor bench translate`: the cost of turning an IOVA into a host address.
//!
//! A guest with a vIOMMU maps its DMA buffers one 4 KiB page at a time, so a device back end may
//! face tens of thousands of small mappings. This experiment builds N scattered 4 KiB mappings
//! (N = 1, 64, 10 000, 100 000; every other IOVA page left as a hole, host pages shuffled) and
//! times `DmaSpace::translate` (a snapshot load and an index lookup) against a per-thread
//! `DmaCursor` on three address patterns: all in one mapping (the cursor always hits),
//! hit-heavy (runs of 16 accesses in one mapping, as a device walking a buffer does) and
//! miss-heavy (every access in a random mapping). Each pattern is [`PATTERN`] addresses, cycled;
//! those over many mappings (hit-heavy and miss-heavy from 10 000 mappings up) are all different,
//! so that a large table is walked far beyond what the caches hold. A loop that only reads the
//! address list is the floor. It also reports what one map costs at that table size.

use std::collections::HashSet;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use memvisor::{Backing, BackingKind, DmaConfig, DmaSpace, Iova, Prot};

use super::{Better, Chart, ChartGroup, Ctx, Experiment, Outcome, Row, Table, ns_per_op};

pub struct Translate;

use memvisor::PAGE_4K as PAGE;
const COUNTS: [u64; 4] = [1, 64, 10_000, 100_000];
/// Addresses in a pattern: 65,536 (a power of two, the loop masks its index).
const PATTERN: usize = 1 << 16;
/// 8-byte aligned offsets in a 4 KiB page where a 64-byte access still fits.
const SPOTS: u64 = (PAGE - 64) / 8 + 1;

struct Space {
    dma: DmaSpace,
    count: u64,
    /// ns per map_backing call while building it.
    map_ns: f64,
    _backing: Arc<Backing>,
}

fn build(count: u64) -> anyhow::Result<Space> {
    let backing = Arc::new(Backing::new(BackingKind::PrivateAnon, count * PAGE)?);
    let dma = DmaSpace::new(DmaConfig {
        max_mappings: count.max(65535) as u32,
        ..Default::default()
    })?;
    let start = Instant::now();
    for i in 0..count {
        let host_page = i * 7919 % count;
        dma.map_backing(
            Iova(2 * i * PAGE),
            &backing,
            host_page * PAGE,
            PAGE,
            Prot::RW,
        )?;
    }
    let map_ns = start.elapsed().as_nanos() as f64 / count as f64;
    Ok(Space {
        dma,
        count,
        map_ns,
        _backing: backing,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Pattern {
    OneMapping,
    HitHeavy,
    MissHeavy,
}

impl Pattern {
    fn name(self) -> &'static str {
        match self {
            Pattern::OneMapping => "all hits",
            Pattern::HitHeavy => "hit-heavy (15/16)",
            Pattern::MissHeavy => "miss-heavy",
        }
    }
}

/// Whether the mappings `pattern` reaches hold 8 times [`PATTERN`] places for an access, so
/// that its addresses can all differ (and be drawn quickly).
fn room_for_distinct(space: &Space, pattern: Pattern) -> bool {
    let mappings = if pattern == Pattern::OneMapping {
        1
    } else {
        space.count
    };
    mappings * SPOTS >= 8 * PATTERN as u64
}

/// [`PATTERN`] IOVAs in `pattern` over the space's mappings, each the start of a 64-byte access
/// inside its mapping; all different where [`room_for_distinct`].
fn addresses(space: &Space, pattern: Pattern) -> Vec<u64> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let distinct = room_for_distinct(space, pattern);
    let mut seen = HashSet::new();
    let mut mapping = next() % space.count;
    let mut out = Vec::with_capacity(PATTERN);
    while out.len() < PATTERN {
        match pattern {
            Pattern::OneMapping => {}
            Pattern::HitHeavy if out.len() % 16 != 0 => {}
            _ => mapping = next() % space.count,
        }
        // A place taken already is drawn again, in the same mapping.
        loop {
            let iova = 2 * mapping * PAGE + next() % SPOTS * 8;
            if !distinct || seen.insert(iova) {
                out.push(iova);
                break;
            }
        }
    }
    out
}

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    LoopOnly,
    Space,
    Cursor,
}

/// ns per translation: `iters` translations cycling through `addrs`.
fn time(space: &Space, variant: Variant, addrs: &[u64], iters: u64) -> f64 {
    let mask = addrs.len() - 1;
    let mut cursor = space.dma.cursor();
    let mut sum = 0u64;
    let start = Instant::now();
    for i in 0..iters as usize {
        let iova = Iova(black_box(addrs[i & mask]));
        sum = sum.wrapping_add(match variant {
            Variant::LoopOnly => iova.0,
            Variant::Space => space
                .dma
                .translate(iova, 64, Prot::READ)
                .map_or(0, |t| t.hva.0),
            Variant::Cursor => cursor
                .translate(iova, 64, Prot::READ)
                .map_or(0, |t| t.hva.0),
        });
    }
    black_box(sum);
    start.elapsed().as_nanos() as f64 / iters as f64
}

impl Experiment for Translate {
    fn name(&self) -> &'static str {
        "translate"
    }

    fn title(&self) -> &'static str {
        "IOVA translation: DmaSpace::translate vs per-thread DmaCursor, 1 to 100 000 mappings"
    }

    fn about(&self) -> &'static str {
        "The device hot path. N scattered 4 KiB mappings (a vIOMMU guest's pattern); \
         ns per translation of a 64-byte access through DmaSpace::translate (no cursor: \
         snapshot load + index lookup) and through a DmaCursor, on all-hit, hit-heavy \
         (runs of 16 in one mapping) and miss-heavy (random mapping each time) address \
         patterns of 65,536 addresses; one thread. 'loop only' reads the address list and \
         nothing else. Targets: cursor hit <= 5 ns, miss <= 40 ns at 100 000 mappings."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(5);
        let mut out = Outcome::default();
        let patterns = [Pattern::OneMapping, Pattern::HitHeavy, Pattern::MissHeavy];
        let mut progress = ctx.progress("translate", (COUNTS.len() * patterns.len()) as u64);
        let mut table = Table::new(
            "ns per translation (1 thread; lower is better)",
            &[
                "Mappings",
                "Pattern",
                "loop only",
                "translate",
                "cursor",
                "translate / cursor",
            ],
        );
        let mut chart = Chart::new(
            "IOVA translation: DmaSpace::translate vs a DmaCursor",
            "mappings in the space, address pattern",
            "ns per translation",
            Better::Lower,
            true,
        );
        let mut map_costs = Vec::new();
        for count in COUNTS {
            let space = build(count)?;
            map_costs.push(format!("{count}: {:.0} ns", space.map_ns));
            for pattern in patterns {
                let addrs = addresses(&space, pattern);
                let case = format!("{count} mappings, {}", pattern.name());
                let mut medians = Vec::new();
                for (variant, name) in [
                    (Variant::LoopOnly, "loop-only"),
                    (Variant::Space, "translate"),
                    (Variant::Cursor, "cursor"),
                ] {
                    let stats = ns_per_op(runs, |iters| time(&space, variant, &addrs, iters));
                    out.rows.push(Row::new(
                        "translate",
                        &case,
                        name,
                        "translate",
                        "ns",
                        &stats,
                    ));
                    medians.push(stats.median);
                }
                table.push(vec![
                    count.to_string(),
                    pattern.name().into(),
                    format!("{:.2}", medians[0]),
                    format!("{:.2}", medians[1]),
                    format!("{:.2}", medians[2]),
                    format!("{:.1}x", medians[1] / medians[2]),
                ]);
                if pattern != Pattern::OneMapping {
                    chart.groups.push(ChartGroup {
                        label: format!(
                            "{count}, {}",
                            if pattern == Pattern::HitHeavy {
                                "hit-heavy"
                            } else {
                                "miss-heavy"
                            }
                        ),
                        bars: vec![
                            ("translate".into(), medians[1]),
                            ("cursor".into(), medians[2]),
                        ],
                    });
                }
                progress.inc(1);
            }
        }
        progress.finish();
        table.note = Some(format!(
            "{runs} runs of about 30 ms each; every pattern is {PATTERN} addresses, cycled; \
             hit-heavy and miss-heavy from 10 000 mappings up are all different addresses (one \
             mapping, or 64, holds fewer places for a 64-byte access); one map_backing call \
             while building the table cost (ns, by mapping count): {}",
            map_costs.join(", ")
        ));
        out.tables.push(table);
        out.charts.push(("translate-ns".into(), chart));
        Ok(out)
    }
}
