#!/usr/bin/env bash
# The side-by-side translate benchmark (translate.c): memvisor's C API against libvfio-user's
# dma_addr_to_sgl, at 64 / 1,000 / 100,000 mappings, and the Rust half (benches/translate.rs:
# the Rust API and the C API's functions on the same addresses, in one process).
#
#   crates/memvisor-capi/c/bench/run.sh [--runs N] [--iters N]
#
# libvfio-user is built as peers/libvfio-user/build.sh builds it (HEAD of
# /work/.mirror/nutanix+libvfio-user/repo or LIBVFIO_USER_SRC; meson, release, debug logs
# off; build tools from apt-get when missing), kept under target/peers/capi-libvfio-user/.
# Without it, the libvfio-user rows print `skipped: ...` and the rest runs.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../../.." && pwd)
target=${CARGO_TARGET_DIR:-$root/target}
out=$target/capi-c
lvu=$target/peers/capi-libvfio-user
git_dir=${LIBVFIO_USER_GIT:-/work/.mirror/nutanix+libvfio-user/repo}

(cd "$root" && cargo build --release -q -p memvisor-capi)
mkdir -p "$out"

# --- libvfio-user, static, as peers/libvfio-user/build.sh makes it
with_lvu=()
lvu_why=
src=${LIBVFIO_USER_SRC:-$lvu/src}
if [ -z "${LIBVFIO_USER_SRC:-}" ] && [ ! -f "$src/lib/dma.h" ]; then
    if git --git-dir="$git_dir" rev-parse --verify -q HEAD >/dev/null 2>&1; then
        mkdir -p "$src"
        git --git-dir="$git_dir" archive HEAD | tar -x -C "$src"
    else
        lvu_why="no source: $git_dir is not a git directory and LIBVFIO_USER_SRC is not set"
    fi
fi
if [ -z "$lvu_why" ] && ! grep -q 'enum region_access_mode' "$src/lib/dma.h" 2>/dev/null; then
    lvu_why="$src predates the DMA API (region_access_mode) this benchmark drives"
fi
if [ -z "$lvu_why" ] && ! command -v meson >/dev/null 2>&1; then
    # The tools peers/libvfio-user/build.sh installs; it is the one place that knows them.
    "$root/peers/libvfio-user/build.sh" >/dev/null || true
    command -v meson >/dev/null 2>&1 || lvu_why="meson is missing (peers/libvfio-user/build.sh installs it as root)"
fi
if [ -z "$lvu_why" ]; then
    if [ ! -f "$lvu/build/lib/libvfio-user.a" ]; then
        rm -rf "$lvu/build"
        meson setup "$lvu/build" "$src" --buildtype=release -Ddefault_library=static \
            -Ddebug-logs=disabled >"$lvu/meson.log" 2>&1 || lvu_why="meson setup failed: $lvu/meson.log"
        [ -n "$lvu_why" ] || ninja -C "$lvu/build" lib/libvfio-user.a >"$lvu/ninja.log" 2>&1 \
            || lvu_why="building libvfio-user failed: $lvu/ninja.log"
    fi
fi
if [ -z "$lvu_why" ]; then
    with_lvu=(-DWITH_LIBVFIO_USER -I"$src/include" -I"$src/lib" "$lvu/build/lib/libvfio-user.a"
              $(pkg-config --libs json-c))
fi

gcc -std=gnu11 -O2 -Wall -Wextra -Werror -Wno-pointer-arith -Wno-unused-parameter \
    -I"$here/../../include" "$here/translate.c" "$target/release/libmemvisor.a" \
    "${with_lvu[@]}" -lpthread -ldl -lm -lrt -lutil -o "$out/bench-translate"

[ -z "$lvu_why" ] || echo "skipped: libvfio-user rows: $lvu_why"
echo "# C: N variant median_ns min_ns max_ns"
"$out/bench-translate" "$@"
echo "# Rust (benches/translate.rs, a process of its own, same addresses): N variant median_ns min_ns max_ns"
(cd "$root" && cargo bench -q -p memvisor-capi --bench translate -- "$@")
