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
