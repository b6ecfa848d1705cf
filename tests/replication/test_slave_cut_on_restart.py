"""A replica started as a slave (``--slave-of``, so with no topics of its own) that
led an epoch cuts back, when it restarts as a slave of a newer epoch, what it
wrote as master and the new master never had (issue 26; found by the replicated
chaos suite: the cut ran before the copied topics were opened and was skipped)."""

from __future__ import annotations

from helpers.procs import read_partition

from metaq import Producer
from metaq.net import BrokerConnection
from metaq.testing import wait_until


def _log(port: int) -> list:
    with BrokerConnection("127.0.0.1", port) as conn:
        return read_partition(conn, "t", 0)


def test_a_slave_started_replica_cuts_what_it_wrote_as_master(zk_connect, broker_factory,
                                                              tmp_path):
    a = broker_factory({"t": 1}, zk_connect=zk_connect, data_dir=tmp_path / "a")
    b = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "b")
    with Producer(zk_connect) as producer:
        for i in range(10):
            producer.send("t", b"both %d" % i)
    wait_until(lambda: b.topics.get("t") == 1 and b.offsets("t", 0) == a.offsets("t", 0),
               20, what="replica 1 to copy the master")
    a.promote(1)  # replica 1 leads epoch 1
    wait_until(lambda: b.role == "master" and a.role == "slave", 20,
               what="replica 1 to lead, replica 0 to follow it")
    shared_end = a.offsets("t", 0)[1]
    a.stop()
    with Producer(zk_connect) as producer:  # only replica 1 has these
        for i in range(5):
            producer.send("t", b"only on replica 1 %d" % i)
    b_end = b.offsets("t", 0)[1]
    assert b_end > shared_end
    b.stop()

    a = broker_factory({"t": 1}, zk_connect=zk_connect, data_dir=tmp_path / "a")
    a.promote(0, force=True)  # replica 1 is gone: replica 0 leads epoch 2 without them
    wait_until(lambda: a.role == "master", 20, what="replica 0 to lead epoch 2")
    assert a.offsets("t", 0)[1] == shared_end
    b = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "b")
    wait_until(lambda: b.role == "slave" and b.offsets("t", 0)[1] == shared_end, 20,
               what=f"replica 1 to cut its log back from {b_end} to {shared_end}")
    assert f"replication_truncated_bytes {b_end - shared_end}" in b.stats()
    with Producer(zk_connect) as producer:  # and it copies what the new master writes
        producer.send("t", b"after the cut")
    wait_until(lambda: _log(b.port) == _log(a.port), 20, what="both replicas the same")
    assert [bytes(m.payload) for m in _log(b.port)][-1] == b"after the cut"
