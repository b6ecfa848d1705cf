"""``txlog`` (a slave copying its master's prepared transactions, ``_txlog``) and the
journal records it carries: the request line in the request parser with good and bad
fields, the answer's head, and records torn, damaged or garbage anywhere (fuzzed):
every bad input is refused with an error naming what is wrong, never half used."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq._errors import ProtocolError
from metaq.broker._txjournal import prepare_record, put_record, read_records
from metaq.protocol import (
    TXLOG_HEAD,
    BadRequest,
    RequestParser,
    TxLogRequest,
    decode_txlog_body,
    encode_txlog,
    encode_txlog_body,
    encode_version,
)

KEY = "XID:7:676c6f62616c:6272616e6368:node1"


def _records() -> bytes:
    return (put_record(KEY, "t", 0, b"m" * 30) + put_record(KEY, "t", 1, b"n" * 10)
            + prepare_record(KEY, [("t", 0, 100, 30), ("t", 1, 0, 10)]))


def test_a_request_round_trips_and_bad_fields_are_named():
    p = RequestParser()
    line = encode_txlog(3, 2**63 - 1, 17, 500, -9)
    assert p.feed(line) == [TxLogRequest(3, 2**63 - 1, 17, 500, -9)]
    for bad, field in [(b"txlog x 1 1 1 5", "replica"), (b"txlog 1 -1 1 1 5", "incarnation"),
                       (b"txlog 1 1 1 -1 5", "holdMs"), (b"txlog 1 1 1 1", "expected"),
                       (b"txlog 1 1 99999999999999999999 1 5", "seq")]:
        got = RequestParser().feed_lenient(bad + b"\r\n" + encode_version(1))
        assert type(got[0]) is BadRequest and field in str(got[0].error), (bad, got)
        assert len(got) == 2  # the connection goes on: the next request is read
    with pytest.raises(ProtocolError):
        encode_txlog(-1, 0, 0, 0, 1)


def test_the_answer_head_and_records_round_trip():
    recs = _records()
    chunk = decode_txlog_body(encode_txlog_body(5, 3, 4, False, recs))
    assert (chunk.incarnation, chunk.first, chunk.last, chunk.snapshot) == (5, 3, 4, False)
    (tx,) = read_records(chunk.records)
    assert tx.key == KEY and tx.prepared and len(tx.puts) == 2
    assert tx.prepared_at == [("t", 0, 100, 30), ("t", 1, 0, 10)]


@pytest.mark.parametrize("body,why", [
    (b"\0" * 10, "shorter than"),
    (TXLOG_HEAD.pack(1, 2, 3, 7), "snapshot flag"),
    (TXLOG_HEAD.pack(1, 5, 3, 0), "not a range"),
    (TXLOG_HEAD.pack(1, 5, 5, 0) + b"x", "for no event"),
])
def test_a_bad_answer_head_is_refused_naming_why(body, why):
    with pytest.raises(ProtocolError, match=why):
        decode_txlog_body(body)


def test_every_cut_and_every_flipped_byte_of_the_records_is_refused():
    recs = _records()
    for cut in range(1, len(recs)):
        if cut in (len(put_record(KEY, "t", 0, b"m" * 30)),
                   len(put_record(KEY, "t", 0, b"m" * 30) + put_record(KEY, "t", 1, b"n" * 10))):
            continue  # a record boundary: whole records, read as such
        with pytest.raises(ValueError, match="offset"):
            read_records(recs[:cut])
    for i in range(len(recs)):
        bad = bytearray(recs)
        bad[i] ^= 0x41
        with pytest.raises(ValueError):
            read_records(bytes(bad))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_answers_and_records_raise_only_named_errors(data):
    try:
        decode_txlog_body(data)
    except ProtocolError:
        pass
    try:
        read_records(data)
    except ValueError as e:
        assert "offset" in str(e)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=80), st.integers(0, 3))
def test_records_with_a_valid_crc_but_garbage_inside_are_refused(body, kind):
    """A CRC that matches says nothing of the contents: a body that does not read as a
    record is refused (as from a master with a bug), never applied."""
    body = b"PRCX"[kind:kind + 1] + body
    rec = len(body).to_bytes(4, "big") + zlib.crc32(body).to_bytes(4, "big") + body
    try:
        txs = read_records(rec)
    except ValueError as e:
        assert "cannot be read" in str(e)
    else:
        assert len(txs) == 1
