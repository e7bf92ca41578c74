//! The ring service: what serving a ring is, the same on the back end's own thread and on a
//! ring worker's ([`crate::worker`]).
//!
//! **Model.** Whoever serves rings holds them behind [`Rings`]: the back end's thread every ring
//! not lent out, a worker its one ring. A *pass* over a ring ([`pass`]) has the device process
//! it, then ends what the device finished meanwhile ([`Device::complete`]: transfers the kernel
//! finished at once): each finished chain goes back on its used ring — one ring at a time, in
//! one batch ([`Ring::return_batch`]: one store of the used index when the ring keeps no
//! inflight log), so each ring is asked once whether its driver wants an interrupt (event
//! indexes) — what the
//! requests wrote goes into the frontend's dirty log in one drain, and only then are the
//! drivers interrupted. A device keeps a bounded number of requests in flight and leaves the
//! rest on the ring; a pass that ended transfers (whose completions, read here, will wake
//! nobody) while the ring still holds requests says to go round again ([`Pass::again`]).
//! [`complete`] is the same ending on its own, when the device's completion descriptor fires or
//! before a message (with `wait`). [`spin`] looks at the rings again and again for a while
//! after work, so a busy device serves requests without waiting for the next kick.
//!
//! **Polling adapts.** How long [`spin`] looks is a window ([`PollWindow`]) between 0 and the
//! device's `poll-us` ([`Device::poll`]), changed at each wake-up from sleep by how long the
//! thread waited for its work since it last had some ([`next_window`], a pure function): a
//! wait the window covered keeps it; a longer one the maximum would have covered grows it
//! (doubling, from [`GROW_FROM`]); a wait longer than the maximum, which no allowed window would
//! have caught, drops it to 0, so a queue that goes idle gives its core back and a busy one
//! earns its window again within a few requests. This is the model of QEMU's adaptive event
//! loop polling (`poll-max-ns`, `poll-grow`, `poll-shrink` in iothread.c, applied by
//! `adjust_polling_time` in util/aio-posix.c, with `poll-shrink` at its default: back to 0);
//! the design is credited, none of its code taken. While it spins, the thread keeps its rings'
//! notifications off ([`Ring::start_polling`]: the driver need not kick for what is looked at
//! anyway) and looks at its stop descriptor only every [`STOP_EVERY`], not with a system call
//! per round; before it sleeps it turns them on again and looks at each ring once more
//! ([`Ring::stop_polling`]), so a request made available while notifications were off is
//! served, not left waiting for a kick that will not come.
//!
//! What differs between the two callers stays with them: the back end's thread also handles
//! IOTLB misses (a worker is never lent a ring behind a vIOMMU) and stops a broken ring itself;
//! a worker tells the frontend through the ring's error descriptor and hands the ring back.

use std::cell::Cell;
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
/// `index`'s when the device says so), and last the device does what must not delay a reply
/// ([`Device::after_replies`]). An error means the ring is broken: the caller stops it.
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
    // The pass's one clock read before its requests: the device may start them from it.
    device.pass_began(t0);
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
    if r.as_ref().is_ok_and(|p| *p == Processed::served(true)) && !ended.tell.contains(&index) {
        rings.notify(index);
    }
    // Every reply of the pass is out: what would have delayed one comes now.
    device.after_replies();
    let processed = r?;
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

/// The smallest window polling grows to from 0 (QEMU starts at 4 µs too).
pub(crate) const GROW_FROM: Duration = Duration::from_micros(4);
/// How often a spinning thread looks at its stop descriptor (a `poll(2)` each time).
pub(crate) const STOP_EVERY: Duration = Duration::from_micros(5);

/// The polling window after a wake-up: the thread had polled for `window` (of at most `max`)
/// and its next work came `waited` after its last. Pure: the caller measures.
pub(crate) fn next_window(window: Duration, max: Duration, waited: Duration) -> Duration {
    if waited <= window {
        // Polling would have caught it (or did): it is the right size.
        window
    } else if waited > max {
        // No allowed window would have caught it: stop polling until work comes close again.
        Duration::ZERO
    } else {
        // A longer window, still within the maximum, would have caught it.
        window.saturating_mul(2).max(GROW_FROM).min(max)
    }
}

/// A serving thread's polling window: how long it spins after work before it sleeps.
#[derive(Debug)]
pub(crate) struct PollWindow {
    window: Duration,
    max: Duration,
    /// When the thread last had work (requests found or transfers ended).
    last_work: Instant,
}

impl PollWindow {
    /// A window of at most `max`, starting at `max` (the device asked to poll: it does until
    /// a long wait says otherwise).
    pub(crate) fn new(max: Duration) -> PollWindow {
        PollWindow {
            window: max,
            max,
            last_work: Instant::now(),
        }
    }

    /// The window now.
    pub(crate) fn window(&self) -> Duration {
        self.window
    }

    /// The maximum (the device's `poll-us`).
    pub(crate) fn max(&self) -> Duration {
        self.max
    }

    /// The thread woke from sleep and found work: the window follows how long it waited.
    pub(crate) fn woke_to_work(&mut self) {
        let now = Instant::now();
        self.window = next_window(self.window, self.max, now - self.last_work);
        self.last_work = now;
    }

    /// The thread had work (without sleeping first).
    pub(crate) fn worked(&mut self) {
        self.last_work = Instant::now();
    }
}

/// What [`spin`] asks of its caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Serve the rings with requests and end finished transfers; say whether there was any.
    Round,
    /// Notifications off on every ring served ([`Ring::start_polling`]).
    Quiet,
    /// Notifications on again, one more look at every ring ([`Ring::stop_polling`]); say
    /// whether one holds requests.
    Rearm,
}

/// After work: runs `step(Round)` again and again until the window passed since the last
/// round that found work, or `stop` (a descriptor: the connection, a worker's stop) becomes
/// readable. Notifications stay off meanwhile and are on again, with one more look at the
/// rings, before it returns ([`Step`]); a ring that then holds requests is served (with
/// notifications on, so the device re-arms as it empties it) and, unless stopped, the spin
/// goes on. With a window of 0 it returns at once. Records the last work in `window`.
pub(crate) fn spin(
    window: &mut PollWindow,
    stop: RawFd,
    mut step: impl FnMut(Step) -> Result<bool>,
) -> Result<()> {
    let span = window.window();
    if span.is_zero() {
        return Ok(());
    }
    step(Step::Quiet)?;
    let r = spin_quiet(window, span, stop, &mut step);
    if r.is_err() {
        // A ring broke: the others get their notifications back all the same.
        let _ = step(Step::Rearm);
    }
    r
}

fn spin_quiet(
    window: &mut PollWindow,
    span: Duration,
    stop: RawFd,
    step: &mut impl FnMut(Step) -> Result<bool>,
) -> Result<()> {
    let mut last = Instant::now();
    let mut looked = last;
    loop {
        let found = step(Step::Round)?;
        let now = Instant::now();
        if found {
            last = now;
            window.worked();
        }
        let stopped = now - looked >= STOP_EVERY && {
            looked = now;
            readable(stop)
        };
        if stopped || now - last >= span {
            if !step(Step::Rearm)? {
                return Ok(());
            }
            // Requests came while notifications were off: serve them now.
            window.worked();
            if stopped {
                step(Step::Round)?;
                return Ok(());
            }
            step(Step::Quiet)?;
            last = Instant::now();
            continue;
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

thread_local! {
    /// The chains a device ended and the rings to interrupt, kept between passes on this
    /// thread: ending requests allocates nothing once they have grown.
    static USED: Cell<Vec<Used>> = const { Cell::new(Vec::new()) };
    static TELL: Cell<Vec<u16>> = const { Cell::new(Vec::new()) };
}

impl Drop for Ended {
    fn drop(&mut self) {
        let mut tell = std::mem::take(&mut self.tell);
        tell.clear();
        let _ = TELL.try_with(|t| t.set(tell));
    }
}

/// Takes what the device finished and puts each chain back on its ring, one ring at a time.
fn finish<D: Device, R: Rings>(
    device: &mut D,
    rings: &mut R,
    memory: &FrontendMemory,
    wait: bool,
) -> Ended {
    let mut used = USED.take();
    if let Err(e) = device.complete_into(memory, wait, &mut used) {
        log::error!("{}: ending requests: {e}", device.name());
        used.clear();
    }
    let any = !used.is_empty();
    // Stable: each ring's chains stay in the order they ended (a stable sort allocates: not
    // for chains of one ring, already in order).
    if !used.is_sorted_by_key(|u| u.ring) {
        used.sort_by_key(|u| u.ring);
    }
    let mem = memory.dma().memory();
    let mut tell = TELL.take();
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
        let name = device.name();
        let failed = |head: u16, e: virtio_queue::Error| {
            log::warn!("{name}: queue {index}: cannot return head {head}: {e}");
        };
        // TEST ONLY: with `reorder` (the device ended them last first), a pause between
        // each chain put back, so a back end killed there leaves later requests answered
        // and earlier ones not: what only the inflight log can mend.
        #[cfg(feature = "test-hooks")]
        if memory.faults().reorder {
            for u in chunk {
                if !std::ptr::eq(u, &chunk[0]) {
                    std::thread::sleep(memvisor::faults::REORDER_GAP);
                }
                ring.return_batch(&mem, [(u.head, u.len)], failed);
            }
            if ring.needs_notification(&mem).unwrap_or(true) {
                tell.push(index);
            }
            continue;
        }
        // The pass's chains for this ring go back together: one store of the used index
        // (without an inflight log), then one question whether to interrupt.
        ring.return_batch(&mem, chunk.iter().map(|u| (u.head, u.len)), failed);
        if ring.needs_notification(&mem).unwrap_or(true) {
            tell.push(index);
        }
    }
    used.clear();
    USED.set(used);
    Ended { any, tell }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(32);

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn a_wait_the_window_covered_keeps_it() {
        assert_eq!(next_window(us(16), MAX, us(3)), us(16));
        assert_eq!(next_window(us(16), MAX, us(16)), us(16));
        assert_eq!(next_window(MAX, MAX, MAX), MAX);
    }

    #[test]
    fn a_wait_the_maximum_would_cover_grows_it_up_to_the_maximum() {
        assert_eq!(next_window(Duration::ZERO, MAX, us(1)), GROW_FROM);
        assert_eq!(next_window(GROW_FROM, MAX, us(5)), GROW_FROM * 2);
        assert_eq!(next_window(us(20), MAX, us(25)), MAX);
        // A maximum below the first step: the maximum.
        assert_eq!(next_window(Duration::ZERO, us(2), us(2)), us(2));
    }

    #[test]
    fn a_wait_past_the_maximum_stops_polling() {
        assert_eq!(next_window(MAX, MAX, us(33)), Duration::ZERO);
        assert_eq!(
            next_window(us(8), MAX, Duration::from_secs(10)),
            Duration::ZERO
        );
        assert_eq!(
            next_window(Duration::ZERO, MAX, Duration::from_secs(1)),
            Duration::ZERO
        );
    }

    #[test]
    fn a_queue_that_goes_quiet_gives_its_core_back_and_a_busy_one_earns_its_window_again() {
        // Busy (work every 10 µs): the window stays at the maximum. One long pause: 0. Work
        // again every 10 µs: 4, 8, 16 (covers 10 µs): kept.
        let mut w = MAX;
        let mut seen = Vec::new();
        for waited in [10, 10, 5000, 10, 10, 10, 10, 10] {
            w = next_window(w, MAX, us(waited));
            seen.push(w.as_micros());
        }
        assert_eq!(seen, [32, 32, 0, 4, 8, 16, 16, 16]);
    }

    fn eventfd() -> std::fs::File {
        use std::os::fd::FromRawFd;
        // SAFETY: plain flags; the result is checked and then owned by the File.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor owned by nothing else.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }

    #[test]
    fn a_spin_keeps_notifications_off_and_ends_with_them_on_and_one_more_look() {
        use std::os::fd::AsRawFd;
        let stop = eventfd();
        let mut w = PollWindow::new(Duration::from_millis(2));
        let mut steps = Vec::new();
        // The last look finds a request once: served, and the spin goes on.
        let mut late = 1;
        let t0 = Instant::now();
        spin(&mut w, stop.as_raw_fd(), |s| {
            steps.push(s);
            Ok(match s {
                Step::Rearm => {
                    late -= 1;
                    late == 0
                }
                _ => false,
            })
        })
        .unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(4), "two windows");
        assert_eq!(steps.first(), Some(&Step::Quiet));
        assert_eq!(steps.last(), Some(&Step::Rearm));
        let rearms: Vec<usize> = (0..steps.len())
            .filter(|&i| steps[i] == Step::Rearm)
            .collect();
        assert_eq!(rearms.len(), 2);
        // After the late find: notifications off again, then rounds.
        assert_eq!(steps[rearms[0] + 1], Step::Quiet);
        assert_eq!(steps[rearms[0] + 2], Step::Round);
        // Nothing found, nothing stopped: no system call per round (the stop is looked at
        // every STOP_EVERY), so rounds are many.
        assert!(steps.len() > 100, "{} steps", steps.len());
    }

    #[test]
    fn a_spin_ends_soon_after_its_stop_and_with_notifications_on() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let mut stop = eventfd();
        stop.write_all(&1u64.to_le_bytes()).unwrap();
        let mut w = PollWindow::new(Duration::from_secs(30));
        let mut last = None;
        let t0 = Instant::now();
        spin(&mut w, stop.as_raw_fd(), |s| {
            last = Some(s);
            // Work every round: only the stop ends it.
            Ok(s == Step::Round)
        })
        .unwrap();
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(last, Some(Step::Rearm));
    }

    #[test]
    fn a_window_of_zero_does_not_spin() {
        let mut w = PollWindow::new(Duration::ZERO);
        let mut steps = 0;
        spin(&mut w, -1, |_| {
            steps += 1;
            Ok(true)
        })
        .unwrap();
        assert_eq!(steps, 0);
    }
}
