"""``put_ack`` (issue 29, the blocking send's lone acknowledgement) in C against its
pure-Python twin: the same answer -- a ``SendResult``, None (not whole yet) or False
(anything else) -- for every buffer, and the right one for replies a broker sends; and
``put_round_trip`` (write, release the send lock, one read) alike over a socket pair."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaq.producer import SendResult
from metaq.protocol import _fast

s = _fast.speedups
needs_c = pytest.mark.skipif(s is None or not hasattr(s, "put_ack"),
                             reason=f"C speedups: {_fast.SPEEDUPS_STATUS}")
IMPLS = [pytest.param("c", marks=needs_c), "python"]


class Names(dict):
    """A partition-name cache like the producer's (``__missing__`` builds a name)."""

    def __missing__(self, index: int) -> str:
        name = self[index] = f"7-{index}"
        return name


def _fn(impl: str):  # type: ignore[no-untyped-def]
    return s.put_ack if impl == "c" else _fast.py_put_ack


def _reply(msg_id: int, index: int, offset: int, opaque: int) -> bytes:
    body = b"%d %d %d" % (msg_id, index, offset)
    return b"result 200 %d %d\r\n%b" % (len(body), opaque, body)


_num = st.one_of(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**64 * 10),
                 st.sampled_from([0, -1, 10**18, 10**19 - 1, 10**19, -(10**19) + 1]))
_opaque = st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, 9999999999,
                                                                       -9999999999, 2**70]))


@pytest.mark.parametrize("impl", IMPLS)
@given(msg_id=st.integers(0, 2**63 - 1), index=st.integers(0, 10**9 - 1),
       offset=st.integers(0, 2**63 - 1), opaque=st.integers(0, 2**31 - 1))
def test_a_broker_ack_gives_its_result_and_every_prefix_waits(impl, msg_id, index, offset,
                                                             opaque):
    fn = _fn(impl)
    reply = _reply(msg_id, index, offset, opaque)
    assert fn(reply, opaque, SendResult, 7, Names()) == SendResult(
        msg_id, f"7-{index}", offset, 7, index)
    r = fn(reply, opaque, SendResult, 7, Names())
    assert type(r) is SendResult and type(r.msg_id) is int and type(r.index) is int
    for cut in range(len(reply)):
        assert fn(reply[:cut], opaque, SendResult, 7, Names()) is None, cut
    assert fn(reply, opaque + 1, SendResult, 7, Names()) is False  # someone else's
    assert fn(reply + reply, opaque, SendResult, 7, Names()) is False  # more than one
    assert fn(reply + b"r", opaque, SendResult, 7, Names()) is False
    assert fn(reply.replace(b" 200 ", b" 500 "), opaque, SendResult, 7, Names()) is False


def _mutations(data: bytes) -> st.SearchStrategy[bytes]:
    n = len(data)
    return st.one_of(
        st.just(data),
        st.integers(0, n).map(lambda i: data[:i]),
        st.tuples(st.integers(0, max(0, n - 1)), st.integers(0, 255)).map(
            lambda t: data[:t[0]] + bytes([t[1]]) + data[t[0] + 1:]),
        st.tuples(st.integers(0, n), st.binary(max_size=4)).map(
            lambda t: data[:t[0]] + t[1] + data[t[0]:]),
        st.tuples(st.integers(0, max(0, n - 1)), st.integers(1, 3)).map(
            lambda t: data[:t[0]] + data[t[0] + t[1]:]),
    )


_bodies = st.one_of(
    st.tuples(_num, st.integers(-5, 10**10), _num).map(lambda t: b"%d %d %d" % t),
    st.sampled_from([b"1 2 3", b"01 002 -0", b"1 2", b"1 2 3 4", b"1  2 3", b"+1 2 3",
                     b"1_0 2 3", b" 1 2 3", b"1 2 3 ", b"a b c", b"", b"1 -2 3"]),
    st.binary(max_size=30))


@st.composite
def _buffers(draw: st.DrawFn) -> tuple[bytes, int]:
    opaque = draw(_opaque)
    body = draw(_bodies)
    length = draw(st.one_of(st.just(len(body)), st.integers(0, 80),
                            st.sampled_from([10**9 - 1, 10**9])))
    code = draw(st.sampled_from([b"200", b"200", b"500", b"20", b"2000", b"403"]))
    head_opaque = draw(st.one_of(st.just(opaque), _opaque, st.sampled_from([-0, 10**10])))
    reply = b"result %b %d %d\r\n%b" % (code, length, head_opaque, body)
    reply = draw(_mutations(reply))
    tail = draw(st.one_of(st.just(b""), st.binary(max_size=8),
                          st.just(_reply(1, 2, 3, opaque))))
    return reply + tail, opaque


@needs_c
@given(_buffers())
def test_c_equals_its_twin_on_anything(case):
    buf, opaque = case
    want = _fast.py_put_ack(buf, opaque, SendResult, 7, Names())
    got = s.put_ack(buf, opaque, SendResult, 7, Names())
    assert got == want and type(got) is type(want)


@needs_c
@given(st.binary(max_size=120), _opaque)
def test_c_equals_its_twin_on_random_bytes(buf, opaque):
    want = _fast.py_put_ack(buf, opaque, SendResult, 7, Names())
    got = s.put_ack(buf, opaque, SendResult, 7, Names())
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("impl", IMPLS)
def test_put_ack_edges(impl):
    fn = _fn(impl)
    names = Names()
    assert fn(b"", 1, SendResult, 7, names) is None
    assert fn(b"x" * 63, 1, SendResult, 7, names) is None  # may be a reply's start
    assert fn(b"x" * 64, 1, SendResult, 7, names) is False  # too long for a header
    assert fn(b"result 200 65 1\r\n" + b"1" * 65, 1, SendResult, 7, names) is False
    assert fn(b"result 200 9 -01\r\n1 2 3", -1, SendResult, 7, names) is None  # 5 of 9
    assert fn(b"result 200 5 -01\r\n1 2 3", -1, SendResult, 7, names) == (1, "7-2", 3, 7, 2)
    assert fn(b"result 200 5 1\r\n1 2 3", 1, tuple, 7, names) == (1, "7-2", 3, 7, 2)
    big = b"%d 0 %d" % (10**19 - 1, -(10**19 - 1))
    assert fn(b"result 200 %d 4\r\n%b" % (len(big), big), 4, SendResult, 7, names) == (
        10**19 - 1, "7-0", -(10**19 - 1), 7, 0)
    with pytest.raises(KeyError):  # a plain dict: what names[] raises goes through
        fn(b"result 200 5 1\r\n1 2 3", 1, SendResult, 7, {})
    if impl == "c":
        with pytest.raises(TypeError):
            fn(bytearray(b"result 200 5 1\r\n1 2 3"), 1, SendResult, 7, names)
        with pytest.raises(TypeError):
            fn(b"", 1, int, 7, names)


def test_without_the_extension_the_names_are_the_twins():
    code = ("import metaq.protocol as p; from metaq.protocol import _fast as f;"
            "assert f.speedups is None and p.put_ack is f.py_put_ack is f.put_ack;"
            "assert p.put_round_trip is f.py_put_round_trip is f.put_round_trip")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         "METAQ_NO_SPEEDUPS": "1"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


ROUND_TRIPS = [pytest.param("c", marks=needs_c), "python"]


def _round_trip(impl: str):  # type: ignore[no-untyped-def]
    return s.put_round_trip if impl == "c" else _fast.py_put_round_trip


@pytest.mark.parametrize("impl", ROUND_TRIPS)
@pytest.mark.parametrize(("answer", "want"), [
    (_reply(11, 2, 40, 5), SendResult(11, "7-2", 40, 7, 2)),
    (b"result 500 4 5\r\noops", b"result 500 4 5\r\noops"),  # not a success: the bytes
    (_reply(11, 2, 40, 6), _reply(11, 2, 40, 6)),  # someone else's
    (_reply(11, 2, 40, 5) + _reply(1, 1, 1, 6), _reply(11, 2, 40, 5) + _reply(1, 1, 1, 6)),
    (b"result 200 7 5\r\n11 ", b"result 200 7 5\r\n11 "),  # not whole yet: the bytes
    (b"", b""),  # the peer closed
    (None, None),  # nothing within the receive timeout
])
def test_put_round_trip_writes_releases_and_reads_once(impl, answer, want):  # type: ignore[no-untyped-def]
    import socket
    import struct
    import threading

    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, 100_000))
        if answer == b"":
            b.shutdown(socket.SHUT_WR)
        elif answer is not None:
            b.sendall(answer)
        lock = threading.Lock()
        lock.acquire()
        got = _round_trip(impl)(a, lock, b"put t 1 1 0 0 5\r\nx", 5, SendResult, 7, Names())
        assert got == want and type(got) is type(want)
        assert not lock.locked()  # released, whatever the answer
        assert b.recv(100) == b"put t 1 1 0 0 5\r\nx"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("impl", ROUND_TRIPS)
def test_put_round_trip_releases_the_lock_when_it_fails(impl):  # type: ignore[no-untyped-def]
    import socket
    import threading

    a, b = socket.socketpair()
    b.close()
    lock = threading.Lock()
    lock.acquire()
    try:
        with pytest.raises(OSError):
            _round_trip(impl)(a, lock, b"x" * 100_000, 5, SendResult, 7, Names())
        assert not lock.locked()
    finally:
        a.close()
    lock.acquire()
    with pytest.raises(OSError):  # a closed socket: fileno() is -1
        _round_trip(impl)(a, lock, b"x", 5, SendResult, 7, Names())
    assert not lock.locked()
