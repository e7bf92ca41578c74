//! The guest's memory statistics, as the virtio-balloon driver sends them on the statistics
//! queue (`VIRTIO_BALLOON_F_STATS_VQ`).
//!
//! **The buffer.** One driver-readable buffer holding entries of 10 bytes each, packed: a
//! little-endian 16-bit tag and a little-endian 64-bit value. The driver may send any subset of
//! the tags, in any order; tags this device does not know (a newer driver's) are skipped and
//! counted, a repeated tag's last value counts. Sizes are in bytes, faults and events are counts.
//!
//! **Bad buffers.** The guest is not trusted. A buffer that is empty, not whole 10-byte entries
//! (a truncated last entry), or longer than [`MAX_STATS_ENTRIES`] entries is refused whole
//! ([`StatsError`]) and the statistics kept from before stay; nothing here panics on any input.
//!
//! **The exchange** (in [`super::Balloon::process_stats`] and [`super::Balloon::request_stats`]):
//! the driver primes the queue with one buffer when it starts; the device keeps it, and each time
//! it wants fresh figures it returns the buffer (used, length 0); the driver then fills a new one
//! and makes it available again.

/// Tag: memory swapped in, bytes.
pub const SWAP_IN: u16 = 0;
/// Tag: memory swapped out, bytes.
pub const SWAP_OUT: u16 = 1;
/// Tag: major page faults.
pub const MAJOR_FAULTS: u16 = 2;
/// Tag: minor page faults.
pub const MINOR_FAULTS: u16 = 3;
/// Tag: free memory, bytes (Linux's `MemFree`).
pub const FREE_MEMORY: u16 = 4;
/// Tag: total memory, bytes (Linux's `MemTotal`).
pub const TOTAL_MEMORY: u16 = 5;
/// Tag: available memory, bytes (Linux's `MemAvailable`).
pub const AVAILABLE_MEMORY: u16 = 6;
/// Tag: disk caches, bytes.
pub const DISK_CACHES: u16 = 7;
/// Tag: successful hugetlb page allocations.
pub const HUGETLB_ALLOCATIONS: u16 = 8;
/// Tag: failed hugetlb page allocations.
pub const HUGETLB_FAILURES: u16 = 9;
/// Tag: OOM kills.
pub const OOM_KILLS: u16 = 10;
/// Tag: allocation stalls.
pub const ALLOC_STALLS: u16 = 11;
/// Tag: pages scanned by background reclaim.
pub const ASYNC_SCANS: u16 = 12;
/// Tag: pages scanned by direct reclaim.
pub const DIRECT_SCANS: u16 = 13;
/// Tag: pages reclaimed in the background.
pub const ASYNC_RECLAIMS: u16 = 14;
/// Tag: pages reclaimed directly.
pub const DIRECT_RECLAIMS: u16 = 15;

/// Bytes of one entry: tag (2) and value (8), packed.
pub const ENTRY_SIZE: usize = 10;
/// The most entries a buffer may hold (drivers send at most one per tag; 16 are defined).
pub const MAX_STATS_ENTRIES: usize = 256;

/// The names the tags go by in logs and JSON, by tag.
const NAMES: [&str; 16] = [
    "swap_in",
    "swap_out",
    "major_faults",
    "minor_faults",
    "free_memory",
    "total_memory",
    "available_memory",
    "disk_caches",
    "hugetlb_allocations",
    "hugetlb_failures",
    "oom_kills",
    "alloc_stalls",
    "async_scans",
    "direct_scans",
    "async_reclaims",
    "direct_reclaims",
];

/// The name of a known tag (`free_memory`, ...), `None` for one this device does not know.
pub fn tag_name(tag: u16) -> Option<&'static str> {
    NAMES.get(usize::from(tag)).copied()
}

/// Why a statistics buffer was refused whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StatsError {
    /// No bytes at all.
    #[error("statistics buffer is empty")]
    Empty,
    /// Not whole 10-byte entries: the last one is cut short.
    #[error("statistics buffer of {len} bytes is not whole {ENTRY_SIZE}-byte entries")]
    NotWholeEntries {
        /// The buffer's length in bytes.
        len: usize,
    },
    /// More entries than a driver sends.
    #[error(
        "statistics buffer of {len} bytes holds more than {MAX_STATS_ENTRIES} entries of {ENTRY_SIZE} bytes"
    )]
    TooLong {
        /// The buffer's length in bytes.
        len: usize,
    },
}

/// One set of statistics from the driver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GuestStats {
    values: [Option<u64>; 16],
    /// Entries whose tag this device does not know (skipped).
    pub unknown_tags: u32,
    /// Entries in the buffer.
    pub entries: u32,
}

impl GuestStats {
    /// Parses a statistics buffer; see the module documentation for what is refused.
    pub fn parse(buf: &[u8]) -> Result<GuestStats, StatsError> {
        let len = buf.len();
        if len == 0 {
            return Err(StatsError::Empty);
        }
        if len > MAX_STATS_ENTRIES * ENTRY_SIZE {
            return Err(StatsError::TooLong { len });
        }
        if len % ENTRY_SIZE != 0 {
            return Err(StatsError::NotWholeEntries { len });
        }
        let mut stats = GuestStats::default();
        for entry in buf.chunks_exact(ENTRY_SIZE) {
            let (tag, value) = entry.split_at(2);
            let tag = u16::from_le_bytes([tag[0], tag[1]]);
            let mut v = [0u8; 8];
            v.copy_from_slice(value);
            stats.entries += 1;
            match stats.values.get_mut(usize::from(tag)) {
                Some(slot) => *slot = Some(u64::from_le_bytes(v)),
                None => stats.unknown_tags += 1,
            }
        }
        Ok(stats)
    }

    /// The value the driver sent for `tag`, if it sent one.
    pub fn get(&self, tag: u16) -> Option<u64> {
        self.values.get(usize::from(tag)).copied().flatten()
    }

    /// Every known tag the driver sent, by name, in tag order.
    pub fn named(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        NAMES
            .iter()
            .zip(self.values.iter())
            .filter_map(|(&name, v)| Some((name, (*v)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(tag: u16, value: u64) -> Vec<u8> {
        let mut e = tag.to_le_bytes().to_vec();
        e.extend_from_slice(&value.to_le_bytes());
        e
    }

    #[test]
    fn parses_linux_layout() {
        let mut buf = Vec::new();
        for (tag, v) in [
            (SWAP_IN, 0),
            (FREE_MEMORY, 123 << 20),
            (TOTAL_MEMORY, 1 << 30),
        ] {
            buf.extend(entry(tag, v));
        }
        let s = GuestStats::parse(&buf).unwrap();
        assert_eq!(s.get(FREE_MEMORY), Some(123 << 20));
        assert_eq!(s.get(TOTAL_MEMORY), Some(1 << 30));
        assert_eq!(s.get(SWAP_IN), Some(0));
        assert_eq!(s.get(AVAILABLE_MEMORY), None);
        assert_eq!(s.entries, 3);
        let named: Vec<_> = s.named().collect();
        assert_eq!(
            named,
            [
                ("swap_in", 0),
                ("free_memory", 123 << 20),
                ("total_memory", 1 << 30)
            ]
        );
    }

    #[test]
    fn unknown_tags_are_skipped_and_counted() {
        let mut buf = entry(16, 7);
        buf.extend(entry(u16::MAX, 9));
        buf.extend(entry(MAJOR_FAULTS, 5));
        let s = GuestStats::parse(&buf).unwrap();
        assert_eq!(s.unknown_tags, 2);
        assert_eq!(s.entries, 3);
        assert_eq!(s.get(MAJOR_FAULTS), Some(5));
        assert_eq!(s.get(u16::MAX), None);
        assert_eq!(s.named().count(), 1);
    }

    #[test]
    fn repeated_tag_keeps_last_value() {
        let mut buf = entry(FREE_MEMORY, 1);
        buf.extend(entry(FREE_MEMORY, 2));
        assert_eq!(GuestStats::parse(&buf).unwrap().get(FREE_MEMORY), Some(2));
    }

    #[test]
    fn truncated_and_odd_lengths_are_refused() {
        let buf = [entry(FREE_MEMORY, 1), entry(TOTAL_MEMORY, 2)].concat();
        for cut in 1..ENTRY_SIZE {
            // A last entry cut short, by any number of bytes.
            let len = buf.len() - cut;
            assert_eq!(
                GuestStats::parse(&buf[..len]),
                Err(StatsError::NotWholeEntries { len })
            );
        }
        assert_eq!(
            GuestStats::parse(&buf[..7]),
            Err(StatsError::NotWholeEntries { len: 7 })
        );
        assert_eq!(GuestStats::parse(&[]), Err(StatsError::Empty));
    }

    #[test]
    fn too_long_is_refused() {
        let buf = vec![0u8; (MAX_STATS_ENTRIES + 1) * ENTRY_SIZE];
        assert_eq!(
            GuestStats::parse(&buf),
            Err(StatsError::TooLong { len: buf.len() })
        );
        let buf = vec![0u8; MAX_STATS_ENTRIES * ENTRY_SIZE];
        assert_eq!(
            GuestStats::parse(&buf).unwrap().entries,
            MAX_STATS_ENTRIES as u32
        );
    }

    #[test]
    fn any_bytes_parse_without_panic() {
        // Every length up to a few entries past the limit, with varied contents.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for len in
            (0..64).chain(MAX_STATS_ENTRIES * ENTRY_SIZE - 3..MAX_STATS_ENTRIES * ENTRY_SIZE + 12)
        {
            let buf: Vec<u8> = (0..len)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed as u8
                })
                .collect();
            match GuestStats::parse(&buf) {
                Ok(s) => assert_eq!(s.entries as usize, len / ENTRY_SIZE),
                Err(_) => assert!(
                    len == 0 || len % ENTRY_SIZE != 0 || len > MAX_STATS_ENTRIES * ENTRY_SIZE
                ),
            }
        }
    }
}
