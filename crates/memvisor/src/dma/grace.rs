//! What keeps memory mapped under a plain copy on the thread's shortcut, without a snapshot.
//!
//! A plain `dma_read` / `dma_write` inside the mapping this thread last hit needs no lookup,
//! only a guarantee that the memory stays mapped until the copy ends. Loading the snapshot for
//! that (an `ArcSwap` guard: a debt slot taken with one locked instruction, paid back with
//! another) was the largest fixed cost of a 64-byte copy. Here a copy on the shortcut instead
//! announces itself in a slot of its thread's own — one atomic exchange in, one plain store
//! out — and every change of a space waits, after publishing, until each copy in that space
//! announced before it has ended. The old snapshot, and with it the memory the change gave back, is dropped only
//! after that, so a change that returns has no shortcut copy running on its old mappings.
//!
//! The handshake is the classic store-then-load on both sides, ordered by sequential
//! consistency: the copy announces (a `SeqCst` swap) and then loads the space's generation
//! (`SeqCst`); the writer bumps the generation, issues a `SeqCst` fence and then reads the
//! slots. In the single order of those operations either the announcement comes first — the
//! writer sees it and waits for the copy — or the fence does — the copy sees the new generation,
//! misses and takes the snapshot path. A slot counts up: odd while its thread copies, so the
//! writer waits for a change of the value it read, never for an even one (a thread copying
//! back to back cannot starve it).
//!
//! So a change can wait as long as the longest single-mapping copy in flight in its space. A
//! copy that faults into a userfaultfd handler which must itself change the same space before
//! the fault resolves would never end: such a handler must not map or unmap in the space whose
//! memory faulted (resolving the fault, `UFFDIO_COPY`, is no change of the space).
//!
//! Reads of the published snapshot (`current`) announce themselves in the same slot
//! ([`enter_nested`]): a read inside a copy or another read of the same space is covered by
//! the announcement already made, and the writer's wait after a publication covers reads as it
//! covers copies.
//!
//! Slots are leaked, cache-line sized nodes on a push-only list, so a writer walks them without
//! a lock; a thread claims one at its first shortcut copy and gives it back when it exits, for
//! the next thread to reuse. A thread that cannot keep a slot (its thread-locals are being torn
//! down) simply never takes the shortcut.

use std::cell::Cell;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering, fence};

/// One thread's announcement: its copy count, odd while a copy runs, and the space copied.
#[repr(align(128))]
struct Slot {
    count: AtomicU64,
    /// The id of the space the copy is in, written before the count goes odd: a writer waits
    /// only for copies in its own space, so one space's long copy never holds up another's
    /// changes.
    space: AtomicU64,
    taken: AtomicBool,
    next: *const Slot,
}

// SAFETY: `next` is written once, before the slot is published on the list, and slots are
// never freed; everything else is atomic.
unsafe impl Sync for Slot {}

/// The newest slot; each points to the one pushed before it.
static SLOTS: AtomicPtr<Slot> = AtomicPtr::new(ptr::null_mut());

thread_local! {
    /// This thread's slot, null until its first shortcut copy (and again once it is given
    /// back). Const and without a destructor, so reading it costs one load.
    static MINE: Cell<*const Slot> = const { Cell::new(ptr::null()) };
    /// Gives the slot back when the thread exits.
    static RETURN: Release = const { Release };
}

struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        let slot = MINE.with(|m| m.replace(ptr::null()));
        if !slot.is_null() {
            // SAFETY: slots are leaked, so the pointer is valid forever.
            unsafe { &*slot }.taken.store(false, Ordering::Release);
        }
    }
}

/// A copy in progress on this thread; ends when dropped.
pub(super) struct InFlight {
    slot: &'static Slot,
    count: u64,
}

impl Drop for InFlight {
    #[inline(always)]
    fn drop(&mut self) {
        // Release: the copy happens before a writer that reads this value goes on to drop
        // the memory.
        self.slot.count.store(self.count + 1, Ordering::Release);
    }
}

/// Announces a copy in the space with id `space` on this thread; `None` if the thread has no slot and cannot get one, or
/// is already copying (a nested call from a signal handler): take the snapshot path then.
/// The caller loads the generation it checks with `SeqCst` after this.
#[inline(always)]
pub(super) fn enter(space: u64) -> Option<InFlight> {
    let mut slot = MINE.with(Cell::get);
    if slot.is_null() {
        slot = claim()?;
    }
    // SAFETY: slots are leaked, so the pointer is valid forever; this thread owns the slot.
    let slot = unsafe { &*slot };
    let count = slot.count.load(Ordering::Relaxed);
    if count & 1 != 0 {
        return None;
    }
    // Ordered before the count by the swap (a release): a writer that reads the odd count
    // reads this id, or one a later copy wrote after this one ended.
    slot.space.store(space, Ordering::Relaxed);
    slot.count.swap(count + 1, Ordering::SeqCst);
    Some(InFlight {
        slot,
        count: count + 1,
    })
}

/// How a read of the published snapshot (`current`) is covered.
pub(super) enum Entry {
    /// Announced now; the announcement ends when this is dropped.
    Entered(InFlight),
    /// This thread is already announced in the same space (a copy, an outer read): that
    /// announcement covers the read, which must end before it.
    Inside,
    /// No announcement possible: no slot, or announced in another space.
    Outside,
}

/// [`enter`] for a read of a space's published snapshot, which may be nested in a copy or an
/// outer read of the same space.
#[inline(always)]
pub(super) fn enter_nested(space: u64) -> Entry {
    let mut slot = MINE.with(Cell::get);
    if slot.is_null() {
        match claim() {
            Some(s) => slot = s,
            None => return Entry::Outside,
        }
    }
    // SAFETY: slots are leaked, so the pointer is valid forever; this thread owns the slot.
    let slot = unsafe { &*slot };
    let count = slot.count.load(Ordering::Relaxed);
    if count & 1 != 0 {
        // Written by this thread when it announced.
        return match slot.space.load(Ordering::Relaxed) == space {
            true => Entry::Inside,
            false => Entry::Outside,
        };
    }
    slot.space.store(space, Ordering::Relaxed);
    slot.count.swap(count + 1, Ordering::SeqCst);
    Entry::Entered(InFlight {
        slot,
        count: count + 1,
    })
}

/// Takes a free slot or pushes a new one, and arranges for it to be given back.
#[cold]
#[inline(never)]
fn claim() -> Option<*const Slot> {
    // Register the give-back first: if the thread's destructors already ran, no slot.
    RETURN.try_with(|_| ()).ok()?;
    let mut at = SLOTS.load(Ordering::Acquire).cast_const();
    while !at.is_null() {
        // SAFETY: slots are leaked.
        let slot = unsafe { &*at };
        if !slot.taken.load(Ordering::Relaxed)
            && slot
                .taken
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
        {
            MINE.with(|m| m.set(at));
            return Some(at);
        }
        at = slot.next;
    }
    let mut head = SLOTS.load(Ordering::Acquire);
    // Leaked: a writer may be reading any slot at any time, so none is ever freed.
    let slot = Box::into_raw(Box::new(Slot {
        count: AtomicU64::new(0),
        space: AtomicU64::new(0),
        taken: AtomicBool::new(true),
        next: head,
    }));
    // SeqCst, as the announcement: a writer that reads the list after its fence and misses
    // this slot is ordered before any copy announced in it.
    while let Err(now) = SLOTS.compare_exchange(head, slot, Ordering::SeqCst, Ordering::Acquire) {
        head = now;
        // SAFETY: not published yet, so this thread alone can reach the slot.
        unsafe { (*slot).next = now };
    }
    let at = slot.cast_const();
    MINE.with(|m| m.set(at));
    Some(at)
}

/// Waits until every copy in the space with id `space` announced before the caller's change
/// (published, generation bumped) has ended. Called by writers before they drop the snapshot
/// they replaced.
pub(super) fn wait_for_copies(space: u64) {
    fence(Ordering::SeqCst);
    let mut at = SLOTS.load(Ordering::SeqCst).cast_const();
    while !at.is_null() {
        // SAFETY: slots are leaked.
        let slot = unsafe { &*at };
        let seen = slot.count.load(Ordering::Acquire);
        if seen & 1 != 0 && slot.space.load(Ordering::Relaxed) == space {
            let mut spins = 0u32;
            while slot.count.load(Ordering::Acquire) == seen {
                spins += 1;
                if spins < 128 {
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
        at = slot.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_writer_waits_for_a_copy_in_its_space_announced_before_it() {
        let copy = enter(7).expect("a slot");
        let done = Arc::new(AtomicUsize::new(0));
        let d = done.clone();
        let writer = std::thread::spawn(move || {
            // A writer of another space does not wait for it.
            wait_for_copies(8);
            d.store(1, Ordering::SeqCst);
            wait_for_copies(7);
            d.store(2, Ordering::SeqCst);
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(done.load(Ordering::SeqCst), 1, "returned during the copy");
        drop(copy);
        writer.join().unwrap();
        assert_eq!(done.load(Ordering::SeqCst), 2);
        // Nothing in flight: returns at once.
        wait_for_copies(7);
    }

    #[test]
    fn slots_are_given_back_when_threads_exit_and_reused() {
        let count = || {
            let (mut n, mut at) = (0, SLOTS.load(Ordering::Acquire).cast_const());
            while !at.is_null() {
                n += 1;
                // SAFETY: slots are leaked.
                at = unsafe { &*at }.next;
            }
            n
        };
        let before = count();
        for _ in 0..100 {
            std::thread::spawn(|| assert!(enter(1).is_some()))
                .join()
                .unwrap();
        }
        // Other tests' threads may push a few meanwhile; without reuse there would be 100.
        assert!(count() - before < 20, "{} new slots", count() - before);
        let first = enter(1);
        assert!(first.is_some());
        drop(first);
        let outer = enter(1);
        assert!(outer.is_some(), "one after another");
        assert!(enter(1).is_none(), "nested: the snapshot path");
        drop(outer);
    }
}
