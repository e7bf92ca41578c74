//! What the pin registry holds `mlock`ed: runs of host pages, each tagged with the unit it was
//! locked in.
//!
//! Pin counts say which pages a device relies on; this says which pages the registry has asked
//! the kernel to lock. The two differ because memory is locked in whole units — a huge page of
//! hugetlbfs or THP memory, whose 4 KiB pins would otherwise split it — and because a munlock can
//! fail (ENOMEM when the kernel cannot split the area: `vm.max_map_count`), leaving pages locked
//! that no pin needs any more. Keeping the locked pages as their own set makes the locked-memory
//! account exact by construction: the registry charges exactly what is in this set, which is
//! exactly what the kernel shows as the process's `VmLck` for memory pinned through it.
//!
//! Runs are kept per unit (at most three: 4 KiB, 2 MiB, 1 GiB), each set sorted, disjoint and
//! merged where runs touch, so a mapping pinned whole is one run however large. The same page is
//! never in two sets. Asking "does a unit-`U` run lie within the `U`-aligned units around these
//! pages" is one ordered lookup per set, so an unpin finds the huge pages it may release without
//! scanning anything else.

use std::collections::BTreeMap;

/// Disjoint runs `[start, end)` of page numbers, touching runs merged.
#[derive(Clone, Debug, Default)]
struct RunSet {
    runs: BTreeMap<u64, u64>,
    pages: u64,
}

impl RunSet {
    /// The runs overlapping `[start, end)`, clipped to it, in order.
    fn overlapping(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let before = self
            .runs
            .range(..start)
            .next_back()
            .filter(|&(_, &e)| e > start);
        before
            .into_iter()
            .chain(self.runs.range(start..end))
            .map(|(&s, &e)| (s.max(start), e.min(end)))
            .filter(|(s, e)| s < e)
            .collect()
    }

    /// Whether any page of `[start, end)` is in the set.
    fn any(&self, start: u64, end: u64) -> bool {
        start < end
            && (self
                .runs
                .range(..=start)
                .next_back()
                .is_some_and(|(_, &e)| e > start)
                || self.runs.range(start..end).next().is_some())
    }

    /// Adds `[start, end)`, which must not overlap the set.
    fn insert(&mut self, start: u64, end: u64) {
        debug_assert!(
            !self.any(start, end),
            "locked twice: [{start:#x}, {end:#x})"
        );
        let (mut s, mut e) = (start, end);
        if let Some((&ps, &pe)) = self.runs.range(..start).next_back() {
            if pe == start {
                self.runs.remove(&ps);
                s = ps;
            }
        }
        if let Some(ne) = self.runs.remove(&end) {
            e = ne;
        }
        self.runs.insert(s, e);
        self.pages += end - start;
    }

    /// Removes the pages of `[start, end)`; returns the pieces that were in the set.
    fn remove(&mut self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let gone = self.overlapping(start, end);
        for &(s, e) in &gone {
            let (&rs, &re) = self
                .runs
                .range(..=s)
                .next_back()
                .expect("a piece lies in a run");
            self.runs.remove(&rs);
            if rs < s {
                self.runs.insert(rs, s);
            }
            if e < re {
                self.runs.insert(e, re);
            }
            self.pages -= e - s;
        }
        gone
    }
}

/// The most distinct units (page sizes) the locked set keeps.
const UNITS_MAX: usize = 8;

/// Units, as [`Locked::units_around`] returns them: no allocation on the unpin path.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Units([u64; UNITS_MAX], usize);

impl Units {
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.0[..self.1].iter().copied()
    }
}

/// The pages held locked, per unit (in pages).
#[derive(Clone, Debug, Default)]
pub(crate) struct Locked {
    sets: Vec<(u64, RunSet)>,
}

impl Locked {
    /// Pages locked.
    pub fn pages(&self) -> u64 {
        self.sets.iter().map(|(_, s)| s.pages).sum()
    }

    /// The parts of `[start, end)` not locked, in order.
    pub fn gaps(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut held: Vec<(u64, u64)> = self
            .sets
            .iter()
            .flat_map(|(_, s)| s.overlapping(start, end))
            .collect();
        held.sort_unstable();
        let mut out = Vec::new();
        let mut at = start;
        for (s, e) in held {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        }
        if at < end {
            out.push((at, end));
        }
        out
    }

    /// Records `[start, end)` (not locked before) as locked in units of `unit` pages.
    pub fn insert(&mut self, start: u64, end: u64, unit: u64) {
        if start >= end {
            return;
        }
        match self.sets.iter_mut().find(|(u, _)| *u == unit) {
            Some((_, set)) => set.insert(start, end),
            None => {
                // Units are page sizes (4 KiB, 2 MiB, 1 GiB): a handful at most.
                assert!(
                    self.sets.len() < UNITS_MAX,
                    "more than {UNITS_MAX} lock units"
                );
                let mut set = RunSet::default();
                set.insert(start, end);
                self.sets.push((unit, set));
                self.sets.sort_unstable_by_key(|(u, _)| *u);
            }
        }
    }

    /// Forgets the locked pages of `[start, end)`; returns them as `(start, end, unit)`, in order.
    pub fn remove(&mut self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        let mut out: Vec<(u64, u64, u64)> = self
            .sets
            .iter_mut()
            .flat_map(|(u, s)| s.remove(start, end).into_iter().map(|(a, b)| (a, b, *u)))
            .collect();
        out.sort_unstable();
        out
    }

    /// The units (in pages) of the locks that may have to go when `[start, end)` is no longer
    /// pinned: those with a run inside the unit-aligned hull of the range.
    pub fn units_around(&self, start: u64, end: u64) -> Units {
        let mut out = Units::default();
        for (u, s) in &self.sets {
            if s.any(start / u * u, end.div_ceil(*u).saturating_mul(*u)) {
                out.0[out.1] = *u;
                out.1 += 1;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_split_and_report_gaps() {
        let mut l = Locked::default();
        l.insert(10, 20, 1);
        l.insert(20, 30, 1);
        l.insert(512, 1024, 512);
        assert_eq!(l.pages(), 20 + 512);
        assert_eq!(l.gaps(0, 40), vec![(0, 10), (30, 40)]);
        assert_eq!(l.remove(12, 14), vec![(12, 14, 1)]);
        assert_eq!(l.gaps(10, 30), vec![(12, 14)]);
        assert_eq!(
            l.units_around(600, 601).iter().collect::<Vec<_>>(),
            vec![512]
        );
        assert_eq!(l.units_around(40, 41).iter().count(), 0);
        assert_eq!(l.units_around(31, 40).iter().count(), 0);
        assert_eq!(
            l.units_around(12, 600).iter().collect::<Vec<_>>(),
            vec![1, 512]
        );
        assert_eq!(l.remove(0, u64::MAX).len(), 3);
        assert_eq!(l.pages(), 0);
    }
}
