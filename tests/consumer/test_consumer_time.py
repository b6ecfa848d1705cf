"""Time as a position (issue 16): a new group starting at a time, and seek_to_time.

The log is written straight into the broker's storage with chosen msgId times (as
tests/client/test_timeseek.py does), then served by a real broker registered in a
real ZooKeeper; the consumer finds the position by searching the log by time.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest

from metaq import ConfigError, ConsumerConfig, MessageConsumer
from metaq.broker import Broker, BrokerConfig, Storage
from metaq.protocol import MSG_ID_EPOCH_MS, encode_message
from metaq.testing import free_port, wait_until

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
def broker(zk_connect: str, tmp_path: Path):
    offsets = _write(tmp_path / "b0")
    cfg = BrokerConfig(broker_id=0, data_dir=tmp_path / "b0", port=free_port(),
                       topics={TOPIC: 1}, max_segment_size=4096, zk_connect=zk_connect)
    with Broker(cfg) as b:
        yield b, offsets


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
