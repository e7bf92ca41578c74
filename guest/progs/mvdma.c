/*
 * mvdma: the guest side of memvisor's vfio-user trial. It takes the mvdma device (memvisor's
 * reference DMA engine, served over vfio-user) with the guest's own vfio-pci, maps buffers
 * through the guest IOMMU with VFIO type1 -- every guest map reaches the server as DMA_MAP --
 * and drives DMA with scatter-gather tables, checking every byte both ways: the device reports
 * a checksum (FNV-1a 64) of what it read, and the destination must hold exactly the source,
 * with the bytes around it untouched. A second thread maps and unmaps other buffers all the
 * while. Then it maps thousands of single pages (scale), and sends DMA to IOVAs that were never
 * mapped or have just been unmapped: those descriptors must fail with an errno and write
 * nothing. Last, races: it unmaps a buffer while the device is writing it, in both modes, and
 * maps another buffer at the same IOVA. Nothing may land in the old buffer once the unmap
 * returned, and the new buffer must get the device's data.
 *
 * usage: mvdma PCI-ADDRESS IOMMU-GROUP REQUESTS SECONDS SCALE-PAGES
 * The device's registers are documented in crates/memvisor-vfio-user/src/dmadev.rs.
 * prints "MVDMA ..." lines and one "RESULT vfio-user PASS|FAIL ..." line.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/vfio.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define REG_ID 0x00
#define REG_DESC 0x08
#define REG_COUNT 0x10
#define REG_MODE 0x14
#define REG_DOORBELL 0x18
#define REG_STATUS 0x1c
#define REG_ERRNO 0x20
#define REG_DONE 0x24
#define REG_SEQ 0x28
#define ST_DONE 2
#define ST_FAILED 3

#define POOL (16u << 20)          /* source and destination pools */
#define SRC_IOVA 0x10000000ull
#define DST_IOVA 0x20000000ull
#define DESC_IOVA 0x30000000ull
#define DESC_BYTES (64 * 1024)    /* up to 2048 descriptors */
#define CHURN_IOVA 0x40000000ull  /* the churn thread's pages */
#define CHURN_PAGES 64
#define SCALE_IOVA 0x100000000ull /* scale: one mapping per page, a page apart */
#define NEVER_IOVA 0x70000000ull  /* never mapped */
#define GONE_IOVA 0x60000000ull   /* mapped, then unmapped */
#define RACE_IOVA 0x50000000ull   /* unmapped while the device writes it */
#define RACE_BYTES (256 * 1024)
#define RACE_DESCS 1024           /* 16 KiB each, over the race buffer again and again */
#define RACES 32                  /* per mode */
#define GUARD 64

struct desc {
	uint64_t src, dst;
	uint32_t len, status;
	uint64_t sum;
};

static int container, dev, efd;
static uint64_t bar0, failures;
static uint8_t *src, *dst;
static volatile struct desc *descs;
static volatile int stop_churn;
static uint64_t churn_pairs, churn_errors;
static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return rng;
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void fail(const char *what, uint64_t a, uint64_t b)
{
	if (failures++ < 20)
		printf("MVDMA FAIL %s (%#llx, %#llx)\n", what, (unsigned long long)a, (unsigned long long)b);
}

static uint64_t fnv(const uint8_t *p, size_t n)
{
	uint64_t h = 0xcbf29ce484222325ull;
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 0x100000001b3ull;
	}
	return h;
}

static uint32_t rd32(uint64_t off)
{
	uint32_t v = 0;
	if (pread(dev, &v, 4, bar0 + off) != 4) {
		perror("mvdma register read");
		exit(1);
	}
	return v;
}

static void wr32(uint64_t off, uint32_t v)
{
	if (pwrite(dev, &v, 4, bar0 + off) != 4) {
		perror("mvdma register write");
		exit(1);
	}
}

static int map(void *va, uint64_t iova, uint64_t size)
{
	struct vfio_iommu_type1_dma_map m = { .argsz = sizeof m,
		.flags = VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
		.vaddr = (uintptr_t)va, .iova = iova, .size = size };
	return ioctl(container, VFIO_IOMMU_MAP_DMA, &m);
}

static int unmap(uint64_t iova, uint64_t size)
{
	struct vfio_iommu_type1_dma_unmap u = { .argsz = sizeof u, .iova = iova, .size = size };
	return ioctl(container, VFIO_IOMMU_UNMAP_DMA, &u);
}

/* Starts the first `n` descriptors in `mode`; returns SEQ before the start. */
static uint32_t start(int n, int mode)
{
	uint32_t seq = rd32(REG_SEQ);
	wr32(REG_DESC, (uint32_t)DESC_IOVA);
	wr32(REG_DESC + 4, (uint32_t)(DESC_IOVA >> 32));
	wr32(REG_COUNT, n);
	wr32(REG_MODE, mode);
	wr32(REG_DOORBELL, 1);
	return seq;
}

/* Waits for the MSI of the table started when SEQ was `seq`. Returns STATUS, -1 on timeout. */
static int finish(uint32_t seq)
{
	struct pollfd p = { .fd = efd, .events = POLLIN };
	for (int waited = 0; waited < 30; waited++) {
		if (poll(&p, 1, 1000) == 1) {
			uint64_t c;
			if (read(efd, &c, 8) != 8)
				perror("eventfd");
			if (rd32(REG_SEQ) != seq)
				return rd32(REG_STATUS);
		}
	}
	/* No interrupt: is the device done anyway? */
	if (rd32(REG_SEQ) != seq) {
		fail("completion without an interrupt", seq, rd32(REG_SEQ));
		return rd32(REG_STATUS);
	}
	return -1;
}

/* Runs the first `n` descriptors in `mode`; waits for the MSI. Returns STATUS, -1 on timeout. */
static int run(int n, int mode)
{
	return finish(start(n, mode));
}

static void spin_us(double us)
{
	double until = now() + us / 1e6;
	while (now() < until)
		;
}

/* Races an unmap against the device writing the buffer it takes away, `RACES` times in `mode`,
 * then maps a new buffer at the same IOVA. Returns the descriptors that failed (the ones the
 * unmap cut off), for the host's count. */
static uint64_t race(int mode)
{
	int overlapped = 0, stale = 0, refused = 0;
	uint64_t failed_descs = 0, late_bytes = 0;
	double delay_us = 300;
	for (int r = 0; r < RACES; r++) {
		uint8_t *a = mmap(NULL, RACE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		uint8_t *b = mmap(NULL, RACE_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		memset(a, 0xee, RACE_BYTES);
		memset(b, 0xee, RACE_BYTES);
		if (map(a, RACE_IOVA, RACE_BYTES)) {
			fail("race: map of the first buffer", r, errno);
			break;
		}
		for (int i = 0; i < RACE_DESCS; i++) {
			descs[i].src = SRC_IOVA + (i % 64) * 16384ull;
			descs[i].dst = RACE_IOVA + (i % (RACE_BYTES / 16384)) * 16384ull;
			descs[i].len = 16384;
			descs[i].status = 0xffffffff;
		}
		uint32_t seq = start(RACE_DESCS, mode);
		spin_us(delay_us);
		if (unmap(RACE_IOVA, RACE_BYTES))
			refused++;
		/* The unmap has returned: from here on the device must not write `a`. */
		memset(a, 0x77, RACE_BYTES);
		if (map(b, RACE_IOVA, RACE_BYTES))
			fail("race: map of the new buffer at the same iova", r, errno);
		int st = finish(seq);
		if (st < 0)
			fail("race: no completion", r, mode);
		uint32_t ok = rd32(REG_DONE);
		failed_descs += RACE_DESCS - ok;
		if (ok > 0 && ok < RACE_DESCS)
			overlapped++;
		/* Move the unmap toward the middle of the table. */
		if (ok == RACE_DESCS)
			delay_us /= 2;
		else if (ok == 0)
			delay_us = delay_us * 2 + 50;
		uint64_t late = 0;
		for (int k = 0; k < RACE_BYTES; k++)
			late += a[k] != 0x77;
		late_bytes += late;
		/* The new buffer gets what the device writes now. */
		descs[0].src = SRC_IOVA + 4096 * (r + 1);
		descs[0].dst = RACE_IOVA + 100;
		descs[0].len = 65536;
		descs[0].status = 0xffffffff;
		if (run(1, mode) != ST_DONE || descs[0].status != 0 || memcmp(b + 100, src + 4096 * (r + 1), 65536) != 0)
			stale++;
		if (unmap(RACE_IOVA, RACE_BYTES))
			refused++;
		munmap(a, RACE_BYTES);
		munmap(b, RACE_BYTES);
	}
	printf("MVDMA race, mode %d: %d races, %d with the unmap inside the table, %llu descriptors cut off; "
	       "%llu bytes written after an unmap returned, %d new buffers without their data, %d unmaps refused\n",
	       mode, RACES, overlapped, (unsigned long long)failed_descs, (unsigned long long)late_bytes, stale, refused);
	if (late_bytes)
		fail("race: the device wrote a buffer after its unmap returned", late_bytes, mode);
	if (stale)
		fail("race: a new buffer at an unmapped iova did not get the device's data", stale, mode);
	if (refused)
		fail("race: unmap refused", refused, mode);
	if (overlapped < RACES / 8)
		fail("race: too few unmaps landed inside a running table to prove anything", overlapped, mode);
	return failed_descs;
}

static void *churn(void *arg)
{
	(void)arg;
	uint8_t *pages = mmap(NULL, CHURN_PAGES * 4096, PROT_READ | PROT_WRITE,
			      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	while (!stop_churn) {
		for (int i = 0; i < CHURN_PAGES; i++)
			if (map(pages + i * 4096, CHURN_IOVA + i * 8192ull, 4096))
				churn_errors++;
		for (int i = 0; i < CHURN_PAGES; i++)
			if (unmap(CHURN_IOVA + i * 8192ull, 4096))
				churn_errors++;
		churn_pairs += CHURN_PAGES;
	}
	return NULL;
}

/* A length from 1 byte to 4 MiB, log-uniform: most small, some large. */
static uint32_t rand_len(void)
{
	int bits = rnd() % 23; /* 2^0 .. 2^22 */
	uint32_t base = 1u << bits;
	return base + rnd() % base;
}

/* Checks one finished descriptor: status, the device's checksum, the destination and its
 * guard bytes. */
static uint64_t check(int i, uint64_t so, uint64_t dof, uint32_t len)
{
	if (descs[i].status != 0) {
		fail("descriptor status", i, descs[i].status);
		return 0;
	}
	if (descs[i].sum != fnv(src + so, len))
		fail("device checksum of what it read", i, len);
	if (memcmp(dst + dof, src + so, len) != 0)
		fail("destination differs from source", i, len);
	for (uint64_t g = (dof >= GUARD ? dof - GUARD : 0); g < dof; g++)
		if (dst[g] != 0xee) {
			fail("byte before the destination written", g, dst[g]);
			break;
		}
	for (uint64_t g = dof + len; g < dof + len + GUARD && g < POOL; g++)
		if (dst[g] != 0xee) {
			fail("byte after the destination written", g, dst[g]);
			break;
		}
	return len;
}

int main(int argc, char **argv)
{
	if (argc != 6) {
		fprintf(stderr, "usage: mvdma PCI-ADDRESS IOMMU-GROUP REQUESTS SECONDS SCALE-PAGES\n");
		return 2;
	}
	int requests = atoi(argv[3]), seconds = atoi(argv[4]), scale = atoi(argv[5]);
	container = open("/dev/vfio/vfio", O_RDWR);
	char path[64];
	snprintf(path, sizeof path, "/dev/vfio/%s", argv[2]);
	int group = open(path, O_RDWR);
	if (container < 0 || group < 0 || ioctl(group, VFIO_GROUP_SET_CONTAINER, &container) ||
	    ioctl(container, VFIO_SET_IOMMU, VFIO_TYPE1v2_IOMMU)) {
		perror("vfio container");
		return 1;
	}
	dev = ioctl(group, VFIO_GROUP_GET_DEVICE_FD, argv[1]);
	if (dev < 0) {
		perror("vfio device");
		return 1;
	}
	struct vfio_region_info ri = { .argsz = sizeof ri, .index = VFIO_PCI_BAR0_REGION_INDEX };
	struct vfio_region_info ci = { .argsz = sizeof ci, .index = VFIO_PCI_CONFIG_REGION_INDEX };
	if (ioctl(dev, VFIO_DEVICE_GET_REGION_INFO, &ri) || ioctl(dev, VFIO_DEVICE_GET_REGION_INFO, &ci)) {
		perror("region info");
		return 1;
	}
	bar0 = ri.offset;
	uint16_t cmd;
	if (pread(dev, &cmd, 2, ci.offset + 4) != 2)
		return 1;
	cmd |= 0x6; /* memory space, bus master */
	if (pwrite(dev, &cmd, 2, ci.offset + 4) != 2)
		return 1;
	if (rd32(REG_ID) != 0x6d76646d) {
		printf("RESULT vfio-user FAIL device id %#x is not mvdm\n", rd32(REG_ID));
		return 1;
	}
	/* MSI vector 0 -> an eventfd */
	efd = eventfd(0, 0);
	struct {
		struct vfio_irq_set s;
		int32_t fd;
	} irq = { { .argsz = sizeof irq, .flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
		    .index = VFIO_PCI_MSI_IRQ_INDEX, .start = 0, .count = 1 }, efd };
	if (ioctl(dev, VFIO_DEVICE_SET_IRQS, &irq)) {
		perror("MSI eventfd");
		printf("RESULT vfio-user FAIL cannot set up MSI\n");
		return 1;
	}
	src = mmap(NULL, POOL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	dst = mmap(NULL, POOL, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	descs = mmap(NULL, DESC_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	double t0 = now();
	if (map(src, SRC_IOVA, POOL) || map(dst, DST_IOVA, POOL) || map((void *)descs, DESC_IOVA, DESC_BYTES)) {
		perror("VFIO_IOMMU_MAP_DMA");
		printf("RESULT vfio-user FAIL cannot map the pools\n");
		return 1;
	}
	printf("MVDMA device %s up; pools of %u MiB mapped in %.2f s\n", argv[1], POOL >> 20, now() - t0);
	memset(dst, 0xee, POOL);

	/* 1. correctness, with the churn thread mapping and unmapping beside it */
	pthread_t ct;
	pthread_create(&ct, NULL, churn, NULL);
	uint64_t bytes = 0, descriptors = 0, by_mode[2] = { 0, 0 };
	int done_requests = 0, timeouts = 0;
	t0 = now();
	for (int r = 0; r < requests && now() - t0 < seconds; r++) {
		int n = 1 + rnd() % 4, mode = r & 1;
		uint64_t so[4], dof[4];
		uint32_t len[4];
		uint64_t used_to = 0;
		for (int i = 0; i < n; i++) {
			/* Unaligned, non-overlapping destinations in order, guards between them. */
			len[i] = rand_len();
			uint64_t room = POOL - used_to - GUARD;
			if (len[i] > room / (n - i) / 2)
				len[i] = 1 + room / (n - i) / 2;
			dof[i] = used_to + GUARD + rnd() % (room / (n - i) - len[i] + 1) / 2;
			used_to = dof[i] + len[i];
			so[i] = rnd() % (POOL - len[i] + 1);
			for (uint32_t k = 0; k < len[i]; k += 8) {
				uint64_t v = rnd();
				memcpy(src + so[i] + k, &v, len[i] - k < 8 ? len[i] - k : 8);
			}
			descs[i].src = SRC_IOVA + so[i];
			descs[i].dst = DST_IOVA + dof[i];
			descs[i].len = len[i];
			descs[i].status = 0xffffffff;
			descs[i].sum = 0;
		}
		int st = run(n, mode);
		if (st != ST_DONE || rd32(REG_DONE) != (uint32_t)n) {
			fail("table status", st, rd32(REG_ERRNO));
			if (st < 0 && ++timeouts > 3)
				break;
		}
		for (int i = 0; i < n; i++) {
			bytes += check(i, so[i], dof[i], len[i]);
			memset(dst + dof[i], 0xee, len[i]);
		}
		descriptors += n;
		by_mode[mode] += n;
		done_requests++;
	}
	double secs = now() - t0;
	stop_churn = 1;
	pthread_join(ct, NULL);
	printf("MVDMA correctness: %d tables, %llu descriptors (copy %llu, pin %llu), %.1f MiB in %.1f s; "
	       "churn %llu map/unmap pairs, %llu churn errors\n",
	       done_requests, (unsigned long long)descriptors, (unsigned long long)by_mode[0],
	       (unsigned long long)by_mode[1], bytes / 1048576.0, secs, (unsigned long long)churn_pairs,
	       (unsigned long long)churn_errors);
	if (churn_errors)
		fail("churn map/unmap errors", churn_errors, churn_pairs);
	if (done_requests < requests && done_requests < 100)
		fail("too few tables ran", done_requests, requests);

	/* 2. scale: `scale` single-page mappings, a page apart; DMA through each */
	uint8_t *sp = mmap(NULL, (size_t)scale * 4096, PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	t0 = now();
	int mapped = 0;
	for (; mapped < scale; mapped++)
		if (map(sp + mapped * 4096ull, SCALE_IOVA + mapped * 8192ull, 4096)) {
			fail("scale map", mapped, errno);
			break;
		}
	double map_s = now() - t0;
	int scale_ok = 0;
	for (int base = 0; base < mapped; base += 512) {
		int n = mapped - base < 512 ? mapped - base : 512;
		for (int i = 0; i < n; i++) {
			uint64_t v = rnd();
			memcpy(src + i * 4096 + 100, &v, 8);
			descs[i].src = SRC_IOVA + i * 4096 + 100;
			descs[i].dst = SCALE_IOVA + (base + i) * 8192ull + 200;
			descs[i].len = 3000;
			descs[i].status = 0xffffffff;
		}
		if (run(n, (base / 512) & 1) != ST_DONE)
			fail("scale table", base, rd32(REG_ERRNO));
		for (int i = 0; i < n; i++)
			if (descs[i].status == 0 && memcmp(sp + (base + i) * 4096ull + 200, src + i * 4096 + 100, 3000) == 0)
				scale_ok++;
	}
	if (scale_ok != mapped)
		fail("scale DMA", scale_ok, mapped);
	t0 = now();
	for (int i = 0; i < mapped; i++)
		if (unmap(SCALE_IOVA + i * 8192ull, 4096))
			fail("scale unmap", i, errno);
	double unmap_s = now() - t0;
	printf("MVDMA scale: %d single-page mappings, %.1f us per map, %.1f us per unmap (whole guest stack), "
	       "%d pages written by DMA and checked\n",
	       mapped, map_s * 1e6 / (mapped ? mapped : 1), unmap_s * 1e6 / (mapped ? mapped : 1), scale_ok);

	/* 3. DMA to and from IOVAs that are not mapped: fails, reported, nothing written */
	uint8_t *gone = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	if (map(gone, GONE_IOVA, 4096) || unmap(GONE_IOVA, 4096))
		fail("map+unmap of the gone page", errno, 0);
	memset(gone, 0x5a, 4096);
	for (int mode = 0; mode < 2; mode++) {
		memset(dst, 0xee, 8192);
		struct { uint64_t s, d; uint32_t len; const char *what; } bad[] = {
			{ SRC_IOVA, GONE_IOVA, 4096, "write into an unmapped page" },
			{ NEVER_IOVA, DST_IOVA, 4096, "read from a never-mapped iova" },
			{ SRC_IOVA, DST_IOVA + POOL - 4096, 8192, "write running past the mapping" },
			{ SRC_IOVA, DST_IOVA + 100, 1000, "a good one after them" },
		};
		for (int i = 0; i < 4; i++) {
			descs[i].src = bad[i].s;
			descs[i].dst = bad[i].d;
			descs[i].len = bad[i].len;
			descs[i].status = 0xffffffff;
		}
		memset(dst + POOL - 4096, 0xee, 4096);
		int st = run(4, mode);
		printf("MVDMA unmapped, mode %d: STATUS %d ERRNO %u DONE %u; statuses %u %u %u %u\n", mode, st,
		       rd32(REG_ERRNO), rd32(REG_DONE), descs[0].status, descs[1].status, descs[2].status,
		       descs[3].status);
		if (st != ST_FAILED || rd32(REG_ERRNO) == 0 || rd32(REG_DONE) != 1)
			fail("table with bad descriptors not reported failed", st, rd32(REG_DONE));
		for (int i = 0; i < 3; i++)
			if (descs[i].status == 0 || descs[i].status == 0xffffffff)
				fail(bad[i].what, i, descs[i].status);
		if (descs[3].status != 0 || memcmp(dst + 100, src, 1000) != 0)
			fail("good descriptor after bad ones", mode, descs[3].status);
		for (int k = 0; k < 4096; k++)
			if (gone[k] != 0x5a) {
				fail("the device wrote a page after the guest unmapped it", k, gone[k]);
				break;
			}
		for (int k = 0; k < 4096; k++)
			if (dst[POOL - 4096 + k] != 0xee) {
				fail("the mapped part of a refused write was written", k, dst[POOL - 4096 + k]);
				break;
			}
	}
	/* 4. unmaps racing the device, in pin mode and copy mode */
	uint64_t race_failed = race(1) + race(0);
	printf("MVDMA race_failed_descriptors=%llu\n", (unsigned long long)race_failed);
	unmap(SRC_IOVA, POOL);
	unmap(DST_IOVA, POOL);
	unmap(DESC_IOVA, DESC_BYTES);
	printf("RESULT vfio-user %s failures=%llu tables=%d descriptors=%llu mib=%.1f churn_pairs=%llu scale=%d\n",
	       failures ? "FAIL" : "PASS", (unsigned long long)failures, done_requests,
	       (unsigned long long)descriptors, bytes / 1048576.0, (unsigned long long)churn_pairs, mapped);
	return failures != 0;
}
