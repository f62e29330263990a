"""Fixtures every test directory may use."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import cluster

RING_ONLY = {"RINGCORE_DIRECT_BYTES": "0"}


@pytest.fixture
def ring_only() -> Iterator[None]:
    """Pin a test's clusters to the ring (``RINGCORE_DIRECT_BYTES=0``).

    For tests about the ring itself (its frames, forms, slices, fault phases,
    or bits shared with the GPU path): on one host an allreduce above the small
    limit otherwise goes direct (``ringcore.plans.direct``), and one at or below
    it one-shot (``ringcore.plans.oneshot``), which have tests of their own
    (``tests/integration/test_direct.py``, ``test_oneshot.py``).
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cluster, "BASE_ENV", RING_ONLY)
        yield
