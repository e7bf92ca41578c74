//! Library half of the `memvisor` server binary. The binary (`src/main.rs`) only parses arguments
//! and prints; everything it runs lives here so that its tests reach it as ordinary public
//! items. The benchmark is the crate memvisor-bench and the test tools memvisor-testkit: what
//! ships is this crate, the library crates and their dependencies, nothing of the lab.
//!
//! The servers (`serve`) follow the vhost-user specification's back end conventions: where
//! their socket comes from (`listener`: a path, `--fd`, systemd socket activation), readiness
//! (`notify`: sd_notify), `--print-capabilities` (`capabilities`) and the log (`logging`:
//! `RUST_LOG`). What `serve` serves is read by `devices` (command line or configuration file);
//! a running server answers on its control socket (`control`, QMP) from its live counters
//! (`status`; the vfio-user server's in `vfio_status`), and adds, deletes and resizes devices
//! while it runs (`runtime`).

pub mod capabilities;
pub mod control;
pub mod devices;
pub mod listener;
pub mod logging;
pub mod metrics;
pub mod notify;
pub mod runtime;
pub mod serve;
pub mod status;
pub mod vfio_status;
