"""The idempotent producer across a failover (issue 26): a slave copies its
master's producer records with the messages, so a put resent to the promoted
slave (same producer id and sequence: its answer was lost when the master died)
is answered with its first place and stored once."""

from __future__ import annotations

from helpers.raw_client import RawClient

from metaq.protocol import parse_put_result
from metaq.testing import wait_until


def idem_put(port: int, pid: int, seq: int, body: bytes) -> tuple[int, bytes]:
    """One idempotent put on a fresh connection: ``(code, body)`` of its answer."""
    with RawClient(port) as c:
        (reply,) = c.puts("i", 0, [body], pid=pid, seq=seq, opaque=7)
        return reply.code, bytes(reply.body)


def test_resent_put_is_stored_once_by_the_promoted_slave(zk_connect, broker_factory,
                                                         tmp_path):
    master = broker_factory({"i": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m",
                            replication="sync")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, auto_promote=True,
                           replication="sync", data_dir=tmp_path / "s")
    wait_until(lambda: master.replication_status().get("in_sync") == [1], 20,
               what="the slave in sync")
    pid = 4242
    first = {}
    for seq in range(10):
        code, body = idem_put(master.port, pid, seq, b"m%d" % seq)
        assert code == 200, body
        first[seq] = parse_put_result(body)
    end = master.offsets("i", 0)[1]
    wait_until(lambda: len(slave.producer_records("i", 0, 0)) > 0, 10,
               what="the producer records on the slave")
    master.stop()
    wait_until(lambda: slave.role == "master", 20, what="the slave to take over")
    code, body = idem_put(slave.port, pid, 9, b"m9")  # the answer to seq 9 was "lost"
    assert code == 200, body
    assert parse_put_result(body) == first[9]
    assert slave.offsets("i", 0)[1] == end  # stored once
    code, body = idem_put(slave.port, pid, 10, b"m10")  # the next one is new
    assert code == 200 and slave.offsets("i", 0)[1] > end


def _stat(broker, name: str) -> int:  # noqa: ANN001
    for line in broker.stats().splitlines():
        f = line.split()
        if f[1:2] == [name]:
            return int(f[2])
    raise AssertionError(f"no {name} in the stats")


def test_records_come_with_the_data_and_plain_puts_ask_for_none(zk_connect, broker_factory,
                                                                 tmp_path):
    """A slave of a ``+records`` master asks no ``producers`` per copied chunk: plain
    puts (one chunk each, with sync replication) cost the master no records request,
    and an idempotent run's records reach the slave with its messages."""
    master = broker_factory({"i": 2}, zk_connect=zk_connect, data_dir=tmp_path / "m",
                            replication="sync")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, replication="sync",
                           data_dir=tmp_path / "s")
    wait_until(lambda: master.replication_status().get("in_sync") == [1], 20,
               what="the slave in sync")
    asked = _stat(master, "cmd_producers")  # the catch-up of each new connection
    with RawClient(master.port) as c:
        for i in range(40):
            (reply,) = c.puts("i", i % 2, [b"plain %d" % i], opaque=i)
            assert reply.code == 200, reply
    assert [slave.offsets("i", p) for p in range(2)] == [master.offsets("i", p)
                                                        for p in range(2)]
    assert _stat(master, "cmd_producers") == asked
    for seq in range(5):
        code, body = idem_put(master.port, 77, seq, b"idem %d" % seq)
        assert code == 200, body
    assert master.producer_records("i", 0, 0)
    wait_until(lambda: slave.producer_records("i", 0, 0) == master.producer_records("i", 0, 0),
               10, what="the records on the slave")
    assert _stat(master, "cmd_producers") > asked  # sent with the data
