"""Spark batch read: 2,000,000 messages of 100 B over 8 partitions, into a count and a group-by.

Setup (not timed): the embedded ZooKeeper, one broker subprocess serving topic
``bench`` with 8 partitions, ``metaq produce --count 2000000 --size 100``.

Timed, in one local[2] SparkSession (no C1-only JIT flag: this is steady-state
speed), alternating so that background load hits both alike:

- ``metaq``: ``spark.read.format("metaq")`` over the topic (executors fetch
  from the broker, check CRC32s, build Arrow batches); also with
  ``verifyChecksums=false``;
- ``ceiling``: an in-memory Python data source with the same schema and the
  same number of rows in 8 partitions, yielding prebuilt Arrow batches of the
  same size without fetching anything: what Spark itself can take in from a
  Python source in this run.

Each query: ``df.count()`` and ``df.groupBy("partition").agg(count, sum(length(value)))``.
Reported: median seconds over ``--runs`` runs, rows/s, and metaq/ceiling as a
percentage of the ceiling's speed (target >= 80%).

Run: ``.venv/bin/python bench/bench_spark.py [--runs 5] [--messages 2000000] [--vary]``
(``--vary``: bodies of 50..150 B, mean 100, so the walker takes its general path).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPIC, PARTS, SIZE = "bench", 8, 100


def start_broker(zk: str, data: Path) -> tuple[subprocess.Popen, int]:
    from metaq.testing import free_port

    port = free_port()
    log = open(data.with_suffix(".log"), "wb")  # noqa: SIM115 - lives as long as the broker
    proc = subprocess.Popen(
        [sys.executable, "-m", "metaq", "broker", "start", "--zk", zk, "--id", "0",
         "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data),
         "--topic", f"{TOPIC}:{PARTS}"], stdout=log, stderr=subprocess.STDOUT)
    return proc, port


def wait_registered(zk: str, timeout: float = 60) -> None:
    from kazoo.client import KazooClient

    from metaq.testing import wait_until
    from zk_layout import Layout

    client = KazooClient(hosts=zk)
    client.start(timeout=30)
    try:
        path = Layout().topic_pub(TOPIC, 0)
        wait_until(lambda: client.exists(path) is not None, timeout, 0.05,
                   what="the broker to register")
    finally:
        client.stop()
        client.close()


def body_size(i: int, vary: bool) -> int:
    """Message i's body size: 100 B, or with ``vary`` 50..150 B (mean 100) in a
    fixed pseudo-random order that the ceiling source reproduces."""
    return 50 + (i * 7919) % 101 if vary else SIZE


def produce(zk: str, count: int, vary: bool) -> float:
    start = time.perf_counter()
    if vary:
        from metaq import Producer

        with Producer(zk, send_timeout=60.0, max_in_flight=65536) as producer:
            futures = [producer.send_async(TOPIC, b"v" * body_size(i, True))
                       for i in range(count)]
            for f in futures:
                f.result(120)
        return time.perf_counter() - start
    out = subprocess.run([sys.executable, "-m", "metaq", "produce", "--zk", zk, "--topic", TOPIC,
                          "--count", str(count), "--size", str(SIZE), "--send-timeout", "60"],
                         capture_output=True, text=True, check=False)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode != 0 or f"acknowledged {count} of {count}" not in last:
        raise SystemExit(f"produce failed: {last}\n{out.stderr[-2000:]}")
    return time.perf_counter() - start


def ceiling_source(total: int, batch_rows: int, vary: bool):  # type: ignore[no-untyped-def]
    """A Python data source yielding prebuilt batches shaped like metaq's."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from metaq.spark import spark_schema

    per_part = total // PARTS

    class Reader(DataSourceReader):
        def partitions(self):  # type: ignore[no-untyped-def]
            return [InputPartition(i) for i in range(PARTS)]

        def read(self, partition):  # type: ignore[no-untyped-def]
            import pyarrow as pa

            from metaq.spark._arrow import arrow_schema

            n = batch_rows
            name = f"0-{partition.value}"
            sizes = [body_size(i, vary) for i in range(n)]
            ends = [0]
            for size in sizes:
                ends.append(ends[-1] + size)
            base = pa.array([e + 20 * i for i, e in enumerate(ends)], pa.int64())
            batch = pa.RecordBatch.from_arrays([
                pa.repeat(pa.scalar(TOPIC, pa.string()), n),
                pa.repeat(pa.scalar(name, pa.string()), n),
                pa.repeat(pa.scalar(0, pa.int32()), n), base[:n], base[1:],
                pa.array(range(n), pa.int64()), pa.nulls(n, pa.string()),
                pa.Array.from_buffers(pa.binary(), n, [
                    None, pa.array(ends, pa.int32()).buffers()[1],
                    pa.py_buffer(b"x" * ends[-1])]),
            ], schema=arrow_schema())
            left = per_part
            while left > 0:
                yield batch if left >= n else batch.slice(0, left)
                left -= n

    class Ceiling(DataSource):
        @classmethod
        def name(cls) -> str:
            return "metaq_bench_ceiling"

        def schema(self):  # type: ignore[no-untyped-def]
            return spark_schema()

        def reader(self, schema):  # type: ignore[no-untyped-def]
            return Reader()

    return Ceiling


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(exclude: set[int]) -> float:
    """CPU seconds (user + system) used so far by this process and all its
    descendants (the Spark JVM, its Python workers, the broker), minus
    ``exclude`` (ZooKeeper) -- a measure that other load on the machine
    disturbs far less than wall time."""
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        parent[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / _TICK
    me = os.getpid()
    total = 0.0
    for pid, used in cpu.items():
        p = pid
        while p not in (0, 1, me) and p not in exclude:
            p = parent.get(p, 0)
        if p == me and pid not in exclude:
            total += used
    return total


def run_queries(df, exclude: set[int]) -> tuple[float, float, float, float, int]:  # type: ignore[no-untyped-def]
    """(count s, group-by s, count cpu-s, group-by cpu-s, rows)."""
    from pyspark.sql import functions as F

    c0, t0 = tree_cpu(exclude), time.perf_counter()
    n = df.count()
    c1, t1 = tree_cpu(exclude), time.perf_counter()
    rows = df.groupBy("partition").agg(F.count("*").alias("n"),
                                       F.sum(F.length("value")).alias("bytes")).collect()
    c2, t2 = tree_cpu(exclude), time.perf_counter()
    if sum(r.n for r in rows) != n or len(rows) != PARTS:
        raise SystemExit(f"group-by disagrees with count: {rows} vs {n}")
    return t1 - t0, t2 - t1, c1 - c0, c2 - c1, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--messages", type=int, default=2_000_000)
    ap.add_argument("--vary", action="store_true",
                    help="bodies of 50..150 B (mean 100) instead of exactly 100 B")
    args = ap.parse_args()
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from metaq._zk import ZooKeeperServer
    from metaq.spark import register

    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp, ZooKeeperServer() as zk:
        broker, _port = start_broker(zk.hosts, Path(tmp) / "broker0")
        try:
            wait_registered(zk.hosts)
            took = produce(zk.hosts, args.messages, args.vary)
            from metaq.protocol import SPEEDUPS_STATUS
            from metaq.spark._arrow import CRC32_IMPL

            print(f"produced {args.messages} messages of {'50..150' if args.vary else SIZE} B "
                  f"in {took:.1f}s; C speedups: {SPEEDUPS_STATUS}; Python CRC32 by {CRC32_IMPL}",
                  flush=True)
            spark = (SparkSession.builder.master("local[2]").appName("bench-spark")
                     .config("spark.ui.enabled", "false")
                     .config("spark.ui.showConsoleProgress", "false")
                     .config("spark.sql.shuffle.partitions", "2")
                     .config("spark.sql.adaptive.enabled", "false")
                     .config("spark.driver.host", "127.0.0.1")
                     .config("spark.driver.bindAddress", "127.0.0.1")
                     .config("spark.driver.memory", "2g")
                     .getOrCreate())
            spark.sparkContext.setLogLevel("ERROR")
            register(spark)
            batch_rows = (1 << 20) // (SIZE + 20)  # rows in one 1 MiB broker reply
            spark.dataSource.register(ceiling_source(args.messages, batch_rows, args.vary))
            frames = {
                "metaq": spark.read.format("metaq").option("zk.connect", zk.hosts)
                .option("topic", TOPIC).load(),
                "metaq-nocrc": spark.read.format("metaq").option("zk.connect", zk.hosts)
                .option("topic", TOPIC).option("verifyChecksums", "false").load(),
                "ceiling": spark.read.format("metaq_bench_ceiling").load(),
            }
            exclude = {zk.pid} if zk.pid else set()
            for df in frames.values():  # warm-up: JIT, workers, first-query costs
                run_queries(df, exclude)
            times: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in frames}
            for run in range(args.runs):
                for name, df in frames.items():
                    count_s, group_s, count_cpu, group_cpu, n = run_queries(df, exclude)
                    if n != args.messages:
                        raise SystemExit(f"{name} counted {n} rows, expected {args.messages}")
                    times[name].append((count_s, group_s, count_cpu, group_cpu))
                    print(f"run {run + 1} {name:12s} count {count_s:6.2f}s ({count_cpu:5.2f} "
                          f"cpu-s)  group-by {group_s:6.2f}s ({group_cpu:5.2f} cpu-s)",
                          flush=True)
            spark.stop()
        finally:
            broker.terminate()
            broker.wait(30)
    med = {k: [statistics.median(r[i] for r in v) for i in range(4)] for k, v in times.items()}
    n = args.messages
    ceiling = med["ceiling"]
    sizes = "50..150" if args.vary else str(SIZE)
    print(f"\n{n} messages x {sizes} B, {PARTS} partitions, local[2], median of {args.runs} "
          f"(% = ceiling time / source time):")
    print(f"{'source':12s} {'count s':>8s} {'rows/s':>10s} {'%':>5s} {'cpu-s':>6s} {'%':>5s} "
          f"{'group-by s':>11s} {'rows/s':>10s} {'%':>5s} {'cpu-s':>6s} {'%':>5s}")
    for name, (c, g, cc, gc) in med.items():
        print(f"{name:12s} {c:8.2f} {n / c:10,.0f} {ceiling[0] / c:5.0%} {cc:6.2f} "
              f"{ceiling[2] / cc:5.0%} {g:11.2f} {n / g:10,.0f} {ceiling[1] / g:5.0%} "
              f"{gc:6.2f} {ceiling[3] / gc:5.0%}")

if __name__ == "__main__":
    main()
