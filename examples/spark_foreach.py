"""foreachPartition job: process each partition's new messages, then commit the group's offsets.

    python examples/spark_foreach.py --zk 127.0.0.1:2181 --topic orders --group billing \
        --out /data/billing

Plans offset ranges from the group's committed offsets to the log ends, runs
one Spark task per range that appends the messages to ``<out>/<partition>.txt``
(``offset<TAB>body`` lines), and commits the ranges' ends to ZooKeeper only
when every task succeeded.  Run it again: it processes only what arrived since.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def run(spark: Any, zk: str, topic: str, *, group: str, out: str) -> dict[tuple[str, str], int]:
    """Process what is new for ``group``; return the offsets committed."""
    from metaq.spark import foreach_partition, offset_ranges

    os.makedirs(out, exist_ok=True)
    ranges = offset_ranges(zk, topic, group=group, starting="group", ending="latest")

    def write(messages: Any) -> None:
        buffered: dict[str, list[str]] = {}
        for m in messages:
            buffered.setdefault(m.partition, []).append(
                f"{m.offset}\t{m.value.decode('utf-8', 'replace')}\n")
        for partition, lines in buffered.items():
            with open(os.path.join(out, f"{partition}.txt"), "a", encoding="utf-8") as f:
                f.writelines(lines)

    return foreach_partition(spark, ranges, write, zk_connect=zk, group=group)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--master", default="local[2]")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(args.master).appName("metaq-foreach-example")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        committed = run(spark, args.zk, args.topic, group=args.group, out=args.out)
    finally:
        spark.stop()
    for (topic, part), offset in sorted(committed.items()):
        print(f"{args.group} {topic} {part}: committed {offset}")
    if not committed:
        print("nothing new")
    return 0


if __name__ == "__main__":
    sys.exit(main())
