//! `memvisor bench rw`: "use vfio_iova_rw() to read/write IOVAs from CPU side" (seed 004a), CPU
//! reads and writes of IOVAs without pinning.
//!
//! The seed (Linux's `vfio_iova_rw`) lets an emulated device copy to and from IOVAs without
//! pinning pages first. This experiment copies transfers of 64 B to 1 MiB between a host buffer
//! and 64 MiB of populated guest memory mapped as 2 MiB IOVA mappings, walking a 16 MiB window
//! so the copies are not all from L1/L2. Variants, side by side on the same memory and offsets:
//! plain memcpy in each direction with no translation (the physical limit); pin + copy + unpin,
//! what a device without an rw call does (mlock, memcpy, munlock per transfer);
//! `DmaSpace::dma_read` / `dma_write`; and the same through a per-thread `DmaCursor`
//! (`read` / `write`), whose copies inside the mapping it last hit skip the snapshot load and
//! the lookup.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use memvisor::{Backing, BackingKind, BackingOptions, DmaSpace, Iova, Prot};

use super::seeds::{SEED_004A, Seed};
use super::{Better, Chart, ChartGroup, Ctx, Experiment, Outcome, Row, Table, limits, ns_per_op};

pub struct Rw;

const GUEST: u64 = 64 << 20;
const WINDOW: u64 = 16 << 20;
const MAPPING: u64 = 2 << 20;
const SIZES: [u64; 8] = [
    64,
    256,
    1 << 10,
    4 << 10,
    16 << 10,
    64 << 10,
    256 << 10,
    1 << 20,
];

#[derive(Clone, Copy, PartialEq)]
enum Variant {
    MemcpyFrom,
    MemcpyTo,
    PinCopyUnpin,
    DmaRead,
    DmaWrite,
    CursorRead,
    CursorWrite,
}

const VARIANTS: [(Variant, &str); 7] = [
    (Variant::MemcpyFrom, "memcpy from guest"),
    (Variant::MemcpyTo, "memcpy to guest"),
    (Variant::PinCopyUnpin, "pin+copy+unpin"),
    (Variant::DmaRead, "dma_read"),
    (Variant::DmaWrite, "dma_write"),
    (Variant::CursorRead, "cursor read"),
    (Variant::CursorWrite, "cursor write"),
];

/// ns per transfer of `size` bytes, `iters` transfers walking the window.
fn time(
    dma: &DmaSpace,
    guest: &Backing,
    variant: Variant,
    size: u64,
    iters: u64,
) -> anyhow::Result<f64> {
    let mut buf = vec![0x5au8; size as usize];
    let mut cursor = dma.cursor();
    let slots = WINDOW / size;
    let start = Instant::now();
    for i in 0..iters {
        // Odd stride through the window so consecutive transfers do not stream.
        let off = (i * 7 % slots) * size;
        match variant {
            // The physical limit: the C library's memcpy, no checks, no translation. (The
            // benchmark's guest memory has no other writer, so a plain copy is sound here;
            // memvisor itself copies guest memory as a device access.)
            Variant::MemcpyFrom => {
                let src = guest.as_ptr().wrapping_add(off as usize);
                // SAFETY: [off, off + size) lies inside the live backing, buf is our own.
                unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), buf.len()) }
            }
            Variant::MemcpyTo => {
                let dst = guest.as_ptr().wrapping_add(off as usize);
                // SAFETY: as above.
                unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), dst, buf.len()) }
            }
            Variant::PinCopyUnpin => {
                let page_start = off & !4095;
                let len = (off + size).next_multiple_of(4096) - page_start;
                let p = guest.as_ptr().wrapping_add(page_start as usize).cast();
                // SAFETY: [page_start, page_start + len) lies inside the live guest backing;
                // mlock/munlock only change residency, not contents.
                if unsafe { libc::mlock(p, len as usize) } != 0 {
                    anyhow::bail!(
                        "mlock failed: {} (RLIMIT_MEMLOCK too low?)",
                        std::io::Error::last_os_error()
                    );
                }
                guest.read(off, &mut buf)?;
                // SAFETY: as above, the range we just locked.
                unsafe { libc::munlock(p, len as usize) };
            }
            Variant::DmaRead => dma.dma_read(Iova(off), &mut buf)?,
            Variant::DmaWrite => dma.dma_write(Iova(off), &buf)?,
            Variant::CursorRead => cursor.read(Iova(off), &mut buf)?,
            Variant::CursorWrite => cursor.write(Iova(off), &buf)?,
        }
        black_box(&mut buf);
    }
    Ok(start.elapsed().as_nanos() as f64 / iters as f64)
}

impl Experiment for Rw {
    fn name(&self) -> &'static str {
        "rw"
    }

    fn title(&self) -> &'static str {
        "CPU access to IOVAs without pinning: dma_read / dma_write vs memcpy vs pin+copy+unpin"
    }

    fn about(&self) -> &'static str {
        "Transfers of 64 B to 1 MiB between a host buffer and 64 MiB of populated private \
         memory mapped as 2 MiB IOVA mappings, walking a 16 MiB window. memcpy (no \
         translation, each direction) is the physical limit; pin+copy+unpin does what a device \
         without an rw call must (mlock, memcpy, munlock per transfer); dma_read / dma_write \
         check and translate the whole range, then copy; cursor read / write do the same with \
         a per-thread DmaCursor. Targets: dma_read/dma_write >= 90% of memcpy from 64 KiB up; \
         at 64 B, >= 50% of memcpy plain and >= 75% through the cursor."
    }

    fn seeds(&self) -> &'static [Seed] {
        &[SEED_004A]
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let runs = ctx.runs_or(5);
        let guest = Arc::new(Backing::with_options(
            BackingKind::PrivateAnon,
            GUEST,
            &BackingOptions {
                populate: true,
                ..Default::default()
            },
        )?);
        let dma = DmaSpace::default();
        for off in (0..GUEST).step_by(MAPPING as usize) {
            dma.map_backing(Iova(off), &guest, off, MAPPING, Prot::RW)?;
        }
        let mut out = Outcome::default();
        let mut progress = ctx.progress("rw", SIZES.len() as u64);
        let mut table = Table::new(
            "GB/s by transfer size (higher is better)",
            &[
                "Size",
                "memcpy from guest",
                "memcpy to guest",
                "pin+copy+unpin",
                "dma_read",
                "dma_write",
                "cursor read",
                "cursor write",
                "dma_read / memcpy",
                "dma_write / memcpy",
                "cursor read / memcpy",
                "cursor write / memcpy",
            ],
        );
        let mut chart = Chart::new(
            "CPU copies to and from guest memory: GB/s by transfer size",
            "bytes per transfer",
            "GB/s (1 GB = 1e9 bytes)",
            Better::Higher,
            true,
        );
        for size in SIZES {
            let label = human(size);
            let mut gbps = Vec::new();
            for (variant, name) in VARIANTS {
                if variant == Variant::PinCopyUnpin {
                    // mlock of the pages a transfer touches: RLIMIT_MEMLOCK without root.
                    if let Err(why) = limits::check_lock(size.next_multiple_of(4096) + 4096) {
                        out.skipped.push(format!("{name}, {label}: {why}"));
                        gbps.push(f64::NAN);
                        continue;
                    }
                }
                let mut failure = None;
                let ns = ns_per_op(runs, |iters| {
                    time(&dma, &guest, variant, size, iters).unwrap_or_else(|e| {
                        failure = Some(e);
                        f64::NAN
                    })
                });
                if let Some(e) = failure {
                    return Err(e);
                }
                // GB/s = bytes / ns; min and max swap under the inversion.
                let mut stats = ns;
                stats.median = size as f64 / ns.median;
                stats.min = size as f64 / ns.max;
                stats.max = size as f64 / ns.min;
                out.rows
                    .push(Row::new("rw", &label, name, "throughput", "GB/s", &stats));
                gbps.push(stats.median);
            }
            let mut cells = vec![label.clone()];
            cells.extend(gbps.iter().map(|g| {
                if g.is_nan() {
                    "skipped".to_string()
                } else {
                    format!("{g:.2}")
                }
            }));
            cells.push(format!("{:.0}%", 100.0 * gbps[3] / gbps[0]));
            cells.push(format!("{:.0}%", 100.0 * gbps[4] / gbps[1]));
            cells.push(format!("{:.0}%", 100.0 * gbps[5] / gbps[0]));
            cells.push(format!("{:.0}%", 100.0 * gbps[6] / gbps[1]));
            table.push(cells);
            chart.groups.push(ChartGroup {
                label,
                bars: VARIANTS
                    .iter()
                    .zip(&gbps)
                    .filter(|(_, g)| !g.is_nan())
                    .map(|((_, n), g)| (n.to_string(), *g))
                    .collect(),
            });
            progress.inc(1);
        }
        progress.finish();
        table.note = Some(format!(
            "{runs} runs of about 30 ms each; {} gives no figures of its own, the point is the \
             gap to pin+copy+unpin",
            SEED_004A.named()
        ));
        out.tables.push(table);
        out.charts.push(("rw-gbps".into(), chart));
        Ok(out)
    }
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}
