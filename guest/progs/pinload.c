/*
 * pinload: guest side of memvisor's locked-memory trial (guest/trial.sh blk --memlock, balloon
 * --memlock): many O_DIRECT writers with large requests, every block checked.
 *
 * Model: WRITERS processes (fork) each own REGION consecutive 4 KiB blocks of the disk (writer
 * w: blocks [w * REGION, (w + 1) * REGION)). For SECONDS each writes a random run of 1..MAXBLK
 * blocks (MAXBLK 64: 256 KiB, one request) at a random place in its region with one O_DIRECT
 * pwrite from a buffer of its own, then reads the run back with one O_DIRECT pread into a second
 * buffer and checks every block. So each block has one writer, and what it must hold is known:
 * a block written at generation g holds a header (magic, block number, g, a checksum of the
 * three) and a body of 64-bit words derived from (block, g); generation 0 is a block never
 * written (zeros). When all have stopped, each writer reads its whole region once more and
 * checks every block.
 *
 * The generations are kept in a file (STATE, in the guest's /tmp), so a later run on the same
 * disk goes on from them; the last run's digest (sum over blocks of mix(block << 32 ^ gen)) is
 * what the host recomputes from the image after the guest is gone.
 *
 * With CHURN 1, every writer unmaps its buffers and maps fresh ones every 8 requests, so the
 * pages it let go of are freed (and reported to a free-page-reporting balloon) while the other
 * writers' requests are in flight.
 *
 * Counted: ioerrors (a request that failed or moved less than asked), bad (a block that read back
 * neither the generation last written nor, after a failed write, the one that write carried),
 * landed (blocks that read back a write the guest had been told failed). A writer with no
 * completion for STALL seconds ends the run ("PINLOAD stuck": a request that never completes).
 *
 * usage: pinload DEVICE SECONDS WRITERS REGION MAXBLK STALL CHURN STATE
 * prints "PINLOAD dev=... ... mibps=..." (throughput: bytes written and read back per second of
 * the timed part), "PINLOAD digest=... blocks=N dev=..." and "RESULT pinload PASS|FAIL ..."; exits 0 only
 * if nothing failed, nothing read wrong and nothing was stuck.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define BLOCK 4096
#define MAGIC 0x50494e4c4f414421ULL /* "PINLOAD!" */
#define WORDS ((BLOCK - 32) / 8)
#define MAX_WRITERS 256
#define MAX_REPORTS 8

struct writer {
	double last;                    /* CLOCK_MONOTONIC of its last completion */
	int done;                       /* finished its final check */
	unsigned long writes, reads, ioerrors, bad, landed, verified;
	unsigned long long bytes;       /* written and read back in the timed part */
};

struct shared {
	struct writer w[MAX_WRITERS];
	unsigned long reported;
};

static struct shared *sh;
static uint32_t *gen_lo, *gen_hi; /* per block; hi > lo only after a failed write */
static int fd;
static unsigned region, maxblk;
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

static void fill(uint64_t *w, uint64_t b, uint64_t g)
{
	uint64_t x = mix((b << 32) ^ g);
	w[0] = MAGIC;
	w[1] = b;
	w[2] = g;
	w[3] = mix(MAGIC ^ mix(b) ^ (g << 1));
	for (unsigned k = 0; k < WORDS; k++)
		w[4 + k] = x + (uint64_t)k * 0x9e3779b97f4a7c15ULL;
}

/* The generation block b holds (0: zeros), or -1 if it is not a whole block of b. */
static long long holds(const uint64_t *w, uint64_t b)
{
	int zero = 1;
	for (unsigned k = 0; k < BLOCK / 8 && zero; k++)
		zero = w[k] == 0;
	if (zero)
		return 0;
	if (w[0] != MAGIC || w[1] != b || w[3] != mix(MAGIC ^ mix(b) ^ (w[2] << 1)))
		return -1;
	uint64_t x = mix((b << 32) ^ w[2]);
	for (unsigned k = 0; k < WORDS; k++)
		if (w[4 + k] != x + (uint64_t)k * 0x9e3779b97f4a7c15ULL)
			return -1;
	return (long long)w[2];
}

static void report(const char *fmt, unsigned a, unsigned long long b, long long c, unsigned d)
{
	if (__atomic_fetch_add(&sh->reported, 1, __ATOMIC_RELAXED) < MAX_REPORTS) {
		printf(fmt, a, b, c, d);
		fflush(stdout);
	}
}

/* Checks block b (its contents at w) against what it may hold; returns 0 if right. */
static int check(struct writer *me, unsigned id, uint64_t b, const uint64_t *w)
{
	long long g = holds(w, b);
	me->verified++;
	if (g >= 0 && (uint32_t)g == gen_lo[b])
		return 0;
	if (g >= 0 && gen_hi[b] != gen_lo[b] && (uint32_t)g == gen_hi[b]) {
		/* A write the guest was told failed is on the disk. */
		me->landed++;
		gen_lo[b] = gen_hi[b];
		return 0;
	}
	me->bad++;
	report("PINLOAD writer %u block %llu holds generation %lld, want %u\n", id, b, g, gen_lo[b]);
	return 1;
}

static void *buffer(size_t len)
{
	void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (p == MAP_FAILED) {
		perror("pinload: mmap");
		exit(2);
	}
	return p;
}

static void run_writer(unsigned id, int churn)
{
	struct writer *me = &sh->w[id];
	size_t len = (size_t)maxblk * BLOCK;
	uint64_t *out = buffer(len), *in = buffer(len);
	uint64_t first = (uint64_t)id * region, x = mix(id ^ (uint64_t)getpid() << 20) | 1;
	unsigned n_req = 0;
	me->last = now();
	while (now() < t_end) {
		x ^= x << 13; x ^= x >> 7; x ^= x << 17;
		unsigned n = 1 + (unsigned)(x % maxblk);
		unsigned at = (unsigned)((x >> 20) % (region - n + 1));
		uint64_t b0 = first + at;
		for (unsigned k = 0; k < n; k++) {
			uint64_t b = b0 + k;
			fill(out + k * (BLOCK / 8), b, gen_hi[b] + 1);
		}
		ssize_t r = pwrite(fd, out, (size_t)n * BLOCK, (off_t)b0 * BLOCK);
		me->writes++;
		me->last = now();
		for (unsigned k = 0; k < n; k++) {
			uint64_t b = b0 + k;
			gen_hi[b]++;
			if (r == (ssize_t)n * BLOCK)
				gen_lo[b] = gen_hi[b];
		}
		if (r != (ssize_t)n * BLOCK) {
			me->ioerrors++;
			report("PINLOAD writer %u: write of %llu blocks at %lld failed (errno %u)\n", id,
			       (unsigned long long)n, (long long)b0, r < 0 ? errno : 0);
			continue;
		}
		me->bytes += (unsigned long long)n * BLOCK;
		r = pread(fd, in, (size_t)n * BLOCK, (off_t)b0 * BLOCK);
		me->reads++;
		me->last = now();
		if (r != (ssize_t)n * BLOCK) {
			me->ioerrors++;
			report("PINLOAD writer %u: read of %llu blocks at %lld failed (errno %u)\n", id,
			       (unsigned long long)n, (long long)b0, r < 0 ? errno : 0);
			continue;
		}
		me->bytes += (unsigned long long)n * BLOCK;
		for (unsigned k = 0; k < n; k++)
			check(me, id, b0 + k, in + k * (BLOCK / 8));
		if (churn && ++n_req % 8 == 0) {
			munmap(out, len);
			munmap(in, len);
			out = buffer(len);
			in = buffer(len);
		}
	}
	/* The final check: the whole region, maxblk blocks per read. */
	for (unsigned at = 0; at < region; at += maxblk) {
		unsigned n = region - at < maxblk ? region - at : maxblk;
		ssize_t r = pread(fd, in, (size_t)n * BLOCK, (off_t)(first + at) * BLOCK);
		me->last = now();
		if (r != (ssize_t)n * BLOCK) {
			me->ioerrors++;
			report("PINLOAD writer %u: final read of %llu blocks at %lld failed (errno %u)\n", id,
			       (unsigned long long)n, (long long)(first + at), r < 0 ? errno : 0);
			continue;
		}
		for (unsigned k = 0; k < n; k++)
			check(me, id, first + at + k, in + k * (BLOCK / 8));
	}
	/* The final reads settled what failed writes left uncertain: lo is what each block holds. */
	for (unsigned k = 0; k < region; k++)
		gen_hi[first + k] = gen_lo[first + k];
	me->done = 1;
	_exit(0);
}

int main(int argc, char **argv)
{
	if (argc != 9) {
		fprintf(stderr, "usage: pinload DEVICE SECONDS WRITERS REGION MAXBLK STALL CHURN STATE\n");
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	const char *dev = argv[1], *state = argv[8];
	double secs = atof(argv[2]), stall = atof(argv[6]);
	unsigned writers = atoi(argv[3]);
	int churn = atoi(argv[7]);
	region = atoi(argv[4]);
	maxblk = atoi(argv[5]);
	if (writers < 1 || writers > MAX_WRITERS || maxblk < 1 || region < maxblk) {
		fprintf(stderr, "pinload: bad WRITERS, REGION or MAXBLK\n");
		return 2;
	}
	size_t blocks = (size_t)writers * region;
	fd = open(dev, O_RDWR | O_DIRECT);
	if (fd < 0) {
		perror(dev);
		return 2;
	}
	off_t size = lseek(fd, 0, SEEK_END);
	if (size < (off_t)(blocks * BLOCK)) {
		fprintf(stderr, "pinload: %s has %lld bytes, %zu blocks needed\n", dev, (long long)size, blocks);
		return 2;
	}
	sh = mmap(NULL, sizeof(*sh), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	gen_lo = mmap(NULL, 2 * blocks * 4, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	if (sh == MAP_FAILED || gen_lo == MAP_FAILED) {
		perror("pinload: mmap");
		return 2;
	}
	gen_hi = gen_lo + blocks;
	FILE *f = fopen(state, "r");
	if (f) {
		if (fread(gen_lo, 4, blocks, f) != blocks) {
			fprintf(stderr, "pinload: %s is short\n", state);
			return 2;
		}
		fclose(f);
	}
	memcpy(gen_hi, gen_lo, blocks * 4);
	double t0 = now();
	t_end = t0 + secs;
	pid_t pids[MAX_WRITERS];
	for (unsigned i = 0; i < writers; i++) {
		sh->w[i].last = now();
		pids[i] = fork();
		if (pids[i] < 0) {
			perror("pinload: fork");
			return 2;
		}
		if (pids[i] == 0)
			run_writer(i, churn);
	}
	/* Watch: every writer must complete something every STALL seconds until it is done. */
	int stuck = -1;
	double stuck_for = 0;
	for (;;) {
		unsigned done = 0;
		double t = now();
		for (unsigned i = 0; i < writers; i++) {
			if (sh->w[i].done) {
				done++;
			} else if (t - sh->w[i].last > stall) {
				stuck = i;
				stuck_for = t - sh->w[i].last;
			}
		}
		if (done == writers || stuck >= 0)
			break;
		usleep(200000);
	}
	struct writer sum = {0};
	for (unsigned i = 0; i < writers; i++) {
		struct writer *w = &sh->w[i];
		sum.writes += w->writes;
		sum.reads += w->reads;
		sum.ioerrors += w->ioerrors;
		sum.bad += w->bad;
		sum.landed += w->landed;
		sum.verified += w->verified;
		sum.bytes += w->bytes;
	}
	double timed = secs;
	if (stuck >= 0) {
		printf("PINLOAD stuck: writer %d completed nothing for %.0f s: requests lost\n", stuck, stuck_for);
		for (unsigned i = 0; i < writers; i++)
			kill(pids[i], SIGKILL);
	} else {
		for (unsigned i = 0; i < writers; i++)
			waitpid(pids[i], NULL, 0);
	}
	uint64_t digest = 0;
	for (size_t b = 0; b < blocks; b++)
		digest += mix(((uint64_t)b << 32) ^ gen_lo[b]);
	f = fopen(state, "w");
	if (!f || fwrite(gen_lo, 4, blocks, f) != blocks || fclose(f)) {
		perror(state);
		return 2;
	}
	printf("PINLOAD dev=%s writers=%u secs=%.0f max_kib=%u churn=%d writes=%lu reads=%lu mib=%.1f "
	       "mibps=%.2f ioerrors=%lu bad=%lu landed=%lu verified=%lu wall=%.1f\n",
	       dev, writers, secs, maxblk * BLOCK / 1024, churn, sum.writes, sum.reads, sum.bytes / 1048576.0,
	       sum.bytes / 1048576.0 / timed, sum.ioerrors, sum.bad, sum.landed, sum.verified, now() - t0);
	printf("PINLOAD digest=%016llx blocks=%zu dev=%s\n", (unsigned long long)digest, blocks, dev);
	int ok = stuck < 0 && !sum.ioerrors && !sum.bad && !sum.landed && sum.writes > 0;
	printf("RESULT pinload %s dev=%s ioerrors=%lu bad=%lu landed=%lu verified=%lu%s\n", ok ? "PASS" : "FAIL", dev,
	       sum.ioerrors, sum.bad, sum.landed, sum.verified, stuck >= 0 ? " stuck" : "");
	return ok ? 0 : 1;
}
