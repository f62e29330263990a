"""pyverbs present but no RDMA device: ``ibverbs`` fails clearly on every rank, ``auto`` does without RDMA.

Runs where pyverbs imports and ``/sys/class/infiniband`` is empty: on the host,
with the venv ``ci/rdma-vm/run-tests.sh`` builds (before it boots the guest).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests import tasks
from tests.cluster import Cluster

HAS_PYVERBS = importlib.util.find_spec("pyverbs") is not None
HAS_DEVICE = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))

pytestmark = [
    pytest.mark.skipif(not HAS_PYVERBS, reason="needs pyverbs (the ci/rdma-vm venv has it)"),
    pytest.mark.skipif(HAS_DEVICE, reason="this machine has an RDMA device"),
    pytest.mark.timeout(120),
]


def test_ibverbs_without_a_device_fails_init_on_every_rank() -> None:
    with pytest.raises(RuntimeError) as info:
        Cluster(2, env={"RINGCORE_TRANSPORT": "ibverbs"}, timeout=60)
    message = str(info.value)
    assert message.count("type_name='ConfigError'") == 2, message
    assert "no RDMA device found" in message and "RINGCORE_TRANSPORT=tcp" in message, message


def test_auto_without_a_device_uses_shared_memory_on_one_host() -> None:
    """Without RDMA, ``auto`` carries these two ranks (one host) through shared memory, TCP between hosts."""
    with Cluster(2, env={"RINGCORE_TRANSPORT": "auto"}, timeout=60) as cluster:
        assert [r["transport"] for r in cluster.results(tasks.transport_report)] == ["ShmTransport"] * 2
