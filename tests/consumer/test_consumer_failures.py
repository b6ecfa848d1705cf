"""A listener failing on chosen messages: retries, then each reject policy."""

from __future__ import annotations

import threading

import pytest
from helpers.inproc import produce

from metaq import MessageConsumer
from metaq.net import BrokerConnection
from metaq.protocol import iter_messages, split_payload
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

TOPIC = "work"
DLQ = "%DLQ%fail"


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2, DLQ: 1}, zk_connect=zk_connect)


def _produce(zk_connect, bodies, attribute=None):
    produce(zk_connect, TOPIC, bodies, attribute=attribute)


class FailOn:
    """Fails every delivery of chosen bodies (or the first n deliveries of them)."""

    def __init__(self, bad: set[bytes], times: int | None = None) -> None:
        self.bad, self.times = bad, times
        self.calls: dict[bytes, int] = {}
        self.ok: list[bytes] = []
        self.lock = threading.Lock()

    def __call__(self, m) -> None:
        with self.lock:
            n = self.calls[m.raw_body] = self.calls.get(m.raw_body, 0) + 1
            if m.raw_body in self.bad and (self.times is None or n <= self.times):
                raise RuntimeError(f"cannot handle {m.raw_body!r}")
            self.ok.append(m.raw_body)


def _consumer(zk_connect, listener, **kw):
    kw.setdefault("max_fetch_retries", 2)
    c = MessageConsumer("fail", zk_connect, consumer_id="c", commit_period=0.1, **kw)
    c.subscribe(TOPIC, listener)
    return c


def test_transient_failure_is_retried_and_order_kept(zk_connect, broker, tmp_path):
    bodies = [f"m{i}".encode() for i in range(40)]
    _produce(zk_connect, bodies)
    listener = FailOn({b"m7", b"m8"}, times=2)  # fails twice, succeeds on the third try
    with _consumer(zk_connect, listener, recover_dir=str(tmp_path / "rs")) as c:
        c.start()
        wait_until(lambda: sorted(listener.ok) == sorted(bodies), timeout=30,
                   what="every message handled")
        assert len(c.recover_store) == 0
    assert listener.calls[b"m7"] == 3 and listener.calls[b"m8"] == 3
    assert len(listener.ok) == len(bodies)  # nothing delivered twice after success


def test_recover_policy_keeps_and_redelivers_until_success(zk_connect, broker, tmp_path):
    bodies = [f"r{i}".encode() for i in range(30)]
    _produce(zk_connect, bodies)
    listener = FailOn({b"r5"}, times=4)  # 3 tries in the partition, then from the store
    with _consumer(zk_connect, listener, recover_dir=str(tmp_path / "rs"),
                   recover_interval=0.2) as c:
        c.start()
        wait_until(lambda: set(listener.ok) == set(bodies), timeout=30,
                   what="the failing message redelivered from the recover store")
        wait_until(lambda: len(c.recover_store) == 0, timeout=10, what="store emptied")
    assert listener.calls[b"r5"] == 5


def test_dlq_policy_sends_original_bytes_and_attribute(zk_connect, broker, tmp_path):
    _produce(zk_connect, [b"good1", b"poison", b"good2"], attribute="trace=42")
    listener = FailOn({b"poison"})
    with _consumer(zk_connect, listener, reject_policy="dlq",
                   recover_dir=str(tmp_path / "rs")) as c:
        c.start()
        wait_until(lambda: {b"good1", b"good2"} <= set(listener.ok), timeout=30,
                   what="good messages handled")

        def dead_letters():
            with BrokerConnection("127.0.0.1", broker.port) as conn:
                try:
                    data = bytes(conn.get(DLQ, "check", 0, 0, 1 << 20))
                except Exception:
                    return []
            return [split_payload(m.payload, m.flag) for m in iter_messages(data, 0)]

        got = wait_until(dead_letters, timeout=30, what="a dead letter")
        assert got == [("trace=42", b"poison")]
        assert len(c.recover_store) == 0


def test_drop_and_user_policies(zk_connect, broker, tmp_path):
    _produce(zk_connect, [b"a", b"bad", b"b"])
    handed: list[tuple[bytes, str]] = []
    listener = FailOn({b"bad"})
    with _consumer(zk_connect, listener, recover_dir=str(tmp_path / "rs"),
                   reject_policy=lambda m, e: handed.append((m.raw_body, str(e)))) as c:
        c.start()
        wait_until(lambda: handed and set(listener.ok) == {b"a", b"b"}, timeout=30,
                   what="user handler called")
    assert handed == [(b"bad", "cannot handle b'bad'")]
    listener2 = FailOn({b"bad"})
    _produce(zk_connect, [b"c"])
    with MessageConsumer("fail2", zk_connect, consumer_id="d", max_fetch_retries=0,
                         reject_policy="drop", recover_dir=str(tmp_path / "rs2")) as c2:
        c2.subscribe(TOPIC, listener2)
        c2.start()
        wait_until(lambda: set(listener2.ok) == {b"a", b"b", b"c"}, timeout=30,
                   what="drop policy moves on")
        assert len(c2.recover_store) == 0
    assert listener2.calls[b"bad"] == 1
