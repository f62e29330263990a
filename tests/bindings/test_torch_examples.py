"""The README's PyTorch example (examples/torch_digits.py), run as a user would, under two launchers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster import free_port

pytest.importorskip("torch")
pytest.importorskip("sklearn")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "torch_digits.py")
BIN = Path(sys.executable).parent


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "RINGCORE_TIMEOUT": "60"}
    for name in [k for k in env if k.startswith(("RINGCORE_RANK", "RINGCORE_SIZE", "OMPI_", "SLURM_"))]:
        env.pop(name)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env, cwd=ROOT)


def _assert_trained(proc: subprocess.CompletedProcess, size: int) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"ringcore.torch example: {size} rank(s) trained identical models" in proc.stdout
    accuracy = float(proc.stdout.split("epoch 4: ")[1].split("accuracy on all digits ")[1].split()[0])
    assert accuracy > 0.9, proc.stdout


@pytest.mark.timeout(180)
def test_the_example_trains_under_ringcore_run() -> None:
    _assert_trained(_run([sys.executable, "-m", "ringcore.run", "-np", "3", sys.executable, EXAMPLE]), 3)


@pytest.mark.timeout(180)
def test_the_example_trains_under_torchrun() -> None:
    torchrun = BIN / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed (pip install torch==2.13.0)")
    port = str(free_port())
    _assert_trained(_run([str(torchrun), "--nproc-per-node", "2", "--master-port", port, EXAMPLE]), 2)
