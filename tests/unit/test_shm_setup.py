"""Set-up of the shared-memory transport: who counts as local, what falls back to TCP, what is left behind."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import numpy as np
import pytest

from ringcore import bootstrap
from ringcore.config import Settings
from ringcore.transport import shm, shm_ring, shm_setup
from ringcore.transport.shm_ring import Ring, Segment
from tests.conformance.test_transport import SIG, drive, in_parallel, tcp_mesh, view

pytestmark = pytest.mark.timeout(60)


def ours() -> set[str]:
    return {name for name in os.listdir(shm_ring.SHM_DIR) if name.startswith(shm_ring.PREFIX)}


def connect_all(size: int, shm_bytes: int = 256 << 10) -> list[shm.ShmTransport]:
    controls = tcp_mesh(size, 1)
    return in_parallel(*[lambda r=r: shm_setup.connect(controls[r], shm_bytes, 20.0) for r in range(size)])  # type: ignore[return-value]


def close_all(transports: list[shm.ShmTransport]) -> None:
    for transport in transports:
        transport.close()


def test_a_peer_is_local_only_if_it_can_read_the_probe() -> None:
    """Same hostname and boot id is not enough: another container's /dev/shm has no such file."""
    me = {"host": shm_setup._host_identity(), "probe": "", "token": ""}
    name, token = shm_setup._make_probe()
    assert name is not None
    try:
        assert os.stat(os.path.join(shm_ring.SHM_DIR, name)).st_mode & 0o777 == 0o600
        assert shm_setup._is_local(me, {"host": me["host"], "probe": name, "token": token})
        assert not shm_setup._is_local(me, {"host": me["host"], "probe": name, "token": "0" * 32})
        assert not shm_setup._is_local(me, {"host": "elsewhere/boot", "probe": name, "token": token})
        missing = shm_ring.new_name("probe")  # what a twin container with its own /dev/shm publishes
        assert not shm_setup._is_local(me, {"host": me["host"], "probe": missing, "token": token})
        assert not shm_setup._is_local(me, {"host": me["host"], "probe": "../etc/passwd", "token": token})
    finally:
        shm_ring.unlink(name)


def test_nothing_is_left_in_dev_shm_after_set_up() -> None:
    before = ours()
    transports = connect_all(3)
    try:
        assert ours() <= before
        assert all(len(t.local) == 2 for t in transports)
    finally:
        close_all(transports)


def test_a_dev_shm_too_small_falls_back_to_tcp_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(nbytes: int) -> Segment:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Segment, "create", staticmethod(full))
    monkeypatch.setattr(shm_setup, "_warned_fallback", False)
    before = ours()
    with caplog.at_level(logging.WARNING, logger="ringcore"):
        transports = connect_all(3)
    try:
        assert [t.local for t in transports] == [[], [], []]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "RINGCORE_SHM_BYTES" in warnings[0], warnings
        got = np.zeros(3, np.int32)
        in_parallel(
            lambda: drive(
                transports[0], [transports[0].isend(1, 0, 5, SIG, view(np.arange(3, dtype=np.int32)))]
            ),
            lambda: drive(transports[1], [transports[1].irecv(0, 0, 5, SIG, view(got))]),
        )
        np.testing.assert_array_equal(got, [0, 1, 2])  # over TCP
        assert ours() <= before
    finally:
        close_all(transports)


def test_ring_reuses_a_slot_only_once_released() -> None:
    slots, slot_bytes = 2, 64
    data = np.zeros(shm_ring.CONTROL_BYTES + slots * (shm_ring.SLOT_HEADER_BYTES + slot_bytes), np.uint8)
    writer, reader = Ring(data, slots, slot_bytes), Ring(data, slots, slot_bytes)
    for k in range(slots):
        assert writer.room()
        writer.write(7, SIG, 2 * slot_bytes, 0, memoryview(bytes([k]) * slot_bytes))
    assert not writer.room()
    out = bytearray(slot_bytes)
    assert reader.peek() == (7, SIG, 2 * slot_bytes, 0, slot_bytes, 0)
    reader.take(memoryview(out), slot_bytes)
    assert out == bytes([0]) * slot_bytes and writer.room()
    assert shm_ring.layout(4 << 20, 1) == (4 << 20, 7, 512 << 10)  # RINGCORE_SHM_BYTES' default
    assert shm_ring.layout(64 << 10, 1) == (64 << 10, 3, 16 << 10)  # its minimum


def _waiting(transport: shm.ShmTransport, requests: list) -> tuple[threading.Thread, list[float]]:
    """Drive ``requests`` in a thread, past the spin at once, so it blocks; when they completed."""
    transport.spin = 0.0
    done_at: list[float] = []

    def wait() -> None:
        while not all(r.done for r in requests):
            transport.progress(2.0)
        done_at.append(time.perf_counter())

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.1)  # blocked in poll by now
    return thread, done_at


def test_a_blocked_receiver_is_woken_by_its_doorbell(monkeypatch: pytest.MonkeyPatch) -> None:
    """It says in the ring that it sleeps; the sender rings once; no wait for the block's bound."""
    rung: list[int] = []
    real = shm_ring.ring_bell
    monkeypatch.setattr(shm_ring, "ring_bell", lambda fd: (rung.append(fd), real(fd)))
    monkeypatch.setattr(shm, "BLOCK_MAX", 1.0)  # a wake-up by the bound alone would take 1 s
    receiver, sender = transports = connect_all(2)
    try:
        got = np.zeros(4, np.int32)
        thread, done_at = _waiting(receiver, [receiver.irecv(1, 0, 5, SIG, view(got))])
        assert int(sender.links[(0, 0)].outbound.reader_asleep[0]) != 0
        sent_at = time.perf_counter()
        drive(sender, [sender.isend(0, 0, 5, SIG, view(np.arange(4, dtype=np.int32)))])
        thread.join(5)
        assert done_at and done_at[0] - sent_at < 0.5, "the receiver was not woken by the doorbell"
        np.testing.assert_array_equal(got, [0, 1, 2, 3])
        assert rung == [sender.bells[0]]
        assert int(sender.links[(0, 0)].outbound.reader_asleep[0]) == 0  # awake again: no more rings
    finally:
        close_all(transports)


def test_a_sender_blocked_on_a_full_ring_is_woken_when_a_slot_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    rung: list[int] = []
    real = shm_ring.ring_bell
    monkeypatch.setattr(shm_ring, "ring_bell", lambda fd: (rung.append(fd), real(fd)))
    monkeypatch.setattr(shm, "BLOCK_MAX", 1.0)
    receiver, sender = transports = connect_all(2, shm_bytes=64 << 10)  # 3 slots of 16 KiB
    try:
        data = np.arange(16 << 10, dtype=np.int32)  # 64 KiB: 4 pieces, one more than the ring holds
        thread, done_at = _waiting(sender, [sender.isend(0, 0, 5, SIG, view(data))])
        assert int(receiver.links[(1, 0)].inbound.writer_asleep[0]) != 0
        got = np.zeros_like(data)
        freed_at = time.perf_counter()
        drive(receiver, [receiver.irecv(1, 0, 5, SIG, view(got))])
        thread.join(5)
        assert done_at and done_at[0] - freed_at < 0.5, "the sender was not woken by the doorbell"
        np.testing.assert_array_equal(got, data)
        assert receiver.bells[1] in rung
    finally:
        close_all(transports)


def test_auto_without_local_peers_keeps_the_plain_tcp_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        shm_setup, "_is_local", lambda me, peer: False
    )  # as if each rank had a host of its own
    controls = tcp_mesh(2, 1)
    auto = Settings(transport="auto", shm_bytes=64 << 10, init_timeout=20.0)
    try:
        got = in_parallel(*[lambda c=c: bootstrap._open_shm(c, auto) for c in controls])
        assert got[0] is controls[0] and got[1] is controls[1]
    finally:
        close_all(controls)


def test_a_host_without_shared_memory_warns_once_and_uses_tcp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Ranks on one host that cannot share memory (here: not x86-64) say why, once."""
    monkeypatch.setattr(
        shm_ring, "supported", lambda: "aarch64 is not x86-64 (the rings rely on its store order)"
    )
    monkeypatch.setattr(shm_setup, "_warned_fallback", False)
    with caplog.at_level(logging.WARNING, logger="ringcore"):
        transports = connect_all(3)
    try:
        assert [t.local for t in transports] == [[], [], []]
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "not x86-64" in warnings[0], warnings
    finally:
        close_all(transports)
