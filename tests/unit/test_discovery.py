"""rendezvous.discover: rank, size and rendezvous address from each launcher's conventions."""

from __future__ import annotations

import pytest

from ringcore.config import Settings
from ringcore.errors import ConfigError
from ringcore.rendezvous import discover


def find(env: dict[str, str], **explicit: object):
    return discover(Settings.from_env(env), env, **explicit)  # type: ignore[arg-type]


def test_no_launcher_is_a_single_rank() -> None:
    spec = find({})
    assert (spec.rank, spec.size) == (0, 1)
    assert spec.addr == "127.0.0.1"


def test_ringcore_variables() -> None:
    env = {"RINGCORE_RANK": "2", "RINGCORE_SIZE": "4", "RINGCORE_ADDR": "10.1.2.3", "RINGCORE_PORT": "5000",
           "RINGCORE_LOCAL_RANK": "0", "RINGCORE_LOCAL_SIZE": "2"}  # fmt: skip
    spec = find(env)
    assert (spec.rank, spec.size, spec.addr, spec.port) == (2, 4, "10.1.2.3", 5000)
    assert (spec.local_rank, spec.local_size) == (0, 2)
    assert "RINGCORE" in spec.source


def test_ringcore_variables_without_address() -> None:
    with pytest.raises(ConfigError, match="RINGCORE_ADDR"):
        find({"RINGCORE_RANK": "0", "RINGCORE_SIZE": "2"})


def test_torchrun_variables() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3",
           "MASTER_ADDR": "node0", "MASTER_PORT": "29400"}  # fmt: skip
    spec = find(env)
    assert (spec.rank, spec.size, spec.local_rank, spec.local_size) == (1, 3, 1, 3)
    assert spec.addr == "node0"
    assert spec.port == 29401  # torch's own store owns MASTER_PORT
    assert "torchrun" in spec.source


def test_ringcore_address_overrides_master_addr() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "node0", "MASTER_PORT": "29400",
           "RINGCORE_ADDR": "10.0.0.1", "RINGCORE_PORT": "6000"}  # fmt: skip
    spec = find(env)
    assert (spec.addr, spec.port) == ("10.0.0.1", 6000)


def ompi(rank: int, size: int, local_size: int, job: str = "1234@1") -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size), "OMPI_MCA_ess_base_jobid": job}  # fmt: skip


def test_openmpi_single_host_uses_loopback_and_a_derived_port() -> None:
    specs = [find(ompi(r, 4, 4)) for r in range(4)]
    assert [s.rank for s in specs] == [0, 1, 2, 3]
    assert {s.addr for s in specs} == {"127.0.0.1"}
    ports = {s.port for s in specs}
    assert len(ports) == 1, "every rank of a job must derive the same port"
    (port,) = ports
    assert 1024 < port < 65536
    assert "OpenMPI" in specs[0].source


def test_openmpi_derived_port_depends_on_the_job() -> None:
    ports = {find(ompi(0, 2, 2, job=f"job-{i}")).port for i in range(20)}
    assert len(ports) > 1


def test_openmpi_multi_host_needs_an_address() -> None:
    with pytest.raises(ConfigError, match="RINGCORE_ADDR"):
        find(ompi(0, 4, 2))
    spec = find({**ompi(0, 4, 2), "RINGCORE_ADDR": "10.0.0.9", "RINGCORE_PORT": "7000"})
    assert (spec.addr, spec.port, spec.size) == ("10.0.0.9", 7000, 4)


def slurm(rank: int, ntasks: int, nodes: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(ntasks), "SLURM_LOCALID": str(rank),
            "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_ID": "777", "SLURM_STEP_ID": "0"}  # fmt: skip


def test_slurm_single_node() -> None:
    specs = [find(slurm(r, 3, 1)) for r in range(3)]
    assert [(s.rank, s.size) for s in specs] == [(0, 3), (1, 3), (2, 3)]
    assert {s.addr for s in specs} == {"127.0.0.1"}
    assert len({s.port for s in specs}) == 1
    assert "Slurm" in specs[0].source


def test_slurm_multi_node_needs_an_address() -> None:
    with pytest.raises(ConfigError, match="RINGCORE_ADDR"):
        find(slurm(0, 4, 2))


def test_explicit_arguments_win() -> None:
    spec = find(ompi(1, 4, 4), rank=3, size=5, addr="192.168.0.2", port=9999)
    assert (spec.rank, spec.size, spec.addr, spec.port) == (3, 5, "192.168.0.2", 9999)


@pytest.mark.parametrize(
    ("env", "explicit"),
    [
        ({"RINGCORE_RANK": "4", "RINGCORE_SIZE": "4", "RINGCORE_ADDR": "h", "RINGCORE_PORT": "1"}, {}),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, {}),
        ({}, {"rank": 1, "size": 1}),
        ({}, {"rank": -1, "size": 2, "addr": "h", "port": 1}),
    ],
)
def test_rank_outside_the_world(env: dict[str, str], explicit: dict) -> None:
    with pytest.raises(ConfigError, match="outside a world"):
        find(env, **explicit)


def test_rank_without_size() -> None:
    with pytest.raises(ConfigError, match="RINGCORE_SIZE"):
        find({"RINGCORE_RANK": "0"})


def test_garbage_launcher_variable_names_it() -> None:
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        find({"RANK": "0", "WORLD_SIZE": "two"})


def test_derived_port_stays_inside_the_port_range() -> None:
    """Under mpirun with no port given, the derived store port honours RINGCORE_PORT_RANGE."""
    settings = Settings.from_env({"RINGCORE_PORT_RANGE": "40000-40010"})
    for job in ("1", "77", "prterun-host-123@1"):
        env = {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_MCA_ess_base_jobid": job,
        }
        assert 40000 <= discover(settings, env).port <= 40010


def test_derived_port_avoids_the_ephemeral_range() -> None:
    """Without a range, derived ports sit below the host's ephemeral ports.

    A port in the ephemeral range can already be the local end of some other
    connection on the host, and then rank 0 cannot serve the store there.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except OSError:
        ephemeral_low = 32768  # Linux's default
    settings = Settings.from_env({})
    for job in range(200):
        env = {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_MCA_ess_base_jobid": str(job),
        }
        assert 1024 <= discover(settings, env).port < ephemeral_low
