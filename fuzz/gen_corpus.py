#!/usr/bin/env python3
"""Writes the seed corpus under fuzz/corpus/<target>/: a few valid inputs per target, in the
byte formats the targets' top comments describe (a handshake and a started ring for vhost-user,
the QEMU-like handshake and a DMA map for vfio-user, well-formed request chains for blk and the
balloon, a map/write/read/pin/unpin/invalidate/unmap sequence for the DMA space). libFuzzer
mutates from these; run again after changing a format. Usage: fuzz/gen_corpus.py"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(bytes(data))


# ---- ring targets: control byte, descriptor table + avail ring, then the data area ----
QUEUE = 16
AVAIL = 0x100
RING_BYTES = AVAIL + 4 + 2 * QUEUE + 2
DATA = 0x1000
NEXT, WRITE, INDIRECT = 1, 2, 4


def ring(control, chains, data):
    """chains: lists of (addr, len, flags); data: {guest address: bytes} in the data area."""
    descs, heads, i = [], [], 0
    for chain in chains:
        heads.append(i)
        for k, (addr, ln, fl) in enumerate(chain):
            nxt = i + 1 if k + 1 < len(chain) else 0
            if k + 1 < len(chain):
                fl |= NEXT
            descs.append(struct.pack("<QIHH", addr, ln, fl, nxt))
            i += 1
    table = b"".join(descs).ljust(AVAIL, b"\0")
    avail = struct.pack("<HH", 0, len(heads)) + b"".join(struct.pack("<H", h) for h in heads)
    r = (table + avail).ljust(RING_BYTES, b"\0")
    area = bytearray()
    for addr, b in sorted(data.items()):
        off = addr - DATA
        area = area.ljust(off, b"\0")
        area[off:off + len(b)] = b
    return bytes([control]) + r + bytes(area)


def blk_header(kind, sector):
    return struct.pack("<IIQ", kind, 0, sector)


HDR, BUF, STATUS = 0x1000, 0x2000, 0x4000
put("blk_chain", "read", ring(0, [[(HDR, 16, 0), (BUF, 1024, WRITE), (STATUS, 1, WRITE)]],
                               {HDR: blk_header(0, 2)}))
put("blk_chain", "write", ring(0, [[(HDR, 16, 0), (BUF, 512, 0), (BUF + 512, 512, 0), (STATUS, 1, WRITE)]],
                                {HDR: blk_header(1, 4), BUF: bytes(range(256)) * 4}))
put("blk_chain", "flush_and_id", ring(2, [[(HDR, 16, 0), (STATUS, 1, WRITE)],
                                          [(HDR + 16, 16, 0), (BUF, 20, WRITE), (STATUS + 1, 1, WRITE)]],
                                       {HDR: blk_header(4, 0), HDR + 16: blk_header(8, 0)}))
# An indirect table at 0x3000 holding the whole request.
ind = b"".join(struct.pack("<QIHH", a, l, f, n) for a, l, f, n in
               [(HDR, 16, NEXT, 1), (BUF, 512, NEXT | WRITE, 2), (STATUS, 1, WRITE, 0)])
put("blk_chain", "indirect", ring(0, [[(0x3000, len(ind), INDIRECT)]],
                                   {HDR: blk_header(0, 0), 0x3000: ind}))
# corpus/blk_chain/status_past_top is not written here: it is the fuzzer's own find (a status
# descriptor whose end wraps), kept as a seed beside its regression test in tests/blk.rs.
put("blk_chain", "read_only_write", ring(1, [[(HDR, 16, 0), (BUF, 512, 0), (STATUS, 1, WRITE)]],
                                          {HDR: blk_header(1, 0)}))

# Balloon: control % 3 is the queue (0 inflate, 1 deflate, 2 reporting); pfns are 4 KiB guest
# pages (the memory has 16).
pfns = struct.pack("<4I", 2, 3, 4, 15)
put("balloon", "inflate", ring(0, [[(0x1000, 16, 0)]], {0x1000: pfns}))
put("balloon", "deflate", ring(1, [[(0x1000, 16, 0)]], {0x1000: pfns}))
put("balloon", "inflate_two_chains", ring(8, [[(0x1000, 8, 0)], [(0x1008, 8, 0)]], {0x1000: pfns}))
put("balloon", "report", ring(2, [[(0x2000, 0x2000, WRITE), (0x6000, 0x1000, WRITE)]], {}))
put("balloon", "report_unaligned", ring(2, [[(0x2100, 0x100, WRITE)]], {}))

# ---- vhost_user: request (0x80|raw), how, len, payload ----
GET_FEATURES, SET_FEATURES, SET_MEM_TABLE = 1, 2, 5
SET_VRING_NUM, SET_VRING_ADDR, SET_VRING_BASE, GET_VRING_BASE = 8, 9, 10, 11
SET_VRING_KICK, SET_VRING_CALL = 12, 13
GET_PROTOCOL_FEATURES, SET_PROTOCOL_FEATURES, SET_VRING_ENABLE = 15, 16, 18
IOTLB_MSG, GET_CONFIG, ADD_MEM_REG, REM_MEM_REG = 22, 24, 37, 38
USER, GUEST = 0x7F0000000000, 64 << 10


def msg(req, payload=b"", reply=True, fds=0, eventfd=False):
    how = (1 if reply else 0) | (fds << 1) | (8 if eventfd else 0)
    return bytes([0x80 | req, how, len(payload)]) + payload


def u64(v):
    return struct.pack("<Q", v)


def region(gpa=0, size=GUEST, user=USER, off=0):
    return struct.pack("<4Q", gpa, size, user, off)


def state(index, num):
    return struct.pack("<II", index, num)


FEATURES = (1 << 32) | (1 << 9) | (1 << 6) | (1 << 2) | (1 << 28) | (1 << 29) | (1 << 30)
PROTOCOL = (1 << 0) | (1 << 1) | (1 << 3) | (1 << 9) | (1 << 13) | (1 << 15) | (1 << 16)
handshake = (msg(GET_FEATURES) + msg(SET_FEATURES, u64(FEATURES)) + msg(GET_PROTOCOL_FEATURES)
             + msg(SET_PROTOCOL_FEATURES, u64(PROTOCOL)))
table = msg(SET_MEM_TABLE, struct.pack("<II", 1, 0) + region(), fds=1)
vring = (msg(SET_VRING_NUM, state(0, 16))
         + msg(SET_VRING_ADDR, struct.pack("<II4Q", 0, 0, USER, USER + 0x200, USER + 0x100, 0))
         + msg(SET_VRING_BASE, state(0, 0)) + msg(SET_VRING_CALL, u64(0), fds=1, eventfd=True)
         + msg(SET_VRING_KICK, u64(0), fds=1, eventfd=True) + msg(SET_VRING_ENABLE, state(0, 1)))
put("vhost_user", "handshake", handshake)
put("vhost_user", "table", handshake + table + msg(GET_CONFIG, struct.pack("<III", 0, 60, 0) + bytes(60)))
put("vhost_user", "ring", handshake + table + vring + msg(GET_VRING_BASE, state(0, 0)))
put("vhost_user", "add_remove", handshake + msg(ADD_MEM_REG, u64(0) + region(), fds=1)
    + msg(ADD_MEM_REG, u64(0) + region(gpa=GUEST, user=USER + GUEST), fds=1)
    + msg(REM_MEM_REG, u64(0) + region()))
iotlb = struct.pack("<QQQBBxxxxxx", 0x10000, 0x1000, USER, 3, 2)  # update, rw
put("vhost_user", "iotlb", msg(GET_FEATURES) + msg(SET_FEATURES, u64(FEATURES | 1 << 33))
    + msg(GET_PROTOCOL_FEATURES) + msg(SET_PROTOCOL_FEATURES, u64(PROTOCOL | 1 << 5 | 1 << 17))
    + table + msg(IOTLB_MSG, iotlb))

# ---- vfio_user: command, how, len (u8), body ----
VERSION, DMA_MAP, DMA_UNMAP, GET_INFO, GET_REGION_INFO, GET_IRQ_INFO = 1, 2, 3, 4, 5, 7
SET_IRQS, REGION_READ, REGION_WRITE, DEVICE_RESET, DIRTY_PAGES = 8, 9, 10, 13, 14


def vmsg(cmd, body=b"", fds=0):
    return bytes([cmd, fds]) + bytes([len(body)]) + body


ver = struct.pack("<HH", 0, 0) + b'{"capabilities":{"max_msg_fds":16,"pgsizes":4096}}\0'
vhello = vmsg(VERSION, ver) + vmsg(GET_INFO, struct.pack("<IIII", 16, 0, 0, 0))
dma_map = vmsg(DMA_MAP, struct.pack("<IIQQQ", 32, 3, 0, 0x100000, GUEST), fds=1)
dma_unmap = vmsg(DMA_UNMAP, struct.pack("<IIQQ", 24, 0, 0x100000, GUEST))


def access(region_index, offset, data=b"", count=None):
    return struct.pack("<QII", offset, region_index, len(data) if count is None else count) + data


put("vfio_user", "hello", vhello)
put("vfio_user", "map_unmap", vhello + dma_map + dma_unmap)
put("vfio_user", "regions", vhello + vmsg(GET_REGION_INFO, struct.pack("<IIII", 32, 0, 0, 0))
    + vmsg(GET_REGION_INFO, struct.pack("<IIII", 32, 0, 7, 0))
    + vmsg(GET_IRQ_INFO, struct.pack("<IIII", 16, 0, 1, 0))
    + vmsg(REGION_READ, access(0, 0, count=4)) + vmsg(REGION_READ, access(7, 0, count=64)))
put("vfio_user", "doorbell", vhello + dma_map
    + vmsg(REGION_WRITE, access(0, 0x08, u64(0x100000)))
    + vmsg(REGION_WRITE, access(0, 0x10, struct.pack("<I", 1)))
    + vmsg(REGION_WRITE, access(0, 0x18, struct.pack("<I", 1)))
    + vmsg(REGION_READ, access(0, 0x1c, count=4)) + dma_unmap)
put("vfio_user", "reset_dirty", vhello + dma_map + vmsg(DEVICE_RESET)
    + vmsg(DIRTY_PAGES, struct.pack("<II", 8, 1)) + dma_unmap)

# ---- dma_ops: a first byte (page table from the start or not), then per op a byte (% 16)
# choosing it and its arguments, as fuzz_targets/dma_ops.rs decodes them ----
def op_map(page, pages, prot, mem, off):
    return bytes([0, page, pages, prot, mem, off])


def op_unmap(page, pages):
    return bytes([2, page, pages])


def op_inval(page, pages):
    return bytes([4, page, pages])


def op_update(page, pages, mem, off):
    return bytes([5, page, pages - 1, mem, off])


def op_translate(addr, ln, write):
    return bytes([6]) + struct.pack("<HHB", addr // 4, ln, write)


def op_read(addr, ln):
    return bytes([7]) + struct.pack("<HH", addr // 4, ln)


def op_write(addr, ln, byte):
    return bytes([8]) + struct.pack("<HHB", addr // 4, ln, byte)


def op_pin(prot, pages):
    # a list of pages inside the space: the list kind byte 5, its length, then (0, page) each
    return bytes([11, 5, len(pages)] + [x for p in pages for x in (0, p)] + [prot])


def op_pin_edge(prot):
    # u64::MAX / 4096 + 1: one page past what an IOVA can name
    return bytes([11, 5, 1, 248, prot])


UNPIN, UNMAP_ALL = bytes([14]), bytes([3])
TRACK_ON, TRACK_OFF = bytes([9, 1]), bytes([9, 0])
GET_DIRTY = bytes([10, 0])
EAGER_ON, EAGER_OFF = bytes([15, 1]), bytes([15, 0])
put("dma_ops", "map_rw", bytes([0]) + op_map(0, 4, 3, 0, 0) + op_write(100, 5000, 7)
    + op_read(0, 8000) + op_translate(4096, 100, 1) + op_unmap(0, 4))
put("dma_ops", "pins", bytes([1]) + op_map(8, 3, 3, 1, 2) + op_map(11, 2, 1, 1, 2)
    + op_pin(3, [8, 9]) + op_pin(1, [11, 12, 8]) + op_unmap(8, 3) + UNPIN + UNPIN
    + op_unmap(8, 5) + op_pin_edge(3))
put("dma_ops", "invalidate", bytes([0]) + op_map(20, 2, 3, 2, 0) + op_inval(20, 2)
    + op_read(20 * 4096, 10) + op_translate(20 * 4096, 10, 0) + op_update(20, 2, 1, 3)
    + op_read(20 * 4096, 10) + op_unmap(20, 2))
put("dma_ops", "edges", bytes([1]) + op_map(38, 4, 3, 0, 0) + op_map(44, 4, 3, 0, 0)
    + op_map(60, 4, 2, 0, 12) + op_write(60 * 4096, 4096, 1) + op_pin(2, [63]) + op_inval(60, 4)
    + UNPIN + op_inval(60, 4) + UNMAP_ALL)
put("dma_ops", "dirty", bytes([0]) + TRACK_ON + op_map(4, 4, 3, 0, 4)
    + op_write(5 * 4096 + 10, 100, 9) + GET_DIRTY + op_pin(3, [6]) + GET_DIRTY + UNPIN
    + op_unmap(4, 4) + GET_DIRTY + TRACK_OFF + GET_DIRTY)
put("dma_ops", "eager", bytes([1]) + op_map(0, 4, 3, 0, 0) + EAGER_ON + TRACK_ON
    + op_write(4096, 10, 3) + GET_DIRTY + EAGER_OFF + GET_DIRTY + op_unmap(0, 4))
