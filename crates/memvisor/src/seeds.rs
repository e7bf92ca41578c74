//! The seeds: the Linux kernel patches whose ideas memvisor carries into userspace, and whose
//! measurements `memvisor bench` reproduces side by side. Reports name each by its patch
//! subject, with the short id beside it; the id numbers the document that holds the patch
//! (document 004 holds two series, told apart as 004a and 004b). This module holds no code.
//!
//! | id | kernel patch | what it measured | reproduced by |
//! |----|--------------|------------------|---------------|
//! | 000 | vfio/type1: Batch page pinning | the time to pin 1–120 GB of guest memory, page by page and 512 pages per step | `memvisor bench pin` |
//! | 001 | vfio/type1: optimize vfio_unpin_pages_remote() for large folio | `VFIO_IOMMU_MAP_DMA` / `UNMAP_DMA` of 16 GB in GB/s on THP, populated and hugetlbfs memory, a huge page unpinned in one step | `memvisor bench map-unmap` |
//! | 002 | vfio iommu type1: Improve vfio_iommu_type1_pin_pages performance | one `pin_pages` call of 1 and of 512 pages with calls split into runs of contiguous pages, and vfio-ccw traces of how long calls and runs are | `memvisor bench pin-pages` |
//! | 003 | KVM: Cache the last used slot index per vCPU | KVM's dirty_log_perf_test, 64 vCPUs each in its own of 64 memslots: populate and iteration 2 with a per-vCPU instead of a VM-wide last-slot hint | `memvisor bench lookup` |
//! | 004a | use vfio_iova_rw() to read/write IOVAs from CPU side | CPU copies to and from IOVAs without pinning first (no figures of its own) | `memvisor bench rw` |
//! | 004b | mm / virtio: Provide support for free page reporting | will-it-scale page_fault1 and page_fault2 in a guest with free page reporting on and off | `memvisor bench report` |
//!
//! In memvisor the seeds' ideas live in [`crate::dma::DmaSpace`] (batched pinning and unpinning,
//! page runs in `pin_pages`, `dma_read` / `dma_write`), [`crate::slots::SlotCursor`] (the
//! per-vCPU last slot) and [`crate::discard::Discarder`] (free page reporting, host side).
