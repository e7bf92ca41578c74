//! A KVM test on a host without /dev/kvm passes, and must say "skipped: ..." where the test
//! runner shows it: libtest captures `println!` (and `eprintln!`) of a passing test and never
//! shows it, so a skip said that way looks like a pass.
//!
//! The check runs this binary's `needs_kvm` test again in a mount namespace whose /dev is an
//! empty tmpfs (needs root and `unshare`; skipped, visibly, without them), without
//! `--nocapture`, and looks for the skip in what the runner printed.

mod common;

use std::process::Command;

use common::*;

#[test]
fn needs_kvm() {
    let Some(_kvm) = kvm_or_skip("needs_kvm") else {
        return;
    };
}

#[test]
fn a_test_without_dev_kvm_says_skipped_where_the_runner_shows_it() {
    let exe = std::env::current_exe().expect("the test binary");
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            "mount -t tmpfs none /dev && exec \"$0\" --exact needs_kvm --test-threads 1",
        ])
        .arg(&exe)
        .output();
    let out = match out {
        Ok(out) if String::from_utf8_lossy(&out.stdout).contains("running 1 test") => out,
        other => {
            skipped(&format!(
                "a test without /dev/kvm: no mount namespace with an empty /dev (root and \
                 unshare needed): {other:?}"
            ));
            return;
        }
    };
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("skipped: needs_kvm: no /dev/kvm"),
        "a run without /dev/kvm passed and never said it skipped:\n{text}"
    );
}
