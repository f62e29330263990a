"""A throwaway local Ray cluster for a test module, and proof that none of its processes outlive it.

The cluster runs on loopback with no dashboard, a small object store, no usage
stats and no auth token, under a temp dir of its own (short: Ray's socket paths
live under it). After ``ray.shutdown()`` no process that descends from the test
run or names that temp dir may remain.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import ray
from ray._private import ray_constants

NODE_IP = "127.0.0.1"


def processes_of(marker: str | None, ancestor: int) -> list[str]:
    """``pid cmdline`` of live processes that descend from ``ancestor`` or whose command line holds ``marker``."""
    parents: dict[int, int] = {}
    lines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parents[int(entry.name)], lines[int(entry.name)] = int(ppid), cmdline
    found = []
    for pid, cmdline in lines.items():
        up = parents.get(pid)
        while up not in (None, 0, 1, ancestor):
            up = parents.get(up)
        if up == ancestor or (marker is not None and marker in cmdline):
            found.append(f"{pid} {cmdline[:160]}")
    return found


def _left_behind(temp_dir: str, before: set[str], timeout: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in processes_of(temp_dir, os.getpid()) if p.split()[0] not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


@contextlib.contextmanager
def local_cluster(num_cpus: int, env_vars: Mapping[str, str], **runtime_env: Any) -> Iterator[str]:
    """``ray.init`` a local cluster of ``num_cpus`` CPUs on loopback; yield its temp dir.

    Args:
        env_vars: The job's environment variables (every actor's, e.g. ``PYTHONPATH``).
        runtime_env: More of the job's runtime env (e.g. a ``worker_process_setup_hook``).

    Raises:
        AssertionError: A process of the cluster outlived ``ray.shutdown()`` (30 s).
    """
    before = {p.split()[0] for p in processes_of(None, os.getpid())}  # this test run's own children
    temp_dir = tempfile.mkdtemp(prefix="rcray", dir="/tmp")
    with pytest.MonkeyPatch.context() as env:
        # Every Ray and ringcore address on loopback (Ray picks the host's interface otherwise): the
        # variable for Ray's processes, the constant it set for this one, which imported Ray already.
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        env.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False, raising=False)
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        env.setenv("RAY_AUTH_MODE", "disabled")  # no token written to ~/.ray for a throwaway cluster
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=100 * 2**20,
            _temp_dir=temp_dir,
            runtime_env={**runtime_env, "env_vars": dict(env_vars)},
        )
        try:
            assert ray.util.get_node_ip_address() == NODE_IP
            yield temp_dir
        finally:
            ray.shutdown()
            left = _left_behind(temp_dir, before)
            shutil.rmtree(temp_dir, ignore_errors=True)
    assert not left, "Ray processes outlived ray.shutdown():\n" + "\n".join(left)
