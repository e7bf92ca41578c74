//! TEST ONLY (feature `test-hooks`): the two switches of [`memvisor::faults::Faults`] that take
//! more than a test of a flag where they act. The back end's faults are given at construction
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

/// The blk device's hold of `pages` for a request ([`memvisor::DmaSpace::hold_pages`]); with
/// [`Faults::locked_blk_pins`](memvisor::faults::Faults::locked_blk_pins), the blk device pins
/// its requests' pages as it did before issue 45: locked (`pin_pages`, mlock or a long-term pin)
/// and charged to `RLIMIT_MEMLOCK`, a pin the limit refuses answered `IOERR`. The real-guest
/// memlock trial's negative control must then see I/O errors in the guest.
pub(crate) fn blk_hold(
    dma: &memvisor::DmaSpace,
    pages: &[u64],
    prot: memvisor::Prot,
) -> memvisor::Result<Vec<memvisor::Hva>> {
    if dma.faults().locked_blk_pins {
        dma.pin_pages(pages, prot)
    } else {
        dma.hold_pages(pages, prot)
    }
}
