//! Model-based test of DmaSpace: random sequences of map / unmap / unmap_all / invalidate /
//! update / translate (space and a long-lived cursor) / dma_read / dma_write / pin_pages /
//! unpin_pages / pin mode switches / dirty tracking, with page numbers up to `u64::MAX`, against
//! a reference model written as plainly as possible: a list of mappings, the pin count of each
//! IOVA page and the bytes of each backing. After every step the space's answers must be the
//! model's, and the memory locked must be exactly the host pages the model says are pinned —
//! by the registry's account and by the kernel's `VmLck`, so this binary holds this one test.
//! 2000 sequences of 50-60 operations by default (at least 100 000 operations), each run on two
//! spaces: one that always keeps its page table and one whose page table starts and stops;
//! `MEMVISOR_MODEL_CASES=N` runs N sequences (CI runs a bounded number, a long local run more).
//! A divergence fails with proptest's shrunk sequence.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use memvisor::dma::{LockLimit, PinMode, PinRegistry};
use memvisor::{Access, Backing, BackingKind, DmaConfig, DmaSpace, Iova, Prot, Range};
use proptest::prelude::*;

mod common;

const P: u64 = 4096;
/// IOVA space of 64 pages, pages 40..44 reserved; 3 backings of 16 pages; at most 12 mappings.
const SPACE: u64 = 64;
const RESERVED: (u64, u64) = (40, 44);
const BACKINGS: usize = 3;
const BACKING_PAGES: u64 = 16;
const LIMIT: usize = 12;

#[derive(Clone, Debug)]
enum Op {
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

/// IOVA page numbers for pin_pages: mostly inside the space, sometimes at the edges of 64 bits.
fn pin_page() -> impl Strategy<Value = u64> {
    prop_oneof![
        12 => 0..SPACE,
        1 => Just(u64::MAX),
        1 => Just(u64::MAX / P),
        1 => Just(u64::MAX / P + 1),
        1 => any::<u64>(),
    ]
}

fn pin_list() -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        20 => proptest::collection::vec(pin_page(), 0..5),
        // runs of consecutive pages, as devices pin them
        6 => (0..SPACE, 1..6u64).prop_map(|(s, n)| (s..s + n).collect()),
        1 => Just(vec![0; 513]),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let page = 0..SPACE;
    let pages = 0..6u64;
    let addr = 0..SPACE * P;
    prop_oneof![
        4 => (page.clone(), 1..5u64, 0..4u8, 0..BACKINGS, 0..BACKING_PAGES)
            .prop_map(|(page, pages, prot, mem, off)| Op::Map { page, pages, prot, mem, off }),
        2 => (page.clone(), pages.clone()).prop_map(|(page, pages)| Op::Unmap { page, pages }),
        1 => Just(Op::UnmapAll),
        1 => (page.clone(), pages.clone()).prop_map(|(page, pages)| Op::Invalidate { page, pages }),
        1 => (page.clone(), 1..5u64, 0..BACKINGS, 0..BACKING_PAGES)
            .prop_map(|(page, pages, mem, off)| Op::Update { page, pages, mem, off }),
        3 => (addr.clone(), 0..2 * P, any::<bool>()).prop_map(|(addr, len, write)| Op::Translate { addr, len, write }),
        3 => (addr.clone(), 0..3 * P).prop_map(|(addr, len)| Op::Read { addr, len }),
        3 => (addr, 0..3 * P, any::<u8>()).prop_map(|(addr, len, byte)| Op::Write { addr, len, byte }),
        1 => any::<bool>().prop_map(Op::Track),
        1 => (page, pages).prop_map(|(page, pages)| Op::GetDirty { page, pages }),
        // the whole space: cuts no mapping
        2 => Just(Op::GetDirty { page: 0, pages: SPACE }),
        3 => (pin_list(), 0..4u8).prop_map(|(pages, prot)| Op::Pin { pages, prot }),
        1 => pin_list().prop_map(|pages| Op::Unpin { pages }),
        3 => Just(Op::UnpinLatest),
        1 => any::<bool>().prop_map(Op::Eager),
    ]
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
        let (mem, off) = self.maps[&s].mem.unwrap();
        (mem, (off * P + byte - s * P) as usize)
    }
    fn mark(&mut self, s: u64, from: u64, n: u64) {
        if let Some(d) = self.maps.get_mut(&s).unwrap().dirty.as_mut() {
            for page in (from / P)..=((from + n - 1) / P) {
                d.insert(page - s);
            }
        }
    }
}

/// Runs `ops` on a space that keeps its page table from `table_from` small mappings on.
fn run(ops: Vec<Op>, table_from: u32) -> Result<(), TestCaseError> {
    let reserved = Range::new("r", Iova(RESERVED.0 * P), (RESERVED.1 - RESERVED.0) * P).unwrap();
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let base = common::vm_lck();
    let d = DmaSpace::new(DmaConfig {
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
    let backings: Vec<Arc<Backing>> = (0..BACKINGS)
        .map(|_| Arc::new(Backing::new(BackingKind::PrivateAnon, BACKING_PAGES * P).unwrap()))
        .collect();
    let mut model = Model {
        maps: BTreeMap::new(),
        bytes: vec![vec![0; (BACKING_PAGES * P) as usize]; BACKINGS],
        tracking: false,
        pins: BTreeMap::new(),
        eager: false,
    };
    let mut cursor = d.cursor();
    // the page lists of successful pins not yet unpinned by UnpinLatest, latest last
    let mut held: Vec<Vec<u64>> = Vec::new();
    let err = |r: memvisor::Result<()>| r.err().map(|e| e.errno());

    for op in ops {
        let step = format!("{op:?}");
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
                    &backings[mem],
                    off * P,
                    pages * P,
                    to_prot(prot),
                ));
                let end = page + pages;
                // type1's order: arguments, overlap, the entry limit, the valid IOVA ranges.
                let expect = if prot == 0 || off + pages > BACKING_PAGES {
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
                prop_assert_eq!(got, expect, "map page {} x{}", page, pages);
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
                prop_assert_eq!(got, expect, "unmap page {} x{}", page, pages);
            }
            Op::UnmapAll => {
                let got = d.unmap_all().map_err(|e| e.errno());
                if model.pins.is_empty() {
                    let bytes: u64 = model.maps.values().map(|m| m.pages * P).sum();
                    model.maps.clear();
                    prop_assert_eq!(got, Ok(bytes));
                } else {
                    prop_assert_eq!(got, Err(libc::EBUSY));
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
                prop_assert_eq!(got, expect, "invalidate page {} x{}", page, pages);
            }
            Op::Update {
                page,
                pages,
                mem,
                off,
            } => {
                let got = err(d.update_vaddr(Iova(page * P), pages * P, &backings[mem], off * P));
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
                prop_assert_eq!(got, expect, "update page {} x{}", page, pages);
                if expect.is_none() {
                    model.maps.get_mut(&page).unwrap().mem = Some((mem, off));
                }
            }
            Op::Translate { addr, len, write } => {
                let access = if write { Access::Write } else { Access::Read };
                let from_space = d
                    .translate(Iova(addr), len, access)
                    .map(|t| (t.hva.0, t.len))
                    .map_err(|e| e.errno());
                let from_cursor = cursor
                    .translate(Iova(addr), len, access)
                    .map(|t| (t.hva.0, t.len))
                    .map_err(|e| e.errno());
                let expect = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    match model.walk(
                        addr,
                        1,
                        if write { 2 } else { 1 },
                        libc::EFAULT,
                        libc::EBUSY,
                    ) {
                        Err(e) => Err(e),
                        Ok(_) => {
                            let (s, m) = model.at(addr / P).unwrap();
                            let n = len.min((s + m.pages) * P - addr);
                            let (mem, off) = model.host_offset(s, addr);
                            Ok((backings[mem].hva().0 + off as u64, n))
                        }
                    }
                };
                prop_assert_eq!(
                    from_space,
                    expect,
                    "translate {:#x}+{:#x} {}",
                    addr,
                    len,
                    write
                );
                prop_assert_eq!(
                    from_cursor,
                    expect,
                    "cursor translate {:#x}+{:#x}",
                    addr,
                    len
                );
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
                prop_assert_eq!(
                    got,
                    walk.as_ref().err().copied(),
                    "read {:#x}+{:#x}",
                    addr,
                    len
                );
                if let Ok(pieces) = walk {
                    let mut want = Vec::new();
                    for (s, from, n) in pieces {
                        let (mem, off) = model.host_offset(s, from);
                        want.extend_from_slice(&model.bytes[mem][off..off + n as usize]);
                    }
                    prop_assert!(
                        buf == want,
                        "read {:#x}+{:#x} returned other bytes",
                        addr,
                        len
                    );
                } else {
                    prop_assert!(
                        buf.iter().all(|&b| b == 0xa5),
                        "a failed read changed the buffer"
                    );
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
                prop_assert_eq!(
                    got,
                    walk.as_ref().err().copied(),
                    "write {:#x}+{:#x}",
                    addr,
                    len
                );
                for (s, from, n) in walk.unwrap_or_default() {
                    let (mem, off) = model.host_offset(s, from);
                    model.bytes[mem][off..off + n as usize].fill(byte);
                    model.mark(s, from, n);
                }
            }
            Op::Track(on) => {
                if on {
                    d.start_dirty_tracking().unwrap()
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
                prop_assert_eq!(got, expect, "get dirty page {} x{}", page, pages);
            }
            Op::Pin { pages, prot } => {
                let got = d.pin_pages(&pages, to_prot(prot)).map_err(|e| e.errno());
                match model.pin_refusal(&pages, prot) {
                    Some(e) => {
                        prop_assert_eq!(got.map(|_| ()), Err(e), "pin {:?}", pages);
                        // Pages before the refused one were pinned, marked dirty and unpinned
                        // again; the marks stay (clearing them could drop a real write's).
                        let past_arguments = pin_arguments(&pages, prot).is_none();
                        if let Some(k) =
                            model.first_refused(&pages, prot).filter(|_| past_arguments)
                        {
                            for &page in &pages[..k] {
                                let s = model.at(page).unwrap().0;
                                if let Some(d) = model.maps.get_mut(&s).unwrap().dirty.as_mut() {
                                    d.insert(page - s);
                                }
                            }
                        }
                    }
                    None => {
                        let want: Vec<u64> = pages
                            .iter()
                            .map(|&page| {
                                let (s, m) = model.at(page).unwrap();
                                let (mem, off) = m.mem.unwrap();
                                backings[mem].hva().0 + (off + page - s) * P
                            })
                            .collect();
                        let got: Result<Vec<u64>, i32> =
                            got.map(|h| h.iter().map(|h| h.0).collect());
                        prop_assert_eq!(got, Ok(want), "pin {:?}", pages);
                        held.push(pages.clone());
                        for &page in &pages {
                            *model.pins.entry(page).or_default() += 1;
                            let s = model.at(page).unwrap().0;
                            if let Some(d) = model.maps.get_mut(&s).unwrap().dirty.as_mut() {
                                d.insert(page - s);
                            }
                        }
                    }
                }
            }
            Op::UnpinLatest | Op::Unpin { .. } => {
                let pages = match op {
                    Op::Unpin { pages } => pages,
                    _ => held.pop().unwrap_or_default(),
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
                prop_assert_eq!(got, expect, "unpin {:?}", pages);
            }
            Op::Eager(eager) => {
                let mode = if eager { PinMode::Eager } else { PinMode::Lazy };
                d.set_pin_mode(mode).unwrap();
                if model.eager && !eager && model.tracking {
                    // The all-mapped scope ends: what its consumer wrote is reported.
                    for m in model.maps.values_mut() {
                        m.dirty = Some((0..m.pages).collect());
                    }
                }
                model.eager = eager;
            }
        }
        let locked = model.locked().len() as u64 * P;
        prop_assert_eq!(
            registry.locked_bytes(),
            locked,
            "locked bytes after {}",
            step
        );
        // The kernel holds what is pinned plus the lock cache, and nothing else.
        prop_assert_eq!(
            common::vm_lck() - base,
            locked + registry.cached_bytes(),
            "VmLck after {}",
            step
        );
        prop_assert_eq!(
            d.device_pinned_pages(),
            model.pins.len() as u64,
            "after {}",
            step
        );
    }
    // every pin the model still holds goes with the space; nothing stays locked
    drop(cursor);
    drop(d);
    prop_assert_eq!(registry.locked_bytes(), 0);
    prop_assert_eq!(common::vm_lck(), base, "VmLck after the space was dropped");
    // the backings hold exactly the model's bytes
    for (i, b) in backings.iter().enumerate() {
        let mut all = vec![0; (BACKING_PAGES * P) as usize];
        b.read(0, &mut all).unwrap();
        prop_assert!(
            all == model.bytes[i],
            "backing {} differs from the model",
            i
        );
    }
    Ok(())
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
    match bits {
        0 => Prot::default(),
        1 => Prot::READ,
        2 => Prot::WRITE,
        _ => Prot::RW,
    }
}

/// Sequences to run: `MEMVISOR_MODEL_CASES`, else 2000.
fn cases() -> u32 {
    std::env::var("MEMVISOR_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]
    #[test]
    fn dma_space_matches_the_model(ops in proptest::collection::vec(op(), 50..=60)) {
        // Each sequence twice: on a space that always keeps its page table (as the saved
        // cases were found), and on one whose table starts at 4 or 8 small mappings and stops
        // below 1 or 2 (the model never holds the default's 64).
        let table_from = [4, 8][ops.len() % 2];
        for (ops, from) in [(ops.clone(), 0), (ops, table_from)] {
            run(ops, from).map_err(|e| TestCaseError::fail(format!("page table from {from}: {e}")))?;
        }
    }
}
