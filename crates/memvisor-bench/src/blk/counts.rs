//! What memvisor's blk device counted over one row of `memvisor bench blk`, read from the
//! `--stats` file it writes on exit: the time its data path spent holding and releasing each
//! request's buffers and, with registered buffers on, where its reads and writes went (io_uring
//! fixed transfers, or the ordinary way and why) and the chunks it registered. The other back
//! ends and the limit have none of it ([`DeviceCounts::NONE`]).

use std::path::Path;

use super::STATS;

/// What memvisor's device counted over one row. These are the device's own counters (`holds`,
/// `hold_ns`, `release_ns`, `fixed`, `fixed_ordinary`, `fixed_fallbacks`, `chunks_registered`,
/// `register_ns`, `evictions` of `memvisor_vhost::blk::BlkStats`, flattened into the report's
/// top level: the same names `query-stats` gives), not the `pin_cost` object kept for older
/// readers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct DeviceCounts {
    /// Hold time per held request (NaN when none was held).
    pub hold_ns: f64,
    /// Release time per held request (NaN when none was held).
    pub release_ns: f64,
    /// Shares of the row's reads and writes, in percent: sent as io_uring fixed transfers,
    /// sent the ordinary way for want of a registered chunk (cold, evicted, over two chunks,
    /// memory that may not be registered), and sent the ordinary way because the host refused
    /// registration. All 0 with fixed buffers off.
    pub fixed_pct: f64,
    pub ordinary_pct: f64,
    pub fallback_pct: f64,
    /// 2 MiB chunks registered over the row, and the time registering them took.
    pub chunks: f64,
    pub register_ns: f64,
    /// Registered chunks given up before a discard.
    pub evictions: f64,
}

impl DeviceCounts {
    /// No figure: a back end other than memvisor, the limit, or a report without them.
    pub const NONE: DeviceCounts = DeviceCounts {
        hold_ns: f64::NAN,
        release_ns: f64::NAN,
        fixed_pct: f64::NAN,
        ordinary_pct: f64::NAN,
        fallback_pct: f64::NAN,
        chunks: f64::NAN,
        register_ns: f64::NAN,
        evictions: f64::NAN,
    };
}

/// [`DeviceCounts`] from memvisor's `--stats` file in `dir`.
pub(super) fn device_counts(dir: &Path) -> Option<DeviceCounts> {
    let text = std::fs::read_to_string(dir.join(STATS)).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    device_counts_of(&v)
}

/// [`device_counts`] of a parsed report: `None` when it did no read or write (no share to
/// give) or lacks a counter (a binary older than registered buffers).
fn device_counts_of(v: &serde_json::Value) -> Option<DeviceCounts> {
    let get = |k: &str| v.get(k).and_then(|x| x.as_u64());
    let requests = (get("reads")? + get("writes")?) as f64;
    if requests == 0.0 {
        return None;
    }
    let per_hold = |k: &str| -> Option<f64> {
        let holds = get("holds")?;
        Some(if holds == 0 {
            f64::NAN
        } else {
            get(k)? as f64 / holds as f64
        })
    };
    let pct = |k: &str| -> Option<f64> { Some(100.0 * get(k)? as f64 / requests) };
    Some(DeviceCounts {
        hold_ns: per_hold("hold_ns")?,
        release_ns: per_hold("release_ns")?,
        fixed_pct: pct("fixed")?,
        ordinary_pct: pct("fixed_ordinary")?,
        fallback_pct: pct("fixed_fallbacks")?,
        chunks: get("chunks_registered")? as f64,
        register_ns: get("register_ns")? as f64,
        evictions: get("evictions")? as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_counts_read_the_device_counters() {
        let v = serde_json::json!({
            "reads": 6, "writes": 2,
            "holds": 4, "hold_ns": 2000, "release_ns": 1000,
            "fixed": 4, "fixed_ordinary": 2, "fixed_fallbacks": 1,
            "chunks_registered": 3, "register_ns": 6000000, "evictions": 1,
            "pin_cost": {"pins": 1, "pin_ns": 9, "unpins": 1, "unpin_ns": 9}
        });
        let d = device_counts_of(&v).unwrap();
        assert_eq!((d.hold_ns, d.release_ns), (500.0, 250.0));
        assert_eq!(
            (d.fixed_pct, d.ordinary_pct, d.fallback_pct),
            (50.0, 25.0, 12.5)
        );
        assert_eq!((d.chunks, d.register_ns, d.evictions), (3.0, 6e6, 1.0));
        // Every request fixed and none held: no hold figure rather than a division by zero.
        let all_fixed = serde_json::json!({
            "reads": 2, "writes": 0, "holds": 0, "hold_ns": 0, "release_ns": 0,
            "fixed": 2, "fixed_ordinary": 0, "fixed_fallbacks": 0,
            "chunks_registered": 1, "register_ns": 1, "evictions": 0
        });
        let d = device_counts_of(&all_fixed).unwrap();
        assert!(d.hold_ns.is_nan() && d.release_ns.is_nan());
        assert_eq!(d.fixed_pct, 100.0);
        // No read or write: no share.
        let idle = serde_json::json!({"reads": 0, "writes": 0, "holds": 0});
        assert_eq!(device_counts_of(&idle), None);
        // A binary older than registered buffers: no figure, not zeros.
        let old = serde_json::json!({"reads": 1, "writes": 0, "holds": 1, "hold_ns": 5,
                                     "release_ns": 5});
        assert_eq!(device_counts_of(&old), None);
    }
}
