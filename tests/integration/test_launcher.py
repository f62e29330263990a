"""End-to-end tests of ``ringcore-run``, run as ``python -m ringcore.run`` in a subprocess.

The rank programs are throwaway scripts that only read ``os.environ``, so
these tests do not depend on the collectives. Timing bounds are generous: the
test machine is small and shared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ringcore.run import parse_args
from tests.cluster import alive
from tests.layout_support import skip_unless_layout_settable

LAUNCH_TIMEOUT = 60

# Prelude of every rank script: RANK, SIZE, and helpers to record this
# process's PID and to wait for the other ranks' PID files.
PRELUDE = """\
import os, signal, sys, time
from pathlib import Path
RANK = int(os.environ["RINGCORE_RANK"])
SIZE = int(os.environ["RINGCORE_SIZE"])
PIDS = Path(sys.argv[1]) if len(sys.argv) > 1 else None

def write_pid():
    tmp = PIDS / f"{RANK}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(PIDS / f"{RANK}.pid")

def mark_failure():
    (PIDS / "failed_at").write_text(repr(time.time()))

def wait_for_pids(count):
    deadline = time.monotonic() + 30
    while len(list(PIDS.glob("*.pid"))) < count and time.monotonic() < deadline:
        time.sleep(0.02)
"""


def write_script(tmp_path: Path, body: str) -> Path:
    """Write a rank script (PRELUDE + ``body``) into ``tmp_path`` and return its path."""
    path = tmp_path / "rank.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def launch(*args: str | Path, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run the launcher to completion and capture its output as text."""
    command = [sys.executable, "-m", "ringcore.run", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def start_launcher(*args: str | Path) -> subprocess.Popen[str]:
    """Start the launcher without waiting for it."""
    command = [sys.executable, "-m", "ringcore.run", *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def pid_dir(tmp_path: Path) -> Path:
    """Return an empty folder for the ranks' PID files."""
    path = tmp_path / "pids"
    path.mkdir()
    return path


def read_pids(folder: Path) -> dict[int, int]:
    """Return ``{rank: pid}`` from the PID files in ``folder``."""
    return {int(path.stem): int(path.read_text()) for path in folder.glob("*.pid")}


def wait_for_files(folder: Path, count: int, timeout: float = 30.0) -> None:
    """Wait until ``folder`` holds ``count`` PID files."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("*.pid"))) < count:
        assert time.monotonic() < deadline, f"only {len(list(folder.glob('*.pid')))} of {count} ranks started"
        time.sleep(0.05)


def assert_dead(pids: dict[int, int], timeout: float = 5.0) -> None:
    """Assert every PID is gone (allowing a moment for a process being reaped elsewhere)."""
    deadline = time.monotonic() + timeout
    for rank, pid in pids.items():
        while alive(pid):
            assert time.monotonic() < deadline, f"rank {rank} (pid {pid}) is still running"
            time.sleep(0.05)


def seconds_since_failure(folder: Path) -> float:
    """Return the seconds since the failing rank wrote ``failed_at`` (startup excluded)."""
    return time.time() - float((folder / "failed_at").read_text())


def sleepers_except(failing_rank: int, fail: str) -> str:
    """Body: every rank but ``failing_rank`` sleeps 60 s; that one waits for all PIDs, then runs ``fail``."""
    return f"""
        write_pid()
        if RANK == {failing_rank}:
            wait_for_pids(SIZE)
            mark_failure()
            {fail}
        time.sleep(60)
    """


@pytest.mark.timeout(90)
def test_each_rank_gets_its_identity(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        """
        keys = ["RINGCORE_RANK", "RINGCORE_SIZE", "RINGCORE_LOCAL_RANK", "RINGCORE_LOCAL_SIZE",
                "RINGCORE_ADDR", "RINGCORE_PORT", "PYTHONUNBUFFERED"]
        print("ENV " + " ".join(os.environ[key] for key in keys))
        """,
    )
    result = launch("-np", 4, "--addr", "127.0.0.2", sys.executable, script)
    assert result.returncode == 0, result.stderr
    rows = [line.split("ENV ")[1].split() for line in result.stdout.splitlines()]
    assert sorted(int(row[0]) for row in rows) == [0, 1, 2, 3]
    for rank, size, local_rank, local_size, addr, _port, unbuffered in rows:
        assert (size, local_rank, local_size, addr, unbuffered) == ("4", rank, "4", "127.0.0.2", "1")
    ports = {row[5] for row in rows}
    assert len(ports) == 1 and 1 <= int(ports.pop()) <= 65535


@pytest.mark.timeout(90)
def test_explicit_port_is_passed_through(tmp_path: Path) -> None:
    script = write_script(tmp_path, 'print(os.environ["RINGCORE_PORT"])\n')
    result = launch("-n", 2, "--port", 4711, "--no-prefix", sys.executable, script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4711", "4711"]


AFFINITY = "import os; print(sorted(os.sched_getaffinity(0)))"


def affinities(proc: subprocess.CompletedProcess[str]) -> dict[int, list[int]]:
    """Rank -> the CPUs it printed (AFFINITY's output)."""
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r"^\[(\d+)\]<stdout>: (\[.*\])$", proc.stdout, re.MULTILINE)
    return {int(rank): json.loads(cpus) for rank, cpus in found}


def test_ranks_are_bound_to_disjoint_equal_shares_of_the_cpus() -> None:
    usable = sorted(os.sched_getaffinity(0))
    size = min(2, len(usable))
    share = len(usable) // size
    got = affinities(launch("-np", size, sys.executable, "-c", AFFINITY))
    assert got == {rank: usable[rank * share : (rank + 1) * share] for rank in range(size)}


def test_rank_cores_splits_evenly_and_goes_round_robin_when_crowded(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringcore import run

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    assert run.rank_cores(3) == [{0, 1}, {2, 3}, {4, 5}]
    assert run.rank_cores(7) == [{c} for c in range(7)]
    assert run.rank_cores(9) == [{0}, {1}, {2}, {3}, {4}, {5}, {6}, {0}, {1}]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 9})
    assert run.rank_cores(4) == [{4}, {9}, {4}, {9}]


def test_crowded_ranks_are_bound_round_robin() -> None:
    usable = sorted(os.sched_getaffinity(0))
    size = len(usable) + 1
    crowded = affinities(launch("-np", size, sys.executable, "-c", AFFINITY))
    assert crowded == {rank: [usable[rank % len(usable)]] for rank in range(size)}


def test_no_binding_when_told_by_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    usable = sorted(os.sched_getaffinity(0))
    free = affinities(launch("-np", 2, "--bind-to", "none", sys.executable, "-c", AFFINITY))
    assert free == {0: usable, 1: usable}
    monkeypatch.setenv("RINGCORE_BIND_TO", "none")
    assert affinities(launch("-np", 2, sys.executable, "-c", AFFINITY)) == {0: usable, 1: usable}
    monkeypatch.setenv("RINGCORE_BIND_TO", "sockets")
    refused = launch("-np", 1, sys.executable, "-c", AFFINITY)
    assert refused.returncode == 2
    assert "RINGCORE_BIND_TO must be core or none, got 'sockets'" in refused.stderr


LAYOUT = (
    "import ctypes; libc = ctypes.CDLL(None); "
    "print(ctypes.cast(libc.getpid, ctypes.c_void_p).value, open('/proc/self/personality').read().strip())"
)


def layouts(proc: subprocess.CompletedProcess[str]) -> dict[int, tuple[int, int]]:
    """Rank -> (where libc's ``getpid`` lies, the persona's ``ADDR_NO_RANDOMIZE`` bit) (LAYOUT's output)."""
    assert proc.returncode == 0, proc.stderr
    found = re.findall(r"^\[(\d+)\]<stdout>: (\d+) ([0-9a-f]+)$", proc.stdout, re.MULTILINE)
    return {int(rank): (int(where), int(persona, 16) & 0x0040000) for rank, where, persona in found}


def test_crowded_ranks_share_one_address_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--aslr auto``: ranks that outnumber the CPUs start with randomization off, so libc lies at
    one address in every rank; with a CPU each (or ``--aslr on``) the ranks are laid out at random."""
    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0":
        pytest.skip("this host randomizes no address space: nothing to tell apart")
    if int(Path("/proc/self/personality").read_text(), 16) & 0x0040000:
        pytest.skip("the tests run without address randomization (setarch -R)")
    skip_unless_layout_settable()
    monkeypatch.delenv("RINGCORE_ASLR", raising=False)
    usable = len(os.sched_getaffinity(0))
    crowded = layouts(launch("-np", usable + 1, sys.executable, "-c", LAYOUT))
    assert len(crowded) == usable + 1 and {where for where, _ in crowded.values()} == {crowded[0][0]}
    assert all(fixed for _, fixed in crowded.values())
    for args in (["-np", min(2, usable)], ["-np", usable + 1, "--aslr", "on"]):
        spread = layouts(launch(*args, sys.executable, "-c", LAYOUT))
        assert not any(fixed for _, fixed in spread.values()), args
        assert len(spread) < 2 or len({where for where, _ in spread.values()}) > 1, (args, spread)
    monkeypatch.setenv("RINGCORE_ASLR", "off")
    assert all(fixed for _, fixed in layouts(launch("-np", 2, sys.executable, "-c", LAYOUT)).values())
    monkeypatch.setenv("RINGCORE_ASLR", "no")
    refused = launch("-np", 1, sys.executable, "-c", LAYOUT)
    assert refused.returncode == 2 and "RINGCORE_ASLR must be auto, on or off, got 'no'" in refused.stderr


def test_a_python_without_ringcore_gets_a_hint_after_the_failure() -> None:
    """A rank whose ``python`` is not the environment's fails importing ringcore: the launcher names
    the failing rank, then says which Python it runs itself (the usual cause: a venv not activated)."""
    no_ringcore = "raise ModuleNotFoundError(\"No module named 'ringcore'\")"
    failed = launch("-np", 2, sys.executable, "-c", no_ringcore)
    assert failed.returncode == 1, failed.stderr
    assert "exited with code 1" in failed.stderr
    assert (
        "cannot import ringcore; activate the environment" in failed.stderr
        and sys.executable in failed.stderr
    )
    other = launch("-np", 1, sys.executable, "-c", "raise SystemExit(3)")
    assert other.returncode == 3 and "cannot import ringcore" not in other.stderr, other.stderr


def test_a_bad_setting_is_refused_once_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every rank would fail ``init`` on it, each with a traceback: the launcher says it once and exits 2."""
    monkeypatch.setenv("RINGCORE_TIMEOUT", "soon")
    started = tmp_path / "started"
    refused = launch("-np", 2, sys.executable, "-c", f"open({str(started)!r}, 'a').write('x')")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("RINGCORE_TIMEOUT='soon' is not a number of seconds") == 1, refused.stderr
    assert not started.exists()


@pytest.mark.timeout(90)
def test_output_lines_are_prefixed_and_never_interleaved(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        """
        for i in range(200):
            print(f"out {RANK} {i} " + "x" * 100)
            print(f"err {RANK} {i}", file=sys.stderr)
        """,
    )
    result = launch("-np", 3, sys.executable, script)
    assert result.returncode == 0, result.stderr
    out_lines, err_lines = result.stdout.splitlines(), result.stderr.splitlines()
    assert len(out_lines) == len(err_lines) == 600
    for line in out_lines:
        assert re.fullmatch(r"\[(\d)\]<stdout>: out \1 \d+ x{100}", line), line
    for line in err_lines:
        assert re.fullmatch(r"\[(\d)\]<stderr>: err \1 \d+", line), line


@pytest.mark.timeout(90)
def test_no_prefix_passes_lines_through(tmp_path: Path) -> None:
    script = write_script(tmp_path, 'print(f"plain {RANK}")\nprint("oops", file=sys.stderr)\n')
    result = launch("--np", 2, "--no-prefix", "--", sys.executable, script)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["plain 0", "plain 1"]
    assert result.stderr.splitlines() == ["oops", "oops"]


@pytest.mark.timeout(90)
def test_undecodable_output_is_replaced_not_fatal(tmp_path: Path) -> None:
    script = write_script(tmp_path, 'sys.stdout.buffer.write(b"bad \\xff\\xfe bytes\\nno newline")\n')
    result = launch("-np", 1, sys.executable, script)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[0]<stdout>: bad \ufffd\ufffd bytes", "[0]<stdout>: no newline"]


@pytest.mark.timeout(90)
def test_single_rank(tmp_path: Path) -> None:
    script = write_script(tmp_path, 'print(f"rank {RANK} of {SIZE}")\n')
    result = launch("-np", 1, sys.executable, script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[0]<stdout>: rank 0 of 1\n"


@pytest.mark.timeout(90)
def test_failing_rank_stops_the_others(tmp_path: Path) -> None:
    pids = pid_dir(tmp_path)
    script = write_script(tmp_path, sleepers_except(2, "sys.exit(3)"))
    result = launch("-np", 4, sys.executable, script, pids)
    elapsed = seconds_since_failure(pids)
    assert result.returncode == 3, result.stderr
    assert elapsed < 10, f"launcher took {elapsed:.1f}s after the failure to stop the job"
    assert "ringcore-run: rank 2 exited with code 3; stopped ranks 0, 1, 3" in result.stderr
    assert_dead(read_pids(pids))


@pytest.mark.timeout(90)
def test_rank_killed_by_signal(tmp_path: Path) -> None:
    pids = pid_dir(tmp_path)
    script = write_script(tmp_path, sleepers_except(1, "os.kill(os.getpid(), signal.SIGKILL)"))
    result = launch("-np", 3, sys.executable, script, pids)
    assert result.returncode == 128 + 9, result.stderr
    assert "ringcore-run: rank 1 was killed by signal SIGKILL (9); stopped ranks 0, 2" in result.stderr
    assert_dead(read_pids(pids))


@pytest.mark.timeout(90)
def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path: Path) -> None:
    pids = pid_dir(tmp_path)
    body = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + textwrap.dedent(
        sleepers_except(1, "sys.exit(5)")
    )
    script = write_script(tmp_path, body)
    result = launch("-np", 2, "--grace", 1, sys.executable, script, pids)
    elapsed = seconds_since_failure(pids)
    assert result.returncode == 5, result.stderr
    assert "rank 1 exited with code 5; stopped ranks 0" in result.stderr
    assert 0.9 <= elapsed < 10, f"expected the 1 s grace before SIGKILL, took {elapsed:.1f}s"
    assert_dead(read_pids(pids))


@pytest.mark.timeout(90)
def test_timeout_stops_the_job_with_124(tmp_path: Path) -> None:
    pids = pid_dir(tmp_path)
    script = write_script(tmp_path, "write_pid()\ntime.sleep(60)\n")
    result = launch("-np", 2, "--timeout", 2, sys.executable, script, pids)
    assert result.returncode == 124, result.stderr
    assert "--timeout" in result.stderr and "stopped ranks 0, 1" in result.stderr
    assert_dead(read_pids(pids))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_stops_all_ranks(tmp_path: Path, signum: int, code: int) -> None:
    pids = pid_dir(tmp_path)
    script = write_script(tmp_path, "write_pid()\ntime.sleep(60)\n")
    launcher = start_launcher("-np", 3, sys.executable, script, pids)
    try:
        wait_for_files(pids, 3)
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=LAUNCH_TIMEOUT)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == code, stderr
    assert f"received {signal.Signals(signum).name}; stopped ranks 0, 1, 2" in stderr
    assert_dead(read_pids(pids))


@pytest.mark.timeout(60)
def test_command_not_found() -> None:
    result = launch("-np", 2, "ringcore-no-such-command-xyz", timeout=30)
    assert result.returncode == 127
    assert "command not found: ringcore-no-such-command-xyz" in result.stderr


@pytest.mark.timeout(60)
def test_help_mentions_np() -> None:
    result = launch("--help", timeout=30)
    assert result.returncode == 0
    assert "-np" in result.stdout and "example" in result.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", [[], ["-np", "0", "x"], ["-np", "2"], ["-np", "two", "x"]])
def test_bad_command_lines_exit_2(args: list[str]) -> None:
    result = launch(*args, timeout=30)
    assert result.returncode == 2
    assert "usage:" in result.stderr


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (
            ["-np", "4", "python", "train.py", "--lr", "0.1", "-n", "3"],
            ["python", "train.py", "--lr", "0.1", "-n", "3"],
        ),
        (["-n", "4", "--", "python", "-c", "pass"], ["python", "-c", "pass"]),
        (["--np", "4", "--no-prefix", "--grace", "0.5", "prog"], ["prog"]),
    ],
)
def test_parse_args_splits_options_from_command(argv: list[str], command: list[str]) -> None:
    options = parse_args(argv)
    assert options.size == 4
    assert options.command == command
