"""High watermarks between replicas: a master tells its slaves what every in-sync
slave holds (:class:`WatermarkFeed`), and a slave serves consumers only below it
(:class:`WatermarkCopy`).

A master serves consumers only below its high watermark (``_replicas``), so no
consumer passes what a failover can take back.  A slave that serves consumers
(Java's rule when the master is gone, ``read_from="slave-preferred"``) holds
what it copied, which may be more than another slave holds: with two slaves, a
consumer reading the first could commit past what a failover to the second
loses, and the second's next messages would land under that position, never
delivered.  So a slave serves below the master's watermark, as Kafka's followers
do, learnt with ``watermarks`` (``metaq.protocol``'s ``_watermark``): held at the
master until a watermark changes, asked again at most every ``interval``
seconds, so a slave's consumers trail its master's by about that much.

A slave of a master that does not offer ``+watermark`` (a Java Metaq master)
serves all it holds, as Java's slaves do.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING

from metaq._errors import BrokerUnavailableError, ProtocolError
from metaq.broker._hold import HeldRequests
from metaq.broker._replies import answer
from metaq.protocol import (
    Result,
    WatermarkRequest,
    decode_watermark_body,
    encode_watermark_body,
    encode_watermarks,
)

if TYPE_CHECKING:
    from metaq.broker._connection import Connection
    from metaq.broker._storage import PartitionLog, Storage

__all__ = ["WatermarkFeed", "WatermarkCopy"]

log = logging.getLogger(__name__)


class WatermarkFeed:
    """A master's watermarks for its slaves (event loop only)."""

    def __init__(self, storage: Storage, *, max_hold: float,
                 stats: collections.Counter) -> None:
        self.storage = storage
        self.max_hold = max_hold
        self.stats = stats
        #: versions start at a random place: a slave's version from another master
        #: (or an earlier run of this one) falls outside and gets every watermark
        self.base = 1 + secrets.randbelow(1 << 60)
        self.version = self.base
        self._changed: dict[PartitionLog, int] = {}
        self._held = HeldRequests(self._answer)

    def changed(self, plog: PartitionLog) -> None:
        """``plog``'s watermark moved (``ReplicaSet``)."""
        self.version += 1
        self._changed[plog] = self.version
        if self._held:
            self._held.answer_all()

    def request(self, conn: Connection, r: WatermarkRequest) -> None:
        self.stats["cmd_watermarks"] += 1
        self._held.drop(conn)
        if r.version == self.version and r.hold_ms > 0 and self.max_hold > 0:
            self._held.hold(conn, r.opaque, r.version, min(r.hold_ms / 1000.0, self.max_hold))
            return
        self._answer(conn, r.opaque, r.version)

    def _answer(self, conn: Connection, opaque: int, since: int) -> None:
        if self.base <= since <= self.version:
            logs: Iterable[PartitionLog] = [p for p, v in self._changed.items() if v > since]
        else:  # everything (a first request, another master's version)
            logs = self.storage.logs()
        body = encode_watermark_body(self.version, [
            (p.topic, p.partition, p.high_watermark) for p in logs])
        conn.send(answer(body, opaque))

    def connection_closed(self, conn: Connection) -> None:
        self._held.drop(conn)

    def close(self) -> None:
        """No longer master: held requests are answered (the slaves ask again, and
        learn who leads now)."""
        self._held.answer_all()


class WatermarkCopy:
    """A slave's copy of its master's watermarks (event loop only)."""

    def __init__(self, storage: Storage, *, replica: int, stats: collections.Counter,
                 hold_ms: int = 5000, interval: float = 0.01, retry_delay: float = 1.0,
                 answer_timeout: float = 10.0) -> None:
        self.storage = storage
        self.replica = replica
        self.stats = stats
        self.hold_ms = hold_ms
        self.interval = interval
        self.retry_delay = retry_delay
        #: how long past its hold a request may wait for its answer before the
        #: connection is made again (a lost request would stop the watermarks for good)
        self.answer_timeout = answer_timeout
        self.version = 0
        #: the master's watermark per partition, kept for partitions not open here yet
        self.marks: dict[tuple[str, int], int | None] = {}
        self.problem: str | None = None

    def apply(self, plog: PartitionLog) -> None:
        """Give a partition opened here (a new copy) the master's watermark."""
        key = (plog.topic, plog.partition)
        if key in self.marks:
            self._set(plog, self.marks[key])

    @staticmethod
    def _set(plog: PartitionLog, hw: int | None) -> None:
        old = plog.high_watermark
        plog.high_watermark = hw
        if plog.on_readable is not None and (hw is None or (old is not None and hw > old)):
            plog.on_readable(plog)  # held consumer gets may go on

    async def step(self, link: object) -> bool:
        """One ``watermarks`` request and its answer applied; False when it could not
        be used."""
        version = self.version
        reply = await link.ask(  # type: ignore[attr-defined]
            lambda o: encode_watermarks(self.replica, version, self.hold_ms, o),
            self.hold_ms / 1000.0 + self.answer_timeout, "a watermarks request", self.stats)
        if type(reply) is Result and reply.code != 200:
            self.problem = f"master answered {reply.code}: " \
                           f"{reply.body.decode('utf-8', 'replace')}"
            return False
        try:
            new_version, entries = decode_watermark_body(reply.body)
        except ProtocolError as e:
            self.stats["replication_watermarks_damaged"] += 1
            self.problem = f"damaged watermarks: {e}"
            log.error("replica %d: the master's watermarks cannot be used: %s; asked again",
                      self.replica, e)
            return False
        for topic, partition, hw in entries:
            self.marks[(topic, partition)] = hw
            plog = self.storage.get(topic, partition)
            if plog is not None:
                self._set(plog, hw)
        self.stats["replication_watermark_updates"] += len(entries)
        self.version = new_version
        self.problem = None
        return True

    async def run(self, link: object) -> None:
        """Follow the master's watermarks over ``link`` until it fails."""
        self.version = 0  # a new connection: every watermark again
        while True:
            try:
                ok = await self.step(link)
            except BrokerUnavailableError:
                return
            except Exception as e:  # a bug: said, and tried again
                self.problem = f"following the master's watermarks failed: {e!r}"
                log.exception("replica %d: %s", self.replica, self.problem)
                ok = False
            await asyncio.sleep(self.interval if ok else self.retry_delay)
