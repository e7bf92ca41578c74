//! The ring service: what serving a ring is, the same on the back end's own thread and on a
//! ring worker's ([`crate::worker`]).
//!
//! **Model.** Whoever serves rings holds them behind [`Rings`]: the back end's thread every ring
//! not lent out, a worker its one ring. A *pass* over a ring ([`pass`]) has the device process
//! it, then ends what the device finished meanwhile ([`Device::complete`]: transfers the kernel
//! finished at once): each finished chain goes back on its used ring — one ring at a time, so
//! each ring is asked once whether its driver wants an interrupt (event indexes) — what the
//! requests wrote goes into the frontend's dirty log in one drain, and only then are the
//! drivers interrupted. A device keeps a bounded number of requests in flight and leaves the
//! rest on the ring; a pass that ended transfers (whose completions, read here, will wake
//! nobody) while the ring still holds requests says to go round again ([`Pass::again`]).
//! [`complete`] is the same ending on its own, when the device's completion descriptor fires or
//! before a message (with `wait`). [`spin`] looks at the rings again and again for a while
//! after a kick, so a busy device serves requests without waiting for the next kick.
//!
//! What differs between the two callers stays with them: the back end's thread also handles
//! IOTLB misses (a worker is never lent a ring behind a vIOMMU) and stops a broken ring itself;
//! a worker tells the frontend through the ring's error descriptor and hands the ring back.

use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use virtio_queue::QueueT;

use crate::device::{Device, Processed, Used};
use crate::error::Result;
use crate::live::RingCounters;
use crate::memory::FrontendMemory;
use crate::ring::Ring;

/// The rings a serving thread holds, and how it tells their drivers.
pub(crate) trait Rings {
    /// Ring `index`, if it is held here (running or not: a chain that ended goes back on it).
    fn ring(&mut self, index: u16) -> Option<&mut Ring>;
    /// What the ended requests wrote goes into the frontend's dirty log (when it keeps one).
    fn log(&mut self);
    /// Interrupts the driver of ring `index`.
    fn notify(&mut self, index: u16);
}

/// What a pass over a ring came to.
pub(crate) struct Pass {
    /// What the device said.
    pub processed: Processed,
    /// Transfers ended during the pass and the ring still holds requests: go round again.
    pub again: bool,
}

/// One pass over ring `index`: the device processes it, the chains it finished meanwhile go
/// back on their rings, the dirty log is drained, then the drivers are interrupted (ring
/// `index`'s when the device says so). An error means the ring is broken: the caller stops it.
pub(crate) fn pass<D: Device, R: Rings>(
    device: &mut D,
    rings: &mut R,
    index: u16,
    memory: &FrontendMemory,
    stats: &RingCounters,
) -> Result<Pass> {
    let Some(ring) = rings.ring(index) else {
        return Ok(Pass {
            processed: Processed::served(false),
            again: false,
        });
    };
    let t0 = Instant::now();
    let r = device.process(index, ring, memory);
    stats.process_ns.add(t0.elapsed().as_nanos() as u64);
    // Transfers the kernel finished at once (the page cache) end now, not a poll later; they
    // and what `process` ended itself are logged, in one drain, before the guest is told (and
    // before the frontend can stop the ring and read the log for the last time).
    let ended = finish(device, rings, memory, false);
    rings.log();
    for &i in &ended.tell {
        rings.notify(i);
    }
    let processed = r?;
    if processed == Processed::served(true) && !ended.tell.contains(&index) {
        rings.notify(index);
    }
    let again = matches!(processed, Processed::Served { .. })
        && ended.any
        && rings.ring(index).is_some_and(|q| has_requests(q, memory));
    Ok(Pass { processed, again })
}

/// Ends the device's work that has ended (with `wait`, all of it): chains back on their rings,
/// what they wrote into the dirty log, their drivers interrupted. Returns whether anything
/// ended.
pub(crate) fn complete<D: Device, R: Rings>(
    device: &mut D,
    rings: &mut R,
    memory: &FrontendMemory,
    wait: bool,
) -> bool {
    let ended = finish(device, rings, memory, wait);
    if !ended.any {
        return false;
    }
    // Logged before the guest is told, as in a pass.
    rings.log();
    for &i in &ended.tell {
        rings.notify(i);
    }
    true
}

/// Whether `ring` holds requests the device has not taken, or heads to redo.
pub(crate) fn has_requests(ring: &Ring, memory: &FrontendMemory) -> bool {
    let mem = memory.dma().memory();
    ring.pending_resubmits() > 0
        || ring
            .avail_idx(&mem, Ordering::Acquire)
            .is_ok_and(|a| a.0 != ring.next_avail())
}

/// After a kick: runs `round` (which serves the rings with requests and says whether it found
/// any) again and again until `budget` passed since the last round that found one, or `stop`
/// (a descriptor: the connection, a worker's stop) becomes readable. An idle device sleeps; only
/// a busy one spins.
pub(crate) fn spin(
    budget: Duration,
    stop: RawFd,
    mut round: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let mut until = Instant::now() + budget;
    loop {
        if round()? {
            until = Instant::now() + budget;
        }
        if readable(stop) || Instant::now() >= until {
            return Ok(());
        }
        std::hint::spin_loop();
    }
}

/// Whether `fd` is readable now.
fn readable(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

/// What ended: whether anything, and the rings whose drivers should be told.
struct Ended {
    any: bool,
    tell: Vec<u16>,
}

/// Takes what the device finished and puts each chain back on its ring, one ring at a time.
fn finish<D: Device, R: Rings>(
    device: &mut D,
    rings: &mut R,
    memory: &FrontendMemory,
    wait: bool,
) -> Ended {
    let mut used = match device.complete(memory, wait) {
        Ok(u) => u,
        Err(e) => {
            log::error!("{}: ending requests: {e}", device.name());
            Vec::new()
        }
    };
    let any = !used.is_empty();
    // Stable: each ring's chains stay in the order they ended.
    used.sort_by_key(|u| u.ring);
    let mem = memory.dma().memory();
    let mut tell = Vec::new();
    for chunk in used.chunk_by(|a, b| a.ring == b.ring) {
        let index = chunk[0].ring;
        let Some(ring) = rings.ring(index) else {
            for u in chunk {
                log::warn!(
                    "{}: queue {index} stopped before its request {} ended",
                    device.name(),
                    u.head
                );
            }
            continue;
        };
        for u in chunk {
            let Used { head, len, .. } = *u;
            // TEST ONLY: with `reorder` (the device ended them last first), a pause between
            // each chain put back, so a back end killed there leaves later requests answered
            // and earlier ones not: what only the inflight log can mend.
            #[cfg(feature = "test-hooks")]
            if memory.faults().reorder && !std::ptr::eq(u, &chunk[0]) {
                std::thread::sleep(memvisor::faults::REORDER_GAP);
            }
            if let Err(e) = ring.add_used(&mem, head, len) {
                log::warn!(
                    "{}: queue {index}: cannot return head {head}: {e}",
                    device.name()
                );
            }
        }
        if ring.needs_notification(&mem).unwrap_or(true) {
            tell.push(index);
        }
    }
    Ended { any, tell }
}
