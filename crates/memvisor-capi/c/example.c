/* The README's library tour, in C: guest RAM in a memfd placed in a slot table, a DMA space
 * the guest's IOMMU programs, a device copying by IOVA, pins for asynchronous I/O, and a
 * typed error with type1's errno. Built and run by c/run.sh. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "memvisor.h"

/* Any failure: say which call and why, and stop. */
#define TRY(call)                                                                            \
    do {                                                                                     \
        int rc_ = (call);                                                                    \
        if (rc_ < 0) {                                                                       \
            fprintf(stderr, "%s failed (%d): %s\n", #call, rc_, memvisor_last_error());      \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

int main(void) {
    const uint64_t MiB = 1 << 20, GiB = 1 << 30;

    /* 4 MiB of guest RAM at guest address 0, in a memfd (its fd can go to a vhost-user back
     * end). */
    memvisor_backing *ram;
    memvisor_slots *slots;
    TRY(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 4 * MiB, &ram));
    TRY(memvisor_slots_new(0, &slots));
    TRY(memvisor_slots_insert(slots, 0, 0, ram, 0, 4 * MiB, 0));
    memvisor_backing_free(ram); /* the slot keeps it */

    /* The guest programs its IOMMU: IOVA 1 GiB -> guest RAM [1 MiB, 2 MiB). */
    memvisor_dma *dma;
    TRY(memvisor_dma_new(0, &dma));
    TRY(memvisor_dma_map_guest(dma, GiB, slots, 1 * MiB, 1 * MiB, MEMVISOR_PROT_RW));

    /* A device copies into guest memory by IOVA; the CPU side sees it at the guest address. */
    TRY(memvisor_dma_write(dma, GiB + 64, "descriptor", 10));
    char buf[10];
    TRY(memvisor_slots_read(slots, 1 * MiB + 64, buf, sizeof buf));
    if (memcmp(buf, "descriptor", 10) != 0) {
        fprintf(stderr, "read back something else\n");
        return 1;
    }

    /* Pages handed to asynchronous I/O are pinned (by IOVA page number) and unpinned after. */
    uint64_t pages[2] = {GiB >> 12, (GiB >> 12) + 1};
    void *hvas[2];
    TRY(memvisor_dma_pin_pages(dma, pages, 2, MEMVISOR_PROT_WRITE, hvas));
    printf("IOVA page %#" PRIx64 " is at host address %p\n", pages[0], hvas[0]);
    TRY(memvisor_dma_unpin_pages(dma, pages, 2));

    /* Bad input is a negative errno, with a message naming the value. */
    int rc = memvisor_dma_unmap(dma, GiB, 4096, NULL); /* would cut a mapping in two */
    if (rc != -EINVAL) {
        fprintf(stderr, "unmap of half a mapping gave %d, not -EINVAL as type1\n", rc);
        return 1;
    }
    printf("errno %d: %s\n", -rc, memvisor_last_error());

    memvisor_dma_free(dma);
    memvisor_slots_free(slots);
    return 0;
}
