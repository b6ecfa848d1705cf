"""metaq.aio.AsyncConsumer against a real ZooKeeper and a real broker: async handlers,
``async for``, commits of finished messages only, cancellation, failures."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers.delivery import check_contiguous
from helpers.inproc import produce as send

from metaq import ConsumerError
from metaq.aio import AsyncConsumer

pytestmark = pytest.mark.broker

TOPIC = "aio"


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2}, zk_connect=zk_connect)


def produce(zk_connect, n, start=0, topic=TOPIC):
    return send(zk_connect, topic, (f"m{i}".encode() for i in range(start, start + n)))


def make(zk_connect, group, tmp_path, **kw):
    kw.setdefault("commit_period", 0.1)
    kw.setdefault("consumer_id", "a")
    return AsyncConsumer(group, zk_connect, recover_dir=str(tmp_path / "rs"), **kw)


async def until(cond, timeout=20.0, what="condition"):
    """Wait for ``cond()`` in the loop, with a deadline."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def ends(results):
    """(topic, partition) -> the log end after ``results`` (SendResults)."""
    out = {}
    for r in results:
        key = (TOPIC, r.partition)
        out[key] = max(out.get(key, 0), r.offset)
    return out


@pytest.mark.asyncio
async def test_async_handler_every_message_in_order_and_committed(zk_connect, broker,
                                                                  tmp_path):
    produce(zk_connect, 400)
    got = []

    async def handle(m):
        await asyncio.sleep(0)
        got.append((m.partition, m.offset, m.next_offset, bytes(m.body)))

    async with make(zk_connect, "g1", tmp_path) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: len(got) == 400, what="400 messages")
        check_contiguous(got, {f"m{i}".encode() for i in range(400)})
        last = {}
        for part, _, nxt, _ in got:
            last[(TOPIC, part)] = nxt
        await until(lambda: c.committed() == last, what="commits at the end")
        assert c.metrics()["finished"] == 400
        assert any(t.name.startswith("metaq-aio-watch-") for t in threading.enumerate())
    # every thread of the member stopped: fetch runners, coordinator, the stall watch
    await until(lambda: not [t for t in threading.enumerate() if c.consumer_id in t.name],
                what="the member's threads to stop")


@pytest.mark.asyncio
async def test_commit_stops_at_a_handler_not_finished(zk_connect, broker, tmp_path):
    produce(zk_connect, 200)
    held = asyncio.Event()
    release = asyncio.Event()
    seen: dict[str, int] = {}
    last: dict[tuple, int] = {}
    stuck: list = []

    async def handle(m):
        seen[m.partition] = seen.get(m.partition, 0) + 1
        if not stuck and seen[m.partition] == 30:  # the 30th of the first partition
            stuck.append(((TOPIC, m.partition), m.offset))
            held.set()
            await release.wait()
        last[(TOPIC, m.partition)] = m.next_offset

    async with make(zk_connect, "g2", tmp_path) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await asyncio.wait_for(held.wait(), 20)
        key, offset = stuck[0]
        await until(lambda: c.committed().get(key) == offset, what="commit at the held one")
        await asyncio.sleep(0.5)  # commit periods pass: it stays there
        assert c.committed()[key] == offset
        assert c.positions()[key] > offset  # fetching went on past it
        release.set()
        await until(lambda: sum(seen.values()) == 200, what="all finished")
        await until(lambda: c.committed() == last, what="commits at the ends")


async def drain_with(c, got, stop_after, hold):
    """async for: record messages; on message number ``stop_after`` wait forever."""
    async for m in c:
        if len(got) == stop_after:
            hold.set()
            await asyncio.Event().wait()
        got.append((m.partition, m.offset, m.next_offset, bytes(m.body)))


@pytest.mark.asyncio
async def test_cancelled_async_for_commits_what_finished_and_redelivers_nothing_committed(
        zk_connect, broker, tmp_path):
    produce(zk_connect, 300)
    first, hold = [], asyncio.Event()
    c = make(zk_connect, "g3", tmp_path)
    c.subscribe(TOPIC)
    task = asyncio.ensure_future(drain_with(c, first, 120, hold))
    await asyncio.wait_for(hold.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await c.close()
    committed_end = {}
    for part, _, nxt, _ in first:
        committed_end[part] = nxt
    # a second member starts exactly after what the first finished, in each partition
    second, hold2 = [], asyncio.Event()
    c2 = make(zk_connect, "g3", tmp_path, consumer_id="b")
    c2.subscribe(TOPIC)
    task = asyncio.ensure_future(drain_with(c2, second, 10**9, hold2))
    await until(lambda: len(first) + len(second) >= 300, what="the rest")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await c2.close()
    check_contiguous(first + second, {f"m{i}".encode() for i in range(300)})
    firsts = {}
    for part, offset, _, _ in second:
        firsts.setdefault(part, offset)
    for part, offset in firsts.items():  # nothing committed comes again
        assert offset == committed_end.get(part, 0)


def test_outside_a_running_loop_is_a_clear_error(zk_connect, tmp_path):
    with pytest.raises(ConsumerError, match="running asyncio event loop"):
        AsyncConsumer("g", zk_connect)

    async def made():
        return make(zk_connect, "g", tmp_path)

    loop = asyncio.new_event_loop()
    try:
        c = loop.run_until_complete(made())
        with pytest.raises(ConsumerError, match=r"subscribe\(\) needs a running asyncio"):
            c.subscribe(TOPIC, print)

        async def elsewhere():
            c.subscribe(TOPIC, print)

        with pytest.raises(ConsumerError, match="belongs to another event loop"):
            asyncio.run(elsewhere())
        loop.run_until_complete(c.close())
    finally:
        loop.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("bad", ["raise", "wrong_type", "timeout", "reconsume"])
async def test_a_bad_handler_is_retried_then_rejected_naming_partition_and_offset(
        zk_connect, broker, tmp_path, bad):
    from metaq import RECONSUME_LATER

    produce(zk_connect, 20)
    rejected = []
    calls: dict[bytes, int] = {}
    ok = []

    async def handle(m):
        calls[m.raw_body] = calls.get(m.raw_body, 0) + 1
        if m.raw_body == b"m7":
            if bad == "raise":
                raise ValueError("boom")
            if bad == "wrong_type":
                return 42
            if bad == "timeout":
                await asyncio.Event().wait()
            if bad == "reconsume":
                return RECONSUME_LATER
        ok.append(m.raw_body)

    async with make(zk_connect, "g4", tmp_path, max_fetch_retries=1, handler_timeout=0.3,
                    reject_policy=lambda m, e: rejected.append((m, e))) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: len(ok) == 19 and rejected, what="the rest, and m7 rejected")
        (m, err), = rejected
        assert m.raw_body == b"m7" and calls[b"m7"] == 2  # tried 1 + max_fetch_retries
        if bad == "raise":
            assert isinstance(err, ValueError)
        else:
            assert f"{m.topic}/{m.partition} offset {m.offset}" in str(err)
            assert "handle" in str(err)
        if bad == "wrong_type":
            assert isinstance(err, TypeError) and "42" in str(err)
        if bad == "timeout":
            assert isinstance(err, asyncio.TimeoutError)
            assert c.metrics()["handler_timeouts"] == 2
        # rejected counts as done: the partition commits past it
        key = (TOPIC, m.partition)
        await until(lambda: c.committed().get(key, 0) > m.offset, what="commit past m7")


@pytest.mark.asyncio
async def test_rewind_retries_without_counting_a_failure(zk_connect, broker, tmp_path):
    from metaq import Rewind

    produce(zk_connect, 10)
    tries = []
    ok = []

    async def handle(m):
        if m.raw_body == b"m3" and len(tries) < 3:
            tries.append(1)
            raise Rewind()
        ok.append(m.raw_body)

    async with make(zk_connect, "g5", tmp_path, max_fetch_retries=0,
                    reject_policy=lambda m, e: pytest.fail(f"rejected {m}")) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: len(ok) == 10, what="all, m3 after 3 rewinds")
        assert len(tries) == 3 and c.metrics()["handler_failures"] == 0


@pytest.mark.asyncio
async def test_a_handler_blocking_the_loop_is_reported_once_by_name(zk_connect, broker,
                                                                    tmp_path):
    produce(zk_connect, 6)
    n = []

    async def sleepy_handler(m):
        n.append(m)
        if len(n) <= 2:
            time.sleep(0.4)  # the mistake: a blocking call in a coroutine

    errors = []
    async with make(zk_connect, "g6", tmp_path, blocking_threshold=0.1,
                    on_error=errors.append) as c:
        c.subscribe(TOPIC, sleepy_handler)
        await c.start()
        await until(lambda: len(n) == 6 and errors, what="all, and a report")
        await asyncio.sleep(0.3)
        assert c.metrics()["blocking_handlers"] == [sleepy_handler.__qualname__]
        blocking = [e for e in errors if "blocked the event loop" in str(e)]
        assert len(blocking) == 1 and "sleepy_handler" in str(blocking[0])


@pytest.mark.asyncio
@pytest.mark.parametrize("finishes", [True, False])
async def test_leaving_async_with_commits_what_finished_and_only_that(
        zk_connect, broker, tmp_path, finishes):
    produce(zk_connect, 100)
    done: list[tuple[str, int]] = []
    held: list = []
    entered = asyncio.Event()

    async def handle(m):
        if not held and len(done) == 30:
            held.append(m)
            entered.set()
            # within drain_timeout (finishes at close) or far beyond it (cancelled)
            await asyncio.sleep(0.2 if finishes else 60)
        done.append((m.partition, m.offset))

    group = f"leave{finishes}"
    async with make(zk_connect, group, tmp_path, drain_timeout=1.0) as c:
        c.subscribe(TOPIC, handle)
        await c.start()
        await asyncio.wait_for(entered.wait(), 20)
    m = held[0]
    assert ((m.partition, m.offset) in done) == finishes
    # the next member starts each partition right after what the first finished
    again: list[tuple[str, int]] = []

    async def handle2(m2):
        again.append((m2.partition, m2.offset))

    async with make(zk_connect, group, tmp_path, consumer_id="b") as c2:
        c2.subscribe(TOPIC, handle2)
        await c2.start()
        await until(lambda: len(set(done) | set(again)) == 100, what="the rest")
    assert not set(done) & set(again)  # nothing finished (all committed) comes again
    if not finishes:
        assert (m.partition, m.offset) == min(a for a in again if a[0] == m.partition)
