"""``watermarks`` (a slave learning its master's high watermarks, ``_watermark``): the
request line with good and bad fields, the answer round trip, and answers cut short,
padded or garbage (fuzzed): refused with an error naming what is wrong."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq._errors import ProtocolError
from metaq.protocol import (
    WATERMARK_HEAD,
    BadRequest,
    RequestParser,
    WatermarkRequest,
    decode_watermark_body,
    encode_version,
    encode_watermark_body,
    encode_watermarks,
)


def test_the_request_round_trips_and_bad_fields_are_named():
    assert RequestParser().feed(encode_watermarks(2, 2**63 - 1, 5000, 7)) == [
        WatermarkRequest(2, 2**63 - 1, 5000, 7)]
    for bad, field in [(b"watermarks -1 0 0 1", "replica"), (b"watermarks 1 x 0 1", "version"),
                       (b"watermarks 1 0 -5 1", "holdMs"), (b"watermarks 1 0 1", "expected")]:
        got = RequestParser().feed_lenient(bad + b"\r\n" + encode_version(1))
        assert type(got[0]) is BadRequest and field in str(got[0].error), (bad, got)
        assert len(got) == 2


entries = st.lists(st.tuples(st.sampled_from(["t", "orders", "ü-x"]), st.integers(0, 2**31 - 1),
                             st.one_of(st.none(), st.integers(0, 2**63 - 1))), max_size=20)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**63 - 1), entries)
def test_answers_round_trip(version, es):
    assert decode_watermark_body(encode_watermark_body(version, es)) == (version, es)


def test_every_cut_and_extra_byte_is_refused():
    body = encode_watermark_body(9, [("t", 0, 5), ("orders", 3, None)])
    for cut in range(len(body)):
        with pytest.raises(ProtocolError):
            decode_watermark_body(body[:cut])
    with pytest.raises(ProtocolError, match="after its"):
        decode_watermark_body(body + b"\0")
    with pytest.raises(ProtocolError, match="partition"):
        decode_watermark_body(WATERMARK_HEAD.pack(1, 1) + b"\0\1t" + (-1).to_bytes(4, "big",
                              signed=True) + (0).to_bytes(8, "big"))
    with pytest.raises(ProtocolError, match="topic"):
        decode_watermark_body(WATERMARK_HEAD.pack(1, 1) + b"\0\2a b" + bytes(12))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_garbage_raises_only_protocol_errors(data):
    try:
        decode_watermark_body(data)
    except ProtocolError:
        pass
