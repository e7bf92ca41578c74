//! Discard gates ([`DiscardGate`]): an engine pinning guest memory on its own (io_uring fixed
//! buffers) is asked to give each chunk up before it is discarded; what it names as busy, and
//! what it still reports pinned while the registry is locked, keeps its bytes; the rest of the
//! report is discarded; and each chunk asked is reopened after.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use memvisor::{
    Backing, BackingKind, DiscardGate, DiscardOptions, Discarder, Gpa, LockLimit, PinRegistry,
    SlotSpec, SlotTable,
};

const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;
const BASE: u64 = 1 << 30;

/// A gate that calls fixed byte runs busy and pinned, and records what it was asked.
struct Fake {
    busy: Vec<(u64, u64)>,
    pinned: Vec<(u64, u64)>,
    asked: Mutex<Vec<(char, u64, u64)>>,
}

impl DiscardGate for Fake {
    fn evict(&self, hva: u64, len: u64, wait: Duration) -> Vec<(u64, u64)> {
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs(1));
        self.asked.lock().unwrap().push(('e', hva, len));
        self.busy
            .iter()
            .copied()
            .filter(|&(s, n)| s < hva + len && s + n > hva)
            .collect()
    }
    fn pinned_runs(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        self.pinned
            .iter()
            .copied()
            .filter(|&(s, n)| s < end && s + n > start)
            .collect()
    }
    fn reopen(&self, hva: u64, len: u64) {
        self.asked.lock().unwrap().push(('r', hva, len));
    }
}

#[test]
fn busy_and_still_pinned_runs_keep_their_bytes_and_every_chunk_is_asked_then_reopened() {
    let b = Arc::new(Backing::new(BackingKind::Memfd, 8 * MIB).unwrap());
    for p in 0..b.size() / PAGE {
        b.write(p * PAGE, &[0x5a; PAGE as usize]).unwrap();
    }
    let t = SlotTable::new();
    t.insert(SlotSpec::new(0, Gpa(BASE), b.clone())).unwrap();
    let registry = PinRegistry::new(LockLimit::Unlimited);
    let h = b.hva().0;
    // Busy: 2 pages in chunk 1 (one of them straddling into the next page by a byte); pinned:
    // 3 pages in chunk 3.
    let gate = Arc::new(Fake {
        busy: vec![(h + 2 * MIB + 5 * PAGE, PAGE + 1)],
        pinned: vec![(h + 6 * MIB, 3 * PAGE)],
        asked: Mutex::new(Vec::new()),
    });
    let weak: std::sync::Weak<dyn DiscardGate> = Arc::downgrade(&gate) as _;
    registry.register_gate(weak);
    let d = Discarder::with_options(
        &t,
        DiscardOptions {
            registry: Some(registry),
            ..DiscardOptions::default()
        },
    );
    let out = d.report(&[(Gpa(BASE), 8 * MIB)]);
    assert_eq!(out.skipped_pinned, 5 * PAGE, "{out:?}");
    assert_eq!(out.discarded, 8 * MIB - 5 * PAGE);
    let kept = |p: u64| (517..519).contains(&p) || (1536..1539).contains(&p);
    for p in 0..b.size() / PAGE {
        let mut buf = [0u8; PAGE as usize];
        b.read(p * PAGE, &mut buf).unwrap();
        let want = if kept(p) { 0x5a } else { 0 };
        assert!(buf.iter().all(|&x| x == want), "page {p}: want {want:#x}");
    }
    // Each 2 MiB chunk evicted, then reopened, in order.
    let asked = gate.asked.lock().unwrap().clone();
    let want: Vec<(char, u64, u64)> = (0..4)
        .flat_map(|c| {
            [
                ('e', h + c * 2 * MIB, 2 * MIB),
                ('r', h + c * 2 * MIB, 2 * MIB),
            ]
        })
        .collect();
    assert_eq!(asked, want);
}
