/* Pins through C: host addresses, nested counts, all-or-nothing unpin, and the dirty log a
 * write sets (and a pin keeps). */
#include <errno.h>
#include <stdint.h>

#include "check.h"

static void pin_counts(void) {
    memvisor_backing *ram;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 1 * MIB, &ram));
    OK(memvisor_dma_new(0, &dma));
    const uint64_t iova = 64 * MIB;
    OK(memvisor_dma_map_backing(dma, iova, ram, 0, 1 * MIB, MEMVISOR_PROT_RW));
    CHECK(memvisor_dma_pinned_pages(dma) == 0);

    uint64_t pages[3] = {iova / PAGE, iova / PAGE + 1, iova / PAGE + 7};
    void *hvas[3] = {0};
    OK(memvisor_dma_pin_pages(dma, pages, 3, MEMVISOR_PROT_WRITE, hvas));
    CHECK(memvisor_dma_pinned_pages(dma) == 3);
    CHECK(hvas[0] == memvisor_backing_ptr(ram));
    CHECK((char *)hvas[2] == (char *)memvisor_backing_ptr(ram) + 7 * PAGE);

    /* Pins nest: page 7 twice now (still 3 pages pinned); one unpin of all three leaves it
     * pinned once. */
    OK(memvisor_dma_pin_pages(dma, &pages[2], 1, MEMVISOR_PROT_READ, NULL));
    CHECK(memvisor_dma_pinned_pages(dma) == 3);
    OK(memvisor_dma_unpin_pages(dma, pages, 3));
    CHECK(memvisor_dma_pinned_pages(dma) == 1);
    /* Unpinning what is not pinned is EINVAL and unpins nothing. */
    FAILS(memvisor_dma_unpin_pages(dma, pages, 3), EINVAL, "not pinned");
    CHECK(memvisor_dma_pinned_pages(dma) == 1);
    OK(memvisor_dma_unpin_pages(dma, &pages[2], 1));
    CHECK(memvisor_dma_pinned_pages(dma) == 0);

    /* A pin of an unmapped page fails whole (EINVAL, as type1): nothing stays pinned. */
    uint64_t mixed[2] = {iova / PAGE, 0};
    FAILS(memvisor_dma_pin_pages(dma, mixed, 2, MEMVISOR_PROT_READ, NULL), EINVAL, "");
    CHECK(memvisor_dma_pinned_pages(dma) == 0);
    /* An empty list is EINVAL too. */
    FAILS(memvisor_dma_pin_pages(dma, pages, 0, MEMVISOR_PROT_READ, NULL), EINVAL, "");
    CHECK(memvisor_dma_pinned_pages(dma) == 0);

    memvisor_dma_free(dma);
    memvisor_backing_free(ram);
}

static void dirty_log(void) {
    memvisor_backing *ram;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 1 * MIB, &ram));
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, 1 * MIB, MEMVISOR_PROT_RW));
    uint64_t bitmap[4]; /* 256 pages */
    /* Off: reading the log is EINVAL. */
    FAILS(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4), EINVAL, "");

    OK(memvisor_dma_dirty_start(dma));
    /* Clean at the start: nothing pinned, devices write only through the space. */
    memset(bitmap, 0xff, sizeof bitmap);
    OK(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4));
    for (int i = 0; i < 4; i++)
        CHECK(bitmap[i] == 0);

    /* A device write to pages 3 and 70 (crossing into 71), and a read, which marks nothing. */
    OK(memvisor_dma_write(dma, 3 * PAGE + 100, "x", 1));
    OK(memvisor_dma_write(dma, 71 * PAGE - 2, "xyz", 3));
    char c;
    OK(memvisor_dma_read(dma, 200 * PAGE, &c, 1));
    OK(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4));
    CHECK(bitmap[0] == (1ull << 3));
    CHECK(bitmap[1] == ((1ull << (70 - 64)) | (1ull << (71 - 64))));
    CHECK(bitmap[2] == 0 && bitmap[3] == 0);
    /* A translation for WRITE marks its page (the device writes through the pointer). */
    void *hva;
    OK(memvisor_dma_translate(dma, 130 * PAGE, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    OK(memvisor_dma_translate(dma, 140 * PAGE, 8, MEMVISOR_PROT_READ, &hva, NULL));
    OK(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4));
    CHECK(bitmap[0] == 0 && bitmap[1] == 0 && bitmap[2] == (1ull << (130 - 128)) && bitmap[3] == 0);
    /* Read and cleared. */
    OK(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4));
    CHECK(bitmap[0] == 0 && bitmap[1] == 0);

    /* A page pinned for WRITE stays dirty: the device may write it any time. */
    uint64_t page = 9;
    OK(memvisor_dma_pin_pages(dma, &page, 1, MEMVISOR_PROT_WRITE, NULL));
    OK(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4));
    CHECK(bitmap[0] == (1ull << 9));
    OK(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4));
    CHECK(bitmap[0] == (1ull << 9));
    OK(memvisor_dma_unpin_pages(dma, &page, 1));

    /* A bitmap too small for the range is refused. */
    FAILS(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 3), EINVAL, "");
    OK(memvisor_dma_dirty_stop(dma));
    FAILS(memvisor_dma_dirty_get_and_clear(dma, 0, 1 * MIB, PAGE, bitmap, 4), EINVAL, "");
    memvisor_dma_free(dma);
    memvisor_backing_free(ram);
}

/* An unmap that returns the range's dirty bits (VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP): the
 * bits of the mappings removed, nothing unmapped when the call fails. */
static void unmap_with_dirty_bits(void) {
    memvisor_backing *ram;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 1 * MIB, &ram));
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, 512 * KIB, MEMVISOR_PROT_RW));
    OK(memvisor_dma_map_backing(dma, 512 * KIB, ram, 512 * KIB, 512 * KIB, MEMVISOR_PROT_RW));
    uint64_t bitmap[4], unmapped = 99;
    /* Tracking off: EINVAL, both mappings still there. */
    FAILS(memvisor_dma_unmap_get_dirty(dma, 0, 1 * MIB, PAGE, bitmap, 4, &unmapped), EINVAL, "");
    CHECK(unmapped == 99);
    OK(memvisor_dma_dirty_start(dma));
    OK(memvisor_dma_write(dma, 5 * PAGE, "a", 1));
    OK(memvisor_dma_write(dma, 130 * PAGE + 7, "b", 1));
    /* A bitmap too small for the range: EINVAL naming it, nothing unmapped. */
    FAILS(memvisor_dma_unmap_get_dirty(dma, 0, 1 * MIB, PAGE, bitmap, 3, &unmapped), EINVAL, "too small");
    void *hva;
    OK(memvisor_dma_translate(dma, 5 * PAGE, 1, MEMVISOR_PROT_READ, &hva, NULL));
    /* The first mapping goes with its bits: page 5 only. */
    memset(bitmap, 0xff, sizeof bitmap);
    OK(memvisor_dma_unmap_get_dirty(dma, 0, 512 * KIB, PAGE, bitmap, 2, &unmapped));
    CHECK(unmapped == 512 * KIB);
    CHECK(bitmap[0] == (1ull << 5) && bitmap[1] == 0);
    FAILS(memvisor_dma_translate(dma, 5 * PAGE, 1, MEMVISOR_PROT_READ, &hva, NULL), EFAULT, "");
    /* The second one's bit counts from the range's start: page 130 is bit 2 of word 0. */
    OK(memvisor_dma_unmap_get_dirty(dma, 512 * KIB, 512 * KIB, PAGE, bitmap, 2, NULL));
    CHECK(bitmap[0] == (1ull << 2) && bitmap[1] == 0);
    /* Cutting a mapping is EINVAL as memvisor_dma_unmap's. */
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, 1 * MIB, MEMVISOR_PROT_RW));
    FAILS(memvisor_dma_unmap_get_dirty(dma, 0, 4 * PAGE, PAGE, bitmap, 1, &unmapped), EINVAL, "");
    OK(memvisor_dma_translate(dma, 0, 1, MEMVISOR_PROT_READ, &hva, NULL));
    memvisor_dma_free(dma);
    memvisor_backing_free(ram);
}

int main(void) {
    pin_counts();
    dirty_log();
    unmap_with_dirty_bits();
    puts("ok: pin");
    return 0;
}
