"""Time as a position (issue 16): a new group starting at a time, and seek_to_time.

The log is written straight into the broker's storage with chosen msgId times (as
tests/net/test_timeseek.py does), then served by a real broker registered in a
real ZooKeeper; the consumer finds the position by searching the log by time.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from metaq import ConfigError, ConsumerConfig, MessageConsumer
from metaq.broker import Storage
from metaq.protocol import MSG_ID_EPOCH_MS, encode_message
from metaq.testing import wait_until

TOPIC = "tt"
T0 = 1_700_000_000_000
N = 300  # messages, one ms apart: message i has time T0 + i


def _write(data_dir: Path) -> list[int]:
    rnd = random.Random(7)
    offsets = []
    with Storage(data_dir, max_segment_size=4096) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        for i in range(N):
            mid = ((T0 + i - MSG_ID_EPOCH_MS) << 22) | i
            offsets.append(plog.append(encode_message(mid, 0, b"m%03d" % i + rnd.randbytes(40)),
                                       1))
        offsets.append(plog.end)
    return offsets  # each message's offset, then the log end


@pytest.fixture
def broker(zk_connect: str, broker_factory, tmp_path: Path):
    offsets = _write(tmp_path / "b0")
    b = broker_factory({TOPIC: 1}, zk_connect=zk_connect, data_dir=tmp_path / "b0",
                       max_segment_size=4096)
    return b, offsets


def _consume(zk_connect: str, group: str, **kw):
    got: list[int] = []
    lock = threading.Lock()

    def listener(m) -> None:  # noqa: ANN001
        with lock:
            got.append(int(m.raw_body[1:4]))

    c = MessageConsumer(group, zk_connect, zk_session_timeout=10.0, commit_period=0.2, **kw)
    c.subscribe(TOPIC, listener)
    return c, got


@pytest.mark.parametrize("when, first", [
    (T0 + 120, 120),                               # a message's own time
    ("2023-11-14T22:13:20.150Z", 150),             # the same clock as ISO-8601 (T0 = ...:20Z)
    (T0 - 5_000, 0),                               # before everything: the log start
])
def test_a_new_group_starts_at_a_time(zk_connect, broker, when, first) -> None:
    c, got = _consume(zk_connect, "g-start", start_position=f"time:{when}")
    with c:
        c.start()
        wait_until(lambda: len(got) >= N - first, 30, what="every message from the time on")
        assert got == list(range(first, N))


def test_a_time_after_the_last_message_starts_at_the_end(zk_connect, broker) -> None:
    c, got = _consume(zk_connect, "g-late", start_position=f"time:{T0 + 10_000}")
    with c:
        c.start()
        end = broker[1][-1]
        wait_until(lambda: c.positions().get((TOPIC, "0-0")) == end, 30,
                   what="positioned at the log end")
        assert got == []


def test_seek_to_time_moves_every_owned_partition(zk_connect, broker) -> None:
    c, got = _consume(zk_connect, "g-seek")
    with c:
        c.start()
        wait_until(lambda: len(got) == N, 30, what="everything once")
        c.seek_to_time(TOPIC, None, T0 + 250)
        wait_until(lambda: len(got) == N + 50, 30, what="the last 50 again")
        assert got[N:] == list(range(250, N))
        c.seek_to_time(TOPIC, "0-0", "2023-11-14T22:13:20.290Z")
        wait_until(lambda: len(got) == N + 60, 30, what="the last 10 again")
        assert got[N + 50:] == list(range(290, N))


def test_bad_times_are_refused_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match="start_position time 'soon'"):
        ConsumerConfig(group="g", start_position="time:soon")
    with pytest.raises(ConfigError, match="outside 2000..3000"):
        ConsumerConfig(group="g", start_position="time:1700000000")  # seconds, not ms
    assert ConsumerConfig(group="g", start_position=f"time:{T0}").start_time_ms == T0


def _metaq(*args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "metaq", *args], capture_output=True,
                          text=True, timeout=60)


def test_reset_offsets_to_a_time_with_a_dry_run_first(zk_connect, zk_client, broker) -> None:
    from zk_layout import Layout, decode_offset

    offsets = broker[1]
    path = Layout().offset("g-reset", TOPIC, "0-0")
    c, got = _consume(zk_connect, "g-reset")
    with c:
        c.start()
        wait_until(lambda: len(got) == N, 30, what="everything consumed")
        c.commit()
        live = _metaq("group", "reset-offsets", "g-reset", "--zk", zk_connect, "--topic", TOPIC,
                      "--to-time", str(T0 + 200))
        assert live.returncode == 2 and "live member" in live.stderr
    committed = decode_offset(zk_client.get(path)[0]).offset
    assert committed == offsets[-1]
    dry = _metaq("group", "reset-offsets", "g-reset", "--zk", zk_connect, "--topic", TOPIC,
                 "--to-time", "2023-11-14T22:13:20.200Z", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    row = dry.stdout.splitlines()[-1].split()
    assert row == [TOPIC, "0-0", str(committed), str(offsets[200])]
    assert decode_offset(zk_client.get(path)[0]).offset == committed  # nothing written
    done = _metaq("group", "reset-offsets", "g-reset", "--zk", zk_connect, "--topic", TOPIC,
                  "--to-time", str(T0 + 200))
    assert done.returncode == 0, done.stderr
    assert decode_offset(zk_client.get(path)[0]).offset == offsets[200]
    again, got2 = _consume(zk_connect, "g-reset")
    with again:
        again.start()
        wait_until(lambda: len(got2) == N - 200, 30, what="from message 200 on")
        assert got2 == list(range(200, N))


def test_lag_in_seconds_is_the_age_of_the_oldest_unconsumed_message(zk_connect, broker) -> None:
    """A member stuck on message 200 (its listener waits): its position is the start of
    the batch in hand, and the lag in seconds is the age of the message there."""
    release = threading.Event()
    seen: list[int] = []

    def listener(m) -> None:  # noqa: ANN001
        i = int(m.raw_body[1:4])
        seen.append(i)
        if i == 200:
            release.wait(30)

    c = MessageConsumer("g-lag", zk_connect, zk_session_timeout=10.0, commit_period=0.2)
    c.subscribe(TOPIC, listener)
    with c:
        c.start()
        wait_until(lambda: 200 in seen, 30, what="the listener stuck on message 200")
        offsets = broker[1]
        # the position is where the batch in hand began (at most message 200)
        pos = c.positions()[(TOPIC, "0-0")]
        i = offsets.index(pos)
        assert i <= 200
        assert c.lag()[(TOPIC, "0-0")] == offsets[-1] - pos
        seconds = c.lag(seconds=True)[(TOPIC, "0-0")]
        expected = time.time() - (T0 + i) / 1000
        assert abs(seconds - expected) < 5, (seconds, expected)
        part = c.metrics(with_lag=True)["partitions"][f"{TOPIC}/0-0"]
        assert part["lag"] == offsets[-1] - pos and part["lag_seconds"] > 0
        release.set()
        wait_until(lambda: len(seen) == N, 30, what="caught up")
        wait_until(lambda: c.lag(seconds=True)[(TOPIC, "0-0")] == 0.0, 10,
                   what="lag 0 s when caught up")


def test_group_describe_shows_lag_seconds(zk_connect, zk_client, broker) -> None:
    from metaq._admin import describe_group
    from metaq.net import offset_for_time  # noqa: F401 - the reset below uses it
    from zk_layout import Layout

    done = _metaq("group", "reset-offsets", "g-desc", "--zk", zk_connect, "--topic", TOPIC,
                  "--to-time", str(T0 + 250))
    assert done.returncode == 0, done.stderr
    report = describe_group(zk_client, Layout(), "g-desc")
    (row,) = report.partitions
    assert row.lag == broker[1][-1] - broker[1][250] and row.state == "unowned"
    assert abs(row.lag_seconds - (time.time() - (T0 + 250) / 1000)) < 5
    assert report.status == "warn"
    text = _metaq("group", "describe", "g-desc", "--zk", zk_connect)
    assert "lag s" in text.stdout and "status: warn" in text.stdout


def test_burrow_rules_over_a_window(zk_client) -> None:
    """Each rule of the window evaluation, with a real offset node (its mtime is the
    time of the last commit)."""
    from metaq._admin import _burrow
    from zk_layout import Layout

    layout = Layout()
    zk_client.create(layout.offset("gb", TOPIC, "0-0"), b"-1-100", makepath=True)
    mtime = zk_client.exists(layout.offset("gb", TOPIC, "0-0")).mtime / 1000

    def state(first, last, end_first, end, *, now=mtime + 1.0, window=2.0):
        return _burrow(zk_client, layout, "gb", TOPIC, "0-0", first, last, end_first, end,
                       max(0, end - last), window, now)

    assert state(100, 90, 500, 500) == "rewind"
    assert state(100, 100, 500, 500) == "stall"             # committed within the window
    assert state(100, 100, 500, 500, now=mtime + 10) == "stop"  # nothing for 10 s > 2 s
    assert state(100, 200, 500, 700) == "warn"              # moved, lag 400 -> 500
    assert state(100, 200, 500, 600) == "warn"              # moved, lag stayed 400
    assert state(100, 300, 500, 500) == "ok"                # moved, lag 400 -> 200
