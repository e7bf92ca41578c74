//! The virtio-rng example (examples/rng.rs) served to the test frontend: what it writes into
//! the guest's buffers, what it leaves alone, and a chain it cannot fill.

mod common;
// The example itself, not a copy; its `main` goes unused here.
#[allow(dead_code)]
#[path = "../examples/rng.rs"]
mod rng;

use common::*;
use memvisor::Gpa;

const SIZE: u64 = MIB;
const BUF: u64 = 0x10000;

fn read(g: &Guest, at: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    g.mem.read(Gpa(at), &mut b).unwrap();
    b
}

fn distinct(b: &[u8]) -> usize {
    let mut seen = [false; 256];
    b.iter().for_each(|&x| seen[usize::from(x)] = true);
    seen.iter().filter(|&&s| s).count()
}

#[test]
fn the_example_rng_fills_the_writable_buffers_with_random_bytes() {
    let mut g = Guest::new(SIZE);
    // A driver-readable buffer the device must not touch, between two writable ones.
    g.mem.write(Gpa(BUF + 0x2000), &[0x5a; 512]).unwrap();
    let (c, t) = common::serve(rng::Rng::default());
    setup(&c, &g);

    let bufs = [
        (BUF, 4096, true),
        (BUF + 0x2000, 512, false),
        (BUF + 0x4000, 100, true),
    ];
    let head = g.post(&bufs);
    assert_eq!(g.wait_used(), (head, 4096 + 100));
    let first = read(&g, BUF, 4096);
    // 4096 random bytes take nearly every byte value (256 * (1 - e^-16)); zeros take one.
    assert!(distinct(&first) >= 250, "{} byte values", distinct(&first));
    assert!(read(&g, BUF + 0x4000, 100).iter().any(|&b| b != 0));
    assert!(
        read(&g, BUF + 0x4000 + 100, 100).iter().all(|&b| b == 0),
        "past the buffer"
    );
    assert!(
        read(&g, BUF + 0x2000, 512).iter().all(|&b| b == 0x5a),
        "read-only buffer"
    );

    // Again: new bytes, not the same ones.
    let head = g.post(&[(BUF, 4096, true)]);
    assert_eq!(g.wait_used(), (head, 4096));
    assert_ne!(read(&g, BUF, 4096), first);

    drop(c);
    let (backend, _) = t.join().unwrap();
    assert_eq!(backend.device().bytes, 4096 + 100 + 4096);
}

#[test]
fn a_buffer_outside_guest_memory_comes_back_empty_and_the_device_goes_on() {
    let mut g = Guest::new(SIZE);
    let (c, t) = common::serve(rng::Rng::default());
    setup(&c, &g);

    let head = g.post(&[(SIZE + 0x1000, 64, true)]);
    assert_eq!(g.wait_used(), (head, 0));
    let head = g.post(&[(BUF, 64, true)]);
    assert_eq!(g.wait_used(), (head, 64));
    assert!(read(&g, BUF, 64).iter().any(|&b| b != 0));

    drop(c);
    let (backend, served) = t.join().unwrap();
    assert_eq!(backend.device().bytes, 64);
    assert!(served.is_ok() || matches!(served, Err(memvisor_vhost::Error::Wire(_))));
}
