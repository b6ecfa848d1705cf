"""metaq-py's transaction feed between a master and its slaves (not in Metaq 1.4).

A broker whose ``version`` answer lists :data:`TXLOG_CAPABILITY` (``+txlog``)
answers::

    txlog <replica> <incarnation> <seq> <holdMs> <opaque>\\r\\n

``replica`` (0..2**31-1) is the asking slave's replica number; ``incarnation``
(0..2**63-1) and ``seq`` (0..2**63-1) say what it holds already: every event of
the master's feed up to ``seq`` of that incarnation (0 and 0 when it holds
nothing).  The request is also the slave's acknowledgement of those events: a
master with synchronous replication answers a PREPARE, and the commit or rollback
of a prepared branch, only once every in-sync slave acknowledged it this way.

The answer is ``result 200 <len> <opaque>`` whose body is a :data:`TXLOG_HEAD`
(big-endian ``incarnation (u64) | first seq (u64) | last seq (u64) | snapshot
(u8)``) followed by transaction journal records (``metaq.broker._txjournal``'s
format: ``length | crc32 | kind key data``), the events ``first + 1 .. last``.
With the snapshot flag the records are the master's whole state of prepared
branches as of ``last`` (the slave replaces what it held); the master sends one
when the slave's incarnation is not its own or its ``seq`` is older than the
events it still keeps.  With nothing after ``seq`` the master holds the request
up to ``holdMs`` (capped by its ``max_hold``) and then answers with no records
(``first == last == seq``).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from metaq._errors import ProtocolError
from metaq.protocol._commands import parse_int
from metaq.protocol._constants import INT32_MAX, INT32_MIN, INT64_MAX

__all__ = ["TXLOG_CAPABILITY", "TXLOG_HEAD", "TxLogRequest", "TxLogChunk", "encode_txlog",
           "encode_txlog_body", "decode_txlog_body", "txlog_request"]

#: In a broker's ``version`` answer: it answers ``txlog`` (it feeds its slaves
#: its transactions).
TXLOG_CAPABILITY = "+txlog"
#: The head of a ``txlog`` answer: incarnation, first seq, last seq, snapshot flag.
TXLOG_HEAD = struct.Struct(">QQQB")


class TxLogRequest(NamedTuple):
    """``txlog <replica> <incarnation> <seq> <holdMs> <opaque>``."""

    replica: int
    incarnation: int
    seq: int
    hold_ms: int
    opaque: int


class TxLogChunk(NamedTuple):
    """A decoded ``txlog`` answer: the events ``first + 1 .. last`` (``records``,
    journal records still to be checked by the reader) of ``incarnation``."""

    incarnation: int
    first: int
    last: int
    snapshot: bool
    records: bytes


def encode_txlog(replica: int, incarnation: int, seq: int, hold_ms: int, opaque: int) -> bytes:
    """A ``txlog`` request (to a broker listing ``+txlog``)."""
    if not (0 <= replica <= INT32_MAX and 0 <= incarnation <= INT64_MAX
            and 0 <= seq <= INT64_MAX and 0 <= hold_ms <= INT32_MAX):
        raise ProtocolError(f"bad txlog request: replica {replica}, incarnation {incarnation}, "
                            f"seq {seq}, hold {hold_ms}")
    return b"txlog %d %d %d %d %d\r\n" % (replica, incarnation, seq, hold_ms, opaque)


def txlog_request(parts: list) -> TxLogRequest:
    """``txlog <replica> <incarnation> <seq> <holdMs> <opaque>`` from its fields."""
    if len(parts) != 6:
        raise ProtocolError("expected 'txlog <replica> <incarnation> <seq> <holdMs> <opaque>'")
    return TxLogRequest(parse_int(parts[1], "replica", 0, INT32_MAX),
                        parse_int(parts[2], "incarnation", 0, INT64_MAX),
                        parse_int(parts[3], "seq", 0, INT64_MAX),
                        parse_int(parts[4], "holdMs", 0, INT32_MAX),
                        parse_int(parts[5], "opaque", INT32_MIN, INT32_MAX))


def encode_txlog_body(incarnation: int, first: int, last: int, snapshot: bool,
                      records: bytes) -> bytes:
    """The body of a ``txlog`` answer."""
    return TXLOG_HEAD.pack(incarnation, first, last, 1 if snapshot else 0) + records


def decode_txlog_body(body: bytes) -> TxLogChunk:
    """A ``txlog`` answer's body; :class:`ProtocolError` naming what is wrong with a
    head that cannot be one (the records are the journal reader's to check)."""
    if len(body) < TXLOG_HEAD.size:
        raise ProtocolError(f"txlog answer of {len(body)} bytes: shorter than its "
                            f"{TXLOG_HEAD.size}-byte head")
    incarnation, first, last, snap = TXLOG_HEAD.unpack_from(body, 0)
    if snap > 1:
        raise ProtocolError(f"txlog answer: snapshot flag {snap} (0 or 1)")
    if last < first or max(incarnation, first, last) > INT64_MAX:
        raise ProtocolError(f"txlog answer: events {first}..{last} of incarnation "
                            f"{incarnation} are not a range")
    records = body[TXLOG_HEAD.size:]
    if first == last and records and not snap:
        raise ProtocolError(f"txlog answer: {len(records)} bytes of records for no event "
                            f"({first}..{last})")
    return TxLogChunk(incarnation, first, last, bool(snap), records)
