"""Frames as pointers over shared memory: one ``process_vm_readv`` copy instead of two through a slot."""

from __future__ import annotations

import errno
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringcore.errors import PeerFailure
from ringcore.transport import cma, shm, shm_ring
from ringcore.transport.base import PeerAborted, Request
from ringcore.transport.shm_ring import Ring
from tests.conformance.test_transport import SIG, drive, drive_for, in_parallel, shm_mesh, view

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not cma.available(), reason="no process_vm_readv on this platform"),
]

_HOLDER = """
import sys
from ringcore.transport import cma
probe = cma.Probe()  # kept alive: peers read its token
record = probe.record()
print(record["pid"], record["address"], record["token"].hex(), flush=True)
sys.stdin.read()
"""


def test_a_process_reads_another_ones_token_and_nothing_else() -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None
        pid, address, token = holder.stdout.readline().split()
        record = {"pid": int(pid), "address": int(address), "token": bytes.fromhex(token.decode())}
        assert record["pid"] == holder.pid
        assert cma.readable(record)
        assert cma.writable(record), "the token's own bytes written back"
        assert cma.readable(record), "...unchanged"
        assert not cma.readable({**record, "token": b"\0" * 16}), "another value at that address"
        assert not cma.readable({**record, "pid": os.getpid()}), "another process (another pid namespace)"
        assert not cma.readable({**record, "address": 8}), "an address not mapped there"
        assert not cma.readable({"pid": "1"})
    finally:
        holder.communicate(b"", timeout=20)
    assert not cma.readable(record), "the process is gone"
    assert not cma.writable(record)


def test_a_process_writes_another_ones_word_and_reads_it_back() -> None:
    """A ``Channel``'s ``copy_out``/``copy_in`` at an address of another process: the direct allreduce's words and pushes,
    the same channel (its two ``Transfer``s, as a ``Remote`` peer holds them) again and again."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER_WORD], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None
        word = int(holder.stdout.readline())
        value, back = np.array([-12345], np.int64), np.zeros(1, np.int64)
        channel = cma.Channel(holder.pid)
        channel.copy_out(value.ctypes.data, word, 8)
        channel.copy_in(word, back.ctypes.data, 8)
        assert back[0] == -12345
        with pytest.raises(OSError):
            channel.copy_out(value.ctypes.data, 8, 8)  # not mapped there
        back[0] = 0
        channel.copy_in(word, back.ctypes.data, 8)  # the same channel after a failure
        assert back[0] == -12345
        holder.stdin.write(b"x\n")  # type: ignore[union-attr]
        holder.stdin.flush()  # type: ignore[union-attr]
        assert int(holder.stdout.readline()) == -12345, "the holder sees the word written"
    finally:
        holder.communicate(b"", timeout=20)
    with pytest.raises(OSError) as gone:
        channel.copy_in(word, back.ctypes.data, 8)
    assert gone.value.errno == errno.ESRCH


def test_a_transfer_aims_again_where_the_addresses_or_the_length_change() -> None:
    """A ``Transfer`` keeps its iovecs between calls and re-aims them only on a change: each of these
    copies (within this process) lands where it was asked, with the length asked."""
    source = np.arange(64, dtype=np.uint8)
    target = np.zeros(64, np.uint8)
    reads = cma.Transfer(os.getpid(), out=False)
    here, there = target.ctypes.data, source.ctypes.data
    for offset, length in [(0, 16), (0, 16), (16, 16), (16, 8), (40, 24)]:
        target[...] = 0
        reads.move(here + offset, there + offset, length)
        want = np.zeros(64, np.uint8)
        want[offset : offset + length] = source[offset : offset + length]
        np.testing.assert_array_equal(target, want, err_msg=f"offset {offset}, length {length}")
    reads.move(here, there, 0)  # nothing to copy: no call
    with pytest.raises(OSError):
        reads.move(here, 8, 8)  # not mapped


_HOLDER_WORD = """
import sys
from ringcore.transport import cma
probe = cma.Probe()
print(probe.record()["word"], flush=True)
sys.stdin.readline()
print(probe.word[0], flush=True)
sys.stdin.read()
"""


def link_pair(
    single_copy_bytes: int = 0, slots: int = 8, slot_bytes: int = 64
) -> tuple[shm._Link, shm._Link]:
    """A writer's and a reader's link over one in-process ring (and an unused ring back)."""
    nbytes = shm_ring.CONTROL_BYTES + slots * (shm_ring.SLOT_HEADER_BYTES + slot_bytes)
    forth, back = np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    _, bell_w = os.pipe()
    os.set_blocking(bell_w, False)
    writer = shm._Link(
        1, 0, Ring(forth, slots, slot_bytes), Ring(back, slots, slot_bytes), bell_w, single_copy_bytes
    )
    reader = shm._Link(
        0, 0, Ring(back, slots, slot_bytes), Ring(forth, slots, slot_bytes), bell_w, 0, os.getpid()
    )
    return writer, reader


def test_a_large_frame_goes_as_a_pointer_and_its_send_ends_when_copied() -> None:
    writer, reader = link_pair(single_copy_bytes=100)
    frames = [np.arange(n, dtype=np.uint8) + k for k, n in enumerate([1000, 10, 4096, 99, 100])]
    sends = [Request(1, 0, 7 + k, view(f)) for k, f in enumerate(frames)]
    writer.sends.extend((request, SIG, 0) for request in sends)
    outs = [np.zeros_like(f) for f in frames]
    recvs = [Request(0, 0, 7 + k, view(o)) for k, o in enumerate(outs)]
    reader.recvs.extend((request, SIG, 0) for request in recvs)
    assert writer.push()
    assert not sends[0].done and sends[1].done and not sends[2].done, "pointed frames wait for the copy"
    assert reader.pull()
    assert [r.done for r in recvs] == [True] * 5
    writer.push()
    assert [r.done for r in sends] == [True] * 5 and not writer.awaiting
    for frame, out in zip(frames, outs, strict=True):
        np.testing.assert_array_equal(out, frame)


def _one_pointed_frame(single_copy_bytes: int = 1) -> tuple[shm._Link, shm._Link, Request, np.ndarray]:
    writer, reader = link_pair(single_copy_bytes)
    frame = np.full(256, 3, np.uint8)
    writer.sends.append((Request(1, 0, 9, view(frame)), SIG, 0))
    out = np.zeros(256, np.uint8)
    recv = Request(0, 0, 9, view(out))
    reader.recvs.append((recv, SIG, 0))
    writer.push()
    return writer, reader, recv, out


def test_a_frame_withdrawn_during_the_copy_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer gave up while the reader copied: its bytes may have changed under the copy."""
    writer, reader, recv, _ = _one_pointed_frame()
    real = cma.read

    def read_while_withdrawn(pid: int, into: memoryview, address: int) -> None:
        writer.withdraw()
        real(pid, into, address)

    monkeypatch.setattr(cma, "read", read_while_withdrawn)
    with pytest.raises(shm.Withdrawn, match="withdrawn while this rank copied it"):
        reader.pull()
    assert not recv.done


def test_a_frame_withdrawn_before_the_copy_is_never_seen() -> None:
    writer, reader, recv, out = _one_pointed_frame()
    writer.withdraw()
    assert not reader.pull() and not recv.done and not out.any()


def test_a_pointer_that_cannot_be_copied_is_refused_naming_why() -> None:
    _, reader, recv, _ = _one_pointed_frame()
    reader.peer_pid = 2**22 + 12345  # beyond pid_max's default: no such process
    with pytest.raises(shm.Withdrawn, match="could not be copied from its memory"):
        reader.pull()
    assert not recv.done


def test_a_reader_that_did_not_agree_refuses_pointers() -> None:
    _, reader, recv, _ = _one_pointed_frame()
    reader.peer_pid = None
    with pytest.raises(shm.ProtocolError, match="did not agree to read"):
        reader.pull()
    assert not recv.done


def test_the_reason_of_a_peer_that_withdrew_reaches_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's collective failed while the receiver copied: the receiver raises the sender's ABORT."""
    t = shm_mesh(2, 1, single_copy_bytes=1024)
    try:
        frame = np.ones(1 << 20, np.uint8)
        t[0].isend(1, 0, 5, SIG, view(frame))
        t[0].progress(0)
        reason = {"kind": "timeout", "culprit": 0, "message": "rank 0 gave up: no progress"}
        real = cma.read

        def read_while_the_sender_aborts(pid: int, into: memoryview, address: int) -> None:
            t[0].cancel()
            t[0].abort(reason)
            real(pid, into, address)

        monkeypatch.setattr(cma, "read", read_while_the_sender_aborts)
        t[1].irecv(0, 0, 5, SIG, view(np.zeros(1 << 20, np.uint8)))
        with pytest.raises(PeerAborted) as info:
            drive_for(t[1], 5.0)
        assert info.value.peer == 0 and info.value.reason == reason
    finally:
        for transport in t:
            transport.close()


def test_a_peer_that_withdrew_without_a_reason_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ABORT within the grace (say the sender died right after): a PeerFailure naming it."""
    monkeypatch.setattr(shm, "WITHDRAWN_GRACE", 0.2)
    t = shm_mesh(2, 1, single_copy_bytes=1024)
    sent = np.ones(1 << 20, np.uint8)  # kept alive: the copy must fail on the withdrawal, not a freed page
    try:
        t[0].isend(1, 0, 5, SIG, view(sent))
        t[0].progress(0)
        real = cma.read

        def read_while_withdrawn(pid: int, into: memoryview, address: int) -> None:
            t[0].cancel()
            real(pid, into, address)

        monkeypatch.setattr(cma, "read", read_while_withdrawn)
        t[1].irecv(0, 0, 5, SIG, view(np.zeros(1 << 20, np.uint8)))
        with pytest.raises(
            PeerFailure, match="withdrawn while this rank copied it; it left the collective"
        ) as info:
            drive_for(t[1], 5.0)
        assert info.value.peer == 0
    finally:
        for transport in t:
            transport.close()


def test_pointers_and_slots_carry_the_same_frames() -> None:
    """Frames around the threshold, many at once, both ways: the pointer path agrees with the slots."""
    rng = np.random.default_rng(5)
    sizes = [0, 1, 1023, 1024, 1025, 70_000, 3 << 20]
    frames = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    got: dict[int, list[np.ndarray]] = {}
    for single_copy_bytes in (0, 1024):
        t = shm_mesh(2, 1, single_copy_bytes=single_copy_bytes)
        try:
            outs = [np.zeros(n, np.uint8) for n in sizes]
            requests = [t[0].isend(1, 0, 20 + k, SIG, view(f)) for k, f in enumerate(frames)]
            requests += [t[1].irecv(0, 0, 20 + k, SIG, view(o)) for k, o in enumerate(outs)]
            sender, receiver = t
            sends, recvs = requests[: len(sizes)], requests[len(sizes) :]
            in_parallel(lambda: drive(sender, sends), lambda: drive(receiver, recvs))  # noqa: B023 (run here)
            for frame, out in zip(frames, outs, strict=True):
                np.testing.assert_array_equal(out, frame)
            got[single_copy_bytes] = outs
        finally:
            for transport in t:
                transport.close()
    for a, b in zip(got[0], got[1024], strict=True):
        assert a.tobytes() == b.tobytes()


def test_memory_the_kernel_will_not_let_peers_copy_is_told_apart_once_per_buffer() -> None:
    """A mapping without read access stands in for device mappings (CUDA's pinned host memory)."""
    sealed = mmap.mmap(-1, 1 << 20, prot=0)
    array = np.ones(1 << 18, np.float32)
    copyable = cma.Copyable(capacity=2)
    assert not copyable(memoryview(sealed)[4096:8192])
    assert copyable(view(array)[40:4000]) and copyable(view(array)[8:16])
    assert list(copyable.ranges.values()) == [False, True], "one entry per owning buffer"
    copyable(view(np.ones(8, np.uint8)))
    assert len(copyable.ranges) == 2


def test_a_frame_from_memory_peers_cannot_copy_goes_through_the_slots() -> None:
    writer, reader = link_pair(single_copy_bytes=1)
    writer.copyable = lambda view: False  # type: ignore[assignment]
    frame = np.arange(100, dtype=np.uint8)
    send = Request(1, 0, 9, view(frame))
    writer.sends.append((send, SIG, 0))
    out = np.zeros(100, np.uint8)
    reader.recvs.append((Request(0, 0, 9, view(out)), SIG, 0))
    writer.push()
    assert send.done and not writer.awaiting, "in a slot: done at once"
    reader.pull()
    np.testing.assert_array_equal(out, frame)


def test_pointers_only_in_collectives_whose_buffers_outgrow_the_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``expect``'s bytes times the host's ranks against ``cache_bytes``: slots below, pointers above."""
    pointed = []
    real = Ring.point
    monkeypatch.setattr(Ring, "point", lambda ring, *args: pointed.append(args[4]) or real(ring, *args))
    t = shm_mesh(2, 1, single_copy_bytes=1024, cache_bytes=8 << 20)
    try:
        frame = np.arange(4096, dtype=np.uint8)
        for seq, (nbytes, points) in enumerate(
            [(4 << 20, False), (4 << 20 | 1, True), (0, True), (64, False)]
        ):
            pointed.clear()
            for transport in t:
                transport.expect(seq, SIG, nbytes)
            out = np.zeros_like(frame)
            send, recv = t[0].isend(1, 0, 5, SIG, view(frame)), t[1].irecv(0, 0, 5, SIG, view(out))
            in_parallel(lambda: drive(t[0], [send]), lambda: drive(t[1], [recv]))  # noqa: B023 (run here)
            np.testing.assert_array_equal(out, frame)
            assert pointed == ([4096] if points else []), f"{nbytes} bytes on 2 ranks against 8 MiB of cache"
    finally:
        for transport in t:
            transport.close()


def test_the_last_level_cache_is_the_largest_the_kernel_reports(tmp_path: Path) -> None:
    from ringcore.transport.shm_setup import last_level_cache

    for index, size in enumerate(["32K", "1024K", "32768K", "garbage"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "uevent").write_text("")
    assert last_level_cache(str(tmp_path)) == 32 << 20
    assert last_level_cache(str(tmp_path / "missing")) == 0
