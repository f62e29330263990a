"""One conformance suite every transport must pass.

The transports: loopback (zero capacity), TCP on 127.0.0.1, shared memory
(``shm``: rings in /dev/shm between the ranks, wrapping a TCP mesh), the RDMA
transport's protocol over fake verbs (``rdma-fake``, runs everywhere), and the
RDMA transport on a real verbs device (``ibverbs``: skipped unless one is
present, e.g. in the Soft-RoCE guest of ``ci/rdma-vm``).

Each rank's work runs on its own thread and drives its own ``progress``, as the
executor does, so a transport that needs the peer to be inside ``progress`` at
the same moment (or that deadlocks when both sides send large frames at once)
fails here.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from ringcore.errors import PeerFailure
from ringcore.transport import shm_setup, wire
from ringcore.transport.base import FrameMismatch, PeerAborted, Request
from ringcore.transport.loopback import LoopbackNetwork
from ringcore.transport.mesh import connect_mesh, make_listener
from ringcore.transport.rdma import DEPTH, RdmaTransport
from ringcore.transport.tcp import STAGE_BYTES, needed_links
from tests.fake_verbs import FakeFabric
from tests.rdma_support import DictStore, needs_rdma

pytestmark = pytest.mark.timeout(60)

SESSION = 0xC0FFEE
SIG = 0x1234
DEADLINE = 15.0

Mesh = Callable[..., list]


def tcp_mesh(size: int, channels: int, before: Callable[[list[socket.socket]], None] | None = None) -> list:
    listeners = [make_listener("127.0.0.1", 0) for _ in range(size)]
    addresses = [s.getsockname()[:2] for s in listeners]
    if before is not None:
        before(listeners)
    transports: list = [None] * size
    errors: list = []

    def connect(rank: int) -> None:
        try:
            transports[rank] = connect_mesh(
                rank, size, channels, listeners[rank], addresses, SESSION, 0, 20.0
            )
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=connect, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for listener in listeners:
        listener.close()
    assert not errors, errors
    assert all(t is not None for t in transports)
    return transports


def rdma_fake_mesh(size: int, channels: int, fabric: FakeFabric | None = None, depth: int = DEPTH) -> list:
    """The RDMA transport's protocol over the in-process fake verbs (not an RDMA test)."""
    controls = tcp_mesh(size, 1)
    fabric = FakeFabric() if fabric is None else fabric
    transports = []
    for rank in range(size):
        links = needed_links(rank, size, channels)
        device = fabric.device(rank, links)
        transports.append(RdmaTransport(rank, size, channels, device, links, controls[rank], depth))
    for transport in transports:
        transport.post_receives()
    return transports


def shm_mesh(
    size: int, channels: int, shm_bytes: int = 64 << 10, single_copy_bytes: int = 0, cache_bytes: int = 0
) -> list:
    """Shared memory between ranks of this process (threads), over a TCP mesh of the same ranks.

    64 KiB per pair (the least RINGCORE_SHM_BYTES allows): 3 slots of 16 KiB, so large frames
    go in many pieces around the ring and the writer often waits for a slot.
    ``single_copy_bytes``: frames from this size go as pointers (``RINGCORE_SHM_SINGLE_COPY_BYTES``),
    in collectives whose buffers outgrow ``cache_bytes`` (``RINGCORE_SHM_CACHE_BYTES``).
    """
    controls = tcp_mesh(size, channels)
    made = in_parallel(
        *[
            lambda rank=rank: shm_setup.connect(
                controls[rank], shm_bytes, 20.0, single_copy_bytes, cache_bytes
            )
            for rank in range(size)
        ]
    )
    assert all(len(t.local) == size - 1 for t in made), "every rank of this process is on this host"
    if single_copy_bytes:
        assert all(len(t.point_from) == size - 1 for t in made), "a process may read its own memory"
    return made


def ibverbs_mesh(size: int, channels: int) -> list:
    """The RDMA transport on a real verbs device, every rank in this process (RDMA test)."""
    from ringcore.config import Settings
    from ringcore.transport import ibverbs

    controls = tcp_mesh(size, 1)
    opened = [ibverbs.open_device(Settings(), rank, size, channels) for rank in range(size)]
    assert all(device is not None for device, _ in opened), [record for _, record in opened]
    records = [record for _, record in opened]
    store = DictStore()
    transports: list = [None] * size

    def connect(rank: int) -> None:
        device = opened[rank][0]
        transports[rank] = ibverbs.connect(rank, size, channels, device, records, controls[rank], store, 20.0)

    in_parallel(*[lambda rank=rank: connect(rank) for rank in range(size)])
    return transports


@pytest.fixture(
    params=[
        "loopback",
        "tcp",
        "shm",
        "shm-single-copy",
        "rdma-fake",
        pytest.param("ibverbs", marks=[pytest.mark.rdma, needs_rdma]),
    ]
)
def mesh(request: pytest.FixtureRequest) -> Iterator[Mesh]:
    made: list = []

    def make(size: int = 3, channels: int = 2) -> list:
        if request.param == "loopback":
            network = LoopbackNetwork(size, channels)
            transports = [network.transport(r) for r in range(size)]
        elif request.param == "tcp":
            transports = tcp_mesh(size, channels)
        elif request.param == "shm":
            transports = shm_mesh(size, channels)
        elif request.param == "shm-single-copy":
            transports = shm_mesh(size, channels, single_copy_bytes=24)  # frames of 24 bytes and up
        elif request.param == "rdma-fake":
            transports = rdma_fake_mesh(size, channels)
        else:
            transports = ibverbs_mesh(size, channels)
        made.extend(transports)
        return transports

    yield make
    for transport in made:
        transport.close()


@pytest.fixture
def tcp() -> Iterator[Callable[..., list]]:
    made: list = []

    def make(size: int = 3, channels: int = 1, before=None) -> list:
        transports = tcp_mesh(size, channels, before)
        made.extend(transports)
        return transports

    yield make
    for transport in made:
        transport.close()


def drive(transport, requests: list[Request], deadline: float = DEADLINE) -> None:
    end = time.monotonic() + deadline
    while not all(r.done for r in requests):
        if time.monotonic() > end:
            pytest.fail(f"requests not done after {deadline} s")
        transport.progress(0.05)


def drive_for(transport, seconds: float) -> None:
    """Call progress for a while; any error it raises propagates."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        transport.progress(0.02)


def in_parallel(*bodies: Callable[[], object]) -> list[object]:
    results: list[object] = [None] * len(bodies)
    errors: list[BaseException | None] = [None] * len(bodies)

    def run(i: int) -> None:
        try:
            results[i] = bodies[i]()
        except BaseException as err:
            errors[i] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE * 2)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    for err in errors:
        if err is not None:
            raise err
    return results


def view(array: np.ndarray) -> memoryview:
    return memoryview(array).cast("B")


# --------------------------------------------------------------------------- data


def test_fifo_matching_per_peer_and_channel(mesh: Mesh) -> None:
    t = mesh(3, 2)
    frames = {ch: [np.arange(10, dtype=np.int32) * (ch + 1) + i for i in range(5)] for ch in range(2)}
    outs = {ch: [np.zeros(10, np.int32) for _ in range(5)] for ch in range(2)}

    def sender() -> None:
        reqs = [
            t[0].isend(1, ch, wire.make_tag(1, i, ch), SIG, view(f))
            for ch in range(2)
            for i, f in enumerate(frames[ch])
        ]
        drive(t[0], reqs)

    def receiver() -> None:
        reqs = [
            t[1].irecv(0, ch, wire.make_tag(1, i, ch), SIG, view(o))
            for ch in range(2)
            for i, o in enumerate(outs[ch])
        ]
        drive(t[1], reqs)

    in_parallel(sender, receiver)
    for ch in range(2):
        for want, got in zip(frames[ch], outs[ch], strict=True):
            np.testing.assert_array_equal(got, want)


def test_every_pair_both_directions(mesh: Mesh) -> None:
    size = 4
    t = mesh(size, 1)

    def rank_body(rank: int) -> Callable[[], dict[int, np.ndarray]]:
        def body() -> dict[int, np.ndarray]:
            outs = {p: np.zeros(5, np.float64) for p in range(size) if p != rank}
            reqs = [t[rank].irecv(p, 0, 7, SIG, view(o)) for p, o in outs.items()]
            mine = np.full(5, float(rank))
            reqs += [t[rank].isend(p, 0, 7, SIG, view(mine)) for p in outs]
            drive(t[rank], reqs)
            return outs

        return body

    results = in_parallel(*(rank_body(r) for r in range(size)))
    for outs in results:
        for peer, got in outs.items():  # type: ignore[union-attr]
            np.testing.assert_array_equal(got, np.full(5, float(peer)))


def test_zero_byte_frames(mesh: Mesh) -> None:
    t = mesh(2, 1)
    empty = np.empty(0, np.uint8)
    after = np.array([1, 2, 3], np.uint8)
    got = np.zeros(3, np.uint8)

    def sender() -> None:
        reqs = [t[0].isend(1, 0, 1, SIG, view(empty)), t[0].isend(1, 0, 2, SIG, view(empty)),
                t[0].isend(1, 0, 3, SIG, view(after))]  # fmt: skip
        drive(t[0], reqs)

    def receiver() -> None:
        reqs = [t[1].irecv(0, 0, 1, SIG, view(empty)), t[1].irecv(0, 0, 2, SIG, view(empty)),
                t[1].irecv(0, 0, 3, SIG, view(got))]  # fmt: skip
        drive(t[1], reqs)

    in_parallel(sender, receiver)
    np.testing.assert_array_equal(got, after)


def test_large_frames_both_directions_at_once(mesh: Mesh) -> None:
    """8 MiB each way, both ranks sending before receiving: far beyond any socket buffer."""
    t = mesh(2, 1)
    n = 8 << 20
    data = [np.frombuffer(np.random.default_rng(r).bytes(n), np.uint8) for r in range(2)]
    outs = [np.zeros(n, np.uint8) for _ in range(2)]

    def body(rank: int) -> Callable[[], None]:
        def run() -> None:
            send = t[rank].isend(1 - rank, 0, 9, SIG, memoryview(data[rank]))
            recv = t[rank].irecv(1 - rank, 0, 9, SIG, memoryview(outs[rank]))
            drive(t[rank], [send, recv], deadline=40)

        return run

    in_parallel(body(0), body(1))
    assert outs[0].tobytes() == data[1].tobytes()
    assert outs[1].tobytes() == data[0].tobytes()


def test_many_channels(mesh: Mesh) -> None:
    channels = 6
    t = mesh(3, channels)
    outs = [np.zeros(4, np.int64) for _ in range(channels)]

    def sender() -> None:
        reqs = [
            t[2].isend(0, ch, ch, SIG, view(np.full(4, ch, np.int64))) for ch in reversed(range(channels))
        ]
        drive(t[2], reqs)

    def receiver() -> None:
        drive(t[0], [t[0].irecv(2, ch, ch, SIG, view(outs[ch])) for ch in range(channels)])

    in_parallel(sender, receiver)
    for ch, got in enumerate(outs):
        np.testing.assert_array_equal(got, np.full(4, ch))


def test_route_is_symmetric(mesh: Mesh) -> None:
    size, channels = 5, 3
    t = mesh(size, channels)
    for a in range(size):
        for b in range(size):
            if a == b:
                continue
            for segment in range(10):
                channel = t[a].route(b, segment)
                assert 0 <= channel < channels
                assert channel == t[b].route(a, segment)


# --------------------------------------------------------------------------- failures


@pytest.mark.parametrize(
    ("field", "send", "recv"),
    [
        ("signature", (5, 111, 8), (5, 222, 8)),
        ("tag", (5, SIG, 8), (6, SIG, 8)),
        ("nbytes", (5, SIG, 8), (5, SIG, 16)),
    ],
)
def test_mismatch_fails_the_receiver(mesh: Mesh, field: str, send: tuple, recv: tuple) -> None:
    t = mesh(2, 1)
    sent = np.ones(send[2], np.uint8)
    out = np.zeros(recv[2], np.uint8)
    request = t[0].isend(1, 0, send[0], send[1], view(sent))

    def sender() -> None:  # zero capacity: the send may never complete; just keep pushing
        end = time.monotonic() + 1.0
        while not request.done and time.monotonic() < end:
            t[0].progress(0.02)

    def receiver() -> FrameMismatch:
        t[1].irecv(0, 0, recv[0], recv[1], view(out))
        with pytest.raises(FrameMismatch) as info:
            drive_for(t[1], DEADLINE)
        return info.value

    _, err = in_parallel(sender, receiver)
    assert err.field == field and err.peer == 0  # type: ignore[union-attr]
    assert "rank 0" in str(err)
    assert not np.any(out), "a mismatched frame must not be written into the receive buffer"


def test_peer_close_with_a_posted_receive(mesh: Mesh) -> None:
    t = mesh(3, 1)
    out = np.zeros(4, np.uint8)
    t[0].irecv(1, 0, 1, SIG, view(out))
    t[1].close()
    with pytest.raises(PeerFailure) as info:
        drive_for(t[0], DEADLINE)
    assert info.value.peer == 1
    assert "rank 1" in str(info.value)


def test_peer_close_with_nothing_posted_is_quiet_until_a_receive(mesh: Mesh) -> None:
    """A clean close (BYE) is not an error by itself; a later receive from that peer is."""
    t = mesh(3, 1)
    t[1].close()
    drive_for(t[0], 0.3)  # must not raise
    # the other peers still work
    got = np.zeros(2, np.int16)
    in_parallel(
        lambda: drive(t[2], [t[2].isend(0, 0, 4, SIG, view(np.array([7, 8], np.int16)))]),
        lambda: drive(t[0], [t[0].irecv(2, 0, 4, SIG, view(got))]),
    )
    np.testing.assert_array_equal(got, [7, 8])
    t[0].irecv(1, 0, 1, SIG, view(np.zeros(4, np.uint8)))
    with pytest.raises(PeerFailure) as info:
        drive_for(t[0], DEADLINE)
    assert info.value.peer == 1


def test_abort_reaches_peers_with_the_reason(mesh: Mesh) -> None:
    t = mesh(3, 2)
    reason = {"kind": "timeout", "culprit": 1, "message": "rank 1 gave up: no progress"}
    for rank in (0, 2):
        t[rank].irecv(1, 0, 1, SIG, view(np.zeros(4, np.uint8)))
    t[1].abort(reason)
    for rank in (0, 2):
        with pytest.raises(PeerAborted) as info:
            drive_for(t[rank], DEADLINE)
        assert info.value.peer == 1
        assert info.value.reason == reason
        assert "gave up" in str(info.value)


@pytest.mark.parametrize("kind", ["shm", "rdma-fake"])
def test_a_frame_sent_before_the_peers_bye_counts_even_if_the_bye_is_read_first(kind: str) -> None:
    """Data beside the TCP mesh (rings, RDMA writes) and BYE on it: a peer that sent its last frame
    and shut down is no failure, though this rank may read its BYE before that frame."""
    t = shm_mesh(2, 1) if kind == "shm" else rdma_fake_mesh(2, 1)
    try:
        data, out = np.arange(100, dtype=np.uint8), np.zeros(100, np.uint8)
        recv = t[0].irecv(1, 0, 3, SIG, view(out))
        t[0].progress(0)  # RDMA: the receive announced
        drive(t[1], [t[1].isend(0, 0, 3, SIG, view(data))])
        t[1].close()  # BYE on TCP, after the frame is in the ring or written
        conn = t[0].control.conns[(1, 0)]
        end = time.monotonic() + DEADLINE
        while not conn.departed:
            assert time.monotonic() < end, "the peer's BYE never came"
            conn.check_idle((0, 0))
            time.sleep(0.01)
        assert not recv.done
        t[0]._check_departed()  # what a waiting rank does once it sees the BYE, before its data
        assert recv.done
        np.testing.assert_array_equal(out, data)
        t[0].irecv(1, 0, 4, SIG, view(out))  # a frame the peer never sent
        with pytest.raises(PeerFailure, match=r"rank 1 .* shut down"):
            t[0]._check_departed()
    finally:
        for transport in t:
            transport.close()


def test_close_is_idempotent(mesh: Mesh) -> None:
    t = mesh(2, 1)
    t[0].close()
    t[0].close()
    assert isinstance(t[0].peer_name(1), str)


# --------------------------------------------------------------------------- TCP only


def test_tcp_accept_drops_bad_hellos(tcp: Callable[..., list]) -> None:
    intruders: list[socket.socket] = []

    def before(listeners: list[socket.socket]) -> None:
        address = listeners[0].getsockname()[:2]
        for payload in (
            b"\x00" * wire.HEADER_BYTES,  # bad magic
            wire.pack(wire.HELLO, 1, 0, SESSION + 1),  # another job
            wire.pack(wire.DATA, 1, 0, SESSION),  # not a HELLO
            wire.pack(wire.HELLO, 9, 0, SESSION),  # no such rank
            b"RC",  # truncated, then closed
        ):
            sock = socket.create_connection(address, timeout=5)
            sock.sendall(payload)
            if payload == b"RC":
                sock.close()
            else:
                intruders.append(sock)

    t = tcp(3, 1, before)
    got = np.zeros(3, np.int32)
    in_parallel(
        lambda: drive(t[2], [t[2].isend(0, 0, 1, SIG, view(np.array([1, 2, 3], np.int32)))]),
        lambda: drive(t[0], [t[0].irecv(2, 0, 1, SIG, view(got))]),
    )
    np.testing.assert_array_equal(got, [1, 2, 3])
    for sock in intruders:
        sock.close()


def test_tcp_peer_names_are_addresses(tcp: Callable[..., list]) -> None:
    t = tcp(2, 1)
    assert t[0].peer_name(1).startswith("127.0.0.1:")
    assert t[1].peer_name(0).startswith("127.0.0.1:")


@pytest.mark.parametrize("spin", [0.0, 0.02])
def test_tcp_spin_polls_and_yields_before_sleeping(
    tcp: Callable[..., list], monkeypatch: pytest.MonkeyPatch, spin: float
) -> None:
    """With nothing to receive, progress spins for ``spin`` calling sched_yield, then polls."""
    import os

    t = tcp(2, 1)
    t[0].spin = spin
    calls = []
    monkeypatch.setattr(os, "sched_yield", lambda: calls.append(1))
    got = np.zeros(4, np.uint8)
    request = t[0].irecv(1, 0, 5, SIG, view(got))
    started = time.monotonic()
    assert not t[0].progress(0.05)
    assert time.monotonic() - started >= 0.05  # the spin, then poll's wait
    assert (len(calls) > 0) == (spin > 0)
    drive(t[1], [t[1].isend(0, 0, 5, SIG, view(np.arange(4, dtype=np.uint8)))])
    drive(t[0], [request])
    np.testing.assert_array_equal(got, np.arange(4))


def test_tcp_channels_beyond_zero_go_to_ring_neighbours(tcp: Callable[..., list]) -> None:
    """Rank 0 and rank 2 of 5 are not neighbours: their segments all route over channel 0."""
    t = tcp(5, 3)
    assert {t[0].route(2, k) for k in range(6)} == {0}
    assert {t[0].route(1, k) for k in range(6)} == {0, 1, 2}


def exchange_until_done(transport, sent: Request | None, received: Request | None) -> None:
    """What the lockstep executor does: the latency path, then progress when it gives up."""
    end = time.monotonic() + DEADLINE
    while not transport.exchange(sent, received):
        assert time.monotonic() < end, "exchange never finished"
        transport.progress(0.05)


def test_tcp_exchange_leaves_requests_not_first_in_line_to_progress(tcp: Callable[..., list]) -> None:
    t = tcp(2, 1)
    first = t[0].irecv(1, 0, 1, SIG, view(np.zeros(4, np.uint8)))
    second = t[0].irecv(1, 0, 2, SIG, view(np.zeros(4, np.uint8)))
    assert not t[0].exchange(None, second)  # first must be read first
    drive(t[1], [t[1].isend(0, 0, 1, SIG, view(np.ones(4, np.uint8)))])
    drive(t[1], [t[1].isend(0, 0, 2, SIG, view(np.ones(4, np.uint8)))])
    exchange_until_done(t[0], None, first)
    exchange_until_done(t[0], None, second)


@pytest.mark.parametrize("room", [4096, 8])  # the reason fits in the bytes read with the header, or not
def test_tcp_exchange_reads_an_abort_reason_that_came_with_its_header(
    tcp: Callable[..., list], room: int
) -> None:
    t = tcp(2, 1)
    reason = {"kind": "timeout", "culprit": 1, "message": "rank 1 gave up: " + "x" * 300}
    out = np.zeros(room, np.uint8)
    received = t[0].irecv(1, 0, 1, SIG, view(out))
    t[1].abort(reason)
    with pytest.raises(PeerAborted) as info:
        exchange_until_done(t[0], None, received)
    assert info.value.peer == 1 and info.value.reason == reason


def test_tcp_exchange_refuses_a_mismatched_frame(tcp: Callable[..., list]) -> None:
    t = tcp(2, 1)
    received = t[0].irecv(1, 0, 5, SIG, view(np.zeros(16, np.uint8)))
    drive(t[1], [t[1].isend(0, 0, 6, SIG, view(np.ones(16, np.uint8)))])
    with pytest.raises(FrameMismatch) as info:
        exchange_until_done(t[0], None, received)
    assert info.value.field == "tag" and info.value.peer == 1


def wait_readable(*socks: socket.socket, bound: float = DEADLINE) -> None:
    """Return once every one of ``socks`` has bytes waiting (instead of sleeping and hoping)."""
    waiting = list(socks)
    end = time.monotonic() + bound
    while waiting:
        left = end - time.monotonic()
        assert left > 0, f"no bytes arrived within {bound} s"
        readable, _, _ = select.select(waiting, [], [], left)
        waiting = [sock for sock in waiting if sock not in readable]


def swap_until_done(transport, send: tuple | None, recv: tuple | None, tag: int) -> None:
    """One lockstep step on TCP's direct path; whatever it hands back, progress finishes."""
    left = transport.swap(send, recv, tag, SIG)
    assert left is not None, "swap refused idle connections"
    drive(transport, [request for request in left if request is not None])


@pytest.mark.parametrize("path", ["exchange", "swap"])
@pytest.mark.parametrize("nbytes", [0, 8, 4096, 3 << 20])
def test_tcp_latency_paths_move_a_step_both_ways(tcp: Callable[..., list], path: str, nbytes: int) -> None:
    """3 MiB does not fit the socket buffers: the latency path stops spinning, progress finishes."""
    t = tcp(2, 1)
    t[0].spin = t[1].spin = 0.001
    data = [np.random.default_rng(rank).integers(0, 255, nbytes, np.uint8) for rank in range(2)]
    got = [np.zeros(nbytes, np.uint8) for _ in range(2)]

    def side(rank: int) -> None:
        peer = 1 - rank
        if path == "swap":
            swap_until_done(t[rank], (peer, 0, view(data[rank])), (peer, 0, view(got[rank])), 9)
            return
        sent = t[rank].isend(peer, 0, 7, SIG, view(data[rank]))
        received = t[rank].irecv(peer, 0, 7, SIG, view(got[rank]))
        exchange_until_done(t[rank], sent, received)
        assert sent.done and received.done

    in_parallel(lambda: side(0), lambda: side(1))
    np.testing.assert_array_equal(got[0], data[1])
    np.testing.assert_array_equal(got[1], data[0])
    assert not any(conn.sends or conn.recvs for transport in t for conn in transport.conns.values())


@pytest.mark.parametrize("first", [0, 10, wire.HEADER_BYTES, wire.HEADER_BYTES + 100])
@pytest.mark.parametrize("nbytes", [256, STAGE_BYTES, STAGE_BYTES + 1])
def test_tcp_swap_hands_a_half_read_frame_to_progress(
    tcp: Callable[..., list], first: int, nbytes: int
) -> None:
    """A frame cut at ``first`` bytes: swap stops spinning there, progress reads the rest into the view.

    Frames up to ``STAGE_BYTES`` are read into the connection's staging
    buffer, so the bytes already read must move to where progress resumes.
    """
    t = tcp(2, 1)
    t[0].spin = 0
    payload = np.random.default_rng(nbytes + first).integers(0, 255, nbytes, np.uint8)
    frame = wire.pack(wire.DATA, 3, SIG, nbytes) + payload.tobytes()
    raw = t[1].conns[(0, 0)].sock
    raw.sendall(frame[:first])
    if first:
        wait_readable(t[0].conns[(1, 0)].sock)  # the first part is in rank 0's socket before it reads
    got = np.zeros(nbytes, np.uint8)
    left = t[0].swap(None, (1, 0, view(got)), 3, SIG)
    assert left is not None and left[1] is not None and not left[1].done, "the frame cannot be complete yet"
    raw.sendall(frame[first:])
    drive(t[0], [left[1]])
    np.testing.assert_array_equal(got, payload)
    assert not t[0].conns[(1, 0)].recvs


def test_tcp_swap_refuses_busy_connections(tcp: Callable[..., list]) -> None:
    t = tcp(2, 1)
    t[0].irecv(1, 0, 1, SIG, view(np.zeros(4, np.uint8)))
    assert t[0].swap(None, (1, 0, view(np.zeros(4, np.uint8))), 2, SIG) is None
    t[1].isend(0, 0, 1, SIG, view(np.ones(4, np.uint8)))
    assert t[1].swap((0, 0, view(np.ones(4, np.uint8))), None, 2, SIG) is None


@pytest.mark.parametrize("room", [4096, 8])
def test_tcp_swap_reads_an_abort_reason_that_came_with_its_header(
    tcp: Callable[..., list], room: int
) -> None:
    t = tcp(2, 1)
    reason = {"kind": "peer_failure", "culprit": 1, "message": "rank 1 stopped: " + "y" * 300}
    t[1].abort(reason)
    with pytest.raises(PeerAborted) as info:
        swap_until_done(t[0], None, (1, 0, view(np.zeros(room, np.uint8))), 1)
    assert info.value.peer == 1 and info.value.reason == reason


def test_tcp_swap_refuses_a_mismatched_frame(tcp: Callable[..., list]) -> None:
    t = tcp(2, 1)
    drive(t[1], [t[1].isend(0, 0, 6, SIG, view(np.ones(16, np.uint8)))])
    with pytest.raises(FrameMismatch) as info:
        swap_until_done(t[0], None, (1, 0, view(np.zeros(16, np.uint8))), 5)
    assert info.value.field == "tag" and info.value.peer == 1


def test_tcp_a_receive_that_arrived_with_an_abort_completes_first(tcp: Callable[..., list]) -> None:
    """Rank 0's frame from rank 1 and rank 2's ABORT (of the collective after) land while rank 0 sleeps.

    The receive completes; the ABORT fails what rank 0 does next. (A rank
    descheduled at the end of a collective used to fail it, though its data
    had arrived, when the others had already moved on and disagreed.)
    """
    t = tcp(3, 1)
    t[0].spin = 0
    out = np.zeros(16, np.uint8)
    received = t[0].irecv(1, 0, 1, SIG, view(out))
    drive(t[1], [t[1].isend(0, 0, 1, SIG, view(np.full(16, 9, np.uint8)))])
    t[2].abort({"kind": "mismatch", "rank": 2, "message": "collective #2: ranks disagree"})
    wait_readable(t[0].conns[(1, 0)].sock, t[0].conns[(2, 0)].sock)  # both are in rank 0's socket buffers
    pump, calls = t[0]._pump, []

    def asleep_at_first() -> bool:  # the first try found nothing: rank 0 then sleeps in poll
        calls.append(1)
        return pump() if len(calls) > 1 else False

    t[0]._pump = asleep_at_first
    drive(t[0], [received])
    np.testing.assert_array_equal(out, 9)
    t[0].irecv(1, 0, 2, SIG, view(np.zeros(16, np.uint8)))
    with pytest.raises(PeerAborted) as info:
        drive_for(t[0], DEADLINE)
    assert info.value.peer == 2


@pytest.mark.parametrize("kind", ["tcp", "shm", "rdma-fake"])
def test_an_early_frame_of_the_next_collective_is_checked_when_it_starts(kind: str) -> None:
    """Rank 0 starts collective #6 while rank 1 is still in #5, and they disagree on #6.

    Rank 1 never receives from rank 0 in #6 (e.g. they disagree on a broadcast's root), so
    only the frame (TCP) or receive announcement (RDMA) that arrived during #5 can tell it:
    starting #6 must judge it again, or both would wait for the timeout.
    """
    t = {"tcp": tcp_mesh, "shm": shm_mesh, "rdma-fake": rdma_fake_mesh}[kind](2, 1)
    try:
        data = np.ones(8, np.uint8)
        out = np.zeros(8, np.uint8)
        t[1].expect(5, SIG)
        t[0].expect(6, 111)
        if kind != "rdma-fake":
            t[0].isend(1, 0, wire.make_tag(6, 0, 0), 111, view(data))
        else:
            t[0].irecv(1, 0, wire.make_tag(6, 0, 0), 111, view(out))  # announced to rank 1
        t[0].progress(0.1)
        drive_for(t[1], 0.5)  # still in #5: nothing is wrong yet
        with pytest.raises(FrameMismatch) as info:
            t[1].expect(6, 222)
            drive_for(t[1], 1.0)
        assert info.value.field == "signature" and info.value.peer == 0
    finally:
        for transport in t:
            transport.close()
