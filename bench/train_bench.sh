#!/usr/bin/env bash
# The training-benchmark figures of bench/RESULTS.md ("ResNet-18 training"), in one go.
#
#   bench/train_bench.sh [PART...]     parts: loopback cluster fusion timeline (default: all)
#
# Every part is one `bench/train_bench.py --compare` (engines alternated, ROUNDS
# rounds, tables of total img/sec and ratios to DDP on gloo); `cluster`, and the
# cluster half of `fusion`, build an emulated 1 Gbit/s cluster of network
# namespaces (root), one rank per host, and tear it down. Logs: bench/out/train_bench-*.log.
# Knobs: ROUNDS (3), PY (.venv/bin/python), BENCH (the benchmark flags below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROUNDS=${ROUNDS:-3}
# 64x64 images, batch 32: a step computes in ~0.35 s on one core; the gradients (46.8 MB) do not depend on it
BENCH=${BENCH:---image-size 64 --batch-size 32 --num-warmup-batches 3 --num-batches-per-iter 5 --num-iters 5}
ENGINES=ddp-gloo,ringcore,ringcore-fp16,ddp-gloo-fp16
FUSION=ringcore@8M,ringcore@0,ringcore@1M,ringcore@4M,ringcore@16M,ringcore@64M
mkdir -p bench/out
stamp=$(date +%Y%m%d-%H%M%S)

compare() {  # NAME ARGS...: one --compare run, its output kept in a log
    local name=$1; shift
    echo "## $name: $PY bench/train_bench.py --compare $* $BENCH"
    # shellcheck disable=SC2086  # BENCH is a list of flags
    $PY bench/train_bench.py --compare "$@" $BENCH 2>&1 | tee "bench/out/train_bench-$stamp-$name.log"
}

for part in "${@:-loopback cluster fusion timeline}"; do
    for p in $part; do
        case $p in
            loopback) compare loopback --np 2,4 --rounds "$ROUNDS" --engines "$ENGINES" ;;
            cluster) compare cluster --cluster 1gbit --np 2,4 --rounds "$ROUNDS" --engines "$ENGINES" ;;
            fusion)
                compare fusion-loopback --np 2 --rounds "$ROUNDS" --engines "$FUSION"
                compare fusion-cluster --cluster 1gbit --np 4 --rounds "$ROUNDS" --engines "$FUSION"
                ;;
            timeline)
                compare timeline-loopback --np 2,4 --rounds 1 --engines ringcore,ringcore-fp16 \
                    --timeline "bench/out/timeline-$stamp/loopback"
                compare timeline-cluster --cluster 1gbit --np 2,4 --rounds 1 --engines ringcore,ringcore-fp16 \
                    --timeline "bench/out/timeline-$stamp/cluster"
                ;;
            *) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
        esac
    done
done
