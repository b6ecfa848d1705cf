"""tx_acks (a transaction's put answers to one partition, in bulk) and tx_answers (the
broker's answers to a run of them): the C functions and their Python twins
(metaq/protocol/_fast.py ``py_tx_acks``, ``py_tx_answers``) give the same results; for
tx_acks the same "more is coming" (None) and "something else" (False), on answers cut
anywhere."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq.producer._send import SendResult
from metaq.protocol import _fast

c_tx_acks = getattr(_fast.speedups, "tx_acks", None)
needs_c = pytest.mark.skipif(c_tx_acks is None, reason=f"C speedups: {_fast.SPEEDUPS_STATUS}")

_digits = st.one_of(st.integers(0, 10**19).map(b"%d".__mod__),
                    st.sampled_from([b"", b"-1", b"01", b"007", b"x", b"3"]))
_reply = st.one_of(
    st.tuples(st.just("ack"), _digits, st.sampled_from([b"3", b"3", b"03", b"4", b"-3"]),
              st.sampled_from([b"-1", b"-1", b"-1", b"0", b"-2", b"-1 "])),
    st.tuples(st.just("raw"), st.binary(max_size=30), st.just(b""), st.just(b"")))


def _encode(items: list, first: int, wrong: int | None) -> bytes:
    out = []
    for i, (kind, a, b, c) in enumerate(items):
        opaque = first + i + (1 if wrong == i else 0)
        if kind == "ack":
            body = b"%b %b %b" % (a, b, c)
            out.append(b"result 200 %d %d\r\n%b" % (len(body), opaque, body))
        else:
            out.append(a)
    return b"".join(out)


@needs_c
@settings(max_examples=3000, deadline=None)
@given(items=st.lists(_reply, min_size=1, max_size=8), first=st.integers(0, 2**31 - 9),
       wrong=st.none() | st.integers(0, 8), index=st.sampled_from([3, 4, -3, 0, 12345]),
       prefix=st.binary(max_size=4), cut=st.integers(0, 400), extra=st.binary(max_size=20),
       as_bytearray=st.booleans())
def test_c_and_python_twins_agree(items, first, wrong, index, prefix, cut, extra,
                                  as_bytearray):
    data = prefix + _encode(items, first, wrong) + extra
    buf = bytearray(data) if as_bytearray else data
    opaques = list(range(first, first + len(items)))
    for end in (len(data), min(cut, len(data)), len(prefix) + cut // 2):
        args = (buf, len(prefix), end, opaques, SendResult, 7, index, "7-x")
        if end < len(prefix):
            with pytest.raises(ValueError):
                c_tx_acks(*args)
            with pytest.raises(ValueError):
                _fast.py_tx_acks(*args)
            continue
        want = _fast.py_tx_acks(*args)
        got = c_tx_acks(*args)
        assert got == want
        if got not in (None, False):
            assert all(type(r) is SendResult for r in got[0])


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
def test_the_usual_answers_and_what_stops_them(impl):
    f = c_tx_acks if impl == "c" else _fast.py_tx_acks
    ids = [10**15 + i for i in range(3)]
    good = b"".join(b"result 200 21 %d\r\n%d 7 -1" % (5 + i, ids[i]) for i in range(3))
    data = b"xx" + good + b"result 200 0 9\r\n"  # the COMMIT's answer after
    results, used = f(data, 2, len(data), [5, 6, 7], SendResult, 0, 7, "0-7")
    assert results == [SendResult(i, "0-7", -1, 0, 7) for i in ids]
    assert used == 2 + len(good)
    for end in range(2, 2 + len(good)):  # cut anywhere: more is coming
        assert f(data, 2, end, [5, 6, 7], SendResult, 0, 7, "0-7") is None
    assert f(data, 2, len(data), [5, 6, 8], SendResult, 0, 7, "0-7") is False  # opaque
    assert f(data, 2, len(data), [5, 6, 7], SendResult, 0, 8, "0-8") is False  # partition
    refused = data.replace(b"result 200 21 6\r\n", b"result 500 21 6\r\n")
    assert f(refused, 2, len(refused), [5, 6, 7], SendResult, 0, 7, "0-7") is False


@needs_c
@settings(max_examples=1000, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 2**31 - 1).map(b"%d".__mod__)
                                | st.binary(max_size=12),
                                st.integers(-(1 << 63), (1 << 63) - 1)), max_size=50),
       tail=st.binary(max_size=20))
def test_tx_answers_c_and_python_agree(pairs, tail):
    opaques = tuple(o for o, _i in pairs)
    ids = [i for _o, i in pairs]
    got = _fast.speedups.tx_answers(opaques, ids, tail)
    assert got == _fast.py_tx_answers(opaques, ids, tail)
    # what the broker wrote before: one format a put
    assert got == b"".join(b"result 200 %d %b\r\n%b" % (len(b"%d%b" % (i, tail)), o,
                                                          b"%d%b" % (i, tail))
                           for o, i in pairs)


@pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])
def test_tx_answers_refuses_what_it_cannot_write(impl):
    f = _fast.speedups.tx_answers if impl == "c" else _fast.py_tx_answers
    with pytest.raises(ValueError, match="different lengths"):
        f((b"1",), [1, 2], b"")
    with pytest.raises(TypeError, match="not bytes"):
        f(("1",), [1], b"")
    with pytest.raises(OverflowError):
        f((b"1",), [1 << 63], b"")
