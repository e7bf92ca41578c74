//! How the blk device meets the back end ([`Device`]): the features and config space it
//! offers, processing a queue (the module above explains the request flow), ending the
//! transfers the kernel finished, polling, and the copy of itself a ring worker serves one
//! queue with.

use super::*;
use crate::device::{Processed, Used};

impl Device for Blk {
    fn name(&self) -> &'static str {
        "vhost-user-blk"
    }

    fn features(&self) -> u64 {
        let mut f = 1u64 << F_VERSION_1
            | 1 << F_SEG_MAX
            | 1 << F_BLK_SIZE
            | 1 << F_FLUSH
            | 1 << F_RING_INDIRECT
            | 1 << VIRTIO_RING_F_EVENT_IDX;
        if self.options.queues > 1 {
            f |= 1 << F_MQ;
        }
        if self.options.read_only {
            f |= 1 << 5; // VIRTIO_BLK_F_RO
        } else {
            f |= 1 << F_WRITE_ZEROES;
            // A block device that cannot discard is not offered DISCARD.
            if self.disk.discard_limits().is_some() {
                f |= 1 << F_DISCARD;
            }
        }
        if self.disk.topology().is_some() {
            f |= 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_TOPOLOGY;
        }
        if self.options.iommu {
            f |= crate::proto::F_IOMMU_PLATFORM;
        }
        f
    }

    fn protocol_features(&self) -> u64 {
        // Completions come in the order the kernel finishes them: a frontend restarting the
        // back end needs the inflight log to know which requests to hand it again.
        crate::proto::protocol::CONFIG | crate::proto::protocol::INFLIGHT_SHMFD
    }

    fn supports_dirty_log(&self) -> bool {
        // Every write goes through the frontend memory's device space (preadv into translated,
        // pinned pages; dma_write for status and ID) or its slots (the rings).
        true
    }

    fn queues(&self) -> u16 {
        self.options.queues
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        self.acked = features;
        Ok(())
    }

    fn read_config(&self, offset: u32, data: &mut [u8]) {
        let c = self.config();
        for (i, b) in data.iter_mut().enumerate() {
            *b = c.get(offset as usize + i).copied().unwrap_or(0);
        }
    }

    fn process(
        &mut self,
        index: u16,
        queue: &mut Ring,
        memory: &FrontendMemory,
    ) -> Result<Processed> {
        let dma = memory.dma().clone();
        let mut batch = Vec::new();
        let mut any = false;
        let taken = self.take(index, queue, memory, &mut batch, &mut any);
        // Whatever stopped the taking (the ring empty, a miss to ask about, a broken ring),
        // what it prepared goes to the kernel.
        self.launch(index, queue, &dma, &mut batch, &mut any);
        if let Some(misses) = taken? {
            return Ok(Processed::Missed { misses });
        }
        Ok(Processed::Served {
            notify: any && queue.needs_notification(&dma.memory()).unwrap_or(true),
        })
    }

    fn reset(&mut self) {
        self.acked = 0;
    }

    fn set_fail_misses(&mut self, fail: bool) {
        self.fail_misses = fail;
    }

    fn completion_fd(&self) -> Option<std::os::fd::RawFd> {
        self.disk.completion_fd()
    }

    fn complete(&mut self, memory: &FrontendMemory, wait: bool) -> Result<Vec<Used>> {
        let dma = memory.dma().clone();
        let mut used = Vec::new();
        loop {
            #[allow(unused_mut)]
            let mut ended = self.disk.finished(wait);
            #[cfg(feature = "test-hooks")]
            let reorder = memory.faults().reorder;
            #[cfg(feature = "test-hooks")]
            if reorder {
                ended.reverse();
            }
            for (i, (key, result)) in ended.into_iter().enumerate() {
                #[cfg(feature = "test-hooks")]
                if reorder && i > 0 {
                    std::thread::sleep(memvisor::faults::REORDER_GAP);
                }
                let _ = i;
                let slot = key as usize;
                let Some(mut o) = self.out.get_mut(slot).and_then(Option::take) else {
                    log::error!("blk: a transfer ended under key {key}, which names none");
                    continue;
                };
                let (offset, read) = (o.ready.sector * SECTOR, o.ready.to_guest);
                let moved = match result {
                    Ok(n) if n > 0 && o.done + n < o.ready.total => {
                        // Short: go on from where it stopped.
                        o.done += n;
                        advance(&mut o.ready.iov, n as usize);
                        // SAFETY: as in `launch`: the same pinned memory, the rest of it.
                        if unsafe { self.disk.start(&o.ready.iov, offset + o.done, read, key) } {
                            self.out[slot] = Some(o);
                            continue;
                        }
                        // SAFETY: as above, for the length of this call.
                        unsafe {
                            self.disk
                                .rw_vectored(&mut o.ready.iov, offset + o.done, read)
                        }
                        .map(|m| o.done + m)
                    }
                    Ok(0) if o.done < o.ready.total => Err(Error::Os {
                        op: if read { "read" } else { "write" },
                        source: std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            format!(
                                "the image ended at byte {} during a transfer",
                                offset + o.done
                            ),
                        ),
                    }),
                    Ok(n) => Ok(o.done + n),
                    Err(e) => Err(e),
                };
                self.free.push(slot);
                let (_, written) = self.end_transfer(o.ring, &dma, o.status_at, o.ready, moved);
                used.push(Used {
                    ring: o.ring,
                    head: o.head,
                    len: written,
                });
            }
            self.disk.submit();
            if !wait || self.disk.in_flight() == 0 {
                break;
            }
        }
        Ok(used)
    }

    fn queue_worker(&self) -> Option<Blk> {
        // The same image through a second descriptor (one open file: the same flags,
        // O_DIRECT included), with an io_uring of its own; it counts in the same live
        // counters, on its queue's block.
        let file = self.disk.file().try_clone().ok()?;
        let mut b = Blk::new(file, self.options.clone()).ok()?;
        b.acked = self.acked;
        b.live = self.live.clone();
        Some(b)
    }

    fn poll(&self) -> Option<std::time::Duration> {
        (self.options.poll_us > 0)
            .then(|| std::time::Duration::from_micros(u64::from(self.options.poll_us)))
    }
}
