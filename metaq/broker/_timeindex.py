"""A segment's time index: where the messages of a time start (metaq-py's extension).

The broker answers ``offset <topic> <group> <part> <offset> <opaque> time=<ms>``
(advertised as ``+timeindex`` in its ``version`` answer) with the offset of the
first message whose msgId time is at or after ``<ms>``, and that message's time:
one round trip where a client's binary search over the log
(:mod:`metaq.net._timeseek`, the fallback against a Java broker) takes ~30.

Entries
-------
Each segment keeps sparse entries ``(offset, time)``: ``offset`` the start of a
valid message, one about every :data:`~metaq.broker._segment.INDEX_STEP` bytes
(where the boundary index has its entries, and the segment's first message);
``time`` the greatest msgId time (epoch ms) of the entries up to and including
it, so the times never decrease and a bisect finds the last entry before a time.
A finished (sealed) segment also knows ``last_time``, the time of its last
message, so a search skips a segment that ends before the time without reading it.

Where the entries come from:

- the writable segment: each write that passes the step adds the time of its
  first message (the broker made that msgId; reading it costs one unpack);
- the writable segment after a restart: recovery's checked scan of the whole
  segment, which it makes anyway, adds them at its boundary entries;
- a sealed segment: ``<name>.timeindex`` beside it, written when the segment is
  sealed (:func:`save`) and after a rebuild.  The file is used only when it
  matches (its magic, version, CRC32, the segment's start and size, entries in
  order inside the segment); otherwise, or when it is missing, the first time
  request rebuilds the index with a checked scan (:meth:`Segment.build_time_index`)
  and writes the file again.  The file is a cache: it is not fsynced, and a bad
  one costs a rebuild, never a wrong answer's worth of trust (every answer comes
  from reading the checked messages themselves, see below).

The answer
----------
:func:`find` walks the segments in order, skips each whose ``last_time`` is before
``when_ms``, bisects the entries of the first that is not, and reads the checked
messages from the last entry before ``when_ms`` to the first message at or after
it (at most about one step of bytes when the times do not decrease).

When times never decrease in log order the answer is exactly the first message
at or after ``when_ms``.  The broker keeps them so: its msgId generator continues
after the greatest time found in its logs when it starts
(:meth:`~metaq.protocol.MsgIdGenerator.continue_after`), so a clock set back
across a restart does not make times go back (ids keep increasing and their
time stays at the log's last millisecond until the clock catches up).  For a log
whose times are out of order anyway (copied from elsewhere, written by an older
version with a clock set back), the answer is a *transition*, as the client's
search gives: a message at or after ``when_ms`` whose predecessor is before it.

Damaged bytes are not messages: a read that meets them resumes at the next
valid message (:meth:`Segment.boundary_at_or_before`, which records what it
finds as damaged, as any reader's does).
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

from metaq.protocol import HEADER, HEADER_SIZE, INT32_MAX, MSG_ID_EPOCH_MS, scan

if TYPE_CHECKING:
    from metaq.broker._segment import Segment

__all__ = ["TimeIndex", "find", "load", "save", "encode", "decode", "path_for", "time_of",
           "last_message_time", "SUFFIX"]

log = logging.getLogger(__name__)

#: The file beside a segment: ``<20-digit start>.meta.timeindex``.
SUFFIX = ".timeindex"
_MAGIC = b"MQTI"
_VERSION = 1
_HEAD = struct.Struct(">4sB3xqqqI")  # magic, version, segment start, size covered, last_time, n
_CRC = struct.Struct(">I")
_ID = struct.Struct(">q")
_READ = 256 * 1024
_NEAR = 2048
_ZEROS = bytes(HEADER_SIZE)


def time_of(buf: bytes | memoryview, pos: int) -> int:
    """The msgId time (epoch ms) of the message whose header starts at ``pos``."""
    return (_ID.unpack_from(buf, pos + 8)[0] >> 22) + MSG_ID_EPOCH_MS


class TimeIndex:
    """The entries of one segment (see the module docstring); ``dirty`` until saved."""

    __slots__ = ("offsets", "times", "last_time", "dirty")

    def __init__(self) -> None:
        self.offsets: list[int] = []
        self.times: list[int] = []
        #: time of the segment's last message, once the segment is finished; else None
        self.last_time: int | None = None
        self.dirty = True

    def add(self, offset: int, t: int) -> None:
        """An entry for the valid message at ``offset`` with msgId time ``t``."""
        offsets = self.offsets
        if offsets and offset <= offsets[-1]:
            return
        times = self.times
        if times and t < times[-1]:
            t = times[-1]
        offsets.append(offset)
        times.append(t)

    def __repr__(self) -> str:
        return f"TimeIndex({len(self.offsets)} entries, last_time={self.last_time})"


# -- the file ------------------------------------------------------------------------------

def path_for(segment_path: Path) -> Path:
    return segment_path.with_name(segment_path.name + SUFFIX)


def save(seg: Segment) -> None:
    """Write ``seg``'s time index beside it (atomically: a temporary file renamed);
    a failure is logged, the index stays in memory and ``dirty``."""
    ti = seg.tindex
    if ti is None:
        return
    data = encode(ti, seg.start, seg.size)
    path = path_for(seg.path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot write the time index %s: %s (it will be rebuilt when needed)",
                    path, e)
        return
    ti.dirty = False


def load(seg: Segment) -> TimeIndex | None:
    """``seg``'s time index from its file, or None (missing, or not matching the
    segment: the reason is logged) for a rebuild."""
    path = path_for(seg.path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("cannot read the time index %s: %s; it will be rebuilt", path, e)
        return None
    got = decode(data, seg.start, seg.size)
    if isinstance(got, str):
        log.warning("ignoring the time index %s: %s; it will be rebuilt", path, got)
        return None
    return got


def encode(ti: TimeIndex, start: int, size: int) -> bytes:
    """The file of ``ti``, for a segment at ``start`` of ``size`` bytes: a header
    (magic ``MQTI``, version, start, size, last_time or -1, n), the n offsets, the
    n times (big-endian int64s), the CRC32 of all that."""
    n = min(len(ti.offsets), len(ti.times))
    body = (_HEAD.pack(_MAGIC, _VERSION, start, size,
                       -1 if ti.last_time is None else ti.last_time, n)
            + struct.pack(f">{n}q", *ti.offsets[:n]) + struct.pack(f">{n}q", *ti.times[:n]))
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: bytes, start: int, size: int) -> TimeIndex | str:
    """The index in ``data`` when it is a good one for a segment at ``start`` of
    ``size`` bytes, else what is wrong with it."""
    if len(data) < _HEAD.size + _CRC.size:
        return f"{len(data)} bytes is too short for a time index"
    magic, version, s_start, s_size, last, n = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        return f"not a time index (magic {magic!r})"
    if version != _VERSION:
        return f"version {version}, this broker reads {_VERSION}"
    want = _HEAD.size + 16 * n + _CRC.size
    if len(data) != want:
        return f"{len(data)} bytes where {n} entries take {want}"
    if _CRC.unpack_from(data, want - _CRC.size)[0] != zlib.crc32(data[:want - _CRC.size]):
        return "its checksum does not match"
    if s_start != start or s_size != size:
        return (f"it was written for a segment at {s_start} of {s_size} bytes; the segment "
                f"is at {start} with {size} bytes")
    offsets = list(struct.unpack_from(f">{n}q", data, _HEAD.size))
    times = list(struct.unpack_from(f">{n}q", data, _HEAD.size + 8 * n))
    end = start + size
    if any(not start <= o < end for o in offsets) or any(
            a >= b for a, b in zip(offsets, offsets[1:], strict=False)) or any(
            a > b for a, b in zip(times, times[1:], strict=False)):
        return "its entries are out of order or outside the segment"
    ti = TimeIndex()
    ti.offsets, ti.times = offsets, times
    ti.last_time = None if last < 0 else last
    ti.dirty = False
    return ti


# -- reading messages ----------------------------------------------------------------------

def _messages(seg: Segment, pos: int, limit: int, first_read: int = _READ):
    """``(offset, time)`` of each valid message of ``seg`` from the message start
    ``pos`` up to ``limit`` (absolute offsets), stepping over damaged bytes; the
    first read is of ``first_read`` bytes (where the caller expects its answer)."""
    want = first_read
    while pos < limit:
        want = min(want, limit - pos)
        chunk = seg.pread(pos, want)
        if not chunk:
            return
        want = _READ
        view = memoryview(chunk)
        bounds, count, stop, kind, _a, _b = scan(view, True, INT32_MAX)
        starts = memoryview(bounds).cast("i").tolist() if count else []
        for i in range(count):
            p = starts[i]
            if view[p:p + HEADER_SIZE] == _ZEROS:  # a hole, never a message
                count, stop, kind = i, p, 1
                break
            yield pos + p, time_of(view, p)
        pos += stop
        if pos >= limit:
            return
        if kind != 0:  # damaged bytes at pos: to the next valid message
            nxt = seg.boundary_at_or_before(pos)
            pos = nxt if nxt > pos else seg.next_valid(pos)
        elif not count:  # one message longer than the chunk, or cut short by limit
            if len(chunk) < HEADER_SIZE:
                return
            need = HEADER_SIZE + HEADER.unpack_from(chunk, 0)[0]
            if pos + need > limit:
                return
            one = seg.pread(pos, need)
            _b, k, _s, _k, _a, _b2 = scan(one, True, INT32_MAX)
            if k == 1 and one[:HEADER_SIZE] != _ZEROS:
                yield pos, time_of(one, 0)
                pos += need
            else:
                nxt = seg.boundary_at_or_before(pos)
                pos = nxt if nxt > pos else seg.next_valid(pos)


def last_message_time(seg: Segment, limit: int | None = None) -> int | None:
    """The greatest msgId time among the messages after ``seg``'s last time-index
    entry (the entry's own included), up to ``limit`` (the segment end): with the
    entries, the greatest time in the segment.  None for a segment with no message."""
    ti = seg.tindex
    end = seg.end if limit is None else limit
    start = ti.offsets[-1] if ti is not None and ti.offsets else seg.start
    best = ti.times[-1] if ti is not None and ti.times else None
    for _o, t in _messages(seg, start, end):
        if best is None or t > best:
            best = t
    return best


def find(segments: list[Segment], end: int, when_ms: int) -> tuple[int, int]:
    """``(offset, time)`` of the first message at or after ``when_ms`` among
    ``segments`` (a partition's, oldest first; nothing at or past ``end`` is
    read), or ``(end, -1)`` when there is none.  Blocking: builds missing indexes."""
    for seg in segments:
        if seg.start >= end:
            break
        ti = seg.tindex
        if ti is None:
            ti = seg.build_time_index()
        if ti.last_time is not None and ti.last_time < when_ms:
            continue
        n = min(len(ti.offsets), len(ti.times))
        k = bisect.bisect_left(ti.times, when_ms, 0, n)
        pos = ti.offsets[k - 1] if k > 0 else seg.start
        # the answer is the message at offsets[k] or before it: read to a little past it
        first = ti.offsets[k] - pos + _NEAR if k < n else _READ
        for o, t in _messages(seg, pos, min(seg.end, end), min(first, _READ)):
            if t >= when_ms:
                return o, t
    return end, -1
