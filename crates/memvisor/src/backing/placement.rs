//! Where and how the kernel gives a new backing its pages: the [`BackingOptions`] beyond
//! `populate`.
//!
//! Three knobs a VMM sets on guest RAM, each a plain kernel interface applied to the mapping
//! memvisor just made, before any page is faulted in:
//!
//! - a NUMA policy, `mbind(2)`: `Bind` takes pages only from the given nodes, `Preferred` tries
//!   one node first, `Interleave` spreads pages round-robin over the nodes. Nodes are checked
//!   against `/sys/devices/system/node/online` first, so a node that does not exist is an error
//!   naming it, not a policy that silently falls back. Policies place anonymous, shmem (memfd)
//!   and hugetlbfs pages; page cache of a regular file follows the faulting thread's policy
//!   instead, so a file kind refuses the option.
//! - `MAP_NORESERVE`: no swap space reserved at `mmap`, so guest RAM can be overcommitted. It
//!   means something only where the kernel reserves: private memory and shared anonymous memory.
//!   A memfd is never reserved, shared file pages are page cache, and on hugetlbfs it would turn
//!   a missing huge page into a SIGBUS at a guest access instead of an error now: refused.
//! - `MADV_MERGEABLE`: KSM may merge identical pages. KSM merges private anonymous pages only;
//!   the kernel takes the advice on shared memory and quietly does nothing (`ksm_madvise` skips
//!   `VM_SHARED` areas), so memvisor refuses it there rather than pretend.
//!
//! `check` refuses bad values before anything is mapped; `apply` runs on the new mapping.

use crate::error::{Error, Result};

use super::{Backing, BackingKind, BackingOptions};

/// How a NUMA policy uses its nodes (`mbind(2)`'s modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NumaMode {
    /// `MPOL_BIND`: pages only from these nodes; allocation fails rather than go elsewhere.
    Bind,
    /// `MPOL_PREFERRED`: pages from this one node while it has free memory, else anywhere.
    Preferred,
    /// `MPOL_INTERLEAVE`: pages spread round-robin over these nodes.
    Interleave,
}

impl NumaMode {
    fn mpol(self) -> libc::c_int {
        match self {
            NumaMode::Bind => libc::MPOL_BIND,
            NumaMode::Preferred => libc::MPOL_PREFERRED,
            NumaMode::Interleave => libc::MPOL_INTERLEAVE,
        }
    }
}

/// A NUMA policy for a backing: a mode and its nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaPolicy {
    /// How the nodes are used.
    pub mode: NumaMode,
    /// The nodes (numbers as in `/sys/devices/system/node/nodeN`); `Preferred` takes exactly one.
    pub nodes: Vec<u32>,
}

impl NumaPolicy {
    /// Pages only from `node`.
    pub fn bind(node: u32) -> Self {
        NumaPolicy {
            mode: NumaMode::Bind,
            nodes: vec![node],
        }
    }

    /// Pages from `node` first.
    pub fn preferred(node: u32) -> Self {
        NumaPolicy {
            mode: NumaMode::Preferred,
            nodes: vec![node],
        }
    }

    /// Pages spread over `nodes`.
    pub fn interleave(nodes: impl IntoIterator<Item = u32>) -> Self {
        NumaPolicy {
            mode: NumaMode::Interleave,
            nodes: nodes.into_iter().collect(),
        }
    }
}

/// Refuses options that mean nothing for `kind`, and nodes that are not online.
pub(super) fn check(kind: &BackingKind, options: &BackingOptions) -> Result<()> {
    let name = kind.name();
    let shared = match kind {
        BackingKind::PrivateAnon | BackingKind::Thp => false,
        BackingKind::File { shared, .. } => *shared,
        _ => true,
    };
    if options.noreserve {
        let why = match kind {
            BackingKind::Memfd => {
                Some("a memfd's memory is never reserved (memfd_create sets that)")
            }
            BackingKind::Hugetlb(_) => Some(
                "unreserved huge pages would be a SIGBUS at a guest access when the pool runs \
                 out, instead of an error now; reserve the pages instead",
            ),
            BackingKind::File { shared: true, .. } => {
                Some("shared file pages are page cache, which is never reserved")
            }
            _ => None,
        };
        if let Some(why) = why {
            return Err(Error::BadOption {
                option: "noreserve (MAP_NORESERVE)",
                kind: name,
                why,
            });
        }
    }
    if options.mergeable && shared {
        return Err(Error::BadOption {
            option: "mergeable (MADV_MERGEABLE)",
            kind: name,
            why: "KSM merges private anonymous pages only (the kernel accepts the advice on \
                  shared memory and does nothing); use private-anon or thp",
        });
    }
    if let Some(policy) = &options.numa {
        if matches!(kind, BackingKind::File { .. }) {
            return Err(Error::BadOption {
                option: "numa (mbind)",
                kind: name,
                why: "page cache follows the faulting thread's policy, not the mapping's; set \
                      the thread's policy (set_mempolicy) or use memfd memory",
            });
        }
        check_nodes(policy)?;
    }
    Ok(())
}

fn check_nodes(policy: &NumaPolicy) -> Result<()> {
    if policy.nodes.is_empty() {
        return Err(Error::Invalid(format!(
            "NUMA policy {:?} names no node; give at least one",
            policy.mode
        )));
    }
    if policy.mode == NumaMode::Preferred && policy.nodes.len() != 1 {
        return Err(Error::Invalid(format!(
            "NUMA policy Preferred takes one node, not {:?}",
            policy.nodes
        )));
    }
    let text = std::fs::read_to_string("/sys/devices/system/node/online").map_err(|e| {
        Error::Unsupported {
            what: "NUMA policies",
            why: format!(
                "/sys/devices/system/node/online is unreadable ({e}): a kernel without NUMA"
            ),
        }
    })?;
    let online = text.trim();
    let ranges = parse_node_list(online).ok_or_else(|| Error::Unsupported {
        what: "NUMA policies",
        why: format!("/sys/devices/system/node/online holds {online:?}, not a node list"),
    })?;
    for &node in &policy.nodes {
        if !ranges.iter().any(|&(a, b)| (a..=b).contains(&node)) {
            return Err(Error::NoSuchNode {
                node,
                online: online.to_string(),
            });
        }
    }
    Ok(())
}

/// `0-1,3` as inclusive ranges.
fn parse_node_list(text: &str) -> Option<Vec<(u32, u32)>> {
    text.split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => Some((a.trim().parse().ok()?, b.trim().parse().ok()?)),
            None => {
                let n = part.trim().parse().ok()?;
                Some((n, n))
            }
        })
        .collect()
}

/// Applies the NUMA policy and KSM advice to the new, not yet populated mapping
/// (`MAP_NORESERVE` went into its `mmap` flags).
pub(super) fn apply(backing: &Backing, options: &BackingOptions) -> Result<()> {
    if let Some(policy) = &options.numa {
        let bits = u64::BITS as usize;
        let highest = policy.nodes.iter().copied().max().unwrap_or(0) as usize;
        let mut mask = vec![0 as libc::c_ulong; highest / bits + 1];
        for &n in &policy.nodes {
            mask[n as usize / bits] |= 1 << (n as usize % bits);
        }
        // The kernel reads maxnode - 1 bits (an off-by-one kept for compatibility).
        let maxnode = (mask.len() * bits + 1) as libc::c_ulong;
        // SAFETY: mbind reads `mask` (ours, `maxnode - 1` bits long) and sets the policy of our
        // own live mapping; it touches no memory.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                backing.as_ptr(),
                backing.mapped,
                policy.mode.mpol(),
                mask.as_ptr(),
                maxnode,
                0 as libc::c_uint,
            )
        };
        if rc != 0 {
            return Err(Error::last_os("mbind"));
        }
    }
    if options.mergeable {
        backing
            .madvise(libc::MADV_MERGEABLE, "madvise(MADV_MERGEABLE)")
            .map_err(|e| match e.errno() {
                libc::EINVAL => Error::Unsupported {
                    what: "KSM (MADV_MERGEABLE)",
                    why: "the kernel refused the advice: built without CONFIG_KSM".into(),
                },
                _ => e,
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_lists_parse() {
        assert_eq!(parse_node_list("0"), Some(vec![(0, 0)]));
        assert_eq!(parse_node_list("0-1,3"), Some(vec![(0, 1), (3, 3)]));
        assert_eq!(parse_node_list("x"), None);
    }
}
