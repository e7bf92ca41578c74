//! What this host lets an experiment take. Experiments ask before they allocate large buffers or
//! pin memory, so that a case the machine cannot run is skipped with the reason (an entry
//! `"<case>: needs ..."` in [`Outcome::skipped`](super::Outcome::skipped)) instead of failing the
//! whole experiment or waking the OOM killer:
//!
//! - [`check_free`]: room in `MemAvailable` for a buffer, with [`HEADROOM`] to spare;
//! - [`check_lock`]: room to lock (pin) that much memory: CAP_IPC_LOCK (root has it), or an
//!   `RLIMIT_MEMLOCK` above what the process has locked already (`VmLck`).

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Memory left over for everything else (page tables, the report, the rest of the system).
pub const HEADROOM: u64 = GIB;

/// `CAP_IPC_LOCK`: mlock without limit.
pub const CAP_IPC_LOCK: u32 = 14;
/// `CAP_SYS_ADMIN`: among others, physical frame numbers in `/proc/self/pagemap`.
pub const CAP_SYS_ADMIN: u32 = 21;

/// A `kB` field of a procfs file such as `/proc/meminfo` (`MemAvailable:   123 kB`), in bytes.
fn kb_field(path: &str, field: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| {
            let v = l.strip_prefix(field)?.strip_prefix(':')?;
            v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()
        })
        .map(|kib| kib * KIB)
}

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn mem_available() -> Option<u64> {
    kb_field("/proc/meminfo", "MemAvailable")
}

/// `Ok` when `MemAvailable` holds `bytes` plus [`HEADROOM`]; otherwise the reason, e.g.
/// "needs 17 GiB free, 10.3 GiB available". An unreadable `/proc/meminfo` lets the case run.
pub fn check_free(bytes: u64) -> Result<(), String> {
    let Some(available) = mem_available() else {
        return Ok(());
    };
    let needs = bytes.saturating_add(HEADROOM);
    if needs <= available {
        return Ok(());
    }
    Err(format!(
        "needs {} GiB free, {:.1} GiB available",
        needs.div_ceil(GIB),
        (available * 10 / GIB) as f64 / 10.0
    ))
}

/// Whether the process has capability `cap` in its effective set (`CapEff` in
/// `/proc/self/status`).
pub fn has_capability(cap: u32) -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|h| u64::from_str_radix(h.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << cap) != 0)
}

/// The soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited.
pub fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one struct rlimit that we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0 {
        return None;
    }
    (lim.rlim_cur != libc::RLIM_INFINITY).then_some(lim.rlim_cur)
}

/// `Ok` when the process may lock `bytes` more memory: with CAP_IPC_LOCK, or when
/// `RLIMIT_MEMLOCK` covers them on top of what it locks now; otherwise the reason, e.g.
/// "needs RLIMIT_MEMLOCK >= 513 MiB or root (ulimit -l 525312; it is 8 MiB)".
pub fn check_lock(bytes: u64) -> Result<(), String> {
    if has_capability(CAP_IPC_LOCK) {
        return Ok(());
    }
    let Some(limit) = memlock_limit() else {
        return Ok(());
    };
    let locked = kb_field("/proc/self/status", "VmLck").unwrap_or(0);
    let needs = bytes.saturating_add(locked);
    if needs <= limit {
        return Ok(());
    }
    Err(format!(
        "needs RLIMIT_MEMLOCK >= {} or root (ulimit -l {}; it is {})",
        amount(needs, true),
        needs.div_ceil(KIB),
        amount(limit, false)
    ))
}

/// `bytes` in whole GiB, MiB or KiB, rounded up or down: the largest unit that holds it
/// exactly or at least 10 times, so that rounding never moves it by more than a tenth.
fn amount(bytes: u64, up: bool) -> String {
    let fits = |unit: u64| bytes % unit == 0 && bytes >= unit || bytes >= 10 * unit;
    let (unit, name) = if fits(GIB) {
        (GIB, "GiB")
    } else if fits(MIB) {
        (MIB, "MiB")
    } else {
        (KIB, "KiB")
    };
    let n = if up {
        bytes.div_ceil(unit)
    } else {
        bytes / unit
    };
    format!("{n} {name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_round_the_right_way() {
        assert_eq!(amount(64 * KIB, false), "64 KiB");
        assert_eq!(amount(2 * MIB, true), "2 MiB");
        assert_eq!(amount(MIB + 8 * KIB, true), "1032 KiB");
        assert_eq!(amount(103 * MIB - 1, true), "103 MiB");
        assert_eq!(amount(103 * MIB - 1, false), "102 MiB");
        assert_eq!(amount(16 * GIB, true), "16 GiB");
        assert_eq!(amount(1536 * MIB, true), "1536 MiB");
        assert_eq!(amount(100, true), "1 KiB");
    }

    #[test]
    fn small_requests_pass_huge_ones_give_a_reason() {
        assert_eq!(
            check_free(0).is_ok(),
            mem_available().is_none_or(|a| a >= HEADROOM)
        );
        let why = check_free(u64::MAX / 2).unwrap_err();
        assert!(
            why.starts_with("needs ") && why.contains("GiB available"),
            "{why}"
        );
        assert!(check_lock(0).is_ok());
        match check_lock(u64::MAX / 2) {
            Ok(()) => assert!(has_capability(CAP_IPC_LOCK) || memlock_limit().is_none()),
            Err(why) => assert!(why.contains("RLIMIT_MEMLOCK >= ") && why.contains("ulimit -l")),
        }
    }
}
