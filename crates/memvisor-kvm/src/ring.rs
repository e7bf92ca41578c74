//! KVM's per-vCPU dirty rings: the second source of the vCPUs' dirty pages.
//!
//! With `KVM_CAP_DIRTY_LOG_RING_ACQ_REL` on, KVM does not keep a dirty bitmap per memslot;
//! each vCPU pushes one entry per page it dirties into its own ring, a page of the vCPU fd that
//! userspace maps (at `KVM_DIRTY_LOG_PAGE_OFFSET`). An entry is `{flags, slot, offset}`: the KVM
//! slot number and the page's index in it. [`Rings`] keeps every vCPU's mapping and harvests
//! them all at once, under one lock:
//!
//! 1. from each ring's fetch index on, an entry whose flags read (acquire) `DIRTY` is collected
//!    into a pending bitmap for its KVM slot and marked `RESET` (release); the first entry not
//!    `DIRTY` ends that ring;
//! 2. `KVM_RESET_DIRTY_RINGS` then makes KVM write-protect the collected pages again and free
//!    their entries.
//!
//! A page written after step 2 dirties again: it is in the next harvest. A page written between
//! 1 and 2 was still writable (no new entry) and its data is in memory before the caller copies
//! the pages this harvest reported. So the order never under-reports, as with the bitmap. That
//! holds for pages another thread's harvest collected too: a harvest resets whenever entries
//! were marked whose reset has not returned yet, even if it collected none itself, so no page
//! is reported before KVM write-protected it again.
//!
//! The binding ([`KvmSlots`](crate::KvmSlots)) harvests before it reads a slot's log and before
//! it deletes a memslot (dropping that slot's pending bits: a re-created slot reports all its
//! pages instead); a vCPU whose ring is full (`KVM_EXIT_DIRTY_RING_FULL`) harvests on its own
//! thread before it enters the guest again. Entries of a deleted memslot that a running vCPU
//! pushed after the last harvest may land on a later slot with the same number: that can only
//! report pages dirty that were not, never miss one.
//!
//! **Harvesting while vCPUs run needs no kick.** `KVM_RESET_DIRTY_RINGS` (kvm_main.c,
//! `kvm_vm_ioctl_reset_dirty_pages`) takes only `kvm->slots_lock`, walks each vCPU's ring from
//! its reset index while entries read `RESET`, re-protects those pages under the MMU lock and
//! flushes TLBs with a request that kicks running vCPUs itself; it never takes a vCPU's mutex
//! (the one `KVM_RUN` holds). So the migration thread harvests while the vCPUs stay in the
//! guest. Concurrent harvests are safe: the collect step holds this module's lock, the resets
//! are serialized by KVM, and a reset frees every entry marked `RESET` by anyone, so a
//! harvest that collected nothing may still have to reset (a vCPU's full-ring harvest always
//! does: the entries it finds marked may be another thread's, not yet reset).
//!
//! **A KVM that overruns rings is refused; an overrun elsewhere is reported, not waited on.**
//! KVM promises to stop a vCPU at the soft limit (ring size minus a reserve of at least 64
//! entries) before its ring is full; `kvm_dirty_ring_push` (virt/kvm/dirty_ring.c) writes at
//! `dirty_index` unconditionally, so a push into a full ring overwrites the oldest entry. The
//! KVM on this project's test machine breaks the promise: it is PVM (`kvm_pvm`), which emulates
//! real-mode guests in batches of up to 1024 instructions, pushes an entry for every emulated
//! write (not once per page) and checks the soft limit only between batches. Instrumented, a
//! guest that writes in a loop without exiting reaches its first full exit with 980-1024 of 1024
//! entries dirty, and when it finds all 1024 dirty KVM had already pushed past them: the next
//! exit shows KVM pushing at position 38 while the fetch index is at 0 (entries 0..37 were
//! overwritten, their writes lost). From then on KVM's push position and the fetch index
//! disagree: harvests collect nothing while the guest writes, until KVM comes round again.
//!
//! No detector from userspace can be shown to catch every such loss while a vCPU runs between
//! harvests. An entry is `{flags, slot, offset}` with no sequence number, and KVM's
//! `dirty_index` and `reset_index` are not visible, so an entry overwritten by a newer one at
//! the place the harvest expects looks like an ordinary push. Counting helps only while the two
//! indexes agree (a harvest that collects a whole ring at once); once they disagree, a loss can
//! leave a contiguous run shorter than the ring. Worse, a push that overwrites an entry already
//! collected but not yet reset (or the reset walk zeroing an entry pushed under it) stalls
//! KVM's `reset_index`: the pages of entries collected later are never write-protected again,
//! so the guest's next writes to them push nothing at all and leave no trace in the ring. The
//! check the binding had (full twice with nothing collected) missed such a run once in CI: the
//! migration "succeeded" with 5 pages lost.
//!
//! So the binding refuses rings (EOPNOTSUPP, "use the dirty bitmap") where `kvm_pvm` is loaded
//! (`KvmSlots::with_options`; a test-hooks build lets them through with `Options::faults`'s
//! `rings_on_pvm`, from `MEMVISOR_TEST_RINGS_ON_PVM` in the tests' environment, for the negative control and for tests whose guests exit after
//! every write and so cannot outrun the reserve). Elsewhere the old check stays as a last line:
//! a vCPU that is told the ring is full twice with no entry collected by anyone in between (it
//! cannot have pushed one without a harvest seeing it) returns [`Error::RingOverrun`]
//! (EOVERFLOW), and every later dirty-log call of the VM fails the same way, so a migration
//! restarts or falls back to the bitmap instead of copying a log it knows is incomplete, and the
//! vCPU does not spin on `KVM_EXIT_DIRTY_RING_FULL` with nothing to harvest (the hang this
//! project first saw on PVM).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{KVM_DIRTY_LOG_PAGE_OFFSET, kvm_dirty_gfn};
use kvm_ioctls::{VcpuFd, VmFd};
use vmm_sys_util::ioctl::ioctl;

use crate::error::{Error, Result};

/// `KVM_RESET_DIRTY_RINGS`, which kvm-ioctls does not wrap.
mod ioctls {
    // vmm-sys-util's macro makes a `pub fn` and takes no doc comment.
    #![allow(missing_docs)]
    const KVMIO: u32 = 0xAE;
    vmm_sys_util::ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);
}
use ioctls::KVM_RESET_DIRTY_RINGS;

/// The entry holds a dirty page (KVM sets it).
const GFN_DIRTY: u32 = 1;
/// The entry was collected (userspace sets it; KVM frees it at the reset).
const GFN_RESET: u32 = 2;

/// One vCPU's ring, mapped from its fd.
struct Ring {
    entries: NonNull<kvm_dirty_gfn>,
    count: u32,
    /// The next entry to look at (free-running; the slot is `fetch % count`).
    fetch: u32,
}

// SAFETY: the mapping is shared memory that KVM and this process access with atomics (flags)
// and plain loads after an acquire (slot, offset); it is valid from any thread, and only the
// holder of `Rings::inner`'s lock reads or writes it.
unsafe impl Send for Ring {}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the mapping was made by `Rings::add` with this length and is not used again.
        unsafe {
            libc::munmap(
                self.entries.as_ptr().cast(),
                self.count as usize * size_of::<kvm_dirty_gfn>(),
            )
        };
    }
}

struct Inner {
    rings: Vec<Ring>,
    /// Harvested, not yet reported: KVM slot number -> bitmap (bit `i` of word `i / 64` is the
    /// slot's page `i`).
    pending: BTreeMap<u32, Vec<u64>>,
    /// Entries marked `RESET` by any harvest so far, and how many of them a
    /// `KVM_RESET_DIRTY_RINGS` that returned has freed: while `marked > reset` another
    /// harvest's pages are in `pending` but not write-protected again, and a harvest must reset
    /// before they are reported.
    marked: u64,
    reset: u64,
}

/// Every vCPU's dirty ring of one VM, and the pages harvested from them.
pub struct Rings {
    vm: Arc<VmFd>,
    /// Entries per ring (a power of two).
    count: u32,
    inner: Mutex<Inner>,
    /// A vCPU found its ring overrun (module documentation): the log is incomplete.
    overrun: AtomicBool,
}

impl std::fmt::Debug for Rings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rings")
            .field("entries", &self.count)
            .field("rings", &self.lock().rings.len())
            .finish()
    }
}

impl Rings {
    pub(crate) fn new(vm: Arc<VmFd>, count: u32) -> Rings {
        Rings {
            vm,
            count,
            inner: Mutex::new(Inner {
                rings: Vec::new(),
                pending: BTreeMap::new(),
                marked: 0,
                reset: 0,
            }),
            overrun: AtomicBool::new(false),
        }
    }

    /// Entries per vCPU ring.
    pub fn entries(&self) -> u32 {
        self.count
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a vCPU found its ring overrun by KVM (entries lost; see the module
    /// documentation). Every dirty-log call fails from then on.
    pub fn overrun(&self) -> bool {
        self.overrun.load(Ordering::Acquire)
    }

    /// EOVERFLOW if a ring was overrun.
    pub(crate) fn check(&self) -> Result<()> {
        if self.overrun() {
            return Err(Error::RingOverrun {
                entries: self.count,
            });
        }
        Ok(())
    }

    pub(crate) fn mark_overrun(&self) {
        self.overrun.store(true, Ordering::Release);
    }

    /// Ring `index`'s fetch index: how many entries were collected from it so far.
    pub(crate) fn fetched(&self, index: usize) -> u32 {
        self.lock().rings.get(index).map_or(0, |r| r.fetch)
    }

    /// Maps `vcpu`'s ring and adds it to the harvest; returns its index.
    pub(crate) fn add(&self, vcpu: &VcpuFd) -> Result<usize> {
        let len = self.count as usize * size_of::<kvm_dirty_gfn>();
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as libc::off_t;
        // SAFETY: a new shared mapping of the vCPU fd's ring pages, at the offset and length
        // KVM documents for a ring of `count` entries; nothing else is at the address returned.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                vcpu.as_raw_fd(),
                KVM_DIRTY_LOG_PAGE_OFFSET as libc::off_t * page,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(Error::kvm(
                "mmap",
                format!("the vCPU's dirty ring ({} entries)", self.count),
                vmm_sys_util::errno::Error::last(),
            ));
        }
        let entries = NonNull::new(ptr.cast()).expect("mmap returned a non-null address");
        let mut inner = self.lock();
        inner.rings.push(Ring {
            entries,
            count: self.count,
            fetch: 0,
        });
        Ok(inner.rings.len() - 1)
    }

    /// Collects every ring's dirty entries into the pending bitmaps and resets the rings (see
    /// the module documentation); returns the entries collected.
    pub fn harvest(&self) -> Result<u64> {
        self.harvest_inner(false)
    }

    /// [`Rings::harvest`]; with `always_reset`, `KVM_RESET_DIRTY_RINGS` runs even when this
    /// call collected nothing (entries another thread marked may not be reset yet).
    pub(crate) fn harvest_inner(&self, always_reset: bool) -> Result<u64> {
        self.harvest_between(always_reset, || {})
    }

    /// TEST ONLY (feature `test-hooks`): a vCPU's full-ring harvest
    /// ([`Rings::harvest`], resetting even when it collected nothing) that runs `between` after
    /// it collected and marked the entries and before its `KVM_RESET_DIRTY_RINGS`: the window in
    /// which another thread's dirty-log call may run.
    #[cfg(feature = "test-hooks")]
    pub fn harvest_with(&self, between: impl FnOnce()) -> Result<u64> {
        self.harvest_between(true, between)
    }

    fn harvest_between(&self, always_reset: bool, between: impl FnOnce()) -> Result<u64> {
        let mut inner = self.lock();
        let Inner { rings, pending, .. } = &mut *inner;
        let mut collected = 0u64;
        for ring in rings.iter_mut() {
            loop {
                let i = (ring.fetch % ring.count) as usize;
                // SAFETY: i < count, inside the mapping this ring owns.
                let entry = unsafe { ring.entries.as_ptr().add(i) };
                // SAFETY: `flags` is a u32 in the mapping, accessed by KVM and us atomically
                // (the ACQ_REL ring's protocol); AtomicU32 has u32's layout.
                let flags = unsafe { AtomicU32::from_ptr(&raw mut (*entry).flags) };
                if flags.load(Ordering::Acquire) & GFN_DIRTY == 0 {
                    break;
                }
                // SAFETY: KVM wrote slot and offset before it set DIRTY with release; the
                // acquire above orders these reads after them. Plain reads of plain fields.
                let (slot, offset) = unsafe { ((*entry).slot, (*entry).offset) };
                let words = pending.entry(slot).or_default();
                let word = (offset / 64) as usize;
                if words.len() <= word {
                    words.resize(word + 1, 0);
                }
                words[word] |= 1 << (offset % 64);
                flags.store(GFN_RESET, Ordering::Release);
                ring.fetch = ring.fetch.wrapping_add(1);
                collected += 1;
            }
        }
        inner.marked += collected;
        let marked = inner.marked;
        // Entries marked here or by another harvest whose reset has not returned yet: reset
        // before any of their pages is reported.
        let unreset = marked > inner.reset;
        // The reset runs without the lock: KVM may wait in it for a running vCPU, and that vCPU,
        // its ring full, harvests too.
        drop(inner);
        between();
        if unreset || always_reset {
            // SAFETY: KVM_RESET_DIRTY_RINGS takes no argument; the fd is this VM's.
            let ret = unsafe { ioctl(self.vm.as_ref(), KVM_RESET_DIRTY_RINGS()) };
            if ret < 0 {
                return Err(Error::kvm(
                    "KVM_RESET_DIRTY_RINGS",
                    format!("after collecting {collected} entries"),
                    vmm_sys_util::errno::Error::last(),
                ));
            }
            // Every entry marked before this reset began is free again.
            let mut inner = self.lock();
            inner.reset = inner.reset.max(marked);
        }
        Ok(collected)
    }

    /// Takes KVM slot `kvm_slot`'s pending bits (after a harvest).
    pub(crate) fn take(&self, kvm_slot: u32) -> Vec<u64> {
        self.lock().pending.remove(&kvm_slot).unwrap_or_default()
    }
}
