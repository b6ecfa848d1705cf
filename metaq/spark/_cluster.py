"""What the planning side needs from ZooKeeper and the brokers.

:class:`Cluster` is opened for one planning step (``partitions()``,
``latestOffset()``, ``commit()``, :func:`metaq.spark.offset_ranges`) and
closed at its end: Spark may run each step in a different Python process and
never calls ``stop()``, so nothing here outlives the step.  It reads a
topic's partitions and the brokers' addresses through the consumer's
topology helpers (``zk_layout`` paths and codecs), asks brokers for log
bounds and message boundaries with the ``offset`` command, reads and writes
a group's offsets in Metaq's ``<msgId>-<offset>`` format, and enforces the
rule that Spark never commits for a group that has live consumers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError

from metaq._errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigError,
    ConnectionClosedError,
    CoordinationError,
    ProtocolError,
)
from metaq._types import BrokerAddress, PartitionKey
from metaq.net import BrokerConnection, TimeSeek, offset_for_time
from metaq.protocol import HEADER_SIZE
from metaq.spark._arrow import walk
from zk_layout import (
    DEFAULT_ROOT,
    READ_FROM,
    Layout,
    NodeDataError,
    StoredOffset,
    broker_replicas,
    decode_offset,
    encode_offset,
    parse_partition,
    read_partitions,
)

__all__ = ["Cluster", "LiveGroupError", "open_zk", "LOG_END"]

log = logging.getLogger(__name__)

#: The offset that makes a broker's ``offset`` command answer with the log end.
LOG_END = 2**63 - 1


class LiveGroupError(CoordinationError):
    """The group has live consumers, so Spark will neither read for it nor commit to it."""


def open_zk(zk_connect: str, timeout: float) -> KazooClient:
    """A started kazoo client, or CoordinationError naming the connect string."""
    client = KazooClient(hosts=zk_connect, timeout=max(timeout, 4.0))
    try:
        client.start(timeout=timeout)
    except (KazooTimeoutError, KazooException) as e:
        client.close()
        raise CoordinationError(f"cannot connect to ZooKeeper at {zk_connect!r} within "
                                f"{timeout:g}s: {e}") from None
    return client


class Cluster:
    """ZooKeeper plus one connection per broker, for one planning step."""

    def __init__(self, zk_connect: str, *, zk_root: str = DEFAULT_ROOT, group: str,
                 zk_timeout: float = 15.0, broker_timeout: float = 30.0,
                 read_from: str = "master") -> None:
        """``read_from``: which of a broker id's master and slaves to read
        (:meth:`zk_layout.BrokerReplicas.choose`, the group name picking among slaves)."""
        if read_from not in READ_FROM:
            raise ConfigError(f"read_from must be one of {READ_FROM}, got {read_from!r}")
        self.read_from = read_from
        self.zk_connect = zk_connect
        self.layout = Layout(zk_root)
        self.group = group
        self.broker_timeout = broker_timeout
        self.zk = open_zk(zk_connect, zk_timeout)
        self._addresses: dict[int, BrokerAddress | None] = {}
        self._conns: dict[int, BrokerConnection] = {}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        try:
            self.zk.stop()
        finally:
            self.zk.close()

    # -- ZooKeeper ---------------------------------------------------------------------------

    def partitions(self, topic: str) -> list[str]:
        """``topic``'s partitions in Metaq's order (``topics-sub``), [] when none."""
        return read_partitions(self.zk, self.layout, topic)

    def matching_topics(self, pattern: re.Pattern[str]) -> list[str]:
        """The topics under ``brokers/topics-sub`` whose whole name matches ``pattern``
        (as Kafka's ``subscribePattern``), sorted."""
        try:
            names = self.zk.get_children(self.layout.topics_sub())
        except NoNodeError:
            return []
        return sorted(n for n in names if pattern.fullmatch(n))

    def address(self, broker_id: int) -> BrokerAddress | None:
        """Where broker id ``broker_id`` is read from (``read_from``: the master, else a
        slave; or a slave, else the master), None when none of its brokers is up."""
        if broker_id not in self._addresses:
            found = broker_replicas(self.zk, self.layout, broker_id).choose(self.read_from,
                                                                            self.group)
            self._addresses[broker_id] = None if found is None else BrokerAddress(*found)
        return self._addresses[broker_id]

    def live_members(self) -> list[str]:
        """The consumer ids registered under the group (``consumers/<group>/ids``)."""
        try:
            return sorted(self.zk.get_children(self.layout.consumer_ids(self.group)))
        except NoNodeError:
            return []

    def check_no_live_members(self, doing: str) -> None:
        members = self.live_members()
        if members:
            raise LiveGroupError(
                f"not {doing}: consumer group {self.group!r} has live members "
                f"({', '.join(members[:5])}{', ...' if len(members) > 5 else ''}); a Spark job "
                f"keeps its own position and would fight them over the group's offsets. Use a "
                f"group of its own (option 'group'), or stop those consumers first")

    def committed(self, topic: str, partitions: Iterable[str]
                  ) -> dict[str, StoredOffset | NodeDataError]:
        """The group's committed offsets of ``partitions`` (absent when none; a node
        holding garbage gives its NodeDataError, for the caller's offsetReset)."""
        parts = list(partitions)
        paths = [self.layout.offset(self.group, topic, p) for p in parts]
        pending = [self.zk.get_async(p) for p in paths]
        out: dict[str, StoredOffset | NodeDataError] = {}
        for part, path, result in zip(parts, paths, pending, strict=True):
            try:
                data = result.get(timeout=self.broker_timeout)[0]
            except NoNodeError:
                continue
            try:
                out[part] = decode_offset(data, path)
            except NodeDataError as e:
                out[part] = e
        return out

    def commit(self, offsets: Mapping[PartitionKey, tuple[int, int]]) -> None:
        """Write ``{(topic, partition): (offset, msg_id)}`` under the group in one
        ZooKeeper transaction (all or nothing), after checking that the group
        has no live members."""
        if not offsets:
            return
        self.check_no_live_members("committing offsets")
        for topic in {t for t, _ in offsets}:
            self.zk.ensure_path(self.layout.offsets_dir(self.group, topic))
        for attempt in range(3):
            paths = {key: self.layout.offset(self.group, *key) for key in offsets}
            exists = {key: self.zk.exists_async(path) for key, path in paths.items()}
            tx = self.zk.transaction()
            for key, path in paths.items():
                offset, msg_id = offsets[key]
                data = encode_offset(StoredOffset(offset=offset, msg_id=msg_id))
                if exists[key].get(timeout=self.broker_timeout) is None:
                    tx.create(path, data)
                else:
                    tx.set_data(path, data)
            results = tx.commit()
            failure = next((r for r in results if isinstance(r, Exception)), None)
            if failure is None:
                log.debug("committed %d offsets for group %s", len(offsets), self.group)
                return
            if not isinstance(failure, NodeExistsError | NoNodeError) or attempt == 2:
                raise CoordinationError(f"committing offsets of group {self.group!r} failed: "
                                        f"{failure!r}")

    # -- brokers -----------------------------------------------------------------------------

    def _conn(self, broker_id: int) -> BrokerConnection:
        conn = self._conns.get(broker_id)
        if conn is not None:
            if conn.idle_and_open():
                return conn
            del self._conns[broker_id]  # the broker closed it meanwhile (restarted)
        address = self.address(broker_id)
        if address is None:
            raise ConnectionClosedError(f"broker {broker_id} is not registered in ZooKeeper "
                                        f"(no master or slave node under "
                                        f"{self.layout.broker_id(broker_id)})")
        try:
            conn = BrokerConnection(*address, timeout=self.broker_timeout)
        except BrokerUnavailableError as e:
            raise ConnectionClosedError(f"cannot connect to broker {broker_id} at "
                                        f"{address[0]}:{address[1]}: {e}") from None
        self._conns[broker_id] = conn
        return conn

    def _call(self, topic: str, partition: str, what: str, fn):  # type: ignore[no-untyped-def]
        part = parse_partition(partition)
        try:
            return fn(self._conn(part.broker_id), part.index)
        except (BrokerUnavailableError, ProtocolError) as e:
            conn = self._conns.pop(part.broker_id, None)
            if conn is not None:
                conn.close()
            raise ConnectionClosedError(f"broker {part.broker_id} did not answer {what} for "
                                        f"{topic} {partition}: {e}") from None

    def nearest(self, topic: str, partition: str, offset: int) -> int:
        """The broker's ``offset`` answer: a message boundary at or before
        ``offset`` (a Java broker answers a segment start), clamped to the log."""
        return self._call(topic, partition, "the offset command",
                          lambda c, i: c.offset(topic, self.group, i, offset))

    def bounds(self, topic: str, partition: str) -> tuple[int, int]:
        """(first offset, end offset) of the partition's log."""
        return (self.nearest(topic, partition, 0), self.nearest(topic, partition, LOG_END))

    def offset_for_time(self, topic: str, partition: str, when_ms: int) -> TimeSeek:
        """The first message at or after ``when_ms`` (msgId time), by a binary
        search over the partition (:func:`metaq.net.offset_for_time`)."""
        return self._call(topic, partition, "a search by time",
                          lambda c, i: offset_for_time(c, topic, i, when_ms, group=self.group))

    def sample(self, topic: str, partition: str, start: int, size: int) -> tuple[list[int], int]:
        """The message boundaries of one ``get`` of ``size`` bytes at ``start``
        (absolute: each message's start, then the end of the last whole one) and the
        msgId of the first message (-1 when none): what admission control counts
        messages with, and lag its age with."""
        try:
            data = self._call(topic, partition, "get",
                              lambda c, i: c.get(topic, self.group, i, start, size))
        except BrokerError as e:
            if e.code == 404:
                return [start], -1
            raise
        found = walk(data, verify=False)
        bounds = [start + b for b in found.bounds.to_pylist()]
        first_id = int.from_bytes(data[8:16], "big", signed=True) if found.count else -1
        if not found.count and len(data) >= HEADER_SIZE:  # one message bigger than the get
            length = int.from_bytes(data[:4], "big", signed=True)
            if length >= 0:
                bounds = [start, start + HEADER_SIZE + length]
                first_id = int.from_bytes(data[8:16], "big", signed=True)
        return bounds, first_id

    def walk_boundary(self, topic: str, partition: str, start: int, limit: int) -> int:
        """The end of the last complete message starting at or after ``start``
        within ``limit`` bytes, found by fetching and walking; at least the end
        of the first message (so a message bigger than ``limit`` still moves)."""
        size = max(min(limit, 1 << 20), HEADER_SIZE)
        while True:
            try:
                data = self._call(topic, partition, "get",
                                  lambda c, i, s=size: c.get(topic, self.group, i, start, s))
            except BrokerError as e:
                if e.code == 404:
                    return start
                raise
            found = walk(data, verify=False)
            if found.count:
                return start + found.stop
            if len(data) >= HEADER_SIZE:
                length = int.from_bytes(data[:4], "big", signed=True)
                if length >= 0:
                    return start + HEADER_SIZE + length
            if len(data) < size:
                return start
            size *= 2
