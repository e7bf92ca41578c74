/*
 * migwrite: guest side of memvisor's migration trial.
 *
 * The device must write guest memory the CPU never touches, for as long as the migration runs:
 * then only the back end's dirty log can tell QEMU to send those pages again. So: a locked
 * buffer of CHUNKS chunks that only the disk writes into (O_DIRECT reads), and passes over the
 * chunks until SECONDS have gone; for each chunk, first check that it still holds what the device put
 * there last time (the pass number is kept in CPU-written memory, which migrates by itself),
 * then write new contents to the disk from a small CPU-written buffer and read them back into
 * the chunk. A chunk the destination got stale fails its check on the next pass; a final pass
 * checks every chunk once more.
 *
 * usage: migwrite DEVICE CHUNKS SECONDS     (chunks of 256 KiB; passes until SECONDS have gone)
 * prints "MIGWRITE ..." progress lines and one "RESULT mig PASS|FAIL ..." line.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (256 * 1024)


static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/* The contents of chunk i after pass p: 64-bit words from a per-(i, p) xorshift sequence. */
static void pattern(uint64_t *w, unsigned i, unsigned p)
{
	uint64_t x = 0x9e3779b97f4a7c15ULL ^ ((uint64_t)i << 20) ^ p;
	for (size_t k = 0; k < CHUNK / 8; k++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		w[k] = x;
	}
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: migwrite DEVICE CHUNKS SECONDS\n");
		return 2;
	}
	unsigned chunks = atoi(argv[2]);
	double seconds = atof(argv[3]);
	int fd = open(argv[1], O_RDWR | O_DIRECT);
	if (fd < 0) {
		perror("open");
		return 1;
	}
	uint8_t *big = mmap(NULL, (size_t)chunks * CHUNK, PROT_READ | PROT_WRITE,
			    MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	uint64_t *wbuf, *want;
	if (big == MAP_FAILED || mlock(big, (size_t)chunks * CHUNK) ||
	    posix_memalign((void **)&wbuf, 4096, CHUNK) || posix_memalign((void **)&want, 4096, CHUNK)) {
		perror("buffers");
		return 1;
	}
	unsigned *done = calloc(chunks, sizeof(unsigned));
	unsigned long mismatches = 0, checked = 0;
	double t0 = now();
	printf("MIGWRITE started: %u chunks of %d KiB, passes for %.0f s\n", chunks, CHUNK / 1024, seconds);
	fflush(stdout);
	int last = 0;
	for (unsigned p = 1; !last; p++) {
		last = now() - t0 >= seconds; /* this pass only checks */
		for (unsigned i = 0; i < chunks; i++) {
			uint8_t *c = big + (size_t)i * CHUNK;
			if (done[i]) {
				pattern(want, i, done[i]);
				checked++;
				if (memcmp(c, want, CHUNK)) {
					mismatches++;
					if (mismatches <= 5)
						printf("MIGWRITE mismatch: chunk %u, last written in pass %u, checked in pass %u\n",
						       i, done[i], p);
				}
			}
			if (last)
				continue;
			pattern(wbuf, i, p);
			off_t at = (off_t)i * CHUNK;
			if (pwrite(fd, wbuf, CHUNK, at) != CHUNK || pread(fd, c, CHUNK, at) != CHUNK) {
				perror("O_DIRECT I/O");
				return 1;
			}
			done[i] = p;
		}
		printf("MIGWRITE pass %u done at %.1f s, %lu mismatches so far\n", p, now() - t0, mismatches);
		fflush(stdout);
	}
	printf("RESULT mig %s checked=%lu mismatches=%lu\n", mismatches ? "FAIL" : "PASS", checked,
	       mismatches);
	fflush(stdout);
	return mismatches != 0;
}
