"""A slave broker copies its master byte for byte (issue 26): same bytes at the same
offsets, new topics as they appear, after its own restart and its master's."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from test_failover import steady_producer

from metaq import Producer
from metaq.testing import wait_until


def log_bytes(data_dir: Path, topic: str, partition: int) -> tuple[int, bytes]:
    """A partition's log as (start offset, bytes from it), whatever its segment files."""
    d = Path(data_dir) / f"{topic}-{partition}"
    segs = sorted(d.glob("*.meta"))
    start = int(segs[0].name.split(".")[0])
    return start, b"".join(s.read_bytes() for s in segs)


def same_logs(a: Path, b: Path, topics: dict[str, int]) -> bool:
    return all(log_bytes(a, t, p) == log_bytes(b, t, p)
               for t, n in topics.items() for p in range(n))


def test_slave_copies_every_partition_byte_for_byte(zk_connect, broker_factory, tmp_path):
    master = broker_factory({"t": 2}, zk_connect=zk_connect, max_segment_size=8192,
                            data_dir=tmp_path / "m")
    with Producer(zk_connect) as producer:
        for i in range(300):
            producer.send("t", b"before %d" % i + b"x" * (i % 50))
        slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, max_segment_size=8192,
                               data_dir=tmp_path / "s")
        assert slave.role == "slave"
        for i in range(300):
            producer.send("t", b"after %d" % i)
        master.add_topic("new", 3)
        for i in range(30):
            producer.send("new", b"n%d" % i)

    def caught_up() -> bool:
        return all(slave.topics.get(t) == n for t, n in master.topics.items()) and all(
            slave.offsets(t, p) == master.offsets(t, p)
            for t, n in master.topics.items() for p in range(n))

    wait_until(caught_up, 20, what="the slave to copy everything")
    assert same_logs(tmp_path / "m", tmp_path / "s", master.topics)
    st = master.replication_status()
    assert st["role"] == "master" and st["in_sync"] == [1], st
    out = subprocess.run([sys.executable, "-m", "metaq", "topic", "describe", "t", "--json",
                          "--zk", zk_connect], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (rep,) = json.loads(out.stdout)["replication"]
    assert (rep["epoch"], rep["leader_replica"], rep["in_sync"], rep["slaves"]) == \
        (0, 0, [1], [1]), rep
    stats = slave.stats()
    assert "replication_role slave" in stats and "replication_master 127.0.0.1:" in stats
    from metaq.prometheus import serve_metrics
    with serve_metrics(brokers=[master, slave]) as server:
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                      timeout=10).read().decode()
    assert 'metaq_broker_replication_in_sync_slaves{broker_id="0",replica="0"} 1.0' in text
    assert 'metaq_broker_replication_master{broker_id="0",replica="1"} 0.0' in text
    assert 'metaq_broker_replication_copy_stopped{broker_id="0",partition="0",replica="1",' \
           'topic="t"} 0.0' in text


def test_restarts_mid_stream_leave_identical_logs(zk_connect, broker_factory, tmp_path):
    """A slave killed and restarted, then its master killed and restarted, under a
    steady producer: afterwards both logs are the same bytes (segment files
    compared; segments roll at 64 KiB so the copy crosses several).  A topic
    created while copying is the in-process test above."""
    master = broker_factory({"r": 2}, zk_connect=zk_connect, process=True,
                            data_dir=tmp_path / "m", extra_args=["--max-segment-size", "64K"])
    slave = broker_factory({}, zk_connect=zk_connect, process=True, data_dir=tmp_path / "s",
                           extra_args=["--slave-of", "0", "--max-segment-size", "64K"])
    acked: list = []
    errors: list = []
    stop = threading.Event()
    t = steady_producer(zk_connect, "r", acked, errors, stop)
    try:
        for proc in (slave, master):
            n = len(acked)
            wait_until(lambda n=n: len(acked) > n + 2000, 30, what="sends")
            proc.kill()
            proc.restart()
        n = len(acked)
        wait_until(lambda: len(acked) > n + 2000, 30, what="sends after the restarts")
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[:3]

    def ends(proc: object) -> list[int]:
        with proc.connection() as conn:
            return [conn.offset("r", "x", p, 1 << 62) for p in range(2)]

    wait_until(lambda: ends(slave) == ends(master), 20, what="the slave to catch up")
    assert same_logs(tmp_path / "m", tmp_path / "s", {"r": 2})
    assert len(list((tmp_path / "s" / "r-0").glob("*.meta"))) > 1


def test_promoted_slave_continues_msg_ids_after_what_it_copied(zk_connect, broker_factory,
                                                              tmp_path):
    """The old master's clock ran a minute ahead: the promoted slave's msgIds (and so
    its message times) still never go back below the copied messages'."""
    from metaq.protocol import msg_id_parts

    master = broker_factory({"i": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    master.ids.continue_after(int(time.time() * 1000) + 60_000)
    with Producer(zk_connect) as producer:
        copied = [producer.send("i", b"m%d" % i).msg_id for i in range(20)]
        slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, auto_promote=True,
                               data_dir=tmp_path / "s")
        wait_until(lambda: slave.replication_status().get("copies", [{}])[0].get("end")
                   == master.offsets("i", 0)[1] and master.replication_status()["in_sync"],
                   20, what="the slave to copy and join")
        master.stop()
        wait_until(lambda: slave.role == "master", 20, what="the slave to take over")
        after = producer.send("i", b"after").msg_id
    assert after > max(copied)
    assert msg_id_parts(after)[0] >= msg_id_parts(max(copied))[0]


def test_heartbeats_do_not_pile_up_zookeeper_watches(zk_connect, broker_factory, tmp_path):
    """Every heartbeat reads the replication node with its watch: the same watch, so
    kazoo keeps one, however long the broker runs."""
    import zk_layout

    master = broker_factory({"w": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m",
                            zk_session_timeout=1.0)
    reg = master.registry
    wait_until(lambda: reg.beats >= 8, 20, what="heartbeats")
    path = zk_layout.Layout().replication(0)
    watched = {k: v for k, v in reg.client._data_watchers.items() if k.endswith(path)}
    assert [len(v) for v in watched.values()] == [1], watched  # (kazoo keys them chrooted)


def test_a_slave_refuses_puts_and_transactions_and_stores_nothing(zk_connect, broker_factory,
                                                                  tmp_path):
    """A slave's log is its master's: plain puts, transactional puts and transaction
    commands are answered 503 naming the master, and nothing is written."""
    import pytest

    from metaq import BrokerError
    from metaq.net import BrokerConnection
    from metaq.protocol import CHECKSUM_MASK, crc32, local_key

    master = broker_factory({"q": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")
    with Producer(zk_connect) as producer:
        producer.send("q", b"one")
    wait_until(lambda: slave.topics.get("q") == 1
               and slave.offsets("q", 0) == master.offsets("q", 0), 20, what="the copy")
    end = slave.offsets("q", 0)
    body = b"not here"
    with BrokerConnection("127.0.0.1", slave.port) as conn:
        with pytest.raises(BrokerError) as e:
            conn.read_result(conn.send_put("q", 0, body, 0, crc32(body) & CHECKSUM_MASK))
        assert e.value.code == 503 and "slave" in str(e.value)
        key = local_key("s1", 1)
        with pytest.raises(BrokerError) as e:
            conn.transaction(key, "s1", "BEGIN")
        assert e.value.code == 503
        with pytest.raises(BrokerError) as e:
            conn.read_result(conn.send_put("q", 0, body, 0, crc32(body) & CHECKSUM_MASK,
                                           tx_key=key))
        assert e.value.code == 503
    assert slave.offsets("q", 0) == end


def test_a_restarted_slave_serves_what_it_holds_before_its_master_is_back(
        zk_connect, broker_factory, tmp_path):
    """Started with --slave-of and no topics, a slave opens the partitions on its disk at
    once (registered, readable) instead of waiting to hear its master's topics."""
    from metaq.broker import Broker, BrokerConfig
    from metaq.testing import free_port

    master = broker_factory({"o": 2}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    cfg = BrokerConfig(broker_id=0, slave_of=0, data_dir=tmp_path / "s", port=free_port(),
                       zk_connect=zk_connect)
    with Producer(zk_connect) as producer:
        for i in range(20):
            producer.send("o", b"o%d" % i)
    with Broker(cfg) as slave:
        wait_until(lambda: slave.topics.get("o") == 2 and all(
            slave.offsets("o", p) == master.offsets("o", p) for p in range(2)), 20,
            what="the copy")
        held = [slave.offsets("o", p) for p in range(2)]
    master.stop()
    with Broker(cfg) as slave:  # no master now
        assert slave.topics == {"o": 2}
        assert [slave.offsets("o", p) for p in range(2)] == held


def test_a_get_its_master_never_answers_does_not_stall_the_slave(zk_connect, broker_factory,
                                                                 tmp_path):
    """A slave's get that its master never answers (a request lost on its way, a stuck
    master) does not stop the copy for good: after its hold and ``answer_timeout`` the
    slave connects again and asks again, and copies what came meanwhile."""
    from metaq.protocol import replica_of_group

    master = broker_factory({"t": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")
    follower = wait_until(lambda: slave._role.follower, 10, what="the slave's follower")
    follower.answer_timeout = 0.5
    with Producer(zk_connect) as producer:
        for i in range(10):
            producer.send("t", b"before %d" % i)
        wait_until(lambda: slave.offsets("t", 0) == master.offsets("t", 0), 20,
                   what="the slave to copy the first messages")
        held = master._server.held
        hold = held.hold
        swallowed: list = []

        def swallow(conn, req, plog):  # noqa: ANN001, ANN202 - HeldGets.hold's signature
            if replica_of_group(req.group) is not None and not swallowed:
                swallowed.append(req)
                return True  # "held", never answered: the get is lost
            return hold(conn, req, plog)

        held.hold = swallow
        wait_until(lambda: swallowed, 10, what="a slave's get to be lost")
        for i in range(10):
            producer.send("t", b"after %d" % i)
    wait_until(lambda: slave.offsets("t", 0) == master.offsets("t", 0), 20,
               what="the slave to copy past the lost get")
    assert same_logs(tmp_path / "m", tmp_path / "s", {"t": 1})
    stats = dict(line.split()[1:3] for line in slave.stats().splitlines()
                 if line.startswith("STAT "))
    assert int(stats.get("replication_request_timeouts", 0)) == 1, stats
