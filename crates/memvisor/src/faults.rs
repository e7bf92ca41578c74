//! TEST ONLY (feature `test-hooks`): the one set of switches that break memvisor on purpose, so
//! that the real-guest trials' negative controls can show their checks fail.
//!
//! The model: a [`Faults`] is a plain value. The server parses it once, from the process's
//! `MEMVISOR_TEST_*` environment variables ([`Faults::from_env`], the only code that reads them),
//! and gives it to what it builds: a [`DmaConfig`](crate::DmaConfig) (the DMA spaces, their dirty
//! bitmaps, and the vfio-user server built on one), a [`SlotTable`](crate::SlotTable) (its dirty
//! bitmaps), the pin registry, the vhost-user back end (which hands it to its devices through
//! their memory) and the KVM binding's options. Each object keeps the switches it acts on and
//! reads them where it would misbehave; nothing reads the environment later. A value built by
//! hand ([`Faults::default`] with fields set) is how tests turn one switch on without touching
//! the process's environment.
//!
//! The module, the type and every field the constructors take exist only in a build with the
//! `test-hooks` feature: nothing of it ships.

/// Which faults to inject; all off by default. Each field names the environment variable
/// [`Faults::from_env`] reads it from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// `MEMVISOR_TEST_IGNORE_INVALIDATE=IOVA` (hex, `0x` optional): the vhost-user back end
    /// acknowledges IOTLB invalidations of ranges starting at this IOVA and does not perform
    /// them, so requests keep reaching memory the guest took back (the hostile trial's race
    /// phase must catch it). Every other invalidation goes through.
    pub ignore_invalidate: Option<u64>,
    /// `MEMVISOR_TEST_LEAK_ON_HANGUP`: a departed peer's memory stays mapped. The vhost-user
    /// back end keeps a leaving frontend's memory table and dirty log; the vfio-user server
    /// keeps a dead client's DMA table, its mappings, locks and pins (the frontend-dies and
    /// client-dies trials' release checks must fail).
    pub leak_on_hangup: bool,
    /// `MEMVISOR_TEST_NO_INFLIGHT`: the vhost-user back end withholds
    /// `VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`, so a frontend restarting it after a crash
    /// restarts each ring at its used index (the crash trial's negative control).
    pub no_inflight: bool,
    /// `MEMVISOR_TEST_REORDER`: the blk device completes each batch of reads and writes last
    /// first, [`REORDER_GAP`] apart: out of order, as a device may, and slowly enough that a
    /// back end killed at a random moment is likely caught with part of a batch returned.
    pub reorder: bool,
    /// `MEMVISOR_TEST_BALLOON_STATS_FROZEN`: the balloon keeps the driver's statistics buffer
    /// and never asks for a fresh one (the statistics trial must then fail).
    pub balloon_stats_frozen: bool,
    /// `MEMVISOR_TEST_LOCKED_BLK_PINS`: the blk device pins its requests' pages as before issue
    /// 45, locked and charged to `RLIMIT_MEMLOCK` (`pin_pages`), a refused pin answered `IOERR`
    /// (the memlock trial's negative control must see I/O errors in the guest).
    pub locked_blk_pins: bool,
    /// `MEMVISOR_TEST_MAX_QUEUE_SIZE=N`: no vhost-user device takes a ring of more than `N`
    /// entries, the limit of 256 the back end once had (the queue-size trials' negative control).
    pub max_queue_size: Option<u16>,
    /// `MEMVISOR_TEST_HIDE_IO_ERRORS`: a blk request whose I/O on the image failed is answered
    /// OK and not counted as failed (the disk-fault trial's negative control).
    pub hide_io_errors: bool,
    /// `MEMVISOR_TEST_DROP_WRITES`: blk writes are answered OK and never reach the image (the
    /// libblkio trial's negative control).
    pub drop_writes: bool,
    /// `MEMVISOR_TEST_NO_DIRTY_LOG`: the vhost-user back end tracks dirty pages but never
    /// writes them to the frontend's log, so a migration loses what the device wrote (the
    /// migration trial's negative control).
    pub no_dirty_log: bool,
    /// `MEMVISOR_TEST_NO_DIRTY_SUMMARY`: dirty bitmaps built with these faults set page bits
    /// and no summary bit, so drains miss the marks (`guest/trial.sh mig --no-summary`).
    pub no_dirty_summary: bool,
    /// `MEMVISOR_TEST_COUNT_REFUSED_LOCKS`: a pin registry hold refused for want of room leaves
    /// the pages it asked for charged (a rollback that forgets to uncount), so the registry's
    /// account says more is locked than `VmLck`.
    pub count_refused_locks: bool,
    /// `MEMVISOR_TEST_RINGS_ON_PVM`: the KVM binding lets dirty rings through on PVM, where it
    /// otherwise refuses them (the negative control of the refusal, and the ring tests whose
    /// guests cannot overrun a ring).
    pub rings_on_pvm: bool,
    /// `MEMVISOR_TEST_IGNORE_UNMAP`: the vfio-user server answers `DMA_UNMAP` as done but keeps
    /// the mappings until the IOVA is mapped again (a forgetful IOMMU).
    pub ignore_unmap: bool,
    /// `MEMVISOR_TEST_UNMAP_BUSY`: the vfio-user server refuses `DMA_UNMAP` with EBUSY while the
    /// device holds pins, as it did before it waited for the device.
    pub unmap_busy: bool,
    /// `MEMVISOR_TEST_SILENT_RESIZE`: `blk-resize` changes the blk device's capacity but the
    /// back end sends no `CONFIG_CHANGE_MSG`, while the `DEVICE_RESIZED` event still says the
    /// frontend was told (the QMP trial's resize step must fail: the guest never sees the size).
    pub silent_resize: bool,
    /// `MEMVISOR_TEST_IGNORE_THROTTLE`: `blk-set-throttle` is accepted and shown, and the blk
    /// device never holds a request back for it (the throttle trial's negative control).
    pub ignore_throttle: bool,
    /// `MEMVISOR_TEST_FIXED_NO_EVICT`: the blk device's io_uring fixed buffers ignore a
    /// discard's request to give a chunk up and claim nothing pinned, so a balloon discard frees
    /// pages the kernel keeps pinned for I/O (the eviction test's and the `balloon --fixed`
    /// trial's negative control).
    pub fixed_no_evict: bool,
    /// `MEMVISOR_TEST_NO_FIXED`: the blk device never uses fixed buffers, even when asked (the
    /// `blk --fixed` trial's negative control).
    pub no_fixed: bool,
}

/// The pause between two completions of a batch under [`Faults::reorder`].
pub const REORDER_GAP: std::time::Duration = std::time::Duration::from_millis(20);

impl Faults {
    /// The switches the process's `MEMVISOR_TEST_*` environment variables turn on: a flag is on
    /// when its variable is set at all; a valued switch whose value does not parse stays off.
    /// Logs a `TEST ONLY` warning for each switch that is on, once, here.
    pub fn from_env() -> Faults {
        Faults::from_lookup(|name| std::env::var(name).ok())
    }

    /// [`Faults::from_env`] over any source of variables (`lookup` returns a variable's value,
    /// `None` when unset).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Faults {
        let flag = |name: &str, what: &str| {
            let on = lookup(name).is_some();
            if on {
                log::warn!("TEST ONLY ({name}): {what}");
            }
            on
        };
        let ignore_invalidate = lookup("MEMVISOR_TEST_IGNORE_INVALIDATE")
            .and_then(|v| u64::from_str_radix(v.trim_start_matches("0x"), 16).ok());
        if let Some(iova) = ignore_invalidate {
            log::warn!(
                "TEST ONLY: IOTLB invalidations at iova {iova:#x} are acknowledged and ignored"
            );
        }
        let max_queue_size = lookup("MEMVISOR_TEST_MAX_QUEUE_SIZE").and_then(|v| v.parse().ok());
        if let Some(max) = max_queue_size {
            log::warn!("TEST ONLY: rings of more than {max} entries are refused");
        }
        Faults {
            ignore_invalidate,
            leak_on_hangup: flag(
                "MEMVISOR_TEST_LEAK_ON_HANGUP",
                "a departed peer's memory, log, locks and pins stay mapped",
            ),
            no_inflight: flag("MEMVISOR_TEST_NO_INFLIGHT", "INFLIGHT_SHMFD is not offered"),
            reorder: flag("MEMVISOR_TEST_REORDER", "batches complete last first"),
            balloon_stats_frozen: flag(
                "MEMVISOR_TEST_BALLOON_STATS_FROZEN",
                "the balloon never asks for fresh statistics",
            ),
            locked_blk_pins: flag(
                "MEMVISOR_TEST_LOCKED_BLK_PINS",
                "blk pins are locked and charged; a refused one is IOERR",
            ),
            max_queue_size,
            hide_io_errors: flag(
                "MEMVISOR_TEST_HIDE_IO_ERRORS",
                "failed blk I/O is answered OK",
            ),
            drop_writes: flag(
                "MEMVISOR_TEST_DROP_WRITES",
                "writes are answered OK and dropped",
            ),
            no_dirty_log: flag(
                "MEMVISOR_TEST_NO_DIRTY_LOG",
                "the migration dirty log stays empty; migrations lose device writes",
            ),
            no_dirty_summary: flag(
                "MEMVISOR_TEST_NO_DIRTY_SUMMARY",
                "dirty marks skip the summary levels; drains miss them",
            ),
            count_refused_locks: flag(
                "MEMVISOR_TEST_COUNT_REFUSED_LOCKS",
                "refused locks stay charged to the pin registry",
            ),
            rings_on_pvm: flag(
                "MEMVISOR_TEST_RINGS_ON_PVM",
                "dirty rings are let through on PVM",
            ),
            ignore_unmap: flag(
                "MEMVISOR_TEST_IGNORE_UNMAP",
                "DMA_UNMAP is answered without unmapping",
            ),
            unmap_busy: flag(
                "MEMVISOR_TEST_UNMAP_BUSY",
                "DMA_UNMAP is refused with EBUSY while the device holds pins",
            ),
            silent_resize: flag(
                "MEMVISOR_TEST_SILENT_RESIZE",
                "blk-resize is not told to the frontend",
            ),
            ignore_throttle: flag(
                "MEMVISOR_TEST_IGNORE_THROTTLE",
                "blk throttles are accepted and never delay a request",
            ),
            fixed_no_evict: flag(
                "MEMVISOR_TEST_FIXED_NO_EVICT",
                "fixed buffers are not evicted before a discard",
            ),
            no_fixed: flag("MEMVISOR_TEST_NO_FIXED", "blk fixed buffers are never used"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(vars: &[(&str, &str)]) -> Faults {
        Faults::from_lookup(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn nothing_set_is_no_fault() {
        assert_eq!(parse(&[]), Faults::default());
    }

    #[test]
    fn each_variable_turns_on_its_switch_only() {
        let f = parse(&[("MEMVISOR_TEST_HIDE_IO_ERRORS", "")]);
        assert_eq!(
            f,
            Faults {
                hide_io_errors: true,
                ..Faults::default()
            }
        );
        let f = parse(&[
            ("MEMVISOR_TEST_IGNORE_INVALIDATE", "0x30000000"),
            ("MEMVISOR_TEST_MAX_QUEUE_SIZE", "256"),
        ]);
        assert_eq!(f.ignore_invalidate, Some(0x3000_0000));
        assert_eq!(f.max_queue_size, Some(256));
        assert!(!f.hide_io_errors);
    }

    #[test]
    fn a_value_that_does_not_parse_leaves_its_switch_off() {
        let f = parse(&[
            ("MEMVISOR_TEST_IGNORE_INVALIDATE", "zz"),
            ("MEMVISOR_TEST_MAX_QUEUE_SIZE", "70000"),
        ]);
        assert_eq!(f, Faults::default());
    }
}
