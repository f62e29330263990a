#!/bin/bash
# Run ringcore's RDMA suite for real: boot one QEMU guest with Soft-RoCE (rdma_rxe) and
# run every ibverbs test and the ibverbs-vs-TCP benchmark in it (see ci/rdma-vm/README.md).
#
#   bash ci/rdma-vm/run-tests.sh            # from the repository root; 6-12 min on 2 cores
#
# Env: RDMA_VM_BUILD     writable folder for the kernel, initramfs and venv (default: .rdma-vm)
#      RDMA_VM_TIMEOUT   seconds the guest may run (default 1500)
#      RDMA_VM_QUICK=1   only the transport conformance suite and the RDMA job tests
# Exit code: the guest's (0 = every step passed), 124 on timeout, 125 if the guest died.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
export RDMA_VM_BUILD="${RDMA_VM_BUILD:-$REPO/.rdma-vm}"
mkdir -p "$RDMA_VM_BUILD"
export RDMA_VM_BUILD="$(cd "$RDMA_VM_BUILD" && pwd)"
case "$RDMA_VM_BUILD/" in
    /tmp/*|/var/tmp/*|/run/*) echo "RDMA_VM_BUILD must not be under /tmp, /var/tmp or /run: the guest mounts fresh tmpfs there" >&2; exit 2;;
esac
t0=$(date +%s)

# Kernel, initramfs, QEMU, rdma-core and Debian's python3-pyverbs (rdma-core 44: the ABI of
# the installed libibverbs; PyPI's pyverbs 59 would need its own rdma-core build).
timeout 900 bash "$HERE/setup-host.sh"

# Debian's /usr/bin/python3 sees python3-pyverbs; the venv adds ringcore and its test tools.
VENV="$RDMA_VM_BUILD/venv"
if [ ! -x "$VENV/bin/python" ]; then
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
if [ ! -f "$VENV/.ringcore-installed" ] || [ "$REPO/pyproject.toml" -nt "$VENV/.ringcore-installed" ]; then
    timeout 600 "$VENV/bin/pip" install -q --disable-pip-version-check -e "$REPO[test]"
    touch "$VENV/.ringcore-installed"
fi
"$VENV/bin/python" -c "import pyverbs, ringcore" || { echo "pyverbs or ringcore not importable in $VENV" >&2; exit 1; }

OUT="$REPO/.rdma-vm-results"
rm -rf "$OUT"; mkdir -p "$OUT"

# On the host first: pyverbs imports but there is no device, so ibverbs must fail clearly and auto use TCP.
echo "=== host: no RDMA device"
(cd "$REPO" && timeout 300 "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests/rdma/test_no_device.py)
echo "=== booting the Soft-RoCE guest (set-up took $(( $(date +%s) - t0 )) s)"
set +e
timeout $(( ${RDMA_VM_TIMEOUT:-1500} + 60 )) bash "$HERE/vm-run.sh" --workdir "$REPO" --timeout "${RDMA_VM_TIMEOUT:-1500}" \
    -- \
    env RINGCORE_RDMA_OUT="$OUT" RDMA_VM_QUICK="${RDMA_VM_QUICK:-0}" bash "$HERE/in-guest.sh" "$VENV/bin/python" \
    | grep -v '^\[ *[0-9.]*\] '   # drop the guest kernel's console lines
rc=${PIPESTATUS[0]}
set -e
echo "=== RDMA suite: rc=$rc in $(( $(date +%s) - t0 )) s; logs and results in $OUT"
[ -f "$OUT/summary.txt" ] && cat "$OUT/summary.txt"
exit "$rc"
