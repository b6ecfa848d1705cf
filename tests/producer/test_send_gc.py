"""A producer's Send is out of the cyclic garbage collector's lists while nothing can
make a cycle through it, and back in them as soon as something can (issue 29)."""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from concurrent.futures import wait

import pytest

from metaq.producer import Send
from metaq.protocol import _fast

needs_c = pytest.mark.skipif(_fast.speedups is None or not hasattr(_fast.speedups, "untrack"),
                             reason=f"C speedups: {_fast.SPEEDUPS_STATUS}")


def _send() -> Send:
    return Send(None, "t", b"x", 0, 0, 0.0)  # type: ignore[arg-type]


@needs_c
def test_a_plain_send_is_untracked():
    assert not gc.is_tracked(_send())


def test_a_cycle_through_a_callback_is_collected():
    send = _send()
    box: list[Send] = []
    send.add_done_callback(functools.partial(box.append, send))  # send -> callback -> send
    assert gc.is_tracked(send)
    ref = weakref.ref(send)
    del send
    gc.collect()
    assert ref() is None


def test_a_cycle_through_an_exception_is_collected():
    send = _send()

    def fail(me: Send) -> None:  # the traceback's frame refers to the send
        raise ValueError(me.topic)

    try:
        fail(send)
    except ValueError as e:
        send.set_exception(e)
    assert gc.is_tracked(send)
    ref = weakref.ref(send)
    del send
    gc.collect()
    assert ref() is None


def test_a_waited_send_is_tracked_and_still_completes():
    send = _send()
    got = []
    t = threading.Thread(target=lambda: got.append(send.exception(10)), name="test-waiter")
    t.start()
    done = wait([send], timeout=0.01)  # the waiter machinery exists from here on
    assert not done.done
    assert gc.is_tracked(send)
    err = RuntimeError("x")
    send.set_exception(err)
    t.join(10)
    assert got == [err]


def test_a_subclass_stays_tracked():
    class Mine(Send):
        __slots__ = ()

    assert gc.is_tracked(Mine(None, "t", b"x", 0, 0, 0.0))  # type: ignore[arg-type]


# -- the one-waiter gate of a blocking send (LightFuture.wait_done) -------------------------

def test_wait_done_times_out_then_sees_the_outcome():
    send = _send()
    t0 = time.monotonic()
    assert not send.wait_done(0.05)
    assert time.monotonic() - t0 >= 0.04
    send.set_result("r")
    assert send.wait_done(0.0) and send.result() == "r"


def test_wait_done_is_woken_by_another_thread():
    send = _send()
    go = threading.Event()

    def complete() -> None:
        go.wait(10)
        send.set_result("done")

    t = threading.Thread(target=complete, name="test-completer")
    t.start()
    go.set()
    assert send.wait_done(10)
    assert send.result() == "done"
    t.join(10)


def test_wait_done_beside_a_result_waiter():
    send = _send()
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(send.result(10)), name="test-waiter")
    t.start()
    wait([send], timeout=0.01)  # the condition exists: both kinds of waiter are woken
    completer = threading.Timer(0.02, send.set_result, ("x",))
    completer.start()
    assert send.wait_done(10)
    t.join(10)
    completer.join(10)
    assert got == ["x"]
