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
//!
//! A second table, on the miss-heavy pattern (a random mapping each time), sets the same
//! space's translations beside a comparator and the per-request walk, all in one run:
//! * **SPDK-style map** ([`TwoLevel`]): the shape of SPDK's `spdk_mem_map`, the flat table a
//!   user-space driver translates with — a top level over 256 TiB of pointers to 1 GiB maps of
//!   512 entries of 2 MiB each, so a translation is two dependent loads and an add. Written here
//!   from that design (SPDK, lib/env_dpdk/memory.c, `spdk_mem_map_translate`); no code is taken.
//!   Its unit is 2 MiB, so it cannot hold 4 KiB mappings 8 KiB apart: it holds the same number
//!   of mappings, each mapping's host page in a 2 MiB unit of its own (mapping `i` at
//!   `i * 2 MiB`), and is asked for the same mapping and offset as the space is. Same entries,
//!   same randomness, exact answers.
//! * **walk rows**: what a block request costs today, one 4 KiB buffer at the start of the
//!   mapping: `DmaSpace::hold_sg` (walk, hold, and the guard's release), the same with a
//!   queue's scratch (`hold_sg_into`, the guard given back with `SgScratch::recycle`: no
//!   allocation), `DmaSpace::translate_sg`, and a cursor's `translate_sg_into` (no hold, no
//!   allocation).
//! * **a block request's walk** (a third table): a 16-byte header and a status byte in one
//!   mapping, 4 KiB of data in another, through a cursor's `translate_sg_into`, beside the
//!   SPDK-style map asked for the same three buffers.

use std::collections::HashSet;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use memvisor::dma::{SgBuf, SgScratch, SgWalk};
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
    /// The same mappings in an SPDK-style map, one 2 MiB unit each.
    spdk: TwoLevel,
    _backing: Arc<Backing>,
}

/// An SPDK-style two-level translation map (see the module documentation): a top level of
/// pointers, one per 1 GiB of a 256 TiB address space, to maps of 512 words, one per 2 MiB.
/// A word holds the host address of its unit's first byte; 0 is "not mapped".
struct TwoLevel {
    top: Box<[Option<Box<[u64; 512]>>]>,
}

impl TwoLevel {
    const SHIFT_1G: u32 = 30;
    const SHIFT_2M: u32 = 21;
    const TOP: usize = 1 << (48 - Self::SHIFT_1G);

    fn new() -> TwoLevel {
        TwoLevel {
            top: (0..Self::TOP).map(|_| None).collect(),
        }
    }

    /// Maps the 2 MiB unit at `addr` (aligned) to `host`.
    fn set(&mut self, addr: u64, host: u64) {
        let map =
            self.top[(addr >> Self::SHIFT_1G) as usize].get_or_insert_with(|| Box::new([0; 512]));
        map[((addr >> Self::SHIFT_2M) & 511) as usize] = host;
    }

    /// The host address of `addr`, or 0 unmapped: two dependent loads and an add.
    #[inline(always)]
    fn translate(&self, addr: u64) -> u64 {
        let Some(map) = self
            .top
            .get((addr >> Self::SHIFT_1G) as usize)
            .and_then(|m| m.as_deref())
        else {
            return 0;
        };
        let unit = map[((addr >> Self::SHIFT_2M) & 511) as usize];
        if unit == 0 {
            return 0;
        }
        unit + (addr & ((1 << Self::SHIFT_2M) - 1))
    }
}

/// Where the SPDK-style map holds mapping `i`'s unit.
const fn spdk_addr(mapping: u64) -> u64 {
    mapping << TwoLevel::SHIFT_2M
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
    let mut spdk = TwoLevel::new();
    for i in 0..count {
        let host = dma.translate(Iova(2 * i * PAGE), 1, Prot::READ)?.hva.0;
        spdk.set(spdk_addr(i), host);
    }
    Ok(Space {
        dma,
        count,
        map_ns,
        spdk,
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
    /// The SPDK-style map, asked for the same mapping and offset.
    Spdk,
    /// One request of one 4 KiB buffer at the mapping's start: hold_sg and the guard's drop.
    HoldSg,
    /// The same buffer through `DmaSpace::translate_sg`.
    TranslateSg,
    /// `HoldSg` with a queue's scratch, the guard given back to it.
    HoldSgInto,
    /// The same buffer through a cursor's `translate_sg_into`.
    TranslateSgInto,
    /// A block request's three buffers through a cursor's `translate_sg_into`: a 16-byte
    /// header and a 1-byte status in one mapping, 4 KiB of data in the next address's.
    Request,
    /// The SPDK-style map asked for the same three buffers.
    SpdkRequest,
}

/// The SPDK-style map's address for `iova` (of mapping `iova / 8 KiB`, see [`build`]).
#[inline(always)]
fn spdk_iova(iova: u64) -> u64 {
    spdk_addr(iova / (2 * PAGE)) + iova % PAGE
}

/// ns per translation: `iters` translations cycling through `addrs`.
fn time(space: &Space, variant: Variant, addrs: &[u64], iters: u64) -> f64 {
    let mask = addrs.len() - 1;
    let mut cursor = space.dma.cursor();
    let mut scratch = SgScratch::for_queue(0);
    let page = |iova: Iova| {
        [SgBuf {
            iova: Iova(iova.0 & !(PAGE - 1)),
            len: PAGE,
            prot: Prot::READ,
        }]
    };
    let request =
        |i: usize| request_bufs(black_box(addrs[i & mask]), black_box(addrs[(i + 1) & mask]));
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
            Variant::Spdk => space.spdk.translate(spdk_iova(iova.0)),
            Variant::HoldSg => {
                let buf = SgBuf {
                    iova: Iova(iova.0 & !(PAGE - 1)),
                    len: PAGE,
                    prot: Prot::READ,
                };
                match space.dma.hold_sg(&[buf]) {
                    Ok(SgWalk::Held(g)) => g.segments()[0].hva.0,
                    _ => 0,
                }
            }
            Variant::TranslateSg => space
                .dma
                .translate_sg(Iova(iova.0 & !(PAGE - 1)), PAGE, Prot::READ)
                .map_or(0, |s| s[0].hva.0),
            Variant::HoldSgInto => match space.dma.hold_sg_into(&page(iova), &mut scratch) {
                Ok(SgWalk::Held(g)) => {
                    let hva = g.segments()[0].hva.0;
                    scratch.recycle(g);
                    hva
                }
                _ => 0,
            },
            Variant::TranslateSgInto => match cursor.translate_sg_into(&page(iova), &mut scratch) {
                Ok(()) => scratch.buffer(0)[0].hva.0,
                Err(_) => 0,
            },
            Variant::Request => match cursor.translate_sg_into(&request(i), &mut scratch) {
                Ok(()) => scratch.segments().iter().fold(0, |a, s| a ^ s.hva.0),
                Err(_) => 0,
            },
            Variant::SpdkRequest => request(i)
                .iter()
                .fold(0, |a, b| a ^ space.spdk.translate(spdk_iova(b.iova.0))),
        });
    }
    black_box(sum);
    start.elapsed().as_nanos() as f64 / iters as f64
}

/// Checks that the SPDK-style map gives the space's host address for every address of `addrs`.
fn check_spdk(space: &Space, addrs: &[u64]) -> anyhow::Result<()> {
    for &a in addrs {
        let want = space.dma.translate(Iova(a), 1, Prot::READ)?.hva.0;
        let got = space.spdk.translate(spdk_iova(a));
        anyhow::ensure!(
            got == want,
            "the SPDK-style map translates {a:#x} to {got:#x}, the space to {want:#x}"
        );
    }
    Ok(())
}

/// [`Variant::Request`]'s buffers: a 16-byte header at the start of `head`'s page and a status
/// byte 16 bytes after it, 4 KiB of data filling `data`'s page.
fn request_bufs(head: u64, data: u64) -> [SgBuf; 3] {
    let (head, data) = (head & !(PAGE - 1), data & !(PAGE - 1));
    [
        (head, 16, Prot::READ),
        (data, PAGE, Prot::WRITE),
        (head + 16, 1, Prot::WRITE),
    ]
    .map(|(iova, len, prot)| SgBuf {
        iova: Iova(iova),
        len,
        prot,
    })
}

/// Checks that a cursor's `translate_sg_into` of [`Variant::Request`]'s buffers gives the
/// SPDK-style map's host addresses, one segment per buffer.
fn check_request(space: &Space, addrs: &[u64]) -> anyhow::Result<()> {
    let mut cursor = space.dma.cursor();
    let mut scratch = SgScratch::for_queue(0);
    for w in addrs.windows(2).take(1024) {
        let bufs = request_bufs(w[0], w[1]);
        cursor.translate_sg_into(&bufs, &mut scratch)?;
        for (k, b) in bufs.iter().enumerate() {
            let got = scratch.buffer(k);
            let want = space.spdk.translate(spdk_iova(b.iova.0));
            anyhow::ensure!(
                got.len() == 1 && got[0].hva.0 == want && got[0].len == b.len,
                "request buffer {k} at {:#x}: translate_sg_into gives {got:?}, the SPDK-style \
                 map {want:#x}",
                b.iova.0
            );
        }
    }
    Ok(())
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
         nothing else. Beside them on the random pattern: an SPDK-style two-level map over \
         the same mappings, one 4 KiB request's walk (hold_sg, translate_sg) and a block \
         request's (header, data, status) beside three lookups in that map. Targets: \
         cursor hit <= 5 ns, miss <= 40 ns at 100 000 mappings; translate and the walk <= \
         1.2x the SPDK-style map."
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
        let mut random = Table::new(
            "random addresses (miss-heavy): ns per translation and per 4 KiB request walk \
             (1 thread; lower is better)",
            &[
                "Mappings",
                "loop only",
                "SPDK-style map",
                "translate",
                "cursor",
                "hold_sg + release",
                "hold_sg_into + recycle",
                "translate_sg",
                "cursor translate_sg_into",
                "translate / SPDK",
                "hold_sg_into / SPDK",
                "translate_sg_into / SPDK",
            ],
        );
        let mut requests = Table::new(
            "random addresses: ns per block request's walk, a 16-byte header and a status \
             byte in one mapping and 4 KiB of data in another (1 thread; lower is better)",
            &[
                "Mappings",
                "SPDK-style map, 3 lookups",
                "cursor translate_sg_into",
                "translate_sg_into / SPDK",
            ],
        );
        let mut map_costs = Vec::new();
        for count in COUNTS {
            let space = build(count)?;
            map_costs.push(format!("{count}: {:.0} ns", space.map_ns));
            for pattern in patterns {
                let addrs = addresses(&space, pattern);
                let case = format!("{count} mappings, {}", pattern.name());
                // Times each variant, reports it as a row, and gives its median.
                let mut measure = |variants: &[(Variant, &str)]| -> Vec<f64> {
                    variants
                        .iter()
                        .map(|&(variant, name)| {
                            let stats =
                                ns_per_op(runs, |iters| time(&space, variant, &addrs, iters));
                            out.rows.push(Row::new(
                                "translate",
                                &case,
                                name,
                                "translate",
                                "ns",
                                &stats,
                            ));
                            stats.median
                        })
                        .collect()
                };
                let mut medians = measure(&[
                    (Variant::LoopOnly, "loop-only"),
                    (Variant::Space, "translate"),
                    (Variant::Cursor, "cursor"),
                ]);
                if pattern == Pattern::MissHeavy && count >= 64 {
                    check_spdk(&space, &addrs)?;
                    medians.extend(measure(&[
                        (Variant::Spdk, "spdk-map"),
                        (Variant::HoldSg, "hold-sg"),
                        (Variant::HoldSgInto, "hold-sg-into"),
                        (Variant::TranslateSg, "translate-sg"),
                        (Variant::TranslateSgInto, "cursor-translate-sg-into"),
                    ]));
                    check_request(&space, &addrs)?;
                    let pair = measure(&[
                        (Variant::SpdkRequest, "spdk-map-request"),
                        (Variant::Request, "cursor-translate-sg-into-request"),
                    ]);
                    requests.push(vec![
                        count.to_string(),
                        format!("{:.1}", pair[0]),
                        format!("{:.1}", pair[1]),
                        format!("{:.1}x", pair[1] / pair[0]),
                    ]);
                    random.push(vec![
                        count.to_string(),
                        format!("{:.2}", medians[0]),
                        format!("{:.2}", medians[3]),
                        format!("{:.2}", medians[1]),
                        format!("{:.2}", medians[2]),
                        format!("{:.1}", medians[4]),
                        format!("{:.1}", medians[5]),
                        format!("{:.1}", medians[6]),
                        format!("{:.1}", medians[7]),
                        format!("{:.1}x", medians[1] / medians[3]),
                        format!("{:.1}x", medians[5] / medians[3]),
                        format!("{:.1}x", medians[7] / medians[3]),
                    ]);
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
        random.note = Some(format!(
            "{runs} runs of about 30 ms each, in the same run as the table above, on its \
             miss-heavy addresses. SPDK-style map: SPDK's spdk_mem_map shape (a top level of \
             1 GiB maps of 512 2 MiB entries; 2 dependent loads and an add), written from its \
             design, holding the same mappings one 2 MiB unit each and checked to give the \
             space's host address for every address. hold_sg: one request of one 4 KiB buffer \
             (DmaSpace::hold_sg, the guard dropped at once); hold_sg_into: the same with a \
             queue's SgScratch, the guard given back to it; translate_sg: the same buffer, \
             translated only; translate_sg_into: a cursor's, into the scratch"
        ));
        requests.note = Some(format!(
            "{runs} runs of about 30 ms each, in the same run, on the miss-heavy addresses: \
             request i has its header at the start of address i's mapping and its status 16 \
             bytes after, and 4 KiB of data filling address i+1's mapping (the shape of a \
             Linux virtio-blk request behind a vIOMMU); one cursor over the run, which reads \
             each buffer's page-table word through its region. Checked to give the \
             SPDK-style map's host addresses"
        ));
        out.tables.push(table);
        out.tables.push(random);
        out.tables.push(requests);
        out.charts.push(("translate-ns".into(), chart));
        Ok(out)
    }
}
