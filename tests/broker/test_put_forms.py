"""Every put form stored alike (issue 29): ours (``<checksum> <opaque>``), Java's clients'
(checksum ``-1``, "not computed") and the legacy 6-field form (no checksum), read by the
broker's put loop in C and by its Python twin, in runs long enough for the columnar
path and short ones: the same replies, the same bytes in the log (the checksum the
broker computes is the payload's CRC32), a wrong checksum refused alike."""

from __future__ import annotations

import pytest
from helpers.raw_client import RawClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_broker import make_config

from metaq.broker import Broker
from metaq.protocol import HEADER, HEADER_SIZE, Result, checksum, encode_get
from metaq.protocol import _fast as _native

pytestmark = pytest.mark.broker

FORMS = ("ours", "java", "legacy", "bad")


def _put(form: str, partition: int, payload: bytes, flag: int, opaque: int) -> bytes:
    head = b"put t %d %d %d" % (partition, len(payload), flag)
    if form == "ours":
        return head + b" %d %d\r\n" % (checksum(payload), opaque) + payload
    if form == "java":
        return head + b" -1 %d\r\n" % opaque + payload
    if form == "legacy":
        return head + b" %d\r\n" % opaque + payload
    return head + b" %d %d\r\n" % (checksum(payload) ^ 1, opaque) + payload


@pytest.fixture(params=["c", "python"])
def put_loop(request, monkeypatch):
    """The broker's put loop: C (``_speedups.c``) or its Python twin, bound in ``_fast``
    before the broker's connections make their parsers."""
    if request.param == "c":
        if _native.speedups is None:
            pytest.skip("the C speedups are not built")
        monkeypatch.setattr(_native, "fast_puts", _native.speedups.fast_puts)
    else:
        monkeypatch.setattr(_native, "fast_puts", _native.py_fast_puts)
    return request.param


puts = st.lists(st.tuples(st.sampled_from(FORMS), st.sampled_from([0, 1]),
                          st.binary(max_size=40), st.sampled_from([0, 4, 6, -8])),
                min_size=1, max_size=24)


@pytest.mark.usefixtures("put_loop")
def test_every_put_form_is_stored_alike(tmp_path):
    with Broker(make_config(tmp_path)) as broker, RawClient(broker.port) as c:
        ends = {0: 0, 1: 0}

        @settings(max_examples=120, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow,
                                         HealthCheck.function_scoped_fixture])
        @given(puts, st.sampled_from(["ours", "java", "legacy", "mixed"]))
        def one_read(items, same):
            if same != "mixed":  # a run of one form (the columnar path from 8 puts)
                items = [(same, p, pl, f) for _form, p, pl, f in items]
            c.send(b"".join(_put(form, p, pl, f, 100 + k)
                            for k, (form, p, pl, f) in enumerate(items)))
            replies = c.replies(len(items))
            for k, ((form, p, payload, flag), r) in enumerate(zip(items, replies,
                                                                   strict=True)):
                assert isinstance(r, Result) and r.opaque == 100 + k
                if form == "bad":
                    assert r.code == 400 and b"checksum" in r.body.lower(), r
                    continue
                assert r.code == 200, r
                msg_id, partition, offset = map(int, r.body.split())
                assert (partition, offset) == (p, ends[p])
                ends[p] += HEADER_SIZE + len(payload)
                want = HEADER.pack(len(payload), checksum(payload), msg_id, flag) + payload
                got = c.call(encode_get("t", "g", p, offset, len(want), 1))
                assert got.body == want

        one_read()


TX_FORMS = ("ours", "java", "legacy", "bad")


def _tx_put(form: str, partition: int, payload: bytes, flag: int, key: str,
            opaque: int) -> bytes:
    """A put with a transaction key: 8 fields (our checksum, Java's -1, a wrong one) or
    7, the key in the checksum's place (Java's clients before 1.4.4)."""
    head = b"put t %d %d %d" % (partition, len(payload), flag)
    k = key.encode()
    if form == "ours":
        return head + b" %d %s %d\r\n" % (checksum(payload), k, opaque) + payload
    if form == "java":
        return head + b" -1 %s %d\r\n" % (k, opaque) + payload
    if form == "legacy":
        return head + b" %s %d\r\n" % (k, opaque) + payload
    return head + b" %d %s %d\r\n" % (checksum(payload) ^ 1, k, opaque) + payload


tx_puts = st.lists(st.tuples(st.sampled_from(TX_FORMS), st.sampled_from([0, 1]),
                             st.binary(max_size=40), st.sampled_from([0, 4, -8])),
                   min_size=1, max_size=30)


@pytest.mark.usefixtures("put_loop")
def test_every_transactional_put_form_is_committed_alike(tmp_path):
    """A transaction's puts in each form: answered alike (msgId, partition, -1; a wrong
    checksum 400), and at the commit the log holds exactly the accepted ones, in order,
    each with its payload's CRC32."""
    from metaq.protocol import encode_transaction

    with Broker(make_config(tmp_path)) as broker, RawClient(broker.port) as c:
        ends = {0: 0, 1: 0}
        count = [0]

        @settings(max_examples=60, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow,
                                         HealthCheck.function_scoped_fixture])
        @given(tx_puts, st.sampled_from(["ours", "java", "legacy", "mixed"]))
        def one_transaction(items, same):
            if same != "mixed":  # a run of one form (whole-list steps from 8 puts)
                items = [(same, p, pl, f) for _form, p, pl, f in items]
            count[0] += 1
            key = f"TX:s{count[0]}:1"
            assert c.call(encode_transaction(key, f"s{count[0]}", "BEGIN", 1)).code == 200
            c.send(b"".join(_tx_put(form, p, pl, f, key, 100 + k)
                            for k, (form, p, pl, f) in enumerate(items)))
            replies = c.replies(len(items))
            want: dict[int, list[bytes]] = {0: [], 1: []}
            for k, ((form, p, payload, flag), r) in enumerate(zip(items, replies,
                                                                   strict=True)):
                assert r.opaque == 100 + k
                if form == "bad":
                    assert r.code == 400, r
                    continue
                assert r.code == 200, r
                msg_id, partition, offset = map(int, r.body.split())
                assert (partition, offset) == (p, -1)
                want[p].append(HEADER.pack(len(payload), checksum(payload), msg_id, flag)
                               + payload)
            assert c.call(encode_transaction(key, f"s{count[0]}", "COMMIT_ONE_PHASE",
                                             2)).code == 200
            for p in (0, 1):
                data = b"".join(want[p])
                if data:
                    got = c.call(encode_get("t", "g", p, ends[p], len(data), 3))
                    assert got.body == data
                    ends[p] += len(data)

        one_transaction()


def test_put_records_are_put_record_each():
    from metaq.broker._txjournal import put_record, put_records

    msgs = [b"", b"a" * 30, b"\x00\xff"]
    assert put_records("TX:s:1", "t", 3, msgs) == b"".join(
        [put_record("TX:s:1", "t", 3, m) for m in msgs])
