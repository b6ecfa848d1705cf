"""``sync`` (a master replicating a put to its slave, Java's ``SyncCommand``) in the
request parser: the fields of Java's ``decodeSync`` with good and bad values, short
data, over-long payloads, any chunking (the parser's other fuzz tests are in
test_protocol.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from metaq.protocol import (
    BadRequest,
    RequestParser,
    SyncRequest,
    VersionRequest,
    encode_sync,
    encode_version,
)

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
LIMIT = 40  # the parser's max_payload

_bad_number = st.sampled_from(["x", "", "-", "1x", "99999999999999999999", "+1", "0x10",
                               "١"])


def _number(lo: int, hi: int, last: bool = False) -> st.SearchStrategy:
    """``(good, token, value)``: a number in range, or a bad token (not a number, out of
    range); never an empty ``last`` field (trailing empty fields are dropped, as Java's
    split drops them: that is a line with fewer fields)."""
    bad = _bad_number.filter(bool) if last else _bad_number
    return st.one_of(
        st.integers(lo, hi).map(lambda v: (True, str(v), v)),
        st.one_of(bad, st.sampled_from([str(lo - 1), str(hi + 1)])).map(
            lambda t: (False, t, None)))


_topic = st.one_of(st.sampled_from(["t", "orders", "ü"]).map(lambda t: (True, t, t)),
                   st.sampled_from(["a/b", "a,b", ".x"]).map(lambda t: (False, t, None)))
_length = st.one_of(st.integers(0, LIMIT + 20).map(lambda v: (True, str(v), v)),
                    st.sampled_from(["x", "-3", "", "99999999999999999999"]).map(
                        lambda t: (False, t, None)))


@st.composite
def sync_lines(draw):
    """``(bytes, want)``: a sync line and what follows it; ``want`` is the SyncRequest,
    ("bad", opaque or None) for a refused one whose payload is skipped, or ("fatal",)."""
    topic = draw(_topic)
    part = draw(_number(*INT32))
    length = draw(_length)
    flag = draw(_number(*INT32))
    msg_id = draw(_number(*INT64))
    check = draw(st.one_of(st.none(), _number(*INT32)))
    opaque = draw(_number(*INT32, last=True))
    shape = draw(st.sampled_from(["ok", "ok", "ok", "short", "extra"]))
    fields = [topic, part, length, flag, msg_id] + ([] if check is None else [check]) + [opaque]
    tokens = [f[1] for f in fields]
    if shape == "short":
        tokens.pop(draw(st.integers(0, len(tokens) - 1)))
    elif shape == "extra":
        tokens.append("5")
    n = length[2] if length[0] else draw(st.integers(0, 8))
    payload = draw(st.binary(min_size=n, max_size=n))
    data = ("sync " + " ".join(tokens)).encode() + b"\r\n" + payload
    if shape != "ok" and len(tokens) not in (6, 7):
        return data, ("fatal",)
    if shape != "ok":  # 6 or 7 tokens, but not the fields they mean: any outcome but a crash
        return data, ("any",)
    if not length[0]:
        return data, ("fatal",)
    if all(f[0] for f in fields) and length[2] <= LIMIT:
        return data, SyncRequest(topic[2], part[2], length[2], flag[2], msg_id[2],
                                 -1 if check is None else check[2], opaque[2], payload)
    return data, ("bad", opaque[2])


@settings(max_examples=400)
@given(sync_lines(), st.lists(st.integers(0, 200), max_size=6), st.booleans())
def test_sync_lines_fuzz(item, cuts, fast):
    data, want = item
    data += encode_version(77)
    parser = RequestParser(max_payload=LIMIT, fast_puts={} if fast else None)
    got: list = []
    pos = 0
    for cut in sorted(cuts) + [len(data)]:
        got += parser.feed_lenient(data[pos:cut])
        pos = max(pos, cut)
        if got and isinstance(got[-1], BadRequest) and got[-1].fatal:
            break
    if want[0] == "any":
        assert all(isinstance(r, (SyncRequest, BadRequest, VersionRequest))
                           for r in got)
        return
    if want[0] == "fatal":
        assert len(got) == 1 and isinstance(got[0], BadRequest) and got[0].fatal
        assert "sync" in str(got[0].error)
        return
    assert got[-1] == VersionRequest(77) and len(got) == 2 and parser.buffered == 0
    if isinstance(want, SyncRequest):
        assert got[0] == want and type(got[0]) is SyncRequest
        if want.checksum != -1:  # our encoder writes what Java's does
            assert data.startswith(encode_sync(want.topic, want.partition, want.payload,
                                               want.flag, want.msg_id, want.checksum,
                                               want.opaque))
    else:
        bad = got[0]
        assert isinstance(bad, BadRequest) and not bad.fatal
        assert str(bad.error).startswith("bad sync line") and bad.opaque == want[1]


def test_short_data_waits_for_the_payload():
    parser = RequestParser(max_payload=100)
    data = encode_sync("t", 3, b"0123456789", 1, 6340863216562294785, 77, 9)
    for i in range(len(data) - 1):  # nothing until the last byte of the payload
        assert parser.feed(data[i:i + 1]) == []
    assert parser.buffered == 9  # the payload so far (the line is read)
    assert parser.feed(data[-1:]) == [
        SyncRequest("t", 3, 10, 1, 6340863216562294785, 77, 9, b"0123456789")]
    assert parser.buffered == 0


def test_an_oversize_payload_is_skipped_without_being_buffered():
    parser = RequestParser(max_payload=100)
    got = parser.feed_lenient(b"sync t 0 1000000 0 5 -1 4\r\n" + b"x" * 10)
    assert len(got) == 1 and not got[0].fatal and got[0].opaque == 4
    assert "payload length 1000000 is over the limit 100" in str(got[0].error)
    for _ in range(99):
        assert parser.feed_lenient(b"y" * 10_000) == []
        assert parser.buffered == 0
    assert parser.feed_lenient(b"z" * 9_990 + encode_version(5)) == [VersionRequest(5)]
