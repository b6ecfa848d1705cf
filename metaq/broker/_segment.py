"""One segment file of a partition log: ``<20-digit start offset>.meta``.

A segment holds whole messages back to back; its name is the absolute log
offset of its first byte.  Only the last segment of a partition is written.
Besides the file, a segment keeps a sparse index of message boundaries (at
least one every :data:`INDEX_STEP` bytes) used to find a valid position without
scanning the whole file.

Messages are checked with the protocol's :func:`~metaq.protocol.scan_messages`
(C when built).  The rules of a damaged log are the broker's and are here: an
all-zero header is a hole, never a message (:func:`_zero_header`), and a resync
anchors only on a message with a payload (:meth:`Segment._anchor`).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from pathlib import Path

from metaq._errors import StorageError
from metaq.broker._timeindex import TimeIndex, last_message_time, time_of
from metaq.protocol import HEADER, HEADER_SIZE, INT32_MAX, scan, scan_messages

__all__ = ["Segment", "segment_name", "parse_segment_name", "INDEX_STEP", "check_messages"]

log = logging.getLogger(__name__)

SUFFIX = ".meta"
INDEX_STEP = 64 * 1024
_SCAN_CHUNK = 8 * 1024 * 1024
_NAME = re.compile(r"(\d{20})\.meta")


def segment_name(start: int) -> str:
    return f"{start:020d}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


class Segment:
    """A segment file; ``size`` bytes of whole messages starting at offset ``start``."""

    def __init__(self, path: Path, start: int, *, writable: bool) -> None:
        self.path = path
        self.start = start
        self.rfile = open(path, "a+b" if writable else "rb", buffering=0)  # noqa: SIM115
        self.size = os.fstat(self.rfile.fileno()).st_size
        self.wfd: int | None = None
        if writable:
            self.wfd = os.open(path, os.O_WRONLY)
        self.index: list[int] = [start]     # absolute offsets of known message boundaries
        self.indexed = False                # True once index covers the whole segment
        #: where the messages of a time start (``_timeindex``); None until loaded or built
        self.tindex: TimeIndex | None = TimeIndex() if self.size == 0 else None
        self.pins = 0                       # reads (sendfile) in progress
        #: ``(start, end, why)`` absolute offset ranges known to hold no valid message
        self.damaged: list[tuple[int, int, str]] = []
        self.retired = False                # deleted; close the file once unpinned

    @property
    def end(self) -> int:
        return self.start + self.size

    def __repr__(self) -> str:
        return f"Segment({self.path.name}, size={self.size})"

    # -- writing (event loop thread) -------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Append ``data`` (whole messages); on failure the file is cut back and
        StorageError raised, so no partial message is ever left behind."""
        fd = self.wfd
        if fd is None:
            raise StorageError(f"segment {self.path} is not writable")
        old = self.size
        try:
            n = os.pwrite(fd, data, old)
            while n < len(data):
                n += os.pwrite(fd, memoryview(data)[n:], old + n)
        except OSError as e:
            try:
                os.ftruncate(fd, old)
            except OSError:
                log.exception("cannot cut %s back to %d bytes after a failed write",
                              self.path, old)
            raise StorageError(f"cannot write {len(data)} bytes to {self.path}: {e}") from e
        start = self.start + old
        self.size = old + len(data)
        ti = self.tindex
        if self.start + self.size - self.index[-1] >= INDEX_STEP or (
                ti is not None and not ti.offsets):
            # entries inside a big write too (one every step), found by walking its
            # headers in C without checking them again: the put step just did
            _index_starts(memoryview(data), len(data), start, self.index, ti, verify=False)

    def seal(self) -> int | None:
        """Stop writing; return the write fd for the caller to fsync and close.  The
        time index is finished (its ``last_time``) for the caller to save."""
        fd, self.wfd = self.wfd, None
        if self.tindex is not None:
            self.tindex.last_time = last_message_time(self)
        return fd

    # -- reading ----------------------------------------------------------------------------
    def pread(self, offset: int, n: int) -> bytes:
        return os.pread(self.rfile.fileno(), n, offset - self.start)

    def close(self) -> None:
        if self.wfd is not None:
            os.close(self.wfd)
            self.wfd = None
        self.rfile.close()

    # -- recovery and boundaries -----------------------------------------------------------
    def recover(self) -> tuple[int, int]:
        """Check every message of the (writable) segment after a restart.

        - A truncated message at the end (a write torn by a crash; nothing after it
          was ever served) is cut; its bytes are kept as ``<name>.cut-<offset>``.
        - A damaged message (impossible length, checksum mismatch) is *not* cut: the
          scan resynchronises on the first later offset from which valid messages
          run to the end, the bytes in between stay in place as a damaged range
          (recorded in ``<name>.damaged``, copied aside as ``<name>.damaged-<offset>``)
          and the intact messages after it are kept at their offsets.  Offsets are
          never reused for other messages; readers meet the damaged range and the
          ``offset`` command sends them past it.

        Returns ``(messages kept, bytes cut)``.
        """
        fd = self.rfile.fileno()
        index = [self.start]
        tindex = TimeIndex()
        pos = count = cut = 0
        while pos < self.size:
            stop, n, problem = self._scan_from(pos, index, tindex)
            count += n
            if stop >= self.size:
                break
            nxt = self._chain_start(stop + 1)
            if problem is None and nxt is None:  # a torn tail
                cut = self.size - stop
                keep = self._save_aside(stop, self.size, "cut")
                log.warning("recovery of %s: truncated message at offset %d; cut %d bytes "
                            "(offsets %d..%d)%s", self.path, self.start + stop, cut,
                            self.start + stop, self.end, f", saved to {keep}" if keep else "")
                os.ftruncate(self.wfd if self.wfd is not None else fd, stop)
                self.size = stop
                break
            if problem is None:  # a length pointing past the end, valid messages after
                problem = "a message length pointing past the end of the segment"
            end = self.size if nxt is None else nxt
            self.add_damage(self.start + stop, self.start + end, problem)
            keep = self._save_aside(stop, end, "damaged")
            log.error("recovery of %s: %s at offset %d; %d bytes (offsets %d..%d) kept in "
                      "place as damaged%s; %s", self.path, problem, self.start + stop,
                      end - stop, self.start + stop, self.start + end,
                      f", copied to {keep}" if keep else "",
                      "nothing valid follows" if nxt is None else
                      f"intact messages from offset {self.start + end} kept")
            if nxt is None:
                break
            pos = nxt
            if self.start + pos - index[-1] >= INDEX_STEP:
                index.append(self.start + pos)
        self.index = index
        self.indexed = True
        self.tindex = tindex
        return count, cut

    def _scan_from(self, pos: int, index: list[int], tindex: TimeIndex | None = None
                   ) -> tuple[int, int, str | None]:
        """Walk valid messages from ``pos``: ``(first position not part of one, count,
        problem)``; problem None at the end or at a truncated message.  Extends the
        sparse ``index`` (and ``tindex``) with the boundaries it passes."""
        fd = self.rfile.fileno()
        count = 0
        want = _SCAN_CHUNK
        while pos < self.size:
            chunk = os.pread(fd, min(want, self.size - pos), pos)
            valid, n, problem = self._check(chunk, self.start + pos, index, tindex)
            count += n
            pos += valid
            if problem is not None or pos >= self.size:
                return pos, count, problem
            if valid == 0:
                # a message larger than the chunk, or a torn tail
                length = HEADER.unpack_from(chunk, 0)[0] if len(chunk) >= HEADER_SIZE else 0
                need = HEADER_SIZE + length
                if len(chunk) >= HEADER_SIZE and pos + need <= self.size and need > want:
                    want = need
                    continue
                return pos, count, None
            want = _SCAN_CHUNK
        return pos, count, None

    @staticmethod
    def _check(chunk: bytes, at: int, index: list[int], tindex: TimeIndex | None = None
               ) -> tuple[int, int, str | None]:
        """:func:`scan_messages` of ``chunk`` (at absolute offset ``at``), where an
        all-zero header also ends the valid messages (a hole, :func:`_hole`); extends
        the sparse ``index`` over the valid ones (:func:`_index_starts`)."""
        view = memoryview(chunk)
        valid, n, problem = check_messages(chunk, view, INT32_MAX)
        _index_starts(view, valid, at, index, tindex)
        return valid, n, problem

    def count_messages(self, offset: int) -> int:
        """How many valid messages lie from ``offset`` (absolute, a message boundary) to
        the end of the segment, stepping over damaged ranges (known ones, and any met:
        resumed where valid messages run again); blocking, reads them."""
        count = 0
        pos = offset - self.start
        while pos < self.size:
            stop, n, _problem = self._scan_from(pos, [self.start])
            count += n
            if stop >= self.size:
                break
            known = self.damage_at(self.start + stop)
            if known is not None and known[1] > self.start + stop:
                pos = known[1] - self.start
                continue
            nxt = self._chain_start(stop + 1)
            if nxt is None:
                break
            pos = nxt
        return count

    def _anchor(self, pos: int) -> int | None:
        """The first position >= ``pos`` where a valid message with a payload starts
        (a byte-by-byte search), or None.

        An empty message is never an anchor: its checksum is 0, so any 8 zero bytes
        in damaged data (a flag of 0 before a body starting with zeros, say) would
        read as one, where a payload's CRC32 matches by chance once in 2**31."""
        fd = self.rfile.fileno()
        size = self.size
        while pos + HEADER_SIZE <= size:
            chunk = os.pread(fd, min(_SCAN_CHUNK, size - pos), pos)
            view = memoryview(chunk)
            last = len(chunk) - HEADER_SIZE
            for b in range(0, last + 1):
                length = HEADER.unpack_from(view, b)[0]
                if length <= 0 or pos + b + HEADER_SIZE + length > size:
                    continue
                rec = (view[b:b + HEADER_SIZE + length] if b + HEADER_SIZE + length <= len(chunk)
                       else os.pread(fd, HEADER_SIZE + length, pos + b))
                if scan_messages(rec, max_payload=INT32_MAX)[1] == 1:
                    return pos + b
            pos += last + 1
        return None

    def _chain_start(self, pos: int) -> int | None:
        """The first position >= ``pos`` from which valid messages run to the end of
        the file (or to a torn tail), the first of them with a payload
        (:meth:`_anchor`); None when there is none."""
        size = self.size
        while True:
            anchor = self._anchor(pos)
            if anchor is None:
                return None
            stop, _n, problem = self._scan_from(anchor, [self.start])
            if stop >= size or problem is None:
                return anchor
            pos = anchor + 1

    def _save_aside(self, start: int, end: int, kind: str) -> Path | None:
        keep = self.path.with_name(f"{self.path.name}.{kind}-{self.start + start}")
        try:
            with open(self.path, "rb") as src, open(keep, "wb") as dst:
                src.seek(start)
                left = end - start
                while left > 0:
                    data = src.read(min(left, _SCAN_CHUNK))
                    if not data:
                        break
                    dst.write(data)
                    left -= len(data)
        except OSError as e:
            log.error("could not save bytes %d..%d of %s to %s: %s", start, end, self.path,
                      keep, e)
            return None
        return keep

    # -- damaged ranges --------------------------------------------------------------------
    @property
    def damage_file(self) -> Path:
        return self.path.with_name(self.path.name + ".damaged")

    def load_damage(self) -> None:
        """Read the damaged ranges recorded for this segment (``<name>.damaged``)."""
        try:
            text = self.damage_file.read_text("utf-8")
        except FileNotFoundError:
            return
        except OSError as e:
            log.error("cannot read %s: %s", self.damage_file, e)
            return
        for line in text.splitlines():
            parts = line.split(" ", 2)
            try:
                a, b = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                log.error("ignoring a bad line in %s: %r", self.damage_file, line[:100])
                continue
            known = {(x, y) for x, y, _ in self.damaged}
            if self.start <= a < b <= self.end and (a, b) not in known:
                self.damaged.append((a, b, parts[2] if len(parts) > 2 else ""))
        self.damaged.sort()

    def add_damage(self, start: int, end: int, why: str) -> None:
        """Record that offsets ``[start, end)`` hold no valid message (kept on disk)."""
        if any(a <= start < b for a, b, _ in self.damaged):
            return
        self.damaged.append((start, end, why))
        self.damaged.sort()
        try:
            with open(self.damage_file, "a", encoding="utf-8") as f:
                f.write(f"{start} {end} {why}\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            log.error("cannot record damaged range %d..%d in %s: %s", start, end,
                      self.damage_file, e)

    def damage_at(self, offset: int) -> tuple[int, int, str] | None:
        for d in self.damaged:
            if d[0] <= offset < d[1]:
                return d
        return None

    def build_index(self) -> None:
        """Fill the sparse index of a sealed segment with a checked scan of it (the
        damaged ranges it meets are recorded and stepped over): every entry is a
        checked message start, never a position reached through damaged bytes."""
        self._scan_all(None)

    def valid_message_at(self, pos: int) -> int | None:
        """The end of the message starting at ``pos`` when it is whole and its checksum
        holds (read and checked here, one message), else None."""
        if pos < self.start or pos + HEADER_SIZE > self.end:
            return None
        fd = self.rfile.fileno()
        head = os.pread(fd, HEADER_SIZE, pos - self.start)
        length = HEADER.unpack(head)[0]
        nxt = pos + HEADER_SIZE + length
        if length < 0 or nxt > self.end or head == _ZEROS:
            return None
        body = os.pread(fd, length, pos + HEADER_SIZE - self.start)
        return nxt if scan_messages(head + body, max_payload=INT32_MAX)[1] == 1 else None

    def boundary_at_or_before(self, offset: int) -> int:
        """Start of the message holding ``offset`` (``offset`` itself at a boundary),
        or the next valid message start when the bytes there are corrupt; the
        segment end when nothing valid follows.

        The walk from the index entry before ``offset`` checks every message it
        passes and steps over the damaged ranges between (known ones at once, new
        ones recorded from where the valid messages stop), so it never walks a
        damaged message's length into intact messages."""
        known = self.damage_at(offset)
        if known is not None:
            return known[1]
        if not self.indexed:
            self.build_index()
            known = self.damage_at(offset)
            if known is not None:
                return known[1]
        i = bisect.bisect_right(self.index, offset) - 1
        pos = self.index[max(i, 0)]
        for _a, b, _why in self.damaged:  # known damage between the entry and offset
            if pos < b <= offset:
                pos = b
        fd = self.rfile.fileno()
        while True:
            while pos < offset:  # whole, checked messages up to offset
                chunk = os.pread(fd, min(offset - pos, _SCAN_CHUNK), pos - self.start)
                if not chunk:
                    break
                view = memoryview(chunk)
                valid = scan_messages(view, max_payload=INT32_MAX)[0]
                hole = _hole(chunk, view, valid)
                pos += valid if hole is None else hole[0]
                if valid < len(chunk) or hole is not None:
                    break
            # the message at pos holds offset, is longer than a chunk, or is damaged
            nxt = self.valid_message_at(pos)
            if nxt is not None:
                if nxt > offset:
                    return pos
                pos = nxt
                continue
            good = self._resync(pos)  # damaged bytes from pos, the last checked boundary
            if good > pos:  # found by a reader (a sealed segment is not scanned at start)
                self.add_damage(pos, good, "found while looking for a valid offset")
            if good > offset:
                return good
            pos = good  # intact messages after the damage: on to offset

    def build_time_index(self) -> TimeIndex:
        """Rebuild the time index (and the boundary index) of a sealed segment with a
        checked scan, resuming after damaged bytes; blocking.  The caller saves it."""
        tindex = TimeIndex()
        self._scan_all(tindex)
        self.tindex = tindex
        tindex.last_time = last_message_time(self)
        return tindex

    def _scan_all(self, tindex: TimeIndex | None) -> None:
        """Checked scan of the whole (sealed) segment: the boundary index (and
        ``tindex``) over its valid messages, each damaged range recorded and
        stepped over to where valid messages run again."""
        index = [self.start]
        pos = 0
        while pos < self.size:
            stop, _n, problem = self._scan_from(pos, index, tindex)
            if stop >= self.size:
                break
            nxt = self._chain_start(stop + 1)
            end = self.size if nxt is None else nxt
            self.add_damage(self.start + stop, self.start + end,
                            problem or "a message cut short inside a sealed segment")
            if nxt is None:
                break
            pos = nxt
        self.index, self.indexed = index, True

    def next_valid(self, pos: int) -> int:
        """The first valid message start after ``pos`` (absolute), or the segment end."""
        return self._resync(pos + 1)

    def _resync(self, pos: int) -> int:
        """First offset >= pos where a valid message with a payload starts
        (:meth:`_anchor`); the segment end when there is none."""
        anchor = self._anchor(pos - self.start)
        return self.end if anchor is None else self.start + anchor


def _zero_header(buf: bytes | memoryview, at: int) -> bool:
    """Twenty zero bytes: a hole or preallocated space, never a message (a real one
    has a non-zero msgId), though its empty payload's checksum (0) would match."""
    return buf[at:at + HEADER_SIZE] == _ZEROS


_ZEROS = bytes(HEADER_SIZE)


def check_messages(data: bytes | memoryview, view: memoryview | None = None,
                   max_payload: int = INT32_MAX) -> tuple[int, int, str | None]:
    """:func:`~metaq.protocol.scan_messages` of ``data`` (C when built: no Python
    loop per message), where an all-zero header also ends the valid messages (a
    hole, :func:`_zero_header`): ``(valid bytes, messages, problem or None)``;
    problem None when the rest is empty or one message cut short."""
    if view is None:
        view = memoryview(data)
    valid, n, problem = scan_messages(view, max_payload=max_payload)
    hole = _hole(data, view, valid)
    if hole is not None:
        valid, n = hole
        problem = "an all-zero message header"
    return valid, n, problem


def _hole(chunk: bytes, view: memoryview, valid: int) -> tuple[int, int] | None:
    """The first all-zero header among the (whole, checked) messages of
    ``chunk[:valid]``: ``(its position, messages before it)``, or None.

    Only where twenty zero bytes in a row are found (a memchr-speed search) is the
    position compared with the message boundaries (found by :func:`scan_messages`
    from the last boundary known); when such runs are common (zero-filled bodies),
    the rest of the chunk's headers are simply walked."""
    b = k = 0  # a message boundary, and how many messages start before it
    h = chunk.find(_ZEROS, 0, valid)
    misses = 0
    while h >= 0:
        if misses == _HOLE_SEARCH_MISSES:
            while b < valid:
                if _zero_header(view, b):
                    return b, k
                b += HEADER_SIZE + HEADER.unpack_from(view, b)[0]
                k += 1
            return None
        v, n, _problem = scan_messages(view[b:h], max_payload=INT32_MAX)
        b += v
        k += n
        if b == h:
            return h, k
        b += HEADER_SIZE + HEADER.unpack_from(view, b)[0]  # past the message holding h
        k += 1
        misses += 1
        h = chunk.find(_ZEROS, b, valid)
    return None


#: Runs of zero bytes inside messages :func:`_hole` looks past before it walks the headers.
_HOLE_SEARCH_MISSES = 16


def _index_starts(view: memoryview, valid: int, at: int, index: list[int],
                  tindex: TimeIndex | None = None, *, verify: bool = True) -> None:
    """Extend the sparse ``index`` over the (whole, checked) messages of
    ``view[:valid]`` (at absolute offset ``at``, a message start): each entry is the
    first message start at least :data:`INDEX_STEP` bytes past the one before.
    ``tindex`` gets an entry at each of them (and at ``at`` when it has none
    within a step).

    :func:`~metaq.protocol.scan` of the bytes up to that point (checking their CRCs
    again unless ``verify`` is False) gives the last boundary before it, one header
    the next one."""
    if tindex is not None and valid and (
            not tindex.offsets or at - tindex.offsets[-1] >= INDEX_STEP):
        tindex.add(at, time_of(view, 0))
    b = 0
    while True:
        t = index[-1] + INDEX_STEP - at
        if t > b:
            if t >= valid:
                return
            b += scan(view[b:t], verify, INT32_MAX, False)[2]
            if b < t:  # the message at b holds t: the next start follows it
                b += HEADER_SIZE + HEADER.unpack_from(view, b)[0]
        if b >= valid:
            return
        index.append(at + b)
        if tindex is not None:
            tindex.add(at + b, time_of(view, b))


def check_contiguous(segments: list[Segment], where: Path) -> None:
    """Raise StorageError unless each segment ends where the next starts."""
    for a, b in zip(segments, segments[1:], strict=False):
        if a.end != b.start:
            raise StorageError(
                f"log {where} is inconsistent: {a.path.name} holds {a.size} bytes so it ends at "
                f"offset {a.end}, but the next segment {b.path.name} starts at {b.start}")
