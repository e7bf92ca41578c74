//! The published snapshot: one atomic pointer, read under the thread's `grace` announcement.
//!
//! A space's current [`DmaSnapshot`](super::index::DmaSnapshot) is an `Arc` the cell owns one
//! count of, kept as a raw pointer in an [`AtomicPtr`]. The writer (the holder of the one
//! [`WriteToken`], kept under the space's writer lock) replaces it with one atomic swap; readers
//! never lock and never write the pointer.
//!
//! **Readers.** [`Current::load`] announces itself in its thread's grace slot (`grace::enter`:
//! one atomic exchange), reads the pointer and uses the snapshot without counting it; dropping
//! the guard ends the announcement (one plain store). [`Current::load_full`] does the same and
//! takes a counted `Arc` before it ends the announcement, for holders that keep the snapshot
//! (a cursor, a vm-memory view). A load nested in another announcement of the same space (a
//! copy, an outer load) needs no announcement of its own: the outer one covers it. A thread
//! that has no slot (its thread-locals are torn down) or is announced in another space counts
//! itself in the cell's `unslotted` counter instead, and always takes a counted `Arc`.
//!
//! **The writer.** [`Current::publish`] swaps the new pointer in, runs the caller's step (the
//! space bumps its generation there), then waits: for every announcement in the space made
//! before the swap to end (`grace::wait_for_copies`, which begins with a `SeqCst` fence), and
//! for `unslotted` to read 0. Only then does it turn the old pointer back into the `Arc` it
//! returns.
//!
//! **Why no reader can use freed or changing memory (the reclamation argument).** Each reader
//! makes a `SeqCst` store (its announcement, or its `unslotted` increment) and then a `SeqCst`
//! load of the pointer; the writer makes a `SeqCst` swap of the pointer, a `SeqCst` fence, then
//! loads the announcements. In the single total order of these, either the reader's store
//! comes before the writer's fence, and then the writer sees it and waits until the reader is
//! done, or it comes after, and then the reader's load comes after the swap and reads the new
//! pointer (or a later one). So when `publish` returns, no reader still uses the old snapshot
//! without holding a count of it: every uncounted use has ended, and every counted one shows
//! in the strong count. The old `Arc`'s count is therefore exact: `Arc::get_mut` on it
//! succeeds only if nothing at all can reach it, and the writer may then edit it in place (the
//! spare, `publish.rs`) or drop it. Counted holders keep it alive and unchanged as any `Arc`
//! does. A nested load relies on the outer announcement, so its guard must end first: guards
//! are scoped (`Loaded` is neither `Send` nor returned past the scope that made it).
//!
//! [`Current::peek`] reads the pointer without any announcement: it needs the write token,
//! shared, and `publish` needs it exclusively, so nothing can replace (and free) the snapshot
//! while the reference lives.
//!
//! The price: a reader that holds a `load` guard holds up every publication in its space until
//! it lets go, as a copy on the shortcut does (`grace`). Guards are kept for one lookup or one
//! walk; nothing may wait for a change of the same space while holding one.
//!
//! All of `dma`'s `unsafe` for the pointer is in this module.

use std::marker::PhantomData;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

use super::grace;

/// The current value, published by the holder of the [`WriteToken`].
pub(super) struct Current<T> {
    /// From `Arc::into_raw`; the cell owns that count.
    ptr: AtomicPtr<T>,
    /// The grace space readers announce themselves in.
    space: u64,
    /// Readers that could not announce themselves, while they take a counted reference.
    unslotted: AtomicUsize,
    /// The cell owns an `Arc<T>`: `Send` and `Sync` as that is.
    _owns: PhantomData<Arc<T>>,
}

/// The right to publish (and to read without announcing): one per cell, never cloned.
pub(super) struct WriteToken {
    space: u64,
}

/// A snapshot in use, uncounted while the thread is announced, or counted.
pub(super) struct Loaded<'a, T> {
    snap: *const T,
    hold: Hold<T>,
    _cell: PhantomData<&'a Current<T>>,
}

enum Hold<T> {
    /// Covered by this thread's announcement: its own (ended when dropped), or an outer one.
    Announced(#[allow(dead_code)] Option<grace::InFlight>),
    /// A counted reference.
    Counted(#[allow(dead_code)] Arc<T>),
}

impl<T> Current<T> {
    /// A cell holding `value`, whose readers announce themselves in the grace space `space`,
    /// and its one write token.
    pub(super) fn new(value: Arc<T>, space: u64) -> (Current<T>, WriteToken) {
        let cell = Current {
            ptr: AtomicPtr::new(Arc::into_raw(value).cast_mut()),
            space,
            unslotted: AtomicUsize::new(0),
            _owns: PhantomData,
        };
        (cell, WriteToken { space })
    }

    /// The current value, for a short use (see the module documentation).
    #[inline]
    pub(super) fn load(&self) -> Loaded<'_, T> {
        let announced = match grace::enter_nested(self.space) {
            grace::Entry::Entered(copying) => Some(copying),
            grace::Entry::Inside => None,
            grace::Entry::Outside => return self.load_unslotted(),
        };
        let snap = self.ptr.load(Ordering::SeqCst).cast_const();
        Loaded {
            snap,
            hold: Hold::Announced(announced),
            _cell: PhantomData,
        }
    }

    /// The current value, counted, to keep.
    #[inline]
    pub(super) fn load_full(&self) -> Arc<T> {
        let loaded = self.load();
        match loaded.hold {
            Hold::Counted(ref arc) => arc.clone(),
            Hold::Announced(_) => {
                // SAFETY: `snap` came from `Arc::into_raw` and, while this thread is announced
                // (`loaded` lives until the end of this block), the writer does not take back
                // the count the cell held of it (module documentation): the count is at least
                // 1, so it may be incremented and a new `Arc` made of the increment.
                unsafe {
                    Arc::increment_strong_count(loaded.snap);
                    Arc::from_raw(loaded.snap)
                }
            }
        }
    }

    /// [`Current::load`] for a thread that cannot announce itself in this space.
    #[cold]
    #[inline(never)]
    fn load_unslotted(&self) -> Loaded<'_, T> {
        self.unslotted.fetch_add(1, Ordering::SeqCst);
        let snap = self.ptr.load(Ordering::SeqCst).cast_const();
        // SAFETY: as in `load_full`: until `unslotted` goes down, the writer does not take
        // back the cell's count of `snap`.
        let arc = unsafe {
            Arc::increment_strong_count(snap);
            Arc::from_raw(snap)
        };
        self.unslotted.fetch_sub(1, Ordering::Release);
        Loaded {
            snap,
            hold: Hold::Counted(arc),
            _cell: PhantomData,
        }
    }

    /// The current value, for the writer: nothing can replace it while `token` is borrowed.
    #[inline]
    pub(super) fn peek<'a>(&'a self, token: &'a WriteToken) -> &'a T {
        debug_assert_eq!(token.space, self.space, "the token of another cell");
        let snap = self.ptr.load(Ordering::Relaxed).cast_const();
        // SAFETY: only `publish` replaces the pointer and gives up the cell's count of it, and
        // it needs `token` exclusively, which the returned reference borrows shared. The
        // pointer came from `Arc::into_raw`, so it is valid while that count is held. (Only
        // the token's holder stores the pointer, so a relaxed load reads its own last store.)
        unsafe { &*snap }
    }

    /// [`Current::peek`], counted.
    pub(super) fn peek_full(&self, token: &WriteToken) -> Arc<T> {
        debug_assert_eq!(token.space, self.space, "the token of another cell");
        // The pointer itself, not one made from `peek`'s reference: that one may reach only
        // the value, and `Arc::from_raw` reaches the counts before it.
        let snap = self.ptr.load(Ordering::Relaxed).cast_const();
        // SAFETY: as in `peek`, the cell's count of `snap` is held while `token` is borrowed.
        unsafe {
            Arc::increment_strong_count(snap);
            Arc::from_raw(snap)
        }
    }

    /// Publishes `next`, runs `then`, and waits until no reader can still use the value it
    /// replaced without a count of its own; returns that value.
    pub(super) fn publish(
        &self,
        token: &mut WriteToken,
        next: Arc<T>,
        then: impl FnOnce(),
    ) -> Arc<T> {
        assert_eq!(token.space, self.space, "the token of another cell");
        let old = self
            .ptr
            .swap(Arc::into_raw(next).cast_mut(), Ordering::SeqCst);
        then();
        grace::wait_for_copies(self.space);
        let mut spins = 0u32;
        while self.unslotted.load(Ordering::SeqCst) != 0 {
            spins += 1;
            if spins < 128 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: `old` came from `Arc::into_raw` (in `new` or an earlier `publish`), and its
        // count was the cell's; the cell no longer points to it, and every reader that read it
        // without a count has ended (module documentation), so the count is ours to take back.
        unsafe { Arc::from_raw(old) }
    }
}

impl<T> Drop for Current<T> {
    fn drop(&mut self) {
        // SAFETY: the pointer came from `Arc::into_raw` and the cell owns that count; with
        // `&mut self`, no reader or writer is using the cell.
        drop(unsafe { Arc::from_raw(self.ptr.get_mut().cast_const()) });
    }
}

impl<T> Deref for Loaded<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: `snap` is kept valid while the guard lives: by the announcement it holds or
        // is nested in (the writer does not take back the cell's count before it ends), or by
        // the count it holds.
        unsafe { &*self.snap }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64};

    /// A value whose two halves must always agree; `tail` is on the heap, so a value freed
    /// or changed under a reader shows (and Miri reports the access).
    struct Pair {
        head: u64,
        tail: Box<u64>,
    }

    fn pair(n: u64) -> Arc<Pair> {
        Arc::new(Pair {
            head: n,
            tail: Box::new(n),
        })
    }

    /// Grace spaces for these tests, apart from any real space's.
    static NEXT: AtomicU64 = AtomicU64::new(1 << 62);

    fn cell(n: u64) -> (Current<Pair>, WriteToken) {
        Current::new(pair(n), NEXT.fetch_add(1, Ordering::Relaxed))
    }

    #[test]
    fn the_replaced_value_comes_back_with_an_exact_count() {
        let (c, mut t) = cell(1);
        assert_eq!(c.load().head, 1);
        let kept = c.load_full();
        let mut old = c.publish(&mut t, pair(2), || {});
        assert_eq!(c.load().head, 2);
        assert_eq!(c.peek(&t).head, 2);
        assert!(Arc::get_mut(&mut old).is_none(), "a counted holder remains");
        drop(kept);
        let o = Arc::get_mut(&mut old).expect("nothing else reaches it");
        o.head = 3;
        *o.tail = 3;
        // Published again, edited in place: the turn-taking the space's spare makes.
        let mut old = c.publish(&mut t, old, || {});
        assert_eq!(c.load_full().head, 3);
        assert!(Arc::get_mut(&mut old).is_some());
        assert_eq!(*c.peek_full(&t).tail, 3);
    }

    #[test]
    fn a_nested_load_in_the_same_space_is_covered_by_the_outer_one() {
        let (c, _t) = cell(5);
        let outer = c.load();
        let inner = c.load();
        assert!(matches!(inner.hold, Hold::Announced(None)));
        assert_eq!(inner.head + outer.head, 10);
        drop(inner);
        // Another cell's load inside this announcement is counted instead.
        let (other, _t2) = cell(6);
        let nested = other.load();
        assert!(matches!(nested.hold, Hold::Counted(_)));
        assert_eq!(*nested.tail, 6);
        drop(nested);
        drop(outer);
    }

    #[test]
    fn readers_never_see_a_value_freed_or_edited_under_them() {
        let rounds: u64 = if cfg!(miri) { 30 } else { 20_000 };
        let (c, mut t) = cell(0);
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    let mut last = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let v = c.load();
                        assert_eq!(v.head, *v.tail, "a value changed under a reader");
                        assert!(v.head >= last, "went back from {last} to {}", v.head);
                        last = v.head;
                        drop(v);
                        let kept = c.load_full();
                        std::hint::spin_loop();
                        assert_eq!(kept.head, *kept.tail);
                    }
                });
            }
            // Two values take turns, each edited in place when nothing reaches it.
            let mut spare = pair(0);
            for n in 1..=rounds {
                let next = match Arc::get_mut(&mut spare) {
                    Some(v) => {
                        v.head = n;
                        *v.tail = n;
                        spare
                    }
                    None => pair(n),
                };
                spare = c.publish(&mut t, next, || {});
            }
            stop.store(true, Ordering::Relaxed);
        });
        assert_eq!(c.load().head, rounds);
    }
}
