//! What the kernel says about this process's memory, for tests that check by resident or locked
//! memory rather than by return codes: the areas of /proc/self/smaps, VmLck, and whether we are root.
#![allow(dead_code)] // each test binary uses part of it

/// One memory area of /proc/self/smaps: `[start, end)` and its field lines.
pub struct Vma {
    pub start: u64,
    pub end: u64,
    lines: Vec<String>,
}

impl Vma {
    /// A size field such as `Rss` or `AnonHugePages`, in KiB.
    pub fn kib(&self, field: &str) -> Option<u64> {
        self.lines.iter().find_map(|l| {
            let rest = l.strip_prefix(field)?.strip_prefix(':')?;
            rest.trim().trim_end_matches("kB").trim().parse().ok()
        })
    }

    /// Whether `VmFlags` holds `flag` (`lo`: locked).
    pub fn has_flag(&self, flag: &str) -> bool {
        self.lines.iter().any(|l| {
            l.strip_prefix("VmFlags:")
                .is_some_and(|f| f.split_whitespace().any(|x| x == flag))
        })
    }
}

/// The areas that overlap `[start, end)`, in address order.
pub fn vmas(start: u64, end: u64) -> Vec<Vma> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut out: Vec<Vma> = Vec::new();
    let mut inside = false;
    for line in smaps.lines() {
        let header = line
            .split_once(' ')
            .and_then(|(range, _)| range.split_once('-'))
            .and_then(|(s, e)| {
                Some((
                    u64::from_str_radix(s, 16).ok()?,
                    u64::from_str_radix(e, 16).ok()?,
                ))
            });
        if let Some((s, e)) = header {
            inside = s < end && start < e;
            if inside {
                out.push(Vma {
                    start: s,
                    end: e,
                    lines: Vec::new(),
                });
            }
        } else if inside {
            out.last_mut()
                .expect("pushed above")
                .lines
                .push(line.to_string());
        }
    }
    out
}

/// Sum of a size field over the areas overlapping `[start, end)`, in bytes.
pub fn smaps_sum(start: u64, end: u64, field: &str) -> u64 {
    vmas(start, end)
        .iter()
        .filter_map(|v| v.kib(field))
        .sum::<u64>()
        * 1024
}

pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// What the kernel says this process has locked (`VmLck` of /proc/self/status), in bytes.
pub fn vm_lck() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmLck:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmLck in /proc/self/status")
        * 1024
}

/// Whether this process may lock `bytes` more memory: with CAP_IPC_LOCK, or under
/// RLIMIT_MEMLOCK's soft limit. If not, prints that `test` is skipped and why.
pub fn may_lock(bytes: u64, test: &str) -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    if caps & (1 << 14) != 0 {
        return true;
    }
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) }, 0);
    let room = rl.rlim_cur.saturating_sub(vm_lck());
    if rl.rlim_cur == libc::RLIM_INFINITY || room >= bytes {
        return true;
    }
    skipped(&format!(
        "{test} locks up to {bytes} bytes; without CAP_IPC_LOCK, RLIMIT_MEMLOCK leaves {room}"
    ));
    false
}

/// Says "skipped: <what>" where the test runner shows it: on the process's real stderr.
/// libtest captures `println!` and `eprintln!` of passing tests (they show only with
/// `--nocapture`); a write to `io::stderr()` it does not capture.
pub fn skipped(what: &str) {
    use std::io::Write;
    // One write: `writeln!` writes each piece apart, and tests running beside this one would
    // cut the line.
    let _ = std::io::stderr().write_all(format!("skipped: {what}\n").as_bytes());
}
