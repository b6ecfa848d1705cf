"""The connection side of fetching: a runner's fetch session and a partition's read-ahead.

kafka-python's fetcher keeps the wire apart from the subscription state; so does
this module.  Two objects, each with one owner:

- :class:`FetchSession` belongs to one fetch runner thread (no locking): it
  owns that runner's connections (one per broker address), sends the ``get``
  of the partition it is fetching and the get sent ahead, receives the replies
  and asks the broker for positions (``offset``, offset for a time).  A runner
  fetches one partition at a time: :meth:`FetchSession.bind` makes a partition
  the current one (its broker is chosen then, by :class:`BrokerRoute`, the one
  place that decides it), and every request after that is about it.
- :class:`Readahead` belongs to one partition while a fetch manager has it: the
  buffer its replies are received into and the bytes fetched ahead (the
  unconsumed tail of the last reply plus the reply of the get sent ahead),
  valid only for the offset and broker they were read at.  Runners share one
  delay queue, so a partition's next fetch may run on another runner: the
  bytes belong to the partition, not to the runner that read them.  Written by
  the runner holding the partition, or by the manager under its lock while
  the partition is parked with the long poller (no runner holds it then).

Transport failures arrive as :class:`~metaq.BrokerUnavailableError` (``metaq.net``
converts them); after one the session forgets that broker's connection
(:meth:`FetchSession.failed`) and the next fetch connects again.  When the route
moves a broker id to another broker (master and slaves, see ``_route``), the next
:meth:`FetchSession.bind` closes the connections to brokers no longer read from.
"""

from __future__ import annotations

import logging

from metaq._errors import BrokerError, BrokerUnavailableError
from metaq._types import BrokerAddress
from metaq.consumer._route import BrokerRoute
from metaq.consumer._subscription import PartitionState
from metaq.net import BrokerConnection, offset_for_time

__all__ = ["FetchSession", "Readahead", "LOG_END"]

log = logging.getLogger(__name__)

#: the ``offset`` command clamps to the log's end
LOG_END = 2**63 - 1


class Readahead:
    """A partition's receive buffer and the bytes fetched ahead (see the module docstring)."""

    __slots__ = ("buf", "data", "offset", "address")

    def __init__(self) -> None:
        #: the partition's own receive buffer (replaced, never resized: views stay valid)
        self.buf: bytearray | None = None
        #: bytes fetched ahead, a view of ``buf``, delivered next if still at ``offset``
        self.data: memoryview | None = None
        self.offset = -1
        self.address: BrokerAddress | None = None

    def take(self, offset: int, address: BrokerAddress) -> memoryview | None:
        """The bytes fetched ahead if they start at ``offset`` and came from ``address``;
        forgotten either way (the offset moved: seek, 301, resync, size growth)."""
        data, self.data = self.data, None
        if data and self.offset == offset and self.address == address:
            return data
        return None

    def keep(self, data: memoryview, offset: int, address: BrokerAddress) -> None:
        """``data`` (bytes at ``offset`` from ``address``) is delivered next, if the
        partition is still at ``offset`` then."""
        self.data, self.offset, self.address = data, offset, address

    def drop(self) -> None:
        self.data = None

    def idle(self) -> None:
        """The partition waits with nothing in hand: give its receive buffer back."""
        if self.data is None:
            self.buf = None


class FetchSession:
    """One fetch runner's connections and the requests of the partition it fetches."""

    __slots__ = ("_group", "_timeout", "_route", "_conns", "pf", "ra", "address", "_conn",
                 "_ahead", "_epoch")

    def __init__(self, *, group: str, timeout: float, route: BrokerRoute) -> None:
        self._group = group
        self._timeout = timeout
        self._route = route
        self._conns: dict[BrokerAddress, BrokerConnection] = {}
        #: the partition fetched now (:meth:`bind`), its read-ahead and its broker
        self.pf: PartitionState | None = None
        self.ra = Readahead()
        self.address: BrokerAddress | None = None
        self._conn: BrokerConnection | None = None
        self._ahead: int | None = None  # opaque of the get sent ahead, reply not read yet
        self._epoch = route.epoch  # the route's, when the connections were last pruned

    # -- the partition fetched now ---------------------------------------------------------

    def bind(self, pf: PartitionState, ra: Readahead) -> BrokerAddress | None:
        """Fetch ``pf`` (read ahead into ``ra``) next; the broker it is read from, or
        None when none is known right now."""
        self.pf, self.ra, self._ahead = pf, ra, None
        if self.route_moved:
            self.prune()
        self.address = address = self._route.address(pf)
        self._conn = None if address is None else self._conns.get(address)
        return address

    @property
    def route_moved(self) -> bool:
        """The route moved a broker id since this session last pruned."""
        return self._epoch != self._route.epoch

    def prune(self) -> None:
        """The route moved a broker id: close the connections to brokers no partition
        is read from any more (a master that went away, a slave left for its master)."""
        self._epoch = self._route.epoch
        in_use = self._route.in_use()
        if in_use is None:
            return
        for address in [a for a in self._conns if a not in in_use]:
            log.debug("closing the fetch connection to %s:%s: no longer read from", *address)
            self._conns.pop(address).close()

    def take_ready(self) -> memoryview | None:
        """The bound partition's bytes fetched ahead, if still at its offset."""
        assert self.pf is not None and self.address is not None
        return self.ra.take(self.pf.offset, self.address)

    @property
    def holds(self) -> bool:
        """The bound partition's broker holds gets (and this consumer uses that)."""
        return self.address is not None and self._route.holds(self.address)

    @property
    def from_slave(self) -> bool:
        """The bound partition is read from a slave (its log may not have reached a
        position its master has)."""
        return self.address is not None and self._route.is_slave(self.address)

    @property
    def exact_offsets(self) -> bool:
        """The bound partition's broker answers ``offset`` exactly (``+boundary``)."""
        return self.address is not None and self._route.exact_offsets(self.address)

    def connect(self) -> BrokerConnection:
        """The connection to the bound partition's broker (opened, and the broker's
        capabilities learned, on first use)."""
        conn = self._conn
        if conn is None:
            address = self.address
            assert address is not None
            conn = BrokerConnection(*address, timeout=self._timeout)
            self._conns[address] = self._conn = conn
            self._route.learn(address, conn)
        return conn

    # -- requests about the bound partition -----------------------------------------------

    def get(self) -> memoryview:
        """The bytes at the partition's offset (``max_size`` of them at most), received
        into its read-ahead buffer; BrokerError for a ``result``."""
        pf = self.pf
        assert pf is not None
        conn = self.connect()
        return self._receive(conn.send_get(pf.topic, self._group, pf.index, pf.offset,
                                           pf.max_size), b"")

    def send_ahead(self, offset: int) -> None:
        """Ask for the bytes at ``offset`` now; the reply is read by :meth:`end_ahead`
        (the broker sends it while the listener runs)."""
        pf = self.pf
        assert pf is not None and self._conn is not None
        self._ahead = self._conn.send_get(pf.topic, self._group, pf.index, offset,
                                          pf.max_size)

    def end_ahead(self, tail: memoryview | None) -> bool:
        """Read the reply of the get sent ahead: kept as the partition's ready bytes
        after ``tail`` (the bytes not consumed yet, which it continues), or dropped
        when ``tail`` is None.  True when it said there is nothing after the bytes in
        hand (404)."""
        ra, pf = self.ra, self.pf
        ra.drop()
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return False
        assert pf is not None and self._conn is not None and self.address is not None
        try:
            if tail is None:
                self._conn.skip_reply(ahead)
                return False
            # the tail is a view of the receive buffer, which the reply overwrites
            ready = self._receive(ahead, bytes(tail))
        except BrokerError as e:  # e.g. 404, nothing new yet: the next fetch asks again
            log.debug("get ahead of %s/%s: %s", pf.topic, pf.partition, e)
            return e.code == 404
        except BrokerUnavailableError as e:
            self.failed()
            log.debug("get ahead of %s/%s failed: %s", pf.topic, pf.partition, e)
            return False
        ra.keep(ready, pf.offset, self.address)
        return False

    def read(self, offset: int, size: int) -> memoryview:
        """Up to ``size`` bytes of the bound partition at ``offset``, outside its
        read-ahead (valid until the next request on this session)."""
        pf = self.pf
        assert pf is not None
        return self.connect().get(pf.topic, self._group, pf.index, offset, size)

    def offset(self, offset: int) -> int:
        """The broker's nearest valid offset to ``offset`` in the bound partition
        (:data:`LOG_END`: its log end; 0: its log start)."""
        pf = self.pf
        assert pf is not None
        return self.connect().offset(pf.topic, self._group, pf.index, offset)

    def resume_after_damage(self, bad: int) -> int:
        """Where to go on after a damaged message at ``bad`` in the bound partition
        (``BrokerConnection.resume_after_damage``)."""
        pf = self.pf
        assert pf is not None
        return self.connect().resume_after_damage(pf.topic, self._group, pf.index, bad)

    def offset_for_time(self, when_ms: int) -> int:
        """The offset of the first message at or after ``when_ms`` (the broker's time
        index, or a search)."""
        pf = self.pf
        assert pf is not None
        return offset_for_time(self.connect(), pf.topic, pf.index, when_ms,
                               group=self._group).offset

    def failed(self) -> None:
        """The bound partition's broker connection failed: close and forget it (and
        the bytes fetched ahead); the next fetch connects again."""
        self.ra.drop()
        self._ahead = None
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            if self.address is not None and self._conns.get(self.address) is conn:
                del self._conns[self.address]

    def close(self) -> None:
        """Close every connection (the runner stops)."""
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        self._conn = None

    def _receive(self, opaque: int, prefix: bytes) -> memoryview:
        assert self._conn is not None
        ra = self.ra
        ra.buf, n = self._conn.read_get_into(opaque, prefix, ra.buf)
        return memoryview(ra.buf)[:n]
