//! I/O limits on a blk device: bytes and requests per second, in total, for reads and for
//! writes, with bursts — the model of QEMU's throttling (`util/throttle.c`,
//! `docs/throttle.txt`; facts used with credit, the code is ours), set at run time with
//! `blk-set-throttle` under the argument names of QEMU's `block_set_io_throttle`.
//!
//! **Model.** Each limit is a leaky bucket ([`Bucket`]): six of them, bytes (`bps*`) and
//! requests (`iops*`) for the total, reads and writes. A request, once let through, pours its
//! size into the byte buckets of its direction and the total, and one unit into the request
//! buckets (with `iops_size` set, a request of `n > iops_size` bytes pours `n / iops_size`
//! units). Each bucket leaks at its average rate `avg` (`bps`, `iops_rd`, ...). Before a request
//! goes, the buckets of its direction and the total are leaked to now and each says how long to
//! wait: a bucket is *full* past `avg / 10` units (a tenth of a second at the average rate: short
//! bursts pass unthrottled), or, with a burst rate `max` (`bps_max`, ...), past `max ×
//! burst_length` units (`burst_length`: `bps_max_length`, ..., seconds, default 1), and the wait
//! is the overflow drained at `avg`. With `burst_length > 1` a second level, leaking at `max`,
//! keeps the burst itself at rate `max`: full past `max / 10`, its overflow drained at `max`.
//! The longest wait of the four buckets wins; none means go. Like QEMU the check is made
//! before the request's size counts, so one large request may overshoot, and the next waits for
//! it.
//!
//! **Validation**, as QEMU's `throttle_is_valid` (each error names the argument and value): a
//! value past 10^15 ([`VALUE_MAX`]); a burst length of 0; a burst length above 1 without its
//! burst rate; a burst rate without its average, or below it; `max × length` past 10^15; a total
//! limit together with a read or write limit of the same kind. All zero lifts the throttle.
//!
//! **Where requests wait.** One [`Throttle`] per device, shared by its queues (the device and
//! every copy serving a queue on a worker hold the same one, in [`crate::blk::BlkLive`]). A
//! chain that must wait is not taken: the device puts it back on the available ring and stops
//! taking from that ring, and arms a one-shot timer ([`Wake`], a `timerfd`) for the wait. The
//! serving loops already sleep on the device's completion descriptor and, when it fires, end
//! what finished and serve every ring that still holds requests; the device hands them an
//! `epoll` descriptor that fires for either its io_uring's eventfd or the timer. So a waiting
//! request blocks no thread: other devices, other rings, vhost-user messages, a disconnect and a
//! stop go on as before, and a ring stopped meanwhile returns its base with the waiting chains
//! still available (never taken), which the next back end serves. The loops also end work (and
//! so look at the timer) at the end of each pass and before a message, where they serve no ring
//! after: a timer that fired then is set again rather than lost, and a ring lent to a worker or
//! handed back carries its deferral with it (`Blk::throttle_woke`). The one exception is a device
//! that polls its rings (`poll-us`): polling a ring whose requests must wait would spin, so
//! there each deferral also sleeps for the wait, at most a millisecond, between polls. Were the
//! timer impossible to set up (no `timerfd`), the throttle lets requests through and says so
//! once in the log rather than leave a ring stalled.
//!
//! Requests are measured from the moment they are let through: the time spent waiting on the
//! ring is not in the latency histograms ([`crate::blk::BlkLive::latency`]).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The largest rate, burst rate or `max × length` QEMU takes (`THROTTLE_VALUE_MAX`).
pub const VALUE_MAX: u64 = 1_000_000_000_000_000;

/// The limits in force, under the names of QEMU's `block_set_io_throttle` (0: no limit; the
/// `*_length` are seconds, default 1).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ThrottleConfig {
    /// Average bytes per second, total.
    pub bps: u64,
    /// Average bytes per second, reads.
    pub bps_rd: u64,
    /// Average bytes per second, writes.
    pub bps_wr: u64,
    /// Average requests per second, total.
    pub iops: u64,
    /// Average requests per second, reads.
    pub iops_rd: u64,
    /// Average requests per second, writes.
    pub iops_wr: u64,
    /// Burst rate of `bps`, bytes per second.
    pub bps_max: u64,
    /// Burst rate of `bps_rd`, bytes per second.
    pub bps_rd_max: u64,
    /// Burst rate of `bps_wr`, bytes per second.
    pub bps_wr_max: u64,
    /// Burst rate of `iops`, requests per second.
    pub iops_max: u64,
    /// Burst rate of `iops_rd`, requests per second.
    pub iops_rd_max: u64,
    /// Burst rate of `iops_wr`, requests per second.
    pub iops_wr_max: u64,
    /// Seconds a burst at `bps_max` may last.
    pub bps_max_length: u64,
    /// Seconds a burst at `bps_rd_max` may last.
    pub bps_rd_max_length: u64,
    /// Seconds a burst at `bps_wr_max` may last.
    pub bps_wr_max_length: u64,
    /// Seconds a burst at `iops_max` may last.
    pub iops_max_length: u64,
    /// Seconds a burst at `iops_rd_max` may last.
    pub iops_rd_max_length: u64,
    /// Seconds a burst at `iops_wr_max` may last.
    pub iops_wr_max_length: u64,
    /// Requests larger than this many bytes count as `size / iops_size` requests (0: each
    /// request counts one).
    pub iops_size: u64,
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        ThrottleConfig {
            bps: 0,
            bps_rd: 0,
            bps_wr: 0,
            iops: 0,
            iops_rd: 0,
            iops_wr: 0,
            bps_max: 0,
            bps_rd_max: 0,
            bps_wr_max: 0,
            iops_max: 0,
            iops_rd_max: 0,
            iops_wr_max: 0,
            bps_max_length: 1,
            bps_rd_max_length: 1,
            bps_wr_max_length: 1,
            iops_max_length: 1,
            iops_rd_max_length: 1,
            iops_wr_max_length: 1,
            iops_size: 0,
        }
    }
}

/// One limit's settings: its argument name, average, burst rate and burst length.
struct Limit {
    name: &'static str,
    avg: u64,
    max: u64,
    length: u64,
}

/// Bucket order: bytes total, read, write; requests total, read, write.
const BPS_TOTAL: usize = 0;
const IOPS_TOTAL: usize = 3;
const READ: usize = 1;
const WRITE: usize = 2;

impl ThrottleConfig {
    fn limits(&self) -> [Limit; 6] {
        let l = |name, avg, max, length| Limit {
            name,
            avg,
            max,
            length,
        };
        [
            l("bps", self.bps, self.bps_max, self.bps_max_length),
            l(
                "bps_rd",
                self.bps_rd,
                self.bps_rd_max,
                self.bps_rd_max_length,
            ),
            l(
                "bps_wr",
                self.bps_wr,
                self.bps_wr_max,
                self.bps_wr_max_length,
            ),
            l("iops", self.iops, self.iops_max, self.iops_max_length),
            l(
                "iops_rd",
                self.iops_rd,
                self.iops_rd_max,
                self.iops_rd_max_length,
            ),
            l(
                "iops_wr",
                self.iops_wr,
                self.iops_wr_max,
                self.iops_wr_max_length,
            ),
        ]
    }

    /// Whether any limit is set.
    pub fn enabled(&self) -> bool {
        self.limits().iter().any(|l| l.avg > 0)
    }

    /// Checks the settings as QEMU does; the error names the argument and its value.
    pub fn validate(&self) -> Result<(), String> {
        let limits = self.limits();
        for kind in [BPS_TOTAL, IOPS_TOTAL] {
            let (t, r, w) = (&limits[kind], &limits[kind + READ], &limits[kind + WRITE]);
            for (what, total, part) in [
                ("", t.avg, r.avg.max(w.avg)),
                ("_max", t.max, r.max.max(w.max)),
            ] {
                if total > 0 && part > 0 {
                    return Err(format!(
                        "{}{what} is {total} and {}{what}/{}{what} is set: a total limit and a \
                         read or write limit cannot be used at the same time",
                        t.name, r.name, w.name
                    ));
                }
            }
        }
        for l in &limits {
            let name = l.name;
            for (suffix, v) in [("", l.avg), ("_max", l.max)] {
                if v > VALUE_MAX {
                    return Err(format!(
                        "{name}{suffix} is {v}; limits must be within [0, {VALUE_MAX}]"
                    ));
                }
            }
            if l.length == 0 {
                return Err(format!(
                    "{name}_max_length is 0; a burst lasts at least 1 second"
                ));
            }
            if l.length > 1 && l.max == 0 {
                return Err(format!(
                    "{name}_max_length is {} but {name}_max is not set: a burst length needs a \
                     burst rate",
                    l.length
                ));
            }
            if l.max > 0 && l.length > VALUE_MAX / l.max {
                return Err(format!(
                    "{name}_max_length is {} with {name}_max {}: their product must be within \
                     {VALUE_MAX}",
                    l.length, l.max
                ));
            }
            if l.max > 0 && l.avg == 0 {
                return Err(format!(
                    "{name}_max is {} but {name} is not set: a burst rate needs an average rate",
                    l.max
                ));
            }
            if l.max > 0 && l.max < l.avg {
                return Err(format!(
                    "{name}_max is {} and {name} is {}: a burst rate cannot be lower than the \
                     average",
                    l.max, l.avg
                ));
            }
        }
        if self.iops_size > VALUE_MAX {
            return Err(format!(
                "iops_size is {}; it must be within [0, {VALUE_MAX}]",
                self.iops_size
            ));
        }
        Ok(())
    }
}

/// One leaky bucket (units: bytes or requests).
#[derive(Clone, Debug, Default)]
struct Bucket {
    /// Average rate, units per second (0: no limit).
    avg: f64,
    /// Burst rate (0: none).
    max: f64,
    /// Seconds a burst at `max` may last.
    burst_length: f64,
    /// Units in the bucket, leaking at `avg`.
    level: f64,
    /// Units of the burst now, leaking at `max` (kept when `burst_length > 1`).
    burst_level: f64,
}

impl Bucket {
    fn new(l: &Limit) -> Bucket {
        Bucket {
            avg: l.avg as f64,
            max: l.max as f64,
            burst_length: l.length as f64,
            ..Bucket::default()
        }
    }

    fn leak(&mut self, secs: f64) {
        self.level = (self.level - self.avg * secs).max(0.0);
        if self.burst_length > 1.0 {
            self.burst_level = (self.burst_level - self.max * secs).max(0.0);
        }
    }

    fn pour(&mut self, units: f64) {
        self.level += units;
        if self.burst_length > 1.0 {
            self.burst_level += units;
        }
    }

    /// Seconds to wait before the next request may go (0: now).
    fn wait(&self) -> f64 {
        if self.avg == 0.0 {
            return 0.0;
        }
        let (size, burst_size) = if self.max == 0.0 {
            (self.avg / 10.0, 0.0)
        } else {
            (self.max * self.burst_length, self.max / 10.0)
        };
        let over = self.level - size;
        if over > 0.0 {
            return over / self.avg;
        }
        if self.burst_length > 1.0 {
            let over = self.burst_level - burst_size;
            if over > 0.0 {
                return over / self.max;
            }
        }
        0.0
    }
}

/// The six buckets of one configuration and when they last leaked: the arithmetic alone, time
/// given in nanoseconds since any fixed moment.
#[derive(Clone, Debug, Default)]
pub(crate) struct Buckets {
    b: [Bucket; 6],
    op_size: u64,
    last_ns: u64,
}

impl Buckets {
    pub(crate) fn new(c: &ThrottleConfig, now_ns: u64) -> Buckets {
        Buckets {
            b: c.limits().map(|l| Bucket::new(&l)),
            op_size: c.iops_size,
            last_ns: now_ns,
        }
    }

    fn dir(write: bool) -> usize {
        if write { WRITE } else { READ }
    }

    /// How long a read (or write) must wait at `now_ns` (0: it may go).
    pub(crate) fn wait_ns(&mut self, write: bool, now_ns: u64) -> u64 {
        let secs = now_ns.saturating_sub(self.last_ns) as f64 / 1e9;
        self.last_ns = self.last_ns.max(now_ns);
        for b in &mut self.b {
            b.leak(secs);
        }
        let d = Buckets::dir(write);
        let wait = [BPS_TOTAL, BPS_TOTAL + d, IOPS_TOTAL, IOPS_TOTAL + d]
            .iter()
            .map(|&i| self.b[i].wait())
            .fold(0.0, f64::max);
        // Rounded: 0.2 s is 200000000.00000003 ns in floating point.
        (wait * 1e9).round() as u64
    }

    /// Counts a read (or write) of `bytes` that goes.
    pub(crate) fn account(&mut self, write: bool, bytes: u64) {
        let units = if self.op_size > 0 && bytes > self.op_size {
            bytes as f64 / self.op_size as f64
        } else {
            1.0
        };
        let d = Buckets::dir(write);
        for i in [BPS_TOTAL, BPS_TOTAL + d] {
            self.b[i].pour(bytes as f64);
        }
        for i in [IOPS_TOTAL, IOPS_TOTAL + d] {
            self.b[i].pour(units);
        }
    }
}

/// A device's throttle, shared by its queues; cloning shares it.
#[derive(Clone, Debug)]
pub struct Throttle(Arc<Shared>);

#[derive(Debug)]
struct Shared {
    /// Any limit set: read without the lock, so an unthrottled device pays one load.
    on: AtomicBool,
    state: Mutex<(ThrottleConfig, Buckets)>,
    epoch: Instant,
}

impl Default for Throttle {
    fn default() -> Self {
        Throttle(Arc::new(Shared {
            on: AtomicBool::new(false),
            state: Mutex::new((ThrottleConfig::default(), Buckets::default())),
            epoch: Instant::now(),
        }))
    }
}

impl Throttle {
    fn now_ns(&self) -> u64 {
        self.0.epoch.elapsed().as_nanos() as u64
    }

    /// Puts `config` in force (checked first: an invalid one changes nothing), with empty
    /// buckets.
    pub fn set(&self, config: ThrottleConfig) -> Result<(), String> {
        config.validate()?;
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        s.1 = Buckets::new(&config, self.now_ns());
        self.0.on.store(config.enabled(), Ordering::Release);
        s.0 = config;
        Ok(())
    }

    /// The limits in force.
    pub fn config(&self) -> ThrottleConfig {
        self.0
            .state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }

    /// Whether any limit is in force.
    pub fn is_on(&self) -> bool {
        self.0.on.load(Ordering::Acquire)
    }

    /// How long a read (or write) must wait before asking again; `None` if it may go now, and
    /// then it is [`account`](Throttle::account)ed once it really goes (a request put back on
    /// its ring after the check, for a vIOMMU miss, is checked again and counted once). Two
    /// queues checking at once may both go: the buckets count both, and the next waits longer.
    pub fn wait(&self, write: bool) -> Option<Duration> {
        if !self.is_on() {
            return None;
        }
        self.wait_ns_at(write, self.now_ns())
    }

    /// [`Throttle::wait`] at `now`, a clock read the caller made already (a blk queue's pass
    /// weighs all its requests at the pass's start: no clock read per request).
    pub fn wait_at(&self, write: bool, now: Instant) -> Option<Duration> {
        if !self.is_on() {
            return None;
        }
        let ns = now.saturating_duration_since(self.0.epoch).as_nanos() as u64;
        self.wait_ns_at(write, ns)
    }

    fn wait_ns_at(&self, write: bool, now_ns: u64) -> Option<Duration> {
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.1.wait_ns(write, now_ns) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// Counts a read (or write) of `bytes` that went.
    pub fn account(&self, write: bool, bytes: u64) {
        if !self.is_on() {
            return;
        }
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        s.1.account(write, bytes);
    }

    /// A read (or write) of `bytes` asks to go: `None` and counted if it may, else how long to
    /// wait before asking again ([`wait`](Throttle::wait) and [`account`](Throttle::account) in
    /// one step under one lock).
    pub fn admit(&self, write: bool, bytes: u64) -> Option<Duration> {
        if !self.is_on() {
            return None;
        }
        let now = self.now_ns();
        let mut s = self.0.state.lock().unwrap_or_else(|p| p.into_inner());
        match s.1.wait_ns(write, now) {
            0 => {
                s.1.account(write, bytes);
                None
            }
            ns => Some(Duration::from_nanos(ns)),
        }
    }
}

/// What wakes a serving loop when a deferred request may go: an `epoll` descriptor over a
/// one-shot `timerfd` and the device's io_uring eventfd (added once it exists).
#[derive(Debug)]
pub(super) struct Wake {
    epoll: OwnedFd,
    timer: OwnedFd,
    /// The completion descriptor already watched (-1: none yet).
    watching: AtomicI32,
}

impl Wake {
    pub(super) fn new() -> std::io::Result<Wake> {
        // SAFETY: takes no pointers; the result is checked.
        let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if ep < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor epoll_create1 just returned, owned by nothing else.
        let epoll = unsafe { OwnedFd::from_raw_fd(ep) };
        // SAFETY: takes no pointers; the result is checked.
        let t = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_CLOEXEC | libc::TFD_NONBLOCK,
            )
        };
        if t < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor timerfd_create just returned, owned by nothing else.
        let timer = unsafe { OwnedFd::from_raw_fd(t) };
        let w = Wake {
            epoll,
            timer,
            watching: AtomicI32::new(-1),
        };
        w.watch(w.timer.as_raw_fd())?;
        Ok(w)
    }

    fn watch(&self, fd: RawFd) -> std::io::Result<()> {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: one live epoll_event, read by the call only.
        if unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } < 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Fires once, `after` from now at the latest: an earlier expiry already set stands, so a
    /// ring's longer wait never pushes back another ring's shorter one (the timer is the
    /// device's one; when it fires every ring is looked at and asks again).
    pub(super) fn arm(&self, after: Duration) {
        let after = after.max(Duration::from_nanos(1));
        // SAFETY: an all-zero itimerspec is a valid value (plain integers).
        let mut set: libc::itimerspec = unsafe { std::mem::zeroed() };
        // SAFETY: one live itimerspec, written by the call.
        if unsafe { libc::timerfd_gettime(self.timer.as_raw_fd(), &mut set) } == 0 {
            let left = Duration::new(
                u64::try_from(set.it_value.tv_sec).unwrap_or(0),
                u32::try_from(set.it_value.tv_nsec).unwrap_or(0),
            );
            if !left.is_zero() && left <= after {
                return;
            }
        }
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: one live itimerspec, read by the call; no old value asked for.
        if unsafe { libc::timerfd_settime(self.timer.as_raw_fd(), 0, &spec, std::ptr::null_mut()) }
            < 0
        {
            log::warn!("blk: throttle timer: {}", std::io::Error::last_os_error());
        }
    }

    /// Takes a fired timer's expiry: whether it had fired.
    pub(super) fn take_fired(&self) -> bool {
        let mut b = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live 8-byte buffer; the descriptor is
        // non-blocking.
        unsafe { libc::read(self.timer.as_raw_fd(), b.as_mut_ptr().cast(), b.len()) > 0 }
    }

    /// The descriptor to wait on, watching `completion` (the io_uring's eventfd) too.
    pub(super) fn fd(&self, completion: Option<RawFd>) -> RawFd {
        if let Some(c) = completion {
            if self.watching.load(Ordering::Relaxed) != c {
                match self.watch(c) {
                    Ok(()) => self.watching.store(c, Ordering::Relaxed),
                    Err(e) => log::warn!("blk: throttle: cannot watch completions: {e}"),
                }
            }
        }
        self.epoll.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn buckets(c: ThrottleConfig) -> Buckets {
        c.validate().unwrap();
        Buckets::new(&c, 0)
    }

    #[test]
    fn a_longer_wait_does_not_push_back_a_shorter_one() {
        // Two rings deferred: the first for 20 ms, the second for 30 s. The timer is the
        // device's one: the first ring must still be looked at after 20 ms.
        let w = Wake::new().unwrap();
        w.arm(Duration::from_millis(20));
        w.arm(Duration::from_secs(30));
        let t0 = Instant::now();
        while !w.take_fired() {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the 20 ms wake-up was pushed back to 30 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn average_only_lets_a_tenth_of_a_second_through_then_waits_the_overflow() {
        // bps 1000: full past 100 bytes. 300 bytes at t=0: 200 over, drained at 1000/s.
        let mut b = buckets(ThrottleConfig {
            bps: 1000,
            ..Default::default()
        });
        assert_eq!(b.wait_ns(false, 0), 0);
        b.account(false, 300);
        assert_eq!(b.wait_ns(false, 0), 200 * MS);
        // 100 ms later 100 bytes leaked: 100 ms to go, for a write as well (the total).
        assert_eq!(b.wait_ns(true, 100 * MS), 100 * MS);
        assert_eq!(b.wait_ns(false, 200 * MS), 0);
    }

    #[test]
    fn direction_limits_leave_the_other_direction_alone() {
        let mut b = buckets(ThrottleConfig {
            iops_wr: 10,
            ..Default::default()
        });
        // iops_wr 10: full past 1 request; 3 writes: 2 over, 200 ms.
        for _ in 0..3 {
            b.account(true, 4096);
        }
        assert_eq!(b.wait_ns(true, 0), 200 * MS);
        assert_eq!(b.wait_ns(false, 0), 0);
    }

    #[test]
    fn a_burst_runs_at_max_for_its_length_then_the_average_holds() {
        // bps 1000, bps_max 4000 for 2 s: the main bucket holds 8000 bytes; the burst level
        // is full past 400 and drains at 4000/s.
        let mut b = buckets(ThrottleConfig {
            bps: 1000,
            bps_max: 4000,
            bps_max_length: 2,
            ..Default::default()
        });
        b.account(false, 1000);
        // burst level 1000: 600 over at 4000/s = 150 ms.
        assert_eq!(b.wait_ns(false, 0), 150 * MS);
        // 150 ms on: main level 850, burst 400: go.
        assert_eq!(b.wait_ns(false, 150 * MS), 0);
        // Fill the main bucket past its 8000: 9000 in it (the burst level leaks faster).
        b.account(false, 8150);
        // The main bucket is 1000 over at 1000/s: its wait is the answer (the burst level is
        // looked at only while the main bucket is not full).
        assert_eq!(b.wait_ns(false, 150 * MS), 1000 * MS);
    }

    #[test]
    fn a_burst_of_length_one_is_a_bigger_bucket() {
        // bps_max 5000, length 1: full past 5000; no separate burst level.
        let mut b = buckets(ThrottleConfig {
            bps: 1000,
            bps_max: 5000,
            ..Default::default()
        });
        b.account(true, 5000);
        assert_eq!(b.wait_ns(true, 0), 0);
        b.account(true, 500);
        assert_eq!(b.wait_ns(true, 0), 500 * MS);
    }

    #[test]
    fn iops_size_counts_a_large_request_as_several() {
        // iops 10, iops_size 4096: 16 KiB is 4 requests; full past 1: 3 over, 300 ms.
        let mut b = buckets(ThrottleConfig {
            iops: 10,
            iops_size: 4096,
            ..Default::default()
        });
        b.account(false, 16384);
        assert_eq!(b.wait_ns(false, 0), 300 * MS);
        // A small one counts 1.
        let mut b = buckets(ThrottleConfig {
            iops: 10,
            iops_size: 4096,
            ..Default::default()
        });
        b.account(false, 512);
        b.account(false, 512);
        assert_eq!(b.wait_ns(false, 0), 100 * MS);
    }

    #[test]
    fn invalid_settings_are_refused_with_the_value_named() {
        let err = |c: ThrottleConfig| c.validate().unwrap_err();
        let e = err(ThrottleConfig {
            bps: 1000,
            bps_max: 500,
            ..Default::default()
        });
        assert!(
            e.contains("bps_max is 500") && e.contains("bps is 1000"),
            "{e}"
        );
        let e = err(ThrottleConfig {
            iops_rd: 10,
            iops_rd_max_length: 5,
            ..Default::default()
        });
        assert!(e.contains("iops_rd_max_length is 5"), "{e}");
        let e = err(ThrottleConfig {
            bps_wr: VALUE_MAX + 1,
            ..Default::default()
        });
        assert!(e.contains(&format!("bps_wr is {}", VALUE_MAX + 1)), "{e}");
        let e = err(ThrottleConfig {
            iops_max: 100,
            ..Default::default()
        });
        assert!(e.contains("iops_max is 100"), "{e}");
        let e = err(ThrottleConfig {
            bps: 1,
            bps_rd: 2,
            ..Default::default()
        });
        assert!(e.contains("bps is 1"), "{e}");
        let e = err(ThrottleConfig {
            bps_max_length: 0,
            ..Default::default()
        });
        assert!(e.contains("bps_max_length is 0"), "{e}");
        let e = err(ThrottleConfig {
            bps: 1,
            bps_max: VALUE_MAX,
            bps_max_length: 2,
            ..Default::default()
        });
        assert!(e.contains("bps_max_length is 2"), "{e}");
        assert!(ThrottleConfig::default().validate().is_ok());
        assert!(!ThrottleConfig::default().enabled());
    }

    #[test]
    fn the_shared_throttle_defers_and_an_all_zero_config_lifts_it() {
        let t = Throttle::default();
        assert_eq!(t.admit(false, 1 << 20), None);
        t.set(ThrottleConfig {
            iops: 1,
            ..Default::default()
        })
        .unwrap();
        // Full past 0.1 requests: the first goes, the second waits about 900 ms.
        assert_eq!(t.admit(false, 512), None);
        let w = t.admit(true, 512).expect("must wait");
        assert!(
            w > Duration::from_millis(800) && w <= Duration::from_millis(900),
            "{w:?}"
        );
        // An invalid config changes nothing.
        assert!(
            t.set(ThrottleConfig {
                iops_max: 1,
                ..Default::default()
            })
            .is_err()
        );
        assert_eq!(t.config().iops, 1);
        t.set(ThrottleConfig::default()).unwrap();
        assert_eq!(t.admit(true, 512), None);
    }

    #[test]
    fn asking_counts_nothing_only_a_request_that_went_counts() {
        let t = Throttle::default();
        t.set(ThrottleConfig {
            iops: 1,
            ..Default::default()
        })
        .unwrap();
        // A request checked and put back (a vIOMMU miss) asks again: it is not counted twice.
        for _ in 0..5 {
            assert_eq!(t.wait(false), None);
        }
        t.account(false, 512);
        let w = t.wait(false).expect("one request went: the next waits");
        assert!(
            w > Duration::from_millis(800) && w <= Duration::from_millis(900),
            "{w:?}"
        );
    }
}
