"""The broker's message store (reference section 7).

``<data_dir>/<topic>-<partition>/<20-digit start offset>.meta``: offsets are
absolute byte positions in the partition's log; a new segment starts once the
current one reaches ``max_segment_size``; only the last segment is written and
it is recovered at open (checksums scanned, cut at the first torn or corrupt
message).  fsyncs run on a small thread pool: after ``unflush_threshold``
messages, every ``unflush_interval`` (driven by the broker), or for group
commit (threshold 0) once per batch of puts, coalescing every put that arrived
while the previous fsync ran.  Retention deletes whole old segments.

A slave keeps a byte-for-byte copy of its master's logs (issue 26):
:meth:`PartitionLog.append_copy` appends the master's bytes at the same offsets
(checked first, all or nothing), :meth:`PartitionLog.truncate` cuts a log back to
a message boundary (an old master rejoining as a slave drops what the new master
never had) and :meth:`PartitionLog.reset` starts an empty log at any offset.

Everything except the fsync jobs runs on one thread (the broker's event loop,
or the caller's thread when used without a loop).
"""

from __future__ import annotations

import asyncio
import bisect
import fcntl
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from metaq._durable import fsync_dir
from metaq._errors import ProtocolError, ReplicaDivergedError, StorageError
from metaq.broker import _timeindex as timeindex
from metaq.broker._segment import (
    Segment,
    check_contiguous,
    check_messages,
    parse_segment_name,
    segment_name,
)
from metaq.protocol import MAX_PAYLOAD, check_topic, scan

__all__ = ["Storage", "PartitionLog", "LogSlice"]

log = logging.getLogger(__name__)

#: :meth:`PartitionLog.recent` keeps an append of at most this many bytes: a lone put's
#: (what a synchronous slave waits for), never a batch's, so that a broker of many
#: partitions holds at most this much per partition (a batch's copy is read from the file).
_RECENT_MAX = 8 * 1024


class LogSlice(NamedTuple):
    """``length`` bytes of the log at ``position`` of ``file`` (for ``os.sendfile``).

    Use ``with log.pinned(slice)`` (or :meth:`PartitionLog.pin`) around an
    asynchronous send so retention does not close the file meanwhile.
    """

    file: object
    position: int
    length: int
    segment: Segment


def _fsync_job(sealed: list[int], fd: int | None, dir_path: Path | None) -> None:
    """Run on a flush thread: fsync and close sealed segments, fsync the live one."""
    for sfd in sealed:
        try:
            os.fsync(sfd)
        finally:
            os.close(sfd)
    if fd is not None:
        os.fsync(fd)
    if dir_path is not None:
        fsync_dir(dir_path)


class PartitionLog:
    """The log of one partition of one topic."""

    def __init__(self, storage: Storage, topic: str, partition: int) -> None:
        self.storage = storage
        self.topic = topic
        self.partition = partition
        self.dir = storage.data_dir / f"{topic}-{partition}"
        self.closed = False          # closed partition: puts and gets answer 403
        self.unflushed = 0           # messages written since the last fsync started
        self.messages_appended = 0
        #: the last :meth:`append` (start offset, its bytes) while it is small and
        #: nothing else changed the log (:meth:`recent`)
        self._last: tuple[int, bytes] | None = None
        self.last_flush = time.monotonic()
        self._sealed: list[int] = []   # write fds of rolled segments, to fsync and close
        self._dir_dirty = False
        self._inflight: Future | None = None         # running fsync job
        self._inflight_target = 0                     # the end it makes durable
        self._waiters: asyncio.Future | None = None  # resolved when the running job ends
        self._next: asyncio.Future | None = None     # for puts written while it runs
        self._want_flush = False
        self._retired: list[Segment] = []
        self.segments: list[Segment] = []
        self._starts: list[int] = []
        #: a master's high watermark (``_replicas``): consumers' gets read below it only
        #: (what every in-sync slave holds); None: no cap
        self.high_watermark: int | None = None
        #: called (with this log) when :attr:`readable_end` moves, while someone waits
        #: for it (the broker's held gets); None otherwise
        self.on_readable: Callable[[PartitionLog], None] | None = None
        #: called when an fsync of this log starts (the idempotent producers' table
        #: fsyncs its journal with the log: ``_producers``); None otherwise
        self.on_flush: Callable[[], None] | None = None
        self._open()
        self.durable_end = self.end

    # -- open / recovery -------------------------------------------------------------------
    def _open(self) -> None:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            names = os.listdir(self.dir)
        except OSError as e:
            raise StorageError(f"cannot open log directory {self.dir}: {e}") from e
        starts = []
        for name in names:
            start = parse_segment_name(name)
            if start is None:
                if ".meta.cut-" not in name and not name.endswith(_KNOWN_SUFFIXES):
                    log.warning("ignoring stray file %s in %s", name, self.dir)
                continue
            starts.append(start)
        starts.sort()
        if not starts:
            starts = [0]
            self._dir_dirty = True
        try:
            for i, start in enumerate(starts):
                last = i == len(starts) - 1
                seg = Segment(self.dir / segment_name(start), start, writable=last)
                self.segments.append(seg)
                seg.load_damage()
                if not last:
                    seg.tindex = timeindex.load(seg)
            check_contiguous(self.segments, self.dir)
            kept, cut = self.segments[-1].recover()
            if cut or kept:
                log.info("opened %s: offsets %d..%d, %d messages in the writable segment",
                         self.dir, self.min_offset, self.end, kept)
            os.fsync(self.segments[-1].wfd)
        except OSError as e:
            self._close_files()
            raise StorageError(f"cannot open log {self.dir}: {e}") from e
        except BaseException:
            self._close_files()
            raise
        self._starts = [s.start for s in self.segments]

    # -- offsets ---------------------------------------------------------------------------
    @property
    def min_offset(self) -> int:
        """Offset of the first byte still stored."""
        return self.segments[0].start

    @property
    def end(self) -> int:
        """Offset right after the last message written (``max_offset``)."""
        return self.segments[-1].end

    max_offset = end

    @property
    def damaged(self) -> list[tuple[int, int, str]]:
        """Every known damaged range ``(start, end, why)`` of the log, in offset order."""
        return [d for seg in self.segments for d in seg.damaged]

    @property
    def readable_end(self) -> int:
        """End of what ``get`` may serve: with group commit only fsynced messages."""
        return self.durable_end if self.storage.unflush_threshold == 0 else self.end

    # -- writing ---------------------------------------------------------------------------
    def append(self, data: bytes, count: int) -> int:
        """Append ``count`` whole messages in one write; return the offset of the first.

        Rolls to a new segment first when the current one would pass
        ``max_segment_size``.  Raises StorageError (nothing written) on failure.
        """
        if self.closed:
            raise StorageError(f"partition {self.topic}-{self.partition} is closed")
        seg = self.segments[-1]
        if seg.size and seg.size + len(data) > self.storage.max_segment_size:
            seg = self._roll()
        start = seg.end
        self._last = None
        seg.write(data)
        if len(data) <= _RECENT_MAX:
            self._last = (start, data)
        self.unflushed += count
        self.messages_appended += count
        threshold = self.storage.unflush_threshold
        if threshold:
            if self.unflushed >= threshold:
                self.flush_soon()
            if self.on_readable is not None:
                self.on_readable(self)
        return start

    def recent(self, offset: int, length: int) -> bytes | None:
        """The log's bytes ``[offset, offset + length)`` from memory when they are
        exactly the last :meth:`append` (a lone put's slave asks for just those, right
        after it: no read of the file), else None."""
        last = self._last
        if last is not None and last[0] == offset and len(last[1]) == length:
            return last[1]
        return None

    def append_copy(self, data: bytes, at: int) -> tuple[int, int]:
        """Append the whole messages at the start of ``data``, bytes a master served
        from its offset ``at`` (a ``get`` reply), at the same offsets: a slave's copy.
        Returns ``(bytes appended, messages appended)``.

        A trailing partial message (a ``get`` reply may end in one) is not appended
        and is no error: the next copy starts with it; ``(0, 0)`` when ``data`` does
        not hold one whole message (ask the master for more bytes).

        All or nothing: every message is checked before anything is written (a
        length the protocol allows, ``CRC32(payload) & 0x7FFFFFFF`` equal to the
        header's checksum, no all-zero header), in one C scan when the speedups are
        built; a bad one raises :class:`~metaq.ReplicaDivergedError` naming the
        topic, partition, its offset (``.offset``) and what is wrong, and nothing of
        the call is written, the good messages before it neither (the log still ends
        at ``at``; the caller can copy ``data[:err.offset - at]`` if it wants them).
        ``at`` other than :attr:`end` raises it too (``.offset`` is ``at``).

        Written like :meth:`append` (its rolls, ``unflush_threshold``, flushes and
        :attr:`on_readable`): where a segment would pass ``max_segment_size`` the
        bytes are split at a message boundary, so segments roll where this log's own
        size says (maybe not where the master's did); offsets are the master's.  A
        write that fails raises StorageError with the pieces before it kept (the log
        then ends at :attr:`end`, always at a message boundary).  With group commit
        (``unflush_threshold`` 0) what is copied becomes readable once fsynced: the
        caller asks for it (:meth:`request_flush`), as the put step does.
        """
        self._last = None
        if self.closed:
            raise StorageError(f"partition {self.topic}-{self.partition} is closed: the copy "
                               f"of the bytes served from offset {at} is refused")
        if at != self.end:
            raise ReplicaDivergedError(
                f"copy of {self.topic}-{self.partition}: bytes served from offset {at}, but "
                f"this log ends at offset {self.end}: nothing written",
                topic=self.topic, partition=self.partition, offset=at)
        if type(data) is not bytes:
            data = bytes(data)
        valid, count, problem = check_messages(data, None, MAX_PAYLOAD)
        if problem is not None:
            bad = at + valid
            raise ReplicaDivergedError(
                f"copy of {self.topic}-{self.partition}: bad message at offset {bad}: "
                f"{problem}; nothing of the {len(data)} bytes served from offset {at} "
                f"written", topic=self.topic, partition=self.partition, offset=bad)
        if not count:
            return 0, 0
        room = self.storage.max_segment_size - self.segments[-1].size
        if valid <= room:
            self.append(data if valid == len(data) else data[:valid], count)
            return valid, count
        # split where segments fill up: the message starts (an int32 array, from C)
        starts = memoryview(scan(data[:valid], False, MAX_PAYLOAD, True)[0]).cast("i")
        done = k = 0  # bytes and messages written
        max_size = self.storage.max_segment_size
        while done < valid:
            room = max_size - self.segments[-1].size
            # the last start with the messages before it fitting in room; at least one
            j = bisect.bisect_right(starts, done + room, k + 1, count + 1) - 1
            if j == k:
                j = k + 1  # one message bigger than the room: append rolls first
            end = starts[j]
            self.append(data[done:end], j - k)
            done, k = end, j
        return valid, count

    def _roll(self) -> Segment:
        old = self.segments[-1]
        new = Segment(self.dir / segment_name(old.end), old.end, writable=True)
        fd = old.seal()
        timeindex.save(old)
        if fd is not None:
            self._sealed.append(fd)
        self._dir_dirty = True
        self.segments.append(new)
        self._starts.append(new.start)
        log.info("rolled %s to a new segment %s", self.dir, new.path.name)
        return new

    # -- flushing --------------------------------------------------------------------------
    def _submit_flush(self) -> tuple[Future, int]:
        sealed, self._sealed = self._sealed, []
        dir_path = self.dir if self._dir_dirty else None
        self._dir_dirty = False
        target = self.end
        self.unflushed = 0
        self.last_flush = time.monotonic()
        if self.on_flush is not None:  # hook: the producer table's journal (_producers)
            self.on_flush()
        cf = self.storage.executor.submit(_fsync_job, sealed, self.segments[-1].wfd, dir_path)
        return cf, target

    def request_flush(self) -> asyncio.Future:
        """(In the event loop) a future done once everything written so far is on disk.

        Every caller between two fsyncs shares one: this is group commit.
        """
        loop = asyncio.get_running_loop()
        if self._inflight is None:
            waiters = loop.create_future()
            self._start(waiters)
            return waiters
        if self._next is None:
            self._next = loop.create_future()
        return self._next

    def _start(self, waiters: asyncio.Future) -> None:
        cf, target = self._submit_flush()
        self._inflight = cf
        self._inflight_target = target
        self._waiters = waiters
        loop = asyncio.get_running_loop()
        cf.add_done_callback(
            lambda f: loop.call_soon_threadsafe(self._flush_done, f, target))

    def _flush_done(self, cf: Future, target: int) -> None:
        if self._inflight is not cf:  # closed meanwhile: close() already waited for it
            return
        waiters, self._waiters, self._inflight = self._waiters, None, None
        err = cf.exception()
        if err is None:
            self._advance_durable(target)
            if waiters is not None and not waiters.done():
                waiters.set_result(target)
        else:
            self.storage.flush_errors += 1
            log.error("fsync of %s failed: %s", self.dir, err)
            if waiters is not None and not waiters.done():
                waiters.set_exception(StorageError(f"fsync of {self.dir} failed: {err}"))
                waiters.exception()  # retrieved here; puts waiting on it see it too
        nxt, self._next = self._next, None
        if nxt is not None:
            self._start(nxt)
        elif self._want_flush and (self.unflushed or self._sealed):
            self.flush_soon()
        self._want_flush = False
        self._reap_retired()

    def flush_soon(self) -> None:
        """Start an fsync without waiting for it (threshold and interval flushes)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if self._inflight is not None:
            self._want_flush = True
            return
        fut = self.request_flush()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def flush(self) -> None:
        """fsync everything written so far, blocking (outside the event loop)."""
        if self._inflight is not None:
            self._inflight.result()
        cf, target = self._submit_flush()
        try:
            cf.result()
        except OSError as e:
            self.storage.flush_errors += 1
            raise StorageError(f"fsync of {self.dir} failed: {e}") from e
        self._advance_durable(target)

    def _advance_durable(self, target: int) -> None:
        if target > self.durable_end:
            self.durable_end = target
            if self.on_readable is not None and self.storage.unflush_threshold == 0:
                self.on_readable(self)

    def needs_flush(self, now: float, interval: float) -> bool:
        return bool(self.unflushed or self._sealed) and now - self.last_flush >= interval

    # -- reading ---------------------------------------------------------------------------
    def _segment_for(self, offset: int) -> Segment | None:
        if offset < self.min_offset or offset >= self.end:
            return None
        return self.segments[bisect.bisect_right(self._starts, offset) - 1]

    def read(self, offset: int, max_size: int) -> LogSlice | None:
        """Up to ``max_size`` bytes from ``offset`` (within one segment, never past
        :attr:`readable_end`, and ending where a known damaged range begins), or None
        when ``offset`` is outside ``[min, readable_end)``."""
        end = self.readable_end
        if offset >= end:
            return None
        seg = self._segment_for(offset)
        if seg is None:
            return None
        length = min(max_size, seg.end - offset, end - offset)
        if seg.damaged:
            for a, _b, _why in seg.damaged:
                if offset < a < offset + length:
                    length = a - offset
                    break
        return LogSlice(seg.rfile, offset - seg.start, length, seg)

    def damage_at(self, offset: int) -> tuple[int, int, str] | None:
        """The known damaged range holding ``offset``, if any."""
        seg = self._segment_for(offset)
        return None if seg is None or not seg.damaged else seg.damage_at(offset)

    def read_bytes(self, offset: int, max_size: int) -> bytes:
        """Like :meth:`read` but returns the bytes (empty when nothing is there)."""
        s = self.read(offset, max_size)
        if s is None:
            return b""
        return s.segment.pread(offset, s.length)

    @staticmethod
    def pin(s: LogSlice) -> None:
        s.segment.pins += 1

    def unpin(self, s: LogSlice) -> None:
        s.segment.pins -= 1
        if s.segment.retired and s.segment.pins <= 0:
            self._reap_retired()

    def nearest_valid_offset(self, offset: int) -> int:
        """The message boundary to resume from for ``offset`` (the ``offset`` command).

        Below the log: the start; at or past the end: the end; inside: the start
        of the message holding ``offset``, or, if the bytes there are corrupt,
        the next offset where a valid message starts.  May read the segment.
        """
        if offset <= self.min_offset:
            return self.min_offset
        if offset >= self.end:
            return self.end
        seg = self._segment_for(offset)
        assert seg is not None
        return seg.boundary_at_or_before(offset)

    # -- time --------------------------------------------------------------------------------
    def offset_for_time(self, when_ms: int) -> tuple[int, int]:
        """``(offset, time)`` of the first message whose msgId time is at or after
        ``when_ms``, or ``(end, -1)`` (``_timeindex.find``).  Blocking (reads the
        segments, builds a sealed segment's missing index and saves it): run it off
        the event loop with the segments pinned (:meth:`pin_all`)."""
        segments = list(self.segments)
        built = [s for s in segments if s.tindex is None]
        found = timeindex.find(segments, self.end, when_ms)
        for seg in built:
            if seg.tindex is not None and seg is not segments[-1]:
                timeindex.save(seg)
        return found

    def last_time(self) -> int | None:
        """The greatest msgId time in the writable segment (where the latest are), or
        in the newest segment that has a message; None for an empty log."""
        for seg in reversed(self.segments):
            ti = seg.tindex if seg.tindex is not None else seg.build_time_index()
            t = ti.last_time if ti.last_time is not None else timeindex.last_message_time(seg)
            if t is not None:
                return t
        return None

    def pin_all(self) -> list[Segment]:
        """Pin every segment (retention closes none of them) until :meth:`unpin_all`."""
        segments = list(self.segments)
        for seg in segments:
            seg.pins += 1
        return segments

    def unpin_all(self, segments: list[Segment]) -> None:
        for seg in segments:
            seg.pins -= 1
        if any(seg.retired for seg in segments):
            self._reap_retired()

    # -- retention -------------------------------------------------------------------------
    def delete_older_than(self, cutoff: float) -> list[Path]:
        """Delete whole segments last modified before ``cutoff`` (epoch seconds), oldest
        first and never the writable one; return the deleted paths."""
        deleted = []
        while len(self.segments) > 1:
            seg = self.segments[0]
            try:
                mtime = os.stat(seg.path).st_mtime
            except FileNotFoundError:
                mtime = 0.0
            if mtime >= cutoff:
                break
            try:
                seg.path.unlink(missing_ok=True)
            except OSError as e:
                log.error("retention could not delete %s: %s", seg.path, e)
                break
            try:
                timeindex.path_for(seg.path).unlink(missing_ok=True)
            except OSError as e:
                log.warning("retention could not delete the time index of %s: %s",
                            seg.path, e)
            self.segments.pop(0)
            self._starts.pop(0)
            seg.retired = True
            self._retired.append(seg)
            deleted.append(seg.path)
            log.info("retention deleted %s (offsets %d..%d)", seg.path, seg.start, seg.end)
        self._reap_retired()
        return deleted

    # -- cutting back (a slave's log) -------------------------------------------------------
    def truncate(self, offset: int) -> tuple[int, int]:
        """Cut the log back to ``offset``: a message boundary in ``[min_offset, end]``
        (else StorageError naming it); ``(bytes removed, messages removed)``.  What an
        old master drops when it rejoins as a slave: what the new master never had.

        Later segments are deleted whole, the one holding ``offset`` is cut there and
        becomes the writable one; the boundary and time indexes and the damaged ranges
        lose what lay past ``offset``; files and directory are fsynced before it returns
        (so :attr:`durable_end` is the new end; ``offset == end`` cuts nothing and
        fsyncs what is pending).  Blocking, on the event loop thread:
        it waits for an fsync in flight (and completes it, answering its group
        commits) rather than refusing, reads the cut part to count its messages, and
        finding the boundary may scan a sealed segment.

        Readers holding pinned slices (a ``sendfile`` in progress, a time lookup) keep
        reading the bytes they pinned: a deleted segment stays open until unpinned, and
        a pinned segment is cut by writing what is kept to a new file renamed over it
        (the old file, unlinked, stays open for them) instead of in place.
        """
        self._last = None
        end = self.end
        if offset == end:  # nothing to cut; durable all the same
            self._settle_flushes()
            self.flush()
            return 0, 0
        where = f"{self.topic}-{self.partition}"
        if not self.min_offset <= offset < end:
            raise StorageError(f"cannot truncate {where} to offset {offset}: outside the log "
                               f"[{self.min_offset}, {end}]")
        i = bisect.bisect_right(self._starts, offset) - 1
        if offset == self.segments[i].start and i > 0:
            i -= 1  # cut at a segment start: the one before ends there, whole
        seg = self.segments[i]
        if offset < seg.end:
            known = seg.damage_at(offset)
            ok = (known[0] == offset) if known is not None else (
                seg.boundary_at_or_before(offset) == offset)
            if not ok:
                raise StorageError(f"cannot truncate {where} to offset {offset}: not a message "
                                   f"boundary (a message or damaged range runs across it)")
        self._settle_flushes()
        messages = seg.count_messages(offset) if offset < seg.end else 0
        for later in self.segments[i + 1:]:
            messages += later.count_messages(later.start)
        try:
            if self._sealed:  # rolled since the last fsync: kept ones must be durable
                _fsync_job(self._sealed, None, None)
        except OSError as e:
            raise StorageError(f"fsync of {self.dir} failed: {e}") from e
        finally:
            self._sealed = []
        try:
            for later in self.segments[i + 1:]:
                self._delete_segment(later)
            del self.segments[i + 1:]
            del self._starts[i + 1:]
            self.segments[i] = self._cut(seg, offset)
            os.fsync(self.segments[i].wfd)
            fsync_dir(self.dir)
        except OSError as e:
            raise StorageError(f"cannot truncate {where} to offset {offset}: {e}") from e
        finally:
            self._reap_retired()
        self._now_durable()
        log.warning("truncated %s from offset %d to %d: %d bytes, %d messages removed",
                    self.dir, end, offset, end - offset, messages)
        return end - offset, messages

    def reset(self, start: int) -> None:
        """Drop every segment and start an empty log whose first segment starts at
        ``start`` (``<start>.meta``, kept across restarts): a new slave whose master's
        log begins above 0 after retention, or one whose log lies wholly below the
        master's start.  Fsynced before it returns; blocking like :meth:`truncate`
        (pinned readers keep their deleted segments until unpinned)."""
        self._last = None
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise StorageError(f"cannot reset {self.topic}-{self.partition} to offset "
                               f"{start!r}: a start is an int >= 0")
        self._settle_flushes()
        sealed, self._sealed = self._sealed, []
        for fd in sealed:  # the segments they write are deleted: nothing to fsync
            os.close(fd)
        old = (self.min_offset, self.end)
        try:
            for seg in self.segments:
                self._delete_segment(seg)
            self.segments = []
            self._starts = []
            seg = Segment(self.dir / segment_name(start), start, writable=True)
            if seg.size:  # a stray leftover of the name: the log starts empty
                os.ftruncate(seg.wfd, 0)
                seg.size = 0
                seg.tindex = timeindex.TimeIndex()
            seg.indexed = True
            self.segments = [seg]
            self._starts = [start]
            os.fsync(seg.wfd)
            fsync_dir(self.dir)
        except OSError as e:
            raise StorageError(f"cannot reset {self.topic}-{self.partition} to offset "
                               f"{start}: {e}") from e
        finally:
            self._reap_retired()
        self.durable_end = start
        self._now_durable()
        log.warning("reset %s (offsets %d..%d) to an empty log starting at offset %d",
                    self.dir, old[0], old[1], start)

    def _settle_flushes(self) -> None:
        """Wait for the fsync in flight (and any it starts for puts that waited) and
        complete it here, so no job of the log as it was lands after a cut."""
        while self._inflight is not None:
            cf = self._inflight
            try:
                cf.result()
            except OSError:
                pass  # reported by _flush_done
            self._flush_done(cf, self._inflight_target)

    def _now_durable(self) -> None:
        """Everything is on disk (after a cut): no flush is due."""
        self.unflushed = 0
        self._dir_dirty = False
        self.last_flush = time.monotonic()
        grew = self.end > self.durable_end
        self.durable_end = self.end
        if grew and self.on_readable is not None and self.storage.unflush_threshold == 0:
            self.on_readable(self)

    def _delete_segment(self, seg: Segment) -> None:
        """Unlink ``seg`` and the files beside it; its file stays open (retired) until
        no reader holds it."""
        for path in (seg.path, timeindex.path_for(seg.path), seg.damage_file):
            path.unlink(missing_ok=True)
        if seg.wfd is not None:
            os.close(seg.wfd)
            seg.wfd = None
        seg.retired = True
        self._retired.append(seg)

    def _cut(self, seg: Segment, offset: int) -> Segment:
        """``seg`` cut at ``offset`` (<= its end) as the writable segment: a new
        :class:`Segment` of the same file (the old object is retired); in place unless
        a reader has it pinned (then the kept bytes are copied to a new file renamed
        over it)."""
        keep = offset - seg.start
        if seg.pins > 0 and keep < seg.size:
            tmp = seg.path.with_name(seg.path.name + ".truncating")
            with open(tmp, "wb") as f:
                pos = 0
                while pos < keep:
                    chunk = seg.pread(seg.start + pos, min(keep - pos, 8 << 20))
                    if not chunk:
                        raise OSError(f"{seg.path} ends at {pos} bytes, before {keep}")
                    f.write(chunk)
                    pos += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, seg.path)
        elif keep < seg.size:
            fd = os.open(seg.path, os.O_WRONLY)
            try:
                os.ftruncate(fd, keep)
            finally:
                os.close(fd)
        if seg.wfd is not None:
            os.close(seg.wfd)
            seg.wfd = None
        timeindex.path_for(seg.path).unlink(missing_ok=True)  # a writable one has none
        seg.retired = True
        self._retired.append(seg)
        new = Segment(seg.path, seg.start, writable=True)
        if new.size != keep:
            raise OSError(f"{seg.path} holds {new.size} bytes after the cut, not {keep}")
        damaged = [(a, b, why) for a, b, why in seg.damaged if a < offset]
        if damaged != seg.damaged:
            self._rewrite_damage(new, damaged)
        new.damaged = damaged
        if seg.tindex is None:  # not loaded: rebuild both indexes with a checked scan
            new.recover()
        else:
            new.index = [b for b in seg.index if b < offset] or [seg.start]
            new.indexed = seg.indexed
            ti = timeindex.TimeIndex()
            for o, t in zip(seg.tindex.offsets, seg.tindex.times, strict=False):
                if o < offset:
                    ti.add(o, t)
            new.tindex = ti
        return new

    @staticmethod
    def _rewrite_damage(seg: Segment, damaged: list[tuple[int, int, str]]) -> None:
        """Replace ``seg``'s damage file with ``damaged`` (atomically, fsynced)."""
        path = seg.damage_file
        if not damaged:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(path.name + ".new")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(f"{a} {b} {why}\n" for a, b, why in damaged)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _reap_retired(self) -> None:
        keep = []
        for seg in self._retired:
            if seg.pins > 0:
                keep.append(seg)
            else:
                seg.rfile.close()
        self._retired = keep

    # -- closing ---------------------------------------------------------------------------
    def _close_files(self) -> None:
        for seg in self.segments + self._retired:
            try:
                seg.close()
            except OSError:
                log.exception("closing %s", seg.path)
        self._retired = []

    def close(self) -> None:
        """fsync what is pending (blocking), answer waiting group commits, close files."""
        error: Exception | None = None
        try:
            if self._inflight is not None:
                try:
                    self._inflight.result()
                except OSError as e:
                    error = e
                self._inflight = None
            try:
                _fsync_job(self._sealed, self.segments[-1].wfd,
                           self.dir if self._dir_dirty else None)
                self.durable_end = self.end
            except OSError as e:
                error = e
                log.error("final fsync of %s failed: %s", self.dir, e)
            self._sealed = []
            for fut in (self._waiters, self._next):
                if fut is not None and not fut.done():
                    if error is None:
                        fut.set_result(self.durable_end)
                    else:
                        fut.set_exception(StorageError(f"fsync of {self.dir} failed: {error}"))
                        fut.exception()
            self._waiters = self._next = None
        finally:
            self._close_files()


#: Files beside the segments that are the broker's own (not stray).
_KNOWN_SUFFIXES = (".meta.damaged", timeindex.SUFFIX,
                   "producers.jnl", "producers.jnl.tmp")  # the producer table (_producers)


class Storage:
    """Every partition log of a broker under one data directory (locked while open)."""

    def __init__(self, data_dir: str | Path, *, max_segment_size: int = 1024 ** 3,
                 unflush_threshold: int = 1000, flush_threads: int = 2) -> None:
        self.data_dir = Path(data_dir)
        self.max_segment_size = max_segment_size
        self.unflush_threshold = unflush_threshold
        self.flush_errors = 0
        self._logs: dict[tuple[str, int], PartitionLog] = {}
        self.topics: dict[str, int] = {}
        #: the greatest msgId time found in the logs opened (epoch ms), None if none:
        #: the broker's msgIds continue after it (``_timeindex``, "The answer")
        self.last_time: int | None = None
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = os.open(self.data_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise StorageError(f"cannot use data directory {self.data_dir}: {e}") from e
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise StorageError(f"data directory {self.data_dir} is in use by another "
                               f"broker (lock on {self.data_dir / '.lock'})") from None
        self.executor = ThreadPoolExecutor(max_workers=flush_threads,
                                           thread_name_prefix="metaq-broker-flush")

    def open_topic(self, topic: str, partitions: int) -> list[PartitionLog]:
        """Open (creating if needed) partitions ``0..partitions-1`` of ``topic``;
        :attr:`last_time` covers them."""
        have = self.topics.get(topic, 0)
        for p in range(have, partitions):
            plog = self._logs[(topic, p)] = PartitionLog(self, topic, p)
            t = plog.last_time()
            if t is not None and (self.last_time is None or t > self.last_time):
                self.last_time = t
        self.topics[topic] = max(have, partitions)
        return [self._logs[(topic, p)] for p in range(self.topics[topic])]

    def on_disk(self) -> dict[str, int]:
        """The topics whose partition directories (``<topic>-<n>``) are in the data
        directory, with the partition count they imply (the greatest ``n`` + 1)."""
        found: dict[str, int] = {}
        try:
            names = os.listdir(self.data_dir)
        except OSError as e:
            raise StorageError(f"cannot list {self.data_dir}: {e}") from e
        for name in names:
            topic, sep, part = name.rpartition("-")
            if not sep or not part.isdigit() or not part.isascii() or \
                    not (self.data_dir / name).is_dir():
                continue
            try:
                check_topic(topic)
            except ProtocolError:
                continue
            found[topic] = max(found.get(topic, 0), int(part) + 1)
        return found

    def get(self, topic: str, partition: int) -> PartitionLog | None:
        return self._logs.get((topic, partition))

    def logs(self) -> list[PartitionLog]:
        return list(self._logs.values())

    def delete_expired(self, retention_seconds: float, now: float | None = None) -> list[Path]:
        cutoff = (time.time() if now is None else now) - retention_seconds
        deleted: list[Path] = []
        for plog in self._logs.values():
            deleted += plog.delete_older_than(cutoff)
        return deleted

    def flush_due(self, interval: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for plog in self._logs.values():
            if plog.needs_flush(now, interval):
                plog.flush_soon()

    def close(self) -> None:
        try:
            for plog in self._logs.values():
                plog.close()
        finally:
            self._logs.clear()
            self.executor.shutdown(wait=True)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            finally:
                os.close(self._lock_fd)

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
