//! Hotplug through the vm-memory adapter: `SlotSpace::insert_region` / `remove_region`. New
//! memory carries a virtqueue; a view held across a removal keeps reading the old memory; bad
//! requests are refused with the values that were wrong (and vm-memory's own `GuestMemoryMmap`
//! refuses the same ones); readers racing a hotplugging writer see whole tables only.
#![cfg(feature = "vm-memory")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memvisor::{Backing, BackingKind, Error, Gpa, SlotMemory, SlotSpace, SlotSpec, SlotTable};
use vm_memory::{
    Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryBackend, GuestMemoryError,
    GuestMemoryMmap, GuestMemoryRegion, GuestRegionCollectionError, Le32, Le64,
};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Boot RAM: slot 0, 1 MiB at 0.
const RAM: u64 = MIB;
/// Hotplugged RAM: slot 1, 256 KiB at 1 GiB.
const PLUG_AT: u64 = 1 << 30;
const PLUG: u64 = 256 * KIB;

fn backing(size: u64) -> Arc<Backing> {
    Arc::new(Backing::new(BackingKind::Memfd, size).unwrap())
}

/// A space over a table holding the boot RAM.
fn booted() -> SlotSpace {
    let table = SlotTable::new();
    table
        .insert(SlotSpec::new(0, Gpa(0), backing(RAM)))
        .unwrap();
    SlotSpace::new(table)
}

fn starts(mem: &impl GuestMemory) -> Vec<u64> {
    mem.physical_memory()
        .unwrap()
        .iter()
        .map(|r| r.start_addr().0)
        .collect()
}

#[test]
fn hotplugged_memory_is_read_and_written_through_new_views() {
    let space = booted();
    let before = space.memory();
    let grown = space
        .insert_region(SlotSpec::new(1, Gpa(PLUG_AT), backing(PLUG)))
        .unwrap();
    assert_eq!(starts(&*grown), [0, PLUG_AT]);
    assert!(
        Arc::ptr_eq(&grown, &space.memory()),
        "the cache holds the new view"
    );

    // The accesses a virtio device makes: a descriptor as objects, a buffer as a slice, an
    // index as an atomic store and load, here across the new region.
    let desc = GuestAddress(PLUG_AT + 0x100);
    grown.write_obj(Le64::from(PLUG_AT + 0x1000), desc).unwrap();
    grown
        .write_obj(Le32::from(300), GuestAddress(desc.0 + 8))
        .unwrap();
    let addr = u64::from(grown.read_obj::<Le64>(desc).unwrap());
    let len = u32::from(grown.read_obj::<Le32>(GuestAddress(desc.0 + 8)).unwrap());
    let data: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x3c).collect();
    grown.write_slice(&data, GuestAddress(addr)).unwrap();
    grown
        .store(7u16, GuestAddress(PLUG_AT + PLUG - 2), Ordering::Release)
        .unwrap();

    // The table (memvisor's own accesses) sees the bytes, and so does a later view.
    let mut back = vec![0; data.len()];
    space.table().read(Gpa(addr), &mut back).unwrap();
    assert_eq!(back, data);
    let idx: u16 = space
        .memory()
        .load(GuestAddress(PLUG_AT + PLUG - 2), Ordering::Acquire)
        .unwrap();
    assert_eq!(idx, 7);

    // A view from before the hotplug does not have the region.
    assert_eq!(starts(&*before), [0]);
    assert!(matches!(
        before.read_obj::<Le64>(desc),
        Err(GuestMemoryError::InvalidGuestAddress(a)) if a == desc
    ));
}

/// A device driving a real virtqueue (rust-vmm's `virtio-queue`) laid out in hotplugged memory.
#[cfg(feature = "virtio-balloon")]
#[test]
fn a_virtqueue_runs_in_hotplugged_memory() {
    use memvisor_testkit::guest_ring::GuestRing;
    use virtio_queue::{Queue, QueueT};

    let space = booted();
    space
        .insert_region(SlotSpec::new(1, Gpa(PLUG_AT), backing(PLUG)))
        .unwrap();
    let mut ring = GuestRing::new(space.table(), Gpa(PLUG_AT), 8).unwrap();
    let buffer = PLUG_AT + 64 * KIB;
    let head = ring
        .add_inbuf(&[(buffer, 512), (buffer + 4096, 512)])
        .unwrap();
    ring.publish(head).unwrap();
    let mut queue = Queue::new(8).unwrap();
    ring.configure(&mut queue);

    let memory = space.memory();
    let mem = &*memory;
    let chain = queue
        .pop_descriptor_chain(mem)
        .expect("a chain is available");
    assert_eq!(chain.head_index(), head);
    let mut written = 0;
    for (i, desc) in chain.enumerate() {
        assert!(desc.is_write_only());
        let fill = vec![0x40 + i as u8; desc.len() as usize];
        mem.write_slice(&fill, desc.addr()).unwrap();
        written += desc.len();
    }
    queue.add_used(mem, head, written).unwrap();

    assert_eq!(ring.get_used().unwrap(), Some((head, 1024)));
    let mut got = [0u8; 512];
    space.table().read(Gpa(buffer + 4096), &mut got).unwrap();
    assert_eq!(got, [0x41; 512]);
}

#[test]
fn a_view_held_across_a_removal_keeps_the_old_memory() {
    let space = booted();
    space
        .insert_region(SlotSpec::new(1, Gpa(PLUG_AT), backing(PLUG)))
        .unwrap();
    space
        .table()
        .write(Gpa(PLUG_AT + 0x2000), b"still here")
        .unwrap();
    let held = space.memory();
    let generation = space.table().generation();

    let (shrunk, removed) = space.remove_region(GuestAddress(PLUG_AT), PLUG).unwrap();
    assert_eq!(
        space.table().generation(),
        generation + 1,
        "one publication"
    );
    assert_eq!(starts(&*shrunk), [0]);
    assert!(shrunk.read_obj::<u8>(GuestAddress(PLUG_AT)).is_err());
    assert!(space.table().lookup(Gpa(PLUG_AT)).is_none());

    // The removed region is what vm-memory's remove_region hands back: the region itself,
    // still mapped while it lives.
    assert_eq!(removed.start_addr(), GuestAddress(PLUG_AT));
    assert_eq!(removed.len(), PLUG);
    assert_eq!(removed.slot().id(), 1);
    let mut buf = [0u8; 10];
    removed
        .read_slice(&mut buf, vm_memory::MemoryRegionAddress(0x2000))
        .unwrap();
    assert_eq!(&buf, b"still here");
    drop(removed);

    // The view from before still reads (and writes) the removed memory, consistently.
    assert_eq!(starts(&*held), [0, PLUG_AT]);
    held.read_slice(&mut buf, GuestAddress(PLUG_AT + 0x2000))
        .unwrap();
    assert_eq!(&buf, b"still here");
    held.write_slice(b"old view", GuestAddress(PLUG_AT))
        .unwrap();
    held.read_slice(&mut buf[..8], GuestAddress(PLUG_AT))
        .unwrap();
    assert_eq!(&buf[..8], b"old view");
}

/// The generation the table is at, and the regions a new view shows; both must not move.
fn unchanged(space: &SlotSpace, generation: u64, regions: &[u64]) {
    assert_eq!(space.table().generation(), generation, "nothing published");
    assert_eq!(starts(&*space.memory()), regions);
}

#[test]
fn bad_hotplug_requests_are_refused_with_the_values_and_publish_nothing() {
    let space = booted();
    space
        .insert_region(SlotSpec::new(1, Gpa(PLUG_AT), backing(PLUG)))
        .unwrap();
    let generation = space.table().generation();
    let regions = [0, PLUG_AT];

    // Overlap: EEXIST, naming both ranges.
    let e = space
        .insert_region(SlotSpec::new(
            2,
            Gpa(PLUG_AT + PLUG - 4096),
            backing(2 * 4096),
        ))
        .unwrap_err();
    assert_eq!(e.errno(), libc::EEXIST);
    match &e {
        Error::Overlap {
            start,
            last,
            existing_start,
            existing_last,
            ..
        } => {
            assert_eq!(
                (*start, *last),
                (PLUG_AT + PLUG - 4096, PLUG_AT + PLUG + 4095)
            );
            assert_eq!(
                (*existing_start, *existing_last),
                (PLUG_AT, PLUG_AT + PLUG - 1)
            );
        }
        other => panic!("expected Overlap, got {other:?}"),
    }
    assert!(
        e.to_string()
            .contains(&format!("{:#x}", PLUG_AT + PLUG - 4096)),
        "{e}"
    );
    unchanged(&space, generation, &regions);

    // A slot id in use: EEXIST.
    let e = space
        .insert_region(SlotSpec::new(1, Gpa(2 * PLUG_AT), backing(PLUG)))
        .unwrap_err();
    assert!(matches!(e, Error::AlreadyExists { id: 1, .. }), "{e:?}");
    unchanged(&space, generation, &regions);

    // Size 0, inserting or removing: EINVAL.
    let e = space
        .insert_region(SlotSpec::new(2, Gpa(2 * PLUG_AT), backing(PLUG)).window(0, 0))
        .unwrap_err();
    assert!(matches!(e, Error::ZeroSize { .. }), "{e:?}");
    assert_eq!(e.errno(), libc::EINVAL);
    let e = space.remove_region(GuestAddress(PLUG_AT), 0).unwrap_err();
    assert!(matches!(e, Error::ZeroSize { .. }), "{e:?}");
    unchanged(&space, generation, &regions);

    // No region there: ENOENT, naming the address.
    let e = space
        .remove_region(GuestAddress(3 * PLUG_AT), PLUG)
        .unwrap_err();
    assert!(
        matches!(e, Error::NotFound { id, .. } if id == 3 * PLUG_AT),
        "{e:?}"
    );
    assert_eq!(e.errno(), libc::ENOENT);
    unchanged(&space, generation, &regions);

    // A region there, but not starting at base or of another size: EINVAL, naming it.
    for (base, size) in [
        (PLUG_AT, PLUG / 2),
        (PLUG_AT + 4096, PLUG - 4096),
        (PLUG_AT, 2 * PLUG),
    ] {
        let e = space.remove_region(GuestAddress(base), size).unwrap_err();
        assert!(matches!(e, Error::Invalid(_)), "{e:?}");
        assert_eq!(e.errno(), libc::EINVAL);
        let msg = e.to_string();
        for value in [base, size, PLUG_AT, PLUG] {
            assert!(
                msg.contains(&format!("{value:#x}")),
                "{msg} names {value:#x}"
            );
        }
        assert!(msg.contains("slot 1"), "{msg}");
        unchanged(&space, generation, &regions);
    }
}

#[test]
fn vm_memory_refuses_the_same_requests() {
    let mem: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[
        (GuestAddress(0), RAM as usize),
        (GuestAddress(PLUG_AT), PLUG as usize),
    ])
    .unwrap();
    let other: GuestMemoryMmap =
        GuestMemoryMmap::from_ranges(&[(GuestAddress(PLUG_AT + PLUG - 4096), 2 * 4096)]).unwrap();
    let (_, overlapping) = other
        .remove_region(GuestAddress(PLUG_AT + PLUG - 4096), 2 * 4096)
        .unwrap();
    assert!(matches!(
        mem.insert_region(overlapping),
        Err(GuestRegionCollectionError::MemoryRegionOverlap)
    ));
    for (base, size) in [
        (3 * PLUG_AT, PLUG),
        (PLUG_AT, PLUG / 2),
        (PLUG_AT + 4096, PLUG - 4096),
        (PLUG_AT, 0),
    ] {
        assert!(
            matches!(
                mem.remove_region(GuestAddress(base), size),
                Err(GuestRegionCollectionError::NoMemoryRegion)
            ),
            "vm-memory removes ({base:#x}, {size:#x})"
        );
    }
}

/// Each hotplugged backing starts with its round number and ends with it again, both written
/// before the region is published; a reader checks the two agree and match the view.
fn signed(round: u64) -> Arc<Backing> {
    let b = backing(PLUG);
    let sig = (round | 0x5157 << 48).to_le_bytes();
    b.write(0, &sig).unwrap();
    b.write(PLUG - 8, &sig).unwrap();
    b
}

#[test]
fn readers_racing_hotplug_see_the_old_or_the_new_table_never_a_mix() {
    const ROUNDS: u64 = 300;
    let space = booted();
    space.table().write(Gpa(0), b"boot RAM").unwrap();
    // Generation 1 holds the boot RAM alone; the writer then alternates insert (even
    // generations: two regions) and remove (odd: one).
    assert_eq!(space.table().generation(), 1);
    let done = AtomicBool::new(false);

    std::thread::scope(|s| {
        let readers: Vec<_> = (0..3)
            .map(|_| {
                let space = space.clone();
                let done = &done;
                s.spawn(move || {
                    let mut views = 0u64;
                    let mut last_generation = 0;
                    let mut held = space.memory();
                    while !done.load(Ordering::Acquire) {
                        let mem = space.memory();
                        let generation = mem.snapshot().generation();
                        assert!(generation >= last_generation, "generations go forward");
                        last_generation = generation;
                        check_view(&mem);
                        // A view held over many writer steps stays what it was.
                        check_view(&held);
                        if views % 64 == 0 {
                            held = mem;
                        }
                        views += 1;
                    }
                    views
                })
            })
            .collect();

        for round in 0..ROUNDS {
            space
                .insert_region(SlotSpec::new(1, Gpa(PLUG_AT), signed(round)))
                .unwrap();
            space.remove_region(GuestAddress(PLUG_AT), PLUG).unwrap();
        }
        done.store(true, Ordering::Release);
        for r in readers {
            let views = r.join().unwrap();
            assert!(views > 0);
        }
    });
    assert_eq!(space.table().generation(), 1 + 2 * ROUNDS);
}

/// One view: the regions its generation says, each whole and readable, the hotplugged one
/// signed the same at both ends with the round that generation belongs to.
fn check_view(mem: &SlotMemory) {
    let generation = mem.snapshot().generation();
    let mut boot = [0u8; 8];
    mem.read_slice(&mut boot, GuestAddress(0)).unwrap();
    assert_eq!(&boot, b"boot RAM");
    let regions = mem.regions();
    assert_eq!(regions.num_regions(), regions.iter().count());
    if generation % 2 == 1 {
        assert_eq!(starts(mem), [0], "generation {generation}");
        assert!(mem.read_obj::<u64>(GuestAddress(PLUG_AT)).is_err());
        return;
    }
    assert_eq!(starts(mem), [0, PLUG_AT], "generation {generation}");
    let round = (generation - 2) / 2;
    let first: u64 = mem.read_obj(GuestAddress(PLUG_AT)).unwrap();
    let last: u64 = mem.read_obj(GuestAddress(PLUG_AT + PLUG - 8)).unwrap();
    assert_eq!(first, round | 0x5157 << 48, "generation {generation}");
    assert_eq!(last, first);
}

/// A VMM that keeps its own mapping code hotplugs the `GuestRegionMmap` it mapped: memvisor
/// adopts that memory (no second mapping), so the VMM's region and memvisor's view are the same
/// bytes, before and after the unplug.
#[cfg(feature = "vm-memory-mmap")]
#[test]
fn a_vmm_s_own_region_hotplugs_without_a_copy() {
    use vm_memory::{GuestRegionMmap, MemoryRegionAddress};

    let space = booted();
    let region: GuestRegionMmap =
        GuestRegionMmap::from_range(GuestAddress(PLUG_AT), PLUG as usize, None).unwrap();
    let grown = space
        .insert_region(SlotSpec::from_guest_region(1, &region).unwrap())
        .unwrap();
    grown
        .write_slice(b"through memvisor", GuestAddress(PLUG_AT + 0x300))
        .unwrap();
    let mut buf = [0u8; 16];
    region
        .read_slice(&mut buf, MemoryRegionAddress(0x300))
        .unwrap();
    assert_eq!(&buf, b"through memvisor");
    region
        .write_slice(b"through the VMM", MemoryRegionAddress(0x400))
        .unwrap();

    let (shrunk, removed) = space.remove_region(GuestAddress(PLUG_AT), PLUG).unwrap();
    assert!(shrunk.read_obj::<u8>(GuestAddress(PLUG_AT)).is_err());
    removed
        .read_slice(&mut buf[..15], MemoryRegionAddress(0x400))
        .unwrap();
    assert_eq!(&buf[..15], b"through the VMM");
}
