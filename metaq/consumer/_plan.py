"""Planning a rebalance: the group as read in, this member's share and what moves out.

Pure: no ZooKeeper, no clock, no state kept.  :func:`make_plan` takes the
topics this member consumes, the :class:`~zk_layout.Topology` a
:class:`~metaq.consumer._view.GroupView` read, the away static members whose
partitions stay held for them (counted as members, so nobody takes their
share), and the assignment strategy; it returns a :class:`Plan`: each
partition of this member's share with the broker id that serves it, the
brokers' addresses, and each broker id's master and slaves (which of them a
partition is read from is the fetcher's ``BrokerRoute``'s choice).
:meth:`Plan.moves` tells, from what is owned now, what to release and what to
claim.  In broadcast mode every member consumes every
partition (owning none).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from metaq._types import BrokerAddress, PartitionKey
from metaq.consumer._assignors import AssignFunction
from zk_layout import BrokerReplicas, StaticMember, Topology, partition_broker_id

__all__ = ["Plan", "make_plan"]


@dataclass(frozen=True)
class Plan:
    """This member's share for one generation."""

    #: planned partition -> the id of the broker that serves it
    target: Mapping[PartitionKey, int] = field(default_factory=dict)
    #: broker id -> its address (None: registered without one, or down when read)
    brokers: Mapping[int, BrokerAddress | None] = field(default_factory=dict)
    #: broker id -> its master and slaves (the route picks one per ``read_from``)
    replicas: Mapping[int, BrokerReplicas] = field(default_factory=dict)

    def moves(self, owned: Iterable[PartitionKey]
              ) -> tuple[list[PartitionKey], list[PartitionKey]]:
        """(to release, to claim): partitions owned but no longer planned, in the order
        given, and partitions planned but not owned, in plan order."""
        owned = list(owned)
        have = set(owned)
        return ([k for k in owned if k not in self.target],
                [k for k in self.target if k not in have])

    def address(self, key: PartitionKey) -> BrokerAddress | None:
        """Where a planned partition is fetched from."""
        return self.brokers.get(self.target[key])


def make_plan(topics: Iterable[str], topo: Topology, held: Mapping[str, StaticMember],
              strategy: AssignFunction, *, me: str, broadcast: bool = False,
              replicas: Mapping[int, BrokerReplicas] | None = None) -> Plan:
    """This member's share (``me``) of each topic's partitions among the topic's
    members and the held static members subscribed to it.  ``replicas``: each broker
    id's master and slaves as read (none: partitions are read from the address in
    ``topo.brokers``)."""
    target: dict[PartitionKey, int] = {}
    for topic in topics:
        members = topo.members.get(topic, [])
        members = members + [c for c, rec in held.items() if topic in rec.topics]
        parts = topo.partitions.get(topic, [])
        if broadcast:
            share = parts  # every member consumes every partition, owning none
        else:
            share = strategy(members, parts, me=me, previous=topo.owners.get(topic) or None)
        for p in share:
            target[PartitionKey(topic, p)] = partition_broker_id(p)
    brokers = {b: None if a is None else BrokerAddress(*a) for b, a in topo.brokers.items()}
    return Plan(target, brokers, dict(replicas or {}))
