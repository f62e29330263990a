"""Set-up of the shared-memory transport: who is local, the segments and doorbells, the fall-backs to TCP.

Set-up (``connect``), three rounds of small messages over the authenticated
TCP mesh, to every peer:

1. identity: hostname and ``/proc/sys/kernel/random/boot_id``, and the name
   and contents of a probe file this rank made in ``/dev/shm`` (mode 0600).
   A peer is local only if the identity matches *and* it can read the probe:
   two containers with one hostname and separate ``/dev/shm`` are not fooled.
   Also this rank's pid and a token in its memory (:class:`cma.Probe`).
2. segments: whether this rank judged the peer local, and if so the name and
   layout of the segment it made for it and the name of its doorbell FIFO
   (a failure to make one, e.g. ``/dev/shm`` too small, makes the pair use
   TCP, with one warning naming ``RINGCORE_SHM_BYTES``); and whether it could
   read the peer's token with ``process_vm_readv``: if so, the peer sends it
   frames of ``RINGCORE_SHM_SINGLE_COPY_BYTES`` or more as pointers, which
   this rank copies in one pass (:mod:`ringcore.transport.cma`).
3. mapped: whether this rank mapped the peer's segment and opened its
   doorbell, and whether it mapped every rank's mailbox. The receiver unlinks a segment as soon as it has mapped it, the
   sender unlinks it (again) after this round, and so does each rank its
   doorbell, so once ``connect`` returns nothing of the job is left in
   ``/dev/shm`` whatever happens to any rank later. A pair is carried by
   shared memory only if both ranks said yes in every round. Where every
   rank may copy from every other, each also says how fast the kernel's
   copies are next to ``memmove`` here (:func:`cma.relative_speed`, half a
   millisecond), and every rank takes the median of the same list
   (``ShmTransport.slow_kernel_copies``, which moves the direct
   allreduce's auto limit: ``ringcore.config.Settings.direct_from``).

Only the window between making a segment and the end of set-up can leave a
file behind (a rank killed right then); names are unguessable and files are
readable only by the job's user.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import statistics
import struct
import threading
import time
from typing import Any

import msgpack

from ringcore.config import SLOW_KERNEL_COPIES
from ringcore.errors import CollectiveTimeout
from ringcore.transport import cma, shm_ring
from ringcore.transport.shm import ShmTransport
from ringcore.transport.shm_mailbox import Mailbox, segment_bytes
from ringcore.transport.shm_ring import Doorbell, Ring, Segment
from ringcore.transport.tcp import TcpTransport, needed_links

log = logging.getLogger("ringcore")
_warned_fallback = False
_warn_lock = threading.Lock()

_SETUP_TAG = 0xFFFFFFFE << 32  # never a collective's: set-up ends before the first collective
_SETUP_SIGNATURE = 0x5348_4D00  # "SHM"
_MESSAGE_BYTES = 512
_LENGTH = struct.Struct("<H")


def connect(
    control: TcpTransport,
    shm_bytes: int,
    timeout: float,
    single_copy_bytes: int = 0,
    cache_bytes: int | None = 0,
    kernel_copies: str = "auto",
) -> ShmTransport:
    """Find the peers on this host and connect to them through shared memory (module docstring).

    Args:
        control: the job's connected TCP mesh; every rank must call this at the same point.
        shm_bytes: bytes of shared memory per ordered pair (``RINGCORE_SHM_BYTES``).
        timeout: seconds each round may wait for the peers (``RINGCORE_INIT_TIMEOUT``).
        single_copy_bytes: frames from this size go as pointers where the peer can read this
            rank's memory (``RINGCORE_SHM_SINGLE_COPY_BYTES``; 0: never).
        cache_bytes: ...in collectives whose buffers on this host outgrow this
            (``RINGCORE_SHM_CACHE_BYTES``; None: :func:`last_level_cache`; 0: in all).
        kernel_copies: ``fast``, ``slow`` or ``auto`` (``RINGCORE_KERNEL_COPIES``): whether
            ``process_vm_readv`` is slow next to ``memmove`` here (``ShmTransport.slow_kernel_copies``);
            auto: where every rank may copy from every other, each measures it
            (:func:`cma.relative_speed`) and all take the median; pinned ``slow`` too holds only there.

    Raises:
        PeerFailure: a peer died during set-up.
        CollectiveTimeout: a peer did not answer within ``timeout`` (is it using ``RINGCORE_TRANSPORT=shm``?).
    """
    peers = [peer for peer in range(control.size) if peer != control.rank]
    why_not = shm_ring.supported()
    probe, token = (None, "") if why_not else _make_probe()
    made: dict[int, Segment] = {}
    mapped: dict[int, Segment] = {}
    bells: dict[int, int] = {}
    doorbell: Doorbell | str | None = None
    box: Segment | None = None
    boxes: dict[int, Segment] = {}
    try:
        memory = cma.Probe()
        me = {"host": _host_identity(), "probe": probe or "", "token": token, "memory": memory.record()}
        theirs = _exchange(control, dict.fromkeys(peers, me), timeout)
        local = [peer for peer in peers if not why_not and _is_local(me, theirs[peer])]
        twins = [peer for peer in peers if theirs[peer].get("host") == me["host"]]
        if why_not and twins:
            _fall_back(twins[0], why_not, "")
        links = needed_links(control.rank, control.size, control.channels)
        rings = {peer: sum(1 for p, _ in links if p == peer) for peer in local}
        doorbell = _make_doorbell() if local else None
        offers = {peer: _offer(peer, rings[peer], shm_bytes, made, doorbell) for peer in local}
        box = _make_mailbox() if peers and len(local) == len(peers) else None
        for peer in local:
            offers[peer]["mailbox"] = box.name if box is not None else ""
            record = theirs[peer].get("memory") or {}
            offers[peer]["reads"] = cma.readable(record)
            offers[peer]["writes"] = offers[peer]["reads"] and cma.writable(record)
        answers = _exchange(control, {peer: offers.get(peer, {}) for peer in peers}, timeout)
        if probe is not None:
            shm_ring.unlink(probe)
        for peer in local:
            if peer in made and answers[peer].get("segment"):
                _attach(peer, answers[peer], mapped, bells)
            if box is not None and answers[peer].get("mailbox"):
                _attach_mailbox(peer, str(answers[peer]["mailbox"]), boxes)
        boxed = box is not None and all(peer in boxes and peer in mapped for peer in peers)
        copies_all = len(local) == len(peers) and all(offers[peer]["writes"] for peer in local)
        speed = (cma.relative_speed() or None) if copies_all and kernel_copies == "auto" else None
        said = {
            peer: {"mapped": peer in mapped, "copies_all": copies_all, "boxed": boxed, "copy_speed": speed}
            for peer in peers
        }
        done = _exchange(control, said, timeout)
    except BaseException:
        for segment in (*made.values(), *mapped.values(), *boxes.values(), *([box] if box else [])):
            shm_ring.unlink(segment.name)
            segment.close()
        for fd in bells.values():
            os.close(fd)
        if isinstance(doorbell, Doorbell):
            shm_ring.unlink(doorbell.name)
            doorbell.close()
        if probe is not None:
            shm_ring.unlink(probe)
        raise
    for segment in (*made.values(), *([box] if box else [])):
        shm_ring.unlink(segment.name)
    if isinstance(doorbell, Doorbell):
        shm_ring.unlink(doorbell.name)
    ours = doorbell if isinstance(doorbell, Doorbell) else None
    point_from = {
        peer: single_copy_bytes for peer in mapped if single_copy_bytes and answers[peer].get("reads")
    }
    peer_pids = {peer: int(theirs[peer]["memory"]["pid"]) for peer in local if offers[peer].get("reads")}
    cache = last_level_cache() if cache_bytes is None else cache_bytes
    transport = _assemble(
        control, made, mapped, answers, done, links, ours, bells, point_from, peer_pids, cache
    )
    transport.copies_everywhere = copies_all and all(done[peer].get("copies_all") for peer in peers)
    said_speeds = [speed, *(done[peer].get("copy_speed") for peer in peers)]
    speeds = [float(value) for value in said_speeds if value is not None]
    if kernel_copies != "auto":  # pinned, but only where the direct route can run at all
        transport.slow_kernel_copies = kernel_copies == "slow" and transport.copies_everywhere
    elif transport.copies_everywhere and len(speeds) == len(said_speeds):  # the same list on every rank
        transport.kernel_copy_speeds = speeds
        transport.slow_kernel_copies = statistics.median(speeds) < SLOW_KERNEL_COPIES
    transport.word = memory.word
    transport.peer_words = {peer: int(theirs[peer]["memory"].get("word", 0)) for peer in peer_pids}
    if box is not None and boxed and all(done[peer].get("boxed") for peer in peers):
        transport.mailbox = Mailbox(control.rank, {control.rank: box, **boxes})
    else:
        for segment in (*boxes.values(), *([box] if box else [])):
            segment.close()
    return transport


def last_level_cache(cpu: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Bytes of this host's largest CPU cache, as the kernel reports it (0: not known)."""
    sizes = [0]
    with contextlib.suppress(OSError):
        for index in os.listdir(cpu):
            with contextlib.suppress(OSError, ValueError):
                with open(os.path.join(cpu, index, "size")) as file:
                    text = file.read().strip().upper()
                scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
                sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes)


def _assemble(
    control: TcpTransport,
    made: dict[int, Segment],
    mapped: dict[int, Segment],
    answers: dict[int, dict[str, Any]],
    done: dict[int, dict[str, Any]],
    links: list[tuple[int, int]],
    doorbell: Doorbell | None,
    bells: dict[int, int],
    point_from: dict[int, int],
    peer_pids: dict[int, int],
    cache_bytes: int,
) -> ShmTransport:
    """The transport over the pairs where both sides mapped; the other segments and doorbells are dropped."""
    rings: dict[tuple[int, int], tuple[Ring, Ring]] = {}
    kept: list[Segment] = []
    for peer in sorted(made):
        if peer not in mapped or not done[peer].get("mapped"):
            made[peer].close()
            if peer in mapped:
                mapped.pop(peer).close()
                os.close(bells.pop(peer))
            continue
        out_layout = shm_ring.layout(made[peer].region.size(), _count(links, peer))
        in_layout = tuple(answers[peer]["layout"])
        channels = [channel for p, channel in links if p == peer]
        for index, channel in enumerate(channels):
            rings[(peer, channel)] = (
                _ring(made[peer], index, out_layout),
                _ring(mapped[peer], index, in_layout),
            )
        kept += [made[peer], mapped[peer]]
    if rings:
        log.info("rank %d: shared memory to ranks %s", control.rank, sorted({p for p, _ in rings}))
    elif doorbell is not None:
        doorbell.close()
        doorbell = None
    return ShmTransport(control, rings, kept, doorbell, bells, point_from, peer_pids, cache_bytes)


def _count(links: list[tuple[int, int]], peer: int) -> int:
    return sum(1 for p, _ in links if p == peer)


def _ring(segment: Segment, index: int, layout: tuple[int, ...]) -> Ring:
    ring_bytes, slots, slot_bytes = layout
    assert segment.bytes is not None
    return Ring(segment.bytes[index * ring_bytes : (index + 1) * ring_bytes], slots, slot_bytes)


def _make_doorbell() -> Doorbell | str:
    """This rank's doorbell, or why it could not make one."""
    try:
        return Doorbell.create()
    except OSError as err:
        return f"could not make a FIFO in {shm_ring.SHM_DIR}: {err.strerror or err}"


def _offer(
    peer: int, rings: int, shm_bytes: int, made: dict[int, Segment], doorbell: Doorbell | str | None
) -> dict[str, Any]:
    """Make the segment this rank writes to ``peer``; what to tell the peer about it and the doorbell."""
    ring_bytes, slots, slot_bytes = shm_ring.layout(shm_bytes, rings)
    if not slots:
        _fall_back(peer, f"{shm_bytes} bytes cannot hold {rings} rings of slots")
        return {"local": True}
    if not isinstance(doorbell, Doorbell):
        _fall_back(peer, str(doorbell))
        return {"local": True}
    try:
        made[peer] = Segment.create(ring_bytes * rings)
    except OSError as err:
        _fall_back(peer, f"{shm_ring.SHM_DIR}: {err.strerror or err}")
        return {"local": True}
    layout = [ring_bytes, slots, slot_bytes]
    return {
        "local": True,
        "segment": made[peer].name,
        "bytes": ring_bytes * rings,
        "layout": layout,
        "bell": doorbell.name,
    }


def _attach(peer: int, answer: dict[str, Any], mapped: dict[int, Segment], bells: dict[int, int]) -> None:
    """Map the peer's segment and open its doorbell; on failure neither (the pair uses TCP)."""
    try:
        segment = Segment.attach(str(answer["segment"]), int(answer["bytes"]))
    except OSError as err:
        _fall_back(peer, f"could not map its segment: {err}")
        return
    try:
        bells[peer] = shm_ring.open_bell(str(answer.get("bell", "")))
    except OSError as err:
        segment.close()
        _fall_back(peer, f"could not open its doorbell: {err}")
        return
    mapped[peer] = segment


def _make_mailbox() -> Segment | None:
    """This rank's mailbox, or None where ``/dev/shm`` will not hold it (small allreduces take the rings)."""
    try:
        return Segment.create(segment_bytes())
    except OSError as err:
        log.info("no shared-memory mailbox (%s): small allreduces take the rings", err.strerror or err)
        return None


def _attach_mailbox(peer: int, name: str, boxes: dict[int, Segment]) -> None:
    """Map the peer's mailbox (its owner unlinks it); on failure leave it out (no rank takes the one-shot route)."""
    try:
        boxes[peer] = Segment.attach(name, segment_bytes(), unlink_it=False)  # its owner unlinks it
    except OSError as err:
        log.info("could not map rank %d's mailbox (%s): small allreduces take the rings", peer, err)


_ADVICE = f". Free space in {shm_ring.SHM_DIR} or lower RINGCORE_SHM_BYTES (bytes per pair of ranks)"


def _fall_back(peer: int, why: str, advice: str = _ADVICE) -> None:
    """Warn, once per process, that a pair of ranks on one host uses TCP (ranks may be threads: locked)."""
    global _warned_fallback
    with _warn_lock:
        if _warned_fallback:
            return
        _warned_fallback = True
    log.warning("shared memory to rank %d is not possible (%s); that pair uses TCP%s", peer, why, advice)


def _make_probe() -> tuple[str | None, str]:
    name, token = shm_ring.new_name("probe"), os.urandom(16).hex()
    try:
        fd = os.open(os.path.join(shm_ring.SHM_DIR, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None, ""
    with os.fdopen(fd, "w") as file:
        file.write(token)
    return name, token


def _is_local(me: dict[str, Any], peer: dict[str, Any]) -> bool:
    """Same host identity, and the peer's probe file is visible here with its contents."""
    name = str(peer.get("probe", ""))
    if peer.get("host") != me["host"] or not name.startswith(shm_ring.PREFIX) or "/" in name:
        return False
    try:
        with open(os.path.join(shm_ring.SHM_DIR, name)) as file:
            return file.read() == peer["token"]
    except OSError:
        return False


def _host_identity() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            boot = file.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _exchange(
    control: TcpTransport, outgoing: dict[int, dict[str, Any]], timeout: float
) -> dict[int, dict[str, Any]]:
    """Send one small message to every peer and receive one from each, over the TCP mesh."""
    inboxes = {peer: bytearray(_MESSAGE_BYTES) for peer in outgoing}
    requests = []
    for peer, message in outgoing.items():
        packed = msgpack.packb(message)
        frame = bytearray(_MESSAGE_BYTES)
        _LENGTH.pack_into(frame, 0, len(packed))
        frame[_LENGTH.size : _LENGTH.size + len(packed)] = packed
        requests.append(control.irecv(peer, 0, _SETUP_TAG, _SETUP_SIGNATURE, memoryview(inboxes[peer])))
        requests.append(control.isend(peer, 0, _SETUP_TAG, _SETUP_SIGNATURE, memoryview(frame)))
    deadline = time.monotonic() + timeout
    while not all(request.done for request in requests):
        if time.monotonic() > deadline:
            waiting = sorted({r.peer for r in requests if not r.done})
            raise CollectiveTimeout(
                f"rank {control.rank}: ranks {waiting} did not answer the shared-memory set-up within "
                f"{timeout:g} s; is RINGCORE_TRANSPORT=shm set on every rank?"
            )
        control.progress(0.05)
    replies = {}
    for peer, inbox in inboxes.items():
        (length,) = _LENGTH.unpack_from(inbox, 0)
        replies[peer] = msgpack.unpackb(bytes(inbox[_LENGTH.size : _LENGTH.size + length]))
    return replies
