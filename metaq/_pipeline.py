"""A pipelined connection for ``put`` requests: many in flight on one socket.

:class:`PipelinedConnection` writes requests as fast as callers submit them
and matches the broker's ``result`` replies to requests by their opaque, so
throughput is not bounded by the round trip:

- callers register a request and append its bytes to a queue; a named writer
  thread joins whatever accumulated into one ``sendall`` (one syscall for
  hundreds of small puts under load);
- a named reader thread parses replies in bulk and completes each request
  (:meth:`Pending.on_reply`); it never blocks on anything but the socket;
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

Replies are parsed in bulk (:func:`metaq._acks.scan_acks`) when a read holds
only successful put replies, and a run of them is handed to a request class's
``on_acks`` / a batch's ``on_acks`` at once.

Futures are :class:`metaq._future.LightFuture`: completing one nobody waits
for yet costs a fraction of a plain ``Future``'s set-up and notify.
"""

from __future__ import annotations

import collections
import itertools
import logging
import select
import socket
import threading
import time
from operator import attrgetter
from typing import Any, Protocol

from metaq._acks import (
    OPAQUE_MASK,
    PutAck,
    parse_put_ack,
    scan_acks,
    scan_results,
)
from metaq._errors import BrokerError, ConnectionClosedError, ProtocolError, SendTimeoutError
from metaq._future import LightFuture
from metaq._protocol import encode_put

__all__ = ["READER_PREFIX", "MultiPending", "Pending", "PipelinedConnection", "PutAck",
           "PutFuture", "parse_put_ack", "scan_results"]

log = logging.getLogger(__name__)

#: Names of reader threads start with this (callbacks of requests run there).
READER_PREFIX = "metaq-pipe-reader-"
_RECV_SIZE = 256 * 1024
_repeat = itertools.repeat
_islice = itertools.islice
_size_of = attrgetter("_pipe_size")


# --------------------------------------------------------------------------- requests

class Pending(Protocol):
    """What the connection completes for one put: exactly one of these is
    called, once, from the reader thread (or from the thread that finds the
    connection dead).

    The connection stores ``_pipe_sent`` (monotonic time) and ``_pipe_size``
    on it (no tuple per request: fewer objects for the garbage collector).

    Optionally the class has ``on_acks(requests, msg_ids, partitions,
    offsets)`` (a static or class method; the last three are lists of
    decimal ``bytes``, each a valid non-negative integer): the reader then
    completes a run of successful replies to requests of that class in one
    call instead of calling ``on_reply(200, body)`` for each.
    """

    _pipe_sent: float
    _pipe_size: int

    def on_reply(self, code: int, body: bytes) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


class MultiPending(Protocol):
    """What the connection completes for the puts of one
    :meth:`PipelinedConnection.put_many` call, by their index in that call.

    Each index gets exactly one outcome: ``on_acks`` (a run of successes,
    indexes ``first .. first + len(msg_ids) - 1``, in order; the columns are
    lists of decimal ``bytes``, each a valid non-negative integer), ``on_reply_at``
    (any other reply, or a success that came alone) or ``on_error_at``.
    Called from the reader thread (or the thread that finds the connection dead).
    """

    def on_acks(self, first: int, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None: ...

    def on_reply_at(self, index: int, code: int, body: bytes) -> None: ...

    def on_error_at(self, index: int, exc: BaseException) -> None: ...


class _Run:
    """The puts of one ``put_many`` call in the pending map (one entry per opaque,
    all pointing here): which index an opaque is, and the bytes each one holds."""

    __slots__ = ("request", "first", "n", "sizes", "index", "_pipe_sent", "_pipe_size")

    def __init__(self, request: MultiPending, opaques: list[int], sizes: list[int]) -> None:
        self.request = request
        self.first = opaques[0]
        self.n = n = len(opaques)
        self.sizes = sizes
        # Opaques from one islice of the counter are consecutive unless they wrapped.
        self.index = None if opaques[-1] - opaques[0] == n - 1 else {
            op: i for i, op in enumerate(opaques)}
        self._pipe_size = 0  # counted per index (sizes)

    def index_of(self, opaque: int) -> int:
        index = self.index
        return opaque - self.first if index is None else index[opaque]


class PutFuture(LightFuture):
    """The default request: resolves to a :class:`PutAck` or raises BrokerError."""

    def __init__(self, broker: str = "") -> None:
        super().__init__()
        self._broker = broker

    def on_reply(self, code: int, body: bytes) -> None:
        if code == 200:
            try:
                self.set_result(parse_put_ack(body))
            except ProtocolError as e:
                self.set_exception(e)
        else:
            self.set_exception(BrokerError(code, body.decode("utf-8", "replace"),
                                           broker=self._broker))

    @staticmethod
    def on_acks(requests: list, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None:
        for request, ack in zip(requests, map(PutAck, map(int, msg_ids), map(int, partitions),
                                              map(int, offsets)), strict=True):
            request.set_result(ack)

    def on_error(self, exc: BaseException) -> None:
        self.set_exception(exc)


# --------------------------------------------------------------------------- connection

class PipelinedConnection:
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
        self._error: ConnectionClosedError | None = None
        self._closing = False
        #: False once the connection failed or is closing (a plain attribute: read per message)
        self.usable = True
        self._prefixes: dict[str, bytes] = {}
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
        data = b"%b%d %d %d %d %d\r\n%b" % (prefix, partition, len(payload), flag, checksum,
                                              opaque, payload)
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
            request._pipe_sent = time.monotonic()
            request._pipe_size = size
            pending[opaque] = request
            self._inflight_bytes += size
            self._out.append(data)
        if flush and self._send_lock.acquire(blocking=False):
            try:
                self._drain()
            except OSError as e:
                self._fail(_closed(f"writing to broker {self.name} failed: {e}", e))
            finally:
                self._send_lock.release()
        elif not self._wake.is_set():
            self._wake.set()
        return request

    def put_many(self, topic: str, partition: int, payloads: list[bytes], flag: int,
                 checksums: list[int], request: MultiPending, deadline: float | None = None,
                 flush: bool = False) -> None:
        """Queue one put per payload (all to ``partition``, same ``flag``), as one
        write; ``request`` gets each one's outcome by its index in ``payloads``.

        Blocks while the window has no room for all of them (unless nothing
        is in flight), up to ``deadline``, then raises SendTimeoutError;
        raises ConnectionClosedError if the connection is dead and
        ProtocolError for a bad topic, before anything is queued.
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
        head = (b"%b%d " % (prefix, partition)).replace(b"%", b"%%")
        fmt = head + b"%d " + (b"%d" % flag) + b" %d %d\r\n%b"
        data = list(map(fmt.__mod__, zip(map(len, payloads), checksums, opaques, payloads,
                                                 strict=True)))
        sizes = list(map(len, data))
        size = sum(sizes)
        data = b"".join(data)
        run = _Run(request, opaques, sizes)
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
        if flush and self._send_lock.acquire(blocking=False):
            try:
                self._drain()
            except OSError as e:
                self._fail(_closed(f"writing to broker {self.name} failed: {e}", e))
            finally:
                self._send_lock.release()
        elif not self._wake.is_set():
            self._wake.set()

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

    def _error_to(self, opaque: int, request: Any, err: BaseException) -> None:
        """Give one popped request (or one put of a run) its error; never raises."""
        try:
            if type(request) is _Run:
                request.request.on_error_at(request.index_of(opaque), err)
            else:
                request.on_error(err)
        except Exception:
            log.exception("request callback failed on %s", self.name)

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
            self._fail(_closed(f"writing to broker {self.name} failed: {e}", e))
        except BaseException as e:  # pragma: no cover - a bug; never leave callers hanging
            log.exception("writer of %s crashed", self.name)
            self._fail(_closed(f"writer of {self.name} crashed: {e!r}", e))

    # -- reader --------------------------------------------------------------

    def _read_loop(self) -> None:
        sock = self._sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        tick = max(0.01, min(0.1, self.request_timeout / 4))
        tick_ms = int(tick * 1000)
        next_sweep = time.monotonic() + tick
        recv = sock.recv
        buf = b""
        try:
            while self._error is None:
                # Try a read first: under load the next replies are already there, and
                # every blocking call costs a GIL hand-over; poll only when idle.
                try:
                    data = recv(_RECV_SIZE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if not poller.poll(tick_ms):
                        self._sweep()
                        next_sweep = time.monotonic() + tick
                    continue
                if not data:
                    raise _closed(f"broker {self.name} closed the connection", None)
                buf = self._handle(buf + data if buf else data)
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + tick
        except ConnectionClosedError as e:
            self._fail(e)
        except ProtocolError as e:
            self._fail(_closed(f"malformed reply from broker {self.name}: {e}", e))
        except OSError as e:
            self._fail(_closed(f"reading from broker {self.name} failed: {e}", e))
        except BaseException as e:  # pragma: no cover - a bug; never leave callers hanging
            log.exception("reader of %s crashed", self.name)
            self._fail(_closed(f"reader of {self.name} crashed: {e!r}", e))
        finally:
            if self._writer.ident is not None and self._writer is not threading.current_thread():
                self._writer.join(5.0)
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, buf: bytes) -> bytes:
        """Complete every whole reply in ``buf``; return the unparsed rest."""
        acks = scan_acks(buf)
        if acks is None:
            return self._handle_results(buf)
        opaques, msg_ids, partitions, offsets, used = acks
        end = len(buf)
        if not opaques:
            return buf
        self._last_reply = time.monotonic()
        requests = list(map(self._pending.pop, opaques, _repeat(None)))
        freed = 0
        try:
            if None in requests:  # replies for requests that timed out (or garbage)
                known = [i for i, r in enumerate(requests) if r is not None]
                log.debug("%d replies for unknown opaques from %s", len(requests) - len(known),
                          self.name)
                requests = [requests[i] for i in known]
                opaques = [opaques[i] for i in known]
                msg_ids = [msg_ids[i] for i in known]
                partitions = [partitions[i] for i in known]
                offsets = [offsets[i] for i in known]
            kinds = set(map(type, requests))
            if len(kinds) == 1:
                freed = self._acks(kinds.pop(), requests, opaques, msg_ids, partitions, offsets)
            else:  # runs of one kind each
                i, n = 0, len(requests)
                while i < n:
                    kind = type(requests[i])
                    j = i + 1
                    while j < n and type(requests[j]) is kind:
                        j += 1
                    freed += self._acks(kind, requests[i:j], opaques[i:j], msg_ids[i:j],
                                        partitions[i:j], offsets[i:j])
                    i = j
        finally:
            if freed:
                self._freed(freed)
        return buf[used:] if used < end else b""

    def _acks(self, kind: type, requests: list, opaques: list[int], msg_ids: list[bytes],
              partitions: list[bytes], offsets: list[bytes]) -> int:
        """Complete successful replies to ``requests`` (all of type ``kind``, already
        out of the pending map); return the bytes they held."""
        if kind is _Run:
            return self._run_acks(requests, opaques, msg_ids, partitions, offsets)
        freed = sum(map(_size_of, requests))
        bulk = getattr(kind, "on_acks", None)
        try:
            if bulk is not None:
                bulk(requests, msg_ids, partitions, offsets)
                return freed
        except Exception:
            log.exception("request callback failed on %s", self.name)
            return freed
        for request, a, b, c in zip(requests, msg_ids, partitions, offsets, strict=True):
            try:
                request.on_reply(200, b" ".join((a, b, c)))
            except Exception:
                log.exception("request callback failed on %s", self.name)
        return freed

    def _run_acks(self, runs: list, opaques: list[int], msg_ids: list[bytes],
                  partitions: list[bytes], offsets: list[bytes]) -> int:
        freed = 0
        i, n = 0, len(runs)
        while i < n:
            run = runs[i]
            first = run.index_of(opaques[i])
            j = min(n, i + run.n - first)
            m = j - i
            if not (run.index is None and runs[i:j].count(run) == m
                    and opaques[i:j] == list(range(opaques[i], opaques[i] + m))):
                j, m = i + 1, 1  # one at a time (a wrapped run, or replies out of order)
            freed += sum(run.sizes[first:first + m])
            try:
                if m == 1:
                    run.request.on_reply_at(first, 200, b" ".join((
                        msg_ids[i], partitions[i], offsets[i])))
                else:
                    run.request.on_acks(first, msg_ids[i:j], partitions[i:j], offsets[i:j])
            except Exception:
                log.exception("request callback failed on %s", self.name)
            i = j
        return freed

    def _handle_results(self, buf: bytes) -> bytes:
        """The general path: any ``result`` replies, one at a time."""
        replies, used = scan_results(buf)
        if replies:
            self._last_reply = time.monotonic()
        pop = self._pending.pop
        freed = 0
        try:
            for code, opaque, body in replies:
                request = pop(opaque, None)
                if request is None:
                    log.debug("reply for unknown opaque %d from %s", opaque, self.name)
                    continue
                try:
                    if type(request) is _Run:
                        index = request.index_of(opaque)
                        freed += request.sizes[index]
                        request.request.on_reply_at(index, code, body)
                    else:
                        freed += request._pipe_size
                        request.on_reply(code, body)
                except Exception:
                    log.exception("request callback failed on %s", self.name)
        finally:
            if freed:
                self._freed(freed)
        return buf[used:] if used else buf

    def _sweep(self) -> None:
        """Time out what the broker does not answer (runs on the reader thread).

        - Nothing answered for ``request_timeout`` while requests wait: the
          broker or the path to it is stuck; the connection is declared dead.
        - One request unanswered for ``stale_timeout`` while later ones were
          answered (a reply lost, or a broker answering out of order that
          forgot one): that request alone fails with SendTimeoutError.
        """
        pending = self._pending
        try:
            oldest = next(iter(pending.values()))
        except (StopIteration, RuntimeError):
            return
        now = time.monotonic()
        idle = now - max(oldest._pipe_sent, self._last_reply)
        if idle > self.request_timeout:
            raise _closed(f"no reply from broker {self.name} for {idle:.1f}s "
                          f"(request_timeout {self.request_timeout:g}s, "
                          f"{len(pending)} requests in flight)", None)
        if now - oldest._pipe_sent <= self.stale_timeout:
            return
        expired = []
        for opaque, request in list(_islice(pending.items(), 16384)):
            if now - request._pipe_sent <= self.stale_timeout:
                break
            if pending.pop(opaque, None) is not None:
                expired.append((opaque, request))
        if not expired:
            return
        self._freed(sum(r.sizes[r.index_of(op)] if type(r) is _Run else r._pipe_size
                        for op, r in expired))
        log.warning("%d request(s) to broker %s unanswered for over %gs while later ones "
                    "were answered", len(expired), self.name, self.stale_timeout)
        for opaque, request in expired:
            self._error_to(opaque, request, SendTimeoutError(
                f"broker {self.name} answered later requests but not this one in "
                f"{now - request._pipe_sent:.1f}s (stale_timeout {self.stale_timeout:g}s)"))


def _closed(msg: str, cause: BaseException | None) -> ConnectionClosedError:
    err = ConnectionClosedError(msg)
    err.__cause__ = cause
    return err
