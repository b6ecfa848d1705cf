"""Batches: many messages to one partition, encoded in one pass, one future.

:meth:`Producer.send_batch` hands its work to a :class:`BatchSender`, which
checks and encodes every body first (nothing is sent when one is bad), asks
the send path for **one** partition for the whole batch (the partitioner is
asked once, with the first body and the key; round-robin moves on per batch)
and hands the puts to that broker's connection in chunks
(:meth:`metaq.net.PipelinedConnection.put_many`: one write per chunk,
replies completed in bulk).  The broker stores the batch's messages in order.

The batch's future resolves to a :class:`BatchResults`: the broker's
answers kept as columns, a ``SendResult`` built only when one is read.

Every message still gets its own outcome.  One the broker refuses with a
code a retry may fix, or one whose connection fails before it is answered,
becomes a :class:`_BatchItem` (a one-message send) and is retried on another
partition by the send path's usual rule (retries, backoff, ``send_timeout``).
An idempotent producer's chunk, on a connection that offers it, takes ``n``
consecutive seqs of its partition's sequence (``_idempotence``) and goes with one
``idem`` mark; a message of it retried alone keeps its seq (and its partition).

The :class:`BatchFuture` completes when every message has its outcome: with
the :class:`BatchResults` in batch order, or with
:class:`~metaq.BatchSendError` naming each message that was not stored and
carrying the results of those that were.

What a batch needs from the rest of the producer comes through two objects:
the :class:`~metaq.producer._path.SendPath` (route, pick, connection, a
failed broker, a failed message's retries) and the
:class:`~metaq.producer._message.MessageEncoder` (codec, size limit,
attribute header).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from metaq._errors import (
    BatchSendError,
    BrokerError,
    ConnectionClosedError,
    MessageError,
    MessageTooLargeError,
    ProtocolError,
    SendTimeoutError,
)
from metaq.net import LightFuture
from metaq.producer._config import ProducerConfig
from metaq.producer._message import MessageEncoder
from metaq.producer._path import SendPath
from metaq.producer._router import TopicRoute
from metaq.producer._send import NO_RETRY, Send, SendResult, make_result, partition_names
from metaq.protocol import CHECKSUM_MASK, FLAG_HAS_ATTRIBUTE, encode_idem_mark
from metaq.protocol import crc32 as _crc32  # ISA-L when installed (one selection point)
from zk_layout import Partition

__all__ = ["BatchFuture", "BatchResults", "BatchSender", "chunk_bounds"]

#: Most messages and bytes per chunk (one put_many, one write); also capped by the window.
CHUNK_MESSAGES = 4096
CHUNK_BYTES = 4 * 1024 * 1024
#: Bytes a put line adds to its payload, at most (for chunking; the window counts exactly).
_LINE_MAX = 320
_monotonic = time.monotonic
_repeat = itertools.repeat


class BatchResults(Sequence):
    """Where the messages of one batch were stored: a read-only sequence with
    the :class:`SendResult` of message ``i`` at index ``i`` (``None`` for a
    message that was not stored, in :attr:`BatchSendError.results
    <metaq.BatchSendError>`).

    It keeps the broker's answers as columns and builds each ``SendResult``
    when it is read, so a batch costs no object per message until then;
    ``list(results)`` makes a plain list.  :attr:`msg_ids` and
    :attr:`offsets` give whole columns.
    """

    __slots__ = ("_ids", "_offsets", "_indexes", "_brokers")

    def __init__(self, n: int) -> None:
        self._ids: list[int | None] = [None] * n
        self._offsets = [0] * n
        self._indexes = [0] * n
        self._brokers = [0] * n

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]  # int -> SendResult, slice -> list
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self._ids)))]
        msg_id = self._ids[i]
        if msg_id is None:
            return None
        bid, index = self._brokers[i], int(self._indexes[i])
        return make_result((int(msg_id), partition_names(bid)[index], int(self._offsets[i]),
                             bid, index))

    def __iter__(self) -> Iterator[SendResult | None]:
        ids, brokers, indexes = self._ids, self._brokers, self._indexes
        bid = brokers[0] if brokers else 0
        if None in ids or brokers.count(bid) != len(brokers):
            return map(self.__getitem__, range(len(ids)))
        return map(make_result, zip(map(int, ids), map(partition_names(bid).__getitem__, indexes),
                                     map(int, self._offsets), _repeat(bid), map(int, indexes),
                                     strict=False))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BatchResults):
            return list(self) == list(other)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        n = len(self._ids)
        shown = ", ".join(map(repr, (self[i] for i in range(min(n, 3)))))
        return f"BatchResults([{shown}{', ...' if n > 3 else ''}], {n} messages)"

    @property
    def msg_ids(self) -> list[int | None]:
        """Every message's msgId (``None`` where it was not stored), in batch order."""
        ids = self._ids
        return list(map(int, ids)) if None not in ids else [
            None if i is None else int(i) for i in ids]

    @property
    def offsets(self) -> list[int | None]:
        """Every message's offset in its partition (``None`` where it was not stored)."""
        if None not in self._ids:
            return list(map(int, self._offsets))
        return [None if i is None else int(o)
                for i, o in zip(self._ids, self._offsets, strict=True)]

    def _set(self, first: int, msg_ids: list, indexes: list, offsets: list,
             broker_id: int) -> None:
        # Columns hold ints or their decimal bytes (as the reader got them): int() on read.
        stop = first + len(msg_ids)
        self._ids[first:stop] = msg_ids
        self._offsets[first:stop] = offsets
        self._indexes[first:stop] = indexes
        self._brokers[first:stop] = _repeat(broker_id, stop - first)


class BatchFuture(LightFuture):
    """The future of one batch: ``result()`` is a :class:`BatchResults` (the
    :class:`SendResult` of every message, in the order of the bodies); raises
    :class:`~metaq.BatchSendError` when some messages were not stored (after
    their retries)."""

    __slots__ = ("topic", "size", "_results", "_errors", "_left", "_lock")  # see LightFuture

    def __init__(self, topic: str, n: int) -> None:
        super().__init__()
        self.topic = topic
        self.size = n
        self._results = BatchResults(n)
        self._errors: dict[int, BaseException] = {}
        self._left = n
        self._lock = threading.Lock()

    def _acked(self, first: int, msg_ids: list, indexes: list, offsets: list,
               broker_id: int) -> None:
        """Messages ``first .. first + len(msg_ids) - 1`` were stored."""
        with self._lock:
            self._results._set(first, msg_ids, indexes, offsets, broker_id)
            self._left -= len(msg_ids)
            done = self._left == 0
        if done:
            self._complete()

    def _outcome(self, index: int, result: SendResult | None, exc: BaseException | None) -> None:
        """The final outcome of one message (a result or an exception)."""
        with self._lock:
            if exc is None:
                assert result is not None
                self._results._set(index, [result.msg_id], [result.index], [result.offset],
                                   result.broker_id)
            else:
                self._errors[index] = exc
            self._left -= 1
            done = self._left == 0
        if done:
            self._complete()

    def _complete(self) -> None:
        errors = self._errors
        if not errors:
            self.set_result(self._results)
            return
        failed = sorted(errors)
        shown = "; ".join(f"#{i}: {errors[i]}" for i in failed[:5])
        more = f"; and {len(failed) - 5} more" if len(failed) > 5 else ""
        err = BatchSendError(
            f"{len(failed)} of {self.size} messages of a batch to topic {self.topic!r} were "
            f"not stored ({shown}{more}); the other {self.size - len(failed)} were "
            f"(see .results and .errors)",
            results=self._results, errors={i: errors[i] for i in failed})
        err.__cause__ = errors[failed[0]]
        self.set_exception(err)


class _BatchItem(Send):
    """One message of a batch sent on its own (a retry): its outcome goes to the batch."""

    __slots__ = ("batch", "index")  # see Send

    def __init__(self, path: SendPath, topic: str, payload: bytes, flag: int, checksum: int,
                 deadline: float, batch: BatchFuture, index: int, part: Partition) -> None:
        super().__init__(path, topic, payload, flag, checksum, deadline)
        self.batch = batch
        self.index = index
        self.part = part
        self.attempts = 1  # the batch's attempt

    def set_result(self, result: Any) -> None:
        super().set_result(result)  # raises if it already had an outcome
        self.batch._outcome(self.index, result, None)

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self.batch._outcome(self.index, None, exception)

    @staticmethod
    def on_acks(requests: list, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None:
        for item, msg_id, index, offset in zip(requests, msg_ids, partitions, offsets,
                                               strict=True):
            item.on_reply(200, b" ".join((msg_id, index, offset)))


class _Chunk:
    """The request one connection completes for one chunk of a batch (by index)."""

    __slots__ = ("path", "batch", "base", "payloads", "flag", "checksums", "part", "deadline",
                 "pid", "seq")

    def __init__(self, path: SendPath, batch: BatchFuture, base: int, payloads: list[bytes],
                 flag: int, checksums: list[int], part: Partition, deadline: float) -> None:
        self.path = path
        self.batch = batch
        self.base = base
        self.payloads = payloads
        self.flag = flag
        self.checksums = checksums
        self.part = part
        self.deadline = deadline
        #: the idempotent producer's id and first seq of this chunk (seq None: plain puts)
        self.pid = 0
        self.seq: int | None = None

    def on_acks(self, first: int, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None:
        self.batch._acked(self.base + first, msg_ids, partitions, offsets, self.part.broker_id)

    def on_reply_at(self, index: int, code: int, body: bytes) -> None:
        bid = self.part.broker_id
        if code == 200:
            try:
                msg_id, pindex, offset = map(int, body.split(b" "))
            except ValueError:
                self.batch._outcome(self.base + index, None, ProtocolError(
                    f"broker {bid} answered a put with {bytes(body[:120])!r}, not "
                    f"'<msgId> <partition> <offset>'"))
                return
            self.batch._acked(self.base + index, [msg_id], [pindex], [offset], bid)
            return
        err = BrokerError(code, body.decode("utf-8", "replace"),
                          broker=f"broker {bid}, partition {self.part}")
        if code in NO_RETRY:
            if self.seq is not None:  # later seqs must not wait for this one
                self.path.sequences.restart(self.part, self.pid)  # type: ignore[union-attr]
            self.batch._outcome(self.base + index, None, err)
        else:
            self.path.attempt_failed(self.item(index), err)

    def on_error_at(self, index: int, exc: BaseException) -> None:
        self.path.attempt_failed(self.item(index), exc)

    def item(self, index: int) -> _BatchItem:
        """Message ``index`` of this chunk as a one-message send (for its retries)."""
        item = _BatchItem(self.path, self.batch.topic, self.payloads[index], self.flag,
                          self.checksums[index], self.deadline, self.batch, self.base + index,
                          self.part)
        if self.seq is not None:  # a resend carries the same (pid, seq)
            item.pid = self.pid
            item.seq = self.seq + index
        return item


# --------------------------------------------------------------------------- sending

class BatchSender:
    """Sends batches over ``path``, their bodies made payloads by ``encoder``;
    ``config`` gives the send timeout and, with the connection's window, the chunk size."""

    def __init__(self, path: SendPath, encoder: MessageEncoder, config: ProducerConfig) -> None:
        self._path = path
        self._encoder = encoder
        self._timeout = config.send_timeout
        self._chunk_messages = max(1, min(CHUNK_MESSAGES, config.max_in_flight // 2))
        self._chunk_bytes = max(1, min(CHUNK_BYTES, config.max_in_flight_bytes // 2))

    def submit(self, topic: str, bodies: Sequence[Any] | Iterable[Any], attribute: str | None,
               key: Any) -> BatchFuture:
        """The work of :meth:`Producer.send_batch` (see there), once the producer
        checked that it is open."""
        path = self._path
        route = path.route(topic)
        if not isinstance(bodies, list):
            if isinstance(bodies, (bytes, bytearray, memoryview, str, dict)):
                raise MessageError(f"send_batch needs a sequence of bodies, not one "
                                   f"{type(bodies).__name__} (use send_async for one message)")
            bodies = list(bodies)
        n = len(bodies)
        batch = BatchFuture(topic, n)
        encoder = self._encoder
        if encoder.raw_bytes and n and set(map(type, bodies)) == {bytes}:
            data = bodies
        else:
            data = encoder.encode_all(bodies)
        if not n:
            batch.set_result(batch._results)
            return batch
        max_size = encoder.max_size
        if max(map(len, data)) > max_size:
            i = next(i for i, d in enumerate(data) if len(d) > max_size)
            raise MessageTooLargeError(
                f"message #{i} of the batch has a body of {len(data[i])} bytes, over the "
                f"limit of {max_size} bytes (max_message_size); nothing was sent to topic "
                f"{topic!r}")
        if attribute is None:
            payloads, flag = data, 0
        else:
            head = encoder.with_attribute(b"", attribute)
            payloads, flag = list(map(head.__add__, data)), FLAG_HAS_ATTRIBUTE
        part = path.pick(topic, route, data[0], key)
        if part is None:  # no broker publishes topic right now: wait within the send timeout
            route = path.writable(topic, _monotonic() + self._timeout)
            part = path.pick(topic, route, data[0], key)
        checksums = list(map(CHECKSUM_MASK.__and__, map(_crc32, payloads)))
        self._dispatch(batch, route, part, payloads, flag, checksums)
        return batch

    def _dispatch(self, batch: BatchFuture, route: TopicRoute, part: Partition,
                  payloads: list[bytes], flag: int, checksums: list[int]) -> None:
        """Hand the chunks to ``part``'s connection, in order.  A chunk the connection
        refuses (it failed) and every later one go message by message through the
        retry thread, in order; nothing raises: outcomes go to the batch."""
        path = self._path
        bid = part.broker_id
        bounds = chunk_bounds(list(map(len, payloads)), self._chunk_messages,
                              self._chunk_bytes)
        topic = batch.topic
        for k, (a, b) in enumerate(bounds):
            deadline = _monotonic() + self._timeout
            chunk = _Chunk(path, batch, a, payloads[a:b], flag, checksums[a:b], part, deadline)
            try:
                conn = path.connection(part, route, deadline)
                if path.sequences is not None and conn.idempotent:  # type: ignore[attr-defined]
                    sequence = path.sequences.of(part)
                    with sequence.lock:  # puts leave in seq order; seqs used once queued
                        pid, seq = chunk.pid, chunk.seq = sequence.take()
                        try:
                            conn.put_many(topic, part.index, chunk.payloads, flag,
                                          chunk.checksums, chunk, deadline, True,
                                          encode_idem_mark(pid, seq, b - a))
                        except BaseException:
                            chunk.seq = None
                            raise
                        sequence.taken(pid, seq, b - a)
                else:
                    conn.put_many(topic, part.index, chunk.payloads, flag, chunk.checksums,
                                  chunk, deadline, True)
            except ConnectionClosedError as e:
                path.broker_failed(bid)
                for a2, b2 in bounds[k:]:
                    rest = chunk if a2 == a else _Chunk(path, batch, a2, payloads[a2:b2], flag,
                                                        checksums[a2:b2], part, deadline)
                    for i in range(b2 - a2):
                        path.attempt_failed(rest.item(i), e)
                return
            except (SendTimeoutError, ProtocolError) as e:
                for i in range(a, len(payloads)):
                    batch._outcome(i, None, e)
                return


def chunk_bounds(lengths: list[int], max_messages: int, max_bytes: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``lengths`` in order, each at most
    ``max_messages`` messages and (unless one message alone) ``max_bytes``."""
    n = len(lengths)
    if n <= max_messages and sum(lengths) + _LINE_MAX * n <= max_bytes:
        return [(0, n)]
    out = []
    start = size = 0
    for i, length in enumerate(lengths):
        length += _LINE_MAX
        if i > start and (i - start >= max_messages or size + length > max_bytes):
            out.append((start, i))
            start, size = i, 0
        size += length
    out.append((start, n))
    return out
