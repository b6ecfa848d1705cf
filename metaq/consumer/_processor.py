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
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metaq._codec import Codec
from metaq._errors import ChecksumError
from metaq.consumer._message import Message

__all__ = ["PartitionFetch", "BatchResult", "process_batch", "Rewind"]

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">iiqi")
_unpack_header = _HEADER.unpack_from
_HEADER_SIZE = 20
_MAX_LENGTH = 0x7FFFFFFF


class _ChecksumAt(ChecksumError):
    def __init__(self, topic: str, partition: str, offset: int, next_offset: int,
                 expected: int, actual: int) -> None:
        self.offset = offset
        self.next_offset = next_offset
        super().__init__(f"checksum mismatch in {topic}/{partition} at offset {offset}: "
                         f"header says {expected}, payload has {actual}")


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
                 epoch: int = 0) -> None:
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
        # scheduling, guarded by the FetchManager's lock
        self.active = False
        self.busy = False
        self.paused = False
        self.parked = False
        self.due = 0.0
        self.queued_token = -1
        # backoff and counters, owned by the runner holding it
        self.delay = 0.0
        self.failures = 0
        self.grow_size_streak = 0
        self.checksum_failures = 0
        self.retry_offset = -1
        self.retry_count = 0
        self.retry_delay: float | None = None
        self.consumed = 0

    def __repr__(self) -> str:
        return f"PartitionFetch({self.topic}/{self.partition} @ {self.offset})"


@dataclass(slots=True)
class BatchResult:
    consumed: int
    needed_size: int | None = None


def _split_batch(pf: PartitionFetch, data: bytes | memoryview) -> tuple[list[Message], int | None]:
    """Decode every complete message of ``data``; the size a larger one needs."""
    topic, partition, codec, verify = pf.topic, pf.partition, pf.codec, pf.verify
    base = pf.offset
    n = len(data)
    pos = 0
    out: list[Message] = []
    append = out.append
    crc32 = zlib.crc32
    while pos + _HEADER_SIZE <= n:
        length, checksum, msg_id, flag = _unpack_header(data, pos)
        end = pos + _HEADER_SIZE + length
        if length < 0 or length > _MAX_LENGTH - _HEADER_SIZE:
            raise _ChecksumAt(topic, partition, base + pos, base + pos + _HEADER_SIZE,
                              checksum, -1)
        if end > n:
            if pos == 0:
                return out, _HEADER_SIZE + length
            break
        payload = bytes(data[pos + _HEADER_SIZE:end])
        if verify:
            actual = crc32(payload) & 0x7FFFFFFF
            if actual != checksum:
                if out:
                    return out, None  # deliver the good ones first; the bad one next time
                raise _ChecksumAt(topic, partition, base + pos, base + end, checksum, actual)
        append(Message(topic, partition, base + pos, base + end, msg_id, flag, payload, codec))
        pos = end
    return out, None


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


def process_batch(pf: PartitionFetch, data: bytes | memoryview) -> BatchResult:
    """Hand the messages in ``data`` to ``pf``'s listener; move ``pf``'s progress."""
    pf.retry_delay = None
    messages, needed = _split_batch(pf, data)
    if not messages:
        return BatchResult(0, needed)
    consumed = 0
    if pf.batch_listener is not None:
        try:
            pf.batch_listener(messages)
        except Exception as exc:  # noqa: BLE001 - the listener's failure is handled here
            if not _fail(pf, messages[0], exc):
                return BatchResult(0)
            # rejected: the whole batch is handed to the reject handler one by one
            for m in messages[1:]:
                if pf.reject is not None:
                    pf.reject(m, exc)
        consumed = len(messages)
        last = messages[-1]
        pf.offset, pf.msg_id = last.next_offset, last.msg_id
    else:
        listener = pf.listener
        assert listener is not None
        for m in messages:
            try:
                listener(m)
            except Exception as exc:  # noqa: BLE001
                if not _fail(pf, m, exc):
                    break
            consumed += 1
            pf.offset, pf.msg_id = m.next_offset, m.msg_id
    if consumed and pf.retry_offset >= 0 and pf.retry_offset < pf.offset:
        pf.retry_offset, pf.retry_count = -1, 0
    pf.consumed += consumed
    return BatchResult(consumed)
