//! Taking memory back from devices: how an unmap, an IOTLB invalidation and a vaddr
//! invalidation end.
//!
//! The rule, the kernel's (`vfio_dma_do_unmap` asks the devices again and retries for as long
//! as they hold pins): a change that takes a range away does not return while a device can
//! still touch the range, and a device racing it is no reason to fail it. Such a change runs in
//! three steps.
//!
//! 1. **Close the range.** Under the writer lock the change is published at once, so from then
//!    on the range is a hole for translations (EFAULT), `pin_pages` and copies (EINVAL), or, for
//!    a vaddr invalidation, an invalidated mapping. Copies that started before it (each
//!    announces itself, `grace`) are waited for. If devices or guards still hold something
//!    there, what the change took out is kept aside as a [`Retiring`]: the old mappings,
//!    through which the pins devices still hold there are released, and the snapshot before,
//!    through which the change can be undone. Otherwise (nearly always) the snapshot before
//!    becomes the writer's spare at once (`publish`).
//! 2. **Ask, and wait.** With no lock held, every unmap notifier is called with each range taken
//!    where devices still hold pins; then the change waits for `unpin_pages` to release them,
//!    asking again now and then (a device may have been about to pin when first asked; its
//!    pin then failed, but its pins from before may still be held), up to
//!    [`DmaConfig::unpin_wait`](super::DmaConfig::unpin_wait). No pin can be added there
//!    meanwhile: the range is closed.
//! 3. **Finish, or undo.** Once the pins are gone the change completes: the lock cache's entries
//!    over the memory are unlocked, its dirty bits read (`unmap_get_dirty`) and the space's
//!    own Eager pins of it dropped. A device that keeps its pins past the bound has the change
//!    undone, the snapshot before published again, and the caller gets EBUSY with nothing
//!    changed. The caller must then stop that device and try again (the vfio-user server does),
//!    never tell its client the memory is gone while a device may still write it.
//!
//! One such change waits at a time, and no other change (map, unmap, mode or tracking switch)
//! starts while it does, so undoing it is publishing the old snapshot again. `pin_pages`,
//! `unpin_pages`, copies, translations and dirty-log reads go on meanwhile. An unmap notifier
//! must not change the space that called it (it would wait for itself): such a change fails at
//! once with EBUSY.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use super::index::Index;
use super::{DmaSpace, Mapping, Writer};
use crate::addr::{Iova, PAGE_4K as PAGE};
use crate::error::{Error, Result};
use crate::sync::lock;

/// What a change took away, while it waits for devices to let go of it.
pub(super) struct Retiring {
    /// The IOVA ranges taken away, as inclusive `(first, last)`.
    ranges: Vec<(u64, u64)>,
    /// The mappings as they were, by start: the memory of the pins devices still hold there.
    pub(super) old: Vec<(u64, Arc<Mapping>)>,
    /// The thread that waits; a change it makes from an unmap notifier would wait for itself.
    thread: ThreadId,
}

/// What an edit of the mappings takes away from devices, for [`DmaSpace::retire`]; the default
/// takes nothing.
#[derive(Default)]
pub(super) struct Plan {
    /// The IOVA ranges no device may touch once the change returns, as inclusive
    /// `(first, last)`; their bytes are what the change reports.
    pub ranges: Vec<(u64, u64)>,
    /// The mappings replaced or removed, by start.
    pub old: Vec<(u64, Arc<Mapping>)>,
    /// Mappings the edit made that carry dirty bits of `old` and Eager pins of their own (the
    /// parts of a mapping an IOTLB invalidation keeps), by id.
    pub made: Vec<u64>,
}

impl DmaSpace {
    /// The writer lock, once no change is waiting for devices (step 2 above). EBUSY if the
    /// caller is that change's own thread: an unmap notifier changing the space that called it.
    pub(super) fn settled_writer(&self) -> Result<MutexGuard<'_, Writer>> {
        let mut writer = self.writer();
        while let Some(r) = &writer.retiring {
            if r.thread == std::thread::current().id() {
                return Err(Error::Busy {
                    addr: r.ranges[0].0,
                    why: "an unmap notifier tried to change the space whose unmap called it; a \
                          notifier may only unpin_pages"
                        .into(),
                });
            }
            writer = self
                .shared
                .settled
                .wait(writer)
                .unwrap_or_else(|e| e.into_inner());
        }
        Ok(writer)
    }

    /// Runs `edit` on a copy of the mappings and takes what its [`Plan`] names away from devices
    /// in the three steps of the module documentation; `finish` then runs under the writer lock
    /// with the old mappings, before their memory can go. Returns the bytes taken away and what
    /// `finish` returned. On an error from `edit` nothing changed; EBUSY, nothing changed, if
    /// devices keep pins in the ranges past [`DmaConfig::unpin_wait`](super::DmaConfig).
    ///
    /// `touches` looks at the current mappings first (under the writer lock, once no change
    /// waits for devices): if it says the change touches none of them, nothing is copied and
    /// `finish` runs with none, as for an `edit` that takes nothing. An IOTLB update removes
    /// whatever its range held before it maps, and that is nearly always nothing: copying the
    /// index (its chunk and piece lists) to find out was a fifth of the update's cost.
    pub(super) fn retire<T>(
        &self,
        touches: impl FnOnce(&Index) -> bool,
        edit: impl FnOnce(&mut Index, &mut Writer) -> Result<Plan>,
        finish: impl FnOnce(&Writer, &[(u64, Arc<Mapping>)]) -> T,
    ) -> Result<(u64, T)> {
        let mut writer = self.settled_writer()?;
        if !touches(&self.shared.current.peek(&writer.token).map) {
            return Ok((0, finish(&writer, &[])));
        }
        let invalid = writer.invalid;
        let mut next = self.working_copy(&mut writer);
        let mut plan = edit(super::working_map(&mut next), &mut writer)?;
        if plan.old.is_empty() {
            self.keep_unchanged(&mut writer, next);
            plan.ranges.clear();
            plan.made.clear();
            writer.scratch = plan;
            return Ok((0, finish(&writer, &[])));
        }
        // Pins change only under the writer lock, held since the edit: whether devices hold
        // pins in the ranges is known now. Guards' holds change without the writer lock: they
        // are looked at only once the range is closed (a guard walking after that misses it).
        // Either way the snapshot before is kept until then, to undo the change if they keep
        // what it took; if nothing holds it, it becomes the spare as for any change.
        let pinned = held_by_devices(&writer, &plan.ranges);
        let (before, ops) = self.swap_in(&mut writer, next);
        // After the publication (and the fence of its grace wait): see `Holds::my_shard`.
        let guards = self.shared.holds.used();
        let hold = pinned || (guards && self.held_by_guards(&plan.ranges));
        if hold {
            writer.retiring = Some(Retiring {
                ranges: plan.ranges.clone(),
                old: plan.old.clone(),
                thread: std::thread::current().id(),
            });
            self.shared.holds.waiting.store(true, Ordering::SeqCst);
            drop(writer);
            let released = self.wait_for_unpins(&plan.ranges);
            writer = self.writer();
            self.shared.holds.waiting.store(false, Ordering::SeqCst);
            writer.retiring = None;
            self.shared.settled.notify_all();
            if !released {
                return Err(self.undo(writer, &before.map, invalid, &plan));
            }
        }
        // The change stands: what it replaced is the next change's working copy.
        self.recycle(&mut writer, before, ops);
        for (_, m) in &plan.old {
            self.shared.release_cached(m);
        }
        let value = finish(&writer, &plan.old);
        // Only Eager mode pins whole mappings: a Lazy space (an IOTLB) looks nothing up.
        if !writer.eager.is_empty() {
            for (_, m) in &plan.old {
                self.unpin_mapping(&mut writer, m.id);
            }
        }
        let bytes = plan.ranges.iter().map(|&(s, l)| l - s + 1).sum();
        // The records the change removed, for the next inserts, and the plan's vectors for the
        // next change's plan.
        for (_, m) in plan.old.drain(..) {
            Self::keep_record(&mut writer, m);
        }
        plan.ranges.clear();
        plan.made.clear();
        writer.scratch = plan;
        Ok((bytes, value))
    }

    /// Calls the unmap notifiers for the ranges where devices hold pins, then waits for the
    /// pins to go, asking again with growing pauses; returns whether they went before the
    /// bound.
    fn wait_for_unpins(&self, ranges: &[(u64, u64)]) -> bool {
        let deadline = Instant::now().checked_add(self.shared.config.unpin_wait);
        let mut pause = Duration::from_millis(1);
        loop {
            let asked = {
                let writer = self.writer();
                ranges
                    .iter()
                    .filter(|r| self.held(&writer, std::slice::from_ref(r)))
                    .map(|&(s, l)| (Iova(s), l - s + 1))
                    .collect::<Vec<_>>()
            };
            self.notify_unmap(&asked);
            let ask_again = Instant::now() + pause;
            let mut writer = self.writer();
            loop {
                if !self.held(&writer, ranges) {
                    return true;
                }
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return false;
                }
                if now >= ask_again {
                    break;
                }
                let until = deadline.map_or(ask_again, |d| d.min(ask_again));
                writer = self
                    .shared
                    .settled
                    .wait_timeout(writer, until - now)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
            pause = (pause * 2).min(Duration::from_millis(100));
        }
    }

    /// Publishes `before` again: devices kept their pins. The pins the edit took for the parts
    /// it made are dropped, and the dirty bits devices set in those parts meanwhile go back to
    /// the mappings they came from. Returns the EBUSY to report.
    fn undo(
        &self,
        mut writer: MutexGuard<'_, Writer>,
        before: &Index,
        invalid: u64,
        plan: &Plan,
    ) -> Error {
        let now = self.shared.current.peek_full(&writer.token);
        for (_, _, _, m) in now.map.iter() {
            if plan.made.contains(&m.id) {
                if let Some((_, old)) = plan
                    .old
                    .iter()
                    .find(|(s, o)| *s <= m.iova.start().0 && m.iova.last() <= o.iova.last())
                {
                    carry_dirty(m, old, self.shared.min_page);
                }
            }
        }
        for &id in &plan.made {
            self.unpin_mapping(&mut writer, id);
        }
        writer.invalid = invalid;
        let again = Arc::new(super::index::DmaSnapshot {
            generation: 0,
            map: before.clone(),
            invalid,
        });
        self.publish(&mut writer, again, false);
        drop(writer);
        // Accesses waiting for a vaddr update see the mapping valid again.
        let (mutex, cv) = &self.shared.updated;
        let _guard = lock(mutex);
        cv.notify_all();
        let (first, last) = plan.ranges[0];
        Error::Busy {
            addr: first,
            why: format!(
                "devices still hold pins in [{first:#x}, {last:#x}] {} ms after the unmap \
                 notifiers asked for them back (DmaConfig::unpin_wait); nothing was changed: \
                 stop the device that holds them, then try again",
                self.shared.config.unpin_wait.as_millis()
            ),
        }
    }

    /// Wakes a change waiting for devices' pins; called after every `unpin_pages`.
    pub(super) fn pins_released(&self, writer: &Writer) {
        if writer.retiring.is_some() {
            self.shared.settled.notify_all();
        }
    }
}

impl DmaSpace {
    /// Whether devices hold pins, or guards hold pages, in any of `ranges` (inclusive IOVA
    /// ranges).
    fn held(&self, writer: &Writer, ranges: &[(u64, u64)]) -> bool {
        held_by_devices(writer, ranges) || self.held_by_guards(ranges)
    }

    /// Whether scatter-gather guards hold pages in any of `ranges`.
    fn held_by_guards(&self, ranges: &[(u64, u64)]) -> bool {
        let holds = &self.shared.holds;
        ranges
            .iter()
            .any(|&(s, l)| holds.any_iova(s / PAGE, l / PAGE + 1))
    }
}

/// Whether devices hold pins (`pin_pages`) in any of `ranges` (inclusive IOVA ranges).
fn held_by_devices(writer: &Writer, ranges: &[(u64, u64)]) -> bool {
    ranges
        .iter()
        .any(|&(s, l)| writer.device_pins.any_counted(s / PAGE, l / PAGE + 1))
}

/// Marks in `to` the pages (of `page` bytes) marked in `from`, a part of `to`.
fn carry_dirty(from: &Mapping, to: &Mapping, page: u64) {
    let (Some(src), Some(dst)) = (&from.dirty, &to.dirty) else {
        return;
    };
    // Bits count IOVA pages from the page of each mapping's first byte (`dirty_pages`).
    let skip = from.iova.start().0 / page - to.iova.start().0 / page;
    for p in 0..src.pages() {
        if src.is_marked(p) {
            dst.mark(skip + p, 1);
        }
    }
}
