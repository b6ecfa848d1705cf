"""AsyncConsumer's modes and control against a real ZooKeeper and broker: concurrent
mode's bound, batch handlers and ``batches()``, manual ack, seek, seek_to_time, pause,
resume, lag, metrics, coroutine rebalance callbacks."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from helpers.delivery import check_contiguous
from test_consumer_aio import TOPIC, make, produce, until

pytestmark = pytest.mark.broker


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2}, zk_connect=zk_connect)


def record(got, m):
    got.append((m.partition, m.offset, m.next_offset, bytes(m.body)))


@pytest.mark.asyncio
async def test_concurrent_mode_bounds_coroutines_per_partition_and_commits_below_unfinished(
        zk_connect, broker, tmp_path):
    produce(zk_connect, 300)
    running: dict[str, int] = {}
    peak: dict[str, int] = {}
    done = []
    release = asyncio.Event()
    held = []

    async def handle(m):
        running[m.partition] = running.get(m.partition, 0) + 1
        peak[m.partition] = max(peak.get(m.partition, 0), running[m.partition])
        try:
            if m.raw_body == b"m10":
                held.append(m)
                await release.wait()
            await asyncio.sleep(random.random() * 0.002)
        finally:
            running[m.partition] -= 1
        done.append(m.raw_body)

    async with make(zk_connect, "cc", tmp_path, consume_mode="concurrent",
                    consume_threads=4) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: len(done) == 299, what="all but the held one")
        assert max(peak.values()) == 4 and all(v <= 4 for v in peak.values())
        m = held[0]
        key = (TOPIC, m.partition)
        await until(lambda: c.committed().get(key) == m.offset, what="commit at the held")
        assert c.positions()[key] > m.offset
        release.set()
        await until(lambda: len(done) == 300, what="the held one")
        await until(lambda: c.committed()[key] == c.positions()[key], what="commit to end")


@pytest.mark.asyncio
async def test_batch_handler_and_batches_iteration(zk_connect, broker, tmp_path):
    produce(zk_connect, 250)
    got = []

    class Handler:
        async def on_messages(self, batch):
            await asyncio.sleep(0)
            for m in batch:
                record(got, m)

    async with make(zk_connect, "bh", tmp_path) as c:
        c.subscribe(TOPIC, Handler(), max_batch=40)
        await c.start()
        await until(lambda: len(got) == 250, what="all through on_messages")
    check_contiguous(got, {f"m{i}".encode() for i in range(250)})

    got2 = []
    async with make(zk_connect, "bi", tmp_path) as c:
        c.subscribe(TOPIC, max_batch=40)
        async for batch in c.batches():
            assert 1 <= len(batch) <= 40
            assert len({m.partition for m in batch}) == 1
            for m in batch:
                record(got2, m)
            if len(got2) == 250:
                break
    check_contiguous(got2, {f"m{i}".encode() for i in range(250)})


@pytest.mark.asyncio
async def test_manual_ack_commits_what_was_acked_and_rollback_redelivers(
        zk_connect, broker, tmp_path):
    produce(zk_connect, 40)
    got = []
    acked: dict[tuple, int] = {}
    ack_upto = {"n": 5}  # ack the first 5 messages of each partition only
    per_part: dict[str, int] = {}

    async with make(zk_connect, "ma", tmp_path) as c:
        async def handle(m):
            record(got, m)
            per_part[m.partition] = per_part.get(m.partition, 0) + 1
            if per_part[m.partition] <= ack_upto["n"]:
                c.ack(m)
                acked[(TOPIC, m.partition)] = m.next_offset

        c.subscribe(TOPIC, handle, auto_ack=False)
        await c.start()
        await until(lambda: len(got) == 40, what="all delivered")
        await until(lambda: c.committed() == acked, what="commits at the acked")
        assert all(c.positions()[k] > v for k, v in acked.items())
        key = next(iter(acked))
        c.rollback(*key)
        await until(lambda: len(got) > 40, what="redelivery from the acked")
        again = got[40]
        assert (again[0], again[1]) == (key[1], acked[key])


@pytest.mark.asyncio
async def test_seek_seek_to_time_pause_resume_lag_and_metrics(zk_connect, broker, tmp_path):
    produce(zk_connect, 60)
    got = []

    async def handle(m):
        record(got, m)

    async with make(zk_connect, "sk", tmp_path) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: len(got) == 60, what="first pass")
        await until(lambda: c.committed() == c.positions(), what="committed")
        lag = await c.lag()
        assert set(lag) == set(c.positions()) and all(v == 0 for v in lag.values())
        part = sorted(c.positions())[0][1]
        # seek to 0: that partition again, from its first message
        n = len(got)
        c.seek(TOPIC, part, 0)
        first_pass = [g for g in got if g[0] == part]
        await until(lambda: len(got) - n == len(first_pass), what="redelivered after seek")
        assert got[n:] == first_pass
        # seek_to_time: messages sent after the mark come again, none before it
        mark = int(time.time() * 1000)
        await until(lambda: int(time.time() * 1000) > mark + 2, what="the clock to move")
        later = produce(zk_connect, 20, start=100)
        await until(lambda: len(got) == n + len(first_pass) + 20, what="the later 20")
        n = len(got)
        c.seek_to_time(TOPIC, None, mark)
        await until(lambda: len(got) == n + 20, what="the later 20 again")
        assert sorted(b for *_, b in got[n:]) == sorted(f"m{i}".encode()
                                                        for i in range(100, 120))
        assert len(later) == 20
        # pause: nothing of the partition until resume; lag shows what waits
        c.pause(TOPIC, part)
        before = len([g for g in got if g[0] == part])
        sent = produce(zk_connect, 20, start=200)
        waiting = sum(1 for r in sent if r.partition == part)
        other = len(sent) - waiting
        n = len(got)
        await until(lambda: len(got) == n + other, what="the other partition's")
        lag = await c.lag()
        assert lag[(TOPIC, part)] > 0
        assert len([g for g in got if g[0] == part]) == before
        c.resume(TOPIC, part)
        await until(lambda: len(got) == n + other + waiting, what="after resume")
        metrics = c.metrics()
        assert metrics["finished"] == len(got) and metrics["in_loop"] == 0
        assert metrics["loop_wakeups"] >= 1 and metrics["state"] == "stable"


@pytest.mark.asyncio
async def test_rebalance_callbacks_may_be_coroutines(zk_connect, broker, tmp_path):
    produce(zk_connect, 10)
    events = []

    async def assigned(topic, partition):
        await asyncio.sleep(0)
        events.append(("assigned", topic, partition))

    async def revoked(topic, partition):
        await asyncio.sleep(0)
        events.append(("revoked", topic, partition))

    got = []

    async def handle(m):
        record(got, m)

    c = make(zk_connect, "cb", tmp_path, on_assigned=assigned, on_revoked=revoked)
    async with c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: len(got) == 10, what="all")
        parts = {p for _, _, p in events}
        assert {e[0] for e in events} == {"assigned"} and len(parts) == 2
    assert sorted(e for e in events if e[0] == "revoked") == sorted(
        ("revoked", TOPIC, p) for p in parts)


@pytest.mark.asyncio
async def test_flow_control_bounds_what_waits_in_the_loop(zk_connect, broker, tmp_path):
    produce(zk_connect, 2000)
    release = asyncio.Event()
    done = []

    async def handle(m):
        await release.wait()  # nothing finishes until released
        done.append(m)

    async with make(zk_connect, "fc", tmp_path, pull_threshold_messages=100) as c:
        c.subscribe(TOPIC, handle, max_batch=50, max_size=1024)
        await c.start()
        await until(lambda: c.metrics()["in_loop"] >= 2 * 100, what="both partitions full")
        await asyncio.sleep(0.5)  # fetch runners keep trying meanwhile
        # fetching stops once more than the threshold waits: at most one fetch over it
        # (1024 bytes: under 43 messages of 24-25 bytes)
        assert c.metrics()["in_loop"] <= 2 * (100 + 43)
        assert all(v == 0 for v in c.committed().values())
        release.set()
        await until(lambda: len(done) == 2000, what="everything once released")
