"""RDD-style consumption: plan offset ranges, fetch them in tasks, commit after success.

::

    ranges = offset_ranges(zk, "orders", group="billing")          # driver
    def handle(messages):                                           # executor
        for m in messages:
            ...
    foreach_partition(spark, ranges, handle, zk_connect=zk, group="billing")

:func:`foreach_partition` runs one Spark task per range and writes the
ranges' ends to ZooKeeper (one transaction, Metaq's ``<msgId>-<offset>``)
only after the whole job succeeded: a failing job commits nothing, so the
next run reads the same messages again (at-least-once).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from metaq._errors import ConfigError
from metaq._types import PartitionKey
from metaq.spark._cluster import Cluster
from metaq.spark._fetch import FetchSettings, RangeMessage, fetch_range
from metaq.spark._options import (
    DEFAULT_GROUP,
    EARLIEST,
    GROUP,
    LATEST,
    OffsetSpec,
    parse_offsets,
)
from metaq.spark._ranges import OffsetRange, plan_ranges, progress_end_offsets
from zk_layout import DEFAULT_ROOT

__all__ = ["offset_ranges", "foreach_partition", "commit_ranges", "commit_query_offsets"]

log = logging.getLogger(__name__)

_WORDS = {"earliest": EARLIEST, "latest": LATEST, "group": GROUP}


def _spec(name: str, value: str | Mapping | OffsetSpec, topics: tuple[str, ...]) -> OffsetSpec:
    if isinstance(value, OffsetSpec):
        return value
    if isinstance(value, str):
        return _WORDS.get(value.strip().lower()) or parse_offsets(name, value, topics)
    if isinstance(value, Mapping):
        import json

        return parse_offsets(name, json.dumps(value), topics)
    raise ConfigError(f"{name} must be 'earliest', 'latest', 'group' or a mapping "
                      f"{{topic: {{partition: offset}}}}, got {value!r}")


def _topics(topic: str | Iterable[str]) -> tuple[str, ...]:
    topics = (topic,) if isinstance(topic, str) else tuple(topic)
    if not topics:
        raise ConfigError("name at least one topic")
    return topics


def offset_ranges(zk_connect: str, topic: str | Iterable[str], *,
                  group: str = DEFAULT_GROUP,
                  starting: str | Mapping | OffsetSpec = "group",
                  ending: str | Mapping | OffsetSpec = "latest",
                  zk_root: str = DEFAULT_ROOT, max_bytes_per_range: int | None = None,
                  fail_on_data_loss: bool = True, zk_timeout: float = 15.0,
                  broker_timeout: float = 30.0, read_from: str = "master") -> list[OffsetRange]:
    """Per-partition ranges ``[from, until)`` to read, planned on the driver.

    ``starting`` / ``ending``: ``"earliest"``, ``"latest"``, ``"group"`` (the
    group's committed offsets; none committed means earliest) or
    ``{topic: {"<brokerId>-<index>": offset}}`` (``-2`` earliest, ``-1`` latest).
    Partitions with nothing to read are left out.  ``max_bytes_per_range``
    splits big partitions at message boundaries.  ``read_from``: each range's broker,
    ``master`` (the master while it is registered, else a slave) or ``slave-preferred``
    (a slave while one is registered, else the master).
    """
    topics = _topics(topic)
    start = _spec("starting", starting, topics)
    end = _spec("ending", ending, topics)
    if end.kind == "json" and any(v == -2 for p in end.per_partition.values()
                                  for v in p.values()):
        raise ConfigError("ending: -2 (earliest) is not allowed as an end")
    with Cluster(zk_connect, zk_root=zk_root, group=group, zk_timeout=zk_timeout,
                 broker_timeout=broker_timeout, read_from=read_from) as cluster:
        return plan_ranges(cluster, topics, start, end, fail_on_data_loss=fail_on_data_loss,
                           max_bytes=max_bytes_per_range)


def commit_ranges(zk_connect: str, ranges: Iterable[OffsetRange], *, group: str,
                  zk_root: str = DEFAULT_ROOT, msg_ids: Mapping[PartitionKey, int] | None = None,
                  zk_timeout: float = 15.0) -> dict[PartitionKey, int]:
    """Write each partition's furthest ``until_offset`` under ``group`` in one
    ZooKeeper transaction (refused while the group has live consumers).
    Returns ``{(topic, partition): offset}`` as committed."""
    ends: dict[PartitionKey, int] = {}
    for rng in ranges:
        key = (rng.topic, rng.partition)
        ends[key] = max(ends.get(key, rng.until_offset), rng.until_offset)
    ids = msg_ids or {}
    with Cluster(zk_connect, zk_root=zk_root, group=group, zk_timeout=zk_timeout) as cluster:
        cluster.commit({key: (offset, ids.get(key, -1)) for key, offset in ends.items()})
    return ends


def foreach_partition(spark: Any, ranges: Iterable[OffsetRange],
                      func: Callable[[Iterator[RangeMessage]], Any], *, zk_connect: str,
                      group: str, zk_root: str = DEFAULT_ROOT, commit: bool = True,
                      settings: FetchSettings | None = None,
                      **fetch_options: Any) -> dict[PartitionKey, int]:
    """Run ``func(messages)`` once per range in Spark tasks, then commit.

    ``spark`` is a SparkSession or SparkContext.  Each task reads its range
    straight from the broker (:func:`fetch_range`) and hands ``func`` an
    iterator of :class:`RangeMessage`.  When every task has returned, the
    ranges' ends are committed to ZooKeeper under ``group`` (with the msgId
    of each partition's last message when ``func`` read them all, else -1);
    if any task raised, the job fails with
    Spark's error and nothing is committed.  A range counts as processed when
    ``func`` returns, whether or not it read every message.  Returns what was
    committed (``{}`` with ``commit=False``).  ``fetch_options`` are fields of
    :class:`FetchSettings`.
    """
    ranges = list(ranges)
    if settings is None:
        settings = FetchSettings(group=group, zk_connect=zk_connect, zk_root=zk_root,
                                 **fetch_options)
    elif fetch_options:
        raise ConfigError("pass either settings= or fetch options, not both")
    if commit:  # fail before doing any work rather than after
        with Cluster(zk_connect, zk_root=zk_root, group=group,
                     zk_timeout=settings.zk_timeout) as cluster:
            cluster.check_no_live_members("running a foreach_partition job that commits")
    if not ranges:
        return {}
    sc = getattr(spark, "sparkContext", spark)

    def task(items: Iterator[tuple[int, OffsetRange]]) -> Iterator[tuple[int, int]]:
        for index, rng in items:
            last = [-1, False]  # msgId of the last message, whether func read them all

            def tracked(r: OffsetRange = rng, seen: list = last) -> Iterator[RangeMessage]:
                for message in fetch_range(r, settings):
                    seen[0] = message.msg_id
                    yield message
                seen[1] = True

            func(tracked())
            yield index, last[0] if last[1] else -1

    results = sc.parallelize(list(enumerate(ranges)), len(ranges)).mapPartitions(task).collect()
    if not commit:
        return {}
    msg_ids: dict[PartitionKey, int] = {}
    best: dict[PartitionKey, int] = {}
    for index, msg_id in results:
        rng = ranges[index]
        key = (rng.topic, rng.partition)
        if rng.until_offset >= best.get(key, -1):
            best[key] = rng.until_offset
            msg_ids[key] = msg_id
    committed = commit_ranges(zk_connect, ranges, group=group, zk_root=zk_root,
                              msg_ids=msg_ids, zk_timeout=settings.zk_timeout)
    log.info("foreach_partition: %d ranges done, committed %s for group %s", len(ranges),
             committed, group)
    return committed


def commit_query_offsets(query: Any, *, zk_connect: str, group: str, zk_root: str = DEFAULT_ROOT,
                         zk_timeout: float = 15.0) -> dict[PartitionKey, int]:
    """Publish a streaming query's last completed position to ZooKeeper.

    A running query writes its position when it plans the next micro-batch, so
    after ``query.stop()`` ZooKeeper can trail the checkpoint by the last
    batch; call this after stopping to bring it level.  Reads the end offset
    of every ``metaq`` source in ``query.lastProgress`` and commits it (msgId
    -1) under ``group``, refused while the group has live consumers.  Returns
    what was committed (``{}`` when the query made no progress).
    """
    offsets = {(topic, part): (offset, -1)
               for topic, parts in progress_end_offsets(query).items()
               for part, offset in parts.items()}
    if not offsets:
        return {}
    with Cluster(zk_connect, zk_root=zk_root, group=group, zk_timeout=zk_timeout) as cluster:
        cluster.commit(offsets)
    return {key: offset for key, (offset, _) in offsets.items()}
