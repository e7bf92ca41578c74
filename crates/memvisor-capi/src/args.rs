//! Checking what C passed: handles, out pointers, buffers and arrays.
//!
//! C gives raw pointers and lengths; Rust needs references and slices. Every conversion is
//! here, after the checks C cannot do for itself: NULL where a pointer is required and lengths
//! no Rust slice can have (past `isize::MAX` bytes) are -EINVAL with a message naming the
//! argument. What no check can see — a dangling pointer, a handle already freed, a buffer
//! shorter than its length — is the caller's promise, written in include/memvisor.h.
//!
//! The buffers made into slices here are the caller's own (`buf` of a read or write, arrays of
//! page numbers or ranges), never guest memory: memvisor reaches guest memory only through its
//! own copies.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::last_error::Failure;

/// `p` as a reference to a live handle.
///
/// # Safety
/// `p` is NULL or a handle this library made and has not freed, not used mutably elsewhere
/// for `'a`.
pub(crate) unsafe fn handle<'a, T>(p: *const T, what: &str) -> Result<&'a T, Failure> {
    // SAFETY: non-NULL `p` is a live handle (the caller's promise above).
    unsafe { p.as_ref() }.ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// `p` as an exclusive reference to a live handle (a cursor, used by one thread at a time).
///
/// # Safety
/// As for [`handle`], and nothing else uses the handle during `'a`.
pub(crate) unsafe fn handle_mut<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    // SAFETY: non-NULL `p` is a live handle used by this thread alone (the caller's promise).
    unsafe { p.as_mut() }.ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// A required out pointer, checked before any work so a NULL one changes nothing.
pub(crate) fn out<T>(p: *mut T, what: &str) -> Result<NonNull<T>, Failure> {
    NonNull::new(p).ok_or_else(|| Failure::invalid(format!("{what} is NULL")))
}

/// Writes `value` through a checked out pointer.
///
/// # Safety
/// `p` points at writable memory for one `T` (the caller's promise).
pub(crate) unsafe fn put<T>(p: NonNull<T>, value: T) {
    // SAFETY: `p` is non-NULL and writable (the caller's promise); `write` drops no old value.
    unsafe { p.as_ptr().write(value) }
}

/// Writes `value` through an optional out pointer (NULL: the caller does not want it).
///
/// # Safety
/// `p` is NULL or points at writable memory for one `T`.
pub(crate) unsafe fn put_opt<T>(p: *mut T, value: T) {
    if let Some(p) = NonNull::new(p) {
        // SAFETY: as this function's contract.
        unsafe { put(p, value) }
    }
}

/// Refuses a count no slice of `T` can have.
fn check_len<T>(len: usize, what: &str) -> Result<(), Failure> {
    let bytes = len.checked_mul(size_of::<T>().max(1));
    match bytes {
        Some(b) if b <= isize::MAX as usize => Ok(()),
        _ => Err(Failure::invalid(format!(
            "{what} {len} is too large (the buffer would pass isize::MAX bytes)"
        ))),
    }
}

/// `len` elements at `p` to read; `p` may be NULL only when `len` is 0.
///
/// # Safety
/// When `len` > 0, `p` points at `len` initialised `T` that nothing changes during `'a`.
pub(crate) unsafe fn array<'a, T>(
    p: *const T,
    len: usize,
    what: &str,
    len_name: &str,
) -> Result<&'a [T], Failure> {
    check_len::<T>(len, len_name)?;
    if len == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Failure::invalid(format!(
            "{what} is NULL with {len_name} {len}"
        )));
    }
    // SAFETY: non-NULL, `len` elements the caller owns and does not change (this function's
    // contract); the length fits a slice (checked above).
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// `len` elements at `p` to write; `p` may be NULL only when `len` is 0.
///
/// # Safety
/// When `len` > 0, `p` points at `len` writable `T` that nothing else reads or writes during
/// `'a`.
pub(crate) unsafe fn array_mut<'a, T>(
    p: *mut T,
    len: usize,
    what: &str,
    len_name: &str,
) -> Result<&'a mut [T], Failure> {
    check_len::<T>(len, len_name)?;
    if len == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Failure::invalid(format!(
            "{what} is NULL with {len_name} {len}"
        )));
    }
    // SAFETY: non-NULL, `len` writable elements the caller gives this call alone (this
    // function's contract); the length fits a slice (checked above).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// A byte buffer to read from.
///
/// # Safety
/// As for [`array`].
pub(crate) unsafe fn bytes<'a>(
    p: *const c_void,
    len: usize,
    what: &str,
) -> Result<&'a [u8], Failure> {
    // SAFETY: as this function's contract.
    unsafe { array(p.cast::<u8>(), len, what, "len") }
}

/// A byte buffer to write into.
///
/// # Safety
/// As for [`array_mut`].
pub(crate) unsafe fn bytes_mut<'a>(
    p: *mut c_void,
    len: usize,
    what: &str,
) -> Result<&'a mut [u8], Failure> {
    // SAFETY: as this function's contract.
    unsafe { array_mut(p.cast::<u8>(), len, what, "len") }
}

/// Takes back a handle made by `Box::into_raw` (NULL: nothing).
///
/// # Safety
/// `p` is NULL or a handle of type `T` this library made and that is not used again.
pub(crate) unsafe fn free<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: `p` came from `Box::into_raw` and is given back once (the contract).
        drop(unsafe { Box::from_raw(p) });
    }
}

/// Hands a new handle to C.
pub(crate) fn into_handle<T>(value: T) -> *mut T {
    Box::into_raw(Box::new(value))
}
