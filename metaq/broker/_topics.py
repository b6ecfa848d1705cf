"""Where a put goes: the broker's topics as the put path looks them up.

A *target* is a :class:`PutTarget` (a partition's log and its number as decimal
bytes); a :class:`PickTarget` stands for "partition -1" of a served topic (the
broker picks one, round robin over its open partitions; its ``log`` is None, so
``target.log is None`` tells the two apart).  :attr:`Topics.keys` maps ``b"<topic> <partition>"``,
as it appears in a put line, to its target: it is the ``fast_puts`` mapping of
every connection's :class:`~metaq.protocol.RequestParser`, kept up to date as
topics are added (at run time, or by ``auto_create_topics`` on a first put).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

from metaq._errors import ProtocolError, StorageError
from metaq.broker._storage import PartitionLog, Storage
from metaq.protocol import check_topic

__all__ = ["Topics", "PutTarget", "PickTarget"]

log = logging.getLogger(__name__)


class PutTarget(NamedTuple):
    """Where a put is stored: the partition's log and its number as a put line spells
    it.  ``refused`` says why the broker refuses the put whatever its payload (over
    ``max_message_size``), None for a put it stores."""

    log: PartitionLog
    partition: bytes
    refused: str | None = None


class PickTarget(NamedTuple):
    """A put to "partition -1" of ``topic``: the broker picks the partition
    (:meth:`Topics.pick`).  ``log`` is always None (a :class:`PutTarget`'s never is)."""

    log: None
    topic: str


class Topics:
    """The served topics of one :class:`Storage`: targets by key, topic creation and
    the round robin of "partition -1" (event loop thread only)."""

    def __init__(self, storage: Storage, *, auto_create: bool, num_partitions: int,
                 on_added: Callable[[str, int], None] | None = None) -> None:
        self.storage = storage
        self.auto_create = auto_create
        self.num_partitions = num_partitions
        self.on_added = on_added
        #: b"<topic> <partition>" -> PutTarget; b"<topic> -1" -> PickTarget
        self.keys: dict[bytes, PutTarget | PickTarget] = {}
        self._next: dict[str, int] = {}  # topic -> where its round robin goes on
        self._index()

    def _index(self) -> None:
        keys = self.keys
        for plog in self.storage.logs():
            p = b"%d" % plog.partition
            keys[plog.topic.encode() + b" " + p] = PutTarget(plog, p)
        for topic in self.storage.topics:
            keys[topic.encode() + b" -1"] = PickTarget(None, topic)

    def add(self, topic: str, partitions: int) -> None:
        """Serve ``topic`` with (at least) ``partitions`` partitions."""
        check_topic(topic)
        before = self.storage.topics.get(topic, 0)
        self.storage.open_topic(topic, partitions)
        self._index()
        if self.storage.topics[topic] != before and self.on_added is not None:
            self.on_added(topic, self.storage.topics[topic])

    def create(self, topic: str) -> bool:
        """Auto-create ``topic`` (a put to it arrived); False when that is off, the
        topic exists, or creating it failed (logged)."""
        if not self.auto_create or topic in self.storage.topics:
            return False
        try:
            self.add(topic, self.num_partitions)
        except (StorageError, ProtocolError) as e:
            log.error("could not auto-create topic %r: %s", topic, e)
            return False
        log.info("auto-created topic %r with %d partitions", topic, self.num_partitions)
        return True

    def target(self, topic: str, partition: int) -> PutTarget | None:
        """The target of ``topic``'s ``partition`` (>= 0), creating the topic if
        allowed; None when there is no such partition."""
        plog = self.storage.get(topic, partition)
        if plog is None:
            if topic not in self.storage.topics and self.create(topic):
                plog = self.storage.get(topic, partition)
            if plog is None:
                return None
        return PutTarget(plog, b"%d" % partition)

    def pick(self, topic: str) -> PutTarget | None:
        """The target of a put to "partition -1": the next open partition of ``topic``
        (creating the topic if allowed), or, when all are closed, one of them (the put
        gets 403); None when the topic is not served."""
        n = self.storage.topics.get(topic)
        if n is None:
            if not self.create(topic):
                return None
            n = self.storage.topics[topic]
        start = self._next.get(topic, 0)
        p = start % n
        for k in range(n):
            q = (start + k) % n
            plog = self.storage.get(topic, q)
            if plog is not None and not plog.closed:
                self._next[topic] = q + 1
                p = q
                break
        return self.keys.get(b"%b %d" % (topic.encode(), p))  # p >= 0: a PutTarget
