//! vCPU threads: a KVM vCPU with its own [`SlotCursor`], handed to the exit handler.
//!
//! KVM keeps a last-used memslot per vCPU (`last_used_slot`) because a vCPU's accesses cluster;
//! the emulation of an MMIO or port I/O exit on the same thread does too (a device model copies
//! a descriptor, then the buffer it names). [`Vcpu`] pairs the vCPU fd with one memvisor
//! [`SlotCursor`] for that thread: [`Vcpu::run`] enters the guest and, on every MMIO or port I/O
//! exit, calls the [`ExitHandler`] with the exit's data and the cursor, so the device model
//! translates and copies guest memory (`SlotCursor::lookup` / `read` / `write`) without a lock
//! and without a search when it stays in one slot. The cursor follows table changes on its own
//! (a changed generation makes it reload), so slots inserted or removed while the vCPU runs
//! are seen at the next exit.
//!
//! With dirty rings on ([`Options::dirty_ring`](crate::Options::dirty_ring)) the vCPU maps its
//! ring when it is created, and a `KVM_EXIT_DIRTY_RING_FULL` exit is handled inside
//! [`Vcpu::run`]: it harvests every ring and resets them (the pages wait for the next
//! dirty-log call) and enters the guest again. A second full-ring exit with nothing collected
//! from this vCPU's ring since the first means KVM overran the ring (see the `ring` module):
//! [`Vcpu::run`] returns [`Error::RingOverrun`] rather than spin. That check catches some
//! overruns, not all: on PVM, which overruns rings, the binding does not turn them on at all.
//!
//! Exits the handler does not take (or that need a decision: HLT, shutdown, anything else) end
//! [`Vcpu::run`] with a [`Stop`] saying why; the caller decides whether to run again.

use std::sync::Arc;

use kvm_bindings::KVM_EXIT_DIRTY_RING_FULL;
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};
use memvisor::SlotCursor;

use crate::error::{Error, Result};
use crate::memslots::KvmSlots;
use crate::ring::Rings;

/// What the handler wants after an exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// Enter the guest again.
    Continue,
    /// Return from [`Vcpu::run`] with [`Stop::Handler`].
    Stop,
}

/// Why [`Vcpu::run`] returned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The handler asked to stop.
    Handler,
    /// The guest ran HLT.
    Hlt,
    /// The guest shut down (triple fault).
    Shutdown,
    /// `KVM_RUN` was interrupted by a signal (EINTR): run again if nothing is to be done.
    Interrupted,
    /// Another exit, by KVM's name for it.
    Other(String),
}

/// The device side of a vCPU thread. Every method gets the vCPU's cursor; the defaults take
/// nothing and stop the run.
pub trait ExitHandler {
    /// The guest read `data.len()` bytes at `gpa`, which no memslot holds: fill `data`.
    fn mmio_read(&mut self, cursor: &mut SlotCursor, gpa: u64, data: &mut [u8]) -> Control {
        let _ = (cursor, gpa, data);
        Control::Stop
    }
    /// The guest wrote `data` at `gpa`, which no memslot holds or a read-only one does.
    fn mmio_write(&mut self, cursor: &mut SlotCursor, gpa: u64, data: &[u8]) -> Control {
        let _ = (cursor, gpa, data);
        Control::Stop
    }
    /// The guest ran IN on `port`: fill `data`.
    fn pio_in(&mut self, cursor: &mut SlotCursor, port: u16, data: &mut [u8]) -> Control {
        let _ = (cursor, port, data);
        Control::Stop
    }
    /// The guest ran OUT on `port`.
    fn pio_out(&mut self, cursor: &mut SlotCursor, port: u16, data: &[u8]) -> Control {
        let _ = (cursor, port, data);
        Control::Stop
    }
}

/// A vCPU and its thread's cursor.
pub struct Vcpu {
    fd: VcpuFd,
    cursor: SlotCursor,
    rings: Option<Arc<Rings>>,
    /// This vCPU's ring in `rings`.
    ring: usize,
    /// The ring's fetch index after the last full-ring harvest.
    fetched_at_full: Option<u32>,
    ring_full_exits: u64,
}

impl std::fmt::Debug for Vcpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vcpu")
            .field("cursor", &self.cursor)
            .finish()
    }
}

impl Vcpu {
    /// Creates vCPU `id` of `vm`, with a cursor over `slots`' table.
    pub fn new(vm: &VmFd, id: u64, slots: &KvmSlots) -> Result<Vcpu> {
        let fd = vm
            .create_vcpu(id)
            .map_err(|e| Error::kvm("KVM_CREATE_VCPU", format!("vCPU {id}"), e))?;
        let rings = slots.rings().cloned();
        let ring = match &rings {
            Some(rings) => rings.add(&fd)?,
            None => 0,
        };
        Ok(Vcpu {
            fd,
            cursor: slots.cursor(),
            rings,
            ring,
            fetched_at_full: None,
            ring_full_exits: 0,
        })
    }

    /// The vCPU fd, for registers and the like.
    pub fn fd(&self) -> &VcpuFd {
        &self.fd
    }

    /// The vCPU fd, mutably.
    pub fn fd_mut(&mut self) -> &mut VcpuFd {
        &mut self.fd
    }

    /// How many times this vCPU's dirty ring filled up (each time [`Vcpu::run`] harvested).
    pub fn ring_full_exits(&self) -> u64 {
        self.ring_full_exits
    }

    /// This vCPU thread's cursor.
    pub fn cursor(&mut self) -> &mut SlotCursor {
        &mut self.cursor
    }

    /// x86: real mode with CS = 0 and IP = `ip` (the guest runs code at guest address `ip`),
    /// flat 64 KiB segments with selector 0, flags 0x2.
    #[cfg(target_arch = "x86_64")]
    pub fn set_real_mode(&self, ip: u16) -> Result<()> {
        let mut sregs = self
            .fd
            .get_sregs()
            .map_err(|e| Error::kvm("KVM_GET_SREGS", "real mode set-up", e))?;
        for seg in [
            &mut sregs.cs,
            &mut sregs.ds,
            &mut sregs.es,
            &mut sregs.ss,
            &mut sregs.fs,
            &mut sregs.gs,
        ] {
            seg.base = 0;
            seg.selector = 0;
        }
        self.fd
            .set_sregs(&sregs)
            .map_err(|e| Error::kvm("KVM_SET_SREGS", "real mode set-up", e))?;
        let regs = kvm_bindings::kvm_regs {
            rip: ip.into(),
            rflags: 2,
            rsp: 0,
            ..Default::default()
        };
        self.fd
            .set_regs(&regs)
            .map_err(|e| Error::kvm("KVM_SET_REGS", "real mode set-up", e))
    }

    /// Runs the guest, handing MMIO and port I/O exits to `handler`, until the handler or the
    /// guest stops it. A failing `KVM_RUN` (other than EINTR) is an error.
    pub fn run(&mut self, handler: &mut impl ExitHandler) -> Result<Stop> {
        loop {
            let cursor = &mut self.cursor;
            let control = match self.fd.run() {
                Ok(VcpuExit::MmioRead(gpa, data)) => handler.mmio_read(cursor, gpa, data),
                Ok(VcpuExit::MmioWrite(gpa, data)) => handler.mmio_write(cursor, gpa, data),
                Ok(VcpuExit::IoIn(port, data)) => handler.pio_in(cursor, port, data),
                Ok(VcpuExit::IoOut(port, data)) => handler.pio_out(cursor, port, data),
                Ok(VcpuExit::Hlt) => return Ok(Stop::Hlt),
                Ok(VcpuExit::Shutdown) => return Ok(Stop::Shutdown),
                Ok(VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL)) if self.rings.is_some() => {
                    self.ring_full_exits += 1;
                    if let Some(rings) = &self.rings {
                        rings.harvest_inner(true)?;
                        let fetched = rings.fetched(self.ring);
                        if self.fetched_at_full == Some(fetched) {
                            // Full again, and no entry of ours collected by anyone since the
                            // last full exit: KVM's indexes no longer match the ring.
                            rings.mark_overrun();
                            return Err(Error::RingOverrun {
                                entries: rings.entries(),
                            });
                        }
                        self.fetched_at_full = Some(fetched);
                    }
                    Control::Continue
                }
                Ok(other) => return Ok(Stop::Other(format!("{other:?}"))),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    return Ok(Stop::Interrupted);
                }
                Err(e) => return Err(Error::kvm("KVM_RUN", "vCPU", e)),
            };
            if control == Control::Stop {
                return Ok(Stop::Handler);
            }
        }
    }
}
