//! A virtio-balloon device model for free page reporting: the guest's reports, taken off a
//! virtqueue in guest memory and handed to [`Discarder::report`].
//!
//! **The protocol.** A Linux guest with `virtio_balloon` and `mm/page_reporting` negotiates
//! `VIRTIO_BALLOON_F_REPORTING` (feature bit 5). When enough memory has been free for a while it
//! takes up to 32 free blocks of order 9 or more (2 MiB and up) off its free lists, puts them on
//! the reporting queue as **one descriptor chain of device-writable buffers**, one buffer per
//! block, notifies the device, and waits until the device returns the chain in the used ring.
//! Only then does it put the blocks back on its free lists — and from that moment it may reuse
//! them. So the host's work happens between the pop and the used entry: [`Balloon::process_queue`]
//! pops each chain, checks it, discards the memory its buffers name, and only then marks it used.
//!
//! **The checks.** The guest is not trusted. A chain is taken whole or not at all: every buffer is
//! checked before anything is discarded, and one bad buffer refuses the whole chain
//! ([`ChainError`]): a driver-readable buffer (reported memory is always device-writable), a
//! length or address that is not a multiple of 4 KiB, a buffer outside guest memory, a chain with
//! more descriptors than the queue has (only a loop makes one), a chain whose next link cannot be
//! read. Indirect descriptor tables are not offered (`VIRTIO_RING_F_INDIRECT_DESC`), but a driver
//! that uses one anyway has it followed and checked the same way. A refused chain is logged (`log::warn!`), counted, and still returned as used, so the
//! guest gets its memory back and the device keeps working; nothing outside the chain's own
//! buffers is ever touched, and of a refused chain nothing at all. What survives the checks is one
//! [`Discarder::report`], which applies its own per-range rules (whole pages of the backing, pins,
//! read-only slots, private files) and says what it did; that [`ReportOutcome`] comes back per
//! chain in [`Processed`]. An available ring that is corrupt (an index more than a queue ahead) is
//! the one error [`Balloon::process_queue`] returns: the device then refuses to work until
//! [`Balloon::reset`], which is virtio's `DEVICE_NEEDS_RESET`.
//!
//! **Page poisoning.** With `VIRTIO_BALLOON_F_PAGE_POISON` (bit 4) the driver writes the value it
//! fills free pages with into the config field `poison_val`. A non-zero value is passed to
//! [`Discarder::set_page_poison`]: a discarded page would come back as zeros, not as that value,
//! so nothing is discarded while it is set (QEMU does the same).
//!
//! **Inflate and deflate.** The host sets a target ([`Balloon::set_target_pages`], config field
//! `num_pages`); the driver gives pages to the device on the inflate queue (chains of
//! driver-readable buffers holding little-endian 32-bit page frame numbers of 4 KiB pages) and
//! takes them back on the deflate queue, and writes how many it holds into `actual`. Inflated
//! pages go through the same [`Discarder::report`] as reported ones — pins hold, read-only slots
//! and poisoning refuse — and deflated pages need nothing: they fault back in on first touch.
//! A frame list is checked like a report chain (driver-readable, whole 4-byte entries, inside
//! guest memory, at most [`MAX_PFNS_PER_CHAIN`] frames) and refused whole otherwise.
//!
//! **Statistics.** With `VIRTIO_BALLOON_F_STATS_VQ` (bit 1) the driver keeps one buffer of
//! memory statistics on the statistics queue ([`stats`]): [`Balloon::process_stats`] takes it,
//! parses it and holds it; [`Balloon::request_stats`] returns it when the device wants fresh
//! figures (a timer of the transport's), and the driver answers with a new buffer.
//!
//! **Deflate on OOM.** `VIRTIO_BALLOON_F_DEFLATE_ON_OOM` (bit 2) lets the driver take pages back
//! from the balloon by itself when the guest runs out of memory; the device sees them on the
//! deflate queue and in `actual`, as for any deflation. Offering it or not is the transport's
//! choice (it masks the bit out of [`Balloon::device_features`]).
//!
//! **What this models.** Feature negotiation, the 16-byte config space, and the inflate, deflate,
//! statistics and reporting queues; not free page hinting. A queue that does not exist takes no
//! number (as Linux's driver and QEMU lay them out): inflate 0, deflate 1, then statistics if
//! negotiated, then reporting if negotiated — so reporting is 2 without statistics
//! ([`REPORTING_QUEUE_INDEX`]) and 3 with them; [`Balloon::queue_kind`] says which is which. The
//! transport (PCI, MMIO,
//! vhost-user) stays with the VMM or back end: it configures the queues (size, ring addresses,
//! ready) through [`virtio_queue::QueueT`], forwards config accesses and feature words, calls
//! [`Balloon::process_reports`] / [`Balloon::process_inflate`] / [`Balloon::process_deflate`]
//! when the guest notifies a queue, and interrupts the guest when they say to. For a VMM with
//! only the reporting queue, the device keeps one itself ([`Balloon::queue_mut`],
//! [`Balloon::process_queue`]).

use std::fmt;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{GuestAddress, GuestAddressSpace, GuestMemoryBackend};

pub use virtio_queue;

pub mod stats;

use self::stats::GuestStats;

// virtio-balloon's page (VIRTIO_BALLOON_PFN_SHIFT 12): reported buffers are whole pages of it.
use crate::addr::{Gpa, PAGE_4K as PAGE};
use crate::discard::{DiscardOptions, Discarder, ReportOutcome};
use crate::error::{Error, Result};
use crate::vm_memory::{SlotMemory, SlotSpace};

/// virtio device type of a memory balloon.
pub const DEVICE_TYPE: u32 = 5;
/// Feature bit: the statistics queue.
pub const VIRTIO_BALLOON_F_STATS_VQ: u32 = 1;
/// Feature bit: the driver may deflate the balloon by itself when the guest is out of memory.
pub const VIRTIO_BALLOON_F_DEFLATE_ON_OOM: u32 = 2;
/// Feature bit: the driver fills free pages with `poison_val`.
pub const VIRTIO_BALLOON_F_PAGE_POISON: u32 = 4;
/// Feature bit: free page reporting through the reporting queue.
pub const VIRTIO_BALLOON_F_REPORTING: u32 = 5;
/// Feature bit: the virtio 1.0 interface (little-endian, modern layout).
pub use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
/// Feature bit: used and available ring event indexes (notification suppression).
pub use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
/// The reporting queue's number when neither the statistics nor the free page hinting queue was
/// negotiated: after inflate (0) and deflate (1). With statistics it is 3
/// ([`Balloon::queue_kind`]).
pub const REPORTING_QUEUE_INDEX: u16 = 2;
/// The statistics queue's number, when negotiated: after inflate and deflate.
pub const STATS_QUEUE_INDEX: u16 = 2;
/// The balloon's config space (`struct virtio_balloon_config` of the virtio specification, 5.5.4),
/// every field little-endian on the wire. The driver may write `actual` and `poison_val`; the
/// rest is the device's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BalloonConfig {
    /// The pages the device asks the driver to hold (the balloon's target).
    pub num_pages: u32,
    /// The pages the driver holds, as it reports them.
    pub actual: u32,
    /// The free page hinting command id (free page hinting is not offered: always 0).
    pub free_page_hint_cmd_id: u32,
    /// The value the driver fills free pages with (with `VIRTIO_BALLOON_F_PAGE_POISON`).
    pub poison_val: u32,
}

impl BalloonConfig {
    /// The config space as the driver reads it.
    pub fn to_le_bytes(&self) -> [u8; CONFIG_SIZE as usize] {
        let mut c = [0u8; CONFIG_SIZE as usize];
        let fields = [
            self.num_pages,
            self.actual,
            self.free_page_hint_cmd_id,
            self.poison_val,
        ];
        for (at, v) in c.chunks_exact_mut(4).zip(fields) {
            at.copy_from_slice(&v.to_le_bytes());
        }
        c
    }

    /// The config space from the bytes the driver sees.
    pub fn from_le_bytes(c: &[u8; CONFIG_SIZE as usize]) -> BalloonConfig {
        let field = |at: usize| u32::from_le_bytes([c[at], c[at + 1], c[at + 2], c[at + 3]]);
        BalloonConfig {
            num_pages: field(std::mem::offset_of!(BalloonConfig, num_pages)),
            actual: field(CONFIG_ACTUAL as usize),
            free_page_hint_cmd_id: field(std::mem::offset_of!(
                BalloonConfig,
                free_page_hint_cmd_id
            )),
            poison_val: field(CONFIG_POISON_VAL as usize),
        }
    }
}

/// Bytes of the config space ([`BalloonConfig`]).
pub const CONFIG_SIZE: u64 = std::mem::size_of::<BalloonConfig>() as u64;
const _: () = assert!(CONFIG_SIZE == 16, "virtio_balloon_config is four u32s");
const CONFIG_ACTUAL: u64 = std::mem::offset_of!(BalloonConfig, actual) as u64;
const CONFIG_POISON_VAL: u64 = std::mem::offset_of!(BalloonConfig, poison_val) as u64;

/// Inflate queue number.
pub const INFLATE_QUEUE_INDEX: u16 = 0;
/// Deflate queue number.
pub const DEFLATE_QUEUE_INDEX: u16 = 1;
/// The most page frame numbers one inflate or deflate chain may carry (Linux sends up to 256).
pub const MAX_PFNS_PER_CHAIN: usize = 16384;

/// Why a whole descriptor chain was refused. `index` counts descriptors from the chain's head
/// (0); addresses are guest physical.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    /// The head index is outside the descriptor table, or the descriptor cannot be read.
    #[error("chain head {head} names no readable descriptor (queue size {queue_size})")]
    NoDescriptors {
        /// The head index the driver made available.
        head: u16,
        /// Descriptors in the queue's table.
        queue_size: u16,
    },
    /// A buffer the device may only read: reported memory is handed to the device to write.
    #[error(
        "descriptor {index} ({addr:#x}+{len:#x}) is driver-readable; reported pages must be device-writable"
    )]
    DriverReadable {
        /// The descriptor's position in the chain (the head is 0).
        index: u32,
        /// The buffer's guest physical address.
        addr: u64,
        /// The buffer's length in bytes.
        len: u32,
    },
    /// A buffer that is not whole 4 KiB pages at a 4 KiB boundary (or is empty).
    #[error("descriptor {index} ({addr:#x}+{len:#x}) is not whole 4 KiB pages")]
    NotWholePages {
        /// The descriptor's position in the chain (the head is 0).
        index: u32,
        /// The buffer's guest physical address.
        addr: u64,
        /// The buffer's length in bytes.
        len: u32,
    },
    /// A buffer not entirely inside guest memory.
    #[error("descriptor {index} ({addr:#x}+{len:#x}) is not inside guest memory")]
    OutsideGuestMemory {
        /// The descriptor's position in the chain (the head is 0).
        index: u32,
        /// The buffer's guest physical address.
        addr: u64,
        /// The buffer's length in bytes.
        len: u32,
    },
    /// More descriptors than the queue holds: the links form a loop (or an indirect table is
    /// longer than the queue).
    #[error("chain is longer than the queue's {queue_size} descriptors (a loop?)")]
    TooLong {
        /// Descriptors in the queue's table: a chain can hold no more.
        queue_size: u16,
    },
    /// An inflate/deflate buffer the device may write: page frame lists are driver-readable.
    #[error(
        "descriptor {index} ({addr:#x}+{len:#x}) is device-writable; a page frame list is driver-readable"
    )]
    DeviceWritable {
        /// The descriptor's position in the chain (the head is 0).
        index: u32,
        /// The buffer's guest physical address.
        addr: u64,
        /// The buffer's length in bytes.
        len: u32,
    },
    /// A page frame list that is not whole 4-byte entries, or longer than the device takes.
    #[error(
        "descriptor {index} ({addr:#x}+{len:#x}) is not a frame list of whole 4-byte entries within {MAX_PFNS_PER_CHAIN} frames"
    )]
    BadFrameList {
        /// The descriptor's position in the chain (the head is 0).
        index: u32,
        /// The buffer's guest physical address.
        addr: u64,
        /// The buffer's length in bytes.
        len: u32,
    },
    /// A descriptor says another follows, but it cannot be read (index past the table, or the
    /// table is not in guest memory).
    #[error("descriptor {index} links to descriptor {next}, which cannot be read")]
    BrokenLink {
        /// The position in the chain of the descriptor that links on.
        index: u32,
        /// The descriptor index it links to.
        next: u16,
    },
}

/// What a virtqueue of the balloon is for, by its number and the negotiated features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueKind {
    /// Page frames the driver gives up.
    Inflate,
    /// Page frames the driver takes back.
    Deflate,
    /// The driver's memory statistics.
    Stats,
    /// Free page reports.
    Reporting,
}

/// What became of one descriptor chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainReport {
    /// The chain's head index, as returned in the used ring.
    pub head: u16,
    /// What the discard did, or why the chain was refused whole.
    pub result: std::result::Result<ReportOutcome, ChainError>,
}

/// What one [`Balloon::process_queue`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Processed {
    /// Every chain taken off the queue, in order.
    pub chains: Vec<ChainReport>,
    /// Whether the guest must be interrupted (chains were returned, and it did not suppress it).
    pub notify: bool,
}

/// Running totals since the device was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ReportingStats {
    /// Chains taken off the queue.
    pub chains: u64,
    /// Chains refused whole.
    pub refused_chains: u64,
    /// Bytes given back to the host.
    pub discarded: u64,
    /// Bytes kept because they are pinned.
    pub skipped_pinned: u64,
    /// Bytes of accepted chains that [`Discarder::report`] refused (partial huge pages, read-only
    /// slots, poisoning, ...).
    pub rejected: u64,
    /// Pages the driver gave on the inflate queue.
    pub inflated_pages: u64,
    /// Pages the driver took back on the deflate queue.
    pub deflated_pages: u64,
    /// Statistics buffers taken.
    pub stats_buffers: u64,
    /// Statistics buffers refused (bad layout or chain); the figures from before stay.
    pub refused_stats: u64,
}

/// The driver's latest statistics and when they came.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatsUpdate {
    /// The figures.
    pub stats: GuestStats,
    /// When the device took them.
    pub at: std::time::SystemTime,
    /// Statistics buffers accepted so far (this one included).
    pub count: u64,
}

/// The virtio-balloon device's free page reporting: features, config space and the reporting
/// queue over memvisor's guest memory. See the module documentation.
pub struct Balloon {
    memory: SlotSpace,
    discarder: Discarder,
    queue: Queue,
    acked: u64,
    target: u32,
    actual: u32,
    poison_val: u32,
    stats: ReportingStats,
    broken: Option<String>,
    /// The statistics buffer the device holds (its head) and since when.
    stats_held: Option<(u16, std::time::Instant)>,
    guest_stats: Option<StatsUpdate>,
}

impl fmt::Debug for Balloon {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Balloon")
            .field("acked", &format_args!("{:#x}", self.acked))
            .field("poison_val", &format_args!("{:#x}", self.poison_val))
            .field("stats", &self.stats)
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

impl Balloon {
    /// A balloon over `memory` that discards reported memory as `options` say, with a reporting
    /// queue of at most `queue_max` entries (a power of two, at most 32768).
    pub fn new(memory: SlotSpace, options: DiscardOptions, queue_max: u16) -> Result<Self> {
        let queue = Queue::new(queue_max).map_err(|e| {
            Error::BadConfig(format!(
                "balloon queue size {queue_max}: {e}; use a power of two from 1 to 32768"
            ))
        })?;
        let discarder = Discarder::with_options(memory.table(), options);
        Ok(Balloon {
            memory,
            discarder,
            queue,
            acked: 0,
            target: 0,
            actual: 0,
            poison_val: 0,
            stats: ReportingStats::default(),
            broken: None,
            stats_held: None,
            guest_stats: None,
        })
    }

    /// The features this device can offer: virtio 1.0, event indexes, free page reporting, page
    /// poisoning, the statistics queue and deflate on OOM. A transport that does not want one
    /// (statistics without a timer to ask for them, say) masks it out of what it offers.
    pub fn device_features(&self) -> u64 {
        [
            VIRTIO_F_VERSION_1,
            VIRTIO_RING_F_EVENT_IDX,
            VIRTIO_BALLOON_F_REPORTING,
            VIRTIO_BALLOON_F_PAGE_POISON,
            VIRTIO_BALLOON_F_STATS_VQ,
            VIRTIO_BALLOON_F_DEFLATE_ON_OOM,
        ]
        .iter()
        .fold(0, |f, bit| f | 1 << bit)
    }

    /// Takes the driver's features. Bits the device did not offer are refused (EINVAL), and so is
    /// a set without `VIRTIO_F_VERSION_1`, which this modern-only device needs.
    pub fn ack_features(&mut self, features: u64) -> Result<()> {
        let extra = features & !self.device_features();
        if extra != 0 {
            return Err(Error::Protocol(format!(
                "balloon: driver acked features {extra:#x} the device does not offer (offered {:#x})",
                self.device_features()
            )));
        }
        if features & 1 << VIRTIO_F_VERSION_1 == 0 {
            return Err(Error::Protocol(format!(
                "balloon: driver features {features:#x} lack VIRTIO_F_VERSION_1; only the modern \
                 interface is supported"
            )));
        }
        self.acked = features;
        self.queue
            .set_event_idx(features & 1 << VIRTIO_RING_F_EVENT_IDX != 0);
        self.apply_poison();
        Ok(())
    }

    /// The features the driver acked.
    pub fn acked_features(&self) -> u64 {
        self.acked
    }

    fn has(&self, bit: u32) -> bool {
        self.acked & 1 << bit != 0
    }

    /// What virtqueue `index` is with the features the driver acked; `None` for a number no
    /// queue has (a queue that does not exist takes no number).
    pub fn queue_kind(&self, index: u16) -> Option<QueueKind> {
        let mut kinds = vec![QueueKind::Inflate, QueueKind::Deflate];
        if self.has(VIRTIO_BALLOON_F_STATS_VQ) {
            kinds.push(QueueKind::Stats);
        }
        if self.has(VIRTIO_BALLOON_F_REPORTING) {
            kinds.push(QueueKind::Reporting);
        }
        kinds.get(usize::from(index)).copied()
    }

    fn config(&self) -> [u8; CONFIG_SIZE as usize] {
        BalloonConfig {
            num_pages: self.target,
            actual: self.actual,
            free_page_hint_cmd_id: 0,
            poison_val: self.poison_val,
        }
        .to_le_bytes()
    }

    /// Reads config space at `offset`; bytes past its end read as zero.
    pub fn read_config(&self, offset: u64, data: &mut [u8]) {
        let c = self.config();
        for (i, b) in data.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| c.get(usize::try_from(o).ok()?))
                .copied()
                .unwrap_or(0);
        }
    }

    /// Writes config space at `offset`. The driver may write `actual` and `poison_val`; other
    /// bytes are the device's and writes to them are ignored with a warning.
    pub fn write_config(&mut self, offset: u64, data: &[u8]) {
        let mut c = self.config();
        for (i, &b) in data.iter().enumerate() {
            let o = offset.saturating_add(i as u64);
            if (CONFIG_ACTUAL..CONFIG_ACTUAL + 4).contains(&o)
                || (CONFIG_POISON_VAL..CONFIG_POISON_VAL + 4).contains(&o)
            {
                c[o as usize] = b;
            } else if c.get(o as usize).is_none_or(|&v| v != b) {
                // Transports that write the whole config space back (vhost-user's SET_CONFIG)
                // rewrite the device's bytes unchanged; only a change is worth a word.
                log::warn!("balloon: driver wrote read-only config byte {o:#x}; ignored");
            }
        }
        let written = BalloonConfig::from_le_bytes(&c);
        self.actual = written.actual;
        self.poison_val = written.poison_val;
        self.apply_poison();
    }

    /// Asks the driver to hold `pages` 4 KiB pages (config `num_pages`). The transport must tell
    /// the driver the config changed (a config interrupt, or vhost-user's config change
    /// message).
    pub fn set_target_pages(&mut self, pages: u32) {
        self.target = pages;
    }

    /// The target last set.
    pub fn target_pages(&self) -> u32 {
        self.target
    }

    /// The pages the driver says it holds (config `actual`).
    pub fn actual_pages(&self) -> u32 {
        self.actual
    }

    /// The poison value counts only with `VIRTIO_BALLOON_F_PAGE_POISON` negotiated.
    fn apply_poison(&self) {
        let value = if self.has(VIRTIO_BALLOON_F_PAGE_POISON) {
            self.poison_val
        } else {
            0
        };
        self.discarder.set_page_poison(value);
    }

    /// The reporting queue, to read its state.
    pub fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The reporting queue, for the transport to set its size, ring addresses and readiness.
    pub fn queue_mut(&mut self) -> &mut Queue {
        &mut self.queue
    }

    /// Totals since the device was created.
    pub fn stats(&self) -> ReportingStats {
        self.stats
    }

    /// Back to the state after [`Balloon::new`] (virtio device reset): features, config and
    /// queue cleared, a broken ring forgotten, a held statistics buffer dropped. Totals and the
    /// last statistics are kept.
    pub fn reset(&mut self) {
        self.queue.reset();
        self.acked = 0;
        self.actual = 0;
        self.poison_val = 0;
        self.broken = None;
        self.stats_held = None;
        self.apply_poison();
    }

    /// The driver's latest statistics, if any came.
    pub fn guest_stats(&self) -> Option<&StatsUpdate> {
        self.guest_stats.as_ref()
    }

    /// Since when the device holds a statistics buffer it can return to ask for fresh figures
    /// ([`Balloon::request_stats`]); `None` when it holds none.
    pub fn stats_held_since(&self) -> Option<std::time::Instant> {
        self.stats_held.map(|(_, t)| t)
    }

    /// Handles the statistics queue: each buffer the driver made available is read and parsed
    /// (the figures kept with the time), then held for [`Balloon::request_stats`]; a buffer
    /// held from before is returned first, so the driver always has one with the device.
    /// A buffer that is not driver-readable, not in guest memory, or not whole entries is
    /// logged and counted, held all the same, and leaves the figures from before. Returns
    /// whether to notify. EINVAL when the statistics queue was not negotiated or its available
    /// ring is corrupt.
    pub fn process_stats(&mut self, queue: &mut Queue) -> Result<bool> {
        if !self.has(VIRTIO_BALLOON_F_STATS_VQ) {
            return Err(Error::Protocol(
                "balloon: VIRTIO_BALLOON_F_STATS_VQ was not negotiated; the statistics queue does \
                 not exist"
                    .into(),
            ));
        }
        let memory = self.memory.memory();
        let mem: &SlotMemory = &memory;
        let mut notify = false;
        loop {
            let chain = match queue.iter(mem) {
                Ok(mut avail) => avail.next(),
                Err(e) => {
                    return Err(Error::Protocol(format!(
                        "balloon statistics queue: available ring unusable: {e}; reset the device"
                    )));
                }
            };
            let Some(chain) = chain else {
                if queue.enable_notification(mem).unwrap_or(false) {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            self.stats.stats_buffers += 1;
            match stats_bytes(mem, chain, queue.size())
                .and_then(|b| GuestStats::parse(&b).map_err(|e| e.to_string()))
            {
                Ok(s) => {
                    let count = self.guest_stats.as_ref().map_or(0, |u| u.count) + 1;
                    log::debug!(
                        "balloon: guest statistics #{count}: {}",
                        s.named()
                            .map(|(n, v)| format!("{n}={v}"))
                            .collect::<Vec<_>>()
                            .join(" ")
                    );
                    self.guest_stats = Some(StatsUpdate {
                        stats: s,
                        at: std::time::SystemTime::now(),
                        count,
                    });
                }
                Err(e) => {
                    self.stats.refused_stats += 1;
                    log::warn!("balloon: refused statistics buffer at head {head}: {e}");
                }
            }
            // One buffer stays with the device; an older one goes back.
            if let Some((old, _)) = self.stats_held.replace((head, std::time::Instant::now())) {
                if let Err(e) = queue.add_used(mem, old, 0) {
                    log::warn!("balloon: cannot return statistics buffer {old}: {e}");
                }
                notify = true;
            }
        }
        Ok(notify && queue.needs_notification(mem).unwrap_or(true))
    }

    /// Asks the driver for fresh statistics: returns the buffer the device holds (used, length
    /// 0). Returns whether to notify; `false` and nothing done when no buffer is held.
    pub fn request_stats(&mut self, queue: &mut Queue) -> Result<bool> {
        let Some((head, _)) = self.stats_held.take() else {
            return Ok(false);
        };
        let memory = self.memory.memory();
        let mem: &SlotMemory = &memory;
        queue.add_used(mem, head, 0).map_err(|e| {
            Error::Protocol(format!(
                "balloon: cannot return statistics buffer {head}: {e}"
            ))
        })?;
        Ok(queue.needs_notification(mem).unwrap_or(true))
    }

    /// Handles every chain the driver made available: checks it, discards what it reports and
    /// returns it as used (length 0: the device writes nothing into the buffers). Errors (EINVAL)
    /// when the queue is not ready or its rings are not in guest memory, and when the available
    /// ring is corrupt — after which the device needs a [`Balloon::reset`].
    pub fn process_queue(&mut self) -> Result<Processed> {
        let placeholder = Queue::new(1).expect("a queue of one entry");
        let mut queue = std::mem::replace(&mut self.queue, placeholder);
        let result = self.process_reports(&mut queue);
        self.queue = queue;
        result
    }

    /// [`Balloon::process_queue`] on a reporting queue the transport keeps (vhost-user).
    pub fn process_reports(&mut self, queue: &mut Queue) -> Result<Processed> {
        if let Some(why) = &self.broken {
            return Err(Error::Protocol(format!(
                "balloon reporting queue is broken ({why}); reset the device"
            )));
        }
        if !self.has(VIRTIO_BALLOON_F_REPORTING) {
            return Err(Error::Protocol(
                "balloon: VIRTIO_BALLOON_F_REPORTING was not negotiated; the reporting queue does \
                 not exist"
                    .into(),
            ));
        }
        let memory = self.memory.memory();
        let mem: &SlotMemory = &memory;
        if !queue.is_valid(mem) {
            return Err(Error::Protocol(format!(
                "balloon reporting queue is not usable: ready={}, size {}, descriptors at {:#x}, \
                 available ring at {:#x}, used ring at {:#x} must be set and inside guest memory",
                queue.ready(),
                queue.size(),
                queue.desc_table(),
                queue.avail_ring(),
                queue.used_ring()
            )));
        }
        let mut out = Processed::default();
        loop {
            let chain = match queue.iter(mem) {
                Ok(mut avail) => avail.next(),
                Err(e) => {
                    let why = format!(
                        "available ring unusable: {e} (next available index {})",
                        queue.next_avail()
                    );
                    log::error!("balloon: {why}; the device needs a reset");
                    self.broken = Some(why.clone());
                    return Err(Error::Protocol(format!("balloon: {why}; reset the device")));
                }
            };
            let Some(chain) = chain else {
                // With event indexes the driver kicks only when told where to (avail_event):
                // publish it, and look again in case a chain arrived meanwhile.
                if queue.enable_notification(mem).unwrap_or(false) {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            let result = chain_ranges(mem, chain, queue.size()).map(|ranges| {
                let outcome = self.discarder.report(&ranges);
                self.stats.discarded += outcome.discarded;
                self.stats.skipped_pinned += outcome.skipped_pinned;
                self.stats.rejected += outcome.rejected_bytes();
                for r in &outcome.rejected {
                    log::debug!(
                        "balloon: kept {:#x}+{:#x} of a report: {}",
                        r.gpa.0,
                        r.len,
                        r.reason
                    );
                }
                outcome
            });
            self.stats.chains += 1;
            if let Err(e) = &result {
                self.stats.refused_chains += 1;
                log::warn!("balloon: refused report chain at head {head}: {e}");
            }
            // Only now may the guest reuse the blocks: their discard is done.
            if let Err(e) = queue.add_used(mem, head, 0) {
                // Only a head outside the table gets here; there is no entry to return.
                log::warn!("balloon: cannot return chain head {head}: {e}");
            }
            out.chains.push(ChainReport { head, result });
        }
        if !out.chains.is_empty() {
            out.notify = queue.needs_notification(mem).unwrap_or(true);
        }
        Ok(out)
    }

    /// Handles the inflate queue the transport keeps: every chain's page frames are checked and
    /// given to [`Discarder::report`], then the chain is returned. Returns whether to notify.
    pub fn process_inflate(&mut self, queue: &mut Queue) -> Result<bool> {
        self.process_frames(queue, true)
    }

    /// Handles the deflate queue: the frames are counted and the chains returned (a deflated
    /// page needs nothing: it faults back in when the guest touches it).
    pub fn process_deflate(&mut self, queue: &mut Queue) -> Result<bool> {
        self.process_frames(queue, false)
    }

    fn process_frames(&mut self, queue: &mut Queue, inflate: bool) -> Result<bool> {
        let name = if inflate { "inflate" } else { "deflate" };
        let memory = self.memory.memory();
        let mem: &SlotMemory = &memory;
        let mut any = false;
        loop {
            let chain = match queue.iter(mem) {
                Ok(mut avail) => avail.next(),
                Err(e) => {
                    return Err(Error::Protocol(format!(
                        "balloon {name} queue: available ring unusable: {e}; reset the device"
                    )));
                }
            };
            let Some(chain) = chain else {
                // With event indexes the driver kicks only when told where to (avail_event):
                // publish it, and look again in case a chain arrived meanwhile.
                if queue.enable_notification(mem).unwrap_or(false) {
                    continue;
                }
                break;
            };
            let head = chain.head_index();
            match frame_ranges(mem, chain, queue.size()) {
                Ok((ranges, pages)) if inflate => {
                    let outcome = self.discarder.report(&ranges);
                    self.stats.inflated_pages += pages;
                    self.stats.discarded += outcome.discarded;
                    self.stats.skipped_pinned += outcome.skipped_pinned;
                    self.stats.rejected += outcome.rejected_bytes();
                }
                Ok((_, pages)) => self.stats.deflated_pages += pages,
                Err(e) => {
                    self.stats.refused_chains += 1;
                    log::warn!("balloon: refused {name} chain at head {head}: {e}");
                }
            }
            if let Err(e) = queue.add_used(mem, head, 0) {
                log::warn!("balloon: cannot return {name} chain head {head}: {e}");
            }
            any = true;
        }
        Ok(any && queue.needs_notification(mem).unwrap_or(true))
    }
}

/// The guest ranges of an inflate/deflate chain's page frame list, merged, and the number of
/// frames; refused whole if any buffer is not driver-readable, not whole 4-byte entries, not in
/// guest memory, or the list is longer than [`MAX_PFNS_PER_CHAIN`].
fn frame_ranges(
    mem: &SlotMemory,
    chain: DescriptorChain<&SlotMemory>,
    queue_size: u16,
) -> std::result::Result<(Vec<(Gpa, u64)>, u64), ChainError> {
    let head = chain.head_index();
    let mut frames: Vec<u64> = Vec::new();
    let mut count = 0u32;
    for desc in chain.take(usize::from(queue_size) + 1) {
        let index = count;
        count += 1;
        if count > u32::from(queue_size) {
            return Err(ChainError::TooLong { queue_size });
        }
        let (addr, len) = (desc.addr().0, desc.len());
        if desc.is_write_only() {
            return Err(ChainError::DeviceWritable { index, addr, len });
        }
        if len % 4 != 0 || frames.len() + len as usize / 4 > MAX_PFNS_PER_CHAIN {
            return Err(ChainError::BadFrameList { index, addr, len });
        }
        let mut raw = vec![0u8; len as usize];
        if mem.snapshot().read(Gpa(addr), &mut raw).is_err() {
            return Err(ChainError::OutsideGuestMemory { index, addr, len });
        }
        frames.extend(
            raw.chunks_exact(4)
                .map(|c| u64::from(u32::from_le_bytes(c.try_into().expect("4 bytes")))),
        );
    }
    if count == 0 {
        return Err(ChainError::NoDescriptors { head, queue_size });
    }
    let pages = frames.len() as u64;
    frames.sort_unstable();
    frames.dedup();
    let mut ranges: Vec<(Gpa, u64)> = Vec::new();
    for f in frames {
        let gpa = f * PAGE;
        match ranges.last_mut() {
            Some((g, l)) if g.0 + *l == gpa => *l += PAGE,
            _ => ranges.push((Gpa(gpa), PAGE)),
        }
    }
    Ok((ranges, pages))
}

/// The bytes of a statistics chain's driver-readable buffers, in order; refused (with why) if a
/// buffer is device-writable or outside guest memory, the chain loops, or it holds more than a
/// statistics buffer may (checked before anything is read).
fn stats_bytes(
    mem: &SlotMemory,
    chain: DescriptorChain<&SlotMemory>,
    queue_size: u16,
) -> std::result::Result<Vec<u8>, String> {
    let limit = stats::MAX_STATS_ENTRIES * stats::ENTRY_SIZE;
    let mut out = Vec::new();
    let mut count = 0u32;
    for desc in chain.take(usize::from(queue_size) + 1) {
        let index = count;
        count += 1;
        if count > u32::from(queue_size) {
            return Err(ChainError::TooLong { queue_size }.to_string());
        }
        let (addr, len) = (desc.addr().0, desc.len());
        if desc.is_write_only() {
            return Err(format!(
                "descriptor {index} ({addr:#x}+{len:#x}) is device-writable; statistics are \
                 driver-readable"
            ));
        }
        let total = out.len() + len as usize;
        if total > limit {
            return Err(stats::StatsError::TooLong { len: total }.to_string());
        }
        let mut raw = vec![0u8; len as usize];
        if mem.snapshot().read(Gpa(addr), &mut raw).is_err() {
            return Err(ChainError::OutsideGuestMemory { index, addr, len }.to_string());
        }
        out.extend_from_slice(&raw);
    }
    Ok(out)
}

/// The ranges a chain reports, if every one of its buffers is acceptable.
fn chain_ranges(
    mem: &SlotMemory,
    chain: DescriptorChain<&SlotMemory>,
    queue_size: u16,
) -> std::result::Result<Vec<(Gpa, u64)>, ChainError> {
    let head = chain.head_index();
    let mut ranges: Vec<(Gpa, u64)> = Vec::new();
    let mut last: Option<Descriptor> = None;
    let mut count: u32 = 0;
    // One past the queue's size is enough to see a chain that is too long.
    for desc in chain.take(usize::from(queue_size) + 1) {
        let index = count;
        count += 1;
        if count > u32::from(queue_size) {
            return Err(ChainError::TooLong { queue_size });
        }
        let (addr, len) = (desc.addr().0, desc.len());
        if !desc.is_write_only() {
            return Err(ChainError::DriverReadable { index, addr, len });
        }
        if len == 0 || addr % PAGE != 0 || u64::from(len) % PAGE != 0 {
            return Err(ChainError::NotWholePages { index, addr, len });
        }
        if !GuestMemoryBackend::check_range(mem.regions(), GuestAddress(addr), len as usize) {
            return Err(ChainError::OutsideGuestMemory { index, addr, len });
        }
        match ranges.last_mut() {
            // Linux's blocks are often neighbours: one range for a run of them.
            Some((g, l)) if g.0.checked_add(*l) == Some(addr) => *l += u64::from(len),
            _ => ranges.push((Gpa(addr), u64::from(len))),
        }
        last = Some(desc);
    }
    match last {
        None => Err(ChainError::NoDescriptors { head, queue_size }),
        // The iterator stopped although the last descriptor links on: it ran out of its
        // queue-size budget (a loop), or the next descriptor could not be read.
        Some(d) if d.has_next() => Err(if count >= u32::from(queue_size) {
            ChainError::TooLong { queue_size }
        } else {
            ChainError::BrokenLink {
                index: count - 1,
                next: d.next(),
            }
        }),
        Some(_) => Ok(ranges),
    }
}
