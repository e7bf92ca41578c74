//! Raw copies between caller buffers and guest memory.
//!
//! Guest memory is shared: the guest's vCPUs, devices and other processes (vhost-user back ends)
//! may write it at any moment. A Rust reference (`&[u8]` / `&mut [u8]`) promises the compiler that
//! no one else changes the bytes while it lives, so memvisor never builds one over guest memory.
//! Every byte that crosses between a caller's buffer and guest memory goes through the three
//! functions here, which copy with raw pointers (`ptr::copy*`, the same opaque memcpy/memmove the
//! kernel's `copy_{to,from}_user` amount to). A racing writer can make the copied bytes any mix
//! of old and new values — which is exactly the semantics of a DMA read — but cannot make the
//! program misbehave. Callers check bounds and keep the memory mapped; these functions only copy.

use std::ptr;

/// Copies `dst.len()` bytes from guest memory at `src` into `dst`.
///
/// # Safety
/// `src .. src + dst.len()` must be mapped readable for the whole call, and must not overlap
/// `dst` (a caller buffer is never guest memory).
#[inline]
pub(crate) unsafe fn from_guest(src: *const u8, dst: &mut [u8]) {
    // SAFETY: the caller guarantees `src` is readable for `dst.len()` bytes and disjoint from
    // `dst`; `dst` is a valid exclusive buffer of that length.
    unsafe { ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) }
}

/// Copies `src` into guest memory at `dst`.
///
/// # Safety
/// `dst .. dst + src.len()` must be mapped writable for the whole call, and must not overlap
/// `src`.
#[inline]
pub(crate) unsafe fn to_guest(src: &[u8], dst: *mut u8) {
    // SAFETY: the caller guarantees `dst` is writable for `src.len()` bytes and disjoint from
    // `src`, which is a valid buffer of that length.
    unsafe { ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) }
}

/// Copies `len` bytes inside guest memory; the two ranges may overlap.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes for the whole call.
#[inline]
pub(crate) unsafe fn within_guest(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller guarantees both ranges are mapped; `ptr::copy` allows overlap.
    unsafe { ptr::copy(src, dst, len) }
}
