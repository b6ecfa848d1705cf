"""Which broker a partition is read from, and what each broker offers.

One :class:`BrokerRoute` per fetch manager, shared by its runners and its long
poller.  :meth:`BrokerRoute.address` is the one place that decides where a
partition's ``get`` goes: a broker id is served by its master and any slaves
(``brokers/ids/<id>/slave<N>``), which hold the same log at the same offsets, so
a partition keeps its position whichever of them it is read from.  The
coordinator hands the route each broker id's registered brokers
(:meth:`BrokerRoute.update`, after every read of the group) and
:meth:`zk_layout.BrokerReplicas.choose` picks one by ``read_from``:

- ``master`` (the default, Metaq's ``Cluster.getBrokerRandom(brokerId)``): the
  master while it is registered, else a slave of the same broker id;
- ``slave-preferred``: a slave while one is registered, else the master (takes
  read load off the master).

Among several slaves the pick is deterministic per consumer (its id hashed), not
random as in Java: a consumer stays on one slave while the set does not change,
and a group's members spread over the slaves.  A partition whose broker id the
route was never told about (a fetch manager driven without a coordinator) is read
from the address recorded in its state.

When a broker id's chosen broker changes (its master went away or came back, a
slave appeared), :meth:`BrokerRoute.update` says which ids moved and bumps
:attr:`BrokerRoute.epoch`; the fetch manager wakes their partitions (a held get
parked on the old broker then counts for nothing, and the long poller drops its
connection there), and each runner's session closes its connections to brokers
no longer chosen (:meth:`BrokerRoute.in_use`) before it fetches again (an idle
runner is woken for it).  A slave's log may lag its master's: a position above a
slave's end (:meth:`BrokerRoute.is_slave`) is waited for, never reset (``_fetch``).

What a broker offers is learned once per new runner connection from its
``version`` answer: ``+hold`` (it holds gets, so a partition at its log end is
parked with the long poller instead of backed off) and ``+boundary`` (its
``offset`` answers are exact: a message's start inside the log, and the end it
serves; a Java Metaq broker answers a segment's start, which says nothing about
messages, and a max offset that may lag what it serves).  Runners write
that table from their own threads; a dict item assignment is atomic, and a
stale answer only costs one backoff, so it takes no lock.  The broker table is
replaced whole by the coordinator thread (one reference assignment) and only
read by the others.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from metaq._errors import BrokerError, ConfigError
from metaq._types import BrokerAddress
from metaq.consumer._subscription import PartitionState
from metaq.net import BrokerConnection
from metaq.protocol import BOUNDARY_CAPABILITY, HOLD_CAPABILITY
from zk_layout import READ_FROM, BrokerReplicas

__all__ = ["BrokerRoute"]

log = logging.getLogger(__name__)


class BrokerRoute:
    """Where partitions are read from (see the module docstring)."""

    __slots__ = ("_long_poll", "_offers", "_read_from", "_salt", "_brokers", "_chosen",
                 "_slaves", "epoch")

    def __init__(self, *, long_poll: bool, read_from: str = "master", salt: str = "") -> None:
        self._long_poll = long_poll
        if read_from not in READ_FROM:
            raise ConfigError(f"read_from must be one of {READ_FROM}, got {read_from!r}")
        self._read_from = read_from
        #: spreads consumers over a broker id's slaves (the consumer's id)
        self._salt = salt
        #: broker address -> the capabilities in its ``version`` answer (asked on each
        #: new runner connection)
        self._offers: dict[BrokerAddress, frozenset[str]] = {}
        #: broker id -> its registered brokers, and -> the one chosen (replaced whole)
        self._brokers: Mapping[int, BrokerReplicas] = {}
        self._chosen: Mapping[int, BrokerAddress | None] = {}
        #: the chosen brokers that are slaves (replaced whole)
        self._slaves: frozenset[BrokerAddress] = frozenset()
        #: bumped by every update that moved a broker id (sessions prune on a change)
        self.epoch = 0

    def update(self, brokers: Mapping[int, BrokerReplicas]) -> set[int]:
        """The broker ids' registered brokers as just read (coordinator thread); returns
        the ids whose chosen broker changed."""
        chosen = {}
        for bid, replicas in brokers.items():
            address = replicas.choose(self._read_from, self._salt)
            chosen[bid] = None if address is None else BrokerAddress(*address)
        old = self._chosen
        moved = {b for b in chosen.keys() | old.keys() if chosen.get(b) != old.get(b)}
        self._slaves = frozenset(a for b, a in chosen.items()
                                 if a is not None and a != brokers[b].master)
        self._brokers, self._chosen = dict(brokers), chosen
        if moved:
            for bid in sorted(moved):
                log.info("broker %d: reading from %s (was %s; read_from=%s, master %s, "
                         "slaves %s)", bid, _name(chosen.get(bid)), _name(old.get(bid)),
                         self._read_from, _name(brokers[bid].master) if bid in brokers
                         else "-", [n for n, _ in brokers[bid].slaves] if bid in brokers
                         else [])
            self.epoch += 1
        return moved

    def address(self, pf: PartitionState) -> BrokerAddress | None:
        """The broker ``pf`` is read from now, or None when none is known (no broker of
        its id is registered right now): the partition waits."""
        chosen = self._chosen
        if pf.broker_id in chosen:
            return chosen[pf.broker_id]
        return pf.broker_address

    def is_slave(self, address: BrokerAddress) -> bool:
        """``address`` is a slave chosen for its broker id: its log may lag its master's
        (a position above its end is one it has not copied yet, never out of range)."""
        return address in self._slaves

    def in_use(self) -> frozenset[BrokerAddress] | None:
        """The brokers chosen now for the ids the route knows; None before the first
        :meth:`update` (nothing is known to be unused then)."""
        if not self._brokers:
            return None
        return frozenset(a for a in self._chosen.values() if a is not None)

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


def _name(address: tuple[str, int] | None) -> str:
    return "none" if address is None else f"{address[0]}:{address[1]}"


def _capabilities(conn: BrokerConnection) -> frozenset[str]:
    """The ``+`` tokens of a broker's ``version`` answer (none from a Java broker)."""
    try:
        return frozenset(t for t in conn.version().split() if t.startswith("+"))
    except BrokerError:
        return frozenset()  # a broker that does not answer version: Metaq's ways
