"""Pure framing: the bytes of frame headers, with no sockets.

Every frame starts with a fixed 32-byte header::

    magic u16 | kind u8 | flags u8 | reserved u32 | tag u64 | signature u64 | nbytes u64

followed by ``nbytes`` of payload. DATA payloads are raw element bytes
(never pickled); ABORT payloads are a small msgpack map. A connection opens
with a HELLO header carrying the connecting rank and channel in ``tag`` and
``signature`` and the job's session id in ``nbytes``, and a clean shutdown
ends it with a BYE header, so peers can tell "left" from "died".

Everything read off the wire is validated here before it is used: a bad magic,
an unknown kind or an oversized control payload is a :class:`ProtocolError`,
never an allocation or a write.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from ringcore.errors import RingcoreError

HEADER = struct.Struct("<HBBIQQQ")
HEADER_BYTES = HEADER.size
MAGIC = 0x5243  # "RC"

DATA = 1
ABORT = 2
HELLO = 3
BYE = 4  # the sender shut down cleanly; no more frames follow
KINDS = (DATA, ABORT, HELLO, BYE)

MAX_CONTROL_BYTES = 64 * 1024


class ProtocolError(RingcoreError):
    """Bytes on a connection are not a valid ringcore frame."""


def pack(kind: int, tag: int, signature: int, nbytes: int) -> bytes:
    """Encode one header."""
    return HEADER.pack(MAGIC, kind, 0, 0, tag, signature, nbytes)


def unpack(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """Decode and validate one header into ``(kind, tag, signature, nbytes)``."""
    magic, kind, _flags, _reserved, tag, signature, nbytes = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic:#06x}: the peer is not speaking ringcore's protocol")
    if kind not in KINDS:
        raise ProtocolError(f"unknown frame kind {kind}")
    if kind != DATA and nbytes > MAX_CONTROL_BYTES and kind != HELLO:
        raise ProtocolError(f"control frame of {nbytes} bytes exceeds the {MAX_CONTROL_BYTES}-byte limit")
    return kind, tag, signature, nbytes


def abort_frame(reason: dict[str, Any]) -> bytes:
    """A complete ABORT frame (header and payload) explaining ``reason``."""
    payload = msgpack.packb(reason, use_bin_type=True)[:MAX_CONTROL_BYTES]
    return pack(ABORT, 0, 0, len(payload)) + payload


def decode_abort(payload: bytes) -> dict[str, Any]:
    """Decode an ABORT payload; garbage becomes ``{"message": "unreadable abort"}``."""
    try:
        reason = msgpack.unpackb(payload, raw=False)
    except Exception:  # any decoding failure means the same thing here
        return {"message": "unreadable abort reason"}
    return reason if isinstance(reason, dict) else {"message": str(reason)[:200]}


PART_BITS = 8  # low bits of a tag's sequence field: which schedule of the collective


def tag_seq(collective: int, part: int) -> int:
    """The tag's 32-bit sequence field for schedule ``part`` of collective ``collective``.

    One collective may run several schedules (allgather's count exchange, the
    slices of a large allreduce); each gets its own tags. The field wraps
    after 2**24 collectives, which only ever meets long-finished ones.
    """
    return ((collective << PART_BITS) | (part & ((1 << PART_BITS) - 1))) & 0xFFFFFFFF


def make_tag(seq: int, step: int, segment: int) -> int:
    """64-bit tag: sequence field (32 bits, see ``tag_seq``), step (12 bits), segment (20 bits)."""
    return ((seq & 0xFFFFFFFF) << 32) | ((step & 0xFFF) << 20) | (segment & 0xFFFFF)


def describe_tag(tag: int) -> str:
    """Human-readable ``collective #n [part p] step s segment k``."""
    field = tag >> 32
    part = field & ((1 << PART_BITS) - 1)
    where = f"collective #{field >> PART_BITS}" + (f" part {part}" if part else "")
    return f"{where} step {(tag >> 20) & 0xFFF} segment {tag & 0xFFFFF}"
