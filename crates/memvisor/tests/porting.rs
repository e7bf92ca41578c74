//! The porting example's two halves (examples/porting_vm_memory.rs on vm-memory's
//! `GuestMemoryMmap`, examples/porting_memvisor.rs on memvisor's adapter over the same kind of
//! `GuestMemoryMmap`, adopted) run the same device model through the same steps, hotplug
//! included, and must compute the same results.
#![cfg(feature = "vm-memory-mmap")]

#[path = "../examples/porting_vm_memory.rs"]
mod before;

#[path = "../examples/porting_memvisor.rs"]
mod after;

#[test]
fn the_ported_device_computes_what_the_original_did() {
    let original = before::run().unwrap();
    let ported = after::run().unwrap();
    assert_eq!(ported, original);

    // And what they computed is right, not merely equal: fills report their length, sums the
    // Fletcher-32 of what was filled, and requests over memory that is not (or no longer)
    // there fail.
    let sum = |byte: u8, len: usize| {
        let (a, b) = before::fletcher((0, 0), &vec![byte; len]);
        b << 16 | a
    };
    let expected = vec![
        0x2345,
        sum(0xa5, 0x2345),
        before::FAILED,
        3 * 4096,
        sum(0x5a, 3 * 4096),
        before::FAILED,
        before::FAILED,
        sum(0xa5, 0x2345),
    ];
    assert_eq!(original, expected);
}

#[test]
fn both_examples_run() {
    before::main().unwrap();
    after::main().unwrap();
}
