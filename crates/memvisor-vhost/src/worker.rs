//! Ring workers: a thread per queue, so a device with several queues uses several cores.
//!
//! **Model.** The back end's thread owns the protocol and, between messages, lends rings out.
//! When every message has been handled, each running ring past the first whose device can make
//! a copy of itself for one queue ([`Device::queue_worker`]) goes to a thread of its own with
//! that copy, its kick and call descriptors, and a shared reference to the frontend's memory
//! and dirty log; ring 0 stays on the back end's thread. The worker serves its ring as the back
//! end would, through the same ring service (`backend::service`) — kicks, completions, the
//! dirty log, the driver's interrupt — until told to stop.
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
use std::thread::JoinHandle;
use std::time::Instant;

use memvisor::SharedLog;

use crate::backend::service::{self, Rings, Step};
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

/// The ring a worker holds, for the ring service.
struct One {
    index: u16,
    ring: Ring,
    log: Option<Arc<SharedLog>>,
    memory: Arc<FrontendMemory>,
    live: BackendLive,
    call: Option<File>,
}

impl Rings for One {
    fn ring(&mut self, index: u16) -> Option<&mut Ring> {
        (index == self.index).then_some(&mut self.ring)
    }

    /// What the ring's requests wrote goes into the frontend's log, counted on the ring's row.
    fn log(&mut self) {
        if let Some(log) = &self.log {
            let stats = self.live.ring(usize::from(self.index));
            let t0 = Instant::now();
            match self.memory.drain_dirty(log) {
                Ok(pages) => stats.logged_pages.add(pages),
                Err(e) => log::error!("ring {}: dirty log: {e}", self.index),
            }
            stats.log_ns.add(t0.elapsed().as_nanos() as u64);
            stats.log_drains.add(1);
        }
    }

    fn notify(&mut self, _: u16) {
        signal(&mut self.call);
    }
}

/// The worker's loop.
fn serve<D: Device>(lent: Lent<D>, stop: File) -> Returned<D> {
    let Lent {
        index,
        ring,
        mut device,
        memory,
        log,
        live,
        mut kick,
        call,
        mut err,
    } = lent;
    let mut one = One {
        index,
        ring,
        log,
        memory: memory.clone(),
        live: live.clone(),
        call,
    };
    let stats = live.ring(usize::from(index));
    let mut broken = false;
    let mut window = device.poll().map(service::PollWindow::new);
    let mut spin_after_work = false;
    loop {
        if let (Some(w), true) = (window.as_mut(), std::mem::take(&mut spin_after_work)) {
            let spun = service::spin(w, stop.as_raw_fd(), |step| match step {
                Step::Round => {
                    let ended = service::complete(&mut device, &mut one, &memory, false);
                    if !service::has_requests(&one.ring, &memory) {
                        return Ok(ended);
                    }
                    stats.poll_hits.add(1);
                    process(&mut device, &mut one, &memory, stats, &mut err)?;
                    Ok(true)
                }
                Step::Quiet => {
                    one.ring.start_polling(&memory.dma().memory());
                    Ok(false)
                }
                Step::Rearm => Ok(one.ring.stop_polling(&memory.dma().memory())),
            });
            if spun.is_err() {
                broken = true;
                break;
            }
        }
        let done = device.completion_fd().unwrap_or(-1);
        let mut fds = [stop.as_raw_fd(), kick.as_raw_fd(), done].map(|fd| libc::pollfd {
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
        // Whether this wake-up brought work (a kick may be one the driver sent for a request
        // the poll already served): only then does the window follow it and the poll start.
        let mut work = false;
        if fds[2].revents & libc::POLLIN != 0 {
            work |= service::complete(&mut device, &mut one, &memory, false);
            // Chains left on the ring while the device had as many out as it keeps: the
            // driver made them available long ago and will not kick for them again.
            if service::has_requests(&one.ring, &memory) {
                work = true;
                if process(&mut device, &mut one, &memory, stats, &mut err).is_err() {
                    broken = true;
                    break;
                }
            }
        }
        if fds[1].revents & libc::POLLIN != 0 {
            let mut b = [0u8; 8];
            let _ = kick.read(&mut b);
            stats.kicks.add(1);
            stats.worker_kicks.add(1);
            work |= service::has_requests(&one.ring, &memory);
            if process(&mut device, &mut one, &memory, stats, &mut err).is_err() {
                broken = true;
                break;
            }
        }
        if let (Some(w), true) = (window.as_mut(), work) {
            w.woke_to_work();
            spin_after_work = true;
        }
    }
    service::complete(&mut device, &mut one, &memory, true);
    Returned {
        index,
        ring: one.ring,
        device,
        broken,
    }
}

/// Serves what the driver made available, going round again while the service says so
/// ([`service::pass`]); an error means the ring broke (told on `err`).
fn process<D: Device>(
    device: &mut D,
    one: &mut One,
    memory: &FrontendMemory,
    stats: &RingCounters,
    err: &mut Option<File>,
) -> Result<()> {
    loop {
        match service::pass(device, one, one.index, memory, stats) {
            Ok(pass) => {
                if let Processed::Missed { misses } = &pass.processed {
                    // Never lent behind a vIOMMU (see the top); a device that says so anyway
                    // has its request wait for the next kick.
                    log::warn!(
                        "{}: ring {}: {} IOTLB misses on a worker",
                        device.name(),
                        one.index,
                        misses.len()
                    );
                    one.notify(one.index);
                }
                if !pass.again {
                    return Ok(());
                }
            }
            Err(e) => {
                log::warn!("{}: ring {} stopped: {e}", device.name(), one.index);
                one.notify(one.index);
                signal(err);
                return Err(e);
            }
        }
    }
}

fn signal(f: &mut Option<File>) {
    if let Some(f) = f {
        let _ = f.write(&1u64.to_le_bytes());
    }
}
