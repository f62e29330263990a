"""The plan cache: allreduce plans of the layouts a program reduces, least recently used forgotten first.

Training loops reduce arrays of the same few layouts every step, so an
allreduce plan is kept per layout (dtype, shape, strides, op, compression)
and its first turn's preparation is paid once. Programs with ever new shapes
(sequence lengths, ragged batches) must not grow memory without bound, so
the cache is bounded twice: in layouts (:data:`MAX_LAYOUTS`) and in the
scratch its plans hold for themselves (``RINGCORE_PLAN_CACHE_BYTES``; a small
allreduce plan holds two arrays of its size). A hit moves a layout to the
end; making room forgets from the front. Read it through
``Communicator.plan_cache()``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ringcore.plans.allreduce import AllreducePlan

MAX_LAYOUTS = 4096


class PlanCache:
    """Kept allreduce plans by layout key, bounded in count and in bytes of scratch they hold."""

    def __init__(self, max_bytes: int, max_layouts: int = MAX_LAYOUTS) -> None:
        self.max_bytes, self.max_layouts = max_bytes, max_layouts
        self._plans: dict[Any, AllreducePlan] = {}
        self._newest: tuple[Any, AllreducePlan] | None = None  # the key and plan at the end of ``_plans``
        self._held_bytes = 0

    def get(self, key: Any) -> AllreducePlan | None:
        """The plan kept for ``key`` (moved to the end: used most recently), or None (also if unhashable).

        The layout used last is found by ``==`` alone, without hashing the key (a loop over
        one layout: 0.15 us less a call), so keys must hold values whose ``==`` is exact (the
        communicator's: dtypes, tuples of ints, strings, enums, None).
        """
        newest = self._newest  # one read: a consistent pair, whatever another thread does
        try:
            if newest is not None and key == newest[0]:
                return newest[1]
            plan = self._plans.get(key)
        except (TypeError, ValueError):  # unhashable, or an == that is not a bool
            return None
        if plan is not None:  # used most recently: to the end
            self._plans.pop(key, None)  # another thread may have moved it already
            self._plans[key] = plan
            self._newest = (key, plan)
        return plan

    def put(self, key: Any, plan: AllreducePlan) -> None:
        """Keep ``plan`` for ``key``, forgetting the least recently used plans to make room."""
        try:
            hash(key)
        except TypeError:
            return
        if plan.holds > self.max_bytes:
            return  # it runs this once, and is forgotten
        plans = self._plans
        while plans and (len(plans) >= self.max_layouts or self._held_bytes + plan.holds > self.max_bytes):
            self._held_bytes -= plans.pop(next(iter(plans))).holds
        plans[key] = plan
        self._newest = (key, plan)
        self._held_bytes += plan.holds

    def clear(self) -> None:
        """Forget every plan (their layouts' next calls validate and prepare again)."""
        self._plans.clear()
        self._newest = None
        self._held_bytes = 0

    def stats(self) -> dict[str, Any]:
        """``layouts``, ``scratch_bytes`` held, and per form the ``forms`` (layouts) and ``calls`` they ran.

        Calls that took a route chosen per call (:func:`ringcore.plans.direct.route_for`)
        count under the route's name (``calls["direct"]``, ``calls["oneshot"]``, ``calls["twoshot"]``), not
        under their plan's form; ``routed``: per route, the plans with such calls.
        """
        forms: Counter[str] = Counter()
        calls: Counter[str] = Counter()
        routed: Counter[str] = Counter()
        for plan in self._plans.values():
            forms[plan.form] += 1
            calls[plan.form] += plan.calls - plan.direct_calls
            for route in plan.routes:
                if route.calls:
                    calls[route.name] += route.calls
                    routed[route.name] += 1
        return {
            "layouts": len(self._plans),
            "routed": dict(routed),
            "scratch_bytes": self._held_bytes,
            "forms": dict(forms),
            "calls": dict(calls),
        }
