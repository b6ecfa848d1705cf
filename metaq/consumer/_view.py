"""The group as one member sees it: ZooKeeper reads cached, and kept true by watches.

A rebalance needs the group's members and their topics, each topic's
partitions, the brokers' addresses, the static member records and, for the
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

Owners (``sticky`` only) are read afresh each time, as a plan that depends on
them must be redone whenever they change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kazoo.client import KazooClient
from kazoo.protocol.states import EventType, WatchedEvent

from zk_layout import (
    Layout,
    NodeKind,
    StaticMember,
    Topology,
    broker_address,
    member_ids,
    member_topics,
    partition_broker_id,
    read_owners,
    read_partitions,
    sort_consumer_ids,
    static_member_ids,
    static_records,
)

__all__ = ["GroupView"]


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
        self._members: dict[str, tuple[str, ...]] = {}
        self._statics: dict[str, tuple[StaticMember, int]] = {}
        self._parts: dict[str, list[str]] = {}
        self._brokers: dict[int, tuple[str, int] | None] = {}
        #: what a watch said changed (under _lock); "all" parts start stale
        self._ids_stale = True
        self._static_list_stale = True
        self._stale_members: set[str] = set()
        self._stale_statics: set[str] = set()
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

    def _on_ids(self, event: WatchedEvent | None = None) -> None:
        if self._lost_watches(event):
            return
        with self._lock:
            self._ids_stale = True
        self._changed()

    def _on_member(self, event: WatchedEvent) -> None:
        if self._lost_watches(event):
            return
        ref = self._layout.classify(event.path)
        with self._lock:
            if ref is not None and ref.consumer_id is not None:
                self._stale_members.add(ref.consumer_id)
            else:
                self._ids_stale = True
        self._changed()

    def _on_static_list(self, event: WatchedEvent | None = None) -> None:
        if self._lost_watches(event):
            return
        with self._lock:
            self._static_list_stale = True
        self._changed()

    def _on_static(self, event: WatchedEvent) -> None:
        if self._lost_watches(event):
            return
        ref = self._layout.classify(event.path)
        with self._lock:
            if ref is not None and ref.consumer_id is not None:
                self._stale_statics.add(ref.consumer_id)
            else:
                self._static_list_stale = True
        self._changed()

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
            self._ids_stale = self._static_list_stale = True
            self._stale_members.update(self._members)
            self._stale_statics.update(self._statics)
            self._stale_topics.update(self._parts)
            self._stale_brokers.update(self._brokers)

    def forget_static(self, consumer_id: str) -> None:
        """Re-read this static record next time (we just wrote or deleted it)."""
        with self._lock:
            self._stale_statics.add(consumer_id)
            self._static_list_stale = True

    def read(self, topics: Iterable[str]) -> Topology:
        """The group as it is now for these topics, reading only what changed since
        the last read (and topics never read before)."""
        topics = list(topics)
        with self._lock:
            ids_stale, self._ids_stale = self._ids_stale, False
            static_list_stale, self._static_list_stale = self._static_list_stale, False
            stale_members, self._stale_members = self._stale_members, set()
            stale_statics, self._stale_statics = self._stale_statics, set()
            stale_topics, self._stale_topics = self._stale_topics, set()
            stale_topics |= {t for t in topics if t not in self._parts}
            stale_brokers, self._stale_brokers = self._stale_brokers, set()
        try:
            return self._read(topics, ids_stale, static_list_stale, stale_members,
                              stale_statics, stale_topics, stale_brokers)
        except BaseException:
            with self._lock:  # read it all again next time: we do not know how far we got
                self._ids_stale = self._ids_stale or ids_stale
                self._static_list_stale = self._static_list_stale or static_list_stale
                self._stale_members |= stale_members | set(self._members)
                self._stale_statics |= stale_statics | set(self._statics)
                self._stale_topics |= stale_topics
                self._stale_brokers |= stale_brokers
            raise

    def _read(self, topics: list[str], ids_stale: bool, static_list_stale: bool,
              stale_members: set[str], stale_statics: set[str], stale_topics: set[str],
              stale_brokers: set[int]) -> Topology:
        client, layout, group = self._client, self._layout, self._group
        requests = 0
        if ids_stale:
            live = set(member_ids(client, layout, group, self._on_ids))
            requests += 1
            for cid in list(self._members):
                if cid not in live:
                    del self._members[cid]
            stale_members = (stale_members & live) | (live - set(self._members))
        else:
            stale_members &= set(self._members)
        if stale_members:
            fresh = member_topics(client, layout, group, sorted(stale_members), self._on_member)
            requests += len(stale_members)
            for cid in stale_members:
                if cid in fresh:
                    self._members[cid] = fresh[cid]
                else:
                    self._members.pop(cid, None)  # gone (or damaged: logged, skipped)
        if static_list_stale:
            listed = set(static_member_ids(client, layout, group, self._on_static_list))
            requests += 1
            for cid in list(self._statics):
                if cid not in listed:
                    del self._statics[cid]
            stale_statics = (stale_statics & listed) | (listed - set(self._statics))
        else:
            stale_statics &= set(self._statics)
        if stale_statics:
            fresh_statics = static_records(client, layout, group, sorted(stale_statics),
                                           self._on_static)
            requests += len(stale_statics)
            for cid in stale_statics:
                if cid in fresh_statics:
                    self._statics[cid] = fresh_statics[cid]
                else:
                    self._statics.pop(cid, None)
        for topic in sorted(stale_topics):
            self._parts[topic] = read_partitions(client, layout, topic, self._on_partitions)
            requests += 1 + len(self._parts[topic])
        wanted = {partition_broker_id(p) for t in topics for p in self._parts.get(t, [])}
        for bid in stale_brokers - wanted:
            self._brokers.pop(bid, None)  # read again when wanted again, never kept stale
        for bid in sorted(wanted):
            # an address read while the broker was down is read again every time: its node
            # may come back before any of its topics (a restart), arming no watch of ours
            if bid in stale_brokers or bid not in self._brokers or self._brokers[bid] is None:
                self._brokers[bid] = broker_address(client, layout, bid, self._on_broker)
                requests += 1
        topo = Topology(member_topics=dict(self._members), static=dict(self._statics),
                        brokers={b: self._brokers[b] for b in sorted(wanted)})
        for topic in topics:
            topo.members[topic] = sort_consumer_ids(
                c for c, subscribed in self._members.items() if topic in subscribed)
            topo.partitions[topic] = list(self._parts.get(topic, []))
            if self._with_owners:
                topo.owners[topic] = read_owners(client, layout, group, topic, self._on_owners)
                requests += 1 + len(topo.owners[topic])
        self.last_requests = requests
        return topo
