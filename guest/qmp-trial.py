#!/usr/bin/env python3
"""The real-guest QMP trial (guest/trial.sh qmp): memvisor driven only through QMP.

The model: `memvisor serve --control SOCK --metrics ADDR` runs with no device. This script is the
operator. It talks to memvisor's control socket with python's own QMP client (`qemu.qmp`, from
pip, not memvisor's `ctl`), starts QEMU (the command after `--`, its console written to
--console) and reads the guest's console, where guest/progs/qmpio.c prints its verified-I/O
verdict, its read and write rates each second and the disk's size as the guest kernel sees it.
It scrapes the Prometheus endpoint and parses it with `prometheus_client`'s parser.

Steps, each judged PASS or FAIL on one line ("STEP n PASS|FAIL ..."):
  1. blk-add a disk while the server runs (DEVICE_ADDED; its socket appears).
  2. QEMU connects (FRONTEND_CONNECTED) and the guest's verified I/O passes.
  3. blk-resize grows the disk by 32 MiB: DEVICE_RESIZED says told-frontend, and the guest's
     /sys/block/vda/size shows the new size (within RESIZE_WAIT s) without a reboot.
  4. blk-set-throttle bps = a quarter of the unthrottled rate measured first: the guest's rate
     (reads + writes, over THROTTLE_SECS intervals after the first two) within +-10% of the
     limit; lifted again (all zero), back above 1.5 times the limit (the unthrottled rate
     itself varies by 2x between runs on a shared machine; a throttle left in force gives 1.0).
  5. QEMU quits (through QEMU's own QMP monitor), then blk-del (no force needed).
  6. Events DEVICE_ADDED, FRONTEND_CONNECTED, DEVICE_RESIZED, FRONTEND_DISCONNECTED,
     DEVICE_DELETED arrived for the device, in that order.
  7. The metrics, scraped at the guest's rate lines during steps 2-4: request counters and the
     latency histograms' counts of reads and writes grow in every window, and the bytes counted
     in each measured window match the guest's own count within 10%.
Then `quit` must stop the server. Exit 0 only if every step passed; the verdict line is
"RESULT qmp PASS|FAIL <failed steps>".
"""
import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from qemu.qmp import QMPClient

RATE = re.compile(r"QMPIO RATE t=([\d.]+) secs=([\d.]+) rd=(\d+) wr=(\d+) rdtot=(\d+) wrtot=(\d+) sectors=(-?\d+)")
WANT_EVENTS = ["DEVICE_ADDED", "FRONTEND_CONNECTED", "DEVICE_RESIZED", "FRONTEND_DISCONNECTED", "DEVICE_DELETED"]


class Console:
    """The guest's console file, read as it grows; `rates` holds every QMPIO RATE line parsed."""

    def __init__(self, path):
        self.path, self.pos, self.lines, self.rates = path, 0, [], []

    def poll(self):
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return
        cut = data.rfind(b"\n") + 1
        self.pos += cut
        for raw in data[:cut].decode(errors="replace").splitlines():
            line = raw.strip("\r")
            self.lines.append(line)
            m = RATE.search(line)
            if m:
                t, secs, rd, wr, rdtot, wrtot, sectors = m.groups()
                self.rates.append({"t": float(t), "secs": float(secs), "bytes": int(rd) + int(wr),
                                   "total": int(rdtot) + int(wrtot), "sectors": int(sectors)})

    async def wait_for(self, pattern, timeout, alive):
        """The first console line (old or new) matching pattern, or None after timeout."""
        end = time.monotonic() + timeout
        rx, i = re.compile(pattern), 0
        while True:
            self.poll()
            for line in self.lines[i:]:
                if rx.search(line):
                    return line
            i = len(self.lines)
            if time.monotonic() > end or not alive():
                return None
            await asyncio.sleep(0.05)

    async def next_rates(self, n, timeout, alive):
        """Waits for n RATE lines after those already seen; returns them (fewer on timeout)."""
        self.poll()
        start, end = len(self.rates), time.monotonic() + timeout
        while len(self.rates) < start + n and time.monotonic() < end and alive():
            await asyncio.sleep(0.05)
            self.poll()
        return self.rates[start:start + n]


def scrape(url, device):
    """One scrape, parsed by prometheus_client: {(sample, op): value} summed over queues."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    got = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.labels.get("device") != device or "op" not in s.labels or s.name.endswith("_bucket"):
                continue
            key = (s.name, s.labels["op"])
            got[key] = got.get(key, 0) + s.value
    return got


def find_key(v, key):
    """The first value under key anywhere in a JSON answer (None if none)."""
    if isinstance(v, dict):
        if key in v:
            return v[key]
        v = list(v.values())
    if isinstance(v, list):
        for x in v:
            got = find_key(x, key)
            if got is not None:
                return got
    return None


def rate_of(lines):
    secs = sum(r["secs"] for r in lines)
    return sum(r["bytes"] for r in lines) / secs if secs else 0.0


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--control", required=True)
    ap.add_argument("--metrics", required=True, help="http://127.0.0.1:PORT/metrics")
    ap.add_argument("--id", default="disk0")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--disk", required=True)
    ap.add_argument("--console", required=True)
    ap.add_argument("--qemu-qmp", required=True)
    ap.add_argument("--throttle-secs", type=int, default=8)
    ap.add_argument("--resize-wait", type=float, default=15)
    ap.add_argument("qemu", nargs="+")
    a = ap.parse_args()
    verdict, events, scrapes = {}, [], []
    t_start = time.monotonic()

    # Device events name the device "id", the frontend events "device".
    ours = lambda d: d.get("id", d.get("device")) == a.id

    def step(n, ok, what):
        verdict[n] = verdict.get(n, True) and ok
        print(f"STEP {n} {'PASS' if ok else 'FAIL'} {what}", flush=True)

    mv = QMPClient("memvisor")
    await mv.connect(a.control)
    v = mv.greeting.QMP.version
    print(f"  greeting: QMP version {v['qemu']}, package {v.get('package')!r}, capabilities "
          f"{list(mv.greeting.QMP.capabilities)} (negotiated by qemu.qmp)")

    async def collect():
        async for ev in mv.events:
            events.append((time.monotonic() - t_start, ev["event"], dict(ev.get("data", {}))))

    collector = asyncio.create_task(collect())

    async def event(name, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for _, n, d in events:
                if n == name and ours(d):
                    return d
            await asyncio.sleep(0.05)
        return None

    def metrics(label):
        try:
            m = scrape(a.metrics, a.id)
        except Exception as e:  # a broken endpoint or text the parser refuses: step 7 fails
            print(f"  metrics scrape '{label}' failed: {e!r}")
            m = None
        # The guest's cumulative bytes at its latest rate line: what the scrape is compared with.
        total = console.rates[-1]["total"] if console.rates else 0
        scrapes.append((label, m, total))

    console = Console(a.console)
    qemu = None
    alive = lambda: qemu is not None and qemu.poll() is None
    try:
        # 1. blk-add while the server runs.
        r = await mv.execute("blk-add", {"id": a.id, "socket": a.socket, "disk": a.disk})
        d = await event("DEVICE_ADDED", 5)
        step(1, r == {} and d is not None and os.path.exists(a.socket),
             f"blk-add returned {r}; DEVICE_ADDED {d}; socket {'present' if os.path.exists(a.socket) else 'absent'}")
        if not verdict[1]:
            return verdict, events
        # 2. QEMU connects and the guest's verified I/O passes.
        qemu = subprocess.Popen(a.qemu, stdout=open(a.console, "wb"), stderr=subprocess.STDOUT)
        d = await event("FRONTEND_CONNECTED", 60)
        line = await console.wait_for(r"QMPIO VERIFY (PASS|FAIL)", 90, alive)
        step(2, d is not None and line is not None and "VERIFY PASS" in line,
             f"FRONTEND_CONNECTED {d}; guest: {line or 'no verdict (see the console)'}")
        if not verdict[2]:
            return verdict, events
        await console.next_rates(1, 10, alive)
        metrics("after verify")
        # The unthrottled rate, measured before anything changes.
        base = await console.next_rates(4, 15, alive)
        metrics("unthrottled")
        free = rate_of(base)
        # 3. blk-resize: the guest must see the new size without a reboot.
        old = console.rates[-1]["sectors"] if console.rates else -1
        new_bytes = os.path.getsize(a.disk) + (32 << 20)
        r = await mv.execute("blk-resize", {"id": a.id, "size": new_bytes})
        d = await event("DEVICE_RESIZED", 5)
        told = d is not None and d.get("size") == new_bytes and d.get("told-frontend") is True
        t0 = time.monotonic()
        line = await console.wait_for(rf"QMPIO SIZE sectors={new_bytes // 512} ", a.resize_wait, alive)
        seen = console.rates[-1]["sectors"] if console.rates else -1
        last = await console.wait_for(r"QMPIO LASTBLOCK", 5, alive) if line else None
        step(3, r == {} and told and line is not None and last is not None and " ok " in last + " ",
             f"blk-resize {old * 512} -> {new_bytes} bytes returned {r}; DEVICE_RESIZED {d}; guest size "
             + (f"{new_bytes // 512} sectors after {time.monotonic() - t0:.1f} s, {last}" if line
                else f"still {seen} sectors after {a.resize_wait:.0f} s (want {new_bytes // 512})"))
        # 4. blk-set-throttle well below the unthrottled rate, then lifted.
        limit = int(free / 4)
        r = await mv.execute("blk-set-throttle", {"id": a.id, "bps": limit})
        st = await mv.execute("query-stats", {"device": a.id})
        shown = find_key(st, "throttle")
        print(f"  blk-set-throttle bps={limit} returned {r}; query-stats throttle: {shown}")
        await console.next_rates(2, 10, alive)   # the intervals the change fell in, and one more
        metrics("throttle set")
        held = await console.next_rates(a.throttle_secs, a.throttle_secs * 3 + 10, alive)
        metrics("throttled")
        capped = rate_of(held)
        r2 = await mv.execute("blk-set-throttle", {"id": a.id, "bps": 0})
        await console.next_rates(1, 10, alive)
        metrics("throttle lifted")
        back = await console.next_rates(4, 15, alive)
        metrics("lifted")
        lifted = rate_of(back)
        per = " ".join("%.2f" % (x["bytes"] / x["secs"] / limit) for x in held) if limit else "-"
        print("  throttle (bytes/s, guest O_DIRECT 64 KiB reads + writes, one at a time):")
        print(f"    {'phase':<12} {'asked':>12} {'measured':>12} {'ratio':>7} intervals")
        print(f"    {'unthrottled':<12} {'-':>12} {free:>12.0f} {'-':>7} {len(base)}")
        print(f"    {'throttled':<12} {limit:>12} {capped:>12.0f} {capped / limit if limit else 0:>7.3f} {len(held)}"
              f"  per interval: {per}")
        print(f"    {'lifted':<12} {'-':>12} {lifted:>12.0f} {lifted / limit if limit else 0:>7.3f} {len(back)}")
        ok4 = (r == {} and r2 == {} and limit > 0 and len(held) == a.throttle_secs
               and abs(capped / limit - 1) <= 0.10 and len(back) == 4 and lifted >= 1.5 * limit)
        step(4, ok4, f"asked {limit} B/s, measured {capped:.0f} B/s (ratio {capped / limit if limit else 0:.3f}, want 0.90-1.10); "
             f"lifted {lifted:.0f} B/s (want >= {1.5 * limit:.0f}); unthrottled {free:.0f} B/s"
             + ("" if len(held) == a.throttle_secs and len(back) == 4 else
                f"; the guest gave {len(held)} of {a.throttle_secs} throttled and {len(back)} of 4 lifted"
                " intervals: its I/O stalled (a request never answered?)"))
        # 5. QEMU quits (its own QMP monitor), then blk-del.
        vm = QMPClient("qemu")
        await vm.connect(a.qemu_qmp)
        try:
            await vm.execute("quit")
        except Exception as e:  # QEMU may close the monitor as it answers
            print(f"  QEMU quit: {e!r}")
        try:
            await vm.disconnect()
        except Exception:
            pass
        for _ in range(200):
            if qemu.poll() is not None:
                break
            await asyncio.sleep(0.05)
        d = await event("FRONTEND_DISCONNECTED", 10)
        r = await mv.execute("blk-del", {"id": a.id})
        dd = await event("DEVICE_DELETED", 5)
        listed = await mv.execute("query-devices")
        step(5, qemu.poll() is not None and d is not None and r == {} and dd is not None and a.id not in str(listed),
             f"QEMU exited ({qemu.poll()}); FRONTEND_DISCONNECTED {d}; blk-del returned {r}; DEVICE_DELETED {dd}; "
             f"query-devices now {listed}")
    finally:
        if qemu is not None and qemu.poll() is None:
            qemu.terminate()
            qemu.wait()
        console.poll()
        for line in console.lines:
            if line.startswith(("QMPIO SIZE", "QMPIO LASTBLOCK", "QMPIO VERIFY", "RESULT")):
                print(f"  guest: {line}")
        # 6. The events, in order.
        mine = [n for _, n, dd in events if ours(dd) and n in WANT_EVENTS]
        for t, n, dd in events:
            print(f"  event +{t:5.1f} s {n} {dd}")
        it = iter(mine)
        step(6, all(w in it for w in WANT_EVENTS), f"want {' '.join(WANT_EVENTS)} in order; got {' '.join(mine)}")
        # 7. The metrics moved as the guest's I/O did.
        ok7 = len(scrapes) >= 6 and all(m for _, m, _ in scrapes)
        print("  metrics (scraped at the guest's rate lines; deltas since the scrape before):")
        print(f"    {'window':<16} {'rd req':>7} {'wr req':>7} {'rd hist':>7} {'wr hist':>7} {'bytes':>11} {'guest bytes':>11} {'ratio':>6}")
        for (l0, m0, g0), (l1, m1, g1) in zip(scrapes, scrapes[1:]):
            if not (m0 and m1):
                continue
            dv = lambda name, op: m1.get((name, op), 0) - m0.get((name, op), 0)
            req = [dv("memvisor_blk_requests_total", op) for op in ("read", "write")]
            hist = [dv("memvisor_blk_request_duration_seconds_count", op) for op in ("read", "write")]
            byt = dv("memvisor_blk_bytes_total", "read") + dv("memvisor_blk_bytes_total", "write")
            ratio = byt / (g1 - g0) if g1 > g0 else 0
            moved = min(req + hist) > 0 and abs(ratio - 1) <= 0.10
            ok7 = ok7 and moved
            print(f"    {l1:<16} {req[0]:>7.0f} {req[1]:>7.0f} {hist[0]:>7.0f} {hist[1]:>7.0f} {byt:>11.0f} {g1 - g0:>11} {ratio:>6.3f}"
                  f"{'' if moved else '  <- did not move with the guest'}")
        step(7, ok7, f"{len(scrapes)} scrapes; counters and histogram counts move, bytes within 10% of the guest's")
        # The server stops on `quit`.
        try:
            r = await mv.execute("quit")
            print(f"  quit returned {r}")
        except Exception as e:
            print(f"  quit: {e!r}")
            verdict["quit"] = False
        collector.cancel()
        try:
            await mv.disconnect()
        except Exception:
            pass
    return verdict, events


verdict, _ = asyncio.run(main())
failed = [str(k) for k in sorted(verdict, key=str) if not verdict[k]]
missing = [str(n) for n in range(1, 8) if n not in verdict]
if failed or missing:
    print(f"RESULT qmp FAIL steps failed: {' '.join(failed) or '-'}; not reached: {' '.join(missing) or '-'}")
    sys.exit(1)
print("RESULT qmp PASS")
