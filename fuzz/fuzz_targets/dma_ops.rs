//! `DmaSpace` operation sequences against a small model, the fuzzing twin of the proptest model
//! in crates/memvisor/tests/dma_model.rs. The space: 64 pages of IOVA, pages 40..44 reserved,
//! at most 12 mappings, three backings of 16 pages. The model: a map from start page to mapping
//! (pages, prot, backing and offset, or none while invalidated), the bytes of each backing, and
//! the device pins per IOVA page. Each op is one byte choosing it and a few argument bytes;
//! after each the space must answer as the model says (success or errno, translated addresses,
//! bytes read, unmapped sizes), and the registry must lock exactly the host pages under pins.
//! A divergence panics with the op, so libFuzzer keeps the input.
#![no_main]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use memvisor::dma::{LockLimit, PinRegistry};
use memvisor::{Access, Backing, BackingKind, DmaConfig, DmaSpace, Iova, Prot, Range};
use memvisor_fuzz::Bytes;

const P: u64 = 4096;
const SPACE: u64 = 64;
const RESERVED: (u64, u64) = (40, 44);
const BACKINGS: usize = 3;
const BACKING_PAGES: u64 = 16;
const LIMIT: usize = 12;

#[derive(Clone, Copy, Debug)]
struct M {
    pages: u64,
    prot: u8,
    mem: Option<(usize, u64)>,
}

#[derive(Default)]
struct Model {
    maps: BTreeMap<u64, M>,
    bytes: Vec<Vec<u8>>,
    pins: BTreeMap<u64, u64>,
    /// Whether dirty tracking is on, and the IOVA pages written since it started or was last
    /// read; each must be reported dirty (pins may add more).
    tracking: bool,
    written: BTreeSet<u64>,
}

impl Model {
    fn at(&self, page: u64) -> Option<(u64, M)> {
        self.maps
            .range(..=page)
            .next_back()
            .filter(|(s, m)| page < *s + m.pages)
            .map(|(s, m)| (*s, *m))
    }
    /// Mappings inside [page, page+pages), or EINVAL if the range cuts one.
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
    fn pinned_in(&self, s: u64) -> bool {
        self.pins.range(s..s + self.maps[&s].pages).next().is_some()
    }
    /// The pieces (start, from byte, n) of [addr, addr+len) for an access needing `need`.
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
            let n = ((s + m.pages) * P).min(addr + len) - pos;
            out.push((s, pos, n));
            pos += n;
        }
        Ok(out)
    }
    fn host(&self, s: u64, byte: u64) -> (usize, usize) {
        let (mem, off) = self.maps[&s].mem.expect("walked pieces have memory");
        (mem, (off * P + byte - s * P) as usize)
    }
    /// Host pages locked: those behind device pins.
    fn locked(&self) -> usize {
        let mut out = BTreeSet::new();
        for &page in self.pins.keys() {
            let (s, m) = self.at(page).expect("pins keep their mappings");
            let (mem, off) = m.mem.expect("pins keep their memory");
            out.insert((mem, off + page - s));
        }
        out.len()
    }
}

fn prot(bits: u8) -> Prot {
    match bits & 3 {
        0 => Prot::default(),
        1 => Prot::READ,
        2 => Prot::WRITE,
        _ => Prot::RW,
    }
}

fn errno(r: memvisor::Result<()>) -> Option<i32> {
    r.err().map(|e| e.errno())
}

fuzz_target!(|data: &[u8]| {
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let reserved = Range::new("r", Iova(RESERVED.0 * P), (RESERVED.1 - RESERVED.0) * P).unwrap();
    let d = DmaSpace::new(DmaConfig {
        max_mappings: LIMIT as u32,
        aperture: (Iova(0), Iova(SPACE * P - 1)),
        reserved: vec![reserved],
        registry: Some(registry.clone()),
        // No unmap notifier: pins never go, fail fast.
        unpin_wait: std::time::Duration::from_millis(1),
        ..Default::default()
    })
    .unwrap();
    let backings: Vec<Arc<Backing>> = (0..BACKINGS)
        .map(|_| Arc::new(Backing::new(BackingKind::PrivateAnon, BACKING_PAGES * P).unwrap()))
        .collect();
    let mut model = Model {
        bytes: vec![vec![0; (BACKING_PAGES * P) as usize]; BACKINGS],
        ..Model::default()
    };
    let mut held: Vec<Vec<u64>> = Vec::new();
    let mut b = Bytes::new(data);
    while !b.is_empty() {
        match b.u8() % 10 {
            0 => {
                let page = u64::from(b.u8()) % SPACE;
                let pages = u64::from(b.u8() % 5);
                let bits = b.u8();
                let mem = usize::from(bits >> 2) % BACKINGS;
                let off = u64::from(b.u8()) % BACKING_PAGES;
                let got = errno(d.map_backing(
                    Iova(page * P),
                    &backings[mem],
                    off * P,
                    pages * P,
                    prot(bits),
                ));
                let end = page + pages;
                let expect = if bits & 3 == 0 || pages == 0 || off + pages > BACKING_PAGES {
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
                assert_eq!(
                    got,
                    expect,
                    "map page {page} x{pages} prot {} mem {mem} off {off}",
                    bits & 3
                );
                if expect.is_none() {
                    model.maps.insert(
                        page,
                        M {
                            pages,
                            prot: bits & 3,
                            mem: Some((mem, off)),
                        },
                    );
                }
            }
            1 => {
                let page = u64::from(b.u8()) % SPACE;
                let pages = u64::from(b.u8() % 8);
                let got = d.unmap(Iova(page * P), pages * P).map_err(|e| e.errno());
                let expect = if pages == 0 {
                    Err(libc::EINVAL)
                } else {
                    match model.whole(page, pages) {
                        Err(e) => Err(e),
                        Ok(starts) if starts.iter().any(|&s| model.pinned_in(s)) => {
                            Err(libc::EBUSY)
                        }
                        Ok(starts) => Ok(starts
                            .iter()
                            .map(|s| {
                                let m = model.maps.remove(s).unwrap();
                                model.written.retain(|p| !(*s..*s + m.pages).contains(p));
                                m.pages * P
                            })
                            .sum::<u64>()),
                    }
                };
                assert_eq!(got, expect, "unmap page {page} x{pages}");
            }
            2 => {
                let page = u64::from(b.u8()) % SPACE;
                let pages = u64::from(b.u8() % 8);
                let got = d
                    .invalidate_vaddr(Iova(page * P), pages * P)
                    .map_err(|e| e.errno());
                let expect = if pages == 0 {
                    Err(libc::EINVAL)
                } else {
                    match model.whole(page, pages) {
                        Err(e) => Err(e),
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
                assert_eq!(got, expect, "invalidate page {page} x{pages}");
            }
            3 => {
                let addr = u64::from(b.u16()) * 4 % (SPACE * P);
                let len = u64::from(b.u16() % (2 * P as u16));
                let write = b.u8() & 1 != 0;
                let access = if write { Access::Write } else { Access::Read };
                let got = d
                    .translate(Iova(addr), len, access)
                    .map(|t| (t.hva.0, t.len))
                    .map_err(|e| e.errno());
                let expect = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    model
                        .walk(
                            addr,
                            1,
                            if write { 2 } else { 1 },
                            libc::EFAULT,
                            libc::EBUSY,
                        )
                        .map(|_| {
                            let (s, m) = model.at(addr / P).unwrap();
                            let n = len.min((s + m.pages) * P - addr);
                            let (mem, off) = model.host(s, addr);
                            (backings[mem].hva().0 + off as u64, n)
                        })
                };
                assert_eq!(got, expect, "translate {addr:#x}+{len:#x} write {write}");
            }
            4 => {
                let addr = u64::from(b.u16()) * 4 % (SPACE * P);
                let len = u64::from(b.u16()) % (3 * P);
                let mut buf = vec![0xa5; len as usize];
                let got = errno(d.dma_read(Iova(addr), &mut buf));
                let walk = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    model.walk(addr, len, 1, libc::EINVAL, libc::EFAULT)
                };
                assert_eq!(got, walk.as_ref().err().copied(), "read {addr:#x}+{len:#x}");
                match walk {
                    Ok(pieces) => {
                        let mut want = Vec::new();
                        for (s, from, n) in pieces {
                            let (mem, off) = model.host(s, from);
                            want.extend_from_slice(&model.bytes[mem][off..off + n as usize]);
                        }
                        assert!(buf == want, "read {addr:#x}+{len:#x} returned other bytes");
                    }
                    Err(_) => assert!(
                        buf.iter().all(|&x| x == 0xa5),
                        "a failed read changed the buffer"
                    ),
                }
            }
            5 => {
                let addr = u64::from(b.u16()) * 4 % (SPACE * P);
                let len = u64::from(b.u16()) % (3 * P);
                let byte = b.u8();
                let got = errno(d.dma_write(Iova(addr), &vec![byte; len as usize]));
                let walk = if len == 0 {
                    Err(libc::EINVAL)
                } else {
                    model.walk(addr, len, 3, libc::EINVAL, libc::EFAULT)
                };
                assert_eq!(
                    got,
                    walk.as_ref().err().copied(),
                    "write {addr:#x}+{len:#x}"
                );
                for (s, from, n) in walk.unwrap_or_default() {
                    let (mem, off) = model.host(s, from);
                    model.bytes[mem][off..off + n as usize].fill(byte);
                    if model.tracking {
                        model.written.extend(from / P..=(from + n - 1) / P);
                    }
                }
            }
            6 => {
                let n = usize::from(b.u8() % 5) + 1;
                let bits = b.u8();
                let pages: Vec<u64> = (0..n).map(|_| u64::from(b.u8()) % SPACE).collect();
                let got = d
                    .pin_pages(&pages, prot(bits))
                    .map(|h| h.iter().map(|h| h.0).collect::<Vec<_>>())
                    .map_err(|e| e.errno());
                let need = bits & 3;
                let refused = pages.iter().position(|&p| {
                    model
                        .at(p)
                        .is_none_or(|(_, m)| m.prot & need != need || m.mem.is_none())
                });
                let expect = if need == 0 {
                    Err(libc::EINVAL)
                } else if let Some(k) = refused {
                    match model.at(pages[k]) {
                        None => Err(libc::EINVAL),
                        Some((_, m)) if m.prot & need != need => Err(libc::EPERM),
                        Some(_) => Err(libc::EBUSY),
                    }
                } else {
                    Ok(pages
                        .iter()
                        .map(|&p| {
                            let (s, m) = model.at(p).unwrap();
                            let (mem, off) = m.mem.unwrap();
                            backings[mem].hva().0 + (off + p - s) * P
                        })
                        .collect())
                };
                assert_eq!(got, expect, "pin {pages:?} prot {need}");
                if expect.is_ok() {
                    for &p in &pages {
                        *model.pins.entry(p).or_default() += 1;
                    }
                    held.push(pages);
                }
            }
            7 => {
                let pages = held.pop().unwrap_or_default();
                let got = d.unpin_pages(&pages).map_err(|e| e.errno());
                let expect = if pages.is_empty() {
                    Err(libc::EINVAL)
                } else {
                    Ok(())
                };
                assert_eq!(got, expect, "unpin {pages:?}");
                for p in pages {
                    let c = model.pins.get_mut(&p).unwrap();
                    *c -= 1;
                    if *c == 0 {
                        model.pins.remove(&p);
                    }
                }
            }
            8 => {
                let on = b.u8() & 1 != 0;
                if on {
                    d.start_dirty_tracking().expect("start dirty tracking");
                } else {
                    d.stop_dirty_tracking();
                }
                if on != model.tracking {
                    model.written.clear();
                }
                model.tracking = on;
            }
            _ => {
                let got = d
                    .get_and_clear_dirty(Iova(0), SPACE * P, P)
                    .map_err(|e| e.errno());
                if !model.tracking {
                    assert_eq!(got, Err(libc::EINVAL), "dirty bits while not tracking");
                } else {
                    let words = got.expect("dirty bits of the whole space");
                    let bit = |p: u64| words[(p / 64) as usize] & 1 << (p % 64) != 0;
                    for &p in &model.written {
                        assert!(bit(p), "page {p} was written but is not reported dirty");
                    }
                    for p in 0..SPACE {
                        assert!(
                            !bit(p) || model.at(p).is_some(),
                            "unmapped page {p} reported dirty"
                        );
                    }
                    model.written.clear();
                }
            }
        }
        assert_eq!(
            registry.locked_bytes(),
            model.locked() as u64 * P,
            "locked bytes"
        );
        assert_eq!(
            d.device_pinned_pages(),
            model.pins.len() as u64,
            "device pinned pages"
        );
        assert_eq!(d.len(), model.maps.len(), "mappings");
    }
    drop(d);
    assert_eq!(registry.locked_bytes(), 0, "locked after the space went");
    for (i, bk) in backings.iter().enumerate() {
        let mut all = vec![0; (BACKING_PAGES * P) as usize];
        bk.read(0, &mut all).unwrap();
        assert!(all == model.bytes[i], "backing {i} differs from the model");
    }
    memvisor_fuzz::check_leaks();
});
