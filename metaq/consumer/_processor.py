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
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count, repeat
from typing import Any

from metaq._errors import ChecksumError
from metaq.consumer._concurrent import RECONSUME_LATER, ReconsumeLater
from metaq.consumer._message import Message, message_classes
from metaq.consumer._subscription import PartitionState as PartitionFetch
from metaq.protocol import CRC32_IMPL
from metaq.protocol import crc32 as _crc32  # ISA-L's when installed (a dependency)
from metaq.protocol._fast import speedups as _NATIVE

__all__ = ["PartitionFetch", "BatchResult", "process_batch", "Rewind", "CRC32_IMPL"]

log = logging.getLogger(__name__)

#: length (read unsigned: a corrupt negative one is just too long), checksum, msgId, flag
_HEADER = struct.Struct(">Iiqi")
_unpack_header = _HEADER.unpack_from
_HEADER_SIZE = 20
_MASK = 0x7FFFFFFF
#: a payload length above this is corruption (Metaq's lengths are int32)
_MAX_PAYLOAD = 0x7FFFFFFF - _HEADER_SIZE


#: Replies longer than this have their checksums checked in one C pass without the
#: GIL before any message is built (another runner's listener runs meanwhile).
_SCAN_FIRST = 65536

#: A batch listener's slice also ends once its messages span this many bytes (at
#: least one message): 500 live 1 KiB bodies cost more in cache misses than the
#: extra listener calls of 128 KiB slices.
_SLICE_BYTES = 128 * 1024

#: What the loops read: a reply as bytes, or (C loops) a view of a receive buffer.
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


def _id_ending_at(data: bytes, end: int) -> int:
    """msgId of the message of ``data`` that ends at ``end`` (a rare path: after a failure)."""
    pos, msg_id = 0, -1
    while pos < end:
        length, _check, msg_id, _flag = _unpack_header(data, pos)
        pos += _HEADER_SIZE + length
    return msg_id


def _stop_at_start(pf: PartitionFetch, data: _Data) -> int | None:
    """Why no message of ``data`` could be taken: the size a fetch needs for a
    message bigger than ``data``, or None when there is no whole header; raises
    for a corrupt first message (impossible length, checksum mismatch)."""
    if len(data) < _HEADER_SIZE:
        return None
    length, check, _msg_id, _flag = _unpack_header(data, 0)
    base = pf.offset
    if length > _MAX_PAYLOAD:
        raise _ChecksumAt(pf.topic, pf.partition, base, base + _HEADER_SIZE, check, -1,
                          f"impossible message length {length}")
    end = _HEADER_SIZE + length
    if end > len(data):
        return end
    actual = _crc32(data[_HEADER_SIZE:end]) & _MASK
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


def process_batch(pf: PartitionFetch, data: _Data) -> BatchResult:
    """Hand the messages in ``data`` to ``pf``'s listener; move ``pf``'s progress.

    ``data`` is a ``get`` reply body read from ``pf.offset`` (any buffer; the C
    loops read it in place, copying each body once).  Checksums are
    verified as messages are taken (when ``pf.verify``); the first bad one ends
    the batch, and raises a ChecksumError when it is the first of a batch.
    """
    pf.retry_delay = None
    native = _NATIVE is not None
    if type(data) is not bytes and not native:
        data = bytes(data)  # one copy; slicing bytes is the cheapest way to the bodies
    if native and pf.verify and len(data) > _SCAN_FIRST:
        # checksums first, in C without the GIL (other runners go on meanwhile);
        # the messages are then built from the verified prefix only
        stop = _NATIVE.scan(data, True, _MAX_PAYLOAD, False)[2]
        if stop:
            return _deliver_c(pf, memoryview(data)[:stop], False, data)
    if native:
        return _deliver_c(pf, data, pf.verify, data)
    if pf.batch_listener is not None:
        return _deliver_batch(pf, data)
    if pf.dispatcher is not None:
        return _deliver_concurrent(pf, data)
    if not pf.auto_ack:
        return _deliver_manual(pf, data)
    return _deliver_each(pf, data)


def _deliver_c(pf: PartitionFetch, view: _Data, verify: bool,
               data: _Data) -> BatchResult:
    if pf.batch_listener is not None:
        return _deliver_batch_c(pf, view, verify, data)
    if pf.dispatcher is not None:
        return _deliver_concurrent(pf, data)
    if not pf.auto_ack:
        return _deliver_manual(pf, data)
    return _deliver_each_c(pf, view, verify, data)


# With the C speedups (metaq/protocol/_fast.py) the walk, the checksums, the messages and,
# for per-message delivery, the listener calls happen in C; Python only handles
# a listener's failure (``_fail``) and writes the progress.  Same results as the
# pure-Python loops further down (tests/test_speedups.py runs both).

def _deliver_each_c(pf: PartitionFetch, view: _Data, verify: bool,
                    data: _Data) -> BatchResult:
    """``view``: the bytes to deliver (``data`` or its verified prefix)."""
    topic, partition, codec, base = pf.topic, pf.partition, pf.codec, pf.offset
    plain, with_attribute = message_classes(codec)
    listener, deliver = pf.listener, _NATIVE.deliver
    later, stop_later = RECONSUME_LATER, _NATIVE.LATER
    pos = consumed = 0
    last: Message | None = None
    failed = False
    while True:
        status, pos, n, ok, bad, exc = deliver(
            view, pos, base, verify, _MAX_PAYLOAD, topic, partition, codec, plain,
            with_attribute, listener, later)
        consumed += n
        if ok is not None:
            last = ok
        if status < stop_later:
            break
        if status == stop_later:
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


def _deliver_batch_c(pf: PartitionFetch, view: _Data, verify: bool,
                     data: _Data) -> BatchResult:
    topic, partition, codec, base = pf.topic, pf.partition, pf.codec, pf.offset
    plain, with_attribute = message_classes(codec)
    listener, take, limit = pf.batch_listener, _NATIVE.take, pf.max_batch
    assert listener is not None
    more = _NATIVE.LIMIT
    pos = consumed = 0
    while True:
        batch, nxt, status = take(view, pos, base, limit, _SLICE_BYTES, verify, _MAX_PAYLOAD,
                                  topic, partition, codec, plain, with_attribute)
        if not batch or not _hand_slice(pf, listener, batch):
            break
        consumed += len(batch)
        pos = nxt
        if status != more:
            break
    if not consumed:
        return BatchResult(0, None if pf.retry_delay is not None else _stop_at_start(pf, data))
    return _progress(pf, consumed)


# The two loops below are the consumer's hot path (see bench/bench_consumer.py):
# everything is a local, a message is built in one call, progress is written to
# ``pf`` once per batch.  The header's length is read unsigned, so a corrupt
# (negative) one can only look too long and end the walk; an exhausted buffer
# ends it through struct.error from unpack_from.

def _deliver_each(pf: PartitionFetch, data: bytes) -> BatchResult:
    topic, partition, codec, base = pf.topic, pf.partition, pf.codec, pf.offset
    plain, with_attribute = message_classes(codec)
    listener = pf.listener
    assert listener is not None
    verify, crc, unpack, struct_error = pf.verify, _crc32, _unpack_header, struct.error
    later = RECONSUME_LATER
    n = len(data)
    pos = 0
    m: Message | None = None
    failed = False
    numbers = count(1)  # ``i`` is the number of the message in hand, counted in C
    i = 1
    while True:
        try:
            for i in numbers:  # noqa: B007 - read after the loop
                try:
                    length, check, msg_id, flag = unpack(data, pos)
                except struct_error:
                    break
                end = pos + 20 + length
                if end > n:
                    break
                payload = data[pos + 20:end]
                if verify and crc(payload) & 0x7FFFFFFF != check:
                    break
                m = (plain if not flag else with_attribute if flag & 1 else plain)(
                    (topic, partition, base + pos, base + end, msg_id, flag, payload, codec))
                if listener(m) is later:
                    raise ReconsumeLater()
                pos = end
            break
        except Exception as exc:  # noqa: BLE001 - the listener's failure is handled here
            assert m is not None
            if not _fail(pf, m, exc):
                failed = True
                break
            pos = m[3] - base  # rejected: it counts as consumed; go on with the next
    consumed = i - 1
    if not consumed:
        return BatchResult(0, None if failed else _stop_at_start(pf, data))
    pf.msg_id = _id_ending_at(data, pos) if failed else m[4]  # type: ignore[index]
    pf.offset = base + pos
    return _progress(pf, consumed)


def _deliver_batch(pf: PartitionFetch, data: bytes) -> BatchResult:
    topic, partition, codec, base = pf.topic, pf.partition, pf.codec, pf.offset
    plain, with_attribute = message_classes(codec)
    verify, crc, unpack, struct_error = pf.verify, _crc32, _unpack_header, struct.error
    listener = pf.batch_listener
    assert listener is not None
    limit, slice_bytes = pf.max_batch, _SLICE_BYTES
    n = len(data)
    pos = consumed = 0
    while True:
        batch: list[Message] = []
        add = batch.append
        more = False
        first = pos
        for _ in repeat(None, limit):
            try:
                length, check, msg_id, flag = unpack(data, pos)
            except struct_error:
                break
            end = pos + 20 + length
            if end > n:
                break
            payload = data[pos + 20:end]
            if verify and crc(payload) & 0x7FFFFFFF != check:
                break
            add((plain if not flag else with_attribute if flag & 1 else plain)(
                (topic, partition, base + pos, base + end, msg_id, flag, payload, codec)))
            pos = end
            if pos - first >= slice_bytes:
                more = True
                break
        else:
            more = True
        if not batch or not _hand_slice(pf, listener, batch):
            break
        consumed += len(batch)
        if not more:
            break
    if not consumed:
        return BatchResult(0, None if pf.retry_delay is not None else _stop_at_start(pf, data))
    return _progress(pf, consumed)


def _walk(pf: PartitionFetch, data: _Data):  # noqa: ANN202 - a generator of messages
    """Messages of ``data`` in order, checksums verified; stops at the first bad or cut one."""
    topic, partition, codec, base = pf.topic, pf.partition, pf.codec, pf.offset
    plain, with_attribute = message_classes(codec)
    if _NATIVE is not None:
        pos, status, more = 0, _NATIVE.LIMIT, _NATIVE.LIMIT
        while status == more:
            batch, pos, status = _NATIVE.take(data, pos, base, 256, 1 << 62, pf.verify,
                                              _MAX_PAYLOAD, topic, partition, codec, plain,
                                              with_attribute)
            yield from batch
        return
    n, pos = len(data), 0
    while pos + 20 <= n:
        length, check, msg_id, flag = _unpack_header(data, pos)
        end = pos + 20 + length
        if end > n:
            return
        payload = data[pos + 20:end]
        if pf.verify and _crc32(payload) & 0x7FFFFFFF != check:
            return
        yield (plain if not flag else with_attribute if flag & 1 else plain)(
            (topic, partition, base + pos, base + end, msg_id, flag, payload, codec))
        pos = end


def _deliver_manual(pf: PartitionFetch, data: _Data) -> BatchResult:
    """Manual-ack mode: progress per message, a rollback stops the batch at once."""
    consumed = 0
    listener = pf.listener
    assert listener is not None
    for m in _walk(pf, data):
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


def _deliver_concurrent(pf: PartitionFetch, data: _Data) -> BatchResult:
    """Concurrent mode: hand each message to the pool; fetching moves on at once."""
    consumed = 0
    inflight, submit = pf.inflight, pf.dispatcher.submit
    prev = pf.msg_id
    for m in _walk(pf, data):
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
