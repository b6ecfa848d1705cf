"""The hot loop that hands fetched bytes to listeners: progress, retries, size growth."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaq import ChecksumError, ConfigError
from metaq.consumer import ConsumerConfig, _processor
from metaq.consumer._processor import process_batch
from metaq.consumer._subscription import PartitionState
from metaq.protocol import _fast, build_payload, checksum, encode_message, get_codec
from metaq.protocol._fast import speedups


@pytest.fixture(autouse=True, params=["c", "c-scan-first", "python"])
def loops(request, monkeypatch):
    """Every test here runs on the C take/deliver (metaq/protocol/_speedups.c), also with the
    checksums checked in a first pass (as for big replies), and on their Python twins: the
    names bound in metaq.protocol._fast, which a partition's reader calls, are rebound."""
    if request.param.startswith("c"):
        if speedups is None:  # test_speedups.py fails if a compiler was there
            pytest.skip("the C speedups are not built")
        bound = {"scan": speedups.scan, "take": speedups.take, "deliver": speedups.deliver,
                 "prepare": _fast.c_prepare}
        if request.param == "c-scan-first":
            monkeypatch.setattr(_processor, "_SCAN_FIRST", 0)
    else:
        bound = {"scan": _fast.py_scan, "take": _fast.py_take, "deliver": _fast.py_deliver,
                 "prepare": _fast.py_prepare}
    for name, function in bound.items():
        monkeypatch.setattr(_fast, name, function)
    return request.param


def _log(bodies, attrs=None, start_id=100):
    out = bytearray()
    for i, body in enumerate(bodies):
        payload, flag = build_payload(body, attrs[i] if attrs else None)
        out += encode_message(start_id + i, flag, payload)
    return bytes(out)


def _pf(listener=None, batch=None, offset=0, max_retries=2, reject=None):
    return PartitionState(topic="t", partition="0-0", broker_id=0, index=0,
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
    ({"group": "g", "zk_root": "a//b"}, "zk_root"),
    ({"group": "g", "zk_root": ""}, "zk_root"),
    ({"group": "g", "max_fetch_retries": -1}, "max_fetch_retries"),
])
def test_bad_config_names_the_field(options, field):
    with pytest.raises(ConfigError) as e:
        ConsumerConfig(**options)
    assert field.split("_")[0] in str(e.value)


def test_zk_root_without_its_leading_slash_is_accepted_as_java_does():
    for root in ("meta", "/meta/", "meta/"):
        assert ConsumerConfig(group="g", zk_root=root).zk_root == root  # Layout normalises


def test_unknown_option_is_named():
    with pytest.raises(ConfigError, match="fetch_runners"):
        ConsumerConfig.from_mapping("g", {"fetch_runners": 3})


# -- the hot loops: failure mid-batch, slices, corrupt lengths, message classes -----------

def _ids(msgs):
    return [m.msg_id for m in msgs]


def test_failure_mid_batch_stops_progress_at_the_failing_message():
    data = _log([b"a", b"b", b"c", b"d"], start_id=10)
    seen = []

    def listener(m):
        if m.raw_body == b"c" and b"c" not in seen:
            seen.append(b"c")
            raise RuntimeError("once")
        seen.append(m.raw_body)

    pf = _pf(listener=listener, offset=500)
    res = process_batch(pf, data)
    assert res.consumed == 2
    assert pf.offset == 500 + len(_log([b"a", b"b"]))
    assert pf.msg_id == 11  # the last message consumed, not the failing one
    assert pf.retry_offset == pf.offset and pf.retry_count == 1 and pf.retry_delay
    res = process_batch(pf, data[pf.offset - 500:])
    assert res.consumed == 2 and pf.msg_id == 13 and pf.retry_count == 0
    assert seen == [b"a", b"b", b"c", b"c", b"d"]


def test_rewind_mid_batch_keeps_the_rest_for_later_without_counting():
    from metaq.consumer import Rewind

    data = _log([b"a", b"b", b"c"])
    got = []

    def listener(m):
        if m.raw_body == b"b":
            raise Rewind()
        got.append(m.raw_body)

    pf = _pf(listener=listener)
    assert process_batch(pf, data).consumed == 1
    assert got == [b"a"] and pf.retry_count == 0 and pf.retry_delay == pf.retry_backoff


def test_batch_listener_gets_slices_of_max_batch_in_order():
    data = _log([bytes([i]) for i in range(7)], start_id=0)
    calls = []
    pf = _pf(batch=lambda b: calls.append([m.msg_id for m in b]))
    pf.max_batch = 3
    res = process_batch(pf, data)
    assert calls == [[0, 1, 2], [3, 4, 5], [6]]
    assert res.consumed == 7 and pf.offset == len(data) and pf.msg_id == 6


def test_batch_slices_also_end_at_a_byte_budget(monkeypatch):
    """Big messages come in smaller slices (cache-friendly); a message bigger than the
    budget still comes, alone."""
    monkeypatch.setattr(_processor, "_SLICE_BYTES", 100)
    data = _log([b"a" * 30, b"b" * 30, b"c" * 30, b"d" * 200, b"e"], start_id=0)
    calls = []
    pf = _pf(batch=lambda b: calls.append([m.msg_id for m in b]))
    pf.max_batch = 10
    res = process_batch(pf, data)
    assert calls == [[0, 1], [2, 3], [4]]  # 50 + 50 bytes reach 100; 50 + 220 do too
    assert res.consumed == 5 and pf.offset == len(data)


def test_batch_failure_in_a_later_slice_keeps_the_earlier_slices_consumed():
    data = _log([bytes([i]) for i in range(6)], start_id=0)
    calls = []

    def on_messages(batch):
        calls.append(_ids(batch))
        if len(calls) == 2:
            raise ValueError("second slice fails once")

    pf = _pf(batch=on_messages)
    pf.max_batch = 2
    res = process_batch(pf, data)
    assert res.consumed == 2 and pf.msg_id == 1 and pf.retry_delay is not None
    assert pf.offset == len(_log([b"\0", b"\1"]))
    res = process_batch(pf, data[pf.offset:])
    assert res.consumed == 4 and pf.offset == len(data)
    assert calls == [[0, 1], [2, 3], [2, 3], [4, 5]]


def test_rejected_batch_slice_goes_to_reject_and_the_rest_is_delivered():
    data = _log([bytes([i]) for i in range(4)], start_id=0)
    calls, rejected = [], []

    def on_messages(batch):
        calls.append(_ids(batch))
        if batch[0].msg_id == 0:
            raise ValueError("always")

    pf = _pf(batch=on_messages, max_retries=0, reject=lambda m, e: rejected.append(m.msg_id))
    pf.max_batch = 2
    res = process_batch(pf, data)
    assert rejected == [0, 1] and calls == [[0, 1], [2, 3]]
    assert res.consumed == 4 and pf.offset == len(data) and pf.msg_id == 3


@pytest.mark.parametrize("bad_length", [-1, -(2**31), 0x7FFFFFFF])
def test_corrupt_length_after_good_messages_delivers_them_first(bad_length):
    good = _log([b"one", b"two"])
    bad = bad_length.to_bytes(4, "big", signed=True) + b"\0" * 16 + b"rest"
    got = []
    pf = _pf(listener=got.append)
    assert process_batch(pf, good + bad).consumed == 2
    assert pf.offset == len(good)
    with pytest.raises(ChecksumError, match="impossible message length"):
        process_batch(pf, bad)


def test_unverified_consumer_delivers_a_bad_checksum():
    data = bytearray(_log([b"x"]))
    data[4:8] = (12345).to_bytes(4, "big")
    got = []
    pf = _pf(listener=got.append)
    pf.verify = False
    assert process_batch(pf, bytes(data)).consumed == 1 and got[0].raw_body == b"x"


def test_message_classes_read_bodies_attributes_and_codecs():
    from metaq.consumer import Message

    data = _log([b'{"a"', "héllo".encode()], attrs=[None, "k=v"])
    for codec, want in (("bytes", [b'{"a"', "héllo".encode()]), ("str", ['{"a"', "héllo"])):
        got = []
        pf = _pf(listener=got.append)
        pf.codec = get_codec(codec)
        process_batch(pf, data)
        assert [m.body for m in got] == want
        assert [m.raw_body for m in got] == [b'{"a"', "héllo".encode()]
        assert [m.attribute for m in got] == [None, "k=v"]
        assert all(isinstance(m, Message) for m in got)
        assert got[1].payload == build_payload("héllo".encode(), "k=v")[0]
        assert "offset=0" in repr(got[0]) and got[0] == got[0] and got[0] != got[1]
        m = got[1]
        made = Message.create(m.topic, m.partition, m.offset, m.next_offset, m.msg_id,
                              m.flag, m.payload, pf.codec)
        assert made == m and type(made) is type(m)


def test_message_pickles():
    import pickle

    got = []
    process_batch(_pf(listener=got.append), _log([b"body"], attrs=["a"]))
    back = pickle.loads(pickle.dumps(got[0]))
    assert back == got[0] and back.attribute == "a" and back.body == b"body"


def test_crc32_in_use_agrees_with_zlib():
    import zlib

    from metaq.consumer._processor import _crc32

    for data in (b"", b"a", bytes(range(256)) * 40):
        assert _crc32(data) == zlib.crc32(data)


@given(st.lists(st.tuples(st.binary(max_size=200), st.one_of(st.none(), st.text(max_size=5))),
                max_size=25),
       st.integers(1, 5), st.integers(1, 3000), st.booleans())
def test_both_loops_deliver_what_the_reference_parser_reads(items, max_batch, step, batch):
    """Fed in arbitrary cuts (the fetcher's contiguous reads), both loops deliver exactly
    the messages metaq.protocol._message.iter_messages finds, with the same offsets and ids."""
    from metaq.protocol import iter_messages

    data = _log([b for b, _ in items], attrs=[a for _, a in items])
    want = [(r.offset, r.next_offset, r.msg_id, r.flag, r.payload)
            for r in iter_messages(data)]
    got = []
    if batch:
        pf = _pf(batch=got.extend)
        pf.max_batch = max_batch
    else:
        pf = _pf(listener=got.append)
    end = 0
    while pf.offset < len(data):
        end = max(end + step, pf.offset + 1)
        res = process_batch(pf, data[pf.offset:end])
        if res.needed_size:
            end = pf.offset + res.needed_size
    assert [(m.offset, m.next_offset, m.msg_id, m.flag, m.payload) for m in got] == want


def test_the_loops_run_are_the_ones_bound(loops, monkeypatch):
    """The fixture's rebinding reaches the hot loop: both implementations really run."""
    calls = []
    bound = _fast.deliver
    monkeypatch.setattr(_fast, "deliver", lambda *args: calls.append(bound) or bound(*args))
    got = []
    process_batch(_pf(listener=got.append), _log([b"a", b"b"]))
    assert [m.raw_body for m in got] == [b"a", b"b"]
    assert calls == [_fast.py_deliver if loops == "python" else speedups.deliver]
