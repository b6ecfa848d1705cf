"""Never two masters accepting puts for one broker id (issue 26): a master paused
(SIGSTOP) past its ZooKeeper session is replaced by its in-sync slave; when it
resumes, a put that was waiting for it is refused (its lease ran out while it
was paused), it steps down, cuts back what the new master never had, and
follows.  Over rounds of pauses, with a producer running throughout, every
acknowledged message stays readable at its acknowledged offset."""

from __future__ import annotations

import threading

from test_failover import SYNC, read_all, replication_state, steady_producer

from metaq import BrokerError
from metaq.protocol import CHECKSUM_MASK, crc32
from metaq.testing import wait_until


def test_paused_master_resumes_refusing_puts_and_steps_down(zk_connect, broker_factory,
                                                           tmp_path):
    topics = {"s": 1}
    a = broker_factory(topics, zk_connect=zk_connect, process=True, group_commit=True,
                       data_dir=tmp_path / "a", zk_session_timeout=3.0,
                       extra_args=[*SYNC, "--auto-promote"])
    b = broker_factory({}, zk_connect=zk_connect, process=True, group_commit=True,
                       data_dir=tmp_path / "b", zk_session_timeout=3.0,
                       extra_args=["--slave-of", "0", "--slave-id", "1", *SYNC,
                                   "--auto-promote"])
    replica = {a: 0, b: 1}
    acked: list = []
    errors: list = []
    stop = threading.Event()
    wait_until(lambda: 1 in replication_state(zk_connect).in_sync, 20,
               what="replica 1 in sync")
    t = steady_producer(zk_connect, "s", acked, errors, stop)
    refused = []
    try:
        leader, follower = a, b
        for round_ in range(2):
            wait_until(lambda r=round_: len(acked) > (r + 1) * 200, 30,
                       what=f"sends in round {round_}")
            epoch = replication_state(zk_connect).epoch
            with leader.connection() as conn:
                leader.pause()
                body = b"sent to a paused master"
                opaque = conn.send_put("s", 0, body, 0, crc32(body) & CHECKSUM_MASK)
                wait_until(lambda e=epoch, f=replica[follower]:
                           (st := replication_state(zk_connect)).epoch > e and st.master == f,
                           30,
                           what="the slave to take over")
                leader.resume()
                try:
                    conn.read_result(opaque)
                except BrokerError as e:
                    refused.append(e.code)
                else:
                    raise AssertionError("the old master accepted a put after it was replaced")
            wait_until(lambda r=replica[leader]: r in replication_state(zk_connect).in_sync, 30,
                       what="the old master to rejoin in sync")
            leader, follower = follower, leader
        n = len(acked)
        wait_until(lambda: len(acked) > n + 100, 30, what="sends after the last round")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[:3]
    assert refused == [503, 503], refused
    served = read_all(leader, topics)
    lost = [(p, o, body) for p, o, body in acked if served.get((p, o)) != body]
    assert not lost, f"{len(lost)} acknowledged messages lost, first {lost[:3]}"
    wait_until(lambda: read_all(follower, topics) == read_all(leader, topics), 20,
               what="both replicas to hold the same log")
