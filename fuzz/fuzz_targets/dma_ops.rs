//! `DmaSpace` operation sequences against the reference model, the fuzzing twin of the proptest
//! model test. Both run their operations through the same `Harness` and model
//! (crates/memvisor/tests/dma_reference/mod.rs, included here by path), so the two can never
//! disagree about what the space must answer; this file only turns bytes into operations. Each
//! operation is one byte choosing it and a few argument bytes; page numbers reach the edges of
//! 64 bits now and then. A divergence panics with the operation, so libFuzzer keeps the input.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memvisor_fuzz::Bytes;

#[path = "../../crates/memvisor/tests/dma_reference/mod.rs"]
mod dma_reference;

use dma_reference::{BACKING_PAGES, BACKINGS, Harness, Op, P, SPACE};

/// An IOVA page for pin_pages: mostly inside the space, sometimes at the edges of 64 bits.
fn pin_page(b: &mut Bytes) -> u64 {
    match b.u8() {
        0..=239 => u64::from(b.u8()) % SPACE,
        240..=243 => u64::MAX,
        244..=247 => u64::MAX / P,
        248..=251 => u64::MAX / P + 1,
        _ => b.u64(),
    }
}

fn pin_list(b: &mut Bytes) -> Vec<u64> {
    match b.u8() % 16 {
        // runs of consecutive pages, as devices pin them
        0..=3 => {
            let s = u64::from(b.u8()) % SPACE;
            let n = u64::from(b.u8() % 5) + 1;
            (s..s + n).collect()
        }
        4 => vec![0; 513],
        _ => (0..b.u8() % 5).map(|_| pin_page(b)).collect(),
    }
}

fn op(b: &mut Bytes) -> Op {
    let page = |b: &mut Bytes| u64::from(b.u8()) % SPACE;
    let addr = |b: &mut Bytes| u64::from(b.u16()) * 4 % (SPACE * P);
    match b.u8() % 16 {
        0 | 1 => Op::Map {
            page: page(b),
            pages: u64::from(b.u8() % 5),
            prot: b.u8() % 4,
            mem: usize::from(b.u8()) % BACKINGS,
            off: u64::from(b.u8()) % BACKING_PAGES,
        },
        2 => Op::Unmap {
            page: page(b),
            pages: u64::from(b.u8() % 8),
        },
        3 => Op::UnmapAll,
        4 => Op::Invalidate {
            page: page(b),
            pages: u64::from(b.u8() % 8),
        },
        5 => Op::Update {
            page: page(b),
            pages: u64::from(b.u8() % 5) + 1,
            mem: usize::from(b.u8()) % BACKINGS,
            off: u64::from(b.u8()) % BACKING_PAGES,
        },
        6 => Op::Translate {
            addr: addr(b),
            len: u64::from(b.u16()) % (2 * P),
            write: b.u8() & 1 != 0,
        },
        7 => Op::Read {
            addr: addr(b),
            len: u64::from(b.u16()) % (3 * P),
        },
        8 => Op::Write {
            addr: addr(b),
            len: u64::from(b.u16()) % (3 * P),
            byte: b.u8(),
        },
        9 => Op::Track(b.u8() & 1 != 0),
        10 => match b.u8() % 4 {
            // the whole space: cuts no mapping
            0 | 1 => Op::GetDirty {
                page: 0,
                pages: SPACE,
            },
            _ => Op::GetDirty {
                page: page(b),
                pages: u64::from(b.u8() % 8),
            },
        },
        11 | 12 => Op::Pin {
            pages: pin_list(b),
            prot: b.u8() % 4,
        },
        13 => Op::Unpin { pages: pin_list(b) },
        14 => Op::UnpinLatest,
        _ => Op::Eager(b.u8() & 1 != 0),
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    // The first byte chooses whether the space keeps its page table from the start or lets it
    // start at 4 small mappings and stop again.
    let table_from = if b.u8() & 1 == 0 { 0 } else { 4 };
    let mut h = Harness::new(table_from);
    while !b.is_empty() {
        let op = op(&mut b);
        if let Err(e) = h.step(&op) {
            panic!("{e}");
        }
    }
    if let Err(e) = h.finish() {
        panic!("{e}");
    }
    memvisor_fuzz::check_leaks();
});
