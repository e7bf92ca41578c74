//! The io_uring's setup flags, each path on its own: a ring set up with each [`RingSetup`]
//! moves the right bytes both ways, wakes its thread through the eventfd for every completion
//! (with `DEFER_TASKRUN` a completion posts only on an enter with `GETEVENTS`, so a reap that
//! cleared the eventfd without that enter would never be woken again), and is entered only by
//! the thread that made it.

use std::fs::File;
use std::io::Write;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use super::{Disk, RingSetup};

/// A file of `len` bytes, byte i = (i * 7 + seed) mod 251, under the temp directory.
fn image(name: &str, len: usize, seed: u8) -> (File, Vec<u8>) {
    let path = std::env::temp_dir().join(format!("memvisor-{name}-{}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let bytes: Vec<u8> = (0..len)
        .map(|i| ((i * 7 + usize::from(seed)) % 251) as u8)
        .collect();
    f.write_all_at(&bytes, 0).unwrap();
    (f, bytes)
}

/// A pipe: (read end, write end).
fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into the array.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: two descriptors pipe2 just made, owned by nothing else.
    unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
}

/// Waits up to `limit` for the disk's eventfd to become readable.
fn woken(disk: &Disk, limit: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: disk.completion_fd().expect("a ring with an eventfd"),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one live pollfd.
    unsafe { libc::poll(&mut p, 1, limit.as_millis() as libc::c_int) > 0 }
}

/// Reaps as a serving loop does: sleep on the eventfd, then take what ended without waiting,
/// until `n` transfers came back. Panics when the eventfd stays quiet for 5 s with some out.
fn reap_by_eventfd(disk: &mut Disk, n: usize) -> Vec<(u64, u64)> {
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            woken(disk, Duration::from_secs(5)),
            "{} of {n} transfers back and the eventfd silent for 5 s: a lost wake-up ({:?})",
            got.len(),
            disk.ring_setup()
        );
        for (key, r) in disk.finished(false) {
            got.push((key, r.expect("the transfer succeeds")));
        }
    }
    got
}

/// The ring of `disk`, set up with `setup` alone; `None` (said as skipped) where the kernel
/// refuses that setup.
fn only(disk: &mut Disk, setup: &'static [RingSetup], test: &str) -> Option<()> {
    disk.only_setup(setup);
    if disk.ring().is_none() {
        println!(
            "skipped: {test}: the kernel refuses io_uring with {}",
            setup[0]
        );
        return None;
    }
    assert_eq!(
        disk.ring_setup(),
        Some(setup[0]),
        "the setup taken is the one asked"
    );
    Some(())
}

const EACH: [&[RingSetup]; 3] = [
    &[RingSetup::DeferTaskrun],
    &[RingSetup::CoopTaskrun],
    &[RingSetup::Plain],
];

/// Eight 4 KiB reads and eight writes at scattered offsets, reaped through the eventfd, with
/// each setup: the reads return the file's bytes, the writes land in the file.
#[test]
fn each_setup_moves_the_bytes_and_wakes_through_the_eventfd() {
    for setup in EACH {
        let (file, bytes) = image("ring-bytes", 64 << 10, 3);
        let mut disk = Disk::new(file).unwrap();
        let Some(()) = only(&mut disk, setup, "each_setup_moves_the_bytes") else {
            continue;
        };
        let offsets: Vec<u64> = (0..8u64).map(|i| (i * 5 % 16) * 4096).collect();
        let mut bufs = vec![vec![0u8; 4096]; 8];
        let iovs: Vec<libc::iovec> = bufs
            .iter_mut()
            .map(|b| libc::iovec {
                iov_base: b.as_mut_ptr().cast(),
                iov_len: b.len(),
            })
            .collect();
        for (i, &off) in offsets.iter().enumerate() {
            // SAFETY: our own buffers and iovecs, kept until reaped below.
            assert!(unsafe { disk.start(&iovs[i..i + 1], off, true, i as u64) });
        }
        assert_eq!(disk.submit(), 8);
        let mut got = reap_by_eventfd(&mut disk, 8);
        got.sort();
        assert_eq!(got, (0..8).map(|k| (k, 4096)).collect::<Vec<_>>());
        for (i, &off) in offsets.iter().enumerate() {
            let off = off as usize;
            assert!(bufs[i] == bytes[off..off + 4096], "{}: read {i}", setup[0]);
        }
        // Writes: each buffer to another place, reaped by waiting.
        let (_, fresh) = image("ring-fresh", 8 * 4096, 101);
        let src: Vec<Vec<u8>> = fresh.chunks(4096).map(<[u8]>::to_vec).collect();
        let iovs: Vec<libc::iovec> = src
            .iter()
            .map(|b| libc::iovec {
                iov_base: b.as_ptr().cast_mut().cast(),
                iov_len: b.len(),
            })
            .collect();
        for i in 0..8 {
            // SAFETY: as above; the kernel only reads these buffers.
            assert!(unsafe {
                disk.start(&iovs[i..i + 1], (i as u64 + 8) * 4096, false, 10 + i as u64)
            });
        }
        disk.submit();
        let mut n = 0;
        while disk.in_flight() > 0 {
            for (_, r) in disk.finished(true) {
                assert_eq!(r.unwrap(), 4096);
                n += 1;
            }
        }
        assert_eq!(n, 8);
        let mut back = vec![0u8; 8 * 4096];
        disk.file().read_exact_at(&mut back, 8 * 4096).unwrap();
        assert!(back == fresh, "{}: the writes landed", setup[0]);
    }
}

/// A read of an empty pipe stays out while the thread sleeps on the eventfd; another thread
/// writes after 0 to 1 ms (so the completion arrives before, during and after the sleep
/// begins). Every one must wake the sleeper and be reaped by the wake-up it caused, 300 times
/// per setup.
#[test]
fn a_completion_arriving_while_the_thread_waits_on_the_eventfd_wakes_it() {
    for setup in EACH {
        let (rd, mut wr) = pipe();
        let mut disk = Disk::new(rd).unwrap();
        let Some(()) = only(&mut disk, setup, "completion_wakes_the_waiter") else {
            continue;
        };
        let (tx, rx) = std::sync::mpsc::channel::<(u64, Duration)>();
        let writer = std::thread::spawn(move || {
            for (value, delay) in rx {
                let start = Instant::now();
                while start.elapsed() < delay {
                    std::hint::spin_loop();
                }
                wr.write_all(&value.to_le_bytes()).unwrap();
            }
        });
        for i in 0..300u64 {
            let mut buf = [0u8; 8];
            let iov = [libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: 8,
            }];
            // SAFETY: `buf` and `iov` live until the read is reaped in this iteration.
            assert!(unsafe { disk.start(&iov, 0, true, i) });
            disk.submit();
            let delay = Duration::from_micros([0, 20, 200, 1000][(i % 4) as usize]);
            tx.send((i * 3 + 1, delay)).unwrap();
            let got = reap_by_eventfd(&mut disk, 1);
            assert_eq!(got, vec![(i, 8)], "{}: round {i}", setup[0]);
            assert_eq!(u64::from_le_bytes(buf), i * 3 + 1);
        }
        drop(tx);
        writer.join().unwrap();
    }
}

/// A disk with a read out, moved to another thread, is not reaped there (the kernel would
/// refuse a ring made SINGLE_ISSUER): that thread gets nothing, at once, and says the transfer
/// is stranded; back on its own thread it is reaped. An idle disk moved to another thread
/// makes a new ring there and serves.
#[test]
fn only_the_rings_thread_reaps_it_and_an_idle_disk_moves() {
    for setup in EACH {
        let (rd, mut wr) = pipe();
        let mut disk = Disk::new(rd).unwrap();
        let Some(()) = only(&mut disk, setup, "only_the_rings_thread_reaps_it") else {
            continue;
        };
        let mut buf = Box::new([0u8; 8]);
        let iov = Box::new([libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: 8,
        }]);
        // SAFETY: the boxes outlive the read, reaped below on this thread.
        assert!(unsafe { disk.start(&iov[..], 0, true, 7) });
        disk.submit();
        let disk = std::thread::spawn(move || {
            assert!(disk.stranded());
            assert!(disk.finished(false).is_empty());
            disk
        })
        .join()
        .unwrap();
        let mut disk = disk;
        assert!(!disk.stranded());
        wr.write_all(&9u64.to_le_bytes()).unwrap();
        assert_eq!(reap_by_eventfd(&mut disk, 1), vec![(7, 8)]);
        assert_eq!(u64::from_le_bytes(*buf), 9);
        // Idle now: another thread may take it over.
        let setup_taken = disk.ring_setup();
        let (disk, got) = std::thread::spawn(move || {
            let mut buf = [0u8; 8];
            let iov = [libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: 8,
            }];
            wr.write_all(&11u64.to_le_bytes()).unwrap();
            // SAFETY: as above, reaped in this closure.
            assert!(unsafe { disk.start(&iov, 0, true, 8) });
            disk.submit();
            let got = reap_by_eventfd(&mut disk, 1);
            assert_eq!(u64::from_le_bytes(buf), 11);
            (disk, got)
        })
        .join()
        .unwrap();
        assert_eq!(got, vec![(8, 8)]);
        assert_eq!(disk.ring_setup(), setup_taken);
    }
}
