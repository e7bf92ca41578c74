//! A VMM's side of free page reporting: a virtio-balloon reporting queue over memvisor memory,
//! with a device holding a pin on part of the reported memory. The guest's part (one report of
//! two 2 MiB blocks) is played by memvisor's guest-side ring.
//!
//! Run with `cargo run -p memvisor --features virtio-balloon --example balloon`;
//! `cargo test --workspace` runs it too (tests/balloon).

use std::sync::Arc;

use memvisor::balloon::{Balloon, VIRTIO_BALLOON_F_REPORTING, VIRTIO_F_VERSION_1};
use memvisor::{
    Backing, BackingKind, DiscardOptions, DmaConfig, DmaSpace, Gpa, Iova, Prot, SlotSpace,
    SlotSpec, SlotTable,
};
use memvisor_testkit::guest_ring::GuestRing;

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

    // The device model; the transport acks the driver's features.
    let mut balloon = Balloon::new(space, DiscardOptions::default(), 16)?;
    balloon.ack_features(1 << VIRTIO_F_VERSION_1 | 1 << VIRTIO_BALLOON_F_REPORTING)?;

    // The guest's driver lays its ring out at 4 KiB (the transport passes the addresses on to
    // the queue) and reports the blocks at 2 MiB and 4 MiB as one chain.
    let mut ring = GuestRing::new(&table, Gpa(0x1000), 16)?;
    ring.configure(balloon.queue_mut());
    let head = ring.add_inbuf(&[(2 * MIB, 2 * MIB as u32), (4 * MIB, 2 * MIB as u32)])?;
    ring.publish(head)?;

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

    assert_eq!(ring.get_used()?, Some((head, 0)));

    // The pinned page kept its bytes; the rest of the report reads as zeros.
    let mut byte = [0u8; 1];
    table.read(Gpa(4 * MIB + 8192), &mut byte)?;
    assert_eq!(byte, [0xa5]);
    table.read(Gpa(4 * MIB), &mut byte)?;
    assert_eq!(byte, [0]);
    Ok(())
}
