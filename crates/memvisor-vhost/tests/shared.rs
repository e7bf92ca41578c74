//! One process, many devices: a block device and a balloon serving the same VMM receive the
//! guest's memory separately, yet map it once — so a page the block device pinned for I/O in
//! flight is skipped by the balloon's discard, and keeps its bytes.

mod common;

use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;

use common::*;
use memvisor::{Discarder, Gpa, Prot};
use memvisor_vhost::FrontendMemory;
use memvisor_vhost::proto::Region;

const SIZE: u64 = 8 * MIB;

fn received(f: &std::fs::File) -> FrontendMemory {
    let mut m = FrontendMemory::new(&memvisor_vhost::ProcessState::new(
        memvisor::SharedMappings::global(),
        memvisor::PinRegistry::global(),
    ))
    .unwrap();
    let r = Region {
        gpa: 0,
        size: SIZE,
        user_addr: USER,
        mmap_offset: 0,
    };
    m.set_table(&[r], vec![OwnedFd::from(f.try_clone().unwrap())])
        .unwrap();
    m
}

#[test]
fn a_page_the_block_device_pinned_is_not_discarded_by_the_balloon() {
    let f = memfd_named(SIZE, c"shared-devices");
    f.write_all_at(&vec![0x77; SIZE as usize], 0).unwrap();
    let blk = received(&f);
    let balloon = received(&f);
    let hva = |m: &FrontendMemory| m.slots().snapshot().slots().next().unwrap().hva();
    assert_eq!(hva(&blk), hva(&balloon), "two mappings of one guest memory");
    assert_eq!(mappings_of("shared-devices"), 1);

    // I/O in flight on pages 100..104 (the block device pins them for its preadv).
    let pinned: Vec<u64> = (100..104).collect();
    blk.dma().pin_pages(&pinned, Prot::WRITE).unwrap();
    // The guest (wrongly, or racing) reports all of its memory free.
    let out = Discarder::new(balloon.slots()).report(&[(Gpa(0), SIZE)]);
    assert_eq!(out.skipped_pinned, 4 * 4096, "{out:?}");
    assert_eq!(out.discarded, SIZE - 4 * 4096);
    let mut page = vec![0u8; 4096];
    for p in 0..SIZE / 4096 {
        f.read_exact_at(&mut page, p * 4096).unwrap();
        let want = if pinned.contains(&p) { 0x77 } else { 0 };
        assert!(page.iter().all(|&b| b == want), "page {p}");
    }
    blk.dma().unpin_pages(&pinned).unwrap();
}
