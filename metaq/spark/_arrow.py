"""Raw Metaq log bytes to Arrow columns, fast.

Two steps per fetched chunk:

1. :func:`walk` finds where each complete message starts.  This is the only
   per-message Python loop (one ``unpack_from`` and one ``append`` a message,
   plus a CRC32 when checksums are verified); it never builds Python objects
   for the messages.
2. :func:`chunk_to_batch` turns the chunk and those positions into a
   :class:`pyarrow.RecordBatch` with vectorised Arrow kernels: the header
   fields are sliced out of a "one record per element" binary view of the
   chunk and byte-swapped, the bodies are cut with ``binary_slice`` (or, when
   some messages carry an attribute, gathered as spans).  Every output column
   is a fresh Arrow buffer, so the chunk's memory may be reused afterwards.

Imports only pyarrow (no pyspark): the schema here is checked against
Spark's ``to_arrow_schema`` by the tests.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from metaq._errors import MessageError
from metaq.protocol import (
    CRC32_IMPL,
    FLAG_HAS_ATTRIBUTE,
    HEADER_SIZE,
    INT32_MAX,
    MAX_PAYLOAD_SIZE,
    SPEEDUPS_IN_USE,
    crc32,
    scan,
)

__all__ = ["CRC32_IMPL", "Walk", "WalkHint", "walk", "arrow_schema", "chunk_to_batch", "CODECS",
           "DECODED_COLUMN"]

#: The extra column a ``codec`` option adds, and the codecs it accepts.
DECODED_COLUMN = "decoded"
CODECS = ("str", "msgpack")

_BIG = INT32_MAX
_len_of = struct.Struct(">i").unpack_from
_crc32 = crc32  # ISA-L's when installed (chosen in metaq.protocol._fast)


# Scalars are always typed: letting pyarrow infer a Python value's type costs a
# failed ``import dateutil`` on every call when dateutil is not installed.
def _i32(value: int) -> pa.Scalar:
    return pa.scalar(value, pa.int32())


def _i64(value: int) -> pa.Scalar:
    return pa.scalar(value, pa.int64())


_ZERO, _ONE = _i32(0), _i32(1)
_U8_ZERO = pa.scalar(0, pa.uint8())
_U8_ATTR = pa.scalar(FLAG_HAS_ATTRIBUTE, pa.uint8())


@dataclass(frozen=True, slots=True)
class Walk:
    """Where the complete messages of a chunk are.

    ``bounds`` (int32) holds the start of every complete, valid message
    followed by ``stop``, the end of the last one, all relative to the chunk;
    ``problem`` is ``None`` when what follows ``stop`` is only a message cut
    short by the fetch size, else what is wrong with the bytes at ``stop``.
    """

    bounds: pa.Array
    stop: int
    problem: str | None
    #: ``bounds`` as int64.
    positions: pa.Array

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


class WalkHint:
    """What :func:`walk` learnt about a partition's message sizes, kept from one
    chunk to the next: how many messages to step through in Python between two
    attempts at a vectorised leap, and how far the last leap reached."""

    __slots__ = ("stretch", "window")

    def __init__(self) -> None:
        self.stretch = _MIN_STRETCH
        self.window = _MIN_WINDOW


_MIN_STRETCH, _MAX_STRETCH = 32, 8192
_MIN_WINDOW, _MAX_WINDOW = 64, 1 << 16
_IOTA = pa.array(range(_MAX_WINDOW + 1), pa.int32())
_IOTA64 = _IOTA.cast(pa.int64())


def _leap(data: pa.Buffer, pos: int, size: int, end: int, window: int) -> int:
    """How many messages of exactly ``size`` bytes follow each other from
    ``pos`` (at most ``window``, all within ``end``).

    Exact, not a guess: the candidates are ``pos + i*size``; if the length
    field at each of the first ``m`` candidates says ``size``, then by
    induction the messages really start there (the first does, and each one
    that does and has that length puts the next at the next candidate).
    """
    k = min((end - pos) // size, window)
    if k < 2:
        return k
    starts = pc.add(pc.multiply(_IOTA[:k + 1], _i32(size)), _i32(pos))
    heads = pc.binary_slice(
        pa.Array.from_buffers(pa.binary(), k, [None, starts.buffers()[1], data]), 0, 4)
    # the 4 length bytes of each candidate, read as a native int32, against the
    # same bytes of the expected length
    native = pa.Array.from_buffers(pa.int32(), k, [None, heads.buffers()[2]])
    expected = int.from_bytes((size - HEADER_SIZE).to_bytes(4, "big"), sys.byteorder,
                              signed=True)
    first_other = pc.index(pc.equal(native, _i32(expected)), False).as_py()
    return k if first_other < 0 else first_other


def walk(buf: memoryview, *, verify: bool = True, max_payload: int = MAX_PAYLOAD_SIZE,
         hint: WalkHint | None = None) -> Walk:
    """Find the complete messages at the start of ``buf`` (a chunk of a log).

    With the C speedups this is one ``scan`` call that walks and verifies every
    message (:func:`_walk_scan`).  Without them, stretches of messages of one size
    are confirmed with vectorised leaps (:func:`_leap`); elsewhere a plain
    Python loop steps from header to header (:func:`_walk_leaping`).  ``hint``
    carries what worked from one chunk to the next.
    """
    return _walk(buf, verify, max_payload, hint)


#: problem texts of :func:`walk` by ``scan``'s ``kind``
_PROBLEMS = ("", "impossible message length {0}",
             "checksum mismatch (header says {0}, payload has {1})")


def _walk_scan(buf: memoryview, verify: bool, max_payload: int,
               hint: WalkHint | None) -> Walk:
    raw, count, stop, kind, a, b = scan(buf, verify, max_payload)
    bounds = pa.Array.from_buffers(pa.int32(), count + 1, [None, pa.py_buffer(raw)])
    return Walk(bounds, stop, _PROBLEMS[kind].format(a, b) if kind else None,
                bounds.cast(pa.int64()))


def _walk_leaping(buf: memoryview, verify: bool, max_payload: int,
                  hint: WalkHint | None) -> Walk:
    """:func:`walk` without C.  Not the Python twin of ``scan`` (which steps through
    every header and checks each checksum in turn): runs of equal-sized messages
    are confirmed by :func:`_leap`'s Arrow kernels, checksums by
    :func:`_first_bad_checksum`'s, and only the rest is stepped through here."""
    hint = hint or WalkHint()
    end = len(buf)
    lim = end - HEADER_SIZE
    data = pa.py_buffer(buf)
    pieces: list[pa.Array] = []
    found: list[int] = []
    app = found.append
    unpack = _len_of
    pos = 0
    budget = end // HEADER_SIZE + 1  # garbage lengths can send pos backwards: bounded
    stepped = False  # any message found by the Python loop (not by a leap)
    while 0 <= pos <= lim and budget > 0:
        length = unpack(buf, pos)[0]
        if 0 <= length <= max_payload:
            size = HEADER_SIZE + length
            got = _leap(data, pos, size, end, hint.window)
            if got >= _MIN_STRETCH:
                if found:
                    pieces.append(pa.array(found, pa.int64()))
                    found = []
                    app = found.append
                run = pc.multiply(_IOTA64[:got], _i64(size))
                pieces.append(pc.add(run, _i64(pos)))
                pos += got * size
                budget -= got
                if got == hint.window:
                    hint.window = min(hint.window * 2, _MAX_WINDOW)
                hint.stretch = _MIN_STRETCH
                continue
            hint.stretch = min(hint.stretch * 2, _MAX_STRETCH)
        stepped = True
        try:
            for _ in range(min(hint.stretch, budget)):
                if pos > lim:
                    break
                app(pos)
                pos += HEADER_SIZE + unpack(buf, pos)[0]
        except struct.error:  # a garbage length sent pos below 0: caught below
            break
        budget -= hint.stretch
    app(pos)
    pieces.append(pa.array(found, pa.int64()))
    bounds = pa.concat_arrays(pieces) if len(pieces) > 1 else pieces[0]
    if not stepped:  # leaps only: every message is complete and its length checked
        positions = bounds
        bounds = positions.cast(pa.int32())
        if verify and len(bounds) > 1:
            return _verified(buf, bounds, positions, None)
        return Walk(bounds, pos, None, positions)
    sizes = pc.subtract(bounds[1:], bounds[:-1])
    bad = pc.or_(pc.less(sizes, _i64(HEADER_SIZE)),
                 pc.greater(sizes, _i64(HEADER_SIZE + max_payload)))
    problem = None
    first_bad = pc.index(bad, True).as_py()
    last = found[-1]
    if first_bad >= 0:
        count = first_bad
        length = _len_of(buf, bounds[count].as_py())[0]
        problem = f"impossible message length {length}"
    elif last > end:
        count = len(bounds) - 2  # the last one is cut short
    else:
        count = len(bounds) - 1
    positions = bounds[:count + 1]
    bounds = positions.cast(pa.int32())
    if verify and count:
        return _verified(buf, bounds, positions, problem)
    return Walk(bounds, positions[count].as_py(), problem, positions)


def _verified(buf: memoryview, bounds: pa.Array, positions: pa.Array,
              problem: str | None) -> Walk:
    """The walk cut at the first message whose checksum does not match."""
    count = len(bounds) - 1
    bad_at = _first_bad_checksum(buf, bounds)
    if bad_at is not None:
        at, stored, actual = bad_at
        count = at
        bounds, positions = bounds[:count + 1], positions[:count + 1]
        problem = f"checksum mismatch (header says {stored}, payload has {actual})"
    return Walk(bounds, positions[count].as_py(), problem, positions)


#: How :func:`walk` walks, chosen once: the C ``scan`` when it is bound (one call);
#: else the leaps, a different algorithm (see :func:`_walk_leaping`), kept because it
#: beats ``scan``'s Python twin (which would give the same walk): on 8000 messages of
#: 100 B, 20 against 195 ns a message unverified, 190 against 355 verified; of 50 to
#: 150 B, 150 against 195 and 275 against 375.
_walk = _walk_scan if SPEEDUPS_IN_USE else _walk_leaping


def _records(buf: pa.Buffer, bounds: pa.Array) -> pa.Array:
    """One binary element per message (header included) over ``buf``."""
    if bounds.offset:
        bounds = pa.concat_arrays([bounds])  # a fresh buffer starting at element 0
    return pa.Array.from_buffers(pa.binary(), len(bounds) - 1, [None, bounds.buffers()[1], buf])


def _first_bad_checksum(buf: memoryview, bounds: pa.Array) -> tuple[int, int, int] | None:
    rec = _records(pa.py_buffer(buf), bounds)
    payloads = pc.binary_slice(rec, HEADER_SIZE, _BIG).to_pylist()
    actual = pa.array(list(map(_crc32, payloads)), pa.int64())
    actual = pc.bit_wise_and(actual, _i64(INT32_MAX))
    stored = _be(rec, 4, 8, pa.int32()).cast(pa.int64())
    at = pc.index(pc.not_equal(actual, stored), True).as_py()
    if at < 0:
        return None
    return at, stored[at].as_py(), actual[at].as_py()


def arrow_schema(codec: str | None = None) -> pa.Schema:
    """The Arrow schema of the batches, equal to Spark's ``to_arrow_schema`` of
    :func:`metaq.spark._source.spark_schema` (INT is int32, BINARY is binary)."""
    fields = [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.string(), nullable=False),
        pa.field("broker_id", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("next_offset", pa.int64(), nullable=False),
        pa.field("msg_id", pa.int64(), nullable=False),
        pa.field("attribute", pa.string(), nullable=True),
        pa.field("value", pa.binary(), nullable=False),
    ]
    if codec is not None:
        fields.append(pa.field(DECODED_COLUMN, pa.string(), nullable=True))
    return pa.schema(fields)


def _be(rec: pa.Array, lo: int, hi: int, typ: pa.DataType) -> pa.Array:
    """The big-endian integer at bytes ``lo..hi`` (``lo >= 1``) of every element
    of ``rec`` (each element at least ``hi`` bytes long): the bytes are sliced
    out in reverse order, which is the little-endian integer."""
    raw = pc.binary_slice(rec, hi - 1, lo - 1, -1)
    return pa.Array.from_buffers(typ, len(rec), [None, raw.buffers()[2]], offset=0)


def _spans(data: pa.Buffer, starts: pa.Array, sizes: pa.Array) -> pa.Array:
    """Binary array of ``data[starts[i]:starts[i]+sizes[i]]``; the spans must be
    in increasing order and not overlap (int32 ``starts`` and ``sizes``)."""
    n = len(starts)
    if n == 0:
        return pa.array([], pa.binary())
    ends = pc.add(starts, sizes)
    both = pa.concat_arrays([starts, ends])
    # interleave: [s0, e0, s1, e1, ...] = both.take([0, n, 1, n+1, ...])
    k = pc.subtract(pc.cumulative_sum(pa.repeat(_ONE, 2 * n)), _ONE)
    idx = pc.add(pc.shift_right(k, _ONE), pc.multiply(pc.bit_wise_and(k, _ONE), _i32(n)))
    bounds = pc.take(both, idx)
    # 2n offsets describe 2n-1 elements: the spans (even) and the gaps between them (odd)
    every = pa.Array.from_buffers(pa.binary(), 2 * n - 1, [None, bounds.buffers()[1], data])
    even = pc.equal(pc.bit_wise_and(k[:2 * n - 1], _ONE), _ZERO)
    return pc.filter(every, even)


class Where:
    """The partition a chunk came from: its constant columns (cached, so a run of
    chunks reuses them) and the names used in errors."""

    __slots__ = ("topic", "partition", "broker_id", "_consts")

    def __init__(self, *, topic: str, partition: str, broker_id: int) -> None:
        self.topic = topic
        self.partition = partition
        self.broker_id = broker_id
        self._consts: list[pa.Array] = []

    def constant_columns(self, n: int) -> list[pa.Array]:
        """``topic``, ``partition`` and ``broker_id`` repeated ``n`` times."""
        if not self._consts or len(self._consts[0]) < n:
            size = max(n, 2 * len(self._consts[0]) if self._consts else n)
            self._consts = [pa.repeat(pa.scalar(self.topic, pa.string()), size),
                            pa.repeat(pa.scalar(self.partition, pa.string()), size),
                            pa.repeat(pa.scalar(self.broker_id, pa.int32()), size)]
        return [c.slice(0, n) for c in self._consts]


def _decode(value: pa.Array, codec: str, where: Where, offsets: pa.Array) -> pa.Array:
    if codec == "str":
        try:
            return value.cast(pa.string())
        except pa.ArrowInvalid:
            for i, v in enumerate(value.to_pylist()):
                try:
                    v.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise MessageError(
                        f"codec 'str': the body of the message at offset {offsets[i]} of "
                        f"{where.topic} {where.partition} is not UTF-8 ({e.reason} at byte "
                        f"{e.start})") from None
            raise
    from metaq.protocol import get_codec

    decode = get_codec("msgpack").decode
    out = []
    for i, v in enumerate(value.to_pylist()):
        try:
            out.append(json.dumps(decode(v), default=_json_default, ensure_ascii=False))
        except (MessageError, ValueError, TypeError) as e:
            raise MessageError(
                f"codec 'msgpack': the body of the message at offset {offsets[i]} of "
                f"{where.topic} {where.partition} cannot be decoded: {e}") from None
    return pa.array(out, pa.string())


def _json_default(value: object) -> object:
    if isinstance(value, bytes | bytearray | memoryview):
        import base64

        return base64.b64encode(bytes(value)).decode("ascii")
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def chunk_to_batch(data: memoryview, found: Walk, base: int, where: Where,
                   schema: pa.Schema, codec: str | None = None) -> pa.RecordBatch:
    """The messages ``found`` in ``data`` (absolute offset of ``data[0]`` is
    ``base``) as a record batch of ``schema`` (see :func:`arrow_schema`)."""
    n = found.count
    buf = pa.py_buffer(data)
    starts = found.bounds
    rec = _records(buf, starts)
    pos64 = pc.add(found.positions, _i64(base))
    offsets, next_offsets = pos64[:n], pos64[1:]
    msg_id = _be(rec, 8, 16, pa.int64())
    # flag bit 0 (has attribute) is the low bit of the flag's last byte
    low = pc.binary_slice(rec, HEADER_SIZE - 1, HEADER_SIZE)
    attr_bits = pc.bit_wise_and(
        pa.Array.from_buffers(pa.uint8(), n, [None, low.buffers()[2]]), _U8_ATTR)
    if n and pc.max(attr_bits).as_py():
        has_attr = pc.not_equal(attr_bits, _U8_ZERO)
        attribute, value = _with_attributes(buf, rec, starts, has_attr, offsets, where)
    else:
        attribute = pa.nulls(n, pa.string())
        value = pc.binary_slice(rec, HEADER_SIZE, _BIG)
    columns = [*where.constant_columns(n), offsets, next_offsets, msg_id, attribute, value]
    if codec is not None:
        columns.append(_decode(value, codec, where, offsets))
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def _with_attributes(buf: pa.Buffer, rec: pa.Array, starts: pa.Array, has_attr: pa.Array,
                     offsets: pa.Array, where: Where) -> tuple[pa.Array, pa.Array]:
    """(attribute, value) when some messages have flag bit 0 set: the payload is
    ``int32 attrLen, UTF-8 attribute, body``."""
    n = len(rec)
    lengths = pc.binary_length(rec)
    which = pc.indices_nonzero(has_attr)
    sub = pc.take(rec, which)
    short = pc.less(pc.take(lengths, which), _i32(HEADER_SIZE + 4))
    if pc.any(short).as_py():
        i = which[pc.index(short, True).as_py()].as_py()
        raise MessageError(f"message at offset {offsets[i]} of {where.topic} {where.partition} "
                           f"has the attribute flag but a payload under 4 bytes")
    alen = _be(sub, HEADER_SIZE, HEADER_SIZE + 4, pa.int32())
    room = pc.subtract(pc.take(lengths, which), _i32(HEADER_SIZE + 4))
    bad = pc.or_(pc.less(alen, _ZERO), pc.greater(alen, room))
    if pc.any(bad).as_py():
        j = pc.index(bad, True).as_py()
        i = which[j].as_py()
        raise MessageError(f"message at offset {offsets[i]} of {where.topic} {where.partition} "
                           f"has a bad attribute length {alen[j]} for a payload of "
                           f"{room[j].as_py() + 4} bytes")
    rel = starts[:n]
    attr_starts = pc.add(pc.take(rel, which), _i32(HEADER_SIZE + 4))
    raw_attr = _spans(buf, attr_starts, alen)
    try:
        attr_text = raw_attr.cast(pa.string())
    except pa.ArrowInvalid:
        raise MessageError(f"a message attribute in {where.topic} {where.partition} (offsets "
                           f"{offsets[0]}..{offsets[n - 1]}) is not valid UTF-8") from None
    attribute = pc.replace_with_mask(pa.nulls(n, pa.string()), has_attr, attr_text)
    skip = pc.replace_with_mask(pa.repeat(_ZERO, n), has_attr, pc.add(alen, _i32(4)))
    value_start = pc.add(pc.add(rel, _i32(HEADER_SIZE)), skip)
    value_size = pc.subtract(starts[1:], value_start)
    return attribute, _spans(buf, value_start, value_size)
