"""Elastic training under ``ringcore-run --min-np/--max-np/--host-discovery-script`` (issue 27).

Real processes on real sockets: ``tests/elastic_task.py`` trains a numpy model
(an MLP under ``ringcore.torch`` with ``--torch``) on 2-4 workers, with
faults from inside the victim (SIGKILL or SIGSTOP in the middle of an
allreduce, death in the middle of a re-rendezvous), never from a timer. Each
test checks the launcher's exit code and what it says about each generation,
that every rank of the last generation ends with the same committed state
(epoch, batch, step count, bitwise-equal parameters: no step lost or done
twice), and that no worker is left running and the launcher's port is free.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ringcore import discovery, elastic_driver, hosts
from ringcore.run import parse_args
from tests.cluster import alive, free_port
from tests.netns_hosts import ssh_cluster, unavailable

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "tests" / "elastic_task.py"
EXAMPLE = ROOT / "examples" / "elastic_numpy.py"
ENV = {"RINGCORE_TIMEOUT": "5"}  # a dead peer is seen at once; 5 s only bounds a stalled one
STEPS = 36  # the task's 3 epochs of 12 batches
GENERATION = re.compile(r"ringcore-run: generation (\d+): (\d+) ranks \(workers ([\d, ]+)\)")


def launcher(port: int, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", "ringcore.run", "--port", str(port), *map(str, args)]


def task(out: Path, *args: str) -> list[str]:
    return [sys.executable, str(TASK), str(out), *args]


def run(command: list[str], timeout: float = 90, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **ENV, **env}
    )


def generations(stderr: str) -> list[list[int]]:
    """Each generation's workers, in rank order, as the launcher announced them."""
    found = [(int(g), int(n), [int(w) for w in ws.split(", ")]) for g, n, ws in GENERATION.findall(stderr)]
    assert [g for g, _, _ in found] == list(range(1, len(found) + 1)), stderr
    assert all(n == len(ws) for _, n, ws in found), stderr
    return [ws for _, _, ws in found]


def finals(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out.glob("final.*.json")}


def assert_consistent(out: Path, workers: list[int], steps: int = STEPS) -> dict[int, dict[str, Any]]:
    """Every worker of the last generation finished with the same committed state, ranks in order."""
    found = finals(out)
    assert sorted(found) == sorted(workers), found
    first = found[workers[0]]
    for worker, final in found.items():
        same = {key: final[key] for key in ("epoch", "batch", "steps", "digest", "size", "generation")}
        assert same == {key: first[key] for key in same}, (worker, final, first)
    assert first["steps"] == steps and first["batch"] == 0 and first["size"] == len(workers), first
    assert [found[w]["rank"] for w in workers] == list(range(len(workers)))
    return found


def assert_nothing_left(out: Path, port: int) -> None:
    """No worker process runs any more, and the launcher's port can be bound again."""
    deadline = time.monotonic() + 5
    for path in out.glob("pid.*"):
        pid = int(path.read_text())
        while alive(pid):
            assert time.monotonic() < deadline, f"{path.name}: process {pid} is still running"
            time.sleep(0.05)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))


def stamp(out: Path, worker: int) -> float:
    return float((out / f"fault.{worker}").read_text())


# --------------------------------------------------------------------------- losing ranks


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [2, 0], ids=["rank2", "rank0"])
def test_training_goes_on_when_a_rank_is_killed_mid_allreduce(tmp_path: Path, victim: int) -> None:
    port, out = free_port(), tmp_path / "out"
    args = ["-np", "4", "--min-np", "2", "--max-np", "4", "--elastic-timeout", "20"]
    proc = run(launcher(port, *args, *task(out, "--kill", f"{victim}:1:5")))
    assert proc.returncode == 0, proc.stderr
    survivors = [w for w in range(4) if w != victim]
    assert generations(proc.stderr) == [[0, 1, 2, 3], survivors]
    assert f"worker {victim} was killed by signal SIGKILL (9) (rank {victim} of generation 1)" in proc.stderr
    found = assert_consistent(out, survivors)
    assert all(final["resets"] == [3] for final in found.values())
    assert_nothing_left(out, port)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("victim", [1, 0], ids=["rank1", "rank0"])
def test_a_rank_that_dies_during_the_re_rendezvous(tmp_path: Path, victim: int) -> None:
    """Worker 2 dies mid-allreduce; then ``victim`` dies after checking in, before meeting generation 2."""
    port, out = free_port(), tmp_path / "out"
    args = ["-np", "4", "--min-np", "2", "--elastic-timeout", "6"]
    proc = run(launcher(port, *args, *task(out, "--kill", "2:1:5", "--die-joining", f"{victim}:2")))
    assert proc.returncode == 0, proc.stderr
    last = [w for w in (0, 1, 3) if w != victim]
    assert generations(proc.stderr) == [[0, 1, 2, 3], [0, 1, 3], last]
    assert f"worker {victim} was killed by signal SIGKILL (9) (rank {victim} of generation 2)" in proc.stderr
    assert_consistent(out, last)
    assert_nothing_left(out, port)


@pytest.mark.timeout(90)
def test_a_stalled_rank_is_stopped_and_left_out(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "out"
    args = ["-np", "4", "--min-np", "2", "--elastic-timeout", "4", "--grace", "1"]
    proc = run(launcher(port, *args, *task(out, "--stall", "3:1:5")), RINGCORE_TIMEOUT="2")
    assert proc.returncode == 0, proc.stderr
    assert generations(proc.stderr) == [[0, 1, 2, 3], [0, 1, 2]]
    assert "worker 3 (rank 3) did not come back to the rendezvous within 4 s" in proc.stderr
    assert_consistent(out, [0, 1, 2])
    assert_nothing_left(out, port)


# --------------------------------------------------------------------------- below --min-np


@pytest.mark.timeout(90)
def test_below_min_np_with_a_discovery_script_fails_after_the_elastic_timeout(tmp_path: Path) -> None:
    """4 workers, --min-np 3: the second loss leaves 2; no slot comes back (the host cools down)."""
    port, out, listing = free_port(), tmp_path / "out", tmp_path / "hosts"
    listing.write_text("localhost:4\n")
    args = ["-np", "4", "--min-np", "3", "--host-discovery-script", f"cat {listing}"]
    args += ["--elastic-timeout", "5", "--failure-cooldown", "120"]
    proc = run(launcher(port, *args, *task(out, "--kill", "1:0:5", "--kill", "2:1:2")))
    ended = time.time()
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert generations(proc.stderr) == [[0, 1, 2, 3], [0, 2, 3]]
    expected = (
        "ringcore-run: 2 workers left, fewer than --min-np 3, for 5 s (--elastic-timeout); the first "
        "failure: worker 2 on localhost was killed by signal SIGKILL (9) (rank 1 of generation 2); "
        "stopped workers 0, 3"
    )
    assert expected in proc.stderr
    waited = ended - stamp(out, 2)
    assert 5 <= waited < 5 + 8, f"the launcher ended {waited:.1f} s after the second loss"
    assert not finals(out)
    assert_nothing_left(out, port)


@pytest.mark.timeout(60)
def test_below_min_np_without_discovery_fails_at_once(tmp_path: Path) -> None:
    port, out = free_port(), tmp_path / "out"
    proc = run(launcher(port, "-np", "3", "--min-np", "3", *task(out, "--kill", "1:0:5")))
    ended = time.time()
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert (
        "ringcore-run: 2 workers left, fewer than --min-np 3; the first failure: worker 1 was killed"
        in proc.stderr
    )
    assert ended - stamp(out, 1) < 5
    assert_nothing_left(out, port)


@pytest.mark.timeout(60)
def test_a_script_that_never_checks_in_is_stopped(tmp_path: Path) -> None:
    port = free_port()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = run(
        launcher(port, "-np", "2", "--max-np", "2", "--elastic-timeout", "2", "--grace", "1", *sleeper)
    )
    assert proc.returncode == 1, proc.stderr
    assert "worker 0 did not check in within 2 s (--elastic-timeout) of its start; does the script use" in (
        proc.stderr
    )
    # Both workers pass the bound in one pass of the driver, or (under load, started further apart) one
    # pass ends the job with the other still inside its bound: either way the job ends below --min-np.
    assert re.search(r"[01] workers? left, fewer than --min-np 2", proc.stderr), proc.stderr


# --------------------------------------------------------------------------- growing


@pytest.mark.timeout(90)
def test_a_new_slot_from_the_discovery_script_grows_the_world(tmp_path: Path) -> None:
    port, out, listing = free_port(), tmp_path / "out", tmp_path / "hosts"
    listing.write_text("localhost:3\n")
    args = [
        "--min-np",
        "2",
        "--max-np",
        "4",
        "--host-discovery-script",
        f"cat {listing}",
        "--elastic-timeout",
        "20",
    ]
    command = launcher(port, *args, *task(out, "--hold-until-size", "4", "--step-seconds", "0.05"))
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "progress").exists():  # generation 1 trains
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        listing.write_text("localhost:4\n")
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert generations(stderr) == [[0, 1, 2], [0, 1, 2, 3]]
    found = assert_consistent(out, [0, 1, 2, 3])
    assert [found[w]["resets"] for w in range(4)] == [[4], [4], [4], []]  # the newcomer had nothing to reset
    assert_nothing_left(out, port)


@pytest.mark.timeout(120)
def test_torch_state_survives_a_kill_and_takes_in_the_replacement(tmp_path: Path) -> None:
    """TorchState + DistributedOptimizer (SGD with momentum): 3 ranks, one killed mid-backward, its slot
    refilled by the discovery script at once (no cooldown): the newcomer gets model and momentum."""
    pytest.importorskip("torch")
    port, out, listing = free_port(), tmp_path / "out", tmp_path / "hosts"
    listing.write_text("localhost:3\n")
    args = ["--min-np", "2", "--max-np", "3", "--host-discovery-script", f"cat {listing}"]
    args += ["--failure-cooldown", "0", "--elastic-timeout", "30"]
    proc = run(launcher(port, *args, *task(out, "--torch", "--kill", "1:0:4", "--hold-until-size", "3")), 110)
    assert proc.returncode == 0, proc.stderr
    assert generations(proc.stderr) == [[0, 1, 2], [0, 2], [0, 2, 3]]
    found = assert_consistent(out, [0, 2, 3])
    assert all(found[w]["sampler"] == {"epoch": 3, "processed": 0} for w in (0, 2, 3)), found
    assert_nothing_left(out, port)


@pytest.mark.timeout(120)
def test_across_hosts_a_lost_remote_worker_is_replaced(tmp_path: Path) -> None:
    """Two emulated hosts (tests/netns_hosts.py): ringcore-run on host 0, workers 2 and 3 on host 1
    over ssh; worker 3 dies mid-allreduce and the discovery script's slot on host 1 gets a new one."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"emulated ssh cluster: {reason}")
    out, listing = tmp_path / "out", tmp_path / "hosts"
    with ssh_cluster(2) as cluster:
        listing.write_text("".join(f"{address}:2\n" for address in cluster.addresses))
        args = [*cluster.ssh_options(), "--addr", cluster.addresses[0], "--min-np", "2", "--max-np", "4"]
        args += [
            "--host-discovery-script",
            f"cat {listing}",
            "--failure-cooldown",
            "0",
            "--elastic-timeout",
            "30",
        ]
        command = launcher(free_port(), *args, *task(out, "--kill", "3:1:5", "--hold-until-size", "4"))
        proc = run(cluster.on(0, *command), 100)
        assert proc.returncode == 0, proc.stderr
        assert generations(proc.stderr) == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 4]]
        assert f"worker 3 on {cluster.addresses[1]} was killed by signal SIGKILL (9)" in proc.stderr
        assert_consistent(out, [0, 1, 2, 4])
        deadline = time.monotonic() + 10
        while any(cluster.strays(host) for host in range(2)):
            assert time.monotonic() < deadline, [cluster.strays(host) for host in range(2)]
            time.sleep(0.05)


# --------------------------------------------------------------------------- the README example


@pytest.mark.timeout(90)
def test_the_example_survives_kill_9_from_outside(tmp_path: Path) -> None:
    """``examples/elastic_numpy.py`` as the README runs it; a worker is killed with ``kill -9`` by PID."""
    port = free_port()
    command = launcher(port, "-np", "3", "--min-np", "2", "--max-np", "3", sys.executable, EXAMPLE, "0.03")
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, **ENV},
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline()]
        while "epoch 1:" not in lines[-1]:
            assert lines[-1], proc.communicate()
            lines.append(proc.stdout.readline())
        os.kill(_children(proc.pid)[1], signal.SIGKILL)  # worker 1
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    stdout = "".join(lines) + stdout
    assert proc.returncode == 0, stderr
    assert generations(stderr) == [[0, 1, 2], [0, 2]]
    assert "ringcore-run: worker 1 was killed by signal SIGKILL (9) (rank 1 of generation 1)" in stderr
    assert "[0]<stdout>: rank 0: now 2 ranks" in stdout and "[2]<stdout>: rank 1: now 2 ranks" in stdout
    assert "[0]<stdout>: done: 5 epochs, 2 ranks at the end" in stdout
    error = float(re.findall(r"epoch 5: max \|w - w_true\| = (\S+) on 2 ranks", stdout)[0])
    assert error < 1e-4


def _children(pid: int) -> list[int]:
    """The PIDs whose parent is ``pid``, oldest first (the workers, in start order)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append((int(fields[19]), int(stat.parent.name)))  # (start time, pid)
    return [child for _, child in sorted(found)]


# --------------------------------------------------------------------------- the pieces


def test_elastic_command_lines() -> None:
    options = parse_args(["-np", "4", "--min-np", "2", "--max-np", "6", "python", "train.py"])
    assert options.elastic == elastic_driver.ElasticOptions(2, 6, None, 60.0, 10.0)
    options = parse_args(
        ["--min-np", "2", "--host-discovery-script", "./d.sh", "--elastic-timeout", "9", "x"]
    )
    assert (options.size, options.elastic) == (0, elastic_driver.ElasticOptions(2, None, "./d.sh", 9.0, 10.0))
    assert parse_args(["-np", "3", "--max-np", "5", "x"]).elastic == elastic_driver.ElasticOptions(3, 5)
    assert parse_args(["-np", "3", "x"]).elastic is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-np", "2", "--min-np", "3", "x"], "--min-np 3 is more than -np 2"),
        (["-np", "4", "--max-np", "3", "x"], "--max-np 3 is less than -np 4"),
        (["-np", "2", "--elastic-timeout", "5", "x"], "--elastic-timeout needs elastic mode"),
        (["-H", "a:2", "--host-discovery-script", "d", "x"], "leave out -H/--hostfile"),
    ],
)
def test_bad_elastic_command_lines_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_discovery_output_is_read_as_horovod_prints_it() -> None:
    assert discovery.parse("hostA:4\n\n# spare\nhostB\nhostA:2\n") == [
        hosts.Host("hostA", 6),
        hosts.Host("hostB", 1),
    ]
    for bad in ("hostA slots=4", "a:0", "a:2,b:2"):
        with pytest.raises(discovery.DiscoveryError):
            discovery.parse(bad)
    with pytest.raises(discovery.DiscoveryError, match="exited with code 3: nope"):
        discovery.discover("echo nope >&2; exit 3")
    assert discovery.discover("printf 'localhost:2\\n'") == [hosts.Host("localhost", 2)]


def test_seats_fill_free_slots_in_order_up_to_the_room_left() -> None:
    listing = [hosts.Host("a", 2), hosts.Host("b", 3)]
    assert elastic_driver.plan_seats(listing, {}, set(), 4) == [
        ("a", 0, 2),
        ("a", 1, 2),
        ("b", 0, 3),
        ("b", 1, 3),
    ]
    assert elastic_driver.plan_seats(listing, {"a": {0}, "b": {1}}, {"b"}, 9) == [("a", 1, 2)]
    assert elastic_driver.plan_seats(listing, {"a": {0, 1}}, set(), 1) == [("b", 0, 3)]
    assert elastic_driver.plan_seats(listing, {}, set(), 0) == []
    seats = {
        7: hosts.Slot(7, "a", 1, 2, True),
        8: hosts.Slot(8, "b", 2, 3, True),
        9: hosts.Slot(9, "b", 0, 3, True),
    }
    assert elastic_driver.excess(seats, [hosts.Host("b", 2)]) == {7, 8}
