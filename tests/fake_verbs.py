"""An in-process fake of the verbs :class:`~ringcore.transport.rdma.Device`: no RDMA involved.

It exists so the RDMA transport's *protocol* (announcements, pairing, credits,
cancellation, mismatch checks) runs in the ordinary test suite on machines
without a verbs device. It follows the RC rules that protocol relies on:
messages on one queue pair arrive in order, every SEND and write with
immediate consumes one posted receive (and waits, like an RNR retry, when none
is posted), a write is refused unless it falls inside a live registration
with remote write access, and completions wake a file descriptor once armed.
Tests that use it are protocol tests, not RDMA tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from collections import deque

from ringcore.transport.rdma import RECEIVED, SENT, WRITTEN, Completion


class FakeRegistration:
    def __init__(self, fabric: FakeFabric, address: int, nbytes: int, writable: bool) -> None:
        self.fabric = fabric
        self.address = address
        self.nbytes = nbytes
        self.writable = writable
        self.lkey = self.rkey = next(fabric.keys)
        self.alive = True
        fabric.registrations[self.rkey] = self

    def close(self) -> None:
        self.alive = False


class FakeFabric:
    """Every rank's fake device, connected link to link like the real queue pairs."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.keys = itertools.count(1)
        self.registrations: dict[int, FakeRegistration] = {}
        self.devices: dict[int, FakeDevice] = {}

    def device(self, rank: int, links: list[tuple[int, int]]) -> FakeDevice:
        device = self.devices[rank] = FakeDevice(self, rank, links)
        return device

    def target(self, rank: int, link: int) -> tuple[FakeDevice, int]:
        peer, channel = self.devices[rank].links[link]
        device = self.devices[peer]
        return device, device.links.index((rank, channel))


class FakeDevice:
    """One rank's fake verbs (see module docstring)."""

    def __init__(self, fabric: FakeFabric, rank: int, links: list[tuple[int, int]]) -> None:
        self.fabric = fabric
        self.rank = rank
        self.links = links
        self.fd, self._wake = os.pipe()
        os.set_blocking(self.fd, False)
        self._armed = False
        self._completions: deque[Completion] = deque()
        self._posted: list[deque[tuple[int, int]]] = [deque() for _ in links]  # (slot, address)
        self._waiting: list[deque[tuple]] = [deque() for _ in links]  # messages waiting for a receive
        self.closed = False
        self.sends = 0
        self.writes = 0
        self.most_waiting = 0  # most messages that ever found no posted receive (RNR) on one link

    def register(self, address: int, nbytes: int, writable: bool) -> FakeRegistration:
        return FakeRegistration(self.fabric, address, nbytes, writable)

    def post_recv(self, link: int, slot: int, address: int, nbytes: int, lkey: int) -> None:
        with self.fabric.lock:
            self._posted[link].append((slot, address))
            self._deliver(link)

    def post_send(self, link: int, data: bytes) -> None:
        with self.fabric.lock:
            self.sends += 1
            device, index = self.fabric.target(self.rank, link)
            device._waiting[index].append(("send", bytes(data), self, link))
            device._deliver(index)

    def post_write(
        self, link: int, address: int, nbytes: int, lkey: int, remote: int, rkey: int, imm: int
    ) -> None:
        with self.fabric.lock:
            self.writes += 1
            device, index = self.fabric.target(self.rank, link)
            device._waiting[index].append(("write", (address, nbytes, remote, rkey, imm), self, link))
            device._deliver(index)

    def _deliver(self, link: int) -> None:
        """Land waiting messages while receives are posted (the RNR retry of a real NIC)."""
        waiting, posted = self._waiting[link], self._posted[link]
        self.most_waiting = max(self.most_waiting, len(waiting) - len(posted))
        while waiting and posted and not self.closed:
            kind, payload, sender, sender_link = waiting.popleft()
            if kind == "send":
                slot, address = posted.popleft()
                ctypes.memmove(address, payload, len(payload))
                self._push(Completion(link, RECEIVED, True, "", slot, len(payload), 0))
                sender._push(Completion(sender_link, SENT, True, "", 0, 0, 0))
                continue
            address, nbytes, remote, rkey, imm = payload
            target = self.fabric.registrations.get(rkey)
            if (
                target is None
                or not target.alive
                or not target.writable
                or not (target.address <= remote and remote + nbytes <= target.address + target.nbytes)
            ):
                sender._push(Completion(sender_link, SENT, False, "IBV_WC_REM_ACCESS_ERR", 0, 0, 0))
                continue
            slot, _ = posted.popleft()
            if nbytes:
                ctypes.memmove(remote, address, nbytes)
            self._push(Completion(link, WRITTEN, True, "", slot, nbytes, imm))
            sender._push(Completion(sender_link, SENT, True, "", 0, 0, 0))

    def _push(self, completion: Completion) -> None:
        self._completions.append(completion)
        if self._armed:
            self._armed = False
            os.write(self._wake, b"x")

    def poll(self, limit: int) -> list[Completion]:
        with self.fabric.lock:
            out = []
            while self._completions and len(out) < limit:
                out.append(self._completions.popleft())
            return out

    def arm(self) -> None:
        with self.fabric.lock:
            self._armed = True

    def consume_event(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 4096)

    def close(self) -> None:
        with self.fabric.lock:
            if self.closed:
                return
            self.closed = True
            os.close(self.fd)
            os.close(self._wake)
