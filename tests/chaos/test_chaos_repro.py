"""Smallest reproductions of bugs the chaos suite found (xfail until fixed).

Each test builds exactly the situation the chaos audit caught, deterministically,
and asserts the correct behaviour; ``xfail(strict=True)`` turns into a failure
once the bug is fixed, so the mark is removed with the fix.
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
from metaq.testing import wait_until
from zk_layout import Layout, decode_offset

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
