"""torch's ``env://`` variables under mpirun and srun, from their own variables.

Launchers. ``env://`` needs ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` before the "ringcore" backend is ever called. torchrun and ringcore-run
set them. Under mpirun or srun, :func:`ringcore.torch.process_group.register` (run by ``import
ringcore.torch``) sets each one that is missing (``os.environ.setdefault``,
as DeepSpeed does) when ``RANK`` and ``WORLD_SIZE`` are both absent and
``OMPI_COMM_WORLD_RANK`` or ``SLURM_PROCID`` is present: rank, size, local
rank and size, and ``MASTER_ADDR`` as ringcore's own discovery finds them
(loopback on one host; ``RINGCORE_ADDR`` or ``MASTER_ADDR`` across hosts),
and ``MASTER_PORT`` one below the port ringcore's store would use (derived
from the job id, or ``RINGCORE_PORT``). ringcore's rule for torchrun's
variables puts its store on ``MASTER_PORT + 1``, so a later ``ringcore.init()``
still meets on that same port, and torch's store never takes it. Across hosts
with no address to meet at, nothing is set and a warning says why (torch then
asks for ``MASTER_ADDR``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from ringcore.config import Settings
from ringcore.errors import ConfigError
from ringcore.rendezvous import discover

__all__ = ["export_launcher_env"]

log = logging.getLogger("ringcore")


def export_launcher_env(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set torch's ``RANK``... ``MASTER_PORT`` from mpirun's or srun's variables, where missing.

    Args:
        env: the environment to fill (default ``os.environ``).

    Returns:
        The variables it set (empty when it left ``env`` alone).
    """
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env:
        return {}
    if "OMPI_COMM_WORLD_RANK" not in env and "SLURM_PROCID" not in env:
        return {}
    try:
        world = discover(Settings.from_env(env), env)
    except ConfigError as err:  # torch's own error about MASTER_ADDR follows; say why here
        log.warning("ringcore.torch: torch's RANK/MASTER_* not set from the launcher: %s", err)
        return {}
    values = {
        "RANK": world.rank,
        "WORLD_SIZE": world.size,
        "LOCAL_RANK": world.local_rank,
        "LOCAL_WORLD_SIZE": world.local_size,
        "MASTER_ADDR": world.addr,
        "MASTER_PORT": world.port - 1 if world.port > 1 else None,  # ringcore's store: MASTER_PORT + 1
    }
    added = {name: str(value) for name, value in values.items() if value is not None and name not in env}
    env.update(added)
    return added
