"""Find the offset for a time: the broker's time index, or a binary search over a
partition's bytes.

A metaq-py broker offers a time index (``+timeindex`` in its ``version`` answer):
one ``offset ... time=<ms>`` round trip answers (:mod:`metaq.broker._timeindex`,
exact for the logs it writes).  Against a Java Metaq broker, or with
``use_index=False``, the search below finds it with ~30 round trips.

:func:`offset_for_time` answers "where do the messages of time ``when_ms`` start?"
with a few ``offset``/``get`` round trips and no index: a message's time is the
wall-clock millisecond its broker wrote into its msgId
(:func:`metaq.protocol.msg_id_parts`), so any message read tells its time.

The answer
----------
The offset of the first message whose time is at or after ``when_ms``; the log
end when no message is; the log start (its first valid message) when every
message is.  Exactly that when the times are non-decreasing in log order (one
broker, a clock that never went back).

Times out of order (a broker restarted with its clock set back, a log copied
from another broker): the search returns a *transition*: a message ``m`` at or
after ``when_ms`` whose predecessor in the log is before ``when_ms`` (or ``m`` is
the first message), or the log end when the last message is before
``when_ms``.  Such a point always exists (the log start is "before everything",
the log end "after everything"), every transition is a place where the log
crosses ``when_ms`` upwards, and when the times are non-decreasing there is
exactly one, the answer above.  With several (the clock went back across
``when_ms``), which one is returned depends on where the probes land: it may be
any of them, never a place inside a run of messages all at or after
``when_ms`` or all before it.  (Kafka's per-segment max-timestamp index finds
the first in log order; without an index that costs a full scan.)

Damaged bytes (a bad checksum, an impossible length, a zeroed hole) are not
messages: they are skipped to the next valid message, so a transition's
"predecessor" is the previous valid message.

The algorithm
-------------
Probe ``P(x)``: the first valid message *starting* at or after byte ``x``, with its
time.  Binary search over ``x`` keeps ``L``, a message known before ``when_ms``, and
``H``, a message known at or after it (or the log end), plus ``hi``: no message
starts in ``[hi, H)``.  Each probe at ``x = (L.next + hi) // 2`` either moves
``L`` past ``x`` or sets ``hi = x`` (``H`` = the probed message, or unchanged when
nothing valid starts in ``[x, H)``), so ``[L.next, hi)`` halves.  Every probe
also reads the whole messages its ``get`` returned (``probe_size`` bytes), so
``L`` and ``H`` also move to any message of the reply; when they become adjacent
the answer is ``H``.  Once ``hi - L.next <= probe_size`` one last walk from
``L.next`` (usually one ``get``) reads message by message to ``H``.

A probe is two round trips:

1. ``offset x``: a message boundary.  metaq-py's broker answers the start of the
   message holding ``x`` (exact); a Java Metaq broker may answer only a segment
   start or another boundary at or before ``x`` (or, for damaged bytes, after).
2. ``get`` of ``probe_size`` bytes at that boundary, walked message by message
   to the first one starting at or after ``x``.  A message whose header is read
   but whose body is cut off is stepped over by its length (the boundary after
   it is the broker's own framing) unless it is the one wanted, whose ``get`` is
   then grown to its whole size.  When the boundary was far before ``x`` (more
   than ``probe_size`` short of it after the first reply: a coarse Java answer),
   the probe resyncs at ``x`` instead of walking the segment.

Resync (after damaged bytes, or at ``x`` for a coarse broker): ``get`` from the
position and take the first byte ``p`` where a *chain* starts: a non-zero header
with a plausible length and a matching CRC32, followed by more such messages up to
the end of the reply (a cut-off last one allowed).  A random false positive
needs a 31-bit CRC match plus the chain, so it is not a practical concern for
damage; a payload that itself holds well-formed Metaq messages that end exactly
where it ends can fool it, which only matters on the coarse (Java) path.  metaq-py's
broker also redirects a ``get`` inside a damaged range it knows (301) to its end,
which the resync follows.

Round trips: 2 for the log bounds, 2 per probe for ``ceil(log2(size /
probe_size))`` probes, 1 or 2 for the last walk (a ``get`` never crosses a segment
end, so a walk that reaches one takes one more), and more only for messages
larger than ``probe_size`` (one ``get`` grown to the message) and damaged bytes
(a resync reads forward until a chain starts).  Against a broker whose ``offset``
is coarse a probe costs up to 4 (``offset``, the ``get`` at the far boundary, the
resync ``get`` at ``x``, the ``get`` from the chain found).
:attr:`TimeSeek.round_trips` says what a search took.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from metaq._errors import BrokerError
from metaq.protocol import (
    HEADER,
    HEADER_SIZE,
    MAX_PAYLOAD_SIZE,
    MSG_ID_EPOCH_MS,
    TIME_INDEX_CAPABILITY,
    scan,
)

__all__ = ["TimeSeek", "offset_for_time", "time_at", "header_at", "broker_has_time_index"]

_INT64_MAX = (1 << 63) - 1
_ID = struct.Struct(">q")
_ZEROS = bytes(HEADER_SIZE)


@dataclass(frozen=True)
class TimeSeek:
    """What :func:`offset_for_time` found.

    ``offset``: where to start reading; ``msg_time_ms``: the time (from its msgId)
    of the message at ``offset``, None when ``offset`` is the log end;
    ``round_trips``: requests sent; ``probes``: binary-search probes made.
    """

    offset: int
    msg_time_ms: int | None
    round_trips: int
    probes: int


@dataclass(frozen=True)
class _Msg:
    pos: int
    time: int
    next: int


def _time_of(msg_id: int) -> int:
    return (msg_id >> 22) + MSG_ID_EPOCH_MS


def _parse(buf: memoryview, base: int) -> tuple[list[_Msg], int, bool]:
    """The whole valid messages at the start of ``buf`` (absolute positions from
    ``base``); where they stop; whether what follows is damaged (else: nothing, or
    a message cut off by the end of ``buf``)."""
    bounds, count, stop, kind, _a, _b = scan(buf, True, MAX_PAYLOAD_SIZE)
    starts = memoryview(bounds).cast("i").tolist()
    out = []
    for i in range(count):
        p = starts[i]
        if buf[p:p + HEADER_SIZE] == _ZEROS:  # a hole, never a message
            return out, base + p, True
        out.append(_Msg(base + p, _time_of(_ID.unpack_from(buf, p + 8)[0]), base + starts[i + 1]))
    return out, base + stop, kind != 0


class _Seeker:
    def __init__(self, conn, topic: str, partition: int, group: str, probe_size: int) -> None:
        self.conn, self.topic, self.partition, self.group = conn, topic, partition, group
        self.probe_size = probe_size
        self.round_trips = 0
        self.probes = 0

    # -- requests ------------------------------------------------------------------------
    def offset(self, x: int) -> int:
        self.round_trips += 1
        return self.conn.offset(self.topic, self.group, self.partition, x)

    def get(self, pos: int, size: int) -> memoryview | int | None:
        """The bytes at ``pos``; an int: the broker moved us there (301); None: at or
        after the log end (404)."""
        self.round_trips += 1
        try:
            data = self.conn.get(self.topic, self.group, self.partition, pos, size)
        except BrokerError as e:
            if e.code == 301:
                try:
                    return int(e.detail.strip())
                except ValueError:
                    raise e from None
            if e.code == 404:  # at or after the end (the partition itself was found)
                return None
            raise
        mv = memoryview(data)
        return mv.cast("B") if mv.itemsize != 1 or mv.ndim != 1 else mv

    # -- reading messages ----------------------------------------------------------------
    def read_from(self, pos: int, want: int, limit: int) -> list[_Msg]:
        """Valid messages read from boundary ``pos`` on: a contiguous run ending in
        the first valid message starting in ``[want, limit)`` (and what else the same
        reply held), or [] when there is none.  Messages cut off by the reply are
        stepped over by their length when before ``want``, else the ``get`` is grown
        to hold them; damaged bytes are resynced past."""
        size = self.probe_size
        run: list[_Msg] = []
        first = True
        while pos < limit:
            got = self.get(pos, size)
            if got is None:
                return []
            if isinstance(got, int):  # below the log start, or past known damage
                pos, run = max(got, pos + 1), []
                continue
            msgs, stop, damaged = _parse(got, pos)
            if not msgs and not damaged:  # a message cut off at the end of the reply
                if len(got) < HEADER_SIZE:
                    return []  # the partition ends in a partial header: no message
                length = HEADER.unpack_from(got, 0)[0]
                if pos < want:
                    pos, run = pos + HEADER_SIZE + length, []  # step over, unread
                    continue
                if len(got) < size:  # the reply ended short of it: it is not whole
                    damaged = True
                else:
                    size = HEADER_SIZE + length  # grow the probe for this message
                    continue
            run += msgs
            for k, m in enumerate(run):
                if m.pos >= want:
                    if m.pos >= limit:
                        return []
                    return run[:k] + [r for r in run[k:] if r.pos < limit]
            size = self.probe_size
            if damaged:
                pos, run = self.resync(stop, limit), []
                continue
            if first and want - stop > self.probe_size:
                # a coarse boundary (a Java broker's segment start): do not walk the
                # segment, resync at ``want``
                pos, run = self.resync(want, limit), []
            else:
                pos = stop
            first = False
        return []

    def resync(self, pos: int, limit: int) -> int:
        """The first position >= ``pos`` where a chain of valid messages starts (see
        the module docstring), a boundary the broker names, or ``limit``."""
        size = self.probe_size
        while pos < limit:
            got = self.get(pos, size)
            if got is None:
                return limit
            if isinstance(got, int):
                if got > pos:
                    return got  # the log start, or the end of damage the broker knows
                pos += 1
                continue
            n = len(got)
            short = n < size  # the reply ended at a segment end, the log end or damage
            grow = None
            for i in range(n - HEADER_SIZE + 1):
                length = HEADER.unpack_from(got, i)[0]
                if length < 0 or length > MAX_PAYLOAD_SIZE or got[i:i + HEADER_SIZE] == _ZEROS:
                    continue
                if i + HEADER_SIZE + length > n:
                    if short:
                        continue  # cannot be whole: the reply ended before it would
                    grow = (i, length)
                    break
                _b, count, _stop, kind, _x, _y = scan(got[i:], True, MAX_PAYLOAD_SIZE, False)
                if count and kind == 0:
                    return pos + i
            if grow is not None:  # maybe a message: read again from it, with room for it
                pos += grow[0]
                size = max(self.probe_size, HEADER_SIZE + grow[1])
                continue
            if short:
                return pos + n  # where the reply stopped is a boundary (segment end...)
            pos += n - HEADER_SIZE + 1
            size = self.probe_size
        return limit

    def probe(self, x: int, limit: int) -> list[_Msg]:
        """Messages read around ``x``: a contiguous run ending in the first valid
        message starting in ``[x, limit)``; [] when there is none."""
        self.probes += 1
        b = self.offset(x)
        if b >= limit:
            return []
        return self.read_from(b, x, limit)


def broker_has_time_index(conn: Any) -> bool:
    """Whether ``conn``'s broker answers ``offset ... time=<ms>`` (its ``version``
    answer lists ``+timeindex``: metaq-py's broker unless told not to)."""
    return TIME_INDEX_CAPABILITY in conn.version().split()


def offset_for_time(conn, topic: str, partition: int, when_ms: int, *,
                    group: str = "metaq-timeseek", probe_size: int = 64 * 1024,
                    use_index: bool | None = None) -> TimeSeek:
    """The offset of the first message of ``topic``-``partition`` whose msgId time
    is at or after ``when_ms`` (epoch ms), through ``conn`` (a
    :class:`BrokerConnection`).

    ``use_index``: ask the broker's time index (one round trip, metaq-py's
    ``+timeindex`` extension, exact for the logs it writes; see
    :mod:`metaq.broker._timeindex`); None (the default) asks when the broker offers
    it (one ``version`` round trip more), False never: then, and against a Java
    Metaq broker, a binary search over the partition's bytes finds it.

    The log end when no message is that late, the log start when all are; for times
    out of order, damaged bytes and the number of round trips see the module
    docstring of :mod:`metaq.net._timeseek`.  Raises what the connection raises
    (BrokerError for an unknown partition, ConnectionClosedError...).
    """
    if probe_size < HEADER_SIZE:
        raise ValueError(f"probe_size must be at least {HEADER_SIZE}, got {probe_size}")
    asked = 0
    if use_index is None:
        use_index = broker_has_time_index(conn)
        asked = 1
    if use_index:
        offset, t = conn.offset_for_time(topic, group, partition, max(0, when_ms))
        return TimeSeek(offset, t, asked + 1, 0)
    s = _Seeker(conn, topic, partition, group, probe_size)
    s.round_trips = asked
    start = s.offset(0)
    end = s.offset(_INT64_MAX)

    def done(m: _Msg | None) -> TimeSeek:
        if m is None:
            return TimeSeek(end, None, s.round_trips, s.probes)
        return TimeSeek(m.pos, m.time, s.round_trips, s.probes)

    if end <= start:
        return done(None)
    s.probes += 1
    run = s.read_from(start, start, end)
    if not run:
        return done(None)
    if run[0].time >= when_ms:
        return done(run[0])
    low: _Msg = run[0]          # a message before when_ms
    high: _Msg | None = None    # a message at or after it (None: the log end)
    high_pos = end
    hi = end                    # no message starts in [hi, high_pos)

    def take(run: list[_Msg]) -> bool:
        """Move low/high to the messages of the contiguous ``run`` between them;
        True when they are adjacent (high is the answer)."""
        nonlocal low, high, high_pos
        for m in run:
            if m.pos < low.pos:
                continue
            if m.pos >= high_pos:
                break
            if m.time < when_ms:
                low = m
            else:
                high, high_pos = m, m.pos
                break
        return low.next == high_pos

    if take(run[1:]):
        return done(high)
    while hi - low.next > probe_size:
        x = (low.next + hi) // 2
        run = s.probe(x, high_pos)
        if not run:
            hi = x
            continue
        first = next(m for m in run if m.pos >= x)
        if take(run):
            return done(high)
        if first.time >= when_ms:
            hi = x
        hi = min(hi, high_pos)
    # the last walk: from low's successor, message by message, up to high
    pos = low.next
    while pos < high_pos:
        run = s.read_from(pos, pos, high_pos)
        if not run:
            break
        for m in run:
            if m.pos >= high_pos:
                break
            if m.time >= when_ms:
                return done(m)
        pos = run[-1].next
    return done(high)


def header_at(conn: Any, topic: str, partition: int, offset: int, *,
              group: str = "metaq-timeseek") -> tuple[int, int] | None:
    """``(msgId time in epoch ms, whole size in bytes)`` of the message starting at
    ``offset``, from one small ``get`` (its header is enough); None at or past the log
    end, or when the bytes there are not a message header (a broker's damaged range)."""
    try:
        head = conn.get(topic, group, partition, offset, 64)
    except BrokerError as e:
        if e.code in (301, 404):
            return None  # moved (below the start, damage) or nothing there
        raise
    if len(head) < HEADER_SIZE:
        return None
    length, _check, msg_id, _flag = HEADER.unpack_from(head, 0)
    return _time_of(msg_id), HEADER_SIZE + length


def time_at(conn: Any, topic: str, partition: int, offset: int, *,
            group: str = "metaq-timeseek") -> int | None:
    """The msgId time (epoch ms) of the message starting at ``offset`` (:func:`header_at`)."""
    head = header_at(conn, topic, partition, offset, group=group)
    return None if head is None else head[0]
