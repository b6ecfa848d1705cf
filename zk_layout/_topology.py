"""What a subscriber reads from a live tree: members, partitions, broker addresses, owners.

Read what a rebalance needs from ZooKeeper, arming the watches that trigger the
next (the consumer's coordinator), and what a reader needs to find a partition's
broker (the Spark source, the admin tools).

Everything is decoded by this package's codecs: group members and their topics
(``consumers/<group>/ids``), each topic's partitions (``topics-sub/<topic>``),
the brokers' addresses (``brokers/ids/<id>/master`` or a slave) and, for the
sticky strategy, the current owners.  Damaged nodes are logged and skipped,
as Metaq does, so one bad node never stops a group.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zk_layout._codecs import (
    decode_broker_uri,
    decode_owner,
    decode_topic_list,
    node_text,
)
from zk_layout._errors import NodeDataError
from zk_layout._names import check_broker_id, parse_broker_child, sort_consumer_ids
from zk_layout._nodes import partitions_for_topic
from zk_layout._paths import Layout
from zk_layout._static import StaticMember, decode_static_member

__all__ = ["Topology", "read_topology", "read_members", "member_ids", "member_topics",
           "read_partitions", "read_owners", "read_static_members", "static_member_ids",
           "static_records", "broker_address", "partition_broker_id",
           "read_master_partitions", "BrokerReplicas", "broker_replicas", "READ_FROM"]

log = logging.getLogger(__name__)

Watch = Callable[..., object]


@dataclass
class Topology:
    members: dict[str, list[str]] = field(default_factory=dict)  # topic -> sorted ids
    partitions: dict[str, list[str]] = field(default_factory=dict)  # topic -> sorted names
    brokers: dict[int, tuple[str, int] | None] = field(default_factory=dict)
    owners: dict[str, dict[str, str]] = field(default_factory=dict)  # topic -> part -> owner
    #: consumer id -> subscribed topics of every live member
    member_topics: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: consumer id -> (static member record, node version); only when asked for
    static: dict[str, tuple[StaticMember, int]] = field(default_factory=dict)


def partition_broker_id(partition: str) -> int:
    """The broker id of a partition name (``"3-0"`` -> 3)."""
    return parse_broker_child(partition.split("-", 1)[0] + "-m").broker_id


def _children(client: KazooClient, path: str, watch: Watch | None) -> list[str]:
    try:
        return client.get_children(path, watch=watch)
    except NoNodeError:
        if watch is not None and client.exists(path, watch=watch) is not None:
            return client.get_children(path, watch=watch)  # created meanwhile
        return []


def _data(client: KazooClient, path: str, watch: Watch | None = None) -> bytes | None:
    """A node's data, or None when absent; with ``watch``, armed either way (on the
    node's change or deletion, or on its creation)."""
    try:
        return client.get(path, watch=watch)[0]
    except NoNodeError:
        if watch is not None and client.exists(path, watch=watch) is not None:
            return _data(client, path, watch)  # created meanwhile
        return None


def _data_many(client: KazooClient, paths: list[str],
               watch: Watch | None = None) -> list[bytes | None]:
    """Read many nodes pipelined on the one connection (not one round trip each)."""
    pending = [client.get_async(p, watch=watch) for p in paths]
    out: list[bytes | None] = []
    for r in pending:
        try:
            out.append(r.get()[0])
        except NoNodeError:
            out.append(None)  # gone while we read
    return out


def _skip(e: NodeDataError) -> None:
    log.warning("skipping damaged node: %s", e)


def member_ids(client: KazooClient, layout: Layout, group: str,
               watch: Watch | None = None) -> list[str]:
    """The ids of the group's live members (the children of ``consumers/<group>/ids``)."""
    return _children(client, layout.consumer_ids(group), watch)


def member_topics(client: KazooClient, layout: Layout, group: str, cids: Iterable[str],
                  watch: Watch | None = None) -> dict[str, tuple[str, ...]]:
    """consumer id -> subscribed topics for these ids, read pipelined; with ``watch``,
    armed on each node (its change or deletion).  Ids gone meanwhile and damaged
    nodes (logged) are left out."""
    cids = list(cids)
    paths = [layout.consumer_id(group, c) for c in cids]
    out: dict[str, tuple[str, ...]] = {}
    for cid, path, data in zip(cids, paths, _data_many(client, paths, watch), strict=True):
        if data is None:
            continue  # left while we read
        try:
            out[cid] = decode_topic_list(data, path)
        except NodeDataError as e:
            _skip(e)
    return out


def read_members(client: KazooClient, layout: Layout, group: str,
                 watch: Watch | None = None) -> dict[str, tuple[str, ...]]:
    """consumer id -> subscribed topics, for every live member of ``group``."""
    return member_topics(client, layout, group, member_ids(client, layout, group, watch))


def read_partitions(client: KazooClient, layout: Layout, topic: str,
                    watch: Watch | None = None) -> list[str]:
    """A topic's partition names in Metaq's order, from ``topics-sub``.  With
    ``watch``, armed on the broker list and on each broker's partition count."""
    sub_dir = layout.topic_sub_dir(topic)
    names = _children(client, sub_dir, watch)
    datas = _data_many(client, [f"{sub_dir}/{n}" for n in names], watch)
    children = {n: d for n, d in zip(names, datas, strict=True) if d is not None}
    return [str(p) for p in partitions_for_topic(children, dir_path=sub_dir, on_damaged=_skip)]


def read_master_partitions(client: KazooClient, layout: Layout, topics: Iterable[str],
                           broker_id: int, watch: Watch | None = None) -> dict[str, list[str]]:
    """topic -> partition names of one master, as a slave broker reads what to copy.

    Java's ``MetaZookeeper.getPartitionStringsForSubTopicsFromMaster`` (over
    ``getPartitionsForSubTopicsFromMaster``), which the slave's
    ``SlaveConsumerZooKeeper`` uses instead of every broker's partitions: for each
    topic, only ``topics-sub/<topic>/<broker_id>-m``; its ``numParts`` = n gives
    ``<id>-0 .. <id>-(n-1)`` in Metaq's string order.  A topic whose node is absent or
    blank, or has ``numParts`` 0, is left out.  Damaged data raises
    :class:`NodeDataError`, as Java throws (``IllegalStateException``) rather than
    skip.  With ``watch``, armed on each ``<id>-m`` node (its change, deletion or
    creation).  For example, with ``{"numParts":3,"broker":"0-m"}`` at
    ``/meta/brokers/topics-sub/t1/0-m``, ``{"numParts":12,"broker":"0-s1"}`` at
    ``.../t1/0-s1`` and nothing for ``t2``::

        read_master_partitions(client, Layout(), ["t1", "t2"], 0)
        -> {"t1": ["0-0", "0-1", "0-2"]}
    """
    check_broker_id(broker_id)
    out: dict[str, list[str]] = {}
    for topic in dict.fromkeys(topics):  # Java's Collection: each topic once
        node = layout.topic_sub(topic, broker_id)
        data = _data(client, node, watch)
        if data is None or not node_text(data, node, allow_empty=True).strip():
            continue  # Java: StringUtils.isBlank -> skipped
        parts = partitions_for_topic({f"{broker_id}-m": data},
                                     dir_path=layout.topic_sub_dir(topic))
        if parts:
            out[topic] = [str(p) for p in parts]
    return out


def broker_address(client: KazooClient, layout: Layout, broker_id: int,
                   watch: Watch | None = None) -> tuple[str, int] | None:
    """The address to fetch from: the master, else the lowest-numbered slave.  With
    ``watch``, armed on the master node and the broker's children (its slaves)."""
    master = layout.broker_master(broker_id)
    data = _data(client, master, watch)
    if data is not None:
        try:
            return decode_broker_uri(data, master).address
        except NodeDataError as e:
            _skip(e)
    slaves = []
    for name in _children(client, layout.broker_id(broker_id), watch):
        if name.startswith("slave") and name[5:].isdigit():
            slaves.append(int(name[5:]))
    for n in sorted(slaves):
        path = layout.broker_slave(broker_id, n)
        data = _data(client, path, watch)
        if data is not None:
            try:
                return decode_broker_uri(data, path).address
            except NodeDataError as e:
                _skip(e)
    return None


#: Where a reader reads a broker id's partitions from (:meth:`BrokerReplicas.choose`).
READ_FROM = ("master", "slave-preferred")


class BrokerReplicas(NamedTuple):
    """One broker id's registered brokers: its master's address (None when down) and
    its slaves' as ``(slave number, address)`` pairs in slave-number order.  Every one
    holds the same log at the same offsets, so any of them serves a reader."""

    master: tuple[str, int] | None = None
    slaves: tuple[tuple[int, tuple[str, int]], ...] = ()

    def choose(self, read_from: str = "master", salt: str = "") -> tuple[str, int] | None:
        """The broker to read from, None when none is registered.

        ``master`` (Java's ``Cluster.getBrokerRandom(brokerId)``): the master when it
        is registered, else a slave.  ``slave-preferred``: a slave when one is
        registered, else the master.  Among several slaves the pick is deterministic,
        not random as Java's: slave ``crc32(salt) % count`` in slave-number order, so a
        reader keeps its slave across re-reads and readers with different salts (the
        consumer's id) spread over the slaves; the empty salt picks the lowest-numbered
        slave (as :func:`broker_address`)::

            r = BrokerReplicas(("m", 1), ((1, ("s1", 2)), (2, ("s2", 3))))
            r.choose()                                  -> ("m", 1)
            r.choose("slave-preferred")                 -> ("s1", 2)
            r._replace(master=None).choose()            -> ("s1", 2)
            BrokerReplicas(("m", 1)).choose("slave-preferred") -> ("m", 1)
            BrokerReplicas().choose()                   -> None
        """
        if read_from not in READ_FROM:
            raise ValueError(f"read_from must be one of {READ_FROM}, got {read_from!r}")
        slave = None
        if self.slaves:
            index = zlib.crc32(salt.encode()) % len(self.slaves) if salt else 0
            slave = self.slaves[index][1]
        if read_from == "master":
            return self.master if self.master is not None else slave
        return slave if slave is not None else self.master


def broker_replicas(client: KazooClient, layout: Layout, broker_id: int,
                    watch: Watch | None = None) -> BrokerReplicas:
    """Broker ``broker_id``'s master and slaves as registered now (damaged nodes are
    logged and left out).  With ``watch``, armed on the master node (its change,
    deletion or creation), on the broker's children (a slave or the master coming or
    going) and on each slave node."""
    master_path = layout.broker_master(broker_id)
    master = None
    data = _data(client, master_path, watch)
    if data is not None:
        try:
            master = decode_broker_uri(data, master_path).address
        except NodeDataError as e:
            _skip(e)
    # Java (MetaZookeeper.getSlaveBrokersById): every child "slave<N>" whose N parses as
    # an int >= 0; other children (master, the config checksum) are not slaves
    names = sorted((int(n[5:]), n) for n in _children(client, layout.broker_id(broker_id), watch)
                   if n.startswith("slave") and n[5:].isascii() and n[5:].isdigit()
                   and int(n[5:]) <= 2**31 - 1)
    numbers = [n for n, _ in names]
    paths = [f"{layout.broker_id(broker_id)}/{name}" for _, name in names]
    slaves = []
    for n, path, sdata in zip(numbers, paths, _data_many(client, paths, watch), strict=True):
        if sdata is None:
            continue  # gone while we read (the children watch says so)
        try:
            slaves.append((n, decode_broker_uri(sdata, path).address))
        except NodeDataError as e:
            _skip(e)
    return BrokerReplicas(master, tuple(slaves))


def read_owners(client: KazooClient, layout: Layout, group: str, topic: str,
                watch: Watch | None = None) -> dict[str, str]:
    """partition -> owner id.  With ``watch``, any claim or release re-triggers it."""
    owners_dir = layout.owners_dir(group, topic)
    out = {}
    parts = _children(client, owners_dir, watch)
    for part, data in zip(parts, _data_many(client, [f"{owners_dir}/{p}" for p in parts]),
                          strict=True):
        path = f"{owners_dir}/{part}"
        if data is None:
            continue
        try:
            out[part] = decode_owner(data, path)
        except NodeDataError as e:
            _skip(e)
    return out


def static_member_ids(client: KazooClient, layout: Layout, group: str,
                      watch: Watch | None = None) -> list[str]:
    """The consumer ids that have a static member record in the group."""
    return _children(client, layout.static_members(group), watch)


def static_records(client: KazooClient, layout: Layout, group: str, cids: Iterable[str],
                   watch: Watch | None = None) -> dict[str, tuple[StaticMember, int]]:
    """consumer id -> (record, node version) for these ids, read pipelined; with
    ``watch``, armed on each record.  Gone and damaged (logged) ones are left out."""
    cids = list(cids)
    paths = [layout.static_member(group, c) for c in cids]
    pending = [client.get_async(p, watch=watch) for p in paths]
    out: dict[str, tuple[StaticMember, int]] = {}
    for cid, path, r in zip(cids, paths, pending, strict=True):
        try:
            data, stat = r.get()
        except NoNodeError:
            continue  # deleted while we read
        try:
            out[cid] = (decode_static_member(data, path), stat.version)
        except NodeDataError as e:
            _skip(e)
    return out


def read_static_members(client: KazooClient, layout: Layout, group: str,
                        watch: Watch | None = None) -> dict[str, StaticMember]:
    """consumer id -> :class:`StaticMember` record of the group's static members."""
    cids = static_member_ids(client, layout, group, watch)
    return {c: rec for c, (rec, _) in static_records(client, layout, group, cids,
                                                      watch).items()}


def read_topology(client: KazooClient, layout: Layout, group: str, topics: Iterable[str],
                  *, watch: Watch | None = None, with_owners: bool = False) -> Topology:
    topo = Topology()
    members = read_members(client, layout, group, watch)
    topo.member_topics = members
    broker_ids: set[int] = set()
    for topic in topics:
        topo.members[topic] = sort_consumer_ids(
            cid for cid, subscribed in members.items() if topic in subscribed)
        parts = read_partitions(client, layout, topic, watch)
        topo.partitions[topic] = parts
        broker_ids.update(partition_broker_id(p) for p in parts)
        if with_owners:
            # A plan that depends on the owners must be redone whenever they change,
            # or members that planned at different moments can disagree for good.
            topo.owners[topic] = read_owners(client, layout, group, topic, watch)
    for bid in sorted(broker_ids):
        topo.brokers[bid] = broker_address(client, layout, bid)
    return topo
