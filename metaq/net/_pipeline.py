"""A pipelined connection for ``put`` requests: many in flight on one socket.

:class:`PipelinedConnection` writes requests as fast as callers submit them
and matches the broker's ``result`` replies to requests by their opaque, so
throughput is not bounded by the round trip:

- callers register a request and append its bytes to a queue; a named writer
  thread joins whatever accumulated into one ``sendall`` (one syscall for
  hundreds of small puts under load);
- a named reader thread parses replies in bulk and completes each request
  (:meth:`Pending.on_reply`); it never blocks on anything but the socket;
- a blocking send that is alone in flight reads its own reply on its thread
  (:meth:`PipelinedConnection.read_own`, after ``put(..., flush=True)``) while the
  reader thread parks, and leaves anything else it finds to the reader thread;
  with nothing else in flight it does its whole round trip there, as a plain client
  would (:meth:`PipelinedConnection.put_wait`: one write, one blocking read, the
  answer parsed in C);
- at most ``max_in_flight`` requests / ``max_in_flight_bytes`` bytes are
  outstanding: :meth:`PipelinedConnection.put` blocks (until its deadline)
  while the window is full;
- when the connection fails (reset, EOF, a malformed reply, a write error,
  or nothing answered for ``request_timeout`` while requests wait) every
  request in flight fails with :class:`~metaq.ConnectionClosedError` and later
  puts raise it at once; a single request left unanswered for
  ``stale_timeout`` while later ones were answered fails alone.

A request is any object with ``on_reply(code, body)`` and ``on_error(exc)``
(the producer passes its own per-message state).  :meth:`PipelinedConnection.put`
without one returns a :class:`PutFuture` resolving to a :class:`PutAck`.
:meth:`PipelinedConnection.put_many` queues many puts to one partition as
one write, completed by index through one :class:`MultiPending`.

Replies are parsed in bulk (:func:`metaq.net._acks.scan_acks`) when a read holds
only successful put replies, and a run of them is handed to a request class's
``on_acks`` / a batch's ``on_acks`` at once.

Futures are :class:`metaq.net._future.LightFuture`: completing one nobody waits
for yet costs a fraction of a plain ``Future``'s set-up and notify.
"""

from __future__ import annotations

import collections
import itertools
import logging
import socket
import struct
import threading
import time
from typing import Any

from metaq._errors import ConnectionClosedError, SendTimeoutError
from metaq.net._acks import MultiPending, Pending, PutFuture
from metaq.net._reader import ReplyReader, Run, closed_error
from metaq.protocol import (
    OPAQUE_MASK,
    encode_put,
    encode_puts,
    put_ack,
    put_request,
    put_round_trip,
)

__all__ = ["READER_PREFIX", "PipelinedConnection"]

log = logging.getLogger(__name__)

#: Names of reader threads start with this (callbacks of requests run there).
READER_PREFIX = "metaq-pipe-reader-"
_repeat = itertools.repeat
_islice = itertools.islice
#: ``put_request(prefix, partition, payload, flag, checksum, opaque)``: one put's bytes (C)
_put_request = put_request
_put_ack = put_ack
_put_round_trip = put_round_trip
_monotonic = time.monotonic
#: SO_RCVTIMEO of a connection's socket (a struct timeval): 50 ms
_RCV_SLICE = struct.pack("@ll", 0, 50_000)
#: put_wait's read size (its reply is some 40 bytes; more is others' replies)
_WAIT_RECV = 65536
#: A put that comes this long (seconds) after the previous one is written by the
#: caller's thread: at a low rate there is nothing to join it with, and handing it to
#: the writer thread costs a thread wake-up (tens of µs) on the way to the broker.
_QUIET = 0.0005


# --------------------------------------------------------------------------- connection

class PipelinedConnection(ReplyReader):
    """Many ``put`` requests in flight on one TCP connection to a broker.

    ``request_timeout``: when requests wait and nothing at all was answered
    for that long, the connection is declared dead (everything in flight
    fails with ConnectionClosedError).  ``stale_timeout`` (default four times
    ``request_timeout``): a single request unanswered that long while later
    ones were answered fails alone with SendTimeoutError.  ``name`` labels
    the threads and errors.
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float = 3.0,
                 request_timeout: float = 3.0, stale_timeout: float | None = None,
                 max_in_flight: int = 16384, max_in_flight_bytes: int = 64 * 1024 * 1024,
                 name: str | None = None) -> None:
        if max_in_flight < 1 or max_in_flight_bytes < 1:
            raise ValueError("max_in_flight and max_in_flight_bytes must be >= 1")
        self.address = (host, port)
        self.name = name or f"{host}:{port}"
        self.request_timeout = request_timeout
        self.stale_timeout = 4 * request_timeout if stale_timeout is None else stale_timeout
        self._last_reply = 0.0
        self.max_in_flight = max_in_flight
        self.max_in_flight_bytes = max_in_flight_bytes
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout)
        except OSError as e:
            raise ConnectionClosedError(f"cannot connect to broker {self.name}: {e}") from e
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A blocking recv (put_wait's; every other read is MSG_DONTWAIT) returns EAGAIN
        # after this slice, so that the reading blocking send looks at its deadline and
        # at its request's fate (swept, failed) now and then; writes are not affected.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _RCV_SLICE)
        self._sock = sock
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._room_waiters = 0
        # Waiters are woken when in flight are at most this many requests / bytes (the
        # easiest of their needs): no wake-up per reply while a batch waits for room.
        self._wake_at = -1
        self._wake_bytes = -1
        self._pending: dict[int, Any] = {}  # opaque -> request (with _pipe_sent/_pipe_size)
        self._inflight_bytes = 0
        self._opaques = itertools.count(1)
        self._out: collections.deque[bytes] = collections.deque()
        self._send_lock = threading.Lock()  # held while taking from _out and writing it
        self._wake = threading.Event()
        self._last_put = 0.0  # when the last put was queued (under _lock; see _QUIET)
        self._error: ConnectionClosedError | None = None
        self._closing = False
        #: False once the connection failed or is closing (a plain attribute: read per message)
        self.usable = True
        self._prefixes: dict[str, bytes] = {}
        self._init_reading()
        #: What the C send path (``submit_put``) uses of this connection: objects fixed
        #: for its life, read in one lookup per message instead of one each (none of
        #: them is ever replaced: a connection that fails is dropped, not reset).
        self._c_put = (self._opaques, self._prefixes, self._pending, self._lock.acquire,
                       self._lock.release, self._out.append, self._wake, self._wake.set,
                       self._unpark.set)
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"{READER_PREFIX}{self.name}")
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name=f"metaq-pipe-writer-{self.name}")
        self._writer.start()
        self._reader.start()

    # -- public --------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the connection failed or was closed: create a new one."""
        return not self.usable

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def put(self, topic: str, partition: int, payload: bytes, flag: int, checksum: int,
            request: Pending | None = None, deadline: float | None = None,
            flush: bool = False) -> Any:
        """Queue a put; return ``request`` (or a new :class:`PutFuture`).

        Blocks while the in-flight window is full, up to ``deadline``
        (``time.monotonic()`` based; ``None`` waits for ever) and then raises
        SendTimeoutError.  Raises ConnectionClosedError if the connection is
        dead; bad arguments raise ProtocolError before anything is queued.
        ``flush``: write now from this thread when no other write is running
        (a caller about to wait for the reply saves a hand-over to the writer).
        """
        opaque = next(self._opaques) & OPAQUE_MASK
        prefix = self._prefixes.get(topic)
        if prefix is None:
            prefix = self._prefix(topic)
        data = _put_request(prefix, partition, payload, flag, checksum, opaque)
        if request is None:
            request = PutFuture(self.name)
        size = len(data)
        pending = self._pending
        if (len(pending) >= self.max_in_flight
                or self._inflight_bytes + size > self.max_in_flight_bytes):
            self._wait_room(size, deadline)
        with self._lock:
            if self._error is not None:
                raise self._error_for_caller()
            if self._closing:
                raise ConnectionClosedError(f"connection to broker {self.name} is closed")
            request._pipe_sent = now = _monotonic()
            request._pipe_size = size
            pending[opaque] = request
            self._inflight_bytes += size
            self._out.append(data)
            quiet = now - self._last_put >= _QUIET
            self._last_put = now
        if flush:  # (a blocking send: it reads its reply itself when it can, read_own)
            self._kick(True, False)
        elif quiet and self._write_now():  # the first put after a pause: written from
            if self._parked:  # this thread (no wait for the writer to wake)
                self._unpark.set()
        else:
            if not self._wake.is_set():  # (_kick's other half, without a call per message)
                self._wake.set()
            if self._parked:  # blocking sends read their replies lately: the reader reads
                self._unpark.set()
        return request

    def put_wait(self, topic: str, partition: int, payload: bytes, flag: int, checksum: int,
                 request: Pending, deadline: float, cls: type, broker_id: int,
                 names: Any) -> Any:
        """A blocking send's whole round trip on the calling thread, as a plain client
        does it (one write, one blocking read, the answer parsed in C), when nothing
        else is in flight, queued or being read on this connection.

        Returns False when it did not apply (nothing sent: :meth:`put` as usual);
        else ``request`` was sent (in the pending map like any put, so that a failing
        connection, :meth:`close` and the reader thread's sweep complete it as usual)
        and this returns its :func:`~metaq.protocol.put_ack` ``cls`` tuple when its
        reply was read here, or None: then ``request`` gets its outcome the usual way
        (a reply that is not a lone success of its own -- an error code, replies to
        other requests put meanwhile -- left to the reader thread; the connection
        failing; ``deadline`` passing), and the caller waits for it.  Raises only
        ProtocolError for a bad topic (nothing sent).  Not from the reader thread (it
        would park itself)."""
        if self._pending:
            return False
        prefix = self._prefixes.get(topic)
        if prefix is None:
            prefix = self._prefix(topic)  # (raises ProtocolError for a bad topic)
        rlock = self._rlock
        if not rlock.acquire(False):
            return False
        send_lock = self._send_lock
        if not send_lock.acquire(False):
            rlock.release()
            return False
        opaque = next(self._opaques) & OPAQUE_MASK
        data = _put_request(prefix, partition, payload, flag, checksum, opaque)
        size = len(data)
        pending = self._pending
        lock = self._lock
        lock.acquire()
        if pending or self._out or self._rbuf or self._error is not None or self._closing:
            lock.release()
            send_lock.release()
            rlock.release()
            return False
        request._pipe_sent = _monotonic()
        request._pipe_size = size
        pending[opaque] = request
        self._inflight_bytes += size
        self._caller_reading = True  # the reader thread keeps off the socket
        lock.release()
        timed = False  # _caller_done set on the way (else the finally sets it)
        try:
            # write, release send_lock, one blocking read (SO_RCVTIMEO bounds it) and
            # the reply parsed, in one C call
            got = _put_round_trip(self._sock, send_lock, data, opaque, cls, broker_id, names)
            if type(got) is not bytes:
                if got is not None and pending.pop(opaque, None) is request:
                    self._last_reply = self._caller_done = _monotonic()
                    timed = True
                    with lock:  # (_freed, inlined)
                        self._inflight_bytes -= size
                        if self._room_waiters and (len(pending) <= self._wake_at
                                                   or self._inflight_bytes <= self._wake_bytes):
                            self._room.notify_all()
                    return got
                # (None: a slice went by; else swept or failed meanwhile)
            elif got:
                self._rbuf = got
            else:
                raise closed_error(f"broker {self.name} closed the connection", None)
            return self._wait_rest(request, opaque, size, deadline, cls, broker_id, names)
        except ConnectionClosedError as e:
            self._fail(e)
        except OSError as e:
            self._fail(closed_error(f"talking to broker {self.name} failed: {e}", e))
        finally:
            self._caller_reading = False
            if not timed:
                self._caller_done = _monotonic()
            rlock.release()
            if self._parked and (self._rbuf or pending or self._error is not None):
                self._unpark.set()
        return None

    def _wait_rest(self, request: Pending, opaque: int, size: int, deadline: float, cls: type,
                   broker_id: int, names: Any) -> Any:
        """:meth:`put_wait` after a first read that was not its whole reply (``_rbuf``
        holds what came, if anything): read until its reply is whole, something else
        comes (left in ``_rbuf`` for the reader thread), the request gets its outcome
        elsewhere (swept, failed) or ``deadline`` passes.  Raises ConnectionClosedError
        (the broker closed) and OSError."""
        pending = self._pending
        recv = self._sock.recv
        buf = self._rbuf
        while True:
            if buf:
                r = _put_ack(buf, opaque, cls, broker_id, names)
                if r is False:  # not (only) its success: the reader thread's
                    break
                if r is not None:
                    self._rbuf = b""
                    if pending.pop(opaque, None) is not request:
                        return None  # swept or failed meanwhile: it has its outcome
                    self._last_reply = _monotonic()
                    self._freed(size)
                    return r
            if pending.get(opaque) is not request or _monotonic() >= deadline:
                break
            try:
                got = recv(_WAIT_RECV)  # blocks for up to one SO_RCVTIMEO slice
            except BlockingIOError:  # a slice went by
                continue
            if not got:
                self._rbuf = buf
                raise closed_error(f"broker {self.name} closed the connection", None)
            buf = buf + got if buf else got
        self._rbuf = buf
        return None

    def put_marked(self, mark: bytes, topic: str, partition: int, payload: bytes, flag: int,
                   checksum: int, request: Pending, deadline: float | None = None,
                   flush: bool = False) -> Any:
        """:meth:`put` preceded by the line ``mark`` (the idempotent producer's ``idem``
        mark, metaq-py's extension; written in the same write, counted in the window).
        A copy of :meth:`put`'s body, so that a plain put costs nothing more."""
        opaque = next(self._opaques) & OPAQUE_MASK
        prefix = self._prefixes.get(topic)
        if prefix is None:
            prefix = self._prefix(topic)
        data = mark + _put_request(prefix, partition, payload, flag, checksum, opaque)
        size = len(data)
        pending = self._pending
        if (len(pending) >= self.max_in_flight
                or self._inflight_bytes + size > self.max_in_flight_bytes):
            self._wait_room(size, deadline)
        with self._lock:
            if self._error is not None:
                raise self._error_for_caller()
            if self._closing:
                raise ConnectionClosedError(f"connection to broker {self.name} is closed")
            request._pipe_sent = time.monotonic()
            request._pipe_size = size
            pending[opaque] = request
            self._inflight_bytes += size
            self._out.append(data)
        self._kick(flush)
        return request

    def put_many(self, topic: str, partition: int, payloads: list[bytes], flag: int,
                 checksums: list[int], request: MultiPending, deadline: float | None = None,
                 flush: bool = False, mark: bytes = b"") -> None:
        """Queue one put per payload (all to ``partition``, same ``flag``), as one
        write; ``request`` gets each one's outcome by its index in ``payloads``.

        Blocks while the window has no room for all of them (unless nothing
        is in flight), up to ``deadline``, then raises SendTimeoutError;
        raises ConnectionClosedError if the connection is dead and
        ProtocolError for a bad topic, before anything is queued.  ``mark``: a line
        written before the puts (the idempotent producer's ``idem`` mark).
        """
        n = len(payloads)
        if n == 0:
            return
        opaques = list(_islice(self._opaques, n))
        if opaques[-1] > OPAQUE_MASK:
            opaques = [op & OPAQUE_MASK for op in opaques]
        prefix = self._prefixes.get(topic)
        if prefix is None:
            prefix = self._prefix(topic)
        data, sizes = encode_puts(b"%b%d " % (prefix, partition), flag, payloads, checksums,
                                  opaques)
        if mark:
            data = mark + data
            sizes[0] += len(mark)
        size = sum(sizes)
        run = Run(request, opaques, sizes)
        pending = self._pending
        if (len(pending) + n > self.max_in_flight
                or self._inflight_bytes + size > self.max_in_flight_bytes):
            self._wait_room(size, deadline, n)
        with self._lock:
            if self._error is not None:
                raise self._error_for_caller()
            if self._closing:
                raise ConnectionClosedError(f"connection to broker {self.name} is closed")
            run._pipe_sent = time.monotonic()
            pending.update(zip(opaques, _repeat(run), strict=False))
            self._inflight_bytes += size
            self._out.append(data)
        self._kick(flush)

    def _kick(self, flush: bool, handover: bool = True) -> None:
        """After queueing: write now from the caller's thread when ``flush`` and no write
        is running, else wake the writer thread; ``handover``: wake a parked reader
        thread (not for a blocking send's put: it reads its reply, see read_own)."""
        if flush and self._send_lock.acquire(blocking=False):
            try:
                self._drain()
            except OSError as e:
                self._fail(closed_error(f"writing to broker {self.name} failed: {e}", e))
            finally:
                self._send_lock.release()
        elif not self._wake.is_set():
            self._wake.set()
        if handover and self._parked:  # the reader thread reads again (see read_own)
            self._unpark.set()

    def _write_now(self) -> bool:
        """Write what is queued from the caller's thread without blocking, when no
        write is running; False when the writer thread has to (it is woken for what
        the socket did not take, which stays first in the queue)."""
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            out = self._out
            n = len(out)
            if not n:
                return True
            data = out.popleft() if n == 1 else b"".join([out.popleft() for _ in range(n)])
            try:
                sent = self._sock.send(data, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self._fail(closed_error(f"writing to broker {self.name} failed: {e}", e))
                return True
            if sent == len(data):
                return True
            out.appendleft(data[sent:])
            return False
        finally:
            self._send_lock.release()

    def wait_idle(self, deadline: float) -> bool:
        """Wait until nothing is in flight (or the connection died), up to the
        ``time.monotonic()`` ``deadline``; True when idle."""
        with self._room:
            self._room_waiters += 1
            self._wake_at = max(self._wake_at, 0)
            try:
                while self._pending and self._error is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._room.wait(left)
            finally:
                self._leave_room()
        return True

    def _prefix(self, topic: str) -> bytes:
        """``b"put <topic> "`` (the topic checked as :func:`encode_put` checks it)."""
        prefix = encode_put(topic, 0, b"", 0, 0, 0).split(b" ", 2)
        value = b"put " + prefix[1] + b" "
        if len(self._prefixes) > 1024:
            self._prefixes.clear()
        self._prefixes[topic] = value
        return value

    def close(self, timeout: float = 0.0) -> None:
        """Stop taking puts; wait up to ``timeout`` s for replies to those in
        flight, then close the socket (failing whatever is still in flight)."""
        with self._room:
            self._closing = True
            self.usable = False
            self._room.notify_all()
        if timeout > 0:
            self.wait_idle(time.monotonic() + timeout)
        self._fail(ConnectionClosedError(f"connection to broker {self.name} was closed "
                                         f"with requests in flight"))
        for t in (self._reader, self._writer):
            if t is not threading.current_thread():
                t.join(5.0)

    def __enter__(self) -> PipelinedConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(timeout=self.request_timeout)

    # -- window --------------------------------------------------------------

    def _wait_room(self, size: int, deadline: float | None, count: int = 1) -> None:
        if threading.current_thread() is self._reader:
            raise SendTimeoutError(
                f"the in-flight window to broker {self.name} is full and this put comes from "
                f"a request callback on its reader thread, which alone can free it")
        with self._room:
            self._room_waiters += 1
            self._wake_at = max(self._wake_at, self.max_in_flight - count, 0)
            self._wake_bytes = max(self._wake_bytes, self.max_in_flight_bytes - size, 0)
            try:
                while (self._error is None and not self._closing and self._pending and (
                        len(self._pending) + count > self.max_in_flight
                        or self._inflight_bytes + size > self.max_in_flight_bytes)):
                    if deadline is None:
                        self._room.wait(1.0)
                        continue
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise SendTimeoutError(
                            f"broker {self.name} did not free room in its in-flight window "
                            f"({len(self._pending)} requests, {self._inflight_bytes} bytes) "
                            f"before the send deadline")
                    self._room.wait(left)
            finally:
                self._leave_room()

    def _leave_room(self) -> None:
        self._room_waiters -= 1
        if not self._room_waiters:
            self._wake_at = self._wake_bytes = -1

    def _freed(self, nbytes: int) -> None:
        """Replies or timeouts took ``nbytes`` out of the window (any thread)."""
        with self._lock:
            self._inflight_bytes -= nbytes
            if self._room_waiters and (len(self._pending) <= self._wake_at
                                       or self._inflight_bytes <= self._wake_bytes):
                self._room.notify_all()

    def _error_for_caller(self) -> ConnectionClosedError:
        err = self._error
        assert err is not None
        new = ConnectionClosedError(str(err))
        new.__cause__ = err.__cause__
        return new

    # -- failure -------------------------------------------------------------

    def _fail(self, err: ConnectionClosedError) -> None:
        """Mark the connection dead and fail every request in flight.

        Requests are taken out of the pending map one ``popitem`` at a time,
        the same atomic operation the reader uses, so each one is completed
        exactly once even while the reader is still running.
        """
        with self._lock:
            if self._error is None:
                self._error = err
            self.usable = False
            self._inflight_bytes = 0
            self._room.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._wake.set()
        self._unpark.set()  # a parked reader thread ends now, not a tick later
        pending = self._pending
        taken = []
        while True:
            try:
                taken.append(pending.popitem())
            except KeyError:
                break
        if taken:
            log.debug("connection %s failed with %d requests in flight: %s",
                      self.name, len(taken), err)
        err = self._error
        assert err is not None
        for opaque, request in reversed(taken):  # oldest first
            self._error_to(opaque, request, err)

    # -- writer --------------------------------------------------------------

    def _drain(self) -> None:
        """Send everything queued, in one write (caller holds ``_send_lock``)."""
        out = self._out
        n = len(out)
        if n == 1:
            self._sock.sendall(out.popleft())
        elif n:
            popleft = out.popleft
            self._sock.sendall(b"".join([popleft() for _ in range(n)]))

    def _write_loop(self) -> None:
        out = self._out
        wake = self._wake
        send_lock = self._send_lock
        try:
            while self._error is None:
                if not out:
                    wake.clear()
                    if not out:
                        wake.wait()
                        continue
                with send_lock:  # requests leave in queue order, whoever writes them
                    self._drain()
        except OSError as e:
            self._fail(closed_error(f"writing to broker {self.name} failed: {e}", e))
        except BaseException as e:  # pragma: no cover - a bug; never leave callers hanging
            log.exception("writer of %s crashed", self.name)
            self._fail(closed_error(f"writer of {self.name} crashed: {e!r}", e))
