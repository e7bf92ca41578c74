//! TEST ONLY (feature `test-hooks`): the one switch of [`memvisor::faults::Faults`] that takes
//! more than a test of a flag where it acts (a frontend's leftovers kept). The back end's faults are given at construction
//! ([`crate::ProcessState::with_faults`], given to [`crate::Backend::new`]) and reach the devices through the frontend's memory
//! ([`FrontendMemory::faults`], and the DMA spaces' own copy, [`memvisor::DmaSpace::faults`]);
//! the other switches are read where they act. Nothing here reads the environment.

use memvisor::SharedLog;

use crate::memory::FrontendMemory;

/// With [`Faults::leak_on_hangup`](memvisor::faults::Faults::leak_on_hangup), a frontend that
/// leaves has its memory table and dirty log kept mapped — the slot snapshot (which holds every
/// region's backing) and the log go into `stash` instead of being dropped — so the real-guest
/// frontend-dies trial's release check must fail. The device is still reset and the next
/// frontend served.
pub(crate) fn leak_on_hangup(
    stash: &mut Vec<Box<dyn std::any::Any + Send>>,
    memory: &FrontendMemory,
    log: Option<std::sync::Arc<SharedLog>>,
) {
    if memory.faults().leak_on_hangup {
        stash.push(Box::new((memory.slots().snapshot(), log)));
    }
}
