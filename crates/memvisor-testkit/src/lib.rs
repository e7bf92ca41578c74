//! memvisor's test kit: the lab's side of the protocols, never linked into the server.
//!
//! The product crates hold only what a deployed back end runs. What tests, fuzzing, the
//! benchmark and the real-guest trials need to drive them lives here:
//!
//! * [`vhost`]: a minimal vhost-user frontend ([`vhost::client`]) for tests and by-hand use, a
//!   hostile one ([`vhost::fuzz`], `memvisor-testkit vhost-user-fuzz`), and the IOTLB recording
//!   ([`vhost::record`]): its text format, the parser the benchmark replays from and, with the
//!   `test-hooks` feature, the recorder a back end writes it with.
//! * [`vfio_user`]: a minimal vfio-user client ([`vfio_user::client`]) and a hostile one
//!   ([`vfio_user::fuzz`], `memvisor-testkit vfio-user-fuzz`).
//! * [`guest_ring`]: a guest's side of a split virtqueue over a slot table, well-formed chains
//!   and hostile ones, for device tests without a guest.
//!
//! The binaries: `memvisor-testkit` runs the hostile clients against a live server (the
//! trials' `--after-fuzz`), `memvisor-faultfs` is the disk-fault trial's failing FUSE file.

#![cfg(target_os = "linux")]

pub mod guest_ring;
pub mod vfio_user;
pub mod vhost;
