"""The broker's time index (``offset ... time=<ms>``, ``_timeindex``): its files beside
sealed segments, what happens when they are missing or damaged, the writable
segment after a crash, msgId times that never go back across restarts, retention."""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq.broker import Broker, BrokerConfig, Storage
from metaq.broker import _timeindex as timeindex
from metaq.net import BrokerConnection, offset_for_time
from metaq.protocol import (
    MSG_ID_EPOCH_MS,
    MsgIdGenerator,
    ReplyParser,
    checksum,
    encode_message,
    encode_put,
    iter_messages,
    msg_id_parts,
    parse_put_result,
)
from metaq.testing import free_port

pytestmark = pytest.mark.broker

TOPIC = "ti"
SEG = 8192
T0 = 1_700_000_000_000


def msg_id(t: int, i: int) -> int:
    return ((t - MSG_ID_EPOCH_MS) << 22) | (i & 0xFFF)


def write(data_dir: Path, times: list[int], first: int = 0) -> list[int]:
    """Append one message per time (payloads of varied size); their offsets."""
    rnd = random.Random(len(times) + first)
    out = []
    with Storage(data_dir, max_segment_size=SEG) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        for i, t in enumerate(times, first):
            out.append(plog.append(encode_message(msg_id(t, i), 0, rnd.randbytes(
                rnd.randrange(0, 300))), 1))
    return out


def part_dir(data_dir: Path) -> Path:
    return data_dir / f"{TOPIC}-0"


def index_files(data_dir: Path) -> list[Path]:
    return sorted(part_dir(data_dir).glob("*.meta" + timeindex.SUFFIX))


def broker(data_dir: Path, **kw) -> Broker:
    return Broker(BrokerConfig(broker_id=3, data_dir=data_dir, port=free_port(),
                               topics={TOPIC: 1}, max_segment_size=SEG, **kw))


def check_all(conn: BrokerConnection, times: list[int], offsets: list[int], end: int) -> None:
    """Every time of the log, and the times between and around them, against a scan."""
    probes = sorted({T0 - 1, times[-1] + 1, *times, *(t + 1 for t in times[::7])})
    for when in probes:
        want = next((o for t, o in zip(times, offsets, strict=True) if t >= when), end)
        got, t = conn.offset_for_time(TOPIC, "g", 0, when)
        assert got == want, when - T0
        assert t == (None if want == end else times[offsets.index(want)])


def end_of(data_dir: Path) -> int:
    with Storage(data_dir, max_segment_size=SEG) as storage:
        return storage.open_topic(TOPIC, 1)[0].end


def test_sealed_segments_get_an_index_file_used_after_a_restart(tmp_path):
    times = [T0 + i // 3 for i in range(1500)]
    offsets = write(tmp_path, times)
    segments = sorted(part_dir(tmp_path).glob("*.meta"))
    files = index_files(tmp_path)
    assert len(segments) > 5 and len(files) == len(segments) - 1  # not the writable one
    with Storage(tmp_path, max_segment_size=SEG) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        assert all(s.tindex is not None and not s.tindex.dirty for s in plog.segments[:-1])
        assert storage.last_time == times[-1]
        mtimes = [f.stat().st_mtime_ns for f in files]
    end = end_of(tmp_path)
    with broker(tmp_path) as b, BrokerConnection("127.0.0.1", b.port) as conn:
        assert "+timeindex" in conn.version().split()
        check_all(conn, times, offsets, end)
    assert [f.stat().st_mtime_ns for f in files] == mtimes  # used, not rewritten


def check_all_end(tmp_path: Path, times: list[int], offsets: list[int], **kw) -> None:
    end = end_of(tmp_path)
    with broker(tmp_path, **kw) as b, BrokerConnection("127.0.0.1", b.port) as conn:
        check_all(conn, times, offsets, end)
        assert "cmd_offset_time" in conn.stats()


def damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "flipped":
        data[len(data) // 2] ^= 0x40
    elif how == "garbage":
        data = bytearray(random.Random(1).randbytes(len(data)))
    elif how == "empty":
        data = bytearray()
    elif how == "other-segment":  # a valid file, for another segment
        other = sorted(path.parent.glob("*" + timeindex.SUFFIX))
        data = bytearray((other[0] if other[0] != path else other[1]).read_bytes())
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped", "garbage", "empty",
                                 "other-segment"])
def test_a_missing_or_bad_index_file_is_rebuilt_never_trusted(tmp_path, how, caplog):
    times = [T0 + i // 2 for i in range(1200)]
    offsets = write(tmp_path, times)
    victim = index_files(tmp_path)[2]
    if how == "missing":
        victim.unlink()
    else:
        damage(victim, how)
    caplog.set_level(logging.WARNING, logger="metaq.broker._timeindex")
    check_all_end(tmp_path, times, offsets)
    if how not in ("missing", "empty"):
        assert f"ignoring the time index {victim}" in caplog.text
    elif how == "empty":
        assert "too short for a time index" in caplog.text
    assert victim.exists()  # written again by the rebuild
    with Storage(tmp_path, max_segment_size=SEG) as storage:
        seg = next(s for s in storage.open_topic(TOPIC, 1)[0].segments
                   if timeindex.path_for(s.path) == victim)
        assert seg.tindex is not None and seg.tindex.offsets  # loads cleanly now


def test_the_writable_segment_after_a_crash_and_a_torn_tail(tmp_path):
    times = [T0 + i for i in range(700)]
    offsets = write(tmp_path, times)
    last = sorted(part_dir(tmp_path).glob("*.meta"))[-1]
    with open(last, "ab") as f:  # a torn write: half a message
        f.write(encode_message(msg_id(T0 + 5000, 1), 0, b"x" * 200)[:100])
    check_all_end(tmp_path, times, offsets)


def test_a_damaged_message_in_a_sealed_segment_found_by_the_rebuild(tmp_path):
    times = [T0 + i for i in range(900)]
    offsets = write(tmp_path, times)
    k = next(i for i in range(400, 900) if offsets[i + 1] - offsets[i] >= 30)
    seg_start = max(int(p.name[:20]) for p in part_dir(tmp_path).glob("*.meta")
                    if int(p.name[:20]) <= offsets[k])
    path = part_dir(tmp_path) / f"{seg_start:020d}.meta"
    timeindex.path_for(path).unlink()  # rebuilt by a checked scan that meets the damage
    with open(path, "r+b") as f:
        f.seek(offsets[k] - seg_start + 8)
        f.write(b"\x00\x00\x00\x00")  # the msgId: its checksum still matches...
        f.seek(offsets[k] - seg_start + 24)
        f.write(b"\xde\xad")  # ...but not the payload's
    valid = [(t, o) for i, (t, o) in enumerate(zip(times, offsets, strict=True)) if i != k]
    check_all_end(tmp_path, [t for t, _ in valid], [o for _, o in valid])


def put(port: int, n: int, partition: int = 0) -> list[int]:
    """``n`` puts through the wire; the msgIds the broker gave them."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        payload = b"p" * 50
        s.sendall(b"".join(encode_put(TOPIC, partition, payload, 0, checksum(payload), i)
                           for i in range(n)))
        parser, got = ReplyParser(), []
        while len(got) < n:
            got += parser.feed(s.recv(65536))
    return [parse_put_result(r.body)[0] for r in got]


def test_msgid_times_never_go_back_across_restarts(tmp_path):
    """The logs hold messages an hour ahead of the clock (a clock set back since): the
    broker's new msgIds continue after them, so the partition's times stay in order
    and the index stays exact."""
    ahead = int(time.time() * 1000) + 3_600_000
    times = [ahead + i for i in range(300)]
    write(tmp_path, times, first=0)
    last_id = msg_id(times[-1], 299)
    with broker(tmp_path) as b:
        ids = put(b.port, 200)
    assert ids == sorted(ids) and ids[0] > last_id
    new_times = [msg_id_parts(i)[0] for i in ids]
    assert min(new_times) >= times[-1]
    with Storage(tmp_path, max_segment_size=SEG) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        got = [m.msg_id for seg in plog.segments
               for m in iter_messages(seg.pread(seg.start, seg.size))]
    assert got == sorted(got) and len(set(got)) == len(got) == 500
    all_times = [msg_id_parts(i)[0] for i in got]
    with broker(tmp_path) as b, BrokerConnection("127.0.0.1", b.port) as conn:
        for when in (times[0], times[-1], times[-1] + 1, all_times[-1], all_times[-1] + 1):
            r = offset_for_time(conn, TOPIC, 0, when, use_index=True)
            s = offset_for_time(conn, TOPIC, 0, when, use_index=False)
            assert (r.offset, r.msg_time_ms) == (s.offset, s.msg_time_ms)


def test_generator_continue_after():
    g = MsgIdGenerator(5)
    now = int(time.time() * 1000)
    before = g.next_id()
    assert g.continue_after(None) == 0
    assert g.continue_after(now - 10_000) == 0  # behind the last id: nothing changes
    assert g.next_id() > before
    far = now + 60_000
    assert 59_000 < g.continue_after(far) <= 60_000
    ids = g.next_ids(5000)
    assert ids == sorted(set(ids)) and msg_id_parts(ids[0])[0] == far + 1
    assert msg_id_parts(ids[0])[1] == 5


def test_retention_deletes_the_index_file_with_its_segment(tmp_path):
    write(tmp_path, [T0 + i for i in range(600)])
    with Storage(tmp_path, max_segment_size=SEG) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        first = plog.segments[0].path
        assert timeindex.path_for(first).exists()
        old = time.time() - 10 * 3600
        os.utime(first, (old, old))
        assert storage.delete_expired(3600) == [first]
        assert not timeindex.path_for(first).exists()
        when, _t = plog.offset_for_time(T0)  # the log now starts later
        assert when == plog.min_offset


def test_the_index_can_be_turned_off(tmp_path):
    times = [T0 + i for i in range(100)]
    offsets = write(tmp_path, times)
    with broker(tmp_path, time_index=False) as b, BrokerConnection("127.0.0.1", b.port) as c:
        assert "+timeindex" not in c.version().split()
        r = offset_for_time(c, TOPIC, 0, T0 + 50)
        assert r.offset == offsets[50] and r.probes > 0


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 1 << 40), st.integers(0, 1 << 20))
def test_index_file_parser_never_raises(data, start, size):
    got = timeindex.decode(data, start, size)
    assert isinstance(got, (str, timeindex.TimeIndex))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 5000), st.integers(-20, 50)), min_size=1, max_size=60),
       st.integers(0, 1 << 30), st.one_of(st.none(), st.integers(0, 1 << 50)))
def test_index_file_round_trip(steps, start, last):
    ti = timeindex.TimeIndex()
    off, t = start, T0
    for step, dt in steps:
        ti.add(off, t)  # times that go back are kept at the greatest so far
        off += step
        t += dt
    assert ti.times == sorted(ti.times)
    ti.last_time = last
    size = off - start
    data = timeindex.encode(ti, start, size)
    back = timeindex.decode(data, start, size)
    assert isinstance(back, timeindex.TimeIndex)
    assert (back.offsets, back.times, back.last_time) == (ti.offsets, ti.times, last)
    assert "written for a segment at" in timeindex.decode(data, start + 1, size)
    assert "written for a segment at" in timeindex.decode(data, start, size + 1)
    flipped = bytearray(data)
    flipped[-5] ^= 1
    assert "checksum" in timeindex.decode(bytes(flipped), start, size)
