"""``RINGCORE_SOCKET_BUFFER``: a size reaches every data socket; 0 leaves them to the kernel.

Linux reports twice the size asked for (socket(7): the kernel doubles it for
its bookkeeping), and a size under ``net.core.rmem_max``/``wmem_max`` is
never capped, so 64 KiB must read back as 128 KiB. Small buffers push a
multi-segment allreduce through many partial sends and receives; the results
are checked against numpy either way.
"""

from __future__ import annotations

import socket
from typing import Any

import numpy as np
import pytest

from ringcore.sockets import size_buffers
from tests.cluster import Cluster

COUNT = 300_001  # float32, ~1.2 MB: many 64 KiB segments per rank


def buffers(sock: socket.socket) -> tuple[int, int]:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), sock.getsockopt(
        socket.SOL_SOCKET, socket.SO_RCVBUF
    )


def test_zero_leaves_the_kernels_sizes_and_a_size_is_set() -> None:
    with socket.socket() as fresh, socket.socket() as left, socket.socket() as sized:
        size_buffers(left, 0)
        size_buffers(sized, 64 * 1024)
        assert buffers(left) == buffers(fresh)
        assert buffers(sized) == (128 * 1024, 128 * 1024)


def sized_allreduce(comm: Any) -> dict[str, Any]:
    """The data sockets' buffer sizes, and whether a multi-segment allreduce matched numpy."""
    x = np.arange(COUNT, dtype=np.float32) * (comm.rank + 1)
    want = np.arange(COUNT, dtype=np.float32) * sum(range(1, comm.size + 1))
    comm.allreduce(x)
    return {
        "sizes": sorted({buffers(conn.sock) for conn in comm.transport.conns.values()}),
        "exact": bool(np.array_equal(x, want)),
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["0", "64K"])
def test_the_setting_reaches_the_data_sockets(setting: str) -> None:
    env = {"RINGCORE_SOCKET_BUFFER": setting, "RINGCORE_SEGMENT_BYTES": "64K"}
    with Cluster(3, env=env) as cluster:
        reports = cluster.results(sized_allreduce)
    for rank, report in enumerate(reports):
        assert report["exact"], (rank, report)
        if setting == "64K":
            assert report["sizes"] == [(128 * 1024, 128 * 1024)], (rank, report)
