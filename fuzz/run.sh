#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 30) with cargo-fuzz and libFuzzer, starting from
# the committed seeds in fuzz/corpus/<target>/ (read only: what a run finds goes to a scratch
# corpus, so the tree stays as committed), and prints per target the executions and coverage
# from libFuzzer's final `#N DONE cov: X` line. A crash stops the script with libFuzzer's report
# and the reproducer under fuzz/artifacts/<target>/. Needs a nightly toolchain and cargo-fuzz
# (`cargo install cargo-fuzz --locked`); without them it says `skipped: fuzzing: <reason>` and
# exits 0. Usage: fuzz/run.sh [SECONDS]
set -euo pipefail

seconds=${1:-30}
here=$(cd "$(dirname "$0")" && pwd)
targets=(vhost_user vfio_user blk_chain balloon dma_ops)

if ! command -v rustup >/dev/null || ! rustup toolchain list | grep -q '^nightly'; then
    echo "skipped: fuzzing: no nightly toolchain (rustup toolchain install nightly)"
    exit 0
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "skipped: fuzzing: cargo-fuzz is not installed (cargo install cargo-fuzz --locked)"
    exit 0
fi

cd "$here"
cargo +nightly fuzz build
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in "${targets[@]}"; do
    mkdir -p "$scratch/$t"
    log="$scratch/$t.log"
    if ! cargo +nightly fuzz run "$t" "$scratch/$t" "corpus/$t" -- \
        -max_total_time="$seconds" -print_final_stats=1 >"$log" 2>&1; then
        tail -n 60 "$log"
        echo "fuzz $t: FAILED (reproducer under fuzz/artifacts/$t/)"
        exit 1
    fi
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -n 1)
    execs=$(sed -E 's/^#([0-9]+).*/\1/' <<<"$done_line")
    cov=$(sed -E 's/.*cov: ([0-9]+).*/\1/' <<<"$done_line")
    echo "fuzz $t: ${seconds}s, $execs executions, cov $cov ($done_line)"
done
