"""Group membership, rebalance and ownership against the real ZooKeeper.

These tests exercise coordination only: topics are published in ZooKeeper the
way a broker publishes them (``topics-sub`` nodes), without a broker process,
so the fetchers have nothing to pull and every observation is about the tree.
End-to-end consumption with broker processes is in test_consumer_e2e.py.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from helpers.audit import OwnerAudit
from kazoo.client import KazooClient

from metaq import MessageConsumer
from metaq.consumer import State, get_strategy
from metaq.consumer._offsets import Ownership, SessionFence, StaleOwnershipError, ZkOffsetStore
from metaq.testing import ZkProxy, expire_session, wait_until
from zk_layout import Layout, TopicBroker, encode_topic_broker

L = Layout()
TOPIC = "orders"


def publish(client: KazooClient, topic: str, broker_id: int, parts: int) -> None:
    client.create(L.topic_sub(topic, broker_id),
                  encode_topic_broker(TopicBroker(num_parts=parts, broker_id=broker_id)),
                  makepath=True)


def all_parts(brokers=(0, 1), parts=4) -> list[str]:
    return [f"{b}-{i}" for b in brokers for i in range(parts)]


def settled(consumers, parts) -> bool:
    owned = [p for c in consumers for p in c.assignment().get(TOPIC, [])]
    return (sorted(owned) == sorted(parts)
            and all(c.state is State.STABLE for c in consumers))


def make(zk_connect, name, **kw):
    kw.setdefault("zk_session_timeout", 4.0)
    kw.setdefault("commit_period", 0.5)
    revoked: list[str] = []
    c = MessageConsumer("g1", zk_connect, consumer_id=name,
                        on_revoked=lambda t, p: revoked.append(p), **kw)
    c.revoked = revoked  # type: ignore[attr-defined]
    c.subscribe(TOPIC, lambda m: None)
    return c


def test_single_consumer_registers_and_owns_every_partition(zk_connect, zk_client):
    publish(zk_client, TOPIC, 0, 4)
    publish(zk_client, TOPIC, 1, 4)
    with make(zk_connect, "a") as c:
        c.start()
        wait_until(lambda: settled([c], all_parts()), timeout=20, what="one member settled")
        cid = c.consumer_id
        assert cid == "g1_a"
        assert zk_client.get(L.consumer_id("g1", cid))[0] == TOPIC.encode()
        owners = {p: zk_client.get(L.owner("g1", TOPIC, p))[0].decode() for p in all_parts()}
        assert set(owners.values()) == {cid}
    # close leaves ZooKeeper clean: no owners, no id
    assert zk_client.get_children(L.consumer_ids("g1")) == []
    assert zk_client.get_children(L.owners_dir("g1", TOPIC)) == []
    assert not [t for t in threading.enumerate() if t.name.startswith("metaq-") and
                "g1_a" in t.name and t.is_alive()]


def test_three_members_split_partitions_exactly_as_metaq_default(zk_connect, zk_client):
    publish(zk_client, TOPIC, 0, 4)
    publish(zk_client, TOPIC, 1, 4)
    audit = OwnerAudit(zk_client, "g1", TOPIC)
    consumers = [make(zk_connect, n) for n in ("c1", "c2", "c3")]
    try:
        for c in consumers:
            c.start()
        wait_until(lambda: settled(consumers, all_parts()), timeout=30, what="group settled")
        expected = get_strategy("default").assign_all([c.consumer_id for c in consumers],
                                                      all_parts())
        for c in consumers:
            assert c.assignment()[TOPIC] == sorted(expected[c.consumer_id])
        assert audit.owners() == {p: cid for cid, ps in expected.items() for p in ps}
    finally:
        for c in consumers:
            c.close()
    # every owner change seen by the audit was either a release (None) or a live member
    ids = {c.consumer_id for c in consumers}
    for part, seq in audit.changes().items():
        assert all(o is None or o in ids for o in seq), (part, seq)


def test_join_and_leave_one_at_a_time_settles_and_never_pauses_stayers(zk_connect, zk_client):
    parts = all_parts(parts=6)
    publish(zk_client, TOPIC, 0, 6)
    publish(zk_client, TOPIC, 1, 6)
    members: list[MessageConsumer] = []
    try:
        for i in range(6):
            before = {c.consumer_id: set(c.assignment().get(TOPIC, [])) for c in members}
            revoked_before = {c.consumer_id: len(c.revoked) for c in members}
            c = make(zk_connect, f"m{i}", strategy="sticky")
            members.append(c)
            c.start()
            wait_until(lambda: settled(members, parts), timeout=30,
                       what=f"settled with {len(members)} members")
            for m in members[:-1]:
                # a partition that stayed with m was never revoked during the change
                new_revokes = set(m.revoked[revoked_before[m.consumer_id]:])
                kept = before[m.consumer_id] & set(m.assignment()[TOPIC])
                assert not (kept & new_revokes)
        while len(members) > 1:
            leaving = members.pop(0)
            before = {c.consumer_id: set(c.assignment().get(TOPIC, [])) for c in members}
            revoked_before = {c.consumer_id: len(c.revoked) for c in members}
            leaving.close()
            wait_until(lambda: settled(members, parts), timeout=30,
                       what=f"settled with {len(members)} members")
            for m in members:
                assert len(m.revoked) == revoked_before[m.consumer_id], "a stayer was paused"
                assert before[m.consumer_id] <= set(m.assignment()[TOPIC])
    finally:
        for c in members:
            c.close()


def test_claim_waits_for_a_partition_still_held_and_takes_it_when_released(
        zk_connect, zk_client):
    publish(zk_client, TOPIC, 0, 2)
    # an old owner (e.g. a Java consumer mid-shutdown) still holds 0-1
    zk_client.create(L.owner("g1", TOPIC, "0-1"), b"g1_old", makepath=True)
    with make(zk_connect, "new") as c:
        c.start()
        wait_until(lambda: c.assignment().get(TOPIC) == ["0-0"], timeout=20,
                   what="the free partition claimed")
        assert c.wait_for_state(State.CLAIMING, 10) is not None
        assert c.state is State.CLAIMING  # and stays there while 0-1 is held
        assert c.waiting() == {(TOPIC, "0-1"): "g1_old"}
        zk_client.delete(L.owner("g1", TOPIC, "0-1"))
        wait_until(lambda: c.assignment().get(TOPIC) == ["0-0", "0-1"], timeout=10,
                   what="the released partition claimed")
        settled = c.wait_for_state(State.STABLE, 10)
        assert settled is not None and settled.previous is State.CLAIMING


def test_broker_partitions_appearing_and_vanishing_rebalance(zk_connect, zk_client):
    publish(zk_client, TOPIC, 0, 2)
    with make(zk_connect, "a") as c:
        c.start()
        wait_until(lambda: settled([c], ["0-0", "0-1"]), timeout=20, what="first broker")
        publish(zk_client, TOPIC, 1, 2)
        wait_until(lambda: settled([c], ["0-0", "0-1", "1-0", "1-1"]), timeout=20,
                   what="second broker's partitions")
        zk_client.delete(L.topic_sub(TOPIC, 0))
        wait_until(lambda: settled([c], ["1-0", "1-1"]), timeout=20,
                   what="first broker's partitions dropped")
        assert zk_client.get_children(L.owners_dir("g1", TOPIC)) == ["1-0", "1-1"] or \
            sorted(zk_client.get_children(L.owners_dir("g1", TOPIC))) == ["1-0", "1-1"]


def test_an_owner_node_left_by_a_release_cut_short_is_deleted_by_the_next_rebalance(
        zk_connect, zk_client):
    """The connection drops while a release deletes the owner node, and comes back in the
    same session: the node must still go, or the member the partition moves to waits
    for it for good (chaos seed 1919940869 found a group stalled so)."""
    from kazoo.exceptions import ConnectionLoss

    publish(zk_client, TOPIC, 0, 2)
    publish(zk_client, TOPIC, 1, 2)
    with make(zk_connect, "a") as c:
        c.start()
        wait_until(lambda: settled([c], all_parts(parts=2)), timeout=20, what="settled")
        client = c._client
        real, cut = client.transaction, []

        def transaction():
            # a release is one transaction (offset write + owner delete) per partition:
            # the first one fails as if the connection dropped mid-call
            tx = real()
            commit = tx.commit_async

            def commit_async():
                owners = [op.path for op in tx.operations if "/owners/" in op.path]
                if owners and not cut:
                    cut.extend(owners)
                    result = client.handler.async_result()
                    result.set_exception(ConnectionLoss())
                    return result
                return commit()

            tx.commit_async = commit_async
            return tx

        client.transaction = transaction
        zk_client.delete(L.topic_sub(TOPIC, 0))
        wait_until(lambda: cut, timeout=20, what="a release cut short")
        wait_until(lambda: sorted(zk_client.get_children(L.owners_dir("g1", TOPIC)))
                   == ["1-0", "1-1"], timeout=20,
                   what="the owner node the cut release left deleted")
        wait_until(lambda: settled([c], ["1-0", "1-1"]), timeout=20, what="settled again")


def test_session_expiry_drops_ownership_and_rejoins(zk_connect, zk_client, zk_server):
    publish(zk_client, TOPIC, 0, 4)
    client = KazooClient(hosts=zk_connect, timeout=4.0)
    client.start(timeout=20)
    consumer = MessageConsumer("g1", client, consumer_id="x", zk_session_timeout=4.0,
                               commit_period=0.2)
    consumer.subscribe(TOPIC, lambda m: None)
    try:
        consumer.start()
        wait_until(lambda: settled([consumer], all_parts((0,))), timeout=20, what="settled")
        gen = consumer.generation
        old_session = client.client_id[0]
        expire_session(client, zk_server.hosts)
        wait_until(lambda: client.client_id and client.client_id[0] != old_session
                   and settled([consumer], all_parts((0,))), timeout=30,
                   what="re-registered in a new session and settled")
        assert consumer.generation > gen
        # the owner nodes belong to the new session
        for p in all_parts((0,)):
            _, stat = zk_client.get(L.owner("g1", TOPIC, p))
            assert stat.ephemeralOwner == client.client_id[0]
    finally:
        consumer.close()
        client.stop()
        client.close()


def test_fenced_commit_refused_after_the_session_that_claimed_ended(zk_connect, zk_client):
    fence = SessionFence()
    store = ZkOffsetStore(zk_client, L, "g1", fence)
    owner = L.owner("g1", TOPIC, "0-0")
    zk_client.create(owner, b"g1_me", ephemeral=True, makepath=True)
    own = Ownership(owner_path=owner, version=0, epoch=fence.epoch)
    store.commit(TOPIC, "0-0", 7, 100, own)
    assert zk_client.get(L.offset("g1", TOPIC, "0-0"))[0] == b"7-100"
    fence.lost()  # what the LOST listener does
    with pytest.raises(StaleOwnershipError):
        store.commit(TOPIC, "0-0", 8, 200, own)
    # a zombie whose owner node was deleted (ownership moved) is refused by the check
    zk_client.delete(owner)
    own2 = Ownership(owner_path=owner, version=0, epoch=fence.epoch)
    with pytest.raises(StaleOwnershipError):
        store.commit(TOPIC, "0-0", 9, 300, own2)
    assert zk_client.get(L.offset("g1", TOPIC, "0-0"))[0] == b"7-100"
    assert store.load(TOPIC, "0-0").offset == 100


def test_offsets_written_by_java_metaq_are_read(zk_connect, zk_client):
    store = ZkOffsetStore(zk_client, L, "g1", SessionFence())
    zk_client.create(L.offset("g1", TOPIC, "0-0"), b"-1-0", makepath=True)
    zk_client.create(L.offset("g1", TOPIC, "0-1"), b"4096", makepath=True)
    zk_client.create(L.offset("g1", TOPIC, "0-10"), b"123-4096", makepath=True)
    assert store.load(TOPIC, "0-0").offset == 0
    assert store.load(TOPIC, "0-1").offset == 4096 and store.load(TOPIC, "0-1").msg_id is None
    assert store.load(TOPIC, "0-10").msg_id == 123
    assert store.load(TOPIC, "1-0") is None


def test_every_state_transition_of_a_member_is_numbered_and_waitable(zk_connect, zk_client,
                                                                     zk_server):
    """Not only the settled state: each transition the coordinator makes gets the next
    id and can be waited for after it passed (issue 25), with the generation it began."""
    from metaq.consumer._lifecycle import TRANSITIONS

    publish(zk_client, TOPIC, 0, 4)
    client = KazooClient(hosts=zk_connect, timeout=4.0)
    client.start(timeout=20)
    a = MessageConsumer("g1", client, consumer_id="a", zk_session_timeout=4.0,
                        commit_period=0.5)  # its session is expired below
    a.subscribe(TOPIC, lambda m: None)
    b = make(zk_connect, "b")
    coord = a._coordinator
    try:
        assert (coord.state_id, a.state) == (0, State.INIT)
        a.start()
        joined = coord.wait_for(State.STABLE, 20)
        assert joined is not None and a.wait_settled(0)
        first = coord.life.transitions()[:4]
        assert [(t.id, t.state, t.generation) for t in first] == [
            (0, State.INIT, 0), (1, State.CONNECTING, 0), (2, State.REBALANCING, 1),
            (3, State.STABLE, 1)]
        # a newcomer moves a: the rebalance is seen even once a has settled again
        mark = coord.state_id
        b.start()
        wait_until(lambda: settled([a, b], all_parts((0,))), timeout=20, what="two settled")
        moved = coord.wait_for(State.REBALANCING, 0, after=mark)
        assert moved is not None and moved.generation > joined.generation
        assert coord.wait_for(State.STABLE, 0, after=moved.id) is not None
        # the session lost: CONNECTING in a new generation, then back
        mark = coord.state_id
        expire_session(client, zk_server.hosts)
        lost = coord.wait_for(State.CONNECTING, 30, after=mark)
        assert lost is not None and lost.reason == "ZooKeeper session lost"
        assert coord.wait_for(State.STABLE, 30, after=lost.id) is not None
        a.close()
        assert coord.wait_for(State.CLOSED, 0) is not None
        kept = coord.life.transitions()
        assert [t.id for t in kept] == list(range(len(kept)))
        for before, after in itertools.pairwise(kept):
            assert after.previous is before.state and after.state in TRANSITIONS[before.state]
            assert after.generation >= before.generation
    finally:
        a.close()
        b.close()
        client.stop()
        client.close()


def test_the_coordinator_sleeps_while_its_connection_is_down(zk_connect, zk_client,
                                                            zk_server, monkeypatch):
    """Its ZooKeeper timers (the heartbeat, claim and retry backoffs) wait for the
    connection: while it is down the coordinator thread sleeps until the reconnection
    (or the commit timer) wakes it.  It used to turn without pause for the whole
    outage: the heartbeat, due but skipped while disconnected, held its wait at zero."""
    publish(zk_client, TOPIC, 0, 2)
    chroot = zk_connect[len(zk_server.hosts):]
    with ZkProxy(zk_server.hosts) as proxy:
        client = KazooClient(hosts=proxy.hosts + chroot, timeout=10.0)
        c = MessageConsumer("g1", client, consumer_id="a", zk_session_timeout=10.0)
        c.subscribe(TOPIC, lambda m: None)
        coord = c._coordinator
        turns = {"n": 0}
        real_turn = coord._turn

        def counted() -> bool:
            turns["n"] += 1
            return real_turn()

        monkeypatch.setattr(coord, "_turn", counted)
        try:
            client.start(timeout=30)
            c.start()
            wait_until(lambda: settled([c], all_parts((0,), 2)), timeout=20, what="settled")
            proxy.down()  # the session lives on (10 s); the heartbeat is due every 1.7 s
            assert coord.wait_for(State.SUSPENDED, 20) is not None
            before = turns["n"]
            time.sleep(3.0)  # the interval measured, not a wait for something
            during = turns["n"] - before
            proxy.up()
            assert coord.wait_for(State.STABLE, 20) is not None
            assert during <= 3, f"{during} turns in 3 s while disconnected"
        finally:
            c.close()
            client.stop()
            client.close()
