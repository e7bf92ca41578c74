//! Porting, before: a device model and its VMM on vm-memory's `GuestMemoryMmap`. Its twin,
//! `porting_memvisor.rs`, is the same program on memvisor; `diff` the two files to see what a
//! port changes (docs/porting.md walks through it). Run it with
//! `cargo run -p memvisor --features vm-memory --example porting_vm_memory`; tests/porting.rs
//! runs both and compares what the device computed.
//!
//! The device fills and checksums guest buffers. The driver puts a request list in guest memory:
//! a `le32` count, then one 24-byte entry per request — `addr: le64, len: le32, op: le32,
//! arg: le32, result: le32` — and the device walks it through `GuestMemory`/`Bytes`, as a virtio
//! device walks a descriptor chain, writing each entry's result back.

use std::sync::Arc;

use vm_memory::{
    Address, Bytes, GuestAddress, GuestAddressSpace, GuestMemory, GuestMemoryAtomic,
    GuestMemoryError, GuestMemoryMmap, GuestRegionMmap, Le32, Le64,
};

// ---- the VMM's memory: what a port changes ----

/// The address space the device is handed.
pub type Memory = GuestMemoryAtomic<GuestMemoryMmap>;

const MIB: u64 = 1 << 20;
/// Boot RAM: 16 MiB at guest address 0.
const RAM: u64 = 16 * MIB;
/// Hotplugged RAM: 2 MiB at 4 GiB.
const PLUG_AT: GuestAddress = GuestAddress(4 << 30);
const PLUG: u64 = 2 * MIB;

fn boot_memory() -> Result<Memory, Box<dyn std::error::Error>> {
    let ram: GuestMemoryMmap = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), RAM as usize)])?;
    Ok(GuestMemoryAtomic::new(ram))
}

fn hotplug(memory: &Memory) -> Result<(), Box<dyn std::error::Error>> {
    let region: GuestRegionMmap = GuestRegionMmap::from_range(PLUG_AT, PLUG as usize, None)?;
    let grown = memory.memory().insert_region(Arc::new(region))?;
    memory.lock().unwrap().replace(grown);
    Ok(())
}

fn unplug(memory: &Memory) -> Result<(), Box<dyn std::error::Error>> {
    let (shrunk, _region) = memory.memory().remove_region(PLUG_AT, PLUG)?;
    memory.lock().unwrap().replace(shrunk);
    Ok(())
}

// ---- the device model: the same in both files ----

/// Fill `len` bytes at `addr` with `arg`'s low byte; result: `len`.
pub const OP_FILL: u32 = 1;
/// Checksum `len` bytes at `addr` (Fletcher-32 over the bytes); result: the checksum.
pub const OP_SUM: u32 = 2;
/// The result of a request the device could not carry out (bad op, memory not there).
pub const FAILED: u32 = u32::MAX;
const ENTRY: u64 = 24;
const CHUNK: usize = 4096;

/// Fletcher-32 of `bytes`, continuing from `state` (start from `(0, 0)`).
pub fn fletcher(state: (u32, u32), bytes: &[u8]) -> (u32, u32) {
    bytes.iter().fold(state, |(a, b), &x| {
        let a = (a + u32::from(x)) % 65535;
        (a, (b + a) % 65535)
    })
}

/// The device: all it knows of memory is the address space it was handed.
pub struct Checksummer {
    memory: Memory,
}

impl Checksummer {
    /// A device on `memory`.
    pub fn new(memory: Memory) -> Self {
        Checksummer { memory }
    }

    /// Carries out the request list at `list` and returns how many requests it held. The list
    /// itself must be readable; a request that fails gets [`FAILED`] as its result.
    pub fn process(&self, list: GuestAddress) -> Result<u32, GuestMemoryError> {
        // One view for the whole list: a hotplug meanwhile is seen by the next call.
        let mem = self.memory.memory();
        let count = u32::from(mem.read_obj::<Le32>(list)?);
        for i in 0..u64::from(count) {
            let entry = at(list, 4 + ENTRY * i)?;
            let addr = GuestAddress(u64::from(mem.read_obj::<Le64>(entry)?));
            let len = u32::from(mem.read_obj::<Le32>(at(entry, 8)?)?);
            let op = u32::from(mem.read_obj::<Le32>(at(entry, 12)?)?);
            let arg = u32::from(mem.read_obj::<Le32>(at(entry, 16)?)?);
            let result = match op {
                OP_FILL => fill(&*mem, addr, len, arg as u8),
                OP_SUM => sum(&*mem, addr, len),
                _ => Err(GuestMemoryError::InvalidBackendAddress),
            };
            mem.write_obj(Le32::from(result.unwrap_or(FAILED)), at(entry, 20)?)?;
        }
        Ok(count)
    }
}

fn at(base: GuestAddress, offset: u64) -> Result<GuestAddress, GuestMemoryError> {
    base.checked_add(offset)
        .ok_or(GuestMemoryError::InvalidGuestAddress(base))
}

/// Guest memory is copied through a host buffer, never borrowed as `&[u8]`: the guest may be
/// writing it at the same time.
fn fill(
    mem: &impl GuestMemory,
    addr: GuestAddress,
    len: u32,
    byte: u8,
) -> Result<u32, GuestMemoryError> {
    if !mem.check_range(addr, len as usize, vm_memory::Permissions::Write) {
        return Err(GuestMemoryError::InvalidGuestAddress(addr));
    }
    let chunk = [byte; CHUNK];
    let mut done = 0usize;
    while done < len as usize {
        let n = (len as usize - done).min(CHUNK);
        mem.write_slice(&chunk[..n], at(addr, done as u64)?)?;
        done += n;
    }
    Ok(len)
}

fn sum(mem: &impl GuestMemory, addr: GuestAddress, len: u32) -> Result<u32, GuestMemoryError> {
    let mut chunk = [0u8; CHUNK];
    let mut state = (0, 0);
    let mut done = 0usize;
    while done < len as usize {
        let n = (len as usize - done).min(CHUNK);
        mem.read_slice(&mut chunk[..n], at(addr, done as u64)?)?;
        state = fletcher(state, &chunk[..n]);
        done += n;
    }
    Ok(state.1 << 16 | state.0)
}

// ---- the driver and the VMM's steps: the same in both files ----

/// Where the driver puts its request list.
const LIST: GuestAddress = GuestAddress(0x1000);

/// The driver's side: writes `requests` (addr, len, op, arg) as a list at [`LIST`].
fn submit(
    mem: &impl GuestMemory,
    requests: &[(u64, u32, u32, u32)],
) -> Result<(), GuestMemoryError> {
    mem.write_obj(Le32::from(requests.len() as u32), LIST)?;
    for (i, &(addr, len, op, arg)) in requests.iter().enumerate() {
        let entry = at(LIST, 4 + ENTRY * i as u64)?;
        mem.write_obj(Le64::from(addr), entry)?;
        mem.write_obj(Le32::from(len), at(entry, 8)?)?;
        mem.write_obj(Le32::from(op), at(entry, 12)?)?;
        mem.write_obj(Le32::from(arg), at(entry, 16)?)?;
        mem.write_obj(Le32::from(0), at(entry, 20)?)?;
    }
    Ok(())
}

/// The results the device wrote back for the last `count` requests.
fn results(mem: &impl GuestMemory, count: usize) -> Result<Vec<u32>, GuestMemoryError> {
    (0..count)
        .map(|i| {
            Ok(u32::from(
                mem.read_obj::<Le32>(at(LIST, 4 + ENTRY * i as u64 + 20)?)?,
            ))
        })
        .collect()
}

/// Boots, runs requests in boot RAM, hotplugs, runs requests in the new RAM (and across into a
/// hole), unplugs while a view is held, and returns every result the device wrote, in order.
pub fn run() -> Result<Vec<u32>, Box<dyn std::error::Error>> {
    let memory = boot_memory()?;
    let device = Checksummer::new(memory.clone());
    let mut all = Vec::new();
    let plug = PLUG_AT.0;
    let mut step = |requests: &[(u64, u32, u32, u32)]| -> Result<(), Box<dyn std::error::Error>> {
        submit(&*memory.memory(), requests)?;
        device.process(LIST)?;
        all.extend(results(&*memory.memory(), requests.len())?);
        Ok(())
    };

    // Boot RAM: fill a buffer that crosses a page, then checksum it; a buffer at the hotplug
    // address fails, nothing is there yet.
    step(&[
        (0x3_f000, 0x2345, OP_FILL, 0xa5),
        (0x3_f000, 0x2345, OP_SUM, 0),
        (plug, 512, OP_SUM, 0),
    ])?;

    hotplug(&memory)?;
    // Now the hotplugged RAM holds buffers; one that runs past its end still fails.
    step(&[
        (plug + 0x1000, 3 * CHUNK as u32, OP_FILL, 0x5a),
        (plug + 0x1000, 3 * CHUNK as u32, OP_SUM, 0),
        (plug + PLUG - 16, 32, OP_SUM, 0),
    ])?;

    // A view held across the unplug still reads the old memory; the device, which asks for a
    // view per list, no longer reaches it.
    let held = memory.memory();
    unplug(&memory)?;
    let mut kept = [0u8; 16];
    held.read_slice(&mut kept, at(PLUG_AT, 0x1000)?)?;
    assert_eq!(kept, [0x5a; 16]);
    drop(held);
    step(&[
        (plug + 0x1000, 16, OP_SUM, 0),
        (0x3_f000, 0x2345, OP_SUM, 0),
    ])?;
    Ok(all)
}

/// Public so tests/porting.rs can run it.
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    for (i, result) in run()?.into_iter().enumerate() {
        println!("request {i}: {result:#010x}");
    }
    Ok(())
}
