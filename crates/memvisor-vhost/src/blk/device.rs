//! How the blk device meets the back end ([`Device`]): taking chains off a queue and walking
//! each request's buffers once (the module above explains the request flow), ending the
//! transfers the kernel finished, polling, and the copy of itself a ring worker serves one
//! queue with.

use std::time::Instant;

use memvisor::dma::{DmaCursor, Miss, SgBuf, SgGuard, SgWalk};
use memvisor::{DmaSpace, Prot};
use virtio_bindings::virtio_blk::{VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT};
use virtio_queue::QueueOwnedT;

use super::fixed::Claim;
use super::io::{Pages, Ready, ns_between};
use super::request::{Failure, Framing, Outcome, frame, read_header};
use super::throttle::Wake;
use super::{Blk, SECTOR};
use crate::device::{Device, Processed, Used};
use crate::disk::{IN_FLIGHT, advance};
use crate::error::{Error, Result};
use crate::memory::FrontendMemory;
use crate::ring::{Desc as Buf, Ring};

/// Safety timers a deferred ring gets with no pass looking at it before the device stops
/// waking for it ([`Blk::throttle_woke`]).
const MAX_IDLE_FIRES: u8 = 10;
/// The safety timer: how soon the loop looks again when a wake-up may not have been acted on.
const SAFETY_WAKE: std::time::Duration = std::time::Duration::from_millis(1);

/// Ring `index`'s bit in [`Blk`]'s set of deferred rings (rings past 63 share the last bit).
fn ring_bit(index: u16) -> u64 {
    1 << index.min(63)
}

impl Device for Blk {
    fn name(&self) -> &'static str {
        "vhost-user-blk"
    }

    fn features(&self) -> u64 {
        self.offered_features()
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
        let c = self.config_space();
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
        // This ring is being looked at: a deferral of it is answered (or made again below).
        self.deferred &= !ring_bit(index);
        self.looked = true;
        let dma = memory.dma().clone();
        self.follow_fixed(index, memory);
        let mut batch = std::mem::take(&mut self.batch);
        let mut any = false;
        let mut bufs = std::mem::take(&mut self.chain);
        let taken = self.take(index, queue, memory, &mut batch, &mut any, &mut bufs);
        self.chain = bufs;
        // Whatever stopped the taking (the ring empty, a miss to ask about, a broken ring),
        // what it prepared goes to the kernel.
        self.launch(index, queue, &dma, &mut batch, &mut any);
        self.batch = batch;
        // What ended during the pass lets its pages go before its chains are handed back; the
        // next pass reads its own clock.
        self.release_ended();
        self.pass_at = None;
        if let Some(misses) = taken? {
            return Ok(Processed::Missed { misses });
        }
        Ok(Processed::Served {
            notify: any && queue.needs_notification(&dma.memory()).unwrap_or(true),
        })
    }

    fn reset(&mut self) {
        self.acked = 0;
        // The next frontend reads the capacity as it is; a change no one heard is not news.
        self.capacity.forget_change();
        // The rings are gone with the frontend: no deferral is owed to them.
        self.deferred = 0;
    }

    fn attach(&mut self, memory: &FrontendMemory) -> Result<()> {
        #[cfg(feature = "test-hooks")]
        {
            self.silent_resize = memory.faults().silent_resize;
        }
        let _ = memory;
        Ok(())
    }

    fn config_changed(&mut self) -> bool {
        let changed = self.capacity.take_change();
        #[cfg(feature = "test-hooks")]
        if changed && self.silent_resize {
            log::warn!("TEST ONLY: blk capacity changed; the frontend is not told");
            return false;
        }
        changed
    }

    fn set_fail_misses(&mut self, fail: bool) {
        self.fail_misses = fail;
    }

    fn completion_fd(&self) -> Option<std::os::fd::RawFd> {
        match &self.wake {
            // Fires for the throttle's timer or the io_uring's completions.
            Some(w) => Some(w.fd(self.disk.completion_fd())),
            None => self.disk.completion_fd(),
        }
    }

    fn pass_began(&mut self, at: Instant) {
        self.pass_at = Some(at);
    }

    fn complete(&mut self, memory: &FrontendMemory, wait: bool) -> Result<Vec<Used>> {
        let mut used = Vec::new();
        self.complete_into(memory, wait, &mut used)?;
        Ok(used)
    }

    fn complete_into(
        &mut self,
        memory: &FrontendMemory,
        wait: bool,
        used: &mut Vec<Used>,
    ) -> Result<()> {
        self.throttle_woke();
        used.clear();
        let dma = memory.dma().clone();
        let mut ended = std::mem::take(&mut self.ended);
        loop {
            self.disk.finished_into(wait, &mut ended);
            #[cfg(feature = "test-hooks")]
            let reorder = memory.faults().reorder;
            #[cfg(feature = "test-hooks")]
            if reorder {
                ended.reverse();
            }
            // (With `reorder`, the ring service pauses between the chains it puts back.)
            for (key, result) in ended.drain(..) {
                let slot = key as usize;
                let Some(mut o) = self.out.get_mut(slot).and_then(Option::take) else {
                    log::error!("blk: a transfer ended under key {key}, which names none");
                    continue;
                };
                let (offset, read) = (o.ready.sector * SECTOR, o.ready.to_guest);
                let result = match result {
                    Err(Error::Os { source, .. })
                        if o.ready.fixed.as_ref().is_some_and(|c| c.usable)
                            && matches!(
                                source.raw_os_error(),
                                Some(libc::EINVAL | libc::EOPNOTSUPP | libc::EFAULT)
                            ) =>
                    {
                        // The kernel refused the fixed transfer itself (no READV_FIXED before
                        // Linux 6.15): nothing moved; it goes again the ordinary way, counted.
                        if o.ready.iov.len() > 1 {
                            if let Some(f) = self.fixed.as_mut() {
                                f.refuse_vectored();
                            }
                        }
                        // Its claim stays: it keeps the pages from a discard until the end.
                        if let Some(c) = o.ready.fixed.as_mut() {
                            c.usable = false;
                        }
                        self.count(o.ring).fixed.sub(1);
                        self.count(o.ring).fixed_fallbacks.add(1);
                        // SAFETY: as in `launch`: the same held memory.
                        if unsafe { self.disk.start(&o.ready.iov, offset + o.done, read, key) } {
                            self.out[slot] = Some(o);
                            continue;
                        }
                        // SAFETY: as above, for the length of this call.
                        unsafe {
                            self.disk
                                .rw_vectored(&mut o.ready.iov, offset + o.done, read)
                        }
                    }
                    r => r,
                };
                let moved = match result {
                    Ok(n) if n > 0 && o.done + n < o.ready.total => {
                        // Short: go on from where it stopped (through the same registered
                        // buffer, whose chunk still counts it in flight, if it went so).
                        o.done += n;
                        advance(&mut o.ready.iov, n as usize);
                        let again = match o.ready.fixed.as_ref().and_then(|c| c.slot()) {
                            // SAFETY: as in `launch`: the same held memory, the rest of it,
                            // inside the same registered chunk.
                            Some(s) => unsafe {
                                self.disk
                                    .start_fixed(&o.ready.iov, offset + o.done, read, key, s)
                            },
                            // SAFETY: as in `launch`: the same held memory, the rest of it.
                            None => unsafe {
                                self.disk.start(&o.ready.iov, offset + o.done, read, key)
                            },
                        };
                        if again {
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
                    Ok(0) if o.done < o.ready.total => Err(crate::disk::image_ended(
                        if read { "read" } else { "write" },
                        offset + o.done,
                    )),
                    Ok(n) => Ok(o.done + n),
                    Err(e) => Err(e),
                };
                self.free.push(slot);
                let written = self.end_transfer(o.ring, &dma, o.ready, moved);
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
        // Every guard of what ended goes before the chains are handed back, and the batch's
        // one clock read (two with guards) ends their latencies.
        self.release_ended();
        // A discard may have woken this thread to give registered chunks up.
        if let Some(f) = self.fixed.as_mut() {
            f.service(&mut self.disk);
            let q = f.queue;
            self.count_fixed(q);
        }
        self.ended = ended;
        Ok(())
    }

    fn join_worker(&mut self, worker: Blk) {
        // Its ring comes back here with requests the throttle held back, maybe: look soon.
        if worker.deferred != 0 {
            self.deferred |= worker.deferred;
            self.ensure_wake();
            if let Some(w) = &self.wake {
                w.arm(SAFETY_WAKE);
            }
        }
    }

    fn queue_worker(&self) -> Option<Blk> {
        // The same image through a second descriptor (one open file: the same flags,
        // O_DIRECT included), with an io_uring of its own; it counts in the same live
        // counters, on its queue's block.
        let file = self.disk.file().try_clone().ok()?;
        let mut b = Blk::new(file, self.options.clone()).ok()?;
        b.acked = self.acked;
        b.live = self.live.clone();
        b.capacity = self.capacity.clone();
        if self.deferred != 0 {
            // The ring lent may hold requests the throttle held back here: the worker looks
            // soon rather than at the next kick.
            b.deferred = self.deferred;
            b.ensure_wake();
            if let Some(w) = &b.wake {
                w.arm(SAFETY_WAKE);
            }
        }
        Some(b)
    }

    fn after_replies(&mut self) {
        // Off the request: the pass's replies are out, so registering the chunks its
        // transfers found cold (~2 ms each) delays none of them (`blk::fixed`).
        let Some(f) = self.fixed.as_mut() else {
            return;
        };
        #[cfg(feature = "test-hooks")]
        if let (true, Some(hook)) = (f.has_cold(), self.before_register.as_mut()) {
            hook();
        }
        f.after_replies(&mut self.disk);
        let q = f.queue;
        self.count_fixed(q);
    }

    fn poll(&self) -> Option<std::time::Duration> {
        (self.options.poll_us > 0)
            .then(|| std::time::Duration::from_micros(u64::from(self.options.poll_us)))
    }
}

impl Blk {
    /// With `fixed_buffers`: makes the registered-buffer table on the first pass (on the
    /// ring's thread), and empties it when the memory table changed since the last pass.
    fn follow_fixed(&mut self, index: u16, memory: &FrontendMemory) {
        if !self.options.fixed_buffers {
            return;
        }
        if self.fixed.is_none() {
            #[cfg(feature = "test-hooks")]
            if memory.faults().no_fixed {
                return;
            }
            #[cfg(feature = "test-hooks")]
            let no_evict = memory.faults().fixed_no_evict;
            #[cfg(not(feature = "test-hooks"))]
            let no_evict = false;
            self.fixed = Some(super::fixed::BlkFixed::new(no_evict));
        }
        if let Some(f) = self.fixed.as_mut() {
            f.queue = index;
            f.follow(&mut self.disk, memory);
        }
    }

    /// Takes the available chains of queue `index`: requests done at once go back to the used
    /// ring, reads and writes ready for the kernel into `batch` (run when it is full, and by
    /// the caller at the end). Sets `any` when something went back. Behind a vIOMMU, returns
    /// the unmapped pages a request needs (the chain put back, for the back end to ask about).
    /// Each chain's buffers are read into `bufs`, kept between passes.
    fn take(
        &mut self,
        index: u16,
        queue: &mut Ring,
        memory: &FrontendMemory,
        batch: &mut Vec<(u16, Ready)>,
        any: &mut bool,
        bufs: &mut Vec<Buf>,
    ) -> Result<Option<Vec<memvisor::dma::Miss>>> {
        // Rings, descriptors and indirect tables are all read at device addresses, through
        // the device space (the IOTLB behind a vIOMMU).
        let dma = memory.dma().clone();
        let mem = dma.memory();
        let ask = memory.is_iotlb() && !self.fail_misses;
        // With registered buffers, requests are translated on this pass's cursor.
        let mut cursor = self.fixed.is_some().then(|| dma.cursor());
        loop {
            // Heads a back end before this one left in flight come first (the driver kicked
            // for them long ago), then the available ring.
            let redo = queue.resubmit();
            let head = match redo {
                Some(head) => head,
                None => match queue.next_head(&mem) {
                    Ok(Some(head)) => head,
                    Ok(None) => {
                        // With event indexes, re-arm and look once more for a late arrival.
                        if queue.enable_notification(&mem).unwrap_or(false) {
                            continue;
                        }
                        break;
                    }
                    Err(e) => {
                        if let (true, Some(m)) = (ask, mem.take_miss()) {
                            return Ok(Some(vec![m]));
                        }
                        return Err(Error::BadRing(format!(
                            "queue {index}: available ring unusable: {e}"
                        )));
                    }
                },
            };
            let (indirect, cut) = match queue.read_chain(&mem, head, bufs) {
                Ok(indirect) => (indirect, None),
                Err(e) => match mem.take_miss() {
                    // A descriptor behind a vIOMMU not in the IOTLB: put the chain back and ask.
                    Some(m) if ask => {
                        match redo {
                            Some(head) => queue.resubmit_later(head),
                            None => queue.go_to_previous_position(),
                        }
                        return Ok(Some(vec![m]));
                    }
                    // Cut short by a miss with no one to ask: failed below, with no status.
                    Some(m) => (false, Some(m)),
                    None => {
                        if redo.is_none() {
                            queue.taken(head);
                        }
                        self.count(index).failed.add(1);
                        log::warn!("blk: queue {index}: request {head} not served: {e}");
                        if let Err(e) = queue.add_used(&mem, head, 0) {
                            log::warn!("blk: queue {index}: cannot return head {head}: {e}");
                        }
                        *any = true;
                        continue;
                    }
                },
            };
            // The header, data and status byte each get descriptors of their own, however the
            // driver laid them out (`request::frame`).
            let framing = if cut.is_none() {
                frame(bufs)
            } else {
                Err("chain cut short".into())
            };
            // One walk of the device space per request: it holds the buffers' pages and
            // finds their host addresses, or finds what is not mapped. Behind a vIOMMU every
            // buffer must be mapped before anything is done; else (and for a chain cut short)
            // put the chain back and let the back end ask — for every unmapped page of the
            // chain's buffers at once, not one round trip per page ([`crate::miss`]).
            // A read or write the throttle holds back stays on the ring, untaken, and the ring
            // waits for the device's timer ([`super::throttle`]).
            // It is counted only once it goes, not when put back for a miss.
            let mut admitted = None;
            if cut.is_none() {
                match self.throttled(&dma, bufs, &framing) {
                    Err(wait) => {
                        match redo {
                            Some(head) => queue.resubmit_later(head),
                            None => queue.go_to_previous_position(),
                        }
                        self.defer(index, wait);
                        break;
                    }
                    Ok(go) => admitted = go,
                }
            }
            let claimed = match (&mut cursor, cut) {
                (Some(cursor), None) => match framing {
                    Ok(header) => self.claim_fixed(cursor, bufs, header),
                    Err(_) => None,
                },
                _ => None,
            };
            let walk = match claimed {
                Some((claim, iov)) => Ok(Walk::Chunk(claim, iov)),
                None => self.hold(index, &dma, bufs).map(|w| match w {
                    SgWalk::Held(g) => Walk::Held(g),
                    SgWalk::Missed(m) => Walk::Missed(m),
                }),
            };
            if ask {
                let mut misses: Vec<memvisor::dma::Miss> = cut.into_iter().collect();
                if let Ok(Walk::Missed(m)) = &walk {
                    let room = crate::miss::MAX_MISSES.saturating_sub(misses.len());
                    misses.extend(m.iter().take(room));
                }
                if !misses.is_empty() {
                    match redo {
                        Some(head) => queue.resubmit_later(head),
                        None => queue.go_to_previous_position(),
                    }
                    return Ok(Some(misses));
                }
            }
            if let Some((write, bytes)) = admitted {
                self.live.throttle().account(write, bytes);
            }
            if redo.is_none() {
                queue.taken(head);
            }
            self.count(index).indirect.add(u64::from(indirect));
            let written = match cut {
                Some(m) => {
                    // Cut short, with no one to ask: there is no status byte to write.
                    self.count(index).failed.add(1);
                    log::warn!(
                        "blk: queue {index}: descriptor chain {head} unreadable at iova {:#x}",
                        m.iova.0
                    );
                    0
                }
                None => {
                    let held = match walk {
                        Ok(Walk::Held(guard)) => Ok(Pages::Held(guard)),
                        Ok(Walk::Chunk(claim, iov)) => Ok(Pages::Chunk(claim, iov)),
                        Ok(Walk::Missed(m)) => Err(Failure::Hold(Error::BadChain(format!(
                            "buffer at iova {:#x} is not in guest memory",
                            m[0].iova.0
                        )))),
                        Err(e) => Err(Failure::Hold(e.into())),
                    };
                    match self.request(index, &dma, bufs, &framing, held) {
                        (_, Outcome::Ready(ready)) => {
                            batch.push((head, ready));
                            if batch.len() + self.disk.in_flight() >= IN_FLIGHT {
                                self.launch(index, queue, &dma, batch, any);
                                if self.free.is_empty() {
                                    // As many out as the device keeps: the rest of the ring
                                    // waits for completions, after which the back end comes
                                    // back.
                                    break;
                                }
                            }
                            continue;
                        }
                        (status, outcome) => self.finish(index, &dma, status, outcome),
                    }
                }
            };
            // A transfer done here (bounced) lets its pages go before its chain goes back.
            self.release_ended();
            if let Err(e) = queue.add_used(&mem, head, written) {
                log::warn!("blk: queue {index}: cannot return head {head}: {e}");
            }
            *any = true;
        }
        Ok(None)
    }

    /// How long the read or write of `bufs` must wait for the throttle (`Err`), or, if it may
    /// go, what to count once it does (`Ok(Some((write, bytes)))`; anything else, and a chain
    /// whose header cannot be read, is not throttled: `Ok(None)`).
    fn throttled(
        &mut self,
        dma: &DmaSpace,
        bufs: &[Buf],
        framing: &Framing,
    ) -> std::result::Result<Option<(bool, u64)>, std::time::Duration> {
        if !self.live.throttle().is_on() {
            return Ok(None);
        }
        // TEST ONLY: the throttle is accepted and shown, and never holds a request back.
        #[cfg(feature = "test-hooks")]
        if dma.faults().ignore_throttle {
            return Ok(None);
        }
        let Ok(header) = *framing else {
            return Ok(None);
        };
        let Ok(hdr) = read_header(dma, &bufs[..header]) else {
            return Ok(None);
        };
        let write = match u32::from_le_bytes(hdr[..4].try_into().expect("4")) {
            VIRTIO_BLK_T_IN => false,
            VIRTIO_BLK_T_OUT => true,
            _ => return Ok(None),
        };
        let data = bufs.get(header..bufs.len() - 1).unwrap_or_default();
        let bytes = data.iter().map(|b| u64::from(b.len)).sum();
        // At the pass's clock: no clock read of its own.
        let now = self.pass_clock();
        let Some(wait) = self.live.throttle().wait_at(write, now) else {
            return Ok(Some((write, bytes)));
        };
        self.ensure_wake();
        // Without a timer to come back on, the request goes (said once in the log).
        match self.wake {
            Some(_) => Err(wait),
            None => Ok(Some((write, bytes))),
        }
    }

    /// Makes the throttle's timer, once (said once in the log if it cannot be made).
    fn ensure_wake(&mut self) {
        if self.wake.is_none() && !self.no_wake {
            match Wake::new() {
                Ok(w) => self.wake = Some(w),
                Err(e) => {
                    log::warn!("blk: no timer for the throttle ({e}): requests go unthrottled");
                    self.no_wake = true;
                }
            }
        }
    }

    /// Has the serving loop come back after `wait` for ring `index`, whose requests the
    /// throttle held back.
    fn defer(&mut self, index: u16, wait: std::time::Duration) {
        self.deferred |= ring_bit(index);
        self.idle_fires = 0;
        if let Some(w) = &self.wake {
            w.arm(wait);
        }
        if self.options.poll_us > 0 {
            // A polling loop would find the held-back chains again at once: pause between
            // looks instead of spinning (bounded, so messages and a stop wait at most this).
            std::thread::sleep(wait.min(std::time::Duration::from_millis(1)));
        }
    }

    /// Called from [`Device::complete`], which the serving loops call when the device's
    /// descriptor fires — and then serve every ring holding requests — but also at the end of
    /// each pass and before a message, where no ring is served after it. So a fired timer is
    /// taken here without losing the wake-up it stands for: fired while rings were being
    /// served (it may be the deferral just made, with a wait already over), it is set again at
    /// once for the loop to see; seen by the loop itself, a short safety timer stays behind in
    /// case nothing serves the rings after this call (a message came first). A deferred ring
    /// that no pass looks at through [`MAX_IDLE_FIRES`] safety timers is not served here any
    /// more (stopped, or lent to a worker): the device stops waking for it.
    fn throttle_woke(&mut self) {
        let Some(w) = &self.wake else {
            return;
        };
        let looked = std::mem::take(&mut self.looked);
        if !w.take_fired() || self.deferred == 0 {
            return;
        }
        if looked {
            w.arm(std::time::Duration::from_micros(1));
        } else if self.idle_fires < MAX_IDLE_FIRES {
            self.idle_fires += 1;
            w.arm(SAFETY_WAKE);
        } else {
            self.deferred = 0;
        }
    }

    /// With registered buffers: the chain's data buffers translated, with no hold and no walk
    /// of the hold table, and counted in flight on the registered chunk they all lie in, with
    /// their iovecs; `None` (the chain goes the ordinary way, [`Blk::hold`]) when they span two
    /// chunks, the chunk is cold, evicting or refused, dirty pages are logged, or a buffer does
    /// not translate (a miss or a bad buffer, which the hold's walk reports).
    ///
    /// Why no hold is needed: a hold keeps a request's pages from two things, an unmap and a
    /// discard, and re-marks its written pages dirty when it ends.
    /// - **Unmap.** Guest memory leaves this process's space only through a vhost-user message
    ///   (a new memory table, an IOTLB invalidation, a log base or features change), and the
    ///   back end waits for every transfer out before it handles any message (module `blk`
    ///   and `crate::backend`), so no unmap can meet a transfer in flight; and the chunk is
    ///   keyed by host address, so a later IOTLB change cannot make it name other memory. A
    ///   new memory table empties every slot before the next transfer ([`BlkFixed::follow`]).
    /// - **Discard.** The only discard that can reach pinned guest memory in this process is
    ///   the balloon's (free page reporting included), and it asks the chunk's gate first: the
    ///   gate skips a chunk whose in-flight count is above 0 (busy), and the count and the
    ///   eviction are taken under one lock, so either the claim sees the chunk evicting (and
    ///   the chain goes the ordinary way) or the discard sees it busy (`blk::fixed`).
    /// - **Dirty pages.** While dirty pages are logged nothing is claimed (`may_claim`): the
    ///   ordinary way's guard marks them.
    ///
    /// [`BlkFixed::follow`]: super::fixed::BlkFixed::follow
    fn claim_fixed(
        &mut self,
        cursor: &mut DmaCursor,
        bufs: &[Buf],
        header: usize,
    ) -> Option<(Claim, Vec<libc::iovec>)> {
        let f = self.fixed.as_mut()?;
        f.begin();
        // Header descriptors, data buffers, a status byte: nothing else moves data.
        if bufs.len() < header + 2 || !f.may_claim() {
            return None;
        }
        let sg = &mut self.sg;
        sg_from(sg, bufs);
        cursor.translate_sg_into(sg, &mut self.xlate).ok()?;
        let mut iov = self.iovs.take();
        iov.extend(
            (header..bufs.len() - 1)
                .flat_map(|i| self.xlate.buffer(i))
                .map(|s| libc::iovec {
                    iov_base: s.hva.0 as usize as *mut libc::c_void,
                    iov_len: s.len as usize,
                }),
        );
        match f.claim(&mut self.disk, &iov) {
            Some(c) => Some((c, iov)),
            None => {
                self.iovs.give(iov);
                None
            }
        }
    }

    /// Walks the buffers of a chain once ([`DmaSpace::hold_sg_into`]), timing it. The pages
    /// are counted in queue `q`'s own shard of the hold table, so two queues never share one.
    /// The guard's vectors come from a scratch the device keeps; the guard goes with the
    /// transfer and gives them back when it ends (`Blk::release_ended`), so a walk allocates
    /// nothing once as many have grown as transfers are out.
    fn hold(&mut self, q: u16, dma: &DmaSpace, bufs: &[Buf]) -> memvisor::Result<SgWalk> {
        sg_from(&mut self.sg, bufs);
        let mut scratch = self
            .scratches
            .pop()
            .unwrap_or_else(|| memvisor::dma::SgScratch::for_queue(q));
        scratch.set_queue(q);
        let start = self.now();
        let walk = dma.hold_sg_into(&self.sg, &mut scratch);
        let ns = ns_between(start, self.now());
        let c = self.count(q);
        c.holds.add(1);
        c.hold_ns.add(ns);
        walk
    }
}

/// What the walk of a chain found: its pages held, or claimed in a registered chunk
/// ([`Blk::claim_fixed`]), or the misses to ask about.
enum Walk {
    Held(SgGuard),
    Chunk(Claim, Vec<libc::iovec>),
    Missed(Vec<Miss>),
}

/// The chain's buffers as the walk's input, in `sg` (emptied first, kept by the device so a
/// request allocates nothing).
fn sg_from(sg: &mut Vec<SgBuf>, bufs: &[Buf]) {
    sg.clear();
    sg.extend(bufs.iter().map(|b| SgBuf {
        iova: memvisor::Iova(b.addr),
        len: u64::from(b.len),
        prot: if b.write { Prot::WRITE } else { Prot::READ },
    }));
}
