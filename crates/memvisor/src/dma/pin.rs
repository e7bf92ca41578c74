//! Pinning host memory for DMA: the process-wide registry, batched pins, extents, unpin by run.
//!
//! In a process, a pin is a promise that a host page stays resident and where it is until it is
//! unpinned: the page is faulted in and locked — `mlock` does both, writable for private writable
//! memory, like `MADV_POPULATE_WRITE` — and, when the consumer programs a real IOMMU or does IOVA-as-PA DMA, its
//! physical frame read from `/proc/self/pagemap`. mlock does not nest — one munlock undoes any
//! number of mlocks — so nesting lives here: one [`PinRegistry`] per process counts pins per host
//! page ([`RunCounts`](super::counts) keyed by page number), across every DMA space, mapping and
//! device. Only a 0 -> 1 transition locks and is charged to the locked-memory account, only a
//! 1 -> 0 transition unlocks and is released; a page pinned through two IOVAs is locked and
//! charged once.
//!
//! **Pinning goes in steps** of a batch of pages (512 by default, one 4 KiB page of pagemap
//! entries — seed 000's batch). Per step, under the lock: find the pages no one has pinned yet,
//! check the limit, mlock those pages — one call per run of them — and count; then, outside the
//! lock, read the step's frames with one `pread` and extend the extents (runs contiguous in both
//! virtual and physical address) kept across steps. If any step fails, every earlier step of the
//! call is unpinned again: a pin is all or nothing. There is no separate `MADV_POPULATE` pass:
//! mlock faults pages in itself, and a second walk over 4 KiB pages that are already present
//! cost as much as the mlock (0.13 s per GiB on the reference machine).
//!
//! **Unpinning goes by run** (seed 001): one walk of the counts, one munlock and one accounting
//! update per run that drops to zero, however many pages or huge pages it spans. A batch of one
//! page turns both directions into the page-at-a-time baseline the benchmarks compare against.
//!
//! **Huge pages are whole units.** Counts are kept per 4 KiB page exactly as pinned, so any
//! pattern of pins and unpins balances; but a hugetlbfs page cannot be locked or unlocked in
//! part, and mlocking part of a transparent huge page splits its mapping into 4 KiB entries for
//! good. So what is locked and charged is the memory's huge page (the granule): it is locked
//! when the first of its 4 KiB pages is pinned and unlocked when the last one is unpinned —
//! decided per run by looking only at the run's two end units. A single pinned 4 KiB page of
//! THP memory therefore locks and charges 2 MiB, as it does on hugetlbfs.
//!
//! Locking order: a DMA space's writer lock, then this registry's lock; nothing here calls up.
//! Whoever must not race a pin (discarding memory) takes the registry's lock too.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use super::account::{Account, Capability, LockLimit, capable};
use super::counts::RunCounts;
use super::locked::Locked;
use crate::addr::Hva;
use crate::error::{Error, Result};

/// Pages per step when pinning: one 4 KiB page of pagemap entries, as in seed 000.
pub const PIN_BATCH: usize = 512;

const PAGE: u64 = 4096;

/// One piece of pinned memory, contiguous in host virtual address and, when frames were asked
/// for, in physical frame numbers: the unit a hardware IOMMU would be programmed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostExtent {
    /// First byte.
    pub hva: Hva,
    /// Bytes.
    pub len: u64,
    /// Physical frame number of the first page, when frames were read.
    pub pfn: Option<u64>,
}

/// What to pin.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PinRequest {
    /// First byte, page aligned.
    pub hva: u64,
    /// Bytes, a page multiple.
    pub len: u64,
    /// The memory's page size: pins are rounded out to it.
    pub granule: u64,
    /// Pages per step; 1 is the page-at-a-time baseline.
    pub batch: usize,
    /// Read physical frames and return extents split where frames are not consecutive.
    pub frames: bool,
}

impl PinRequest {
    /// The 4 KiB pages the pin counts (`hva` and `len` are page multiples; the end may be
    /// the top of the address space).
    fn pages(&self) -> (u64, u64) {
        (self.hva / PAGE, self.hva / PAGE + self.len.div_ceil(PAGE))
    }

    /// Pages `[start, end)` rounded out to whole units: what pinning them locks.
    fn units(&self, start: u64, end: u64) -> (u64, u64) {
        let unit = self.unit();
        (start / unit * unit, end.div_ceil(unit) * unit)
    }

    /// The granule in pages.
    fn unit(&self) -> u64 {
        (self.granule / PAGE).max(1)
    }
}

/// The units (granule-aligned page ranges of `unit` pages) that the run `[s, e)` — pages whose
/// count just dropped to zero — frees, as one range: those with no other counted page. Only the
/// run's two end units can hold other pages, so only they are looked at.
fn whole_units(pages: &RunCounts, s: u64, e: u64, unit: u64) -> Option<(u64, u64)> {
    let mut us = s / unit * unit;
    let mut ue = e.div_ceil(unit) * unit;
    if us < s && pages.any_counted(us, s) {
        us += unit;
    }
    if e < ue && pages.any_counted(e, ue) {
        ue -= unit;
    }
    (us < ue).then_some((us, ue))
}

struct State {
    /// Pins per 4 KiB host page.
    pages: RunCounts,
    /// What is mlocked on the pins' behalf: whole units around pinned pages, and locks whose
    /// munlock failed. The account charges exactly this.
    locked: Locked,
    /// Runs a munlock failed for (the kernel could not split the area, e.g. at
    /// `vm.max_map_count`): still locked and charged, tried again at the next pin or unpin.
    stuck: Vec<(u64, u64)>,
    /// Scratch list kept between calls, so that an unpin allocates nothing.
    zero: Vec<(u64, u64)>,
    account: Account,
}

impl State {
    /// Unlocks and releases what the pages of `runs` (no longer pinned) held locked: the units
    /// of every lock around them that no pin is left in. A munlock that fails leaves its pages
    /// locked, charged and remembered in `stuck`.
    fn release(&mut self, runs: &[(u64, u64)]) {
        for &(s, e) in runs {
            for unit in self.locked.units_around(s, e).iter() {
                let Some((us, ue)) = whole_units(&self.pages, s, e, unit) else {
                    continue;
                };
                for (a, b, u) in self.locked.remove(us, ue) {
                    if munlock(a, b).is_ok() {
                        self.account.release((b - a) * PAGE);
                    } else {
                        self.locked.insert(a, b, u);
                        self.stuck.push((a, b));
                    }
                }
            }
        }
    }

    /// The account charges exactly what is locked.
    fn check_account(&self) {
        debug_assert_eq!(self.account.locked(), self.locked.pages() * PAGE);
    }

    /// Tries the failed munlocks again (their pages may since have been pinned again, which
    /// keeps them).
    fn retry_stuck(&mut self) {
        if self.stuck.is_empty() {
            return;
        }
        let stuck = std::mem::take(&mut self.stuck);
        let free: Vec<(u64, u64)> = stuck
            .iter()
            .flat_map(|&(s, e)| self.pages.gaps(s, e))
            .collect();
        self.release(&free);
    }

    /// Locks `[start, end)` (not locked now) in units of `unit` pages and charges it, all or
    /// nothing.
    fn lock_runs(&mut self, runs: &[(u64, u64)], unit: u64) -> Result<()> {
        let bytes: u64 = runs.iter().map(|(s, e)| (e - s) * PAGE).sum();
        self.account.charge(bytes)?;
        for (i, &(s, e)) in runs.iter().enumerate() {
            if let Err(err) = mlock(s, e) {
                // A failed mlock may have locked part of its range (the areas before the one
                // that could not be split or faulted in): undo it with the others.
                for &(s, e) in &runs[..=i] {
                    if munlock(s, e).is_err() {
                        self.locked.insert(s, e, unit);
                        self.stuck.push((s, e));
                    } else {
                        self.account.release((e - s) * PAGE);
                    }
                }
                for &(s, e) in &runs[i + 1..] {
                    self.account.release((e - s) * PAGE);
                }
                return Err(err);
            }
        }
        for &(s, e) in runs {
            self.locked.insert(s, e, unit);
        }
        Ok(())
    }
}

/// Pin counts for every host page of the process, and the locked-memory account.
///
/// mlock is process-wide, so there should be one registry per process: [`PinRegistry::global`],
/// which every [`DmaSpace`](super::DmaSpace) uses unless its config names another. Separate
/// registries are safe only over memory no other registry pins (tests, benchmarks).
pub struct PinRegistry {
    state: Mutex<State>,
    pagemap: OnceLock<std::result::Result<File, String>>,
}

impl std::fmt::Debug for PinRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let st = self.lock();
        f.debug_struct("PinRegistry")
            .field("pinned_pages", &st.pages.pages())
            .field("locked_bytes", &st.account.locked())
            .field("limit", &st.account.limit())
            .finish()
    }
}

impl PinRegistry {
    /// A registry of its own, held to `limit`.
    pub fn new(limit: LockLimit) -> Arc<Self> {
        Arc::new(PinRegistry {
            state: Mutex::new(State {
                pages: RunCounts::default(),
                locked: Locked::default(),
                stuck: Vec::new(),
                zero: Vec::new(),
                account: Account::new(limit),
            }),
            pagemap: OnceLock::new(),
        })
    }

    /// The process's registry, held to `RLIMIT_MEMLOCK` unless [`PinRegistry::set_limit`] says
    /// otherwise.
    pub fn global() -> Arc<Self> {
        static GLOBAL: OnceLock<Arc<PinRegistry>> = OnceLock::new();
        GLOBAL
            .get_or_init(|| PinRegistry::new(LockLimit::Rlimit))
            .clone()
    }

    /// Changes the limit. Pins already held stay; the next pin is checked against the new one.
    pub fn set_limit(&self, limit: LockLimit) {
        self.lock().account.set_limit(limit);
    }

    /// The limit pins are held to.
    pub fn limit(&self) -> LockLimit {
        self.lock().account.limit()
    }

    /// Bytes locked by pins now (each page once, however often it is pinned).
    pub fn locked_bytes(&self) -> u64 {
        self.lock().account.locked()
    }

    /// How many pins hold the host page containing `hva`.
    pub fn pin_count(&self, hva: Hva) -> u64 {
        self.lock().pages.count(hva.0 / PAGE)
    }

    /// The pinned runs of host memory as `(first byte, bytes, count)`, in address order.
    pub fn pinned(&self) -> Vec<(Hva, u64, u64)> {
        self.lock()
            .pages
            .runs()
            .map(|(s, e, c)| (Hva(s * PAGE), (e - s) * PAGE, c))
            .collect()
    }

    /// Runs `f` on the host pages held locked for pins (4 KiB page numbers, `hva / 4096`; whole
    /// huge pages where memory is locked in them) while holding the lock every pin and unpin
    /// takes. Whatever `f` sees unlocked stays unpinned until it returns: a pin that races it
    /// either locked its pages before `f` ran or locks (and faults in) the pages after `f` is
    /// done with them. Discarding uses this; keep `f` short, pins wait for it.
    pub(crate) fn with_locked<R>(&self, f: impl FnOnce(&Locked) -> R) -> R {
        f(&self.lock().locked)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pins `req` in steps, all or nothing, and returns its extents: one for the whole range
    /// unless frames were asked for.
    pub(crate) fn pin(&self, req: &PinRequest) -> Result<Vec<HostExtent>> {
        let mut extents = Extents::default();
        self.pin_steps(req, &mut extents)?;
        if !req.frames {
            extents.0.push(HostExtent {
                hva: Hva(req.hva),
                len: req.len,
                pfn: None,
            });
        }
        Ok(extents.0)
    }

    /// Pins `req` (which asks for no frames) in steps, all or nothing; no extents.
    pub(crate) fn pin_only(&self, req: &PinRequest) -> Result<()> {
        debug_assert!(!req.frames);
        self.pin_steps(req, &mut Extents::default())
    }

    /// Pins `req` in steps, all or nothing, adding to `extents` when frames are asked for.
    fn pin_steps(&self, req: &PinRequest, extents: &mut Extents) -> Result<()> {
        let pagemap = if req.frames {
            Some(self.pagemap()?)
        } else {
            None
        };
        let (first, end) = req.pages();
        let step = req.batch.max(1) as u64;
        if end - first > step {
            // Refuse up front when the whole call cannot fit, before any work; each step
            // still checks again under the lock, since other pins may come in between.
            let mut st = self.lock();
            let (us, ue) = req.units(first, end);
            let new: u64 = st.locked.gaps(us, ue).iter().map(|(s, e)| e - s).sum();
            st.account.check(new * PAGE)?;
        }
        let mut at = first;
        while at < end {
            let step_end = end.min(at.saturating_add(step));
            let pinned = self.pin_step(req, at, step_end);
            let step_pinned = pinned.is_ok();
            let done = pinned.and_then(|()| match pagemap {
                Some(file) => extents.read_frames(file, req, at, step_end),
                None => Ok(()),
            });
            if let Err(e) = done {
                // A step that failed pinned nothing; a step whose frames could not be read did.
                let pinned_to = if step_pinned { step_end } else { at };
                if pinned_to > first {
                    self.unpin_pages(first, pinned_to, req);
                }
                return Err(e);
            }
            at = step_end;
        }
        Ok(())
    }

    /// Pins pages `[start, end)`: locks (faulting in), charges and counts what no lock holds
    /// yet, in whole units. On error nothing of the step stays pinned or charged.
    fn pin_step(&self, req: &PinRequest, start: u64, end: u64) -> Result<()> {
        let mut st = self.lock();
        st.retry_stuck();
        let (us, ue) = req.units(start, end);
        let new = st.locked.gaps(us, ue);
        st.lock_runs(&new, req.unit())?;
        st.pages.add(start, end);
        st.check_account();
        Ok(())
    }

    /// Unpins what `req` pinned.
    pub(crate) fn unpin(&self, req: &PinRequest) {
        let (first, end) = req.pages();
        self.unpin_pages(first, end, req);
    }

    /// Drops one pin from each page of `[first, end)`: one munlock and one release per run of
    /// units that no pin holds any more, or a page at a time when the batch is 1.
    fn unpin_pages(&self, first: u64, end: u64, req: &PinRequest) {
        let step = if req.batch <= 1 { 1 } else { end - first };
        let mut at = first;
        while at < end {
            let step_end = end.min(at.saturating_add(step));
            let mut st = self.lock();
            st.retry_stuck();
            let mut zero = std::mem::take(&mut st.zero);
            zero.clear();
            match st.pages.sub_reporting(at, step_end, &mut zero) {
                Ok(()) => st.release(&zero),
                // Callers only unpin what they pinned; a hole here is a bookkeeping bug, and
                // unlocking someone else's pages would be worse than leaving this one.
                Err(page) => debug_assert!(false, "unpin of page {page:#x}, which is not pinned"),
            }
            st.zero = zero;
            st.check_account();
            at = step_end;
        }
    }

    fn pagemap(&self) -> Result<&File> {
        let opened = self.pagemap.get_or_init(|| {
            if !capable(Capability::SysAdmin) {
                return Err("CAP_SYS_ADMIN".into());
            }
            File::open("/proc/self/pagemap").map_err(|e| e.to_string())
        });
        opened.as_ref().map_err(|why| match why.as_str() {
            "CAP_SYS_ADMIN" => Error::NeedsCapability {
                what: "reading physical frames from /proc/self/pagemap",
                capability: "CAP_SYS_ADMIN",
            },
            other => Error::Unsupported {
                what: "/proc/self/pagemap",
                why: other.to_string(),
            },
        })
    }
}

/// Extents under construction, kept across steps so a run continues into the next batch.
#[derive(Default)]
struct Extents(Vec<HostExtent>);

impl Extents {
    /// Reads the frames of the requested part of pages `[start, end)`, 512 entries per `pread`,
    /// and extends the extents with them.
    fn read_frames(&mut self, file: &File, req: &PinRequest, start: u64, end: u64) -> Result<()> {
        let start = start.max(req.hva / PAGE);
        let end = end.min((req.hva + req.len) / PAGE);
        let mut buf = [0u64; PIN_BATCH];
        let mut at = start;
        while at < end {
            let n = ((end - at) as usize).min(PIN_BATCH);
            let bytes = pread_entries(file, at, &mut buf[..n])?;
            for (i, &entry) in buf[..bytes].iter().enumerate() {
                let page = at + i as u64;
                if entry >> 63 == 0 {
                    return Err(Error::Unsupported {
                        what: "physical frames",
                        why: format!("page at {:#x} is not present although pinned", page * PAGE),
                    });
                }
                self.push(page * PAGE, entry & ((1 << 55) - 1));
            }
            at += bytes as u64;
        }
        Ok(())
    }

    fn push(&mut self, hva: u64, pfn: u64) {
        if let Some(last) = self.0.last_mut() {
            let pages = last.len / PAGE;
            if last.hva.0 + last.len == hva && last.pfn.map(|p| p + pages) == Some(pfn) {
                last.len += PAGE;
                return;
            }
        }
        self.0.push(HostExtent {
            hva: Hva(hva),
            len: PAGE,
            pfn: Some(pfn),
        });
    }
}

/// Reads pagemap entries for the pages from `page` into `out`; returns how many were read.
fn pread_entries(file: &File, page: u64, out: &mut [u64]) -> Result<usize> {
    let mut raw = [0u8; PIN_BATCH * 8];
    let raw = &mut raw[..out.len() * 8];
    let got = file.read_at(raw, page * 8).map_err(|source| Error::Os {
        op: "pread(/proc/self/pagemap)",
        source,
    })?;
    if got < 8 {
        return Err(Error::Unsupported {
            what: "physical frames",
            why: format!("pagemap has no entry for {:#x}", page * PAGE),
        });
    }
    for (o, chunk) in out.iter_mut().zip(raw[..got].chunks_exact(8)) {
        *o = u64::from_ne_bytes(chunk.try_into().expect("8 bytes"));
    }
    Ok(got / 8)
}

fn mlock(start: u64, end: u64) -> Result<()> {
    // SAFETY: mlock changes residency only, never contents or mappings.
    let rc = unsafe {
        libc::mlock(
            (start * PAGE) as *const libc::c_void,
            ((end - start) * PAGE) as usize,
        )
    };
    if rc != 0 {
        return Err(Error::last_os("mlock while pinning"));
    }
    Ok(())
}

/// Unlocks pages `[start, end)`. It fails with ENOMEM when the kernel cannot split an area
/// (`vm.max_map_count`) or part of the range is no longer mapped; the pages that could not be
/// unlocked then stay locked.
fn munlock(start: u64, end: u64) -> Result<()> {
    // SAFETY: munlock changes residency only, never contents or mappings.
    let rc = unsafe {
        libc::munlock(
            (start * PAGE) as *const libc::c_void,
            ((end - start) * PAGE) as usize,
        )
    };
    if rc != 0 {
        return Err(Error::last_os("munlock while unpinning"));
    }
    Ok(())
}
