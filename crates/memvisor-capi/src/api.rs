//! The exported functions, one for each prototype in include/memvisor.h (a test compares the
//! two: names, argument and return types).
//!
//! Each function checks its pointers (module `args`), runs the memvisor call inside
//! `last_error::call` and converts the result: 0 or a count on success, `-errno` on failure.
//! Handles are the Rust objects boxed: [`MemvisorBacking`] holds an `Arc<Backing>`, the others
//! hold a cloneable handle ([`SlotTable`], [`DmaSpace`]) or a per-thread object ([`DmaCursor`],
//! an `SgGuard`). Which may be shared between threads is asserted at compile time at the end of
//! this file, and written in the header.
//!
//! Long because `tests/header.rs` compares this one file with the header: every exported
//! function and C struct stays here, each a few lines over the library's own call.
#![allow(clippy::missing_safety_doc)] // every function's contract is in include/memvisor.h

use std::ffi::{c_char, c_int, c_void};
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use memvisor::dma::{SgBuf, SgGuard, SgWalk};
use memvisor::{
    AdoptedMemory, Backing, BackingKind, DiscardOptions, Discarder, DmaConfig, DmaCursor, DmaSpace,
    Gpa, Hva, Iova, PageSize, Prot, SlotFlags, SlotSpec, SlotTable,
};

use crate::args::{
    array, array_mut, bytes, bytes_mut, free, handle, handle_mut, into_handle, out, put, put_opt,
};
use crate::last_error::{Failure, call, call_infallible, last};

/// A backing: host memory guest RAM lives in (`memvisor_backing`).
pub struct MemvisorBacking(Arc<Backing>);
/// A slot table (`memvisor_slots`).
pub struct MemvisorSlots(SlotTable);
/// A DMA space (`memvisor_dma`).
pub struct MemvisorDma(DmaSpace);
/// A per-thread translation cursor over a DMA space (`memvisor_cursor`).
pub struct MemvisorCursor(DmaCursor);
/// Free page reporting's discarder (`memvisor_discarder`).
pub struct MemvisorDiscarder(Discarder);
/// The held pages of a scatter-gather request and their host segments (`memvisor_sg`).
pub struct MemvisorSg {
    _guard: SgGuard,
    segments: Vec<MemvisorSegment>,
}

/// One host-contiguous piece of a translation (`memvisor_segment`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemvisorSegment {
    /// Host address.
    pub hva: *mut c_void,
    /// Bytes.
    pub len: u64,
}

/// One buffer of a scatter-gather request (`memvisor_sg_buf`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemvisorSgBuf {
    /// First byte.
    pub iova: u64,
    /// Bytes (0: skipped).
    pub len: u64,
    /// `MEMVISOR_PROT_READ` (the device reads it) or `MEMVISOR_PROT_WRITE`.
    pub prot: u32,
}

/// What `memvisor_backing_adopt` calls once an adopted backing's last user is gone
/// (`memvisor_release_fn`).
pub type MemvisorReleaseFn = Option<unsafe extern "C" fn(opaque: *mut c_void)>;

/// Memory the caller mapped itself, for `memvisor_backing_adopt` (`memvisor_adopt`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemvisorAdopt {
    /// The mapping's first byte, page aligned.
    pub ptr: *mut c_void,
    /// Bytes: whole pages.
    pub size: u64,
    /// The page size the kernel backs it with: 4096 (or 0, meaning 4096) or a hugetlbfs size.
    pub page_size: u64,
    /// `MEMVISOR_ADOPT_*`.
    pub flags: u32,
    /// With `MEMVISOR_ADOPT_FD`: the file mapped (memvisor keeps a duplicate).
    pub fd: c_int,
    /// With `MEMVISOR_ADOPT_FD`: where in the file the mapping starts.
    pub file_offset: u64,
    /// Called once with `opaque` when the backing's last user is gone (NULL: nothing called).
    pub release: MemvisorReleaseFn,
    /// Handed to `release`.
    pub opaque: *mut c_void,
}

/// A guest range reported free (`memvisor_range`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemvisorRange {
    /// First guest physical address.
    pub gpa: u64,
    /// Bytes.
    pub len: u64,
}

/// What a free page report did (`memvisor_report`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MemvisorReport {
    /// Bytes given back to the host.
    pub discarded: u64,
    /// Bytes kept because a pin holds them.
    pub skipped_pinned: u64,
    /// Bytes refused (outside guest memory, read-only slots, private file mappings, ...).
    pub rejected: u64,
}

/// `MEMVISOR_BACKING_*` of the header.
const BACKING_PRIVATE_ANON: c_int = 0;
const BACKING_SHARED_ANON: c_int = 1;
const BACKING_MEMFD: c_int = 2;
const BACKING_THP: c_int = 3;
const BACKING_HUGETLB_2M: c_int = 4;
const BACKING_HUGETLB_1G: c_int = 5;

/// `MEMVISOR_ADOPT_*` of the header.
const ADOPT_SHARED: u32 = 1;
const ADOPT_FD: u32 = 2;

/// `MEMVISOR_PROT_*` of the header.
const PROT_READ: u32 = 1;
const PROT_WRITE: u32 = 2;
/// `MEMVISOR_SLOT_*` of the header.
const SLOT_READ_ONLY: u32 = 1;
const SLOT_LOG_DIRTY: u32 = 2;

/// `bits` as a `Prot`; unknown bits and 0 are refused naming `what`.
fn prot(bits: u32, what: &str) -> Result<Prot, Failure> {
    match bits {
        PROT_READ => Ok(Prot::READ),
        PROT_WRITE => Ok(Prot::WRITE),
        b if b == PROT_READ | PROT_WRITE => Ok(Prot::RW),
        _ => Err(Failure::invalid(format!(
            "{what} {bits:#x} is not MEMVISOR_PROT_READ, MEMVISOR_PROT_WRITE or both"
        ))),
    }
}

/// `bits` as slot flags; unknown bits are refused.
fn slot_flags(bits: u32) -> Result<SlotFlags, Failure> {
    if bits & !(SLOT_READ_ONLY | SLOT_LOG_DIRTY) != 0 {
        return Err(Failure::invalid(format!(
            "flags {bits:#x} has bits other than MEMVISOR_SLOT_READ_ONLY and MEMVISOR_SLOT_LOG_DIRTY"
        )));
    }
    let mut flags = SlotFlags::NONE;
    if bits & SLOT_READ_ONLY != 0 {
        flags = flags | SlotFlags::READ_ONLY;
    }
    if bits & SLOT_LOG_DIRTY != 0 {
        flags = flags | SlotFlags::LOG_DIRTY;
    }
    Ok(flags)
}

/// A count returned as the function's value; counts past `INT_MAX` cannot be.
fn count(n: usize, what: &str) -> Result<c_int, Failure> {
    c_int::try_from(n).map_err(|_| Failure {
        errno: libc::EOVERFLOW,
        message: format!("{what} {n} does not fit the return value"),
    })
}

// ---- errors

/// This thread's last error message.
#[unsafe(no_mangle)]
pub extern "C" fn memvisor_last_error() -> *const c_char {
    last()
}

// ---- backings

/// `memvisor_backing_new`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_new(
    kind: c_int,
    size: u64,
    backing: *mut *mut MemvisorBacking,
) -> c_int {
    call("memvisor_backing_new", || {
        let backing = out(backing, "backing")?;
        let kind = match kind {
            BACKING_PRIVATE_ANON => BackingKind::PrivateAnon,
            BACKING_SHARED_ANON => BackingKind::SharedAnon,
            BACKING_MEMFD => BackingKind::Memfd,
            BACKING_THP => BackingKind::Thp,
            BACKING_HUGETLB_2M => BackingKind::Hugetlb(PageSize::Size2M),
            BACKING_HUGETLB_1G => BackingKind::Hugetlb(PageSize::Size1G),
            k => {
                return Err(Failure::invalid(format!(
                    "kind {k} is not a MEMVISOR_BACKING_* value (0 to 5)"
                )));
            }
        };
        let made = Backing::new(kind, size)?;
        // SAFETY: `backing` is a checked out pointer (the header's contract: writable).
        unsafe { put(backing, into_handle(MemvisorBacking(Arc::new(made)))) };
        Ok(0)
    })
}

/// `memvisor_backing_from_fd`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_from_fd(
    fd: c_int,
    file_offset: u64,
    size: u64,
    backing: *mut *mut MemvisorBacking,
) -> c_int {
    call("memvisor_backing_from_fd", || {
        let backing = out(backing, "backing")?;
        // The caller keeps its fd: memvisor maps and keeps a duplicate of its own.
        let made = Backing::from_fd(duplicate(fd)?, file_offset, size)?;
        // SAFETY: `backing` is a checked out pointer.
        unsafe { put(backing, into_handle(MemvisorBacking(Arc::new(made)))) };
        Ok(0)
    })
}

/// A duplicate of the caller's `fd` (the caller keeps its own).
fn duplicate(fd: c_int) -> Result<OwnedFd, Failure> {
    if fd < 0 {
        return Err(Failure::invalid(format!(
            "fd {fd} is not a file descriptor"
        )));
    }
    // SAFETY: F_DUPFD_CLOEXEC reads no memory; a bad fd is EBADF.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        let e = std::io::Error::last_os_error();
        return Err(Failure {
            errno: e.raw_os_error().unwrap_or(libc::EBADF),
            message: format!("fd {fd} cannot be duplicated: {e}"),
        });
    }
    // SAFETY: `dup` is a new descriptor this function alone owns.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// An adopted backing's keeper: calls the caller's release function when the backing drops
/// it, unless adoption failed (disarmed: the caller still owns its memory then).
struct Release {
    release: unsafe extern "C" fn(*mut c_void),
    opaque: *mut c_void,
    armed: AtomicBool,
}

// SAFETY: the header's contract: `release` may be called from any thread, and `opaque` is only
// handed back to it, never read here.
unsafe impl Send for Release {}
// SAFETY: as for Send; `&Release` only reads `armed`, an atomic.
unsafe impl Sync for Release {}

impl Drop for Release {
    fn drop(&mut self) {
        if *self.armed.get_mut() {
            // SAFETY: the caller's function with the caller's pointer, called once (the
            // header's contract).
            unsafe { (self.release)(self.opaque) }
        }
    }
}

/// `memvisor_backing_adopt`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_adopt(
    memory: *const MemvisorAdopt,
    backing: *mut *mut MemvisorBacking,
) -> c_int {
    call("memvisor_backing_adopt", || {
        let backing = out(backing, "backing")?;
        // SAFETY: NULL or the caller's description (the header's contract).
        let m = *unsafe { handle(memory, "memory") }?;
        if m.flags & !(ADOPT_SHARED | ADOPT_FD) != 0 {
            return Err(Failure::invalid(format!(
                "flags {:#x} has bits other than MEMVISOR_ADOPT_SHARED and MEMVISOR_ADOPT_FD",
                m.flags
            )));
        }
        let page_size = match m.page_size {
            0 => PageSize::Size4K,
            b => PageSize::from_bytes(b).ok_or_else(|| {
                Failure::invalid(format!("page_size {b:#x} is not 4096, 2 MiB or 1 GiB"))
            })?,
        };
        let mut adopted = AdoptedMemory::new(m.ptr.cast(), m.size)
            .shared(m.flags & ADOPT_SHARED != 0)
            .page_size(page_size);
        if m.flags & ADOPT_FD != 0 {
            adopted = adopted.file(duplicate(m.fd)?, m.file_offset);
        }
        let keeper = m.release.map(|release| {
            Arc::new(Release {
                release,
                opaque: m.opaque,
                armed: AtomicBool::new(true),
            })
        });
        if let Some(k) = &keeper {
            adopted = adopted.keep(k.clone());
        }
        // SAFETY: the caller's promises of the header (memvisor_backing_adopt), the same as
        // Backing::adopt's: the mapping stays mapped and read-write until `release` is called.
        match unsafe { Backing::adopt(adopted) } {
            Ok(made) => {
                // SAFETY: `backing` is a checked out pointer.
                unsafe { put(backing, into_handle(MemvisorBacking(Arc::new(made)))) };
                Ok(0)
            }
            Err(e) => {
                // Not adopted: the memory is still the caller's; do not call its release.
                if let Some(k) = &keeper {
                    k.armed.store(false, Ordering::Relaxed);
                }
                Err(e.into())
            }
        }
    })
}

/// `memvisor_backing_free`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_free(backing: *mut MemvisorBacking) {
    // SAFETY: NULL or a backing handle given back once (the header's contract).
    call_infallible("memvisor_backing_free", (), || unsafe { free(backing) })
}

/// `memvisor_backing_ptr`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_ptr(backing: *const MemvisorBacking) -> *mut c_void {
    // SAFETY: NULL or a live backing handle.
    match unsafe { handle(backing, "backing") } {
        Ok(b) => b.0.as_ptr().cast(),
        Err(_) => std::ptr::null_mut(),
    }
}

/// `memvisor_backing_size`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_size(backing: *const MemvisorBacking) -> u64 {
    // SAFETY: NULL or a live backing handle.
    unsafe { handle(backing, "backing") }.map_or(0, |b| b.0.size())
}

/// `memvisor_backing_fd`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_backing_fd(backing: *const MemvisorBacking) -> c_int {
    use std::os::fd::AsRawFd;
    // SAFETY: NULL or a live backing handle.
    unsafe { handle(backing, "backing") }
        .ok()
        .and_then(|b| b.0.fd().map(|fd| fd.as_raw_fd()))
        .unwrap_or(-1)
}

// ---- slot tables

/// `memvisor_slots_new`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_new(
    max_slots: u32,
    slots: *mut *mut MemvisorSlots,
) -> c_int {
    call("memvisor_slots_new", || {
        let slots = out(slots, "slots")?;
        let table = if max_slots == 0 {
            SlotTable::new()
        } else {
            SlotTable::with_max_slots(max_slots)
        };
        // SAFETY: `slots` is a checked out pointer.
        unsafe { put(slots, into_handle(MemvisorSlots(table))) };
        Ok(0)
    })
}

/// `memvisor_slots_free`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_free(slots: *mut MemvisorSlots) {
    // SAFETY: NULL or a slot table handle given back once.
    call_infallible("memvisor_slots_free", (), || unsafe { free(slots) })
}

/// `memvisor_slots_insert`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_insert(
    slots: *const MemvisorSlots,
    id: u32,
    gpa: u64,
    backing: *const MemvisorBacking,
    offset: u64,
    size: u64,
    flags: u32,
) -> c_int {
    call("memvisor_slots_insert", || {
        // SAFETY: NULL or live handles (the header's contract).
        let (slots, backing) = unsafe { (handle(slots, "slots")?, handle(backing, "backing")?) };
        let spec = SlotSpec::new(id, Gpa(gpa), backing.0.clone())
            .window(offset, size)
            .flags(slot_flags(flags)?);
        slots.0.insert(spec)?;
        Ok(0)
    })
}

/// `memvisor_slots_remove`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_remove(slots: *const MemvisorSlots, id: u32) -> c_int {
    call("memvisor_slots_remove", || {
        // SAFETY: NULL or a live handle.
        unsafe { handle(slots, "slots") }?.0.remove(id)?;
        Ok(0)
    })
}

/// `memvisor_slots_read`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_read(
    slots: *const MemvisorSlots,
    gpa: u64,
    buf: *mut c_void,
    len: usize,
) -> c_int {
    call("memvisor_slots_read", || {
        // SAFETY: a live handle; `buf` is the caller's `len` bytes (the header's contract).
        let (slots, buf) = unsafe { (handle(slots, "slots")?, bytes_mut(buf, len, "buf")?) };
        slots.0.read(Gpa(gpa), buf)?;
        Ok(0)
    })
}

/// `memvisor_slots_write`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_write(
    slots: *const MemvisorSlots,
    gpa: u64,
    buf: *const c_void,
    len: usize,
) -> c_int {
    call("memvisor_slots_write", || {
        // SAFETY: a live handle; `buf` is the caller's `len` bytes.
        let (slots, buf) = unsafe { (handle(slots, "slots")?, bytes(buf, len, "buf")?) };
        slots.0.write(Gpa(gpa), buf)?;
        Ok(0)
    })
}

/// `memvisor_slots_lookup`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_slots_lookup(
    slots: *const MemvisorSlots,
    gpa: u64,
    hva: *mut *mut c_void,
    len: *mut u64,
) -> c_int {
    call("memvisor_slots_lookup", || {
        let hva_out = out(hva, "hva")?;
        // SAFETY: a live handle.
        let slots = unsafe { handle(slots, "slots") }?;
        let Some(t) = slots.0.lookup(Gpa(gpa)) else {
            return Err(Failure {
                errno: libc::EFAULT,
                message: format!("no slot holds gpa {gpa:#x}"),
            });
        };
        // SAFETY: checked out pointers; `len` may be NULL.
        unsafe {
            put(hva_out, t.hva.as_ptr().cast());
            put_opt(len, t.len);
        }
        Ok(0)
    })
}

// ---- DMA spaces

/// `memvisor_dma_new`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_new(max_mappings: u32, dma: *mut *mut MemvisorDma) -> c_int {
    call("memvisor_dma_new", || {
        let dma = out(dma, "dma")?;
        let mut config = DmaConfig::default();
        if max_mappings != 0 {
            config.max_mappings = max_mappings;
        }
        let space = DmaSpace::new(config)?;
        // SAFETY: a checked out pointer.
        unsafe { put(dma, into_handle(MemvisorDma(space))) };
        Ok(0)
    })
}

/// `memvisor_dma_free`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_free(dma: *mut MemvisorDma) {
    // SAFETY: NULL or a DMA space handle given back once.
    call_infallible("memvisor_dma_free", (), || unsafe { free(dma) })
}

/// `memvisor_dma_map_backing`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_map_backing(
    dma: *const MemvisorDma,
    iova: u64,
    backing: *const MemvisorBacking,
    offset: u64,
    size: u64,
    prot_bits: u32,
) -> c_int {
    call("memvisor_dma_map_backing", || {
        // SAFETY: NULL or live handles.
        let (dma, backing) = unsafe { (handle(dma, "dma")?, handle(backing, "backing")?) };
        dma.0.map_backing(
            Iova(iova),
            &backing.0,
            offset,
            size,
            prot(prot_bits, "prot")?,
        )?;
        Ok(0)
    })
}

/// `memvisor_dma_map_guest`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_map_guest(
    dma: *const MemvisorDma,
    iova: u64,
    slots: *const MemvisorSlots,
    gpa: u64,
    size: u64,
    prot_bits: u32,
) -> c_int {
    call("memvisor_dma_map_guest", || {
        // SAFETY: NULL or live handles.
        let (dma, slots) = unsafe { (handle(dma, "dma")?, handle(slots, "slots")?) };
        let snapshot = slots.0.snapshot();
        dma.0.map_guest(
            Iova(iova),
            &snapshot,
            Gpa(gpa),
            size,
            prot(prot_bits, "prot")?,
        )?;
        Ok(0)
    })
}

/// `memvisor_dma_map_raw`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_map_raw(
    dma: *const MemvisorDma,
    iova: u64,
    hva: *mut c_void,
    size: u64,
    prot_bits: u32,
) -> c_int {
    call("memvisor_dma_map_raw", || {
        // SAFETY: NULL or a live handle.
        let dma = unsafe { handle(dma, "dma") }?;
        let prot = prot(prot_bits, "prot")?;
        if hva.is_null() {
            // NULL is no memory, whatever its alignment: a translation there would hand out 0.
            return Err(Failure::invalid("hva is NULL".into()));
        }
        // SAFETY: the caller's promise of the header (memvisor_dma_map_raw), map_raw's own:
        // the memory stays mapped until the mapping is unmapped.
        unsafe { dma.0.map_raw(Iova(iova), Hva(hva as u64), size, prot) }?;
        Ok(0)
    })
}

/// `memvisor_dma_unmap`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_unmap(
    dma: *const MemvisorDma,
    iova: u64,
    size: u64,
    unmapped: *mut u64,
) -> c_int {
    call("memvisor_dma_unmap", || {
        // SAFETY: NULL or a live handle.
        let bytes = unsafe { handle(dma, "dma") }?.0.unmap(Iova(iova), size)?;
        // SAFETY: NULL or writable (the header's contract).
        unsafe { put_opt(unmapped, bytes) };
        Ok(0)
    })
}

/// `memvisor_dma_translate`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_translate(
    dma: *const MemvisorDma,
    iova: u64,
    len: u64,
    access: u32,
    hva: *mut *mut c_void,
    avail: *mut u64,
) -> c_int {
    call("memvisor_dma_translate", || {
        let hva_out = out(hva, "hva")?;
        // SAFETY: NULL or a live handle.
        let dma = unsafe { handle(dma, "dma") }?;
        let t = dma.0.translate(Iova(iova), len, prot(access, "access")?)?;
        // SAFETY: checked out pointers; `avail` may be NULL.
        unsafe {
            put(hva_out, t.hva.as_ptr().cast());
            put_opt(avail, t.len);
        }
        Ok(0)
    })
}

/// `memvisor_dma_translate_sg`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_translate_sg(
    dma: *const MemvisorDma,
    iova: u64,
    len: u64,
    access: u32,
    segments: *mut MemvisorSegment,
    capacity: usize,
) -> c_int {
    call("memvisor_dma_translate_sg", || {
        // SAFETY: a live handle; `segments` is the caller's `capacity` entries.
        let (dma, slots) = unsafe {
            (
                handle(dma, "dma")?,
                array_mut(segments, capacity, "segments", "capacity")?,
            )
        };
        let found = dma
            .0
            .translate_sg(Iova(iova), len, prot(access, "access")?)?;
        if found.len() > slots.len() {
            return Err(Failure {
                errno: libc::ENOSPC,
                message: format!(
                    "iova {iova:#x}+{len:#x} is {} segments; capacity is {capacity}",
                    found.len()
                ),
            });
        }
        for (slot, s) in slots.iter_mut().zip(&found) {
            *slot = MemvisorSegment {
                hva: s.hva.as_ptr().cast(),
                len: s.len,
            };
        }
        count(found.len(), "segment count")
    })
}

/// `memvisor_dma_hold_sg`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_hold_sg(
    dma: *const MemvisorDma,
    bufs: *const MemvisorSgBuf,
    n: usize,
    sg: *mut *mut MemvisorSg,
    miss_iova: *mut u64,
) -> c_int {
    call("memvisor_dma_hold_sg", || {
        let sg_out = out(sg, "sg")?;
        // SAFETY: a live handle; `bufs` is the caller's `n` entries.
        let (dma, bufs) = unsafe { (handle(dma, "dma")?, array(bufs, n, "bufs", "n")?) };
        let mut list = Vec::with_capacity(bufs.len());
        for (i, b) in bufs.iter().enumerate() {
            list.push(SgBuf {
                iova: Iova(b.iova),
                len: b.len,
                prot: prot(b.prot, &format!("bufs[{i}].prot"))?,
            });
        }
        match dma.0.hold_sg(&list)? {
            SgWalk::Held(guard) => {
                let segments = guard
                    .segments()
                    .iter()
                    .map(|s| MemvisorSegment {
                        hva: s.hva.as_ptr().cast(),
                        len: s.len,
                    })
                    .collect();
                let held = into_handle(MemvisorSg {
                    _guard: guard,
                    segments,
                });
                // SAFETY: a checked out pointer.
                unsafe { put(sg_out, held) };
                Ok(0)
            }
            SgWalk::Missed(misses) => {
                let first = misses.first().map_or(0, |m| m.iova.0);
                // SAFETY: NULL or writable.
                unsafe { put_opt(miss_iova, first) };
                Err(Failure {
                    errno: libc::EFAULT,
                    message: format!(
                        "nothing is mapped at iova {first:#x} ({} unmapped pages); nothing is held",
                        misses.len()
                    ),
                })
            }
        }
    })
}

/// `memvisor_sg_segments`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_sg_segments(
    sg: *const MemvisorSg,
    segments: *mut *const MemvisorSegment,
) -> c_int {
    call("memvisor_sg_segments", || {
        let segments_out = out(segments, "segments")?;
        // SAFETY: NULL or a live handle.
        let sg = unsafe { handle(sg, "sg") }?;
        // SAFETY: a checked out pointer; the array lives as long as the handle.
        unsafe { put(segments_out, sg.segments.as_ptr()) };
        count(sg.segments.len(), "segment count")
    })
}

/// `memvisor_sg_release`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_sg_release(sg: *mut MemvisorSg) {
    // SAFETY: NULL or a guard handle given back once.
    call_infallible("memvisor_sg_release", (), || unsafe { free(sg) })
}

/// `memvisor_dma_read`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_read(
    dma: *const MemvisorDma,
    iova: u64,
    buf: *mut c_void,
    len: usize,
) -> c_int {
    call("memvisor_dma_read", || {
        // SAFETY: a live handle; `buf` is the caller's `len` bytes.
        let (dma, buf) = unsafe { (handle(dma, "dma")?, bytes_mut(buf, len, "buf")?) };
        dma.0.dma_read(Iova(iova), buf)?;
        Ok(0)
    })
}

/// `memvisor_dma_write`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_write(
    dma: *const MemvisorDma,
    iova: u64,
    buf: *const c_void,
    len: usize,
) -> c_int {
    call("memvisor_dma_write", || {
        // SAFETY: a live handle; `buf` is the caller's `len` bytes.
        let (dma, buf) = unsafe { (handle(dma, "dma")?, bytes(buf, len, "buf")?) };
        dma.0.dma_write(Iova(iova), buf)?;
        Ok(0)
    })
}

/// `memvisor_dma_pin_pages`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_pin_pages(
    dma: *const MemvisorDma,
    pages: *const u64,
    n: usize,
    prot_bits: u32,
    hvas: *mut *mut c_void,
) -> c_int {
    call("memvisor_dma_pin_pages", || {
        // SAFETY: a live handle; `pages` is the caller's `n` entries.
        let (dma, pages) = unsafe { (handle(dma, "dma")?, array(pages, n, "pages", "n")?) };
        let out_hvas = if hvas.is_null() {
            None
        } else {
            // SAFETY: the caller's `n` writable entries (the header's contract).
            Some(unsafe { array_mut(hvas, n, "hvas", "n")? })
        };
        let pinned = dma.0.pin_pages(pages, prot(prot_bits, "prot")?)?;
        if let Some(out_hvas) = out_hvas {
            for (slot, h) in out_hvas.iter_mut().zip(&pinned) {
                *slot = h.as_ptr().cast();
            }
        }
        Ok(0)
    })
}

/// `memvisor_dma_unpin_pages`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_unpin_pages(
    dma: *const MemvisorDma,
    pages: *const u64,
    n: usize,
) -> c_int {
    call("memvisor_dma_unpin_pages", || {
        // SAFETY: a live handle; `pages` is the caller's `n` entries.
        let (dma, pages) = unsafe { (handle(dma, "dma")?, array(pages, n, "pages", "n")?) };
        dma.0.unpin_pages(pages)?;
        Ok(0)
    })
}

/// `memvisor_dma_pinned_pages`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_pinned_pages(dma: *const MemvisorDma) -> u64 {
    // SAFETY: NULL or a live handle.
    let dma = unsafe { handle(dma, "dma") };
    call_infallible("memvisor_dma_pinned_pages", 0, || {
        dma.map_or(0, |d| d.0.device_pinned_pages())
    })
}

/// `memvisor_dma_invalidate_vaddr`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_invalidate_vaddr(
    dma: *const MemvisorDma,
    iova: u64,
    size: u64,
    invalidated: *mut u64,
) -> c_int {
    call("memvisor_dma_invalidate_vaddr", || {
        // SAFETY: NULL or a live handle.
        let bytes = unsafe { handle(dma, "dma") }?
            .0
            .invalidate_vaddr(Iova(iova), size)?;
        // SAFETY: NULL or writable.
        unsafe { put_opt(invalidated, bytes) };
        Ok(0)
    })
}

/// `memvisor_dma_update_vaddr`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_update_vaddr(
    dma: *const MemvisorDma,
    iova: u64,
    size: u64,
    backing: *const MemvisorBacking,
    offset: u64,
) -> c_int {
    call("memvisor_dma_update_vaddr", || {
        // SAFETY: NULL or live handles.
        let (dma, backing) = unsafe { (handle(dma, "dma")?, handle(backing, "backing")?) };
        dma.0.update_vaddr(Iova(iova), size, &backing.0, offset)?;
        Ok(0)
    })
}

/// `memvisor_dma_iotlb_map`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_iotlb_map(
    dma: *const MemvisorDma,
    iova: u64,
    backing: *const MemvisorBacking,
    offset: u64,
    size: u64,
    prot_bits: u32,
) -> c_int {
    call("memvisor_dma_iotlb_map", || {
        // SAFETY: NULL or live handles.
        let (dma, backing) = unsafe { (handle(dma, "dma")?, handle(backing, "backing")?) };
        dma.0.iotlb_map(
            Iova(iova),
            &backing.0,
            offset,
            size,
            prot(prot_bits, "prot")?,
        )?;
        Ok(0)
    })
}

/// `memvisor_dma_invalidate_range`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_invalidate_range(
    dma: *const MemvisorDma,
    iova: u64,
    size: u64,
    removed: *mut u64,
) -> c_int {
    call("memvisor_dma_invalidate_range", || {
        // SAFETY: NULL or a live handle.
        let bytes = unsafe { handle(dma, "dma") }?
            .0
            .invalidate_range(Iova(iova), size)?;
        // SAFETY: NULL or writable (the header's contract).
        unsafe { put_opt(removed, bytes) };
        Ok(0)
    })
}

/// `memvisor_dma_dirty_start`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_dirty_start(dma: *const MemvisorDma) -> c_int {
    call("memvisor_dma_dirty_start", || {
        // SAFETY: NULL or a live handle.
        unsafe { handle(dma, "dma") }?.0.start_dirty_tracking()?;
        Ok(0)
    })
}

/// `memvisor_dma_dirty_stop`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_dirty_stop(dma: *const MemvisorDma) -> c_int {
    call("memvisor_dma_dirty_stop", || {
        // SAFETY: NULL or a live handle.
        unsafe { handle(dma, "dma") }?.0.stop_dirty_tracking();
        Ok(0)
    })
}

/// `memvisor_dma_dirty_get_and_clear`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_dirty_get_and_clear(
    dma: *const MemvisorDma,
    iova: u64,
    size: u64,
    page_size: u64,
    bitmap: *mut u64,
    words: usize,
) -> c_int {
    call("memvisor_dma_dirty_get_and_clear", || {
        // SAFETY: a live handle; `bitmap` is the caller's `words` words.
        let (dma, bitmap) = unsafe {
            (
                handle(dma, "dma")?,
                array_mut(bitmap, words, "bitmap", "words")?,
            )
        };
        dma.0
            .get_and_clear_dirty_into(Iova(iova), size, page_size, bitmap)?;
        Ok(0)
    })
}

/// `memvisor_dma_unmap_get_dirty`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_dma_unmap_get_dirty(
    dma: *const MemvisorDma,
    iova: u64,
    size: u64,
    page_size: u64,
    bitmap: *mut u64,
    words: usize,
    unmapped: *mut u64,
) -> c_int {
    call("memvisor_dma_unmap_get_dirty", || {
        // SAFETY: a live handle; `bitmap` is the caller's `words` words.
        let (dma, bitmap) = unsafe {
            (
                handle(dma, "dma")?,
                array_mut(bitmap, words, "bitmap", "words")?,
            )
        };
        // The bitmap must hold the range before anything is unmapped: a failed call changes
        // nothing. A zero or wrong page size is left to the space, which names it.
        if let Some(pages) = size.checked_div(page_size) {
            let need = pages.div_ceil(64);
            if (bitmap.len() as u64) < need {
                return Err(Failure::invalid(format!(
                    "bitmap of {words} words is too small for {pages:#x} pages ({need} words): nothing unmapped"
                )));
            }
        }
        let (bytes, bits) = dma.0.unmap_get_dirty(Iova(iova), size, page_size)?;
        bitmap[..bits.len()].copy_from_slice(&bits);
        // SAFETY: NULL or writable (the header's contract).
        unsafe { put_opt(unmapped, bytes) };
        Ok(0)
    })
}

// ---- cursors

/// `memvisor_cursor_new`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_cursor_new(
    dma: *const MemvisorDma,
    cursor: *mut *mut MemvisorCursor,
) -> c_int {
    call("memvisor_cursor_new", || {
        let cursor = out(cursor, "cursor")?;
        // SAFETY: NULL or a live handle.
        let made = unsafe { handle(dma, "dma") }?.0.cursor();
        // SAFETY: a checked out pointer.
        unsafe { put(cursor, into_handle(MemvisorCursor(made))) };
        Ok(0)
    })
}

/// `memvisor_cursor_free`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_cursor_free(cursor: *mut MemvisorCursor) {
    // SAFETY: NULL or a cursor handle given back once.
    call_infallible("memvisor_cursor_free", (), || unsafe { free(cursor) })
}

/// `memvisor_cursor_translate`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_cursor_translate(
    cursor: *mut MemvisorCursor,
    iova: u64,
    len: u64,
    access: u32,
    hva: *mut *mut c_void,
    avail: *mut u64,
) -> c_int {
    call("memvisor_cursor_translate", || {
        let hva_out = out(hva, "hva")?;
        // SAFETY: NULL or a live cursor this thread alone uses (the header's contract).
        let cursor = unsafe { handle_mut(cursor, "cursor") }?;
        let t = cursor
            .0
            .translate(Iova(iova), len, prot(access, "access")?)?;
        // SAFETY: checked out pointers; `avail` may be NULL.
        unsafe {
            put(hva_out, t.hva.as_ptr().cast());
            put_opt(avail, t.len);
        }
        Ok(0)
    })
}

// ---- free page reporting

/// `memvisor_discarder_new`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_discarder_new(
    slots: *const MemvisorSlots,
    use_madv_free: c_int,
    discarder: *mut *mut MemvisorDiscarder,
) -> c_int {
    call("memvisor_discarder_new", || {
        let discarder = out(discarder, "discarder")?;
        // SAFETY: NULL or a live handle.
        let slots = unsafe { handle(slots, "slots") }?;
        let options = DiscardOptions {
            use_madv_free: use_madv_free != 0,
            ..DiscardOptions::default()
        };
        let made = Discarder::with_options(&slots.0, options);
        // SAFETY: a checked out pointer.
        unsafe { put(discarder, into_handle(MemvisorDiscarder(made))) };
        Ok(0)
    })
}

/// `memvisor_discarder_free`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_discarder_free(discarder: *mut MemvisorDiscarder) {
    // SAFETY: NULL or a discarder handle given back once.
    call_infallible("memvisor_discarder_free", (), || unsafe { free(discarder) })
}

/// `memvisor_discard_report`: its contract (arguments, ownership, threads) is in include/memvisor.h.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn memvisor_discard_report(
    discarder: *const MemvisorDiscarder,
    ranges: *const MemvisorRange,
    n: usize,
    report: *mut MemvisorReport,
) -> c_int {
    call("memvisor_discard_report", || {
        let report_out = out(report, "report")?;
        // SAFETY: a live handle; `ranges` is the caller's `n` entries.
        let (discarder, ranges) = unsafe {
            (
                handle(discarder, "discarder")?,
                array(ranges, n, "ranges", "n")?,
            )
        };
        let list: Vec<(Gpa, u64)> = ranges.iter().map(|r| (Gpa(r.gpa), r.len)).collect();
        let outcome = discarder.0.report(&list);
        let done = MemvisorReport {
            discarded: outcome.discarded,
            skipped_pinned: outcome.skipped_pinned,
            rejected: outcome.rejected_bytes(),
        };
        // SAFETY: a checked out pointer.
        unsafe { put(report_out, done) };
        Ok(0)
    })
}

// What the header promises about threads, checked: these handles may be used from any thread
// at once; a cursor and a guard may move between threads but are used by one at a time.
const _: () = {
    const fn shared<T: Send + Sync>() {}
    const fn movable<T: Send>() {}
    shared::<MemvisorBacking>();
    shared::<MemvisorSlots>();
    shared::<MemvisorDma>();
    shared::<MemvisorDiscarder>();
    movable::<DmaCursor>();
    movable::<SgGuard>();
};
