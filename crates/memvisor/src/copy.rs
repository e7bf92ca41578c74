//! Raw copies between caller buffers and guest memory.
//!
//! Guest memory is shared: the guest's vCPUs, devices and other processes (vhost-user back ends)
//! may write it at any moment. A Rust reference (`&[u8]` / `&mut [u8]`) promises the compiler that
//! no one else changes the bytes while it lives, so memvisor never builds one over guest memory.
//! Plain `ptr::copy` is not enough either: in Rust's memory model a non-atomic access that races
//! another thread's write is undefined behaviour, whatever the hardware does. Every byte that
//! crosses between a caller's buffer and guest memory goes through the three functions here,
//! which copy in a way the compiler must treat as a device access:
//!
//! * on x86-64, one `rep movsb` in inline assembly. The compiler sees an opaque instruction that
//!   reads and writes memory, as the kernel's `copy_{to,from}_user` are; it cannot assume the
//!   bytes stay put, tear them into a race it may exploit, or read them twice. On CPUs with fast
//!   string moves (ERMS / FSRM, every x86-64 server of the last decade) it runs at memcpy speed
//!   from a few dozen bytes up.
//! * elsewhere, volatile loads and stores a `u64` at a time where both sides are aligned, as
//!   vm-memory does, and a byte at a time for the rest.
//!
//! A racing writer can make the copied bytes any mix of old and new values — exactly the
//! semantics of a DMA read — but cannot make the program misbehave. Callers check bounds and keep
//! the memory mapped; these functions only copy.

/// Copies `dst.len()` bytes from guest memory at `src` into `dst`.
///
/// # Safety
/// `src .. src + dst.len()` must be mapped readable for the whole call, and must not overlap
/// `dst` (a caller buffer is never guest memory).
#[inline]
pub(crate) unsafe fn from_guest(src: *const u8, dst: &mut [u8]) {
    // SAFETY: the caller guarantees `src` is readable for `dst.len()` bytes and disjoint from
    // `dst`; `dst` is a valid exclusive buffer of that length.
    unsafe { forward(src, dst.as_mut_ptr(), dst.len()) }
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
    unsafe { forward(src.as_ptr(), dst, src.len()) }
}

/// Copies `len` bytes inside guest memory; the two ranges may overlap.
///
/// # Safety
/// `src` must be readable and `dst` writable for `len` bytes for the whole call.
pub(crate) unsafe fn within_guest(src: *const u8, dst: *mut u8, len: usize) {
    let (s, d) = (src as usize, dst as usize);
    if d <= s || d >= s.saturating_add(len) {
        // SAFETY: as the caller guarantees; a forward copy reads every source byte before the
        // destination can reach it when dst is below src or past its end.
        return unsafe { forward(src, dst, len) };
    }
    // dst overlaps the source from above: move chunks from the end down through a buffer of our
    // own, so every source chunk is read before a destination chunk covers it.
    let mut buf = [0u8; 4096];
    let mut end = len;
    while end > 0 {
        let n = end.min(buf.len());
        let at = end - n;
        // SAFETY: `at + n <= len`, inside both caller-guaranteed ranges; `buf` is our own.
        unsafe {
            forward(src.add(at), buf.as_mut_ptr(), n);
            forward(buf.as_ptr(), dst.add(at), n);
        }
        end = at;
    }
}

/// Copies `len` bytes from `src` to `dst`, lowest address first.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes; if they overlap, `dst <= src`.
#[cfg(target_arch = "x86_64")]
#[inline]
unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: `rep movsb` copies rcx bytes from [rsi] to [rdi] upwards (the direction flag is
    // clear on entry to inline assembly, as Rust requires); the caller guarantees both ranges.
    // It touches no stack and leaves the flags alone.
    unsafe {
        std::arch::asm!(
            "rep movsb",
            inout("rcx") len => _,
            inout("rsi") src => _,
            inout("rdi") dst => _,
            options(nostack, preserves_flags)
        );
    }
}

/// Copies `len` bytes from `src` to `dst`, lowest address first.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes; if they overlap, `dst <= src`.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
    let mut i = 0;
    const W: usize = std::mem::size_of::<u64>();
    if (src as usize) % W == (dst as usize) % W {
        while i < len && (src as usize + i) % W != 0 {
            // SAFETY: i < len, inside both ranges.
            unsafe { dst.add(i).write_volatile(src.add(i).read_volatile()) };
            i += 1;
        }
        while i + W <= len {
            // SAFETY: both addresses are 8-byte aligned here and the word lies inside both ranges.
            unsafe {
                let w = src.add(i).cast::<u64>().read_volatile();
                dst.add(i).cast::<u64>().write_volatile(w);
            }
            i += W;
        }
    }
    while i < len {
        // SAFETY: i < len, inside both ranges.
        unsafe { dst.add(i).write_volatile(src.add(i).read_volatile()) };
        i += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_every_length_and_offset() {
        let src: Vec<u8> = (0..300u32).map(|i| (i * 7 + 1) as u8).collect();
        for len in [0usize, 1, 7, 8, 9, 63, 64, 65, 200] {
            for off in 0..8 {
                let mut dst = vec![0u8; 300];
                // SAFETY: both buffers are ours and long enough.
                unsafe { from_guest(src.as_ptr().add(off), &mut dst[off..off + len]) };
                assert_eq!(&dst[off..off + len], &src[off..off + len]);
                assert!(dst[..off].iter().all(|&b| b == 0));
                assert!(dst[off + len..].iter().all(|&b| b == 0));
            }
        }
    }

    #[test]
    fn overlapping_moves_either_way_match_memmove() {
        for (from, to, len) in [
            (0usize, 3usize, 9000usize),
            (3, 0, 9000),
            (0, 4096, 5000),
            (10, 10, 50),
        ] {
            let mut a: Vec<u8> = (0..10000u32).map(|i| (i % 251) as u8).collect();
            let mut want = a.clone();
            want.copy_within(from..from + len, to);
            let p = a.as_mut_ptr();
            // SAFETY: both ranges lie inside `a`, which nothing else uses.
            unsafe { within_guest(p.add(from), p.add(to), len) };
            assert!(a == want, "from {from} to {to} len {len}");
        }
    }
}
