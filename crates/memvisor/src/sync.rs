//! Locks: one way to take a mutex, for the whole crate.
//!
//! memvisor's mutexes guard bookkeeping (writers of a table, pin counts, notifier lists, pools)
//! that every change leaves consistent before it can panic, so a lock poisoned by a panicking
//! thread still guards valid state: [`lock`] takes it anyway rather than spreading the panic to
//! every other vCPU or device thread. Condition-variable waits, which hand a guard back, use the
//! same rule in place (`unwrap_or_else(|e| e.into_inner())`).

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poisoning (see the module's comment).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
