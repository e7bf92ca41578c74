//! A recording of the IOTLB traffic between a frontend and a back end, for replay.
//!
//! Behind a vIOMMU the back end's device space changes with every guest map and unmap: QEMU
//! sends `IOTLB_MSG` UPDATE and INVALIDATE, the back end asks with MISS. How fast memvisor takes
//! that traffic is best measured against what a real guest sent, so a back end can write it
//! down and `memvisor-bench iotlb` replays it. The back end tells an observer of its traffic
//! (`memvisor_vhost::observe`, a test-hooks seam); [`Recorder`] is that observer, in this
//! crate's `test-hooks` build, and `memvisor vhost-user-blk --record-iotlb FILE` (a test-hooks
//! server) installs it.
//!
//! The format is text, one event per line, numbers in hex except the time (ns since the
//! recording began):
//!
//! ```text
//! T                                        the memory table changed; it is now:
//! R <gpa> <size> <user address>            one of its regions
//! U <t> <iova> <size> <user address> <perm> IOTLB UPDATE (perm 1 read, 2 write, 3 both)
//! I <t> <iova> <size>                      IOTLB INVALIDATE
//! M <t> <iova> <perm>                      the back end's MISS
//! ```
//!
//! Replay starts over (an empty IOTLB) at each table: the frontend changes its memory when it
//! connects, and then the IOTLB traffic refers to that table.

use std::io::Write;
use std::time::Instant;

use memvisor_vhost::proto::Region;

/// A malformed line of a recording: which one, what was wrong, and the line itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError {
    /// The line's number, from 1.
    pub line: usize,
    /// What was expected there.
    pub what: String,
    /// The line as read.
    pub text: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IOTLB recording line {}: {}: {:?}",
            self.line, self.what, self.text
        )
    }
}

impl std::error::Error for ParseError {}

/// One recorded event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The memory table changed; the `Region`s that follow are all of it.
    Table,
    /// A region of the frontend's memory table.
    Region {
        /// Guest physical address.
        gpa: u64,
        /// Bytes.
        size: u64,
        /// The frontend's user address of its first byte.
        uaddr: u64,
    },
    /// IOTLB UPDATE at `t` ns.
    Update {
        /// Time since the recording began, ns.
        t: u64,
        /// First IOVA.
        iova: u64,
        /// Bytes.
        size: u64,
        /// The frontend's user address `iova` maps to.
        uaddr: u64,
        /// 1 read, 2 write, 3 both.
        perm: u8,
    },
    /// IOTLB INVALIDATE at `t` ns.
    Invalidate {
        /// Time since the recording began, ns.
        t: u64,
        /// First IOVA.
        iova: u64,
        /// Bytes.
        size: u64,
    },
    /// The back end's MISS at `t` ns.
    Miss {
        /// Time since the recording began, ns.
        t: u64,
        /// The IOVA asked for.
        iova: u64,
        /// 1 read, 2 write, 3 both.
        perm: u8,
    },
}

/// Writes events as they happen. Write errors end the recording (logged once), never the
/// back end.
pub struct Recorder {
    out: Option<Box<dyn Write + Send>>,
    start: Instant,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recorder")
            .field("on", &self.out.is_some())
            .finish()
    }
}

impl Recorder {
    /// Records into `out` (buffer it: there is one line per message).
    pub fn new(out: Box<dyn Write + Send>) -> Recorder {
        Recorder {
            out: Some(out),
            start: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    /// The memory table the following events refer to (all of it, after every change).
    pub fn table(&mut self, regions: &[Region]) {
        self.put("T\n");
        for r in regions {
            let line = format!("R {:x} {:x} {:x}\n", r.gpa, r.size, r.user_addr);
            self.put(&line);
        }
    }

    /// An IOTLB UPDATE.
    pub fn update(&mut self, iova: u64, size: u64, uaddr: u64, perm: u8) {
        let line = format!("U {} {iova:x} {size:x} {uaddr:x} {perm}\n", self.now());
        self.put(&line);
    }

    /// An IOTLB INVALIDATE.
    pub fn invalidate(&mut self, iova: u64, size: u64) {
        let line = format!("I {} {iova:x} {size:x}\n", self.now());
        self.put(&line);
    }

    /// A MISS the back end sent.
    pub fn miss(&mut self, iova: u64, perm: u8) {
        let line = format!("M {} {iova:x} {perm}\n", self.now());
        self.put(&line);
    }

    /// Flushes what is buffered (the back end calls this when a connection ends).
    pub fn flush(&mut self) {
        if let Some(out) = self.out.as_mut() {
            if let Err(e) = out.flush() {
                log::warn!("IOTLB recording stopped: {e}");
                self.out = None;
            }
        }
    }

    fn put(&mut self, line: &str) {
        if let Some(out) = self.out.as_mut() {
            if let Err(e) = out.write_all(line.as_bytes()) {
                log::warn!("IOTLB recording stopped: {e}");
                self.out = None;
            }
        }
    }
}

/// The back end's observer seam, written down (a test-hooks build of the back end only).
#[cfg(feature = "test-hooks")]
impl memvisor_vhost::observe::IotlbObserver for Recorder {
    fn table(&mut self, regions: &[Region]) {
        Recorder::table(self, regions)
    }
    fn update(&mut self, iova: u64, size: u64, uaddr: u64, perm: u8) {
        Recorder::update(self, iova, size, uaddr, perm)
    }
    fn invalidate(&mut self, iova: u64, size: u64) {
        Recorder::invalidate(self, iova, size)
    }
    fn miss(&mut self, iova: u64, perm: u8) {
        Recorder::miss(self, iova, perm)
    }
    fn flush(&mut self) {
        Recorder::flush(self)
    }
}

/// Parses a recording; a [`ParseError`] naming the line for anything malformed.
pub fn parse(text: &str) -> Result<Vec<Event>, ParseError> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let bad = |what: &str| ParseError {
            line: n + 1,
            what: what.to_string(),
            text: line.to_string(),
        };
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.is_empty() {
            continue;
        }
        let hex = |i: usize| {
            f.get(i)
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .ok_or_else(|| bad("expected a hex number"))
        };
        let dec = |i: usize| {
            f.get(i)
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or_else(|| bad("expected a time in ns"))
        };
        let perm = |i: usize| {
            f.get(i)
                .and_then(|s| s.parse::<u8>().ok())
                .filter(|p| (1..=3).contains(p))
                .ok_or_else(|| bad("expected a permission 1, 2 or 3"))
        };
        let (ev, fields) = match f[0] {
            "T" => (Event::Table, 1),
            "R" => (
                Event::Region {
                    gpa: hex(1)?,
                    size: hex(2)?,
                    uaddr: hex(3)?,
                },
                4,
            ),
            "U" => (
                Event::Update {
                    t: dec(1)?,
                    iova: hex(2)?,
                    size: hex(3)?,
                    uaddr: hex(4)?,
                    perm: perm(5)?,
                },
                6,
            ),
            "I" => (
                Event::Invalidate {
                    t: dec(1)?,
                    iova: hex(2)?,
                    size: hex(3)?,
                },
                4,
            ),
            "M" => (
                Event::Miss {
                    t: dec(1)?,
                    iova: hex(2)?,
                    perm: perm(3)?,
                },
                4,
            ),
            _ => return Err(bad("expected T, R, U, I or M")),
        };
        if f.len() != fields {
            return Err(bad(&format!("expected {fields} fields")));
        }
        out.push(ev);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn what_is_recorded_parses_back() {
        let buf = Shared::default();
        let mut r = Recorder::new(Box::new(buf.clone()));
        r.table(&[Region {
            gpa: 0,
            size: 1 << 30,
            user_addr: 0x7f00_0000_0000,
            mmap_offset: 0,
        }]);
        r.miss(0xfff0_0000, 3);
        r.update(0xfff0_0000, 0x1000, 0x7f00_0001_0000, 3);
        r.invalidate(0xfff0_0000, 0x1000);
        r.flush();
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let ev = parse(&text).unwrap();
        assert_eq!(ev.len(), 5);
        assert_eq!(ev[0], Event::Table);
        let ev = &ev[1..];
        assert_eq!(
            ev[0],
            Event::Region {
                gpa: 0,
                size: 1 << 30,
                uaddr: 0x7f00_0000_0000
            }
        );
        assert!(matches!(
            ev[1],
            Event::Miss {
                iova: 0xfff0_0000,
                perm: 3,
                ..
            }
        ));
        assert!(matches!(
            ev[2],
            Event::Update {
                iova: 0xfff0_0000,
                size: 0x1000,
                uaddr: 0x7f00_0001_0000,
                perm: 3,
                ..
            }
        ));
        assert!(matches!(
            ev[3],
            Event::Invalidate {
                iova: 0xfff0_0000,
                size: 0x1000,
                ..
            }
        ));
    }

    #[test]
    fn malformed_lines_are_refused_naming_the_line() {
        for bad in [
            "X 1 2",
            "U 1 zz 1000 0 3",
            "U 1 0 1000 0 7",
            "I 1 0",
            "M 1 0 3 9",
        ] {
            let e = parse(&format!("R 0 1000 0\n{bad}\n")).unwrap_err();
            assert!(e.to_string().contains("line 2"), "{bad}: {e}");
        }
    }
}
