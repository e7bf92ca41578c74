//! Readers (cursors, cross-slot copies) during a storm of slot replacements and removals.
//!
//! Every region of guest memory is repeatedly replaced by a fresh backing — so old backings are
//! really unmapped once no snapshot holds them — or removed for a while. Each backing is filled
//! with one byte that names its region and version. A reader that touched unmapped memory would
//! crash the test; a reader answering from a mix of snapshots would see a byte naming the wrong
//! region or two versions inside one slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use memvisor::{Backing, BackingKind, Gpa, SlotSpec, SlotTable};

const REGIONS: u64 = 8;
const REGION: u64 = 64 * 1024;
const ROUNDS: u64 = 3000;

fn tag(region: u64, version: u64) -> u8 {
    ((region << 4) | (version & 0xf)) as u8
}

fn filled(region: u64, version: u64) -> Arc<Backing> {
    let b = Backing::new(BackingKind::PrivateAnon, REGION).unwrap();
    b.write(0, &vec![tag(region, version); REGION as usize])
        .unwrap();
    Arc::new(b)
}

/// Checks bytes read from `gpa`: each byte names the region it lies in, and one region's bytes
/// all come from one version.
fn check(gpa: u64, bytes: &[u8]) {
    let mut version_of = [None::<u8>; REGIONS as usize];
    for (i, &b) in bytes.iter().enumerate() {
        let region = (gpa + i as u64) / REGION;
        assert_eq!(
            u64::from(b >> 4),
            region,
            "byte {i} from {gpa:#x} names another region"
        );
        let seen = version_of[region as usize].get_or_insert(b & 0xf);
        assert_eq!(
            *seen,
            b & 0xf,
            "two versions of region {region} in one read"
        );
    }
}

#[test]
fn readers_survive_a_storm_of_slot_changes() {
    let table = SlotTable::new();
    for r in 0..REGIONS {
        table
            .insert(SlotSpec::new(r as u32, Gpa(r * REGION), filled(r, 0)))
            .unwrap();
    }
    let done = Arc::new(AtomicBool::new(false));
    let reads = Arc::new(AtomicU64::new(0));
    let faults = Arc::new(AtomicU64::new(0));

    let mut readers = Vec::new();
    for id in 0..3u64 {
        let (table, done, reads, faults) =
            (table.clone(), done.clone(), reads.clone(), faults.clone());
        readers.push(thread::spawn(move || {
            let mut cursor = table.cursor();
            let mut buf = vec![0u8; 3 * REGION as usize / 2];
            let mut x = id * 7919 + 1;
            while !done.load(Ordering::Relaxed) {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let gpa = (x >> 20) % (REGIONS * REGION);
                // a lookup names the slot of its region, with the right extent
                if let Some(tr) = cursor.lookup(Gpa(gpa)) {
                    assert_eq!(u64::from(tr.slot), gpa / REGION);
                    assert_eq!(tr.len, REGION - gpa % REGION);
                }
                // a read through the cursor, possibly crossing into the next region
                let len = ((x >> 8) as usize % buf.len()).max(1);
                let len = len.min((REGIONS * REGION - gpa) as usize);
                let r = if x & 1 == 0 {
                    cursor.read(Gpa(gpa), &mut buf[..len])
                } else {
                    table.read(Gpa(gpa), &mut buf[..len])
                };
                match r {
                    Ok(()) => {
                        check(gpa, &buf[..len]);
                        reads.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        assert_eq!(e.errno(), libc::EFAULT, "{e}");
                        faults.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }

    let mut version = vec![0u64; REGIONS as usize];
    let mut changes = 0;
    let mut round = 0;
    // At least ROUNDS changes, and on until the readers have done real work.
    while round < ROUNDS || reads.load(Ordering::Relaxed) < 2000 {
        round += 1;
        let r = round * 2654435761 % REGIONS;
        let id = r as u32;
        if round % 5 == 0 {
            // leave a hole for a while
            table.remove(id).unwrap();
            changes += 1;
            thread::yield_now();
        }
        version[r as usize] += 1;
        let fresh = filled(r, version[r as usize]);
        table
            .update(|edit| {
                // ENOENT when the slot was removed above; the insert is what matters
                let _ = edit.remove(id);
                edit.insert(SlotSpec::new(id, Gpa(r * REGION), fresh))
            })
            .unwrap();
        changes += 1;
    }
    done.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    let (reads, faults) = (
        reads.load(Ordering::Relaxed),
        faults.load(Ordering::Relaxed),
    );
    println!("{reads} reads, {faults} faults during {changes} slot changes");
    assert!(faults > 0, "some reads met a hole, so holes were exercised");
    assert_eq!(table.snapshot().generation(), REGIONS + changes);
}
