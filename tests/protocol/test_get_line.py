"""The broker's fast read of a get line (``_fast.get_line``, C and its Python twin
``py_get_line``): the two agree on any line, and whatever they read, the full get
parser (``_parsers._get_request``) reads the same (so the fast path never reads a
line another way); what they do not read (None) the full parser still does."""

from __future__ import annotations

import gc
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq.protocol import GetRequest, RequestParser, _fast, encode_get, encode_get_head
from metaq.protocol import _parsers as parsers

s = _fast.speedups if hasattr(_fast.speedups, "get_line") else None
needs_c = pytest.mark.skipif(s is None, reason=f"C speedups: {_fast.SPEEDUPS_STATUS}, "
                                               f"get_line built: {s is not None}")

TOPICS = {b"t": "t", b"topic-1": "topic-1"}
GROUPS = {b"g": "g", b"meta-slave-group-1": "meta-slave-group-1"}

#: number tokens around every edge the parsers care about
_EDGES = [0, 1, 9, 10, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63,
          -2**63 - 1, 10**19, 10**20, -1]
_int32 = st.integers(-2**31, 2**31 - 1).map(lambda v: b"%d" % v)
numbers = st.one_of(
    _int32, _int32, _int32, st.integers(0, 99).map(lambda v: b"%d" % v),
    st.integers(-2**64, 2**64).map(lambda v: b"%d" % v),
    st.sampled_from(_EDGES).map(lambda v: b"%d" % v),
    st.sampled_from([b"-0", b"007", b"0" * 20 + b"1", b"0" * 19 + b"1", b"-" + b"0" * 19,
                     b"", b"-", b"+1", b"1x", b" 1", b"1 ", b"\xff", b"hold=1"]),
)
_odd_names = [b"unknown", b"", b"t\r", b"a b"]
topics = st.sampled_from(list(TOPICS) * 4 + _odd_names)
groups = st.sampled_from(list(GROUPS) * 4 + _odd_names)


@st.composite
def get_lines(draw) -> bytes:
    fields = [b"get", draw(topics), draw(groups)] + [draw(numbers) for _ in range(4)]
    extra = draw(st.sampled_from([0, 0, 1, 1, 2, 2, 3]))
    if extra >= 1:
        fields.append(draw(st.sampled_from([b"hold=", b"hold=", b"hold", b"x=", b"records="]))
                      + draw(numbers))
    if extra >= 2:
        fields.append(draw(st.sampled_from([b"records=", b"hold=", b"r="])) + draw(numbers))
    if extra >= 3:
        fields.append(draw(st.sampled_from([b"", b"x", b"records=1"])))
    line = b"  ".join(fields) if draw(st.integers(0, 7)) == 0 else b" ".join(fields)
    if draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(line)))
        line = line[:i] + draw(st.binary(max_size=3)) + line[i + draw(st.integers(0, 3)):]
    return line


def full(line: bytes) -> GetRequest | None:
    """What the full parser reads (None: a bad request)."""
    try:
        return parsers._get_request(parsers._fields(line))
    except Exception:
        return None


def _both(line: bytes) -> object:
    py = _fast.py_get_line(line, TOPICS, GROUPS, GetRequest)
    if s is not None:
        c = s.get_line(line, TOPICS, GROUPS, GetRequest)
        assert c == py and type(c) is type(py), (line, c, py)
    return py


@settings(max_examples=2000, deadline=None)
@given(get_lines())
def test_c_and_python_agree_and_never_read_a_line_another_way(line):
    got = _both(line)
    if got is not None:
        assert type(got) is GetRequest
        assert got == full(line), line


@given(st.sampled_from(list(TOPICS.values())), st.sampled_from(list(GROUPS.values())),
       st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1),
       st.integers(-2**31, 2**31 - 1), st.integers(-2**31, 2**31 - 1),
       st.integers(0, 2**31 - 1), st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)))
def test_every_get_a_client_writes_is_read_whole(topic, group, partition, offset, size, opaque,
                                                 hold, records):
    line = encode_get(topic, group, partition, offset, size, opaque, hold, records)[:-2]
    want = GetRequest(topic, group, partition, offset, size, opaque,
                      hold if hold > 0 or records is not None else 0, records)
    assert _both(line) == want == full(line)
    head = encode_get_head(topic, group, partition)
    assert line.startswith(head)


def test_unknown_names_and_odd_forms_go_to_the_full_parser():
    for line in [b"get unknown g 0 0 1 1", b"get t nobody 0 0 1 1", b"get t g 0 0 1 1 ",
                 b"get t g 0 0 1 1 x=1", b"get t g 0 0 1 1 hold=1 records=2 x",
                 b"get t g 0 0 1 1 hold=-1", b"get t g 2147483648 0 1 1", b"get  t g 0 0 1 1"]:
        assert _both(line) is None, line
    # and the parser reads them as before (a bad request, or the same get)
    p = RequestParser()
    (r,) = p.feed(b"get t g 0 0 1 1 x=1\r\n")
    assert r == GetRequest("t", "g", 0, 0, 1, 1)


@needs_c
def test_the_c_one_refuses_bad_arguments_and_leaks_nothing():
    with pytest.raises(TypeError):
        s.get_line("get t g 0 0 1 1", TOPICS, GROUPS, GetRequest)
    with pytest.raises(TypeError):
        s.get_line(b"get t g 0 0 1 1", TOPICS, GROUPS, int)
    with pytest.raises(TypeError):
        s.get_line(b"get t g 0 0 1 1", TOPICS, GROUPS)
    assert s.get_line(b"get t g 0 5 1 1", TOPICS, GROUPS, tuple) == ("t", "g", 0, 5, 1, 1, 0,
                                                                      None)
    line = b"get t g 0 123456789012 1 1 hold=5 records=7"
    for _ in range(1000):
        s.get_line(line, TOPICS, GROUPS, GetRequest)
    gc.collect()
    before = sys.gettotalrefcount() if hasattr(sys, "gettotalrefcount") else None
    objs = len(gc.get_objects())
    for _ in range(10_000):
        s.get_line(line, TOPICS, GROUPS, GetRequest)
        s.get_line(b"get unknown g 0 0 1 1", TOPICS, GROUPS, GetRequest)
    gc.collect()
    assert len(gc.get_objects()) - objs < 100
    if before is not None:
        assert sys.gettotalrefcount() - before < 100


def test_the_parser_binds_the_c_one_when_built():
    assert parsers.get_line is (s.get_line if s is not None else _fast.py_get_line)
