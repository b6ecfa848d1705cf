"""send_async's C path (issue 29) against the Python path it stands in for.

- ``submit_put`` (the future, the round-robin pick and the put in one call) writes the
  same bytes, keeps the same pending map and leaves the same Send as ``Send(...)`` and
  ``PipelinedConnection.put``; what it declines (no prefix yet, a full window, a closed
  connection, another connection at the address, a broker avoided, no partition) it
  leaves to the Python path with nothing done but what that path expects.
- ``take_acks`` (the reader's completion of successful replies) takes exactly the
  leading replies the Python parser would hand to ``Send.on_acks``, with the same
  results, and leaves the rest of the bytes to it.
- ``result()`` in C (``bind_send_result``) answers as the Python method does.

Both connections below talk to plain sockets that record what they receive (no broker
needed to compare bytes).
"""

from __future__ import annotations

import itertools
import re
import socket
import threading
import time
from concurrent.futures._base import FINISHED, RUNNING
from types import SimpleNamespace

import pytest
from helpers.procs import read_partition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq.net import BrokerConnection, PipelinedConnection
from metaq.producer._send import Send, SendResult, partition_names
from metaq.protocol import CHECKSUM_MASK, _fast, crc32, submit_put, take_acks
from metaq.testing import wait_until
from zk_layout import Partition

needs_c = pytest.mark.skipif(_fast.speedups is None,
                             reason=f"C speedups: {_fast.SPEEDUPS_STATUS}")
pytestmark = needs_c


class _Sink:
    """A listening socket that accepts one connection and keeps what it receives."""

    def __init__(self) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self.data = bytearray()
        self._t = threading.Thread(target=self._run, daemon=True, name="test-sink")
        self._t.start()

    def _run(self) -> None:
        conn, _ = self._srv.accept()
        with conn:
            while True:
                b = conn.recv(65536)
                if not b:
                    return
                self.data += b

    def close(self) -> None:
        self._srv.close()
        self._t.join(5)


class _Path:
    """A stand-in for the send path: the futures only keep a reference to it."""

    def attempt_failed(self, send, err):  # (the connections close with puts unanswered)
        send.set_exception(err)

    def fail(self, send, err, cause=None):  # pragma: no cover - not reached here
        send.set_exception(err)


@pytest.fixture
def pair():
    """Two connections (C path, Python path) to two sinks."""
    sinks = [_Sink(), _Sink()]
    conns = [PipelinedConnection("127.0.0.1", s.port, max_in_flight=1 << 20) for s in sinks]
    yield sinks, conns
    for c in conns:
        c.close()
    for s in sinks:
        s.close()


def _route(conn: PipelinedConnection, nparts: int, bid: int = 3) -> SimpleNamespace:
    parts = tuple(Partition(bid, i) for i in range(nparts))
    return SimpleNamespace(partitions=parts, counter=itertools.count(5),
                           addresses={bid: conn.address})


def _state(conn, path, faults=None, timeout=30.0):
    return (Send, path, {3: conn}, {} if faults is None else faults, PipelinedConnection,
            timeout, RUNNING)


def _python_send(conn, path, route, topic, payload, flag, timeout=30.0):
    """What send_async did before (Send, then SendPath.submit's common path)."""
    send = Send(path, topic, payload, flag, crc32(payload) & CHECKSUM_MASK,
                time.monotonic() + timeout)
    parts = route.partitions
    part = parts[next(route.counter) % len(parts)]
    send.part = part
    send.attempts = 1
    conn.put(topic, part.index, payload, flag, send.checksum, send, send.deadline, False)
    return send


_msgs = st.lists(st.tuples(st.binary(max_size=300), st.integers(0, 2**31 - 1),
                           st.sampled_from(["t", "orders", "ü-x_1"])), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(msgs=_msgs, nparts=st.integers(1, 5))
def test_submit_put_writes_and_keeps_what_the_python_path_does(pair, msgs, nparts):
    sinks, (cc, pc) = pair
    path = _Path()
    rc, rp = _route(cc, nparts), _route(pc, nparts)
    state = _state(cc, path)
    got = []
    for payload, flag, topic in msgs:
        before = time.monotonic()
        s = submit_put(state, topic, rc, payload, flag)
        after = time.monotonic()
        assert type(s) is Send and s.part is not None
        if not s.attempts:  # the first put of a topic on this connection: put() makes the prefix
            assert topic not in cc._prefixes
            s.attempts = 1
            cc.put(topic, s.part.index, payload, flag, s.checksum, s, s.deadline, False)
        p = _python_send(pc, path, rp, topic, payload, flag)
        assert before + 30.0 <= s.deadline <= after + 30.0
        for name in ("topic", "payload", "flag", "checksum", "attempts", "part", "tried",
                     "flush", "_state", "_result", "_exception", "_waited", "_pipe_size",
                     "path"):
            assert getattr(s, name) == getattr(p, name), name
        got.append((s, p))
    # the same pending map (opaque -> the same message), window and bytes on the wire
    assert [(op, r.payload, r.part) for op, r in cc._pending.items()] == \
        [(op, r.payload, r.part) for op, r in pc._pending.items()]
    assert cc._inflight_bytes == pc._inflight_bytes
    # (the sinks never answer: the window's bytes are all the bytes written so far)
    wait_until(lambda: len(sinks[0].data) == cc._inflight_bytes
               and len(sinks[1].data) == pc._inflight_bytes, timeout=10)
    assert bytes(sinks[0].data) == bytes(sinks[1].data)
    assert all(not s.done() for s, _ in got)


def test_submit_put_declines_and_leaves_the_rest_to_python(pair):
    sinks, (cc, _) = pair
    path = _Path()
    route = _route(cc, 2)
    cc._prefix("t")
    # not bytes: nothing done (the Python path makes its own Send)
    assert submit_put(_state(cc, path), "t", route, bytearray(b"x"), 0) is None
    assert next(route.counter) == 5
    # a broker avoided lately: no pick, no put (pick() steers away from it)
    s = submit_put(_state(cc, path, faults={3: time.monotonic() + 10}), "t", route, b"x", 0)
    assert s.part is None and s.attempts == 0 and next(route.counter) == 6
    # no partition
    empty = SimpleNamespace(partitions=(), counter=itertools.count(), addresses={})
    s = submit_put(_state(cc, path), "t", empty, b"x", 0)
    assert s.part is None and s.attempts == 0
    # a connection elsewhere than the route says: picked, not put
    other = SimpleNamespace(partitions=route.partitions, counter=itertools.count(1),
                            addresses={3: ("127.0.0.1", 1)})
    s = submit_put(_state(cc, path), "t", other, b"x", 0)
    assert s.part == Partition(3, 1) and s.attempts == 0 and not cc._pending
    # a full window: picked, not put (put() waits for room)
    cc.max_in_flight = 1
    s1 = submit_put(_state(cc, path), "t", route, b"x", 0)
    s2 = submit_put(_state(cc, path), "t", route, b"y", 0)
    assert s1.attempts == 1 and s2.attempts == 0 and list(cc._pending.values()) == [s1]
    cc.max_in_flight = 1 << 20
    # the lock held by another thread: not put (put() waits for it)
    with cc._lock:
        s3 = submit_put(_state(cc, path), "t", route, b"z", 0)
    assert s3.attempts == 0 and len(cc._pending) == 1
    # a closed connection: not put (put() raises ConnectionClosedError)
    cc.close()
    s4 = submit_put(_state(cc, path), "t", route, b"z", 0)
    assert s4.attempts == 0 and s4.part is not None


# --------------------------------------------------------------------------- take_acks

_digits = st.text("0123456789", min_size=1, max_size=22)
_reply = st.one_of(
    st.tuples(st.just("ok"), _digits, _digits, _digits),
    st.tuples(st.just("code"), st.sampled_from([400, 500, 201, 2000]), _digits, _digits),
    st.tuples(st.just("body"), st.sampled_from([b"1 2", b"a b c", b"1  2 3", b" 1 2 3",
                                               b"1 2 3 ", b"1 2 3 4", b"-1 2 3", b""]),
              st.just(""), st.just("")),
    st.tuples(st.just("unknown"), _digits, _digits, _digits),
    st.tuples(st.just("other"), _digits, _digits, _digits),
    st.tuples(st.just("dup"), _digits, _digits, _digits),
)
_OK_BODY = re.compile(rb"[0-9]+ [0-9]+ [0-9]+\Z")


class _Other:
    """A request of another class (the Python path's)."""

    _pipe_size = 7


def _send(bid: int) -> Send:
    s = Send(_Path(), "t", b"payload", 0, 0, 0.0)
    s.part = Partition(bid, 0)
    s._pipe_size = 10
    return s


@settings(max_examples=300, deadline=None)
@given(replies=st.lists(_reply, max_size=25), cut=st.integers(0, 40), waited=st.booleans())
def test_take_acks_takes_what_the_python_path_hands_to_on_acks(replies, cut, waited):
    pending: dict = {}
    chunks: list[tuple[bytes, int, int]] = []  # (bytes, code, opaque)
    op = 1
    for kind, a, b, c in replies:
        op += 1
        if kind == "code":
            body = f"{b} 1 {c}".encode()
            code = a
        elif kind == "body":
            body, code = a, 200
        else:
            body, code = f"{a} {b} {c}".encode(), 200
            if kind == "dup":  # the opaque of the reply before
                op -= 1
        if kind == "other":
            pending[op] = _Other()
        elif kind != "unknown" and op not in pending:
            pending[op] = _send(2)
            pending[op]._waited = waited
        chunks.append((f"result {code} {len(body)} {op}\r\n".encode() + body, code, op))
    buf = b"".join(c[0] for c in chunks)
    if cut and buf:
        buf = buf[:max(0, len(buf) - cut)]
    # what the Python parser hands to Send.on_acks: the leading whole replies that are
    # acks (code 200, digits) to Sends still pending
    sim = dict(pending)
    want_used, want = 0, []
    for data, code, opaque in chunks:
        body = data.split(b"\r\n", 1)[1]
        if (code != 200 or want_used + len(data) > len(buf) or not _OK_BODY.match(body)
                or type(sim.get(opaque)) is not Send):
            break
        want_used += len(data)
        want.append((sim.pop(opaque), tuple(map(int, body.split()))))
    before = dict(pending)
    used, freed, got_waited = take_acks(buf, pending, Send, FINISHED)
    assert used == want_used
    assert freed == 10 * len(want)
    taken = [r for r, _ in want]
    assert got_waited == (taken if waited else [])
    assert pending == sim == {k: v for k, v in before.items() if not any(v is r for r in taken)}
    for req, (i, p, o) in want:
        assert req.done() and req.payload == b""
        # the same result as the Python path's bulk completion of the same bytes
        twin = _send(2)
        Send.on_acks([twin], [str(i).encode()], [str(p).encode()], [str(o).encode()])
        assert req.result() == twin.result() == SendResult(i, f"2-{p}", o, 2, p)
    for r in pending.values():
        assert type(r) is _Other or not r.done()


# --------------------------------------------------------------------------- result()

def test_result_in_c_answers_as_the_python_method():
    slow = Send.__dict__["result"]
    assert type(slow).__name__ == "instancemethod"  # the C one is bound (speedups on)
    s = _send(4)
    partition_names(4)
    with pytest.raises(TimeoutError):
        s.result(timeout=0.01)  # not done: the Python method waits
    Send.on_acks([s], [b"11"], [b"0"], [b"22"])
    assert s.result() == s.result(timeout=1) == SendResult(11, "4-0", 22, 4, 0)
    e = _send(4)
    e.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        e.result()
    r = _send(4)
    r.set_result(SendResult(1, "4-2", 3, 4, 2))
    assert r.result() is r._result


# --------------------------------------------------------------------------- end to end

def test_send_async_takes_the_c_path_and_gets_the_python_paths_results(zk_connect,
                                                                        broker_factory):
    """Against a broker: the C path puts (no Python dispatch), the results and the stored
    messages are what the Python path gives for the same messages."""
    from metaq import Producer
    from metaq.producer._path import SendPath

    broker_factory({"fp": 3}, zk_connect=zk_connect)
    dispatched = []
    with Producer(zk_connect) as c_side, Producer(zk_connect) as py_side:
        assert c_side._fast is not None
        py_side._fast = None  # the Python path, as without the C module
        real = SendPath.dispatch

        def counting(self, send, route, part):
            dispatched.append(send)
            return real(self, send, route, part)

        c_side._path.dispatch = counting.__get__(c_side._path)  # type: ignore[method-assign]
        c_side.send_async("fp", b"first").result(timeout=10)  # makes the put prefix
        dispatched.clear()
        bodies = [b"m%d" % i * (i % 7) for i in range(300)]
        cf = [c_side.send_async("fp", b, attribute="a" if i % 3 else None)
              for i, b in enumerate(bodies)]
        pf = [py_side.send_async("fp", b, attribute="a" if i % 3 else None)
              for i, b in enumerate(bodies)]
        cr = [f.result(timeout=10) for f in cf]
        pr = [f.result(timeout=10) for f in pf]
        assert not dispatched  # every one put by the C call
        assert all(f.attempts == 1 and f.payload == b"" for f in cf + pf)
        # round-robin over the same partitions from each route's own start
        parts = c_side.partitions("fp")
        assert len(parts) == 3
        for results in (cr, pr):
            start = parts.index(results[0].partition)
            assert [r.partition for r in results] == [parts[(start + i) % 3]
                                                      for i in range(len(results))]
            assert all(type(r) is SendResult and r.partition == f"{r.broker_id}-{r.index}"
                       for r in results)
        # and in one partition, offsets grow as the messages were sent
        for results in (cr, pr):
            by_part: dict[str, list[int]] = {}
            for r in results:
                by_part.setdefault(r.partition, []).append(r.offset)
            assert all(offs == sorted(offs) for offs in by_part.values())
        # the future class changed (metaq.aio's): the C path is off
        c_side.future_type = type("Sub", (Send,), {"__slots__": ()})
        assert c_side._fast is None


def test_submit_put_writes_a_put_after_a_pause_from_the_callers_thread(pair):
    """As PipelinedConnection.put: the first put after a quiet spell (``_QUIET``) goes out
    from the caller's thread (``_write_now``), a put right behind another is left to the
    writer thread; the C path keeps that rule and ``_last_put``."""
    sinks, (cc, _) = pair
    state, route = _state(cc, _Path()), _route(cc, 2)
    cc.put("t", 0, b"x", 0, crc32(b"x") & CHECKSUM_MASK)  # (makes the topic's prefix)
    calls = []
    real = cc._write_now

    def counting() -> bool:
        calls.append(threading.current_thread().name)
        return real()

    cc._write_now = counting
    cc._last_put = time.monotonic() - 1.0  # a quiet second before it
    s = submit_put(state, "t", route, b"after a pause", 0)
    assert s.attempts == 1
    assert calls == [threading.current_thread().name]
    assert abs(cc._last_put - time.monotonic()) < 1.0
    cc._last_put = time.monotonic() + 60  # "the previous put was just now": no pause
    s2 = submit_put(state, "t", route, b"right behind", 0)
    assert s2.attempts == 1 and len(calls) == 1  # the writer thread's job
    wait_until(lambda: sinks[0].data.endswith(b"right behind"), timeout=10)
    assert b"after a pause" in sinks[0].data


def test_send_async_in_c_answers_every_call_as_the_python_method(zk_connect, broker_factory):
    """``Producer.send_async`` is a C method (``bind_send_async``) for its common call and
    the Python method (``py_send_async``) for the rest: both give the same results for
    the same messages, raise the same errors for the same bad calls, and a send the C
    call makes but cannot put goes on in ``_go_on`` as the Python method's does."""
    from metaq import (
        MessageTooLargeError,
        NoBrokerAvailableError,
        Producer,
        ProducerError,
        ProtocolError,
    )
    from metaq.producer._producer import py_send_async

    assert Producer.send_async is not py_send_async
    assert "Queue one message" in (Producer.send_async.__doc__ or "")
    broker = broker_factory({"fa": 2, "fb": 1}, zk_connect=zk_connect)
    with Producer(zk_connect, max_message_size=64, send_timeout=1.0) as p:
        goes_on = []
        real_go_on = p._go_on

        def counting(send, *args):  # noqa: ANN001, ANN002, ANN202
            goes_on.append(send)
            return real_go_on(send, *args)

        p._go_on = counting  # type: ignore[method-assign]
        assert p.partitions("fb") == ["0-0"]  # the route is known, no connection yet
        first = p.send_async("fb", b"first")  # C: no connection, goes on in _go_on
        assert goes_on == [first] and first.result(timeout=10).partition == "0-0"
        sent: list[tuple[object, bytes]] = []
        for i in range(200):
            body = b"b%d" % i * (i % 5)
            f = p.send_async("fa", body) if i % 2 else py_send_async(p, "fa", body)
            sent.append((f, body))
        # the other forms go to the Python method from the C one: a str body, keywords,
        # an attribute, a key
        sent.append((p.send_async("fa", "text"), p._encode("text")))
        sent.append((p.send_async(topic="fa", body=b"kw"), b"kw"))
        sent.append((p.send_async("fa", b"k", None, "key"), b"k"))
        results = [(f.result(timeout=10), body) for f, body in sent]
        assert len(goes_on) == 2  # and the first put of "fa" (its put prefix is made then)
        with BrokerConnection("127.0.0.1", broker.port) as conn:
            stored = {(f"0-{i}", m.offset): bytes(m.payload)
                      for i in range(2) for m in read_partition(conn, "fa", i)}
        assert {(r.partition, r.offset): body for r, body in results} == stored
        assert len(stored) == len(sent)

        def same_error(*args: object) -> type[BaseException]:
            errors = []
            for call in (p.send_async, lambda *a: py_send_async(p, *a)):
                with pytest.raises(Exception) as e:
                    call(*args)
                errors.append((type(e.value), str(e.value)))
            assert errors[0] == errors[1]
            return errors[0][0]

        assert same_error("fa", b"x" * 65) is MessageTooLargeError
        assert issubclass(same_error("no-such-topic", b"x"), NoBrokerAvailableError)
        assert issubclass(same_error("bad topic!", b"x"), ProtocolError)
    assert same_error("fa", b"x") is ProducerError  # closed
    with pytest.raises(TypeError):
        Producer.send_async(object(), "fa", b"x")  # a method of Producer only
