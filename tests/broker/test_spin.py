"""The broker loop's selector (``metaq.broker._spin``): it polls for a moment before
it sleeps only while an answer is due, and never changes what select returns."""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time

import pytest

from metaq.broker._spin import SpinSelector


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


def test_an_answer_arriving_while_it_polls_is_returned() -> None:
    a, b = _pair()
    sel = SpinSelector(spin=0.5)
    sel.wanted = lambda: True
    sel.register(a, selectors.EVENT_READ)
    try:
        t = threading.Timer(0.02, b.send, (b"x",))
        t.start()
        start = time.monotonic()
        ready = sel.select(5.0)
        took = time.monotonic() - start
        t.join()
        assert [key.fileobj for key, _ev in ready] == [a]
        assert took < 0.5  # returned when the byte came, not at the end of the spin
    finally:
        sel.close()
        a.close()
        b.close()


def test_the_timeout_still_holds_when_it_polls_first() -> None:
    a, b = _pair()
    sel = SpinSelector(spin=0.05)
    sel.wanted = lambda: True
    sel.register(a, selectors.EVENT_READ)
    try:
        start = time.monotonic()
        assert sel.select(0.2) == []
        took = time.monotonic() - start
        assert 0.19 <= took < 1.0
        start = time.monotonic()
        assert sel.select(0.01) == []  # a timeout shorter than the spin bounds it
        assert time.monotonic() - start < 0.045
    finally:
        sel.close()
        a.close()
        b.close()


def test_it_polls_only_while_an_answer_is_due(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = _pair()
    calls = []
    sel = SpinSelector(spin=0.05)
    base = selectors.DefaultSelector.select

    def counting(self: SpinSelector, timeout: float | None = None) -> list:
        calls.append(timeout)
        return base(self, timeout)

    yields = []
    sel.register(a, selectors.EVENT_READ)
    try:
        monkeypatch.setattr(selectors.DefaultSelector, "select", counting)
        monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
        due = [False]
        sel.wanted = lambda: due[0]
        assert sel.select(0.01) == []
        assert calls == [0.01] and not yields  # one blocking call, no polling
        calls.clear()
        due[0] = True
        assert sel.select(0.1) == []
        assert len(calls) > 2 and calls[0] == 0 and calls[-1] > 0  # polled, then blocked
        # between two polls the CPU is offered to whoever waits for it
        assert len(yields) == len(calls) - 2
    finally:
        sel.close()
        a.close()
        b.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_sync_slave_polls_only_right_after_it_copied_a_lone_put(
        zk_connect, broker_factory, tmp_path, mode: str) -> None:
    from metaq import Producer
    from metaq.testing import wait_until

    master = broker_factory({"t": 1}, zk_connect=zk_connect, replication="sync",
                            data_dir=tmp_path / "m")
    slave = broker_factory({}, zk_connect=zk_connect, slave_of=0, replication=mode,
                           data_dir=tmp_path / "s")
    wait_until(lambda: master.replication_status()["in_sync"] == [1], 30,
               what="the slave to be in sync")
    follower = slave._role.follower
    with Producer(zk_connect) as producer:
        producer.send("t", b"warm-up")
        before = follower.lone_at
        producer.send("t", b"one")  # acknowledged: the slave copied it (sync)
        lone = follower.lone_at
        assert lone > before  # a value of one message: a lone put's
        producer.send_batch("t", [b"m%d" % i for i in range(10)]).result(30)
        assert follower.lone_at == lone  # ten messages in one value: a batch's

    def wanted_now() -> tuple[bool, bool]:
        follower.lone_at = time.monotonic()
        now = slave._spin_wanted()
        follower.lone_at = time.monotonic() - 1.0
        return now, slave._spin_wanted()

    assert slave._call(wanted_now) == ((mode == "sync"), False)
