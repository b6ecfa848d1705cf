"""A slave whose master comes back with a log shorter than the slave's copy says so
(issue 26: "a master whose log was cut below the slave's position reports it ... and
never silently diverges"): its ``offset`` check on connecting finds the master's end
below its own and marks the partition ``diverged``, naming both ends, instead of
reporting ``caught-up`` while the master writes other messages at the offsets it holds."""

from __future__ import annotations

import os

from helpers.procs import read_partition

from metaq import Producer
from metaq.net import BrokerConnection
from metaq.testing import wait_until


def test_a_master_back_with_a_shorter_log_is_reported_diverged(zk_connect, broker_factory,
                                                               tmp_path):
    master = broker_factory({"t": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    with Producer(zk_connect) as producer:
        for i in range(100):
            producer.send("t", b"first %d" % i)
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")
    wait_until(lambda: slave.topics.get("t") == 1
               and slave.offsets("t", 0) == master.offsets("t", 0), 20,
               what="the slave to copy the master")
    with BrokerConnection("127.0.0.1", master.port) as conn:
        cut = read_partition(conn, "t", 0)[80].offset
    copied = slave.offsets("t", 0)[1]
    slave.stop()
    master.stop()
    # the master's disk lost its last 20 messages (cut at a message boundary: a valid log)
    os.truncate(sorted((tmp_path / "m" / "t-0").glob("*.meta"))[-1], cut)
    master = broker_factory({"t": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    assert master.offsets("t", 0)[1] == cut
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")

    def state() -> dict:
        (copy,) = slave.replication_status()["copies"]
        return copy
    wait_until(lambda: state()["state"] == "diverged", 10,
               what="the slave to report the master's shorter log")
    problem = state()["problem"]
    assert f"ends at {cut}" in problem and f"end {copied}" in problem, problem
    with Producer(zk_connect) as producer:   # the master goes on; the slave copies none of it
        for i in range(20):
            producer.send("t", b"second %d" % i)
    assert state()["state"] == "diverged" and slave.offsets("t", 0)[1] == copied
