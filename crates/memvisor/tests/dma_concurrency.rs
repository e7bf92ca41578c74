//! Translators, dma_read and dma_write running while another thread maps and unmaps.
//!
//! Each IOVA region is repeatedly unmapped and mapped again onto a fresh backing that only the
//! mapping holds, so an unmap really unmaps host memory once no snapshot needs it. Backings are
//! filled with a byte naming their region and version; the writer thread writes bytes naming the
//! region with version 0xf. A copy touching unmapped memory would crash the test; a read mixing
//! two versions of one region, or bytes of another region, fails it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use memvisor::{Backing, BackingKind, DmaSpace, Iova, Prot};

const REGIONS: u64 = 6;
const REGION: u64 = 16 * 4096;
const ROUNDS: u64 = 3000;
const WRITTEN: u8 = 0xf;

fn tag(region: u64, version: u64) -> u8 {
    ((region << 4) | (version % 15)) as u8
}

fn remap(d: &DmaSpace, region: u64, version: u64) {
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, REGION).unwrap());
    b.write(0, &vec![tag(region, version); REGION as usize])
        .unwrap();
    d.map_backing(Iova(region * REGION), &b, 0, REGION, Prot::RW)
        .unwrap();
    // `b` drops here: the mapping is now the only owner.
}

fn check(iova: u64, bytes: &[u8]) {
    let mut version = [None::<u8>; REGIONS as usize];
    for (i, &b) in bytes.iter().enumerate() {
        let region = (iova + i as u64) / REGION;
        assert_eq!(
            u64::from(b >> 4),
            region,
            "byte {i} from {iova:#x} names another region"
        );
        if b & 0xf != WRITTEN {
            let seen = version[region as usize].get_or_insert(b & 0xf);
            assert_eq!(
                *seen,
                b & 0xf,
                "two versions of region {region} in one read"
            );
        }
    }
}

#[test]
fn readers_and_writers_survive_concurrent_map_and_unmap() {
    let d = DmaSpace::default();
    for r in 0..REGIONS {
        remap(&d, r, 0);
    }
    let done = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    for id in 0..2u64 {
        let (d, done, reads) = (d.clone(), done.clone(), reads.clone());
        threads.push(thread::spawn(move || {
            let mut cursor = d.cursor();
            let mut buf = vec![0u8; 2 * REGION as usize];
            let mut x = id * 7919 + 3;
            while !done.load(Ordering::Relaxed) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let iova = (x >> 20) % (REGIONS * REGION);
                match cursor.translate(Iova(iova), 1 << 20, Prot::READ) {
                    Ok(t) => assert_eq!(t.len, REGION - iova % REGION),
                    Err(e) => assert_eq!(e.errno(), libc::EFAULT, "{e}"),
                }
                let len =
                    ((x >> 8) as usize % buf.len()).clamp(1, (REGIONS * REGION - iova) as usize);
                match d.dma_read(Iova(iova), &mut buf[..len]) {
                    Ok(()) => {
                        check(iova, &buf[..len]);
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => assert_eq!(e.errno(), libc::EINVAL, "{e}"),
                }
            }
        }));
    }
    {
        let (d, done) = (d.clone(), done.clone());
        threads.push(thread::spawn(move || {
            let mut x = 99u64;
            while !done.load(Ordering::Relaxed) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let region = (x >> 33) % REGIONS;
                let off = (x >> 7) % REGION;
                let len = ((x >> 40) % 512 + 1).min(REGION - off);
                let bytes = vec![((region << 4) as u8) | WRITTEN; len as usize];
                if let Err(e) = d.dma_write(Iova(region * REGION + off), &bytes) {
                    assert_eq!(e.errno(), libc::EINVAL, "{e}");
                }
            }
        }));
    }
    let mut version = vec![0u64; REGIONS as usize];
    let mut round = 0;
    while round < ROUNDS || reads.load(Ordering::Relaxed) < 2000 {
        round += 1;
        let r = round * 2654435761 % REGIONS;
        assert_eq!(d.unmap(Iova(r * REGION), REGION).unwrap(), REGION);
        if round % 4 == 0 {
            thread::yield_now(); // leave a hole for a moment
        }
        version[r as usize] += 1;
        remap(&d, r, version[r as usize]);
    }
    done.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    println!(
        "{} checked reads during {round} remaps",
        reads.load(Ordering::Relaxed)
    );
    assert_eq!(d.len(), REGIONS as usize);
}

/// A plain copy on its thread's shortcut (inside the mapping it last hit) holds no snapshot;
/// instead a change waits for such copies before it returns. So once `unmap` returns, no copy
/// that raced it is still writing the memory given back: a byte written there afterwards stays.
/// A copy runs forwards, so the last page is the last it writes; each round unmaps while a
/// 16 MiB copy is (almost surely) in flight and then writes that page.
#[test]
fn unmap_returns_only_after_plain_copies_on_the_old_mapping_end() {
    const SIZE: u64 = 16 << 20;
    const PAGE: usize = 4096;
    let b = Arc::new(Backing::new(BackingKind::PrivateAnon, SIZE).unwrap());
    b.populate().unwrap();
    let d = DmaSpace::default();
    for round in 0..8 {
        d.map_backing(Iova(0), &b, 0, SIZE, Prot::RW).unwrap();
        let copies = Arc::new(AtomicU64::new(0));
        let writer = {
            let (d, copies) = (d.clone(), copies.clone());
            thread::spawn(move || {
                let bytes = vec![0xaa; SIZE as usize];
                loop {
                    match d.dma_write(Iova(0), &bytes) {
                        Ok(()) => copies.fetch_add(1, Ordering::Relaxed),
                        Err(e) => return assert_eq!(e.errno(), libc::EINVAL, "{e}"),
                    };
                }
            })
        };
        // The first copy looks the mapping up; those after it take the shortcut.
        while copies.load(Ordering::Relaxed) < 2 {
            thread::yield_now();
        }
        assert_eq!(d.unmap(Iova(0), SIZE).unwrap(), SIZE);
        b.write(SIZE - PAGE as u64, &[0x55; PAGE]).unwrap();
        writer.join().unwrap();
        let mut last = [0u8; PAGE];
        b.read(SIZE - PAGE as u64, &mut last).unwrap();
        assert!(
            last.iter().all(|&x| x == 0x55),
            "round {round}: a copy wrote memory after the unmap returned"
        );
    }
}
