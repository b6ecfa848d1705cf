"""Spark fixtures: one local[2] SparkSession for the whole run, brokers with a topic.

The session uses the "fast tests" settings measured for PySpark 4.x (see the
project's reference notes): local[2], no UI, 2 shuffle partitions, no AQE,
UTC, driver bound to 127.0.0.1, C1-only JIT, workers on this interpreter.
One warm-up read of the metaq source is done here so that the first test does
not pay the cost of the first data-source query.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.procs import BrokerProc, start_broker, stop_all

from metaq import Producer

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError:  # the 'spark' extra is not installed: nothing here can run
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    from metaq.spark import register

    warehouse = tmp_path_factory.mktemp("spark-warehouse")
    session = (SparkSession.builder.master("local[2]").appName("metaq-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.default.parallelism", "2")
               .config("spark.sql.adaptive.enabled", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1")
               .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1")
               .config("spark.sql.warehouse.dir", str(warehouse))
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    _warm_up(session)
    yield session
    session.stop()


def _warm_up(session: object) -> None:
    """One tiny read through a Python data source (pays the first-query cost once)."""
    from pyspark.sql.datasource import DataSource, DataSourceReader

    class _Reader(DataSourceReader):
        def read(self, partition: object) -> Iterator[tuple[int]]:
            yield (1,)

    class _WarmUp(DataSource):
        @classmethod
        def name(cls) -> str:
            return "metaq_warm_up"

        def schema(self) -> str:
            return "x int"

        def reader(self, schema: object) -> DataSourceReader:
            return _Reader()

    session.dataSource.register(_WarmUp)  # type: ignore[attr-defined]
    assert session.read.format("metaq_warm_up").load().count() == 1  # type: ignore[attr-defined]


class Topic:
    """A topic served by broker subprocesses, and a producer for it."""

    def __init__(self, zk_connect: str, name: str, brokers: list[BrokerProc]) -> None:
        self.zk_connect = zk_connect
        self.name = name
        self.brokers = brokers

    def produce(self, bodies: list[bytes], attribute: str | None = None,
                key_of=None) -> list:  # type: ignore[no-untyped-def]
        """Send every body (pipelined); return the SendResults in order."""
        with Producer(self.zk_connect, send_timeout=30.0,
                      partitioner="hash" if key_of else "roundrobin") as producer:
            futures = [producer.send_async(self.name, b, attribute,
                                           key_of(b) if key_of else None) for b in bodies]
            return [f.result(60) for f in futures]

    def options(self, **extra: str) -> dict[str, str]:
        return {"zk.connect": self.zk_connect, "topic": self.name, **extra}


@pytest.fixture
def make_topic(zk_connect: str, tmp_path: Path) -> Iterator[object]:
    """``make_topic(name, parts=4, brokers=1)`` starts brokers serving ``name``
    (and the topics of ``also``, ``{topic: parts}``: ``Topic(zk, other, t.brokers)``
    produces to them)."""
    procs: list[BrokerProc] = []

    def make(name: str = "events", parts: int = 4, brokers: int = 1,
             also: dict[str, int] | None = None, **kw: object) -> Topic:
        mine = []
        for _ in range(brokers):
            proc = start_broker(zk_connect, len(procs), tmp_path / f"broker{len(procs)}",
                                {name: parts, **(also or {})}, **kw)  # type: ignore[arg-type]
            procs.append(proc)
            mine.append(proc)
        return Topic(zk_connect, name, mine)

    yield make
    stop_all(procs)
