"""`what_if` (and `metaq group what-if`) against what a real group then computes.

A real ZooKeeper and real members (``MessageConsumer``, each with its own session);
topics are published as a broker publishes them (``topics-sub``), without broker
processes: assignment is coordination only.  Each test snapshots the live tree,
asks what-if for a change, makes the same change for real and waits until the
group settles: the owner nodes must be exactly the plan what-if gave.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.group_nodes import owners as group_owners
from kazoo.client import KazooClient

from metaq import ConfigError, MessageConsumer
from metaq._insight import hypothetical_ids, what_if
from metaq.consumer import STRATEGIES, State
from metaq.testing import wait_until
from zk_layout import Layout, TopicBroker, encode_topic_broker, take_snapshot

L = Layout()
TOPIC = "orders"
GROUP = "wg"
#: 2 brokers x 5 partitions: 10 partitions, string order 0-0..0-4,1-0..1-4
PARTS = [f"{b}-{i}" for b in (0, 1) for i in range(5)]


@pytest.fixture
def topic(zk_client: KazooClient) -> None:
    for b in (0, 1):
        zk_client.create(L.topic_sub(TOPIC, b),
                         encode_topic_broker(TopicBroker(num_parts=5, broker_id=b)),
                         makepath=True)


def member(zk_connect: str, name: str, strategy: str, **kw) -> MessageConsumer:
    kw.setdefault("zk_session_timeout", 4.0)
    kw.setdefault("commit_period", 0.5)
    if "instance_id" not in kw:
        kw["consumer_id"] = name
    c = MessageConsumer(GROUP, zk_connect, strategy=strategy, **kw)
    c.subscribe(TOPIC, lambda m: None)
    c.start()
    return c


def owners(zk_client: KazooClient) -> dict[str, str]:
    return group_owners(zk_client, GROUP, TOPIC, L)


def settled(zk_client: KazooClient, consumers: list[MessageConsumer],
            expect_owned: int = len(PARTS)) -> bool:
    """Every member stable, each one's assignment exactly its owner nodes, and
    ``expect_owned`` partitions owned in all."""
    if not all(c.state is State.STABLE for c in consumers):
        return False
    own = owners(zk_client)
    if len(own) != expect_owned:
        return False
    return all(sorted(c.assignment().get(TOPIC, [])) ==
               sorted(p for p, o in own.items() if o == c.consumer_id) for c in consumers)


def wait_settled(zk_client, consumers, expect_owned=len(PARTS)) -> dict[str, str]:
    wait_until(lambda: settled(zk_client, consumers, expect_owned), timeout=40,
               what="group settled")
    return owners(zk_client)


def owned_by(plan: dict[str, list[str]]) -> dict[str, str]:
    return {p: m for m, ps in plan.items() for p in ps}


def close_all(consumers) -> None:
    for c in consumers:
        c.close()


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_what_if_add_and_remove_match_the_group(zk_connect, zk_client, topic, strategy):
    live = [member(zk_connect, n, strategy) for n in ("m1", "m3", "m5")]
    try:
        before = wait_settled(zk_client, live)
        snap = take_snapshot(zk_client)
        assert strategy in what_if(snap, GROUP).current_strategies
        # the owners may fit several strategies (default and sticky agree on a fresh
        # group): say which the group runs
        w = what_if(snap, GROUP, add_ids=[f"{GROUP}_m2", f"{GROUP}_m9"], strategy=strategy)
        assert w.current[TOPIC] == {m: [p for p in PARTS if before[p] == m]
                                    for m in sorted(set(before.values()))}
        # the change, for real: two members join
        if STRATEGIES[strategy].uses_previous:
            # sticky plans from the owners it reads: two members joining in one rebalance
            # and one after the other (the group settled between) end differently, and
            # which happens is timing.  One at a time is deterministic: check that.
            w = what_if(snap, GROUP, add_ids=[f"{GROUP}_m2"], strategy=strategy)
            live.append(member(zk_connect, "m2", strategy))
            between = wait_settled(zk_client, live)
            assert between == owned_by(w.new[TOPIC])
            assert w.moved == sum(before[p] != between[p] for p in PARTS)
            w = what_if(take_snapshot(zk_client), GROUP, add_ids=[f"{GROUP}_m9"],
                        strategy=strategy)
            before = between
            live.append(member(zk_connect, "m9", strategy))
        else:
            live += [member(zk_connect, n, strategy) for n in ("m2", "m9")]
        after = wait_settled(zk_client, live)
        assert after == owned_by(w.new[TOPIC])
        assert w.moved == sum(before[p] != after[p] for p in PARTS)
        assert sum(w.load.values()) == len(PARTS) and set(w.load) == set(w.new_members)
        assert {m for m, n in w.load.items() if n} == set(after.values())

        # one leaves for good
        snap = take_snapshot(zk_client)
        w = what_if(snap, GROUP, remove=["m3"], strategy=strategy)  # the part after <group>_
        assert w.removed == (f"{GROUP}_m3",)
        gone = next(c for c in live if c.consumer_id == f"{GROUP}_m3")
        gone.close()
        live.remove(gone)
        final = wait_settled(zk_client, live)
        assert final == owned_by(w.new[TOPIC])
        assert w.moved == sum(after[p] != final[p] for p in PARTS)
    finally:
        close_all(live)


@pytest.mark.parametrize("to", ["consist", "cooperative", "roundrobin", "default"])
def test_what_if_strategy_switch_matches_the_group_restarted_with_it(
        zk_connect, zk_client, topic, to):
    """Switching strategy means restarting every member with the new one (members of
    one group must agree); ``sticky`` is left out: its plan depends on the owners at
    the moment it runs, which a restart releases."""
    start = "roundrobin" if to == "default" else "default"
    names = ("a1", "b2", "c3", "d4")
    live = [member(zk_connect, n, start) for n in names]
    try:
        wait_settled(zk_client, live)
        w = what_if(take_snapshot(zk_client), GROUP, strategy=to)
        assert w.strategy == to and w.new_members == w.members
        close_all(live)
        live = [member(zk_connect, n, to) for n in names]
        assert wait_settled(zk_client, live) == owned_by(w.new[TOPIC])
    finally:
        close_all(live)


def test_what_if_counts_an_away_static_member_as_the_group_does(zk_connect, zk_client, topic):
    """A static member away within its grace is planned for (its share held, owned by
    nobody): what-if's new plan holds its share for it too; removing it (leaving for good)
    is what the group computes once it left."""
    live = [member(zk_connect, "", "default", instance_id=i, static_grace=120.0)
            for i in ("s1", "s2", "s3")]
    try:
        wait_settled(zk_client, live)
        away = live.pop(1)
        away.close(leave=False)                                   # held for 120 s
        wait_until(lambda: f"{GROUP}_s2" not in zk_client.get_children(
            L.consumer_ids(GROUP)), timeout=20, what="s2's id node gone")
        snap = take_snapshot(zk_client)
        w = what_if(snap, GROUP, add_ids=[f"{GROUP}_s4"])
        assert f"{GROUP}_s2" in w.members                          # held: still counted
        held_share = set(w.new[TOPIC][f"{GROUP}_s2"])
        assert held_share
        live.append(member(zk_connect, "", "default", instance_id="s4", static_grace=120.0))
        got = wait_settled(zk_client, live, expect_owned=len(PARTS) - len(held_share))
        plan = owned_by(w.new[TOPIC])
        assert got == {p: m for p, m in plan.items() if m != f"{GROUP}_s2"}

        w = what_if(take_snapshot(zk_client), GROUP, remove=[f"{GROUP}_s2"])
        assert any("static member" in n for n in w.notes)
        away = member(zk_connect, "", "default", instance_id="s2", static_grace=120.0)
        wait_settled(zk_client, [*live, away])                     # back ...
        away.close(leave=True)                                     # ... then gone for good
        assert wait_settled(zk_client, live) == owned_by(w.new[TOPIC])
    finally:
        close_all(live)


def test_unnamed_members_land_after_their_hosts_default_ids(zk_connect, zk_client, topic):
    """``--add N`` names members ``<group>_<host>-whatif-<k>``: a member without a
    configured id is ``<group>_<ip>-<pid>-<uuid>``, so on its host it lands after
    the members whose pid sorts before its own, before any later host."""
    ids = ["10.0.0.1-4100-aa", "10.0.0.2-900-bb", "10.0.0.3-77-cc"]
    live = [member(zk_connect, n, "default") for n in ids]
    try:
        wait_settled(zk_client, live)
        w = what_if(take_snapshot(zk_client), GROUP, add=1, host="10.0.0.2")
        assert w.added == (f"{GROUP}_10.0.0.2-whatif-1",)
        live.append(member(zk_connect, "10.0.0.2-901-dd", "default"))  # a later pid
        got = wait_settled(zk_client, live)
        new = {m.replace("whatif-1", "901-dd"): ps for m, ps in w.new[TOPIC].items()}
        assert got == owned_by(new)
    finally:
        close_all(live)
    assert hypothetical_ids("g", 2, host="h", taken=["g_h-whatif-1"]) == \
        ["g_h-whatif-2", "g_h-whatif-3"]


def test_what_if_names_bad_input(zk_connect, zk_client, topic):
    live = [member(zk_connect, "x1", "default")]
    try:
        wait_settled(zk_client, live)
        snap = take_snapshot(zk_client)
        with pytest.raises(ConfigError, match="no member 'nobody'.*wg_x1"):
            what_if(snap, GROUP, remove=["nobody"])
        with pytest.raises(ConfigError, match="no consumer group 'nope'"):
            what_if(snap, "nope")
        with pytest.raises(ConfigError, match="unknown assignment strategy 'range'"):
            what_if(snap, GROUP, strategy="range")
        with pytest.raises(ConfigError, match="already a member"):
            what_if(snap, GROUP, add_ids=[f"{GROUP}_x1"])
        with pytest.raises(ConfigError, match=">= 0"):
            what_if(snap, GROUP, add=-1)
    finally:
        close_all(live)


def test_cli_what_if_reads_only_and_prints_the_plan(zk_connect, zk_client, topic):
    live = [member(zk_connect, n, "default") for n in ("p1", "p2")]
    try:
        before = wait_settled(zk_client, live)
        mtimes = {p: zk_client.exists(L.owner(GROUP, TOPIC, p)).mzxid for p in PARTS}
        run = subprocess.run(
            [sys.executable, "-m", "metaq", "group", "what-if", GROUP, "--zk", zk_connect,
             "--add", "2", "--host", "10.9.9.9", "--remove", "p1", "--json"],
            capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        w = what_if(take_snapshot(zk_client), GROUP, add=2, host="10.9.9.9", remove=["p1"])
        assert out == json.loads(json.dumps(w.to_json()))
        assert out["strategy"] == "default" and out["moved"] == w.moved > 0
        assert out["added"] == ["wg_10.9.9.9-whatif-1", "wg_10.9.9.9-whatif-2"]
        # nothing written
        assert owners(zk_client) == before
        assert {p: zk_client.exists(L.owner(GROUP, TOPIC, p)).mzxid for p in PARTS} == mtimes
        text = subprocess.run(
            [sys.executable, "-m", "metaq", "group", "what-if", GROUP, "--zk", zk_connect,
             "--add", "1", "--strategy", "roundrobin"],
            capture_output=True, text=True, timeout=60)
        assert text.returncode == 0, text.stderr
        assert "strategy roundrobin" in text.stdout and "partition(s) move" in text.stdout
        bad = subprocess.run(
            [sys.executable, "-m", "metaq", "group", "what-if", GROUP, "--zk", zk_connect,
             "--remove", "ghost"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "no member 'ghost'" in bad.stderr
        assert "Traceback" not in bad.stderr
    finally:
        close_all(live)


def test_docstring_examples():
    import doctest

    from metaq._insight import _whatif
    result = doctest.testmod(_whatif)
    assert result.attempted > 0 and result.failed == 0
