"""The group as one member sees it: ZooKeeper reads cached, and kept true by watches.

A rebalance needs the group's members and their topics, each topic's
partitions, each broker id's master and slaves (``brokers/ids/<id>/master`` and
``slave<N>``, a :class:`GroupTopology`), the static member records and, for the
``sticky`` strategy, the current owners.  Read afresh every time, that is a
request per member for every member on every rebalance: O(N²) requests for
the group each time it changes, most of the cost of a rebalance at 64 members.
:class:`GroupView` reads each node once, arms a watch on it, and re-reads only
what a watch said changed: after one member joins a settled group, a
rebalance reads the id list and the newcomer's node, nothing else.

The watches only mark parts stale and call ``on_change`` (the coordinator's
``request_rebalance``): they never block, as they run in kazoo's event thread.
A stale mark is taken off *before* the read it asks for, so a change that lands
during the read marks the part stale again and is read next time.  ZooKeeper
keeps a session's watches over a reconnect in the same session; after a
session loss they are all gone, and the owner calls :meth:`GroupView.reset`.
The two listings by consumer id (the live members' id nodes, the static member
records) are cached alike, each with one watch callback for its list of
children and one for a child's node.

Owners (``sticky`` only) are read afresh each time, as a plan that depends on
them must be redone whenever they change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kazoo.client import KazooClient
from kazoo.protocol.states import EventType, WatchedEvent

from metaq._types import BrokerAddress
from zk_layout import (
    BrokerReplicas,
    Layout,
    NodeKind,
    StaticMember,
    Topology,
    broker_replicas,
    member_ids,
    member_topics,
    partition_broker_id,
    read_owners,
    read_partitions,
    sort_consumer_ids,
    static_member_ids,
    static_records,
)

__all__ = ["GroupView", "GroupTopology"]

T = TypeVar("T")
Watch = Callable[[WatchedEvent], object]


@dataclass
class GroupTopology(Topology):
    """A :class:`~zk_layout.Topology` with each wanted broker id's master and slaves
    (``brokers`` keeps one address per id: the master, else its lowest slave)."""

    replicas: dict[int, BrokerReplicas] = field(default_factory=dict)


class _Listing(Generic[T]):
    """A watched listing of the group's children by consumer id (the live members'
    id nodes, or the static member records) and each child's node: what is cached,
    what a watch said changed, and the two watch callbacks of its shape (the list's
    and a node's).  The callbacks are bound methods, equal at every read: kazoo keeps
    a set of watchers per path, so a read arms one watch, not one more each time."""

    def __init__(self, lock: threading.Lock, layout: Layout, *,
                 lost_watches: Callable[[WatchedEvent | None], bool],
                 changed: Callable[[], None],
                 list_ids: Callable[[Watch], list[str]],
                 read_nodes: Callable[[list[str], Watch], dict[str, T]]) -> None:
        self._lock = lock
        self._layout = layout
        self._lost_watches = lost_watches
        self._changed = changed
        self._list_ids = list_ids
        self._read_nodes = read_nodes
        self.cache: dict[str, T] = {}
        #: what a watch said changed (under the lock); the list starts stale
        self.list_stale = True
        self.stale: set[str] = set()

    # -- watch callbacks (kazoo's event thread: never block) ----------------------------

    def on_list(self, event: WatchedEvent | None = None) -> None:
        """The children changed: list them again."""
        if self._lost_watches(event):
            return
        with self._lock:
            self.list_stale = True
        self._changed()

    def on_node(self, event: WatchedEvent) -> None:
        """One child's node changed (or went): read it again."""
        if self._lost_watches(event):
            return
        ref = self._layout.classify(event.path)
        with self._lock:
            if ref is not None and ref.consumer_id is not None:
                self.stale.add(ref.consumer_id)
            else:
                self.list_stale = True
        self._changed()

    # -- under the lock -----------------------------------------------------------------

    def take(self) -> tuple[bool, set[str]]:
        """What is stale, marked fresh (before the read it asks for)."""
        taken = self.list_stale, self.stale
        self.list_stale, self.stale = False, set()
        return taken

    def give_back(self, taken: tuple[bool, set[str]]) -> None:
        """A read failed: read it all again next time (how far it got is unknown)."""
        self.list_stale = self.list_stale or taken[0]
        self.stale |= taken[1] | set(self.cache)

    def reset(self) -> None:
        self.list_stale = True
        self.stale.update(self.cache)

    # -- the coordinator thread ---------------------------------------------------------

    def refresh(self, taken: tuple[bool, set[str]]) -> int:
        """Read what was taken as stale; returns the requests sent."""
        list_stale, stale = taken
        requests = 0
        if list_stale:
            listed = set(self._list_ids(self.on_list))
            requests += 1
            for cid in list(self.cache):
                if cid not in listed:
                    del self.cache[cid]
            stale = (stale & listed) | (listed - set(self.cache))
        else:
            stale &= set(self.cache)
        if stale:
            fresh = self._read_nodes(sorted(stale), self.on_node)
            requests += len(stale)
            for cid in stale:
                if cid in fresh:
                    self.cache[cid] = fresh[cid]
                else:
                    self.cache.pop(cid, None)  # gone (or damaged: logged, skipped)
        return requests


class GroupView:
    """A watched cache of what a rebalance reads; :meth:`read` returns a :class:`Topology`."""

    def __init__(self, client: KazooClient, layout: Layout, group: str,
                 *, on_change: Callable[[], None], with_owners: bool = False) -> None:
        self._client = client
        self._layout = layout
        self._group = group
        self._on_change = on_change
        self._with_owners = with_owners
        self._lock = threading.Lock()
        listing = dict(lock=self._lock, layout=layout, lost_watches=self._lost_watches,
                       changed=self._changed)
        self._members: _Listing[tuple[str, ...]] = _Listing(
            **listing, list_ids=lambda w: member_ids(client, layout, group, w),
            read_nodes=lambda ids, w: member_topics(client, layout, group, ids, w))
        self._statics: _Listing[tuple[StaticMember, int]] = _Listing(
            **listing, list_ids=lambda w: static_member_ids(client, layout, group, w),
            read_nodes=lambda ids, w: static_records(client, layout, group, ids, w))
        self._parts: dict[str, list[str]] = {}
        #: broker id -> its master and slaves as last read
        self._brokers: dict[int, BrokerReplicas] = {}
        #: what a watch said changed (under _lock)
        self._stale_topics: set[str] = set()
        self._stale_brokers: set[int] = set()
        #: requests sent by the last read (for tests and the benchmark)
        self.last_requests = 0

    # -- watch callbacks (kazoo's event thread: never block) ----------------------------

    def _changed(self) -> None:
        self._on_change()

    def _lost_watches(self, event: WatchedEvent | None) -> bool:
        """kazoo drops every watch when the connection drops, calling each with a
        ``NONE`` event and no path: then nothing cached can be trusted."""
        if event is None or event.path is None or event.type == EventType.NONE:
            self.reset()
            self._changed()
            return True
        return False

    def _on_partitions(self, event: WatchedEvent) -> None:
        if self._lost_watches(event):
            return
        ref = self._layout.classify(event.path)
        with self._lock:
            if ref is not None and ref.topic is not None:
                self._stale_topics.add(ref.topic)
            else:
                self._stale_topics.update(self._parts)
        self._changed()

    def _on_broker(self, event: WatchedEvent) -> None:
        if self._lost_watches(event):
            return
        ref = self._layout.classify(event.path)
        with self._lock:
            if ref is not None and ref.broker_id is not None \
                    and ref.kind in (NodeKind.BROKER_ID, NodeKind.BROKER_MASTER,
                                     NodeKind.BROKER_SLAVE):
                self._stale_brokers.add(ref.broker_id)
            else:
                self._stale_brokers.update(self._brokers)
        self._changed()

    def _on_owners(self, _event: WatchedEvent | None = None) -> None:
        self._changed()

    # -- the coordinator thread ---------------------------------------------------------

    def reset(self) -> None:
        """Forget everything (the session ended and its watches with it)."""
        with self._lock:
            self._members.reset()
            self._statics.reset()
            self._stale_topics.update(self._parts)
            self._stale_brokers.update(self._brokers)

    def forget_static(self, consumer_id: str) -> None:
        """Re-read this static record next time (we just wrote or deleted it)."""
        with self._lock:
            self._statics.stale.add(consumer_id)
            self._statics.list_stale = True

    def read(self, topics: Iterable[str]) -> GroupTopology:
        """The group as it is now for these topics, reading only what changed since
        the last read (and topics never read before)."""
        topics = list(topics)
        with self._lock:
            members = self._members.take()
            statics = self._statics.take()
            stale_topics, self._stale_topics = self._stale_topics, set()
            stale_topics |= {t for t in topics if t not in self._parts}
            stale_brokers, self._stale_brokers = self._stale_brokers, set()
        try:
            return self._read(topics, members, statics, stale_topics, stale_brokers)
        except BaseException:
            with self._lock:  # read it all again next time: we do not know how far we got
                self._members.give_back(members)
                self._statics.give_back(statics)
                self._stale_topics |= stale_topics
                self._stale_brokers |= stale_brokers
            raise

    def _read(self, topics: list[str], members: tuple[bool, set[str]],
              statics: tuple[bool, set[str]], stale_topics: set[str],
              stale_brokers: set[int]) -> GroupTopology:
        client, layout, group = self._client, self._layout, self._group
        requests = self._members.refresh(members) + self._statics.refresh(statics)
        for topic in sorted(stale_topics):
            self._parts[topic] = read_partitions(client, layout, topic, self._on_partitions)
            requests += 1 + len(self._parts[topic])
        wanted = {partition_broker_id(p) for t in topics for p in self._parts.get(t, [])}
        for bid in stale_brokers - wanted:
            self._brokers.pop(bid, None)  # read again when wanted again, never kept stale
        for bid in sorted(wanted):
            # a broker id read while none of its brokers was up is read again every time:
            # its nodes may come back before any of its topics (a restart), arming no
            # watch of ours
            cached = self._brokers.get(bid)
            if bid in stale_brokers or cached is None or cached == BrokerReplicas():
                replicas = broker_replicas(client, layout, bid, self._on_broker)
                self._brokers[bid] = BrokerReplicas(
                    None if replicas.master is None else BrokerAddress(*replicas.master),
                    tuple((n, BrokerAddress(*a)) for n, a in replicas.slaves))
                requests += 2 + len(replicas.slaves)
        member_topics_ = dict(self._members.cache)
        brokers = {b: self._brokers[b] for b in sorted(wanted)}
        topo = GroupTopology(member_topics=member_topics_, static=dict(self._statics.cache),
                             brokers={b: r.choose() for b, r in brokers.items()},
                             replicas=brokers)
        for topic in topics:
            topo.members[topic] = sort_consumer_ids(
                c for c, subscribed in member_topics_.items() if topic in subscribed)
            topo.partitions[topic] = list(self._parts.get(topic, []))
            if self._with_owners:
                topo.owners[topic] = read_owners(client, layout, group, topic, self._on_owners)
                requests += 1 + len(topo.owners[topic])
        self.last_requests = requests
        return topo
