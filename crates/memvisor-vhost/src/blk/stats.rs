//! What a blk device counts: requests by kind, bytes, failures by cause, batches, and the
//! pinned-page histogram of its reads and writes (the distribution a real guest produces).
//!
//! The counts are kept per queue, live ([`crate::live`]): a [`BlkLive`] holds one block of
//! counters per queue, shared by the device and the copies of it that serve a queue on a worker
//! thread; the thread serving a queue is the only one adding to its block. [`BlkStats`] is what
//! a block, or the sum of all of them, says at one moment.
//!
//! **Latency.** Each block also keeps a latency histogram per operation (read, write, flush):
//! fixed log-scale buckets, bucket `i` counting requests that took at most `2^(10+i)` ns (1 µs
//! to 8.6 s, [`LATENCY_BOUNDS_NS`]) and one more for longer, with their count and total time.
//! Recording is two plain relaxed stores by the queue's own thread (no atomic read-modify-write,
//! no lock), and a read or write reads no clock of its own for it: it is timed from the start
//! of the pass that took it off its ring (the serving loop reads the clock once a pass and hands
//! it to the device, `Device::pass_began`) to when the device ended it, together with the
//! others that ended with it (one clock read for them all, after their pages were let go, just
//! before their chains go back). So it counts the walk of its buffers and the requests taken
//! before it in the same pass, as a driver would see them, and not the time it waited on the
//! ring before the pass (until issue 48 it ran from its buffers being held to its own end, two
//! clock reads a request). A flush
//! is its `fdatasync`, timed on its own. Time a request waited on the ring for the throttle is
//! not in it ([`super::throttle`]).

use std::sync::Arc;

use super::throttle::Throttle;
use crate::live::Counter;

/// Buckets of the pinned-page histogram: up to 2^23 pages (32 GiB) in one request.
const BUCKETS: usize = 24;

/// Latency buckets with an upper bound: `2^10` ns (1 µs) to `2^33` ns (8.6 s).
const LATENCY_BOUNDED: usize = 24;
/// The smallest bound is `2^LATENCY_SHIFT` ns.
const LATENCY_SHIFT: u32 = 10;

/// The latency histograms' upper bounds, in nanoseconds (a last bucket counts what is longer).
pub const LATENCY_BOUNDS_NS: [u64; LATENCY_BOUNDED] = {
    let mut b = [0u64; LATENCY_BOUNDED];
    let mut i = 0;
    while i < LATENCY_BOUNDED {
        b[i] = 1 << (LATENCY_SHIFT as usize + i);
        i += 1;
    }
    b
};

/// What a latency histogram tells about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Reads (`IN`).
    Read = 0,
    /// Writes (`OUT`).
    Write = 1,
    /// Flushes.
    Flush = 2,
}

/// One operation's latency histogram at one moment (serialized under these names).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Histogram {
    /// Upper bounds of the buckets ([`LATENCY_BOUNDS_NS`]).
    pub bounds_ns: Vec<u64>,
    /// Requests per bucket (not cumulative); one more entry than `bounds_ns`: longer ones.
    pub counts: Vec<u64>,
    /// Requests timed.
    pub count: u64,
    /// Their total time.
    pub sum_ns: u64,
}

/// One queue's latency histograms.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueLatency {
    /// The queue's index.
    pub queue: u16,
    /// Its reads.
    pub read: Histogram,
    /// Its writes.
    pub write: Histogram,
    /// Its flushes.
    pub flush: Histogram,
}

/// One operation's live latency counters.
#[derive(Debug, Default)]
struct Latency {
    counts: [Counter; LATENCY_BOUNDED + 1],
    sum_ns: Counter,
}

impl Latency {
    fn snapshot(&self) -> Histogram {
        let counts: Vec<u64> = self.counts.iter().map(Counter::get).collect();
        Histogram {
            bounds_ns: LATENCY_BOUNDS_NS.to_vec(),
            count: counts.iter().sum(),
            counts,
            sum_ns: self.sum_ns.get(),
        }
    }
}

/// The bucket a request of `ns` nanoseconds falls in.
#[inline]
fn latency_bucket(ns: u64) -> usize {
    // ceil(log2(ns)): the smallest k with ns <= 2^k.
    let k = 64 - ns.max(1).wrapping_sub(1).leading_zeros();
    (k.saturating_sub(LATENCY_SHIFT) as usize).min(LATENCY_BOUNDED)
}

/// What the device has done (serialized under these names; the histogram as
/// `[[pages up to, requests], ...]` for the buckets with requests).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BlkStats {
    /// Read requests completed.
    pub reads: u64,
    /// Write requests completed.
    pub writes: u64,
    /// Flushes.
    pub flushes: u64,
    /// Bytes read from the image into guest memory.
    pub bytes_read: u64,
    /// Bytes written from guest memory to the image.
    pub bytes_written: u64,
    /// Requests answered IOERR or UNSUPP.
    pub failed: u64,
    /// Of those, reads and writes whose system call on the image failed (EIO, ENOSPC).
    pub io_errors: u64,
    /// Of those, reads and writes whose guest pages could not be held (a buffer that left
    /// guest memory meanwhile; never a host limit: holds lock nothing).
    pub pin_errors: u64,
    /// Chains read through an indirect descriptor table (named by their head, or by the
    /// descriptor that ends their direct part).
    pub indirect: u64,
    /// Transfers copied through a buffer of the back end's own: the image is `O_DIRECT` and
    /// the guest's buffers were not aligned as it needs, or a write of sector 0 checked with
    /// `guard_first_sector` (checked in the copy that is written).
    pub bounced: u64,
    /// Discard requests carried out.
    pub discards: u64,
    /// Write-zeroes requests carried out.
    pub write_zeroes: u64,
    /// Batches of reads and writes handed to the kernel together (one io_uring submission
    /// each).
    pub batches: u64,
    /// The most reads and writes the kernel had from this device at once.
    pub most_in_flight: u64,
    /// Guest pages held now for reads and writes in flight (0 whenever the device is idle).
    pub pinned_pages: u64,
    /// The most guest pages held at once for reads and writes in flight (holds lock nothing:
    /// this may be far past `RLIMIT_MEMLOCK`).
    pub most_pinned_pages: u64,
    /// Reads and writes whose buffers were held (one walk of the device space each,
    /// [`memvisor::DmaSpace::hold_sg`]).
    pub holds: u64,
    /// Nanoseconds spent walking and holding those requests' buffers.
    pub hold_ns: u64,
    /// Nanoseconds spent letting them go (the guards of the transfers that end together are let
    /// go together, and timed so).
    pub release_ns: u64,
    /// Reads and writes that went out as io_uring fixed transfers through a registered chunk
    /// of guest memory (`fixed_buffers`).
    pub fixed: u64,
    /// With `fixed_buffers`, reads and writes that went the ordinary way because the host
    /// refused registration (RLIMIT_MEMLOCK, ENOMEM, EFAULT, EOPNOTSUPP, EPERM, an old kernel).
    pub fixed_fallbacks: u64,
    /// With `fixed_buffers`, reads and writes that went the ordinary way for another reason:
    /// their chunk not registered yet (cold, or evicted and waiting), buffers over two chunks,
    /// memory that is not registered (private anonymous), dirty logging on.
    pub fixed_ordinary: u64,
    /// 2 MiB chunks of guest memory registered with the io_uring (each pinned while it stays).
    pub chunks_registered: u64,
    /// Nanoseconds spent registering them.
    pub register_ns: u64,
    /// Registered chunks given up before a discard (the balloon, free page reporting).
    pub evictions: u64,
    /// Chunks a discard found with a transfer in flight (or not given up in time): kept.
    pub evict_busy: u64,
    /// Pinned 4 KiB pages per read/write request: entry `i` counts requests of `2^(i-1) < n <=
    /// 2^i` pages (entry 0: one page).
    #[serde(serialize_with = "histogram_pairs")]
    pub npage_histogram: Vec<u64>,
}

impl BlkStats {
    /// Adds another queue's counts.
    pub fn add(&mut self, o: &BlkStats) {
        // Every field named: a new one does not compile until it is added up here too.
        let BlkStats {
            reads,
            writes,
            flushes,
            bytes_read,
            bytes_written,
            failed,
            io_errors,
            pin_errors,
            indirect,
            bounced,
            discards,
            write_zeroes,
            batches,
            most_in_flight,
            pinned_pages,
            most_pinned_pages,
            holds,
            hold_ns,
            release_ns,
            fixed,
            fixed_fallbacks,
            fixed_ordinary,
            chunks_registered,
            register_ns,
            evictions,
            evict_busy,
            npage_histogram,
        } = o;
        self.holds += holds;
        self.hold_ns += hold_ns;
        self.release_ns += release_ns;
        self.fixed += fixed;
        self.fixed_fallbacks += fixed_fallbacks;
        self.fixed_ordinary += fixed_ordinary;
        self.chunks_registered += chunks_registered;
        self.register_ns += register_ns;
        self.evictions += evictions;
        self.evict_busy += evict_busy;
        self.reads += reads;
        self.writes += writes;
        self.flushes += flushes;
        self.bytes_read += bytes_read;
        self.bytes_written += bytes_written;
        self.failed += failed;
        self.io_errors += io_errors;
        self.pin_errors += pin_errors;
        self.indirect += indirect;
        self.bounced += bounced;
        self.discards += discards;
        self.write_zeroes += write_zeroes;
        self.batches += batches;
        self.most_in_flight = self.most_in_flight.max(*most_in_flight);
        self.pinned_pages += pinned_pages;
        // Queues peak at different moments: the highest is a lower bound of the device's.
        self.most_pinned_pages = self.most_pinned_pages.max(*most_pinned_pages);
        if self.npage_histogram.len() < npage_histogram.len() {
            self.npage_histogram.resize(npage_histogram.len(), 0);
        }
        for (a, b) in self.npage_histogram.iter_mut().zip(npage_histogram) {
            *a += b;
        }
    }
}

fn histogram_pairs<S: serde::Serializer>(h: &[u64], s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeSeq;
    let mut seq = s.serialize_seq(None)?;
    for (i, n) in h.iter().enumerate().filter(|(_, n)| **n > 0) {
        seq.serialize_element(&(1u64 << i, *n))?;
    }
    seq.end()
}

/// One queue's counters.
#[derive(Debug, Default)]
pub(super) struct BlkCounters {
    pub reads: Counter,
    pub writes: Counter,
    pub flushes: Counter,
    pub bytes_read: Counter,
    pub bytes_written: Counter,
    pub failed: Counter,
    pub io_errors: Counter,
    pub pin_errors: Counter,
    pub indirect: Counter,
    pub bounced: Counter,
    pub discards: Counter,
    pub write_zeroes: Counter,
    pub batches: Counter,
    pub most_in_flight: Counter,
    pub pinned_pages: Counter,
    pub most_pinned_pages: Counter,
    pub holds: Counter,
    pub hold_ns: Counter,
    pub release_ns: Counter,
    pub fixed: Counter,
    pub fixed_fallbacks: Counter,
    pub fixed_ordinary: Counter,
    pub chunks_registered: Counter,
    pub register_ns: Counter,
    pub evictions: Counter,
    pub evict_busy: Counter,
    npage_histogram: [Counter; BUCKETS],
    latency: [Latency; 3],
}

impl BlkCounters {
    /// Counts a read or write over `pages` pinned pages in the histogram.
    pub fn record_pages(&self, pages: usize) {
        let bucket = pages.max(1).next_power_of_two().trailing_zeros() as usize;
        self.npage_histogram[bucket.min(BUCKETS - 1)].add(1);
    }

    /// Counts one `op` that took `ns` nanoseconds in its latency histogram.
    #[inline]
    pub fn record_latency(&self, op: Op, ns: u64) {
        let l = &self.latency[op as usize];
        l.counts[latency_bucket(ns)].add(1);
        l.sum_ns.add(ns);
    }

    fn snapshot(&self) -> BlkStats {
        let mut npage_histogram: Vec<u64> = self.npage_histogram.iter().map(|c| c.get()).collect();
        while npage_histogram.last() == Some(&0) {
            npage_histogram.pop();
        }
        BlkStats {
            reads: self.reads.get(),
            writes: self.writes.get(),
            flushes: self.flushes.get(),
            bytes_read: self.bytes_read.get(),
            bytes_written: self.bytes_written.get(),
            failed: self.failed.get(),
            io_errors: self.io_errors.get(),
            pin_errors: self.pin_errors.get(),
            indirect: self.indirect.get(),
            bounced: self.bounced.get(),
            discards: self.discards.get(),
            write_zeroes: self.write_zeroes.get(),
            batches: self.batches.get(),
            most_in_flight: self.most_in_flight.get(),
            pinned_pages: self.pinned_pages.get(),
            most_pinned_pages: self.most_pinned_pages.get(),
            holds: self.holds.get(),
            hold_ns: self.hold_ns.get(),
            release_ns: self.release_ns.get(),
            fixed: self.fixed.get(),
            fixed_fallbacks: self.fixed_fallbacks.get(),
            fixed_ordinary: self.fixed_ordinary.get(),
            chunks_registered: self.chunks_registered.get(),
            register_ns: self.register_ns.get(),
            evictions: self.evictions.get(),
            evict_busy: self.evict_busy.get(),
            npage_histogram,
        }
    }
}

/// A blk device's counters, one block per queue, to read from any thread while it serves
/// ([`crate::Blk::live`]), and its throttle. Cloning shares them.
#[derive(Clone, Debug)]
pub struct BlkLive {
    queues: Arc<[BlkCounters]>,
    throttle: Throttle,
}

impl BlkLive {
    pub(super) fn new(queues: u16) -> BlkLive {
        BlkLive {
            queues: (0..queues.max(1)).map(|_| BlkCounters::default()).collect(),
            throttle: Throttle::default(),
        }
    }

    /// Queue `q`'s block (the last queue's for an index past the end: the back end hands the
    /// device only indexes below its queue count).
    pub(super) fn queue(&self, q: u16) -> &BlkCounters {
        &self.queues[usize::from(q).min(self.queues.len() - 1)]
    }

    /// Each queue's counts now.
    pub fn queues(&self) -> Vec<BlkStats> {
        self.queues.iter().map(BlkCounters::snapshot).collect()
    }

    /// Each queue's latency histograms now.
    pub fn latency(&self) -> Vec<QueueLatency> {
        self.queues
            .iter()
            .enumerate()
            .map(|(q, c)| QueueLatency {
                queue: q as u16,
                read: c.latency[Op::Read as usize].snapshot(),
                write: c.latency[Op::Write as usize].snapshot(),
                flush: c.latency[Op::Flush as usize].snapshot(),
            })
            .collect()
    }

    /// Counts one `op` of `ns` nanoseconds in queue `q`'s histogram, as the device does for
    /// each request it ends (for tools that measure what that costs: the bench). Only the
    /// thread serving queue `q` may call it while the device serves.
    pub fn record_latency(&self, q: u16, op: Op, ns: u64) {
        self.queue(q).record_latency(op, ns);
    }

    /// The device's throttle, shared by its queues (`blk-set-throttle`).
    pub fn throttle(&self) -> &Throttle {
        &self.throttle
    }

    /// The device's counts now: the sum of its queues'.
    pub fn total(&self) -> BlkStats {
        let mut t = BlkStats::default();
        for q in self.queues() {
            t.add(&q);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_total_sums_the_queues_and_keeps_the_highest_mark() {
        let live = BlkLive::new(2);
        live.queue(0).reads.add(3);
        live.queue(1).reads.add(4);
        live.queue(0).most_in_flight.raise(9);
        live.queue(1).most_in_flight.raise(5);
        live.queue(1).record_pages(1);
        live.queue(1).record_pages(3);
        live.queue(0).record_pages(1 << 30);
        let t = live.total();
        assert_eq!((t.reads, t.most_in_flight), (7, 9));
        // 1 page: bucket 0; 3 pages: bucket 2 (up to 4); a huge request: the last bucket.
        assert_eq!(t.npage_histogram[0..3], [1, 0, 1]);
        assert_eq!(t.npage_histogram.len(), BUCKETS);
        assert_eq!(live.queues()[1].npage_histogram, vec![1, 0, 1]);
        // A queue index past the end counts on the last queue, never out of bounds.
        live.queue(7).flushes.add(1);
        assert_eq!(live.queues()[1].flushes, 1);
    }

    #[test]
    fn latency_buckets_are_upper_bounds_in_powers_of_two() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1024), 0);
        assert_eq!(latency_bucket(1025), 1);
        assert_eq!(latency_bucket(1 << 20), 10);
        assert_eq!(latency_bucket((1 << 33) + 1), LATENCY_BOUNDED);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BOUNDED);
        let live = BlkLive::new(2);
        live.queue(1).record_latency(Op::Write, 3000);
        live.queue(1).record_latency(Op::Write, 5000);
        live.queue(0).record_latency(Op::Flush, 1 << 40);
        let l = live.latency();
        let w = &l[1].write;
        // 3000 and 5000 ns: at most 4096 (bucket 2) and 8192 (bucket 3).
        assert_eq!(
            (w.count, w.sum_ns, w.counts[2], w.counts[3]),
            (2, 8000, 1, 1)
        );
        assert_eq!(w.counts.len(), w.bounds_ns.len() + 1);
        assert_eq!(w.bounds_ns[2], 4096);
        assert_eq!(l[0].flush.counts[LATENCY_BOUNDED], 1);
        assert_eq!((l[0].read.count, l[1].flush.count), (0, 0));
    }
}
