"""offset_for_time: the offset for a time, against a real (in-process) broker serving
logs written with chosen msgIds, compared with a brute-force scan; both ways: the
client's search (``use_index=False``, as against a Java broker) and the broker's
time index (``use_index=True``, one round trip)."""

from __future__ import annotations

import math
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metaq import BrokerError
from metaq.broker import Broker, BrokerConfig, Storage
from metaq.net import BrokerConnection, TimeSeek, offset_for_time
from metaq.protocol import MSG_ID_EPOCH_MS, encode_message
from metaq.testing import free_port

pytestmark = pytest.mark.broker

TOPIC = "ts"
T0 = 1_700_000_000_000  # a wall-clock ms


def msg_id(t: int, i: int) -> int:
    return ((t - MSG_ID_EPOCH_MS) << 22) | (i & 0xFFF)


def write_log(data_dir: Path, msgs: Sequence[tuple[int, int]], seg: int) -> list[int]:
    """Append a message of ``size`` payload bytes and time ``t`` for each ``(t, size)``;
    return their offsets followed by the log end."""
    rnd = random.Random(len(msgs))
    offsets = []
    with Storage(data_dir, max_segment_size=seg) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        for i, (t, size) in enumerate(msgs):
            offsets.append(plog.append(encode_message(msg_id(t, i), 0, rnd.randbytes(size)), 1))
        offsets.append(plog.end)
    return offsets


@contextmanager
def serve(data_dir: Path, seg: int) -> Iterator[BrokerConnection]:
    cfg = BrokerConfig(broker_id=0, data_dir=data_dir, port=free_port(), topics={TOPIC: 1},
                       max_segment_size=seg)
    with Broker(cfg) as b, BrokerConnection("127.0.0.1", b.port) as conn:
        yield conn


def brute(times: Sequence[int | None], offsets: Sequence[int], when: int) -> int:
    """The first valid message (time not None) at or after ``when``, else the end."""
    for t, off in zip(times, offsets, strict=False):
        if t is not None and t >= when:
            return off
    return offsets[-1]


def bound(size: int, probe: int) -> int:
    """The round trips a clean search may take (module docstring of _timeseek)."""
    return 2 + 2 * (math.ceil(math.log2(max(size / probe, 1))) + 1) + 3


def seek(conn, when: int, probe: int, index: bool = False) -> TimeSeek:
    return offset_for_time(conn, TOPIC, 0, when, probe_size=probe, use_index=index)


both = pytest.mark.parametrize("index", [False, True], ids=["search", "index"])


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(gaps=st.lists(st.integers(0, 3), min_size=1, max_size=400),
       sizes=st.lists(st.integers(0, 700), min_size=400, max_size=400),
       probe=st.sampled_from([256, 1024, 4096]),
       picks=st.lists(st.integers(0, 10_000), min_size=6, max_size=6),
       index=st.booleans())
def test_agrees_with_a_brute_force_scan(gaps, sizes, probe, picks, index):
    times = []
    t = T0
    for g in gaps:
        t += g
        times.append(t)
    msgs = list(zip(times, sizes, strict=False))
    with tempfile.TemporaryDirectory() as d:
        offsets = write_log(Path(d), msgs, 4096)
        assert len(os.listdir(Path(d) / f"{TOPIC}-0")) > 1 or offsets[-1] < 4096
        whens = [T0 - 5, times[0], times[-1], times[-1] + 1]
        whens += [times[p % len(times)] + (p % 3) - 1 for p in picks]
        with serve(Path(d), 4096) as conn:
            for when in whens:
                r = seek(conn, when, probe, index)
                want = brute(times, offsets, when)
                assert r.offset == want, (when, r)
                k = offsets.index(want)
                assert r.msg_time_ms == (times[k] if k < len(times) else None)
                if index:
                    assert r.round_trips == 1 and r.probes == 0
                    continue
                # messages bigger than the probe add a get each where the search meets
                # one: at most one per probe and two in the final walk (module docstring)
                big = r.probes + 2 if max(sizes[:len(times)], default=0) + 20 > probe else 0
                assert r.round_trips <= bound(offsets[-1], probe) + big, r


def test_a_big_log_takes_logarithmic_round_trips(tmp_path):
    n = 20_000
    times = [T0 + i // 7 for i in range(n)]
    offsets = write_log(tmp_path, [(t, 80) for t in times], 64 * 1024)
    with serve(tmp_path, 64 * 1024) as conn:
        for when in (T0 - 1, T0 + 1, T0 + 1234, T0 + 2857, T0 + 99_999, times[-1]):
            r = seek(conn, when, 1024)
            assert r.offset == brute(times, offsets, when)
            assert r.round_trips <= bound(offsets[-1], 1024), r
            assert r.round_trips <= 2 * math.log2(offsets[-1] / 1024) + 6


def test_an_empty_partition_gives_its_end(tmp_path):
    write_log(tmp_path, [], 4096)
    with serve(tmp_path, 4096) as conn:
        assert seek(conn, T0, 1024) == TimeSeek(0, None, 2, 0)
        assert seek(conn, T0, 1024, True) == TimeSeek(0, None, 1, 0)


def test_the_index_is_used_when_offered(tmp_path):
    times = [T0 + i for i in range(500)]
    offsets = write_log(tmp_path, [(t, 100) for t in times], 4096)
    with serve(tmp_path, 4096) as conn:
        r = offset_for_time(conn, TOPIC, 0, T0 + 250)  # asks version, then the index
        assert (r.offset, r.msg_time_ms, r.round_trips, r.probes) == (
            offsets[250], T0 + 250, 2, 0)
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path, port=free_port(), topics={TOPIC: 1},
                       max_segment_size=4096, time_index=False)
    with Broker(cfg) as b, BrokerConnection("127.0.0.1", b.port) as conn:
        assert "+timeindex" not in conn.version().split()
        r = offset_for_time(conn, TOPIC, 0, T0 + 250)  # falls back to the search
        assert r.offset == offsets[250] and r.probes > 0
        with pytest.raises(BrokerError, match="does not offer the time index"):
            offset_for_time(conn, TOPIC, 0, T0 + 250, use_index=True)


@both
def test_messages_bigger_than_the_probe(tmp_path, index):
    sizes = [30, 5000, 40, 20_000, 10, 9000, 9000, 50, 3000] * 5
    times = [T0 + i for i in range(len(sizes))]
    offsets = write_log(tmp_path, list(zip(times, sizes, strict=True)), 4096)
    with serve(tmp_path, 4096) as conn:
        for when in [T0 - 1, *times, times[-1] + 1]:
            r = seek(conn, when, 256, index)
            assert r.offset == brute(times, offsets, when), when
            assert r.round_trips <= bound(offsets[-1], 256) + 4, r


def transitions(times: Sequence[int], offsets: Sequence[int], when: int) -> set[int]:
    """Every defensible answer for out-of-order times: a message at or after ``when``
    whose predecessor is before it (or the first message); the end when the last is
    before it."""
    out = {offsets[k] for k in range(len(times))
           if times[k] >= when and (k == 0 or times[k - 1] < when)}
    if times[-1] < when:
        out.add(offsets[-1])
    return out


@both
def test_times_out_of_order_give_a_transition(tmp_path, index):
    # a broker restarted with its clock 500 ms back: 1000..1999, then 1500..2499
    run_a = [T0 + 1000 + i // 2 for i in range(2000)]
    run_b = [T0 + 1500 + i // 2 for i in range(2000)]
    times = run_a + run_b
    rnd = random.Random(7)
    offsets = write_log(tmp_path, [(t, rnd.randrange(0, 200)) for t in times], 8192)
    with serve(tmp_path, 8192) as conn:
        for when in range(T0 + 900, T0 + 2600, 37):
            r = seek(conn, when, 512, index)
            ok = transitions(times, offsets, when)
            assert r.offset in ok, (when - T0, r)
            if len(ok) == 1:  # no overlap with the set-back run: the one answer
                assert r.offset == brute(times, offsets, when)
        # before the overlap the answer is in the first run, after it in the second
        assert seek(conn, T0 + 1200, 512, index).offset == brute(times, offsets, T0 + 1200)
        r = seek(conn, T0 + 2200, 512, index)
        assert r.offset == brute(times[2000:], offsets[2000:], T0 + 2200)


@both
def test_a_damaged_message_is_skipped(tmp_path, index):
    times = [T0 + i for i in range(600)]
    offsets = write_log(tmp_path, [(t, 100) for t in times], 4096)
    bad = 100  # in the fourth segment of many: a sealed one, not checked at start
    seg_dir = tmp_path / f"{TOPIC}-0"
    names = sorted(n for n in os.listdir(seg_dir) if n.endswith(".meta"))
    starts = [int(n[:20]) for n in names]
    seg_start = max(s for s in starts if s <= offsets[bad])
    assert seg_start > 0 and seg_start != starts[-1]
    path = seg_dir / names[starts.index(seg_start)]
    with open(path, "r+b") as f:
        f.seek(offsets[bad] - seg_start + 40)
        f.write(b"\xff\xfe\xfd\xfc")  # payload bytes: its CRC no longer matches
    valid: list[int | None] = list(times)
    valid[bad] = None
    with serve(tmp_path, 4096) as conn:
        for when in [times[bad] - 1, times[bad], times[bad] + 1, T0 - 1, T0 + 300]:
            for probe in (128, 1024):
                r = seek(conn, when, probe, index)
                assert r.offset == brute(valid, offsets, when), (when - T0, probe, r)


class CoarseOffsets:
    """A connection whose ``offset`` answers only segment starts, as a Java Metaq
    broker may (the start of the segment holding the offset)."""

    def __init__(self, conn: BrokerConnection, starts: list[int]) -> None:
        self.conn, self.starts = conn, starts
        self.get = conn.get

    def offset(self, topic, group, partition, offset):
        exact = self.conn.offset(topic, group, partition, offset)
        if offset <= 0 or exact >= self.conn.offset(topic, group, partition, 1 << 62):
            return exact
        return max(s for s in self.starts if s <= offset)


def test_a_broker_answering_coarse_offsets(tmp_path):
    rnd = random.Random(3)
    times = sorted(T0 + rnd.randrange(0, 5000) for _ in range(3000))
    offsets = write_log(tmp_path, [(t, rnd.randrange(0, 300)) for t in times], 64 * 1024)
    seg_dir = tmp_path / f"{TOPIC}-0"
    starts = sorted(int(n[:20]) for n in os.listdir(seg_dir) if n.endswith(".meta"))
    assert len(starts) > 3
    with serve(tmp_path, 64 * 1024) as conn:
        coarse = CoarseOffsets(conn, starts)
        for when in [T0 - 1, times[0], times[1500], times[-1], times[-1] + 1,
                     *(T0 + rnd.randrange(0, 5000) for _ in range(20))]:
            r = offset_for_time(coarse, TOPIC, 0, when, probe_size=1024, use_index=False)
            assert r.offset == brute(times, offsets, when), when - T0
