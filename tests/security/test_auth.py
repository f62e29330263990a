"""Who may talk to a rank: the HMAC handshake, the job secret, and where ranks listen.

Three layers, cheapest first: the handshake of :mod:`ringcore.auth` between
two ends of a ``socketpair`` (same key, wrong key, garbage, slow clients,
replayed and reflected transcripts, mixed-up contexts); an in-process
:class:`~ringcore.store.StoreServer` fed strangers; and real jobs in fresh
interpreters (a rank with the wrong ``RINGCORE_SECRET``, a job with none).
Everything stays on 127.0.0.1. Time bounds only cap how long a rejection
may take; they are generous.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ringcore
from ringcore import auth
from ringcore.config import Settings
from ringcore.errors import AuthenticationError, ConfigError
from ringcore.rendezvous import interface_address, listen_address
from ringcore.store import StoreClient, StoreServer, send_message
from ringcore.transport.mesh import make_listener
from tests import tasks
from tests.cluster import Cluster, free_port
from tests.security import BOUND, free_range, poke

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
KEY = b"job-secret"
DATA = auth.data_context(0x5EC)


# --------------------------------------------------------------------------- helpers


def serve(
    sock: socket.socket, key: bytes, context: bytes = DATA, timeout: float = 5.0
) -> Callable[[], BaseException | None]:
    """Run ``server_handshake`` on a thread; the returned function waits and gives its error."""
    result: list[BaseException | None] = [None]

    def body() -> None:
        try:
            auth.server_handshake(sock, key, context, timeout)
        except BaseException as err:
            result[0] = err
        finally:
            sock.close()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()

    def wait() -> BaseException | None:
        thread.join(timeout + BOUND)
        assert not thread.is_alive(), "server_handshake did not return within its timeout"
        return result[0]

    return wait


def client(
    sock: socket.socket, key: bytes, context: bytes = DATA, timeout: float = 5.0
) -> BaseException | None:
    """Run ``client_handshake``, close the socket, and return its error (``None`` on success)."""
    try:
        auth.client_handshake(sock, key, context, timeout)
    except BaseException as err:
        return err
    finally:
        sock.close()
    return None


class Recorder:
    """A socket stand-in that records what ``client_handshake`` sends and receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []
        self.received = bytearray()

    def sendall(self, data: bytes) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def recv(self, nbytes: int) -> bytes:
        chunk = self.sock.recv(nbytes)
        self.received += chunk
        return chunk

    def settimeout(self, value: float | None) -> None:
        self.sock.settimeout(value)


# --------------------------------------------------------------------------- the handshake


def test_same_key_passes_both_ways() -> None:
    a, b = socket.socketpair()
    wait = serve(b, KEY)
    assert client(a, KEY) is None
    assert wait() is None


def test_empty_key_on_both_sides_passes() -> None:
    """The no-secret mode runs the same protocol with an empty key."""
    a, b = socket.socketpair()
    wait = serve(b, b"")
    assert client(a, b"") is None
    assert wait() is None


@pytest.mark.parametrize(("client_key", "server_key"), [(b"other", KEY), (b"", KEY), (KEY, b"")])
def test_different_keys_fail_on_both_sides(client_key: bytes, server_key: bytes) -> None:
    a, b = socket.socketpair()
    wait = serve(b, server_key)
    err = client(a, client_key)
    assert isinstance(err, AuthenticationError)
    assert "does not share" in str(err)
    assert isinstance(wait(), AuthenticationError)


@pytest.mark.parametrize(
    ("client_context", "server_context"),
    [
        (auth.STORE_CONTEXT, DATA),
        (DATA, auth.STORE_CONTEXT),
        (auth.data_context(1), auth.data_context(2)),
    ],
    ids=["store-to-data", "data-to-store", "other-session"],
)
def test_different_contexts_fail(client_context: bytes, server_context: bytes) -> None:
    a, b = socket.socketpair()
    wait = serve(b, KEY, server_context)
    assert isinstance(client(a, KEY, client_context), AuthenticationError)
    assert isinstance(wait(), AuthenticationError)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"R",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64,
        b"\x00" * 36,
        auth.MAGIC[:3] + b"\xff" * 33,
    ],
    ids=["nothing", "one-byte", "http", "zeros", "near-magic"],
)
def test_garbage_client_is_rejected_promptly(payload: bytes) -> None:
    a, b = socket.socketpair()
    wait = serve(b, KEY, timeout=0.5)
    start = time.monotonic()
    with contextlib.suppress(OSError):
        a.sendall(payload)
        a.shutdown(socket.SHUT_WR)
    assert isinstance(wait(), AuthenticationError)
    assert time.monotonic() - start < BOUND
    a.close()


def test_silent_client_times_out() -> None:
    a, b = socket.socketpair()
    wait = serve(b, KEY, timeout=0.5)
    start = time.monotonic()
    err = wait()
    assert isinstance(err, AuthenticationError)
    assert "timed out" in str(err)
    assert time.monotonic() - start < BOUND
    a.close()


def test_trickling_client_cannot_extend_the_deadline() -> None:
    """One byte at a time keeps each recv busy, but the deadline covers the whole handshake."""
    a, b = socket.socketpair()
    wait = serve(b, KEY, timeout=0.6)
    start = time.monotonic()
    hello = auth.MAGIC + os.urandom(auth.NONCE_BYTES)
    for byte in hello:
        try:
            a.send(bytes([byte]))
        except OSError:  # the server gave up and closed its end
            break
        time.sleep(0.1)
    err = wait()
    assert isinstance(err, AuthenticationError)
    assert "timed out" in str(err)
    assert time.monotonic() - start < BOUND
    a.close()


def test_silent_server_times_out_the_client() -> None:
    a, b = socket.socketpair()
    start = time.monotonic()
    err = client(a, KEY, timeout=0.5)
    assert isinstance(err, AuthenticationError)
    assert time.monotonic() - start < BOUND
    b.close()


def recorded_handshake() -> Recorder:
    """A successful data-plane handshake, with both directions' bytes recorded on the client."""
    a, b = socket.socketpair()
    wait = serve(b, KEY)
    recorder = Recorder(a)
    auth.client_handshake(recorder, KEY, DATA, 5.0)  # type: ignore[arg-type]
    a.close()
    assert wait() is None
    return recorder


def test_replayed_client_transcript_fails() -> None:
    """A recorded, successful client side replayed to a fresh server: the server's nonce is new."""
    recorder = recorded_handshake()
    hello, answer = recorder.sent
    assert len(hello) == 36 and len(answer) == 32

    a, b = socket.socketpair()
    wait = serve(b, KEY)
    a.sendall(hello)
    reply = a.recv(68, socket.MSG_WAITALL)
    assert reply[:4] == auth.MAGIC and reply[4:36] != recorder.received[4:36]
    a.sendall(answer)
    err = wait()
    assert isinstance(err, AuthenticationError)
    assert "does not know" in str(err)
    a.close()


def test_replayed_server_transcript_fails() -> None:
    """A recorded server reply replayed to a fresh client: the client's nonce is new."""
    recorder = recorded_handshake()

    a, b = socket.socketpair()
    replay = threading.Thread(target=lambda: (b.recv(36, socket.MSG_WAITALL), b.sendall(recorder.received)))
    replay.start()
    err = client(a, KEY)
    replay.join(BOUND)
    b.close()
    assert isinstance(err, AuthenticationError)
    assert "does not share" in str(err)


def test_reflected_server_mac_fails() -> None:
    """Sending the server's own MAC back as the client's answer: the roles are bound into the MAC."""
    a, b = socket.socketpair()
    wait = serve(b, KEY)
    a.sendall(auth.MAGIC + os.urandom(auth.NONCE_BYTES))
    reply = a.recv(68, socket.MSG_WAITALL)
    a.sendall(reply[-auth.MAC_BYTES :])
    assert isinstance(wait(), AuthenticationError)
    a.close()


# --------------------------------------------------------------------------- the store, in process


@pytest.fixture
def ringcore_log() -> Any:
    """Records of the ``ringcore`` logger (attached directly: init() may have turned propagation off)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ringcore")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


@pytest.fixture
def store() -> Any:
    server = StoreServer("127.0.0.1", 0, KEY, handshake_timeout=1.0)
    yield server
    server.close()


def request_bytes(message: Any) -> bytes:
    a, b = socket.socketpair()
    with a, b:
        send_message(a, message)
        return b.recv(65536)


def test_store_rejects_strangers_and_logs_them(store: StoreServer, ringcore_log: list) -> None:
    request = request_bytes(["mget", ["anything"]])
    assert poke(store.port, request) == b""
    deadline = time.monotonic() + BOUND
    while not ringcore_log and time.monotonic() < deadline:
        time.sleep(0.02)
    messages = [r.getMessage() for r in ringcore_log]
    assert any("store: rejected a connection from 127.0.0.1" in m for m in messages), messages
    assert all(KEY.decode() not in m for m in messages)


def test_store_close_ends_handshakes_in_progress_without_calling_them_rejected(
    store: StoreServer, ringcore_log: list
) -> None:
    silent = socket.create_connection(("127.0.0.1", store.port), timeout=BOUND)
    with silent:
        time.sleep(0.2)  # the server is now waiting for this client's half of the handshake
        store.close()  # joins the handshake threads, so their log lines are in
    messages = [r.getMessage() for r in ringcore_log]
    assert not any("rejected" in m for m in messages), messages


def test_store_client_with_wrong_key_says_so(store: StoreServer) -> None:
    with pytest.raises(AuthenticationError) as info:
        StoreClient("127.0.0.1", store.port, 5.0, b"wrong", handshake_timeout=2.0)
    message = str(info.value)
    assert "authentication" in message and "failed" in message
    assert "RINGCORE_SECRET" in message
    good = StoreClient("127.0.0.1", store.port, 5.0, KEY, handshake_timeout=2.0)
    good.set("still", "serving")
    assert good.mget(["still"]) == ["serving"]
    good.close()


def live_sockets() -> int:
    """Socket objects alive in this process (after a collection)."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance on deprecated module proxies (torch's) warns
        warnings.simplefilter("ignore")
        return sum(isinstance(o, socket.socket) for o in gc.get_objects())


def test_store_keeps_no_objects_for_rejected_connections(store: StoreServer) -> None:
    """Memory stays bounded: a rejected stranger leaves nothing behind on the server.

    A regression test: the store once kept every accepted socket (in
    ``StoreServer.clients``) until it closed, so each rejected or finished
    connection stayed alive.
    """
    for _ in range(10):
        poke(store.port, b"x" * 40)
    before = live_sockets()
    for _ in range(200):
        poke(store.port, b"x" * 40)
    deadline = time.monotonic() + 10  # the store's threads let go of the last ones in their own time
    while (after := live_sockets()) - before >= 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert after - before < 20, f"{after - before} socket objects kept after 200 rejected connections"


# --------------------------------------------------------------------------- where ranks listen


def test_data_listener_and_store_bind_loopback_only() -> None:
    host = listen_address(Settings(), "127.0.0.1", free_port())
    assert host == "127.0.0.1"
    listener = make_listener(host, 0)
    server = StoreServer(host, 0, KEY)
    try:
        assert listener.getsockname()[0] == "127.0.0.1"
        assert server.listener.getsockname()[0] == "127.0.0.1"
    finally:
        listener.close()
        server.close()


def test_port_range_confines_the_data_listener() -> None:
    low, high = free_range(8)
    settings = Settings.from_env({"RINGCORE_PORT_RANGE": f"{low}-{high}"})
    assert settings.port_range == (low, high)
    listeners = []
    try:
        for _ in range(3):
            listeners.append(make_listener("127.0.0.1", 0, port_range=settings.port_range))
        ports = [sock.getsockname()[1] for sock in listeners]
        assert all(low <= port <= high for port in ports), ports
        assert len(set(ports)) == 3
    finally:
        for sock in listeners:
            sock.close()


def test_full_port_range_is_a_config_error() -> None:
    low, high = free_range(2)
    taken = [make_listener("127.0.0.1", 0, port=port) for port in (low, high)]
    try:
        with pytest.raises(
            ConfigError, match=rf"no free port on 127\.0\.0\.1 in RINGCORE_PORT_RANGE={low}-{high}"
        ):
            make_listener("127.0.0.1", 0, port_range=(low, high))
    finally:
        for sock in taken:
            sock.close()


@pytest.mark.parametrize("text", ["20000", "b-c", "20100-20000", "0-10", "1-70000"])
def test_bad_port_range_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="RINGCORE_PORT_RANGE"):
        Settings.from_env({"RINGCORE_PORT_RANGE": text})


def test_ifname_lo_resolves_to_loopback() -> None:
    assert interface_address("lo") == "127.0.0.1"
    settings = Settings.from_env({"RINGCORE_IFNAME": "lo"})
    assert listen_address(settings, "127.0.0.1", 1) == "127.0.0.1"


def test_bogus_ifname_lists_the_interfaces() -> None:
    settings = Settings.from_env({"RINGCORE_IFNAME": "nosuchif0"})
    with pytest.raises(ConfigError, match="RINGCORE_IFNAME='nosuchif0'") as info:
        listen_address(settings, "127.0.0.1", 1)
    assert "lo" in str(info.value).split("interfaces:")[1]


# --------------------------------------------------------------------------- whole jobs


SCRIPT = (
    "import json, sys; from tests.tasks import init_and_report; "
    "print('REPORT ' + json.dumps(init_and_report(*map(int, sys.argv[1:]))))"
)


def start_rank(
    rank: int, size: int, port: int, env: dict[str, str], again: int | None = None
) -> subprocess.Popen:
    """A rank in a fresh interpreter with only ``env``'s RINGCORE_* variables; stdout and stderr piped.

    With ``again``, the process runs a second job (init to shutdown) with its store on that port.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RINGCORE_")}
    clean.update({"RINGCORE_TIMEOUT": "30", "RINGCORE_INIT_TIMEOUT": "20", **env})
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(rank), str(size), str(port), *([str(again)] if again else [])],
        cwd=ROOT,
        env=clean,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 45.0) -> tuple[dict[str, Any], str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"rank process {proc.pid} did not finish within {timeout} s")
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    assert lines, f"no report; exit {proc.returncode}; stderr:\n{err}"
    return json.loads(lines[-1][len("REPORT ") :]), err


def test_rank_with_wrong_secret_fails_at_init() -> None:
    port = free_port()
    rank0 = start_rank(0, 2, port, {"RINGCORE_SECRET": "s3cret-R1GHT", "RINGCORE_INIT_TIMEOUT": "2"})
    rank1 = start_rank(1, 2, port, {"RINGCORE_SECRET": "s3cret-WR0NG"})
    report1, _ = finish(rank1)
    report0, log0 = finish(rank0)
    assert report1["error"] == "ringcore.errors.AuthenticationError", report1
    assert report1["authentication"]
    message = report1["message"]
    assert "authentication" in message and "failed" in message, message
    assert "RINGCORE_SECRET" in message
    assert "s3cret" not in message
    # rank 0 dropped and logged the stranger, then gave up waiting for a real rank 1
    assert "store: rejected a connection from 127.0.0.1" in log0, log0
    assert "s3cret" not in log0
    assert report0["error"] == "ringcore.errors.CollectiveTimeout", report0


def test_authentication_error_is_public() -> None:
    """``except ringcore.AuthenticationError`` is how users catch a wrong secret.

    A regression test: ``ringcore/__init__.py`` once did not re-export it (only
    ``ringcore.errors.AuthenticationError`` existed).
    """
    assert getattr(ringcore, "AuthenticationError", None) is AuthenticationError
    assert "AuthenticationError" in ringcore.__all__


def test_no_secret_warns_once_and_the_job_works() -> None:
    port, port2 = free_port(), free_port()
    assert port != port2
    ranks = [start_rank(r, 2, port, {}) for r in range(2)]
    reports = [finish(proc) for proc in ranks]
    for rank, (report, log) in enumerate(reports):
        assert report["error"] is None, report
        assert report["sums"] == [[3.0] * 16]
        warnings = [line for line in log.splitlines() if "RINGCORE_SECRET" in line]
        assert len(warnings) == 1, f"rank {rank} stderr:\n{log}"
        assert "WARNING" in warnings[0]
    # twice in one process: still one warning
    ranks = [start_rank(r, 2, port, {}, again=port2) for r in range(2)]
    for report, log in (finish(proc) for proc in ranks):
        assert report["error"] is None, report
        assert len(report["sums"]) == 2
        assert sum("RINGCORE_SECRET" in line for line in log.splitlines()) == 1, log


def test_secret_on_one_side_only_fails() -> None:
    """A rank with a secret against a job without one fails fast (the empty key is still a key)."""
    port = free_port()
    rank0 = start_rank(0, 2, port, {"RINGCORE_INIT_TIMEOUT": "2"})
    rank1 = start_rank(1, 2, port, {"RINGCORE_SECRET": "set"})
    report1, _ = finish(rank1)
    finish(rank0)
    assert report1["error"] == "ringcore.errors.AuthenticationError", report1


def test_intruder_with_wrong_secret_leaves_a_running_job_alone() -> None:
    with Cluster(2, env={"RINGCORE_SECRET": "cluster-secret", "RINGCORE_HANDSHAKE_TIMEOUT": "2"}) as cluster:
        _, port = cluster.results(tasks.store_address)[0]
        intruder = start_rank(1, 2, port, {"RINGCORE_SECRET": "guess"})
        report, _ = finish(intruder)
        assert report["error"] == "ringcore.errors.AuthenticationError", report
        inputs = [np.arange(100, dtype=np.float64) * (r + 1) for r in range(2)]
        for out in cluster.results(tasks.allreduce, inputs, "sum"):
            np.testing.assert_array_equal(out, inputs[0] + inputs[1])
