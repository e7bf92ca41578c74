//! Long-term pins: the kernel's own page pin, reached from userspace through io_uring.
//!
//! VFIO type1 pins guest memory with `pin_user_pages(FOLL_LONGTERM)`: the page's pin count goes
//! up, the page stays where it is (the kernel first moves it out of movable and CMA memory), and
//! reclaim, migration and compaction leave it alone until it is unpinned. No VMA changes. A
//! process can ask for exactly that pin without a device: registering a buffer with an io_uring
//! instance (`IORING_REGISTER_BUFFERS_UPDATE`) pins its pages the same way, and clearing the
//! buffer's slot unpins them. On the reference machine a 4 KiB page costs 1.1 µs to pin and
//! 0.6 µs to unpin this way, against 6-7 µs and 4-6 µs for `mlock` and `munlock`, whose cost is
//! mostly splitting and merging the memory area around the page.
//!
//! Here io_uring instances, never used for I/O, each hold a sparse table of buffers, and a new
//! instance opens when every slot is taken. Every [`LongTerm::pin`] of a run of pages registers
//! it as one buffer (a run over 1 GiB, the kernel's largest buffer, as several) in a free slot,
//! and [`LongTerm::unpin`] clears the slots of the buffers inside the run it is given. A buffer
//! only partly inside is replaced: the parts outside are registered as buffers of their own
//! first, then the old slot is cleared, so the pages that stay pinned are never unpinned in
//! between.
//!
//! **Huge pages are charged once per table.** The kernel charges a huge page a buffer touches
//! whole (`VmPin` grows by 2 MiB for a 4 KiB buffer inside a THP), and only if no other buffer
//! of the same table touches it. Two consequences:
//! - The parts a replaced buffer keeps go to *another* table: in its own they would not be
//!   charged (the old buffer still holds their huge pages), and clearing the old buffer then
//!   uncharges huge pages that stay pinned — `VmPin`, and the user's locked memory, would fall
//!   short of what is pinned.
//! - On hugetlbfs, whose huge pages never split, a buffer that would cover exactly one huge
//!   page registers only its first 4 KiB page: the kernel pins and charges the whole huge page
//!   all the same. On the reference machine that is 0.8 µs instead of 1.8 µs for a 2 MiB page
//!   and 0.7 µs instead of 0.4-0.7 ms for a 1 GiB page. THP memory cannot do the same: a
//!   transparent huge page may be split or never have formed, and then one page holds only
//!   itself (finding out costs a `PAGEMAP_SCAN`, 0.8 µs, as much as it would save).
//!
//! **Tables come in two sizes.** Registering a buffer over a huge page (THP, hugetlbfs) makes the
//! kernel look through its whole table — every slot, and every page of every buffer held there —
//! for the same huge page, to charge it once. On the reference machine a 2 MiB THP buffer cost
//! 1.6 µs to register in an empty table of 64 slots, 2.4 µs in one of 1,024 and 4.0 µs in one of
//! 1,024 holding 1,000 one-page buffers (a 4 KiB page of ordinary memory: 0.7 µs in all three).
//! So short buffers (at most [`SHORT_MAX_PAGES`], what a device's pin holds) go to tables of
//! [`SHORT_SLOTS`], which hold nothing else, and long ones (pins of whole mappings, in steps of
//! up to 64 MiB) to tables of [`SLOTS`]; up to [`RINGS`] of each. When one kind is used up, a
//! buffer takes a free slot of the other kind: slower, never refused for it.
//!
//! What differs from an `mlock` (the registry's other way to hold a page), as the caller must
//! know:
//! - The kernel counts these pages in the process's `VmPin`, not `VmLck`, and — without
//!   `CAP_IPC_LOCK` — charges them to the *user's* locked memory under `RLIMIT_MEMLOCK`.
//! - `MADV_DONTNEED` on such a page succeeds: the process's mapping gets a new zero page and the
//!   pinned one lives on apart from it until it is unpinned (an mlocked page refuses with
//!   EINVAL). memvisor's own discards never touch pinned pages, but a VMM that discards memory
//!   behind memvisor's back loses what a device writes there — the same as under VFIO type1.
//! - Pages that cannot be pinned for writing are refused (EFAULT): read-only mappings, and
//!   `MAP_SHARED` files on filesystems without long-term pin support (ext4, xfs). So are pins
//!   when the process may not use io_uring (seccomp, `kernel.io_uring_disabled`), and pins past
//!   the table's slots. The registry falls back to `mlock` for all of these.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};

const PAGE: u64 = 4096;

/// Buffers one table of long buffers holds.
pub(crate) const SLOTS: u32 = 1 << 10;

/// Buffers one table of short buffers holds.
pub(crate) const SHORT_SLOTS: u32 = 64;

/// The most tables (io_uring instances) of each size open at once: 16,384 long buffers and
/// 1,024 short ones, 32 file descriptors.
pub(crate) const RINGS: u32 = 16;

/// The most pages of a short buffer (4 MiB): what one `pin_pages` call can hold (512 pages,
/// or the two huge pages they can touch).
pub(crate) const SHORT_MAX_PAGES: u64 = 1024;

/// Index of the short tables in [`LongTerm`]'s per-size lists.
const SHORT: usize = 0;

/// Index of the long tables in [`LongTerm`]'s per-size lists.
const LONG: usize = 1;

/// The largest buffer the kernel registers, in pages (1 GiB).
const MAX_BUFFER_PAGES: u64 = (1 << 30) / PAGE;

const IORING_REGISTER_BUFFERS2: libc::c_uint = 15;
const IORING_REGISTER_BUFFERS_UPDATE: libc::c_uint = 16;
const IORING_RSRC_REGISTER_SPARSE: u32 = 1;

/// `struct io_uring_params`: 120 bytes the kernel reads flags from and writes offsets to.
#[repr(C)]
struct Params {
    words: [u32; 10],
    offsets: [u64; 10],
}

/// `struct io_uring_rsrc_register`.
#[repr(C)]
struct RsrcRegister {
    nr: u32,
    flags: u32,
    resv2: u64,
    data: u64,
    tags: u64,
}

/// `struct io_uring_rsrc_update2`.
#[repr(C)]
struct RsrcUpdate {
    offset: u32,
    resv: u32,
    data: u64,
    tags: u64,
    nr: u32,
    resv2: u32,
}

/// Runs of pages held by long-term pins, one registered buffer each.
#[derive(Debug)]
pub(crate) struct LongTerm {
    /// The tables and their sizes (short or long); slot `n` is slot `n % SLOTS` of table
    /// `n / SLOTS`.
    rings: Vec<(OwnedFd, usize)>,
    /// Free slots of the short and the long tables, the lowest last.
    free: [Vec<u32>; 2],
    /// Tables opened of each size.
    opened: [u32; 2],
    /// Buffers by first page: `(end page, slot)`, the pages they hold (a buffer over one huge
    /// page of hugetlbfs registers only its first). Disjoint.
    held: BTreeMap<u64, (u64, u32)>,
    pages: u64,
}

impl LongTerm {
    /// One io_uring instance with an empty table of [`SHORT_SLOTS`] buffers (the long ones
    /// open when first needed). Fails where the process may not use io_uring, with the reason.
    pub fn open() -> Result<LongTerm> {
        let mut long_term = LongTerm {
            rings: Vec::new(),
            free: [Vec::new(), Vec::new()],
            opened: [0; 2],
            held: BTreeMap::new(),
            pages: 0,
        };
        long_term.add_ring(SHORT)?;
        Ok(long_term)
    }

    /// Opens one more table of size `kind` ([`SHORT`] or [`LONG`]) and makes its slots free.
    fn add_ring(&mut self, kind: usize) -> Result<()> {
        let mut params = Params {
            words: [0; 10],
            offsets: [0; 10],
        };
        // SAFETY: io_uring_setup reads and writes only the params struct, which is the size the
        // kernel expects (120 bytes) and lives across the call; it returns a new fd or -1.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_io_uring_setup,
                1 as libc::c_uint,
                &mut params as *mut Params,
            )
        };
        if fd < 0 {
            let source = std::io::Error::last_os_error();
            return Err(Error::Unsupported {
                what: "long-term pins",
                why: format!(
                    "io_uring_setup: {source} (a seccomp profile or kernel.io_uring_disabled \
                     forbids io_uring here; pins stay mlocks)"
                ),
            });
        }
        // SAFETY: the fd was just returned by the kernel and nothing else owns it.
        let ring = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let slots = if kind == SHORT { SHORT_SLOTS } else { SLOTS };
        let table = RsrcRegister {
            nr: slots,
            flags: IORING_RSRC_REGISTER_SPARSE,
            resv2: 0,
            data: 0,
            tags: 0,
        };
        register(
            &ring,
            IORING_REGISTER_BUFFERS2,
            &table as *const RsrcRegister as *const libc::c_void,
            std::mem::size_of::<RsrcRegister>() as u32,
        )
        .map_err(|e| Error::Unsupported {
            what: "long-term pins",
            why: format!("registering a sparse buffer table: {e}"),
        })?;
        let first = self.rings.len() as u32 * SLOTS;
        self.rings.push((ring, kind));
        self.opened[kind] += 1;
        self.free[kind].extend((first..first + slots).rev());
        Ok(())
    }

    /// Pages held.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Pins pages `[start, end)`, none of which it holds yet, all or nothing. `folio` is the
    /// pages of a huge page of this memory that the kernel never splits (hugetlbfs), else 1:
    /// a buffer that would cover exactly one such huge page registers only its first page,
    /// which pins — and charges — the whole huge page. Fails when the kernel refuses (the
    /// errno says why) or the tables are full (ENOSPC).
    pub fn pin(&mut self, start: u64, end: u64, folio: u64) -> Result<()> {
        debug_assert!(start < end);
        let mut at = start;
        while at < end {
            let to = end.min(at + MAX_BUFFER_PAGES);
            let whole_folio = folio > 1 && to - at == folio && at % folio == 0;
            if let Err(e) = self.register(at, to, if whole_folio { 1 } else { to - at }) {
                if at > start {
                    // Only buffers this call registered lie in [start, at).
                    let _ = self.unpin(start, at);
                }
                return Err(e);
            }
            at = to;
        }
        Ok(())
    }

    /// Unpins what it holds of pages `[start, end)` and returns the parts of that range it did
    /// not hold, in order. A buffer reaching outside the range keeps its pages there pinned. On
    /// error (the kernel would not register the outside part of such a buffer) that buffer is
    /// kept whole; the others are unpinned.
    pub fn unpin(&mut self, start: u64, end: u64) -> Result<Vec<(u64, u64)>> {
        let mut gaps = Vec::new();
        let mut failed = None;
        let mut at = start;
        while at < end {
            // The first buffer overlapping [at, end): one from before `at` reaching past it, or
            // the first to start inside. What `release` keeps of a buffer lies before `start`
            // or from `end` on, so it is never found again.
            let next = self
                .held
                .range(..=at)
                .next_back()
                .filter(|(_, (e, _))| *e > at)
                .or_else(|| self.held.range(at..end).next())
                .map(|(&s, &(e, slot))| (s, e, slot));
            let Some((s, e, slot)) = next else {
                break;
            };
            if at < s {
                gaps.push((at, s));
            }
            if let Err(err) = self.release(s, e, slot, start, end) {
                failed = Some(err);
            }
            at = e.min(end);
        }
        if at < end {
            gaps.push((at, end));
        }
        match failed {
            Some(err) => Err(err),
            None => Ok(gaps),
        }
    }

    /// Releases the buffer `[s, e)` in `slot` over `[start, end)`: the parts outside stay
    /// pinned as buffers of their own, registered before the slot is cleared. On error the
    /// buffer stays as it was.
    fn release(&mut self, s: u64, e: u64, slot: u32, start: u64, end: u64) -> Result<()> {
        self.held.remove(&s);
        self.pages -= e - s;
        let mut kept = Vec::new();
        let mut done = Ok(());
        for (a, b) in [(s, start), (end, e)] {
            if a < b && done.is_ok() {
                // In another table: the kernel charges a huge page once per table, so in the
                // old buffer's table the part would not be charged, and clearing the old
                // buffer would then uncharge a huge page that stays pinned.
                done = self.register_avoiding(a, b, b - a, Some(slot / SLOTS));
                if done.is_ok() {
                    kept.push(a);
                }
            }
        }
        if done.is_ok() {
            done = self.set_slot(slot, 0, 0);
        }
        if done.is_err() {
            for a in kept {
                let (b, k) = self.held.remove(&a).expect("registered above");
                self.pages -= b - a;
                // Clearing a slot only fails for want of kernel memory; then its pages stay
                // pinned until the table closes, as well as under the restored buffer.
                let _ = self.set_slot(k, 0, 0);
                self.free_slot(k);
            }
            self.held.insert(s, (e, slot));
            self.pages += e - s;
            return done;
        }
        self.free_slot(slot);
        Ok(())
    }

    /// Makes `slot` free again, in the list of its table's size.
    fn free_slot(&mut self, slot: u32) {
        let kind = self.rings[(slot / SLOTS) as usize].1;
        self.free[kind].push(slot);
    }

    /// A free slot for a buffer of `pages`: of a table of its size, opening one if none is
    /// free and fewer than [`RINGS`] are open, else of the other size; not of table `avoid`
    /// unless no other has room. Fails with ENOSPC when every table is open and full, or with
    /// the reason a table would not open.
    fn take_slot(&mut self, pages: u64, avoid: Option<u32>) -> Result<u32> {
        let kind = if pages <= SHORT_MAX_PAGES {
            SHORT
        } else {
            LONG
        };
        let elsewhere = |slot: &u32| Some(slot / SLOTS) != avoid;
        let mut refused = None;
        for k in [kind, 1 - kind] {
            if !self.free[k].iter().any(elsewhere) && self.opened[k] < RINGS {
                // A table that will not open (out of file descriptors, say) leaves the other
                // size.
                if let Err(e) = self.add_ring(k) {
                    refused = Some(e);
                }
            }
            // The lowest free slot outside `avoid` (the list keeps the lowest last).
            if let Some(i) = self.free[k].iter().rposition(elsewhere) {
                return Ok(self.free[k].remove(i));
            }
        }
        for k in [kind, 1 - kind] {
            if let Some(slot) = self.free[k].pop() {
                return Ok(slot);
            }
        }
        Err(refused.unwrap_or_else(|| Error::Os {
            op: "long-term pin: every slot of the io_uring buffer tables is in use",
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        }))
    }

    /// Holds `[s, e)` (at most 1 GiB) as one buffer in a free slot, registering its first `len`
    /// pages: all of them, or one where that pins them all (one huge page).
    fn register(&mut self, s: u64, e: u64, len: u64) -> Result<()> {
        self.register_avoiding(s, e, len, None)
    }

    /// [`LongTerm::register`], in a table other than `avoid` where one has room.
    fn register_avoiding(&mut self, s: u64, e: u64, len: u64, avoid: Option<u32>) -> Result<()> {
        let slot = self.take_slot(len, avoid)?;
        if let Err(err) = self.set_slot(slot, s * PAGE, len * PAGE) {
            self.free_slot(slot);
            return Err(err);
        }
        self.held.insert(s, (e, slot));
        self.pages += e - s;
        Ok(())
    }

    /// Puts buffer `[addr, addr + len)` into `slot`; `len` 0 empties it (unpinning what it held).
    fn set_slot(&self, slot: u32, addr: u64, len: u64) -> Result<()> {
        let iov = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        };
        let update = RsrcUpdate {
            offset: slot,
            resv: 0,
            data: &iov as *const libc::iovec as u64,
            tags: 0,
            nr: 1,
            resv2: 0,
        };
        let update = RsrcUpdate {
            offset: slot % SLOTS,
            ..update
        };
        register(
            &self.rings[(slot / SLOTS) as usize].0,
            IORING_REGISTER_BUFFERS_UPDATE,
            &update as *const RsrcUpdate as *const libc::c_void,
            std::mem::size_of::<RsrcUpdate>() as u32,
        )
        .map_err(|source| Error::Os {
            op: if len == 0 {
                "long-term unpin (clearing an io_uring buffer)"
            } else {
                "long-term pin (registering an io_uring buffer)"
            },
            source,
        })
    }
}

/// `io_uring_register(ring, op, arg, nr)`.
fn register(
    ring: &OwnedFd,
    op: libc::c_uint,
    arg: *const libc::c_void,
    nr: u32,
) -> std::io::Result<()> {
    // SAFETY: `arg` points to a live struct of the size `nr` says, which the kernel only reads;
    // the iovec a buffer update names is live too. Registering pins pages and changes no
    // mapping or content.
    let rc = unsafe { libc::syscall(libc::SYS_io_uring_register, ring.as_raw_fd(), op, arg, nr) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `VmPin` of /proc/self/status, in pages.
    fn vm_pin() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmPin:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmPin")
            / 4
    }

    /// A private anonymous mapping of `pages` populated pages, unmapped on drop.
    struct Area(u64, u64);

    impl Area {
        fn new(pages: u64) -> Area {
            let len = (pages * PAGE) as usize;
            // SAFETY: a new anonymous mapping; nothing else refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                    -1,
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            Area(p as u64 / PAGE, pages)
        }
    }

    impl Drop for Area {
        fn drop(&mut self) {
            // SAFETY: the mapping made in `new`, no longer used.
            unsafe {
                libc::munmap(
                    (self.0 * PAGE) as *mut libc::c_void,
                    (self.1 * PAGE) as usize,
                )
            };
        }
    }

    impl LongTerm {
        /// Whether every slot of every open table is free.
        fn all_free(&self) -> bool {
            let slots: usize = (self.rings.iter())
                .map(|(_, k)| if *k == SHORT { SHORT_SLOTS } else { SLOTS } as usize)
                .sum();
            self.free[SHORT].len() + self.free[LONG].len() == slots
        }

        /// The size (short or long) of the table holding the buffer that starts at `page`.
        fn kind_of(&self, page: u64) -> usize {
            self.rings[(self.held[&page].1 / SLOTS) as usize].1
        }
    }

    fn open_or_skip(test: &str) -> Option<LongTerm> {
        match LongTerm::open() {
            Ok(lt) => Some(lt),
            Err(e) => {
                // libtest captures eprintln!; a skip must show.
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "skipped: {test}: {e}");
                None
            }
        }
    }

    // Other tests of this binary pin too, but only through their own registries' mlocks:
    // VmPin is this module's alone. Tests here run one at a time against it.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[test]
    fn pin_and_unpin_show_in_vm_pin_exactly() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut lt) = open_or_skip("pin_and_unpin_show_in_vm_pin_exactly") else {
            return;
        };
        let a = Area::new(64);
        let before = vm_pin();
        lt.pin(a.0 + 4, a.0 + 12, 1).unwrap();
        lt.pin(a.0 + 20, a.0 + 21, 1).unwrap();
        assert_eq!(vm_pin() - before, 9);
        assert_eq!(lt.pages(), 9);
        // Unpinning a range that covers held and unheld pages returns the unheld ones.
        let gaps = lt.unpin(a.0, a.0 + 16).unwrap();
        assert_eq!(gaps, vec![(a.0, a.0 + 4), (a.0 + 12, a.0 + 16)]);
        assert_eq!(vm_pin() - before, 1);
        lt.unpin(a.0 + 20, a.0 + 21).unwrap();
        assert_eq!(vm_pin(), before);
        assert_eq!(lt.pages(), 0);
        assert!(lt.all_free());
    }

    #[test]
    fn partial_unpin_keeps_the_rest_pinned() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut lt) = open_or_skip("partial_unpin_keeps_the_rest_pinned") else {
            return;
        };
        let a = Area::new(32);
        let before = vm_pin();
        lt.pin(a.0, a.0 + 16, 1).unwrap();
        // The middle goes: both ends stay pinned, as two buffers.
        assert_eq!(lt.unpin(a.0 + 4, a.0 + 6).unwrap(), vec![]);
        assert_eq!(vm_pin() - before, 14);
        assert_eq!(lt.held.len(), 2);
        // The first page goes: the buffer starting there is replaced by one starting after it.
        assert_eq!(lt.unpin(a.0, a.0 + 1).unwrap(), vec![]);
        assert_eq!(vm_pin() - before, 13);
        assert_eq!(
            lt.unpin(a.0, a.0 + 16).unwrap(),
            vec![(a.0, a.0 + 1), (a.0 + 4, a.0 + 6)]
        );
        assert_eq!(vm_pin(), before);
        assert_eq!(lt.pages(), 0);
        assert!(lt.held.is_empty());
    }

    #[test]
    fn a_full_table_opens_another() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut lt) = open_or_skip("a_full_table_opens_another") else {
            return;
        };
        let n = SHORT_SLOTS as u64 + 2;
        let a = Area::new(2 * n);
        let before = vm_pin();
        // Every other page, so that no two buffers touch: one slot each.
        for i in 0..n {
            lt.pin(a.0 + 2 * i, a.0 + 2 * i + 1, 1).unwrap();
        }
        assert_eq!(lt.opened, [2, 0]);
        assert_eq!(vm_pin() - before, n);
        let gaps = lt.unpin(a.0, a.0 + 2 * n).unwrap();
        assert_eq!(gaps.len() as u64, n);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn short_and_long_buffers_go_to_tables_of_their_own_size() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut lt) = open_or_skip("tables_of_their_own_size") else {
            return;
        };
        let long = SHORT_MAX_PAGES + 1;
        let a = Area::new(SHORT_MAX_PAGES + 1 + long);
        let before = vm_pin();
        lt.pin(a.0, a.0 + SHORT_MAX_PAGES, 1).unwrap();
        lt.pin(
            a.0 + SHORT_MAX_PAGES + 1,
            a.0 + SHORT_MAX_PAGES + 1 + long,
            1,
        )
        .unwrap();
        assert_eq!(lt.opened, [1, 1]);
        assert_eq!(lt.kind_of(a.0), SHORT);
        assert_eq!(lt.kind_of(a.0 + SHORT_MAX_PAGES + 1), LONG);
        assert_eq!(vm_pin() - before, SHORT_MAX_PAGES + long);
        // The long buffer loses its first page: what stays is short now, and moves.
        lt.unpin(a.0 + SHORT_MAX_PAGES + 1, a.0 + SHORT_MAX_PAGES + 2)
            .unwrap();
        assert_eq!(lt.kind_of(a.0 + SHORT_MAX_PAGES + 2), SHORT);
        assert_eq!(vm_pin() - before, SHORT_MAX_PAGES + long - 1);
        lt.unpin(a.0, a.0 + 2 * SHORT_MAX_PAGES + 2).unwrap();
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn when_one_size_is_used_up_buffers_take_the_other() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut lt) = open_or_skip("buffers_take_the_other_size") else {
            return;
        };
        let n = (RINGS * SHORT_SLOTS) as u64 + 3;
        let a = Area::new(2 * n);
        let before = vm_pin();
        for i in 0..n {
            lt.pin(a.0 + 2 * i, a.0 + 2 * i + 1, 1).unwrap();
        }
        assert_eq!(lt.opened, [RINGS, 1]);
        for i in n - 3..n {
            assert_eq!(lt.kind_of(a.0 + 2 * i), LONG);
        }
        assert_eq!(vm_pin() - before, n);
        lt.unpin(a.0, a.0 + 2 * n).unwrap();
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn a_page_that_cannot_be_pinned_for_writing_is_refused_and_nothing_stays() {
        let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mut lt) = open_or_skip("read_only_refused") else {
            return;
        };
        let a = Area::new(8);
        // SAFETY: the area is this test's own.
        let rc = unsafe {
            libc::mprotect(
                (a.0 * PAGE + 4 * PAGE) as *mut libc::c_void,
                4096,
                libc::PROT_READ,
            )
        };
        assert_eq!(rc, 0);
        let before = vm_pin();
        let err = lt.pin(a.0, a.0 + 8, 1).unwrap_err();
        assert_eq!(err.errno(), libc::EFAULT, "{err}");
        assert_eq!(vm_pin(), before);
        assert_eq!(lt.pages(), 0);
        assert!(lt.all_free());
    }
}
