//! TEST ONLY (feature `test-hooks`): switches that break the back end on purpose, so that the
//! real-guest trials' negative controls can show their checks fail. Each is read once from an
//! environment variable, says so in the log when on, and exists only in a test-hooks build;
//! nothing else should use them.

use memvisor::SharedLog;

use crate::memory::FrontendMemory;

/// With `MEMVISOR_TEST_IGNORE_INVALIDATE=IOVA` (hex), IOTLB invalidations of ranges starting at
/// that IOVA are acknowledged and not performed, so requests keep reaching memory the guest
/// took back there. The real-guest hostile trial's race phase must catch it; every other
/// invalidation goes through, so the rest of the trial runs as usual.
pub(crate) fn ignored_invalidation() -> Option<u64> {
    static IGNORE: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *IGNORE.get_or_init(|| {
        let v = std::env::var("MEMVISOR_TEST_IGNORE_INVALIDATE").ok()?;
        let iova = u64::from_str_radix(v.trim_start_matches("0x"), 16).ok()?;
        log::warn!("TEST ONLY: IOTLB invalidations at iova {iova:#x} are acknowledged and ignored");
        Some(iova)
    })
}

/// With `MEMVISOR_TEST_LEAK_ON_HANGUP` set, a frontend that leaves has its memory table and
/// dirty log kept mapped — the slot snapshot (which holds every region's backing) and the log
/// go into `stash` instead of being dropped — so the real-guest frontend-dies trial's release
/// check must fail. The device is still reset and the next frontend served.
pub(crate) fn leak_on_hangup(
    stash: &mut Vec<Box<dyn std::any::Any + Send>>,
    memory: &FrontendMemory,
    log: Option<std::sync::Arc<SharedLog>>,
) {
    static LEAK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *LEAK.get_or_init(|| {
        let on = std::env::var_os("MEMVISOR_TEST_LEAK_ON_HANGUP").is_some();
        if on {
            log::warn!("TEST ONLY: a departed frontend's memory and log stay mapped");
        }
        on
    });
    if on {
        stash.push(Box::new((memory.slots().snapshot(), log)));
    }
}

/// With `MEMVISOR_TEST_NO_INFLIGHT` set, the back end withholds
/// `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`: a frontend restarting it after a crash then restarts
/// each ring at its used index. The crash trial's negative control (with
/// [`reorder_completions`]) must lose or redo requests.
pub(crate) fn no_inflight() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let on = std::env::var_os("MEMVISOR_TEST_NO_INFLIGHT").is_some();
        if on {
            log::warn!("TEST ONLY: INFLIGHT_SHMFD is not offered");
        }
        on
    })
}

/// The pause between two completions of a batch under [`reorder_completions`].
pub(crate) const REORDER_GAP: std::time::Duration = std::time::Duration::from_millis(20);

/// With `MEMVISOR_TEST_REORDER` set, the blk device completes each batch of reads and writes
/// last first, [`REORDER_GAP`] apart: out of order, as a device may, and slowly enough that a
/// back end killed at a random moment is likely caught with part of a batch returned, when the
/// used index does not say which requests completed.
pub(crate) fn reorder_completions() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let on = std::env::var_os("MEMVISOR_TEST_REORDER").is_some();
        if on {
            log::warn!("TEST ONLY: batches complete last first");
        }
        on
    })
}

/// With `MEMVISOR_TEST_BALLOON_STATS_FROZEN` set, the balloon keeps the driver's statistics
/// buffer and never asks for a fresh one, so only the figures the driver primed the queue with
/// arrive; the real-guest statistics trial must then FAIL.
pub(crate) fn balloon_stats_frozen() -> bool {
    static FROZEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FROZEN.get_or_init(|| {
        let on = std::env::var_os("MEMVISOR_TEST_BALLOON_STATS_FROZEN").is_some();
        if on {
            log::warn!("TEST ONLY: the balloon never asks for fresh statistics");
        }
        on
    })
}

/// The blk device's hold of `pages` for a request ([`memvisor::DmaSpace::hold_pages`]); with
/// `MEMVISOR_TEST_LOCKED_BLK_PINS` set, the blk device pins its requests' pages as it did
/// before issue 45: locked (`pin_pages`, mlock or a long-term pin) and charged to
/// `RLIMIT_MEMLOCK`, a pin the limit refuses answered `IOERR`. The real-guest memlock trial's
/// negative control must then see I/O errors in the guest.
pub(crate) fn blk_hold(
    dma: &memvisor::DmaSpace,
    pages: &[u64],
    prot: memvisor::Prot,
) -> memvisor::Result<Vec<memvisor::Hva>> {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let locked = *ON.get_or_init(|| {
        let on = std::env::var_os("MEMVISOR_TEST_LOCKED_BLK_PINS").is_some();
        if on {
            log::warn!("TEST ONLY: blk pins are locked and charged; a refused one is IOERR");
        }
        on
    });
    if locked {
        dma.pin_pages(pages, prot)
    } else {
        dma.hold_pages(pages, prot)
    }
}

/// With `MEMVISOR_TEST_MAX_QUEUE_SIZE=N`, no device takes a ring of more than `N` entries: the
/// limit of 256 the back end once had, put back for the queue-size trial's negative control
/// (a frontend asking for 1024 is refused, and the trial must fail).
pub(crate) fn max_queue_size() -> Option<u16> {
    static MAX: std::sync::OnceLock<Option<u16>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        let max = std::env::var("MEMVISOR_TEST_MAX_QUEUE_SIZE")
            .ok()?
            .parse()
            .ok()?;
        log::warn!("TEST ONLY: rings of more than {max} entries are refused");
        Some(max)
    })
}
