/* Memory the caller mapped, handed to memvisor: adopted as a backing (with and without its
 * file), released through the caller's function once its last user is gone and never when
 * adoption fails; and a DMA mapping of raw host memory. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"

static int releases;
static void *released_with;

static void count_release(void *opaque) {
    releases++;
    released_with = opaque;
}

static void *map(size_t size, int flags, int fd) {
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, flags, fd, 0);
    CHECK(p != MAP_FAILED);
    return p;
}

static void adopted_private_memory_released_after_its_last_user(void) {
    char *mem = map(2 * MIB, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    int token;
    memvisor_adopt a = {.ptr = mem, .size = 2 * MIB, .release = count_release, .opaque = &token};
    memvisor_backing *b;
    releases = 0;
    OK(memvisor_backing_adopt(&a, &b));
    CHECK(memvisor_backing_ptr(b) == mem && memvisor_backing_size(b) == 2 * MIB);
    CHECK(memvisor_backing_fd(b) == -1);

    /* A device writes through memvisor; the caller sees it in its own mapping. */
    memvisor_dma *dma;
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 1 * MIB, b, 0, 2 * MIB, MEMVISOR_PROT_RW));
    OK(memvisor_dma_write(dma, 1 * MIB + 5 * PAGE + 3, "adopted", 7));
    CHECK(memcmp(mem + 5 * PAGE + 3, "adopted", 7) == 0);

    /* The caller's handle goes; the mapping still uses the memory: no release yet. */
    memvisor_backing_free(b);
    CHECK(releases == 0);
    OK(memvisor_dma_write(dma, 1 * MIB, "x", 1));
    /* The last user goes: released once, with the caller's pointer. */
    uint64_t unmapped;
    OK(memvisor_dma_unmap(dma, 1 * MIB, 2 * MIB, &unmapped));
    CHECK(unmapped == 2 * MIB);
    CHECK(releases == 1 && released_with == &token);
    memvisor_dma_free(dma);
    CHECK(releases == 1);
    CHECK(munmap(mem, 2 * MIB) == 0);
}

static void adopted_shared_file_keeps_a_duplicate(void) {
    int fd = memfd_create("adopt-test", MFD_CLOEXEC);
    CHECK(fd >= 0 && ftruncate(fd, 4 * MIB) == 0);
    /* The second half of the file, mapped by the caller. */
    char *mem = mmap(NULL, 2 * MIB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 2 * MIB);
    CHECK(mem != MAP_FAILED);
    memvisor_adopt a = {
        .ptr = mem,
        .size = 2 * MIB,
        .flags = MEMVISOR_ADOPT_SHARED | MEMVISOR_ADOPT_FD,
        .fd = fd,
        .file_offset = 2 * MIB,
    };
    memvisor_backing *b;
    OK(memvisor_backing_adopt(&a, &b));
    int kept = memvisor_backing_fd(b);
    CHECK(kept >= 0 && kept != fd);
    close(fd);
    /* What memvisor writes is in the file at the mapping's offset. */
    memvisor_dma *dma;
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, b, 0, 2 * MIB, MEMVISOR_PROT_RW));
    OK(memvisor_dma_write(dma, PAGE, "file", 4));
    char buf[4];
    CHECK(pread(kept, buf, 4, 2 * MIB + PAGE) == 4 && memcmp(buf, "file", 4) == 0);
    memvisor_dma_free(dma);
    memvisor_backing_free(b);
    CHECK(munmap(mem, 2 * MIB) == 0);
}

static void refused_adoptions_change_nothing_and_release_nothing(void) {
    char *mem = map(4 * PAGE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    memvisor_backing *b = NULL;
    releases = 0;
    memvisor_adopt a = {.ptr = mem + 8, .size = PAGE, .release = count_release};
    FAILS(memvisor_backing_adopt(&a, &b), EINVAL, "adopted memory");
    a.ptr = mem;
    a.size = PAGE + 1;
    FAILS(memvisor_backing_adopt(&a, &b), EINVAL, "adopted memory size");
    a.size = PAGE;
    a.flags = 4;
    FAILS(memvisor_backing_adopt(&a, &b), EINVAL, "flags 0x4");
    a.flags = 0;
    a.page_size = 12345;
    FAILS(memvisor_backing_adopt(&a, &b), EINVAL, "page_size 0x3039");
    a.page_size = 0;
    /* A range past the caller's mapping: not wholly mapped. */
    CHECK(munmap(mem + 2 * PAGE, 2 * PAGE) == 0);
    a.size = 4 * PAGE;
    FAILS(memvisor_backing_adopt(&a, &b), EINVAL, "not wholly mapped");
    /* A file flag with no file. */
    a.size = PAGE;
    a.flags = MEMVISOR_ADOPT_FD;
    a.fd = -1;
    FAILS(memvisor_backing_adopt(&a, &b), EINVAL, "fd -1");
    FAILS(memvisor_backing_adopt(NULL, &b), EINVAL, "memory is NULL");
    a.flags = 0;
    FAILS(memvisor_backing_adopt(&a, NULL), EINVAL, "backing is NULL");
    CHECK(b == NULL && releases == 0);
    CHECK(munmap(mem, 2 * PAGE) == 0);
}

static void raw_host_memory_mapped_for_dma(void) {
    char *mem = map(4 * PAGE, MAP_PRIVATE | MAP_ANONYMOUS, -1);
    memvisor_dma *dma;
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_raw(dma, 1ull << 30, mem, 4 * PAGE, MEMVISOR_PROT_RW));
    void *hva;
    OK(memvisor_dma_translate(dma, (1ull << 30) + PAGE + 9, 8, MEMVISOR_PROT_WRITE, &hva, NULL));
    CHECK((char *)hva == mem + PAGE + 9);
    OK(memvisor_dma_write(dma, (1ull << 30) + 3 * PAGE, "raw", 3));
    CHECK(memcmp(mem + 3 * PAGE, "raw", 3) == 0);
    FAILS(memvisor_dma_map_raw(dma, 0, mem + 1, PAGE, MEMVISOR_PROT_RW), EINVAL, "");
    FAILS(memvisor_dma_map_raw(dma, 0, mem, PAGE, 0), EINVAL, "prot 0x0");
    FAILS(memvisor_dma_map_raw(dma, (1ull << 30) + PAGE, mem, PAGE, MEMVISOR_PROT_RW), EEXIST, "");
    uint64_t unmapped;
    OK(memvisor_dma_unmap(dma, 1ull << 30, 4 * PAGE, &unmapped));
    CHECK(unmapped == 4 * PAGE);
    memvisor_dma_free(dma);
    CHECK(munmap(mem, 4 * PAGE) == 0);
}

int main(void) {
    adopted_private_memory_released_after_its_last_user();
    adopted_shared_file_keeps_a_duplicate();
    refused_adoptions_change_nothing_and_release_nothing();
    raw_host_memory_mapped_for_dma();
    puts("ok: adopt");
    return 0;
}
