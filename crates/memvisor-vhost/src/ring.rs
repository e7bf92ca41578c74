//! A started virtqueue as a device sees it: virtio-queue's split [`Queue`], and — when the
//! frontend shared one (`VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD`) — the queue's part of the
//! inflight log, with which a back end started again after a crash redoes what its predecessor
//! took off the ring and never completed.
//!
//! **Why a log.** A device completes requests in the order they finish, not the order it took
//! them. The used ring's index says how many completed, not which: a frontend that restarted a
//! ring at the used index after a crash would redo some completed requests and drop some that
//! never were. The inflight log is a memfd the back end allocates ([`InflightRegion::create`],
//! `GET_INFLIGHT_FD`) and the frontend keeps and hands to the next back end
//! ([`InflightRegion::map`], `SET_INFLIGHT_FD`). Per queue it holds a header and one entry per
//! descriptor head: whether the head is in flight, and a submission counter.
//!
//! **The steps (vhost-user, "Inflight I/O tracking", split rings).**
//! - Taking head `h` ([`Ring::taken`]): `desc[h].counter = counter++`, then `desc[h].inflight = 1`.
//! - Completing head `h` ([`Ring::add_used`]): `last_batch_head = h`; the used element and the
//!   used index are written; `desc[h].inflight = 0`; `used_idx =` the used index.
//! - Starting ([`Ring::new`]): a log whose `used_idx` differs from the ring's used index belongs
//!   to a back end that died between writing the used index and clearing the entries, so the
//!   last batch's entries (from `last_batch_head`, by `next`, as many as the two indexes
//!   differ) are cleared and `used_idx` catches up. Every head still in flight is then redone,
//!   oldest counter first, before anything new ([`Ring::resubmit`]); the next available index
//!   is the used index plus their number. A log naming more heads in flight than the driver
//!   made available and did not get back is set aside.
//!
//! Each store is ordered after the one before it by a fence, so a back end killed between any
//! two of them leaves a log the next one reads right. Hence a ring with a log returns chains
//! one used-index store each; only a ring without one publishes a batch with a single store
//! ([`Ring::add_used_batch`]).
//!
//! **Polling.** While the serving thread polls a ring it keeps the driver's notifications off
//! ([`Ring::start_polling`]); before it sleeps it turns them on and looks once more
//! ([`Ring::stop_polling`]), so no request slips between the last look and the sleep. The log is the frontend's memory as much
//! as ours: it is read through bounds-checked copies, and a head it names is just a request to
//! read from the ring, checked like any other.
//!
//! **Heads and chains.** Heads come off the available ring through [`Ring::next_head`]; the
//! chains, of new heads and of heads to redo (which are not on the ring any more) alike, are
//! read by [`Ring::read_chain`], which walks the descriptor table itself: direct and indirect
//! descriptors, with the limits virtio-queue keeps (a chain no longer than its table, a `next`
//! inside it, no indirect table inside another); chains go back with [`Ring::return_batch`].
//! Each ring entry, descriptor and used element is one small read or write of the device
//! space's view ([`memvisor::DmaMemory::read_value`], `write_value`: a translation and one
//! copy), not vm-memory's slice iterator, which cost a libblkio request ~2,200 instructions for
//! its ring entry, three descriptors and used element. virtio-queue keeps the queue's state
//! and notifications. [`Ring::chain`] and [`Ring::add_used_batch`] do the same walk and batch
//! through any vm-memory `GuestMemory`. A malformed chain is an error: the device fails that
//! request alone.

use std::collections::VecDeque;
use std::io;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use memvisor::{Backing, BackingKind, DmaMemory, Iova};
use virtio_bindings::virtio_ring::{VRING_DESC_F_INDIRECT, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryError};

use crate::error::{Error, Result};

/// Bytes of a queue's log header (features, version, desc_num, last_batch_head, used_idx).
const HEADER: u64 = 16;
/// Bytes of one head's entry (inflight, padding, next, counter).
const ENTRY: u64 = 16;
/// Each queue's part starts on a 64-byte boundary.
const QUEUE_ALIGN: u64 = 64;
/// The log's format version, written by the first back end to use a queue's part.
const VERSION: u16 = 1;
/// The largest log accepted from a frontend.
const MAX_LOG: u64 = 64 << 20;
/// The largest split queue the virtio specification allows (32768 entries, "Queue Size" must be
/// a power of two up to it): what a device accepts unless it says less ([`crate::Device::queue_max`]).
pub const MAX_QUEUE: u16 = 32768;

// A descriptor's flags (16 bits on the ring; the bindings give them as u32).
const NEXT: u16 = VRING_DESC_F_NEXT as u16;
const WRITE: u16 = VRING_DESC_F_WRITE as u16;
const INDIRECT: u16 = VRING_DESC_F_INDIRECT as u16;
/// Bytes of a split descriptor.
const DESC: u32 = std::mem::size_of::<Descriptor>() as u32;

/// Bytes of one queue's part of a log for queues of `queue_size` heads.
pub fn queue_bytes(queue_size: u16) -> u64 {
    (HEADER + ENTRY * u64::from(queue_size)).next_multiple_of(QUEUE_ALIGN)
}

/// The inflight log shared with the frontend: `queues` parts of [`queue_bytes`] each.
#[derive(Debug)]
pub struct InflightRegion {
    memory: Arc<Backing>,
    queues: u16,
    queue_size: u16,
}

impl InflightRegion {
    /// A new, zeroed log for `queues` queues of `queue_size` heads (`GET_INFLIGHT_FD`).
    pub fn create(queues: u16, queue_size: u16) -> Result<InflightRegion> {
        let size = Self::check(queues, queue_size)?;
        let memory = Backing::new(BackingKind::Memfd, size.next_multiple_of(4096))?;
        Ok(InflightRegion {
            memory: Arc::new(memory),
            queues,
            queue_size,
        })
    }

    /// The log the frontend kept from an earlier back end (`SET_INFLIGHT_FD`): `size` bytes of
    /// `fd` at `offset`, laid out for `queues` queues of `queue_size` heads.
    pub fn map(
        fd: std::os::fd::OwnedFd,
        offset: u64,
        size: u64,
        queues: u16,
        queue_size: u16,
    ) -> Result<InflightRegion> {
        let need = Self::check(queues, queue_size)?;
        if size < need || size > MAX_LOG {
            return Err(Error::BadRegion(format!(
                "inflight log of {size:#x} bytes for {queues} queues of {queue_size}: it needs \
                 {need:#x} bytes, and at most {MAX_LOG:#x} are accepted"
            )));
        }
        // Whole pages are mapped; a log's last page may lie partly past its end.
        let memory = Backing::from_fd(fd, offset, size.next_multiple_of(4096)).map_err(|e| {
            Error::BadRegion(format!(
                "inflight log of {size:#x} bytes at offset {offset:#x}: {e}"
            ))
        })?;
        Ok(InflightRegion {
            memory: Arc::new(memory),
            queues,
            queue_size,
        })
    }

    /// Checks the shape of a log; returns its size in bytes.
    fn check(queues: u16, queue_size: u16) -> Result<u64> {
        if queues == 0 || queue_size == 0 || queue_size > MAX_QUEUE {
            return Err(Error::Invalid(format!(
                "inflight log for {queues} queues of {queue_size} heads: at least one queue, \
                 of 1 to {MAX_QUEUE} heads"
            )));
        }
        Ok(u64::from(queues) * queue_bytes(queue_size))
    }

    /// The memfd to hand to the frontend.
    pub fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.memory.fd()
    }

    /// Bytes of the log as mapped (all queues, in whole pages): what the frontend maps.
    pub fn size(&self) -> u64 {
        self.memory.size()
    }

    /// Number of queues it covers.
    pub fn queues(&self) -> u16 {
        self.queues
    }

    /// Heads per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }
}

/// One queue's part of the log, and the back end's counter.
#[derive(Debug)]
struct InflightQueue {
    memory: Arc<Backing>,
    /// Where the queue's part starts in the log.
    base: u64,
    /// Heads covered (the ring's size: no head of the ring lies past it).
    heads: u16,
    counter: u64,
}

impl InflightQueue {
    fn read<const N: usize>(&self, at: u64) -> [u8; N] {
        let mut b = [0u8; N];
        // Inside the part: `base + at` < the log's size was checked when the part was made.
        if let Err(e) = self.memory.read(self.base + at, &mut b) {
            log::error!("inflight log read at {at:#x}: {e}");
        }
        b
    }

    fn write(&self, at: u64, bytes: &[u8]) {
        if let Err(e) = self.memory.write(self.base + at, bytes) {
            log::error!("inflight log write at {at:#x}: {e}");
        }
        // The next store must not be seen before this one, even by a successor reading the
        // log after this process died between the two.
        fence(Ordering::Release);
    }

    fn entry(head: u16) -> u64 {
        HEADER + ENTRY * u64::from(head)
    }

    fn taken(&mut self, head: u16) {
        if head >= self.heads {
            return;
        }
        let c = self.counter;
        self.counter += 1;
        self.write(Self::entry(head) + 8, &c.to_le_bytes());
        self.write(Self::entry(head), &[1]);
    }

    fn before_used(&self, head: u16) {
        self.write(12, &head.to_le_bytes());
    }

    fn after_used(&self, head: u16, used_idx: u16) {
        if head < self.heads {
            self.write(Self::entry(head), &[0]);
        }
        self.write(14, &used_idx.to_le_bytes());
    }
}

/// A started virtqueue: the split queue, and its part of the inflight log if there is one.
/// Dereferences to the [`Queue`] for everything else (notifications, addresses, indexes).
#[derive(Debug)]
pub struct Ring {
    queue: Queue,
    inflight: Option<InflightQueue>,
    /// Heads a predecessor left in flight, oldest first: redone before anything new.
    resubmit: VecDeque<u16>,
    /// The serving thread is polling the ring: notifications stay off ([`Ring::start_polling`]).
    polling: bool,
    /// The used index when [`Ring::needs_notification`] last looked: the chains put back since
    /// are those it asks about.
    checked_used: u16,
    /// Stores of the used index so far ([`Ring::used_index_stores`]).
    index_stores: u64,
    /// The heads the last read of the available index showed made available: the next
    /// available indexes `[avail_from, avail_to)` (wrapping), read without reading the index
    /// again ([`Ring::next_head`]).
    avail_from: u16,
    avail_to: u16,
}

impl Ring {
    /// A ring over `queue` whose indexes are set. With `log` (the inflight log, and this
    /// ring's queue index in it), the log is read as the module comment says: heads left in
    /// flight are queued for [`Ring::resubmit`], and the queue's next available index becomes
    /// the used index plus their number.
    pub fn new<M: GuestMemory>(
        mut queue: Queue,
        log: Option<(&InflightRegion, u16)>,
        mem: &M,
    ) -> Result<Ring> {
        let Some((region, index)) = log.filter(|(r, i)| *i < r.queues) else {
            return Ok(Ring::assemble(queue, None, VecDeque::new()));
        };
        if queue.size() > region.queue_size {
            return Err(Error::BadRing(format!(
                "ring {index} of {} entries: the inflight log covers {} heads per queue",
                queue.size(),
                region.queue_size
            )));
        }
        let mut q = InflightQueue {
            memory: region.memory.clone(),
            base: u64::from(index) * queue_bytes(region.queue_size),
            heads: queue.size(),
            counter: 0,
        };
        let version = u16::from_le_bytes(q.read(8));
        if version == 0 {
            // A fresh log: nothing was ever in flight.
            q.write(10, &region.queue_size.to_le_bytes());
            q.write(8, &VERSION.to_le_bytes());
            return Ok(Ring::assemble(queue, Some(q), VecDeque::new()));
        }
        let used = queue
            .used_idx(mem, Ordering::Acquire)
            .map_err(|e| Error::BadRing(format!("ring {index}: used index unreadable: {e}")))?
            .0;
        let logged = u16::from_le_bytes(q.read(14));
        if logged != used {
            // Died after publishing its last batch of completions and before clearing their
            // entries: the batch is `used - logged` heads, listed from `last_batch_head` by
            // each entry's `next` (vhost-user.rst, "When reconnecting"). Ours are batches of
            // one; another back end's may be longer.
            let mut head = u16::from_le_bytes(q.read(12));
            for _ in 0..used.wrapping_sub(logged).min(q.heads) {
                if head >= q.heads {
                    break;
                }
                let e: [u8; 16] = q.read(InflightQueue::entry(head));
                q.write(InflightQueue::entry(head), &[0]);
                head = u16::from_le_bytes([e[6], e[7]]);
            }
            q.write(14, &used.to_le_bytes());
        }
        let mut left: Vec<(u64, u16)> = (0..q.heads)
            .filter_map(|h| {
                let e: [u8; 16] = q.read(InflightQueue::entry(h));
                (e[0] == 1).then(|| (u64::from_le_bytes(e[8..16].try_into().expect("8")), h))
            })
            .collect();
        // No more can be in flight than the driver made available and has not had back: a
        // log that says otherwise (a frontend's or a dying back end's garbage) names heads
        // that are no requests. It is set aside, and the ring goes on from the base the
        // frontend gave, as without a log.
        let avail = queue
            .avail_idx(mem, Ordering::Acquire)
            .map_err(|e| Error::BadRing(format!("ring {index}: available index unreadable: {e}")))?
            .0;
        let out = avail.wrapping_sub(used);
        if left.len() > usize::from(out) {
            log::warn!(
                "ring {index}: the inflight log names {} heads in flight, but only {out} were \
                 made available and not returned: the log is set aside",
                left.len()
            );
            for &(_, h) in &left {
                q.write(InflightQueue::entry(h), &[0]);
            }
            return Ok(Ring::assemble(queue, Some(q), VecDeque::new()));
        }
        left.sort_unstable();
        q.counter = left.last().map_or(0, |&(c, _)| c.wrapping_add(1));
        let next = used.wrapping_add(left.len() as u16);
        queue.set_next_avail(next);
        queue.set_next_used(used);
        if !left.is_empty() {
            log::info!(
                "ring {index}: {} requests were in flight when the last back end stopped; \
                 redoing them (used index {used}, next available {next})",
                left.len()
            );
        }
        Ok(Ring::assemble(
            queue,
            Some(q),
            left.into_iter().map(|(_, h)| h).collect(),
        ))
    }

    fn assemble(queue: Queue, inflight: Option<InflightQueue>, resubmit: VecDeque<u16>) -> Ring {
        Ring {
            checked_used: queue.next_used(),
            avail_from: queue.next_avail(),
            avail_to: queue.next_avail(),
            queue,
            inflight,
            resubmit,
            polling: false,
            index_stores: 0,
        }
    }

    /// The head of the next chain the driver made available, if there is one, taken off the
    /// available ring: the next available index moves past it (and
    /// `Queue::go_to_previous_position` puts it back). What virtio-queue's `AvailIter` gives,
    /// read through the device space's view ([`DmaMemory::read_value`]) instead of vm-memory's
    /// slice iterator. The available index is read only once every head its last read showed
    /// was taken, then ordered before the ring's entries (acquire); a driver's index more than
    /// the ring's size past the next head to take is refused, as virtio-queue refuses it. A
    /// read the view cannot make (a miss behind a vIOMMU: [`DmaMemory::take_miss`] says so)
    /// is an error.
    pub fn next_head(&mut self, mem: &DmaMemory) -> Result<Option<u16>> {
        if !self.queue.ready() {
            return Err(Error::BadRing("the ring is not ready".into()));
        }
        let next = self.queue.next_avail();
        let size = self.queue.size();
        let ring = self.queue.avail_ring();
        let past = |what: &str| {
            Error::BadRing(format!(
                "available ring at {ring:#x}: {what} past the address space"
            ))
        };
        // Heads in `[avail_from, avail_to)` are known made available; else read the index.
        if next.wrapping_sub(self.avail_from) >= self.avail_to.wrapping_sub(self.avail_from) {
            let at = ring.checked_add(2).ok_or_else(|| past("its index"))?;
            let idx = u16::from_le(mem.read_value::<u16>(Iova(at))?);
            // The driver wrote the entries before the index: read them after it.
            fence(Ordering::Acquire);
            let ahead = idx.wrapping_sub(next);
            if ahead > size {
                return Err(Error::BadRing(format!(
                    "available index {idx} is {ahead} heads past the next one to take ({next}), \
                     more than the ring's {size}"
                )));
            }
            (self.avail_from, self.avail_to) = (next, idx);
            if ahead == 0 {
                return Ok(None);
            }
        }
        let at = ring
            .checked_add(4 + 2 * u64::from(next % size))
            .ok_or_else(|| past("an entry"))?;
        let head = u16::from_le(mem.read_value::<u16>(Iova(at))?);
        self.queue.set_next_avail(next.wrapping_add(1));
        Ok(Some(head))
    }

    /// A ring with no inflight log (tests, fuzzing, devices that need none).
    pub fn plain(queue: Queue) -> Ring {
        Ring::assemble(queue, None, VecDeque::new())
    }

    /// The serving thread polls the ring from now on: the driver is asked not to notify
    /// (`VRING_USED_F_NO_NOTIFY` without event indexes; with them, `avail_event` is simply not
    /// moved on, so the driver kicks at most once more), and [`Ring::enable_notification`] does
    /// nothing until [`Ring::stop_polling`].
    pub fn start_polling<M: GuestMemory>(&mut self, mem: &M) {
        self.polling = true;
        // A ring whose used flags cannot be written is broken: the next look at it says so.
        let _ = self.queue.disable_notification(mem);
    }

    /// The serving thread stops polling the ring (before it sleeps): notifications on again,
    /// then — after a full fence, so a driver that made a request available meanwhile either
    /// sees them on and kicks or has its request seen here — one more look. Returns whether
    /// the ring holds requests the device has not taken: they must be served now, as the driver
    /// may never kick for them. False if the ring was not being polled.
    pub fn stop_polling<M: GuestMemory>(&mut self, mem: &M) -> bool {
        if !std::mem::take(&mut self.polling) {
            return false;
        }
        // An unreadable ring is broken, not busy: the next pass over it says so.
        self.queue.enable_notification(mem).unwrap_or(false) || !self.resubmit.is_empty()
    }

    /// Whether the serving thread polls the ring ([`Ring::start_polling`]).
    pub fn is_polling(&self) -> bool {
        self.polling
    }

    /// Asks the driver to notify for its next request and looks once more for one made
    /// available meanwhile (`true`: there is one), as [`QueueT::enable_notification`] does;
    /// while the ring is polled, does nothing and says `false` (the poll looks again).
    pub fn enable_notification<M: GuestMemory>(
        &mut self,
        mem: &M,
    ) -> std::result::Result<bool, virtio_queue::Error> {
        if self.polling {
            return Ok(false);
        }
        self.queue.enable_notification(mem)
    }

    /// The next head a predecessor left in flight, to be redone before the available ring is
    /// read; it stays in flight in the log until completed.
    pub fn resubmit(&mut self) -> Option<u16> {
        self.resubmit.pop_front()
    }

    /// Puts a head from [`Ring::resubmit`] back at the front (its chain could not be read yet).
    pub fn resubmit_later(&mut self, head: u16) {
        self.resubmit.push_front(head);
    }

    /// Heads still to be redone.
    pub fn pending_resubmits(&self) -> usize {
        self.resubmit.len()
    }

    /// Whether the ring has an inflight log.
    pub fn has_inflight_log(&self) -> bool {
        self.inflight.is_some()
    }

    /// Records in the log that `head`, just taken from the available ring, is in flight.
    pub fn taken(&mut self, head: u16) {
        if let Some(q) = self.inflight.as_mut() {
            q.taken(head);
        }
    }

    /// Returns `head` to the driver with `len` bytes written, and records its completion in the
    /// log around the used ring's update.
    pub fn add_used<M: GuestMemory>(
        &mut self,
        mem: &M,
        head: u16,
        len: u32,
    ) -> std::result::Result<(), virtio_queue::Error> {
        if let Some(q) = self.inflight.as_ref() {
            q.before_used(head);
        }
        self.queue.add_used(mem, head, len)?;
        self.index_stores += 1;
        if let Some(q) = self.inflight.as_ref() {
            q.after_used(head, self.queue.next_used());
        }
        Ok(())
    }

    /// Returns the chains `used` (head, bytes written) to the driver, in order. Without an
    /// inflight log their elements are written and then published by one store of the used
    /// index (with release order: the driver that reads the index sees every element). With a
    /// log, each goes back as [`Ring::add_used`] does, index store and all: libvhost-user's and
    /// DPDK's recovery mends only `last_batch_head`, so a back end killed after publishing
    /// several heads at once would have such a successor redo heads the driver already had
    /// back (ours follows the batch's list). A head that cannot be
    /// returned (out of range, its element unwritable) is handed to `failed` and the rest go
    /// on. Ask [`Ring::needs_notification`] once after the batch. A device that writes through
    /// the device space's view uses [`Ring::return_batch`], the same without vm-memory's slice
    /// iterator.
    pub fn add_used_batch<M: GuestMemory>(
        &mut self,
        mem: &M,
        used: impl IntoIterator<Item = (u16, u32)>,
        failed: impl FnMut(u16, virtio_queue::Error),
    ) {
        let write = |at: u64, element: u64| {
            mem.write_obj(element, GuestAddress(at))
                .map_err(virtio_queue::Error::GuestMemory)
        };
        self.used_batch(mem, used, write, failed);
    }

    /// [`Ring::add_used_batch`] through the device space's view: each element one
    /// [`DmaMemory::write_value`] (a device write: its page is marked dirty while the space
    /// logs pages). What the vhost-user back end returns its chains with.
    pub fn return_batch(
        &mut self,
        mem: &DmaMemory,
        used: impl IntoIterator<Item = (u16, u32)>,
        failed: impl FnMut(u16, virtio_queue::Error),
    ) {
        let write = |at: u64, element: u64| {
            mem.write_value(Iova(at), element).map_err(|e| {
                virtio_queue::Error::GuestMemory(GuestMemoryError::IOError(io::Error::other(e)))
            })
        };
        self.used_batch(mem, used, write, failed);
    }

    /// The batch of [`Ring::add_used_batch`] and [`Ring::return_batch`]; `write` puts one used
    /// element (id in the low half, length in the high half, little-endian) at a device
    /// address.
    #[inline(always)]
    fn used_batch<M: GuestMemory>(
        &mut self,
        mem: &M,
        used: impl IntoIterator<Item = (u16, u32)>,
        mut write: impl FnMut(u64, u64) -> std::result::Result<(), virtio_queue::Error>,
        mut failed: impl FnMut(u16, virtio_queue::Error),
    ) {
        if self.inflight.is_some() {
            for (head, len) in used {
                if let Err(e) = self.add_used(mem, head, len) {
                    failed(head, e);
                }
            }
            return;
        }
        let size = self.queue.size();
        let ring = self.queue.used_ring();
        let start = self.queue.next_used();
        let mut next = start;
        let mut last = None;
        for (head, len) in used {
            if head >= size {
                failed(head, virtio_queue::Error::InvalidDescriptorIndex);
                continue;
            }
            // The used ring: flags, idx, then 8-byte elements (id: le32, len: le32).
            let Some(at) = ring.checked_add(4 + 8 * u64::from(next % size)) else {
                failed(head, virtio_queue::Error::AddressOverflow);
                continue;
            };
            let element = u64::from(head) | u64::from(len) << 32;
            if let Err(e) = write(at, element.to_le()) {
                failed(head, e);
                continue;
            }
            next = next.wrapping_add(1);
            last = Some(head);
        }
        let Some(last) = last else {
            return;
        };
        let stored = ring
            .checked_add(2)
            .ok_or(virtio_queue::Error::AddressOverflow)
            .and_then(|at| {
                mem.store(u16::to_le(next), GuestAddress(at), Ordering::Release)
                    .map_err(virtio_queue::Error::GuestMemory)
            });
        match stored {
            Ok(()) => {
                self.index_stores += 1;
                self.queue.set_next_used(next);
            }
            // Nothing was published: the ring is unusable (its next pass says so).
            Err(e) => failed(last, e),
        }
    }

    /// Whether the driver wants an interrupt for the chains put back since the last time this
    /// was asked: always without event indexes; with them, when the used index passed the
    /// driver's `used_event` meanwhile (the test Linux's `virtqueue_kick_prepare` and
    /// virtio-queue make, over however many chains a batch returned).
    pub fn needs_notification<M: GuestMemory>(
        &mut self,
        mem: &M,
    ) -> std::result::Result<bool, virtio_queue::Error> {
        let used = std::num::Wrapping(self.queue.next_used());
        let old = std::num::Wrapping(std::mem::replace(&mut self.checked_used, used.0));
        // The used index's store comes before the read of `used_event` (the driver does the
        // opposite pair: a missed interrupt otherwise).
        fence(Ordering::SeqCst);
        if !self.queue.event_idx_enabled() {
            return Ok(true);
        }
        // `used_event` follows the available ring's entries.
        let at = self
            .queue
            .avail_ring()
            .checked_add(4 + 2 * u64::from(self.queue.size()))
            .ok_or(virtio_queue::Error::AddressOverflow)?;
        let event: u16 = mem
            .load(GuestAddress(at), Ordering::Relaxed)
            .map_err(virtio_queue::Error::GuestMemory)?;
        let event = std::num::Wrapping(u16::from_le(event));
        Ok(used - event - std::num::Wrapping(1) < used - old)
    }

    /// How many times the used index was stored since the ring started: with batches
    /// ([`Ring::add_used_batch`]), fewer than the chains put back.
    pub fn used_index_stores(&self) -> u64 {
        self.index_stores
    }

    /// The descriptors of the chain at `head`, read from the descriptor table (and an indirect
    /// table it names) through `mem`; whether it was indirect. A device that reads through the
    /// device space's view uses [`Ring::read_chain`], the same walk without vm-memory's slice
    /// iterator.
    pub fn chain<M: GuestMemory>(&self, mem: &M, head: u16) -> Result<(Vec<Desc>, bool)> {
        let mut out = Vec::new();
        let indirect = self.walk(head, &mut out, |at| {
            mem.read_obj(GuestAddress(at)).map_err(|e| e.to_string())
        })?;
        Ok((out, indirect))
    }

    /// [`Ring::chain`] through the device space's view, into `out` (emptied first): each
    /// descriptor one [`DmaMemory::read_value`] (a translation and a 16-byte copy). The
    /// vhost-user back end reads every chain this way, of new heads and of heads redone from
    /// the inflight log. A descriptor that cannot be read (a miss behind a vIOMMU:
    /// [`DmaMemory::take_miss`] says so) or a malformed chain is an error; `out` is then
    /// partly filled.
    pub fn read_chain(&self, mem: &DmaMemory, head: u16, out: &mut Vec<Desc>) -> Result<bool> {
        self.walk(head, out, |at| {
            mem.read_value(Iova(at)).map_err(|e| e.to_string())
        })
    }

    /// The walk of [`Ring::chain`] and [`Ring::read_chain`], with the limits virtio-queue keeps:
    /// a chain no longer than its table, a `next` inside it, no indirect table inside another.
    /// `read` copies out the 16-byte descriptor at a device address, or says why it cannot.
    ///
    /// An indirect descriptor may end a direct chain, not only start one (VIRTIO 1.2, 2.7.5.3.2:
    /// "zero or more normal chained descriptors followed by a single descriptor with
    /// VIRTQ_DESC_F_INDIRECT"): the walk then goes on in its table, from the table's first
    /// descriptor, and the chain ends where the table's chain ends. That descriptor's own
    /// `WRITE` and `NEXT` flags are ignored, as the specification asks of the device.
    #[inline(always)]
    fn walk(
        &self,
        head: u16,
        out: &mut Vec<Desc>,
        read: impl Fn(u64) -> std::result::Result<Descriptor, String>,
    ) -> Result<bool> {
        let size = self.queue.size();
        if head >= size {
            return Err(Error::BadChain(format!(
                "head {head} past the ring's {size} descriptors"
            )));
        }
        let read = |table: u64, i: u16| -> Result<(u64, u32, u16, u16)> {
            let at = table
                .checked_add(DESC as u64 * u64::from(i))
                .ok_or_else(|| Error::BadChain(format!("descriptor {i} past the address space")))?;
            // virtio-queue's split descriptor: the specification's 16-byte layout,
            // little-endian, copied out of guest memory.
            let d = read(at).map_err(|why| Error::DescriptorUnreadable {
                index: i,
                addr: at,
                why,
            })?;
            Ok((d.addr().0, d.len(), d.flags(), d.next()))
        };
        out.clear();
        let (mut table, mut count, mut i) = (self.queue.desc_table(), size, head);
        let mut indirect = false;
        // Descriptors read from the current table: no more than it holds, or it loops.
        let mut steps: u16 = 0;
        loop {
            if steps >= count {
                return Err(Error::BadChain(format!(
                    "chain at head {head} longer than its table's {count} descriptors (a loop)"
                )));
            }
            steps += 1;
            let (addr, len, flags, next) = read(table, i)?;
            if flags & INDIRECT != 0 {
                if indirect {
                    return Err(Error::BadChain(format!(
                        "indirect descriptor inside the indirect table of head {head}"
                    )));
                }
                if len == 0 || len % DESC != 0 || len / DESC > u32::from(MAX_QUEUE) {
                    return Err(Error::BadChain(format!(
                        "indirect table of {len} bytes in the chain of head {head}"
                    )));
                }
                (table, count, i, steps, indirect) = (addr, (len / DESC) as u16, 0, 0, true);
                continue;
            }
            out.push(Desc {
                addr,
                len,
                write: flags & WRITE != 0,
            });
            if flags & NEXT == 0 {
                return Ok(indirect);
            }
            if next >= count {
                return Err(Error::BadChain(format!(
                    "descriptor {i} of head {head} names next {next}, past {count}"
                )));
            }
            i = next;
        }
    }

    /// The queue, to be given up (`GET_VRING_BASE`).
    pub fn into_queue(self) -> Queue {
        self.queue
    }
}

impl Deref for Ring {
    type Target = Queue;
    fn deref(&self) -> &Queue {
        &self.queue
    }
}

impl DerefMut for Ring {
    fn deref_mut(&mut self) -> &mut Queue {
        &mut self.queue
    }
}

/// One descriptor of a chain: a guest buffer and whether the device writes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    /// The buffer's device address (an IOVA behind a vIOMMU, else guest physical).
    pub addr: u64,
    /// Its bytes.
    pub len: u32,
    /// Whether the device writes it (`VRING_DESC_F_WRITE`); else the device reads it.
    pub write: bool,
}
