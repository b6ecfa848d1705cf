"""Names that go into Metaq's ZooKeeper paths, and the partition value type.

Metaq puts topics, groups, consumer ids, broker ids and partition names into
paths (``/meta/consumers/<group>/owners/<topic>/<brokerId>-<part>``).  Every
name is checked here before it is used, so a bad one fails with a clear
:class:`InvalidNameError` instead of a wrong path.

Order matters: Metaq sorts partition names and consumer ids *as strings*
(``"0-10"`` before ``"0-2"``), and a Python consumer sharing a group with Java
consumers must compute the same assignment.  :func:`sort_partitions` and
:func:`sort_consumer_ids` do exactly that.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from zk_layout._errors import InvalidNameError

__all__ = [
    "INT32_MAX",
    "RANDOM_PARTITION",
    "BrokerChild",
    "Partition",
    "as_partition",
    "broker_child_name",
    "check_broker_id",
    "check_consumer_id",
    "check_group",
    "check_name",
    "check_slave_no",
    "check_topic",
    "metaq_sort_key",
    "parse_broker_child",
    "parse_broker_id",
    "parse_broker_role",
    "parse_partition",
    "sort_consumer_ids",
    "sort_partitions",
]

#: Java ``int``: broker ids, slave numbers, partition indexes and numParts are ints in Metaq.
INT32_MAX = 2**31 - 1

# A canonical non-negative decimal, as Java's Integer.toString writes it.
_CANON_INT = re.compile(r"0|[1-9][0-9]*")
_BROKER_CHILD = re.compile(r"(0|[1-9][0-9]*)-(?:(m)|s(0|[1-9][0-9]*))")
_PARTITION = re.compile(r"(0|[1-9][0-9]*)-(0|[1-9][0-9]*)")
_SLAVE = re.compile(r"slave(0|[1-9][0-9]*)")


def _bad_char(ch: str) -> bool:
    """Characters never allowed in a name: path separators aside, whitespace,
    control characters and the ranges ZooKeeper itself rejects in node names."""
    o = ord(ch)
    return (
        ch.isspace()
        or o < 0x20
        or 0x7F <= o <= 0x9F
        or 0xD800 <= o <= 0xF8FF
        or o >= 0xFFF0  # includes every non-BMP character: a UTF-16 surrogate pair in Java
    )


def check_name(kind: str, value: object, forbidden: str = "/") -> str:
    """Return ``value`` if it can be one ZooKeeper node name, else raise
    :class:`InvalidNameError` naming ``kind``; ``forbidden`` lists extra banned characters."""
    if not isinstance(value, str):
        raise InvalidNameError(kind, value, f"must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidNameError(kind, value, "must not be empty")
    if value in (".", ".."):
        raise InvalidNameError(kind, value, "'.' and '..' are not allowed as ZooKeeper node names")
    for ch in value:
        if ch in forbidden:
            raise InvalidNameError(kind, value, f"must not contain {ch!r}")
        if _bad_char(ch):
            raise InvalidNameError(
                kind, value, f"must not contain whitespace or control character {ch!r}"
            )
    return value


def check_topic(topic: object) -> str:
    """Return ``topic`` if Metaq can use it as a topic name, else raise.

    Not empty, no ``/`` (path separator), no ``,`` (consumer ids list topics
    comma-joined), no whitespace (the text protocol is space-separated).
    """
    return check_name("topic", topic, "/,")


def check_group(group: object) -> str:
    """Return ``group`` if Metaq can use it as a consumer group name, else raise."""
    return check_name("group", group, "/")


def check_consumer_id(consumer_id: object) -> str:
    """Return ``consumer_id`` if it can be a node name under ``ids/``, else raise."""
    return check_name("consumer id", consumer_id, "/")


def _check_int(kind: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNameError(kind, value, f"must be an int, not {type(value).__name__}")
    if not 0 <= value <= INT32_MAX:
        raise InvalidNameError(kind, value, f"must be between 0 and {INT32_MAX}")
    return value


def check_broker_id(broker_id: object) -> int:
    """Return ``broker_id`` if it is a valid broker id (a Java int >= 0), else raise."""
    return _check_int("broker id", broker_id)


def check_slave_no(slave_no: object) -> int:
    """Return ``slave_no`` if it is a valid slave number (a Java int >= 0), else raise."""
    return _check_int("slave number", slave_no)


def _parse_int(kind: str, text: object) -> int:
    if not isinstance(text, str) or not _CANON_INT.fullmatch(text):
        raise InvalidNameError(kind, text, "must be a non-negative decimal number")
    value = int(text)
    if value > INT32_MAX:
        raise InvalidNameError(kind, text, f"must be at most {INT32_MAX}")
    return value


def parse_broker_id(name: str) -> int:
    """Parse a child of ``brokers/ids`` (``"0"``) into the broker id."""
    return _parse_int("broker id", name)


def parse_broker_role(name: str) -> int | None:
    """Parse a child of ``brokers/ids/<id>``: ``"master"`` gives ``None``,
    ``"slave<N>"`` gives ``N``; anything else raises :class:`InvalidNameError`."""
    if name == "master":
        return None
    m = _SLAVE.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise InvalidNameError("broker role", name, "expected 'master' or 'slave<N>'")
    return _parse_int("slave number", m.group(1))


class BrokerChild(NamedTuple):
    """A parsed ``<id>-m`` / ``<id>-s<N>`` child of a topic directory."""

    broker_id: int
    is_master: bool
    slave_no: int | None


def parse_broker_child(name: str) -> BrokerChild:
    """Parse a child of ``topics-pub/<topic>``, ``topics-sub/<topic>`` or
    ``brokers/topics/<topic>``: ``"0-m"`` gives ``(0, True, None)``,
    ``"3-s1"`` gives ``(3, False, 1)``."""
    m = _BROKER_CHILD.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise InvalidNameError(
            "topic broker node", name, "expected '<brokerId>-m' or '<brokerId>-s<N>'"
        )
    broker_id = _parse_int("broker id", m.group(1))
    if m.group(2):
        return BrokerChild(broker_id, True, None)
    return BrokerChild(broker_id, False, _parse_int("slave number", m.group(3)))


def broker_child_name(broker_id: int, slave_no: int | None = None) -> str:
    """``"<id>-m"`` for a master, ``"<id>-s<N>"`` for slave ``N``."""
    check_broker_id(broker_id)
    if slave_no is None:
        return f"{broker_id}-m"
    return f"{broker_id}-s{check_slave_no(slave_no)}"


@dataclass(frozen=True)
class Partition:
    """A Metaq partition: ``broker_id`` and ``index`` on that broker.

    ``str(p)`` is Metaq's name ``"<brokerId>-<index>"``.  Partitions have no
    ``<`` on purpose: Metaq orders them as *strings*; use
    :func:`sort_partitions` or ``key=metaq_sort_key``.

    ``Partition(-1, -1)``, named ``"-1--1"``, is Java's ``Partition.RandomPartiton``
    (:data:`RANDOM_PARTITION`: "any partition", a producer's choice left to the
    broker); no other negative number is a partition.
    """

    broker_id: int
    index: int

    def __post_init__(self) -> None:
        if type(self.broker_id) is int and self.broker_id == -1 == self.index \
                and type(self.index) is int:
            return  # RANDOM_PARTITION
        check_broker_id(self.broker_id)
        _check_int("partition index", self.index)

    @property
    def is_random(self) -> bool:
        """Whether this is :data:`RANDOM_PARTITION` (``"-1--1"``)."""
        return self.broker_id == -1

    def __str__(self) -> str:
        return f"{self.broker_id}-{self.index}"

    @classmethod
    def parse(cls, name: str) -> Partition:
        """Same as :func:`parse_partition`."""
        return parse_partition(name)


#: Java's ``Partition.RandomPartiton``, ``"-1--1"``.
RANDOM_PARTITION = Partition(-1, -1)


def parse_partition(name: str) -> Partition:
    """Parse ``"<brokerId>-<index>"`` (e.g. ``"0-10"``) into a :class:`Partition`;
    ``"-1--1"`` is :data:`RANDOM_PARTITION`, as in Java's ``Partition(String)``."""
    if name == "-1--1":
        return RANDOM_PARTITION
    m = _PARTITION.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise InvalidNameError("partition", name, "expected '<brokerId>-<index>', e.g. '0-10'")
    return Partition(_parse_int("broker id", m.group(1)), _parse_int("partition index", m.group(2)))


def as_partition(value: Partition | str) -> Partition:
    """Accept a :class:`Partition` or its name."""
    if isinstance(value, Partition):
        return value
    return parse_partition(value)


def metaq_sort_key(partition: Partition | str) -> str:
    """Sort key giving Metaq's partition order: the name as a string
    (``"0-10"`` sorts before ``"0-2"``)."""
    return str(partition)


def sort_partitions(partitions: Iterable[Partition | str]) -> list[Partition]:
    """De-duplicate and sort partitions exactly as Metaq does (by name, as strings)."""
    unique = {as_partition(p) for p in partitions}
    return sorted(unique, key=metaq_sort_key)


def sort_consumer_ids(consumer_ids: Iterable[str]) -> list[str]:
    """Sort consumer ids as Metaq does (plain string order, Java ``String.compareTo``).

    Valid names hold only Basic Multilingual Plane characters outside the
    surrogate range, where Java's UTF-16 order and Python's code-point order agree.
    """
    return sorted(check_consumer_id(c) for c in consumer_ids)
