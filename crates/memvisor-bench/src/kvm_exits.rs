//! `memvisor bench kvm`, second part: MMIO-exit round trips and dirty-log harvest cost (issue 37).
//!
//! **MMIO exits.** A real-mode guest loops on a 2-byte write to guest address 0xF0000, which no
//! slot holds, so every write is an MMIO exit to `Vcpu::run`'s handler. The handler emulates a
//! device that copies 64 bytes of guest memory per exit (a descriptor read) from a slot in the
//! middle of `n` slots (n = 1, 100, 10,000, 4 KiB each): through the vCPU thread's
//! `SlotCursor` (its last slot hits: no search), or through `SlotTable::read` (the table's
//! current snapshot, a binary search over the slots, then the copy). The floor is the same loop
//! with a handler that does nothing: the bare exit. Nanoseconds per exit.
//!
//! **Dirty harvest.** One 1 GiB logging slot; `d` pages dirtied (1 and 128: a real-mode guest
//! reaches the first MiB only), then one read-and-clear of the slot's log timed: KVM's bitmap
//! with manual protect (`KvmSlots::take_dirty_log`: `KVM_GET_DIRTY_LOG` of the whole 1 GiB, then
//! `KVM_CLEAR_DIRTY_LOG` of the bits read), KVM's dirty ring (the same call: ring harvest and
//! `KVM_RESET_DIRTY_RINGS`), the pages dirtied by a guest loop on KVM; and memvisor's own log
//! with the pages marked by host writes through the table: `SlotTable::drain_dirty_log`
//! (summary levels, O(dirty words)) and `SlotTable::take_dirty_log` (a copy of the whole
//! bitmap). Microseconds per harvest of the 1 GiB slot, and per dirty page (the difference
//! between 128 and 1 dirty pages, over 127).

use std::sync::Arc;
use std::time::Instant;

use kvm_ioctls::Kvm;
use memvisor::{Backing, BackingKind, Gpa, SlotCursor, SlotFlags, SlotSpec, SlotTable};
use memvisor_kvm::{Control, ExitHandler, KvmSlots, Options, Stop, Vcpu};

use super::{Outcome, Row, Stats, Table, measure};

const COUNTS: [u64; 3] = [1, 100, 10_000];
/// Slot `i` of the `n` at `SLOTS_AT + i * 8 KiB`, 4 KiB each; slot `n` is the code (64 KiB at 0).
const SLOTS_AT: u64 = 0x10_0000;
const EXITS: u32 = 20_000;

/// mov ax, 0xF000; mov es, ax; loop: mov es:\[0\], ax; jmp loop.
const MMIO_LOOP: [u8; 11] = [
    0xB8, 0x00, 0xF0, 0x8E, 0xC0, 0x26, 0xA3, 0x00, 0x00, 0xEB, 0xFA,
];

/// For each segment in the list at 0x2000 (0 ends it) writes a word at its offset 0; halts.
const DIRTY_LIST: [u8; 22] = [
    0x31, 0xC0, 0x8E, 0xD8, 0xBE, 0x00, 0x20, 0xAD, 0x85, 0xC0, 0x74, 0x09, 0x8E, 0xC0, 0x26, 0x89,
    0x06, 0x00, 0x00, 0xEB, 0xF2, 0xF4,
];

#[derive(Clone, Copy, PartialEq)]
enum Copy {
    Nothing,
    Cursor,
    Search,
}

struct Device {
    how: Copy,
    table: SlotTable,
    target: Gpa,
    exits: u32,
    /// Nanoseconds spent in the copy (timed around it on every exit).
    copy_ns: u128,
    failed: bool,
}

impl ExitHandler for Device {
    fn mmio_write(&mut self, cursor: &mut SlotCursor, _: u64, _: &[u8]) -> Control {
        let mut buf = [0u8; 64];
        let t = Instant::now();
        let ok = match self.how {
            Copy::Nothing => true,
            Copy::Cursor => cursor.read(self.target, &mut buf).is_ok(),
            Copy::Search => self.table.read(self.target, &mut buf).is_ok(),
        };
        std::hint::black_box(&buf);
        self.copy_ns += t.elapsed().as_nanos();
        self.failed |= !ok;
        self.exits += 1;
        if self.exits == EXITS {
            Control::Stop
        } else {
            Control::Continue
        }
    }
}

pub fn mmio_exits(kvm: &Kvm, runs: u32, out: &mut Outcome) -> anyhow::Result<()> {
    let max = *COUNTS.last().unwrap_or(&1);
    let memory = Arc::new(Backing::new(BackingKind::Memfd, 0x10000 + max * 4096)?);
    memory.write(0x1000, &MMIO_LOOP)?;
    let mut table = Table::new(
        "MMIO-exit round trip, ns per exit (handler copies 64 bytes of guest memory)",
        &[
            "slots",
            "round trip, bare exit",
            "round trip, SlotCursor copy",
            "round trip, search copy",
            "copy: SlotCursor",
            "copy: binary search",
            "search / cursor",
        ],
    );
    for n in COUNTS {
        let vm = Arc::new(kvm.create_vm()?);
        let slots = KvmSlots::new(vm.clone(), SlotTable::new())?;
        slots.update(|e| {
            e.insert(SlotSpec::new(n as u32, Gpa(0), memory.clone()).window(0, 0x10000))?;
            (0..n).try_for_each(|i| {
                e.insert(
                    SlotSpec::new(i as u32, Gpa(SLOTS_AT + i * 0x2000), memory.clone())
                        .window(0x10000 + i * 4096, 4096),
                )
            })
        })?;
        let mut vcpu = Vcpu::new(&vm, 0, &slots)?;
        let target = Gpa(SLOTS_AT + n / 2 * 0x2000 + 64);
        let mut time = |how: Copy| -> anyhow::Result<(Stats, Stats)> {
            let mut failed = None;
            let mut copy = Vec::new();
            let stats = measure(runs, || {
                let mut device = Device {
                    how,
                    table: slots.table().clone(),
                    target,
                    exits: 0,
                    copy_ns: 0,
                    failed: false,
                };
                if let Err(e) = vcpu.set_real_mode(0x1000) {
                    failed.get_or_insert(anyhow::anyhow!("{e}"));
                }
                let t = Instant::now();
                loop {
                    match vcpu.run(&mut device) {
                        Ok(Stop::Handler) => break,
                        Ok(Stop::Interrupted) => continue,
                        Ok(other) => {
                            failed.get_or_insert(anyhow::anyhow!("guest stopped: {other:?}"));
                            break;
                        }
                        Err(e) => {
                            failed.get_or_insert(anyhow::anyhow!("{e}"));
                            break;
                        }
                    }
                }
                if device.failed {
                    failed.get_or_insert(anyhow::anyhow!("the handler's copy failed"));
                }
                let exits = f64::from(EXITS.max(device.exits));
                copy.push(device.copy_ns as f64 / exits);
                t.elapsed().as_nanos() as f64 / exits
            });
            match failed {
                Some(e) => Err(e.context(format!("kvm mmio exits at {n} slots"))),
                None => Ok((stats, Stats::from_samples(&copy))),
            }
        };
        let (bare, bare_copy) = time(Copy::Nothing)?;
        let (cursor, cursor_copy) = time(Copy::Cursor)?;
        let (search, search_copy) = time(Copy::Search)?;
        let case = format!("{n} slots");
        for (variant, metric, stats) in [
            ("bare exit", "mmio exit", &bare),
            ("SlotCursor", "mmio exit", &cursor),
            ("binary search", "mmio exit", &search),
            ("SlotCursor", "handler copy", &cursor_copy),
            ("binary search", "handler copy", &search_copy),
        ] {
            out.rows
                .push(Row::new("kvm", &case, variant, metric, "ns", stats));
        }
        // The timer's own cost (the empty handler's timed section) is taken off both copies.
        let net = |s: &Stats| (s.median - bare_copy.median).max(0.1);
        table.push(vec![
            n.to_string(),
            format!("{:.0}", bare.median),
            format!("{:.0}", cursor.median),
            format!("{:.0}", search.median),
            format!("{:.1}", net(&cursor_copy)),
            format!("{:.1}", net(&search_copy)),
            format!("{:.2}x", net(&search_copy) / net(&cursor_copy)),
        ]);
    }
    table.note = Some(
        "Round trips are the whole loop (guest write, KVM's exit, Vcpu::run, the handler, \
         re-entry) per exit; the copy columns time the handler's 64-byte copy alone on the vCPU \
         thread, less the timer's own cost (an empty timed section). On this machine the exit \
         itself (PVM, emulated real mode) is hundreds of times the copy."
            .into(),
    );
    out.tables.push(table);
    Ok(())
}

const GIB: u64 = 1 << 30;
const DIRTY: [u64; 2] = [1, 128];
/// Harvests timed per run.
const ROUNDS: u32 = 20;

/// Guest memory: one 1 GiB logging slot at 0 with the dirtying program and its list of `d`
/// pages (from 0x20000, one per 4 KiB).
fn dirty_memory(d: u64) -> anyhow::Result<(SlotTable, Arc<Backing>)> {
    let memory = Arc::new(Backing::new(BackingKind::Memfd, GIB)?);
    memory.write(0x1000, &DIRTY_LIST)?;
    let mut list = Vec::new();
    for i in 0..d {
        list.extend_from_slice(&(((0x20000 + i * 4096) >> 4) as u16).to_le_bytes());
    }
    list.extend_from_slice(&[0, 0]);
    memory.write(0x2000, &list)?;
    let table = SlotTable::new();
    table.insert(SlotSpec::new(0, Gpa(0), memory.clone()).flags(SlotFlags::LOG_DIRTY))?;
    Ok((table, memory))
}

/// µs per harvest of `d` guest-dirtied pages through a binding made with `options`.
fn kvm_harvest(kvm: &Kvm, runs: u32, d: u64, options: Options) -> anyhow::Result<Stats> {
    let (table, _memory) = dirty_memory(d)?;
    let vm = Arc::new(kvm.create_vm()?);
    let slots = KvmSlots::with_options(vm.clone(), table, options)?;
    let mut vcpu = Vcpu::new(&vm, 0, &slots)?;
    struct Halt;
    impl ExitHandler for Halt {}
    let mut failed: Option<anyhow::Error> = None;
    let mut pages = 0u64;
    let stats = measure(runs, || {
        let mut total = 0.0;
        for _ in 0..ROUNDS {
            let run = vcpu
                .set_real_mode(0x1000)
                .and_then(|()| vcpu.run(&mut Halt));
            if !matches!(run, Ok(Stop::Hlt)) {
                failed.get_or_insert(anyhow::anyhow!("dirtying guest: {run:?}"));
            }
            let t = Instant::now();
            match slots.take_dirty_log(0) {
                Ok(words) => pages = words.iter().map(|w| u64::from(w.count_ones())).sum(),
                Err(e) => {
                    failed.get_or_insert(e.into());
                }
            }
            total += t.elapsed().as_nanos() as f64 / 1e3;
        }
        total / f64::from(ROUNDS)
    });
    if let Some(e) = failed {
        return Err(e);
    }
    // The guest's pages (its code, list and stack pages are read, not written).
    if pages < d {
        anyhow::bail!("harvest reported {pages} pages, the guest dirtied {d}");
    }
    Ok(stats)
}

/// µs per harvest of memvisor's own log with `d` pages marked by host writes.
fn own_harvest(runs: u32, d: u64, sparse: bool) -> anyhow::Result<Stats> {
    let (table, _memory) = dirty_memory(d)?;
    let mut failed: Option<anyhow::Error> = None;
    let stats = measure(runs, || {
        let mut total = 0.0;
        for _ in 0..ROUNDS {
            for i in 0..d {
                if let Err(e) = table.write(Gpa(0x20000 + i * 4096), &[1]) {
                    failed.get_or_insert(e.into());
                }
            }
            let t = Instant::now();
            let pages = if sparse {
                let mut pages = 0u64;
                let r = table.drain_dirty_log(0, |_, bits| pages += u64::from(bits.count_ones()));
                r.map(|()| pages)
            } else {
                table
                    .take_dirty_log(0)
                    .map(|w| w.iter().map(|w| u64::from(w.count_ones())).sum())
            };
            total += t.elapsed().as_nanos() as f64 / 1e3;
            match pages {
                Ok(p) if p == d => {}
                Ok(p) => {
                    failed.get_or_insert(anyhow::anyhow!("own log: {p} pages, {d} marked"));
                }
                Err(e) => {
                    failed.get_or_insert(e.into());
                }
            }
        }
        total / f64::from(ROUNDS)
    });
    match failed {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

pub fn harvest(kvm: &Kvm, runs: u32, out: &mut Outcome) -> anyhow::Result<()> {
    let mut table = Table::new(
        "dirty-log harvest of a 1 GiB slot, µs per harvest (and per dirty page)",
        &["log", "1 dirty page", "128 dirty pages", "per dirty page"],
    );
    let ring = Options {
        dirty_ring: Some(4096),
        ..Options::default()
    };
    let mut sources: Vec<(&str, [Stats; 2])> = Vec::new();
    let by_d = |f: &mut dyn FnMut(u64) -> anyhow::Result<Stats>| -> anyhow::Result<[Stats; 2]> {
        Ok([f(DIRTY[0])?, f(DIRTY[1])?])
    };
    sources.push((
        "KVM bitmap (GET + CLEAR, manual protect)",
        by_d(&mut |d| kvm_harvest(kvm, runs, d, Options::default()))?,
    ));
    // Refused (EOPNOTSUPP) where KVM lacks rings or overruns them (PVM): skipped, said why.
    match by_d(&mut |d| kvm_harvest(kvm, runs, d, ring)) {
        Ok(stats) => sources.push(("KVM dirty ring (harvest + RESET)", stats)),
        Err(e)
            if e.downcast_ref::<memvisor_kvm::Error>()
                .is_some_and(|k| k.errno() == libc::EOPNOTSUPP) =>
        {
            out.skipped.push(format!("kvm: dirty-ring harvest: {e}"));
        }
        Err(e) => return Err(e),
    }
    sources.push((
        "memvisor log, sparse drain",
        by_d(&mut |d| own_harvest(runs, d, true))?,
    ));
    sources.push((
        "memvisor log, full take",
        by_d(&mut |d| own_harvest(runs, d, false))?,
    ));
    for (name, [one, many]) in &sources {
        for (d, stats) in [(DIRTY[0], one), (DIRTY[1], many)] {
            out.rows.push(Row::new(
                "kvm",
                &format!("1 GiB, {d} dirty"),
                name,
                "harvest",
                "us",
                stats,
            ));
        }
        let per_page = (many.median - one.median) / (DIRTY[1] - DIRTY[0]) as f64;
        table.push(vec![
            name.to_string(),
            format!("{:.2}", one.median),
            format!("{:.2}", many.median),
            format!("{:.4}", per_page),
        ]);
    }
    table.note = Some(
        "The 1-dirty-page column is the cost per GiB of slot; per dirty page is (128 - 1 \
         dirty pages) / 127. KVM's pages are dirtied by a guest loop, memvisor's by host \
         writes through the table; each harvest is one read-and-clear of the whole slot."
            .into(),
    );
    out.tables.push(table);
    Ok(())
}
