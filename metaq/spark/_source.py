"""The ``metaq`` PySpark data source: batch reader and micro-batch stream reader.

Planning (``partitions``, ``initialOffset``, ``latestOffset``, ``commit``)
opens a :class:`~metaq.spark._cluster.Cluster` for the call and closes it
before returning, because Spark runs these in separate, long-lived Python
processes and never calls ``stop()``.  ``read`` runs in executor workers on a
pickled reader: it holds only options and opens its broker connection per
partition.  Batches are Arrow record batches (see :mod:`metaq.spark._arrow`).

Streaming offsets are ``{"<topic>": {"<brokerId>-<index>": <byte offset>}}``
with keys sorted, so equal positions always serialise to equal JSON (Spark
compares the JSON text to tell whether there is new data).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

from metaq._errors import ConfigError
from metaq.spark._arrow import DECODED_COLUMN, Where, arrow_schema, chunk_to_batch
from metaq.spark._cluster import Cluster
from metaq.spark._fetch import FetchSettings, iter_chunks
from metaq.spark._options import SourceOptions
from metaq.spark._ranges import (
    OffsetRange,
    PartitionOffsets,
    cap_messages,
    cap_offsets,
    log_bounds,
    measure_backlog,
    plan_ranges,
    resolve,
)
from zk_layout import metaq_sort_key, parse_partition

__all__ = ["MetaqDataSource", "spark_schema", "RangePartition"]

log = logging.getLogger(__name__)


def spark_schema(codec: str | None = None) -> StructType:
    """The source's columns (``decoded`` only when a codec is chosen)."""
    fields = [
        StructField("topic", StringType(), nullable=False),
        StructField("partition", StringType(), nullable=False),
        StructField("broker_id", IntegerType(), nullable=False),
        StructField("offset", LongType(), nullable=False),
        StructField("next_offset", LongType(), nullable=False),
        StructField("msg_id", LongType(), nullable=False),
        StructField("attribute", StringType(), nullable=True),
        StructField("value", BinaryType(), nullable=False),
    ]
    if codec is not None:
        fields.append(StructField(DECODED_COLUMN, StringType(), nullable=True))
    return StructType(fields)


class RangePartition(InputPartition):
    """One Spark input partition: an :class:`OffsetRange` (its ``value``)."""

    def __init__(self, rng: OffsetRange) -> None:
        super().__init__(rng)


def _cluster(opts: SourceOptions) -> Cluster:
    return Cluster(opts.zk_connect, zk_root=opts.zk_root, group=opts.group,
                   zk_timeout=opts.zk_timeout, broker_timeout=opts.broker_timeout,
                   read_from=opts.read_from)


def _settings(opts: SourceOptions) -> FetchSettings:
    return FetchSettings(group=opts.group, fetch_size=opts.fetch_size,
                         verify_checksums=opts.verify_checksums,
                         fail_on_data_loss=opts.fail_on_data_loss,
                         broker_timeout=opts.broker_timeout,
                         retry_timeout=opts.broker_retry_timeout,
                         zk_connect=opts.zk_connect, zk_root=opts.zk_root,
                         zk_timeout=opts.zk_timeout, read_from=opts.read_from)


def read_batches(rng: OffsetRange, settings: FetchSettings, codec: str | None,
                 schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The record batches of one range, one per broker reply."""
    where = Where(topic=rng.topic, partition=rng.partition, broker_id=rng.broker_id)
    for data, base, found in iter_chunks(rng, settings):
        yield chunk_to_batch(data, found, base, where, schema, codec)


def _sorted(offsets: PartitionOffsets) -> PartitionOffsets:
    return {t: {p: offsets[t][p] for p in sorted(offsets[t], key=metaq_sort_key)}
            for t in sorted(offsets)}


def _topics(cluster: Cluster, opts: SourceOptions) -> tuple[str, ...]:
    """The topics to read now: the ``topic`` option, or those matching ``subscribePattern``."""
    pattern = opts.pattern()
    return opts.topics if pattern is None else tuple(cluster.matching_topics(pattern))


class _Reading:
    """What batch and stream readers share: options, the Arrow schema, ``read``."""

    def __init__(self, opts: SourceOptions) -> None:
        self.opts = opts
        self.settings = _settings(opts)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        rng = getattr(partition, "value", None)
        if rng is None:  # Spark's one empty partition when there is nothing to read
            return iter(())
        return read_batches(rng, self.settings, self.opts.codec, arrow_schema(self.opts.codec))


class MetaqBatchReader(_Reading, DataSourceReader):
    """``spark.read.format("metaq")``: ranges planned once, read by the executors."""

    def partitions(self) -> Sequence[InputPartition]:
        opts = self.opts
        with _cluster(opts) as cluster:
            topics = _topics(cluster, opts)
            if not topics:
                raise ConfigError(f"option subscribePattern {opts.subscribe_pattern!r} matches "
                                  f"no topic under {cluster.layout.topics_sub()}")
            ranges = plan_ranges(cluster, topics, opts.starting(streaming=False),
                                 opts.ending(), fail_on_data_loss=opts.fail_on_data_loss,
                                 max_bytes=opts.max_bytes_per_partition,
                                 offset_reset=opts.offset_reset)
        log.info("metaq batch read of %s: %d ranges, %d bytes", ",".join(topics),
                 len(ranges), sum(r.size for r in ranges))
        return [RangePartition(r) for r in ranges]


class MetaqStreamReader(_Reading, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("metaq")``: see the package docstring for how
    it commits and how it treats live consumers of its group."""

    def __init__(self, opts: SourceOptions) -> None:
        super().__init__(opts)
        # Not raised here: PySpark's stream runner calls streamReader() inside a
        # ``try: ... finally: reader.stop()``, so an error here reaches the user as
        # UnboundLocalError on ``reader``.  Each planning call raises it instead.
        given = opts.batch_only_given()
        self._error = None if not given else ConfigError(
            f"option{'s' if len(given) > 1 else ''} {', '.join(given)} "
            f"{'are' if len(given) > 1 else 'is'} for batch reads only (spark.read); a "
            f"stream (spark.readStream) has no end")
        self._target: PartitionOffsets | None = None
        self._committed: PartitionOffsets | None = None
        self._reported: PartitionOffsets | None = None
        self._last_trigger: float | None = None

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # -- positions ---------------------------------------------------------------------------

    def initialOffset(self) -> dict:
        self._check()
        opts = self.opts
        start = opts.starting(streaming=True)
        out: PartitionOffsets = {}
        with _cluster(opts) as cluster:
            if opts.commit_offsets:
                cluster.check_no_live_members("starting a streaming query")
            for topic in _topics(cluster, opts):
                parts = cluster.partitions(topic)
                bounds = log_bounds(cluster, topic, parts, skip_unreachable=False)
                out[topic] = resolve(cluster, topic, parts, start, end=False,
                                     fail_on_data_loss=opts.fail_on_data_loss, bounds=bounds,
                                     offset_reset=opts.offset_reset)
        return _sorted(out)

    def _latest(self, cluster: Cluster, start: PartitionOffsets) -> PartitionOffsets:
        """Log ends now; partitions whose broker is unreachable (or that left
        ZooKeeper for a while) stay where ``start`` has them."""
        out: PartitionOffsets = {t: dict(p) for t, p in start.items()}
        for topic in _topics(cluster, self.opts):
            parts = cluster.partitions(topic)
            ends = log_bounds(cluster, topic, parts, skip_unreachable=True)
            row = out.setdefault(topic, {})
            for part, (_first, end) in ends.items():
                row[part] = max(end, row[part]) if part in row else end
        return out

    def getDefaultReadLimit(self) -> ReadLimit:
        """One limit stands for the options' limits (PySpark has no composite
        limit): :meth:`latestOffset` applies every limit option whenever Spark
        passes anything but ReadAllAvailable."""
        self._check()
        opts = self.opts
        if opts.max_offsets_per_trigger is not None:
            return ReadMaxRows(opts.max_offsets_per_trigger)
        if opts.max_bytes_per_trigger is not None:
            return ReadMaxBytes(opts.max_bytes_per_trigger)
        if opts.min_offsets_per_trigger is not None:
            return ReadMinRows(opts.min_offsets_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._check()
        with _cluster(self.opts) as cluster:
            self._target = self._latest(cluster, {})

    def reportLatestOffset(self) -> dict | None:
        """The log ends seen by the last latestOffset (Spark shows them as the
        source's ``latestOffset`` in the query progress; no broker call here)."""
        return self._reported

    def _admit(self, cluster: Cluster, start: PartitionOffsets, latest: PartitionOffsets,
               limit: ReadLimit) -> PartitionOffsets:
        """Kafka's admission control: minOffsetsPerTrigger / maxTriggerDelay, then
        maxBytesPerTrigger and maxOffsetsPerTrigger (both, whichever cuts first)."""
        opts = self.opts
        max_bytes = opts.max_bytes_per_trigger
        max_msgs = opts.max_offsets_per_trigger
        min_msgs = opts.min_offsets_per_trigger
        if isinstance(limit, ReadMaxBytes):
            max_bytes = limit.max_bytes
        elif isinstance(limit, ReadMaxRows):
            max_msgs = limit.max_rows
        elif isinstance(limit, ReadMinRows):
            min_msgs = limit.min_rows
        waiting = any(latest[t][p] > start.get(t, {}).get(p, -1) for t in latest
                      for p in latest[t])
        if not waiting:
            return latest
        backlog = None
        now = time.monotonic()
        if self._last_trigger is None:
            self._last_trigger = now  # the delay counts from the query's first plan
        # availableNow never waits (it would wait for messages that are not coming)
        if min_msgs is not None and self._target is None \
                and now - self._last_trigger < opts.max_trigger_delay:
            backlog = measure_backlog(cluster, start, latest)
            available = sum(b.messages for b in backlog.values())
            if available < min_msgs:
                log.debug("metaq: %d messages wait, fewer than minOffsetsPerTrigger=%d; "
                          "delaying the micro-batch", available, min_msgs)
                return {t: dict(ps) for t, ps in start.items()}  # no new batch
        if max_bytes is not None:
            latest = cap_offsets(cluster, start, latest, max_bytes)
        if max_msgs is not None:
            if backlog is None or max_bytes is not None:
                backlog = measure_backlog(cluster, start, latest)
            latest = cap_messages(cluster, start, latest, backlog, max_msgs)
        self._last_trigger = now
        return latest

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        self._check()
        opts = self.opts
        with _cluster(opts) as cluster:
            if opts.commit_offsets:
                cluster.check_no_live_members("planning a micro-batch")
                # Spark asks for the next batch only once the previous one is
                # done, so ``start`` is processed: commit it (this is also what
                # records the last batch of an availableNow run).
                self._commit(cluster, start)
            latest = self._latest(cluster, start)
            if self._target is not None:
                for topic, parts in latest.items():
                    for part in parts:
                        begin = start.get(topic, {}).get(part)
                        cap = self._target.get(topic, {}).get(part, begin)
                        if cap is None:  # appeared after the availableNow target was taken
                            parts[part] = None  # type: ignore[assignment]
                        elif begin is not None:
                            parts[part] = max(begin, min(parts[part], cap))
                        else:
                            parts[part] = min(parts[part], cap)
                latest = {t: {p: o for p, o in ps.items() if o is not None}
                          for t, ps in latest.items()}
            self._reported = _sorted(latest)
            if not isinstance(limit, ReadAllAvailable):
                latest = self._admit(cluster, start, latest, limit)
        return _sorted(latest)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        self._check()
        out = []
        with _cluster(self.opts) as cluster:
            for topic in sorted(end):
                for part in sorted(end[topic], key=metaq_sort_key):
                    until = end[topic][part]
                    begin = start.get(topic, {}).get(part)
                    if begin is None:  # a partition that appeared: from its log start
                        begin = cluster.nearest(topic, part, 0)
                    if until <= begin:
                        continue
                    rng = OffsetRange(topic=topic, partition=part, from_offset=begin,
                                      until_offset=until,
                                      address=cluster.address(parse_partition(part).broker_id))
                    out.append(RangePartition(rng))
        return out

    # -- progress ----------------------------------------------------------------------------

    def commit(self, end: dict) -> None:
        if not self.opts.commit_offsets:
            return
        with _cluster(self.opts) as cluster:
            self._commit(cluster, end)

    def _commit(self, cluster: Cluster, offsets: PartitionOffsets) -> None:
        offsets = _sorted(offsets)
        if offsets == self._committed:
            return
        cluster.commit({(t, p): (o, -1) for t, parts in offsets.items() for p, o in parts.items()})
        self._committed = offsets

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_committed"] = None
        return state


class MetaqDataSource(DataSource):
    """``spark.read.format("metaq")`` / ``spark.readStream.format("metaq")``.

    Options: see :class:`metaq.spark.SourceOptions` (``zk.connect`` and
    ``topic`` are required).
    """

    def __init__(self, options: dict) -> None:
        super().__init__(options)
        self._opts = SourceOptions.from_options(options)

    @classmethod
    def name(cls) -> str:
        return "metaq"

    def schema(self) -> StructType:
        return spark_schema(self._opts.codec)

    def reader(self, schema: StructType) -> DataSourceReader:
        return MetaqBatchReader(self._opts)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return MetaqStreamReader(self._opts)
