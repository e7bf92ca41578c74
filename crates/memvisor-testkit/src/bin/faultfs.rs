//! `memvisor-faultfs`: a one-file FUSE file system whose reads and writes fail with EIO on
//! demand, for the real-guest disk-fault trial (`guest/trial.sh blk --disk-fault`). Test tooling,
//! not part of memvisor's library.
//!
//! The model: one regular file, `disk.img`, at the root of the mount, backed by a real file of
//! the same size (every read and write goes to it with `pread` / `pwrite`). Before each read or
//! write the control file is read; its first word picks the fault:
//! - `range` (or no control file): requests overlapping the bad byte range fail with EIO;
//! - `all`: every read and write fails with EIO;
//! - `none`: nothing fails (healed).
//!
//! Files are opened with `FOPEN_DIRECT_IO`, so the kernel's page cache never answers a read
//! for the server: every read and write of the file reaches it and sees the fault of the moment.
//!
//! It speaks the kernel's FUSE protocol on `/dev/fuse` itself (mounted with mount(2), which
//! needs root; no libfuse, no fusermount), and answers only what one file needs: INIT, LOOKUP,
//! GETATTR, SETATTR (attributes unchanged), OPEN, READ, WRITE, FLUSH, FSYNC, RELEASE, STATFS,
//! DESTROY; anything else ENOSYS. It ends when the mount goes (`umount -l`), printing its counts.
//!
//! usage: memvisor-faultfs MOUNTPOINT BACKING_FILE CONTROL_FILE BAD_START BAD_LEN

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;

const ROOT: u64 = 1;
const FILE: u64 = 2;
const NAME: &[u8] = b"disk.img";

const LOOKUP: u32 = 1;
const FORGET: u32 = 2;
const GETATTR: u32 = 3;
const SETATTR: u32 = 4;
const OPEN: u32 = 14;
const READ: u32 = 15;
const WRITE: u32 = 16;
const STATFS: u32 = 17;
const RELEASE: u32 = 18;
const FSYNC: u32 = 20;
const FLUSH: u32 = 25;
const INIT: u32 = 26;
const INTERRUPT: u32 = 36;
const DESTROY: u32 = 38;
const BATCH_FORGET: u32 = 42;

/// Largest write the kernel may send (the default 32 pages of a FUSE request).
const MAX_WRITE: u32 = 128 << 10;
const FOPEN_DIRECT_IO: u32 = 1;
/// Bytes of `struct fuse_in_header`.
const IN_HEADER: usize = 40;

/// The fault the control file asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Range,
    All,
    None,
}

struct Server {
    backing: File,
    size: u64,
    control: String,
    bad: (u64, u64),
    last: Fault,
    reads: u64,
    writes: u64,
    failed: u64,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        eprintln!("usage: memvisor-faultfs MOUNTPOINT BACKING_FILE CONTROL_FILE BAD_START BAD_LEN");
        return ExitCode::from(2);
    }
    match run(&args[1], &args[2], &args[3], &args[4], &args[5]) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memvisor-faultfs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn number(what: &str, s: &str) -> Result<u64, String> {
    let parsed = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    parsed.map_err(|e| format!("{what} {s:?} is not a number: {e}"))
}

fn run(mnt: &str, backing: &str, control: &str, start: &str, len: &str) -> Result<(), String> {
    let start = number("BAD_START", start)?;
    let len = number("BAD_LEN", len)?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| format!("bad range {start:#x}+{len:#x} passes 2^64"))?;
    let backing_file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(backing)
        .map_err(|e| format!("cannot open backing file {backing}: {e}"))?;
    let size = backing_file
        .metadata()
        .map_err(|e| format!("stat {backing}: {e}"))?
        .len();
    let dev = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/fuse")
        .map_err(|e| format!("cannot open /dev/fuse: {e}"))?;
    let opts = format!(
        "fd={},rootmode=40000,user_id=0,group_id=0,allow_other",
        dev.as_raw_fd()
    );
    let c = |s: &str| CString::new(s).map_err(|_| format!("{s:?} holds a NUL byte"));
    let (src, target, kind, data) = (c("memvisor-faultfs")?, c(mnt)?, c("fuse")?, c(&opts)?);
    // SAFETY: every pointer is a NUL-terminated string alive for the call.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            kind.as_ptr(),
            libc::MS_NOSUID | libc::MS_NODEV,
            data.as_ptr().cast(),
        )
    };
    if rc != 0 {
        return Err(format!(
            "mount fuse on {mnt}: {}",
            std::io::Error::last_os_error()
        ));
    }
    eprintln!(
        "memvisor-faultfs: {mnt}/disk.img = {backing} ({size} bytes), bad range [{start:#x}, {end:#x}), control {control}"
    );
    let mut server = Server {
        backing: backing_file,
        size,
        control: control.to_string(),
        bad: (start, end),
        last: Fault::Range,
        reads: 0,
        writes: 0,
        failed: 0,
    };
    let mut buf = vec![0u8; MAX_WRITE as usize + 64 * 1024];
    loop {
        let n = match (&dev).read_request(&mut buf) {
            Ok(n) => n,
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) | Some(libc::ENOENT) | Some(libc::EAGAIN) => continue,
                // The mount is gone.
                Some(libc::ENODEV) => break,
                _ => return Err(format!("read /dev/fuse: {e}")),
            },
        };
        if n < IN_HEADER {
            return Err(format!("short FUSE request of {n} bytes"));
        }
        let req = &buf[..n];
        let opcode = u32_at(req, 4);
        let unique = u64_at(req, 8);
        let node = u64_at(req, 16);
        let body = &req[IN_HEADER..];
        let reply = match opcode {
            FORGET | BATCH_FORGET | INTERRUPT => continue,
            _ => server.handle(opcode, node, body),
        };
        let (error, payload) = match reply {
            Ok(p) => (0i32, p),
            Err(errno) => (-errno, Vec::new()),
        };
        let mut out = Vec::with_capacity(16 + payload.len());
        out.extend_from_slice(&((16 + payload.len()) as u32).to_le_bytes());
        out.extend_from_slice(&error.to_le_bytes());
        out.extend_from_slice(&unique.to_le_bytes());
        out.extend_from_slice(&payload);
        if let Err(e) = (&dev).write_reply(&out) {
            // ENOENT: the request was interrupted and is gone.
            if e.raw_os_error() != Some(libc::ENOENT) {
                eprintln!("memvisor-faultfs: reply to opcode {opcode}: {e}");
            }
        }
        if opcode == DESTROY {
            break;
        }
    }
    eprintln!(
        "memvisor-faultfs: done: reads={} writes={} failed={}",
        server.reads, server.writes, server.failed
    );
    Ok(())
}

/// One read of a whole request, and one write of a whole reply, on `/dev/fuse`.
trait FuseDev {
    fn read_request(&self, buf: &mut [u8]) -> std::io::Result<usize>;
    fn write_reply(&self, out: &[u8]) -> std::io::Result<()>;
}

impl FuseDev for &File {
    fn read_request(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        std::io::Read::read(&mut &**self, buf)
    }
    fn write_reply(&self, out: &[u8]) -> std::io::Result<()> {
        let n = std::io::Write::write(&mut &**self, out)?;
        if n != out.len() {
            return Err(std::io::Error::other(format!(
                "wrote {n} of {} bytes",
                out.len()
            )));
        }
        Ok(())
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    b.get(at..at + 8)
        .map_or(0, |s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
}

impl Server {
    fn handle(&mut self, opcode: u32, node: u64, body: &[u8]) -> Result<Vec<u8>, i32> {
        match opcode {
            INIT => {
                // fuse_init_out of protocol 7.31: major, minor, max_readahead, flags,
                // max_background, congestion_threshold, max_write, time_gran, max_pages,
                // map_alignment, flags2, unused.
                let mut o = Vec::with_capacity(64);
                o.extend_from_slice(&7u32.to_le_bytes());
                o.extend_from_slice(&31u32.to_le_bytes());
                o.extend_from_slice(&u32_at(body, 8).to_le_bytes());
                o.extend_from_slice(&0u32.to_le_bytes());
                o.extend_from_slice(&16u16.to_le_bytes());
                o.extend_from_slice(&12u16.to_le_bytes());
                o.extend_from_slice(&MAX_WRITE.to_le_bytes());
                o.extend_from_slice(&1u32.to_le_bytes());
                o.resize(64, 0);
                Ok(o)
            }
            LOOKUP => {
                let name = body.split(|&b| b == 0).next().unwrap_or_default();
                if node != ROOT || name != NAME {
                    return Err(libc::ENOENT);
                }
                // fuse_entry_out: nodeid, generation, entry_valid, attr_valid, their nsecs,
                // then the attributes.
                let mut o = Vec::with_capacity(128);
                o.extend_from_slice(&FILE.to_le_bytes());
                o.extend_from_slice(&1u64.to_le_bytes());
                o.extend_from_slice(&[0u8; 24]);
                o.extend_from_slice(&self.attr(FILE));
                Ok(o)
            }
            GETATTR | SETATTR => {
                if node != ROOT && node != FILE {
                    return Err(libc::ENOENT);
                }
                // fuse_attr_out: attr_valid, attr_valid_nsec, dummy, attributes.
                let mut o = vec![0u8; 16];
                o.extend_from_slice(&self.attr(node));
                Ok(o)
            }
            OPEN => {
                if node != FILE {
                    return Err(libc::EISDIR);
                }
                let mut o = vec![0u8; 16];
                o[8..12].copy_from_slice(&FOPEN_DIRECT_IO.to_le_bytes());
                Ok(o)
            }
            READ => {
                let offset = u64_at(body, 8);
                let size = u32_at(body, 16) as usize;
                self.reads += 1;
                self.check(offset, size as u64)?;
                let size = size.min(self.size.saturating_sub(offset) as usize);
                let mut data = vec![0u8; size];
                let mut done = 0;
                while done < size {
                    match self
                        .backing
                        .read_at(&mut data[done..], offset + done as u64)
                    {
                        Ok(0) => break,
                        Ok(n) => done += n,
                        Err(e) => return Err(e.raw_os_error().unwrap_or(libc::EIO)),
                    }
                }
                data.truncate(done);
                Ok(data)
            }
            WRITE => {
                let offset = u64_at(body, 8);
                let size = u32_at(body, 16) as usize;
                let data = body.get(40..40 + size).ok_or(libc::EINVAL)?;
                self.writes += 1;
                self.check(offset, size as u64)?;
                if offset.saturating_add(size as u64) > self.size {
                    self.failed += 1;
                    return Err(libc::ENOSPC);
                }
                self.backing
                    .write_all_at(data, offset)
                    .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
                let mut o = (size as u32).to_le_bytes().to_vec();
                o.extend_from_slice(&[0u8; 4]);
                Ok(o)
            }
            FSYNC => {
                self.backing
                    .sync_data()
                    .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
                Ok(Vec::new())
            }
            FLUSH | RELEASE | DESTROY => Ok(Vec::new()),
            STATFS => {
                // fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize.
                let mut o = Vec::with_capacity(80);
                for v in [self.size / 4096, 0, 0, 1, 0] {
                    o.extend_from_slice(&v.to_le_bytes());
                }
                for v in [4096u32, 255, 4096] {
                    o.extend_from_slice(&v.to_le_bytes());
                }
                o.resize(80, 0);
                Ok(o)
            }
            _ => Err(libc::ENOSYS),
        }
    }

    /// EIO if the fault of the moment covers `[offset, offset + len)`.
    fn check(&mut self, offset: u64, len: u64) -> Result<(), i32> {
        let fault = match std::fs::read_to_string(&self.control) {
            Ok(s) => match s.split_whitespace().next() {
                Some("all") => Fault::All,
                Some("none") => Fault::None,
                _ => Fault::Range,
            },
            Err(_) => Fault::Range,
        };
        if fault != self.last {
            eprintln!(
                "memvisor-faultfs: fault now {fault:?} (so far reads={} writes={} failed={})",
                self.reads, self.writes, self.failed
            );
            self.last = fault;
        }
        let hit = match fault {
            Fault::All => true,
            Fault::None => false,
            Fault::Range => offset < self.bad.1 && offset.saturating_add(len) > self.bad.0,
        };
        if hit {
            self.failed += 1;
            return Err(libc::EIO);
        }
        Ok(())
    }

    /// `struct fuse_attr` of the root directory or the file.
    fn attr(&self, node: u64) -> Vec<u8> {
        let (size, mode, nlink) = if node == ROOT {
            (0, libc::S_IFDIR | 0o755, 2u32)
        } else {
            (self.size, libc::S_IFREG | 0o644, 1u32)
        };
        let mut o = Vec::with_capacity(88);
        // ino, size, blocks, atime, mtime, ctime, three nsecs.
        for v in [node, size, size.div_ceil(512), 0, 0, 0] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o.extend_from_slice(&[0u8; 12]);
        // mode, nlink, uid, gid, rdev, blksize, flags.
        for v in [mode, nlink, 0, 0, 0, 4096, 0] {
            o.extend_from_slice(&v.to_le_bytes());
        }
        o
    }
}
