//! A VMM in a few dozen lines: a KVM VM whose memory is a memvisor slot table.
//!
//! The guest (hand-assembled real-mode code) writes 0xBEEF at 0x10000, then programs a small
//! "copy engine" device at MMIO address 0xd0000: source, destination (as 16-byte paragraph
//! numbers) and length, whose write starts the copy. The device model runs on the vCPU thread and
//! copies guest memory through the vCPU's slot cursor. At HLT the VMM checks the copy and prints
//! the one merged dirty log of the logging slot: page 0 written by the guest (KVM's bitmap),
//! page 1 by the device (memvisor's log). Needs /dev/kvm.

use std::sync::Arc;

use kvm_ioctls::Kvm;
use memvisor::{Backing, BackingKind, Gpa, SlotCursor, SlotFlags, SlotSpec, SlotTable};
use memvisor_kvm::{Control, ExitHandler, KvmSlots, Stop, Vcpu};

const GUEST: &[u8] = &[
    0xB8, 0x00, 0x10, //                   mov ax, 0x1000
    0x8E, 0xD8, //                         mov ds, ax          ; ds base 0x10000
    0xC7, 0x06, 0x00, 0x00, 0xEF, 0xBE, // mov word [0], 0xBEEF
    0xB8, 0x00, 0xD0, //                   mov ax, 0xd000
    0x8E, 0xC0, //                         mov es, ax          ; es base 0xd0000: the device
    0x26, 0xC7, 0x06, 0x00, 0x00, 0x00, 0x10, // mov word es:[0], 0x1000  ; source 0x10000
    0x26, 0xC7, 0x06, 0x02, 0x00, 0x00,
    0x11, // mov word es:[2], 0x1100  ; destination 0x11000
    0x26, 0xC7, 0x06, 0x04, 0x00, 0x02, 0x00, // mov word es:[4], 2       ; length: copy now
    0xF4, //                               hlt
];

/// The copy engine: three 16-bit registers at 0xd0000.
#[derive(Default)]
struct CopyEngine {
    regs: [u16; 3],
}

impl ExitHandler for CopyEngine {
    fn mmio_write(&mut self, cursor: &mut SlotCursor, gpa: u64, data: &[u8]) -> Control {
        let reg = ((gpa - 0xd0000) / 2) as usize;
        self.regs[reg] = u16::from_le_bytes([data[0], data[1]]);
        if reg == 2 {
            let (src, dst) = (u64::from(self.regs[0]) << 4, u64::from(self.regs[1]) << 4);
            let mut buf = vec![0u8; usize::from(self.regs[2])];
            // A real device would report a fault to the guest; the example just says so.
            if let Err(e) = cursor
                .read(Gpa(src), &mut buf)
                .and_then(|()| cursor.write(Gpa(dst), &buf))
            {
                eprintln!("copy engine: {e}");
            }
        }
        Control::Continue
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let kvm = Kvm::new()?;
    let vm = Arc::new(kvm.create_vm()?);
    // Guest memory: 64 KiB of code at 0, 64 KiB of logged RAM at 0x10000, one memfd.
    let memory = Arc::new(Backing::new(BackingKind::Memfd, 0x20000)?);
    memory.write(0x1000, GUEST)?;
    let table = SlotTable::new();
    table.insert(SlotSpec::new(0, Gpa(0), memory.clone()).window(0, 0x10000))?;
    table.insert(
        SlotSpec::new(1, Gpa(0x10000), memory.clone())
            .window(0x10000, 0x10000)
            .flags(SlotFlags::LOG_DIRTY),
    )?;
    let slots = KvmSlots::new(vm.clone(), table)?;

    let mut vcpu = Vcpu::new(&vm, 0, &slots)?;
    vcpu.set_real_mode(0x1000)?;
    let stop = vcpu.run(&mut CopyEngine::default())?;
    assert_eq!(stop, Stop::Hlt, "the guest ends with HLT");

    let mut word = [0u8; 2];
    slots.table().read(Gpa(0x11000), &mut word)?;
    println!("copied by the device: {:#x}", u16::from_le_bytes(word));
    let log = slots.take_dirty_log(1)?;
    let dirty: Vec<u64> = (0..16).filter(|p| log[0] >> p & 1 == 1).collect();
    println!("dirty pages of slot 1 (guest via KVM, device via memvisor): {dirty:?}");
    assert_eq!((u16::from_le_bytes(word), dirty), (0xBEEF, vec![0, 1]));
    Ok(())
}
