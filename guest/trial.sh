#!/bin/bash
# Real-guest trials: a Debian kernel under QEMU 11.1 (TCG) with a device served by memvisor's
# vhost-user back end. Needs root (mount namespaces, chroot, mmdebstrap); builds the QEMU root
# and the guest on first use under target/guest/.
#
# usage: guest/trial.sh blk [--negative] [--peer] [--queues=N] [--after-fuzz] [--iommu=M] | balloon [--negative]
#                      | blk --queue-size=N [--queue-cap] [--peer] | qtest [--peer | --negative] [--queue-size=N]
#                      | balloon --stats [--negative]
#                      | blk --disk-fault [--negative] | blk --memlock [--negative] | balloon --memlock
#                      | mig [--negative | --no-summary] [--iommu=M] | hostile [--negative]
#                      | vfio-user [--negative] [--unmap-busy] [--private] [--long-term] [--after-fuzz]
#                                  [--client-dies [--negative]]
#                      | blkio [--negative]
#                      | blk --frontend-dies [--negative] | mig --frontend-dies [--negative]
#                      | blk --crash [--negative | --reorder]
#                      | rng [--negative]
#                      | blk --loop[=4096] [--negative]
#                      | locks [--negative]
#                      | qmp [--negative-throttle | --negative-resize]
#                      | blk --fixed [--negative] | balloon --fixed [--negative]
#   blk         the guest writes a random pattern, drops caches, reads it back (sequential
#               O_DIRECT, through the page cache, random 4 KiB O_DIRECT) and compares; the host
#               then checks the image holds the pattern.
#   --negative  negative control: the host changes the image while the guest waits between
#               writing and reading; the trial must then FAIL (exit 0 only if it does).
#   --peer      the same trial against qemu-storage-daemon's vhost-user-blk export.
#   --queues=N  N queues and N vCPUs (QEMU num-queues=N, -smp N): the guest submits on the
#               queue of its CPU, and rings past the first must be served by worker threads.
#   --iommu=strict|lazy  the device behind QEMU's intel-iommu (device-iotlb), the guest with
#               intel_iommu=on and iommu.strict=1 or 0: every address goes through the IOTLB.
#   --after-fuzz first attack the back end for 15 s with memvisor's hostile frontend
#               (memvisor-testkit vhost-user-fuzz); the same back end must then serve QEMU and pass.
#   balloon     one `memvisor serve` process with a blk and a balloon device; the guest fills and
#               frees 512 MiB (free page reporting), then follows the host's balloon target up and
#               down, with block I/O in the background; the host samples the guest memory's
#               allocated bytes (its memfd) twice a second and checks at least 80% of what was
#               freed went back, and the guest checks data it kept is intact.
#   balloon --negative: the back end runs with free page reporting off (target only); the memory
#               check must then FAIL.
#   mig         the guest's device writes memory the CPU never touches (guest/progs/migwrite.c)
#               while QEMU migrates to a file; a second QEMU loads it, reconnects to the same back
#               end and the guest checks every chunk the device wrote, then keeps going.
#   mig --negative: the back end keeps its dirty log empty (MEMVISOR_TEST_NO_DIRTY_LOG; needs
#               MEMVISOR= a test-hooks build); the guest must then find stale chunks on the
#               destination. Exit 3 if the destination gives no
#               verdict at all (inconclusive; CI runs it once more).
#   mig --no-summary: negative control of the dirty bitmaps' summary levels: marks set no
#               summary bit (MEMVISOR_TEST_NO_DIRTY_SUMMARY; needs MEMVISOR= a test-hooks build),
#               so the O(dirty) drains find nothing; the destination must then find stale chunks,
#               judged as mig --negative.
#   mig --iommu=strict|lazy: the same behind the vIOMMU; the back end logs the guest pages behind
#               the IOVAs it wrote.
#   hostile     two vIOMMU blk devices in one back end: the kernel runs the blk trial on one, a
#               user-space driver in the guest (VFIO) runs the other and sends requests naming
#               IOVAs it never mapped or has unmapped; those fail alone, nothing else does.
#               Then races: 8 reads of 256 KiB whose buffer the guest unmaps at once, each
#               followed by a read to the same IOVA; once the unmap returned (the invalidation
#               acknowledged) nothing may land in the buffer, and the second read must fail.
#   hostile --negative: the back end acknowledges the invalidations of the race's buffer and
#               ignores them (needs MEMVISOR= a binary built with --features test-hooks); the
#               race must catch it.
#   blkio       no guest: libblkio (QEMU's blkio driver, from qemu-io) as the client of memvisor's
#               vhost-user-blk back end, its image opened O_DIRECT (--direct), both sides
#               bypassing the page cache: 4 MiB and 8 MiB single requests, sector-aligned and
#               byte-unaligned writes, 16 in flight; each read back verified, and the host checks
#               the image against the same writes replayed.
#   blkio --negative: the back end answers writes OK and drops them (needs MEMVISOR= a binary
#               built with --features test-hooks); the trial must then FAIL.
#   vfio-user   memvisor's vfio-user server with its mvdma DMA device under QEMU's vfio-user-pci
#               behind intel-iommu (caching mode); the guest's own VFIO type1 maps buffers (each
#               map a DMA_MAP) and guest/progs/mvdma.c checks every byte of thousands of DMA
#               requests, with maps churning beside them, thousands of page maps, and DMA to
#               unmapped IOVAs (must fail, write nothing), then races: 32 unmaps per mode of a
#               buffer the device is writing, each followed by a map of a new buffer at the same
#               IOVA (nothing may land in the old buffer after its unmap returned; the new one
#               must get the data; QEMU must log no refused map or unmap). The server must end
#               with nothing pinned or locked. Env: MVDMA_REQ (tables, 2000), MVDMA_SECS (45),
#               MVDMA_SCALE (4096).
#   vfio-user --negative: the server forgets unmaps (MEMVISOR_TEST_IGNORE_UNMAP; needs
#               MEMVISOR= a test-hooks build); the guest must catch the device writing a page
#               it unmapped.
#   vfio-user --unmap-busy: the server refuses DMA_UNMAP with EBUSY while its device holds pins
#               (needs MEMVISOR= a binary built with --features test-hooks); the race phase must
#               catch the device writing a buffer the guest unmapped.
#   blk --long-term, balloon --long-term: retired (issue 45). blk requests hold their pages in
#               the pin registry without locking them, so nothing of theirs is pinned long-term
#               (`--long-term-pins` has no effect on blk); the plain balloon trial now has the
#               case balloon --long-term was for: only the registry keeps discards off pages in
#               flight. The script refuses them (exit 2).
#   balloon --stats: the balloon alone, with its statistics queue polled every second and
#               deflate on OOM offered (QEMU num_vqs=4). The guest says its MemFree while idle and
#               while it holds 192 MiB; the host checks the statistics the back end received
#               (its debug log) show both within 16 MiB, at least 5 updates, and total_memory equal
#               to the guest's MemTotal. Then the host inflates the balloon until 64 MiB are free
#               and the guest allocates 256 MiB in one process: it must succeed with no OOM kill,
#               and the back end must have seen the guest take at least 64 MiB back below the
#               target (--stats JSON deflated_below_target_pages). The control socket's
#               query-stats, sampled while the guest runs, must have shown at least 5 statistics
#               updates, free_memory and the target set through the socket (memvisor ctl).
#   balloon --stats --negative: the back end never asks for fresh statistics
#               (MEMVISOR_TEST_BALLOON_STATS_FROZEN; needs MEMVISOR= a test-hooks build) and does
#               not offer deflate on OOM; both the statistics and the OOM check must then FAIL.
#   vfio-user --long-term: the server holds what the device pins with long-term pins (io_uring,
#               FOLL_LONGTERM) instead of mlock; the host also checks that pins went that way
#               and that none is left at the end.
#   vfio-user --private: guest RAM is private to QEMU (no shared memory backend), so every
#               DMA_MAP comes without a descriptor and every byte the device moves goes through
#               DMA_READ / DMA_WRITE messages to QEMU; pin mode finds nothing to pin and copies.
#   vfio-user --after-fuzz: first 15 s of memvisor's hostile vfio-user client (memvisor-testkit vfio-user-fuzz)
#               against the server; it must still be alive, and the same server process must
#               then serve QEMU and pass. Every connection, the hostile ones too, must leave the
#               server's VmLck, VmPin and memfd mappings where they were before the first.
#   vfio-user --client-dies: QEMU runs the vfio-user trial; 5 s into its correctness phase, once
#               the server holds locks or pins and maps guest memory, QEMU is killed (SIGKILL).
#               Within 10 s the server must be alive with VmLck, VmPin and its memfd mappings
#               back at their values before the first client (/proc/PID/status, /proc/PID/maps);
#               then a second QEMU runs a shortened vfio-user trial (MVDMA_SECS, default 10)
#               against the same server.
#   vfio-user --client-dies --negative: the server keeps a dead connection's DMA table and all
#               it maps, locks and pins (needs MEMVISOR= a binary built with --features
#               test-hooks; MEMVISOR_TEST_LEAK_ON_HANGUP); the /proc checks must then FAIL.
#   blk --frontend-dies: the guest streams 4 MiB O_DIRECT writes and reads (t=hammer); the host
#               SIGKILLs QEMU while the back end is inside a request's preadv/pwritev, its pins
#               held (it keeps the image's page cache cold so requests wait on the disk). Within
#               10 s the back end must be alive, with VmLck and VmPin back to 0 and no mapping
#               of the dead QEMU's memfds (told apart by inode); then a fresh QEMU runs the blk
#               trial against the same back end process and must pass (2 connections served).
#   mig --frontend-dies: the same with the migration source SIGKILLed while its dirty log is
#               live (migrating at QEMU's default bandwidth, which the device outruns): the
#               log's memfd must be unmapped too.
#   --frontend-dies --negative: the back end keeps a departed frontend's memory and log mapped
#               (MEMVISOR_TEST_LEAK_ON_HANGUP; needs MEMVISOR= a binary built with --features
#               test-hooks); the release check must then FAIL.
#   blk --disk-fault: two memvisor blk back ends whose disks fail: an image on a 40 MiB tmpfs
#               with 16 MiB of filler (writes past 24 MiB get ENOSPC) and a FUSE file
#               (memvisor-faultfs) failing 512 KiB at 4 MiB with EIO. guest/progs/faultio.c
#               checks that exactly the requests the faults hit fail (EIO), the others move the
#               right data, and no memory outside the failed request's buffers changes; the host
#               then frees the filler, makes the FUSE file fail everything, then heals it, and
#               the guest checks requests succeed again on the same back ends. The host checks
#               both back ends lived to the end, their stats count each failed request as an I/O
#               error, and the pin registry equals VmLck (+VmPin).
#   blk --disk-fault --negative: the back ends answer OK for requests whose I/O failed
#               (MEMVISOR_TEST_HIDE_IO_ERRORS; needs MEMVISOR= a test-hooks build); must FAIL.
#   blk --memlock: no host limit on locked memory reaches the guest. The back end runs without
#               CAP_IPC_LOCK under RLIMIT_MEMLOCK 1 MiB against 96 guest O_DIRECT writers of up to
#               256 KiB (guest/progs/pinload.c, every write read back and checked), beside a second
#               back end without a limit on a second disk, MEMLOCK_ROUNDS (3) rounds of
#               MEMLOCK_SECS (10) s each, in turns. Must see: no I/O error, every block right
#               (guest and host), nothing stuck, the limited back end holding more guest pages
#               than its limit, registry == VmLck + VmPin, and its median throughput at least
#               half the unlimited one's (both printed, with the ratio).
#   balloon --memlock: the same limited back end as `serve` with a free-page-reporting balloon,
#               one run of 30 s while the guest fills and frees 128 MiB every few seconds and
#               its writers churn their buffers: the balloon must discard, the data stay right.
#   blk --memlock --negative: the old behaviour, a locked pin refused past the limit answered
#               IOERR (MEMVISOR_TEST_LOCKED_BLK_PINS; needs a test-hooks build): must FAIL.
#   blk --crash: the back end is SIGKILLed three times under load and started again at once on the
#               same socket; QEMU (reconnect-ms=100) reconnects. guest/progs/genio.c keeps 4
#               processes x 4 threads of O_DIRECT reads and writes of generation-stamped 4 KiB
#               blocks in flight for CRASH_SECS (45) s and must see no I/O error, no stale or
#               corrupt block, and no request left unanswered for CRASH_STALL (20) s; the host
#               checks every block of the image and genio's final generations, 3 kills, 4
#               frontend connections and that INFLIGHT_SHMFD was in use (the back end made the
#               inflight log), and stops a guest not done CRASH_SECS + 60 s after genio began.
#   blk --queue-size=N: the blk trial with QEMU's queue-size=N (a power of two up to 1024, QEMU's
#               own limit; Debian 13's stock QEMU uses 1024 by default): the data checks as in
#               blk, and the back end must have made the inflight log for queues of N
#               (the frontend asked for rings of N). A watchdog stops QEMU when the guest has
#               not found its disk (read its partition table) 60 s after QEMU started, so a
#               ring the back end never serves fails the trial instead of hanging it.
#   blk --queue-size=N --queue-cap: negative control: the back end takes rings of at most 256
#               entries again (MEMVISOR_TEST_MAX_QUEUE_SIZE=256; needs MEMVISOR= a test-hooks
#               build); it refuses SET_VRING_NUM N, closes the connection, and the trial must
#               FAIL within the timeout (exit 0 only if it does).
#   qtest       QEMU's own vhost-user-blk qtest (tests/qtest/vhost-user-blk-test.c, the
#               vhost-user-blk tests of qos-test) with memvisor in place of
#               qemu-storage-daemon (guest/qsd-shim.sh translates the daemon's command line)
#               and the trials' QEMU (qemu-system-x86_64 of the QEMU root) as the frontend:
#               each test runs alone with a 20 s limit (each takes about 1 s) and is reported PASS/FAIL; none may
#               fail. qos-test is built once from Debian's QEMU source (guest/mkqtest.sh,
#               target/guest/qtest; see there for which version and why).
#   qtest --peer: the same tests against qemu-storage-daemon from the QEMU root.
#   qtest --queue-size=N: QEMU gives every vhost-user-blk-pci rings of N entries
#               (-global vhost-user-blk-pci.queue-size=N; the tests' default is 128).
#   qtest --negative: the back end takes rings of at most 64 entries
#               (MEMVISOR_TEST_MAX_QUEUE_SIZE=64; needs MEMVISOR= a test-hooks build), below
#               the tests' 128: every test must FAIL.
#   blk --crash --negative: the back end withholds INFLIGHT_SHMFD and completes each batch of
#               requests in reverse order (MEMVISOR_TEST_NO_INFLIGHT, MEMVISOR_TEST_REORDER; needs
#               MEMVISOR= a test-hooks build); the trial must FAIL (lost requests: a hang the
#               watchdog reports, errors, or stale data).
#   blk --crash --reorder: the positive trial with each batch completed in reverse order
#               (MEMVISOR_TEST_REORDER alone; needs MEMVISOR= a test-hooks build) and
#               INFLIGHT_SHMFD on: out-of-order completion, which the used index cannot describe,
#               must still lose nothing.
#   rng         memvisor-vhost's example device (crates/memvisor-vhost/examples/rng.rs, built with
#               `cargo build --release -p memvisor-vhost --example rng`) under QEMU's generic
#               vhost-user-test-device-pci (virtio-id=4): it must be the guest kernel's hardware
#               RNG, and 1 MiB the guest reads from /dev/hwrng must not compress (gzip >= 99%)
#               nor repeat. Env RNG: the example's binary (default target/release/examples/rng).
#   rng --negative: the device writes zeros (MEMVISOR_TEST_RNG_ZEROS; RNG= a build with
#               --features test-hooks); the guest's check must then FAIL.
#   blk --loop: the disk is a loop device over a 64 MiB image (a block device, not a file: its
#               size comes from BLKGETSIZE64). The guest runs the blk trial on it, checks it sees
#               the whole capacity (sectors = image bytes / 512) and that its last block reads;
#               then guest/progs/blkdisc.c writes 1 MiB at 48 MiB, checks it, discards it
#               (BLKDISCARD; the back end sends it on with BLKDISCARD, the loop driver punches a
#               hole) and reads back zeros. The host checks the image: the guest's pattern, and
#               zeros and a hole where the guest discarded.
#               --loop=4096: the loop device has 4096-byte logical sectors (losetup --sector-size),
#               which the guest must see as its disk's logical block size (blk_size).
#   blk --loop --negative: once the guest has discarded, the host writes random data into the
#               discarded range through the loop device; the zero checks must then FAIL.
#   locks       no guest: QEMU's image locks and format probe against real peers from the QEMU
#               root. A paused QEMU VM (-S, virtio-blk -drive) holds the image: memvisor must
#               refuse it naming the image and the "write" lock; memvisor serves it: that VM
#               must fail to start (QEMU: Failed to get "write" lock); the same both ways with
#               qemu-storage-daemon's writable vhost-user-blk export; read-only memvisor beside
#               a read-only VM (both orders) must start; a qemu-img create -f qcow2 image must
#               be refused naming qcow2 and, with --format raw, served: qemu-io (libblkio)
#               reads the qcow2 header through memvisor and the image is qcow2 afterwards;
#               --locking off must start beside the paused VM. About 30 s.
#   locks --negative: memvisor runs with locking off (and format raw) wherever a refusal is
#               expected; the trial must then FAIL.
#   qmp         memvisor driven only through QMP, by python's qemu.qmp (guest/qmp-trial.py; pip install
#               qemu.qmp prometheus_client): `serve --control --metrics` starts with no device;
#               blk-add a disk, QEMU connects and the guest (guest/progs/qmpio.c) does verified
#               I/O; blk-resize +32 MiB must reach the guest's /sys/block/vda/size without a
#               reboot; blk-set-throttle bps = a quarter of the unthrottled rate: the guest's
#               rate over 8 s within +-10% of it, and back above 1.5 times it once lifted; QEMU
#               quits (its own QMP), then blk-del; the five device and frontend events in order;
#               the Prometheus endpoint, scraped at the guest's rate lines and parsed by
#               prometheus_client, must count requests, histogram counts and the guest's bytes
#               (within 10%) in every window; `quit` must stop the server. About 35 s (50 s negative-resize).
#   qmp --negative-throttle: blk-set-throttle is accepted and never delays a request
#               (MEMVISOR_TEST_IGNORE_THROTTLE; needs MEMVISOR= a test-hooks build): step 4
#               must FAIL.
#   qmp --negative-resize: blk-resize changes the capacity and tells the frontend nothing
#               (MEMVISOR_TEST_SILENT_RESIZE; needs MEMVISOR= a test-hooks build): step 3
#               must FAIL.
#   blk --fixed: the blk trial (sequential O_DIRECT, page cache, random 4 KiB O_DIRECT) against
#               `memvisor serve --blk ...,fixed-buffers=on` (guest RAM a memfd): the guest's
#               checks and the host image check must pass, and the back end's --stats must show
#               reads and writes gone out through registered buffers (fixed > 0,
#               chunks_registered > 0), none refused by the host (fixed_fallbacks == 0,
#               failed == 0), and fixed transfers not held (holds < fixed: only the ordinary
#               ones and flushes take a hold). About 1 minute.
#   blk --fixed --negative: the back end never uses registered buffers (MEMVISOR_TEST_NO_FIXED;
#               needs MEMVISOR= a test-hooks build); the fixed check must then FAIL.
#   balloon --fixed: the balloon trial with the blk device's registered buffers on
#               (fixed-buffers=on), then guest/progs/fixreuse.c: FIX_ROUNDS (4) rounds, each
#               mapping a fresh FIX_BUF_MIB (320) MiB buffer that lands on memory freed and
#               reported before (the balloon in the same process discarded it), reading the
#               disk into it with 64 KiB O_DIRECT reads and checking every 4 KiB block, then
#               writing the next generation, freeing the buffer and waiting 5 s for reporting.
#               Must see: the balloon trial's checks, no bad block, and in the back end's stats
#               fixed > 0, chunks_registered > 0, evictions > 0 (chunks the discard gate took out
#               of the table before a discard) and memory discarded. About 100 s.
#   balloon --fixed --negative: the discard gate evicts nothing (MEMVISOR_TEST_FIXED_NO_EVICT;
#               needs MEMVISOR= a test-hooks build), so discarded pages stay pinned behind
#               registered chunks and fixed reads fill them instead of the guest's pages: the
#               guest must find bad blocks (exit 0 only if it does).
# Env: MEMVISOR (binary, default target/release/memvisor), TIMEOUT (s, default 300), RUST_LOG
#   (the back ends' log filter, default info; warn for vfio-user).
set -euo pipefail
cd "$(dirname "$0")/.."
top=$PWD
trial=${1:?usage: trial.sh blk [--negative] [--peer]}; shift
balloon_stats=0; queues=1; negative=0; peer=0; fuzz=0; iommu=""; private=0; long_term=0; unmap_busy=0; disk_fault=0; memlock=0; client_dies=0
crash=0; reorder=0
# --queue-size=N and --queue-cap (blk; see the usage) are taken out before the common options.
qsize=""; qcap=0; rest=(); for a in "$@"; do case $a in --queue-size=[0-9]*) qsize=${a#--queue-size=};; --queue-cap) qcap=1;; *) rest+=("$a");; esac; done; set -- ${rest[@]+"${rest[@]}"}
if [ $qcap = 1 ] && [ -z "$qsize" ]; then echo "--queue-cap needs --queue-size=N" >&2; exit 2; fi
# --frontend-dies (blk, mig; see frontend_dies_* below) is taken out before the common options.
frontend_dies=0; rest=(); for a in "$@"; do if [ "$a" = --frontend-dies ]; then frontend_dies=1; else rest+=("$a"); fi; done; set -- ${rest[@]+"${rest[@]}"}
# --negative-throttle and --negative-resize (qmp; see the qmp case below) likewise.
qmp_neg=""; rest=(); for a in "$@"; do case $a in --negative-throttle) qmp_neg=throttle;; --negative-resize) qmp_neg=resize;; *) rest+=("$a");; esac; done; set -- ${rest[@]+"${rest[@]}"}
# --fixed (blk, balloon; see blk_fixed_trial and balloon_fixed_check below) likewise.
fixed=0; rest=(); for a in "$@"; do if [ "$a" = --fixed ]; then fixed=1; else rest+=("$a"); fi; done; set -- ${rest[@]+"${rest[@]}"}
# --loop (blk; see blk_loop_trial below) likewise.
loop=0; loop_sector=512; rest=(); for a in "$@"; do case $a in --loop) loop=1;; --loop=4096) loop=1; loop_sector=4096;; *) rest+=("$a");; esac; done; set -- ${rest[@]+"${rest[@]}"}
for a in "$@"; do case $a in --stats) balloon_stats=1;; --negative) negative=1;; --crash) crash=1;; --reorder) reorder=1;; --disk-fault) disk_fault=1;; --memlock) memlock=1;; --client-dies) client_dies=1;; --unmap-busy) unmap_busy=1; negative=1;; --no-summary) no_summary=1; negative=1;; --peer) peer=1;; --after-fuzz) fuzz=1;; --private) private=1;; --long-term) long_term=1;; --queues=[1-8]) queues=${a#--queues=};; --iommu=strict|--iommu=lazy) iommu=${a#--iommu=};; *) echo "unknown option $a" >&2; exit 2;; esac; done
# blk and balloon --long-term are retired (see the usage above): blk pins nothing long-term now.
if [ $long_term = 1 ] && { [ "$trial" = blk ] || [ "$trial" = balloon ]; }; then
  echo "trial.sh $trial --long-term: retired; blk requests hold guest pages without locking them (issue 45), so nothing is pinned long-term; vfio-user --long-term remains" >&2; exit 2
fi
# With --frontend-dies, --negative is the leak switch (MEMVISOR_TEST_LEAK_ON_HANGUP, a test-hooks
# build), not the trial's own negative control.
leak=0; if [ $frontend_dies = 1 ] && [ $negative = 1 ]; then negative=0; leak=1; export MEMVISOR_TEST_LEAK_ON_HANGUP=1; fi
if [ "$(id -u)" != 0 ]; then
  echo "SKIPPED real-guest trial $trial: needs root (mount namespace + chroot for the QEMU root, mmdebstrap)"
  exit 0
fi
bin=${MEMVISOR:-$top/target/release/memvisor}
[ -x "$bin" ] || { echo "no memvisor binary at $bin: cargo build --release first" >&2; exit 1; }
# Negative controls whose switch is a test hook (issue 36: no test switch in the product):
# the binary must be a test-hooks build, which alone contains the variable's name; otherwise
# the switch would be ignored and the control would prove nothing.
need_hooks() {
  grep -q -a "$1" "$bin" && return 0
  echo "trial.sh $trial: $1 needs MEMVISOR= a binary built with --features test-hooks (.ci/run's target/release/memvisor-test-hooks); $bin is not one" >&2
  exit 2
}
# The lab's tools are the test kit's binaries (crate memvisor-testkit), beside the server:
# the hostile clients (--after-fuzz) and the failing FUSE file (--disk-fault).
testkit=${TESTKIT:-$(dirname "$bin")/memvisor-testkit}
need_testkit() {
  [ -x "$testkit" ] && return 0
  echo "trial.sh $trial: no memvisor-testkit at $testkit: cargo build --release -p memvisor-testkit (or TESTKIT=PATH)" >&2
  exit 1
}
# The IOTLB and DMA recordings the benchmark replays (--record-iotlb, --record) are written by a
# test-hooks build only (the recorder is the test kit's); with the plain server the trial runs
# the same and records nothing. $1: the server's subcommand, $2: the option.
can_record() { "$bin" "$1" --help 2>/dev/null | grep -q -- "$2"; }
work=$top/target/guest
# The serial vhost-user-blk answers GET_ID with when none is given: mv- and the FNV-1a hash of the
# disk's canonical path, 16 hex digits (crates/memvisor-cli/src/devices.rs, path_serial).
path_serial() {
  python3 -c 'import os, sys
h = 0xcbf29ce484222325
for b in os.fsencode(os.path.realpath(sys.argv[1])):
    h = ((h ^ b) * 0x100000001b3) & (2**64 - 1)
print("mv-%016x" % h)' "$1"
}
guest/mkroot.sh "$work/root" >/dev/null
fresh=1; for f in guest/init guest/mkguest.sh guest/progs/*.c; do [ "$work/vm/initrd.cpio.gz" -nt "$f" ] || fresh=0; done
[ $fresh = 1 ] || guest/mkguest.sh "$work/vm" >/dev/null
cd "$work"
name=$trial; [ $peer = 0 ] || name=$name-peer; [ $negative = 0 ] || name=$name-negative; [ $unmap_busy = 0 ] || name=$name-unmap-busy; [ $fuzz = 0 ] || name=$name-after-fuzz; [ -z "$iommu" ] || name=$name-iommu-$iommu; [ $private = 0 ] || name=$name-private; [ $long_term = 0 ] || name=$name-long-term; [ $queues = 1 ] || name=$name-queues$queues
[ $fixed = 0 ] || name=$name-fixed
[ $frontend_dies = 0 ] || name=$name-frontend-dies; [ $leak = 0 ] || name=$name-negative; [ $client_dies = 0 ] || name=$name-client-dies
[ $balloon_stats = 0 ] || name=${name/balloon/balloon-stats}
[ $disk_fault = 0 ] || name=${name/blk/blk-disk-fault}; [ $memlock = 0 ] || { name=${name/blk/blk-memlock}; name=${name/balloon/balloon-memlock}; }
[ $crash = 0 ] || name=${name/blk/blk-crash}; [ $reorder = 0 ] || name=$name-reorder
[ $loop = 0 ] || name=${name/blk/blk-loop}; [ $loop_sector = 512 ] || name=${name/blk-loop/blk-loop$loop_sector}
[ -z "$qsize" ] || name=$name-qs$qsize; [ $qcap = 0 ] || name=$name-capped
[ -z "$qmp_neg" ] || name=$name-negative-$qmp_neg
# The disk-fault trial's mounts (tmpfs, FUSE) from a run that died before its cleanup.
for m in "$work/run/$name/fault/fuse" "$work/run/$name/fault/tmpfs"; do
  mountpoint -q "$m" 2>/dev/null && umount -l "$m"
done
run=run/$name; rm -rf "$run"; mkdir -p "$run"
log=$run/console.log
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_socket() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; return 1; }
# With --long-term: the back end's stats ($run/stats.json) must show runs pinned long-term and
# none still pinned at the end; sets ok=0 otherwise.
check_long_term() {
  local lt left
  # The registry's figures at exit (the stats also hold readings taken at each disconnect).
  lt=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pins"]["long_term_pins"])' "$run/stats.json" 2>/dev/null || true)
  left=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pins"]["long_term_bytes"])' "$run/stats.json" 2>/dev/null || true)
  echo "  long-term pins: ${lt:-none} runs pinned, ${left:-?} bytes still pinned at the end (want > 0 and 0)"
  [ "${lt:-0}" -gt 0 ] && [ "${left:-1}" = 0 ] || ok=0
}
# Guest RAM: a shared memfd that back ends map, or (--private) QEMU's own anonymous memory.
ram="memory-backend-memfd,id=mem,size=1G,share=on"; [ $private = 0 ] || ram="memory-backend-ram,id=mem,size=1G"
# Runs QEMU with the trial's devices; the console goes to $log.
qemu() {
  timeout "${TIMEOUT:-300}" "$top/guest/qemu.sh" root \
    -machine q35,memory-backend=mem -object "$ram" -m 1G \
    -smp $queues -nographic -no-reboot -kernel vm/vmlinuz -initrd vm/initrd.cpio.gz \
    -append "console=ttyS0 panic=-1 quiet $1" "${@:2}" > "$log" 2>&1 &
  qpid=$!; pids+=("$qpid")
}

# --- balloon --stats ----------------------------------------------------------------------------
# The balloon's statistics queue (polled every second) and deflate on OOM, in one guest
# (guest/init: balloon-stats); see the usage at the top. With --negative the back end never asks
# for fresh statistics (test-hooks build) and does not offer deflate on OOM: both checks must fail.
balloon_stats_trial() {
  local oom=on answered="" sres
  if [ $negative = 1 ]; then oom=off; export MEMVISOR_TEST_BALLOON_STATS_FROZEN=1; fi
  # The statistics go to the debug log; the control socket shows them live (query-stats,
  # sampled every second into live.json while the guest runs).
  RUST_LOG=debug "$bin" serve --balloon "$run/balloon.sock,stats-interval=1,deflate-on-oom=$oom" \
    --control "$run/control.sock" --stats "$run/stats.json" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$run/balloon.sock"; wait_socket "$run/control.sock"
  qemu "t=balloon-stats" \
    -chardev socket,id=c1,path=$run/balloon.sock -device vhost-user-test-device-pci,chardev=c1,virtio-id=5,num_vqs=4,config_size=16
  while kill -0 "$qpid" 2>/dev/null; do
    if [ -z "$answered" ]; then
      want=$(grep -a -o 'OOM INFLATE [0-9]* MiB please' "$log" 2>/dev/null | awk '{ print $3 }' || true)
      if [ -n "$want" ]; then
        echo "  control: $("$bin" ctl --control "$run/control.sock" balloon-set-target target-mib="$want" | tr -d ' \n')"; answered=1
      fi
    fi
    if [ "$((SECONDS % 2))" = 0 ]; then
      "$bin" ctl --control "$run/control.sock" query-stats device=balloon0 > "$run/live.tmp" 2>/dev/null \
        && mv "$run/live.tmp" "$run/live.json" || true
    fi
    sleep 0.2
  done
  wait "$qpid" || true
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  grep -a '^GUEST' "$log" | tr -d '\r' | sed 's/^/  /'
  sres=$(grep -a '^RESULT balloon-stats' "$log" | tail -1 | tr -d '\r' || true)
  # The figures: the guest's MemFree/MemTotal against the statistics the back end logged, and
  # what the back end counted below the target.
  python3 - "$log" "$run/backend.log" "$run/stats.json" "${sres:-RESULT balloon-stats FAIL no verdict}" "$run/live.json" > "$run/verdict" <<'PY'
import json, re, sys
console, backend, stats_path, sres, live_path = sys.argv[1:6]
text = open(console, errors="replace").read()
def kb(pattern):
    m = re.search(pattern, text)
    return int(m.group(1)) * 1024 if m else None
idle, total, held = kb(r"STATS idle MemFree (\d+) kB"), kb(r"MemTotal (\d+) kB"), kb(r"STATS held MemFree (\d+) kB")
updates = []
for line in open(backend, errors="replace"):
    m = re.search(r"guest statistics #(\d+): (.*)", line)
    if m:
        updates.append({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))})
free = [u["free_memory"] for u in updates if "free_memory" in u]
tol = 16 << 20
near = lambda want: want is not None and any(abs(f - want) <= tol for f in free)
mib = lambda b: "?" if b is None else f"{b / 2**20:.0f}"
closest = lambda want: mib(min(free, key=lambda f: abs(f - want))) if free and want is not None else "none"
stats_ok = (len(updates) >= 5 and idle is not None and held is not None and idle - held >= 150 << 20
            and near(idle) and near(held) and any(u.get("total_memory") == total for u in updates))
print(f"  statistics: {len(updates)} updates; guest MemFree idle {mib(idle)} MiB (closest update {closest(idle)} MiB), "
      f"holding 192 MiB {mib(held)} MiB (closest update {closest(held)} MiB); total_memory = MemTotal "
      f"{mib(total)} MiB in {sum(u.get('total_memory') == total for u in updates)} updates")
try:
    b = json.load(open(stats_path))["balloon"][0]
except Exception as e:
    b = {}
below = b.get("deflated_below_target_pages", 0)
print(f"  back end: target {b.get('target_pages', '?')} pages, deflated below the target on OOM {below} pages "
      f"({below // 256} MiB), statistics buffers {b.get('stats_buffers', '?')} ({b.get('refused_stats', '?')} refused), "
      f"last statistics {json.dumps(b.get('guest_stats'))}")
oom_ok = "PASS" in sres and below >= 64 * 256
# The live view (control socket, query-stats) while the guest ran: statistics had arrived and the
# target set through the socket was in force.
try:
    lb = json.load(open(live_path))["devices"][0]["balloon"]
except Exception as e:
    lb = {}
lg = lb.get("guest_stats") or {}
live_ok = lg.get("updates", 0) >= 5 and "free_memory" in lg.get("values", {}) and lb.get("target_pages", 0) > 0
print(f"  live (query-stats while the guest ran): target {lb.get('target_pages', '?')} pages, actual "
      f"{lb.get('actual_pages', '?')}, {lg.get('updates', 0)} statistics updates, free_memory "
      f"{mib(lg.get('values', {}).get('free_memory'))} MiB: {'PASS' if live_ok else 'FAIL'}")
stats_ok = stats_ok and live_ok
print(f"  guest: {sres}")
print(f"STATS {'PASS' if stats_ok else 'FAIL'} OOM {'PASS' if oom_ok else 'FAIL'}")
PY
  grep -v '^STATS ' "$run/verdict"
  local v; v=$(grep '^STATS ' "$run/verdict" || echo "STATS FAIL OOM FAIL")
  echo "$name: statistics ${v#STATS }" | sed 's/ OOM /; deflate on OOM /'
  if [ $negative = 1 ]; then
    [ "$v" = "STATS FAIL OOM FAIL" ] && { echo "$name: both checks failed as they must"; return 0; }
    echo "$name: a check passed although the back end was broken for it ($v; is MEMVISOR a test-hooks build?)"; return 1
  fi
  [ "$v" = "STATS PASS OOM PASS" ]
}

# --- frontend-dies (blk --frontend-dies, mig --frontend-dies) ---------------------------------
# A QEMU is SIGKILLed while memvisor's vhost-user-blk back end serves it: mid-request (the guest's
# "hammer" streams 4 MiB O_DIRECT writes and reads), or mid-migration (the dirty log live). The
# kill lands while the back end is inside a preadv/pwritev of a request (its pins held), seen in
# /proc/PID/task/*/syscall. Within 10 s the back end must be alive, back to a fresh back end's
# VmLck and VmPin (0) with no memfd mapped, none of the dead QEMU's memfds (guest RAM, the
# migration log, told apart by inode) in particular; then a fresh QEMU runs the blk trial
# against the same back end process and must pass.
# With MEMVISOR_TEST_LEAK_ON_HANGUP (--negative, test-hooks build) the back end keeps a departed
# frontend's memory mapped: the release check must then fail.

# "VmLck VmPin DEAD MEMFD" of process $1: kB locked, kB pinned, its mappings of the memfd
# inodes in $2 (space-separated) and of any memfd.
vhost_figures() {
  awk '/^VmLck:/ { l = $2 } /^VmPin:/ { p = $2 } END { printf "%d %d", l, p }' "/proc/$1/status"
  awk -v inos=" $2 " '$6 ~ /^\/memfd:/ { m++; if (index(inos, " " $5 " ")) d++ } END { printf " %d %d\n", d, m }' "/proc/$1/maps"
}
# check_released_vhost PID "BASE_LCK BASE_PIN _ BASE_MEMFD" "INODES": prints the figures as one
# line; 0 when the back end is alive and has released everything of the dead frontend.
check_released_vhost() {
  local f b
  kill -0 "$1" 2>/dev/null || { echo "back end $1 is gone"; return 1; }
  read -r -a f <<< "$(vhost_figures "$1" "$3")"; read -r -a b <<< "$2"
  echo "back end alive; VmLck ${f[0]} kB (baseline ${b[0]}), VmPin ${f[1]} kB (baseline ${b[1]}), ${f[2]} mappings of the dead QEMU's memfds, ${f[3]} memfd mappings (baseline ${b[3]})"
  [ "${f[0]}" = "${b[0]}" ] && [ "${f[1]}" = "${b[1]}" ] && [ "${f[2]}" = 0 ] && [ "${f[3]}" = "${b[3]}" ]
}
# The QEMU process under the harness's `timeout` $1 (qemu.sh execs its way to it).
qemu_pid_under() {
  local p=$1 c
  for _ in 1 2 3 4 5 6; do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = qemu-system-x86 ] && { echo "$p"; return 0; }
    c=$(cat "/proc/$p/task/$p/children" 2>/dev/null | awk '{print $1}'); [ -n "$c" ] || return 1; p=$c
  done
  return 1
}
# Kills QEMU ($1: the harness's pid for it) while back end $bpid is in a request's preadv/pwritev
# (tried for 60 s, keeping the image's page cache cold so that requests wait on the disk; else
# killed anyway, said so), then waits for the release.
# Prints what was outstanding; returns 1 if the back end did not release everything.
frontend_dies_kill() {
  local q base out inodes t0 line ok_rel=1
  q=$(qemu_pid_under "$1") || { echo "  no QEMU process under $1"; return 1; }
  disown "$1" 2>/dev/null || true   # no "Killed" job notice; its end is awaited below
  base="0 0 0 0"
  out=$(python3 - "$bpid" "$q" 60 "$run/disk.img" <<'PY'
import os, signal, sys, time
b, q, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def memfds(pid):
    got = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("/memfd:"):
                got[os.stat(f"/proc/{pid}/fd/{fd}").st_ino] = link.split()[0][len("/memfd:"):]
        except OSError:
            pass
    return got
def status(pid):
    f = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status"))
    return f.get("VmLck", " 0 kB").split()[0], f.get("VmPin", " 0 kB").split()[0]
fds = memfds(q)
mapped = {}
for line in open(f"/proc/{b}/maps"):
    c = line.split()
    if len(c) >= 6 and c[5].startswith("/memfd:") and int(c[4]) in fds:
        mapped[fds[int(c[4])]] = mapped.get(fds[int(c[4])], 0) + 1
names = {295: "preadv", 296: "pwritev", 327: "preadv2", 328: "pwritev2"}
caught = None
end = time.monotonic() + secs
# Keep the image's page cache cold, so that requests wait on the disk inside their system
# call (a request copying from the page cache is over in microseconds and shows as "running").
image = os.open(sys.argv[4], os.O_RDONLY)
cooled = 0.0
while caught is None and time.monotonic() < end:
    if time.monotonic() - cooled > 0.02:
        os.fdatasync(image)
        os.posix_fadvise(image, 0, 0, os.POSIX_FADV_DONTNEED)
        cooled = time.monotonic()
    for t in os.listdir(f"/proc/{b}/task"):
        try:
            c = open(f"/proc/{b}/task/{t}/syscall").read().split()
        except OSError:
            continue
        if c and c[0].isdigit() and int(c[0]) in names:
            lck, pin = status(b)
            os.kill(q, signal.SIGKILL)
            try:
                still = open(f"/proc/{b}/task/{t}/syscall").read().split()[:5] == c[:5]
            except OSError:
                still = False
            caught = (f"{names[int(c[0])]} of {int(c[3], 16)} iovecs at byte {int(c[4], 16)}"
                      f" ({'still' if still else 'no longer'} in it after the kill)")
            break
if caught is None:
    lck, pin = status(b)
    os.kill(q, signal.SIGKILL)
    caught = f"none in {secs:.0f} s (killed anyway)"
print("inodes=" + " ".join(str(i) for i in fds))
print("mapped=" + ", ".join(f"{n} x{k}" for n, k in sorted(mapped.items())) + f" ({sum(mapped.values())} mappings)")
print(f"caught={caught}")
print(f"at_kill=VmLck {lck} kB, VmPin {pin} kB")
PY
) || { echo "  the kill went wrong: $out"; return 1; }
  inodes=$(sed -n 's/^inodes=//p' <<< "$out")
  echo "  QEMU $q's memfds mapped by the back end before the kill: $(sed -n 's/^mapped=//p' <<< "$out")"
  echo "  SIGKILL while the back end was in: $(sed -n 's/^caught=//p' <<< "$out"); the back end then held $(sed -n 's/^at_kill=//p' <<< "$out")"
  t0=$(date +%s.%N)
  for _ in $(seq 100); do [ -e "/proc/$q" ] || break; sleep 0.1; done
  for _ in $(seq 50); do
    line=$(check_released_vhost "$bpid" "$base" "$inodes") && { ok_rel=0; break; }
    sleep 0.2
  done
  echo "  $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}') s after the kill: $line"
  if [ $ok_rel = 1 ]; then
    echo "  still mapped:"; awk -v inos=" $inodes " '$6 ~ /^\/memfd:/ && index(inos, " " $5 " ")' "/proc/$bpid/maps" 2>/dev/null | head -5 | sed 's/^/    /' || true
    echo "$name: RELEASE FAIL"
  else
    echo "$name: RELEASE PASS"
  fi
  return $ok_rel
}
# After the kill: the leak switch's verdict, or a fresh QEMU running the blk trial (its own
# pattern, verified by the guest and in the image) against the same back end.
frontend_dies_next() {
  local rel=$1 result want have host=FAIL conns
  if [ $leak = 1 ]; then
    [ "$rel" != 0 ] && { echo "$name: the release check failed as it must"; exit 0; }
    echo "$name: a back end that kept the dead frontend's memory passed the release check"; exit 1
  fi
  [ "$rel" = 0 ] || exit 1
  log=$run/console.log
  qemu "t=blk blk_mib=32 blk_wait=1 blk_random=300 blk_serial=$(path_serial "$run/disk.img")" \
    -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  kill -0 "$bpid" 2>/dev/null || { echo "$name: the back end died"; tail "$run/backend.log"; exit 1; }
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  grep -a '^GUEST' "$log" | sed 's/^/  /'
  result=$(grep -a '^RESULT blk' "$log" | tail -1 | tr -d '\r' || true)
  want=$(grep -a 'PATTERN sha256=' "$log" | sed 's/.*sha256=\([0-9a-f]*\).*/\1/' | tr -d '\r' || true)
  have=$(head -c $((32 << 20)) "$run/disk.img" | sha256sum | cut -d' ' -f1)
  [ -z "$want" ] || [ "$want" != "$have" ] || host=PASS
  conns=$(tr -d ' \n' < "$run/stats.json" 2>/dev/null | grep -o '"connections":[0-9]*' | cut -d: -f2)
  echo "  host image check: $host (guest pattern ${want:-none}, image $have); connections served: ${conns:-?} (want 2)"
  echo "$name: next frontend: ${result:-RESULT blk FAIL no verdict (see $work/$log)}"
  case "$result" in *PASS*) [ $host = PASS ] && [ "${conns:-0}" = 2 ] && exit 0;; esac
  exit 1
}
# blk --frontend-dies: called with the back end up ($bpid on $sock).
frontend_dies_blk() {
  local rel=0
  log=$run/console-killed.log
  qemu "t=hammer" -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1
  for _ in $(seq 1800); do grep -q "HAMMER started" "$log" 2>/dev/null && break; sleep 0.1; done
  grep -q "HAMMER started" "$log" || { echo "$name: the guest never started its I/O"; tail -5 "$log"; exit 1; }
  sleep 2
  echo "  guest: $(grep -a 'HAMMER' "$log" | tail -1 | tr -d '\r')"
  frontend_dies_kill "$qpid" || rel=$?
  frontend_dies_next $rel
}
# mig --frontend-dies: called with the source QEMU ($src) up and its device writing; migrates at
# QEMU's default bandwidth, which this writer outruns, so the dirty log stays live.
frontend_dies_mig() {
  local rel=0 status=""
  hmp src "migrate -d \"exec:cat > $run/mig.state\"" >/dev/null
  for _ in $(seq 600); do grep -q "dirty logging on" "$run/backend.log" 2>/dev/null && break; sleep 0.1; done
  sleep 2
  status=$(hmp src "info migrate" 2>/dev/null | tr -d '\r' | grep -i -m1 'status:' || true)
  echo "  migration $(tr -s " \t" " " <<< "$status"); back end: $(grep -a -h -o 'dirty log of.*\|dirty logging on' "$run/backend.log" | tr '\n' ';')"
  case $status in *active*) ;; *) echo "$name: the migration was not active"; exit 1;; esac
  grep -q "dirty logging on" "$run/backend.log" || { echo "$name: the back end never turned its dirty log on"; exit 1; }
  frontend_dies_kill "$src" || rel=$?
  frontend_dies_next $rel
}
# --- end of frontend-dies ---------------------------------------------------------------------
# blk --disk-fault and blk --memlock (issue 34's injected faults): each its own block.
# Reads a number at a JSON path from a stats file: jget FILE EXPR (EXPR in Python on `s`).
jget() { python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null || echo "?"; }
# The registry-vs-kernel check of a vhost-user-blk --stats file: its account (charged +
# cached) and what it holds must both equal VmLck + VmPin, when each frontend left and at exit.
pin_check() {
  python3 - "$1" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"FAIL no stats ({e})"); sys.exit()
checks = [("disconnect", c) for c in s["pins_at_disconnect"]] + [("exit", s["pins"]["check"])]
bad, shown = [], []
for when, c in checks:
    kernel = (c["vm_lck"] or 0) + (c["vm_pin"] or 0)
    account = c["charged_bytes"] + c["cached_bytes"]
    shown.append(f"{when}: account={account} held={c['held_bytes']} VmLck+VmPin={kernel}")
    if c["vm_lck"] is None: bad.append(f"{when}: no VmLck")
    if account != kernel or c["held_bytes"] != kernel: bad.append(f"{when}: registry != kernel")
if not s["pins_at_disconnect"]: bad.append("no check when the frontend left")
print(("FAIL " + "; ".join(bad) if bad else "PASS") + " (" + ", ".join(shown) + ")")
PY
}
# --- crash (blk --crash) ------------------------------------------------------------------------
# The back end SIGKILLed under load and started again on the same socket, three times; QEMU
# (reconnect-ms=100) reconnects each time and the restarted back end must take up what was in
# flight (INFLIGHT_SHMFD). guest/progs/genio.c keeps 4 processes x 4 threads of O_DIRECT reads
# and writes of generation-stamped blocks going and must end with no I/O error, stale or corrupt
# block and nothing stuck (its watchdog says "requests lost" after CRASH_STALL s without a
# completion; virtio-blk has no timeout of its own). The host checks every block of the image
# against its header and genio's digest of the final generations, counts the kills and the
# frontend connections, checks the first back end made the inflight log (INFLIGHT_SHMFD in use),
# reports how many requests each restarted back end redid, and ends the run if genio is not done
# CRASH_SECS + 60 s after it started.
# --negative: the back end withholds INFLIGHT_SHMFD and completes each batch in reverse order
# (MEMVISOR_TEST_NO_INFLIGHT, MEMVISOR_TEST_REORDER; a test-hooks build): the trial must FAIL.
# --reorder: the reverse-order completions alone, INFLIGHT_SHMFD on: the trial must PASS.
if [ $crash = 1 ]; then
  secs=${CRASH_SECS:-45}; stall=${CRASH_STALL:-20}; kills=3
  sock=$run/blk.sock
  truncate -s 0 "$run/disk.img"; truncate -s 64M "$run/disk.img"
  hooks_env=(); [ $negative = 0 ] || hooks_env=(MEMVISOR_TEST_NO_INFLIGHT=1 MEMVISOR_TEST_REORDER=1)
  [ $reorder = 0 ] || hooks_env=(MEMVISOR_TEST_REORDER=1)
  # Back end number $1 (0 the first), its log in backend-$1.log.
  crash_backend() {
    env "${hooks_env[@]}" RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$sock" \
      --disk "$run/disk.img" --stats "$run/stats-$1.json" > "$run/backend-$1.log" 2>&1 &
    bpid=$!; pids+=("$bpid")
  }
  connected() { cat "$run"/backend-*.log 2>/dev/null | grep -c 'frontend connected' || true; }
  crash_backend 0
  wait_socket "$sock"
  start=$(date +%s.%N)
  qemu "t=crash genio_secs=$secs genio_stall=$stall" \
    -chardev socket,id=c0,path=$sock,reconnect-ms=100 -device vhost-user-blk-pci,chardev=c0,num-queues=1
  for _ in $(seq 1800); do grep -a -q "GENIO started" "$log" 2>/dev/null && break; kill -0 "$qpid" 2>/dev/null || break; sleep 0.1; done
  grep -a -q "GENIO started" "$log" || { echo "$name: genio never started"; tail -20 "$log"; exit 1; }
  t_started=$SECONDS
  echo "  guest: $(grep -a 'GENIO started' "$log" | tr -d '\r')"
  # Kill k (1..3) at about 5 + 9(k-1) s into genio's run: while a back end thread is in an I/O
  # system call or in a pause between two completions (the reorder hook's), if one is seen
  # within 3 s (the image's page cache kept cold so that requests wait on the disk), else
  # anyway; then a new back end at once on the same socket.
  done_kills=0
  for k in $(seq $kills); do
    while [ $((SECONDS - t_started)) -lt $((5 + 9 * (k - 1))) ]; do sleep 0.2; done
    kill -0 "$qpid" 2>/dev/null || break
    before=$(connected)
    what=$(python3 - "$bpid" "$run/disk.img" 3 <<'PY'
import os, signal, sys, time
b, secs = int(sys.argv[1]), float(sys.argv[3])
names = {17: "pread64", 18: "pwrite64", 19: "readv", 20: "writev", 295: "preadv", 296: "pwritev",
         327: "preadv2", 328: "pwritev2", 426: "io_uring_enter", 74: "fsync", 75: "fdatasync",
         35: "a pause between completions (nanosleep)", 230: "a pause between completions (clock_nanosleep)"}
image = os.open(sys.argv[2], os.O_RDONLY)
end, cooled, caught = time.monotonic() + secs, 0.0, None
while caught is None and time.monotonic() < end:
    if time.monotonic() - cooled > 0.02:
        os.fdatasync(image); os.posix_fadvise(image, 0, 0, os.POSIX_FADV_DONTNEED); cooled = time.monotonic()
    for t in os.listdir(f"/proc/{b}/task"):
        try:
            c = open(f"/proc/{b}/task/{t}/syscall").read().split()
        except OSError:
            continue
        if c and c[0].isdigit() and int(c[0]) in names:
            os.kill(b, signal.SIGKILL); caught = f"in {names[int(c[0])]}"; break
if caught is None:
    os.kill(b, signal.SIGKILL); caught = f"in no I/O call within {secs:.0f} s (killed anyway)"
print(caught)
PY
) || { echo "$name: the kill went wrong: $what"; exit 1; }
    wait "$bpid" 2>/dev/null || true
    t_kill=$((SECONDS - t_started))
    rm -f "$sock"
    crash_backend "$k"
    wait_socket "$sock" || { echo "$name: the restarted back end did not listen"; exit 1; }
    back=""
    for _ in $(seq 100); do [ "$(connected)" -gt "$before" ] && { back=1; break; }; sleep 0.1; done
    done_kills=$k
    echo "  kill $k at ${t_kill} s: SIGKILL $what; new back end $bpid; QEMU $([ -n "$back" ] && echo reconnected || echo "did NOT reconnect within 10 s")"
    echo "  guest: $(grep -a '^GENIO' "$log" | tail -1 | tr -d '\r')"
  done
  # genio's end: its own verdict (or its watchdog's) and the guest's poweroff.
  limit=$((secs + 60)); finished=""
  while [ $((SECONDS - t_started)) -lt $limit ]; do kill -0 "$qpid" 2>/dev/null || { finished=1; break; }; sleep 0.5; done
  end=$(date +%s.%N)
  if [ -z "$finished" ]; then
    echo "  genio did not finish in $limit s: requests lost (QEMU stopped)"
    # QEMU may itself be waiting on a back end that does not answer: SIGKILL after 10 s.
    q=$(qemu_pid_under "$qpid" || true)
    kill -TERM "$qpid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$qpid" 2>/dev/null || break; sleep 0.2; done
    [ -z "$q" ] || kill -KILL "$q" 2>/dev/null || true
  fi
  wait "$qpid" 2>/dev/null || true
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  { grep -a -E '^(GUEST|GENIO|genio:)' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  { grep -a -i -E 'vhost|virtio|not a head|blk_update|I/O error|hung|blocked for' "$log" | grep -v -E '^(GUEST|GENIO|genio:)' || true; } \
    | tr -d '\r' | sort | uniq -c | sort -rn | head -8 | sed 's/^/  console: /' || true  # head closes the pipe early: SIGPIPE upstream
  result=$(grep -a '^RESULT crash' "$log" | tail -1 | tr -d '\r' || true)
  digest=$(grep -a -o 'GENIO digest=[0-9a-f]* blocks=[0-9]*' "$log" | tail -1 || true)
  host="FAIL no digest from genio"
  if [ -n "$digest" ]; then
    host=$(python3 - "$run/disk.img" $(sed 's/GENIO digest=\([0-9a-f]*\) blocks=\([0-9]*\)/\1 \2/' <<< "$digest") <<'PY'
# Every block must be a whole genio block (header and body of one generation) and the
# generations must be the ones genio ended with (its digest).
import struct, sys
M = (1 << 64) - 1
MAGIC = 0x47454e494f626c6b
def mix(x):
    x = (x + 0x9e3779b97f4a7c15) & M
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & M
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & M
    return x ^ (x >> 31)
def block(b, g):
    w = [MAGIC, b, g, mix(MAGIC ^ mix(b) ^ ((g << 1) & M))]
    x = mix(((b << 32) ^ g) & M) | 1
    for _ in range(508):
        x ^= (x << 13) & M; x ^= x >> 7; x ^= (x << 17) & M
        w.append(x)
    return struct.pack("<512Q", *w)
img, want, n = open(sys.argv[1], "rb").read(), int(sys.argv[2], 16), int(sys.argv[3])
bad, digest, gens = [], 0, 0
for b in range(n):
    g = struct.unpack_from("<Q", img, b * 4096 + 16)[0]
    if img[b * 4096:(b + 1) * 4096] != block(b, g): bad.append(b)
    digest = (digest + mix(((b << 32) ^ g) & M)) & M; gens += g
if bad: print(f"FAIL {len(bad)} of {n} blocks are not whole genio blocks, first {bad[:4]}")
elif digest != want: print(f"FAIL the image's generations (digest {digest:016x}) are not genio's ({want:016x})")
else: print(f"PASS {n} blocks whole, generations as genio ended (digest {digest:016x}, {gens} writes in all)")
PY
)
  fi
  conns=$(connected)
  tested=$(cat "$run"/backend-*.log | grep -a 'TEST ONLY' | sort | uniq -c | sed 's/^ *//' | head -3 | tr '\n' ';' || true)
  echo "  host image check: $host"
  echo "  kills: $done_kills of $kills; frontend connections seen by the back ends: $conns (want $((kills + 1)))"
  # INFLIGHT_SHMFD in use: the first back end made the log QEMU keeps; restarted ones say what
  # they redid.
  logs=$(cat "$run"/backend-*.log | grep -a -c 'inflight log of' || true)
  redone=$({ cat "$run"/backend-*.log | grep -a -o '[0-9]* requests were in flight when the last back end stopped' || true; } | awk '{n += $1; r = r " " $1} END {printf "%d (per restart:%s)", n, r ? r : " none"}')
  echo "  inflight logs made: $logs; requests redone by restarted back ends: $redone$([ -z "$tested" ] || echo "; test hooks: $tested")"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${result:-RESULT crash FAIL no verdict from genio (see $work/$log)}"
  ok=0
  case "$result/$host" in *PASS*/PASS*) [ -n "$finished" ] && [ "$done_kills" = $kills ] && [ "$conns" = $((kills + 1)) ] && ok=1;; esac
  [ $negative = 1 ] || [ "$logs" -ge 1 ] || { echo "  no inflight log was made: INFLIGHT_SHMFD not in use"; ok=0; }
  if [ $negative = 1 ] || [ $reorder = 1 ]; then
    [ -n "$tested" ] || { echo "$name: the back end logged no test hook: run it with MEMVISOR= a test-hooks build"; exit 1; }
  fi
  if [ $negative = 1 ]; then
    [ "$logs" = 0 ] || { echo "$name: an inflight log was made: INFLIGHT_SHMFD was not withheld"; exit 1; }
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: requests completed out of order survived the kills without INFLIGHT_SHMFD"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  exit 0
fi
# --- end of crash -------------------------------------------------------------------------------
if [ $disk_fault = 1 ]; then
  fdir=$run/fault; mkdir -p "$fdir/tmpfs" "$fdir/fuse"
  faultfs=${FAULTFS:-$(dirname "$testkit")/memvisor-faultfs}
  [ -x "$faultfs" ] || { echo "no memvisor-faultfs at $faultfs: cargo build --release -p memvisor-testkit" >&2; exit 1; }
  cleanup_fault() { cleanup; umount -l "$fdir/fuse" 2>/dev/null || true; umount -l "$fdir/tmpfs" 2>/dev/null || true; }
  trap cleanup_fault EXIT
  # (a) 40 MiB of tmpfs, 16 of them filler: a 64 MiB sparse image gets about 24 MiB, then ENOSPC.
  mount -t tmpfs -o size=40m memvisor-nospc "$fdir/tmpfs"
  dd if=/dev/zero of="$fdir/tmpfs/filler" bs=1M count=16 status=none
  truncate -s 64M "$fdir/tmpfs/disk.img"
  # (b) a 16 MiB FUSE file, EIO on [4 MiB, 4.5 MiB) until the control file says otherwise.
  bad_start=$((4 << 20)); bad_len=$((512 << 10))
  truncate -s 16M "$fdir/eio-backing.img"; echo range > "$fdir/control"
  "$faultfs" "$fdir/fuse" "$fdir/eio-backing.img" "$fdir/control" $bad_start $bad_len > "$run/faultfs.log" 2>&1 &
  fpid=$!; pids+=("$fpid")
  for _ in $(seq 50); do [ -e "$fdir/fuse/disk.img" ] && break; sleep 0.1; done
  [ -e "$fdir/fuse/disk.img" ] || { echo "$name: the FUSE file did not appear"; cat "$run/faultfs.log"; exit 1; }
  hide_env=(); [ $negative = 0 ] || hide_env=(MEMVISOR_TEST_HIDE_IO_ERRORS=1)
  env "${hide_env[@]}" RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$run/nospc.sock" \
    --disk "$fdir/tmpfs/disk.img" --stats "$run/stats-nospc.json" > "$run/backend-nospc.log" 2>&1 &
  b1=$!; pids+=("$b1")
  env "${hide_env[@]}" RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$run/eio.sock" \
    --disk "$fdir/fuse/disk.img" --stats "$run/stats-eio.json" > "$run/backend-eio.log" 2>&1 &
  b2=$!; pids+=("$b2")
  wait_socket "$run/nospc.sock"; wait_socket "$run/eio.sock"
  start=$(date +%s.%N)
  qemu "t=disk-fault nospc_sectors=131072 eio_sectors=32768 bad_start=$bad_start bad_len=$bad_len" \
    -chardev socket,id=c0,path=$run/nospc.sock -device vhost-user-blk-pci,chardev=c0,num-queues=1 \
    -chardev socket,id=c1,path=$run/eio.sock -device vhost-user-blk-pci,chardev=c1,num-queues=1
  # The guest says what it waits for; the host changes the fault.
  done_space=0; done_all=0; done_none=0
  while kill -0 "$qpid" 2>/dev/null; do
    if [ $done_space = 0 ] && grep -a -q "FAULTIO want=space" "$log"; then rm -f "$fdir/tmpfs/filler"; done_space=1; echo "  host: freed 16 MiB of the tmpfs"; fi
    if [ $done_all = 0 ] && grep -a -q "FAULTIO want=all" "$log"; then echo all > "$fdir/control"; done_all=1; echo "  host: the FUSE file fails everything"; fi
    if [ $done_none = 0 ] && grep -a -q "FAULTIO want=none" "$log"; then echo none > "$fdir/control"; done_none=1; echo "  host: the FUSE file healed"; fi
    sleep 0.2
  done
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  end=$(date +%s.%N)
  alive=PASS
  for p in $b1 $b2; do kill -0 "$p" 2>/dev/null || alive="FAIL (back end $p died)"; done
  kill -TERM "$b1" "$b2" 2>/dev/null || true; wait "$b1" 2>/dev/null || true; wait "$b2" 2>/dev/null || true
  # The FUSE server ends with its mount and prints its counts (unless a mount namespace made
  # meanwhile, such as another trial's QEMU, holds a copy of the mount: then cleanup stops it).
  umount -l "$fdir/fuse" 2>/dev/null || true
  for _ in $(seq 20); do kill -0 "$fpid" 2>/dev/null || break; sleep 0.1; done
  { grep -a -E '^(GUEST|FAULTIO)' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  result=$(grep -a '^RESULT disk-fault' "$log" | tail -1 | tr -d '\r' || true)
  guest_failed=$({ grep -a -o 'FAULTIO failed_requests=[0-9]*' "$log" || true; } | tail -1 | cut -d= -f2)
  n_io=$(jget "$run/stats-nospc.json" 's["io_errors"]'); n_failed=$(jget "$run/stats-nospc.json" 's["failed"]')
  e_io=$(jget "$run/stats-eio.json" 's["io_errors"]'); e_failed=$(jget "$run/stats-eio.json" 's["failed"]')
  stats=PASS
  case "$n_io$e_io" in *'?'*) stats="FAIL no stats";; esac
  if [ "$stats" = PASS ]; then
    [ "$n_io" -gt 0 ] && [ "$e_io" -gt 0 ] || stats="FAIL a disk's stats show no I/O error"
    [ "$n_failed" = "$n_io" ] && [ "$e_failed" = "$e_io" ] || stats="FAIL requests failed other than by I/O errors"
    [ "$((n_io + e_io))" = "${guest_failed:-x}" ] || stats="FAIL back ends counted $((n_io + e_io)) I/O errors, the guest saw ${guest_failed:-none} fail"
  fi
  echo "  back ends alive to the end: $alive"
  echo "  stats: nospc failed=$n_failed io_errors=$n_io; eio failed=$e_failed io_errors=$e_io; guest failed_requests=${guest_failed:-none}: $stats"
  echo "  FUSE: $(tail -1 "$run/faultfs.log")"
  pins1=$(pin_check "$run/stats-nospc.json"); pins2=$(pin_check "$run/stats-eio.json")
  echo "  pins nospc: $pins1"; echo "  pins eio: $pins2"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${result:-RESULT disk-fault FAIL no verdict (see $work/$log)}"
  ok=0; case "$result/$alive/$stats/$pins1/$pins2" in *PASS*/PASS/PASS/PASS*/PASS*) ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: I/O errors answered OK went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  exit 0
fi
# --- memlock (blk --memlock, balloon --memlock) -------------------------------------------------
# No host limit on locked memory reaches the guest (issue 45): blk requests hold their pages in
# the pin registry without locking them. The back end runs without CAP_IPC_LOCK under
# RLIMIT_MEMLOCK 1 MiB (soft and hard) while guest/progs/pinload.c runs 96 O_DIRECT writers of up
# to 256 KiB, each write read back and checked; a second back end without a limit serves a second
# disk for the throughput beside it (MEMLOCK_ROUNDS rounds of MEMLOCK_SECS s on each, in turns).
# Checks: every pinload run PASS (no I/O error, no block read wrong, nothing stuck), both images
# hold exactly the generations pinload ended with, the back ends counted no failed request, the
# limited one held more guest pages at once than its limit (else the load proved nothing), its
# registry equals VmLck + VmPin, and its throughput (median of the rounds) is at least half the
# unlimited one's — a bound against a design that stalls, not a speed target.
# balloon --memlock: `serve` with the blk device and a free-page-reporting balloon in the same
# limited process; the guest fills and frees 128 MiB every few seconds and its writers churn their
# buffers. The balloon must have discarded memory, and the data checks must pass.
# --negative (blk): the old behaviour, a locked pin refused past the limit answered IOERR
# (MEMVISOR_TEST_LOCKED_BLK_PINS; a test-hooks build): the trial must FAIL, with I/O errors.
memlock_trial() {
  local limit=$((1 << 20)) secs=${MEMLOCK_SECS:-10} rounds=${MEMLOCK_ROUNDS:-3} writers=96 region=128
  local balloon=0 hook_env=() lim_sectors free_sectors="" vmlck_max=0 v
  [ "$trial" = balloon ] && { balloon=1; secs=${MEMLOCK_SECS:-30}; rounds=1; }
  if [ $negative = 1 ]; then
    need_hooks MEMVISOR_TEST_LOCKED_BLK_PINS; hook_env=(MEMVISOR_TEST_LOCKED_BLK_PINS=1); rounds=1
  fi
  # Images: the writers' regions, plus 1 MiB (limited) or 2 MiB (unlimited) to tell them apart.
  local bytes=$((writers * region * 4096))
  truncate -s 0 "$run/lim.img"; truncate -s $((bytes + (1 << 20))) "$run/lim.img"; lim_sectors=$(((bytes + (1 << 20)) / 512))
  # Root without CAP_IPC_LOCK: the kernel holds the back end's mlocks to its RLIMIT_MEMLOCK.
  local what=(vhost-user-blk --socket "$run/lim.sock" --disk "$run/lim.img" --stats "$run/stats-lim.json")
  [ $balloon = 0 ] || what=(serve --blk "socket=$run/lim.sock,disk=$run/lim.img" --balloon "$run/balloon.sock,reporting=on" --stats "$run/stats-lim.json")
  prlimit --memlock=$limit:$limit setpriv --inh-caps=-ipc_lock --bounding-set=-ipc_lock -- \
    env "${hook_env[@]}" RUST_LOG=${RUST_LOG:-info} "$bin" "${what[@]}" > "$run/backend-lim.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  local devs=(-chardev socket,id=c0,path=$run/lim.sock -device vhost-user-blk-pci,chardev=c0,num-queues=1)
  if [ $balloon = 1 ]; then
    wait_socket "$run/balloon.sock"
    devs+=(-chardev socket,id=c1,path=$run/balloon.sock -device vhost-user-test-device-pci,chardev=c1,virtio-id=5,num_vqs=3,config_size=16)
  elif [ $negative = 0 ]; then
    truncate -s 0 "$run/free.img"; truncate -s $((bytes + (2 << 20))) "$run/free.img"; free_sectors=$(((bytes + (2 << 20)) / 512))
    RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$run/free.sock" --disk "$run/free.img" \
      --stats "$run/stats-free.json" > "$run/backend-free.log" 2>&1 &
    fpid=$!; pids+=("$fpid")
    wait_socket "$run/free.sock"
    devs+=(-chardev socket,id=c1,path=$run/free.sock -device vhost-user-blk-pci,chardev=c1,num-queues=1)
  fi
  wait_socket "$run/lim.sock"
  echo "  limited back end $bpid: $(grep CapEff /proc/$bpid/status | tr -s '\t' ' '), RLIMIT_MEMLOCK $(prlimit --pid $bpid --memlock -o SOFT,HARD --noheadings | tr -s ' ')"
  echo "  $(grep -a -o 'blk: requests hold.*' "$run/backend-lim.log" | head -1)"
  # A bound on the whole run: boot, the rounds, the final checks.
  local start; start=$(date +%s.%N)
  TIMEOUT=${TIMEOUT:-$((rounds * 2 * (secs + 30) + 120))} qemu "t=memlock pl_writers=$writers pl_secs=$secs pl_rounds=$rounds pl_balloon=$balloon lim_sectors=$lim_sectors${free_sectors:+ free_sectors=$free_sectors}" "${devs[@]}"
  while kill -0 "$qpid" 2>/dev/null; do
    v=$(awk '/VmLck/{print $2}' /proc/$bpid/status 2>/dev/null || echo 0); [ "${v:-0}" -le "$vmlck_max" ] || vmlck_max=$v
    sleep 0.2
  done
  local qrc=0; wait "$qpid" || qrc=$?
  local end; end=$(date +%s.%N)
  local alive=PASS; kill -0 "$bpid" 2>/dev/null || alive="FAIL (the limited back end died)"
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  if [ -n "$free_sectors" ]; then kill -TERM "$fpid" 2>/dev/null; wait "$fpid" 2>/dev/null || true; fi
  { grep -a -E '^(GUEST|PINLOAD)' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  [ $qrc = 0 ] || echo "  QEMU exited with $qrc (timeout: a hang?)"
  local pins="PASS (not checked)"; [ $balloon = 1 ] || pins=$(pin_check "$run/stats-lim.json")
  python3 - "$log" "$run" "$limit" "$rounds" "$balloon" "$negative" "$qrc" "$vmlck_max" > "$run/verdict" <<'PY'
import json, re, struct, sys, statistics
log, run, limit, rounds, balloon, negative, qrc, vmlck_kib = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
text = open(log, errors="replace").read().replace("\r", "")
runs = [dict(re.findall(r"(\w+)=(\S+)", l)) for l in re.findall(r"^PINLOAD dev=.*$", text, re.M)]
results = re.findall(r"^RESULT pinload (\w+) dev=(\S+)", text, re.M)
digests = {d: (dg, int(n)) for dg, n, d in re.findall(r"^PINLOAD digest=(\w+) blocks=(\d+) dev=(\S+)$", text, re.M)}
m = re.search(r"limited disk ([^,\s]+), unlimited disk ([^;\s]+)", text)
lim_dev, free_dev = (m.group(1), m.group(2)) if m else ("?", "?")
fails = []
M, G, MAGIC = (1 << 64) - 1, 0x9e3779b97f4a7c15, 0x50494e4c4f414421
def mix(x):
    x = (x + G) & M
    x = ((x ^ (x >> 30)) * 0xbf58476d1ce4e5b9) & M
    x = ((x ^ (x >> 27)) * 0x94d049bb133111eb) & M
    return x ^ (x >> 31)
def image_check(path, dev):
    # Every block zeros (never written) or a whole pinload block; generations as pinload ended.
    if dev not in digests:
        return f"FAIL no digest from pinload for {dev}"
    want, n = int(digests[dev][0], 16), digests[dev][1]
    img, zero, bad, digest, written = open(path, "rb").read(), bytes(4096), [], 0, 0
    for b in range(n):
        raw = img[b * 4096:(b + 1) * 4096]
        g = 0 if raw == zero else struct.unpack_from("<Q", raw, 16)[0]
        if g:
            x = mix(((b << 32) ^ g) & M)
            if raw != struct.pack("<512Q", MAGIC, b, g, mix(MAGIC ^ mix(b) ^ ((g << 1) & M)), *[(x + k * G) & M for k in range(508)]):
                bad.append(b)
            written += 1
        digest = (digest + mix(((b << 32) ^ g) & M)) & M
    if bad: return f"FAIL {len(bad)} of {n} blocks are not whole pinload blocks, first {bad[:4]}"
    if digest != want: return f"FAIL generations differ from pinload's (digest {digest:016x}, want {want:016x})"
    return f"PASS {n} blocks ({written} written) as pinload ended"
def stats(name):
    try:
        s = json.load(open(f"{run}/stats-{name}.json"))
    except Exception as e:
        return None
    return s["blk"][0] if "blk" in s else s
def side(dev, name, image):
    rs = [r for r in runs if r.get("dev") == dev]
    # The warm-up run (the first, 3 s) counts for errors and data, not for throughput.
    mibps = [float(r["mibps"]) for r in rs[1:]]
    errs = sum(int(r["ioerrors"]) for r in rs); bad = sum(int(r["bad"]) + int(r["landed"]) for r in rs)
    verified = sum(int(r["verified"]) for r in rs)
    passed = sum(1 for v, d in results if d == dev and v == "PASS")
    s = stats(name) or {}
    img = image_check(f"{run}/{image}", dev)
    print(f"  {name} ({dev}): {len(rs)} runs, {passed} PASS; I/O errors {errs}, blocks read wrong {bad}, "
          f"blocks verified {verified}; MiB/s per round {mibps} (median {statistics.median(mibps) if mibps else 0:.2f})")
    print(f"  {name} back end: requests failed {s.get('failed', '?')} (pin errors {s.get('pin_errors', '?')}), "
          f"writes {s.get('writes', '?')}, most requests in flight {s.get('most_in_flight', '?')}, "
          f"most guest pages held at once {s.get('most_pinned_pages', '?')} ({s.get('most_pinned_pages', 0) * 4} KiB)")
    print(f"  {name} image: {img}")
    if len(rs) != rounds + 1 or passed != rounds + 1: fails.append(f"{name}: {passed} of {rounds + 1} pinload runs passed")
    if errs: fails.append(f"{name}: {errs} I/O errors")
    if bad: fails.append(f"{name}: {bad} blocks read wrong")
    if not img.startswith("PASS"): fails.append(f"{name}: image")
    if s.get("failed") != 0: fails.append(f"{name}: the back end failed {s.get('failed', '?')} requests")
    return mibps, s
if "stuck" in text: fails.append("a request never completed (pinload stuck)")
if qrc: fails.append(f"QEMU ended with {qrc} (timeout)")
lim_mibps, ls = side(lim_dev, "lim", "lim.img")
held = ls.get("most_pinned_pages", 0) * 4096
print(f"  limited back end: RLIMIT_MEMLOCK {limit >> 10} KiB; VmLck at most {vmlck_kib} KiB while serving; "
      f"guest pages held at once up to {held >> 10} KiB")
if not negative and held <= limit: fails.append(f"the load never held more than the limit ({held} bytes): it proves nothing")
if balloon:
    try:
        b = json.load(open(f"{run}/stats-lim.json"))["balloon"][0]
    except Exception:
        b = {}
    print(f"  balloon: discarded {b.get('discarded', 0) >> 20} MiB in {b.get('chains', '?')} reports, "
          f"skipped as held {b.get('skipped_pinned', '?')} bytes; guest: {' '.join(re.findall(r'filled and freed .* times', text)) or 'no fill count'}")
    if b.get("discarded", 0) < 64 << 20: fails.append("the balloon discarded less than 64 MiB")
elif not negative:
    free_mibps, _ = side(free_dev, "free", "free.img")
    # Each round's two runs are next to each other in time: their ratio is the least
    # disturbed by the shared machine's load; the verdict takes the median of those.
    ratios = [l / f for l, f in zip(lim_mibps, free_mibps) if f > 0]
    ratio = statistics.median(ratios) if ratios else 0
    med = lambda v: statistics.median(v) if v else 0
    print(f"  throughput: limited median {med(lim_mibps):.2f} MiB/s, unlimited median {med(free_mibps):.2f} MiB/s; "
          f"limited/unlimited per round {[round(r, 2) for r in ratios]}, median {ratio:.2f}")
    if ratio < 0.5: fails.append(f"the limited back end ran at {ratio:.2f} of the unlimited one's throughput")
print("VERDICT " + ("PASS" if not fails else "FAIL " + "; ".join(fails)))
PY
  grep -v '^VERDICT' "$run/verdict"
  local verdict; verdict=$(grep '^VERDICT' "$run/verdict" || echo "VERDICT FAIL no verdict")
  echo "  limited back end alive to the end: $alive; panics in its log: $(grep -c -i panic "$run/backend-lim.log" || true)"
  echo "  pins (registry == VmLck + VmPin): $pins"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${verdict#VERDICT }"
  local ok=0; case "$verdict/$alive/$pins" in "VERDICT PASS"/PASS/PASS*) ok=1;; esac
  grep -q -i panic "$run/backend-lim.log" && ok=0
  if [ $negative = 1 ]; then
    local pe; pe=$(jget "$run/stats-lim.json" 's["pin_errors"]')
    grep -a -q "TEST ONLY" "$run/backend-lim.log" || { echo "$name: the back end logged no test hook"; return 1; }
    if [ $ok = 0 ] && [ "$pe" != "?" ] && [ "$pe" -gt 0 ]; then echo "$name: the trial failed as it must ($pe pins refused, answered IOERR)"; return 0; fi
    echo "$name: refused pins answered IOERR went unnoticed (pin errors: $pe)"; return 1
  fi
  [ $ok = 1 ]
}
if [ $memlock = 1 ]; then
  case $trial in blk|balloon) ;; *) echo "--memlock goes with blk or balloon" >&2; exit 2;; esac
  [ $trial = blk ] || [ $negative = 0 ] || { echo "balloon --memlock has no --negative (blk --memlock --negative is the control)" >&2; exit 2; }
  memlock_trial; exit $?
fi
# --- end of memlock -----------------------------------------------------------------------------

# --- blk --loop ---------------------------------------------------------------------------------
# A block device as the disk (issue 45): a loop device over an image; see the usage at the top.
blk_loop_trial() {
  local bytes=$((64 << 20)) mib=32 off=$((48 << 20)) len=$((1 << 20)) wait_s=1 sock=$run/blk.sock
  truncate -s 0 "$run/disk.img"; truncate -s $bytes "$run/disk.img"
  loopdev=$(losetup --find --show --sector-size $loop_sector "$run/disk.img" 2> "$run/losetup.err") || {
    echo "SKIPPED real-guest trial $name: no loop device ($(cat "$run/losetup.err"))"; exit 0; }
  # Detached at the end whatever happens, after the back end is gone.
  trap 'cleanup; losetup -d "$loopdev" 2>/dev/null || true' EXIT
  local q=/sys/block/${loopdev#/dev/}/queue
  echo "  disk: $loopdev over $run/disk.img ($bytes bytes); the host's view: $(blockdev --getsize64 "$loopdev") bytes, logical block $(cat $q/logical_block_size), discard_max_bytes $(cat $q/discard_max_bytes), write_zeroes_max_bytes $(cat $q/write_zeroes_max_bytes)"
  RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$sock" --disk "$loopdev" --stats "$run/stats.json" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$sock"
  [ $negative = 0 ] || wait_s=4
  start=$(date +%s.%N)
  qemu "t=blk,blkdisc blk_mib=$mib blk_wait=1 blk_random=300 blk_serial=$(path_serial "$loopdev") blk_sectors=$((bytes / 512)) blk_logical=$loop_sector disc_off=$off disc_len=$len disc_wait=$wait_s" \
    -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1
  if [ $negative = 1 ]; then
    # Once the guest has discarded (and waits), write into the range under it.
    for _ in $(seq 3000); do grep -q -a 'BLKDISC discarded' "$log" 2>/dev/null && break; kill -0 "$qpid" 2>/dev/null || break; sleep 0.1; done
    dd if=/dev/urandom of="$loopdev" bs=4k seek=$((off / 4096 + 16)) count=4 oflag=direct conv=notrunc status=none
    echo "negative control: wrote 16 KiB of random data at byte $((off + 65536)), inside the range the guest discarded, through $loopdev"
  fi
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  end=$(date +%s.%N)
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  blockdev --flushbufs "$loopdev" 2>/dev/null || true
  { grep -a -E '^(GUEST|BLKDISC)' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  local bres dres want have host disc
  bres=$(grep -a '^RESULT blk ' "$log" | tail -1 | tr -d '\r' || true)
  dres=$(grep -a '^RESULT blkdisc' "$log" | tail -1 | tr -d '\r' || true)
  want=$(grep -a 'PATTERN sha256=' "$log" | sed 's/.*sha256=\([0-9a-f]*\).*/\1/' | tr -d '\r' || true)
  have=$(head -c $((mib << 20)) "$run/disk.img" | sha256sum | cut -d' ' -f1)
  host=FAIL; [ -z "$want" ] || [ "$want" != "$have" ] || host=PASS
  echo "  host image check, pattern: $host (guest pattern ${want:-none}, image $have)"
  # The discarded range: zeros in the image, and a hole (the loop driver punched it).
  disc=$(python3 - "$run/disk.img" $off $len <<'PY'
import os, sys
path, off, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "rb") as f:
    f.seek(off); b = f.read(n)
bad = sum(1 for x in b if x)
fd = os.open(path, os.O_RDONLY)
try:
    data = os.lseek(fd, off, os.SEEK_DATA)
except OSError:
    data = os.fstat(fd).st_size
hole = data >= off + n
print(("PASS" if bad == 0 and hole else "FAIL") + f" {n - bad} of {n} bytes zero, " + ("a hole" if hole else f"data at byte {data}"))
PY
)
  echo "  host image check, discarded range at $off: $disc"
  # The guest's discard reached the back end as a DISCARD request, and nothing failed there.
  local backend
  backend=$(python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(("PASS" if s["discards"] >= 1 and s["failed"] == 0 else "FAIL"), "reads=%(reads)d writes=%(writes)d bytes_read=%(bytes_read)d bytes_written=%(bytes_written)d discards=%(discards)d write_zeroes=%(write_zeroes)d failed=%(failed)d io_errors=%(io_errors)d" % s)' "$run/stats.json" 2>/dev/null || echo "FAIL no back end stats")
  echo "  back end: $backend"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${bres:-RESULT blk FAIL no verdict}; ${dres:-RESULT blkdisc FAIL no verdict (see $work/$log)}"
  local ok=0; case "$bres/$dres/$host/$disc/$backend" in *PASS*/*PASS*/PASS/PASS*/PASS*) ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: data written into the discarded range went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  exit 0
}
if [ "$trial" = blk ] && [ $loop = 1 ]; then blk_loop_trial; fi

# --- blk --fixed --------------------------------------------------------------------------------
# The blk trial against `serve --blk ...,fixed-buffers=on`; see the usage at the top. With
# --negative the back end never uses registered buffers (test-hooks build): the fixed check must
# then fail.
blk_fixed_trial() {
  # serve names the device blk0, the serial GET_ID answers with when none is given.
  local mib=32 sock=$run/blk.sock hook_env=()
  if [ $negative = 1 ]; then need_hooks MEMVISOR_TEST_NO_FIXED; hook_env=(MEMVISOR_TEST_NO_FIXED=1); fi
  truncate -s 0 "$run/disk.img"; truncate -s 64M "$run/disk.img"
  env ${hook_env[@]+"${hook_env[@]}"} RUST_LOG=${RUST_LOG:-info} "$bin" serve --blk "socket=$sock,disk=$run/disk.img,direct=on,fixed-buffers=on" \
    --stats "$run/stats.json" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$sock"
  start=$(date +%s.%N)
  qemu "t=blk blk_mib=$mib blk_wait=1 blk_random=300 blk_serial=blk0" \
    -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1
  # What registration holds, sampled until QEMU ends: the back end's pinned and resident memory.
  local vmpin=0 rss=0 p r
  while kill -0 "$qpid" 2>/dev/null; do
    p=$(awk '/^VmPin:/ { print $2 }' /proc/$bpid/status 2>/dev/null || echo 0); [ "${p:-0}" -le "$vmpin" ] || vmpin=$p
    r=$(awk '/^VmRSS:/ { print $2 }' /proc/$bpid/status 2>/dev/null || echo 0); [ "${r:-0}" -le "$rss" ] || rss=$r
    sleep 0.5
  done
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  end=$(date +%s.%N)
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  { grep -a '^GUEST' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  echo "  back end at most: VmPin $vmpin kB, VmRSS $rss kB"
  local result want have host fixedck
  result=$(grep -a '^RESULT blk' "$log" | tail -1 | tr -d '\r' || true)
  want=$(grep -a 'PATTERN sha256=' "$log" | sed 's/.*sha256=\([0-9a-f]*\).*/\1/' | tr -d '\r' || true)
  have=$(head -c $((mib << 20)) "$run/disk.img" | sha256sum | cut -d' ' -f1)
  host=FAIL; [ -z "$want" ] || [ "$want" != "$have" ] || host=PASS
  echo "  host image check: $host (guest pattern ${want:-none}, image $have)"
  fixedck=$(python3 -c 'import json,sys
s = json.load(open(sys.argv[1])); s = s["blk"][0] if "blk" in s else s
ok = s["fixed"] > 0 and s["chunks_registered"] > 0 and s["fixed_fallbacks"] == 0 and s["failed"] == 0 and s["holds"] < s["fixed"]
print(("PASS" if ok else "FAIL"), "reads=%(reads)d writes=%(writes)d fixed=%(fixed)d holds=%(holds)d fixed_ordinary=%(fixed_ordinary)d fixed_fallbacks=%(fixed_fallbacks)d chunks_registered=%(chunks_registered)d register_ns=%(register_ns)d failed=%(failed)d" % s)' "$run/stats.json" 2>/dev/null || echo "FAIL no back end stats")
  echo "  registered buffers: $fixedck"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${result:-RESULT blk FAIL no verdict (see $work/$log)}"
  local ok=0; case "$result/$host/$fixedck" in *PASS*/PASS/PASS*) ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: the fixed check passed with registered buffers turned off"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  exit 0
}
if [ "$trial" = blk ] && [ $fixed = 1 ]; then blk_fixed_trial; fi

# --- balloon --fixed ----------------------------------------------------------------------------
# The balloon trial with the blk device's registered buffers on (fixed-buffers=on) and, after
# the balloon's steps, guest/progs/fixreuse.c: rounds of O_DIRECT reads into fresh buffers that
# land on memory the guest freed and reported a round before (the balloon in the same process
# discarded it), every block checked. Called from the balloon case with its verdict in $ok; adds
# its own: the guest's checks, registered transfers and chunks, memory discarded, and chunks the
# discard gate evicted. With --negative (MEMVISOR_TEST_FIXED_NO_EVICT) the gate evicts nothing,
# discarded pages stay behind registered chunks, and fixed reads land where the guest no longer
# looks: the trial passes only if the guest found bad blocks.
balloon_fixed_check() {
  local fres fbad ck end
  end=$(date +%s.%N)
  fres=$(grep -a '^RESULT fixreuse' "$log" | tail -1 | tr -d '\r' || true)
  { grep -a '^FIXREUSE' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  echo "$name: ${fres:-RESULT fixreuse FAIL no verdict}"
  fbad=$(echo "$fres" | sed -n 's/.* bad=\([0-9]*\).*/\1/p')
  ck=$(python3 -c 'import json,sys
s = json.load(open(sys.argv[1])); k = s["blk"][0]; b = s["balloon"][0]
ok = k["fixed"] > 0 and k["chunks_registered"] > 0 and k["evictions"] > 0 and b.get("discarded", 0) > 0
print(("PASS" if ok else "FAIL"), "fixed=%d fixed_ordinary=%d fixed_fallbacks=%d chunks_registered=%d evictions=%d evict_busy=%d" % (k["fixed"], k["fixed_ordinary"], k["fixed_fallbacks"], k["chunks_registered"], k["evictions"], k["evict_busy"]), "discarded_mib=%d" % (b.get("discarded", 0) >> 20))' "$run/stats.json" 2>/dev/null || echo "FAIL no back end stats")
  echo "  registered buffers and discards (want fixed, chunks_registered, evictions, discarded > 0): $ck"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  case "$fres" in *PASS*) ;; *) ok=0;; esac
  case "$ck" in PASS*) ;; *) ok=0;; esac
  if [ $negative = 1 ]; then
    if [ "${fbad:-0}" -gt 0 ]; then echo "$name: the trial failed as it must: $fbad blocks read wrong"; exit 0; fi
    echo "$name: no block read wrong with the discard gate's eviction off (ok=$ok)"; exit 1
  fi
}

case $trial in
blk)
  mib=32
  truncate -s 0 "$run/disk.img"; truncate -s 64M "$run/disk.img"
  sock=$run/blk.sock
  if [ $peer = 1 ]; then
    BIN=qemu-storage-daemon "$top/guest/qemu.sh" root --blockdev driver=file,node-name=file,filename=$run/disk.img,cache.direct=off \
      --blockdev driver=raw,node-name=disk,file=file \
      --export type=vhost-user-blk,id=exp,node-name=disk,addr.type=unix,addr.path=$sock,writable=on > "$run/backend.log" 2>&1 &
  else
    if [ $qcap = 1 ]; then need_hooks MEMVISOR_TEST_MAX_QUEUE_SIZE; export MEMVISOR_TEST_MAX_QUEUE_SIZE=256; fi
    RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$sock" --disk "$run/disk.img" --stats "$run/stats.json" --queues "$queues" \
      $([ -n "$iommu" ] && echo --iommu) $([ -n "$iommu" ] && can_record vhost-user-blk --record-iotlb && echo --record-iotlb "$run/iotlb.rec") $([ $long_term = 1 ] && echo --long-term-pins) > "$run/backend.log" 2>&1 &
  fi
  bpid=$!; pids+=("$bpid")
  wait_socket "$sock"
  if [ $frontend_dies = 1 ]; then frontend_dies_blk; fi  # exits
  if [ $fuzz = 1 ]; then
    need_testkit
    "$testkit" vhost-user-fuzz --socket "$sock" --seconds 15 --seed "${SEED:-$RANDOM}" | sed 's/^/  /'
    kill -0 "$bpid" 2>/dev/null || { echo "$name: the back end died under the hostile frontend"; tail "$run/backend.log"; exit 1; }
  fi
  serial=$(path_serial "$run/disk.img"); wait_s=1; [ $peer = 0 ] || serial=none; [ $negative = 0 ] || wait_s=4
  # With --queue-size: the ring size QEMU gives the device.
  qdev=""; [ -z "$qsize" ] || qdev=",queue-size=$qsize"
  start=$(date +%s.%N)
  if [ -n "$iommu" ]; then
    strict=1; [ "$iommu" = strict ] || strict=0
    qemu "t=blk blk_mib=$mib blk_wait=$wait_s blk_random=300 blk_serial=$serial intel_iommu=on iommu.strict=$strict" \
      -device intel-iommu,intremap=on,device-iotlb=on \
      -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1,iommu_platform=on,ats=on,disable-legacy=on$qdev
  else
    qemu "t=blk blk_mib=$mib blk_wait=$wait_s blk_random=300 blk_serial=$serial" \
      -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=$queues$qdev
  fi
  if [ -n "$qsize" ]; then
    # A disk that never answers must fail the trial, not hang it: the guest's kernel reads the
    # disk (its partition table) before /init says what it found; no such line within 60 s of
    # QEMU's start, and QEMU is stopped.
    ( for _ in $(seq 600); do
        grep -a -q 'GUEST.*disk /dev/vda' "$log" 2>/dev/null && exit 0
        kill -0 "$qpid" 2>/dev/null || exit 0
        sleep 0.1
      done
      echo "watchdog: no answer from the guest's disk 60 s after QEMU started; QEMU stopped" > "$run/watchdog"
      kill -TERM "$qpid" 2>/dev/null ) &
    pids+=("$!")
  fi
  if [ $negative = 1 ]; then
    # Wait for the guest to finish writing, then change three 4 KiB blocks of the image.
    for _ in $(seq 600); do grep -q WRITTEN "$log" 2>/dev/null && break; sleep 0.1; done
    for blk in 7 2049 6000; do dd if=/dev/urandom of="$run/disk.img" bs=4k seek=$blk count=1 conv=notrunc status=none; done
    echo "negative control: changed 4 KiB blocks 7, 2049, 6000 of the image after the guest wrote it"
  fi
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  end=$(date +%s.%N)
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  grep '^GUEST' "$log" | sed 's/^/  /' || true
  [ ! -f "$run/watchdog" ] || sed 's/^/  /' "$run/watchdog"
  result=$(grep -a '^RESULT blk' "$log" | tail -1 | tr -d '\r' || true)
  want=$(grep -a 'PATTERN sha256=' "$log" | sed 's/.*sha256=\([0-9a-f]*\).*/\1/' | tr -d '\r' || true)
  have=$(head -c $((mib << 20)) "$run/disk.img" | sha256sum | cut -d' ' -f1)
  host=FAIL; [ -z "$want" ] || [ "$want" != "$have" ] || host=PASS
  echo "  host image check: $host (guest pattern ${want:-none}, image $have)"
  [ -f "$run/stats.json" ] && echo "  back end: $(tr -d ' \n' < "$run/stats.json")"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${result:-RESULT blk FAIL no verdict (see $work/$log)}"
  ok=0; case "$result" in *PASS*) [ $host = PASS ] && ok=1;; esac
  if [ -n "$iommu" ] && [ $ok = 1 ]; then
    # Behind the vIOMMU the guest must have used indirect tables, each read through the IOTLB.
    ind=$(tr -d ' \n' < "$run/stats.json" 2>/dev/null | grep -o '"indirect":[0-9]*' | cut -d: -f2)
    echo "  indirect descriptor chains served behind the vIOMMU: ${ind:-none}"
    [ "${ind:-0}" -gt 0 ] || { echo "$name: no indirect descriptor chain was served"; ok=0; }
  fi
  [ $long_term = 0 ] || check_long_term
  if [ -n "$qsize" ] && [ $peer = 0 ]; then
    # The guest's ring was the size asked for (the firmware's, before it, may be smaller: a
    # driver may lower a queue's size). A refusal, if any, is in the back end's log.
    sized=$(grep -a -c "ring 0 started: $qsize entries" "$run/backend.log" || true)
    echo "  rings of $qsize entries started: ${sized:-0}"
    grep -a -E "WARN .*(refused|closing the connection|connection ended)" "$run/backend.log" | head -3 | sed 's/^/  back end: /' || true
    [ "${sized:-0}" -gt 0 ] || { echo "$name: no ring of $qsize entries was started"; ok=0; }
  fi
  if [ $qcap = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: rings of $qsize were served although the back end takes at most 256"; exit 1
  fi
  if [ $queues -gt 1 ] && [ $ok = 1 ]; then
    # The guest's vCPUs submit on their own queues: rings past the first are served by worker
    # threads of their own.
    wk=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["worker_kicks"])' "$run/stats.json" 2>/dev/null || true)
    echo "  kicks served on worker threads (rings past the first): ${wk:-none}"
    [ "${wk:-0}" -gt 0 ] || { echo "$name: no ring was served by a worker thread"; ok=0; }
  fi
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: the corrupted image went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
balloon)
  if [ $balloon_stats = 1 ]; then balloon_stats_trial; exit $?; fi
  truncate -s 64M "$run/disk.img"
  # --fixed: registered buffers on, and the guest's fixreuse step after the balloon's (see
  # balloon_fixed_check); its --negative keeps reporting on and turns the eviction off.
  blkopt=""; reporting=on; hook_env=(); fx=""
  [ $negative = 0 ] || reporting=off
  if [ $fixed = 1 ]; then
    blkopt=,fixed-buffers=on; reporting=on; fx=",fixreuse fx_off=32 fx_pat=16 fx_buf=${FIX_BUF_MIB:-320} fx_rounds=${FIX_ROUNDS:-4} fx_wait=5"
    if [ $negative = 1 ]; then need_hooks MEMVISOR_TEST_FIXED_NO_EVICT; hook_env=(MEMVISOR_TEST_FIXED_NO_EVICT=1); fi
  fi
  env ${hook_env[@]+"${hook_env[@]}"} "$bin" serve --blk "socket=$run/blk.sock,disk=$run/disk.img$blkopt" --balloon "$run/balloon.sock,reporting=$reporting" \
    --control "$run/control.sock" --stats "$run/stats.json" $([ $long_term = 1 ] && echo --long-term-pins) \
    > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$run/blk.sock"; wait_socket "$run/balloon.sock"; wait_socket "$run/control.sock"
  control() { "$bin" ctl --control "$run/control.sock" balloon-set-target target-mib="$1" | tr -d ' \n'; }
  start=$(date +%s.%N)
  qemu "t=balloon,blk$fx bal_mib=512 bal_wait=15 bal_target=256 blk_mib=16 blk_random=50 blk_serial=blk0" \
    -chardev socket,id=c0,path=$run/blk.sock -device vhost-user-blk-pci,chardev=c0,num-queues=1 \
    -chardev socket,id=c1,path=$run/balloon.sock -device vhost-user-test-device-pci,chardev=c1,virtio-id=5,num_vqs=3,config_size=16
  # Sample the guest memory's allocated bytes: QEMU's memfd, through /proc; the phase column
  # says what the host had asked for by then (fill-and-report, inflate, deflate).
  echo report > "$run/phase"
  ( t0=$(date +%s.%N); qp=""
    while kill -0 "$qpid" 2>/dev/null; do
      # QEMU is timeout's child once the wrapper (guest/qemu.sh) has exec'd into it; its forks
      # (mount) carry the same command line, and another trial's QEMU may be running too.
      [ -n "$qp" ] || qp=$(pgrep -P "$qpid" -f '^qemu-system-x86_64 ' || true)
      if [ -n "$qp" ]; then
        for f in /proc/$qp/fd/*; do
          case $(readlink "$f" 2>/dev/null) in /memfd:*) echo "$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'),$(( $(stat -L -c %b "$f" 2>/dev/null || echo 0) * 512 )),$(cat "$run/phase")"; break;; esac
        done
      fi
      sleep 0.5
    done > "$run/memory.csv" ) &
  spid=$!
  answered=""
  while kill -0 "$qpid" 2>/dev/null; do
    if [ -z "$answered" ] && grep -q "INFLATE please" "$log" 2>/dev/null; then echo inflate > "$run/phase"; echo "  control: $(control 256)"; answered=i; fi
    if [ "$answered" = i ] && grep -q "DEFLATE please" "$log" 2>/dev/null; then echo deflate > "$run/phase"; echo "  control: $(control 0)"; answered=d; fi
    sleep 0.2
  done
  wait "$qpid" || true; wait "$spid" || true
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  grep -a '^GUEST' "$log" | sed 's/^/  /'
  # Allocated guest memory at FILLED (peak) and its lowest before the inflation starts.
  peak=$(awk -F, '$3=="report"' "$run/memory.csv" | sort -t, -k2 -n | tail -1 | cut -d, -f2); peak=${peak:-0}
  low=$(awk -F, -v p="$peak" 'BEGIN{seen=0; low=p} $3!="report"{exit} $2==p{seen=1} seen && $2<low{low=$2} END{print low}' "$run/memory.csv")
  inflated=$(awk -F, '$3=="inflate"{print $2}' "$run/memory.csv" | sort -n | head -1)
  echo "  balloon: lowest during inflation $(( ${inflated:-0} >> 20 )) MiB, at the end $(( $(tail -1 "$run/memory.csv" | cut -d, -f2) >> 20 )) MiB"
  freed=$((512 << 20)); dropped=$((peak - low))
  echo "  guest memory (memfd allocated): peak $((peak >> 20)) MiB, lowest after it $((low >> 20)) MiB: $((dropped >> 20)) MiB of $((freed >> 20)) MiB freed went back ($((dropped * 100 / freed))%)"
  echo "  samples: $run/memory.csv ($(wc -l < "$run/memory.csv") points)"
  [ -f "$run/stats.json" ] && echo "  back end: $(tr -d ' \n' < "$run/stats.json")"
  bres=$(grep -a '^RESULT balloon' "$log" | tail -1 | tr -d '\r' || true); kres=$(grep -a '^RESULT blk' "$log" | tail -1 | tr -d '\r' || true)
  echo "$name: ${bres:-RESULT balloon FAIL no verdict}; ${kres:-RESULT blk FAIL no verdict}; memory $([ $dropped -ge $((freed * 8 / 10)) ] && echo PASS || echo FAIL)"
  ok=1
  case "$bres" in *PASS*) ;; *) ok=0;; esac
  case "$kres" in *PASS*) ;; *) ok=0;; esac
  [ $dropped -ge $((freed * 8 / 10)) ] || ok=0
  # The blk device's pins were held long-term, and none outlived the devices.
  [ $long_term = 0 ] || check_long_term
  [ $fixed = 0 ] || balloon_fixed_check
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: memory came back without free page reporting"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
mig)
  chunks=512; secs=45   # 128 MiB the device writes, passes for 45 s of guest time, a final check
  truncate -s 0 "$run/disk.img"; truncate -s 256M "$run/disk.img"
  sock=$run/blk.sock
  nolog_env=(); [ $negative = 0 ] || { need_hooks MEMVISOR_TEST_NO_DIRTY_LOG; nolog_env=(MEMVISOR_TEST_NO_DIRTY_LOG=1); }
  # --no-summary: the log is on, but marks never reach the summary levels the drains read.
  [ "${no_summary:-0}" = 0 ] || { need_hooks MEMVISOR_TEST_NO_DIRTY_SUMMARY; nolog_env=(MEMVISOR_TEST_NO_DIRTY_SUMMARY=1); }
  env "${nolog_env[@]}" "$bin" vhost-user-blk --socket "$sock" --disk "$run/disk.img" --stats "$run/stats.json" \
    $([ -n "$iommu" ] && echo --iommu) $([ -n "$iommu" ] && can_record vhost-user-blk --record-iotlb && echo --record-iotlb "$run/iotlb.rec") > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$sock"
  hmp() { python3 - "$run/mon-$1.sock" "$2" <<'PY'
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.settimeout(10)
def until_prompt():
    b = b""
    while not b.endswith(b"(qemu) "):
        more = s.recv(65536)
        if not more:  # QEMU closed the monitor (quit)
            break
        b += more
    return b.decode(errors="replace")
until_prompt(); s.sendall((sys.argv[2] + "\n").encode()); print(until_prompt().replace("(qemu) ", "").strip())
PY
  }
  args=(-chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1)
  cmdline="t=mig mig_chunks=$chunks mig_secs=$secs"
  if [ -n "$iommu" ]; then
    # Both QEMUs get the same vIOMMU; the IOTLB state migrates with the guest and the back end
    # starts over with an empty IOTLB on the destination (it asks with MISS).
    strict=1; [ "$iommu" = strict ] || strict=0
    args=(-device intel-iommu,intremap=on,device-iotlb=on
      -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1,iommu_platform=on,ats=on,disable-legacy=on)
    cmdline="$cmdline intel_iommu=on iommu.strict=$strict"
  fi
  qemu "$cmdline" "${args[@]}" -monitor unix:$run/mon-src.sock,server=on,wait=off
  src=$qpid
  for _ in $(seq 1200); do grep -q "MIGWRITE started" "$log" 2>/dev/null && break; sleep 0.1; done
  if [ $frontend_dies = 1 ]; then frontend_dies_mig; fi  # exits
  sleep 3
  echo "  source: $(grep -a 'MIGWRITE' "$log" | tail -1 | tr -d '\r')"
  # Fast enough to converge while the device keeps writing ~150 MB/s (QEMU's default cap is
  # 128 MiB/s, which this writer outruns forever).
  hmp src "migrate_set_parameter max-bandwidth 4G" >/dev/null
  hmp src "migrate_set_parameter downtime-limit 500" >/dev/null
  t0=$(date +%s.%N)
  hmp src "migrate -d \"exec:cat > $run/mig.state\"" >/dev/null
  status=""
  for _ in $(seq 1200); do
    status=$(hmp src "info migrate" 2>/dev/null | tr -d '\r' | grep -i -m1 'status:' || true)
    [ -n "$status" ] || kill -0 "$src" 2>/dev/null || { status="source QEMU gone"; break; }
    case $status in *completed*|*failed*|*cancelled*) break;; esac
    sleep 0.2
  done
  t1=$(date +%s.%N)
  echo "  migration: $status in $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}') s, $(( $(stat -c %s "$run/mig.state") >> 20 )) MiB of state"
  hmp src "info migrate" | grep -i -E "transferred|dirty sync|iterations|downtime" | sed 's/^/    /' || true
  hmp src quit >/dev/null 2>&1 || true
  wait "$src" 2>/dev/null || true
  cp "$log" "$run/console-src.log"
  case $status in *completed*) ;; *) echo "$name: migration did not complete ($status)"; exit 1;; esac
  # The destination: same devices, the state from the file; it reconnects to the same back end.
  qemu "$cmdline" "${args[@]}" -incoming "exec:cat $run/mig.state"
  wait "$qpid" || true
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  echo "  source, last: $(grep -a 'MIGWRITE pass' "$run/console-src.log" | tail -1 | tr -d '\r')"
  echo "  destination, first: $(grep -a 'MIGWRITE pass' "$log" | head -1 | tr -d '\r')"
  { grep -a -h 'MIGWRITE mismatch' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  echo "  destination, last: $(grep -a 'MIGWRITE pass' "$log" | tail -1 | tr -d '\r')"
  [ -f "$run/stats.json" ] && echo "  back end: $(tr -d ' \n' < "$run/stats.json")"
  result=$(grep -a '^RESULT mig' "$log" | tail -1 | tr -d '\r' || true)
  echo "$name: ${result:-RESULT mig FAIL no verdict from the destination}"
  if [ $negative = 1 ]; then
    case "$result" in *FAIL*mismatches=[1-9]*) echo "$name: the destination found stale chunks, as it must"; exit 0;; esac
    # No verdict proves nothing either way: the destination's guest never finished a pass
    # (without the dirty log its copy of the used ring can be stale too, and then it waits
    # for completions it will never see). Exit 3, "inconclusive", so that CI can run it again.
    [ -n "$result" ] || { echo "$name: inconclusive: the destination gave no verdict"; exit 3; }
    echo "$name: nothing stale was found without the dirty log"; exit 1
  fi
  case "$result" in *PASS*) ;; *) exit 1;; esac
  ;;
hostile)
  # One back end process, two vIOMMU blk devices: the kernel's driver runs the blk trial on the
  # first; guest/progs/vioraw.c drives the second from user space and names IOVAs it never
  # mapped or has unmapped. Those requests must fail alone: the user-space driver checks their
  # status and that nothing was written, the disk behind them must be unchanged, and the blk
  # trial on the other device must pass.
  truncate -s 0 "$run/disk.img"; truncate -s 64M "$run/disk.img"
  # The second disk: the 64-bit word at byte offset o is 0x6d656d7669736f72 ^ o (vioraw checks it).
  python3 -c 'import struct,sys; sys.stdout.buffer.write(b"".join(struct.pack("<Q", 0x6d656d7669736f72 ^ o) for o in range(0, 1 << 20, 8)))' > "$run/raw.img"
  before=$(sha256sum < "$run/raw.img")
  # --negative: the back end acknowledges IOTLB invalidations and ignores them (a binary built
  # with the test-hooks feature); the race phase must see the device write an unmapped buffer.
  ignore_env=(); [ $negative = 0 ] || ignore_env=(MEMVISOR_TEST_IGNORE_INVALIDATE=0x30000000)  # vioraw's RACE_IOVA
  env "${ignore_env[@]}" "$bin" serve --iommu --blk "socket=$run/blk.sock,disk=$run/disk.img" --blk "socket=$run/raw.sock,disk=$run/raw.img" \
    --stats "$run/stats.json" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$run/blk.sock"; wait_socket "$run/raw.sock"
  dev="iommu_platform=on,ats=on,disable-legacy=on,num-queues=1"
  qemu "t=hostile,blk blk_mib=16 blk_wait=1 blk_random=100 blk_serial=blk0 hostile_dev=0000:00:05.0 intel_iommu=on iommu.strict=1" \
    -device intel-iommu,intremap=on,device-iotlb=on \
    -chardev socket,id=c0,path=$run/blk.sock -device vhost-user-blk-pci,chardev=c0,$dev,addr=04.0 \
    -chardev socket,id=c1,path=$run/raw.sock -device vhost-user-blk-pci,chardev=c1,$dev,addr=05.0
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  { grep -a -h -E '^(GUEST|VIORAW)' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  [ -f "$run/stats.json" ] && echo "  back end: $(tr -d ' \n' < "$run/stats.json")"
  hres=$(grep -a '^RESULT hostile' "$log" | tail -1 | tr -d '\r' || true)
  bres=$(grep -a '^RESULT blk' "$log" | tail -1 | tr -d '\r' || true)
  disk=PASS; [ "$(sha256sum < "$run/raw.img")" = "$before" ] || disk=FAIL
  echo "  second disk unchanged: $disk"
  # Exactly the four hostile requests and the race phase's failed reads failed, all on the
  # second device.
  race_failed=$({ grep -a -o 'VIORAW race_failed=[0-9]*' "$log" || true; } | tail -1 | cut -d= -f2)
  want="0 $((4 + ${race_failed:-1000}))"
  failed=$(tr -d ' \n' < "$run/stats.json" 2>/dev/null | grep -o '"failed":[0-9]*' | cut -d: -f2 | tr '\n' ' ')
  echo "  failed requests per device: ${failed:-none} (want $want)"
  [ "$failed" = "$want " ] || disk="$disk, failed counts $failed"
  echo "$name: ${hres:-RESULT hostile FAIL no verdict}; other device: ${bres:-RESULT blk FAIL no verdict}"
  ok=0; case "$hres/$bres/$disk" in *PASS*/*PASS*/PASS) ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: requests reaching unmapped buffers went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
blkio)
  # No guest: libblkio, the second vhost-user-blk client of the ecosystem, behind QEMU's blkio
  # driver, from qemu-io; the back end's image is O_DIRECT. It writes patterns in requests of every shape a libblkio program sends
  # (4 MiB and 8 MiB in one request, sector- but not page-aligned, byte-unaligned, 16 in
  # flight), reads each back verified, and the host checks the image byte for byte against the
  # same writes replayed in Python. Runs as root only because qemu-io comes from the QEMU root.
  hooks_env=(); [ $negative = 0 ] || hooks_env=(MEMVISOR_TEST_DROP_WRITES=1)
  truncate -s 0 "$run/disk.img"; truncate -s 64M "$run/disk.img"
  env "${hooks_env[@]}" RUST_LOG=${RUST_LOG:-info} "$bin" vhost-user-blk --socket "$run/blk.sock" \
    --disk "$run/disk.img" --direct --stats "$run/stats.json" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$run/blk.sock"
  # (pattern byte, offset, length): one list for qemu-io and for the host's replay.
  writes="0x5a 0 4194304
0x33 8388608 8388608
0x11 16777728 3584
0x22 20000001 12345"
  for i in $(seq 0 15); do writes="$writes
$((0x40 + i)) $((33554432 + i * 65536)) 65536"; done
  args=()
  while read -r p o l; do
    if [ "$o" -ge 33554432 ]; then args+=(-c "aio_write -P $p $o $l"); else args+=(-c "write -P $p $o $l"); fi
  done <<< "$writes"
  args+=(-c "aio_flush" -c "flush")
  while read -r p o l; do args+=(-c "read -P $p $o $l"); done <<< "$writes"
  start=$(date +%s.%N)
  (BIN=qemu-io timeout "${TIMEOUT:-300}" "$top/guest/qemu.sh" root \
    --image-opts "driver=virtio-blk-vhost-user,path=$run/blk.sock,cache.direct=on" "${args[@]}") > "$log" 2>&1 || true
  end=$(date +%s.%N)
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  verified=$(grep -c '^read [0-9]*/[0-9]* bytes' "$log" || true)
  mismatched=$(grep -c 'Pattern verification failed' "$log" || true)
  errors=$(grep -a -i -c 'error\|failed' "$log" || true)
  host=$(python3 - "$run/disk.img" "$writes" <<'PY'
import sys
img = open(sys.argv[1], "rb").read()
want = bytearray(len(img))
for line in sys.argv[2].splitlines():
    p, o, l = line.split()
    p, o, l = int(p, 0), int(o), int(l)
    want[o:o + l] = bytes([p]) * l
bad = [i for i in range(0, len(img), 4096) if img[i:i + 4096] != want[i:i + 4096]]
print("PASS" if not bad else f"FAIL {len(bad)} 4 KiB blocks differ, first at {bad[0]:#x}")
PY
)
  nwrites=$(wc -l <<< "$writes")
  echo "  qemu-io (libblkio virtio-blk-vhost-user, cache.direct=on): $nwrites writes, $verified of $nwrites reads verified, $mismatched mismatched, $errors error lines"
  { grep -a -i 'error\|failed' "$log" || true; } | head -3 | sed 's/^/  qemu-io: /'
  echo "  host image check: $host"
  [ -f "$run/stats.json" ] && echo "  back end: $(tr -d ' \n' < "$run/stats.json" | cut -c1-400)"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  ok=0; [ "$verified" = "$nwrites" ] && [ "$mismatched" = 0 ] && [ "$errors" = 0 ] && [ "$host" = PASS ] && ok=1
  if [ $ok = 1 ]; then echo "$name: RESULT blkio PASS"; else echo "$name: RESULT blkio FAIL"; fi
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: dropped writes went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
vfio-user)
  # memvisor's vfio-user server with the mvdma device; QEMU's vfio-user-pci behind intel-iommu
  # with caching-mode=on, so every map the guest makes through its own VFIO type1 arrives as a
  # DMA_MAP. guest/progs/mvdma.c checks every byte both ways while another thread churns maps,
  # maps thousands of single pages, and sends DMA to unmapped IOVAs (must fail, write nothing).
  # The host checks the server ended cleanly: nothing pinned or locked, the bad descriptors
  # (3 per mode) failed and no others.
  # --unmap-busy: the server refuses DMA_UNMAP with EBUSY while the device holds pins, as it
  # did before it waited for the device (a binary built with the test-hooks feature); QEMU takes
  # that as done, so the guest's race phase must see the device write an unmapped buffer.
  # --client-dies --negative: the server keeps a dead connection's memory, locks and pins.
  extra=(); [ $long_term = 0 ] || extra+=(--long-term-pins)
  # The recording (replayed by `memvisor-bench vfio-user`; a test-hooks server only) is of
  # QEMU's traffic alone.
  [ $fuzz = 1 ] || [ $client_dies = 1 ] || ! can_record vfio-user --record || extra+=(--record "$run/dma.rec")
  test_env=(); [ $unmap_busy = 0 ] || test_env=(MEMVISOR_TEST_UNMAP_BUSY=1)
  if [ $negative = 1 ] && [ $unmap_busy = 0 ] && [ $client_dies = 0 ]; then
    need_hooks MEMVISOR_TEST_IGNORE_UNMAP; test_env=(MEMVISOR_TEST_IGNORE_UNMAP=1)
  fi
  [ $client_dies = 0 ] || [ $negative = 0 ] || test_env=(MEMVISOR_TEST_LEAK_ON_HANGUP=1)
  env "${test_env[@]}" RUST_LOG=${RUST_LOG:-warn} "$bin" vfio-user --socket "$run/vfu.sock" --stats "$run/stats.json" \
    "${extra[@]}" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$run/vfu.sock"
  # no_timer_check: a guest booting while the host is busy can fail Linux's check that the
  # timer interrupt arrives through the remapped IO-APIC and panic (seen under TCG).
  vfu_devices=(-device intel-iommu,intremap=on,caching-mode=on
    -device "{\"driver\":\"vfio-user-pci\",\"socket\":{\"type\":\"unix\",\"path\":\"$run/vfu.sock\"},\"addr\":\"04.0\"}")
  # "VmLck-kB VmPin-kB memfd-mappings" of the server process.
  proc_figures() {
    echo "$(awk '/^VmLck:/{l=$2} /^VmPin:/{p=$2} END{printf "%d %d", l, p}' "/proc/$bpid/status") $(grep -c '/memfd:' "/proc/$bpid/maps" || true)"
  }
  read -r lck0 pin0 maps0 <<< "$(proc_figures)"
  echo "  server before any client: VmLck $lck0 kB, VmPin $pin0 kB, $maps0 memfd mappings"
  if [ $fuzz = 1 ]; then
    need_testkit
    "$testkit" vfio-user-fuzz --socket "$run/vfu.sock" --seconds 15 --seed "${SEED:-$RANDOM}" | sed 's/^/  /' \
      || { echo "$name: the hostile client stopped with an error"; tail "$run/backend.log"; exit 1; }
    kill -0 "$bpid" 2>/dev/null || { echo "$name: the server died under the hostile client"; tail "$run/backend.log"; exit 1; }
    # The server may still be ending the last hostile connection: give it up to 10 s.
    for _ in $(seq 50); do
      read -r lck pin maps <<< "$(proc_figures)"
      [ "$lck" -le "$lck0" ] && [ "$pin" -le "$pin0" ] && [ "$maps" -le "$maps0" ] && break
      sleep 0.2
    done
    echo "  server alive after the hostile client: VmLck $lck kB, VmPin $pin kB, $maps memfd mappings (want $lck0, $pin0, $maps0)"
    [ "$lck" -le "$lck0" ] && [ "$pin" -le "$pin0" ] && [ "$maps" -le "$maps0" ] \
      || { echo "$name: the hostile client's memory, locks or pins were not released"; exit 1; }
  fi
  secs=${MVDMA_SECS:-45}
  if [ $client_dies = 1 ]; then
    # The first client: the full trial, killed once the server holds locks or pins in guest
    # memory it maps (the guest's correctness phase alternates pin and copy mode).
    qemu "t=vfio-user mvdma_dev=0000:00:04.0 mvdma_req=${MVDMA_REQ:-2000} mvdma_secs=45 mvdma_scale=${MVDMA_SCALE:-4096} intel_iommu=on iommu.strict=1 no_timer_check" "${vfu_devices[@]}"
    # Killed 5 s into the guest's correctness phase (tables in both modes, maps churning),
    # at a moment the server holds locks or pins.
    first=$qpid; busy=""; up=0
    for _ in $(seq 2400); do
      kill -0 "$first" 2>/dev/null || break
      [ $up != 0 ] || ! grep -q -a 'MVDMA device' "$log" || up=$SECONDS
      if [ $up != 0 ] && [ $((SECONDS - up)) -ge 5 ]; then
        read -r lck pin maps <<< "$(proc_figures)"
        if [ $((lck + pin)) -gt $((lck0 + pin0)) ] && [ "$maps" -gt "$maps0" ]; then busy=1; break; fi
      fi
      sleep 0.1
    done
    [ -n "$busy" ] || { echo "$name: the first client never left locks or pins outstanding"; tail -20 "$log"; exit 1; }
    victim=$(pgrep -n -f 'qemu-system-x86_64.*t=vfio-user' || true)
    [ -n "$victim" ] || { echo "$name: no QEMU process to kill"; exit 1; }
    kill -KILL "$victim"
    t0=$(date +%s.%N)
    echo "  outstanding when QEMU (pid $victim) was killed: VmLck $lck kB, VmPin $pin kB, $maps memfd mappings; guest: $(grep -a '^MVDMA' "$log" | tail -1 | tr -d '\r')"
    wait "$first" 2>/dev/null || true
    cp "$log" "$run/console-first.log"
    released=""
    while awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{exit !(b - a < 10)}'; do
      kill -0 "$bpid" 2>/dev/null || break
      read -r lck pin maps <<< "$(proc_figures)"
      if [ "$lck" -le "$lck0" ] && [ "$pin" -le "$pin0" ] && [ "$maps" -le "$maps0" ]; then released=1; break; fi
      sleep 0.1
    done
    took=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
    alive=no; ! kill -0 "$bpid" 2>/dev/null || alive=yes
    echo "  after the kill: server alive: $alive; VmLck $lck kB, VmPin $pin kB, $maps memfd mappings after $took s (want $lck0, $pin0, $maps0 within 10 s)"
    proc=FAIL; [ $alive = yes ] && [ -n "$released" ] && proc=PASS
    echo "$name: /proc checks after the client died: $proc"
    if [ $negative = 1 ]; then
      [ $proc = FAIL ] && { echo "$name: the trial failed as it must (the dead client's memory was kept)"; exit 0; }
      echo "$name: a server that keeps a dead client's memory went unnoticed"; exit 1
    fi
    [ $proc = PASS ] || { tail "$run/backend.log"; exit 1; }
    secs=${MVDMA_SECS:-10}
  fi
  start=$(date +%s.%N)
  qemu "t=vfio-user mvdma_dev=0000:00:04.0 mvdma_req=${MVDMA_REQ:-2000} mvdma_secs=$secs mvdma_scale=${MVDMA_SCALE:-4096} intel_iommu=on iommu.strict=1 no_timer_check" "${vfu_devices[@]}"
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  end=$(date +%s.%N)
  # The server serves client after client: stop it.
  kill -TERM "$bpid" 2>/dev/null || true; wait "$bpid" 2>/dev/null || true
  { grep -a -h -E '^(GUEST|MVDMA)' "$log" || true; } | tr -d '\r' | sed 's/^/  /'
  res=$(grep -a '^RESULT vfio-user' "$log" | tail -1 | tr -d '\r' || true)
  # The race phase's descriptors cut off by its unmaps fail too; QEMU logs any map or unmap the
  # server refused.
  race_failed=$({ grep -a -o 'race_failed_descriptors=[0-9]*' "$log" || true; } | tail -1 | cut -d= -f2)
  qemu_errors=$(grep -a -c 'vfio_container_dma_\(un\)\?map' "$log" || true)
  { grep -a 'vfio_container_dma_' "$log" || true; } | head -3 | sed 's/^/  QEMU: /'
  host=$(python3 - "$run/stats.json" $private $long_term "${race_failed:--1}" "${qemu_errors:-0}" <<'PY'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"FAIL no server stats ({e})"); sys.exit()
private = sys.argv[2] == "1"
long_term = sys.argv[3] == "1"
race_failed = int(sys.argv[4])
qemu_errors = int(sys.argv[5])
d = s["device"]
bad = []
if race_failed < 0: bad.append("the guest reported no race phase")
if qemu_errors: bad.append(f"QEMU logged {qemu_errors} refused DMA maps/unmaps")
if s["device_stops"]: bad.append(f"the device was stopped {s['device_stops']} times for keeping its pins")
if long_term:
    # The device's pins went through long-term pins, and none is left.
    if not s["long_term_pins"]: bad.append("no pin was held long-term")
    if s["long_term_bytes_at_end"]: bad.append(f"{s['long_term_bytes_at_end']} bytes still pinned long-term")
    # Guest RAM is a shmem memfd: where the kernel's THP settings give shmem no large folios,
    # nothing stands in the way of a long-term pin, so none may fall back to mlock.
    import glob, re
    def chosen(path):
        try: return re.search(r"\[(\w+)\]", open(path).read()).group(1)
        except Exception: return None
    top = chosen("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    sizes = [chosen(p) for p in glob.glob("/sys/kernel/mm/transparent_hugepage/hugepages-*/shmem_enabled")]
    sizes = [top if v == "inherit" else v for v in sizes if v]
    shmem_thp = any(v not in (None, "never", "deny") for v in (sizes or [top]))
    if not shmem_thp and s["long_term_fallbacks"]: bad.append(f"{s['long_term_fallbacks']} long-term pins fell back to mlock")
if private:
    # Every map without a descriptor, every byte through QEMU, none of it failing.
    if s["dma_maps_remote"] != s["dma_maps"]: bad.append(f"{s['dma_maps'] - s['dma_maps_remote']} maps came with a descriptor")
    if not (s["peer_reads"] and s["peer_writes"]): bad.append("no DMA_READ/DMA_WRITE went to QEMU")
    # QEMU refuses a DMA_READ/DMA_WRITE of an IOVA the guest has unmapped: only the race
    # phase's cut-off descriptors may meet that, at most once each.
    if s["peer_errors"] > max(race_failed, 0): bad.append(f"{s['peer_errors']} DMA_READ/DMA_WRITE failed, more than the {race_failed} descriptors the race cut off")
    if not d["pin_fallbacks"]: bad.append("pin mode never met memory without a descriptor")
if s["end"] != "ok": bad.append(f"connection ended: {s['end']}")
# Every connection (hostile, killed or not) must leave the process as it was before the first.
base, conns = s["baseline"], s["connections"]
for i, c in enumerate(conns):
    over = [f"{k}={c['after'][k]}" for k in ("vm_lck_kb", "vm_pin_kb", "memfd_maps", "shared_file_maps") if c["after"][k] > base[k]]
    if over:
        bad.append(f"connection {i + 1} of {len(conns)} left {', '.join(over)} after it ended"); break
if s["pinned_pages_at_end"] or s["locked_bytes_at_end"]: bad.append(f"leaked pins {s['pinned_pages_at_end']} pages, {s['locked_bytes_at_end']} bytes locked")
if d["descriptors_failed"] != 6 + max(race_failed, 0):
    bad.append(f"{d['descriptors_failed']} descriptors failed, want the 6 bad ones and the {race_failed} the race's unmaps cut off")
if s["dma_unmap_errors"]: bad.append(f"{s['dma_unmap_errors']} DMA_UNMAPs refused")
print(("FAIL " + "; ".join(bad)) if bad else "PASS", f"maps={s['dma_maps']} unmaps={s['dma_unmaps']} empty_unmaps={s['dma_unmaps_empty']}",
      f"map_refused={s['dma_map_errors']} peak_mappings={s['peak_mappings']}",
      f"map_us={s['map_ns'] / max(s['dma_maps'] + s['dma_map_errors'], 1) / 1e3:.2f} unmap_us={s['unmap_ns'] / max(s['dma_unmaps'] + s['dma_unmaps_empty'], 1) / 1e3:.2f}",
      f"descriptors ok={d['descriptors_ok']} failed={d['descriptors_failed']} copy={d['copy_descriptors']} pin={d['pin_descriptors']}",
      f"pin_calls={d['pin_calls']} irqs={s['irqs_signalled']} mib={d['bytes'] / 2**20:.1f}",
      f"remote_maps={s['dma_maps_remote']} dma_read={s['peer_reads']} dma_write={s['peer_writes']} peer_mib={s['peer_bytes'] / 2**20:.1f} pin_fallbacks={d['pin_fallbacks']}",
      f"long_term_pins={s['long_term_pins']} long_term_fallbacks={s['long_term_fallbacks']}",
      f"connections={len(conns)} (first: end={conns[0]['end']!r} left {conns[0]['mappings_at_end']} mappings,"
      f" {conns[0]['pinned_pages_at_hangup']} pages pinned by the device; after it VmLck={conns[0]['after']['vm_lck_kb']} kB"
      f" VmPin={conns[0]['after']['vm_pin_kb']} kB memfd_maps={conns[0]['after']['memfd_maps']})" if conns else "connections=0")
PY
)
  echo "  server: $host"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${res:-RESULT vfio-user FAIL no verdict (see $work/$log)}"
  ok=0; case "$res/$host" in *PASS*/PASS*) ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: DMA into unmapped memory went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
rng)
  # A device of one's own (issue 36): the example served to QEMU's generic vhost-user device.
  rng=${RNG:-$top/target/release/examples/rng}
  [ -x "$rng" ] || { echo "no rng example at $rng: cargo build --release -p memvisor-vhost --example rng" >&2; exit 1; }
  sock=$run/rng.sock
  if [ $negative = 1 ]; then export MEMVISOR_TEST_RNG_ZEROS=1; fi
  "$rng" "$sock" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$sock"
  qemu "t=rng" -chardev socket,id=c0,path=$sock -device vhost-user-test-device-pci,chardev=c0,virtio-id=4,num_vqs=1
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  alive=yes; kill -0 "$bpid" 2>/dev/null || alive=no
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  grep -a '^GUEST' "$log" | sed 's/^/  /'
  res=$(grep -a '^RESULT rng' "$log" | tail -1 | tr -d '\r' || true)
  echo "  back end alive to the end: $alive"
  echo "$name: ${res:-RESULT rng FAIL no verdict (see $work/$log)}"
  ok=0; case "$res/$alive" in *PASS*/yes) ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: a device writing zeros passed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
locks)
  # No guest: QEMU (paused), qemu-storage-daemon and qemu-img from the QEMU root against
  # memvisor on one image; see the usage at the top. Each case prints what the peer said.
  img=$run/disk.img; truncate -s 64M "$img"; ino=$(stat -c %i "$img")
  # --negative: every memvisor that must be refused runs with the locks (and the probe) off.
  off=(); offsub=""; [ $negative = 0 ] || { off=(--locking off --format raw); offsub=",locking=off,format=raw"; }
  pass=0; fail=0
  verdict() { if [ "$1" = 1 ]; then pass=$((pass + 1)); echo "  ($2) PASS"; else fail=$((fail + 1)); echo "  ($2) FAIL"; fi; }
  # How many open files hold a lock on byte $1 of the image (/proc/locks).
  lk_count() { awk -v i=":$ino" -v b="$1" '$2 == "OFDLCK" && substr($6, length($6) - length(i) + 1) == i && $7 <= b && $8 >= b { n++ } END { print n + 0 }' /proc/locks; }
  # Waits until at least $2 open files hold a lock on byte $1 (10 s at most).
  lk_held() { local i; for i in $(seq 100); do [ "$(lk_count "$1")" -ge "$2" ] && return 0; sleep 0.1; done; return 1; }
  lk_stop() { kill -TERM "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
  # A program that must be refused: runs "$@" in the background (output to $out) until it
  # exits (then 0 if it failed) or has run 8 s / made socket $sock (then stops it; 1).
  lk_refused() {
    local p i; rm -f "$sock"
    timeout 60 "$@" > "$out" 2>&1 & p=$!
    for i in $(seq 80); do
      kill -0 "$p" 2>/dev/null || { wait "$p" && return 1; return 0; }
      if [ -n "$sock" ] && [ -S "$sock" ]; then break; fi
      sleep 0.1
    done
    lk_stop "$p"; return 1
  }
  # A program that must start: in the background; $lkpid; 0 once socket $sock exists (or,
  # with no socket, once one more open file locks byte 100) and it is still alive 1 s later.
  lk_started() {
    local before; before=$(lk_count 100)
    rm -f "$sock"; timeout 120 "$@" > "$out" 2>&1 & lkpid=$!; pids+=("$lkpid")
    if [ -n "$sock" ]; then wait_socket "$sock" 2>/dev/null || return 1; else lk_held 100 $((before + 1)) || return 1; fi
    sleep 1; kill -0 "$lkpid" 2>/dev/null
  }
  said() { grep -a -v '^\[' "$out" | grep -a -i -m3 'lock\|format\|error\|fail\|process' | sed "s/^/      $1: /" || true; }
  # The peers' command lines (arrays: lk_refused and lk_started run them under timeout).
  vm=("$top/guest/qemu.sh" root -S -nographic -display none -machine q35 -device virtio-blk-pci,drive=d0 -drive)
  qsd=(env BIN=qemu-storage-daemon "$top/guest/qemu.sh" root --blockdev "driver=file,node-name=f0,filename=$img"
       --export "type=vhost-user-blk,id=e0,node-name=f0,addr.type=unix,addr.path=$run/qsd.sock,writable=on")
  mvs=(env RUST_LOG=warn "$bin" vhost-user-blk --socket "$run/mv.sock" --disk)
  start=$(date +%s.%N)
  echo "  (a) a paused QEMU VM holds $img (writable virtio-blk): memvisor must refuse it"
  out=$run/a-vm.log; sock=""
  if lk_started "${vm[@]}" "file=$img,if=none,id=d0,format=raw"; then
    vmpid=$lkpid
    echo "      /proc/locks: $(grep ":$ino " /proc/locks | awk '{print $(NF-1) "-" $NF}' | tr '\n' ' ')"
    ok=1
    for ro in "" --read-only; do
      out=$run/a-mv$ro.log; sock=$run/mv.sock
      if lk_refused "${mvs[@]}" "$img" $ro ${off[@]+"${off[@]}"}; then said "memvisor${ro:+ $ro}"; grep -q 'cannot take the .*"write" lock' "$out" || ok=0
      else echo "      memvisor${ro:+ $ro} served the image the VM holds"; ok=0; fi
    done
    echo "  (f) memvisor --locking off beside the same VM: must start"
    out=$run/f-mv.log; sock=$run/mv.sock
    if lk_started "${mvs[@]}" "$img" --locking off; then lk_stop "$lkpid"; verdict 1 f; else said memvisor; verdict 0 f; fi
    lk_stop "$vmpid"
  else
    echo "      the VM did not start:"; sed 's/^/      /' "$out" | head -5; ok=0
  fi
  verdict $ok a
  echo "  (b) memvisor serves $img: a QEMU VM on it must fail to start"
  out=$run/b-mv.log; sock=$run/mv.sock; ok=0
  if lk_started "${mvs[@]}" "$img" ${off[@]+"${off[@]}"}; then
    mvpid=$lkpid; out=$run/b-vm.log; sock=""
    if lk_refused "${vm[@]}" "file=$img,if=none,id=d0,format=raw"; then said QEMU; grep -q 'Failed to get .*lock' "$out" && ok=1; else echo "      the VM started beside memvisor"; fi
    lk_stop "$mvpid"
  else said memvisor; fi
  verdict $ok b
  echo "  (c) qemu-storage-daemon exports $img (vhost-user-blk, writable=on): memvisor must refuse it"
  out=$run/c-qsd.log; sock=$run/qsd.sock; ok=0
  if lk_started "${qsd[@]}"; then
    qpid2=$lkpid; out=$run/c-mv.log; sock=$run/mv.sock
    if lk_refused env RUST_LOG=warn "$bin" serve --blk "socket=$run/mv.sock,disk=$img$offsub"; then said memvisor; grep -q 'cannot take the .*"write" lock' "$out" && ok=1
    else echo "      memvisor served the image qemu-storage-daemon exports"; fi
    lk_stop "$qpid2"
  else said qemu-storage-daemon; fi
  echo "      and memvisor serves it: qemu-storage-daemon must fail to start"
  out=$run/c-mv2.log; sock=$run/mv.sock
  if lk_started "${mvs[@]}" "$img" ${off[@]+"${off[@]}"}; then
    mvpid=$lkpid; out=$run/c-qsd2.log; sock=$run/qsd.sock
    if lk_refused "${qsd[@]}"; then said qemu-storage-daemon; grep -q 'Failed to get .*lock' "$out" || ok=0; else echo "      qemu-storage-daemon exported the image memvisor serves"; ok=0; fi
    lk_stop "$mvpid"
  else said memvisor; ok=0; fi
  verdict $ok c
  echo "  (d) read-only: memvisor --read-only beside a read-only VM, in both orders, must start"
  ok=1; out=$run/d-vm.log; sock=""
  if lk_started "${vm[@]}" "file=$img,if=none,id=d0,format=raw,readonly=on"; then
    vmpid=$lkpid; out=$run/d-mv.log; sock=$run/mv.sock
    if lk_started "${mvs[@]}" "$img" --read-only; then lk_stop "$lkpid"; else said memvisor; ok=0; fi
    lk_stop "$vmpid"
  else said QEMU; ok=0; fi
  out=$run/d-mv2.log; sock=$run/mv.sock
  if lk_started "${mvs[@]}" "$img" --read-only; then
    mvpid=$lkpid; out=$run/d-vm2.log; sock=""
    if lk_started "${vm[@]}" "file=$img,if=none,id=d0,format=raw,readonly=on"; then lk_stop "$lkpid"; else said QEMU; ok=0; fi
    lk_stop "$mvpid"
  else said memvisor; ok=0; fi
  verdict $ok d
  echo "  (e) qemu-img create -f qcow2: memvisor must refuse it naming qcow2, and serve it with --format raw"
  q=$run/vm.qcow2; ok=0
  BIN=qemu-img "$top/guest/qemu.sh" root create -q -f qcow2 "$q" 64M
  out=$run/e-mv.log; sock=$run/mv.sock
  if lk_refused "${mvs[@]}" "$q" ${off[@]+"${off[@]}"}; then said memvisor; grep -q 'is in qcow2 format' "$out" && ok=1
  else echo "      memvisor served the qcow2 image as raw"; fi
  out=$run/e-mv2.log
  if lk_started "${mvs[@]}" "$q" --format raw; then
    mvpid=$lkpid
    # The client reads sector 0 through memvisor: the qcow2 magic, as the file holds it.
    BIN=qemu-io "$top/guest/qemu.sh" root --image-opts "driver=virtio-blk-vhost-user,path=$run/mv.sock,cache.direct=on" \
      -c "read -v 0 16" > "$run/e-io.log" 2>&1 || true
    lk_stop "$mvpid"
    echo "      qemu-io through memvisor: $(grep -a -m1 '^00000000:' "$run/e-io.log" || echo "no data: $(head -2 "$run/e-io.log")")"
    grep -a -q '^00000000:  51 46 49 fb' "$run/e-io.log" || ok=0
    fmt=$(BIN=qemu-img "$top/guest/qemu.sh" root info "$q" 2>&1 | awk '/^file format:/{print $3}')
    echo "      qemu-img info afterwards: file format ${fmt:-?}"
    [ "$fmt" = qcow2 ] || ok=0
  else said memvisor; ok=0; fi
  verdict $ok e
  end=$(date +%s.%N)
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s; $pass passed, $fail failed"
  ok=0; [ $fail = 0 ] && [ $pass = 6 ] && ok=1
  if [ $ok = 1 ]; then echo "$name: RESULT locks PASS"; else echo "$name: RESULT locks FAIL"; fi
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: memvisor without locks went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
qmp)
  # memvisor driven only through QMP by python's qemu.qmp; guest/qmp-trial.py runs the steps and
  # QEMU (the command after its `--`), and judges each; see the usage at the top.
  python3 -c 'import qemu.qmp, prometheus_client' 2>/dev/null \
    || { echo "trial.sh qmp: needs python's qemu.qmp and prometheus_client: pip install qemu.qmp prometheus_client" >&2; exit 1; }
  case $qmp_neg in
    throttle) need_hooks MEMVISOR_TEST_IGNORE_THROTTLE; export MEMVISOR_TEST_IGNORE_THROTTLE=1;;
    resize) need_hooks MEMVISOR_TEST_SILENT_RESIZE; export MEMVISOR_TEST_SILENT_RESIZE=1;;
  esac
  truncate -s 64M "$run/disk.img"
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  RUST_LOG=${RUST_LOG:-info} "$bin" serve --control "$work/$run/control.sock" --metrics "127.0.0.1:$port" > "$run/backend.log" 2>&1 &
  bpid=$!; pids+=("$bpid")
  wait_socket "$run/control.sock"
  start=$(date +%s.%N)
  rc=0
  timeout "${TIMEOUT:-150}" python3 "$top/guest/qmp-trial.py" --control "$run/control.sock" --metrics "http://127.0.0.1:$port/metrics" \
    --socket "$work/$run/blk.sock" --disk "$work/$run/disk.img" --console "$log" --qemu-qmp "$run/qemu.qmp" -- \
    timeout "${TIMEOUT:-150}" "$top/guest/qemu.sh" root -machine q35,memory-backend=mem -object "$ram" -m 1G \
      -smp 1 -nographic -no-reboot -kernel vm/vmlinuz -initrd vm/initrd.cpio.gz \
      -append "console=ttyS0 panic=-1 quiet t=qmp qmp_mib=8 qmp_secs=120" \
      -chardev socket,id=c0,path=$run/blk.sock -device vhost-user-blk-pci,chardev=c0,num-queues=1 \
      -qmp unix:$run/qemu.qmp,server=on,wait=off > "$run/trial.log" 2>&1 || rc=$?
  # `quit` (the last thing the script sends) must have stopped the server.
  for _ in $(seq 50); do kill -0 "$bpid" 2>/dev/null || break; sleep 0.1; done
  stopped=1; kill -0 "$bpid" 2>/dev/null && stopped=0
  end=$(date +%s.%N)
  sed 's/^/  /' "$run/trial.log"
  echo "  server $([ $stopped = 1 ] && echo "stopped on quit" || echo "still running 5 s after quit")"
  grep -a -E 'WARN|ERROR|panick' "$run/backend.log" | head -5 | sed 's/^/  back end: /' || true
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  result=$(grep -a '^RESULT qmp' "$run/trial.log" | tail -1 || true)
  echo "$name: ${result:-RESULT qmp FAIL no verdict (exit $rc; see $work/$run/trial.log)}"
  ok=0; if [ $rc = 0 ] && [ $stopped = 1 ]; then case "$result" in *PASS*) ok=1;; esac; fi
  if [ -n "$qmp_neg" ]; then
    want=4; [ "$qmp_neg" = throttle ] || want=3
    if grep -a -q "^STEP $want FAIL" "$run/trial.log"; then echo "$name: step $want failed as it must"; exit 0; fi
    echo "$name: step $want did not fail although the back end was broken for it (is MEMVISOR a test-hooks build?)"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
qtest)
  # QEMU's vhost-user-blk qtest against memvisor (through guest/qsd-shim.sh) or, with --peer,
  # qemu-storage-daemon; see the usage at the top.
  "$top/guest/mkqtest.sh" "$work/qtest" >/dev/null
  cp "$work/qtest/qos-test" "$top/guest/qsd-shim.sh" "$run/"
  cp "$bin" "$run/memvisor"
  daemon=/w/qsd-shim.sh; [ $peer = 0 ] || daemon=/usr/bin/qemu-storage-daemon
  if [ $negative = 1 ]; then need_hooks MEMVISOR_TEST_MAX_QUEUE_SIZE; export MEMVISOR_TEST_MAX_QUEUE_SIZE=64; fi
  echo "  $(cat "$work/qtest/qos-test.version"); frontend: $("$top/guest/qemu.sh" root -version | head -1)"
  export QTEST_QEMU_BINARY=/usr/bin/qemu-system-x86_64 QTEST_QEMU_STORAGE_DAEMON_BINARY=$daemon
  if [ -n "$qsize" ]; then
    # Every vhost-user-blk-pci the tests make gets rings of $qsize (QEMU's default is 128).
    printf '#!/bin/sh\nexec /usr/bin/qemu-system-x86_64 "$@" -global vhost-user-blk-pci.queue-size=%s\n' "$qsize" > "$run/qemu-qs-system-x86_64"
    chmod +x "$run/qemu-qs-system-x86_64"; export QTEST_QEMU_BINARY=/w/qemu-qs-system-x86_64
    echo "  rings of $qsize entries (-global vhost-user-blk-pci.queue-size=$qsize)"
  fi
  ( cd "$run" && BIN=/w/qos-test "$top/guest/qemu.sh" "$work/root" -l ) > "$run/list.log" 2>&1 || true
  mapfile -t tests < <(grep -o '^# /x86_64/.*/vhost-user-blk[^ ]*' "$run/list.log" | sed 's/^# //')
  [ ${#tests[@]} -gt 0 ] || { echo "$name: qos-test lists no vhost-user-blk test (see $work/$run/list.log)"; exit 1; }
  passed=0; failed=0
  for t in "${tests[@]}"; do
    log_t=$run/$(basename "$t").log
    t0=$(date +%s.%N)
    rc=0; ( cd "$run" && BIN=/w/qos-test timeout 20 "$top/guest/qemu.sh" "$work/root" -p "$t" ) > "$log_t" 2>&1 || rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
    if [ $rc = 0 ] && grep -q '^ok ' "$log_t" && ! grep -q '^not ok' "$log_t"; then
      passed=$((passed + 1)); echo "  PASS $t ($secs s)"
    else
      failed=$((failed + 1)); echo "  FAIL $t ($secs s, exit $rc; $work/$log_t)"
      grep -a -E 'ERROR|Bail out|assert|timeout|refused|closing' "$log_t" | head -3 | sed 's/^/       /' || true
    fi
  done
  echo "$name: $passed of ${#tests[@]} vhost-user-blk qtests passed, $failed failed ($([ $peer = 1 ] && echo qemu-storage-daemon || echo memvisor))"
  if [ $negative = 1 ]; then
    [ $passed = 0 ] && { echo "$name: every test failed as it must"; exit 0; }
    echo "$name: $passed tests passed with rings capped at 64 entries"; exit 1
  fi
  [ $failed = 0 ]
  ;;
*) echo "unknown trial $trial" >&2; exit 2 ;;
esac
