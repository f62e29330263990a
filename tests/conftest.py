"""Fixtures every test directory may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import cluster

RING_ONLY = {**cluster.PINNED, "RINGCORE_DIRECT_BYTES": "0"}


@pytest.fixture
def ring_only() -> Iterator[None]:
    """Pin a test's clusters to the ring (``RINGCORE_DIRECT_BYTES=0``).

    For tests about the ring itself (its frames, forms, slices, fault phases,
    or bits shared with the GPU path): on one host an allreduce at or below the
    small limit otherwise goes one-shot, one above it two-shot (one shot at N=2;
    ``ringcore.plans.oneshot``) and from ``RINGCORE_DIRECT_BYTES`` direct
    (``ringcore.plans.direct``), which have tests of their own
    (``tests/integration/test_oneshot.py``, ``test_twoshot.py``, ``test_direct.py``).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cluster, "BASE_ENV", RING_ONLY)
        yield
