//! What a blk device counts: requests by kind, bytes, failures by cause, batches, and the
//! pinned-page histogram of its reads and writes (the distribution a real guest produces).
//! A ring worker counts on its own; its counts are added to the device's when it stops.

/// What the device has done.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
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
    /// Of those, reads and writes whose guest pages could not be pinned (ENOMEM: the
    /// locked-memory limit).
    pub pin_errors: u64,
    /// Chains whose head named an indirect descriptor table.
    pub indirect: u64,
    /// Transfers copied through an aligned buffer: the image is `O_DIRECT` and the guest's
    /// buffers were not aligned as it needs.
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
    /// Pinned 4 KiB pages per read/write request: entry `i` counts requests of `2^(i-1) < n <=
    /// 2^i` pages (entry 0: one page).
    pub npage_histogram: Vec<u64>,
}

impl BlkStats {
    /// Adds another device's counts (a ring worker's, [`crate::Device::join_worker`]).
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
            npage_histogram,
        } = o;
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
        if self.npage_histogram.len() < npage_histogram.len() {
            self.npage_histogram.resize(npage_histogram.len(), 0);
        }
        for (a, b) in self.npage_histogram.iter_mut().zip(npage_histogram) {
            *a += b;
        }
    }
}

pub(super) fn record(h: &mut Vec<u64>, pages: usize) {
    let bucket = pages.max(1).next_power_of_two().trailing_zeros() as usize;
    if h.len() <= bucket {
        h.resize(bucket + 1, 0);
    }
    h[bucket] += 1;
}
