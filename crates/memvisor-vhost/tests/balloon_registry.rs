//! The vhost-user balloon discards through the pin registry the back end's process state
//! names (the one its device spaces pin through), not always the global one: a page pinned
//! through either is kept when the guest inflates it.

use memvisor::balloon::virtio_queue::QueueT;
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor::{Backing, BackingKind, Gpa, Prot};
use memvisor_testkit::guest_ring::{Desc, GuestRing};
use memvisor_vhost::proto::Region;
use memvisor_vhost::{BalloonDevice, BalloonTarget, Device, FrontendMemory, ProcessState, Ring};

const PAGE: u64 = 4096;
const SIZE: u64 = 4 << 20;

/// With the process's global registry (what the server passes), the pin holds.
#[test]
fn inflate_keeps_a_page_pinned_through_the_global_registry() {
    inflate_pinned(PinRegistry::global());
}

#[test]
fn inflate_keeps_a_page_pinned_through_the_process_registry() {
    // A server whose back ends pin through a registry of their own (ProcessState allows it).
    inflate_pinned(PinRegistry::new(LockLimit::Unlimited));
}

fn inflate_pinned(registry: std::sync::Arc<PinRegistry>) {
    let state = ProcessState::new(memvisor::SharedMappings::global(), registry.clone());
    let mut mem = FrontendMemory::new(&state).unwrap();
    let backing = Backing::new(BackingKind::Memfd, SIZE).unwrap();
    let fd = backing.fd().unwrap().try_clone_to_owned().unwrap();
    mem.set_table(
        &[Region {
            gpa: 0,
            size: SIZE,
            user_addr: 0x7f00_0000_0000,
            mmap_offset: 0,
        }],
        vec![fd],
    )
    .unwrap();

    let mut dev = BalloonDevice::new(BalloonTarget::default());
    dev.attach(&mem).unwrap();
    dev.set_features(dev.features()).unwrap();

    // A device (blk, say) pins page 100 through the back end's device space for its DMA.
    let pinned = 100u64;
    let pattern = vec![0xa5u8; PAGE as usize];
    mem.slots().write(Gpa(pinned * PAGE), &pattern).unwrap();
    let _pin = mem.dma().pin_pages(&[pinned], Prot::RW).unwrap();

    // The guest inflates that very page.
    let mut q = memvisor::balloon::virtio_queue::Queue::new(64).unwrap();
    let mut guest = GuestRing::new(mem.slots(), Gpa(0), 64).unwrap();
    guest.configure(&mut q);
    let list = 16 * PAGE;
    mem.slots()
        .write(Gpa(list), &(pinned as u32).to_le_bytes())
        .unwrap();
    let head = guest
        .add_raw(
            &[0],
            &[Desc {
                addr: list,
                len: 4,
                flags: 0,
                next: 0,
            }],
        )
        .unwrap();
    guest.publish(head).unwrap();
    let mut ring = Ring::plain(q);
    dev.process(0, &mut ring, &mem).unwrap();
    assert_eq!(guest.get_used().unwrap(), Some((0, 0)));

    let mut back = vec![0u8; PAGE as usize];
    mem.slots().read(Gpa(pinned * PAGE), &mut back).unwrap();
    let s = dev.stats();
    assert!(
        back == pattern,
        "a page pinned through the back end's registry was discarded (stats {s:?})"
    );
}
