//! The vhost-user side of the test kit: a frontend to drive a back end with, a hostile one,
//! and the IOTLB recording a back end writes and the benchmark replays.

pub mod client;
pub mod fuzz;
pub mod record;
