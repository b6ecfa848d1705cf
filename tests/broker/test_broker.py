"""The broker over real sockets: every command, every result code rule, pipelining, bad input."""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from pathlib import Path

import pytest
from helpers.raw_client import RawClient

import metaq
from metaq.broker import Broker, BrokerConfig
from metaq.protocol import (
    QUIT,
    Result,
    Value,
    checksum,
    encode_get,
    encode_offset,
    encode_put,
    encode_stats,
    encode_version,
    iter_messages,
    parse_put_result,
    scan_messages,
    split_payload,
)
from metaq.testing import wait_until

pytestmark = pytest.mark.broker


def make_config(tmp_path: Path, **kw) -> BrokerConfig:
    kw.setdefault("topics", {"t": 2, "other": 1})
    return BrokerConfig(broker_id=kw.pop("broker_id", 3), data_dir=tmp_path / "data", port=0,
                        **kw)


@pytest.fixture(autouse=True)
def no_errors_logged(caplog):
    """Whatever clients send, the broker logs no error (errors mean a bug or lost data)."""
    yield
    bad = [r for r in caplog.get_records("call")
           if r.levelno >= logging.ERROR and r.name.startswith("metaq")]
    assert not bad, [r.getMessage() for r in bad]


@pytest.fixture
def broker(tmp_path, broker_factory):
    return broker_factory(config=make_config(tmp_path))


@pytest.fixture
def client(broker):
    c = RawClient(broker.port)
    yield c
    c.close()


def assert_logs_clean(data_dir: Path) -> None:
    """Every segment of every partition is whole messages with good checksums."""
    for seg in data_dir.glob("*-*/*.meta"):
        raw = seg.read_bytes()
        valid, _n, problem = scan_messages(raw)
        assert problem is None and valid == len(raw), f"{seg}: {problem} at {valid}"


# --------------------------------------------------------------------------- commands

def test_put_then_get_returns_the_log_bytes(broker, client):
    bodies = [b"hello", b"", b"x" * 1000, "ü".encode() * 10]
    results = []
    for i, body in enumerate(bodies):
        r = client.put("t", 1, body, opaque=100 + i, attribute="attr" if i % 2 else None)
        assert isinstance(r, Result) and r.code == 200 and r.opaque == 100 + i
        results.append(parse_put_result(r.body))
    assert [p for _m, p, _o in results] == [1, 1, 1, 1]
    assert [o for _m, _p, o in results] == [0, 25, 45 + 8, 45 + 8 + 1020]
    ids = [m for m, _p, _o in results]
    assert ids == sorted(ids) and len(set(ids)) == 4
    v = client.call(encode_get("t", "g", 1, 0, 1 << 20, 7))
    assert isinstance(v, Value) and v.opaque == 7
    msgs = list(iter_messages(v.body, 0))
    assert [m.msg_id for m in msgs] == ids
    assert [m.offset for m in msgs] == [o for _m, _p, o in results]
    assert [split_payload(m.payload, m.flag) for m in msgs] == [
        (None, bodies[0]), ("attr", bodies[1]), (None, bodies[2]), ("attr", bodies[3])]
    # the bytes on disk are the bytes served
    seg = broker.config.data_dir / "t-1" / "00000000000000000000.meta"
    assert seg.read_bytes() == v.body
    assert broker.offsets("t", 1) == (0, len(v.body))
    assert broker.offsets("t", 0) == (0, 0)


def test_get_from_the_middle_and_partial_messages(broker, client):
    for i in range(10):
        assert client.put("t", 0, b"%03d" % i * 10).code == 200  # 50-byte records
    v = client.call(encode_get("t", "g", 0, 100, 120, 1))
    assert len(v.body) == 120
    msgs = list(iter_messages(v.body, 100))
    assert [m.offset for m in msgs] == [100, 150]  # the third is cut: ignored by readers
    v = client.call(encode_get("t", "g", 0, 490, 1000, 2))
    assert len(v.body) == 10  # the tail of the last message


def test_put_partition_minus_one_round_robin(broker, client):
    parts = [parse_put_result(client.put("t", -1, b"m%d" % i).body)[1] for i in range(6)]
    assert sorted(parts[:2]) == [0, 1] and parts == parts[:2] * 3
    broker.set_partition_closed("t", 0)
    parts = [parse_put_result(client.put("t", -1, b"n%d" % i).body)[1] for i in range(3)]
    assert parts == [1, 1, 1]


def test_one_pipelined_batch_over_many_partitions(broker, client):
    broker.add_topic("wide", 4)
    broker.set_partition_closed("wide", 3)
    rng = random.Random(7)
    reqs, want = [], []
    for i in range(400):
        part = rng.choice([0, 1, 2, 3, -1])
        payload = b"%04d" % i
        good = rng.random() > 0.1
        reqs.append(encode_put("wide", part, payload, 0, checksum(payload) ^ (0 if good else 1),
                               i))
        want.append((part, good))
    client.send(b"".join(reqs))
    got = client.replies(400)
    assert [r.opaque for r in got] == list(range(400))
    placed = {0: [], 1: [], 2: []}
    for (part, good), r in zip(want, got, strict=True):
        if not good:
            assert (r.code, r.body) == (400, b"checksum mismatch")
        elif part == 3:
            assert r.code == 403
        else:
            assert r.code == 200, r
            _m, p, off = parse_put_result(r.body)
            assert p == part or (part == -1 and p in (0, 1, 2))
            placed[p].append((off, r.opaque))
    for p, offs in placed.items():
        # offsets of a partition follow request order, back to back (24-byte records)
        assert [o for o, _ in offs] == [24 * i for i in range(len(offs))]
        v = client.call(encode_get("wide", "g", p, 0, 1 << 20, 9999))
        assert [m.payload for m in iter_messages(v.body, 0)] == [b"%04d" % o for _, o in offs]
    assert broker.offsets("wide", 3) == (0, 0)


def test_puts_of_both_parser_paths_are_one_step(broker, client):
    """Puts the parser's put loop takes (tuples) and puts it leaves to the general
    parser (PutRequests: a partition written with a leading zero, a transaction key,
    a partition below -1...) mixed in one pipelined batch: each answered by the same
    rules, partition -1 picked in request order, stored back to back per partition."""
    broker.add_topic("mix", 3)
    broker.set_partition_closed("mix", 2)
    rng = random.Random(11)
    reqs, want = [], []
    turn = 0  # partition -1's round robin over the open partitions 0 and 1
    for i in range(300):
        part = rng.choice([0, 0, 1, 1, 2, -1, -1, 5, -2])
        form = rng.choice(["loop", "loop", "general", "tx"])
        good = rng.random() > 0.1
        payload = b"%04d" % i
        line = encode_put("mix", part, payload, 0, checksum(payload) ^ (0 if good else 1), i,
                          tx_key="k" if form == "tx" else None)
        if form == "general":
            line = line.replace(b"mix %d " % part, b"mix %s0%d " % (
                b"-" if part < 0 else b"", abs(part)), 1)
        reqs.append(line)
        if form == "tx":  # a transaction's put (here of a key that is not one)
            want.append((400, b"bad transaction key b'k': expected 'TX:<session>:<n>', "
                              b"'XID:<formatId>:<gtrid hex>:<bqual hex>:<uniqueQualifier>' "
                              b"or 'null'"))
            continue
        if part == -2:
            want.append((400, b"bad partition -2"))
            continue
        if part == 5:
            want.append((404, b"topic mix partition 5 not found"))
            continue
        if part == -1:
            part, turn = turn, 1 - turn
        if not good:
            want.append((400, b"checksum mismatch"))
        elif part == 2:
            want.append((403, b"partition mix-2 is closed"))
        else:
            want.append((200, part))
    client.send(b"".join(reqs))
    got = client.replies(300)
    assert [r.opaque for r in got] == list(range(300))
    placed: dict[int, list[int]] = {0: [], 1: []}
    for (code, what), r in zip(want, got, strict=True):
        if code != 200:
            assert (r.code, r.body) == (code, what), r
            continue
        assert r.code == 200, r
        _m, p, off = parse_put_result(r.body)
        assert p == what
        assert off == 24 * len(placed[p])
        placed[p].append(r.opaque)
    for p, opaques in placed.items():
        v = client.call(encode_get("mix", "g", p, 0, 1 << 20, 9999))
        assert [m.payload for m in iter_messages(v.body, 0)] == [b"%04d" % o for o in opaques]
    assert broker.offsets("mix", 2) == (0, 0)


def test_get_result_rules(tmp_path):
    cfg = make_config(tmp_path, max_segment_size=4096)
    with Broker(cfg) as broker:
        c = RawClient(broker.port)
        for i in range(100):
            assert c.put("t", 0, b"%08d" % i * 12).code == 200  # 116-byte records
        end = broker.offsets("t", 0)[1]
        assert end == 11600
        # age every sealed segment and run retention: the log now starts later
        old = time.time() - 1000 * 3600
        for seg in (cfg.data_dir / "t-0").glob("*.meta"):
            os.utime(seg, (old, old))
        deleted = broker.run_retention()
        assert len(deleted) == 2
        start = broker.offsets("t", 0)[0]
        assert start > 0
        r = c.call(encode_get("t", "g", 0, 0, 1000, 1))
        assert (r.code, r.body) == (301, b"%d" % start)
        assert c.call(encode_get("t", "g", 0, start, 1000, 2)).opaque == 2
        r = c.call(encode_get("t", "g", 0, end, 1000, 3))
        assert r.code == 404
        r = c.call(encode_get("t", "g", 0, end + 500, 1000, 4))
        assert r.code == 404
        r = c.call(encode_get("t", "g", 0, start, 0, 5))
        assert r.code == 400 and b"maxSize" in r.body
        r = c.call(encode_get("t", "g", 0, start, -7, 6))
        assert r.code == 400
        r = c.call(encode_get("nope", "g", 0, 0, 1000, 7))
        assert r.code == 404 and b"nope" in r.body
        r = c.call(encode_get("t", "g", 2, 0, 1000, 8))
        assert r.code == 404
        broker.set_partition_closed("t", 0)
        r = c.call(encode_get("t", "g", 0, start, 1000, 9))
        assert r.code == 403
        r = c.put("t", 0, b"x", opaque=10)
        assert (r.code, r.opaque) == (403, 10)
        broker.set_partition_closed("t", 0, False)
        assert c.put("t", 0, b"x", opaque=11).code == 200
        c.close()
    with Broker(cfg.replace(correct_offsets=True)) as broker:
        c = RawClient(broker.port)
        end = broker.offsets("t", 0)[1]
        r = c.call(encode_get("t", "g", 0, end + 500, 1000, 1))
        assert (r.code, r.body) == (301, b"%d" % end)
        assert c.call(encode_get("t", "g", 0, end, 1000, 2)).code == 404
        c.close()


def test_big_gets_use_sendfile_and_are_capped(tmp_path):
    cfg = make_config(tmp_path, max_transfer_size=256 * 1024)
    with Broker(cfg) as broker:
        c = RawClient(broker.port)
        bodies = [os.urandom(100_000) for _ in range(5)]
        for b in bodies:
            assert c.put("t", 0, b).code == 200
        seg = (cfg.data_dir / "t-0" / "00000000000000000000.meta").read_bytes()
        # pipelined: big get, small request, big get; replies stay in order
        c.send(encode_get("t", "g", 0, 0, 10 << 20, 1) + encode_version(2)
               + encode_get("t", "g", 0, 100_020, 150_000, 3))
        v1, ver, v3 = c.replies(3)
        assert (v1.opaque, ver.opaque, v3.opaque) == (1, 2, 3)
        assert v1.body == seg[:256 * 1024]          # capped at max_transfer_size
        assert v3.body == seg[100_020:250_020]      # capped at maxSize
        assert [split_payload(m.payload, m.flag)[1] for m in iter_messages(v1.body, 0)] == \
            bodies[:2]
        # the counter moves when the sendfile task finishes, which can be just after the
        # client has read the bytes: wait for it, with a deadline
        def counted() -> str | None:
            st = broker.stats()
            return st if "STAT get_sendfile 2\r\n" in st else None

        stats = wait_until(counted, timeout=10, what="two sendfiles counted")
        assert "get_sendfile_fallback 0" in stats
        c.close()


def test_offset_stats_version_quit(broker, client):
    for _i in range(5):
        client.put("t", 0, b"abcdefghij")  # 30-byte records
    assert client.call(encode_offset("t", "g", 0, 45, 1)) == Result(200, b"30", 1)
    assert client.call(encode_offset("t", "g", 0, 60, 2)) == Result(200, b"60", 2)
    assert client.call(encode_offset("t", "g", 0, -3, 3)) == Result(200, b"0", 3)
    assert client.call(encode_offset("t", "g", 0, 10 ** 6, 4)) == Result(200, b"150", 4)
    assert client.call(encode_offset("zz", "g", 0, 0, 5)).code == 404
    v = client.call(encode_version(6))
    assert v.code == 200 and v.body.startswith(b"1.4") and b"metaq-py" in v.body
    s = client.call(encode_stats(None, 7))
    text = s.body.decode()
    assert s.code == 200 and f"STAT pid {os.getpid()}\r\n" in text
    assert "STAT uptime " in text and "STAT version 1.4" in text
    assert "STAT topics 2\r\n" in text and "STAT partitions 3\r\n" in text
    assert "STAT cmd_put 5\r\n" in text
    s = client.call(encode_stats("offsets", 8)).body.decode()
    assert ("STAT t part 0 min_offset 0 max_offset 150 closed false damaged 0 "
            "damaged_bytes 0\r\n") in s
    assert "STAT other partitions 1" in client.call(encode_stats("topics", 9)).body.decode()
    client.send(encode_version(10) + QUIT + encode_version(11))
    assert [r.opaque for r in client.rest_until_closed()] == [10]


def test_java_request_forms(broker, client):
    """Each form a Java Metaq 1.4 client or tool sends, answered as a Java broker does."""
    from metaq.protocol import HEADER

    # put without a checksum (clients before 1.4.4), and with -1 ("not computed": every
    # Java producer's): stored with the checksum the broker computes
    r1 = client.call(b"put t 0 5 0 11\r\nhello")
    r2 = client.call(b"put t 0 5 0 -1 12\r\nworld")
    r3 = client.call(b"put t 0 3 0 %d 13  \r\nabc" % checksum(b"abc"))  # trailing spaces
    assert [(r.code, r.opaque) for r in (r1, r2, r3)] == [(200, 11), (200, 12), (200, 13)]
    v = client.call(encode_get("t", "g", 0, 0, 4096, 14))
    msgs = list(iter_messages(v.body, 0))  # checksums verified
    assert [m.payload for m in msgs] == [b"hello", b"world", b"abc"]
    assert [HEADER.unpack_from(v.body, m.offset)[1] for m in msgs] == [
        checksum(b"hello"), checksum(b"world"), checksum(b"abc")]
    # a checksum that is given and wrong is still refused; transactional puts, in
    # either of Java's forms: Java's answer when the transaction was not begun, else
    # kept for the commit (offset -1)
    assert client.call(b"put t 0 3 0 12345 15\r\nabc") == Result(400, b"checksum mismatch", 15)
    for line in (b"put t 0 3 0 TX:s:1 16\r\nabc", b"put t 0 3 0 -1 TX:s:1 16\r\nabc"):
        r = client.call(line)
        assert r == Result(500, b"Local transaction 'TX:s:1' has not been started.", 16)
    assert client.call(b"transaction TX:s:1 s BEGIN 16\r\n") == Result(200, b"", 16)
    for line in (b"put t 0 3 0 TX:s:1 16\r\nabc", b"put t 0 3 0 -1 TX:s:1 16\r\nabc"):
        r = client.call(line)
        assert r.code == 200 and r.body.endswith(b" 0 -1") and r.opaque == 16
    assert client.call(b"transaction TX:s:1 s ROLLBACK 16\r\n") == Result(200, b"", 16)
    # get and offset with fields after the opaque (ignored)
    v = client.call(b"get t g 0 0 4096 17 some extra fields\r\n")
    assert isinstance(v, Value) and v.opaque == 17 and len(list(iter_messages(v.body, 0))) == 3
    assert client.call(b"get t g 0 0 4096 18  \r\n").opaque == 18
    assert client.call(b"offset t g 0 0 19 extra\r\n") == Result(200, b"0", 19)
    # stats: Java's "stats  <opaque>" (no item), and without an opaque
    s = client.call(b"stats  20\r\n")
    assert s.code == 200 and s.opaque == 20 and f"STAT pid {os.getpid()}\r\n" in s.body.decode()
    s = client.call(b"stats\r\n")
    assert s.code == 200 and s.opaque == 2**31 - 1 and b"STAT pid " in s.body
    s = client.call(b"stats topics\r\n")
    assert s.opaque == 2**31 - 1 and b"STAT other partitions 1" in s.body
    # version alone: Java's heartbeat, answered with opaque Integer.MAX_VALUE
    v = client.call(b"version\r\n")
    assert (v.code, v.opaque) == (200, 2147483647) and v.body.startswith(b"1.4")
    # sync (master -> slave) to a broker that is not a slave: refused (403), its payload
    # skipped, the connection goes on (tests/broker/test_sync.py: a slave's answers)
    payload = b"put t 0 1 0 0 99\r\nx" * 3
    client.send(b"sync t 0 %d 0 6340863216562294785 -1 21\r\n" % len(payload))
    # (a payload split across reads is the parser's case: tests/protocol/test_protocol.py
    # feeds sync in every chunking)
    client.send(payload[:10])
    client.send(payload[10:] + encode_version(22))
    r, v = client.replies(2)
    assert (r.code, r.opaque) == (403, 21)
    assert r.body == b"broker 3 is not a slave; sync is only accepted by a slave"
    assert (v.code, v.opaque) == (200, 22)
    r = client.call(b"sync t 0 3 0 6340863216562294785 23\r\nabc" + encode_version(24))
    assert (r.code, r.opaque) == (403, 23) and client.replies(1)[0].opaque == 24
    assert broker.offsets("t", 0)[1] == 3 * 20 + 5 + 5 + 3  # nothing of the syncs stored
    assert_logs_clean(broker.config.data_dir)


def test_pipelining_many_opaques_in_order(broker, client):
    rng = random.Random(5)
    reqs, expect = [], []
    for i in range(3000):
        opaque = rng.randrange(-(2 ** 31), 2 ** 31)
        kind = rng.choice("ppppgvo")
        if kind == "p":
            payload = os.urandom(rng.randrange(0, 300))
            reqs.append(encode_put("t", i % 2, payload, 0, checksum(payload), opaque))
        elif kind == "g":
            reqs.append(encode_get("t", "g", i % 2, 0, 4096, opaque))
        elif kind == "v":
            reqs.append(encode_version(opaque))
        else:
            reqs.append(encode_offset("t", "g", 0, 0, opaque))
        expect.append((kind, opaque))
    data = b"".join(reqs)
    # send in odd-sized chunks from another thread while reading
    sender = threading.Thread(target=lambda: [client.send(data[i:i + 777])
                                              for i in range(0, len(data), 777)])
    sender.start()
    got = client.replies(len(reqs))
    sender.join()
    assert [r.opaque for r in got] == [o for _k, o in expect]
    offsets = {0: [], 1: []}
    for (kind, _o), r in zip(expect, got, strict=True):
        if kind == "p":
            assert r.code == 200
            _m, p, off = parse_put_result(r.body)
            offsets[p].append(off)
        elif kind == "g":
            assert isinstance(r, Value) or r.code == 404
    for p, offs in offsets.items():
        assert offs == sorted(offs)
        assert broker.offsets("t", p)[1] >= (offs[-1] if offs else 0)
    assert_logs_clean(broker.config.data_dir)


def test_concurrent_producers_get_unique_offsets(broker):
    results: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def produce(k: int) -> None:
        c = RawClient(broker.port)
        payloads = [b"%d-%d" % (k, i) for i in range(300)]
        c.send(b"".join(encode_put("t", 0, p, 0, checksum(p), i) for i, p in enumerate(payloads)))
        got = [parse_put_result(r.body) for r in c.replies(300)]
        with lock:
            results.extend(got)
        c.close()

    threads = [threading.Thread(target=produce, args=(k,), name=f"prod-{k}") for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({o for _m, _p, o in results}) == 1800
    assert len({m for m, _p, _o in results}) == 1800
    seg = (broker.config.data_dir / "t-0" / "00000000000000000000.meta").read_bytes()
    msgs = list(iter_messages(seg, 0))
    assert sorted(m.offset for m in msgs) == sorted(o for _m, _p, o in results)
    assert_logs_clean(broker.config.data_dir)


# --------------------------------------------------------------------------- bad puts

def test_put_errors_write_nothing(broker, client):
    payload = b"payload"
    before = broker.offsets("t", 0)
    r = client.call(encode_put("t", 0, payload, 0, checksum(payload) ^ 1, 1))
    assert (r.code, r.body, r.opaque) == (400, b"checksum mismatch", 1)
    r = client.call(encode_put("nope", 0, payload, 0, checksum(payload), 2))
    assert r.code == 404 and r.opaque == 2
    r = client.call(encode_put("t", 9, payload, 0, checksum(payload), 3))
    assert r.code == 404
    r = client.call(encode_put("t", -2, payload, 0, checksum(payload), 4))
    assert r.code == 400 and b"partition" in r.body
    r = client.call(encode_put("t", 0, payload, 0, checksum(payload), 5, tx_key="tx-1"))
    assert r.code == 400 and b"bad transaction key" in r.body
    r = client.call(encode_put("t", 0, payload, 0, checksum(payload), 5, tx_key="TX:s:9"))
    assert r.code == 500 and b"has not been started" in r.body
    assert broker.offsets("t", 0) == before
    assert client.put("t", 0, b"ok", opaque=6).code == 200


def test_oversize_put_is_refused_and_skipped(tmp_path):
    with Broker(make_config(tmp_path, max_message_size=1000)) as broker:
        c = RawClient(broker.port)
        big = os.urandom(5000)
        c.send(encode_put("t", 0, big, 0, checksum(big), 1) + encode_version(2))
        r1, r2 = c.replies(2)
        assert r1.code == 400 and b"over the limit 1000" in r1.body and r1.opaque == 1
        assert r2 == Result(200, r2.body, 2)
        assert broker.offsets("t", 0) == (0, 0)
        assert c.put("t", 0, os.urandom(1000)).code == 200
        c.close()


@pytest.mark.parametrize("data, what", [
    (b"hello world\r\n", b"unknown command"),
    (b"get t g 0 0\r\n", b"expected 'get"),
    (b"get t g zero 0 100 5\r\n", b"partition b'zero' is not an integer"),
    (b"get t\xff g 0 0 100 5\r\n", b"not valid UTF-8"),
    (b"put t\xff 0 1 0 0 5\r\nx", b"not valid UTF-8"),
    (b"get a/b g 0 0 100 5\r\n", b"bad topic 'a/b'"),
    (b"\r\n", b"unknown command"),
    (b"version 99999999999\r\n", b"out of range"),
    (b"stats a b c d\r\n", b"opaque b'b' is not an integer"),
    (b"sync t 0 3 0 x 7\r\nxyz", b"bad sync line"),
])
def test_bad_lines_get_400_and_the_connection_goes_on(broker, client, data, what):
    other = RawClient(broker.port)
    r = client.call(data)
    assert r.code == 400 and what in r.body, r
    assert client.call(encode_version(42)).opaque == 42
    assert client.put("t", 0, b"still fine").code == 200
    assert other.call(encode_version(1)).code == 200
    other.close()
    assert_logs_clean(broker.config.data_dir)


@pytest.mark.parametrize("data, what", [
    (b"put t 0 -5 0 0 1\r\n", b"length -5 is out of range"),
    (b"put t 0 many 0 0 1\r\nxxxx", b"length b'many' is not an integer"),
    (b"put t 0 4 0\r\nxxxx", b"expected 'put"),
    (b"sync t 0 4 0 1\r\nxxxx", b"bad sync line"),
    (b"x" * 10_000, b"no CRLF within 8192 bytes"),
    (b"get " + b"t" * 9000 + b" g 0 0 1 1\r\n", b"no CRLF within 8192 bytes"),
])
def test_unrecoverable_input_closes_only_that_connection(broker, client, data, what):
    other = RawClient(broker.port)
    assert other.put("t", 0, b"before").code == 200
    client.send(encode_version(1) + data + encode_version(2))
    replies = client.rest_until_closed()
    assert replies[0] == Result(200, replies[0].body, 1)
    assert len(replies) == 2 and replies[1].code == 400 and what in replies[1].body
    assert other.put("t", 0, b"after").code == 200
    assert RawClient(broker.port).call(encode_version(3)).opaque == 3
    other.close()
    assert_logs_clean(broker.config.data_dir)


def test_lying_length_cannot_corrupt_the_log(broker, client):
    # the length says 50 but 10 bytes follow, then a valid put: its bytes become the payload
    good = b"real message"
    lie = b"put t 0 50 0 12345 1\r\n0123456789"
    client.send(lie + encode_put("t", 0, good, 0, checksum(good), 2) + b"\r\n" * 20)
    client.send(encode_version(3))
    got = client.replies(1)
    assert got[0].code == 400 and got[0].opaque == 1  # checksum mismatch: nothing written
    assert broker.offsets("t", 0) == (0, 0)
    assert_logs_clean(broker.config.data_dir)


def test_client_vanishing_mid_stream_is_harmless(broker):
    for _ in range(20):
        c = RawClient(broker.port)
        payload = os.urandom(200_000)
        c.send(encode_put("t", 0, payload, 0, checksum(payload), 1)[:100_000])
        c.close()
        c = RawClient(broker.port)
        c.send(encode_get("t", "g", 0, 0, 1 << 20, 1))
        c.close()
    assert RawClient(broker.port).call(encode_version(1)).code == 200
    assert broker.offsets("t", 0) == (0, 0)


def stat(broker: Broker, name: str) -> int:
    for line in broker.stats().splitlines():
        if line.startswith(f"STAT {name} "):
            return int(line.split()[2])
    raise KeyError(name)


@pytest.mark.parametrize("get_size", [1 << 20, 60_000])  # sendfile and copied replies
def test_reader_that_never_reads_costs_bounded_memory(tmp_path, get_size):
    cfg = make_config(tmp_path, max_inflight_requests=2000, max_pending_bytes=1 << 20)
    with Broker(cfg) as broker:
        c = RawClient(broker.port)
        assert c.put("t", 0, os.urandom(200_000)).code == 200
        lazy = RawClient(broker.port)
        lazy.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        lazy.sock.settimeout(0.5)
        req = encode_get("t", "g", 0, 0, get_size, 1) * 1000
        sent = 0
        try:
            while sent < 2_000_000:  # the broker stops reading long before this
                lazy.sock.sendall(req)
                sent += 1000
        except TimeoutError:
            pass
        assert sent < 2_000_000, "the broker kept reading from a client that never reads"
        # everything still answered for others, and the lazy one holds little memory
        for i in range(20):
            assert c.call(encode_version(i)).opaque == i
        assert stat(broker, "unsent_reply_bytes") < 6 * (1 << 20)
        assert stat(broker, "queued_replies") < 2000 + 300_000 // 30  # limit + one read
        lazy.close()
        wait_until(lambda: stat(broker, "curr_connections") == 1, 10, what="lazy one gone")
        assert stat(broker, "queued_replies") == 0
        assert c.call(encode_version(99)).opaque == 99
        c.close()


def test_disk_full_answers_500_and_keeps_the_log_whole(broker, client, monkeypatch, caplog):
    import errno

    import metaq.broker._segment as segmod
    assert client.put("t", 0, b"first").code == 200
    real = os.pwrite

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segmod.os, "pwrite", enospc)
    payloads = [b"lost-%d" % i for i in range(5)]
    client.send(b"".join(encode_put("t", 0, p, 0, checksum(p), i) for i, p in enumerate(payloads)))
    got = client.replies(5)
    monkeypatch.setattr(segmod.os, "pwrite", real)
    assert [(r.code, r.opaque) for r in got] == [(500, i) for i in range(5)]
    assert b"No space left" in got[0].body
    assert client.put("t", 0, b"second").code == 200
    v = client.call(encode_get("t", "g", 0, 0, 1000, 1))
    assert [m.payload for m in iter_messages(v.body, 0)] == [b"first", b"second"]
    assert "put failed" in caplog.text
    caplog.clear()  # the error logged above is expected


# --------------------------------------------------------------------------- modes

def test_group_commit_acks_only_synced_messages(tmp_path):
    cfg = make_config(tmp_path, unflush_threshold=0)
    assert cfg.group_commit
    with Broker(cfg) as broker:
        clients = [RawClient(broker.port) for _ in range(4)]
        for k, c in enumerate(clients):
            c.send(b"".join(encode_put("t", k % 2, b"m%03d" % i, 0, checksum(b"m%03d" % i), i)
                            for i in range(200)))
        for c in clients:
            assert all(r.code == 200 for r in c.replies(200))
        total = sum(broker.offsets("t", p)[1] for p in (0, 1))
        assert total == 800 * 24
        v = clients[0].call(encode_get("t", "g", 0, 0, 1 << 20, 1))
        assert len(list(iter_messages(v.body, 0))) == 400
        for c in clients:
            c.close()
    with Broker(cfg) as broker:
        assert sum(broker.offsets("t", p)[1] for p in (0, 1)) == 800 * 24


def test_auto_create_and_add_topic(tmp_path):
    with Broker(make_config(tmp_path, auto_create_topics=True, num_partitions=3)) as broker:
        c = RawClient(broker.port)
        r = c.put("fresh", 2, b"x")
        assert r.code == 200 and parse_put_result(r.body)[1] == 2
        assert broker.topics["fresh"] == 3
        assert (broker.config.data_dir / "fresh-2").is_dir()
        broker.add_topic("later", 2)
        assert c.put("later", 1, b"y").code == 200
        r = c.call(b"put bad,name 0 1 0 %d 1\r\nx" % checksum(b"x"))
        assert r.code == 400 and b"must not contain ','" in r.body
        assert "bad,name" not in broker.topics
        c.close()
    with Broker(make_config(tmp_path)) as broker:
        c = RawClient(broker.port)
        assert c.put("brand-new", 0, b"x").code == 404  # auto-create is off by default
        with pytest.raises(metaq.ConfigError, match="topic"):
            broker.add_topic("bad/name", 1)
        c.close()


def test_broker_restart_keeps_data_and_ids_increase(tmp_path):
    cfg = make_config(tmp_path)
    with Broker(cfg) as broker:
        c = RawClient(broker.port)
        first = parse_put_result(c.put("t", 0, b"one").body)
        c.close()
    with Broker(cfg) as broker:
        c = RawClient(broker.port)
        second = parse_put_result(c.put("t", 0, b"two").body)
        v = c.call(encode_get("t", "g", 0, 0, 1000, 1))
        assert [split_payload(m.payload, m.flag)[1] for m in iter_messages(v.body, 0)] == \
            [b"one", b"two"]
        c.close()
    assert second[0] > first[0] and second[2] == 23


def test_second_broker_on_same_data_dir_fails_cleanly(tmp_path):
    with Broker(make_config(tmp_path)), pytest.raises(metaq.StorageError, match="in use"):
        Broker(make_config(tmp_path, broker_id=4)).start()


@pytest.mark.parametrize("field, value", [
    ("broker_id", 1024), ("port", 70000), ("max_segment_size", 10), ("unflush_threshold", -1),
    ("unflush_interval", 0), ("retention_hours", -1), ("topics", {"a b": 1}),
    ("topics", {"t": 0}), ("max_transfer_size", True), ("zk_root", "a//b"),
])
def test_config_validation_names_the_field(tmp_path, field, value):
    kw = {"broker_id": 1, "data_dir": tmp_path, field: value}
    with pytest.raises(metaq.ConfigError, match=field):
        BrokerConfig(**kw)


def test_brokers_embedded_in_one_process_never_mix_their_reads(tmp_path):
    """Brokers in one process each run their loop in their own thread, and a socket read
    releases the GIL: every connection of every broker reading into one shared buffer let
    one broker's read overwrite another's bytes before they were copied out (a slave's
    get or a producer's put cut in two: ``unknown command``, a copy that never came).
    Each loop thread has its own buffer: here clients stream puts to two brokers at
    once, one put per write (a read each), and every reply is a success and every log
    holds exactly the payloads sent to it."""
    per_client, clients = 1000, 3
    with Broker(make_config(tmp_path / "a", broker_id=1)) as a, \
            Broker(make_config(tmp_path / "b", broker_id=2)) as b:
        failures: list = []
        sent: dict[int, list[bytes]] = {a.port: [], b.port: []}
        lock = threading.Lock()
        start = threading.Barrier(2 * clients)

        def produce(port: int, k: int) -> None:
            try:
                c = RawClient(port)
                payloads = [b"%d:%d:%d:" % (port, k, i) + bytes([97 + i % 26]) * (i % 300)
                            for i in range(per_client)]
                start.wait(10)
                try:
                    for i, p in enumerate(payloads):  # one put per write: one read each
                        c.send(encode_put("t", 0, p, 0, checksum(p), i + 1))
                    replies = c.replies(per_client)
                finally:
                    c.close()
            except Exception as e:  # noqa: BLE001 - reported by the test below
                with lock:
                    failures.append(e)
                return
            with lock:
                failures.extend(r for r in replies if r.code != 200)
                sent[port].extend(payloads)

        threads = [threading.Thread(target=produce, args=(port, k), name=f"prod-{port}-{k}")
                   for k in range(clients) for port in (a.port, b.port)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads)
        assert not failures, failures[:3]
        for broker in (a, b):
            seg = (broker.config.data_dir / "t-0" / "00000000000000000000.meta").read_bytes()
            stored = sorted(bytes(m.payload) for m in iter_messages(seg, 0))
            assert stored == sorted(sent[broker.port])


def test_a_stopped_broker_leaves_no_client_connected(tmp_path):
    """Clients keep connecting while the broker stops: every connection the kernel
    accepted, the last ones included (accepted before the listening socket closed,
    made by the loop after), is closed by the stop; none is left open with nobody
    behind it, a client waiting on it until its own timeout."""
    broker = Broker(make_config(tmp_path)).start()
    opened: list[socket.socket] = []
    stop = threading.Event()

    def connect() -> None:
        while not stop.is_set():
            try:
                s = socket.create_connection(("127.0.0.1", broker.port), timeout=2)
            except OSError:
                continue  # refused once the listening socket is closed
            opened.append(s)

    t = threading.Thread(target=connect, name="connector")
    t.start()
    try:
        wait_until(lambda: len(opened) >= 50, 10, what="clients connected")
        broker.stop()
    finally:
        stop.set()
        t.join(10)

    def closed(s: socket.socket) -> bool:
        try:
            return s.recv(1) == b""
        except TimeoutError:
            return False
        except OSError:
            return True  # reset

    for s in opened:
        s.settimeout(0.05)
    try:
        wait_until(lambda: all(closed(s) for s in opened), 10,
                   what="every connection closed by the stopped broker")
    finally:
        for s in opened:
            s.close()
