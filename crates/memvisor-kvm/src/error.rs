//! Errors of the KVM binding: KVM's own refusals with the values that were refused, and memvisor's.
//!
//! A memslot ioctl that fails is reported as [`Error::Memslot`] with the errno KVM gave and the
//! whole region it was asked to install (slot numbers, guest address, size, flags), so a caller
//! sees exactly which value KVM did not take. Other VM and vCPU ioctls are [`Error::Kvm`], with
//! the ioctl's name and what it was for. What the binding itself refuses — no free KVM memslot
//! number, a slot that KVM does not hold — has its own case and the errno KVM would give for the
//! same thing. memvisor's errors pass through unchanged ([`Error::Memvisor`]).

use memvisor::SlotId;

/// What went wrong, with the numbers that were wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `KVM_SET_USER_MEMORY_REGION(2)` refused a region.
    #[error(
        "{op} refused memvisor slot {slot} as KVM slot {kvm_slot} (gpa {gpa:#x}, size {size:#x}, \
         hva {hva:#x}, flags {flags:#x}): {}",
        strerror(*errno)
    )]
    Memslot {
        /// The ioctl (`KVM_SET_USER_MEMORY_REGION` or `..._REGION2`).
        op: &'static str,
        /// The memvisor slot being installed.
        slot: SlotId,
        /// The KVM memslot number it was given.
        kvm_slot: u32,
        /// Guest physical address of the region.
        gpa: u64,
        /// Its size in bytes.
        size: u64,
        /// Host address of its memory.
        hva: u64,
        /// The KVM memslot flags asked for (`KVM_MEM_*`).
        flags: u32,
        /// The errno KVM answered.
        errno: i32,
    },

    /// Any other KVM ioctl failed.
    #[error("{op} ({what}) failed: {}", strerror(*errno))]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// What it was for.
        what: String,
        /// The errno KVM answered.
        errno: i32,
    },

    /// Every KVM memslot number is taken (ENOSPC).
    #[error(
        "no free KVM memslot for memvisor slot {slot}: {used} of {limit} in use \
         (KVM_CAP_NR_MEMSLOTS); remove a slot first"
    )]
    NoMemslot {
        /// The memvisor slot that found no KVM memslot.
        slot: SlotId,
        /// KVM memslots in use.
        used: u32,
        /// KVM memslots there are (`KVM_CAP_NR_MEMSLOTS`).
        limit: u32,
    },

    /// A slot the table has and KVM does not hold (the last sync failed on it): ENOENT, as
    /// `KVM_GET_DIRTY_LOG` answers for an absent slot.
    #[error("memvisor slot {slot} is not installed in KVM (a sync failed on it); call sync again")]
    NotInKvm {
        /// The memvisor slot.
        slot: SlotId,
    },

    /// KVM pushed more entries into a vCPU's dirty ring than it holds (entries, and the writes
    /// they named, are lost): EOVERFLOW. See the `ring` module; use the bitmap on this host.
    #[error(
        "KVM overran a {entries}-entry dirty ring (it reports the ring full while no entry is \
         dirty): dirty pages were lost; restart the migration with the dirty bitmap"
    )]
    RingOverrun {
        /// Entries in each vCPU's ring.
        entries: u32,
    },

    /// A dirty ring larger than KVM takes (E2BIG, as `KVM_ENABLE_CAP` answers for it).
    #[error(
        "dirty ring of {entries} entries ({bytes} bytes) is larger than KVM takes: at most \
         {max_bytes} bytes ({} entries)",
        max_bytes / 16
    )]
    RingTooBig {
        /// Entries asked for.
        entries: u32,
        /// Their size in bytes.
        bytes: u64,
        /// The largest ring KVM takes (`KVM_CAP_DIRTY_LOG_RING_ACQ_REL`), in bytes.
        max_bytes: u32,
    },

    /// memvisor refused the change or the access.
    #[error(transparent)]
    Memvisor(#[from] memvisor::Error),
}

impl Error {
    /// The errno of the refusal, as KVM (or memvisor, which follows KVM) gives it.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Memslot { errno, .. } | Error::Kvm { errno, .. } => *errno,
            Error::NoMemslot { .. } => libc::ENOSPC,
            Error::NotInKvm { .. } => libc::ENOENT,
            Error::RingOverrun { .. } => libc::EOVERFLOW,
            Error::RingTooBig { .. } => libc::E2BIG,
            Error::Memvisor(e) => e.errno(),
        }
    }

    /// The memvisor slot the error is about, when it names one.
    pub fn slot(&self) -> Option<SlotId> {
        match self {
            Error::Memslot { slot, .. }
            | Error::NoMemslot { slot, .. }
            | Error::NotInKvm { slot } => Some(*slot),
            _ => None,
        }
    }

    pub(crate) fn kvm(
        op: &'static str,
        what: impl Into<String>,
        e: vmm_sys_util::errno::Error,
    ) -> Self {
        Error::Kvm {
            op,
            what: what.into(),
            errno: e.errno(),
        }
    }
}

fn strerror(errno: i32) -> String {
    // "Invalid argument (os error 22)": the name and the number.
    std::io::Error::from_raw_os_error(errno).to_string()
}

/// The binding's result type.
pub type Result<T> = std::result::Result<T, Error>;
