"""A producer rides through a broker's kill -9 and restart within its send timeout
(issue 13, finding 4): no burst of NoBrokerAvailableError while the broker's
registration is replaced, every message acknowledged once the broker is back."""

from __future__ import annotations

import threading
import time

from metaq import Producer
from metaq.testing import wait_until


def test_sends_wait_for_a_restarted_broker_instead_of_failing(zk_connect, brokers):
    b = brokers(0, {"r": 2})
    results, errors, slow = [], [], []
    stop = threading.Event()
    with Producer(zk_connect, send_timeout=20.0, retries=100, retry_backoff=0.2) as producer:
        producer.send("r", b"warm")

        def loop() -> None:
            i = 0
            while not stop.is_set():
                t = time.monotonic()
                try:
                    results.append(producer.send("r", b"m%d" % i))
                except Exception as e:  # noqa: BLE001 - collected, asserted below
                    errors.append(e)
                if time.monotonic() - t > 1.0:
                    slow.append(i)
                i += 1

        t = threading.Thread(target=loop, name="test-sender")
        t.start()
        try:
            wait_until(lambda: len(results) > 50, 15, what="sends before the kill")
            b.kill()
            b.restart()  # waits for the old session to expire, then registers again
            n = len(results)
            wait_until(lambda: len(results) > n + 50, 30, what="sends after the restart")
        finally:
            stop.set()
            t.join(30)
    assert not errors, errors[:3]
    assert slow, "no send was in flight while the broker was away"
    assert len({(r.partition, r.offset) for r in results}) == len(results)


def test_a_transaction_after_its_broker_restarted_does_not_fail_on_a_pooled_connection(
        zk_connect, brokers):
    """A finished transaction's connection is kept for the next one; when the broker
    restarted meanwhile, that connection is dead and the next transaction takes a new
    one instead of failing (the broker closed the old one: it is found at once)."""
    b = brokers(0, {"r": 1})
    with Producer(zk_connect, send_timeout=20.0) as producer:
        with producer.transaction() as tx:
            tx.send("r", b"before")
        b.kill()
        b.restart()
        wait_until(lambda: producer.send("r", b"probe").offset >= 0, 30,
                   what="the restarted broker to take a plain send")
        tx = producer.transaction()
        tx.send("r", b"after")
        tx.send("r", b"after 2")
        assert len(tx.commit()) == 2
