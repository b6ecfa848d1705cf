"""The bulk paths at both ends of a put, checked against their one-at-a-time twins.

- Producer side: :func:`metaq.net._acks.scan_acks` (whole-buffer parsing of put
  acks) must accept only what :func:`metaq.net._acks.scan_results` parses, with
  the same meaning, and must be the path taken for plain runs of acks.
- Broker side: the columnar put groups of ``BrokerServer._fast_puts`` (one
  partition, runs of partitions, interleaved partitions, bad checksums,
  unknown partitions, "partition -1") must answer every put as the protocol
  says and store exactly the acknowledged messages where the replies say.
"""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq import ProtocolError
from metaq.broker._config import BrokerConfig
from metaq.broker._server import BrokerServer
from metaq.broker._storage import Storage
from metaq.net import scan_acks, scan_results
from metaq.protocol import (
    MsgIdGenerator,
    ReplyParser,
    RequestParser,
    encode_put,
    encode_result,
    iter_messages,
)

# --------------------------------------------------------------------------- replies

pytestmark = pytest.mark.broker

_ok = st.builds(lambda op, mid, part, off: ("ok", op, b"%d %d %d" % (mid, part, off)),
                st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1), st.integers(0, 9999),
                st.integers(0, 2**45))
_other = st.builds(lambda code, op, text: ("other", op, encode_result(code, text, op)),
                   st.sampled_from([200, 400, 403, 404, 500]), st.integers(-2**31, 2**31 - 1),
                   st.binary(max_size=40))
_junk = st.builds(lambda b: ("junk", 0, b), st.binary(max_size=30))


def _encode(item: tuple) -> bytes:
    kind, op, body = item
    return b"result 200 %d %d\r\n%b" % (len(body), op, body) if kind == "ok" else body


def _outcome(fn, buf: bytes):  # type: ignore[no-untyped-def]
    try:
        return fn(buf)
    except ProtocolError:
        return "error"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(_ok, _ok, _ok, _other, _junk), max_size=12), st.integers(0, 2000))
def test_scan_acks_accepts_only_what_scan_results_parses(items: list, cut: int) -> None:
    data = b"".join(map(_encode, items))
    buf = data[:cut % (len(data) + 1)]
    slow = _outcome(scan_results, buf)
    fast = scan_acks(buf)  # never raises
    if fast is None:
        return  # the caller falls back to scan_results
    opaques, ids, parts, offs, used = fast
    assert slow != "error", buf
    replies, slow_used = slow
    assert used == slow_used
    assert replies == [(200, op, b" ".join(t)) for op, *t in zip(opaques, ids, parts, offs,
                                                                 strict=True)]
    assert all(map(bytes.isdigit, ids + parts + offs))


@settings(max_examples=200, deadline=None)
@given(st.lists(_ok, min_size=1, max_size=40), st.integers(0, 5000))
def test_scan_acks_takes_runs_of_acks_in_any_chunking(items: list, cut: int) -> None:
    data = b"".join(map(_encode, items))
    buf = data[:cut % (len(data) + 1)]
    fast = scan_acks(buf)
    replies, used = scan_results(buf)
    if b"result " not in buf:  # not even one header yet: left to scan_results
        assert fast is None and not replies
        return
    assert fast is not None
    assert fast[4] == used and fast[0] == [op for _, op, _ in items[:len(replies)]]
    assert [b" ".join(t) for t in zip(*fast[1:4], strict=True)] == [b for _, _, b in
                                                                    items[:len(replies)]]


@pytest.mark.parametrize("buf, what", [
    (b"result 200 5 1\r\n1 2 3HTTP/1.1 200 OK\r\n", "bad reply"),
    (b"result 200 5 1\r\n1 2 3value 5 1\r\n", "unexpected 'value' reply"),
    (b"result 200 2000000 1\r\n", "over the limit"),
])
def test_scan_acks_leaves_bad_tails_to_the_general_parser(buf: bytes, what: str) -> None:
    assert scan_acks(buf) is None
    with pytest.raises(ProtocolError, match=what):
        scan_results(buf)


def test_scan_acks_leaves_odd_replies_to_the_general_parser() -> None:
    ok = b"result 200 5 1\r\n1 2 3"
    for odd in (b"result 200 6 1\r\n1 2 3",      # body length off by one
                b"result 200 5 -1\r\n1 2 3",     # negative opaque
                b"result 200 5 1\r\n1 2  3",     # not three numbers
                b"result 404 3 1\r\nnah",        # another code
                b"result 200 4 1\r\n1 23"):      # two numbers
        assert scan_acks(ok + odd + ok) is None, odd
    assert scan_acks(ok + ok)[:4] == ([1, 1], [b"1", b"1"], [b"2", b"2"], [b"3", b"3"])


# --------------------------------------------------------------------------- broker

class _Conn:
    peer = "test"
    gone = False  # the client is still there (a real Connection checks its transport)

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.out.append(data)


_put = st.tuples(st.sampled_from([0, 0, 0, 1, 2, -1, 7]), st.binary(max_size=64),
                 st.sampled_from([True, True, True, False]), st.integers(0, 3))
_layout = st.sampled_from(["as drawn", "runs", "one partition", "long runs"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(_put, min_size=1, max_size=120), _layout, st.lists(st.integers(0, 20000),
                                                                   max_size=4))
def test_broker_put_groups_store_exactly_what_they_acknowledge(
        tmp_path_factory: pytest.TempPathFactory, puts: list, layout: str,
        cuts: list[int]) -> None:
    if layout == "runs":
        puts = sorted(puts, key=lambda p: p[0])
    elif layout == "long runs":  # what batches look like: hundreds of puts per partition
        puts = [p for p in sorted(puts[:8], key=lambda p: p[0]) for _ in range(90)]
    elif layout == "one partition":
        puts = [(0, *p[1:]) for p in puts]
    tmp = tmp_path_factory.mktemp("fastpath")
    storage = Storage(tmp, unflush_threshold=10**9)
    storage.open_topic("t", 3)
    server = BrokerServer(BrokerConfig(broker_id=5, data_dir=tmp, port=0, topics={"t": 3}),
                          storage, MsgIdGenerator(5))
    conn = _Conn()
    parser = RequestParser(fast_puts=server.fast_keys)
    data = b"".join(
        encode_put("t", part, payload, flag,
                   (zlib.crc32(payload) & 0x7FFFFFFF) ^ (0 if good else 1), i)
        for i, (part, payload, good, flag) in enumerate(puts))
    try:
        bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
        for a, b in itertools.pairwise(bounds):
            reqs = parser.feed_lenient(data[a:b])
            if reqs:
                server.handle(conn, reqs)  # type: ignore[arg-type]
        replies = ReplyParser().feed(b"".join(conn.out))
        assert [r.opaque for r in replies] == list(range(len(puts)))
        stored = {}
        for p in range(3):
            plog = storage.get("t", p)
            for m in iter_messages(plog.read_bytes(0, plog.end + 1)):
                stored[(p, m.offset)] = m
        acked = 0
        for r, (part, payload, good, flag) in zip(replies, puts, strict=True):
            if part == 7:
                assert r.code == 404, r
            elif not good:
                assert (r.code, r.body) == (400, b"checksum mismatch"), r
            else:
                assert r.code == 200, r
                msg_id, index, offset = map(int, r.body.split(b" "))
                assert part in (-1, index)
                m = stored[(index, offset)]
                assert (m.msg_id, m.payload, m.flag) == (msg_id, payload, flag)
                assert (msg_id >> 12) & 0x3FF == 5
                acked += 1
        assert len(stored) == acked
        assert server.stats["cmd_put"] == len(puts)
        assert server.stats["put_failed"] == len(puts) - acked
    finally:
        storage.close()


def test_broker_put_group_write_failure_answers_500(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from metaq import StorageError
    from metaq.broker._storage import PartitionLog

    storage = Storage(tmp_path, unflush_threshold=10**9)
    storage.open_topic("t", 2)
    server = BrokerServer(BrokerConfig(broker_id=1, data_dir=tmp_path, port=0,
                                       topics={"t": 2}), storage, MsgIdGenerator(1))

    def broken(self: PartitionLog, data: bytes, count: int) -> int:
        raise StorageError("disk on fire")

    monkeypatch.setattr(PartitionLog, "append", broken)
    conn = _Conn()
    puts = b"".join(encode_put("t", i // 3, b"x%d" % i, 0,
                               zlib.crc32(b"x%d" % i) & 0x7FFFFFFF, i) for i in range(6))
    server.handle(conn, RequestParser(fast_puts=server.fast_keys).feed_lenient(puts))  # type: ignore[arg-type]
    replies = ReplyParser().feed(b"".join(conn.out))
    assert [(r.code, r.opaque) for r in replies] == [(500, i) for i in range(6)]
    assert b"disk on fire" in replies[0].body
    storage.close()


def test_broker_takes_runs_of_puts_as_one_group_each(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    storage = Storage(tmp_path, unflush_threshold=10**9)
    storage.open_topic("t", 3)
    server = BrokerServer(BrokerConfig(broker_id=1, data_dir=tmp_path, port=0,
                                       topics={"t": 3}), storage, MsgIdGenerator(1))
    groups: list[int] = []
    put_group = BrokerServer._put_group

    def spy(self: BrokerServer, target: tuple, puts: list, ids: list[int]):  # type: ignore[no-untyped-def]
        groups.append(len(puts))
        return put_group(self, target, puts, ids)

    monkeypatch.setattr(BrokerServer, "_put_group", spy)
    body = b"b" * 10
    crc = zlib.crc32(body) & 0x7FFFFFFF
    for layout, expect in (([0] * 300 + [2] * 200 + [0] * 100, [300, 200, 100]),  # runs
                           ([0, 1, 2] * 100, [100, 100, 100]),                    # buckets
                           ([1] * 50, [50])):                                      # one
        groups.clear()
        conn = _Conn()
        data = b"".join(encode_put("t", p, body, 0, crc, i) for i, p in enumerate(layout))
        server.handle(conn, RequestParser(fast_puts=server.fast_keys).feed_lenient(data))  # type: ignore[arg-type]
        assert groups == expect
        replies = ReplyParser().feed(b"".join(conn.out))
        assert [(r.code, r.opaque) for r in replies] == [(200, i) for i in range(len(layout))]
        assert [int(r.body.split()[1]) for r in replies] == layout
    storage.close()
