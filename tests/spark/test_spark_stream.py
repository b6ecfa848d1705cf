"""Structured Streaming with the metaq source: real brokers, ZooKeeper, file sinks."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from metaq.spark import commit_query_offsets
from metaq.testing import wait_until
from zk_layout import Layout, take_snapshot

pytestmark = pytest.mark.spark

GROUP = "stream-job"


def _stream(spark, options):  # type: ignore[no-untyped-def]
    reader = spark.readStream.format("metaq")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def _ends(bodies, results) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Each partition's log end after the sends (20-byte header + body)."""
    ends: dict[str, int] = {}
    for body, res in zip(bodies, results, strict=True):
        ends[res.partition] = max(ends.get(res.partition, 0), res.offset + 20 + len(body))
    return ends


def _committed(zk_client: KazooClient, topic: str, group: str = GROUP) -> dict[str, int]:
    """What zk_layout reads back as the group's committed offsets."""
    snap = take_snapshot(zk_client, Layout())
    for g in snap.groups:
        if g.group == group:
            for t in g.topics:
                if t.topic == topic:
                    return {str(p.partition): p.offset.offset for p in t.partitions
                            if p.offset is not None}
    return {}


def _sunk(spark, path) -> list[tuple[str, int, bytes]]:  # type: ignore[no-untyped-def]
    rows = spark.read.parquet(str(path)).select("partition", "offset", "value").collect()
    return sorted((r.partition, r.offset, bytes(r.value)) for r in rows)


def _expected(bodies, results) -> list[tuple[str, int, bytes]]:  # type: ignore[no-untyped-def]
    return sorted((r.partition, r.offset, b) for b, r in zip(bodies, results, strict=True))


def test_available_now_commits_and_restart_resumes_without_loss_or_duplicates(
        spark, make_topic, zk_client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("clicks", parts=3)
    first = [f"click-{i}".encode() * (1 + i % 5) for i in range(900)]
    sent = topic.produce(first)
    out, ck = tmp_path / "out", tmp_path / "ck"

    def run() -> object:
        df = _stream(spark, topic.options(group=GROUP, maxBytesPerTrigger="8192"))
        q = (df.writeStream.format("parquet").option("checkpointLocation", str(ck))
             .trigger(availableNow=True).start(str(out)))
        q.awaitTermination(240)
        assert not q.isActive and q.exception() is None
        return q

    q = run()
    assert _sunk(spark, out) == _expected(first, sent)
    assert q.lastProgress is not None and len(q.recentProgress) > 2  # the cap split it up
    assert _committed(zk_client, "clicks") == _ends(first, sent)

    second = [f"later-{i}".encode() for i in range(300)]
    sent2 = topic.produce(second)
    run()
    assert _sunk(spark, out) == _expected(first + second, sent + sent2)
    assert _committed(zk_client, "clicks") == _ends(first + second, sent + sent2)


def test_processing_time_trigger_follows_new_data_and_survives_a_broker_restart(
        spark, make_topic, zk_client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("metrics", parts=2)
    bodies = [f"m-{i}".encode() for i in range(200)]
    sent = topic.produce(bodies)
    out, ck = tmp_path / "out", tmp_path / "ck"
    df = _stream(spark, topic.options(group=GROUP, brokerRetryTimeout="60"))
    q = (df.writeStream.format("parquet").option("checkpointLocation", str(ck))
         .trigger(processingTime="300 milliseconds").start(str(out)))
    try:
        wait_until(lambda: _committed(zk_client, "metrics") == _ends(bodies, sent), 120, 0.1,
                   what="the streaming query to commit the first messages")
        topic.brokers[0].restart()
        more = [f"after-restart-{i}".encode() for i in range(150)]
        sent += topic.produce(more)
        bodies += more
        wait_until(lambda: _committed(zk_client, "metrics") == _ends(bodies, sent), 120, 0.1,
                   what="the streaming query to commit messages sent after the broker restart")
        assert q.isActive and q.exception() is None
    finally:
        q.stop()
    assert _sunk(spark, out) == _expected(bodies, sent)
    published = commit_query_offsets(q, zk_connect=topic.zk_connect, group=GROUP)
    assert published == {("metrics", p): e for p, e in _ends(bodies, sent).items()}
    assert _committed(zk_client, "metrics") == _ends(bodies, sent)


def test_refuses_a_group_with_live_members(spark, make_topic, zk_client,
                                           tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("busy", parts=1)
    topic.produce([b"x"])
    member = Layout().consumer_id("shared", "shared_10.0.0.1-42-abc")
    zk_client.create(member, b"busy", ephemeral=True, makepath=True)
    q = (_stream(spark, topic.options(group="shared")).writeStream.format("noop")
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="live members") as info:
        q.awaitTermination(120)
    assert "shared_10.0.0.1-42-abc" in str(info.value)
    assert _committed(zk_client, "busy", "shared") == {}
