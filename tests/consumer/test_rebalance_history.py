"""The rebalance history (issue 28) against the real ZooKeeper and real members.

Each member writes ``consumers/<group>/history/<consumerId>``; these tests read it back
the way the CLI and the dashboard do (``zk_layout.read_history`` and
``ownership_timeline``) across a join, a leave, a member killed with SIGKILL (a
subprocess), partitions added by a new broker, a session expired on the server, and
the bounds of one node and of the group.  Topics are published in ZooKeeper as a broker
publishes them, without a broker: every observation is about the tree.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.faults import fail_next_rebalance
from kazoo.client import KazooClient

from metaq import ConfigError, MessageConsumer
from metaq._cli import main as cli_main
from metaq.consumer import State
from metaq.testing import expire_session, wait_until
from zk_layout import (
    TRIGGERS,
    Layout,
    RebalanceRecord,
    TopicBroker,
    encode_history,
    encode_topic_broker,
    holder_at,
    ownership_timeline,
    read_history,
)

L = Layout()
G = "hg"
TOPIC = "orders"
SCRIPT = str(Path(__file__).parents[1] / "helpers" / "consumer_script.py")


def publish(client: KazooClient, broker_id: int, parts: int, topic: str = TOPIC) -> None:
    client.create(L.topic_sub(topic, broker_id),
                  encode_topic_broker(TopicBroker(num_parts=parts, broker_id=broker_id)),
                  makepath=True)


def parts(broker_ids=(0,), n=4) -> list[str]:
    return [f"{TOPIC}/{b}-{i}" for b in broker_ids for i in range(n)]


def make(zk_connect, name, **kw) -> MessageConsumer:
    kw.setdefault("zk_session_timeout", 4.0)
    kw.setdefault("commit_period", 0.5)
    c = MessageConsumer(G, zk_connect, consumer_id=name, **kw)
    c.subscribe(TOPIC, lambda m: None)
    return c


def settled(consumers, wanted) -> bool:
    owned = sorted(f"{TOPIC}/{p}" for c in consumers for p in c.assignment().get(TOPIC, []))
    return owned == sorted(wanted) and all(c.state is State.STABLE for c in consumers)


def records_of(zk_client, cid: str) -> list[RebalanceRecord]:
    return [r for r in read_history(zk_client, L, G) if r.consumer_id == cid]


def wait_record(zk_client, cid: str, trigger: str, after: int = -1, what: str = ""
                ) -> RebalanceRecord:
    """The first record of ``cid`` with ``trigger`` and a generation above ``after``."""
    def found() -> RebalanceRecord | None:
        for r in records_of(zk_client, cid):
            if r.trigger == trigger and r.generation > after:
                return r
        return None
    return wait_until(found, timeout=30,
                      what=what or f"a {trigger} record of {cid} after gen {after}")


def held_by(zk_client, cid: str) -> set[str]:
    """Partitions the timeline says ``cid`` holds now (an open interval)."""
    tl = ownership_timeline(read_history(zk_client, L, G))
    return {p for p, intervals in tl.items() if intervals[-1].end_ms is None
            and intervals[-1].consumer_id == cid}


def test_join_leave_and_partitions_added_are_recorded_with_why(zk_connect, zk_client,
                                                               capsys):
    publish(zk_client, 0, 4)
    a, b = make(zk_connect, "a"), make(zk_connect, "b")
    try:
        a.start()
        wait_until(lambda: settled([a], parts()), timeout=20, what="a alone")
        first = wait_record(zk_client, "hg_a", "started")
        assert sorted(first.claimed) == parts() and sorted(first.plan) == parts()
        assert first.released == () and first.state == "stable"
        assert first.strategy == "default" and first.duration_ms >= 0
        assert first.path == L.history_member(G, "hg_a")

        b.start()
        wait_until(lambda: settled([a, b], parts()), timeout=20, what="a and b")
        joined = wait_record(zk_client, "hg_a", "member_joined", first.generation)
        assert "hg_b" in joined.detail
        assert len(joined.released) == 2 and len(joined.plan) == 2
        b_share = {f"{TOPIC}/{p}" for p in b.assignment()[TOPIC]}
        assert set(joined.released) == b_share
        # b has them once a let go: in its first rebalance, or after waiting for them
        wait_until(lambda: held_by(zk_client, "hg_b") == b_share, timeout=20,
                   what="the timeline to show b holding its share")
        b_recs = records_of(zk_client, "hg_b")
        assert b_recs[0].trigger == "started"
        assert {p for r in b_recs for p in r.claimed} == b_share
        tl = ownership_timeline(read_history(zk_client, L, G))
        for p in b_share:
            a_iv, b_iv = tl[p][-2], tl[p][-1]
            assert (a_iv.consumer_id, a_iv.trigger_in, a_iv.trigger_out) == \
                ("hg_a", "started", "member_joined")
            assert b_iv.consumer_id == "hg_b" and b_iv.end_ms is None
            assert a_iv.end_ms <= b_iv.start_ms  # a gap, never an overlap
            assert holder_at(tl, p, a_iv.end_ms - 1).consumer_id == "hg_a"

        # a broker publishes 4 more partitions: both rebalance for it
        gens = {c.consumer_id: c.generation for c in (a, b)}
        publish(zk_client, 1, 4)
        wait_until(lambda: settled([a, b], parts((0, 1))), timeout=20, what="eight split")
        for c in (a, b):
            r = wait_record(zk_client, c.consumer_id, "partitions_changed",
                            gens[c.consumer_id] - 1)
            assert f"{TOPIC}: 4 -> 8 partitions" in r.detail
            assert "broker 1: absent -> no master" in r.detail
            assert len(r.plan) == 4

        # b leaves: its last record says so, a's says why it took b's partitions
        gen_a = a.generation
        b_had = {f"{TOPIC}/{p}" for p in b.assignment()[TOPIC]}
        b.close()
        closing = wait_record(zk_client, "hg_b", "closing")
        assert set(closing.released) == b_had and closing.state == "closed"
        left = wait_record(zk_client, "hg_a", "member_left", gen_a - 1)
        assert "hg_b" in left.detail
        wait_until(lambda: held_by(zk_client, "hg_a") == set(parts((0, 1))), timeout=20,
                   what="a holding all eight in the timeline")
        tl = ownership_timeline(read_history(zk_client, L, G))
        for p in b_had:
            assert tl[p][-2].consumer_id == "hg_b" and tl[p][-2].trigger_out == "closing"
            assert tl[p][-1].trigger_in in ("member_left", "owner_vanished")
        assert {r.trigger for r in read_history(zk_client, L, G)} <= set(TRIGGERS)
        # the history outlives the member
        assert zk_client.exists(L.history_member(G, "hg_b")) is not None

        # the command prints the same, as JSON too, for one partition, since a time
        zk = zk_connect
        capsys.readouterr()
        assert cli_main(["group", "history", G, "--zk", zk, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["group"] == G
        assert [r["trigger"] for r in doc["records"]] == \
            [r.trigger for r in read_history(zk_client, L, G)]
        assert doc["records"][0].keys() >= {"consumer_id", "generation", "time", "time_ms",
                                            "duration_ms", "trigger", "detail", "plan",
                                            "released", "claimed", "waiting", "error"}
        moved = sorted(b_had)[0]
        assert cli_main(["group", "history", G, "--zk", zk, "--json",
                         "--partition", moved]) == 0
        one = json.loads(capsys.readouterr().out)
        assert list(one["timeline"]) == [moved]
        assert [i["consumer_id"] for i in one["timeline"][moved]][-2:] == ["hg_b", "hg_a"]
        assert all(moved in r["plan"] + r["released"] + r["claimed"] + r["waiting"]
                   for r in one["records"])
        assert cli_main(["group", "history", G, "--zk", zk, "--partition", moved]) == 0
        text = capsys.readouterr().out
        assert "closing" in text and "hg_b" in text and "held by" in text
        assert cli_main(["group", "history", G, "--zk", zk, "--since", "1h"]) == 0
        assert "member_left" in capsys.readouterr().out
        assert cli_main(["group", "history", G, "--zk", zk, "--json",
                         "--since", "2999-01-01T00:00:00Z"]) == 0
        assert json.loads(capsys.readouterr().out)["records"] == []
        assert cli_main(["group", "history", G, "--zk", zk, "--since", "yesterday"]) == 2
        assert "--since" in capsys.readouterr().err
        assert cli_main(["group", "history", "nosuchgroup", "--zk", zk]) == 2
    finally:
        a.close()
        b.close()


class ScriptMember:
    """``tests/helpers/consumer_script.py`` as a group member, to be killed with SIGKILL."""

    def __init__(self, zk_connect: str, name: str) -> None:
        self.p = subprocess.Popen([sys.executable, SCRIPT, "--zk", zk_connect, "--group", G,
                                   "--topic", TOPIC, "--id", name], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        for raw in self.p.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait(30)
        self.t.join(10)


def test_a_member_killed_with_sigkill_is_in_the_history_and_who_took_over(zk_connect,
                                                                        zk_client):
    publish(zk_client, 0, 4)
    a = make(zk_connect, "a")
    k = ScriptMember(zk_connect, "k")
    try:
        wait_until(lambda: held_by(zk_client, "hg_k") == set(parts()), timeout=30,
                   what="the script member to record holding every partition")
        a.start()
        wait_until(lambda: len(a.assignment().get(TOPIC, [])) == 2 and a.state is State.STABLE,
                   timeout=30, what="a holding half")
        wait_until(lambda: len(held_by(zk_client, "hg_k")) == 2, timeout=30,
                   what="the script member to record giving a half")
        k_had = held_by(zk_client, "hg_k")
        gen = a.generation
        k.kill()  # no close, no record: its session expires (4 s) and a takes over
        wait_until(lambda: settled([a], parts()), timeout=30, what="a taking k's partitions")
        left = wait_record(zk_client, "hg_a", "member_left", gen - 1)
        assert "hg_k" in left.detail and set(left.claimed) == k_had
        tl = ownership_timeline(read_history(zk_client, L, G))
        for p in k_had:
            k_iv, a_iv = tl[p][-2], tl[p][-1]
            assert (k_iv.consumer_id, k_iv.trigger_out) == ("hg_k", "member_left")
            assert (a_iv.consumer_id, a_iv.trigger_in, a_iv.end_ms) == \
                ("hg_a", "member_left", None)
            assert k_iv.end_ms <= a_iv.start_ms
        # the killed member's own records are still there, up to its last rebalance
        assert records_of(zk_client, "hg_k") and records_of(zk_client, "hg_k")[-1].trigger \
            != "closing"
    finally:
        k.kill()
        a.close()


def test_session_expiry_is_recorded_then_the_rejoin(zk_connect, zk_client, zk_server):
    publish(zk_client, 0, 4)
    client = KazooClient(hosts=zk_connect, timeout=4.0)
    client.start(timeout=20)
    c = MessageConsumer(G, client, consumer_id="x", zk_session_timeout=4.0,
                        commit_period=0.2)
    c.subscribe(TOPIC, lambda m: None)
    try:
        c.start()
        wait_until(lambda: settled([c], parts()), timeout=20, what="settled")
        start = wait_record(zk_client, "hg_x", "started")
        old = client.client_id[0]
        expire_session(client, zk_server.hosts)
        wait_until(lambda: client.client_id and client.client_id[0] != old
                   and settled([c], parts()), timeout=30, what="back in a new session")
        def expiry() -> tuple[RebalanceRecord, RebalanceRecord] | None:
            recs = records_of(zk_client, "hg_x")
            marks = [i for i, r in enumerate(recs) if r.trigger == "session_expired"]
            return (recs[marks[0]], recs[marks[1]]) if len(marks) >= 2 else None
        lost, back = wait_until(expiry, timeout=30, what="the expiry and the rejoin recorded")
        recs = records_of(zk_client, "hg_x")
        assert lost.trigger == back.trigger == "session_expired"
        assert set(lost.released) == set(parts()) and lost.plan == () and \
            lost.state == "connecting"
        assert "without committing" in lost.detail
        assert set(back.claimed) == set(parts()) and back.generation > lost.generation \
            > start.generation
        assert "new session" in back.detail
        tl = ownership_timeline(recs)
        for p in parts():
            assert [(i.consumer_id, i.trigger_in, i.trigger_out) for i in tl[p]] == [
                ("hg_x", "started", "session_expired"),
                ("hg_x", "session_expired", None)]
    finally:
        c.close()
        client.stop()
        client.close()


def test_a_members_node_keeps_its_last_records_within_its_bytes(zk_connect, zk_client):
    publish(zk_client, 0, 4)
    a = make(zk_connect, "a", history_records=3, history_node_bytes=1024)
    try:
        a.start()
        wait_until(lambda: settled([a], parts()), timeout=20, what="settled")
        # more rebalances than kept: brokers with 40 partitions each come, five times
        wanted = parts()
        for n in range(1, 6):
            publish(zk_client, n, 40)
            wanted += [f"{TOPIC}/{n}-{i}" for i in range(40)]
            wait_until(lambda w=list(wanted): settled([a], w), timeout=20,
                       what=f"settled with {n} more brokers")
        recs = wait_until(lambda: (rs := records_of(zk_client, "hg_a")) and
                          rs[-1].generation == a.generation and rs, timeout=20,
                          what="the last rebalance written")
        assert len(recs) <= 3
        assert [r.trigger for r in recs][-1] == "partitions_changed"
        data, _ = zk_client.get(L.history_member(G, "hg_a"))
        assert len(data) <= 1024
        assert len(recs[-1].plan) == 204  # one run per broker: the whole plan fits
    finally:
        a.close()


def test_the_group_keeps_at_most_its_bound_deleting_the_oldest_gone_members(zk_connect,
                                                                            zk_client):
    publish(zk_client, 0, 4)
    base = L.history(G)
    # ten gone members' histories, written one after the other (oldest first)
    for i in range(10):
        rec = RebalanceRecord(consumer_id=f"hg_gone{i}", generation=1, time_ms=1_000 + i,
                              trigger="started", plan=(f"{TOPIC}/0-0",))
        zk_client.create(f"{base}/hg_gone{i}", encode_history(f"hg_gone{i}", [rec]),
                         makepath=True)
    sizes = {n: zk_client.exists(f"{base}/{n}").dataLength for n in zk_client.get_children(base)}
    a = make(zk_connect, "a", history_max_members=4, history_node_bytes=1024,
             history_max_bytes=64 * 1024)
    try:
        a.start()
        wait_until(lambda: settled([a], parts()), timeout=20, what="settled")
        left = wait_until(lambda: len(n := zk_client.get_children(base)) <= 4 and n,
                          timeout=20, what="the group's history pruned to 4 nodes")
        assert "hg_a" in left  # its own is never deleted
        assert sorted(n for n in left if n != "hg_a") == ["hg_gone7", "hg_gone8", "hg_gone9"]
    finally:
        a.close()
    # the byte bound: 0b (first in Metaq's order, so the one pruning) keeps the group
    # within its own node's cap and one more gone member's node
    one = max(sizes.values())
    b = make(zk_connect, "0b", history_max_members=100, history_node_bytes=1024,
             history_max_bytes=1024 + one)
    before = sorted(zk_client.get_children(base),
                    key=lambda n: zk_client.exists(f"{base}/{n}").mtime)
    try:
        b.start()
        wait_until(lambda: settled([b], parts()), timeout=20, what="b settled")
        left = wait_until(lambda: total_bytes(zk_client, base) <= 1024 + one
                          and zk_client.get_children(base), timeout=20,
                          what="the group's history within its bytes")
        assert "hg_0b" in left
        others = [n for n in before if n in left]
        assert others == before[len(before) - len(others):]  # the newest kept
        assert "hg_gone7" not in left
    finally:
        b.close()


def total_bytes(zk_client, base: str) -> int:
    stats = [zk_client.exists(f"{base}/{n}") for n in zk_client.get_children(base)]
    return sum(s.dataLength for s in stats if s is not None)


def test_history_settings_are_validated():
    for bad in ({"history_records": -1}, {"history_records": True},
                {"history_node_bytes": 100}, {"history_max_members": 0},
                {"history_node_bytes": 4096, "history_max_bytes": 2048}):
        with pytest.raises(ConfigError, match="history_"):
            MessageConsumer(G, "127.0.0.1:1", **bad)


def test_history_off_writes_nothing(zk_connect, zk_client):
    publish(zk_client, 0, 2)
    a = make(zk_connect, "a", history_records=0)
    try:
        a.start()
        wait_until(lambda: settled([a], parts(n=2)), timeout=20, what="settled")
    finally:
        a.close()
    assert zk_client.exists(L.history(G)) is None


def test_garbage_in_its_own_node_is_overwritten_and_others_are_flagged(zk_connect,
                                                                       zk_client):
    publish(zk_client, 0, 2)
    zk_client.create(L.history_member(G, "hg_a"), b"\xff garbage", makepath=True)
    zk_client.create(L.history_member(G, "hg_old"), b'{"v":1}', makepath=True)
    a = make(zk_connect, "a")
    try:
        a.start()
        wait_until(lambda: settled([a], parts(n=2)), timeout=20, what="settled")
        wait_record(zk_client, "hg_a", "started")
        recs = read_history(zk_client, L, G)
        bad = [r for r in recs if r.damaged]
        assert [(r.consumer_id, r.trigger) for r in bad] == [("hg_old", "damaged")]
        assert "consumerId" in bad[0].error
        assert ownership_timeline(recs)[f"{TOPIC}/0-0"][-1].consumer_id == "hg_a"
    finally:
        a.close()


@pytest.mark.asyncio
async def test_an_asyncio_member_records_its_rebalances_too(zk_connect, zk_client, tmp_path):
    """``metaq.aio.AsyncConsumer`` runs the same coordinator: the same history."""
    import asyncio

    from metaq.aio import AsyncConsumer

    publish(zk_client, 0, 2)

    async def handle(m) -> None:  # noqa: ANN001
        pass

    c = AsyncConsumer(G, zk_connect, consumer_id="aio", zk_session_timeout=4.0,
                      recover_dir=str(tmp_path / "rs"))
    c.subscribe(TOPIC, handle)
    async with c:
        await c.start()
        await asyncio.to_thread(wait_record, zk_client, "hg_aio", "started")
    closing = await asyncio.to_thread(wait_record, zk_client, "hg_aio", "closing")
    assert set(closing.released) == set(parts(n=2))


def test_a_member_restarted_with_its_id_goes_on_with_its_history(zk_connect, zk_client):
    """A static member, or one with a fixed consumer id, restarted: the new process keeps
    the records of the one before (which may be what explains the restart)."""
    publish(zk_client, 0, 2)
    first = make(zk_connect, "s")
    first.start()
    wait_until(lambda: settled([first], parts(n=2)), timeout=20, what="first settled")
    first.close()
    wait_record(zk_client, "hg_s", "closing")
    again = make(zk_connect, "s")
    try:
        again.start()
        wait_until(lambda: settled([again], parts(n=2)), timeout=20, what="again settled")
        recs = wait_until(lambda: len(rs := records_of(zk_client, "hg_s")) >= 3 and rs,
                          timeout=20, what="both processes' records")
        assert [r.trigger for r in recs] == ["started", "closing", "started"]
        tl = ownership_timeline(recs)
        assert [(i.trigger_in, i.trigger_out) for i in tl[f"{TOPIC}/0-0"]] == [
            ("started", "closing"), ("started", None)]
    finally:
        again.close()


def test_a_failed_member_records_leaving_and_rejoining(zk_connect, zk_client, monkeypatch):
    publish(zk_client, 0, 2)
    a, b = make(zk_connect, "a"), make(zk_connect, "b")
    try:
        a.start()
        wait_until(lambda: settled([a], parts(n=2)), timeout=20, what="a settled")
        fail_next_rebalance(a, monkeypatch)
        b.start()  # a's rebalance fails: it leaves, then rejoins after a backoff
        failed = wait_record(zk_client, "hg_a", "failed")
        assert "injected coordinator bug" in failed.detail
        assert set(failed.released) == set(parts(n=2)) and failed.state == "connecting"
        back = wait_record(zk_client, "hg_a", "rejoined", failed.generation)
        assert back.detail.startswith("after a failure")
        wait_until(lambda: settled([a, b], parts(n=2)), timeout=30, what="split again")
    finally:
        a.close()
        b.close()


def test_a_broker_moving_is_recorded(zk_connect, zk_client):
    """A broker restarted on another port: nothing moves, and the record says why the
    member rebalanced."""
    from zk_layout import BrokerUri, encode_broker_uri

    publish(zk_client, 0, 2)
    master = L.broker_master(0)
    zk_client.create(master, encode_broker_uri(BrokerUri("127.0.0.1", 1)), makepath=True)
    a = make(zk_connect, "a")
    try:
        a.start()
        wait_until(lambda: settled([a], parts(n=2)), timeout=20, what="settled")
        first = wait_record(zk_client, "hg_a", "started")
        zk_client.set(master, encode_broker_uri(BrokerUri("127.0.0.1", 2)))
        moved = wait_record(zk_client, "hg_a", "broker_changed", first.generation)
        assert moved.detail == "broker 0: 127.0.0.1:1 -> 127.0.0.1:2"
        assert moved.released == moved.claimed == () and set(moved.plan) == set(parts(n=2))
    finally:
        a.close()


def test_a_static_member_away_then_its_hold_ending_is_recorded(zk_connect, zk_client):
    publish(zk_client, 0, 4)

    def static(name: str) -> MessageConsumer:
        c = MessageConsumer(G, zk_connect, instance_id=name, static_grace=2.0,
                            zk_session_timeout=4.0, commit_period=0.5)
        c.subscribe(TOPIC, lambda m: None)
        return c

    s1, s2 = static("s1"), static("s2")
    try:
        s1.start()
        s2.start()
        wait_until(lambda: settled([s1, s2], parts()), timeout=30, what="two static members")
        gen = s1.generation
        s2.close()  # away, not for good: its partitions are held for it for 2 s
        away = wait_record(zk_client, "hg_s1", "member_left", gen)
        assert away.detail == "left: hg_s2 (static: its partitions held for it)"
        assert away.claimed == () and len(away.plan) == 2
        ended = wait_record(zk_client, "hg_s1", "static_hold_ended", away.generation)
        assert ended.detail.startswith("hold ended: hg_s2")
        assert len(ended.claimed) == 2 and len(ended.plan) == 4
    finally:
        s1.close(leave=True)
        s2.close(leave=True)
