"""How far a streaming query (or a group) is behind the brokers.

PySpark's Python data source API (4.3) has no way for a stream reader to add
custom metrics to a query's progress (Kafka's source reports
``avgOffsetsBehindLatest`` and friends through ``ReportsSourceMetrics``, which
Python sources cannot implement).  What the progress does show, through
``reportLatestOffset``, is each partition's log end as ``latestOffset`` beside
the query's ``endOffset``.  :func:`stream_lag` computes the rest on demand from
a query's last progress, from explicit offsets, or from a group's committed
offsets in ZooKeeper.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from metaq._errors import ConfigError
from metaq.spark._cluster import Cluster
from metaq.spark._options import DEFAULT_GROUP
from metaq.spark._ranges import (
    PartitionOffsets,
    log_bounds,
    measure_backlog,
    progress_end_offsets,
)
from zk_layout import DEFAULT_ROOT

__all__ = ["Lag", "PartitionLag", "stream_lag"]

_SAMPLE = 64 * 1024


@dataclass(frozen=True, kw_only=True)
class PartitionLag:
    """One partition: ``position`` (next byte to read), ``end`` (log end),
    ``bytes`` behind, ``messages`` behind (a count when ``messages_exact``, else
    bytes / the mean size of a 64 KiB sample at ``position``) and ``seconds``: the
    age of the oldest unread message from its msgId time, 0 when caught up."""

    topic: str
    partition: str
    position: int
    end: int
    bytes: int
    messages: int
    messages_exact: bool
    seconds: float


@dataclass(frozen=True, kw_only=True)
class Lag:
    """Totals (``seconds`` is the largest partition's) and the partitions."""

    bytes: int
    messages: int
    seconds: float
    partitions: tuple[PartitionLag, ...]


def stream_lag(zk_connect: str, *, query: Any = None, offsets: Mapping | None = None,
               group: str | None = None, topics: Iterable[str] | None = None,
               zk_root: str = DEFAULT_ROOT, zk_timeout: float = 15.0,
               now_ms: int | None = None) -> Lag:
    """Lag of exactly one of: ``query`` (a StreamingQuery, or its ``lastProgress``
    dict: the ``endOffset`` of its ``metaq`` sources), ``offsets`` (``{topic:
    {partition: offset}}``) or ``group`` (its committed offsets of ``topics``).
    Partitions of those topics that the positions do not name count from their log
    start.  One ``offset`` pair per partition and one 64 KiB ``get`` per partition
    that is behind."""
    if sum(x is not None for x in (query, offsets, group)) != 1:
        raise ConfigError("give exactly one of query, offsets or group")
    with Cluster(zk_connect, zk_root=zk_root, group=group or DEFAULT_GROUP,
                 zk_timeout=zk_timeout) as cluster:
        if query is not None:
            start = progress_end_offsets(query)
        elif offsets is not None:
            start = {str(t): {str(p): int(o) for p, o in ps.items()} for t, ps in offsets.items()}
        else:
            if topics is None:
                raise ConfigError("stream_lag(group=...) needs topics")
            start = {}
            for topic in topics:
                for part, stored in cluster.committed(topic, cluster.partitions(topic)).items():
                    if not isinstance(stored, Exception):
                        start.setdefault(topic, {})[part] = stored.offset
                start.setdefault(topic, {})
        ends: PartitionOffsets = {}
        for topic in sorted(start):
            bounds = log_bounds(cluster, topic, cluster.partitions(topic), skip_unreachable=True)
            ends[topic] = {p: last for p, (_first, last) in bounds.items()}
            for part, (first, _last) in bounds.items():  # behind the log start: from it
                if part in start[topic] and start[topic][part] < first:
                    start[topic][part] = first
        backlog = measure_backlog(cluster, start, ends, sample_bytes=_SAMPLE)
    now = time.time() * 1000 if now_ms is None else now_ms
    parts = []
    for topic in sorted(ends):
        for part in sorted(ends[topic]):
            end = ends[topic][part]
            b = backlog.get((topic, part))
            pos = b.start if b is not None else min(start.get(topic, {}).get(part, end), end)
            oldest = b.oldest_ms if b is not None else None
            parts.append(PartitionLag(
                topic=topic, partition=part, position=pos, end=end, bytes=max(end - pos, 0),
                messages=b.messages if b is not None else 0,
                messages_exact=b.exact if b is not None else True,
                seconds=max(now - oldest, 0) / 1000 if oldest is not None else 0.0))
    return Lag(bytes=sum(p.bytes for p in parts), messages=sum(p.messages for p in parts),
               seconds=max((p.seconds for p in parts), default=0.0), partitions=tuple(parts))
