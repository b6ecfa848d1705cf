"""Consumption modes and control: concurrent, manual ack, broadcast, seek, pause, reconsume."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from helpers.inproc import produce as send

from metaq import ConfigError, MessageConsumer
from metaq.consumer import RECONSUME_LATER
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "modes"


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2}, zk_connect=zk_connect)


def produce(zk_connect, n, start=0):
    send(zk_connect, TOPIC, (f"m{i}".encode() for i in range(start, start + n)))


def consumer(zk_connect, group, tmp_path, **kw):
    kw.setdefault("commit_period", 0.1)
    return MessageConsumer(group, zk_connect, recover_dir=str(tmp_path / "rs"), **kw)


def test_concurrent_mode_commits_only_below_the_oldest_unfinished(zk_connect, broker,
                                                                  tmp_path):
    produce(zk_connect, 200)
    release = threading.Event()
    done: list[bytes] = []
    lock = threading.Lock()

    def slow(m):
        if m.raw_body == b"m10":  # one message stays unfinished until released
            release.wait(30)
        time.sleep(0.001)
        with lock:
            done.append(m.raw_body)

    with consumer(zk_connect, "conc", tmp_path, consumer_id="c", consume_mode="concurrent",
                  consume_threads=8) as c:
        c.subscribe(TOPIC, slow)
        c.start()
        wait_until(lambda: len(done) == 199, timeout=30, what="all but the held message")
        stuck = next(k for k, pf, _ in c._coordinator.owned() if pf.inflight.low())
        pf = c._coordinator.fetch_state(*stuck)
        low_offset = pf.inflight.low()[0]
        wait_until(lambda: c.committed().get(stuck) == low_offset, timeout=10,
                   what="commit held at the unfinished message")
        assert c.positions()[stuck] > low_offset  # fetching went on past it
        release.set()
        wait_until(lambda: c.committed() == c.positions(), timeout=10,
                   what="commit catches up once it finished")
    assert Counter(done) == Counter(f"m{i}".encode() for i in range(200))


def test_concurrent_failures_are_retried_and_reconsume_later_counts(zk_connect, broker,
                                                                    tmp_path):
    produce(zk_connect, 30)
    calls: Counter[bytes] = Counter()
    ok: list[bytes] = []
    lock = threading.Lock()

    def flaky(m):
        with lock:
            calls[m.raw_body] += 1
            n = calls[m.raw_body]
        if m.raw_body == b"m3" and n < 3:
            raise RuntimeError("transient")
        if m.raw_body == b"m4" and n < 2:
            return RECONSUME_LATER
        with lock:
            ok.append(m.raw_body)

    with consumer(zk_connect, "retry", tmp_path, consumer_id="r", consume_mode="concurrent",
                  consume_threads=4, max_fetch_retries=5) as c:
        c.subscribe(TOPIC, flaky)
        c.start()
        wait_until(lambda: len(ok) == 30, timeout=30, what="every message succeeded")
        wait_until(lambda: c.committed() == c.positions(), timeout=10, what="all committed")
    assert calls[b"m3"] == 3 and calls[b"m4"] == 2


def test_orderly_reconsume_later_retries_the_same_message(zk_connect, broker, tmp_path):
    produce(zk_connect, 10)
    seen: list[bytes] = []

    def later_once(m):
        seen.append(m.raw_body)
        if m.raw_body == b"m2" and seen.count(b"m2") == 1:
            return RECONSUME_LATER
        return None

    with consumer(zk_connect, "later", tmp_path, consumer_id="l") as c:
        c.subscribe(TOPIC, later_once)
        c.start()
        wait_until(lambda: len(set(seen)) == 10, timeout=30, what="all delivered")
    assert seen.count(b"m2") == 2


def test_manual_ack_commits_only_acked_and_rollback_redelivers(zk_connect, broker, tmp_path):
    produce(zk_connect, 40)
    got: list = []
    with consumer(zk_connect, "manual", tmp_path, consumer_id="m") as c:
        c.subscribe(TOPIC, got.append, auto_ack=False)
        c.start()
        wait_until(lambda: len(got) == 40, timeout=30, what="all delivered once")
        assert c.committed() == {(TOPIC, "0-0"): 0, (TOPIC, "0-1"): 0}  # nothing acked
        first = next(m for m in got if m.partition == "0-0")
        c.ack(first)
        wait_until(lambda: c.committed()[(TOPIC, "0-0")] == first.next_offset, timeout=10,
                   what="ack committed")
        before = len(got)
        c.rollback(TOPIC, "0-0")
        redelivered_count = sum(1 for m in got if m.partition == "0-0") - 1
        wait_until(lambda: len(got) >= before + redelivered_count, timeout=30,
                   what="rollback delivered the unacked ones again")
        again = [m for m in got[before:] if m.partition == "0-0"]
        assert again[0].offset == first.next_offset
        assert c.committed()[(TOPIC, "0-0")] == first.next_offset


def test_seek_pause_resume(zk_connect, broker, tmp_path):
    produce(zk_connect, 20)
    got: list = []
    with consumer(zk_connect, "seek", tmp_path, consumer_id="s") as c:
        c.subscribe(TOPIC, got.append)
        c.start()
        wait_until(lambda: len(got) == 20, timeout=30, what="all delivered")
        c.pause(TOPIC, "0-1")
        c.seek_to_earliest(TOPIC, "0-0")
        wait_until(lambda: len(got) == 30, timeout=30, what="0-0 delivered again")
        assert {m.partition for m in got[20:]} == {"0-0"}
        produce(zk_connect, 20, start=20)
        new = {f"m{i}".encode() for i in range(20, 40)}
        wait_until(lambda: sum(1 for m in got if m.raw_body in new) == 10, timeout=30,
                   what="the new messages of 0-0")
        assert all(m.partition == "0-0" for m in got if m.raw_body in new), "paused fetched"
        c.resume(TOPIC, "0-1")
        wait_until(lambda: len({m.raw_body for m in got}) == 40, timeout=30,
                   what="paused partition resumed")
        with pytest.raises(ConfigError):
            c.seek(TOPIC, "0-0", -5)


def test_broadcast_every_member_sees_every_message_once_across_a_restart(
        zk_connect, zk_client, broker, tmp_path):
    produce(zk_connect, 100)
    seen: dict[str, list[bytes]] = {n: [] for n in ("a", "b", "c")}

    def member(name):
        c = consumer(zk_connect, "bc", tmp_path, consumer_id=name, broadcast=True,
                     offset_file=str(tmp_path / f"{name}.offsets"))
        c.subscribe(TOPIC, lambda m: seen[name].append(m.raw_body))
        return c.start()

    members = [member(n) for n in seen]
    wait_until(lambda: all(len(v) == 100 for v in seen.values()), timeout=30,
               what="every member saw every message")
    for c in members:
        assert c.zk_group.startswith("bc-")
        assert sorted(c.assignment()[TOPIC]) == ["0-0", "0-1"]
    members[1].close()  # b restarts later and resumes from its own offsets file
    produce(zk_connect, 50, start=100)
    wait_until(lambda: len(seen["a"]) == 150 and len(seen["c"]) == 150, timeout=30,
               what="a and c got the new messages")
    members[1] = member("b")
    wait_until(lambda: len(seen["b"]) == 150, timeout=30, what="b caught up after restart")
    for c in members:
        c.close()
    expected = Counter(f"m{i}".encode() for i in range(150))
    for name, got in seen.items():
        assert Counter(got) == expected, name
    # nothing owned in ZooKeeper: broadcast members do not claim partitions
    group = members[0].zk_group
    assert not zk_client.exists(f"/meta/consumers/{group}/owners/{TOPIC}/0-0")


def test_mode_config_errors_are_named(zk_connect, tmp_path):
    with pytest.raises(ConfigError, match="consume_mode"):
        MessageConsumer("g", zk_connect, consume_mode="parallel")
    c = MessageConsumer("g", zk_connect, consume_mode="concurrent")
    with pytest.raises(ConfigError, match="batch listener"):
        c.subscribe(TOPIC, type("B", (), {"on_messages": lambda self, b: None})())
    with pytest.raises(ConfigError, match="manual ack"):
        c.subscribe(TOPIC, lambda m: None, auto_ack=False)
    c.close()
