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
    ("kill9", "scatter-reduce", 4),
    ("kill9", "allgather", 2),
    ("kill9", "idle", 3),
    ("sigstop", "scatter-reduce", 3),
    ("sigstop", "idle", 2),
    ("cut_all", "allgather", 4),
    ("cut_one", "scatter-reduce", 3),
]


def ours() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("ringcore-")}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kind", "phase", "size"), SHM_SCENARIOS)
def test_fault_over_shm(
    kind: str, phase: str, size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "ENV", {**faults.ENV, "RINGCORE_TRANSPORT": "shm"})
    before = ours()
    faults.test_fault(kind, phase, size, tmp_path)
    assert ours() <= before, f"left in /dev/shm: {ours() - before}"
