"""Text protocol (reference section 6): encoders, incremental parsers, fuzz."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import metaq
from metaq.protocol import (
    QUIT,
    BadRequest,
    GetRequest,
    OffsetRequest,
    PutRequest,
    QuitRequest,
    ReplyParser,
    RequestParser,
    Result,
    StatsRequest,
    SyncRequest,
    TxPut,
    Value,
    VersionRequest,
    check_topic,
    checksum,
    encode_get,
    encode_get_head,
    encode_offset,
    encode_put,
    encode_result,
    encode_stats,
    encode_sync,
    encode_value_header,
    encode_version,
    parse_put_result,
)

int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
def _usable(s: str) -> bool:
    try:
        check_topic(s)
        return True
    except metaq.ProtocolError:
        return False


names = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp", "Cf", "Co",
                                                    "Cn")),
                min_size=1, max_size=30).filter(_usable)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for c in cuts + [len(data)]:
        out.append(data[prev:c])
        prev = c
    return out


def test_exact_bytes():
    assert encode_put("t", 3, b"abc", 1, 99, 7) == b"put t 3 3 1 99 7\r\nabc"
    assert encode_put("t", -1, b"", 0, 0, 8, tx_key="tx1") == b"put t -1 0 0 0 tx1 8\r\n"
    assert encode_get("t", "g", 0, 4096, 1024, 9) == b"get t g 0 4096 1024 9\r\n"
    assert encode_get("t", "g", 0, 4096, 1024, 9, 500, 10) == \
        b"get t g 0 4096 1024 9 hold=500 records=10\r\n"
    assert encode_offset("t", "g", 1, 5, 10) == b"offset t g 1 5 10\r\n"
    assert encode_offset("t", "g", 1, 0, 10, 1_700_000_000_000) == \
        b"offset t g 1 0 10 time=1700000000000\r\n"
    assert encode_stats(None, 11) == b"stats  11\r\n"  # as Java writes it
    assert encode_stats("topics", 12) == b"stats topics 12\r\n"
    assert encode_version(13) == b"version 13\r\n"
    assert QUIT == b"quit\r\n"
    assert encode_result(200, b"1 0 20", 14) == b"result 200 6 14\r\n1 0 20"
    assert encode_value_header(100, 15) == b"value 100 15\r\n"
    assert parse_put_result(b"123 2 4096") == (123, 2, 4096)


@pytest.mark.parametrize("topic", ["", "a b", "a/b", "a,b", "..", ".x", "x\n", "a\\b", "a" * 256])
def test_encoders_reject_bad_topic(topic):
    with pytest.raises(metaq.ProtocolError, match="topic"):
        encode_put(topic, 0, b"", 0, 0, 1)


requests = st.one_of(
    st.builds(lambda t, p, pl, f, c, tx, o: PutRequest(t, p, len(pl), f, c, tx, o, pl),
              names, int32, st.binary(max_size=200), int32, st.integers(0, 2**31 - 1),
              st.one_of(st.none(), names), int32),
    st.builds(GetRequest, names, names, int32, int64, int32, int32,
              st.one_of(st.just(0), st.integers(1, 2**31 - 1)),
              st.one_of(st.none(), int32)),
    st.builds(OffsetRequest, names, names, int32, int64, int32,
              st.one_of(st.just(-1), st.integers(0, 2**63 - 1))),
    st.builds(StatsRequest, st.one_of(st.none(), names), int32),
    st.builds(VersionRequest, int32),
    st.just(QuitRequest()),
)


def encode_request(r) -> bytes:
    if isinstance(r, PutRequest):
        return encode_put(r.topic, r.partition, r.payload, r.flag, r.checksum, r.opaque, r.tx_key)
    if isinstance(r, GetRequest):
        return encode_get(r.topic, r.group, r.partition, r.offset, r.max_size, r.opaque,
                          r.hold_ms, r.records)
    if isinstance(r, OffsetRequest):
        return encode_offset(r.topic, r.group, r.partition, r.offset, r.opaque, r.time_ms)
    if isinstance(r, StatsRequest):
        return encode_stats(r.item, r.opaque)
    if isinstance(r, VersionRequest):
        return encode_version(r.opaque)
    return QUIT


@given(names, names, int32, int64, int32, int32, st.integers(-5, 2**31 - 1),
       st.one_of(st.none(), int32))
def test_get_head_starts_every_get(topic, group, partition, offset, max_size, opaque, hold,
                                   records):
    """A slave encodes its gets as ``encode_get_head`` + the tail (``_follower``)."""
    head = encode_get_head(topic, group, partition)
    if records is not None:
        tail = b"%d %d %d hold=%d records=%d\r\n" % (offset, max_size, opaque, max(hold, 0),
                                                     records)
    elif hold > 0:
        tail = b"%d %d %d hold=%d\r\n" % (offset, max_size, opaque, hold)
    else:
        tail = b"%d %d %d\r\n" % (offset, max_size, opaque)
    assert head + tail == encode_get(topic, group, partition, offset, max_size, opaque, hold,
                                     records)


def test_get_head_checks_names():
    with pytest.raises(metaq.ProtocolError, match="group"):
        encode_get_head("t", "bad group", 0)
    with pytest.raises(metaq.ProtocolError, match="topic"):
        encode_get_head("bad topic", "g", 0)


@given(st.lists(requests, max_size=15), st.lists(st.integers(0, 10_000), max_size=10))
def test_request_round_trip_any_chunking(reqs, cuts):
    data = b"".join(map(encode_request, reqs))
    parser = RequestParser()
    got = []
    for chunk in chunked(data, cuts):
        got += parser.feed(chunk)
    assert got == reqs
    assert parser.buffered == 0


replies = st.one_of(
    st.builds(Result, st.integers(0, 999), st.binary(max_size=200), int32),
    st.builds(Value, st.binary(max_size=300), int32),
)


def encode_reply(r) -> bytes:
    if isinstance(r, Result):
        return encode_result(r.code, r.body, r.opaque)
    return encode_value_header(len(r.body), r.opaque) + r.body


@given(st.lists(replies, max_size=15), st.lists(st.integers(0, 10_000), max_size=10))
def test_reply_round_trip_any_chunking(reps, cuts):
    data = b"".join(map(encode_reply, reps))
    parser = ReplyParser()
    got = []
    for chunk in chunked(data, cuts):
        got += parser.feed(chunk)
    assert got == reps


valid_types = (PutRequest, SyncRequest, GetRequest, OffsetRequest, StatsRequest, VersionRequest,
               QuitRequest)
line_tokens = st.sampled_from([b"put", b"get", b"offset", b"stats", b"version", b"quit", b"t",
                               b"sync", b"hold=5", b"time=x", b"TX:1",
                               b"-1", b"0", b"5", b"\xff", b"99999999999999999999999", b"",
                               b"\r\n", b"\r", b"\n", b" ", b"abc"])
fuzz_bytes = st.one_of(st.binary(max_size=400),
                       st.lists(line_tokens, max_size=60).map(b" ".join),
                       st.lists(st.one_of(line_tokens, st.binary(max_size=5)),
                                max_size=60).map(b"".join))


@settings(max_examples=300)
@given(fuzz_bytes, st.lists(st.integers(0, 500), max_size=8))
def test_request_parser_fuzz(data, cuts):
    """Arbitrary bytes, arbitrary chunking: only valid requests or ProtocolError."""
    parser = RequestParser(max_line=64, max_payload=50)
    lenient = RequestParser(max_line=64, max_payload=50)
    lenient_ok = True
    for chunk in chunked(data, cuts):
        pending = chunk
        while True:
            try:
                for r in parser.feed(pending):
                    assert isinstance(r, valid_types)
                break
            except metaq.ProtocolError as e:
                assert str(e)
                if parser._broken is not None:
                    break
                pending = b""
        if not lenient_ok:
            continue
        for r in lenient.feed_lenient(chunk):
            assert isinstance(r, (*valid_types, BadRequest))
            if isinstance(r, BadRequest) and r.fatal:
                lenient_ok = False
            if isinstance(r, PutRequest):
                assert len(r.payload) == r.length <= 50
    assert parser.buffered <= len(data)


@settings(max_examples=300)
@given(fuzz_bytes, st.lists(st.integers(0, 500), max_size=8))
def test_reply_parser_fuzz(data, cuts):
    parser = ReplyParser(max_line=64, max_body=100)
    try:
        for chunk in chunked(data, cuts):
            for r in parser.feed(chunk):
                assert isinstance(r, (Result, Value))
    except metaq.ProtocolError as e:
        assert "reply" in str(e)
        with pytest.raises(metaq.ProtocolError, match="broken"):
            parser.feed(b"version 1\r\n")


@pytest.mark.parametrize("line, what, fatal", [
    (b"bogus 1\r\n", "unknown command", False),
    (b"\r\n", "unknown command", False),
    (b"get t g 0 0 1\r\n", "expected 'get", False),
    (b"get t g x 0 1 2\r\n", "partition b'x' is not an integer", False),
    (b"get \xff g 0 0 1 2\r\n", "topic b'\\\\xff' is not valid UTF-8", False),
    (b"get a/b g 0 0 1 2\r\n", "bad topic 'a/b'", False),
    (b"get t g 0 0 1 99999999999\r\n", "opaque 99999999999 is out of range", False),
    (b"get t g 0 0 1 2 hold=x\r\n", "hold b'x' is not an integer", False),
    (b"offset t g 0 0 1 time=-5\r\n", "time -5 is out of range", False),
    (b"version x\r\n", "opaque b'x' is not an integer", False),
    (b"version  5\r\n", "opaque b'' is not an integer", False),
    (b"stats a b c\r\n", "opaque b'b' is not an integer", False),
    (b"stats \xff 5\r\n", "stats item b'\\\\xff' is not valid UTF-8", False),
    (b"quit 1\r\n", "expected 'quit'", False),
    (b"put t 0 3 0 0 x\r\nabc", "opaque b'x' is not an integer", False),
    (b"put t 0 3 0 1x 2\r\nabc", "checksum b'1x' is not an integer", False),
    (b"put t 0 3 0  2\r\nabc", "bad transaction key", False),
    (b"put t 0 3 0 0 a b 2\r\nabc", "expected 'put", True),
    (b"put t 0 x 0 0 1\r\nabc", "length b'x' is not an integer", True),
    (b"put t 0 -3 0 0 1\r\n", "length -3 is out of range", True),
    (b"put t 0 3 0\r\nabc", "expected 'put", True),
    (b"sync t 0 3 0 x 7\r\nabc", "msgId b'x' is not an integer", False),
    (b"sync t 0 3 0 12 1x 7\r\nabc", "checksum b'1x' is not an integer", False),
    (b"sync a/b 0 3 0 12 -1 7\r\nabc", "bad topic 'a/b'", False),
    (b"sync t 0 3 0 99999999999999999999 7\r\nabc", "msgId 99999999999999999999 is out", False),
    (b"sync t 0 100 0 12 7\r\n" + b"x" * 100, "payload length 100 is over the limit 50", False),
    (b"sync t 0 3 0 7\r\nabc", "bad sync line", True),
    (b"sync t 0 x 0 12 7\r\nabc", "bad sync line", True),
    (b"sync t 0 -3 0 12 7\r\n", "length -3 is out of range", True),
    (b"put t 0 100 0 0 5\r\n" + b"x" * 100, "payload length 100 is over the limit 50", False),
    (b"x" * 80, "no CRLF within 64 bytes", True),
])
def test_bad_requests_named(line, what, fatal):
    follow = b"version 77\r\n"
    parser = RequestParser(max_line=64, max_payload=50)
    with pytest.raises(metaq.ProtocolError, match=what.replace("'", ".").replace("(", ".")):
        parser.feed(line + follow)
    if fatal:
        with pytest.raises(metaq.ProtocolError, match="broken"):
            parser.feed(b"")
    else:
        assert parser.feed(b"") == [VersionRequest(77)]
    lenient = RequestParser(max_line=64, max_payload=50)
    out = lenient.feed_lenient(line + follow)
    assert isinstance(out[0], BadRequest) and out[0].fatal is fatal
    assert out[1:] == ([] if fatal else [VersionRequest(77)])


def test_oversize_payload_skipped_across_chunks():
    parser = RequestParser(max_payload=10)
    out = parser.feed_lenient(b"put t 0 1000 0 0 5\r\n" + b"x" * 100)
    assert len(out) == 1 and out[0].opaque == 5 and not out[0].fatal
    for _ in range(8):
        assert parser.feed_lenient(b"y" * 100) == []
    assert parser.feed_lenient(b"z" * 100 + b"version 6\r\n") == [VersionRequest(6)]


def test_put_payload_exact_and_big_chunks():
    payload = bytes(range(256)) * 4000
    data = encode_put("big", 2, payload, 0, checksum(payload), 1) + encode_version(2)
    parser = RequestParser(max_payload=len(payload))
    got = []
    for i in range(0, len(data), 4096):
        got += parser.feed(data[i:i + 4096])
    assert got[0].payload == payload and got[1] == VersionRequest(2)


@pytest.mark.parametrize("data, what", [
    (b"resul 200 0 1\r\n", "expected 'result"),
    (b"result 200 x 1\r\n", "body length"),
    (b"value 99999 1\r\n", "value length 99999 is out of range"),
    (b"value -1 1\r\n", "out of range"),
])
def test_bad_replies_named(data, what):
    parser = ReplyParser(max_body=1000)
    with pytest.raises(metaq.ProtocolError, match=what):
        parser.feed(data)


FAST = {b"t 0": "T0", b"t 12": "T12", b"t -1": "T?", "ü 3".encode(): "U3"}
_FAST_NAMES = {v: k for k, v in FAST.items()}


def _unfast(r):
    """A fast-path tuple back to the PutRequest the slow path makes."""
    if type(r) is TxPut:
        target, length, flag, check, opaque, payload, key = r
        topic, part = _FAST_NAMES[target].decode().rsplit(" ", 1)
        return PutRequest(topic, int(part), length, flag, check, key.decode(), int(opaque),
                          payload)
    if type(r) is not tuple:
        return r
    target, length, flag, check, opaque, payload = r
    topic, part = _FAST_NAMES[target].decode().rsplit(" ", 1)
    return PutRequest(topic, int(part), length, flag, check, None, int(opaque), payload)


fast_puts = st.builds(
    lambda t, p, pl, f, c, o: PutRequest(t, p, len(pl), f, c, None, o, pl),
    st.sampled_from(["t", "ü", "x"]), st.sampled_from([0, 12, -1, 3, 7]),
    st.binary(max_size=50), int32, st.one_of(st.integers(0, 2**31 - 1), st.just(-1), int32),
    int32)


class _Legacy(bytes):
    """The bytes of Java's legacy put without a checksum (6 fields), and the
    PutRequest it means (checksum -1)."""

    request: PutRequest


def _legacy_put(t: str, p: int, pl: bytes, f: int, o: int) -> _Legacy:
    b = _Legacy(b"put %s %d %d %d %d\r\n%s" % (t.encode(), p, len(pl), f, o, pl))
    b.request = PutRequest(t, p, len(pl), f, -1, None, o, pl)
    return b


def _tx_put(t: str, p: int, pl: bytes, f: int, c: int | None, k: str, o: int):  # noqa: ANN202
    """A put with a transaction key: 8 fields, or 7 (``c`` None) with the key in the
    checksum's place (a key that does not start with a digit or '-')."""
    if c is None and (k[0].isdigit() or k[0] == "-"):
        c = -1
    if c is not None:
        return PutRequest(t, p, len(pl), f, c, k, o, pl)
    b = _Legacy(b"put %s %d %d %d %s %d\r\n%s" % (t.encode(), p, len(pl), f, k.encode(), o,
                                                  pl))
    b.request = PutRequest(t, p, len(pl), f, -1, k, o, pl)
    return b


tx_puts = st.builds(_tx_put, st.sampled_from(["t", "ü", "x"]),
                    st.sampled_from([0, 12, -1, 3, 7]), st.binary(max_size=50), int32,
                    st.one_of(st.none(), st.just(-1), int32),
                    st.sampled_from(["TX:s:1", "XID:1:0a:0b:q", "12", "-k", "k" * 512,
                                     "é"]), int32)

legacy_puts = st.builds(_legacy_put, st.sampled_from(["t", "ü", "x"]),
                        st.sampled_from([0, 12, -1, 3, 7]), st.binary(max_size=50), int32,
                        int32)


def _wire(r) -> bytes:  # noqa: ANN001
    return r if isinstance(r, _Legacy) else encode_request(r)


def _meant(r):  # noqa: ANN001, ANN202
    return r.request if isinstance(r, _Legacy) else r


@pytest.fixture(params=["c", "python"])
def put_loop(request, monkeypatch):
    """The broker's fast put loop in C (metaq/protocol/_speedups.c) and its Python twin
    (``py_fast_puts``), as ``_fast`` binds one of them for the parser."""
    from metaq.protocol import _fast as _native

    if request.param == "c":
        if _native.speedups is None:  # test_speedups.py (this room) fails if a compiler was there
            pytest.skip("the C speedups are not built")
        monkeypatch.setattr(_native, "fast_puts", _native.speedups.fast_puts)
    else:
        monkeypatch.setattr(_native, "fast_puts", _native.py_fast_puts)
    return request.param


@pytest.mark.usefixtures("put_loop")
@settings(max_examples=300)
@given(st.lists(st.one_of(fast_puts, legacy_puts, tx_puts, requests), max_size=20),
       st.lists(st.integers(0, 3000), max_size=6), st.binary(max_size=30))
def test_fast_put_path_agrees_with_the_slow_path(reqs, cuts, junk):
    """Every put form (ours, Java's checksum -1, the 6-field legacy form, the puts with a
    transaction key) in the put loop (C and Python) gives what the general parser gives."""
    data = b"".join(map(_wire, reqs)) + junk
    reqs = list(map(_meant, reqs))
    fast = RequestParser(tx_puts=True, fast_puts=FAST, max_payload=60)
    slow = RequestParser(max_payload=60)
    got_fast, got_slow = [], []
    for chunk in chunked(data, cuts):
        got_fast += [_unfast(r) for r in fast.feed_lenient(chunk)]
        got_slow += slow.feed_lenient(chunk)
        if any(isinstance(r, BadRequest) and r.fatal for r in got_fast + got_slow):
            break  # the stream is broken: a caller closes the connection, feeds no more
    norm = [(type(r.error), str(r.error), r.opaque, r.fatal) if isinstance(r, BadRequest) else r
            for r in got_slow]
    assert [(type(r.error), str(r.error), r.opaque, r.fatal) if isinstance(r, BadRequest) else r
            for r in got_fast] == norm
    assert got_slow[:len(reqs)] == reqs[:len(got_slow)]


@pytest.mark.usefixtures("put_loop")
def test_fast_put_path_exact_bytes():
    parser = RequestParser(tx_puts=True, fast_puts=FAST)
    out = parser.feed(b"put t 12 3 1 99 -7\r\nabcput t 0 0 0 0 2147483647\r\n")
    assert out[0] == ("T12", 3, 1, 99, b"-7", b"abc")
    assert out[1] == ("T0", 0, 0, 0, b"2147483647", b"")
    # Java's forms are fast too: checksum -1 ("not computed"), and none at all (6 fields)
    out = RequestParser(fast_puts=FAST).feed(b"put t 0 2 0 -1 5\r\nabput t 12 1 0 -6\r\nc")
    assert out == [("T0", 2, 0, -1, b"5", b"ab"), ("T12", 1, 0, -1, b"-6", b"c")]
    # an opaque out of int32 range is not fast: the slow path names it
    parser = RequestParser(tx_puts=True, fast_puts=FAST)
    with pytest.raises(metaq.ProtocolError, match="opaque 2147483648 is out of range"):
        parser.feed(b"put t 0 1 0 0 2147483648\r\nz")


def test_fast_puts_from_a_mapping_that_is_not_a_dict():
    """The C loop reads dicts only: another mapping gets the Python twin, same requests."""
    from types import MappingProxyType

    data = b"put t 12 3 1 99 -7\r\nabcput t 0 0 0 0 5\r\nput t 9 1 0 0 6\r\nxversion 3\r\n"
    want = RequestParser(tx_puts=True, fast_puts=FAST).feed(data)
    assert want[:2] == [("T12", 3, 1, 99, b"-7", b"abc"), ("T0", 0, 0, 0, b"5", b"")]
    assert RequestParser(tx_puts=True, fast_puts=MappingProxyType(FAST)).feed(data) == want


# Put lines built token by token, with the edge cases of the fast path's grammar
# (``put <topic> <part> <len> <flag> <checksum> <opaque>\r\n``, numbers of at
# most 10 digits, int32 ranges, topics of at most 255 bytes).
_EDGE_FAST = {b"t 0": "T0", b"t 00": "T00", b"t -1": "T-1", "ü 3".encode(): "U3",
              b"a" * 255 + b" 0": "A255", b"a" * 256 + b" 0": "A256", b"t 12": "T12"}
def _mostly(common: list[str], edges: list[str]) -> st.SearchStrategy[str]:
    """Usually a valid token (so that whole runs take the fast path), else an edge case."""
    return st.sampled_from(common * 16 + edges)


_put_line = st.tuples(
    _mostly(["t", "ü", "a" * 255], ["x", "a" * 256, "t\t", ""]),
    _mostly(["0", "12", "-1", "3", "00"], ["-0", "012", "99999999999", "1x"]),
    _mostly(["len"], ["0len", "-1", "99999999999"]),
    _mostly(["0", "1", "-1"], ["00", "-0", "2147483647", "2147483648", "-2147483648",
                               "-2147483649", "9999999999", "99999999999"]),
    _mostly(["0", "5", "2147483647"], ["2147483648", "-1", "9999999999"]),
    _mostly(["1", "-7", "2147483647"], ["2147483648", "-2147483648", "-2147483649",
                                        "0000000001", "-000000001", "12345678901", ""]),
    _mostly([" "], ["  ", "\t"]),
    _mostly(["\r\n"], ["\n", " \r\n"]),
    st.binary(max_size=12))


def _edge_put(item) -> bytes:
    topic, part, length, flag, check, opaque, sep, eol, payload = item
    length = length.replace("len", str(len(payload)))
    return (sep.join(["put", topic, part, length, flag, check, opaque]) + eol).encode() + payload


@settings(max_examples=500)
@given(st.lists(_put_line, max_size=12), st.lists(st.integers(0, 800), max_size=4),
       st.integers(0, 100))
def test_the_c_put_loop_parses_exactly_as_the_python_loop(items, cuts, max_payload):
    from metaq.protocol import _fast as _native

    if _native.speedups is None:
        pytest.skip("the C speedups are not built")
    data = b"".join(map(_edge_put, items))
    got = {}
    for name, loop in (("c", _native.speedups.fast_puts), ("python", _native.py_fast_puts)):
        saved, _native.fast_puts = _native.fast_puts, loop
        try:
            parser = RequestParser(tx_puts=True, fast_puts=dict(_EDGE_FAST),
                                   max_payload=max_payload)
            out = []
            for chunk in chunked(data, cuts):
                try:
                    out += parser.feed_lenient(chunk)
                except metaq.ProtocolError as e:  # fed after a fatal error
                    out.append(("broken", str(e)))
                    break
            got[name] = [(type(r.error), str(r.error), r.opaque, r.fatal)
                         if isinstance(r, BadRequest) else r for r in out]
        finally:
            _native.fast_puts = saved
    assert got["c"] == got["python"]


# --------------------------------------------------------------------------- Java's forms
#
# Every request line Java's decoder (MetamorphosisWireFormatType.decode, Metaq 1.4)
# reads, read as it reads it: split at single spaces, trailing empty fields dropped.

NO_OPAQUE = 2**31 - 1  # Java's Integer.MAX_VALUE: the opaque of a stats/version without one

JAVA_FORMS = [
    # put, 6 fields: clients before 1.4.4, no checksum (-1: the broker computes it)
    (b"put t 0 3 0 7\r\nabc", PutRequest("t", 0, 3, 0, -1, None, 7, b"abc")),
    (b"put t 0 3 1 -7  \r\nabc", PutRequest("t", 0, 3, 1, -1, None, -7, b"abc")),
    # put, 7 fields: a checksum when the slot starts with a digit or '-'
    (b"put t 0 3 0 -1 7\r\nabc", PutRequest("t", 0, 3, 0, -1, None, 7, b"abc")),
    (b"put t 0 3 0 12345 7\r\nabc", PutRequest("t", 0, 3, 0, 12345, None, 7, b"abc")),
    (b"put t 0 3 0 5 7 \r\nabc", PutRequest("t", 0, 3, 0, 5, None, 7, b"abc")),
    # ... else a transaction key (transactional put before 1.4.4): no checksum
    (b"put t 0 3 0 TX:sess:12 7\r\nabc", PutRequest("t", 0, 3, 0, -1, "TX:sess:12", 7, b"abc")),
    (b"put t -1 0 0 XID:1:0a0b:0c:3 8\r\n", PutRequest("t", -1, 0, 0, -1, "XID:1:0a0b:0c:3", 8,
                                                       b"")),
    # put, 8 fields: checksum and transaction key (Java's clients since 1.4.4)
    (b"put t 0 3 0 -1 TX:sess:12 7\r\nabc",
     PutRequest("t", 0, 3, 0, -1, "TX:sess:12", 7, b"abc")),
    (b"put t 0 3 0 99 12 7\r\nabc", PutRequest("t", 0, 3, 0, 99, "12", 7, b"abc")),
    # stats: Java's encoder writes "stats  <opaque>" (an empty item) for none
    (b"stats  7\r\n", StatsRequest(None, 7)),
    (b"stats\r\n", StatsRequest(None, NO_OPAQUE)),
    (b"stats   \r\n", StatsRequest(None, NO_OPAQUE)),
    (b"stats topics\r\n", StatsRequest("topics", NO_OPAQUE)),
    (b"stats topics 9 extra\r\n", StatsRequest("topics", 9)),
    (b"stats 9\r\n", StatsRequest(None, 9)),  # metaq-py's encoder's form, kept
    # version: alone (Java's heartbeat reader), extra fields ignored
    (b"version\r\n", VersionRequest(NO_OPAQUE)),
    (b"version \r\n", VersionRequest(NO_OPAQUE)),
    (b"version 5 extra\r\n", VersionRequest(5)),
    # get / offset: fields after the opaque ignored, but metaq-py's extension right there
    (b"get t g 0 0 100 7 extra\r\n", GetRequest("t", "g", 0, 0, 100, 7)),
    (b"get t g 0 0 100 7  \r\n", GetRequest("t", "g", 0, 0, 100, 7)),
    (b"get t g 0 0 100 7 a b c\r\n", GetRequest("t", "g", 0, 0, 100, 7)),
    (b"get t g 0 0 100 7 hold=50 extra\r\n", GetRequest("t", "g", 0, 0, 100, 7, 50)),
    (b"get t g 0 0 100 7 extra hold=50\r\n", GetRequest("t", "g", 0, 0, 100, 7, 0)),
    # a slave's records=<opaque> (``+records``): right after hold=, else ignored
    (b"get t g 0 0 100 7 hold=50 records=-3\r\n", GetRequest("t", "g", 0, 0, 100, 7, 50, -3)),
    (b"get t g 0 0 100 7 hold=0 records=9 x\r\n", GetRequest("t", "g", 0, 0, 100, 7, 0, 9)),
    (b"get t g 0 0 100 7 records=9\r\n", GetRequest("t", "g", 0, 0, 100, 7)),
    (b"get t g 0 0 100 7 hold=5 x records=9\r\n", GetRequest("t", "g", 0, 0, 100, 7, 5)),
    (b"offset t g 1 5 7 extra\r\n", OffsetRequest("t", "g", 1, 5, 7)),
    (b"offset t g 1 5 7 time=9 extra\r\n", OffsetRequest("t", "g", 1, 5, 7, 9)),
    (b"offset t g 1 5 7 \r\n", OffsetRequest("t", "g", 1, 5, 7)),
    (b"quit \r\n", QuitRequest()),
]


def _norm(items: list) -> list:
    """Parser output comparable across parsers: fast tuples back to PutRequests, bad
    requests as (type, message, opaque, fatal)."""
    return [(type(r.error), str(r.error), r.opaque, r.fatal) if isinstance(r, BadRequest)
            else _unfast(r) for r in items]


@pytest.mark.usefixtures("put_loop")
@pytest.mark.parametrize("line, want", JAVA_FORMS, ids=[repr(f[0][:40]) for f in JAVA_FORMS])
@pytest.mark.parametrize("fast", [None, FAST], ids=["plain", "fast_puts"])
def test_java_forms(line, want, fast):
    """Each form as Java reads it, with the stream going on after it; the fast put loop
    (C and Python) takes the puts without transaction key in their exact forms (7
    fields, checksum -1 included, and 6 fields) and hands the rest over."""
    follow = encode_version(77)
    parser = RequestParser(tx_puts=True, fast_puts=fast)
    assert [_unfast(r) for r in parser.feed(line + follow)] == [want, VersionRequest(77)]
    parser = RequestParser(tx_puts=True, fast_puts=fast)
    got = []
    for b in line + follow:  # one byte at a time
        got += parser.feed_lenient(bytes([b]))
    assert [_unfast(r) for r in got] == [want, VersionRequest(77)]
    if fast is not None and line.startswith(b"put t 0 "):
        taken = RequestParser(tx_puts=True, fast_puts=fast).feed(line)[0]
        assert (type(taken) is tuple) == (line in (
            b"put t 0 3 0 12345 7\r\nabc", b"put t 0 3 0 -1 7\r\nabc", b"put t 0 3 0 7\r\nabc"))
        assert (type(taken) is TxPut) == (line in (
            b"put t 0 3 0 TX:sess:12 7\r\nabc", b"put t 0 3 0 -1 TX:sess:12 7\r\nabc",
            b"put t 0 3 0 99 12 7\r\nabc"))


@pytest.mark.usefixtures("put_loop")
@pytest.mark.parametrize("fast", [None, FAST], ids=["plain", "fast_puts"])
def test_sync_is_read_with_its_payload_in_any_chunking(fast):
    """Java's two forms (``decodeSync``: 8 fields, 7 from masters before 1.4.4 without
    the checksum, read as -1); a payload over the limit is refused and skipped."""
    payload = b"sync payload, with version 1\r\n inside: never read as requests"
    for head, check in ((b"sync t 0 %d 0 6340863216562294785 7\r\n", -1),
                        (b"sync t 0 %d 0 6340863216562294785 -1 7\r\n", -1),
                        (b"sync t 0 %d 0 6340863216562294785 12345 7\r\n", 12345)):
        data = (head % len(payload) + payload + encode_put("t", 0, b"x", 0, checksum(b"x"), 8)
                + encode_version(9))
        want = SyncRequest("t", 0, len(payload), 0, 6340863216562294785, check, 7, payload)
        for step in (len(data), 5, 1):
            parser = RequestParser(tx_puts=True, fast_puts=fast)
            got = []
            for i in range(0, len(data), step):
                got += parser.feed_lenient(data[i:i + step])
            sync, put, version = got
            assert sync == want and type(sync) is SyncRequest
            assert _unfast(put) == PutRequest("t", 0, 1, 0, checksum(b"x"), None, 8, b"x")
            assert version == VersionRequest(9)
            assert parser.buffered == 0
            # over the parser's payload limit: refused, its payload skipped, not buffered
            parser = RequestParser(tx_puts=True, fast_puts=fast, max_payload=10)
            got = []
            for i in range(0, len(data), step):
                got += parser.feed_lenient(data[i:i + step])
            bad, put, version = got
            assert isinstance(bad, BadRequest) and (bad.opaque, bad.fatal) == (7, False)
            assert "over the limit 10" in str(bad.error)
            assert _unfast(put).opaque == 8 and version == VersionRequest(9)
        # strict: the error raised, then the stream goes on from after the payload
        parser = RequestParser(tx_puts=True, fast_puts=fast, max_payload=10)
        with pytest.raises(metaq.ProtocolError, match="bad sync line"):
            parser.feed(data)
        assert [_unfast(r).opaque for r in parser.feed(b"")] == [8, 9]
    assert encode_sync("t", 0, payload, 0, 6340863216562294785, 12345, 7) == (
        b"sync t 0 %d 0 6340863216562294785 12345 7\r\n" % len(payload) + payload)


# Java-valid lines with random values: (line + payload, the request it is).
_tx_keys = names.filter(lambda k: not (k[0].isdigit() or k[0] == "-")).filter(
    lambda k: not k[0].isdecimal())
_trail = st.sampled_from(["", "", " ", "   "])
_extra = st.lists(st.text("abc=0123456789-", min_size=1, max_size=6).filter(
    lambda x: not x.startswith(("hold=", "time="))), max_size=3).map(
    lambda xs: "".join(" " + x for x in xs))
_payload = st.binary(max_size=40)


def _line(fields: list, trail: str) -> bytes:
    return (" ".join(str(f) for f in fields) + trail + "\r\n").encode()


_java_requests = st.one_of(
    st.builds(lambda t, p, f, o, pl, tr: (
        _line(["put", t, p, len(pl), f, o], tr) + pl, PutRequest(t, p, len(pl), f, -1, None, o,
                                                                 pl)),
        names, int32, int32, int32, _payload, _trail),
    st.builds(lambda t, p, f, c, o, pl, tr: (
        _line(["put", t, p, len(pl), f, c, o], tr) + pl, PutRequest(t, p, len(pl), f, c, None, o,
                                                                    pl)),
        names, st.sampled_from([0, 3, -1]), int32, st.one_of(st.just(-1), int32), int32,
        _payload, _trail),
    st.builds(lambda t, p, f, k, o, pl, tr: (
        _line(["put", t, p, len(pl), f, k, o], tr) + pl, PutRequest(t, p, len(pl), f, -1, k, o,
                                                                    pl)),
        names, int32, int32, _tx_keys, int32, _payload, _trail),
    st.builds(lambda t, p, f, c, k, o, pl, tr: (
        _line(["put", t, p, len(pl), f, c, k, o], tr) + pl, PutRequest(t, p, len(pl), f, c, k, o,
                                                                       pl)),
        names, int32, int32, int32, names, int32, _payload, _trail),
    st.builds(lambda i, o, tr: (
        _line(["stats", "" if i is None else i, o], tr), StatsRequest(i, o)),
        st.one_of(st.none(), names), int32, _trail),
    st.builds(lambda i, tr: (_line(["stats"] + ([] if i is None else [i]), tr),
                             StatsRequest(i, NO_OPAQUE)),
              st.one_of(st.none(), names.filter(lambda i: not i.lstrip("-").isdigit())), _trail),
    st.builds(lambda o, x, tr: (_line(["version"] + ([] if o is None else [o]),
                                      ("" if o is None else x) + tr),
                                VersionRequest(NO_OPAQUE if o is None else o)),
              st.one_of(st.none(), int32), st.sampled_from(["", " x"]), _trail),
    st.builds(lambda t, g, p, off, m, o, h, x, tr: (
        _line(["get", t, g, p, off, m, o] + ([f"hold={h}"] if h else []), x + tr),
        GetRequest(t, g, p, off, m, o, h)),
        names, names, int32, int64, int32, int32, st.sampled_from([0, 0, 5]), _extra, _trail),
    st.builds(lambda t, g, p, off, o, tm, x, tr: (
        _line(["offset", t, g, p, off, o] + ([f"time={tm}"] if tm >= 0 else []), x + tr),
        OffsetRequest(t, g, p, off, o, tm)),
        names, names, int32, int64, int32, st.sampled_from([-1, -1, 0, 12]), _extra, _trail),
    st.builds(lambda t, p, f, i, c, o, pl, tr: (
        _line(["sync", t, p, len(pl), f, i] + ([] if c is None else [c]) + [o], tr) + pl,
        SyncRequest(t, p, len(pl), f, i, -1 if c is None else c, o, pl)),
        names, int32, int32, int64, st.one_of(st.none(), int32), int32, _payload, _trail),
)


@pytest.mark.usefixtures("put_loop")
@settings(max_examples=300)
@given(st.lists(_java_requests, max_size=12), st.lists(st.integers(0, 3000), max_size=6),
       st.booleans())
def test_java_forms_fuzz_keep_their_framing(items, cuts, fast):
    """Java's forms with random values, back to back in any chunking: each read as Java
    reads it, nothing else, nothing lost."""
    data = b"".join(line for line, _want in items) + encode_version(77)
    parser = RequestParser(tx_puts=True, fast_puts=FAST if fast else None, max_payload=60)
    got = []
    for chunk in chunked(data, cuts):
        got += parser.feed_lenient(chunk)
    want = [w for _line, w in items] + [VersionRequest(77)]
    assert len(got) == len(want)
    for r, w in zip(got, want, strict=True):
        assert _unfast(r) == w and type(_unfast(r)) is type(w)
    assert parser.buffered == 0


_vocab = st.sampled_from(["put", "sync", "stats", "version", "get", "offset", "quit", "t", "g",
                          "", "", "0", "1", "3", "-1", "-0", "7", "x", "TX:1", "hold=5",
                          "hold=x", "time=3", "2147483648", "99999999999999999999", "ü",
                          "a/b"])


_num = st.sampled_from(["0", "1", "3", "-1", "7", "9", "x", "", "2147483648"])
_name = st.sampled_from(["t", "g", "ü", "a/b", "", "TX:1"])
# fields shaped like a put's or sync's (topic, partition, length, ...) or a get's or
# offset's (topic, group, numbers...), with random ones after them; or random throughout
_random_fields = st.one_of(
    st.lists(_vocab, max_size=9),
    st.builds(lambda t, p, n, rest: [t, p, n, *rest], _name, _num, _num,
              st.lists(st.one_of(_num, _vocab), max_size=6)),
    st.builds(lambda t, g, nums, rest: [t, g, *nums, *rest], _name, _name,
              st.lists(_num, min_size=3, max_size=5), st.lists(_vocab, max_size=3)))


@pytest.mark.usefixtures("put_loop")
@settings(max_examples=500)
@given(st.lists(st.tuples(st.sampled_from(["put", "sync", "stats", "version", "get", "offset"]),
                          _random_fields, st.binary(max_size=8)), max_size=8),
       st.lists(st.integers(0, 400), max_size=5))
def test_random_command_lines_fail_only_as_documented(lines, cuts):
    """Random fields after each command (payloads as long as their length field says,
    for put and sync): nothing but ProtocolError, requests of the documented types, the
    fast put loop (C and Python) agreeing with the parser alone, and the stream going
    on after every bad request that is not fatal."""
    data = b""
    for cmd, fields, noise in lines:
        data += " ".join([cmd, *fields]).encode() + b"\r\n"
        if cmd in ("put", "sync") and len(fields) >= 3:
            n = fields[2]
            if n.isdigit() and int(n) <= 9:
                data += (noise * 9)[:int(n)].ljust(int(n), b"z")
    data += encode_version(77)
    results = []
    for fast in (None, FAST):
        parser = RequestParser(tx_puts=True, fast_puts=fast, max_line=200, max_payload=50)
        got = []
        for chunk in chunked(data, cuts):
            try:
                got += parser.feed_lenient(chunk)
            except metaq.ProtocolError as e:  # fed after a fatal error
                assert parser._broken is not None and "broken" in str(e)
                break
        for r in got:
            assert isinstance(r, (*valid_types, BadRequest, tuple))
            if isinstance(r, BadRequest):
                assert isinstance(r.error, metaq.ProtocolError) and str(r.error)
        if not any(isinstance(r, BadRequest) and r.fatal for r in got):
            assert got[-1] == VersionRequest(77)
        results.append(_norm(got))
        strict = RequestParser(tx_puts=True, fast_puts=fast, max_line=200, max_payload=50)
        pending = data
        while True:
            try:
                strict.feed(pending)
                break
            except metaq.ProtocolError:
                if strict._broken is not None:
                    break
                pending = b""
    assert results[0] == results[1]
