#!/bin/bash
# Builds QEMU's qos-test (the qtest binary that holds tests/qtest/vhost-user-blk-test.c) from
# Debian's QEMU source package, once: a trixie build root (mmdebstrap, ~2 min), the source
# (apt-get source, ~40 MB), a minimal configure (x86_64-softmmu, default features off; tools
# and the vhost-user-blk server on, which the test needs) and `ninja tests/qtest/qos-test`
# alone. Measured from nothing on the 2 shared cores here (2026-11-28): 4 min 4 s in all,
# configure 31 s and ninja 129 s of it; with a cargo build beside it, configure took 102 s and
# ninja 358 s (without tools) plus 256 s to add them. Leaves
# DIR/qos-test and DIR/qos-test.version, and removes the build root; a DIR that has them is
# kept as it is. Needs root.
# usage: guest/mkqtest.sh DIR
# The source: the QEMU the trials run is 11.1.3 from trixie-backports, but Debian's mirror
# here lists that source package and answers 404 for its files (checked 2026-11-28:
# qemu_11.1.3+ds.orig.tar.xz and its .dsc); trixie's 10.0.13 source is served. So the
# backports source is tried first and trixie's taken if it cannot be had; the version built
# is written down, and the trial says which qos-test ran against which QEMU.
set -euo pipefail
dest=${1:?usage: mkqtest.sh DIR}
[ -x "$dest/qos-test" ] && [ -s "$dest/qos-test.version" ] && exit 0
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
root=$dest/root
mkdir -p "$dest"
if [ ! -x "$root/usr/bin/meson" ]; then
  command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; }
  rm -rf "$root.tmp"
  mmdebstrap --mode=root --variant=apt --aptopt='Acquire::Check-Valid-Until "false"' \
    --aptopt='Acquire::Retries "3"' \
    --include=build-essential,meson,ninja-build,pkg-config,libglib2.0-dev,zlib1g-dev,libpixman-1-dev,libfdt-dev,python3,python3-venv,flex,bison,dpkg-dev,ca-certificates \
    trixie "$root.tmp" "deb $mirror trixie main" "deb-src $mirror trixie main" \
    "deb $mirror trixie-backports main" "deb-src $mirror trixie-backports main" > "$dest/root.log" 2>&1 \
    || { tail -n 25 "$dest/root.log" >&2; exit 1; }
  mv "$root.tmp" "$root"
fi
in_root() { unshare -m bash -c 'mount -t proc proc "$1/proc" && chroot "$1" bash -c "$2"' _ "$root" "$1"; }
in_root '
set -e
mkdir -p /src && cd /src
if [ ! -d qemu ]; then
  apt-get -o Acquire::Check-Valid-Until=false update -qq
  rm -f qemu_*
  for from in trixie-backports trixie; do
    if apt-get source -qq --download-only qemu/$from >/dev/null 2>&1; then break; fi
    echo "mkqtest: QEMU source from $from cannot be had from the mirror" >&2
  done
  dpkg-source -x qemu_*.dsc qemu >/dev/null
fi
cd qemu
v=$(dpkg-parsechangelog -S Version)
mkdir -p build && cd build
t0=$(date +%s)
[ -f build.ninja ] || ../configure --target-list=x86_64-softmmu --without-default-features --disable-docs \
  --disable-werror --disable-install-blobs --enable-tools --enable-vhost-user \
  --enable-vhost-user-blk-server > /src/configure.log 2>&1 || { tail -30 /src/configure.log >&2; exit 1; }
t1=$(date +%s)
ninja tests/qtest/qos-test > /src/ninja.log 2>&1 || { tail -30 /src/ninja.log >&2; exit 1; }
t2=$(date +%s)
echo "mkqtest: configure $((t1 - t0)) s, ninja $((t2 - t1)) s"
echo "qos-test of QEMU $v (Debian source)" > /src/qos-test.version
' > "$dest/build.log" 2>&1 || { tail -n 30 "$dest/build.log" >&2; exit 1; }
cp "$root/src/qemu/build/tests/qtest/qos-test" "$dest/qos-test"
cp "$root/src/qos-test.version" "$dest/qos-test.version"
# The build root, source and build tree (1.4 GB) served their purpose: qos-test runs in the
# trials' QEMU root, and another build starts over (~4 min).
rm -rf "$root"
cat "$dest/qos-test.version"
