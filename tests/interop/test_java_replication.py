"""Replication across implementations (issue 26), with the real Metaq 1.4 Java broker and
client (compiled unmodified: ``helpers.java_broker`` and ``test_java_client``'s harness;
every test skips, naming what is missing, where Java or the jars are not there).

- Our slave following a real Java master: the Java broker registers ``ids/<id>/master``
  and ``topics-pub/<t>/<id>-m`` itself; our broker started with ``slave_of`` copies its
  partitions over ordinary gets (the Java broker's ``version`` lists no ``+hold``: the
  slave polls).  Both must then hold the same messages at the same offsets (offsets,
  msgIds and payloads read back with ``get`` from each): what was there before the slave
  started, what concurrent producers add while it follows (the Java broker's max offset
  is what it flushed and lags what its gets serve, so the slave is told ``301`` with a
  max offset below its own end: it must wait for the flush, not give up), a topic never
  written until then (the Java broker answers ``404 ... is not exists`` for it), and
  what was put while the slave was stopped; under both of the Java broker's flush
  policies (group commit, and Metaq's periodic flush, where the lag lasts up to
  ``unflushInterval``), and with Metaq's default ``updateConsumerOffsets=false`` (a
  get past the max offset answered 404 "Could not find message", not 301).
- A real Java consumer reading from our slave: our master copied by our slave, then the
  master stopped; Java's ``Cluster.getBrokerRandom(brokerId)`` finds no ``ids/0/master``
  and picks ``ids/0/slave1`` (``meta://host:port?slaveId=1``), and its partition list
  comes from ``topics-sub/<t>/0-s1``: it must receive every message.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from helpers.java_broker import TELL_MAX_OFFSET, JavaBroker, JavaServer, java_server
from helpers.java_client import JavaRunner
from helpers.procs import read_partition

from metaq import Producer
from metaq.broker import Broker
from metaq.net import BrokerConnection
from metaq.testing import WaitTimeout, wait_until
from zk_layout import Layout, decode_broker_uri, decode_offset

pytestmark = [pytest.mark.broker, pytest.mark.zk]

TOPIC = "t"
LATE = "late"         # a topic the Java master has configured but nobody writes at first
PARTS = 2
TOPICS = {TOPIC: PARTS, LATE: PARTS}
GROUP = "java-replication-reader"
#: an offset past any log here: a Java broker answers ``offset`` with its max offset for it
PAST_END = 1 << 40
LAYOUT = Layout()


@pytest.fixture(scope="module")
def server() -> JavaServer:
    """First in a test's arguments: where Java or the jars are missing it skips before
    ZooKeeper starts."""
    return java_server()


def messages(port: int, topic: str, partition: int) -> list[tuple[int, int, bytes]]:
    """``(offset, msgId, payload)`` of every message of one partition, read with ``get``."""
    with BrokerConnection("127.0.0.1", port) as conn:
        return [(m.offset, m.msg_id, m.payload)
                for m in read_partition(conn, topic, partition, group=GROUP)]


def ends(port: int, topics: dict[str, int]) -> dict[tuple[str, int], int]:
    """Each partition's max offset as the broker answers ``offset`` past the end (0 for a
    partition a Java broker has not created yet)."""
    with BrokerConnection("127.0.0.1", port) as conn:
        return {(t, p): conn.offset(t, GROUP, p, PAST_END) for t, n in topics.items()
                for p in range(n)}


def send(producer: Producer, topic: str, prefix: str, n: int) -> list[bytes]:
    bodies = [f"{prefix}-{i}-".encode() + b"x" * (i % 37) for i in range(n)]
    for body in bodies:
        producer.send(topic, body)
    return bodies


def send_concurrently(producer: Producer, topic: str, prefix: str, threads: int,
                      n: int) -> list[bytes]:
    """``threads`` senders of ``n`` messages each at once (puts while the slave copies)."""
    out: list[list[bytes]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            out[k] = send(producer, topic, f"{prefix}{k}", n)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    workers = [threading.Thread(target=run, args=(k,), name=f"sender-{k}")
               for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert not errors, errors
    assert not any(w.is_alive() for w in workers), "a sender is still sending after 60 s"
    return [b for bodies in out for b in bodies]


#: the Java master's configurations: group commit (each put answered once fsynced, the
#: harness's default, with ``updateConsumerOffsets=true``: a get past the max offset is
#: answered 301 with it), Metaq's periodic flush (every ``unflushThreshold`` messages
#: and every ``unflushInterval`` ms; puts are answered before), where the max offset lags
#: what gets serve by up to the interval, and Metaq's default
#: ``updateConsumerOffsets=false``, where a get past the max offset is answered 404
JAVA_CONFIGS: dict[str, dict] = {
    "group-commit": {},
    "periodic-flush": {"system": {"unflushThreshold": 100, "unflushInterval": 2000}},
    "no-tell-max-offset": {"update_consumer_offsets": False},
}


@pytest.mark.parametrize("config", sorted(JAVA_CONFIGS))
def test_our_slave_follows_a_java_master(server, zk_connect, broker_factory, tmp_path,
                                         request, config):
    sent: dict[str, list[bytes]] = {TOPIC: [], LATE: []}

    def start_slave() -> Broker:
        slave = broker_factory({}, zk_connect=zk_connect, slave_of=jb.broker_id,
                               data_dir=tmp_path / "slave")
        assert slave.role == "slave"
        return slave

    def wait(predicate: Callable[[], bool], what: str, slave: Broker) -> None:
        try:
            wait_until(predicate, 20, 0.1, what=what)
        except WaitTimeout as e:
            raise AssertionError(f"{e}\nJava master: {ends(jb.port, TOPICS)}\nslave: "
                                 f"{slave.replication_status()}") from None

    def same_messages(slave: Broker) -> None:
        """Wait until the Java master serves every message sent (it flushed them), the
        slave holds the same messages at the same offsets, and its ends are the Java
        master's max offsets."""
        def java_serves_all() -> bool:
            return all(sorted(m[2] for p in range(n) for m in messages(jb.port, t, p))
                       == sorted(sent[t]) for t, n in TOPICS.items())

        def same() -> bool:
            return (all(slave.topics.get(t) == n for t, n in TOPICS.items())
                    and all(messages(slave.port, t, p) == messages(jb.port, t, p)
                            for t, n in TOPICS.items() for p in range(n)))
        wait(java_serves_all, "the Java master to serve every message sent", slave)
        wait(same, "the slave to hold the Java master's messages at the same offsets", slave)
        wait(lambda: ends(slave.port, TOPICS) == ends(jb.port, TOPICS),
             "the slave's ends to be the Java master's max offsets", slave)

    with JavaBroker(server, zk_connect, tmp_path / "jb", TOPICS, **JAVA_CONFIGS[config]) as jb, \
            jb.attach_log(request), Producer(zk_connect) as producer:
        sent[TOPIC] += send(producer, TOPIC, "before", 400)
        slave = start_slave()
        same_messages(slave)   # LATE: never written, 404 "is not exists" on the master

        sent[TOPIC] += send_concurrently(producer, TOPIC, "during", 4, 400)
        sent[LATE] += send(producer, LATE, "late", 50)
        same_messages(slave)
        # caught up once its next get past the end finds nothing new (a poll later)
        wait(lambda: {c["state"] for c in slave.replication_status()["copies"]}
             == {"caught-up"}, "every copy to report caught-up", slave)
        told = [line for line in jb.log_text().splitlines()
                if TELL_MAX_OFFSET in line and "group=meta-slave-group-" in line]
        print(f"the Java master answered the slave 301 (max offset below the slave's end, "
              f"not flushed yet) {len(told)} times")

        slave.stop()           # resumes from its own end: nothing copied twice or skipped
        had = ends(jb.port, TOPICS)  # = what the stopped slave holds (same_messages)
        sent[TOPIC] += send(producer, TOPIC, "while-stopped", 200)
        slave = start_slave()
        same_messages(slave)
        copied = sum(c["copied_bytes"] for c in slave.replication_status()["copies"])
        assert copied == sum(ends(jb.port, TOPICS).values()) - sum(had.values())


def test_a_java_consumer_reads_from_our_slave(java: JavaRunner, zk_connect, zk_client,  # noqa: F811
                                              broker_factory, tmp_path):
    n = 300
    master = broker_factory({TOPIC: PARTS}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    with Producer(zk_connect) as producer:
        sent = send(producer, TOPIC, "m", n)
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")
    wait_until(lambda: slave.topics.get(TOPIC) == PARTS and all(
        slave.offsets(TOPIC, p) == master.offsets(TOPIC, p) for p in range(PARTS)), 20,
        what="the slave to copy the master")
    master.stop()
    # only the slave is left for Java to find: its ids/0/slave1 and topics-sub/t/0-s1
    assert zk_client.exists(LAYOUT.broker_master(0)) is None
    assert zk_client.exists(LAYOUT.topic_sub(TOPIC, 0)) is None
    uri = decode_broker_uri(zk_client.get(LAYOUT.broker_slave(0, 1))[0])
    assert uri.port == slave.port, uri
    assert zk_client.get_children(LAYOUT.topic_sub_dir(TOPIC)) == ["0-s1"]

    cons = java.run("JavaConsumer", "java-from-slave", TOPIC, str(n), "25", timeout=40)
    got = [line.split(" ", 3)[3] for line in cons.output() if line.startswith("GOT ")]
    assert len(got) == n, cons.describe()
    assert sorted(got) == sorted(b.decode() for b in sent)
    # and Java committed its positions: the slave's ends, in the group's offset nodes
    for p in range(PARTS):
        node = zk_client.get(LAYOUT.offset("java-from-slave", TOPIC, f"0-{p}"))[0]
        assert decode_offset(node).offset == slave.offsets(TOPIC, p)[1], (p, node)
