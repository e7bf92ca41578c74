//! Long-term pins: the kernel's own page pin, reached from userspace through io_uring.
//!
//! VFIO type1 pins guest memory with `pin_user_pages(FOLL_LONGTERM)`: the page's pin count goes
//! up, the page stays where it is (the kernel first moves it out of movable and CMA memory), and
//! reclaim, migration and compaction leave it alone until it is unpinned. No VMA changes. A
//! process can ask for exactly that pin without a device: registering a buffer with an io_uring
//! instance (`IORING_REGISTER_BUFFERS_UPDATE`) pins its pages the same way, and clearing the
//! buffer's slot unpins them. A 4 KiB page costs several times less to pin and unpin this way
//! than with `mlock` and `munlock`, whose cost is mostly splitting and merging the memory area
//! around the page (figures for this module: `docs/measurements.md`, "Long-term pins").
//!
//! Here io_uring instances, never used for I/O, each hold a sparse table of buffers, and a new
//! instance opens when every slot is taken. [`LongTerm::pin`] registers a run of pages as one
//! buffer (a run over 1 GiB, the kernel's largest buffer, as several) in a free slot.
//! [`LongTerm::unpin`] lets go of pages, and a buffer's slot is cleared — its pages unpinned —
//! with the last of its pages. Until then the kernel keeps all of it pinned, and a later pin of
//! a page let go takes it back from its buffer ([`LongTerm::revive`]). What remains of a
//! buffer is never registered anew: that would pin whatever its addresses map by then (another
//! process may have punched a hole in a shared memfd), not the pages a device was given, and
//! let those go.
//!
//! **Huge pages are charged once per table.** The kernel charges a huge page a buffer touches
//! whole (`VmPin` grows by 2 MiB for a 4 KiB buffer inside a transparent huge page), and only to
//! the first buffer of its table that touches it; clearing that buffer uncharges it, even
//! while another buffer of the table still pins it. Memory the registry pins in 4 KiB units may
//! be backed by huge pages all the same (THP `always`, a VMM's own `MADV_HUGEPAGE`, shmem with
//! huge pages), so where the kernel's THP settings allow that, no two buffers within the same
//! 2 MiB of memory share a table: each is charged on its own, and `VmPin` may exceed what the
//! registry holds but never falls short of what the kernel pins. Past 32 buffers within one
//! 2 MiB (every table), a pin is refused with ENOSPC and the registry mlocks instead. Not
//! foreseen: folios over 2 MiB in memory pinned in 4 KiB units (a 1 GiB hugetlbfs page handed
//! over as caller-managed memory), one huge page mapped at two addresses, and huge pages the
//! settings forbid (`MADV_COLLAPSE`, a tmpfs mounted with its own `huge=`).
//!
//! **Hugetlbfs pages are pinned through one page.** Their huge pages never split, so a buffer
//! that would cover exactly one of them registers only its first 4 KiB page: the kernel pins
//! and charges the whole huge page all the same, at the cost of one 4 KiB page: about half for
//! a 2 MiB page, hundreds of times less for a 1 GiB one. THP memory cannot do the same: a
//! transparent huge page may be split or never have formed, and then one page holds only itself
//! (finding out costs a `PAGEMAP_SCAN`, as much as it would save).
//!
//! **Tables come in two sizes.** Registering a buffer over a huge page (THP, hugetlbfs) makes the
//! kernel look through its whole table — every slot, and every page of every buffer held there —
//! for the same huge page, to charge it once: a 2 MiB THP buffer costs more to register the
//! more slots and buffers its table holds (over twice as much in a full table of 1,024 as in
//! an empty one of 64), while a 4 KiB page of ordinary memory costs the same in all. So short
//! buffers (at most [`SHORT_MAX_PAGES`], what a device's pin holds) go to tables of
//! [`SHORT_SLOTS`], which hold nothing else, and long ones (pins of whole mappings, in steps of
//! up to 64 MiB) to tables of [`SLOTS`]; up to [`RINGS`] of each. When one kind is used up, a
//! buffer takes a free slot of the other kind.
//!
//! What differs from an `mlock` (the registry's other way to hold a page), as the caller must
//! know:
//! - The kernel counts these pages in the process's `VmPin`, not `VmLck`, and — without
//!   `CAP_IPC_LOCK` — charges them to the *user's* locked memory under `RLIMIT_MEMLOCK`.
//! - `MADV_DONTNEED` on such a page succeeds: the process's mapping gets a new zero page and the
//!   pinned one lives on apart from it until it is unpinned (an mlocked page refuses with
//!   EINVAL). memvisor's own discards never touch pinned pages, but a VMM that discards memory
//!   behind memvisor's back loses what a device writes there — the same as under VFIO type1.
//! - A page let go while the rest of its buffer is held stays pinned until that goes too (at
//!   most 4 MiB per short buffer): discarding it frees the process's mapping at once, the page
//!   itself only then.
//! - Pages that cannot be pinned for writing are refused (EFAULT): read-only mappings, and
//!   `MAP_SHARED` files on filesystems without long-term pin support (ext4, xfs). So are pins
//!   when the process may not use io_uring (seccomp, `kernel.io_uring_disabled`), and pins past
//!   the table's slots. The registry falls back to `mlock` for all of these.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::addr::PAGE_4K as PAGE;
use crate::error::{Error, Result};

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

/// One registered buffer.
#[derive(Debug, Clone, Copy)]
struct Buffer {
    /// Page after its last.
    end: u64,
    slot: u32,
    /// Its pages the registry holds; the others were let go and stay pinned until this is 0.
    live: u64,
}

/// Runs of pages held by long-term pins, one registered buffer each.
#[derive(Debug)]
pub(crate) struct LongTerm {
    /// The tables and their sizes (short or long); slot `n` is slot `n % SLOTS` of table
    /// `n / SLOTS`.
    rings: Vec<(OwnedFd, usize)>,
    /// Free slots of the short and the long tables.
    free: [Vec<u32>; 2],
    /// Tables opened of each size.
    opened: [u32; 2],
    /// Buffers by first page. Disjoint. A buffer over one huge page of hugetlbfs registers only
    /// its first page and pins them all.
    held: BTreeMap<u64, Buffer>,
    /// Pages of all buffers: what the kernel pins.
    pages: u64,
    /// Pages of buffers whose slot could not be cleared: pinned until the table closes.
    lost: u64,
    /// Scratch lists kept between calls, so that a pin or unpin allocates nothing.
    avoid: Vec<u32>,
    empty: Vec<(u64, Buffer)>,
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
            lost: 0,
            avoid: Vec::new(),
            empty: Vec::new(),
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
        // SAFETY: a sparse table names no buffer; the struct is the kernel's.
        unsafe { register(&ring, IORING_REGISTER_BUFFERS2, &table) }.map_err(|e| {
            Error::Unsupported {
                what: "long-term pins",
                why: format!("registering a sparse buffer table: {e}"),
            }
        })?;
        let first = self.rings.len() as u32 * SLOTS;
        self.rings.push((ring, kind));
        self.opened[kind] += 1;
        self.free[kind].extend((first..first + slots).rev());
        Ok(())
    }

    /// Pages the kernel pins for this instance: every buffer whole, even where the registry let
    /// part of it go, and buffers that could not be cleared.
    pub fn pages(&self) -> u64 {
        self.pages + self.lost
    }

    /// Takes back the pages of `[start, end)` that lie in buffers (let go earlier, still
    /// pinned) and puts the runs that lie in none into `gaps`, in order. Nothing is registered.
    pub fn revive(&mut self, start: u64, end: u64, gaps: &mut Vec<(u64, u64)>) {
        self.walk(start, end, gaps, |_, b, n| b.live += n);
    }

    /// Pins `[start, end)`, which no buffer holds any part of, as new buffers, all or nothing.
    /// `folio` is the pages of a huge page of this memory that the kernel never splits
    /// (hugetlbfs), else 1: a buffer that would cover exactly one such huge page registers only
    /// its first page, which pins — and charges — the whole huge page. `spread`: the memory
    /// may be backed by larger folios than its 4 KiB units (see [`LongTerm::register`]). Fails
    /// when the kernel refuses (the errno says why) or no table may take the buffer (ENOSPC).
    pub fn pin(&mut self, start: u64, end: u64, folio: u64, spread: bool) -> Result<()> {
        debug_assert!(start < end);
        let mut at = start;
        while at < end {
            let to = end.min(at + MAX_BUFFER_PAGES);
            let one_page = folio > 1 && to - at == folio && at % folio == 0;
            let len = if one_page { 1 } else { to - at };
            if let Err(e) = self.register(at, to, len, spread) {
                // Only buffers this call registered lie in [start, at).
                self.unpin(start, at, &mut Vec::new());
                return Err(e);
            }
            at = to;
        }
        Ok(())
    }

    /// Puts the runs of `[start, end)` that lie in no buffer into `gaps`, in order.
    pub fn gaps(&mut self, start: u64, end: u64, gaps: &mut Vec<(u64, u64)>) {
        self.walk(start, end, gaps, |_, _, _| {});
    }

    /// Lets go of the pages of `[start, end)` that lie in buffers — all held — and puts the
    /// runs that lie in none into `gaps`, in order. A buffer is unpinned (its slot cleared) when
    /// the last of its pages goes; until then the kernel keeps all of it pinned. Registering
    /// what remains of a buffer as a new one would pin whatever its addresses map by then,
    /// which need not be the pages a device was given.
    pub fn unpin(&mut self, start: u64, end: u64, gaps: &mut Vec<(u64, u64)>) {
        let mut empty = std::mem::take(&mut self.empty);
        empty.clear();
        self.walk(start, end, gaps, |s, b, n| {
            debug_assert!(b.live >= n, "unpinning pages not held");
            b.live = b.live.saturating_sub(n);
            if b.live == 0 {
                empty.push((s, *b));
            }
        });
        for &(s, b) in &empty {
            self.held.remove(&s);
            self.pages -= b.end - s;
            if self.set_slot(b.slot, 0, 0).is_ok() {
                self.free_slot(b.slot);
            } else {
                // Clearing asks the kernel for no memory and reads one iovec on this stack; if
                // it fails anyway, the slot stays taken and its pages pinned until the table
                // closes, counted in `pages()`.
                self.lost += b.end - s;
            }
        }
        self.empty = empty;
    }

    /// Calls `each(first page, buffer, pages)` for every buffer overlapping `[start, end)` with
    /// the pages of the overlap, and puts the runs that lie in no buffer into `gaps`.
    fn walk(
        &mut self,
        start: u64,
        end: u64,
        gaps: &mut Vec<(u64, u64)>,
        mut each: impl FnMut(u64, &mut Buffer, u64),
    ) {
        // Buffers are disjoint, so sorted by end as by start: one search, walking back from
        // `end` while they reach past `start`; the gaps come out last first.
        let first_gap = gaps.len();
        let mut at = end;
        for (&s, b) in (self.held.range_mut(..end).rev()).take_while(|(_, b)| b.end > start) {
            let (a, z) = (s.max(start), b.end.min(end));
            if z < at {
                gaps.push((z, at));
            }
            each(s, b, z - a);
            at = a;
        }
        if start < at {
            gaps.push((start, at));
        }
        gaps[first_gap..].reverse();
    }

    /// Makes `slot` free again, in the list of its table's size.
    fn free_slot(&mut self, slot: u32) {
        let kind = self.rings[(slot / SLOTS) as usize].1;
        self.free[kind].push(slot);
    }

    /// Puts the tables holding a buffer that touches the same 2 MiB of memory as `[s, e)` into
    /// `tables`.
    fn tables_near(&self, s: u64, e: u64, tables: &mut Vec<u32>) {
        const REGION: u64 = (2 << 20) / PAGE;
        let (rs, re) = (s / REGION * REGION, e.div_ceil(REGION) * REGION);
        // Buffers are disjoint, so sorted by end as by start: walk back from the region's end
        // while they reach into it.
        tables.extend(
            (self.held.range(..re).rev())
                .take_while(|(_, b)| b.end > rs)
                .map(|(_, b)| b.slot / SLOTS),
        );
    }

    /// A free slot for a buffer of `pages` in none of the tables `avoid`: of a table of its
    /// size, opening one if none is free and fewer than [`RINGS`] are open, else of the other
    /// size. Fails with ENOSPC when every table is open and full (or avoided), or with the
    /// reason a table would not open.
    fn take_slot(&mut self, pages: u64, avoid: &[u32]) -> Result<u32> {
        let kind = if pages <= SHORT_MAX_PAGES {
            SHORT
        } else {
            LONG
        };
        let usable = |slot: &u32| !avoid.contains(&(slot / SLOTS));
        let mut refused = None;
        for k in [kind, 1 - kind] {
            if !self.free[k].iter().rev().any(usable) && self.opened[k] < RINGS {
                // A table that will not open (out of file descriptors, say) leaves the other
                // size.
                if let Err(e) = self.add_ring(k) {
                    refused = Some(e);
                }
            }
            if let Some(i) = self.free[k].iter().rposition(usable) {
                return Ok(self.free[k].swap_remove(i));
            }
        }
        Err(refused.unwrap_or_else(|| Error::Os {
            op: "long-term pin: no io_uring buffer table has a slot free for this buffer",
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        }))
    }

    /// Pins `[s, e)` (at most 1 GiB) as one buffer, registering its first `len` pages: all of
    /// them, or one where that pins them all (one huge page). With `spread` — memory whose
    /// 4 KiB units may be backed by transparent huge pages — the buffer goes to a table
    /// holding no other buffer within the same 2 MiB of memory: the kernel charges a huge
    /// page to the first buffer of a table that touches it and to no other, so if two buffers
    /// of one table shared one, unpinning the charged one would uncharge a huge page the other
    /// still pins.
    fn register(&mut self, s: u64, e: u64, len: u64, spread: bool) -> Result<()> {
        let mut avoid = std::mem::take(&mut self.avoid);
        avoid.clear();
        if spread {
            self.tables_near(s, e, &mut avoid);
        }
        let slot = self.take_slot(len, &avoid);
        self.avoid = avoid;
        let slot = slot?;
        if let Err(err) = self.set_slot(slot, s * PAGE, len * PAGE) {
            self.free_slot(slot);
            return Err(err);
        }
        self.held.insert(
            s,
            Buffer {
                end: e,
                slot,
                live: e - s,
            },
        );
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
            offset: slot % SLOTS,
            resv: 0,
            data: &iov as *const libc::iovec as u64,
            tags: 0,
            nr: 1,
            resv2: 0,
        };
        let ring = &self.rings[(slot / SLOTS) as usize].0;
        // SAFETY: `update` names one iovec, `iov`, live on this stack for the call. Registering
        // faults in and pins the pages it covers, for writing (breaking copy-on-write where it
        // must, contents unchanged); an address range not mapped writable is refused (EFAULT).
        unsafe { register(ring, IORING_REGISTER_BUFFERS_UPDATE, &update) }.map_err(|source| {
            Error::Os {
                op: if len == 0 {
                    "long-term unpin (clearing an io_uring buffer)"
                } else {
                    "long-term pin (registering an io_uring buffer)"
                },
                source,
            }
        })
    }
}

/// `io_uring_register(ring, op, arg, size of arg)`.
///
/// # Safety
///
/// `arg` must be the kernel's struct for `op`, and every pointer in it must be valid for the
/// kernel to read for the length it names.
unsafe fn register<T>(ring: &OwnedFd, op: libc::c_uint, arg: &T) -> std::io::Result<()> {
    let size = std::mem::size_of::<T>() as libc::c_uint;
    // SAFETY: `arg` is a live reference of `size` bytes; the caller vouches for what it points
    // to.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring.as_raw_fd(),
            op,
            arg as *const T,
            size,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sync::lock;

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
            Area::with(pages, libc::MAP_POPULATE)
        }

        /// Not populated: pages fault in as they are pinned.
        fn sparse(pages: u64) -> Area {
            Area::with(pages, 0)
        }

        fn with(pages: u64, populate: libc::c_int) -> Area {
            let len = (pages * PAGE) as usize;
            // SAFETY: a new anonymous mapping; nothing else refers to it.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | populate,
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
            self.rings[(self.held[&page].slot / SLOTS) as usize].1
        }
    }

    /// What `io_uring_setup` charges to `RLIMIT_MEMLOCK` for one of the tables' one-entry rings
    /// (8 KiB, as Linux 6.18 charges it: 64 KiB of limit opens 8 of them).
    const RING_BYTES: u64 = 2 * PAGE;

    /// Rings of this module's earlier tests that may still be charged: the kernel closes a ring
    /// after its fd is closed, in a worker, and uncharges it only then (invisible in `VmPin`).
    /// All the tests here open fewer than 64 tables together.
    const CLOSING_RINGS_BYTES: u64 = 64 * RING_BYTES;

    /// Opens a registry for `test`, which holds up to `pages` pages in up to `tables` tables at
    /// once; or says on stderr why the test is skipped and gives None. Without `CAP_IPC_LOCK`
    /// the kernel charges the pins and the rings to `RLIMIT_MEMLOCK` (8 MiB is a common default)
    /// and refuses what goes past it with ENOMEM, so a test that needs more than is left is
    /// skipped, not failed. So is one where the process may not use io_uring.
    fn open_or_skip(test: &str, pages: u64, tables: u32) -> Option<LongTerm> {
        let skip = |why: &str| {
            // libtest captures eprintln!; a skip must show.
            use std::io::Write;
            // One write, so that a test running beside this one cannot cut the line.
            let _ = std::io::stderr().write_all(format!("skipped: {test}: {why}\n").as_bytes());
        };
        let need = pages * PAGE + u64::from(tables) * RING_BYTES + CLOSING_RINGS_BYTES;
        if let Some(room) = pin_room().filter(|&room| room < need) {
            skip(&format!(
                "needs up to {need} bytes for long-term pins and io_uring rings; without \
                 CAP_IPC_LOCK, RLIMIT_MEMLOCK leaves {room} (needs `ulimit -l {}` or root)",
                need.div_ceil(1024) + vm_pin() * PAGE / 1024
            ));
            return None;
        }
        match LongTerm::open() {
            Ok(lt) => Some(lt),
            Err(e) => {
                skip(&e.to_string());
                None
            }
        }
    }

    /// Bytes the kernel would still let this process pin through io_uring: None with
    /// `CAP_IPC_LOCK` or an unlimited `RLIMIT_MEMLOCK`, else the soft limit less `VmPin`
    /// (what this process pins already; other processes of the user may hold more).
    fn pin_room() -> Option<u64> {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let caps = (status.lines())
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .expect("CapEff in /proc/self/status");
        // CAP_IPC_LOCK is capability 14.
        if caps & (1 << 14) != 0 {
            return None;
        }
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into the struct we own.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) }, 0);
        (rl.rlim_cur != libc::RLIM_INFINITY).then(|| rl.rlim_cur.saturating_sub(vm_pin() * PAGE))
    }

    // Other tests of this binary pin too, but only through their own registries' mlocks:
    // VmPin is this module's alone. Tests here run one at a time against it.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// `unpin`, collecting the gaps.
    fn unpin(lt: &mut LongTerm, start: u64, end: u64) -> Vec<(u64, u64)> {
        let mut gaps = Vec::new();
        lt.unpin(start, end, &mut gaps);
        gaps
    }

    /// The table of the buffer starting at `page`.
    fn table_of(lt: &LongTerm, page: u64) -> u32 {
        lt.held[&page].slot / SLOTS
    }

    const REGION: u64 = 512;

    #[test]
    fn pin_and_unpin_show_in_vm_pin_exactly() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip("pin_and_unpin_show_in_vm_pin_exactly", 9, 2) else {
            return;
        };
        let a = Area::new(64);
        let before = vm_pin();
        lt.pin(a.0 + 4, a.0 + 12, 1, true).unwrap();
        lt.pin(a.0 + 20, a.0 + 21, 1, true).unwrap();
        assert_eq!(vm_pin() - before, 9);
        assert_eq!(lt.pages(), 9);
        // Unpinning a range that covers held and unheld pages returns the unheld ones.
        assert_eq!(
            unpin(&mut lt, a.0, a.0 + 16),
            vec![(a.0, a.0 + 4), (a.0 + 12, a.0 + 16)]
        );
        assert_eq!(vm_pin() - before, 1);
        unpin(&mut lt, a.0 + 20, a.0 + 21);
        assert_eq!(vm_pin(), before);
        assert_eq!(lt.pages(), 0);
        assert!(lt.all_free());
    }

    #[test]
    fn a_buffer_stays_whole_until_its_last_page_goes() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip("a_buffer_stays_whole_until_its_last_page_goes", 18, 2)
        else {
            return;
        };
        let a = Area::new(32);
        let before = vm_pin();
        lt.pin(a.0, a.0 + 16, 1, true).unwrap();
        // The middle goes: the kernel keeps all 16 pinned, nothing is registered anew.
        assert_eq!(unpin(&mut lt, a.0 + 4, a.0 + 6), vec![]);
        assert_eq!(vm_pin() - before, 16);
        assert_eq!(lt.held.len(), 1);
        assert_eq!(lt.held[&a.0].live, 14);
        // Taken back as it is, with the pages just past the buffer pinned anew.
        let mut gaps = Vec::new();
        lt.revive(a.0 + 4, a.0 + 6, &mut gaps);
        assert_eq!(gaps, vec![]);
        lt.revive(a.0 + 16, a.0 + 18, &mut gaps);
        assert_eq!(gaps, vec![(a.0 + 16, a.0 + 18)]);
        assert_eq!(lt.held[&a.0].live, 16);
        lt.pin(a.0 + 16, a.0 + 18, 1, true).unwrap();
        assert_eq!(vm_pin() - before, 18);
        // Let go page by page: a buffer is unpinned with its last page.
        for p in 0..15 {
            unpin(&mut lt, a.0 + p, a.0 + p + 1);
            assert_eq!(vm_pin() - before, 18);
        }
        unpin(&mut lt, a.0 + 15, a.0 + 16);
        assert_eq!(vm_pin() - before, 2);
        assert_eq!(
            unpin(&mut lt, a.0, a.0 + 32),
            vec![(a.0, a.0 + 16), (a.0 + 18, a.0 + 32)]
        );
        assert_eq!(vm_pin(), before);
        assert_eq!(lt.pages(), 0);
        assert!(lt.all_free());
    }

    #[test]
    fn buffers_within_the_same_2_mib_go_to_different_tables() {
        let _g = lock(&SERIAL);
        let Some(mut lt) =
            open_or_skip("buffers_within_the_same_2_mib_go_to_different_tables", 5, 3)
        else {
            return;
        };
        let a = Area::sparse(4 * REGION);
        let r = a.0.div_ceil(REGION) * REGION;
        let before = vm_pin();
        lt.pin(r + 1, r + 2, 1, true).unwrap();
        lt.pin(r + 3, r + 4, 1, true).unwrap();
        lt.pin(r + REGION - 1, r + REGION + 1, 1, true).unwrap();
        let (t1, t3, t_edge) = (
            table_of(&lt, r + 1),
            table_of(&lt, r + 3),
            table_of(&lt, r + REGION - 1),
        );
        assert_ne!(t1, t3);
        assert!(
            t_edge != t1 && t_edge != t3,
            "it reaches into the same 2 MiB"
        );
        // A buffer in the next 2 MiB but one shares with nothing.
        lt.pin(r + 2 * REGION + 5, r + 2 * REGION + 6, 1, true)
            .unwrap();
        assert_eq!(lt.opened, [3, 0]);
        assert_eq!(vm_pin() - before, 5);
        unpin(&mut lt, a.0, a.0 + 4 * REGION);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn past_every_table_within_one_2_mib_a_pin_is_refused_with_enospc() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip(
            "past_every_table_within_one_2_mib_a_pin_is_refused_with_enospc",
            2 * RINGS as u64,
            2 * RINGS,
        ) else {
            return;
        };
        let a = Area::sparse(2 * REGION);
        let r = a.0.div_ceil(REGION) * REGION;
        let tables = 2 * RINGS as u64;
        let before = vm_pin();
        for i in 0..tables {
            lt.pin(r + 2 * i, r + 2 * i + 1, 1, true).unwrap();
        }
        let err = lt
            .pin(r + 2 * tables, r + 2 * tables + 1, 1, true)
            .unwrap_err();
        assert_eq!(err.errno(), libc::ENOSPC, "{err}");
        assert_eq!(vm_pin() - before, tables);
        unpin(&mut lt, r, r + REGION);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn without_large_folios_buffers_share_tables() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip(
            "without_large_folios_buffers_share_tables",
            2 * RINGS as u64 + 8,
            1,
        ) else {
            return;
        };
        let a = Area::sparse(2 * REGION);
        let r = a.0.div_ceil(REGION) * REGION;
        let n = 2 * RINGS as u64 + 8;
        let before = vm_pin();
        for i in 0..n {
            lt.pin(r + 2 * i, r + 2 * i + 1, 1, false).unwrap();
        }
        assert_eq!(lt.opened, [1, 0]);
        assert_eq!(vm_pin() - before, n);
        unpin(&mut lt, r, r + REGION);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn a_full_table_opens_another() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip("a_full_table_opens_another", SHORT_SLOTS as u64 + 2, 2)
        else {
            return;
        };
        // One page in each 2 MiB, so that no two buffers need different tables.
        let n = SHORT_SLOTS as u64 + 2;
        let a = Area::sparse((n + 1) * REGION);
        let r = a.0.div_ceil(REGION) * REGION;
        let before = vm_pin();
        for i in 0..n {
            lt.pin(r + i * REGION, r + i * REGION + 1, 1, true).unwrap();
        }
        assert_eq!(lt.opened, [2, 0]);
        assert_eq!(vm_pin() - before, n);
        let gaps = unpin(&mut lt, r, r + n * REGION);
        assert_eq!(gaps.len() as u64, n);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn short_and_long_buffers_go_to_tables_of_their_own_size() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip(
            "short_and_long_buffers_go_to_tables_of_their_own_size",
            2 * SHORT_MAX_PAGES + 1,
            2,
        ) else {
            return;
        };
        let long = SHORT_MAX_PAGES + 1;
        let a = Area::sparse(4 * REGION + long);
        let r = a.0.div_ceil(REGION) * REGION;
        let before = vm_pin();
        lt.pin(r, r + SHORT_MAX_PAGES, 1, true).unwrap();
        lt.pin(r + 2 * REGION, r + 2 * REGION + long, 1, true)
            .unwrap();
        assert_eq!(lt.opened, [1, 1]);
        assert_eq!(lt.kind_of(r), SHORT);
        assert_eq!(lt.kind_of(r + 2 * REGION), LONG);
        assert_eq!(vm_pin() - before, SHORT_MAX_PAGES + long);
        unpin(&mut lt, r, r + 2 * REGION + long);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn when_one_size_is_used_up_buffers_take_the_other() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip(
            "when_one_size_is_used_up_buffers_take_the_other",
            (RINGS * SHORT_SLOTS) as u64 + 3,
            RINGS + 1,
        ) else {
            return;
        };
        let n = (RINGS * SHORT_SLOTS) as u64 + 3;
        let a = Area::sparse((n + 1) * REGION);
        let r = a.0.div_ceil(REGION) * REGION;
        let before = vm_pin();
        for i in 0..n {
            lt.pin(r + i * REGION, r + i * REGION + 1, 1, true).unwrap();
        }
        assert_eq!(lt.opened, [RINGS, 1]);
        for i in n - 3..n {
            assert_eq!(lt.kind_of(r + i * REGION), LONG);
        }
        assert_eq!(vm_pin() - before, n);
        unpin(&mut lt, r, r + n * REGION);
        assert_eq!(vm_pin(), before);
        assert!(lt.all_free());
    }

    #[test]
    fn a_page_that_cannot_be_pinned_for_writing_is_refused_and_nothing_stays() {
        let _g = lock(&SERIAL);
        let Some(mut lt) = open_or_skip(
            "a_page_that_cannot_be_pinned_for_writing_is_refused_and_nothing_stays",
            8,
            1,
        ) else {
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
        let err = lt.pin(a.0, a.0 + 8, 1, true).unwrap_err();
        assert_eq!(err.errno(), libc::EFAULT, "{err}");
        assert_eq!(vm_pin(), before);
        assert_eq!(lt.pages(), 0);
        assert!(lt.all_free());
    }
}
