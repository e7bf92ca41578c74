//! A VMM's side of free page reporting: a virtio-balloon reporting queue over memvisor memory,
//! with a device holding a pin on part of the reported memory. The guest's part (one report of
//! two 2 MiB blocks on a split ring) is played by a few writes into guest memory.
//!
//! Run with `cargo run -p memvisor --features virtio-balloon --example balloon`;
//! `cargo test --workspace` runs it too (tests/balloon).

use std::sync::Arc;

use memvisor::balloon::virtio_queue::QueueT;
use memvisor::balloon::{Balloon, VIRTIO_BALLOON_F_REPORTING, VIRTIO_F_VERSION_1};
use memvisor::{
    Backing, BackingKind, DiscardOptions, DmaConfig, DmaSpace, Gpa, Iova, Prot, SlotSpace,
    SlotSpec, SlotTable,
};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, Le16, Le32, Le64};

const MIB: u64 = 1 << 20;

/// Public so tests/balloon can run it.
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    // 8 MiB of guest RAM at 0, every byte in use.
    let table = SlotTable::new();
    let ram = Arc::new(Backing::new(BackingKind::PrivateAnon, 8 * MIB)?);
    table.insert(SlotSpec::new(0, Gpa(0), ram.clone()))?;
    let space = SlotSpace::new(table.clone());
    table.write(Gpa(0), &vec![0xa5; 8 * MIB as usize])?;

    // A passthrough device maps all of RAM and pins one page at 4 MiB + 8 KiB.
    let dma = DmaSpace::new(DmaConfig::default())?;
    dma.map_backing(Iova(0), &ram, 0, ram.size(), Prot::RW)?;
    dma.pin_pages(&[(4 * MIB) / 4096 + 2], Prot::RW)?;

    // The device model: the transport acks features and sets the queue up as the guest says.
    let mut balloon = Balloon::new(space.clone(), DiscardOptions::default(), 16)?;
    balloon.ack_features(1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BALLOON_F_REPORTING)?;
    let (desc, avail, used) = (0x1000u64, 0x2000u64, 0x3000u64);
    let q = balloon.queue_mut();
    q.set_size(16);
    q.set_desc_table_address(Some(desc as u32), Some(0));
    q.set_avail_ring_address(Some(avail as u32), Some(0));
    q.set_used_ring_address(Some(used as u32), Some(0));
    q.set_ready(true);

    // The guest reports the blocks at 2 MiB and 4 MiB: descriptors 0 -> 1, device-writable.
    let mem = space.memory();
    for (i, block) in [2 * MIB, 4 * MIB].into_iter().enumerate() {
        let at = GuestAddress(desc + 16 * i as u64);
        let (flags, next) = if i == 0 { (2 | 1, 1) } else { (2, 0) }; // WRITE | NEXT
        mem.write_obj(Le64::from(block), at)?;
        mem.write_obj(Le32::from(2 * MIB as u32), GuestAddress(at.0 + 8))?;
        mem.write_obj(Le16::from(flags), GuestAddress(at.0 + 12))?;
        mem.write_obj(Le16::from(next), GuestAddress(at.0 + 14))?;
    }
    mem.write_obj(Le16::from(0), GuestAddress(avail + 4))?; // ring[0] = head 0
    mem.write_obj(Le16::from(1), GuestAddress(avail + 2))?; // idx = 1

    // The guest notified the queue: the VMM's event loop runs the device.
    let done = balloon.process_queue()?;
    let outcome = done.chains[0]
        .result
        .as_ref()
        .expect("a well-formed report");
    eprintln!(
        "reported 4 MiB: {} KiB discarded, {} KiB kept because pinned; interrupt guest: {}",
        outcome.discarded >> 10,
        outcome.skipped_pinned >> 10,
        done.notify
    );
    assert_eq!(outcome.skipped_pinned, 4096);
    assert_eq!(outcome.discarded, 4 * MIB - 4096);

    // The pinned page kept its bytes; the rest of the report reads as zeros.
    let mut byte = [0u8; 1];
    table.read(Gpa(4 * MIB + 8192), &mut byte)?;
    assert_eq!(byte, [0xa5]);
    table.read(Gpa(4 * MIB), &mut byte)?;
    assert_eq!(byte, [0]);
    Ok(())
}
