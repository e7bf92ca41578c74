//! `memvisor bench blk-throttle`: the blk device's I/O limits asked against measured, and what
//! its latency histograms cost per request — the rows of the blk back end that need no root,
//! no QEMU and no image on disk (the qemu-storage-daemon comparison is `memvisor bench blk`).
//!
//! **Throttle accuracy.** A blk device over a memfd image is served by memvisor's vhost-user
//! back end on one end of a socket pair; the test kit's vhost-user client sets it up as QEMU
//! would (features, memory table, one ring) and drives it from this thread as a guest driver
//! does at queue depth 1, a request at a time (the test kit's driver-side ring). For each limit
//! (`bps` 8 MiB/s and 32 MiB/s with 64 KiB reads, `iops` 500 with 4 KiB reads) the device is
//! throttled through its shared [`Throttle`](memvisor_vhost::Throttle), the driver runs for a
//! while, and the measured rate is set against the limit. QEMU's model lets a tenth of a second
//! at the average rate through before it throttles (over a run of `T` seconds counted from the
//! start, up to `0.1 / T` above the limit is the model, not an error), so each run first drives
//! the device for 0.2 s uncounted and then measures the steady rate. Unthrottled, the same loop
//! gives the ceiling the limits sit under.
//!
//! **Histogram cost.** What the latency histograms add to each request: a clock read when the
//! request's buffers are held, one when it ends, and the record (a bucket computed, two
//! counters bumped) — timed together in a loop, beside the unthrottled request's own time.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use memvisor::{Backing, Gpa, SlotSpec, SlotTable};
use memvisor_testkit::guest_ring::{Desc, GuestRing, VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use memvisor_testkit::vhost::client::Client;
use memvisor_vhost::blk::Op;
use memvisor_vhost::proto::{self, Region, VringAddr, req};
use memvisor_vhost::{Backend, Blk, BlkOptions, ProcessState, ThrottleConfig};

use super::{Ctx, Experiment, Mode, Outcome, Row, Stats, Table, clock_cost, measure, ns_per_op};

pub struct BlkThrottle;

const MIB: u64 = 1 << 20;
const GUEST: u64 = 64 * MIB;
const IMAGE: u64 = 64 * MIB;
const USER: u64 = 0x7f00_0000_0000;
const RING_AT: u64 = 0x1000;
const RING_SIZE: u16 = 16;
const HDR: u64 = 0x10_0000;
const STATUS: u64 = 0x11_0000;
const DATA: u64 = 0x20_0000;

fn memfd(size: u64, name: &std::ffi::CStr) -> anyhow::Result<File> {
    // SAFETY: a constant C string; the result is checked.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    anyhow::ensure!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor, owned by nothing else.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size)?;
    Ok(f)
}

fn eventfd() -> anyhow::Result<File> {
    // SAFETY: plain flags; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    anyhow::ensure!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor, owned by nothing else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// A served blk device and the driver side of its one ring.
struct Rig {
    _client: Client,
    /// Guest memory (kept open for the back end's mapping of it).
    _file: File,
    mem: SlotTable,
    ring: GuestRing,
    kick: File,
    _call: File,
    throttle: memvisor_vhost::Throttle,
    n: u64,
}

impl Rig {
    fn new() -> anyhow::Result<Rig> {
        let blk = Blk::new(
            memfd(IMAGE, c"bench-throttle-image")?,
            BlkOptions::default(),
        )?;
        let throttle = blk.live().throttle().clone();
        let (a, b) = UnixStream::pair()?;
        let mut backend = Backend::new(
            blk,
            &ProcessState::new(
                memvisor::SharedMappings::global(),
                memvisor::PinRegistry::global(),
            ),
        )?;
        std::thread::spawn(move || {
            let stop = AtomicBool::new(false);
            let _ = backend.run(&b, &stop);
        });
        let c = Client::from_stream(a);
        let file = memfd(GUEST, c"bench-throttle-guest")?;
        let backing = Arc::new(Backing::from_fd(
            OwnedFd::from(file.try_clone()?),
            0,
            GUEST,
        )?);
        let mem = SlotTable::new();
        mem.insert(SlotSpec::new(0, Gpa(0), backing))?;
        let ring = GuestRing::new(&mem, Gpa(RING_AT), RING_SIZE)?;
        let (kick, call) = (eventfd()?, eventfd()?);
        let f = c.get_u64(req::GET_FEATURES)?;
        c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[])?;
        let pf = c.get_u64(req::GET_PROTOCOL_FEATURES)?;
        c.send(req::SET_PROTOCOL_FEATURES, 0, &pf.to_le_bytes(), &[])?;
        let region = Region {
            gpa: 0,
            size: GUEST,
            user_addr: USER,
            mmap_offset: 0,
        };
        let table = proto::mem_table_bytes(&[region]);
        c.send(req::SET_MEM_TABLE, 0, &table, &[file.as_raw_fd()])?;
        let n = u64::from(RING_SIZE);
        let avail = RING_AT + 16 * n;
        let used = avail + (6 + 2 * n).next_multiple_of(4);
        let addr = VringAddr {
            index: 0,
            flags: 0,
            desc: USER + RING_AT,
            used: USER + used,
            avail: USER + avail,
            log: 0,
        };
        let st = |v: u32| proto::vring_state_bytes(0, v);
        c.send(req::SET_VRING_NUM, 0, &st(u32::from(RING_SIZE)), &[])?;
        c.send(req::SET_VRING_ADDR, 0, &addr.bytes(), &[])?;
        c.send(req::SET_VRING_BASE, 0, &st(0), &[])?;
        c.send(
            req::SET_VRING_CALL,
            0,
            &0u64.to_le_bytes(),
            &[call.as_raw_fd()],
        )?;
        c.send(
            req::SET_VRING_KICK,
            0,
            &0u64.to_le_bytes(),
            &[kick.as_raw_fd()],
        )?;
        c.send(req::SET_VRING_ENABLE, 0, &st(1), &[])?;
        Ok(Rig {
            _client: c,
            _file: file,
            mem,
            ring,
            kick,
            _call: call,
            throttle,
            n: 0,
        })
    }

    /// One read of `len` bytes, waited for (looking every 20 µs).
    fn read(&mut self, len: u32) -> anyhow::Result<()> {
        let step = u64::from(len) / 512;
        let sector = (self.n * step) % (IMAGE / 512 - step);
        self.n += 1;
        let mut h = [0u8; 16];
        h[8..16].copy_from_slice(&sector.to_le_bytes());
        self.mem.write(Gpa(HDR), &h)?;
        self.mem.write(Gpa(STATUS), &[0xff])?;
        let descs = [
            Desc {
                addr: HDR,
                len: 16,
                flags: VRING_DESC_F_NEXT,
                next: 1,
            },
            Desc {
                addr: DATA,
                len,
                flags: VRING_DESC_F_NEXT | VRING_DESC_F_WRITE,
                next: 2,
            },
            Desc {
                addr: STATUS,
                len: 1,
                flags: VRING_DESC_F_WRITE,
                next: 0,
            },
        ];
        let head = self.ring.add_raw(&[0, 1, 2], &descs)?;
        self.ring.publish(head)?;
        self.kick.write_all(&1u64.to_le_bytes())?;
        let end = Instant::now() + Duration::from_secs(5);
        while self.ring.get_used()?.is_none() {
            anyhow::ensure!(Instant::now() < end, "the device did not answer in 5 s");
            std::thread::sleep(Duration::from_micros(20));
        }
        let mut s = [0xffu8];
        self.mem.read(Gpa(STATUS), &mut s)?;
        anyhow::ensure!(s[0] == 0, "read failed with status {}", s[0]);
        Ok(())
    }

    /// Reads of `len` bytes for `secs`: (bytes/s, requests/s).
    fn rate(&mut self, len: u32, secs: f64) -> anyhow::Result<(f64, f64)> {
        let t0 = Instant::now();
        let mut n = 0u64;
        while t0.elapsed().as_secs_f64() < secs {
            self.read(len)?;
            n += 1;
        }
        let t = t0.elapsed().as_secs_f64();
        Ok((n as f64 * f64::from(len) / t, n as f64 / t))
    }
}

impl Experiment for BlkThrottle {
    fn name(&self) -> &'static str {
        "blk-throttle"
    }
    fn title(&self) -> &'static str {
        "blk throttle: asked vs measured; latency histogram cost per request"
    }
    fn about(&self) -> &'static str {
        "A blk device on memvisor's vhost-user back end, driven over a socket pair by the test \
         kit's client at queue depth 1, throttled to bps 8 and 32 MiB/s (64 KiB reads) and \
         iops 500 (4 KiB reads): the measured rate against the limit, after the 0.1 s QEMU's \
         model lets through first. And the latency histograms' cost per request: two clock \
         reads and one record, timed in a loop."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let (secs, runs) = match ctx.mode {
            Mode::Quick => (1.0, ctx.runs_or(1)),
            Mode::Full => (3.0, ctx.runs_or(3)),
        };
        let mut out = Outcome::default();
        let mut rig = Rig::new()?;
        let mut table = Table::new(
            "blk throttle accuracy (queue depth 1, one ring)",
            &["limit", "asked", "measured", "measured / asked"],
        );
        let cases: [(&str, ThrottleConfig, u32, bool); 3] = [
            (
                "bps 8 MiB/s",
                ThrottleConfig {
                    bps: 8 * MIB,
                    ..Default::default()
                },
                65536,
                true,
            ),
            (
                "bps 32 MiB/s",
                ThrottleConfig {
                    bps: 32 * MIB,
                    ..Default::default()
                },
                65536,
                true,
            ),
            (
                "iops 500",
                ThrottleConfig {
                    iops: 500,
                    ..Default::default()
                },
                4096,
                false,
            ),
        ];
        for (name, config, len, bytes) in cases {
            let asked = if bytes {
                config.bps as f64
            } else {
                config.iops as f64
            };
            let mut got = Vec::new();
            for _ in 0..runs {
                // Empty buckets each run: set afresh.
                rig.throttle
                    .set(config.clone())
                    .map_err(anyhow::Error::msg)?;
                // The first tenth of a second at the limit passes unthrottled (the model):
                // spent before the measured run, which then sees the steady rate.
                rig.rate(len, 0.2)?;
                let (bps, iops) = rig.rate(len, secs)?;
                got.push(if bytes { bps } else { iops });
            }
            let s = Stats::from_samples(&got);
            let ratio: Vec<f64> = got.iter().map(|g| g / asked).collect();
            let r = Stats::from_samples(&ratio);
            let unit = if bytes { "B/s" } else { "req/s" };
            let fmt = |v: f64| {
                if bytes {
                    format!("{:.2} MiB/s", v / MIB as f64)
                } else {
                    format!("{v:.1} req/s")
                }
            };
            table.push(vec![
                name.into(),
                fmt(asked),
                fmt(s.median),
                format!("{:.3} ({:.3}–{:.3})", r.median, r.min, r.max),
            ]);
            out.rows
                .push(Row::new(self.name(), name, "measured", "rate", unit, &s));
            out.rows.push(Row::new(
                self.name(),
                name,
                "measured/asked",
                "ratio",
                "x",
                &r,
            ));
        }
        rig.throttle
            .set(ThrottleConfig::default())
            .map_err(anyhow::Error::msg)?;
        let free = measure(runs, || {
            let (_, iops) = rig.rate(4096, secs / 2.0).unwrap_or((0.0, f64::NAN));
            iops
        });
        table.push(vec![
            "none (4 KiB reads)".into(),
            "-".into(),
            format!("{:.0} req/s", free.median),
            "-".into(),
        ]);
        out.rows.push(Row::new(
            self.name(),
            "unthrottled 4 KiB",
            "measured",
            "rate",
            "req/s",
            &free,
        ));
        table.note = Some(format!(
            "median of {runs} run(s) of {secs} s each, each after 0.2 s at the limit: QEMU's \
             model lets 0.1 s at the average rate through unthrottled first (+{:.0}% in a \
             {secs} s run counted from the start)",
            10.0 / secs
        ));
        out.tables.push(table);

        // The histograms' cost per request.
        let live = Blk::new(
            memfd(1 << 20, c"bench-throttle-hist")?,
            BlkOptions::default(),
        )?
        .live();
        let hist = ns_per_op(runs.max(3), |iters| {
            let t0 = Instant::now();
            for _ in 0..iters {
                let started = Instant::now();
                let ns = started.elapsed().as_nanos() as u64;
                live.record_latency(0, Op::Read, std::hint::black_box(ns));
            }
            t0.elapsed().as_nanos() as f64 / iters as f64
        });
        let per_request_ns = 1e9 / free.median;
        let mut t = Table::new(
            "blk latency histograms: added cost per request",
            &[
                "what",
                "ns per request",
                "share of an unthrottled 4 KiB read",
            ],
        );
        let clock = clock_cost();
        t.push(vec![
            "of which 2 clock reads".into(),
            format!("{clock:.1}"),
            format!("{:.3}%", 100.0 * clock / per_request_ns),
        ]);
        t.push(vec![
            "2 clock reads + record".into(),
            format!("{:.1} ({:.1}–{:.1})", hist.median, hist.min, hist.max),
            format!("{:.3}%", 100.0 * hist.median / per_request_ns),
        ]);
        out.tables.push(t);
        out.rows.push(Row::new(
            self.name(),
            "latency histogram",
            "added",
            "cost",
            "ns/request",
            &hist,
        ));
        Ok(out)
    }
}
