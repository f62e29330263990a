#!/usr/bin/env bash
# One go on a freshly lent GPU machine (CuPy, PyTorch, pytest there; nothing is installed):
#   1. the GPU tests (tests/gpu: kernels bitwise vs numpy on the GPU, cupy/torch collectives
#      N=2..4 vs the host path, the staged executor on the real device, fp16 error bounds),
#   2. the GPU benchmark (bench/gpu_bench.py), whose table is printed last.
# Budget: 8 minutes in all (tests up to ~4.5 min, benchmark ~3 min); each part is bounded.
#
#   bash bench/gpu_check.sh              # from the repository root or anywhere
#   OUT=/some/dir bash bench/gpu_check.sh  # logs and JSON go to $OUT (default /tmp/ringcore-gpu)
#   PYTHON=python3.12 SIZES=4M,64M bash bench/gpu_check.sh
#
# ringcore needs numpy and msgpack; if msgpack is missing there, carry this checkout's
# .venv/lib/python3.*/site-packages/msgpack along: it is found and put on PYTHONPATH.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/ringcore-gpu}
SIZES=${SIZES:-4M,64M,256M}
NPS=${NPS:-2,4}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c "import msgpack" 2>/dev/null; then
    for dir in "$ROOT"/.venv/lib/python3*/site-packages; do
        if [ -d "$dir/msgpack" ]; then
            mkdir -p "$OUT/vendor" && ln -sfn "$dir/msgpack" "$OUT/vendor/msgpack"
            export PYTHONPATH="$PYTHONPATH:$OUT/vendor"
        fi
    done
fi

echo "== environment"
"$PY" - <<'PY' || { echo "FAILED: the environment cannot run the GPU path (see above)"; exit 2; }
import sys, numpy, msgpack, pytest
import cupy
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__, "pytest", pytest.__version__)
n = cupy.cuda.runtime.getDeviceCount()
props = cupy.cuda.runtime.getDeviceProperties(0)
print("GPUs:", n, props["name"].decode(), "sm_%d%d" % (props["major"], props["minor"]))
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.cuda.is_available())
except ImportError:
    print("torch: not installed (torch tests skip)")
PY

echo "== GPU tests (tests/gpu)"
# CI runs what needs no GPU (fake device, mock CuPy, nvcc/NVRTC compile checks); the rest runs
# here, the host-side kernel rules too (this machine's numpy may differ from CI's)
timeout 280 "$PY" -m pytest -q -rfEs --maxfail=20 -p no:cacheprovider tests/gpu \
    --ignore=tests/gpu/test_fake_cluster.py --ignore=tests/gpu/test_compile.py \
    --ignore=tests/gpu/test_mock_cupy.py \
    -o addopts="" --timeout 250 -W ignore::DeprecationWarning \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tee "$OUT/gpu-tests.log" | tail -40
TESTS=${PIPESTATUS[0]}
echo "tests exit status: $TESTS"

echo "== GPU benchmark"
timeout 200 "$PY" bench/gpu_bench.py --kernel-mib 256 --reps 10 --sizes "$SIZES" --np "$NPS" \
    --iters 3 --timeout 90 --json "$OUT/gpu-bench.json" 2>&1 | grep -v "RINGCORE_SECRET" | tee "$OUT/gpu-bench.log"
BENCH=${PIPESTATUS[0]}

echo
echo "== summary: tests exit $TESTS, benchmark exit $BENCH (logs in $OUT)"
grep -E "passed|failed|error" "$OUT/gpu-tests.log" | tail -1
sed -n '/^kernel /,$p' "$OUT/gpu-bench.log"
[ "$TESTS" = 0 ] && [ "$BENCH" = 0 ]
