"""The transaction journal: ``<data_dir>/transactions/journal`` (one per broker).

What a transaction did before it is committed lives here, not in the partition
logs (where nothing of it is visible until the commit appends it).  Records are
appended; each is ``length (u32) | crc32 of the body (u32) | body`` with the body
``kind (1 byte) | key length (u16) | key | data``:

========  =========================================================================
``P``     a put: ``topic length (u16) | topic | partition (i32) | message bytes``
          (the whole stored message, msgId assigned at the put).  An XA branch's
          are written as they come; a local transaction's only at its commit, right
          before its ``C`` (in the same write), each ``P`` then holding a run of
          whole messages of one partition (read back like single puts: a partition's
          are joined in order)
``R``     prepared (XA): the branch must survive a crash until committed or rolled back;
          its data (empty in journals written before slaves copied them) is like
          ``C``'s, each start the partition's end when the branch was prepared: a
          lower bound for where a later commit appends its messages
``C``     committed: ``count (u16)`` then per partition ``topic length (u16) | topic |
          partition (i32) | start offset (i64) | length (i64)``: where its messages
          go.  Written before they are appended, so recovery can finish a commit a
          crash cut short (append what is missing; never twice)
``D``     commit decided (a prepared branch): like ``C``, but each start offset is a
          lower bound, the partition's end when the decision was written.  Fsynced
          *before* the messages are appended, so they never reach a log (its page
          cache, which the OS may write back at any time) while a power loss could
          still lose the decision and let the branch be prepared, and committed,
          again; its ``C`` follows with the exact starts
``X``     rolled back (or timed out)
========  =========================================================================

:func:`replay` reads the records back after a restart: a branch with ``R`` and no
``C``/``X`` is prepared again (RECOVER lists it); a transaction with neither ``R``
nor ``C`` was in flight when the broker stopped and is rolled back, as Java Metaq
does; a ``C`` is finished where the logs lack it, and so is a ``D`` without its ``C``
(the messages are looked for from its lower bounds, see ``_transactions``).  A torn
record at the end (a crash while writing) is cut; a damaged record in the middle (bad CRC) stops the
replay there with an error naming its offset, and the file is kept aside.

The journal is rewritten (:meth:`TxJournal.rewrite`) with only the prepared
branches at each start and whenever no transaction is open and it has grown past
:data:`COMPACT_AT`.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain, repeat
from pathlib import Path

from metaq._durable import write_durably
from metaq._errors import StorageError
from metaq.protocol import crc32  # zlib's CRC-32, ISA-L's when installed (much faster)

__all__ = ["TxJournal", "Replayed", "COMPACT_AT", "put_record", "prepare_record",
           "decide_record", "read_records", "records_of"]

log = logging.getLogger(__name__)

COMPACT_AT = 64 * 1024 * 1024
_HEAD = struct.Struct(">II")
_U16 = struct.Struct(">H")
_I32 = struct.Struct(">i")
_PLACE = struct.Struct(">iqq")
_MAX_RECORD = 1 << 30
_BUFFER_MAX = 1 << 20


@dataclass
class Replayed:
    """One transaction as the journal tells it."""

    key: str
    puts: list[tuple[str, int, bytes]] = field(default_factory=list)
    prepared: bool = False
    #: ``(topic, partition, lower bound, length)`` per partition, from its ``R``
    prepared_at: list[tuple[str, int, int, int]] | None = None
    #: ``(topic, partition, start offset, length)`` once committed
    committed: list[tuple[str, int, int, int]] | None = None
    #: the same with each start a lower bound (``D``), once a commit was decided
    decided: list[tuple[str, int, int, int]] | None = None
    rolled_back: bool = False


def _name(b: bytes, pos: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(b, pos)
    return b[pos + 2:pos + 2 + n].decode("utf-8"), pos + 2 + n


def _read_places(body: bytes, pos: int) -> list[tuple[str, int, int, int]]:
    (n,) = _U16.unpack_from(body, pos)
    pos += 2
    places = []
    for _ in range(n):
        topic, pos = _name(body, pos)
        partition, start, length = _PLACE.unpack_from(body, pos)
        pos += _PLACE.size
        places.append((topic, partition, start, length))
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} bytes after the places")
    return places


def _put_name(s: str) -> bytes:
    raw = s.encode("utf-8")
    return _U16.pack(len(raw)) + raw


def _record(kind: bytes, key: str, data: bytes = b"") -> bytes:
    """A journal record: length and CRC32 of the body, then the body."""
    body = kind + _put_name(key) + data
    return _HEAD.pack(len(body), crc32(body)) + body


def _places(places: list[tuple[str, int, int, int]]) -> bytes:
    return _U16.pack(len(places)) + b"".join(
        _put_name(t) + _PLACE.pack(p, start, length) for t, p, start, length in places)


def put_record(key: str, topic: str, partition: int, message: bytes) -> bytes:
    """The ``P`` record of one put of transaction ``key``."""
    return _record(b"P", key, _put_name(topic) + _I32.pack(partition) + message)


def put_records(key: str, topic: str, partition: int, messages: list[bytes]) -> bytes:
    """The ``P`` records of puts of transaction ``key`` to one partition, together (each
    what :func:`put_record` makes of it; each message copied once, its CRC continued
    from the shared prefix's)."""
    prefix = b"P" + _put_name(key) + _put_name(topic) + _I32.pack(partition)
    heads = map(_HEAD.pack, map(len(prefix).__add__, map(len, messages)),
                map(crc32, messages, repeat(crc32(prefix))))
    return b"".join(chain.from_iterable(zip(heads, repeat(prefix), messages)))


def prepare_record(key: str, bounds: list[tuple[str, int, int, int]] | None) -> bytes:
    """The ``R`` record of branch ``key`` (``bounds``: see the module docstring)."""
    return _record(b"R", key, b"" if bounds is None else _places(bounds))


def decide_record(key: str, places: list[tuple[str, int, int, int]]) -> bytes:
    """The ``D`` record of branch ``key``."""
    return _record(b"D", key, _places(places))


def read_records(data: bytes) -> list[Replayed]:
    """The transactions ``data`` (whole journal records, e.g. a master's feed) tells;
    ValueError naming the offset of the first record that is torn, damaged (CRC) or
    cannot be read: nothing of such ``data`` should be used."""
    txs: dict[str, Replayed] = {}
    pos = 0
    while pos < len(data):
        if len(data) - pos < _HEAD.size:
            raise ValueError(f"a torn record header at offset {pos}")
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if end > len(data):
            raise ValueError(f"a record of {length} bytes at offset {pos} runs past the "
                             f"end ({len(data)} bytes)")
        body = data[pos + _HEAD.size:end]
        if crc32(body) != crc:
            raise ValueError(f"a record whose CRC does not match at offset {pos}")
        try:
            TxJournal._apply(body, txs)
        except (ValueError, struct.error, UnicodeDecodeError, IndexError) as e:
            raise ValueError(f"a record that cannot be read at offset {pos} ({e})") from None
        pos = end
    return list(txs.values())


def records_of(tx: Replayed) -> Iterator[bytes]:
    """The records that tell ``tx`` again: its puts, then R, D, C or X as it has them."""
    for topic, partition, message in tx.puts:
        yield put_record(tx.key, topic, partition, message)
    if tx.prepared:
        yield prepare_record(tx.key, tx.prepared_at)
    if tx.decided is not None:
        yield decide_record(tx.key, tx.decided)
    if tx.committed is not None:
        yield _record(b"C", tx.key, _places(tx.committed))
    if tx.rolled_back:
        yield _record(b"X", tx.key)


class TxJournal:
    """The append-only journal file (event loop thread: appends; :meth:`sync` may run
    on an executor thread)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.path = directory / "journal"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise StorageError(f"cannot open the transaction journal {self.path}: {e}") from e
        self.size = os.fstat(self.fd).st_size
        self._buffer: list[bytes] = []
        self._buffered = 0

    # -- writing ---------------------------------------------------------------------------
    def _append(self, kind: bytes, key: str, data: bytes = b"") -> bytes:
        rec = out = _record(kind, key, data)
        if self._buffer:
            self._buffer.append(rec)
            out = b"".join(self._buffer)
            self._buffer.clear()
            self._buffered = 0
        self._write(out)
        return rec

    def _write(self, rec: bytes) -> None:
        try:
            n = os.write(self.fd, rec)
            while n < len(rec):
                n += os.write(self.fd, rec[n:])
        except OSError as e:
            raise StorageError(f"cannot write the transaction journal {self.path}: {e}") from e
        self.size += len(rec)

    def put(self, key: str, topic: str, partition: int, message: bytes) -> None:
        """A put: kept in memory until the next other record, :meth:`write` or 1 MiB
        of them (a put matters only once its transaction prepares or commits, and
        those records write it first)."""
        rec = put_record(key, topic, partition, message)
        self._buffer.append(rec)
        self._buffered += len(rec)
        if self._buffered >= _BUFFER_MAX:
            self.write()

    def puts(self, key: str, topic: str, partition: int, messages: list[bytes]) -> None:
        """:meth:`put` of several messages to one partition."""
        recs = put_records(key, topic, partition, messages)
        self._buffer.append(recs)
        self._buffered += len(recs)
        if self._buffered >= _BUFFER_MAX:
            self.write()

    def write(self) -> None:
        """Write the buffered put records."""
        if self._buffer:
            data = b"".join(self._buffer)
            self._buffer.clear()
            self._buffered = 0
            self._write(data)

    def prepare(self, key: str, bounds: list[tuple[str, int, int, int]] | None = None
                ) -> bytes:
        """Branch ``key`` prepared; the record written (every record method returns
        it: the master feeds them to its slaves, ``_txfeed``)."""
        return self._append(b"R", key, b"" if bounds is None else _places(bounds))

    def commit(self, key: str, places: list[tuple[str, int, int, int]]) -> bytes:
        return self._append(b"C", key, _places(places))

    def decide(self, key: str, places: list[tuple[str, int, int, int]]) -> bytes:
        """A commit decided (``D``: each start a lower bound); :meth:`sync` it before
        appending the messages."""
        return self._append(b"D", key, _places(places))

    def rollback(self, key: str) -> bytes:
        return self._append(b"X", key)

    def append_records(self, data: bytes) -> None:
        """Append whole records (a master's feed, checked by :func:`read_records`)."""
        self.write()
        self._write(data)

    def sync(self) -> None:
        """fsync (blocking; the buffered puts must have been written: :meth:`write`)."""
        os.fsync(self.fd)

    def close(self) -> None:
        try:
            self.write()
            os.fsync(self.fd)
        finally:
            os.close(self.fd)

    # -- reading ---------------------------------------------------------------------------
    def replay(self) -> list[Replayed]:
        """Every transaction the journal names, in the order first seen; a torn tail
        is cut, a damaged record ends the replay (logged, file copied aside)."""
        try:
            data = Path(self.path).read_bytes()
        except OSError as e:
            raise StorageError(f"cannot read the transaction journal {self.path}: {e}") from e
        txs: dict[str, Replayed] = {}
        pos = 0
        while pos < len(data):
            if len(data) - pos < _HEAD.size:
                self._cut(pos, len(data), "a torn record header")
                break
            length, crc = _HEAD.unpack_from(data, pos)
            end = pos + _HEAD.size + length
            if length > _MAX_RECORD or end > len(data):
                if length <= _MAX_RECORD:
                    self._cut(pos, len(data), "a torn record")
                    break
                self._damaged(data, pos, f"an impossible record length {length}")
                break
            body = data[pos + _HEAD.size:end]
            if crc32(body) != crc:
                if end == len(data):
                    self._cut(pos, len(data), "a torn last record (bad CRC)")
                else:
                    self._damaged(data, pos, "a record whose CRC does not match")
                break
            try:
                self._apply(body, txs)
            except (ValueError, struct.error, UnicodeDecodeError) as e:
                self._damaged(data, pos, f"a record that cannot be read ({e})")
                break
            pos = end
        return list(txs.values())

    @staticmethod
    def _apply(body: bytes, txs: dict[str, Replayed]) -> None:
        kind = body[:1]
        key, pos = _name(body, 1)
        tx = txs.get(key)
        if tx is None:
            tx = txs[key] = Replayed(key)
        if kind == b"P":
            topic, pos = _name(body, pos)
            (partition,) = _I32.unpack_from(body, pos)
            tx.puts.append((topic, partition, body[pos + 4:]))
        elif kind == b"R":
            tx.prepared = True
            if len(body) > pos:
                tx.prepared_at = _read_places(body, pos)
        elif kind in (b"C", b"D"):
            places = _read_places(body, pos)
            if kind == b"C":
                tx.committed = places
            else:
                tx.decided = places
        elif kind == b"X":
            tx.rolled_back = True
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def _cut(self, pos: int, end: int, why: str) -> None:
        log.warning("transaction journal %s: %s at offset %d; %d bytes cut", self.path, why,
                    pos, end - pos)
        os.ftruncate(self.fd, pos)
        self.size = pos

    def _damaged(self, data: bytes, pos: int, why: str) -> None:
        keep = self.path.with_name(f"journal.damaged-{pos}")
        try:
            keep.write_bytes(data)
        except OSError as e:
            log.error("cannot copy the damaged journal to %s: %s", keep, e)
        log.error("transaction journal %s: %s at offset %d; the records after it are not "
                  "read (the whole file is copied to %s)", self.path, why, pos, keep)
        os.ftruncate(self.fd, pos)
        self.size = pos

    # -- compaction ------------------------------------------------------------------------
    def rewrite(self, keep: list[Replayed]) -> None:
        """Replace the journal with the records of ``keep`` (prepared branches; on a
        slave also commits whose messages it has not copied yet), atomically (a new
        file fsynced, renamed over the old one, the directory fsynced)."""
        self.replace(b"".join(rec for tx in keep for rec in records_of(tx)))

    def replace(self, data: bytes) -> None:
        """Replace the journal with ``data`` (whole records), atomically."""
        try:
            size = write_durably(self.path, [data], tmp=self.dir / "journal.new")
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        except OSError as e:
            raise StorageError(f"cannot rewrite the transaction journal {self.path}: {e}") from e
        self._buffer.clear()
        self._buffered = 0
        os.close(self.fd)
        self.fd, self.size = fd, size
