//! What the pin registry holds `mlock`ed: runs of host pages, each tagged with the unit it was
//! locked in; and which of those locks no pin needs any more (the lock cache).
//!
//! Pin counts say which pages a device relies on; this says which pages the registry has asked
//! the kernel to lock. The two differ because memory is locked in whole units — a huge page of
//! hugetlbfs or THP memory, whose 4 KiB pins would otherwise split it — because a munlock can
//! fail (ENOMEM when the kernel cannot split the area: `vm.max_map_count`), leaving pages locked
//! that no pin needs any more, and because the registry keeps the locks of short-lived pins for
//! a while after their last unpin ([`Idle`]). Keeping the locked pages as their own set makes the
//! kernel's side exact by construction: the set is exactly what the kernel shows as the
//! process's `VmLck` for memory pinned through the registry, and the account charges exactly
//! the set minus its idle part.
//!
//! Runs are kept per unit (at most three: 4 KiB, 2 MiB, 1 GiB), each set sorted, disjoint and
//! merged where runs touch, so a mapping pinned whole is one run however large. The same page is
//! never in two sets. Asking "does a unit-`U` run lie within the `U`-aligned units around these
//! pages" is one ordered lookup per set, so an unpin finds the huge pages it may release without
//! scanning anything else.
//!
//! [`Idle`] is the lock cache: runs of the locked set that no pin holds, each tagged with its
//! unit and the time of its last use. A pin of idle memory takes its runs back (no
//! system call); the least recently used run is unlocked when the cache passes its bounds.
//! Runs are not merged, so each keeps its own age, and the bound on entries is a bound on the
//! memory areas the cache can split off in the kernel.

use std::collections::{BTreeMap, BTreeSet};

use super::counts::overlapping;

/// Disjoint runs `[start, end)` of page numbers, touching runs merged.
#[derive(Clone, Debug, Default)]
struct RunSet {
    runs: BTreeMap<u64, u64>,
    pages: u64,
}

impl RunSet {
    /// The runs overlapping `[start, end)`, clipped to it, in order.
    fn overlapping(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        self.overlapping_iter(start, end).collect()
    }

    /// [`RunSet::overlapping`], lazily.
    fn overlapping_iter(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        overlapping(&self.runs, start, end, |&e| e)
            .map(move |(s, &e)| (s.max(start), e.min(end)))
            .filter(|(s, e)| s < e)
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

    /// The end of the run holding page `at`, if one does.
    fn run_at(&self, at: u64) -> Option<u64> {
        self.runs
            .range(..=at)
            .next_back()
            .map(|(_, &e)| e)
            .filter(|&e| e > at)
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

    /// Removes the pages of `[start, end)`; appends the pieces that were in the set to `out`
    /// as `(start, end, unit)`, in order. Nothing is allocated but `out`'s growth: this is on
    /// every unpin's path.
    fn remove_into(&mut self, start: u64, end: u64, unit: u64, out: &mut Vec<(u64, u64, u64)>) {
        let mut at = start;
        while at < end {
            // The first run overlapping [at, end). What is put back of a run lies before
            // `start` or from `end` on, so it is never found again.
            let Some((rs, re)) = self
                .runs
                .range(..=at)
                .next_back()
                .filter(|(_, e)| **e > at)
                .or_else(|| self.runs.range(at..end).next())
                .map(|(&s, &e)| (s, e))
            else {
                break;
            };
            let (s, e) = (rs.max(start), re.min(end));
            self.runs.remove(&rs);
            if rs < s {
                self.runs.insert(rs, s);
            }
            if e < re {
                self.runs.insert(e, re);
            }
            self.pages -= e - s;
            out.push((s, e, unit));
            at = e;
        }
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
        let mut out = Vec::new();
        self.gaps_into(start, end, &mut out);
        out
    }

    /// [`Locked::gaps`], appended to `out`. With one unit (the usual case) nothing is
    /// allocated but `out`'s growth.
    pub fn gaps_into(&self, start: u64, end: u64, out: &mut Vec<(u64, u64)>) {
        let mut at = start;
        let mut step = |(s, e): (u64, u64)| {
            if s > at {
                out.push((at, s));
            }
            at = at.max(e);
        };
        match self.sets.as_slice() {
            [] => {}
            [(_, set)] => set.overlapping_iter(start, end).for_each(&mut step),
            sets => {
                let mut held: Vec<(u64, u64)> = sets
                    .iter()
                    .flat_map(|(_, s)| s.overlapping(start, end))
                    .collect();
                held.sort_unstable();
                held.into_iter().for_each(&mut step);
            }
        }
        if at < end {
            out.push((at, end));
        }
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
        let mut out = Vec::new();
        self.remove_into(start, end, &mut out);
        out
    }

    /// [`Locked::remove`], into `out` (emptied first).
    pub fn remove_into(&mut self, start: u64, end: u64, out: &mut Vec<(u64, u64, u64)>) {
        out.clear();
        for (u, s) in &mut self.sets {
            s.remove_into(start, end, *u, out);
        }
        if self.sets.len() > 1 {
            out.sort_unstable();
        }
    }

    /// The locked pieces of `[start, end)` as `(start, end, unit)`, in order; nothing changes.
    #[cfg(test)]
    pub fn pieces(&self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        let mut out: Vec<(u64, u64, u64)> = self.pieces_iter(start, end).collect();
        out.sort_unstable();
        out
    }

    /// The locked pieces of `[start, end)` as `(start, end, unit)`, unit by unit.
    pub fn pieces_iter(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.sets
            .iter()
            .flat_map(move |(u, s)| s.overlapping_iter(start, end).map(|(a, b)| (a, b, *u)))
    }

    /// Whether every page of `[start, end)` is locked (in any unit).
    pub fn covers(&self, start: u64, end: u64) -> bool {
        let mut at = start;
        while at < end {
            let next = self
                .sets
                .iter()
                .find_map(|(_, s)| s.run_at(at).map(|e| e.min(end)));
            match next {
                Some(e) => at = e,
                None => return false,
            }
        }
        true
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

/// One idle run: its end, its unit (pages) and when it was last used.
#[derive(Clone, Copy, Debug)]
struct IdleRun {
    end: u64,
    unit: u64,
    used: u64,
}

/// Locked runs that no pin holds: the lock cache. See the module documentation.
#[derive(Clone, Debug, Default)]
pub(crate) struct Idle {
    runs: BTreeMap<u64, IdleRun>,
    /// The runs as `(used, start)`: oldest first.
    by_age: BTreeSet<(u64, u64)>,
    pages: u64,
    clock: u64,
}

impl Idle {
    /// Pages held idle.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Runs held idle.
    pub fn len(&self) -> usize {
        self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// Records `[start, end)` — locked in units of `unit` pages (whole units, but where the
    /// same memory was also pinned in another granule), not idle now — as idle and just used.
    pub fn insert(&mut self, start: u64, end: u64, unit: u64) {
        self.clock += 1;
        self.put(start, end, unit, self.clock);
    }

    fn put(&mut self, start: u64, end: u64, unit: u64, used: u64) {
        debug_assert!(start < end && unit > 0);
        debug_assert!(
            self.overlapping(start, end).next().is_none(),
            "idle twice: [{start:#x}, {end:#x})"
        );
        self.runs.insert(start, IdleRun { end, unit, used });
        self.by_age.insert((used, start));
        self.pages += end - start;
    }

    /// Removes the run starting at `start`, which is there.
    fn cut(&mut self, start: u64) -> IdleRun {
        let r = self.runs.remove(&start).expect("an idle run starts here");
        self.by_age.remove(&(r.used, start));
        self.pages -= r.end - start;
        r
    }

    /// The runs overlapping `[start, end)`, as `(start, run)`.
    fn overlapping(&self, start: u64, end: u64) -> impl Iterator<Item = (u64, IdleRun)> + '_ {
        overlapping(&self.runs, start, end, |r| r.end).map(|(s, &r)| (s, r))
    }

    /// Idle pages inside `[start, end)`.
    pub fn pages_in(&self, start: u64, end: u64) -> u64 {
        self.overlapping(start, end)
            .map(|(s, r)| r.end.min(end).saturating_sub(s.max(start)))
            .sum()
    }

    /// Takes out the idle pages around `[start, end)`: of each idle run overlapping it, the
    /// part inside the range rounded out to whole units of the run's own unit. Returns the
    /// parts as `(start, end, unit)`; what is left of the runs stays idle, as old as it was.
    pub fn take(&mut self, start: u64, end: u64, out: &mut Vec<(u64, u64, u64)>) {
        let first = out.len();
        // Always the last run starting before `end`: once it does not reach into the range,
        // no earlier one does (runs are disjoint and sorted).
        while let Some((&s, &r)) = self.runs.range(..end).next_back() {
            if r.end <= start {
                break;
            }
            self.cut(s);
            let ts = s.max(start / r.unit * r.unit);
            let te = r.end.min(end.div_ceil(r.unit).saturating_mul(r.unit));
            if s < ts {
                self.put(s, ts, r.unit, r.used);
            }
            if te < r.end {
                self.put(te, r.end, r.unit, r.used);
            }
            out.push((ts, te, r.unit));
        }
        out[first..].reverse();
    }

    /// Puts back runs [`Idle::take`] returned, as just used.
    pub fn give_back(&mut self, runs: &[(u64, u64, u64)]) {
        for &(s, e, u) in runs {
            self.insert(s, e, u);
        }
    }

    /// Removes every run overlapping `[start, end)`, whole; returns them as `(start, end, unit)`.
    pub fn remove_overlapping(&mut self, start: u64, end: u64) -> Vec<(u64, u64, u64)> {
        let hit: Vec<(u64, u64, u64)> = self
            .overlapping(start, end)
            .map(|(s, r)| (s, r.end, r.unit))
            .collect();
        for &(s, _, _) in &hit {
            self.cut(s);
        }
        hit
    }

    /// Removes the idle pages of `[start, end)` exactly (runs reaching past it keep their parts
    /// outside); returns how many there were.
    pub fn remove_in(&mut self, start: u64, end: u64) -> u64 {
        let mut gone = 0;
        while let Some((&s, &r)) = self.runs.range(..end).next_back() {
            if r.end <= start {
                break;
            }
            self.cut(s);
            if s < start {
                self.put(s, start, r.unit, r.used);
            }
            if end < r.end {
                self.put(end, r.end, r.unit, r.used);
            }
            gone += r.end.min(end) - s.max(start);
        }
        gone
    }

    /// Removes the least recently used run and returns it as `(start, end, unit)`.
    pub fn pop_oldest(&mut self) -> Option<(u64, u64, u64)> {
        let &(_, s) = self.by_age.first()?;
        let r = self.cut(s);
        Some((s, r.end, r.unit))
    }

    /// Every run as `(start, end, unit)`, in address order.
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.runs.iter().map(|(&s, r)| (s, r.end, r.unit))
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

    #[test]
    fn covers_and_pieces_see_every_unit() {
        let mut l = Locked::default();
        l.insert(0, 4, 1);
        l.insert(512, 1024, 512);
        l.insert(4, 8, 1);
        assert!(l.covers(0, 8));
        assert!(l.covers(600, 700));
        assert!(!l.covers(6, 9));
        assert!(l.covers(5, 5));
        assert_eq!(l.pieces(6, 520), vec![(6, 8, 1), (512, 520, 512)]);
    }

    #[test]
    fn idle_takes_whole_units_and_evicts_the_oldest() {
        let mut i = Idle::default();
        i.insert(0, 8, 1);
        i.insert(512, 1536, 512);
        i.insert(20, 21, 1);
        assert_eq!((i.pages(), i.len()), (8 + 1024 + 1, 3));
        // A 4 KiB page inside a 2 MiB run takes its whole huge page; the rest stays idle.
        let mut got = Vec::new();
        i.take(600, 601, &mut got);
        assert_eq!(got, vec![(512, 1024, 512)]);
        // A range over two runs takes the parts inside it.
        got.clear();
        i.take(6, 21, &mut got);
        assert_eq!(got, vec![(6, 8, 1), (20, 21, 1)]);
        assert_eq!(
            i.runs().collect::<Vec<_>>(),
            vec![(0, 6, 1), (1024, 1536, 512)]
        );
        assert_eq!(i.pages(), 6 + 512);
        // What was left keeps its age: [0, 6) is older than [1024, 1536).
        assert_eq!(i.pop_oldest(), Some((0, 6, 1)));
        i.give_back(&[(20, 21, 1)]);
        assert_eq!(i.pop_oldest(), Some((1024, 1536, 512)));
        assert_eq!(i.remove_overlapping(0, 100), vec![(20, 21, 1)]);
        assert!(i.is_empty());
        assert_eq!(i.pages(), 0);
        got.clear();
        i.take(0, u64::MAX, &mut got);
        assert!(got.is_empty());
        i.insert(0, 512, 512);
        i.insert(600, 610, 1);
        assert_eq!(i.remove_in(100, 605), 412 + 5);
        assert_eq!(
            i.runs().collect::<Vec<_>>(),
            vec![(0, 100, 512), (605, 610, 1)]
        );
        assert_eq!(i.pages(), 105);
    }
}
