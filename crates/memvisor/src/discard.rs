//! Free page reporting, host side: give reported guest memory back to the host, around pins.
//!
//! A guest's balloon driver (Linux's `virtio_balloon` with `mm/page_reporting`) reports blocks of
//! memory it has freed — up to 32 per report, 2 MiB or larger by default — and waits until the
//! device acknowledges before it reuses them. [`Discarder::report`] is that acknowledgement's
//! work: for every reported range it finds the slots that hold it, drops the host memory behind
//! it, and says in a [`ReportOutcome`] how many bytes it discarded, how many it skipped because
//! they are pinned, and which bytes it refused and why. Nothing is ever an error: a report is
//! advice, and whatever is refused simply stays resident.
//!
//! **What is discarded, and how.** Touching ranges of one report (one ending where the next
//! starts, as neighbouring free blocks often are) are joined first. A range is cut at slot
//! boundaries; bytes in no slot are
//! refused ([`RejectReason::OutsideGuestMemory`]), as are zero-length and wrapping ranges. Each
//! piece is shrunk inward to whole pages of its backing's page size, in host addresses — a
//! partial page is never discarded, and its bytes are refused as [`RejectReason::PartialPage`].
//! For hugetlbfs that means a huge page goes only when one report covers all of it (in one range
//! or in touching ones). Then, by
//! backing kind:
//!
//! | kind | discard | effect |
//! |---|---|---|
//! | private anonymous, THP | `madvise(MADV_DONTNEED)` (`MADV_FREE` with [`DiscardOptions::use_madv_free`]) | pages freed now (lazily with `MADV_FREE`); the next touch maps a zero page |
//! | shared anonymous | `madvise(MADV_REMOVE)` | the shmem pages behind it are freed |
//! | memfd, hugetlbfs, received descriptor | `fallocate(PUNCH_HOLE \| KEEP_SIZE)` at the file offset | the file's pages are freed, in every mapping of it |
//! | shared file | `fallocate(PUNCH_HOLE \| KEEP_SIZE)` | **the file itself changes**: the range reads as zeros for every user |
//! | private file | refused ([`RejectReason::PrivateFileMapping`]) | punching would change the file for every user of it, and `MADV_DONTNEED` would bring back the file's old bytes, not zeros |
//! | read-only slot | refused ([`RejectReason::ReadOnlySlot`]) | ROM-like memory: the guest cannot have freed it |
//!
//! **Pinned pages are never discarded.** A pin promises that the page stays resident and keeps
//! its content; a device may be doing DMA into it right now. Memory is discarded in chunks of
//! 2 MiB of 4 KiB pages or 64 MiB of huge pages (about the same kernel time, a fraction of a
//! millisecond); for each chunk, the check against the [`PinRegistry`]'s counts and
//! the discard system calls happen under the registry's lock, the one every pin and unpin takes.
//! So a pin that races a report either lands first — its pages are counted, and skipped — or
//! after: the page is gone, and the pin's `mlock` faults a zero-filled page back in before
//! anyone uses it. Locks the registry keeps cached after their pins went are unlocked in the
//! chunk first, under the same lock, so only pinned pages are skipped. Pinned pages are skipped page by page; a huge page with any pinned 4 KiB page
//! in it is skipped whole. Skipped bytes are reported as [`ReportOutcome::skipped_pinned`].
//! Pins are known by host address, so only pins made through this registry (the process's
//! [`PinRegistry::global`] unless [`DiscardOptions::registry`] names another) are seen: memory
//! pinned some other way — another process mapping the same memfd, a second mapping of the same
//! file — is not protected.
//!
//! **Pages an engine pinned on its own** — an io_uring's registered buffers, which the
//! kernel keeps pinned outside the registry's counts — are asked for first: each
//! [`DiscardGate`](crate::pin::DiscardGate) registered with the registry takes the chunk out of
//! its tables before the discard (waiting a bounded time for its thread), and what it cannot
//! give up (I/O in flight) or still holds is skipped like a pinned page.
//!
//! **How other VMMs do it.** QEMU turns ballooning (and free page reporting) off entirely as soon
//! as a VFIO device is attached, so a guest with one passthrough device never gives memory back.
//! Firecracker and Cloud Hypervisor discard whatever is reported without looking at pins: if the
//! guest reports a page a device still holds — a bug, a malicious guest, a device with a stale
//! mapping — the device's DMA goes to a page the host has since reused or zeroed. memvisor
//! discards everything that is reported except what is pinned.
//!
//! **No accumulation across reports.** A huge page reported in parts over several reports is
//! never discarded. The guest reuses a block as soon as its report is acknowledged, so the half
//! remembered from an earlier report may hold live data by the time the other half arrives;
//! discarding it then would zero guest memory in use. Remembering parts is only safe together
//! with a proof that nothing wrote them since (soft-dirty bits in `/proc/self/pagemap` or a
//! dirty log covering every writer, guest and devices) — memvisor has no such proof for guest
//! writes (KVM's dirty log lives in the VMM), so it does not accumulate. Linux reports blocks of
//! `pageblock_order` (2 MiB) or larger, so 2 MiB huge pages are covered by single reports; 1 GiB
//! huge pages are in practice never discarded.
//!
//! **Dirty logging.** In a slot with [`SlotFlags::LOG_DIRTY`](crate::SlotFlags::LOG_DIRTY),
//! discarded pages are marked dirty after the discard, so a migration resends them — as the zero
//! pages they now are — instead of leaving the old content on the destination.
//!
//! **Page poisoning.** A guest that negotiated a non-zero poison value
//! ([`Discarder::set_page_poison`]) expects free pages to hold that value, and a discarded page
//! comes back as zeros; then nothing is discarded and every range is refused with
//! [`RejectReason::PagePoison`].
//!
//! A report works on one snapshot of the slot table, which keeps every backing it names mapped
//! until the report is done.

use std::fmt;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::addr::{Gpa, PAGE_4K as PAGE, PageSize};
use crate::backing::{Backing, BackingKind};
use crate::pin::{PinRegistry, subtract_kept};
use crate::slots::{Slot, SlotFlags, SlotId, SlotTable};

/// Memory discarded per hold of the pin registry's lock, so a pin waits at most about that long:
/// 2 MiB of 4 KiB pages (a fraction of a millisecond of `MADV_DONTNEED`; figures:
/// `docs/measurements.md`, "Discard")...
const CHUNK: u64 = PageSize::Size2M.bytes();
/// ...and 64 MiB of huge pages (THP or hugetlbfs), which the kernel frees 512 times fewer of for
/// the same bytes (about as long for THP) — at least one huge page. One system call per chunk.
const HUGE_CHUNK: u64 = 64 << 20;
/// How long a discard waits for an engine's thread to give a chunk up
/// ([`crate::pin::DiscardGate::evict`]); a chunk not given up in time is skipped (a discard is
/// a hint).
const EVICT_WAIT: std::time::Duration = std::time::Duration::from_millis(10);

/// How a [`Discarder`] works.
#[derive(Clone, Debug, Default)]
pub struct DiscardOptions {
    /// The registry whose pins are respected; `None` is [`PinRegistry::global`], which every
    /// [`DmaSpace`](crate::DmaSpace) uses unless told otherwise.
    pub registry: Option<Arc<PinRegistry>>,
    /// Discard private anonymous and THP memory with `MADV_FREE` instead of `MADV_DONTNEED`: the
    /// kernel frees the pages only under memory pressure, and a page the guest touches again
    /// before that costs no fault and no zeroing (it keeps its old bytes, which the guest
    /// treats as garbage anyway). Resident memory falls only when the kernel reclaims.
    pub use_madv_free: bool,
}

/// Why bytes of a report were not discarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RejectReason {
    /// The range has no bytes.
    Empty,
    /// The range passes the top of the 64-bit address space.
    Wraps,
    /// No slot holds these bytes.
    OutsideGuestMemory,
    /// Part of a page of this size: only whole pages are discarded.
    PartialPage {
        /// The page size of the slot's memory.
        page_size: PageSize,
    },
    /// The slot is read-only: the guest cannot have freed its memory.
    ReadOnlySlot {
        /// The read-only slot.
        slot: SlotId,
    },
    /// The slot is a private file mapping: punching would change the file for every user.
    PrivateFileMapping {
        /// The slot over a private file mapping.
        slot: SlotId,
    },
    /// The guest poisons free pages with this value, and a discarded page would read as zeros.
    PagePoison {
        /// The poison value the driver announced.
        value: u32,
    },
    /// The discard system call failed with this errno.
    Failed {
        /// The call that failed (`fallocate`, `madvise`).
        op: &'static str,
        /// The errno it returned.
        errno: i32,
    },
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RejectReason::Empty => f.write_str("zero-length range"),
            RejectReason::Wraps => f.write_str("range wraps past the top of the address space"),
            RejectReason::OutsideGuestMemory => f.write_str("outside guest memory"),
            RejectReason::PartialPage { page_size } => {
                write!(
                    f,
                    "partial page: only whole {page_size} pages are discarded"
                )
            }
            RejectReason::ReadOnlySlot { slot } => {
                write!(
                    f,
                    "slot {slot} is read-only: the guest cannot have freed it"
                )
            }
            RejectReason::PrivateFileMapping { slot } => write!(
                f,
                "slot {slot} is a private file mapping: punching would change the file for \
                 every user"
            ),
            RejectReason::PagePoison { value } => write!(
                f,
                "the guest poisons free pages with {value:#x}; discarded pages would read as zeros"
            ),
            RejectReason::Failed { op, errno } => write!(
                f,
                "{op} failed: {}",
                std::io::Error::from_raw_os_error(*errno)
            ),
        }
    }
}

/// Bytes of a report that were not discarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejected {
    /// First guest address.
    pub gpa: Gpa,
    /// Bytes.
    pub len: u64,
    /// Why.
    pub reason: RejectReason,
}

/// What one report did. For every range, its bytes are discarded, skipped or rejected: the
/// three add up to the reported length.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReportOutcome {
    /// Bytes given back to the host.
    pub discarded: u64,
    /// Bytes left alone because a pin holds them (whole huge pages where any part is pinned).
    pub skipped_pinned: u64,
    /// Bytes refused, each piece with its reason, in report order; touching pieces with the
    /// same reason are merged.
    pub rejected: Vec<Rejected>,
}

impl ReportOutcome {
    /// Total bytes refused.
    pub fn rejected_bytes(&self) -> u64 {
        // Ranges of different reports may overlap, so the total can pass 2^64: it saturates.
        self.rejected
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.len))
    }

    fn reject(&mut self, gpa: u64, len: u64, reason: RejectReason) {
        if let Some(last) = self.rejected.last_mut() {
            let joined = last.len.checked_add(len);
            if last.reason == reason && last.gpa.0.checked_add(last.len) == Some(gpa) {
                // The joined piece must end inside the address space; an empty one always does.
                let fits = |&j: &u64| {
                    j.checked_sub(1)
                        .is_none_or(|n| last.gpa.0.checked_add(n).is_some())
                };
                if let Some(joined) = joined.filter(fits) {
                    last.len = joined;
                    return;
                }
            }
        }
        self.rejected.push(Rejected {
            gpa: Gpa(gpa),
            len,
            reason,
        });
    }
}

/// Discards reported guest memory, never touching pinned pages; see the module documentation.
#[derive(Debug)]
pub struct Discarder {
    slots: SlotTable,
    registry: Arc<PinRegistry>,
    use_madv_free: bool,
    poison: AtomicU32,
}

impl Discarder {
    /// A discarder over `slots` that respects the pins of [`PinRegistry::global`].
    pub fn new(slots: &SlotTable) -> Self {
        Self::with_options(slots, DiscardOptions::default())
    }

    /// A discarder over `slots` working as `options` say.
    pub fn with_options(slots: &SlotTable, options: DiscardOptions) -> Self {
        Discarder {
            slots: slots.clone(),
            registry: options.registry.unwrap_or_else(PinRegistry::global),
            use_madv_free: options.use_madv_free,
            poison: AtomicU32::new(0),
        }
    }

    /// Records the page poison value the guest negotiated (virtio-balloon's `poison_val` with
    /// `VIRTIO_BALLOON_F_PAGE_POISON`); 0 means none. While it is non-zero, reports discard
    /// nothing.
    pub fn set_page_poison(&self, value: u32) {
        self.poison.store(value, Ordering::Relaxed);
    }

    /// The page poison value in force (0: none).
    pub fn page_poison(&self) -> u32 {
        self.poison.load(Ordering::Relaxed)
    }

    /// Discards the host memory behind the guest ranges `(start, bytes)`, except pinned pages,
    /// partial pages and memory that may not be discarded; see the module documentation.
    pub fn report(&self, ranges: &[(Gpa, u64)]) -> ReportOutcome {
        let mut out = ReportOutcome::default();
        let poison = self.page_poison();
        let snapshot = self.slots.snapshot();
        for (gpa, len) in coalesce(ranges) {
            if len == 0 {
                out.reject(gpa.0, 0, RejectReason::Empty);
                continue;
            }
            let Some(last) = gpa.0.checked_add(len - 1) else {
                out.reject(gpa.0, len, RejectReason::Wraps);
                continue;
            };
            if poison != 0 {
                out.reject(gpa.0, len, RejectReason::PagePoison { value: poison });
                continue;
            }
            // `at` is the next byte not yet accounted for; None once the top was reached.
            let mut at = Some(gpa.0);
            for slot in snapshot.overlapping(gpa, Gpa(last)) {
                let Some(from) = at else { break };
                let (s_first, s_last) = (slot.range().start().0, slot.range().last().0);
                if from < s_first {
                    out.reject(from, s_first - from, RejectReason::OutsideGuestMemory);
                }
                let first = from.max(s_first);
                let piece_last = last.min(s_last);
                self.piece(&mut out, slot, first, piece_last);
                at = piece_last.checked_add(1);
            }
            if let Some(from) = at.filter(|&f| f <= last) {
                out.reject(from, last - from + 1, RejectReason::OutsideGuestMemory);
            }
        }
        out
    }

    /// Handles the bytes `[first, last]` of one slot.
    fn piece(&self, out: &mut ReportOutcome, slot: &Slot, first: u64, last: u64) {
        let len = last - first + 1;
        let backing = slot.backing();
        let method = match backing.kind() {
            _ if slot.flags().contains(SlotFlags::READ_ONLY) => {
                return out.reject(first, len, RejectReason::ReadOnlySlot { slot: slot.id() });
            }
            BackingKind::File { shared: false, .. } => {
                return out.reject(
                    first,
                    len,
                    RejectReason::PrivateFileMapping { slot: slot.id() },
                );
            }
            BackingKind::PrivateAnon | BackingKind::Thp if self.use_madv_free => Method::Free,
            BackingKind::PrivateAnon | BackingKind::Thp => Method::DontNeed,
            BackingKind::SharedAnon => Method::Remove,
            // An adopted mapping, by what its caller said of it: a private file mapping as
            // above; private anonymous like PrivateAnon (hugetlbfs pages can only be dropped);
            // shared memory by its descriptor if given, else MADV_REMOVE as for SharedAnon.
            BackingKind::Adopted { shared: false, .. } if backing.fd().is_some() => {
                return out.reject(
                    first,
                    len,
                    RejectReason::PrivateFileMapping { slot: slot.id() },
                );
            }
            BackingKind::Adopted {
                shared: false,
                page_size,
            } => match page_size {
                PageSize::Size4K if self.use_madv_free => Method::Free,
                _ => Method::DontNeed,
            },
            BackingKind::Adopted { shared: true, .. } if backing.fd().is_none() => Method::Remove,
            BackingKind::Adopted { shared: true, .. } => Method::PunchHole,
            BackingKind::Memfd
            | BackingKind::Hugetlb(_)
            | BackingKind::File { .. }
            | BackingKind::Received { .. } => Method::PunchHole,
        };
        let page_size = backing.page_size();
        let page = page_size.bytes();
        // The unit pins lock: a pinned 4 KiB page keeps its whole huge page.
        let unit = backing
            .huge_page_size()
            .map_or(page, |p| p.bytes())
            .max(page);
        // Host addresses of the piece, [start, end); aligned inward to whole pages.
        let start = slot.hva().0 + (first - slot.range().start().0);
        let end = start + len;
        let a_start = start.next_multiple_of(page);
        let a_end = end / page * page;
        let gpa_of = |hva: u64| first + (hva - start);
        if a_start >= a_end {
            return out.reject(first, len, RejectReason::PartialPage { page_size });
        }
        if a_start > start {
            out.reject(
                first,
                a_start - start,
                RejectReason::PartialPage { page_size },
            );
        }
        let chunk = if unit > PAGE {
            HUGE_CHUNK.max(unit)
        } else {
            CHUNK
        };
        let mut done: Vec<(u64, u64, Option<i32>)> = Vec::new();
        let mut at = a_start;
        while at < a_end {
            let chunk_end = a_end.min((at / chunk + 1) * chunk);
            done.clear();
            // Pins lock huge pages (THP too) whole: look at the whole units the chunk
            // touches, and keep every unit holding a pin, even where the report covers
            // only part of it.
            let (w0, w1) = (at / unit * unit, chunk_end.div_ceil(unit) * unit);
            // Engines pinning memory on their own (io_uring fixed buffers) give the chunk up
            // first; what they cannot (I/O in flight, no answer in time) or still hold while
            // the registry is locked stays.
            let gates = self.registry.discard_gates();
            let busy: Vec<(u64, u64)> = gates
                .iter()
                .flat_map(|g| g.evict(w0, w1 - w0, EVICT_WAIT))
                .collect();
            self.registry.with_unheld_in(w0, w1, |free| {
                let gated;
                let free = if gates.is_empty() {
                    free
                } else {
                    let kept: Vec<(u64, u64)> = gates
                        .iter()
                        .flat_map(|g| g.pinned_runs(w0, w1))
                        .chain(busy.iter().copied())
                        .collect();
                    gated = subtract_kept(free, &kept);
                    &gated[..]
                };
                for &(s, e) in free {
                    let (mut s, mut e) = (s * PAGE, e * PAGE);
                    if s > w0 {
                        s = s.next_multiple_of(unit);
                    }
                    if e < w1 {
                        e = e / unit * unit;
                    }
                    // Whole pages of the backing inside the report.
                    let (s, e) = (
                        s.max(at).next_multiple_of(page),
                        e.min(chunk_end) / page * page,
                    );
                    if s < e {
                        done.push((s, e, method.apply(backing, s, e).err()));
                    }
                }
            });
            for g in &gates {
                g.reopen(w0, w1 - w0);
            }
            let mut gone = 0;
            for &(s, e, err) in &done {
                match err {
                    None => {
                        gone += e - s;
                        self.mark_dirty(slot, gpa_of(s), e - s);
                    }
                    Some(errno) => out.reject(
                        gpa_of(s),
                        e - s,
                        RejectReason::Failed {
                            op: method.name(),
                            errno,
                        },
                    ),
                }
            }
            let failed: u64 = done
                .iter()
                .filter(|d| d.2.is_some())
                .map(|d| d.1 - d.0)
                .sum();
            out.discarded += gone;
            out.skipped_pinned += (chunk_end - at) - gone - failed;
            at = chunk_end;
        }
        if end > a_end {
            out.reject(
                gpa_of(a_end),
                end - a_end,
                RejectReason::PartialPage { page_size },
            );
        }
    }

    fn mark_dirty(&self, slot: &Slot, gpa: u64, len: u64) {
        if let Some(bitmap) = slot.dirty_bitmap() {
            let rel = gpa - slot.range().start().0;
            bitmap.mark(rel / PAGE, len / PAGE);
        }
    }
}

/// `ranges` with each run of touching ranges (one ending where the next starts) joined into one,
/// so neighbouring blocks of a report cost one pass, and whole pages made of pieces of several
/// ranges of the same report are discarded. Empty and wrapping ranges stay on their own.
fn coalesce(ranges: &[(Gpa, u64)]) -> impl Iterator<Item = (Gpa, u64)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        let &(gpa, mut len) = ranges.get(i)?;
        i += 1;
        if len == 0 {
            return Some((gpa, len));
        }
        while let Some(&(next, next_len)) = ranges.get(i) {
            let joined = gpa.0.checked_add(len).filter(|&end| end == next.0);
            match joined.and_then(|_| len.checked_add(next_len)) {
                Some(total) if next_len != 0 && gpa.0.checked_add(total - 1).is_some() => {
                    len = total;
                    i += 1;
                }
                _ => break,
            }
        }
        Some((gpa, len))
    })
}

/// How one backing kind gives memory back.
#[derive(Clone, Copy, Debug)]
enum Method {
    DontNeed,
    Free,
    Remove,
    PunchHole,
}

impl Method {
    fn name(self) -> &'static str {
        match self {
            Method::DontNeed => "madvise(MADV_DONTNEED)",
            Method::Free => "madvise(MADV_FREE)",
            Method::Remove => "madvise(MADV_REMOVE)",
            Method::PunchHole => "fallocate(PUNCH_HOLE|KEEP_SIZE)",
        }
    }

    /// Discards host memory `[start, end)` of `backing`; both page aligned and inside it.
    fn apply(self, backing: &Backing, start: u64, end: u64) -> Result<(), i32> {
        let len = (end - start) as usize;
        let rc = match self {
            Method::DontNeed | Method::Free | Method::Remove => {
                let advice = match self {
                    Method::DontNeed => libc::MADV_DONTNEED,
                    Method::Free => libc::MADV_FREE,
                    _ => libc::MADV_REMOVE,
                };
                // SAFETY: [start, end) lies inside `backing`'s live mapping (the caller holds a
                // snapshot that keeps it mapped). Dropping pages changes their content to
                // zeros (or, for MADV_FREE, to zeros at the kernel's choosing) but never the
                // mapping itself, and memvisor never holds Rust references into guest memory.
                unsafe { libc::madvise(start as usize as *mut libc::c_void, len, advice) }
            }
            Method::PunchHole => {
                let Some(fd) = backing.fd() else {
                    return Err(libc::EBADF);
                };
                let offset = (backing.file_offset() + (start - backing.hva().0)) as libc::off_t;
                // SAFETY: fallocate only changes the file behind our own descriptor; the range
                // is inside the file (the backing maps it from `file_offset`, checked against
                // the file's length), and the mapping stays valid — punched pages read back as
                // zeros.
                unsafe {
                    libc::fallocate(
                        fd.as_raw_fd(),
                        libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                        offset,
                        len as libc::off_t,
                    )
                }
            }
        };
        if rc == 0 {
            return Ok(());
        }
        let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // Kernels before 4.5 lack MADV_FREE: fall back to dropping the pages outright.
        if matches!(self, Method::Free) && errno == libc::EINVAL {
            return Method::DontNeed.apply(backing, start, end);
        }
        Err(errno)
    }
}
