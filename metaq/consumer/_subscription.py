"""Subscription state: what this member consumes, and where each partition it owns stands.

kafka-python's ``SubscriptionState`` / ``TopicPartitionState``, for Metaq:

- :class:`Subscription`: one subscribed topic (its listener, fetch size, ack
  mode, batch size), fixed by ``subscribe`` before the member starts;
- :class:`PartitionState`: one owned partition (Metaq's FetchRequest): the
  settings it was built with, its progress, the requests other threads make of
  it, its scheduling flags and its commit bookkeeping, with a method for each
  transition another module causes;
- :class:`SubscriptionState`: owns the subscriptions and the assignment (the
  state of every partition owned now), and builds a partition's state from its
  committed offset.

Each group of :class:`PartitionState` attributes has one owner::

    group         attributes                      written by (and what guards it)
    settings      topic, partition, listener,     whoever builds it, before it is
                  codec, verify, max_batch, ...   fetched; read-only afterwards
    progress      offset, msg_id, consumed,       the runner holding it (``busy``; one
                  retry_*, max_size, checked,     at a time, so no lock)
                  stalled, counters, backoff
    requests      seek_to, rollback, acked        any thread; a seek or rollback is
                                                  applied by the runner before its
                                                  next fetch
    scheduling    active, busy, paused, due,      the fetch manager, under its lock
                  queued_token, hold_token
    coordination  broker_address, ownership,      the coordinator thread
                  committed

The delivery loops (``_processor``) read the settings and write the progress
as plain attributes, once per batch or per message: no method call or property
on that path.  Everyone else changes a partition's state through the methods.

Nothing here touches the wire: the connections, the get sent ahead, the receive
buffer and the bytes fetched ahead are the fetch side's (``_session``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metaq._errors import ConfigError, OffsetOutOfRangeError
from metaq._types import BrokerAddress, PartitionKey
from metaq.consumer._concurrent import ConcurrentDispatcher, InFlight
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._message import Message
from metaq.consumer._offsets import Ownership
from metaq.protocol import Codec, PartitionReader
from zk_layout import NodeDataError, StoredOffset, check_topic

__all__ = ["Subscription", "PartitionState", "SubscriptionState", "LATEST", "EARLIEST",
           "BY_TIME", "DEFAULT_MAX_BATCH"]

log = logging.getLogger(__name__)

#: ``PartitionState.offset`` values resolved by the first fetch from the broker: its
#: log end, its log start, the first message at or after ``PartitionState.time_ms``
LATEST, EARLIEST, BY_TIME = -1, -2, -3

#: Default for ``PartitionState.max_batch``: below CPython's first GC threshold
#: (700 new container objects), so a batch in hand never triggers a collection.
DEFAULT_MAX_BATCH = 500

Listener = Callable[[Message], Any]
BatchListener = Callable[[list[Message]], Any]
Reject = Callable[[Message, BaseException], None]


@dataclass(frozen=True)
class Subscription:
    """One subscribed topic: how its partitions are fetched and delivered."""

    topic: str
    listener: Listener | None
    batch_listener: BatchListener | None
    max_size: int
    auto_ack: bool = True
    max_batch: int = DEFAULT_MAX_BATCH
    #: a hand-off listener's ``in_flight(pf)``: the tracker of what it took and has not
    #: finished, made for each partition state (see :meth:`SubscriptionState.subscribe`)
    tracker: Callable[[PartitionState], Any] | None = None


class PartitionState:
    """The state of one owned partition (see the module docstring for who writes what)."""

    __slots__ = (
        # settings
        "topic", "partition", "key", "broker_id", "index", "listener", "batch_listener",
        "codec", "verify", "max_retries", "retry_backoff", "reject", "max_batch", "auto_ack",
        "dispatcher", "inflight", "flow", "reader",
        # progress
        "offset", "msg_id", "consumed", "retry_offset", "retry_count", "retry_delay",
        "max_size", "checked", "stalled", "damaged", "skipped", "resets", "delay",
        "failures", "grow_size_streak", "checksum_failures", "time_ms", "rewound",
        "rewind_seen", "rewinds",
        "redelivered_skipped", "capped",
        # requests
        "seek_to", "seek_time", "rollback", "acked",
        # scheduling
        "active", "busy", "paused", "due", "queued_token", "hold_token",
        # coordination
        "broker_address", "ownership", "committed",
    )

    def __init__(self, *, topic: str, partition: str, broker_id: int, index: int,
                 broker_address: BrokerAddress | None, offset: int, msg_id: int,
                 max_size: int, listener: Listener | None,
                 batch_listener: BatchListener | None, codec: Codec, verify: bool,
                 max_retries: int, retry_backoff: float = 0.5, reject: Reject | None = None,
                 max_batch: int | None = None, auto_ack: bool = True,
                 dispatcher: ConcurrentDispatcher | None = None,
                 flow: tuple[int, int, int] = (1000, 100 * 1024 * 1024, 2000),
                 stalled: BaseException | None = None) -> None:
        # -- settings: fixed once built (tests may change them before the first fetch)
        self.topic = topic
        self.partition = partition
        self.key = PartitionKey(topic, partition)
        self.broker_id = broker_id
        self.index = index
        self.listener = listener
        self.batch_listener = batch_listener
        self.codec = codec
        self.verify = verify
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.reject = reject
        #: most messages per batch-listener call (a fetched batch is handed over in
        #: slices of this size, in order)
        self.max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
        #: manual acknowledgement when False: progress to commit is what was acked
        self.auto_ack = auto_ack
        #: concurrent mode: the pool and the in-flight tracker (None when orderly), and
        #: flow control's (max messages, max bytes, max span) in flight
        self.dispatcher = dispatcher
        self.inflight: InFlight | None = None if dispatcher is None else InFlight()
        self.flow = flow
        #: how the delivery loops read this partition's bytes (topic, codec, message classes
        #: bound to the C or Python walk); made by the processor on first use
        self.reader: PartitionReader | None = None

        # -- progress: the runner holding it (``busy``) writes these; others only read
        self.offset = offset
        self.msg_id = msg_id
        self.consumed = 0
        # listener failures (written by the delivery loops)
        self.retry_offset = -1
        self.retry_count = 0
        self.retry_delay: float | None = None
        #: bytes asked per get; grows for a message bigger than it
        self.max_size = max_size
        #: ``offset`` is known to be a message boundary inside the log (set once the
        #: broker confirmed it or a message was delivered from it; cleared by a seek)
        self.checked = False
        #: offset_reset="fail" found the position out of range: not fetched until a seek
        self.stalled = stalled
        #: damaged byte ranges met and bytes skipped over them, out-of-range resets
        self.damaged = 0
        self.skipped = 0
        self.resets = 0
        #: the broker sent it back from a position it had delivered from (a Java broker's
        #: 301 with a max offset that lags what it serves): ``(that position, the msgId
        #: of the message ending there)``, until the re-read shows whether the log is the
        #: same there (skip what was delivered) or not (a real rewind)
        self.rewound: tuple[int, int] | None = None
        #: the position a rewind's re-read came back to (the broker may send it back
        #: again from there until its max offset catches up: then it just waits)
        self.rewind_seen = -1
        self.rewinds = 0
        #: messages read again after a rewind and not delivered again (already were)
        self.redelivered_skipped = 0
        #: a message the broker will never send whole: ``(its size, the broker's cap)``
        self.capped: tuple[int, int] | None = None
        # backoff and failure counters
        self.delay = 0.0
        self.failures = 0
        self.grow_size_streak = 0
        self.checksum_failures = 0
        #: the time (epoch ms) an ``offset`` of BY_TIME stands for
        self.time_ms: int | None = None

        # -- requests: made by any thread, applied by the runner before its next fetch
        self.seek_to: int | None = None
        self.seek_time: int | None = None  # with seek_to == BY_TIME
        self.rollback = False
        self.acked: tuple[int, int] = (msg_id, offset)

        # -- scheduling: the FetchManager's, under its lock
        self.active = False
        self.busy = False
        self.paused = False
        self.due = 0.0
        self.queued_token = -1
        #: token of the held get the long poller keeps out for it; 0 when not parked
        self.hold_token = 0

        # -- coordination: the coordinator thread's
        self.broker_address = broker_address
        #: the owner node proving ownership for fenced commits (None: not exclusive)
        self.ownership: Ownership | None = None
        #: (msgId, offset) last committed
        self.committed: tuple[int, int] = (msg_id, offset)

    def __repr__(self) -> str:
        return f"PartitionState({self.topic}/{self.partition} @ {self.offset})"

    def commit_position(self) -> tuple[int, int]:
        """(msgId, offset) safe to commit: nothing before it is unfinished or unacked."""
        # read before the in-flight tracker: a message handed out after this read lies
        # beyond it, so an empty tracker never lets it pass uncommitted-but-unfinished
        msg_id, offset = self.msg_id, self.offset
        if self.inflight is not None:
            low = self.inflight.low()
            if low is not None:
                return low[1], low[0]
        if not self.auto_ack:
            return self.acked
        rewound = self.rewound  # once: the runner clears it
        if rewound is not None:  # sent back to re-read what it delivered: until that is
            return rewound[1], rewound[0]  # checked, it still stands where it was
        return msg_id, offset

    # -- requests (any thread) ------------------------------------------------------------

    def seek(self, offset: int, time_ms: int | None = None) -> None:
        """Deliver from ``offset`` next (LATEST: the log end; BY_TIME: the first message
        at or after ``time_ms``).  Any thread; applied by the runner before its next
        fetch (:meth:`apply_requests`); the caller wakes it."""
        self.seek_time = time_ms  # before seek_to: the runner reads them the other way
        self.seek_to = offset

    def request_rollback(self) -> None:
        """Manual ack: deliver again from the last acknowledged position (any thread;
        the delivery loop stops at the next message, the runner applies it)."""
        self.rollback = True

    def ack(self, msg_id: int, next_offset: int) -> None:
        """Manual ack: everything up to ``next_offset`` is done (never moves back)."""
        if next_offset > self.acked[1]:
            self.acked = (msg_id, next_offset)

    def requested(self) -> bool:
        """A seek or a rollback waits to be applied."""
        return self.seek_to is not None or self.rollback

    def apply_requests(self) -> None:
        """(The runner holding it) apply a rollback, then a seek: progress moves there,
        listener retries are forgotten (the runner drops the bytes fetched ahead)."""
        if self.rollback:
            self.rollback = False
            self.msg_id, self.offset = self.acked
            self.rewound = None  # delivered again from there, not passed over
        to = self.seek_to
        if to is not None:
            self.seek_to = None
            self.offset, self.msg_id = to, -1
            self.time_ms = self.seek_time if to == BY_TIME else None
            self.checked, self.stalled = False, None
            self.rewound = self.capped = None
            if not self.auto_ack:
                self.acked = (-1, to)
        self.retry_offset, self.retry_count, self.retry_delay = -1, 0, None

    # -- scheduling (the FetchManager, under its lock) ------------------------------------

    def activate(self) -> None:
        """Added to the fetch manager: runners may take it."""
        self.active = True

    def deactivate(self) -> None:
        """Removed (revoked, session lost, closing): no runner takes it again, a held
        get's answer and a queued retry count for nothing."""
        self.active = False

    def pause(self) -> None:
        """Not fetched until :meth:`resume` (it stays assigned)."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def take(self) -> None:
        """A runner holds it now: it alone writes the progress until :meth:`let_go`."""
        self.busy = True

    def let_go(self) -> None:
        self.busy = False

    def queue(self, due: float, token: int) -> None:
        """Queued to be fetched at ``due`` under ``token`` (older queue entries and a
        held get out for it stop counting)."""
        self.hold_token = 0
        self.due = due
        self.queued_token = token

    def park(self, token: int) -> None:
        """Handed to the long poller under ``token`` (at its log end; see
        :meth:`parked_on`)."""
        self.hold_token = token
        self.delay = 0.0

    def parked_on(self, token: int) -> bool:
        """Still waiting on the held get parked under ``token`` (not revoked, sought,
        paused or woken since)."""
        return self.hold_token == token and self.active

    # -- progress (the runner holding it) -----------------------------------------------

    def back_off(self, step: float, max_delay: float) -> float:
        """Wait ``step`` longer before the next fetch (up to ``max_delay``): nothing new,
        or a failure."""
        self.delay = delay = min(max_delay, self.delay + step)
        return delay

    def answered(self) -> None:
        """The broker answered a get: connection failures in a row end."""
        self.failures = 0

    def fetch_failed(self) -> int:
        """The connection failed: failures in a row."""
        self.failures += 1
        return self.failures

    def delivered(self) -> None:
        """Messages were delivered from ``offset``: a boundary, no backoff, no growth."""
        self.checked = True
        self.capped = None
        self.delay = 0.0
        self.grow_size_streak = 0

    def resolve(self, offset: int) -> None:
        """LATEST, EARLIEST or BY_TIME became an offset of the broker's log."""
        self.offset = offset
        self.time_ms = None
        self.checked = True

    def mark_checked(self) -> None:
        """The broker confirmed ``offset`` (or cannot tell): a boundary inside the log."""
        self.checked = True

    def grow(self, max_size: int) -> None:
        """A message bigger than ``max_size``: ask for this many bytes from now on."""
        self.max_size = max_size
        self.grow_size_streak += 1

    def too_big(self) -> bool:
        """A message over the fetch size limit stalls it; True the first time (report
        it once)."""
        self.grow_size_streak += 1
        return self.grow_size_streak == 1

    def count_checksum_failure(self) -> int:
        """A checksum failure at a position the broker says is valid: in a row."""
        self.checksum_failures += 1
        return self.checksum_failures

    def forget_checksum_failures(self) -> None:
        self.checksum_failures = 0

    def skip_damaged(self, bad: int, valid: int) -> None:
        """The bytes ``[bad, valid)`` are damaged: counted, delivery goes on at ``valid``."""
        self.damaged += 1
        self.skipped += valid - bad
        self.offset, self.checked = valid, True

    def rewind(self, to: int) -> None:
        """The broker moved it back to ``to``: remember where it was (``rewound``; moved
        back further before the re-read: still where it was first)."""
        if self.rewound is None:
            self.rewound = (self.offset, self.msg_id)
            self.rewinds += 1
        self.offset = to

    def rewind_checked(self, skip: int | None, messages: int = 0) -> None:
        """The re-read after a rewind: ``skip`` bytes (``messages``) were delivered
        already and are passed over; None: the log changed there (a real rewind), so
        the old position is restored for offset_reset to handle."""
        assert self.rewound is not None
        if skip is None:
            self.offset = self.rewound[0]
        else:
            self.offset += skip
            self.redelivered_skipped += messages
            self.rewind_seen = self.offset
        self.rewound = None

    def count_reset(self) -> None:
        """Its position was outside the log (or inside a message): one reset more."""
        self.resets += 1

    def move_to_boundary(self, offset: int) -> None:
        """``offset`` was inside the message that starts at ``offset``: read it again."""
        self.offset, self.checked = offset, True

    def reset_to(self, offset: int) -> None:
        """offset_reset moved it to ``offset`` (the log start or end); bytes jumped over
        count as skipped."""
        if offset > self.offset:
            self.skipped += offset - self.offset
        self.offset, self.msg_id, self.checked = offset, -1, True

    def stall(self, error: BaseException) -> None:
        """offset_reset="fail": not fetched until a seek (which clears it)."""
        self.stalled = error

    # -- coordination (the coordinator thread) -------------------------------------------

    def broker_moved(self, address: BrokerAddress | None) -> None:
        """Its broker has a new address (or none known right now)."""
        self.broker_address = address

    def mark_committed(self, position: tuple[int, int]) -> None:
        """``position`` ((msgId, offset)) was committed."""
        self.committed = position

    def drain(self, timeout: float = 2.0) -> None:
        """Concurrent mode, once no runner fetches it: give its in-flight messages a
        moment to finish, so fewer are delivered again by the next owner."""
        if self.dispatcher is not None:
            self.dispatcher.wait_idle(self, timeout)


class SubscriptionState:
    """The topics this member consumes and the state of every partition it owns.

    Subscriptions are made before the member starts.  The assignment changes on
    the coordinator thread only (:meth:`assign`, :meth:`revoke`, :meth:`drop_all`);
    other threads read it through snapshots (:meth:`assigned`, :meth:`partition`).
    """

    def __init__(self, config: ConsumerConfig, *, consumer_id: str, codec: Codec,
                 reject: Reject | None, dispatcher: ConcurrentDispatcher | None,
                 on_error: Callable[[BaseException], None]) -> None:
        self._config = config
        self._consumer_id = consumer_id
        self._codec = codec
        self._reject = reject
        self._dispatcher = dispatcher
        self._on_error = on_error
        self._subs: dict[str, Subscription] = {}
        self._assigned: dict[PartitionKey, PartitionState] = {}
        #: messages consumed from partitions no longer owned (revoked, or dropped with
        #: a lost session, a failure or close): metrics count them with the owned ones
        self.consumed_released = 0
        #: offset nodes found holding garbage
        self.damaged_offsets = 0

    # -- subscriptions --------------------------------------------------------------------

    def subscribe(self, topic: str, listener: Any, *, max_size: int, auto_ack: bool,
                  max_batch: int) -> Subscription:
        """Consume ``topic`` with ``listener`` (a callable, or an object with
        ``on_messages(batch)``); ConfigError for what this member cannot do.

        A *hand-off* listener (``on_messages``, ``in_flight(pf)`` and ``redeliver(m)``;
        metaq.aio's bridge) takes each slice to finish it elsewhere: ``in_flight`` makes
        each partition's tracker (``add``-free: the listener registers the slice itself;
        ``low()``, ``blocked(...)``, ``__len__`` as :class:`InFlight`), so commits stop
        at its oldest unfinished message and flow control bounds what it holds;
        ``redeliver`` takes the recover store's messages one at a time."""
        check_topic(topic)
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 32:
            raise ConfigError(f"max_size must be an int >= 32, got {max_size!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if max_size > self._config.max_fetch_size:
            raise ConfigError(f"max_size {max_size} is over max_fetch_size "
                              f"{self._config.max_fetch_size}")
        batch = getattr(listener, "on_messages", None)
        tracker = getattr(listener, "in_flight", None)
        if batch is not None and callable(batch) and callable(tracker):
            # a hand-off: slices go to another executor (metaq.aio's event loop); the
            # partition's commit position is its tracker's oldest unfinished message
            if self._dispatcher is not None:
                raise ConfigError("a hand-off listener works in orderly mode only")
            sub = Subscription(topic, listener.redeliver, batch, max_size, auto_ack,
                               max_batch, tracker)
        elif batch is not None and callable(batch):
            if self._dispatcher is not None or not auto_ack:
                raise ConfigError("a batch listener works in orderly auto-ack mode only")
            sub = Subscription(topic, None, batch, max_size, auto_ack, max_batch)
        elif callable(listener):
            if self._dispatcher is not None and not auto_ack:
                raise ConfigError("manual ack works in orderly mode only")
            sub = Subscription(topic, listener, None, max_size, auto_ack, max_batch)
        else:
            raise ConfigError("listener must be callable or have on_messages(batch)")
        if topic in self._subs:
            raise ConfigError(f"topic {topic!r} is already subscribed")
        self._subs[topic] = sub
        return sub

    def topics(self) -> list[str]:
        return sorted(self._subs)

    def listener_for(self, topic: str) -> Listener | None:
        """A per-message listener for ``topic`` (a batch listener gets one-message
        batches), or None when it is not subscribed: for redeliveries."""
        sub = self._subs.get(topic)
        if sub is None:
            return None
        if sub.listener is not None:
            return sub.listener
        batch = sub.batch_listener
        assert batch is not None
        return lambda m: batch([m])

    # -- the assignment (written by the coordinator thread) -----------------------------

    def assign(self, topic: str, partition: str, broker_id: int,
               address: BrokerAddress | None, stored: StoredOffset | NodeDataError | None,
               ownership: Ownership | None) -> PartitionState:
        """The state of a partition just claimed, from its committed offset ``stored``
        (None: none yet; garbage: reported, then as offset_reset says)."""
        pf = self._new_state(topic, partition, broker_id, address, stored)
        pf.ownership = ownership
        pf.committed = pf.commit_position()
        self._assigned[pf.key] = pf
        return pf

    def revoke(self, key: PartitionKey) -> PartitionState:
        """No longer owned (released): its consumed messages still count."""
        pf = self._assigned.pop(key)
        self.consumed_released += pf.consumed
        return pf

    def drop_all(self) -> list[PartitionState]:
        """Forget every partition at once (session lost, member failed, closed); what
        was consumed from them still counts, as for :meth:`revoke`."""
        dropped = list(self._assigned.values())
        self._assigned = {}
        self.consumed_released += sum(pf.consumed for pf in dropped)
        return dropped

    # -- reading the assignment (any thread) ---------------------------------------------

    def partition(self, topic: str, partition: str) -> PartitionState | None:
        return self._assigned.get((topic, partition))

    def assigned_keys(self) -> list[PartitionKey]:
        """(topic, partition) of every owned partition, in the order they were assigned."""
        return list(self._assigned)

    def assigned(self) -> list[PartitionState]:
        """Every owned partition's state, by (topic, partition)."""
        return [pf for _, pf in sorted(list(self._assigned.items()))]

    def assignment(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for topic, part in sorted(list(self._assigned)):
            out.setdefault(topic, []).append(part)
        return out

    def _new_state(self, topic: str, partition: str, broker_id: int,
                   address: BrokerAddress | None,
                   stored: StoredOffset | NodeDataError | None) -> PartitionState:
        cfg = self._config
        sub = self._subs[topic]
        stalled = None
        if isinstance(stored, NodeDataError):
            # garbage in the offset node: report it, start as offset_reset says; the next
            # commit writes a good value over it
            reset = cfg.offset_reset
            offset = {"earliest": EARLIEST, "latest": LATEST}.get(reset, EARLIEST)
            msg_id = -1
            err = OffsetOutOfRangeError(
                f"{topic}/{partition}: damaged committed offset ({stored}); "
                + ("not fetched until a seek (offset_reset=fail)" if reset == "fail" else
                   f"reading from the log {'start' if reset == 'earliest' else 'end'} "
                   f"(offset_reset={reset})"),
                topic=topic, partition=partition, offset=-1, log_start=None, log_end=None,
                action=reset)
            log.error("group %s consumer %s: %s", cfg.group, self._consumer_id, err)
            self._on_error(err)
            self.damaged_offsets += 1
            stalled = err if reset == "fail" else None
        elif stored is not None:
            offset, msg_id = stored.offset, -1 if stored.msg_id is None else stored.msg_id
        elif cfg.start_position == "latest":
            offset, msg_id = LATEST, -1  # resolved by the fetcher from the broker's log end
        elif cfg.start_time_ms is not None:
            offset, msg_id = BY_TIME, -1  # resolved by the fetcher, searching by time
        else:
            offset, msg_id = 0, -1
        flow = (cfg.pull_threshold_messages, cfg.pull_threshold_bytes, cfg.max_span)
        pf = PartitionState(
            topic=topic, partition=partition, broker_id=broker_id,
            index=int(partition.split("-", 1)[1]), broker_address=address, offset=offset,
            msg_id=msg_id, max_size=sub.max_size, listener=sub.listener,
            batch_listener=sub.batch_listener, max_batch=sub.max_batch, codec=self._codec,
            verify=cfg.verify_checksums, max_retries=cfg.max_fetch_retries,
            reject=self._reject, auto_ack=sub.auto_ack, dispatcher=self._dispatcher,
            flow=flow, stalled=stalled)
        if offset == BY_TIME:
            pf.time_ms = cfg.start_time_ms
        if sub.tracker is not None:
            pf.inflight = sub.tracker(pf)
        return pf
