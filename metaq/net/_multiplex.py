"""A non-blocking connection whose replies are matched to requests by opaque.

Held gets (``get ... hold=<ms>``) are answered when a message arrives or the
hold runs out, so out of order: :class:`MultiplexedConnection` keeps many of
them out on one socket and hands each reply back with the token its request
was sent with.  It does no waiting of its own: the owner's ``selectors`` loop
(the consumer's long poller; an asyncio loop's reader callback works the same
way) calls :meth:`~MultiplexedConnection.flush` when the socket is writable
and :meth:`~MultiplexedConnection.read` when it is readable.

Transport failures are converted here, as in :mod:`metaq.net._connection`:
an ``OSError`` becomes :class:`~metaq.BrokerUnavailableError` (the cause
attached), a peer that closes :class:`~metaq.ConnectionClosedError`, and bytes
that do not parse :class:`~metaq.MalformedReplyError`.  After any of them the
connection is closed and its pending tokens are the caller's to hand back
(:meth:`~MultiplexedConnection.take_pending`).
"""

from __future__ import annotations

import itertools
import socket
from typing import Generic, TypeVar

from metaq._errors import (
    BrokerUnavailableError,
    ConnectionClosedError,
    MalformedReplyError,
    MetaqError,
)
from metaq._types import BrokerAddress
from metaq.net._connection import unavailable
from metaq.protocol import OPAQUE_MASK, ReplyParser, Result, Value, encode_get

__all__ = ["MultiplexedConnection"]

T = TypeVar("T")

#: Bytes received per ``recv_into`` (into the connection's own buffer; a plain
#: ``recv`` of 128 KiB or more costs a fresh mmap per call, about 11 µs).
_CHUNK = 1 << 16
_MAX_CHUNKS = 16  # per read (the selector comes back for the rest)


class MultiplexedConnection(Generic[T]):
    """One non-blocking TCP connection to a broker; replies matched by opaque.

    ``T`` is whatever the owner sends a request with (a held get's parked
    partition): :meth:`read` returns ``(token, reply)`` pairs.
    """

    __slots__ = ("address", "_sock", "_parser", "_out", "_opaque", "_pending", "closed",
                 "_view")

    def __init__(self, address: BrokerAddress, *, timeout: float) -> None:
        self.address = address
        try:
            sock = socket.create_connection(address, timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
        except OSError as e:
            raise unavailable(address, "connecting to", e) from e
        self._sock = sock
        self._parser = ReplyParser()
        self._out = bytearray()
        self._opaque = itertools.count(1)
        self._pending: dict[int, T] = {}
        self.closed = False
        self._view = memoryview(bytearray(_CHUNK))

    def fileno(self) -> int:
        """The socket's descriptor, for a selector."""
        return self._sock.fileno()

    # -- requests -----------------------------------------------------------------------

    def send_get(self, token: T, topic: str, group: str, partition: int, offset: int,
                 max_size: int, *, hold_ms: int = 0) -> None:
        """Queue a ``get`` (held for ``hold_ms`` when > 0) answered to ``token``;
        sent by :meth:`flush`.  ProtocolError for a name the protocol cannot carry."""
        opaque = next(self._opaque) & OPAQUE_MASK
        self._out += encode_get(topic, group, partition, offset, max_size, opaque, hold_ms)
        self._pending[opaque] = token

    @property
    def wants_write(self) -> bool:
        """Bytes are queued that the socket did not take yet."""
        return bool(self._out)

    @property
    def pending(self) -> list[T]:
        """Tokens of the requests not answered yet."""
        return list(self._pending.values())

    def take_pending(self) -> list[T]:
        """Forget every unanswered request; their tokens (after a failure or close)."""
        pending, self._pending = self._pending, {}
        return list(pending.values())

    # -- driven by the owner's loop --------------------------------------------------------

    def flush(self) -> None:
        """Send what the socket takes now (BrokerUnavailableError when it fails)."""
        try:
            while self._out:
                n = self._sock.send(self._out)
                del self._out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            raise self._failed("sending to", e) from e

    def read(self) -> list[tuple[T, Result | Value]]:
        """Receive what is there and return the replies completed, with their tokens
        (replies to no request of ours are dropped)."""
        view = self._view
        chunks = []
        eof = False
        try:
            while True:  # what is there, in chunks (a big reply: several)
                n = self._sock.recv_into(view)
                if not n:
                    eof = True
                    break
                chunks.append(view[:n].tobytes())
                if n < _CHUNK or len(chunks) == _MAX_CHUNKS:
                    break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            raise self._failed("receiving from", e) from e
        if not chunks:
            if not eof:
                return []
            self.close()
            raise ConnectionClosedError(f"broker {self.address} closed the connection",
                                        address=self.address)
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        try:
            replies = self._parser.feed(data)
        except MetaqError as e:
            self.close()
            raise MalformedReplyError(f"{e} (from broker {self.address})",
                                      address=self.address) from e
        out = []
        for reply in replies:
            token = self._pending.pop(reply.opaque, None)
            if token is not None:
                out.append((token, reply))
        return out

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._sock.close()
            except OSError:
                pass

    def _failed(self, doing: str, e: OSError) -> BrokerUnavailableError:
        self.close()
        return unavailable(self.address, doing, e)
