"""zk_layout: the one owner of Metaq's ZooKeeper paths and node formats.

* :class:`Layout` builds every path (root configurable, default ``/meta``) and
  :meth:`Layout.classify` parses one back into a :class:`NodeRef`.
* :class:`Partition`, :func:`parse_partition`, :func:`parse_broker_child`,
  :func:`sort_partitions` / :func:`metaq_sort_key` (Metaq's string order) and
  :func:`partitions_for_topic`.
* ``encode_*`` / ``decode_*`` codecs for each node's data, byte-for-byte
  Metaq's; garbage raises :class:`NodeDataError`, bad names
  :class:`InvalidNameError` (both ``ValueError``).
* :func:`take_snapshot` reads a live tree (kazoo) into a read-only
  :class:`Snapshot`; ``python -m zk_layout`` is its inspector CLI.
* :func:`read_topology`, :func:`read_partitions`, :func:`broker_address`, ...: what a
  subscriber reads from a live tree (with watches), for consumers, Spark and tools;
  :func:`broker_replicas` a broker id's master and slaves, and
  :meth:`BrokerReplicas.choose` the one rule picking which of them a reader reads.
  :func:`read_master_partitions` is a slave broker's read of one master's partitions.
* Rebalance history (``consumers/<group>/history/<consumerId>``, ``_history``): the
  :class:`RebalanceRecord` codec, :func:`read_history` (a group's, merged and sorted),
  :func:`ownership_timeline` (who held each partition when, and why it moved),
  :func:`prune_history` (the group's bound).

Does not import ``metaq``.
"""

from zk_layout._codecs import (
    MSG_ID_EPOCH_MS,
    BrokerUri,
    StoredOffset,
    TopicBroker,
    build_consumer_id,
    decode_broker_uri,
    decode_num_parts,
    decode_offset,
    decode_owner,
    decode_topic_broker,
    decode_topic_list,
    encode_broker_uri,
    encode_num_parts,
    encode_offset,
    encode_owner,
    encode_topic_broker,
    encode_topic_list,
    local_ip,
)
from zk_layout._errors import InvalidNameError, NodeDataError
from zk_layout._history import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_TOTAL_BYTES,
    DEFAULT_NODE_BYTES,
    DEFAULT_RECORDS,
    HISTORY_VERSION,
    TRIGGERS,
    RebalanceRecord,
    decode_history,
    encode_history,
    prune_history,
    read_history,
)
from zk_layout._names import (
    RANDOM_PARTITION,
    BrokerChild,
    Partition,
    check_consumer_id,
    check_group,
    check_topic,
    metaq_sort_key,
    parse_broker_child,
    parse_broker_id,
    parse_broker_role,
    parse_partition,
    sort_consumer_ids,
    sort_partitions,
)
from zk_layout._nodes import decode_node, partitions_for_topic
from zk_layout._paths import DEFAULT_ROOT, Layout, NodeKind, NodeRef
from zk_layout._replication import (
    REPLICATION_MODES,
    EpochStart,
    ReplicationState,
    decode_epoch_start,
    decode_replication_state,
    encode_epoch_start,
    encode_replication_state,
    read_epoch_starts,
    read_replication,
)
from zk_layout._snapshot import (
    BrokerInfo,
    Damage,
    GroupInfo,
    GroupTopic,
    MemberInfo,
    PartitionState,
    Snapshot,
    TopicBrokerEntry,
    TopicInfo,
    TreeNode,
    read_tree,
    take_snapshot,
)
from zk_layout._static import (
    MAX_STATIC_GRACE_MS,
    StaticMember,
    StaticMemberInfo,
    decode_static_member,
    encode_static_member,
    iso_ms,
)
from zk_layout._timeline import (
    OwnershipInterval,
    history_to_json,
    holder_at,
    ownership_timeline,
    parse_since,
    render_history,
    select_history,
    timeline_to_json,
)
from zk_layout._topology import (
    READ_FROM,
    BrokerReplicas,
    Topology,
    broker_address,
    broker_replicas,
    member_ids,
    member_topics,
    partition_broker_id,
    read_master_partitions,
    read_members,
    read_owners,
    read_partitions,
    read_static_members,
    read_topology,
    static_member_ids,
    static_records,
)

__all__ = [
    # rebalance history
    "HISTORY_VERSION",
    "TRIGGERS",
    "DEFAULT_RECORDS",
    "DEFAULT_NODE_BYTES",
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_TOTAL_BYTES",
    "RebalanceRecord",
    "OwnershipInterval",
    "encode_history",
    "decode_history",
    "read_history",
    "prune_history",
    "ownership_timeline",
    "timeline_to_json",
    "holder_at",
    "parse_since",
    "render_history",
    "select_history",
    "history_to_json",
    "REPLICATION_MODES",
    "EpochStart",
    "ReplicationState",
    "decode_epoch_start",
    "decode_replication_state",
    "encode_epoch_start",
    "encode_replication_state",
    "read_epoch_starts",
    "read_replication",
    "Topology",
    "read_topology",
    "read_members",
    "read_partitions",
    "read_master_partitions",
    "read_owners",
    "read_static_members",
    "member_ids",
    "member_topics",
    "static_member_ids",
    "static_records",
    "partition_broker_id",
    "broker_address",
    "broker_replicas",
    "BrokerReplicas",
    "READ_FROM",
    # errors
    "NodeDataError",
    "InvalidNameError",
    # paths
    "DEFAULT_ROOT",
    "Layout",
    "NodeKind",
    "NodeRef",
    # names and partitions
    "BrokerChild",
    "Partition",
    "RANDOM_PARTITION",
    "check_consumer_id",
    "check_group",
    "check_topic",
    "metaq_sort_key",
    "parse_broker_child",
    "parse_broker_id",
    "parse_broker_role",
    "parse_partition",
    "partitions_for_topic",
    "sort_consumer_ids",
    "sort_partitions",
    # codecs
    "BrokerUri",
    "MSG_ID_EPOCH_MS",
    "MAX_STATIC_GRACE_MS",
    "StaticMember",
    "StoredOffset",
    "TopicBroker",
    "build_consumer_id",
    "local_ip",
    "decode_broker_uri",
    "decode_node",
    "decode_num_parts",
    "decode_offset",
    "decode_owner",
    "decode_static_member",
    "decode_topic_broker",
    "decode_topic_list",
    "encode_broker_uri",
    "encode_num_parts",
    "encode_offset",
    "encode_owner",
    "encode_static_member",
    "encode_topic_broker",
    "encode_topic_list",
    # snapshot of a live tree
    "BrokerInfo",
    "Damage",
    "GroupInfo",
    "GroupTopic",
    "MemberInfo",
    "PartitionState",
    "Snapshot",
    "StaticMemberInfo",
    "iso_ms",
    "TopicBrokerEntry",
    "TopicInfo",
    "TreeNode",
    "read_tree",
    "take_snapshot",
]
