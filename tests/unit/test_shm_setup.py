"""Set-up of the shared-memory transport: who counts as local, what falls back to TCP, what is left behind."""

from __future__ import annotations

import errno
import logging
import os

import numpy as np
import pytest

from ringcore.transport import shm, shm_ring
from ringcore.transport.shm_ring import Ring, Segment
from tests.conformance.test_transport import SIG, drive, in_parallel, tcp_mesh, view

pytestmark = pytest.mark.timeout(60)


def ours() -> set[str]:
    return {name for name in os.listdir(shm_ring.SHM_DIR) if name.startswith(shm_ring.PREFIX)}


def connect_all(size: int, shm_bytes: int = 256 << 10) -> list[shm.ShmTransport]:
    controls = tcp_mesh(size, 1)
    return in_parallel(*[lambda r=r: shm.connect(controls[r], shm_bytes, 20.0) for r in range(size)])  # type: ignore[return-value]


def close_all(transports: list[shm.ShmTransport]) -> None:
    for transport in transports:
        transport.close()


def test_a_peer_is_local_only_if_it_can_read_the_probe() -> None:
    """Same hostname and boot id is not enough: another container's /dev/shm has no such file."""
    me = {"host": shm._host_identity(), "probe": "", "token": ""}
    name, token = shm._make_probe()
    assert name is not None
    try:
        assert os.stat(os.path.join(shm_ring.SHM_DIR, name)).st_mode & 0o777 == 0o600
        assert shm._is_local(me, {"host": me["host"], "probe": name, "token": token})
        assert not shm._is_local(me, {"host": me["host"], "probe": name, "token": "0" * 32})
        assert not shm._is_local(me, {"host": "elsewhere/boot", "probe": name, "token": token})
        missing = shm_ring.new_name("probe")  # what a twin container with its own /dev/shm publishes
        assert not shm._is_local(me, {"host": me["host"], "probe": missing, "token": token})
        assert not shm._is_local(me, {"host": me["host"], "probe": "../etc/passwd", "token": token})
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
    monkeypatch.setattr(shm, "_warned_fallback", False)
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
    assert reader.peek() == (7, SIG, 2 * slot_bytes, 0, slot_bytes)
    reader.take(memoryview(out), slot_bytes)
    assert out == bytes([0]) * slot_bytes and writer.room()
    assert shm_ring.layout(4 << 20, 1) == (4 << 20, 15, 256 << 10)  # RINGCORE_SHM_BYTES' default
    assert shm_ring.layout(64 << 10, 1) == (64 << 10, 3, 16 << 10)  # its minimum
