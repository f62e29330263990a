"""Descriptors: the 64-bit signature every frame carries, and the message that names who differs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringcore.descriptor import Descriptor, explain, rank_list

BASE = Descriptor("allreduce", 3, "float32", (1000,), "sum", None, "none")


VARIANTS = [
    BASE,
    BASE._replace(kind="broadcast", op=None, root=2),
    BASE._replace(dtype="bfloat16", shape=(3, 5, 7), compression="fp16"),
    BASE._replace(kind="allgather", shape=(), op=None),
]
PRINT_SIGNATURES = (
    "from ringcore.descriptor import Descriptor\n"
    "for fields in {fields!r}:\n"
    "    print(Descriptor(*fields).signature())\n"
)


def test_signature_is_the_same_in_every_process_and_64_bit() -> None:
    """Ranks compare signatures computed in different processes: no per-process salt (hash
    randomisation, object ids) may enter it. Computed afresh in an interpreter with another hash
    seed, not read back from this process's cache."""
    here = [d.signature() for d in VARIANTS]
    assert all(0 <= sig < 2**64 for sig in here) and len(set(here)) == len(here)
    script = PRINT_SIGNATURES.format(fields=[tuple(d) for d in VARIANTS])
    env = {**os.environ, "PYTHONHASHSEED": "random"}  # a seed of its own, whatever this process runs with
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert [int(line) for line in out.stdout.split()] == here


def test_signature_ignores_the_sequence_number() -> None:
    assert BASE._replace(seq=99).signature() == BASE.signature()


@pytest.mark.parametrize(
    "changes",
    [
        {"kind": "reduce_scatter"},
        {"dtype": "float64"},
        {"shape": (1024,)},
        {"shape": (10, 100)},
        {"op": "max"},
        {"root": 0},
        {"compression": "fp16"},
    ],
)
def test_signature_differs_when_an_argument_differs(changes: dict) -> None:
    assert BASE._replace(**changes).signature() != BASE.signature()


def test_record_round_trips_shape_as_list() -> None:
    record = BASE.record()
    assert record["shape"] == [1000] and record["kind"] == "allreduce" and record["seq"] == 3


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([3], "rank 3"), ([0, 1, 2], "ranks 0-2"), ([0, 2, 5], "ranks 0, 2, 5"), ([4, 5], "ranks 4-5")],
)
def test_rank_list(ranks: list[int], text: str) -> None:
    assert rank_list(ranks) == text


def test_explain_names_ranks_and_values() -> None:
    other = BASE._replace(shape=(1024,))
    records = {0: BASE.record(), 1: BASE.record(), 2: BASE.record(), 3: other.record()}
    message = explain(BASE, records, 4)
    assert message == "allreduce #3: ranks disagree on shape: ranks 0-2 passed (1000,), rank 3 passed (1024,)"


def test_explain_several_fields_and_missing_ranks() -> None:
    records = {
        0: BASE.record(),
        2: BASE._replace(dtype="float64", op="max").record(),
    }
    message = explain(BASE, records, 4)
    assert message.startswith("allreduce #3: ranks disagree on ")
    assert "dtype: rank 0 passed float32, rank 2 passed float64" in message
    assert "op: rank 0 passed sum, rank 2 passed max" in message
    assert "no report from ranks 1, 3" in message


def test_explain_when_everyone_agrees() -> None:
    message = explain(BASE, {0: BASE.record(), 1: BASE.record()}, 2)
    assert "every rank that reported asked for the same" in message
    assert "no report" not in message
