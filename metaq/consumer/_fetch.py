"""One fetch of one partition: its ``get``, and what the broker's answers mean for its position.

A fetch runner (:class:`~metaq.consumer._fetcher.FetchManager`) holding a
partition calls :meth:`PartitionFetcher.fetch_once` with its
:class:`~metaq.consumer._session.FetchSession` bound to the partition; it
fetches through the session, hands the bytes to delivery (``process_batch``)
and answers how long the partition waits before its next fetch.  This module
decides what the broker's answers mean for the position; the session does the
wire, the partition's state keeps the position.  What differs from Metaq:

- growth of the fetch size for a message bigger than ``max_size`` has its own
  counter (the listener's retry counter is never touched by it);
- each runner keeps one connection per broker (its session); a broker failure
  (:class:`~metaq.BrokerUnavailableError`, the one transport error) backs off
  only that broker's partitions;
- the next ``get`` of a partition is sent before the current bytes go to the
  listener, asking for the bytes right after them (offsets are byte
  positions, so a message cut at the end of a reply is completed by the next
  one); the broker sends them while the listener runs, and they are read
  before the runner lets the partition go (kept as its ready bytes, at most
  one reply per partition).  Order stays serial: they are processed only when
  the partition's offset is still where they start;
- replies are received straight into a buffer of the partition's own (its
  :class:`~metaq.consumer._session.Readahead`, behind the unconsumed tail of
  the last one), and the C message builder reads them
  there: the body bytes are copied once, into the messages;
- a partition found at its log end on a broker that offers holding is not
  backed off but answered :data:`PARK`: the manager parks it with the long
  poller;
- a position nobody confirmed yet (a committed offset, a seek) that reads as
  garbage, as nothing, or as a huge message is checked with the broker
  (``offset``): inside a message it moves to that message's start; outside
  the log ``offset_reset`` decides; damaged bytes are skipped and reported;
- a position above the log end of a slave (``BrokerRoute``: a broker id's
  partitions may be read from a slave) is one the slave has not copied yet: the
  partition waits for it (Metaq's backoff), never resets.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable

from metaq._errors import (
    BrokerError,
    BrokerUnavailableError,
    ChecksumError,
    DamagedMessageError,
    MessageError,
    OffsetOutOfRangeError,
)
from metaq.consumer._lease import Lease
from metaq.consumer._processor import process_batch
from metaq.consumer._session import LOG_END, FetchSession, Readahead
from metaq.consumer._subscription import BY_TIME, LATEST, PartitionState
from metaq.protocol import MAX_PAYLOAD_SIZE, scan

__all__ = ["PartitionFetcher", "PARK", "ErrorHandler"]

log = logging.getLogger(__name__)

_ID = struct.Struct(">q")
_FLOW_POLL = 0.02  # seconds between looks at a flow-controlled partition
#: ``fetch_once``'s answer for "at the log end: park it with the long poller"
PARK = -1.0

#: ``on_error(error, partition or None)``
ErrorHandler = Callable[[BaseException, "PartitionState | None"], None]


class PartitionFetcher:
    """Fetches one partition for the runner holding it (see the module docstring).

    Shared by the runners of one manager and stateless: the wire is the runner's
    :class:`~metaq.consumer._session.FetchSession`, the position the partition's
    :class:`~metaq.consumer._subscription.PartitionState`.
    """

    def __init__(self, *, group: str, max_delay: float, max_fetch_size: int,
                 on_error: ErrorHandler, lease: Lease | None, offset_reset: str,
                 prefetch: bool) -> None:
        self._group = group
        self._prefetch = prefetch
        self._max_delay = max_delay
        self._step = max_delay / 10.0
        self._max_fetch_size = max_fetch_size
        self._offset_reset = offset_reset
        self._on_error = on_error
        self._lease = lease

    def backoff(self, pf: PartitionState, ra: Readahead) -> float:
        """Wait longer before ``pf``'s next fetch (nothing new, or a failure); with
        nothing in hand it gives its receive buffer back."""
        ra.idle()
        return pf.back_off(self._step, self._max_delay)

    def _backoff(self, s: FetchSession) -> float:
        assert s.pf is not None
        return self.backoff(s.pf, s.ra)

    def _may_lag(self, pf: PartitionState, s: FetchSession) -> bool:
        """A broker's answer that ``pf`` is past its end may still be a lag (a Java
        broker's max offset is what it flushed): true until ``pf`` has waited the
        longest backoff for it; always from a slave (it copies its master's log, the
        same offsets, and gets there: never a reason to reset a position)."""
        return s.from_slave or pf.delay < self._max_delay

    def _at_end(self, s: FetchSession) -> float:
        """Nothing new at the partition's offset: park it when its broker holds gets,
        else Metaq's growing backoff."""
        return PARK if s.holds else self._backoff(s)

    def fetch_once(self, pf: PartitionState, s: FetchSession) -> float:
        """Fetch ``pf`` (bound to the runner's session ``s``) and deliver what came (the
        caller holds it); the delay before its next fetch, or :data:`PARK`."""
        if pf.seek_to is not None or pf.rollback:
            pf.apply_requests()
            s.ra.drop()  # bytes fetched ahead belong to the old position
        if pf.stalled is not None:
            return self._max_delay  # offset_reset="fail": waits for a seek
        if pf.inflight is not None and pf.inflight.blocked(*pf.flow):
            return _FLOW_POLL  # flow control: too much of this partition is in flight
        if s.address is None:
            s.ra.drop()
            return self._backoff(s)  # broker unknown right now: wait
        if self._lease is not None and not self._lease.valid():
            s.ra.drop()
            return self._step  # ownership unconfirmed (frozen past the session?): wait
        data = s.take_ready()
        sent_ahead = False
        try:
            s.connect()
            if data is None:
                if pf.offset == BY_TIME:  # a time: searched in the log by msgId time
                    assert pf.time_ms is not None
                    pf.resolve(s.offset_for_time(pf.time_ms))
                elif pf.offset < 0:  # LATEST or EARLIEST: the broker's log end or start
                    pf.resolve(s.offset(LOG_END if pf.offset == LATEST else 0))
                data = s.get()
            parks = s.holds
            if data and self._prefetch and (not parks or len(data) >= pf.max_size >> 1):
                # the bytes right after these: the broker sends them while we deliver
                # (not after a short reply from a broker that holds gets: the partition
                # is probably caught up, and its held get will bring what comes next
                # without this runner waiting for a round trip)
                s.send_ahead(pf.offset + len(data))
                sent_ahead = True
        except BrokerError as e:
            return self._on_broker_error(pf, e, s)
        except BrokerUnavailableError as e:
            return self._connection_failed(pf, s, e)
        pf.answered()
        if self._lease is not None and not self._lease.valid():
            s.end_ahead(None)
            return self._step  # the lease ran out while we fetched: deliver nothing
        if pf.rewound is not None:
            moved = pf.offset
            data = self._after_rewind(pf, data)
            if data is None:  # the log changed where it was: a real rewind
                s.end_ahead(None)
                return self._out_of_range(pf, s, start=None, end=moved)
            if not data:  # all of it delivered already
                s.end_ahead(data)
                return 0.0
        base = pf.offset
        try:
            result = process_batch(pf, data)
        except ChecksumError as e:
            s.end_ahead(None)
            if not pf.checked:  # a committed offset inside a message reads as garbage
                delay = self._check_position(pf, s)
                if delay is not None:
                    return delay
            return self._resync(pf, s, e)
        except BaseException:
            s.end_ahead(None)
            raise
        keep = result.consumed and pf.retry_delay is None
        at_end = s.end_ahead(data[pf.offset - base:] if keep else None)
        if result.consumed:
            pf.delivered()
            if pf.retry_delay is not None:
                return pf.retry_delay
            if (at_end or (parks and not sent_ahead)) and pf.offset == base + len(data):
                return self._at_end(s)  # all delivered, maybe nothing after it
            return 0.0
        if pf.retry_delay is not None:
            return pf.retry_delay  # listener failed on the first message: retry later
        if result.needed_size:
            if not pf.checked:  # a huge "message" at an unconfirmed position: maybe
                delay = self._check_position(pf, s)  # inside one
                if delay is not None:
                    return delay
            if len(data) < result.needed_size <= pf.max_size:
                return self._capped(pf, result.needed_size, len(data))
            return self._grow(pf, result.needed_size)
        return self._backoff(s)

    def _connection_failed(self, pf: PartitionState, s: FetchSession,
                           e: BrokerUnavailableError) -> float:
        s.failed()
        failures = pf.fetch_failed()
        if failures in (1, 10) or failures % 100 == 0:
            log.warning("fetch %s/%s from %s failed (%d in a row): %s",
                        pf.topic, pf.partition, s.address, failures, e)
        return self._backoff(s)

    def _grow(self, pf: PartitionState, needed: int) -> float:
        if needed > self._max_fetch_size:
            err = MessageError(
                f"message at {pf.topic}/{pf.partition} offset {pf.offset} needs "
                f"{needed} bytes, over max_fetch_size={self._max_fetch_size}; partition stalls")
            if pf.too_big():
                self._on_error(err, pf)
            return self._max_delay
        new = min(self._max_fetch_size, max(needed, pf.max_size * 2))
        log.info("fetch size of %s/%s grows %d -> %d for a message of %d bytes",
                 pf.topic, pf.partition, pf.max_size, new, needed)
        pf.grow(new)
        return 0.0

    def _capped(self, pf: PartitionState, needed: int, got: int) -> float:
        """Asked for at least the whole message, sent only ``got`` bytes: the broker caps
        its replies below the message (a Java broker: ``min(maxTransferSize, maxSize)``)
        and will never send it.  Reported once (MessageError to on_error, ``capped`` in
        metrics), then retried at the slowest backoff in case the cap is raised."""
        first = pf.capped is None
        pf.capped = (needed, got)
        if first:
            err = MessageError(
                f"message at {pf.topic}/{pf.partition} offset {pf.offset} is {needed} bytes "
                f"but its broker sends at most {got} bytes per get (a Java Metaq broker's "
                f"maxTransferSize, 1 MiB by default): it can never be read; raise "
                f"maxTransferSize in the broker's server.ini above {needed} and restart it. "
                f"The partition waits and retries every {self._max_delay:g} s")
            log.error("%s", err)
            self._on_error(err, pf)
        return self._max_delay

    def _after_rewind(self, pf: PartitionState, data: memoryview) -> memoryview | None:
        """The bytes re-read after a rewind (from ``pf.offset``): when the message ending
        where the partition was is still there with the msgId delivered last, the log is
        the same and everything before it was delivered: those bytes are passed over
        (counted); None when the log changed (a real rewind)."""
        assert pf.rewound is not None
        was, msg_id = pf.rewound
        gap = was - pf.offset
        found = None
        if 0 < gap <= len(data) and msg_id != -1:
            bounds, count, stop, _kind, _a, _b = scan(data[:gap], True, MAX_PAYLOAD_SIZE)
            if count and stop == gap:
                last = memoryview(bounds).cast("i")[count - 1]
                if _ID.unpack_from(data, last + 8)[0] == msg_id:
                    found = count
        if found is None:
            log.warning("%s/%s: the broker moved it back from %d to %d and the log there "
                        "changed (not the message delivered last): a real rewind",
                        pf.topic, pf.partition, was, pf.offset)
            pf.rewind_checked(None)
            return None
        log.info("%s/%s: the broker moved it back from %d to %d; the %d message(s) read "
                 "again were delivered already: not delivered again",
                 pf.topic, pf.partition, was, was - gap, found)
        pf.rewind_checked(gap, found)
        return data[gap:]

    def _on_broker_error(self, pf: PartitionState, e: BrokerError, s: FetchSession) -> float:
        if e.code == 404:
            if pf.rewound is not None:
                if self._may_lag(pf, s):
                    # sent back to the broker's max offset, and nothing there yet: a Java
                    # broker's max offset (what it flushed) lags what it served and it
                    # answers 404 there until it flushes: wait, re-read (the msgId check)
                    log.debug("%s/%s: nothing yet at %d, the broker's max offset: waiting "
                              "for it to catch up with %d", pf.topic, pf.partition, pf.offset,
                              pf.rewound[0])
                    return self._backoff(s)
                moved = pf.offset  # still nothing after the longest backoff: the log is
                pf.rewind_checked(None)  # shorter than what was delivered (a real rewind)
                return self._out_of_range(pf, s, start=None, end=moved)
            if not pf.checked:  # nothing here: the end, or a position beyond it?
                delay = self._check_position(pf, s)
                if delay is not None:
                    return delay
            return self._at_end(s)  # nothing new
        if e.code == 301:
            try:
                moved = int(e.detail.strip())
            except ValueError:
                self._on_error(e, pf)
                return self._backoff(s)
            if moved > pf.offset:
                try:
                    start = s.offset(0)
                except BrokerError:
                    start = moved
                except BrokerUnavailableError as err:
                    return self._connection_failed(pf, s, err)
                if start < moved:  # a damaged range the broker knows: past it
                    return self._skip_damaged(pf, pf.offset, moved, "damaged bytes in the "
                                              "broker's log")
                # below the log start: retention deleted what was not read
                return self._out_of_range(pf, s, start=moved, end=None)
            if pf.offset == pf.rewind_seen:
                return self._backoff(s)  # sent back again from where a re-read proved
                #                          the log the same: nothing new yet, wait
            if pf.msg_id != -1:
                # above what the broker calls its end, where we read (a Java broker whose
                # max offset lags): re-read from there, passing over what was delivered
                # (sent back further during a re-read: from there, checked the same way)
                pf.rewind(moved)
                s.ra.drop()
                return 0.0
            if self._may_lag(pf, s):
                # no msgId to check a re-read against (a committed offset without one, a
                # seek): maybe a lag too; ask again from here with Metaq's backoff, and
                # only when it still says so after the longest backoff is it above the end
                log.info("%s/%s: the broker says its max offset is %d, below %d: asking "
                         "again", pf.topic, pf.partition, moved, pf.offset)
                return self._backoff(s)
            return self._out_of_range(pf, s, start=None, end=moved)  # above the end
        log.warning("fetch %s/%s: %s", pf.topic, pf.partition, e)
        return self._backoff(s)

    # -- damaged bytes ------------------------------------------------------------------

    def _resync(self, pf: PartitionState, s: FetchSession, err: Exception) -> float:
        """A damaged message: ask the broker for the next valid position (Metaq's rule),
        report what is skipped (DamagedMessageError to on_error) and resume there."""
        bad = getattr(err, "offset", pf.offset)
        try:
            valid = s.resume_after_damage(bad)
        except BrokerError as e:
            log.warning("offset resync of %s/%s failed: %s", pf.topic, pf.partition, e)
            return self._backoff(s)
        except BrokerUnavailableError as e:
            return self._connection_failed(pf, s, e)
        if valid <= bad:  # the broker sees a valid message there
            if pf.count_checksum_failure() < 3:
                return self._backoff(s)  # maybe damaged in transit: read again
            skip_to = getattr(err, "next_offset", None)
            if skip_to is None:
                self._on_error(err, pf)
                return self._max_delay
            valid = skip_to  # the broker serves damaged bytes: skip the one message
        pf.forget_checksum_failures()
        return self._skip_damaged(pf, bad, valid, str(err))

    def _skip_damaged(self, pf: PartitionState, bad: int, valid: int, why: str) -> float:
        """Report the damaged bytes ``[bad, valid)`` (DamagedMessageError to on_error),
        count them, and resume delivery at ``valid``."""
        pf.skip_damaged(bad, valid)
        log.error("damaged message in %s/%s at offset %d (%s); %d bytes skipped, resuming "
                  "at %d", pf.topic, pf.partition, bad, why, valid - bad, valid)
        self._on_error(DamagedMessageError(
            f"damaged message in {pf.topic}/{pf.partition} at offset {bad}: {why}; "
            f"{valid - bad} bytes skipped, delivery resumes at {valid}",
            topic=pf.topic, partition=pf.partition, offset=bad, next_offset=valid), pf)
        return 0.0

    # -- positions outside the log -------------------------------------------

    def _check_position(self, pf: PartitionState, s: FetchSession) -> float | None:
        """Is ``pf.offset`` (from a commit or a seek) a message boundary in the log?
        Asks the broker (``offset``); None when it is (the caller goes on), else the
        delay after handling what it is not (offset_reset).

        A broker without ``+boundary`` (Java) is not exact: its log end may lag what
        it served (it is what it flushed), so a position above it is asked about
        again with Metaq's backoff, and only one still above it after the longest
        backoff is out of range; and it answers ``offset`` inside the log with a
        segment's start, from which the message holding the position is found by
        walking message headers (never the whole segment delivered again)."""
        try:
            valid = s.offset(pf.offset)
            if valid == pf.offset:
                pf.mark_checked()
                return None
            end = s.offset(LOG_END)
        except BrokerError as e:  # a broker that cannot tell (Java: unwritten partition)
            log.debug("position check of %s/%s: %s", pf.topic, pf.partition, e)
            pf.mark_checked()
            return None
        except BrokerUnavailableError as e:
            return self._connection_failed(pf, s, e)
        if pf.offset > end:
            if s.from_slave:  # behind its master: wait until it has copied that far
                log.debug("%s/%s: slave %s:%s has copied up to %d, below %d: waiting",
                          pf.topic, pf.partition, *s.address, end, pf.offset)
                return self._backoff(s)
            if not s.exact_offsets and self._may_lag(pf, s):
                log.info("%s/%s: the broker says its log ends at %d, below %d: asking "
                         "again", pf.topic, pf.partition, end, pf.offset)
                return self._backoff(s)
            return self._out_of_range(pf, s, start=None, end=end)
        if valid > pf.offset:  # below the log start
            return self._out_of_range(pf, s, start=valid, end=end)
        if not s.exact_offsets:  # ``valid`` is a segment's start: walk from there
            try:
                found = self._find_boundary(pf, s, valid)
            except BrokerError as e:
                log.debug("position check of %s/%s: %s", pf.topic, pf.partition, e)
                found = None
            except BrokerUnavailableError as e:
                return self._connection_failed(pf, s, e)
            if found is None or found == pf.offset:  # a boundary, or it cannot tell
                pf.mark_checked()
                return None
            valid = found
        # inside a message: back to its start (that message is read again)
        self._report_reset(pf, "boundary", None, end,
                           f"offset {pf.offset} is inside the message at {valid}; "
                           f"reading from {valid} ({pf.offset - valid} bytes again)")
        pf.move_to_boundary(valid)
        return 0.0

    def _find_boundary(self, pf: PartitionState, s: FetchSession, start: int) -> int | None:
        """The start of the message holding ``pf.offset``, walking message headers from
        ``start`` (a segment's start, where a message begins) without delivering
        anything; None when the walk cannot get there (damaged bytes, a message
        bigger than a fetch)."""
        at, target, size = start, pf.offset, self._max_fetch_size
        while at < target:
            data = s.read(at, size)
            bounds, count, stop, _kind, _a, _b = scan(data, False, MAX_PAYLOAD_SIZE)
            if not count:
                return None
            starts = memoryview(bounds).cast("i")
            for i in range(count):
                if at + starts[i + 1] > target:  # this message ends past the position
                    return at + starts[i]
            at += stop
        return at if at == target else None

    def _out_of_range(self, pf: PartitionState, s: FetchSession, *,
                      start: int | None, end: int | None) -> float:
        """``pf.offset`` is below the log ``start`` or above its ``end``: offset_reset."""
        policy = self._offset_reset
        where = (f"above the log end {end}" if start is None
                 else f"below the log start {start}")  # before a bound is asked for
        try:
            if policy == "earliest" and start is None:
                start = s.offset(0)
            elif policy == "latest" and end is None:
                end = s.offset(LOG_END)
        except BrokerError as e:
            log.warning("log bounds of %s/%s: %s", pf.topic, pf.partition, e)
            return self._backoff(s)
        except BrokerUnavailableError as e:
            return self._connection_failed(pf, s, e)
        if policy == "fail":
            err = self._report_reset(pf, "fail", start, end,
                                     f"offset {pf.offset} is {where}; offset_reset=fail: "
                                     f"not fetched until a seek")
            pf.stall(err)
            return self._max_delay
        to = start if policy == "earliest" else end
        assert to is not None
        gap = to - pf.offset
        what = (f"{gap} bytes skipped" if gap > 0 else f"{-gap} bytes from the log start "
                f"read (again)" if policy == "earliest" else f"{-gap} bytes back")
        self._report_reset(pf, policy, start, end,
                           f"offset {pf.offset} is {where}; offset_reset={policy}: "
                           f"reading from {to} ({what})")
        pf.reset_to(to)
        return 0.0

    def _report_reset(self, pf: PartitionState, action: str, start: int | None,
                      end: int | None, what: str) -> OffsetOutOfRangeError:
        pf.count_reset()
        err = OffsetOutOfRangeError(f"{pf.topic}/{pf.partition}: {what}", topic=pf.topic,
                                    partition=pf.partition, offset=pf.offset,
                                    log_start=start, log_end=end, action=action)
        log.error("%s", err)
        self._on_error(err, pf)
        return err
