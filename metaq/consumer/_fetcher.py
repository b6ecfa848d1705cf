"""FetchManager: runner threads pulling owned partitions from their brokers.

Metaq's design, kept: ``fetch_runner_count`` threads share one delay queue
holding one :class:`PartitionFetch` per owned partition; a partition is
re-queued only after its batch was handed to the listener, so each partition
is processed serially and in offset order.

What differs from Metaq:

- a partition can be removed on its own (``remove``) while the others keep
  fetching: a rebalance never pauses partitions that stay;
- ``remove`` waits until a runner no longer holds the partition, so the
  offset read afterwards is final and can be committed;
- growth of the fetch size for a message bigger than ``max_size`` has its own
  counter (the listener's retry counter is never touched by it);
- each runner keeps one connection per broker; a broker failure backs off
  only that broker's partitions;
- a runner sends the next ``get`` of a partition before handing the current
  bytes to the listener, asking for the bytes right after them (offsets are
  byte positions, so a message cut at the end of a reply is completed by the
  next one); the broker sends them while the listener runs, and the runner
  reads them before it lets the partition go (kept in ``pf.ready``, at most
  one reply per partition).  Order stays serial: they are processed only when
  the partition's offset is still where they start;
- replies are received straight into a buffer of the partition's own
  (``pf.rbuf``, behind the unconsumed tail of the last one), and the C message
  builder reads them there: the body bytes are copied once, into the messages;
- a partition found at its log end on a broker that offers holding is not
  backed off but parked with the :class:`~metaq.consumer._longpoll.LongPoller`,
  whose held get brings the next message the moment it is written; the bytes
  it brings become the partition's ready bytes, delivered by a runner like
  any other (park tokens make replies for a partition revoked, sought,
  paused or woken meanwhile count for nothing).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from metaq._errors import (
    BrokerError,
    ChecksumError,
    DamagedMessageError,
    MessageError,
    MetaqError,
    OffsetOutOfRangeError,
)
from metaq.consumer._lease import Lease
from metaq.consumer._longpoll import LongPoller, Parked
from metaq.consumer._processor import PartitionFetch, process_batch
from metaq.net import BrokerConnection
from metaq.protocol import HOLD_CAPABILITY

__all__ = ["FetchManager"]

log = logging.getLogger(__name__)

_LOG_END = 2**63 - 1  # the ``offset`` command clamps to the log's end
#: ``PartitionFetch.offset`` values resolved by the first fetch from the broker
LATEST, EARLIEST = -1, -2
_FLOW_POLL = 0.02  # seconds between looks at a flow-controlled partition
#: ``_fetch_once``'s answer for "at the log end: park it with the long poller"
_PARK = -1.0


def _apply_control(pf: PartitionFetch) -> None:
    """Apply a seek or a rollback asked for by another thread (runner holds ``pf``)."""
    if pf.rollback:
        pf.rollback = False
        pf.msg_id, pf.offset = pf.acked
    to = pf.seek_to
    if to is not None:
        pf.seek_to = None
        pf.offset, pf.msg_id = to, -1
        pf.checked, pf.stalled = False, None
        if not pf.auto_ack:
            pf.acked = (-1, to)
    pf.ready = None  # bytes fetched ahead belong to the old position
    pf.retry_offset, pf.retry_count, pf.retry_delay = -1, 0, None

ErrorHandler = Callable[[BaseException, "PartitionFetch | None"], None]


def _offers_hold(conn: BrokerConnection) -> bool:
    """Does this broker hold gets (``+hold`` in its ``version`` answer)?"""
    try:
        return HOLD_CAPABILITY in conn.version().split()
    except BrokerError:
        return False  # a broker that does not answer version: Metaq's backoff


def _take_ready(pf: PartitionFetch, address: tuple[str, int]) -> memoryview | None:
    """The bytes fetched ahead for ``pf``, if they still start at its offset."""
    ready, pf.ready = pf.ready, None
    if ready and pf.ready_offset == pf.offset and pf.ready_address == address:
        return ready
    return None  # nothing, or the offset moved (seek, 301, resync, size growth)


class FetchManager:
    """Runs the fetch loop for every partition added to it.

    Thread-safety: ``add``/``remove``/``suspend``/``resume``/``close`` may be
    called from any thread (the consumer's coordinator calls them).
    """

    def __init__(self, *, group: str, runner_count: int, fetch_timeout: float,
                 max_delay: float, max_fetch_size: int, on_error: ErrorHandler,
                 lease: Lease | None = None, hold: float = 0.0,
                 offset_reset: str = "earliest",
                 name: str = "metaq-fetch", prefetch: bool = True) -> None:
        self._group = group
        self._prefetch = prefetch
        self._fetch_timeout = fetch_timeout
        self._max_delay = max_delay
        self._step = max_delay / 10.0
        self._max_fetch_size = max_fetch_size
        self._offset_reset = offset_reset
        self._on_error = on_error
        self._lease = lease
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, PartitionFetch]] = []
        self._seq = itertools.count()
        self._suspended = False
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{group}-{i}", daemon=True)
            for i in range(runner_count)
        ]
        #: broker address -> it offers held gets (asked on each new runner connection)
        self._holds: dict[tuple[str, int], bool] = {}
        self._poller: LongPoller | None = None
        if hold > 0:
            self._poller = LongPoller(
                group=group, hold=hold, connect_timeout=fetch_timeout,
                reply_margin=fetch_timeout, woken=self._woken,
                still_parked=self._still_parked,
                on_error=lambda e: self._on_error(e, None), name=f"{name}-{group}-hold")
        for t in self._threads:
            t.start()

    # -- control -----------------------------------------------------------

    def add(self, pf: PartitionFetch) -> None:
        with self._cond:
            pf.active = True
            self._push(pf, 0.0)
            self._cond.notify()

    def remove(self, pf: PartitionFetch, timeout: float | None = None) -> bool:
        """Stop fetching ``pf``; wait until no runner holds it. True when idle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            pf.active = False
            self._cond.notify_all()
            while pf.busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def seek(self, pf: PartitionFetch, offset: int) -> None:
        """Deliver ``pf`` from ``offset`` next (applied before its next fetch)."""
        pf.seek_to = offset
        self.wake(pf)

    def rollback(self, pf: PartitionFetch) -> None:
        """Manual ack: deliver again from the last acknowledged position."""
        pf.rollback = True
        self.wake(pf)

    def pause(self, pf: PartitionFetch) -> None:
        with self._cond:
            pf.paused = True

    def unpause(self, pf: PartitionFetch) -> None:
        with self._cond:
            pf.paused = False
        self.wake(pf)

    def suspend(self) -> None:
        """Stop handing out partitions (ZooKeeper connection uncertain)."""
        with self._cond:
            self._suspended = True

    def resume(self) -> None:
        with self._cond:
            self._suspended = False
            self._cond.notify_all()

    def wake(self, pf: PartitionFetch) -> None:
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
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))

    @property
    def threads(self) -> list[threading.Thread]:
        extra = [] if self._poller is None else [self._poller.thread]
        return list(self._threads) + extra

    # -- long polling ------------------------------------------------------------------

    def _park(self, pf: PartitionFetch) -> Parked | None:
        """(Under the lock, as the runner lets ``pf`` go) hand it to the long poller,
        unless a control request wants it fetched now (None: push it instead)."""
        if pf.seek_to is not None or pf.rollback or pf.paused or pf.broker_address is None:
            return None
        pf.hold_token = token = next(self._seq)
        pf.delay = 0.0
        if pf.ready is None:
            pf.rbuf = None  # an idle partition gives its receive buffer back
        return Parked(pf, token, pf.broker_address, pf.offset)

    def _still_parked(self, parked: Parked) -> bool:
        pf = parked.pf
        return pf.hold_token == parked.token and pf.active and not self._closed

    def _woken(self, parked: Parked, data: memoryview | None, backoff: bool) -> None:
        """(Long-poll thread) the held get of ``parked`` was answered: fetch it now
        with ``data`` as its ready bytes, or after Metaq's backoff."""
        pf = parked.pf
        with self._cond:
            if pf.hold_token != parked.token or not pf.active or self._closed:
                return  # revoked, sought, paused or woken since it was parked
            if data is not None and pf.offset == parked.offset:
                pf.ready, pf.ready_offset, pf.ready_address = data, parked.offset, \
                    parked.address
            self._push(pf, self._backoff(pf) if backoff else 0.0)
            self._cond.notify()

    def _at_end(self, pf: PartitionFetch, address: tuple[str, int]) -> float:
        """Nothing new at ``pf``'s offset: park it when its broker holds gets, else
        Metaq's growing backoff."""
        if self._poller is not None and self._holds.get(address):
            return _PARK
        return self._backoff(pf)

    # -- internals ---------------------------------------------------------

    def _push(self, pf: PartitionFetch, delay: float) -> None:
        pf.hold_token = 0  # a held get out for it no longer counts
        pf.due = time.monotonic() + delay
        pf.queued_token = next(self._seq)
        heapq.heappush(self._heap, (pf.due, pf.queued_token, pf))

    def _take(self) -> PartitionFetch | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._heap and not self._suspended:
                    due, token, pf = self._heap[0]
                    if not pf.active or token != pf.queued_token or pf.busy:
                        heapq.heappop(self._heap)  # stale entry
                        continue
                    now = time.monotonic()
                    if due <= now and not pf.paused:
                        heapq.heappop(self._heap)
                        pf.busy = True
                        return pf
                    if pf.paused:
                        heapq.heappop(self._heap)
                        pf.parked = True  # re-queued by wake()/resume
                        continue
                    self._cond.wait(due - now)
                else:
                    self._cond.wait(1.0 if self._suspended else None)

    def _release(self, pf: PartitionFetch, delay: float | None) -> None:
        parked = None
        with self._cond:
            pf.busy = False
            if pf.active and delay is not None and not self._closed:
                if delay == _PARK and self._poller is not None:
                    parked = self._park(pf)
                    if parked is None:
                        self._push(pf, 0.0)
                else:
                    self._push(pf, delay)
            self._cond.notify_all()
        if parked is not None and not self._poller.park(parked):  # type: ignore[union-attr]
            self._woken(parked, None, True)  # the poller stopped: Metaq's backoff

    def _run(self) -> None:
        connections: dict[tuple[str, int], BrokerConnection] = {}
        try:
            while True:
                pf = self._take()
                if pf is None:
                    return
                delay: float | None = self._max_delay
                try:
                    delay = self._fetch_once(pf, connections)
                except BaseException as e:  # noqa: BLE001 - reported, runner survives
                    log.exception("fetch runner failed on %s/%s", pf.topic, pf.partition)
                    self._on_error(e, pf)
                    delay = self._max_delay
                finally:
                    self._release(pf, delay)
        finally:
            for c in connections.values():
                c.close()

    def _backoff(self, pf: PartitionFetch) -> float:
        """Wait longer before this partition's next fetch (nothing new, or a failure);
        an idle partition gives its receive buffer back (up to ``max_size`` each)."""
        pf.delay = min(self._max_delay, pf.delay + self._step)
        if pf.ready is None:
            pf.rbuf = None
        return pf.delay

    def _fetch_once(self, pf: PartitionFetch,
                    connections: dict[tuple[str, int], BrokerConnection]) -> float:
        if pf.seek_to is not None or pf.rollback:
            _apply_control(pf)
        if pf.stalled is not None:
            return self._max_delay  # offset_reset="fail": waits for a seek
        if pf.inflight is not None and pf.inflight.blocked(*pf.flow):
            return _FLOW_POLL  # flow control: too much of this partition is in flight
        address = pf.broker_address
        if address is None:
            pf.ready = None
            return self._backoff(pf)  # broker unknown right now: wait
        if self._lease is not None and not self._lease.valid():
            pf.ready = None
            return self._step  # ownership unconfirmed (frozen past the session?): wait
        data = _take_ready(pf, address)
        conn = connections.get(address)
        ahead: int | None = None  # opaque of the get sent ahead, reply not read yet
        parks = False
        try:
            if conn is None:
                conn = BrokerConnection(address[0], address[1], timeout=self._fetch_timeout)
                connections[address] = conn
                if self._poller is not None:
                    self._holds[address] = _offers_hold(conn)
            if data is None:
                if pf.offset < 0:  # LATEST or EARLIEST: the broker's log end or start
                    pf.offset = conn.offset(pf.topic, self._group, pf.index,
                                            _LOG_END if pf.offset == LATEST else 0)
                    pf.checked = True
                pf.rbuf, n = conn.read_get_into(
                    conn.send_get(pf.topic, self._group, pf.index, pf.offset, pf.max_size),
                    b"", pf.rbuf)
                data = memoryview(pf.rbuf)[:n]
            parks = self._poller is not None and self._holds.get(address, False)
            if data and self._prefetch and (not parks or len(data) >= pf.max_size >> 1):
                # the bytes right after these: the broker sends them while we deliver
                # (not after a short reply from a broker that holds gets: the partition
                # is probably caught up, and its held get will bring what comes next
                # without this runner waiting for a round trip)
                ahead = conn.send_get(pf.topic, self._group, pf.index, pf.offset + len(data),
                                      pf.max_size)
        except BrokerError as e:
            return self._on_broker_error(pf, e, conn, address, connections)
        except (OSError, MetaqError) as e:
            return self._connection_failed(pf, conn, address, connections, e)
        pf.failures = 0
        if self._lease is not None and not self._lease.valid():
            self._end_ahead(pf, conn, ahead, None, address, connections)
            pf.ready = None
            return self._step  # the lease ran out while we fetched: deliver nothing
        base = pf.offset
        try:
            result = process_batch(pf, data)
        except ChecksumError as e:
            self._end_ahead(pf, conn, ahead, None, address, connections)
            if not pf.checked:  # a committed offset inside a message reads as garbage
                delay = self._check_position(pf, conn, address, connections)
                if delay is not None:
                    return delay
            return self._resync(pf, conn, e)
        except BaseException:
            self._end_ahead(pf, conn, ahead, None, address, connections)
            raise
        keep = result.consumed and pf.retry_delay is None
        at_end = self._end_ahead(pf, conn, ahead, data[pf.offset - base:] if keep else None,
                                 address, connections)
        if result.consumed:
            pf.checked = True
            pf.delay = 0.0
            pf.grow_size_streak = 0
            if pf.retry_delay is not None:
                return pf.retry_delay
            if (at_end or (parks and ahead is None)) and pf.offset == base + len(data):
                return self._at_end(pf, address)  # all delivered, maybe nothing after it
            return 0.0
        if pf.retry_delay is not None:
            return pf.retry_delay  # listener failed on the first message: retry later
        if result.needed_size:
            if not pf.checked:  # a huge "message" at an unconfirmed position: maybe
                delay = self._check_position(pf, conn, address, connections)  # inside one
                if delay is not None:
                    return delay
            return self._grow(pf, result.needed_size)
        return self._backoff(pf)

    def _connection_failed(self, pf: PartitionFetch, conn: BrokerConnection | None,
                           address: tuple[str, int],
                           connections: dict[tuple[str, int], BrokerConnection],
                           e: BaseException) -> float:
        if conn is not None:
            conn.close()
        connections.pop(address, None)
        pf.ready = None
        pf.failures += 1
        if pf.failures in (1, 10) or pf.failures % 100 == 0:
            log.warning("fetch %s/%s from %s:%s failed (%d in a row): %s",
                        pf.topic, pf.partition, address[0], address[1], pf.failures, e)
        return self._backoff(pf)

    @staticmethod
    def _end_ahead(pf: PartitionFetch, conn: BrokerConnection, ahead: int | None,
                   tail: memoryview | None, address: tuple[str, int],
                   connections: dict[tuple[str, int], BrokerConnection]) -> bool:
        """Read the reply of the get sent ahead: kept in ``pf.ready`` after ``tail`` (the
        bytes not consumed yet, which it continues), or dropped when ``tail`` is None.
        True when it said there is nothing after the bytes in hand (404)."""
        pf.ready = None
        if ahead is None:
            return False
        try:
            if tail is None:
                conn.skip_reply(ahead)
                return False
            # the tail is a view of pf.rbuf, which the reply is about to overwrite
            pf.rbuf, n = conn.read_get_into(ahead, bytes(tail), pf.rbuf)
            ready = memoryview(pf.rbuf)[:n]
        except BrokerError as e:  # e.g. 404, nothing new yet: the next fetch asks again
            log.debug("get ahead of %s/%s: %s", pf.topic, pf.partition, e)
            return e.code == 404
        except (OSError, MetaqError) as e:
            conn.close()
            connections.pop(address, None)
            log.debug("get ahead of %s/%s failed: %s", pf.topic, pf.partition, e)
            return False
        pf.ready, pf.ready_offset, pf.ready_address = ready, pf.offset, address
        return False

    def _grow(self, pf: PartitionFetch, needed: int) -> float:
        if needed > self._max_fetch_size:
            err = MessageError(
                f"message at {pf.topic}/{pf.partition} offset {pf.offset} needs "
                f"{needed} bytes, over max_fetch_size={self._max_fetch_size}; partition stalls")
            if pf.grow_size_streak == 0:
                self._on_error(err, pf)
            pf.grow_size_streak += 1
            return self._max_delay
        new = min(self._max_fetch_size, max(needed, pf.max_size * 2))
        log.info("fetch size of %s/%s grows %d -> %d for a message of %d bytes",
                 pf.topic, pf.partition, pf.max_size, new, needed)
        pf.max_size = new
        pf.grow_size_streak += 1
        return 0.0

    def _on_broker_error(self, pf: PartitionFetch, e: BrokerError, conn: BrokerConnection,
                         address: tuple[str, int],
                         connections: dict[tuple[str, int], BrokerConnection]) -> float:
        if e.code == 404:
            if not pf.checked:  # nothing here: the end, or a position beyond it?
                delay = self._check_position(pf, conn, address, connections)
                if delay is not None:
                    return delay
            return self._at_end(pf, address)  # nothing new
        if e.code == 301:
            try:
                moved = int(e.detail.strip())
            except ValueError:
                self._on_error(e, pf)
                return self._backoff(pf)
            if moved > pf.offset:
                try:
                    start = conn.offset(pf.topic, self._group, pf.index, 0)
                except BrokerError:
                    start = moved
                except (OSError, MetaqError) as err:
                    return self._connection_failed(pf, conn, address, connections, err)
                if start < moved:  # a damaged range the broker knows: past it
                    return self._skip_damaged(pf, pf.offset, moved, "damaged bytes in the "
                                              "broker's log")
                # below the log start: retention deleted what was not read
                return self._out_of_range(pf, conn, address, connections,
                                          start=moved, end=None)
            return self._out_of_range(pf, conn, address, connections,  # above the end
                                      start=None, end=moved)
        log.warning("fetch %s/%s: %s", pf.topic, pf.partition, e)
        return self._backoff(pf)

    def _resync(self, pf: PartitionFetch, conn: BrokerConnection, err: Exception) -> float:
        """A damaged message: ask the broker for the next valid position (Metaq's rule),
        report what is skipped (DamagedMessageError to on_error) and resume there."""
        bad = getattr(err, "offset", pf.offset)
        try:
            valid = conn.offset(pf.topic, self._group, pf.index, bad)
        except (OSError, MetaqError) as e:
            log.warning("offset resync of %s/%s failed: %s", pf.topic, pf.partition, e)
            return self._backoff(pf)
        if valid <= bad:  # the broker sees a valid message there
            pf.checksum_failures += 1
            if pf.checksum_failures < 3:
                return self._backoff(pf)  # maybe damaged in transit: read again
            skip_to = getattr(err, "next_offset", None)
            if skip_to is None:
                self._on_error(err, pf)
                return self._max_delay
            valid = skip_to  # the broker serves damaged bytes: skip the one message
        pf.checksum_failures = 0
        return self._skip_damaged(pf, bad, valid, str(err))

    def _skip_damaged(self, pf: PartitionFetch, bad: int, valid: int, why: str) -> float:
        """Report the damaged bytes ``[bad, valid)`` (DamagedMessageError to on_error),
        count them, and resume delivery at ``valid``."""
        pf.damaged += 1
        pf.skipped += valid - bad
        log.error("damaged message in %s/%s at offset %d (%s); %d bytes skipped, resuming "
                  "at %d", pf.topic, pf.partition, bad, why, valid - bad, valid)
        self._on_error(DamagedMessageError(
            f"damaged message in {pf.topic}/{pf.partition} at offset {bad}: {why}; "
            f"{valid - bad} bytes skipped, delivery resumes at {valid}",
            topic=pf.topic, partition=pf.partition, offset=bad, next_offset=valid), pf)
        pf.offset, pf.checked = valid, True
        return 0.0

    # -- positions outside the log -------------------------------------------

    def _check_position(self, pf: PartitionFetch, conn: BrokerConnection,
                        address: tuple[str, int],
                        connections: dict[tuple[str, int], BrokerConnection]
                        ) -> float | None:
        """Is ``pf.offset`` (from a commit or a seek) a message boundary in the log?
        Asks the broker (``offset``); None when it is (the caller goes on), else the
        delay after handling what it is not (offset_reset)."""
        try:
            valid = conn.offset(pf.topic, self._group, pf.index, pf.offset)
            if valid == pf.offset:
                pf.checked = True
                return None
            end = conn.offset(pf.topic, self._group, pf.index, _LOG_END)
        except BrokerError as e:  # a broker that cannot tell (Java: unwritten partition)
            log.debug("position check of %s/%s: %s", pf.topic, pf.partition, e)
            pf.checked = True
            return None
        except (OSError, MetaqError) as e:
            return self._connection_failed(pf, conn, address, connections, e)
        if pf.offset > end:
            return self._out_of_range(pf, conn, address, connections, start=None, end=end)
        if valid > pf.offset:  # below the log start
            return self._out_of_range(pf, conn, address, connections, start=valid, end=end)
        # inside a message: back to its start (that message is read again)
        self._report_reset(pf, "boundary", None, end,
                           f"offset {pf.offset} is inside the message at {valid}; "
                           f"reading from {valid} ({pf.offset - valid} bytes again)")
        pf.offset, pf.checked = valid, True
        return 0.0

    def _out_of_range(self, pf: PartitionFetch, conn: BrokerConnection,
                      address: tuple[str, int],
                      connections: dict[tuple[str, int], BrokerConnection], *,
                      start: int | None, end: int | None) -> float:
        """``pf.offset`` is below the log ``start`` or above its ``end``: offset_reset."""
        policy = self._offset_reset
        try:
            if policy == "earliest" and start is None:
                start = conn.offset(pf.topic, self._group, pf.index, 0)
            elif policy == "latest" and end is None:
                end = conn.offset(pf.topic, self._group, pf.index, _LOG_END)
        except BrokerError as e:
            log.warning("log bounds of %s/%s: %s", pf.topic, pf.partition, e)
            return self._backoff(pf)
        except (OSError, MetaqError) as e:
            return self._connection_failed(pf, conn, address, connections, e)
        where = (f"above the log end {end}" if start is None
                 else f"below the log start {start}")
        if policy == "fail":
            err = self._report_reset(pf, "fail", start, end,
                                     f"offset {pf.offset} is {where}; offset_reset=fail: "
                                     f"not fetched until a seek")
            pf.stalled = err
            return self._max_delay
        to = start if policy == "earliest" else end
        assert to is not None
        gap = to - pf.offset
        what = (f"{gap} bytes skipped" if gap > 0 else f"{-gap} bytes from the log start "
                f"read (again)" if policy == "earliest" else f"{-gap} bytes back")
        self._report_reset(pf, policy, start, end,
                           f"offset {pf.offset} is {where}; offset_reset={policy}: "
                           f"reading from {to} ({what})")
        if gap > 0:
            pf.skipped += gap
        pf.offset, pf.msg_id, pf.checked = to, -1, True
        return 0.0

    def _report_reset(self, pf: PartitionFetch, action: str, start: int | None,
                      end: int | None, what: str) -> OffsetOutOfRangeError:
        pf.resets += 1
        err = OffsetOutOfRangeError(f"{pf.topic}/{pf.partition}: {what}", topic=pf.topic,
                                    partition=pf.partition, offset=pf.offset,
                                    log_start=start, log_end=end, action=action)
        log.error("%s", err)
        self._on_error(err, pf)
        return err

    def describe(self) -> dict[str, Any]:
        with self._cond:
            return {"queued": len(self._heap), "suspended": self._suspended,
                    "threads": [t.name for t in self._threads if t.is_alive()]}
