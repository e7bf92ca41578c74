//! The memslot table: guest physical addresses to host virtual addresses.
//!
//! A VM's RAM is a set of slots, each mapping a guest-physical range onto part of a [`Backing`](crate::Backing).
//! The table is read far more often than it changes — every emulated device access, every vCPU
//! exit that touches guest memory translates an address — so readers never lock:
//!
//! * The slots live in an immutable [`Snapshot`], sorted by guest address. A change (insert,
//!   remove, flag change, or any batch of them through [`SlotTable::update`]) builds a new
//!   snapshot and swaps it in atomically; writers serialize on a mutex among themselves only.
//! * A snapshot holds an `Arc` to every backing it names, so memory a reader can still reach stays
//!   mapped until the last reader drops the snapshot: a concurrent remove never makes a reader
//!   touch unmapped memory.
//! * A snapshot carries a bucket index over its slots, built with it: the guest range they span
//!   cut into equal power-of-two buckets (at most two per slot), each naming the one or two slots
//!   that can hold its addresses and where the second starts. A lookup by address — a cursor's
//!   miss or a plain lookup — searches there: one subtraction and shift, one bucket load, one
//!   compare, one entry load, at any slot count; a binary search only among the slots of a
//!   crowded bucket.
//! * A [`SlotCursor`] (one per vCPU or device thread) remembers the last slot it hit and the
//!   generation of the snapshot it came from (KVM's per-vCPU `last_used_slot`, from the patch
//!   "KVM: Cache the last used slot index per vCPU"). A hit
//!   costs one load of the table's generation counter — a cache line only writers write — and a
//!   bounds check; nothing shared is written on a lookup, so cursors on different threads never
//!   contend. When the generation moved, the cursor reloads the snapshot and searches again: a
//!   stale cursor is slower once, never wrong.
//! * A cursor whose hit test keeps failing (random addresses over a few slots, where guessing
//!   wrong costs more than the search) stops remembering and searches every address for a
//!   while, then tries remembering again (the `adapt` module). The answers are the same either
//!   way; only their cost differs.
//!
//! Guest memory is reached through the table with [`SlotTable::read`], [`SlotTable::write`] and
//! [`SlotTable::copy_within`], which may cross slot boundaries. They check the whole range first
//! — unmapped memory is EFAULT, a write into a read-only slot is EFAULT as in KVM — and copy only
//! if all of it is there. Writes through the table mark the slot's dirty bitmap when the slot has
//! [`SlotFlags::LOG_DIRTY`]: device-model writes that KVM's own dirty log cannot see.
//!
//! The module's parts, by concept:
//!
//! * `spec`: what a slot is — [`SlotId`], [`SlotFlags`], [`SlotSpec`] and the installed [`Slot`].
//! * `index`: the address index a snapshot carries (packed entries, power-of-two buckets) and
//!   the [`GpaTranslation`] a lookup answers.
//! * `snapshot`: [`Snapshot`], the table at one generation, and guest memory reached through it.
//! * `table`: [`SlotTable`] and its batches of changes, [`SlotEdit`].
//! * `cursor`: [`SlotCursor`], the per-thread view that remembers its last hit.

mod cursor;
mod index;
mod snapshot;
mod spec;
mod table;
#[cfg(test)]
mod tests;

pub use cursor::SlotCursor;
pub use index::GpaTranslation;
pub use snapshot::Snapshot;
pub use spec::{DEFAULT_MAX_SLOTS, Slot, SlotFlags, SlotId, SlotSpec};
pub use table::{SlotEdit, SlotTable};

use cursor::NO_HIT;
