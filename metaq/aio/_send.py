"""One message of an :class:`~metaq.aio.AsyncProducer` on its way: a threaded
:class:`~metaq.producer.Send` that is also awaitable, completed into the event loop.

The broker connection's reader thread completes sends exactly as for the threaded
producer (in bulk: ``on_acks``); the only additions are one
``loop.call_soon_threadsafe`` per completed run of replies (not per message) to the
producer's :class:`LoopWindow`, which frees its share of the in-flight window and
wakes the coroutines that await those sends.  Awaiting a send that is already
acknowledged (the usual case when many are pipelined) creates nothing: no asyncio
future, no callback, no wake-up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from concurrent.futures._base import FINISHED
from typing import Any, ClassVar

from metaq._errors import SendTimeoutError
from metaq.producer import Send, SendResult

__all__ = ["AioSend", "OVERHEAD", "send_type"]

#: Bytes a put request adds to its payload, at most (command line with topic, partition,
#: length, flag, checksum, opaque; an idempotent mark line), beside the topic's length.
OVERHEAD = 160


class AioSend(Send):
    """A :class:`~metaq.producer.Send` that can be awaited in the event loop of its
    producer (``await producer.send_async(...)`` is its :class:`~metaq.SendResult`).

    Awaiting it waits for the broker's answer, at most until the send deadline (then
    :class:`~metaq.SendTimeoutError`: the message may or may not have been stored).
    Cancelling the awaiting task stops the wait at once; it does not take the message
    back (it may already be on the wire, as with the threaded producer).
    """

    __slots__ = ("aio_size", "aio_waiters")

    #: a connection failing as it is put: the retry thread takes it from there (it may
    #: pause and connect; the loop must not)
    retry_here = False

    #: set on the per-producer subclass (:func:`send_type`): the producer's loop
    loop: ClassVar[asyncio.AbstractEventLoop]

    @staticmethod
    def settle(sends: list[AioSend]) -> None:
        """Called in :attr:`loop` with completed sends (the producer's window); set on
        the per-producer subclass (:func:`send_type`)."""
        raise NotImplementedError

    def __init__(self, path: Any, topic: str, payload: bytes, flag: int, checksum: int,
                 deadline: float) -> None:
        Send.__init__(self, path, topic, payload, flag, checksum, deadline)
        #: this message's share of the in-flight window (bytes, an upper bound)
        self.aio_size = len(payload) + len(topic) + OVERHEAD
        #: asyncio futures of coroutines awaiting this send (loop thread only)
        self.aio_waiters: list[asyncio.Future[None]] | None = None

    def __await__(self) -> Generator[Any, None, SendResult]:
        if self._state != FINISHED:
            # Both this and the producer's settle() run in the loop thread, and settle() is
            # scheduled only after the state became FINISHED: seen not finished here, the
            # waiter is in place before settle() looks.
            loop = self.loop
            waiter: asyncio.Future[None] = loop.create_future()
            if self.aio_waiters is None:
                self.aio_waiters = [waiter]
            else:
                self.aio_waiters.append(waiter)
            timer = loop.call_at(self.deadline + 0.05, _expire, waiter)
            try:
                yield from waiter
            finally:
                timer.cancel()
            if self._state != FINISHED:
                raise SendTimeoutError(
                    f"no acknowledgement for a message to topic {self.topic!r} within the "
                    f"send timeout ({self.attempts} attempt(s)); it may or may not have "
                    f"been stored")
        return self.result()

    # -- completion (any thread: the reader, the retry thread, the sender) --------------

    def set_result(self, result: Any) -> None:
        Send.set_result(self, result)
        _notify(self, [self])

    def set_exception(self, exception: BaseException | None) -> None:
        Send.set_exception(self, exception)
        _notify(self, [self])

    @staticmethod
    def on_acks(requests: list[Any], msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None:
        Send.on_acks(requests, msg_ids, partitions, offsets)
        # The reader groups a run by the request's class: one class per producer.
        _notify(requests[0], requests)


def _notify(send: AioSend, sends: list[AioSend]) -> None:
    try:
        send.loop.call_soon_threadsafe(send.settle, sends)
    except RuntimeError:  # the loop is closed: nobody is left to wake
        pass


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def send_type(loop: asyncio.AbstractEventLoop,
              settle: Callable[[list[AioSend]], None]) -> type[AioSend]:
    """The :class:`AioSend` class of one producer: ``settle(sends)`` is called in ``loop``
    (once per run of replies) with the sends completed."""
    return type("AioSend", (AioSend,), {"__slots__": (), "loop": loop,
                                        "settle": staticmethod(settle),
                                        "__module__": __name__})
