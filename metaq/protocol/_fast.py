"""The per-message work, C or Python, chosen once: the only place that knows.

Each function below is bound at import to its C implementation (the optional
extension ``_speedups``) when that is built and switched on, else to its pure-Python
twin written next to it; callers import the name from :mod:`metaq.protocol` and
never ask which one they got.  :data:`SPEEDUPS_STATUS` says which, and why.

``metaq/protocol/_speedups.c`` does the consumer's per-message work (walk the headers,
verify CRC32s, build messages, call the listener) in C.  It is built by
``pip install`` when a C compiler and the Python headers are there; without
them the install goes on with a warning and every name here is bound to its
twin (``py_<name>``), which takes the same arguments and gives the same results
and exceptions (``tests/protocol/test_speedups.py`` fuzzes each pair against each other).

``METAQ_NO_SPEEDUPS=1`` in the environment binds the twins, for comparisons
(``METAQ_NO_AVX512=1`` keeps the C code but folds CRC32s 128 bits at a time,
``METAQ_NO_CLMUL=1`` uses its lookup tables).  ``metaq --version`` prints
:data:`SPEEDUPS_STATUS`.

This module imports nothing of metaq but the constants (``_message`` imports it,
not the other way round).
"""

from __future__ import annotations

import importlib
import os
import re
import struct
from array import array
from collections.abc import Callable, Mapping, Sequence
from itertools import count, repeat
from operator import itemgetter
from types import ModuleType
from typing import Any

from metaq.protocol._constants import (
    CHECKSUM_MASK,
    HEADER_SIZE,
    INT32_MAX,
    INT32_MIN,
    MAX_PAYLOAD,
)

__all__ = [
    "speedups", "SPEEDUPS_STATUS", "SPEEDUPS_IN_USE", "EXPECTED_VERSION",
    # reading side
    "crc32", "CRC32_IMPL", "scan", "take", "deliver", "prepare", "PartitionReader",
    "slot_fields", "py_slot_fields",
    "ST_END", "ST_LIMIT", "ST_BAD", "ST_LATER", "ST_ERROR",
    "py_crc32", "py_scan", "py_take", "py_deliver", "py_prepare", "c_prepare",
    # producer side
    "encode_puts", "py_encode_puts", "c_encode_puts",
    "encode_tx_puts", "py_encode_tx_puts", "c_encode_tx_puts",
    "put_request", "py_put_request", "untrack", "py_untrack", "track", "py_track",
    "complete_acks", "py_complete_acks", "ack_result", "py_ack_result", "put_ack",
    "py_put_ack", "put_round_trip", "py_put_round_trip", "submit_put",
    "take_acks", "bind_send_async", "bind_send_result",
    "tx_acks", "py_tx_acks", "tx_answers", "py_tx_answers",
    # broker side
    "fast_puts", "py_fast_puts", "get_line", "py_get_line",
]

#: The ``VERSION`` the Python side was written against; a stale build (an older
#: ``.so`` left next to newer sources) is ignored rather than misused.
EXPECTED_VERSION = 7


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("METAQ_NO_SPEEDUPS", "").strip() not in ("", "0"):
        return None, "off (METAQ_NO_SPEEDUPS is set)"
    try:
        _speedups = importlib.import_module("metaq.protocol._speedups")
    except ImportError as e:
        return None, f"not built ({e}); pure Python in use"
    if getattr(_speedups, "VERSION", None) != EXPECTED_VERSION:
        return None, (f"stale build (VERSION {getattr(_speedups, 'VERSION', None)}, "
                      f"want {EXPECTED_VERSION}): reinstall metaq-py")
    crc = ("AVX-512 carry-less multiply" if _speedups.VCLMUL else
           "carry-less multiply" if _speedups.CLMUL else "tables")
    return _speedups, f"in use (CRC32 by {crc})"


speedups, SPEEDUPS_STATUS = _load()
#: The C implementations are bound (for the rare caller whose Python path is a
#: different algorithm, not a twin: the Spark source's vectorised Arrow walk).
SPEEDUPS_IN_USE = speedups is not None


# ----------------------------------------------------------------------------------
# Reading side (consumer, Spark, tools): crc32, scan, take, deliver.
# ----------------------------------------------------------------------------------

#: Why ``take``/``deliver`` stopped (the C module's ``END``, ``LIMIT``, ...):
#: no further whole message (the data is used up or the next message is cut
#: short); ``limit`` messages or ``max_bytes`` taken; an impossible length or a
#: checksum mismatch at ``pos``; the listener returned ``later`` for the message at
#: ``pos``; the listener raised.
ST_END, ST_LIMIT, ST_BAD, ST_LATER, ST_ERROR = 0, 1, 2, 3, 4

#: length (read unsigned: a negative one is just too long), checksum, msgId, flag
_HEADER = struct.Struct(">Iiqi")
_unpack_header = _HEADER.unpack_from
_unpack_length = struct.Struct(">I").unpack_from
_struct_error = struct.error

# crc32(data, value=0) -> int: zlib's CRC-32 of any bytes-like ``data``.
#
# ISA-L's (a dependency) is preferred even to the extension's: both are C, but
# ISA-L's call is cheaper (57 against 108 ns on 100 bytes, the same from 10 KB);
# the extension's beats zlib's from about 20 bytes.  (The extension's walks below
# check CRC32s inside C, with its own.)
try:
    from isal.isal_zlib import crc32 as py_crc32

    _PY_CRC32 = "isal"
except ImportError:  # pragma: no cover - isal is a dependency; kept for odd platforms
    from zlib import crc32 as py_crc32

    _PY_CRC32 = "zlib"

crc32: Callable[..., int]
if speedups is not None and _PY_CRC32 == "zlib":  # pragma: no cover - see above
    crc32, CRC32_IMPL = speedups.crc32, "speedups"
else:
    crc32, CRC32_IMPL = py_crc32, _PY_CRC32


def py_scan(data: Any, verify: bool = True, max_payload: int = INT32_MAX,
            bounds: bool = True) -> tuple[bytes | None, int, int, int, int, int]:
    """scan(data, verify=True, max_payload=2**31-1, bounds=True)
    -> (bounds, count, stop, kind, a, b).

    Walk the whole messages at the start of ``data``.  ``bounds``: native int32
    start of each, then ``stop`` (the end of the last); None when not asked for.
    ``kind`` 0: what follows ``stop`` is empty or cut short; 1: impossible length
    ``a``; 2: checksum mismatch (``a`` stored, ``b`` actual).  (The C one releases
    the GIL.)
    """
    mv = memoryview(data)
    if mv.itemsize != 1 or mv.ndim != 1:
        mv = mv.cast("B")
    n = len(mv)
    if n > INT32_MAX:
        raise ValueError("scan: data longer than 2 GiB")
    cap = min(max_payload, INT32_MAX)
    unpack, crc = _unpack_header, crc32
    starts: list[int] = []
    add = starts.append
    pos = kind = a = b = 0
    while n - pos >= HEADER_SIZE:
        length, check, _msg_id, _flag = unpack(mv, pos)
        if length > cap:
            kind, a = 1, length - (length >> 31 << 32)  # as the signed int32 it is
            break
        end = pos + HEADER_SIZE + length
        if end > n:
            break
        if verify:
            actual = crc(mv[pos + HEADER_SIZE:end]) & CHECKSUM_MASK
            if actual != check:
                kind, a, b = 2, check, actual
                break
        add(pos)
        pos = end
    found = len(starts)
    if not bounds:
        return None, found, pos, kind, a, b
    add(pos)
    return array("i", starts).tobytes(), found, pos, kind, a, b


#: message classes take/deliver were given and found fit (see _check_classes)
_FIT: set[type] = set()


def _check_classes(plain: Any, attr: Any) -> None:
    """What the C functions check of the message classes: they build a message by
    filling a tuple of 8 items, so each must be a tuple subclass without fields."""
    for cls, name in ((plain, "plain"), (attr, "attr")):
        if cls not in _FIT:
            if not (isinstance(cls, type) and issubclass(cls, tuple)
                    and cls.__basicsize__ == tuple.__basicsize__
                    and cls.__itemsize__ == tuple.__itemsize__):
                raise TypeError(f"{name} must be a tuple subclass without instance fields")
            _FIT.add(cls)


def _as_bytes(data: Any) -> bytes:
    """Slicing bytes is the cheapest way to the bodies: one copy of any other buffer."""
    return data if type(data) is bytes else memoryview(data).tobytes()


def py_take(data: Any, pos: int, base: int, limit: int, max_bytes: int, verify: bool,
            max_payload: int, topic: str, partition: str, codec: Any, plain: type,
            attr: type) -> tuple[list[Any], int, int]:
    """take(data, pos, base, limit, max_bytes, verify, max_payload, topic, partition,
    codec, plain, attr) -> (messages, pos, status).

    Up to ``limit`` messages from ``pos``, and no more once they span ``max_bytes``
    (at least one); ``status`` is ST_LIMIT, or ST_END already when nothing whole
    follows, or ST_END / ST_BAD when the walk stopped there.  A message is
    ``cls((topic, partition, base + pos, base + end, msg_id, flag, payload, codec))``,
    ``cls`` being ``attr`` when flag bit 0 is set, else ``plain``.
    """
    data = _as_bytes(data)
    _check_classes(plain, attr)
    n = len(data)
    if pos < 0 or pos > n:
        raise ValueError("take: pos outside the data")
    cap = min(max_payload, INT32_MAX)
    unpack, crc, struct_error = _unpack_header, crc32, _struct_error
    messages: list[Any] = []
    add = messages.append
    stop_at = pos + max_bytes
    status = ST_LIMIT
    # the hot loop of a batch listener without C: everything a local, one call a message
    for _ in repeat(None, limit if max_bytes > 0 else 0):
        try:
            length, check, msg_id, flag = unpack(data, pos)
        except struct_error:  # less than a header left
            status = ST_END
            break
        if length > cap:
            status = ST_BAD
            break
        end = pos + HEADER_SIZE + length
        if end > n:
            status = ST_END
            break
        payload = data[pos + HEADER_SIZE:end]
        if verify and crc(payload) & CHECKSUM_MASK != check:
            status = ST_BAD
            break
        add((plain if not flag else attr if flag & 1 else plain)(
            (topic, partition, base + pos, base + end, msg_id, flag, payload, codec)))
        pos = end
        if pos >= stop_at:
            break
    if status == ST_LIMIT:  # say END now rather than on the next call
        if n - pos < HEADER_SIZE:
            status = ST_END
        else:
            length = _unpack_length(data, pos)[0]
            if length <= cap and pos + HEADER_SIZE + length > n:
                status = ST_END
    return messages, pos, status


def py_deliver(data: Any, pos: int, base: int, verify: bool, max_payload: int, topic: str,
               partition: str, codec: Any, plain: type, attr: type,
               listener: Callable[[Any], Any], later: Any
               ) -> tuple[int, int, int, Any, Any, BaseException | None]:
    """deliver(data, pos, base, verify, max_payload, topic, partition, codec, plain, attr,
    listener, later) -> (status, pos, count, last, failed, exc).

    Call ``listener(m)`` for each message from ``pos`` (built as by :func:`py_take`)
    until the data ends (ST_END), a bad message (ST_BAD), a ``later`` (ST_LATER) or
    an Exception (ST_ERROR, ``exc``; a BaseException propagates).  ``pos`` is where
    the walk stopped (the failed message's start), ``count`` how many messages the
    listener took, ``last`` the last of them, ``failed`` the message it refused.
    """
    data = _as_bytes(data)
    _check_classes(plain, attr)
    n = len(data)
    if pos < 0 or pos > n:
        raise ValueError("deliver: pos outside the data")
    cap = min(max_payload, INT32_MAX)
    unpack, crc, struct_error = _unpack_header, crc32, _struct_error
    last = None
    # the consumer's hot loop without C: everything a local, a message built in one
    # call; ``i``, the number of messages taken, is counted by itertools.count
    for i in count():
        try:
            length, check, msg_id, flag = unpack(data, pos)
        except struct_error:  # less than a header left
            return ST_END, pos, i, last, None, None
        if length > cap:
            return ST_BAD, pos, i, last, None, None
        end = pos + HEADER_SIZE + length
        if end > n:
            return ST_END, pos, i, last, None, None
        payload = data[pos + HEADER_SIZE:end]
        if verify and crc(payload) & CHECKSUM_MASK != check:
            return ST_BAD, pos, i, last, None, None
        m = (plain if not flag else attr if flag & 1 else plain)(
            (topic, partition, base + pos, base + end, msg_id, flag, payload, codec))
        try:
            if listener(m) is later:
                return ST_LATER, pos, i, last, m, None
        except Exception as exc:  # noqa: BLE001 - handed back, as by the C one
            return ST_ERROR, pos, i, last, m, exc
        last = m
        pos = end
    raise AssertionError("unreachable: count() has no end")


def c_prepare(data: Any, verify: bool, max_payload: int, scan_first: int) -> tuple[Any, bool]:
    """prepare with C: a reply longer than ``scan_first`` bytes has its checksums
    checked first, in one C pass without the GIL (other threads run meanwhile), and
    the messages are then built from its verified prefix, unverified."""
    if verify and len(data) > scan_first:
        stop = scan(data, True, max_payload, False)[2]
        if stop:
            return memoryview(data)[:stop], False
    return data, verify


def py_prepare(data: Any, verify: bool, max_payload: int, scan_first: int
               ) -> tuple[Any, bool]:
    """prepare(data, verify, max_payload, scan_first) -> (data, verify): what
    :func:`take`/:func:`deliver` read a batch from, and whether they still must
    verify it.  In Python: the batch as bytes (a view is copied once, since slicing
    bytes is the cheapest way to the bodies); there is no GIL to release."""
    return _as_bytes(data), verify


scan: Callable[..., tuple[bytes | None, int, int, int, int, int]]
take: Callable[..., tuple[list[Any], int, int]]
deliver: Callable[..., tuple[int, int, int, Any, Any, BaseException | None]]
prepare: Callable[[Any, bool, int, int], tuple[Any, bool]]
if speedups is not None:
    scan, take, deliver, prepare = speedups.scan, speedups.take, speedups.deliver, c_prepare
else:
    scan, take, deliver, prepare = py_scan, py_take, py_deliver, py_prepare


class PartitionReader:
    """One partition's messages read by the bound :func:`take` and :func:`deliver`:
    what they are built with (topic, partition, codec, its two message classes), and
    the largest payload length believed, set once; a call a batch or a slice, never
    a message.

    The bound functions are looked up when called (a test may rebind them here).
    """

    __slots__ = ("topic", "partition", "codec", "plain", "attr", "max_payload")

    def __init__(self, topic: str, partition: str, codec: Any, plain: type, attr: type,
                 max_payload: int = MAX_PAYLOAD) -> None:
        self.topic = topic
        self.partition = partition
        self.codec = codec
        self.plain = plain
        self.attr = attr
        self.max_payload = max_payload

    def prepare(self, data: Any, verify: bool, scan_first: int) -> tuple[Any, bool]:
        """``(data, verify)`` to read a batch with (see :func:`py_prepare`)."""
        return prepare(data, verify, self.max_payload, scan_first)

    def take(self, data: Any, pos: int, base: int, limit: int, max_bytes: int,
             verify: bool) -> tuple[list[Any], int, int]:
        """``(messages, pos, status)``: see :func:`py_take`."""
        return take(data, pos, base, limit, max_bytes, verify, self.max_payload, self.topic,
                    self.partition, self.codec, self.plain, self.attr)

    def deliver(self, data: Any, pos: int, base: int, verify: bool,
                listener: Callable[[Any], Any], later: Any
                ) -> tuple[int, int, int, Any, Any, BaseException | None]:
        """``(status, pos, count, last, failed, exc)``: see :func:`py_deliver`."""
        return deliver(data, pos, base, verify, self.max_payload, self.topic,
                       self.partition, self.codec, self.plain, self.attr, listener, later)


def py_slot_fields(cls: type, size: int, fields: tuple[tuple[str, int, str], ...]) -> None:
    """slot_fields(cls, size, fields): make each ``(name, index, doc)`` of ``fields`` a
    read-only attribute of ``cls`` (a tuple subclass whose instances all have ``size``
    items) giving item ``index``.  Here a ``property(itemgetter(index))``; the C one
    a member descriptor reading the item in place (one load for the interpreter)."""
    _check_fields(cls, size, fields)
    for name, index, doc in fields:
        setattr(cls, name, property(itemgetter(index), doc=doc))


def _check_fields(cls: type, size: int, fields: Any) -> None:
    """What both slot_fields check (the C one with the same messages)."""
    if not (isinstance(cls, type) and issubclass(cls, tuple)
            and cls.__basicsize__ == tuple.__basicsize__
            and cls.__itemsize__ == tuple.__itemsize__):
        raise TypeError("cls must be a tuple subclass without instance fields")
    if not isinstance(fields, tuple) or not all(
            isinstance(f, tuple) and len(f) == 3 and isinstance(f[0], str)
            and type(f[1]) is int and isinstance(f[2], str) for f in fields):
        raise TypeError("slot_fields: fields must be (name: str, index: int, doc: str) tuples")
    for name, index, _doc in fields:
        if not 0 <= index < size:
            raise ValueError(f"slot_fields: index {index} of {name!r} outside 0..{size - 1}")


def c_slot_fields(cls: type, size: int, fields: tuple[tuple[str, int, str], ...]) -> None:
    """slot_fields with C, after the same checks as its twin (errors alike)."""
    _check_fields(cls, size, fields)
    _c_slot_fields(cls, size, fields)


slot_fields: Callable[[type, int, tuple[tuple[str, int, str], ...]], None]
if speedups is not None:
    _c_slot_fields = speedups.slot_fields
    slot_fields = c_slot_fields
else:
    slot_fields = py_slot_fields


# ----------------------------------------------------------------------------------
# Producer side: encode_puts.
# ----------------------------------------------------------------------------------

def py_encode_puts(head: bytes, flag: int, payloads: list[Any], checksums: list[int],
                   opaques: list[int]) -> tuple[bytes, list[int]]:
    """encode_puts(head, flag, payloads, checksums, opaques) -> (data, sizes).

    The put requests of one partition as one bytes, and the size of each: one
    ``<head><len> <flag> <checksum> <opaque>\\r\\n<payload>`` per payload, ``head``
    being ``b"put <topic> <partition> "``.  Any bytes-like payloads, any sequences.
    """
    if not len(payloads) == len(checksums) == len(opaques):
        raise ValueError("encode_puts: lists of different lengths")
    fmt = head.replace(b"%", b"%%") + b"%d " + (b"%d" % flag) + b" %d %d\r\n%b"
    data = list(map(fmt.__mod__, zip(map(len, payloads), checksums, opaques, payloads,
                                     strict=True)))
    return b"".join(data), list(map(len, data))


def c_encode_puts(head: bytes, flag: int, payloads: list[Any], checksums: list[int],
                  opaques: list[int]) -> tuple[bytes, list[int]]:
    """encode_puts with C, which takes lists of bytes only: anything else (a
    ``bytearray`` payload, a tuple) goes to the Python formatting."""
    try:
        return _c_encode_puts(head, flag, payloads, checksums, opaques)
    except TypeError:
        return py_encode_puts(head, flag, payloads, checksums, opaques)


encode_puts: Callable[[bytes, int, list[Any], list[int], list[int]], tuple[bytes, list[int]]]
if speedups is not None:
    _c_encode_puts = speedups.encode_puts
    encode_puts = c_encode_puts
else:
    encode_puts = py_encode_puts


# ----------------------------------------------------------------------------------
# Producer side, transactions (issue 29): encode_tx_puts.
# ----------------------------------------------------------------------------------

def py_encode_tx_puts(head: bytes, flag: int, payloads: list[Any], checksums: list[int],
                      key: bytes, opaques: list[int]) -> bytes:
    """encode_tx_puts(head, flag, payloads, checksums, key, opaques) -> data.

    The put requests of one partition joining transaction ``key`` (its bytes) as one
    bytes: one ``<head><len> <flag> <checksum> <key> <opaque>\\r\\n<payload>`` per
    payload, ``head`` being ``b"put <topic> <partition> "``.
    """
    if not len(payloads) == len(checksums) == len(opaques):
        raise ValueError("encode_tx_puts: lists of different lengths")
    fmt = (head.replace(b"%", b"%%") + b"%d " + (b"%d" % flag) + b" %d "
           + key.replace(b"%", b"%%") + b" %d\r\n%b")
    return b"".join(map(fmt.__mod__, zip(map(len, payloads), checksums, opaques, payloads,
                                         strict=True)))


def c_encode_tx_puts(head: bytes, flag: int, payloads: list[Any], checksums: list[int],
                     key: bytes, opaques: list[int]) -> bytes:
    """encode_tx_puts with C, which takes lists of bytes and ints only: anything else
    goes to the Python formatting."""
    try:
        return _c_encode_tx_puts(head, flag, payloads, checksums, key, opaques)
    except TypeError:
        return py_encode_tx_puts(head, flag, payloads, checksums, key, opaques)


# Looked up by name, not by VERSION: an older build without it still serves the rest.
_c_encode_tx_puts = getattr(speedups, "encode_tx_puts", None)
encode_tx_puts: Callable[[bytes, int, list[Any], list[int], bytes, list[int]], bytes] = (
    py_encode_tx_puts if _c_encode_tx_puts is None else c_encode_tx_puts)


# ----------------------------------------------------------------------------------
# Producer side, per message (issue 29): put_request, untrack / track.
# ----------------------------------------------------------------------------------

def py_put_request(prefix: bytes, partition: int, payload: Any, flag: int, checksum: int,
                   opaque: int) -> bytes:
    """put_request(prefix, partition, payload, flag, checksum, opaque) -> bytes.

    One put request, ``prefix`` being ``b"put <topic> "``:
    ``<prefix><partition> <len> <flag> <checksum> <opaque>\\r\\n<payload>``."""
    return b"%b%d %d %d %d %d\r\n%b" % (prefix, partition, len(payload), flag, checksum,
                                          opaque, payload)


def py_untrack(obj: object) -> None:
    """untrack(obj): without the C module, objects stay in the cyclic collector's
    lists (the collector then costs time, results are the same)."""


def py_track(obj: object) -> None:
    """track(obj): the twin of :func:`py_untrack` (nothing to undo)."""


def py_complete_acks(requests: list[Any], msg_ids: list[bytes], partitions: list[bytes],
                     offsets: list[bytes], state: object) -> list[Any]:
    """complete_acks(requests, msg_ids, partitions, offsets, state) -> waited.

    The bulk completion of a producer's sends (``Send.on_acks``): each request's
    ``payload`` becomes ``b""``, its ``_ack_id`` / ``_ack_index`` / ``_ack_offset``
    the answer's columns, then its ``_state`` ``state`` (last: a waiter reads the
    state first); the requests whose ``_waited`` is true are returned, to be notified."""
    if not len(requests) == len(msg_ids) == len(partitions) == len(offsets):
        raise ValueError("complete_acks: lists of different lengths")
    waited = []
    for r, msg_id, index, offset in zip(requests, msg_ids, partitions, offsets, strict=True):
        r.payload = b""
        r._ack_id = msg_id
        r._ack_index = index
        r._ack_offset = offset
        r._state = state
        if r._waited:
            waited.append(r)
    return waited


def py_ack_result(cls: type, msg_id: bytes, index: bytes, offset: bytes, broker_id: int,
                  names: Mapping[int, str]) -> Any:
    """ack_result(cls, msg_id, index, offset, broker_id, names) -> a ``cls`` tuple.

    A producer's ``SendResult`` from the decimal bytes of a bulk acknowledgement:
    ``(int(msg_id), names[int(index)], int(offset), broker_id, int(index))``."""
    i = int(index)
    return tuple.__new__(cls, (int(msg_id), names[i], int(offset), broker_id, i))



# Issue 29 (transactions): a transaction's put answers to one partition, in bulk.
_TXA_HEAD = re.compile(rb"result 200 ([0-9]{1,9}) ([0-9]{1,10})\r\n")
#: what a head cut short may be: a prefix of ``result 200 ``, or it and more that fits
_TXA_PARTIAL = re.compile(rb"result 200 (?:[0-9]{1,9}(?: (?:[0-9]{1,10}\r?)?)?)?")
_TXA_BODY = re.compile(rb"([0-9]{1,18}) ")


def py_tx_acks(buf: Any, pos: int, end: int, opaques: list[int], cls: type, broker_id: int,
               index: int, name: str) -> tuple[list[Any], int] | bool | None:
    """tx_acks(buf, pos, end, opaques, cls, broker_id, index, name) -> (results, used),
    None or False.

    The answers to a transaction's puts to one partition, from ``buf[pos:end]``: one
    reply per opaque, each exactly ``result 200 <L> <O>\r\n<I> <index> -1`` (L 1-9
    digits, at most 40; O 1-10 digits equal to the opaque; the body exactly L bytes, I
    1-18 digits, the index as ``%d`` writes it).  All there: ``cls`` tuples
    ``(int(I), name, -1, broker_id, index)`` and the position after the last; None
    while ``buf`` ends where every byte so far fits that shape; False otherwise."""
    if not isinstance(opaques, list):
        raise TypeError("tx_acks: opaques must be a list")
    end = min(end, len(buf))
    if not 0 <= pos <= end:
        raise ValueError("tx_acks: pos out of range")
    data = bytes(buf[pos:end])
    tail = b" %d -1" % index
    out = []
    p = 0
    n = len(data)
    for opaque in opaques:
        m = _TXA_HEAD.match(data, p)
        if m is None:
            rest = data[p:]
            if len(rest) < 11:
                return None if b"result 200 ".startswith(rest) else False
            return None if _TXA_PARTIAL.fullmatch(rest) else False
        length = int(m.group(1))
        if length > 40 or int(m.group(2)) != opaque:
            return False
        p = m.end()
        if n - p < length:
            return None
        body = data[p:p + length]
        b = _TXA_BODY.match(body)
        if b is None or body[b.end() - 1:] != tail:
            return False
        out.append(tuple.__new__(cls, (int(b.group(1)), name, -1, broker_id, index)))
        p += length
    return out, pos + p

def py_tx_answers(opaques: Sequence[bytes], ids: Sequence[int], tail: bytes) -> bytes:
    """tx_answers(opaques, ids, tail) -> bytes: the broker's answers to a run of a
    transaction's puts, ``result 200 <len> <opaque>\r\n<msgId><tail>`` each (the body
    ``b"%d%b" % (msgId, tail)``), joined.  A msgId must fit in 64 bits."""
    if len(opaques) != len(ids):
        raise ValueError("tx_answers: opaques and ids of different lengths")
    if any(type(o) is not bytes for o in opaques):
        raise TypeError("tx_answers: an opaque is not bytes")
    out = []
    for opaque, msg_id in zip(opaques, ids, strict=True):
        if not -(1 << 63) <= msg_id < 1 << 63:
            raise OverflowError("tx_answers: a msgId over 64 bits")
        body = b"%d%b" % (msg_id, tail)
        out.append(b"result 200 %d %b\r\n%b" % (len(body), opaque, body))
    return b"".join(out)


# Issue 29 (sync send): one put's acknowledgement read whole by a blocking send.
_ACK1_HEAD = re.compile(rb"result 200 ([0-9]{1,9}) (-?[0-9]{1,10})\r\n")
_ACK1_BODY = re.compile(rb"(-?[0-9]{1,19}) ([0-9]{1,9}) (-?[0-9]{1,19})")


def py_put_ack(buf: bytes, opaque: int, cls: type, broker_id: int,
               names: Mapping[int, str]) -> Any:
    """put_ack(buf, opaque, cls, broker_id, names) -> a ``cls`` tuple, None or False.

    ``buf`` as exactly one successful put reply with this ``opaque`` (``result 200
    <len> <opaque>\\r\\n<msgId> <index> <offset>``, ``len`` at most 64):
    ``(int(msgId), names[index], int(offset), broker_id, index)``; None while it may
    still become one (no CRLF yet and under 64 bytes, or a body short of ``len``);
    False for anything else (another code or opaque, more than one reply, not a
    reply): the general parser's business."""
    if b"\r\n" not in buf:
        return None if len(buf) < 64 else False
    m = _ACK1_HEAD.match(buf)
    if m is None or int(m[2]) != opaque:
        return False
    n = int(m[1])
    start = m.end()
    have = len(buf) - start
    if n > 64 or have > n:
        return False
    if have < n:
        return None
    b = _ACK1_BODY.fullmatch(buf, start)
    if b is None:
        return False
    i = int(b[2])
    return tuple.__new__(cls, (int(b[1]), names[i], int(b[3]), broker_id, i))


def py_put_round_trip(sock: Any, send_lock: Any, data: bytes, opaque: int, cls: type,
                      broker_id: int, names: Mapping[int, str]) -> Any:
    """put_round_trip(sock, send_lock, data, opaque, cls, broker_id, names)
    -> a ``cls`` tuple, bytes or None.

    A blocking send's write and first read: ``sock.sendall(data)``, then
    ``send_lock.release()`` (always), then one blocking ``recv`` of up to 16 KiB
    (bounded by the socket's SO_RCVTIMEO): :func:`py_put_ack`'s tuple when that read
    is exactly the request's lone success, else the bytes read (``b""``: the peer
    closed), or None when the receive timeout passed with nothing read.  OSError
    for a failed send or recv."""
    try:
        sock.sendall(data)
    finally:
        send_lock.release()
    try:
        got = sock.recv(16384)
    except BlockingIOError:
        return None
    if got:
        r = put_ack(got, opaque, cls, broker_id, names)
        if r is not None and r is not False:
            return r
    return got


# Looked up by name, not by VERSION: an older build without them still serves the rest.
put_request: Callable[[bytes, int, Any, int, int, int], bytes] = getattr(
    speedups, "put_request", py_put_request)
untrack: Callable[[object], None] = getattr(speedups, "untrack", py_untrack)
track: Callable[[object], None] = getattr(speedups, "track", py_track)
ack_result: Callable[[type, bytes, bytes, bytes, int, Mapping[int, str]], Any] = getattr(
    speedups, "ack_result", py_ack_result)
complete_acks: Callable[[list[Any], list[bytes], list[bytes], list[bytes], object],
                        list[Any]] = getattr(speedups, "complete_acks", py_complete_acks)
put_ack: Callable[[bytes, int, type, int, Mapping[int, str]], Any] = getattr(
    speedups, "put_ack", py_put_ack)
#: ``tx_acks(buf, pos, end, opaques, cls, broker_id, index, name)``: see py_tx_acks
tx_acks: Callable[..., Any] = getattr(speedups, "tx_acks", py_tx_acks)
tx_answers: Callable[[Sequence[bytes], Sequence[int], bytes], bytes] = getattr(
    speedups, "tx_answers", py_tx_answers)
put_round_trip: Callable[[Any, Any, bytes, int, type, int, Mapping[int, str]], Any] = getattr(
    speedups, "put_round_trip", py_put_round_trip)
#: ``submit_put(state, topic, route, payload, flag)``: ``Producer.send_async``'s future, pick
#: and put in one C call (see the C file).  None without the C module: its twin is the
#: Python path it replaces in metaq/producer/_producer.py (``Send(...)`` then
#: ``SendPath.submit``), which tests/producer/test_send_fast_path.py compares it with.
submit_put: Callable[[tuple, str, Any, bytes, int], Any] | None = getattr(
    speedups, "submit_put", None)
#: ``take_acks(buf, pending, send_type, finished) -> (used, freed, waited)``: a put
#: connection reader's completion of a run of successful replies in one C call (see the C
#: file); None without the C module: its twin is the Python path it goes before in
#: metaq/net/_reader.py (``scan_acks`` / ``scan_results``, then ``on_acks`` / ``on_reply``).
take_acks: Callable[[bytes, dict, type, str], tuple[int, int, list[Any]]] | None = getattr(
    speedups, "take_acks", None)
#: ``bind_send_async(producer_type, slow, doc)``: a C ``send_async`` method descriptor for
#: the producer, ``slow`` (the Python method, its twin) for all but its common call; None
#: without the C module (the Python method stays).
bind_send_async: Callable[[type, Callable[..., Any], str], Any] | None = getattr(
    speedups, "bind_send_async", None)
#: ``bind_send_result(send_type, result_cls, names, slow)``: a C ``result`` method for the
#: producer's Send, ``slow`` (the Python method, its twin) for all but a finished send
#: without an exception; None without the C module (the Python method stays).
bind_send_result: Callable[[type, type, dict, Callable[..., Any]], Any] | None = getattr(
    speedups, "bind_send_result", None)


# ----------------------------------------------------------------------------------
# Broker side: fast_puts.
# ----------------------------------------------------------------------------------


# put <topic> <partition> <len> <flag> [<checksum>] <opaque>\r\n: the grammar of the C loop
# (``-?[0-9]{1,10}`` numbers, the sign only where Metaq allows one, a topic of 1..255
# bytes without space or line break); group 1 is the key ``b"<topic> <partition>"``;
# groups 4 and 5 are the checksum and the opaque, or (6 fields, no checksum: Java's
# legacy form) the opaque and None.
_PUT_NUMBERS = (rb" ([0-9]{1,10}) (-?[0-9]{1,10}) (-?[0-9]{1,10})(?: (-?[0-9]{1,10}))?"
                rb"\r\n")
_PUT = re.compile(rb"put ([^ \r\n]{1,255} -?[0-9]{1,10})" + _PUT_NUMBERS).match
_KEYED_PUTS: dict[bytes, object] = {}


def _keyed_put(key: bytes):  # type: ignore[no-untyped-def]
    """``_PUT`` for puts to one ``b"<topic> <partition>"`` (as matched by it): the same
    groups, found faster (a literal prefix instead of a scan of the topic)."""
    match = _KEYED_PUTS.get(key)
    if match is None:
        if len(_KEYED_PUTS) >= 1024:
            _KEYED_PUTS.clear()
        match = _KEYED_PUTS[key] = re.compile(
            b"put (" + re.escape(key) + b")" + _PUT_NUMBERS).match
    return match


# ---- issue 29 (broker): the transactional puts (``tx_cls`` given): ``<checksum> <txKey>
# <opaque>`` (8 fields) or ``<txKey> <opaque>`` (7 fields, a key that does not start with
# a digit or '-': Java's decoder reads such a slot as a checksum), a key being 1..512
# bytes of printable ASCII but the space; groups: key, length, flag, checksum, txKey (8
# fields) or None, txKey (7 fields) or None, opaque.
_TX_PUT = re.compile(
    rb"put ([^ \r\n]{1,255} -?[0-9]{1,10}) ([0-9]{1,10}) (-?[0-9]{1,10}) "
    rb"(?:(-?[0-9]{1,10}) ([\x21-\x7e]{1,512})"
    rb"|([\x21-\x2c\x2e\x2f\x3a-\x7e][\x21-\x7e]{0,511})) (-?[0-9]{1,10})\r\n").match


def py_fast_puts(buf: bytes, pos: int, fast: Mapping[bytes, object], max_payload: int,
                 out: list, tx_cls: type | None = None) -> int:
    """The broker's put loop (``fast_puts`` of ``_speedups.c``), in Python.

    From ``pos``, every whole ``put <topic> <part> <len> <flag> [<checksum>] <opaque>\\r\\n
    <payload>`` whose ``b"<topic> <part>"`` maps to a target other than None in ``fast``
    becomes the tuple ``(target, length, flag, checksum, opaque_token, payload)``
    appended to ``out`` (the opaque as its decimal bytes, ready to echo; the checksum
    -1 when the put has none, 6 fields, Java's legacy form); the loop stops at the
    first request that is anything else (a put cut short, over ``max_payload``, with
    a number out of the int32 range, with a transaction key, to an unknown
    partition, another command) and returns where, for the general parser to take
    it from there.  With ``tx_cls``, a put with a transaction key (8 fields, or 7
    with the key in the checksum's place) becomes ``tx_cls((target, length, flag,
    checksum, opaque_token, payload, tx_key))``, the key as bytes (printable ASCII
    only; any other goes to the general parser).  Numbers of at most 9 digits are in
    range without a check; after two puts in a row to one partition, a pattern for
    that partition is tried first (the general one again when it fails).
    """
    if not 0 <= pos <= len(buf):
        raise ValueError("fast_puts: pos outside the data")
    end = len(buf)
    get = fast.get
    append = out.append
    general = match = _PUT
    last_key = None
    while True:
        tx = None
        m = match(buf, pos)
        if m is None:
            if match is not general:
                match = general
                continue
            if tx_cls is None or (m := _TX_PUT(buf, pos)) is None:
                return pos
            key, length, flag, check, tx, legacy, opaque = m.groups()
            if tx is None:  # 7 fields, a key in the checksum's place: no checksum
                check, tx = b"-1", legacy
        else:
            key, length, flag, check, opaque = m.groups()
            if opaque is None:  # 6 fields: no checksum (-1, "not computed", as Java's)
                check, opaque = b"-1", check
        target = get(key)
        if target is None:
            return pos
        start = m.end()
        stop = start + int(length)
        if stop > end or stop - start > max_payload:
            return pos
        if flag == b"0":
            flag = 0
        else:
            flag = int(flag)
            if not INT32_MIN <= flag <= INT32_MAX:
                return pos
        check = int(check)
        if not INT32_MIN <= check <= INT32_MAX or (
                len(opaque) > 9 and not INT32_MIN <= int(opaque) <= INT32_MAX):
            return pos
        if tx is not None:
            append(tx_cls((target, stop - start, flag, check, opaque, buf[start:stop], tx)))
            pos = stop
            continue
        append((target, stop - start, flag, check, opaque, buf[start:stop]))
        pos = stop
        if match is general:
            if key == last_key:
                match = _keyed_put(key)
            last_key = key


#: ``fast_puts(buf, pos, fast, max_payload, out) -> pos``: C when built (``fast`` must then
#: be a dict), else :func:`py_fast_puts`.
fast_puts = py_fast_puts if speedups is None else speedups.fast_puts


# ---- issue 26 (sync replication): a get line, read whole ----------------------------------

#: ``get <topic> <group> <partition> <offset> <maxSize> <opaque>[ hold=<ms>[ records=<o>]]``
#: with nothing else (single spaces, no trailing ones), numbers of at most 20 bytes.
_GET_LINE = re.compile(rb"get ([^ ]+) ([^ ]+) (-?[0-9]{1,20}) (-?[0-9]{1,20}) (-?[0-9]{1,20})"
                       rb" (-?[0-9]{1,20})(?: hold=(-?[0-9]{1,20})(?: records=(-?[0-9]{1,20}))?)?")
_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1


def py_get_line(line: bytes, topics: Mapping[bytes, str], groups: Mapping[bytes, str],
                cls: type) -> Any:
    """get_line(line, topics, groups, cls) -> a ``cls`` tuple or None.

    ``line`` (its CRLF cut) exactly a well-formed get (:data:`_GET_LINE`: the usual
    one, a slave's or a consumer's), its topic and group tokens keys of ``topics``
    and ``groups`` (the parser's caches of names already checked), every number in
    its range (the sign's ``-`` counts in the 20 bytes; a token of 20 digits or more
    that fits is read too, as ``parse_int`` does): ``tuple.__new__(cls, (topic,
    group, partition, offset, max_size, opaque, hold_ms, records))`` (records None
    when absent).  None for anything else: the full parser reads it then (and says
    what is wrong), so a line is never read two ways."""
    m = _GET_LINE.fullmatch(line)
    if m is None:
        return None
    t, g, p, off, size, op, hold, rec = m.groups()
    for tok in (p, off, size, op, hold, rec):
        if tok is not None and len(tok) > 20:
            return None
    topic = topics.get(t)
    group = groups.get(g)
    if topic is None or group is None:
        return None
    p, off, size, op = int(p), int(off), int(size), int(op)
    if not (INT32_MIN <= p <= INT32_MAX and _INT64_MIN <= off <= _INT64_MAX
            and INT32_MIN <= size <= INT32_MAX and INT32_MIN <= op <= INT32_MAX):
        return None
    h = 0
    if hold is not None:
        h = int(hold)
        if not 0 <= h <= INT32_MAX:
            return None
    r = None
    if rec is not None:
        r = int(rec)
        if not INT32_MIN <= r <= INT32_MAX:
            return None
    return tuple.__new__(cls, (topic, group, p, off, size, op, h, r))


#: ``get_line(line, topics, groups, cls)``: C when built (``topics`` and ``groups``
#: must then be dicts), else :func:`py_get_line`.
get_line: Callable[[bytes, Mapping[bytes, str], Mapping[bytes, str], type], Any] = getattr(
    speedups, "get_line", py_get_line)
