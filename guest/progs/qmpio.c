// qmpio: the guest side of the QMP trial (guest/trial.sh qmp, guest/qmp-trial.py). The host
// changes the disk under a running guest through QMP (resize, throttle); this program does the
// I/O the host watches and says what the guest sees, on the console:
//   1. verified I/O: writes a pseudo-random pattern over the first VERIFY_MIB MiB with O_DIRECT,
//      flushes, reads it back with O_DIRECT and compares ("QMPIO VERIFY PASS|FAIL").
//   2. until SECS seconds have passed: writes a 64 KiB block stamped with its sequence number to
//      the next slot of the second VERIFY_MIB MiB, reads it back and compares (O_DIRECT, one
//      request at a time). Every second one line
//        QMPIO RATE t=<uptime s> secs=<interval s> rd=<bytes> wr=<bytes> rdtot=<bytes>
//                   wrtot=<bytes> sectors=<size in 512-byte sectors> bad=<mismatches so far>
//      gives the interval's rates (read and write) and the capacity the kernel shows
//      (/sys/block/<disk>/size, read each interval, so a resize shows without a reboot).
//   3. when the capacity changes: "QMPIO SIZE sectors=<n>", and the new last 4 KiB is read
//      ("QMPIO LASTBLOCK ok|fail <errno>"), so the guest proves it can use what it was told.
// Exits with "RESULT qmpio PASS|FAIL <details>" (FAIL on any mismatch or I/O error).
// usage: qmpio DEV VERIFY_MIB SECS
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLK (64 * 1024)

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static double uptime(void) {
  double u = 0;
  FILE *f = fopen("/proc/uptime", "r");
  if (f) {
    if (fscanf(f, "%lf", &u) != 1) u = 0;
    fclose(f);
  }
  return u;
}

// The pattern of byte range [off, off + len): 64-bit words of a hash of their offset and a seed.
static void fill(uint64_t *p, uint64_t off, size_t len, uint64_t seed) {
  for (size_t i = 0; i < len / 8; i++) {
    uint64_t x = (off + i * 8) ^ seed;
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    p[i] = x;
  }
}

static long long sectors(const char *sizefile) {
  char b[64] = {0};
  int fd = open(sizefile, O_RDONLY);
  if (fd < 0) return -1;
  ssize_t n = read(fd, b, sizeof b - 1);
  close(fd);
  return n > 0 ? atoll(b) : -1;
}

int main(int argc, char **argv) {
  if (argc != 4) { fprintf(stderr, "usage: qmpio DEV VERIFY_MIB SECS\n"); return 2; }
  const char *dev = argv[1];
  uint64_t vbytes = (uint64_t)atoi(argv[2]) << 20;
  double secs = atof(argv[3]);
  char sizefile[128];
  snprintf(sizefile, sizeof sizefile, "/sys/block/%s/size", strrchr(dev, '/') ? strrchr(dev, '/') + 1 : dev);
  int fd = open(dev, O_RDWR | O_DIRECT);
  if (fd < 0) { printf("RESULT qmpio FAIL open %s: %s\n", dev, strerror(errno)); return 1; }
  uint64_t *w, *r, *e;
  if (posix_memalign((void **)&w, 4096, BLK) || posix_memalign((void **)&r, 4096, BLK) ||
      posix_memalign((void **)&e, 4096, BLK)) { printf("RESULT qmpio FAIL no memory\n"); return 1; }
  setvbuf(stdout, NULL, _IOLBF, 0);
  long long sz = sectors(sizefile);
  printf("QMPIO disk %s sectors=%lld\n", dev, sz);
  if (sz < 0 || (uint64_t)sz * 512 < 2 * vbytes) { printf("RESULT qmpio FAIL disk too small\n"); return 1; }

  // 1. Verified I/O over the first vbytes.
  double t0 = now();
  int bad = 0, ioerr = 0;
  for (uint64_t o = 0; o < vbytes; o += BLK) {
    fill(w, o, BLK, 1);
    if (pwrite(fd, w, BLK, o) != BLK) ioerr++;
  }
  if (fdatasync(fd)) ioerr++;
  for (uint64_t o = 0; o < vbytes; o += BLK) {
    fill(e, o, BLK, 1);
    if (pread(fd, r, BLK, o) != BLK) ioerr++;
    else if (memcmp(r, e, BLK)) bad++;
  }
  printf("QMPIO VERIFY %s mib=%llu in %.2f s (%d blocks of 64 KiB mismatched, %d I/O errors)\n",
         bad || ioerr ? "FAIL" : "PASS", (unsigned long long)(vbytes >> 20), now() - t0, bad, ioerr);
  int verify_bad = bad || ioerr;

  // 2. Write, read back, compare, one 64 KiB block at a time; rates every second.
  uint64_t slots = vbytes / BLK, seq = 0, rd = 0, wr = 0, rdtot = 0, wrtot = 0;
  double start = now(), last = start;
  long long seen = sz;
  int lastblock_bad = 0;
  while (now() - start < secs) {
    uint64_t off = vbytes + (seq % slots) * BLK;
    fill(w, off, BLK, 0x5eed0000ULL + seq);
    if (pwrite(fd, w, BLK, off) == BLK) wr += BLK; else ioerr++;
    if (pread(fd, r, BLK, off) == BLK) { rd += BLK; if (memcmp(r, w, BLK)) bad++; } else ioerr++;
    seq++;
    double t = now();
    if (t - last >= 1.0) {
      long long s = sectors(sizefile);
      rdtot += rd; wrtot += wr;
      printf("QMPIO RATE t=%.3f secs=%.3f rd=%llu wr=%llu rdtot=%llu wrtot=%llu sectors=%lld bad=%d ioerr=%d\n",
             uptime(), t - last, (unsigned long long)rd, (unsigned long long)wr, (unsigned long long)rdtot,
             (unsigned long long)wrtot, s, bad, ioerr);
      rd = wr = 0; last = t;
      if (s != seen && s > 8) {
        // 3. The capacity changed: its new last 4 KiB must read.
        printf("QMPIO SIZE sectors=%lld (was %lld)\n", s, seen);
        seen = s;
        ssize_t n = pread(fd, r, 4096, (off_t)s * 512 - 4096);
        if (n == 4096) printf("QMPIO LASTBLOCK ok at byte %lld\n", s * 512 - 4096);
        else { printf("QMPIO LASTBLOCK fail %zd %s\n", n, strerror(errno)); lastblock_bad = 1; }
      }
    }
  }
  if (!verify_bad && !bad && !ioerr && !lastblock_bad)
    printf("RESULT qmpio PASS blocks=%llu\n", (unsigned long long)seq);
  else
    printf("RESULT qmpio FAIL%s mismatched=%d ioerr=%d%s\n", verify_bad ? " verify" : "", bad, ioerr,
           lastblock_bad ? " lastblock" : "");
  return 0;
}
