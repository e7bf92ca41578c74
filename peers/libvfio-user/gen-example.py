#!/usr/bin/env python3
"""Writes example.rec: a synthetic DMA_MAP/DMA_UNMAP stream for replay-libvfio-user.

2000 single-page (4 KiB) maps at distinct IOVAs, each of a random page of a 1 GiB
guest-RAM fd, with at most 32 live at once (the oldest is unmapped when a 33rd
arrives, like a streaming-DMA driver under a strict IOMMU), 4 unmaps of ranges
never mapped, 2 unmaps that a kernel type1 IOMMU would accept but that are not
one whole region (one spanning two adjacent regions, one half a region), and an
unmap-all with the last 32 still mapped. Deterministic (fixed seed).

usage: gen-example.py [OUT]   (default: example.rec next to this script)
"""
import os
import random
import sys

PAGE = 0x1000
MAPS = 2000
WINDOW = 32
IOVA_BASE = 0xFEE00000 - MAPS * PAGE   # below the x86 MSI window, as a 32-bit IOVA allocator would
NEVER_BASE = 0x7F0000000000             # nothing is ever mapped up here
RAM = 1 << 30

rng = random.Random(14)
out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "example.rec")
lines = [
    "# synthetic stream, written by gen-example.py (seed 14)",
    f"# {MAPS} maps of 4 KiB at distinct IOVAs, <= {WINDOW} live, oldest unmapped first;",
    "# 4 unmaps of never-mapped ranges, 2 unmaps that are not one whole region, then A",
]
live = []          # IOVAs, oldest first
never = 0
for i in range(MAPS):
    iova = IOVA_BASE + i * PAGE
    offset = rng.randrange(RAM // PAGE) * PAGE
    prot = rng.choice(["r", "w", "rw"])
    lines.append(f"M {iova:#x} {PAGE:#x} {offset:#x} {prot}")
    live.append(iova)
    if len(live) > WINDOW:
        old = live.pop(0)
        lines.append(f"U {old:#x} {PAGE:#x}")
    if i % 500 == 250:
        lines.append("# never mapped")
        lines.append(f"U {NEVER_BASE + never * 0x100000:#x} {PAGE:#x}")
        never += 1
    if i == 1000:
        # the two newest regions are adjacent: one unmap covering both of them
        lines.append("# spans two whole regions (type1 would unmap both)")
        lines.append(f"U {live[-2]:#x} {2 * PAGE:#x}")
    if i == 1500:
        lines.append("# the first half of a region")
        lines.append(f"U {live[-1]:#x} {PAGE // 2:#x}")
lines.append(f"# {len(live)} still mapped")
lines.append("A")
with open(out, "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"wrote {out}: {sum(1 for l in lines if not l.startswith('#'))} messages", file=sys.stderr)
