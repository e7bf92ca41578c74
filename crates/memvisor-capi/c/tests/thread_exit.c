/* A failing call (and memvisor_last_error) from a pthread key destructor, on a thread that
 * already had a failure. glibc runs Rust's thread-local destructors (which free the
 * last-error slot) before pthread key destructors: still a negative errno, never an abort
 * (no panic crosses into C). */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>

#include "check.h"

static pthread_key_t key;
static int dtor_rc = 1;

static void dtor(void *arg) {
    (void)arg;
    /* NULL dma: must be -EINVAL, not an abort. */
    dtor_rc = memvisor_dma_unmap(NULL, 0, PAGE, NULL);
    fprintf(stderr, "dtor: rc %d, last error \"%s\"\n", dtor_rc, memvisor_last_error());
}

static void *worker(void *arg) {
    (void)arg;
    CHECK(pthread_setspecific(key, (void *)1) == 0);
    /* A first failure on this thread: its message slot now exists. */
    FAILS(memvisor_dma_unmap(NULL, 0, PAGE, NULL), EINVAL, "dma is NULL");
    return NULL;
}

int main(void) {
    CHECK(pthread_key_create(&key, dtor) == 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, worker, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(dtor_rc == -EINVAL);
    puts("ok: tls_dtor");
    return 0;
}
