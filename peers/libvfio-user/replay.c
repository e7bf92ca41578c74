/*
 * replay-libvfio-user: replays a recorded vfio-user DMA_MAP / DMA_UNMAP stream
 * against libvfio-user's own DMA table (lib/dma.c, a B-tree of regions since
 * upstream commit f3742ed), to compare with memvisor's DmaSpace.
 *
 * The table is driven through its internal API, the calls libvfio-user's
 * handle_dma_map / handle_dma_unmap make once a message has been parsed:
 *   M -> dma_controller_add_region
 *        then, inside the new region, dma_addr_to_sgl (1 page), and in --mmap
 *        mode also dma_sgl_get (the host address)
 *   U -> dma_controller_remove_region
 *   A -> dma_controller_remove_all_regions
 * Message framing, the socket and the application's register/unregister
 * callbacks are not part of what is measured (NULL callbacks).
 *
 * Recording format: one message a line, '#' starts a comment, numbers hex:
 *   M <iova> <size> <offset> <prot>     prot: r | w | rw
 *   U <iova> <size>
 *   A
 *
 * Built by build.sh against libvfio-user's static library and its private
 * headers (lib/), which is where dma.h lives.
 */

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "libvfio-user.h"
#include "private.h"
#include "dma.h"

#ifndef LVU_COMMIT
#define LVU_COMMIT "unknown"
#endif

#define PAGE 4096ULL

enum kind { K_MAP, K_UNMAP, K_ALL };

struct msg {
    enum kind kind;
    uint32_t prot;      /* PROT_READ / PROT_WRITE, maps only */
    uint64_t iova;
    uint64_t size;
    uint64_t offset;    /* offset into the guest-RAM fd, maps only */
};

struct recording {
    struct msg *msgs;
    size_t n, cap;
    size_t maps, unmaps, alls;
    uint64_t fd_end;    /* highest offset + size over the maps */
};

/* errno -> count, for the JSON */
#define NERR 256
struct errcount { uint64_t n[NERR]; };

struct stats {
    uint64_t maps_ok, maps_failed;
    uint64_t unmaps_ok, unmaps_missing, unmaps_missing_overlapping;
    uint64_t translates, translates_failed;
    uint64_t alls, removed_by_all;
    uint64_t peak;
    struct errcount map_err, unmap_err, translate_err;
    /* per-operation nanoseconds, timer overhead subtracted */
    double ns_map, ns_unmap, ns_unmap_missing, ns_translate, ns_all;
};

static double timer_overhead_ns;

static inline uint64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* One timed operation: the interval less one timer read, never below 0 (as
 * memvisor's `bench iotlb` does). */
static inline double
lap(uint64_t t0, uint64_t t1)
{
    double d = (double)(t1 - t0) - timer_overhead_ns;
    return d > 0 ? d : 0;
}

static int
cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int
cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median cost of one clock_gettime, i.e. what one timed interval adds. */
static double
calibrate_timer(void)
{
    enum { N = 20001 };
    static uint64_t d[N];
    uint64_t prev = now_ns();
    for (int i = 0; i < N; i++) {
        uint64_t t = now_ns();
        d[i] = t - prev;
        prev = t;
    }
    qsort(d, N, sizeof(d[0]), cmp_u64);
    return (double)d[N / 2];
}

static void
die(const char *fmt, ...)
    __attribute__((noreturn, format(printf, 1, 2)));

static void
die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("replay-libvfio-user: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static bool
parse_hex(char **cursor, uint64_t *out)
{
    char *s = *cursor, *end;
    while (*s == ' ' || *s == '\t') {
        s++;
    }
    if (s[0] != '0' || (s[1] != 'x' && s[1] != 'X')) {
        return false;
    }
    errno = 0;
    *out = strtoull(s + 2, &end, 16);
    if (errno != 0 || end == s + 2) {
        return false;
    }
    *cursor = end;
    return true;
}

static bool
parse_word(char **cursor, char *buf, size_t len)
{
    char *s = *cursor;
    size_t i = 0;
    while (*s == ' ' || *s == '\t') {
        s++;
    }
    while (*s && *s != ' ' && *s != '\t' && *s != '\n' && *s != '#') {
        if (i + 1 >= len) {
            return false;
        }
        buf[i++] = *s++;
    }
    buf[i] = '\0';
    *cursor = s;
    return i > 0;
}

static bool
at_end(char *s)
{
    while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n') {
        s++;
    }
    return *s == '\0' || *s == '#';
}

static void
push(struct recording *rec, struct msg m)
{
    if (rec->n == rec->cap) {
        rec->cap = rec->cap ? rec->cap * 2 : 4096;
        rec->msgs = realloc(rec->msgs, rec->cap * sizeof(*rec->msgs));
        if (rec->msgs == NULL) {
            die("out of memory");
        }
    }
    rec->msgs[rec->n++] = m;
}

static void
load(const char *path, struct recording *rec)
{
    FILE *f = fopen(path, "r");
    char *line = NULL;
    size_t cap = 0;
    size_t lineno = 0;

    if (f == NULL) {
        die("%s: %s", path, strerror(errno));
    }
    memset(rec, 0, sizeof(*rec));
    while (getline(&line, &cap, f) != -1) {
        char *s = line;
        struct msg m = { 0 };
        char word[8];

        lineno++;
        while (*s == ' ' || *s == '\t') {
            s++;
        }
        if (at_end(s)) {
            continue;
        }
        switch (*s++) {
        case 'M':
            m.kind = K_MAP;
            if (!parse_hex(&s, &m.iova) || !parse_hex(&s, &m.size) ||
                !parse_hex(&s, &m.offset) || !parse_word(&s, word, sizeof(word))) {
                die("%s:%zu: expected M <iova> <size> <offset> <prot>", path, lineno);
            }
            if (strcmp(word, "r") == 0) {
                m.prot = PROT_READ;
            } else if (strcmp(word, "w") == 0) {
                m.prot = PROT_WRITE;
            } else if (strcmp(word, "rw") == 0) {
                m.prot = PROT_READ | PROT_WRITE;
            } else {
                die("%s:%zu: prot must be r, w or rw, not %s", path, lineno, word);
            }
            if (m.offset + m.size < m.offset) {
                die("%s:%zu: offset + size overflows", path, lineno);
            }
            if (m.offset + m.size > rec->fd_end) {
                rec->fd_end = m.offset + m.size;
            }
            rec->maps++;
            break;
        case 'U':
            m.kind = K_UNMAP;
            if (!parse_hex(&s, &m.iova) || !parse_hex(&s, &m.size)) {
                die("%s:%zu: expected U <iova> <size>", path, lineno);
            }
            rec->unmaps++;
            break;
        case 'A':
            m.kind = K_ALL;
            rec->alls++;
            break;
        default:
            die("%s:%zu: unknown message %c", path, lineno, s[-1]);
        }
        if (!at_end(s)) {
            die("%s:%zu: trailing text", path, lineno);
        }
        push(rec, m);
    }
    free(line);
    fclose(f);
}

/*
 * The controller as vfu_setup_device_dma() creates it, owned by a bare context
 * rather than one from vfu_create_ctx(), which would bind a listening socket.
 * vfu_log() only needs the context to exist: no log callback, so no output.
 */
static vfu_ctx_t *
table_create(size_t max_regions)
{
    vfu_ctx_t *ctx = calloc(1, sizeof(*ctx));

    if (ctx == NULL) {
        die("out of memory");
    }
    ctx->log_level = LOG_ERR;
    ctx->dma = dma_controller_create(ctx, max_regions, MAX_DMA_SIZE);
    if (ctx->dma == NULL) {
        die("dma_controller_create: %s", strerror(errno));
    }
    return ctx;
}

static void
table_destroy(vfu_ctx_t *ctx)
{
    dma_controller_remove_all_regions(ctx->dma, NULL, NULL);
    dma_controller_destroy(ctx->dma);
    free(ctx);
}

/* Peak number of live regions, from one replay with room for every map;
 * used to size max_regions before the runs. */
static size_t
expected_peak(const struct recording *rec, size_t max_regions, int memfd,
              enum region_access_mode mode)
{
    vfu_ctx_t *ctx = table_create(max_regions);
    size_t peak = 0;

    for (size_t i = 0; i < rec->n; i++) {
        const struct msg *m = &rec->msgs[i];
        if (m->kind == K_MAP) {
            int fd = mode == REGION_ACCESS_MODE_MSG ? -1 : dup(memfd);
            if (dma_controller_add_region(ctx->dma, (vfu_dma_addr_t)(uintptr_t)m->iova,
                                          m->size, &fd, m->offset, m->prot,
                                          mode) == NULL && fd != -1) {
                close(fd);
            }
            if (btree_size(&ctx->dma->regions) > peak) {
                peak = btree_size(&ctx->dma->regions);
            }
        } else if (m->kind == K_UNMAP) {
            dma_controller_remove_region(ctx->dma, (vfu_dma_addr_t)(uintptr_t)m->iova,
                                         m->size, NULL, NULL);
        } else {
            dma_controller_remove_all_regions(ctx->dma, NULL, NULL);
        }
    }
    table_destroy(ctx);
    return peak;
}

/* Does [iova, iova+size) overlap any live region? (Outside the timers.) */
static bool
overlaps_live(dma_controller_t *dma, uint64_t iova, uint64_t size)
{
    dma_memory_region_t *r;
    btree_iter_t it;

    if (size == 0) {
        return false;
    }
    btree_iter_init(&dma->regions, (uintptr_t)iova, &it);
    r = btree_iter_get(&it, NULL);
    return r != NULL && (uint64_t)(uintptr_t)r->info.iova.iov_base < iova + size;
}

static inline void
count_err(struct errcount *e, int err)
{
    e->n[err >= 0 && err < NERR ? err : 0]++;
}

/*
 * One replay from an empty table. With `timed`, each operation is timed on
 * its own (timer overhead subtracted); without, only the whole replay is.
 * Returns the nanoseconds of the whole replay.
 */
static uint64_t
replay(const struct recording *rec, size_t max_regions, int memfd,
       enum region_access_mode mode, bool timed, struct stats *st)
{
    vfu_ctx_t *ctx = table_create(max_regions);
    dma_controller_t *dma = ctx->dma;
    double t_map = 0, t_unmap = 0, t_miss = 0, t_tr = 0, t_all = 0;
    uint64_t start, end;
    struct iovec iov = { 0 };
    dma_sg_t sg;

    memset(st, 0, sizeof(*st));

    start = now_ns();
    for (size_t i = 0; i < rec->n; i++) {
        const struct msg *m = &rec->msgs[i];
        vfu_dma_addr_t iova = (vfu_dma_addr_t)(uintptr_t)m->iova;
        uint64_t t0 = 0, t1 = 0, t2 = 0;
        int ret;

        switch (m->kind) {
        case K_MAP: {
            dma_memory_region_t *region;
            /* the fd a DMA_MAP message would carry (SCM_RIGHTS) */
            int fd = mode == REGION_ACCESS_MODE_MSG ? -1 : dup(memfd);

            if (timed) {
                t0 = now_ns();
            }
            region = dma_controller_add_region(dma, iova, m->size, &fd,
                                               (off_t)m->offset, m->prot, mode);
            if (timed) {
                t1 = now_ns();
                t_map += lap(t0, t1);
            }
            if (region == NULL) {
                count_err(&st->map_err, errno);
                st->maps_failed++;
                if (fd != -1) {
                    close(fd);
                }
                break;
            }
            st->maps_ok++;
            if (timed && btree_size(&dma->regions) > st->peak) {
                st->peak = btree_size(&dma->regions);
            }
            if (m->size == 0) {
                break;
            }
            /* one page in the middle of the new region */
            uint64_t off = (m->size / 2) & ~(PAGE - 1);
            uint64_t len = m->size - off < PAGE ? m->size - off : PAGE;
            if (timed) {
                t1 = now_ns();
            }
            ret = dma_addr_to_sgl(dma, iova + off, len, &sg, 1, PROT_READ);
            if (ret == 1 && mode == REGION_ACCESS_MODE_MMAP) {
                ret = dma_sgl_get(dma, &sg, &iov, 1) == 0 ? 1 : -1;
            }
            if (timed) {
                t2 = now_ns();
                t_tr += lap(t1, t2);
            }
            st->translates++;
            /* outside the timers: the translation names the new region */
            if (ret == 1 && timed &&
                (sg.region != region || sg.offset != off || sg.length != len ||
                 (mode == REGION_ACCESS_MODE_MMAP &&
                  iov.iov_base != (char *)region->info.vaddr + off))) {
                ret = -1;
                errno = EFAULT;
            }
            if (ret != 1) {
                st->translates_failed++;
                count_err(&st->translate_err, errno);
            }
            break;
        }
        case K_UNMAP:
            if (timed) {
                t0 = now_ns();
            }
            ret = dma_controller_remove_region(dma, iova, m->size, NULL, NULL);
            if (timed) {
                t1 = now_ns();
            }
            if (ret == 0) {
                st->unmaps_ok++;
                t_unmap += lap(t0, t1);
            } else {
                count_err(&st->unmap_err, errno);
                st->unmaps_missing++;
                t_miss += lap(t0, t1);
                if (timed && overlaps_live(dma, m->iova, m->size)) {
                    st->unmaps_missing_overlapping++;
                }
            }
            break;
        case K_ALL: {
            size_t live = btree_size(&dma->regions);
            if (timed) {
                t0 = now_ns();
            }
            dma_controller_remove_all_regions(dma, NULL, NULL);
            if (timed) {
                t1 = now_ns();
                t_all += lap(t0, t1);
            }
            st->alls++;
            st->removed_by_all += live;
            break;
        }
        }
    }
    end = now_ns();

    table_destroy(ctx);

#define PER(total, count) ((count) ? (total) / (double)(count) : 0.0)
    st->ns_map = PER(t_map, st->maps_ok + st->maps_failed);
    st->ns_unmap = PER(t_unmap, st->unmaps_ok);
    st->ns_unmap_missing = PER(t_miss, st->unmaps_missing);
    st->ns_translate = PER(t_tr, st->translates);
    st->ns_all = PER(t_all, st->alls);
#undef PER
    return end - start;
}

static void
print_errs(const char *name, const struct errcount *e)
{
    bool first = true;
    printf(",\"%s\":{", name);
    for (int i = 0; i < NERR; i++) {
        if (e->n[i] == 0) {
            continue;
        }
        const char *nm = i ? strerrorname_np(i) : NULL;
        printf("%s\"%s\":%" PRIu64, first ? "" : ",", nm ? nm : "errno?", e->n[i]);
        first = false;
    }
    printf("}");
}

static void
usage(void)
{
    fprintf(stderr,
            "usage: replay-libvfio-user [--mmap] [--max-regions N] [--warmup N] "
            "RECORDING [RUNS]\n"
            "  --mmap           maps carry an fd (a memfd as big as the highest\n"
            "                   offset+size) and libvfio-user mmap()s each region;\n"
            "                   translate then includes dma_sgl_get.\n"
            "                   Default: no fd (REGION_ACCESS_MODE_MSG), no mmap.\n"
            "  --max-regions N  the DMA controller's region limit (default: the\n"
            "                   library default LIBVFIO_USER_MAX_DMA_REGIONS = %d,\n"
            "                   raised to the stream's peak if that is higher)\n"
            "  --warmup N       untimed replays before the runs (default 1)\n"
            "  RUNS             measured replays, one JSON line each (default 5)\n",
            LIBVFIO_USER_MAX_DMA_REGIONS);
    exit(2);
}

int
main(int argc, char **argv)
{
    enum region_access_mode mode = REGION_ACCESS_MODE_MSG;
    size_t max_regions = 0;
    bool max_regions_given = false;
    int warmup = 1, runs = 5;
    const char *path = NULL;
    struct recording rec;
    int memfd = -1;
    int i;

    for (i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--mmap") == 0) {
            mode = REGION_ACCESS_MODE_MMAP;
        } else if (strcmp(argv[i], "--max-regions") == 0 && i + 1 < argc) {
            max_regions = strtoull(argv[++i], NULL, 0);
            max_regions_given = true;
        } else if (strcmp(argv[i], "--warmup") == 0 && i + 1 < argc) {
            warmup = atoi(argv[++i]);
        } else if (argv[i][0] == '-') {
            usage();
        } else if (path == NULL) {
            path = argv[i];
        } else {
            runs = atoi(argv[i]);
        }
    }
    if (path == NULL || runs < 1) {
        usage();
    }

    load(path, &rec);

    if (mode == REGION_ACCESS_MODE_MMAP) {
        uint64_t len = (rec.fd_end + PAGE - 1) & ~(PAGE - 1);
        memfd = memfd_create("replay-guest-ram", MFD_CLOEXEC);
        if (memfd < 0 || ftruncate(memfd, (off_t)(len ? len : PAGE)) < 0) {
            die("memfd of %#" PRIx64 " bytes: %s", len, strerror(errno));
        }
    }

    size_t peak = expected_peak(&rec, rec.maps ? rec.maps : 1, memfd, mode);
    if (!max_regions_given) {
        max_regions = LIBVFIO_USER_MAX_DMA_REGIONS;
        if (peak > max_regions) {
            max_regions = peak;
        }
    }
    timer_overhead_ns = calibrate_timer();

    fprintf(stderr,
            "replay-libvfio-user: libvfio-user %s, %s: %zu messages (%zu M, %zu U, "
            "%zu A), peak %zu live regions, max_regions %zu (library default %d), "
            "mode %s, timer overhead %.0f ns\n",
            LVU_COMMIT, path, rec.n, rec.maps, rec.unmaps, rec.alls, peak,
            max_regions, LIBVFIO_USER_MAX_DMA_REGIONS,
            mode == REGION_ACCESS_MODE_MSG ? "msg (fd -1, no mmap)"
                                           : "mmap (memfd, one mmap per region)",
            timer_overhead_ns);

    struct stats st;
    for (i = 0; i < warmup; i++) {
        replay(&rec, max_regions, memfd, mode, false, &st);
    }

    double *med[6];
    for (int k = 0; k < 6; k++) {
        med[k] = calloc((size_t)runs, sizeof(double));
    }
    for (i = 0; i < runs; i++) {
        /* whole replay without per-operation timers, then with them */
        uint64_t total = replay(&rec, max_regions, memfd, mode, false, &st);
        replay(&rec, max_regions, memfd, mode, true, &st);
        double mps = total ? (double)rec.n * 1e9 / (double)total : 0.0;

        printf("{\"peer\":\"libvfio-user\",\"commit\":\"%s\",\"run\":%d,"
               "\"mode\":\"%s\",\"messages\":%zu,\"maps\":%zu,\"maps_failed\":%" PRIu64
               ",\"unmaps\":%zu,\"unmaps_missing\":%" PRIu64
               ",\"unmaps_missing_overlapping\":%" PRIu64
               ",\"unmap_all\":%" PRIu64 ",\"regions_removed_by_all\":%" PRIu64
               ",\"regions_peak\":%" PRIu64 ",\"max_regions\":%zu"
               ",\"translates\":%" PRIu64 ",\"translates_failed\":%" PRIu64,
               LVU_COMMIT, i, mode == REGION_ACCESS_MODE_MSG ? "msg" : "mmap",
               rec.n, rec.maps, st.maps_failed, rec.unmaps, st.unmaps_missing,
               st.unmaps_missing_overlapping, st.alls, st.removed_by_all, st.peak,
               max_regions, st.translates, st.translates_failed);
        print_errs("map_errno", &st.map_err);
        print_errs("unmap_errno", &st.unmap_err);
        print_errs("translate_errno", &st.translate_err);
        printf(",\"ns_per_map\":%.1f,\"ns_per_unmap\":%.1f,\"ns_per_unmap_missing\":%.1f"
               ",\"ns_per_translate\":%.1f,\"ns_per_unmap_all\":%.1f"
               ",\"replay_ns\":%" PRIu64 ",\"messages_per_s\":%.0f"
               ",\"timer_overhead_ns\":%.1f}\n",
               st.ns_map, st.ns_unmap, st.ns_unmap_missing, st.ns_translate, st.ns_all,
               total, mps, timer_overhead_ns);
        fflush(stdout);
        med[0][i] = st.ns_map;
        med[1][i] = st.ns_unmap;
        med[2][i] = st.ns_unmap_missing;
        med[3][i] = st.ns_translate;
        med[4][i] = st.ns_all;
        med[5][i] = mps;
    }
    for (int k = 0; k < 6; k++) {
        qsort(med[k], (size_t)runs, sizeof(double), cmp_double);
    }
    fprintf(stderr,
            "replay-libvfio-user: median of %d: map %.1f ns, unmap %.1f ns, "
            "unmap (missing) %.1f ns, translate %.1f ns, unmap-all %.1f ns, "
            "%.0f messages/s\n",
            runs, med[0][runs / 2], med[1][runs / 2], med[2][runs / 2],
            med[3][runs / 2], med[4][runs / 2], med[5][runs / 2]);
    return 0;
}
