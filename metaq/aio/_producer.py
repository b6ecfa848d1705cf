"""The asyncio producer: :class:`AsyncProducer`, a thin bridge over the threaded
:class:`metaq.Producer` that never blocks the event loop.

Design (measured before choosing)
---------------------------------
Two designs were measured against one real broker process (100 B bodies, 4
partitions, 50,000 messages per run; medians of 5 runs, of 3 for the first two
bridge rows; on the shared 2-core development machine while other work ran, so
only the ratios mean much):

=================================================  ============  ==============
                                                   pipelined      one at a time
                                                   (msgs/s)       (msgs/s)
=================================================  ============  ==============
threaded ``Producer.send_async`` / ``send``         216,000        16,600
bridge, a ``concurrent`` future per message and     35,000         -
``call_soon_threadsafe`` per completion
bridge, an asyncio future per message, one          62,000         -
``call_soon_threadsafe`` per run of replies
**bridge as built**: the send itself awaitable,     **205,000**    **10,900**
an asyncio future only when awaited unanswered,
one ``call_soon_threadsafe`` per run of replies
native asyncio (a ``Protocol`` writing put lines,   205,000        22,300
``scan_acks`` in ``data_received``; no routing,
retries, checksums per message: a lower bound)
the same with an asyncio future per message         123,000        -
=================================================  ============  ==============

(``bench/bench_aio.py`` measures the built producer beside the threaded one in
one run; a single small run there, 5,000 messages, gave 0.83x for ``send_async``
and 0.65x for ``await send``, with the loop's 1 ms ticker late by 5 ms at p99
while it sent 1,000 messages between yields.)

Pipelined, the bridge is as fast as the bare native client and within a few
per cent of the threaded producer, while keeping everything the threaded
producer guarantees (routes followed in ZooKeeper, retries on other partitions,
the idempotent producer's sequences, the in-flight window, close semantics)
without a second implementation of any of it; the broker connection's reader
thread also parses replies beside the loop instead of on it.  One message at a
time the native client is faster (one loop wake-up per reply instead of the hops
through the writer and reader threads); that is the price of the bridge, paid
by ``await send(...)`` in a tight loop only (use ``send_async`` and await later,
or ``send_batch``, for throughput).

How a send goes
---------------
:meth:`AsyncProducer.send_async` runs the threaded producer's ``send_async``
*in the loop* when nothing in it can block: the topic's route is known, each
broker has a usable connection (:meth:`metaq.Producer.ready`) and the producer's
own in-flight window (``max_in_flight`` messages, ``max_in_flight_bytes``) has
room, so the connection's window cannot be full either.  The send returned
(:class:`~metaq.aio._send.AioSend`) is awaitable.  Otherwise the message joins
a FIFO queue that one task drains in order: it waits for room without blocking
(backpressure: the coroutine awaiting the send waits) and hands sends whose
route or connection is missing to a worker thread (ZooKeeper reads, DNS,
connects happen there).  While the queue holds anything, new sends join it too,
so messages keep the order in which they were sent.  Batches and transactions
always go through the worker threads (one hop per batch or per call).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Awaitable, Generator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from kazoo.client import KazooClient

from metaq._errors import ConfigError, ProducerError, SendTimeoutError
from metaq.aio._loop import running_loop
from metaq.aio._send import OVERHEAD, AioSend, send_type
from metaq.aio._transaction import AsyncTransaction, AsyncXAResource
from metaq.producer import BatchResults, Producer, ProducerConfig, SendResult

__all__ = ["AsyncProducer"]

log = logging.getLogger(__name__)


class _Queued:
    """A send or batch waiting in the producer's queue: awaitable for its outcome."""

    __slots__ = ("args", "batch", "dispatched", "size", "deadline")

    def __init__(self, args: tuple[Any, ...], batch: bool, size: int,
                 dispatched: asyncio.Future[Any], deadline: float) -> None:
        self.args = args
        self.batch = batch
        self.size = size
        #: the send timeout's end (loop.time()): room in the window must come by then
        self.deadline = deadline
        #: the AioSend, or the _BatchWait, once handed to the threaded producer
        self.dispatched = dispatched

    def __await__(self) -> Generator[Any, None, Any]:
        # Cancelled here (still queued), the message is never sent.
        sent = yield from self.dispatched
        return (yield from sent.__await__())


class _BatchWait:
    """A batch handed to the threaded producer: awaitable for its BatchResults."""

    __slots__ = ("future", "done")

    def __init__(self, future: Future[BatchResults], done: asyncio.Future[None]) -> None:
        self.future = future
        self.done = done

    def __await__(self) -> Generator[Any, None, BatchResults]:
        yield from asyncio.shield(self.done).__await__()
        return self.future.result()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class AsyncProducer:
    """Sends messages to a Metaq cluster found through ZooKeeper, from asyncio code.

    ::

        async with AsyncProducer("127.0.0.1:2181") as producer:
            result = await producer.send("orders", b"hello")          # one, acknowledged
            pending = [producer.send_async("orders", {"id": i}) for i in range(1000)]
            results = [await p for p in pending]                      # pipelined
            batch = await producer.send_batch("orders", [b"a", b"b"]) # BatchResults
            async with producer.transaction() as tx:
                await tx.send("orders", b"in a transaction")

    The arguments, options, results and errors are those of :class:`metaq.Producer`
    (``zk_connect`` a connect string or a started ``KazooClient``; options as
    ``config=`` or keywords).  Building it does no I/O and needs no loop; ``async
    with`` (or :meth:`start`) connects to ZooKeeper on a worker thread and binds the
    producer to the running loop.  Every other call must be made in that loop
    (elsewhere it raises :class:`~metaq.ProducerError` saying so), and none blocks it.
    """

    def __init__(self, zk_connect: str | KazooClient, *, config: ProducerConfig | None = None,
                 **options: Any) -> None:
        if config is not None and options:
            raise ConfigError("pass either config= or keyword options, not both")
        if config is None:
            config = ProducerConfig.from_mapping(options)
        elif not isinstance(config, ProducerConfig):
            raise ConfigError(f"config must be a ProducerConfig, not {type(config).__name__}")
        if not isinstance(zk_connect, KazooClient) and not (
                isinstance(zk_connect, str) and zk_connect):
            raise ConfigError(f"zk_connect must be a 'host:port[/chroot]' string or a "
                              f"KazooClient, got {zk_connect!r}")
        self.config = config
        self._zk_connect = zk_connect
        self._producer: Producer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # bound by start()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._starting: asyncio.Future[None] | None = None
        # The producer's in-flight window, counted in the loop: what was handed to the
        # threaded producer and is not settled yet.  Kept within the connections' own
        # window, so that a put never waits for room (in the loop).
        self._max_count = config.max_in_flight
        self._max_bytes = config.max_in_flight_bytes
        self._max_one = config.max_message_size + OVERHEAD + 256
        self._count = 0
        self._bytes = 0
        self._room: asyncio.Future[None] | None = None  # set when the queue waits for room
        self._queue: collections.deque[_Queued] = collections.deque()
        self._drainer: asyncio.Task[None] | None = None

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        """Connect to ZooKeeper (on a worker thread) and bind to the running loop.
        Called by ``async with``; a second call waits for the first."""
        loop = running_loop("AsyncProducer.start()", ProducerError)
        if self._closed:
            raise ProducerError("the producer is closed")
        if self._starting is not None:
            if self.loop is not loop:
                raise ProducerError("this AsyncProducer was started in another event loop")
            await asyncio.shield(self._starting)
            return
        self.loop = loop
        self._starting = loop.create_future()
        self._executor = ThreadPoolExecutor(max_workers=4,
                                            thread_name_prefix="metaq-aio-producer")
        try:
            producer = await loop.run_in_executor(
                self._executor, functools.partial(Producer, self._zk_connect,
                                                  config=self.config))
        except BaseException as e:
            self._closed = True
            self._executor.shutdown(wait=False)
            self._starting.set_exception(e)
            self._starting.exception()  # retrieved: a later start() re-raises it
            raise
        producer.future_type = send_type(loop, self.settle)
        self._producer = producer
        self._starting.set_result(None)

    async def __aenter__(self) -> AsyncProducer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    async def close(self, timeout: float | None = None) -> None:
        """Send what is queued, wait (up to ``timeout``, default ``close_timeout``) for
        every message in flight to be acknowledged or to fail, then close; as
        :meth:`metaq.Producer.close`, on a worker thread."""
        running_loop("AsyncProducer.close()", ProducerError)
        if self._closed:
            return
        self._closed = True
        producer, executor = self._producer, self._executor
        if producer is None or executor is None:  # never started
            if executor is not None:
                executor.shutdown(wait=False)
            return
        try:
            if self._drainer is not None:
                await asyncio.shield(self._drainer)
            await asyncio.get_running_loop().run_in_executor(executor, producer.close, timeout)
        finally:
            executor.shutdown(wait=False)

    def _open(self, what: str) -> Producer:
        """The threaded producer, checked: started, open, called in its loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not self.loop or self._producer is None:
            if loop is None:
                running_loop(what, ProducerError)
            if self.loop is None:
                raise ProducerError(f"{what}: the producer is not started: use "
                                    f"'async with AsyncProducer(...)' or 'await start()'")
            raise ProducerError(f"{what}: this AsyncProducer belongs to another event loop "
                                f"(the one running when it was started)")
        if self._closed:
            raise ProducerError("the producer is closed")
        return self._producer

    # -- sending -------------------------------------------------------------

    def send_async(self, topic: str, body: Any, attribute: str | None = None,
                   key: Any = None) -> Awaitable[SendResult]:
        """Send one message; return an awaitable of its :class:`~metaq.SendResult`.

        Does not wait for the broker: many messages stay in flight (await each
        awaitable later, in any order).  Errors about the message itself
        (MessageTooLargeError, MessageError, ProtocolError) are raised here when the
        message goes straight out, else by the awaitable; failures of the sending
        (NoBrokerAvailableError, SendTimeoutError, BrokerError) by the awaitable.
        When the in-flight window is full the message waits in the producer's queue
        and the awaitable resolves later (awaiting it is the backpressure).
        Cancelling a task that awaits it stops the wait; a message still queued is
        then not sent, one already handed to a broker connection may be stored.
        """
        producer = self._open("AsyncProducer.send_async()")
        size = (len(body) + len(topic) + OVERHEAD if type(body) is bytes and attribute is None
                and type(topic) is str else self._estimate(topic, body, attribute))
        if not self._queue:
            count = self._count
            if (count < self._max_count and self._bytes + size <= self._max_bytes
                    or not count) and producer.ready(topic):
                # (future_type is the AioSend class: see start())
                send = cast(AioSend, producer.send_async(topic, body, attribute, key))
                self._count += 1
                self._bytes += send.aio_size
                return send
        return self._enqueue((topic, body, attribute, key), False, size)

    async def send(self, topic: str, body: Any, attribute: str | None = None,
                   key: Any = None) -> SendResult:
        """Send one message and wait for the broker's acknowledgement (see
        :meth:`metaq.Producer.send` for the errors); :meth:`send_async`, awaited."""
        result: SendResult = await self.send_async(topic, body, attribute, key)
        return result

    def send_batch(self, topic: str, bodies: Sequence[Any], *, attribute: str | None = None,
                   key: Any = None) -> Awaitable[BatchResults]:
        """Send many messages to one partition (see :meth:`metaq.Producer.send_batch`);
        return an awaitable of their :class:`~metaq.BatchResults` (raises
        :class:`~metaq.BatchSendError` when some were not stored).  Encoded and
        written on a worker thread, in order with the other sends."""
        self._open("AsyncProducer.send_batch()")
        if not isinstance(bodies, (list, tuple, bytes, bytearray, memoryview, str, dict)):
            bodies = list(bodies)  # an iterable: read once, here (the threaded one refuses
            # the other kinds, naming them, when the batch is handed over)
        size = min(self._max_bytes, sum(self._estimate(topic, b, attribute) for b in bodies))
        return self._enqueue((topic, bodies, attribute, key), True, size)

    def transaction(self, *, timeout: int = 0) -> AsyncTransaction:
        """A local transaction (see :meth:`metaq.Producer.transaction`), used with
        ``async with``; its calls run on worker threads."""
        producer = self._open("AsyncProducer.transaction()")
        assert self._executor is not None
        return AsyncTransaction(producer.transaction(timeout=timeout), self._executor)

    async def xa_resource(self, unique_qualifier: str, *, topic: str | None = None,
                          broker_id: int | None = None) -> AsyncXAResource:
        """An XA resource on one broker (see :meth:`metaq.Producer.xa_resource`)."""
        producer = self._open("AsyncProducer.xa_resource()")
        assert self._executor is not None
        resource = await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(producer.xa_resource, unique_qualifier,
                                              topic=topic, broker_id=broker_id))
        return AsyncXAResource(resource, self._executor)

    async def partitions(self, topic: str) -> list[str]:
        """The names of ``topic``'s writable partitions, in Metaq order (read from
        ZooKeeper on a worker thread the first time)."""
        producer = self._open("AsyncProducer.partitions()")
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, producer.partitions, topic)

    # -- the window and the queue (loop thread only) ----------------------------

    def settle(self, sends: list[AioSend]) -> None:
        """``sends`` completed (scheduled by their reader thread): free their share of
        the window, wake whoever awaits them."""
        self._count -= len(sends)
        freed = 0
        for s in sends:
            freed += s.aio_size
            waiters = s.aio_waiters
            if waiters is not None:
                s.aio_waiters = None
                for w in waiters:
                    if not w.done():
                        w.set_result(None)
        self._bytes -= freed
        self._room_freed()

    def _batch_settled(self, n: int, size: int, done: asyncio.Future[None]) -> None:
        self._count -= n
        self._bytes -= size
        if not done.done():
            done.set_result(None)
        self._room_freed()

    def _room_freed(self) -> None:
        room = self._room
        if room is not None and not room.done():
            room.set_result(None)

    def _estimate(self, topic: Any, body: Any, attribute: str | None) -> int:
        """An upper bound of a message's share of the window, before it is encoded."""
        if type(topic) is not str:
            return self._max_one
        extra = len(topic) + OVERHEAD + (0 if attribute is None else 4 * len(attribute) + 8)
        if isinstance(body, (bytes, bytearray)):
            return len(body) + extra
        if isinstance(body, str):
            return 4 * len(body) + extra
        return self._max_one  # a codec's output: its size is not known before encoding

    def _has_room(self, n: int, size: int) -> bool:
        return not self._count or (self._count + n <= self._max_count
                                   and self._bytes + size <= self._max_bytes)

    def _enqueue(self, args: tuple[Any, ...], batch: bool, size: int) -> _Queued:
        loop = self.loop
        assert loop is not None
        item = _Queued(args, batch, size, loop.create_future(),
                       loop.time() + self.config.send_timeout)
        self._queue.append(item)
        if self._drainer is None:
            self._drainer = loop.create_task(self._drain(), name="metaq-aio-producer-queue")
        return item

    async def _drain(self) -> None:
        """Hand the queued sends to the threaded producer, in order, each when it
        cannot block the loop (else on a worker thread)."""
        loop = asyncio.get_running_loop()
        producer, queue = self._producer, self._queue
        assert producer is not None
        try:
            while queue:
                item = queue[0]
                try:
                    if item.dispatched.done():  # cancelled while queued: never sent
                        continue
                    n = len(item.args[1]) if item.batch else 1
                    while not self._has_room(n, item.size):
                        if loop.time() >= item.deadline:  # as the threaded put's wait
                            raise SendTimeoutError(
                                f"the in-flight window stayed full ({self._count} messages, "
                                f"{self._bytes} bytes unanswered) for the send timeout "
                                f"({self.config.send_timeout:g}s); nothing was sent to topic "
                                f"{item.args[0]!r}")
                        room = self._room = loop.create_future()
                        timer = loop.call_at(item.deadline, _wake, room)
                        try:
                            await room
                        finally:
                            timer.cancel()
                            self._room = None
                    if item.dispatched.done():
                        continue
                    sent: Any
                    if item.batch:
                        sent = await self._dispatch_batch(producer, item, n)
                    elif producer.ready(item.args[0]):
                        sent = producer.send_async(*item.args)
                    else:  # ZooKeeper, DNS, connects: on a worker thread
                        sent = await loop.run_in_executor(self._executor, producer.send_async,
                                                          *item.args)
                    if not item.batch:
                        self._count += 1
                        self._bytes += sent.aio_size
                    if not item.dispatched.done():
                        item.dispatched.set_result(sent)
                except Exception as e:
                    if not item.dispatched.done():
                        item.dispatched.set_exception(e)
                finally:
                    queue.popleft()
        finally:
            self._drainer = None

    async def _dispatch_batch(self, producer: Producer, item: _Queued, n: int) -> _BatchWait:
        loop = asyncio.get_running_loop()
        topic, bodies, attribute, key = item.args
        future = await loop.run_in_executor(
            self._executor, functools.partial(producer.send_batch, topic, bodies,
                                              attribute=attribute, key=key))
        done = loop.create_future()
        self._count += n
        self._bytes += item.size

        def completed(_: object) -> None:  # any thread
            try:
                loop.call_soon_threadsafe(self._batch_settled, n, item.size, done)
            except RuntimeError:  # the loop is closed
                pass

        future.add_done_callback(completed)
        return _BatchWait(future, done)
