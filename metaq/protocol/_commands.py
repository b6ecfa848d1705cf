"""The text protocol's commands (reference section 6): request and reply
types, the checks of their fields (names, integers) and their encoders.

The incremental parsers that produce these types are in
:mod:`metaq.protocol._parsers`; they read fields with the checks defined here
(:func:`parse_int`, :func:`parse_topic`, :func:`token_text`, :func:`name_problem`,
:func:`show`), which are public in this module but not exported by the package.
"""

from __future__ import annotations

from typing import NamedTuple

import zk_layout
from metaq._errors import ProtocolError
from metaq.protocol._constants import INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN
from metaq.protocol._fast import encode_tx_puts as _encode_tx_puts

__all__ = [
    "PutRequest",
    "TxPut",
    "SyncRequest",
    "GetRequest",
    "OffsetRequest",
    "StatsRequest",
    "VersionRequest",
    "QuitRequest",
    "BadRequest",
    "Result",
    "Value",
    "encode_put",
    "encode_tx_puts",
    "encode_sync",
    "encode_get",
    "encode_offset",
    "encode_stats",
    "encode_version",
    "encode_result",
    "encode_value_header",
    "parse_put_result",
    "check_topic",
    "check_group",
    # field checks shared with the parsers (not exported by the package)
    "topic_cache",
    "group_cache",
    "name_problem",
    "token_text",
    "parse_topic",
    "parse_group",
    "parse_int",
    "show",
]

#: The ranges of Java's int and long, as the protocol's numbers are read.
_MAX_NAME = 255
_REPR_MAX = 120


class PutRequest(NamedTuple):
    topic: str
    partition: int
    length: int
    flag: int
    #: CRC32 of the payload & 0x7FFFFFFF, or -1: not given (Java's clients send -1,
    #: "not computed"; its legacy forms carry none): the broker computes it
    checksum: int
    tx_key: str | None
    opaque: int
    payload: bytes


class TxPut(tuple):
    """A put with a transaction key as the broker's put loop reads it
    (``RequestParser(fast_puts=..., tx_puts=True)``): ``(target, length, flag,
    checksum, opaque_token, payload, tx_key)``, the target from ``fast_puts``, the
    opaque as its decimal bytes, the key as bytes (printable ASCII), the checksum -1
    when the put has none (7 fields, the key in its place)."""

    __slots__ = ()


class SyncRequest(NamedTuple):
    """``sync``: a master replicating one put to its slave (Java's ``SyncCommand``, Samsa
    master to Gregor slave), stored with the msgId the master gave it."""

    topic: str
    partition: int
    length: int
    flag: int
    #: the msgId the master assigned (stored as is: not a new one)
    msg_id: int
    #: CRC32 of the payload & 0x7FFFFFFF, or -1: not given (masters before Metaq 1.4.4
    #: send none, the 7-field form), then computed
    checksum: int
    opaque: int
    payload: bytes


class GetRequest(NamedTuple):
    topic: str
    group: str
    partition: int
    offset: int
    max_size: int
    opaque: int
    #: metaq-py's extension (``hold=<ms>`` after the opaque): how long the broker may
    #: hold a get that finds nothing new before it answers "no message"; 0 = a plain get
    hold_ms: int = 0
    #: metaq-py's extension for slaves (``records=<opaque>`` after ``hold=``): the opaque
    #: under which a ``+records`` master sends the producer records of what it serves,
    #: right before the value (``_idempotence``); None: not asked
    records: int | None = None


class OffsetRequest(NamedTuple):
    topic: str
    group: str
    partition: int
    offset: int
    opaque: int
    #: metaq-py's extension (``time=<ms>`` after the opaque): instead of the nearest
    #: valid offset, the first message whose msgId time is at or after this epoch ms
    #: (answered ``<offset> <its time ms or -1>``); -1 = a plain ``offset``
    time_ms: int = -1


class StatsRequest(NamedTuple):
    item: str | None
    opaque: int


class VersionRequest(NamedTuple):
    opaque: int


class QuitRequest(NamedTuple):
    pass


class BadRequest(NamedTuple):
    """A malformed request, returned by :meth:`RequestParser.feed_lenient`.

    ``opaque`` is the request's opaque when it could be read (else ``None``);
    ``fatal`` means the stream cannot be resynchronised and the connection
    must be closed after answering what came before.
    """

    error: ProtocolError
    opaque: int | None
    fatal: bool


class Result(NamedTuple):
    code: int
    body: bytes
    opaque: int


class Value(NamedTuple):
    body: bytes
    opaque: int


# --------------------------------------------------------------------------- names

#: A topic's bytes as they appear in a request -> the checked topic (see :func:`parse_topic`).
topic_cache: dict[bytes, str] = {}
#: A group's bytes as they appear in a request -> the checked group (:func:`parse_group`).
group_cache: dict[bytes, str] = {}
_topic_bytes_cache: dict[str, bytes] = {}


def name_problem(s: str) -> str | None:
    """What makes ``s`` unusable as a name (topic, group, key), or None."""
    if not s:
        return "is empty"
    if len(s) > _MAX_NAME:
        return f"is longer than {_MAX_NAME} characters"
    if not s.isprintable() or " " in s:
        return "contains whitespace or control characters"
    return None


def check_topic(topic: str) -> str:
    """Return ``topic`` if it is a usable topic name, else raise ProtocolError.

    A topic names ZooKeeper nodes (``zk_layout.check_topic``: no ``/``, ``,``,
    whitespace or control characters) and a directory ``<topic>-<partition>``:
    at most 255 characters, no ``\\``, not starting with ``.``.
    """
    try:
        zk_layout.check_topic(topic)
    except zk_layout.InvalidNameError as e:
        raise ProtocolError(f"bad topic {str(topic)[:_REPR_MAX]!r}: {e.reason}") from None
    problem = name_problem(topic)
    if problem is None and "\\" in topic:
        problem = "contains '\\'"
    if problem is None and topic.startswith("."):
        problem = "starts with '.'"
    if problem is not None:
        raise ProtocolError(f"bad topic {topic[:_REPR_MAX]!r}: {problem}")
    return topic


def check_group(group: str) -> str:
    """Return ``group`` if usable as a consumer group name, else raise ProtocolError."""
    try:
        zk_layout.check_group(group)
    except zk_layout.InvalidNameError as e:
        raise ProtocolError(f"bad group {str(group)[:_REPR_MAX]!r}: {e.reason}") from None
    problem = name_problem(group)
    if problem is not None:
        raise ProtocolError(f"bad group {group[:_REPR_MAX]!r}: {problem}")
    return group


#: transaction keys already checked, as bytes (:func:`encode_put`)
_tx_key_cache: dict[str, bytes] = {}


def _topic_bytes(topic: str) -> bytes:
    b = _topic_bytes_cache.get(topic)
    if b is None:
        b = check_topic(topic).encode("utf-8")
        if len(_topic_bytes_cache) > 4096:
            _topic_bytes_cache.clear()
        _topic_bytes_cache[topic] = b
    return b


def token_text(tok: bytes, what: str) -> str:
    """A request's token as text; ProtocolError naming ``what`` when it is not UTF-8."""
    try:
        return tok.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError(f"{what} {tok[:_REPR_MAX]!r} is not valid UTF-8") from None


def parse_topic(tok: bytes) -> str:
    """A request's topic token, checked (:func:`check_topic`) once per distinct token."""
    t = topic_cache.get(tok)
    if t is None:
        t = check_topic(token_text(tok, "topic"))
        if len(topic_cache) > 4096:
            topic_cache.clear()
        topic_cache[bytes(tok)] = t
    return t


def parse_group(tok: bytes) -> str:
    """A request's group token, checked (:func:`check_group`) once per distinct token
    (every ``get`` names one; a slave's and a consumer's are the same every time)."""
    g = group_cache.get(tok)
    if g is None:
        g = check_group(token_text(tok, "group"))
        if len(group_cache) > 4096:
            group_cache.clear()
        group_cache[bytes(tok)] = g
    return g


def parse_int(tok: bytes, what: str, lo: int, hi: int) -> int:
    """A decimal token in ``lo..hi``; ProtocolError naming ``what`` otherwise."""
    if len(tok) <= 20 and (tok.isdigit() or (tok[:1] == b"-" and tok[1:].isdigit())):
        v = int(tok)
        if lo <= v <= hi:
            return v
        raise ProtocolError(f"{what} {v} is out of range {lo}..{hi}")
    raise ProtocolError(f"{what} {tok[:_REPR_MAX]!r} is not an integer")


def show(line: bytes) -> str:
    """A line as error messages quote it (its repr, cut after 120 bytes)."""
    r = repr(bytes(line[:_REPR_MAX]))
    return r + ("..." if len(line) > _REPR_MAX else "")


# --------------------------------------------------------------------------- encoders

def encode_put(topic: str, partition: int, payload: bytes, flag: int, checksum: int,
               opaque: int, tx_key: str | None = None) -> bytes:
    """A ``put`` request with its payload."""
    if tx_key is None:
        return b"put %b %d %d %d %d %d\r\n%b" % (
            _topic_bytes(topic), partition, len(payload), flag, checksum, opaque, payload)
    return b"put %b %d %d %d %d %b %d\r\n%b" % (
        _topic_bytes(topic), partition, len(payload), flag, checksum, _tx_key_bytes(tx_key),
        opaque, payload)


def encode_tx_puts(topic: str, partition: int, flag: int, payloads: list[bytes],
                   checksums: list[int], tx_key: str, opaques: list[int]) -> bytes:
    """The ``put`` requests of several payloads to one partition joining transaction
    ``tx_key``, as one bytes: what :func:`encode_put` makes of each, in order."""
    return _encode_tx_puts(b"put %b %d " % (_topic_bytes(topic), partition), flag, payloads,
                           checksums, _tx_key_bytes(tx_key), opaques)


def _tx_key_bytes(tx_key: str) -> bytes:
    key = _tx_key_cache.get(tx_key) if type(tx_key) is str else None
    if key is None:  # a transaction's puts carry the same key: checked once
        if not isinstance(tx_key, str) or not tx_key or len(tx_key) > 512 \
                or not tx_key.isprintable() or " " in tx_key:
            raise ProtocolError(f"bad tx_key {str(tx_key)[:_REPR_MAX]!r}: a transaction key "
                                f"is 1..512 printable characters without spaces")
        key = tx_key.encode("utf-8")
        if len(_tx_key_cache) > 256:
            _tx_key_cache.clear()
        _tx_key_cache[tx_key] = key
    return key


def encode_sync(topic: str, partition: int, payload: bytes, flag: int, msg_id: int,
                checksum: int, opaque: int) -> bytes:
    """A ``sync`` request with its payload, as Java's ``SyncCommand.encode`` writes it:
    ``sync <topic> <partition> <length> <flag> <msgId> <checksum> <opaque>\\r\\n<payload>``."""
    return b"sync %b %d %d %d %d %d %d\r\n%b" % (
        _topic_bytes(topic), partition, len(payload), flag, msg_id, checksum, opaque, payload)


def _name_bytes(s: str, what: str) -> bytes:
    if not isinstance(s, str):
        raise ProtocolError(f"{what} must be a str, not {type(s).__name__}")
    problem = name_problem(s)
    if problem is not None:
        raise ProtocolError(f"bad {what} {s[:_REPR_MAX]!r}: {problem}")
    return s.encode("utf-8")


def encode_get(topic: str, group: str, partition: int, offset: int, max_size: int,
               opaque: int, hold_ms: int = 0, records: int | None = None) -> bytes:
    """A ``get``; ``hold_ms`` > 0 adds metaq-py's ``hold=<ms>`` field (send it only to
    a broker whose ``version`` answer lists the ``+hold`` capability); ``records``
    adds ``records=<opaque>`` after it (only to a ``+records`` broker, see
    ``_idempotence``)."""
    if records is not None:
        return b"get %b %b %d %d %d %d hold=%d records=%d\r\n" % (
            _topic_bytes(topic), _name_bytes(group, "group"), partition, offset, max_size,
            opaque, max(hold_ms, 0), records)
    if hold_ms > 0:
        return b"get %b %b %d %d %d %d hold=%d\r\n" % (
            _topic_bytes(topic), _name_bytes(group, "group"), partition, offset, max_size,
            opaque, hold_ms)
    return b"get %b %b %d %d %d %d\r\n" % (
        _topic_bytes(topic), _name_bytes(group, "group"), partition, offset, max_size, opaque)


def encode_get_head(topic: str, group: str, partition: int) -> bytes:
    """The start of every ``get`` of one partition for one group, names checked:
    ``head + b"%d %d %d hold=%d records=%d\\r\\n" % (offset, max_size, opaque, hold_ms,
    records)`` (or the shorter tails) is what :func:`encode_get` writes.  For a reader
    that sends the same get again and again (a slave's copy of a partition), which
    then checks and encodes the names once, not per get."""
    return b"get %b %b %d " % (_topic_bytes(topic), _name_bytes(group, "group"), partition)


def encode_offset(topic: str, group: str, partition: int, offset: int, opaque: int,
                  time_ms: int = -1) -> bytes:
    """An ``offset``; ``time_ms`` >= 0 adds metaq-py's ``time=<ms>`` field (send it
    only to a broker whose ``version`` answer lists ``+timeindex``)."""
    if time_ms >= 0:
        return b"offset %b %b %d %d %d time=%d\r\n" % (
            _topic_bytes(topic), _name_bytes(group, "group"), partition, offset, opaque,
            time_ms)
    return b"offset %b %b %d %d %d\r\n" % (
        _topic_bytes(topic), _name_bytes(group, "group"), partition, offset, opaque)


def encode_stats(item: str | None, opaque: int) -> bytes:
    """A ``stats``; without an item as Java writes it, ``stats  <opaque>`` (an empty
    item): a Java broker reads ``stats <opaque>`` as an item named by the number."""
    if item is None:
        return b"stats  %d\r\n" % opaque
    return b"stats %b %d\r\n" % (_name_bytes(item, "stats item"), opaque)


def encode_version(opaque: int) -> bytes:
    return b"version %d\r\n" % opaque


def encode_result(code: int, body: bytes, opaque: int) -> bytes:
    """A ``result`` reply with its body."""
    return b"result %d %d %d\r\n%b" % (code, len(body), opaque, body)


def encode_value_header(length: int, opaque: int) -> bytes:
    """The line before ``length`` raw log bytes of a ``value`` reply."""
    return b"value %d %d\r\n" % (length, opaque)


def parse_put_result(body: bytes) -> tuple[int, int, int]:
    """``(msgId, partition, offset)`` from the body of a successful put result."""
    parts = body.split(b" ")
    if len(parts) != 3:
        raise ProtocolError(f"put result body {show(body)} is not '<msgId> <partition> <offset>'")
    return (parse_int(parts[0], "msgId", INT64_MIN, INT64_MAX),
            parse_int(parts[1], "partition", INT32_MIN, INT32_MAX),
            parse_int(parts[2], "offset", INT64_MIN, INT64_MAX))
