//! The machine a benchmark ran on, recorded at the top of every report and in `results.json` so
//! numbers from different hosts are never compared blindly. Everything is read from procfs/sysfs
//! and `uname(2)` when the run starts; anything that cannot be read becomes "unknown" (or `None`)
//! instead of an error, because a missing detail must not stop a benchmark.
//!
//! A cloud guest often names its processor only "AMD EPYC", the same for hosts generations apart
//! whose caches differ fourfold (this project's machines have been both): so the report also
//! carries the processor's family, model and stepping, the core generation they stand for where
//! it is a known AMD one, the sizes of the caches one core sees, and whether the machine is a
//! virtual one. A lookup whose working set fits one core's L2 on one host and not on the next
//! is otherwise a regression no code caused.

use serde::Serialize;
use std::fs;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu_model: String,
    /// x86 `cpu family`, `model` and `stepping` from /proc/cpuinfo, when present.
    pub cpu_id: Option<CpuId>,
    /// The core generation `cpu_id` stands for, where it is a known AMD one ("Zen 4").
    pub cpu_core: Option<String>,
    /// Sizes of the caches cpu0 sees, one entry per cache: "L1d 32K", "L2 1024K", ...
    pub caches: Vec<String>,
    /// Whether the processor says it runs under a hypervisor (the x86 `hypervisor` flag);
    /// `None` where /proc/cpuinfo lists no flags (other architectures, or unreadable).
    pub virtual_machine: Option<bool>,
    /// Online logical CPUs.
    pub cores: u32,
    /// `MemTotal` in GiB.
    pub memory_gib: f64,
    /// Kernel release, e.g. "6.18.44".
    pub kernel: String,
    pub hostname: Option<String>,
    /// UTC, ISO 8601, e.g. "2025-11-21T22:38:05Z".
    pub date: String,
    /// Transparent huge page mode: "always", "madvise" or "never".
    pub thp: Option<String>,
    pub memvisor_version: String,
}

impl Machine {
    pub fn detect() -> Machine {
        let read = |path: &str| fs::read_to_string(path).unwrap_or_default();
        let uts = uname();
        let cpuinfo = read("/proc/cpuinfo");
        let cpu_model = ["model name", "Hardware", "Processor"]
            .iter()
            .find_map(|key| proc_field(&cpuinfo, key))
            .or_else(|| uts.as_ref().map(|u| u.machine.clone()))
            .unwrap_or_else(|| "unknown".to_string());
        let cpu_id = CpuId::parse(&cpuinfo);
        let cpu_core = cpu_id
            .filter(|_| proc_field(&cpuinfo, "vendor_id").as_deref() == Some("AuthenticAMD"))
            .and_then(|id| amd_core(id.family, id.model))
            .map(str::to_string);
        let virtual_machine = proc_field(&cpuinfo, "flags")
            .map(|flags| flags.split_whitespace().any(|f| f == "hypervisor"));
        let cores = parse_cpu_list(&read("/sys/devices/system/cpu/online"))
            .or_else(|| {
                std::thread::available_parallelism()
                    .ok()
                    .and_then(|n| u32::try_from(n.get()).ok())
            })
            .unwrap_or(1);
        let mem_kib: f64 = proc_field(&read("/proc/meminfo"), "MemTotal")
            .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0.0);
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Machine {
            cpu_model,
            cpu_id,
            cpu_core,
            caches: caches(std::path::Path::new("/sys/devices/system/cpu/cpu0/cache")),
            virtual_machine,
            cores,
            memory_gib: mem_kib / (1024.0 * 1024.0),
            kernel: uts
                .as_ref()
                .map_or_else(|| "unknown".to_string(), |u| u.release.clone()),
            hostname: uts.map(|u| u.nodename).filter(|h| !h.is_empty()),
            date: iso8601_utc(now),
            thp: bracketed(&read("/sys/kernel/mm/transparent_hugepage/enabled")),
            memvisor_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// One line, e.g. "AMD EPYC (family 25 model 17 stepping 1, Zen 4; L1d 32K, L1i 32K,
    /// L2 1024K, L3 32768K; virtual machine) · 2 cores · 23.5 GiB · Linux 6.18.44 · THP madvise".
    pub fn describe(&self) -> String {
        let mut about = Vec::new();
        if let Some(id) = self.cpu_id {
            let mut text = format!(
                "family {} model {} stepping {}",
                id.family, id.model, id.stepping
            );
            if let Some(core) = &self.cpu_core {
                text.push_str(", ");
                text.push_str(core);
            }
            about.push(text);
        }
        if !self.caches.is_empty() {
            about.push(self.caches.join(", "));
        }
        if self.virtual_machine == Some(true) {
            about.push("virtual machine".to_string());
        }
        let cpu = if about.is_empty() {
            self.cpu_model.clone()
        } else {
            format!("{} ({})", self.cpu_model, about.join("; "))
        };
        format!(
            "{} · {} cores · {:.1} GiB · Linux {} · THP {}",
            cpu,
            self.cores,
            self.memory_gib,
            self.kernel,
            self.thp.as_deref().unwrap_or("unavailable")
        )
    }
}

/// An x86 processor's identity as /proc/cpuinfo gives it (decimal there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct CpuId {
    pub family: u32,
    pub model: u32,
    pub stepping: u32,
}

impl CpuId {
    /// The first processor's `cpu family`, `model` and `stepping`; `None` unless all three are
    /// there (other architectures name their fields differently).
    fn parse(cpuinfo: &str) -> Option<CpuId> {
        let field = |key: &str| proc_field(cpuinfo, key)?.parse().ok();
        Some(CpuId {
            family: field("cpu family")?,
            model: field("model")?,
            stepping: field("stepping")?,
        })
    }
}

/// The core generation of an AMD processor of `family` and `model`: the model ranges Linux
/// assigns to each Zen generation (`bsp_init_amd` in arch/x86/kernel/cpu/amd.c, as of 6.18;
/// "Zen" covers Zen+ there too). `None` for a family or model outside them, which Linux warns
/// about as unknown.
fn amd_core(family: u32, model: u32) -> Option<&'static str> {
    Some(match (family, model) {
        (0x17, 0x00..=0x2f | 0x50..=0x5f) => "Zen",
        (0x17, 0x30..=0x4f | 0x60..=0x7f | 0x90..=0x91 | 0xa0..=0xaf) => "Zen 2",
        (0x19, 0x00..=0x0f | 0x20..=0x5f) => "Zen 3",
        (0x19, 0x10..=0x1f | 0x60..=0xaf) => "Zen 4",
        (0x1a, 0x00..=0x2f | 0x40..=0x4f | 0x60..=0x7f) => "Zen 5",
        (0x1a, 0x50..=0x5f | 0x80..=0xaf | 0xc0..=0xcf) => "Zen 6",
        _ => return None,
    })
}

/// The caches under `dir` (a CPU's sysfs `cache` directory), by level then kind, as "L1d 32K",
/// "L1i 32K", "L2 1024K": the size as sysfs writes it. Empty if nothing can be read.
fn caches(dir: &std::path::Path) -> Vec<String> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let read = |path: std::path::PathBuf| Some(fs::read_to_string(path).ok()?.trim().to_string());
    let mut found: Vec<(u32, String, String)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
        .filter_map(|e| {
            let level: u32 = read(e.path().join("level"))?.parse().ok()?;
            let suffix = match read(e.path().join("type"))?.as_str() {
                "Data" => "d",
                "Instruction" => "i",
                _ => "",
            };
            Some((level, suffix.to_string(), read(e.path().join("size"))?))
        })
        .collect();
    found.sort();
    found
        .into_iter()
        .map(|(level, suffix, size)| format!("L{level}{suffix} {size}"))
        .collect()
}

struct Uname {
    nodename: String,
    release: String,
    machine: String,
}

fn uname() -> Option<Uname> {
    // SAFETY: utsname consists only of c_char arrays, for which all-zero bytes are a valid value;
    // uname writes NUL-terminated strings into the struct, which we own and pass exclusively.
    let (rc, uts) = unsafe {
        let mut uts: libc::utsname = std::mem::zeroed();
        let rc = libc::uname(&mut uts);
        (rc, uts)
    };
    if rc != 0 {
        return None;
    }
    let text = |field: &[libc::c_char]| {
        let bytes: Vec<u8> = field
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    Some(Uname {
        nodename: text(&uts.nodename),
        release: text(&uts.release),
        machine: text(&uts.machine),
    })
}

/// The value of the first `key : value` line in a procfs file.
fn proc_field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k.trim() == key).then(|| v.trim().to_string())
    })
}

/// Counts the CPUs in a sysfs list such as "0-3,6,8-9".
fn parse_cpu_list(text: &str) -> Option<u32> {
    let mut count = 0;
    for part in text.trim().split(',') {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (u32, u32) = (lo.parse().ok()?, hi.parse().ok()?);
        count += hi.checked_sub(lo)? + 1;
    }
    Some(count)
}

/// The selected word in a sysfs choice list such as `always [madvise] never`.
fn bracketed(text: &str) -> Option<String> {
    let start = text.find('[')? + 1;
    let len = text[start..].find(']')?;
    Some(text[start..start + len].to_string())
}

/// Seconds since the Unix epoch as "YYYY-MM-DDThh:mm:ssZ" (proleptic Gregorian calendar).
fn iso8601_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Converts days since 1970-01-01 to (year, month, day). Works in 400-year eras (146097 days)
/// of years that start on March 1st, so the leap day is the last day of the shifted year.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let shifted = days + 719_468; // days from 0000-03-01 to 1970-01-01
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted - era * 146_097; // 0..=146096
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153; // 0 = March .. 11 = February
    let day = (day_of_year - (153 * month_from_march + 2) / 5 + 1) as u32;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(iso8601_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(iso8601_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(iso8601_utc(1_709_164_800 + 86_399), "2024-02-29T23:59:59Z");
        assert_eq!(iso8601_utc(1_709_251_200), "2024-03-01T00:00:00Z");
        assert_eq!(iso8601_utc(4_102_444_800), "2100-01-01T00:00:00Z");
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }

    #[test]
    fn parsers() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0-3,6,8-9"), Some(7));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(
            bracketed("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(bracketed("never"), None);
        let info = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n";
        assert_eq!(
            proc_field(info, "model name").as_deref(),
            Some("AMD EPYC 7B13")
        );
        assert_eq!(proc_field(info, "Hardware"), None);
    }

    #[test]
    fn processor_identity() {
        let info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n\
                    model name\t: AMD EPYC\nstepping\t: 1\n";
        let id = CpuId::parse(info).unwrap();
        assert_eq!((id.family, id.model, id.stepping), (25, 17, 1));
        assert_eq!(CpuId::parse("processor\t: 0\nHardware\t: BCM2835\n"), None);
        assert_eq!(amd_core(25, 17), Some("Zen 4"));
        assert_eq!(amd_core(25, 1), Some("Zen 3"));
        assert_eq!(amd_core(25, 0x61), Some("Zen 4"));
        assert_eq!(amd_core(25, 0x90), Some("Zen 4"));
        assert_eq!(amd_core(25, 0xb0), None);
        assert_eq!(amd_core(23, 0x31), Some("Zen 2"));
        assert_eq!(amd_core(23, 0x50), Some("Zen"));
        assert_eq!(amd_core(0x1a, 0x02), Some("Zen 5"));
        assert_eq!(amd_core(0x1a, 0x50), Some("Zen 6"));
        assert_eq!(amd_core(0x1a, 0x30), None);
        assert_eq!(amd_core(6, 0x55), None);
    }

    #[test]
    fn caches_in_level_order() {
        let dir = std::env::temp_dir().join(format!("memvisor-caches-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        for (index, level, kind, size) in [
            ("index3", "3", "Unified", "32768K"),
            ("index0", "1", "Data", "32K"),
            ("index2", "2", "Unified", "1024K"),
            ("index1", "1", "Instruction", "32K"),
        ] {
            let d = dir.join(index);
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("level"), format!("{level}\n")).unwrap();
            fs::write(d.join("type"), format!("{kind}\n")).unwrap();
            fs::write(d.join("size"), format!("{size}\n")).unwrap();
        }
        fs::create_dir_all(dir.join("power")).unwrap();
        assert_eq!(
            caches(&dir),
            ["L1d 32K", "L1i 32K", "L2 1024K", "L3 32768K"]
        );
        fs::remove_dir_all(&dir).unwrap();
        assert!(caches(&dir).is_empty());
    }

    #[test]
    fn detect_and_describe() {
        let m = Machine::detect();
        assert!(m.cores >= 1);
        assert!(m.memory_gib > 0.0, "MemTotal should be readable on Linux");
        assert_eq!(m.date.len(), "2025-11-21T22:38:05Z".len());
        let line = m.describe();
        assert!(line.contains(&format!(" · {} cores · ", m.cores)), "{line}");
        assert!(line.contains(&format!("Linux {}", m.kernel)), "{line}");
    }
}
