"""Properties of :mod:`tests.property.test_collectives` over shared memory (``RINGCORE_TRANSPORT=shm``).

The same test bodies, collected here with a ``live`` fixture of its own: three
configurations that between them reach the ring in several segments over two
channels (``ring3``), halving-doubling with a folded rank (``halving5``) and
the defaults (``n2``), every rank on this host, so every frame goes through
the rings in ``/dev/shm`` (``ring3``: most of them as pointers, the
single-copy path). A subset of the properties (one per collective and
the special values), to keep the added time near a minute.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.property import test_collectives as base
from tests.property.test_collectives import (  # noqa: F401  (collected here, over shm)
    test_allgather_concatenates,
    test_allreduce_async_in_order,
    test_allreduce_matches_numpy,
    test_allreduce_special_values_match_numpy,
    test_barrier_waits_for_the_last_rank,
    test_broadcast_copies_root,
    test_reduce_scatter_gives_each_rank_its_chunk,
)

SHM = {"RINGCORE_TRANSPORT": "shm", "RINGCORE_SHM_BYTES": "64K"}  # small rings: frames go in pieces


@pytest.fixture(scope="module", params=["n2", "ring3", "halving5"])
def live(request: pytest.FixtureRequest) -> Any:
    cluster = base.LiveCluster(request.param)
    cluster.env = {**cluster.env, **SHM}
    if request.param == "ring3":  # frames of 256 bytes and up as pointers, copied with process_vm_readv
        cluster.env["RINGCORE_SHM_SINGLE_COPY_BYTES"] = "256"
        cluster.env["RINGCORE_SHM_CACHE_BYTES"] = "0"  # in collectives of every size
    yield cluster
    cluster.close()
