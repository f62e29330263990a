"""The loopback TCP stack's CPU cost per MiB, by send size: the floor under every TCP allreduce.

    python bench/kernel_cost.py            # 16 MiB x 40 rounds per send size

One process sends a 16 MiB buffer over a loopback TCP connection in pieces
of each size (blocking ``sendall``); a forked child receives it with
``recv_into``. Prints the goodput and each side's CPU time per MiB
(``time.process_time``), with kernel-default socket buffers and with 4 MiB
ones (ringcore's ``RINGCORE_SOCKET_BUFFER``). An allreduce that sends and
receives B bytes per rank cannot use less CPU than B times these costs.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

TOTAL = 16 << 20
ROUNDS = 40
MIB = 1 << 20


def _receive(sock: socket.socket, piece: int, report: int) -> None:
    buffer = memoryview(np.zeros(TOTAL, np.uint8))
    start = time.process_time()
    for _ in range(ROUNDS):
        offset = 0
        while offset < TOTAL:
            offset += sock.recv_into(buffer[offset : offset + piece])
    os.write(report, repr(time.process_time() - start).encode())


def measure(piece: int, socket_buffer: int) -> str:
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
    if child == 0:
        sender.close()
        _receive(receiver, piece, write_end)
        os._exit(0)
    receiver.close()
    data = memoryview(np.ones(TOTAL, np.uint8))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(ROUNDS):
        for offset in range(0, TOTAL, piece):
            sender.sendall(data[offset : offset + piece])
    os.waitpid(child, 0)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    receive_cpu = float(os.read(read_end, 100))
    sender.close()
    os.close(read_end)
    os.close(write_end)
    mib = TOTAL * ROUNDS / MIB
    return (
        f"send {piece >> 10:5d} KiB, socket buffers {socket_buffer >> 10 or 'default':>7}: "
        f"{mib / wall / 1024:5.2f} GiB/s; CPU per MiB: send {cpu / mib * 1e3:.3f} ms, "
        f"receive {receive_cpu / mib * 1e3:.3f} ms"
    )


def main() -> None:
    for socket_buffer in (0, 4 * MIB):
        for piece in (64 << 10, 128 << 10, 512 << 10, 2 * MIB):
            print(measure(piece, socket_buffer), flush=True)


if __name__ == "__main__":
    main()
