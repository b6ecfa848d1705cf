"""Transactions across a failover (issue 26): a master's prepared XA branches reach
its slaves (``txlog``), so a promoted slave knows every prepared branch, never
commits one twice, and never resurrects one that was finished.  Real broker
processes, killed with SIGKILL, their data directories deleted."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from helpers.raw_client import RawClient
from test_failover import replication_state, stat

from metaq.protocol import (
    XA_OK,
    checksum,
    encode_put,
    encode_transaction,
    iter_messages,
    local_key,
    xa_key,
)
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

SYNC = ["--replication", "sync", "--zk-session-timeout", "3"]
TOPIC = "t"


class Tx:
    """Transaction commands over one raw connection."""

    def __init__(self, port: int) -> None:
        self.c = RawClient(port)
        self.opaque = 10

    def __call__(self, key: str, type: str, uq: str | None = "node1"):
        self.opaque += 1
        return self.c.call(encode_transaction(key, "s1", type, self.opaque,
                                              unique_qualifier=uq))

    def put(self, key: str, body: bytes, partition: int = 0):
        self.opaque += 1
        return self.c.call(encode_put(TOPIC, partition, body, 0, checksum(body), self.opaque,
                                      tx_key=key))

    def recover(self) -> list[str]:
        body = self("null", "RECOVER", "node1").body.decode()
        return sorted(k for k in body.split("\r\n") if k)

    def close(self) -> None:
        self.c.close()


def bodies(port: int, partition: int = 0) -> list[bytes]:
    with RawClient(port) as c:
        return [bytes(m.payload) for m in iter_messages(c.log(TOPIC, partition))]


def start_pair(broker_factory, zk_connect, tmp_path, *, auto: bool = True):
    master = broker_factory({TOPIC: 2}, zk_connect=zk_connect, process=True, group_commit=True,
                            data_dir=tmp_path / "m", zk_session_timeout=3.0, extra_args=SYNC)
    args = ["--slave-of", "0", "--slave-id", "1", *SYNC] + (["--auto-promote"] if auto else [])
    slave = broker_factory({}, zk_connect=zk_connect, process=True, group_commit=True,
                           data_dir=tmp_path / "s", zk_session_timeout=3.0, extra_args=args)
    wait_until(lambda: (st := replication_state(zk_connect)) is not None and 1 in st.in_sync,
               30, what="the slave to join the in-sync set")
    return master, slave


def wait_master(proc) -> None:
    wait_until(lambda: stat(proc, "replication_role") == "master", 30,
               what="the promoted replica to lead")


def prepared_branch(tx: Tx, n: int, *bodies_: bytes) -> str:
    key = xa_key(7, b"global-%d" % n, b"branch", "node1")
    assert tx(key, "BEGIN").code == 200
    for b in bodies_:
        assert tx.put(key, b).code == 200
    ans = tx(key, "PREPARE")
    assert ans.code == 200 and ans.body == b"%d" % XA_OK, ans
    return key


def test_a_promoted_slave_knows_every_prepared_branch_and_commits_each_once(
        zk_connect, broker_factory, tmp_path):
    master, slave = start_pair(broker_factory, zk_connect, tmp_path)
    tx = Tx(master.port)
    kept = prepared_branch(tx, 1, b"kept-1", b"kept-2")      # stays prepared
    done = prepared_branch(tx, 2, b"done-1")                 # committed before the kill
    gone = prepared_branch(tx, 3, b"gone-1")                 # rolled back before the kill
    assert tx(done, "COMMIT_TWO_PHASE").code == 200
    assert tx(gone, "ROLLBACK").code == 200
    local = local_key("s1", 1)
    assert tx(local, "BEGIN", None).code == 200
    assert tx.put(local, b"in-flight local").code == 200     # never committed
    assert tx.recover() == [kept]
    tx.close()

    master.kill()
    shutil.rmtree(tmp_path / "m")  # the machine and its disk are gone
    wait_until(lambda: replication_state(zk_connect).master == 1, 30,
               what="the slave to take over")
    wait_master(slave)
    tx = Tx(slave.port)
    wait_until(lambda: tx.recover() == [kept], 20, what="the new master to list the branch")
    assert bodies(slave.port) == [b"done-1"]                 # once; nothing of the others
    assert tx(kept, "COMMIT_TWO_PHASE").code == 200
    assert bodies(slave.port) == [b"done-1", b"kept-1", b"kept-2"]
    assert tx(done, "COMMIT_TWO_PHASE").code == 500          # finished: XAER_NOTA
    assert tx(gone, "COMMIT_TWO_PHASE").code == 500
    assert bodies(slave.port) == [b"done-1", b"kept-1", b"kept-2"]
    assert tx.recover() == []
    tx.close()


def test_a_branch_prepared_on_a_new_master_reaches_the_returning_old_master(
        zk_connect, broker_factory, tmp_path):
    """After a failover by command, the old master comes back as a slave: its stale
    branches are dropped for the new master's snapshot, and a branch prepared on the
    new master survives a second failover back to it."""
    master, slave = start_pair(broker_factory, zk_connect, tmp_path, auto=False)
    tx = Tx(master.port)
    stale = prepared_branch(tx, 1, b"stale")
    assert tx(stale, "COMMIT_TWO_PHASE").code == 200
    tx.close()
    master.kill()
    out = subprocess.run([sys.executable, "-m", "metaq", "broker", "promote", "0",
                          "--replica", "1", "--zk", zk_connect],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: replication_state(zk_connect).master == 1, 30, what="promotion")
    wait_master(slave)
    tx = Tx(slave.port)
    fresh = prepared_branch(tx, 2, b"fresh-1", b"fresh-2")
    tx.close()
    master.start(wait=False)  # the old master returns: a slave of replica 1
    master.wait_serving()
    wait_until(lambda: (st := replication_state(zk_connect)) is not None and 0 in st.in_sync,
               30, what="the old master to rejoin as an in-sync slave")
    wait_until(lambda: stat(master, "replication_tx_feed").split()[1] != "0", 20,
               what="the old master to copy the new master's feed")
    slave.kill()
    out = subprocess.run([sys.executable, "-m", "metaq", "broker", "promote", "0",
                          "--replica", "0", "--zk", zk_connect],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    wait_until(lambda: replication_state(zk_connect).master == 0, 30, what="second promotion")
    wait_master(master)
    tx = Tx(master.port)
    wait_until(lambda: tx.recover() == [fresh], 20, what="the branch on the old master")
    assert tx(fresh, "COMMIT_TWO_PHASE").code == 200
    assert bodies(master.port) == [b"stale", b"fresh-1", b"fresh-2"]
    tx.close()


@pytest.mark.parametrize("what", ["prepare", "local commit"])
def test_an_answer_waits_for_every_listed_in_sync_slave(zk_connect, broker_factory, tmp_path,
                                                        what):
    """Sync replication: with the in-sync slave paused (SIGSTOP), a PREPARE (its feed
    event) or a local commit (its messages) is answered only once ZooKeeper no longer
    lists the slave: a slave that may be promoted always holds what was answered."""
    master = broker_factory({TOPIC: 1}, zk_connect=zk_connect, process=True,
                            data_dir=tmp_path / "m", zk_session_timeout=3.0,
                            extra_args=[*SYNC, "--replication-max-lag", "1"])
    slave = broker_factory({}, zk_connect=zk_connect, process=True, data_dir=tmp_path / "s",
                           zk_session_timeout=3.0,
                           extra_args=["--slave-of", "0", "--slave-id", "1", *SYNC])
    wait_until(lambda: 1 in replication_state(zk_connect).in_sync, 30, what="slave in sync")
    tx = Tx(master.port)
    key = xa_key(9, b"g", b"b", "node1") if what == "prepare" else local_key("s1", 5)
    assert tx(key, "BEGIN", "node1" if what == "prepare" else None).code == 200
    assert tx.put(key, b"waits").code == 200
    slave.pause()
    try:
        ans = tx(key, "PREPARE" if what == "prepare" else "COMMIT_ONE_PHASE",
                 "node1" if what == "prepare" else None)
        listed = replication_state(zk_connect).in_sync  # read after the answer came
    finally:
        slave.resume()
    assert ans.code == 200, ans
    assert 1 not in listed, f"answered while ZooKeeper lists the paused slave: {listed}"
    tx.close()
