"""Every ZooKeeper path Metaq uses, built and parsed in one place.

::

    <root>/brokers/ids/<id>                              master URI (persistent, legacy)
    <root>/brokers/ids/<id>/master                       master URI (ephemeral)
    <root>/brokers/ids/<id>/slave<N>                     slave URI (ephemeral)
    <root>/brokers/ids/<id>/master_config_checksum       written by Java brokers
    <root>/brokers/topics/<topic>/<id>-m|-s<N>|<id>      numParts text (deprecated)
    <root>/brokers/topics-pub/<topic>/<id>-m|-s<N>       {"numParts":N,"broker":"<id>-m"}
    <root>/brokers/topics-sub/<topic>/<id>-m|-s<N>       same JSON
    <root>/brokers/replication/<id>                      epoch, master, in-sync slaves
                                                         (metaq-py only, persistent)
    <root>/brokers/replication/<id>/epoch-<E>            log ends when epoch E began
    <root>/consumers/<group>/ids/<consumerId>            topics, comma-joined
    <root>/consumers/<group>/owners/<topic>/<b>-<p>      owner's consumer id
    <root>/consumers/<group>/offsets/<topic>/<b>-<p>     <msgId>-<offset>
    <root>/consumers/<group>/static/<consumerId>         static member record (metaq-py
                                                         only, persistent; Java ignores it)
    <root>/consumers/<group>/history/<consumerId>        a member's last rebalances (metaq-py
                                                         only, persistent; Java ignores it)

:class:`Layout` builds them for a configurable root (default ``/meta``);
:meth:`Layout.classify` turns a path back into a :class:`NodeRef` saying which
node it is.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from zk_layout._errors import InvalidNameError
from zk_layout._names import (
    BrokerChild,
    Partition,
    as_partition,
    broker_child_name,
    check_broker_id,
    check_consumer_id,
    check_group,
    check_name,
    check_slave_no,
    check_topic,
    parse_broker_child,
    parse_broker_id,
    parse_broker_role,
    parse_partition,
)

__all__ = ["DEFAULT_ROOT", "Layout", "NodeKind", "NodeRef"]

#: Metaq's default ZooKeeper root (``zkRoot``).
DEFAULT_ROOT = "/meta"

#: The child of ``brokers/ids/<id>`` where Java brokers keep their config checksum.
MASTER_CONFIG_CHECKSUM = "master_config_checksum"


class NodeKind(enum.Enum):
    """What a path in Metaq's tree is."""

    ROOT = "root"
    BROKERS = "brokers"
    BROKER_IDS = "broker_ids"
    BROKER_ID = "broker_id"
    BROKER_MASTER = "broker_master"
    BROKER_SLAVE = "broker_slave"
    BROKER_CONFIG_CHECKSUM = "broker_config_checksum"
    TOPICS_LEGACY = "topics_legacy"
    TOPIC_LEGACY_DIR = "topic_legacy_dir"
    TOPIC_LEGACY = "topic_legacy"
    TOPICS_PUB = "topics_pub"
    TOPIC_PUB_DIR = "topic_pub_dir"
    TOPIC_PUB = "topic_pub"
    TOPICS_SUB = "topics_sub"
    TOPIC_SUB_DIR = "topic_sub_dir"
    TOPIC_SUB = "topic_sub"
    REPLICATION_ROOT = "replication_root"
    REPLICATION = "replication"
    REPLICATION_EPOCH = "replication_epoch"
    CONSUMERS = "consumers"
    GROUP = "group"
    CONSUMER_IDS = "consumer_ids"
    CONSUMER_ID = "consumer_id"
    OWNERS = "owners"
    OWNERS_DIR = "owners_dir"
    OWNER = "owner"
    OFFSETS = "offsets"
    OFFSETS_DIR = "offsets_dir"
    OFFSET = "offset"
    STATIC_MEMBERS = "static_members"
    STATIC_MEMBER = "static_member"
    HISTORY = "history"
    HISTORY_MEMBER = "history_member"


@dataclass(frozen=True, kw_only=True)
class NodeRef:
    """A path of Metaq's tree, understood: its :class:`NodeKind` and the names in it.

    Fields that do not apply to the kind are ``None``.  For topic broker
    nodes ``slave_no`` is ``None`` on the master (``<id>-m``).
    """

    kind: NodeKind
    path: str
    broker_id: int | None = None
    slave_no: int | None = None
    topic: str | None = None
    group: str | None = None
    consumer_id: str | None = None
    partition: Partition | None = None


def _normalize_root(root: object) -> str:
    """``root`` as Java's MetaZookeeper.normalize makes it: ``/`` put in front when it
    is missing (``meta`` is ``/meta``), the trailing one dropped; then checked."""
    if not isinstance(root, str):
        raise InvalidNameError("root", root, f"must be a str, not {type(root).__name__}")
    if not root:  # Java makes it "/" and then paths starting "//": refused here
        raise InvalidNameError("root", root, "must not be empty (the top is '/')")
    if not root.startswith("/"):
        root = "/" + root
    stripped = root.rstrip("/")
    for part in stripped.split("/")[1:]:
        if not part:
            raise InvalidNameError("root", root, "must not contain empty path segments ('//')")
        try:
            check_name("root segment", part)
        except InvalidNameError as e:
            raise InvalidNameError("root", root, f"segment {part!r}: {e.reason}") from None
    return stripped  # "" stands for "/"


@dataclass(frozen=True)
class Layout:
    """Builds every Metaq path under ``root`` (default ``/meta``; ``meta`` and ``/meta/``
    are ``/meta``, as Java reads a zkRoot).

    Names are validated: a topic or group that is empty or holds ``/`` raises
    :class:`InvalidNameError` (a :class:`ValueError`).  Broker ids, slave
    numbers and partition indexes must be ints in ``0..2**31-1``.
    """

    root: str = DEFAULT_ROOT

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", _normalize_root(self.root) or "/")

    def _p(self, *parts: str) -> str:
        base = "" if self.root == "/" else self.root
        return base + "/" + "/".join(parts) if parts else self.root

    # -- brokers ---------------------------------------------------------------------------
    def brokers(self) -> str:
        return self._p("brokers")

    def broker_ids(self) -> str:
        return self._p("brokers", "ids")

    def broker_id(self, broker_id: int) -> str:
        return self._p("brokers", "ids", str(check_broker_id(broker_id)))

    def broker_master(self, broker_id: int) -> str:
        return self.broker_id(broker_id) + "/master"

    def broker_slave(self, broker_id: int, slave_no: int) -> str:
        return self.broker_id(broker_id) + f"/slave{check_slave_no(slave_no)}"

    def replication_root(self) -> str:
        return self._p("brokers", "replication")

    def replication(self, broker_id: int) -> str:
        """The replication state of a broker id (``_replication``)."""
        return self._p("brokers", "replication", str(check_broker_id(broker_id)))

    def replication_epoch(self, broker_id: int, epoch: int) -> str:
        """The log ends of broker id's master when ``epoch`` began."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidNameError("epoch", epoch, "must be an int >= 0")
        return self.replication(broker_id) + f"/epoch-{epoch}"

    def broker_config_checksum(self, broker_id: int) -> str:
        return self.broker_id(broker_id) + "/" + MASTER_CONFIG_CHECKSUM

    # -- topics ----------------------------------------------------------------------------
    def topics_legacy(self) -> str:
        return self._p("brokers", "topics")

    def topic_legacy_dir(self, topic: str) -> str:
        return self._p("brokers", "topics", check_topic(topic))

    def topic_legacy(self, topic: str, broker_id: int, slave: int | None = None) -> str:
        return self.topic_legacy_dir(topic) + "/" + broker_child_name(broker_id, slave)

    def topics_pub(self) -> str:
        return self._p("brokers", "topics-pub")

    def topic_pub_dir(self, topic: str) -> str:
        return self._p("brokers", "topics-pub", check_topic(topic))

    def topic_pub(self, topic: str, broker_id: int, slave: int | None = None) -> str:
        """``topics-pub/<topic>/<id>-m`` (producers read only these), or
        ``<id>-s<slave>`` which a Java slave accepting publishes writes too."""
        return self.topic_pub_dir(topic) + "/" + broker_child_name(broker_id, slave)

    def topics_sub(self) -> str:
        return self._p("brokers", "topics-sub")

    def topic_sub_dir(self, topic: str) -> str:
        return self._p("brokers", "topics-sub", check_topic(topic))

    def topic_sub(self, topic: str, broker_id: int, slave: int | None = None) -> str:
        """``topics-sub/<topic>/<id>-m``, or ``<id>-s<slave>`` for a slave."""
        return self.topic_sub_dir(topic) + "/" + broker_child_name(broker_id, slave)

    # -- consumers -------------------------------------------------------------------------
    def consumer_groups(self) -> str:
        return self._p("consumers")

    def group(self, group: str) -> str:
        return self._p("consumers", check_group(group))

    def consumer_ids(self, group: str) -> str:
        return self.group(group) + "/ids"

    def consumer_id(self, group: str, consumer_id: str) -> str:
        return self.consumer_ids(group) + "/" + check_consumer_id(consumer_id)

    def owners(self, group: str) -> str:
        return self.group(group) + "/owners"

    def owners_dir(self, group: str, topic: str) -> str:
        return self.owners(group) + "/" + check_topic(topic)

    def owner(self, group: str, topic: str, partition: Partition | str) -> str:
        return self.owners_dir(group, topic) + "/" + str(as_partition(partition))

    def offsets(self, group: str) -> str:
        return self.group(group) + "/offsets"

    def offsets_dir(self, group: str, topic: str) -> str:
        return self.offsets(group) + "/" + check_topic(topic)

    def offset(self, group: str, topic: str, partition: Partition | str) -> str:
        return self.offsets_dir(group, topic) + "/" + str(as_partition(partition))

    def static_members(self, group: str) -> str:
        return self.group(group) + "/static"

    def static_member(self, group: str, consumer_id: str) -> str:
        return self.static_members(group) + "/" + check_consumer_id(consumer_id)

    def history(self, group: str) -> str:
        """The group's rebalance history nodes (``_history``)."""
        return self.group(group) + "/history"

    def history_member(self, group: str, consumer_id: str) -> str:
        """One member's rebalance history (kept after it is gone)."""
        return self.history(group) + "/" + check_consumer_id(consumer_id)

    # -- parsing ---------------------------------------------------------------------------
    def relative(self, path: str) -> list[str] | None:
        """The segments of ``path`` below the root, or ``None`` when outside it."""
        if not isinstance(path, str):
            return None
        if path == self.root:
            return []
        prefix = "/" if self.root == "/" else self.root + "/"
        if not path.startswith(prefix):
            return None
        rest = path[len(prefix):]
        segments = rest.split("/")
        if any(not s for s in segments):
            return None
        return segments

    def classify(self, path: str) -> NodeRef | None:
        """Say which Metaq node ``path`` is, or ``None`` for a path Metaq does not
        define (outside the root, an unknown child, or a name that does not parse)."""
        seg = self.relative(path)
        if seg is None:
            return None
        try:
            return _classify(path, seg)
        except InvalidNameError:
            return None


def _topic_broker_ref(kind: NodeKind, path: str, topic: str, child: BrokerChild) -> NodeRef:
    return NodeRef(kind=kind, path=path, topic=check_topic(topic),
                   broker_id=child.broker_id, slave_no=child.slave_no)


_TOPIC_DIRS = {
    "topics": (NodeKind.TOPICS_LEGACY, NodeKind.TOPIC_LEGACY_DIR, NodeKind.TOPIC_LEGACY),
    "topics-pub": (NodeKind.TOPICS_PUB, NodeKind.TOPIC_PUB_DIR, NodeKind.TOPIC_PUB),
    "topics-sub": (NodeKind.TOPICS_SUB, NodeKind.TOPIC_SUB_DIR, NodeKind.TOPIC_SUB),
}


def _classify(path: str, seg: list[str]) -> NodeRef | None:
    n = len(seg)
    if n == 0:
        return NodeRef(kind=NodeKind.ROOT, path=path)
    if seg[0] == "brokers":
        return _classify_brokers(path, seg[1:])
    if seg[0] != "consumers":
        return None
    if n == 1:
        return NodeRef(kind=NodeKind.CONSUMERS, path=path)
    group = check_group(seg[1])
    if n == 2:
        return NodeRef(kind=NodeKind.GROUP, path=path, group=group)
    sub = seg[2]
    if sub == "ids":
        if n == 3:
            return NodeRef(kind=NodeKind.CONSUMER_IDS, path=path, group=group)
        if n == 4:
            return NodeRef(kind=NodeKind.CONSUMER_ID, path=path, group=group,
                           consumer_id=check_consumer_id(seg[3]))
        return None
    if sub in ("static", "history"):
        kinds = ((NodeKind.STATIC_MEMBERS, NodeKind.STATIC_MEMBER) if sub == "static"
                 else (NodeKind.HISTORY, NodeKind.HISTORY_MEMBER))
        if n == 3:
            return NodeRef(kind=kinds[0], path=path, group=group)
        if n == 4:
            return NodeRef(kind=kinds[1], path=path, group=group,
                           consumer_id=check_consumer_id(seg[3]))
        return None
    kinds = {"owners": (NodeKind.OWNERS, NodeKind.OWNERS_DIR, NodeKind.OWNER),
             "offsets": (NodeKind.OFFSETS, NodeKind.OFFSETS_DIR, NodeKind.OFFSET)}.get(sub)
    if kinds is None or n > 5:
        return None
    if n == 3:
        return NodeRef(kind=kinds[0], path=path, group=group)
    topic = check_topic(seg[3])
    if n == 4:
        return NodeRef(kind=kinds[1], path=path, group=group, topic=topic)
    part = parse_partition(seg[4])
    return NodeRef(kind=kinds[2], path=path, group=group, topic=topic,
                   partition=part, broker_id=part.broker_id)


def _classify_brokers(path: str, seg: list[str]) -> NodeRef | None:
    n = len(seg)
    if n == 0:
        return NodeRef(kind=NodeKind.BROKERS, path=path)
    if seg[0] == "ids":
        if n == 1:
            return NodeRef(kind=NodeKind.BROKER_IDS, path=path)
        broker_id = parse_broker_id(seg[1])
        if n == 2:
            return NodeRef(kind=NodeKind.BROKER_ID, path=path, broker_id=broker_id)
        if n > 3:
            return None
        if seg[2] == MASTER_CONFIG_CHECKSUM:
            return NodeRef(kind=NodeKind.BROKER_CONFIG_CHECKSUM, path=path, broker_id=broker_id)
        slave = parse_broker_role(seg[2])
        kind = NodeKind.BROKER_MASTER if slave is None else NodeKind.BROKER_SLAVE
        return NodeRef(kind=kind, path=path, broker_id=broker_id, slave_no=slave)
    if seg[0] == "replication":
        return _classify_replication(path, seg)
    kinds = _TOPIC_DIRS.get(seg[0])
    if kinds is None or n > 3:
        return None
    if n == 1:
        return NodeRef(kind=kinds[0], path=path)
    topic = check_topic(seg[1])
    if n == 2:
        return NodeRef(kind=kinds[1], path=path, topic=topic)
    if kinds[2] is NodeKind.TOPIC_LEGACY and seg[2].isdigit():
        # Brokers before 1.4.3 also wrote brokers/topics/<topic>/<id> for older clients.
        return NodeRef(kind=NodeKind.TOPIC_LEGACY, path=path, topic=topic,
                       broker_id=parse_broker_id(seg[2]))
    return _topic_broker_ref(kinds[2], path, topic, parse_broker_child(seg[2]))


def _classify_replication(path: str, seg: list[str]) -> NodeRef | None:
    n = len(seg)
    if n == 1:
        return NodeRef(kind=NodeKind.REPLICATION_ROOT, path=path)
    broker_id = parse_broker_id(seg[1])
    if n == 2:
        return NodeRef(kind=NodeKind.REPLICATION, path=path, broker_id=broker_id)
    if n == 3 and seg[2].startswith("epoch-") and _EPOCH.fullmatch(seg[2][6:]):
        return NodeRef(kind=NodeKind.REPLICATION_EPOCH, path=path, broker_id=broker_id)
    return None


_EPOCH = re.compile(r"0|[1-9][0-9]*")
