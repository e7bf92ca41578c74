//! Memslot churn on a real KVM guest: slots inserted, removed, flagged read-only or logging,
//! moved and resized (a batch that re-creates them) while a vCPU thread keeps entering and
//! leaving the guest. After every change KVM's view must match the table's:
//! - the guest touches every candidate place: a write to no slot or a read-only one is an MMIO
//!   write exit, a read of no slot an MMIO read exit, a write to a writable slot lands in the
//!   table's memory; the vCPU's cursor, asked on the exit path, agrees;
//! - `KVM_GET_DIRTY_LOG` succeeds for exactly the KVM slot numbers of the table's logging slots
//!   and fails with ENOENT for every other number in use so far (removed slots included).
//!
//! Also: KVM's refusal of a memslot comes back typed, with its errno and the refused region.
//! Skips (printing "skipped: ... no /dev/kvm") without /dev/kvm.

mod common;

use std::sync::mpsc;
use std::thread;

use common::*;
use memvisor::{Gpa, SlotFlags, SlotId, SlotSpec};
use memvisor_kvm::{Error, Options};

/// Candidate places: 8 of 64 KiB from 0x20000; slot `i` (1..=8) lives in place `i - 1` or, moved,
/// in another free one.
const PLACES: u64 = 8;
const PLACE: u64 = 0x10000;
fn place(p: u64) -> u64 {
    0x20000 + p * PLACE
}

/// Probe requests to the vCPU thread; between requests it keeps probing slot 0 (code slot), so
/// the vCPU is in and out of KVM_RUN while the table changes.
enum Request {
    Probe(Vec<u16>, mpsc::Sender<Vec<Probe>>),
    Done(mpsc::Sender<u64>),
}

struct Xorshift(u64);
impl Xorshift {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn kvm_view_matches_the_table_after_every_change() {
    let Some(kvm) = kvm_or_skip("memslot churn") else {
        return;
    };
    let g = guest(&kvm, Options::default(), PLACES * PLACE);
    let Guest {
        vm,
        slots,
        mut vcpu,
        memory,
    } = g;
    let (tx, rx) = mpsc::channel::<Request>();
    let vcpu_thread = thread::spawn(move || {
        let mut spins = 0u64;
        loop {
            match rx.try_recv() {
                Ok(Request::Probe(segments, reply)) => {
                    let out = segments.iter().map(|&s| probe(&mut vcpu, s)).collect();
                    reply.send(out).unwrap();
                }
                Ok(Request::Done(reply)) => {
                    reply.send(spins).unwrap();
                    return;
                }
                Err(_) => {
                    // Keep running the guest: a probe of code-slot memory at 0x8000.
                    let p = probe(&mut vcpu, 0x800);
                    assert_eq!((p.write_exit, p.read_exit), (None, None));
                    spins += 1;
                }
            }
        }
    });
    let probe_all = |segments: Vec<u16>| {
        let (reply, answer) = mpsc::channel();
        tx.send(Request::Probe(segments, reply)).unwrap();
        answer.recv().unwrap()
    };

    // Where each slot is (place, pages) in the table as the test built it.
    let mut model: [Option<(u64, u64, SlotFlags)>; 9] = [None; 9];
    let mut rng = Xorshift(0x2545_f491_4f6c_dd1d);
    let mut max_kvm_slot = 0u32;
    let flag_choices = [
        SlotFlags::NONE,
        SlotFlags::READ_ONLY,
        SlotFlags::LOG_DIRTY,
        SlotFlags::LOG_DIRTY | SlotFlags::READ_ONLY,
    ];
    let mut changes = [0u32; 5];
    for step in 0..160 {
        let id = 1 + rng.next(8) as SlotId;
        let free_place = |model: &[Option<(u64, u64, SlotFlags)>; 9], rng: &mut Xorshift| {
            let free: Vec<u64> = (0..PLACES)
                .filter(|p| !model.iter().flatten().any(|(q, _, _)| q == p))
                .collect();
            (!free.is_empty()).then(|| free[rng.next(free.len() as u64) as usize])
        };
        let what = match model[id as usize] {
            None => {
                let Some(p) = free_place(&model, &mut rng) else {
                    continue;
                };
                let pages = [16, 8, 1][rng.next(3) as usize];
                let flags = flag_choices[rng.next(4) as usize];
                slots
                    .insert(
                        SlotSpec::new(id, Gpa(place(p)), memory.clone())
                            .window(p * PLACE, pages * 4096)
                            .flags(flags),
                    )
                    .unwrap();
                model[id as usize] = Some((p, pages, flags));
                changes[0] += 1;
                format!("insert slot {id} at place {p}, {pages} pages, {flags:?}")
            }
            Some((p, pages, _)) => match rng.next(4) {
                0 => {
                    slots.remove(id).unwrap();
                    model[id as usize] = None;
                    changes[1] += 1;
                    format!("remove slot {id}")
                }
                1 => {
                    let flags = flag_choices[rng.next(4) as usize];
                    slots.set_flags(id, flags).unwrap();
                    model[id as usize] = Some((p, pages, flags));
                    changes[2] += 1;
                    format!("slot {id} flags {flags:?}")
                }
                2 => {
                    // Move: one batch removes and re-inserts the id elsewhere.
                    let Some(q) = free_place(&model, &mut rng) else {
                        continue;
                    };
                    let flags = model[id as usize].unwrap().2;
                    slots
                        .update(|e| {
                            e.remove(id)?;
                            e.insert(
                                SlotSpec::new(id, Gpa(place(q)), memory.clone())
                                    .window(q * PLACE, pages * 4096)
                                    .flags(flags),
                            )
                        })
                        .unwrap();
                    model[id as usize] = Some((q, pages, flags));
                    changes[3] += 1;
                    format!("move slot {id} to place {q}")
                }
                _ => {
                    // Resize in place: KVM cannot, the binding deletes and re-creates.
                    let new_pages = if pages == 16 { 4 } else { 16 };
                    let flags = model[id as usize].unwrap().2;
                    slots
                        .update(|e| {
                            e.remove(id)?;
                            e.insert(
                                SlotSpec::new(id, Gpa(place(p)), memory.clone())
                                    .window(p * PLACE, new_pages * 4096)
                                    .flags(flags),
                            )
                        })
                        .unwrap();
                    model[id as usize] = Some((p, new_pages, flags));
                    changes[4] += 1;
                    format!("resize slot {id} to {new_pages} pages")
                }
            },
        };

        // The guest's view: the first and the last page of every place, and the page after
        // a slot's end when it is shorter than its place.
        let mut gpas = Vec::new();
        for p in 0..PLACES {
            gpas.extend([
                place(p),
                place(p) + PLACE - 4096,
                place(p) + 4 * 4096,
                place(p) + 4096,
            ]);
        }
        let answers = probe_all(gpas.iter().map(|&a| segment(a)).collect());
        for (&gpa, got) in gpas.iter().zip(&answers) {
            let holder = model.iter().enumerate().find_map(|(i, m)| {
                m.filter(|(p, pages, _)| gpa >= place(*p) && gpa < place(*p) + pages * 4096)
                    .map(|m| (i, m.2))
            });
            let ctx = format!("step {step} ({what}): gpa {gpa:#x} in {holder:?}");
            assert!(
                got.cursor_disagrees.is_empty(),
                "{ctx}: the cursor disagrees: {got:?}"
            );
            match holder {
                None => {
                    assert_eq!(got.write_exit, Some(gpa), "{ctx}: write must exit");
                    assert_eq!(got.read_exit, Some(gpa + 2), "{ctx}: read must exit");
                }
                Some((_, flags)) => {
                    let mut word = [0u8; 2];
                    slots.table().read(Gpa(gpa + 2), &mut word).unwrap();
                    assert_eq!(got.read_exit, None, "{ctx}: read must not exit");
                    assert_eq!(got.value, u16::from_le_bytes(word), "{ctx}: value read");
                    if flags.contains(SlotFlags::READ_ONLY) {
                        assert_eq!(
                            got.write_exit,
                            Some(gpa),
                            "{ctx}: read-only write must exit"
                        );
                    } else {
                        assert_eq!(got.write_exit, None, "{ctx}: write must not exit");
                        slots.table().read(Gpa(gpa), &mut word).unwrap();
                        assert_eq!(
                            u16::from_le_bytes(word),
                            segment(gpa),
                            "{ctx}: write landed"
                        );
                    }
                }
            }
        }
        // KVM's slot numbers: GET_DIRTY_LOG works exactly for the logging slots.
        let mut logging = Vec::new();
        for (i, m) in model.iter().enumerate() {
            if let Some((_, _, flags)) = m {
                let k = slots.kvm_slot(i as SlotId).expect("installed");
                max_kvm_slot = max_kvm_slot.max(k);
                if flags.contains(SlotFlags::LOG_DIRTY) {
                    logging.push(k);
                }
            }
        }
        for k in 0..=max_kvm_slot + 1 {
            match vm.get_dirty_log(k, (PLACE) as usize) {
                Ok(_) => assert!(
                    logging.contains(&k),
                    "step {step} ({what}): KVM slot {k} logs"
                ),
                Err(e) => {
                    assert!(
                        !logging.contains(&k),
                        "step {step} ({what}): KVM slot {k}: {e}"
                    );
                    assert_eq!(e.errno(), libc::ENOENT, "step {step}: KVM slot {k}");
                }
            }
        }
        assert_eq!(slots.installed(), 1 + model.iter().flatten().count());
    }
    let (reply, answer) = mpsc::channel();
    tx.send(Request::Done(reply)).unwrap();
    let spins = answer.recv().unwrap();
    vcpu_thread.join().unwrap();
    println!(
        "memslot churn: 160 steps (inserts {}, removes {}, flag changes {}, moves {}, resizes {}), \
         KVM's view matched the table after each; {spins} guest probes ran between changes; \
         KVM slot numbers used 0..={max_kvm_slot}",
        changes[0], changes[1], changes[2], changes[3], changes[4]
    );
    assert!(
        changes.iter().all(|&c| c > 0),
        "every kind of change ran: {changes:?}"
    );
}

#[test]
fn kvm_refusals_come_back_typed_with_errno_and_the_region() {
    let Some(kvm) = kvm_or_skip("memslot errors") else {
        return;
    };
    let g = guest(&kvm, Options::default(), 0x20000);
    // A second table bound to the same VM claims guest memory the first one holds: KVM refuses
    // (the binding's KVM slot 0 is taken by the first table's code slot: KVM sees a move).
    let other = memvisor::SlotTable::new();
    other
        .insert(SlotSpec::new(7, Gpa(0), g.memory.clone()).window(0, 0x10000))
        .unwrap();
    let err = memvisor_kvm::KvmSlots::new(g.vm.clone(), other).unwrap_err();
    println!("second binding on one VM: {err}");
    match &err {
        Error::Memslot {
            slot,
            gpa,
            size,
            errno,
            ..
        } => {
            assert_eq!((*slot, *gpa, *size), (7, 0, 0x10000));
            assert!(
                *errno == libc::EINVAL || *errno == libc::EEXIST,
                "errno {errno}"
            );
            assert_eq!(err.errno(), *errno);
        }
        other => panic!("not a memslot error: {other:?}"),
    }
    assert!(err.to_string().contains("gpa 0x0, size 0x10000"), "{err}");
    // memvisor's own refusals pass through with their errno (EEXIST for an overlap) and leave
    // KVM as it was.
    let err = g
        .slots
        .insert(SlotSpec::new(3, Gpa(0x8000), g.memory.clone()).window(0, 0x10000))
        .unwrap_err();
    assert_eq!(err.errno(), libc::EEXIST, "{err}");
    assert_eq!(g.slots.installed(), 1);
    // A slot that is not there: ENOENT from the dirty log, as KVM gives it.
    assert_eq!(
        g.slots.take_dirty_log(42).unwrap_err().errno(),
        libc::ENOENT
    );
    assert_eq!(g.slots.take_dirty_log(0).unwrap_err().errno(), libc::ENOENT);
}
