"""Streaming job: copy a Metaq topic into Parquet files, publishing progress to ZooKeeper.

    python examples/spark_streaming.py --zk 127.0.0.1:2181 --topic orders \
        --group orders-to-parquet --out /data/orders --checkpoint /data/orders.ck \
        [--available-now] [--max-bytes-per-trigger 67108864]

Without ``--available-now`` it runs until interrupted, a micro-batch every
second.  Restarting with the same ``--checkpoint`` resumes exactly where it
stopped.  The group's offsets in ZooKeeper follow the job (see them with
``python -m zk_layout --zk ... tree``); the group must have no live consumers.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def run(spark: Any, zk: str, topic: str, *, group: str, out: str, checkpoint: str,
        available_now: bool = True, max_bytes_per_trigger: int | None = None,
        timeout: float | None = None) -> Any:
    """Start the query (and, with ``available_now``, wait for it); return it."""
    from metaq.spark import register

    register(spark)
    reader = (spark.readStream.format("metaq")
              .option("zk.connect", zk).option("topic", topic).option("group", group))
    if max_bytes_per_trigger:
        reader = reader.option("maxBytesPerTrigger", str(max_bytes_per_trigger))
    writer = (reader.load()
              .selectExpr("topic", "partition", "offset", "msg_id", "attribute", "value")
              .writeStream.format("parquet").option("checkpointLocation", checkpoint))
    if available_now:
        query = writer.trigger(availableNow=True).start(out)
        query.awaitTermination(timeout)
    else:
        query = writer.trigger(processingTime="1 second").start(out)
    return query


def committed(zk: str, group: str, topic: str) -> dict[str, int]:
    """The group's offsets as any Metaq tool reads them (via zk_layout)."""
    from kazoo.client import KazooClient

    from zk_layout import take_snapshot

    client = KazooClient(hosts=zk)
    client.start(timeout=15)
    try:
        snap = take_snapshot(client)
    finally:
        client.stop()
        client.close()
    return {str(p.partition): p.offset.offset
            for g in snap.groups if g.group == group
            for t in g.topics if t.topic == topic
            for p in t.partitions if p.offset is not None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--available-now", action="store_true")
    ap.add_argument("--max-bytes-per-trigger", type=int, default=None)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("metaq-streaming-example")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        query = run(spark, args.zk, args.topic, group=args.group, out=args.out,
                    checkpoint=args.checkpoint, available_now=args.available_now,
                    max_bytes_per_trigger=args.max_bytes_per_trigger)
        if not args.available_now:
            try:
                query.awaitTermination()
            except KeyboardInterrupt:
                query.stop()
    finally:
        spark.stop()
    for part, offset in sorted(committed(args.zk, args.group, args.topic).items()):
        print(f"{args.group} {args.topic} {part}: committed {offset}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
