//! The vfio-user side of the test kit: a client to drive a server with, and a hostile one.

pub mod client;
pub mod fuzz;
