//! The virtio-balloon reporting queue, driven by a guest-side driver that behaves like Linux's
//! (`driver.rs`): reports end to end with a device thread — checked by what the kernel says is
//! resident and by the bytes read back — and every kind of malformed queue input, including a
//! model test over random mixes of good and bad chains.
//!
//! Tests here measure resident memory, so they run one at a time (`serial()`).
#![cfg(feature = "virtio-balloon")]

use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread;

use memvisor::balloon::{
    Balloon, CONFIG_SIZE, ChainError, VIRTIO_BALLOON_F_PAGE_POISON, VIRTIO_BALLOON_F_REPORTING,
    VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX,
};
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor::{
    Backing, BackingKind, DiscardOptions, DmaConfig, DmaSpace, Gpa, Iova, Prot, RejectReason,
    SlotSpace, SlotSpec, SlotTable,
};
use proptest::prelude::*;

#[path = "../common/mod.rs"]
mod common;
mod driver;
#[path = "../../examples/balloon.rs"]
mod example;

use driver::Reporter;
use memvisor_testkit::guest_ring::{Desc, GuestRing, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;
/// The ring's slot: 64 KiB at guest address 0.
const RING: u64 = 0;
/// Guest RAM starts here, so guest and host offsets differ.
const BASE: u64 = 1 << 30;
const QUEUE: u16 = 64;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The nonzero byte RAM page `page` is filled with.
fn pattern(page: u64) -> u8 {
    (page * 7 % 255 + 1) as u8
}

/// A guest: the ring's slot, and `size` bytes of `kind` RAM at `BASE`, every page filled.
struct Guest {
    table: SlotTable,
    ram: Arc<Backing>,
    registry: Arc<PinRegistry>,
}

impl Guest {
    fn new(kind: BackingKind, size: u64) -> Guest {
        let table = SlotTable::new();
        let ring = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 * 1024).unwrap());
        table.insert(SlotSpec::new(0, Gpa(RING), ring)).unwrap();
        let ram = Arc::new(Backing::new(kind, size).unwrap());
        for p in 0..size / PAGE {
            ram.write(p * PAGE, &[pattern(p); PAGE as usize]).unwrap();
        }
        table
            .insert(SlotSpec::new(1, Gpa(BASE), ram.clone()))
            .unwrap();
        Guest {
            table,
            ram,
            registry: PinRegistry::new(LockLimit::Unlimited),
        }
    }

    /// A negotiated device and the driver's ring, configured.
    fn device(&self, features: u64) -> (Balloon, GuestRing) {
        let mut dev = Balloon::new(
            SlotSpace::new(self.table.clone()),
            DiscardOptions {
                registry: Some(self.registry.clone()),
                ..DiscardOptions::default()
            },
            QUEUE,
        )
        .unwrap();
        dev.ack_features(features).unwrap();
        let ring = GuestRing::new(&self.table, Gpa(RING), QUEUE).unwrap();
        ring.configure(dev.queue_mut());
        (dev, ring)
    }

    fn page(&self, p: u64) -> Vec<u8> {
        let mut buf = vec![0u8; PAGE as usize];
        self.ram.read(p * PAGE, &mut buf).unwrap();
        buf
    }

    /// RAM pages that no longer hold their pattern.
    fn changed(&self) -> Vec<u64> {
        (0..self.ram.size() / PAGE)
            .filter(|&p| self.page(p) != [pattern(p); PAGE as usize])
            .collect()
    }

    /// Resident bytes of RAM: smaps' Rss for anonymous memory, allocated blocks for a memfd.
    fn resident(&self) -> u64 {
        match self.ram.fd() {
            Some(fd) => {
                // SAFETY: fstat writes one struct stat we own; the fd lives as long as `ram`.
                unsafe {
                    let mut st: libc::stat = std::mem::zeroed();
                    assert_eq!(libc::fstat(fd.as_raw_fd(), &mut st), 0);
                    st.st_blocks as u64 * 512
                }
            }
            None => {
                let start = self.ram.hva().0;
                common::smaps_sum(start, start + self.ram.size(), "Rss")
            }
        }
    }
}

const FEATURES: u64 = 1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BALLOON_F_REPORTING;

/// RAM page index of guest address `gpa`.
fn page_of(gpa: u64) -> u64 {
    (gpa - BASE) / PAGE
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Fill guest RAM, pin some pages through a device, free most 2 MiB blocks, report them the way
/// Linux does with the device on its own thread, and check the host side: resident memory fell
/// by exactly what was discarded, pinned pages kept their bytes, freed pages read as zeros (and
/// come back as fresh pages when touched), everything else kept its bytes.
fn end_to_end(kind: BackingKind) {
    let _s = serial();
    let size = 256 * MIB;
    let g = Guest::new(kind, size);
    let (mut dev, ring) = g.device(FEATURES);

    // The guest frees 2 MiB blocks: all but every fifth, so buddies merge into 4 MiB blocks and
    // lone 2 MiB blocks remain.
    let free_2m: Vec<u64> = (0..size / (2 * MIB)).filter(|i| i % 5 != 2).collect();
    let blocks = driver::buddy_blocks(BASE, &free_2m, 10);
    let reported: u64 = blocks.iter().map(|b| b.1).sum();
    assert!(blocks.iter().any(|b| b.1 == 4 * MIB) && blocks.iter().any(|b| b.1 == 2 * MIB));
    assert!(
        blocks.len() > driver::REPORT_CAPACITY,
        "needs several reports"
    );

    // A device holds pins on scattered pages and a 16-page run inside freed blocks (a buggy or
    // malicious guest reporting memory under DMA), and on a page outside them.
    let dma = DmaSpace::new(DmaConfig {
        registry: Some(g.registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    dma.map_backing(Iova(0), &g.ram, 0, size, Prot::RW).unwrap();
    let pinned: Vec<u64> = [3u64, 700, 4097, 20_000]
        .into_iter()
        .chain(9000..9016)
        .chain([page_of(BASE + 4 * MIB + 5 * PAGE)])
        .collect();
    dma.pin_pages(&pinned, Prot::RW).unwrap();
    let in_freed = |p: u64| {
        let gpa = BASE + p * PAGE;
        blocks.iter().any(|&(s, l)| gpa >= s.0 && gpa < s.0 + l)
    };
    let pinned_in_freed = pinned.iter().filter(|&&p| in_freed(p)).count() as u64;
    assert!(pinned_in_freed > 0 && pinned_in_freed < pinned.len() as u64);
    let sums: Vec<u64> = pinned.iter().map(|&p| fnv(&g.page(p))).collect();

    let before = g.resident();
    assert_eq!(before, size);

    let (doorbell, rung) = mpsc::channel::<()>();
    let (irq, irq_rx) = mpsc::channel::<()>();
    let device = thread::spawn(move || {
        for () in rung {
            let done = dev.process_queue().expect("queue works");
            for c in &done.chains {
                assert!(c.result.is_ok(), "{c:?}");
            }
            if done.notify {
                let _ = irq.send(());
            }
        }
        dev
    });
    let mut reporter = Reporter {
        ring,
        doorbell,
        irq: irq_rx,
    };
    let reports = reporter.report(&blocks);
    drop(reporter);
    let dev = device.join().unwrap();

    assert_eq!(reports, blocks.len().div_ceil(driver::REPORT_CAPACITY));
    let stats = dev.stats();
    assert_eq!(stats.chains, reports as u64);
    assert_eq!(stats.refused_chains, 0);
    assert_eq!(stats.skipped_pinned, pinned_in_freed * PAGE);
    assert_eq!(stats.discarded + stats.skipped_pinned, reported);
    assert_eq!(stats.rejected, 0);
    assert_eq!(
        before - g.resident(),
        stats.discarded,
        "resident memory fell by what was discarded"
    );

    // The guest reuses a freed page: a write brings one fresh page back. (Done before the
    // read-back below: reading a hole of a memfd allocates a page, as any shmem read fault does.)
    let after = g.resident();
    let reused = (BASE + size - 4 * MIB..BASE + size)
        .step_by(PAGE as usize)
        .find(|&a| in_freed(page_of(a)))
        .expect("a freed page near the top");
    g.table.write(Gpa(reused), &[0x5a; 8]).unwrap();
    assert_eq!(g.resident(), after + PAGE);

    for (&p, &sum) in pinned.iter().zip(&sums) {
        assert_eq!(fnv(&g.page(p)), sum, "pinned page {p} changed");
    }
    let zero = vec![0u8; PAGE as usize];
    let mut reused_page = zero.clone();
    reused_page[..8].fill(0x5a);
    for p in 0..size / PAGE {
        let got = g.page(p);
        if p == page_of(reused) {
            assert!(got == reused_page, "reused page {p} lost its write");
        } else if in_freed(p) && !pinned.contains(&p) {
            assert!(got == zero, "freed page {p} does not read as zeros");
        } else {
            assert!(got == [pattern(p); PAGE as usize], "page {p} changed");
        }
    }

    dma.unpin_pages(&pinned).unwrap();
}

#[test]
fn linux_like_reports_free_private_anonymous_memory() {
    end_to_end(BackingKind::PrivateAnon);
}

#[test]
fn linux_like_reports_free_memfd_memory() {
    end_to_end(BackingKind::Memfd);
}

/// Reports RAM block `i` of 2 MiB alone and returns what the device did with it.
fn report_block(dev: &mut Balloon, ring: &mut GuestRing, i: u64) -> memvisor::ReportOutcome {
    let head = good(ring, i);
    ring.publish(head).unwrap();
    let mut done = dev.process_queue().unwrap();
    assert_eq!(done.chains.len(), 1);
    done.chains.remove(0).result.unwrap()
}

/// A valid one-buffer chain over RAM block `i` of 2 MiB.
fn good(ring: &mut GuestRing, i: u64) -> u16 {
    ring.add_inbuf(&[(BASE + i * 2 * MIB, 2 * MIB as u32)])
        .unwrap()
}

fn w(addr: u64, len: u64) -> Desc {
    Desc {
        addr,
        len: len as u32,
        flags: VRING_DESC_F_WRITE,
        next: 0,
    }
}

/// Links `descs` at `ids` into one chain (NEXT flags and next indexes).
fn linked(ids: &[u16], mut descs: Vec<Desc>) -> Vec<Desc> {
    for i in 0..descs.len() - 1 {
        descs[i].flags |= VRING_DESC_F_NEXT;
        descs[i].next = ids[i + 1];
    }
    descs
}

#[test]
fn malformed_chains_are_refused_whole_and_the_device_goes_on() {
    let _s = serial();
    // RAM: 8 MiB at BASE; nothing at BASE + 8 MiB.
    let end = BASE + 8 * MIB;
    let ok = w(BASE, 2 * MIB);
    type Case = (&'static str, Vec<u16>, Vec<Desc>, ChainError);
    let cases: Vec<Case> = vec![
        (
            "driver-readable buffer",
            vec![10, 11],
            linked(
                &[10, 11],
                vec![
                    ok,
                    Desc {
                        flags: 0,
                        ..w(BASE + 2 * MIB, 2 * MIB)
                    },
                ],
            ),
            ChainError::DriverReadable {
                index: 1,
                addr: BASE + 2 * MIB,
                len: 2 * MIB as u32,
            },
        ),
        (
            "length not a page multiple",
            vec![10, 11],
            linked(&[10, 11], vec![ok, w(BASE + 2 * MIB, 2 * MIB - 512)]),
            ChainError::NotWholePages {
                index: 1,
                addr: BASE + 2 * MIB,
                len: (2 * MIB - 512) as u32,
            },
        ),
        (
            "address not page aligned",
            vec![10],
            vec![w(BASE + 100, PAGE)],
            ChainError::NotWholePages {
                index: 0,
                addr: BASE + 100,
                len: PAGE as u32,
            },
        ),
        (
            "empty buffer",
            vec![10],
            vec![w(BASE, 0)],
            ChainError::NotWholePages {
                index: 0,
                addr: BASE,
                len: 0,
            },
        ),
        (
            "buffer past the end of guest memory",
            vec![10, 11],
            linked(&[10, 11], vec![ok, w(end - MIB, 2 * MIB)]),
            ChainError::OutsideGuestMemory {
                index: 1,
                addr: end - MIB,
                len: 2 * MIB as u32,
            },
        ),
        (
            "buffer in no slot at all",
            vec![10],
            vec![w(1 << 40, 2 * MIB)],
            ChainError::OutsideGuestMemory {
                index: 0,
                addr: 1 << 40,
                len: 2 * MIB as u32,
            },
        ),
        (
            "chain longer than the queue (a loop)",
            vec![10, 11],
            vec![
                Desc {
                    flags: VRING_DESC_F_WRITE | VRING_DESC_F_NEXT,
                    next: 11,
                    ..ok
                },
                Desc {
                    flags: VRING_DESC_F_WRITE | VRING_DESC_F_NEXT,
                    next: 10,
                    ..w(BASE + 2 * MIB, PAGE)
                },
            ],
            ChainError::TooLong { queue_size: QUEUE },
        ),
        (
            "link past the descriptor table",
            vec![10],
            vec![Desc {
                flags: VRING_DESC_F_WRITE | VRING_DESC_F_NEXT,
                next: QUEUE + 7,
                ..ok
            }],
            ChainError::BrokenLink {
                index: 0,
                next: QUEUE + 7,
            },
        ),
    ];
    for (what, ids, descs, want) in cases {
        let g = Guest::new(BackingKind::PrivateAnon, 8 * MIB);
        let (mut dev, mut ring) = g.device(FEATURES);
        let bad = ring.add_raw(&ids, &descs).unwrap();
        ring.publish(bad).unwrap();
        let after = good(&mut ring, 3);
        ring.publish(after).unwrap();
        let done = dev.process_queue().unwrap();
        assert_eq!(done.chains.len(), 2, "{what}");
        assert_eq!(done.chains[0].head, bad);
        assert_eq!(done.chains[0].result, Err(want), "{what}");
        let second = done.chains[1].result.as_ref().unwrap();
        assert_eq!(
            second.discarded,
            2 * MIB,
            "{what}: the next chain still works"
        );
        assert!(done.notify);
        // Only the good chain's block changed; the bad chain's valid buffers did not.
        let block3: Vec<u64> = (3 * 512..4 * 512).collect();
        assert_eq!(g.changed(), block3, "{what}");
        // Both chains came back, the bad one first.
        assert_eq!(ring.get_used().unwrap(), Some((bad, 0)), "{what}");
        assert_eq!(ring.get_used().unwrap(), Some((after, 0)), "{what}");
        let stats = dev.stats();
        assert_eq!((stats.chains, stats.refused_chains), (2, 1), "{what}");
    }
}

#[test]
fn example_runs() {
    let _s = serial();
    example::main().unwrap();
}

#[test]
fn indirect_tables_are_followed_and_checked_like_any_chain() {
    let _s = serial();
    const VRING_DESC_F_INDIRECT: u16 = 4;
    let g = Guest::new(BackingKind::PrivateAnon, 8 * MIB);
    let (mut dev, mut ring) = g.device(FEATURES);
    // Two tables of two descriptors in the ring's slot, past the ring itself.
    let tables = [RING + 0x8000, RING + 0x9000];
    let entries = |table: u64, second_flags: u16| {
        let mut raw = Vec::new();
        for (addr, flags, next) in [
            (BASE, VRING_DESC_F_WRITE | VRING_DESC_F_NEXT, 1u16),
            (BASE + 2 * MIB, second_flags, 0),
        ] {
            raw.extend_from_slice(&addr.to_le_bytes());
            raw.extend_from_slice(&(2 * MIB as u32).to_le_bytes());
            raw.extend_from_slice(&flags.to_le_bytes());
            raw.extend_from_slice(&next.to_le_bytes());
        }
        g.table.write(Gpa(table), &raw).unwrap();
    };
    // The first table's second buffer is driver-readable: refused whole.
    entries(tables[0], 0);
    entries(tables[1], VRING_DESC_F_WRITE);
    for (id, table) in [(20u16, tables[0]), (21, tables[1])] {
        let indirect = Desc {
            addr: table,
            len: 32,
            flags: VRING_DESC_F_INDIRECT,
            next: 0,
        };
        let head = ring.add_raw(&[id], &[indirect]).unwrap();
        ring.publish(head).unwrap();
    }
    let done = dev.process_queue().unwrap();
    assert_eq!(
        done.chains[0].result,
        Err(ChainError::DriverReadable {
            index: 1,
            addr: BASE + 2 * MIB,
            len: 2 * MIB as u32
        })
    );
    assert_eq!(done.chains[1].result.as_ref().unwrap().discarded, 4 * MIB);
    assert_eq!(g.changed(), (0..1024).collect::<Vec<u64>>());
}

#[test]
fn a_head_outside_the_table_is_skipped() {
    let _s = serial();
    let g = Guest::new(BackingKind::PrivateAnon, 8 * MIB);
    let (mut dev, mut ring) = g.device(FEATURES);
    ring.publish(QUEUE + 3).unwrap();
    let after = good(&mut ring, 1);
    ring.publish(after).unwrap();
    let done = dev.process_queue().unwrap();
    assert_eq!(
        done.chains[0].result,
        Err(ChainError::NoDescriptors {
            head: QUEUE + 3,
            queue_size: QUEUE
        })
    );
    assert_eq!(done.chains[1].result.as_ref().unwrap().discarded, 2 * MIB);
    // No used entry can name a head outside the table: only the good chain comes back.
    assert_eq!(ring.get_used().unwrap(), Some((after, 0)));
    assert_eq!(ring.get_used().unwrap(), None);
}

#[test]
fn a_corrupt_available_index_breaks_the_device_until_reset() {
    let _s = serial();
    let g = Guest::new(BackingKind::PrivateAnon, 8 * MIB);
    let (mut dev, mut ring) = g.device(FEATURES);
    let head = good(&mut ring, 0);
    ring.publish(head).unwrap();
    // The driver claims more entries than the queue has.
    ring.set_avail_idx(QUEUE + 5).unwrap();
    let e = dev.process_queue().unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("reset"), "{e}");
    assert!(dev.process_queue().is_err(), "stays broken");
    assert_eq!(g.changed(), Vec::<u64>::new(), "nothing was discarded");

    dev.reset();
    dev.ack_features(FEATURES).unwrap();
    let mut ring = GuestRing::new(&g.table, Gpa(RING), QUEUE).unwrap();
    ring.configure(dev.queue_mut());
    let head = good(&mut ring, 2);
    ring.publish(head).unwrap();
    let done = dev.process_queue().unwrap();
    assert_eq!(done.chains[0].result.as_ref().unwrap().discarded, 2 * MIB);
}

#[test]
fn an_unusable_queue_is_an_error() {
    let _s = serial();
    let g = Guest::new(BackingKind::PrivateAnon, 4 * MIB);
    let mut dev = Balloon::new(
        SlotSpace::new(g.table.clone()),
        DiscardOptions::default(),
        QUEUE,
    )
    .unwrap();
    // Reporting not negotiated.
    let e = dev.process_queue().unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("VIRTIO_BALLOON_F_REPORTING"), "{e}");
    dev.ack_features(FEATURES).unwrap();
    // Not ready.
    let e = dev.process_queue().unwrap_err();
    assert!(e.to_string().contains("ready=false"), "{e}");
    // Rings outside guest memory.
    let ring = GuestRing::new(&g.table, Gpa(RING), QUEUE).unwrap();
    ring.configure(dev.queue_mut());
    use memvisor::balloon::virtio_queue::QueueT;
    dev.queue_mut()
        .set_used_ring_address(Some(0x1000_0000), Some(0));
    let e = dev.process_queue().unwrap_err();
    assert!(e.to_string().contains("0x10000000"), "{e}");
    assert_eq!(g.changed(), Vec::<u64>::new());
}

#[test]
fn queue_sizes_and_features_are_checked() {
    let g = Guest::new(BackingKind::PrivateAnon, 2 * MIB);
    let space = SlotSpace::new(g.table.clone());
    for bad in [0u16, 3, 48] {
        let e = Balloon::new(space.clone(), DiscardOptions::default(), bad).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(e.to_string().contains(&bad.to_string()), "{e}");
    }
    let mut dev = Balloon::new(space, DiscardOptions::default(), QUEUE).unwrap();
    let offered = dev.device_features();
    assert_ne!(offered & 1 << VIRTIO_BALLOON_F_REPORTING, 0);
    // Free page hinting (bit 3) is not offered.
    let e = dev.ack_features(FEATURES | 1 << 3).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(e.to_string().contains("0x8"), "{e}");
    let e = dev
        .ack_features(1 << VIRTIO_BALLOON_F_REPORTING)
        .unwrap_err();
    assert!(e.to_string().contains("VERSION_1"), "{e}");
    dev.ack_features(FEATURES).unwrap();
    assert_eq!(dev.acked_features(), FEATURES);
}

#[test]
fn config_space_lets_the_driver_write_only_actual_and_poison_val() {
    let g = Guest::new(BackingKind::PrivateAnon, 2 * MIB);
    let mut dev = Balloon::new(
        SlotSpace::new(g.table.clone()),
        DiscardOptions::default(),
        QUEUE,
    )
    .unwrap();
    dev.write_config(0, &[0xff; CONFIG_SIZE as usize]);
    let mut c = [0u8; CONFIG_SIZE as usize + 4];
    dev.read_config(0, &mut c);
    assert_eq!(&c[..4], &[0; 4], "num_pages is the device's");
    assert_eq!(&c[4..8], &[0xff; 4], "actual");
    assert_eq!(&c[8..12], &[0; 4], "free_page_hint_cmd_id is the device's");
    assert_eq!(&c[12..16], &[0xff; 4], "poison_val");
    assert_eq!(&c[16..], &[0; 4], "past the end reads zero");
    let mut tail = [1u8; 2];
    dev.read_config(u64::MAX, &mut tail);
    assert_eq!(tail, [0, 0]);
}

#[test]
fn event_indexes_suppress_interrupts_the_driver_does_not_want() {
    let _s = serial();
    let g = Guest::new(BackingKind::PrivateAnon, 8 * MIB);
    let (mut dev, mut ring) = g.device(FEATURES | 1 << VIRTIO_RING_F_EVENT_IDX);
    // Interrupt me after the used index passes 2: the first two returns stay quiet.
    ring.set_used_event(2).unwrap();
    for (block, want) in [(0, false), (1, false), (2, true)] {
        let head = good(&mut ring, block);
        ring.publish(head).unwrap();
        let done = dev.process_queue().unwrap();
        assert_eq!(done.chains.len(), 1);
        assert_eq!(done.notify, want, "return {block}");
        assert_eq!(ring.get_used().unwrap(), Some((head, 0)));
        // And the driver is told to kick for the next chain: without avail_event moving on,
        // Linux stops kicking after its first chain (found with a real guest).
        assert_eq!(ring.avail_event().unwrap(), block as u16 + 1, "avail_event");
    }
    // Nothing returned: nothing to say.
    assert!(!dev.process_queue().unwrap().notify);
}

#[test]
fn page_poison_stops_discards_only_when_negotiated() {
    let _s = serial();
    let g = Guest::new(BackingKind::PrivateAnon, 8 * MIB);
    let poison = 0xaaaa_aaaau32;

    // Negotiated and non-zero: nothing discarded, every byte refused with the value.
    let (mut dev, mut ring) = g.device(FEATURES | 1 << VIRTIO_BALLOON_F_PAGE_POISON);
    dev.write_config(12, &poison.to_le_bytes());
    let out = report_block(&mut dev, &mut ring, 0);
    assert_eq!(out.discarded, 0);
    assert_eq!(out.rejected.len(), 1);
    assert_eq!(
        out.rejected[0].reason,
        RejectReason::PagePoison { value: poison }
    );
    assert_eq!(out.rejected_bytes(), 2 * MIB);
    assert_eq!(g.changed(), Vec::<u64>::new());

    // A zero poison value (Linux with init_on_free): freed pages are zeros anyway.
    dev.write_config(12, &[0; 4]);
    let out = report_block(&mut dev, &mut ring, 1);
    assert_eq!(out.discarded, 2 * MIB);

    // Written without the feature: the value does not count.
    let (mut dev, mut ring) = g.device(FEATURES);
    dev.write_config(12, &poison.to_le_bytes());
    let out = report_block(&mut dev, &mut ring, 2);
    assert_eq!(out.discarded, 2 * MIB);
}

/// One chain the model test puts on the queue: buffers as (first page, pages), and a defect.
#[derive(Clone, Debug)]
struct ModelChain {
    bufs: Vec<(u64, u64)>,
    defect: Option<(Defect, usize)>,
}

#[derive(Clone, Copy, Debug)]
enum Defect {
    Readable,
    OddLength,
    Misaligned,
    Outside,
    Loop,
    BrokenLink,
}

const MODEL_PAGES: u64 = 256;

fn model_chain() -> impl Strategy<Value = ModelChain> {
    let buf = (0..MODEL_PAGES).prop_flat_map(|p| (Just(p), 1..=(MODEL_PAGES - p).min(16)));
    let defect = prop_oneof![
        3 => Just(None),
        1 => (
            prop_oneof![
                Just(Defect::Readable),
                Just(Defect::OddLength),
                Just(Defect::Misaligned),
                Just(Defect::Outside),
                Just(Defect::Loop),
                Just(Defect::BrokenLink),
            ],
            0usize..4
        )
            .prop_map(Some),
    ];
    (proptest::collection::vec(buf, 1..4), defect).prop_map(|(bufs, defect)| ModelChain {
        defect: defect.map(|(d, at)| (d, at % bufs.len())),
        bufs,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Random mixes of good chains and chains with one defect: exactly the good chains' pages are
    /// discarded, every chain comes back in order, and the device never fails.
    #[test]
    fn only_good_chains_are_discarded(chains in proptest::collection::vec(model_chain(), 1..8)) {
        let _s = serial();
        let g = Guest::new(BackingKind::PrivateAnon, MODEL_PAGES * PAGE);
        let (mut dev, mut ring) = g.device(FEATURES);
        let mut want_zero = std::collections::BTreeSet::new();
        let mut want_bytes = 0;
        let mut heads = Vec::new();
        let mut next_id = 0u16;
        for c in &chains {
            let ids: Vec<u16> = (next_id..next_id + c.bufs.len() as u16).collect();
            next_id += c.bufs.len() as u16;
            let mut descs: Vec<Desc> = c
                .bufs
                .iter()
                .map(|&(p, n)| w(BASE + p * PAGE, n * PAGE))
                .collect();
            descs = linked(&ids, descs);
            match c.defect {
                None => {
                    want_zero.extend(c.bufs.iter().flat_map(|&(p, n)| p..p + n));
                    // Each report discards what it names, overlaps again.
                    want_bytes += c.bufs.iter().map(|&(_, n)| n * PAGE).sum::<u64>();
                }
                Some((d, at)) => {
                    let x = &mut descs[at];
                    match d {
                        Defect::Readable => x.flags &= !VRING_DESC_F_WRITE,
                        Defect::OddLength => x.len -= 8,
                        Defect::Misaligned => x.addr += 8,
                        Defect::Outside => x.addr = BASE + MODEL_PAGES * PAGE - PAGE,
                        Defect::Loop => {
                            x.flags |= VRING_DESC_F_NEXT;
                            x.next = ids[0];
                        }
                        Defect::BrokenLink => {
                            x.flags |= VRING_DESC_F_NEXT;
                            x.next = QUEUE;
                        }
                    }
                    // An out-of-memory buffer of one page would still fit: make it two.
                    if matches!(d, Defect::Outside) {
                        x.len = 2 * PAGE as u32;
                    }
                }
            }
            let head = ring.add_raw(&ids, &descs).unwrap();
            ring.publish(head).unwrap();
            heads.push(head);
        }
        let done = dev.process_queue().unwrap();
        prop_assert_eq!(done.chains.len(), chains.len());
        for (c, r) in chains.iter().zip(&done.chains) {
            prop_assert_eq!(c.defect.is_none(), r.result.is_ok(), "{:?} -> {:?}", c, r);
        }
        let got: std::collections::BTreeSet<u64> = g.changed().into_iter().collect();
        prop_assert_eq!(&got, &want_zero);
        for &p in &got {
            prop_assert!(g.page(p) == vec![0u8; PAGE as usize]);
        }
        for &h in &heads {
            prop_assert_eq!(ring.get_used().unwrap(), Some((h, 0)));
        }
        prop_assert_eq!(dev.stats().discarded, want_bytes);
    }
}

#[test]
fn a_ring_placed_at_the_top_of_guest_addresses_is_refused() {
    let table = SlotTable::new();
    for at in [u64::MAX - 15, u64::MAX - 4095, (u64::MAX - 1000) / 16 * 16] {
        let e = GuestRing::new(&table, Gpa(at), 256).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{e}");
    }
}

/// Inflate: the driver hands over page frames; the device discards them (pins hold) and returns
/// the chain; deflate counts them back. Frame lists that are device-writable, not whole 4-byte
/// entries, outside guest memory or too long are refused whole and nothing is discarded.
#[test]
fn inflate_discards_the_frames_given_and_deflate_takes_them_back() {
    use memvisor::balloon::MAX_PFNS_PER_CHAIN;
    let _s = serial();
    let size = 16 * MIB;
    let g = Guest::new(BackingKind::Memfd, size);
    let (mut dev, _) = g.device(FEATURES);
    dev.set_target_pages(1024);
    let mut cfg = [0u8; 4];
    dev.read_config(0, &mut cfg);
    assert_eq!(u32::from_le_bytes(cfg), 1024, "num_pages is the target");

    // Inflate and deflate queues of our own, in the ring slot after the first ring.
    use memvisor::balloon::virtio_queue::QueueT;
    let mut q = memvisor::balloon::virtio_queue::Queue::new(QUEUE).unwrap();
    let mut ring = GuestRing::new(&g.table, Gpa(RING + 16 * 1024), QUEUE).unwrap();
    ring.configure(&mut q);
    let dma = DmaSpace::new(DmaConfig {
        registry: Some(g.registry.clone()),
        ..DmaConfig::default()
    })
    .unwrap();
    dma.map_backing(Iova(0), &g.ram, 0, size, Prot::RW).unwrap();
    dma.pin_pages(&[10], Prot::RW).unwrap();

    // Frames of pages 8..16 of RAM (page 10 pinned), in a buffer in the ring slot.
    let list = RING + 48 * 1024;
    let frames: Vec<u8> = (8u32..16)
        .flat_map(|p| ((BASE / PAGE) as u32 + p).to_le_bytes())
        .collect();
    g.table.write(Gpa(list), &frames).unwrap();
    let before = g.resident();
    let send = |ring: &mut GuestRing, d: Desc| {
        let head = ring.add_raw(&[0], &[d]).unwrap();
        ring.publish(head).unwrap();
    };
    send(
        &mut ring,
        Desc {
            addr: list,
            len: 32,
            flags: 0,
            next: 0,
        },
    );
    assert!(
        dev.process_inflate(&mut q).unwrap(),
        "the driver is notified"
    );
    assert_eq!(ring.get_used().unwrap(), Some((0, 0)));
    let s = dev.stats();
    assert_eq!(
        (s.inflated_pages, s.discarded, s.skipped_pinned),
        (8, 7 * PAGE, PAGE)
    );
    assert_eq!(before - g.resident(), 7 * PAGE);
    assert_eq!(
        g.changed(),
        vec![8, 9, 11, 12, 13, 14, 15],
        "exactly the unpinned frames"
    );

    // Refused whole: nothing more is discarded.
    let resident = g.resident();
    let bad = [
        Desc {
            addr: list,
            len: 32,
            flags: VRING_DESC_F_WRITE,
            next: 0,
        },
        Desc {
            addr: list,
            len: 30,
            flags: 0,
            next: 0,
        },
        Desc {
            addr: 64 * 1024 * MIB,
            len: 32,
            flags: 0,
            next: 0,
        },
        Desc {
            addr: list,
            len: (MAX_PFNS_PER_CHAIN as u32 + 1) * 4,
            flags: 0,
            next: 0,
        },
        Desc {
            addr: list,
            len: !3,
            flags: 0,
            next: 0,
        },
    ];
    for d in bad {
        send(&mut ring, d);
        dev.process_inflate(&mut q).unwrap();
        assert_eq!(ring.get_used().unwrap(), Some((0, 0)), "{d:?} not returned");
    }
    assert_eq!(dev.stats().refused_chains, bad.len() as u64);
    assert_eq!(dev.stats().inflated_pages, 8);
    assert_eq!(g.resident(), resident);

    // Deflate counts the frames and discards nothing.
    send(
        &mut ring,
        Desc {
            addr: list,
            len: 32,
            flags: 0,
            next: 0,
        },
    );
    dev.process_deflate(&mut q).unwrap();
    assert_eq!(dev.stats().deflated_pages, 8);
    assert_eq!(g.resident(), resident);
    dma.unpin_pages(&[10]).unwrap();
}

/// The statistics queue: the queue numbers follow the negotiated features; the driver's primed
/// buffer is parsed and held; `request_stats` returns it; the next buffer's figures replace the
/// old ones. Buffers that are device-writable, outside guest memory, cut short or of an odd
/// length are refused (counted, the figures from before kept) and still held, so the exchange
/// goes on; unknown tags are skipped.
#[test]
fn statistics_are_parsed_held_and_asked_for_again() {
    use memvisor::balloon::stats::{FREE_MEMORY, TOTAL_MEMORY};
    use memvisor::balloon::virtio_queue::QueueT;
    use memvisor::balloon::{QueueKind, VIRTIO_BALLOON_F_STATS_VQ};
    let _s = serial();
    let g = Guest::new(BackingKind::PrivateAnon, 2 * MIB);
    let (dev, _) = g.device(FEATURES);
    assert_eq!(dev.queue_kind(2), Some(QueueKind::Reporting));
    assert_eq!(dev.queue_kind(3), None);
    let mut q = memvisor::balloon::virtio_queue::Queue::new(QUEUE).unwrap();
    let mut ring = GuestRing::new(&g.table, Gpa(RING + 16 * 1024), QUEUE).unwrap();
    ring.configure(&mut q);
    let mut no_stats = dev;
    let e = no_stats.process_stats(&mut q).unwrap_err();
    assert_eq!(e.errno(), libc::EINVAL, "{e}");

    let (mut dev, _) = g.device(FEATURES | 1 << VIRTIO_BALLOON_F_STATS_VQ);
    assert_eq!(dev.queue_kind(0), Some(QueueKind::Inflate));
    assert_eq!(dev.queue_kind(1), Some(QueueKind::Deflate));
    assert_eq!(dev.queue_kind(2), Some(QueueKind::Stats));
    assert_eq!(dev.queue_kind(3), Some(QueueKind::Reporting));
    assert_eq!(dev.queue_kind(4), None);
    let buf = RING + 48 * 1024;
    let write_stats = |entries: &[(u16, u64)]| {
        let bytes: Vec<u8> = entries
            .iter()
            .flat_map(|&(t, v)| [t.to_le_bytes().to_vec(), v.to_le_bytes().to_vec()].concat())
            .collect();
        g.table.write(Gpa(buf), &bytes).unwrap();
        bytes.len() as u32
    };
    let mut next_id = 0u16;
    let mut send = |ring: &mut GuestRing, len: u32, flags: u16, addr: u64| {
        let id = next_id;
        next_id = (next_id + 1) % QUEUE;
        let head = ring
            .add_raw(
                &[id],
                &[Desc {
                    addr,
                    len,
                    flags,
                    next: 0,
                }],
            )
            .unwrap();
        ring.publish(head).unwrap();
        head
    };

    // The primed buffer: parsed and held, nothing returned yet.
    let len = write_stats(&[(FREE_MEMORY, 100 * MIB), (TOTAL_MEMORY, 1 << 30), (99, 1)]);
    let first = send(&mut ring, len, 0, buf);
    assert!(!dev.process_stats(&mut q).unwrap(), "nothing to return yet");
    assert_eq!(
        ring.get_used().unwrap(),
        None,
        "the device holds the buffer"
    );
    let u = dev.guest_stats().unwrap();
    assert_eq!(
        (u.stats.get(FREE_MEMORY), u.stats.get(TOTAL_MEMORY), u.count),
        (Some(100 * MIB), Some(1 << 30), 1)
    );
    assert_eq!(u.stats.unknown_tags, 1);
    assert!(dev.stats_held_since().is_some());

    // Asking for fresh figures returns it; with none held there is nothing to do.
    assert!(dev.request_stats(&mut q).unwrap());
    assert_eq!(ring.get_used().unwrap(), Some((first, 0)));
    assert!(dev.stats_held_since().is_none());
    assert!(!dev.request_stats(&mut q).unwrap());

    // The driver's answer replaces the figures.
    let len = write_stats(&[(FREE_MEMORY, 60 * MIB), (TOTAL_MEMORY, 1 << 30)]);
    let mut held = send(&mut ring, len, 0, buf);
    dev.process_stats(&mut q).unwrap();
    let u = dev.guest_stats().unwrap();
    assert_eq!((u.stats.get(FREE_MEMORY), u.count), (Some(60 * MIB), 2));

    // Bad buffers: refused, held (the one before goes back), the figures stay.
    let bad = [
        (len - 3, 0, buf),              // the last entry cut short
        (7, 0, buf),                    // shorter than one entry
        (0, 0, buf),                    // empty
        (len, VRING_DESC_F_WRITE, buf), // device-writable
        (len, 0, 64 * 1024 * MIB),      // outside guest memory
        (10 * 257, 0, buf),             // more entries than a driver sends
    ];
    for (i, &(len, flags, addr)) in bad.iter().enumerate() {
        let head = send(&mut ring, len, flags, addr);
        assert!(
            dev.process_stats(&mut q).unwrap(),
            "{i}: the older buffer goes back"
        );
        assert_eq!(ring.get_used().unwrap(), Some((held, 0)), "{i}");
        held = head;
        assert_eq!(dev.stats().refused_stats, i as u64 + 1);
        let u = dev.guest_stats().unwrap();
        assert_eq!(
            (u.stats.get(FREE_MEMORY), u.count),
            (Some(60 * MIB), 2),
            "{i}"
        );
    }
    assert!(dev.request_stats(&mut q).unwrap());
    assert_eq!(ring.get_used().unwrap(), Some((held, 0)));
    assert_eq!(dev.stats().stats_buffers, 2 + bad.len() as u64);

    // A reset drops the held buffer and keeps the last figures.
    let len = write_stats(&[(FREE_MEMORY, 50 * MIB)]);
    send(&mut ring, len, 0, buf);
    dev.process_stats(&mut q).unwrap();
    dev.reset();
    assert!(dev.stats_held_since().is_none());
    assert_eq!(
        dev.guest_stats().unwrap().stats.get(FREE_MEMORY),
        Some(50 * MIB)
    );
    let _ = q.size();
}
