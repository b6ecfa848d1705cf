"""Consumers read a broker id's partitions from its master or its slaves (issue 26).

The choice (``zk_layout.BrokerReplicas.choose``, which the consumer's ``BrokerRoute``
and the Spark source apply) as pure examples; the partition list with slaves as Java's
consumer builds it; and against real ZooKeeper and real brokers (a slave emulated by a
broker serving a copy of the master's data directory, ``helpers.slaves``): a master
SIGKILLed while its group consumes (the partitions stay assigned, reads go on from the
slave with no gap and no duplicate, the admin tools keep working) and coming back
(reads move back); ``read_from="slave-preferred"`` reading from the slave while the
master is up, and moving to the master when the slave goes, dropping its held gets and
connections there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from helpers.delivery import brokers_read, check_contiguous, listener
from helpers.slaves import broker_stat, start_slave

from metaq import ConfigError, MessageConsumer, Producer
from metaq._types import BrokerAddress
from metaq.consumer._route import BrokerRoute
from metaq.consumer._subscription import PartitionState
from metaq.protocol import get_codec
from metaq.spark import FetchSettings, SourceOptions, fetch_range, offset_ranges
from metaq.testing import wait_until
from zk_layout import (
    BrokerReplicas,
    BrokerUri,
    Layout,
    TopicBroker,
    broker_replicas,
    decode_offset,
    encode_broker_uri,
    encode_topic_broker,
    partitions_for_topic,
)

L = Layout()
TOPIC, GROUP = "repl", "readers"
M, S1, S2 = ("10.0.0.1", 8123), ("10.0.0.2", 8123), ("10.0.0.3", 8123)


# ----------------------------------------------------------------------- the choice (pure)

@pytest.mark.parametrize(("replicas", "read_from", "salt", "expected"), [
    # master: Java's Cluster.getBrokerRandom -- the master when registered, else a slave
    (BrokerReplicas(M, ((1, S1),)), "master", "", M),
    (BrokerReplicas(None, ((1, S1),)), "master", "", S1),
    (BrokerReplicas(M), "master", "c1", M),
    (BrokerReplicas(), "master", "", None),
    # slave-preferred: a slave when one is registered, else the master
    (BrokerReplicas(M, ((1, S1),)), "slave-preferred", "", S1),
    (BrokerReplicas(M), "slave-preferred", "", M),
    (BrokerReplicas(), "slave-preferred", "c1", None),
    # several slaves: the empty salt takes the lowest-numbered one (broker_address's)...
    (BrokerReplicas(None, ((1, S1), (2, S2))), "master", "", S1),
    (BrokerReplicas(M, ((1, S1), (2, S2))), "slave-preferred", "", S1),
    # ... a salt (the consumer's id) slave crc32(salt) % count: crc32(b"a") is odd
    (BrokerReplicas(None, ((1, S1), (2, S2))), "master", "a", S2),
    (BrokerReplicas(M, ((1, S1), (2, S2))), "slave-preferred", "a", S2),
])
def test_choose_picks_as_documented(replicas, read_from, salt, expected):
    assert replicas.choose(read_from, salt) == expected


def test_each_consumer_keeps_its_slave_and_a_group_spreads_over_them():
    r = BrokerReplicas(M, ((1, S1), (2, S2), (7, S1[:1] + (9,))))
    picks = {f"readers_c{i}": r.choose("slave-preferred", f"readers_c{i}") for i in range(30)}
    assert all(r.choose("slave-preferred", c) == a for c, a in picks.items())  # stable
    assert set(picks.values()) == {a for _, a in r.slaves}  # every slave gets readers
    with pytest.raises(ValueError, match="read_from"):
        r.choose("slave")


def test_the_route_moves_a_broker_id_and_says_which():
    route = BrokerRoute(long_poll=True, read_from="master", salt="c1")
    pf = PartitionState(topic="t", partition="0-0", broker_id=0, index=0,
                        broker_address=BrokerAddress(*M), offset=0, msg_id=-1, max_size=1024,
                        listener=None, batch_listener=None, codec=get_codec("bytes"),
                        verify=True, max_retries=0)
    assert route.address(pf) == M and route.in_use() is None  # not told: its own address
    assert route.update({0: BrokerReplicas(M, ((1, S1),)), 1: BrokerReplicas(S2)}) == {0, 1}
    epoch = route.epoch
    assert route.update({0: BrokerReplicas(M, ((1, S1),)), 1: BrokerReplicas(S2)}) == set()
    assert route.epoch == epoch
    assert route.update({0: BrokerReplicas(None, ((1, S1),)), 1: BrokerReplicas(S2)}) == {0}
    assert route.address(pf) == S1 and route.epoch == epoch + 1
    assert route.in_use() == {S1, S2}
    assert route.update({0: BrokerReplicas(), 1: BrokerReplicas(S2)}) == {0}
    assert route.address(pf) is None  # nothing registered: the partition waits
    preferring = BrokerRoute(long_poll=False, read_from="slave-preferred")
    preferring.update({0: BrokerReplicas(M, ((1, S1),))})
    assert preferring.address(pf) == S1
    with pytest.raises(ConfigError, match="read_from"):
        BrokerRoute(long_poll=False, read_from="slaves")


def test_read_from_is_validated_in_the_consumer_and_the_spark_source():
    with pytest.raises(ConfigError, match="read_from must be 'master'.*'slave-preferred'"):
        MessageConsumer(GROUP, "127.0.0.1:1", read_from="slave")
    opts = SourceOptions.from_options({"zk.connect": "zk:2181", "topic": "t",
                                       "ReadFrom": " Slave-Preferred "})
    assert opts.read_from == "slave-preferred"
    assert SourceOptions.from_options(opts.to_options()) == opts
    assert SourceOptions.from_options({"zk.connect": "zk", "topic": "t"}).read_from == "master"
    with pytest.raises(ConfigError, match="option readFrom must be master or slave-preferred"):
        SourceOptions.from_options({"zk.connect": "zk", "topic": "t", "readFrom": "any"})


def test_partitions_of_a_broker_id_count_once_from_master_or_slave():
    """Java's ``getPartitionStringsForSubTopics``: every ``<id>-m`` / ``<id>-s<N>`` child
    gives ``<id>-0 .. <id>-(n-1)``, once per name, sorted as strings: a broker id whose
    master is down still has its partitions while a slave is up, and a group mixing
    Java and Python consumers computes the same list."""
    def tb(n, b, s=None):
        return encode_topic_broker(TopicBroker(num_parts=n, broker_id=b, slave_no=s))

    both = {"0-m": tb(2, 0), "0-s1": tb(2, 0, 1), "1-m": tb(12, 1)}
    only_slave = {"0-s1": tb(2, 0, 1), "1-m": tb(12, 1)}
    java = ["0-0", "0-1", "1-0", "1-1", "1-10", "1-11"] + [f"1-{i}" for i in range(2, 10)]
    assert [str(p) for p in partitions_for_topic(both)] == java
    assert [str(p) for p in partitions_for_topic(only_slave)] == java
    # a slave registering more partitions than its master: the union, as Java's
    assert [str(p) for p in partitions_for_topic({"0-m": tb(1, 0), "0-s2": tb(2, 0, 2)})] \
        == ["0-0", "0-1"]


def test_broker_replicas_reads_the_master_and_the_slaves(zk_client):
    fired = threading.Event()
    zk_client.create(L.broker_master(4), encode_broker_uri(BrokerUri(*M)), makepath=True)
    zk_client.create(L.broker_slave(4, 3), encode_broker_uri(BrokerUri(*S2)))
    zk_client.create(L.broker_slave(4, 1), b"meta://10.0.0.2:8123?slaveId=1")  # Java's form
    zk_client.create(L.broker_id(4) + "/slavex", b"meta://10.9.9.9:1")  # not a slave: skipped
    zk_client.create(L.broker_slave(4, 2), b"garbage")  # damaged: logged, skipped
    got = broker_replicas(zk_client, L, 4, watch=lambda _e: fired.set())
    assert got == BrokerReplicas(M, ((1, S1), (3, S2)))
    zk_client.delete(L.broker_master(4))
    wait_until(fired.is_set, 10, what="the watch on the master to fire")
    assert broker_replicas(zk_client, L, 4) == BrokerReplicas(None, ((1, S1), (3, S2)))
    assert broker_replicas(zk_client, L, 5) == BrokerReplicas()


# ------------------------------------------------------------------ real brokers, a group

def _gets(proc) -> int:  # noqa: ANN001
    with proc.connection() as c:
        return broker_stat(c.stats(), "cmd_get")


def _metaq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.broker
def test_a_killed_master_is_read_from_its_slave_then_again_when_it_returns(
        zk_connect, broker_factory, tmp_path):
    n = 240
    master = broker_factory({TOPIC: 2}, broker_id=0, zk_connect=zk_connect, process=True,
                            zk_session_timeout=2.0)
    bodies = {f"m{i:04d}-".encode() * 8 for i in range(n)}
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, b) for b in sorted(bodies)]:
            f.result(timeout=30)
    got: list = []
    gate = threading.Event()
    with start_slave(zk_connect, master.data_dir, tmp_path / "slave", {TOPIC: 2},
                     broker_id=0) as slave, \
            MessageConsumer(GROUP, zk_connect, consumer_id="c1", max_fetch_delay=0.3,
                            commit_period=0.2) as c1, \
            MessageConsumer(GROUP, zk_connect, consumer_id="c2", max_fetch_delay=0.3,
                            commit_period=0.2) as c2:
        for c in (c1, c2):  # small gets: the rest of the log is fetched after the kill
            c.subscribe(TOPIC, listener(got, gate, n // 3), max_size=1024).start()
        wait_until(lambda: len(got) >= n // 3, 30, what="a third consumed")
        assignment = {**c1.assignment(), **c2.assignment()}
        before = slave.gets()
        master.kill()  # SIGKILL mid-stream: its nodes go when its session expires
        master.wait_unregistered(timeout=30)
        gate.set()
        wait_until(lambda: len(got) == n, 30, what="the rest consumed from the slave")
        check_contiguous(got, bodies)
        assert slave.gets() > before + 10  # the rest came from the slave, get by get
        assert sorted(c1.assignment()[TOPIC] + c2.assignment()[TOPIC]) == ["0-0", "0-1"]
        assert {**c1.assignment(), **c2.assignment()}.keys() == assignment.keys()
        assert brokers_read(c1, c2) == {f"127.0.0.1:{slave.port}"}
        # the tools keep working with only the slave up
        lag = {**c1.lag(), **c2.lag()}
        assert set(lag.values()) == {0}  # asked of the slave: nothing behind
        described = _metaq("metaq", "group", "describe", GROUP, "--zk", zk_connect, "--json")
        assert described.returncode == 0, described.stderr
        rows = json.loads(described.stdout)["partitions"]
        assert {r["partition"]: r["log_end"] for r in rows} == {
            f"0-{i}": slave.broker.offsets(TOPIC, i)[1] for i in range(2)}
        brokers = _metaq("zk_layout", "--zk", zk_connect, "brokers")
        assert brokers.returncode == 0, brokers.stderr
        rows = [ln.split()[:3] for ln in brokers.stdout.splitlines()[1:] if ln.strip()]
        assert rows == [["0", "master", "(down)"],
                        ["0", "slave1", f"meta://127.0.0.1:{slave.port}?slaveId=1"]]

        master.start()  # back: reads move back to it; what it gets now only it has
        more = {f"n{i:04d}-".encode() * 8 for i in range(20)}
        with Producer(zk_connect) as p:
            for f in [p.send_async(TOPIC, b) for b in sorted(more)]:
                f.result(timeout=30)
        wait_until(lambda: len(got) == n + len(more), 30, what="the new messages from the "
                   "returned master")
        check_contiguous(got, bodies | more)
        assert _gets(master) > 0
        assert brokers_read(c1, c2) == {f"127.0.0.1:{master.port}"}


@pytest.mark.broker
def test_slave_preferred_reads_the_slave_and_falls_back_to_the_master_cleanly(
        zk_connect, broker_factory, tmp_path):
    n = 60
    master = broker_factory({TOPIC: 2}, broker_id=0, zk_connect=zk_connect)
    bodies = {f"m{i:03d}".encode() for i in range(n)}
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, b) for b in sorted(bodies)]:
            f.result(timeout=30)
    got: list = []
    with start_slave(zk_connect, master.config.data_dir, tmp_path / "slave", {TOPIC: 2},
                     broker_id=0) as slave, \
            MessageConsumer(GROUP, zk_connect, consumer_id="c1", read_from="slave-preferred",
                            max_fetch_delay=0.3, fetch_runner_count=2) as c:
        c.subscribe(TOPIC, listener(got), max_size=256).start()
        wait_until(lambda: len(got) == n, 30, what="all consumed")
        # both partitions parked with held gets on the slave; the master was never asked
        wait_until(lambda: broker_stat(slave.broker.stats(), "held_gets") == 2, 30,
                   what="held gets on the slave")
        assert slave.gets() > 0 and broker_stat(master.stats(), "cmd_get") == 0
        check_contiguous(got, bodies)

        slave.unregister()  # the slave goes (it still serves): reads move to the master
        wait_until(lambda: broker_stat(master.stats(), "held_gets") == 2, 30,
                   what="held gets on the master")
        # the old broker is let go cleanly: its held gets and every connection closed
        wait_until(lambda: broker_stat(slave.broker.stats(), "held_gets") == 0
                   and broker_stat(slave.broker.stats(), "curr_connections") == 0, 30,
                   what="the slave let go")
        more = {f"n{i:03d}".encode() for i in range(10)}
        with Producer(zk_connect) as p:
            for f in [p.send_async(TOPIC, b) for b in sorted(more)]:
                f.result(timeout=30)
        wait_until(lambda: len(got) == n + len(more), 30, what="the new messages")
        check_contiguous(got, bodies | more)


@pytest.mark.broker
def test_the_spark_source_plans_and_reads_from_the_slave_when_preferred(
        zk_connect, broker_factory, tmp_path):
    master = broker_factory({TOPIC: 2}, broker_id=0, zk_connect=zk_connect)
    bodies = {f"s{i:03d}".encode() for i in range(40)}
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, b) for b in sorted(bodies)]:
            f.result(timeout=30)
    with start_slave(zk_connect, master.config.data_dir, tmp_path / "slave", {TOPIC: 2},
                     broker_id=0) as slave:
        ranges = offset_ranges(zk_connect, TOPIC, starting="earliest",
                               read_from="slave-preferred")
        assert {r.address for r in ranges} == {("127.0.0.1", slave.port)}
        read = [m.value for r in ranges
                for m in fetch_range(r, zk_connect=zk_connect, read_from="slave-preferred")]
        assert sorted(read) == sorted(bodies)
        assert slave.gets() > 0 and broker_stat(master.stats(), "cmd_get") == 0
        ranges = offset_ranges(zk_connect, TOPIC, starting="earliest")  # master's rule
        assert {r.address for r in ranges} == {("127.0.0.1", master.port)}
    with pytest.raises(ConfigError, match="read_from"):
        FetchSettings(read_from="slave")


@pytest.mark.broker
def test_a_slave_behind_the_committed_position_is_waited_for_never_reset(
        zk_connect, zk_client, broker_factory, tmp_path):
    master = broker_factory({TOPIC: 2}, broker_id=0, zk_connect=zk_connect)
    old = {f"o{i:03d}".encode() for i in range(30)}
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, b) for b in sorted(old)]:
            f.result(timeout=30)
    slave = start_slave(zk_connect, master.config.data_dir, tmp_path / "slave", {TOPIC: 2},
                        broker_id=0, register=False)
    with slave:
        with Producer(zk_connect) as p:  # the slave has not copied these (yet)
            for f in [p.send_async(TOPIC, f"x{i}".encode()) for i in range(10)]:
                f.result(timeout=30)
        ends = {f"0-{i}": master.offsets(TOPIC, i)[1] for i in range(2)}
        seen: list = []
        with MessageConsumer(GROUP, zk_connect, consumer_id="c0") as c0:  # up to the end
            c0.subscribe(TOPIC, listener(seen)).start()
            wait_until(lambda: len(seen) == 40, 30, what="the whole log consumed")
        d = L.offsets_dir(GROUP, TOPIC)
        assert {p: decode_offset(zk_client.get(f"{d}/{p}")[0]).offset
                for p in zk_client.get_children(d)} == ends  # committed on close
        slave.register()
        got: list = []
        with MessageConsumer(GROUP, zk_connect, consumer_id="c1", read_from="slave-preferred",
                             max_fetch_delay=0.2) as c1:
            c1.subscribe(TOPIC, listener(got)).start()
            # each partition's committed position is above the slave's end: it asks the
            # slave where its log ends, waits, and asks again (twice each, at least)
            wait_until(lambda: got or broker_stat(slave.broker.stats(), "cmd_offset") >= 8,
                       30, what="the slave asked about the positions again (or a reset)")
            assert got == [] and c1.metrics()["offset_resets"] == 0 and not c1.errors()
            slave.unregister()  # to the master, from the committed positions
            new = {f"n{i}".encode() for i in range(6)}
            with Producer(zk_connect) as p:
                for f in [p.send_async(TOPIC, b) for b in sorted(new)]:
                    f.result(timeout=30)
            wait_until(lambda: len(got) == len(new), 30, what="the new messages")
            assert sorted(b for *_, b in got) == sorted(new)
            assert all(offset >= ends[part] for part, offset, _, _ in got)
