"""Hostile bytes on every port a job opens: the store, the data listeners, established connections.

The store: one 3-rank job (``RINGCORE_HANDSHAKE_TIMEOUT=1``) serves every
test in the module. Hypothesis sends garbage, truncated and bogus handshakes,
each followed by a valid store request, to rank 0's store port while the
ranks run checked allreduce loops; a replayed handshake, a wrong key and
silent connections get their own tests. The store must never answer an
unauthenticated connection, the job's results must stay exact, and rank 0's
memory must stay bounded.

The data plane: its listeners are open only while the mesh forms (they close
once it is up), so the mesh is built in threads with ``connect_mesh`` and
attacked while it forms; then hypothesis writes raw bytes into an
established connection while the other side has a receive posted into a
guarded numpy buffer. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ringcore import auth
from ringcore.errors import AuthenticationError, PeerFailure, RingcoreError
from ringcore.transport import wire
from ringcore.transport.base import FrameMismatch, PeerAborted
from ringcore.transport.mesh import connect_mesh, make_listener
from ringcore.transport.tcp import TcpTransport, needed_links
from tests import tasks
from tests.cluster import Background, Cluster, RankError
from tests.security import BOUND, free_range, poke, recv_all

pytestmark = pytest.mark.timeout(90)

SECRET = "fuzz-secret-5bd1"
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
REQUEST = (
    len(packed := msgpack.packb(["mget", ["session"]], use_bin_type=True)).to_bytes(4, "little") + packed
)
SERVER_CHALLENGE = len(auth.MAGIC) + auth.NONCE_BYTES + auth.MAC_BYTES


# --------------------------------------------------------------------------- the job


@pytest.fixture(scope="module")
def port_range() -> tuple[int, int]:
    return free_range(40)


@pytest.fixture(scope="module")
def job(port_range: tuple[int, int]) -> Iterator[tuple[Cluster, int]]:
    env = {
        "RINGCORE_SECRET": SECRET,
        "RINGCORE_HANDSHAKE_TIMEOUT": "1",
        "RINGCORE_PORT_RANGE": f"{port_range[0]}-{port_range[1]}",
    }
    with Cluster(3, env=env) as cluster:
        host, port = cluster.results(tasks.store_address)[0]
        assert host == "127.0.0.1"
        yield cluster, port


def check_allreduce(cluster: Cluster) -> None:
    inputs = [np.arange(1000, dtype=np.float64) * (r + 1) - r for r in range(cluster.size)]
    expected = np.sum(inputs, axis=0)
    for out in cluster.results(tasks.allreduce, inputs, "sum"):
        np.testing.assert_array_equal(out, expected)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` has in LISTEN state."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for fields in (line.split() for line in lines):
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:
                address, port = local.split(":")
                if table == "tcp":
                    address = socket.inet_ntoa(bytes.fromhex(address)[::-1])
                found.append((address, int(port, 16)))
    return found


def assert_unanswered(reply: bytes, sent: bytes) -> None:
    """The store said nothing, or only its half of the handshake: never a store reply."""
    if sent[: len(auth.MAGIC)] == auth.MAGIC and len(sent) >= len(auth.MAGIC) + auth.NONCE_BYTES:
        assert reply in (b"",) or (len(reply) == SERVER_CHALLENGE and reply.startswith(auth.MAGIC)), reply
    else:
        assert reply == b"", reply


# --------------------------------------------------------------------------- where the job listens


def test_job_listens_only_on_loopback_within_the_port_range(
    job: tuple[Cluster, int], port_range: tuple[int, int]
) -> None:
    cluster, store_port = job
    reports = cluster.results(tasks.listening_report)
    assert reports[0]["store"] == ["127.0.0.1", store_port] or tuple(reports[0]["store"]) == (
        "127.0.0.1",
        store_port,
    )
    low, high = port_range
    for rank, report in enumerate(reports):
        for peer, _channel, local, remote in report["links"]:
            assert local[0] == "127.0.0.1" and remote[0] == "127.0.0.1"
            listener_port = local[1] if peer > rank else remote[1]  # higher ranks connect to lower
            assert low <= listener_port <= high, (rank, peer, listener_port)
        # the data listener is closed once the mesh is up; only rank 0's store listens
        expected = [("127.0.0.1", store_port)] if rank == 0 else []
        assert listening_sockets(report["pid"]) == expected, rank


# --------------------------------------------------------------------------- the store


truncated_hello = st.binary(min_size=0, max_size=auth.NONCE_BYTES - 1).map(lambda b: auth.MAGIC + b)
bogus_full_hello = st.binary(min_size=auth.NONCE_BYTES, max_size=auth.NONCE_BYTES + 80).map(
    lambda b: auth.MAGIC + b
)
store_garbage = st.one_of(st.binary(max_size=300), truncated_hello, bogus_full_hello)


def test_store_fuzz_while_collectives_run(job: tuple[Cluster, int], tmp_path: Path) -> None:
    cluster, port = job
    stop = tmp_path / "stop"
    loop = Background(cluster, tasks.allreduce_checked_until, 2000, str(stop))

    @FUZZ
    @given(payload=store_garbage, then_request=st.booleans())
    def attack(payload: bytes, then_request: bool) -> None:
        sent = payload + (REQUEST if then_request else b"")
        assert_unanswered(poke(port, sent), sent)

    try:
        attack()
    finally:
        stop.touch()
    reports = loop.join()
    assert not any(isinstance(r, RankError) for r in reports), reports
    assert len({r["rounds"] for r in reports}) == 1, reports
    assert reports[0]["rounds"] >= 1
    assert all(r["wrong"] == 0 for r in reports), reports
    check_allreduce(cluster)


class Recorder:
    """Records what ``client_handshake`` sends, passing everything through to the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def recv(self, nbytes: int) -> bytes:
        return self.sock.recv(nbytes)

    def settimeout(self, value: float | None) -> None:
        self.sock.settimeout(value)


def test_store_answers_only_after_the_handshake_and_never_to_a_replay(job: tuple[Cluster, int]) -> None:
    cluster, port = job
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:
        recorder = Recorder(sock)
        auth.client_handshake(recorder, SECRET.encode(), auth.STORE_CONTEXT, BOUND)  # type: ignore[arg-type]
        sock.sendall(REQUEST)
        length = int.from_bytes(sock.recv(4, socket.MSG_WAITALL), "little")
        status, (session,) = msgpack.unpackb(sock.recv(length, socket.MSG_WAITALL))
        assert status == "ok" and isinstance(session, int)  # the control: a real client is answered
    replay = b"".join(recorder.sent) + REQUEST
    assert_unanswered(poke(port, replay), replay)
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:  # no shutdown: no EOF hint
        sock.sendall(recorder.sent[0])
        sock.recv(SERVER_CHALLENGE, socket.MSG_WAITALL)
        sock.sendall(recorder.sent[1] + REQUEST)
        assert recv_all(sock) == b""
    check_allreduce(cluster)


def test_store_wrong_key_gets_no_answer(job: tuple[Cluster, int]) -> None:
    cluster, port = job
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:
        with pytest.raises(AuthenticationError, match="does not share"):
            auth.client_handshake(sock, b"guessed", auth.STORE_CONTEXT, BOUND)
        with contextlib.suppress(OSError):
            sock.sendall(REQUEST)
        assert recv_all(sock) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=BOUND) as sock:  # a request, no handshake
        sock.sendall(REQUEST)
        assert recv_all(sock) == b""
    check_allreduce(cluster)


def test_store_drops_silent_and_trickling_connections(job: tuple[Cluster, int]) -> None:
    cluster, port = job
    silent = [socket.create_connection(("127.0.0.1", port), timeout=BOUND) for _ in range(8)]
    trickler = socket.create_connection(("127.0.0.1", port), timeout=BOUND)
    try:
        check_allreduce(cluster)  # strangers holding connections open delay nobody
        start = time.monotonic()
        for byte in auth.MAGIC + bytes(auth.NONCE_BYTES):
            try:
                trickler.send(bytes([byte]))
            except OSError:
                break
            time.sleep(0.1)
            if time.monotonic() - start > BOUND:
                pytest.fail("a trickling client kept the store's handshake going past the bound")
        for sock in [*silent, trickler]:
            assert recv_all(sock) == b""  # closed by the store after RINGCORE_HANDSHAKE_TIMEOUT
    finally:
        for sock in [*silent, trickler]:
            sock.close()
    check_allreduce(cluster)


def test_store_memory_stays_bounded(job: tuple[Cluster, int]) -> None:
    cluster, port = job
    payloads = [os.urandom(64), auth.MAGIC + os.urandom(40), auth.MAGIC[:2], os.urandom(2000)]
    for i in range(40):  # warm up thread and allocator pools
        poke(port, payloads[i % len(payloads)] + REQUEST)
    before = rss_bytes(cluster.pids[0])
    for i in range(400):
        poke(port, payloads[i % len(payloads)] + REQUEST)
    time.sleep(0.2)
    growth = rss_bytes(cluster.pids[0]) - before
    assert growth < 50 * 1024 * 1024, f"rank 0 grew by {growth / 2**20:.1f} MiB over 400 rejected connections"
    check_allreduce(cluster)


# --------------------------------------------------------------------------- data plane: mesh setup

SESSION = 0x5EC0DE
KEY = b"k"
SIG = 0x51


def form_mesh(
    size: int, attack: Callable[[list[tuple[str, int]]], list[threading.Thread]] | None = None
) -> tuple[list[TcpTransport], list[threading.Thread]]:
    """Connect ``size`` ranks in threads; ``attack`` starts its own threads against the listeners first."""
    listeners = [make_listener("127.0.0.1", 0) for _ in range(size)]
    addresses = [sock.getsockname()[:2] for sock in listeners]
    attackers = attack(addresses) if attack is not None else []
    transports: list[Any] = [None] * size
    errors: list[BaseException] = []

    def connect(rank: int) -> None:
        try:
            transports[rank] = connect_mesh(
                rank, size, 1, listeners[rank], addresses, SESSION, 0, 20.0, key=KEY, handshake_timeout=1.0
            )
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=connect, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for sock in listeners:
        sock.close()
    if errors or any(t is None for t in transports):
        for transport in transports:
            if transport is not None:
                transport.close()
        pytest.fail(f"the mesh did not form: {errors}")
    return transports, attackers


def check_mesh(
    transports: list[TcpTransport], strangers: set[tuple[tuple[str, int], tuple[str, int]]]
) -> None:
    """Every connection is the real peer's socket, none is a stranger's, and data flows correctly.

    A stranger is told apart by its whole connection, ``(its address, the listener's)``: Linux
    reuses an ephemeral port for connections to different listeners, so a port alone is not enough.
    """
    size = len(transports)
    for rank, transport in enumerate(transports):
        assert set(transport.conns) == set(needed_links(rank, size, 1))
        for (peer, channel), conn in transport.conns.items():
            remote = conn.sock.getpeername()[:2]
            connection = (remote, conn.sock.getsockname()[:2])
            assert connection not in strangers, f"rank {rank} accepted a stranger as rank {peer}"
            assert remote == transports[peer].conns[(rank, channel)].sock.getsockname()[:2]
    results: list[dict[int, np.ndarray]] = [{} for _ in range(size)]
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            transport = transports[rank]
            mine = np.full(64, rank + 1, np.int32)
            outs = {peer: np.zeros(64, np.int32) for peer in range(size) if peer != rank}
            requests = [transport.irecv(p, 0, 9, SIG, memoryview(o).cast("B")) for p, o in outs.items()]
            requests += [transport.isend(p, 0, 9, SIG, memoryview(mine).cast("B")) for p in outs]
            deadline = time.monotonic() + 15
            while not all(r.done for r in requests) and time.monotonic() < deadline:
                transport.progress(0.05)
            assert all(r.done for r in requests), f"rank {rank}: the exchange did not finish within 15 s"
            results[rank] = outs
        except BaseException as err:  # a thread's exception would otherwise vanish with it
            errors[rank] = err

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not any(thread.is_alive() for thread in threads), "a rank's exchange outlived its 20 s join"
    assert not errors, f"ranks failed the exchange: {errors}"
    for rank in range(size):
        assert sorted(results[rank]) == [p for p in range(size) if p != rank], (rank, sorted(results[rank]))
        for peer, got in results[rank].items():
            np.testing.assert_array_equal(got, np.full(64, peer + 1, np.int32))


class Stranger:
    """One attacking connection to a data listener, run on its own thread."""

    def __init__(self, address: tuple[str, int], kind: str, payload: bytes = b"") -> None:
        self.sock = socket.create_connection(address, timeout=BOUND)
        self.local = self.sock.getsockname()[:2]
        self.connection = (self.local, tuple(address[:2]))
        self.kind = kind
        self.payload = payload
        self.error: BaseException | None = None
        self.leftover = b""
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.kind == "garbage":
                self.sock.sendall(self.payload)
            elif self.kind == "hello-only":  # a HELLO frame with no handshake
                self.sock.sendall(wire.pack(wire.HELLO, 0, 0, SESSION))
            elif self.kind == "wrong-key":
                auth.client_handshake(self.sock, b"not-k", auth.data_context(SESSION), BOUND)
            elif self.kind == "other-session":
                auth.client_handshake(self.sock, KEY, auth.data_context(SESSION + 1), BOUND)
            elif self.kind == "bad-hello":  # knows the key, claims a rank nobody expects
                auth.client_handshake(self.sock, KEY, auth.data_context(SESSION), BOUND)
                self.sock.sendall(wire.pack(wire.HELLO, 99, 0, SESSION) + self.payload)
            # "silent": sends nothing
            self.leftover = recv_all(self.sock, 10.0)
        except BaseException as err:
            self.error = err

    def finish(self) -> None:
        self.thread.join(15)
        self.sock.close()
        assert not self.thread.is_alive(), f"a {self.kind} stranger was never dropped"


STRANGER_KINDS = ["garbage", "hello-only", "wrong-key", "other-session", "bad-hello", "silent"]


def launch(plan: list[tuple[int, str, bytes]]) -> Callable[[list[tuple[str, int]]], list[Any]]:
    def attack(addresses: list[tuple[str, int]]) -> list[Any]:
        return [Stranger(addresses[rank], kind, payload) for rank, kind, payload in plan]

    return attack


def test_strangers_during_mesh_setup_are_dropped() -> None:
    """Strangers queue up ahead of the real ranks; ranks 0 and 1 accept and reject them, rank 2
    (which accepts nobody) never does, and closing its listener resets them."""
    plan = [(rank, kind, b"\x00garbage" * 8) for rank in range(3) for kind in STRANGER_KINDS]
    transports, strangers = form_mesh(3, launch(plan))
    try:
        check_mesh(transports, {s.connection for s in strangers})
        for (rank, kind, _), stranger in zip(plan, strangers, strict=True):
            stranger.finish()
            if rank == 2:
                # reset or closed with the listener: never answered, whatever it tried
                assert stranger.error is None or isinstance(
                    stranger.error, (ConnectionError, AuthenticationError)
                ), stranger.error
            elif kind in ("wrong-key", "other-session"):
                assert isinstance(stranger.error, AuthenticationError), (rank, kind, stranger.error)
                assert "does not share" in str(stranger.error)
            else:
                assert stranger.error is None, (rank, kind, stranger.error)
            assert stranger.leftover == b"", (rank, kind, stranger.leftover)  # closed, nothing said
    finally:
        for transport in transports:
            transport.close()


@settings(FUZZ, max_examples=40)
@given(
    plan=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(STRANGER_KINDS), st.binary(max_size=200)), max_size=5
    )
)
def test_fuzzed_strangers_during_mesh_setup(plan: list[tuple[int, str, bytes]]) -> None:
    transports, strangers = form_mesh(3, launch(plan))
    try:
        check_mesh(transports, {s.connection for s in strangers})
    finally:
        for transport in transports:
            transport.close()
        for stranger in strangers:
            stranger.sock.close()


# --------------------------------------------------------------------------- data plane: frames

GUARD = 64
TAG = wire.make_tag(7, 3, 1)


def pair() -> tuple[TcpTransport, TcpTransport]:
    transports, _ = form_mesh(2)
    return transports[0], transports[1]


def feed(sender: TcpTransport, data: bytes) -> None:
    """Write raw bytes into rank 0's connection to rank 1, then end the stream."""
    sock = sender.conns[(1, 0)].sock
    sock.setblocking(True)
    sock.settimeout(BOUND)
    with contextlib.suppress(OSError):
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)


def receive(receiver: TcpTransport, nbytes: int, early: bool) -> tuple[np.ndarray, Any, BaseException | None]:
    """Post a receive of ``nbytes`` into a guarded buffer (after some idle progress if ``early``)."""
    area = np.full(nbytes + 2 * GUARD, 0xA5, np.uint8)
    error: BaseException | None = None
    request = None
    try:
        if early:  # let the bytes arrive with no receive posted: the idle-peek path
            for _ in range(3):
                receiver.progress(0.02)
        request = receiver.irecv(0, 0, TAG, SIG, memoryview(area)[GUARD : GUARD + nbytes])
        deadline = time.monotonic() + 10
        while not request.done and time.monotonic() < deadline:
            receiver.progress(0.05)
        assert request.done, "progress neither finished the receive nor raised"
    except BaseException as err:
        error = err
    return area, request, error


header_fields = st.tuples(
    st.sampled_from([wire.MAGIC, wire.MAGIC, wire.MAGIC, 0, 0x4352, 0xFFFF]),
    st.sampled_from([wire.DATA, wire.DATA, wire.ABORT, wire.HELLO, wire.BYE, 0, 5, 255]),
    st.one_of(st.just(TAG), st.integers(0, 2**64 - 1)),
    st.one_of(st.just(SIG), st.integers(0, 2**64 - 1)),
    st.one_of(
        st.sampled_from([0, 1, 16, 17, 100, 2**60, 2**64 - 1]),
        st.integers(0, 300),
        st.integers(0, 2**64 - 1),
    ),
)
payloads = st.one_of(
    st.binary(max_size=200),
    st.dictionaries(
        st.text(max_size=8), st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20), max_size=4
    ).map(lambda reason: msgpack.packb(reason, use_bin_type=True)),
)
frames = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda fields, payload: wire.HEADER.pack(fields[0], fields[1], 0, 0, *fields[2:]) + payload,
        header_fields,
        payloads,
    ),
    st.builds(  # a well-formed frame for the posted receive, cut short or with more behind it
        lambda nbytes, payload: wire.pack(wire.DATA, TAG, SIG, nbytes) + payload,
        st.sampled_from([0, 1, 16, 100]),
        st.binary(max_size=200),
    ),
)


@settings(FUZZ, max_examples=300)
@given(data=frames, nbytes=st.sampled_from([0, 1, 16, 100]), early=st.booleans())
def test_fuzzed_frames_never_escape_the_posted_view(data: bytes, nbytes: int, early: bool) -> None:
    sender, receiver = pair()
    try:
        feed(sender, data)
        area, request, error = receive(receiver, nbytes, early)
    finally:
        sender.close()
        receiver.close()
    assert (area[:GUARD] == 0xA5).all() and (area[GUARD + nbytes :] == 0xA5).all(), "wrote outside the view"
    event(type(error).__name__)
    if error is not None:
        assert isinstance(error, RingcoreError), f"{type(error).__name__}: {error}"
        assert isinstance(error, (FrameMismatch, PeerAborted, wire.ProtocolError, PeerFailure))
    else:  # only a well-formed frame for exactly this receive may complete it
        header = wire.HEADER.pack(wire.MAGIC, wire.DATA, 0, 0, TAG, SIG, nbytes)
        assert data[:3] == header[:3] and data[8:32] == header[8:32], data[:32]
        assert request.done and bytes(area[GUARD : GUARD + nbytes]) == data[32 : 32 + nbytes]


@pytest.mark.parametrize(
    ("kind", "expected"),
    [(wire.DATA, FrameMismatch), (wire.ABORT, wire.ProtocolError), (wire.HELLO, wire.ProtocolError)],
    ids=["data", "abort", "hello"],
)
@pytest.mark.parametrize("early", [False, True], ids=["posted", "idle"])
def test_huge_nbytes_is_rejected_before_any_allocation(kind: int, expected: type, early: bool) -> None:
    sender, receiver = pair()
    try:
        feed(sender, wire.HEADER.pack(wire.MAGIC, kind, 0, 0, TAG, SIG, 2**60) + b"x" * 100)
        tracemalloc.start()
        try:
            area, _, error = receive(receiver, 16, early)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        sender.close()
        receiver.close()
    assert isinstance(error, expected), repr(error)
    if isinstance(error, FrameMismatch):
        assert error.field == "nbytes" and error.got == 2**60
    assert peak < 1024 * 1024, f"{peak} bytes allocated while rejecting the frame"
    assert (area[:GUARD] == 0xA5).all() and (area[GUARD + 16 :] == 0xA5).all()
