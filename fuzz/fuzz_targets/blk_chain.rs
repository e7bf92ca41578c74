//! virtio-blk's request parser over a fuzzed descriptor table: the input is a control byte
//! (features, start index), then the descriptor table and avail ring of a 16-entry queue in a
//! 64 KiB guest memory, then the bytes of that memory's data area (headers, buffers). One
//! process pass of the blk device over a 64 KiB memfd image follows, then the end of every
//! transfer it handed to the kernel. Whatever the chains say,
//! the device answers on the ring or returns an error for a broken queue; it never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memvisor_fuzz::{Bytes, RingMemory, memfd};
use memvisor_vhost::{Blk, BlkOptions, Device};

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let control = b.u8();
    let read_only = control & 1 != 0;
    let event_idx = control & 2 != 0;
    let base = u16::from(control >> 4);
    let ring = RingMemory::new(&mut b);
    let mut blk = Blk::new(
        memfd(64 << 10),
        BlkOptions {
            read_only,
            ..BlkOptions::default()
        },
    )
    .expect("blk device");
    blk.set_features(blk.features()).expect("features");
    let mut queue = memvisor_vhost::Ring::plain(ring.queue(base, event_idx));
    let _ = blk.process(0, &mut queue, &ring.memory);
    // Transfers handed to the kernel end here, as the back end ends them before any message:
    // unpinned, their status written, their chains returned.
    // The chains they end go back on the ring, as the back end's ring service puts them.
    if let Ok(used) = blk.complete(&ring.memory, true) {
        let mem = ring.memory.dma().memory();
        for u in used {
            let _ = queue.add_used(&mem, u.head, u.len);
        }
    }
    drop(blk);
    drop(ring);
    memvisor_fuzz::check_leaks();
});
