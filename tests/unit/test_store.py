"""The rendezvous key-value store: set/get/add, waiting gets, timeouts, and garbage on the wire."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import msgpack
import pytest

from ringcore import auth
from ringcore.errors import CollectiveTimeout, RingcoreError
from ringcore.rendezvous import StoreClient, StoreServer

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[StoreServer]:
    srv = StoreServer("127.0.0.1", 0)
    yield srv
    srv.close()


@pytest.fixture
def client(server: StoreServer) -> Iterator[StoreClient]:
    cli = StoreClient("127.0.0.1", server.port, timeout=5.0)
    yield cli
    cli.close()


def test_set_get_values(client: StoreClient) -> None:
    client.set("addr/0", ["10.0.0.1", 4711])
    client.set("blob", b"\x00\xff")
    client.set("map", {"shape": [1, 2], "op": None})
    assert client.get("addr/0", 1.0) == ["10.0.0.1", 4711]
    assert client.get("blob", 1.0) == b"\x00\xff"
    assert client.get("map", 1.0) == {"shape": [1, 2], "op": None}
    client.set("addr/0", "replaced")
    assert client.get("addr/0", 1.0) == "replaced"


def test_get_waits_for_a_later_set(server: StoreServer, client: StoreClient) -> None:
    other = StoreClient("127.0.0.1", server.port, timeout=5.0)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(client.get("late", 10.0)), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive(), "get returned before the key was set"
    other.set("late", 42)
    waiter.join(10)
    assert not waiter.is_alive()
    assert got == [42]
    other.close()


def test_get_timeout(client: StoreClient) -> None:
    with pytest.raises(CollectiveTimeout, match="never"):
        client.get("never", 0.2)
    client.set("after", 1)  # the connection still works
    assert client.get("after", 1.0) == 1


def test_add_is_an_atomic_counter(server: StoreServer) -> None:
    clients = [StoreClient("127.0.0.1", server.port, timeout=5.0) for _ in range(4)]
    results: list[int] = []
    lock = threading.Lock()

    def bump(c: StoreClient) -> None:
        for _ in range(25):
            value = c.add("counter", 1)
            with lock:
                results.append(value)

    threads = [threading.Thread(target=bump, args=(c,), daemon=True) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(results) == list(range(1, 101))
    assert clients[0].add("counter", -100) == 0
    assert clients[0].add("fresh", 5) == 5
    for c in clients:
        c.close()


def test_unknown_request_is_an_error(client: StoreClient) -> None:
    with pytest.raises(RingcoreError, match="refused"):
        client._call(["delete", "k"], 5.0)


def raw(server: StoreServer, authenticate: bool = True) -> socket.socket:
    """A bare socket to the store, past the HMAC handshake unless told otherwise."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    if authenticate:
        auth.client_handshake(sock, b"", auth.STORE_CONTEXT, 5.0)
    return sock


def frame(obj: object) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack("<I", len(payload)) + payload


def reply_or_eof(sock: socket.socket) -> object:
    """The server's reply to a raw request, or None if it closed the connection."""
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    (length,) = struct.unpack("<I", head)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            return None
        body += chunk
    return msgpack.unpackb(body, raw=False)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff",  # a length far over the limit
        struct.pack("<I", 3) + b"\xc1\xc1\xc1",  # not msgpack
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        struct.pack("<I", 2) + b"\x92",  # truncated, then closed
    ],
)
def test_garbage_does_not_kill_the_server(server: StoreServer, garbage: bytes) -> None:
    sock = raw(server, authenticate=False)
    sock.sendall(garbage)
    sock.close()
    client = StoreClient("127.0.0.1", server.port, timeout=5.0)
    client.set("still", "alive")
    assert client.get("still", 1.0) == "alive"
    client.close()


@pytest.mark.parametrize(
    "request_",
    [
        "just a string",
        [],
        [1, 2, 3],
        ["set", "only-key"],
        ["get", "k", "soon"],
        ["add", "k", "many"],
        ["get", "k", None],
        ["add", "k", None],
        ["add", "k", [1]],
    ],
)
def test_malformed_requests_get_an_answer(server: StoreServer, request_: object) -> None:
    """Each malformed request from an authenticated client gets an error reply or a closed
    connection, never silence (a None/list timeout or delta used to kill the client thread)."""
    sock = raw(server)
    sock.settimeout(2.0)
    sock.sendall(frame(request_))
    try:
        reply = reply_or_eof(sock)
    except TimeoutError:
        pytest.fail(f"the store neither answered nor closed the connection after {request_!r}")
    finally:
        sock.close()
    assert reply is None or reply[0] == "error"
    client = StoreClient("127.0.0.1", server.port, timeout=5.0)
    assert client.add("alive", 1) == 1
    client.close()


def test_close_wakes_waiting_gets(server: StoreServer) -> None:
    client = StoreClient("127.0.0.1", server.port, timeout=5.0)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.get("never", 30.0)
        except BaseException as err:
            errors.append(err)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(0.2)
    server.close()
    waiter.join(10)
    assert not waiter.is_alive(), "a get kept waiting after the store closed"
    assert len(errors) == 1 and isinstance(errors[0], RingcoreError)
    client.close()


def test_members_join_leave_and_a_rank_that_left_is_told_to_retry(server: StoreServer) -> None:
    first, second = (StoreClient("127.0.0.1", server.port, timeout=5.0) for _ in range(2))
    assert first.join(1)
    assert second.join(0)
    first.leave(1)
    again = StoreClient("127.0.0.1", server.port, timeout=5.0)
    assert not again.join(1), "a rank that left this job must wait for the next one"
    assert again.join(2)  # a rank the job has not seen may still join
    for client in (first, second, again):
        client.close()


def test_a_second_claim_of_a_rank_still_in_the_job_is_a_config_error(server: StoreServer) -> None:
    from ringcore.errors import ConfigError

    holder = StoreClient("127.0.0.1", server.port, timeout=5.0)
    assert holder.join(3)
    other = StoreClient("127.0.0.1", server.port, timeout=5.0)
    with pytest.raises(ConfigError, match="two processes claim rank 3"):
        other.join(3)
    holder.close()
    other.close()


def test_retire_waits_for_members_and_counts_a_closed_connection_as_leaving() -> None:
    server = StoreServer("127.0.0.1", 0)
    stays, dies = (StoreClient("127.0.0.1", server.port, timeout=5.0) for _ in range(2))
    assert stays.join(0) and dies.join(1)
    retired = threading.Event()
    thread = threading.Thread(target=lambda: (server.retire(grace=20), retired.set()))
    thread.start()
    assert not retired.wait(0.3), "retire() returned while both members were still in the job"
    late = StoreClient("127.0.0.1", server.port, timeout=5.0)
    assert not late.join(2), "a retiring store takes no new member"
    late.close()
    stays.leave(0)
    dies.sock.close()  # a rank that died: its connection closes without a leave
    assert retired.wait(5), "retire() did not return once every member had left"
    thread.join(5)
    assert server.closed
    stays.close()
