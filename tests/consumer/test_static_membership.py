"""Static membership (issue 15) against a real ZooKeeper: held partitions, grace, refusal.

A static member (``instance_id``) that goes away without ``close(leave=True)`` has
its partitions held for it for ``static_grace``: nobody else claims them, nobody
else moves, and when it comes back it takes the same ones.  Coordination only:
topics are published in ZooKeeper without brokers (as in test_consumer_group.py);
members that must be killed or frozen run in their own processes
(tests/helpers/static_member.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.audit import OwnerAudit
from helpers.group_nodes import owners as group_owners
from kazoo.client import KazooClient

from metaq import ConfigError, DuplicateInstanceError, MessageConsumer
from metaq.consumer import State, get_strategy
from metaq.consumer._view import GroupView
from metaq.testing import wait_until
from zk_layout import (
    BrokerUri,
    Layout,
    TopicBroker,
    decode_static_member,
    encode_broker_uri,
    encode_topic_broker,
)

L = Layout()
TOPIC = "orders"
GROUP = "sg"
PARTS = [f"{b}-{i}" for b in (0, 1) for i in range(4)]
SCRIPT = str(Path(__file__).parents[1] / "helpers" / "static_member.py")


@pytest.fixture
def topic(zk_client: KazooClient) -> None:
    for b in (0, 1):
        zk_client.create(L.topic_sub(TOPIC, b),
                         encode_topic_broker(TopicBroker(num_parts=4, broker_id=b)),
                         makepath=True)


def member(zk_connect: str, instance: str | None, **kw) -> MessageConsumer:
    kw.setdefault("zk_session_timeout", 4.0)
    kw.setdefault("commit_period", 0.5)
    errors: list[BaseException] = []
    c = MessageConsumer(GROUP, zk_connect, instance_id=instance,
                        on_error=errors.append, **kw)
    c.errors = errors  # type: ignore[attr-defined]
    c.subscribe(TOPIC, lambda m: None)
    return c


def owners(zk_client: KazooClient) -> dict[str, str]:
    return group_owners(zk_client, GROUP, TOPIC, L)


def plan(ids: list[str]) -> dict[str, list[str]]:
    return get_strategy("default").assign_all(ids, PARTS)


def settled_as(consumers: list[MessageConsumer], expected: dict[str, list[str]]) -> bool:
    return all(c.state is State.STABLE
               and sorted(c.assignment().get(TOPIC, [])) == sorted(expected[c.consumer_id])
               for c in consumers)


def record(zk_client: KazooClient, cid: str):
    path = L.static_member(GROUP, cid)
    if not zk_client.exists(path):
        return None
    return decode_static_member(zk_client.get(path)[0], path)


class Proc:
    """A member in its own process (tests/helpers/static_member.py)."""

    def __init__(self, zk_connect: str, instance: str, *args: str) -> None:
        self.events: list[dict] = []
        self.p = subprocess.Popen(
            [sys.executable, SCRIPT, "--zk", zk_connect, "--group", GROUP, "--topic", TOPIC,
             "--instance", instance, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            self.events.append(json.loads(raw))

    def owns(self) -> set[str]:
        out: set[str] = set()
        for ev in list(self.events):
            if ev["ev"] == "assigned":
                out.add(ev["p"])
            elif ev["ev"] == "revoked":
                out.discard(ev["p"])
        return out

    def state(self) -> str | None:
        states = [ev["state"] for ev in list(self.events) if ev["ev"] == "state"]
        return states[-1] if states else None

    def errors(self) -> list[dict]:
        return [ev for ev in list(self.events) if ev["ev"] == "error"]

    def signal(self, sig: int) -> None:
        self.p.send_signal(sig)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(30)
        self.t.join(10)


def never_owned_by_others(audit: OwnerAudit, parts: list[str], owner: str,
                          since: float) -> None:
    """Since ``since`` (monotonic), ``parts`` had no owner but ``owner``."""
    with audit.lock:
        seen = [(part, o) for t, part, o in audit.events if t >= since and part in parts]
    assert all(o is None or o == owner for _, o in seen), seen


# --------------------------------------------------------------------------- config

@pytest.mark.parametrize("kw, words", [
    ({"instance_id": "a", "consumer_id": "b"}, "not both"),
    ({"instance_id": "a", "broadcast": True}, "broadcast"),
    ({"instance_id": "bad id"}, "instance_id"),
    ({"instance_id": "a", "static_grace": 0}, "static_grace"),
    ({"instance_id": "a", "static_grace": True}, "static_grace"),
    ({"instance_id": "a", "static_grace": 10**9}, "static_grace"),
])
def test_static_config_is_validated(kw, words) -> None:
    from metaq import ConsumerConfig
    with pytest.raises(ConfigError, match=words):
        ConsumerConfig(group="g", **kw)


# --------------------------------------------------------------------------- graceful

def test_restart_within_the_grace_takes_the_same_partitions_and_nobody_moves(
        zk_connect, zk_client, topic) -> None:
    audit = OwnerAudit(zk_client, GROUP, TOPIC)
    a, b, c = (member(zk_connect, n, static_grace=60) for n in ("a", "b", "c"))
    ids = [f"{GROUP}_{n}" for n in ("a", "b", "c")]
    expected = plan(ids)
    try:
        for m in (a, b, c):
            m.start()
        wait_until(lambda: settled_as([a, b, c], expected), 30, what="three static members")
        gen_a, gen_c, since = a.generation, c.generation, time.monotonic()
        b.close()  # not leave=True: held for it
        rec = record(zk_client, b.consumer_id)
        assert rec is not None and rec.away_since_ms is not None, rec
        # the others saw it go (they re-planned) and still hold exactly their own share
        wait_until(lambda: a.generation > gen_a and c.generation > gen_c
                   and settled_as([a, c], expected), 20, what="a and c re-planned")
        assert not any(o == b.consumer_id for o in owners(zk_client).values())
        assert set(owners(zk_client)) == set(expected[ids[0]]) | set(expected[ids[2]])
        b2 = member(zk_connect, "b", static_grace=60)
        b2.start()
        wait_until(lambda: settled_as([a, b2, c], expected), 20, what="b back")
        left = time.monotonic()
        b2.close(leave=True)
        assert record(zk_client, b2.consumer_id) is None
        wait_until(lambda: settled_as([a, c], plan([ids[0], ids[2]])), 20,
                   what="a and c share everything once b left for good")
    finally:
        for m in (a, b, c):
            m.close()
    # from settled until b left for good, no partition changed hands
    with audit.lock:
        seen = [(t, part, o) for t, part, o in audit.events if since <= t < left]
    mine = {q: cid for cid, qs in expected.items() for q in qs}
    assert all(o is None or o == mine[part] for _, part, o in seen), seen


def test_a_member_that_never_comes_back_is_planned_without_after_the_grace(
        zk_connect, zk_client, topic) -> None:
    a, b = member(zk_connect, "a", static_grace=3), member(zk_connect, "b", static_grace=3)
    try:
        a.start()
        b.start()
        ids = [a.consumer_id, b.consumer_id]
        wait_until(lambda: settled_as([a, b], plan(ids)), 30, what="two members")
        b.close()
        rec = record(zk_client, b.consumer_id)
        assert rec is not None and rec.held_until_ms is not None
        wait_until(lambda: settled_as([a], plan([a.consumer_id])), 30,
                   what="a owns everything after b's grace")
        # not before the hold ended (ZooKeeper's clock and ours are the same machine's)
        assert time.time() * 1000 >= rec.held_until_ms
        wait_until(lambda: record(zk_client, b.consumer_id) is None, 10,
                   what="the expired record deleted")
    finally:
        a.close()
        b.close()


def test_close_with_leave_rebalances_at_once(zk_connect, zk_client, topic) -> None:
    a, b = member(zk_connect, "a", static_grace=600), member(zk_connect, "b", static_grace=600)
    try:
        a.start()
        b.start()
        wait_until(lambda: settled_as([a, b], plan([a.consumer_id, b.consumer_id])), 30,
                   what="two members")
        b.close(leave=True)
        assert record(zk_client, b.consumer_id) is None
        wait_until(lambda: settled_as([a], plan([a.consumer_id])), 20,
                   what="a owns everything well before the 600 s grace")
    finally:
        a.close()
        b.close()


def test_a_dynamic_member_beside_static_ones_moves_as_today(zk_connect, zk_client,
                                                            topic) -> None:
    a, d = member(zk_connect, "a", static_grace=600), member(zk_connect, None)
    try:
        a.start()
        d.start()
        wait_until(lambda: settled_as([a, d], plan([a.consumer_id, d.consumer_id])), 30,
                   what="static and dynamic")
        assert record(zk_client, d.consumer_id) is None  # no record for a dynamic one
        d.close()
        wait_until(lambda: settled_as([a], plan([a.consumer_id])), 20,
                   what="the dynamic member's partitions taken at once")
    finally:
        a.close()
        d.close()


# --------------------------------------------------------------------------- crashes

def test_killed_static_member_is_held_then_takes_its_partitions_back(
        zk_connect, zk_client, topic) -> None:
    audit = OwnerAudit(zk_client, GROUP, TOPIC)
    a = member(zk_connect, "a", static_grace=60)
    ids = [a.consumer_id, f"{GROUP}_b"]
    expected = plan(ids)
    p = Proc(zk_connect, "b", "--grace", "60")
    p2 = None
    try:
        a.start()
        wait_until(lambda: settled_as([a], expected) and p.owns() == set(expected[ids[1]]),
                   30, what="a and the process b settled")
        gen, since = a.generation, time.monotonic()
        p.signal(signal.SIGKILL)
        p.p.wait(10)
        wait_until(lambda: not zk_client.exists(L.consumer_id(GROUP, ids[1])), 30,
                   what="b's session expired")
        wait_until(lambda: (r := record(zk_client, ids[1])) is not None
                   and r.away_since_ms is not None, 10, what="b marked away by a")
        wait_until(lambda: a.generation > gen and a.state is State.STABLE, 10,
                   what="a re-planned after b went")
        assert sorted(a.assignment()[TOPIC]) == sorted(expected[ids[0]])
        assert not set(owners(zk_client)) & set(expected[ids[1]])
        p2 = Proc(zk_connect, "b", "--grace", "60")
        wait_until(lambda: p2.owns() == set(expected[ids[1]]) and p2.state() == "stable",
                   30, what="b back with its partitions")
        assert sorted(a.assignment()[TOPIC]) == sorted(expected[ids[0]])
        assert not p2.errors()
    finally:
        a.close()
        p.stop()
        if p2 is not None:
            p2.stop()
    never_owned_by_others(audit, expected[ids[1]], ids[1], since)


def test_a_static_member_frozen_past_its_session_rejoins_without_two_owners(
        zk_connect, zk_client, topic) -> None:
    audit = OwnerAudit(zk_client, GROUP, TOPIC)
    a = member(zk_connect, "a", static_grace=60)
    ids = [a.consumer_id, f"{GROUP}_b"]
    expected = plan(ids)
    p = Proc(zk_connect, "b", "--grace", "60")
    try:
        a.start()
        wait_until(lambda: settled_as([a], expected) and p.owns() == set(expected[ids[1]]),
                   30, what="settled")
        since = time.monotonic()
        p.signal(signal.SIGSTOP)
        wait_until(lambda: not zk_client.exists(L.consumer_id(GROUP, ids[1])), 30,
                   what="the frozen member's session expired")
        wait_until(lambda: (r := record(zk_client, ids[1])) is not None
                   and r.away_since_ms is not None, 10, what="marked away")
        p.signal(signal.SIGCONT)
        wait_until(lambda: zk_client.exists(L.consumer_id(GROUP, ids[1])) is not None
                   and set(owners(zk_client)) == set(PARTS), 30,
                   what="b re-registered and owns its partitions again")
        assert owners(zk_client) == {q: cid for cid, qs in expected.items() for q in qs}
    finally:
        a.close()
        p.signal(signal.SIGCONT)
        p.stop()
    never_owned_by_others(audit, expected[ids[1]], ids[1], since)


def test_a_killed_member_that_never_comes_back_is_dropped_after_its_grace(
        zk_connect, zk_client, topic) -> None:
    a = member(zk_connect, "a", static_grace=3)
    p = Proc(zk_connect, "b", "--grace", "3")
    try:
        a.start()
        wait_until(lambda: p.owns() and a.state is State.STABLE, 30, what="settled")
        p.signal(signal.SIGKILL)
        wait_until(lambda: settled_as([a], plan([a.consumer_id])), 30,
                   what="a owns everything once b's session and grace are over")
        wait_until(lambda: record(zk_client, f"{GROUP}_b") is None, 10, what="record deleted")
    finally:
        a.close()
        p.stop()


def test_a_second_process_with_the_same_instance_id_is_refused(zk_connect, zk_client,
                                                               topic) -> None:
    first = member(zk_connect, "x", static_grace=60)
    second = None
    try:
        first.start()
        wait_until(lambda: settled_as([first], plan([first.consumer_id])), 30, what="first")
        session = zk_client.get(L.consumer_id(GROUP, first.consumer_id))[1].ephemeralOwner
        p = Proc(zk_connect, "x", "--grace", "60")
        second = p
        wait_until(lambda: any(e["type"] == "DuplicateInstanceError" for e in p.errors()),
                   30, what="the second process refused")
        err = next(e for e in p.errors() if e["type"] == "DuplicateInstanceError")
        assert "instance_id 'x'" in err["error"] and "in use" in err["error"]
        wait_until(lambda: p.state() == "closed", 10, what="the second closed")
        assert not p.owns()
        # the first is untouched: its id node, its session, every partition
        assert zk_client.get(L.consumer_id(GROUP, first.consumer_id))[1].ephemeralOwner \
            == session
        assert set(owners(zk_client).values()) == {first.consumer_id}
        assert first.state is State.STABLE and not first.errors
        p.p.stdin.write(b"close\n")
        p.p.stdin.flush()
        wait_until(lambda: any(e["ev"] == "closed" for e in p.events), 10, what="closed")
        assert zk_client.get(L.consumer_id(GROUP, first.consumer_id))[1].ephemeralOwner \
            == session
    finally:
        first.close()
        if second is not None:
            second.stop()


def test_in_process_duplicate_raises_to_the_user_and_owns_nothing(zk_connect, zk_client,
                                                                  topic) -> None:
    first, second = member(zk_connect, "x"), member(zk_connect, "x")
    try:
        first.start()
        wait_until(lambda: first.state is State.STABLE, 30, what="first")
        second.start()
        wait_until(lambda: any(isinstance(e, DuplicateInstanceError) for e in second.errors),
                   30, what="the duplicate refused")
        assert second.state is State.CLOSED and not second.assignment()
        assert sorted(first.assignment()[TOPIC]) == sorted(PARTS)
    finally:
        second.close()
        first.close()


# --------------------------------------------------------------------------- the view

def test_the_group_view_reads_only_what_changed(zk_connect, zk_client, topic) -> None:
    changes = threading.Event()
    for b in (0, 1, 2):  # brokers up: an address read while a broker is down is re-read
        zk_client.create(L.broker_master(b), encode_broker_uri(BrokerUri("127.0.0.1", 9000 + b)),
                         makepath=True)
    view = GroupView(zk_client, L, GROUP, on_change=changes.set)
    for n in range(20):
        zk_client.create(L.consumer_id(GROUP, f"{GROUP}_m{n}"), TOPIC.encode(), makepath=True)
    first = view.read([TOPIC])
    assert len(first.members[TOPIC]) == 20 and first.partitions[TOPIC] == sorted(PARTS)
    assert view.last_requests >= 20
    again = view.read([TOPIC])
    assert view.last_requests == 0 and again.members == first.members
    zk_client.create(L.consumer_id(GROUP, f"{GROUP}_new"), TOPIC.encode())
    wait_until(changes.is_set, 10, what="the ids watch fired")
    joined = view.read([TOPIC])
    assert view.last_requests == 2  # the id list and the newcomer's node
    assert f"{GROUP}_new" in joined.members[TOPIC]
    changes.clear()
    zk_client.set(L.consumer_id(GROUP, f"{GROUP}_m3"), b"other")  # m3 now subscribes elsewhere
    wait_until(changes.is_set, 10, what="the data watch fired")
    moved = view.read([TOPIC])
    assert view.last_requests == 1 and f"{GROUP}_m3" not in moved.members[TOPIC]
    changes.clear()
    zk_client.create(L.topic_sub(TOPIC, 2),
                     encode_topic_broker(TopicBroker(num_parts=2, broker_id=2)))
    wait_until(changes.is_set, 10, what="the partitions watch fired")
    grown = view.read([TOPIC])
    assert "2-1" in grown.partitions[TOPIC] and grown.brokers[2] == ("127.0.0.1", 9002)
