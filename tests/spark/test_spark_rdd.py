"""RDD-style fetchers: offset_ranges, fetch_range, foreach_partition with commit after success."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from metaq import DataLossError
from metaq.spark import FetchSettings, LiveGroupError, fetch_range, foreach_partition, offset_ranges
from zk_layout import Layout, StoredOffset, decode_offset, encode_offset

pytestmark = pytest.mark.spark

GROUP = "billing"


def _ends(bodies, results, attribute_len: int = 0) -> dict[str, int]:  # type: ignore[no-untyped-def]
    ends: dict[str, int] = {}
    extra = 4 + attribute_len if attribute_len else 0
    for body, res in zip(bodies, results, strict=True):
        ends[res.partition] = max(ends.get(res.partition, 0), res.offset + 20 + extra + len(body))
    return ends


def _stored(zk_client, topic: str) -> dict[str, StoredOffset]:  # type: ignore[no-untyped-def]
    layout = Layout()
    out = {}
    for part in zk_client.get_children(layout.offsets_dir(GROUP, topic)):
        data, _ = zk_client.get(layout.offset(GROUP, topic, part))
        out[part] = decode_offset(data)
    return out


def test_offset_ranges_start_at_the_group_and_end_at_the_log_end(make_topic, zk_client) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("ledger", parts=3)
    bodies = [b"entry-%d" % i for i in range(90)]
    sent = topic.produce(bodies)
    ends = _ends(bodies, sent)
    layout = Layout()
    zk_client.ensure_path(layout.offsets_dir(GROUP, "ledger"))
    first_of_0_1 = min(r.offset for r in sent if r.partition == "0-1")
    second_of_0_1 = sorted(r.offset for r in sent if r.partition == "0-1")[1]
    zk_client.create(layout.offset(GROUP, "ledger", "0-1"),
                     encode_offset(StoredOffset(offset=second_of_0_1, msg_id=5)))
    ranges = offset_ranges(topic.zk_connect, "ledger", group=GROUP)
    got = {r.partition: (r.from_offset, r.until_offset) for r in ranges}
    assert got == {"0-0": (0, ends["0-0"]), "0-1": (second_of_0_1, ends["0-1"]),
                   "0-2": (0, ends["0-2"])}
    assert first_of_0_1 == 0
    assert all(r.address == ("127.0.0.1", topic.brokers[0].port) for r in ranges)
    explicit = offset_ranges(topic.zk_connect, "ledger", group=GROUP, starting="earliest",
                             ending={"ledger": {"0-2": second_of_0_1}})
    assert {r.partition: r.until_offset for r in explicit}["0-2"] == second_of_0_1


def test_fetch_range_gives_every_message_with_its_attribute(make_topic) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("tagged", parts=2)
    bodies = [os.urandom(i % 300) for i in range(400)]
    sent = topic.produce(bodies, attribute="tag-é")
    got = []
    for rng in offset_ranges(topic.zk_connect, "tagged", starting="earliest"):
        got += list(fetch_range(rng, fetch_size=1024))  # small: messages straddle fetches
    assert sorted((m.partition, m.offset, m.msg_id, m.value) for m in got) == \
        sorted((r.partition, r.offset, r.msg_id, b) for b, r in zip(bodies, sent, strict=True))
    assert {m.attribute for m in got} == {"tag-é"}


def test_foreach_partition_commits_only_after_the_job_succeeded(
        spark, make_topic, zk_client, tmp_path) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("invoices", parts=4)
    bodies = [b"invoice-%04d" % i for i in range(400)]
    sent = topic.produce(bodies)
    seen_dir = tmp_path / "seen"
    seen_dir.mkdir()
    boom = tmp_path / "boom"
    boom.write_text("fail on 0-2")

    def handle(messages) -> None:  # type: ignore[no-untyped-def]
        rows = [(m.partition, m.offset, m.value) for m in messages]
        if rows and rows[0][0] == "0-2" and boom.exists():
            raise RuntimeError("handler failed on partition 0-2")
        with open(seen_dir / f"{rows[0][0]}-{rows[0][1]}.txt", "w") as f:
            f.writelines(f"{p} {o} {v.decode()}\n" for p, o, v in rows)

    ranges = offset_ranges(topic.zk_connect, "invoices", group=GROUP)
    with pytest.raises(Exception, match="handler failed on partition 0-2"):
        foreach_partition(spark, ranges, handle, zk_connect=topic.zk_connect, group=GROUP)
    assert zk_client.exists(Layout().offsets_dir(GROUP, "invoices")) is None  # nothing committed

    boom.unlink()
    for f in seen_dir.iterdir():
        f.unlink()
    committed = foreach_partition(spark, ranges, handle, zk_connect=topic.zk_connect,
                                  group=GROUP)
    ends = _ends(bodies, sent)
    assert committed == {("invoices", p): e for p, e in ends.items()}
    last_id = {}
    for r in sorted(sent, key=lambda r: r.offset):
        last_id[r.partition] = r.msg_id
    assert _stored(zk_client, "invoices") == {
        p: StoredOffset(offset=e, msg_id=last_id[p]) for p, e in ends.items()}
    lines = sorted(line for f in seen_dir.iterdir() for line in f.read_text().splitlines())
    assert lines == sorted(f"{r.partition} {r.offset} {b.decode()}"
                           for b, r in zip(bodies, sent, strict=True))
    # the next plan starts where the commit left off: nothing to do
    assert offset_ranges(topic.zk_connect, "invoices", group=GROUP) == []


def test_foreach_partition_refuses_a_group_with_live_members(spark, make_topic,
                                                             zk_client) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("shared", parts=1)
    topic.produce([b"x"])
    zk_client.create(Layout().consumer_id(GROUP, f"{GROUP}_c1"), b"shared", ephemeral=True,
                     makepath=True)
    ranges = offset_ranges(topic.zk_connect, "shared", group=GROUP)
    with pytest.raises(LiveGroupError, match=f"{GROUP}_c1"):
        foreach_partition(spark, ranges, lambda ms: None, zk_connect=topic.zk_connect,
                          group=GROUP)


def _segments(broker, topic: str, index: int) -> list[Path]:  # type: ignore[no-untyped-def]
    return sorted((broker.data_dir / f"{topic}-{index}").glob("*.meta"))


def test_a_log_shorter_than_planned_is_data_loss(make_topic, caplog) -> None:  # type: ignore[no-untyped-def]
    topic = make_topic("fragile", parts=1)
    bodies = [b"payload-%03d" % i for i in range(100)]
    sent = topic.produce(bodies)
    (rng,) = offset_ranges(topic.zk_connect, "fragile", starting="earliest")
    broker = topic.brokers[0]
    broker.stop()
    (segment,) = _segments(broker, "fragile", 0)
    keep = sent[60].offset + 5  # inside message 60: recovery truncates to its start
    os.truncate(segment, keep)
    broker.start()
    settings = FetchSettings(zk_connect=topic.zk_connect)
    with pytest.raises(DataLossError, match=f"the log ends at {sent[60].offset}"):
        list(fetch_range(rng, settings))
    with caplog.at_level(logging.WARNING, logger="metaq.spark._fetch"):
        got = list(fetch_range(rng, zk_connect=topic.zk_connect, fail_on_data_loss=False))
    assert [m.value for m in got] == bodies[:60]
    assert "failOnDataLoss=false" in caplog.text


@pytest.mark.parametrize("where", ["inside", "log start"])
def test_corrupt_bytes_are_data_loss_or_skipped(make_topic, where) -> None:  # type: ignore[no-untyped-def]
    """A damaged message inside a sealed segment, or the log's very first one (the
    broker answers ``offset`` for the log start without looking at it)."""
    topic = make_topic("rotten", parts=1, extra_args=["--max-segment-size", "4096"])
    bodies = [b"body-%03d-" % i + b"z" * 90 for i in range(120)]
    # in six rounds of some 2.4 KB: a pipelined burst lands in one segment, whatever its
    # size (the first put after a pause may go out, and land, alone)
    sent = [r for k in range(6) for r in topic.produce(bodies[k * 20:(k + 1) * 20])]
    broker = topic.brokers[0]
    broker.stop()
    first, second, *_ = _segments(broker, "rotten", 0)
    base, end = int(first.stem), int(second.stem)  # (a segment is named by its start)
    in_first = [i for i, r in enumerate(sent) if base <= r.offset < end]
    assert len(in_first) >= 2, (base, end)
    # a message of the first segment (sealed, not re-checked at start): one inside it, or
    # the first of the log
    victim = in_first[len(in_first) // 2] if where == "inside" else 0
    assert where == "inside" or sent[victim].offset == base
    at = sent[victim].offset - base + 30  # segment: a byte of its body
    with open(first, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    broker.start()
    (rng,) = offset_ranges(topic.zk_connect, "rotten", starting="earliest")
    with pytest.raises(DataLossError, match=f"bad message at offset {sent[victim].offset}: "
                                            f"checksum mismatch"):
        list(fetch_range(rng))
    got = list(fetch_range(rng, fail_on_data_loss=False))
    assert [m.value for m in got] == bodies[:victim] + bodies[victim + 1:]
    # the broker now knows the damage (the skip asked it where to go on) and sends a
    # reader past it: still a bad message, not bytes deleted from before the log start
    with pytest.raises(DataLossError, match=f"bad message at offset {sent[victim].offset}: "
                                            f"the broker knows bytes"):
        list(fetch_range(rng))


def test_fetch_waits_for_a_broker_that_is_down_and_finds_it_again(make_topic) -> None:  # type: ignore[no-untyped-def]
    import threading

    from metaq.testing import wait_until

    topic = make_topic("patient", parts=1)
    bodies = [b"msg-%d" % i for i in range(50)]
    topic.produce(bodies)
    (rng,) = offset_ranges(topic.zk_connect, "patient", starting="earliest")
    broker = topic.brokers[0]
    broker.stop()

    retried = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying for up to" in record.getMessage():
                retried.set()

    handler = Seen(level=logging.WARNING)
    fetch_log = logging.getLogger("metaq.spark._fetch")
    fetch_log.addHandler(handler)
    result: dict[str, object] = {}

    def read() -> None:
        try:
            result["values"] = [m.value for m in fetch_range(
                rng, zk_connect=topic.zk_connect, retry_timeout=60.0, broker_timeout=5.0)]
        except Exception as e:  # handed to the test thread
            result["error"] = e

    reader = threading.Thread(target=read, name="test-fetch-range", daemon=True)
    try:
        reader.start()
        wait_until(retried.is_set, 30, what="the fetch to fail and start retrying")
        broker.start()
        reader.join(60)
    finally:
        fetch_log.removeHandler(handler)
    assert not reader.is_alive()
    assert result.get("values") == bodies, result.get("error")
