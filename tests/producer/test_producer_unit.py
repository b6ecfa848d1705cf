"""Producer pieces that need no broker: config, partitioners, futures, reply scanning, CLI input."""

from __future__ import annotations

import io
import threading
import zlib
from concurrent.futures import FIRST_COMPLETED, InvalidStateError, as_completed, wait

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq import ConfigError, MessageError, ProducerConfig, ProducerError, ProtocolError
from metaq._cli.produce import generated, lines
from metaq.net import LightFuture, PutAck, parse_put_ack, scan_results
from metaq.producer._partitioner import (
    KeyHash,
    RoundRobin,
    UserPartitioner,
    hash_index,
    key_bytes,
    make_partitioner,
)
from metaq.protocol import encode_result
from zk_layout import Partition

PARTS = tuple(Partition(b, i) for b, i in [(0, 0), (0, 1), (0, 10), (0, 2), (1, 0), (1, 1)])


# --------------------------------------------------------------------------- config

def test_config_defaults_are_rocketmq_like() -> None:
    c = ProducerConfig()
    assert (c.zk_root, c.send_timeout, c.retries, c.max_message_size, c.partitioner,
            c.codec) == ("/meta", 3.0, 2, 4 * 1024 * 1024, "roundrobin", "auto")
    assert c.attempt_timeout == pytest.approx(1.0)
    assert ProducerConfig(request_timeout=0.5).attempt_timeout == 0.5


def test_config_is_frozen_and_keyword_only() -> None:
    c = ProducerConfig()
    with pytest.raises(AttributeError):
        c.retries = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        ProducerConfig("/meta")  # type: ignore[misc]


@pytest.mark.parametrize("field,value,words", [
    ("zk_root", "", "zk_root"),
    ("zk_root", "/a//b", "zk_root"),
    ("send_timeout", 0, "send_timeout"),
    ("send_timeout", -1.0, "send_timeout"),
    ("send_timeout", float("nan"), "send_timeout"),
    ("send_timeout", "3", "send_timeout"),
    ("retries", -1, "retries"),
    ("retries", 1.5, "retries"),
    ("retries", True, "retries"),
    ("max_message_size", 0, "max_message_size"),
    ("max_message_size", 1 << 40, "max_message_size"),
    ("partitioner", "random", "partitioner"),
    ("partitioner", 42, "partitioner"),
    ("codec", "pickle", "codec"),
    ("max_in_flight", 0, "max_in_flight"),
    ("max_in_flight_bytes", 10, "max_in_flight_bytes"),
    ("request_timeout", 0, "request_timeout"),
    ("retry_backoff", -0.1, "retry_backoff"),
    ("close_timeout", 0, "close_timeout"),
    ("zk_security", "user:pw", "zk_security"),
])
def test_config_rejects_bad_values_naming_the_field(field: str, value: object,
                                                    words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ProducerConfig(**{field: value})


def test_zk_root_without_its_leading_slash_is_accepted_as_java_does() -> None:
    assert ProducerConfig(zk_root="meta").zk_root == "meta"  # zk_layout.Layout normalises


def test_config_from_mapping_names_unknown_options() -> None:
    with pytest.raises(ConfigError, match="send_timout"):
        ProducerConfig.from_mapping({"send_timout": 1.0})
    assert ProducerConfig.from_mapping({"retries": 0}).retries == 0


def test_config_accepts_a_callable_partitioner() -> None:
    c = ProducerConfig(partitioner=lambda topic, parts, body, key: 0, retries=0)
    assert callable(c.partitioner)


# --------------------------------------------------------------------------- partitioners

def test_round_robin_cycles_every_partition_per_topic() -> None:
    rr = RoundRobin()
    a = [rr("a", PARTS, b"", None) for _ in range(12)]
    b = [rr("b", PARTS[:2], b"", None) for _ in range(4)]
    assert sorted(a[:6]) == list(range(6)) and a[6:] == a[:6]
    assert [(x - a[0]) % 6 for x in a[:6]] == list(range(6))  # consecutive
    assert sorted(b) == [0, 0, 1, 1]


def test_round_robin_is_safe_across_threads() -> None:
    rr = RoundRobin()
    counts = [0] * len(PARTS)
    lock = threading.Lock()

    def work() -> None:
        local = [0] * len(PARTS)
        for _ in range(6000):
            local[rr("t", PARTS, b"", None)] += 1
        with lock:
            for i, n in enumerate(local):
                counts[i] += n

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counts == [4000] * len(PARTS)


def test_hash_is_crc32_of_the_key_bytes_and_stable() -> None:
    # Known values: the same in every process and run (unlike hash()).
    assert zlib.crc32(b"order-42") == 1475806942
    assert hash_index("order-42", 6) == 1475806942 % 6
    assert hash_index(b"order-42", 6) == hash_index("order-42", 6)
    assert hash_index(42, 7) == zlib.crc32(b"42") % 7
    kh = KeyHash()
    assert {kh("t", PARTS, b"", "user-7") for _ in range(20)} == {zlib.crc32(b"user-7") % 6}
    assert key_bytes("é") == "é".encode()
    with pytest.raises(MessageError, match="key must be"):
        key_bytes(1.5)
    with pytest.raises(MessageError, match="key must be"):
        key_bytes(True)


def test_hash_without_key_falls_back_to_round_robin() -> None:
    kh = KeyHash()
    assert sorted(kh("t", PARTS, b"", None) for _ in range(6)) == list(range(6))


def test_hash_spreads_keys() -> None:
    kh = KeyHash()
    hits = [0] * 6
    for i in range(6000):
        hits[kh("t", PARTS, b"", f"key-{i}")] += 1
    assert min(hits) > 800, hits


def test_user_partitioner_accepts_partition_name_or_position() -> None:
    seen = []

    def fn(topic, parts, body, key):  # type: ignore[no-untyped-def]
        seen.append((topic, tuple(parts), body, key))
        return {"p": Partition(1, 0), "s": "0-10", "i": 3}[key]

    up = UserPartitioner(fn)
    assert up("t", PARTS, b"body", "p") == 4
    assert up("t", PARTS, b"body", "s") == 2
    assert up("t", PARTS, b"body", "i") == 3
    assert seen[0] == ("t", PARTS, b"body", "p")


@pytest.mark.parametrize("answer", [6, -1, "2-0", "zz", Partition(3, 0), None, True, 1.0])
def test_user_partitioner_rejects_an_answer_outside_the_list(answer: object) -> None:
    up = UserPartitioner(lambda *a: answer)
    with pytest.raises(ProducerError, match="not one of its 6 partitions"):
        up("t", PARTS, b"", None)


def test_make_partitioner() -> None:
    assert isinstance(make_partitioner("roundrobin"), RoundRobin)
    assert isinstance(make_partitioner("hash"), KeyHash)
    assert isinstance(make_partitioner(lambda *a: 0), UserPartitioner)


# --------------------------------------------------------------------------- futures

def test_light_future_completed_before_anyone_looks() -> None:
    f = LightFuture()
    assert f.running() and not f.done() and not f.cancel()
    f.set_result(7)
    assert "_condition" not in f.__dict__  # nobody waited: no condition was built
    assert f.done() and f.result() == 7 and f.exception() is None
    with pytest.raises(InvalidStateError):
        f.set_result(8)
    with pytest.raises(InvalidStateError):
        f.set_exception(ValueError())
    assert f.result(0) == 7


def test_light_future_exception() -> None:
    f = LightFuture()
    err = ProducerError("boom")
    f.set_exception(err)
    assert f.exception() is err
    with pytest.raises(ProducerError, match="boom"):
        f.result()


def test_light_future_result_timeout_then_value() -> None:
    f = LightFuture()
    with pytest.raises(TimeoutError):
        f.result(timeout=0.01)
    f.set_result("late")  # a condition exists now: the slow path notifies
    assert f.result(timeout=1) == "late"


def test_light_future_wakes_waiters_in_other_threads() -> None:
    futures = [LightFuture() for _ in range(2000)]
    got: list[object] = []
    started = threading.Event()

    def waiter() -> None:
        started.set()
        got.extend(f.result(timeout=10) for f in futures)

    t = threading.Thread(target=waiter)
    t.start()
    started.wait(5)
    for i, f in enumerate(futures):
        f.set_result(i)
    t.join(20)
    assert got == list(range(2000))


def test_light_future_callbacks_run_once_before_or_after_completion() -> None:
    calls: list[object] = []
    f = LightFuture()
    f.add_done_callback(lambda fut: calls.append(("before", fut.result())))
    f.set_result(1)
    f.add_done_callback(lambda fut: calls.append(("after", fut.result())))
    assert calls == [("before", 1), ("after", 1)]


def test_light_future_works_with_wait_and_as_completed() -> None:
    a, b, c = LightFuture(), LightFuture(), LightFuture()
    a.set_result("a")
    done, pending = wait([a, b, c], timeout=0.01, return_when=FIRST_COMPLETED)
    assert done == {a} and pending == {b, c}

    def finish() -> None:
        b.set_result("b")
        c.set_exception(ProducerError("c"))

    t = threading.Thread(target=finish)
    t.start()
    order = [f for f in as_completed([a, b, c], timeout=5)]
    t.join()
    assert set(order) == {a, b, c}
    assert b.result() == "b" and isinstance(c.exception(), ProducerError)


def test_light_future_completion_racing_with_waiters_and_callbacks() -> None:
    """Completer and observers race on every future; nothing is lost or doubled."""
    n = 20_000
    futures = [LightFuture() for _ in range(n)]
    calls = [0] * n
    seen: list[object] = [None] * n
    barrier = threading.Barrier(2)

    def complete() -> None:
        barrier.wait()
        for i, f in enumerate(futures):
            if i % 7 == 0:
                f.set_exception(ProducerError(str(i)))
            else:
                f.set_result(i)

    def observe() -> None:
        barrier.wait()
        for i, f in enumerate(futures):
            kind = i % 3
            if kind == 0:
                def cb(fut: LightFuture, i: int = i) -> None:
                    calls[i] += 1
                f.add_done_callback(cb)
            elif kind == 1:
                done, _ = wait([f], timeout=10)
                seen[i] = f in done
            else:
                seen[i] = f.exception(timeout=10) or f.result(timeout=10)

    threads = [threading.Thread(target=complete), threading.Thread(target=observe)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(calls[i] == 1 for i in range(0, n, 3))
    assert all(seen[i] is True for i in range(1, n, 3))
    for i in range(2, n, 3):
        assert (str(seen[i]) == str(i)) if i % 7 == 0 else seen[i] == i


# --------------------------------------------------------------------------- replies

def test_parse_put_ack() -> None:
    assert parse_put_ack(b"123 4 5678") == PutAck(123, 4, 5678)
    for bad in (b"", b"1 2", b"1 2 3 4", b"a b c", b"1  2 3"):
        with pytest.raises(ProtocolError, match="msgId"):
            parse_put_ack(bad)


def test_scan_results_whole_and_partial() -> None:
    data = encode_result(200, b"1 0 0", 5) + encode_result(500, b"disk full", -3)
    assert scan_results(data) == ([(200, 5, b"1 0 0"), (500, -3, b"disk full")], len(data))
    for cut in range(len(data)):
        replies, used = scan_results(data[:cut])
        assert used <= cut
        assert [r for r in scan_results(data)[0][:len(replies)]] == replies


@pytest.mark.parametrize("garbage,words", [
    (b"value 5 1\r\nhello", "unexpected 'value'"),
    (b"result 200 x 1\r\n", "bad reply line"),
    (b"HTTP/1.1 200 OK\r\n", "bad reply"),
    (b"resulx", "bad reply"),
    (b"result 200 5 99999999999\r\n", "bad reply line"),
    (b"result 200 5 4294967295\r\n", "int32"),
    (b"result 200 999999999 1\r\n", "over the limit"),
    (b"result " + b"1" * 9000, "bad reply line"),
])
def test_scan_results_rejects_garbage(garbage: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        scan_results(encode_result(200, b"1 0 0", 1) + garbage)


_reply = st.tuples(st.sampled_from([200, 400, 403, 404, 500, 503]),
                   st.integers(-(1 << 31), (1 << 31) - 1),
                   st.binary(max_size=40))


@settings(max_examples=300, deadline=None)
@given(st.lists(_reply, max_size=20), st.lists(st.integers(1, 60), max_size=30))
def test_scan_results_any_chunking_gives_the_same_replies(replies, cuts) -> None:  # type: ignore[no-untyped-def]
    data = b"".join(encode_result(c, body, o) for c, o, body in replies)
    got = []
    rest = b""
    pos = 0
    for size in [*cuts, len(data)]:
        rest += data[pos:pos + size]
        pos += size
        out, used = scan_results(rest)
        got.extend(out)
        rest = rest[used:]
    assert rest == b""
    assert got == [(c, o, body) for c, o, body in replies]


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_scan_results_garbage_never_crashes(data: bytes) -> None:
    try:
        out, used = scan_results(data)
    except ProtocolError:
        return
    assert 0 <= used <= len(data)
    assert all(isinstance(c, int) and isinstance(o, int) for c, o, _ in out)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000))
def test_producer_checksum_is_metaqs(payload: bytes) -> None:
    """The producer may use ISA-L's CRC32; it must equal Metaq's checksum."""
    from metaq.producer._producer import _crc32
    from metaq.protocol import checksum

    assert _crc32(payload) & 0x7FFFFFFF == checksum(payload)


# --------------------------------------------------------------------------- structure

def test_producer_modules_share_no_private_names_and_import_no_circle() -> None:
    """Each module of metaq.producer imports the others' public names only, and no
    module imports one that imports it back (TYPE_CHECKING imports count)."""
    import ast
    from pathlib import Path

    import metaq.producer

    here = Path(metaq.producer.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in sorted(here.glob("_*.py")):
        graph[path.stem] = deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "metaq.producer._"):
                deps.add(node.module.rsplit(".", 1)[1])
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{path.name} imports {private} from {node.module}"
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("metaq.producer._") for a in node.names)

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph[start])
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return seen

    assert {"_batch", "_path", "_send", "_producer"} <= set(graph)
    circles = sorted(m for m in graph if m in reach(m))
    assert not circles, f"import circles through {circles}"


# --------------------------------------------------------------------------- CLI input

def test_cli_lines_strip_newline_and_cr_only() -> None:
    stream = io.BytesIO(b"a\nb c\r\n\n  d \nlast")
    assert list(lines(stream)) == [b"a", b"b c", b"", b"  d ", b"last"]


def test_cli_generated_bodies_have_the_exact_size_and_differ() -> None:
    bodies = list(generated(1000, 100))
    assert {len(b) for b in bodies} == {100} and len(set(bodies)) == 1000
    assert list(generated(3, 1)) == [b"0", b"1", b"2"]
    assert list(generated(2, 0)) == [b"", b""]
