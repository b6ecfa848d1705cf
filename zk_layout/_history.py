"""Rebalance history (metaq-py's extension): each member's record of its rebalances.

Where it lives, and why there
-----------------------------
``consumers/<group>/history/<consumerId>`` is a *persistent* node per member
holding that member's last rebalances (:class:`RebalanceRecord`), rewritten whole
by the member after each one.  Persistent, because the history must outlive the
member: the interesting question is usually about one that is gone (killed,
expired, scaled away).  One node per member, because then each member writes only
its own node (no two writers, no versions to race on, one ``set`` per rebalance;
one read when it starts, to go on with what a previous process with its consumer
id left), and a reader gets the group's history with one listing and one
pipelined read per member.  Beside ``ids``, ``owners`` and ``offsets`` under the
group, as the ``static`` records are: Java Metaq's consumer reads only those three
by name (``ZKGroupDirs`` / ``ZKGroupTopicDirs`` in ZKLoadRebalanceListener) and
never lists the group's children, so a Java member in the same group never sees
it.  Not under ``ids`` (whose children Java lists and parses as members), nor in
a Metaq node's data.

The bound
---------
One node holds at most ``records`` rebalances and ``max_bytes`` bytes (the oldest
records go first, then, for one record too big alone, the end of its partition
lists, marked ``truncated``): :func:`encode_history`.  The group keeps at most
``max_members`` nodes and ``max_total_bytes`` bytes: :func:`prune_history` deletes
the nodes written longest ago (the members gone first, never the caller's own),
run by one member of the group after its rebalances.  The defaults are
:data:`DEFAULT_RECORDS`, :data:`DEFAULT_NODE_BYTES`, :data:`DEFAULT_MAX_MEMBERS` and
:data:`DEFAULT_MAX_TOTAL_BYTES`.

The codec
---------
Compact JSON, readable with ``zkCli get``, versioned::

    {"v":1,"consumerId":"g_a","records":[{"gen":3,"at":1764241323120,"ms":12,
      "trigger":"member_joined","detail":"joined g_b","state":"stable",
      "strategy":"default","plan":{"t":["0-0..1"]},"released":{"t":["0-2"]},
      "claimed":{},"waiting":{}}, ...]}

Partitions are grouped by topic, a broker's consecutive ones as one run
(``"0-0..0-15"`` is written ``"0-0..15"``); in a :class:`RebalanceRecord` each is the
string ``"<topic>/<brokerId>-<index>"`` (a topic never holds ``/``), in numeric order.
A reader never raises on garbage: a node it cannot decode, or one record in it,
comes back as a record with ``trigger == "damaged"`` and ``error`` saying what was wrong
(:func:`read_history`).  A version newer than this reader's is flagged the same way.

Reading
-------
:func:`read_history` merges every member's records, sorted by time; ``_timeline``
turns them into who held each partition when, and prints both for people.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kazoo.exceptions import NoNodeError

from zk_layout._codecs import json_object
from zk_layout._errors import InvalidNameError, NodeDataError
from zk_layout._names import check_consumer_id
from zk_layout._paths import Layout
from zk_layout._static import iso_ms

__all__ = [
    "HISTORY_VERSION",
    "TRIGGERS",
    "DEFAULT_RECORDS",
    "DEFAULT_NODE_BYTES",
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_TOTAL_BYTES",
    "RebalanceRecord",
    "encode_history",
    "decode_history",
    "read_history",
    "prune_history",
    "matches_partition",
]

#: The encoding's version (``"v"``); a reader flags a newer one as damaged.
HISTORY_VERSION = 1

#: A member's last rebalances kept in its node.
DEFAULT_RECORDS = 50
#: Largest node a member writes (ZooKeeper refuses nodes past ~1 MiB).
DEFAULT_NODE_BYTES = 32 * 1024
#: History nodes a group keeps (one per member, live or gone).
DEFAULT_MAX_MEMBERS = 100
#: Bytes of history nodes a group keeps.
DEFAULT_MAX_TOTAL_BYTES = 2 * 1024 * 1024

#: What can start a rebalance record, and what it means.
TRIGGERS: Mapping[str, str] = {
    "started": "the member started (its first rebalance)",
    "member_joined": "a member joined the group",
    "member_left": "a member left the group (closed, killed, or its session expired)",
    "partitions_changed": "a topic's partitions changed (a broker came, went, or "
                          "published more)",
    "broker_changed": "a broker's address changed (restarted elsewhere, master or "
                      "slave came or went)",
    "owners_changed": "owner nodes changed (strategies that read the current owners)",
    "owner_vanished": "a partition this member waited for was released by its old "
                      "owner, and claimed",
    "static_hold_ended": "an away static member's hold ended",
    "session_expired": "this member's ZooKeeper session expired (its partitions were "
                       "dropped; the next record is its rejoin)",
    "connection_back": "the ZooKeeper connection came back (the group re-read)",
    "failed": "this member failed and left the group (it rejoins after a backoff)",
    "rejoined": "this member rejoined after a failure",
    "retry": "a failed rebalance tried again",
    "closing": "the member closed and released its partitions",
    "unchanged": "a watch fired but nothing this member plans with changed",
    "damaged": "not a record: a history node (or a record in it) that could not be read",
}

_DETAIL_MAX = 300
_FIELDS = ("plan", "released", "claimed", "waiting")


@dataclass(frozen=True, kw_only=True)
class RebalanceRecord:
    """One rebalance one member took part in (or a flagged damaged entry).

    ``time_ms`` is the wall-clock start (epoch ms), ``duration_ms`` how long until the
    member settled (or gave up waiting for its claims: see ``waiting``).  Partitions
    are ``"<topic>/<partition>"``: ``plan`` this member's whole share,
    ``released`` what it gave up (or dropped: a lost session, a failure), ``claimed``
    what it took, ``waiting`` planned partitions still held by their old owner when it
    recorded.  ``state`` is the member's state afterwards (``stable``, ``claiming``,
    ``connecting``, ``closed``).  ``error`` is set only on a flagged entry
    (``trigger == "damaged"``), ``path`` is the node it came from.
    """

    consumer_id: str
    generation: int
    time_ms: int
    duration_ms: int = 0
    trigger: str = "unchanged"
    detail: str = ""
    state: str = ""
    strategy: str = ""
    plan: tuple[str, ...] = ()
    released: tuple[str, ...] = ()
    claimed: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    truncated: bool = False
    error: str | None = None
    path: str = ""

    @property
    def damaged(self) -> bool:
        return self.error is not None

    @property
    def end_ms(self) -> int:
        return self.time_ms + self.duration_ms

    def touches(self, partition: str) -> bool:
        """Whether ``partition`` (``topic/b-p``, or ``b-p`` in any topic) is in it."""
        return any(matches_partition(p, partition) for f in _FIELDS for p in getattr(self, f))

    def to_json(self) -> dict[str, Any]:
        """The record with stable field names (the CLI's and the dashboard's JSON)."""
        return {"consumer_id": self.consumer_id, "generation": self.generation,
                "time": iso_ms(self.time_ms), "time_ms": self.time_ms,
                "duration_ms": self.duration_ms, "trigger": self.trigger,
                "detail": self.detail, "state": self.state, "strategy": self.strategy,
                "plan": list(self.plan), "released": list(self.released),
                "claimed": list(self.claimed), "waiting": list(self.waiting),
                "truncated": self.truncated, "error": self.error, "path": self.path}


# -- the codec -----------------------------------------------------------------------------

def _grouped(parts: Sequence[str]) -> dict[str, list[str]]:
    """topic -> its partitions, runs of one broker's consecutive indexes written as
    ``"<b>-<first>..<last>"`` (a member's share is usually a few runs)."""
    names: dict[str, list[str]] = {}
    for p in parts:
        topic, _, name = p.partition("/")
        names.setdefault(topic, []).append(name)
    out: dict[str, list[str]] = {}
    for topic, items in names.items():
        runs: list[str] = []
        numbered = sorted({(int(b), int(i)) for b, i in
                           (n.split("-") for n in items if _NAME.fullmatch(n))})
        start = prev = None
        for b, i in numbered + [(-1, -1)]:
            if prev is not None and (b, i) == (prev[0], prev[1] + 1):
                prev = (b, i)
                continue
            if start is not None and prev is not None:
                runs.append(f"{start[0]}-{start[1]}" + (f"..{prev[1]}" if prev != start
                                                         else ""))
            start = prev = (b, i)
        out[topic] = runs + [n for n in items if not _NAME.fullmatch(n)]
    return out


_NAME = re.compile(r"[0-9]{1,10}-[0-9]{1,10}")
_RUN = re.compile(r"([0-9]{1,10})-([0-9]{1,10})\.\.([0-9]{1,10})")
#: Most partitions one run may stand for (a typo, not a plan, past it).
_MAX_RUN = 1_000_000


def _record_obj(r: RebalanceRecord) -> dict[str, Any]:
    obj: dict[str, Any] = {"gen": r.generation, "at": r.time_ms, "ms": r.duration_ms,
                           "trigger": r.trigger, "detail": r.detail[:_DETAIL_MAX],
                           "state": r.state, "strategy": r.strategy}
    for name in _FIELDS:
        obj[name] = _grouped(getattr(r, name))
    if r.truncated:
        obj["truncated"] = True
    return obj


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _cut(r: RebalanceRecord, keep: int) -> RebalanceRecord:
    """``r`` with each partition list cut to its first ``keep``."""
    lists = {name: getattr(r, name)[:keep] for name in _FIELDS}
    return replace(r, truncated=True, **lists)


def encode_history(consumer_id: str, records: Sequence[RebalanceRecord], *,
                   max_records: int = DEFAULT_RECORDS,
                   max_bytes: int = DEFAULT_NODE_BYTES) -> bytes:
    """A member's node: its last ``max_records`` records (oldest first), dropping the
    oldest until the encoding fits ``max_bytes``; a newest record too big alone has
    its partition lists cut (``truncated``).  ``max_bytes`` below 512 is refused."""
    check_consumer_id(consumer_id)
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 512:
        raise ValueError(f"max_bytes must be an int >= 512, got {max_bytes!r}")
    if isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1:
        raise ValueError(f"max_records must be an int >= 1, got {max_records!r}")
    head = {"v": HISTORY_VERSION, "consumerId": consumer_id}
    base = len(_dump({**head, "records": []}))
    objs = [_dump(_record_obj(r)) for r in list(records)[-max_records:]]
    total = base + sum(len(o) + 1 for o in objs)
    while objs and total > max_bytes:
        total -= len(objs.pop(0)) + 1
    if not objs and records:
        newest = records[-1]
        keep = max(len(getattr(newest, n)) for n in _FIELDS)
        while True:
            keep //= 2
            one = _dump(_record_obj(_cut(replace(newest, detail=newest.detail[:80]), keep)))
            if base + len(one) <= max_bytes or keep == 0:
                objs = [one] if base + len(one) <= max_bytes else []
                break
    return (b'{"v":%d,"consumerId":%s,"records":[' % (HISTORY_VERSION, _dump(consumer_id))
            + b",".join(objs) + b"]}")


def _str(obj: dict, key: str, path: str, data: object, default: str | None = None) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str):
        raise NodeDataError(path, data, f"{key} must be a string, not {value!r}")
    return value


def _int(obj: dict, key: str, path: str, data: object) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise NodeDataError(path, data, f"{key} must be an integer >= 0, not {value!r}")
    return value


def _parts(obj: dict, key: str, path: str, data: object) -> tuple[str, ...]:
    value = obj.get(key, {})
    if not isinstance(value, dict):
        raise NodeDataError(path, data, f"{key} must map topics to partition lists, "
                                        f"not {value!r}")
    out = []
    for topic, names in value.items():
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise NodeDataError(path, data, f"{key}[{topic!r}] must be a list of partition "
                                            f"names, not {names!r}")
        for n in names:
            m = _RUN.fullmatch(n)
            if m is None:
                out.append(f"{topic}/{n}")
                continue
            b, first, last = (int(x) for x in m.groups())
            if not 0 < last - first < _MAX_RUN:
                raise NodeDataError(path, data, f"{key}[{topic!r}]: bad run {n!r}")
            out += [f"{topic}/{b}-{i}" for i in range(first, last + 1)]
    return tuple(out)


def _decode_record(obj: object, consumer_id: str, path: str, data: object) -> RebalanceRecord:
    if not isinstance(obj, dict):
        raise NodeDataError(path, data, f"a record must be a JSON object, not {obj!r}")
    return RebalanceRecord(
        consumer_id=consumer_id, generation=_int(obj, "gen", path, data),
        time_ms=_int(obj, "at", path, data), duration_ms=_int(obj, "ms", path, data),
        trigger=_str(obj, "trigger", path, data), detail=_str(obj, "detail", path, data, ""),
        state=_str(obj, "state", path, data, ""),
        strategy=_str(obj, "strategy", path, data, ""),
        plan=_parts(obj, "plan", path, data), released=_parts(obj, "released", path, data),
        claimed=_parts(obj, "claimed", path, data), waiting=_parts(obj, "waiting", path, data),
        truncated=obj.get("truncated") is True, path=path)


def _flagged(consumer_id: str, time_ms: int, path: str, reason: str) -> RebalanceRecord:
    return RebalanceRecord(consumer_id=consumer_id, generation=0, time_ms=time_ms,
                           trigger="damaged", error=reason, path=path)


def decode_history(data: bytes | str | None, path: str = "",
                   mtime_ms: int = 0) -> list[RebalanceRecord]:
    """A member's node as records, oldest first.  A node that is not a history node
    (not JSON, a newer version, a consumer id naming another node) raises
    :class:`NodeDataError`; a record in it that does not decode comes back as a
    flagged record (``trigger == "damaged"``, dated ``mtime_ms``) among the others."""
    obj = json_object(data, path, "(a rebalance history)", ("v", "consumerId", "records"))
    version = obj["v"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise NodeDataError(path, data, f"v must be a version number, not {version!r}")
    if version > HISTORY_VERSION:
        raise NodeDataError(path, data, f"history version {version} is newer than this "
                                        f"reader's ({HISTORY_VERSION})")
    cid = obj["consumerId"]
    if not isinstance(cid, str):
        raise NodeDataError(path, data, f"consumerId must be a string, not {cid!r}")
    try:
        check_consumer_id(cid)
    except InvalidNameError as e:
        raise NodeDataError(path, data, f"consumerId: {e.reason}") from None
    if path and path.rsplit("/", 1)[-1] != cid:
        raise NodeDataError(path, data, f"consumerId {cid!r} is not the node's name")
    records = obj["records"]
    if not isinstance(records, list):
        raise NodeDataError(path, data, f"records must be a list, not {records!r}")
    out = []
    for i, r in enumerate(records):
        try:
            out.append(_decode_record(r, cid, path, data))
        except NodeDataError as e:
            out.append(_flagged(cid, mtime_ms, path, f"record {i}: {e.reason}"))
    return out


# -- reading a group's history ---------------------------------------------------------------

def read_history(client: Any, layout: Layout, group: str,
                 since: int | None = None) -> list[RebalanceRecord]:
    """Every member's records of ``group`` (live members and gone ones), merged and
    sorted by time (then consumer id, then generation); with ``since`` (epoch ms),
    only records that ended at or after it.  Garbage is a flagged record, never an
    exception; ZooKeeper's own failures (connection) propagate."""
    base = layout.history(group)
    try:
        names = client.get_children(base)
    except NoNodeError:
        return []
    pending = []
    for name in sorted(names):
        path = f"{base}/{name}"
        pending.append((name, path, client.get_async(path)))
    out: list[RebalanceRecord] = []
    for name, path, result in pending:
        try:
            data, stat = result.get()
        except NoNodeError:
            continue  # pruned while we read
        mtime = int(getattr(stat, "mtime", 0) or 0)
        try:
            check_consumer_id(name)
            records = decode_history(data, path, mtime)
        except InvalidNameError as e:
            records = [_flagged(name, mtime, path, f"not a consumer id: {e.reason}")]
        except NodeDataError as e:
            records = [_flagged(name, mtime, path, e.reason)]
        out += records
    if since is not None:
        out = [r for r in out if r.end_ms >= since or (r.damaged and r.time_ms >= since)]
    out.sort(key=lambda r: (r.time_ms, r.consumer_id, r.generation))
    return out


def prune_history(client: Any, layout: Layout, group: str, *, keep: Iterable[str] = (),
                  protect: str | None = None, max_members: int = DEFAULT_MAX_MEMBERS,
                  max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
                  node_bytes: int = 1024 * 1024) -> list[str]:
    """Delete history nodes of ``group`` until at most ``max_members`` nodes and
    ``max_total_bytes`` bytes are left: the nodes of members not in ``keep`` (the live
    ones) first, each set oldest written first; never ``protect`` (the caller's own).
    Returns the consumer ids deleted.  A node gone meanwhile is no failure.

    One listing, and only when the count times ``node_bytes`` (the size a node is
    taken to have at most: ZooKeeper's limit by default, the members' cap when they
    share it) could pass ``max_total_bytes``, one pipelined ``exists`` per node."""
    base = layout.history(group)
    try:
        names = client.get_children(base)
    except NoNodeError:
        return []
    count = len(names) + (protect is not None and protect not in names)
    if count <= max_members and max_total_bytes >= count * node_bytes:
        return []  # cannot be over either bound: no stat needed
    stats = {n: client.exists_async(f"{base}/{n}") for n in names}
    sizes: dict[str, tuple[int, int]] = {}
    for name, result in stats.items():
        stat = result.get()
        if stat is not None:
            sizes[name] = (stat.mtime, stat.dataLength)
    if protect is not None and protect not in sizes:
        sizes[protect] = (2**62, node_bytes)  # being written now: counted, never deleted
    live = set(keep)
    order = sorted((n for n in sizes if n != protect),
                   key=lambda n: (n in live, sizes[n][0], n))
    count, total = len(sizes), sum(s for _, s in sizes.values())
    doomed = []
    for name in order:
        if count <= max_members and total <= max_total_bytes:
            break
        doomed.append(name)
        count -= 1
        total -= sizes[name][1]
    pending = [(n, client.delete_async(f"{base}/{n}")) for n in doomed]
    deleted = []
    for name, result in pending:
        try:
            result.get()
            deleted.append(name)
        except NoNodeError:
            pass
    return deleted


def matches_partition(p: str, wanted: str) -> bool:
    """Whether partition ``p`` (``topic/b-p``) is ``wanted``: ``topic/b-p``, or ``b-p``
    in any topic."""
    return p == wanted or ("/" not in wanted and p.rsplit("/", 1)[-1] == wanted)
