//! Device pins: the pages an emulated device pins by IOVA (`pin_pages` / `unpin_pages`), and
//! the unmap notifier that asks for them back.
//!
//! These are the pins a device takes and gives back itself, one IOVA page at a time, as opposed
//! to the pins a space holds for whole mappings in [`PinMode::Eager`](super::PinMode) (`mode`).
//! Both end up in the process's pin registry ([`crate::pin`]), which counts and locks host
//! pages; this module keeps the per-IOVA-page counts and the protocol with devices.
//!
//! An emulated device (type1's mdev/vfio-ccw case, a vfio-user server) does not want whole
//! mappings pinned; it pins the pages it hands to asynchronous I/O, a few at a time, by IOVA page
//! number (`iova >> 12`), at most [`PIN_PAGES_MAX`] per call, and gets their host addresses back.
//! Each IOVA page keeps a count of device pins (pinning a page twice needs two unpins), and the
//! host pages are counted by the process's pin registry like every other pin.
//!
//! **Holds** (`hold_pages`) are device pins that lock nothing: counted here and in the
//! registry like any pin — so discards skip their pages and unmaps wait for them — but not
//! locked, faulted in or charged to the locked-memory limit, which therefore never refuses one.
//! They are for devices whose only access to the pages is through this process's own mapping
//! (the CPU, `preadv` / `pwritev`, io_uring): the kernel faults such pages in, and pins them
//! itself for the length of an `O_DIRECT` transfer. Both kinds are released by `unpin_pages`.
//!
//! **Grouping** (the kernel patch "vfio iommu type1: Improve vfio_iommu_type1_pin_pages
//! performance"). The pages of one call are often contiguous: the call is split into
//! runs of consecutive page numbers and each run is pinned with one registry call — one fault-in,
//! one mlock — instead of one per page. But most calls in real workloads are single pages
//! (vfio-ccw booting a guest: 81% of calls; 87% of runs), and the kernel's first attempt at
//! grouping made those slower by splitting the array in a separate pass. [`Grouping::Adaptive`]
//! finds runs in the same pass that pins them, so a single page costs exactly what the per-page
//! path costs and a run costs one pin; [`Grouping::Runs`] is the two-pass split and
//! [`Grouping::PerPage`] the page-at-a-time baseline, both kept for the benchmarks.
//!
//! **Unmapping pinned memory.** A device must not lose memory it pinned, and must not touch
//! memory taken away from it. An unmap, IOTLB invalidation or vaddr invalidation of a range
//! where devices hold pins closes the range to new pins at once, calls every registered unmap
//! notifier with each such range, with no lock held, so the devices can finish their I/O and
//! unpin, and waits until they have (`retire`); a device that keeps its pins past
//! [`DmaConfig::unpin_wait`](super::DmaConfig::unpin_wait) makes the change fail with EBUSY
//! and change nothing. Never a panic, never a pin left pointing at unmapped memory.
//!
//! `pin_pages` holds the space's writer lock, so it cannot interleave with the step that
//! closes a range: a pin either lands before it (and is waited for) or finds the range gone
//! (EINVAL, as for memory never mapped).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::index::DmaSnapshot;
use super::{DmaSpace, Mapping, Prot, Shared, Writer};
use crate::addr::{Hva, Iova, PAGE_4K as PAGE};
use crate::error::{Error, Result};
use crate::pin::PinRequest;
use crate::pin::counts::RunCounts;
use crate::sync::lock;

/// Most pages one `pin_pages` / `unpin_pages` call takes (type1's
/// `VFIO_PIN_PAGES_MAX_ENTRIES`: one page of entries).
pub const PIN_PAGES_MAX: usize = 512;

/// How `pin_pages` groups the pages of a call; see the module documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Grouping {
    /// One pin per page: the baseline.
    PerPage,
    /// Split the call into runs of consecutive pages first, then pin each run (the kernel
    /// patch's way).
    Runs,
    /// Find runs while pinning, in one pass: never slower than per page, one pin per run.
    #[default]
    Adaptive,
}

/// Copies `dst.len()` bytes from host memory a device pinned with [`DmaSpace::pin_pages`], at
/// `src` (an address it returned, plus an offset inside the pinned pages), into `dst`. The copy
/// is the one `dma_read` uses: guest memory is never seen as a Rust slice.
///
/// # Safety
/// `src .. src + dst.len()` must lie inside pages the caller has pinned and keeps pinned until
/// this call returns (a pin keeps the mapping, and so its memory, from being unmapped).
pub unsafe fn read_pinned(src: Hva, dst: &mut [u8]) {
    // SAFETY: the caller guarantees the range is pinned, so mapped readable, and a pinned guest
    // page is never the caller's own buffer.
    unsafe { crate::copy::from_guest(src.0 as *const u8, dst) }
}

/// Copies `src` into host memory a device pinned with [`DmaSpace::pin_pages`], at `dst`.
///
/// # Safety
/// `dst .. dst + src.len()` must lie inside pages the caller has pinned with WRITE and keeps
/// pinned until this call returns.
pub unsafe fn write_pinned(src: &[u8], dst: Hva) {
    // SAFETY: as the caller guarantees; a pinned guest page is never the caller's own buffer.
    unsafe { crate::copy::to_guest(src, dst.0 as *mut u8) }
}

/// Names a registered unmap notifier, for [`DmaSpace::remove_unmap_notifier`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NotifierId(u64);

type Notifier = Arc<dyn Fn(Iova, u64) + Send + Sync>;

/// The registered unmap notifiers.
#[derive(Default)]
pub(super) struct Notifiers {
    list: Mutex<Vec<(NotifierId, Notifier)>>,
    next: AtomicU64,
}

/// Why one attempt at pinning stopped.
enum Stop {
    /// A mapping's host address is invalidated: wait for the update, then try again.
    Invalidated(u64),
    Failed(Error),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Stop::Failed(e)
    }
}

impl DmaSpace {
    /// Pins the IOVA pages numbered `pages` (`iova >> 12`) for a device and returns the host
    /// address of each, in order. All or nothing: EINVAL if a page is not mapped (or the list is
    /// empty), EPERM if a mapping does not allow `prot`, E2BIG for more than [`PIN_PAGES_MAX`]
    /// pages, ENOMEM past the locked-memory limit, EBUSY if a mapping's host address stays
    /// invalidated past [`DmaConfig::vaddr_wait`](super::DmaConfig::vaddr_wait). Pages pinned
    /// are dirty while dirty tracking is on and they stay pinned, whatever `prot` (type1's rule).
    pub fn pin_pages(&self, pages: &[u64], prot: Prot) -> Result<Vec<Hva>> {
        self.pin_or_hold("pin_pages", pages, prot, true)
    }

    /// Holds the IOVA pages numbered `pages` for a device: a pin that locks nothing. The pages
    /// are counted in the pin registry, so memvisor's discards (a balloon in the same process)
    /// skip them and an unmap of their memory waits for them, exactly as for
    /// [`DmaSpace::pin_pages`]; but they are neither locked nor pinned long-term, faulted in nor
    /// charged to the locked-memory limit, so no limit can refuse a hold. Enough for a device
    /// whose only access to the pages is the CPU's or a system call's on this process's own
    /// mapping (`preadv` / `pwritev`, io_uring, `O_DIRECT`, whose pages the kernel pins itself
    /// for the I/O); not for DMA by physical address. Released with [`DmaSpace::unpin_pages`].
    /// The same errors as `pin_pages`, but never ENOMEM for the limit.
    pub fn hold_pages(&self, pages: &[u64], prot: Prot) -> Result<Vec<Hva>> {
        self.pin_or_hold("hold_pages", pages, prot, false)
    }

    /// [`DmaSpace::pin_pages`] (`lock`) or [`DmaSpace::hold_pages`], named `what` in errors.
    fn pin_or_hold(
        &self,
        what: &'static str,
        pages: &[u64],
        prot: Prot,
        lock: bool,
    ) -> Result<Vec<Hva>> {
        check_count(what, pages)?;
        if prot == Prot::default() {
            return Err(Error::NoAccess { what: what.into() });
        }
        self.refuse_while_invalid(&self.shared.current.load(), pages[0] * PAGE)?;
        // Read the clock only if there is a wait: the deadline counts from the first one.
        let mut deadline = None;
        loop {
            match self.try_pin_pages(pages, prot, lock) {
                Ok(hvas) => return Ok(hvas),
                Err(Stop::Failed(e)) => return Err(e),
                Err(Stop::Invalidated(iova)) => {
                    let deadline = *deadline.get_or_insert_with(|| self.vaddr_deadline());
                    if !self.wait_for_vaddr(Iova(iova), deadline) {
                        return Err(Error::Busy {
                            addr: iova,
                            why: "its host address is invalidated for a live update; pin after \
                                  update_vaddr"
                                .into(),
                        });
                    }
                }
            }
        }
    }

    /// Drops one device pin from each of the IOVA pages `pages`. All or nothing: EINVAL, nothing
    /// unpinned, if a page holds fewer device pins than the list names it.
    pub fn unpin_pages(&self, pages: &[u64]) -> Result<()> {
        check_count("unpin_pages", pages)?;
        let mut writer = self.writer();
        let mut done: Done<(u64, u64)> = Done::default();
        for (i, n) in groups(pages, self.shared.config.grouping) {
            let p = pages[i];
            if let Err(page) = writer.device_pins.sub(p, p + n as u64) {
                for (p, n) in done {
                    writer.device_pins.add(p, p + n);
                }
                return Err(Error::NotPinned(format!(
                    "iova page {page:#x} (iova {:#x}) is not pinned by pin_pages",
                    page.saturating_mul(PAGE)
                )));
            }
            done.push((p, n as u64));
        }
        let snap = self.shared.current.load();
        let retiring = writer.retiring.as_ref().map_or(&[][..], |r| &r.old[..]);
        for (p, n) in done {
            self.shared.unpin_iova_pages(&snap, retiring, p, n);
        }
        self.pins_released(&writer);
        Ok(())
    }

    /// IOVA pages pinned by devices now (each once, however many pins it has).
    pub fn device_pinned_pages(&self) -> u64 {
        self.writer().device_pins.pages()
    }

    /// Registers `notify(iova, size)`, called when an unmap or vaddr invalidation covers a
    /// mapping `[iova, iova + size)` in which devices hold pins; it should unpin them. It is
    /// called with no lock held, again while the pins stay, and may call back into the space
    /// to unpin, copy or translate, but not to map or unmap (EBUSY: that change would wait for
    /// the one that called it).
    pub fn add_unmap_notifier(
        &self,
        notify: impl Fn(Iova, u64) + Send + Sync + 'static,
    ) -> NotifierId {
        let n = &self.shared.notifiers;
        let id = NotifierId(n.next.fetch_add(1, Ordering::Relaxed));
        lock(&n.list).push((id, Arc::new(notify)));
        id
    }

    /// Whether any unmap notifier is registered (a device that pins is attached).
    pub(super) fn has_unmap_notifiers(&self) -> bool {
        !lock(&self.shared.notifiers.list).is_empty()
    }

    /// Unregisters a notifier; returns whether it was registered.
    pub fn remove_unmap_notifier(&self, id: NotifierId) -> bool {
        let mut list = lock(&self.shared.notifiers.list);
        let before = list.len();
        list.retain(|(i, _)| *i != id);
        list.len() != before
    }

    /// Calls every unmap notifier with each of `ranges` (no lock may be held).
    pub(super) fn notify_unmap(&self, ranges: &[(Iova, u64)]) {
        if ranges.is_empty() {
            return;
        }
        let notifiers: Vec<Notifier> = lock(&self.shared.notifiers.list)
            .iter()
            .map(|(_, f)| f.clone())
            .collect();
        for &(iova, size) in ranges {
            for notify in &notifiers {
                notify(iova, size);
            }
        }
    }

    /// Unlocks the locks devices' pins left cached in this space's memory (see
    /// [`PinRegistry::release_cached`](super::PinRegistry::release_cached)); pins held now are
    /// not touched. Unmapping and dropping the space do this by themselves; call it when the
    /// devices will not pin again for a while and the kernel's `VmLck` should show only pins.
    pub fn release_cached_locks(&self) {
        let _writer = self.writer();
        let snap = self.shared.current.load();
        for (_, _, _, m) in snap.map.iter() {
            self.shared.release_cached(m);
        }
    }

    fn try_pin_pages(
        &self,
        pages: &[u64],
        prot: Prot,
        lock: bool,
    ) -> std::result::Result<Vec<Hva>, Stop> {
        let mut writer = self.writer();
        let snap = self.shared.current.load();
        let mut out = Vec::with_capacity(pages.len());
        let mut done: Done<(u64, u64, PinRequest)> = Done::default();
        let mut result = Ok(());
        'groups: for (i, n) in groups(pages, self.shared.config.grouping) {
            let (mut page, end) = (pages[i], pages[i] + n as u64);
            while page < end {
                match self.pin_piece(&mut writer, &snap, page, end, prot, lock) {
                    Ok((req, pinned)) => {
                        out.extend((0..pinned).map(|k| Hva(req.hva + k * PAGE)));
                        done.push((page, pinned, req));
                        page += pinned;
                    }
                    Err(stop) => {
                        result = Err(stop);
                        break 'groups;
                    }
                }
            }
        }
        if let Err(stop) = result {
            for (page, n, req) in done {
                let _ = writer.device_pins.sub(page, page + n);
                self.shared.registry.unpin(&req);
            }
            return Err(stop);
        }
        Ok(out)
    }

    /// Pins (or, without `lock`, holds) the part of IOVA pages `[page, end)` that lies in one
    /// mapping; returns the registry request and how many pages it covered.
    fn pin_piece(
        &self,
        writer: &mut Writer,
        snap: &DmaSnapshot,
        page: u64,
        end: u64,
        prot: Prot,
        lock: bool,
    ) -> std::result::Result<(PinRequest, u64), Stop> {
        let iova = page_iova(page)?;
        let Some((start, last, hot, m)) = snap.entry(iova) else {
            return Err(Error::Invalid(format!(
                "pin_pages: iova page {page:#x} (iova {iova:#x}) is not mapped"
            ))
            .into());
        };
        if !hot.prot().contains(prot) || hot.remote() {
            // The same EPERM, or EFAULT for a peer's memory, that a translation gives.
            return Err(super::translate::refused(iova, start, last, hot, prot).into());
        }
        if !hot.valid() {
            return Err(Stop::Invalidated(iova));
        }
        let pieces = (end - page).min((last - iova) / PAGE + 1);
        let req = PinRequest {
            lock,
            ..self
                .shared
                .device_request(m, hot.delta().wrapping_add(iova), pieces * PAGE)
        };
        self.shared.registry.pin_only(&req)?;
        writer.device_pins.add(page, page + pieces);
        // Pinned pages are dirty while pinned, whatever the protection (type1 marks them
        // when pinned, and every read of the log marks them again).
        super::translate::mark_dirty(m, iova, req.len, self.shared.min_page);
        Ok((req, pieces))
    }
}

impl Shared {
    /// Drops every pin `device_pins` counts and unlocks what devices' pins left in the lock
    /// cache over the space's memory (the space is going away, and its memory may go with it).
    pub(super) fn drop_device_pins(&self, device_pins: &RunCounts) {
        let snap = self.current.load();
        for (s, e, count) in device_pins.runs() {
            for _ in 0..count {
                self.unpin_iova_pages(&snap, &[], s, e - s);
            }
        }
        for (_, _, _, m) in snap.map.iter() {
            self.release_cached(m);
        }
    }

    /// Unlocks the lock cache's entries over `m`'s memory.
    pub(super) fn release_cached(&self, m: &Mapping) {
        if let Some(host) = m.memory.host() {
            let start = host.hva.0;
            self.registry
                .release_cached_in(start, start.saturating_add(m.iova.len()));
        }
    }

    /// Drops the registry pins behind `n` device-pinned IOVA pages from `page`, whose mappings
    /// are valid in `snap` or, while a change takes them away, among `retiring`.
    fn unpin_iova_pages(
        &self,
        snap: &DmaSnapshot,
        retiring: &[(u64, Arc<Mapping>)],
        page: u64,
        n: u64,
    ) {
        let end = page + n;
        let mut page = page;
        while page < end {
            let iova = page * PAGE;
            // Device pins keep their mappings from going, and a change that takes a mapping
            // away keeps it among `retiring` until they are released.
            let found = snap
                .entry(iova)
                .filter(|e| e.2.valid())
                .map(|(_, last, hot, m)| (last, hot.delta().wrapping_add(iova), m))
                .or_else(|| {
                    let (start, m) = retiring
                        .iter()
                        .find(|(s, m)| *s <= iova && iova <= m.iova.last().0)?;
                    let hva = m.memory.host()?.hva.0 + (iova - start);
                    Some((m.iova.last().0, hva, m))
                });
            let Some((last, hva, m)) = found else {
                debug_assert!(false, "device-pinned iova {iova:#x} has no mapping");
                return;
            };
            let pieces = (end - page).min((last - iova) / PAGE + 1);
            let req = self.device_request(m, hva, pieces * PAGE);
            self.registry.unpin(&req);
            page += pieces;
        }
    }
}

fn page_iova(page: u64) -> Result<u64> {
    page.checked_mul(PAGE).ok_or_else(|| {
        Error::Invalid(format!(
            "iova page {page:#x} is beyond the 64-bit IOVA space (page numbers are iova >> 12)"
        ))
    })
}

fn check_count(what: &'static str, pages: &[u64]) -> Result<()> {
    if pages.is_empty() {
        return Err(Error::Invalid(format!("{what} needs at least one page")));
    }
    if pages.len() > PIN_PAGES_MAX {
        return Err(Error::TooBig {
            what,
            count: pages.len() as u64,
            limit: PIN_PAGES_MAX as u64,
        });
    }
    for &page in pages {
        page_iova(page)?;
    }
    Ok(())
}

/// The groups `(first index, pages)` a call is pinned in: runs of consecutive page numbers, or
/// single pages.
fn groups(pages: &[u64], grouping: Grouping) -> Groups<'_> {
    match grouping {
        Grouping::PerPage => Groups::PerPage(0..pages.len()),
        Grouping::Runs => Groups::Split(Runs { pages, at: 0 }.collect::<Vec<_>>().into_iter()),
        Grouping::Adaptive => Groups::Runs(Runs { pages, at: 0 }),
    }
}

/// The iterator [`groups`] returns (an enum, not a box: no allocation per call).
enum Groups<'a> {
    PerPage(std::ops::Range<usize>),
    Split(std::vec::IntoIter<(usize, usize)>),
    Runs(Runs<'a>),
}

impl Iterator for Groups<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        match self {
            Groups::PerPage(r) => r.next().map(|i| (i, 1)),
            Groups::Split(v) => v.next(),
            Groups::Runs(r) => r.next(),
        }
    }
}

/// What a call did so far, to undo on failure: the first item inline, so that a call of one
/// group allocates nothing for it.
struct Done<T> {
    first: Option<T>,
    rest: Vec<T>,
}

impl<T> Default for Done<T> {
    fn default() -> Self {
        Done {
            first: None,
            rest: Vec::new(),
        }
    }
}

impl<T> Done<T> {
    fn push(&mut self, item: T) {
        match self.first {
            None => self.first = Some(item),
            Some(_) => self.rest.push(item),
        }
    }
}

impl<T> IntoIterator for Done<T> {
    type Item = T;
    type IntoIter = std::iter::Chain<std::option::IntoIter<T>, std::vec::IntoIter<T>>;

    fn into_iter(self) -> Self::IntoIter {
        self.first.into_iter().chain(self.rest)
    }
}

/// Maximal runs of consecutive page numbers, found lazily.
struct Runs<'a> {
    pages: &'a [u64],
    at: usize,
}

impl Iterator for Runs<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        let start = self.at;
        let first = *self.pages.get(start)?;
        let mut n = 1;
        while let Some(&next) = self.pages.get(start + n) {
            if first.checked_add(n as u64) != Some(next) {
                break;
            }
            n += 1;
        }
        self.at += n;
        Some((start, n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_every_break() {
        let pages = [1, 5, 6, 7, 9, 10, u64::MAX];
        let got: Vec<_> = Runs {
            pages: &pages,
            at: 0,
        }
        .collect();
        assert_eq!(got, vec![(0, 1), (1, 3), (4, 2), (6, 1)]);
        let got: Vec<_> = groups(&pages, Grouping::PerPage).collect();
        assert_eq!(got.len(), pages.len());
    }
}
