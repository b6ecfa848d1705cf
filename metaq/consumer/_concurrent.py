"""Concurrent consumption: a partition's messages handed to a worker pool.

The fetcher walks a batch in order and hands each message to a pool of
``consume_threads`` workers; the partition's *committed* position is the
smallest offset still in flight (RocketMQ's rule), so a crash never skips a
message that was not finished.  A failed message is retried later by a
scheduler thread (it stays in flight meanwhile) and after ``max_retries``
goes to the reject handler, like in orderly mode.

Flow control (RocketMQ's defaults): a partition is not fetched while more than
``max_messages`` or ``max_bytes`` of it are in flight, or while the span
between its oldest and newest in-flight messages is over ``max_span`` messages.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["InFlight", "ConcurrentDispatcher", "RECONSUME_LATER", "ReconsumeLater"]

log = logging.getLogger(__name__)


class _Status:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: Return this from a listener to have the message delivered again later
#: (counted as a failed attempt, like raising).
RECONSUME_LATER = _Status("RECONSUME_LATER")


class ReconsumeLater(Exception):  # noqa: N818 - raised for a RECONSUME_LATER return
    def __init__(self) -> None:
        super().__init__("listener asked to reconsume later")


class InFlight:
    """Messages of one partition handed out and not finished (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[int, int, int]] = {}  # offset -> (seq, prev_id, size)
        self._heap: list[int] = []
        self._seq = itertools.count()
        self.newest_seq = -1
        self.bytes = 0

    def add(self, offset: int, prev_msg_id: int, size: int) -> None:
        with self._lock:
            seq = next(self._seq)
            self._live[offset] = (seq, prev_msg_id, size)
            heapq.heappush(self._heap, offset)
            self.newest_seq = seq
            self.bytes += size

    def done(self, offset: int) -> None:
        with self._lock:
            entry = self._live.pop(offset, None)
            if entry is not None:
                self.bytes -= entry[2]
            heap = self._heap
            while heap and heap[0] not in self._live:
                heapq.heappop(heap)

    def low(self) -> tuple[int, int] | None:
        """(offset, msgId before it) of the oldest unfinished message, or None."""
        with self._lock:
            if not self._heap:
                return None
            off = self._heap[0]
            return off, self._live[off][1]

    def __len__(self) -> int:
        return len(self._live)

    def span(self) -> int:
        with self._lock:
            if not self._heap:
                return 0
            return self.newest_seq - self._live[self._heap[0]][0]

    def blocked(self, max_messages: int, max_bytes: int, max_span: int) -> bool:
        return (len(self._live) > max_messages or self.bytes > max_bytes
                or self.span() > max_span)


class ConcurrentDispatcher:
    """The worker pool and the retry scheduler shared by a consumer's partitions."""

    def __init__(self, *, workers: int, name: str, backoff: float = 0.5,
                 max_backoff: float = 30.0) -> None:
        # plain threads on a C queue: no Future per message (ThreadPoolExecutor's cost)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._workers = [threading.Thread(target=self._work_loop, name=f"{name}-{i}",
                                          daemon=True) for i in range(workers)]
        for t in self._workers:
            t.start()
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._cond = threading.Condition()
        self._retries: list[tuple[float, int, Any, Any, int]] = []
        self._tick = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._schedule, name=f"{name}-retry",
                                        daemon=True)
        self._thread.start()

    def submit(self, pf: Any, message: Any, attempt: int = 0) -> None:
        self._work.put((pf, message, attempt))

    def _work_loop(self) -> None:
        get, run = self._work.get, self._run
        while True:
            item = get()
            if item is None:
                return
            run(*item)

    def _run(self, pf: Any, m: Any, attempt: int) -> None:
        listener: Callable[[Any], Any] = pf.listener
        try:
            if listener(m) is RECONSUME_LATER:
                raise ReconsumeLater()
        except Exception as exc:  # noqa: BLE001 - the listener's failure is handled here
            self._failed(pf, m, attempt + 1, exc)
            return
        pf.inflight.done(m[2])

    def _failed(self, pf: Any, m: Any, attempt: int, exc: BaseException) -> None:
        if attempt > pf.max_retries:
            log.error("giving up on %s/%s offset %d msgId %d after %d failures: %r", m[0],
                      m[1], m[2], m[4], attempt, exc)
            try:
                if pf.reject is not None:
                    pf.reject(m, exc)
            except Exception:  # noqa: BLE001 - keep it in flight: never skip it silently
                log.exception("reject handler failed; %s/%s offset %d stays uncommitted",
                              m[0], m[1], m[2])
                return
            pf.inflight.done(m[2])
            return
        delay = min(self._max_backoff, self._backoff * 2 ** (attempt - 1))
        log.warning("listener failed on %s/%s offset %d (try %d of %d): %r; retry in %.1fs",
                    m[0], m[1], m[2], attempt, pf.max_retries + 1, exc, delay)
        with self._cond:
            heapq.heappush(self._retries,
                           (time.monotonic() + delay, next(self._tick), pf, m, attempt))
            self._cond.notify()

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._retries or
                                            self._retries[0][0] > time.monotonic()):
                    wait = self._retries[0][0] - time.monotonic() if self._retries else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, _, pf, m, attempt = heapq.heappop(self._retries)
            if pf.active:  # a revoked partition's message is not committed: the next
                self._work.put((pf, m, attempt))  # owner delivers it again

    def wait_idle(self, pf: Any, timeout: float) -> bool:
        """Wait until ``pf`` has nothing in flight (True) or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while len(pf.inflight):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)  # polling a counter owned by worker threads, with a deadline
        return True

    @property
    def threads(self) -> list[threading.Thread]:
        return [self._thread, *self._workers]

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for _ in self._workers:
            self._work.put(None)  # after the queued work: in-flight messages finish first
        deadline = time.monotonic() + timeout
        for t in [*self._workers, self._thread]:
            t.join(max(0.0, deadline - time.monotonic()))
