/* What the header says about threads: a DMA space shared by threads that translate (each with
 * its own cursor) and copy while another maps and unmaps elsewhere in it; error messages kept
 * per thread. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>

#include "check.h"

enum { THREADS = 3, ROUNDS = 20000 };

static memvisor_dma *dma;
static memvisor_backing *ram;

static void *reader(void *arg) {
    uintptr_t id = (uintptr_t)arg;
    memvisor_cursor *cursor;
    OK(memvisor_cursor_new(dma, &cursor));
    char *base = memvisor_backing_ptr(ram);
    for (uint64_t i = 0; i < ROUNDS; i++) {
        uint64_t off = ((i * 7 + id) % 256) * PAGE + id * 8;
        void *hva;
        OK(memvisor_cursor_translate(cursor, off, 8, MEMVISOR_PROT_READ, &hva, NULL));
        CHECK((char *)hva == base + off);
        OK(memvisor_dma_translate(dma, off, 8, MEMVISOR_PROT_READ, &hva, NULL));
        CHECK((char *)hva == base + off);
        uint64_t v = i, back = 0;
        OK(memvisor_dma_write(dma, off, &v, 8));
        OK(memvisor_dma_read(dma, off, &back, 8));
        CHECK(back == i);
    }
    /* This thread's failure message is its own. */
    FAILS(memvisor_dma_translate(dma, 1ull << 40, 8, MEMVISOR_PROT_READ, &(void *){0}, NULL),
          EFAULT, "0x10000000000");
    memvisor_cursor_free(cursor);
    return NULL;
}

int main(void) {
    memvisor_backing *other;
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 1 * MIB, &ram));
    OK(memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, 64 * KIB, &other));
    OK(memvisor_dma_new(0, &dma));
    OK(memvisor_dma_map_backing(dma, 0, ram, 0, 1 * MIB, MEMVISOR_PROT_RW));

    pthread_t t[THREADS];
    for (uintptr_t i = 0; i < THREADS; i++)
        CHECK(pthread_create(&t[i], NULL, reader, (void *)i) == 0);
    /* Meanwhile: churn elsewhere in the same space, and a failure of this thread's own. */
    for (int i = 0; i < 2000; i++) {
        OK(memvisor_dma_map_backing(dma, 1ull << 30, other, 0, 64 * KIB, MEMVISOR_PROT_RW));
        uint64_t bytes;
        OK(memvisor_dma_unmap(dma, 1ull << 30, 64 * KIB, &bytes));
        CHECK(bytes == 64 * KIB);
    }
    FAILS(memvisor_dma_unmap(dma, 0, PAGE, NULL), EINVAL, "split");
    for (int i = 0; i < THREADS; i++)
        CHECK(pthread_join(t[i], NULL) == 0);
    /* The readers' failures did not replace this thread's message. */
    CHECK(strstr(memvisor_last_error(), "memvisor_dma_unmap") != NULL);

    memvisor_dma_free(dma);
    memvisor_backing_free(other);
    memvisor_backing_free(ram);
    puts("ok: threads");
    return 0;
}
