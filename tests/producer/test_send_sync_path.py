"""A blocking ``send`` doing its whole round trip on its thread
(``SendPath.submit_sync`` / ``PipelinedConnection.put_wait``, issue 29) keeps every
rule of a send: its timeout against a silent broker, its retry on another broker,
messages stored where the results say, and threads sending at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from helpers.procs import BrokerProc, read_partition

from metaq import Producer, SendResult, SendTimeoutError
from metaq.net import BrokerConnection, PipelinedConnection
from metaq.protocol import build_payload

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
def round_trips(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """What each put_wait call answered."""
    got: list[object] = []
    real = PipelinedConnection.put_wait

    def recording(self: PipelinedConnection, *args: object) -> object:
        r = real(self, *args)  # type: ignore[arg-type]
        got.append(r)
        return r

    monkeypatch.setattr(PipelinedConnection, "put_wait", recording)
    return got


def test_sync_sends_take_the_round_trip_and_are_stored_as_answered(
        brokers: StartBroker, zk_connect: str, round_trips: list[object]) -> None:
    b0 = brokers(0, {"t": 3})
    with Producer(zk_connect) as producer:
        sent = [(producer.send("t", b"s%d" % i), b"s%d" % i) for i in range(200)]
        with_attr = producer.send("t", b"body", attribute="a=1")
    assert all(isinstance(r, SendResult) for r, _ in sent)
    assert sum(isinstance(r, SendResult) for r in round_trips) >= 195  # (the first connects)
    assert {r.partition for r, _ in sent} == {"0-0", "0-1", "0-2"}  # round-robin still
    assert len({r.msg_id for r, _ in sent}) == 200
    at = _stored([b0], "t", 3)
    for r, body in sent:
        assert at[(r.partition, r.offset)] == body
    assert at[(with_attr.partition, with_attr.offset)] == build_payload(b"body", "a=1")[0]


def test_a_silent_broker_times_a_sync_send_out_on_time(brokers: StartBroker,
                                                       zk_connect: str) -> None:
    b0 = brokers(0, {"t": 1})
    with Producer(zk_connect, send_timeout=1.0, request_timeout=30.0) as producer:
        producer.send("t", b"warm")
        b0.pause()  # SIGSTOP: the connection stays up, nothing is answered
        try:
            t0 = time.monotonic()
            with pytest.raises(SendTimeoutError, match="within 1s"):
                producer.send("t", b"lost?")
            assert 1.0 <= time.monotonic() - t0 < 3.0
        finally:
            b0.resume()


def test_a_sync_send_to_a_silent_broker_goes_to_another(brokers: StartBroker,
                                                        zk_connect: str) -> None:
    b0 = brokers(0, {"t": 1})
    b1 = brokers(1, {"t": 1})
    with Producer(zk_connect, send_timeout=8.0, request_timeout=0.5) as producer:
        assert {producer.send("t", b"w%d" % i).broker_id for i in range(4)} == {0, 1}
        b1.pause()
        try:
            results = [(producer.send("t", b"p%d" % i), b"p%d" % i) for i in range(6)]
        finally:
            b1.resume()
    assert {r.broker_id for r, _ in results} == {0}
    at = _stored([b0, b1], "t", 1)
    for r, body in results:
        assert at[(r.partition, r.offset)] == body


def test_threads_sending_sync_and_async_at_once_lose_nothing(
        brokers: StartBroker, zk_connect: str, round_trips: list[object]) -> None:
    b0 = brokers(0, {"t": 2})
    results: list[tuple[SendResult, bytes]] = []
    failures: list[BaseException] = []
    lock = threading.Lock()
    with Producer(zk_connect, send_timeout=20.0) as producer:

        def blocking(n: int) -> None:
            try:
                for i in range(300):
                    body = b"t%d-%d" % (n, i)
                    r = producer.send("t", body)
                    with lock:
                        results.append((r, body))
            except BaseException as e:  # reported below
                failures.append(e)

        threads = [threading.Thread(target=blocking, args=(n,), name=f"test-sync-{n}")
                   for n in range(3)]
        for t in threads:
            t.start()
        futures = [(producer.send_async("t", b"a%d" % i), b"a%d" % i) for i in range(2000)]
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads) and not failures, failures
        results += [(f.result(20), body) for f, body in futures]
    assert len(round_trips) >= 1  # some went the round trip; the rest as futures
    assert len({r.msg_id for r, _ in results}) == len(results) == 900 + 2000
    at = _stored([b0], "t", 2)
    for r, body in results:
        assert at[(r.partition, r.offset)] == body
