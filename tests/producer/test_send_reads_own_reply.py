"""A blocking ``send`` reads its own reply on its thread while it is alone in flight
(``PipelinedConnection.put_wait``, its whole round trip there, or ``read_own``; issue
29): the reader thread parks meanwhile, and takes over again for anything else --
pipelined sends, batches, a broker going away."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from helpers.procs import BrokerProc, read_partition

from metaq import Producer, SendResult
from metaq.net import BrokerConnection, PipelinedConnection
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

StartBroker = Callable[..., BrokerProc]


def _stored(procs: list[BrokerProc], topic: str, parts: int) -> dict[tuple[str, int], bytes]:
    at = {}
    for proc in procs:
        with BrokerConnection("127.0.0.1", proc.port) as conn:
            for index in range(parts):
                for m in read_partition(conn, topic, index):
                    at[(f"{proc.broker_id}-{index}", m.offset)] = m.payload
    return at


@pytest.fixture
def own_reads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per blocking send, whether its reply was read on the calling thread: by its
    whole round trip there (put_wait answering the result) or by read_own (called
    when put_wait did not answer it: the request done by then)."""
    got: list[bool] = []
    real = PipelinedConnection.read_own
    real_wait = PipelinedConnection.put_wait

    def counting(self: PipelinedConnection, request: object, deadline: float) -> None:
        real(self, request, deadline)
        got.append(request.done())  # type: ignore[attr-defined]

    def waiting(self: PipelinedConnection, *args: object) -> object:
        r = real_wait(self, *args)  # type: ignore[arg-type]
        if isinstance(r, SendResult):
            got.append(True)
        return r

    monkeypatch.setattr(PipelinedConnection, "read_own", counting)
    monkeypatch.setattr(PipelinedConnection, "put_wait", waiting)
    return got


def test_blocking_sends_read_their_replies_and_the_reader_parks(
        brokers: StartBroker, zk_connect: str, own_reads: list[bool]) -> None:
    b0 = brokers(0, {"t": 2})
    with Producer(zk_connect) as producer:
        results = [(producer.send("t", b"m%d" % i), b"m%d" % i) for i in range(300)]
        conn = producer._connections.by_broker[0]
        # most replies were read by the sending thread (one may race the reader thread)
        assert len(own_reads) == 300 and sum(own_reads) >= 250, sum(own_reads)
        # a pipelined send now: the reader thread reads again
        fut = producer.send_async("t", b"after")
        results.append((fut.result(10), b"after"))
        wait_until(lambda: not conn._parked, 5, what="the reader thread back on the socket")
    assert all(isinstance(r, SendResult) for r, _ in results)
    assert len({r.msg_id for r, _ in results}) == len(results)
    at = _stored([b0], "t", 2)
    for r, body in results:
        assert at[(r.partition, r.offset)] == body


def test_blocking_and_pipelined_sends_together(brokers: StartBroker, zk_connect: str,
                                               own_reads: list[bool]) -> None:
    b0 = brokers(0, {"t": 2})
    with Producer(zk_connect, send_timeout=20.0) as producer:
        sync_results: list[tuple[SendResult, bytes]] = []
        failures: list[BaseException] = []

        def blocking() -> None:
            try:
                for i in range(400):
                    body = b"sync%d" % i
                    sync_results.append((producer.send("t", body), body))
            except BaseException as e:  # reported below
                failures.append(e)

        t = threading.Thread(target=blocking, name="test-blocking-sender")
        t.start()
        futures = []
        batches = []
        for i in range(3000):
            futures.append((producer.send_async("t", b"async%d" % i), b"async%d" % i))
            if i % 500 == 0:
                bodies = [b"batch%d-%d" % (i, j) for j in range(50)]
                batches.append((producer.send_batch("t", bodies), bodies))
        t.join(60)
        assert not t.is_alive() and not failures, failures
        results = sync_results + [(f.result(20), body) for f, body in futures]
        for batch, bodies in batches:
            results += list(zip(batch.result(20), bodies, strict=True))
    assert len(own_reads) == 400
    assert len({r.msg_id for r, _ in results}) == len(results) == 400 + 3000 + 6 * 50
    at = _stored([b0], "t", 2)
    for r, body in results:
        assert at[(r.partition, r.offset)] == body


def test_a_broker_killed_while_the_reader_is_parked(brokers: StartBroker,
                                                   zk_connect: str) -> None:
    brokers(0, {"t": 2})
    b1 = brokers(1, {"t": 2})
    with Producer(zk_connect, send_timeout=10.0) as producer:
        warm = [producer.send("t", b"warm%d" % i) for i in range(40)]
        assert {r.broker_id for r in warm} == {0, 1}
        b1.kill()  # both readers parked after the blocking sends
        after = [producer.send("t", b"after%d" % i) for i in range(40)]
        assert all(isinstance(r, SendResult) for r in after)
        assert {r.broker_id for r in after[-10:]} == {0}  # broker 1 is avoided by then
