"""Which broker a partition is read from, and what each broker offers.

One :class:`BrokerRoute` per fetch manager, shared by its runners and its long
poller.  :meth:`BrokerRoute.address` is the one place that decides where a
partition's ``get`` goes: today the address the coordinator recorded for the
partition's broker id (the master's); with replication, the master or a slave
of the same broker id (Metaq's ``Cluster.getBrokerRandom(brokerId)``), chosen
here and nowhere else.

What a broker offers is learned once per new runner connection from its
``version`` answer (``+hold``: it holds gets, so a partition at its log end is
parked with the long poller instead of backed off).  Runners write that table
from their own threads; a dict item assignment is atomic, and a stale answer
only costs one backoff, so it takes no lock.
"""

from __future__ import annotations

import logging

from metaq._errors import BrokerError
from metaq._types import BrokerAddress
from metaq.consumer._subscription import PartitionState
from metaq.net import BrokerConnection
from metaq.protocol import HOLD_CAPABILITY

__all__ = ["BrokerRoute"]

log = logging.getLogger(__name__)


class BrokerRoute:
    """Where partitions are read from (see the module docstring)."""

    __slots__ = ("_long_poll", "_holds")

    def __init__(self, *, long_poll: bool) -> None:
        self._long_poll = long_poll
        #: broker address -> it offers held gets (asked on each new runner connection)
        self._holds: dict[BrokerAddress, bool] = {}

    def address(self, pf: PartitionState) -> BrokerAddress | None:
        """The broker ``pf`` is read from now, or None when none is known (its broker
        is not registered right now): the partition waits."""
        return pf.broker_address

    def learn(self, address: BrokerAddress, conn: BrokerConnection) -> None:
        """A runner connected to ``address``: ask what it offers (only what this
        consumer uses: held gets when long polling)."""
        if self._long_poll:
            self._holds[address] = _offers_hold(conn)

    def holds(self, address: BrokerAddress) -> bool:
        """Park partitions of ``address`` at their log end with the long poller."""
        return self._long_poll and self._holds.get(address, False)


def _offers_hold(conn: BrokerConnection) -> bool:
    """Does this broker hold gets (``+hold`` in its ``version`` answer)?"""
    try:
        return HOLD_CAPABILITY in conn.version().split()
    except BrokerError:
        return False  # a broker that does not answer version: Metaq's backoff
