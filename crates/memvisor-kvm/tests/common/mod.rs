//! What the KVM tests share: the skip check, a VM whose memory is a slot table, and a real-mode
//! probe program the tests drive one step at a time.
//!
//! The probe program loops: `IN AX, 0x10` (the host answers a segment `s`), then writes `s` as a
//! 16-bit word at guest address `s * 16` (`MOV ES:[0], AX`), reads the word at `s * 16 + 2`, and
//! reports it with `OUT 0x11, AX`. One [`Probe`] is one turn of that loop: from the IN to the
//! OUT. A write the guest's memslots do not take (no slot, or a read-only one) comes out as an
//! MMIO write exit, a read of no slot as an MMIO read exit: that is how a test sees KVM's view
//! of the guest's memory.
#![allow(dead_code)]

use std::sync::Arc;

use kvm_ioctls::{Kvm, VmFd};
use memvisor::{Backing, BackingKind, Gpa, SlotCursor, SlotSpec, SlotTable};
use memvisor_kvm::{Control, Error, ExitHandler, KvmSlots, Options, Stop, Vcpu};

/// Where the probe program runs (in slot 0, guest 0..64 KiB).
pub const CODE: u16 = 0x1000;

/// The probe program, hand-assembled 16-bit code.
pub const PROBE_PROGRAM: [u8; 18] = [
    0xBA, 0x10, 0x00, // mov dx, 0x10
    0xED, //             in ax, dx          ; the segment to probe
    0x8E, 0xC0, //       mov es, ax
    0x26, 0xA3, 0x00, 0x00, // mov es:[0], ax ; write
    0x26, 0xA1, 0x02, 0x00, // mov ax, es:[2] ; read
    0xE7, 0x11, //       out 0x11, ax       ; report the word read
    0xEB, 0xEE, //       jmp 0
];

/// Says "skipped: <what>" where the test runner shows it: on the process's real stderr (libtest
/// captures `println!` and `eprintln!` of passing tests, not a write to `io::stderr()`), in one
/// write so that tests running beside this one do not cut the line.
pub fn skipped(what: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("skipped: {what}\n").as_bytes());
}

/// The KVM device, or `None` after saying why the test is skipped.
pub fn kvm_or_skip(test: &str) -> Option<Kvm> {
    if !std::path::Path::new("/dev/kvm").exists() {
        skipped(&format!("{test}: no /dev/kvm"));
        return None;
    }
    match Kvm::new() {
        Ok(kvm) => Some(kvm),
        Err(e) => {
            skipped(&format!("{test}: /dev/kvm cannot be opened: {e}"));
            None
        }
    }
}

/// `options` with the faults of the tests' environment in a test-hooks build
/// (`MEMVISOR_TEST_RINGS_ON_PVM` lets dirty rings through on PVM); `options` as they are in any
/// other build.
pub fn with_env_faults(options: Options) -> Options {
    #[cfg(feature = "test-hooks")]
    let options = Options {
        faults: memvisor::faults::Faults::from_env(),
        ..options
    };
    options
}

/// Whether this host's KVM is PVM, which overruns dirty rings: the binding refuses them there
/// (a test-hooks build lets them through with `MEMVISOR_TEST_RINGS_ON_PVM`).
pub fn pvm() -> bool {
    std::path::Path::new("/sys/module/kvm_pvm").exists()
}

/// Whether the binding takes dirty rings of `entries` entries here; `false` after printing why
/// the test is skipped. On PVM the refusal must be EOPNOTSUPP and say to use the bitmap.
pub fn rings_or_skip(kvm: &Kvm, test: &str, entries: u32) -> bool {
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let options = with_env_faults(Options {
        dirty_ring: Some(entries),
        ..Options::default()
    });
    match KvmSlots::with_options(vm, SlotTable::new(), options) {
        Ok(_) => true,
        Err(e) if e.errno() == libc::EOPNOTSUPP && pvm() => {
            assert!(e.to_string().contains("use the dirty bitmap"), "{e}");
            skipped(&format!(
                "{test}: dirty rings unsound on this KVM (PVM overruns them): {e}"
            ));
            false
        }
        Err(e) if e.errno() == libc::EOPNOTSUPP => {
            skipped(&format!("{test}: {e}"));
            false
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

/// A VM with a slot table whose slot 0 (guest 0..64 KiB) holds the probe program, a vCPU in real
/// mode at its start, and `memory`: one memfd the tests cut further slots from.
pub struct Guest {
    pub vm: Arc<VmFd>,
    pub slots: KvmSlots,
    pub vcpu: Vcpu,
    pub memory: Arc<Backing>,
}

pub fn guest(kvm: &Kvm, options: Options, memory_bytes: u64) -> Guest {
    try_guest(kvm, options, memory_bytes).expect("bind the table, create the vCPU")
}

/// [`guest`], with the binding's or the vCPU's refusal returned.
pub fn try_guest(kvm: &Kvm, options: Options, memory_bytes: u64) -> Result<Guest, Error> {
    let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
    let table = SlotTable::new();
    let code = Arc::new(Backing::new(BackingKind::Memfd, 0x10000).unwrap());
    code.write(CODE.into(), &PROBE_PROGRAM).unwrap();
    table.insert(SlotSpec::new(0, Gpa(0), code)).unwrap();
    let slots = KvmSlots::with_options(vm.clone(), table, options)?;
    let vcpu = Vcpu::new(&vm, 0, &slots)?;
    vcpu.set_real_mode(CODE)?;
    let memory = Arc::new(Backing::new(BackingKind::Memfd, memory_bytes).unwrap());
    Ok(Guest {
        vm,
        slots,
        vcpu,
        memory,
    })
}

/// What one turn of the probe program saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    /// The guest address of an MMIO write exit, if the write exited.
    pub write_exit: Option<u64>,
    /// The guest address of an MMIO read exit, if the read exited.
    pub read_exit: Option<u64>,
    /// The word the guest read (0xdead from an MMIO read exit).
    pub value: u16,
    /// MMIO exits whose address the vCPU's cursor found in a writable slot: KVM and the table
    /// disagreeing, seen on the exit path.
    pub cursor_disagrees: Vec<u64>,
}

struct ProbeHandler {
    segment: u16,
    probe: Probe,
}

impl ExitHandler for ProbeHandler {
    fn pio_in(&mut self, _: &mut SlotCursor, port: u16, data: &mut [u8]) -> Control {
        assert_eq!(port, 0x10);
        data.copy_from_slice(&self.segment.to_le_bytes()[..data.len()]);
        Control::Continue
    }
    fn mmio_write(&mut self, cursor: &mut SlotCursor, gpa: u64, _: &[u8]) -> Control {
        if cursor.lookup(Gpa(gpa)).is_some_and(|t| !t.read_only) {
            self.probe.cursor_disagrees.push(gpa);
        }
        self.probe.write_exit = Some(gpa);
        Control::Continue
    }
    fn mmio_read(&mut self, cursor: &mut SlotCursor, gpa: u64, data: &mut [u8]) -> Control {
        if cursor.lookup(Gpa(gpa)).is_some() {
            self.probe.cursor_disagrees.push(gpa);
        }
        self.probe.read_exit = Some(gpa);
        data.copy_from_slice(&0xdeadu16.to_le_bytes()[..data.len()]);
        Control::Continue
    }
    fn pio_out(&mut self, _: &mut SlotCursor, port: u16, data: &[u8]) -> Control {
        assert_eq!(port, 0x11);
        self.probe.value = u16::from_le_bytes([data[0], data[1]]);
        Control::Stop
    }
}

/// One turn of the probe program on `segment` (guest address `segment * 16`).
pub fn probe(vcpu: &mut Vcpu, segment: u16) -> Probe {
    let mut handler = ProbeHandler {
        segment,
        probe: Probe::default(),
    };
    loop {
        match vcpu.run(&mut handler).expect("KVM_RUN") {
            Stop::Handler => return handler.probe,
            Stop::Interrupted => continue,
            other => panic!("the probe program stopped: {other:?}"),
        }
    }
}

/// The segment whose offset 0 is `gpa` (below 1 MiB, 16-byte aligned).
pub fn segment(gpa: u64) -> u16 {
    assert!(
        gpa < 0x10_0000 && gpa % 16 == 0,
        "{gpa:#x} is not reachable"
    );
    (gpa >> 4) as u16
}

/// The pages set in a dirty bitmap.
pub fn pages(words: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    for (i, &w) in words.iter().enumerate() {
        for b in 0..64 {
            if w >> b & 1 == 1 {
                out.push(i as u64 * 64 + b);
            }
        }
    }
    out
}
