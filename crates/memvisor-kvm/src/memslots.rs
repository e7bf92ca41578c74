//! A memvisor [`SlotTable`] mirrored into a KVM VM's memslots, and one dirty log per slot.
//!
//! [`KvmSlots`] owns the binding between one table and one VM fd. The table stays the source of
//! truth (device threads, cursors and `SlotTable::write` read it); KVM's memslots are a copy the
//! binding keeps equal to it.
//!
//! **Sync on call, not an observer.** The binding changes the table through its own
//! [`KvmSlots::insert`] / [`remove`](KvmSlots::remove) / [`set_flags`](KvmSlots::set_flags) /
//! [`update`](KvmSlots::update), each of which publishes the table change and then brings KVM
//! level with the table before it returns; [`KvmSlots::sync`] does the same for changes made
//! through another handle of the table. An observer pushed from inside `SlotTable::update` would
//! have made the core crate call out (into KVM, with KVM's errors) while it holds the table's
//! writer lock, and a KVM refusal could not be returned to the caller who made the change; it
//! would also have put a hook for this crate into the core crate. Syncing on call keeps the data
//! flowing one way (this crate reads the table's snapshots, the table knows nothing of KVM),
//! returns KVM's errors to the caller who made the change, and turns a batch of table changes
//! into one pass over KVM.
//!
//! **What KVM holds is known exactly.** The binding records, per memvisor slot, what it last
//! installed in KVM (KVM slot number, flags, and the `Slot` itself). A sync compares that with
//! the table's current snapshot and applies the difference in KVM's rules: a slot cannot be
//! resized, moved to another host address or have `KVM_MEM_READONLY` changed in place, so such a
//! slot is deleted first and created again (deletions all come before creations, so a slot may
//! take a guest range another one just left); a change of dirty logging alone is a flags-only
//! update of the same KVM slot. Each ioctl that succeeds is recorded at once, so when KVM refuses
//! one the record is still KVM's state: the error names the refused region and errno, and the
//! next sync picks up from there.
//!
//! **One refused slot stops nothing else.** A sync that meets a refusal still applies the rest
//! of its plan, and the dirty-log calls read every slot KVM holds as the table has it: only
//! the refused slot's `take_dirty_log` fails, with KVM's refusal naming it (and
//! `take_dirty_logs`, which cannot give that slot's log, fails before reading any). Until a
//! sync goes through, every sync and dirty-log call plans again and retries the refused ioctl.
//!
//! **Memory KVM maps stays mapped.** The record holds an `Arc` of every slot KVM has, so the
//! backing under a KVM memslot is not unmapped before KVM lets go of it, even when the table
//! dropped the slot long ago; dropping the binding deletes its memslots first (and leaks a
//! backing KVM would not delete rather than unmap it under the guest).
//!
//! **KVM slot numbers** are the binding's, not the table's ids: any memvisor id maps to a KVM
//! number below `KVM_CAP_NR_MEMSLOTS` (lowest freed first), and a batch that would hold more
//! slots than KVM takes is refused before it is published (ENOSPC).
//!
//! **Dirty log: one read-and-clear per slot.** [`KvmSlots::take_dirty_log`] returns one bitmap
//! (bit `i` of word `i / 64` is the slot's page `i`) that is the union of what the vCPUs wrote
//! (KVM's bitmap), what was written through the table (the slot's own memvisor log) and what
//! device models wrote through device spaces, in this order:
//! 1. `KVM_GET_DIRTY_LOG`: with `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` this reads without clearing
//!    or write-protecting anything;
//! 2. `KVM_CLEAR_DIRTY_LOG` of exactly the bits read, in chunks of at most
//!    [`Options::clear_chunk_pages`], skipping clean stretches: KVM write-protects those pages
//!    again, so a guest write after the clear dirties them again and is in the next round; a
//!    write between the read and the clear is either already in memory before the caller copies
//!    the page (the page was reported) or, to a page that read clean, sets a bit the clear does
//!    not touch (reported next round). Nothing is cleared that was not read;
//! 3. memvisor's own log of the slot, drained through its summary levels
//!    (`SlotTable::drain_dirty_log`: O(dirty words), no copy of the slot's whole bitmap), then
//!    the dirty bits of every device space added with [`KvmSlots::log_device_space`] over the
//!    slot's guest range (`DmaSpace::drain_dirty`: in-process device models' `dma_write`s);
//!    bits drained before a failing step are kept for the next call with KVM's;
//! 4. every page of a slot KVM deleted and re-created since the last call (a move, resize or
//!    read-only change of a logging slot): KVM's bitmap of the old memslot goes with it, and a
//!    vCPU may write between a last read and the delete, so the new slot reports all its pages
//!    once rather than risk missing one. Likewise every page of a logging slot replaced in
//!    place (removed and inserted again, even with an identical spec: KVM's memslot stays, but
//!    the table started the new slot a log of its own, and the old slot's table writes are in
//!    no log the table still reaches). And every page of a new logging slot over guest
//!    addresses that a logging slot deleted in the same sync held (a slot split in two, or
//!    moved to a new id): the old memslot's bitmap and the old slot's log went with it.
//!
//! Without the capability, step 1 reads and clears at once (KVM's classic behaviour) and step 2
//! is skipped. With [`Options::dirty_ring`] the vCPUs' pages come from KVM's per-vCPU dirty
//! rings instead of the bitmap (the `ring` module: harvest, then `KVM_RESET_DIRTY_RINGS`) behind
//! the same call; on PVM, which overruns rings, the binding refuses them (EOPNOTSUPP). Either
//! way the caller copies the reported pages after the call returns.
//!
//! This file is long because the sync (the plan from one table snapshot to KVM's memslots) and
//! the dirty log share one state under one lock, whose rules (a slot in step, a refused slot,
//! a replaced one) both halves must read the same way; splitting them would spread those
//! rules over two files.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use kvm_bindings::{
    KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY,
    kvm_clear_dirty_log, kvm_enable_cap, kvm_userspace_memory_region, kvm_userspace_memory_region2,
};
use kvm_ioctls::{Cap, VmFd};
use memvisor::slots::Snapshot;
use memvisor::slots::{Slot, SlotEdit};
use memvisor::{DmaSpace, Gpa, Iova, Range, SlotCursor, SlotFlags, SlotId, SlotSpec, SlotTable};
use vmm_sys_util::ioctl::ioctl_with_ref;

use crate::error::{Error, Result};
use crate::ring::Rings;

/// `KVM_CLEAR_DIRTY_LOG`, which kvm-ioctls does not wrap.
mod ioctls {
    // vmm-sys-util's macro makes a `pub fn` and takes no doc comment.
    #![allow(missing_docs)]
    const KVMIO: u32 = 0xAE;
    vmm_sys_util::ioctl_iowr_nr!(
        KVM_CLEAR_DIRTY_LOG,
        KVMIO,
        0xc0,
        kvm_bindings::kvm_clear_dirty_log
    );
}
use ioctls::KVM_CLEAR_DIRTY_LOG;

const PAGE_SHIFT: u32 = 12;

/// What the VM's KVM offers, as probed when the binding is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvmCaps {
    /// `KVM_CAP_NR_MEMSLOTS`: KVM slot numbers are `0..nr_memslots`.
    pub nr_memslots: u32,
    /// `KVM_CAP_USER_MEMORY2`: `KVM_SET_USER_MEMORY_REGION2` is there.
    pub region2: bool,
    /// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`: the dirty log can be read and cleared apart.
    pub manual_protect: bool,
    /// `KVM_CAP_READONLY_MEM`: read-only slots.
    pub readonly: bool,
    /// `KVM_CAP_DIRTY_LOG_RING_ACQ_REL`: the largest dirty ring, in bytes (0: none).
    pub dirty_ring_bytes: u32,
}

impl KvmCaps {
    /// Probes `vm`.
    pub fn probe(vm: &VmFd) -> KvmCaps {
        KvmCaps {
            nr_memslots: vm.check_extension_int(Cap::NrMemslots).max(0) as u32,
            region2: vm.check_extension(Cap::UserMemory2),
            manual_protect: vm.check_extension_raw(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2.into()) > 0,
            readonly: vm.check_extension(Cap::ReadonlyMem),
            dirty_ring_bytes: vm
                .check_extension_raw(KVM_CAP_DIRTY_LOG_RING_ACQ_REL.into())
                .max(0) as u32,
        }
    }
}

/// How the binding uses KVM.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// Use `KVM_SET_USER_MEMORY_REGION2` where KVM offers it (`false`: always v1).
    pub region2: bool,
    /// Turn on `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` where KVM offers it (`false`: the classic
    /// `KVM_GET_DIRTY_LOG` that clears as it reads).
    pub manual_protect: bool,
    /// Pages per `KVM_CLEAR_DIRTY_LOG` call, a multiple of 64 (rounded down, at least 64): each
    /// call holds KVM's MMU lock for its pages only.
    pub clear_chunk_pages: u64,
    /// Take the vCPUs' dirty pages from per-vCPU dirty rings of this many entries (a power of
    /// two; `KVM_CAP_DIRTY_LOG_RING_ACQ_REL`) instead of KVM's bitmaps. Must be set before the
    /// VM has vCPUs: bind first, then create them with [`Vcpu::new`](crate::Vcpu::new).
    /// Refused with EOPNOTSUPP where KVM lacks the capability and on a KVM known to overrun
    /// rings (PVM: see the `ring` module); use the bitmap (`None`) there. A ring larger than
    /// KVM takes is refused with E2BIG, as KVM does; one below a page or of no power of two
    /// with EINVAL.
    pub dirty_ring: Option<u32>,
    /// TEST ONLY (feature `test-hooks`): the faults the binding injects
    /// ([`Faults::rings_on_pvm`](memvisor::faults::Faults::rings_on_pvm) lets dirty rings
    /// through on PVM). Off by default.
    #[cfg(feature = "test-hooks")]
    pub faults: memvisor::faults::Faults,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            region2: true,
            manual_protect: true,
            // 256 MiB of 4 KiB pages per call.
            clear_chunk_pages: 1 << 16,
            dirty_ring: None,
            #[cfg(feature = "test-hooks")]
            faults: memvisor::faults::Faults::default(),
        }
    }
}

/// What a sync changed in KVM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Memslots created (new slots, and the second half of a re-creation).
    pub created: u32,
    /// Memslots deleted (removed slots, and the first half of a re-creation).
    pub deleted: u32,
    /// Flags-only updates (dirty logging turned on or off).
    pub flags_changed: u32,
}

/// One slot's merged dirty log, from [`KvmSlots::take_dirty_logs`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SlotLog {
    /// The memvisor slot.
    pub slot: SlotId,
    /// Its first guest address: bit `i` is the page at `gpa + i * 4096`.
    pub gpa: Gpa,
    /// Bit `i` of word `i / 64` set: page `i` was written.
    pub words: Vec<u64>,
}

/// What [`KvmSlots::take_dirty_logs`] read: every logging slot's log that could be given, and
/// the refusal of each logging slot KVM does not hold as the table has it (whose log could
/// not be read: a migration is not complete while any is here).
#[derive(Debug, Default)]
pub struct DirtyLogs {
    /// The logs read and cleared, in slot-id order.
    pub logs: Vec<SlotLog>,
    /// One error per logging slot KVM refused ([`Error::Memslot`] naming the slot, or
    /// [`Error::NotInKvm`]).
    pub refused: Vec<Error>,
}

/// A memslot KVM holds, as the binding installed it.
struct Installed {
    kvm_slot: u32,
    flags: u32,
    /// Keeps the backing mapped while KVM maps it.
    slot: Arc<Slot>,
}

#[derive(Default)]
struct State {
    installed: BTreeMap<SlotId, Installed>,
    /// KVM numbers below `next` not in use; `next` and up were never used.
    freed: BTreeSet<u32>,
    next: u32,
    /// Dirty bits of KVM slots deleted to be re-created, not yet reported.
    carried: BTreeMap<SlotId, Vec<u64>>,
    /// The table generation KVM last equalled in full.
    synced: Option<u64>,
    /// Device spaces (IOVA = guest physical) whose dirty tracking joins every slot's log.
    devices: Vec<DmaSpace>,
}

/// A [`SlotTable`] bound to a KVM VM: see the module documentation.
pub struct KvmSlots {
    vm: Arc<VmFd>,
    table: SlotTable,
    caps: KvmCaps,
    options: Options,
    /// Whether manual protect is on for this VM.
    manual: bool,
    /// The vCPUs' dirty rings, when they replace KVM's bitmaps.
    rings: Option<Arc<Rings>>,
    state: Mutex<State>,
}

impl fmt::Debug for KvmSlots {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvmSlots")
            .field("caps", &self.caps)
            .field("manual_protect", &self.manual)
            .field("installed", &self.lock().installed.len())
            .finish()
    }
}

fn kvm_flags(slot: &Slot) -> u32 {
    let mut flags = 0;
    if slot.flags().contains(SlotFlags::LOG_DIRTY) {
        flags |= KVM_MEM_LOG_DIRTY_PAGES;
    }
    if slot.flags().contains(SlotFlags::READ_ONLY) {
        flags |= KVM_MEM_READONLY;
    }
    flags
}

/// Whether KVM sees both slots at the same guest range and host memory.
fn same_place(a: &Slot, b: &Slot) -> bool {
    a.range() == b.range() && a.hva() == b.hva() && Arc::ptr_eq(a.backing(), b.backing())
}

fn pages_of(slot: &Slot) -> u64 {
    slot.range().len() >> PAGE_SHIFT
}

/// ORs `src` into `dst`, growing `dst` if it is shorter.
fn or_into(dst: &mut Vec<u64>, src: &[u64]) {
    if dst.len() < src.len() {
        dst.resize(src.len(), 0);
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d |= s;
    }
}

/// ORs `bits` (bit `b` is page `page + b`; `page` need not be a multiple of 64) into `dst`,
/// dropping pages past its end.
fn or_bits(dst: &mut [u64], page: u64, bits: u64) {
    let (word, shift) = ((page / 64) as usize, page % 64);
    if let Some(d) = dst.get_mut(word) {
        *d |= bits << shift;
    }
    if shift != 0 {
        if let Some(d) = dst.get_mut(word + 1) {
            *d |= bits >> (64 - shift);
        }
    }
}

/// Every page of a slot of `pages` pages marked.
fn all_dirty(pages: u64) -> Vec<u64> {
    let mut words = vec![u64::MAX; pages.div_ceil(64) as usize];
    if pages % 64 != 0 {
        if let Some(last) = words.last_mut() {
            *last = (1u64 << (pages % 64)) - 1;
        }
    }
    words
}

/// What one pass of a sync did: its report, KVM's refusals in the order met, and the table
/// snapshot it brought KVM towards (`None` when nothing had changed).
struct Synced {
    report: SyncReport,
    errors: Vec<Error>,
    snapshot: Option<Arc<Snapshot>>,
}

/// Whether KVM holds slot `id` exactly as `snapshot` has it (or neither has it): its log can be
/// read whatever KVM refused of other slots.
fn in_step(state: &State, snapshot: Option<&Snapshot>, id: SlotId) -> bool {
    let Some(snapshot) = snapshot else {
        return true;
    };
    match (snapshot.slot(id), state.installed.get(&id)) {
        (Some(now), Some(installed)) => Arc::ptr_eq(now, &installed.slot),
        (None, None) => true,
        _ => false,
    }
}

/// The refusal among `errors` that names slot `id`, else [`Error::NotInKvm`].
fn refusal_of(errors: Vec<Error>, id: SlotId) -> Error {
    errors
        .into_iter()
        .find(|e| e.slot() == Some(id))
        .unwrap_or(Error::NotInKvm { slot: id })
}

impl KvmSlots {
    /// Binds `table` to `vm` with the default [`Options`] and installs its slots.
    pub fn new(vm: Arc<VmFd>, table: SlotTable) -> Result<KvmSlots> {
        Self::with_options(vm, table, Options::default())
    }

    /// Binds `table` to `vm` and installs its slots. Turns on manual dirty-log protection first
    /// when asked and offered (KVM takes it only before the VM has memslots with dirty logging).
    pub fn with_options(vm: Arc<VmFd>, table: SlotTable, options: Options) -> Result<KvmSlots> {
        let caps = KvmCaps::probe(&vm);
        let rings = match options.dirty_ring {
            None => None,
            Some(entries) => Some(Arc::new(enable_rings(&vm, &caps, entries, &options)?)),
        };
        // With rings KVM keeps no bitmap: there is nothing to protect by hand.
        let manual = options.manual_protect && caps.manual_protect && rings.is_none();
        if manual {
            let cap = kvm_enable_cap {
                cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                args: [KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE.into(), 0, 0, 0],
                ..Default::default()
            };
            vm.enable_cap(&cap).map_err(|e| {
                Error::kvm(
                    "KVM_ENABLE_CAP",
                    "KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 with MANUAL_PROTECT_ENABLE",
                    e,
                )
            })?;
        }
        let options = Options {
            clear_chunk_pages: (options.clear_chunk_pages / 64).max(1) * 64,
            ..options
        };
        let slots = KvmSlots {
            vm,
            table,
            caps,
            options,
            manual,
            rings,
            state: Mutex::new(State::default()),
        };
        slots.sync()?;
        Ok(slots)
    }

    /// The table (clone it for device threads; changes through it reach KVM at the next
    /// [`KvmSlots::sync`] or change through the binding).
    pub fn table(&self) -> &SlotTable {
        &self.table
    }

    /// The VM fd.
    pub fn vm(&self) -> &Arc<VmFd> {
        &self.vm
    }

    /// What KVM offers.
    pub fn caps(&self) -> KvmCaps {
        self.caps
    }

    /// Whether the dirty log is read and cleared apart (manual protect is on).
    pub fn manual_protect(&self) -> bool {
        self.manual
    }

    /// The vCPUs' dirty rings, when [`Options::dirty_ring`] turned them on.
    pub fn rings(&self) -> Option<&Arc<Rings>> {
        self.rings.as_ref()
    }

    /// Whether memslots go through `KVM_SET_USER_MEMORY_REGION2`.
    pub fn uses_region2(&self) -> bool {
        self.options.region2 && self.caps.region2
    }

    /// A cursor over the table for one vCPU or device thread.
    pub fn cursor(&self) -> SlotCursor {
        self.table.cursor()
    }

    /// The KVM slot number memvisor slot `id` is installed as, if KVM holds it.
    pub fn kvm_slot(&self, id: SlotId) -> Option<u32> {
        self.lock().installed.get(&id).map(|i| i.kvm_slot)
    }

    /// Adds a device space to the dirty log: a [`DmaSpace`] whose IOVAs are guest physical
    /// addresses (no vIOMMU; e.g. mapped with `DmaSpace::map_guest` over this table, one
    /// mapping per slot) through which in-process device models `dma_write` into guest memory.
    /// From now on every dirty-log call also drains the space's dirty bits over the slot's
    /// guest range (`DmaSpace::drain_dirty`, after KVM's log is cleared), so one call reports
    /// the vCPUs', the table's and the devices' writes. Start the space's dirty tracking
    /// first; a drain error (tracking off, a mapping that crosses a slot's edge) is returned
    /// by the dirty-log call, with KVM's bits kept for the next one.
    pub fn log_device_space(&self, space: DmaSpace) {
        self.lock().devices.push(space);
    }

    /// Number of memslots KVM holds for this table.
    pub fn installed(&self) -> usize {
        self.lock().installed.len()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is consistent after every ioctl, so a panic elsewhere does not spoil it.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies a batch of table changes (see `SlotTable::update`) and installs them in KVM. A
    /// batch that would leave more slots than KVM has memslots is refused (ENOSPC) before
    /// anything is published; a KVM refusal after publishing is returned as KVM gave it, with
    /// KVM left as the error says (call [`KvmSlots::sync`] to retry).
    pub fn update<T>(&self, edit: impl FnOnce(&mut SlotEdit) -> memvisor::Result<T>) -> Result<T> {
        let mut state = self.lock();
        let limit = self.caps.nr_memslots;
        let value = self.table.update(|e| {
            let value = edit(e)?;
            if e.len() as u64 > u64::from(limit) {
                return Err(memvisor::Error::NoSpace {
                    what: "KVM memslots",
                    count: e.len() as u64,
                    limit: limit.into(),
                    hint: "KVM_CAP_NR_MEMSLOTS bounds the slots of one VM; remove slots first",
                });
            }
            Ok(value)
        })?;
        self.sync_locked(&mut state)?;
        Ok(value)
    }

    /// Inserts a slot into the table and KVM.
    pub fn insert(&self, spec: SlotSpec) -> Result<()> {
        self.update(|e| e.insert(spec))
    }

    /// Removes a slot from the table and KVM.
    pub fn remove(&self, id: SlotId) -> Result<()> {
        self.update(|e| e.remove(id).map(drop))
    }

    /// Changes a slot's flags in the table and KVM.
    pub fn set_flags(&self, id: SlotId, flags: SlotFlags) -> Result<()> {
        self.update(|e| e.set_flags(id, flags))
    }

    /// Brings KVM level with the table's current snapshot.
    pub fn sync(&self) -> Result<SyncReport> {
        let mut state = self.lock();
        self.sync_locked(&mut state)
    }

    /// [`KvmSlots::sync_all`], with its first refusal as the error.
    fn sync_locked(&self, state: &mut State) -> Result<SyncReport> {
        let synced = self.sync_all(state);
        match synced.errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(synced.report),
        }
    }

    /// Syncs before reading slot `id`'s log: KVM's refusal of another slot does not stop it.
    /// Fails only when KVM does not hold `id` as the table has it, with the refusal that names
    /// `id` (or [`Error::NotInKvm`] if none does, e.g. the table changed meanwhile).
    fn sync_for(&self, state: &mut State, id: SlotId) -> Result<()> {
        let synced = self.sync_all(state);
        if synced.errors.is_empty() || in_step(state, synced.snapshot.as_deref(), id) {
            return Ok(());
        }
        Err(refusal_of(synced.errors, id))
    }

    /// Brings KVM level with the table's current snapshot as far as KVM lets it: a refused
    /// ioctl is recorded and the rest of the plan still applied, so one slot KVM refuses does
    /// not keep the others out (nor their logs: see `sync_for`). Until a sync has no refusal,
    /// every call plans again (and retries what KVM refused).
    fn sync_all(&self, state: &mut State) -> Synced {
        let mut report = SyncReport::default();
        let mut errors = Vec::new();
        // Nothing changed since the last full sync: one atomic load, O(1) whatever the slot
        // count (every dirty-log call syncs first).
        if state.synced == Some(self.table.generation()) {
            return Synced {
                report,
                errors,
                snapshot: None,
            };
        }
        let snapshot = self.table.snapshot();
        if state.synced == Some(snapshot.generation()) {
            return Synced {
                report,
                errors,
                snapshot: Some(snapshot),
            };
        }
        let current: BTreeMap<SlotId, &Arc<Slot>> = snapshot.slots().map(|s| (s.id(), s)).collect();
        // The plan: what to delete (and whether to keep its KVM dirty bits, and how), what to
        // update in place, what to create.
        let mut delete: Vec<(SlotId, bool)> = Vec::new();
        let mut flags_only: Vec<(Arc<Slot>, bool)> = Vec::new();
        let mut create: Vec<Arc<Slot>> = Vec::new();
        // Guest ranges of the logging memslots this sync deletes (removed or re-created): KVM
        // drops each one's bitmap with it, and the table the log of a slot it removed.
        let mut left: Vec<Range<Gpa>> = Vec::new();
        for (id, old) in &state.installed {
            let old_logs = old.flags & KVM_MEM_LOG_DIRTY_PAGES != 0;
            let Some(&new) = current.get(id) else {
                if old_logs {
                    left.push(old.slot.range());
                }
                delete.push((*id, false));
                continue;
            };
            if Arc::ptr_eq(new, &old.slot) {
                continue;
            }
            let new_flags = kvm_flags(new);
            let logs = new_flags & old.flags & KVM_MEM_LOG_DIRTY_PAGES != 0;
            if same_place(&old.slot, new) && (new_flags ^ old.flags) & KVM_MEM_READONLY == 0 {
                // Same memory, same read-only-ness: at most dirty logging changed, and KVM's
                // memslot (with its bitmap) stays. But a slot that logs before and after and
                // does not share the old slot's memvisor log was replaced (removed and
                // inserted again, maybe with an identical spec): the table started it a
                // fresh log, and pages written through the table before the replacement are
                // in the old slot's log, which the table no longer reaches. It is reported
                // whole once, as a re-created slot is (module documentation, step 4), rather
                // than by carrying a log over: a carried log is right only for the same
                // memory, and a replacement is where a caller may have changed what is behind
                // the slot (another backing with the same spec values takes the re-create
                // path below, and is reported whole there); a writer holding an older
                // snapshot may also still mark the old log after this sync. Reporting every
                // page is right whatever the memory is; it costs one extra copy of the slot.
                let replaced = logs && !old.slot.shares_dirty_log(new);
                flags_only.push((new.clone(), replaced));
            } else {
                // A moved, resized, re-backed or read-only-toggled slot: delete, re-create.
                // When it logs before and after, all its pages are reported once (module
                // documentation, step 4).
                if old_logs {
                    left.push(old.slot.range());
                }
                delete.push((*id, logs));
                create.push(new.clone());
            }
        }
        for (id, slot) in &current {
            if !state.installed.contains_key(id) {
                // A new logging slot over guest addresses a logging memslot deleted here held
                // (a slot split, or moved to a new id): what was written there since the last
                // read is in no log any more, so it reports all its pages once (step 4).
                if kvm_flags(slot) & KVM_MEM_LOG_DIRTY_PAGES != 0
                    && left.iter().any(|r| r.overlaps(&slot.range()))
                {
                    or_into(
                        state.carried.entry(*id).or_default(),
                        &all_dirty(pages_of(slot)),
                    );
                }
                create.push((*slot).clone());
            }
        }

        for (id, all_pages) in delete {
            let old = &state.installed[&id];
            if let (Some(rings), true) = (&self.rings, old.flags & KVM_MEM_LOG_DIRTY_PAGES != 0) {
                // Entries for this KVM number must not outlive the memslot.
                if let Err(e) = rings.harvest() {
                    errors.push(e);
                    continue;
                }
                rings.take(old.kvm_slot);
            }
            if all_pages {
                let new_pages = pages_of(current[&id]);
                state.carried.insert(id, all_dirty(new_pages));
            } else {
                // A slot that no longer logs (or is gone) has nothing left to report.
                state.carried.remove(&id);
            }
            if let Err(e) = self.set_region(id, old.kvm_slot, &old.slot, 0, 0) {
                // Still installed: its re-creation below is skipped.
                errors.push(e);
                continue;
            }
            let old = state.installed.remove(&id).expect("planned from installed");
            if old.kvm_slot + 1 == state.next {
                state.next -= 1;
            } else {
                state.freed.insert(old.kvm_slot);
            }
            report.deleted += 1;
            // `old.slot` drops here, after KVM let go of its memory.
        }
        for (new, replaced) in flags_only {
            let id = new.id();
            let flags = kvm_flags(&new);
            let old = state
                .installed
                .get_mut(&id)
                .expect("planned from installed");
            if flags != old.flags {
                if let Err(e) = self.set_region(id, old.kvm_slot, &new, new.range().len(), flags) {
                    errors.push(e);
                    continue;
                }
                if flags & KVM_MEM_LOG_DIRTY_PAGES == 0 {
                    state.carried.remove(&id);
                }
                report.flags_changed += 1;
            }
            if replaced {
                or_into(
                    state.carried.entry(id).or_default(),
                    &all_dirty(pages_of(&new)),
                );
            }
            old.flags = flags;
            old.slot = new;
        }
        for new in create {
            let id = new.id();
            if state.installed.contains_key(&id) {
                // KVM refused to delete the old memslot (an error above): it is still there.
                continue;
            }
            let kvm_slot = match state.freed.pop_first() {
                Some(n) => n,
                None if state.next < self.caps.nr_memslots => {
                    state.next += 1;
                    state.next - 1
                }
                None => {
                    errors.push(Error::NoMemslot {
                        slot: id,
                        used: state.installed.len() as u32,
                        limit: self.caps.nr_memslots,
                    });
                    continue;
                }
            };
            let flags = kvm_flags(&new);
            if let Err(e) = self.set_region(id, kvm_slot, &new, new.range().len(), flags) {
                state.freed.insert(kvm_slot);
                errors.push(e);
                continue;
            }
            state.installed.insert(
                id,
                Installed {
                    kvm_slot,
                    flags,
                    slot: new,
                },
            );
            report.created += 1;
        }
        if errors.is_empty() {
            state.synced = Some(snapshot.generation());
        }
        Synced {
            report,
            errors,
            snapshot: Some(snapshot),
        }
    }

    /// One `KVM_SET_USER_MEMORY_REGION(2)`: `size` 0 deletes.
    fn set_region(
        &self,
        id: SlotId,
        kvm_slot: u32,
        slot: &Slot,
        size: u64,
        flags: u32,
    ) -> Result<()> {
        let (gpa, hva) = (slot.range().start().0, slot.hva().0);
        let (op, result) = if self.uses_region2() {
            let region = kvm_userspace_memory_region2 {
                slot: kvm_slot,
                flags,
                guest_phys_addr: gpa,
                memory_size: size,
                userspace_addr: hva,
                ..Default::default()
            };
            // SAFETY: `hva..hva + size` is the slot's window of its backing, mapped for as long
            // as the `Arc<Slot>` the binding records for this KVM slot lives; the record is
            // dropped only after KVM deleted the slot (or, when it would not, leaked). Slots of
            // one table never overlap, and the KVM slot numbers are the binding's own.
            ("KVM_SET_USER_MEMORY_REGION2", unsafe {
                self.vm.set_user_memory_region2(region)
            })
        } else {
            let region = kvm_userspace_memory_region {
                slot: kvm_slot,
                flags,
                guest_phys_addr: gpa,
                memory_size: size,
                userspace_addr: hva,
            };
            // SAFETY: as above.
            ("KVM_SET_USER_MEMORY_REGION", unsafe {
                self.vm.set_user_memory_region(region)
            })
        };
        result.map_err(|e| Error::Memslot {
            op,
            slot: id,
            kvm_slot,
            gpa,
            size,
            hva,
            flags,
            errno: e.errno(),
        })
    }

    /// Slot `id`'s merged dirty log, read and cleared: see the module documentation. ENOENT if
    /// the slot does not log dirty pages (or is not there).
    pub fn take_dirty_log(&self, id: SlotId) -> Result<Vec<u64>> {
        let mut state = self.lock();
        self.sync_for(&mut state, id)?;
        self.take_locked(&mut state, id, || {})
    }

    /// TEST ONLY (feature `test-hooks`): [`KvmSlots::take_dirty_log`], running `between` after
    /// KVM's bitmap was read and before it is cleared, for tests that write in that window
    /// (such a write must be reported by this call or the next).
    #[cfg(feature = "test-hooks")]
    pub fn take_dirty_log_with(&self, id: SlotId, between: impl FnOnce()) -> Result<Vec<u64>> {
        let mut state = self.lock();
        self.sync_for(&mut state, id)?;
        self.take_locked(&mut state, id, between)
    }

    /// Every logging slot's merged dirty log, one read-and-clear each, in slot-id order. A
    /// logging slot KVM refused cannot give its log: its refusal is in
    /// [`DirtyLogs::refused`] and every other slot's log is still read, so one bad slot does
    /// not stop the others' logging. Fails only if reading a log fails (the logs read before it
    /// are kept for the next call).
    pub fn take_dirty_logs(&self) -> Result<DirtyLogs> {
        let mut state = self.lock();
        let synced = self.sync_all(&mut state);
        let snapshot = synced.snapshot.as_deref();
        let mut refused = Vec::new();
        if let (false, Some(snapshot)) = (synced.errors.is_empty(), snapshot) {
            let ids: Vec<SlotId> = snapshot
                .slots()
                .filter(|s| {
                    s.flags().contains(SlotFlags::LOG_DIRTY)
                        && !in_step(&state, Some(snapshot), s.id())
                })
                .map(|s| s.id())
                .collect();
            let mut errors = synced.errors;
            for id in ids {
                let at = errors.iter().position(|e| e.slot() == Some(id));
                refused.push(match at {
                    Some(i) => errors.swap_remove(i),
                    None => Error::NotInKvm { slot: id },
                });
            }
        }
        // KVM's logging slots, but for one the table dropped and KVM would not delete.
        let logging: Vec<(SlotId, Gpa)> = state
            .installed
            .iter()
            .filter(|(id, i)| {
                i.flags & KVM_MEM_LOG_DIRTY_PAGES != 0 && in_step(&state, snapshot, **id)
            })
            .map(|(id, i)| (*id, i.slot.range().start()))
            .collect();
        let mut logs = Vec::with_capacity(logging.len());
        for (slot, gpa) in logging {
            match self.take_locked(&mut state, slot, || {}) {
                Ok(words) => logs.push(SlotLog { slot, gpa, words }),
                Err(e) => {
                    // Read and cleared already: kept for the next call, not dropped.
                    for log in logs {
                        or_into(state.carried.entry(log.slot).or_default(), &log.words);
                    }
                    return Err(e);
                }
            }
        }
        Ok(DirtyLogs { logs, refused })
    }

    fn take_locked(
        &self,
        state: &mut State,
        id: SlotId,
        between: impl FnOnce(),
    ) -> Result<Vec<u64>> {
        let Some(installed) = state.installed.get(&id) else {
            return Err(if self.table.snapshot().slot(id).is_some() {
                Error::NotInKvm { slot: id }
            } else {
                memvisor::Error::NotFound {
                    what: "slot",
                    id: id.into(),
                }
                .into()
            });
        };
        if installed.flags & KVM_MEM_LOG_DIRTY_PAGES == 0 {
            return Err(memvisor::Error::NotFound {
                what: "dirty log of slot",
                id: id.into(),
            }
            .into());
        }
        let kvm_slot = installed.kvm_slot;
        let pages = pages_of(&installed.slot);
        let mut words = match &self.rings {
            Some(rings) => {
                rings.check()?;
                rings.harvest()?;
                rings.take(kvm_slot)
            }
            None => self
                .vm
                .get_dirty_log(kvm_slot, installed.slot.range().len() as usize)
                .map_err(|e| {
                    Error::kvm(
                        "KVM_GET_DIRTY_LOG",
                        format!("slot {id} (KVM {kvm_slot})"),
                        e,
                    )
                })?,
        };
        between();
        // From here on the bits read are ours to report: if a later step fails they are kept
        // for the next call rather than lost.
        words.resize(pages.div_ceil(64) as usize, 0);
        let gpa = installed.slot.range().start();
        // memvisor's own log and the device spaces', drained sparsely (O(dirty words)); what
        // was drained before an error is kept with KVM's bits.
        let mut own = Vec::new();
        let rest = (|| {
            if self.manual {
                self.clear(id, kvm_slot, pages, &words)?;
            }
            self.table
                .drain_dirty_log(id, |page, bits| own.push((page, bits)))?;
            for space in state.devices.iter() {
                space.drain_dirty(
                    Iova(gpa.0),
                    pages << PAGE_SHIFT,
                    1 << PAGE_SHIFT,
                    |page, bits| own.push((page, bits)),
                )?;
            }
            Ok::<_, Error>(())
        })();
        for (page, bits) in own {
            or_bits(&mut words, page, bits);
        }
        match rest {
            Ok(()) => {
                if let Some(carried) = state.carried.remove(&id) {
                    or_into(&mut words, &carried);
                }
                words.truncate(pages.div_ceil(64) as usize);
                Ok(words)
            }
            Err(e) => {
                or_into(state.carried.entry(id).or_default(), &words);
                Err(e)
            }
        }
    }

    /// `KVM_CLEAR_DIRTY_LOG` of exactly the bits in `words`, a chunk at a time, skipping clean
    /// stretches. KVM wants `first_page` a multiple of 64 and `num_pages` one too unless the
    /// chunk ends at the slot's end.
    fn clear(&self, id: SlotId, kvm_slot: u32, pages: u64, words: &[u64]) -> Result<()> {
        let per_chunk = (self.options.clear_chunk_pages / 64) as usize;
        let mut i = 0;
        while i < words.len() {
            if words[i] == 0 {
                i += 1;
                continue;
            }
            let start = i;
            let mut end = (start + per_chunk).min(words.len());
            while words[end - 1] == 0 {
                end -= 1;
            }
            let first_page = start as u64 * 64;
            let num_pages = (end as u64 * 64).min(pages) - first_page;
            let clear = kvm_clear_dirty_log {
                slot: kvm_slot,
                num_pages: num_pages as u32,
                first_page,
                __bindgen_anon_1: kvm_bindings::kvm_clear_dirty_log__bindgen_ty_1 {
                    dirty_bitmap: words[start..].as_ptr() as *mut libc::c_void,
                },
            };
            // SAFETY: the bitmap pointer covers `end - start` words of `words`, at least the
            // `num_pages` bits KVM reads; KVM only reads it. The struct is KVM's layout.
            let ret = unsafe { ioctl_with_ref(self.vm.as_ref(), KVM_CLEAR_DIRTY_LOG(), &clear) };
            if ret != 0 {
                return Err(Error::kvm(
                    "KVM_CLEAR_DIRTY_LOG",
                    format!(
                        "slot {id} (KVM {kvm_slot}), pages {first_page:#x}+{num_pages:#x} of {pages:#x}"
                    ),
                    vmm_sys_util::errno::Error::last(),
                ));
            }
            i = end;
        }
        Ok(())
    }
}

impl Drop for KvmSlots {
    /// Deletes the binding's memslots, so no KVM memslot outlives the memory under it; a slot KVM
    /// refuses to delete keeps its backing mapped forever (leaked) rather than unmapped under
    /// the guest.
    fn drop(&mut self) {
        let state = std::mem::take(&mut *self.lock());
        for (id, installed) in state.installed {
            if self
                .set_region(id, installed.kvm_slot, &installed.slot, 0, 0)
                .is_err()
            {
                std::mem::forget(installed.slot);
            }
        }
    }
}

/// Where this host's KVM is known to overrun dirty rings (the `ring` module), the proof of it:
/// PVM's module, `/sys/module/kvm_pvm`. Erring on the safe side: with PVM loaded at all, rings
/// are refused (the bitmap works on every KVM).
fn overrunning_kvm(options: &Options) -> Option<&'static str> {
    const PVM: &str = "/sys/module/kvm_pvm";
    #[cfg(feature = "test-hooks")]
    if options.faults.rings_on_pvm {
        // TEST ONLY: the negative control that shows the refusal matters, and the ring tests
        // whose guests exit after every write (they cannot push past the ring's reserve).
        return None;
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = options;
    std::path::Path::new(PVM).exists().then_some(PVM)
}

/// Turns on KVM's dirty rings of `entries` entries per vCPU: refused (EOPNOTSUPP) without the
/// capability or on a KVM known to overrun them.
fn enable_rings(vm: &Arc<VmFd>, caps: &KvmCaps, entries: u32, options: &Options) -> Result<Rings> {
    let bytes = u64::from(entries) * size_of::<kvm_bindings::kvm_dirty_gfn>() as u64;
    if caps.dirty_ring_bytes == 0 {
        return Err(memvisor::Error::Unsupported {
            what: "per-vCPU dirty rings",
            why: "KVM does not offer KVM_CAP_DIRTY_LOG_RING_ACQ_REL here; use the bitmap".into(),
        }
        .into());
    }
    if let Some(module) = overrunning_kvm(options) {
        return Err(memvisor::Error::Unsupported {
            what: "per-vCPU dirty rings",
            why: format!(
                "this host's KVM is PVM ({module} exists), which overruns dirty rings: it checks \
                 a ring's soft limit only between batches of emulated instructions, so a guest \
                 that writes without exiting overwrites entries, and the lost writes cannot be \
                 detected reliably; use the dirty bitmap"
            ),
        }
        .into());
    }
    if !entries.is_power_of_two() || bytes < 4096 {
        return Err(memvisor::Error::Invalid(format!(
            "dirty ring of {entries} entries ({bytes} bytes): KVM takes a power of two from 4096 \
             to {} bytes (256 to {} entries)",
            caps.dirty_ring_bytes,
            caps.dirty_ring_bytes / 16
        ))
        .into());
    }
    if bytes > u64::from(caps.dirty_ring_bytes) {
        // E2BIG, as kvm_vm_ioctl_enable_dirty_log_ring answers (EINVAL is for the two above).
        return Err(Error::RingTooBig {
            entries,
            bytes,
            max_bytes: caps.dirty_ring_bytes,
        });
    }
    let cap = kvm_enable_cap {
        cap: KVM_CAP_DIRTY_LOG_RING_ACQ_REL,
        args: [bytes, 0, 0, 0],
        ..Default::default()
    };
    vm.enable_cap(&cap).map_err(|e| {
        Error::kvm(
            "KVM_ENABLE_CAP",
            format!("KVM_CAP_DIRTY_LOG_RING_ACQ_REL of {bytes} bytes (before any vCPU exists)"),
            e,
        )
    })?;
    Ok(Rings::new(vm.clone(), entries))
}

#[cfg(test)]
mod tests {
    use super::or_bits;

    #[test]
    fn or_bits_places_unaligned_words_across_two_words() {
        let mut words = vec![0u64; 3];
        // Bits 0 and 63 of a word handed over from page 70: pages 70 and 133.
        or_bits(&mut words, 70, 1 | 1 << 63);
        assert_eq!(words, vec![0, 1 << 6, 1 << 5]);
        // Aligned: one word; past the end: dropped.
        or_bits(&mut words, 0, 0b101);
        or_bits(&mut words, 192, u64::MAX);
        assert_eq!(words, vec![0b101, 1 << 6, 1 << 5]);
    }
}
