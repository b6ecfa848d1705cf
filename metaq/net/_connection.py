"""A blocking, one-request-at-a-time connection to a Metaq broker.

Used by fetch runners (each owns its connections, so no locking), by tools
that ask a broker for offsets, and by tests.  Replies are read into one
reusable buffer: a ``get`` returns a memoryview into it that stays valid until
the next request on the same connection.

A fetch runner pipelines one ``get`` ahead: :meth:`BrokerConnection.send_get`
sends it, :meth:`BrokerConnection.read_get` reads its reply later (as bytes,
after an optional prefix), :meth:`BrokerConnection.read_get_into` receives it
straight into the caller's buffer, or :meth:`BrokerConnection.skip_reply` drops
it; replies come back in request order.

This module is the transport error boundary of the blocking client: every
``OSError`` (refused, reset, timed out) becomes a
:class:`~metaq.BrokerUnavailableError` naming the broker, with the ``OSError``
as its cause, and a reply that cannot be parsed a
:class:`~metaq.MalformedReplyError` (a kind of both ``ProtocolError`` and
``BrokerUnavailableError``).  Either closes the connection.  Callers catch
``BrokerUnavailableError`` for "this connection is gone" and ``BrokerError``
for "the broker answered no".
"""

from __future__ import annotations

import itertools
import re
import select
import socket
from typing import Any

from metaq._errors import (
    BrokerError,
    BrokerUnavailableError,
    ConnectionClosedError,
    MalformedReplyError,
)
from metaq._types import BrokerAddress
from metaq.protocol import (
    encode_get,
    encode_offset,
    encode_put,
    encode_stats,
    encode_transaction,
    encode_tx_puts,
    encode_version,
    is_unwritten_partition,
    tx_acks,
)

__all__ = ["BrokerConnection", "parse_meta_uri", "unavailable"]

_MAX_HEADER = 1024
_HELD_MAX = 256 * 1024
_HEADROOM = 64 * 1024
#: a ``result 200 <length> <opaque>`` line, read in place by :meth:`read_results`
_OK_HEAD = re.compile(rb"result 200 ([0-9]{1,9}) (-?[0-9]{1,10})\r\n").match
#: most bytes :meth:`BrokerConnection.read_tx_acks` waits for before reading one by one
_TX_ACKS_MAX = 8 << 20


def unavailable(address: BrokerAddress, doing: str, e: OSError) -> BrokerUnavailableError:
    """The one conversion of a socket error (the caller raises it ``from e``)."""
    what = "timed out" if isinstance(e, TimeoutError) else str(e) or type(e).__name__
    return BrokerUnavailableError(f"{doing} broker {address} failed: {what}", address=address)


def parse_meta_uri(uri: str) -> BrokerAddress:
    """``meta://host:port`` (IPv6 in brackets) to ``(host, port)``."""
    from zk_layout import decode_broker_uri

    parsed = decode_broker_uri(uri.encode() if isinstance(uri, str) else uri)
    return BrokerAddress(parsed.host, parsed.port)


class BrokerConnection:
    """One TCP connection; ``get``/``offset``/``stats``/``version`` block until answered."""

    def __init__(self, host: str, port: int, *, timeout: float = 10.0) -> None:
        self.address = BrokerAddress(host, port)
        try:
            self._sock = socket.create_connection(self.address, timeout=timeout)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        except OSError as e:
            raise unavailable(self.address, "connecting to", e) from e
        self._buf = bytearray(64 * 1024)
        self._start = 0  # unread bytes are _buf[_start:_end]
        self._end = 0
        self._opaque = itertools.count(1)
        self._closed = False
        self._held: list[bytes] = []  # puts queued by send_put(hold=True)
        self._held_size = 0
        #: ``(topic, partition)`` a Java broker said it has no storage for (see offset())
        self.unwritten: set[tuple[str, int]] = set()

    def __enter__(self) -> BrokerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._sock.close()
            except OSError:
                pass

    def idle_and_open(self) -> bool:
        """For a connection kept idle between uses (a pool): True when it is open and
        nothing has arrived on it.  Readable means the broker closed or reset it (it
        restarted, or closed an idle client), or sent something nobody asked for:
        either way not one to send on.  One zero-timeout poll; closes it when not."""
        if self._closed:
            return False
        try:
            p = select.poll()
            p.register(self._sock, select.POLLIN | select.POLLERR | select.POLLHUP)
            quiet = not p.poll(0)
        except (OSError, ValueError):
            quiet = False
        if not quiet:
            self.close()
        return quiet

    # -- requests ------------------------------------------------------------

    def get(self, topic: str, group: str, partition: int, offset: int,
            max_size: int) -> memoryview:
        """Raw message bytes from ``offset``; raises BrokerError for a ``result``."""
        opaque = next(self._opaque)
        self._send(encode_get(topic, group, partition, offset, max_size, opaque))
        return self._reply(opaque, want_value=True)

    def send_get(self, topic: str, group: str, partition: int, offset: int,
                 max_size: int) -> int:
        """Send a ``get`` without waiting; returns the opaque to read its reply with."""
        opaque = next(self._opaque)
        self._send(encode_get(topic, group, partition, offset, max_size, opaque))
        return opaque

    def read_get(self, opaque: int, prefix: bytes = b"") -> bytes:
        """The reply to :meth:`send_get` ``opaque`` as ``prefix + body`` (one copy);
        raises BrokerError for a ``result``."""
        body = self._reply(opaque, want_value=True)
        return prefix + body if prefix else bytes(body)

    def read_get_into(self, opaque: int, prefix: bytes,
                      buf: bytearray | None) -> tuple[bytearray, int]:
        """The reply to :meth:`send_get` ``opaque``, received straight into ``buf``
        after ``prefix``: no copy of the body through the connection's own buffer.

        Returns ``(buffer, length)``: the bytes are ``buffer[:length]``; the buffer
        is ``buf`` when it is big enough, else a new one (``buf`` is never resized,
        so views of it stay valid).  Raises BrokerError for a ``result``.
        """
        code, length = self._head(opaque)
        if code != 200:
            self._body(code, length)  # raises
        keep = len(prefix)
        need = keep + length
        if buf is None or len(buf) < need:
            buf = bytearray(need + _HEADROOM)
        view = memoryview(buf)
        view[:keep] = prefix
        have = min(self._end - self._start, length)
        view[keep:keep + have] = memoryview(self._buf)[self._start:self._start + have]
        self._start += have
        got = keep + have
        while got < need:
            got += self._recv_into(view[got:need])
        return buf, need

    def skip_reply(self, opaque: int) -> None:
        """Read and drop the reply to ``opaque`` (any code)."""
        try:
            self._reply(opaque, want_value=True)
        except BrokerError:
            pass

    def offset(self, topic: str, group: str, partition: int, offset: int) -> int:
        """The broker's nearest valid offset to ``offset`` (the ``offset`` command).

        A Java Metaq broker answers 404 "... is not exists" for a partition it has not
        created storage for (never written): that partition is empty, so this answers
        0 (log start = log end = 0), as Metaq's own client does, and remembers the
        partition in :attr:`unwritten` for tools to say so."""
        opaque = next(self._opaque)
        self._send(encode_offset(topic, group, partition, offset, opaque))
        try:
            body = bytes(self._reply(opaque, want_value=False))
        except BrokerError as e:
            if e.code == 404 and is_unwritten_partition(e.detail):
                self.unwritten.add((topic, partition))
                return 0
            raise
        try:
            return int(body)
        except ValueError:
            raise self._malformed(f"offset reply body is not a number: {body[:80]!r}") from None

    def resume_after_damage(self, topic: str, group: str, partition: int, bad: int) -> int:
        """Where to go on after a damaged message at ``bad``: the broker's nearest valid
        offset, above ``bad`` when the broker found the damage; ``bad`` itself (or
        below) when it sees a valid message there.  The broker answers the log start
        without looking at it, so there the byte after it is asked for too, which it
        answers through the message holding it (this one).  (A Java broker answers a
        segment start either way.)"""
        valid = self.offset(topic, group, partition, bad)
        if valid <= bad:
            valid = max(valid, self.offset(topic, group, partition, bad + 1))
        return valid

    def offset_for_time(self, topic: str, group: str, partition: int, when_ms: int
                        ) -> tuple[int, int | None]:
        """``(offset, its msgId time or None at the log end)`` of the first message at or
        after ``when_ms``: metaq-py's ``offset ... time=<ms>`` (only for a broker whose
        ``version`` lists ``+timeindex``; others answer it with an error)."""
        opaque = next(self._opaque)
        self._send(encode_offset(topic, group, partition, 0, opaque, when_ms))
        body = bytes(self._reply(opaque, want_value=False))
        parts = body.split()
        try:
            if len(parts) != 2:
                raise ValueError
            offset, t = int(parts[0]), int(parts[1])
        except ValueError:
            raise self._malformed("offset-for-time reply is not '<offset> <time>': "
                                  f"{body[:80]!r}") from None
        return offset, (t if t >= 0 else None)

    def send_put(self, topic: str, partition: int, payload: bytes, flag: int, checksum: int,
                 tx_key: str | None = None, *, hold: bool = False) -> int:
        """Send a ``put`` without waiting; its opaque, for :meth:`read_result`.  With
        ``hold`` it is only queued: sent with the next request that is not held (or
        when the queue passes 256 KiB), several puts in one write."""
        opaque = next(self._opaque)
        data = encode_put(topic, partition, payload, flag, checksum, opaque, tx_key)
        self._send_or_hold(data, hold)
        return opaque

    def send_tx_puts(self, topic: str, partition: int, payloads: list[bytes], flag: int,
                     checksums: list[int], tx_key: str, *, hold: bool = False) -> list[int]:
        """:meth:`send_put` of several payloads to one partition joining transaction
        ``tx_key``, encoded together; their opaques, in order."""
        opaques = list(itertools.islice(self._opaque, len(payloads)))
        data = encode_tx_puts(topic, partition, flag, payloads, checksums, tx_key, opaques)
        self._send_or_hold(data, hold)
        return opaques

    def _send_or_hold(self, data: bytes, hold: bool) -> None:
        """Send ``data`` (with what is held), or with ``hold`` queue it for the next
        request not held (sent at once when the queue passes 256 KiB)."""
        if hold:
            self._held.append(data)
            self._held_size += len(data)
            if self._held_size >= _HELD_MAX:
                self._send(b"")
        else:
            self._send(data)

    def read_result(self, opaque: int) -> bytes:
        """The body of the ``result 200`` answering ``opaque``; BrokerError otherwise."""
        if self._held:
            self._send(b"")
        return bytes(self._reply(opaque, want_value=False))

    def read_tx_acks(self, opaques: list[int], cls: type, broker_id: int, index: int,
                     name: str) -> list[Any] | None:
        """The answers to ``opaques`` (a transaction's puts to partition ``index``, sent in
        that order) read in bulk when every one is an acknowledgement,
        ``<msgId> <index> -1``: ``cls`` tuples ``(msgId, name, -1, broker_id, index)``
        (:func:`metaq.protocol.tx_acks`).  None, with nothing read, for anything else:
        :meth:`read_results` then reads them one by one (and names what is wrong)."""
        if self._held:
            self._send(b"")
        while True:
            got = tx_acks(self._buf, self._start, self._end, opaques, cls, broker_id, index,
                          name)
            if got is False:
                return None
            if got is not None:
                results, self._start = got
                return results
            if self._end - self._start > _TX_ACKS_MAX:
                return None
            self._fill(self._end - self._start + 1)

    def read_results(self, opaques: list[int]) -> list[bytes | BrokerError]:
        """The bodies of the answers to ``opaques`` (requests sent in that order, such
        as a transaction's puts), a BrokerError in place of each refused one."""
        if self._held:
            self._send(b"")
        out: list[bytes | BrokerError] = []
        append = out.append
        for opaque in opaques:
            m = _OK_HEAD(self._buf, self._start, self._end)
            if m is not None and int(m.group(2)) == opaque:  # whole in the buffer: at once
                begin = m.end()
                stop = begin + int(m.group(1))
                if stop <= self._end:
                    append(bytes(self._buf[begin:stop]))
                    self._start = stop
                    continue
            code, length = self._head(opaque)
            try:
                append(bytes(self._body(code, length)))
            except BrokerError as e:
                append(e)
        return out

    def transaction(self, key: str, session_id: str, type: str, *, timeout: int = 0,
                    unique_qualifier: str | None = None) -> bytes | None:
        """A ``transaction`` request; the body of its ``result 200`` (BrokerError for
        another code), or None for END, which the broker does not answer."""
        opaque = self.send_transaction(key, session_id, type, timeout=timeout,
                                       unique_qualifier=unique_qualifier)
        if type == "END":
            return None
        return bytes(self._reply(opaque, want_value=False))

    def send_transaction(self, key: str, session_id: str, type: str, *, timeout: int = 0,
                         unique_qualifier: str | None = None, puts: int | None = None,
                         hold: bool = False) -> int:
        """Send a ``transaction`` request without waiting (queued with the held puts
        when ``hold``, as :meth:`send_put`); its opaque, for :meth:`read_result`.
        ``puts``: a pipelined local commit's count (``metaq.protocol._transaction``)."""
        opaque = next(self._opaque)
        data = encode_transaction(key, session_id, type, opaque, timeout=timeout,
                                  unique_qualifier=unique_qualifier, puts=puts)
        if hold:
            self._held.append(data)
            self._held_size += len(data)
        else:
            self._send(data)
        return opaque

    def stats(self, item: str | None = None) -> str:
        opaque = next(self._opaque)
        self._send(encode_stats(item, opaque))
        return bytes(self._reply(opaque, want_value=False)).decode("utf-8", "replace")

    def version(self) -> str:
        opaque = next(self._opaque)
        self._send(encode_version(opaque))
        return bytes(self._reply(opaque, want_value=False)).decode("utf-8", "replace")

    # -- wire ----------------------------------------------------------------

    def _send(self, data: bytes) -> None:
        if self._closed:
            raise ConnectionClosedError(f"connection to {self._where()} is closed",
                                        address=self.address)
        if self._held:
            self._held.append(data)
            data = b"".join(self._held)
            self._held.clear()
            self._held_size = 0
        try:
            self._sock.sendall(data)
        except OSError as e:
            raise self._failed("sending to", e) from e

    def _where(self) -> str:
        return str(self.address)

    def _failed(self, doing: str, e: OSError) -> BrokerUnavailableError:
        """Close and say why: the one conversion of socket errors (module docstring)."""
        self.close()
        return unavailable(self.address, doing, e)

    def _malformed(self, what: str) -> MalformedReplyError:
        """Close (the stream can no longer be trusted) and say what was wrong."""
        self.close()
        return MalformedReplyError(f"{what} (from broker {self._where()})",
                                   address=self.address)

    def _fill(self, need: int) -> None:
        """Make at least ``need`` unread bytes available in the buffer."""
        if self._end - self._start >= need:
            return
        if len(self._buf) - self._start < need:
            # A fresh buffer rather than a resize: a caller may still hold a
            # memoryview of the old one (a get reply being processed).
            # Room for a reply line before the next body too, so that the
            # buffer is not replaced again for every reply of the same size.
            unread = self._end - self._start
            new = bytearray(max(need + _HEADROOM, len(self._buf)))
            new[:unread] = self._buf[self._start:self._end]
            self._buf, self._start, self._end = new, 0, unread
        view = memoryview(self._buf)
        while self._end - self._start < need:
            self._end += self._recv_into(view[self._end:])

    def _recv_into(self, view: memoryview) -> int:
        """One ``recv_into``; an error or the peer closing closes this connection."""
        try:
            n = self._sock.recv_into(view)
        except OSError as e:
            raise self._failed("receiving from", e) from e
        if n == 0:
            self.close()
            raise ConnectionClosedError(f"{self._where()} closed the connection",
                                        address=self.address)
        return n

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._buf[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start > _MAX_HEADER:
                raise self._malformed(f"reply line over {_MAX_HEADER} bytes")
            self._fill(self._end - self._start + 1)

    def _reply(self, opaque: int, *, want_value: bool) -> memoryview:
        return self._body(*self._head(opaque))

    def _head(self, opaque: int) -> tuple[int, int]:
        """Read a reply line: ``(code, body length)``; a ``value`` line is code 200."""
        if self._start == self._end:
            self._start = self._end = 0
        line = self._line()
        parts = line.split(b" ")
        try:
            if parts[0] == b"value" and len(parts) == 3:
                code, length, got = 200, int(parts[1]), int(parts[2])
            elif parts[0] == b"result" and len(parts) == 4:
                code, length, got = int(parts[1]), int(parts[2]), int(parts[3])
            else:
                raise ValueError
            if length < 0:
                raise ValueError
        except ValueError:
            raise self._malformed(f"malformed reply line: {line[:120]!r}") from None
        if got != opaque:
            raise self._malformed(f"reply opaque {got} does not match request {opaque}")
        return code, length

    def _body(self, code: int, length: int) -> memoryview:
        self._fill(length)
        body = memoryview(self._buf)[self._start:self._start + length]
        self._start += length
        if code == 200:
            return body
        raise BrokerError(code, bytes(body).decode("utf-8", "replace"), broker=self._where())
