"""A read-only snapshot of a live Metaq tree in ZooKeeper (via kazoo).

:func:`take_snapshot` reads brokers, topics and consumer groups into frozen
dataclasses.  It only reads.  A node holding garbage is reported in
``damaged`` (with the error text) and the snapshot carries on; a node that
vanishes between listing and reading (``NoNodeError``) is simply left out; a
missing root gives an empty snapshot with ``exists=False``; nodes Metaq does
not define (extra nodes a Java cluster or an operator wrote) are listed in
``unknown`` and otherwise ignored.  Connection errors propagate.

A group's static member records (``consumers/<group>/static/<consumerId>``,
metaq-py's extension) are read into :class:`StaticMemberInfo` with their state
at the moment the group was read (``GroupInfo.read_at_ms``).

:func:`read_tree` lists every node under the root with its data, decoded where
the node is one of Metaq's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import NoNodeError

from zk_layout._codecs import BrokerUri, StoredOffset, TopicBroker
from zk_layout._errors import InvalidNameError, NodeDataError
from zk_layout._names import (
    Partition,
    check_group,
    check_topic,
    sort_consumer_ids,
    sort_partitions,
)
from zk_layout._nodes import NodeValue, decode_node, partitions_for_topic
from zk_layout._paths import Layout, NodeKind, NodeRef
from zk_layout._replication import ReplicationState
from zk_layout._static import StaticMember, StaticMemberInfo

__all__ = [
    "BrokerInfo",
    "Damage",
    "GroupInfo",
    "GroupTopic",
    "MemberInfo",
    "PartitionState",
    "Snapshot",
    "TopicBrokerEntry",
    "TopicInfo",
    "TreeNode",
    "read_tree",
    "take_snapshot",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Damage:
    """A node whose data is not what Metaq writes there: its raw ``data`` and
    ``error``, what is wrong with it (:attr:`NodeDataError.reason`)."""

    path: str
    data: bytes | None
    error: str


@dataclass(frozen=True, kw_only=True)
class BrokerInfo:
    """``brokers/ids/<id>``: the master (``None`` when down), slaves by number,
    the legacy URI in the id node itself, and the Java master's config checksum."""

    broker_id: int
    master: BrokerUri | None = None
    slaves: tuple[tuple[int, BrokerUri], ...] = ()
    legacy_uri: BrokerUri | None = None
    config_checksum: str | None = None
    damaged: tuple[Damage, ...] = ()
    #: metaq-py's replication state of this broker id (epoch, leading replica,
    #: in-sync slaves, mode); None for a broker id never run by a metaq-py broker
    replication: ReplicationState | None = None


@dataclass(frozen=True, kw_only=True)
class TopicBrokerEntry:
    """One broker (master, or slave ``slave_no``) serving a topic: numParts as
    registered under ``topics-pub``, ``topics-sub`` and legacy ``topics`` (None: absent)."""

    broker_id: int
    slave_no: int | None
    pub_parts: int | None = None
    sub_parts: int | None = None
    legacy_parts: int | None = None


@dataclass(frozen=True, kw_only=True)
class TopicInfo:
    """A topic: its brokers and its partition list as consumers build it (from topics-sub)."""

    topic: str
    brokers: tuple[TopicBrokerEntry, ...] = ()
    partitions: tuple[Partition, ...] = ()
    damaged: tuple[Damage, ...] = ()


@dataclass(frozen=True, kw_only=True)
class MemberInfo:
    """A registered consumer (``consumers/<group>/ids/<consumerId>``) and its topics;
    ``static`` with its ``instance_id`` when it also has a static member record."""

    consumer_id: str
    topics: tuple[str, ...] = ()
    error: str | None = None
    static: bool = False
    instance_id: str | None = None

    @property
    def state_text(self) -> str:
        """``live``, or ``live, static (instance pod-1)``."""
        return f"live, static (instance {self.instance_id})" if self.static else "live"


@dataclass(frozen=True, kw_only=True)
class PartitionState:
    """A partition as a group sees it: owner's consumer id and committed offset
    (``None`` when there is no node); ``errors`` lists garbage found for it."""

    partition: Partition
    owner: str | None = None
    offset: StoredOffset | None = None
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GroupTopic:
    topic: str
    partitions: tuple[PartitionState, ...] = ()


@dataclass(frozen=True, kw_only=True)
class GroupInfo:
    """A consumer group: members (sorted as Metaq sorts them), its static member
    records (``read_at_ms``: the wall clock their state is as of) and per topic the
    state of every partition that the topic has or the group has nodes for."""

    group: str
    members: tuple[MemberInfo, ...] = ()
    topics: tuple[GroupTopic, ...] = ()
    damaged: tuple[Damage, ...] = ()
    static_members: tuple[StaticMemberInfo, ...] = ()
    read_at_ms: int = 0

    @property
    def away_members(self) -> tuple[StaticMemberInfo, ...]:
        """The static members whose id node is gone (held, starting, or expired)."""
        return tuple(s for s in self.static_members if s.state != "live")

    @property
    def held_topics(self) -> frozenset[str]:
        """Topics whose unowned partitions may be held for an away static member."""
        return frozenset(t for s in self.static_members if s.state in ("away", "hold_starting")
                         for t in s.topics)


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Everything read from the tree under ``root``."""

    root: str
    exists: bool
    brokers: tuple[BrokerInfo, ...] = ()
    topics: tuple[TopicInfo, ...] = ()
    groups: tuple[GroupInfo, ...] = ()
    damaged: tuple[Damage, ...] = ()
    unknown: tuple[str, ...] = ()

    def broker(self, broker_id: int) -> BrokerInfo | None:
        return next((b for b in self.brokers if b.broker_id == broker_id), None)

    def topic(self, topic: str) -> TopicInfo | None:
        return next((t for t in self.topics if t.topic == topic), None)

    def group(self, group: str) -> GroupInfo | None:
        return next((g for g in self.groups if g.group == group), None)


@dataclass(frozen=True, kw_only=True)
class TreeNode:
    """One node of :func:`read_tree`: raw data, whether ephemeral, what Metaq node it
    is (``ref`` None: not one of Metaq's), and the decoded ``value`` or ``error``."""

    path: str
    depth: int
    data: bytes | None
    ephemeral: bool
    ref: NodeRef | None = None
    value: Any = None
    error: str | None = None


_MISSING = object()


@dataclass
class _Reader:
    client: Any
    layout: Layout
    damaged: list[Damage] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    now_ms: int | None = None

    def children(self, path: str) -> list[str]:
        """Children of ``path`` sorted; [] when the node is gone."""
        try:
            return sorted(self.client.get_children(path))
        except NoNodeError:
            return []

    def read(self, ref: NodeRef) -> tuple[Any, Damage | None]:
        """Decode the node ``ref``: (value, None), (None, damage), or (_MISSING, None)
        when it vanished."""
        path = ref.path
        try:
            data, _stat = self.client.get(path)
        except NoNodeError:
            return _MISSING, None
        try:
            return decode_node(ref, data), None
        except NodeDataError as e:
            damage = Damage(path=path, data=data, error=e.reason)
            self.damaged.append(damage)
            log.debug("damaged node %s: %s", path, e)
            return None, damage

    # -- brokers ---------------------------------------------------------------------------
    def brokers(self) -> list[BrokerInfo]:
        out = []
        ids_path = self.layout.broker_ids()
        for name in self.children(ids_path):
            ref = self.layout.classify(f"{ids_path}/{name}")
            if ref is None or ref.kind is not NodeKind.BROKER_ID:
                self.unknown.append(f"{ids_path}/{name}")
                continue
            info = self.broker(ref)
            if info is not None:
                out.append(info)
        return out

    def broker(self, id_ref: NodeRef) -> BrokerInfo | None:
        path, broker_id = id_ref.path, id_ref.broker_id
        legacy, bad = self.read(id_ref)
        if legacy is _MISSING:
            return None
        damaged = [bad] if bad else []
        master = checksum = None
        slaves = []
        for name in self.children(path):
            ref = self.layout.classify(f"{path}/{name}")
            if ref is None:
                self.unknown.append(f"{path}/{name}")
                continue
            value, bad = self.read(ref)
            damaged += [bad] if bad else []
            if value is _MISSING or value is None:
                continue
            if ref.kind is NodeKind.BROKER_MASTER:
                master = value
            elif ref.kind is NodeKind.BROKER_SLAVE:
                slaves.append((ref.slave_no, value))
            else:
                checksum = value
        value, bad = self.read(self.layout.classify(self.layout.replication(broker_id)))
        damaged += [bad] if bad else []
        replication = value if isinstance(value, ReplicationState) else None
        return BrokerInfo(broker_id=broker_id, master=master, slaves=tuple(sorted(slaves)),
                          legacy_uri=legacy, config_checksum=checksum, damaged=tuple(damaged),
                          replication=replication)

    # -- topics ----------------------------------------------------------------------------
    def topics(self) -> list[TopicInfo]:
        dirs = {"legacy": self.layout.topics_legacy(), "pub": self.layout.topics_pub(),
                "sub": self.layout.topics_sub()}
        names: set[str] = set()
        for base in dirs.values():
            for name in self.children(base):
                try:
                    names.add(check_topic(name))
                except InvalidNameError:
                    self.unknown.append(f"{base}/{name}")
        return [self.topic(name, dirs) for name in sorted(names)]

    def topic(self, topic: str, dirs: dict[str, str]) -> TopicInfo:
        entries: dict[tuple[int, int], dict[str, int]] = {}
        damaged: list[Damage] = []
        sub_values: dict[str, TopicBroker] = {}
        for which, base in dirs.items():
            topic_dir = f"{base}/{topic}"
            for name in self.children(topic_dir):
                ref = self.layout.classify(f"{topic_dir}/{name}")
                if ref is None:
                    self.unknown.append(f"{topic_dir}/{name}")
                    continue
                value, bad = self.read(ref)
                damaged += [bad] if bad else []
                if value is _MISSING or value is None:
                    continue
                key = (ref.broker_id, -1 if ref.slave_no is None else ref.slave_no)
                if isinstance(value, TopicBroker):
                    entries.setdefault(key, {})[which] = value.num_parts
                    if which == "sub":
                        sub_values[name] = value
                else:
                    entries.setdefault(key, {})[which] = value
        brokers = tuple(
            TopicBrokerEntry(broker_id=b, slave_no=None if s < 0 else s,
                             pub_parts=v.get("pub"), sub_parts=v.get("sub"),
                             legacy_parts=v.get("legacy"))
            for (b, s), v in sorted(entries.items())
        )
        partitions = partitions_for_topic(sub_values, dir_path=f"{dirs['sub']}/{topic}",
                                          on_damaged=lambda e: damaged.append(
                                              self._damage_from(e)))
        return TopicInfo(topic=topic, brokers=brokers, partitions=tuple(partitions),
                         damaged=tuple(damaged))

    def _damage_from(self, e: NodeDataError) -> Damage:
        data = e.data if isinstance(e.data, bytes) else None
        damage = Damage(path=e.path, data=data, error=e.reason)
        self.damaged.append(damage)
        return damage

    # -- consumer groups -------------------------------------------------------------------
    def groups(self, topics: dict[str, TopicInfo]) -> list[GroupInfo]:
        base = self.layout.consumer_groups()
        out = []
        for name in self.children(base):
            try:
                check_group(name)
            except InvalidNameError:
                self.unknown.append(f"{base}/{name}")
                continue
            out.append(self.group(name, topics))
        return out

    def group(self, group: str, topics: dict[str, TopicInfo]) -> GroupInfo:
        lay = self.layout
        damaged: list[Damage] = []
        for name in self.children(lay.group(group)):
            if name not in ("ids", "owners", "offsets", "static", "history"):
                self.unknown.append(f"{lay.group(group)}/{name}")
        members = []
        ids_dir = lay.consumer_ids(group)
        for name in self.children(ids_dir):
            ref = lay.classify(f"{ids_dir}/{name}")
            if ref is None:
                self.unknown.append(f"{ids_dir}/{name}")
                continue
            value, bad = self.read(ref)
            if value is _MISSING:
                continue
            damaged += [bad] if bad else []
            members.append(MemberInfo(consumer_id=name, topics=value or (),
                                      error=bad.error if bad else None))
        records = self.static_records(group, damaged)
        now_ms = self.now_ms if self.now_ms is not None else int(time.time() * 1000)
        live = {m.consumer_id for m in members}
        statics = tuple(StaticMemberInfo.of(records[c], live=c in live, now_ms=now_ms)
                        for c in sort_consumer_ids(records))
        members = [MemberInfo(consumer_id=m.consumer_id, topics=m.topics, error=m.error,
                              static=True, instance_id=records[m.consumer_id].instance_id)
                   if m.consumer_id in records else m for m in members]
        order = {c: i for i, c in enumerate(sort_consumer_ids(m.consumer_id for m in members))}
        members.sort(key=lambda m: order[m.consumer_id])

        states: dict[str, dict[Partition, dict[str, Any]]] = {}
        for m in members:
            for t in m.topics:
                states.setdefault(t, {})
        for kind, base in ((NodeKind.OWNER, lay.owners(group)),
                           (NodeKind.OFFSET, lay.offsets(group))):
            for topic in self.children(base):
                try:
                    check_topic(topic)
                except InvalidNameError:
                    self.unknown.append(f"{base}/{topic}")
                    continue
                per_topic = states.setdefault(topic, {})
                for name in self.children(f"{base}/{topic}"):
                    ref = lay.classify(f"{base}/{topic}/{name}")
                    if ref is None:
                        self.unknown.append(f"{base}/{topic}/{name}")
                        continue
                    value, bad = self.read(ref)
                    if value is _MISSING:
                        continue
                    state = per_topic.setdefault(ref.partition, {"errors": []})
                    if bad:
                        damaged.append(bad)
                        state["errors"].append(bad.error)
                    else:
                        state["owner" if kind is NodeKind.OWNER else "offset"] = value
        group_topics = []
        for topic in sorted(states):
            per_topic = states[topic]
            known = topics.get(topic)
            parts = sort_partitions(list(per_topic) + list(known.partitions if known else ()))
            group_topics.append(GroupTopic(topic=topic, partitions=tuple(
                PartitionState(partition=p, owner=per_topic.get(p, {}).get("owner"),
                               offset=per_topic.get(p, {}).get("offset"),
                               errors=tuple(per_topic.get(p, {}).get("errors", ())))
                for p in parts)))
        return GroupInfo(group=group, members=tuple(members), topics=tuple(group_topics),
                         damaged=tuple(damaged), static_members=statics, read_at_ms=now_ms)

    def static_records(self, group: str, damaged: list[Damage]) -> dict[str, StaticMember]:
        """consumer id -> decodable static member record; garbage, or a record naming
        another consumer id than its node's, is damage."""
        out = {}
        base = self.layout.static_members(group)
        for name in self.children(base):
            ref = self.layout.classify(f"{base}/{name}")
            if ref is None or ref.kind is not NodeKind.STATIC_MEMBER:
                self.unknown.append(f"{base}/{name}")
                continue
            try:
                data, _stat = self.client.get(ref.path)
            except NoNodeError:
                continue
            try:
                value = decode_node(ref, data)
                if value.consumer_id != name:
                    raise NodeDataError(ref.path, data, f"the record's consumerId "
                                        f"{value.consumer_id!r} is not its node's name")
            except NodeDataError as e:
                damaged.append(self._damage_from(e))
                continue
            out[name] = value
        return out

    def top_level_unknowns(self) -> None:
        """Children of the root and of ``brokers`` that Metaq does not define."""
        lay = self.layout
        for name in self.children(lay.root):
            if name not in ("brokers", "consumers"):
                self.unknown.append(_join(lay.root, name))
        for name in self.children(lay.brokers()):
            if name not in ("ids", "topics", "topics-pub", "topics-sub"):
                self.unknown.append(f"{lay.brokers()}/{name}")


def _join(parent: str, name: str) -> str:
    return f"/{name}" if parent == "/" else f"{parent}/{name}"


def take_snapshot(client: Any, layout: Layout | None = None, *,
                  now_ms: int | None = None) -> Snapshot:
    """Read the Metaq tree under ``layout.root`` through a started kazoo client.
    Static members' states are as of ``now_ms`` (epoch ms; default: the wall clock
    when each group is read)."""
    layout = layout or Layout()
    if client.exists(layout.root) is None:
        return Snapshot(root=layout.root, exists=False)
    r = _Reader(client, layout, now_ms=now_ms)
    r.top_level_unknowns()
    brokers = r.brokers()
    topics = r.topics()
    groups = r.groups({t.topic: t for t in topics})
    return Snapshot(root=layout.root, exists=True, brokers=tuple(brokers), topics=tuple(topics),
                    groups=tuple(groups), damaged=tuple(r.damaged), unknown=tuple(r.unknown))


def read_tree(client: Any, layout: Layout | None = None) -> tuple[TreeNode, ...]:
    """Every node under ``layout.root`` (depth first, children sorted) with its data;
    Metaq's nodes decoded (``value``) or flagged (``error``).  Empty if no root."""
    layout = layout or Layout()
    out: list[TreeNode] = []
    stack = [(layout.root, 0)]
    while stack:
        path, depth = stack.pop()
        try:
            data, stat = client.get(path)
            children = sorted(client.get_children(path))
        except NoNodeError:
            continue
        ref = layout.classify(path)
        value: NodeValue = None
        error = None
        if ref is not None:
            try:
                value = decode_node(ref, data)
            except NodeDataError as e:
                error = e.reason
        out.append(TreeNode(path=path, depth=depth, data=data,
                            ephemeral=bool(stat.ephemeralOwner), ref=ref, value=value,
                            error=error))
        stack.extend((_join(path, c), depth + 1) for c in reversed(children))
    return tuple(out)
