#!/usr/bin/env bash
# Hierarchical against flat allreduce on an emulated cluster (root; a few minutes).
#
#   bench/hier_bench.sh [RATE] [HOSTS] [PER_HOST] [SIZES] [ROUNDS]   defaults: 1gbit 4 2 1M,16M,64M 2
#
# Builds HOSTS namespaces with RATE links (bench/netns_cluster.sh), each host with
# its own host name and /dev/shm, runs PER_HOST ranks on each, and measures one
# iperf3 stream (the TCP ceiling of a link), then ringcore's allreduce (float32 sum)
# flat over TCP (RINGCORE_TRANSPORT=tcp RINGCORE_HIERARCHICAL=0), flat and
# hierarchical with shared memory inside hosts (RINGCORE_TRANSPORT=auto), alternated
# for ROUNDS rounds; then the bytes each host sent per 64 MiB allreduce. Tears the
# cluster down at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
HOSTS=${2:-4}
PER=${3:-2}
SIZES=${4:-1M,16M,64M}
ROUNDS=${5:-2}
PY=${PY:-.venv/bin/python}
CLUSTER=bench/netns_cluster.sh
N=$(( HOSTS * PER ))

trap 'bash $CLUSTER down >/dev/null 2>&1 || true' EXIT
bash $CLUSTER down >/dev/null 2>&1 || true
bash $CLUSTER up "$HOSTS" "$RATE"
echo "## iperf3, one stream host1 -> host0 ($RATE)"
bash $CLUSTER iperf 0 1 5 | grep -E "receiver"

run() {  # run TRANSPORT HIERARCHICAL SIZES ITERS
    RINGCORE_TRANSPORT=$1 RINGCORE_HIERARCHICAL=$2 PER_HOST=$PER bash $CLUSTER launch "$N" \
        "$PY" -m ringcore.bench.cli --sizes "$3" -n "$4" -w 1 -c 1 | grep -E "^ +[0-9]"
}
for round in $(seq "$ROUNDS"); do
    for cfg in "tcp 0" "auto 0" "auto 1"; do
        set -- $cfg
        echo "## round $round: $HOSTS hosts x $PER ranks, transport=$1 hierarchical=$2"
        run "$1" "$2" "$SIZES" 5
    done
done

sent() { for i in $(seq 0 $(( HOSTS - 1 ))); do tc -n "rch$i" -s qdisc show dev eth0 | grep -m1 -o 'Sent [0-9]*' | awk '{print $2}'; done; }
for cfg in "auto 0" "auto 1"; do
    set -- $cfg
    before=$(sent)
    run "$1" "$2" 64M 4 >/dev/null  # 1 warm-up + 4 timed + 1 checked = 6 allreduces
    after=$(sent)
    paste <(echo "$before") <(echo "$after") | awk -v h="$2" \
        '{ total += $2 - $1 } END { printf "## hierarchical=%s: %.1f MB sent per host per 64 MiB allreduce (headers and ACKs included)\n", h, total / NR / 6 / 1e6 }'
done
