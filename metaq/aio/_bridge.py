"""The bridge from the threaded consumer's fetch runners into one event loop.

A fetch runner hands a partition's messages to a *hand-off listener*
(:class:`HandOff`, subscribed to the threaded consumer in orderly auto-ack or
manual mode) a slice at a time (up to ``max_batch`` messages, in offset order,
built by the C walk).  The listener registers the slice with the partition's
:class:`Tracker` and posts it to the loop: one ``call_soon_threadsafe`` per burst
of slices, never one per message (:class:`Inbox`).  The runner moves on at once.

The tracker is the partition state's ``inflight``: the threaded consumer's
commits stop at its oldest unfinished message (:meth:`Tracker.low`), and its
flow control (``pull_threshold_messages`` / ``_bytes``, ``max_span``) stops
fetching a partition while too much of it waits in the loop
(:meth:`Tracker.blocked`).  The loop marks messages finished (``Slice.low`` in
order, or ``Slice.flags`` when several coroutines share a partition) and drops a
slice from the tracker when it is all finished.

Thread rules: a runner appends slices (``Tracker.add``); the loop finishes and
drops them; the committing thread reads ``low()`` from a snapshot.  Each step is
one GIL-atomic operation on a deque or an attribute.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

from metaq.consumer import Message

__all__ = ["Slice", "Tracker", "Inbox", "HandOff"]

log = logging.getLogger(__name__)


class Slice:
    """One slice of a partition's messages, in offset order, and how far it is done.

    ``low``: the index of the first message not finished (every one before it is);
    ``flags``: with several coroutines on the partition, 1 for each finished message
    (``low`` follows the finished prefix)."""

    __slots__ = ("msgs", "prev_id", "low", "flags", "taken", "size", "epoch")

    def __init__(self, msgs: list[Message], prev_id: int, epoch: int) -> None:
        self.msgs = msgs
        self.prev_id = prev_id  # msgId of the message before the first one
        self.low = 0
        self.flags: bytearray | None = None
        self.taken = 0  # messages handed to coroutines (concurrent mode)
        self.size = msgs[-1][3] - msgs[0][2]
        self.epoch = epoch

    def finish(self, i: int) -> None:
        """Message ``i`` finished (any order); ``low`` follows the finished prefix."""
        flags = self.flags
        if flags is None:
            flags = self.flags = bytearray(len(self.msgs))
        flags[i] = 1
        low, n = self.low, len(self.msgs)
        while low < n and flags[low]:
            low += 1
        self.low = low

    def position(self) -> tuple[int, int] | None:
        """(offset, msgId before it) of the first unfinished message, None when done."""
        low, msgs = self.low, self.msgs
        if low >= len(msgs):
            return None
        return msgs[low][2], (msgs[low - 1][4] if low else self.prev_id)


class Tracker:
    """One partition's slices in the loop (the partition state's ``inflight``).

    ``epoch`` moves on a seek, a rollback, a revocation or a newer owner of the same
    partition: slices of an older epoch are not delivered (the workers stop at the
    next message)."""

    def __init__(self, pf: Any, handoff: HandOff, manual: bool) -> None:
        self.pf = pf
        self.key = pf.key
        self.handoff = handoff
        self.manual = manual
        self.slices: collections.deque[Slice] = collections.deque()
        # what it holds, as two counters each written by one thread only (a ``+=`` from
        # two threads can lose an update): added by the runner, removed by the loop
        self.added_messages = self.added_bytes = 0
        self.removed_messages = self.removed_bytes = 0
        self.epoch = 0
        self.dead = False
        #: the loop's side (set by the consumer): slices to deliver, the wake-up
        self.pending: collections.deque[Slice] = collections.deque()
        self.wake: asyncio.Event | None = None
        self.workers: list[Any] = []
        self.finished = 0
        #: the tracker of an earlier claim of the same partition (revoked, or its session
        #: lost): its handlers still running finish before this one's start
        self.predecessor: Tracker | None = None

    # -- the runner's side -------------------------------------------------------

    def add(self, msgs: list[Message], prev_id: int) -> Slice:
        sl = Slice(msgs, prev_id, self.epoch)
        self.slices.append(sl)
        self.added_messages += len(msgs)
        self.added_bytes += sl.size
        return sl

    @property
    def messages(self) -> int:
        """Messages held in unfinished slices."""
        return self.added_messages - self.removed_messages

    @property
    def bytes(self) -> int:
        return self.added_bytes - self.removed_bytes

    # -- the InFlight face the threaded consumer reads --------------------------

    def low(self) -> tuple[int, int] | None:
        """(offset, msgId before it) of the oldest unfinished message; None when all
        is finished, and always in manual-ack mode (the acked position rules)."""
        if self.manual:
            return None
        for sl in list(self.slices):
            pos = sl.position()
            if pos is not None:
                return pos
        return None

    def __len__(self) -> int:
        return self.messages

    def span(self) -> int:
        return self.messages

    def blocked(self, max_messages: int, max_bytes: int, max_span: int) -> bool:
        held = self.messages
        return held > max_messages or self.bytes > max_bytes or held > max_span

    def done(self, offset: int) -> None:  # InFlight's face; slices finish in the loop
        raise NotImplementedError("hand-off slices are finished by the event loop")

    # -- the loop's side -----------------------------------------------------------

    def slice_done(self, sl: Slice) -> None:
        """Every message of ``sl`` finished (or it was dropped): it stops counting."""
        try:
            self.slices.remove(sl)
        except ValueError:
            return  # dropped already
        self.removed_messages += len(sl.msgs)
        self.removed_bytes += sl.size

    def idle(self) -> bool:
        return not self.slices


class Inbox:
    """Slices posted by runner threads, taken by the loop: one wake-up a burst."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 deliver: Callable[[Tracker, Slice], None]) -> None:
        self._loop = loop
        self._deliver = deliver
        self._items: collections.deque[tuple[Tracker, Slice]] = collections.deque()
        self._scheduled = False
        self.closed = False
        self.posts = 0  # call_soon_threadsafe calls made (for the design numbers)

    def post(self, tracker: Tracker, sl: Slice) -> None:
        """(a runner) Queue a slice; wake the loop unless a wake-up is pending."""
        self._items.append((tracker, sl))
        if not self._scheduled:
            self._scheduled = True
            self.posts += 1
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop closed: nothing is delivered any more
                self.closed = True

    def _drain(self) -> None:
        self._scheduled = False  # first: a post after this wakes the loop again
        items, deliver = self._items, self._deliver
        while items:
            deliver(*items.popleft())


class HandOff:
    """The listener the threaded consumer sees for one topic: it takes slices for the
    loop (see :meth:`metaq.consumer.MessageConsumer.subscribe`'s hand-off)."""

    def __init__(self, topic: str, *, manual: bool,
                 trackers: dict[Any, Tracker], inbox: Inbox,
                 redeliver: Callable[[Any], None],
                 on_new: Callable[[Tracker, Tracker | None], None]) -> None:
        self.topic = topic
        self.manual = manual
        self._trackers = trackers
        self._inbox = inbox
        self._redeliver = redeliver
        self._on_new = on_new

    def in_flight(self, pf: Any) -> Tracker:
        """(the coordinator thread) A partition was just claimed: its tracker."""
        tracker = Tracker(pf, self, self.manual)
        old = self._trackers.get(pf.key)
        tracker.predecessor = old
        self._trackers[pf.key] = tracker
        self._on_new(tracker, old)
        return tracker

    def on_messages(self, batch: list[Message]) -> None:
        """(a runner, holding the partition) Register the slice, post it, return."""
        m = batch[0]
        tracker = self._trackers[(m[0], m[1])]
        pf = tracker.pf
        sl = tracker.add(batch, pf.msg_id)
        self._inbox.post(tracker, sl)

    def redeliver(self, message: Any) -> None:
        """(the recover store's thread) One message given up on earlier, again."""
        self._redeliver(message)
