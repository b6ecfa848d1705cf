"""The consumer's control and inspection API: assignment, positions, committed, lag, metrics."""

from __future__ import annotations

import pytest
from helpers.inproc import produce

from metaq import MessageConsumer, Producer
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "ctl"


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2}, zk_connect=zk_connect)


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
    assert ('metaq_consumer_lag_seconds{consumer_id="prom_p",group="prom",partition="ctl/0-0"} 0.0'
            in text)


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


# --------------------------------------------------------------------------- partition state

def _state(**kw):
    from metaq.consumer._subscription import PartitionState
    from metaq.protocol import get_codec

    return PartitionState(topic=TOPIC, partition="0-0", broker_id=0, index=0,
                          broker_address=("127.0.0.1", 1), offset=100, msg_id=7,
                          max_size=1024, listener=lambda m: None, batch_listener=None,
                          codec=get_codec("bytes"), verify=True, max_retries=2, **kw)


def test_requests_wait_for_the_runner_then_rollback_and_seek_apply_in_order():
    pf = _state(auto_ack=False)
    pf.ack(9, 150)
    pf.ack(8, 120)  # an older ack never moves the acknowledged position back
    assert pf.acked == (9, 150) and pf.commit_position() == (9, 150)
    pf.offset, pf.msg_id, pf.retry_offset, pf.retry_count = 300, 12, 250, 1
    pf.request_rollback()
    assert pf.requested() and pf.offset == 300  # nothing moves until the runner applies it
    pf.apply_requests()
    assert (pf.offset, pf.msg_id) == (150, 9) and not pf.requested()
    assert (pf.retry_offset, pf.retry_count) == (-1, 0)
    pf.stall(RuntimeError("out of range"))
    pf.mark_checked()
    pf.seek(40)
    pf.apply_requests()
    assert (pf.offset, pf.msg_id, pf.acked) == (40, -1, (-1, 40))
    assert not pf.checked and pf.stalled is None


def test_bytes_fetched_ahead_count_only_at_the_same_offset_and_broker():
    from metaq._types import BrokerAddress
    from metaq.consumer._session import Readahead

    ra = Readahead()
    here = BrokerAddress("127.0.0.1", 1)
    ra.keep(memoryview(b"abc"), 100, here)
    assert bytes(ra.take(100, here)) == b"abc"
    assert ra.take(100, here) is None  # taken once
    ra.keep(memoryview(b"abc"), 100, here)
    assert ra.take(100, BrokerAddress("127.0.0.1", 2)) is None and ra.data is None
    ra.keep(memoryview(b"abc"), 90, here)
    assert ra.take(100, here) is None  # the partition moved (seek, rollback, 301)


def test_a_readahead_gives_its_buffer_back_only_with_nothing_in_hand():
    from metaq._types import BrokerAddress
    from metaq.consumer._session import Readahead

    ra = Readahead()
    ra.buf = bytearray(8)
    ra.keep(memoryview(ra.buf)[:3], 0, BrokerAddress("h", 1))
    ra.idle()
    assert ra.buf is not None  # its bytes are a view of the buffer: kept
    ra.drop()
    ra.idle()
    assert ra.buf is None


def test_position_transitions_count_what_they_skip():
    pf = _state()
    pf.skip_damaged(100, 160)
    assert (pf.offset, pf.damaged, pf.skipped, pf.checked) == (160, 1, 60, True)
    pf.reset_to(400)
    assert (pf.offset, pf.msg_id, pf.skipped) == (400, -1, 300)
    pf.reset_to(0)  # back to the log start: nothing skipped
    assert (pf.offset, pf.skipped) == (0, 300)
    assert pf.too_big() and not pf.too_big()  # reported once per stall
    pf.delivered()
    assert pf.grow_size_streak == 0 and pf.delay == 0.0


def test_subscription_state_builds_states_from_committed_offsets_and_counts_revoked():
    from metaq import ConfigError, ConsumerConfig
    from metaq.consumer._subscription import EARLIEST, LATEST, SubscriptionState
    from metaq.protocol import get_codec
    from zk_layout import NodeDataError, StoredOffset

    errors = []

    def subs(**kw):
        return SubscriptionState(ConsumerConfig(group="g", **kw), consumer_id="g_c",
                                 codec=get_codec("bytes"), reject=None, dispatcher=None,
                                 on_error=errors.append)

    s = subs(start_position="latest", offset_reset="fail")
    s.subscribe(TOPIC, lambda m: None, max_size=2048, auto_ack=True, max_batch=10)
    with pytest.raises(ConfigError, match="already subscribed"):
        s.subscribe(TOPIC, lambda m: None, max_size=2048, auto_ack=True, max_batch=10)
    new = s.assign(TOPIC, "0-0", 0, None, None, None)
    stored = s.assign(TOPIC, "0-1", 0, None, StoredOffset(offset=500, msg_id=3), None)
    bad = s.assign(TOPIC, "0-2", 0, None, NodeDataError("/x", b"junk", "not an offset"),
                   None)
    assert (new.offset, stored.offset, stored.msg_id, stored.committed) == (LATEST, 500, 3,
                                                                            (3, 500))
    assert bad.stalled is errors[0] and s.damaged_offsets == 1
    assert (new.max_size, new.max_batch) == (2048, 10)
    assert s.assignment() == {TOPIC: ["0-0", "0-1", "0-2"]}
    stored.consumed = 5
    assert s.revoke((TOPIC, "0-1")) is stored and s.consumed_released == 5
    new.consumed = 4
    # lost with a session: delivered all the same, so still counted (metrics()["messages"]
    # is a counter: it never goes down, whatever happens to the partitions)
    assert s.drop_all() == [new, bad] and s.consumed_released == 9
    assert s.partition(TOPIC, "0-0") is None and s.assignment() == {}
    s2 = subs(offset_reset="earliest")
    s2.subscribe(TOPIC, lambda m: None, max_size=2048, auto_ack=True, max_batch=10)
    assert s2.assign(TOPIC, "0-3", 0, None, NodeDataError("/y", b"?", "bad"),
                     None).offset == EARLIEST
