"""The hot loop that hands fetched bytes to listeners: progress, retries, size growth."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaq import ChecksumError, ConfigError
from metaq._codec import get_codec
from metaq._message import build_payload, checksum, encode_message
from metaq.consumer import ConsumerConfig
from metaq.consumer._processor import PartitionFetch, process_batch


def _log(bodies, attrs=None, start_id=100):
    out = bytearray()
    for i, body in enumerate(bodies):
        payload, flag = build_payload(body, attrs[i] if attrs else None)
        out += encode_message(start_id + i, flag, payload)
    return bytes(out)


def _pf(listener=None, batch=None, offset=0, max_retries=2, reject=None):
    return PartitionFetch(topic="t", partition="0-0", broker_id=0, index=0,
                          broker_address=None, offset=offset, msg_id=-1, max_size=1024,
                          listener=listener, batch_listener=batch, codec=get_codec("bytes"),
                          verify=True, max_retries=max_retries, reject=reject)


def test_every_message_delivered_in_order_with_offsets():
    bodies = [b"a", b"bb" * 10, b"", b"xyz"]
    data = _log(bodies, attrs=[None, "k=v", None, "ü"])
    got = []
    pf = _pf(listener=got.append, offset=1000)
    res = process_batch(pf, data)
    assert res.consumed == 4
    assert [m.raw_body for m in got] == bodies
    assert [m.attribute for m in got] == [None, "k=v", None, "ü"]
    assert got[0].offset == 1000
    assert all(a.next_offset == b.offset for a, b in zip(got, got[1:], strict=False))
    assert pf.offset == got[-1].next_offset == 1000 + len(data)
    assert pf.msg_id == 103


def test_truncated_last_message_is_left_for_the_next_fetch():
    data = _log([b"one", b"two", b"three"])
    got = []
    pf = _pf(listener=got.append)
    process_batch(pf, data[:-2])
    assert [m.raw_body for m in got] == [b"one", b"two"]
    assert pf.offset == len(_log([b"one", b"two"]))
    process_batch(pf, data[pf.offset:])
    assert [m.raw_body for m in got][-1] == b"three"


def test_a_message_bigger_than_the_fetch_reports_the_size_it_needs():
    data = _log([b"x" * 5000])
    pf = _pf(listener=lambda m: None)
    res = process_batch(pf, data[:1024])
    assert res.consumed == 0 and res.needed_size == len(data)
    assert pf.retry_count == 0  # size growth never counts as a listener retry


def test_listener_failure_rewinds_and_retries_that_message_then_rejects():
    data = _log([b"ok", b"bad", b"after"])
    seen, rejected = [], []

    def listener(m):
        seen.append(m.raw_body)
        if m.raw_body == b"bad":
            raise RuntimeError("boom")

    pf = _pf(listener=listener, max_retries=2, reject=lambda m, e: rejected.append(m.raw_body))
    first_end = len(_log([b"ok"]))
    for attempt in range(3):
        res = process_batch(pf, data[pf.offset:])
        if attempt < 2:
            assert pf.offset == first_end and pf.retry_delay is not None
    assert rejected == [b"bad"]
    assert seen == [b"ok", b"bad", b"bad", b"bad", b"after"]
    assert pf.offset == len(data) and res.consumed == 2


def test_checksum_mismatch_delivers_good_messages_then_raises_at_the_bad_one():
    data = bytearray(_log([b"good", b"evil"]))
    data[-1] ^= 0xFF
    got = []
    pf = _pf(listener=got.append)
    process_batch(pf, bytes(data))
    assert [m.raw_body for m in got] == [b"good"]
    with pytest.raises(ChecksumError) as e:
        process_batch(pf, bytes(data[pf.offset:]))
    assert e.value.offset == pf.offset and "checksum" in str(e.value)


def test_batch_listener_gets_the_whole_batch_and_failure_retries_it():
    data = _log([b"1", b"2", b"3"])
    calls = []

    class Batch:
        def on_messages(self, batch):
            calls.append([m.raw_body for m in batch])
            if len(calls) == 1:
                raise ValueError("first time fails")

    pf = _pf(batch=Batch().on_messages)
    assert process_batch(pf, data).consumed == 0 and pf.offset == 0
    assert process_batch(pf, data).consumed == 3
    assert calls == [[b"1", b"2", b"3"]] * 2 and pf.offset == len(data)


@given(st.lists(st.binary(max_size=300), max_size=20), st.integers(0, 400))
def test_any_cut_of_a_log_delivers_a_prefix_and_resumes_exactly(bodies, cut):
    data = _log(bodies)
    got = []
    pf = _pf(listener=got.append)
    process_batch(pf, data[:cut])
    while pf.offset < len(data):
        before = pf.offset
        res = process_batch(pf, data[pf.offset:])
        assert res.consumed > 0 or pf.offset > before
    assert [m.raw_body for m in got] == bodies


def test_checksum_helper_matches_header():
    payload, flag = build_payload(b"body", "attr")
    msg = encode_message(7, flag, payload)
    assert int.from_bytes(msg[4:8], "big") == checksum(payload)


@pytest.mark.parametrize("options, field", [
    ({"group": ""}, "group"),
    ({"group": "a/b"}, "group"),
    ({"group": "g", "commit_period": 0}, "commit_period"),
    ({"group": "g", "fetch_runner_count": 0}, "fetch_runner_count"),
    ({"group": "g", "strategy": "range"}, "strategy"),
    ({"group": "g", "start_position": "middle"}, "start_position"),
    ({"group": "g", "codec": "pickle"}, "codec"),
    ({"group": "g", "zk_root": "meta"}, "zk_root"),
    ({"group": "g", "max_fetch_retries": -1}, "max_fetch_retries"),
])
def test_bad_config_names_the_field(options, field):
    with pytest.raises(ConfigError) as e:
        ConsumerConfig(**options)
    assert field.split("_")[0] in str(e.value)


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="fetch_runners"):
        ConsumerConfig.from_mapping("g", {"fetch_runners": 3})
