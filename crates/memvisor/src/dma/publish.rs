//! Publishing a change: the writer's working copy, and the spare that makes an IOTLB cheap.
//!
//! Readers never lock: they read the current [`DmaSnapshot`] (`current`, an atomic pointer)
//! announced, or take a counted `Arc` of it and keep it as long as they like (a cursor until
//! its next translation, a vm-memory view for its life). A change is made to a working copy,
//! the copy is published with a new generation, and the writer waits for the readers and
//! copies announced on the old one (`grace`) before the old one may go or be edited.
//!
//! **The working copy.** The index is persistent (`index`): a copy of it costs a few pointers,
//! and a change to a copy copies what it touches — the chunk of the sorted index (6.8 KiB), the
//! page-table leaf (4 KiB) and the path to them, the value group — each a fresh allocation,
//! freed when the old snapshot goes. For a type1 space, which changes rarely, that is nothing.
//! An IOTLB is another matter: a guest in strict mode maps and unmaps one 4 KiB page per
//! message, ten thousand times a second, and copying and freeing those nodes was most of the
//! ~700 ns an IOTLB update cost (`docs/scale.md`, "IOTLB updates").
//!
//! **The spare.** So the writer keeps the snapshot a change replaced, instead of dropping it,
//! and makes the same change to it once no reader holds it: the index logs each change it
//! takes (`index::Op`, by start address), and the log is made again on the spare
//! ([`Index::replay`]). The two copies then take turns: the next change is made, in place, to
//! the spare, which is published, and the snapshot it replaces becomes the spare. Once both
//! copies have their own chunk, leaf and path where the IOTLB churns (after the first change
//! there), a change costs two small edits in place (a few entries moved in one chunk, a word
//! in one leaf) and no allocation: the writer fills a removed mapping's record again when
//! nothing else holds it (`keep_record`), and keeps its vectors between changes (while the
//! index holds something: an emptied index lets go of its chunk list). Whatever the two
//! copies still share is copied on write as before, so a reader holding either sees it
//! unchanged.
//! A small index (up to 256 mappings, an IOTLB's usual size) is a flat array held inside the
//! snapshot itself (`index::flat`): nothing in it is shared between the copies, so its edit
//! is a move of a few entries and no atomic at all.
//!
//! The rules that keep that safe:
//! * A snapshot is changed in place only when the writer holds the only reference to it
//!   (`Arc::get_mut`): `Current::publish` returns only after the readers that read it without
//!   counting have ended, so the count is exact. A snapshot a reader holds is never
//!   changed, whatever its age.
//! * It is changed only after the grace wait, as dropping it was: copies announced before the
//!   change may still use memory only it maps.
//! * A spare never holds a mapping the current snapshot does not, so nothing stays mapped
//!   longer than before: a spare a reader still holds is kept (with the change pending, made
//!   by the next change once the reader let go) only if the change dropped no mapping (an
//!   insert, an IOTLB update); otherwise it is let go, and the next change copies the current
//!   snapshot as before.
//! * An edit that fails may have changed its working copy part way: the copy is dropped. An
//!   undo (`retire`) publishes a snapshot of its own, with no log: the spare is dropped.
//! * A change that takes memory back (`retire`) is published first and recycled only once it
//!   stands: while devices or guards may hold what it took, the snapshot it replaced is the
//!   one to publish again if they keep it (and it is not the spare then). Guards that hold
//!   nothing there cost the spare nothing.
//! * A change of more than `index::REPLAY_MAX` logged ops (mappings side by side removed from
//!   a flat index are one op, one move) is not made twice: the spare is let go, as the old
//!   snapshot was before, and the next change copies the current one. Made twice, such a
//!   change cost a fifth more than a copy of what it touches. One that empties the index (an
//!   unmap of everything, a whole-space IOTLB flush) is one op (`Clear`), made on the spare
//!   too: emptying it in place resets the flat array's used slots, where letting it go cost a
//!   copy of the (empty, 8.6 KiB) array at the next change.
//!
//! The cost: up to twice the index's memory where the two copies stopped sharing (for an
//! IOTLB of a few hundred pages, two chunks and two leaves), and each change made twice, in
//! place.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use super::index::{self, DmaSnapshot, Index};
use super::{DmaSpace, Writer};
use crate::error::Result;

/// A published snapshot no longer current, kept by the writer as the next change's working
/// copy: once no reader holds it, the changes it lacks (`pending`, the log of the change that
/// replaced it; empty once made) are made to it in place, and it equals the current snapshot.
pub(super) struct Spare {
    snap: Arc<DmaSnapshot>,
    pending: Vec<index::Op>,
}

impl DmaSpace {
    /// Runs `edit` on a copy of the current mappings and publishes it if `edit` says it changed
    /// something; on error nothing is published. Writers are serialized, and none starts while
    /// a change waits for devices to let go of memory it takes back (`retire`).
    pub(super) fn change<T>(
        &self,
        edit: impl FnOnce(&mut Index, &mut Writer) -> Result<(T, bool)>,
    ) -> Result<T> {
        let writer = self.settled_writer()?;
        self.change_with(writer, edit)
    }

    /// [`DmaSpace::change`] under `writer`, taken with `settled_writer`.
    pub(super) fn change_with<T>(
        &self,
        mut writer: MutexGuard<'_, Writer>,
        edit: impl FnOnce(&mut Index, &mut Writer) -> Result<(T, bool)>,
    ) -> Result<T> {
        let mut next = self.working_copy(&mut writer);
        let (value, changed) = edit(working_map(&mut next), &mut writer)?;
        if changed {
            self.publish(&mut writer, next, true);
        } else {
            self.keep_unchanged(&mut writer, next);
        }
        Ok(value)
    }

    /// A snapshot equal to the current one, the writer's alone, to edit and publish: the spare
    /// (brought up to date in place) if no reader holds it any more, else a copy of the current
    /// one (which shares all it can: the index is persistent).
    pub(super) fn working_copy(&self, writer: &mut Writer) -> Arc<DmaSnapshot> {
        if let Some(mut spare) = writer.spare.take() {
            if let Some(snap) = Arc::get_mut(&mut spare.snap) {
                // Nearly always made already (`recycle`): nothing to replay then.
                if !spare.pending.is_empty() {
                    snap.map.replay(spare.pending);
                }
                return spare.snap;
            }
            // Still held by a reader: let go of it.
        }
        Arc::new(DmaSnapshot {
            generation: 0,
            map: self.shared.current.peek(&writer.token).map.clone(),
            invalid: 0,
        })
    }

    /// Keeps a working copy that an edit left unchanged (it found nothing to do) as the spare;
    /// one it changed after all, or failed part way through, is dropped.
    pub(super) fn keep_unchanged(&self, writer: &mut Writer, mut next: Arc<DmaSnapshot>) {
        if working_map(&mut next).take_log().is_empty() {
            writer.spare = Some(Spare {
                snap: next,
                pending: Vec::new(),
            });
        }
    }

    /// Publishes `next` (a working copy) as the next generation and waits until no copy can
    /// still be on the one it replaces.
    ///
    /// With `recycle`, the snapshot replaced becomes the writer's spare: if no reader holds it,
    /// the change is made to it too, in place, at once; if a reader does and the change
    /// dropped no mapping, it is kept with the change pending, for the next change to make
    /// once the reader let go. Either way it never holds a mapping the current snapshot does
    /// not, so nothing stays mapped longer than before. Without `recycle` (an undo, which has
    /// no log of its change), the spare is dropped. Why a spare: an IOTLB changes one 4 KiB
    /// entry at a time, and a persistent index copies the chunk (6.8 KiB), the page-table leaf
    /// (4 KiB) and the path to them for each change and frees the old ones when the old
    /// snapshot goes; made twice in place, on two copies that take turns, the change costs
    /// two small edits and no allocation.
    pub(super) fn publish(&self, writer: &mut Writer, next: Arc<DmaSnapshot>, recycle: bool) {
        let (old, ops) = self.swap_in(writer, next);
        if recycle {
            self.recycle(writer, old, ops);
        }
    }

    /// The first half of [`DmaSpace::publish`]: publishes `next` and waits until no copy can
    /// still be on the snapshot it replaces; returns that snapshot and the log of the change,
    /// for [`DmaSpace::recycle`] (or, for a change that may yet be undone, to publish again).
    /// The writer has no spare until then.
    pub(super) fn swap_in(
        &self,
        writer: &mut Writer,
        mut next: Arc<DmaSnapshot>,
    ) -> (Arc<DmaSnapshot>, Vec<index::Op>) {
        let generation = self.shared.head.0.generation.load(Ordering::Relaxed) + 1;
        let ops = {
            let snap = Arc::get_mut(&mut next).expect("a working copy is the writer's alone");
            snap.map.reindex();
            snap.generation = generation;
            snap.invalid = writer.invalid;
            snap.map.take_log()
        };
        // Kept by the caller: it may be the last holder of memory the change gave back, which
        // copies announced before the change may still be using.
        let head = &self.shared.head.0;
        // The generation after the snapshot: a reader that sees this generation loads this
        // snapshot or a later one, so what it caches under a generation is that generation's.
        // Copies and readers announce themselves and hold no lock: `publish` returns once
        // none that may be on the old snapshot (and the memory only it still maps) is left.
        let old = (self.shared.current).publish(&mut writer.token, next, || {
            head.generation.store(generation, Ordering::Release)
        });
        writer.spare = None;
        (old, ops)
    }

    /// The second half of [`DmaSpace::publish`]: `old`, the snapshot a change published by
    /// [`DmaSpace::swap_in`] replaced, becomes the spare, with `ops`, that change's log, made
    /// to it in place (or pending, see `publish`), or is dropped.
    pub(super) fn recycle(
        &self,
        writer: &mut Writer,
        mut old: Arc<DmaSnapshot>,
        ops: Vec<index::Op>,
    ) {
        if ops.len() > index::REPLAY_MAX {
            return;
        }
        // `publish` has waited for the readers that read `old` without counting it, so the
        // count is exact: 1 means no reader can reach it, and it may be changed in place.
        if let Some(snap) = Arc::get_mut(&mut old) {
            snap.map.replay(ops);
            writer.spare = Some(Spare {
                snap: old,
                pending: Vec::new(),
            });
        } else if ops.iter().all(index::Op::drops_nothing) {
            writer.spare = Some(Spare {
                snap: old,
                pending: ops,
            });
        }
    }
}

/// The index of a working copy (see [`DmaSpace::working_copy`]).
pub(super) fn working_map(next: &mut Arc<DmaSnapshot>) -> &mut Index {
    &mut Arc::get_mut(next)
        .expect("a working copy is the writer's alone")
        .map
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::addr::{Iova, PAGE_4K as PAGE};
    use crate::backing::{Backing, BackingKind};
    use crate::dma::Prot;
    use std::sync::atomic::{AtomicBool, AtomicU64};

    /// One entry as [`contents`] lists it: start, last, hot word, record address, page-table
    /// word of its first page.
    type Entry = (u64, u64, u64, usize, u64);

    /// What a snapshot holds, entry by entry.
    fn contents(snap: &DmaSnapshot) -> Vec<Entry> {
        snap.map
            .iter()
            .map(|(s, l, h, m)| {
                (
                    s,
                    l,
                    h.bits(),
                    Arc::as_ptr(m) as usize,
                    snap.map.pages.get(s),
                )
            })
            .collect()
    }

    fn spare_state(d: &DmaSpace) -> Option<(Vec<Entry>, usize)> {
        let w = d.writer();
        w.spare
            .as_ref()
            .map(|s| (contents(&s.snap), s.pending.len()))
    }

    fn space() -> (DmaSpace, Arc<Backing>) {
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 256 * PAGE).unwrap());
        let config = crate::dma::DmaConfig {
            // Keep the page table from the first small mapping on, so it is edited too.
            page_table_from: 0,
            ..crate::dma::DmaConfig::default()
        };
        (DmaSpace::new(config).unwrap(), b)
    }

    #[test]
    fn the_replaced_snapshot_becomes_the_spare_and_equals_the_current_one() {
        let (d, b) = space();
        for k in 0..40u64 {
            d.map_backing(Iova(k * 2 * PAGE), &b, k * PAGE, PAGE, Prot::RW)
                .unwrap();
            if k % 3 == 0 {
                d.invalidate_range(Iova(k * PAGE), 3 * PAGE).unwrap();
            }
            let current = contents(&d.shared.current.load());
            let (spare, pending) = spare_state(&d).expect("no reader held the old snapshot");
            assert_eq!(pending, 0);
            assert_eq!(spare, current, "after change {k}");
        }
        // A failed edit (overlap) drops the working copy; the next change copies the current
        // snapshot and the two take turns again.
        assert!(
            d.map_backing(Iova(2 * PAGE), &b, 0, PAGE, Prot::RW)
                .is_err()
        );
        assert!(
            spare_state(&d).is_none(),
            "a failed edit drops its working copy"
        );
        d.map_backing(Iova(200 * PAGE), &b, 0, PAGE, Prot::READ)
            .unwrap();
        let current = contents(&d.shared.current.load());
        assert_eq!(spare_state(&d).map(|s| s.0), Some(current));
        // Emptying the space (more than `REPLAY_MAX` mappings at once: one `Clear`) is made on
        // the spare too, in place: it stays, empty, and the next change edits it.
        d.invalidate_range(Iova(0), 512 * PAGE).unwrap();
        assert!(d.shared.current.load().map.is_empty());
        assert_eq!(
            spare_state(&d),
            Some((Vec::new(), 0)),
            "the spare emptied too"
        );
        d.map_backing(Iova(300 * PAGE), &b, 0, PAGE, Prot::RW)
            .unwrap();
        let current = contents(&d.shared.current.load());
        assert_eq!(spare_state(&d).map(|s| s.0), Some(current));
    }

    #[test]
    fn a_snapshot_a_reader_holds_never_changes_and_is_kept_only_while_nothing_was_dropped() {
        let (d, b) = space();
        d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW).unwrap();
        d.map_backing(Iova(PAGE), &b, PAGE, PAGE, Prot::RW).unwrap();
        let held = d.shared.current.load_full();
        let seen = contents(&held);
        // An insert while the old snapshot is held: kept, with the insert pending.
        d.map_backing(Iova(4 * PAGE), &b, 4 * PAGE, PAGE, Prot::RW)
            .unwrap();
        assert_eq!(spare_state(&d).map(|s| s.1), Some(1));
        assert_eq!(contents(&held), seen);
        // The next change, with the reader still there: the spare is let go, the current
        // snapshot copied.
        d.map_backing(Iova(5 * PAGE), &b, 5 * PAGE, PAGE, Prot::RW)
            .unwrap();
        assert_eq!(contents(&held), seen, "a held snapshot is never edited");
        // A removal while a reader holds the old snapshot: no spare (it would keep the
        // removed mapping's memory).
        let held2 = d.shared.current.load_full();
        let seen2 = contents(&held2);
        d.invalidate_range(Iova(0), PAGE).unwrap();
        assert!(spare_state(&d).is_none());
        assert_eq!(contents(&held2), seen2);
        // Readers gone: a lagging spare catches up on the next change.
        drop(held2);
        d.map_backing(Iova(6 * PAGE), &b, 6 * PAGE, PAGE, Prot::RW)
            .unwrap();
        let held3 = d.shared.current.load_full();
        d.map_backing(Iova(7 * PAGE), &b, 7 * PAGE, PAGE, Prot::RW)
            .unwrap();
        assert_eq!(
            spare_state(&d).map(|s| s.1),
            Some(1),
            "lagging by one insert"
        );
        drop(held3);
        d.invalidate_range(Iova(6 * PAGE), PAGE).unwrap();
        let current = contents(&d.shared.current.load());
        assert_eq!(spare_state(&d), Some((current, 0)));
        assert_eq!(contents(&held), seen);
    }

    #[test]
    fn a_removed_mapping_lets_go_of_its_memory_when_the_old_snapshot_did() {
        let (d, _) = space();
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, PAGE).unwrap());
        d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW).unwrap();
        d.map_backing(Iova(PAGE), &b, 0, PAGE, Prot::RW).unwrap();
        // Ours, the current snapshot's two mappings; the spare holds the same records.
        assert_eq!(Arc::strong_count(&b), 3);
        d.invalidate_range(Iova(0), 2 * PAGE).unwrap();
        assert_eq!(
            Arc::strong_count(&b),
            1,
            "neither the spare nor a log keeps it"
        );
    }

    fn hold(d: &DmaSpace, page: u64) -> crate::dma::SgGuard {
        let buf = crate::dma::SgBuf {
            iova: Iova(page * PAGE),
            len: PAGE,
            prot: Prot::READ,
        };
        match d.hold_sg(&[buf]).unwrap() {
            crate::dma::SgWalk::Held(g) => g,
            crate::dma::SgWalk::Missed(m) => panic!("page {page} missed: {m:?}"),
        }
    }

    /// A back end's requests take guards all the time: an invalidation where none holds
    /// anything keeps the spare, as on a space that never saw a guard.
    #[test]
    fn guards_that_hold_nothing_in_the_range_cost_the_spare_nothing() {
        let (d, b) = space();
        d.map_backing(Iova(0), &b, 0, PAGE, Prot::RW).unwrap();
        // A request in flight on page 0, and one taken and let go on page 1.
        let in_flight = hold(&d, 0);
        d.map_backing(Iova(PAGE), &b, PAGE, PAGE, Prot::RW).unwrap();
        drop(hold(&d, 1));
        for k in 1..20u64 {
            d.invalidate_range(Iova(k * PAGE), PAGE).unwrap();
            let current = contents(&d.shared.current.load());
            assert_eq!(
                spare_state(&d),
                Some((current, 0)),
                "after invalidation {k}"
            );
            d.map_backing(Iova((k + 1) * PAGE), &b, k * PAGE, PAGE, Prot::RW)
                .unwrap();
        }
        assert_eq!(d.guard_held_pages(), 1);
        drop(in_flight);
    }

    /// A guard another thread holds (so in another shard) over an invalidated page still
    /// holds the invalidation back: EBUSY past `unpin_wait`, nothing changed; once it is let
    /// go, the invalidation goes through and the spare is back.
    #[test]
    fn a_guard_on_another_thread_still_holds_an_invalidation_back() {
        let b = Arc::new(Backing::new(BackingKind::PrivateAnon, 16 * PAGE).unwrap());
        let config = crate::dma::DmaConfig {
            page_table_from: 0,
            unpin_wait: std::time::Duration::from_millis(30),
            ..crate::dma::DmaConfig::default()
        };
        let d = DmaSpace::new(config).unwrap();
        for k in 0..4u64 {
            d.map_backing(Iova(k * PAGE), &b, k * PAGE, PAGE, Prot::RW)
                .unwrap();
        }
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        std::thread::scope(|s| {
            let d2 = &d;
            s.spawn(move || {
                let g = hold(d2, 2);
                held_tx.send(()).unwrap();
                done_rx.recv().unwrap();
                drop(g);
            });
            held_rx.recv().unwrap();
            let before = contents(&d.shared.current.load());
            let e = d.invalidate_range(Iova(PAGE), 2 * PAGE).unwrap_err();
            assert_eq!(e.errno(), libc::EBUSY, "{e}");
            assert_eq!(contents(&d.shared.current.load()), before, "undone whole");
            assert!(d.translate(Iova(PAGE), 8, Prot::READ).is_ok());
            done_tx.send(()).unwrap();
        });
        assert_eq!(d.invalidate_range(Iova(PAGE), 2 * PAGE).unwrap(), 2 * PAGE);
        assert!(d.translate(Iova(2 * PAGE), 8, Prot::READ).is_err());
        let current = contents(&d.shared.current.load());
        assert_eq!(spare_state(&d), Some((current, 0)));
    }

    struct StopOnDrop<'a>(&'a AtomicBool);

    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    /// Readers hold snapshots and translate while a writer churns one-page mappings as an
    /// IOTLB in strict mode does: every translation that succeeds gives the page's one host
    /// address, and a held snapshot reads the same at the end as when it was taken.
    #[test]
    fn readers_holding_snapshots_see_them_unchanged_while_the_writer_takes_turns() {
        const PAGES: u64 = 96;
        let (d, b) = space();
        let stop = AtomicBool::new(false);
        let reads = AtomicU64::new(0);
        std::thread::scope(|s| {
            for r in 0..2u64 {
                let (d, b, stop, reads) = (&d, &b, &stop, &reads);
                s.spawn(move || {
                    let mut x = r + 1;
                    while !stop.load(Ordering::Relaxed) {
                        let held = d.shared.current.load_full();
                        let seen = contents(&held);
                        for _ in 0..50 {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                            let page = (x >> 33) % PAGES;
                            if let Ok(t) = d.translate(Iova(page * PAGE), 8, Prot::READ) {
                                assert_eq!(t.hva.0, b.hva().0 + page * PAGE, "page {page}");
                            }
                        }
                        assert_eq!(contents(&held), seen, "a held snapshot changed");
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            // Stops the readers however the writer ends, a failed assertion included.
            let _stop = StopOnDrop(&stop);
            let mut x = 7u64;
            for _ in 0..20_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                let page = (x >> 33) % PAGES;
                if x & (1 << 20) != 0 {
                    // An update: whatever was there goes first, as a vhost-user back end does.
                    d.invalidate_range(Iova(page * PAGE), PAGE).unwrap();
                    d.map_backing(Iova(page * PAGE), &b, page * PAGE, PAGE, Prot::RW)
                        .unwrap();
                } else {
                    let n = 1 + (x >> 40) % 8;
                    d.invalidate_range(Iova(page * PAGE), n * PAGE).unwrap();
                }
            }
        });
        assert!(reads.load(Ordering::Relaxed) > 0);
        // The writer's copies agree at the end.
        let current = contents(&d.shared.current.load());
        if let Some((spare, 0)) = spare_state(&d) {
            assert_eq!(spare, current);
        }
    }
}
