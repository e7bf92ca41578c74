//! virtio-balloon (device id 5) over vhost-user: memvisor's balloon model
//! ([`memvisor::balloon::Balloon`]) on the rings a frontend hands over.
//!
//! QEMU has no vhost-user balloon front end; its generic
//! `vhost-user-test-device-pci,virtio-id=5,num_vqs=3,config_size=16` passes the device through:
//! queues 0 (inflate), 1 (deflate) and 2 (free page reporting), and the 16-byte config space read
//! and written with `GET_CONFIG` / `SET_CONFIG`. Offered features are the model's: virtio 1.0,
//! event indexes, free page reporting and page poisoning; not `VIRTIO_F_ACCESS_PLATFORM`, which
//! Linux's balloon driver refuses, and not the statistics or free page hinting queues (the
//! generic device has three queues).
//!
//! The target (`num_pages`) comes from a shared [`BalloonTarget`] that the command line and a
//! control socket set; when it changes the back end tells the frontend with a config change
//! message on the back-end channel, and the driver inflates or deflates towards it.
//!
//! Discards run through the frontend memory's slot table with the process's pin registry, and the
//! guest memory is mapped once per process ([`memvisor::SharedMappings`]): a page a block device
//! in the same process has pinned for I/O is skipped, not freed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use memvisor::DiscardOptions;
use memvisor::balloon::{
    Balloon, DEFLATE_QUEUE_INDEX, INFLATE_QUEUE_INDEX, REPORTING_QUEUE_INDEX, ReportingStats,
    VIRTIO_BALLOON_F_REPORTING,
};

use crate::backend::Device;
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

/// The vhost-user balloon device.
pub struct BalloonDevice {
    model: Option<Balloon>,
    target: BalloonTarget,
    queue_max: u16,
    reporting: bool,
}

impl BalloonDevice {
    /// A balloon whose target follows `target`.
    pub fn new(target: BalloonTarget) -> Self {
        BalloonDevice {
            model: None,
            target,
            queue_max: 256,
            reporting: true,
        }
    }

    /// The same device without free page reporting offered (inflate and deflate only): what a
    /// balloon without it gives back, for comparison and negative controls.
    pub fn without_reporting(mut self) -> Self {
        self.reporting = false;
        self
    }

    /// What the model counted (zeros before a frontend's memory was attached).
    pub fn stats(&self) -> ReportingStats {
        self.model.as_ref().map(|m| m.stats()).unwrap_or_default()
    }

    /// Pages the driver says it holds.
    pub fn actual_pages(&self) -> u32 {
        self.model.as_ref().map_or(0, |m| m.actual_pages())
    }

    fn model(&mut self) -> Result<&mut Balloon> {
        self.model
            .as_mut()
            .ok_or_else(|| Error::Invalid("balloon used before its memory was attached".into()))
    }
}

impl Device for BalloonDevice {
    fn name(&self) -> &'static str {
        "vhost-user-balloon"
    }

    fn attach(&mut self, memory: &FrontendMemory) -> Result<()> {
        let model = Balloon::new(
            memory.space().clone(),
            DiscardOptions::default(),
            self.queue_max,
        )?;
        self.model = Some(model);
        Ok(())
    }

    fn features(&self) -> u64 {
        let all = self.model.as_ref().map_or(0, |m| m.device_features());
        if self.reporting {
            all
        } else {
            all & !(1 << VIRTIO_BALLOON_F_REPORTING)
        }
    }

    fn protocol_features(&self) -> u64 {
        crate::proto::protocol::CONFIG
    }

    fn queues(&self) -> u16 {
        3
    }

    fn queue_max(&self) -> u16 {
        self.queue_max
    }

    fn set_features(&mut self, features: u64) -> Result<()> {
        Ok(self.model()?.ack_features(features)?)
    }

    fn read_config(&self, offset: u32, data: &mut [u8]) {
        match &self.model {
            Some(m) => m.read_config(u64::from(offset), data),
            None => data.fill(0),
        }
    }

    fn write_config(&mut self, offset: u32, data: &[u8]) -> Result<()> {
        self.model()?.write_config(u64::from(offset), data);
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

    fn process(&mut self, index: u16, ring: &mut Ring, _memory: &FrontendMemory) -> Result<bool> {
        let model = self.model()?;
        // The balloon completes every chain before it returns and offers no inflight log:
        // the queue alone will do.
        let queue = &mut **ring;
        let notify = match index {
            INFLATE_QUEUE_INDEX => model.process_inflate(queue)?,
            DEFLATE_QUEUE_INDEX => model.process_deflate(queue)?,
            REPORTING_QUEUE_INDEX
                if model.acked_features() & 1 << VIRTIO_BALLOON_F_REPORTING != 0 =>
            {
                model.process_reports(queue)?.notify
            }
            other => {
                return Err(Error::BadRing(format!(
                    "balloon: queue {other} is not in use with features {:#x}",
                    model.acked_features()
                )));
            }
        };
        Ok(notify)
    }

    fn reset(&mut self) {
        if let Some(m) = self.model.as_mut() {
            m.reset();
            // The target stays: a new driver is asked for the same.
            m.set_target_pages(self.target.pages());
        }
    }
}
