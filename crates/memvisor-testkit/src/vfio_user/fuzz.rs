//! A hostile vfio-user client: connects to a server again and again and sends it messages
//! built to break it, mixed with well-formed sequences that take the server and its `mvdma`
//! device deep into their states (memory mapped, a descriptor table running, pins held) so
//! that the hostile messages meet those states too.
//!
//! What it sends: headers that lie (sizes below the header, bodies longer or shorter than
//! announced, unknown commands, reply / error / no-reply bits on requests, unknown message
//! types), bad version negotiation (another major, capabilities that are not JSON, a
//! `max_data_xfer_size` of 0, commands before VERSION), descriptors in the wrong number or of
//! the wrong kind (pipes, eventfds, a 4 KiB memfd, a write-sealed memfd, memory opened
//! read-only, more than the server takes), `DMA_MAP` / `DMA_UNMAP` at the edges (size 0, unaligned, IOVAs near `u64::MAX`,
//! offsets past the file's end, overlaps, half a mapping, `UNMAP_ALL` with a range, dirty
//! bitmaps), region accesses out of range or of the wrong width, bad interrupt settings,
//! device-reset storms, unmaps and resets while a table runs, and maps without a descriptor
//! whose `DMA_READ` / `DMA_WRITE` requests it answers or refuses. It never truncates memory it
//! has mapped: a peer that shrinks a shared file under a mapping gets the server killed by
//! `SIGBUS`, which no server that maps client memory can rule out (see `memvisor::backing`).
//!
//! The server must answer or hang up, never crash, and serve a well-behaved client afterwards.
//! Deterministic for a seed (xorshift): the same seed sends the same messages, though what the
//! server answers can depend on timing (a table still running, or done).

use memvisor_wire::rng::Rng;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use memvisor_wire::WireError;

use super::client::Client;
use memvisor_vfio_user::dmadev::{DESC_SIZE, reg};
use memvisor_vfio_user::error::{Error, Result};
use memvisor_vfio_user::proto::{self, DmaMap, DmaUnmap, HEADER, Header, cmd, flags};

/// What a fuzzing run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuzzStats {
    /// Connections opened.
    pub connections: u64,
    /// Messages sent.
    pub messages: u64,
    /// Replies received.
    pub replies: u64,
    /// Error replies among them.
    pub refusals: u64,
    /// Connections the server closed on us.
    pub hangups: u64,
    /// Connections we gave up on: no reply in time to a message that may have none.
    pub abandoned: u64,
    /// `DMA_READ` / `DMA_WRITE` requests of the server answered.
    pub server_requests: u64,
    /// Descriptor tables the device was started on.
    pub tables: u64,
}

/// Bytes of the memory the well-formed sequences map and run tables in.
const MEM: u64 = 16 << 20;
/// Where in the IOVA space the well-formed sequences put it (one of these).
const BASES: [u64; 4] = [0x1000_0000, 0, 0xffff_ffff_ff00_0000, 0x8000_0000_0000];
const BAR0: u32 = 0;
const CONFIG: u32 = 7;
const MSI: u32 = 1;

/// Descriptors of the kinds the hostile messages carry.
struct Fds {
    mem: OwnedFd,
    tiny: OwnedFd,
    sealed: OwnedFd,
    /// `mem` opened again read-only (through `/proc/self/fd`).
    readonly: OwnedFd,
    pipe: [OwnedFd; 2],
    event: OwnedFd,
}

/// What a step left the connection in.
enum Step {
    Go,
    Gone,
}

/// Sends hostile traffic to the server at `path` for `duration`.
pub fn run(path: &Path, seed: u64, duration: Duration) -> Result<FuzzStats> {
    let mem = memfd(MEM, 0)?;
    let readonly = reopen_read_only(&mem)?;
    let mut f = Fuzz {
        rng: Rng::new(seed),
        stats: FuzzStats::default(),
        fds: Fds {
            mem,
            readonly,
            tiny: memfd(4096, 0)?,
            sealed: memfd(1 << 20, libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK)?,
            pipe: pipe()?,
            event: eventfd()?,
        },
        maps: Vec::new(),
        base: BASES[0],
    };
    let start = Instant::now();
    while start.elapsed() < duration {
        let mut c = Client::connect(path)?;
        let _ = c.socket().set_read_timeout(Some(Duration::from_secs(3)));
        f.stats.connections += 1;
        f.maps.clear();
        f.base = BASES[f.rng.below(BASES.len() as u64) as usize];
        let go = if f.rng.chance(90) {
            f.handshake(&mut c)
        } else {
            Step::Go
        };
        if let Step::Go = go {
            for _ in 0..f.rng.below(80) + 1 {
                if let Step::Gone = f.step(&mut c) {
                    break;
                }
            }
        }
        f.stats.server_requests += c.server_requests;
    }
    Ok(f.stats)
}

struct Fuzz {
    rng: Rng,
    stats: FuzzStats,
    fds: Fds,
    /// What this connection mapped (as far as we know: the server may have refused).
    maps: Vec<(u64, u64)>,
    /// IOVA of this connection's well-formed mapping of `fds.mem`.
    base: u64,
}

impl Fuzz {
    /// Sends a command and reads its reply; counts both.
    fn call(&mut self, c: &mut Client, command: u16, body: &[u8], fds: &[RawFd]) -> Step {
        self.stats.messages += 1;
        match c.call(command, body, fds) {
            Ok((errno, _)) => {
                self.stats.replies += 1;
                if errno != 0 {
                    self.stats.refusals += 1;
                }
                Step::Go
            }
            Err(e) => self.gone(e),
        }
    }

    /// Sends a message that may get no reply (a lying header, a reply bit, NO_REPLY): waits a
    /// little for one, then carries on or gives the connection up.
    fn maybe(&mut self, c: &mut Client, bytes: &[u8], fds: &[RawFd], expect: bool) -> Step {
        self.stats.messages += 1;
        if let Err(e) = c.raw(bytes, fds) {
            return self.gone(e);
        }
        let wait = if expect { 3000 } else { 150 };
        let _ = c
            .socket()
            .set_read_timeout(Some(Duration::from_millis(wait)));
        let r = c.reply();
        let _ = c.socket().set_read_timeout(Some(Duration::from_secs(3)));
        match r {
            Ok(m) => {
                self.stats.replies += 1;
                if m.header.flags & flags::ERROR != 0 {
                    self.stats.refusals += 1;
                }
                Step::Go
            }
            Err(Error::Wire(WireError::Io { source, .. }))
                if matches!(
                    source.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) && !expect =>
            {
                // No reply, as may be: the stream is still in step only if nothing was
                // half-read; go on with a fresh connection.
                self.stats.abandoned += 1;
                Step::Gone
            }
            Err(e) => self.gone(e),
        }
    }

    fn gone(&mut self, e: Error) -> Step {
        match e {
            Error::Wire(WireError::Disconnected) => self.stats.hangups += 1,
            Error::Wire(WireError::Io { ref source, .. })
                if source.kind() == std::io::ErrorKind::BrokenPipe =>
            {
                self.stats.hangups += 1
            }
            _ => self.stats.abandoned += 1,
        }
        Step::Gone
    }

    fn handshake(&mut self, c: &mut Client) -> Step {
        let v = proto::Version {
            major: 0,
            minor: 0,
            json: r#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":1048576}}"#.into(),
        };
        self.call(c, cmd::VERSION, &v.to_bytes(), &[])
    }

    /// One hostile or well-formed exchange.
    fn step(&mut self, c: &mut Client) -> Step {
        match self.rng.below(16) {
            0..=2 => self.good_table(c),
            3 | 4 => self.bad_map(c),
            5 | 6 => self.bad_unmap(c),
            7 => self.bad_region(c),
            8 => self.bad_irqs(c),
            9 => self.reset_storm(c),
            10 => self.bad_header(c),
            11 => self.bad_version(c),
            12 => self.bad_info(c),
            13 => self.random_command(c),
            14 => self.remote_table(c),
            _ => self.good_map(c),
        }
    }

    fn map(
        &mut self,
        c: &mut Client,
        fd: Option<RawFd>,
        offset: u64,
        iova: u64,
        size: u64,
    ) -> Step {
        let m = DmaMap {
            argsz: 32,
            flags: 3,
            offset,
            iova,
            size,
        };
        let fds: Vec<RawFd> = fd.into_iter().collect();
        self.send_map(c, &m.to_bytes(), &fds, iova, size)
    }

    fn unmap(&mut self, c: &mut Client, iova: u64, size: u64, fl: u32) -> Step {
        let u = DmaUnmap {
            argsz: 24,
            flags: fl,
            iova,
            size,
            bitmap: None,
        };
        let r = self.call(c, cmd::DMA_UNMAP, &u.to_bytes(), &[]);
        self.maps
            .retain(|&(i, _)| i < iova || i >= iova.saturating_add(size));
        if fl & proto::unmap_flags::ALL != 0 {
            self.maps.clear();
        }
        r
    }

    fn region_write(&mut self, c: &mut Client, region: u32, offset: u64, data: &[u8]) -> Step {
        let mut b = proto::RegionAccess {
            offset,
            region,
            count: data.len() as u32,
        }
        .to_bytes()
        .to_vec();
        b.extend_from_slice(data);
        self.call(c, cmd::REGION_WRITE, &b, &[])
    }

    fn region_read(&mut self, c: &mut Client, region: u32, offset: u64, count: u32) -> Step {
        let b = proto::RegionAccess {
            offset,
            region,
            count,
        }
        .to_bytes();
        self.call(c, cmd::REGION_READ, &b, &[])
    }

    /// Maps the whole of `fds.mem` at this connection's base (or a piece of it).
    fn good_map(&mut self, c: &mut Client) -> Step {
        if self.rng.chance(70) {
            let fd = self.fds.mem.as_raw_fd();
            self.map(c, Some(fd), 0, self.base, MEM)
        } else {
            let page = self.rng.below(MEM / 4096);
            let n = 1 + self.rng.below((MEM / 4096 - page).min(64));
            let fd = self.fds.mem.as_raw_fd();
            self.map(c, Some(fd), page * 4096, self.base + page * 4096, n * 4096)
        }
    }

    /// A descriptor table in `fds.mem`, mostly inside the mapping, some descriptors outside
    /// it; started, polled, and sometimes pulled away (unmap, reset) while it runs.
    fn good_table(&mut self, c: &mut Client) -> Step {
        if self.maps.is_empty() {
            if let Step::Gone = self.good_map(c) {
                return Step::Gone;
            }
        }
        let most = if self.rng.chance(10) { 4096 } else { 16 };
        let count = 1 + self.rng.below(most);
        let table_off = self.rng.below(64) * 4096;
        let mut table = Vec::with_capacity((count * DESC_SIZE) as usize);
        for _ in 0..count {
            let len = match self.rng.below(6) {
                0 => self.rng.edgy() as u32,
                1 => 1 + self.rng.below(8) as u32,
                _ => 1 + self.rng.below(256 << 10) as u32,
            };
            let inside = |rng: &mut Rng| (1 << 20) + rng.below(MEM - (2 << 20));
            let (src, dst) = if self.rng.chance(85) {
                (
                    self.base + inside(&mut self.rng),
                    self.base + inside(&mut self.rng),
                )
            } else {
                (self.rng.edgy(), self.rng.edgy())
            };
            table.extend_from_slice(&src.to_le_bytes());
            table.extend_from_slice(&dst.to_le_bytes());
            table.extend_from_slice(&len.to_le_bytes());
            table.extend_from_slice(&[0u8; 12]);
        }
        pwrite(&self.fds.mem, table_off, &table);
        let desc = if self.rng.chance(90) {
            self.base + table_off
        } else {
            self.rng.edgy()
        };
        let mode = if self.rng.chance(95) {
            self.rng.below(2) as u32
        } else {
            self.rng.bits() as u32
        };
        for (off, v) in [(reg::COUNT, count as u32), (reg::MODE, mode)] {
            if let Step::Gone = self.region_write(c, BAR0, off, &v.to_le_bytes()) {
                return Step::Gone;
            }
        }
        if let Step::Gone = self.region_write(c, BAR0, reg::DESC, &desc.to_le_bytes()) {
            return Step::Gone;
        }
        if self.rng.chance(30) {
            let irq = self.fds.event.as_raw_fd();
            if let Step::Gone = self.set_irqs(c, 0x24, MSI, 0, 1, &[irq], &[]) {
                return Step::Gone;
            }
        }
        self.stats.tables += 1;
        if let Step::Gone = self.region_write(c, BAR0, reg::DOORBELL, &1u32.to_le_bytes()) {
            return Step::Gone;
        }
        // Pull the memory or the device away while it may still run, or poll it to the end.
        match self.rng.below(5) {
            0 if !self.maps.is_empty() => {
                let (iova, size) = self.maps[self.rng.below(self.maps.len() as u64) as usize];
                self.unmap(c, iova, size, 0)
            }
            1 => self.call(c, cmd::DEVICE_RESET, &[], &[]),
            2 => self.unmap(c, 0, 0, proto::unmap_flags::ALL),
            _ => {
                for _ in 0..self.rng.below(20) {
                    if let Step::Gone = self.region_read(c, BAR0, reg::STATUS, 4) {
                        return Step::Gone;
                    }
                }
                Step::Go
            }
        }
    }

    /// Memory mapped without a descriptor and a table over it: the device's copies become
    /// `DMA_READ` / `DMA_WRITE` requests to us, answered or refused.
    fn remote_table(&mut self, c: &mut Client) -> Step {
        let iova = 0x4000_0000 + self.rng.below(16) * (1 << 20);
        if let Step::Gone = self.map(c, None, 0, iova, 1 << 20) {
            return Step::Gone;
        }
        if self.maps.is_empty() {
            if let Step::Gone = self.good_map(c) {
                return Step::Gone;
            }
        }
        c.refuse_server_requests = if self.rng.chance(30) {
            [libc::EFAULT, libc::EINVAL, 0xffff][self.rng.below(3) as usize] as u32
        } else {
            0
        };
        // One descriptor from the remote memory into ours, one back.
        let mut table = Vec::new();
        for (src, dst) in [
            (iova + self.rng.below(4096), self.base + (2 << 20)),
            (self.base + (3 << 20), iova + self.rng.below(4096)),
        ] {
            table.extend_from_slice(&src.to_le_bytes());
            table.extend_from_slice(&dst.to_le_bytes());
            table.extend_from_slice(&(1 + self.rng.below(200 << 10) as u32).to_le_bytes());
            table.extend_from_slice(&[0u8; 12]);
        }
        pwrite(&self.fds.mem, 0, &table);
        let mode = self.rng.below(2) as u32;
        for (off, v) in [
            (reg::COUNT, 2u64, 4usize),
            (reg::MODE, mode as u64, 4),
            (reg::DESC, self.base, 8),
        ]
        .map(|(o, v, w)| (o, v.to_le_bytes()[..w].to_vec()))
        {
            if let Step::Gone = self.region_write(c, BAR0, off, &v) {
                return Step::Gone;
            }
        }
        self.stats.tables += 1;
        if let Step::Gone = self.region_write(c, BAR0, reg::DOORBELL, &1u32.to_le_bytes()) {
            return Step::Gone;
        }
        for _ in 0..self.rng.below(10) {
            if let Step::Gone = self.region_read(c, BAR0, reg::STATUS, 4) {
                return Step::Gone;
            }
        }
        Step::Go
    }

    fn bad_map(&mut self, c: &mut Client) -> Step {
        let f = &self.fds;
        let (mem, tiny, sealed, pipe, event) = (
            f.mem.as_raw_fd(),
            f.tiny.as_raw_fd(),
            f.sealed.as_raw_fd(),
            f.pipe[0].as_raw_fd(),
            f.event.as_raw_fd(),
        );
        let readonly = f.readonly.as_raw_fd();
        let fds: Vec<RawFd> = match self.rng.below(11) {
            0 => vec![],
            1 => vec![tiny],
            2 => vec![sealed],
            3 => vec![pipe],
            4 => vec![event],
            5 => vec![mem, mem],
            6 => vec![mem; 16],
            7 => vec![readonly],
            _ => vec![mem],
        };
        let (iova, size, offset) = match self.rng.below(8) {
            // Overlapping what is there.
            0 if !self.maps.is_empty() => {
                let (i, s) = self.maps[self.rng.below(self.maps.len() as u64) as usize];
                (
                    i + self.rng.below(s / 4096 + 1) * 4096,
                    4096 << self.rng.below(4),
                    0,
                )
            }
            1 => (u64::MAX - 0xfff, 0x1000 << self.rng.below(2), 0),
            2 => (self.base, 0, 0),
            3 => (self.base + 1 + self.rng.below(4095), 4096, 0),
            4 => (self.base, 4096, MEM - 4096 + 4096 * self.rng.below(3)),
            5 => (self.base, MEM, u64::MAX - 0xfff),
            _ => (self.rng.edgy(), self.rng.edgy(), self.rng.edgy()),
        };
        let mut m = DmaMap {
            argsz: 32,
            flags: 3,
            offset,
            iova,
            size,
        };
        match self.rng.below(6) {
            0 => m.flags = self.rng.bits() as u32,
            1 => m.flags = 0,
            2 => m.argsz = self.rng.edgy() as u32,
            _ => {}
        }
        let mut body = m.to_bytes();
        match self.rng.below(6) {
            0 => body.truncate(self.rng.below(32) as usize),
            1 => body.extend((0..self.rng.below(64)).map(|_| 0xa5)),
            _ => {}
        }
        self.send_map(c, &body, &fds, iova, size)
    }

    /// Sends one `DMA_MAP` body and remembers `[iova, iova + size)` as mapped if it was taken.
    fn send_map(
        &mut self,
        c: &mut Client,
        body: &[u8],
        fds: &[RawFd],
        iova: u64,
        size: u64,
    ) -> Step {
        self.stats.messages += 1;
        match c.call(cmd::DMA_MAP, body, fds) {
            Ok((errno, _)) => {
                self.stats.replies += 1;
                if errno != 0 {
                    self.stats.refusals += 1;
                } else {
                    self.maps.push((iova, size));
                }
                Step::Go
            }
            Err(e) => self.gone(e),
        }
    }

    fn bad_unmap(&mut self, c: &mut Client) -> Step {
        let known = self
            .maps
            .get(self.rng.below(self.maps.len() as u64 + 1) as usize)
            .copied();
        let (iova, size) = match (self.rng.below(6), known) {
            // Half of a mapping: its first half, or its second.
            (0, Some((i, s))) => (i, (s / 2).max(1)),
            (1, Some((i, s))) => (i + s / 2, s - s / 2),
            (2, Some((i, s))) => (i, s),
            (3, _) => (u64::MAX - 0xfff, 0x1000 << self.rng.below(2)),
            _ => (self.rng.edgy(), self.rng.edgy()),
        };
        let fl = match self.rng.below(8) {
            0 => proto::unmap_flags::ALL,
            1 => proto::unmap_flags::GET_DIRTY_BITMAP,
            2 => self.rng.bits() as u32,
            _ => 0,
        };
        if fl == proto::unmap_flags::GET_DIRTY_BITMAP {
            let u = DmaUnmap {
                argsz: 40,
                flags: fl,
                iova,
                size,
                bitmap: Some((4096 << self.rng.below(3), self.rng.edgy())),
            };
            return self.call(c, cmd::DMA_UNMAP, &u.to_bytes(), &[]);
        }
        let (iova, size) = if fl == proto::unmap_flags::ALL && self.rng.chance(50) {
            (0, 0)
        } else {
            (iova, size)
        };
        self.unmap(c, iova, size, fl)
    }

    fn bad_region(&mut self, c: &mut Client) -> Step {
        let region = match self.rng.below(6) {
            0 => self.rng.bits() as u32,
            1 => 1 + self.rng.below(8) as u32,
            2 => CONFIG,
            _ => BAR0,
        };
        let offset = if self.rng.chance(50) {
            self.rng.below(0x40)
        } else {
            self.rng.edgy()
        };
        match self.rng.below(5) {
            0 => {
                let count = match self.rng.below(3) {
                    0 => self.rng.edgy() as u32,
                    _ => [1, 2, 3, 4, 5, 8, 16][self.rng.below(7) as usize],
                };
                self.region_read(c, region, offset, count)
            }
            1 => {
                // Count and data that disagree.
                let mut b = proto::RegionAccess {
                    offset,
                    region,
                    count: self.rng.below(16) as u32,
                }
                .to_bytes()
                .to_vec();
                b.extend((0..self.rng.below(16)).map(|_| self.rng.bits() as u8));
                self.call(c, cmd::REGION_WRITE, &b, &[])
            }
            2 => {
                let n = if self.rng.chance(50) {
                    self.rng.below(4)
                } else {
                    self.rng.edgy()
                };
                let mut b = n.to_le_bytes().to_vec();
                for _ in 0..self.rng.below(4) {
                    b.extend_from_slice(&self.rng.below(0x40).to_le_bytes());
                    b.extend_from_slice(&region.to_le_bytes());
                    b.extend_from_slice(&(self.rng.below(10) as u32).to_le_bytes());
                    b.extend_from_slice(&self.rng.bits().to_le_bytes());
                }
                self.call(c, cmd::REGION_WRITE_MULTI, &b, &[])
            }
            _ => {
                let len = [1usize, 2, 3, 4, 8, 12][self.rng.below(6) as usize];
                let data: Vec<u8> = (0..len).map(|_| self.rng.edgy() as u8).collect();
                self.region_write(c, region, offset, &data)
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn set_irqs(
        &mut self,
        c: &mut Client,
        fl: u32,
        index: u32,
        start: u32,
        count: u32,
        fds: &[RawFd],
        extra: &[u8],
    ) -> Step {
        let mut b = Vec::new();
        for v in [20 + extra.len() as u32, fl, index, start, count] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(extra);
        self.call(c, cmd::DEVICE_SET_IRQS, &b, fds)
    }

    fn bad_irqs(&mut self, c: &mut Client) -> Step {
        let data = [1u32, 2, 4][self.rng.below(3) as usize];
        let action = [8u32, 16, 32][self.rng.below(3) as usize];
        let fl = if self.rng.chance(80) {
            data | action
        } else {
            self.rng.bits() as u32
        };
        let index = if self.rng.chance(70) {
            self.rng.below(6) as u32
        } else {
            self.rng.edgy() as u32
        };
        let start = if self.rng.chance(60) {
            0
        } else {
            self.rng.edgy() as u32
        };
        let count = if self.rng.chance(60) {
            self.rng.below(3) as u32
        } else {
            self.rng.edgy() as u32
        };
        let f = &self.fds;
        let fds: Vec<RawFd> = match self.rng.below(6) {
            0 => vec![],
            1 => vec![f.pipe[1].as_raw_fd()],
            2 => vec![f.mem.as_raw_fd(), f.event.as_raw_fd()],
            3 => vec![f.event.as_raw_fd(); 3],
            _ => vec![f.event.as_raw_fd()],
        };
        let extra: Vec<u8> = (0..self.rng.below(4))
            .map(|_| self.rng.below(2) as u8)
            .collect();
        self.set_irqs(c, fl, index, start, count, &fds, &extra)
    }

    fn reset_storm(&mut self, c: &mut Client) -> Step {
        for _ in 0..1 + self.rng.below(20) {
            let r = if self.rng.chance(20) {
                self.region_write(c, BAR0, reg::DOORBELL, &1u32.to_le_bytes())
            } else {
                self.call(c, cmd::DEVICE_RESET, &[], &[])
            };
            if let Step::Gone = r {
                return Step::Gone;
            }
        }
        Step::Go
    }

    fn bad_header(&mut self, c: &mut Client) -> Step {
        let command = match self.rng.below(4) {
            0 => self.rng.bits() as u16,
            1 => 17 + self.rng.below(100) as u16,
            _ => 1 + self.rng.below(16) as u16,
        };
        let body: Vec<u8> = (0..self.rng.below(48))
            .map(|_| self.rng.bits() as u8)
            .collect();
        let mut h = Header {
            id: self.rng.bits() as u16,
            command,
            size: (HEADER + body.len()) as u32,
            flags: flags::COMMAND,
            error: 0,
        };
        // Whether the server must still answer: only if the stream stays in step and the
        // message is a plain command.
        let mut expect = true;
        match self.rng.below(9) {
            0 => {
                h.size = self.rng.below(HEADER as u64) as u32;
                expect = false;
            }
            1 => {
                // Announces more than is sent: the server waits for the rest, we give up.
                h.size += 1 + self.rng.below(64) as u32;
                expect = false;
            }
            2 => {
                // Announces less: the rest of the body is read as the next header.
                h.size = (HEADER + self.rng.below(body.len() as u64 + 1) as usize) as u32;
                expect = false;
            }
            3 => {
                h.flags = flags::REPLY;
                expect = false;
            }
            4 => h.flags = 2 + self.rng.below(14) as u32,
            5 => {
                h.flags = flags::NO_REPLY;
                expect = false;
            }
            6 => h.flags = flags::ERROR,
            7 => {
                h.size = self.rng.bits() as u32;
                expect = false;
            }
            _ => {}
        }
        let mut b = h.to_bytes().to_vec();
        b.extend_from_slice(&body);
        if self.rng.chance(10) {
            // Cut off mid-message and gone.
            b.truncate(self.rng.below(b.len() as u64) as usize);
            self.stats.messages += 1;
            let _ = c.raw(&b, &[]);
            self.stats.abandoned += 1;
            return Step::Gone;
        }
        let fd = self.fds.pipe[0].as_raw_fd();
        let fds: Vec<RawFd> = if self.rng.chance(15) {
            vec![fd]
        } else {
            vec![]
        };
        self.maybe(c, &b, &fds, expect && fds.is_empty())
    }

    fn bad_version(&mut self, c: &mut Client) -> Step {
        let json = match self.rng.below(6) {
            0 => "not json".to_string(),
            1 => r#"{"capabilities":{"max_data_xfer_size":0}}"#.to_string(),
            2 => format!(
                r#"{{"capabilities":{{"max_data_xfer_size":{}}}}}"#,
                self.rng.edgy()
            ),
            3 => "{".repeat(self.rng.below(2000) as usize),
            4 => String::new(),
            _ => r#"{"capabilities":{"max_msg_fds":"many","pgsizes":[]}}"#.to_string(),
        };
        let v = proto::Version {
            major: if self.rng.chance(30) {
                self.rng.bits() as u16
            } else {
                0
            },
            minor: self.rng.bits() as u16,
            json,
        };
        let mut b = v.to_bytes();
        if self.rng.chance(20) {
            b.truncate(self.rng.below(6) as usize);
        }
        self.call(c, cmd::VERSION, &b, &[])
    }

    fn bad_info(&mut self, c: &mut Client) -> Step {
        let command = [
            cmd::DEVICE_GET_INFO,
            cmd::DEVICE_GET_REGION_INFO,
            cmd::DEVICE_GET_IRQ_INFO,
            cmd::DEVICE_GET_REGION_IO_FDS,
            cmd::DIRTY_PAGES,
            cmd::DEVICE_FEATURE,
        ][self.rng.below(6) as usize];
        let mut b = Vec::new();
        for v in [
            if self.rng.chance(50) {
                32
            } else {
                self.rng.edgy() as u32
            },
            0,
            if self.rng.chance(50) {
                self.rng.below(10) as u32
            } else {
                self.rng.edgy() as u32
            },
            0,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.truncate(self.rng.below(17) as usize);
        self.call(c, command, &b, &[])
    }

    fn random_command(&mut self, c: &mut Client) -> Step {
        let command = 1 + self.rng.below(18) as u16;
        let body: Vec<u8> = (0..self.rng.below(64))
            .map(|_| self.rng.edgy() as u8)
            .collect();
        let f = &self.fds;
        let fds: Vec<RawFd> = match self.rng.below(4) {
            0 => vec![f.mem.as_raw_fd()],
            1 => vec![f.event.as_raw_fd(), f.pipe[1].as_raw_fd()],
            _ => vec![],
        };
        self.call(c, command, &body, &fds)
    }
}

fn memfd(size: u64, seals: i32) -> Result<OwnedFd> {
    let flags = libc::MFD_CLOEXEC
        | if seals != 0 {
            libc::MFD_ALLOW_SEALING
        } else {
            0
        };
    // SAFETY: valid C string, plain flags; the result is checked.
    let fd = unsafe { libc::memfd_create(c"memvisor-vfio-user-fuzz".as_ptr(), flags) };
    if fd < 0 {
        return Err(os_error("memfd_create"));
    }
    // SAFETY: a fresh descriptor, owned from here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) } != 0
        || (seals != 0
            // SAFETY: fcntl on our own descriptor.
            && unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0)
    {
        return Err(os_error("size or seal the fuzz memfd"));
    }
    Ok(fd)
}

fn reopen_read_only(fd: &OwnedFd) -> Result<OwnedFd> {
    let f = std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(|e| Error::Wire(WireError::io("reopen the fuzz memfd read-only", e)))?;
    Ok(f.into())
}

fn pipe() -> Result<[OwnedFd; 2]> {
    let mut p = [0; 2];
    // SAFETY: pipe2 fills the array with two new descriptors; checked.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(os_error("pipe2"));
    }
    // SAFETY: fresh descriptors owned from here.
    Ok(unsafe { [OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])] })
}

fn eventfd() -> Result<OwnedFd> {
    // SAFETY: eventfd with valid flags; checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(os_error("eventfd"));
    }
    // SAFETY: a fresh descriptor, owned from here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Writes `data` into the fuzzer's own memory at `off` (a short write only weakens a table).
fn pwrite(fd: &OwnedFd, off: u64, data: &[u8]) {
    // SAFETY: writes from a live buffer to our own descriptor.
    let _ = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), off as i64) };
}

fn os_error(op: &'static str) -> Error {
    Error::Wire(WireError::io(op, std::io::Error::last_os_error()))
}
