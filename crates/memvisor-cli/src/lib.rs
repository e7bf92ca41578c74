//! Library half of the `memvisor` command line. The binary (`src/main.rs`) only parses arguments
//! and prints; everything it runs lives here so that experiments, the report writer and their
//! tests are ordinary public items of one crate rather than dead code in a binary.

pub mod bench;
pub mod serve;
