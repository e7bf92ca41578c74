//! Live update of a mapping's host memory (`VFIO_DMA_UNMAP_FLAG_VADDR`, then
//! `VFIO_DMA_MAP_FLAG_VADDR`): the IOVAs stay mapped while the memory behind them is swapped,
//! e.g. when a VMM re-execs.
//!
//! [`DmaSpace::invalidate_vaddr`] marks whole mappings `Memory::Invalidated` in one published
//! change and takes their old memory back as an unmap does (`retire`: copies in flight end,
//! device pins are asked back and waited for). Until [`DmaSpace::update_vaddr`] names each
//! mapping whole and gives it new memory, nothing reaches the old address: under
//! [`VaddrRule::Wait`] (Linux 5.12-6.2) a translation, copy or pin there waits for the update
//! up to [`DmaConfig::vaddr_wait`](super::DmaConfig::vaddr_wait) (`wait_for_vaddr`, woken by
//! `Shared::updated`); under [`VaddrRule::Refuse`] (Linux 6.3 on) it fails at once with EBUSY,
//! and an invalidation is refused while a device that pins is attached.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{DmaSpace, Host, Memory, PinMode, VaddrRule, retire, whole_mappings};
use crate::addr::{Hva, Iova};
use crate::backing::Backing;
use crate::error::{Error, Result};
use crate::sync::lock;

impl DmaSpace {
    /// Invalidates the host address of every mapping inside `[iova, iova + size)`
    /// (`VFIO_DMA_UNMAP_FLAG_VADDR`); returns the bytes invalidated. The IOVAs stay mapped, but
    /// until [`DmaSpace::update_vaddr`] nothing reaches the old memory. EINVAL, nothing changed,
    /// if the range cuts a mapping or any mapping in it is already invalidated. The old memory
    /// is unpinned; pins devices hold there are asked back and waited for as for
    /// [`DmaSpace::unmap`] (EBUSY, nothing changed, if they stay past
    /// [`DmaConfig::unpin_wait`](super::DmaConfig::unpin_wait)). In Eager mode `update_vaddr`
    /// pins the new memory.
    pub fn invalidate_vaddr(&self, iova: Iova, size: u64) -> Result<u64> {
        if self.shared.config.vaddr_rule == VaddrRule::Refuse && self.has_unmap_notifiers() {
            return Err(Error::Busy {
                addr: iova.0,
                why: "a device that pins is attached (an unmap notifier is registered); \
                      VaddrRule::Refuse, as Linux 6.3 on, allows no vaddr invalidation then"
                    .into(),
            });
        }
        let range = self.check_range(iova, size)?;
        let (first, last) = (range.start().0, range.last().0);
        let (bytes, ()) = self.retire(
            |_| true,
            |map, writer| {
                let hit = whole_mappings(map, first, last)?;
                for (start, m) in &hit {
                    match m.memory {
                        Memory::Local(_) => {}
                        Memory::Invalidated => {
                            return Err(Error::VaddrState {
                                addr: *start,
                                why: format!(
                                    "mapping at iova {start:#x} already has its vaddr invalidated"
                                ),
                            });
                        }
                        Memory::Remote => {
                            return Err(Error::VaddrState {
                                addr: *start,
                                why: format!(
                                    "mapping at iova {start:#x} is a peer's memory: it has no \
                                     vaddr to invalidate"
                                ),
                            });
                        }
                    }
                }
                for (start, m) in &hit {
                    let pos = map.find(*start).expect("found above");
                    map.set(pos, m.with(Memory::Invalidated, m.dirty.clone()));
                }
                writer.invalid += hit.len() as u64;
                Ok(retire::Plan {
                    ranges: hit.iter().map(|(s, m)| (*s, m.iova.last().0)).collect(),
                    old: hit,
                    made: Vec::new(),
                })
            },
            |_, _| {},
        )?;
        Ok(bytes)
    }

    /// Gives an invalidated mapping its new host memory: `size` bytes of `backing` from
    /// `offset` (`VFIO_DMA_MAP_FLAG_VADDR`). ENOENT if no mapping lies in the range; EINVAL if
    /// the mapping it touches does not start at `iova` with `size` bytes, or its vaddr is not
    /// invalidated.
    pub fn update_vaddr(
        &self,
        iova: Iova,
        size: u64,
        backing: &Arc<Backing>,
        offset: u64,
    ) -> Result<()> {
        let host = self.backing_host(backing, offset, size)?;
        self.update_host(iova, size, host)
    }

    /// [`DmaSpace::update_vaddr`] with caller-managed memory.
    ///
    /// # Safety
    /// As for [`DmaSpace::map_raw`].
    pub unsafe fn update_vaddr_raw(&self, iova: Iova, size: u64, hva: Hva) -> Result<()> {
        let host = self.raw_host(hva, size)?;
        self.update_host(iova, size, host)
    }

    fn update_host(&self, iova: Iova, size: u64, host: Host) -> Result<()> {
        let range = self.check_range(iova, size)?;
        self.change(|map, writer| {
            // Like type1 (`vfio_find_dma` over the whole range): any mapping the range touches
            // is the one it names, and it must match exactly.
            let pos = map
                .first_ending_at_or_after(range.start().0)
                .filter(|&p| map.get(p).0 <= range.last().0)
                .ok_or(Error::NotFound {
                    what: "dma mapping in the range starting at iova",
                    id: iova.0,
                })?;
            let (start, _, _, m) = map.get(pos);
            if start != iova.0 || m.iova.len() != size {
                return Err(Error::VaddrState {
                    addr: start,
                    why: format!(
                        "vaddr update of iova {iova}+{size:#x} must name the whole mapping \
                         [{start:#x}, {:#x}]",
                        m.iova.last().0
                    ),
                });
            }
            if !m.memory.is_invalidated() {
                return Err(Error::VaddrState {
                    addr: start,
                    why: format!(
                        "mapping at iova {iova} has no invalidated vaddr to update ({}); \
                         invalidate it first",
                        if m.is_remote() {
                            "it is a peer's memory"
                        } else {
                            "its vaddr is valid"
                        }
                    ),
                });
            }
            let new = m.with(Memory::Local(host), m.dirty.clone());
            if writer.mode == PinMode::Eager {
                let pinned = self.pin_mapping(&new)?;
                writer.eager.insert(new.id, pinned);
            }
            map.set(pos, new);
            writer.invalid -= 1;
            Ok(((), true))
        })?;
        let (mutex, cv) = &self.shared.updated;
        let _guard = lock(mutex);
        cv.notify_all();
        Ok(())
    }

    /// When a wait for a vaddr update that starts now gives up: `None` for never (a wait too
    /// long to express as an `Instant`, such as `Duration::MAX`).
    pub(super) fn vaddr_deadline(&self) -> Option<Instant> {
        Instant::now().checked_add(self.vaddr_wait())
    }

    /// How long an access waits for a vaddr update: never under [`VaddrRule::Refuse`].
    pub(super) fn vaddr_wait(&self) -> Duration {
        match self.shared.config.vaddr_rule {
            VaddrRule::Wait => self.shared.config.vaddr_wait,
            VaddrRule::Refuse => Duration::ZERO,
        }
    }

    /// Waits until the mapping at `iova` has a valid host address or `deadline` passes (never,
    /// for `None`); returns whether it is valid now.
    pub(super) fn wait_for_vaddr(&self, iova: Iova, deadline: Option<Instant>) -> bool {
        let (mutex, cv) = &self.shared.updated;
        let mut guard = lock(mutex);
        loop {
            // The read ends before the wait: a reader holds up publication (`current`).
            let valid = {
                let snap = self.shared.current.load();
                // Unmapped meanwhile: let the caller report it.
                (snap.map.find(iova.0)).is_none_or(|pos| snap.map.get(pos).2.valid())
            };
            if valid {
                return true;
            }
            guard = match deadline {
                None => cv.wait(guard).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return false;
                    }
                    cv.wait_timeout(guard, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }
}
