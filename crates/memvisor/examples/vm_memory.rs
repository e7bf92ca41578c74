//! rust-vmm code on memvisor memory: the slot table through vm-memory's traits. Run it with
//! `cargo run -p memvisor --features vm-memory --example vm_memory`; `cargo test --workspace`
//! runs it too (tests/vm_memory.rs).

use std::sync::Arc;

use memvisor::{Backing, BackingKind, Gpa, SlotFlags, SlotSpace, SlotSpec, SlotTable};
use vm_memory::{Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryError, Le32};

/// Code written for any vm-memory guest memory, as a virtio device model is.
fn bump_counter(mem: &impl GuestMemory, at: GuestAddress) -> Result<u32, GuestMemoryError> {
    let n = u32::from(mem.read_obj::<Le32>(at)?) + 1;
    mem.write_obj(Le32::from(n), at)?;
    Ok(n)
}

/// Public so tests/vm_memory.rs can run it.
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    const MIB: u64 = 1 << 20;
    let table = SlotTable::new();
    let ram = Arc::new(Backing::new(BackingKind::Memfd, 2 * MIB)?);
    let rom = Arc::new(Backing::new(BackingKind::PrivateAnon, 64 << 10)?);
    table.insert(SlotSpec::new(0, Gpa(0), ram).flags(SlotFlags::LOG_DIRTY))?;
    table.insert(SlotSpec::new(1, Gpa(4 * MIB), rom).flags(SlotFlags::READ_ONLY))?;

    // A device gets the live table; each memory() is a consistent snapshot of it.
    let space = SlotSpace::new(table.clone());
    let mem = space.memory();
    assert_eq!(bump_counter(&*mem, GuestAddress(0x1000))?, 1);
    assert_eq!(bump_counter(&*mem, GuestAddress(0x1000))?, 2);

    // vm-memory writes land in memvisor's memory and its dirty log...
    let mut raw = [0u8; 4];
    table.read(Gpa(0x1000), &mut raw)?;
    assert_eq!(u32::from_le_bytes(raw), 2);
    assert_eq!(table.take_dirty_log(0)?[0], 0b10);

    // ...and a read-only slot refuses them.
    let err = mem.write_obj(7u32, GuestAddress(4 * MIB)).unwrap_err();
    println!("write to the read-only slot: {err}");
    Ok(())
}
