#!/usr/bin/env bash
# A/B of two revisions of ringcore: ringcore-bench time per allreduce, run back to back
# in ABBA order so drift hits both alike (issue 25's "what must not change" check).
#
#   bench/ab_revisions.sh BASE HEAD [ROUNDS]     e.g. bench/ab_revisions.sh b02283e HEAD 4
#
# Each revision is checked out in a worktree under ${AB_DIR:-/tmp/ringcore-ab}; every round
# runs float32 sum at ${AB_SIZES:-4K,64K,1M,16M,64M} and fp16 at 16M (torch's casts), N=2 and N=4,
# and the table gives the median time of each side, the ratio and the ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?base revision}; head=${2:?head revision}; rounds=${3:-4}
dir=${AB_DIR:-/tmp/ringcore-ab}; py=$PWD/.venv/bin/python; log=$dir/ab.log
mkdir -p "$dir"; : > "$log"
for side in base head; do
    rev=$([ $side = base ] && echo "$base" || echo "$head")
    git worktree remove --force "$dir/$side" 2>/dev/null || true
    git worktree add -f --detach "$dir/$side" "$rev" -q
done
bench() {  # SIDE N ROUND
    local tree=$dir/$1
    (cd "$tree" && PYTHONPATH=$tree $py -m ringcore.bench.cli --np "$2" --sizes "${AB_SIZES:-4K,64K,1M,16M,64M}" -n 40 -w 5 -c 0 |
        awk -v s="$1" -v n="$2" -v r="$3" '/^ +[0-9]+ /{print r, n, s, $1, "float32", $6}'
     cd "$tree" && PYTHONPATH=$tree $py -m ringcore.bench.cli --np "$2" --sizes 16M -n 20 -w 3 -c 0 \
        --compression fp16 --with-torch | awk -v s="$1" -v n="$2" -v r="$3" '/^ +[0-9]+ /{print r, n, s, $1, "fp16", $6}') >> "$log"
}
for r in $(seq 1 "$rounds"); do
    for n in 2 4; do for side in base head head base; do bench $side $n "$r"; done; done
done
$py - "$log" <<'PY'
import collections, statistics, sys
times = collections.defaultdict(list)
for line in open(sys.argv[1]):
    _, n, side, size, wire, t = line.split()
    times[(int(n), wire, int(size), side)].append(float(t))
print("| N | size | wire | base (us) | head (us) | head/base | base range | head range |")
print("| --- | ---: | --- | ---: | ---: | ---: | --- | --- |")
for n, wire, size in sorted({k[:3] for k in times}):
    b, h = times[(n, wire, size, "base")], times[(n, wire, size, "head")]
    name = f"{size >> 20}M" if size >= 1 << 20 else f"{size >> 10}K"
    mb, mh = statistics.median(b), statistics.median(h)
    print(f"| {n} | {name} | {wire} | {mb:.1f} | {mh:.1f} | {mh / mb:.2f} | {min(b):.0f}-{max(b):.0f} | {min(h):.0f}-{max(h):.0f} |")
PY
