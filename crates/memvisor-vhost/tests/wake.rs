//! Wake-ups: a thread that polls its rings keeps the driver's notifications off while it looks
//! and turns them on again before it sleeps, with one more look (`Ring::start_polling`,
//! `Ring::stop_polling`); no request made available in between is lost, whether the driver
//! sees notifications on and kicks or the device sees the request. And a polling thread whose
//! queue goes quiet for longer than its `poll-us` stops polling: it sleeps.

mod common;

use std::sync::atomic::{Ordering, fence};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use memvisor::{DmaConfig, DmaMemory, DmaSpace, Gpa, Iova, Prot, SlotMemory};
use memvisor_vhost::ring::InflightRegion;
use memvisor_vhost::{Blk, BlkOptions, Ring};
use virtio_queue::{Queue, QueueOwnedT, QueueT};

/// A cheap per-thread random number (xorshift), for delays that move each race's window.
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn busy(n: u64) {
    for _ in 0..n {
        std::hint::spin_loop();
    }
}

/// The driver's rule for a kick after publishing `new` (the available index before was
/// `old`): with event indexes, whether `avail_event` lies in `[old, new)`
/// (`vring_need_event`); without, whether the device left `VRING_USED_F_NO_NOTIFY` clear.
fn driver_kicks(g: &Guest, event_idx: bool, old: u16, new: u16) -> bool {
    // The driver's full barrier between publishing and reading the device's wish.
    fence(Ordering::SeqCst);
    if event_idx {
        let event = g.ring.avail_event().unwrap();
        new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
    } else {
        let n = u64::from(RING_SIZE);
        let used = RING_AT + 16 * n + (6 + 2 * n).next_multiple_of(4);
        let mut flags = [0u8; 2];
        g.mem.read(Gpa(used), &mut flags).unwrap();
        u16::from_le_bytes(flags) & 1 == 0
    }
}

/// `rounds` races between a device that stops polling (notifications on, one more look) and a
/// driver that publishes a request at the same moment and kicks only if notifications look
/// on. Returns how many requests neither side noticed: a lost wake-up each.
fn lost_wake_ups(event_idx: bool, rounds: u32) -> u32 {
    let mut g = Guest::new(MIB);
    let mut q = Queue::new(RING_SIZE).unwrap();
    g.ring.configure(&mut q);
    q.set_event_idx(event_idx);
    let mem = SlotMemory::from_table(&g.mem);
    let mut ring = Ring::plain(q);
    let barrier = Arc::new(Barrier::new(2));
    let b = barrier.clone();
    let device = std::thread::spawn(move || {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut late = Vec::with_capacity(rounds as usize);
        for _ in 0..rounds {
            // Polling: what is there is served without re-arming (as a device's pass does
            // while the ring is polled), so the driver's view of `avail_event` grows stale.
            ring.start_polling(&mem);
            assert!(!ring.enable_notification(&mem).unwrap());
            b.wait();
            busy(next(&mut seed) % 400);
            late.push(ring.stop_polling(&mem));
            b.wait();
            // Whoever noticed serves it: the request is taken.
            let avail = ring.avail_idx(&mem, Ordering::Acquire).unwrap();
            ring.set_next_avail(avail.0);
            b.wait();
        }
        late
    });
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut kicked = Vec::with_capacity(rounds as usize);
    let mut idx = 0u16;
    for _ in 0..rounds {
        barrier.wait();
        busy(next(&mut seed) % 400);
        g.ring.publish(0).unwrap();
        kicked.push(driver_kicks(&g, event_idx, idx, idx.wrapping_add(1)));
        idx = idx.wrapping_add(1);
        barrier.wait();
        barrier.wait();
    }
    let late = device.join().unwrap();
    let lost = late
        .iter()
        .zip(&kicked)
        .filter(|&(&late, &kick)| !late && !kick)
        .count() as u32;
    eprintln!(
        "event_idx={event_idx}: {rounds} rounds, seen on the last look {}, kicked {}, lost {lost}",
        late.iter().filter(|&&l| l).count(),
        kicked.iter().filter(|&&k| k).count()
    );
    lost
}

#[test]
fn no_request_made_available_while_polling_stops_is_lost() {
    // 10^5 races in all, with and without event indexes.
    assert_eq!(lost_wake_ups(true, 50_000), 0, "with event indexes");
    assert_eq!(lost_wake_ups(false, 50_000), 0, "without event indexes");
}

/// The state letter of this process's thread named `name` (/proc/self/task/TID/stat).
fn thread_state(name: &str) -> Option<char> {
    for t in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(t.path().join("stat")).ok()?;
        // "TID (COMM) S ...": the state follows the last ')'.
        return stat[stat.rfind(')')? + 1..].trim_start().chars().next();
    }
    None
}

/// Whether the thread named `name` was seen in `state` at least once in `samples` looks over
/// `span`: `R` (running or runnable), or `S` (asleep). A thread that spins is never seen
/// asleep, however busy the machine (preempted, it is still `R`); one that sleeps is seen so at
/// once, or at the next look if it was runnable for a moment: one look alone failed on a
/// loaded machine.
fn seen_in(name: &str, state: char, samples: u32, span: Duration) -> bool {
    (0..samples).any(|_| {
        std::thread::sleep(span / samples);
        thread_state(name) == Some(state)
    })
}

/// Reads sector 0 through the guest's ring (the device's queue 1, on its worker).
fn read_once(g: &mut Guest) {
    const HDR: u64 = 0x10000;
    const DATA: u64 = 0x20000;
    const STATUS: u64 = 0x80000;
    g.add_request(0, 0, 0, HDR, DATA, 4096, STATUS);
    g.kick();
    g.wait_used();
    let mut s = [0u8];
    g.mem.read(Gpa(STATUS), &mut s).unwrap();
    assert_eq!(s[0], 0, "the read failed");
}

#[test]
fn a_polling_worker_whose_queue_goes_quiet_sleeps() {
    // poll-us 1 s: the worker may spin up to a second after work. After its first request it
    // does (the window starts at the maximum). A request that comes after a wait longer than
    // the maximum shows the queue is not busy: the window drops to 0, and 200-600 ms after that
    // request the worker sleeps in poll(2) (a fixed budget would spin a second more).
    let options = BlkOptions {
        queues: 2,
        poll_us: 1_000_000,
        ..BlkOptions::default()
    };
    let (c, t) = serve(Blk::new(memfd(MIB), options).unwrap());
    let mut g = Guest::new(4 * MIB);
    negotiate(&c, &g);
    start_ring_at(&c, &g, 1);
    read_once(&mut g);
    let done = Instant::now();
    assert!(
        seen_in("memvisor-q1", 'R', 10, Duration::from_millis(200)),
        "the worker does not poll after its first request (state {:?})",
        thread_state("memvisor-q1")
    );
    // Past the maximum: the worker went to sleep by itself.
    std::thread::sleep(Duration::from_millis(1300).saturating_sub(done.elapsed()));
    assert!(
        seen_in("memvisor-q1", 'S', 20, Duration::from_millis(400)),
        "still polling 1.3-1.7 s after its first request (state {:?})",
        thread_state("memvisor-q1")
    );
    // Looks from 200 to 600 ms after the next request: a worker that kept a fixed budget
    // would spin through all of them (until 1 s).
    read_once(&mut g);
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        seen_in("memvisor-q1", 'S', 20, Duration::from_millis(400)),
        "200-600 ms after a request that came after a long quiet, the worker still polls (state {:?})",
        thread_state("memvisor-q1")
    );
    drop(c);
    let _ = t.join().unwrap();
}

/// The guest's memory as a device sees it without an IOMMU (device address = guest physical):
/// the view a back end reads and writes its rings through.
fn device_view(g: &Guest) -> DmaMemory {
    let dma = DmaSpace::new(DmaConfig::default()).unwrap();
    dma.map_guest(Iova(0), &g.mem.snapshot(), Gpa(0), g.size, Prot::RW)
        .unwrap();
    dma.memory()
}

/// A ring of the guest's, served by a `Ring` with event indexes, and `n` chains of one
/// buffer each made available and taken by the device; returns the ring and the heads.
fn taken(g: &mut Guest, mem: &DmaMemory, n: u16, log: Option<&InflightRegion>) -> (Ring, Vec<u16>) {
    let mut q = Queue::new(RING_SIZE).unwrap();
    g.ring.configure(&mut q);
    q.set_event_idx(true);
    let mut ring = match log {
        Some(r) => Ring::new(q, Some((r, 0)), mem).unwrap(),
        None => Ring::plain(q),
    };
    for i in 0..n {
        let head = g
            .ring
            .add_inbuf(&[(0x10000 + 0x1000 * u64::from(i), 512)])
            .unwrap();
        g.ring.publish(head).unwrap();
    }
    let mut heads = Vec::new();
    while let Some(chain) = ring.iter(mem).unwrap().next() {
        heads.push(chain.head_index());
    }
    for &h in &heads {
        ring.taken(h);
    }
    assert_eq!(heads.len(), usize::from(n));
    (ring, heads)
}

#[test]
fn a_batch_of_completions_is_published_by_one_index_store_and_asks_for_one_interrupt() {
    let n = 8;
    let mut g = Guest::new(MIB);
    let mem = device_view(&g);
    let (mut ring, heads) = taken(&mut g, &mem, n, None);
    // The driver wants an interrupt once the first chain is back.
    g.ring.set_used_event(0).unwrap();
    let stores = ring.used_index_stores();
    ring.return_batch(
        &mem,
        heads.iter().map(|&h| (h, 100 + u32::from(h))),
        |h, e| panic!("head {h}: {e}"),
    );
    assert_eq!(
        ring.used_index_stores() - stores,
        1,
        "one store for {n} chains"
    );
    assert!(
        ring.needs_notification(&mem).unwrap(),
        "one interrupt for the batch"
    );
    assert!(!ring.needs_notification(&mem).unwrap(), "and no second one");
    // Every chain is back, in order, with its length.
    for &h in &heads {
        assert_eq!(g.ring.get_used().unwrap(), Some((h, 100 + u32::from(h))));
    }
    assert_eq!(g.ring.get_used().unwrap(), None);
    // A batch that does not pass the driver's used_event asks for none; a bad head is
    // refused and the others still go back.
    g.ring.set_used_event(1000).unwrap();
    let (heads2, mut refused) = (
        [
            g.ring.add_inbuf(&[(0x30000, 8)]).unwrap(),
            g.ring.add_inbuf(&[(0x31000, 8)]).unwrap(),
        ],
        Vec::new(),
    );
    for &h in &heads2 {
        g.ring.publish(h).unwrap();
    }
    while ring.iter(&mem).unwrap().next().is_some() {}
    ring.return_batch(
        &mem,
        [(heads2[0], 1), (RING_SIZE, 1), (heads2[1], 2)],
        |h, _| refused.push(h),
    );
    assert_eq!(refused, [RING_SIZE]);
    assert_eq!(ring.used_index_stores() - stores, 2);
    assert!(!ring.needs_notification(&mem).unwrap());
    assert_eq!(g.ring.get_used().unwrap(), Some((heads2[0], 1)));
    assert_eq!(g.ring.get_used().unwrap(), Some((heads2[1], 2)));
}

#[test]
fn with_an_inflight_log_a_batch_goes_back_one_logged_chain_at_a_time() {
    // The log's recovery mends only its last_batch_head: each chain gets its own store, and
    // the log ends with none in flight and its used_idx at the ring's.
    use std::os::unix::fs::FileExt;
    let n = 4;
    let mut g = Guest::new(MIB);
    let mem = device_view(&g);
    let log = InflightRegion::create(1, RING_SIZE).unwrap();
    let (mut ring, heads) = taken(&mut g, &mem, n, Some(&log));
    let file = std::fs::File::from(log.fd().unwrap().try_clone_to_owned().unwrap());
    let byte = |at: u64| {
        let mut b = [0u8; 2];
        file.read_exact_at(&mut b, at).unwrap();
        u16::from_le_bytes(b)
    };
    for &h in &heads {
        assert_eq!(byte(16 + 16 * u64::from(h)) & 0xff, 1, "head {h} in flight");
    }
    let stores = ring.used_index_stores();
    ring.add_used_batch(&mem, heads.iter().map(|&h| (h, 0)), |h, e| {
        panic!("{h}: {e}")
    });
    assert_eq!(ring.used_index_stores() - stores, u64::from(n));
    for &h in &heads {
        assert_eq!(
            byte(16 + 16 * u64::from(h)) & 0xff,
            0,
            "head {h} still in flight"
        );
    }
    assert_eq!(byte(14), n, "the log's used_idx");
    assert_eq!(byte(12), *heads.last().unwrap(), "last_batch_head");
}
