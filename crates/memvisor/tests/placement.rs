//! The placement options of `BackingOptions`, checked by what the kernel reports: the NUMA
//! policy read back with `get_mempolicy(MPOL_F_ADDR)`, `MAP_NORESERVE` and `MADV_MERGEABLE`
//! as the `nr` and `mg` flags of the mapping in /proc/self/smaps (each beside a backing made
//! without the option, which must not show it). Every refusal: a node that is not online, an
//! option on a kind where it has no meaning.

use memvisor::{Backing, BackingKind, BackingOptions, NumaMode, NumaPolicy};

mod common;

const MIB: u64 = 1 << 20;
const MPOL_F_ADDR: libc::c_ulong = 1 << 1;

fn with(kind: BackingKind, options: BackingOptions) -> memvisor::Result<Backing> {
    Backing::with_options(kind, 2 * MIB, &options)
}

/// The policy mode and first word of the node mask at `b`'s first byte.
fn policy_at(b: &Backing) -> (libc::c_int, libc::c_ulong) {
    let mut mode: libc::c_int = -1;
    let mut mask: [libc::c_ulong; 16] = [0; 16];
    // SAFETY: get_mempolicy writes `mode` and at most 1024 bits of `mask`, both ours; the
    // address is inside a live mapping.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_get_mempolicy,
            &mut mode,
            mask.as_mut_ptr(),
            (mask.len() * 64) as libc::c_ulong,
            b.as_ptr(),
            MPOL_F_ADDR,
        )
    };
    assert_eq!(rc, 0, "get_mempolicy: {}", std::io::Error::last_os_error());
    (mode, mask[0])
}

fn numa_online() -> bool {
    let ok = std::path::Path::new("/sys/devices/system/node/online").exists();
    if !ok {
        common::skipped(
            "numa tests: /sys/devices/system/node/online missing (kernel without NUMA)",
        );
    }
    ok
}

#[test]
fn numa_policy_applies_to_the_mapping() {
    if !numa_online() {
        return;
    }
    for kind in [
        BackingKind::PrivateAnon,
        BackingKind::Memfd,
        BackingKind::Thp,
    ] {
        let plain = with(kind.clone(), BackingOptions::default()).unwrap();
        assert_eq!(
            policy_at(&plain).0,
            libc::MPOL_DEFAULT,
            "{kind:?} without a policy"
        );
        for (policy, mode) in [
            (NumaPolicy::bind(0), libc::MPOL_BIND),
            (NumaPolicy::preferred(0), libc::MPOL_PREFERRED),
            (NumaPolicy::interleave([0]), libc::MPOL_INTERLEAVE),
        ] {
            let options = BackingOptions {
                numa: Some(policy.clone()),
                populate: true,
                ..Default::default()
            };
            let b = with(kind.clone(), options).unwrap();
            assert_eq!(policy_at(&b), (mode, 0b1), "{kind:?} {policy:?}");
            b.write(MIB, b"placed").unwrap();
        }
    }
}

#[test]
fn numa_refuses_nodes_that_are_not_online_and_bad_policies() {
    if !numa_online() {
        return;
    }
    let online = std::fs::read_to_string("/sys/devices/system/node/online").unwrap();
    for node in [64, 1023] {
        if online.trim() != "0" {
            common::skipped(&format!(
                "numa node {node} refusal: nodes {} online, this test wants just node 0",
                online.trim()
            ));
            return;
        }
        let e = with(
            BackingKind::PrivateAnon,
            BackingOptions {
                numa: Some(NumaPolicy::bind(node)),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(
            matches!(e, memvisor::Error::NoSuchNode { node: n, .. } if n == node),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains(&format!("node {node} is not online")),
            "{e}"
        );
    }
    let bad = [
        NumaPolicy::interleave([]),
        NumaPolicy {
            mode: NumaMode::Preferred,
            nodes: vec![0, 0],
        },
    ];
    for policy in bad {
        let e = with(
            BackingKind::Memfd,
            BackingOptions {
                numa: Some(policy.clone()),
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{policy:?}: {e}");
    }
    let path = std::env::temp_dir().join(format!("memvisor-placement-{}", std::process::id()));
    let e = with(
        BackingKind::File {
            path: path.clone(),
            shared: true,
        },
        BackingOptions {
            numa: Some(NumaPolicy::bind(0)),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            memvisor::Error::BadOption {
                kind: "file-shared",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(!path.exists(), "refused before the file was created");
}

/// Whether every area of `b`'s mapping shows VmFlags `flag`.
fn flagged(b: &Backing, flag: &str) -> bool {
    let areas = common::vmas(b.hva().0, b.hva().0 + b.size());
    assert!(!areas.is_empty());
    areas.iter().all(|a| a.has_flag(flag))
}

#[test]
fn noreserve_reaches_the_mapping() {
    let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap_or_default();
    if overcommit.trim() == "2" {
        common::skipped(
            "noreserve: vm.overcommit_memory=2, where the kernel ignores MAP_NORESERVE",
        );
        return;
    }
    for kind in [
        BackingKind::PrivateAnon,
        BackingKind::Thp,
        BackingKind::SharedAnon,
    ] {
        let plain = with(kind.clone(), BackingOptions::default()).unwrap();
        assert!(!flagged(&plain, "nr"), "{kind:?} without noreserve");
        let b = with(
            kind.clone(),
            BackingOptions {
                noreserve: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(flagged(&b, "nr"), "{kind:?} with noreserve");
    }
}

#[test]
fn noreserve_is_refused_where_it_means_nothing() {
    let path = std::env::temp_dir().join(format!("memvisor-noreserve-{}", std::process::id()));
    for kind in [
        BackingKind::Memfd,
        BackingKind::Hugetlb(memvisor::PageSize::Size2M),
        BackingKind::File {
            path: path.clone(),
            shared: true,
        },
    ] {
        let e = with(
            kind.clone(),
            BackingOptions {
                noreserve: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{kind:?}: {e}");
        let msg = e.to_string();
        assert!(
            msg.contains("noreserve") && msg.contains(kind.name()),
            "{msg}"
        );
    }
    assert!(!path.exists());
}

fn ksm() -> bool {
    let ok = std::path::Path::new("/sys/kernel/mm/ksm").exists();
    if !ok {
        common::skipped("mergeable tests: /sys/kernel/mm/ksm missing (kernel without KSM)");
    }
    ok
}

#[test]
fn mergeable_reaches_private_memory() {
    if !ksm() {
        return;
    }
    for kind in [BackingKind::PrivateAnon, BackingKind::Thp] {
        let plain = with(kind.clone(), BackingOptions::default()).unwrap();
        assert!(!flagged(&plain, "mg"), "{kind:?} without mergeable");
        let b = with(
            kind.clone(),
            BackingOptions {
                mergeable: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(flagged(&b, "mg"), "{kind:?} with mergeable");
    }
}

/// Why memvisor refuses `mergeable` on shared memory: the kernel says yes and does nothing.
#[test]
fn mergeable_is_refused_on_shared_memory_which_the_kernel_ignores() {
    if !ksm() {
        return;
    }
    for kind in [BackingKind::SharedAnon, BackingKind::Memfd] {
        let e = with(
            kind.clone(),
            BackingOptions {
                mergeable: true,
                ..Default::default()
            },
        )
        .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL, "{kind:?}: {e}");
        assert!(e.to_string().contains("mergeable"), "{e}");
        // The kernel's own answer, asked directly.
        let b = with(kind.clone(), BackingOptions::default()).unwrap();
        // SAFETY: advice on our own live mapping; MADV_MERGEABLE changes no contents.
        let rc =
            unsafe { libc::madvise(b.as_ptr().cast(), b.size() as usize, libc::MADV_MERGEABLE) };
        assert_eq!(rc, 0, "{kind:?}: the kernel accepts the advice");
        assert!(
            !flagged(&b, "mg"),
            "{kind:?}: and does not mark the area mergeable"
        );
    }
}
