"""What a failed in-place allreduce leaves in the caller's buffer, element by element.

A rank is killed (SIGKILL, from inside its own allreduce: ``tasks.SendTrigger``)
partway through the second of two allreduces. By default the in-place paths
reduce straight into the caller's buffer, so a survivor's buffer may hold
partial results; the error's note names the elements that may. What must
hold on every survivor:

* outside the elements the note names, every element is the rank's input,
  bit for bit (or, before the range a sliced run says is done, the full sum);
* inside them, every element is its input or the sum of the inputs of a
  subset of the ranks that includes this rank: never a value from another
  element, a half-written one, or a sum that counts a rank twice;
* with ``RINGCORE_ATOMIC=1`` the note names nothing and the buffer is the
  input, bit for bit.

Rank r's input is ``2**r + 2**N * (i % 4096)`` (float32, exact): the low N
bits of a sum name its subset, the rest must be ``|subset| * 2**N * (i % 4096)``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcore
from tests import tasks
from tests.cluster import Background, Cluster, RankError, qualified

# the ring, halving-doubling and slices, whose steps the victim dies in (the direct route:
# tests/integration/test_direct.py)
pytestmark = pytest.mark.usefixtures("ring_only")

RING = {"RINGCORE_SEGMENT_BYTES": "64K", "RINGCORE_HALVING_BYTES": "0", "RINGCORE_SLICE_BYTES": "48M"}
SLICED = {"RINGCORE_SEGMENT_BYTES": "16K", "RINGCORE_SLICE_BYTES": "64K", "RINGCORE_SMALL_BYTES": "4K"}

# name -> (size, victim, env, float32 elements, how far through its sends the victim dies, atomic)
SCENARIOS: dict[str, tuple[int, int, dict[str, str], int, float, bool]] = {
    "ring-scatter-reduce": (3, 1, RING, 1_000_000, 0.25, False),
    "ring-allgather": (4, 0, RING, 1_000_000, 0.8, False),  # rank 0 hosts the store
    "ring-atomic": (3, 2, RING, 1_000_000, 0.4, True),
    "halving-doubling": (4, 3, {}, 250_000, 0.5, False),
    "halving-doubling-atomic": (4, 1, {}, 250_000, 0.5, True),
    "sliced": (3, 2, SLICED, 500_000, 0.53, False),
    "small": (3, 1, {}, 1000, 0.5, False),  # the bound latency path
    "ring-5-ranks": (5, 2, RING, 1_000_000, 0.55, False),
    "halving-doubling-extras": (6, 4, {}, 250_000, 0.5, False),  # rank 4 folds into rank 0
}


def decode(buf: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per element: the subset of ranks (a bit mask) whose inputs sum to it, and whether it is such a sum."""
    whole = buf.astype(np.int64)
    k = np.arange(buf.size) % 4096
    masks = whole % 2**size
    members = np.unpackbits(masks.astype(np.uint8)[:, None], axis=1).sum(axis=1)
    valid = (whole == buf) & (masks > 0) & (whole - masks == members * 2**size * k)
    return masks, valid


def noted(notes: str, count: int) -> tuple[int, tuple[int, int]]:
    """The elements a failure's notes say are done (``[0, done)``) and may hold partial sums."""
    done = re.search(rf"elements \[0, (\d+)\) of {count} already hold", notes)
    exposed = re.search(rf"elements \[(\d+), (\d+)\) of {count} may hold partial sums", notes)
    first = int(done.group(1)) if done else 0
    return first, (int(exposed.group(1)), int(exposed.group(2))) if exposed else (first, first)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_failed_allreduce_leaves_inputs_or_partial_sums(scenario: str, tmp_path: Path) -> None:
    size, victim, env, count, fraction, atomic = SCENARIOS[scenario]
    fault = (victim, "kill9", str(tmp_path / "killed_at"), fraction)
    survivors = [r for r in range(size) if r != victim]
    full = 2**size - 1
    env = {**env, "RINGCORE_TIMEOUT": "20", "RINGCORE_ATOMIC": str(int(atomic))}
    with Cluster(size, env=env) as cluster:
        doomed = Background(cluster, tasks.partial_sums_after_fault, count, fault, ranks=[victim], timeout=60)
        reports = cluster.run(tasks.partial_sums_after_fault, count, fault, ranks=survivors, timeout=60)
        (dead,) = doomed.join(30)
    assert isinstance(dead, RankError) and dead.type_name == "dead", dead
    partial = {}  # how many elements held a partial sum (neither the input nor the sum): for the log
    for rank, report in zip(survivors, reports, strict=True):
        assert not isinstance(report, RankError), (rank, report)
        assert report["error"] == qualified(ringcore.PeerFailure) and report["peer"] == victim, (rank, report)
        assert report["rounds"] >= 1, (rank, report)
        buf: Any = report["buf"]
        original = (2.0**rank + 2.0**size * (np.arange(count) % 4096)).astype(np.float32)
        done, (start, end) = noted(report["notes"], count)
        if atomic:
            assert (done, start, end) == (0, 0, 0), (rank, report["notes"])
            assert buf.tobytes() == original.tobytes(), f"rank {rank}: RINGCORE_ATOMIC=1 changed the buffer"
            continue
        masks, valid = decode(buf, size)
        assert valid[:done].all() and (masks[:done] == full).all(), (
            f"rank {rank}: a done element is not the sum"
        )
        outside = np.ones(count, bool)
        outside[:done] = outside[start:end] = False
        changed = np.flatnonzero(outside & (buf != original))
        assert not changed.size, (
            f"rank {rank}: {changed.size} elements outside [{start}, {end}) changed, e.g. {changed[:5]}"
        )
        inside = slice(start, end)
        wrong = np.flatnonzero(~valid[inside] | (masks[inside] & (1 << rank) == 0)) + start
        assert not wrong.size, (
            f"rank {rank}: {wrong.size} elements in [{start}, {end}) are no partial sum with this rank's input, "
            f"e.g. element {wrong[0]} = {buf[wrong[0]]!r}"
        )
        partial[rank] = int(((masks[inside] != 1 << rank) & (masks[inside] != full)).sum())
    print(f"\n{scenario}: elements holding a partial sum, by survivor: {partial}")
