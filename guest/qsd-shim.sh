#!/bin/bash
# Stands in for qemu-storage-daemon under QEMU's own vhost-user-blk qtest (tests/qtest/
# vhost-user-blk-test.c, in qos-test), which starts $QTEST_QEMU_STORAGE_DAEMON_BINARY with
#   --blockdev driver=file,node-name=diskN,filename=IMG
#   --export type=vhost-user-blk,id=diskN,addr.type=fd,addr.str=FD,node-name=diskN,writable=on,num-queues=Q
# once per device, and stops it with SIGTERM, expecting exit status 0. This translates that
# command line into one `memvisor vhost-user-blk` per export (qsd's syntax stays out of the
# product): the listening socket it inherited (--fd), or addr.type=unix,addr.path=PATH
# (--socket), the image, the queues, read-only unless writable=on. SIGTERM goes to every
# back end; the status is 0 only if each ended with 0. Anything else on the command line is
# refused with exit 2 and the reason, so a test that needs more than this fails visibly.
# Env: MEMVISOR (the binary; default: memvisor next to this script, else on PATH).
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=${MEMVISOR:-$here/memvisor}; [ -x "$bin" ] || bin=memvisor
declare -A image=()
cmds=()
# Value of key $2 in the comma-separated option list $1 (qsd's ",," escape is not needed here).
opt() { tr ',' '\n' <<< "$1" | sed -n "s/^$2=//p" | head -1; }
while [ $# -gt 0 ]; do
  case $1 in
    --blockdev)
      [ "$(opt "$2" driver)" = file ] || { echo "qsd-shim: --blockdev $2: only driver=file" >&2; exit 2; }
      image[$(opt "$2" node-name)]=$(opt "$2" filename); shift 2;;
    --export)
      e=$2; shift 2
      [ "$(opt "$e" type)" = vhost-user-blk ] || { echo "qsd-shim: --export $e: only type=vhost-user-blk" >&2; exit 2; }
      node=$(opt "$e" node-name); disk=${image[$node]:-}
      [ -n "$disk" ] || { echo "qsd-shim: --export $e: no --blockdev node-name=$node before it" >&2; exit 2; }
      case $(opt "$e" addr.type) in
        fd) where=(--fd "$(opt "$e" addr.str)");;
        unix) where=(--socket "$(opt "$e" addr.path)");;
        *) echo "qsd-shim: --export $e: addr.type must be fd or unix" >&2; exit 2;;
      esac
      ro=(--read-only); [ "$(opt "$e" writable)" = on ] && ro=()
      q=$(opt "$e" num-queues); q=${q:-1}
      cmds+=("$(printf '%q ' "$bin" vhost-user-blk "${where[@]}" --disk "$disk" --queues "$q" "${ro[@]}")");;
    *) echo "qsd-shim: unsupported argument $1" >&2; exit 2;;
  esac
done
[ ${#cmds[@]} -gt 0 ] || { echo "qsd-shim: no --export" >&2; exit 2; }
pids=()
for c in "${cmds[@]}"; do eval "exec $c" & pids+=("$!"); done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
rc=0
for p in "${pids[@]}"; do
  # A wait cut short by the trapped signal is waited again.
  while :; do wait "$p"; s=$?; kill -0 "$p" 2>/dev/null || break; done
  [ $s = 0 ] || rc=$s
done
exit $rc
