/*
 * blkdisc: guest side of memvisor's discard check (guest/trial.sh blk --loop).
 *
 *   blkdisc DEV OFFSET LEN WAIT
 *
 * Writes LEN bytes of a pattern with no zero byte at OFFSET (O_DIRECT, one request per MiB),
 * reads them back and compares; discards the range with the BLKDISCARD ioctl (the kernel's
 * virtio-blk driver sends it as VIRTIO_BLK_T_DISCARD); says "BLKDISC discarded", waits WAIT
 * seconds (the harness's negative control writes into the range then), and reads the range
 * back (O_DIRECT): every byte must be zero. That holds only because the disk is a loop device
 * over a file, which punches a hole for a discard: virtio's DISCARD itself promises no zeros.
 * Prints "BLKDISC ..." lines and exits 0 when every check passed.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#define STEP (1 << 20)

static int rw(int fd, unsigned char *buf, size_t len, off_t at, int write)
{
	size_t done = 0;
	while (done < len) {
		size_t n = len - done < STEP ? len - done : STEP;
		ssize_t r = write ? pwrite(fd, buf + done, n, at + done) : pread(fd, buf + done, n, at + done);
		if (r <= 0) {
			printf("BLKDISC %s at %lld failed: %s\n", write ? "write" : "read",
			       (long long)(at + done), r < 0 ? strerror(errno) : "short");
			return -1;
		}
		done += r;
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc != 5) {
		fprintf(stderr, "usage: blkdisc DEV OFFSET LEN WAIT\n");
		return 2;
	}
	off_t at = strtoll(argv[2], 0, 0);
	size_t len = strtoull(argv[3], 0, 0);
	int wait = atoi(argv[4]);
	int fd = open(argv[1], O_RDWR | O_DIRECT);
	if (fd < 0) {
		printf("BLKDISC open %s: %s\n", argv[1], strerror(errno));
		return 1;
	}
	unsigned char *pat, *buf;
	if (posix_memalign((void **)&pat, 4096, len) || posix_memalign((void **)&buf, 4096, len))
		return 1;
	for (size_t i = 0; i < len; i++)
		pat[i] = (unsigned char)((i * 131 + (i >> 12) * 7) % 255 + 1); /* never 0 */
	if (rw(fd, pat, len, at, 1) || fsync(fd) || rw(fd, buf, len, at, 0))
		return 1;
	if (memcmp(pat, buf, len)) {
		printf("BLKDISC the range did not read back as written before the discard\n");
		return 1;
	}
	printf("BLKDISC written and verified %zu bytes at %lld\n", len, (long long)at);
	uint64_t range[2] = {(uint64_t)at, len};
	if (ioctl(fd, BLKDISCARD, range)) {
		printf("BLKDISC BLKDISCARD %zu bytes at %lld: %s\n", len, (long long)at, strerror(errno));
		return 1;
	}
	printf("BLKDISC discarded %zu bytes at %lld\n", len, (long long)at);
	fflush(stdout);
	sleep(wait);
	memset(buf, 0xff, len);
	if (rw(fd, buf, len, at, 0))
		return 1;
	size_t nonzero = 0, first = len;
	for (size_t i = 0; i < len; i++)
		if (buf[i]) {
			nonzero++;
			if (first == len)
				first = i;
		}
	if (nonzero) {
		printf("BLKDISC %zu of %zu bytes are not zero after the discard, the first at %lld\n", nonzero,
		       len, (long long)(at + first));
		return 1;
	}
	printf("BLKDISC zeros %zu bytes\n", len);
	return 0;
}
