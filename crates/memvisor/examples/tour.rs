//! A short tour of memvisor: guest RAM from two backings, device-model access across the slot
//! boundary, a per-vCPU cursor, a typed error and the dirty log. Run it with
//! `cargo run -p memvisor --example tour`.

use std::sync::Arc;

use memvisor::{Backing, BackingKind, Gpa, SlotFlags, SlotSpec, SlotTable};

fn main() -> memvisor::Result<()> {
    const MIB: u64 = 1 << 20;
    // 2 MiB of guest RAM in a memfd (its fd can go to a vhost-user back end), and 2 MiB of
    // private memory right above it whose writes are logged for migration.
    let low = Arc::new(Backing::new(BackingKind::Memfd, 2 * MIB)?);
    let high = Arc::new(Backing::new(BackingKind::PrivateAnon, 2 * MIB)?);
    let table = SlotTable::new();
    table.insert(SlotSpec::new(0, Gpa(0), low))?;
    table.insert(SlotSpec::new(1, Gpa(2 * MIB), high).flags(SlotFlags::LOG_DIRTY))?;

    // A device model writes and reads guest memory; the range crosses the slot boundary and is
    // checked whole before a byte is copied.
    table.write(Gpa(2 * MIB - 4), b"hello, guest")?;
    let mut buf = [0u8; 12];
    table.read(Gpa(2 * MIB - 4), &mut buf)?;
    assert_eq!(&buf, b"hello, guest");

    // Each vCPU thread keeps a cursor: a repeat hit on its slot costs a bounds check.
    let mut cursor = table.cursor();
    let t = cursor.lookup(Gpa(0x1234)).expect("0x1234 is guest RAM");
    println!(
        "gpa 0x1234 -> {:?}, {:#x} contiguous bytes, slot {}",
        t.hva, t.len, t.slot
    );

    // Bad input is a typed error with KVM's errno and the offending values.
    let err = table.read(Gpa(1 << 30), &mut buf).unwrap_err();
    println!("errno {}: {err}", err.errno());
    let err = table.insert(SlotSpec::new(
        2,
        Gpa(MIB),
        Arc::new(Backing::new(BackingKind::Memfd, MIB)?),
    ));
    println!(
        "errno {}: {}",
        err.as_ref().unwrap_err().errno(),
        err.unwrap_err()
    );

    // The write above touched page 0 of slot 1.
    assert_eq!(table.take_dirty_log(1)?[0], 0b1);
    Ok(())
}
