#!/bin/bash
# Runs a program from the QEMU root with the current directory as its working directory, so
# relative paths (sockets, kernel, images, logs) mean the same to QEMU and to back ends on the
# host. A private mount namespace keeps the bind mounts out of the host's view. Needs root.
# usage: [BIN=qemu-storage-daemon] guest/qemu.sh ROOT ARGS...
set -euo pipefail
root=$(cd "${1:?usage: qemu.sh ROOT ARGS...}" && pwd -P); shift
mkdir -p "$root/w"
exec unshare -m bash -c 'mount --bind "$1" "$2/w" && mount -t proc proc "$2/proc" && mount -t sysfs sys "$2/sys" && r=$2 && shift 2 && exec chroot "$r" env -C /w "${BIN:-qemu-system-x86_64}" "$@"' _ "$PWD" "$root" "$@"
