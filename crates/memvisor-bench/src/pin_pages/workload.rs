//! The workloads part 2 of `memvisor bench pin-pages` replays, and how their shapes are
//! compared. A workload is a list of `pin_pages` calls, each a list of IOVA page numbers, drawn
//! by [`replay_calls`] from recorded histograms ([`Buckets`]): how many pages a call has
//! (`npage`), and how long the runs of consecutive pages inside a call are. The histograms are the
//! vfio-ccw traces of "vfio iommu type1: Improve vfio_iommu_type1_pin_pages performance" (seed
//! 002) — guest boot and fio — and the mvdma device's calls under a real guest
//! ([`mvdma_npage`]: the last vfio-user trial's, else the recording that ships in `data/`). The
//! draw is deterministic (xorshift from a fixed seed), so every variant replays the same calls.
//! [`shares`] and [`hist_shares`] put drawn calls and recorded histograms into the same [`DIST`]
//! buckets, so the tables can show that a replay has the shape of its recording.

/// One bucket of a histogram: `(first, end (exclusive), count)`.
pub(super) type Bucket = (u64, u64, u64);
/// A histogram.
pub(super) type Buckets = [Bucket];

/// `@npage` BASE, vfio-ccw guest boot.
pub(super) const BOOT_NPAGE: &Buckets = &[(1, 2, 29484), (2, 4, 3298), (4, 8, 1011), (8, 16, 2600)];
/// `@npage` BASE, fio.
pub(super) const FIO_NPAGE: &Buckets = &[
    (1, 2, 8_457_107),
    (2, 4, 2_066_957),
    (4, 8, 359_989),
    (8, 16, 1_440_006),
];
/// `vfio_iommu_type1_pin_contiguous_pages npage` (one guest boot plus an fio run).
pub(super) const SEED_RUNS: &Buckets = &[
    (1, 2, 16_384_925),
    (2, 4, 1_327_548),
    (4, 8, 727_564),
    (8, 16, 417_182),
];
/// The same trace's `vfio_iommu_type1_pin_pages npage: 1` count: each of those calls is one
/// single-page run.
pub(super) const SEED_SINGLE_CALLS: u64 = 9_890_332;
/// The same trace's total of `vfio_iommu_type1_pin_pages` calls.
pub(super) const SEED_CALLS: u64 = 14_408_024;
/// The runs inside multi-page calls: [`SEED_RUNS`] minus the single-page calls' runs.
pub(super) const MULTI_RUNS: &Buckets = &[
    (1, 2, SEED_RUNS[0].2 - SEED_SINGLE_CALLS),
    SEED_RUNS[1],
    SEED_RUNS[2],
    SEED_RUNS[3],
];

/// xorshift64: small, fast and the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in `[0, n)` (the bias of a plain modulo is far below anything measured here).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    /// A value from `hist`: a bucket by its count, then uniform inside it.
    fn draw(&mut self, hist: &Buckets) -> u64 {
        let total: u64 = hist.iter().map(|b| b.2).sum();
        let mut x = self.below(total);
        for &(first, end, count) in hist {
            if x < count {
                return first + self.below(end - first);
            }
            x -= count;
        }
        unreachable!("x is below the total")
    }
}

/// `calls` pin_pages calls over `pages` pages of IOVA: npage drawn from `npage`, the lengths
/// of a call's runs from `runs` (clipped to what is left of the call), or one run per call for
/// `None`; see the module documentation.
pub(super) fn replay_calls(
    npage: &Buckets,
    runs: Option<&Buckets>,
    calls: usize,
    pages: u64,
    seed: u64,
) -> Vec<Vec<u64>> {
    let mut rng = Rng(seed | 1);
    (0..calls)
        .map(|_| {
            let n = rng.draw(npage);
            let mut placed: Vec<(u64, u64)> = Vec::new();
            let mut left = n;
            while left > 0 {
                let len = runs.map_or(left, |r| rng.draw(r).min(left));
                let start = loop {
                    let s = rng.below(pages - len);
                    // Runs of one call neither overlap nor touch, so they stay separate runs.
                    if placed.iter().all(|&(p, l)| s > p + l || p > s + len) {
                        break s;
                    }
                };
                placed.push((start, len));
                left -= len;
            }
            placed
                .iter()
                .flat_map(|&(s, l)| s..s + l)
                .collect::<Vec<u64>>()
        })
        .collect()
}

/// Lengths of the runs of consecutive page numbers in `pages`.
pub(super) fn run_lengths(pages: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut len = 0;
    for (i, &p) in pages.iter().enumerate() {
        if i > 0 && pages[i - 1] + 1 == p {
            len += 1;
        } else {
            if len > 0 {
                out.push(len);
            }
            len = 1;
        }
    }
    if len > 0 {
        out.push(len);
    }
    out
}

/// The columns distributions are compared in: the seed's buckets, and all above them.
const DIST: [(u64, u64); 5] = [(1, 2), (2, 4), (4, 8), (8, 16), (16, 513)];

/// Shares (in %) of `values` in the [`DIST`] buckets.
pub(super) fn shares(values: impl Iterator<Item = u64>) -> [f64; 5] {
    let mut counts = [0u64; 5];
    let mut total = 0u64;
    for v in values {
        total += 1;
        if let Some(i) = DIST.iter().position(|&(f, e)| (f..e).contains(&v)) {
            counts[i] += 1;
        }
    }
    counts.map(|c| 100.0 * c as f64 / total.max(1) as f64)
}

/// Shares (in %) of a histogram's calls in the [`DIST`] buckets (its buckets lie inside them).
pub(super) fn hist_shares(hist: &Buckets) -> [f64; 5] {
    let total: u64 = hist.iter().map(|b| b.2).sum();
    let mut out = [0.0; 5];
    for &(first, _, count) in hist {
        if let Some(i) = DIST.iter().position(|&(f, e)| (f..e).contains(&first)) {
            out[i] += 100.0 * count as f64 / total.max(1) as f64;
        }
    }
    out
}

/// Where the real-guest npage histogram comes from: this machine's last vfio-user trial, else
/// the recording that ships with memvisor.
const TRIAL_STATS: &str = "target/guest/run/vfio-user/stats.json";
const SHIPPED_NPAGE: &str = include_str!("../../data/mvdma-npage.txt");

/// The npage histogram of the mvdma device's pin mode under a real guest, one bucket per
/// npage, and where it came from.
pub(super) fn mvdma_npage() -> anyhow::Result<(Vec<Bucket>, String)> {
    let from_trial = std::fs::read_to_string(TRIAL_STATS)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            let h = v["device"]["npage_histogram"]
                .as_array()?
                .iter()
                .map(|e| Some((e[0].as_u64()?, e[1].as_u64()?)));
            h.collect::<Option<Vec<(u64, u64)>>>()
        })
        .filter(|h| !h.is_empty());
    let (pairs, source) = match from_trial {
        Some(h) => (h, TRIAL_STATS.to_string()),
        None => {
            let mut h = Vec::new();
            for (i, line) in SHIPPED_NPAGE.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let mut f = line.split_whitespace().map(str::parse::<u64>);
                match (f.next(), f.next()) {
                    (Some(Ok(n)), Some(Ok(c))) => h.push((n, c)),
                    _ => anyhow::bail!("data/mvdma-npage.txt line {}: {line:?}", i + 1),
                }
            }
            (
                h,
                "the shipped recording (data/mvdma-npage.txt, 2026-11-23)".to_string(),
            )
        }
    };
    let buckets: Vec<Bucket> = pairs
        .into_iter()
        .filter(|&(n, c)| (1..=512).contains(&n) && c > 0)
        .map(|(n, c)| (n, n + 1, c))
        .collect();
    anyhow::ensure!(!buckets.is_empty(), "the mvdma npage histogram is empty");
    Ok((buckets, source))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_calls_follow_the_histograms() {
        let calls = replay_calls(BOOT_NPAGE, Some(MULTI_RUNS), 5000, 1 << 14, 7);
        assert_eq!(
            calls,
            replay_calls(BOOT_NPAGE, Some(MULTI_RUNS), 5000, 1 << 14, 7)
        );
        for c in &calls {
            assert!((1..16).contains(&c.len()), "{c:?}");
            assert!(c.iter().all(|&p| p < 1 << 14));
            let mut sorted = c.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), c.len(), "no page twice in a call: {c:?}");
        }
        let got = shares(calls.iter().map(|c| c.len() as u64));
        for (g, s) in got.iter().zip(hist_shares(BOOT_NPAGE)) {
            assert!((g - s).abs() < 2.0, "{got:?}");
        }
        let runs: Vec<u64> = calls.iter().flat_map(|c| run_lengths(c)).collect();
        let single = shares(runs.into_iter())[0];
        assert!((80.0..95.0).contains(&single), "{single}");
    }

    #[test]
    fn run_lengths_split_at_breaks() {
        assert_eq!(run_lengths(&[1, 5, 6, 7, 9, 10, 3]), vec![1, 3, 2, 1]);
        assert_eq!(run_lengths(&[4]), vec![1]);
        assert!(run_lengths(&[]).is_empty());
    }
}
