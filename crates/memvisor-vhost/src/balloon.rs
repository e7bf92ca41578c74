//! virtio-balloon (device id 5) over vhost-user: memvisor's balloon model
//! ([`memvisor::balloon::Balloon`]) on the rings a frontend hands over.
//!
//! QEMU has no vhost-user balloon front end; its generic `vhost-user-test-device-pci,
//! virtio-id=5,num_vqs=N,config_size=16` passes the device through: the queues, and the 16-byte
//! config space read and written with `GET_CONFIG` / `SET_CONFIG`. A queue that is not offered
//! takes no number, so `N` is 2 (inflate, deflate), plus 1 for the statistics queue when it is
//! offered, plus 1 for free page reporting: 3 by default, 4 with statistics
//! ([`BalloonDevice::queues`] says the same). Offered features: virtio 1.0, event indexes, free
//! page reporting and page poisoning; the statistics queue when a polling interval is set
//! ([`BalloonDevice::with_stats_interval`]); deflate on OOM when asked
//! ([`BalloonDevice::with_deflate_on_oom`]). Not `VIRTIO_F_ACCESS_PLATFORM`, which Linux's
//! balloon driver refuses, and not free page hinting.
//!
//! The target (`num_pages`) comes from a shared [`BalloonTarget`] that the command line and a
//! control socket set; when it changes the back end tells the frontend with a config change
//! message on the back-end channel, and the driver inflates or deflates towards it.
//!
//! **Statistics.** The driver keeps one buffer on the statistics queue; the device holds it and,
//! every interval, returns it ([`Device::due`] tells the back end when), and the driver answers
//! with fresh figures. The latest figures, with their time, `actual` and the target are kept in
//! a [`BalloonLive`] that other threads read while the device runs ([`BalloonLive::status`]).
//! `actual` changes are logged: every one at debug, reaching the target at info, and deflations
//! below the target (the guest taking pages back by itself, on OOM) at info at most every 5 s.
//!
//! Discards run through the frontend memory's slot table with the process's pin registry, and the
//! guest memory is mapped once per process ([`memvisor::SharedMappings`]): a page a block device
//! in the same process has pinned for I/O is skipped, not freed.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use memvisor::DiscardOptions;
use memvisor::balloon::{
    Balloon, QueueKind, ReportingStats, STATS_QUEUE_INDEX, VIRTIO_BALLOON_F_DEFLATE_ON_OOM,
    VIRTIO_BALLOON_F_REPORTING, VIRTIO_BALLOON_F_STATS_VQ,
};

use crate::backend::Device;
use crate::device::Processed;
use crate::error::{Error, Result};
use crate::memory::FrontendMemory;
use crate::ring::Ring;

/// virtio device id of a memory balloon.
pub const DEVICE_ID: u32 = 5;

/// The balloon's target in 4 KiB pages, shared with whoever sets it.
#[derive(Clone, Debug, Default)]
pub struct BalloonTarget(Arc<AtomicU32>);

impl BalloonTarget {
    /// Asks the guest to give up `pages` 4 KiB pages.
    pub fn set_pages(&self, pages: u32) {
        self.0.store(pages, Ordering::Relaxed);
    }

    /// The target in pages.
    pub fn pages(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The guest's latest memory statistics, as the driver sent them.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct GuestStatsStatus {
    /// When they came, in milliseconds since the Unix epoch.
    pub updated_unix_ms: u64,
    /// Statistics buffers accepted since the device was created.
    pub updates: u64,
    /// Every known tag the driver sent, by name (`free_memory`, `total_memory`, ...; sizes in
    /// bytes, faults and events as counts).
    pub values: BTreeMap<&'static str, u64>,
    /// Entries with a tag this device does not know.
    pub unknown_tags: u32,
}

/// What a balloon is doing now: a snapshot of [`BalloonLive`].
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct BalloonStatus {
    /// Pages asked of the guest: the target as set now (the driver hears of it while a
    /// frontend is connected).
    pub target_pages: u32,
    /// Pages the driver says it holds (`actual`).
    pub actual_pages: u32,
    /// The features the driver acked (0 before a driver negotiated).
    pub features: u64,
    /// Whether the statistics queue was negotiated.
    pub stats_queue: bool,
    /// Whether deflate on OOM was negotiated.
    pub deflate_on_oom: bool,
    /// The statistics polling interval in seconds (0: statistics not offered).
    pub stats_interval_secs: u64,
    /// Pages the guest took back below the target by itself (deflate on OOM), summed.
    pub deflated_below_target_pages: u64,
    /// The latest statistics, if any came.
    pub guest_stats: Option<GuestStatsStatus>,
    /// What the balloon model counted: chains, bytes discarded or kept, pages inflated and
    /// deflated, statistics buffers (running totals over every frontend; serialized beside the
    /// fields above).
    #[serde(flatten)]
    pub counts: ReportingStats,
}

/// A balloon's live status, shared between the thread serving it and any other (a control
/// socket, the report at exit). Cloning shares it.
#[derive(Clone, Debug, Default)]
pub struct BalloonLive {
    status: Arc<Mutex<BalloonStatus>>,
    target: BalloonTarget,
}

impl BalloonLive {
    /// A copy of the status now.
    pub fn status(&self) -> BalloonStatus {
        let mut s = self
            .status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        s.target_pages = self.target.pages();
        s
    }

    /// `actual` now, in pages.
    pub fn actual_pages(&self) -> u32 {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .actual_pages
    }

    fn update(&self, f: impl FnOnce(&mut BalloonStatus)) {
        f(&mut self.status.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// The vhost-user balloon device.
pub struct BalloonDevice {
    model: Option<Balloon>,
    target: BalloonTarget,
    queue_max: u16,
    reporting: bool,
    stats_interval: Duration,
    deflate_on_oom: bool,
    live: BalloonLive,
    /// When a deflation below the target was last logged at info, and the pages since.
    oom_logged: Option<std::time::Instant>,
    oom_unlogged: u64,
    /// TEST ONLY ([`Faults::balloon_stats_frozen`](memvisor::faults::Faults::balloon_stats_frozen),
    /// from the memory at attach): keep the driver's statistics buffer and never ask for a
    /// fresh one, so only the figures the driver primed the queue with arrive; the real-guest
    /// statistics trial must then FAIL.
    #[cfg(feature = "test-hooks")]
    stats_frozen: bool,
}

/// The least time between two info lines about deflations below the target.
const OOM_LOG_EVERY: Duration = Duration::from_secs(5);

impl BalloonDevice {
    /// A balloon whose target follows `target`: free page reporting offered, no statistics
    /// queue, no deflate on OOM.
    pub fn new(target: BalloonTarget) -> Self {
        BalloonDevice {
            model: None,
            // Any size the specification allows: the driver's buffers are taken one at a time.
            queue_max: crate::ring::MAX_QUEUE,
            reporting: true,
            stats_interval: Duration::ZERO,
            deflate_on_oom: false,
            live: BalloonLive {
                status: Arc::default(),
                target: target.clone(),
            },
            target,
            oom_logged: None,
            oom_unlogged: 0,
            #[cfg(feature = "test-hooks")]
            stats_frozen: false,
        }
    }

    /// The same device without free page reporting offered (inflate and deflate only; the
    /// reporting ring's slot stays, unused): what a balloon without it gives back, for
    /// comparison and negative controls.
    pub fn without_reporting(mut self) -> Self {
        self.reporting = false;
        self
    }

    /// Offers the statistics queue and asks the driver for fresh figures every `interval`
    /// (whole seconds are what a driver expects; zero offers no statistics queue).
    pub fn with_stats_interval(mut self, interval: Duration) -> Self {
        self.stats_interval = interval;
        self.live
            .update(|s| s.stats_interval_secs = interval.as_secs());
        self
    }

    /// Offers `VIRTIO_BALLOON_F_DEFLATE_ON_OOM` (or not): the guest may then take pages back
    /// from the balloon by itself when it runs out of memory.
    pub fn with_deflate_on_oom(mut self, on: bool) -> Self {
        self.deflate_on_oom = on;
        self
    }

    /// The live status, to read from other threads while the device runs.
    pub fn live(&self) -> BalloonLive {
        self.live.clone()
    }

    /// What the model counted (zeros before a frontend's memory was attached).
    pub fn stats(&self) -> ReportingStats {
        self.model.as_ref().map(|m| m.stats()).unwrap_or_default()
    }

    /// Pages the driver says it holds.
    pub fn actual_pages(&self) -> u32 {
        self.model.as_ref().map_or(0, |m| m.actual_pages())
    }

    fn stats_offered(&self) -> bool {
        !self.stats_interval.is_zero()
    }

    fn model(&mut self) -> Result<&mut Balloon> {
        self.model
            .as_mut()
            .ok_or_else(|| Error::Invalid("balloon used before its memory was attached".into()))
    }

    /// Copies the latest statistics into the live status.
    fn publish_stats(&self) {
        let Some(u) = self.model.as_ref().and_then(|m| m.guest_stats()) else {
            return;
        };
        let g = GuestStatsStatus {
            updated_unix_ms: u
                .at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            updates: u.count,
            values: u.stats.named().collect(),
            unknown_tags: u.stats.unknown_tags,
        };
        self.live.update(|s| s.guest_stats = Some(g));
    }

    /// [`Device::process`] itself.
    fn process_queue(
        &mut self,
        index: u16,
        ring: &mut Ring,
        _memory: &FrontendMemory,
    ) -> Result<bool> {
        let interval = self.stats_interval;
        #[cfg(feature = "test-hooks")]
        let frozen = self.stats_frozen;
        let model = self.model()?;
        // The balloon completes every chain before it returns (the statistics buffer it holds
        // is the driver's to resend, not a request) and offers no inflight log: the queue alone
        // will do.
        let queue = &mut **ring;
        let notify = match model.queue_kind(index) {
            Some(QueueKind::Inflate) => model.process_inflate(queue)?,
            Some(QueueKind::Deflate) => model.process_deflate(queue)?,
            Some(QueueKind::Stats) => {
                // The buffer goes back once the interval is over (a kick may come before).
                let due = !interval.is_zero()
                    && model
                        .stats_held_since()
                        .is_some_and(|t| t.elapsed() >= interval);
                #[cfg(feature = "test-hooks")]
                let due = due && !frozen;
                let asked = due && model.request_stats(queue)?;
                let returned = model.process_stats(queue)?;
                self.publish_stats();
                asked || returned
            }
            Some(QueueKind::Reporting) => model.process_reports(queue)?.notify,
            None => {
                return Err(Error::BadRing(format!(
                    "balloon: queue {index} is not in use with features {:#x}",
                    model.acked_features()
                )));
            }
        };
        Ok(notify)
    }
}

impl Device for BalloonDevice {
    fn name(&self) -> &'static str {
        "vhost-user-balloon"
    }

    fn attach(&mut self, memory: &FrontendMemory) -> Result<()> {
        // The pins to respect are those of the registry the device spaces pin through (the
        // process's, or one a test or an embedder handed the back end).
        let options = DiscardOptions {
            registry: Some(memory.registry().clone()),
            ..DiscardOptions::default()
        };
        let model = Balloon::new(memory.space().clone(), options, self.queue_max)?;
        self.model = Some(model);
        #[cfg(feature = "test-hooks")]
        {
            self.stats_frozen = memory.faults().balloon_stats_frozen;
        }
        Ok(())
    }

    fn features(&self) -> u64 {
        let mut all = self.model.as_ref().map_or(0, |m| m.device_features());
        if !self.reporting {
            all &= !(1 << VIRTIO_BALLOON_F_REPORTING);
        }
        if !self.stats_offered() {
            all &= !(1 << VIRTIO_BALLOON_F_STATS_VQ);
        }
        if !self.deflate_on_oom {
            all &= !(1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM);
        }
        all
    }

    fn protocol_features(&self) -> u64 {
        crate::proto::protocol::CONFIG
    }

    /// Inflate and deflate, then the statistics queue if offered, then reporting if offered.
    fn queues(&self) -> u16 {
        // The reporting queue's slot is there even when reporting is not offered: QEMU's
        // generic device sets up the fixed number of rings its command line names (`num_vqs`),
        // so the same command line serves the device with and without reporting; a driver
        // without the feature never uses the last ring.
        3 + u16::from(self.stats_offered())
    }

    fn queue_max(&self) -> u16 {
        self.queue_max
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        self.model()?.ack_features(features)?;
        let has = |bit: u32| features & 1 << bit != 0;
        self.live.update(|s| {
            s.features = features;
            s.stats_queue = has(VIRTIO_BALLOON_F_STATS_VQ);
            s.deflate_on_oom = has(VIRTIO_BALLOON_F_DEFLATE_ON_OOM);
        });
        log::info!(
            "balloon: driver features {features:#x} (statistics queue {}, deflate on OOM {}, \
             free page reporting {})",
            has(VIRTIO_BALLOON_F_STATS_VQ),
            has(VIRTIO_BALLOON_F_DEFLATE_ON_OOM),
            has(VIRTIO_BALLOON_F_REPORTING)
        );
        Ok(())
    }

    fn read_config(&self, offset: u32, data: &mut [u8]) {
        match &self.model {
            Some(m) => m.read_config(u64::from(offset), data),
            None => data.fill(0),
        }
    }

    fn write_config(&mut self, offset: u32, data: &[u8]) -> Result<()> {
        let model = self.model()?;
        let before = model.actual_pages();
        model.write_config(u64::from(offset), data);
        let (actual, target) = (model.actual_pages(), model.target_pages());
        if actual == before {
            return Ok(());
        }
        log::debug!("balloon: actual {actual} pages, target {target}");
        // The part of the change that went below the target: only the guest's own deflation
        // (on OOM) goes there; following a lowered target stays at or above it.
        let below = u64::from(before.min(target).saturating_sub(actual));
        if below > 0 {
            // The driver deflates 1 MiB per OOM event, hundreds a second under pressure: one
            // info line at most every 5 s, with the pages since the last one.
            self.oom_unlogged += below;
            if self.oom_logged.is_none_or(|t| t.elapsed() >= OOM_LOG_EVERY) {
                log::info!(
                    "balloon: the guest took back {} pages below the target (deflate on OOM): \
                     actual {actual} pages ({} MiB), target {target}",
                    self.oom_unlogged,
                    actual / 256
                );
                self.oom_unlogged = 0;
                self.oom_logged = Some(std::time::Instant::now());
            }
        } else if actual == target {
            log::info!(
                "balloon: actual {actual} pages ({} MiB) reached the target",
                actual / 256
            );
        }
        self.live.update(|s| {
            s.actual_pages = actual;
            s.deflated_below_target_pages += below;
        });
        Ok(())
    }

    fn config_changed(&mut self) -> bool {
        let want = self.target.pages();
        match self.model.as_mut() {
            Some(m) if m.target_pages() != want => {
                m.set_target_pages(want);
                log::info!("balloon: target {want} pages ({} MiB)", want / 256);
                true
            }
            _ => false,
        }
    }

    fn due(&mut self) -> Option<u16> {
        let since = self.model.as_ref()?.stats_held_since()?;
        if self.stats_interval.is_zero() || since.elapsed() < self.stats_interval {
            return None;
        }
        #[cfg(feature = "test-hooks")]
        if self.stats_frozen {
            return None;
        }
        Some(STATS_QUEUE_INDEX)
    }

    fn process(
        &mut self,
        index: u16,
        ring: &mut Ring,
        memory: &FrontendMemory,
    ) -> Result<Processed> {
        let r = self.process_queue(index, ring, memory);
        let counts = self.stats();
        self.live.update(|s| s.counts = counts);
        r.map(Processed::served)
    }

    fn reset(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.reset();
            // The target stays: a new driver is asked for the same.
            m.set_target_pages(self.target.pages());
        }
        self.live.update(|s| {
            s.actual_pages = 0;
            s.features = 0;
            s.stats_queue = false;
            s.deflate_on_oom = false;
        });
    }
}
