/* DmaSpace through C: map, translate (single and scatter-gather), read/write, unmap with
 * type1's answers, held scatter-gather lists, and arguments C alone can get wrong. */
#include <errno.h>
#include <stdint.h>

#include "check.h"

static void map_translate_read_write(void) {
    memvisor_backing *ram;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 2 * MIB, &ram));
    OK(memvisor_dma_new(0, &dma));
    const uint64_t iova = 1ull << 30;
    OK(memvisor_dma_map_backing(dma, iova, ram, 0, 2 * MIB, MEMVISOR_PROT_RW));

    /* The host address is the backing's, offset by the IOVA's. */
    void *hva = NULL;
    uint64_t avail = 0;
    OK(memvisor_dma_translate(dma, iova + 3 * PAGE + 8, 100, MEMVISOR_PROT_WRITE, &hva, &avail));
    CHECK((char *)hva == (char *)memvisor_backing_ptr(ram) + 3 * PAGE + 8);
    CHECK(avail == 100);
    /* Near the end only what is left of the mapping is usable. */
    OK(memvisor_dma_translate(dma, iova + 2 * MIB - 16, 100, MEMVISOR_PROT_READ, &hva, &avail));
    CHECK(avail == 16);

    /* Written through the C pointer, read back through memvisor_dma_read... */
    OK(memvisor_dma_translate(dma, iova + 5 * PAGE, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    memcpy(hva, "by hand!", 8);
    char buf[8];
    OK(memvisor_dma_read(dma, iova + 5 * PAGE, buf, sizeof buf));
    CHECK(memcmp(buf, "by hand!", 8) == 0);
    /* ...and the other way round, across a page boundary. */
    OK(memvisor_dma_write(dma, iova + 6 * PAGE - 3, "device", 6));
    CHECK(memcmp((char *)memvisor_backing_ptr(ram) + 6 * PAGE - 3, "device", 6) == 0);

    /* The cursor gives the same answers. */
    memvisor_cursor *cursor;
    OK(memvisor_cursor_new(dma, &cursor));
    void *again = NULL;
    OK(memvisor_cursor_translate(cursor, iova + 5 * PAGE, 8, MEMVISOR_PROT_READ, &again, NULL));
    CHECK(again == hva);

    /* type1 v2: a hole unmaps 0 bytes and succeeds; cutting a mapping in two is EINVAL and
     * leaves it mapped. */
    uint64_t unmapped = 99;
    OK(memvisor_dma_unmap(dma, 0, 1 * MIB, &unmapped));
    CHECK(unmapped == 0);
    FAILS(memvisor_dma_unmap(dma, iova, PAGE, &unmapped), EINVAL, "");
    CHECK(unmapped == 0);
    OK(memvisor_dma_translate(dma, iova, PAGE, MEMVISOR_PROT_READ, &hva, NULL));
    /* The whole mapping goes; translations there fail after. */
    OK(memvisor_dma_unmap(dma, iova, 2 * MIB, &unmapped));
    CHECK(unmapped == 2 * MIB);
    FAILS(memvisor_dma_translate(dma, iova, PAGE, MEMVISOR_PROT_READ, &hva, NULL), EFAULT, "0x40000000");
    FAILS(memvisor_cursor_translate(cursor, iova, PAGE, MEMVISOR_PROT_READ, &hva, NULL), EFAULT, "");
    /* A copy over a hole is EINVAL, as type1's vfio_dma_rw. */
    FAILS(memvisor_dma_read(dma, iova, buf, 1), EINVAL, "nothing is mapped at iova 0x40000000");

    memvisor_cursor_free(cursor);
    memvisor_dma_free(dma);
    memvisor_backing_free(ram);
}

static void permissions_and_overlaps(void) {
    memvisor_backing *ram;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 1 * MIB, &ram));
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, 1 * MIB, MEMVISOR_PROT_READ));
    void *hva;
    FAILS(memvisor_dma_translate(dma, 0, 8, MEMVISOR_PROT_WRITE, &hva, NULL), EPERM, "");
    FAILS(memvisor_dma_write(dma, 0, "x", 1), EPERM, "");
    FAILS(memvisor_dma_map_backing(dma, 4 * KIB, ram, 0, PAGE, MEMVISOR_PROT_RW), EEXIST, "");
    FAILS(memvisor_dma_map_backing(dma, 2 * MIB + 1, ram, 0, PAGE, MEMVISOR_PROT_RW), EINVAL, "");
    memvisor_dma_free(dma);

    /* max_mappings is type1's dma_entry_limit: past it, ENOSPC. */
    OK(memvisor_dma_new(2, &dma));
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, PAGE, MEMVISOR_PROT_RW));
    OK(memvisor_dma_map_backing(dma, 2 * PAGE, ram, 0, PAGE, MEMVISOR_PROT_RW));
    FAILS(memvisor_dma_map_backing(dma, 4 * PAGE, ram, 0, PAGE, MEMVISOR_PROT_RW), ENOSPC, "limit");
    memvisor_dma_free(dma);
    memvisor_backing_free(ram);
}

static void scatter_gather(void) {
    /* Two backings mapped back to back in IOVA: one range, two host pieces. */
    memvisor_backing *a, *b;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 1 * MIB, &a));
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 1 * MIB, &b));
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, a, 0, 1 * MIB, MEMVISOR_PROT_RW));
    OK(memvisor_dma_map_backing(dma, 1 * MIB, b, 0, 1 * MIB, MEMVISOR_PROT_RW));

    memvisor_segment segs[4];
    int n = memvisor_dma_translate_sg(dma, 1 * MIB - PAGE, 3 * PAGE, MEMVISOR_PROT_READ, segs, 4);
    CHECK(n == 2);
    CHECK((char *)segs[0].hva == (char *)memvisor_backing_ptr(a) + 1 * MIB - PAGE);
    CHECK(segs[0].len == PAGE);
    CHECK(segs[1].hva == memvisor_backing_ptr(b));
    CHECK(segs[1].len == 2 * PAGE);
    FAILS(memvisor_dma_translate_sg(dma, 1 * MIB - PAGE, 3 * PAGE, MEMVISOR_PROT_READ, segs, 1),
          ENOSPC, "capacity is 1");
    FAILS(memvisor_dma_translate_sg(dma, 2 * MIB - PAGE, 2 * PAGE, MEMVISOR_PROT_READ, segs, 4),
          EFAULT, "");

    /* A request's buffers held: the segments point where the data is. */
    memvisor_sg_buf bufs[2] = {
        {.iova = 16, .len = 32, .prot = MEMVISOR_PROT_READ},
        {.iova = 1 * MIB - 8, .len = 16, .prot = MEMVISOR_PROT_WRITE},
    };
    memvisor_sg *sg;
    uint64_t miss = 0;
    OK(memvisor_dma_hold_sg(dma, bufs, 2, &sg, &miss));
    const memvisor_segment *held;
    n = memvisor_sg_segments(sg, &held);
    CHECK(n == 3);
    CHECK((char *)held[0].hva == (char *)memvisor_backing_ptr(a) + 16 && held[0].len == 32);
    CHECK((char *)held[1].hva == (char *)memvisor_backing_ptr(a) + 1 * MIB - 8 && held[1].len == 8);
    CHECK(held[2].hva == memvisor_backing_ptr(b) && held[2].len == 8);
    memvisor_sg_release(sg);

    /* A buffer past the mappings: nothing held, the first unmapped IOVA named. */
    memvisor_sg_buf far = {.iova = 2 * MIB + 100, .len = 4, .prot = MEMVISOR_PROT_WRITE};
    sg = NULL;
    FAILS(memvisor_dma_hold_sg(dma, &far, 1, &sg, &miss), EFAULT, "0x200064");
    CHECK(sg == NULL && miss == 2 * MIB + 100);

    memvisor_dma_free(dma);
    memvisor_backing_free(a);
    memvisor_backing_free(b);
}

/* A vIOMMU's traffic: updates replace what their range held, invalidations cut mappings at
 * their edges and keep the parts outside, with the same host memory. */
static void iotlb_updates_and_invalidations(void) {
    memvisor_backing *a, *b;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 2 * MIB, &a));
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 1 * MIB, &b));
    OK(memvisor_dma_new(0, &dma));
    const uint64_t iova = 1ull << 32;
    char *base = memvisor_backing_ptr(a);
    OK(memvisor_dma_iotlb_map(dma, iova, a, 0, 2 * MIB, MEMVISOR_PROT_RW));

    /* 4 KiB out of the middle: that page is gone, its neighbours translate as before. */
    uint64_t removed = 99;
    OK(memvisor_dma_invalidate_range(dma, iova + 10 * PAGE, PAGE, &removed));
    CHECK(removed == PAGE);
    void *hva;
    uint64_t avail;
    FAILS(memvisor_dma_translate(dma, iova + 10 * PAGE, 8, MEMVISOR_PROT_READ, &hva, NULL), EFAULT, "");
    OK(memvisor_dma_translate(dma, iova + 9 * PAGE + 8, 8, MEMVISOR_PROT_WRITE, &hva, &avail));
    CHECK((char *)hva == base + 9 * PAGE + 8);
    OK(memvisor_dma_translate(dma, iova + 11 * PAGE, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    CHECK((char *)hva == base + 11 * PAGE);
    /* The left part ends where the invalidation began. */
    OK(memvisor_dma_translate(dma, iova + 9 * PAGE, 2 * PAGE, MEMVISOR_PROT_READ, &hva, &avail));
    CHECK(avail == PAGE);
    /* Nothing there: 0 bytes, success (removed may be NULL). */
    OK(memvisor_dma_invalidate_range(dma, iova + 10 * PAGE, PAGE, &removed));
    CHECK(removed == 0);
    OK(memvisor_dma_invalidate_range(dma, 0, PAGE, NULL));

    /* An update over mapped pages replaces them (map_backing would be EEXIST). */
    FAILS(memvisor_dma_map_backing(dma, iova + 8 * PAGE, b, 0, 4 * PAGE, MEMVISOR_PROT_READ), EEXIST, "");
    OK(memvisor_dma_iotlb_map(dma, iova + 8 * PAGE, b, 0, 4 * PAGE, MEMVISOR_PROT_READ));
    OK(memvisor_dma_translate(dma, iova + 9 * PAGE, 8, MEMVISOR_PROT_READ, &hva, NULL));
    CHECK((char *)hva == (char *)memvisor_backing_ptr(b) + PAGE);
    FAILS(memvisor_dma_translate(dma, iova + 9 * PAGE, 8, MEMVISOR_PROT_WRITE, &hva, NULL), EPERM, "");
    OK(memvisor_dma_translate(dma, iova + 12 * PAGE, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    CHECK((char *)hva == base + 12 * PAGE);
    OK(memvisor_dma_translate(dma, iova + 7 * PAGE, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    CHECK((char *)hva == base + 7 * PAGE);

    /* Bad ranges are EINVAL and change nothing. */
    FAILS(memvisor_dma_invalidate_range(dma, iova + 1, PAGE, NULL), EINVAL, "");
    FAILS(memvisor_dma_invalidate_range(dma, iova, 0, NULL), EINVAL, "");
    FAILS(memvisor_dma_iotlb_map(dma, iova, b, 0, 2 * MIB, MEMVISOR_PROT_RW), EINVAL, "");
    FAILS(memvisor_dma_iotlb_map(dma, iova, a, 0, PAGE, 8), EINVAL, "prot 0x8");
    FAILS(memvisor_dma_iotlb_map(dma, iova, NULL, 0, PAGE, MEMVISOR_PROT_RW), EINVAL, "backing is NULL");
    OK(memvisor_dma_translate(dma, iova, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    CHECK((char *)hva == base);

    /* Everything at once (a lazy guest's global flush). */
    OK(memvisor_dma_invalidate_range(dma, 0, 1ull << 40, &removed));
    CHECK(removed == 2 * MIB);
    FAILS(memvisor_dma_translate(dma, iova, 8, MEMVISOR_PROT_READ, &hva, NULL), EFAULT, "");
    memvisor_dma_free(dma);
    memvisor_backing_free(a);
    memvisor_backing_free(b);
}

static void bad_arguments_are_einval_naming_them(void) {
    memvisor_backing *ram;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 1 * MIB, &ram));
    OK(memvisor_dma_new(0, &dma));
    void *hva;
    FAILS(memvisor_dma_new(0, NULL), EINVAL, "dma is NULL");
    FAILS(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, MIB, NULL), EINVAL, "backing is NULL");
    FAILS(memvisor_backing_new(42, MIB, &ram), EINVAL, "kind 42");
    FAILS(memvisor_backing_from_fd(-1, 0, MIB, &ram), EINVAL, "fd -1");
    FAILS(memvisor_dma_map_backing(NULL, 0, ram, 0, MIB, MEMVISOR_PROT_RW), EINVAL, "dma is NULL");
    FAILS(memvisor_dma_map_backing(dma, 0, NULL, 0, MIB, MEMVISOR_PROT_RW), EINVAL, "backing is NULL");
    FAILS(memvisor_dma_map_backing(dma, 0, ram, 0, MIB, 4), EINVAL, "prot 0x4");
    FAILS(memvisor_dma_map_backing(dma, 0, ram, 0, 0, MEMVISOR_PROT_RW), EINVAL, "");
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, MIB, MEMVISOR_PROT_RW));
    FAILS(memvisor_dma_translate(dma, 0, 8, MEMVISOR_PROT_READ, NULL, NULL), EINVAL, "hva is NULL");
    FAILS(memvisor_dma_translate(dma, 0, 8, 0, &hva, NULL), EINVAL, "access 0x0");
    FAILS(memvisor_dma_read(dma, 0, NULL, 8), EINVAL, "buf is NULL");
    FAILS(memvisor_dma_write(dma, 0, NULL, 8), EINVAL, "buf is NULL");
    FAILS(memvisor_dma_read(dma, 0, &hva, SIZE_MAX), EINVAL, "len");
    FAILS(memvisor_dma_translate_sg(dma, 0, 8, MEMVISOR_PROT_READ, NULL, 4), EINVAL, "segments is NULL");
    FAILS(memvisor_dma_pin_pages(dma, NULL, 2, MEMVISOR_PROT_READ, NULL), EINVAL, "pages is NULL");
    FAILS(memvisor_dma_dirty_get_and_clear(dma, 0, MIB, PAGE, NULL, 4), EINVAL, "bitmap is NULL");
    FAILS(memvisor_dma_hold_sg(dma, NULL, 0, NULL, NULL), EINVAL, "sg is NULL");
    /* NULL with length 0 passes the argument check and reaches memvisor's own: no bytes. */
    FAILS(memvisor_dma_read(dma, 0, NULL, 0), EINVAL, "size is 0");
    /* Free functions and getters take NULL. */
    memvisor_dma_free(NULL);
    memvisor_backing_free(NULL);
    memvisor_cursor_free(NULL);
    memvisor_sg_release(NULL);
    memvisor_slots_free(NULL);
    memvisor_discarder_free(NULL);
    CHECK(memvisor_backing_ptr(NULL) == NULL && memvisor_backing_size(NULL) == 0);
    CHECK(memvisor_backing_fd(NULL) == -1 && memvisor_dma_pinned_pages(NULL) == 0);
    /* A failed call left the space as it was. */
    OK(memvisor_dma_translate(dma, 0, 8, MEMVISOR_PROT_READ, &hva, NULL));
    CHECK(hva == memvisor_backing_ptr(ram));
    memvisor_dma_free(dma);
    memvisor_backing_free(ram);
}

int main(void) {
    map_translate_read_write();
    permissions_and_overlaps();
    scatter_gather();
    iotlb_updates_and_invalidations();
    bad_arguments_are_einval_naming_them();
    puts("ok: dma");
    return 0;
}
