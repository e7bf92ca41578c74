#!/bin/bash
# Builds the QEMU root for the real-guest trials: Debian trixie with QEMU 11.1.x from
# trixie-backports and its extra block drivers (qemu-block-extra: the blkio driver, libblkio's
# client for the libblkio trial), made with mmdebstrap (40-80 s, 300 MB). Backports is the
# default release there, or qemu-block-extra's dependencies do not resolve. Needs root.
# usage: guest/mkroot.sh DIR        (a root already in DIR only gets what it lacks)
# Facts from ../shared/real-guest (measured 2026-11-22): only QEMU 11.1 has the generic
# vhost-user-test-device-pci and vfio-user-pci; the mirror's Release files may be past their
# Valid-Until, so that check is off.
set -euo pipefail
dest=${1:?usage: mkroot.sh DIR}
bp=trixie-backports
if [ -x "$dest/usr/bin/qemu-system-x86_64" ]; then
  # A root made before the libblkio trial lacks QEMU's blkio driver (qemu-block-extra): add it.
  [ -e "$dest/usr/lib/x86_64-linux-gnu/qemu/block-blkio.so" ] && exit 0
  unshare -m bash -c 'mount -t proc proc "$1/proc" && chroot "$1" sh -c "apt-get -o Acquire::Check-Valid-Until=false update -qq && apt-get install -y -qq -t $2 qemu-block-extra"' _ "$dest" "$bp" > "$dest.update.log" 2>&1 || { tail "$dest.update.log" >&2; exit 1; }
  exit 0
fi
command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; }
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
mkdir -p "$(dirname "$dest")"; rm -rf "$dest.tmp"
# A mirror can fail one download (a CI run once lost a package mid-sync): try three times, and
# show the end of each failed attempt's log so the cause is on record.
for attempt in 1 2 3; do
  rm -rf "$dest.tmp"
  mmdebstrap --mode=root --variant=apt \
    --aptopt='Acquire::Check-Valid-Until "false"' --aptopt='APT::Default-Release "trixie-backports"' \
    --aptopt='Acquire::Retries "3"' \
    --include=qemu-system-x86/$bp,qemu-system-common/$bp,qemu-system-data/$bp,qemu-utils/$bp,qemu-block-extra/$bp,seabios/$bp \
    trixie "$dest.tmp" "deb $mirror trixie main" "deb $mirror $bp main" > "$dest.log" 2>&1 && break
  echo "mkroot.sh: mmdebstrap attempt $attempt failed; the end of its log ($dest.log):" >&2
  tail -n 25 "$dest.log" >&2
  [ "$attempt" = 3 ] && exit 1
  sleep $((attempt * 15))
done
mv "$dest.tmp" "$dest"
"$(dirname "$0")/qemu.sh" "$dest" -version | head -1
