//! Image formats: memvisor serves raw images only, so before it serves one it looks at the
//! image's first bytes for the header of a format that is not raw, and refuses such an image
//! unless the user said it is raw (`format=raw`).
//!
//! **Why.** A qcow2 (or VMDK, LUKS, ...) image served as raw bytes shows the guest the format's
//! metadata as its disk; the guest's first write to sector 0 destroys the header, and with it
//! the image. QEMU guards the same way: with no format given it probes, and an image it probed
//! as raw may not be written so that it would probe as something else.
//!
//! **What is looked for**: the fixed signatures of these formats, at the offsets QEMU's `probe`
//! functions read them (facts from QEMU's block/*.c and the formats' specifications). QEMU's
//! VMDK probe also takes a text descriptor whose first line is not the usual comment; that one
//! is not looked for here.
//!
//! | format    | signature                                                         |
//! |-----------|-------------------------------------------------------------------|
//! | qcow2     | `QFI\xfb` at 0, big-endian version ≥ 2 at 4 (version 1: qcow)     |
//! | qed       | `QED\0` at 0                                                      |
//! | vmdk      | `KDMV` or `COWD` at 0, or a text descriptor `# Disk DescriptorFile`|
//! | vhdx      | `vhdxfile` at 0                                                   |
//! | vdi       | little-endian 0xbeda107f at 0x40 (after the `<<< ... >>>` text)   |
//! | luks      | `LUKS\xba\xbe` at 0                                               |
//! | vpc       | `conectix` at 0                                                   |
//! | parallels | `WithoutFreeSpace` or `WithouFreSpacExt` at 0                     |
//! | bochs     | `Bochs Virtual HD Image` at 0                                     |
//! | cloop     | the `#!/bin/sh` / `#V2.0 Format` / `modprobe cloop` script at 0   |
//!
//! A raw image may begin with any bytes, so a raw image that happens to begin with one of
//! these is refused too; the user then says `format=raw`. The one format value taken is
//! `raw`: memvisor has no driver for any other.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::disk::AlignedBuf;

/// Bytes read from the start of the image: every signature above lies in the first 512; 4096
/// keeps the read aligned for any `O_DIRECT` file or block device.
pub const PROBE_BYTES: usize = 4096;

/// What the user said the image's format is (`format=`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FormatChoice {
    /// Nothing: look, and refuse an image that has another format's header.
    #[default]
    Probe,
    /// `format=raw`: serve the bytes as they are, whatever they begin with.
    Raw,
}

impl std::str::FromStr for FormatChoice {
    type Err = FormatError;

    fn from_str(s: &str) -> Result<FormatChoice, FormatError> {
        match s {
            "raw" => Ok(FormatChoice::Raw),
            other => Err(FormatError::NotRaw(other.to_string())),
        }
    }
}

/// Why an image is not served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    /// The image begins with a format's header and the user did not say `format=raw` (EINVAL).
    #[error(
        "{}: the image is in {format} format (its header says so); memvisor serves raw images \
         only: convert it (qemu-img convert -f {format} -O raw), or if it really is raw, \
         say format=raw",
        image.display()
    )]
    Formatted {
        /// The image.
        image: PathBuf,
        /// The format found (QEMU's driver name).
        format: &'static str,
    },
    /// `format=` named something other than `raw` (EINVAL).
    #[error("format={0:?}: memvisor serves raw images only; leave format= out or say format=raw")]
    NotRaw(String),
    /// The image's first bytes could not be read.
    #[error("{}: cannot read the image's first bytes: {source}", image.display())]
    Read {
        /// The image.
        image: PathBuf,
        /// What the read said.
        source: std::io::Error,
    },
}

impl FormatError {
    /// The errno: EINVAL for a format or a value refused, the read's own otherwise.
    pub fn errno(&self) -> i32 {
        match self {
            FormatError::Formatted { .. } | FormatError::NotRaw(_) => libc::EINVAL,
            FormatError::Read { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// The format whose header `head` (an image's first bytes) begins with, if any.
pub fn probe(head: &[u8]) -> Option<&'static str> {
    let at = |offset: usize, sig: &[u8]| head.get(offset..offset + sig.len()) == Some(sig);
    let be32 = |offset: usize| {
        head.get(offset..offset + 4)
            .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    };
    if at(0, b"QFI\xfb") {
        return Some(match be32(4) {
            Some(1) => "qcow",
            _ => "qcow2",
        });
    }
    if at(0x40, &0xbeda_107f_u32.to_le_bytes()) {
        return Some("vdi");
    }
    let signatures: [(&[u8], &'static str); 11] = [
        (b"QED\0", "qed"),
        (b"KDMV", "vmdk"),
        (b"COWD", "vmdk"),
        (b"# Disk DescriptorFile", "vmdk"),
        (b"vhdxfile", "vhdx"),
        (b"LUKS\xba\xbe", "luks"),
        (b"conectix", "vpc"),
        (b"WithoutFreeSpace", "parallels"),
        (b"WithouFreSpacExt", "parallels"),
        (b"Bochs Virtual HD Image", "bochs"),
        (b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0", "cloop"),
    ];
    signatures
        .iter()
        .find(|(sig, _)| at(0, sig))
        .map(|(_, name)| *name)
}

/// Checks the image `file` (at `image`, for messages) is one memvisor may serve as raw bytes:
/// with [`FormatChoice::Raw`] any is; otherwise its first bytes must carry no other format's
/// header. Works on files opened `O_DIRECT` (the read is aligned).
pub fn check(file: &File, image: &Path, choice: FormatChoice) -> Result<(), FormatError> {
    if choice == FormatChoice::Raw {
        return Ok(());
    }
    let read = |source| FormatError::Read {
        image: image.to_path_buf(),
        source,
    };
    let mut buf = AlignedBuf::new(PROBE_BYTES, PROBE_BYTES)
        .ok_or_else(|| read(std::io::ErrorKind::OutOfMemory.into()))?;
    let head = buf.as_mut_slice();
    let mut got = 0;
    // A short image is read whole; O_DIRECT reads end at its last byte.
    while got < head.len() {
        match file.read_at(&mut head[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(read(e)),
        }
        // O_DIRECT moves whole blocks; a short read means the end of the image.
        if got % 512 != 0 {
            break;
        }
    }
    match probe(&head[..got]) {
        None => Ok(()),
        Some(format) => Err(FormatError::Formatted {
            image: image.to_path_buf(),
            format,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first bytes of a qcow2 image as `qemu-img create -f qcow2` writes them (version 3,
    /// 64 KiB clusters, 1 GiB): built here from the specification's header layout.
    fn qcow2_header() -> Vec<u8> {
        let mut h = vec![0u8; 512];
        h[0..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes()); // version
        h[20..24].copy_from_slice(&16u32.to_be_bytes()); // cluster_bits
        h[24..32].copy_from_slice(&(1u64 << 30).to_be_bytes()); // size
        h[100..104].copy_from_slice(&104u32.to_be_bytes()); // header_length
        h
    }

    #[test]
    fn finds_each_format_by_its_header() {
        assert_eq!(probe(&qcow2_header()), Some("qcow2"));
        let mut v1 = qcow2_header();
        v1[4..8].copy_from_slice(&1u32.to_be_bytes());
        assert_eq!(probe(&v1), Some("qcow"));
        let mut vdi = b"<<< Oracle VM VirtualBox Disk Image >>>\n".to_vec();
        vdi.resize(0x200, 0);
        vdi[0x40..0x44].copy_from_slice(&0xbeda107fu32.to_le_bytes());
        assert_eq!(probe(&vdi), Some("vdi"));
        for (head, name) in [
            (&b"QED\0\x00\x00\x01\x00"[..], "qed"),
            (b"KDMV\x01\x00\x00\x00", "vmdk"),
            (b"# Disk DescriptorFile\nversion=1\n", "vmdk"),
            (b"vhdxfile\0\0\0\0", "vhdx"),
            (b"LUKS\xba\xbe\x00\x02", "luks"),
            (b"Bochs Virtual HD Image\0\0Redolog\0", "bochs"),
            (
                b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660",
                "cloop",
            ),
            (b"conectix\0\0\0\x02", "vpc"),
            (b"WithoutFreeSpace\x02\0\0\0", "parallels"),
        ] {
            assert_eq!(probe(head), Some(name), "{name}");
        }
    }

    #[test]
    fn raw_bytes_are_raw() {
        assert_eq!(probe(&[0u8; 4096]), None);
        assert_eq!(probe(&[]), None);
        // A signature cut short by the image's end is no signature.
        assert_eq!(probe(b"QFI"), None);
        // An MBR or a file system is raw to QEMU as well.
        let mut mbr = vec![0u8; 512];
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        assert_eq!(probe(&mbr), None);
    }

    fn memfd_with(bytes: &[u8]) -> File {
        // SAFETY: the name is a NUL-terminated literal; the result is checked.
        let fd = unsafe { libc::memfd_create(c"image".as_ptr(), 0) };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fd was just made and is owned by nothing else.
        let f = unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        f.write_all_at(bytes, 0).unwrap();
        f
    }

    #[test]
    fn a_qcow2_image_is_refused_unless_said_raw() {
        let mut bytes = qcow2_header();
        bytes.resize(1 << 20, 0);
        let f = memfd_with(&bytes);
        let e = check(&f, Path::new("vm.qcow2"), FormatChoice::Probe).unwrap_err();
        assert!(
            matches!(
                e,
                FormatError::Formatted {
                    format: "qcow2",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(e.errno(), libc::EINVAL);
        let text = e.to_string();
        assert!(
            text.starts_with("vm.qcow2: the image is in qcow2 format"),
            "{text}"
        );
        assert!(text.contains("format=raw"), "{text}");
        check(&f, Path::new("vm.qcow2"), FormatChoice::Raw).unwrap();
    }

    #[test]
    fn a_zeroed_image_and_a_short_one_pass() {
        check(
            &memfd_with(&[0u8; 8192]),
            Path::new("z"),
            FormatChoice::Probe,
        )
        .unwrap();
        check(
            &memfd_with(&[7u8; 100]),
            Path::new("s"),
            FormatChoice::Probe,
        )
        .unwrap();
        check(&memfd_with(&[]), Path::new("e"), FormatChoice::Probe).unwrap();
    }

    #[test]
    fn only_raw_is_a_format() {
        assert_eq!("raw".parse::<FormatChoice>().unwrap(), FormatChoice::Raw);
        let e = "qcow2".parse::<FormatChoice>().unwrap_err();
        assert!(e.to_string().starts_with("format=\"qcow2\""), "{e}");
    }
}
