"""How ``bench/compare.py`` starts each engine, bounds it in time, and reads its rows.

Engines:

- ``ringcore``: ``ringcore-bench --np N`` (self-launch through ``ringcore-run``),
  rows read from its ``--json`` file. ``ringcore:NAME=VALUE+NAME=VALUE`` is the
  same with ``RINGCORE_NAME=VALUE`` in its environment, so settings taken at
  init (e.g. ``ringcore:SHM_SINGLE_COPY_BYTES=0``) run beside the peers too.
- ``ringcore-symmetric`` (run when named): ``ringcore-bench --symmetric``,
  buffers from ``ringcore.empty``: on one host, the direct allreduce on
  symmetric memory.
- ``gloo``: torch.distributed's gloo backend on CPU tensors, store and pairs on
  loopback (:mod:`ringcore.bench.peers.gloo_worker`).
- ``mpi-tcp``: OpenMPI forced onto TCP over loopback (``btl self,tcp``), the
  peer that moves bytes the way ringcore does.
- ``mpi-shm``: OpenMPI's on-node default, shared memory (``btl self,vader``):
  the ceiling on one machine, not a like-for-like peer.
- floors, run only when named (:mod:`ringcore.bench.peers.floor_worker`):
  ``floor-ring``, a bare ring allreduce in Python through shared-memory slots
  (results checked), and ``floor-cma``, ``floor-shm``, ``floor-mix``, the
  ring's memory passes alone with no synchronization (results not checked).

Peers print JSON lines on stdout (rank 0, one per size). Every run has a
timeout; on expiry its process group gets SIGTERM, then SIGKILL. A run that
fails or times out comes back as a :class:`Run` with ``rc != 0`` and the tail
of its log, never as an exception.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ringcore.bench import report
from ringcore.config import assignments

ENGINES = ("ringcore", "gloo", "mpi-tcp", "mpi-shm")
NAMED = ("ringcore-symmetric",)  # run when named (--engines), not by default
FLOORS = ("floor-cma", "floor-shm", "floor-mix", "floor-ring")  # run when named (--engines), never by default
# What each engine needs besides ringcore itself: (python module, program)
_NEEDS = {"gloo": ("torch", None), "mpi-tcp": ("mpi4py", "mpirun"), "mpi-shm": ("mpi4py", "mpirun")}
_MCA = {
    "mpi-tcp": ["btl", "self,tcp", "btl_tcp_if_include", "lo"],
    "mpi-shm": ["btl", "self,vader"],
}
EXIT_TIMEOUT = 124


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every engine measures, the same for all.

    Attributes:
        sizes: Message sizes in bytes.
        iters: Timed iterations per size (before the budget cap).
        warmup: Warmup iterations per size.
        budget: Byte budget capping iterations of big sizes (0: no cap).
        timeout_s: Wall-clock limit of one engine run.
    """

    sizes: tuple[int, ...]
    iters: int
    warmup: int
    budget: int
    timeout_s: float


@dataclasses.dataclass
class Run:
    """The outcome of one engine run at one N.

    Attributes:
        engine: Engine name.
        n: Number of ranks.
        rc: Exit code (124 on timeout, 127 when the engine is not installed).
        wall_s: Wall time of the run.
        rows: Result rows (``bytes``, ``time_us``, ``busbw``...), possibly partial.
        log: Path of the run's stdout+stderr log.
        error: Why it failed (last lines of the log), or ``""``.
    """

    engine: str
    n: int
    rc: int
    wall_s: float
    rows: list[dict[str, Any]]
    log: str
    error: str = ""


def variant_env(engine: str) -> dict[str, str]:
    """The ``RINGCORE_*`` variables of a ``ringcore:NAME=VALUE+...`` engine (``{}`` for any other).

    Raises:
        ConfigError: (a ValueError) see :func:`ringcore.config.assignments`.
    """
    if not engine.startswith("ringcore:"):
        return {}
    return assignments(engine.split(":", 1)[1], launcher=True)


def missing(engine: str) -> str:
    """Why ``engine`` cannot run here, or ``""`` when it can."""
    module, program = _NEEDS.get(engine, (None, None))
    if module and importlib.util.find_spec(module) is None:
        return f"{engine}: python module {module} is not installed"
    if program and shutil.which(program) is None:
        return f"{engine}: {program} is not on PATH"
    return ""


def command(engine: str, n: int, plan: Plan, json_path: Path) -> list[str]:
    """The argv that runs ``engine`` on ``n`` ranks over ``plan``'s sizes."""
    common = ["--sizes", ",".join(map(str, plan.sizes)), "--budget", str(plan.budget)]
    py = sys.executable
    if engine in ("ringcore", "ringcore-symmetric") or variant_env(engine):
        return [
            *[py, "-m", "ringcore.bench.cli", "--np", str(n), *common],
            *["-n", str(plan.iters), "-w", str(plan.warmup), "-c", "1", "--json", str(json_path)],
            *(["--symmetric"] if engine == "ringcore-symmetric" else []),
        ]
    peer_args = [*common, "--iters", str(plan.iters), "--warmup", str(plan.warmup), "--engine", engine]
    if engine == "gloo":
        return [py, "-m", "ringcore.bench.peers.gloo_worker", "--np", str(n), *peer_args]
    if engine in _MCA:
        return [*mpirun(n, _MCA[engine]), py, "-m", "ringcore.bench.peers.mpi_worker", *peer_args]
    if engine in FLOORS:
        launch = [py, "-m", "ringcore.run", "-np", str(n), "--no-prefix", "--"]
        return [*launch, py, "-m", "ringcore.bench.peers.floor_worker", *peer_args]
    raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES + NAMED + FLOORS)}")


def mpirun(n: int, mca: list[str]) -> list[str]:
    """mpirun for ``n`` ranks on this host, launcher traffic on loopback, ``mca`` key/value pairs."""
    cmd = ["mpirun", "-np", str(n), "--oversubscribe"]  # N may exceed the cores
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for key, value in [("pml", "ob1"), ("oob_tcp_if_include", "lo"), *zip(mca[::2], mca[1::2], strict=True)]:
        cmd += ["--mca", key, value]
    return cmd


def run(engine: str, n: int, plan: Plan, workdir: Path, tag: str) -> Run:
    """Run ``engine`` on ``n`` ranks under ``plan.timeout_s``; never raises for engine failures."""
    log = workdir / f"{tag}.log"
    why = missing(engine)
    if why:
        log.write_text(why + "\n")
        return Run(engine, n, 127, 0.0, [], str(log), why)
    json_path = workdir / f"{tag}.json"
    argv = command(engine, n, plan, json_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **variant_env(engine))
    t0 = time.monotonic()
    with open(log, "w") as err:
        err.write("$ " + " ".join(argv) + "\n")
        err.flush()
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True
        )
        stdout, rc = _wait(proc, plan.timeout_s)
        err.write(stdout)
    wall = time.monotonic() - t0
    if engine.startswith("ringcore"):  # the JSON file comes at the end; the table has partial rows
        rows = _read_json_file(json_path) or report.parse_table(stdout)
    else:
        rows = _read_json_lines(stdout)
    error = ""
    if rc != 0:
        what = f"timed out after {plan.timeout_s:g} s" if rc == EXIT_TIMEOUT else f"exit code {rc}"
        error = f"{engine} N={n}: {what}; log {log}:\n" + _tail(log)
    return Run(engine, n, rc, wall, rows, str(log), error)


def _wait(proc: subprocess.Popen[str], timeout_s: float) -> tuple[str, int]:
    """Collect stdout; on timeout stop the run's own process group (SIGTERM, then SIGKILL)."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return out, proc.returncode
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)  # start_new_session: the group is this run's alone
        try:
            out, _ = proc.communicate(timeout=15.0)
            return out, EXIT_TIMEOUT
        except subprocess.TimeoutExpired:
            continue
    # something outside the group still holds the pipe open: give up on its output
    if proc.stdout is not None:
        proc.stdout.close()
    proc.wait()
    return "", EXIT_TIMEOUT


def _read_json_lines(text: str) -> list[dict[str, Any]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def _read_json_file(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text())["rows"])
    except (OSError, ValueError, KeyError):
        return []


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
