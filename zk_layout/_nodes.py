"""Decoding a node by what it is, and a topic's partition list as Metaq builds it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from zk_layout._codecs import (
    BrokerUri,
    StoredOffset,
    TopicBroker,
    decode_broker_uri,
    decode_num_parts,
    decode_offset,
    decode_owner,
    decode_topic_broker,
    decode_topic_list,
    node_text,
)
from zk_layout._errors import InvalidNameError, NodeDataError
from zk_layout._history import RebalanceRecord, decode_history
from zk_layout._names import BrokerChild, Partition, parse_broker_child, sort_partitions
from zk_layout._paths import NodeKind, NodeRef
from zk_layout._replication import decode_epoch_start, decode_replication_state
from zk_layout._static import StaticMember, decode_static_member

__all__ = ["DEFAULT_MAX_PARTS_PER_BROKER", "decode_node", "partitions_for_topic"]

log = logging.getLogger(__name__)

#: A topic node claiming more partitions than this on one broker is treated as
#: garbage by :func:`partitions_for_topic` instead of building a list that
#: would exhaust memory (Metaq itself has no limit).
DEFAULT_MAX_PARTS_PER_BROKER = 100_000

NodeValue = (BrokerUri | TopicBroker | StoredOffset | StaticMember | tuple[str, ...] | str | int
             | tuple[RebalanceRecord, ...] | None)


def _check_topic_broker(value: TopicBroker, child: BrokerChild, path: str, data: object) -> None:
    if (value.broker_id, value.slave_no) != (child.broker_id, child.slave_no):
        raise NodeDataError(
            path, data, f"broker field {value.broker!r} does not match the node's name"
        )


def decode_node(ref: NodeRef, data: bytes | str | None) -> NodeValue:
    """Decode ``data`` read at ``ref.path`` with the codec for ``ref.kind``.

    Returns ``None`` for directory nodes (their data is not Metaq's) and for a
    ``brokers/ids/<id>`` node left empty (a slave created it, or the master
    left while slaves remained).  Slave URIs come back with ``slave_id`` set
    from the node name, as Metaq clients read them.  Raises
    :class:`NodeDataError` for garbage.
    """
    kind, path = ref.kind, ref.path
    if kind is NodeKind.BROKER_ID:
        if data is None or data == b"" or data == "":
            return None
        return _broker_uri(path, data, None)
    if kind is NodeKind.BROKER_MASTER:
        return _broker_uri(path, data, None)
    if kind is NodeKind.BROKER_SLAVE:
        return _broker_uri(path, data, ref.slave_no)
    if kind is NodeKind.BROKER_CONFIG_CHECKSUM:
        return node_text(data, path, allow_empty=True)
    if kind is NodeKind.TOPIC_LEGACY:
        return decode_num_parts(data, path)
    if kind in (NodeKind.TOPIC_PUB, NodeKind.TOPIC_SUB):
        value = decode_topic_broker(data, path)
        _check_topic_broker(value, BrokerChild(ref.broker_id, ref.slave_no is None, ref.slave_no),
                            path, data)
        return value
    if kind is NodeKind.CONSUMER_ID:
        return decode_topic_list(data, path)
    if kind is NodeKind.OWNER:
        return decode_owner(data, path)
    if kind is NodeKind.OFFSET:
        return decode_offset(data, path)
    if kind is NodeKind.STATIC_MEMBER:
        return decode_static_member(data, path)
    if kind is NodeKind.HISTORY_MEMBER:
        return tuple(decode_history(data, path))
    if kind is NodeKind.REPLICATION:
        return decode_replication_state(data, path)
    if kind is NodeKind.REPLICATION_EPOCH:
        return decode_epoch_start(data, path)
    return None


def _broker_uri(path: str, data: bytes | str | None, slave_no: int | None) -> BrokerUri:
    uri = decode_broker_uri(data, path)
    if uri.slave_id is not None and uri.slave_id != slave_no:
        raise NodeDataError(path, data, f"unexpected ?slaveId={uri.slave_id} in a broker node")
    return uri.with_slave_id(slave_no)


def partitions_for_topic(
    children: Mapping[str, bytes | str | TopicBroker | None]
    | Iterable[tuple[str, bytes | str | TopicBroker | None]],
    *,
    dir_path: str = "",
    on_damaged: Callable[[NodeDataError], None] | None = None,
    max_parts_per_broker: int = DEFAULT_MAX_PARTS_PER_BROKER,
) -> list[Partition]:
    """A topic's partition list exactly as a Metaq consumer builds it.

    ``children`` maps each child name of ``topics-sub/<topic>`` (``"0-m"``,
    ``"0-s1"``) to its data (raw bytes, or an already decoded
    :class:`TopicBroker`).  Every child ``<id>-x`` with ``numParts = n``
    contributes ``<id>-0 .. <id>-(n-1)``; the result is de-duplicated and
    sorted as strings (``0-10`` before ``0-2``).

    Child names that are not ``<id>-m`` / ``<id>-s<N>`` are skipped, as Metaq
    skips them.  Garbage data raises :class:`NodeDataError` (naming
    ``dir_path/<child>``), unless ``on_damaged`` is given: then it is called
    with the error and that child is skipped, as Metaq logs and skips it.
    """
    items = children.items() if isinstance(children, Mapping) else children
    parts: list[Partition] = []
    for name, data in items:
        try:
            child = parse_broker_child(name)
        except InvalidNameError:
            log.warning("skipping %r under %s: not a '<id>-m' or '<id>-s<N>' node",
                        name, dir_path or "topics-sub")
            continue
        path = f"{dir_path}/{name}" if dir_path else name
        try:
            if isinstance(data, TopicBroker):
                value = data
            else:
                value = decode_topic_broker(data, path)
            _check_topic_broker(value, child, path, data)
            if value.num_parts > max_parts_per_broker:
                raise NodeDataError(path, data, f"numParts {value.num_parts} is over the limit "
                                                f"of {max_parts_per_broker} per broker")
        except NodeDataError as e:
            if on_damaged is None:
                raise
            on_damaged(e)
            continue
        parts.extend(Partition(child.broker_id, i) for i in range(value.num_parts))
    return sort_partitions(parts)
