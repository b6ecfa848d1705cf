"""The broker's side of the idempotent producer, over real sockets and real files:
the ``idem`` mark, a resent put answered with its original place and stored once,
a gap refused, the table surviving a restart and a torn journal, plain puts
unchanged, the ``producers`` command and the replication reads."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.raw_client import RawClient

from metaq.broker import Broker, BrokerConfig
from metaq.protocol import (
    GAP_CODE,
    IDEMPOTENT_CAPABILITY,
    RECORD_SIZE,
    TOO_OLD_CODE,
    checksum,
    decode_producer_records,
    encode_idem_mark,
    encode_producer_records,
    encode_producers,
    encode_put,
    encode_version,
    iter_messages,
    parse_put_result,
)

pytestmark = pytest.mark.broker


def _config(tmp_path: Path, **kw) -> BrokerConfig:
    kw.setdefault("topics", {"t": 2})
    return BrokerConfig(broker_id=3, data_dir=tmp_path / "data", port=0, **kw)


def _log(tmp_path: Path, topic: str = "t", partition: int = 0) -> list:
    """Every message in the partition's files."""
    d = tmp_path / "data" / f"{topic}-{partition}"
    data = b"".join(p.read_bytes() for p in sorted(d.glob("*.meta")))
    return list(iter_messages(data))


def _ok(replies: list) -> list[tuple[int, int, int]]:
    assert all(r.code == 200 for r in replies), [(r.code, r.body) for r in replies]
    return [parse_put_result(r.body) for r in replies]


def test_version_lists_the_capability_unless_off(tmp_path: Path) -> None:
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        c.sock.sendall(encode_version(7))
        assert IDEMPOTENT_CAPABILITY in c.replies(1)[0].body.decode().split()
        c.close()
    with Broker(_config(tmp_path, idempotent=False)) as b:
        c = RawClient(b.port)
        c.sock.sendall(encode_version(7))
        assert IDEMPOTENT_CAPABILITY not in c.replies(1)[0].body.decode().split()
        c.close()


def test_a_resent_run_is_answered_with_the_original_places_and_stored_once(
        tmp_path: Path) -> None:
    bodies = [b"m%d" % i + b"x" * i for i in range(20)]
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        first = _ok(c.puts("t", 0, bodies, pid=42, seq=0))
        again = _ok(c.puts("t", 0, bodies, pid=42, seq=0, opaque=100))  # the whole run
        assert again == first
        middle = _ok(c.puts("t", 0, bodies[5:9], pid=42, seq=5))  # part of it, singly
        assert middle == first[5:9]
        # overlapping the end: the old part answered, the new part stored
        more = [b"n%d" % i for i in range(5)]
        over = _ok(c.puts("t", 0, bodies[18:] + more, pid=42, seq=18))
        assert over[:2] == first[18:]
        assert over[2][2] > first[-1][2]
        # another producer's seq 0 is its own
        other = _ok(c.puts("t", 0, [b"o"], pid=43, seq=0))
        assert other[0][2] > over[-1][2]
        c.close()
    stored = _log(tmp_path)
    assert [m.payload for m in stored] == bodies + more + [b"o"]
    assert [(m.msg_id, m.offset) for m in stored[:20]] == [(i, o) for i, _p, o in first]


def test_a_gap_is_refused_naming_pid_partition_expected_and_got(tmp_path: Path) -> None:
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        _ok(c.puts("t", 1, [b"a", b"b"], pid=9, seq=0))
        r = c.puts("t", 1, [b"d"], pid=9, seq=3)[0]
        assert r.code == GAP_CODE
        text = r.body.decode()
        assert "producer 9" in text and "t-1" in text and "expected seq 2" in text \
            and "got 3" in text
        _ok(c.puts("t", 1, [b"c"], pid=9, seq=2))
        _ok(c.puts("t", 1, [b"d"], pid=9, seq=3))  # the retry, once the gap is filled
        c.close()
    assert [m.payload for m in _log(tmp_path, partition=1)] == [b"a", b"b", b"c", b"d"]


def test_a_seq_older_than_the_window_is_refused_as_too_old(tmp_path: Path) -> None:
    with Broker(_config(tmp_path, producer_window=4)) as b:
        c = RawClient(b.port)
        for i in range(10):  # singles from two producers interleaved: nothing merges
            _ok(c.puts("t", 0, [b"p%d" % i], pid=1, seq=i))
            _ok(c.puts("t", 0, [b"q%d" % i], pid=2, seq=i))
        r = c.puts("t", 0, [b"p0"], pid=1, seq=0)[0]
        assert r.code == TOO_OLD_CODE and "producer 1" in r.body.decode()
        assert _ok(c.puts("t", 0, [b"p9"], pid=1, seq=9))  # recent: still answered
        c.close()
    assert len(_log(tmp_path)) == 20


def test_the_table_survives_a_restart_and_plain_puts_are_unchanged(tmp_path: Path) -> None:
    bodies = [b"r%d" % i for i in range(30)]
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        first = _ok(c.puts("t", 0, bodies[:10], pid=5, seq=0))
        first += _ok(c.puts("t", 0, [bodies[10]], pid=5, seq=10))
        plain = _ok(c.puts("t", 0, [b"java"]))  # a put line without a mark: as ever
        plain += _ok(c.puts("t", 0, [b"java"]))  # twice is twice
        c.close()
    assert (tmp_path / "data" / "t-0" / "producers.jnl").stat().st_size == 2 * RECORD_SIZE
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        assert _ok(c.puts("t", 0, bodies[:11], pid=5, seq=0)) == first
        r = c.puts("t", 0, [b"x"], pid=5, seq=12)[0]
        assert r.code == GAP_CODE and "expected seq 11" in r.body.decode()
        c.close()
    stored = _log(tmp_path)
    assert [m.payload for m in stored] == bodies[:11] + [b"java", b"java"]
    assert plain[0][2] != plain[1][2]


def test_records_past_the_log_end_are_dropped_on_open(tmp_path: Path) -> None:
    """A record journaled for messages that never reached the log (killed between the
    two writes, or the log's tail cut at recovery) is dropped; so is a torn record."""
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        _ok(c.puts("t", 0, [b"a", b"b"], pid=5, seq=0))
        c.close()
    jnl = tmp_path / "data" / "t-0" / "producers.jnl"
    good = jnl.read_bytes()
    (rec,), _ = decode_producer_records(good)
    ghost = rec._replace(seq=2, count=1, start=rec.end, end=rec.end + 21,
                         last_start=rec.end, first_id=rec.last_id + 1, last_id=rec.last_id + 1)
    jnl.write_bytes(good + encode_producer_records([ghost]) + b"torn")
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        # seq 2 was never stored: accepted, not answered as a duplicate of the ghost
        (r,) = _ok(c.puts("t", 0, [b"c"], pid=5, seq=2))
        assert r[2] == rec.end
        c.close()
    assert [m.payload for m in _log(tmp_path)] == [b"a", b"b", b"c"]
    records, used = decode_producer_records(jnl.read_bytes())
    assert used == jnl.stat().st_size and [x.seq for x in records] == [0, 2]


def test_producers_command_and_replication_reads(tmp_path: Path) -> None:
    other = tmp_path / "slave"
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        _ok(c.puts("t", 0, [b"a", b"b"], pid=5, seq=0))
        _ok(c.puts("t", 0, [b"c"], pid=6, seq=0))
        _ok(c.puts("t", 0, [b"d"], pid=5, seq=2))  # merges with pid 5's first run
        c.sock.sendall(encode_producers("t", 0, 0, 77))
        reply = c.replies(1)[0]
        assert reply.code == 200 and reply.opaque == 77
        records, used = decode_producer_records(reply.body)
        assert used == len(reply.body)
        assert [(r.pid, r.seq, r.count) for r in records] == [(5, 0, 2), (6, 0, 1), (5, 2, 1)]
        later = b.producer_records("t", 0, records[-1].start)
        assert later == [records[-1]]
        # a run that grows after a read comes again, whole, from the same offset
        end = records[-1].end
        _ok(c.puts("t", 0, [b"e"], pid=5, seq=3))  # merges with pid 5's last run
        (grown,) = b.producer_records("t", 0, end - 1)
        assert (grown.pid, grown.seq, grown.count, grown.start) == (5, records[-1].seq,
                                                                   records[-1].count + 1,
                                                                   records[-1].start)
        c.sock.sendall(encode_producers("nope", 0, 0, 78))
        assert c.replies(1)[0].code == 404
        c.close()
    records = records[:-1] + [grown]
    # a "slave": the same log bytes copied, the records applied
    (other / "t-0").mkdir(parents=True)
    for f in (tmp_path / "data" / "t-0").glob("*.meta"):
        (other / "t-0" / f.name).write_bytes(f.read_bytes())
    with Broker(BrokerConfig(broker_id=4, data_dir=other, port=0, topics={"t": 2})) as s:
        assert s.apply_producer_records("t", 0, records) == len(records)
        assert s.apply_producer_records("t", 0, records) == 0  # known
        c = RawClient(s.port)
        again = _ok(c.puts("t", 0, [b"a", b"b", b"d", b"e"], pid=5, seq=0))  # promoted
        assert [o for _i, _p, o in again] == [m.offset for m in _log(tmp_path)
                                               if m.payload in (b"a", b"b", b"d", b"e")]
        c.close()
    assert len(list(iter_messages(b"".join(
        p.read_bytes() for p in sorted((other / "t-0").glob("*.meta")))))) == 5


def test_group_commit_answers_resends_after_the_fsync(tmp_path: Path) -> None:
    with Broker(_config(tmp_path, unflush_threshold=0)) as b:
        c = RawClient(b.port)
        first = _ok(c.puts("t", 0, [b"g1", b"g2"], pid=8, seq=0))
        assert _ok(c.puts("t", 0, [b"g1", b"g2"], pid=8, seq=0)) == first
        c.close()
    assert len(_log(tmp_path)) == 2


def test_mark_split_across_reads_and_bad_marks(tmp_path: Path) -> None:
    with Broker(_config(tmp_path)) as b:
        c = RawClient(b.port)
        body = [b"s%d" % i for i in range(3)]
        data = encode_idem_mark(11, 0, 3) + b"".join(
            encode_put("t", 0, x, 0, checksum(x), k) for k, x in enumerate(body))
        cut = len(encode_idem_mark(11, 0, 3)) + len(encode_put("t", 0, body[0], 0,
                                                               checksum(body[0]), 0))
        c.sock.sendall(data[:cut])  # the mark and its first put: answered before the rest
        first = _ok(c.replies(1))
        c.sock.sendall(data[cut:])  # so these two come in another read
        first += _ok(c.replies(2))
        c.sock.sendall(data)
        assert _ok(c.replies(3)) == first
        # a malformed mark is refused with opaque 0 (never a put's) and the stream goes on
        c.sock.sendall(b"idem 1 x 3\r\n" + encode_put("t", 0, b"y", 0, checksum(b"y"), 9))
        bad, ok = c.replies(2)
        assert bad.code == 400 and bad.opaque == 0 and b"seq" in bad.body
        assert ok.code == 200 and ok.opaque == 9
        # the puts after a mark must name one partition
        c.sock.sendall(encode_idem_mark(12, 0, 2)
                       + encode_put("t", 0, b"z", 0, checksum(b"z"), 1)
                       + encode_put("t", 1, b"z", 0, checksum(b"z"), 2))
        assert [r.code for r in c.replies(2)] == [400, 400]
        c.close()
    assert [m.payload for m in _log(tmp_path)] == body + [b"y"]
