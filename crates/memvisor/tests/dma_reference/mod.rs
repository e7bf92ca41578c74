//! The reference model of `DmaSpace`, shared by the proptest model test (tests/dma_model.rs) and
//! the `dma_ops` fuzz target (fuzz/fuzz_targets/dma_ops.rs, which includes this file by path).
//! Each of them only chooses operations — proptest from strategies, the fuzzer from bytes — and
//! hands them to a [`Harness`], which runs each on a real space and on the model and compares.
//!
//! The space: 64 pages of IOVA, pages 40..44 reserved, at most 12 mappings, three private
//! backings of 16 pages each. The model is written as plainly as possible: a map from start page
//! to mapping (pages, prot, backing and first page in it, or none while invalidated, and its
//! dirty pages while tracking), the bytes of each backing, the device pins per IOVA page, and
//! whether the space is in Eager pin mode. After every operation the space's answers (success or
//! errno, translated addresses, bytes read, unmapped sizes, dirty bits) must be the model's, and
//! the registry must lock exactly the host pages the model says are pinned. The model follows
//! VFIO type1's order of checks, so the errnos are the ones type1 would give.
//!
//! A divergence is an `Err` naming the operation; the caller turns it into a proptest failure
//! (which shrinks it) or a panic (which libFuzzer keeps as a crash).
#![allow(dead_code)] // each including binary uses part of it

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use memvisor::dma::{LockLimit, PinMode, PinRegistry};
use memvisor::{Backing, BackingKind, DmaConfig, DmaCursor, DmaSpace, Iova, Prot, Range};

/// Page size of the model.
pub const P: u64 = 4096;
/// Pages of IOVA space.
pub const SPACE: u64 = 64;
/// Reserved IOVA pages `[.0, .1)`.
pub const RESERVED: (u64, u64) = (40, 44);
/// Backings to map from.
pub const BACKINGS: usize = 3;
/// Pages in each backing.
pub const BACKING_PAGES: u64 = 16;
/// The space's mapping limit.
pub const LIMIT: usize = 12;

/// One operation on the space. Prot arguments are two bits: 0 none, 1 read, 2 write, 3 both.
#[derive(Clone, Debug)]
pub enum Op {
    Map {
        page: u64,
        pages: u64,
        prot: u8,
        mem: usize,
        off: u64,
    },
    Unmap {
        page: u64,
        pages: u64,
    },
    UnmapAll,
    Invalidate {
        page: u64,
        pages: u64,
    },
    Update {
        page: u64,
        pages: u64,
        mem: usize,
        off: u64,
    },
    /// Translates through the space and through a long-lived cursor; both must agree.
    Translate {
        addr: u64,
        len: u64,
        write: bool,
    },
    Read {
        addr: u64,
        len: u64,
    },
    Write {
        addr: u64,
        len: u64,
        byte: u8,
    },
    Track(bool),
    GetDirty {
        page: u64,
        pages: u64,
    },
    Pin {
        pages: Vec<u64>,
        prot: u8,
    },
    Unpin {
        pages: Vec<u64>,
    },
    /// Unpins what the latest pin still held pinned, as a device finishing its I/O does.
    UnpinLatest,
    Eager(bool),
}

#[derive(Clone, Debug)]
struct M {
    pages: u64,
    prot: u8,
    /// (backing, first page in it); None while invalidated.
    mem: Option<(usize, u64)>,
    /// Dirty pages (relative) while tracking.
    dirty: Option<BTreeSet<u64>>,
}

struct Model {
    maps: BTreeMap<u64, M>, // start page -> mapping
    bytes: Vec<Vec<u8>>,
    tracking: bool,
    /// Device pins per IOVA page.
    pins: BTreeMap<u64, u64>,
    eager: bool,
}

impl Model {
    /// Whether devices hold pins in the mapping starting at `s`.
    fn pinned_in(&self, s: u64) -> bool {
        self.pins.range(s..s + self.maps[&s].pages).next().is_some()
    }

    /// The host pages (backing, page) that must be locked: those behind device pins and, in
    /// Eager mode, every page of every mapping with memory.
    fn locked(&self) -> BTreeSet<(usize, u64)> {
        let mut out = BTreeSet::new();
        for &page in self.pins.keys() {
            let (s, m) = self.at(page).expect("pins keep their mappings");
            let (mem, off) = m.mem.expect("pins keep their memory");
            out.insert((mem, off + page - s));
        }
        if self.eager {
            for m in self.maps.values() {
                if let Some((mem, off)) = m.mem {
                    out.extend((off..off + m.pages).map(|p| (mem, p)));
                }
            }
        }
        out
    }

    /// The answer of pin_pages before it touches anything: the first refusal, in the order the
    /// space checks.
    fn pin_refusal(&self, pages: &[u64], prot: u8) -> Option<i32> {
        if let Some(e) = pin_arguments(pages, prot) {
            return Some(e);
        }
        let k = self.first_refused(pages, prot)?;
        let Some((_, m)) = self.at(pages[k]) else {
            return Some(libc::EINVAL);
        };
        if m.prot & prot != prot {
            return Some(libc::EPERM);
        }
        Some(libc::EBUSY)
    }

    /// The index of the first page pin_pages refuses (unmapped, not allowed, invalidated), once
    /// the call's arguments passed.
    fn first_refused(&self, pages: &[u64], prot: u8) -> Option<usize> {
        pages.iter().position(|&page| {
            self.at(page)
                .is_none_or(|(_, m)| m.prot & prot != prot || m.mem.is_none())
        })
    }

    fn at(&self, page: u64) -> Option<(u64, &M)> {
        self.maps
            .range(..=page)
            .next_back()
            .filter(|(s, m)| page < *s + m.pages)
            .map(|(s, m)| (*s, m))
    }

    /// Mappings inside [page, page+pages), or EINVAL if one is cut.
    fn whole(&self, page: u64, pages: u64) -> Result<Vec<u64>, i32> {
        let end = page + pages;
        let mut out = Vec::new();
        for (&s, m) in &self.maps {
            let e = s + m.pages;
            if e <= page || s >= end {
                continue;
            }
            if s < page || e > end {
                return Err(libc::EINVAL);
            }
            out.push(s);
        }
        Ok(out)
    }

    /// Walks [addr, addr+len) for an access needing the `need` prot bits: the pieces (mapping
    /// start, from byte, n) or errno (`unmapped` for a byte in no mapping, `busy` for an
    /// invalidated host address).
    fn walk(
        &self,
        addr: u64,
        len: u64,
        need: u8,
        unmapped: i32,
        busy: i32,
    ) -> Result<Vec<(u64, u64, u64)>, i32> {
        let mut out = Vec::new();
        let mut pos = addr;
        while pos < addr + len {
            let (s, m) = self.at(pos / P).ok_or(unmapped)?;
            if m.prot & need != need {
                return Err(libc::EPERM);
            }
            if m.mem.is_none() {
                return Err(busy);
            }
            let end = (s + m.pages) * P;
            let n = end.min(addr + len) - pos;
            out.push((s, pos, n));
            pos += n;
        }
        Ok(out)
    }

    fn host_offset(&self, s: u64, byte: u64) -> (usize, usize) {
        let (mem, off) = self.maps[&s].mem.expect("walked pieces have memory");
        (mem, (off * P + byte - s * P) as usize)
    }

    fn mark(&mut self, s: u64, from: u64, n: u64) {
        if let Some(d) = self.maps.get_mut(&s).unwrap().dirty.as_mut() {
            for page in (from / P)..=((from + n - 1) / P) {
                d.insert(page - s);
            }
        }
    }

    /// Marks one IOVA page dirty in its mapping, if tracking.
    fn mark_page(&mut self, page: u64) {
        let s = self.at(page).unwrap().0;
        if let Some(d) = self.maps.get_mut(&s).unwrap().dirty.as_mut() {
            d.insert(page - s);
        }
    }
}

/// Fails the step with a message naming what differed, as prop_assert_eq! would.
macro_rules! check_eq {
    ($got:expr, $want:expr, $($what:tt)+) => {{
        let (got, want) = (&$got, &$want);
        if got != want {
            return Err(format!("{}: got {:?}, the model says {:?}", format!($($what)+), got, want));
        }
    }};
}

/// A space and its model, run side by side.
pub struct Harness {
    space: DmaSpace,
    cursor: DmaCursor,
    registry: Arc<PinRegistry>,
    backings: Vec<Arc<Backing>>,
    model: Model,
    /// The page lists of successful pins not yet unpinned by UnpinLatest, latest last.
    held: Vec<Vec<u64>>,
}

impl Harness {
    /// A fresh space whose page table starts at `table_from` small mappings (0: always).
    pub fn new(table_from: u32) -> Harness {
        let reserved =
            Range::new("r", Iova(RESERVED.0 * P), (RESERVED.1 - RESERVED.0) * P).unwrap();
        let registry = PinRegistry::new(LockLimit::Unlimited);
        let space = DmaSpace::new(DmaConfig {
            max_mappings: LIMIT as u32,
            aperture: (Iova(0), Iova(SPACE * P - 1)),
            reserved: vec![reserved],
            registry: Some(registry.clone()),
            page_table_from: table_from,
            // No notifier is registered, so pins never go: fail fast.
            unpin_wait: std::time::Duration::from_millis(1),
            ..Default::default()
        })
        .unwrap();
        let backings = (0..BACKINGS)
            .map(|_| Arc::new(Backing::new(BackingKind::PrivateAnon, BACKING_PAGES * P).unwrap()))
            .collect();
        Harness {
            cursor: space.cursor(),
            space,
            registry,
            backings,
            model: Model {
                maps: BTreeMap::new(),
                bytes: vec![vec![0; (BACKING_PAGES * P) as usize]; BACKINGS],
                tracking: false,
                pins: BTreeMap::new(),
                eager: false,
            },
            held: Vec::new(),
        }
    }

    /// The registry the space pins through.
    pub fn registry(&self) -> &PinRegistry {
        &self.registry
    }

    /// The bytes the model says are locked now.
    pub fn model_locked_bytes(&self) -> u64 {
        self.model.locked().len() as u64 * P
    }

    /// Runs `op` on the space and the model; then checks the registry's locked bytes, the
    /// device's pinned pages and the number of mappings against the model.
    pub fn step(&mut self, op: &Op) -> Result<(), String> {
        self.apply(op)?;
        check_eq!(
            self.registry.locked_bytes(),
            self.model_locked_bytes(),
            "locked bytes after {op:?}"
        );
        check_eq!(
            self.space.device_pinned_pages(),
            self.model.pins.len() as u64,
            "device pinned pages after {op:?}"
        );
        check_eq!(
            self.space.len(),
            self.model.maps.len(),
            "mappings after {op:?}"
        );
        Ok(())
    }

    /// Drops the space (every pin the model still holds goes with it: nothing may stay locked)
    /// and checks the backings hold exactly the model's bytes.
    pub fn finish(self) -> Result<(), String> {
        let Harness {
            space,
            cursor,
            registry,
            backings,
            model,
            ..
        } = self;
        drop(cursor);
        drop(space);
        check_eq!(
            registry.locked_bytes(),
            0,
            "locked bytes after the space went"
        );
        for (i, b) in backings.iter().enumerate() {
            let mut all = vec![0; (BACKING_PAGES * P) as usize];
            b.read(0, &mut all).unwrap();
            if all != model.bytes[i] {
                return Err(format!("backing {i} differs from the model"));
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: &Op) -> Result<(), String> {
        let err = |r: memvisor::Result<()>| r.err().map(|e| e.errno());
        let (d, model) = (&self.space, &mut self.model);
        match op.clone() {
            Op::Map {
                page,
                pages,
                prot,
                mem,
                off,
            } => {
                let got = err(d.map_backing(
                    Iova(page * P),
                    &self.backings[mem],
                    off * P,
                    pages * P,
                    to_prot(prot),
                ));
                let end = page + pages;
                // type1's order: arguments, overlap, the entry limit, the valid IOVA ranges.
                let expect = if prot == 0 || pages == 0 || off + pages > BACKING_PAGES {
                    Some(libc::EINVAL)
                } else if model
                    .maps
                    .iter()
                    .any(|(&s, m)| s < end && page < s + m.pages)
                {
                    Some(libc::EEXIST)
                } else if model.maps.len() >= LIMIT {
                    Some(libc::ENOSPC)
                } else if end > SPACE || (page < RESERVED.1 && end > RESERVED.0) {
                    Some(libc::EINVAL)
                } else {
                    None
                };
                check_eq!(
                    got,
                    expect,
                    "map page {page} x{pages} prot {prot} mem {mem} off {off}"
                );
                if expect.is_none() {
                    let dirty = model.tracking.then(BTreeSet::new);
                    model.maps.insert(
                        page,
                        M {
                            pages,
                            prot,
                            mem: Some((mem, off)),
                            dirty,
                        },
                    );
                }
            }
            Op::Unmap { page, pages } => {
                let got = d.unmap(Iova(page * P), pages * P).map_err(|e| e.errno());
                let expect = if pages == 0 {
                    Err(libc::EINVAL)
                } else {
                    match model.whole(page, pages) {
                        Err(e) => Err(e),
                        // No unmap notifier is registered: pins stay, EBUSY.
                        Ok(starts) if starts.iter().any(|&s| model.pinned_in(s)) => {
                            Err(libc::EBUSY)
                        }
                        Ok(starts) => Ok(starts
                            .iter()
                            .map(|s| model.maps.remove(s).unwrap().pages * P)
                            .sum::<u64>()),
                    }
                };
                check_eq!(got, expect, "unmap page {page} x{pages}");
            }
            Op::UnmapAll => {
                let got = d.unmap_all().map_err(|e| e.errno());
                if model.pins.is_empty() {
                    let bytes: u64 = model.maps.values().map(|m| m.pages * P).sum();
                    model.maps.clear();
                    check_eq!(got, Ok(bytes), "unmap_all");
                } else {
                    check_eq!(got, Err(libc::EBUSY), "unmap_all with pins held");
                }
            }
            Op::Invalidate { page, pages } => {
                let got = d
                    .invalidate_vaddr(Iova(page * P), pages * P)
                    .map_err(|e| e.errno());
                let expect = if pages == 0 {
                    Err(libc::EINVAL)
                } else {
                    match model.whole(page, pages) {
                        Err(e) => Err(e),
                        // type1's order: an invalidated mapping is EINVAL before anything
                        // waits for devices.
                        Ok(starts) if starts.iter().any(|s| model.maps[s].mem.is_none()) => {
                            Err(libc::EINVAL)
                        }
                        Ok(starts) if starts.iter().any(|&s| model.pinned_in(s)) => {
                            Err(libc::EBUSY)
                        }
                        Ok(starts) => Ok(starts
                            .iter()
                            .map(|s| {
                                let m = model.maps.get_mut(s).unwrap();
                                m.mem = None;
                                m.pages * P
                            })
                            .sum::<u64>()),
                    }
                };
                check_eq!(got, expect, "invalidate page {page} x{pages}");
            }
            Op::Update {
                page,
                pages,
                mem,
                off,
            } => {
                let got =
                    err(d.update_vaddr(Iova(page * P), pages * P, &self.backings[mem], off * P));
                let expect = if off + pages > BACKING_PAGES {
                    Some(libc::EINVAL)
                } else {
                    // The first mapping the range touches is the one it names.
                    let touched = model
                        .maps
                        .iter()
                        .find(|(s, m)| **s < page + pages && page < **s + m.pages)
                        .map(|(&s, m)| (s, m));
                    match touched {
                        None => Some(libc::ENOENT),
                        Some((s, m)) if s != page || m.pages != pages || m.mem.is_some() => {
                            Some(libc::EINVAL)
                        }
                        Some(_) => None,
                    }
                };
                check_eq!(
                    got,
                    expect,
                    "update page {page} x{pages} mem {mem} off {off}"
                );
                if expect.is_none() {
                    model.maps.get_mut(&page).unwrap().mem = Some((mem, off));
                }
            }
            Op::Translate { addr, len, write } => {
                let access = if write { Prot::WRITE } else { Prot::READ };
                let from_space = d
                    .translate(Iova(addr), len, access)
                    .map(|t| (t.hva.0, t.len))
                    .map_err(|e| e.errno());
                let from_cursor = self
                    .cursor
                    .translate(Iova(addr), len, access)
                    .map(|t| (t.hva.0, t.len))
                    .map_err(|e| e.errno());
                let expect = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    let need = if write { 2 } else { 1 };
                    match model.walk(addr, 1, need, libc::EFAULT, libc::EBUSY) {
                        Err(e) => Err(e),
                        Ok(_) => {
                            let (s, m) = model.at(addr / P).unwrap();
                            let n = len.min((s + m.pages) * P - addr);
                            let (mem, off) = model.host_offset(s, addr);
                            Ok((self.backings[mem].hva().0 + off as u64, n))
                        }
                    }
                };
                check_eq!(
                    from_space,
                    expect,
                    "translate {addr:#x}+{len:#x} write {write}"
                );
                check_eq!(from_cursor, expect, "cursor translate {addr:#x}+{len:#x}");
                if let (Ok((_, n)), true) = (expect, write) {
                    // both the space and the cursor marked: the same pages
                    let s = model.at(addr / P).unwrap().0;
                    model.mark(s, addr, n);
                }
            }
            Op::Read { addr, len } => {
                let mut buf = vec![0xa5; len as usize];
                let got = err(d.dma_read(Iova(addr), &mut buf));
                // type1's vfio_dma_rw: EINVAL for nothing to copy or an unmapped byte.
                let walk = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    model.walk(addr, len, 1, libc::EINVAL, libc::EFAULT)
                };
                check_eq!(got, walk.as_ref().err().copied(), "read {addr:#x}+{len:#x}");
                if let Ok(pieces) = walk {
                    let mut want = Vec::new();
                    for (s, from, n) in pieces {
                        let (mem, off) = model.host_offset(s, from);
                        want.extend_from_slice(&model.bytes[mem][off..off + n as usize]);
                    }
                    if buf != want {
                        return Err(format!("read {addr:#x}+{len:#x} returned other bytes"));
                    }
                } else if buf.iter().any(|&b| b != 0xa5) {
                    return Err(format!(
                        "a failed read {addr:#x}+{len:#x} changed the buffer"
                    ));
                }
            }
            Op::Write { addr, len, byte } => {
                let got = err(d.dma_write(Iova(addr), &vec![byte; len as usize]));
                // A CPU write needs READ as well as WRITE.
                let walk = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    model.walk(addr, len, 3, libc::EINVAL, libc::EFAULT)
                };
                check_eq!(
                    got,
                    walk.as_ref().err().copied(),
                    "write {addr:#x}+{len:#x}"
                );
                for (s, from, n) in walk.unwrap_or_default() {
                    let (mem, off) = model.host_offset(s, from);
                    model.bytes[mem][off..off + n as usize].fill(byte);
                    model.mark(s, from, n);
                }
            }
            Op::Track(on) => {
                if on {
                    d.start_dirty_tracking()
                        .map_err(|e| format!("start dirty tracking: {e}"))?
                } else {
                    d.stop_dirty_tracking()
                }
                if on != model.tracking {
                    for m in model.maps.values_mut() {
                        m.dirty = on.then(BTreeSet::new);
                    }
                    model.tracking = on;
                }
            }
            Op::GetDirty { page, pages } => {
                let got = d
                    .get_and_clear_dirty(Iova(page * P), pages * P, P)
                    .map_err(|e| e.errno());
                let expect = if pages == 0 || !model.tracking {
                    Err(libc::EINVAL)
                } else {
                    model.whole(page, pages).map(|starts| {
                        let mut words = vec![0u64; pages.div_ceil(64) as usize];
                        for s in starts {
                            let n = model.maps[&s].pages;
                            // Pinned pages stay dirty; Eager mode reports every page.
                            let pinned: BTreeSet<u64> =
                                model.pins.range(s..s + n).map(|(&p, _)| p - s).collect();
                            let m = model.maps.get_mut(&s).unwrap();
                            let mut bits = std::mem::take(m.dirty.as_mut().unwrap());
                            bits.extend(&pinned);
                            if model.eager {
                                bits.extend(0..n);
                            }
                            *m.dirty.as_mut().unwrap() = pinned;
                            for rel in bits {
                                let bit = s + rel - page;
                                words[(bit / 64) as usize] |= 1 << (bit % 64);
                            }
                        }
                        words
                    })
                };
                check_eq!(got, expect, "get dirty page {page} x{pages}");
            }
            Op::Pin { pages, prot } => {
                let got = d.pin_pages(&pages, to_prot(prot)).map_err(|e| e.errno());
                match model.pin_refusal(&pages, prot) {
                    Some(e) => {
                        check_eq!(got.map(|_| ()), Err(e), "pin {pages:?} prot {prot}");
                        // Pages before the refused one were pinned, marked dirty and unpinned
                        // again; the marks stay (clearing them could drop a real write's).
                        let past_arguments = pin_arguments(&pages, prot).is_none();
                        if let Some(k) =
                            model.first_refused(&pages, prot).filter(|_| past_arguments)
                        {
                            for &page in &pages[..k] {
                                model.mark_page(page);
                            }
                        }
                    }
                    None => {
                        let want: Vec<u64> = pages
                            .iter()
                            .map(|&page| {
                                let (s, m) = model.at(page).unwrap();
                                let (mem, off) = m.mem.unwrap();
                                self.backings[mem].hva().0 + (off + page - s) * P
                            })
                            .collect();
                        let got: Result<Vec<u64>, i32> =
                            got.map(|h| h.iter().map(|h| h.0).collect());
                        check_eq!(got, Ok(want), "pin {pages:?} prot {prot}");
                        for &page in &pages {
                            *model.pins.entry(page).or_default() += 1;
                            model.mark_page(page);
                        }
                        self.held.push(pages);
                    }
                }
            }
            Op::UnpinLatest | Op::Unpin { .. } => {
                let pages = match op {
                    Op::Unpin { pages } => pages.clone(),
                    _ => self.held.pop().unwrap_or_default(),
                };
                let got = d.unpin_pages(&pages).map_err(|e| e.errno());
                let mut need: BTreeMap<u64, u64> = BTreeMap::new();
                for &p in &pages {
                    *need.entry(p).or_default() += 1;
                }
                let expect = if pages.is_empty() {
                    Err(libc::EINVAL)
                } else if pages.len() > 512 {
                    Err(libc::E2BIG)
                } else if need.iter().any(|(p, &n)| {
                    p.checked_mul(P).is_none() || model.pins.get(p).copied().unwrap_or(0) < n
                }) {
                    Err(libc::EINVAL)
                } else {
                    for (p, n) in need {
                        let c = model.pins.get_mut(&p).unwrap();
                        *c -= n;
                        if *c == 0 {
                            model.pins.remove(&p);
                        }
                    }
                    Ok(())
                };
                check_eq!(got, expect, "unpin {pages:?}");
            }
            Op::Eager(eager) => {
                let mode = if eager { PinMode::Eager } else { PinMode::Lazy };
                d.set_pin_mode(mode)
                    .map_err(|e| format!("set pin mode {mode:?}: {e}"))?;
                if model.eager && !eager && model.tracking {
                    // The all-mapped scope ends: what its consumer wrote is reported.
                    for m in model.maps.values_mut() {
                        m.dirty = Some((0..m.pages).collect());
                    }
                }
                model.eager = eager;
            }
        }
        Ok(())
    }
}

/// pin_pages' answer to its arguments alone, before it looks at any mapping.
fn pin_arguments(pages: &[u64], prot: u8) -> Option<i32> {
    if pages.is_empty() {
        return Some(libc::EINVAL);
    }
    if pages.len() > 512 {
        return Some(libc::E2BIG);
    }
    if pages.iter().any(|p| p.checked_mul(P).is_none()) || prot == 0 {
        return Some(libc::EINVAL);
    }
    None
}

fn to_prot(bits: u8) -> Prot {
    match bits & 3 {
        0 => Prot::default(),
        1 => Prot::READ,
        2 => Prot::WRITE,
        _ => Prot::RW,
    }
}
