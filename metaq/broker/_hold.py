"""Held gets: metaq-py's long-polling extension of Metaq's ``get``.

A ``get`` that carries ``hold=<ms>`` (a metaq-py client sends it only to a broker
whose ``version`` answer lists ``+hold``) and asks for the log's readable end,
where a plain get would answer 404 "no message", is parked here instead.  It is
answered by the normal ``get`` path the moment the partition's readable end
moves (a put landed; with group commit, its fsync finished), or with the usual
404 when its hold runs out.  A plain get, as every Java Metaq client sends it,
is never held.

Costs: one small object and one timer handle of the event loop per held get; no
thread and no polling.  A held get takes no place in its connection's ordered
reply queue, so replies to later requests on the same connection are never
delayed by it (Metaq replies carry the request's opaque).  Bounds: the broker
clamps each hold to ``max_hold`` and holds at most ``max_held_gets`` at once
(beyond it gets are answered at once, as a Java broker would); a connection
that closes drops its held gets.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from metaq.protocol import GetRequest, replica_of_group

if TYPE_CHECKING:
    from metaq.broker._connection import Connection
    from metaq.broker._storage import PartitionLog

__all__ = ["HeldGets", "HeldRequests"]

log = logging.getLogger(__name__)

#: Answers a get (the server's normal get path) on a connection.
Answer = Callable[["Connection", GetRequest], None]


class _Held:
    __slots__ = ("conn", "req", "plog", "timer", "replica")

    def __init__(self, conn: Connection, req: GetRequest, plog: PartitionLog) -> None:
        self.conn = conn
        self.req = req
        self.plog = plog
        self.timer: asyncio.TimerHandle | None = None
        #: a slave's get reads up to the readable end; a consumer's below the master's
        #: high watermark too (``_replicas``)
        self.replica = replica_of_group(req.group) is not None


class HeldGets:
    """Every held get of one broker, by partition and by connection.

    Runs in the broker's event loop only.  ``stats`` is the server's counter:
    ``get_held`` (gets parked), ``get_held_woken`` (answered by a put),
    ``get_held_expired`` (answered at the end of their hold), ``get_hold_refused``
    (answered at once because ``max_held_gets`` were held).
    """

    def __init__(self, answer: Answer, *, max_hold: float, max_held: int,
                 stats: collections.Counter) -> None:
        self._answer = answer
        self._max_hold = max_hold
        self._max_held = max_held
        self._stats = stats
        self._by_log: dict[PartitionLog, dict[_Held, None]] = {}
        self._count = 0
        self._firing: set[PartitionLog] = set()
        #: set by the server while it serves one read of a connection: logs made
        #: readable then are answered when it calls :meth:`answer_due` (once a run of
        #: puts is stored, and at the end of the read), not a turn of the loop later
        self.defer = False
        self._due: list[PartitionLog] = []

    def __len__(self) -> int:
        return self._count

    def hold(self, conn: Connection, req: GetRequest, plog: PartitionLog) -> bool:
        """Park ``req`` until ``plog``'s readable end moves or its hold runs out;
        False when it cannot be held (the caller answers it at once)."""
        if self._max_hold <= 0:
            return False
        if self._count >= self._max_held:
            self._stats["get_hold_refused"] += 1
            return False
        held = _Held(conn, req, plog)
        waiting = self._by_log.get(plog)
        if waiting is None:
            waiting = self._by_log[plog] = {}
            plog.on_readable = self._readable
        waiting[held] = None
        conn.held[held] = None
        self._count += 1
        self._stats["get_held"] += 1
        seconds = min(req.hold_ms / 1000.0, self._max_hold)
        held.timer = asyncio.get_running_loop().call_later(seconds, self._expire, held)
        return True

    def _readable(self, plog: PartitionLog) -> None:
        """(Called by the log, maybe inside a put) its readable end moved: answer its
        held gets once for all puts of this read (:attr:`defer`, :meth:`answer_due`),
        or of this turn of the loop when it moved outside a read (an fsync, a
        watermark)."""
        if plog not in self._firing and plog in self._by_log:
            self._firing.add(plog)
            if self.defer:
                self._due.append(plog)
            else:
                asyncio.get_running_loop().call_soon(self._fire, plog)

    def answer_due(self) -> None:
        """(The server, at the end of a read it served) answer the held gets of the
        logs that read made readable."""
        due, self._due = self._due, []
        for plog in due:
            self._fire(plog)

    def _fire(self, plog: PartitionLog) -> None:
        self._firing.discard(plog)
        waiting = self._by_log.get(plog)
        if not waiting:
            return
        end = plog.readable_end
        hw = plog.high_watermark
        visible = end if hw is None else min(end, hw)
        woken = [held for held in waiting
                 if held.req.offset < (end if held.replica else visible)]
        for held in woken:  # (a get past an fsync still running waits on)
            del waiting[held]
        if not waiting:
            del self._by_log[plog]
            plog.on_readable = None
        for held in woken:
            self._forget(held)
            self._stats["get_held_woken"] += 1
            self._reply(held)

    def _expire(self, held: _Held) -> None:
        held.timer = None
        waiting = self._by_log.get(held.plog)
        if waiting is None or held not in waiting:
            return
        del waiting[held]
        if not waiting:
            del self._by_log[held.plog]
            held.plog.on_readable = None
        self._forget(held)
        self._stats["get_held_expired"] += 1
        self._reply(held)

    def _forget(self, held: _Held) -> None:
        self._count -= 1
        held.conn.held.pop(held, None)
        if held.timer is not None:
            held.timer.cancel()
            held.timer = None

    def _reply(self, held: _Held) -> None:
        if held.conn.closing:
            return
        try:
            self._answer(held.conn, held.req._replace(hold_ms=0))
        except Exception:
            log.exception("answering a held get of %s failed; closing its connection",
                          held.conn.peer)
            held.conn.abort("internal error answering a held get")

    def drop(self, conn: Connection) -> None:
        """``conn`` closed: forget its held gets (nobody reads their answers)."""
        for held in list(conn.held):
            waiting = self._by_log.get(held.plog)
            if waiting is not None:
                waiting.pop(held, None)
                if not waiting:
                    del self._by_log[held.plog]
                    held.plog.on_readable = None
            self._forget(held)


class HeldRequests:
    """At most one request per connection parked until something changes or its hold
    runs out: a slave's ``txlog`` (``_txfeed``) and ``watermarks`` (``_watermarks``).
    ``answer(conn, opaque, since)`` answers one; ``since`` is what the request said it
    holds.  Event loop only."""

    def __init__(self, answer: Callable[[Connection, int, int], None]) -> None:
        self._answer = answer
        self._held: dict[Connection, tuple[int, int, asyncio.TimerHandle]] = {}

    def __bool__(self) -> bool:
        return bool(self._held)

    def hold(self, conn: Connection, opaque: int, since: int, seconds: float) -> None:
        """Park this request of ``conn`` (an older one of it is dropped unanswered: the
        connection asks again only once answered, so there is none)."""
        self.drop(conn)
        timer = asyncio.get_running_loop().call_later(seconds, self._expire, conn)
        self._held[conn] = (opaque, since, timer)

    def drop(self, conn: Connection) -> None:
        """Forget ``conn``'s request (it closed, or asked again)."""
        held = self._held.pop(conn, None)
        if held is not None:
            held[2].cancel()

    def answer_all(self, answer: Callable[[Connection, int, int], None] | None = None) -> None:
        """Something changed: answer every parked request (with ``answer`` if given)."""
        held, self._held = self._held, {}
        for conn, (opaque, since, timer) in held.items():
            timer.cancel()
            (answer or self._answer)(conn, opaque, since)

    def _expire(self, conn: Connection) -> None:
        held = self._held.pop(conn, None)
        if held is not None:
            self._answer(conn, held[0], held[1])
