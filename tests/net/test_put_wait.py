"""``PipelinedConnection.put_wait``: a blocking send's whole round trip on its own
thread (issue 29) -- the lone success parsed here, everything else (an error code,
other replies, silence, a closing server, ``close()``) left to the usual machinery,
with the request completed exactly once."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from helpers.fake_broker import fake_brokers

from metaq import ConnectionClosedError
from metaq.net import PipelinedConnection
from metaq.producer import SendResult
from metaq.protocol import RequestParser
from metaq.testing import wait_until

NAMES = {i: f"3-{i}" for i in range(8)}


class Req:
    """A request recording its outcomes (a second one fails the test)."""

    def __init__(self) -> None:
        self.outcomes: list[tuple] = []

    def on_reply(self, code: int, body: bytes) -> None:
        self.outcomes.append(("reply", code, bytes(body)))

    def on_error(self, exc: BaseException) -> None:
        self.outcomes.append(("error", exc))


@pytest.fixture
def server_factory() -> Iterator:  # type: ignore[type-arg]
    with fake_brokers() as make:
        yield make


def _ok(opaque: int, msg_id: int = 11, index: int = 1, offset: int = 40) -> bytes:
    body = b"%d %d %d" % (msg_id, index, offset)
    return b"result 200 %d %d\r\n%b" % (len(body), opaque, body)


def _wait(conn: PipelinedConnection, req: Req, deadline: float = 10.0) -> object:
    return conn.put_wait("t", 1, b"x", 0, 1, req, time.monotonic() + deadline, SendResult, 3,
                         NAMES)


def test_a_lone_ack_is_the_result_and_nothing_else_happens(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: b"".join(_ok(r.opaque, 100 + r.opaque) for r in reqs))
    with PipelinedConnection("127.0.0.1", server.port) as conn:
        for _ in range(20):
            req = Req()
            r = _wait(conn, req)
            assert type(r) is SendResult and r[1:] == ("3-1", 40, 3, 1) and r.msg_id > 100
            assert req.outcomes == [] and conn.in_flight == 0
        assert server.received == 20
        # the window's bytes were given back: a put of the whole window still goes
        assert conn._inflight_bytes == 0


def test_an_error_code_goes_to_the_request_through_the_reader(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: b"".join(
        b"result 500 4 %d\r\noops" % r.opaque if r.payload == b"x" else _ok(r.opaque)
        for r in reqs))
    with PipelinedConnection("127.0.0.1", server.port) as conn:
        req = Req()
        assert _wait(conn, req) is None
        wait_until(lambda: req.outcomes, 5, what="the reader thread to hand over the reply")
        assert req.outcomes == [("reply", 500, b"oops")]
        assert not conn.closed and conn.in_flight == 0
        ok = conn.put_wait("t", 1, b"y", 0, 1, Req(), time.monotonic() + 5, SendResult, 3,
                           NAMES)
        assert isinstance(ok, SendResult)


def test_replies_to_others_in_the_same_read_leave_it_to_the_reader(server_factory) -> None:  # type: ignore[no-untyped-def]
    # its own success and a reply for an opaque nobody sent, in one write
    server = server_factory(lambda reqs: b"".join(_ok(r.opaque) + _ok(r.opaque + 1000)
                                                  for r in reqs))
    with PipelinedConnection("127.0.0.1", server.port) as conn:
        req = Req()
        assert _wait(conn, req) is None
        wait_until(lambda: req.outcomes, 5, what="the reader thread to complete it")
        assert req.outcomes == [("reply", 200, b"11 1 40")]
        assert conn.in_flight == 0 and not conn.closed


def test_it_does_not_apply_while_something_is_in_flight(server_factory) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()

    def answer(reqs):  # type: ignore[no-untyped-def]
        gate.wait(10)
        return b"".join(_ok(r.opaque) for r in reqs)

    server = server_factory(answer)
    with PipelinedConnection("127.0.0.1", server.port) as conn:
        fut = conn.put("t", 0, b"first", 0, 1)
        req = Req()
        assert _wait(conn, req) is False  # nothing sent, nothing registered
        assert conn.in_flight == 1 and req.outcomes == []
        gate.set()
        assert fut.result(10).offset == 40
        wait_until(lambda: server.received == 1, 5, what="the server to count")


def test_a_reply_in_pieces_is_read_whole(server_factory) -> None:  # type: ignore[no-untyped-def]
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def dribble() -> None:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        parser = RequestParser()
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                for r in parser.feed(data):
                    for i in range(0, len(reply := _ok(r.opaque)), 7):
                        conn.sendall(reply[i:i + 7])
                        time.sleep(0.002)  # separate segments (shaping, not waiting)

    t = threading.Thread(target=dribble, name="test-dribbler", daemon=True)
    t.start()
    try:
        with PipelinedConnection("127.0.0.1", port) as conn:
            for _ in range(3):
                req = Req()
                assert isinstance(_wait(conn, req), SendResult) and req.outcomes == []
    finally:
        srv.close()
        t.join(5)


def test_silence_until_the_deadline_returns_and_leaves_it_in_flight(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)
    conn = PipelinedConnection("127.0.0.1", server.port, request_timeout=30)
    try:
        req = Req()
        t0 = time.monotonic()
        assert _wait(conn, req, deadline=0.3) is None
        assert 0.3 <= time.monotonic() - t0 < 2
        assert conn.in_flight == 1 and req.outcomes == []
    finally:
        conn.close()
    assert len(req.outcomes) == 1 and isinstance(req.outcomes[0][1], ConnectionClosedError)


def test_a_server_closing_fails_the_request_once(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: b"CLOSE")
    conn = PipelinedConnection("127.0.0.1", server.port)
    req = Req()
    assert _wait(conn, req) is None
    assert [o[0] for o in req.outcomes] == ["error"]
    assert isinstance(req.outcomes[0][1], ConnectionClosedError)
    assert conn.closed
    assert _wait(conn, Req()) is False  # a dead connection: the usual path raises
    conn.close()
    assert len(req.outcomes) == 1


def test_close_from_another_thread_wakes_it(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)
    conn = PipelinedConnection("127.0.0.1", server.port, request_timeout=30)
    req = Req()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(_wait(conn, req, deadline=30)),
                         name="test-put-wait")
    t.start()
    wait_until(lambda: server.received == 1, 5, what="the put to arrive")
    t0 = time.monotonic()
    conn.close()
    t.join(10)
    assert not t.is_alive() and got == [None] and time.monotonic() - t0 < 5
    assert len(req.outcomes) == 1 and isinstance(req.outcomes[0][1], ConnectionClosedError)


def test_the_reader_threads_timeout_ends_it(server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(lambda reqs: None)
    conn = PipelinedConnection("127.0.0.1", server.port, request_timeout=0.3)
    req = Req()
    t0 = time.monotonic()
    assert _wait(conn, req, deadline=30) is None
    assert time.monotonic() - t0 < 5  # the parked reader thread still sweeps
    assert len(req.outcomes) == 1 and "no reply from broker" in str(req.outcomes[0][1])
    conn.close()
