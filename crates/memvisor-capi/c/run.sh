#!/usr/bin/env bash
# Builds libmemvisor (cargo build --release -p memvisor-capi), compiles the C tests and the
# example against include/memvisor.h with gcc, each twice: linked to the shared library
# (libmemvisor.so) and to the static one (libmemvisor.a), and runs them all. Exits non-zero
# at the first failure.
#
#   crates/memvisor-capi/c/run.sh
#
# CC (default gcc) and CARGO_TARGET_DIR (default the workspace's target/) are honoured. The
# binaries go to $target/capi-c/.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
cc=${CC:-gcc}
target=${CARGO_TARGET_DIR:-$root/target}
lib=$target/release
out=$target/capi-c
cflags=(-Wall -Wextra -Werror -std=c11 -O2 -I"$here/../include" -I"$here/tests")
# What the Rust standard library needs from the system when linked statically.
static_libs=(-lpthread -ldl -lm -lrt -lutil)

(cd "$root" && cargo build --release -q -p memvisor-capi)
mkdir -p "$out"

programs=("$here"/tests/*.c "$here/example.c")
for src in "${programs[@]}"; do
    name=$(basename "$src" .c)
    "$cc" "${cflags[@]}" "$src" -o "$out/$name-shared" -L"$lib" -lmemvisor -Wl,-rpath,"$lib"
    "$cc" "${cflags[@]}" "$src" -o "$out/$name-static" "$lib/libmemvisor.a" "${static_libs[@]}"
done

# The static build must not need libmemvisor.so; the shared one must load it.
static_deps=$(ldd "$out/example-static")
shared_deps=$(ldd "$out/example-shared")
if grep -q libmemvisor <<<"$static_deps"; then
    echo "run.sh: example-static links libmemvisor.so" >&2
    exit 1
fi
if ! grep -q "libmemvisor.so" <<<"$shared_deps"; then
    echo "run.sh: example-shared does not load libmemvisor.so" >&2
    exit 1
fi

failed=0
for src in "${programs[@]}"; do
    name=$(basename "$src" .c)
    for kind in shared static; do
        if "$out/$name-$kind" >"$out/$name-$kind.log" 2>&1; then
            echo "ok: c/$name ($kind)"
        else
            echo "FAILED: c/$name ($kind):" >&2
            cat "$out/$name-$kind.log" >&2
            failed=1
        fi
    done
done
exit $failed
