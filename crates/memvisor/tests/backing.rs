//! Every backing kind maps, holds data and unmaps; shared kinds are really shared; huge-page
//! kinds report and use their page size. Tests that need root or huge pages print why they skip.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use memvisor::backing::free_huge_pages;
use memvisor::{
    Backing, BackingKind, BackingOptions, Gpa, HugePageReservation, PageSize, SlotSpec, SlotTable,
};

const MIB: u64 = 1 << 20;

mod common;

/// A size field of the mapping that starts at `addr`, in KiB.
fn smaps_field(addr: u64, field: &str) -> u64 {
    common::vmas(addr, addr + 1)
        .iter()
        .find(|v| v.start == addr)
        .and_then(|v| v.kib(field))
        .unwrap_or_else(|| panic!("no mapping at {addr:#x} with field {field}"))
}

fn round_trip(b: &Backing) {
    let pattern: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 256) as u8).collect();
    let at = b.size() - pattern.len() as u64;
    b.write(at, &pattern).unwrap();
    b.write(0, &pattern[..16]).unwrap();
    let mut out = vec![0; pattern.len()];
    b.read(at, &mut out).unwrap();
    assert_eq!(out, pattern, "{:?}", b.kind());
}

fn temp_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("memvisor-test-{}-{name}", std::process::id()))
}

#[test]
fn every_4k_kind_maps_holds_data_and_reports_itself() {
    let file = temp_path("shared");
    let cases = [
        (BackingKind::PrivateAnon, false, false),
        (BackingKind::SharedAnon, true, false),
        (BackingKind::Memfd, true, true),
        (BackingKind::Thp, false, false),
        (
            BackingKind::File {
                path: file.clone(),
                shared: true,
            },
            true,
            true,
        ),
    ];
    for (kind, shared, has_fd) in cases {
        let b = Backing::new(kind.clone(), 4 * MIB).unwrap();
        assert_eq!(b.page_size(), PageSize::Size4K, "{kind:?}");
        assert_eq!(b.is_shared(), shared, "{kind:?}");
        assert_eq!(b.fd().is_some(), has_fd, "{kind:?}");
        assert_eq!(b.size(), 4 * MIB);
        round_trip(&b);
    }
    std::fs::remove_file(file).unwrap();
}

#[test]
fn populate_makes_every_page_resident() {
    let b = Backing::with_options(
        BackingKind::SharedAnon,
        8 * MIB,
        &BackingOptions {
            populate: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(smaps_field(b.hva().0, "Rss"), 8 * 1024);
    let lazy = Backing::new(BackingKind::PrivateAnon, 8 * MIB).unwrap();
    assert_eq!(smaps_field(lazy.hva().0, "Rss"), 0);
}

#[test]
fn dropping_a_backing_unmaps_it() {
    let b = Backing::new(BackingKind::PrivateAnon, 2 * MIB).unwrap();
    let addr = b.hva().0;
    drop(b);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let gone = !maps.lines().any(|l| l.starts_with(&format!("{addr:x}-")));
    assert!(gone, "mapping at {addr:#x} still present after drop");
}

#[test]
fn memfd_content_is_visible_through_a_second_mapping_of_its_fd() {
    let b = Backing::new(BackingKind::Memfd, 2 * MIB).unwrap();
    b.write(MIB + 5, b"through the fd").unwrap();
    let fd = b.fd().unwrap().as_raw_fd();
    let len = 2 * MIB as usize;
    // SAFETY: a new shared mapping of a live memfd we hold; unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let mut seen = [0u8; 14];
    // SAFETY: p..p+len is our second mapping; the range read is inside it.
    unsafe {
        std::ptr::copy_nonoverlapping(p.cast::<u8>().add(MIB as usize + 5), seen.as_mut_ptr(), 14)
    };
    assert_eq!(&seen, b"through the fd");
    // and writes through the second mapping show up in the backing
    // SAFETY: as above.
    unsafe { p.cast::<u8>().write(0xab) };
    let mut first = [0u8];
    b.read(0, &mut first).unwrap();
    assert_eq!(first[0], 0xab);
    // SAFETY: unmapping our own second mapping.
    unsafe { libc::munmap(p, len) };
}

#[test]
fn private_file_mappings_keep_writes_to_themselves() {
    let path = temp_path("private");
    std::fs::write(&path, vec![1u8; 4096]).unwrap();
    let b = Backing::new(
        BackingKind::File {
            path: path.clone(),
            shared: false,
        },
        MIB,
    )
    .unwrap();
    assert!(!b.is_shared());
    b.write(0, &[9; 16]).unwrap();
    let mut out = [0; 16];
    b.read(0, &mut out).unwrap();
    assert_eq!(out, [9; 16]);
    drop(b);
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(
        on_disk.len() as u64,
        MIB,
        "file extended to the backing size"
    );
    assert_eq!(
        on_disk[..16],
        [1; 16],
        "private writes never reach the file"
    );
    std::fs::remove_file(path).unwrap();
}

#[test]
fn thp_backing_gets_huge_pages_when_the_kernel_allows() {
    let b = Backing::with_options(
        BackingKind::Thp,
        8 * MIB,
        &BackingOptions {
            populate: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        b.page_size(),
        PageSize::Size4K,
        "THP may be split: 4 KiB is the guarantee"
    );
    assert_eq!(b.huge_page_size(), Some(PageSize::Size2M));
    let mode =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if mode.contains("[never]") || mode.is_empty() {
        common::skipped(&format!(
            "the AnonHugePages check: THP is disabled here ({})",
            mode.trim()
        ));
        return;
    }
    let huge = smaps_field(b.hva().0, "AnonHugePages");
    assert!(
        huge >= 2048,
        "THP backing got {huge} KiB of huge pages (THP mode {})",
        mode.trim()
    );
}

/// All hugetlbfs checks in one test: they adjust the machine-wide pool, so they run in order.
#[test]
fn hugetlb_backings() {
    // Without enough free pages: a typed error that says how to reserve them.
    match free_huge_pages(PageSize::Size2M) {
        Ok(free) => {
            let e = Backing::new(BackingKind::Hugetlb(PageSize::Size2M), (free + 1) * 2 * MIB)
                .unwrap_err();
            assert_eq!(e.errno(), libc::ENOMEM);
            let msg = e.to_string();
            assert!(
                msg.contains(&format!("need {}", free + 1)) && msg.contains("nr_hugepages"),
                "{msg}"
            );
        }
        Err(e) => {
            common::skipped(&format!("hugetlb_backings: {e}"));
            return;
        }
    }
    assert_eq!(
        Backing::new(BackingKind::Hugetlb(PageSize::Size4K), MIB)
            .unwrap_err()
            .errno(),
        libc::EOPNOTSUPP
    );
    if !common::is_root() {
        common::skipped("hugetlb_backings: mapping huge pages: reserving them needs root");
        return;
    }
    for (page, count) in [(PageSize::Size2M, 3u64), (PageSize::Size1G, 1)] {
        let _pool = match HugePageReservation::add(page, count) {
            Ok(r) => r,
            Err(e) => {
                common::skipped(&format!("hugetlb_backings: {page} pages: {e}"));
                continue;
            }
        };
        let size = count * page.bytes();
        let b = Arc::new(Backing::new(BackingKind::Hugetlb(page), size).unwrap());
        assert_eq!(b.page_size(), page);
        assert!(b.is_shared() && b.fd().is_some());
        assert!(b.hva().is_aligned(page), "{:?} not {page} aligned", b.hva());
        round_trip(&b);
        assert_eq!(
            smaps_field(b.hva().0, "KernelPageSize"),
            page.bytes() / 1024
        );
        // a size that is not a whole number of huge pages is refused
        assert_eq!(
            Backing::new(BackingKind::Hugetlb(page), page.bytes() + 4096)
                .unwrap_err()
                .errno(),
            libc::EINVAL
        );
        // slots over huge pages must not split them
        let t = SlotTable::new();
        let e = t
            .insert(SlotSpec::new(0, Gpa(0), b.clone()).window(4096, page.bytes()))
            .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
        t.insert(SlotSpec::new(0, Gpa(0), b.clone()).window(0, page.bytes()))
            .unwrap();
    }
}
