"""FetchManager: the runner threads and the delay queue that hands them owned partitions.

Metaq's design, kept: ``fetch_runner_count`` threads share one delay queue
holding one :class:`~metaq.consumer._subscription.PartitionState` per owned
partition; a partition is re-queued only after its batch was handed to the
listener, so each partition is processed serially and in offset order.  What
one fetch does is :class:`~metaq.consumer._fetch.PartitionFetcher`'s.

What differs from Metaq:

- a partition can be removed on its own (``remove``) while the others keep
  fetching: a rebalance never pauses partitions that stay;
- ``remove`` waits until a runner no longer holds the partition, so the
  offset read afterwards is final and can be committed;
- a partition found at its log end on a broker that offers holding is not
  backed off but parked with the :class:`~metaq.consumer._longpoll.LongPoller`,
  whose held get brings the next message the moment it is written; the bytes
  it brings become the partition's ready bytes, delivered by a runner like
  any other (park tokens make replies for a partition revoked, sought,
  paused or woken meanwhile count for nothing);
- when no runner holds a partition and the long-poll thread had been waiting
  for this reply (it is not kept busy by a stream of them), it delivers such
  bytes itself, as a runner would (it takes the partition the same way and counts
  as one of the ``fetch_runner_count``: runners wait while it delivers), which
  saves waking a runner on the way to the listener.  After
  :data:`_INLINE_SLOW_RUN` of its deliveries in a row took over
  :data:`_INLINE_SLOW` each (a slow listener, which would keep other
  partitions' held gets waiting; one alone may be the machine's scheduler) it
  leaves them to the runners for :data:`_INLINE_PAUSE`.

The scheduling flags of a partition's state (active, busy, paused, queue and
park tokens) change only under this manager's lock.  Each runner has a
:class:`~metaq.consumer._session.FetchSession` of its own (its connections);
each partition added has a :class:`~metaq.consumer._session.Readahead` (its
receive buffer and bytes fetched ahead), kept here while the partition is, and
handed to whichever runner takes the partition.  One
:class:`~metaq.consumer._route.BrokerRoute`, shared by the runners and the long
poller, says which broker each partition is read from.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from metaq._types import BrokerAddress
from metaq.consumer._fetch import PARK, ErrorHandler, PartitionFetcher
from metaq.consumer._lease import Lease
from metaq.consumer._longpoll import LongPoller, Parked
from metaq.consumer._route import BrokerRoute
from metaq.consumer._session import FetchSession, Readahead
from metaq.consumer._subscription import PartitionState
from zk_layout import BrokerReplicas

__all__ = ["FetchManager"]

log = logging.getLogger(__name__)

#: This many deliveries in a row by the long-poll thread that each took longer than
#: ``_INLINE_SLOW`` seconds make it leave deliveries to the runners for
#: ``_INLINE_PAUSE`` seconds.
_INLINE_SLOW = 0.002
_INLINE_SLOW_RUN = 3
_INLINE_PAUSE = 1.0


class FetchManager:
    """Runs the fetch loop for every partition added to it.

    Thread-safety: every public method may be called from any thread (the
    consumer's coordinator adds, removes, suspends and resumes; the user seeks,
    pauses and rolls back).
    """

    def __init__(self, *, group: str, runner_count: int, fetch_timeout: float,
                 max_delay: float, max_fetch_size: int, on_error: ErrorHandler,
                 lease: Lease | None = None, hold: float = 0.0,
                 offset_reset: str = "earliest",
                 name: str = "metaq-fetch", prefetch: bool = True,
                 read_from: str = "master", member: str = "") -> None:
        """``read_from`` and ``member`` (the consumer's id): how partitions pick among a
        broker id's master and slaves (``_route``)."""
        self._max_delay = max_delay
        self._on_error = on_error
        self._group = group
        self._fetch_timeout = fetch_timeout
        self._route = BrokerRoute(long_poll=hold > 0, read_from=read_from, salt=member)
        self._fetch = PartitionFetcher(
            group=group, max_delay=max_delay, max_fetch_size=max_fetch_size,
            on_error=on_error, lease=lease, offset_reset=offset_reset, prefetch=prefetch)
        self._cond = threading.Condition()
        #: each partition added: its read-ahead (read and written by the runner holding
        #: it, or under the lock while it is parked; the table itself under the lock)
        self._readahead: dict[PartitionState, Readahead] = {}
        self._heap: list[tuple[float, int, PartitionState]] = []
        self._seq = itertools.count()
        self._suspended = False
        self._closed = False
        #: partitions held by a runner or the long-poll thread (under the lock); at most
        #: ``runner_count``
        self._busy = 0
        self._slots = runner_count
        #: threads in :meth:`remove_many` waiting for runners to let go (under the lock)
        self._removing = 0
        #: (long-poll thread) what ``_woken`` took for it to deliver, its fetch session,
        #: and until when it leaves deliveries to the runners (a slow listener)
        self._inline: list[tuple[PartitionState, Readahead]] = []
        self._inline_session: FetchSession | None = None
        self._inline_off = 0.0
        self._inline_slow = 0  # its slow deliveries in a row
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{group}-{i}", daemon=True)
            for i in range(runner_count)
        ]
        self._poller: LongPoller | None = None
        if hold > 0:
            self._poller = LongPoller(
                group=group, hold=hold, connect_timeout=fetch_timeout,
                reply_margin=fetch_timeout, woken=self._woken,
                still_parked=self._still_parked, deliver=self._deliver_inline,
                on_error=lambda e: self._on_error(e, None), name=f"{name}-{group}-hold")
        for t in self._threads:
            t.start()

    # -- assign and revoke (the coordinator) ---------------------------------------------

    def add(self, pf: PartitionState) -> None:
        with self._cond:
            self._readahead[pf] = Readahead()
            pf.activate()
            self._push(pf, 0.0)
            self._cond.notify()

    def remove(self, pf: PartitionState, timeout: float | None = None) -> bool:
        """Stop fetching ``pf``; wait until no runner holds it. True when idle."""
        return self.remove_many([pf], timeout)

    def remove_many(self, pfs: list[PartitionState], timeout: float | None = None) -> bool:
        """Stop fetching all of ``pfs`` at once, then wait until no runner holds any (one
        wait for all, not one after another).  True when all are idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            for pf in pfs:
                pf.deactivate()
            self._cond.notify_all()
            self._removing += 1
            try:
                while any(pf.busy for pf in pfs):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
            finally:
                self._removing -= 1
            for pf in pfs:
                self._readahead.pop(pf, None)
        return True

    def route(self, brokers: Mapping[int, BrokerReplicas]) -> None:
        """Each broker id's master and slaves as just read (the coordinator, after every
        read of the group).  Partitions of a broker id whose chosen broker changed are
        fetched at once from the new one: a held get parked on the old broker then counts
        for nothing (its park token is stale) and the long poller closes its connection
        there; each runner closes its own before it fetches again (idle ones are woken
        for it).  Positions carry over unchanged: master and slaves hold the same
        offsets."""
        moved = self._route.update(brokers)
        if not moved:
            return
        with self._cond:
            for pf in self._readahead:
                if pf.broker_id in moved and pf.active and not pf.busy and not pf.paused:
                    self._push(pf, 0.0)
            self._cond.notify_all()
        in_use = self._route.in_use()
        if self._poller is not None and in_use is not None:
            self._poller.keep_only(in_use)

    def address(self, pf: PartitionState) -> BrokerAddress | None:
        """The broker ``pf`` is read from now (None: none registered)."""
        return self._route.address(pf)

    def suspend(self) -> None:
        """Stop handing out partitions (ZooKeeper connection uncertain)."""
        with self._cond:
            self._suspended = True

    def resume(self) -> None:
        with self._cond:
            self._suspended = False
            self._cond.notify_all()

    # -- control (the user) --------------------------------------------------------------

    def seek(self, pf: PartitionState, offset: int, time_ms: int | None = None) -> None:
        """Deliver ``pf`` from ``offset`` next (applied before its next fetch; BY_TIME
        with ``time_ms``: from the first message at or after that time)."""
        pf.seek(offset, time_ms)
        self.wake(pf)

    def rollback(self, pf: PartitionState) -> None:
        """Manual ack: deliver again from the last acknowledged position."""
        pf.request_rollback()
        self.wake(pf)

    def pause(self, pf: PartitionState) -> None:
        with self._cond:
            pf.pause()

    def unpause(self, pf: PartitionState) -> None:
        with self._cond:
            pf.resume()
        self.wake(pf)

    def wake(self, pf: PartitionState) -> None:
        """Fetch ``pf`` now (after a seek or resume), if it is queued."""
        with self._cond:
            if pf.active and not pf.busy:
                self._push(pf, 0.0)
                self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        deadline = time.monotonic() + timeout
        if self._poller is not None:
            self._poller.close(timeout)
            if self._inline_session is not None and not self._poller.thread.is_alive():
                self._inline_session.close()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    @property
    def threads(self) -> list[threading.Thread]:
        extra = [] if self._poller is None else [self._poller.thread]
        return list(self._threads) + extra

    def readahead(self, pf: PartitionState) -> Readahead | None:
        """``pf``'s read-ahead while it is added (for tests and diagnostics)."""
        with self._cond:
            return self._readahead.get(pf)

    def describe(self) -> dict[str, Any]:
        with self._cond:
            return {"queued": len(self._heap), "suspended": self._suspended,
                    "threads": [t.name for t in self._threads if t.is_alive()]}

    # -- long polling ------------------------------------------------------------------

    def _park(self, pf: PartitionState) -> Parked | None:
        """(Under the lock, as the runner lets ``pf`` go) hand it to the long poller,
        unless a control request wants it fetched now (None: push it instead)."""
        address = self._route.address(pf)
        if pf.requested() or pf.paused or address is None:
            return None
        token = next(self._seq)
        pf.park(token)
        ra = self._readahead.get(pf)
        if ra is not None:
            ra.idle()  # an idle partition gives its receive buffer back
        return Parked(pf, token, address, pf.offset)

    def _still_parked(self, parked: Parked) -> bool:
        return parked.pf.parked_on(parked.token) and not self._closed

    def _woken(self, parked: Parked, data: memoryview | None, backoff: bool) -> None:
        """(Long-poll thread) the held get of ``parked`` was answered: fetch it now
        with ``data`` as its ready bytes, or after Metaq's backoff.  With bytes and no
        runner holding a partition, the long-poll thread takes it to deliver itself
        (:meth:`_deliver_inline`, once it has read its replies)."""
        pf = parked.pf
        with self._cond:
            ra = self._readahead.get(pf)
            if ra is None or not pf.parked_on(parked.token) or self._closed:
                return  # revoked, sought, paused or woken since it was parked
            if data is not None and pf.offset == parked.offset:
                ra.keep(data, parked.offset, parked.address)
                if (not backoff and not self._busy and not self._suspended
                        and not pf.paused and not pf.busy and self._poller.idle  # type: ignore[union-attr]
                        and (self._inline_off == 0.0 or self._inline_ready())):
                    pf.queue(0.0, next(self._seq))  # no longer parked, nowhere queued
                    pf.take()
                    self._busy += 1
                    self._inline.append((pf, ra))
                    return
            self._push(pf, self._fetch.backoff(pf, ra) if backoff else 0.0)
            self._cond.notify()

    def _inline_ready(self) -> bool:
        """(Under the lock) the pause after a slow delivery by the long-poll thread is
        over."""
        if time.monotonic() < self._inline_off:
            return False
        self._inline_off = 0.0
        return True

    def _deliver_inline(self) -> None:
        """(Long-poll thread, after reading its replies) deliver what :meth:`_woken`
        took for it, as a runner would."""
        todo = self._inline
        if not todo:
            return
        self._inline = []
        session = self._inline_session
        if session is None:
            session = self._inline_session = FetchSession(
                group=self._group, timeout=self._fetch_timeout, route=self._route)
        for pf, ra in todo:
            start = time.monotonic()
            self._serve(pf, ra, session)
            if time.monotonic() - start <= _INLINE_SLOW:
                self._inline_slow = 0
                continue
            self._inline_slow += 1
            if self._inline_slow >= _INLINE_SLOW_RUN:
                self._inline_slow = 0
                self._inline_off = time.monotonic() + _INLINE_PAUSE

    # -- the delay queue and the runners ----------------------------------------------

    def _push(self, pf: PartitionState, delay: float) -> None:
        due = time.monotonic() + delay
        token = next(self._seq)
        pf.queue(due, token)  # a held get out for it no longer counts
        heapq.heappush(self._heap, (due, token, pf))

    def _take(self, session: FetchSession) -> tuple[PartitionState, Readahead] | None | bool:
        """The next partition due (with its read-ahead); None once closed; False when the
        route moved a broker id (the runner closes its connections to old brokers)."""
        with self._cond:
            while True:
                if self._closed:
                    return None
                if session.route_moved:
                    return False
                if self._heap and not self._suspended and self._busy < self._slots:
                    due, token, pf = self._heap[0]
                    if not pf.active or token != pf.queued_token or pf.busy:
                        heapq.heappop(self._heap)  # stale entry
                        continue
                    now = time.monotonic()
                    if due <= now and not pf.paused:
                        heapq.heappop(self._heap)
                        pf.take()
                        self._busy += 1
                        return pf, self._readahead[pf]
                    if pf.paused:
                        heapq.heappop(self._heap)  # re-queued by wake() after unpause
                        continue
                    self._cond.wait(due - now)
                else:
                    self._cond.wait(1.0 if self._suspended else None)

    def _release(self, pf: PartitionState, delay: float | None) -> None:
        parked = None
        with self._cond:
            pf.let_go()
            self._busy -= 1
            if not pf.active:  # removed while this runner held it
                self._readahead.pop(pf, None)
            elif delay is not None and not self._closed:
                if delay == PARK and self._poller is not None:
                    parked = self._park(pf)
                    if parked is None:
                        self._push(pf, 0.0)
                else:
                    self._push(pf, delay)
            if self._heap or self._removing:
                # a slot came free for what waits in the queue, or a removal waits for
                # this let-go; else no runner has anything new to do (a partition
                # parked on a held get, as after every delivery of an idle consumer:
                # waking the runners then cost a thread wake-up a message)
                self._cond.notify_all()
        if parked is not None and not self._poller.park(parked):  # type: ignore[union-attr]
            self._woken(parked, None, True)  # the poller stopped: Metaq's backoff

    def _run(self) -> None:
        session = FetchSession(group=self._group, timeout=self._fetch_timeout,
                               route=self._route)
        try:
            while True:
                taken = self._take(session)
                if taken is None:
                    return
                if taken is False:
                    session.prune()
                    continue
                self._serve(*taken, session)
        finally:
            session.close()

    def _serve(self, pf: PartitionState, ra: Readahead, session: FetchSession) -> None:
        """Fetch and deliver ``pf``, taken by this thread, then let it go."""
        session.bind(pf, ra)
        delay: float | None = self._max_delay
        try:
            delay = self._fetch.fetch_once(pf, session)
        except BaseException as e:  # noqa: BLE001 - reported, the thread survives
            log.exception("fetch runner failed on %s/%s", pf.topic, pf.partition)
            self._on_error(e, pf)
            session.failed()  # the connection may be anywhere in a reply
            delay = self._max_delay
        finally:
            self._release(pf, delay)
