//! memvisor's C API: `libmemvisor.so`, `libmemvisor.a` and `include/memvisor.h`.
//!
//! The model: every memvisor object a C program holds is an opaque handle, a `Box` of the Rust
//! object turned into a pointer (`memvisor_backing`, `memvisor_slots`, `memvisor_dma`,
//! `memvisor_cursor`, `memvisor_sg`, `memvisor_discarder`). A constructor writes a new handle
//! through an out pointer; the matching `*_free` (or `memvisor_sg_release`) takes it back.
//! Handles name shared objects, so freeing one never pulls memory from under another: a slot
//! table or a mapping keeps its backing mapped, a cursor keeps its space, as in Rust.
//!
//! Every fallible function returns 0 (or a count) on success and a negative errno on failure,
//! the errno [`memvisor::Error::errno`] gives (VFIO type1's or KVM's for the same mistake); the
//! message is kept per thread for [`api::memvisor_last_error`]. Bad arguments the C side alone
//! can get wrong (NULL pointers, unknown flag bits, lengths past `isize::MAX`) are refused with
//! -EINVAL and a message naming the argument. No panic crosses the boundary: each call runs
//! under `catch_unwind` and a panic becomes -EIO with its message.
//!
//! ```text
//! last_error  the thread's last message, and `call`, the wrapper every entry point runs in
//! args        checking C pointers and turning them into Rust references and slices
//! api         the exported functions, one per prototype of include/memvisor.h
//! ```
//!
//! `unsafe` lives in `args` (dereferencing what C passed) and `api` (taking handles back).
#![cfg(target_os = "linux")]

pub mod api;
mod args;
mod last_error;
