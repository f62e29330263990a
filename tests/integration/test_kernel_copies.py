"""Where the kernel's copies are slow (``RINGCORE_KERNEL_COPIES``), the direct route starts later.

``process_vm_readv`` pins and maps every page it copies; on some hosts that
costs four times a ``memmove`` in cache, and there user-space copies through
shared memory beat the direct route while the buffers stay in cache
(``ringcore.config.Settings.direct_from``). Checked here, across real
processes: ``auto`` measures it at set-up and every rank ends with the same
verdict; ``slow`` sends N=2 allreduces from 384 KiB to 16 MiB through the
ring, and from three ranks those up to 8 MiB through two shots, with results
equal to numpy's and to the ring's bits; ``fast`` keeps the limits of
``tests/integration/test_direct.py``; a bad value is refused at init.
"""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from ringcore.config import SLOW_KERNEL_COPIES, Settings
from ringcore.errors import ConfigError
from ringcore.transport import cma
from tests import tasks
from tests.cluster import Cluster, free_port
from tests.conftest import RING_ONLY
from tests.integration.test_halving_doubling import start_rank
from tests.reference import check_allreduce

KIB, MIB = 1024, 1024 * 1024
SLOW = {"RINGCORE_KERNEL_COPIES": "slow"}
pytestmark = pytest.mark.skipif(not cma.available(), reason="process_vm_readv: Linux only")


def _route(nbytes: int, size: int) -> str:
    """The route slow kernel copies give an ordinary float32 buffer of ``nbytes`` on ``size`` ranks."""
    settings = Settings()
    if nbytes >= settings.direct_from(size, slow_copies=True):
        return "direct"
    if nbytes < settings.mailboxes_below(size, slow_copies=True):
        return "mailboxes"
    return "ring"


def test_relative_speed_is_a_ratio_and_zero_where_the_kernel_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    speed = cma.relative_speed(64 * KIB, rounds=4)
    assert 0.0 < speed < 100.0, speed

    def refuse(self: cma.Channel, there: int, here: int, nbytes: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(cma.Channel, "copy_in", refuse)
    assert cma.relative_speed(64 * KIB, rounds=4) == 0.0


def test_a_bad_value_is_refused_and_ranks_that_differ_fail_at_init_naming_it() -> None:
    with pytest.raises(ConfigError, match="RINGCORE_KERNEL_COPIES"):
        Settings.from_env({"RINGCORE_KERNEL_COPIES": "quick"})
    port = free_port()
    ranks = [
        start_rank(rank, 3, port, {"RINGCORE_KERNEL_COPIES": "fast"} if rank else {}) for rank in range(3)
    ]
    for proc in ranks:
        report = json.loads(proc.communicate(timeout=60)[0].strip().splitlines()[-1])
        assert report["error"] == "ConfigError", report
        assert "ranks disagree on RINGCORE_KERNEL_COPIES" in report["message"], report


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("size", "nbytes"), [(2, 512 * KIB), (3, 2 * MIB)])
def test_auto_measures_and_every_rank_takes_the_route_of_the_median(size: int, nbytes: int) -> None:
    """``nbytes`` goes direct where the copies prove fast, else the ring (N=2) or two shots in two
    pieces (N=3): which one ran is checked against the verdict, and the verdict against the
    measurements every rank saw."""
    x = [np.arange(nbytes // 4, dtype=np.float32) * (rank + 1) for rank in range(size)]
    with Cluster(size, env={"RINGCORE_KERNEL_COPIES": "auto"}, timeout=60) as cluster:
        verdicts = cluster.results(tasks.kernel_copies)
        reports = cluster.results(tasks.allreduce_routed, x, "sum")
    for rank, report in enumerate(reports):
        check_allreduce(report["result"], x, "sum", where=f"rank {rank}")
    assert len({(v["slow"], v["direct_from"]) for v in verdicts}) == 1, verdicts
    if not cluster_can_copy(size):
        assert not verdicts[0]["slow"] and not verdicts[0]["speeds"], "measured where ranks may not copy"
        return
    # every rank measured once and all saw the same measurements: the verdict is their median's
    speeds = sorted(verdicts[0]["speeds"])
    assert [sorted(v["speeds"]) for v in verdicts] == [speeds] * size, verdicts
    assert len(speeds) == size and all(0 < s < 100 for s in speeds), verdicts
    slow = verdicts[0]["slow"]
    assert slow == (statistics.median(speeds) < SLOW_KERNEL_COPIES), verdicts
    route = _route(nbytes, size) if slow else "direct"
    for rank, report in enumerate(reports):
        took = "direct" if report["direct"] else "mailboxes" if report["posted"] else "ring"
        assert took == route, (rank, slow, report["direct"], report["posted"])


def cluster_can_copy(size: int) -> bool:
    """Whether ``size`` ranks of a cluster here may copy from each other (the direct route's condition)."""
    with Cluster(size, timeout=60) as cluster:
        return all(cluster.results(tasks.can_copy))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("size", "sizes"),
    [(2, [256 * KIB, 512 * KIB, 1 * MIB, 4 * MIB + 12, 16 * MIB]), (3, [512 * KIB, 3 * MIB + 12, 8 * MIB])],
)
def test_slow_copies_move_the_routes_and_keep_the_rings_bits(size: int, sizes: list[int]) -> None:
    """N=2: one shot below 384 KiB, the ring up to 16 MiB, direct from there; N=3: two shots (in pieces
    past 1 MiB) up to 8 MiB, direct from there."""
    if not cluster_can_copy(size):
        pytest.skip("ranks may not copy from each other here (Yama ptrace_scope): no direct route")
    rng = np.random.default_rng(size)
    cases = [[rng.integers(-1000, 1000, n // 4).astype(np.float32) for _ in range(size)] for n in sizes]
    routes = [_route(n // 4 * 4, size) for n in sizes]
    assert set(routes) == ({"mailboxes", "ring", "direct"} if size == 2 else {"mailboxes", "direct"}), routes
    with Cluster(size, env=RING_ONLY, timeout=120) as cluster:
        rings = [cluster.results(tasks.allreduce_routed, inputs, "sum") for inputs in cases]
    with Cluster(size, env=SLOW, timeout=120) as cluster:
        assert all(v["slow"] for v in cluster.results(tasks.kernel_copies))
        for inputs, by_ring, route in zip(cases, rings, routes, strict=True):
            reports = cluster.results(tasks.allreduce_routed, inputs, "sum")
            for rank, (report, ring) in enumerate(zip(reports, by_ring, strict=True)):
                where = f"rank {rank} {inputs[0].nbytes} bytes, {route}:"
                took = "direct" if report["direct"] else "mailboxes" if report["posted"] else "ring"
                assert took == route, (where, report["direct"], report["posted"])
                check_allreduce(report["result"], inputs, "sum", where=where)
                assert report["result"].tobytes() == ring["result"].tobytes(), where  # integer-valued
