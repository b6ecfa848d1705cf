"""Issue 16: the Kafka source's options on the metaq source, against real brokers.

Times: a first wave is produced, the test waits (wait_until on the clock, not a
sleep) until the broker's clock (this machine's) is past the newest msgId time of
that wave, and a second wave follows, so a time ``T`` between them splits every
partition exactly.
"""

from __future__ import annotations

import json
import time

import pytest

from metaq.protocol import MSG_ID_EPOCH_MS
from metaq.spark import stream_lag
from metaq.testing import wait_until

pytestmark = pytest.mark.spark


def _read(spark, options):  # type: ignore[no-untyped-def]
    reader = spark.read.format("metaq")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def _stream(spark, options):  # type: ignore[no-untyped-def]
    reader = spark.readStream.format("metaq")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load()


def _time_ms(msg_id: int) -> int:
    return (msg_id >> 22) + MSG_ID_EPOCH_MS


def _two_waves(topic, first: int, second: int) -> tuple[list, list, int]:  # type: ignore[no-untyped-def]
    """Send two waves; ``T``: every first-wave message is before it, every second-wave
    message at or after it."""
    wave1 = topic.produce([b"one-%04d" % i for i in range(first)])
    split = max(_time_ms(r.msg_id) for r in wave1) + 1
    wait_until(lambda: time.time() * 1000 > split + 1, 10, 0.005,
               what="the clock to pass the first wave's last msgId time")
    wave2 = topic.produce([b"two-%04d" % i for i in range(second)])
    assert min(_time_ms(r.msg_id) for r in wave2) >= split
    return wave1, wave2, split


def _keys(results) -> set[tuple[str, int]]:  # type: ignore[no-untyped-def]
    return {(r.partition, r.offset) for r in results}


def _got(df) -> set[tuple[str, int]]:  # type: ignore[no-untyped-def]
    return {(r.partition, r.offset) for r in df.select("partition", "offset").collect()}


def test_batch_timestamps_strategy_and_subscribe_pattern(spark, make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("tsa", parts=2, also={"tsb": 1, "zzz": 1})
    wave1, wave2, split = _two_waves(topic, 40, 30)
    opts = topic.options

    assert _got(_read(spark, opts(startingTimestamp=str(split)))) == _keys(wave2)
    assert _got(_read(spark, opts(endingTimestamp=str(split)))) == _keys(wave1)
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(split // 1000)) + \
        f".{split % 1000:03d}Z"
    assert _got(_read(spark, opts(startingTimestamp=iso))) == _keys(wave2)  # ISO-8601 too
    by_time = json.dumps({"tsa": {"0-0": split}})
    assert _got(_read(spark, opts(startingOffsetsByTimestamp=by_time))) == \
        _keys(wave2) | {k for k in _keys(wave1) if k[0] == "0-1"}  # 0-1: startingOffsets
    assert _got(_read(spark, opts(endingOffsetsByTimestamp=json.dumps(
        {"tsa": {"0-1": split}})))) == _keys(wave2 + wave1) - \
        {k for k in _keys(wave2) if k[0] == "0-1"}  # 0-0: endingOffsets (latest)

    future = str(int(time.time() * 1000) + 3_600_000)
    with pytest.raises(Exception, match=r"no message of tsa 0-0 .* is at or after the starting "
                                        r"time .*startingOffsetsByTimestampStrategy=latest"):
        _read(spark, opts(startingTimestamp=future)).count()
    assert _read(spark, opts(startingTimestamp=future,
                             startingOffsetsByTimestampStrategy="latest")).count() == 0
    assert _read(spark, opts(endingTimestamp=future)).count() == 70  # none that late: the end

    type(topic)(topic.zk_connect, "tsb", topic.brokers).produce([b"b1", b"b2"])
    type(topic)(topic.zk_connect, "zzz", topic.brokers).produce([b"z"])
    pattern = {"zk.connect": topic.zk_connect, "subscribePattern": "ts[ab]"}
    rows = _read(spark, pattern).groupBy("topic").count().collect()
    assert {r.topic: r["count"] for r in rows} == {"tsa": 70, "tsb": 2}
    with pytest.raises(Exception, match="matches no topic"):
        _read(spark, {**pattern, "subscribePattern": "ts"}).count()  # whole names only
    with pytest.raises(Exception, match="topic and subscribePattern are exclusive"):
        _read(spark, {**pattern, "topic": "tsa"}).count()
    with pytest.raises(Exception, match="option startingOffsetsByTimestamp must be JSON"):
        _read(spark, opts(startingOffsetsByTimestamp="{tsa: 1}")).count()


def test_stream_from_a_timestamp_in_batches_of_max_offsets_and_its_lag(
        spark, make_topic, tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("capped", parts=3)
    wave1, wave2, split = _two_waves(topic, 30, 130)
    batches: list[list[tuple[str, int]]] = []

    def sink(df, batch_id) -> None:  # type: ignore[no-untyped-def]
        batches.append([(r.partition, r.offset) for r in df.select("partition", "offset")
                        .collect()])

    df = _stream(spark, topic.options(group="capped-job", startingTimestamp=str(split),
                                      maxOffsetsPerTrigger="25"))
    q = (df.writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(availableNow=True).start())
    q.awaitTermination(240)
    assert not q.isActive and q.exception() is None
    sizes = [len(b) for b in batches if b]
    assert sum(sizes) == 130 and max(sizes) <= 25 and len(sizes) >= 6, sizes
    assert {k for b in batches for k in b} == _keys(wave2)  # from the time, nothing twice

    ends: dict[str, int] = {}
    for r, body_len in [(r, 8) for r in wave1 + wave2]:
        ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 20 + body_len)
    source = q.lastProgress["sources"][0]
    assert json.loads(source["latestOffset"]) == {"capped": ends}  # reportLatestOffset
    assert stream_lag(topic.zk_connect, query=q).bytes == 0
    caught_up = stream_lag(topic.zk_connect, query=q)
    assert (caught_up.messages, caught_up.seconds) == (0, 0.0)
    by_group = stream_lag(topic.zk_connect, group="capped-job", topics=["capped"])
    assert (by_group.bytes, by_group.seconds) == (0, 0.0)  # the published position

    firsts: dict[str, int] = {}
    for r in sorted(wave2, key=lambda r: r.offset, reverse=True):
        firsts[r.partition] = r.offset
    now = int(time.time() * 1000)
    lag = stream_lag(topic.zk_connect, offsets={"capped": firsts}, now_ms=now)
    assert (lag.bytes, lag.messages) == (130 * 28, 130)
    assert all(p.messages_exact for p in lag.partitions)
    oldest = min(_time_ms(r.msg_id) for r in wave2)
    assert lag.seconds == pytest.approx((now - oldest) / 1000, abs=0.002)


def test_min_offsets_per_trigger_waits_for_enough_messages_or_the_delay(
        spark, make_topic, tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("trickle", parts=2)
    topic.produce([b"early-%d" % i for i in range(5)])
    batches: list[tuple[float, int]] = []

    def sink(df, batch_id) -> None:  # type: ignore[no-untyped-def]
        n = df.count()
        if n:
            batches.append((time.monotonic(), n))

    df = _stream(spark, topic.options(group="trickle-job", minOffsetsPerTrigger="30",
                                      maxTriggerDelay="4s"))
    started = time.monotonic()
    q = (df.writeStream.foreachBatch(sink).option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="200 milliseconds").start())
    try:
        wait_until(lambda: batches, 60, 0.05, what="the delayed first micro-batch")
        assert batches[0][1] == 5  # fewer than 30 waited: only the delay let them through...
        assert batches[0][0] - started >= 4.0  # ...after 4 s
        topic.produce([b"burst-%d" % i for i in range(40)])
        wait_until(lambda: sum(n for _, n in batches) == 45, 60, 0.05,
                   what="the burst to be read")
        assert batches[1][1] >= 30  # the count, not the delay, let the burst through
        assert q.exception() is None
    finally:
        q.stop()


def test_batch_only_options_on_a_stream_fail_by_name(spark, make_topic, tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("streamonly", parts=1)
    topic.produce([b"x"])
    for option, value in [("endingOffsets", "latest"), ("endingTimestamp", "1700000000000")]:
        df = _stream(spark, topic.options(**{option: value}))
        with pytest.raises(Exception) as info:
            q = (df.writeStream.format("noop").trigger(availableNow=True)
                 .option("checkpointLocation", str(tmp_path / option)).start())
            q.awaitTermination(120)
        text = str(info.value)
        assert f"option {option} is for batch reads only" in text
        assert "UnboundLocalError" not in text
