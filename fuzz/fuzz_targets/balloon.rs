//! The balloon's chains: the input is a control byte (which queue, features, start index), then
//! the descriptor table and avail ring of a 16-entry queue in a 64 KiB guest memory, then the
//! data area (page-frame-number arrays for inflate and deflate, buffers for free page reports).
//! One process pass of the balloon device on that queue follows; bad chains are refused on the
//! ring or as a broken queue, and the memory the model discards is only the guest's.
#![no_main]

use libfuzzer_sys::fuzz_target;
use memvisor_fuzz::{Bytes, RingMemory};
use memvisor_vhost::{BalloonDevice, BalloonTarget, Device};

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let control = b.u8();
    let index = u16::from(control % 3);
    let reporting = control & 4 == 0;
    let event_idx = control & 8 != 0;
    let base = u16::from(control >> 4);
    let ring = RingMemory::new(&mut b);
    let mut device = BalloonDevice::new(BalloonTarget::default());
    if !reporting {
        device = device.without_reporting();
    }
    device.attach(&ring.memory).expect("attach");
    let mut features = device.features();
    if !event_idx {
        features &= !(1 << 29);
    }
    // The model refuses no feature set it offered; a refusal is a bug.
    device
        .set_features(features)
        .expect("the balloon's own features");
    let mut queue = memvisor_vhost::Ring::plain(ring.queue(base, event_idx));
    let _ = device.process(index, &mut queue, &ring.memory);
    drop(device);
    drop(ring);
    memvisor_fuzz::check_leaks();
});
