"""The measurement scripts of bench/ that RESULTS.md cites, run small across real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringcore.config import Settings
from tests.layout_support import skip_unless_layout_settable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from ab_settings import variant_settings  # noqa: E402
from link_trace import busy_spans  # noqa: E402


def _run_bench(command: list[str], timeout: float = 100) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGCORE_")}
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "RINGCORE_TIMEOUT": "60"},
        cwd=ROOT,
    )


def test_variant_settings_apply_only_what_they_name() -> None:
    base = Settings.from_env({"RINGCORE_TIMEOUT": "7", "RINGCORE_SEGMENT_BYTES": "1M"})
    both = variant_settings(base, "ATOMIC=1+SEGMENT_BYTES=2M")
    assert both.atomic and both.segment_bytes == 2 << 20 and both.timeout == 7.0
    assert variant_settings(base, "ATOMIC=0") == base


@pytest.mark.parametrize("text", ["SHM_BYTES=1M", "ATOMIC=1+SPIN_US=0", "TRANSPORT=tcp"])
def test_variant_settings_refuse_what_the_transport_took_at_init(text: str) -> None:
    with pytest.raises(SystemExit, match="taken at init"):
        variant_settings(Settings.from_env({}), text)


def _ab_settings(size: str, *variants: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """``bench/ab_settings.py`` on ``ranks`` ranks, one short block per variant; it must succeed."""
    script = [sys.executable, "bench/ab_settings.py", size, *variants, "--blocks", "1", "--iters", "3"]
    proc = _run_bench([sys.executable, "-m", "ringcore.run", "-np", str(ranks), *script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.timeout(120)
def test_ab_settings_variants_reach_the_plans() -> None:
    """Each variant plans again under its own settings: with 3 ranks on one host 4 KiB goes one
    shot with SMALL_BYTES=64K and two shots with SMALL_BYTES=0 (above the small limit)."""
    proc = _ab_settings("4K", "SMALL_BYTES=0", "SMALL_BYTES=64K", ranks=3)
    forms = re.findall(r"SMALL_BYTES=(\w+) .* form (\S+)", proc.stdout)
    assert forms == [("0", "twoshot"), ("64K", "oneshot")], proc.stdout


@pytest.mark.timeout(120)
def test_ab_settings_checks_and_times_every_variant() -> None:
    proc = _ab_settings("256K", "ATOMIC=1", "ATOMIC=0+SEGMENT_BYTES=64K")
    lines = [line for line in proc.stdout.splitlines() if "busbw" in line]
    assert len(lines) == 2 and "ATOMIC=1" in lines[0] and "SEGMENT_BYTES=64K" in lines[1], proc.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("barrier", [False, True])
def test_cpu_per_op_times_every_rank_and_checks_the_sum(barrier: bool) -> None:
    script = [
        sys.executable,
        "bench/cpu_per_op.py",
        "64K",
        "--iters",
        "5",
        *(["--barrier"] if barrier else []),
    ]
    proc = _run_bench([sys.executable, "-m", "ringcore.run", "-np", "3", *script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if "per op" in line]
    assert ("barrier;op" in line) == barrier, line
    assert len(re.findall(r"\d+\.\d+\+\d+\.\d+", line)) == 3 and line.endswith("wrong elements: 0"), line


@pytest.mark.timeout(120)
def test_cpu_per_op_measures_open_mpi_in_place() -> None:
    mpirun = shutil.which("mpirun")
    if mpirun is None or importlib.util.find_spec("mpi4py") is None:
        pytest.skip(
            "needs mpirun and mpi4py (apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py)"
        )
    script = [sys.executable, "bench/cpu_per_op.py", "64K", "--iters", "5", "--engine", "mpi", "--barrier"]
    mca = ["--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo"]
    proc = _run_bench([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", *mca, *script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mpi N=2 64K barrier;op" in proc.stdout and "wrong elements: 0" in proc.stdout, proc.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("splice", [False, True])
def test_kernel_cost_moves_the_bytes_intact(splice: bool) -> None:
    import kernel_cost

    allowed = os.sched_getaffinity(0)
    line = kernel_cost.measure(256 << 10, 1 << 20, splice=splice, same_cpu=True, rounds=1)
    assert line.startswith("splice" if splice else "send") and "GiB/s" in line, line
    assert os.sched_getaffinity(0) == allowed  # the pin to one CPU is undone


@pytest.mark.timeout(60)
def test_kernel_cost_fails_when_the_bytes_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernel_cost

    pattern, sender = kernel_cost._pattern, os.getpid()

    def flipped_in_the_sender() -> np.ndarray:
        data = pattern()
        if os.getpid() == sender:  # the forked receiver still expects the true pattern
            data[5] ^= 1
        return data

    monkeypatch.setattr(kernel_cost, "_pattern", flipped_in_the_sender)
    with pytest.raises(RuntimeError, match="other bytes than were sent"):
        kernel_cost.measure(256 << 10, 0, rounds=1)


@pytest.mark.timeout(120)
def test_latency_layers_times_every_layer_of_the_small_route() -> None:
    """Each layer's allreduce is checked against the sum inside the script (it exits non-zero otherwise),
    and the pattern's three rows follow the layers."""
    script = [sys.executable, "bench/latency_layers.py", "50"]
    proc = _run_bench([sys.executable, "-m", "ringcore.run", "-np", "2", *script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^\[0\]<stdout>:\s+(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)", proc.stdout, re.M)
    layers = ["floor", "swap", "lockstep", "plan", "small", "mailbox", "one", "oneshot", "turn", "api"]
    patterns = ["hand", "hand_one", "api"]  # then compare.py's pattern: barrier; allreduce
    assert [name for name, *_ in rows] == layers + patterns, proc.stdout
    assert all(float(value) > 0 for _, *values in rows for value in values)


def test_link_trace_finds_the_busy_spans_and_the_idle_gap_between() -> None:
    """0.2 s idle, 0.5 s at 110 MB/s, 0.1 s idle, 0.3 s at 50 MB/s: two spans with their bytes."""
    times = np.arange(0.0, 1.2, 0.001)
    rate = np.where(
        (times >= 0.2) & (times < 0.7), 110e6, np.where((times >= 0.8) & (times < 1.1), 50e6, 0.0)
    )
    sent = np.concatenate([[0.0], np.cumsum(rate[:-1] * 0.001)])
    spans = busy_spans(np.column_stack([times + 5.0, sent, sent]), bin_s=0.01)
    assert [(round(s.start, 2), round(s.end, 2)) for s in spans] == [(0.2, 0.7), (0.8, 1.1)]
    assert [round(s.sent / 1e6, 1) for s in spans] == [55.0, 15.0]
    assert round(spans[0].rate) == 110 and round(spans[1].rate) == 50
    assert not spans[0].slow and len(spans[1].slow) == 30  # every bin of the second is below 100 MB/s


def test_link_trace_records_a_real_interface(tmp_path: Path) -> None:
    out = tmp_path / "lo.npy"
    done = _run_bench(
        [sys.executable, "bench/link_trace.py", "record", str(out), "--iface", "lo", "--seconds", "0.2"]
    )
    assert done.returncode == 0, done.stderr
    rows = np.load(out)
    assert rows.shape[1] == 3 and len(rows) >= 20
    assert np.all(np.diff(rows[:, 0]) > 0) and np.all(np.diff(rows[:, 1]) >= 0)
    shown = _run_bench([sys.executable, "bench/link_trace.py", "show", str(out)])
    assert shown.returncode == 0, shown.stderr


def test_ring_moves_visit_every_chunk_once_per_half() -> None:
    from ringcore.bench.peers.floor_worker import ring_moves

    for size in (2, 3, 4):
        for rank in range(size):
            moves = ring_moves(rank, size, 12)
            reduces = [start for kind, start, _ in moves if kind == "reduce"]
            copies = [start for kind, start, _ in moves if kind == "copy"]
            own = 12 // size * ((rank + 1) % size)  # the chunk its last reduce step completes
            assert len(reduces) == len(copies) == size - 1
            assert own not in copies and len(set(copies)) == size - 1  # receives all but what it reduced


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_floor_ring_is_a_real_allreduce_and_the_pass_floors_run(np_: int) -> None:
    """floor-ring's sums are checked by the timing loop (wrong 0); the pass floors report wrong null."""
    for engine, want_wrong in (("floor-ring", 0), ("floor-mix", None), ("floor-cma", None)):
        launch = [sys.executable, "-m", "ringcore.run", "-np", str(np_), "--no-prefix", "--"]
        worker = [sys.executable, "-m", "ringcore.bench.peers.floor_worker", "--engine", engine]
        options = ["--sizes", "48K,3M", "--iters", "3", "--warmup", "1"]
        proc = _run_bench([*launch, *worker, *options], timeout=100)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert [row["bytes"] for row in rows] == [48 << 10, 3 << 20], proc.stdout
        assert all(row["wrong"] == want_wrong and row["busbw"] > 0 for row in rows), rows


@pytest.mark.timeout(120)
def test_ab_floor_checks_both_engines_and_prints_the_ratio_per_block() -> None:
    script = [sys.executable, "bench/ab_floor.py", "64K", "1M", "--blocks", "2", "--budget", "4M"]
    proc = _run_bench([sys.executable, "-m", "ringcore.run", "-np", "2", *script])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ratios = re.findall(r"N=2 +(\w+) ringcore/floor-ring per block: ([\d.]+) ([\d.]+) +median", proc.stdout)
    assert [size for size, *_ in ratios] == ["64K", "1M"], proc.stdout
    assert all(float(r) > 0 for _, *values in ratios for r in values)


def test_layout_turns_times_pairs_in_random_and_one_layout_and_one_alone() -> None:
    skip_unless_layout_settable()
    proc = _run_bench([sys.executable, "bench/layout_turns.py", "1"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = re.fullmatch(r" *([\d.]+) ([\d.]+) \| +([\d.]+) ([\d.]+) \| ([\d.]+)", proc.stdout.splitlines()[-1])
    assert row and all(float(value) > 0 for value in row.groups()), proc.stdout


@pytest.mark.parametrize(
    "script",
    ["memory", "memcpy", "barrier_time", "latency_layers", "segment_cost", "compare", "layout_turns"],
)
def test_bench_scripts_answer_help_with_how_to_run_them(script: str) -> None:
    done = _run_bench([sys.executable, f"bench/{script}.py", "--help"], timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "python" in done.stdout and "Traceback" not in done.stderr, (done.stdout, done.stderr)
