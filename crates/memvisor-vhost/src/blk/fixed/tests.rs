//! Registered chunks move the right bytes, a discard's eviction empties the slot on the ring's
//! thread (the kernel's own listing and VmPin say so), and a chunk with a transfer in flight is
//! called busy and kept. `MEMVISOR_TEST_FIXED_NO_EVICT=1` (with `--features test-hooks`) must
//! make the eviction test fail.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use memvisor::{Backing, BackingKind, DiscardGate};

use super::{CHUNK, FixedChunks, REREGISTER_AFTER};
use crate::disk::Disk;

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn no_evict() -> bool {
    #[cfg(feature = "test-hooks")]
    return memvisor::faults::Faults::from_env().fixed_no_evict;
    #[cfg(not(feature = "test-hooks"))]
    false
}

/// Registered buffers of every io_uring of this process, `(address, bytes)`, from fdinfo.
fn kernel_buffers() -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let ring = std::fs::read_link(fd.path())
            .is_ok_and(|t| t.to_string_lossy() == "anon_inode:[io_uring]");
        let info = std::fs::read_to_string(format!(
            "/proc/self/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ));
        let (true, Ok(info)) = (ring, info) else {
            continue;
        };
        for line in info.lines() {
            if let Some((a, n)) = line
                .trim()
                .split_once(": 0x")
                .and_then(|(_, b)| b.split_once('/'))
            {
                if let (Ok(a), Ok(n)) = (u64::from_str_radix(a, 16), n.parse()) {
                    out.push((a, n));
                }
            }
        }
    }
    out
}

fn vm_pin_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmPin:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

fn image() -> (File, Vec<u8>) {
    let path = std::env::temp_dir().join(format!("memvisor-fixed-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let bytes: Vec<u8> = (0..1usize << 20).map(|i| (i * 13 % 251) as u8).collect();
    f.write_all_at(&bytes, 0).unwrap();
    (f, bytes)
}

/// Guest memory (memfd, 8 MiB) and the first whole chunk inside it.
fn guest() -> (Backing, (u64, u64), u64) {
    let b = Backing::new(BackingKind::Memfd, 8 << 20).unwrap();
    let region = (b.hva().0, b.hva().0 + b.size());
    let base = region.0.next_multiple_of(CHUNK);
    (b, region, base)
}

/// The slot for `iov`, its chunk registered as the device does it, after a pass: the first
/// transfers over a cold (or evicted) chunk go the ordinary way.
fn warm(
    fixed: &mut FixedChunks,
    disk: &mut Disk,
    iov: &[libc::iovec],
    region: (u64, u64),
) -> Option<u16> {
    for _ in 0..=REREGISTER_AFTER {
        if let Some(s) = fixed.acquire(disk, iov, region) {
            return Some(s);
        }
        fixed.register_cold(disk);
    }
    None
}

/// Evicts `[base, base + CHUNK)` from another thread while this one, the ring's, sleeps on
/// the completion eventfd and services the table when woken, as the serving loop would.
fn evict_while_serving(fixed: &mut FixedChunks, disk: &mut Disk, base: u64) -> Vec<(u64, u64)> {
    let gate = fixed.gate();
    let done = Arc::new(AtomicBool::new(false));
    let d2 = done.clone();
    let t = std::thread::spawn(move || {
        let busy = gate.evict(base, CHUNK, Duration::from_secs(2));
        d2.store(true, Ordering::SeqCst);
        busy
    });
    let fd = disk.completion_fd().unwrap();
    while !done.load(Ordering::SeqCst) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        if unsafe { libc::poll(&mut p, 1, 20) } > 0 {
            disk.finished(false);
            fixed.service(disk);
        }
    }
    t.join().unwrap()
}

#[test]
fn fixed_transfers_move_the_bytes_and_a_discard_evicts_the_chunk_first() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (b, region, base) = guest();
    let (file, bytes) = image();
    let mut disk = Disk::new(file).unwrap();
    let mut fixed = FixedChunks::new(no_evict());
    let at = base + 4096;
    let iov = [libc::iovec {
        iov_base: at as usize as *mut libc::c_void,
        iov_len: 8192,
    }];
    assert_eq!(
        fixed.acquire(&mut disk, &iov, region),
        None,
        "a cold chunk goes the ordinary way"
    );
    assert!(
        !kernel_buffers().contains(&(base, CHUNK)),
        "registered on the request"
    );
    let Some(slot) = warm(&mut fixed, &mut disk, &iov, region) else {
        println!(
            "skipped: fixed_transfers_move_the_bytes: no registered buffers here (RLIMIT_MEMLOCK?)"
        );
        return;
    };
    // SAFETY: guest memory of our own backing, mapped for the test; reaped below.
    assert!(unsafe { disk.start_fixed(&iov, 4096, true, 1, slot) });
    disk.submit();
    let got = disk.finished(true);
    assert_eq!(got.len(), 1);
    assert_eq!(*got[0].1.as_ref().unwrap(), 8192);
    fixed.release(at);
    let mut back = vec![0u8; 8192];
    b.read(at - region.0, &mut back).unwrap();
    assert!(
        back == bytes[4096..4096 + 8192],
        "READ_FIXED filled guest memory"
    );
    // Written back elsewhere through the same slot.
    assert_eq!(fixed.acquire(&mut disk, &iov, region), Some(slot));
    // SAFETY: as above.
    assert!(unsafe { disk.start_fixed(&iov, 512 << 10, false, 2, slot) });
    disk.submit();
    assert_eq!(*disk.finished(true)[0].1.as_ref().unwrap(), 8192);
    fixed.release(at);
    let mut file_back = vec![0u8; 8192];
    disk.file()
        .read_exact_at(&mut file_back, 512 << 10)
        .unwrap();
    assert!(
        file_back == back,
        "WRITE_FIXED wrote guest memory to the file"
    );
    // Buffers over two chunks go the ordinary way.
    let over = [libc::iovec {
        iov_base: (base + CHUNK - 4096) as usize as *mut libc::c_void,
        iov_len: 8192,
    }];
    assert_eq!(fixed.acquire(&mut disk, &over, region), None);
    assert_eq!(fixed.counts.ordinary, 3, "cold twice, then over two chunks");
    assert_eq!(fixed.counts.fallbacks, 0);
    assert_eq!(fixed.counts.fixed, 2);

    assert!(
        kernel_buffers().contains(&(base, CHUNK)),
        "the chunk is registered"
    );
    let pinned = vm_pin_kib();
    let busy = evict_while_serving(&mut fixed, &mut disk, base);
    assert!(busy.is_empty(), "nothing in flight, nothing busy: {busy:?}");
    assert!(
        !kernel_buffers().contains(&(base, CHUNK)),
        "the chunk is still registered after the discard's eviction"
    );
    assert!(
        vm_pin_kib() + 2048 <= pinned,
        "VmPin {} kB, {pinned} kB before the eviction",
        vm_pin_kib()
    );
    assert_eq!(fixed.counts.evictions, 1);
    // Closed until the discard reopens it.
    assert_eq!(fixed.acquire(&mut disk, &iov, region), None);
    fixed.register_cold(&mut disk);
    assert!(!kernel_buffers().contains(&(base, CHUNK)));
    fixed.gate().reopen(base, CHUNK);
    // Registered again only once REREGISTER_AFTER transfers touched it.
    for i in 1..REREGISTER_AFTER {
        assert_eq!(fixed.acquire(&mut disk, &iov, region), None, "transfer {i}");
        fixed.register_cold(&mut disk);
        assert!(
            !kernel_buffers().contains(&(base, CHUNK)),
            "registered again after {i} transfers"
        );
    }
    assert_eq!(fixed.acquire(&mut disk, &iov, region), None);
    fixed.register_cold(&mut disk);
    assert!(fixed.acquire(&mut disk, &iov, region).is_some());
    fixed.release(at);
    // A memory table change empties every slot.
    assert!(kernel_buffers().contains(&(base, CHUNK)));
    fixed.clear_all(&mut disk);
    assert!(!kernel_buffers().contains(&(base, CHUNK)));
}

#[test]
fn a_chunk_with_a_transfer_in_flight_is_busy_and_kept() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_b, region, base) = guest();
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: two descriptors just made, owned by nothing else.
    let (rd, mut wr) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    let mut disk = Disk::new(rd).unwrap();
    let mut fixed = FixedChunks::new(no_evict());
    let iov = [libc::iovec {
        iov_base: base as usize as *mut libc::c_void,
        iov_len: 8,
    }];
    let Some(slot) = warm(&mut fixed, &mut disk, &iov, region) else {
        println!("skipped: a_chunk_with_a_transfer_in_flight: no registered buffers here");
        return;
    };
    // SAFETY: as above; the read stays out until the pipe is written, reaped below.
    assert!(unsafe { disk.start_fixed(&iov, 0, true, 1, slot) });
    disk.submit();
    let gate = fixed.gate();
    assert_eq!(
        gate.evict(base, CHUNK, Duration::from_millis(50)),
        vec![(base, CHUNK)]
    );
    assert_eq!(gate.pinned_runs(base, base + CHUNK), vec![(base, CHUNK)]);
    gate.reopen(base, CHUNK);
    wr.write_all(&5u64.to_le_bytes()).unwrap();
    assert_eq!(*disk.finished(true)[0].1.as_ref().unwrap(), 8);
    fixed.release(base);
    assert!(evict_while_serving(&mut fixed, &mut disk, base).is_empty());
    assert!(gate.pinned_runs(base, base + CHUNK).is_empty());
    assert_eq!(
        fixed.take_counts().evict_busy,
        1,
        "the busy chunk was counted"
    );
}

/// Regions smaller than a chunk are registered too: each as its span, the part of the chunk
/// inside it, two regions side by side in one chunk with a span each (a libblkio client's
/// bounce buffer of 128 KiB, small regions the back end mapped next to each other). A transfer
/// over a span's edge goes the ordinary way, and a discard of the chunk evicts the idle span
/// and calls the busy one busy, by its own bytes.
#[test]
fn regions_smaller_than_a_chunk_are_registered_as_spans_of_their_own() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (b, whole, base) = guest();
    let (file, bytes) = image();
    let mut disk = Disk::new(file).unwrap();
    let mut fixed = FixedChunks::new(no_evict());
    // Two regions of 128 KiB in one chunk, the first 12 KiB past the chunk's start.
    let a = (base + 0x3000, base + 0x23000);
    let c = (a.1, a.1 + 0x20000);
    let at = |addr: u64, len: usize| {
        [libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: len,
        }]
    };
    // Whether this host registers at all: a whole chunk, the next one.
    let next = at(base + CHUNK, 4096);
    if warm(&mut fixed, &mut disk, &next, whole).is_none() {
        println!("skipped: regions_smaller_than_a_chunk: no registered buffers here");
        return;
    }
    fixed.release(base + CHUNK);
    let in_a = at(a.0 + 4096, 8192);
    let slot_a = warm(&mut fixed, &mut disk, &in_a, a).expect("the first region's span");
    assert!(
        kernel_buffers().contains(&(a.0, 0x20000)),
        "the first region's span is registered: {:?}",
        kernel_buffers()
    );
    // SAFETY: guest memory of our own backing, mapped for the test; reaped below.
    assert!(unsafe { disk.start_fixed(&in_a, 4096, true, 1, slot_a) });
    disk.submit();
    assert_eq!(*disk.finished(true)[0].1.as_ref().unwrap(), 8192);
    fixed.release(a.0 + 4096);
    let mut back = vec![0u8; 8192];
    b.read(a.0 + 4096 - whole.0, &mut back).unwrap();
    assert!(
        back == bytes[4096..4096 + 8192],
        "READ_FIXED filled the span"
    );
    // Over the first region's end: not inside its span.
    let ordinary = fixed.counts.ordinary;
    assert_eq!(fixed.acquire(&mut disk, &at(a.1 - 4096, 8192), a), None);
    assert_eq!(fixed.counts.ordinary, ordinary + 1);
    let in_c = at(c.0, 4096);
    let slot_c = warm(&mut fixed, &mut disk, &in_c, c).expect("the second region's span");
    assert_ne!(slot_a, slot_c);
    fixed.release(c.0);
    assert!(kernel_buffers().contains(&(c.0, 0x20000)));
    let gate = fixed.gate();
    assert_eq!(
        gate.pinned_runs(base, base + CHUNK),
        vec![(a.0, 0x20000), (c.0, 0x20000)]
    );
    // A transfer out in the first span; the discard of the chunk keeps that span alone.
    assert_eq!(fixed.acquire(&mut disk, &in_a, a), Some(slot_a));
    let busy = evict_while_serving(&mut fixed, &mut disk, base);
    assert_eq!(
        busy,
        vec![(a.0, 0x20000)],
        "the busy span, by its own bytes"
    );
    assert!(kernel_buffers().contains(&(a.0, 0x20000)));
    assert!(
        !kernel_buffers().contains(&(c.0, 0x20000)),
        "the idle span is still registered after the discard's eviction"
    );
    fixed.release(a.0 + 4096);
    gate.reopen(base, CHUNK);
    fixed.clear_all(&mut disk);
    assert!(!kernel_buffers().contains(&(a.0, 0x20000)));
}

/// End to end with a real discard: a free page report of a registered chunk, handled on
/// another thread while the ring's thread serves, evicts the chunk before the hole is punched;
/// the next READ_FIXED registers the chunk again over the new pages, and the guest sees the
/// bytes read. Without the eviction (the fault) the read fills the orphaned pinned pages and
/// the guest reads zeros.
#[test]
fn a_read_after_a_balloon_discard_lands_where_the_guest_looks() {
    let _s = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let b = Arc::new(Backing::new(BackingKind::Memfd, 8 << 20).unwrap());
    let region = (b.hva().0, b.hva().0 + b.size());
    let base = region.0.next_multiple_of(CHUNK);
    let slots = memvisor::SlotTable::new();
    const GPA: u64 = 1 << 30;
    slots
        .insert(memvisor::SlotSpec::new(0, memvisor::Gpa(GPA), b.clone()))
        .unwrap();
    let registry = memvisor::PinRegistry::new(memvisor::LockLimit::Unlimited);
    let discarder = memvisor::Discarder::with_options(
        &slots,
        memvisor::DiscardOptions {
            registry: Some(registry.clone()),
            ..Default::default()
        },
    );
    let (file, bytes) = image();
    let mut disk = Disk::new(file).unwrap();
    let mut fixed = FixedChunks::new(no_evict());
    let gate: Arc<dyn DiscardGate> = fixed.gate();
    registry.register_gate(Arc::downgrade(&gate));
    let iov = [libc::iovec {
        iov_base: base as usize as *mut libc::c_void,
        iov_len: 4096,
    }];
    let read = |fixed: &mut FixedChunks, disk: &mut Disk, offset: u64| {
        let slot = warm(fixed, disk, &iov, region)?;
        // SAFETY: our own guest memory, reaped before it returns.
        assert!(unsafe { disk.start_fixed(&iov, offset, true, 9, slot) });
        disk.submit();
        assert_eq!(*disk.finished(true)[0].1.as_ref().unwrap(), 4096);
        fixed.release(base);
        Some(())
    };
    if read(&mut fixed, &mut disk, 0).is_none() {
        println!("skipped: a_read_after_a_balloon_discard: no registered buffers here");
        return;
    }
    // The guest frees the chunk; the balloon reports it, from another thread.
    let gpa = GPA + (base - region.0);
    let done = Arc::new(AtomicBool::new(false));
    let d2 = done.clone();
    let t = std::thread::spawn(move || {
        // A discard waits only a bounded time for the ring's thread and skips the chunk if it
        // did not answer (a hint); on a loaded machine the report is made again.
        let mut out = discarder.report(&[(memvisor::Gpa(gpa), CHUNK)]);
        for _ in 0..50 {
            if out.discarded == CHUNK {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
            out = discarder.report(&[(memvisor::Gpa(gpa), CHUNK)]);
        }
        d2.store(true, Ordering::SeqCst);
        out
    });
    let fd = disk.completion_fd().unwrap();
    while !done.load(Ordering::SeqCst) {
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        if unsafe { libc::poll(&mut p, 1, 20) } > 0 {
            disk.finished(false);
            fixed.service(&mut disk);
        }
    }
    let out = t.join().unwrap();
    assert_eq!(out.discarded, CHUNK, "{out:?}");
    // The guest reuses the page for a read of other bytes.
    assert!(read(&mut fixed, &mut disk, 64 << 10).is_some());
    let mut seen = vec![0u8; 4096];
    b.read(base - region.0, &mut seen).unwrap();
    assert!(
        seen == bytes[64 << 10..(64 << 10) + 4096],
        "the guest does not see the bytes read after the discard (first: {:?})",
        &seen[..8]
    );
}
