"""The data of every Metaq ZooKeeper node, byte-for-byte, both directions.

Every ``encode_*`` returns the UTF-8 bytes Metaq writes; every ``decode_*``
takes the raw bytes read from ZooKeeper (``str`` is accepted too) and either
returns a value or raises :class:`NodeDataError` naming the path (when given),
the data and what is wrong -- never anything else, whatever the bytes.

=======================  ==========================================  =====================
node                     data                                        codec
=======================  ==========================================  =====================
brokers/ids/<id>[/...]   ``meta://host:port`` (``[v6]:port``)         :class:`BrokerUri`
topics-pub / topics-sub  ``{"numParts":4,"broker":"0-m"}``            :class:`TopicBroker`
brokers/topics (legacy)  ``4``                                        numParts
consumers/.../ids/<c>    ``t1,t2``                                    topic list
consumers/.../owners     owner's consumer id                         owner
consumers/.../offsets    ``<msgId>-<offset>``, ``-1-0``, legacy ``4096``  :class:`StoredOffset`
=======================  ==========================================  =====================
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import socket
import uuid as _uuid
from collections.abc import Iterable
from dataclasses import dataclass

from zk_layout._errors import InvalidNameError, NodeDataError
from zk_layout._java_uri import slave_id_of_uri_tail
from zk_layout._names import (
    INT32_MAX,
    broker_child_name,
    check_broker_id,
    check_consumer_id,
    check_group,
    check_slave_no,
    check_topic,
    parse_broker_child,
)

__all__ = [
    "BrokerUri",
    "StoredOffset",
    "TopicBroker",
    "build_consumer_id",
    "decode_broker_uri",
    "decode_num_parts",
    "decode_offset",
    "decode_owner",
    "decode_topic_broker",
    "decode_topic_list",
    "encode_broker_uri",
    "encode_num_parts",
    "encode_offset",
    "encode_owner",
    "encode_topic_broker",
    "encode_topic_list",
    "local_ip",
    "node_text",
]

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

_HOSTNAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?")
# The host: an IPv6 address in brackets (as Java's Broker.getZKString writes it), a name
# or IPv4 address, or an IPv6 address without brackets (``"meta://" + host`` with the
# host as InetAddress.getHostAddress writes it, e.g. ``meta://0:0:0:0:0:0:0:1:8123``):
# its port is after the last colon.
_URI = re.compile(
    r"meta://(?:\[(?P<v6>[0-9A-Fa-f:.]+(?:%[A-Za-z0-9_.-]+)?)\]|(?P<host>[^\[\]:/?#@\s]+)"
    r"|(?P<bare6>[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*(?:%[A-Za-z0-9_.-]+)?))"
    r":(?P<port>[1-9][0-9]{0,4})(?P<rest>[/?#].*)?",
    re.DOTALL,
)
_UINT = re.compile(r"0|[1-9][0-9]*")
_LONG = re.compile(r"-?[0-9]{1,19}")
_ULONG = re.compile(r"[0-9]{1,19}")


def node_text(data: bytes | str | None, path: str, *, allow_empty: bool = False) -> str:
    """The node data as text, or NodeDataError for None, non-UTF-8 or (usually) empty."""
    if data is None:
        raise NodeDataError(path, data, "node has no data")
    if isinstance(data, str):
        text = data
    elif isinstance(data, bytes | bytearray | memoryview):
        data = bytes(data)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            reason = f"not valid UTF-8 ({e.reason} at byte {e.start})"
            raise NodeDataError(path, data, reason) from None
    else:
        raise NodeDataError(path, data, f"expected bytes, got {type(data).__name__}")
    if not text and not allow_empty:
        raise NodeDataError(path, data, "node data is empty")
    return text


# -- broker URI ----------------------------------------------------------------------------


@dataclass(frozen=True)
class BrokerUri:
    """A broker address as Metaq writes it: ``meta://host:port``.

    ``host`` is a host name, an IPv4 address or an IPv6 address (without
    brackets; ``str()`` adds them).  ``slave_id`` is set when the URI carries
    ``?slaveId=N``, which Metaq clients append to a slave's URI when reading
    ``brokers/ids/<id>/slave<N>``; brokers never write it.  Other query forms Java
    reads (a path, more parameters, ``slaveId=``) decode to this and are written back
    in this one form (:func:`decode_broker_uri`).
    """

    host: str
    port: int
    slave_id: int | None = None

    def __post_init__(self) -> None:
        host = self.host
        if not isinstance(host, str) or not host:
            raise InvalidNameError("broker host", host, "must be a non-empty str")
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise InvalidNameError("broker host", host, "not a valid IPv6 address") from None
        elif not _HOSTNAME.fullmatch(host):
            raise InvalidNameError("broker host", host, "not a valid host name or IPv4 address")
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise InvalidNameError("broker port", self.port, "must be an int")
        if not 1 <= self.port <= 65535:
            raise InvalidNameError("broker port", self.port, "must be between 1 and 65535")
        if self.slave_id is not None:
            check_slave_no(self.slave_id)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        uri = f"meta://{host}:{self.port}"
        return uri if self.slave_id is None else f"{uri}?slaveId={self.slave_id}"

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` for :func:`socket.create_connection`."""
        return (self.host, self.port)

    def with_slave_id(self, slave_id: int | None) -> BrokerUri:
        """This URI as a client sees a slave: with ``?slaveId=N`` (or without for None)."""
        return BrokerUri(self.host, self.port, slave_id)


def encode_broker_uri(uri: BrokerUri) -> bytes:
    """``meta://host:port`` (``meta://[v6]:port``; ``?slaveId=N`` only if set)."""
    if not isinstance(uri, BrokerUri):
        raise TypeError(f"expected BrokerUri, got {type(uri).__name__}")
    return str(uri).encode("utf-8")


def decode_broker_uri(data: bytes | str | None, path: str = "") -> BrokerUri:
    """Parse a broker URI as a Metaq 1.4 client parses it.

    ``meta://host:port``; an IPv6 host in brackets or not (``meta://[::1]:8123``,
    ``meta://0:0:0:0:0:0:0:1:8123``: the port is after the last colon).  After the
    port, what Java's ``Broker(int, String)`` constructor takes (``new java.net.URI``,
    then ``Broker.slaveIdByUri`` over ``URIUtils.parseParameters``): any path (``/``),
    a query of ``&``-separated parameters in any order, a fragment.  Only ``slaveId``
    means anything: the last one wins; absent, empty (``slaveId=``), blank or
    negative it is a master (Java's ``slaveId`` -1, ``Broker.isSlave`` false)::

        meta://h:8123?slaveId=3          -> BrokerUri("h", 8123, 3)
        meta://h:8123/?x=1&slaveId=3     -> BrokerUri("h", 8123, 3)
        meta://h:8123?slaveId=           -> BrokerUri("h", 8123)

    Raises :class:`NodeDataError` where Java throws: a character ``java.net.URI``
    refuses, a malformed ``%`` escape, a parameter with more than one ``=`` value
    (``URIUtils``' "bad parameter"), a ``slaveId`` ``Integer.parseInt`` refuses.
    """
    text = node_text(data, path)
    m = _URI.fullmatch(text)
    if m is None:
        raise NodeDataError(path, data, "expected a broker URI 'meta://host:port'")
    host = m.group("v6") or m.group("host") or m.group("bare6")
    if m.group("v6") is not None and ":" not in host:
        raise NodeDataError(path, data, "only IPv6 addresses go in brackets")
    rest = m.group("rest")
    slave = None if rest is None else slave_id_of_uri_tail(rest, m.start("rest"), path, data)
    try:
        return BrokerUri(host, int(m.group("port")), slave)
    except InvalidNameError as e:
        raise NodeDataError(path, data, str(e)) from None


# -- topic JSON (topics-pub / topics-sub) ------------------------------------------------


def _check_num_parts(num_parts: object) -> int:
    if isinstance(num_parts, bool) or not isinstance(num_parts, int):
        raise InvalidNameError("numParts", num_parts, "must be an int")
    if not 0 <= num_parts <= INT32_MAX:
        raise InvalidNameError("numParts", num_parts, f"must be between 0 and {INT32_MAX}")
    return num_parts


@dataclass(frozen=True)
class TopicBroker:
    """The JSON a broker writes under ``topics-pub`` / ``topics-sub``:
    ``num_parts`` partitions on broker ``broker_id``, master when ``slave_no`` is None."""

    num_parts: int
    broker_id: int
    slave_no: int | None = None

    def __post_init__(self) -> None:
        _check_num_parts(self.num_parts)
        check_broker_id(self.broker_id)
        if self.slave_no is not None:
            check_slave_no(self.slave_no)

    @property
    def broker(self) -> str:
        """The JSON ``broker`` field: ``"<id>-m"`` or ``"<id>-s<N>"``."""
        return broker_child_name(self.broker_id, self.slave_no)

    @property
    def is_master(self) -> bool:
        return self.slave_no is None


def encode_topic_broker(value: TopicBroker) -> bytes:
    """``{"numParts":N,"broker":"<id>-m"}``: this key order, no spaces, as Metaq writes."""
    if not isinstance(value, TopicBroker):
        raise TypeError(f"expected TopicBroker, got {type(value).__name__}")
    return f'{{"numParts":{value.num_parts},"broker":"{value.broker}"}}'.encode()


def reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def json_object(data: bytes | str | None, path: str, what: str,
                required: tuple[str, ...]) -> dict[str, object]:
    """A node's data as a strict JSON object (no NaN, no duplicate keys) holding the
    ``required`` keys, or :class:`NodeDataError` saying what is wrong (``what``
    describes the object expected)."""
    text = node_text(data, path)
    try:
        obj = json.loads(text, parse_constant=reject_constant, object_pairs_hook=no_duplicate_keys)
    except (ValueError, RecursionError) as e:
        raise NodeDataError(path, data, f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise NodeDataError(path, data, f"expected a JSON object {what}")
    for key in required:
        if key not in obj:
            raise NodeDataError(path, data, f"missing {key!r}")
    return obj


def decode_topic_broker(data: bytes | str | None, path: str = "") -> TopicBroker:
    """Parse the topic JSON; any whitespace and key order, unknown keys ignored,
    but ``numParts`` must be a JSON integer >= 0 and ``broker`` a ``"<id>-m"`` /
    ``"<id>-s<N>"`` string."""
    obj = json_object(data, path, "with numParts and broker", ("numParts", "broker"))
    num_parts, broker = obj["numParts"], obj["broker"]
    if isinstance(num_parts, bool) or not isinstance(num_parts, int):
        raise NodeDataError(path, data, f"numParts must be an integer, not {num_parts!r}")
    if not 0 <= num_parts <= INT32_MAX:
        raise NodeDataError(path, data, f"numParts must be between 0 and {INT32_MAX}")
    if not isinstance(broker, str):
        raise NodeDataError(path, data, f"broker must be a string, not {broker!r}")
    try:
        child = parse_broker_child(broker)
    except InvalidNameError as e:
        raise NodeDataError(path, data, f"broker field: {e}") from None
    return TopicBroker(num_parts, child.broker_id, child.slave_no)


# -- legacy numParts (brokers/topics/<topic>/<id>-m) ------------------------------------


def encode_num_parts(num_parts: int) -> bytes:
    """The legacy ``brokers/topics`` data: numParts as decimal text."""
    return str(_check_num_parts(num_parts)).encode("ascii")


def decode_num_parts(data: bytes | str | None, path: str = "") -> int:
    """Parse the legacy numParts text (``"4"``)."""
    text = node_text(data, path)
    if not _UINT.fullmatch(text) or len(text) > 10 or int(text) > INT32_MAX:
        raise NodeDataError(path, data, f"numParts must be a decimal integer 0..{INT32_MAX}")
    return int(text)


# -- consumer registration, owners -------------------------------------------------------


def encode_topic_list(topics: Iterable[str]) -> bytes:
    """The data of ``consumers/<group>/ids/<consumerId>``: topics joined by ``,``."""
    names = [check_topic(t) for t in ([topics] if isinstance(topics, str) else topics)]
    if not names:
        raise ValueError("a consumer registers at least one topic")
    return ",".join(names).encode("utf-8")


def decode_topic_list(data: bytes | str | None, path: str = "") -> tuple[str, ...]:
    """Parse ``"t1,t2"`` into ``("t1", "t2")`` (order kept)."""
    text = node_text(data, path)
    topics = text.split(",")
    for topic in topics:
        try:
            check_topic(topic)
        except InvalidNameError as e:
            raise NodeDataError(path, data, f"bad topic in list: {e.reason}") from None
    return tuple(topics)


def build_consumer_id(
    group: str,
    consumer_id: str | None = None,
    *,
    ip: str | None = None,
    pid: int | None = None,
    uuid: str | None = None,
) -> str:
    """Metaq's consumer id: ``<group>_<consumerId>``, or ``<group>_<ip>-<pid>-<uuid>``
    when no ``consumer_id`` is configured (ip, pid and uuid default to this host's
    address, this process and a fresh random UUID)."""
    check_group(group)
    if consumer_id is None:
        ip = local_ip() if ip is None else ip
        pid = os.getpid() if pid is None else pid
        uuid = str(_uuid.uuid4()) if uuid is None else uuid
        consumer_id = f"{ip}-{pid}-{uuid}"
    return check_consumer_id(f"{group}_{consumer_id}")


def local_ip() -> str:
    """This host's outward IPv4 address without sending anything (UDP connect), or loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def encode_owner(consumer_id: str) -> bytes:
    """The data of an owner node: the owning consumer's id."""
    return check_consumer_id(consumer_id).encode("utf-8")


def decode_owner(data: bytes | str | None, path: str = "") -> str:
    """The consumer id held by an owner node."""
    text = node_text(data, path)
    try:
        return check_consumer_id(text)
    except InvalidNameError as e:
        raise NodeDataError(path, data, f"not a consumer id: {e.reason}") from None


#: The epoch of a msgId's time field (Metaq's constant, also metaq.protocol's).
MSG_ID_EPOCH_MS = 1303895660503


# -- offsets ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StoredOffset:
    """A committed offset: ``offset`` (bytes into the partition) and ``msg_id``
    (the last message id, ``-1`` when unknown; ``None`` for a legacy node that
    held a bare offset).  Encodes as ``<msgId>-<offset>``; ``None`` writes ``-1``."""

    offset: int
    msg_id: int | None = -1

    def __post_init__(self) -> None:
        if isinstance(self.offset, bool) or not isinstance(self.offset, int):
            raise InvalidNameError("offset", self.offset, "must be an int")
        if not 0 <= self.offset <= INT64_MAX:
            raise InvalidNameError("offset", self.offset, f"must be between 0 and {INT64_MAX}")
        if self.msg_id is not None:
            if isinstance(self.msg_id, bool) or not isinstance(self.msg_id, int):
                raise InvalidNameError("msgId", self.msg_id, "must be an int or None")
            if not INT64_MIN <= self.msg_id <= INT64_MAX:
                raise InvalidNameError("msgId", self.msg_id, "must fit a Java long")

    @property
    def msg_time_ms(self) -> int | None:
        """The broker wall-clock time (epoch ms) in ``msg_id``; None when unknown.

        >>> StoredOffset(offset=0, msg_id=(1000 << 22) | 5).msg_time_ms
        1303895661503
        """
        if self.msg_id is None or self.msg_id < 0:
            return None
        return (self.msg_id >> 22) + MSG_ID_EPOCH_MS


def encode_offset(value: StoredOffset) -> bytes:
    """``<msgId>-<offset>``, e.g. ``123-4096`` or ``-1-0``."""
    if not isinstance(value, StoredOffset):
        raise TypeError(f"expected StoredOffset, got {type(value).__name__}")
    msg_id = -1 if value.msg_id is None else value.msg_id
    return f"{msg_id}-{value.offset}".encode("ascii")


def decode_offset(data: bytes | str | None, path: str = "") -> StoredOffset:
    """Parse ``<msgId>-<offset>`` at the LAST ``-`` (msgId may be ``-1``), or a
    legacy bare ``<offset>`` (msg_id ``None``)."""
    text = node_text(data, path)
    index = text.rfind("-")
    if index > 0:
        head, tail = text[:index], text[index + 1:]
        if not _LONG.fullmatch(head) or not _ULONG.fullmatch(tail):
            raise NodeDataError(path, data, "expected '<msgId>-<offset>' with decimal numbers")
        msg_id, offset = int(head), int(tail)
        if not INT64_MIN <= msg_id <= INT64_MAX:
            raise NodeDataError(path, data, "msgId does not fit a Java long")
    else:
        if not _ULONG.fullmatch(text):
            raise NodeDataError(path, data, "expected '<msgId>-<offset>' or a bare offset >= 0")
        msg_id, offset = None, int(text)
    if offset > INT64_MAX:
        raise NodeDataError(path, data, "offset does not fit a Java long")
    return StoredOffset(offset=offset, msg_id=msg_id)
