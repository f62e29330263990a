"""The plan cache's bounds: least recently used layouts go first, in count and in bytes held."""

from __future__ import annotations

from dataclasses import dataclass

from ringcore.plans.cache import PlanCache


@dataclass
class FakeRoute:
    name: str
    calls: int


@dataclass
class FakePlan:
    holds: int = 0
    form: str = "general"
    calls: int = 0
    direct_calls: int = 0
    routes: tuple[FakeRoute, ...] = ()  # routes chosen per call


def test_hot_layouts_outlive_one_off_ones_in_a_full_cache() -> None:
    """With room for 16, four layouts used every round outlive ten new ones per round."""
    cache = PlanCache(max_bytes=1 << 30, max_layouts=16)
    hot = {key: FakePlan() for key in ("a", "b", "c", "d")}
    for key, plan in hot.items():
        cache.put(key, plan)
    for round_ in range(6):
        for key, plan in hot.items():
            assert cache.get(key) is plan, (round_, key)  # never forgotten, never made again
        for i in range(10):
            key = f"one-off-{round_}-{i}"
            assert cache.get(key) is None
            cache.put(key, FakePlan())
        assert cache.stats()["layouts"] == min(16, 4 + 10 * (round_ + 1))
    assert cache.get("one-off-0-0") is None  # forgotten long ago
    assert cache.get("one-off-5-9") is not None


def test_scratch_held_is_bounded_and_given_back() -> None:
    cache = PlanCache(max_bytes=100)
    for i in range(10):
        cache.put(i, FakePlan(holds=30, form="small", calls=i))
    stats = cache.stats()
    assert stats["scratch_bytes"] == 90 and stats["layouts"] == 3
    assert stats["forms"] == {"small": 3} and stats["calls"] == {"small": 7 + 8 + 9}
    cache.put(
        "sym", FakePlan(holds=0, form="in_place", calls=5, direct_calls=4, routes=(FakeRoute("direct", 4),))
    )
    cache.put(
        "one",
        FakePlan(holds=0, form="unprepared", calls=2, direct_calls=2, routes=(FakeRoute("oneshot", 2),)),
    )
    stats = cache.stats()
    assert stats["calls"] == {"small": 7 + 8 + 9, "in_place": 1, "direct": 4, "unprepared": 0, "oneshot": 2}
    assert stats["routed"] == {"direct": 1, "oneshot": 1}
    assert [cache.get(i) is not None for i in (6, 7, 8, 9)] == [False, True, True, True]
    cache.put("big", FakePlan(holds=101))  # more than the bound on its own: not kept, nothing forgotten
    assert cache.get("big") is None and cache.stats()["layouts"] == 5
    cache.clear()
    assert cache.stats() == {"layouts": 0, "routed": {}, "scratch_bytes": 0, "forms": {}, "calls": {}}


def test_an_unhashable_key_is_neither_found_nor_kept() -> None:
    cache = PlanCache(max_bytes=100)
    key = ("float32", (4,), [1, 2])
    assert cache.get(key) is None
    cache.put(key, FakePlan())
    assert cache.stats()["layouts"] == 0


def test_the_newest_layout_is_found_by_equality_and_a_bad_argument_is_a_miss() -> None:
    """The last layout used is found without hashing; a key whose comparison raises (an array
    passed as ``op``) or that is unhashable is a miss, for validation to name, not an error here."""
    import numpy as np

    cache = PlanCache(max_bytes=100)
    plan = FakePlan()
    key = (np.dtype(np.float32), (4,), (4,), "sum", None)
    cache.put(key, plan)
    assert cache.get((np.dtype(np.float32), (4,), (4,), "sum", None)) is plan  # an equal key, built anew
    assert cache.get((np.dtype(np.float32), (4,), (4,), np.array([1, 2]), None)) is None
    assert cache.get((np.dtype(np.float32), (4,), (4,), ["sum"], None)) is None
    assert cache.get(key) is plan
    cache.put(("other",), FakePlan())
    assert cache.get(key) is plan  # no longer the newest: found by its hash, and the newest again
    cache.clear()
    assert cache.get(key) is None  # forgotten, the newest too


def test_an_array_passed_as_op_is_never_served_a_kept_plan() -> None:
    """``np.array("sum") == "sum"`` is true, so a key holding it would match the kept layout's: the
    communicator keys only plain ops and compressions, and validation names the bad one every time."""
    import numpy as np
    import pytest

    from ringcore.comm import Communicator
    from ringcore.config import Settings

    comm = Communicator(0, 1, 0, 1, Settings(), None)
    try:
        buf = np.ones(4, np.float32)
        comm.allreduce(buf)  # the layout is kept, and is the newest
        for op in (np.array("sum"), np.array(["sum"])):
            with pytest.raises(ValueError, match="unknown reduce op"):
                comm.allreduce(buf, op=op)
        comm.allreduce(buf, op=np.str_("sum"))  # a str subclass: validated each call, not kept
        assert comm.plan_cache()["layouts"] == 1
    finally:
        comm.shutdown()
