#!/usr/bin/env bash
# Builds the libvfio-user peer of the DMA-map replay benchmark:
#   target/peers/replay-libvfio-user   (relative to the memvisor checkout)
#
# LIBVFIO_USER_SRC  a libvfio-user source tree; default: HEAD of the bare git dir
#                   LIBVFIO_USER_GIT (default /work/.mirror/nutanix+libvfio-user/repo),
#                   exported into a temporary directory.
# Prints SKIPPED and exits 0 when no source is available or it lacks the DMA API
# replay.c drives. Installs missing build tools with apt-get (needs root).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
out_dir=$root/target/peers
out=$out_dir/replay-libvfio-user
git_dir=${LIBVFIO_USER_GIT:-/work/.mirror/nutanix+libvfio-user/repo}

skip() {
    echo "SKIPPED: libvfio-user peer: $*"
    exit 0
}

tmp=$(mktemp -d /tmp/replay-libvfio-user.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

# --- the source and its commit
commit=unknown
if [ -n "${LIBVFIO_USER_SRC:-}" ]; then
    src=$LIBVFIO_USER_SRC
    [ -d "$src" ] || skip "LIBVFIO_USER_SRC=$src does not exist"
    if git -C "$src" rev-parse HEAD >/dev/null 2>&1; then
        commit=$(git -C "$src" rev-parse HEAD)
        git -C "$src" diff --quiet HEAD 2>/dev/null || commit="$commit-dirty"
    fi
else
    if ! command -v git >/dev/null 2>&1; then
        skip "git is not installed and LIBVFIO_USER_SRC is not set"
    fi
    if ! git --git-dir="$git_dir" rev-parse --verify -q HEAD >/dev/null 2>&1; then
        skip "no source: LIBVFIO_USER_SRC is not set and $git_dir is not a git directory"
    fi
    commit=$(git --git-dir="$git_dir" rev-parse HEAD)
    src=$tmp/src
    mkdir -p "$src"
    git --git-dir="$git_dir" archive HEAD | tar -x -C "$src"
fi

for f in lib/dma.c lib/dma.h lib/private.h include/libvfio-user.h meson.build; do
    [ -f "$src/$f" ] || skip "$src has no $f (not a libvfio-user source tree?)"
done
# replay.c drives the B-tree DMA table (upstream f3742ed, 2026-03-23) with region
# access modes (5d64ebf, 2026-06-04) and later; older trees have another API (and
# before f3742ed a fixed array of 64 regions).
[ -f "$src/lib/btree.h" ] &&
    grep -q 'enum region_access_mode' "$src/lib/dma.h" &&
    grep -q 'LIBVFIO_USER_MAX_DMA_REGIONS' "$src/include/libvfio-user.h" ||
    skip "$src predates the DMA API replay.c uses (needs lib/btree.h, region_access_mode, LIBVFIO_USER_MAX_DMA_REGIONS)"

# --- build tools (Debian bookworm package names)
missing=()
command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
command -v meson >/dev/null 2>&1 || missing+=(meson)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
if command -v pkg-config >/dev/null 2>&1; then
    pkg-config --exists json-c || missing+=(libjson-c-dev)
    # meson.build asks for cmocka unconditionally (for its tests)
    pkg-config --exists cmocka || missing+=(libcmocka-dev)
else
    missing+=(libjson-c-dev libcmocka-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "build.sh: missing ${missing[*]}; install them (apt-get, as root)" >&2
        exit 1
    fi
    echo "build.sh: installing ${missing[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# --- libvfio-user as a static library, optimised, its debug logging off
build=$tmp/build
meson setup "$build" "$src" --buildtype=release -Ddefault_library=static \
    -Ddebug-logs=disabled >"$tmp/meson.log" 2>&1 || {
    cat "$tmp/meson.log" >&2
    echo "build.sh: meson setup failed" >&2
    exit 1
}
ninja -C "$build" lib/libvfio-user.a >"$tmp/ninja.log" 2>&1 || {
    cat "$tmp/ninja.log" >&2
    echo "build.sh: building libvfio-user failed" >&2
    exit 1
}

# --- the harness, against the library's private headers (lib/dma.h is internal)
mkdir -p "$out_dir"
cc -std=gnu11 -O2 -Wall -Wextra -Wno-pointer-arith -Wno-unused-parameter \
    -D_GNU_SOURCE -DLVU_COMMIT="\"$commit\"" \
    -I"$src/include" -I"$src/lib" \
    "$here/replay.c" "$build/lib/libvfio-user.a" \
    $(pkg-config --libs json-c) -lpthread -ldl \
    -o "$out"

echo "built $out (libvfio-user $commit)"
