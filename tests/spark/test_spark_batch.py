"""Batch reads of the metaq source against real brokers and ZooKeeper."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.spark


def _read(spark, options):  # type: ignore[no-untyped-def]
    reader = spark.read.format("metaq")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def test_batch_read_equals_what_was_produced(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("orders", parts=4)
    bodies = [f"order-{i:05d}-".encode() + bytes([i % 251]) * (i % 37) for i in range(3000)]
    sent = topic.produce(bodies)
    rows = _read(spark, topic.options()).collect()
    assert len(rows) == len(bodies)
    by_part: dict[str, list] = {}
    for r in rows:
        by_part.setdefault(r.partition, []).append(r)
    expected: dict[str, list] = {}
    for body, res in zip(bodies, sent, strict=True):
        expected.setdefault(res.partition, []).append((res.offset, res.msg_id, body))
    assert set(by_part) == set(expected)
    for part, exp in expected.items():
        got = sorted(by_part[part], key=lambda r: r.offset)
        assert [(r.offset, r.msg_id, bytes(r.value)) for r in got] == sorted(exp)
        assert all(r.topic == "orders" and r.broker_id == 0 and r.attribute is None for r in got)
        assert all(a.next_offset == b.offset for a, b in zip(got, got[1:], strict=False))
