"""The producer-state table of the idempotent producer: per partition, which runs of
which producer's sequence are stored where, so that a resent put is stored once.

A put run arrives after an ``idem <pid> <seq> <count>`` mark (``metaq.protocol``,
module ``_idempotence``).  Per partition, :class:`ProducerTable` keeps for each
producer id its recent runs (:class:`Run`: first seq, count, the log range, first and
last msgId) and the next seq it expects.  :meth:`ProducerTable.check` tells the put
step (``_puts.idem_group``) how many puts of a run are already stored (answered
with their original msgId and offset, :meth:`ProducerTable.originals`) and whether
the run jumps ahead (a gap: refused).

**Durability.**  A run's record (the bytes of ``_idempotence``'s producer record) is
appended to ``producers.jnl`` in the partition directory *before* the run's
messages are appended to the log (:meth:`ProducerTable.write`; taken back with
:meth:`ProducerTable.unwrite` when the append fails), and the journal is fsynced
whenever the log is (:meth:`ProducerTable.on_flush`, hooked into the log's flush;
with group commit the put replies also wait for it).  So after a kill -9 or a
power loss the table is never behind the acknowledged messages.  On open, the
records whose messages are not in the log (past its recovered end, or whose first
and last msgIds do not match what is at their offsets: the log was cut and written
again) are dropped, newest first, until one checks out, and the journal is
rewritten with what is kept; it is rewritten likewise once it grows past
``_COMPACT_AT`` bytes.

**Bounds.**  Per producer the runs covering its last ``keep_seqs`` seqs are kept
(at least one run); runs arriving back to back in the log merge (up to
``_MERGE_MAX`` messages).  A producer not heard from for ``expiry_s`` seconds is
forgotten, and beyond ``max_pids`` producers the least recently heard from is.  A
forgotten producer's next put is accepted whatever its seq.

**Replication.**  :meth:`ProducerTable.records_from` gives the records of the runs
starting at or after a log offset (what the ``producers`` command answers) and
:meth:`ProducerTable.apply` stores such records on another broker (a slave, so that
once promoted it still drops a resent put); :meth:`ProducerTable.truncate` forgets
the runs past a log offset (a slave cutting its log to its master's).

:class:`Producers` holds the tables of one storage, opened on first use.
"""

from __future__ import annotations

import array
import logging
import os
import time
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

from metaq._durable import fsync_dir
from metaq._errors import StorageError
from metaq.protocol import (
    HEADER,
    HEADER_SIZE,
    ProducerRecord,
    decode_producer_records,
    encode_producer_records,
)

if TYPE_CHECKING:
    from metaq.broker._storage import PartitionLog, Storage

__all__ = ["Producers", "ProducerTable", "Run", "JOURNAL_NAME"]

log = logging.getLogger(__name__)

#: The journal's file name in a partition directory.
JOURNAL_NAME = "producers.jnl"
#: Rewrite the journal with only the live runs once it is this big.
_COMPACT_AT = 4 * 1024 * 1024
#: Most messages (and bytes) one merged run may span.
_MERGE_MAX = 4096
_MERGE_BYTES = 4 * 1024 * 1024
_unpack_header = HEADER.unpack_from


class Run:
    """``count`` messages of one producer, seqs ``seq..``, stored as one range
    ``start..end`` of the log (``last_start``: where the last begins); ``ids`` and
    ``offsets``: each message's msgId and offset, read from the log when first
    needed (a resend of a message in its middle: rare), then kept."""

    __slots__ = ("seq", "count", "start", "end", "first_id", "last_start", "last_id",
                 "time_ms", "ids", "offsets")

    def __init__(self, seq: int, count: int, start: int, end: int, first_id: int,
                 last_start: int, last_id: int, time_ms: int,
                 ids: array.array | None = None, offsets: array.array | None = None) -> None:
        self.seq = seq
        self.count = count
        self.start = start
        self.end = end
        self.first_id = first_id
        self.last_start = last_start
        self.last_id = last_id
        self.time_ms = time_ms
        self.ids = ids
        self.offsets = offsets

    def record(self, pid: int) -> ProducerRecord:
        return ProducerRecord(pid, self.seq, self.count, self.start, self.end, self.first_id,
                              self.last_start, self.last_id, self.time_ms)


class _Producer:
    """One producer id's state in one partition."""

    __slots__ = ("runs", "next_seq", "kept", "last_ms")

    def __init__(self) -> None:
        self.runs: deque[Run] = deque()
        self.next_seq = 0
        self.kept = 0  # seqs covered by ``runs``
        self.last_ms = 0


class ProducerTable:
    """The producer table of one partition log (see the module docstring)."""

    def __init__(self, plog: PartitionLog, *, keep_seqs: int = 65536,
                 expiry_s: float = 7 * 86400.0, max_pids: int = 10000) -> None:
        self.plog = plog
        self.path = plog.dir / JOURNAL_NAME
        self.keep_seqs = keep_seqs
        self.expiry_ms = int(expiry_s * 1000)
        self.max_pids = max_pids
        self.pids: dict[int, _Producer] = {}
        self._fd: int | None = None
        self._size = 0
        self._before = 0  # journal size before the last write (for unwrite)
        self._dirty = False
        #: the last journal fsync started by :meth:`on_flush` (None when none runs)
        self.synced: Future | None = None
        self._adds = 0
        #: puts answered as resends of stored ones (a counter for ``stats``)
        self.duplicates = 0
        self._load()

    # -- open ------------------------------------------------------------------------------
    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError(f"cannot read {self.path}: {e}") from e
        records, used = decode_producer_records(data)
        if used != len(data):
            log.warning("%s: dropping %d damaged or torn bytes at its end", self.path,
                        len(data) - used)
        dropped = 0
        while records and not self._present(records[-1]):
            records.pop()
            dropped += 1
        if dropped:
            log.info("%s: dropped %d record(s) of messages not in the log (end %d)",
                     self.path, dropped, self.plog.end)
        for r in records:
            if r.start >= self.plog.min_offset:
                self._add(r.pid, Run(r.seq, r.count, r.start, r.end, r.first_id,
                                     r.last_start, r.last_id, r.time_ms))
        self.expire()
        self._rewrite()

    def _present(self, r: ProducerRecord) -> bool:
        """Whether record ``r``'s messages are in the log: its first and last msgIds at
        their offsets, the last one ending at its end."""
        plog = self.plog
        if r.end > plog.end or r.start < 0 or not r.start <= r.last_start < r.end:
            return False
        if r.start < plog.min_offset:
            return True  # deleted by retention: it was there
        first = self._header(r.start)
        last = self._header(r.last_start)
        return (first is not None and last is not None and first[2] == r.first_id
                and last[2] == r.last_id and r.last_start + HEADER_SIZE + last[0] == r.end)

    def _header(self, offset: int) -> tuple | None:
        data = self._read(offset, offset + HEADER_SIZE)
        return _unpack_header(data) if len(data) == HEADER_SIZE else None

    def _read(self, start: int, end: int) -> bytes:
        """The log's bytes ``start..end``, fsynced or not (fewer when they are not all
        there: deleted by retention, or past the end)."""
        out = []
        pos = start
        for seg in self.plog.segments:
            if pos >= end:
                break
            if seg.start <= pos < seg.end:
                chunk = seg.pread(pos, min(end, seg.end) - pos)
                if not chunk:
                    break
                out.append(chunk)
                pos += len(chunk)
        return b"".join(out)

    # -- the put step ----------------------------------------------------------------------
    def expected(self, pid: int) -> int | None:
        """The next seq expected from ``pid``; None for a producer not known here."""
        p = self.pids.get(pid)
        return None if p is None else p.next_seq

    def oldest(self, pid: int) -> int:
        """The first seq of ``pid`` whose place is still known."""
        p = self.pids.get(pid)
        return p.runs[0].seq if p is not None and p.runs else 0

    def originals(self, pid: int, seq: int, n: int) -> list[tuple[int, int] | None]:
        """``(msgId, offset)`` of seqs ``seq..seq + n - 1`` of ``pid`` (stored before);
        None for one older than the runs kept."""
        p = self.pids.get(pid)
        self.duplicates += n
        out: list[tuple[int, int] | None] = []
        runs = list(p.runs) if p is not None else []
        k = len(runs) - 1
        for s in range(seq, seq + n):
            while k >= 0 and runs[k].seq > s:
                k -= 1
            while 0 <= k < len(runs) - 1 and runs[k].seq + runs[k].count <= s:
                k += 1
            if k < 0 or not runs[k].seq <= s < runs[k].seq + runs[k].count:
                out.append(None)
                k = max(k, 0)
                continue
            run = runs[k]
            out.append(self._message(run, s - run.seq))
        return out

    def _message(self, run: Run, i: int) -> tuple[int, int] | None:
        if i == 0:
            return run.first_id, run.start
        if i == run.count - 1:
            return run.last_id, run.last_start
        if run.ids is None:
            data = self._read(run.start, run.end)
            if len(data) != run.end - run.start:
                return None  # no longer readable (retention)
            ids = array.array("q")
            offsets = array.array("q")
            pos = 0
            while pos < len(data) and len(ids) < run.count:
                length, _check, msg_id, _flag = _unpack_header(data, pos)
                ids.append(msg_id)
                offsets.append(run.start + pos)
                pos += HEADER_SIZE + length
            if len(ids) != run.count:
                return None
            run.ids, run.offsets = ids, offsets
        return run.ids[i], run.offsets[i]  # type: ignore[index]

    def write(self, record: ProducerRecord) -> None:
        """Journal ``record`` (before its messages are appended; raises StorageError)."""
        if self._fd is None:
            self._open_journal()
        data = encode_producer_records((record,))
        self._before = self._size
        try:
            os.write(self._fd, data)  # type: ignore[arg-type]
        except OSError as e:
            self._truncate_to(self._before)
            raise StorageError(f"cannot write {self.path}: {e}") from e
        self._size += len(data)
        self._dirty = True

    def unwrite(self) -> None:
        """Take back the record of the last :meth:`write` (its append failed)."""
        self._truncate_to(self._before)

    def stored(self, record: ProducerRecord) -> None:
        """The run of ``record`` is in the log: remember it (after :meth:`write`)."""
        r = record
        self._add(r.pid, Run(r.seq, r.count, r.start, r.end, r.first_id, r.last_start,
                             r.last_id, r.time_ms))
        self._adds += 1
        if self._adds % 1024 == 0:
            self.expire()
        if self._size > _COMPACT_AT:
            self._rewrite()

    def skip(self, pid: int, next_seq: int) -> None:
        """``pid``'s seqs before ``next_seq`` are done with (in memory only: a run that
        was partly refused)."""
        p = self.pids.get(pid)
        if p is None:
            p = self.pids[pid] = _Producer()
        p.next_seq = max(p.next_seq, next_seq)

    def _add(self, pid: int, run: Run) -> None:
        p = self.pids.get(pid)
        if p is None:
            p = self.pids[pid] = _Producer()
            if len(self.pids) > self.max_pids:
                self._forget_least_recent()
        runs = p.runs
        last = runs[-1] if runs else None
        if (last is not None and last.seq + last.count == run.seq and last.end == run.start
                and last.count + run.count <= _MERGE_MAX
                and run.end - last.start <= _MERGE_BYTES):
            last.ids = last.offsets = None
            last.count += run.count
            last.end = run.end
            last.last_start = run.last_start
            last.last_id = run.last_id
            last.time_ms = run.time_ms
        else:
            runs.append(run)
        p.kept += run.count
        p.next_seq = run.seq + run.count
        p.last_ms = max(p.last_ms, run.time_ms)
        while len(runs) > 1 and p.kept - runs[0].count >= self.keep_seqs:
            p.kept -= runs.popleft().count

    def _forget_least_recent(self) -> None:
        pid = min(self.pids, key=lambda k: self.pids[k].last_ms)
        del self.pids[pid]

    def expire(self, now_ms: int | None = None) -> int:
        """Forget the producers not heard from for ``expiry_s``; how many."""
        now = int(time.time() * 1000) if now_ms is None else now_ms
        old = [pid for pid, p in self.pids.items() if now - p.last_ms > self.expiry_ms]
        for pid in old:
            del self.pids[pid]
        return len(old)

    # -- journal ---------------------------------------------------------------------------
    def _open_journal(self) -> None:
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._size = os.fstat(self._fd).st_size
        except OSError as e:
            raise StorageError(f"cannot open {self.path}: {e}") from e

    def _truncate_to(self, size: int) -> None:
        try:
            if self._fd is not None:
                os.ftruncate(self._fd, size)
                self._size = size
        except OSError as e:  # the record stays: on open it is dropped (not in the log)
            log.error("cannot take back a record of %s: %s", self.path, e)

    def records_from(self, offset: int) -> list[ProducerRecord]:
        """The records of the runs that end after log ``offset``, in log order (a run
        that grew since a reader last asked from its end comes again, whole; 0: all)."""
        out = [run.record(pid) for pid, p in self.pids.items() for run in p.runs
               if run.end > offset]
        out.sort(key=lambda r: r.start)
        return out

    def records_bytes(self, offset: int) -> bytes:
        """:meth:`records_from` as the bytes of a ``producers`` answer."""
        return encode_producer_records(self.records_from(offset))

    def _rewrite(self) -> None:
        """The journal rewritten with the live runs only (atomically, fsynced)."""
        data = encode_producer_records(self.records_from(0))
        tmp = self.path.with_name(JOURNAL_NAME + ".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_dir(self.plog.dir)
        except OSError as e:
            raise StorageError(f"cannot rewrite {self.path}: {e}") from e
        old, self._fd = self._fd, None
        if old is not None:
            pending = self.synced
            if pending is not None and not pending.done():
                pending.add_done_callback(lambda _f: os.close(old))
            else:
                os.close(old)
        self._dirty = False
        if data:
            self._open_journal()

    def on_flush(self) -> None:
        """The log is being fsynced: fsync the journal too (on the storage's threads)."""
        if not self._dirty or self._fd is None:
            return
        self._dirty = False
        self.synced = self.plog.storage.executor.submit(os.fsync, self._fd)

    # -- replication -----------------------------------------------------------------------
    def apply(self, records: list[ProducerRecord]) -> int:
        """Store records read from another broker's table (its ``producers`` answer);
        those whose seqs are all known here, or whose messages are not (yet) in this
        log, are skipped; one that extends a run known here (it grew on the other
        broker) replaces it.  Returns how many were stored."""
        done = 0
        for r in sorted(records, key=lambda r: r.start):
            known = self.pids.get(r.pid)
            if known is not None and r.seq + r.count <= known.next_seq:
                continue
            if not self._present(r):
                continue
            if known is not None:
                while known.runs and known.runs[-1].seq >= r.seq:
                    known.kept -= known.runs.pop().count
            self.write(r)
            self.stored(r)
            done += 1
        return done

    def truncate(self, offset: int) -> None:
        """Forget the runs that end past log ``offset`` (the log is cut there)."""
        for pid in list(self.pids):
            p = self.pids[pid]
            while p.runs and p.runs[-1].end > offset:
                p.kept -= p.runs.pop().count
            if not p.runs:
                del self.pids[pid]
            else:
                last = p.runs[-1]
                p.next_seq = last.seq + last.count
        self._rewrite()

    def close(self) -> None:
        """fsync and close the journal."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.synced is not None:
                self.synced.result()
            os.fsync(fd)
        except Exception as e:  # noqa: BLE001 - an fsync failed: logged, closing goes on
            log.error("final fsync of %s failed: %s", self.path, e)
        finally:
            os.close(fd)


class Producers:
    """The producer tables of one :class:`Storage`, one per partition, opened on
    first use (the log's flush then fsyncs the table's journal too)."""

    def __init__(self, storage: Storage, *, keep_seqs: int = 65536,
                 expiry_s: float = 7 * 86400.0, max_pids: int = 10000) -> None:
        self.storage = storage
        self.keep_seqs = keep_seqs
        self.expiry_s = expiry_s
        self.max_pids = max_pids
        self._tables: dict[PartitionLog, ProducerTable] = {}

    def table(self, plog: PartitionLog) -> ProducerTable:
        t = self._tables.get(plog)
        if t is None:
            t = self._tables[plog] = ProducerTable(plog, keep_seqs=self.keep_seqs,
                                                   expiry_s=self.expiry_s,
                                                   max_pids=self.max_pids)
            plog.on_flush = t.on_flush
        return t

    def producer_records(self, topic: str, partition: int,
                         from_offset: int) -> list[ProducerRecord]:
        """The records of ``topic``-``partition`` from log offset ``from_offset`` on
        (StorageError when the partition is not served)."""
        plog = self.storage.get(topic, partition)
        if plog is None:
            raise StorageError(f"topic {topic} partition {partition} not found")
        return self.table(plog).records_from(from_offset)

    def apply_producer_records(self, topic: str, partition: int,
                               records: list[ProducerRecord]) -> int:
        """Store another broker's records for ``topic``-``partition`` (see
        :meth:`ProducerTable.apply`); how many were stored."""
        plog = self.storage.get(topic, partition)
        if plog is None:
            raise StorageError(f"topic {topic} partition {partition} not found")
        return self.table(plog).apply(records)

    def truncate(self, topic: str, partition: int, offset: int) -> None:
        """The log of ``topic``-``partition`` was cut at ``offset``: forget later runs."""
        plog = self.storage.get(topic, partition)
        if plog is not None:
            self.table(plog).truncate(offset)

    @property
    def duplicates(self) -> int:
        """Puts answered as resends of stored ones, in every table opened."""
        return sum(t.duplicates for t in self._tables.values())

    def expire(self) -> int:
        """Forget expired producers in every table; how many."""
        return sum(t.expire() for t in self._tables.values())

    def close(self) -> None:
        for plog, t in self._tables.items():
            plog.on_flush = None
            t.close()
        self._tables.clear()
