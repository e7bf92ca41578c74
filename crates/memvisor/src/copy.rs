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
//! * on x86-64, inline assembly, shaped like glibc's memcpy on the same CPU: up to 256 bytes,
//!   overlapping head and tail moves with every load before the first store; up to 2 KiB,
//!   128-byte blocks of 32-byte AVX moves (16-byte SSE2 moves on CPUs without AVX); from 2112
//!   bytes (glibc's threshold for CPUs with fast `rep movsb`), one `rep movsb` from a
//!   64-byte-aligned destination. The compiler sees opaque instructions that read and write
//!   memory, as the kernel's `copy_{to,from}_user` are; it cannot assume the bytes stay put,
//!   read them twice or tear them into a race it may exploit. Side by side with glibc's memcpy
//!   it is about as fast or faster from 256 bytes up, and somewhat slower at odd sizes between
//!   128 and 256 (figures: `docs/measurements.md`, "Guest copies").
//! * elsewhere, volatile loads and stores, a `u64` at a time where both sides are aligned, as
//!   vm-memory does for small copies, and a byte at a time for the rest.
//!
//! A copy of 2, 4 or 8 bytes is one move (on x86-64 always; elsewhere where both sides are
//! aligned): a naturally aligned value a guest writes at the same time, such as a split ring's
//! 16-bit available index, is read whole, old or new, never half of each.
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
    // `dst`, a valid exclusive buffer of that length.
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
    if d.saturating_add(len) <= s || s.saturating_add(len) <= d {
        // SAFETY: as the caller guarantees; the ranges are disjoint.
        return unsafe { forward(src, dst, len) };
    }
    if d < s {
        // SAFETY: as the caller guarantees; a byte-by-byte upward move reads every source byte
        // before the destination reaches it when dst is below src.
        return unsafe { upward_bytes(src, dst, len) };
    }
    // dst overlaps the source from above: move chunks from the end down through a buffer of our
    // own, so every source chunk is read before a destination chunk covers it.
    let mut buf = [0u8; 4096];
    let mut end = len;
    while end > 0 {
        let n = end.min(buf.len());
        let at = end - n;
        // SAFETY: `at + n <= len`, inside both caller-guaranteed ranges; `buf` is our own and
        // disjoint from both.
        unsafe {
            forward(src.add(at), buf.as_mut_ptr(), n);
            forward(buf.as_ptr(), dst.add(at), n);
        }
        end = at;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{forward, upward_bytes};

/// The x86-64 copies. Every function: `src` readable and `dst` writable for the bytes it
/// names, the two ranges disjoint (except `upward_bytes`, see there).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;

    /// Copies `len` bytes from `src` to `dst`, which do not overlap.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `len` bytes, disjoint.
    #[inline]
    pub(crate) unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: in every arm, each helper touches only bytes below `len` of both ranges (the
        // head and tail moves overlap each other, never the ends), which the caller
        // guarantees.
        unsafe {
            match len {
                2 => move_2(src, dst),
                0..=3 => upward_bytes(src, dst, len),
                4..=7 => head_tail_4(src, dst, len),
                8..=16 => head_tail_8(src, dst, len),
                17..=32 => head_tail_16(src, dst, len),
                33..=64 => head_tail_32(src, dst, len),
                65..=128 => head_tail_64(src, dst, len),
                129..=256 => {
                    block_128(src, dst);
                    block_128(src.add(len - 128), dst.add(len - 128));
                }
                257..REP_FROM if std::is_x86_feature_detected!("avx") => blocks_avx(src, dst, len),
                257..REP_FROM => {
                    let mut i = 0;
                    while i + 128 < len {
                        block_128(src.add(i), dst.add(i));
                        i += 128;
                    }
                    block_128(src.add(len - 128), dst.add(len - 128));
                }
                _ => {
                    // `rep movsb` runs at full speed only with a 64-byte-aligned destination:
                    // move the first 64 bytes with vector moves, then the rest from the first
                    // aligned destination byte (the two overlap by up to 63 bytes, which are
                    // read and written twice).
                    head_64(src, dst);
                    let skip = 64 - (dst as usize & 63);
                    upward_bytes(src.add(skip), dst.add(skip), len - skip);
                }
            }
        }
    }

    /// From this many bytes `rep movsb` is as fast as vector moves (glibc's threshold for CPUs
    /// with fast short `rep movsb`, 2112 bytes, which measurement here confirmed).
    const REP_FROM: usize = 2112;

    /// `rep movsb`: copies `len` bytes upwards, one byte after another as far as any reader can
    /// tell, so `dst` may overlap `src` from below.
    ///
    /// # Safety
    /// `src` readable and `dst` writable for `len` bytes; if they overlap, `dst < src`.
    #[inline]
    pub(crate) unsafe fn upward_bytes(src: *const u8, dst: *mut u8, len: usize) {
        // SAFETY: rep movsb moves rcx bytes from [rsi] to [rdi] upwards (the direction flag is
        // clear on entry to inline assembly, as Rust requires); the caller guarantees both
        // ranges. No stack, flags untouched.
        unsafe {
            asm!(
                "rep movsb",
                inout("rcx") len => _,
                inout("rsi") src => _,
                inout("rdi") dst => _,
                options(nostack, preserves_flags)
            )
        }
    }

    /// Copies 2 bytes in one 16-bit move: aligned, a racing write is seen whole or not at all
    /// (a split ring's 16-bit index; `rep movsb` would move it a byte at a time).
    #[inline]
    unsafe fn move_2(s: *const u8, d: *mut u8) {
        // SAFETY: both 2-byte ranges are the caller's.
        unsafe {
            asm!("mov {a:x}, [{s}]", "mov [{d}], {a:x}",
                s = in(reg) s, d = in(reg) d, a = out(reg) _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies bytes `[0, 4)` and `[len - 4, len)`, both loads first.
    #[inline]
    unsafe fn head_tail_4(s: *const u8, d: *mut u8, len: usize) {
        // SAFETY: 4 <= len, so both 4-byte moves lie inside the caller's ranges.
        unsafe {
            asm!("mov {a:e}, [{s}]", "mov {b:e}, [{s} + {t}]", "mov [{d}], {a:e}", "mov [{d} + {t}], {b:e}",
                s = in(reg) s, d = in(reg) d, t = in(reg) len - 4, a = out(reg) _, b = out(reg) _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies bytes `[0, 8)` and `[len - 8, len)`, both loads first.
    #[inline]
    unsafe fn head_tail_8(s: *const u8, d: *mut u8, len: usize) {
        // SAFETY: 8 <= len, so both 8-byte moves lie inside the caller's ranges.
        unsafe {
            asm!("mov {a}, [{s}]", "mov {b}, [{s} + {t}]", "mov [{d}], {a}", "mov [{d} + {t}], {b}",
                s = in(reg) s, d = in(reg) d, t = in(reg) len - 8, a = out(reg) _, b = out(reg) _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies bytes `[0, 16)` and `[len - 16, len)`, both loads first.
    #[inline]
    unsafe fn head_tail_16(s: *const u8, d: *mut u8, len: usize) {
        // SAFETY: 16 <= len, so both 16-byte moves lie inside the caller's ranges.
        unsafe {
            asm!("movdqu xmm0, [{s}]", "movdqu xmm1, [{s} + {t}]", "movdqu [{d}], xmm0", "movdqu [{d} + {t}], xmm1",
                s = in(reg) s, d = in(reg) d, t = in(reg) len - 16, out("xmm0") _, out("xmm1") _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies bytes `[0, 32)` and `[len - 32, len)`, all loads first.
    #[inline]
    unsafe fn head_tail_32(s: *const u8, d: *mut u8, len: usize) {
        // SAFETY: 32 <= len, so all four 16-byte moves lie inside the caller's ranges.
        unsafe {
            asm!(
                "movdqu xmm0, [{s}]", "movdqu xmm1, [{s} + 16]",
                "movdqu xmm2, [{s} + {t}]", "movdqu xmm3, [{s} + {t} + 16]",
                "movdqu [{d}], xmm0", "movdqu [{d} + 16], xmm1",
                "movdqu [{d} + {t}], xmm2", "movdqu [{d} + {t} + 16], xmm3",
                s = in(reg) s, d = in(reg) d, t = in(reg) len - 32,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies bytes `[0, 64)` and `[len - 64, len)`, all loads first.
    #[inline]
    unsafe fn head_tail_64(s: *const u8, d: *mut u8, len: usize) {
        // SAFETY: 64 <= len, so all eight 16-byte moves lie inside the caller's ranges.
        unsafe {
            asm!(
                "movdqu xmm0, [{s}]", "movdqu xmm1, [{s} + 16]",
                "movdqu xmm2, [{s} + 32]", "movdqu xmm3, [{s} + 48]",
                "movdqu xmm4, [{s} + {t}]", "movdqu xmm5, [{s} + {t} + 16]",
                "movdqu xmm6, [{s} + {t} + 32]", "movdqu xmm7, [{s} + {t} + 48]",
                "movdqu [{d}], xmm0", "movdqu [{d} + 16], xmm1",
                "movdqu [{d} + 32], xmm2", "movdqu [{d} + 48], xmm3",
                "movdqu [{d} + {t}], xmm4", "movdqu [{d} + {t} + 16], xmm5",
                "movdqu [{d} + {t} + 32], xmm6", "movdqu [{d} + {t} + 48], xmm7",
                s = in(reg) s, d = in(reg) d, t = in(reg) len - 64,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies `len` (more than 128) bytes 128 at a time with 32-byte AVX moves, the last block
    /// overlapping the one before it; the upper register halves are cleared on the way out, so
    /// later SSE code pays no transition penalty.
    ///
    /// # Safety
    /// The CPU supports AVX; `src` readable and `dst` writable for `len > 128` bytes, disjoint.
    #[target_feature(enable = "avx")]
    unsafe fn blocks_avx(src: *const u8, dst: *mut u8, len: usize) {
        let block = |s: *const u8, d: *mut u8| {
            // SAFETY: each call names 128 bytes inside the caller's ranges (below).
            unsafe {
                asm!(
                    "vmovdqu ymm0, [{s}]", "vmovdqu ymm1, [{s} + 32]",
                    "vmovdqu ymm2, [{s} + 64]", "vmovdqu ymm3, [{s} + 96]",
                    "vmovdqu [{d}], ymm0", "vmovdqu [{d} + 32], ymm1",
                    "vmovdqu [{d} + 64], ymm2", "vmovdqu [{d} + 96], ymm3",
                    s = in(reg) s, d = in(reg) d,
                    out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
                    options(nostack, preserves_flags))
            }
        };
        let mut i = 0;
        while i + 128 < len {
            // SAFETY: i + 128 < len.
            block(unsafe { src.add(i) }, unsafe { dst.add(i) });
            i += 128;
        }
        // SAFETY: len > 128, so the last block starts inside both ranges; AVX is present.
        unsafe {
            block(src.add(len - 128), dst.add(len - 128));
            asm!("vzeroupper", options(nostack, preserves_flags));
        }
    }

    /// Copies bytes `[0, 64)`, all loads first.
    #[inline]
    unsafe fn head_64(s: *const u8, d: *mut u8) {
        // SAFETY: the caller passes at least 64 bytes inside its ranges.
        unsafe {
            asm!(
                "movdqu xmm0, [{s}]", "movdqu xmm1, [{s} + 16]",
                "movdqu xmm2, [{s} + 32]", "movdqu xmm3, [{s} + 48]",
                "movdqu [{d}], xmm0", "movdqu [{d} + 16], xmm1",
                "movdqu [{d} + 32], xmm2", "movdqu [{d} + 48], xmm3",
                s = in(reg) s, d = in(reg) d,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                options(nostack, preserves_flags))
        }
    }

    /// Copies 128 bytes, all loads first.
    #[inline]
    unsafe fn block_128(s: *const u8, d: *mut u8) {
        // SAFETY: the caller passes 128 bytes inside its ranges.
        unsafe {
            asm!(
                "movdqu xmm0, [{s}]", "movdqu xmm1, [{s} + 16]",
                "movdqu xmm2, [{s} + 32]", "movdqu xmm3, [{s} + 48]",
                "movdqu xmm4, [{s} + 64]", "movdqu xmm5, [{s} + 80]",
                "movdqu xmm6, [{s} + 96]", "movdqu xmm7, [{s} + 112]",
                "movdqu [{d}], xmm0", "movdqu [{d} + 16], xmm1",
                "movdqu [{d} + 32], xmm2", "movdqu [{d} + 48], xmm3",
                "movdqu [{d} + 64], xmm4", "movdqu [{d} + 80], xmm5",
                "movdqu [{d} + 96], xmm6", "movdqu [{d} + 112], xmm7",
                s = in(reg) s, d = in(reg) d,
                out("xmm0") _, out("xmm1") _, out("xmm2") _, out("xmm3") _,
                out("xmm4") _, out("xmm5") _, out("xmm6") _, out("xmm7") _,
                options(nostack, preserves_flags))
        }
    }
}

/// Copies `len` bytes from `src` to `dst`, lowest address first.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes; if they overlap, `dst <= src`.
#[cfg(not(target_arch = "x86_64"))]
use forward as upward_bytes;

#[cfg(not(target_arch = "x86_64"))]
unsafe fn forward(src: *const u8, dst: *mut u8, len: usize) {
    // A 2- or 4-byte value aligned on both sides in one access, as the 8-byte words below:
    // a racing write is seen whole or not at all (a split ring's 16-bit index).
    if len == 2 && (src as usize | dst as usize) % 2 == 0 {
        // SAFETY: both aligned, both 2-byte ranges the caller's.
        return unsafe {
            dst.cast::<u16>()
                .write_volatile(src.cast::<u16>().read_volatile())
        };
    }
    if len == 4 && (src as usize | dst as usize) % 4 == 0 {
        // SAFETY: both aligned, both 4-byte ranges the caller's.
        return unsafe {
            dst.cast::<u32>()
                .write_volatile(src.cast::<u32>().read_volatile())
        };
    }
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
        let src: Vec<u8> = (0..5100u32).map(|i| (i * 7 + 1) as u8).collect();
        for len in (0usize..300).chain([511, 512, 513, 1000, 2047, 2048, 2111, 2112, 2113, 5000]) {
            for off in 0..8 {
                for skew in 0..3 {
                    let mut dst = vec![0u8; 5100];
                    let at = off + skew;
                    // SAFETY: both buffers are ours and long enough.
                    unsafe { from_guest(src.as_ptr().add(off), &mut dst[at..at + len]) };
                    assert_eq!(&dst[at..at + len], &src[off..off + len]);
                    assert!(dst[..at].iter().all(|&b| b == 0));
                    assert!(dst[at + len..].iter().all(|&b| b == 0));
                    let mut back = vec![0u8; 5100];
                    // SAFETY: as above.
                    unsafe { to_guest(&src[off..off + len], back.as_mut_ptr().add(at)) };
                    assert_eq!(&back[at..at + len], &src[off..off + len]);
                    assert!(back[..at].iter().all(|&b| b == 0));
                    assert!(back[at + len..].iter().all(|&b| b == 0));
                }
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
