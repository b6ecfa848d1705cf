"""metaq-py's idempotent-producer extension of the put (not in Metaq 1.4).

A broker whose ``version`` answer lists :data:`IDEMPOTENT_CAPABILITY`
(``+idempotent``) reads one more line, the **idem mark**, sent right before a run
of puts::

    idem <pid> <seq> <count>\\r\\n
    put <topic> <part> <len> <flag> <checksum> <opaque>\\r\\n<payload>     (count times)

``pid`` (1..2**63-1) names one producer instance; ``seq`` (0..2**63-1) is the
sequence number of the run's first message in that producer's sequence *for that
partition*; ``count`` (1..2**31-1) is how many of the put requests that follow on
this connection carry ``seq, seq + 1, ...``, all to one partition.  The mark has no
opaque and no answer of its own: each put is answered as usual.  The put lines are
byte for byte Metaq's, so the broker's fast put loop (C) still reads them; the mark
is one short line per run (a batch chunk: one line for thousands of puts).

Why a line before the puts and not a token on each put line: a put line with a
trailing token would leave the broker's C put loop for its Python parser on every
idempotent put; a separate line costs one short command per run and nothing per
put of a batch.  A Java broker never sees the mark: a producer sends it only over
a connection to a broker that listed the capability.

The broker stores a run once: a put whose ``(pid, seq)`` it already stored is
answered with the original ``<msgId> <partition> <offset>`` (result 200) and not
written again; a seq past the next one expected is refused with
:data:`GAP_CODE` (409, text naming pid, partition, expected and got: nothing was
stored, a retry once the missing puts arrived succeeds); a seq older than what the
broker remembers of that producer is refused with :data:`TOO_OLD_CODE` (410: it
was stored, where is not known any more).

The table behind it is replicated as **producer records**, the body of the answer
to (also metaq-py's)::

    producers <topic> <partition> <fromOffset> <opaque>\\r\\n

``result 200`` with the records of the runs that end after ``fromOffset`` (a run that
grew since comes again, whole: the reader replaces what it had), oldest first, each
:data:`RECORD_SIZE` bytes (big-endian, see :data:`PRODUCER_RECORD`): ``pid, seq,
count, start, end, first_id, last_start, last_id, time_ms, crc``.  The run's
messages are ``count`` whole messages at log offsets ``start..end``
(``last_start``: where its last one begins), with msgIds ``first_id`` (first) and
``last_id`` (last), stored at ``time_ms``; ``crc`` is the CRC32 of the 68 bytes
before it.  The same records, the same bytes, make the
journal ``producers.jnl`` in each partition directory.

A slave copying a master that also lists :data:`RECORDS_CAPABILITY` (``+records``)
does without that request on its data path: it adds ``records=<opaque>`` to its
``get`` (after ``hold=<ms>``, see :func:`~metaq.protocol.encode_get`), and the master,
right before the ``value`` answering that get, writes the ``producers`` answer for
the get's offset under that opaque, when it holds any such record.  No answer before
the ``value`` means no record: the plain-put path costs no request and no answer,
and a record always reaches the slave before the get that tells the master it holds
the record's messages.

Transactions (puts with a transaction key) are not covered: a mark covers plain puts
only, and its run ends at any other request (a transactional put, a ``get``...); such
a request is served as Metaq serves it.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

from metaq._errors import ProtocolError
from metaq.protocol._commands import parse_int, parse_topic, show
from metaq.protocol._constants import INT32_MAX, INT32_MIN, INT64_MAX

__all__ = ["IdemMark", "ProducersRequest", "ProducerRecord", "PRODUCER_RECORD",
           "RECORD_SIZE", "GAP_CODE", "TOO_OLD_CODE", "encode_idem_mark",
           "encode_producers", "encode_producer_records", "decode_producer_records",
           "idem_request", "producers_request"]

#: Result code of a put whose seq jumps ahead of what its producer stored (a gap).
GAP_CODE = 409
#: Result code of a put whose seq was stored so long ago the broker forgot where.
TOO_OLD_CODE = 410

#: One producer record: pid, seq, count, start, end, first_id, last_start, last_id,
#: time_ms (8 + 8 + 4 + 6 * 8 bytes) and the CRC32 of those 68 bytes.
PRODUCER_RECORD = struct.Struct(">qqiqqqqqqI")
RECORD_SIZE = PRODUCER_RECORD.size
_BODY = struct.Struct(">qqiqqqqqq")
_CRC = struct.Struct(">I")
_crc32 = zlib.crc32


class IdemMark(NamedTuple):
    """``idem <pid> <seq> <count>``: the next ``count`` puts carry ``seq..``."""

    pid: int
    seq: int
    count: int


class ProducersRequest(NamedTuple):
    """``producers <topic> <partition> <fromOffset> <opaque>``."""

    topic: str
    partition: int
    from_offset: int
    opaque: int


class ProducerRecord(NamedTuple):
    """One stored run of one producer's messages (see the module docstring)."""

    pid: int
    seq: int
    count: int
    start: int
    end: int
    first_id: int
    last_start: int
    last_id: int
    time_ms: int


def encode_idem_mark(pid: int, seq: int, count: int) -> bytes:
    """The mark line before ``count`` puts carrying ``pid`` and ``seq..``."""
    if not (0 < pid <= INT64_MAX and 0 <= seq <= INT64_MAX and 0 < count <= INT32_MAX):
        raise ProtocolError(f"bad idem mark: pid {pid} (1..2**63-1), seq {seq} (0..2**63-1), "
                            f"count {count} (1..2**31-1)")
    return b"idem %d %d %d\r\n" % (pid, seq, count)


def encode_producers(topic: str, partition: int, from_offset: int, opaque: int) -> bytes:
    """A ``producers`` request (to a broker listing ``+idempotent``)."""
    return b"producers %b %d %d %d\r\n" % (topic.encode("utf-8"), partition, from_offset,
                                            opaque)


def encode_producer_records(records: Sequence[ProducerRecord] | Sequence[tuple]) -> bytes:
    """Records as bytes (journal lines, a ``producers`` answer)."""
    out = []
    for r in records:
        body = _BODY.pack(*r)
        out.append(body + _CRC.pack(_crc32(body)))
    return out[0] if len(out) == 1 else b"".join(out)


def decode_producer_records(data: bytes) -> tuple[list[ProducerRecord], int]:
    """``(records, bytes used)``: the whole, intact records at the start of ``data``;
    reading stops at a torn or damaged one (its CRC does not match)."""
    out = []
    pos = 0
    n = len(data)
    unpack = PRODUCER_RECORD.unpack_from
    while pos + RECORD_SIZE <= n:
        *fields, crc = unpack(data, pos)
        if zlib.crc32(data[pos:pos + RECORD_SIZE - 4]) != crc:
            break
        out.append(ProducerRecord(*fields))
        pos += RECORD_SIZE
    return out, pos


def _number(tok: bytes, what: str, lo: int, hi: int) -> int:
    # int() alone would take b" 1", b"+1", b"1_0": a number here is plain digits, without
    # a leading zero (as encode_idem_mark writes it: one spelling per number)
    if tok.isdigit() and len(tok) <= 19 and (tok[:1] != b"0" or tok == b"0"):
        v = int(tok)
        if lo <= v <= hi:
            return v
    raise ProtocolError(f"{what} {show(tok)} is not a decimal integer in {lo}..{hi} "
                        f"(digits only, no leading zero)")


def idem_request(parts: list) -> IdemMark:
    """``idem <pid> <seq> <count>`` from its fields (the command's first)."""
    if len(parts) != 4:
        raise ProtocolError("expected 'idem <pid> <seq> <count>'")
    return IdemMark(_number(parts[1], "pid", 1, INT64_MAX),
                    _number(parts[2], "seq", 0, INT64_MAX),
                    _number(parts[3], "count", 1, INT32_MAX))


def producers_request(parts: list) -> ProducersRequest:
    """``producers <topic> <partition> <fromOffset> <opaque>`` from its fields."""
    if len(parts) != 5:
        raise ProtocolError("expected 'producers <topic> <partition> <fromOffset> <opaque>'")
    return ProducersRequest(parse_topic(parts[1]),
                            parse_int(parts[2], "partition", 0, INT32_MAX),
                            parse_int(parts[3], "fromOffset", 0, INT64_MAX),
                            parse_int(parts[4], "opaque", INT32_MIN, INT32_MAX))
