"""Batch reads of the metaq source against real brokers and ZooKeeper."""

from __future__ import annotations

import json

import pytest

from metaq import Producer

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


def test_big_partitions_split_into_byte_ranges_over_two_brokers(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("big", parts=2, brokers=2)
    bodies = [b"%05d:" % i + b"p" * (50 + i % 200) for i in range(2000)]
    sent = topic.produce(bodies)
    df = _read(spark, topic.options(maxBytesPerPartition="16384"))
    ends: dict[str, int] = {}
    for b, s in zip(bodies, sent, strict=True):
        ends[s.partition] = max(ends.get(s.partition, 0), s.offset + 20 + len(b))
    assert len(ends) == 4
    assert df.rdd.getNumPartitions() == sum(-(-e // 16384) for e in ends.values())
    rows = df.collect()  # Spark partition order, and read order inside each
    assert sorted((r.partition, r.offset, bytes(r.value)) for r in rows) == \
        sorted((s.partition, s.offset, b) for b, s in zip(bodies, sent, strict=True))
    assert {r.broker_id for r in rows} == {0, 1}
    last: dict[str, int] = {}
    for r in rows:  # within a topic partition, rows come in log order across its ranges
        assert r.offset > last.get(r.partition, -1)
        last[r.partition] = r.offset


def test_starting_and_ending_offsets(spark, make_topic, zk_client) -> None:  # type: ignore[no-untyped-def]
    from zk_layout import Layout, StoredOffset, encode_offset

    topic = make_topic("window", parts=2)
    bodies = [b"w%03d" % i for i in range(100)]
    sent = topic.produce(bodies)
    by_part: dict[str, list] = {}
    for b, s in zip(bodies, sent, strict=True):
        by_part.setdefault(s.partition, []).append((s.offset, b))
    layout = Layout()
    zk_client.ensure_path(layout.offsets_dir("reader", "window"))
    tenth = sorted(by_part["0-0"])[10][0]
    zk_client.create(layout.offset("reader", "window", "0-0"),
                     encode_offset(StoredOffset(offset=tenth, msg_id=1)))
    from_group = _read(spark, topic.options(group="reader", startingOffsets="group"))
    assert from_group.count() == 100 - 10  # 0-1 has no commit: from its start
    twentieth = sorted(by_part["0-1"])[20][0]
    window = _read(spark, topic.options(
        startingOffsets=json.dumps({"window": {"0-1": twentieth}}),
        endingOffsets=json.dumps({"window": {"0-0": tenth}})))
    got = sorted((r.partition, r.offset) for r in window.collect())
    assert got == sorted([("0-0", o) for o, _ in sorted(by_part["0-0"])[:10]] +
                         [("0-1", o) for o, _ in sorted(by_part["0-1"])[20:]])
    assert _read(spark, topic.options(startingOffsets="latest")).count() == 0
    assert _read(spark, topic.options(endingOffsets="group", group="reader")).count() == 10


def test_attribute_and_decoded_columns(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("texts", parts=1)
    topic.produce(["héllo", "wörld"], attribute="lang=de")
    rows = _read(spark, topic.options(codec="str")).orderBy("offset").collect()
    assert [(r.attribute, bytes(r.value), r.decoded) for r in rows] == [
        ("lang=de", "héllo".encode(), "héllo"), ("lang=de", "wörld".encode(), "wörld")]


def test_bad_reads_fail_with_a_clear_message(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("strict", parts=1)
    topic.produce([b"only"])
    with pytest.raises(Exception, match="unknown option 'endoffsets' for the metaq source"):
        _read(spark, topic.options(endOffsets="latest")).count()
    with pytest.raises(Exception, match="offset 999999 asked for strict 0-0 .* past the log end"):
        _read(spark, topic.options(endingOffsets='{"strict": {"0-0": 999999}}')).count()
    with pytest.raises(Exception, match="topic 'nowhere' has no partitions"):
        _read(spark, {"zk.connect": topic.zk_connect, "topic": "nowhere"}).count()


def test_offset_reset_for_a_damaged_or_out_of_range_group_offset(spark, make_topic,
                                                                  zk_client) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: offsetReset = earliest | latest | fail for the source, as the consumer's
    offset_reset: garbage in the group's offset node, an offset past the log end."""
    from zk_layout import Layout

    topic = make_topic("reset", parts=2)
    topic.produce([b"r%03d" % i for i in range(40)])
    layout = Layout()
    zk_client.ensure_path(layout.offsets_dir("resetter", "reset"))
    zk_client.create(layout.offset("resetter", "reset", "0-0"), b"garbage")
    zk_client.create(layout.offset("resetter", "reset", "0-1"), b"1-99999999999")
    group = dict(group="resetter", startingOffsets="group")
    assert _read(spark, topic.options(offsetReset="earliest", **group)).count() == 40
    assert _read(spark, topic.options(offsetReset="latest", **group)).count() == 0
    with pytest.raises(Exception, match="damaged committed offset|past the log end"):
        _read(spark, topic.options(offsetReset="fail", **group)).count()


def test_an_unwritten_partition_of_a_java_broker_reads_as_empty(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    """A Java broker answers ``offset`` with 404 "... is not exists" for a partition
    never written (issue 19): planning takes it as empty instead of failing."""
    topic = make_topic("sparse", parts=3, extra_args=["--java", "unwritten-404"])
    with Producer(topic.zk_connect, partitioner=lambda t, parts, body, key: "0-1") as p:
        sent = [p.send("sparse", b"only-%d" % i) for i in range(5)]
    assert {r.partition for r in sent} == {"0-1"}
    rows = _read(spark, topic.options()).collect()
    assert sorted(bytes(r.value) for r in rows) == [b"only-%d" % i for i in range(5)]
