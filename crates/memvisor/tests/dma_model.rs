//! Model-based test of DmaSpace: random sequences of map / unmap / unmap_all / invalidate /
//! update / translate (space and a long-lived cursor) / dma_read / dma_write / pin_pages /
//! unpin_pages / pin mode switches / dirty tracking, with page numbers up to `u64::MAX`, run on a
//! space and on the reference model in `dma_reference/` (shared with the `dma_ops` fuzz target).
//! This file only chooses the operations. After every step the space's answers must be the
//! model's, and the memory locked must be exactly the host pages the model says are pinned —
//! by the registry's account and by the kernel's `VmLck`, so this binary holds this one test.
//! 2000 sequences of 50-60 operations by default (at least 100 000 operations), each run on two
//! spaces: one that always keeps its page table and one whose page table starts and stops;
//! `MEMVISOR_MODEL_CASES=N` runs N sequences (CI runs a bounded number, a long local run more).
//! A divergence fails with proptest's shrunk sequence.

use dma_reference::{BACKING_PAGES, BACKINGS, Harness, Op, P, SPACE};
use proptest::prelude::*;

mod common;
mod dma_reference;

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

/// Runs `ops` on a space that keeps its page table from `table_from` small mappings on.
fn run(ops: Vec<Op>, table_from: u32) -> Result<(), TestCaseError> {
    let base = common::vm_lck();
    let mut h = Harness::new(table_from);
    for op in &ops {
        h.step(op).map_err(TestCaseError::fail)?;
        // The kernel holds what is pinned plus the lock cache, and nothing else.
        prop_assert_eq!(
            common::vm_lck() - base,
            h.model_locked_bytes() + h.registry().cached_bytes(),
            "VmLck after {:?}",
            op
        );
    }
    h.finish().map_err(TestCaseError::fail)?;
    prop_assert_eq!(common::vm_lck(), base, "VmLck after the space was dropped");
    Ok(())
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
