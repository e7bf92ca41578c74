/*
 * faultio: guest side of memvisor's disk-fault trial (guest/trial.sh blk --disk-fault).
 *
 * Every request is one O_DIRECT pread/pwrite of CHUNK bytes (one virtio-blk request) into or from
 * a buffer with a canary page on each side; a separate region the disk never touches is filled
 * with a known pattern. After every request that fails, it must have failed with EIO, and the
 * canaries and the untouched region must be unchanged: a failed request may change nothing
 * outside its own buffer. Requests that succeed must move the right data (chunk i of a disk
 * holds pattern(i, generation)).
 *
 * The host changes the fault while this runs; this program says what it waits for on the
 * console ("FAULTIO want=WHAT") and polls until the disk behaves so:
 *   fault NOSPC_DEV EIO_DEV BAD_START BAD_LEN
 *     NOSPC_DEV: an image on a nearly full tmpfs. Chunks are written until writes fail with
 *       ENOSPC (EIO here); every chunk that was written reads back right. want=space: the host
 *       frees space; the first failed chunks are retried until they succeed, then all are read
 *       back.
 *     EIO_DEV: a FUSE file failing [BAD_START, BAD_START + BAD_LEN) with EIO. Writes and reads
 *       overlapping it must fail, the others succeed. want=all: the host makes every request
 *       fail (polled with reads of chunk 0); want=none: healed (polled with writes of the first
 *       bad chunk); then every chunk is written and read back.
 * One "RESULT disk-fault PASS|FAIL ..." line; "FAULTIO failed_requests=N" counts the
 * requests that failed (the host compares it with the back end's stats).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096
#define CHUNK (256 * 1024)
#define SLOTS 96		/* buffers */
#define UNTOUCHED (4 << 20)

static unsigned char *mem;	/* [canary][slot 0][canary][slot 1]...[canary] */
static unsigned char *untouched;
static unsigned long failed_requests, bad_errno, damaged;
static char fail[512];

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void note(const char *what)
{
	if (strlen(fail) + strlen(what) + 2 < sizeof(fail) && !strstr(fail, what)) {
		strcat(fail, " ");
		strcat(fail, what);
	}
}

static unsigned char *slot(unsigned s) { return mem + PAGE + (size_t)s * (CHUNK + PAGE); }

static unsigned char canary_byte(size_t i) { return (unsigned char)(0xc5 ^ (i * 131)); }

/* The contents of disk chunk i at generation g: 64-bit words of an xorshift sequence. */
static void pattern(unsigned char *buf, unsigned i, unsigned g)
{
	uint64_t x = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)i << 24) ^ ((uint64_t)g << 48) ^ 1;
	uint64_t *w = (uint64_t *)buf;
	for (size_t k = 0; k < CHUNK / 8; k++) {
		x ^= x << 13; x ^= x >> 7; x ^= x << 17;
		w[k] = x;
	}
}

static void fill_guards(void)
{
	for (unsigned s = 0; s <= SLOTS; s++) {
		unsigned char *c = mem + (size_t)s * (CHUNK + PAGE);
		for (size_t i = 0; i < PAGE; i++)
			c[i] = canary_byte(i + s);
	}
	for (size_t i = 0; i < UNTOUCHED; i++)
		untouched[i] = canary_byte(i * 7);
}

/* Whether every canary page and the untouched region still hold what fill_guards wrote. */
static int guards_intact(void)
{
	for (unsigned s = 0; s <= SLOTS; s++) {
		unsigned char *c = mem + (size_t)s * (CHUNK + PAGE);
		for (size_t i = 0; i < PAGE; i++)
			if (c[i] != canary_byte(i + s))
				return 0;
	}
	for (size_t i = 0; i < UNTOUCHED; i++)
		if (untouched[i] != canary_byte(i * 7))
			return 0;
	return 1;
}

/* One request of CHUNK bytes at chunk i through slot s: 0, or the errno it failed with. After a
 * failure the guards are checked. */
static int io(int fd, int write, unsigned i, unsigned s)
{
	ssize_t r = write ? pwrite(fd, slot(s), CHUNK, (off_t)i * CHUNK)
			  : pread(fd, slot(s), CHUNK, (off_t)i * CHUNK);
	if (r == CHUNK)
		return 0;
	int e = r < 0 ? errno : EIO;
	failed_requests++;
	if (e != EIO) {
		bad_errno++;
		printf("FAULTIO %s chunk %u failed with errno %d, not EIO\n", write ? "write" : "read", i, e);
		note("errno");
	}
	if (!guards_intact()) {
		damaged++;
		printf("FAULTIO memory outside the request changed after a failed %s of chunk %u\n",
		       write ? "write" : "read", i);
		note("memory-changed");
		fill_guards();
	}
	return e;
}

static int wr(int fd, unsigned i, unsigned g, unsigned s)
{
	pattern(slot(s), i, g);
	return io(fd, 1, i, s);
}

/* Reads chunk i into slot s and compares it with generation g: 0 right, 1 wrong, -1 failed. */
static int rd(int fd, unsigned i, unsigned g, unsigned s)
{
	static unsigned char *want;
	if (!want)
		want = aligned_alloc(PAGE, CHUNK);
	if (io(fd, 0, i, s))
		return -1;
	pattern(want, i, g);
	return memcmp(want, slot(s), CHUNK) != 0;
}

static int open_dev(const char *dev)
{
	int fd = open(dev, O_RDWR | O_DIRECT);
	if (fd < 0) {
		perror(dev);
		exit(1);
	}
	return fd;
}

static unsigned chunks_of(int fd)
{
	return (unsigned)(lseek(fd, 0, SEEK_END) / CHUNK);
}

static void want(const char *what)
{
	printf("FAULTIO want=%s\n", what);
	fflush(stdout);
}

/* The image on a nearly full tmpfs: writes fail once it is full, until the host frees space. */
static void nospc(const char *dev)
{
	int fd = open_dev(dev);
	unsigned n = chunks_of(fd), first_bad = 0, ok = 0, bad = 0, wrong = 0;
	unsigned char *written = calloc(n, 1);
	for (unsigned i = 0; i < n && bad < 8; i++) {
		if (wr(fd, i, 1, 0) == 0) {
			written[i] = 1;
			ok++;
		} else if (bad++ == 0) {
			first_bad = i;
		}
	}
	printf("FAULTIO nospc: %u chunks written, %u refused from chunk %u on\n", ok, bad, first_bad);
	if (!bad || ok < 8)
		note("nospc-no-fault");
	for (unsigned i = 0; i < n; i++)
		if (written[i] && rd(fd, i, 1, 1) != 0)
			wrong++;
	if (wrong)
		note("nospc-data");
	want("space");
	double t0 = now();
	int healed = 0;
	while (bad && now() - t0 < 120) {
		if (wr(fd, first_bad, 1, 0) == 0) {
			healed = 1;
			break;
		}
		usleep(500000);
	}
	if (!healed)
		note("nospc-not-healed");
	written[first_bad] = 1;
	/* With the space back, the next refused chunks go too, on the same back end. */
	for (unsigned i = first_bad + 1; healed && i < first_bad + 4 && i < n; i++) {
		if (wr(fd, i, 1, 0) == 0)
			written[i] = 1;
		else
			note("nospc-after-heal");
	}
	unsigned checked = 0;
	for (unsigned i = 0; i < n; i++)
		if (written[i]) {
			checked++;
			if (rd(fd, i, 1, 1) != 0)
				wrong++;
		}
	if (wrong)
		note("nospc-data");
	printf("FAULTIO nospc: healed after %.1f s; %u chunks read back, %u wrong\n", now() - t0, checked, wrong);
	close(fd);
}

/* A FUSE file with a bad range, then all bad, then healed. */
static void eio(const char *dev, unsigned long long bad_start, unsigned long long bad_len)
{
	int fd = open_dev(dev);
	unsigned n = chunks_of(fd), wrong = 0, unexpected = 0, bad_chunks = 0, first_bad = n;
	for (unsigned i = 0; i < n; i++) {
		int bad = (unsigned long long)i * CHUNK < bad_start + bad_len &&
			  (unsigned long long)(i + 1) * CHUNK > bad_start;
		if (bad) {
			bad_chunks++;
			if (first_bad == n)
				first_bad = i;
		}
		if ((wr(fd, i, 2, 2) != 0) != bad)
			unexpected++;
	}
	for (unsigned i = 0; i < n; i++) {
		int bad = (unsigned long long)i * CHUNK < bad_start + bad_len &&
			  (unsigned long long)(i + 1) * CHUNK > bad_start;
		int r = rd(fd, i, 2, 3);
		if ((r < 0) != bad)
			unexpected++;
		if (r > 0)
			wrong++;
	}
	printf("FAULTIO eio: %u chunks, %u in the bad range; %u requests went otherwise than the range says, %u read wrong\n",
	       n, bad_chunks, unexpected, wrong);
	if (unexpected)
		note("eio-range");
	if (!bad_chunks)
		note("eio-no-bad-range");
	want("all");
	double t0 = now();
	int all = 0;
	while (now() - t0 < 30) {
		if (rd(fd, 0, 2, 3) < 0) {
			all = 1;
			break;
		}
		usleep(300000);
	}
	/* Everything fails now: a write elsewhere too, and it changes nothing. */
	if (!all || wr(fd, n - 1, 9, 2) == 0 || rd(fd, n / 2, 2, 3) >= 0)
		note("eio-all");
	want("none");
	t0 = now();
	int healed = 0;
	while (first_bad < n && now() - t0 < 60) {
		if (wr(fd, first_bad, 2, 2) == 0) {
			healed = 1;
			break;
		}
		usleep(300000);
	}
	if (!healed)
		note("eio-not-healed");
	for (unsigned i = 0; i < n; i++)
		if (wr(fd, i, 2, 2) != 0)
			note("eio-after-heal");
	unsigned after = 0;
	for (unsigned i = 0; i < n; i++)
		if (rd(fd, i, 2, 3) != 0)
			after++;
	if (after)
		note("eio-data-after-heal");
	printf("FAULTIO eio: healed after %.1f s; %u chunks read back, %u wrong\n", now() - t0, n, after);
	close(fd);
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: faultio fault NOSPC_DEV EIO_DEV BAD_START BAD_LEN\n");
		return 2;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	size_t len = (size_t)SLOTS * (CHUNK + PAGE) + PAGE;
	mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	untouched = mmap(NULL, UNTOUCHED, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (mem == MAP_FAILED || untouched == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	mlock(mem, len);
	mlock(untouched, UNTOUCHED);
	fill_guards();
	const char *trial = "disk-fault";
	if (!strcmp(argv[1], "fault") && argc == 6) {
		nospc(argv[2]);
		eio(argv[3], strtoull(argv[4], NULL, 0), strtoull(argv[5], NULL, 0));
	} else {
		fprintf(stderr, "faultio: unknown mode %s\n", argv[1]);
		return 2;
	}
	if (!guards_intact())
		note("memory-changed");
	printf("FAULTIO failed_requests=%lu\n", failed_requests);
	if (fail[0])
		printf("RESULT %s FAIL%s failed_requests=%lu bad_errno=%lu damaged=%lu\n", trial, fail,
		       failed_requests, bad_errno, damaged);
	else
		printf("RESULT %s PASS failed_requests=%lu\n", trial, failed_requests);
	return 0;
}
