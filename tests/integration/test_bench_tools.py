"""The measurement scripts of bench/ that RESULTS.md cites, run small across real processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ringcore.config import Settings

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from ab_settings import variant_settings  # noqa: E402


def test_variant_settings_apply_only_what_they_name() -> None:
    base = Settings.from_env({"RINGCORE_TIMEOUT": "7", "RINGCORE_SEGMENT_BYTES": "1M"})
    both = variant_settings(base, "ATOMIC=1+SEGMENT_BYTES=2M")
    assert both.atomic and both.segment_bytes == 2 << 20 and both.timeout == 7.0
    assert variant_settings(base, "ATOMIC=0") == base


@pytest.mark.timeout(120)
def test_ab_settings_checks_and_times_every_variant() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCORE_")}
    script = [sys.executable, "bench/ab_settings.py", "256K", "ATOMIC=1", "ATOMIC=0+SEGMENT_BYTES=64K"]
    proc = subprocess.run(
        [sys.executable, "-m", "ringcore.run", "-np", "2", *script, "--blocks", "1", "--iters", "3"],
        capture_output=True,
        text=True,
        timeout=100,
        env={**env, "RINGCORE_TIMEOUT": "60"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if "busbw" in line]
    assert len(lines) == 2 and "ATOMIC=1" in lines[0] and "SEGMENT_BYTES=64K" in lines[1], proc.stdout
