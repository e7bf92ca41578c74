//! Shared pieces of the fuzz targets.
//!
//! Each target in `fuzz_targets/` is a thin driver: it turns libFuzzer's bytes into calls on a
//! public API of the workspace crates and lets the code under test judge them. What they share
//! is here: [`Bytes`], a reader that never fails (past the end it yields zeros, so every input
//! is a valid program), small memfds and eventfds standing in for the frontend's descriptors,
//! and [`RingMemory`], a tiny guest memory held the way the vhost-user back end holds it, with a
//! split virtqueue whose descriptor table and avail ring are whatever the input says.
//!
//! Everything a target creates is dropped at the end of its iteration: libFuzzer runs millions
//! of them in one process, so a leaked descriptor or mapping would end the run.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use memvisor_vhost::FrontendMemory;
use memvisor_vhost::proto::Region;
use virtio_queue::{Queue, QueueT};

/// Reads little-endian values off the input; zeros once it is used up.
pub struct Bytes<'a> {
    data: &'a [u8],
}

impl<'a> Bytes<'a> {
    /// A reader over `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Bytes { data }
    }
    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
    /// Up to `n` bytes (fewer at the end).
    pub fn take(&mut self, n: usize) -> &'a [u8] {
        let n = n.min(self.data.len());
        let (a, b) = self.data.split_at(n);
        self.data = b;
        a
    }
    /// The rest.
    pub fn rest(&mut self) -> &'a [u8] {
        self.take(self.data.len())
    }
    fn array<const N: usize>(&mut self) -> [u8; N] {
        let mut a = [0u8; N];
        let got = self.take(N);
        a[..got.len()].copy_from_slice(got);
        a
    }
    /// One byte.
    pub fn u8(&mut self) -> u8 {
        self.array::<1>()[0]
    }
    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.array())
    }
    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.array())
    }
    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.array())
    }
}

/// A memfd of `size` bytes.
pub fn memfd(size: u64) -> File {
    // SAFETY: a NUL-terminated name and plain flags; the result is checked and owned by the File.
    let fd = unsafe { libc::memfd_create(c"memvisor-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size).expect("size the fuzz memfd");
    f
}

/// A non-blocking eventfd (a kick or call descriptor).
pub fn eventfd() -> File {
    // SAFETY: plain flags; the result is checked and owned by the File.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nobody else owns.
    unsafe { File::from_raw_fd(fd) }
}

/// Size of the guest memory under [`RingMemory`].
pub const GUEST: u64 = 64 << 10;
/// Where the frontend claims to have that memory mapped.
pub const USER: u64 = 0x7f00_0000_0000;
/// Queue size of the fuzzed ring.
pub const QUEUE: u16 = 16;
/// Guest addresses of the ring's parts: 16 descriptors, the avail ring, the used ring.
pub const DESC: u64 = 0;
/// Avail ring.
pub const AVAIL: u64 = 0x100;
/// Used ring.
pub const USED: u64 = 0x200;
/// Bytes of ring the input fills, from [`DESC`]: the descriptor table and the avail ring.
pub const RING_BYTES: usize = (AVAIL as usize) + 4 + 2 * QUEUE as usize + 2;
/// Where the input's buffer bytes go.
pub const DATA: u64 = 0x1000;

/// A small guest memory held as the vhost-user back end holds a frontend's (one region, a
/// memfd), and a queue over it whose descriptor table and avail ring came from the input.
pub struct RingMemory {
    /// The guest memory as the back end holds it.
    pub memory: FrontendMemory,
    /// The guest memory's file (the test's own handle for writing it).
    pub file: File,
}

impl RingMemory {
    /// A fresh memory; the input fills the ring area and then the data area. Panics only when
    /// the host cannot give a memfd or a mapping.
    pub fn new(b: &mut Bytes) -> RingMemory {
        let file = memfd(GUEST);
        file.write_all_at(b.take(RING_BYTES), DESC)
            .expect("write the ring");
        file.write_all_at(b.take((GUEST - DATA) as usize), DATA)
            .expect("write the data");
        let state = memvisor_vhost::ProcessState::new(
            memvisor::SharedMappings::global(),
            memvisor::PinRegistry::global(),
        );
        let mut memory = FrontendMemory::new(&state).expect("frontend memory");
        let fd = OwnedFd::from(file.try_clone().expect("dup the guest memfd"));
        let region = Region {
            gpa: 0,
            size: GUEST,
            user_addr: USER,
            mmap_offset: 0,
        };
        memory.set_table(&[region], vec![fd]).expect("memory table");
        RingMemory { memory, file }
    }

    /// A ready queue over the ring, starting at avail index `base`.
    pub fn queue(&self, base: u16, event_idx: bool) -> Queue {
        let mut q = Queue::new(QUEUE).expect("queue");
        q.set_size(QUEUE);
        q.set_desc_table_address(Some(DESC as u32), Some(0));
        q.set_avail_ring_address(Some(AVAIL as u32), Some(0));
        q.set_used_ring_address(Some(USED as u32), Some(0));
        q.set_next_avail(base);
        q.set_next_used(base);
        q.set_event_idx(event_idx);
        q.set_ready(true);
        assert!(
            q.is_valid(&self.memory.dma().memory()),
            "the fixed ring is valid"
        );
        q
    }
}

/// Checks, every 64th call, that the process holds no memfd, eventfd or socket and no mapping of
/// a fuzz memfd: a target calls it at the end of each iteration, once everything it made is
/// dropped, so a leak shows as a crash within 64 runs instead of an exhausted process hours
/// later. (Other descriptors come and go with libFuzzer itself: the sanitizer's symbolizer
/// pipes.)
pub fn check_leaks() {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    if !CALLS.fetch_add(1, Ordering::Relaxed).is_multiple_of(64) {
        return;
    }
    let ours: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let target = std::fs::read_link(e.path()).ok()?.display().to_string();
            let made = ["memfd:", "anon_inode:[eventfd]", "socket:"]
                .iter()
                .any(|k| target.starts_with(k));
            made.then(|| format!("{} -> {target}", e.file_name().to_string_lossy()))
        })
        .collect();
    assert!(ours.is_empty(), "descriptors left after the run: {ours:?}");
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let left = maps
        .lines()
        .filter(|l| l.contains("memfd:memvisor-fuzz"))
        .count();
    assert_eq!(left, 0, "{left} mappings of fuzz memfds left after the run");
}
