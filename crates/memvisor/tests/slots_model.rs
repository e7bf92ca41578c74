//! Model-based test: random sequences of inserts, removes, flag changes, lookups and cross-slot
//! writes/reads against a reference model written as plainly as possible — a list of slots and
//! a byte map of guest memory. Any divergence fails with proptest's shrunk sequence.

use std::collections::BTreeMap;
use std::sync::Arc;

use memvisor::{Backing, BackingKind, Gpa, SlotFlags, SlotSpec, SlotTable};
use proptest::prelude::*;

const PAGE: u64 = 4096;
/// Guest space of 32 pages; slots of 1..=4 pages.
const SPACE_PAGES: u64 = 32;

#[derive(Clone, Debug)]
enum Op {
    Insert { id: u32, page: u64, pages: u64 },
    Remove { id: u32 },
    SetReadOnly { id: u32, read_only: bool },
    Lookup { addr: u64 },
    Write { addr: u64, len: u64, byte: u8 },
    Read { addr: u64, len: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    let addr = 0..SPACE_PAGES * PAGE;
    prop_oneof![
        (0..6u32, 0..SPACE_PAGES, 1..=4u64).prop_map(|(id, page, pages)| Op::Insert {
            id,
            page,
            pages
        }),
        (0..6u32).prop_map(|id| Op::Remove { id }),
        (0..6u32, any::<bool>()).prop_map(|(id, read_only)| Op::SetReadOnly { id, read_only }),
        addr.clone().prop_map(|addr| Op::Lookup { addr }),
        (addr.clone(), 1..3 * PAGE, any::<u8>()).prop_map(|(addr, len, byte)| Op::Write {
            addr,
            len,
            byte
        }),
        (addr, 1..3 * PAGE).prop_map(|(addr, len)| Op::Read { addr, len }),
    ]
}

#[derive(Clone)]
struct ModelSlot {
    start: u64,
    len: u64,
    read_only: bool,
    /// The slot's bytes (the model's "backing").
    bytes: Vec<u8>,
}

#[derive(Default)]
struct Model {
    slots: BTreeMap<u32, ModelSlot>,
}

impl Model {
    fn slot_at(&self, addr: u64) -> Option<(u32, &ModelSlot)> {
        self.slots
            .iter()
            .find(|(_, s)| addr >= s.start && addr < s.start + s.len)
            .map(|(id, s)| (*id, s))
    }

    /// errno the real table must give for an access, or None if it must succeed.
    fn access_errno(&self, addr: u64, len: u64, write: bool) -> Option<i32> {
        for a in addr..addr + len {
            match self.slot_at(a) {
                None => return Some(libc::EFAULT),
                Some((_, s)) if write && s.read_only => return Some(libc::EFAULT),
                _ => {}
            }
        }
        None
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let table = SlotTable::with_max_slots(5); // id 5 is out of range: EINVAL
    let mut model = Model::default();
    for op in ops {
        match op {
            Op::Insert { id, page, pages } => {
                let (start, len) = (page * PAGE, pages * PAGE);
                let expect = if id >= 5 {
                    Some(libc::EINVAL)
                } else if model.slots.contains_key(&id)
                    || model
                        .slots
                        .values()
                        .any(|s| start < s.start + s.len && s.start < start + len)
                {
                    Some(libc::EEXIST)
                } else {
                    None
                };
                let backing = Arc::new(Backing::new(BackingKind::PrivateAnon, len).unwrap());
                let got = table
                    .insert(SlotSpec::new(id, Gpa(start), backing))
                    .err()
                    .map(|e| e.errno());
                prop_assert_eq!(got, expect, "insert id {} at page {} x{}", id, page, pages);
                if expect.is_none() {
                    model.slots.insert(
                        id,
                        ModelSlot {
                            start,
                            len,
                            read_only: false,
                            bytes: vec![0; len as usize],
                        },
                    );
                }
            }
            Op::Remove { id } => {
                let got = table.remove(id).err().map(|e| e.errno());
                let expect = (!model.slots.contains_key(&id)).then_some(libc::ENOENT);
                prop_assert_eq!(got, expect);
                model.slots.remove(&id);
            }
            Op::SetReadOnly { id, read_only } => {
                let flags = if read_only {
                    SlotFlags::READ_ONLY
                } else {
                    SlotFlags::NONE
                };
                let got = table.set_flags(id, flags).err().map(|e| e.errno());
                let expect = (!model.slots.contains_key(&id)).then_some(libc::ENOENT);
                prop_assert_eq!(got, expect);
                if let Some(s) = model.slots.get_mut(&id) {
                    s.read_only = read_only;
                }
            }
            Op::Lookup { addr } => {
                let got = table
                    .lookup(Gpa(addr))
                    .map(|t| (t.slot, t.len, t.read_only));
                let expect = model
                    .slot_at(addr)
                    .map(|(id, s)| (id, s.start + s.len - addr, s.read_only));
                prop_assert_eq!(got, expect, "lookup {:#x}", addr);
            }
            Op::Write { addr, len, byte } => {
                let len = len.min(SPACE_PAGES * PAGE + 4 * PAGE - addr);
                let got = table
                    .write(Gpa(addr), &vec![byte; len as usize])
                    .err()
                    .map(|e| e.errno());
                let expect = model.access_errno(addr, len, true);
                prop_assert_eq!(got, expect, "write {:#x}+{:#x}", addr, len);
                if expect.is_none() {
                    for a in addr..addr + len {
                        let id = model.slot_at(a).unwrap().0;
                        let s = model.slots.get_mut(&id).unwrap();
                        s.bytes[(a - s.start) as usize] = byte;
                    }
                }
            }
            Op::Read { addr, len } => {
                let mut buf = vec![0xa5; len as usize];
                let got = table.read(Gpa(addr), &mut buf).err().map(|e| e.errno());
                let expect = model.access_errno(addr, len, false);
                prop_assert_eq!(got, expect, "read {:#x}+{:#x}", addr, len);
                if expect.is_none() {
                    let want: Vec<u8> = (addr..addr + len)
                        .map(|a| {
                            let (_, s) = model.slot_at(a).unwrap();
                            s.bytes[(a - s.start) as usize]
                        })
                        .collect();
                    prop_assert!(
                        buf == want,
                        "read {:#x}+{:#x} returned other bytes",
                        addr,
                        len
                    );
                } else {
                    prop_assert!(
                        buf.iter().all(|&b| b == 0xa5),
                        "a failed read changed the buffer"
                    );
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]
    #[test]
    fn slot_table_matches_the_model(ops in proptest::collection::vec(op(), 1..60)) {
        run(ops)?;
    }
}
