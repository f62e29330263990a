#!/usr/bin/env bash
# The emulated-cluster measurements of bench/RESULTS.md, in one go (root; a few minutes).
#
#   bench/cluster_suite.sh [RATE] [HOSTS] [SIZES]     defaults: 1gbit 4 16M,64M
#
# Builds HOSTS namespaces with RATE links (bench/netns_cluster.sh), measures one
# iperf3 stream (the TCP ceiling of a link), then ringcore allreduce (float32 sum),
# ringcore with --compression fp16, and Gloo through torch.distributed, each rank on
# its own host; tears the cluster down at the end. Output: iperf's goodput, then
# nccl-tests lines for ringcore and JSON lines for Gloo.
set -euo pipefail
cd "$(dirname "$0")/.."
RATE=${1:-1gbit}
HOSTS=${2:-4}
SIZES=${3:-16M,64M}
ITERS=${ITERS:-5}
PY=${PY:-.venv/bin/python}
CLUSTER=bench/netns_cluster.sh

trap 'bash $CLUSTER down >/dev/null 2>&1 || true' EXIT
bash $CLUSTER down >/dev/null 2>&1 || true
bash $CLUSTER up "$HOSTS" "$RATE"
echo "## iperf3, one stream host1 -> host0 ($RATE)"
bash $CLUSTER iperf 0 1 5 | grep -E "receiver|sender"

echo "## ringcore allreduce, $HOSTS hosts, $RATE"
bash $CLUSTER launch "$HOSTS" "$PY" -m ringcore.bench.cli --sizes "$SIZES" -n "$ITERS" -w 1 -c 1 | grep -E "^ +[0-9]|wrong"
echo "## ringcore allreduce --compression fp16, $HOSTS hosts, $RATE (busbw in float32 bytes)"
bash $CLUSTER launch "$HOSTS" "$PY" -m ringcore.bench.cli --sizes "$SIZES" -n "$ITERS" -w 1 -c 1 --compression fp16 | grep -E "^ +[0-9]"

echo "## gloo allreduce, $HOSTS hosts, $RATE"
port=29623
pids=()
for i in $(seq 0 $((HOSTS - 1))); do
    ip netns exec "rch$i" env GLOO_SOCKET_IFNAME=eth0 "$PY" -m ringcore.bench.peers.gloo_worker \
        --np "$HOSTS" --rank "$i" --addr "$(bash $CLUSTER addr 0)" --port "$port" --ifname eth0 \
        --sizes "$SIZES" --iters "$ITERS" --warmup 1 2>/dev/null | grep '"busbw"' &
    pids+=("$!")
done
for p in "${pids[@]}"; do wait "$p" || true; done
