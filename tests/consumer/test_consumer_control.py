"""The consumer's control and inspection API: assignment, positions, committed, lag, metrics."""

from __future__ import annotations

import pytest
from helpers.inproc import inproc_broker, produce

from metaq import MessageConsumer, Producer
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "ctl"


@pytest.fixture
def broker(zk_connect, tmp_path):
    with inproc_broker(zk_connect, tmp_path / "b0", {TOPIC: 2}) as b:
        yield b


def _produce(zk_connect, n, start=0):
    produce(zk_connect, TOPIC, (f"m{i}".encode() for i in range(start, start + n)))


def test_positions_committed_lag_and_metrics(zk_connect, broker, tmp_path):
    _produce(zk_connect, 200)
    seen = []
    with MessageConsumer("ctl", zk_connect, consumer_id="c", commit_period=0.1,
                         recover_dir=str(tmp_path / "rs")) as c:
        c.subscribe(TOPIC, seen.append)
        c.start()
        wait_until(lambda: len(seen) == 200, timeout=30, what="all consumed")
        wait_until(lambda: c.committed() == c.positions(), timeout=10, what="committed")
        keys = {(TOPIC, "0-0"), (TOPIC, "0-1")}
        assert set(c.positions()) == keys
        assert c.lag() == {k: 0 for k in keys}
        m = c.metrics(with_lag=True)
        assert m["messages"] == 200 and m["state"] == "stable" and m["rebalances"] >= 1
        assert m["rate"] > 0 and m["recover_store_size"] == 0 and m["errors"] == 0
        assert {p: v["lag"] for p, v in m["partitions"].items()} == {"ctl/0-0": 0, "ctl/0-1": 0}
        assert sum(v["consumed"] for v in m["partitions"].values()) == 200
        _produce(zk_connect, 50, start=200)
        wait_until(lambda: len(seen) == 250, timeout=30, what="the next 50")
        assert c.metrics()["messages"] == 250


def test_prometheus_exporter_serves_consumer_metrics(zk_connect, broker, tmp_path):
    import urllib.request

    from metaq.prometheus import serve_metrics

    _produce(zk_connect, 40)
    seen = []
    with MessageConsumer("prom", zk_connect, consumer_id="p", commit_period=0.1,
                         recover_dir=str(tmp_path / "rs")) as c:
        c.subscribe(TOPIC, seen.append)
        c.start()
        wait_until(lambda: len(seen) == 40, timeout=30, what="all consumed")
        with serve_metrics([c], with_lag=True) as server:
            text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                          timeout=10).read().decode()
    assert 'metaq_consumer_messages_total{consumer_id="prom_p",group="prom"} 40.0' in text
    assert 'metaq_consumer_partitions{consumer_id="prom_p",group="prom"} 2.0' in text
    assert 'metaq_consumer_lag{consumer_id="prom_p",group="prom",partition="ctl/0-0"} 0.0' in text


def test_message_bigger_than_transfer_cap_and_fetch_size_is_consumed_whole(
        zk_connect, broker, tmp_path):
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: over the broker's 1 MiB maxTransferSize
    with Producer(zk_connect) as p:
        p.send(TOPIC, b"small-before")
        p.send(TOPIC, big)
        p.send(TOPIC, b"small-after")
    seen = []
    with MessageConsumer("big", zk_connect, consumer_id="b",
                         recover_dir=str(tmp_path / "rs")) as c:
        c.subscribe(TOPIC, lambda m: seen.append(m.raw_body), max_size=64 * 1024)
        c.start()
        wait_until(lambda: len(seen) == 3, timeout=30, what="all three, the big one whole")
        assert c.errors() == []
    assert sorted(seen) == sorted([b"small-before", big, b"small-after"])
