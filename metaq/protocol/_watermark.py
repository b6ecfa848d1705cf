"""metaq-py's high watermarks from a master to its slaves (not in Metaq 1.4).

A master serves consumers only below its *high watermark*, what every in-sync
slave holds; a slave that serves consumers must keep to the same bound, or a
consumer reading from one slave could pass what a failover to another slave
loses.  A broker whose ``version`` answer lists :data:`WATERMARK_CAPABILITY`
(``+watermark``) answers::

    watermarks <replica> <version> <holdMs> <opaque>\\r\\n

with the watermarks that changed after ``version`` (0: all of them), held up to
``holdMs`` (capped by its ``max_hold``) when none did.  The answer is ``result
200 <len> <opaque>`` whose body is a :data:`WATERMARK_HEAD` (big-endian
``version (u64) | count (u32)``) and ``count`` entries ``topic length (u16) | topic
(UTF-8) | partition (i32) | watermark (i64)``, the watermark -1 when there is
none (no slave in sync: everything the master holds may be served).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from metaq._errors import ProtocolError
from metaq.protocol._commands import name_problem, parse_int
from metaq.protocol._constants import INT32_MAX, INT32_MIN, INT64_MAX

__all__ = ["WATERMARK_CAPABILITY", "WATERMARK_HEAD", "WatermarkRequest", "encode_watermarks",
           "watermarks_request", "encode_watermark_body", "decode_watermark_body"]

#: In a broker's ``version`` answer: it answers ``watermarks``.
WATERMARK_CAPABILITY = "+watermark"
#: The head of a ``watermarks`` answer: version, count.
WATERMARK_HEAD = struct.Struct(">QI")
_U16 = struct.Struct(">H")
_ENTRY = struct.Struct(">iq")


class WatermarkRequest(NamedTuple):
    """``watermarks <replica> <version> <holdMs> <opaque>``."""

    replica: int
    version: int
    hold_ms: int
    opaque: int


def encode_watermarks(replica: int, version: int, hold_ms: int, opaque: int) -> bytes:
    """A ``watermarks`` request (to a broker listing ``+watermark``)."""
    if not (0 <= replica <= INT32_MAX and 0 <= version <= INT64_MAX
            and 0 <= hold_ms <= INT32_MAX):
        raise ProtocolError(f"bad watermarks request: replica {replica}, version {version}, "
                            f"hold {hold_ms}")
    return b"watermarks %d %d %d %d\r\n" % (replica, version, hold_ms, opaque)


def watermarks_request(parts: list) -> WatermarkRequest:
    """``watermarks <replica> <version> <holdMs> <opaque>`` from its fields."""
    if len(parts) != 5:
        raise ProtocolError("expected 'watermarks <replica> <version> <holdMs> <opaque>'")
    return WatermarkRequest(parse_int(parts[1], "replica", 0, INT32_MAX),
                            parse_int(parts[2], "version", 0, INT64_MAX),
                            parse_int(parts[3], "holdMs", 0, INT32_MAX),
                            parse_int(parts[4], "opaque", INT32_MIN, INT32_MAX))


def encode_watermark_body(version: int, entries: list[tuple[str, int, int | None]]) -> bytes:
    """A ``watermarks`` answer's body: ``(topic, partition, watermark or None)``."""
    out = [WATERMARK_HEAD.pack(version, len(entries))]
    for topic, partition, hw in entries:
        raw = topic.encode("utf-8")
        out.append(_U16.pack(len(raw)) + raw + _ENTRY.pack(partition, -1 if hw is None else hw))
    return b"".join(out)


def decode_watermark_body(body: bytes) -> tuple[int, list[tuple[str, int, int | None]]]:
    """``(version, entries)`` of a ``watermarks`` answer; :class:`ProtocolError` naming
    what is wrong (short, a bad topic, partition or watermark, bytes left over)."""
    if len(body) < WATERMARK_HEAD.size:
        raise ProtocolError(f"watermarks answer of {len(body)} bytes: shorter than its "
                            f"{WATERMARK_HEAD.size}-byte head")
    version, count = WATERMARK_HEAD.unpack_from(body, 0)
    if version > INT64_MAX:
        raise ProtocolError(f"watermarks answer: version {version} is over 2**63-1")
    pos = WATERMARK_HEAD.size
    entries: list[tuple[str, int, int | None]] = []
    for i in range(count):
        if pos + _U16.size > len(body):
            raise ProtocolError(f"watermarks answer: entry {i} of {count} is cut short")
        (n,) = _U16.unpack_from(body, pos)
        end = pos + _U16.size + n + _ENTRY.size
        if end > len(body):
            raise ProtocolError(f"watermarks answer: entry {i} of {count} is cut short")
        try:
            topic = body[pos + _U16.size:pos + _U16.size + n].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(f"watermarks answer: entry {i}'s topic is not UTF-8") from None
        problem = name_problem(topic)
        if problem:
            raise ProtocolError(f"watermarks answer: entry {i}'s topic {problem}")
        partition, hw = _ENTRY.unpack_from(body, pos + _U16.size + n)
        if partition < 0 or hw < -1:
            raise ProtocolError(f"watermarks answer: entry {i} ({topic}) has partition "
                                f"{partition}, watermark {hw}")
        entries.append((topic, partition, None if hw == -1 else hw))
        pos = end
    if pos != len(body):
        raise ProtocolError(f"watermarks answer: {len(body) - pos} bytes after its "
                            f"{count} entries")
    return version, entries
