"""The hot loop that hands a batch to a listener (a partition's state: ``_subscription``).

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
from metaq.consumer._subscription import PartitionState
from metaq.protocol import (
    CHECKSUM_MASK,
    CRC32_IMPL,
    HEADER_SIZE,
    MAX_PAYLOAD,
    ST_LATER,
    ST_LIMIT,
    PartitionReader,
)
from metaq.protocol import crc32 as _crc32  # ISA-L's when installed (a dependency)

__all__ = ["BatchResult", "process_batch", "Rewind", "CRC32_IMPL"]

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


@dataclass(slots=True)
class BatchResult:
    consumed: int
    needed_size: int | None = None


def _stop_at_start(pf: PartitionState, data: _Data) -> int | None:
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


def _fail(pf: PartitionState, msg: Message, exc: BaseException) -> bool:
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


def _hand_slice(pf: PartitionState, listener: Callable[[list[Message]], Any],
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
# Python twins: tests/protocol/test_speedups.py fuzzes one against the other), a call a batch
# or a slice through the partition's PartitionReader; Python here only handles a
# listener's failure (``_fail``) and writes the progress, once a batch.

def _reader(pf: PartitionState) -> PartitionReader:
    """``pf``'s reader (topic, partition, codec and its message classes for the bound
    ``take``/``deliver``), made on its first batch and again when its codec changed.

    Kept in ``pf.reader`` (declared by the partition state, made here on first use)."""
    reader = pf.reader
    if reader is None or reader.codec is not pf.codec:
        plain, with_attribute = message_classes(pf.codec)
        reader = PartitionReader(pf.topic, pf.partition, pf.codec, plain, with_attribute,
                                 MAX_PAYLOAD)
        pf.reader = reader
    return reader


def process_batch(pf: PartitionState, data: _Data) -> BatchResult:
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

def _deliver_each(pf: PartitionState, reader: PartitionReader, view: _Data, verify: bool,
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


def _deliver_batch(pf: PartitionState, reader: PartitionReader, view: _Data, verify: bool,
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
        # let the slice go before the next is built: its bodies' memory (if the
        # listener kept none of them) is what the next slice's bodies get, still in cache
        del batch
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


def _deliver_manual(pf: PartitionState, reader: PartitionReader, view: _Data, verify: bool,
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


def _deliver_concurrent(pf: PartitionState, reader: PartitionReader, view: _Data,
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


def _progress(pf: PartitionState, consumed: int) -> BatchResult:
    if pf.retry_offset >= 0 and pf.retry_offset < pf.offset:
        pf.retry_offset, pf.retry_count = -1, 0
    pf.consumed += consumed
    return BatchResult(consumed)
