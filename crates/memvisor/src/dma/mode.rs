//! Pin modes: whether mapping memory pins it.
//!
//! Like VFIO type1, a DMA space pins in one of two ways, depending on who consumes it:
//!
//! * [`PinMode::Lazy`] — only emulated devices are attached. They reach memory through the CPU
//!   (`translate`, `dma_read` / `dma_write`) and pin just the pages they hand to asynchronous I/O
//!   with `pin_pages`. `map` pins nothing.
//! * [`PinMode::Eager`] — a consumer that needs everything resident and fixed is attached (a
//!   hardware IOMMU, a device that DMAs by physical address, RDMA). `map` pins each new mapping
//!   whole before it becomes visible, all or nothing; `unmap` unpins it. Switching Lazy -> Eager
//!   replays: every existing mapping is pinned, and if one fails, every pin the switch made is
//!   dropped again and the space stays Lazy. Switching back unpins all of them, as type1 does when
//!   the last IOMMU-backed group detaches.
//!
//! A mapping pinned in Eager mode keeps its pin record here, keyed by the mapping's id — the
//! request (to unpin exactly what was pinned) and its extents: runs contiguous in IOVA and, when
//! the space reads frames, in physical address. Invalidating a mapping's host address (live
//! update) unpins the old memory; `update_vaddr` pins the new one.

use std::collections::HashMap;

use super::{DmaSpace, Mapping, Shared, Writer};
use crate::addr::{Hva, Iova};
use crate::error::{Error, Result};
use crate::pin::{HostExtent, PinRequest};

/// Whether mapping pins; see the module documentation.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PinMode {
    /// Map records only; devices pin what they use through `pin_pages`.
    #[default]
    Lazy,
    /// Map pins every mapping whole.
    Eager,
}

/// A pinned piece of a mapping, contiguous in IOVA, host address and (when frames were read)
/// physical address: what an IOMMU would be programmed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    /// First IOVA.
    pub iova: Iova,
    /// Host address of the first byte.
    pub hva: Hva,
    /// Bytes.
    pub len: u64,
    /// Physical frame number of the first page, when the space reads frames.
    pub pfn: Option<u64>,
}

/// What the space pinned for one mapping.
#[derive(Debug)]
pub(super) struct Pinned {
    req: PinRequest,
    extents: Vec<HostExtent>,
}

impl DmaSpace {
    /// The current pin mode.
    pub fn pin_mode(&self) -> PinMode {
        self.writer().mode
    }

    /// Switches the pin mode. Lazy -> Eager pins every mapping (the replay); if any pin fails,
    /// nothing the switch pinned stays pinned, the mode stays Lazy and the error (ENOMEM past the
    /// locked-memory limit) is returned. Eager -> Lazy unpins every mapping.
    pub fn set_pin_mode(&self, mode: PinMode) -> Result<()> {
        self.change(|map, writer| {
            if writer.mode == mode {
                return Ok(((), false));
            }
            match mode {
                PinMode::Eager => {
                    let live: Vec<_> = map
                        .iter()
                        .filter(|(_, _, hot, _)| hot.valid())
                        .map(|(_, _, _, m)| m.clone())
                        .collect();
                    let pinned = self.pin_all(live.iter().map(|m| &**m))?;
                    writer.eager.extend(pinned);
                }
                PinMode::Lazy => {
                    for (_, p) in writer.eager.drain() {
                        self.shared.registry.unpin(&p.req);
                    }
                }
            }
            let before = writer.scope();
            writer.mode = mode;
            // Leaving Eager mode ends the all-mapped dirty scope (its consumer logged nothing).
            super::dirty::scope_ended(writer, before, map);
            Ok(((), false))
        })
    }

    /// The extents of the mapping at `iova` (its first byte), in IOVA order. ENOENT if no
    /// mapping starts there; EINVAL if it is not pinned (Lazy mode, or its host address is
    /// invalidated).
    pub fn extents(&self, iova: Iova) -> Result<Vec<Extent>> {
        let writer = self.writer();
        let snap = self.shared.current.load();
        let (start, _, hot, m) = snap
            .map
            .find(iova.0)
            .map(|pos| snap.map.get(pos))
            .filter(|&(start, ..)| start == iova.0)
            .ok_or(Error::NotFound {
                what: "dma mapping starting at iova",
                id: iova.0,
            })?;
        let pinned = writer.eager.get(&m.id).ok_or_else(|| {
            Error::NotPinned(format!(
                "mapping at iova {iova} is not pinned (pin mode {:?}{}); only Eager mode pins \
                 whole mappings",
                writer.mode,
                if hot.valid() {
                    ""
                } else {
                    ", vaddr invalidated"
                }
            ))
        })?;
        Ok(pinned
            .extents
            .iter()
            .map(|x| Extent {
                iova: Iova(start + (x.hva.0 - pinned.req.hva)),
                hva: x.hva,
                len: x.len,
                pfn: x.pfn,
            })
            .collect())
    }

    /// Pins the whole of `m`.
    pub(super) fn pin_mapping(&self, m: &Mapping) -> Result<Pinned> {
        let req = self.shared.pin_request(m);
        let extents = self.shared.registry.pin(&req)?;
        Ok(Pinned { req, extents })
    }

    /// Pins every mapping of `ms`, all or nothing.
    pub(super) fn pin_all<'a>(
        &self,
        ms: impl IntoIterator<Item = &'a Mapping>,
    ) -> Result<HashMap<u64, Pinned>> {
        let mut done = HashMap::new();
        for m in ms {
            match self.pin_mapping(m) {
                Ok(p) => {
                    done.insert(m.id, p);
                }
                Err(e) => {
                    for (_, p) in done {
                        self.shared.registry.unpin(&p.req);
                    }
                    return Err(e);
                }
            }
        }
        Ok(done)
    }

    /// Drops the space's own pin of mapping `id`, if it holds one.
    pub(super) fn unpin_mapping(&self, writer: &mut Writer, id: u64) {
        if let Some(p) = writer.eager.remove(&id) {
            self.shared.registry.unpin(&p.req);
        }
    }
}

impl Shared {
    /// The pin request that covers all of `m`'s memory.
    pub(super) fn pin_request(&self, m: &Mapping) -> PinRequest {
        let host = m
            .memory
            .host()
            .expect("only mappings with memory are pinned");
        PinRequest {
            hva: host.hva.0,
            len: m.iova.len(),
            granule: host.granule(),
            unsplittable: host.unsplittable(),
            large_folios: host.large_folios(),
            batch: self.config.pin_batch,
            frames: self.config.frames,
            // Whole mappings are unpinned when they are unmapped, when their memory may go too.
            keep: false,
            lock: true,
        }
    }

    /// The request for part of `m` that a device pins through `pin_pages`: `len` bytes from host
    /// address `hva`, without frames (devices get host addresses). Its locks go to the lock
    /// cache when it is unpinned: an unmap or vaddr invalidation of `m` empties the cache over
    /// `m`'s memory (`retire`, `release_cached`), as does dropping the space.
    pub(super) fn device_request(&self, m: &Mapping, hva: u64, len: u64) -> PinRequest {
        PinRequest {
            hva,
            len,
            frames: false,
            keep: true,
            ..self.pin_request(m)
        }
    }

    /// Drops the pins `eager` holds (the space is going away).
    pub(super) fn drop_eager(&self, eager: HashMap<u64, Pinned>) {
        for (_, p) in eager {
            self.registry.unpin(&p.req);
        }
    }
}
