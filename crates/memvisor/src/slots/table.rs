//! The [`SlotTable`] and its batches of changes ([`SlotEdit`]).
//!
//! The table is a handle to shared state: the current snapshot behind an `ArcSwap`, a
//! generation counter on a cache line of its own (what every cursor lookup reads), and a writer
//! mutex. A change copies the current slots into a [`SlotEdit`], applies the batch there, builds
//! a new snapshot and publishes it with the next generation; an error in the batch publishes
//! nothing. Readers never take the mutex.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use crate::adapt::Adapt;
use crate::addr::{Gpa, PageSize, Range};
use crate::bitmap::DirtyBitmap;
use crate::error::{Error, Result};
use crate::sync::lock;

use super::index::Entry;
use super::{
    DEFAULT_MAX_SLOTS, GpaTranslation, NO_HIT, Slot, SlotCursor, SlotFlags, SlotId, SlotSpec,
    Snapshot,
};

#[repr(align(128))]
pub(super) struct Padded<T>(pub(super) T);

pub(super) struct Shared {
    /// Generation of `current`; bumped after each swap. On its own cache line: only writers
    /// write it, every cursor lookup reads it.
    pub(super) generation: Padded<AtomicU64>,
    pub(super) current: ArcSwap<Snapshot>,
    pub(super) writer: Mutex<()>,
    pub(super) max_slots: u32,
    /// TEST ONLY: the faults the table's dirty bitmaps are built with.
    #[cfg(feature = "test-hooks")]
    pub(super) faults: crate::faults::Faults,
}

/// The memslot table. Cloning gives another handle to the same table.
#[derive(Clone)]
pub struct SlotTable {
    pub(super) shared: Arc<Shared>,
}

impl fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotTable")
            .field("snapshot", &*self.shared.current.load())
            .field("max_slots", &self.shared.max_slots)
            .finish()
    }
}

impl Default for SlotTable {
    fn default() -> Self {
        Self::new()
    }
}

impl SlotTable {
    /// An empty table accepting slot ids `0..32764`, like KVM on x86-64.
    pub fn new() -> Self {
        Self::with_max_slots(DEFAULT_MAX_SLOTS)
    }

    /// An empty table accepting slot ids `0..max_slots`.
    pub fn with_max_slots(max_slots: u32) -> Self {
        SlotTable {
            shared: Arc::new(Shared {
                generation: Padded(AtomicU64::new(0)),
                current: ArcSwap::from_pointee(Snapshot::build(0, Vec::new())),
                writer: Mutex::new(()),
                max_slots,
                #[cfg(feature = "test-hooks")]
                faults: crate::faults::Faults::default(),
            }),
        }
    }

    /// TEST ONLY (feature `test-hooks`): an empty table like [`SlotTable::with_max_slots`]
    /// whose dirty bitmaps are built with `faults`
    /// ([`Faults::no_dirty_summary`](crate::faults::Faults::no_dirty_summary)).
    #[cfg(feature = "test-hooks")]
    pub fn with_faults(max_slots: u32, faults: crate::faults::Faults) -> Self {
        SlotTable {
            shared: Arc::new(Shared {
                generation: Padded(AtomicU64::new(0)),
                current: ArcSwap::from_pointee(Snapshot::build(0, Vec::new())),
                writer: Mutex::new(()),
                max_slots,
                faults,
            }),
        }
    }

    /// The largest number of slots (and one past the largest id) the table accepts.
    pub fn max_slots(&self) -> u32 {
        self.shared.max_slots
    }

    /// Applies a batch of changes and publishes them as one new snapshot, or — if `edit`
    /// returns an error — publishes nothing. Writers are serialized; readers are never blocked.
    pub fn update<T>(&self, edit: impl FnOnce(&mut SlotEdit) -> Result<T>) -> Result<T> {
        let _writer = lock(&self.shared.writer);
        let current = self.shared.current.load_full();
        #[allow(unused_mut)]
        let mut draft = SlotEdit::from_snapshot(&current, self.shared.max_slots);
        #[cfg(feature = "test-hooks")]
        {
            draft.faults = self.shared.faults;
        }
        let value = edit(&mut draft)?;
        let generation = current.generation + 1;
        let slots = draft
            .by_gpa
            .values()
            .map(|id| draft.by_id[id].clone())
            .collect();
        self.shared
            .current
            .store(Arc::new(Snapshot::build(generation, slots)));
        self.shared
            .generation
            .0
            .store(generation, Ordering::Release);
        Ok(value)
    }

    /// Installs one slot. EINVAL for a bad id, size, alignment or a window past the backing's
    /// end; EEXIST if the id is taken or the guest range overlaps another slot.
    pub fn insert(&self, spec: SlotSpec) -> Result<()> {
        self.update(|t| t.insert(spec))
    }

    /// Removes a slot; ENOENT if there is none with this id. Its backing stays mapped until the
    /// last reader of an older snapshot lets go.
    pub fn remove(&self, id: SlotId) -> Result<()> {
        self.update(|t| t.remove(id).map(drop))
    }

    /// Changes a slot's flags; ENOENT if there is none with this id.
    pub fn set_flags(&self, id: SlotId, flags: SlotFlags) -> Result<()> {
        self.update(|t| t.set_flags(id, flags))
    }

    /// The generation of the current snapshot: one load, no reference taken. A view built from
    /// a snapshot of this generation is still current.
    pub fn generation(&self) -> u64 {
        self.shared.generation.0.load(Ordering::Acquire)
    }

    /// The current snapshot, to use for many lookups or to keep memory mapped.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.shared.current.load_full()
    }

    /// A cursor for one thread's lookups.
    pub fn cursor(&self) -> SlotCursor {
        let snapshot = self.snapshot();
        SlotCursor {
            generation: snapshot.generation,
            shared: self.shared.clone(),
            snapshot,
            hit: Entry::NONE,
            hit_generation: NO_HIT,
            adapt: Adapt::NEW,
        }
    }

    /// Where `gpa` lives on the host (the current snapshot's bucket index).
    pub fn lookup(&self, gpa: Gpa) -> Option<GpaTranslation> {
        self.shared.current.load().lookup(gpa)
    }

    /// See [`Snapshot::read`].
    pub fn read(&self, gpa: Gpa, buf: &mut [u8]) -> Result<()> {
        self.shared.current.load().read(gpa, buf)
    }

    /// See [`Snapshot::write`].
    pub fn write(&self, gpa: Gpa, buf: &[u8]) -> Result<()> {
        self.shared.current.load().write(gpa, buf)
    }

    /// See [`Snapshot::copy_within`].
    pub fn copy_within(&self, src: Gpa, dst: Gpa, len: u64) -> Result<()> {
        self.shared.current.load().copy_within(src, dst, len)
    }

    /// Returns the slot's dirty bitmap (one bit per 4 KiB page, KVM_GET_DIRTY_LOG layout) and
    /// clears it. ENOENT if there is no such slot or it does not log dirty pages.
    pub fn take_dirty_log(&self, id: SlotId) -> Result<Vec<u64>> {
        let snapshot = self.shared.current.load();
        let slot = snapshot.slot(id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        match &slot.dirty {
            Some(bitmap) => Ok(bitmap.take()),
            None => Err(Error::NotFound {
                what: "dirty log of slot",
                id: id.into(),
            }),
        }
    }

    /// Reads and clears the slot's dirty bitmap like [`SlotTable::take_dirty_log`], handing
    /// each non-zero word to `f(page, bits)` (bit `b` is the slot's page `page + b`; `page` is
    /// a multiple of 64) in increasing order. Costs O(dirty words), not O(slot size): no
    /// bitmap of the slot's size is built. ENOENT as for [`SlotTable::take_dirty_log`], before
    /// any call of `f`.
    pub fn drain_dirty_log(&self, id: SlotId, f: impl FnMut(u64, u64)) -> Result<()> {
        let snapshot = self.shared.current.load();
        let slot = snapshot.slot(id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        match &slot.dirty {
            Some(bitmap) => {
                bitmap.drain(f);
                Ok(())
            }
            None => Err(Error::NotFound {
                what: "dirty log of slot",
                id: id.into(),
            }),
        }
    }
}

/// A batch of changes being prepared by [`SlotTable::update`].
pub struct SlotEdit {
    by_id: BTreeMap<SlotId, Arc<Slot>>,
    /// Guest start address -> id; slots never overlap, so this orders them.
    by_gpa: BTreeMap<u64, SlotId>,
    max_slots: u32,
    /// TEST ONLY: the table's faults, for the bitmaps this batch starts.
    #[cfg(feature = "test-hooks")]
    faults: crate::faults::Faults,
}

impl SlotEdit {
    fn from_snapshot(snapshot: &Snapshot, max_slots: u32) -> Self {
        SlotEdit {
            by_id: snapshot.slots.iter().map(|s| (s.id, s.clone())).collect(),
            by_gpa: snapshot
                .slots
                .iter()
                .map(|s| (s.range.start().0, s.id))
                .collect(),
            max_slots,
            #[cfg(feature = "test-hooks")]
            faults: crate::faults::Faults::default(),
        }
    }

    /// A clear dirty bitmap for `pages` pages, with the table's faults in a test-hooks build.
    fn new_bitmap(&self, pages: u64) -> DirtyBitmap {
        let bitmap = DirtyBitmap::new(pages);
        #[cfg(feature = "test-hooks")]
        let bitmap = bitmap.with_faults(&self.faults);
        bitmap
    }

    /// Adds a slot to the batch; see [`SlotTable::insert`].
    pub fn insert(&mut self, spec: SlotSpec) -> Result<()> {
        if spec.id >= self.max_slots {
            return Err(Error::LimitExceeded {
                what: "slot id",
                value: spec.id.into(),
                limit: self.max_slots.into(),
            });
        }
        let range = Range::new("slot", spec.gpa, spec.size)?;
        PageSize::Size4K.check("slot guest address", spec.gpa.0)?;
        let page = spec.backing.page_size();
        page.check("slot size", spec.size)?;
        page.check("slot offset in backing", spec.offset)?;
        match spec.offset.checked_add(spec.size) {
            Some(end) if end <= spec.backing.size() => {}
            _ => {
                return Err(Error::OutOfBounds {
                    what: "slot window in backing",
                    start: spec.offset,
                    len: spec.size,
                    limit: spec.backing.size(),
                });
            }
        }
        if self.by_id.contains_key(&spec.id) {
            return Err(Error::AlreadyExists {
                what: "slot",
                id: spec.id.into(),
            });
        }
        // The slot starting closest below our last byte is the only one that can overlap.
        if let Some((_, &other)) = self.by_gpa.range(..=range.last().0).next_back() {
            let other = &self.by_id[&other];
            if other.range.overlaps(&range) {
                return Err(Error::Overlap {
                    what: "slot",
                    start: range.start().0,
                    last: range.last().0,
                    existing: format!("slot {}", other.id),
                    existing_start: other.range.start().0,
                    existing_last: other.range.last().0,
                });
            }
        }
        let dirty = spec
            .flags
            .contains(SlotFlags::LOG_DIRTY)
            .then(|| Arc::new(self.new_bitmap(spec.size >> PageSize::Size4K.shift())));
        self.by_gpa.insert(range.start().0, spec.id);
        self.by_id.insert(
            spec.id,
            Arc::new(Slot {
                id: spec.id,
                range,
                backing: spec.backing,
                offset: spec.offset,
                flags: spec.flags,
                dirty,
            }),
        );
        Ok(())
    }

    /// Removes a slot from the batch and returns it; ENOENT if there is none with this id.
    pub fn remove(&mut self, id: SlotId) -> Result<Arc<Slot>> {
        let slot = self.by_id.remove(&id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        self.by_gpa.remove(&slot.range.start().0);
        Ok(slot)
    }

    /// Changes a slot's flags. Turning LOG_DIRTY on starts a clear bitmap; leaving it on keeps
    /// the bitmap (no marks are lost); turning it off drops it.
    pub fn set_flags(&mut self, id: SlotId, flags: SlotFlags) -> Result<()> {
        let old = self.by_id.get(&id).ok_or(Error::NotFound {
            what: "slot",
            id: id.into(),
        })?;
        let dirty = match (&old.dirty, flags.contains(SlotFlags::LOG_DIRTY)) {
            (Some(bitmap), true) => Some(bitmap.clone()),
            (None, true) => Some(Arc::new(
                self.new_bitmap(old.range.len() >> PageSize::Size4K.shift()),
            )),
            (_, false) => None,
        };
        let new = Slot {
            id,
            range: old.range,
            backing: old.backing.clone(),
            offset: old.offset,
            flags,
            dirty,
        };
        self.by_id.insert(id, Arc::new(new));
        Ok(())
    }

    /// Number of slots in the batch's result so far.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether the batch's result is empty so far.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}
