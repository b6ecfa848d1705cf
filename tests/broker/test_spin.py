"""The broker loop's selector (``metaq.broker._spin``): it polls for a moment before
it sleeps only while an answer is due, and never changes what select returns."""

from __future__ import annotations

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

    sel.register(a, selectors.EVENT_READ)
    try:
        monkeypatch.setattr(selectors.DefaultSelector, "select", counting)
        due = [False]
        sel.wanted = lambda: due[0]
        assert sel.select(0.01) == []
        assert calls == [0.01]  # one blocking call, no polling
        calls.clear()
        due[0] = True
        assert sel.select(0.1) == []
        assert len(calls) > 2 and calls[0] == 0 and calls[-1] > 0  # polled, then blocked
    finally:
        sel.close()
        a.close()
        b.close()
