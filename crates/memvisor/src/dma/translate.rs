//! IOVA translation: the device hot path.
//!
//! A device model turns each descriptor's IOVA into a host address it can copy to or from.
//! [`DmaSpace::translate`] answers from the current snapshot: for a small mapping (what a
//! vIOMMU makes, up to 127 pages) or a whole 2 MiB granule of a big one (guest RAM) from the
//! snapshot's page table — a few loads indexed by the address's bits, no search — and
//! otherwise from the sorted index (a lookup that reads a few cache lines); neither reads the
//! mapping record. [`DmaSpace::translate_sg`] turns a range that
//! spans mappings into a scatter-gather list; a [`DmaCursor`], one per device thread, remembers
//! the last mapping it hit and the snapshot generation, so a repeated hit costs one load of a
//! counter only writers write and a bounds check — like the memslot cursor (KVM's
//! `last_used_slot`), but with the permission check and dirty marking a device access needs. The cursor's `read` / `write`
//! are `dma_read` / `dma_write` with the same shortcut for copies inside the last mapping hit;
//! plain `translate` keeps a last hit per thread (no snapshot held, so nothing stays mapped),
//! which plain `dma_read` / `dma_write` take as their shortcut too, kept mapped for the copy by
//! the `grace` handshake. Every path checks the access against the mapping's protection (EPERM),
//! fails on unmapped IOVAs (EFAULT) and on invalidated host addresses (EBUSY, after waiting up to
//! [`DmaConfig::vaddr_wait`](super::DmaConfig::vaddr_wait)), and marks written pages dirty when
//! tracking is on.
//!
//! The file is long because the plain path and the cursor share their private parts (`Found`,
//! the page-table answer, the checks) and one set of tests of huge words through every path.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::index::{DmaSnapshot, Hot, Pos, Region, WINDOW, Word, word_answer};
use super::{DmaSpace, Head, Mapping, Prot, VaddrRule, grace};
use crate::addr::{Hva, Iova};
use crate::copy;
use crate::error::{Error, Result};

/// Where an IOVA lives on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Translation {
    /// Host address of the IOVA.
    pub hva: Hva,
    /// Bytes usable from there: the requested length, or less where the mapping ends.
    pub len: u64,
}

/// One host-contiguous piece of a scatter-gather list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Host address.
    pub hva: Hva,
    /// Length in bytes.
    pub len: u64,
}

/// The mapping a thread's last plain `translate` hit: valid while the space (by id) is at the
/// same generation, as every change bumps it.
#[derive(Clone, Copy)]
struct LastHit {
    space: u64,
    generation: u64,
    start: u64,
    last: u64,
    /// hva - iova, wrapping.
    delta: u64,
    /// The accesses a hit may answer (WRITE left out while the mapping logs dirty pages).
    prot: u8,
    /// Whether plain copies may take the hit: not while the space refuses copies
    /// ([`DmaSpace::copies_allowed`]) at that generation.
    copies: bool,
}

impl LastHit {
    /// The translation of `[iova, iova + len)` for `access` if this hit answers it in space
    /// `space` at `generation`. The conditions are joined without short-circuits: the outcome
    /// is one branch, as in the cursor.
    #[inline(always)]
    fn answer(
        self,
        space: u64,
        generation: u64,
        iova: Iova,
        len: u64,
        access: Prot,
    ) -> Option<Translation> {
        let hits = (self.space == space)
            & (self.generation == generation)
            & (iova.0.wrapping_sub(self.start) <= self.last.wrapping_sub(self.start))
            & (self.prot & access.0 == access.0)
            & (len != 0);
        hits.then(|| Translation {
            hva: Hva(iova.0.wrapping_add(self.delta)),
            len: len.min(self.last - iova.0 + 1),
        })
    }
}

thread_local! {
    /// Space id 0 is never given out, so the initial value never hits.
    static LAST_HIT: Cell<LastHit> = const {
        Cell::new(LastHit {
            space: 0,
            generation: 0,
            start: 1,
            last: 0,
            delta: 0,
            prot: 0,
            copies: false,
        })
    };
}

/// Remembers `found` (a mapping with host memory of `snap`, space `space`) as this thread's
/// last hit, for plain copies too if `copies`. WRITE is left out while the mapping logs dirty
/// pages: writes must mark them.
#[inline]
pub(super) fn remember(space: u64, snap: &DmaSnapshot, found: &Found, copies: bool) {
    let mut prot = found.hot.prot().0;
    if found.hot.dirty() {
        prot &= !Prot::WRITE.0;
    }
    LAST_HIT.with(|c| {
        c.set(LastHit {
            space,
            generation: snap.generation,
            start: found.start,
            last: found.last,
            delta: found.hot.delta(),
            prot,
            copies,
        })
    });
}

/// Announces a copy in the space with `head` ([`grace::enter`]) and returns it with the
/// space's generation, loaded after the announcement: a change that this load misses waits for
/// the copy, one it sees is in every snapshot loaded after it (see `grace`). `None` without a
/// slot (a nested copy from a signal handler, a thread being torn down).
#[inline(always)]
fn announce(head: &Head) -> Option<(grace::InFlight, u64)> {
    let copying = grace::enter(head.id)?;
    Some((copying, head.generation.load(Ordering::SeqCst)))
}

/// Runs `copy(host address)` if `[iova, iova + len)` lies whole in this thread's last hit in
/// the space with `head`, that mapping allows `need` (bits) and copies, and the hit is of the
/// space's current generation; returns whether it ran. The copy is announced first
/// ([`grace::enter`]) and the generation checked after, so a change cannot give the memory
/// back before the copy ends: nothing is held once this returns.
#[inline(always)]
pub(super) fn copy_on_last_hit(
    head: &Head,
    iova: u64,
    len: u64,
    need: u8,
    copy: impl FnOnce(u64),
) -> bool {
    let h = LAST_HIT.with(Cell::get);
    // The bounds first, without the announcement: a miss elsewhere costs no atomic.
    let inside = (h.space == head.id)
        & h.copies
        & (len != 0)
        & (iova.wrapping_sub(h.start) <= h.last.wrapping_sub(h.start))
        & (len.wrapping_sub(1) <= h.last.wrapping_sub(iova))
        & (h.prot & need == need);
    if !inside {
        return false;
    }
    let Some((_copying, generation)) = announce(head) else {
        return false;
    };
    if generation != h.generation {
        return false;
    }
    copy(iova.wrapping_add(h.delta));
    true
}

/// A mapping found for an access: where it is in the index and what the access needs.
#[derive(Clone, Copy)]
pub(super) struct Found {
    /// Its place in the sorted index; a placeholder when the page table answered, which it
    /// never does for a mapping that logs dirty pages (the only users of the place).
    pos: Pos,
    /// Where the answer starts: the mapping's start, or the page's (the granule's for a huge
    /// word) when the page table answered; `last` is then the mapping's last byte, or the
    /// granule's.
    start: u64,
    last: u64,
    hot: Hot,
}

impl Found {
    /// Whether `[iova, iova + len)` (`len` > 0, starting in this mapping) lies whole in it and
    /// its memory is the host's.
    pub(super) fn holds_host(&self, iova: u64, len: u64) -> bool {
        self.hot.valid() && self.last - iova >= len - 1
    }
}

impl DmaSnapshot {
    /// The mapping holding `iova`, checked for `access` and a valid host address. Reads the
    /// index only, never the mapping record. Inlined into each translation path: a call
    /// would pass the result through memory.
    #[inline(always)]
    fn resolve(&self, iova: u64, len: u64, need: Prot) -> Result<Found> {
        if let Some((hot, start, last)) = self.page_answer(iova, len, need) {
            return Ok(Found {
                pos: Pos::FIRST,
                start,
                last,
                hot,
            });
        }
        let Some((pos, start, last, hot)) = self.map.lookup(iova) else {
            return Err(unmapped(iova, len));
        };
        checked(pos, start, last, hot, iova, need, Hot::VALID)
    }

    /// The mapping at `pos` (which holds `iova`), checked for `access` and for memory of a
    /// kind in `usable` (Hot bits).
    #[inline]
    fn check(&self, pos: Pos, iova: u64, need: Prot, usable: u64) -> Result<Found> {
        let (start, last, hot) = self.map.bounds(pos);
        checked(pos, start, last, hot, iova, need, usable)
    }

    /// Checks that `[iova, iova + len)` is all mapped, contiguously, for `access`, with memory
    /// of a kind in `usable` (`Hot::VALID`: host memory; `| Hot::REMOTE`: a peer's too); then
    /// calls `piece(iova, host address, bytes)` for each mapping-sized piece in order (the host
    /// address `None` for a peer's memory), marking written pages dirty. Nothing is called if
    /// any check fails. Returns the first mapping (`len` > 0).
    pub(super) fn for_each_piece(
        &self,
        iova: u64,
        len: u64,
        need: Prot,
        min_page: u64,
        usable: u64,
        mut piece: impl FnMut(u64, Option<u64>, u64, &Arc<Mapping>) -> bool,
    ) -> Result<Found> {
        let (first, end) = self.check_span(iova, len, need, usable)?;
        let mut addr = iova;
        let mut pos = Some(first.pos);
        while let Some(p) = pos.filter(|_| addr <= end) {
            let (_, last, hot, m) = self.map.get(p);
            let n = end.min(last) - addr + 1;
            let hva = match hot.valid() {
                true => Some(addr.wrapping_add(hot.delta())),
                false => None,
            };
            // After the copy: a dirty read racing us then reports the page now or next time,
            // never before the bytes landed. A piece `piece` leaves for later (false) is the
            // caller's to mark once it is written.
            if piece(addr, hva, n, m) && need.contains(Prot::WRITE) && hot.dirty() {
                mark_dirty(m, addr, n, min_page);
            }
            addr = addr.wrapping_add(n);
            pos = self.map.next(p);
        }
        Ok(first)
    }
}

impl DmaSnapshot {
    /// Checks that `[iova, iova + len)` (`len` > 0) is all mapped, contiguously, for `need`, with
    /// memory of a kind in `usable`; returns the first mapping and the last byte.
    #[inline]
    fn check_span(&self, iova: u64, len: u64, need: Prot, usable: u64) -> Result<(Found, u64)> {
        let end = iova.checked_add(len - 1).ok_or(Error::RangeWraps {
            what: "dma access",
            start: iova,
            len,
        })?;
        let found = match self.map.lookup(iova) {
            Some((pos, start, last, hot)) => checked(pos, start, last, hot, iova, need, usable)?,
            None => return Err(unmapped(iova, len)),
        };
        let (mut pos, mut last) = (found.pos, found.last);
        while last < end {
            // The next piece must start right after this one; it is at the next position.
            let next = self
                .map
                .next(pos)
                .filter(|&p| self.map.bounds(p).0 == last + 1);
            let Some(next) = next else {
                return Err(Error::Fault {
                    space: "iova",
                    addr: last + 1,
                    start: iova,
                    len,
                });
            };
            Found { pos, last, .. } = self.check(next, last + 1, need, usable)?;
        }
        Ok((found, end))
    }
}

/// `Found` if the mapping allows `need` and its memory is of a kind in `usable` (Hot bits:
/// `VALID` for host memory, `REMOTE` for a peer's).
#[inline(always)]
fn checked(
    pos: Pos,
    start: u64,
    last: u64,
    hot: Hot,
    iova: u64,
    need: Prot,
    usable: u64,
) -> Result<Found> {
    if !hot.prot().contains(need) || !hot.is_any(usable) {
        return Err(refused(iova, start, last, hot, need));
    }
    Ok(Found {
        pos,
        start,
        last,
        hot,
    })
}

/// EFAULT for an access of `len` bytes at `iova`, which is in no mapping.
#[cold]
#[inline(never)]
fn unmapped(iova: u64, len: u64) -> Error {
    Error::Fault {
        space: "iova",
        addr: iova,
        start: iova,
        len,
    }
}

/// Why the mapping `[start, last]` with `hot` refuses `access` at `iova`: EPERM if its protection
/// does not allow it, EFAULT if its memory is a peer's, else EBUSY (host address invalidated).
#[cold]
#[inline(never)]
pub(super) fn refused(iova: u64, start: u64, last: u64, hot: Hot, need: Prot) -> Error {
    if !hot.prot().contains(need) {
        return Error::PermissionDenied {
            access: if need.contains(Prot::WRITE) {
                "write"
            } else {
                "read"
            },
            addr: iova,
            start,
            last,
            allowed: format!("{:?}", hot.prot()),
        };
    }
    if hot.remote() {
        return Error::Remote {
            addr: iova,
            start,
            last,
        };
    }
    Error::Busy {
        addr: iova,
        why: format!(
            "the host address of mapping [{start:#x}, {last:#x}] is invalidated for a live update"
        ),
    }
}

/// Marks the pages of `[iova, iova + n)` dirty in `m`'s bitmap, if it has one.
#[inline]
pub(super) fn mark_dirty(m: &Mapping, iova: u64, n: u64, min_page: u64) {
    if let Some(bitmap) = &m.dirty {
        let base = m.iova.start().0 / min_page;
        let first = iova / min_page - base;
        let last = (iova + (n - 1)) / min_page - base;
        bitmap.mark(first, last - first + 1);
    }
}

impl DmaSpace {
    /// Runs `f` on the current snapshot; while it fails with EBUSY (an invalidated host address)
    /// waits for a vaddr update, up to the configured time, and tries again.
    pub(super) fn with_snapshot<T>(&self, f: impl FnMut(&DmaSnapshot) -> Result<T>) -> Result<T> {
        self.with_snapshot_as(false, f)
    }

    /// [`DmaSpace::with_snapshot`] for a copy: each try runs announced (`grace`), so a change
    /// that takes the memory away returns only after the copy ended, and a copy that starts
    /// after the change sees it. The announcement ends before any wait for a vaddr update,
    /// which is itself a change.
    pub(super) fn with_snapshot_copying<T>(
        &self,
        f: impl FnMut(&DmaSnapshot) -> Result<T>,
    ) -> Result<T> {
        self.with_snapshot_as(true, f)
    }

    fn with_snapshot_as<T>(
        &self,
        announce: bool,
        mut f: impl FnMut(&DmaSnapshot) -> Result<T>,
    ) -> Result<T> {
        let mut deadline = None;
        loop {
            let result = {
                // Without a slot the snapshot alone keeps the memory mapped.
                let _copying = announce
                    .then(|| self::announce(&self.shared.head.0))
                    .flatten();
                f(&self.shared.current.load())
            };
            match result {
                Err(Error::Busy { addr, .. }) if !self.vaddr_wait().is_zero() => {
                    let d = *deadline.get_or_insert_with(|| self.vaddr_deadline());
                    if d.is_some_and(|d| Instant::now() >= d) || !self.wait_for_vaddr(Iova(addr), d)
                    {
                        return result;
                    }
                }
                other => return other,
            }
        }
    }

    /// Translates `iova` for an access of up to `len` bytes; the answer covers the part inside
    /// the first mapping. EINVAL for `len` 0; EFAULT unmapped; EPERM not allowed; EBUSY
    /// invalidated (after waiting). A write marks the pages dirty when tracking is on.
    ///
    /// Each thread remembers the last mapping it translated in (per thread, one space at a
    /// time): a repeated hit checks the space's generation and the bounds, and touches neither
    /// the snapshot nor the index. Nothing is held: like every plain translation, the address
    /// is the caller's to keep valid (a [`DmaCursor`] holds its snapshot instead).
    #[inline]
    pub fn translate(&self, iova: Iova, len: u64, access: Prot) -> Result<Translation> {
        let head = &self.shared.head.0;
        let generation = head.generation.load(Ordering::Acquire);
        match LAST_HIT
            .with(Cell::get)
            .answer(head.id, generation, iova, len, access)
        {
            Some(t) => Ok(t),
            None => self.translate_slow(iova, len, access),
        }
    }

    /// A plain translation the thread's last hit does not answer: one try on the current
    /// snapshot; only an invalidated mapping (EBUSY) takes the waiting loop, which then tries
    /// again from the start.
    #[inline(never)]
    fn translate_slow(&self, iova: Iova, len: u64, access: Prot) -> Result<Translation> {
        {
            let snap = self.shared.current.load();
            match self.translate_at(&snap, iova, len, access) {
                Err(Error::Busy { .. }) => {}
                other => return other,
            }
        }
        // The snapshot's guard (a grace announcement) has ended: the wait below waits for a
        // change, which waits for announcements to end.
        self.translate_waiting(iova, len, access)
    }

    /// [`DmaSpace::translate`] after it found the mapping invalidated: waits for the update.
    #[cold]
    #[inline(never)]
    fn translate_waiting(&self, iova: Iova, len: u64, access: Prot) -> Result<Translation> {
        self.with_snapshot(|snap| self.translate_in(snap, iova, len, access))
    }

    /// [`DmaSpace::translate_at`] after the thread's last hit, for a caller that holds `snap`
    /// (a view): a hit taken in that snapshot's generation answers with no walk. The hit is
    /// checked against the held snapshot's generation, not the space's current one: the
    /// mapping it names is in `snap` whatever the space has done since, and `snap` keeps its
    /// memory. Rings, descriptors and request headers are read this way, many times a request,
    /// nearly always in the mapping read last.
    /// The hit is checked inline in each access; the rest is a call of its own.
    #[cfg(feature = "vm-memory")]
    #[inline(always)]
    pub(super) fn translate_held(
        &self,
        snap: &DmaSnapshot,
        iova: Iova,
        len: u64,
        access: Prot,
    ) -> Result<Translation> {
        let space = self.shared.head.0.id;
        match LAST_HIT
            .with(Cell::get)
            .answer(space, snap.generation, iova, len, access)
        {
            Some(t) => Ok(t),
            None => self.translate_held_walked(snap, iova, len, access),
        }
    }

    /// [`DmaSpace::translate_held`] past the thread's last hit.
    #[cfg(feature = "vm-memory")]
    #[inline(never)]
    fn translate_held_walked(
        &self,
        snap: &DmaSnapshot,
        iova: Iova,
        len: u64,
        access: Prot,
    ) -> Result<Translation> {
        self.translate_at(snap, iova, len, access)
    }

    /// [`DmaSpace::translate`] in `snap`, a snapshot the caller holds (a view's), without
    /// waiting for an invalidated host address: EBUSY at once.
    ///
    /// Most translations end in the page table (a small mapping, or a big one's 2 MiB
    /// granule, that logs no dirty pages) and are answered here with the table's loads alone;
    /// the rest take the general path, in a call of its own, so that its frame and its
    /// `Result`s are not paid by the first kind (they were half its instructions).
    #[inline]
    pub(super) fn translate_at(
        &self,
        snap: &DmaSnapshot,
        iova: Iova,
        len: u64,
        access: Prot,
    ) -> Result<Translation> {
        if let (true, Some((hot, start, last))) = (len != 0, snap.page_answer(iova.0, len, access))
        {
            // A page word never logs dirty pages: nothing to mark, WRITE kept in the hit.
            let found = Found {
                pos: Pos::FIRST,
                start,
                last,
                hot,
            };
            remember(
                self.shared.head.0.id,
                snap,
                &found,
                self.copies_allowed(snap),
            );
            return Ok(Translation {
                hva: Hva(iova.0.wrapping_add(hot.delta())),
                len: len.min(last - iova.0 + 1),
            });
        }
        self.translate_searched(snap, iova, len, access)
    }

    /// [`DmaSpace::translate_at`] past the page table: the sorted index, the checks, the
    /// errors.
    #[inline(never)]
    fn translate_searched(
        &self,
        snap: &DmaSnapshot,
        iova: Iova,
        len: u64,
        access: Prot,
    ) -> Result<Translation> {
        if len == 0 {
            return Err(Error::ZeroSize {
                what: "translation",
            });
        }
        self.translate_in(snap, iova, len, access)
    }

    /// [`DmaSpace::translate`] in `snap`, remembering the hit.
    #[inline(always)]
    fn translate_in(
        &self,
        snap: &DmaSnapshot,
        iova: Iova,
        len: u64,
        access: Prot,
    ) -> Result<Translation> {
        let found = snap.resolve(iova.0, len, access)?;
        let n = len.min(found.last - iova.0 + 1);
        if access == Prot::WRITE && found.hot.dirty() {
            mark_dirty(snap.map.get(found.pos).3, iova.0, n, self.shared.min_page);
        }
        remember(
            self.shared.head.0.id,
            snap,
            &found,
            self.copies_allowed(snap),
        );
        Ok(Translation {
            hva: Hva(iova.0.wrapping_add(found.hot.delta())),
            len: n,
        })
    }

    /// Checks that a device may do `access` on every byte of `[iova, iova + len)`, host memory
    /// or a peer's ([`DmaSpace::map_remote`]): mapped contiguously and allowed. Errors as
    /// [`DmaSpace::translate`]; marks nothing dirty. A device that must refuse a whole request
    /// before it moves a byte checks with this first.
    pub fn check_access(&self, iova: Iova, len: u64, access: Prot) -> Result<()> {
        if len == 0 {
            return Err(Error::ZeroSize {
                what: "access check",
            });
        }
        self.with_snapshot(|snap| {
            snap.check_span(iova.0, len, access, Hot::VALID | Hot::REMOTE)
                .map(|_| ())
        })
    }

    /// Translates `[iova, iova + len)`, which may span mappings, into host segments (adjacent
    /// segments that are contiguous on the host are merged). Fails whole, like `translate`, if
    /// any byte is unmapped, not allowed or invalidated.
    pub fn translate_sg(&self, iova: Iova, len: u64, access: Prot) -> Result<Vec<Segment>> {
        if len == 0 {
            return Err(Error::ZeroSize {
                what: "translation",
            });
        }
        let min_page = self.shared.min_page;
        self.with_snapshot(|snap| {
            let mut segments: Vec<Segment> = Vec::new();
            snap.for_each_piece(iova.0, len, access, min_page, Hot::VALID, |_, hva, n, _| {
                let hva = hva.expect("only host memory passes Hot::VALID");
                match segments.last_mut() {
                    Some(s) if s.hva.0 + s.len == hva => s.len += n,
                    _ => segments.push(Segment {
                        hva: Hva(hva),
                        len: n,
                    }),
                }
                true
            })
            .map(|_| ())?;
            Ok(segments)
        })
    }

    /// A cursor for one device thread's translations.
    pub fn cursor(&self) -> DmaCursor {
        let snapshot = self.shared.current.load_full();
        DmaCursor {
            generation: snapshot.generation,
            copies: self.copies_allowed(&snapshot),
            space: self.clone(),
            snapshot,
            hit: Hit::NONE,
            hit_before: Hit::NONE,
            region: Region::NONE,
        }
    }

    /// Whether CPU copies may run against `snap` at all: not under [`VaddrRule::Refuse`] while
    /// any host address is invalidated (Linux 6.3's container-wide check).
    pub(super) fn copies_allowed(&self, snap: &DmaSnapshot) -> bool {
        snap.invalid == 0 || self.shared.config.vaddr_rule != VaddrRule::Refuse
    }
}

/// The last mapping a cursor hit, packed for the hit check.
#[derive(Clone, Copy)]
struct Hit {
    start: u64,
    last: u64,
    /// hva - iova, wrapping.
    delta: u64,
    /// The mapping's protection bits, plus [`Hit::DIRTY`] while it logs dirty pages: one byte,
    /// so a miss answered by the page table stores four fields.
    prot: u8,
    /// Its place in the sorted index; read only while [`Hit::DIRTY`] is set.
    pos: Pos,
}

impl Hit {
    /// In `prot`: the mapping logs dirty pages. Above the protection bits, so no access's
    /// check (`prot & need`) sees it.
    const DIRTY: u8 = 0x80;

    /// No mapping: no protection, so every access misses (the range check alone would not, as
    /// `last - start` wraps).
    const NONE: Hit = Hit {
        start: 1,
        last: 0,
        delta: 0,
        prot: 0,
        pos: Pos::FIRST,
    };

    /// Whether the mapping logs dirty pages.
    #[inline(always)]
    fn dirty(&self) -> bool {
        self.prot & Hit::DIRTY != 0
    }
}

/// One device thread's translator, remembering the last mapping it hit.
///
/// Holds the snapshot it last used (and so the memory of mappings removed since) until its next
/// translation; [`DmaCursor::refresh`] lets go sooner.
pub struct DmaCursor {
    pub(super) space: DmaSpace,
    pub(super) snapshot: Arc<DmaSnapshot>,
    generation: u64,
    /// Whether `read` / `write` may copy from the snapshot ([`DmaSpace::copies_allowed`]).
    copies: bool,
    hit: Hit,
    /// The hit before `hit`, which a request's walk asks too ([`DmaCursor::hit_answer`]).
    hit_before: Hit,
    /// The page table's part over the 8 GiB region of the last miss, from `snapshot`: a miss
    /// in it walks two levels, not four.
    region: Region,
}

impl std::fmt::Debug for DmaCursor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DmaCursor")
            .field("generation", &self.generation)
            .field(
                "last_hit",
                &format_args!("[{:#x}, {:#x}]", self.hit.start, self.hit.last),
            )
            .finish()
    }
}

impl DmaCursor {
    /// [`DmaSpace::translate`], with a cache of the last mapping hit.
    ///
    /// Always inlined: the hit is a dozen instructions, and as an ordinary call it costs twice
    /// that (a caller with two call sites got the call; figures: `docs/measurements.md`, "DMA
    /// cursor").
    #[inline(always)]
    pub fn translate(&mut self, iova: Iova, len: u64, access: Prot) -> Result<Translation> {
        let h = &self.hit;
        // One compare for the range (`iova - start` wraps above `last - start` when below),
        // and the conditions joined without short-circuits: the outcome is one branch, which
        // a miss-heavy stream predicts well, rather than a chain of coin tosses.
        let current =
            self.space.shared.head.0.generation.load(Ordering::Acquire) == self.generation;
        if current
            & (iova.0.wrapping_sub(h.start) <= h.last.wrapping_sub(h.start))
            & (h.prot & access.0 == access.0)
            & (len != 0)
        {
            let n = len.min(h.last - iova.0 + 1);
            if h.dirty() && access == Prot::WRITE {
                let m = self.snapshot.map.get(h.pos).3;
                mark_dirty(m, iova.0, n, self.space.shared.min_page);
            }
            return Ok(Translation {
                hva: Hva(iova.0.wrapping_add(h.delta)),
                len: n,
            });
        }
        self.miss(iova, len, access)
    }

    /// A translation the last hit does not answer. The generation is read again rather than
    /// passed in: keeping the hit test's in a register costs the hit an instruction.
    #[inline]
    fn miss(&mut self, iova: Iova, len: u64, access: Prot) -> Result<Translation> {
        let current =
            self.space.shared.head.0.generation.load(Ordering::Acquire) == self.generation;
        // A miss at the current generation in a page the page table answers (a small mapping
        // that logs no dirty pages): inlined where the compiler sees fit, so it costs the
        // table's loads and no call.
        if current & (len != 0) {
            if let Some((hot, start, last)) =
                word_answer(iova.0, len, self.table_word(iova.0), access)
            {
                // Not `pos`: it is read only while DIRTY is set, and the table never answers
                // for a mapping that logs dirty pages.
                self.hit.start = start;
                self.hit.last = last;
                self.hit.delta = hot.delta();
                self.hit.prot = hot.prot().0;
                return Ok(Translation {
                    hva: Hva(iova.0.wrapping_add(hot.delta())),
                    len: len.min(last - iova.0 + 1),
                });
            }
        }
        self.translate_slow(iova, len, access)
    }

    /// Makes `found`, a mapping of the cursor's snapshot with a host address, the last hit;
    /// the last one becomes the one before.
    #[inline(always)]
    pub(super) fn remember(&mut self, found: &Found) {
        self.hit_before = self.hit;
        self.hit = Hit {
            start: found.start,
            last: found.last,
            delta: found.hot.delta(),
            prot: found.hot.prot().0 | if found.hot.dirty() { Hit::DIRTY } else { 0 },
            pos: found.pos,
        };
    }

    /// The host address of `[iova, iova + len)` if it lies whole in the last hit or the one
    /// before, which allows `need` (not empty) and logs no dirty pages; for a caller that has
    /// refreshed the cursor. Length 0 and a wrapping range never answer. Two, because a block
    /// request's header and status byte lie in one mapping (the driver's request memory) and
    /// its data in another (the buffer's).
    #[inline(always)]
    pub(super) fn hit_answer(&self, iova: u64, len: u64, need: Prot) -> Option<u64> {
        let answers = |h: &Hit| {
            (iova.wrapping_sub(h.start) <= h.last.wrapping_sub(h.start))
                & (len.wrapping_sub(1) <= h.last.wrapping_sub(iova))
                & (h.prot & need.0 == need.0)
                & (need != Prot::default())
                & (h.prot & Hit::DIRTY == 0)
        };
        if answers(&self.hit) {
            return Some(iova.wrapping_add(self.hit.delta));
        }
        answers(&self.hit_before).then(|| iova.wrapping_add(self.hit_before.delta))
    }

    /// The page-table word for `iova` in the cursor's snapshot, through the cursor's region
    /// (two levels), which becomes `iova`'s if it did not hold it.
    #[inline(always)]
    pub(super) fn table_word(&mut self, iova: u64) -> Word {
        if self.region.holds(iova) {
            self.region.word(iova)
        } else {
            self.enter_region(iova)
        }
    }

    /// The page-table word for `iova`, which the cursor's region does not hold: the region
    /// becomes `iova`'s (one reference count), if the table covers it.
    fn enter_region(&mut self, iova: u64) -> Word {
        if iova >= WINDOW {
            return Word {
                bits: 0,
                huge: false,
            };
        }
        self.region = self.snapshot.map.pages.region(iova);
        self.region.word(iova)
    }

    fn translate_slow(&mut self, iova: Iova, len: u64, access: Prot) -> Result<Translation> {
        if len == 0 {
            return Err(Error::ZeroSize {
                what: "translation",
            });
        }
        self.refresh();
        let found = match self.snapshot.resolve(iova.0, len, access) {
            Ok(found) => found,
            // Invalidated: take the space's path, which waits for the update.
            Err(Error::Busy { .. }) => return self.space.translate(iova, len, access),
            Err(e) => return Err(e),
        };
        self.remember(&found);
        let n = len.min(found.last - iova.0 + 1);
        if access == Prot::WRITE && found.hot.dirty() {
            let m = self.snapshot.map.get(found.pos).3;
            mark_dirty(m, iova.0, n, self.space.shared.min_page);
        }
        Ok(Translation {
            hva: Hva(iova.0.wrapping_add(self.hit.delta)),
            len: n,
        })
    }

    /// Moves to the space's current snapshot if it changed, letting go of the old one.
    #[inline]
    pub fn refresh(&mut self) {
        if self.space.shared.head.0.generation.load(Ordering::Acquire) != self.generation {
            self.reload();
        }
    }

    #[cold]
    #[inline(never)]
    fn reload(&mut self) {
        self.snapshot = self.space.shared.current.load_full();
        self.generation = self.snapshot.generation;
        self.copies = self.space.copies_allowed(&self.snapshot);
        self.hit = Hit::NONE;
        self.hit_before = Hit::NONE;
        self.region = Region::NONE;
    }

    /// [`DmaSpace::dma_read`] through the cursor: a copy that lies inside the last mapping hit
    /// announces itself (`grace`), checks the generation and the bounds and copies, with no
    /// snapshot load and no lookup; a change that takes the memory away returns only after
    /// the copy ended. Anything else takes `dma_read`'s path, with its errors, and remembers
    /// the mapping.
    #[inline]
    pub fn read(&mut self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        if self.copy_hits(iova.0, buf.len() as u64, Prot::READ.0) {
            if let Some(_copying) = self.announce() {
                let hva = iova.0.wrapping_add(self.hit.delta);
                // SAFETY: the whole range lies in the mapping last hit, which is of the current
                // generation (checked after the announcement, so no change can take it away
                // until the copy ends) and allows READ with a valid host address. buf is
                // caller memory, never guest memory.
                unsafe { copy::from_guest(hva as usize as *const u8, buf) };
                return Ok(());
            }
        }
        self.read_slow(iova, buf)
    }

    /// [`DmaSpace::dma_write`] through the cursor, as [`DmaCursor::read`]; marks the pages
    /// dirty when tracking is on.
    #[inline]
    pub fn write(&mut self, iova: Iova, buf: &[u8]) -> Result<()> {
        if self.copy_hits(iova.0, buf.len() as u64, Prot::RW.0) {
            if let Some(_copying) = self.announce() {
                let hva = iova.0.wrapping_add(self.hit.delta);
                // SAFETY: as in read; the mapping allows READ and WRITE.
                unsafe { copy::to_guest(buf, hva as usize as *mut u8) };
                if self.hit.dirty() {
                    let m = self.snapshot.map.get(self.hit.pos).3;
                    mark_dirty(m, iova.0, buf.len() as u64, self.space.shared.min_page);
                }
                return Ok(());
            }
        }
        self.write_slow(iova, buf)
    }

    /// Announces a copy on the cursor's hit and checks, after it, that the hit is still of
    /// the current generation (`grace`); `None` sends the copy down the slow path.
    #[inline(always)]
    fn announce(&self) -> Option<grace::InFlight> {
        let (copying, generation) = announce(&self.space.shared.head.0)?;
        (generation == self.generation).then_some(copying)
    }

    /// Whether `[iova, iova + len)` lies inside the last mapping hit, at the current
    /// generation, with `need` allowed and copies allowed; no short-circuits, one branch.
    #[inline(always)]
    fn copy_hits(&self, iova: u64, len: u64, need: u8) -> bool {
        let h = &self.hit;
        let current =
            self.space.shared.head.0.generation.load(Ordering::Acquire) == self.generation;
        current
            & self.copies
            & (len != 0)
            & (iova.wrapping_sub(h.start) <= h.last.wrapping_sub(h.start))
            & (len.wrapping_sub(1) <= h.last.wrapping_sub(iova))
            & (h.prot & need == need)
    }

    #[inline(never)]
    fn read_slow(&mut self, iova: Iova, buf: &mut [u8]) -> Result<()> {
        self.space.dma_read(iova, buf)?;
        let _ = self.translate(iova, 1, Prot::READ);
        Ok(())
    }

    #[inline(never)]
    fn write_slow(&mut self, iova: Iova, buf: &[u8]) -> Result<()> {
        self.space.dma_write(iova, buf)?;
        // A read translation: it remembers the mapping without marking a page twice.
        let _ = self.translate(iova, 1, Prot::READ);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Big mappings answered from the page table's huge words: every path gives what the
    //! sorted index gives, at the granules' and the mapping's edges, and never while the
    //! mapping logs dirty pages.
    use super::*;
    use crate::addr::PAGE_4K as PAGE;
    use crate::backing::{Backing, BackingKind};
    use crate::dma::{DmaConfig, SgBuf, SgWalk};

    const MIB: u64 = 1 << 20;

    /// A space with one big mapping, `[2 MiB - 4 KiB, 9 MiB - 4 KiB)`: three whole granules
    /// and a part of one at each end. Returns it, its backing, and its host address of the
    /// mapping's start (from the sorted index: the start is in a part granule).
    fn space() -> (DmaSpace, Arc<Backing>, u64) {
        let backing = Arc::new(Backing::new(BackingKind::PrivateAnon, 8 * MIB).unwrap());
        let d = DmaSpace::new(DmaConfig::default()).unwrap();
        d.map_backing(Iova(START), &backing, PAGE, LEN, Prot::RW)
            .unwrap();
        let base = d.translate(Iova(START), 1, Prot::READ).unwrap().hva.0;
        (d, backing, base)
    }

    const START: u64 = 2 * MIB - PAGE;
    const LEN: u64 = 7 * MIB;

    fn huge_at(d: &DmaSpace, iova: u64) -> bool {
        d.shared.current.load().map.pages.word(iova).huge
    }

    /// Checks every path at addresses around the edges, for lengths up to past the end.
    fn agree(d: &DmaSpace, base: u64, access: Prot) {
        let end = START + LEN;
        let mut cursor = d.cursor();
        let edges = [START, 2 * MIB, 4 * MIB, 6 * MIB, 8 * MIB, end];
        let iovas = edges
            .iter()
            .flat_map(|&e| [e.wrapping_sub(64), e - 1, e, e + 8])
            .filter(|&a| (START..end).contains(&a));
        for iova in iovas {
            for len in [1, 64, PAGE, 2 * MIB, LEN] {
                let want = Translation {
                    hva: Hva(base + (iova - START)),
                    len: len.min(end - iova),
                };
                let what = format!("iova {iova:#x}, len {len:#x}");
                assert_eq!(
                    d.translate(Iova(iova), len, access).unwrap(),
                    want,
                    "{what}"
                );
                assert_eq!(
                    cursor.translate(Iova(iova), len, access).unwrap(),
                    want,
                    "{what}"
                );
                let segs = d.translate_sg(Iova(iova), want.len, access).unwrap();
                let one = [Segment {
                    hva: want.hva,
                    len: want.len,
                }];
                assert_eq!(segs, one, "translate_sg: {what}");
                let buf = SgBuf {
                    iova: Iova(iova),
                    len: want.len,
                    prot: access,
                };
                match d.hold_sg(&[buf]).unwrap() {
                    SgWalk::Held(g) => assert_eq!(g.segments(), one, "hold_sg: {what}"),
                    SgWalk::Missed(m) => panic!("hold_sg missed {m:?}: {what}"),
                }
            }
        }
        assert!(d.translate(Iova(end), 1, access).is_err(), "past the end");
    }

    #[test]
    fn a_big_mapping_answers_from_huge_words_as_from_the_sorted_index() {
        let (d, _b, base) = space();
        for g in [2, 4, 6] {
            assert!(huge_at(&d, g * MIB), "granule at {g} MiB holds a huge word");
        }
        assert!(
            !huge_at(&d, START) && !huge_at(&d, 8 * MIB),
            "part granules hold none"
        );
        agree(&d, base, Prot::READ);
        agree(&d, base, Prot::WRITE);
    }

    /// The page table answers whenever it holds words (a big mapping's whole granules; small
    /// mappings once there are `page_table_from` of them), and a space whose table holds none
    /// is not asked (the sorted index answers, as it must).
    #[test]
    fn the_page_table_is_asked_whenever_it_holds_words() {
        let asked = |d: &DmaSpace, iova: u64| {
            let snap = d.shared.current.load();
            snap.page_answer(iova, 64, Prot::READ).is_some()
        };
        let (d, _b, _) = space();
        assert!(asked(&d, 4 * MIB), "a big mapping's whole granule");
        assert!(!asked(&d, START), "a part granule holds no word");
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * PAGE).unwrap());
        let d = DmaSpace::new(DmaConfig {
            page_table_from: 4,
            ..DmaConfig::default()
        })
        .unwrap();
        for k in 0..4u64 {
            d.map_backing(Iova(k * 2 * PAGE), &b, k * PAGE, PAGE, Prot::RW)
                .unwrap();
            assert_eq!(asked(&d, 0), k == 3, "after {} small mappings", k + 1);
            assert!(d.translate(Iova(0), 64, Prot::READ).is_ok());
        }
    }

    #[test]
    fn no_huge_word_answers_while_the_mapping_logs_dirty_pages() {
        let (d, _b, base) = space();
        d.start_dirty_tracking().unwrap();
        assert!(
            !huge_at(&d, 4 * MIB),
            "dirty logging takes the huge words out"
        );
        agree(&d, base, Prot::WRITE);
        // Every page `agree` wrote through is dirty, those in whole granules too.
        let bits = d.get_and_clear_dirty(Iova(START), LEN, PAGE).unwrap();
        let dirty = |iova: u64| {
            let page = (iova - START) / PAGE;
            bits[(page / 64) as usize] >> (page % 64) & 1 == 1
        };
        assert!(dirty(4 * MIB) && dirty(4 * MIB - PAGE) && dirty(6 * MIB + PAGE));
        d.stop_dirty_tracking();
        assert!(huge_at(&d, 4 * MIB), "back once the log stops");
        agree(&d, base, Prot::READ);
    }
}
