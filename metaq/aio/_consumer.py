"""AsyncConsumer: a consumer group member for asyncio services.

::

    async with AsyncConsumer("my-group", "127.0.0.1:2181") as consumer:
        consumer.subscribe("orders", handle)      # async def handle(message): ...
        consumer.subscribe("audit")               # no handler: read it with async for
        await consumer.start()
        async for message in consumer:            # the topics without a handler
            ...

Design: the threaded consumer's machinery does the work it does well (the
coordinator, ZooKeeper, the fetch runner threads and their C message walk, offsets
and fenced commits, the recover store and the DLQ); :mod:`metaq.aio._bridge`
hands each fetched slice (up to ``max_batch`` messages) to the event loop with one
``call_soon_threadsafe`` per burst of slices, and the handlers are awaited in the
loop.  Each partition's tracker is the threaded consumer's in-flight record, so a
commit never covers a message whose handler has not finished, and the threaded
flow-control limits bound what waits in the loop.  Native asyncio I/O would mean
a second fetch path, coordinator and commit path to keep right; the bridge costs
one cross-thread wake-up per slice instead.

Measured before choosing (2-core machine shared with other work, load 0.2-1.7;
CPython 3.11; scratch scripts, then ``bench/bench_aio.py --only consumer --runs 1``):

- moving messages into a loop, no broker (500,000 messages, a no-op coroutine
  handler): one ``call_soon_threadsafe`` per message 0.21 M msg/s; one task per
  message 0.11 M msg/s; a worker coroutine awaiting the handler inline 4.7 M msg/s.
  So: one cross-thread wake-up per slice, handlers awaited inline by one worker
  coroutine per partition (``consume_threads`` of them in concurrent mode).
- against a broker process (4 partitions, 100 B bodies, 0.3 M - 1 M messages loaded,
  one fetch runner; ranges over the runs): threaded per-message listener 4.5-5.8 M
  msg/s, threaded batch 5.7-9.2 M; this bridge with a per-message async handler
  1.4-2.3 M, async batch handler 3.5-6.1 M, ``async for`` 1.2-1.6 M.  The fetch side
  is not the limit (the threaded consumer is 2-4x faster on it), the loop's per-message
  await is: a native asyncio fetch would run in that same thread and could only take
  time from the handlers.
- send to handler at 500 msg/s, p50 (one partition, 4 runs each): threaded 0.20-0.28
  ms, aio 0.25-0.37 ms (1.15-1.24x of threaded once a woken worker takes no extra
  loop turn; 1.68x before); at 20,000 msg/s 0.24-0.25 vs 0.34 ms (1.36-1.43x).
- a 1 ms ticker's lateness while the per-message handler drains at full speed: p99
  13.8 ms when a worker ran its whole queue without a turn for the loop; 3.2-4.8 ms once
  workers yield each slice and every 128 messages, over 1 M messages (5.2 ms in one
  0.15 s run of 300,000, where p99 is nearly the maximum).  The rest is the GIL shared
  with the fetch runner and garbage collection of the message tuples: max 8-11 ms
  with the collector on, 3.6-4.6 ms with it off.  So the 5 ms target holds, narrowly.

Modes: orderly (default) runs one handler coroutine per partition at a time, in
offset order; ``consume_mode="concurrent"`` runs up to ``consume_threads``
coroutines per partition.  In both, the threaded consumer's flow-control limits
bound what waits in the loop: a partition is not fetched while more than
``pull_threshold_messages`` (or ``pull_threshold_bytes``, or ``max_span`` messages)
of it are unfinished; the fetch that crossed the line (``max_size`` bytes at most) is
delivered whole.  A handler that raises, returns RECONSUME_LATER or a value
that is not None, or runs over ``handler_timeout`` is retried in place
(``max_fetch_retries`` times, with backoff) and then given to the reject policy
(recover store, DLQ, ...), the log naming partition and offset; raising
:class:`~metaq.Rewind` retries without counting.  Manual ack (``auto_ack=False``)
commits what :meth:`AsyncConsumer.ack` acknowledged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from types import CodeType
from typing import Any

from metaq._errors import ConfigError, ConsumerClosedError, ConsumerError
from metaq._types import PartitionKey
from metaq.aio._bridge import HandOff, Inbox, Slice, Tracker
from metaq.aio._cwatch import StallWatch
from metaq.consumer import (
    RECONSUME_LATER,
    ConsumerConfig,
    Message,
    MessageConsumer,
    Rewind,
    State,
)

__all__ = ["AsyncConsumer", "running_loop"]

log = logging.getLogger(__name__)

MIB = 1024 * 1024

Handler = Callable[[Message], Awaitable[Any]]

#: A worker lets the loop run other work every this many + 1 messages (and before each
#: slice): handlers that never suspend would otherwise hold it for a whole slice.
_YIELD_MASK = 127


def running_loop(what: str) -> asyncio.AbstractEventLoop:
    """The running loop, or a ConsumerError saying ``what`` needs one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise ConsumerError(
            f"{what} needs a running asyncio event loop: call it from a coroutine "
            f"(inside asyncio.run(...)); from threads use metaq.MessageConsumer") from None


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _code(fn: Any) -> CodeType | None:
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        call = type(fn).__dict__.get("__call__")
        code = getattr(getattr(call, "__func__", call), "__code__", None)
    return code


class _Sub:
    """One subscribed topic, as the loop sees it."""

    __slots__ = ("topic", "handler", "batch", "name", "fast", "handoff")

    def __init__(self, topic: str, handler: Any, batch: bool, handoff: HandOff) -> None:
        self.topic = topic
        self.batch = batch
        self.name = _name(handler)
        self.handoff = handoff
        #: a coroutine function: awaited directly (the fast path)
        self.fast = handler is not None and inspect.iscoroutinefunction(handler)
        self.handler = handler


class _Worker:
    """One coroutine delivering a partition's messages (its task and what it is on)."""

    __slots__ = ("task", "current", "seen", "seen_at", "timed_out", "epoch")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.current: Any = None
        self.seen: Any = None
        self.seen_at = 0.0
        self.timed_out = False
        self.epoch = 0


class _Timeout(asyncio.TimeoutError):
    pass


class AsyncConsumer:
    """A member of a Metaq consumer group, for asyncio (see the module docstring).

    Created, used and closed in one running event loop (anything else raises a
    ConsumerError saying so).  ``subscribe(topic, handler)`` takes a coroutine
    function called once per message (a plain callable works too; an object with
    an async ``on_messages(batch)`` gets the partition's messages a slice at a
    time); ``subscribe(topic)`` leaves the topic to ``async for message in
    consumer`` (or ``async for batch in consumer.batches()``): a message counts as
    finished when the next one is asked for, so a body that raises or a task that
    is cancelled leaves it uncommitted.  ``on_assigned``/``on_revoked`` may be
    coroutine functions; ``on_revoked`` runs after the partition's messages in the
    loop finished (or ``drain_timeout`` passed) and before its offset is committed.

    ``handler_timeout`` (seconds, None for none): a handler still running after it
    is cancelled and counts as a failure.  ``blocking_threshold`` (seconds, None
    to turn it off): an event loop stalled longer inside a handler is reported once
    per handler, by name: a logged warning, ``metrics()["blocking_handlers"]``, and a
    :class:`~metaq.aio.BlockingHandlerWarning` to ``on_error`` (not kept for
    :meth:`check`: a warning, not a failure).  ``on_error`` is called in the loop.
    """

    def __init__(self, group: str, zk_connect: Any, *,
                 config: ConsumerConfig | None = None,
                 on_error: Callable[[BaseException], Any] | None = None,
                 on_assigned: Callable[[str, str], Any] | None = None,
                 on_revoked: Callable[[str, str], Any] | None = None,
                 handler_timeout: float | None = 60.0,
                 blocking_threshold: float | None = 0.25,
                 drain_timeout: float = 2.0,
                 **options: Any) -> None:
        self._loop = running_loop("AsyncConsumer()")
        if config is not None and options:
            raise ConfigError("pass either config= or keyword options, not both")
        cfg = config if config is not None else ConsumerConfig.from_mapping(group, options)
        for name, value in (("handler_timeout", handler_timeout),
                            ("blocking_threshold", blocking_threshold)):
            if value is not None and (isinstance(value, bool) or
                                      not isinstance(value, int | float) or value <= 0):
                raise ConfigError(f"{name} must be a number > 0 or None, got {value!r}")
        self.config = cfg
        self._concurrency = cfg.consume_threads if cfg.consume_mode == "concurrent" else 1
        self._handler_timeout = handler_timeout
        self._blocking_threshold = blocking_threshold
        self._drain_timeout = drain_timeout
        self._user_on_error = on_error
        self._user_on_assigned = on_assigned
        self._user_on_revoked = on_revoked
        self._errors: list[BaseException] = []
        self._subs: dict[str, _Sub] = {}
        self._trackers: dict[PartitionKey, Tracker] = {}
        self._inbox = Inbox(self._loop, self._deliver)
        self._workers: list[_Worker] = []
        self._stream: deque[tuple[Tracker, Slice]] = deque()
        self._stream_wake = asyncio.Event()
        self._cur: tuple[Tracker, Slice, int] | None = None  # the message async for holds
        self._cur_batch: tuple[Tracker, Slice] | None = None
        self._started = False
        self._start_task: asyncio.Future[None] | None = None
        self._closing = False
        self._closed = False
        self._close_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._codes: dict[CodeType, str] = {}
        self.failures = 0
        self.timeouts = 0
        self.finished_released = 0
        # the threaded member does the group, fetching and commits (orderly: the loop
        # runs the coroutines, in order or several at once)
        threaded = dataclasses.replace(cfg, consume_mode="orderly")
        self._consumer = MessageConsumer(
            group, zk_connect, config=threaded, on_error=self._report,
            on_assigned=self._assigned_cb, on_revoked=self._revoked_cb)
        self.consumer_id = self._consumer.consumer_id
        self._watch: StallWatch | None = None
        if blocking_threshold is not None:
            self._watch = StallWatch(self._loop, threshold=blocking_threshold,
                                     name=f"metaq-aio-watch-{self.consumer_id}",
                                     handlers=lambda: self._codes, report=self._warn)

    # -- lifecycle -----------------------------------------------------------------

    async def __aenter__(self) -> AsyncConsumer:
        self._in_loop("async with AsyncConsumer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def subscribe(self, topic: str, handler: Any = None, *, max_size: int = MIB,
                  auto_ack: bool = True, max_batch: int = 500) -> AsyncConsumer:
        """Consume ``topic`` with ``handler`` (see the class docstring); without one,
        its messages come through ``async for``.  Call before :meth:`start`."""
        self._in_loop("subscribe()")
        self._check_open()
        if self._start_task is not None:
            raise ConsumerError("subscribe() must be called before start()")
        batch = False
        fn = handler
        if handler is not None:
            on_messages = getattr(handler, "on_messages", None)
            if on_messages is not None and callable(on_messages):
                fn, batch = on_messages, True
            elif not callable(handler):
                raise ConfigError(f"handler for {topic!r} must be a coroutine function, a "
                                  f"callable or have on_messages(batch), got {handler!r}")
        if not auto_ack and self._concurrency > 1:
            raise ConfigError("manual ack works in orderly mode only")
        handoff = HandOff(topic, manual=not auto_ack, trackers=self._trackers,
                          inbox=self._inbox, redeliver=self._redeliver,
                          on_new=self._new_tracker)
        sub = _Sub(topic, fn, batch, handoff)
        if topic in self._subs:
            raise ConfigError(f"topic {topic!r} is already subscribed")
        self._consumer.subscribe(topic, handoff, max_size=max_size, auto_ack=auto_ack,
                                 max_batch=max_batch)
        self._subs[topic] = sub
        code = _code(fn) if fn is not None else None
        if code is not None:
            self._codes[code] = sub.name
        return self

    async def start(self) -> AsyncConsumer:
        """Join the group (ZooKeeper I/O runs in a thread; the loop keeps running)."""
        self._in_loop("start()")
        self._check_open()
        if self._start_task is None:  # one start, however many callers (async for too)
            self._start_task = asyncio.ensure_future(self._start())
        task = self._start_task
        try:
            await asyncio.shield(task)
        except Exception:
            if self._start_task is task:
                self._start_task = None  # failed (ZooKeeper unreachable...): may retry
            raise
        return self

    async def _start(self) -> None:
        await asyncio.to_thread(self._consumer.start)
        self._started = True
        if self._watch is not None:
            self._watch.start()
        if self._handler_timeout is not None:
            self._spawn(self._watchdog(self._handler_timeout))

    async def close(self, *, leave: bool = False) -> None:
        """Stop: handlers finish the message they are on (up to ``drain_timeout``; then
        they are cancelled), no other is started, what finished is committed, the
        partitions are released.  Idempotent; a cancelled close goes on to the end."""
        self._in_loop("close()")
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._close(leave))
        await asyncio.shield(self._close_task)

    async def _close(self, leave: bool) -> None:
        self._closing = True
        for tracker in list(self._trackers.values()):
            if tracker.wake is not None:
                tracker.wake.set()
        self._stream_wake.set()
        tasks = [w.task for w in self._workers if w.task is not None and not w.task.done()]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=self._drain_timeout)
            for t in late:
                t.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self._consumer.close, leave=leave)
        if self._watch is not None:  # joined from a thread: it may wait on the loop
            await asyncio.to_thread(self._watch.stop)
        self._closed = True

    # -- async for -------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Message]:
        self._in_loop("async for over AsyncConsumer")
        return _Messages(self)

    def batches(self) -> AsyncIterator[list[Message]]:
        """``async for batch in consumer.batches()``: a partition's messages in offset
        order, a slice at a time; a batch counts as finished when the next is asked."""
        self._in_loop("consumer.batches()")
        return _Batches(self)

    async def _next_slice(self) -> tuple[Tracker, Slice] | None:
        """The next slice of a handler-less topic with something to deliver (None when
        closing)."""
        stream = self._stream
        while True:
            if self._closing:
                return None
            while stream:
                tracker, sl = stream[0]
                if sl.epoch != tracker.epoch or tracker.dead or sl.low >= len(sl.msgs):
                    stream.popleft()
                    continue
                return tracker, sl
            if not self._started:
                await self.start()
                continue
            self._stream_wake.clear()
            await self._stream_wake.wait()

    async def _next_message(self, fresh: bool) -> Message:
        cur = self._cur
        if cur is not None:
            tracker, sl, i = cur
            if fresh and sl.epoch == tracker.epoch and not tracker.dead:
                return sl.msgs[i]  # not finished: a new iteration gets it again
            self._cur = None
            sl.low = i + 1
            if sl.low >= len(sl.msgs):
                self._slice_done(tracker, sl)
                if self._stream and self._stream[0][1] is sl:
                    self._stream.popleft()
        got = self._stream[0] if self._stream else None
        if got is not None and got[1].low == 0:
            await asyncio.sleep(0)  # a new slice: let other work run (see _work)
        if got is None or got[1].epoch != got[0].epoch or got[0].dead or self._closing:
            got = await self._next_slice()
            if got is None:
                raise StopAsyncIteration
        tracker, sl = got
        i = sl.low
        self._cur = (tracker, sl, i)
        return sl.msgs[i]

    async def _next_batch(self, fresh: bool) -> list[Message]:
        cur = self._cur_batch
        if cur is not None:
            tracker, sl = cur
            if fresh and sl.epoch == tracker.epoch and not tracker.dead:
                return sl.msgs[sl.low:]
            self._cur_batch = None
            sl.low = len(sl.msgs)
            self._slice_done(tracker, sl)
            if self._stream and self._stream[0][1] is sl:
                self._stream.popleft()
        got = await self._next_slice()
        if got is None:
            raise StopAsyncIteration
        tracker, sl = got
        self._cur_batch = got
        return sl.msgs[sl.low:]

    # -- from the runners, in the loop ------------------------------------------------

    def _new_tracker(self, tracker: Tracker, old: Tracker | None) -> None:
        """(the coordinator thread) A partition was claimed; a tracker of an earlier
        claim of it (a lost session) delivers nothing more."""
        if old is not None:
            self._threadsafe(self._kill, old)

    def _deliver(self, tracker: Tracker, sl: Slice) -> None:
        if tracker.dead or sl.epoch != tracker.epoch or self._closing:
            return  # stays in the tracker, unfinished: never committed
        sub = self._subs[tracker.key[0]]
        if sub.handler is None:
            self._stream.append((tracker, sl))
            self._stream_wake.set()
            return
        tracker.pending.append(sl)
        if tracker.wake is None:
            tracker.wake = asyncio.Event()
            for _ in range(self._concurrency):
                w = _Worker()
                w.task = self._loop.create_task(self._work(tracker, sub, w))
                w.task.add_done_callback(self._worker_ended)
                tracker.workers.append(w)
                self._workers.append(w)
        tracker.wake.set()

    def _worker_ended(self, task: asyncio.Task[None]) -> None:
        """A worker that ended on an error (never a handler's: those are settled) leaves
        its partition undelivered: say so, loudly."""
        if not task.cancelled() and (error := task.exception()) is not None:
            log.error("a delivery coroutine of %s failed: %r", self.consumer_id, error,
                      exc_info=error)
            self._report(error)

    def _slice_done(self, tracker: Tracker, sl: Slice) -> None:
        tracker.slice_done(sl)
        tracker.finished += len(sl.msgs)

    def _kill(self, tracker: Tracker) -> None:
        """Deliver nothing more of ``tracker`` (its slices stay, uncommitted)."""
        tracker.dead = True
        tracker.epoch += 1
        tracker.pending.clear()
        if tracker.wake is not None:
            tracker.wake.set()
        self._stream_wake.set()

    # -- the workers -------------------------------------------------------------------

    async def _work(self, tracker: Tracker, sub: _Sub, w: _Worker) -> None:
        pending = tracker.pending
        wake = tracker.wake
        assert wake is not None
        ordered = self._concurrency == 1 or sub.batch
        woken = False
        try:
            old, tracker.predecessor = tracker.predecessor, None
            busy = [x.task for x in old.workers if x.task is not None and
                    x.current is not None and not x.task.done()] if old is not None else []
            if busy:  # an earlier claim's handler still running: one at a time, in order
                await asyncio.wait(busy, timeout=self._drain_timeout)
            while not self._closing and not tracker.dead:
                try:
                    if not pending:
                        wake.clear()
                        await wake.wait()
                        woken = True
                        continue
                    sl = pending[0]
                    if sl.low == 0 and sl.taken == 0 and not woken:
                        # a new slice after another: let the loop run other work first
                        # (a handler that never suspends would hold it for every slice
                        # waiting); not right after a wake-up: that is a turn already
                        await asyncio.sleep(0)
                        if self._closing or tracker.dead or not pending:
                            continue
                        sl = pending[0]
                    woken = False
                    if ordered:
                        pending.popleft()
                        w.epoch = sl.epoch
                        if sub.batch:
                            await self._run_batch(tracker, sub, sl, w)
                        else:
                            await self._run_slice(tracker, sub, sl, w)
                    else:
                        i = sl.taken
                        sl.taken = i + 1
                        if sl.taken >= len(sl.msgs):
                            pending.popleft()
                        w.epoch = sl.epoch
                        await self._run_one(tracker, sub, sl, i, w)
                except asyncio.CancelledError:
                    # the watchdog's cancel landing after the handler returned
                    if w.timed_out and not self._closing:
                        w.timed_out = False
                        assert w.task is not None
                        w.task.uncancel()
                        continue
                    raise
        finally:
            w.current = None
            self._workers.remove(w)  # the watchdog and close look at live ones only

    async def _run_slice(self, tracker: Tracker, sub: _Sub, sl: Slice, w: _Worker) -> None:
        """Orderly, per message: the hot loop."""
        msgs, handler, ep = sl.msgs, sub.handler, sl.epoch
        fast = sub.fast
        n = len(msgs)
        i = sl.low
        while i < n:
            if tracker.epoch != ep or self._closing:
                return
            m = msgs[i]
            w.current = m
            try:
                r = await handler(m) if fast else await self._call(handler, m)
            except asyncio.CancelledError:
                r = self._cancelled(sub, w, m)
            except Exception as e:  # noqa: BLE001 - the handler's failure, handled below
                r = e
            if r is not None and not await self._settle(tracker, sub, m, r, w, ep):
                return
            i += 1
            sl.low = i
            if not i & _YIELD_MASK:
                await asyncio.sleep(0)  # a handler that never suspends: others run too
        w.current = None
        self._slice_done(tracker, sl)

    async def _run_one(self, tracker: Tracker, sub: _Sub, sl: Slice, i: int,
                       w: _Worker) -> None:
        """Concurrent mode: one message of a slice, finished in any order."""
        m = sl.msgs[i]
        ep = sl.epoch
        if tracker.epoch != ep:
            return
        w.current = m
        try:
            r = await sub.handler(m) if sub.fast else await self._call(sub.handler, m)
        except asyncio.CancelledError:
            r = self._cancelled(sub, w, m)
        except Exception as e:  # noqa: BLE001
            r = e
        if r is not None and not await self._settle(tracker, sub, m, r, w, ep):
            return
        w.current = None
        sl.finish(i)
        if sl.low >= len(sl.msgs):
            self._slice_done(tracker, sl)

    async def _run_batch(self, tracker: Tracker, sub: _Sub, sl: Slice, w: _Worker) -> None:
        """A batch handler: the slice (from its first unfinished message) at once."""
        ep = sl.epoch
        batch = sl.msgs[sl.low:]
        w.current = batch
        try:
            r = await self._call(sub.handler, batch)
        except asyncio.CancelledError:
            r = self._cancelled(sub, w, batch[0])
        except Exception as e:  # noqa: BLE001
            r = e
        if r is not None and not await self._settle(tracker, sub, batch, r, w, ep):
            return
        w.current = None
        sl.low = len(sl.msgs)
        self._slice_done(tracker, sl)

    @staticmethod
    async def _call(handler: Any, m: Any) -> Any:
        r = handler(m)
        if inspect.isawaitable(r):
            r = await r
        return r

    def _cancelled(self, sub: _Sub, w: _Worker, m: Any) -> BaseException:
        """A CancelledError out of a handler: the watchdog's (a timeout: a failure) or
        a real one (re-raised)."""
        if not w.timed_out or self._closing:
            raise asyncio.CancelledError
        w.timed_out = False
        assert w.task is not None
        w.task.uncancel()
        self.timeouts += 1
        return _Timeout(f"handler {sub.name} did not finish {m[0]}/{m[1]} offset {m[2]} "
                        f"within handler_timeout={self._handler_timeout}s")

    async def _settle(self, tracker: Tracker, sub: _Sub, m: Any, r: Any, w: _Worker,
                      ep: int) -> bool:
        """The handler did not return None on ``m`` (a message, or a batch): retry it
        in place with backoff, then reject it; True once it is settled, False when the
        partition moved on (seek, revoked, closing) meanwhile."""
        pf = tracker.pf
        first = m[0] if sub.batch else m
        count = 0
        while r is not None:
            if isinstance(r, Rewind):
                delay = pf.retry_backoff
            else:
                if r is RECONSUME_LATER:
                    exc: BaseException = ConsumerError(
                        f"handler {sub.name} asked to reconsume {first[0]}/{first[1]} "
                        f"offset {first[2]} later")
                elif isinstance(r, BaseException):
                    exc = r
                else:
                    exc = TypeError(f"handler {sub.name} returned {r!r} for {first[0]}/"
                                    f"{first[1]} offset {first[2]}: expected None or "
                                    f"RECONSUME_LATER")
                count += 1
                self.failures += 1
                if count > pf.max_retries:
                    log.error("giving up on %s/%s offset %d msgId %d after %d failures of "
                              "handler %s: %r", first[0], first[1], first[2], first[4],
                              count, sub.name, exc)
                    w.current = None
                    if await self._reject(pf, m if sub.batch else [m], exc):
                        return True
                    count = 0  # the reject handler failed: never skip it silently
                delay = min(pf.retry_backoff * 2 ** max(count - 1, 0), 30.0)
                log.warning("handler %s failed on %s/%s offset %d (try %d of %d): %r; "
                            "retry in %.1fs", sub.name, first[0], first[1], first[2], count,
                            pf.max_retries + 1, exc, delay)
            w.current = w.seen = None
            await asyncio.sleep(delay)
            if tracker.epoch != ep or self._closing:
                return False
            w.current = m
            try:
                r = await self._call(sub.handler, m)
            except asyncio.CancelledError:
                r = self._cancelled(sub, w, first)
            except Exception as e:  # noqa: BLE001
                r = e
        return True

    async def _reject(self, pf: Any, msgs: list[Any], exc: BaseException) -> bool:
        if pf.reject is None:
            return True
        try:
            for m in msgs:  # recover store / DLQ do I/O: in a thread
                await asyncio.to_thread(pf.reject, m, exc)
        except Exception as e:  # noqa: BLE001
            log.exception("reject handler failed; %s/%s offset %d stays uncommitted",
                          msgs[0][0], msgs[0][1], msgs[0][2])
            self._report(e)
            return False
        return True

    async def _watchdog(self, timeout: float) -> None:
        """Cancel a handler running longer than ``timeout`` (a failure: retried)."""
        period = min(1.0, timeout / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for w in self._workers:
                cur = w.current
                if cur is None or cur is not w.seen:
                    w.seen, w.seen_at = cur, now
                elif now - w.seen_at >= timeout and not w.timed_out and w.task is not None:
                    w.timed_out = True
                    w.seen = None
                    w.task.cancel()

    def _redeliver(self, m: Message) -> None:
        """(the recover store's thread) Run ``m``'s handler once; raising keeps it."""
        sub = self._subs.get(m.topic)
        if sub is None or sub.handler is None:
            raise ConsumerError(f"no handler for {m.topic}: recovered message waits")
        call = self._call(sub.handler, [m] if sub.batch else m)
        fut = asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(call, self._handler_timeout), self._loop)
        r = fut.result()
        if r is not None:
            raise ConsumerError(f"handler {sub.name} returned {r!r} for recovered "
                                f"{m.topic}/{m.partition} offset {m.offset}")

    # -- rebalance callbacks (the coordinator thread) ----------------------------------

    def _assigned_cb(self, topic: str, partition: str) -> None:
        if self._user_on_assigned is not None:
            self._run_in_loop(self._call2(self._user_on_assigned, topic, partition))

    def _revoked_cb(self, topic: str, partition: str) -> None:
        self._run_in_loop(self._revoke(topic, partition))

    async def _revoke(self, topic: str, partition: str) -> None:
        tracker = self._trackers.get(PartitionKey(topic, partition))
        if tracker is not None:
            deadline = time.monotonic() + self._drain_timeout
            while not tracker.idle() and not self._closing and time.monotonic() < deadline:
                await asyncio.sleep(0.005)  # its coroutines finishing, with a deadline
            self._kill(tracker)
            self.finished_released += tracker.finished
        if self._user_on_revoked is not None:
            await self._call2(self._user_on_revoked, topic, partition)

    @staticmethod
    async def _call2(fn: Callable[[str, str], Any], topic: str, partition: str) -> None:
        r = fn(topic, partition)
        if inspect.isawaitable(r):
            await r

    def _run_in_loop(self, coro: Any) -> None:
        """(another thread) Run ``coro`` in the loop and wait for it; its failure is
        raised (the threaded consumer reports a callback's)."""
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError:  # the loop is closed: nothing of ours runs any more
            coro.close()
            return
        fut.result(self.config.close_timeout)

    def _threadsafe(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop is closed

    # -- control -----------------------------------------------------------------------

    def ack(self, message: Message) -> None:
        """Manual ack: everything of the message's partition up to it is done."""
        self._consumer.ack(message)

    def rollback(self, topic: str, partition: str) -> None:
        """Manual ack: deliver again from the last acknowledged message."""
        self._in_loop("rollback()")
        self._consumer.rollback(topic, partition)
        self._reposition(topic, partition)

    def seek(self, topic: str, partition: str, offset: int) -> None:
        """Deliver ``topic``/``partition`` from byte ``offset`` next; messages of it
        already in the loop and not started are not delivered."""
        self._in_loop("seek()")
        self._consumer.seek(topic, partition, offset)
        self._reposition(topic, partition)

    def seek_to_time(self, topic: str, partition: str | None, when: object) -> None:
        """As :meth:`metaq.MessageConsumer.seek_to_time` (of one partition, or with
        None of every partition of ``topic`` owned now)."""
        self._in_loop("seek_to_time()")
        parts = [partition] if partition is not None else \
            self._consumer.assignment().get(topic, [])
        self._consumer.seek_to_time(topic, partition, when)
        for p in parts:
            self._reposition(topic, p)

    def _reposition(self, topic: str, partition: str) -> None:
        """A seek or rollback: what the loop holds of the partition is not delivered;
        it stops holding back commits once the runner applied the request."""
        tracker = self._trackers.get(PartitionKey(topic, partition))
        if tracker is None:
            return
        tracker.epoch += 1
        tracker.pending.clear()
        self._spawn(self._forget_old(tracker, tracker.epoch))

    async def _forget_old(self, tracker: Tracker, epoch: int) -> None:
        pf = tracker.pf
        deadline = time.monotonic() + self.config.close_timeout
        while time.monotonic() < deadline and (
                pf.seek_to is not None or pf.rollback or
                any(w.epoch < epoch and w.current is not None for w in tracker.workers)):
            await asyncio.sleep(0.005)  # the runner applies it before its next fetch
        for sl in list(tracker.slices):
            if sl.epoch < epoch:
                tracker.slice_done(sl)

    def pause(self, topic: str, partition: str) -> None:
        """Stop fetching a partition (what the loop holds of it is still delivered)."""
        self._consumer.pause(topic, partition)

    def resume(self, topic: str, partition: str) -> None:
        self._consumer.resume(topic, partition)

    def commit(self) -> None:
        """Ask for a commit at the next coordinator turn (the timer also commits)."""
        self._consumer.commit()

    # -- inspection --------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._consumer.state

    @property
    def generation(self) -> int:
        return self._consumer.generation

    def assignment(self) -> dict[str, list[str]]:
        return self._consumer.assignment()

    def committed(self) -> dict[PartitionKey, int]:
        return self._consumer.committed()

    def positions(self) -> dict[PartitionKey, int]:
        """(topic, partition) -> the next offset fetched (handed to the loop)."""
        return self._consumer.positions()

    async def wait_settled(self, timeout: float) -> bool:
        """True once every assigned partition is owned and fetching (False at timeout)."""
        return await asyncio.to_thread(self._consumer.wait_settled, timeout)

    async def lag(self, timeout: float = 5.0, *, seconds: bool = False
                  ) -> dict[PartitionKey, int | float | None]:
        """As :meth:`metaq.MessageConsumer.lag` (the broker is asked from a thread)."""
        return await asyncio.to_thread(self._consumer.lag, timeout, seconds=seconds)

    def metrics(self) -> dict[str, Any]:
        """The threaded member's metrics (``messages``: fetched and handed to the loop)
        plus the loop's: ``finished`` (handlers done), ``in_loop`` (held, unfinished),
        ``handler_failures``, ``handler_timeouts``, ``blocking_handlers`` (names
        reported), ``loop_wakeups`` (cross-thread hand-offs made)."""
        out = self._consumer.metrics()
        trackers = [t for t in self._trackers.values() if not t.dead]
        out.update({
            "finished": self.finished_released + sum(t.finished for t in trackers),
            "in_loop": sum(t.messages for t in trackers),
            "handler_failures": self.failures, "handler_timeouts": self.timeouts,
            "blocking_handlers": sorted(self._watch.reported) if self._watch else [],
            "loop_wakeups": self._inbox.posts})
        return out

    def errors(self) -> list[BaseException]:
        return list(self._errors)

    def check(self) -> None:
        """Raise the first background error not yet seen, as a ConsumerError."""
        if self._errors:
            err = self._errors.pop(0)
            raise ConsumerError(f"background failure in consumer {self.consumer_id}: "
                                f"{err}") from err

    @property
    def failed(self) -> BaseException | None:
        """The error that made this member give up for good, None while it works."""
        return self._consumer.failed

    @property
    def recover_store(self) -> Any:
        """The local store of messages the handler gave up on (see reject_policy; the
        threaded consumer's ``RecoverStore``)."""
        return self._consumer.recover_store

    # -- helpers -------------------------------------------------------------------------

    def _report(self, error: BaseException) -> None:
        """(any thread) The error sink: the user's on_error in the loop, else kept."""
        if self._user_on_error is None:
            self._errors.append(error)
            del self._errors[:-100]
            return
        self._threadsafe(self._call_on_error, error)

    def _warn(self, warning: BaseException) -> None:
        """(the stall watch) A handler blocked the loop: logged there, listed in
        metrics; given to on_error when there is one, never raised by check()."""
        if self._user_on_error is not None:
            self._threadsafe(self._call_on_error, warning)

    def _call_on_error(self, error: BaseException) -> None:
        assert self._user_on_error is not None
        try:
            r = self._user_on_error(error)
            if inspect.isawaitable(r):
                self._spawn(r)
        except Exception:  # noqa: BLE001
            log.exception("on_error callback failed")

    def _spawn(self, coro: Any) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _in_loop(self, what: str) -> None:
        loop = running_loop(what)
        if loop is not self._loop:
            raise ConsumerError(f"{what}: this AsyncConsumer belongs to another event loop")

    def _check_open(self) -> None:
        if self._closing:
            raise ConsumerClosedError(f"consumer {self.consumer_id} is closed")


class _Messages:
    """``async for message in consumer``."""

    def __init__(self, consumer: AsyncConsumer) -> None:
        self._c = consumer
        self._fresh = True

    def __aiter__(self) -> _Messages:
        return self

    async def __anext__(self) -> Message:
        fresh, self._fresh = self._fresh, False
        return await self._c._next_message(fresh)


class _Batches:
    """``async for batch in consumer.batches()``."""

    def __init__(self, consumer: AsyncConsumer) -> None:
        self._c = consumer
        self._fresh = True

    def __aiter__(self) -> _Batches:
        return self

    async def __anext__(self) -> list[Message]:
        fresh, self._fresh = self._fresh, False
        return await self._c._next_batch(fresh)
