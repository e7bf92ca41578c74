//! The memcopy example (examples/memcopy.rs) behind a server, driven with the crate's client
//! as QEMU would: a copy through the DMA table, and copies the table refuses — each leaves the
//! destination as it was and its errno in `RESULT`.

// The example itself, not a copy; its `main` goes unused here.
#[allow(dead_code)]
#[path = "../examples/memcopy.rs"]
mod memcopy;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use memcopy::{DST, GO, LEN, MemCopy, RESULT, SRC};
use memvisor::DmaConfig;
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor_testkit::vfio_user::client::Client;
use memvisor_vfio_user::proto::{self, DmaMap, RegionAccess, cmd, map_flags};
use memvisor_vfio_user::{Server, ServerStats};

const MIB: u64 = 1 << 20;

fn memfd(size: u64) -> std::fs::File {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"memcopy-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a new descriptor we own.
    let f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.set_len(size).unwrap();
    f
}

fn ok(c: &mut Client, command: u16, body: &[u8], fds: &[i32]) -> Vec<u8> {
    let (errno, b) = c.call(command, body, fds).unwrap();
    assert_eq!(errno, 0, "{}", cmd::name(command));
    b
}

fn reg_write(c: &mut Client, offset: u64, value: u32) {
    let mut b = RegionAccess {
        offset,
        region: 0,
        count: 4,
    }
    .to_bytes()
    .to_vec();
    b.extend_from_slice(&value.to_le_bytes());
    ok(c, cmd::REGION_WRITE, &b, &[]);
}

fn reg_read(c: &mut Client, offset: u64) -> u32 {
    let b = RegionAccess {
        offset,
        region: 0,
        count: 4,
    }
    .to_bytes();
    let r = ok(c, cmd::REGION_READ, &b, &[]);
    u32::from_le_bytes(r[16..20].try_into().unwrap())
}

/// Programs a copy, rings `GO` and returns `RESULT`.
fn copy(c: &mut Client, src: u64, dst: u64, len: u32) -> u32 {
    for (at, v) in [(SRC, src), (DST, dst)] {
        reg_write(c, at, v as u32);
        reg_write(c, at + 4, (v >> 32) as u32);
    }
    reg_write(c, LEN, len);
    reg_write(c, GO, 1);
    reg_read(c, RESULT)
}

/// A server for the example on one end of a socket pair; the client on the other, past the
/// version handshake, with `mem` mapped at IOVA 0 (the first MiB read-only, the rest RW).
fn start(mem: &std::fs::File) -> (Client, std::thread::JoinHandle<ServerStats>) {
    let (a, b) = UnixStream::pair().unwrap();
    let config = DmaConfig {
        registry: Some(PinRegistry::new(LockLimit::Unlimited)),
        ..DmaConfig::default()
    };
    let server = Server::new(b, config, memvisor::SharedMappings::global(), MemCopy::new).unwrap();
    let t = std::thread::spawn(move || server.serve().0);
    let mut c = Client::from_stream(a);
    let v = proto::Version {
        major: 0,
        minor: 0,
        json: r#"{"capabilities":{"max_msg_fds":16}}"#.into(),
    };
    ok(&mut c, cmd::VERSION, &v.to_bytes(), &[]);
    for (iova, flags) in [
        (0, map_flags::READ),
        (MIB, map_flags::READ | map_flags::WRITE),
    ] {
        let m = DmaMap {
            argsz: 32,
            flags,
            offset: iova,
            iova,
            size: MIB,
        };
        ok(&mut c, cmd::DMA_MAP, &m.to_bytes(), &[mem.as_raw_fd()]);
    }
    (c, t)
}

#[test]
fn go_copies_the_source_to_the_destination_through_the_dma_table() {
    use std::os::unix::fs::FileExt;
    let mem = memfd(2 * MIB);
    let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect();
    mem.write_all_at(&data, 0x1000).unwrap();
    let (mut c, t) = start(&mem);
    assert_eq!(reg_read(&mut c, RESULT), u32::MAX, "before the first copy");

    assert_eq!(copy(&mut c, 0x1000, MIB + 0x3000, 5000), 0);
    let mut got = vec![0u8; 5002];
    mem.read_exact_at(&mut got, MIB + 0x3000).unwrap();
    assert_eq!(&got[..5000], &data[..], "the copy");
    assert_eq!(&got[5000..], &[0, 0], "past the copy");

    drop(c);
    let stats = t.join().unwrap();
    assert_eq!(stats.dma_maps, 2);
}

#[test]
fn a_copy_the_table_refuses_changes_nothing_and_reports_its_errno() {
    use std::os::unix::fs::FileExt;
    let mem = memfd(2 * MIB);
    mem.write_all_at(&[0x11; 64], MIB).unwrap();
    mem.write_all_at(&[0x22; 64], 0x100).unwrap();
    let (mut c, t) = start(&mem);

    // Into the read-only first MiB: EPERM.
    assert_eq!(copy(&mut c, MIB, 0x100, 64), libc::EPERM as u32);
    // From or to IOVAs nothing is mapped at, or running past the end: EINVAL.
    assert_eq!(copy(&mut c, 4 * MIB, MIB, 64), libc::EINVAL as u32);
    assert_eq!(copy(&mut c, 0x100, 2 * MIB - 32, 64), libc::EINVAL as u32);
    // No length, or more than the engine takes: EINVAL.
    assert_eq!(copy(&mut c, 0x100, MIB, 0), libc::EINVAL as u32);
    assert_eq!(
        copy(&mut c, 0x100, MIB, memcopy::MAX_LEN + 1),
        libc::EINVAL as u32
    );
    let mut b = [0u8; 64];
    mem.read_exact_at(&mut b, 0x100).unwrap();
    assert_eq!(b, [0x22; 64], "the read-only destination");
    mem.read_exact_at(&mut b, MIB).unwrap();
    assert_eq!(b, [0x11; 64], "the destination of the refused copies");
    let mut tail = [0u8; 32];
    mem.read_exact_at(&mut tail, 2 * MIB - 32).unwrap();
    assert_eq!(
        tail, [0; 32],
        "the part of a copy past the end that was mapped"
    );

    // A register that is not one, and a 2-byte access: refused with EINVAL, the device goes on.
    let mut w = RegionAccess {
        offset: RESULT,
        region: 0,
        count: 4,
    }
    .to_bytes()
    .to_vec();
    w.extend_from_slice(&0u32.to_le_bytes());
    assert_eq!(
        c.call(cmd::REGION_WRITE, &w, &[]).unwrap().0,
        libc::EINVAL as u32
    );
    let r = RegionAccess {
        offset: SRC,
        region: 0,
        count: 2,
    };
    assert_eq!(
        c.call(cmd::REGION_READ, &r.to_bytes(), &[]).unwrap().0,
        libc::EINVAL as u32
    );
    assert_eq!(copy(&mut c, MIB, MIB + 0x1000, 64), 0);

    drop(c);
    t.join().unwrap();
}
