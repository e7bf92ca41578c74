// blkio-bench: the libblkio client of `memvisor bench blk` for what qemu-img bench cannot do:
// random offsets and several queues. One blkio instance started with Q queues: either
// libblkio's virtio-blk-vhost-user driver on a back end's socket, or its io_uring driver
// straight on the image file or block device (`path=`, `direct=0|1`), which is the limit row:
// the same requests with no back end, what the kernel alone does. DIRECT is the io_uring
// driver's O_DIRECT; with virtio-blk-vhost-user it must be 0 (the back end owns the cache mode). one thread per queue keeps D requests of S bytes in flight on it, each
// request at a random S-aligned offset (or the next sequential one) of the device, read or
// write, until the queue has completed N/Q of them. Buffers come from one libblkio memory
// region (shared with the back end), placed so that a back end which registers guest memory
// in 2 MiB chunks of its own addresses (memvisor's fixed buffers) finds every buffer in a
// whole chunk, as it would in a guest's RAM: the region has 2 MiB of slack before and after
// the buffers (rounded up to 2 MiB). Wherever the back end maps it, the chunk holding any
// buffer byte then lies inside the region. Prints one line:
//   ops=N secs=T ops_per_sec=R
// and exits 1 on any failed request or libblkio error (the message on stderr).
// usage: blkio-bench virtio-blk-vhost-user|io_uring PATH DIRECT QUEUES DEPTH SIZE
//                    read|write|randread|randwrite COUNT
// Built by guest/build-client.sh against the QEMU root's libblkio-dev.
#include <blkio.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct job {
    struct blkioq *q;
    char *buf;            // DEPTH buffers of SIZE bytes
    uint64_t count;       // requests this queue completes
    uint64_t next_seq;    // next sequential offset
    uint64_t rng;         // xorshift64 state
    int failed;
};

static uint64_t size, blocks, depth;
static int write_op, random_op;

static uint64_t next_offset(struct job *j)
{
    if (!random_op) {
        uint64_t off = j->next_seq;
        j->next_seq = (j->next_seq + size) % (blocks * size);
        return off;
    }
    j->rng ^= j->rng << 13;
    j->rng ^= j->rng >> 7;
    j->rng ^= j->rng << 17;
    return (j->rng % blocks) * size;
}

static void submit(struct job *j, uint64_t slot)
{
    char *buf = j->buf + slot * size;
    void *tag = (void *)(uintptr_t)slot;
    if (write_op)
        blkioq_write(j->q, next_offset(j), buf, size, tag, 0);
    else
        blkioq_read(j->q, next_offset(j), buf, size, tag, 0);
}

static void *run(void *arg)
{
    struct job *j = arg;
    struct blkio_completion done[256];
    uint64_t issued = 0, completed = 0;
    for (uint64_t s = 0; s < depth && issued < j->count; s++, issued++)
        submit(j, s);
    while (completed < j->count) {
        int n = blkioq_do_io(j->q, done, 1, (int)(depth < 256 ? depth : 256), NULL);
        if (n < 0) {
            fprintf(stderr, "blkioq_do_io: %s: %s\n", strerror(-n), blkio_get_error_msg());
            j->failed = 1;
            return NULL;
        }
        for (int i = 0; i < n; i++) {
            if (done[i].ret != 0) {
                fprintf(stderr, "request failed: %s: %s\n", strerror(-done[i].ret),
                        done[i].error_msg ? done[i].error_msg : "");
                j->failed = 1;
                return NULL;
            }
            completed++;
            if (issued < j->count) {
                submit(j, (uint64_t)(uintptr_t)done[i].user_data);
                issued++;
            }
        }
    }
    return NULL;
}

static int fail(const char *what)
{
    fprintf(stderr, "%s: %s\n", what, blkio_get_error_msg());
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 9) {
        fprintf(stderr, "usage: blkio-bench virtio-blk-vhost-user|io_uring PATH DIRECT QUEUES "
                        "DEPTH SIZE read|write|randread|randwrite COUNT\n");
        return 2;
    }
    const char *driver = argv[1];
    const char *path = argv[2];
    int direct = atoi(argv[3]);
    int queues = atoi(argv[4]);
    depth = strtoull(argv[5], NULL, 0);
    size = strtoull(argv[6], NULL, 0);
    const char *op = argv[7];
    uint64_t count = strtoull(argv[8], NULL, 0);
    write_op = strstr(op, "write") != NULL;
    random_op = strncmp(op, "rand", 4) == 0;
    int uring = strcmp(driver, "io_uring") == 0;
    if (!uring && strcmp(driver, "virtio-blk-vhost-user") != 0) {
        fprintf(stderr, "blkio-bench: driver %s: use virtio-blk-vhost-user or io_uring\n", driver);
        return 2;
    }
    if ((direct != 0 && direct != 1) || (direct && !uring)) {
        fprintf(stderr, "blkio-bench: DIRECT %s: 0 or 1, and 1 only with io_uring\n", argv[3]);
        return 2;
    }
    if (queues < 1 || queues > 64 || depth < 1 || depth > 1024 || size < 512 || size % 512 ||
        count < (uint64_t)queues || (!write_op && strstr(op, "read") == NULL)) {
        fprintf(stderr, "blkio-bench: bad arguments\n");
        return 2;
    }

    struct blkio *b;
    if (blkio_create(driver, &b) < 0)
        return fail("blkio_create");
    if (blkio_set_str(b, "path", path) < 0)
        return fail("path");
    if (uring && blkio_set_bool(b, "direct", direct) < 0)
        return fail("direct");
    if (blkio_connect(b) < 0)
        return fail("blkio_connect");
    if (blkio_set_int(b, "num-queues", queues) < 0)
        return fail("num-queues");
    if (blkio_start(b) < 0)
        return fail("blkio_start");
    uint64_t capacity, align;
    if (blkio_get_uint64(b, "capacity", &capacity) < 0)
        return fail("capacity");
    if (blkio_get_uint64(b, "mem-region-alignment", &align) < 0)
        return fail("mem-region-alignment");
    blocks = capacity / size;
    if (blocks == 0) {
        fprintf(stderr, "blkio-bench: device of %llu bytes is smaller than one request\n",
                (unsigned long long)capacity);
        return 1;
    }
    size_t per_queue = depth * size;
    const size_t chunk = 2u << 20;
    size_t used = per_queue * (size_t)queues;
    size_t len = chunk + (used + chunk - 1) / chunk * chunk + chunk;
    len = (len + align - 1) / align * align;
    struct blkio_mem_region region;
    if (blkio_alloc_mem_region(b, &region, len) < 0)
        return fail("blkio_alloc_mem_region");
    if (blkio_map_mem_region(b, &region) < 0)
        return fail("blkio_map_mem_region");
    memset(region.addr, 0x5a, len);
    char *bufs = (char *)region.addr + chunk;

    struct job jobs[64];
    pthread_t threads[64];
    for (int i = 0; i < queues; i++) {
        jobs[i] = (struct job){
            .q = blkio_get_queue(b, i),
            .buf = bufs + (size_t)i * per_queue,
            .count = count / (uint64_t)queues,
            .next_seq = (blocks / (uint64_t)queues) * (uint64_t)i * size,
            .rng = 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1),
        };
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < queues; i++)
        if (pthread_create(&threads[i], NULL, run, &jobs[i]) != 0) {
            fprintf(stderr, "pthread_create failed\n");
            return 1;
        }
    int failed = 0;
    uint64_t done = 0;
    for (int i = 0; i < queues; i++) {
        pthread_join(threads[i], NULL);
        failed |= jobs[i].failed;
        done += jobs[i].count;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (failed)
        return 1;
    double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    printf("ops=%llu secs=%.6f ops_per_sec=%.0f\n", (unsigned long long)done, secs,
           (double)done / secs);
    blkio_unmap_mem_region(b, &region);
    blkio_free_mem_region(b, &region);
    blkio_destroy(&b);
    return 0;
}
