"""A ZooKeeper outage shorter than the session timeout (issue 13, finding 6): members
come back within about a second of ZooKeeper and resume without any rebalance."""

from __future__ import annotations

import threading
import time

from metaq import MessageConsumer, Producer
from metaq.testing import ZkProxy, wait_until

TOPIC = "o"


def _chroot(zk_connect: str) -> str:
    return zk_connect[zk_connect.index("/"):] if "/" in zk_connect else ""


def test_members_return_quickly_after_an_outage_without_moving_a_partition(
        zk_server, zk_connect, brokers):
    brokers(0, {TOPIC: 2})  # the broker talks to ZooKeeper directly: only members lose it
    got: list[bytes] = []
    lock = threading.Lock()

    def listener(m) -> None:  # noqa: ANN001
        with lock:
            got.append(m.raw_body)

    with ZkProxy(zk_server.hosts) as proxy, Producer(zk_connect) as producer:
        revoked: list[str] = []
        members = [MessageConsumer("og", proxy.hosts + _chroot(zk_connect), consumer_id=name,
                                   zk_session_timeout=30.0,
                                   on_revoked=lambda t, p: revoked.append(p))
                   for name in ("a", "b")]
        for c in members:
            c.subscribe(TOPIC, listener)
            c.start()
        try:
            wait_until(lambda: all(c.wait_settled(0) for c in members) and
                       sorted(p for c in members for p in c.assignment().get(TOPIC, []))
                       == ["0-0", "0-1"], 30, what="the group settled")
            producer.send(TOPIC, b"before")
            wait_until(lambda: b"before" in got, 10, what="delivery before the outage")
            owned = [c.assignment() for c in members]
            # a member that joined ahead of the other claimed both partitions and gave one
            # back: that move belongs to the joins (it happens when the machine is busy)
            revoked.clear()

            proxy.down()
            wait_until(lambda: all(c.state.value == "suspended" for c in members), 15,
                       what="members to notice the outage")
            # the fault: 8 s without ZooKeeper (kazoo's default backoff would then wait
            # up to 6.4 s more before trying again)
            threading.Event().wait(8.0)
            proxy.up()
            back = time.monotonic()
            producer.send(TOPIC, b"after")
            wait_until(lambda: b"after" in got, 10, what="delivery after the outage")
            took = time.monotonic() - back
            assert took < 3.0, f"delivery resumed {took:.1f}s after ZooKeeper was back"
            wait_until(lambda: all(c.state.value == "stable" for c in members), 10,
                       what="members stable again")
            # the group was read again (kazoo dropped the watches with the connection), and
            # nothing moved: the same partitions, none stopped
            assert [c.assignment() for c in members] == owned
            assert revoked == []
        finally:
            for c in members:
                c.close()
