"""Smallest reproductions of bugs the chaos suite found (each fails without its fix).

Each test builds exactly the situation the chaos audit caught, deterministically,
and asserts the correct behaviour.  A new reproduction may land before its fix as
``xfail(strict=True)`` (which fails once the bug is fixed); the mark goes with the fix.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from _chaos_procs import Event, Member
from helpers.procs import start_broker
from kazoo.client import KazooClient

from metaq import MessageConsumer, Producer
from metaq.consumer import State
from metaq.consumer._view import GroupView
from metaq.testing import ZkProxy, wait_until
from zk_layout import (
    BrokerUri,
    Layout,
    TopicBroker,
    Topology,
    decode_offset,
    encode_broker_uri,
    encode_topic_broker,
)

pytestmark = pytest.mark.broker

TOPIC = "frozen"
GROUP = "g"
L = Layout()


def test_member_frozen_after_claim_delivers_nothing_once_its_session_ended(
        zk_server, zk_connect, zk_client, tmp_path):
    chroot = zk_connect[len(zk_server.hosts):]
    events: list[Event] = []
    lock = threading.Lock()
    with start_broker(zk_connect, 0, tmp_path / "b0", {TOPIC: 1}) as broker:
        with Producer(zk_connect) as producer:
            for f in [producer.send_async(TOPIC, b"m%d" % i) for i in range(50)]:
                f.result(timeout=30)
        a = Member(0, group=GROUP, topic=TOPIC, node_hosts=[zk_server.hosts], chroot=chroot,
                   log_dir=tmp_path, session_timeout=3.0, commit_period=0.2, max_size=4096,
                   sink=events, sink_lock=lock, extra=("--sigstop-on-assign",))
        b_seen: list[int] = []
        b = MessageConsumer(GROUP, zk_connect, consumer_id="b", zk_session_timeout=10.0,
                            commit_period=0.1, fetch_runner_count=1)
        b.subscribe(TOPIC, lambda m: b_seen.append(m.offset))
        try:
            a.start()
            # a claimed 0-0, loaded its offset, and froze in on_assigned: before fetching
            wait_until(a.stopped_by_itself, timeout=30, what="a to freeze in on_assigned")
            assert [e.part for e in events if e.kind == "A"] == ["0-0"]
            a.block_zk()  # what a hears from ZooKeeper after it thaws: nothing yet
            wait_until(lambda: zk_client.exists(f"{L.consumer_ids(GROUP)}/{GROUP}_c0") is None,
                       timeout=30, what="a's session to expire on the server")
            b.start()
            with broker.connection() as conn:
                end = conn.offset(TOPIC, GROUP, 0, 2**63 - 1)
            offset_path = L.offset(GROUP, TOPIC, "0-0")
            wait_until(lambda: zk_client.exists(offset_path) and decode_offset(
                zk_client.get(offset_path)[0]).offset == end, timeout=30,
                what="b to consume and commit everything")
            a.resume()
            wait_until(lambda: any(e.kind == "Z" and e.body == "SUSPENDED" for e in events),
                       timeout=30, what="a to notice its silent ZooKeeper connection")
            zombie = [e.offset for e in events if e.kind == "M"]
            assert not zombie, (
                f"a delivered {len(zombie)} messages (offsets {zombie[0]}..{zombie[-1]}) "
                f"after its session had ended and b had committed up to {end}")
        finally:
            b.close()
            a.close()


class _Records(logging.Handler):
    def __init__(self, needle: str) -> None:
        super().__init__(logging.DEBUG)
        self.needle = needle
        self.count = 0
        self.last = 0.0

    def emit(self, record: logging.LogRecord) -> None:
        if self.needle in record.getMessage():
            self.count += 1
            self.last = time.monotonic()


def test_member_restarted_before_its_old_session_expired_joins_once_it_does(
        zk_server, zk_connect, zk_client):
    path = f"{L.consumer_ids(GROUP)}/{GROUP}_x"
    predecessor = KazooClient(hosts=zk_connect, timeout=10.0)  # the crashed incarnation
    predecessor.start(timeout=30)
    predecessor.create(path, TOPIC.encode(), ephemeral=True, makepath=True)
    failures = _Records("is registered by another session")
    logger = logging.getLogger("metaq.consumer._coordinator")
    logger.addHandler(failures)
    consumer = MessageConsumer(GROUP, zk_connect, consumer_id="x", commit_period=0.1,
                               zk_session_timeout=10.0)
    consumer.subscribe(TOPIC, lambda m: None)
    try:
        consumer.start()
        t0 = time.monotonic()
        # Failed at least once, then either no retry for longer than the largest
        # backoff (7.5 s: the retries stopped) or 12 s of retrying (they go on).
        wait_until(lambda: failures.count >= 1 and (time.monotonic() - failures.last > 8.0
                                                    or time.monotonic() - t0 > 12.0),
                   timeout=60, interval=0.1, what="the member to fail registering")
        predecessor.stop()  # the old session ends: its ids node goes
        predecessor.close()
        wait_until(lambda: (s := zk_client.exists(path)) is not None
                   and s.ephemeralOwner == consumer._client.client_id[0], timeout=20,
                   what="the member to register once its id is free")
    finally:
        logger.removeHandler(failures)
        consumer.close()
        predecessor.stop()
        predecessor.close()


def test_member_reconnected_in_the_same_session_still_sees_the_group(zk_server, zk_connect,
                                                                     zk_client):
    """Seen in the static chaos variant (seed 2): after a ZooKeeper leader election two
    members went on in the same session but never rebalanced again.  kazoo drops every
    watch when the connection drops (SUSPENDED), the group view asks for a rebalance, the
    coordinator takes that request while disconnected and drops it, and resumes without
    one on reconnecting in the same session: no watch is armed again, so the member no
    longer sees members come and go (nor brokers, nor static members going away)."""
    zk_client.create(L.topic_sub(TOPIC, 0),
                     encode_topic_broker(TopicBroker(num_parts=4, broker_id=0)),
                     makepath=True)
    chroot = zk_connect[len(zk_server.hosts):]
    with ZkProxy(zk_server.hosts) as proxy:
        a_client = KazooClient(hosts=proxy.hosts + chroot, timeout=10.0)
        a = MessageConsumer(GROUP, a_client, consumer_id="a", zk_session_timeout=10.0)
        b = MessageConsumer(GROUP, zk_connect, consumer_id="b", zk_session_timeout=10.0)
        for c in (a, b):
            c.subscribe(TOPIC, lambda m: None)
        try:
            a_client.start(timeout=30)
            a.start()
            b.start()
            wait_until(lambda: len(a.assignment().get(TOPIC, [])) == 2
                       and len(b.assignment().get(TOPIC, [])) == 2
                       and a.state is State.STABLE, timeout=30, what="two members settled")
            session = a_client.client_id[0]
            proxy.down()  # a's connection drops; its session lives on (10 s)
            wait_until(lambda: a.state is State.SUSPENDED, timeout=30, what="a suspended")
            proxy.up()
            wait_until(lambda: a.state is State.STABLE, timeout=30, what="a reconnected")
            assert a_client.client_id[0] == session
            b.close()  # b leaves: a must take every partition
            wait_until(lambda: len(a.assignment().get(TOPIC, [])) == 4, timeout=10,
                       what="a to take b's partitions after b left")
        finally:
            b.close()
            a.close()
            a_client.stop()
            a_client.close()


def test_group_view_learns_a_restarted_brokers_address(zk_client):
    """Seen in the static chaos variant (seed 4): after broker 0 restarted, member c1
    owned its partitions for good without fetching any (lag 1904 at the end).  Its group
    view had read broker 0's address as None while the broker was down; the broker's
    master node came back before its topic registration, so when its watch marked the
    address stale no partition of broker 0 was wanted and the view dropped the mark; then
    its partitions came back with the cached None, and no watch armed to correct it."""
    changed = threading.Event()
    view = GroupView(zk_client, L, GROUP, on_change=changed.set)
    master = L.broker_master(0)
    sub = L.topic_sub(TOPIC, 0)
    uri = encode_broker_uri(BrokerUri("127.0.0.1", 8123))
    zk_client.create(master, uri, makepath=True)
    zk_client.create(sub, encode_topic_broker(TopicBroker(num_parts=2, broker_id=0)),
                     makepath=True)

    def step(change) -> Topology:  # noqa: ANN001
        changed.clear()
        change()
        wait_until(changed.is_set, timeout=10, what="the view's watch to fire")
        return view.read([TOPIC])

    assert view.read([TOPIC]).brokers == {0: ("127.0.0.1", 8123)}
    # the broker dies: its master node goes before the view hears of its topic node
    assert step(lambda: zk_client.delete(master)).brokers == {0: None}
    assert step(lambda: zk_client.delete(sub)).partitions[TOPIC] == []
    # it restarts: master node first (nothing of broker 0 wanted yet), then its topic
    step(lambda: zk_client.create(master, uri))
    topo = step(lambda: zk_client.create(
        sub, encode_topic_broker(TopicBroker(num_parts=2, broker_id=0))))
    assert topo.partitions[TOPIC] == ["0-0", "0-1"]
    assert topo.brokers == {0: ("127.0.0.1", 8123)}
