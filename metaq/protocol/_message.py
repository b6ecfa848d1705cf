"""Metaq 1.4 message bytes (reference section 5).

A message on disk and inside the body of a ``value`` reply is::

    int32 length     payload length (attribute section included)
    int32 checksum   CRC32(payload) & 0x7FFFFFFF
    int64 msgId
    int32 flag       bit 0 = the payload starts with an attribute
    payload          [int32 attrLen, UTF-8 attribute] body

all big-endian.  This module encodes and decodes those bytes, iterates over a
buffer of concatenated messages without copying more than needed, and
generates broker message ids.  The walk over a buffer is :func:`metaq.protocol._fast.scan`
(C or its Python twin): :func:`scan_messages` and :func:`iter_messages` are that walk
with errors worded for people.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

from metaq._errors import ChecksumError, ConfigError, MessageError
from metaq.protocol._constants import (
    CHECKSUM_MASK,
    FLAG_HAS_ATTRIBUTE,
    HEADER_SIZE,
    MAX_MESSAGE_SIZE,
    MAX_PAYLOAD_SIZE,
    MSG_ID_EPOCH_MS,
)
from metaq.protocol._fast import crc32, scan

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "MAX_MESSAGE_SIZE",
    "MAX_PAYLOAD_SIZE",
    "MSG_ID_EPOCH_MS",
    "FLAG_HAS_ATTRIBUTE",
    "RawMessage",
    "MsgIdGenerator",
    "checksum",
    "build_payload",
    "split_payload",
    "encode_message",
    "iter_messages",
    "scan_messages",
    "scan_problem",
    "msg_id_parts",
]

#: length, checksum, msgId, flag
HEADER = struct.Struct(">iiqi")
assert HEADER.size == HEADER_SIZE

_ATTR_LEN = struct.Struct(">i")
_unpack_header = HEADER.unpack_from
_pack_header = HEADER.pack
_crc32 = crc32  # ISA-L's when installed (chosen in metaq.protocol._fast)


class RawMessage(NamedTuple):
    """One complete message found in a buffer.

    ``offset`` is the absolute log offset of its header, ``next_offset`` the
    offset right after it; ``payload`` is the raw payload (attribute section
    included, see :func:`split_payload`).
    """

    offset: int
    msg_id: int
    flag: int
    payload: bytes
    next_offset: int


def checksum(payload: bytes) -> int:
    """Metaq's checksum: CRC32 of the payload masked to a non-negative int32."""
    return _crc32(payload) & CHECKSUM_MASK


def build_payload(body: bytes, attribute: str | None) -> tuple[bytes, int]:
    """Return ``(payload, flag)`` for a body and an optional attribute.

    With an attribute the payload is ``int32 attrLen + UTF-8 attribute + body``
    and flag bit 0 is set; without one the payload is the body and flag 0.
    """
    if attribute is None:
        return bytes(body), 0
    if not isinstance(attribute, str):
        raise MessageError(f"attribute must be a str or None, not {type(attribute).__name__}")
    attr = attribute.encode("utf-8")
    return _ATTR_LEN.pack(len(attr)) + attr + body, FLAG_HAS_ATTRIBUTE


def split_payload(payload: bytes, flag: int) -> tuple[str | None, bytes]:
    """Return ``(attribute, body)`` of a payload; the inverse of :func:`build_payload`.

    Raises :class:`metaq.MessageError` when flag bit 0 is set and the attribute
    length is impossible or the attribute is not UTF-8.
    """
    if not flag & FLAG_HAS_ATTRIBUTE:
        return None, bytes(payload)
    n = len(payload)
    if n < 4:
        raise MessageError(f"flag says the payload has an attribute but it is only {n} bytes")
    (alen,) = _ATTR_LEN.unpack_from(payload, 0)
    if alen < 0 or 4 + alen > n:
        raise MessageError(f"bad attribute length {alen} in a payload of {n} bytes")
    try:
        attribute = str(payload[4:4 + alen], "utf-8")
    except UnicodeDecodeError as e:
        raise MessageError(f"attribute is not valid UTF-8: {e}") from None
    return attribute, bytes(payload[4 + alen:])


def encode_message(msg_id: int, flag: int, payload: bytes) -> bytes:
    """The full record (20-byte header + payload) as stored in the log."""
    return _pack_header(len(payload), _crc32(payload) & CHECKSUM_MASK, msg_id, flag) + payload


def iter_messages(buf: bytes | bytearray | memoryview, start_offset: int = 0, *,
                  verify: bool = True,
                  max_payload: int = MAX_PAYLOAD_SIZE) -> Iterator[RawMessage]:
    """Yield every complete message in ``buf`` as a :class:`RawMessage`.

    ``start_offset`` is the absolute offset of ``buf[0]``.  A truncated last
    message (header or payload cut short) ends the iteration silently.  A
    negative or larger-than-``max_payload`` length raises
    :class:`metaq.MessageError`, a checksum mismatch (when ``verify``)
    :class:`metaq.ChecksumError`; both name the offset, and come after the
    messages before it.  (``buf`` is walked first, in one ``scan``.)
    """
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.itemsize != 1 or mv.ndim != 1:
        mv = mv.cast("B")
    bounds, _count, stop, kind, a, b = scan(mv, verify, max_payload)
    starts = memoryview(bounds).cast("i").tolist()
    unpack = _unpack_header
    for pos, nxt in zip(starts, starts[1:], strict=False):
        _length, _check, msg_id, flag = unpack(mv, pos)
        yield RawMessage(start_offset + pos, msg_id, flag, mv[pos + HEADER_SIZE:nxt].tobytes(),
                         start_offset + nxt)
    if kind == 1:
        raise MessageError(f"impossible message length {a} at offset {start_offset + stop} "
                           f"(limit {max_payload})")
    if kind == 2:
        raise ChecksumError(
            f"checksum mismatch at offset {start_offset + stop}: header says {a}, "
            f"payload of {unpack(mv, stop)[0]} bytes has {b}")


def scan_messages(buf: bytes | bytearray | memoryview, *,
                  max_payload: int = MAX_PAYLOAD_SIZE) -> tuple[int, int, str | None]:
    """Check every message of ``buf`` without building them.

    Returns ``(valid_bytes, count, problem)``: the length of the longest prefix
    made of complete messages with good checksums, how many messages it holds,
    and ``None`` when the rest is empty or a truncated message, else a text
    saying what is wrong at ``valid_bytes`` (bad length or checksum).
    """
    _bounds, count, valid, kind, a, b = scan(buf, True, max_payload, False)
    return valid, count, scan_problem(kind, a, b)


def scan_problem(kind: int, a: int, b: int) -> str | None:
    """The text :func:`scan_messages` gives for a problem ``scan`` found (its ``kind``,
    ``a``, ``b``)."""
    if kind == 1:
        return f"impossible message length {a}"
    if kind == 2:
        return f"checksum mismatch (header {a}, payload {b})"
    return None


def msg_id_parts(msg_id: int) -> tuple[int, int, int]:
    """Split a msgId into ``(wall-clock ms, brokerId, sequence)``."""
    return (msg_id >> 22) + MSG_ID_EPOCH_MS, (msg_id >> 12) & 0x3FF, msg_id & 0xFFF


class MsgIdGenerator:
    """Thread-safe, strictly increasing msgIds for one broker.

    ``msgId = ((ms - 1303895660503) << 22) | (brokerId << 12) | seq`` where
    ``ms`` comes from a monotonic clock anchored to the wall clock when the
    generator is created.  When the 4096 sequence numbers of a millisecond are
    used up the next millisecond is borrowed, so ids stay unique and increasing
    however fast they are asked for.
    """

    def __init__(self, broker_id: int) -> None:
        if isinstance(broker_id, bool) or not isinstance(broker_id, int) \
                or not 0 <= broker_id <= 1023:
            raise ConfigError(f"broker_id must be an int in 0..1023, got {broker_id!r}")
        self.broker_id = broker_id
        self._broker_bits = broker_id << 12
        self._anchor_ms = time.time_ns() // 1_000_000
        self._anchor_mono = time.monotonic_ns()
        self._last_ms = 0
        self._seq = -1
        self._lock = threading.Lock()

    def _now_ms(self) -> int:
        return self._anchor_ms + (time.monotonic_ns() - self._anchor_mono) // 1_000_000

    def continue_after(self, ms: int | None) -> int:
        """Make every later id's time at least ``ms`` and every later id greater than
        any id of a millisecond up to ``ms`` (a broker passes the greatest time in its
        logs when it starts, so a clock set back across a restart neither makes times
        go back nor repeats ids).  Returns how far ``ms`` is ahead of the clock (0 when
        it is not)."""
        if ms is None:
            return 0
        with self._lock:
            if ms >= self._last_ms:
                self._last_ms = ms
                self._seq = 0xFFF  # the next id borrows the next millisecond
            return max(0, ms - self._now_ms())

    def next_id(self) -> int:
        """One new msgId."""
        return self.next_ids(1)[0]

    def next_ids(self, n: int) -> list[int]:
        """``n`` new msgIds in increasing order (one lock round for all of them)."""
        out: list[int] = []
        with self._lock:
            now = self._now_ms()
            if now > self._last_ms:
                self._last_ms = now
                self._seq = -1
            while n > 0:
                seq = self._seq + 1
                if seq > 0xFFF:
                    self._last_ms += 1  # borrow the next millisecond
                    seq = 0
                take = min(n, 0x1000 - seq)
                base = ((self._last_ms - MSG_ID_EPOCH_MS) << 22) | self._broker_bits
                out.extend(range(base | seq, (base | seq) + take))
                self._seq = seq + take - 1
                n -= take
        return out
