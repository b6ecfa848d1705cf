"""Which broker a partition is read from, and what each broker offers.

One :class:`BrokerRoute` per fetch manager, shared by its runners and its long
poller.  :meth:`BrokerRoute.address` is the one place that decides where a
partition's ``get`` goes: today the address the coordinator recorded for the
partition's broker id (the master's); with replication, the master or a slave
of the same broker id (Metaq's ``Cluster.getBrokerRandom(brokerId)``), chosen
here and nowhere else.

What a broker offers is learned once per new runner connection from its
``version`` answer: ``+hold`` (it holds gets, so a partition at its log end is
parked with the long poller instead of backed off) and ``+boundary`` (its
``offset`` answers are exact: a message's start inside the log, and the end it
serves; a Java Metaq broker answers a segment's start, which says nothing about
messages, and a max offset that may lag what it serves).  Runners write
that table from their own threads; a dict item assignment is atomic, and a
stale answer only costs one backoff, so it takes no lock.
"""

from __future__ import annotations

import logging

from metaq._errors import BrokerError
from metaq._types import BrokerAddress
from metaq.consumer._subscription import PartitionState
from metaq.net import BrokerConnection
from metaq.protocol import BOUNDARY_CAPABILITY, HOLD_CAPABILITY

__all__ = ["BrokerRoute"]

log = logging.getLogger(__name__)


class BrokerRoute:
    """Where partitions are read from (see the module docstring)."""

    __slots__ = ("_long_poll", "_offers")

    def __init__(self, *, long_poll: bool) -> None:
        self._long_poll = long_poll
        #: broker address -> the capabilities in its ``version`` answer (asked on each
        #: new runner connection)
        self._offers: dict[BrokerAddress, frozenset[str]] = {}

    def address(self, pf: PartitionState) -> BrokerAddress | None:
        """The broker ``pf`` is read from now, or None when none is known (its broker
        is not registered right now): the partition waits."""
        return pf.broker_address

    def learn(self, address: BrokerAddress, conn: BrokerConnection) -> None:
        """A runner connected to ``address``: ask what it offers."""
        self._offers[address] = _capabilities(conn)

    def holds(self, address: BrokerAddress) -> bool:
        """Park partitions of ``address`` at their log end with the long poller."""
        return self._long_poll and HOLD_CAPABILITY in self._offers.get(address, ())

    def exact_offsets(self, address: BrokerAddress) -> bool:
        """``address`` answers ``offset`` exactly: a message's start inside the log,
        and the end it serves."""
        return BOUNDARY_CAPABILITY in self._offers.get(address, ())


def _capabilities(conn: BrokerConnection) -> frozenset[str]:
    """The ``+`` tokens of a broker's ``version`` answer (none from a Java broker)."""
    try:
        return frozenset(t for t in conn.version().split() if t.startswith("+"))
    except BrokerError:
        return frozenset()  # a broker that does not answer version: Metaq's ways
