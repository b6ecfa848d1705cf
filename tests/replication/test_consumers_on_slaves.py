"""Consumers on a real slave broker (issue 26): a group keeps consuming from the
slave when its master is killed, with no gap and no repeat (same offsets on both);
``read_from="slave-preferred"`` reads from the slave while the master is up."""

from __future__ import annotations

import threading

from helpers.delivery import brokers_read, check_contiguous, listener

from metaq import MessageConsumer, Producer
from metaq.testing import wait_until

TOPIC = "rs"


def _caught_up(master, slave, parts: int) -> bool:  # noqa: ANN001
    with master.connection() as m, slave.connection() as s:
        return all(m.offset(TOPIC, "x", p, 1 << 62) == s.offset(TOPIC, "x", p, 1 << 62)
                   for p in range(parts))


def test_group_finishes_from_the_real_slave_after_a_master_kill(zk_connect, broker_factory,
                                                               tmp_path):
    n = 240
    master = broker_factory({TOPIC: 2}, zk_connect=zk_connect, process=True,
                            data_dir=tmp_path / "m", zk_session_timeout=2.0)
    slave = broker_factory({}, zk_connect=zk_connect, process=True, data_dir=tmp_path / "s",
                           zk_session_timeout=2.0, extra_args=["--slave-of", "0"])
    bodies = {f"m{i:04d}-".encode() * 8 for i in range(n)}
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, b) for b in sorted(bodies)]:
            f.result(timeout=30)
    wait_until(lambda: _caught_up(master, slave, 2), 20, what="the slave to copy")
    got: list = []
    gate = threading.Event()
    with MessageConsumer("g", zk_connect, consumer_id="c1", max_fetch_delay=0.3,
                         commit_period=0.2) as c1, \
            MessageConsumer("g", zk_connect, consumer_id="c2", max_fetch_delay=0.3,
                            commit_period=0.2) as c2:
        for c in (c1, c2):  # small gets: most of the log is fetched after the kill
            c.subscribe(TOPIC, listener(got, gate, n // 3), max_size=1024).start()
        wait_until(lambda: len(got) >= n // 3, 30, what="a third consumed")
        assert brokers_read(c1, c2) == {f"127.0.0.1:{master.port}"}
        master.kill()
        master.wait_unregistered(timeout=30)
        gate.set()
        wait_until(lambda: len(got) == n, 30, what="the rest consumed from the slave")
        check_contiguous(got, bodies)
        assert brokers_read(c1, c2) == {f"127.0.0.1:{slave.port}"}


def test_slave_preferred_reads_the_real_slave(zk_connect, broker_factory, tmp_path):
    master = broker_factory({TOPIC: 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")
    got: list = []
    with MessageConsumer("g", zk_connect, read_from="slave-preferred",
                         max_fetch_delay=0.3) as c:
        c.subscribe(TOPIC, listener(got)).start()
        bodies = {b"p%d" % i for i in range(50)}
        with Producer(zk_connect) as p:
            for b in sorted(bodies):
                p.send(TOPIC, b)
        wait_until(lambda: len(got) == len(bodies), 30, what="consumed from the slave")
        check_contiguous(got, bodies)
        assert brokers_read(c) == {f"127.0.0.1:{slave.port}"}
        assert master.port != slave.port
