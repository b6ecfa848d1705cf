"""PipelinedConnection against a real broker (in-process, over TCP) and against
misbehaving servers (silent, garbage, closing) that a real broker cannot play."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.fake_broker import fake_brokers
from helpers.procs import read_partition

from metaq import BrokerError, ConnectionClosedError, SendTimeoutError
from metaq.broker import Broker
from metaq.net import BrokerConnection, PipelinedConnection, PutAck
from metaq.protocol import checksum, encode_result
from metaq.testing import free_port, wait_until

pytestmark = pytest.mark.broker


@pytest.fixture
def broker(broker_factory) -> Broker:  # type: ignore[no-untyped-def]
    return broker_factory({"t": 2}, broker_id=3, port=0)


@pytest.fixture
def server_factory() -> Iterator:  # type: ignore[type-arg]
    with fake_brokers() as make:
        yield make


def _pipe_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("metaq-pipe-")]


def test_many_puts_in_flight_all_acknowledged_and_stored(broker: Broker) -> None:
    payloads = [b"m%05d" % i + b"x" * (i % 50) for i in range(5000)]
    with PipelinedConnection("127.0.0.1", broker.port, name="b3") as conn:
        assert {"metaq-pipe-reader-b3", "metaq-pipe-writer-b3"} <= set(_pipe_threads())
        futures = [conn.put("t", i % 2, p, 0, _crc(p)) for i, p in enumerate(payloads)]
        acks = [f.result(10) for f in futures]
    assert all(isinstance(a, PutAck) for a in acks)
    assert [a.partition for a in acks] == [i % 2 for i in range(5000)]
    for part in (0, 1):
        offsets = [a.offset for a in acks if a.partition == part]
        assert offsets == sorted(offsets) and len(set(offsets)) == 2500
    assert len({a.msg_id for a in acks}) == 5000
    assert all((a.msg_id >> 12) & 0x3FF == 3 for a in acks)  # broker id in the msgId
    with BrokerConnection("127.0.0.1", broker.port) as reader:
        for part in (0, 1):
            got = read_partition(reader, "t", part)
            assert [m.payload for m in got] == payloads[part::2]
            assert [m.offset for m in got] == [a.offset for a in acks if a.partition == part]
            assert [m.msg_id for m in got] == [a.msg_id for a in acks if a.partition == part]
    assert not [n for n in _pipe_threads() if n.endswith("-b3")]


def test_flush_writes_from_the_calling_thread(broker: Broker) -> None:
    with PipelinedConnection("127.0.0.1", broker.port) as conn:
        acks = [conn.put("t", 0, b"s%d" % i, 0, _crc(b"s%d" % i), flush=True).result(5)
                for i in range(50)]
        mixed = [conn.put("t", 1, b"m%d" % i, 0, _crc(b"m%d" % i), flush=i % 2 == 0)
                 for i in range(200)]
        assert [f.result(5).partition for f in mixed] == [1] * 200
    assert [a.offset for a in acks] == sorted(a.offset for a in acks)
    with BrokerConnection("127.0.0.1", broker.port) as reader:
        assert [m.payload for m in read_partition(reader, "t", 1)] == [b"m%d" % i
                                                                      for i in range(200)]


class _WakeSpy:
    """Stands in for a connection's writer wake-up event on the callers' side."""

    def __init__(self, real: threading.Event) -> None:
        self.real = real
        self.sets = 0

    def is_set(self) -> bool:
        return self.real.is_set()

    def set(self) -> None:
        self.sets += 1
        self.real.set()


def test_a_put_after_a_pause_is_written_by_the_caller_a_stream_by_the_writer(
        broker: Broker) -> None:
    """At a low rate nothing joins a put: handing it to the writer thread would only
    add a thread wake-up to its way to the broker."""
    with PipelinedConnection("127.0.0.1", broker.port) as conn:
        conn.put("t", 0, b"first", 0, _crc(b"first")).result(5)
        spy = conn._wake = _WakeSpy(conn._wake)  # noqa: SLF001
        time.sleep(0.01)  # the pause under test
        assert conn.put("t", 0, b"quiet", 0, _crc(b"quiet")).result(5).partition == 0
        assert spy.sets == 0
        stream = [conn.put("t", 1, b"s%d" % i, 0, _crc(b"s%d" % i)) for i in range(500)]
        assert [f.result(10).partition for f in stream] == [1] * 500
        assert spy.sets >= 1
    with BrokerConnection("127.0.0.1", broker.port) as reader:
        assert [m.payload for m in read_partition(reader, "t", 0)] == [b"first", b"quiet"]
        assert [m.payload for m in read_partition(reader, "t", 1)] == [b"s%d" % i
                                                                      for i in range(500)]


def test_a_put_written_by_the_caller_never_blocks_on_a_full_socket() -> None:
    """What the socket does not take stays queued, first, for the writer thread: the
    caller returns, and the broker reads every request whole and in order."""
    srv = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) but reads nothing yet
    big = b"x" * (16 << 20)
    conn = PipelinedConnection("127.0.0.1", srv.getsockname()[1], request_timeout=60,
                               max_in_flight_bytes=64 << 20)

    def caller() -> None:
        conn.put("t", 0, big, 0, 1)
        time.sleep(0.002)  # a pause: the next put is written by the caller too, if it can
        conn.put("t", 0, b"tail", 0, 2)

    try:
        t = threading.Thread(target=caller, name="test-caller", daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "a put blocked while the server read nothing"
        peer, _ = srv.accept()
        with peer:
            peer.settimeout(30)
            data = bytearray()
            while not data.endswith(b"tail"):
                chunk = peer.recv(1 << 20)
                assert chunk, "connection closed early"
                data += chunk
        head, rest = bytes(data).split(b"\r\n", 1)
        assert head.startswith(b"put t 0 %d 0 1 " % len(big))
        assert rest[:len(big)] == big
        head2, payload2 = rest[len(big):].split(b"\r\n", 1)
        assert head2.startswith(b"put t 0 4 0 2 ") and payload2 == b"tail"
    finally:
        conn.close()
        srv.close()


def test_broker_refusal_fails_one_request_and_keeps_the_connection(broker: Broker) -> None:
    with PipelinedConnection("127.0.0.1", broker.port) as conn:
        bad = conn.put("t", 7, b"x", 0, _crc(b"x"))       # no partition 7
        ok = conn.put("t", 1, b"y", 0, _crc(b"y"))
        with pytest.raises(BrokerError) as e:
            bad.result(5)
        assert e.value.code == 404 and "7" in str(e.value)
        assert ok.result(5).partition == 1
        assert conn.put("t", 0, b"z", 0, _crc(b"z")).result(5).partition == 0
        assert not conn.closed


def test_connect_refused_is_a_clear_connection_error() -> None:
    port = free_port()
    with pytest.raises(ConnectionClosedError, match=f"cannot connect to broker 127.0.0.1:{port}"):
        PipelinedConnection("127.0.0.1", port, connect_timeout=2)


def test_full_window_blocks_until_the_deadline(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)  # reads, never answers
    conn = PipelinedConnection("127.0.0.1", server.port, max_in_flight=4, request_timeout=30)
    try:
        futures = [conn.put("t", 0, b"x", 0, 1) for _ in range(4)]
        t0 = time.monotonic()
        with pytest.raises(SendTimeoutError, match="in-flight window"):
            conn.put("t", 0, b"x", 0, 1, deadline=time.monotonic() + 0.3)
        assert 0.25 <= time.monotonic() - t0 < 5
        assert conn.in_flight == 4 and not any(f.done() for f in futures)
        wait_until(lambda: server.received == 4, 5, what="the server to read 4 puts")
    finally:
        conn.close()
    for f in futures:
        with pytest.raises(ConnectionClosedError, match="closed"):
            f.result(5)
    with pytest.raises(ConnectionClosedError):
        conn.put("t", 0, b"x", 0, 1)


def test_byte_window_counts_request_bytes(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)
    with PipelinedConnection("127.0.0.1", server.port, max_in_flight_bytes=10_000,
                             request_timeout=30) as conn:
        conn.put("t", 0, b"x" * 6000, 0, 1)  # one request may exceed nothing in flight
        with pytest.raises(SendTimeoutError):
            conn.put("t", 0, b"x" * 6000, 0, 1, deadline=time.monotonic() + 0.2)
        conn.close()


def test_no_reply_within_request_timeout_kills_the_connection(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)
    conn = PipelinedConnection("127.0.0.1", server.port, request_timeout=0.3)
    t0 = time.monotonic()
    f = conn.put("t", 0, b"x", 0, 1)
    with pytest.raises(ConnectionClosedError, match="no reply from broker"):
        f.result(10)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert conn.closed
    conn.close()


def test_one_unanswered_request_times_out_alone(server_factory) -> None:  # type: ignore[no-untyped-def]
    def answer(reqs):  # type: ignore[no-untyped-def]
        return b"".join(b"result 200 5 %d\r\n1 0 0" % r.opaque for r in reqs
                        if r.payload != b"lost")

    server = server_factory(answer)
    with PipelinedConnection("127.0.0.1", server.port, request_timeout=0.3,
                             stale_timeout=0.6) as conn:
        lost = conn.put("t", 0, b"lost", 0, 1)
        t0 = time.monotonic()
        while not lost.done() and time.monotonic() - t0 < 10:  # replies keep flowing
            conn.put("t", 0, b"ok", 0, 1).result(5)
        with pytest.raises(SendTimeoutError, match="answered later requests but not this one"):
            lost.result(0)
        assert 0.6 <= time.monotonic() - t0 < 5
        assert not conn.closed and conn.in_flight == 0
        assert conn.put("t", 0, b"ok", 0, 1).result(5).msg_id == 1


def test_garbage_reply_fails_everything_in_flight(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: b"HTTP/1.1 400 Bad Request\r\n\r\n")
    conn = PipelinedConnection("127.0.0.1", server.port)
    f = conn.put("t", 0, b"x", 0, 1)
    with pytest.raises(ConnectionClosedError, match="malformed reply") as e:
        f.result(10)
    assert "HTTP/1.1" in str(e.value.__cause__)
    conn.close()


def test_server_closing_fails_in_flight_and_later_puts(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: b"CLOSE")
    conn = PipelinedConnection("127.0.0.1", server.port)
    f = conn.put("t", 0, b"x", 0, 1)
    with pytest.raises(ConnectionClosedError, match="closed the connection"):
        f.result(10)
    wait_until(lambda: conn.closed, 5, what="the connection to notice")
    with pytest.raises(ConnectionClosedError):
        conn.put("t", 0, b"y", 0, 1)
    conn.close()


def test_replies_out_of_order_are_matched_by_opaque(server_factory) -> None:  # type: ignore[no-untyped-def]
    def answer(reqs):  # type: ignore[no-untyped-def]
        return b"".join(b"result 200 %d %d\r\n%b" % (len(b := b"%d 0 %d" % (r.opaque, r.opaque)),
                                                        r.opaque, b) for r in reversed(reqs))

    server = server_factory(answer)
    with PipelinedConnection("127.0.0.1", server.port) as conn:
        fs = [conn.put("t", 0, b"x", 0, 1) for _ in range(50)]
        acks = [f.result(10) for f in fs]
    assert [a.msg_id for a in acks] == [a.offset for a in acks]
    assert len({a.msg_id for a in acks}) == 50


def test_close_waits_for_replies_in_flight(broker: Broker) -> None:
    conn = PipelinedConnection("127.0.0.1", broker.port)
    fs = [conn.put("t", 0, b"%d" % i, 0, _crc(b"%d" % i)) for i in range(2000)]
    conn.close(timeout=10)
    assert all(f.done() and f.exception() is None for f in fs)


# --------------------------------------------------------------------------- put_many

class Outcomes:
    """A MultiPending that records each index's outcome (and fails on a second one)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.got: dict[int, tuple] = {}
        self.bulk_calls = 0
        self.lock = threading.Lock()

    def _set(self, index: int, value: tuple) -> None:
        with self.lock:
            assert 0 <= index < self.n and index not in self.got, (index, value)
            self.got[index] = value

    def on_acks(self, first, msg_ids, partitions, offsets) -> None:  # type: ignore[no-untyped-def]
        self.bulk_calls += 1
        for i, (a, b, c) in enumerate(zip(msg_ids, partitions, offsets, strict=True)):
            self._set(first + i, ("ok", int(a), int(b), int(c)))

    def on_reply_at(self, index: int, code: int, body: bytes) -> None:
        if code == 200:
            a, b, c = map(int, body.split())
            self._set(index, ("ok", a, b, c))
        else:
            self._set(index, ("code", code, body))

    def on_error_at(self, index: int, exc: BaseException) -> None:
        self._set(index, ("error", exc))

    def complete(self) -> bool:
        return len(self.got) == self.n


def test_put_many_every_index_acknowledged_and_stored(broker: Broker) -> None:
    payloads = [b"p%05d" % i + b"y" * (i % 70) for i in range(5000)]
    batch = Outcomes(len(payloads))
    with PipelinedConnection("127.0.0.1", broker.port, name="b3") as conn:
        singles = [conn.put("t", 1, b"s%d" % i, 0, _crc(b"s%d" % i)) for i in range(10)]
        conn.put_many("t", 0, payloads, 0, [_crc(p) for p in payloads], batch, flush=True)
        singles += [conn.put("t", 1, b"s%d" % i, 0, _crc(b"s%d" % i)) for i in range(10, 20)]
        conn.put_many("t", 1, [], 0, [], Outcomes(0))  # nothing: no-op
        wait_until(batch.complete, 20, what="every put of the batch answered")
        assert [f.result(5).partition for f in singles] == [1] * 20
        assert conn.in_flight == 0
    assert batch.bulk_calls >= 1  # acknowledged in bulk, not one by one
    acks = [batch.got[i] for i in range(len(payloads))]
    assert all(a[0] == "ok" and a[2] == 0 for a in acks)
    with BrokerConnection("127.0.0.1", broker.port) as reader:
        got = read_partition(reader, "t", 0)
    assert [m.payload for m in got] == payloads
    assert [(m.msg_id, m.offset) for m in got] == [(a[1], a[3]) for a in acks]


def test_put_many_mixed_replies_out_of_order_each_index_once(server_factory) -> None:  # type: ignore[no-untyped-def]
    def answer(reqs):  # type: ignore[no-untyped-def]
        out = []
        for r in reqs:
            n = int(r.payload)
            if n % 7 == 3:
                out.append(encode_result(500, b"disk full", r.opaque))
            else:
                body = b"%d 4 %d" % (1000 + n, 10 * n)
                out.append(b"result 200 %d %d\r\n%b" % (len(body), r.opaque, body))
        if reqs and int(reqs[0].payload) >= 200:
            out.reverse()  # the second half answered backwards
        return b"".join(out)

    server = server_factory(answer)
    batch = Outcomes(400)
    payloads = [b"%d" % i for i in range(400)]
    with PipelinedConnection("127.0.0.1", server.port) as conn:
        conn.put_many("t", 4, payloads[:200], 0, [1] * 200, batch)
        wait_until(lambda: len(batch.got) == 200, 10, what="the first half")
        conn.put_many("t", 4, payloads[200:], 0, [1] * 200, _Shifted(batch, 200))
        wait_until(batch.complete, 10, what="every put answered")
        assert conn.in_flight == 0 and not conn.closed
    for i in range(400):
        expect = (("code", 500, b"disk full") if i % 7 == 3 else ("ok", 1000 + i, 4, 10 * i))
        assert batch.got[i] == expect, i


class _Shifted:
    """Outcomes of a second put_many, recorded at ``base + index``."""

    def __init__(self, target: Outcomes, base: int) -> None:
        self.target, self.base = target, base

    def on_acks(self, first, msg_ids, partitions, offsets) -> None:  # type: ignore[no-untyped-def]
        self.target.on_acks(self.base + first, msg_ids, partitions, offsets)

    def on_reply_at(self, index: int, code: int, body: bytes) -> None:
        self.target.on_reply_at(self.base + index, code, body)

    def on_error_at(self, index: int, exc: BaseException) -> None:
        self.target.on_error_at(self.base + index, exc)


def test_put_many_connection_lost_mid_batch_fails_the_rest_once(server_factory) -> None:  # type: ignore[no-untyped-def]
    answered = [0]

    def answer(reqs):  # type: ignore[no-untyped-def]
        if answered[0] >= 150:
            return b"CLOSE"
        out = []
        for r in reqs[:150 - answered[0]]:
            out.append(b"result 200 5 %d\r\n1 0 0" % r.opaque)
        answered[0] += len(out)
        return b"".join(out) if answered[0] < 150 else b"".join(out) + b"result 200 5"

    server = server_factory(answer)
    batch = Outcomes(1000)
    conn = PipelinedConnection("127.0.0.1", server.port)
    try:
        conn.put_many("t", 0, [b"x"] * 1000, 0, [1] * 1000, batch)
        wait_until(lambda: len(batch.got) >= 150, 10, what="150 answers")
        conn.put("t", 0, b"nudge", 0, 1)  # the server closes on its next read
        wait_until(batch.complete, 10, what="every put to get an outcome")
    finally:
        conn.close()
    oks = [i for i, v in batch.got.items() if v[0] == "ok"]
    errors = [i for i, v in batch.got.items() if v[0] == "error"]
    assert oks == list(range(150)) and errors == list(range(150, 1000))
    assert all(isinstance(batch.got[i][1], ConnectionClosedError) for i in errors)
    with pytest.raises(ConnectionClosedError):
        conn.put_many("t", 0, [b"x"], 0, [1], Outcomes(1))


def test_put_many_waits_for_room_for_all_of_it(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)  # never answers
    with PipelinedConnection("127.0.0.1", server.port, max_in_flight=100,
                             request_timeout=30) as conn:
        first = Outcomes(150)
        conn.put_many("t", 0, [b"x"] * 150, 0, [1] * 150, first)  # alone: may pass the window
        t0 = time.monotonic()
        with pytest.raises(SendTimeoutError, match="in-flight window"):
            conn.put_many("t", 0, [b"y"], 0, [1], Outcomes(1), time.monotonic() + 0.3)
        assert time.monotonic() - t0 >= 0.25 and conn.in_flight == 150
        conn.close()
    assert first.complete() and {v[0] for v in first.got.values()} == {"error"}


def test_put_many_stale_puts_time_out_alone(server_factory) -> None:  # type: ignore[no-untyped-def]
    def answer(reqs):  # type: ignore[no-untyped-def]
        return b"".join(b"result 200 5 %d\r\n1 0 0" % r.opaque for r in reqs
                        if r.payload != b"lost")

    server = server_factory(answer)
    batch = Outcomes(6)
    with PipelinedConnection("127.0.0.1", server.port, request_timeout=0.3,
                             stale_timeout=0.6) as conn:
        conn.put_many("t", 0, [b"a", b"lost", b"b", b"lost", b"c", b"d"], 0, [1] * 6, batch)
        t0 = time.monotonic()
        while not batch.complete() and time.monotonic() - t0 < 10:  # replies keep flowing
            conn.put("t", 0, b"ok", 0, 1).result(5)
        assert conn.in_flight == 0 and not conn.closed
    assert [batch.got[i][0] for i in range(6)] == ["ok", "error", "ok", "error", "ok", "ok"]
    assert isinstance(batch.got[1][1], SendTimeoutError)


# --------------------------------------------------------------------------- helpers

def _crc(payload: bytes) -> int:
    return checksum(payload)
