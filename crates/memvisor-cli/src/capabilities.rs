//! `--print-capabilities`: what each server tells management software (libvirt) about itself,
//! in the JSON of the vhost-user specification's `VHostUserBackendCapabilities`
//! (docs/interop/vhost-user.json in QEMU): one object, `{"type": ..., "features": [...]}`.
//!
//! The model: a feature is listed only when the command line option it names in the schema
//! exists and works here. `vhost-user-blk` is a back end of type `block` with `--read-only` and
//! `--blk-file` (an alias of `--disk`). `serve` hosts block devices and balloons in one process;
//! the schema's object has one type, so it says `block` — what management software would run
//! it for, the balloon being an addition it can also host — with no features (its disks take
//! `read-only=` and `disk=` per device, not the schema's `--read-only` and `--blk-file`).
//! `vfio-user` has no schema in the vfio-user specification (its conventions say only that a
//! JSON file must come with the back end); it prints the same shape with `"type":
//! "vfio-user"` and the device it serves.
//!
//! **Before parsing.** The specification says a back end given `--print-capabilities` ignores
//! every other option and argument. So [`requested`] looks for it in the raw arguments, before
//! clap sees them: an unknown option, a stray argument, `--queues 0`, or `--socket-path` with
//! `--fd` next to it changes nothing. And a JSON descriptor's `binary` gets no arguments of its
//! own, so the program's name can stand for the subcommand ([`server_named`]):
//! `memvisor-vhost-user-blk` and `memvisor-vfio-user`, links to `memvisor`.

use std::ffi::OsString;
use std::path::Path;

use serde_json::{Value, json};

/// The program names that stand for a subcommand, and the subcommand.
pub const SERVER_NAMES: [(&str, &str); 3] = [
    ("memvisor-vhost-user-blk", "vhost-user-blk"),
    ("memvisor-serve", "serve"),
    ("memvisor-vfio-user", "vfio-user"),
];

/// `argv` with the subcommand its program name stands for put in after it (unchanged for
/// `memvisor` or any other name).
pub fn server_named(mut argv: Vec<OsString>) -> Vec<OsString> {
    let name = argv
        .first()
        .and_then(|a| Path::new(a).file_name())
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    if let Some((_, sub)) = SERVER_NAMES.iter().find(|(n, _)| *n == name) {
        argv.insert(1, OsString::from(sub));
    }
    argv
}

/// The capabilities to print if `argv` (program, subcommand, arguments) runs a server with
/// `--print-capabilities` among its arguments, whatever else they hold; `None` otherwise.
pub fn requested(argv: &[OsString]) -> Option<Value> {
    let sub = argv.get(1)?.to_str()?;
    let caps = match sub {
        "vhost-user-blk" => vhost_user_blk(),
        "serve" => serve(),
        "vfio-user" => vfio_user(),
        _ => return None,
    };
    argv[2..]
        .iter()
        .any(|a| a == "--print-capabilities")
        .then_some(caps)
}

/// `memvisor vhost-user-blk --print-capabilities`.
pub fn vhost_user_blk() -> Value {
    json!({ "type": "block", "features": ["read-only", "blk-file"] })
}

/// `memvisor serve --print-capabilities` (the module documentation says why `block`).
pub fn serve() -> Value {
    json!({ "type": "block", "features": [] })
}

/// `memvisor vfio-user --print-capabilities`.
pub fn vfio_user() -> Value {
    json!({ "type": "vfio-user", "device": "mvdma", "features": [] })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_program_name_stands_for_its_server_and_only_those_do() {
        let got = server_named(args(&["/usr/libexec/memvisor-vhost-user-blk", "--fd=3"]));
        assert_eq!(
            got,
            args(&[
                "/usr/libexec/memvisor-vhost-user-blk",
                "vhost-user-blk",
                "--fd=3"
            ])
        );
        let got = server_named(args(&["memvisor-vfio-user"]));
        assert_eq!(got, args(&["memvisor-vfio-user", "vfio-user"]));
        for plain in [
            "memvisor",
            "/usr/bin/memvisor",
            "vhost-user-blk",
            "memvisor-ctl",
        ] {
            assert_eq!(server_named(args(&[plain, "x"])), args(&[plain, "x"]));
        }
    }

    #[test]
    fn print_capabilities_is_found_among_anything_but_only_for_a_server() {
        let caps = requested(&args(&[
            "m",
            "vhost-user-blk",
            "--bogus",
            "--print-capabilities",
        ]));
        assert_eq!(caps, Some(vhost_user_blk()));
        assert_eq!(
            requested(&args(&["m", "vhost-user-blk", "--disk", "x"])),
            None
        );
        assert_eq!(
            requested(&args(&["m", "ctl", "--print-capabilities"])),
            None
        );
        assert_eq!(requested(&args(&["m", "--print-capabilities"])), None);
    }
}
