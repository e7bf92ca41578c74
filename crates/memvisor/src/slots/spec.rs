//! What a slot is: its number ([`SlotId`]), its flags ([`SlotFlags`]), the request to install
//! one ([`SlotSpec`]) and the installed, immutable [`Slot`].
//!
//! A slot maps `size` bytes of a [`Backing`], from `offset`, at a guest physical address. Once
//! installed it never changes: a flag change installs a new `Slot` (keeping the old one's dirty
//! bitmap when logging stays on), so a snapshot that holds an `Arc<Slot>` sees it as it was.

use std::fmt;
use std::ops::BitOr;
use std::sync::Arc;

use crate::addr::{Gpa, Hva, Range};
use crate::backing::Backing;
use crate::bitmap::DirtyBitmap;

/// A slot's number, as in KVM's `kvm_userspace_memory_region.slot`.
pub type SlotId = u32;

/// KVM's `KVM_USER_MEM_SLOTS` on x86-64: the default bound on slot ids.
pub const DEFAULT_MAX_SLOTS: u32 = 32764;

/// Slot flags.
#[derive(Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct SlotFlags(u32);

impl SlotFlags {
    /// No flags: readable and writable, no dirty logging.
    pub const NONE: SlotFlags = SlotFlags(0);
    /// Guest memory the guest (and writes through the table) may not change (KVM_MEM_READONLY).
    pub const READ_ONLY: SlotFlags = SlotFlags(1);
    /// Keep a dirty bitmap of pages written through the table (KVM_MEM_LOG_DIRTY_PAGES).
    pub const LOG_DIRTY: SlotFlags = SlotFlags(2);

    /// Whether every flag in `other` is set.
    #[inline]
    pub const fn contains(self, other: SlotFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for SlotFlags {
    type Output = SlotFlags;
    fn bitor(self, rhs: SlotFlags) -> SlotFlags {
        SlotFlags(self.0 | rhs.0)
    }
}

impl fmt::Debug for SlotFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        if self.contains(SlotFlags::READ_ONLY) {
            names.push("READ_ONLY");
        }
        if self.contains(SlotFlags::LOG_DIRTY) {
            names.push("LOG_DIRTY");
        }
        write!(
            f,
            "SlotFlags({})",
            if names.is_empty() {
                "NONE".to_string()
            } else {
                names.join("|")
            }
        )
    }
}

/// What to install: `size` bytes of `backing` starting at `offset`, seen by the guest at `gpa`.
#[derive(Clone, Debug)]
pub struct SlotSpec {
    /// The slot's number; below the table's `max_slots`.
    pub id: SlotId,
    /// Guest physical address of the slot's first byte; page-aligned.
    pub gpa: Gpa,
    /// Bytes the slot covers; a whole number of pages, within the backing.
    pub size: u64,
    /// The memory behind the slot.
    pub backing: Arc<Backing>,
    /// Where in `backing` the slot's first byte is; page-aligned.
    pub offset: u64,
    /// `READ_ONLY`, `LOG_DIRTY`.
    pub flags: SlotFlags,
}

impl SlotSpec {
    /// The whole of `backing` at `gpa`, no flags.
    pub fn new(id: SlotId, gpa: Gpa, backing: Arc<Backing>) -> Self {
        SlotSpec {
            id,
            gpa,
            size: backing.size(),
            backing,
            offset: 0,
            flags: SlotFlags::NONE,
        }
    }

    /// Only `size` bytes of the backing, from `offset`.
    pub fn window(mut self, offset: u64, size: u64) -> Self {
        self.offset = offset;
        self.size = size;
        self
    }

    /// With these flags.
    pub fn flags(mut self, flags: SlotFlags) -> Self {
        self.flags = flags;
        self
    }
}

/// An installed slot. Immutable: a flag change installs a new `Slot`.
#[derive(Debug)]
pub struct Slot {
    pub(super) id: SlotId,
    pub(super) range: Range<Gpa>,
    pub(super) backing: Arc<Backing>,
    pub(super) offset: u64,
    pub(super) flags: SlotFlags,
    pub(super) dirty: Option<Arc<DirtyBitmap>>,
}

impl Slot {
    /// The slot's id.
    pub fn id(&self) -> SlotId {
        self.id
    }
    /// The guest-physical range it covers.
    pub fn range(&self) -> Range<Gpa> {
        self.range
    }
    /// Host address of the slot's first byte.
    pub fn hva(&self) -> Hva {
        Hva(self.backing.hva().0 + self.offset)
    }
    /// The memory behind it.
    pub fn backing(&self) -> &Arc<Backing> {
        &self.backing
    }
    /// Offset of the slot's first byte in the backing.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// Its flags.
    pub fn flags(&self) -> SlotFlags {
        self.flags
    }
    /// The dirty bitmap writes through the table (and discards) mark, when the slot logs them.
    pub(crate) fn dirty_bitmap(&self) -> Option<&Arc<DirtyBitmap>> {
        self.dirty.as_ref()
    }
    /// Whether both slots mark one and the same dirty log: true for the slots before and after
    /// a flag change that keeps `LOG_DIRTY` (the log goes on), false for a slot inserted anew,
    /// even with the same spec (it starts a log of its own, and the old one's marks stay with
    /// the old slot), and false when either does not log. For a binding that copies the table
    /// elsewhere (KVM's memslots) and must not lose the marks of a replaced slot.
    pub fn shares_dirty_log(&self, other: &Slot) -> bool {
        match (&self.dirty, &other.dirty) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}
