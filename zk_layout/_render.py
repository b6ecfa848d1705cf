"""Rendering a :class:`Snapshot` / :func:`read_tree` result as aligned text or JSON."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from zk_layout._codecs import BrokerUri, StoredOffset
from zk_layout._names import Partition
from zk_layout._paths import NodeRef
from zk_layout._snapshot import Damage, GroupInfo, Snapshot, TreeNode
from zk_layout._static import iso_ms

#: The note on a partition nobody owns while the group has an away static member
#: subscribed to its topic (the inspector cannot tell which partitions it holds).
HELD_NOTE = "unowned (may be held for an away static member)"

__all__ = [
    "format_table",
    "render_brokers",
    "render_group",
    "render_groups",
    "render_topics",
    "render_tree",
    "show_data",
    "to_json",
    "to_jsonable",
]


def show_data(data: bytes | str | None) -> str:
    """Node data for humans: quoted text (escapes for control characters), or
    ``<no data>``; bytes that are not UTF-8 are shown with ``\\x`` escapes."""
    if data is None:
        return "<no data>"
    if isinstance(data, bytes):
        data = data.decode("utf-8", "backslashreplace")
    return json.dumps(data, ensure_ascii=False)


def _data_text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", "backslashreplace")


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values for snapshots, tree nodes and their parts."""
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, BrokerUri | Partition):
        return str(obj)
    if isinstance(obj, StoredOffset):
        return {"msg_id": obj.msg_id, "offset": obj.offset}
    if isinstance(obj, bytes):
        return _data_text(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, NodeRef):
        return obj.kind.value
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        return [to_jsonable(v) for v in obj]
    return str(obj)


def to_json(obj: Any) -> str:
    return json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False, sort_keys=False)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """Left-aligned columns separated by two spaces; ``None`` cells print as ``-``."""
    cells = [[str(h) for h in headers]]
    cells += [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    return "\n".join(lines)


def _damage_section(damaged: Iterable[Damage]) -> str:
    damaged = list(damaged)
    if not damaged:
        return ""
    lines = [f"\n\n{len(damaged)} damaged node(s):"]
    lines += [f"  {d.path}: {d.error} (data: {show_data(d.data)})" for d in damaged]
    return "\n".join(lines)


def _missing_root(snap: Snapshot) -> str:
    return f"(no Metaq tree: {snap.root} does not exist)"


def render_tree(nodes: Sequence[TreeNode], root: str) -> str:
    """An indented tree: one node per line with its data, ``(ephemeral)``,
    ``[not a Metaq node]`` and ``!! DAMAGED: ...`` markers."""
    if not nodes:
        return f"(no Metaq tree: {root} does not exist)"
    lines = []
    for node in nodes:
        name = node.path if node.depth == 0 else node.path.rsplit("/", 1)[1]
        text = "  " * node.depth + name
        if node.data:
            text += " = " + show_data(node.data)
        if node.ephemeral:
            text += "  (ephemeral)"
        if node.ref is None and node.depth > 0:
            text += "  [not a Metaq node]"
        if node.error:
            text += f"  !! DAMAGED: {node.error}"
        lines.append(text)
    damaged = sum(1 for n in nodes if n.error)
    lines.append(f"\n{len(nodes)} node(s), {damaged} damaged")
    return "\n".join(lines)


def render_brokers(snap: Snapshot) -> str:
    if not snap.exists:
        return _missing_root(snap)
    rows = []
    for b in snap.brokers:
        rep = b.replication
        master_rep = None if rep is None else (
            f"epoch {rep.epoch}, replica {rep.master}, {rep.mode}, in sync: "
            + (",".join(map(str, rep.in_sync)) or "none"))
        rows.append((b.broker_id, "master", b.master if b.master else "(down)",
                     b.legacy_uri, master_rep, b.config_checksum))
        for slave_no, uri in b.slaves:
            rows.append((b.broker_id, f"slave{slave_no}", uri, None,
                         None if rep is None else
                         ("in sync" if slave_no in rep.in_sync else "NOT IN SYNC"), None))
        for d in b.damaged:
            rows.append((b.broker_id, "DAMAGED", d.path, None, None, d.error))
    table = format_table(("BROKER", "ROLE", "URI", "LEGACY URI", "REPLICATION",
                          "CHECKSUM / ERROR"), rows)
    damaged = [d for b in snap.brokers for d in b.damaged]
    return table + _damage_section(damaged)


def _role(slave_no: int | None) -> str:
    return "master" if slave_no is None else f"slave{slave_no}"


def render_topics(snap: Snapshot) -> str:
    if not snap.exists:
        return _missing_root(snap)
    rows = []
    for t in snap.topics:
        for e in t.brokers:
            rows.append((t.topic, e.broker_id, _role(e.slave_no), e.pub_parts, e.sub_parts,
                         e.legacy_parts))
    out = [format_table(("TOPIC", "BROKER", "ROLE", "PUB", "SUB", "LEGACY"), rows)]
    prow = [(t.topic, len(t.partitions), " ".join(str(p) for p in t.partitions))
            for t in snap.topics]
    out.append(format_table(("TOPIC", "PARTS", "PARTITIONS (consumer order)"), prow))
    return "\n\n".join(out) + _damage_section(d for t in snap.topics for d in t.damaged)


def _member_rows(g: GroupInfo) -> list[tuple[object, ...]]:
    """(consumer id, topics, instance, host, error, state) for the live members, then
    for the static members that are away."""
    statics = {s.consumer_id: s for s in g.static_members}
    rows: list[tuple[object, ...]] = [
        (m.consumer_id, ",".join(m.topics) or None, m.instance_id,
         (statics[m.consumer_id].host or None) if m.consumer_id in statics else None,
         m.error, m.state_text) for m in g.members]
    rows += [(s.consumer_id, ",".join(s.topics) or None, s.instance_id, s.host or None, None,
              s.state_text(g.read_at_ms)) for s in g.away_members]
    return rows


def _members_line(g: GroupInfo) -> str:
    away = f", {len(g.away_members)} away static member(s)" if g.away_members else ""
    return f"group {g.group}: {len(g.members)} member(s){away}"


def render_groups(snap: Snapshot) -> str:
    if not snap.exists:
        return _missing_root(snap)
    rows = []
    for g in snap.groups:
        parts = [p for t in g.topics for p in t.partitions]
        rows.append((g.group, len(g.members), ",".join(t.topic for t in g.topics) or None,
                     len(parts), sum(1 for p in parts if p.owner),
                     sum(1 for p in parts if p.offset), len(g.damaged)))
    table = format_table(
        ("GROUP", "MEMBERS", "TOPICS", "PARTITIONS", "OWNED", "COMMITTED", "DAMAGED"), rows)
    mrows = [(g.group, *row) for g in snap.groups for row in _member_rows(g)]
    members = format_table(
        ("GROUP", "CONSUMER ID", "TOPICS", "INSTANCE", "HOST", "ERROR", "STATE"), mrows)
    return table + "\n\n" + members + _damage_section(d for g in snap.groups for d in g.damaged)


def _msg_id(offset: StoredOffset | None) -> object:
    if offset is None:
        return None
    return "(legacy)" if offset.msg_id is None else offset.msg_id


def _consumed_at(offset: StoredOffset | None) -> object:
    """The msgId time of the last committed message (ZooKeeper alone: how far the group
    has read in time; ``metaq group describe`` asks the brokers for lag in seconds)."""
    t = None if offset is None else offset.msg_time_ms
    return None if t is None else iso_ms(t)


def render_group(group: GroupInfo, lags: Mapping[tuple[str, Partition], Any] | None = None
                 ) -> str:
    """The group's members and partitions; with ``lags`` (``group --brokers``, each a
    ``_probe.PartitionLag``) also LOG END, LAG and LAG S columns."""
    out = [_members_line(group),
           format_table(("CONSUMER ID", "TOPICS", "INSTANCE", "HOST", "ERROR", "STATE"),
                        _member_rows(group))]
    held = group.held_topics
    prows = []
    for t in group.topics:
        for p in t.partitions:
            notes = [HELD_NOTE] if p.owner is None and t.topic in held else []
            notes += ["DAMAGED: " + "; ".join(p.errors)] if p.errors else []
            row: tuple = (t.topic, p.partition, p.owner,
                          None if p.offset is None else p.offset.offset,
                          _msg_id(p.offset), _consumed_at(p.offset))
            if lags is not None:
                lag = lags.get((t.topic, p.partition))
                if lag is not None and lag.error:
                    notes.append("BROKER: " + lag.error)
                row += (None, None, None) if lag is None else (
                    lag.log_end, lag.lag_bytes,
                    None if lag.lag_seconds is None else f"{lag.lag_seconds:.1f}")
            prows.append((*row, "; ".join(notes) or None))
    heads = ("TOPIC", "PARTITION", "OWNER", "OFFSET", "MSGID", "CONSUMED UP TO")
    if lags is not None:
        heads += ("LOG END", "LAG", "LAG S")
    out.append(format_table((*heads, "NOTE"), prows))
    return "\n\n".join(out) + _damage_section(group.damaged)
