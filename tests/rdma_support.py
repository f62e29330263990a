"""Whether this machine has a usable RDMA verbs device, and helpers for tests that need one."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from typing import Any

import pytest

from ringcore.errors import CollectiveTimeout


def rdma_unavailable() -> str | None:
    """Why RDMA tests cannot run here, or ``None`` when they can."""
    if importlib.util.find_spec("pyverbs") is None:
        return "pyverbs is not importable (install python3-pyverbs; ci/rdma-vm runs these tests in a Soft-RoCE guest)"
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        devices = []
    if not devices:
        return "no RDMA device in /sys/class/infiniband (run ci/rdma-vm/run-tests.sh for a Soft-RoCE guest)"
    return None


REASON = rdma_unavailable()
needs_rdma = pytest.mark.skipif(REASON is not None, reason=f"RDMA test: {REASON}")


class DictStore:
    """An in-process stand-in for the rendezvous store (``set`` / blocking ``get``)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: Any) -> None:
        with self.cond:
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while key not in self.data:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CollectiveTimeout(f"no {key!r} in the test store")
                self.cond.wait(left)
            return self.data[key]
