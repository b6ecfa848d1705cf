"""Consumers read a master only below its high watermark (issue 26): what every
in-sync slave holds.  A message on the master alone can be lost by a failover,
so no consumer may have it (its committed position would then point past the
new master's log); once the slave has it, or has left the in-sync set, it is
served."""

from __future__ import annotations

from metaq import BrokerError, Producer
from metaq.net import BrokerConnection
from metaq.testing import wait_until


def readable(port: int, offset: int, group: str = "consumers") -> bool:
    with BrokerConnection("127.0.0.1", port) as conn:
        try:
            return len(conn.get("h", group, 0, offset, 65536)) > 0
        except BrokerError as e:
            if e.code == 404:
                return False
            raise


def test_a_message_only_the_master_holds_is_not_served(zk_connect, broker_factory,
                                                       tmp_path):
    master = broker_factory({"h": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m",
                            replication_max_lag=2.0)
    slave = broker_factory({}, zk_connect=zk_connect, process=True, data_dir=tmp_path / "s",
                           extra_args=["--slave-of", "0"])
    with Producer(zk_connect) as producer:
        first = producer.send("h", b"copied")
        wait_until(lambda: master.replication_status().get("in_sync") == [1], 20,
                   what="the slave in sync")
        wait_until(lambda: readable(master.port, first.offset), 10, what="the first message")
        slave.pause()
        second = producer.send("h", b"on the master alone")  # async: acknowledged
        assert not readable(master.port, second.offset)
        slave.resume()
        wait_until(lambda: readable(master.port, second.offset), 10,
                   what="the message, once the slave has it")
        slave.pause()
        third = producer.send("h", b"the slave is gone")
        assert not readable(master.port, third.offset)
        wait_until(lambda: master.replication_status()["in_sync"] == [], 20,
                   what="the stopped slave to leave the in-sync set")
        assert readable(master.port, third.offset)  # nobody in sync: no cap
        slave.resume()


def test_a_slave_serves_consumers_only_below_its_masters_watermark(zk_connect, broker_factory,
                                                                   tmp_path):
    """With two slaves, one may copy a message the other lacks; a consumer reading the
    first must not get it (a failover to the second would lose it and reuse its
    offset).  The slaves learn the master's watermark (``watermarks``) and serve below
    it; once both hold the message it is served."""
    master = broker_factory({"h": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m",
                            replication_max_lag=60.0)
    slaves = [broker_factory({}, zk_connect=zk_connect, process=True,
                             data_dir=tmp_path / f"s{n}",
                             extra_args=["--slave-of", "0", "--slave-id", str(n)])
              for n in (1, 2)]
    wait_until(lambda: master.replication_status().get("in_sync") == [1, 2], 30,
               what="both slaves in sync")
    with Producer(zk_connect) as producer:
        first = producer.send("h", b"both have it")
        wait_until(lambda: readable(slaves[1].port, first.offset), 10,
                   what="the first message on slave 2")
        slaves[0].pause()
        try:
            second = producer.send("h", b"slave 2 alone")  # async: acknowledged
            # slave 2 holds it (a replica's get reads all it holds) ...
            wait_until(lambda: readable(slaves[1].port, second.offset, "meta-slave-group-9"),
                       10, what="slave 2's copy")
            # ... but serves it to no consumer while slave 1, in sync, lacks it
            assert not readable(slaves[1].port, second.offset)
            assert not readable(master.port, second.offset)
        finally:
            slaves[0].resume()
        wait_until(lambda: readable(slaves[1].port, second.offset), 10,
                   what="the message on slave 2 once slave 1 has it too")


def test_a_watermarks_request_its_master_never_answers_does_not_freeze_the_slave(
        zk_connect, broker_factory, tmp_path):
    """A slave's ``watermarks`` request its master never answers (lost on its way) does
    not freeze what the slave's consumers may read: after its hold and
    ``answer_timeout`` the slave connects again and learns the master's watermark."""
    master = broker_factory({"h": 1}, zk_connect=zk_connect, data_dir=tmp_path / "m")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, data_dir=tmp_path / "s")
    follower = wait_until(lambda: slave._role.follower, 10, what="the slave's follower")
    marks = follower.watermarks
    marks.hold_ms, marks.answer_timeout = 200, 0.5

    def slave_mark() -> int | None:
        return slave._call(lambda: slave._storage.get("h", 0).high_watermark)

    with Producer(zk_connect) as producer:
        producer.send("h", b"first")
        end = master.offsets("h", 0)[1]
        wait_until(lambda: slave_mark() == end, 20, what="the slave to learn the watermark")
        feed = master._role.replicas.watermarks
        request = feed.request
        swallowed: list = []

        def swallow(conn, r):  # noqa: ANN001, ANN202 - WatermarkFeed.request's signature
            if not swallowed:
                swallowed.append(r)
                return  # never answered: the request is lost
            request(conn, r)

        feed.request = swallow
        wait_until(lambda: swallowed, 10, what="a watermarks request to be lost")
        producer.send("h", b"second")
    end = master.offsets("h", 0)[1]
    wait_until(lambda: slave_mark() == end, 20, what="the slave to learn the new watermark")
    stats = dict(line.split()[1:3] for line in slave.stats().splitlines()
                 if line.startswith("STAT "))
    assert int(stats["replication_request_timeouts"]) == 1, stats
