"""shutdown() then init() at one fixed address, many times, under every launcher's variables.

Launchers give a fixed rendezvous address (MASTER_PORT, a port derived from the
job id), so a rank that re-initialises quickly meets rank 0's store of the job
that is ending; the store's generations (ringcore/store.py) make it wait for the
next one instead of failing. Each rank also checks that its descriptors and
threads come back to where they were.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import free_port


def master_port() -> int:
    """A MASTER_PORT whose next port (ringcore's store under torchrun) is free too, below the ephemeral range.

    A port in the ephemeral range may be the local port of any connection on the host
    for as long as that lives (``free_port()`` now avoids that range too).
    """
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(20000, 32000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two free ports in 20000-32000")


ROOT = Path(__file__).resolve().parents[2]
JOB = str(Path(__file__).with_name("reinit_job.py"))
CYCLES = 50


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGCORE_", "OMPI_", "SLURM_", "PMIX_"))}
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(name, None)
    return {**env, "RINGCORE_INIT_TIMEOUT": "20", "RINGCORE_TIMEOUT": "20", "PYTHONPATH": str(ROOT), **extra}


def _assert_cycled(output: str, size: int) -> None:
    # Found anywhere, not per line: mpirun may forward two ranks' lines without the newline between.
    reports = re.findall(r"cycles (\d+) fds (\d+) (\d+) threads (\d+) (\d+)", output)
    assert len(reports) == size, output
    for cycles, fds_before, fds_after, threads_before, threads_after in reports:
        assert cycles == str(CYCLES), output
        assert fds_before == fds_after, f"descriptors not back to baseline: {output}"
        assert threads_before == threads_after, f"threads not back to baseline: {output}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_cycles_under_torchrun_variables(size: int) -> None:
    port = str(master_port())
    procs = [
        subprocess.Popen(
            [sys.executable, JOB, str(CYCLES)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_clean_env(
                RANK=str(rank),
                WORLD_SIZE=str(size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RINGCORE_SECRET="s",
            ),
        )
        for rank in range(size)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=100)[0])
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert all(proc.returncode == 0 for proc in procs), "\n".join(outputs)
    _assert_cycled("\n".join(outputs), size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_cycles_under_ringcore_run(size: int) -> None:
    cmd = [sys.executable, "-m", "ringcore.run", "-np", str(size), sys.executable, JOB, str(CYCLES)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=_clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_cycled(proc.stdout, size)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("size", [2, 3])
def test_cycles_under_open_mpi(size: int) -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun not installed (apt-get install openmpi-bin)")
    cmd = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(size),
        sys.executable,
        JOB,
        str(CYCLES),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=_clean_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_cycled(proc.stdout, size)


@pytest.mark.timeout(60)
def test_a_timeout_at_init_mentions_a_connection_that_failed_authentication() -> None:
    """Rank 1 has the wrong secret: it fails at once; rank 0's timeout says someone failed authentication."""
    port = str(free_port())
    code = "import ringcore; ringcore.init()"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_clean_env(
                RINGCORE_RANK=str(rank),
                RINGCORE_SIZE="2",
                RINGCORE_ADDR="127.0.0.1",
                RINGCORE_PORT=port,
                RINGCORE_SECRET="right" if rank == 0 else "wrong",
                RINGCORE_INIT_TIMEOUT="4",
            ),
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=40)[0] for proc in procs]
    assert "AuthenticationError" in outputs[1] and "RINGCORE_SECRET" in outputs[1], outputs[1]
    assert "CollectiveTimeout" in outputs[0], outputs[0]
    assert "Meanwhile the store rejected a connection from 127.0.0.1:" in outputs[0], outputs[0]
