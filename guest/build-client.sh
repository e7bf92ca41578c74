#!/bin/bash
# Builds guest/blkio-bench.c, the libblkio client of `memvisor-bench blk` (random offsets,
# several queues: what qemu-img bench cannot do; and, with its io_uring driver, the limit row
# straight on the image). It is compiled in the QEMU root
# (guest/mkroot.sh) seen through an overlay whose upper layer is OUT/overlay, so the shared root
# is never written: the root's apt installs gcc and libblkio-dev into the overlay, and the
# binary is linked against the root's libblkio, among which it then runs (guest/qemu.sh).
# Result: OUT/blkio-bench, rebuilt only when the source is newer; the overlay is kept, so a
# rebuild skips apt. First build 1-3 minutes (apt), later ones a second. Needs root.
# (fio's libblkio engine would do too, but Debian's fio is built without it and Debian's
# source packages cannot be fetched here, so the client is ours.)
# usage: guest/build-client.sh ROOT OUT
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd -P)
root=$(cd "${1:?usage: build-client.sh ROOT OUT}" && pwd -P)
mkdir -p "${2:?usage: build-client.sh ROOT OUT}"; out=$(cd "$2" && pwd -P)
src=$here/blkio-bench.c
[ -x "$out/blkio-bench" ] && [ "$out/blkio-bench" -nt "$src" ] && exit 0
mkdir -p "$out/overlay/upper" "$out/overlay/work" "$out/overlay/merged"
log=$out/build.log
# The whole build in one private mount namespace: the overlay and /proc vanish with it.
unshare -m bash -s "$root" "$out/overlay" "$src" > "$log" 2>&1 <<'SH' || { tail -20 "$log" >&2; exit 1; }
set -euo pipefail
root=$1 ov=$2 src=$3 m=$2/merged
mount -t overlay overlay -o "lowerdir=$root,upperdir=$ov/upper,workdir=$ov/work" "$m"
mount -t proc proc "$m/proc"
mkdir -p "$m/build" && cp "$src" "$m/build/blkio-bench.c"
chroot "$m" sh -euc '
  if [ ! -e /usr/include/blkio.h ] || ! command -v gcc >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o Acquire::Check-Valid-Until=false update -qq
    apt-get install -y -qq -o Acquire::Retries=3 --no-install-recommends gcc libc6-dev libblkio-dev >/dev/null
  fi
  gcc -O2 -Wall -Wextra -Werror -o /build/blkio-bench /build/blkio-bench.c -lblkio -lpthread
'
cp "$m/build/blkio-bench" "$ov/../blkio-bench.new"
SH
mv "$out/blkio-bench.new" "$out/blkio-bench"
echo "built $out/blkio-bench"
