//! Ring workers: a thread per queue, so a device with several queues uses several cores.
//!
//! **Model.** The back end's thread owns the protocol and, between messages, lends rings out.
//! When every message has been handled, each running ring past the first whose device can make
//! a copy of itself for one queue ([`Device::queue_worker`]) goes to a thread of its own with
//! that copy, its kick and call descriptors, and a shared reference to the frontend's memory
//! and dirty log; ring 0 stays on the back end's thread. The worker serves its ring as the back
//! end would — kicks, completions, the dirty log, the driver's interrupt — until told to stop.
//! Before the next message the back end stops every worker ([`Worker::stop`]): the worker ends
//! every transfer it has out and hands back its ring, its device copy ([`Device::join_worker`]). What it
//! counts goes straight into its ring's row of the back end's live counters ([`crate::live`]). So a message is still handled with no
//! request in flight and no other thread holding the memory: the memory is shared through an
//! `Arc` the back end can change only when it holds the sole reference again.
//!
//! Behind a vIOMMU no ring is lent: an IOTLB miss needs the protocol thread to ask the frontend
//! and wait for the answer, which is the back end's own loop.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use memvisor::SharedLog;
use virtio_queue::QueueT;

use crate::device::{Device, Processed};
use crate::error::{Error, Result};
use crate::live::{BackendLive, RingCounters};
use crate::memory::FrontendMemory;
use crate::ring::Ring;

/// What a worker is lent.
pub(crate) struct Lent<D> {
    pub index: u16,
    pub ring: Ring,
    pub device: D,
    pub memory: Arc<FrontendMemory>,
    pub log: Option<Arc<SharedLog>>,
    /// The back end's counters: the worker writes its ring's row.
    pub live: BackendLive,
    pub kick: File,
    pub call: Option<File>,
    pub err: Option<File>,
}

/// What a stopped worker hands back.
pub(crate) struct Returned<D> {
    pub index: u16,
    pub ring: Ring,
    pub device: D,
    /// The ring broke (the driver needs a reset); the error descriptor was written.
    pub broken: bool,
}

/// A running worker.
pub(crate) struct Worker<D> {
    stop: File,
    thread: JoinHandle<Returned<D>>,
}

impl<D: Device + 'static> Worker<D> {
    /// Starts a thread serving `lent`.
    pub fn start(lent: Lent<D>) -> Result<Worker<D>> {
        // SAFETY: eventfd takes no pointers; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(Error::Os {
                op: "create a worker's stop eventfd",
                source: std::io::Error::last_os_error(),
            });
        }
        // SAFETY: a descriptor eventfd just returned, owned by nothing else.
        let stop = unsafe { File::from_raw_fd(fd) };
        let theirs = stop.try_clone().map_err(|source| Error::Os {
            op: "share a worker's stop eventfd",
            source,
        })?;
        // Short enough for the kernel's 15-byte thread names (`ps -L`, /proc/PID/task/*/comm).
        let name = format!("memvisor-q{}", lent.index);
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || serve(lent, theirs))
            .map_err(|source| Error::Os {
                op: "start a ring worker",
                source,
            })?;
        Ok(Worker { stop, thread })
    }

    /// Tells the worker to stop and waits for what it hands back: it first ends every
    /// transfer it has out.
    pub fn stop(mut self) -> Option<Returned<D>> {
        let _ = self.stop.write(&1u64.to_le_bytes());
        match self.thread.join() {
            Ok(r) => Some(r),
            Err(_) => {
                log::error!("a ring worker panicked; its ring is lost until the frontend resets");
                None
            }
        }
    }
}

/// The worker's loop.
fn serve<D: Device>(mut w: Lent<D>, stop: File) -> Returned<D> {
    let live = w.live.clone();
    let stats = live.ring(usize::from(w.index));
    let mut broken = false;
    let poll_budget = w.device.poll();
    let mut spin_after_kick = false;
    loop {
        if let (Some(budget), true) = (poll_budget, std::mem::take(&mut spin_after_kick)) {
            if spin(&mut w, &stop, budget, stats).is_err() {
                broken = true;
                break;
            }
        }
        let done = w.device.completion_fd().unwrap_or(-1);
        let mut fds = [stop.as_raw_fd(), w.kick.as_raw_fd(), done].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: `fds` is a live array of pollfd of the given length (a negative fd is
        // ignored by poll).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 200) };
        if n < 0 {
            continue;
        }
        if fds[0].revents != 0 {
            break;
        }
        if fds[2].revents & libc::POLLIN != 0 {
            reap(&mut w, false, stats);
            // Chains left on the ring while the device had as many out as it keeps: the
            // driver made them available long ago and will not kick for them again.
            if has_more(&w) && process(&mut w, stats).is_err() {
                broken = true;
                break;
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut b = [0u8; 8];
            let _ = w.kick.read(&mut b);
            stats.kicks.add(1);
            stats.worker_kicks.add(1);
            spin_after_kick = true;
            if process(&mut w, stats).is_err() {
                broken = true;
                break;
            }
        }
    }
    reap(&mut w, true, stats);
    Returned {
        index: w.index,
        ring: w.ring,
        device: w.device,
        broken,
    }
}

/// Looks at the ring for new requests until `budget` passed since the last found, or a stop.
fn spin<D: Device>(
    w: &mut Lent<D>,
    stop: &File,
    budget: Duration,
    stats: &RingCounters,
) -> Result<()> {
    let mut until = Instant::now() + budget;
    loop {
        reap(w, false, stats);
        if has_more(w) {
            stats.poll_hits.add(1);
            process(w, stats)?;
            until = Instant::now() + budget;
        }
        let mut p = libc::pollfd {
            fd: stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        if unsafe { libc::poll(&mut p, 1, 0) } > 0 || Instant::now() >= until {
            return Ok(());
        }
        std::hint::spin_loop();
    }
}

/// Whether the ring holds requests the device has not taken (or heads to redo).
fn has_more<D>(w: &Lent<D>) -> bool {
    let mem = w.memory.dma().memory();
    w.ring.pending_resubmits() > 0
        || w.ring
            .avail_idx(&mem, Ordering::Acquire)
            .is_ok_and(|a| a.0 != w.ring.next_avail())
}

/// Serves what the driver made available; an error means the ring broke (told on `err`). As
/// the back end's own pass does: when transfers ended during the pass (their completions read
/// here, so nothing will wake the loop for them) and the ring still holds requests the device
/// left there while it had as many out as it keeps, it goes round again.
fn process<D: Device>(w: &mut Lent<D>, stats: &RingCounters) -> Result<()> {
    loop {
        let t0 = Instant::now();
        let r = w.device.process(w.index, &mut w.ring, &w.memory);
        stats.process_ns.add(t0.elapsed().as_nanos() as u64);
        // Transfers the kernel finished at once end now; one drain of the log for them and for
        // what `process` ended itself, before the driver is told.
        let (any, tell) = ended(w, false);
        drain_log(w, stats);
        match r {
            Ok(p) => {
                // No ring is lent behind a vIOMMU: a worker's device never misses.
                let notify = matches!(
                    p,
                    Processed::Served { notify: true } | Processed::Missed { .. }
                );
                if notify || tell {
                    signal(&mut w.call);
                }
                if !(any && has_more(w)) {
                    return Ok(());
                }
            }
            Err(e) => {
                log::warn!("{}: ring {} stopped: {e}", w.device.name(), w.index);
                signal(&mut w.call);
                signal(&mut w.err);
                return Err(e);
            }
        }
    }
}

/// Ends the device's transfers that have ended (with `wait`, all of them).
fn reap<D: Device>(w: &mut Lent<D>, wait: bool, stats: &RingCounters) {
    let (any, tell) = ended(w, wait);
    if any {
        drain_log(w, stats);
    }
    if tell {
        signal(&mut w.call);
    }
}

/// Ends what has ended (chains back on the ring); returns whether anything ended, and whether
/// its driver should be told.
fn ended<D: Device>(w: &mut Lent<D>, wait: bool) -> (bool, bool) {
    let mut rings: Vec<Option<&mut Ring>> = (0..=w.index).map(|_| None).collect();
    rings[usize::from(w.index)] = Some(&mut w.ring);
    match w.device.complete(&mut rings, &w.memory, wait) {
        Ok(e) => (!e.is_empty(), e.iter().any(|&(_, notify)| notify)),
        Err(e) => {
            log::error!(
                "{}: ring {}: ending requests: {e}",
                w.device.name(),
                w.index
            );
            (false, false)
        }
    }
}

/// What the ring's requests wrote goes into the frontend's log before the driver hears.
fn drain_log<D>(w: &Lent<D>, stats: &RingCounters) {
    if let Some(log) = &w.log {
        let t0 = Instant::now();
        match w.memory.drain_dirty(log) {
            Ok(pages) => stats.logged_pages.add(pages),
            Err(e) => log::error!("ring {}: dirty log: {e}", w.index),
        }
        stats.log_ns.add(t0.elapsed().as_nanos() as u64);
        stats.log_drains.add(1);
    }
}

fn signal(f: &mut Option<File>) {
    if let Some(f) = f {
        let _ = f.write(&1u64.to_le_bytes());
    }
}
