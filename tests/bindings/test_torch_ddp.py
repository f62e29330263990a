"""The torch.distributed backend "ringcore" over real processes and sockets.

DDP on "ringcore" against DDP on "gloo" (same seed, data and steps: plain,
BatchNorm buffers, unused parameters, ``no_sync``, ``Join``), every implemented
collective against numpy, refusals and failures on every rank, the fp16 comm
hook, ``init_process_group("ringcore")`` under each launcher, and the rules for
addresses, timeouts and launcher variables.

One cluster per world size (2 and 3) serves most tests; each task makes and
destroys its own process group on a port the test picks.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import torch.distributed as dist  # noqa: E402

from ringcore.config import Settings  # noqa: E402
from ringcore.rendezvous import discover  # noqa: E402
from ringcore.run import parse_args, rank_env  # noqa: E402
from ringcore.torch import process_group as ringcore_pg  # noqa: E402
from tests.bindings import ddp_tasks  # noqa: E402
from tests.cluster import Cluster, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ENV = {"OMP_NUM_THREADS": "1"}
# N=2 sums two values, the same float in either order: bit-equal to gloo. N=3 adds in another order
# than gloo's ring: parameters within rtol 1e-6; BatchNorm's running mean, an average of activations
# that cancel, also within atol 1e-6.
PARAMS_TOL = {2: (0.0, 0.0), 3: (1e-6, 1e-7)}
BUFFERS_TOL = {2: (0.0, 0.0), 3: (1e-6, 1e-6)}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"N={n}")
def cluster(request: Any) -> Any:
    with Cluster(request.param, env=ENV, timeout=120) as live:
        yield live


def _assert_same(
    got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: tuple[float, float], what: str
) -> None:
    """Arrays by name: bit-equal when ``tol`` (rtol, atol) is zero."""
    assert got.keys() == want.keys()
    for name in got:
        if tol == (0.0, 0.0):
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{what}: {name}")
        else:
            np.testing.assert_allclose(got[name], want[name], *tol, err_msg=f"{what}: {name}")


def _assert_ranks_agree(results: list[dict]) -> None:
    """Parameters are the same on every rank (buffers are not: each rank's last forward updates its own)."""
    for rank, result in enumerate(results[1:], 1):
        _assert_same(result["params"], results[0]["params"], (0.0, 0.0), f"rank {rank} against rank 0")


def _ports() -> tuple[int, int]:
    return free_port(), free_port()


# ------------------------------------------------------------------ DDP against gloo


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "kind, mode",
    [
        ("mlp", "plain"),
        ("batchnorm", "plain"),
        ("branchy", "unused"),
        ("mlp", "no_sync"),
        ("batchnorm", "join"),
    ],
)
def test_ddp_matches_gloo(cluster: Cluster, kind: str, mode: str) -> None:
    out = cluster.results(ddp_tasks.train_both, _ports(), kind, mode, timeout=200)
    for backend in ("ringcore", "gloo"):
        _assert_ranks_agree([o[backend] for o in out])
    for rank, o in enumerate(out):
        _assert_same(o["ringcore"]["params"], o["gloo"]["params"], PARAMS_TOL[cluster.size], f"rank {rank}")
        _assert_same(
            o["ringcore"]["buffers"], o["gloo"]["buffers"], BUFFERS_TOL[cluster.size], f"rank {rank}"
        )
        assert len(o["ringcore"]["losses"]) == len(o["gloo"]["losses"])
    losses = out[0]["ringcore"]["losses"]
    assert losses[-1] < losses[0], losses  # it trained
    if kind == "batchnorm":  # buffers moved, and rank 0's were broadcast
        assert np.any(out[0]["ringcore"]["buffers"]["1.running_mean"] != 0)


@pytest.mark.timeout(240)
def test_fsdp2_and_dtensor_match_gloo(cluster: Cluster) -> None:
    """FSDP2 and DTensor run on the backend (the group's name, scatter, the coalesced collectives):
    gloo's parameters (bit for bit at 2 ranks; at 3 the sums' order differs), and a tensor sharded
    and gathered back whole."""
    n = cluster.size
    ours = cluster.results(ddp_tasks.fsdp2_params, "ringcore", free_port(), timeout=200)
    gloo = cluster.results(ddp_tasks.fsdp2_params, "gloo", free_port(), timeout=200)
    for rank, (mine, theirs) in enumerate(zip(ours, gloo, strict=True)):
        _assert_same({"params": mine["params"]}, {"params": theirs["params"]}, PARAMS_TOL[n], f"rank {rank}")
        np.testing.assert_array_equal(mine["full"], np.arange(6.0 * n))
        np.testing.assert_array_equal(mine["local"], np.arange(6.0 * rank, 6.0 * rank + 6))


@pytest.mark.timeout(240)
def test_fp16_hook_trains_to_bit_identical_ranks(cluster: Cluster) -> None:
    ports = _ports()
    fp16 = cluster.results(ddp_tasks.train, "ringcore", ports[0], "mlp", "plain", "fp16", timeout=200)
    fp32 = cluster.results(ddp_tasks.train, "ringcore", ports[1], "mlp", "plain", None, timeout=200)
    _assert_ranks_agree(fp16)
    got, want = np.array(fp16[0]["losses"]), np.array(fp32[0]["losses"])
    assert got[-1] < 0.8 * got[0], got  # it trained
    np.testing.assert_allclose(got, want, rtol=1e-2)
    _assert_same(fp16[0]["params"], fp32[0]["params"], (1e-2, 1e-4), "fp16 against fp32")


# ------------------------------------------------------------------ collectives


def _stack(n: int, count: int = 7, dtype: str = "float32") -> np.ndarray:
    return np.stack([ddp_tasks.inputs(r, count, dtype) for r in range(n)])


@pytest.mark.timeout(180)
def test_collectives_match_numpy(cluster: Cluster) -> None:
    n = cluster.size
    out = cluster.results(ddp_tasks.collectives, free_port(), timeout=150)
    x = _stack(n)
    reference = {
        "all_reduce SUM": x.sum(0),
        "all_reduce AVG": x.astype(np.float64).mean(0),
        "all_reduce PRODUCT": x.prod(0),
        "all_reduce MIN": x.min(0),
        "all_reduce MAX": x.max(0),
        "all_reduce int64": _stack(n, dtype="int64").sum(0),
        "async wait": x.sum(0),
        "async future": x.sum(0),
        "collective in a callback": x.sum(0) + np.stack([ddp_tasks.inputs(r + 20) for r in range(n)]).sum(0),
        "functional all_reduce": x.sum(0),
        "broadcast": x[n - 1],
        "broadcast bool": np.array([(n - 1) % 2 == 0, True, False]),
        "all_gather": list(_stack(n, 6).reshape(n, 2, 3)),
        "all_gather_into_tensor bf16": torch.from_numpy(_stack(n, 4))
        .to(torch.bfloat16)
        .float()
        .numpy()
        .ravel(),
        "reduce_scatter": None,  # per rank, below
    }
    wide = _stack(n, 12).sum(0).reshape(3, 4)
    for rank, o in enumerate(out):
        assert o["wait"] is True and o["barrier"] is True
        assert isinstance(o["group name"], str) and o["group name"], o["group name"]
        mine = ddp_tasks.inputs(rank)  # dist.reduce leaves the others' tensors as they were
        np.testing.assert_array_equal(o["reduce MAX to the last"], x.max(0) if rank == n - 1 else mine)
        if rank == 0:
            np.testing.assert_array_equal(np.stack(o["gather to 0"]), _stack(n, 6).reshape(n, 2, 3))
        else:
            assert o["gather to 0"] is None
        np.testing.assert_array_equal(o["scatter from 1"], np.full((2, 2), 10.0 * rank + 1))
        assert o["all_gather_object"] == [{"rank": r} for r in range(n)]
        for name, want in reference.items():
            if want is not None:
                np.testing.assert_allclose(
                    np.asarray(o[name], np.float64), np.asarray(want, np.float64), rtol=1e-6, err_msg=name
                )
        strided = ddp_tasks.inputs(rank, 12).reshape(3, 4)
        strided[:, ::2] = wide[:, ::2]
        np.testing.assert_allclose(o["all_reduce strided"], strided, rtol=1e-6)
        pair = [
            _stack(n, 6).sum(0).reshape(2, 3),
            np.stack([ddp_tasks.inputs(r + 10, 4) for r in range(n)]).sum(0),
        ]
        for got, want in zip(o["all_reduce_coalesced"], pair, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        scattered = _stack(n, 4 * n).reshape(n, n, 4)[:, rank]
        np.testing.assert_allclose(o["reduce_scatter_tensor SUM"], scattered.sum(0).reshape(2, 2), rtol=1e-6)
        np.testing.assert_array_equal(o["reduce_scatter_tensor MAX"], scattered.max(0).reshape(2, 2))
        np.testing.assert_allclose(
            o["reduce_scatter"], _stack(n, 3 * n).reshape(n, n, 3)[:, rank].sum(0), rtol=1e-6
        )


@pytest.mark.timeout(120)
def test_refusals_name_the_call_on_every_rank(cluster: Cluster) -> None:
    for rank, o in enumerate(cluster.results(ddp_tasks.refusals, free_port(), timeout=100)):
        assert o["send"].startswith("NotImplementedError: ringcore backend does not implement dist.send"), o
        assert o["all_to_all"].startswith(
            "NotImplementedError: ringcore backend does not implement dist.all_to_all"
        ), o
        assert (
            "all_to_all_single" in o["all_to_all_single"] and "NotImplementedError" in o["all_to_all_single"]
        )
        assert o["BAND"].startswith(
            "ValueError: ringcore backend: all_reduce does not support ReduceOp.BAND"
        ), o
        assert o["bool sum"].startswith("TypeError"), o
        assert o["reduce_scatter_tensor size"].startswith(
            "ValueError: ringcore backend: reduce_scatter_tensor"
        ), o
        assert o["after"] == [cluster.size] * 2, (rank, o)


@pytest.mark.timeout(120)
def test_ranks_that_disagree_fail_on_every_rank(cluster: Cluster) -> None:
    for o in cluster.results(ddp_tasks.mismatch, free_port(), timeout=100):
        assert o["first"].startswith("MismatchError: allreduce #1: ranks disagree on"), o
        assert o["next"].startswith("CommunicatorClosed"), o


@pytest.mark.timeout(120)
def test_new_group_gets_its_own_communicator_and_timeout(cluster: Cluster) -> None:
    n = cluster.size
    members = [0, n - 1]
    out = cluster.results(ddp_tasks.subgroup, _ports(), members, timeout=100)
    for rank, o in enumerate(out):
        want = float(sum(r + 1 for r in members)) if rank in members else float(rank + 1)
        assert o["sum"] == [want] * 3, (rank, o)
        assert o["world"] == n
        assert o.get("timeout") == (42.0 if rank in members else None)
        assert o["default timeout"] == o["RINGCORE_TIMEOUT"] == 30.0  # torch's default: RINGCORE_TIMEOUT's


@pytest.mark.timeout(120)
def test_killed_peer_makes_the_others_raise_not_hang() -> None:
    with Cluster(3, env={**ENV, "RINGCORE_TIMEOUT": "10"}, timeout=90) as live:
        assert live.results(ddp_tasks.join_and_reduce, free_port()) == [3.0] * 3
        live.kill(2, signal.SIGKILL)
        out = live.run(ddp_tasks.reduce_after_failure, ranks=[0, 1], timeout=60)
    for rank, o in enumerate(out):
        assert isinstance(o, dict), (rank, o)
        assert "PeerFailure" in o["ddp"] and "rank 2" in o["ddp"], o  # DDP's forward broadcasts first
        assert o["wait"].startswith("PeerFailure") and "rank 2" in o["wait"], o
        assert o["future"].startswith("RuntimeError") and "PeerFailure" in o["future"], o
        assert o["next"].startswith("CommunicatorClosed"), o
        assert o["ddp seconds"] < 15 and o["wait seconds"] < 15, o  # RINGCORE_TIMEOUT=10 bounds both


# ------------------------------------------------------------------ launchers

SCRIPT = """\
import torch
import torch.distributed as dist
import ringcore.torch  # registers the "ringcore" backend

dist.init_process_group("ringcore")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print(f"rank {dist.get_rank()}/{dist.get_world_size()} {dist.get_backend()} sum {t[0].item():g}", flush=True)
dist.destroy_process_group()
"""
AGAIN = """\
import torch
import torch.distributed as dist
import ringcore.torch

for _ in range(5):
    dist.init_process_group("ringcore")
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    print(f"{dist.get_backend()} sum {t[0].item():g}", flush=True)
    dist.destroy_process_group()
"""
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's variables, plus ``extra``."""
    launched = ("RINGCORE_RANK", "RINGCORE_SIZE", "RINGCORE_PORT", "OMPI_", "SLURM_")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(launched)}
    return {**env, **ENV, "RINGCORE_TIMEOUT": "60", **extra}


def _run(cmd: list[str], **extra: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=_clean_env(**extra), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def _assert_summed(stdout: str, size: int) -> None:
    total = size * (size + 1) // 2
    for rank in range(size):
        assert f"rank {rank}/{size} ringcore sum {total}" in stdout, stdout


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "allreduce.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.timeout(160)
def test_init_process_group_under_ringcore_run(script: str) -> None:
    _assert_summed(_run([sys.executable, "-m", "ringcore.run", "-np", "2", sys.executable, script]), 2)


@pytest.mark.timeout(300)
def test_process_groups_made_again_after_destroy(tmp_path: Path) -> None:
    """init, allreduce, destroy, five times in one process: rank 0 leaves each destroy first, so no
    rank starts its next init on the store rank 0 is about to close (before, 2 launches in 6 failed
    with ``DistNetworkError: Failed to recv``, the host loaded)."""
    path = tmp_path / "again.py"
    path.write_text(AGAIN)
    for _ in range(3):
        out = _run([sys.executable, "-m", "ringcore.run", "-np", "2", sys.executable, str(path)])
        assert out.count("ringcore sum 3") == 10, out


@pytest.mark.timeout(160)
def test_init_process_group_under_torchrun(script: str) -> None:
    torchrun = BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this python")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), script]
    _assert_summed(_run(cmd), 2)


@pytest.mark.timeout(160)
def test_init_process_group_under_mpirun(script: str) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, script]
    _assert_summed(_run(cmd), 2)


@pytest.mark.timeout(160)
def test_init_process_group_under_srun_variables(script: str) -> None:
    """srun sets SLURM_* only; two processes of one job on one host."""
    job = str(free_port())
    procs = []
    for rank in range(2):
        slurm = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank)}
        env = _clean_env(**slurm, SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_JOB_NUM_NODES="1")
        procs.append(
            subprocess.Popen(
                [sys.executable, script],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=ROOT,
            )
        )
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    _assert_summed("".join(outputs), 2)


# ------------------------------------------------------------------ rules, in this process


def test_ringcore_run_exports_torch_variables_on_another_port() -> None:
    options = parse_args(["-np", "3", "python", "train.py"])
    envs = [rank_env({"PATH": "/bin"}, options, rank) for rank in range(3)]
    for rank, env in enumerate(envs):
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), "3")
        assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "3")
        assert env["MASTER_ADDR"] == "127.0.0.1" == env["RINGCORE_ADDR"]
        assert env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert int(env["MASTER_PORT"]) not in (
            options.port,
            options.port - 1,
        )  # ringcore's own: RINGCORE_PORT
        world = discover(Settings.from_env(env), env)  # RINGCORE_* still win over torch's
        assert (world.rank, world.size, world.port, world.source) == (
            rank,
            3,
            options.port,
            "RINGCORE_* variables",
        )
    mine = rank_env({"MASTER_PORT": "1234", "MASTER_ADDR": "10.0.0.1"}, options, 1)
    assert (mine["MASTER_PORT"], mine["MASTER_ADDR"], mine["RANK"]) == ("1234", "10.0.0.1", "1")


def _ompi(rank: int, size: int = 2, local_size: int = 2, **extra: str) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(size),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
        "OMPI_MCA_ess_base_jobid": "4242",
        **extra,
    }


def test_mpirun_variables_become_torch_variables_one_port_below_ringcores() -> None:
    env = _ompi(1)
    store_port = discover(Settings.from_env(env), env).port
    added = ringcore_pg.export_launcher_env(env)
    assert added == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store_port - 1),
    }
    world = discover(Settings.from_env(env), env)  # ringcore.init() afterwards: torchrun's rule, same store
    assert (world.rank, world.port, world.addr) == (1, store_port, "127.0.0.1")


def test_launcher_variables_left_alone_when_set_or_unknown() -> None:
    mine = _ompi(0, MASTER_PORT="2000")
    assert "MASTER_PORT" not in ringcore_pg.export_launcher_env(mine)
    assert (mine["MASTER_PORT"], mine["RANK"]) == ("2000", "0")
    assert discover(Settings.from_env(mine), mine).port == 2001  # ringcore's store, as before
    assert ringcore_pg.export_launcher_env({**_ompi(0), "RANK": "0", "WORLD_SIZE": "2"}) == {}
    assert ringcore_pg.export_launcher_env({"PATH": "/bin"}) == {}
    across_hosts = _ompi(0, size=4, local_size=2)  # no address to meet at: torch will ask for MASTER_ADDR
    assert ringcore_pg.export_launcher_env(across_hosts) == {}
    assert "RANK" not in across_hosts
    slurm = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NUM_NODES": "1",
    }
    added = ringcore_pg.export_launcher_env(slurm)
    assert (added["RANK"], added["WORLD_SIZE"], added["LOCAL_RANK"]) == ("3", "4", "1")
    assert "LOCAL_WORLD_SIZE" not in added


def test_timeout_rule() -> None:
    assert ringcore_pg.collective_timeout(dist.constants.default_pg_timeout) is None
    assert ringcore_pg.collective_timeout(None) is None
    assert ringcore_pg.collective_timeout(timedelta(seconds=90)) == 90.0


def test_store_host_follows_prefix_stores() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    try:
        nested = dist.PrefixStore("a/", dist.PrefixStore("b/", store))
        assert ringcore_pg.store_host(nested) == "127.0.0.1"
        assert ringcore_pg.store_host(dist.HashStore()) is None
    finally:
        del store


def test_fp16_hook_refuses_another_backends_group() -> None:
    class Lonely(dist.ProcessGroup):
        def getBackendName(self) -> str:
            return "lonely"

    with pytest.raises(TypeError, match="expected a 'ringcore' process group, got 'lonely'"):
        ringcore_pg.ringcore_group(Lonely(0, 1))
