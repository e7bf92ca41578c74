/*
 * vioraw: a hostile guest for memvisor's vIOMMU trial. It takes a virtio-blk device away from
 * the kernel (vfio-pci), programs the guest IOMMU itself through VFIO type1, runs the device's
 * queue from user space, and sends requests whose buffers name IOVAs it never mapped or has
 * unmapped. Each such request must fail alone (status IOERR, nothing read or written), and the
 * device must keep serving good requests around them. Last, races: it unmaps a buffer while a
 * read into it is in flight and posts another read to the same IOVA; once the unmap returned
 * (the back end acknowledged the invalidation), nothing may land in the buffer.
 *
 * usage: vioraw PCI-ADDRESS IOMMU-GROUP
 * The disk holds a known pattern: the 64-bit word at byte offset o is PATTERN ^ o.
 * prints "VIORAW ..." lines and one "RESULT hostile PASS|FAIL ..." line.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/vfio.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PATTERN 0x6d656d7669736f72ULL /* "memvisor" */
#define QSIZE 16
#define BASE_IOVA 0x10000000ULL     /* where the ring and buffers are mapped */
#define AREA (64 * 1024)            /* ring (3 pages), header/status page, 12 data pages */
#define DATA_OFF 0x4000
#define NEVER_IOVA 0x70000000ULL    /* never mapped by anyone */
#define LATE_IOVA 0x20000000ULL     /* mapped, used, then unmapped */
#define RACE_IOVA 0x30000000ULL     /* unmapped while a read into it is in flight */
#define RACE_BYTES (256 * 1024)
#define RACES 8

static int dev;
static uint64_t bar_off[6];
static uint64_t common, notify, notify_mult;
static int common_bar, notify_bar;
static uint8_t *area;
static uint16_t avail_idx, used_seen, notify_off;
static int failures;

static void fail(const char *what)
{
	printf("VIORAW FAIL %s\n", what);
	failures++;
}

static void cfg_rw(int write, void *b, size_t n, uint64_t off)
{
	/* config space is region VFIO_PCI_CONFIG_REGION_INDEX, at bar_off[] of index 7 */
	struct vfio_region_info ri = { .argsz = sizeof ri, .index = VFIO_PCI_CONFIG_REGION_INDEX };
	static uint64_t cfg_base = UINT64_MAX;
	if (cfg_base == UINT64_MAX) {
		if (ioctl(dev, VFIO_DEVICE_GET_REGION_INFO, &ri)) {
			perror("config region");
			exit(1);
		}
		cfg_base = ri.offset;
	}
	ssize_t r = write ? pwrite(dev, b, n, cfg_base + off) : pread(dev, b, n, cfg_base + off);
	if (r != (ssize_t)n) {
		perror("config space");
		exit(1);
	}
}

static void bar_rw(int write, int bar, uint64_t off, void *b, size_t n)
{
	ssize_t r = write ? pwrite(dev, b, n, bar_off[bar] + off) : pread(dev, b, n, bar_off[bar] + off);
	if (r != (ssize_t)n) {
		fprintf(stderr, "bar %d offset %#llx: %s\n", bar, (unsigned long long)off, strerror(errno));
		exit(1);
	}
}

static uint32_t rd(uint64_t off, size_t n)
{
	uint32_t v = 0;
	bar_rw(0, common_bar, common + off, &v, n);
	return v;
}

static void wr(uint64_t off, uint32_t v, size_t n)
{
	bar_rw(1, common_bar, common + off, &v, n);
}

static void set_status(uint8_t s)
{
	wr(20, s, 1);
}

/* descriptor, avail and used rings inside the area */
struct desc {
	uint64_t addr;
	uint32_t len;
	uint16_t flags, next;
};
#define D_NEXT 1
#define D_WRITE 2

static volatile struct desc *descs(void) { return (volatile struct desc *)area; }
static volatile uint16_t *avail(void) { return (volatile uint16_t *)(area + 0x1000); }
static volatile uint16_t *used_idx(void) { return (volatile uint16_t *)(area + 0x2000 + 2); }
static uint8_t *hdr(void) { return area + 0x3000; }
static volatile uint8_t *status_byte(void) { return area + 0x3100; }

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

/*
 * Posts one request in descriptor slot `slot` (0 or 1; three descriptors and a header/status
 * pair each): type 0 (read: the device writes `len` bytes at `iova`) or 1 (write: the device
 * reads them), at `sector`, and notifies the device.
 */
static void post(int slot, uint32_t type, uint64_t sector, uint64_t iova, uint32_t len)
{
	uint8_t *h = hdr() + slot * 0x200;
	memset(h, 0, 16);
	memcpy(h, &type, 4);
	memcpy(h + 8, &sector, 8);
	status_byte()[slot * 0x200] = 0xee;
	volatile struct desc *d = descs() + 3 * slot;
	uint16_t first = 3 * slot;
	d[0] = (struct desc){ BASE_IOVA + 0x3000 + slot * 0x200, 16, D_NEXT, (uint16_t)(first + 1) };
	d[1] = (struct desc){ iova, len, (uint16_t)(D_NEXT | (type == 0 ? D_WRITE : 0)), (uint16_t)(first + 2) };
	d[2] = (struct desc){ BASE_IOVA + 0x3100 + slot * 0x200, 1, D_WRITE, 0 };
	avail()[2 + avail_idx % QSIZE] = first;
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	avail()[1] = ++avail_idx;
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	uint16_t q = 0;
	bar_rw(1, notify_bar, notify + notify_off * notify_mult, &q, 2);
}

/* Waits until the device has returned `n` more chains; 0, or -1 after 10 s. */
static int reap(int n)
{
	double t0 = now();
	while ((uint16_t)(*used_idx() - used_seen) < n) {
		if (now() - t0 > 10)
			return -1;
		usleep(1000);
	}
	used_seen += n;
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	return 0;
}

/*
 * One request, as `post` in slot 0; returns the status byte the device wrote, or -1 if the
 * device did not return the chain within 10 s.
 */
static int request(uint32_t type, uint64_t sector, uint64_t iova, uint32_t len)
{
	post(0, type, sector, iova, len);
	if (reap(1))
		return -1;
	return *status_byte();
}

static int pattern_ok(const uint8_t *b, uint64_t disk_off, size_t len)
{
	for (size_t i = 0; i < len; i += 8) {
		uint64_t w;
		memcpy(&w, b + i, 8);
		if (w != (PATTERN ^ (disk_off + i)))
			return 0;
	}
	return 1;
}

static int dma_map(void *vaddr, uint64_t iova, uint64_t size, int container)
{
	struct vfio_iommu_type1_dma_map m = { .argsz = sizeof m,
		.flags = VFIO_DMA_MAP_FLAG_READ | VFIO_DMA_MAP_FLAG_WRITE,
		.vaddr = (uintptr_t)vaddr, .iova = iova, .size = size };
	return ioctl(container, VFIO_IOMMU_MAP_DMA, &m);
}

static int dma_unmap(uint64_t iova, uint64_t size, int container)
{
	struct vfio_iommu_type1_dma_unmap u = { .argsz = sizeof u, .iova = iova, .size = size };
	return ioctl(container, VFIO_IOMMU_UNMAP_DMA, &u);
}

/* Runs one request and checks its status against `want`; names it in the output. */
static void expect(const char *name, int got, int want)
{
	printf("VIORAW %s: status %d (want %d)\n", name, got, want);
	if (got != want)
		fail(name);
}

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: vioraw PCI-ADDRESS IOMMU-GROUP\n");
		return 2;
	}
	int container = open("/dev/vfio/vfio", O_RDWR);
	char path[64];
	snprintf(path, sizeof path, "/dev/vfio/%s", argv[2]);
	int group = open(path, O_RDWR);
	if (container < 0 || group < 0) {
		perror("open vfio");
		return 1;
	}
	if (ioctl(group, VFIO_GROUP_SET_CONTAINER, &container) || ioctl(container, VFIO_SET_IOMMU, VFIO_TYPE1v2_IOMMU)) {
		perror("vfio container");
		return 1;
	}
	dev = ioctl(group, VFIO_GROUP_GET_DEVICE_FD, argv[1]);
	if (dev < 0) {
		perror("device fd");
		return 1;
	}
	for (int i = 0; i < 6; i++) {
		struct vfio_region_info ri = { .argsz = sizeof ri, .index = i };
		if (ioctl(dev, VFIO_DEVICE_GET_REGION_INFO, &ri) == 0)
			bar_off[i] = ri.offset;
	}
	/* bus master + memory space */
	uint16_t cmd;
	cfg_rw(0, &cmd, 2, 4);
	cmd |= 0x6;
	cfg_rw(1, &cmd, 2, 4);
	/* virtio vendor capabilities: common and notify configuration */
	uint8_t ptr;
	cfg_rw(0, &ptr, 1, 0x34);
	common_bar = notify_bar = -1;
	while (ptr) {
		uint8_t cap[20];
		cfg_rw(0, cap, sizeof cap, ptr);
		if (cap[0] == 0x09) {
			uint32_t off;
			memcpy(&off, cap + 8, 4);
			if (cap[3] == 1) {
				common_bar = cap[4];
				common = off;
			} else if (cap[3] == 2) {
				uint32_t mult;
				memcpy(&mult, cap + 16, 4);
				notify_bar = cap[4];
				notify = off;
				notify_mult = mult;
			}
		}
		ptr = cap[1];
	}
	if (common_bar < 0 || notify_bar < 0) {
		printf("RESULT hostile FAIL no virtio common/notify capability\n");
		return 1;
	}
	/* the ring and buffers, mapped at BASE_IOVA through the guest's IOMMU */
	area = mmap(NULL, AREA, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	uint8_t *late = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
	memset(area, 0, AREA);
	if (dma_map(area, BASE_IOVA, AREA, container) || dma_map(late, LATE_IOVA, 4096, container)) {
		perror("VFIO_IOMMU_MAP_DMA");
		return 1;
	}
	/* reset, acknowledge, features: VERSION_1 and ACCESS_PLATFORM only */
	set_status(0);
	while (rd(20, 1) != 0)
		usleep(1000);
	set_status(1);
	set_status(1 | 2);
	wr(0, 1, 4);
	uint32_t hi = rd(4, 4);
	if (!(hi & 1) || !(hi & 2)) {
		printf("RESULT hostile FAIL device features %#x: VERSION_1 or ACCESS_PLATFORM missing\n", hi);
		return 1;
	}
	wr(8, 0, 4);
	wr(12, 0, 4);
	wr(8, 1, 4);
	wr(12, 3, 4);
	set_status(1 | 2 | 8);
	if (!(rd(20, 1) & 8)) {
		printf("RESULT hostile FAIL features not accepted\n");
		return 1;
	}
	wr(22, 0, 2);
	if (rd(24, 2) < QSIZE) {
		printf("RESULT hostile FAIL queue too small\n");
		return 1;
	}
	wr(24, QSIZE, 2);
	uint64_t rings[3] = { BASE_IOVA, BASE_IOVA + 0x1000, BASE_IOVA + 0x2000 };
	for (int i = 0; i < 3; i++) {
		wr(32 + 8 * i, (uint32_t)rings[i], 4);
		wr(36 + 8 * i, (uint32_t)(rings[i] >> 32), 4);
	}
	notify_off = rd(30, 2);
	avail()[0] = 1; /* no interrupts: this driver polls */
	wr(28, 1, 2);
	set_status(1 | 2 | 8 | 4);
	printf("VIORAW device %s up: queue of %d, polling\n", argv[1], QSIZE);

	uint8_t *data = area + DATA_OFF;
	uint64_t data_iova = BASE_IOVA + DATA_OFF;
	const size_t DLEN = AREA - DATA_OFF;

	/* 1. good read */
	memset(data, 0xa5, DLEN);
	expect("good read 16 KiB", request(0, 0, data_iova, 16384), 0);
	if (!pattern_ok(data, 0, 16384))
		fail("good read data");

	/* 2. read into an IOVA never mapped: fails, nothing written anywhere we can see */
	memset(data, 0xa5, DLEN);
	double t0 = now();
	expect("read into never-mapped iova", request(0, 8, NEVER_IOVA, 4096), 1);
	printf("VIORAW   (the device gave up after %.1f s)\n", now() - t0);

	/* 3. write from a never-mapped IOVA: fails, the disk keeps its contents */
	expect("write from never-mapped iova", request(1, 16, NEVER_IOVA, 4096), 1);

	/* 4. a buffer that starts mapped and runs past the mapping: fails whole, the mapped part
	 *    untouched */
	uint64_t edge = BASE_IOVA + AREA - 4096;
	memset(area + AREA - 4096, 0xa5, 4096);
	expect("read across the mapping's end", request(0, 24, edge, 8192), 1);
	for (int i = 0; i < 4096; i++)
		if (area[AREA - 4096 + i] != 0xa5) {
			fail("the mapped half of a refused read was written");
			break;
		}

	/* 5. map, use, unmap: after the unmap the device must not reach the page */
	memset(late, 0, 4096);
	expect("read into a mapped page", request(0, 32, LATE_IOVA, 4096), 0);
	if (!pattern_ok(late, 32 * 512, 4096))
		fail("mapped page data");
	if (dma_unmap(LATE_IOVA, 4096, container)) {
		perror("VFIO_IOMMU_UNMAP_DMA");
		fail("unmap");
	}
	memset(late, 0x5a, 4096);
	expect("read into the page after its unmap", request(0, 40, LATE_IOVA, 4096), 1);
	for (int i = 0; i < 4096; i++)
		if (late[i] != 0x5a) {
			fail("the device wrote a page after the guest unmapped it");
			break;
		}

	/* 6. the device still works, and nothing reached the disk from the refused write */
	memset(data, 0, DLEN);
	expect("good read after the refusals", request(0, 0, data_iova, (uint32_t)DLEN), 0);
	if (!pattern_ok(data, 0, DLEN))
		fail("good read data after the refusals (sector 16 was the refused write)");

	/* 7. races: a read of 256 KiB into a buffer, the buffer unmapped at once, and a second read
	 *    into the same IOVA after the unmap. The unmap returns when the back end acknowledged
	 *    the invalidation: the first read has ended by then (done whole, or failed), the second
	 *    must fail, and nothing may land in the buffer from then on. */
	int race_done = 0, race_failed = 0, written_after = 0, torn = 0;
	for (int r = 0; r < RACES; r++) {
		uint8_t *buf = mmap(NULL, RACE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
		memset(buf, 0, RACE_BYTES);
		if (dma_map(buf, RACE_IOVA, RACE_BYTES, container)) {
			fail("race: map");
			break;
		}
		uint64_t sector = 64 + 8 * r;
		/* A first read fills the back end's IOTLB (its misses are answered), so the racing
		 * read below runs at once on its kick. */
		if (request(0, sector, RACE_IOVA, RACE_BYTES) != 0 || !pattern_ok(buf, sector * 512, RACE_BYTES))
			fail("race: the warm-up read");
		memset(buf, 0, RACE_BYTES);
		post(0, 0, sector, RACE_IOVA, RACE_BYTES);
		if (dma_unmap(RACE_IOVA, RACE_BYTES, container))
			fail("race: unmap refused");
		/* Acknowledged. */
		uint8_t st_then = status_byte()[0];
		if (st_then == 0 && !pattern_ok(buf, sector * 512, RACE_BYTES))
			torn++;
		memset(buf, 0x77, RACE_BYTES);
		post(1, 0, sector, RACE_IOVA, RACE_BYTES);
		if (reap(2)) {
			fail("race: the device did not return its requests");
			break;
		}
		uint8_t st0 = status_byte()[0], st1 = status_byte()[0x200];
		if (st0 == 0)
			race_done++;
		else if (st0 == 1)
			race_failed++;
		else
			fail("race: the first read's status is neither OK nor IOERR");
		if (st1 != 1)
			fail("race: a read into the unmapped buffer did not fail");
		for (int k = 0; k < RACE_BYTES; k++)
			if (buf[k] != 0x77) {
				written_after++;
				break;
			}
		munmap(buf, RACE_BYTES);
	}
	printf("VIORAW race: %d reads ended before the unmap returned, %d failed; %d buffers written after it, "
	       "%d completed reads with torn data\n", race_done, race_failed, written_after, torn);
	printf("VIORAW race_failed=%d\n", race_failed + RACES);
	if (written_after)
		fail("race: the device wrote a buffer after its unmap returned");
	if (torn)
		fail("race: a read reported done before its data landed");
	printf("RESULT hostile %s failures=%d\n", failures ? "FAIL" : "PASS", failures);
	return failures != 0;
}
