"""Descriptors: the 64-bit signature every frame carries, and the message that names who differs."""

from __future__ import annotations

import pytest

from ringcore.descriptor import Descriptor, explain, rank_list

BASE = Descriptor("allreduce", 3, "float32", (1000,), "sum", None, "none")


def test_signature_is_stable_and_64_bit() -> None:
    sig = BASE.signature()
    assert sig == Descriptor("allreduce", 3, "float32", (1000,), "sum", None, "none").signature()
    assert 0 <= sig < 2**64


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
