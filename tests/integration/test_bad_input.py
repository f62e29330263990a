"""Bad arguments fail on the calling rank, before anything is sent, and leave the job usable.

One live cluster of 3 ranks serves every case. Only rank 1 makes the bad call
while the others do nothing; then all ranks run a correct allreduce, checked
against numpy. Had the bad call sent a frame or taken a sequence number, that
allreduce would fail or disagree. The cases themselves are built on the rank
(``tasks._bad_input_case``) because pickling would not keep read-only flags or
strides.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests import tasks
from tests.cluster import Cluster, RankError

SIZE = 3
CALLER = 1

# case -> (exact exception type, words the message must contain)
CASES: dict[str, tuple[type[Exception], list[str]]] = {
    "list": (TypeError, ["allreduce buffer", "list"]),
    "str": (TypeError, ["allreduce buffer", "str"]),
    "bytes": (ValueError, ["allreduce buffer", "read-only"]),
    "readonly": (ValueError, ["allreduce buffer", "read-only"]),
    "non_contiguous": (ValueError, ["allreduce buffer", "not contiguous"]),
    "non_contiguous_allgather": (ValueError, ["allgather input", "not contiguous"]),
    "object": (TypeError, ["allreduce buffer", "object"]),
    "bool": (TypeError, ["allreduce buffer", "bool"]),
    "complex": (TypeError, ["allreduce buffer", "complex64"]),
    "big_endian": (TypeError, ["allreduce buffer", "big-endian"]),
    "unknown_op": (ValueError, ["median"]),
    "op_not_a_string": (ValueError, ["unknown reduce op", "3"]),
    "unknown_compression": (ValueError, ["int8"]),
    "op_unhashable": (ValueError, ["unknown reduce op", "['sum']"]),
    "compression_unhashable": (ValueError, ["unknown compression", "['fp16']"]),
    "avg_on_ints": (ValueError, ["allreduce", "avg", "int32"]),
    "fp16_on_ints": (ValueError, ["allreduce", "fp16", "int32"]),
    "async_avg_on_ints": (ValueError, ["allreduce", "avg", "int32"]),
    "reduce_scatter_avg_on_ints": (ValueError, ["reduce_scatter", "avg", "int32"]),
    "reduce_scatter_unknown_op": (ValueError, ["mean"]),
    "broadcast_root_too_big": (ValueError, ["broadcast", f"root {SIZE}", f"size {SIZE}"]),
    "broadcast_root_negative": (ValueError, ["broadcast", "root -1"]),
    "broadcast_root_float": (TypeError, ["broadcast", "root", "float"]),
    "broadcast_root_str": (TypeError, ["broadcast", "root", "str"]),
    "broadcast_root_bool": (TypeError, ["broadcast", "root", "bool"]),
    "broadcast_async_root_too_big": (ValueError, ["broadcast", f"root {SIZE}"]),
    "allgather_0d": (ValueError, ["allgather", "0-d"]),
    "reduce_scatter_0d": (ValueError, ["reduce_scatter", "0-d"]),
}


@pytest.fixture(scope="module")
def cluster() -> Any:
    with Cluster(SIZE) as live:
        yield live


def check_still_usable(cluster: Cluster, seed: int) -> None:
    """A correct allreduce on every rank gives numpy's sum on every rank."""
    rng = np.random.default_rng(seed)
    inputs = [rng.integers(-1000, 1000, size=257).astype(np.int64) for _ in range(SIZE)]
    results = cluster.results(tasks.allreduce, inputs, "sum")
    for result in results:
        np.testing.assert_array_equal(result, np.sum(inputs, axis=0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_before_sending(cluster: Cluster, case: str) -> None:
    expected_type, words = CASES[case]
    (outcome,) = cluster.run(tasks.bad_input, case, ranks=[CALLER], timeout=30)
    assert not isinstance(outcome, RankError), outcome
    type_name, message, unchanged = outcome
    assert type_name == expected_type.__name__, f"{case}: got {type_name}: {message}"
    for word in words:
        assert word in message, f"{case}: {word!r} not in {message!r}"
    assert unchanged, f"{case}: the caller's buffer changed"
    check_still_usable(cluster, seed=len(case))


@pytest.mark.timeout(60)
def test_bad_input_on_every_rank_at_once(cluster: Cluster) -> None:
    """All ranks failing the same validation is just as harmless."""
    outcomes = cluster.run(tasks.bad_input, "avg_on_ints", timeout=30)
    assert [o[0] for o in outcomes] == ["ValueError"] * SIZE, outcomes
    assert all(o[2] for o in outcomes)
    check_still_usable(cluster, seed=1)
