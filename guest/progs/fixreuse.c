/*
 * fixreuse: guest side of memvisor's registered-buffer balloon trial (guest/trial.sh balloon
 * --fixed): O_DIRECT reads into memory the guest freed and free page reporting gave back.
 *
 * Model: the back end registers guest memory with io_uring in 2 MiB chunks of host memory once
 * transfers touch them, and a registered chunk keeps its pages pinned in the host kernel. When
 * the balloon (in the same back end process) discards a page of such a chunk, the guest's
 * mapping gets a fresh page while the registration still names the old one, so a READ_FIXED
 * would fill the old page and the guest would never see the data. The back end must take a
 * chunk out of its table before it discards it. This program makes that case happen often:
 *
 * Each round maps a fresh buffer of BUF MiB (2 MiB aligned, MADV_HUGEPAGE, so its pages come in
 * whole free 2 MiB blocks, the unit free page reporting reports), fills it with a poison byte,
 * and reads the disk's PAT MiB at OFF MiB into it again and again with 64 KiB O_DIRECT reads
 * (piece k of the buffer gets piece k mod (PAT / 64 KiB) of the disk), checking every 4 KiB
 * block against the generation last written there. Then it fills the buffer's first PAT MiB with
 * the next generation, writes that to the disk (64 KiB O_DIRECT writes), unmaps the buffer and
 * waits WAIT seconds, so the guest reports the freed blocks and the balloon discards them. The
 * next round's buffer lands largely on those blocks: each round says how much of it lay in 2 MiB
 * blocks of guest memory an earlier round's buffer had used (from /proc/self/pagemap). Round 0
 * first writes generation 0 from its buffer.
 *
 * Block b (4 KiB, counted from OFF) at generation g holds 512 words, word i = mix(g, b, i). A bad
 * block is counted as poison (the read never reached the guest's page: the data went to a page
 * the guest no longer has), zero, or other (a wrong generation or garbage).
 *
 * usage: fixreuse DEVICE OFF_MIB PAT_MIB BUF_MIB ROUNDS WAIT
 * prints "FIXREUSE round ..." per round and "RESULT fixreuse PASS|FAIL ... bad=N (poison=..
 * zero=.. other=..)"; exits 0 only if every read succeeded and every block was right.
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

#define BLOCK 4096
#define PIECE (64 << 10)
#define MIB (1UL << 20)
#define HUGE (2UL << 20)
#define POISON 0x5a
/* Guest-physical 2 MiB blocks tracked (64 GiB of guest memory). */
#define MAX_BLOCKS (1UL << 15)

static uint64_t mix(uint64_t g, uint64_t b, uint64_t i)
{
	uint64_t x = (g << 48) ^ (b << 12) ^ i ^ 0x9e3779b97f4a7c15ULL;
	x ^= x >> 31;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 29;
	return x;
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void fill(uint64_t *w, uint64_t g, uint64_t b)
{
	for (uint64_t i = 0; i < BLOCK / 8; i++)
		w[i] = mix(g, b, i);
}

static unsigned long poison, zero, other;

/* Checks one 4 KiB block; 1 if right. */
static int check(const uint64_t *w, uint64_t g, uint64_t b)
{
	uint64_t i;
	for (i = 0; i < BLOCK / 8; i++)
		if (w[i] != mix(g, b, i))
			break;
	if (i == BLOCK / 8)
		return 1;
	const unsigned char *c = (const unsigned char *)w;
	int all_p = 1, all_z = 1;
	for (i = 0; i < BLOCK; i++) {
		all_p &= c[i] == POISON;
		all_z &= c[i] == 0;
	}
	if (all_p)
		poison++;
	else if (all_z)
		zero++;
	else
		other++;
	return 0;
}

/* Marks the guest-physical 2 MiB blocks under buf[0..len) in `now_used`; returns how many of
 * its pages lie in blocks `before` has (an earlier round's buffer used them). */
static unsigned long physical(int pm, char *buf, size_t len, unsigned char *before,
			      unsigned char *now_used, unsigned long *mapped)
{
	unsigned long again = 0;
	size_t pages = len / BLOCK;
	uint64_t *e = malloc(pages * 8);
	if (!e || pm < 0 ||
	    pread(pm, e, pages * 8, (uintptr_t)buf / BLOCK * 8) != (ssize_t)(pages * 8)) {
		free(e);
		return 0;
	}
	for (size_t p = 0; p < pages; p++) {
		if (!(e[p] >> 63))
			continue;
		uint64_t blk = (e[p] & ((1ULL << 55) - 1)) / (HUGE / BLOCK);
		if (blk >= MAX_BLOCKS)
			continue;
		(*mapped)++;
		if (before[blk])
			again++;
		now_used[blk] = 1;
	}
	free(e);
	return again;
}

int main(int argc, char **argv)
{
	if (argc != 7) {
		fprintf(stderr, "usage: fixreuse DEVICE OFF_MIB PAT_MIB BUF_MIB ROUNDS WAIT\n");
		return 2;
	}
	const char *dev = argv[1];
	off_t off = (off_t)atol(argv[2]) * MIB;
	size_t pat = (size_t)atol(argv[3]) * MIB, len = (size_t)atol(argv[4]) * MIB;
	int rounds = atoi(argv[5]), wait = atoi(argv[6]);
	if (pat == 0 || len < pat || rounds < 1) {
		fprintf(stderr, "fixreuse: need 0 < PAT <= BUF and ROUNDS >= 1\n");
		return 2;
	}
	int fd = open(dev, O_RDWR | O_DIRECT);
	if (fd < 0) {
		perror(dev);
		printf("RESULT fixreuse FAIL cannot open %s\n", dev);
		return 1;
	}
	int pm = open("/proc/self/pagemap", O_RDONLY);
	unsigned char *used = calloc(MAX_BLOCKS, 1), *used_now = calloc(MAX_BLOCKS, 1);
	size_t npieces = pat / PIECE;
	unsigned long ioerrors = 0, bad = 0, reads = 0, blocks = 0;
	uint64_t gen = 0;
	for (int r = 0; r < rounds; r++) {
		double t0 = now();
		char *map = mmap(NULL, len + HUGE, PROT_READ | PROT_WRITE,
				 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (map == MAP_FAILED) {
			perror("mmap");
			printf("RESULT fixreuse FAIL mmap of %zu MiB\n", len / MIB + 2);
			return 1;
		}
		char *buf = (char *)(((uintptr_t)map + HUGE - 1) & ~(HUGE - 1));
		madvise(buf, len, MADV_HUGEPAGE);
		memset(buf, POISON, len);
		if (r == 0) {
			for (size_t k = 0; k < npieces; k++) {
				for (size_t b = 0; b < PIECE / BLOCK; b++)
					fill((uint64_t *)(buf + k * PIECE + b * BLOCK), gen,
					     k * (PIECE / BLOCK) + b);
				if (pwrite(fd, buf + k * PIECE, PIECE, off + k * PIECE) != PIECE)
					ioerrors++;
			}
			memset(buf, POISON, pat);
		}
		memset(used_now, 0, MAX_BLOCKS);
		unsigned long mapped = 0;
		unsigned long again = physical(pm, buf, len, used, used_now, &mapped);
		unsigned long bad0 = bad, p0 = poison, z0 = zero, o0 = other;
		for (size_t k = 0; k < len / PIECE; k++) {
			char *p = buf + k * PIECE;
			size_t d = k % npieces;
			reads++;
			if (pread(fd, p, PIECE, off + d * PIECE) != PIECE) {
				ioerrors++;
				continue;
			}
			for (size_t b = 0; b < PIECE / BLOCK; b++) {
				blocks++;
				if (!check((uint64_t *)(p + b * BLOCK), gen, d * (PIECE / BLOCK) + b))
					bad++;
			}
		}
		double t1 = now();
		gen++;
		for (size_t k = 0; k < npieces; k++) {
			for (size_t b = 0; b < PIECE / BLOCK; b++)
				fill((uint64_t *)(buf + k * PIECE + b * BLOCK), gen,
				     k * (PIECE / BLOCK) + b);
			if (pwrite(fd, buf + k * PIECE, PIECE, off + k * PIECE) != PIECE)
				ioerrors++;
		}
		munmap(map, len + HUGE);
		for (unsigned long i = 0; i < MAX_BLOCKS; i++)
			used[i] |= used_now[i];
		printf("FIXREUSE round %d: read %zu MiB in %.1f s, %lu bad blocks (poison %lu, zero %lu, "
		       "other %lu); %lu of %lu pages in 2 MiB blocks an earlier round used\n",
		       r, len / MIB, t1 - t0, bad - bad0, poison - p0, zero - z0, other - o0,
		       again, mapped);
		fflush(stdout);
		sleep(wait);
	}
	printf("RESULT fixreuse %s rounds=%d reads=%lu blocks=%lu ioerrors=%lu bad=%lu (poison=%lu "
	       "zero=%lu other=%lu)\n",
	       ioerrors == 0 && bad == 0 ? "PASS" : "FAIL", rounds, reads, blocks, ioerrors, bad,
	       poison, zero, other);
	return ioerrors == 0 && bad == 0 ? 0 : 1;
}
