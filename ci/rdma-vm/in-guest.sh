#!/bin/bash
# Runs inside the Soft-RoCE guest (started by run-tests.sh): the RDMA test suites, then
# ringcore-bench over ibverbs and over TCP side by side. Argument: the venv's python.
set -uo pipefail
PY="$1"
BIN="$(dirname "$PY")"
OUT="${RINGCORE_RDMA_OUT:?}"
export PATH="$BIN:$PATH" PYTHONDONTWRITEBYTECODE=1
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rs)
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
    step property env RINGCORE_TRANSPORT=ibverbs RINGCORE_TEST_EXAMPLES=2 \
        "${PYTEST[@]}" tests/property -k "n2 or n4 or ring3"
    # The failure suite runs ~20x slower in the guest (6.5 min of a 30-min CI). Left out here:
    # variants that differ from a kept one only in which descriptor field disagrees or in the
    # world size; the host runs all of them over TCP.
    FAILURES=tests/integration/test_failures.py
    SKIP=()
    for id in "test_mismatch_fails_every_rank_and_names_the_culprit["{count,dtype,op,compression,broadcast_root}"]" \
        "test_sigkill_mid_allreduce_fails_every_survivor[3-1]" "test_rank_exiting_during_barrier_fails_the_others[4-0]"; do
        SKIP+=(--deselect "$FAILURES::$id")
    done
    step failures env RINGCORE_TRANSPORT=ibverbs "${PYTEST[@]}" "$FAILURES" "${SKIP[@]}"
    for transport in ibverbs tcp; do
        step "bench-$transport" env RINGCORE_TRANSPORT="$transport" \
            ringcore-bench --np 2 -b 64K -e 4M -f 4 -n 5 -w 2 -c 1 --json "$OUT/bench-$transport-$SECONDS.json"
    done
fi
echo "=== summary"
cat "$OUT/summary.txt"
exit "$rc"
