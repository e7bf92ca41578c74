//! The seam between the vhost-user back end and a virtio device model.
//!
//! A [`Device`] knows its virtio features, its config space and how to process one of its
//! queues; the protocol, the rings' life cycle, the memory table, the IOTLB and the dirty log
//! are the back end's ([`crate::backend`]). A device reaches guest memory only through the
//! [`FrontendMemory`] it is handed: its device space for buffers (translations, copies, pins),
//! and the space's vm-memory view for the queue — so what it writes is tracked for migration
//! and what the guest took back is out of its reach.

use crate::error::{Error, Result};
use crate::memory::FrontendMemory;
use crate::ring::{MAX_QUEUE, Ring};

/// A virtio device served over vhost-user.
pub trait Device: Send {
    /// Short name for logs.
    fn name(&self) -> &'static str;
    /// Virtio feature bits the device offers (`VIRTIO_F_VERSION_1` and device bits); the
    /// back end adds vhost-user's own.
    fn features(&self) -> u64;
    /// Protocol feature bits the device needs beyond the back end's own (e.g. `CONFIG`).
    fn protocol_features(&self) -> u64 {
        0
    }
    /// Number of queues.
    fn queues(&self) -> u16;
    /// Largest queue size the device takes: `SET_VRING_NUM` above it is refused (a failure the
    /// frontend sees, [`crate::backend`]). By default every size a split ring may have, up to
    /// [`MAX_QUEUE`]: a driver may make as many requests available as the ring holds, and a
    /// device that keeps fewer in flight leaves the rest on the ring until it has room.
    fn queue_max(&self) -> u16 {
        MAX_QUEUE
    }
    /// The driver's accepted features; EINVAL refuses them.
    fn set_features(&mut self, features: u64) -> Result<()>;
    /// Reads config bytes at `offset` (bytes past the device's config read as zero).
    fn read_config(&self, offset: u32, data: &mut [u8]);
    /// Writes config bytes at `offset`.
    fn write_config(&mut self, offset: u32, data: &[u8]) -> Result<()> {
        let _ = data;
        Err(Error::Unsupported {
            request: format!("{}: config write at offset {offset}", self.name()),
            why: "the config space is read-only".into(),
        })
    }
    /// Whether the device logs its writes for migration (`VHOST_F_LOG_ALL`, `LOG_SHMFD`): it
    /// must write guest memory only through the [`FrontendMemory`]'s device space or its slot
    /// table, where memvisor tracks dirty pages.
    fn supports_dirty_log(&self) -> bool {
        false
    }
    /// Called once with the frontend's memory holder, before any message (the memory inside
    /// changes with each memory table; the holder stays).
    fn attach(&mut self, memory: &FrontendMemory) -> Result<()> {
        let _ = memory;
        Ok(())
    }
    /// Whether the config space changed on the device's side since last asked (the back end
    /// then tells the frontend). Polled between messages, at least every 200 ms.
    fn config_changed(&mut self) -> bool {
        false
    }
    /// A queue the device wants processed now although no kick came (a timer of its own: the
    /// balloon asking for fresh statistics); the back end then processes it as if kicked.
    /// Polled between messages, at least every 200 ms.
    fn due(&mut self) -> Option<u16> {
        None
    }
    /// Processes what the driver made available on queue `index` — first the heads
    /// [`Ring::resubmit`] gives, left in flight by a back end before this one — taking chains
    /// with [`Ring::taken`] and returning them with [`Ring::add_used`] (which keep the inflight
    /// log); says whether the driver should be notified, or which translations a request
    /// waits for ([`Processed`]). An error means the queue is broken (the driver needs a
    /// reset); a bad request is answered on the ring, not with an error.
    fn process(
        &mut self,
        index: u16,
        ring: &mut Ring,
        memory: &FrontendMemory,
    ) -> Result<Processed>;
    /// The serving thread read the clock at `at` as it began the pass whose
    /// [`Device::process`] comes next (it times each pass): a device that times its requests
    /// may start them from it rather than read the clock again for each. By default ignored.
    fn pass_began(&mut self, at: std::time::Instant) {
        let _ = at;
    }
    /// Called on the serving thread at the end of each pass, once the chains it finished are
    /// on their used rings and their drivers interrupted: for work that must not delay a
    /// reply (the blk device registers here the memory its requests found cold). By default
    /// nothing.
    fn after_replies(&mut self) {}
    /// A descriptor that becomes readable when work `process` handed to the kernel has ended
    /// (an io_uring's eventfd): the back end then calls [`Device::complete`]. `None`: the
    /// device finishes everything within `process`.
    fn completion_fd(&self) -> Option<std::os::fd::RawFd> {
        None
    }
    /// Ends the work that has ended — with `wait`, until nothing is left out: the back end
    /// asks so before every message, which may take memory away — and returns the chains it
    /// finished. The back end puts them on their used rings ([`Ring::add_used`]), one ring at a
    /// time, logs what they wrote and interrupts the drivers.
    fn complete(&mut self, memory: &FrontendMemory, wait: bool) -> Result<Vec<Used>> {
        let _ = (memory, wait);
        Ok(Vec::new())
    }
    /// [`Device::complete`] into `used` (emptied first), which the back end keeps between
    /// calls: a device that overrides it ends its requests with no allocation once warm.
    fn complete_into(
        &mut self,
        memory: &FrontendMemory,
        wait: bool,
        used: &mut Vec<Used>,
    ) -> Result<()> {
        *used = self.complete(memory, wait)?;
        Ok(())
    }
    /// For a device whose queues are independent: a device of the same kind, sharing what
    /// this one shares (an image, its live counters), to serve one queue on a thread of its own ([`crate::backend`] lends it a ring between messages). `None` (the default):
    /// every queue is served on the back end's thread.
    fn queue_worker(&self) -> Option<Self>
    where
        Self: Sized,
    {
        None
    }
    /// Takes back a device [`Device::queue_worker`] made, after its thread stopped.
    fn join_worker(&mut self, worker: Self)
    where
        Self: Sized,
    {
        let _ = worker;
    }
    /// Back to the state before feature negotiation.
    fn reset(&mut self);
    /// The most the serving loop keeps looking at the started rings for new requests after
    /// its last work, before it sleeps until a kick: a request that arrives meanwhile is
    /// served without the kick's wake-up, at the price of a busy core. The loop's window
    /// adapts below it (`backend::service`): 0 once requests come further apart than this.
    /// `None`: never.
    fn poll(&self) -> Option<std::time::Duration> {
        None
    }
    /// Whether an IOTLB miss fails the request (after the wait for the frontend's update gave
    /// up) instead of being returned as [`Processed::Missed`] with the chain put back.
    fn set_fail_misses(&mut self, fail: bool) {
        let _ = fail;
    }
}

/// What processing a queue came to ([`Device::process`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Processed {
    /// The device took what the ring held (or as many requests as it keeps in flight);
    /// `notify`: whether the driver should be interrupted now.
    Served {
        /// Whether the driver should be interrupted.
        notify: bool,
    },
    /// Behind a vIOMMU, a request needs device addresses the IOTLB has no translation for yet,
    /// one per unmapped page ([`crate::miss`]): its chain was put back, the chains before it
    /// were served. The back end sends a MISS for each page it has not asked for already and
    /// processes the queue again when the frontend's updates have covered them (or, when they
    /// never come, with [`Device::set_fail_misses`], failing the request).
    Missed {
        /// The first unmapped address of each page, in the order the request needs them
        /// (never empty).
        misses: Vec<memvisor::dma::Miss>,
    },
}

impl Processed {
    /// Served, notifying the driver when `notify`.
    pub fn served(notify: bool) -> Processed {
        Processed::Served { notify }
    }
}

/// A chain the device finished, for its ring's used ring ([`Device::complete`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    /// The queue it was taken from.
    pub ring: u16,
    /// Its head descriptor.
    pub head: u16,
    /// Bytes the device wrote into it.
    pub len: u32,
}
