//! The hostile client ([`memvisor_testkit::vfio_user::fuzz`]) against servers made one after another on
//! one listening socket, as `memvisor vfio-user` serves: for 2 s it sends malformed and
//! well-formed messages; then a well-behaved client must get a full session (map, a table in
//! both device modes, every byte checked, unmap), and no connection may leave anything locked,
//! pinned or mapped behind it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use memvisor::dma::{LockLimit, PinRegistry};
use memvisor::{DmaConfig, SharedMappings};
use memvisor_testkit::vfio_user::client::Client;
use memvisor_testkit::vfio_user::fuzz;
use memvisor_vfio_user::dmadev::{reg, status};
use memvisor_vfio_user::proto::{self, DmaMap, DmaUnmap, cmd};
use memvisor_vfio_user::{DmaDev, Server};

/// What each connection left: (registry locked + cached bytes, long-term bytes, device pins,
/// whether the server's loop ended with an error).
type Left = (u64, u64, u64, bool);

/// Serves connections on `listener` one after another until `stop`; returns what each left
/// after its cleanup.
fn serve(listener: UnixListener, registry: Arc<PinRegistry>, stop: Arc<AtomicBool>) -> Vec<Left> {
    listener.set_nonblocking(true).unwrap();
    let mut left = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let sock = match listener.accept() {
            Ok((s, _)) => s,
            Err(_) => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        sock.set_nonblocking(false).unwrap();
        let config = DmaConfig {
            registry: Some(registry.clone()),
            ..DmaConfig::default()
        };
        let server = Server::new(
            sock,
            config,
            memvisor::SharedMappings::global(),
            DmaDev::new,
        )
        .unwrap();
        let (stats, end) = server.serve();
        left.push((
            registry.locked_bytes() + registry.cached_bytes(),
            registry.long_term_bytes(),
            stats.pinned_pages_at_end,
            end.is_err(),
        ));
    }
    left
}

fn memfd(size: u64) -> OwnedFd {
    // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"vfio-user-fuzz-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: fd is a new descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our descriptor.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
    fd
}

fn pwrite(fd: &OwnedFd, off: u64, data: &[u8]) {
    // SAFETY: writes from a live buffer to our descriptor.
    let n = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), off as i64) };
    assert_eq!(n as usize, data.len());
}

fn pread(fd: &OwnedFd, off: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    // SAFETY: reads into a live buffer from our descriptor.
    let n = unsafe { libc::pread(fd.as_raw_fd(), b.as_mut_ptr().cast(), len, off as i64) };
    assert_eq!(n as usize, len);
    b
}

fn ok(c: &mut Client, command: u16, body: &[u8], fds: &[i32]) -> Vec<u8> {
    let (errno, b) = c.call(command, body, fds).unwrap();
    assert_eq!(
        errno,
        0,
        "{} refused with errno {errno}",
        cmd::name(command)
    );
    b
}

fn reg_write(c: &mut Client, offset: u64, data: &[u8]) {
    let mut b = proto::RegionAccess {
        offset,
        region: 0,
        count: data.len() as u32,
    }
    .to_bytes()
    .to_vec();
    b.extend_from_slice(data);
    ok(c, cmd::REGION_WRITE, &b, &[]);
}

fn reg_read(c: &mut Client, offset: u64) -> u32 {
    let b = proto::RegionAccess {
        offset,
        region: 0,
        count: 4,
    }
    .to_bytes();
    proto::u32_at(&ok(c, cmd::REGION_READ, &b, &[]), 16)
}

/// A well-behaved session: VERSION, a map, one table per device mode copying 40000 bytes,
/// every byte compared, the unmap.
fn good_session(path: &std::path::Path) {
    let mut c = Client::connect(path).unwrap();
    let v = proto::Version {
        major: 0,
        minor: 0,
        json: r#"{"capabilities":{"max_msg_fds":16}}"#.into(),
    };
    ok(&mut c, cmd::VERSION, &v.to_bytes(), &[]);
    let mem = memfd(4 << 20);
    let map = DmaMap {
        argsz: 32,
        flags: 3,
        offset: 0,
        iova: 0x1_0000_0000,
        size: 4 << 20,
    };
    ok(&mut c, cmd::DMA_MAP, &map.to_bytes(), &[mem.as_raw_fd()]);
    for mode in [0u32, 1] {
        let data: Vec<u8> = (0..40000u32).map(|i| (i * 7 + mode) as u8 ^ 0x5a).collect();
        let (src, dst) = (0x10_0003u64, 0x20_0ff1u64 + mode as u64 * 0x10_0000);
        pwrite(&mem, src, &data);
        let mut d = Vec::new();
        d.extend_from_slice(&(0x1_0000_0000 + src).to_le_bytes());
        d.extend_from_slice(&(0x1_0000_0000 + dst).to_le_bytes());
        d.extend_from_slice(&(data.len() as u32).to_le_bytes());
        d.extend_from_slice(&[0xff; 12]);
        pwrite(&mem, 0, &d);
        reg_write(&mut c, reg::DESC, &0x1_0000_0000u64.to_le_bytes());
        reg_write(&mut c, reg::COUNT, &1u32.to_le_bytes());
        reg_write(&mut c, reg::MODE, &mode.to_le_bytes());
        reg_write(&mut c, reg::DOORBELL, &1u32.to_le_bytes());
        let mut st = status::BUSY;
        for _ in 0..1000 {
            st = reg_read(&mut c, reg::STATUS);
            if st != status::BUSY {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            st,
            status::DONE,
            "mode {mode}: errno {}",
            reg_read(&mut c, reg::ERRNO)
        );
        assert_eq!(pread(&mem, dst, data.len()), data, "mode {mode}");
    }
    let u = DmaUnmap {
        argsz: 24,
        flags: 0,
        iova: 0x1_0000_0000,
        size: 4 << 20,
        bitmap: None,
    };
    let r = ok(&mut c, cmd::DMA_UNMAP, &u.to_bytes(), &[]);
    assert_eq!(proto::u64_at(&r, 16), 4 << 20, "bytes unmapped");
}

#[test]
fn a_hostile_client_then_a_good_one_and_nothing_left_behind() {
    let dir = std::env::temp_dir().join(format!("memvisor-vfu-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("vfu.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).unwrap();
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let (registry, stop) = (registry.clone(), stop.clone());
        std::thread::spawn(move || serve(listener, registry, stop))
    };

    let seed = std::env::var("MEMVISOR_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed);
    let s = fuzz::run(&path, seed, Duration::from_secs(2)).unwrap();
    eprintln!("seed {seed:#x}: {s:?}");
    // It went deep: many connections and messages, refusals, tables run.
    assert!(s.connections >= 5, "{s:?}");
    assert!(
        s.messages >= 100 && s.refusals >= 10 && s.tables >= 5,
        "{s:?}"
    );
    assert!(
        !server.is_finished(),
        "the server thread ended (panicked?) under the hostile client"
    );

    good_session(&path);

    stop.store(true, Ordering::Relaxed);
    let left = server.join().expect("the server thread panicked");
    assert!(
        left.len() as u64 > s.connections,
        "every hostile connection and the good one"
    );
    assert!(
        !left.last().unwrap().3,
        "the good session ended with an error"
    );
    for (i, &(locked, long_term, pinned, _)) in left.iter().enumerate() {
        assert_eq!(
            (locked, long_term, pinned),
            (0, 0, 0),
            "connection {i} of {} left bytes locked, bytes pinned long-term, device pins",
            left.len()
        );
    }
    assert_eq!(registry.locked_bytes() + registry.cached_bytes(), 0);
    // Every mapping of client memory went with its connection.
    assert_eq!(SharedMappings::global().len(), 0);
    let _ = std::fs::remove_dir_all(&dir);
}
