//! Locked-memory accounting: how many bytes pins hold resident, against a limit.
//!
//! VFIO type1 charges every pinned page to the process's `locked_vm` and refuses with ENOMEM
//! past `RLIMIT_MEMLOCK`, unless the process has CAP_IPC_LOCK. memvisor does the same, once per
//! host page — the pin registry charges a page when its count goes 0 -> 1 and releases it on
//! 1 -> 0, so a page pinned through two IOVAs or by two devices is charged once (iommufd's rule;
//! type1 would count it twice). What the registry keeps locked after the last pin went (its lock
//! cache) is not charged: the account says what is pinned.
//!
//! [`Account`] lives inside the registry's lock: the check and the charge are one step, so
//! concurrent pins can never overshoot the limit between them. Reading the limit costs system
//! calls (`capget`, and `getrlimit` without CAP_IPC_LOCK) that would be a good part of a cached
//! pin, so the account keeps the limit as last read and reads it again before it refuses a pin
//! and whenever the kernel refuses an mlock: raising the rlimit of a running process takes
//! effect at the next pin; lowering it (or dropping CAP_IPC_LOCK) takes effect when the kernel
//! first holds an mlock to it — the kernel checks every mlock itself, so nothing is ever locked
//! past its limit; only a pin served from locks the registry already holds is checked against
//! the limit as last read (the kernel does not re-check held locks either).

use crate::error::{Error, Result};

/// How much memory pins may lock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LockLimit {
    /// `RLIMIT_MEMLOCK`'s soft limit, as the kernel would apply it: no limit with CAP_IPC_LOCK or
    /// an infinite rlimit.
    #[default]
    Rlimit,
    /// At most this many bytes, whatever the rlimit and capabilities say.
    Bytes(u64),
    /// No limit.
    Unlimited,
}

impl LockLimit {
    /// The limit in bytes and where it came from; `None` when there is none.
    pub fn resolve(self) -> Option<(u64, &'static str)> {
        match self {
            LockLimit::Bytes(n) => Some((n, "caller-set")),
            LockLimit::Unlimited => None,
            LockLimit::Rlimit => {
                if capable(Capability::IpcLock) {
                    return None;
                }
                let mut rl = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                // SAFETY: getrlimit writes one rlimit into the struct we own.
                let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
                if rc != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
                    return None;
                }
                Some((rl.rlim_cur, "RLIMIT_MEMLOCK"))
            }
        }
    }
}

/// Bytes locked by pins, and the limit they are held to.
#[derive(Debug, Default)]
pub(crate) struct Account {
    limit: LockLimit,
    locked: u64,
    /// `limit` as last resolved.
    resolved: Option<(u64, &'static str)>,
    /// What the kernel holds this process's locks to (`RLIMIT_MEMLOCK` without CAP_IPC_LOCK),
    /// as last read.
    kernel: Option<u64>,
}

impl Account {
    pub fn new(limit: LockLimit) -> Self {
        let mut a = Account {
            limit,
            ..Account::default()
        };
        a.refresh();
        a
    }

    /// The limit as configured.
    pub fn limit(&self) -> LockLimit {
        self.limit
    }

    /// Changes the limit (read at once).
    pub fn set_limit(&mut self, limit: LockLimit) {
        self.limit = limit;
        self.refresh();
    }

    /// Reads the limit and the kernel's rlimit again.
    pub fn refresh(&mut self) {
        self.kernel = LockLimit::Rlimit.resolve().map(|(n, _)| n);
        self.resolved = match self.limit {
            LockLimit::Rlimit => self.kernel.map(|n| (n, "RLIMIT_MEMLOCK")),
            other => other.resolve(),
        };
    }

    /// The most bytes this process may hold locked as far as the registry knows: the lower of
    /// the limit and the kernel's, as last read; `None` for no limit.
    pub fn cap(&self) -> Option<u64> {
        match (self.resolved.map(|r| r.0), self.kernel) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Bytes charged now.
    pub fn locked(&self) -> u64 {
        self.locked
    }

    /// Whether `bytes` more fit under the limit; ENOMEM naming the limit, the request and what
    /// is already locked if not. A refusal reads the limit again first.
    /// Nothing more (`bytes` 0: a pin of memory already held) always fits, even when a lowered
    /// limit is below what is held already: the kernel keeps held locks whatever the limit.
    pub fn check(&mut self, bytes: u64) -> Result<()> {
        if bytes == 0 || self.fits(bytes) {
            return Ok(());
        }
        self.refresh();
        let Some((limit, kind)) = self.resolved else {
            return Ok(());
        };
        match self.locked.checked_add(bytes) {
            Some(total) if total <= limit => Ok(()),
            total => Err(Error::LockLimit {
                asked: bytes,
                locked: self.locked,
                total: total.unwrap_or(u64::MAX),
                limit,
                limit_kind: kind,
            }),
        }
    }

    /// Whether `bytes` more fit under the limit as last read.
    fn fits(&self, bytes: u64) -> bool {
        match self.resolved {
            None => true,
            Some((limit, _)) => self.locked.checked_add(bytes).is_some_and(|t| t <= limit),
        }
    }

    /// Charges `bytes` whatever the limit: memory that is locked and could not be unlocked.
    pub fn force_charge(&mut self, bytes: u64) {
        self.locked = self.locked.saturating_add(bytes);
    }

    /// Charges `bytes` if they fit.
    pub fn charge(&mut self, bytes: u64) -> Result<()> {
        self.check(bytes)?;
        self.locked = self.locked.saturating_add(bytes);
        Ok(())
    }

    /// Gives back `bytes` charged earlier.
    pub fn release(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.locked, "releasing more than was charged");
        self.locked = self.locked.saturating_sub(bytes);
    }
}

/// The Linux capabilities memvisor asks about.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Capability {
    /// Lock memory without limit.
    IpcLock = 14,
    /// Read physical frame numbers from /proc/self/pagemap.
    SysAdmin = 21,
}

/// Whether the process has `cap` in its effective set: one `capget`, or /proc/self/status if
/// that fails.
pub(crate) fn capable(cap: Capability) -> bool {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    // _LINUX_CAPABILITY_VERSION_3: two Data words, capabilities 0-31 and 32-63.
    let mut header = Header {
        version: 0x2008_0522,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget reads `header` and writes at most two `Data` (version 3) into `data`, both
    // ours and live for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_capget,
            &mut header as *mut Header,
            data.as_mut_ptr(),
        )
    };
    let bit = cap as u32;
    if rc == 0 {
        return data[(bit / 32) as usize].effective & (1 << (bit % 32)) != 0;
    }
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|bits| bits & (1 << cap as u32) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_limit_refuses_past_it_and_says_by_how_much() {
        let mut a = Account::new(LockLimit::Bytes(8192));
        a.charge(4096).unwrap();
        let e = a.charge(8192).unwrap_err();
        assert_eq!(e.errno(), libc::ENOMEM);
        let msg = e.to_string();
        assert!(msg.contains("0x2000 more bytes"), "{msg}");
        assert!(msg.contains("limit of 0x2000"), "{msg}");
        assert!(msg.contains("0x1000 already locked"), "{msg}");
        assert_eq!(a.locked(), 4096);
        a.charge(4096).unwrap();
        a.release(8192);
        assert_eq!(a.locked(), 0);
    }

    #[test]
    fn the_rlimit_default_follows_the_kernel_rule() {
        let resolved = LockLimit::Rlimit.resolve();
        if capable(Capability::IpcLock) {
            assert_eq!(resolved, None, "CAP_IPC_LOCK locks without limit");
        } else {
            let mut rl = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            // SAFETY: getrlimit writes one rlimit into the struct we own.
            assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) }, 0);
            let want =
                (rl.rlim_cur != libc::RLIM_INFINITY).then_some((rl.rlim_cur, "RLIMIT_MEMLOCK"));
            assert_eq!(resolved, want);
        }
    }

    #[test]
    fn capget_agrees_with_proc_status() {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let bits = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .unwrap();
        for cap in [Capability::IpcLock, Capability::SysAdmin] {
            assert_eq!(capable(cap), bits & (1 << cap as u32) != 0, "{cap:?}");
        }
    }

    #[test]
    fn a_refusal_reads_the_limit_again() {
        let mut a = Account::new(LockLimit::Bytes(4096));
        a.charge(4096).unwrap();
        assert!(a.check(1).is_err());
        // The limit as last read is stale on purpose: a refusal must look again.
        a.limit = LockLimit::Unlimited;
        a.charge(8192).unwrap();
        assert_eq!(a.locked(), 3 * 4096);
    }

    #[test]
    fn nothing_more_fits_under_a_limit_lowered_below_what_is_held() {
        let mut a = Account::new(LockLimit::Bytes(8192));
        a.charge(8192).unwrap();
        a.set_limit(LockLimit::Bytes(4096));
        a.charge(0).unwrap();
        assert_eq!(a.charge(1).unwrap_err().errno(), libc::ENOMEM);
        assert_eq!(a.locked(), 8192);
    }

    #[test]
    fn unlimited_takes_anything() {
        let mut a = Account::new(LockLimit::Unlimited);
        a.charge(u64::MAX).unwrap();
        assert!(a.check(1).is_ok());
    }
}
