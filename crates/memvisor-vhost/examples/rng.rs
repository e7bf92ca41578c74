//! A device of your own on memvisor-vhost: virtio-rng (virtio device id 4) in a few dozen lines.
//!
//! **The device.** virtio-rng has one queue and no config space. The guest's driver posts
//! device-writable buffers; the device fills each with random bytes and returns it with the
//! number of bytes written. That is all of [`Device`]'s required methods: a name, the feature
//! bits (`VIRTIO_F_VERSION_1` only), one queue, accept the driver's features, a config space
//! that reads as zeros, `process`, and `reset`. The back end ([`Backend`]) does the vhost-user
//! protocol: features, the memory table, the rings' addresses, kicks and interrupts.
//!
//! **Guest memory** is reached only through the [`FrontendMemory`] handed to `process`: its
//! device space ([`FrontendMemory::dma`], a [`memvisor::DmaSpace`]) translates the addresses the
//! driver put in the descriptors, and `dma_write` copies into them with bounds and permission
//! checks and dirty-page tracking. A device never builds a `&[u8]` or `&mut [u8]` over guest
//! memory: the guest may change or take back that memory at any moment, which a Rust reference
//! forbids (undefined behaviour). A buffer that does not translate ends that request (the chain
//! goes back with the bytes written before it), never the device.
//!
//! **Chains** are taken with virtio-queue's iterator over the [`Ring`] (it dereferences to
//! `virtio_queue::Queue`), marked with [`Ring::taken`], and returned with [`Ring::add_used`];
//! those two keep the inflight log when the frontend shares one. The ring itself is read
//! through the device space's vm-memory view (`dma.memory()`), like the buffers. Heads a crashed
//! predecessor left in flight come from [`Ring::resubmit`]; this device does not ask for the
//! inflight log (`protocol_features` stays 0), so there are none.
//!
//! **Serving it** is [`Backend::new`] and [`Backend::serve`] on a listening Unix socket; QEMU
//! drives it with its generic vhost-user device:
//!
//! ```text
//! cargo run --release -p memvisor-vhost --example rng -- /tmp/rng.sock
//! qemu-system-x86_64 ... -machine q35,memory-backend=mem -m 1G \
//!     -object memory-backend-memfd,id=mem,size=1G,share=on \
//!     -chardev socket,id=rng,path=/tmp/rng.sock \
//!     -device vhost-user-test-device-pci,chardev=rng,virtio-id=4,num_vqs=1
//! ```
//!
//! In the guest, `cat /sys/class/misc/hw_random/rng_current` names `virtio_rng.0` and
//! `/dev/hwrng` reads from this process (`guest/trial.sh rng` checks that with QEMU 11.1).
//! `tests/rng_example.rs` drives [`Rng`] through the crate's test frontend. More in
//! docs/devices.md.

use std::os::unix::net::UnixListener;
use std::sync::atomic::AtomicBool;

use memvisor::{Iova, PinRegistry, SharedMappings};
use memvisor_vhost::device::Processed;
use memvisor_vhost::{Backend, Device, FrontendMemory, ProcessState, Result, Ring};
use virtio_queue::QueueOwnedT;

/// virtio-rng: fills every device-writable buffer of a chain with random bytes.
#[derive(Default)]
pub struct Rng {
    /// Bytes handed to the guest so far.
    pub bytes: u64,
}

/// virtio 1.0 (`VIRTIO_F_VERSION_1`), which a vhost-user device must offer.
const VERSION_1: u64 = 1 << 32;

impl Device for Rng {
    fn name(&self) -> &'static str {
        "example-rng"
    }
    fn features(&self) -> u64 {
        VERSION_1
    }
    fn queues(&self) -> u16 {
        1
    }
    fn set_features(&mut self, _features: u64) -> Result<()> {
        Ok(())
    }
    fn read_config(&self, _offset: u32, data: &mut [u8]) {
        data.fill(0);
    }
    fn reset(&mut self) {}

    fn process(
        &mut self,
        _index: u16,
        ring: &mut Ring,
        memory: &FrontendMemory,
    ) -> Result<Processed> {
        let dma = memory.dma().clone();
        let mem = dma.memory();
        let mut returned = false;
        // The iterator is re-created per chain: `taken` and `add_used` need the ring back.
        while let Some(chain) = ring.iter(&mem).ok().and_then(|mut avail| avail.next()) {
            let head = chain.head_index();
            ring.taken(head);
            let mut written = 0u32;
            for desc in chain.filter(|d| d.is_write_only()) {
                match fill(&dma, desc.addr().0, desc.len()) {
                    Ok(()) => written += desc.len(),
                    Err(e) => {
                        log::warn!("rng: buffer at {:#x}: {e}", desc.addr().0);
                        break;
                    }
                }
            }
            self.bytes += u64::from(written);
            if let Err(e) = ring.add_used(&mem, head, written) {
                log::warn!("rng: cannot return chain {head}: {e}");
            }
            returned = true;
        }
        Ok(Processed::served(
            returned && ring.needs_notification(&mem).unwrap_or(true),
        ))
    }
}

/// Writes `len` random bytes at device address `addr`, a page-sized piece at a time.
fn fill(dma: &memvisor::DmaSpace, addr: u64, len: u32) -> std::io::Result<()> {
    let mut piece = [0u8; 4096];
    let mut done = 0u64;
    while done < u64::from(len) {
        let n = (u64::from(len) - done).min(piece.len() as u64) as usize;
        random(&mut piece[..n])?;
        let at = addr
            .checked_add(done)
            .ok_or(std::io::ErrorKind::InvalidInput)?;
        dma.dma_write(Iova(at), &piece[..n])
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        done += n as u64;
    }
    Ok(())
}

/// Fills `buf` (the device's own memory, not the guest's) from the kernel's random pool.
fn random(buf: &mut [u8]) -> std::io::Result<()> {
    // TEST ONLY (feature `test-hooks`): zeros instead, for the real-guest trial's negative
    // control (guest/trial.sh rng --negative), which must then see the guest's check fail.
    #[cfg(feature = "test-hooks")]
    if std::env::var_os("MEMVISOR_TEST_RNG_ZEROS").is_some() {
        buf.fill(0);
        return Ok(());
    }
    let mut at = 0;
    while at < buf.len() {
        let rest = &mut buf[at..];
        // SAFETY: the pointer and length are those of `rest`, a live slice of a local buffer.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        match n {
            n if n > 0 => at += n as usize,
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// Serves the device on the socket path given, one frontend after another, until killed.
fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: rng SOCKET")?;
    // Binding fails if something is at the path already: remove a stale socket by hand.
    let listener = UnixListener::bind(&path)?;
    let mut backend = Backend::new(
        Rng::default(),
        &ProcessState::new(SharedMappings::global(), PinRegistry::global()),
    )?;
    eprintln!("example-rng: serving virtio-rng on {path}");
    backend.serve(&listener, &AtomicBool::new(false))?;
    Ok(())
}
