"""The loopback TCP stack's CPU cost per MiB, by send size: the floor under every TCP allreduce.

    python bench/kernel_cost.py                       # 16 MiB x 40 rounds per send size
    python bench/kernel_cost.py --splice --same-cpu   # zero-copy sends, both ends on CPU 0

One process sends a 16 MiB buffer over a loopback TCP connection in pieces
of each size (blocking ``sendall``); a forked child receives it with
``recv_into``. Prints the goodput and each side's CPU time per MiB
(``time.process_time``), with kernel-default socket buffers and with 4 MiB
ones (ringcore's ``RINGCORE_SOCKET_BUFFER``). An allreduce that sends and
receives B bytes per rank cannot use less CPU than B times these costs.

``--splice`` sends without the sender's copy: ``vmsplice`` hands the
buffer's pages to a pipe and ``splice`` moves them into the socket, so the
receiver copies straight out of the sender's pages (loopback delivers the
same buffers). It is what a zero-copy TCP send could save; ringcore does not
send this way (bench/HISTORY.md, "Zero-copy sends, tried": the receiver pays
more than the sender saves). ``--same-cpu`` pins both ends to
one CPU, where wall time is their CPU summed, as with more ranks than cores.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import os
import socket
import time

import numpy as np

TOTAL = 16 << 20
ROUNDS = 40
MIB = 1 << 20
_F_SETPIPE_SZ = 1031


class _IoVec(ctypes.Structure):
    _fields_ = (("base", ctypes.c_void_p), ("length", ctypes.c_size_t))


def _splicer() -> ctypes.CDLL:
    """libc with ``vmsplice`` declared (Python's os module has ``splice`` but not ``vmsplice``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.vmsplice.argtypes = (ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint)
    libc.vmsplice.restype = ctypes.c_ssize_t
    return libc


def _send_spliced(libc: ctypes.CDLL, sock: socket.socket, data: np.ndarray, pipe: tuple[int, int]) -> None:
    """All of ``data`` into ``sock`` through ``pipe``: page references, no copy on this side."""
    read_end, write_end = pipe
    address, offset = data.ctypes.data, 0
    while offset < data.nbytes:
        vec = _IoVec(address + offset, data.nbytes - offset)
        moved = libc.vmsplice(write_end, ctypes.byref(vec), 1, 0)
        if moved < 0:
            raise OSError(ctypes.get_errno(), "vmsplice")
        offset += moved
        while moved:
            moved -= os.splice(read_end, sock.fileno(), moved)


def _receive(sock: socket.socket, piece: int, report: int, rounds: int) -> None:
    array = np.zeros(TOTAL, np.uint8)
    buffer = memoryview(array)
    start = time.process_time()
    for _ in range(rounds):
        offset = 0
        while offset < TOTAL:
            got = sock.recv_into(buffer[offset : offset + piece])
            if not got:
                os.write(report, b"nan False")  # the sender stopped early
                return
            offset += got
    cpu = time.process_time() - start
    os.write(report, f"{cpu!r} {np.array_equal(array, _pattern())}".encode())


def _pattern() -> np.ndarray:
    """What the sender sends: every byte value, over and over."""
    return np.resize(np.arange(256, dtype=np.uint8), TOTAL)


def _send(
    sender: socket.socket, piece: int, rounds: int, pipe: tuple[int, int] | None
) -> tuple[float, float]:
    """Send the pattern ``rounds`` times in ``piece``-byte sends (spliced through ``pipe`` if given).

    Returns the wall and CPU seconds it took.
    """
    array = _pattern()
    data = memoryview(array)
    libc = _splicer() if pipe is not None else None
    if pipe is not None:
        fcntl.fcntl(pipe[1], _F_SETPIPE_SZ, min(piece, MIB))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(rounds):
        for offset in range(0, TOTAL, piece):
            if libc is not None and pipe is not None:
                _send_spliced(libc, sender, array[offset : offset + piece], pipe)
            else:
                sender.sendall(data[offset : offset + piece])
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(
    piece: int, socket_buffer: int, splice: bool = False, same_cpu: bool = False, rounds: int = ROUNDS
) -> str:
    """One line: goodput and CPU ms per MiB on each side, for ``piece``-byte sends."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.create_connection(server.getsockname())
        receiver, _ = server.accept()
    if socket_buffer:
        sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer)
        receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer)
    sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the receiver; it must never return into the caller's code
        try:
            if same_cpu:
                os.sched_setaffinity(0, {0})
            sender.close()
            _receive(receiver, piece, write_end, rounds)
        finally:
            os._exit(0)
    receiver.close()
    os.close(write_end)  # so a receiver that died without a word reads as end of file
    allowed = os.sched_getaffinity(0)
    if same_cpu:
        os.sched_setaffinity(0, {0})
    pipe = os.pipe() if splice else None
    try:
        wall, cpu = _send(sender, piece, rounds, pipe)
    finally:
        os.sched_setaffinity(0, allowed)
        sender.close()  # the receiver stops at EOF if sending failed
        os.waitpid(child, 0)
        report = os.read(read_end, 100).decode().split()
        for fd in (read_end, *(pipe or ())):
            os.close(fd)
    if report[1:] != ["True"]:
        raise RuntimeError(f"the receiver got other bytes than were sent ({report or 'it died'})")
    receive_cpu = float(report[0])
    mib = TOTAL * rounds / MIB
    return (
        f"{'splice' if splice else 'send'} {piece >> 10:5d} KiB, socket buffers {socket_buffer >> 10 or 'default':>7}: "
        f"{mib / wall / 1024:5.2f} GiB/s; CPU per MiB: send {cpu / mib * 1e3:.3f} ms, "
        f"receive {receive_cpu / mib * 1e3:.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--splice", action="store_true", help="send with vmsplice + splice (no sender copy)")
    parser.add_argument("--same-cpu", action="store_true", help="pin sender and receiver to CPU 0")
    args = parser.parse_args()
    for socket_buffer in (0, 4 * MIB):
        for piece in (64 << 10, 128 << 10, 512 << 10, 2 * MIB):
            print(measure(piece, socket_buffer, args.splice, args.same_cpu), flush=True)


if __name__ == "__main__":
    main()
