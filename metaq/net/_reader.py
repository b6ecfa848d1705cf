"""The reading half of :class:`metaq.net._pipeline.PipelinedConnection`.

A named thread reads the socket, parses replies in bulk
(:func:`metaq.net._acks.scan_acks`, falling back to
:func:`metaq.net._acks.scan_results`) and completes the requests: a run of
successful replies to one ``put_many`` (:class:`Run`) or to requests of one
class with ``on_acks`` in one call, anything else one reply at a time; with the
C module, the leading successful replies to requests of :attr:`ReplyReader.ack_type`
(the producer's ``Send``) are completed first in one C call (``take_acks``).  It
also times out what the broker does not answer (:meth:`ReplyReader._sweep`).
"""

from __future__ import annotations

import itertools
import logging
import select
import socket
import threading
import time
from operator import attrgetter
from typing import TYPE_CHECKING, Any

from metaq._errors import ConnectionClosedError, ProtocolError, SendTimeoutError
from metaq.net._acks import MultiPending, scan_acks, scan_results
from metaq.protocol import take_acks as _take_acks

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["ReplyReader", "Run", "closed_error"]

log = logging.getLogger(__name__)

_RECV_SIZE = 256 * 1024
#: Reads shorter than this (about 25 put acks) are parsed one reply at a time: the
#: bulk parser's fixed cost (some 30 whole-buffer steps) pays off only on longer ones.
_BULK_MIN = 1024
_repeat = itertools.repeat
_islice = itertools.islice
_size_of = attrgetter("_pipe_size")
_FINISHED = "FINISHED"  # concurrent.futures._base.FINISHED (a LightFuture's done state)


class Run:
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


class ReplyReader:
    """Mixin of :class:`~metaq.net._pipeline.PipelinedConnection`: its reader thread."""

    #: The request class whose successful replies are completed in C, in one call per
    #: read (``take_acks``: popped, their answer stored, their state set, as its
    #: ``on_acks`` would), before the parsers below see the rest; None: none.  A class
    #: with the slots ``on_acks`` stores (the producer's ``Send`` sets itself here).
    ack_type: type | None = None

    # Provided by the connection.
    name: str
    request_timeout: float
    stale_timeout: float
    _pending: dict[int, Any]
    _sock: socket.socket
    _error: ConnectionClosedError | None
    _last_reply: float
    _writer: threading.Thread
    _fail: Callable[[ConnectionClosedError], None]
    _freed: Callable[[int], None]

    def _error_to(self, opaque: int, request: Any, err: BaseException) -> None:
        """Give one popped request (or one put of a run) its error; never raises."""
        try:
            if type(request) is Run:
                request.request.on_error_at(request.index_of(opaque), err)
            else:
                request.on_error(err)
        except Exception:
            log.exception("request callback failed on %s", self.name)

    def _init_reading(self) -> None:
        """The state shared by the reader thread and a blocking send reading its own
        reply (:meth:`read_own`); called by the connection before its threads start."""
        #: held while reading the socket and parsing: by the reader or a blocking send
        self._rlock = threading.Lock()
        #: bytes read and not parsed yet (a partial reply), under ``_rlock``
        self._rbuf = b""
        #: a blocking send reads the socket: the reader thread keeps off it
        self._caller_reading = False
        #: the reader thread waits on ``_unpark`` instead of the socket (blocking sends
        #: read their replies; put() without flush and read_own() hand reading back)
        self._parked = False
        self._unpark = threading.Event()
        self._caller_done = 0.0
        self._cpoll = select.poll()
        self._cpoll.register(self._sock.fileno(),
                             select.POLLIN | select.POLLERR | select.POLLHUP)

    def _handover(self) -> None:
        """Let the reader thread read again (it may be parked)."""
        if self._parked:
            self._unpark.set()

    def read_own(self, request: Any, deadline: float) -> None:
        """Called by a thread that just wrote ``request`` (``put(..., flush=True)``) and
        will wait for it: when it is the only request in flight, read its reply here,
        until ``deadline`` at most, instead of waiting for the reader thread to read
        it and wake this one (one thread hand-over per round trip instead of three;
        the reader thread parks meanwhile).  Anything else in the bytes -- a reply to
        another request, out of order or later -- is left to the reader thread, and
        this returns: the caller then waits for ``request`` as usual.  Never raises:
        a failure of the connection fails its requests (``request`` included)."""
        if (len(self._pending) != 1 or threading.current_thread() is self._reader
                or not self._rlock.acquire(False)):
            self._handover()
            return
        try:
            self._caller_reading = True
            pending = self._pending
            buf = self._rbuf
            # (not ``request in pending.values()``: a dict keeps the slots of popped
            # entries until it is resized, and iterating it walks them all)
            while self._error is None and not request.done():
                if buf:
                    replies, used = scan_results(buf)
                    if replies:
                        code, opaque, body = replies[0]
                        if len(replies) > 1 or used != len(buf) or pending.get(opaque) \
                                is not request:
                            break  # not for it, or more than its reply: the reader's
                        del pending[opaque]
                        buf = b""
                        self._last_reply = time.monotonic()
                        self._freed(request._pipe_size)
                        try:
                            request.on_reply(code, body)
                        except Exception:
                            log.exception("request callback failed on %s", self.name)
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                # (in slices: should the request fail here and be retried elsewhere --
                # a stale reply swept by the reader thread -- this stops soon after)
                if not self._cpoll.poll(min(left, 0.05) * 1000):
                    continue
                try:
                    data = self._sock.recv(_RECV_SIZE, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if not data:
                    raise closed_error(f"broker {self.name} closed the connection", None)
                buf = buf + data if buf else data
            self._rbuf = buf
        except ConnectionClosedError as e:
            self._fail(e)
        except ProtocolError as e:
            self._fail(closed_error(f"malformed reply from broker {self.name}: {e}", e))
        except OSError as e:
            self._fail(closed_error(f"reading from broker {self.name} failed: {e}", e))
        finally:
            self._caller_reading = False
            self._caller_done = time.monotonic()
            self._rlock.release()
            if self._rbuf or self._pending or self._error is not None:
                self._handover()

    def _read_loop(self) -> None:
        sock = self._sock
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        tick = max(0.01, min(0.1, self.request_timeout / 4))
        tick_ms = int(tick * 1000)
        next_sweep = time.monotonic() + tick
        recv = sock.recv
        rlock = self._rlock
        unpark = self._unpark
        trickle = True
        try:
            while self._error is None:
                if self._caller_reading or self._parked:
                    # A blocking send reads its own reply (read_own): keep off the socket
                    # while it does, and while such sends follow one another with
                    # nothing else to read (no wake-up per round trip); back on it
                    # when handed over, or a tick after the last one.
                    if not self._caller_reading and (
                            self._pending or self._rbuf
                            or time.monotonic() - self._caller_done > tick):
                        self._parked = False
                        trickle = True
                        continue
                    self._parked = True
                    if unpark.wait(tick):
                        unpark.clear()
                    if time.monotonic() >= next_sweep:
                        self._sweep()
                        next_sweep = time.monotonic() + tick
                    continue
                # Under load try a read first: the next replies are already there, and
                # every blocking call costs a GIL hand-over.  After a short read (a
                # few replies: blocking sends, a light load) wait for the next bytes
                # first: a read that finds nothing costs an exception.
                if trickle and not self._rbuf and not poller.poll(tick_ms):
                    self._sweep()
                    next_sweep = time.monotonic() + tick
                    continue
                if self._caller_reading:  # its reply came: leave it to it, park
                    continue
                with rlock:
                    if self._caller_reading:
                        continue
                    try:
                        data = recv(_RECV_SIZE, socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        if self._rbuf:  # handed over by read_own: parse what it left
                            self._rbuf = self._handle(self._rbuf)
                        trickle = True
                        continue
                    if not data:
                        raise closed_error(f"broker {self.name} closed the connection", None)
                    trickle = len(data) < _BULK_MIN
                    buf = self._rbuf
                    self._rbuf = self._handle(buf + data if buf else data)
                if time.monotonic() >= next_sweep:
                    self._sweep()
                    next_sweep = time.monotonic() + tick
        except ConnectionClosedError as e:
            self._fail(e)
        except ProtocolError as e:
            self._fail(closed_error(f"malformed reply from broker {self.name}: {e}", e))
        except OSError as e:
            self._fail(closed_error(f"reading from broker {self.name} failed: {e}", e))
        except BaseException as e:  # pragma: no cover - a bug; never leave callers hanging
            log.exception("reader of %s crashed", self.name)
            self._fail(closed_error(f"reader of {self.name} crashed: {e!r}", e))
        finally:
            if self._writer.ident is not None and self._writer is not threading.current_thread():
                self._writer.join(5.0)
            try:
                sock.close()
            except OSError:
                pass

    def _handle(self, buf: bytes) -> bytes:
        """Complete every whole reply in ``buf``; return the unparsed rest."""
        kind = self.ack_type
        if kind is not None and _take_acks is not None:
            used, freed, waited = _take_acks(buf, self._pending, kind, _FINISHED)
            if used:
                self._last_reply = time.monotonic()
                try:
                    for request in waited:
                        try:
                            request._notify()
                        except Exception:
                            log.exception("request callback failed on %s", self.name)
                finally:
                    if freed:
                        self._freed(freed)
                if used == len(buf):
                    return b""
                buf = buf[used:]
        if len(buf) < _BULK_MIN:  # a few replies (a caller waiting for each): one by one
            return self._handle_results(buf)
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
        if kind is Run:
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
                    if type(request) is Run:
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
            raise closed_error(f"no reply from broker {self.name} for {idle:.1f}s "
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
        self._freed(sum(r.sizes[r.index_of(op)] if type(r) is Run else r._pipe_size
                        for op, r in expired))
        log.warning("%d request(s) to broker %s unanswered for over %gs while later ones "
                    "were answered", len(expired), self.name, self.stale_timeout)
        for opaque, request in expired:
            self._error_to(opaque, request, SendTimeoutError(
                f"broker {self.name} answered later requests but not this one in "
                f"{now - request._pipe_sent:.1f}s (stale_timeout {self.stale_timeout:g}s)"))


def closed_error(msg: str, cause: BaseException | None) -> ConnectionClosedError:
    err = ConnectionClosedError(msg)
    err.__cause__ = cause
    return err
