//! A hostile frontend: connects to a back end again and again and sends it messages built to
//! break it — random requests, sizes and flags, payloads that are almost right (a real memory
//! table with one field bent), descriptors that are not memory, too many descriptors, messages
//! cut short, connections dropped mid-message. The back end must answer or hang up, never crash,
//! and serve a well-behaved frontend afterwards (the bad-frontend trial checks that with QEMU).
//!
//! Deterministic for a seed (xorshift), so a failure can be replayed.

use memvisor_wire::rng::Rng;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use super::client::Client;
use memvisor_vhost::error::Result;
use memvisor_vhost::proto::{self, Region, VringAddr, flags, req};

/// What a fuzzing run did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FuzzStats {
    /// Connections opened.
    pub connections: u64,
    /// Messages sent.
    pub messages: u64,
    /// Replies received.
    pub replies: u64,
    /// Non-zero acks (refusals) among them.
    pub refusals: u64,
    /// Connections the back end closed on us.
    pub hangups: u64,
}

/// Sends hostile traffic to the back end at `path` for `duration`.
pub fn run(path: &Path, seed: u64, duration: Duration) -> Result<FuzzStats> {
    let mut rng = Rng::new(seed);
    let mut stats = FuzzStats::default();
    let memory = memfd(4 << 20)?;
    let start = Instant::now();
    while start.elapsed() < duration {
        let client = Client::connect(path)?;
        let _ = client
            .socket()
            .set_read_timeout(Some(Duration::from_millis(20)));
        stats.connections += 1;
        if rng.chance(80) && handshake(&client, &mut rng, &memory).is_err() {
            stats.hangups += 1;
            continue;
        }
        for _ in 0..rng.below(40) + 1 {
            if !one(&client, &mut rng, &memory, &mut stats) {
                stats.hangups += 1;
                break;
            }
        }
    }
    Ok(stats)
}

/// Sends one message (and reads what comes back); false once the back end hung up.
fn one(c: &Client, rng: &mut Rng, memory: &File, stats: &mut FuzzStats) -> bool {
    let fd = memory.as_raw_fd();
    let request = match rng.below(10) {
        0 => rng.below(64) as u32,
        1 => rng.bits() as u32,
        _ => [
            req::GET_FEATURES,
            req::SET_FEATURES,
            req::SET_OWNER,
            req::SET_MEM_TABLE,
            req::ADD_MEM_REG,
            req::REM_MEM_REG,
            req::SET_VRING_NUM,
            req::SET_VRING_ADDR,
            req::SET_VRING_BASE,
            req::GET_VRING_BASE,
            req::SET_VRING_KICK,
            req::SET_VRING_CALL,
            req::SET_VRING_ENABLE,
            req::GET_PROTOCOL_FEATURES,
            req::SET_PROTOCOL_FEATURES,
            req::GET_CONFIG,
            req::SET_CONFIG,
            req::RESET_DEVICE,
            req::IOTLB_MSG,
        ][rng.below(19) as usize],
    };
    let region = |rng: &mut Rng| Region {
        gpa: if rng.chance(50) { 0 } else { rng.edgy() },
        size: if rng.chance(50) { 4 << 20 } else { rng.edgy() },
        user_addr: if rng.chance(50) {
            0x7f00_0000_0000
        } else {
            rng.edgy()
        },
        mmap_offset: if rng.chance(70) { 0 } else { rng.edgy() },
    };
    let mut payload = match request {
        req::SET_MEM_TABLE => {
            let n = rng.below(10) as usize;
            proto::mem_table_bytes(&(0..n).map(|_| region(rng)).collect::<Vec<_>>())
        }
        req::ADD_MEM_REG | req::REM_MEM_REG => proto::single_region_bytes(&region(rng)),
        req::SET_VRING_ADDR => VringAddr {
            index: rng.below(4) as u32,
            flags: rng.bits() as u32,
            desc: rng.edgy(),
            used: rng.edgy(),
            avail: rng.edgy(),
            log: rng.edgy(),
        }
        .bytes(),
        req::GET_CONFIG | req::SET_CONFIG => {
            let size = rng.below(300) as usize;
            proto::config_bytes(rng.below(300) as u32, 0, &vec![0x5a; size])
        }
        _ if rng.chance(50) => rng.edgy().to_le_bytes().to_vec(),
        _ => proto::vring_state_bytes(rng.below(5) as u32, rng.edgy() as u32),
    };
    // Bend the payload: cut it, pad it, or flip a byte.
    match rng.below(6) {
        0 if !payload.is_empty() => payload.truncate(rng.below(payload.len() as u64) as usize),
        1 => payload.extend((0..rng.below(64)).map(|_| rng.bits() as u8)),
        2 if !payload.is_empty() => {
            let i = rng.below(payload.len() as u64) as usize;
            payload[i] ^= 1 << rng.below(8);
        }
        _ => {}
    }
    let pipe = pipe();
    let fds: Vec<RawFd> = match rng.below(6) {
        0 | 1 => vec![],
        2 => vec![fd],
        3 => vec![fd; rng.below(12) as usize],
        4 => pipe.iter().map(|p| p.as_raw_fd()).take(1).collect(),
        _ => vec![fd, fd],
    };
    let extra = match rng.below(10) {
        0 => rng.bits() as u32 & !flags::VERSION_MASK,
        1 | 2 => 0,
        _ => flags::NEED_REPLY,
    };
    let sent = if rng.chance(3) {
        // A header that lies about the version or the size, or a message cut short.
        let mut b = request.to_le_bytes().to_vec();
        b.extend_from_slice(&(rng.bits() as u32).to_le_bytes());
        b.extend_from_slice(&(rng.edgy() as u32).to_le_bytes());
        b.truncate(rng.below(13) as usize);
        c.raw(&b, &fds)
    } else {
        c.send(request, extra, &payload, &fds)
    };
    stats.messages += 1;
    if sent.is_err() {
        return false;
    }
    match c.reply() {
        Ok((_, p)) => {
            stats.replies += 1;
            if p.len() == 8 && p != [0; 8] {
                stats.refusals += 1;
            }
            true
        }
        Err(e) => !matches!(e, memvisor_vhost::Error::Os { ref source, .. }
            if source.kind() == std::io::ErrorKind::UnexpectedEof),
    }
}

/// What QEMU does first: features, protocol features (all offered, so refusals come back as
/// acks), and often a valid memory table.
fn handshake(c: &Client, rng: &mut Rng, memory: &File) -> Result<()> {
    let f = c.get_u64(req::GET_FEATURES)?;
    c.send(req::SET_FEATURES, 0, &f.to_le_bytes(), &[])?;
    let p = c.get_u64(req::GET_PROTOCOL_FEATURES)?;
    c.send(req::SET_PROTOCOL_FEATURES, 0, &p.to_le_bytes(), &[])?;
    if rng.chance(60) {
        let r = Region {
            gpa: 0,
            size: 4 << 20,
            user_addr: 0x7f00_0000_0000,
            mmap_offset: 0,
        };
        c.ack(
            req::SET_MEM_TABLE,
            &proto::mem_table_bytes(&[r]),
            &[memory.as_raw_fd()],
        )?;
    }
    Ok(())
}

fn memfd(size: u64) -> Result<File> {
    // SAFETY: valid C string, plain flags; the descriptor is owned by the File.
    let fd = unsafe { libc::memfd_create(c"memvisor-fuzz".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(memvisor_vhost::Error::Os {
            op: "memfd_create",
            source: std::io::Error::last_os_error(),
        });
    }
    // SAFETY: fresh descriptor.
    let f = unsafe { File::from_raw_fd(fd) };
    f.set_len(size)
        .map_err(|source| memvisor_vhost::Error::Os {
            op: "size the fuzz memfd",
            source,
        })?;
    Ok(f)
}

fn pipe() -> Vec<OwnedFd> {
    let mut p = [0; 2];
    // SAFETY: pipe fills the array with two new descriptors.
    if unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Vec::new();
    }
    // SAFETY: fresh descriptors owned from here.
    unsafe { vec![OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])] }
}
