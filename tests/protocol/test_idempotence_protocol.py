"""The idempotent producer's protocol extension: the ``idem`` mark, the ``producers``
command and producer records; round trips in any chunking, malformed tokens refused
(never read as something else, never answered with a put's opaque), records cut or
damaged read up to the last intact one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import metaq
from metaq.protocol import (
    RECORD_SIZE,
    BadRequest,
    IdemMark,
    ProducerRecord,
    ProducersRequest,
    PutRequest,
    RequestParser,
    checksum,
    decode_producer_records,
    encode_idem_mark,
    encode_producer_records,
    encode_producers,
    encode_put,
)

INT63 = 2**63 - 1
pids = st.integers(1, INT63)
seqs = st.integers(0, INT63)
counts = st.integers(1, 2**31 - 1)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, prev = [], 0
    for p in points:
        out.append(data[prev:p])
        prev = p
    out.append(data[prev:])
    return out


def test_encodings() -> None:
    assert encode_idem_mark(7, 0, 3) == b"idem 7 0 3\r\n"
    assert encode_producers("t", 1, 4096, 9) == b"producers t 1 4096 9\r\n"
    for bad in ((0, 0, 1), (1, -1, 1), (1, 0, 0), (2**63, 0, 1), (1, 0, 2**31)):
        with pytest.raises(metaq.ProtocolError, match="idem mark"):
            encode_idem_mark(*bad)


@given(st.lists(st.one_of(st.builds(IdemMark, pids, seqs, counts),
                          st.builds(ProducersRequest, st.just("t"), st.integers(0, 2**31 - 1),
                                    st.integers(0, INT63), st.integers(-(2**31), 2**31 - 1)),
                          st.builds(lambda body, op: PutRequest("t", 0, len(body), 0,
                                                                checksum(body), None, op, body),
                                    st.binary(max_size=50), st.integers(0, 2**31 - 1))),
                max_size=12),
       st.lists(st.integers(0, 2000), max_size=8))
def test_round_trip_any_chunking(reqs, cuts) -> None:
    def enc(r) -> bytes:
        if isinstance(r, IdemMark):
            return encode_idem_mark(*r)
        if isinstance(r, ProducersRequest):
            return encode_producers(*r)
        return encode_put(r.topic, r.partition, r.payload, r.flag, r.checksum, r.opaque)

    parser = RequestParser()
    got = []
    for chunk in chunked(b"".join(map(enc, reqs)), cuts):
        got += parser.feed(chunk)
    assert got == reqs


tokens = st.one_of(
    st.sampled_from([b"", b"-1", b"0", b"00", b"01", b"+1", b" 1", b"1_0", b"0x1", b"\xff",
                     b"9" * 19, b"9223372036854775807",
                     b"9" * 20, b"9223372036854775808", b"2147483648", b"1.5", b"a"]),
    st.binary(max_size=6).filter(lambda b: b"\r" not in b and b"\n" not in b),
    st.integers(-(2**64), 2**64).map(lambda i: b"%d" % i))


@settings(max_examples=400)
@given(st.sampled_from([b"idem", b"producers"]), st.lists(tokens, max_size=6))
def test_malformed_marks_and_producers_lines(cmd, fields) -> None:
    """Any fields after ``idem``/``producers``: a request whose numbers are all in range,
    or a bad request that does not stop the stream; a bad ``idem`` is answered with
    opaque 0 (it has none; never the next put's)."""
    line = b" ".join([cmd, *fields])
    put = encode_put("t", 0, b"x", 0, checksum(b"x"), 5)
    out = RequestParser().feed_lenient(line + b"\r\n" + put)
    assert out[-1] == PutRequest("t", 0, 1, 0, checksum(b"x"), None, 5, b"x")
    (r,) = out[:-1]  # one line, one request
    if isinstance(r, BadRequest):
        assert not r.fatal and str(r.error)
        if cmd == b"idem":
            assert r.opaque is None
    elif isinstance(r, IdemMark):
        assert cmd == b"idem" and 1 <= r.pid <= INT63 and 0 <= r.seq <= INT63 \
            and 1 <= r.count <= 2**31 - 1
        # read exactly as written: plain digits, nothing else (trailing spaces dropped)
        assert encode_idem_mark(*r) == line.rstrip(b" ") + b"\r\n"
    else:
        assert isinstance(r, ProducersRequest) and cmd == b"producers"
        assert 0 <= r.from_offset <= INT63 and r.partition >= 0


records = st.builds(ProducerRecord, pids, seqs, st.integers(1, 2**31 - 1),
                    st.integers(0, 2**62), st.integers(0, 2**62), st.integers(0, INT63),
                    st.integers(0, 2**62), st.integers(0, INT63), st.integers(0, 2**62))


@given(st.lists(records, max_size=6), st.integers(0, 10_000), st.booleans())
def test_records_cut_or_damaged_read_up_to_the_last_intact(recs, cut, flip) -> None:
    data = encode_producer_records(recs)
    assert decode_producer_records(data) == (recs, len(data))
    cut = cut % (len(data) + 1)
    got, used = decode_producer_records(data[:cut])
    assert got == recs[:cut // RECORD_SIZE] and used == cut // RECORD_SIZE * RECORD_SIZE
    if flip and recs:
        k = cut % len(data)
        bad = data[:k] + bytes([data[k] ^ 0x01]) + data[k + 1:]
        got, used = decode_producer_records(bad)
        assert got == recs[:k // RECORD_SIZE]
