//! Live counters: what a back end, its rings and its device have done, readable from any thread
//! while they run — a control socket's `query-stats`, a report on SIGUSR1, the report at exit.
//!
//! **Model.** Every count is a [`Counter`]: an atomic that one thread at a time adds to with a
//! plain load and store (no locked instruction on the data path) and that any thread reads. One
//! writer at a time holds because every block of counters belongs to one serving thread at a
//! time: the back end's protocol counts ([`BackendLive`]'s own) to the back end's thread, a
//! ring's counts (a [`QueueStats`] row, and a device's per-queue counts such as
//! [`crate::BlkLive`]'s) to the thread serving that ring — the back end's, or the worker it is
//! lent to. A ring changes hands only when a worker thread starts or is joined, and both order
//! the memory writes before and after them. Were two threads ever to add to one counter at
//! once, counts could be lost; nothing unsafe can happen.
//!
//! A reader gets each counter's latest value. Counters read one after another are not one
//! atomic snapshot: a request may already be in `kicks` and not yet in `process_ns`. Totals
//! ([`BackendLive::stats`]) are sums of the rows at the moment each was read.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// A count with one writer at a time (see the module documentation) and any number of readers.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Adds `n`. Only the thread that owns this counter's block may call it.
    #[inline]
    pub fn add(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_add(n), Relaxed);
    }

    /// Takes `n` away (a level that goes up and down, such as pages pinned now). Same rule as
    /// [`Counter::add`].
    #[inline]
    pub fn sub(&self, n: u64) {
        self.0.store(self.0.load(Relaxed).wrapping_sub(n), Relaxed);
    }

    /// Raises the value to `n` if it is lower (a high-water mark). Same rule as [`Counter::add`].
    #[inline]
    pub fn raise(&self, n: u64) {
        if n > self.0.load(Relaxed) {
            self.0.store(n, Relaxed);
        }
    }

    /// The value now.
    #[inline]
    pub fn get(&self) -> u64 {
        self.0.load(Relaxed)
    }
}

/// Counts of what a back end saw (serialized as they are named here, e.g. in `--stats`): the
/// protocol's, and the sums of its rings'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BackendStats {
    /// Connections served.
    pub connections: u64,
    /// Messages handled.
    pub messages: u64,
    /// Messages refused (state left as it was).
    pub refused: u64,
    /// Kicks processed.
    pub kicks: u64,
    /// Pages written to the frontend's dirty log.
    pub logged_pages: u64,
    /// IOTLB updates applied.
    pub iotlb_updates: u64,
    /// IOTLB invalidations applied.
    pub iotlb_invalidates: u64,
    /// IOTLB misses sent.
    pub iotlb_misses: u64,
    /// Times a ring was lent to a worker thread of its own.
    pub lent: u64,
    /// Kicks served on worker threads (counted in `kicks` too).
    pub worker_kicks: u64,
    /// Times polling found a ring with new requests, served with no kick
    /// ([`crate::Device::poll`]).
    pub poll_hits: u64,
    /// Nanoseconds spent in the device's queue processing (requests, including their I/O).
    pub process_ns: u64,
    /// Nanoseconds spent moving dirty pages into the frontend's log.
    pub log_ns: u64,
    /// How many times dirty pages were moved into the frontend's log.
    pub log_drains: u64,
    /// Nanoseconds spent applying IOTLB updates and invalidations (not the requests they let
    /// go on).
    pub iotlb_ns: u64,
}

/// One ring's row of [`BackendLive`]: what was served on it, wherever it was served.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueStats {
    /// The ring's index.
    pub index: u16,
    /// Whether the ring runs now (started, and enabled if the frontend enables rings).
    pub running: bool,
    /// Whether it is lent to a worker thread now.
    pub on_worker: bool,
    /// Kicks served.
    pub kicks: u64,
    /// Of those, the kicks served on a worker.
    pub worker_kicks: u64,
    /// Times polling found new requests on it without a kick.
    pub poll_hits: u64,
    /// Nanoseconds in the device's processing of this ring.
    pub process_ns: u64,
    /// Times it was lent to a worker.
    pub lent: u64,
    /// Dirty-log drains its worker made (a ring served on the back end's thread is drained
    /// with the others there: those count in the back end's totals only).
    pub log_drains: u64,
    /// Pages those drains logged.
    pub logged_pages: u64,
    /// Nanoseconds those drains took.
    pub log_ns: u64,
}

/// The protocol's counts: the back end's thread alone writes them.
#[derive(Debug, Default)]
pub(crate) struct ProtocolCounters {
    pub connections: Counter,
    pub messages: Counter,
    pub refused: Counter,
    pub iotlb_updates: Counter,
    pub iotlb_invalidates: Counter,
    pub iotlb_misses: Counter,
    pub iotlb_ns: Counter,
    /// Log drains on the back end's thread.
    pub log_drains: Counter,
    pub logged_pages: Counter,
    pub log_ns: Counter,
}

/// One ring's counts: the thread serving the ring writes them.
#[derive(Debug, Default)]
pub(crate) struct RingCounters {
    pub running: AtomicBool,
    pub on_worker: AtomicBool,
    pub kicks: Counter,
    pub worker_kicks: Counter,
    pub poll_hits: Counter,
    pub process_ns: Counter,
    pub lent: Counter,
    pub log_drains: Counter,
    pub logged_pages: Counter,
    pub log_ns: Counter,
}

#[derive(Debug, Default)]
pub(crate) struct Shared {
    pub protocol: ProtocolCounters,
    pub rings: Box<[RingCounters]>,
    pub connected: AtomicBool,
    /// The frontend opened the back-end channel and negotiated `CONFIG`: it hears
    /// `CONFIG_CHANGE_MSG`.
    pub config_channel: AtomicBool,
}

/// A back end's counters, shared with any thread that wants to read them while it serves
/// ([`crate::Backend::live`]). Cloning shares them.
#[derive(Clone, Debug)]
pub struct BackendLive(pub(crate) Arc<Shared>);

impl BackendLive {
    pub(crate) fn new(rings: usize) -> BackendLive {
        BackendLive(Arc::new(Shared {
            protocol: ProtocolCounters::default(),
            rings: (0..rings).map(|_| RingCounters::default()).collect(),
            connected: AtomicBool::new(false),
            config_channel: AtomicBool::new(false),
        }))
    }

    /// Ring `i`'s counters (the last ring's for an index past the end: the back end never asks
    /// for one).
    pub(crate) fn ring(&self, i: usize) -> &RingCounters {
        let rings = &self.0.rings;
        &rings[i.min(rings.len().saturating_sub(1))]
    }

    pub(crate) fn protocol(&self) -> &ProtocolCounters {
        &self.0.protocol
    }

    pub(crate) fn set_connected(&self, on: bool) {
        self.0.connected.store(on, Relaxed);
    }

    pub(crate) fn set_config_channel(&self, on: bool) {
        self.0.config_channel.store(on, Relaxed);
    }

    /// Whether the connected frontend hears config changes (it opened the back-end channel
    /// and negotiated `VHOST_USER_PROTOCOL_F_CONFIG`).
    pub fn hears_config_changes(&self) -> bool {
        self.0.config_channel.load(Relaxed)
    }

    /// Whether a frontend is connected now.
    pub fn connected(&self) -> bool {
        self.0.connected.load(Relaxed)
    }

    /// Each ring's row now.
    pub fn queues(&self) -> Vec<QueueStats> {
        self.0
            .rings
            .iter()
            .enumerate()
            .map(|(i, r)| QueueStats {
                index: i as u16,
                running: r.running.load(Relaxed),
                on_worker: r.on_worker.load(Relaxed),
                kicks: r.kicks.get(),
                worker_kicks: r.worker_kicks.get(),
                poll_hits: r.poll_hits.get(),
                process_ns: r.process_ns.get(),
                lent: r.lent.get(),
                log_drains: r.log_drains.get(),
                logged_pages: r.logged_pages.get(),
                log_ns: r.log_ns.get(),
            })
            .collect()
    }

    /// The totals now: the protocol's counts and the sums of the rings'.
    pub fn stats(&self) -> BackendStats {
        let p = &self.0.protocol;
        let mut s = BackendStats {
            connections: p.connections.get(),
            messages: p.messages.get(),
            refused: p.refused.get(),
            iotlb_updates: p.iotlb_updates.get(),
            iotlb_invalidates: p.iotlb_invalidates.get(),
            iotlb_misses: p.iotlb_misses.get(),
            iotlb_ns: p.iotlb_ns.get(),
            log_drains: p.log_drains.get(),
            logged_pages: p.logged_pages.get(),
            log_ns: p.log_ns.get(),
            ..BackendStats::default()
        };
        for q in self.queues() {
            s.kicks += q.kicks;
            s.worker_kicks += q.worker_kicks;
            s.poll_hits += q.poll_hits;
            s.process_ns += q.process_ns;
            s.lent += q.lent;
            s.log_drains += q.log_drains;
            s.logged_pages += q.logged_pages;
            s.log_ns += q.log_ns;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_are_the_protocol_counts_plus_every_rings() {
        let live = BackendLive::new(3);
        live.protocol().messages.add(7);
        live.protocol().log_drains.add(2);
        live.ring(0).kicks.add(5);
        live.ring(2).kicks.add(4);
        live.ring(2).worker_kicks.add(4);
        live.ring(2).log_drains.add(3);
        // An index past the end lands on the last ring, never out of bounds.
        live.ring(9).poll_hits.add(1);
        let s = live.stats();
        assert_eq!(
            (
                s.messages,
                s.kicks,
                s.worker_kicks,
                s.log_drains,
                s.poll_hits
            ),
            (7, 9, 4, 5, 1)
        );
        let q = live.queues();
        assert_eq!(q.iter().map(|q| q.kicks).collect::<Vec<_>>(), vec![5, 0, 4]);
        assert_eq!(q[2].poll_hits, 1);
    }

    #[test]
    fn a_counter_read_on_another_thread_sees_what_its_writer_added() {
        let live = BackendLive::new(1);
        let writer = live.clone();
        std::thread::spawn(move || {
            for _ in 0..1000 {
                writer.ring(0).kicks.add(1);
            }
            writer.ring(0).process_ns.raise(50);
            writer.ring(0).process_ns.raise(20);
        })
        .join()
        .unwrap();
        assert_eq!(live.stats().kicks, 1000);
        assert_eq!(live.queues()[0].process_ns, 50);
    }
}
