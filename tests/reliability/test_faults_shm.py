"""The fault scenarios of :mod:`tests.reliability.test_faults` over shared memory (``RINGCORE_TRANSPORT=shm``).

Every rank of a :class:`~tests.cluster.Cluster` is on this host, so all data
moves through the rings in ``/dev/shm`` and the TCP mesh carries only
liveness and ABORT: these cases check that a survivor waiting on a ring (or
blocked on its doorbell) still learns of the fault from TCP, within the same
bound and with the same blame, and that nothing is left in ``/dev/shm``.

A representative subset, one case per kind of fault and a spread of phases
and sizes (about 30 s), not the whole matrix: the rules that decide blame and
buffers are the executors', shared with TCP, which runs every case.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.reliability import test_faults as faults

SHM_SCENARIOS = [
    ("kill9", "scatter-reduce", 4, "1M"),
    ("kill9", "allgather", 2, "1M"),
    ("kill9", "idle", 3, "1M"),
    ("sigstop", "scatter-reduce", 3, "1M"),
    ("sigstop", "idle", 2, "1M"),
    ("cut_all", "allgather", 4, "1M"),
    ("cut_one", "scatter-reduce", 3, "1M"),
    # every frame of 1 KiB or more as a pointer the receiver copies (process_vm_readv)
    ("kill9", "scatter-reduce", 3, "1K"),
    ("kill9", "allgather", 4, "1K"),
    ("sigstop", "allgather", 2, "1K"),
    ("cut_one", "allgather", 3, "1K"),
]


def ours() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("ringcore-")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "phase", "size", "single_copy"), SHM_SCENARIOS)
def test_fault_over_shm(
    kind: str, phase: str, size: int, single_copy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {
        "RINGCORE_TRANSPORT": "shm",
        "RINGCORE_SHM_SINGLE_COPY_BYTES": single_copy,
        "RINGCORE_SHM_CACHE_BYTES": "0",
    }
    monkeypatch.setattr(faults, "ENV", {**faults.ENV, **env})
    before = ours()
    faults.test_fault(kind, phase, size, tmp_path)
    assert ours() <= before, f"left in /dev/shm: {ours() - before}"
