"""Where each rank runs: ranks, local ranks and local sizes from the nodes Ray placed the workers on.

Ray places one worker per placement-group bundle; bundle ``i`` landed on node
``node_ids[i]``. Ranks are handed out node by node, in the order the nodes
first appear among the bundles, and in bundle order within a node, so the
ranks of one node are consecutive (as Horovod's ``RayExecutor`` and
``ringcore-run`` number them) and bundle 0 is always rank 0. A rank's local
rank is its index among the ranks of its node; its local size is how many
ranks that node holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Slot:
    """One worker: its bundle, its node, and the ranks ringcore gives it."""

    bundle: int
    rank: int
    local_rank: int
    local_size: int
    node_id: str
    node_ip: str
    pid: int = 0  # the actor's process, once known

    def where(self) -> str:
        """``rank 2 (pid 4711) on node 10.0.0.7 (node id 3f2a9c81d0e4...)``, for messages."""
        pid = f" (pid {self.pid})" if self.pid else ""
        return f"rank {self.rank}{pid} on node {self.node_ip} (node id {self.node_id[:12]}...)"


def assign_ranks(nodes: Sequence[tuple[str, str]]) -> list[Slot]:
    """Ranks for the workers of bundles ``0..n-1``, grouped by node.

    Args:
        nodes: ``(node_id, node_ip)`` of the worker of each bundle, in bundle order.

    Returns:
        One :class:`Slot` per bundle, in bundle order.
    """
    by_node: dict[str, list[int]] = {}
    for bundle, (node_id, _) in enumerate(nodes):
        by_node.setdefault(node_id, []).append(bundle)
    slots: list[Slot] = []
    rank = 0
    for node_id, bundles in by_node.items():  # dicts keep the order nodes first appeared in
        for local_rank, bundle in enumerate(bundles):
            slots.append(Slot(bundle, rank, local_rank, len(bundles), node_id, nodes[bundle][1]))
            rank += 1
    return sorted(slots, key=lambda slot: slot.bundle)


def rank_env(slot: Slot, size: int, addr: str, port: int, secret: str) -> dict[str, str]:
    """The ``RINGCORE_*`` variables that make ``ringcore.init()`` in this worker join the job."""
    return {
        "RINGCORE_RANK": str(slot.rank),
        "RINGCORE_SIZE": str(size),
        "RINGCORE_LOCAL_RANK": str(slot.local_rank),
        "RINGCORE_LOCAL_SIZE": str(slot.local_size),
        "RINGCORE_ADDR": addr,
        "RINGCORE_PORT": str(port),
        "RINGCORE_SECRET": secret,
    }
