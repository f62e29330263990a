"""Rendezvous: launcher discovery and the choice of addresses.

The key-value store ranks meet through lives in :mod:`ringcore.store`
(re-exported here).

Discovery. ``discover()`` finds rank, size and the rendezvous address from,
in order: explicit arguments, ``RINGCORE_*`` (ringcore-run), torchrun's
``RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT``, OpenMPI's ``OMPI_COMM_WORLD_*``,
Slurm's ``SLURM_*``. Under mpirun or srun on one host with no address given,
the store is on loopback at a port derived from the job id. With
``MASTER_PORT`` (torchrun), the store uses ``MASTER_PORT + 1``: torch's own
store already listens on ``MASTER_PORT``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import logging
import os
import socket
import struct
from collections.abc import Mapping
from typing import Any

from ringcore.config import Settings
from ringcore.errors import ConfigError
from ringcore.store import StoreClient, StoreServer

__all__ = ["StoreClient", "StoreServer", "WorldSpec", "discover", "interface_address", "listen_address"]

log = logging.getLogger("ringcore")

# Derived store ports stay below Linux's default ephemeral range (32768-60999), so a
# connection's local port elsewhere on the host cannot already hold the one a job derives.
_PORT_BASE, _PORT_SPAN = 20000, 32768 - 20000


# --------------------------------------------------------------------------- discovery


@dataclasses.dataclass(frozen=True)
class WorldSpec:
    """Who this process is and where the ranks meet."""

    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    addr: str
    port: int
    source: str


def discover(
    settings: Settings,
    env: Mapping[str, str] | None = None,
    rank: int | None = None,
    size: int | None = None,
    addr: str | None = None,
    port: int | None = None,
) -> WorldSpec:
    """Find rank, size and rendezvous address; explicit arguments win.

    Raises:
        ConfigError: incomplete or contradictory settings, or a multi-host job
            with no rendezvous address.
    """
    env = os.environ if env is None else env
    found = _from_launcher(settings, env)
    source = found.pop("source")
    rank = found.get("rank") if rank is None else rank
    size = found.get("size") if size is None else size
    if rank is None and size is None:
        rank, size, source = 0, 1, "default (no launcher found)"
    if rank is None or size is None:
        raise ConfigError(
            f"{source}: rank is {rank}, size is {size}; set both (e.g. RINGCORE_RANK and RINGCORE_SIZE)"
        )
    if not 0 <= rank < size:
        raise ConfigError(f"{source}: rank {rank} is outside a world of size {size}")
    addr = addr or found.get("addr")
    port = port or found.get("port")
    if size > 1 and addr is None:
        if not found.get("single_host"):
            raise ConfigError(
                f"{source}: no rendezvous address for a job across hosts; set RINGCORE_ADDR "
                "(or MASTER_ADDR) to rank 0's address, and RINGCORE_PORT to a free port"
            )
        addr = "127.0.0.1"
    if size > 1 and port is None:
        port = _derived_port(found.get("job_id"), source, settings.port_range)
    return WorldSpec(
        rank,
        size,
        found.get("local_rank"),
        found.get("local_size"),
        addr or "127.0.0.1",
        int(port or 0),
        source,
    )


def _from_launcher(settings: Settings, env: Mapping[str, str]) -> dict[str, Any]:
    if settings.rank is not None or settings.size is not None:
        return {
            "source": "RINGCORE_* variables",
            "rank": settings.rank,
            "size": settings.size,
            "local_rank": settings.local_rank,
            "local_size": settings.local_size,
            "addr": settings.addr,
            "port": settings.port,
            "single_host": False,
        }
    master_port = _int(env, "MASTER_PORT")
    # torch's own TCPStore (torchrun's agent, init_process_group) owns MASTER_PORT: take the next one.
    shared = {
        "addr": settings.addr or env.get("MASTER_ADDR") or None,
        "port": settings.port or (master_port + 1 if master_port else None),
    }
    if "RANK" in env and "WORLD_SIZE" in env:
        return {
            "source": "torchrun variables",
            "rank": _int(env, "RANK"),
            "size": _int(env, "WORLD_SIZE"),
            "local_rank": _int(env, "LOCAL_RANK"),
            "local_size": _int(env, "LOCAL_WORLD_SIZE"),
            "single_host": False,
            **shared,
        }
    if "OMPI_COMM_WORLD_RANK" in env:
        size = _int(env, "OMPI_COMM_WORLD_SIZE")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or f"ppid-{os.getppid()}"
        return {
            "source": "OpenMPI variables",
            "rank": _int(env, "OMPI_COMM_WORLD_RANK"),
            "size": size,
            "local_rank": _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            "local_size": local_size,
            "single_host": local_size == size,
            "job_id": job,
            **shared,
        }
    if "SLURM_PROCID" in env:
        nodes = _int(env, "SLURM_JOB_NUM_NODES") or _int(env, "SLURM_NNODES")
        job = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        return {
            "source": "Slurm variables",
            "rank": _int(env, "SLURM_PROCID"),
            "size": _int(env, "SLURM_NTASKS"),
            "local_rank": _int(env, "SLURM_LOCALID"),
            "local_size": None,
            "single_host": nodes == 1,
            "job_id": job,
            **shared,
        }
    return {"source": "environment", **shared}


def _int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def _derived_port(job_id: str | None, source: str, port_range: tuple[int, int] | None) -> int:
    """The same port on every rank of a job: a hash of its id, inside RINGCORE_PORT_RANGE if set."""
    if not job_id:
        raise ConfigError(f"{source}: no rendezvous port; set RINGCORE_PORT (or MASTER_PORT)")
    base, span = (
        (port_range[0], port_range[1] - port_range[0] + 1) if port_range else (_PORT_BASE, _PORT_SPAN)
    )
    digest = hashlib.sha256(job_id.encode()).digest()
    return base + int.from_bytes(digest[:4], "little") % span


def listen_address(settings: Settings, store_addr: str, store_port: int) -> str:
    """The local address to listen on: ``RINGCORE_IFNAME``'s, else the one routing to the store."""
    if settings.ifname:
        return interface_address(settings.ifname)
    family = socket.AF_INET6 if ":" in store_addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((store_addr, store_port or 9))  # UDP connect sends nothing
            return str(probe.getsockname()[0])
        except OSError as err:
            raise ConfigError(f"no route to the rendezvous address {store_addr}: {err}") from None


def interface_address(ifname: str) -> str:
    """IPv4 address of a network interface (like ``NCCL_SOCKET_IFNAME``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(
                probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15])
            )  # SIOCGIFADDR
        except OSError:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ConfigError(
                f"RINGCORE_IFNAME={ifname!r} has no IPv4 address; interfaces: {names}"
            ) from None
    return socket.inet_ntoa(packed[20:24])
