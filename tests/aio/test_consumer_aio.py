"""metaq.aio.AsyncConsumer against a real ZooKeeper and a real broker: async handlers,
``async for``, commits of finished messages only, cancellation, failures."""

from __future__ import annotations

import asyncio
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
