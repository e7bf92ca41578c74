//! QEMU's image locks between disks of memvisor on one image file: each disk opens the file
//! itself (its own open file description, as a second program would) and locks it as a disk
//! served to a guest does. A second writer is refused, two readers go together, a reader and
//! a writer refuse each other in either order, and a disk's locks go with its file.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memvisor_vhost::disk::Disk;
use memvisor_vhost::image_lock::{self, Access, Conflict, LockError, Locked, Locking, Permission};

struct Image(PathBuf);

impl Image {
    fn new(name: &str) -> Image {
        let p = std::env::temp_dir().join(format!(
            "memvisor-image-lock-{name}-{}.img",
            std::process::id()
        ));
        std::fs::write(&p, vec![0u8; 1 << 20]).unwrap();
        Image(p)
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Opens the image as a disk does and takes its locks; the disk holds the file.
fn disk(p: &Path, read_only: bool, locking: Locking) -> Result<Disk, LockError> {
    let file: File = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(p)
        .unwrap();
    image_lock::lock(&file, p, Access::disk(read_only), locking)?;
    Ok(Disk::new(file).unwrap())
}

fn conflict(e: LockError) -> (Permission, Conflict) {
    match e {
        LockError::Conflict {
            permission,
            conflict,
            ..
        } => (permission, conflict),
        other => panic!("not a conflict: {other}"),
    }
}

#[test]
fn a_second_writer_is_refused_until_the_first_disk_is_dropped() {
    let img = Image::new("writers");
    let first = disk(&img.0, false, Locking::Auto).unwrap();
    let e = disk(&img.0, false, Locking::Auto).unwrap_err();
    let text = e.to_string();
    assert_eq!(
        conflict(e),
        (Permission::Write, Conflict::NotShared),
        "{text}"
    );
    assert!(text.starts_with(&format!(
        "{}: cannot take the \"write\" lock: another process",
        img.0.display()
    )));
    // The locks belong to the open file: dropping the disk closes it and frees the image.
    drop(first);
    let again = disk(&img.0, false, Locking::On).unwrap();
    drop(again);
}

#[test]
fn two_readers_share_the_image() {
    let img = Image::new("readers");
    let a = disk(&img.0, true, Locking::On).unwrap();
    let b = disk(&img.0, true, Locking::On).unwrap();
    drop((a, b));
}

#[test]
fn a_reader_and_a_writer_refuse_each_other_in_either_order() {
    let img = Image::new("reader-writer");
    // A reader first: it shares reading, not writing, so a writer cannot come.
    let reader = disk(&img.0, true, Locking::Auto).unwrap();
    let e = disk(&img.0, false, Locking::Auto).unwrap_err();
    assert_eq!(conflict(e), (Permission::Write, Conflict::NotShared));
    drop(reader);
    // A writer first: a reader would have to let it write, which a reader here refuses.
    let writer = disk(&img.0, false, Locking::Auto).unwrap();
    let e = disk(&img.0, true, Locking::Auto).unwrap_err();
    let text = e.to_string();
    assert_eq!(conflict(e), (Permission::Write, Conflict::Held), "{text}");
    assert!(
        text.contains("cannot take the shared \"write\" lock") && text.contains("for writing"),
        "{text}"
    );
    drop(writer);
}

#[test]
fn locking_off_neither_takes_nor_checks() {
    let img = Image::new("off");
    let writer = disk(&img.0, false, Locking::Auto).unwrap();
    // Off goes beside a writer; a later writer with locks still sees only the first.
    let off = disk(&img.0, false, Locking::Off).unwrap();
    drop(writer);
    let on = disk(&img.0, false, Locking::On).unwrap();
    drop((off, on));
    // What `lock` reports for off.
    let f = File::open(&img.0).unwrap();
    assert_eq!(
        image_lock::lock(&f, &img.0, Access::disk(true), Locking::Off).unwrap(),
        Locked::Off
    );
}
