"""Long polling: one thread that keeps held gets out for partitions with nothing new.

When a fetch runner finds a partition at its log end and the broker offers
holding (``+hold`` in its ``version`` answer; see ``metaq.broker._hold``), the
:class:`~metaq.consumer._fetcher.FetchManager` parks the partition here instead
of backing off.  This thread sends one ``get ... hold=<ms>`` for it on a
connection of its own per broker (``metaq.net``'s
:class:`~metaq.net.MultiplexedConnection`: non-blocking, replies matched by
opaque since held gets are answered out of order; one ``selectors`` loop here
drives them all) and waits:

- a ``value`` reply (a message arrived) goes back to the manager as the
  partition's ready bytes, and a runner delivers them at once, or this thread
  does when the manager took the partition for it (no runner holds any:
  ``deliver``, called once the replies of a read were handed back);
- a 404 at the end of the hold: the held get is sent again (an idle partition
  costs one request per hold period, and no CPU in between);
- a 404 long before the hold ran out (the broker did not hold it: at its
  ``max_held_gets``, or holding switched off) hands the partition back with
  Metaq's backoff; any other answer, a dead connection or a reply that never
  comes hands it back to the runners, whose normal path handles it (after
  Metaq's backoff where the connection failed, so nothing spins).

When the route moves a broker id to another broker (its master went away or
came back, a slave appeared: ``_route``), the manager wakes the partitions and
:meth:`LongPoller.keep_only` closes the connections to brokers no longer read
from; a held get still queued for a partition woken meanwhile is not sent.

It never decides ownership or when it delivers: the manager drops a reply
whose partition was revoked, sought, paused or woken meanwhile (its park token
changed), takes a partition for this thread only as a runner would take it, and
the delivery checks the lease as a runner's does.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from metaq._errors import BrokerUnavailableError, MetaqError
from metaq._types import BrokerAddress
from metaq.consumer._subscription import PartitionState
from metaq.net import MultiplexedConnection
from metaq.protocol import Value

__all__ = ["LongPoller", "Parked"]

log = logging.getLogger(__name__)

#: A 404 that comes back before this share of the asked hold was not held.
_NOT_HELD = 0.5
#: Seconds between looks for held gets past their deadline (hold + reply margin).
_CHECK_EVERY = 1.0
#: The thread waited at least this long (seconds) for what it reads now: it was idle.
_IDLE = 0.0005


class Parked:
    """One held get: partition state, park token, where it asked and when."""

    __slots__ = ("pf", "token", "address", "offset", "sent", "deadline")

    def __init__(self, pf: PartitionState, token: int, address: BrokerAddress,
                 offset: int) -> None:
        self.pf = pf
        self.token = token
        self.address = address
        self.offset = offset
        self.sent = 0.0
        self.deadline = 0.0


#: ``woken(parked, data, backoff)``: ``data`` the bytes a held get brought (or None),
#: ``backoff`` True when the partition should wait as Metaq's backoff says.
Woken = Callable[[Parked, "memoryview | None", bool], None]
#: ``still_parked(parked)``: the partition still waits on this held get.
StillParked = Callable[[Parked], bool]


class LongPoller:
    """The thread behind held gets of one FetchManager (see the module docstring)."""

    def __init__(self, *, group: str, hold: float, connect_timeout: float,
                 reply_margin: float, woken: Woken, still_parked: StillParked,
                 on_error: Callable[[BaseException], None], name: str,
                 deliver: Callable[[], None] | None = None) -> None:
        self._group = group
        self._hold_ms = max(1, int(hold * 1000))
        self._hold = hold
        self._connect_timeout = connect_timeout
        self._margin = reply_margin
        self._woken = woken
        self._still_parked = still_parked
        self._deliver = deliver
        #: (this thread) it waited in select for what it is reading now (``_IDLE``): the
        #: manager lets it deliver only then; when replies keep it busy, runners deliver
        #: while it reads on
        self.idle = False
        self._on_error = on_error
        self._queue: collections.deque[Parked] = collections.deque()
        self._todo: collections.deque[Parked] = collections.deque()  # being sent (thread)
        self._lock = threading.Lock()
        self._signalled = False
        self._closed = False
        self._conns: dict[BrokerAddress, MultiplexedConnection[Parked]] = {}
        #: the brokers still read from, when the route moved a broker id (under the lock;
        #: the thread closes its connections to the others)
        self._keep: frozenset[BrokerAddress] | None = None
        self._next_check = 0.0
        self._sel = selectors.DefaultSelector()
        # the self-pipe that wakes the select (a local socket pair, safe to write to
        # after close, unlike a raw pipe descriptor); brokers are reached through net
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    # -- any thread ------------------------------------------------------------------------
    def park(self, parked: Parked) -> bool:
        """Send a held get for ``parked`` (from a runner, as it lets the partition go);
        False when this poller has stopped (the caller fetches it as before)."""
        with self._lock:
            if self._closed:
                return False
            self._queue.append(parked)
            signal = not self._signalled
            self._signalled = True
        if signal and threading.get_ident() != self._thread.ident:
            self._signal()  # (this thread itself, after delivering, takes the queue next)
        return True

    def keep_only(self, addresses: frozenset[BrokerAddress]) -> None:
        """Close the connections to brokers not in ``addresses`` (the route moved their
        partitions elsewhere, and woke them first: their held gets count for nothing)."""
        with self._lock:
            if self._closed:
                return
            self._keep = addresses
            signal = not self._signalled
            self._signalled = True
        if signal:
            self._signal()

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            self._closed = True
        self._signal()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _signal(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or closing

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                timeout = self._next_deadline()
                waited = time.monotonic()
                ready = self._sel.select(timeout)
                self.idle = time.monotonic() - waited >= _IDLE
                for key, events in ready:
                    conn = key.data
                    if conn is None:
                        self._drain_wakeups()
                        continue
                    if events & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if events & selectors.EVENT_READ and self._conns.get(conn.address) is conn:
                        self._read(conn)
                with self._lock:
                    if self._closed:
                        return
                    todo = self._todo
                    todo.extend(self._queue)
                    self._queue.clear()
                    self._signalled = False
                    keep, self._keep = self._keep, None
                if keep is not None:
                    for conn in [c for a, c in self._conns.items() if a not in keep]:
                        log.debug("closing the long-poll connection to %s: no longer read "
                                  "from", conn.address)
                        self._drop(conn, None)
                while todo:
                    self._send(todo[0])
                    todo.popleft()
                for conn in list(self._conns.values()):
                    if conn.wants_write:
                        self._flush(conn)
                self._check_deadlines()
        except BaseException as e:  # noqa: BLE001 - hand every partition back, report
            log.exception("long-poll thread of group %s failed; partitions fall back to "
                          "Metaq's backoff", self._group)
            self._on_error(e)
        finally:
            with self._lock:
                self._closed = True
                todo = list(self._todo) + list(self._queue)
                self._queue.clear()
            for conn in list(self._conns.values()):
                self._drop(conn, None)
            for parked in todo:
                self._woken(parked, None, True)
            self._sel.close()
            self._wake_r.close()
            self._wake_w.close()

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _next_deadline(self) -> float | None:
        """Select's timeout: held gets' deadlines are looked at about once a second."""
        if not any(conn.pending for conn in self._conns.values()):
            return None
        return max(0.0, self._next_check - time.monotonic())

    def _connect(self, address: BrokerAddress) -> MultiplexedConnection[Parked] | None:
        conn = self._conns.get(address)
        if conn is not None:
            return conn
        try:
            conn = MultiplexedConnection(address, timeout=self._connect_timeout)
        except BrokerUnavailableError as e:
            log.debug("long-poll connection failed: %s", e)
            return None
        self._conns[address] = conn
        self._sel.register(conn, selectors.EVENT_READ, conn)
        return conn

    def _send(self, parked: Parked) -> None:
        if not self._still_parked(parked):
            return  # woken meanwhile (moved to another broker, sought, revoked): not held
        conn = self._connect(parked.address)
        if conn is None:  # the runner's own fetch meets the failure, after a backoff
            self._woken(parked, None, True)
            return
        pf = parked.pf
        try:
            conn.send_get(parked, pf.topic, self._group, pf.index, parked.offset,
                          pf.max_size, hold_ms=self._hold_ms)
        except MetaqError as e:  # a name the protocol cannot carry: not ours to hold
            log.warning("cannot hold a get of %s/%s: %s", pf.topic, pf.partition, e)
            self._woken(parked, None, True)
            return
        parked.sent = now = time.monotonic()
        parked.deadline = now + self._hold + self._margin

    def _flush(self, conn: MultiplexedConnection[Parked]) -> None:
        try:
            conn.flush()
        except BrokerUnavailableError as e:
            self._drop(conn, e)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.wants_write else 0)
        self._sel.modify(conn, events, conn)

    def _read(self, conn: MultiplexedConnection[Parked]) -> None:
        try:
            replies = conn.read()
        except BrokerUnavailableError as e:
            self._drop(conn, e)
            return
        now = time.monotonic()
        try:
            for parked, reply in replies:
                if type(reply) is Value:
                    self._woken(parked, memoryview(reply.body) if reply.body else None, False)
                elif reply.code == 404 and self._still_parked(parked):
                    if now - parked.sent >= self._hold * _NOT_HELD:
                        self._send(parked)  # the hold ran out: hold again
                    else:
                        self._woken(parked, None, True)  # not held: Metaq's backoff
                else:
                    self._woken(parked, None, False)
        finally:  # what the manager took for this thread is delivered (and let go) always
            if self._deliver is not None:
                self._deliver()

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _CHECK_EVERY
        for conn in list(self._conns.values()):
            if any(p.deadline <= now for p in conn.pending):
                self._drop(conn, BrokerUnavailableError(
                    f"a held get was not answered in time by broker {conn.address}",
                    address=conn.address))

    def _drop(self, conn: MultiplexedConnection[Parked], err: BaseException | None) -> None:
        """Close ``conn``; its partitions go back to the runners."""
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        if err is not None:
            log.info("long-poll connection to %s lost: %s", conn.address, err)
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()
        for parked in conn.take_pending():  # back off: a broker that keeps dropping
            self._woken(parked, None, True)  # us must not make partitions spin

