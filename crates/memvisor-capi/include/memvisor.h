/*
 * memvisor.h: the C API of memvisor, guest memory and DMA mapping for userspace VMMs and
 * device back ends (libmemvisor.so / libmemvisor.a, crate crates/memvisor-capi).
 *
 * The model, as in Rust (docs/api.md): guest RAM is host memory in *backings*, placed at
 * guest physical addresses (GPA) in a *slot table*. Devices reach it through a *DMA space*
 * with VFIO type1's rules: I/O virtual addresses (IOVA) mapped to backings or to guest
 * ranges, translated to host addresses, pinned, logged dirty. A *discarder* gives memory the
 * guest reported free back to the host, never touching pages a device has pinned.
 *
 * ERRORS. A function returning int returns 0 (or a count, where its comment says so) on
 * success and a negative errno on failure: the errno Linux's VFIO type1 driver or KVM gives
 * for the same mistake (e.g. -EINVAL for an unmap that would cut a mapping in two). NULL
 * pointers where one is required, unknown flag bits and lengths past PTRDIFF_MAX bytes are
 * -EINVAL. On failure nothing was changed and no out argument was written (unless its comment
 * says otherwise), and memvisor_last_error() says why. One exception, while dirty tracking is
 * on: a walk for WRITE that fails part way (memvisor_dma_translate_sg, memvisor_dma_hold_sg)
 * may leave the pages of the buffers before the failure marked dirty, as a device that wrote
 * them would; a migration copies them once more, nothing is lost.
 *
 * OWNERSHIP. Each handle type below says which function makes it and which one frees it.
 * Every free function accepts NULL. Handles name shared objects, so freeing one never pulls
 * memory from under another: a slot or a DMA mapping keeps its backing mapped, a cursor or a
 * held scatter-gather list keeps its DMA space, a discarder keeps its slot table. Host
 * addresses handed out (memvisor_backing_ptr, translations, segments, pinned pages) stay
 * valid while the memory is mapped there: for a backing, until it is freed and no slot or
 * mapping uses it; for a translation, until the IOVA is unmapped (pin or hold what a device
 * reaches after the call returns).
 *
 * THREADS. memvisor_backing, memvisor_slots, memvisor_dma and memvisor_discarder may be used
 * from any number of threads at once (every function on them is thread-safe), except that
 * the free function must be the handle's last use. memvisor_cursor and memvisor_sg may be
 * passed between threads but used by one thread at a time. memvisor_last_error() is per
 * thread.
 *
 * BUFFERS. The `buf` of a read or write and the arrays passed in are the caller's own memory,
 * not changed by another thread during the call; to copy between guest memory and guest
 * memory use two calls through a buffer of your own.
 */
#ifndef MEMVISOR_H
#define MEMVISOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ------------------------------------------------------------------------- */

/*
 * The message of this thread's last failed call, "function: what was wrong", or "" before
 * any. Owned by memvisor: valid until the next failing call on this thread; do not free it.
 * Successful calls leave it as it was.
 */
const char *memvisor_last_error(void);

/* ---- backings: host memory ------------------------------------------------------------ */

/*
 * A backing: host memory guest RAM lives in. Made by memvisor_backing_new,
 * memvisor_backing_from_fd or memvisor_backing_adopt, freed by memvisor_backing_free (which
 * drops the caller's reference: slots and DMA mappings that use it keep it mapped).
 * Thread-safe.
 */
typedef struct memvisor_backing memvisor_backing;

/* Kinds for memvisor_backing_new. */
#define MEMVISOR_BACKING_PRIVATE_ANON 0 /* private anonymous memory */
#define MEMVISOR_BACKING_SHARED_ANON 1  /* shared anonymous memory */
#define MEMVISOR_BACKING_MEMFD 2        /* a memfd: its fd can go to a vhost-user back end */
#define MEMVISOR_BACKING_THP 3          /* private, 2 MiB aligned, transparent huge pages */
#define MEMVISOR_BACKING_HUGETLB_2M 4   /* hugetlbfs 2 MiB pages (MFD_HUGETLB memfd) */
#define MEMVISOR_BACKING_HUGETLB_1G 5   /* hugetlbfs 1 GiB pages */

/*
 * Maps `size` bytes (a multiple of the kind's page size) of a new backing of `kind` and
 * stores its handle in *backing. -EINVAL for an unknown kind or a bad size; -ENOMEM when
 * huge pages are not available.
 */
int memvisor_backing_new(int kind, uint64_t size, memvisor_backing **backing);

/*
 * Maps `size` bytes of the shared file `fd` (a memfd, a hugetlbfs file, one received from
 * another process) from `file_offset`. memvisor maps and keeps a duplicate of `fd`: the caller
 * still owns `fd` and may close it at once.
 */
int memvisor_backing_from_fd(int fd, uint64_t file_offset, uint64_t size,
                             memvisor_backing **backing);

/* Called once with its `opaque` when an adopted backing's last user is gone, from whichever
 * thread let go of it last (memvisor_backing_free, an unmap, a slot removed): unmap there. */
typedef void (*memvisor_release_fn)(void *opaque);

/* Flags for memvisor_adopt. */
#define MEMVISOR_ADOPT_SHARED 1u /* the mapping is MAP_SHARED (otherwise MAP_PRIVATE) */
#define MEMVISOR_ADOPT_FD 2u     /* `fd` and `file_offset` name the file mapped */

/* Memory the caller mapped itself (its own NUMA binding, huge pages, KSM advice), for
 * memvisor_backing_adopt. Zero what is not used: 0 page_size is 4096, no flags is private
 * memory without a file, NULL release calls nothing. */
typedef struct memvisor_adopt {
    void *ptr;            /* the mapping's first byte, page aligned */
    uint64_t size;        /* bytes: whole pages */
    uint64_t page_size;   /* what the kernel backs it with: 4096, or the hugetlbfs page size */
    uint32_t flags;       /* MEMVISOR_ADOPT_* */
    int fd;               /* with MEMVISOR_ADOPT_FD: the file mapped (memvisor keeps a dup) */
    uint64_t file_offset; /* with MEMVISOR_ADOPT_FD: where the mapping starts in it */
    memvisor_release_fn release; /* called once the backing's last user is gone (may be NULL) */
    void *opaque;         /* handed to release */
} memvisor_adopt;

/*
 * Adopts memory the caller mapped: a backing over it that slots, DMA mappings, pins and
 * discards use like one memvisor made, and that memvisor never unmaps. With a file (a memfd,
 * hugetlbfs), its fd can go to a vhost-user back end and discards punch holes in it.
 * Checked, each -EINVAL naming the bad value and nothing adopted (release not called): a
 * NULL or unaligned ptr, a size of no or part pages, a range that wraps or is not wholly
 * mapped in this process, an unknown flag or page size; with a file, one that is not regular,
 * on a file system of another page size, or shorter than the range from file_offset.
 * The caller promises, until release is called: the range stays mapped read-write (no
 * munmap, mremap, MAP_FIXED over it or mprotect), the description is true (shared, page
 * size, the file mapped from that offset), and it reads and writes the memory only as memory
 * shared with a running guest.
 */
int memvisor_backing_adopt(const memvisor_adopt *memory, memvisor_backing **backing);

/* Frees the caller's reference to `backing` (NULL: nothing). */
void memvisor_backing_free(memvisor_backing *backing);

/* The backing's host address (NULL if `backing` is NULL). Memory shared with the guest:
 * read and write it with care (volatile or atomics), as any VMM does. */
void *memvisor_backing_ptr(const memvisor_backing *backing);

/* The backing's size in bytes (0 if `backing` is NULL). */
uint64_t memvisor_backing_size(const memvisor_backing *backing);

/* The backing's file descriptor, or -1 if it has none (private memory) or `backing` is NULL.
 * Owned by the backing: do not close it; dup() it to keep it. */
int memvisor_backing_fd(const memvisor_backing *backing);

/* ---- slot tables: guest physical -> host ------------------------------------------------ */

/*
 * A slot table: guest physical memory as KVM's memslots see it. Made by memvisor_slots_new,
 * freed by memvisor_slots_free (mappings made from it with memvisor_dma_map_guest and
 * discarders over it stay valid). Thread-safe: readers never wait for writers.
 */
typedef struct memvisor_slots memvisor_slots;

#define MEMVISOR_SLOT_READ_ONLY 1u /* KVM_MEM_READONLY: writes through the table fail, -EFAULT */
#define MEMVISOR_SLOT_LOG_DIRTY 2u /* KVM_MEM_LOG_DIRTY_PAGES: writes are logged */

/* A new empty table of at most `max_slots` slots (0: memvisor's default, 32764). */
int memvisor_slots_new(uint32_t max_slots, memvisor_slots **slots);

/* Frees the caller's handle (NULL: nothing). */
void memvisor_slots_free(memvisor_slots *slots);

/*
 * Adds slot `id` at `gpa`: `size` bytes of `backing` from `offset`, with MEMVISOR_SLOT_*
 * `flags`. The slot takes its own reference to the backing. -EEXIST for an id in use or an
 * overlap; -EINVAL for a window outside the backing or misaligned.
 */
int memvisor_slots_insert(const memvisor_slots *slots, uint32_t id, uint64_t gpa,
                          const memvisor_backing *backing, uint64_t offset, uint64_t size,
                          uint32_t flags);

/* Removes slot `id` (-ENOENT if there is none). Readers using it keep it mapped until done. */
int memvisor_slots_remove(const memvisor_slots *slots, uint32_t id);

/* Copies `len` bytes of guest memory at `gpa` into `buf`; -EFAULT, nothing copied, if any
 * of the range is in no slot. */
int memvisor_slots_read(const memvisor_slots *slots, uint64_t gpa, void *buf, size_t len);

/* Copies `len` bytes from `buf` to guest memory at `gpa`; -EFAULT, nothing copied, if any of
 * the range is in no slot or in a read-only slot. Marks LOG_DIRTY slots' logs. */
int memvisor_slots_write(const memvisor_slots *slots, uint64_t gpa, const void *buf,
                         size_t len);

/* The host address of `gpa` in *hva and the bytes contiguous from there in *len (may be
 * NULL); -EFAULT if no slot holds `gpa`. */
int memvisor_slots_lookup(const memvisor_slots *slots, uint64_t gpa, void **hva,
                          uint64_t *len);

/* ---- DMA spaces: IOVA -> host, VFIO type1's rules --------------------------------------- */

/*
 * A DMA space: one device's (or one vIOMMU domain's) I/O address space. Made by
 * memvisor_dma_new, freed by memvisor_dma_free; the space lives on while a cursor or a held
 * scatter-gather list of it exists, and releases every pin it still holds when it goes.
 * Thread-safe: translations, copies and pins run in parallel with maps and unmaps.
 */
typedef struct memvisor_dma memvisor_dma;

#define MEMVISOR_PROT_READ 1u  /* the device reads (memory -> device) */
#define MEMVISOR_PROT_WRITE 2u /* the device writes (device -> memory) */
#define MEMVISOR_PROT_RW 3u

/* A new empty DMA space holding at most `max_mappings` mappings (0: type1's default
 * dma_entry_limit, 65535), otherwise with memvisor's defaults (type1 v2, 4 KiB pages, the
 * process-wide pin registry). */
int memvisor_dma_new(uint32_t max_mappings, memvisor_dma **dma);

/* Frees the caller's handle (NULL: nothing). */
void memvisor_dma_free(memvisor_dma *dma);

/*
 * Maps [iova, iova + size) to `size` bytes of `backing` from `offset`, with MEMVISOR_PROT_*
 * `prot`. The mapping takes its own reference to the backing. As type1: -EEXIST if it
 * overlaps a mapping, -EINVAL if misaligned or empty, -ENOSPC past the mapping limit.
 */
int memvisor_dma_map_backing(const memvisor_dma *dma, uint64_t iova,
                             const memvisor_backing *backing, uint64_t offset, uint64_t size,
                             uint32_t prot);

/* Maps [iova, iova + size) to the guest range [gpa, gpa + size) of `slots` (one mapping per
 * slot crossed, all or nothing); -EFAULT if part of it is in no slot, or a read-only slot
 * and `prot` has WRITE. */
int memvisor_dma_map_guest(const memvisor_dma *dma, uint64_t iova, const memvisor_slots *slots,
                           uint64_t gpa, uint64_t size, uint32_t prot);

/* Maps [iova, iova + size) to `size` bytes of host memory at `hva` that the caller manages
 * itself, with MEMVISOR_PROT_* `prot`; errors as memvisor_dma_map_backing's. The caller
 * promises the memory stays mapped readable (and writable, for WRITE) until the mapping is
 * unmapped; memvisor reads and writes it for devices. Prefer memvisor_backing_adopt, whose
 * backing pins and discards know. */
int memvisor_dma_map_raw(const memvisor_dma *dma, uint64_t iova, void *hva, uint64_t size,
                         uint32_t prot);

/*
 * Unmaps every mapping inside [iova, iova + size) and stores the bytes unmapped in *unmapped
 * (may be NULL). As type1 v2: a range over nothing unmaps 0 bytes and succeeds; a range that
 * would cut a mapping in two is -EINVAL, nothing unmapped. Returns once no device can reach
 * the range (waits for copies in flight and for devices to unpin; -EBUSY, nothing changed, if
 * a pin stays past 1 s).
 */
int memvisor_dma_unmap(const memvisor_dma *dma, uint64_t iova, uint64_t size,
                       uint64_t *unmapped);

/*
 * Translates `len` bytes at `iova` for `access` (MEMVISOR_PROT_*): the host address in *hva,
 * the bytes usable from there (len, or less where the mapping ends) in *avail (may be NULL).
 * -EINVAL if `len` is 0; -EFAULT if nothing is mapped at `iova`; -EPERM if the mapping does
 * not allow `access`; -EBUSY if its host memory is invalidated (memvisor_dma_invalidate_vaddr).
 * Holds nothing: pin or hold what I/O uses after the call returns.
 */
int memvisor_dma_translate(const memvisor_dma *dma, uint64_t iova, uint64_t len,
                           uint32_t access, void **hva, uint64_t *avail);

/* One host-contiguous piece of a translation. */
typedef struct memvisor_segment {
    void *hva;
    uint64_t len;
} memvisor_segment;

/*
 * Translates all of [iova, iova + len) for `access` into at most `capacity` segments; returns
 * the number of segments written (>= 0). -EFAULT if any byte is unmapped;
 * -EPERM without the access; -ENOSPC, nothing written, if more than `capacity` segments are
 * needed.
 */
int memvisor_dma_translate_sg(const memvisor_dma *dma, uint64_t iova, uint64_t len,
                              uint32_t access, memvisor_segment *segments, size_t capacity);

/* One buffer of a request: `len` bytes at `iova` the device reads (MEMVISOR_PROT_READ) or
 * writes (MEMVISOR_PROT_WRITE). */
typedef struct memvisor_sg_buf {
    uint64_t iova;
    uint64_t len;
    uint32_t prot;
} memvisor_sg_buf;

/*
 * A request's pages held in place (an unmap of them waits; a discard skips them) and their
 * host segments. Made by memvisor_dma_hold_sg, released by memvisor_sg_release. Used by one
 * thread at a time; may be released from another thread.
 */
typedef struct memvisor_sg memvisor_sg;

/*
 * Translates the `n` buffers and holds their pages (no mlock, no charge to RLIMIT_MEMLOCK)
 * until memvisor_sg_release. -EFAULT if a buffer's page is not mapped: then nothing is held
 * and *miss_iova (may be NULL) is the first unmapped IOVA. -EPERM if a mapping lacks a
 * buffer's access (type1's answer): nothing is held and *miss_iova is not written.
 */
int memvisor_dma_hold_sg(const memvisor_dma *dma, const memvisor_sg_buf *bufs, size_t n,
                         memvisor_sg **sg, uint64_t *miss_iova);

/* The held segments, in buffer order: stores the array in *segments (owned by `sg`, valid
 * until it is released) and returns their number. */
int memvisor_sg_segments(const memvisor_sg *sg, const memvisor_segment **segments);

/* Lets the held pages go (NULL: nothing). */
void memvisor_sg_release(memvisor_sg *sg);

/* Copies `len` bytes the device reads at `iova` into `buf`. Nothing is copied on failure:
 * -EINVAL if `len` is 0 or any byte is unmapped (type1's vfio_dma_rw), -EPERM if a mapping
 * lacks READ, -EFAULT if its host address is invalidated. */
int memvisor_dma_read(const memvisor_dma *dma, uint64_t iova, void *buf, size_t len);

/* Copies `len` bytes from `buf` to `iova` as the device writing; errors as memvisor_dma_read
 * (the mappings need READ and WRITE, as type1 checks). Marks the dirty log while tracking is
 * on. */
int memvisor_dma_write(const memvisor_dma *dma, uint64_t iova, const void *buf, size_t len);

/*
 * Pins the `n` IOVA pages `pages` (page numbers: iova >> 12) for `prot`, all or nothing, and
 * stores their host addresses in hvas[0..n) (hvas may be NULL). Pins nest per page; each
 * needs one memvisor_dma_unpin_pages. -EINVAL if `n` is 0 or a page is not mapped; -EPERM
 * if a mapping lacks `prot`; -E2BIG past 512 pages; -ENOMEM past RLIMIT_MEMLOCK. While dirty
 * tracking is on, pinned pages read as dirty until unpinned.
 */
int memvisor_dma_pin_pages(const memvisor_dma *dma, const uint64_t *pages, size_t n,
                           uint32_t prot, void **hvas);

/* Unpins pages pinned by memvisor_dma_pin_pages; -EINVAL, nothing unpinned, if one is not
 * pinned. */
int memvisor_dma_unpin_pages(const memvisor_dma *dma, const uint64_t *pages, size_t n);

/* How many IOVA pages memvisor_dma_pin_pages holds pinned in this space now, each counted
 * once however many pins it has (0 if `dma` is NULL). */
uint64_t memvisor_dma_pinned_pages(const memvisor_dma *dma);

/*
 * VFIO_DMA_UNMAP_FLAG_VADDR: the mappings inside [iova, iova + size) keep their IOVAs but
 * lose their host memory until memvisor_dma_update_vaddr; translations there fail meanwhile.
 * Stores the bytes invalidated in *invalidated (may be NULL).
 */
int memvisor_dma_invalidate_vaddr(const memvisor_dma *dma, uint64_t iova, uint64_t size,
                                  uint64_t *invalidated);

/* VFIO_DMA_MAP_FLAG_VADDR: gives the invalidated mapping at exactly [iova, iova + size) its
 * new host memory, `size` bytes of `backing` from `offset`. -ENOENT if no mapping is there;
 * -EINVAL if it is not invalidated or not exactly that range. */
int memvisor_dma_update_vaddr(const memvisor_dma *dma, uint64_t iova, uint64_t size,
                              const memvisor_backing *backing, uint64_t offset);

/*
 * An IOTLB update (vhost's VHOST_IOTLB_UPDATE, a vIOMMU's map): [iova, iova + size) maps
 * `size` bytes of `backing` from `offset` with MEMVISOR_PROT_* `prot`, after whatever the
 * range held was removed as memvisor_dma_invalidate_range removes it, in one step: unlike
 * memvisor_dma_map_backing, an overlap is replaced, not -EEXIST. -EINVAL if misaligned,
 * empty or past the backing, -ENOSPC past the mapping limit (nothing changed), -EBUSY from
 * the removal.
 */
int memvisor_dma_iotlb_map(const memvisor_dma *dma, uint64_t iova,
                           const memvisor_backing *backing, uint64_t offset, uint64_t size,
                           uint32_t prot);

/*
 * An IOTLB invalidation (VHOST_IOTLB_INVALIDATE, a page-selective IOMMU invalidation):
 * removes every translation in [iova, iova + size), cutting mappings at its edges (the parts
 * outside stay mapped, with the same host memory, protection and dirty bits), and stores the
 * bytes removed in *removed (may be NULL; 0 if nothing was mapped there). Returns once no
 * device can reach the range; -EBUSY, nothing changed, if a device keeps pins there past 1 s.
 * -EINVAL if the range is empty, wraps or is not page aligned.
 */
int memvisor_dma_invalidate_range(const memvisor_dma *dma, uint64_t iova, uint64_t size,
                                  uint64_t *removed);

/* Starts dirty page tracking (VFIO_IOMMU_DIRTY_PAGES_FLAG_START): every mapping gets a clear
 * bitmap; pages written by memvisor_dma_write, translated for WRITE (memvisor_dma_translate,
 * _translate_sg, cursors, held WRITE buffers) or pinned are marked. Starting twice keeps the
 * bitmaps. */
int memvisor_dma_dirty_start(const memvisor_dma *dma);

/* Stops dirty page tracking. */
int memvisor_dma_dirty_stop(const memvisor_dma *dma);

/*
 * Reads and clears the dirty bitmap of [iova, iova + size) at `page_size` (4096): bit i of
 * the bitmap (word i / 64, bit i % 64) is the page at iova + i * page_size. `bitmap` holds
 * `words` 64-bit words, at least one bit per page. Pinned pages stay dirty. -EINVAL if
 * tracking is off, the range is misaligned, cuts a mapping, or `words` is too small.
 */
int memvisor_dma_dirty_get_and_clear(const memvisor_dma *dma, uint64_t iova, uint64_t size,
                                     uint64_t page_size, uint64_t *bitmap, size_t words);

/*
 * Unmaps every mapping inside [iova, iova + size) as memvisor_dma_unmap does, storing the
 * bytes unmapped in *unmapped (may be NULL), and reads the removed range's dirty bitmap in
 * the same step (VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP), laid out as in
 * memvisor_dma_dirty_get_and_clear. -EINVAL, nothing unmapped, if tracking is off, the bitmap
 * arguments are wrong or `words` is too small for the range.
 */
int memvisor_dma_unmap_get_dirty(const memvisor_dma *dma, uint64_t iova, uint64_t size,
                                 uint64_t page_size, uint64_t *bitmap, size_t words,
                                 uint64_t *unmapped);

/* ---- cursors: a thread's fast path -------------------------------------------------------- */

/*
 * A translation cursor: remembers the last mapping it hit, so a thread's repeat translations
 * cost a bounds check. Made by memvisor_cursor_new, freed by memvisor_cursor_free; keeps its
 * space alive. One thread at a time (one cursor per thread).
 */
typedef struct memvisor_cursor memvisor_cursor;

/* A new cursor over `dma`. */
int memvisor_cursor_new(const memvisor_dma *dma, memvisor_cursor **cursor);

/* Frees the cursor (NULL: nothing). */
void memvisor_cursor_free(memvisor_cursor *cursor);

/* memvisor_dma_translate through the cursor: same answers, same errors. */
int memvisor_cursor_translate(memvisor_cursor *cursor, uint64_t iova, uint64_t len,
                              uint32_t access, void **hva, uint64_t *avail);

/* ---- free page reporting: discards around pins ------------------------------------------ */

/*
 * Gives memory the guest reported free back to the host, never a pinned page (a device may
 * be writing it). Made by memvisor_discarder_new over a slot table, freed by
 * memvisor_discarder_free. Thread-safe.
 */
typedef struct memvisor_discarder memvisor_discarder;

/* A guest range reported free. */
typedef struct memvisor_range {
    uint64_t gpa;
    uint64_t len;
} memvisor_range;

/* What a report did: for each range, its bytes were discarded, skipped or rejected. */
typedef struct memvisor_report {
    uint64_t discarded;      /* given back to the host (reads as zeros, or old bytes with MADV_FREE) */
    uint64_t skipped_pinned; /* kept because a pin or a held request holds them */
    uint64_t rejected;       /* refused: outside guest memory, read-only, private file, ... */
} memvisor_report;

/* A discarder over `slots` respecting the pins of every DMA space made by memvisor_dma_new;
 * `use_madv_free` non-zero discards private memory with MADV_FREE instead of MADV_DONTNEED. */
int memvisor_discarder_new(const memvisor_slots *slots, int use_madv_free,
                           memvisor_discarder **discarder);

/* Frees the discarder (NULL: nothing). */
void memvisor_discarder_free(memvisor_discarder *discarder);

/* Discards the `n` reported ranges except pinned pages; stores what happened in *report.
 * Refused ranges are counted in report->rejected, not an error. */
int memvisor_discard_report(const memvisor_discarder *discarder, const memvisor_range *ranges,
                            size_t n, memvisor_report *report);

#ifdef __cplusplus
}
#endif

#endif /* MEMVISOR_H */
