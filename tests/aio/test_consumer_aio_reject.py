"""AsyncConsumer's reject policies with async handlers: the recover store redelivers to
the coroutine (from its own thread, through the loop), the DLQ gets the original."""

from __future__ import annotations

import asyncio

import pytest
from helpers.inproc import produce
from test_consumer_aio import make, until

from metaq.net import BrokerConnection
from metaq.protocol import iter_messages, split_payload

pytestmark = pytest.mark.broker

TOPIC = "aiowork"
DLQ = "%DLQ%aiofail"


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2, DLQ: 1}, zk_connect=zk_connect)


class FailOn:
    """An async handler failing the first ``times`` deliveries of chosen bodies."""

    def __init__(self, bad: set[bytes], times: int | None = None) -> None:
        self.bad, self.times = bad, times
        self.calls: dict[bytes, int] = {}
        self.ok: list[bytes] = []
        self.loops: set[int] = set()

    async def __call__(self, m) -> None:
        self.loops.add(id(asyncio.get_running_loop()))
        await asyncio.sleep(0)
        n = self.calls[m.raw_body] = self.calls.get(m.raw_body, 0) + 1
        if m.raw_body in self.bad and (self.times is None or n <= self.times):
            raise RuntimeError(f"cannot handle {m.raw_body!r}")
        self.ok.append(m.raw_body)


@pytest.mark.asyncio
async def test_recover_store_redelivers_to_the_coroutine_until_success(
        zk_connect, broker, tmp_path):
    bodies = [f"r{i}".encode() for i in range(30)]
    produce(zk_connect, TOPIC, bodies)
    handler = FailOn({b"r5"}, times=4)  # 3 tries in the partition, then from the store
    async with make(zk_connect, "aiofail", tmp_path, max_fetch_retries=2,
                    recover_interval=0.2) as c:
        c.subscribe(TOPIC, handler)
        await c.start()
        await until(lambda: set(handler.ok) == set(bodies), timeout=30,
                    what="the failing message redelivered from the recover store")
        await until(lambda: len(c.recover_store) == 0, what="store emptied")
    assert handler.calls[b"r5"] == 5
    assert handler.loops == {id(asyncio.get_running_loop())}  # always in this loop


@pytest.mark.asyncio
async def test_dlq_policy_sends_the_original(zk_connect, broker, tmp_path):
    produce(zk_connect, TOPIC, [b"good1", b"poison", b"good2"], attribute="trace=42")
    handler = FailOn({b"poison"})
    async with make(zk_connect, "aiofail", tmp_path, max_fetch_retries=1,
                    reject_policy="dlq") as c:
        c.subscribe(TOPIC, handler)
        await c.start()
        await until(lambda: {b"good1", b"good2"} <= set(handler.ok), what="good ones")

        def dead_letters():
            with BrokerConnection("127.0.0.1", broker.port) as conn:
                try:
                    data = bytes(conn.get(DLQ, "check", 0, 0, 1 << 20))
                except Exception:
                    return []
            return [split_payload(m.payload, m.flag) for m in iter_messages(data, 0)]

        got = []
        await until(lambda: got.extend(dead_letters()) or got, what="a dead letter")
        assert got == [("trace=42", b"poison")]
        assert handler.calls[b"poison"] == 2
