//! Reference counts over page numbers, kept as runs.
//!
//! Pins nest — the same page can be pinned through two IOVAs, by a mapping and by a device,
//! or by overlapping requests of different lengths — so every pinned page has a count, and only
//! the 0 -> 1 and 1 -> 0 transitions reach the kernel. Kept per page, 100 GiB pinned at once would
//! need 26 million entries. [`RunCounts`] keeps maximal runs of consecutive pages that share a
//! count instead (`start -> (end, count)` in a B-tree, ends exclusive, runs disjoint, neighbours
//! with the same count merged), so a mapping pinned whole is one entry however large it is,
//! and a change costs O(log n + runs it touches).
//!
//! Changes hand back the runs that crossed zero — the pages to lock or unlock — so callers make
//! one system call per run, never one per page. The type knows nothing of what a page number
//! means: the pin registry counts host pages with it and a DMA space counts the IOVA pages
//! devices pin (`dma::device_pins`) with it.

use std::collections::BTreeMap;

/// The runs of `runs` — disjoint, keyed by first page, each ending (exclusive) at `end_of(run)`
/// — that overlap `[start, end)`, in order: the run that starts before `start` if it reaches
/// past it, then those that start inside. The one walk every run map here needs.
pub(super) fn overlapping<R>(
    runs: &BTreeMap<u64, R>,
    start: u64,
    end: u64,
    end_of: fn(&R) -> u64,
) -> impl Iterator<Item = (u64, &R)> {
    let before = runs
        .range(..start)
        .next_back()
        .filter(move |(_, r)| end_of(r) > start);
    before
        .into_iter()
        .chain(runs.range(start..end))
        .map(|(&s, r)| (s, r))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    end: u64,
    count: u64,
}

/// Counts per page, stored as runs. Pages not in any run have count 0.
#[derive(Clone, Debug, Default)]
pub(crate) struct RunCounts {
    runs: BTreeMap<u64, Run>,
    /// Pages with a count of at least one.
    counted: u64,
}

impl RunCounts {
    /// Whether every count is zero.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Number of pages with a non-zero count.
    pub fn pages(&self) -> u64 {
        self.counted
    }

    /// The count of one page.
    pub fn count(&self, page: u64) -> u64 {
        match self.runs.range(..=page).next_back() {
            Some((_, r)) if r.end > page => r.count,
            _ => 0,
        }
    }

    /// Every run as `(start, end, count)`, in order.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.runs.iter().map(|(&s, r)| (s, r.end, r.count))
    }

    /// Whether any page of `[start, end)` has a non-zero count.
    pub fn any_counted(&self, start: u64, end: u64) -> bool {
        start < end && (self.count(start) > 0 || self.runs.range(start..end).next().is_some())
    }

    /// The counted runs overlapping `[start, end)`, clipped to it, as `(start, end, count)`.
    pub fn counted_in(&self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        overlapping(&self.runs, start, end, |r| r.end)
            .map(|(s, r)| (s.max(start), r.end.min(end), r.count))
            .collect()
    }

    /// The parts of `[start, end)` whose count is zero: what [`RunCounts::add`] would take from
    /// zero to one.
    pub fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = start;
        for (s, e, _) in self.counted_in(start, end) {
            if s > at {
                out.push((at, s));
            }
            at = e;
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    /// Adds one to the count of every page in `[start, end)`.
    pub fn add(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        // The common cases without a walk: a range inside a single run, or one no run touches.
        match self.runs.range(..=start).next_back().map(|(&s, &r)| (s, r)) {
            Some((_, r)) if r.end >= end => {
                self.split(start);
                self.split(end);
                self.runs.get_mut(&start).expect("split above").count += 1;
                self.merge(start, end);
                return;
            }
            Some((_, r)) if r.end > start => {}
            _ if self.runs.range(start..end).next().is_none() => {
                self.runs.insert(start, Run { end, count: 1 });
                self.counted += end - start;
                self.merge(start, end);
                return;
            }
            _ => {}
        }
        let gaps = self.gaps(start, end);
        self.split(start);
        self.split(end);
        for r in self.runs.range_mut(start..end) {
            r.1.count += 1;
        }
        for &(s, e) in &gaps {
            self.runs.insert(s, Run { end: e, count: 1 });
            self.counted += e - s;
        }
        self.merge(start, end);
    }

    /// Subtracts one from the count of every page in `[start, end)`. If some page there has
    /// count zero, changes nothing and returns it.
    pub fn sub(&mut self, start: u64, end: u64) -> Result<(), u64> {
        self.sub_reporting(start, end, &mut Vec::new())
    }

    /// [`RunCounts::sub`], appending the runs that went from one to zero to `zero`.
    pub fn sub_reporting(
        &mut self,
        start: u64,
        end: u64,
        zero: &mut Vec<(u64, u64)>,
    ) -> Result<(), u64> {
        if start >= end {
            return Ok(());
        }
        // The common case without a walk: a range inside a single run.
        if let Some((&s, &r)) = self.runs.range(..=start).next_back() {
            if r.end >= end {
                if r.count == 1 {
                    // The pieces of a maximal run keep their neighbours apart: nothing merges.
                    self.runs.remove(&s);
                    if s < start {
                        self.runs.insert(s, Run { end: start, ..r });
                    }
                    if end < r.end {
                        self.runs.insert(end, r);
                    }
                    self.counted -= end - start;
                    zero.push((start, end));
                } else {
                    self.split(start);
                    self.split(end);
                    self.runs.get_mut(&start).expect("split above").count -= 1;
                    self.merge(start, end);
                }
                return Ok(());
            }
        }
        if let Some(&(hole, _)) = self.gaps(start, end).first() {
            return Err(hole);
        }
        self.split(start);
        self.split(end);
        let first = zero.len();
        let mut emptied = Vec::new();
        for (&s, r) in self.runs.range_mut(start..end) {
            r.count -= 1;
            if r.count == 0 {
                emptied.push(s);
                match zero[first..].last_mut() {
                    Some(last) if last.1 == s => last.1 = r.end,
                    _ => zero.push((s, r.end)),
                }
            }
        }
        for s in emptied {
            let r = self.runs.remove(&s).expect("collected above");
            self.counted -= r.end - s;
        }
        self.merge(start, end);
        Ok(())
    }

    /// Cuts the run containing `at` (if it starts before `at`) in two at `at`.
    fn split(&mut self, at: u64) {
        let Some((&s, &r)) = self.runs.range(..at).next_back() else {
            return;
        };
        if r.end > at {
            self.runs.insert(s, Run { end: at, ..r });
            self.runs.insert(at, r);
        }
    }

    /// Merges touching runs with equal counts from the run before `start` to the run at `end`.
    fn merge(&mut self, start: u64, end: u64) {
        let mut at = self
            .runs
            .range(..start)
            .next_back()
            .map_or(start, |(&s, _)| s);
        while let Some((&s, &r)) = self.runs.range(at..).next() {
            if s > end {
                break;
            }
            match self.runs.get(&r.end) {
                Some(&next) if next.count == r.count && r.end <= end => {
                    self.runs.remove(&r.end);
                    self.runs.insert(s, Run { end: next.end, ..r });
                    at = s;
                }
                _ => at = r.end,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn nested_adds_count_and_report_transitions() {
        let mut c = RunCounts::default();
        assert_eq!(c.gaps(10, 20), vec![(10, 20)]);
        c.add(10, 20);
        assert_eq!(c.gaps(15, 30), vec![(20, 30)]);
        c.add(15, 30);
        assert_eq!(c.count(14), 1);
        assert_eq!(c.count(15), 2);
        assert_eq!(c.count(29), 1);
        assert_eq!(c.count(30), 0);
        assert_eq!(c.pages(), 20);
        let mut zero = Vec::new();
        assert_eq!(c.sub_reporting(10, 20, &mut zero), Ok(()));
        assert_eq!(zero, vec![(10, 15)]);
        assert_eq!(c.sub(5, 16), Err(5));
        zero.clear();
        assert_eq!(c.sub_reporting(15, 30, &mut zero), Ok(()));
        assert_eq!(zero, vec![(15, 30)]);
        assert!(c.is_empty());
        assert_eq!(c.pages(), 0);
    }

    #[test]
    fn equal_neighbours_merge_into_one_run() {
        let mut c = RunCounts::default();
        for i in 0..512 {
            c.add(i, i + 1);
        }
        assert_eq!(c.runs().collect::<Vec<_>>(), vec![(0, 512, 1)]);
        c.add(100, 200);
        c.sub(100, 200).unwrap();
        assert_eq!(c.runs().count(), 1);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        /// Random nested adds and subs against a plain per-page array.
        #[test]
        fn matches_per_page_counts(ops in prop::collection::vec((any::<bool>(), 0u64..64, 1u64..24), 1..80)) {
            let mut c = RunCounts::default();
            let mut model = [0u64; 96];
            for (add, start, len) in ops {
                let end = start + len;
                if add {
                    let want: Vec<u64> = (start..end).filter(|&p| model[p as usize] == 0).collect();
                    let got: Vec<u64> = c.gaps(start, end).into_iter().flat_map(|(s, e)| s..e).collect();
                    c.add(start, end);
                    prop_assert_eq!(got, want);
                    (start..end).for_each(|p| model[p as usize] += 1);
                } else if let Some(hole) = (start..end).find(|&p| model[p as usize] == 0) {
                    prop_assert_eq!(c.sub(start, end), Err(hole));
                } else {
                    let want: Vec<u64> = (start..end).filter(|&p| model[p as usize] == 1).collect();
                    let mut zero = Vec::new();
                    c.sub_reporting(start, end, &mut zero).unwrap();
                    let got: Vec<u64> = zero.into_iter().flat_map(|(s, e)| s..e).collect();
                    prop_assert_eq!(got, want);
                    (start..end).for_each(|p| model[p as usize] -= 1);
                }
                for p in 0..96u64 {
                    prop_assert_eq!(c.count(p), model[p as usize], "page {}", p);
                }
                prop_assert_eq!(c.pages(), model.iter().filter(|&&n| n > 0).count() as u64);
                let any = (start..end).any(|p| model[p as usize] > 0);
                prop_assert_eq!(c.any_counted(start, end), any);
                // Runs are maximal: no two touching runs share a count.
                let runs: Vec<_> = c.runs().collect();
                for w in runs.windows(2) {
                    prop_assert!(!(w[0].1 == w[1].0 && w[0].2 == w[1].2), "unmerged {:?}", w);
                }
            }
        }
    }
}
