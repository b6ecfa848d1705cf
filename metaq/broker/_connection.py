"""One client connection of the broker: parse what it reads, hand the requests to
the server, send the replies in request order.

Replies queue behind a group-commit batch waiting for its fsync
(:class:`~metaq.broker._replies.Gate`) or a ``get`` going out with ``sendfile``
(:class:`~metaq.broker._replies.FileReply`); everything else is written at once,
coalesced per read.  Reading pauses while the client does not read its replies
(transport buffer or queue over the configured limits).  What a connection needs
from the server that accepted it is :class:`Host`; it knows nothing else of it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import threading
import time
from typing import Protocol

from metaq._errors import ProtocolError
from metaq.broker._config import BrokerConfig
from metaq.broker._replies import FileReply, Gate, result
from metaq.protocol import BadRequest, RequestParser

__all__ = ["Connection", "Host", "SENDFILE_MIN"]

log = logging.getLogger(__name__)

_CLOSE = object()
#: The connections of one event loop receive into one buffer (the loop's thread reads
#: one socket at a time, and the bytes are copied out before anything else runs): a
#: plain ``recv(256 KiB)`` per read, asyncio's default, costs a fresh mmap of that size
#: each time (about 11 µs, more than a small put's whole work).  One buffer per thread,
#: never one per process: brokers embedded in one process each run their own loop in
#: their own thread, and a ``recv_into`` releases the GIL, so a shared buffer would let
#: one broker's read overwrite another's bytes before they are copied out.
_RECV_BUFFERS = threading.local()
_RECV_SIZE = 256 * 1024


def _recv_buffer() -> memoryview:
    """This thread's receive buffer (made on its first connection)."""
    buf = getattr(_RECV_BUFFERS, "buf", None)
    if buf is None:
        buf = _RECV_BUFFERS.buf = memoryview(bytearray(_RECV_SIZE))
    return buf


#: ``get`` replies at least this big go out with sendfile; smaller ones are copied.
SENDFILE_MIN = 64 * 1024
_WRITE_BATCH = 256 * 1024


class Host(Protocol):
    """What a :class:`Connection` needs from the server that accepted it."""

    #: limits: max_line, max_message_size, max_inflight_requests, max_pending_bytes
    config: BrokerConfig
    #: the put loop's mapping (``RequestParser(fast_puts=...)``), kept up to date by the host
    fast_keys: dict[bytes, tuple]
    #: counters: connections_total, clients_vanished, get_sendfile, get_sendfile_fallback
    stats: collections.Counter

    def connection_opened(self, conn: Connection) -> bool:
        """A client connected: False to refuse it (the connection then closes)."""
        ...

    def connection_closed(self, conn: Connection) -> None:
        """The connection is gone (whether it was admitted or not)."""
        ...

    def handle(self, conn: Connection, reqs: list) -> None:
        """Serve parsed requests (replies go back through :meth:`Connection.send`...)."""
        ...

    def first_request(self, conn: Connection) -> None:
        """``conn`` sent its first whole request (it is no longer unused)."""
        ...

    def timed_out(self, conn: Connection, why: str) -> None:
        """Close ``conn``: ``"first_request"`` (none came within
        ``first_request_timeout`` of its acceptance) or ``"request"`` (one has been
        coming in for over ``request_timeout``)."""
        ...


class Connection(asyncio.BufferedProtocol):
    """One client: parse, hand to the server, send replies in order."""

    def __init__(self, server: Host) -> None:
        self.server = server
        cfg = server.config
        self.parser = RequestParser(max_line=cfg.max_line, max_payload=cfg.max_message_size,
                                    fast_puts=server.fast_keys, tx_puts=True)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self._outq: collections.deque = collections.deque()
        self._busy = False            # a sendfile is running
        self._corked = False          # serving a read of several requests: replies queued
        self._closing = False
        self._quit = False            # no more requests are read (quit, fatal error, EOF)
        self._write_paused = False
        self._read_paused = False
        self.last_seen = self.accepted_at = time.monotonic()  # last bytes received, for
        # the idle timeout; when accepted, for the first request's
        #: when the request now being received began (None between requests)
        self.partial_since: float | None = None
        #: it has sent a whole request (one not refused as bad)
        self.requested = False
        #: the timer of the first request's and the current request's deadlines (armed
        #: when one is due, re-armed by itself: no timer work per read)
        self._deadline: asyncio.TimerHandle | None = None
        self.address = "?"
        self._dropped = 0  # replies not sent because the client had gone
        #: this client's held gets (see ``_hold``), answered outside the reply order
        self.held: dict = {}
        #: what it receives into: its loop's thread's buffer (made in that thread)
        self._recv = _recv_buffer()

    # -- asyncio callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.address = peer[0] if isinstance(peer, tuple) else str(peer)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)  # type: ignore[attr-defined]
        if not self.server.connection_opened(self):
            self._closing = True
            transport.close()
        elif self.server.config.first_request_timeout > 0:
            self._arm(self.accepted_at + self.server.config.first_request_timeout)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._recv

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._recv[:nbytes].tobytes())

    def data_received(self, data: bytes) -> None:
        now = self.last_seen = time.monotonic()
        if self._closing or self._quit:
            return
        try:
            reqs = self.parser.feed_lenient(data)
        except ProtocolError as e:  # stream broken earlier; nothing more to parse
            self.abort(str(e))
            return
        if reqs:
            if not self.requested and any(type(r) is not BadRequest for r in reqs):
                self.requested = True
                self.server.first_request(self)
            # the replies to a read of several requests (a pipelined transaction's BEGIN,
            # puts and COMMIT) go out in one write, not one each
            self._corked = len(reqs) > 1
            try:
                self.server.handle(self, reqs)
            except Exception:
                log.exception("internal error serving %s; closing its connection", self.peer)
                self.send(result(500, "internal broker error", 0))
                self.close_after_replies()
            finally:
                if self._corked:
                    self._corked = False
                    if self._outq:
                        self._drain()
        # a request begun and not complete: when it began (the slow-client deadline); a
        # request completed in this read means the one coming in began in it too
        if self.parser.in_request:
            if reqs or self.partial_since is None:
                self.partial_since = now
                timeout = self.server.config.request_timeout
                if timeout > 0 and (self._deadline is None
                                    or self._deadline.when() > now + timeout):
                    self._arm(now + timeout)
        else:
            self.partial_since = None
        self._check_backpressure()

    def _arm(self, when: float) -> None:
        """The deadline timer at ``when`` (``time.monotonic``, the loop's clock)."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = asyncio.get_running_loop().call_at(when, self._on_deadline)

    def _on_deadline(self) -> None:
        """Close this connection when its first request or the request coming in is
        past its deadline; else wait for the next deadline, if one is due."""
        self._deadline = None
        if self._closing or self._quit:
            return
        cfg = self.server.config
        now = time.monotonic()
        due: float | None = None
        if not self.requested and cfg.first_request_timeout > 0:
            due = self.accepted_at + cfg.first_request_timeout
            if now >= due:
                self.server.timed_out(self, "first_request")
                return
        if self.partial_since is not None and cfg.request_timeout > 0:
            when = self.partial_since + cfg.request_timeout
            if now >= when:
                self.server.timed_out(self, "request")
                return
            due = when if due is None else min(due, when)
        if due is not None:
            self._arm(due)

    def eof_received(self) -> bool:
        self.close_after_replies()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and not self._closing:  # reset with every request served
            self.server.stats["clients_vanished"] += 1  # (replies still in the transport)
        self._closing = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.server.connection_closed(self)
        if self._dropped:
            log.info("client %s went away with %d replies unsent", self.peer, self._dropped)
        for item in self._outq:
            if type(item) is FileReply:
                item.plog.unpin(item.slice)
        self._outq.clear()

    def idle_for(self, now: float) -> float:
        """Seconds since this client last sent bytes, 0 while replies are still queued
        or gets are held for it."""
        return 0.0 if self._outq or self._busy or self.held else now - self.last_seen

    def pause_writing(self) -> None:
        self._write_paused = True
        self._check_backpressure()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._drain()

    # -- output ----------------------------------------------------------------------------
    @property
    def closing(self) -> bool:
        """No more replies can be sent (closed, or closing after its last replies)."""
        return self._closing or self._quit or self.gone

    @property
    def gone(self) -> bool:
        """The client went away (its socket failed or closed): requests still parsed
        are not served, replies are dropped (counted, one log line at the end)."""
        t = self.transport
        if self._closing or t is None or t.is_closing():
            if not self._closing:
                self._closing = True
                self.server.stats["clients_vanished"] += 1
            return True
        return False

    @property
    def queued(self) -> int:
        """Replies waiting behind a gate, a sendfile or a full socket buffer."""
        return len(self._outq)

    @property
    def unsent_bytes(self) -> int:
        """Bytes handed to the transport and not yet sent."""
        t = self.transport
        return 0 if t is None or t.is_closing() else t.get_write_buffer_size()

    def _check_backpressure(self) -> None:
        t = self.transport
        if t is None or self._closing:
            return
        cfg = self.server.config
        over = (self._write_paused or len(self._outq) > cfg.max_inflight_requests
                or t.get_write_buffer_size() > cfg.max_pending_bytes)
        if over and not self._read_paused:
            self._read_paused = True
            t.pause_reading()
        elif not over and self._read_paused:
            self._read_paused = False
            t.resume_reading()

    def send(self, data: bytes) -> None:
        """Queue a reply (written at once when nothing is ahead of it)."""
        if self.gone:
            self._dropped += 1
        elif self._outq or self._busy or self._write_paused or self._corked:
            self._outq.append(data)
        else:
            self.transport.write(data)

    def send_gated(self, gate: Gate, *, notified: bool = False) -> None:
        """Queue replies that wait for ``gate.fut``; ``notified``: whoever resolves it
        calls :meth:`drain` right then (no callback of the future, a turn later)."""
        self._outq.append(gate)
        if not notified:
            gate.fut.add_done_callback(lambda _f: self._drain())
        elif gate.fut.done():
            self._drain()

    def drain(self) -> None:
        """Write the queued replies that can go out now (a gate's wait ended)."""
        self._drain()

    def send_file(self, item: FileReply) -> None:
        """Queue a ``value`` reply; its bytes are read from the log only when they can
        go out, so a client that does not read its replies costs no memory."""
        if self.gone:
            self._dropped += 1
            return
        item.plog.pin(item.slice)
        if (item.slice.length < SENDFILE_MIN and not self._outq and not self._busy
                and not self._write_paused):
            data = self._read_small(item)
            if data is not None:
                self.transport.write(data)
            return
        self._outq.append(item)
        self._drain()

    def _read_small(self, item: FileReply) -> bytes | None:
        s = item.slice
        at = s.segment.start + s.position
        recent = item.plog.recent(at, s.length)  # exactly the last append: no read
        try:
            if recent is not None:
                return item.header + recent
            return item.header + s.segment.pread(at, s.length)
        except OSError as e:
            log.error("reading %s for %s failed: %s", s.segment.path, self.peer, e)
            self.abort(f"read failed: {e}")
            return None
        finally:
            item.plog.unpin(s)

    def close_after_replies(self) -> None:
        if not self._closing and not self._quit:
            self._quit = True
            self._outq.append(_CLOSE)
            self._drain()

    def abort(self, why: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            log.debug("closing connection from %s: %s", self.peer, why)
            self.transport.close()
        self._closing = True

    def _drain(self) -> None:
        """Write queued replies in order until one must wait (fsync, sendfile, a full
        socket buffer)."""
        if self._busy or self.gone:
            return
        q = self._outq
        chunks: list[bytes] = []
        size = 0
        write = self.transport.write
        while q and not self._write_paused:
            item = q[0]
            t = type(item)
            if t is bytes:
                chunks.append(item)
                size += len(item)
            elif t is Gate:
                if not item.fut.done():
                    break
                chunks.append(item.render())
            elif item is _CLOSE:
                q.clear()
                if chunks:
                    write(b"".join(chunks))
                self._closing = True
                self.transport.close()
                return
            elif item.slice.length < SENDFILE_MIN:  # small FileReply: copy
                data = self._read_small(item)
                if data is None:
                    return
                chunks.append(data)
                size += len(data)
            else:  # big FileReply: sendfile on a task
                q.popleft()
                if chunks:
                    write(b"".join(chunks))
                self._busy = True
                asyncio.get_running_loop().create_task(self._sendfile(item))
                return
            q.popleft()
            if size >= _WRITE_BATCH:
                write(b"".join(chunks))  # may pause writing: the loop re-checks
                chunks = []
                size = 0
                if self.gone:
                    self._dropped += len(q)
                    return
        if chunks:
            write(b"".join(chunks))
        self._check_backpressure()

    async def _sendfile(self, item: FileReply) -> None:
        s = item.slice
        try:
            self.transport.write(item.header)
            try:
                await asyncio.get_running_loop().sendfile(
                    self.transport, s.file, s.position, s.length, fallback=False)
                self.server.stats["get_sendfile"] += 1
            except (asyncio.SendfileNotAvailableError, RuntimeError) as e:
                if self.transport.is_closing():
                    raise ConnectionResetError("connection closed during sendfile") from e
                self.server.stats["get_sendfile_fallback"] += 1
                self.transport.write(s.segment.pread(s.segment.start + s.position, s.length))
            if self._read_paused:
                self.transport.pause_reading()
        except (ConnectionError, OSError) as e:
            self.abort(f"sendfile failed: {e}")
        except Exception:
            log.exception("sendfile to %s failed", self.peer)
            self.abort("sendfile failed")
        finally:
            item.plog.unpin(s)
            self._busy = False
        self._drain()
