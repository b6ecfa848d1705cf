"""Per-partition fetch state and the hot loop that hands a batch to a listener.

``process_batch`` walks the raw bytes of a ``get`` reply (Metaq message
records back to back, maybe ending in a partial one), verifies checksums and
calls the listener.  Progress (``offset``, ``msg_id``) moves as messages are
consumed (auto-ack); a listener failure rewinds to the failing message and
counts a retry for THAT message only.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from metaq._errors import ChecksumError
from metaq.consumer._concurrent import RECONSUME_LATER, ReconsumeLater
from metaq.consumer._message import Message, message_classes
from metaq.protocol import (
    CHECKSUM_MASK,
    CRC32_IMPL,
    HEADER_SIZE,
    MAX_PAYLOAD,
    ST_LATER,
    ST_LIMIT,
    Codec,
    PartitionReader,
)
from metaq.protocol import crc32 as _crc32  # ISA-L's when installed (a dependency)

__all__ = ["PartitionFetch", "BatchResult", "process_batch", "Rewind", "CRC32_IMPL"]

log = logging.getLogger(__name__)

#: length (read unsigned: a corrupt negative one is just too long), checksum, msgId, flag
_unpack_header = struct.Struct(">Iiqi").unpack_from


#: Replies longer than this have their checksums checked in one C pass without the
#: GIL before any message is built (another runner's listener runs meanwhile).
_SCAN_FIRST = 65536

#: A batch listener's slice also ends once its messages span this many bytes (at
#: least one message): 500 live 1 KiB bodies cost more in cache misses than the
#: extra listener calls of 128 KiB slices.
_SLICE_BYTES = 128 * 1024

#: What the loops read: a reply as bytes, or a view of a receive buffer.
_Data = bytes | bytearray | memoryview

#: Default for ``PartitionFetch.max_batch``: below CPython's first GC threshold
#: (700 new container objects), so a batch in hand never triggers a collection.
DEFAULT_MAX_BATCH = 500


class _ChecksumAt(ChecksumError):
    def __init__(self, topic: str, partition: str, offset: int, next_offset: int,
                 expected: int, actual: int, problem: str | None = None) -> None:
        self.offset = offset
        self.next_offset = next_offset
        if problem is None:
            problem = f"checksum mismatch: header says {expected}, payload has {actual}"
        super().__init__(f"corrupt message in {topic}/{partition} at offset {offset}: {problem}")


class Rewind(Exception):  # noqa: N818 - a control signal, not an error
    """Raise from a listener to leave this message (and the rest of the batch)
    for a later delivery without counting a failure, e.g. while shutting down."""


class PartitionFetch:
    """Mutable fetch state of one owned partition (Metaq's FetchRequest).

    Only the runner holding it (``busy``) changes ``offset``/``msg_id``;
    others read them (commits) or set the flags under the manager's lock.
    """

    def __init__(self, *, topic: str, partition: str, broker_id: int, index: int,
                 broker_address: tuple[str, int] | None, offset: int, msg_id: int,
                 max_size: int, listener: Callable[[Message], Any] | None,
                 batch_listener: Callable[[list[Message]], Any] | None, codec: Codec,
                 verify: bool, max_retries: int, retry_backoff: float = 0.5,
                 reject: Callable[[Message, BaseException], None] | None = None,
                 epoch: int = 0, max_batch: int | None = None) -> None:
        self.topic = topic
        self.partition = partition
        self.broker_id = broker_id
        self.index = index
        self.broker_address = broker_address
        self.offset = offset
        self.msg_id = msg_id
        self.max_size = max_size
        self.listener = listener
        self.batch_listener = batch_listener
        self.codec = codec
        self.verify = verify
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        self.reject = reject
        self.epoch = epoch
        #: most messages per batch-listener call (a fetched batch is handed over in
        #: slices of this size, in order)
        self.max_batch = DEFAULT_MAX_BATCH if max_batch is None else max_batch
        # scheduling, guarded by the FetchManager's lock
        self.active = False
        self.busy = False
        self.paused = False
        self.parked = False
        self.due = 0.0
        self.queued_token = -1
        #: token of the held get the long poller keeps out for it; 0 when not parked
        self.hold_token = 0
        # position checks (see FetchManager._check_position), owned by the runner
        #: ``offset`` is known to be a message boundary inside the log (set once the
        #: broker confirmed it or a message was delivered from it; cleared by a seek)
        self.checked = False
        #: offset_reset="fail" found the position out of range: not fetched until a seek
        self.stalled: BaseException | None = None
        #: damaged byte ranges met and bytes skipped over them, out-of-range resets
        self.damaged = 0
        self.skipped = 0
        self.resets = 0
        # backoff and counters, owned by the runner holding it
        self.delay = 0.0
        self.failures = 0
        self.grow_size_streak = 0
        self.checksum_failures = 0
        self.retry_offset = -1
        self.retry_count = 0
        self.retry_delay: float | None = None
        self.consumed = 0
        # bytes fetched ahead (unconsumed tail of the last batch + the next reply),
        # valid while ``offset == ready_offset`` (see FetchManager)
        self.ready: memoryview | None = None
        #: the partition's receive buffer (``ready`` is a view of it)
        self.rbuf: bytearray | None = None
        self.ready_offset = -1
        self.ready_address: tuple[str, int] | None = None
        # control requests, applied by the runner before its next fetch
        self.seek_to: int | None = None
        self.rollback = False
        # manual acknowledgement: progress to commit is what was acked
        self.auto_ack = True
        self.acked: tuple[int, int] = (msg_id, offset)
        # concurrent mode: the pool and the in-flight tracker (None when orderly)
        self.dispatcher: Any = None
        self.inflight: Any = None
        self.flow: tuple[int, int, int] = (1000, 100 * 1024 * 1024, 2000)

    def commit_position(self) -> tuple[int, int]:
        """(msgId, offset) safe to commit: nothing before it is unfinished or unacked."""
        if self.inflight is not None:
            low = self.inflight.low()
            if low is not None:
                return low[1], low[0]
        if not self.auto_ack:
            return self.acked
        return self.msg_id, self.offset

    def __repr__(self) -> str:
        return f"PartitionFetch({self.topic}/{self.partition} @ {self.offset})"


@dataclass(slots=True)
class BatchResult:
    consumed: int
    needed_size: int | None = None


def _stop_at_start(pf: PartitionFetch, data: _Data) -> int | None:
    """Why no message of ``data`` could be taken: the size a fetch needs for a
    message bigger than ``data``, or None when there is no whole header; raises
    for a corrupt first message (impossible length, checksum mismatch).  (Not a
    walk: the first header only, once a batch delivered nothing.)"""
    if len(data) < HEADER_SIZE:
        return None
    length, check, _msg_id, _flag = _unpack_header(data, 0)
    base = pf.offset
    if length > MAX_PAYLOAD:
        raise _ChecksumAt(pf.topic, pf.partition, base, base + HEADER_SIZE, check, -1,
                          f"impossible message length {length}")
    end = HEADER_SIZE + length
    if end > len(data):
        return end
    actual = _crc32(data[HEADER_SIZE:end]) & CHECKSUM_MASK
    raise _ChecksumAt(pf.topic, pf.partition, base, base + end, check, actual)


def _fail(pf: PartitionFetch, msg: Message, exc: BaseException) -> bool:
    """Count a listener failure on ``msg``; True when it must be rejected now."""
    if isinstance(exc, Rewind):
        pf.retry_delay = pf.retry_backoff
        return False
    if pf.retry_offset == msg.offset:
        pf.retry_count += 1
    else:
        pf.retry_offset, pf.retry_count = msg.offset, 1
    if pf.retry_count > pf.max_retries:
        log.error("giving up on %s/%s offset %d msgId %d after %d failures: %r",
                  msg.topic, msg.partition, msg.offset, msg.msg_id, pf.retry_count, exc)
        if pf.reject is not None:
            pf.reject(msg, exc)
        pf.retry_offset, pf.retry_count = -1, 0
        return True
    log.warning("listener failed on %s/%s offset %d (try %d of %d): %r", msg.topic,
                msg.partition, msg.offset, pf.retry_count, pf.max_retries + 1, exc)
    pf.retry_delay = min(pf.retry_backoff * (2 ** (pf.retry_count - 1)), 30.0)
    return False


def _hand_slice(pf: PartitionFetch, listener: Callable[[list[Message]], Any],
                batch: list[Message]) -> bool:
    """Give one slice to a batch listener; True when it counts as consumed (handled,
    or rejected after its retries: then the rest of it goes to the reject handler
    one by one), and then ``pf``'s progress is moved past it."""
    try:
        if listener(batch) is RECONSUME_LATER:
            raise ReconsumeLater()
    except Exception as exc:  # noqa: BLE001 - the listener's failure is handled here
        if not _fail(pf, batch[0], exc):
            return False
        if pf.reject is not None:
            for m in batch[1:]:
                pf.reject(m, exc)
    last = batch[-1]
    pf.offset, pf.msg_id = last[3], last[4]
    return True


# The walk, the checksums, the messages and, for per-message delivery, the listener
# calls happen in the bound ``take``/``deliver`` of metaq.protocol (C, or their
# Python twins: tests/test_speedups.py fuzzes one against the other), a call a batch
# or a slice through the partition's PartitionReader; Python here only handles a
# listener's failure (``_fail``) and writes the progress, once a batch.

def _reader(pf: PartitionFetch) -> PartitionReader:
    """``pf``'s reader (topic, partition, codec and its message classes for the bound
    ``take``/``deliver``), made on its first batch and again when its codec changed.

    Kept in ``pf.reader``, an attribute this module sets (PartitionFetch may declare
    it as ``reader: PartitionReader | None = None``)."""
    reader = getattr(pf, "reader", None)
    if reader is None or reader.codec is not pf.codec:
        plain, with_attribute = message_classes(pf.codec)
        reader = PartitionReader(pf.topic, pf.partition, pf.codec, plain, with_attribute,
                                 MAX_PAYLOAD)
        pf.reader = reader
    return reader


def process_batch(pf: PartitionFetch, data: _Data) -> BatchResult:
    """Hand the messages in ``data`` to ``pf``'s listener; move ``pf``'s progress.

    ``data`` is a ``get`` reply body read from ``pf.offset`` (any buffer; C reads
    it in place, copying each body once).  Checksums are verified as messages
    are taken (when ``pf.verify``; with C, a reply over ``_SCAN_FIRST`` bytes
    first, in one pass without the GIL); the first bad one ends the batch, and
    raises a ChecksumError when it is the first of a batch.
    """
    pf.retry_delay = None
    reader = _reader(pf)
    view, verify = reader.prepare(data, pf.verify, _SCAN_FIRST)
    if pf.batch_listener is not None:
        return _deliver_batch(pf, reader, view, verify, data)
    if pf.dispatcher is not None:
        return _deliver_concurrent(pf, reader, view, verify, data)
    if not pf.auto_ack:
        return _deliver_manual(pf, reader, view, verify, data)
    return _deliver_each(pf, reader, view, verify, data)


# Each mode reads ``view`` (``data`` prepared: with C maybe its verified prefix, in
# Python bytes) with ``verify``, and names ``data`` when nothing could be taken.

def _deliver_each(pf: PartitionFetch, reader: PartitionReader, view: _Data, verify: bool,
                  data: _Data) -> BatchResult:
    """Per-message listener, auto-ack: one ``deliver`` call a batch (more only after
    a failure that rejected its message)."""
    base, listener, deliver = pf.offset, pf.listener, reader.deliver
    later = RECONSUME_LATER
    pos = consumed = 0
    last: Message | None = None
    failed = False
    while True:
        status, pos, n, ok, bad, exc = deliver(view, pos, base, verify, listener, later)
        consumed += n
        if ok is not None:
            last = ok
        if status < ST_LATER:  # the data ended, or a bad message
            break
        if status == ST_LATER:
            exc = ReconsumeLater()
        if not _fail(pf, bad, exc):
            failed = True
            break
        consumed += 1  # rejected: it counts as consumed; go on with the next
        last = bad
        pos = bad[3] - base
    if not consumed:
        return BatchResult(0, None if failed else _stop_at_start(pf, data))
    assert last is not None
    pf.msg_id = last[4]
    pf.offset = base + pos
    return _progress(pf, consumed)


def _deliver_batch(pf: PartitionFetch, reader: PartitionReader, view: _Data, verify: bool,
                   data: _Data) -> BatchResult:
    """Batch listener: one ``take`` call a slice (``max_batch`` messages, at most
    ``_SLICE_BYTES`` but at least one message)."""
    base, listener, limit, take = pf.offset, pf.batch_listener, pf.max_batch, reader.take
    assert listener is not None
    pos = consumed = 0
    while True:
        batch, nxt, status = take(view, pos, base, limit, _SLICE_BYTES, verify)
        if not batch or not _hand_slice(pf, listener, batch):
            break
        consumed += len(batch)
        pos = nxt
        if status != ST_LIMIT:
            break
    if not consumed:
        return BatchResult(0, None if pf.retry_delay is not None else _stop_at_start(pf, data))
    return _progress(pf, consumed)


def _walk(reader: PartitionReader, view: _Data, verify: bool, base: int) -> Iterator[Message]:
    """Messages of ``view`` in order (checksums verified when ``verify``), taken 256 at
    a time; stops at the first bad or cut one."""
    take = reader.take
    pos, status = 0, ST_LIMIT
    while status == ST_LIMIT:
        batch, pos, status = take(view, pos, base, 256, 1 << 62, verify)
        yield from batch


def _deliver_manual(pf: PartitionFetch, reader: PartitionReader, view: _Data, verify: bool,
                    data: _Data) -> BatchResult:
    """Manual-ack mode: progress per message, a rollback stops the batch at once."""
    consumed = 0
    listener = pf.listener
    assert listener is not None
    for m in _walk(reader, view, verify, pf.offset):
        try:
            if listener(m) is RECONSUME_LATER:
                raise ReconsumeLater()
        except Exception as exc:  # noqa: BLE001
            if not _fail(pf, m, exc):
                break
        consumed += 1
        pf.offset, pf.msg_id = m[3], m[4]
        if pf.rollback:
            break
    if not consumed:
        return BatchResult(0, None if pf.retry_delay is not None
                           else _stop_at_start(pf, data))
    return _progress(pf, consumed)


def _deliver_concurrent(pf: PartitionFetch, reader: PartitionReader, view: _Data,
                        verify: bool, data: _Data) -> BatchResult:
    """Concurrent mode: hand each message to the pool; fetching moves on at once."""
    consumed = 0
    inflight, submit = pf.inflight, pf.dispatcher.submit
    prev = pf.msg_id
    for m in _walk(reader, view, verify, pf.offset):
        inflight.add(m[2], prev, m[3] - m[2])
        submit(pf, m)
        prev = m[4]
        consumed += 1
        pf.offset, pf.msg_id = m[3], m[4]
    if not consumed:
        return BatchResult(0, _stop_at_start(pf, data))
    return _progress(pf, consumed)


def _progress(pf: PartitionFetch, consumed: int) -> BatchResult:
    if pf.retry_offset >= 0 and pf.retry_offset < pf.offset:
        pf.retry_offset, pf.retry_count = -1, 0
    pf.consumed += consumed
    return BatchResult(consumed)
