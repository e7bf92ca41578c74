/* Slot tables, backings from an fd, guest mappings, live update of host addresses (vaddr),
 * and free page reporting's discards around pins. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

static void slots_and_fds(void) {
    /* A memfd of the caller's, handed to memvisor: both see the same bytes. */
    int fd = memfd_create("guest-ram", MFD_CLOEXEC);
    CHECK(fd >= 0);
    CHECK(ftruncate(fd, 4 * MIB) == 0);
    memvisor_backing *low;
    OK(memvisor_backing_from_fd(fd, 2 * MIB, 2 * MIB, &low));
    CHECK(memvisor_backing_size(low) == 2 * MIB);
    CHECK(memvisor_backing_fd(low) >= 0 && memvisor_backing_fd(low) != fd);
    CHECK(pwrite(fd, "from the fd", 11, 2 * MIB + 64) == 11);
    close(fd); /* memvisor keeps its own duplicate */

    memvisor_backing *high;
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 2 * MIB, &high));
    memvisor_slots *slots;
    OK(memvisor_slots_new(0, &slots));
    OK(memvisor_slots_insert(slots, 0, 0, low, 0, 2 * MIB, 0));
    OK(memvisor_slots_insert(slots, 1, 2 * MIB, high, 0, 2 * MIB, MEMVISOR_SLOT_READ_ONLY));
    FAILS(memvisor_slots_insert(slots, 0, 8 * MIB, high, 0, 2 * MIB, 0), EEXIST, "");
    FAILS(memvisor_slots_insert(slots, 2, 1 * MIB, high, 0, 2 * MIB, 0), EEXIST, "");
    FAILS(memvisor_slots_insert(slots, 2, 8 * MIB, high, 0, 2 * MIB, 8), EINVAL, "flags 0x8");

    char buf[11];
    OK(memvisor_slots_read(slots, 64, buf, 11));
    CHECK(memcmp(buf, "from the fd", 11) == 0);
    void *hva;
    uint64_t len;
    OK(memvisor_slots_lookup(slots, 2 * MIB + 5, &hva, &len));
    CHECK((char *)hva == (char *)memvisor_backing_ptr(high) + 5 && len == 2 * MIB - 5);
    /* Read-only slot: writes through the table fail, EFAULT, as KVM. */
    FAILS(memvisor_slots_write(slots, 2 * MIB + 8, "x", 1), EFAULT, "");
    FAILS(memvisor_slots_read(slots, 1ull << 30, buf, 1), EFAULT, "0x40000000");

    /* The slot keeps its backing: the caller's handle may go first. */
    memvisor_backing_free(low);
    OK(memvisor_slots_write(slots, 100, "still", 5));
    OK(memvisor_slots_read(slots, 100, buf, 5));
    CHECK(memcmp(buf, "still", 5) == 0);

    OK(memvisor_slots_remove(slots, 0));
    FAILS(memvisor_slots_remove(slots, 0), ENOENT, "");
    FAILS(memvisor_slots_read(slots, 100, buf, 1), EFAULT, "");
    memvisor_slots_free(slots);
    memvisor_backing_free(high);
}

static void vaddr_update(void) {
    memvisor_backing *old, *new_;
    memvisor_dma *dma;
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 1 * MIB, &old));
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 1 * MIB, &new_));
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, old, 0, 1 * MIB, MEMVISOR_PROT_RW));
    /* Updating a mapping that is not invalidated is EINVAL. */
    FAILS(memvisor_dma_update_vaddr(dma, 0, 1 * MIB, new_, 0), EINVAL, "");
    uint64_t bytes = 0;
    OK(memvisor_dma_invalidate_vaddr(dma, 0, 1 * MIB, &bytes));
    CHECK(bytes == 1 * MIB);
    void *hva;
    CHECK(memvisor_dma_translate(dma, 0, 8, MEMVISOR_PROT_READ, &hva, NULL) < 0);
    FAILS(memvisor_dma_update_vaddr(dma, 2 * MIB, 1 * MIB, new_, 0), ENOENT, "");
    OK(memvisor_dma_update_vaddr(dma, 0, 1 * MIB, new_, 0));
    OK(memvisor_dma_translate(dma, 4096, 8, MEMVISOR_PROT_READ, &hva, NULL));
    CHECK((char *)hva == (char *)memvisor_backing_ptr(new_) + 4096);
    memvisor_dma_free(dma);
    memvisor_backing_free(old);
    memvisor_backing_free(new_);
}

static void discard_keeps_pinned(void) {
    memvisor_backing *ram;
    memvisor_slots *slots;
    memvisor_dma *dma;
    memvisor_discarder *discarder;
    OK(memvisor_backing_new(MEMVISOR_BACKING_MEMFD, 4 * MIB, &ram));
    OK(memvisor_slots_new(0, &slots));
    OK(memvisor_slots_insert(slots, 0, 0, ram, 0, 4 * MIB, 0));
    OK(memvisor_dma_new(0, &dma));
    /* Without a vIOMMU the device's space is the identity over guest memory. */
    OK(memvisor_dma_map_guest(dma, 0, slots, 0, 4 * MIB, MEMVISOR_PROT_RW));
    OK(memvisor_discarder_new(slots, 0, &discarder));

    /* Data in three pages of [2 MiB, 4 MiB); a device pins the middle one. */
    for (uint64_t p = 0; p < 3; p++)
        OK(memvisor_slots_write(slots, 2 * MIB + p * PAGE, "data", 4));
    uint64_t pinned = (2 * MIB) / PAGE + 1;
    OK(memvisor_dma_pin_pages(dma, &pinned, 1, MEMVISOR_PROT_WRITE, NULL));

    /* The guest reports [2 MiB, 4 MiB) free, and 1 MiB past guest memory. */
    memvisor_range ranges[2] = {{.gpa = 2 * MIB, .len = 2 * MIB}, {.gpa = 64 * MIB, .len = MIB}};
    memvisor_report report;
    OK(memvisor_discard_report(discarder, ranges, 2, &report));
    CHECK(report.skipped_pinned == PAGE);
    CHECK(report.discarded == 2 * MIB - PAGE);
    CHECK(report.rejected == MIB);

    /* The pinned page keeps its bytes; its neighbours were given back (zeros). */
    char buf[4];
    OK(memvisor_slots_read(slots, 2 * MIB + PAGE, buf, 4));
    CHECK(memcmp(buf, "data", 4) == 0);
    OK(memvisor_slots_read(slots, 2 * MIB, buf, 4));
    CHECK(memcmp(buf, "\0\0\0\0", 4) == 0);
    OK(memvisor_slots_read(slots, 2 * MIB + 2 * PAGE, buf, 4));
    CHECK(memcmp(buf, "\0\0\0\0", 4) == 0);

    /* Unpinned, the page goes at the next report. */
    OK(memvisor_dma_unpin_pages(dma, &pinned, 1));
    OK(memvisor_discard_report(discarder, ranges, 1, &report));
    CHECK(report.skipped_pinned == 0 && report.discarded == 2 * MIB);
    OK(memvisor_slots_read(slots, 2 * MIB + PAGE, buf, 4));
    CHECK(memcmp(buf, "\0\0\0\0", 4) == 0);

    FAILS(memvisor_discard_report(discarder, NULL, 1, &report), EINVAL, "ranges is NULL");
    memvisor_discarder_free(discarder);
    memvisor_dma_free(dma);
    memvisor_slots_free(slots);
    memvisor_backing_free(ram);
}

int main(void) {
    slots_and_fds();
    vaddr_update();
    discard_keeps_pinned();
    puts("ok: slots");
    return 0;
}
