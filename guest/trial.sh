#!/bin/bash
# Real-guest trials: a Debian kernel under QEMU 11.1 (TCG) with a device served by memvisor's
# vhost-user back end. Needs root (mount namespaces, chroot, mmdebstrap); builds the QEMU root
# and the guest on first use under target/guest/.
#
# usage: guest/trial.sh blk [--negative] [--peer] [--after-fuzz]
#   blk         the guest writes a random pattern, drops caches, reads it back (sequential
#               O_DIRECT, through the page cache, random 4 KiB O_DIRECT) and compares; the host
#               then checks the image holds the pattern.
#   --negative  negative control: the host changes the image while the guest waits between
#               writing and reading; the trial must then FAIL (exit 0 only if it does).
#   --peer      the same trial against qemu-storage-daemon's vhost-user-blk export.
#   --after-fuzz first attack the back end for 15 s with memvisor's hostile frontend
#               (vhost-user-fuzz); the same back end must then serve QEMU and pass.
# Env: MEMVISOR (binary, default target/release/memvisor), TIMEOUT (s, default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
top=$PWD
trial=${1:?usage: trial.sh blk [--negative] [--peer]}; shift
negative=0; peer=0; fuzz=0
for a in "$@"; do case $a in --negative) negative=1;; --peer) peer=1;; --after-fuzz) fuzz=1;; *) echo "unknown option $a" >&2; exit 2;; esac; done
if [ "$(id -u)" != 0 ]; then
  echo "SKIPPED real-guest trial $trial: needs root (mount namespace + chroot for the QEMU root, mmdebstrap)"
  exit 0
fi
bin=${MEMVISOR:-$top/target/release/memvisor}
[ -x "$bin" ] || { echo "no memvisor binary at $bin: cargo build --release first" >&2; exit 1; }
work=$top/target/guest
guest/mkroot.sh "$work/root" >/dev/null
[ -f "$work/vm/initrd.cpio.gz" ] && [ "$work/vm/initrd.cpio.gz" -nt guest/init ] || guest/mkguest.sh "$work/vm" >/dev/null
cd "$work"
name=$trial; [ $peer = 0 ] || name=$name-peer; [ $negative = 0 ] || name=$name-negative; [ $fuzz = 0 ] || name=$name-after-fuzz
run=run/$name; rm -rf "$run"; mkdir -p "$run"
log=$run/console.log
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_socket() { for _ in $(seq 100); do [ -S "$1" ] && return 0; sleep 0.1; done; echo "no socket $1" >&2; return 1; }
# Runs QEMU with the trial's devices; the console goes to $log.
qemu() {
  timeout "${TIMEOUT:-300}" "$top/guest/qemu.sh" root \
    -machine q35,memory-backend=mem -object memory-backend-memfd,id=mem,size=1G,share=on -m 1G \
    -smp 1 -nographic -no-reboot -kernel vm/vmlinuz -initrd vm/initrd.cpio.gz \
    -append "console=ttyS0 panic=-1 quiet $1" "${@:2}" > "$log" 2>&1 &
  qpid=$!; pids+=("$qpid")
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
    "$bin" vhost-user-blk --socket "$sock" --disk "$run/disk.img" --stats "$run/stats.json" > "$run/backend.log" 2>&1 &
  fi
  bpid=$!; pids+=("$bpid")
  wait_socket "$sock"
  if [ $fuzz = 1 ]; then
    "$bin" vhost-user-fuzz --socket "$sock" --seconds 15 --seed "${SEED:-$RANDOM}" | sed 's/^/  /'
    kill -0 "$bpid" 2>/dev/null || { echo "$name: the back end died under the hostile frontend"; tail "$run/backend.log"; exit 1; }
  fi
  serial=memvisor; wait_s=1; [ $peer = 0 ] || serial=none; [ $negative = 0 ] || wait_s=4
  start=$(date +%s.%N)
  qemu "t=blk blk_mib=$mib blk_wait=$wait_s blk_random=300 blk_serial=$serial" \
    -chardev socket,id=c0,path=$sock -device vhost-user-blk-pci,chardev=c0,num-queues=1
  if [ $negative = 1 ]; then
    # Wait for the guest to finish writing, then change three 4 KiB blocks of the image.
    for _ in $(seq 600); do grep -q WRITTEN "$log" 2>/dev/null && break; sleep 0.1; done
    for blk in 7 2049 6000; do dd if=/dev/urandom of="$run/disk.img" bs=4k seek=$blk count=1 conv=notrunc status=none; done
    echo "negative control: changed 4 KiB blocks 7, 2049, 6000 of the image after the guest wrote it"
  fi
  wait "$qpid" || { echo "QEMU exited with $? (timeout?); console:"; tail -20 "$log"; }
  end=$(date +%s.%N)
  kill -TERM "$bpid" 2>/dev/null; wait "$bpid" 2>/dev/null || true
  grep '^GUEST' "$log" | sed 's/^/  /'
  result=$(grep -a '^RESULT blk' "$log" | tail -1 | tr -d '\r')
  want=$(grep -a 'PATTERN sha256=' "$log" | sed 's/.*sha256=\([0-9a-f]*\).*/\1/' | tr -d '\r')
  have=$(head -c $((mib << 20)) "$run/disk.img" | sha256sum | cut -d' ' -f1)
  host=FAIL; [ -z "$want" ] || [ "$want" != "$have" ] || host=PASS
  echo "  host image check: $host (guest pattern ${want:-none}, image $have)"
  [ -f "$run/stats.json" ] && echo "  back end: $(tr -d ' \n' < "$run/stats.json")"
  echo "  wall time $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}') s"
  echo "$name: ${result:-RESULT blk FAIL no verdict (see $work/$log)}"
  ok=0; case "$result" in *PASS*) [ $host = PASS ] && ok=1;; esac
  if [ $negative = 1 ]; then
    [ $ok = 0 ] && { echo "$name: the trial failed as it must"; exit 0; }
    echo "$name: the corrupted image went unnoticed"; exit 1
  fi
  [ $ok = 1 ] || exit 1
  ;;
*) echo "unknown trial $trial" >&2; exit 2 ;;
esac
