//! Library half of the `memvisor` command line. The binary (`src/main.rs`) only parses arguments
//! and prints; everything it runs lives here so that experiments, the report writer and their
//! tests are ordinary public items of one crate rather than dead code in a binary.
//!
//! The servers (`serve`) follow the vhost-user specification's back end conventions: where
//! their socket comes from (`listener`: a path, `--fd`, systemd socket activation), readiness
//! (`notify`: sd_notify), `--print-capabilities` (`capabilities`) and the log (`logging`:
//! `RUST_LOG`).

pub mod bench;
pub mod capabilities;
pub mod listener;
pub mod logging;
pub mod notify;
pub mod serve;
