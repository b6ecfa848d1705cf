"""PySpark on Metaq topics: batch DataFrames, Structured Streaming, foreachPartition fetchers.

Needs the ``spark`` extra (pyspark, pyarrow); ``import metaq`` never imports this package.

Batch::

    from metaq.spark import register
    register(spark)                                   # the "metaq" data source
    df = (spark.read.format("metaq")
          .option("zk.connect", "zk1:2181/prod").option("topic", "orders")
          .option("startingOffsets", "earliest").option("endingOffsets", "latest")
          .load())

Streaming::

    q = (spark.readStream.format("metaq").option("zk.connect", zk)
         .option("topic", "orders").option("group", "orders-to-lake")
         .option("maxBytesPerTrigger", 64 << 20).load()
         .writeStream.format("parquet").option("checkpointLocation", ck).start(path))

RDD / foreachPartition::

    ranges = offset_ranges(zk, "orders", group="billing")
    foreach_partition(spark, ranges, handle, zk_connect=zk, group="billing")

Columns: ``topic``, ``partition`` (Metaq's ``"<brokerId>-<index>"``),
``broker_id``, ``offset`` (byte position), ``next_offset``, ``msg_id``,
``attribute`` (null when none), ``value`` (binary) and, with option
``codec`` (``str`` or ``msgpack``), ``decoded`` (string; msgpack as JSON).
One Spark partition per topic partition (split at ``maxBytesPerPartition``);
executors fetch straight from the brokers and build Arrow record batches;
the driver only plans.  Every message's CRC32 is checked unless
``verifyChecksums=false``; with the C speedups (metaq.protocol._fast) the walk and
the check are one call per fetched reply, without them the check is most of
the read's Python cost (see bench/RESULTS.md).  All options:
:class:`SourceOptions`.

Kafka-style options (issue 16)
------------------------------
``subscribePattern``, ``startingTimestamp``, ``startingOffsetsByTimestamp``
(``startingOffsetsByTimestampStrategy``), ``endingTimestamp``,
``endingOffsetsByTimestamp``, ``maxOffsetsPerTrigger``, ``minOffsetsPerTrigger``
and ``maxTriggerDelay`` mean what they mean for Spark's Kafka source; see the
README's Spark section for the table.  Messages are counted in a byte-offset
log from one sampled ``get`` per waiting partition: exact where a partition's
share lies within its sample, else by the sample's mean message size cut at a
boundary the broker names (:class:`metaq.spark._ranges.Backlog`).  Python
sources cannot add custom metrics to a query's progress: :func:`stream_lag`
computes bytes, messages and seconds behind.

Streaming queries and the consumer group
----------------------------------------
A streaming query keeps its position in its Spark checkpoint, which is the
source of truth: a restart from the checkpoint resumes exactly where the last
completed micro-batch ended, whatever ZooKeeper says.  It *publishes* that
position to ZooKeeper under its ``group``
(``consumers/<group>/offsets/<topic>/<brokerId>-<part>``, Metaq's
``<msgId>-<offset>`` with msgId ``-1``), so ``python -m zk_layout`` and
Metaq's tools show a streaming job's progress like any consumer's.  The write
happens when Spark plans the next micro-batch (``latestOffset``, whose start
is the end of the last completed batch; this also records the final batch of
an ``availableNow`` run) and in ``commit()``; all partitions go in one
ZooKeeper transaction.  When a running query is stopped, ZooKeeper can trail
the checkpoint by the last micro-batch: :func:`commit_query_offsets`
publishes the final position after ``query.stop()``.  A new query (no checkpoint)
starts from the group's committed offsets by default
(``startingOffsets=group``; earliest where none).

A streaming query does not register as a group member and owns no
partitions: it reads *every* partition of its topics, which a member of a
Metaq group never does.  So it **refuses a group that has live members**:
starting the query, planning each micro-batch and every commit first list
``consumers/<group>/ids``, and if any consumer is registered the query fails
with :class:`LiveGroupError` naming them, instead of silently overwriting
their offsets (or having its own overwritten).  Give a streaming job a group
of its own; to hand a group over between a streaming job and ordinary
consumers, stop one side before starting the other (the offsets carry over
both ways).  A consumer that joins while the query runs makes the query fail
at its next micro-batch (the check and the write are two steps, so one commit
can race a consumer registering in between).  ``commitOffsets=false`` turns
the ZooKeeper writes (and the check) off.  The same rule holds for
:func:`foreach_partition`.  Two Spark jobs on one group are not detected:
don't.  With
``spark.sql.streaming.asyncProgressTrackingEnabled`` Spark may plan before
the previous batch is done; leave it off when ZooKeeper offsets matter.
"""

from __future__ import annotations

from typing import Any

from metaq.spark._cluster import LiveGroupError
from metaq.spark._fetch import FetchSettings, RangeMessage, fetch_range
from metaq.spark._lag import Lag, PartitionLag, stream_lag
from metaq.spark._options import OffsetSpec, SourceOptions
from metaq.spark._ranges import OffsetRange
from metaq.spark._rdd import (
    commit_query_offsets,
    commit_ranges,
    foreach_partition,
    offset_ranges,
)
from metaq.spark._source import MetaqDataSource, spark_schema

__all__ = [
    "MetaqDataSource",
    "register",
    "spark_schema",
    "SourceOptions",
    "OffsetSpec",
    "OffsetRange",
    "RangeMessage",
    "FetchSettings",
    "offset_ranges",
    "fetch_range",
    "foreach_partition",
    "commit_ranges",
    "commit_query_offsets",
    "msg_id_timestamp",
    "LiveGroupError",
    "stream_lag",
    "Lag",
    "PartitionLag",
]


def register(spark: Any) -> None:
    """Register the ``metaq`` data source with ``spark`` (a SparkSession)."""
    spark.dataSource.register(MetaqDataSource)


def msg_id_timestamp(column: Any = "msg_id") -> Any:
    """A Column: the broker's wall-clock time (ms precision) encoded in a msgId,
    as a timestamp (``(msgId >> 22) + 1303895660503`` ms since the epoch)."""
    from pyspark.sql import functions as F

    from metaq.protocol import MSG_ID_EPOCH_MS

    col = F.col(column) if isinstance(column, str) else column
    return F.timestamp_millis(F.shiftright(col, 22) + F.lit(MSG_ID_EPOCH_MS))
