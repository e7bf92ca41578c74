#!/bin/bash
# Every real-guest trial's negative control, one after another, with a table of what each did.
#
# A negative control breaks what its trial checks (the image changed under the guest, a dirty log
# kept empty, unmaps forgotten, ...) and runs the trial, which must then FAIL: guest/trial.sh
# exits 0 only when it did ("the trial failed as it must"), 3 when a migration gave no verdict
# (inconclusive: run once more), anything else when the broken thing went unnoticed. Most breakages
# are switches only the test-hooks build has (MEMVISOR_TEST_*, crates/memvisor/src/faults.rs);
# this script builds that server and the virtio-rng example with them, beside the plain ones.
#
# They take ~25 minutes on 2 cores, too long for every CI run. So CI does not run them; it checks
# (.ci/run, first steps) that the trials (guest/) and the switches (faults.rs) are what they were at
# the commit docs/trials.md#negative-controls records this script passing at. Change either, run
# this, and record the table and commit it prints there.
#
# usage (root): guest/negatives.sh [PATTERN]   only the controls whose line matches PATTERN
set -u
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "guest/negatives.sh needs root, as the trials do" >&2; exit 2; }
pattern=${1:-}

hooks=$PWD/target/release/memvisor-test-hooks
rng_hooks=$PWD/target/release/examples/rng-test-hooks
set -e
cargo build --release -q -p memvisor-cli --features test-hooks
cp target/release/memvisor "$hooks"
cargo build --release -q -p memvisor-vhost --features test-hooks --example rng
cp target/release/examples/rng "$rng_hooks"
cargo build --release -q -p memvisor-cli
cargo build --release -q -p memvisor-testkit
cargo build --release -q -p memvisor-vhost --example rng
set +e

# One control per line: the server it runs (plain, hooks) | trial.sh's arguments | what it breaks.
controls=$(cat <<'EOF'
plain|blk --negative|the host changes 3 blocks of the image while the guest waits between writing and reading
plain|blk --loop --negative|the host writes data into the range the guest discarded on the loop device
plain|locks --negative|memvisor with --locking off --format raw where QEMU's locks must refuse it
plain|balloon --negative|free page reporting not offered: no memory given back
rng|rng --negative|the virtio-rng device writes zeros
hooks|qmp --negative-throttle|a throttle accepted and never applied
hooks|qmp --negative-resize|a resize never told to the frontend
hooks|mig --negative|the back end's dirty log kept empty (MEMVISOR_TEST_NO_DIRTY_LOG)
hooks|mig --negative --iommu=strict|the same behind the vIOMMU
hooks|mig --negative --no-summary|marks that skip the dirty bitmaps' summary levels (MEMVISOR_TEST_NO_DIRTY_SUMMARY)
hooks|hostile --negative|the race buffer's invalidations acknowledged and ignored
hooks|blk --fixed --negative|nothing goes through registered buffers (MEMVISOR_TEST_NO_FIXED)
hooks|balloon --fixed --negative|discarded pages kept behind registered chunks (MEMVISOR_TEST_FIXED_NO_EVICT)
hooks|blkio --negative|libblkio's writes answered OK and dropped
hooks|blk --frontend-dies --negative|a dead frontend's memory kept mapped
hooks|mig --frontend-dies --negative|the same with its dirty log
hooks|blk --crash --negative|INFLIGHT_SHMFD withheld, batches completed in reverse
hooks|blk --disk-fault --negative|failed I/O answered OK
hooks|blk --memlock --negative|the old locked pins, answered IOERR past the limit
hooks|blk --queue-size=1024 --queue-cap|the old limit of 256 ring entries
hooks|qtest --negative|rings capped at 64 entries
hooks|balloon --stats --negative|statistics never asked for again, no deflate on OOM
hooks|vfio-user --negative|unmaps answered and forgotten (MEMVISOR_TEST_IGNORE_UNMAP)
hooks|vfio-user --unmap-busy|DMA_UNMAP refused with EBUSY while the device holds pins
hooks|vfio-user --client-dies --negative|a dead client's DMA table and pins kept
EOF
)

table=(); failed=0; ran=0; t_all=$SECONDS
while IFS='|' read -r server args what; do
  [ -z "$pattern" ] || [[ "$server|$args|$what" == *$pattern* ]] || continue
  env_=()
  case $server in hooks) env_=(MEMVISOR="$hooks");; rng) env_=(RNG="$rng_hooks");; esac
  echo "== guest/trial.sh $args  ($what)"
  t0=$SECONDS; rc=0
  # shellcheck disable=SC2086  # the arguments are words
  env "${env_[@]}" guest/trial.sh $args < /dev/null || rc=$?
  if [ $rc = 3 ]; then
    echo "guest/trial.sh $args: inconclusive (no verdict), running it once more"
    rc=0; env "${env_[@]}" guest/trial.sh $args < /dev/null || rc=$?
  fi
  s=$((SECONDS - t0)); ran=$((ran + 1))
  if [ $rc = 0 ]; then verdict="FAIL, as it must"; else verdict="**not caught** (exit $rc)"; failed=$((failed + 1)); fi
  table+=("| \`$args\` | $what | $verdict | $s |")
done <<< "$controls"

echo
echo "| control | what it breaks | the trial | s |"
echo "|---|---|---|---:|"
printf '%s\n' "${table[@]}"
echo
commit=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain -- guest/ crates/memvisor/src/faults.rs)" ]; then
  commit="(none: guest/ or faults.rs has changes not committed)"
fi
echo "negative controls: $((ran - failed)) of $ran failed as they must, in $((SECONDS - t_all)) s, at commit $commit"
[ $failed = 0 ] && [ $ran -gt 0 ]
