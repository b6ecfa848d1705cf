"""Where a put goes: the broker's topics as the put path looks them up.

A *target* is ``(partition log, partition as decimal bytes)``; ``(None, topic)``
stands for "partition -1" of a served topic (the broker picks one, round robin
over its open partitions).  :attr:`Topics.keys` maps ``b"<topic> <partition>"``,
as it appears in a put line, to its target: it is the ``fast_puts`` mapping of
every connection's :class:`~metaq.protocol.RequestParser`, kept up to date as
topics are added (at run time, or by ``auto_create_topics`` on a first put).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from metaq._errors import ProtocolError, StorageError
from metaq.broker._storage import Storage
from metaq.protocol import check_topic

__all__ = ["Topics"]

log = logging.getLogger(__name__)


class Topics:
    """The served topics of one :class:`Storage`: targets by key, topic creation and
    the round robin of "partition -1" (event loop thread only)."""

    def __init__(self, storage: Storage, *, auto_create: bool, num_partitions: int,
                 on_added: Callable[[str, int], None] | None = None) -> None:
        self.storage = storage
        self.auto_create = auto_create
        self.num_partitions = num_partitions
        self.on_added = on_added
        #: b"<topic> <partition>" -> (log, partition bytes); b"<topic> -1" -> (None, topic)
        self.keys: dict[bytes, tuple] = {}
        self._next: dict[str, int] = {}  # topic -> where its round robin goes on
        self._index()

    def _index(self) -> None:
        keys = self.keys
        for plog in self.storage.logs():
            p = b"%d" % plog.partition
            keys[plog.topic.encode() + b" " + p] = (plog, p)
        for topic in self.storage.topics:
            keys[topic.encode() + b" -1"] = (None, topic)

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

    def target(self, topic: str, partition: int) -> tuple | None:
        """The target of ``topic``'s ``partition`` (>= 0), creating the topic if
        allowed; None when there is no such partition."""
        plog = self.storage.get(topic, partition)
        if plog is None:
            if topic not in self.storage.topics and self.create(topic):
                plog = self.storage.get(topic, partition)
            if plog is None:
                return None
        return (plog, b"%d" % partition)

    def pick(self, topic: str) -> tuple | None:
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
        return self.keys.get(b"%b %d" % (topic.encode(), p))
