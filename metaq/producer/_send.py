"""One message on its way (:class:`Send`) and where it was stored (:class:`SendResult`).

A :class:`Send` is both the future the user holds and the request a broker
connection completes; an attempt that fails goes back to its :class:`Retrier`
(the send path, :mod:`metaq.producer._path`), which sends it again.

With the C module, a plain :class:`Send` is made and put by one C call on
``send_async``'s common path (``submit_put``, see :mod:`metaq.producer._producer`),
completed in C by its connection's reader (``take_acks``, which stores what
:meth:`Send.on_acks` stores) and read by a C ``result()`` once finished; the
Python code here is what they stand in for, and what runs without the C module.
"""

from __future__ import annotations

import functools
from concurrent.futures._base import FINISHED, RUNNING
from typing import NamedTuple, Protocol

from metaq._errors import BrokerError, ProtocolError
from metaq.net import LAZY_OK, LightFuture, PipelinedConnection
from metaq.protocol import ack_result as _ack_result
from metaq.protocol import bind_send_result as _bind_send_result
from metaq.protocol import complete_acks as _complete_acks
from metaq.protocol import untrack as _untrack
from zk_layout import Partition

__all__ = ["NO_RETRY", "Retrier", "Send", "SendResult", "make_result", "partition_names"]

#: Result codes a retry cannot fix: the same bytes would be refused anywhere (410: an
#: idempotent resend of a message stored so long ago the broker forgot where).
NO_RETRY = frozenset((400, 401, 410))
_new_tuple = tuple.__new__


class SendResult(NamedTuple):
    """Where a message was stored: its broker-assigned ``msg_id``, the
    partition name ``"<brokerId>-<index>"``, and its byte ``offset`` in that
    partition; ``broker_id`` and ``index`` are the two parts of the name."""

    msg_id: int
    partition: str
    offset: int
    broker_id: int
    index: int


class Retrier(Protocol):
    """Where a failed attempt of a :class:`Send` goes (the send path)."""

    def attempt_failed(self, send: Send, err: BaseException) -> None:
        """An attempt failed (called from a connection's reader): retry elsewhere; never blocks."""

    def fail(self, send: Send, err: BaseException, cause: BaseException | None = None) -> None:
        """Complete ``send`` with its final failure ``err``."""


class Send(LightFuture):
    """One message on its way: the future the user holds, and the request the
    broker connection completes."""

    # Slots, like LightFuture's: the sending thread, the retry thread, the reader
    # and a waiter store attributes of one Send concurrently, and first stores in an
    # instance dict can lose each other on CPython 3.11 (see LightFuture).  So no
    # class defaults either: every field a reader may look at is set in __init__.
    __slots__ = ("path", "topic", "payload", "flag", "checksum", "deadline", "attempts",
                 "part", "tried", "flush", "_ack_id", "_ack_index", "_ack_offset",
                 "_pipe_sent", "_pipe_size", "pid", "seq", "gaps")

    #: False: a connection failing under :meth:`SendPath.dispatch` hands the next attempt
    #: to the retry thread rather than pausing and reconnecting in the sending thread
    #: (:mod:`metaq.aio`'s sends, dispatched from an event loop, set it so).
    retry_here = True

    #: Set per attempt.
    attempts: int
    part: Partition | None
    tried: set[Partition] | None
    flush: bool  # write from the sending thread (a blocking send waits anyway)
    #: The idempotent producer's (``_idempotence``) id and seq of this message, once its
    #: first attempt took them, and how many gap refusals (409) in a row it met.  Not
    #: set in ``__init__`` (a plain send never touches them): read with ``getattr``.
    pid: int
    seq: int | None
    gaps: int
    #: The broker's answer as decimal bytes (``on_acks``) or ints (``take_acks``, the C
    #: reader's), when completed in bulk; set before the state becomes FINISHED, read
    #: only after it.
    _ack_id: bytes | int
    _ack_index: bytes | int
    _ack_offset: bytes | int

    def __init__(self, path: Retrier, topic: str, payload: bytes, flag: int, checksum: int,
                 deadline: float) -> None:
        if LAZY_OK:  # LightFuture.__init__, inlined: this runs once per message
            self._state = RUNNING
            self._result = None
            self._exception = None
            self._waited = False
        else:  # pragma: no cover
            LightFuture.__init__(self)
        self.path = path
        self.topic = topic
        self.payload = payload
        self.flag = flag
        self.checksum = checksum
        self.deadline = deadline
        self.attempts = 0
        self.part = None
        self.tried = None
        self.flush = False
        if type(self) is Send:
            # Out of the cyclic collector's lists: in flight a Send refers only to
            # bytes, numbers, a Partition, its producer's long-lived send path and (on
            # a retry) a set of Partitions -- nothing that can close a cycle back to
            # it -- so refcounting frees it, and the collector need not walk every
            # message in flight or held (0 collector time per message).  Whatever
            # could make a cycle puts it back first: a waiter or callback, an
            # exception (LightFuture.__getattr__ / set_exception).  Subclasses (the
            # asyncio one keeps its waiters) stay tracked.
            _untrack(self)

    def result(self, timeout: float | None = None) -> SendResult:
        """The :class:`SendResult` (see ``concurrent.futures.Future.result``).

        After a bulk acknowledgement it is built from the broker's answer on
        each call (equal each time), and not kept: a finished future is then
        a single object for the garbage collector to track."""
        if self._state != FINISHED:
            LightFuture.result(self, timeout)  # waits; raises the failure
        elif self._exception is not None:
            raise self._exception
        r = self._result
        if r is None:
            bid = self.part.broker_id  # type: ignore[union-attr]
            r = _ack_result(SendResult, self._ack_id, self._ack_index, self._ack_offset, bid,
                            _NAMES.get(bid) or partition_names(bid))
        return r

    def on_reply(self, code: int, body: bytes) -> None:
        part = self.part
        if code == 200:
            try:
                msg_id, index, offset = map(int, body.split(b" "))
            except ValueError:
                self.set_exception(ProtocolError(
                    f"broker {part.broker_id} answered a put with {bytes(body[:120])!r}, not "
                    f"'<msgId> <partition> <offset>'"))
                return
            bid = part.broker_id
            self.payload = b""  # done with it: a finished future should not pin the body
            self.set_result(_new_tuple(SendResult, (msg_id, f"{bid}-{index}", offset, bid,
                                                    index)))
            return
        err = BrokerError(code, body.decode("utf-8", "replace"),
                          broker=f"broker {part.broker_id}, partition {part}")
        if code in NO_RETRY:
            self.path.fail(self, err)  # (an idempotent one restarts its sequence there)
        else:
            self.path.attempt_failed(self, err)

    @staticmethod
    def on_acks(requests: list, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None:
        """Successful replies to many sends of one connection (its reader, in bulk).

        Each future keeps the answer's bytes; ``result()`` builds the
        :class:`SendResult` when asked (no object per message here)."""
        # set_result inlined (none of these is done: each was in the pending map), in C
        for send in _complete_acks(requests, msg_ids, partitions, offsets, FINISHED):
            send._notify()

    def on_error(self, exc: BaseException) -> None:
        self.path.attempt_failed(self, exc)


# Successful replies to plain Sends are completed in C by the connections' readers
# (``take_acks``: what on_acks does, the answer kept as ints), before any Python parsing.
PipelinedConnection.ack_type = Send


class _Names(dict):
    """Partition index (an int or its decimal bytes) -> ``"<brokerId>-<index>"`` for
    one broker, built on first use."""

    def __init__(self, broker_id: int) -> None:
        super().__init__()
        self.broker_id = broker_id

    def __missing__(self, index: int | bytes) -> str:
        if len(self) > 65536:  # a broker answering garbage indexes
            self.clear()
        name = self[index] = f"{self.broker_id}-{int(index)}"
        return name


_NAMES: dict[int, _Names] = {}
if _bind_send_result is not None:
    # result() of a finished Send in C (one call, no Python frame); the Python method
    # above does everything else (waiting, raising) and is what the C one stands for.
    Send.result = _bind_send_result(  # type: ignore[method-assign]
        Send, SendResult, _NAMES, Send.result)
#: ``make_result((msg_id, partition, offset, broker_id, index))``: a :class:`SendResult`
#: from a tuple without a call to ``__new__`` (``map`` over columns builds many at once).
make_result = functools.partial(_new_tuple, SendResult)


def partition_names(broker_id: int) -> dict[int | bytes, str]:
    """The (shared) name cache of one broker's partitions: index -> ``"<id>-<index>"``."""
    names = _NAMES.get(broker_id)
    if names is None:
        if len(_NAMES) > 4096:
            _NAMES.clear()
        names = _NAMES.setdefault(broker_id, _Names(broker_id))
    return names
