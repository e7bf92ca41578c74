//! A device of your own on memvisor-vfio-user: a PCI device whose one BAR holds a copy
//! engine's registers — write a source, a destination and a length, then `GO`, and it copies
//! that many bytes of guest memory from one to the other by DMA.
//!
//! **The device** implements [`Device`]: PCI flags, its regions (BAR0 of 4 KiB and the
//! 256-byte config space; the other indices empty), no interrupts, register reads and writes,
//! reset and counters. The [`Server`] does the protocol: the version handshake, region and
//! interrupt queries, and `DMA_MAP` / `DMA_UNMAP` into the device's DMA table. It checks every
//! region access against the region's size before the device sees it.
//!
//! **Guest memory** is reached only through the [`Port`] the server hands the device when it
//! is made: `port.dma()` is a [`memvisor::DmaSpace`] holding what the client mapped, with VFIO
//! type1's rules. `dma_read` / `dma_write` check the whole range first (mapped, contiguous,
//! readable resp. writable), then copy: a copy that fails changes nothing, and its errno
//! (EINVAL unmapped, EPERM not allowed) goes into the `RESULT` register. A device never builds
//! a `&[u8]` over guest memory; the guest may unmap it at any moment, and the DMA table is what
//! makes that safe.
//!
//! **Which thread.** `write` runs on the server's message loop, so this device copies right
//! there, with the `DmaSpace`'s own `dma_read` / `dma_write`: those reach memory the client
//! shared as a file, and fail with EFAULT for memory the client mapped without one. Reaching
//! that too takes [`Port::dma_read`] / [`Port::dma_write`], which ask the client with
//! `DMA_READ` / `DMA_WRITE` messages whose replies the loop reads; they must run on a thread of
//! the device's own, as the reference device `mvdma` (src/dmadev.rs) does.
//!
//! BAR0 registers (32-bit, little-endian): 0x00/0x04 `SRC` low/high, 0x08/0x0c `DST` low/high,
//! 0x10 `LEN` (1 to 64 KiB), 0x14 `GO` (write-only; any value copies), 0x18 `RESULT`
//! (read-only: 0 after a good copy, else the errno; `u32::MAX` before the first).
//!
//! **Serving it**: one client after another on a listening socket, for QEMU's `vfio-user-pci`
//! (the project's trials use QEMU 11.1):
//!
//! ```text
//! cargo run --release -p memvisor-vfio-user --example memcopy -- /tmp/memcopy.sock
//! qemu-system-x86_64 ... -machine q35,memory-backend=mem -m 1G \
//!     -object memory-backend-memfd,id=mem,size=1G,share=on \
//!     -device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/memcopy.sock"}}'
//! ```
//!
//! `tests/memcopy_example.rs` drives it with the crate's client. More in docs/devices.md.

use std::os::unix::net::UnixListener;
use std::sync::Arc;

use memvisor::{DmaConfig, Iova};
use memvisor_vfio_user::proto::region_flags;
use memvisor_vfio_user::server::PCI_DEVICE;
use memvisor_vfio_user::{Device, Error, IrqInfo, Port, RegionInfo, Result, Server};

// Register offsets in BAR0.
/// BAR0 register: the IOVA to copy from (64 bits).
pub const SRC: u64 = 0x00;
/// BAR0 register: the IOVA to copy to (64 bits).
pub const DST: u64 = 0x08;
/// BAR0 register: bytes to copy (32 bits).
pub const LEN: u64 = 0x10;
/// BAR0 register: a write starts the copy.
pub const GO: u64 = 0x14;
/// BAR0 register: the outcome of the last copy.
pub const RESULT: u64 = 0x18;
/// Largest copy.
pub const MAX_LEN: u32 = 64 << 10;
/// VFIO's region indices for PCI: BAR0 is 0, the config space 7, of 9.
const BAR0: u32 = 0;
const CONFIG: u32 = 7;

/// The copy engine.
pub struct MemCopy {
    port: Arc<Port>,
    regs: [u32; 7],
    config: [u8; 256],
    /// Bytes copied, all copies.
    pub bytes: u64,
}

impl MemCopy {
    /// The device on `port` (what [`Server::new`] calls with the port it made).
    pub fn new(port: Arc<Port>) -> MemCopy {
        let mut d = MemCopy {
            port,
            regs: [0; 7],
            config: [0; 256],
            bytes: 0,
        };
        d.power_on();
        d
    }

    fn power_on(&mut self) {
        self.regs = [0, 0, 0, 0, 0, 0, u32::MAX];
        let c = &mut self.config;
        *c = [0; 256];
        c[0..4].copy_from_slice(&[0x34, 0x12, 0xf1, 0x11]); // vendor 0x1234, device 0x11f1
        c[0x0a] = 0x80; // class 0x0880: other system peripheral
        c[0x0b] = 0x08;
        // BAR0 (0x10): 32-bit memory; bits 0-11 read 0, so the size is 4 KiB.
    }

    fn copy(&mut self) -> memvisor::Result<()> {
        let addr = |lo: usize| u64::from(self.regs[lo]) | u64::from(self.regs[lo + 1]) << 32;
        let (src, dst, len) = (addr(0), addr(2), self.regs[4]);
        if len == 0 || len > MAX_LEN {
            return Err(memvisor::Error::Invalid(format!(
                "memcopy: LEN {len}: 1 to {MAX_LEN} bytes"
            )));
        }
        // The device's own buffer: the bytes cross it, guest memory is never borrowed.
        let mut buf = vec![0u8; len as usize];
        let dma = self.port.dma();
        dma.dma_read(Iova(src), &mut buf)?;
        dma.dma_write(Iova(dst), &buf)?;
        self.bytes += u64::from(len);
        Ok(())
    }
}

impl Device for MemCopy {
    fn flags(&self) -> u32 {
        PCI_DEVICE
    }

    fn regions(&self) -> Vec<RegionInfo> {
        let rw = region_flags::READ | region_flags::WRITE;
        let mut r = vec![RegionInfo::default(); 9];
        r[BAR0 as usize] = RegionInfo {
            size: 4096,
            flags: rw,
        };
        r[CONFIG as usize] = RegionInfo {
            size: 256,
            flags: rw,
        };
        r
    }

    fn irqs(&self) -> Vec<IrqInfo> {
        // INTx, MSI, MSI-X, ERR, REQ: none used.
        vec![IrqInfo::default(); 5]
    }

    fn read(&mut self, region: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        if region == CONFIG {
            // In bounds: the server checked the access against the region's size.
            let at = offset as usize;
            buf.copy_from_slice(&self.config[at..at + buf.len()]);
            return Ok(());
        }
        let value = match (offset, buf.len()) {
            (o, 4) if o % 4 == 0 && o <= RESULT => self.regs[(o / 4) as usize],
            (o, 4) if o % 4 == 0 => 0,
            (o, n) => return Err(bad(o, n)),
        };
        buf.copy_from_slice(&value.to_le_bytes());
        Ok(())
    }

    fn write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        if region == CONFIG {
            // Writable: the command register's memory-space and bus-master bits, and BAR0's
            // address bits above its 4 KiB size.
            for (i, &b) in data.iter().enumerate() {
                let at = offset as usize + i;
                let mask = match at {
                    0x04 => 0x06,
                    0x11 => 0xf0,
                    0x12 | 0x13 => 0xff,
                    _ => 0,
                };
                self.config[at] = (self.config[at] & !mask) | (b & mask);
            }
            return Ok(());
        }
        let value = match <[u8; 4]>::try_from(data) {
            Ok(v) if offset % 4 == 0 && offset < RESULT => u32::from_le_bytes(v),
            _ => return Err(bad(offset, data.len())),
        };
        if offset == GO {
            let result = self.copy();
            if let Err(e) = &result {
                log::info!("memcopy: copy refused: {e}");
            }
            self.regs[(RESULT / 4) as usize] = result.map_or_else(|e| e.errno() as u32, |()| 0);
        } else {
            self.regs[(offset / 4) as usize] = value;
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        // Copies end within `write`: nothing is in flight and nothing is pinned.
        self.power_on();
        Ok(())
    }

    fn stats(&self) -> serde_json::Value {
        serde_json::json!({ "bytes": self.bytes })
    }
}

fn bad(offset: u64, len: usize) -> Error {
    Error::BadRegion(format!(
        "memcopy BAR0: a {len}-byte access at {offset:#x}; registers are 32-bit, \
         writable up to {GO:#x}"
    ))
}

/// Serves the device on the socket path given, one client after another, until killed.
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: memcopy SOCKET")?;
    // Binding fails if something is at the path already: remove a stale socket by hand.
    let listener = UnixListener::bind(&path)?;
    eprintln!("memcopy: serving on {path}");
    for sock in listener.incoming() {
        let server = Server::new(
            sock?,
            DmaConfig::default(),
            memvisor::SharedMappings::global(),
            MemCopy::new,
        )?;
        // Ends when the client leaves, with every mapping dropped.
        let (stats, end) = server.serve();
        eprintln!(
            "memcopy: client gone ({end:?}), {} requests",
            stats.requests
        );
    }
    Ok(())
}
