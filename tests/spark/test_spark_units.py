"""Pieces of metaq.spark that need no SparkSession: options, the byte walker, Arrow batches."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq import ConfigError, MessageError
from metaq.protocol import _fast, build_payload, encode_message, iter_messages
from metaq.protocol import scan_messages as _scan_messages
from metaq.protocol._fast import speedups
from metaq.spark import SourceOptions, _arrow
from metaq.spark._arrow import WalkHint, Where, arrow_schema, chunk_to_batch, walk


@pytest.fixture(autouse=True, params=["c", "python", "python-scan"])
def walker(request, monkeypatch):
    """The byte walker is tested in C (one scan call), in Python (leaps and steps), and as
    the C walk's shape over scan's Python twin."""
    if request.param == "c" and speedups is None:  # test_speedups.py fails if a
        pytest.skip("the C speedups are not built")    # compiler was there
    if request.param == "python":
        monkeypatch.setattr(_arrow, "_walk", _arrow._walk_leaping)
    else:
        monkeypatch.setattr(_arrow, "_walk", _arrow._walk_scan)
        monkeypatch.setattr(_arrow, "scan", speedups.scan if request.param == "c"
                            else _fast.py_scan)
    return request.param


def scan_messages(buf):  # the reference: always the pure-Python scan
    import metaq.protocol._message as m

    saved, m.scan = m.scan, _fast.py_scan
    try:
        return _scan_messages(buf)
    finally:
        m.scan = saved

pytestmark = [
    pytest.mark.spark,
    # Background threads of session fixtures (kazoo's retry jitter) touch the global
    # `random` while a draw runs; hypothesis then warns, though no strategy uses it.
    pytest.mark.filterwarnings("ignore:Do not use the `random` module inside strategies"),
]

BASE = {"zk.connect": "127.0.0.1:2181/x", "topic": "orders"}


# -- options --------------------------------------------------------------------------------


def test_options_parse_with_any_case_and_defaults() -> None:
    opts = SourceOptions.from_options({
        "ZK.CONNECT": "h:1/c", "Topic": "a, b", "STARTINGOFFSETS": '{"a": {"0-1": 100}}',
        "maxbytespertrigger": "4096", "failOnDataLoss": "False", "codec": "str"})
    assert opts.topics == ("a", "b") and opts.zk_connect == "h:1/c"
    assert opts.starting_offsets.per_partition == {"a": {"0-1": 100}}
    assert opts.max_bytes_per_trigger == 4096 and opts.fail_on_data_loss is False
    assert opts.codec == "str" and opts.group == "metaq-spark"
    assert opts.starting(streaming=False).kind == "json"
    plain = SourceOptions.from_options(BASE)
    assert plain.starting(streaming=False).kind == "earliest"
    assert plain.starting(streaming=True).kind == "group"
    assert plain.ending().kind == "latest" and plain.verify_checksums is True
    assert plain.ending_offsets is None and plain.batch_only_given() == []
    assert SourceOptions.from_options(opts.to_options()) == opts


def test_time_and_admission_options_parse_with_kafka_precedence() -> None:
    by_time = '{"orders": {"0-1": "2023-11-14T22:13:20Z"}}'
    opts = SourceOptions.from_options({
        **BASE, "startingOffsetsByTimestamp": by_time, "startingOffsets": "latest",
        "endingOffsetsByTimestamp": '{"orders": {"0-0": 1700000001000}}',
        "maxOffsetsPerTrigger": "100", "minOffsetsPerTrigger": "10", "maxTriggerDelay": "2m",
        "startingOffsetsByTimestampStrategy": "LATEST"})
    start = opts.starting(streaming=True)
    assert start.kind == "timestamp" and start.per_partition == {"orders": {"0-1": 1700000000000}}
    assert start.fallback.kind == "latest" and start.strategy == "latest"
    end = opts.ending()
    assert end.kind == "timestamp" and end.fallback.kind == "latest"
    assert opts.batch_only_given() == ["endingOffsetsByTimestamp"]
    assert (opts.max_offsets_per_trigger, opts.min_offsets_per_trigger) == (100, 10)
    assert opts.max_trigger_delay == 120.0
    assert SourceOptions.from_options(opts.to_options()) == opts
    both = SourceOptions.from_options({**BASE, "startingTimestamp": "1700000000000",
                                       "startingOffsetsByTimestamp": by_time})
    assert both.starting(streaming=False).all_ms == 1700000000000  # startingTimestamp wins
    pattern = SourceOptions.from_options({"zk.connect": "h:1", "subscribePattern": "ord.*",
                                          "startingOffsetsByTimestamp": by_time})
    assert pattern.topics == () and pattern.pattern().fullmatch("orders")
    assert not pattern.pattern().fullmatch("my-orders")  # whole name, as Kafka's


@pytest.mark.parametrize(("options", "message"), [
    ({"topic": "t"}, "zk.connect is required"),
    ({"zk.connect": "h:1"}, "option topic (one topic, or several comma-separated) or "
                            "subscribePattern is required"),
    ({**BASE, "subscribePattern": "ord.*"}, "topic and subscribePattern are exclusive"),
    ({"zk.connect": "h:1", "subscribePattern": "(x"}, "subscribePattern '(x' is not a regular"),
    ({**BASE, "startingTimestamp": "yesterday"}, "option startingTimestamp 'yesterday' is "
                                                 "neither epoch milliseconds nor ISO-8601"),
    ({**BASE, "endingTimestamp": "1700000000"}, "option endingTimestamp '1700000000' is"),
    ({**BASE, "startingOffsetsByTimestamp": "{oops"}, "option startingOffsetsByTimestamp must "
                                                      "be JSON like"),
    ({**BASE, "startingOffsetsByTimestamp": '{"orders": {"0-0": "soon"}}'},
     "option startingOffsetsByTimestamp: time of orders 0-0 'soon'"),
    ({**BASE, "endingOffsetsByTimestamp": '{"other": {"0-0": 1700000000000}}'},
     "endingOffsetsByTimestamp names topic 'other'"),
    ({**BASE, "endingOffsetsByTimestamp": '{"orders": {"x": 1700000000000}}'},
     "'x' of topic 'orders' is not a partition"),
    ({**BASE, "startingOffsetsByTimestampStrategy": "guess"},
     "startingOffsetsByTimestampStrategy must be error or latest"),
    ({**BASE, "maxOffsetsPerTrigger": "-5"}, "maxOffsetsPerTrigger must be an integer in 1.."),
    ({**BASE, "minOffsetsPerTrigger": "many"}, "minOffsetsPerTrigger must be an integer"),
    ({**BASE, "maxTriggerDelay": "-1s"}, "maxTriggerDelay must be a duration"),
    ({**BASE, "maxTriggerDelay": "0"}, "maxTriggerDelay must be a positive duration"),
    ({**BASE, "startingOffset": "earliest"}, "unknown option 'startingOffset'"),
    ({**BASE, "path": "/x"}, "takes no path"),
    ({**BASE, "startingOffsets": "newest"}, "startingOffsets must be earliest, latest"),
    ({**BASE, "startingOffsets": '{"other": {"0-0": 1}}'}, "topic 'other', which is not"),
    ({**BASE, "startingOffsets": '{"orders": {"zero": 1}}'}, "'zero' of topic 'orders'"),
    ({**BASE, "startingOffsets": '{"orders": {"0-0": -3}}'}, "offset of orders 0-0 must"),
    ({**BASE, "startingOffsets": '{"orders": {"0-0": 1.5}}'}, "must be an integer"),
    ({**BASE, "endingOffsets": '{"orders": {"0-0": -2}}'}, "-2 (earliest) is not allowed"),
    ({**BASE, "startingOffsets": "[]"}, "non-empty object"),
    ({**BASE, "maxBytesPerTrigger": "lots"}, "maxBytesPerTrigger must be an integer"),
    ({**BASE, "maxBytesPerTrigger": "0"}, "maxBytesPerTrigger must be an integer in 1.."),
    ({**BASE, "fetchSize": "10"}, "fetchSize must be an integer in 1024.."),
    ({**BASE, "failOnDataLoss": "maybe"}, "failOnDataLoss must be true or false"),
    ({**BASE, "codec": "pickle"}, "codec must be one of str, msgpack"),
    ({**BASE, "brokerTimeout": "-1"}, "brokerTimeout must be a positive number"),
    ({**BASE, "topic": "a/b"}, "option topic"),
    ({**BASE, "topic": "a,a"}, "names a topic twice"),
    ({**BASE, "group": "g/h"}, "option group"),
    ({**BASE, "zk.root": "a//b"}, "zk.root must be a ZooKeeper path"),
])
def test_bad_options_are_refused_by_name(options: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        SourceOptions.from_options(options)
    assert message in str(info.value)


@settings(deadline=None)
@given(st.dictionaries(st.text(max_size=20), st.text(max_size=40), max_size=6))
def test_any_option_map_parses_or_raises_config_error(options: dict) -> None:
    try:
        SourceOptions.from_options({**BASE, **options})
    except ConfigError:
        pass


# -- the walker -----------------------------------------------------------------------------

_message = st.tuples(st.binary(max_size=200), st.one_of(st.none(), st.text(max_size=12)))


def _log(messages: list[tuple[bytes, str | None]], first_id: int = 1) -> bytes:
    out = []
    for i, (body, attribute) in enumerate(messages):
        payload, flag = build_payload(body, attribute)
        out.append(encode_message(first_id + i, flag, payload))
    return b"".join(out)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message, max_size=60), st.data())
def test_walk_agrees_with_the_reference_scan(messages, data) -> None:  # type: ignore[no-untyped-def]
    buf = bytearray(_log(messages))
    cut = data.draw(st.integers(0, len(buf)))
    buf = buf[:cut]
    if buf and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] ^= data.draw(st.integers(1, 255))
    valid, count, problem = scan_messages(bytes(buf))
    found = walk(memoryview(bytes(buf)), verify=True, hint=WalkHint())
    assert (found.stop, found.count, found.problem is None) == (valid, count, problem is None)
    assert found.bounds.to_pylist()[-1] == valid


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(1, 400), st.integers(0, 400), st.data())
def test_leaps_over_equal_sizes_are_exact(size: int, n: int, cut: int, data) -> None:  # type: ignore[no-untyped-def]
    """Runs of one size (leapt over) mixed with other sizes, bodies that look like headers."""
    fake = (size).to_bytes(4, "big") * 60
    sizes = data.draw(st.lists(st.sampled_from([size, size, size, size + 1, 0]), min_size=n,
                               max_size=n))
    messages = [((fake * 10)[:s], None) for s in sizes]
    buf = _log(messages)
    buf = buf[:max(0, len(buf) - cut)]
    hint = WalkHint()
    for _ in range(2):  # a second chunk walked with what the first taught the hint
        valid, count, problem = scan_messages(buf)
        found = walk(memoryview(buf), verify=data.draw(st.booleans()), hint=hint)
        assert (found.stop, found.count, found.problem) == (valid, count, problem)


def test_walk_names_an_impossible_length() -> None:
    good = _log([(b"abc", None)] * 3)
    bad = good + (-5).to_bytes(4, "big", signed=True) + bytes(40)
    found = walk(memoryview(bad))
    assert found.count == 3 and found.stop == len(good)
    assert found.problem == "impossible message length -5"


# -- Arrow batches --------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_message, max_size=80), st.integers(0, 2**40))
def test_batches_hold_exactly_the_messages(messages, base: int) -> None:  # type: ignore[no-untyped-def]
    buf = _log(messages, first_id=2**40)
    where = Where(topic="t", partition="3-7", broker_id=3)
    found = walk(memoryview(buf))
    batch = chunk_to_batch(memoryview(buf), found, base, where, arrow_schema())
    assert batch.schema == arrow_schema()
    cols = batch.to_pydict()
    expect = list(iter_messages(buf, base))
    assert cols["offset"] == [m.offset for m in expect]
    assert cols["next_offset"] == [m.next_offset for m in expect]
    assert cols["msg_id"] == [m.msg_id for m in expect]
    assert cols["attribute"] == [a for _, a in messages]
    assert cols["value"] == [b for b, _ in messages]
    assert set(cols["topic"]) <= {"t"} and set(cols["partition"]) <= {"3-7"}
    assert set(cols["broker_id"]) <= {3}


def test_codecs_fill_the_decoded_column_or_name_the_bad_message() -> None:
    import msgpack

    where = Where(topic="t", partition="0-0", broker_id=0)
    text = _log([("héllo".encode(), None), (b"", "a")])
    batch = chunk_to_batch(memoryview(text), walk(memoryview(text)), 0, where,
                           arrow_schema("str"), "str")
    assert batch.column("decoded").to_pylist() == ["héllo", ""]
    packed = _log([(msgpack.packb({"k": [1, b"\x00"]}), None)])
    batch = chunk_to_batch(memoryview(packed), walk(memoryview(packed)), 0, where,
                           arrow_schema("msgpack"), "msgpack")
    assert batch.column("decoded").to_pylist() == ['{"k": [1, "AA=="]}']
    bad = _log([(b"ok", None), (b"\xff\xfe", None)])
    with pytest.raises(MessageError, match="offset 22 of t 0-0 is not UTF-8"):
        chunk_to_batch(memoryview(bad), walk(memoryview(bad)), 0, where, arrow_schema("str"),
                       "str")


def test_a_bad_attribute_length_is_named() -> None:
    payload = (1000).to_bytes(4, "big") + b"short"
    buf = encode_message(9, 1, payload)
    where = Where(topic="t", partition="0-0", broker_id=0)
    with pytest.raises(MessageError, match="bad attribute length 1000"):
        chunk_to_batch(memoryview(buf), walk(memoryview(buf)), 0, where, arrow_schema())


def test_metaq_imports_without_pyspark() -> None:
    import subprocess
    import sys

    code = ("import sys, metaq, metaq.consumer, metaq.producer, metaq.broker\n"
            "assert 'pyspark' not in sys.modules and 'pyarrow' not in sys.modules, "
            "sorted(m for m in sys.modules if m.startswith(('pyspark', 'pyarrow')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=60)
    assert out.returncode == 0, out.stderr
