/*
 * Side-by-side translate benchmark: random 64-byte translations among N mappings of one 4 KiB
 * page each (IOVA 2*i pages, so no two touch; host page i*7919 % N), through
 *   memvisor_dma_translate     the C API over DmaSpace::translate (a per-thread last hit,
 *                              then the space's index)
 *   memvisor_cursor_translate  the C API over a DmaCursor (the thread's own snapshot)
 *   libvfio-user               dma_addr_to_sgl (lib/dma.h, inlined into this file: a
 *                              per-thread region hint, then its B-tree), regions added without
 *                              an fd (REGION_ACCESS_MODE_MSG, as replay.c's default): it
 *                              finds the region and offset, not a host address
 *   libvfio-user +sgl_get      the same regions mmapped from a memfd (REGION_ACCESS_MODE_MMAP),
 *                              dma_addr_to_sgl then dma_sgl_get: the host address, as memvisor
 *                              gives; only where N mmaps fit under vm.max_map_count
 * The addresses come from xorshift64 with a fixed seed, the same sequence the Rust half
 * (benches/translate.rs) uses. Each run times ITERS translations after one untimed pass, in
 * the thread's CPU time (CLOCK_THREAD_CPUTIME_ID);
 * the figure is the median of RUNS runs, ns per translation. Every answer is checked once,
 * untimed, before the runs.
 *
 * Built by c/bench/run.sh (with -DWITH_LIBVFIO_USER when libvfio-user could be built).
 * Output: one line per (N, variant): "N variant median min max" in ns.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "memvisor.h"

#ifdef WITH_LIBVFIO_USER
#include <sys/uio.h>

#include "libvfio-user.h"
#include "private.h"
#include "dma.h"
#endif

#define PAGE 4096ull
#define NADDR (1u << 16)
#define ACCESS 64ull

static unsigned runs = 5;
static uint64_t iters = 2000000;
static volatile uintptr_t sink;

static void die(const char *what) {
    fprintf(stderr, "bench: %s: %s (%s)\n", what, memvisor_last_error(), strerror(errno));
    exit(1);
}

/* The thread's CPU time, not the wall clock: on a shared 2-core machine a run's wall time
 * counts the time other processes had the core. */
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The mapping of address k: its IOVA (a random byte of a random mapping, room for ACCESS). */
static void addresses(uint64_t n, uint64_t *iova, uint64_t *mapping) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (unsigned k = 0; k < NADDR; k++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint64_t m = x % n;
        uint64_t off = (x >> 32) % (PAGE - ACCESS);
        mapping[k] = m;
        iova[k] = 2 * m * PAGE + off;
    }
}

static uint64_t host_page(uint64_t i, uint64_t n) { return i * 7919 % n; }

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef double (*timed_fn)(void *state, const uint64_t *iova);

static void report(uint64_t n, const char *name, timed_fn f, void *state, const uint64_t *iova) {
    double t[32];
    f(state, iova); /* warm-up */
    for (unsigned r = 0; r < runs; r++)
        t[r] = f(state, iova);
    qsort(t, runs, sizeof t[0], cmp);
    printf("%" PRIu64 " %s %.2f %.2f %.2f\n", n, name, t[runs / 2], t[0], t[runs - 1]);
    fflush(stdout);
}

/* ---- memvisor */

struct mv {
    memvisor_dma *dma;
    memvisor_cursor *cursor;
};

static double mv_space(void *s, const uint64_t *iova) {
    struct mv *mv = s;
    uintptr_t acc = 0;
    uint64_t t0 = now_ns();
    for (uint64_t i = 0; i < iters; i++) {
        void *hva;
        if (memvisor_dma_translate(mv->dma, iova[i & (NADDR - 1)], ACCESS, MEMVISOR_PROT_READ,
                                   &hva, NULL) != 0)
            die("memvisor_dma_translate");
        acc += (uintptr_t)hva;
    }
    uint64_t t1 = now_ns();
    sink = acc;
    return (double)(t1 - t0) / (double)iters;
}

static double mv_cursor(void *s, const uint64_t *iova) {
    struct mv *mv = s;
    uintptr_t acc = 0;
    uint64_t t0 = now_ns();
    for (uint64_t i = 0; i < iters; i++) {
        void *hva;
        if (memvisor_cursor_translate(mv->cursor, iova[i & (NADDR - 1)], ACCESS,
                                      MEMVISOR_PROT_READ, &hva, NULL) != 0)
            die("memvisor_cursor_translate");
        acc += (uintptr_t)hva;
    }
    uint64_t t1 = now_ns();
    sink = acc;
    return (double)(t1 - t0) / (double)iters;
}

static void bench_memvisor(uint64_t n, const uint64_t *iova, const uint64_t *mapping) {
    memvisor_backing *ram;
    struct mv mv;
    if (memvisor_backing_new(MEMVISOR_BACKING_PRIVATE_ANON, n * PAGE, &ram) != 0)
        die("memvisor_backing_new");
    if (memvisor_dma_new(n > 65535 ? (uint32_t)n : 0, &mv.dma) != 0)
        die("memvisor_dma_new");
    for (uint64_t i = 0; i < n; i++)
        if (memvisor_dma_map_backing(mv.dma, 2 * i * PAGE, ram, host_page(i, n) * PAGE, PAGE,
                                     MEMVISOR_PROT_RW) != 0)
            die("memvisor_dma_map_backing");
    if (memvisor_cursor_new(mv.dma, &mv.cursor) != 0)
        die("memvisor_cursor_new");
    char *base = memvisor_backing_ptr(ram);
    for (unsigned k = 0; k < NADDR; k++) {
        void *a, *b;
        char *want = base + host_page(mapping[k], n) * PAGE + (iova[k] % PAGE);
        if (memvisor_dma_translate(mv.dma, iova[k], ACCESS, MEMVISOR_PROT_READ, &a, NULL) != 0 ||
            memvisor_cursor_translate(mv.cursor, iova[k], ACCESS, MEMVISOR_PROT_READ, &b, NULL) != 0 ||
            a != want || b != want) {
            fprintf(stderr, "bench: memvisor translated %#" PRIx64 " wrongly\n", iova[k]);
            exit(1);
        }
    }
    report(n, "memvisor_dma_translate", mv_space, &mv, iova);
    report(n, "memvisor_cursor_translate", mv_cursor, &mv, iova);
    memvisor_cursor_free(mv.cursor);
    memvisor_dma_free(mv.dma);
    memvisor_backing_free(ram);
}

/* ---- libvfio-user */

#ifdef WITH_LIBVFIO_USER
struct lvu {
    vfu_ctx_t *ctx;
    dma_controller_t *dma;
};

static double lvu_sgl(void *s, const uint64_t *iova) {
    struct lvu *l = s;
    uintptr_t acc = 0;
    dma_sg_t sg;
    uint64_t t0 = now_ns();
    for (uint64_t i = 0; i < iters; i++) {
        if (dma_addr_to_sgl(l->dma, (vfu_dma_addr_t)(uintptr_t)iova[i & (NADDR - 1)], ACCESS,
                            &sg, 1, PROT_READ) != 1)
            die("dma_addr_to_sgl");
        acc += (uintptr_t)sg.region + sg.offset;
    }
    uint64_t t1 = now_ns();
    sink = acc;
    return (double)(t1 - t0) / (double)iters;
}

static double lvu_sgl_get(void *s, const uint64_t *iova) {
    struct lvu *l = s;
    uintptr_t acc = 0;
    dma_sg_t sg;
    struct iovec iov;
    uint64_t t0 = now_ns();
    for (uint64_t i = 0; i < iters; i++) {
        if (dma_addr_to_sgl(l->dma, (vfu_dma_addr_t)(uintptr_t)iova[i & (NADDR - 1)], ACCESS,
                            &sg, 1, PROT_READ) != 1 ||
            dma_sgl_get(l->dma, &sg, &iov, 1) != 0)
            die("dma_addr_to_sgl + dma_sgl_get");
        acc += (uintptr_t)iov.iov_base;
    }
    uint64_t t1 = now_ns();
    sink = acc;
    return (double)(t1 - t0) / (double)iters;
}

static void bench_libvfio_user(uint64_t n, const uint64_t *iova, const uint64_t *mapping,
                               int with_mmap) {
    struct lvu l;
    l.ctx = calloc(1, sizeof(*l.ctx));
    if (l.ctx == NULL)
        die("calloc");
    l.ctx->log_level = LOG_ERR;
    l.dma = l.ctx->dma = dma_controller_create(l.ctx, n, MAX_DMA_SIZE);
    if (l.dma == NULL)
        die("dma_controller_create");
    int memfd = -1;
    if (with_mmap) {
        memfd = memfd_create("lvu-bench", MFD_CLOEXEC);
        if (memfd < 0 || ftruncate(memfd, (off_t)(n * PAGE)) != 0)
            die("memfd");
    }
    dma_memory_region_t **regions = calloc(n, sizeof(*regions));
    for (uint64_t i = 0; i < n; i++) {
        int fd = with_mmap ? dup(memfd) : -1;
        regions[i] = dma_controller_add_region(
            l.dma, (vfu_dma_addr_t)(uintptr_t)(2 * i * PAGE), PAGE, &fd,
            (off_t)(host_page(i, n) * PAGE), PROT_READ | PROT_WRITE,
            with_mmap ? REGION_ACCESS_MODE_MMAP : REGION_ACCESS_MODE_MSG);
        if (regions[i] == NULL)
            die("dma_controller_add_region");
    }
    for (unsigned k = 0; k < NADDR; k++) {
        dma_sg_t sg;
        struct iovec iov;
        if (dma_addr_to_sgl(l.dma, (vfu_dma_addr_t)(uintptr_t)iova[k], ACCESS, &sg, 1,
                            PROT_READ) != 1 ||
            sg.region != regions[mapping[k]] || sg.offset != iova[k] % PAGE ||
            (with_mmap && (dma_sgl_get(l.dma, &sg, &iov, 1) != 0 ||
                           iov.iov_base != (char *)regions[mapping[k]]->info.vaddr +
                                               iova[k] % PAGE))) {
            fprintf(stderr, "bench: libvfio-user translated %#" PRIx64 " wrongly\n", iova[k]);
            exit(1);
        }
    }
    if (with_mmap)
        report(n, "libvfio-user_sgl+sgl_get", lvu_sgl_get, &l, iova);
    else
        report(n, "libvfio-user_dma_addr_to_sgl", lvu_sgl, &l, iova);
    dma_controller_remove_all_regions(l.dma, NULL, NULL);
    dma_controller_destroy(l.dma);
    free(regions);
    free(l.ctx);
    if (memfd >= 0)
        close(memfd);
}

static uint64_t max_map_count(void) {
    FILE *f = fopen("/proc/sys/vm/max_map_count", "r");
    unsigned long long v = 65530;
    if (f != NULL) {
        if (fscanf(f, "%llu", &v) != 1)
            v = 65530;
        fclose(f);
    }
    return v;
}
#endif

int main(int argc, char **argv) {
    uint64_t counts[8] = {64, 1000, 100000};
    unsigned ncounts = 3;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc)
            runs = (unsigned)atoi(argv[++i]);
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            iters = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: %s [--runs N (1-31)] [--iters N]\n", argv[0]);
            return 2;
        }
    }
    if (runs < 1 || runs > 31 || iters == 0) {
        fprintf(stderr, "bench: --runs 1 to 31, --iters at least 1\n");
        return 2;
    }
    uint64_t *iova = malloc(NADDR * sizeof *iova), *mapping = malloc(NADDR * sizeof *mapping);
    for (unsigned c = 0; c < ncounts; c++) {
        uint64_t n = counts[c];
        addresses(n, iova, mapping);
        bench_memvisor(n, iova, mapping);
#ifdef WITH_LIBVFIO_USER
        bench_libvfio_user(n, iova, mapping, 0);
        if (n + 1000 < max_map_count())
            bench_libvfio_user(n, iova, mapping, 1);
        else
            printf("%" PRIu64 " libvfio-user_sgl+sgl_get skipped: %" PRIu64
                   " mmaps pass vm.max_map_count\n", n, n);
#endif
    }
    free(iova);
    free(mapping);
    return 0;
}
