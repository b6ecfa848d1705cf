"""metaq.aio.AsyncProducer against a real ZooKeeper and real broker processes.

Every message the tests count as sent is read back from the brokers with ``get``.
The loop-lag checks run a 1 ms ticker task beside the producer and assert on the
largest delay it saw while something that would block a thread for seconds
(a paused broker, an unreachable ZooKeeper) was going on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from helpers.procs import BrokerProc, read_partition

from metaq import (
    BatchResults,
    CoordinationError,
    MessageTooLargeError,
    ProducerError,
    SendResult,
    SendTimeoutError,
    TransactionError,
    XAError,
    Xid,
)
from metaq.aio import AsyncProducer
from metaq.testing import free_port

pytestmark = pytest.mark.broker

StartBroker = Callable[..., BrokerProc]


def _stored(procs: list[BrokerProc], topic: str) -> dict[str, list[bytes]]:
    """partition name -> the payloads stored there, in offset order."""
    out: dict[str, list[bytes]] = {}
    for b in procs:
        with b.connection() as conn:
            for index in range(b.topics[topic]):
                out[f"{b.broker_id}-{index}"] = [m.payload for m in
                                                 read_partition(conn, topic, index)]
    return out


def _stored_at(procs: list[BrokerProc], topic: str) -> dict[tuple[str, int], bytes]:
    out = {}
    for b in procs:
        with b.connection() as conn:
            for index in range(b.topics[topic]):
                for m in read_partition(conn, topic, index):
                    out[(f"{b.broker_id}-{index}", m.offset)] = m.payload
    return out


class Ticker:
    """A task that wakes every ``interval`` and keeps the largest lateness it saw."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.max_lag = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            self.max_lag = max(self.max_lag, loop.time() - due)
            self.ticks += 1

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


@pytest.mark.asyncio
async def test_send_send_async_and_send_batch_are_stored_exactly(brokers: StartBroker,
                                                                 zk_connect: str) -> None:
    b0 = brokers(0, {"t": 2})
    b1 = brokers(1, {"t": 2})
    async with AsyncProducer(zk_connect, send_timeout=10.0) as producer:
        assert await producer.partitions("t") == ["0-0", "0-1", "1-0", "1-1"]
        sent: list[tuple[SendResult, bytes]] = []
        for i in range(20):
            body = b"one %d" % i
            sent.append((await producer.send("t", body), body))
        pending = [(producer.send_async("t", b"many %d" % i), b"many %d" % i)
                   for i in range(3000)]
        for p, body in pending:
            sent.append((await p, body))
        bodies = [b"batch %d" % i for i in range(500)]
        batch = await producer.send_batch("t", bodies)
        assert isinstance(batch, BatchResults) and len(batch) == 500
        assert len({r.partition for r in batch}) == 1  # a batch goes to one partition
        sent += list(zip(batch, bodies, strict=True))
        with pytest.raises(MessageTooLargeError):
            await producer.send("t", b"x" * (producer.config.max_message_size + 1))
    assert producer.closed
    assert all(isinstance(r, SendResult) for r, _ in sent)
    assert {r.broker_id for r, _ in sent} == {0, 1}
    at = _stored_at([b0, b1], "t")
    assert len(at) == len(sent)
    for r, body in sent:
        assert at[(r.partition, r.offset)] == body, r


@pytest.mark.asyncio
async def test_the_idempotent_option(brokers: StartBroker, zk_connect: str) -> None:
    b0 = brokers(0, {"t": 2})
    async with AsyncProducer(zk_connect, idempotent=True) as producer:
        await producer.send("t", b"i0")  # the route read and the connections made
        pending = [producer.send_async("t", b"i%d" % i) for i in range(1, 1000)]
        results = [await p for p in pending]
        assert any(getattr(p, "seq", None) is not None for p in pending)  # (pid, seq) sent
    at = _stored_at([b0], "t")
    assert len(at) == 1000
    assert sorted(at.values()) == sorted(b"i%d" % i for i in range(1000))
    assert {at[(r.partition, r.offset)] for r in results} == set(at.values()) - {b"i0"}


@pytest.mark.asyncio
async def test_messages_keep_their_order_per_partition(brokers: StartBroker,
                                                       zk_connect: str) -> None:
    """The first sends (route unknown: queued, sent from a worker thread) and the later
    ones (straight from the loop), with a window so small that many wait in the queue:
    each partition holds its messages in the order they were sent."""
    b0 = brokers(0, {"t": 3})
    async with AsyncProducer(zk_connect, max_in_flight=16, send_timeout=10.0) as producer:
        order: dict[str, list[bytes]] = {}
        pending = []
        for i in range(3000):
            body = b"%06d" % i
            pending.append((producer.send_async("t", body), body))
            if i % 500 == 0:
                await asyncio.sleep(0)
        for p, body in pending:
            r = await p
            order.setdefault(r.partition, []).append(body)
    assert sum(map(len, order.values())) == 3000
    assert _stored([b0], "t") == order
    for bodies in order.values():
        assert bodies == sorted(bodies)


@pytest.mark.asyncio
async def test_transaction_commit_and_rollback(brokers: StartBroker, zk_connect: str) -> None:
    b0 = brokers(0, {"t": 1})
    async with AsyncProducer(zk_connect) as producer:
        async with producer.transaction() as tx:
            await tx.send("t", b"tx-a")
            await tx.send("t", b"tx-b")
        tx2 = producer.transaction()
        await tx2.send("t", b"rolled-back-1")
        await tx2.rollback()
        with pytest.raises(RuntimeError, match="boom"):
            async with producer.transaction() as tx3:
                await tx3.send("t", b"rolled-back-2")
                raise RuntimeError("boom")
        with pytest.raises(TransactionError):
            await tx2.commit()  # rolled back: cannot commit
        tx4 = producer.transaction()
        await tx4.send("t", b"tx-c")
        results = await tx4.commit()
        assert [r.partition for r in results] == ["0-0"]
    assert _stored([b0], "t") == {"0-0": [b"tx-a", b"tx-b", b"tx-c"]}


@pytest.mark.asyncio
async def test_xa_two_phase_commit_and_rollback(brokers: StartBroker, zk_connect: str) -> None:
    b0 = brokers(0, {"t": 1})
    xid = Xid(1, b"gtrid-1", b"bq-1")
    async with AsyncProducer(zk_connect) as producer:
        xa = await producer.xa_resource("app1", topic="t")
        async with xa:
            await xa.start(xid)
            await xa.send("t", b"two-phase")
            await xa.end(xid)
            assert await xa.prepare(xid) == 0
            assert await xa.recover() == [xid]
            assert _stored([b0], "t") == {"0-0": []}  # prepared: not visible yet
            await xa.commit(xid)
            with pytest.raises(XAError):
                await xa.commit(xid)  # no such branch any more
            await xa.start(xid)
            await xa.send("t", b"rolled")
            await xa.end(xid)
            await xa.prepare(xid)
            await xa.rollback(xid)
            assert await xa.recover() == []
    assert _stored([b0], "t") == {"0-0": [b"two-phase"]}


@pytest.mark.asyncio
async def test_a_broker_killed_mid_stream_its_messages_are_retried(brokers: StartBroker,
                                                                   zk_connect: str) -> None:
    b0 = brokers(0, {"t": 2})
    b1 = brokers(1, {"t": 2})
    async with AsyncProducer(zk_connect, send_timeout=10.0) as producer:
        warm = [await producer.send("t", b"warm%d" % i) for i in range(8)]
        assert {r.broker_id for r in warm} == {0, 1}  # connected to both
        pending = []
        for i in range(6000):
            pending.append((producer.send_async("t", b"w%d" % i), b"w%d" % i))
            if i == 1500:
                b1.pause()  # SIGSTOP: what goes to broker 1 from here stays unanswered...
            if i == 2500:
                b1.kill()  # ...and is in flight when it gets SIGKILL
            if i % 200 == 0:
                await asyncio.sleep(0)
        results = []
        for p, body in pending:
            results.append((await p, body))
        retried = [p for p, _ in pending if getattr(p, "attempts", 1) > 1]
        assert retried, "no message was retried although broker 1 died"
        after = [await producer.send("t", b"after%d" % i) for i in range(20)]
        assert {r.broker_id for r in after} == {0}
    b1.start()
    at = _stored_at([b0, b1], "t")
    for r, body in results:
        assert at[(r.partition, r.offset)] == body


@pytest.mark.asyncio
async def test_follows_a_broker_that_starts_publishing(brokers: StartBroker,
                                                       zk_connect: str) -> None:
    """A broker that appears in ZooKeeper mid-stream gets messages too (the route is
    refreshed by the router's watch; the first send to the new broker connects on a worker
    thread), and every message is stored where its result says."""
    b0 = brokers(0, {"t": 2})
    async with AsyncProducer(zk_connect, send_timeout=10.0) as producer:
        results = [await producer.send("t", b"before%d" % i) for i in range(10)]
        assert {r.broker_id for r in results} == {0}
        b1 = brokers(1, {"t": 2})
        deadline = time.monotonic() + 30
        i = 0
        async with Ticker() as ticker:
            while not any(r.broker_id == 1 for r in results[-4:]):
                assert time.monotonic() < deadline, "broker 1 never got a message"
                results.append(await producer.send("t", b"after%d" % i))
                i += 1
        assert ticker.max_lag < 0.25, f"the loop stalled {ticker.max_lag * 1000:.0f} ms"
        assert await producer.partitions("t") == ["0-0", "0-1", "1-0", "1-1"]
    at = _stored_at([b0, b1], "t")
    assert len(at) == len(results)
    assert {at[(r.partition, r.offset)] for r in results} == set(at.values())


def test_used_outside_a_running_loop_it_says_so(zk_connect: str) -> None:
    producer = AsyncProducer(zk_connect)  # no I/O, no loop needed
    for call in (lambda: producer.send_async("t", b"x"),
                 lambda: producer.send_batch("t", [b"x"]),
                 lambda: producer.transaction(),
                 lambda: producer.start().send(None),
                 lambda: producer.send("t", b"x").send(None)):
        with pytest.raises(ProducerError, match="running in an asyncio event loop"):
            call()


@pytest.mark.asyncio
async def test_not_started_and_closed_say_so(zk_connect: str) -> None:
    producer = AsyncProducer(zk_connect)
    with pytest.raises(ProducerError, match="not started"):
        producer.send_async("t", b"x")
    await producer.close()
    with pytest.raises(ProducerError, match="closed"):
        await producer.start()


@pytest.mark.asyncio
async def test_an_unreachable_zookeeper_does_not_block_the_loop() -> None:
    producer = AsyncProducer(f"127.0.0.1:{free_port()}", zk_connect_timeout=1.5)
    async with Ticker() as ticker:
        t0 = time.monotonic()
        with pytest.raises(CoordinationError):
            await producer.start()
        waited = time.monotonic() - t0
    assert waited >= 1.0  # the connect really waited...
    assert ticker.ticks > 100  # ...while the loop went on ticking
    assert ticker.max_lag < 0.25, f"the loop stalled {ticker.max_lag * 1000:.0f} ms"


@pytest.mark.asyncio
async def test_a_full_window_and_a_paused_broker_do_not_block_the_loop(
        brokers: StartBroker, zk_connect: str) -> None:
    """The threaded producer's send_async would wait for room (up to the send timeout)
    once ``max_in_flight`` puts are unanswered; here the extra messages wait in the
    queue, the loop keeps ticking, and they all go out once the broker answers again."""
    b0 = brokers(0, {"t": 2})
    async with AsyncProducer(zk_connect, max_in_flight=50, send_timeout=20.0) as producer:
        await producer.send("t", b"warm")
        async with Ticker() as ticker:
            b0.pause()  # SIGSTOP: nothing is answered
            try:
                pending = []
                for i in range(400):
                    pending.append(producer.send_async("t", b"p%d" % i))
                    if i % 50 == 0:
                        await asyncio.sleep(0)
                t0 = time.monotonic()
                # nothing is answered: the first send waits (as long as we let it)
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(1.5):
                        await pending[0]
                assert time.monotonic() - t0 >= 1.4
                ticks_paused = ticker.ticks
            finally:
                b0.resume()
            results = [await p for p in pending]
        assert ticks_paused > 200
        assert ticker.max_lag < 0.25, f"the loop stalled {ticker.max_lag * 1000:.0f} ms"
    assert len({(r.partition, r.offset) for r in results}) == 400


@pytest.mark.asyncio
async def test_unanswered_and_queued_sends_time_out(brokers: StartBroker,
                                                    zk_connect: str) -> None:
    """As with the threaded producer: a message unanswered within the send timeout, and
    one that found no room in the window within it, fail with SendTimeoutError."""
    b0 = brokers(0, {"t": 1})
    async with AsyncProducer(zk_connect, max_in_flight=3, send_timeout=1.0,
                             request_timeout=30.0) as producer:
        await producer.send("t", b"warm")
        b0.pause()
        try:
            t0 = time.monotonic()
            pending = [asyncio.ensure_future(producer.send("t", b"p%d" % i)) for i in range(6)]
            outcomes = await asyncio.gather(*pending, return_exceptions=True)
            waited = time.monotonic() - t0
        finally:
            b0.resume()
        assert all(isinstance(o, SendTimeoutError) for o in outcomes), outcomes
        assert any("window stayed full" in str(o) for o in outcomes)  # queued ones
        assert 0.9 < waited < 5.0
        assert (await producer.send("t", b"after")).partition == "0-0"


@pytest.mark.asyncio
async def test_cancelling_pending_sends(brokers: StartBroker, zk_connect: str) -> None:
    """A task awaiting a send is cancelled at once whether the message is queued (it is
    then never sent) or on the wire (it may be stored: the producer goes on)."""
    b0 = brokers(0, {"t": 1})
    async with AsyncProducer(zk_connect, max_in_flight=5, send_timeout=30.0) as producer:
        await producer.send("t", b"warm")
        b0.pause()
        try:
            on_wire = [asyncio.ensure_future(producer.send("t", b"wire%d" % i))
                       for i in range(5)]
            queued = [asyncio.ensure_future(producer.send("t", b"queued%d" % i))
                      for i in range(5)]
            await asyncio.sleep(0.2)  # let the tasks reach their awaits
            assert not any(t.done() for t in on_wire + queued)
            t0 = time.monotonic()
            batch = asyncio.ensure_future(producer.send_batch("t", [b"b1", b"b2"]))
            await asyncio.sleep(0.05)
            on_wire[1].cancel()
            queued[2].cancel()
            batch.cancel()
            for t in (on_wire[1], queued[2], batch):
                with pytest.raises(asyncio.CancelledError):
                    await t
            assert time.monotonic() - t0 < 1.0  # at once, not at the 30 s send timeout
        finally:
            b0.resume()
        rest = [await t for t in on_wire + queued if not t.cancelled()]
        assert len(rest) == 8
        assert (await producer.send("t", b"after")).partition == "0-0"
    stored = _stored([b0], "t")["0-0"]
    assert b"queued2" not in stored  # cancelled while queued: never sent
    assert b"b1" not in stored and b"b2" not in stored
    assert stored[0] == b"warm" and stored[-1] == b"after"
    assert set(stored) - {b"wire1"} == ({b"warm", b"after"}
                                        | {b"wire%d" % i for i in range(5) if i != 1}
                                        | {b"queued%d" % i for i in range(5) if i != 2})
