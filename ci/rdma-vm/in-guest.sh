#!/bin/bash
# Runs inside the Soft-RoCE guest (started by run-tests.sh): the RDMA test suites, then
# ringcore-bench over ibverbs. Argument: the venv's python.
set -uo pipefail
PY="$1"
BIN="$(dirname "$PY")"
OUT="${RINGCORE_RDMA_OUT:?}"
export PATH="$BIN:$PATH" PYTHONDONTWRITEBYTECODE=1
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rs --durations=5)  # durations: where CI time goes
rc=0
: > "$OUT/summary.txt"

step() {  # step NAME COMMAND...: run, time, and record the outcome
    local name="$1" start=$SECONDS status
    shift
    echo "=== [$name] $*"
    "$@" 2>&1 | tee "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    printf '%-12s rc=%s  %4ss  %s\n' "$name" "$status" "$(( SECONDS - start ))" \
        "$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/$name.log" | tail -1)" >> "$OUT/summary.txt"
    [ "$status" = 0 ] || rc=1
}

# Jumbo frames, as RoCE fabrics use: rxe's MTU follows eth0's (1500 -> 1024, 9000 -> 4096).
ip link set eth0 mtu 9000 2>/dev/null && sleep 1
ibv_devinfo -d rxe0 | grep -E 'state|active_mtu' || true
step conformance "${PYTEST[@]}" tests/conformance -k ibverbs
step rdma-jobs "${PYTEST[@]}" tests/rdma
if [ "${RDMA_VM_QUICK:-0}" != 1 ]; then
    # Code runs 10-30x slower in the guest, so the guest runs the suites' ibverbs-specific
    # share; the host runs every case of them over TCP. Ranks fork from a preloaded server
    # (tests/cluster.py), so a test no longer pays 10-30 s of imports per rank here.
    # Property: N=2 (one round of recursive doubling, one ring step); tests/rdma runs the
    # segmented ring on 2 and 3 ranks and halving-doubling on 4 against numpy.
    step property env RINGCORE_TRANSPORT=ibverbs RINGCORE_TEST_EXAMPLES=2 \
        "${PYTEST[@]}" tests/property -k "n2"
    # Failures: the paths where the transport matters (a mismatch found mid-data, a peer that
    # exits, dies before, or stops; a failed call leaving the buffer alone; re-init). Plain
    # mismatches and kill -9 over ibverbs are in tests/rdma.
    step failures env RINGCORE_TRANSPORT=ibverbs "${PYTEST[@]}" tests/integration/test_failures.py \
        -k "late_odd_rank or untouched or exiting_during_barrier_fails_the_others[3-2] or dead_before or stopped_rank or repeated_init"
    step bench-ibverbs env RINGCORE_TRANSPORT=ibverbs \
        ringcore-bench --np 2 -b 64K -e 1M -f 16 -n 5 -w 2 -c 1 --json "$OUT/bench-ibverbs.json"
fi
echo "=== summary"
cat "$OUT/summary.txt"
exit "$rc"
