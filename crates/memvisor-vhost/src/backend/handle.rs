//! The back end's answer to each front-end request, one arm per message: checked first, then
//! applied, so a refused request leaves the state as it was (the module above explains the
//! protocol and the serving loop). Features and protocol features; the memory table
//! (`SET_MEM_TABLE`, `ADD_MEM_REG`, `REM_MEM_REG`); the rings (`SET_VRING_*`,
//! `GET_VRING_BASE`, which drains the dirty log first); the IOTLB (`IOTLB_MSG` updates apply and
//! let waiting rings go on, invalidations remove); config space, the dirty log (`SET_LOG_BASE`),
//! the inflight log (`GET_INFLIGHT_FD` / `SET_INFLIGHT_FD`) and device status. By the time a
//! request gets here the device has nothing in flight and no ring is lent to a worker.

use super::*;

impl<D: Device + 'static> Backend<D> {
    /// Applies one request; `Some(payload)` for requests that answer with data.
    pub(super) fn handle(&mut self, mut msg: Message) -> Result<Option<Vec<u8>>> {
        let request = msg.header.request;
        let p = &msg.payload[..];
        match request {
            req::GET_FEATURES => {
                proto::exact(request, p, 0)?;
                Ok(Some(self.offered().to_le_bytes().to_vec()))
            }
            req::SET_FEATURES => {
                let f = proto::u64_payload(request, p)?;
                let unknown = f & !self.offered();
                if unknown != 0 {
                    return Err(Error::NotOffered {
                        request: "SET_FEATURES",
                        asked: f,
                        unknown,
                    });
                }
                self.device
                    .set_features(f & !(F_PROTOCOL_FEATURES | F_LOG_ALL))?;
                self.memory_mut().set_iotlb(f & F_IOMMU_PLATFORM != 0)?;
                let log_all = f & F_LOG_ALL != 0;
                if log_all && !self.memory.is_logging() {
                    self.memory_mut().start_logging()?;
                    log::info!("{}: dirty logging on", self.device.name());
                } else if !log_all && self.memory.is_logging() {
                    self.drain_log()?;
                    self.memory_mut().stop_logging()?;
                    log::info!(
                        "{}: dirty logging off ({} pages logged)",
                        self.device.name(),
                        self.live.stats().logged_pages
                    );
                }
                self.acked = f;
                if f & F_PROTOCOL_FEATURES == 0 {
                    // Without protocol features a ring is enabled from the start.
                    for v in &mut self.vrings {
                        v.enabled = true;
                    }
                }
                Ok(None)
            }
            req::GET_PROTOCOL_FEATURES => {
                proto::exact(request, p, 0)?;
                Ok(Some(self.protocol_offered().to_le_bytes().to_vec()))
            }
            req::SET_PROTOCOL_FEATURES => {
                let f = proto::u64_payload(request, p)?;
                let unknown = f & !self.protocol_offered();
                if unknown != 0 {
                    return Err(Error::NotOffered {
                        request: "SET_PROTOCOL_FEATURES",
                        asked: f,
                        unknown,
                    });
                }
                self.protocol_acked = f;
                Ok(None)
            }
            req::SET_OWNER => Ok(None),
            req::RESET_OWNER | req::RESET_DEVICE => {
                self.reset()?;
                Ok(None)
            }
            req::GET_QUEUE_NUM => {
                proto::exact(request, p, 0)?;
                Ok(Some((self.vrings.len() as u64).to_le_bytes().to_vec()))
            }
            req::GET_MAX_MEM_SLOTS => {
                proto::exact(request, p, 0)?;
                Ok(Some((MAX_REGIONS as u64).to_le_bytes().to_vec()))
            }
            req::SET_MEM_TABLE => {
                let regions = proto::mem_table(p)?;
                let fds = std::mem::take(&mut msg.fds);
                self.memory_mut().set_table(&regions, fds)?;
                self.record_table();
                log::info!(
                    "{}: memory table of {} regions",
                    self.device.name(),
                    regions.len()
                );
                Ok(None)
            }
            req::ADD_MEM_REG => {
                let r = proto::single_region(request, p)?;
                let fd = msg.take_fd("the region")?;
                self.memory_mut().add(r, fd)?;
                self.record_table();
                Ok(None)
            }
            req::REM_MEM_REG => {
                // QEMU attaches a descriptor it need not; it is closed with the message.
                let r = proto::single_region(request, p)?;
                // Removed first: a refused removal leaves the rings running. Nothing reads a
                // ring between the two (no request is in flight while a message is handled).
                self.memory_mut().remove(r)?;
                self.stop_rings_in(r.gpa, r.size);
                self.record_table();
                Ok(None)
            }
            req::SET_VRING_NUM => {
                let (i, num) = proto::vring_state(request, p)?;
                let max = self.queue_max();
                if num == 0 || num > u32::from(max) || !num.is_power_of_two() {
                    return Err(Error::BadRing(format!(
                        "SET_VRING_NUM {num} for ring {i}: {} takes a power of two from 1 to {max}",
                        self.device.name()
                    )));
                }
                let v = self.ring(request, i)?;
                v.size = num as u16;
                Ok(None)
            }
            req::SET_VRING_ADDR => {
                let a = proto::vring_addr(p)?;
                self.ring(request, a.index)?;
                let addrs = self.ring_addresses(&a)?;
                let v = &mut self.vrings[a.index as usize];
                // A running ring may be told its own addresses again: QEMU does that to set the
                // log flag when migration starts. Moving a running ring is refused.
                if v.started && v.addr != Some(addrs) {
                    return Err(Error::RingRunning {
                        request: "SET_VRING_ADDR",
                        index: a.index,
                    });
                }
                v.addr = Some(addrs);
                v.pending = None;
                let misses = self.ring_misses(a.index as usize);
                if !misses.is_empty() {
                    // Not translatable yet: ask, and start the ring on the update.
                    self.vrings[a.index as usize].pending = Some(a);
                    self.send_misses(None, &misses);
                }
                Ok(None)
            }
            req::IOTLB_MSG => {
                let m = proto::IotlbMsg::parse(p)?;
                match m.kind {
                    proto::iotlb::UPDATE => {
                        let prot = match m.perm {
                            1 => Prot::READ,
                            2 => Prot::WRITE,
                            3 => Prot::RW,
                            other => {
                                return Err(Error::BadIotlb(format!(
                                    "IOTLB update of iova {:#x}: permission {other} is not 1, 2 or 3",
                                    m.iova
                                )));
                            }
                        };
                        let t0 = std::time::Instant::now();
                        self.memory_mut()
                            .iotlb_update(m.iova, m.size, m.uaddr, prot)?;
                        self.live
                            .protocol()
                            .iotlb_ns
                            .add(t0.elapsed().as_nanos() as u64);
                        if let Some(r) = self.record.as_mut() {
                            r.update(m.iova, m.size, m.uaddr, m.perm);
                        }
                        self.live.protocol().iotlb_updates.add(1);
                        self.iotlb_answered(m.iova, m.size)?;
                    }
                    proto::iotlb::INVALIDATE => {
                        if !self.memory.is_iotlb() {
                            return Err(Error::NotNegotiated {
                                request: "IOTLB_MSG invalidate",
                                feature: "VIRTIO_F_IOMMU_PLATFORM",
                            });
                        }
                        let t0 = std::time::Instant::now();
                        #[cfg(feature = "test-hooks")]
                        if self.memory.faults().ignore_invalidate == Some(m.iova) {
                            return Ok(None);
                        }
                        self.memory_mut().iotlb_invalidate(m.iova, m.size)?;
                        self.live
                            .protocol()
                            .iotlb_ns
                            .add(t0.elapsed().as_nanos() as u64);
                        if let Some(r) = self.record.as_mut() {
                            r.invalidate(m.iova, m.size);
                        }
                        self.live.protocol().iotlb_invalidates.add(1);
                    }
                    other => {
                        return Err(Error::BadIotlb(format!(
                            "IOTLB message type {other} from the frontend: expected UPDATE (2) or \
                             INVALIDATE (3)"
                        )));
                    }
                }
                Ok(None)
            }
            req::SET_VRING_BASE => {
                let (i, base) = proto::vring_state(request, p)?;
                if base > u16::MAX as u32 {
                    return Err(Error::BadRing(format!(
                        "SET_VRING_BASE {base} for ring {i}: a split ring index is 16 bits"
                    )));
                }
                self.ring(request, i)?.base = base as u16;
                Ok(None)
            }
            req::GET_VRING_BASE => {
                let (i, _) = proto::vring_state(request, p)?;
                // Everything the ring's requests wrote is in the log before the frontend hears
                // the ring stopped.
                self.drain_log()?;
                let v = self.ring(request, i)?;
                let next = v.queue.as_ref().map_or(v.base, |q| q.next_avail());
                v.started = false;
                v.kick = None;
                v.queue = None;
                v.base = next;
                // A start still waiting for the IOTLB is called off too: stopped means no
                // later update may start the ring.
                v.pending = None;
                v.pending_kick = None;
                v.miss_deadline = None;
                v.missing_since = None;
                v.awaiting.clear();
                Ok(Some(proto::vring_state_bytes(i, next as u32)))
            }
            req::SET_VRING_KICK | req::SET_VRING_CALL | req::SET_VRING_ERR => {
                let arg = proto::u64_payload(request, p)?;
                let i = (arg & 0xff) as u32;
                let fd = if arg & proto::VRING_NOFD != 0 {
                    if !msg.fds.is_empty() {
                        return Err(Error::Invalid(format!(
                            "{}: no-descriptor flag set but a descriptor was sent",
                            req::name(request)
                        )));
                    }
                    None
                } else {
                    Some(File::from(msg.take_fd("the eventfd")?))
                };
                self.ring(request, i)?;
                log::debug!(
                    "{}: {} ring {i} fd {}",
                    self.device.name(),
                    req::name(request),
                    fd.is_some()
                );
                match request {
                    req::SET_VRING_KICK => {
                        let Some(kick) = fd else {
                            return Err(Error::Unsupported {
                                request: format!(
                                    "SET_VRING_KICK for ring {i} without a descriptor"
                                ),
                                why: "polling rings are not supported".into(),
                            });
                        };
                        let v = &mut self.vrings[i as usize];
                        if v.pending.is_some() {
                            // Waiting for the IOTLB to translate the ring: start on the update.
                            v.pending_kick = Some(kick);
                        } else if v.started && v.queue.is_some() {
                            // A new eventfd for a running ring: only the fd changes. Starting
                            // it again would take it back to its SET_VRING_BASE and serve
                            // requests already served. A kick the old eventfd got and nobody
                            // read goes with it: the ring is looked at once now.
                            v.kick = Some(kick);
                            self.process(i as usize)?;
                        } else {
                            self.start_ring(i as usize, kick)?;
                        }
                    }
                    req::SET_VRING_CALL => self.vrings[i as usize].call = fd,
                    _ => self.vrings[i as usize].err = fd,
                }
                Ok(None)
            }
            req::SET_VRING_ENABLE => {
                let (i, on) = proto::vring_state(request, p)?;
                if on > 1 {
                    return Err(Error::BadRing(format!(
                        "SET_VRING_ENABLE {on} for ring {i}: 0 or 1"
                    )));
                }
                if self.acked & F_PROTOCOL_FEATURES == 0 {
                    return Err(Error::NotNegotiated {
                        request: "SET_VRING_ENABLE",
                        feature: "VHOST_USER_F_PROTOCOL_FEATURES",
                    });
                }
                self.ring(request, i)?.enabled = on == 1;
                if on == 1 && self.vrings[i as usize].started {
                    // Kicks that came while the ring was disabled were read and not acted on.
                    self.process(i as usize)?;
                }
                Ok(None)
            }
            req::GET_CONFIG => {
                let (offset, size, _) = proto::config(request, p)?;
                let mut data = vec![0u8; size as usize];
                self.device.read_config(offset, &mut data);
                Ok(Some(proto::config_bytes(offset, 0, &data)))
            }
            req::SET_CONFIG => {
                let (offset, _, data) = proto::config(request, p)?;
                self.device.write_config(offset, data)?;
                Ok(None)
            }
            req::SET_BACKEND_REQ_FD => {
                let fd = msg.take_fd("the back-end channel")?;
                let ch = UnixStream::from(fd);
                // A frontend that stops reading its channel must not stop the back end: a
                // message that cannot go within the wait gives the channel up
                // (`Backend::send_backend_req`).
                ch.set_write_timeout(Some(BACKEND_REQ_WAIT))
                    .map_err(|source| Error::Os {
                        op: "setsockopt(SO_SNDTIMEO) on the back-end channel",
                        source,
                    })?;
                self.backend_req = Some(ch);
                Ok(None)
            }
            req::SET_LOG_BASE => {
                let (size, offset) = proto::log_base(p)?;
                let fd = msg.take_fd("the dirty log")?;
                let mapped = size.checked_next_multiple_of(4096).ok_or_else(|| {
                    Error::BadRegion(format!("SET_LOG_BASE: log size {size:#x} is too large"))
                })?;
                let memory = Backing::from_fd(fd, offset, mapped).map_err(|e| {
                    Error::BadRegion(format!(
                        "SET_LOG_BASE: log of {size:#x} bytes at offset {offset:#x}: {e}"
                    ))
                })?;
                self.drain_log()?;
                self.log = Some(Arc::new(SharedLog::new(Arc::new(memory), size)?));
                log::info!(
                    "{}: dirty log of {size} bytes ({} GiB of guest memory)",
                    self.device.name(),
                    (size * 8 * 4096) >> 30
                );
                // With LOG_SHMFD the frontend waits for this reply.
                Ok(Some(0u64.to_le_bytes().to_vec()))
            }
            req::SET_LOG_FD => Ok(None),
            req::GET_INFLIGHT_FD => {
                self.inflight_negotiated(request)?;
                let want = proto::Inflight::parse(request, p)?;
                let n = self.vrings.len();
                if usize::from(want.num_queues) > n {
                    return Err(Error::Invalid(format!(
                        "GET_INFLIGHT_FD for {} queues: the device has {n}",
                        want.num_queues
                    )));
                }
                let region = InflightRegion::create(want.num_queues, want.queue_size)?;
                let reply = proto::Inflight {
                    mmap_size: region.size(),
                    mmap_offset: 0,
                    ..want
                };
                log::info!(
                    "{}: inflight log of {} bytes for {} queues of {}",
                    self.device.name(),
                    reply.mmap_size,
                    want.num_queues,
                    want.queue_size
                );
                self.inflight = Some(region);
                Ok(Some(reply.bytes()))
            }
            req::SET_INFLIGHT_FD => {
                self.inflight_negotiated(request)?;
                let d = proto::Inflight::parse(request, p)?;
                let fd = msg.take_fd("the inflight log")?;
                if self.vrings.iter().any(|v| v.started) {
                    return Err(Error::Invalid(
                        "SET_INFLIGHT_FD while rings run: the log is read when a ring starts"
                            .into(),
                    ));
                }
                self.inflight = Some(InflightRegion::map(
                    fd,
                    d.mmap_offset,
                    d.mmap_size,
                    d.num_queues,
                    d.queue_size,
                )?);
                Ok(None)
            }
            req::SET_STATUS => {
                let s = proto::u64_payload(request, p)?;
                self.status = s as u8;
                Ok(None)
            }
            req::GET_STATUS => {
                proto::exact(request, p, 0)?;
                Ok(Some(u64::from(self.status).to_le_bytes().to_vec()))
            }
            _ => Err(Error::Unsupported {
                request: format!("request {request} ({})", req::name(request)),
                why: "not supported by this back end".into(),
            }),
        }
    }

    /// Refuses an inflight request the frontend did not negotiate.
    fn inflight_negotiated(&self, request: u32) -> Result<()> {
        if self.protocol_acked & protocol::INFLIGHT_SHMFD == 0 {
            return Err(Error::NotNegotiated {
                request: req::name(request),
                feature: "VHOST_USER_PROTOCOL_F_INFLIGHT_SHMFD",
            });
        }
        Ok(())
    }
}
