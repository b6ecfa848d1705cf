"""The jobs in examples/ run against real brokers and ZooKeeper."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.spark

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    # Not put in sys.modules: functions defined in it are pickled by value for the workers.
    spec = importlib.util.spec_from_file_location(f"metaq_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ends(bodies, sent) -> dict[str, int]:  # type: ignore[no-untyped-def]
    ends: dict[str, int] = {}
    for b, s in zip(bodies, sent, strict=True):
        ends[s.partition] = max(ends.get(s.partition, 0), s.offset + 20 + len(b))
    return ends


def test_batch_example(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("orders", parts=3)
    bodies = [b"order %d" % i for i in range(300)]
    sent = topic.produce(bodies)
    summary = _example("spark_batch").run(spark, topic.zk_connect, "orders")
    expect = {}
    for b, s in zip(bodies, sent, strict=True):
        n, size, first, last = expect.get(s.partition, (0, 0, s.offset, s.offset))
        expect[s.partition] = (n + 1, size + len(b), min(first, s.offset), max(last, s.offset))
    assert summary == [(p, *v) for p, v in sorted(expect.items())]


def test_batch_example_runs_as_a_script(make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("script", parts=2)
    topic.produce([b"a", b"bb", b"ccc"])
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "JAVA_TOOL_OPTIONS": "-XX:TieredStopAtLevel=1"}  # a JVM that starts faster
    out = subprocess.run([sys.executable, str(EXAMPLES / "spark_batch.py"),
                          "--zk", topic.zk_connect, "--topic", "script", "--master", "local[1]"],
                         capture_output=True, text=True, timeout=240, check=False, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "total: 3 messages"


def test_streaming_example(spark, make_topic, tmp_path) -> None:  # type: ignore[no-untyped-def]
    example = _example("spark_streaming")
    topic = make_topic("events", parts=2)
    bodies = [b"event %d" % i for i in range(400)]
    sent = topic.produce(bodies)
    query = example.run(spark, topic.zk_connect, "events", group="lake",
                        out=str(tmp_path / "out"), checkpoint=str(tmp_path / "ck"),
                        available_now=True, max_bytes_per_trigger=4096, timeout=240)
    assert not query.isActive and query.exception() is None
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert sorted((r.partition, r.offset, bytes(r.value)) for r in rows) == \
        sorted((s.partition, s.offset, b) for b, s in zip(bodies, sent, strict=True))
    assert example.committed(topic.zk_connect, "lake", "events") == _ends(bodies, sent)


def test_foreach_example_processes_only_what_is_new(spark, make_topic, tmp_path) -> None:  # type: ignore[no-untyped-def]
    example = _example("spark_foreach")
    topic = make_topic("payments", parts=2)
    first = [b"payment %d" % i for i in range(100)]
    sent = topic.produce(first)
    out = tmp_path / "out"
    assert example.run(spark, topic.zk_connect, "payments", group="billing", out=str(out)) == \
        {("payments", p): e for p, e in _ends(first, sent).items()}
    second = [b"late payment %d" % i for i in range(30)]
    sent2 = topic.produce(second)
    committed = example.run(spark, topic.zk_connect, "payments", group="billing", out=str(out))
    assert committed == {("payments", p): e for p, e in _ends(first + second, sent + sent2).items()}
    for part in ("0-0", "0-1"):
        lines = (out / f"{part}.txt").read_text().splitlines()
        expect = [f"{s.offset}\t{b.decode()}"
                  for b, s in zip(first + second, sent + sent2, strict=True) if s.partition == part]
        assert lines == sorted(expect, key=lambda line: int(line.split("\t")[0]))
