"""The producer's per-message C helpers (issue 29) against their pure-Python twins:
``put_request`` (one put's bytes) and ``untrack`` / ``track`` (the cyclic collector)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import metaq.protocol
from metaq.protocol import _fast, encode_put

s = _fast.speedups
needs_c = pytest.mark.skipif(s is None, reason=f"C speedups: {_fast.SPEEDUPS_STATUS}")

_ints = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-(2**70), 2**70),
                  st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1]),
                  st.booleans())
_payloads = st.one_of(st.binary(max_size=400), st.binary(max_size=50).map(bytearray))
_prefixes = st.one_of(st.sampled_from([b"put t ", "put ü%d ".encode(), b""]),
                      st.binary(max_size=40))


@needs_c
@given(_prefixes, _ints, _payloads, _ints, _ints, _ints)
def test_put_request_equals_its_twin(prefix, partition, payload, flag, checksum, opaque):
    want = _fast.py_put_request(prefix, partition, payload, flag, checksum, opaque)
    assert s.put_request(prefix, partition, payload, flag, checksum, opaque) == want
    assert type(s.put_request(prefix, partition, payload, flag, checksum, opaque)) is bytes


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
@given(partition=st.integers(0, 2**31 - 1), payload=st.binary(max_size=300),
       flag=st.integers(-(2**31), 2**31 - 1), checksum=st.integers(0, 2**31 - 1),
       opaque=st.integers(0, 2**31 - 1), topic=st.sampled_from(["t", "orders", "ü-x_1"]))
def test_put_request_is_encode_put(impl, partition, payload, flag, checksum, opaque, topic):
    fn = s.put_request if impl == "c" else _fast.py_put_request
    prefix = b"put " + topic.encode() + b" "
    assert fn(prefix, partition, payload, flag, checksum, opaque) == encode_put(
        topic, partition, payload, flag, checksum, opaque)


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
def test_put_request_refuses_what_the_formatting_refuses(impl):
    fn = s.put_request if impl == "c" else _fast.py_put_request
    for bad in [("put t ", 0, b"x", 0, 0, 0), (b"put t ", "0", b"x", 0, 0, 0),
                (b"put t ", 0, "x", 0, 0, 0)]:
        with pytest.raises(TypeError):
            fn(*bad)
    # what %d takes (a float, a memoryview payload) it takes alike
    odd = (b"put t ", 2, memoryview(b"xy"), 0, 1.5, 7)
    assert fn(*odd) == _fast.py_put_request(*odd) == b"put t 2 2 0 1 7\r\nxy"
    if impl == "c":
        with pytest.raises(TypeError):
            fn(b"put t ", 0, b"x", 0, 0)


@needs_c
def test_untrack_and_track():
    class Thing:
        __slots__ = ("x",)

    t = Thing()
    assert gc.is_tracked(t)
    s.untrack(t)
    assert not gc.is_tracked(t)
    s.untrack(t)  # twice: nothing more
    s.track(t)
    assert gc.is_tracked(t)
    s.track(t)
    assert gc.is_tracked(t)
    s.untrack(5)  # not a GC object: nothing
    s.track(b"x")
    assert not gc.is_tracked(b"x")


def test_without_the_extension_the_names_are_the_twins():
    code = ("import metaq.protocol as p; from metaq.protocol import _fast as f;"
            "names = ('put_request', 'untrack', 'track', 'complete_acks', 'ack_result');"
            "wrong = [n for n in names if getattr(f, n) is not getattr(f, 'py_' + n)"
            "         or getattr(p, n) is not getattr(f, 'py_' + n)];"
            "assert f.speedups is None and not wrong, wrong")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         "METAQ_NO_SPEEDUPS": "1"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


@needs_c
def test_with_the_extension_the_names_are_c():
    assert metaq.protocol.put_request is s.put_request
    assert (metaq.protocol.untrack, metaq.protocol.track) == (s.untrack, s.track)


class _Req:
    __slots__ = ("payload", "_ack_id", "_ack_index", "_ack_offset", "_state", "_waited")

    def __init__(self, waited: bool) -> None:
        self.payload = b"body"
        self._state = "RUNNING"
        self._waited = waited


def _fields(r: _Req) -> tuple:
    return (r.payload, r._ack_id, r._ack_index, r._ack_offset, r._state, r._waited)


_digits = st.integers(0, 2**63).map(lambda i: b"%d" % i)


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
@given(rows=st.lists(st.tuples(st.booleans(), _digits, _digits, _digits), max_size=30))
def test_complete_acks_stores_the_answers_and_names_the_waited(impl, rows):
    fn = s.complete_acks if impl == "c" else _fast.py_complete_acks
    reqs = [_Req(w) for w, _, _, _ in rows]
    cols = [[r[k] for r in rows] for k in (1, 2, 3)]
    waited = fn(reqs, *cols, "FINISHED")
    assert waited == [r for r in reqs if r._waited]
    assert [_fields(r) for r in reqs] == [(b"", a, b, c, "FINISHED", w) for w, a, b, c in rows]


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
def test_complete_acks_refuses_columns_of_different_lengths(impl):
    fn = s.complete_acks if impl == "c" else _fast.py_complete_acks
    with pytest.raises(ValueError):
        fn([_Req(False)], [b"1"], [], [b"2"], "FINISHED")


class _Names(dict):
    def __missing__(self, index: int) -> str:
        name = self[index] = f"7-{index}"
        return name


class _Result(tuple):
    __slots__ = ()


_odd_digits = st.one_of(_digits, st.sampled_from([b"007", b" 12", b"1_0", b"-5", b"+3",
                                                  b"9" * 19, b"9" * 40, b"", b"x"]))


def _outcome(fn, *args):
    try:
        r = fn(*args)
        return type(r), tuple(r)
    except Exception as e:
        return type(e)


@needs_c
@given(msg_id=_odd_digits, index=_odd_digits, offset=_odd_digits,
       cls=st.sampled_from([tuple, _Result]))
def test_ack_result_equals_its_twin(msg_id, index, offset, cls):
    want = _outcome(_fast.py_ack_result, cls, msg_id, index, offset, 7, _Names())
    assert _outcome(s.ack_result, cls, msg_id, index, offset, 7, _Names()) == want


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
def test_ack_result_builds_a_send_result(impl):
    from metaq.producer import SendResult

    fn = s.ack_result if impl == "c" else _fast.py_ack_result
    r = fn(SendResult, b"123", b"2", b"4096", 7, _Names())
    assert type(r) is SendResult and r == SendResult(123, "7-2", 4096, 7, 2)
