"""A send future always completes, even when threads switch at awkward moments.

``bench_producer.py`` once hung in ``f.result()`` on a future of ``send_async``
(send_timeout 30 s, no reply lost, no warning logged).  The cause: on CPython
3.11 a first store of an attribute in an instance ``__dict__`` can move the
object's values into a new dict, and a garbage collection inside that move
(the bench's ``gc.callbacks`` clock; any finalizer that does I/O) lets another
thread run.  The reader completing a future (``Send.on_acks`` stores the ack
fields and ``_state``) and the user's thread starting to wait on it (storing
``_condition`` and ``_waited``) then each built a dict on the same values and
one was dropped with its stores: a waiter never notified, or a result whose
fields were lost.  Futures now keep every field in slots.

The tests make every collection hand the GIL over (a ``gc.callbacks`` hook
that sleeps, a low threshold), so the switch happens where it once did by
bad luck.  The bulk-ack race (run in a child process: before the fix it
ended in a segmentation fault, a freed values array written to) fails every
time without the fix; the one through a real producer and broker did not
meet the race in a few runs before the fix and stays as a guard that every
future completes within ``send_timeout`` plus a margin; the last two check
that no field of a future lives in an instance dict.
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import pytest

from metaq import Producer, SendResult
from metaq.net import PipelinedConnection
from metaq.producer._batch import BatchFuture, _BatchItem
from metaq.producer._send import Send
from zk_layout import Partition

pytestmark = pytest.mark.broker

SEND_TIMEOUT = 5.0
MARGIN = 5.0


@contextlib.contextmanager
def _collections_hand_over_the_gil(threshold: int = 10) -> Iterator[None]:
    """Run a collection every ``threshold`` allocations and let other threads run
    inside each one (as a finalizer doing I/O, or a gc callback, can)."""
    def hand_over(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(0)  # releases the GIL: a waiting thread takes it

    old = gc.get_threshold()
    gc.callbacks.append(hand_over)
    gc.set_threshold(threshold)
    try:
        yield
    finally:
        gc.callbacks.remove(hand_over)
        gc.set_threshold(*old)


class _NoRetry:
    def attempt_failed(self, send: Send, err: BaseException) -> None:
        send.set_exception(err)


def _sent(n: int) -> list[Send]:
    """``n`` Sends as the send path leaves them after their put."""
    sends = []
    for _ in range(n):
        s = Send(_NoRetry(), "t", b"x", 0, 1, time.monotonic() + SEND_TIMEOUT)
        s.part = Partition(3, 1)
        s.attempts += 1
        s._pipe_sent = time.monotonic()
        s._pipe_size = 40
        sends.append(s)
    return sends


def _bulk_acks_race(rounds: int = 3, n: int = 20_000) -> list[str]:
    """The reader's bulk completion (``Send.on_acks``, as the pipeline's reader calls
    it) in one thread against a thread waiting on each future in turn, with thread
    switches inside garbage collections; what went wrong."""
    problems: list[str] = []
    for _ in range(rounds):
        _sent(64)  # earlier Sends (the class's shared attribute keys fill up)
        sends = _sent(n)
        go = threading.Event()

        def complete(sends: list[Send], go: threading.Event) -> None:
            go.wait()
            for i in range(0, len(sends), 50):
                run = sends[i:i + 50]
                Send.on_acks(run, [b"%d" % (i + k) for k in range(len(run))],
                             [b"1"] * len(run), [b"%d" % (40 * (i + k)) for k in range(len(run))])

        with _collections_hand_over_the_gil():
            t = threading.Thread(target=complete, args=(sends, go), name="test-acks",
                                 daemon=True)
            t.start()
            go.set()
            for i, s in enumerate(sends):
                try:
                    r = s.result(MARGIN)
                except FutureTimeout:
                    problems.append(f"#{i}: never completed (state {s._state})")
                except Exception as e:
                    problems.append(f"#{i}: {e!r}")
                else:
                    if r != (i, "3-1", 40 * i, 3, 1):
                        problems.append(f"#{i}: wrong result {r}")
                if len(problems) > 5:
                    return problems
            t.join(30)
    return problems


def test_bulk_acks_racing_first_waits_lose_no_completion() -> None:
    # In a child process: before the fix this race also crashed the interpreter
    # (a freed values array written to), which would take the test run with it.
    # Before the fix: a segmentation fault, results with lost ack fields
    # (ValueError building the SendResult) or waits that never ended.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__],
                          capture_output=True, timeout=300, env=env, cwd=root)
    out = (proc.stdout + proc.stderr).decode("utf-8", "replace")
    assert proc.returncode == 0, f"the race run exited with {proc.returncode}:\n{out[-3000:]}"
    assert "every future completed" in out, out[-3000:]


def test_every_send_async_future_completes_while_threads_switch_in_collections(
        brokers, zk_connect: str) -> None:  # type: ignore[no-untyped-def]
    # The bench's pattern, through a real producer and broker: one thread sends while
    # another waits on each future in turn, right behind the replies, so that its
    # first wait on a future often meets the reader completing it.
    brokers(0, {"t": 4})
    n = 20_000
    with Producer(zk_connect, send_timeout=SEND_TIMEOUT) as producer:
        for f in [producer.send_async("t", b"warm-up") for _ in range(500)]:
            f.result(SEND_TIMEOUT + MARGIN)
        futures: list = []
        more = threading.Condition()

        def send() -> None:
            for _ in range(n):
                f = producer.send_async("t", b"x" * 100)
                with more:
                    futures.append(f)
                    more.notify()

        problems: list[str] = []
        results = []
        with _collections_hand_over_the_gil():
            t = threading.Thread(target=send, name="test-sender", daemon=True)
            t.start()
            for i in range(n):
                with more:
                    assert more.wait_for(lambda i=i: len(futures) > i, SEND_TIMEOUT + MARGIN)
                    f = futures[i]
                try:
                    r = f.result(SEND_TIMEOUT + MARGIN)
                except FutureTimeout:
                    problems.append(f"#{i}: not completed within send_timeout + {MARGIN}s")
                except Exception as e:
                    problems.append(f"#{i}: {e!r}")
                else:
                    results.append(r)
                if len(problems) > 5:
                    break
            t.join(30)
        assert not problems, problems
        assert all(type(r) is SendResult and r.partition == f"0-{r.index}" for r in results)
        assert len({r.msg_id for r in results}) == len({(r.partition, r.offset)
                                                         for r in results}) == n


def test_futures_keep_every_field_out_of_the_instance_dict(brokers,  # type: ignore[no-untyped-def]
                                                           zk_connect: str) -> None:
    # What makes the races above impossible: no attribute store on a future
    # goes through an instance dict (each is a slot), whoever completes or waits.
    brokers(0, {"t": 2})
    with Producer(zk_connect, send_timeout=SEND_TIMEOUT) as producer:
        futures = [producer.send_async("t", b"y" * 50) for _ in range(2000)]
        waited = futures[::7]
        for f in waited:
            f.result(SEND_TIMEOUT + MARGIN)
        for f in futures:
            f.result(SEND_TIMEOUT + MARGIN)
        futures[0].add_done_callback(lambda f: None)
        batch = producer.send_batch("t", [b"a", b"b", b"c"])
        batch.result(SEND_TIMEOUT + MARGIN)
        assert [f for f in futures if f.__dict__] == []
        assert batch.__dict__ == {}
    port = brokers(1, {"u": 1}).port
    with PipelinedConnection("127.0.0.1", port) as conn:
        puts = [conn.put("u", 0, b"z", 0, 0) for _ in range(100)]
        for p in puts:
            p.exception(SEND_TIMEOUT + MARGIN)
        assert [p for p in puts if p.__dict__] == []



def test_fields_a_retry_or_a_batch_sets_are_slots_too() -> None:
    # The retry thread stores a Send's next attempt while the user may be waiting.
    s = _sent(1)[0]
    s.tried = {s.part}
    s.attempts += 1
    s.flush = True
    s.payload = b""
    s.add_done_callback(lambda f: None)
    s.set_exception(RuntimeError("x"))
    assert s.__dict__ == {}

    batch = BatchFuture("t", 1)
    item = _BatchItem(_NoRetry(), "t", b"x", 0, 1, time.monotonic() + 1, batch, 0,
                      Partition(3, 1))
    item._pipe_sent, item._pipe_size = time.monotonic(), 4
    item.on_reply(200, b"1 1 8")
    assert batch.result(0)[0].offset == 8
    assert item.__dict__ == {} and batch.__dict__ == {}


if __name__ == "__main__":  # the child process of test_bulk_acks_racing_first_waits_...
    found = _bulk_acks_race()
    if found:
        sys.exit("\n".join(found))
    print("every future completed with its result")
