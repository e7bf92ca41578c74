//! `memvisor bench kvm`: memslot update latency with 1, 100 and 10,000 slots (issue 37); the
//! MMIO-exit and dirty-harvest rows are in `kvm_exits.rs`.
//!
//! A VMM that changes guest memory (hotplug, a BAR moved, a ROM made read-only) pays for it on
//! two sides: its own slot table and KVM's memslots. With `n` slots installed (4 KiB each, one
//! memfd) the experiment times one more slot inserted and removed again, side by side:
//! - `table only`: `SlotTable::insert` + `remove` (memvisor builds and publishes a snapshot each);
//! - `KVM ioctls only`: `KVM_SET_USER_MEMORY_REGION2` create + delete on the same VM, the
//!   binding not involved (what KVM itself costs at that slot count);
//! - `KvmSlots`: `memvisor_kvm::KvmSlots::insert` + `remove`, the table change and its sync into
//!   KVM together: what a VMM on memvisor-kvm pays.
//!
//! `KvmSlots` minus the other two is the binding's own cost (its diff of the snapshot against
//! what KVM holds). Run on request only: it needs /dev/kvm (and says "skipped" without it).

use std::sync::Arc;
use std::time::Instant;

use kvm_bindings::kvm_userspace_memory_region2;
use kvm_ioctls::Kvm;
use memvisor::{Backing, BackingKind, Gpa, SlotSpec, SlotTable};
use memvisor_kvm::KvmSlots;

use super::{Ctx, Experiment, Outcome, Row, Table, measure};

pub struct KvmMemslots;

const COUNTS: [u64; 3] = [1, 100, 10_000];
const SLOT: u64 = 4096;
/// Slot `i` at `i * STRIDE`: 4 KiB slots with 4 KiB holes between them.
const STRIDE: u64 = 2 * SLOT;

/// Insert + remove pairs per run at `n` slots: fewer where each costs more.
fn pairs(n: u64) -> u32 {
    (2000 / (1 + n / 100)).max(20) as u32
}

impl Experiment for KvmMemslots {
    fn name(&self) -> &'static str {
        "kvm"
    }
    fn title(&self) -> &'static str {
        "KVM: memslot update latency, MMIO-exit round trips (cursor vs search), dirty harvest"
    }
    fn about(&self) -> &'static str {
        "With n slots of 4 KiB installed, one more slot is inserted and removed again: through \
         the SlotTable alone, through KVM_SET_USER_MEMORY_REGION2 alone, and through \
         memvisor-kvm's KvmSlots (the table change and its sync into KVM). Microseconds per \
         insert + remove pair, median of the runs. Then MMIO exits whose handler copies guest \
         memory through the vCPU's SlotCursor or a binary search over n slots, against the bare \
         exit (ns per exit); and one read-and-clear of a 1 GiB slot's dirty log with 1 and 128 \
         dirty pages: KVM bitmap, KVM dirty ring, memvisor's own log (µs)."
    }

    fn run(&self, ctx: &mut Ctx) -> anyhow::Result<Outcome> {
        let mut out = Outcome::default();
        if !std::path::Path::new("/dev/kvm").exists() {
            out.skipped.push("kvm: no /dev/kvm".into());
            return Ok(out);
        }
        let runs = ctx.runs_or(3);
        let kvm = Kvm::new()?;
        let max = *COUNTS.last().unwrap_or(&1);
        let memory = Arc::new(Backing::new(BackingKind::Memfd, (max + 1) * SLOT)?);
        let mut table = Table::new(
            "memslot insert + remove, µs per pair",
            &[
                "slots",
                "table only",
                "KVM ioctls only",
                "KvmSlots",
                "KvmSlots / (table + KVM)",
            ],
        );
        for n in COUNTS {
            let pairs = pairs(n);
            // n slots, installed in one batch (one sync).
            let vm = Arc::new(kvm.create_vm()?);
            let slots = KvmSlots::new(vm.clone(), SlotTable::new())?;
            slots.update(|e| {
                (0..n).try_for_each(|i| {
                    e.insert(
                        SlotSpec::new(i as u32, Gpa(i * STRIDE), memory.clone())
                            .window(i * SLOT, SLOT),
                    )
                })
            })?;
            // The extra slot: past the others, its memory the backing's last page.
            let extra = || {
                SlotSpec::new(n as u32, Gpa(n * STRIDE), memory.clone()).window(max * SLOT, SLOT)
            };
            let per_pair = |t: Instant| t.elapsed().as_nanos() as f64 / 1e3 / f64::from(pairs);

            let table_only = SlotTable::new();
            table_only.update(|e| {
                (0..n).try_for_each(|i| {
                    e.insert(
                        SlotSpec::new(i as u32, Gpa(i * STRIDE), memory.clone())
                            .window(i * SLOT, SLOT),
                    )
                })
            })?;
            let mut failed: Option<anyhow::Error> = None;
            let t_table = measure(runs, || {
                let t = Instant::now();
                for _ in 0..pairs {
                    if let Err(e) = table_only
                        .insert(extra())
                        .and_then(|()| table_only.remove(n as u32))
                    {
                        failed.get_or_insert(e.into());
                    }
                }
                per_pair(t)
            });

            // KVM alone: a KVM slot number the binding does not use (it numbers from 0).
            let hva = memory.hva().0 + max * SLOT;
            let region = |size| kvm_userspace_memory_region2 {
                slot: n as u32 + 1,
                guest_phys_addr: (n + 1) * STRIDE,
                memory_size: size,
                userspace_addr: hva,
                ..Default::default()
            };
            let t_kvm = measure(runs, || {
                let t = Instant::now();
                for _ in 0..pairs {
                    for size in [SLOT, 0] {
                        // SAFETY: the region is the last page of `memory`, made before the loop
                        // and alive after every VM made in it; the next call (size 0) deletes it.
                        if let Err(e) = unsafe { vm.set_user_memory_region2(region(size)) } {
                            failed.get_or_insert(anyhow::anyhow!(
                                "KVM_SET_USER_MEMORY_REGION2 (size {size:#x}): {e}"
                            ));
                        }
                    }
                }
                per_pair(t)
            });

            let t_binding = measure(runs, || {
                let t = Instant::now();
                for _ in 0..pairs {
                    if let Err(e) = slots.insert(extra()).and_then(|()| slots.remove(n as u32)) {
                        failed.get_or_insert(e.into());
                    }
                }
                per_pair(t)
            });
            if let Some(e) = failed {
                return Err(e.context(format!("kvm: at {n} slots")));
            }
            let case = format!("{n} slots");
            for (variant, stats) in [
                ("table only", &t_table),
                ("KVM ioctls only", &t_kvm),
                ("KvmSlots", &t_binding),
            ] {
                out.rows.push(Row::new(
                    "kvm",
                    &case,
                    variant,
                    "insert+remove",
                    "us",
                    stats,
                ));
            }
            table.push(vec![
                n.to_string(),
                format!("{:.2}", t_table.median),
                format!("{:.2}", t_kvm.median),
                format!("{:.2}", t_binding.median),
                format!("{:.2}x", t_binding.median / (t_table.median + t_kvm.median)),
            ]);
        }
        table.note = Some(
            "One slot inserted and removed with n others present; the last column is the \
             binding's overhead over doing both halves by hand (its diff of the snapshot \
             against what KVM holds is O(n))."
                .into(),
        );
        out.tables.push(table);
        super::kvm_exits::mmio_exits(&kvm, runs, &mut out)?;
        super::kvm_exits::harvest(&kvm, runs, &mut out)?;
        Ok(out)
    }
}
