"""Batch job: read a Metaq topic as a DataFrame and summarise it per partition.

    python examples/spark_batch.py --zk 127.0.0.1:2181 --topic orders [--group reader]
        [--starting earliest|latest|group|JSON] [--ending latest|group|JSON]

Prints one line per partition (messages, bytes, first and last offset) and a
total.  Each executor fetches its partition's byte range straight from the
broker; the driver only plans.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def run(spark: Any, zk: str, topic: str, *, group: str = "metaq-spark",
        starting: str = "earliest", ending: str = "latest") -> list[tuple[str, int, int, int, int]]:
    """(partition, messages, bytes, first offset, last offset) per partition, in name order."""
    from pyspark.sql import functions as F

    from metaq.spark import register

    register(spark)
    df = (spark.read.format("metaq")
          .option("zk.connect", zk).option("topic", topic).option("group", group)
          .option("startingOffsets", starting).option("endingOffsets", ending)
          .load())
    rows = (df.groupBy("partition")
            .agg(F.count("*").alias("messages"), F.sum(F.length("value")).alias("bytes"),
                 F.min("offset").alias("first"), F.max("offset").alias("last"))
            .orderBy("partition").collect())
    return [(r.partition, r.messages, r.bytes, r.first, r.last) for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zk", required=True, help="ZooKeeper host:port[/chroot]")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", default="metaq-spark")
    ap.add_argument("--starting", default="earliest")
    ap.add_argument("--ending", default="latest")
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("metaq-batch-example")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        summary = run(spark, args.zk, args.topic, group=args.group, starting=args.starting,
                      ending=args.ending)
    finally:
        spark.stop()
    for part, n, size, first, last in summary:
        print(f"{args.topic} {part}: {n} messages, {size} bytes, offsets {first}..{last}")
    print(f"total: {sum(s[1] for s in summary)} messages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
