/*
 * genio: guest side of memvisor's crash trial (the back end SIGKILLed and restarted under load).
 *
 * Model: PROCS processes (fork), each with THREADS threads, keep O_DIRECT reads and writes of
 * generation-stamped 4 KiB blocks in flight on the disk. Block b belongs to process b % PROCS
 * and, inside it, to thread (b / PROCS) % THREADS, so every block has exactly one writer and at
 * most one request of its own in flight: what it must hold is always known. A block written at
 * generation g holds a header (magic, block number, g, a checksum of the three) and a body of
 * 64-bit words derived from (block, g). Each thread first writes generation 1 to all its blocks,
 * then until SECONDS have gone writes one of its blocks at its next generation and reads back
 * another, which must hold the last generation written to it (older: stale; anything else:
 * corrupt). At the end every block is read and checked once more.
 *
 * Every I/O error counts: the point is that no request is lost or fails while the back end dies
 * and comes back. A request that never completes (virtio-blk has no timeout: the thread sleeps in
 * the kernel for ever) is caught by the parent: every completion stamps the thread's progress
 * time in shared memory, and a thread with no completion for STALL seconds ends the run with
 * "GENIO stuck: ... requests lost" (its processes stay blocked; the parent reports and exits).
 *
 * The generations the blocks end with are in shared memory too; the parent prints a digest of
 * them (sum over blocks of mix(block << 32 ^ gen)) that the host recomputes from the image.
 *
 * usage: genio DEVICE SECONDS [PROCS BLOCKS_PER_PROC THREADS STALL]   (defaults 4 256 4 20)
 * prints "GENIO ..." lines, a summary "genio: writes W reads R ioerrors E stale S corrupt C",
 * "GENIO digest=... blocks=N" and "RESULT crash PASS|FAIL ..."; exits 0 only if E = S = C = 0
 * and nothing was stuck.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 4096
#define MAGIC 0x47454e494f626c6bULL /* "GENIOblk" */
#define WORDS ((BLOCK - 32) / 8)
#define MAX_WORKERS 64
#define MAX_REPORTS 8 /* problem lines in all (the counts say the rest) */

enum op { OP_IDLE, OP_WRITE, OP_READ, OP_VERIFY };
static const char *op_name[] = {"nothing", "write", "read", "final read"};

/* One thread's figures and progress, written by it alone, read by the parent. */
struct worker {
	double last;     /* CLOCK_MONOTONIC of its last completed request (or of its start) */
	int op;          /* what it is waiting for now */
	unsigned block;  /* ... on which block */
	uint64_t gen;    /* ... at which generation (write) or expecting (read) */
	int done;        /* finished its final check */
	unsigned long writes, reads, ioerrors, stale, corrupt;
};

struct shared {
	struct worker w[MAX_WORKERS];
	unsigned long reported; /* problem lines printed, all workers */
	/* Per block: the generations it may hold. lo = last write known done; hi = last write
	 * sent (above lo only after a write failed, when either may be on the disk). */
	uint64_t lo[]; /* blocks entries, followed by as many of hi */
};

static struct shared *sh;
static uint64_t *gen_lo, *gen_hi;
static int fd, procs, threads;
static unsigned per_proc;
static double t_end;

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static uint64_t mix(uint64_t x)
{
	x += 0x9e3779b97f4a7c15ULL;
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
	x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
	return x ^ (x >> 31);
}

static uint64_t header_sum(uint64_t block, uint64_t gen)
{
	return mix(MAGIC ^ mix(block) ^ (gen << 1));
}

/* The contents of block b at generation g. */
static void fill(uint64_t *w, uint64_t b, uint64_t g)
{
	w[0] = MAGIC;
	w[1] = b;
	w[2] = g;
	w[3] = header_sum(b, g);
	uint64_t x = mix((b << 32) ^ g) | 1;
	for (int k = 0; k < WORDS; k++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		w[4 + k] = x;
	}
}

static void stamp(struct worker *me, int op, unsigned b, uint64_t g)
{
	__atomic_store_n(&me->op, op, __ATOMIC_RELAXED);
	__atomic_store_n(&me->block, b, __ATOMIC_RELAXED);
	__atomic_store_n(&me->gen, g, __ATOMIC_RELAXED);
}

static void progress(struct worker *me)
{
	double t = now();
	__atomic_store(&me->last, &t, __ATOMIC_RELAXED);
}

/* The first MAX_REPORTS problems of the run, as "GENIO ..." lines. */
static void report(struct worker *me, const char *fmt, ...)
{
	(void)me;
	if (__atomic_fetch_add(&sh->reported, 1, __ATOMIC_RELAXED) >= MAX_REPORTS)
		return;
	char line[256];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	printf("GENIO %s\n", line);
	fflush(stdout);
}

static int do_write(struct worker *me, uint64_t *buf, unsigned b)
{
	uint64_t g = gen_hi[b] + 1;
	fill(buf, b, g);
	stamp(me, OP_WRITE, b, g);
	ssize_t n = pwrite(fd, buf, BLOCK, (off_t)b * BLOCK);
	int e = errno;
	progress(me);
	gen_hi[b] = g;
	__atomic_add_fetch(&me->writes, 1, __ATOMIC_RELAXED);
	if (n != BLOCK) {
		__atomic_add_fetch(&me->ioerrors, 1, __ATOMIC_RELAXED);
		report(me, "ioerror: write of block %u gen %llu: %s", b, (unsigned long long)g,
		       n < 0 ? strerror(e) : "short write");
		return -1;
	}
	gen_lo[b] = g;
	return 0;
}

static void do_check(struct worker *me, uint64_t *buf, uint64_t *want, unsigned b, int op)
{
	stamp(me, op, b, gen_lo[b]);
	ssize_t n = pread(fd, buf, BLOCK, (off_t)b * BLOCK);
	int e = errno;
	progress(me);
	__atomic_add_fetch(&me->reads, 1, __ATOMIC_RELAXED);
	if (n != BLOCK) {
		__atomic_add_fetch(&me->ioerrors, 1, __ATOMIC_RELAXED);
		report(me, "ioerror: read of block %u (gen %llu): %s", b, (unsigned long long)gen_lo[b],
		       n < 0 ? strerror(e) : "short read");
		return;
	}
	uint64_t g = buf[2];
	fill(want, b, g);
	if (buf[0] != MAGIC || buf[1] != b || buf[3] != header_sum(b, g) || memcmp(buf, want, BLOCK)) {
		__atomic_add_fetch(&me->corrupt, 1, __ATOMIC_RELAXED);
		report(me, "corrupt: block %u (want gen %llu) holds magic %#llx block %llu gen %llu, %s", b,
		       (unsigned long long)gen_lo[b], (unsigned long long)buf[0], (unsigned long long)buf[1],
		       (unsigned long long)g, buf[1] != b ? "not its own" : "a bad checksum or body");
	} else if (g < gen_lo[b]) {
		__atomic_add_fetch(&me->stale, 1, __ATOMIC_RELAXED);
		report(me, "stale: block %u holds gen %llu, want %llu", b, (unsigned long long)g,
		       (unsigned long long)gen_lo[b]);
	} else if (g > gen_hi[b]) {
		__atomic_add_fetch(&me->corrupt, 1, __ATOMIC_RELAXED);
		report(me, "corrupt: block %u holds gen %llu, newer than the last written, %llu", b,
		       (unsigned long long)g, (unsigned long long)gen_hi[b]);
	} else {
		gen_lo[b] = gen_hi[b] = g; /* after a failed write: what the disk settled on */
	}
}

static void *worker_main(void *arg)
{
	int id = (int)(intptr_t)arg, p = id / threads, t = id % threads;
	struct worker *me = &sh->w[id];
	unsigned owned = per_proc / threads, *mine = calloc(owned, sizeof(unsigned));
	uint64_t *buf, *want;
	if (!mine || posix_memalign((void **)&buf, BLOCK, BLOCK) || posix_memalign((void **)&want, BLOCK, BLOCK)) {
		perror("genio: buffers");
		exit(1);
	}
	for (unsigned i = 0; i < owned; i++)
		mine[i] = p + procs * (t + threads * i);
	uint64_t r = mix(((uint64_t)id << 40) ^ (uint64_t)(now() * 1e9)) | 1;
	progress(me);
	for (unsigned i = 0; i < owned; i++)
		do_write(me, buf, mine[i]);
	while (now() < t_end) {
		r ^= r << 13;
		r ^= r >> 7;
		r ^= r << 17;
		unsigned i = r % owned, j = (i + 1 + (r >> 32) % (owned > 1 ? owned - 1 : 1)) % owned;
		do_write(me, buf, mine[i]);
		do_check(me, buf, want, mine[j], OP_READ);
	}
	for (unsigned i = 0; i < owned; i++)
		do_check(me, buf, want, mine[i], OP_VERIFY);
	stamp(me, OP_IDLE, 0, 0);
	__atomic_store_n(&me->done, 1, __ATOMIC_RELEASE);
	return NULL;
}

static void child(int p)
{
	pthread_t th[MAX_WORKERS];
	for (int t = 0; t < threads; t++)
		if (pthread_create(&th[t], NULL, worker_main, (void *)(intptr_t)(p * threads + t))) {
			perror("genio: pthread_create");
			exit(1);
		}
	for (int t = 0; t < threads; t++)
		pthread_join(th[t], NULL);
	exit(0);
}

struct totals {
	unsigned long writes, reads, ioerrors, stale, corrupt;
};

static struct totals sum_up(void)
{
	struct totals s = {0};
	for (int i = 0; i < procs * threads; i++) {
		struct worker *w = &sh->w[i];
		s.writes += __atomic_load_n(&w->writes, __ATOMIC_RELAXED);
		s.reads += __atomic_load_n(&w->reads, __ATOMIC_RELAXED);
		s.ioerrors += __atomic_load_n(&w->ioerrors, __ATOMIC_RELAXED);
		s.stale += __atomic_load_n(&w->stale, __ATOMIC_RELAXED);
		s.corrupt += __atomic_load_n(&w->corrupt, __ATOMIC_RELAXED);
	}
	return s;
}

int main(int argc, char **argv)
{
	if (argc != 3 && argc != 7) {
		fprintf(stderr, "usage: genio DEVICE SECONDS [PROCS BLOCKS_PER_PROC THREADS STALL]\n");
		return 2;
	}
	double seconds = atof(argv[2]), stall = 20;
	procs = 4;
	per_proc = 256;
	threads = 4;
	if (argc == 7) {
		procs = atoi(argv[3]);
		per_proc = atoi(argv[4]);
		threads = atoi(argv[5]);
		stall = atof(argv[6]);
	}
	if (procs < 1 || threads < 1 || procs * threads > MAX_WORKERS || per_proc < (unsigned)threads ||
	    per_proc % threads) {
		fprintf(stderr, "genio: want 1..%d workers and BLOCKS_PER_PROC a multiple of THREADS\n",
			MAX_WORKERS);
		return 2;
	}
	unsigned blocks = procs * per_proc;
	fd = open(argv[1], O_RDWR | O_DIRECT);
	if (fd < 0) {
		perror("genio: open");
		return 1;
	}
	size_t size = sizeof(struct shared) + 2 * blocks * sizeof(uint64_t);
	sh = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED) {
		perror("genio: mmap");
		return 1;
	}
	gen_lo = sh->lo;
	gen_hi = sh->lo + blocks;
	double t0 = now();
	t_end = t0 + seconds;
	printf("GENIO started: %d processes x %d threads, %u blocks of 4 KiB on %s, for %.0f s\n", procs,
	       threads, blocks, argv[1], seconds);
	fflush(stdout);
	pid_t pid[MAX_WORKERS];
	for (int p = 0; p < procs; p++) {
		pid[p] = fork();
		if (pid[p] < 0) {
			perror("genio: fork");
			return 1;
		}
		if (pid[p] == 0)
			child(p);
	}
	/* Watch: progress every 10 s; a thread with no completion for STALL seconds is stuck. */
	int left = procs, stuck = 0;
	double shown = t0;
	while (left > 0 && !stuck) {
		usleep(200000);
		int st;
		while (left > 0 && waitpid(-1, &st, WNOHANG) > 0)
			left--;
		double t = now();
		for (int i = 0; i < procs * threads && !stuck; i++) {
			struct worker *w = &sh->w[i];
			double last;
			__atomic_load(&w->last, &last, __ATOMIC_RELAXED);
			if (__atomic_load_n(&w->done, __ATOMIC_ACQUIRE) || last == 0 || t - last < stall)
				continue;
			stuck = 1;
			printf("GENIO stuck: process %d thread %d waiting %.0f s for its %s of block %u (gen %llu): requests lost\n",
			       i / threads, i % threads, t - last, op_name[w->op], w->block,
			       (unsigned long long)w->gen);
			int others = 0;
			for (int k = 0; k < procs * threads; k++) {
				struct worker *o = &sh->w[k];
				__atomic_load(&o->last, &last, __ATOMIC_RELAXED);
				if (k == i || o->done || t - last < stall)
					continue;
				if (others++ < 3)
					printf("GENIO stuck too: process %d thread %d, %.0f s in its %s of block %u\n",
					       k / threads, k % threads, t - last, op_name[o->op], o->block);
			}
			if (others > 3)
				printf("GENIO stuck too: %d more threads\n", others - 3);
		}
		if (t - shown >= 10) {
			struct totals s = sum_up();
			printf("GENIO t=%.0f writes=%lu reads=%lu ioerrors=%lu stale=%lu corrupt=%lu\n", t - t0,
			       s.writes, s.reads, s.ioerrors, s.stale, s.corrupt);
			shown = t;
		}
		fflush(stdout);
	}
	struct totals s = sum_up();
	int unfinished = 0;
	for (int i = 0; i < procs * threads; i++)
		unfinished += !__atomic_load_n(&sh->w[i].done, __ATOMIC_ACQUIRE);
	uint64_t digest = 0;
	for (unsigned b = 0; b < blocks; b++)
		digest += mix(((uint64_t)b << 32) ^ gen_lo[b]);
	printf("genio: writes %lu reads %lu ioerrors %lu stale %lu corrupt %lu\n", s.writes, s.reads,
	       s.ioerrors, s.stale, s.corrupt);
	if (!stuck && !unfinished)
		printf("GENIO digest=%016llx blocks=%u\n", (unsigned long long)digest, blocks);
	int ok = !stuck && !unfinished && !s.ioerrors && !s.stale && !s.corrupt;
	printf("RESULT crash %s writes=%lu reads=%lu ioerrors=%lu stale=%lu corrupt=%lu unfinished=%d%s in %.1f s\n",
	       ok ? "PASS" : "FAIL", s.writes, s.reads, s.ioerrors, s.stale, s.corrupt, unfinished,
	       stuck ? " stuck" : "", now() - t0);
	fflush(stdout);
	/* Stuck threads sleep in the kernel for ever: leave them (exit does not wait for them). */
	return !ok;
}
