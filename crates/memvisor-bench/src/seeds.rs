//! The seed documents the experiments reproduce: numbered kernel patches kept in the project's
//! shared `seeds/` folder (`000_….txt` to `004_….txt`; file 004 holds two patch series, told
//! apart as 004a and 004b). What each measured, and which experiment reproduces it:
//!
//! | id | kernel patch | what it measured | reproduced by |
//! |----|--------------|------------------|---------------|
//! | 000 | vfio/type1: Batch page pinning | the time to pin 1–120 GB of guest memory, page by page and 512 pages per step | `memvisor-bench pin` |
//! | 001 | vfio/type1: optimize vfio_unpin_pages_remote() for large folio | `VFIO_IOMMU_MAP_DMA` / `UNMAP_DMA` of 16 GB in GB/s on THP, populated and hugetlbfs memory, a huge page unpinned in one step | `memvisor-bench map-unmap` |
//! | 002 | vfio iommu type1: Improve vfio_iommu_type1_pin_pages performance | one `pin_pages` call of 1 and of 512 pages with calls split into runs of contiguous pages, and vfio-ccw traces of how long calls and runs are | `memvisor-bench pin-pages` |
//! | 003 | KVM: Cache the last used slot index per vCPU | KVM's dirty_log_perf_test, 64 vCPUs each in its own of 64 memslots: populate and iteration 2 with a per-vCPU instead of a VM-wide last-slot hint | `memvisor-bench lookup` |
//! | 004a | use vfio_iova_rw() to read/write IOVAs from CPU side | CPU copies to and from IOVAs without pinning first (no figures of its own) | `memvisor-bench rw` |
//! | 004b | mm / virtio: Provide support for free page reporting | will-it-scale page_fault1 and page_fault2 in a guest with free page reporting on and off | `memvisor-bench report` |
//!
//! In memvisor the seeds' ideas live in [`memvisor::DmaSpace`] (batched pinning and unpinning,
//! page runs in `pin_pages`, `dma_read` / `dma_write`), [`memvisor::SlotCursor`] (the per-vCPU
//! last slot) and [`memvisor::discard::Discarder`] (free page reporting, host side).
//!
//! Each [`Seed`] here is the one place an experiment's reference is written down:
//! [`super::Experiment::seeds`] returns them, the terminal and `report.md` headings and the
//! "Reproduces …" line are made from them ([`heading_suffix`], [`reproduces_line`]), and
//! `results.json` serializes them as they are. Text for people names a seed by its patch, the
//! short id beside it ([`Seed::named`]); a bare id means nothing to a reader without the folder.

use serde::Serialize;

/// One seed document, or one of the two patch series in document 004.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Seed {
    /// "000" to "003", "004a" or "004b".
    pub id: &'static str,
    /// The patch (series) subject, as the document gives it.
    pub title: &'static str,
    /// The document's file name in `shared/seeds/`, the project's shared folder.
    pub file: &'static str,
}

pub const SEED_000: Seed = Seed {
    id: "000",
    title: "vfio/type1: Batch page pinning",
    file: "000_bacae2283cd0fb79.txt",
};
pub const SEED_001: Seed = Seed {
    id: "001",
    title: "vfio/type1: optimize vfio_unpin_pages_remote() for large folio",
    file: "001_a6f90f1f11b89d32.txt",
};
pub const SEED_002: Seed = Seed {
    id: "002",
    title: "vfio iommu type1: Improve vfio_iommu_type1_pin_pages performance",
    file: "002_e2e3dd2eb2dd7d49.txt",
};
pub const SEED_003: Seed = Seed {
    id: "003",
    title: "KVM: Cache the last used slot index per vCPU",
    file: "003_323e49152d0d40df.txt",
};
pub const SEED_004A: Seed = Seed {
    id: "004a",
    title: "use vfio_iova_rw() to read/write IOVAs from CPU side",
    file: "004_a2f6aacf2ac97302.txt",
};
pub const SEED_004B: Seed = Seed {
    id: "004b",
    title: "mm / virtio: Provide support for free page reporting",
    file: "004_a2f6aacf2ac97302.txt",
};

impl Seed {
    /// “KVM: Cache the last used slot index per vCPU” (seed 003): the seed as text for people
    /// names it.
    pub fn named(&self) -> String {
        format!("“{}” (seed {})", self.title, self.id)
    }
}

/// " (“KVM: …”, seed 003)", " (“vfio/type1: …”, seed 000; “vfio/type1: …”, seed 001)", or ""
/// for none: the end of an experiment's heading.
pub fn heading_suffix(seeds: &[Seed]) -> String {
    if seeds.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = seeds
        .iter()
        .map(|s| format!("“{}”, seed {}", s.title, s.id))
        .collect();
    format!(" ({})", parts.join("; "))
}

/// "Reproduces seed 003, “KVM: …” (shared/seeds/003_….txt)." with one clause per seed, or `None` when
/// the experiment reproduces none.
pub fn reproduces_line(seeds: &[Seed]) -> Option<String> {
    if seeds.is_empty() {
        return None;
    }
    let parts: Vec<String> = seeds
        .iter()
        .map(|s| format!("seed {}, “{}” (shared/seeds/{})", s.id, s.title, s.file))
        .collect();
    Some(format!("Reproduces {}.", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_and_lines_name_every_seed() {
        assert_eq!(heading_suffix(&[]), "");
        assert_eq!(
            heading_suffix(&[SEED_003]),
            " (“KVM: Cache the last used slot index per vCPU”, seed 003)"
        );
        assert_eq!(
            heading_suffix(&[SEED_000, SEED_001]),
            " (“vfio/type1: Batch page pinning”, seed 000; “vfio/type1: optimize \
             vfio_unpin_pages_remote() for large folio”, seed 001)"
        );
        assert_eq!(
            SEED_004A.named(),
            "“use vfio_iova_rw() to read/write IOVAs from CPU side” (seed 004a)"
        );
        assert_eq!(reproduces_line(&[]), None);
        assert_eq!(
            reproduces_line(&[SEED_004B]).unwrap(),
            "Reproduces seed 004b, “mm / virtio: Provide support for free page reporting” \
             (shared/seeds/004_a2f6aacf2ac97302.txt)."
        );
        let two = reproduces_line(&[SEED_000, SEED_001]).unwrap();
        assert!(two.starts_with("Reproduces seed 000, “vfio/type1: Batch page pinning”"));
        assert!(
            two.contains(".txt); seed 001, “vfio/type1: optimize"),
            "{two}"
        );
    }

    /// Ids are unique and each file name starts with the id's number.
    #[test]
    fn ids_match_files() {
        let all = [SEED_000, SEED_001, SEED_002, SEED_003, SEED_004A, SEED_004B];
        for (i, s) in all.iter().enumerate() {
            assert!(s.file.starts_with(&s.id[..3]), "{s:?}");
            assert!(all[..i].iter().all(|t| t.id != s.id), "{s:?} twice");
        }
    }
}
