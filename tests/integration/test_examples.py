"""The README example, run as written under every launcher a user would pick."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = str(ROOT / "examples" / "allreduce_demo.py")
BIN = Path(sys.executable).parent


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "RINGCORE_TIMEOUT": "60", **env}
    for name in [k for k in full_env if k.startswith(("RINGCORE_RANK", "RINGCORE_SIZE", "OMPI_", "SLURM_"))]:
        full_env.pop(name)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=full_env, cwd=ROOT)


def _assert_demo_ran(proc: subprocess.CompletedProcess, size: int) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ringcore demo: {size} process(es), every collective matched numpy" in proc.stdout
    for rank in range(size):
        assert f"rank {rank}/{size}: allreduce of 1,000,000 float32" in proc.stdout


@pytest.mark.timeout(160)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_demo_under_ringcore_run(size: int) -> None:
    proc = _run([sys.executable, "-m", "ringcore.run", "-np", str(size), sys.executable, DEMO])
    _assert_demo_ran(proc, size)
    assert "[0]<stdout>: " in proc.stdout


@pytest.mark.timeout(160)
def test_demo_without_launcher_is_a_world_of_one() -> None:
    _assert_demo_ran(_run([sys.executable, DEMO]), 1)


@pytest.mark.timeout(160)
def test_demo_under_torchrun() -> None:
    torchrun = BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed (pip install torch==2.13.0)")
    port = str(free_port())
    proc = _run([str(torchrun), "--nproc-per-node", "3", "--master-port", port, DEMO])
    _assert_demo_ran(proc, 3)


@pytest.mark.timeout(160)
def test_demo_under_mpirun() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "3", sys.executable, DEMO]
    _assert_demo_ran(_run(cmd), 3)


@pytest.mark.timeout(60)
def test_slurm_like_environment_on_one_host() -> None:
    """srun sets SLURM_* only; two processes with a shared job id meet on loopback."""
    job = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, DEMO],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={
                **os.environ,
                "SLURM_PROCID": str(r),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(r),
                "SLURM_JOB_ID": job,
                "SLURM_STEP_ID": "0",
                "SLURM_JOB_NUM_NODES": "1",
            },
            cwd=ROOT,
        )
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "ringcore demo: 2 process(es)" in outputs[0]
