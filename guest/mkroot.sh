#!/bin/bash
# Builds the QEMU root for the real-guest trials: Debian trixie with QEMU 11.1.x from
# trixie-backports, made with mmdebstrap (about 25 s and 560 MB). Needs root.
# usage: guest/mkroot.sh DIR        (does nothing if DIR/usr/bin/qemu-system-x86_64 exists)
# Facts from ../shared/real-guest (measured 2026-11-22): only QEMU 11.1 has the generic
# vhost-user-test-device-pci and vfio-user-pci; the mirror's Release files may be past their
# Valid-Until, so that check is off.
set -euo pipefail
dest=${1:?usage: mkroot.sh DIR}
if [ -x "$dest/usr/bin/qemu-system-x86_64" ]; then exit 0; fi
command -v mmdebstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq mmdebstrap >/dev/null; }
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
bp=trixie-backports
mkdir -p "$(dirname "$dest")"; rm -rf "$dest.tmp"
mmdebstrap --mode=root --variant=apt --quiet \
  --aptopt='Acquire::Check-Valid-Until "false"' \
  --include=qemu-system-x86/$bp,qemu-system-common/$bp,qemu-system-data/$bp,qemu-utils/$bp,seabios/$bp \
  trixie "$dest.tmp" "deb $mirror trixie main" "deb $mirror $bp main"
mv "$dest.tmp" "$dest"
"$(dirname "$0")/qemu.sh" "$dest" -version | head -1
