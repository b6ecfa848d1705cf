"""Rebalance history over time: who held each partition when, and why it moved.

:func:`ownership_timeline` turns members' :class:`~zk_layout.RebalanceRecord` s
(``_history``) into :class:`OwnershipInterval` s per partition ("who held 3-7 at
14:02, and why did it move?": :func:`holder_at`); :func:`select_history` is what
``metaq group history`` and ``python -m zk_layout history`` show for ``--since`` and
``--partition``, :func:`render_history` how they print it, :func:`parse_since` how
they read ``--since``.  Pure: no ZooKeeper.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from zk_layout._history import RebalanceRecord, matches_partition
from zk_layout._static import iso_ms

__all__ = ["OwnershipInterval", "ownership_timeline", "timeline_to_json", "holder_at",
           "select_history", "history_to_json", "parse_since", "render_history"]


class OwnershipInterval(NamedTuple):
    """One member's holding of one partition: from ``start_ms`` (None: before the
    history kept begins) to ``end_ms`` (None: still held when the history ends), the
    trigger that brought it (None: unknown, before the history) and the one that took
    it away (None: still held)."""

    start_ms: int | None
    end_ms: int | None
    consumer_id: str
    trigger_in: str | None
    trigger_out: str | None

    def to_json(self) -> dict[str, Any]:
        return {"start_ms": self.start_ms, "end_ms": self.end_ms,
                "start": None if self.start_ms is None else iso_ms(self.start_ms),
                "end": None if self.end_ms is None else iso_ms(self.end_ms),
                "consumer_id": self.consumer_id, "trigger_in": self.trigger_in,
                "trigger_out": self.trigger_out}


# -- ownership over time --------------------------------------------------------------------

def _partition_order(p: str) -> tuple[str, tuple[int, ...], str]:
    """Topic, then broker id and index as numbers (for people: 0-2 before 0-10)."""
    topic, _, name = p.partition("/")
    nums = tuple(int(x) for x in name.split("-")) if _PART.fullmatch(name) else ()
    return topic, nums, name


_PART = re.compile(r"[0-9]+-[0-9]+")

# event kinds, in the order they are taken within one millisecond
_RELEASED, _CLAIMED, _KEPT, _WAITING = range(4)


def ownership_timeline(records: Iterable[RebalanceRecord]
                       ) -> dict[str, list[OwnershipInterval]]:
    """partition (``topic/b-p``) -> who held it when, oldest first, from the members'
    records (damaged ones skipped).

    Rebalances of several members overlap, so the records are taken apart into
    events: a member stops holding what it released at the *start* of the rebalance
    that released it (or dropped it: a lost session, a failure, the close), and holds
    what it claimed from the *end* of the one that claimed it.  A hand-over then shows
    a gap, never an overlap (a claim can only succeed after the release).  A member
    that never said it let go (killed with SIGKILL) is taken to have held the
    partition until the rebalance of the member that claimed it next began, with that
    claim's trigger as the reason it moved.  A claim that had to wait (its holder's
    node still there) and was won by a later retry whose trigger is ``unchanged``
    carries the reason of the rebalance that planned it.  A partition a member already
    had when its kept history begins starts at None."""
    # In one millisecond: releases, then claims, then what a member kept, then waits.  A
    # claim comes before a keep so that the next rebalance of the claimer, starting in
    # the millisecond its claim ended, does not take the partition as kept (held since
    # before the history, or taken from its last holder for no reason of its own).
    events: list[tuple[int, int, str, str, RebalanceRecord]] = []
    for r in records:
        if r.damaged:
            continue
        events += [(r.time_ms, _RELEASED, r.consumer_id, p, r) for p in r.released]
        skip = set(r.claimed) | set(r.waiting)
        events += [(r.time_ms, _KEPT, r.consumer_id, p, r) for p in r.plan if p not in skip]
        events += [(r.end_ms, _CLAIMED, r.consumer_id, p, r) for p in r.claimed]
        events += [(r.time_ms, _WAITING, r.consumer_id, p, r) for p in r.waiting]
    events.sort(key=lambda e: (e[0], e[1], e[2], e[4].generation))
    held: dict[str, tuple[int | None, str, str | None]] = {}
    planned: dict[tuple[str, str], str] = {}  # (member, partition) waiting -> why planned
    out: dict[str, list[OwnershipInterval]] = {}

    def close(p: str, end: int, why: str) -> None:
        start, cid, why_in = held.pop(p)
        if start is not None:
            end = max(end, start)
        out.setdefault(p, []).append(OwnershipInterval(start, end, cid, why_in, why))

    for at, kind, me, p, r in events:
        if kind == _WAITING:  # a claim that waits: its reason is this rebalance's
            planned.setdefault((me, p), r.trigger)
            continue
        why = r.trigger
        if kind == _CLAIMED:
            first = planned.pop((me, p), None)
            if r.trigger == "unchanged" and first is not None:
                why = first  # (a retry that names no reason of its own)
        mine = p in held and held[p][1] == me
        if kind == _RELEASED:
            if mine:
                close(p, at, r.trigger)
            elif p not in held:  # held since before the kept history
                out.setdefault(p, []).append(OwnershipInterval(None, at, me, None, r.trigger))
        elif not mine:  # kept or claimed, not ours yet
            if p in held:  # another's, that never said it let go
                close(p, r.time_ms, why)
                held[p] = (at, me, why)
            else:
                held[p] = (at, me, why) if kind == _CLAIMED else (None, me, None)
    for p, (start, cid, why_in) in held.items():
        out.setdefault(p, []).append(OwnershipInterval(start, None, cid, why_in, None))
    return {p: sorted(out[p], key=lambda i: (-1 if i.start_ms is None else i.start_ms))
            for p in sorted(out, key=_partition_order)}


def timeline_to_json(timeline: Mapping[str, Sequence[OwnershipInterval]]
                     ) -> dict[str, list[dict[str, Any]]]:
    """:func:`ownership_timeline`'s result as plain JSON values."""
    return {p: [i.to_json() for i in intervals] for p, intervals in timeline.items()}


def history_to_json(group: str, records: Sequence[RebalanceRecord],
                    timeline: Mapping[str, Sequence[OwnershipInterval]]) -> dict[str, Any]:
    """The document ``group history --json`` prints (and the dashboard serves):
    ``{"group", "records": [record.to_json()...], "timeline": {partition: [...]}}``."""
    return {"group": group, "records": [r.to_json() for r in records],
            "timeline": timeline_to_json(timeline)}


def select_history(records: Sequence[RebalanceRecord], *, since: int | None = None,
                   partition: str | None = None
                   ) -> tuple[list[RebalanceRecord], dict[str, list[OwnershipInterval]]]:
    """What ``group history --since T --partition P`` shows: the records that ended at
    or after ``since`` and touch ``partition`` (``topic/b-p``, or ``b-p`` in any topic;
    flagged ones always), and the timeline of the partitions (of that one) cut to the
    intervals still open at ``since``.  The timeline is built from every record, so
    that who held a partition when the window opens is known."""
    timeline = ownership_timeline(records)
    out = [r for r in records if since is None or r.end_ms >= since
           or (r.damaged and r.time_ms >= since)]
    if partition:
        out = [r for r in out if r.damaged or r.touches(partition)]
        timeline = {p: ivs for p, ivs in timeline.items() if matches_partition(p, partition)}
    if since is not None:
        timeline = {p: kept for p, ivs in timeline.items()
                    if (kept := [i for i in ivs if i.end_ms is None or i.end_ms >= since])}
    return out, timeline


def holder_at(timeline: Mapping[str, Sequence[OwnershipInterval]], partition: str,
              at_ms: int) -> OwnershipInterval | None:
    """The interval of ``partition`` covering ``at_ms`` (who held it then), or None."""
    for i in timeline.get(partition, ()):
        if (i.start_ms is None or i.start_ms <= at_ms) and (i.end_ms is None
                                                           or at_ms < i.end_ms):
            return i
    return None


# -- for people ------------------------------------------------------------------------------

_RELATIVE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(s|m|h|d)\s*", re.IGNORECASE)
_UNITS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_since(text: str, now_ms: int | None = None) -> int:
    """``--since``: a duration back from now (``30s``, ``10m``, ``2h``, ``1d``), ISO-8601
    (a time without zone is UTC) or epoch milliseconds; epoch ms.  Anything else raises
    :class:`ValueError` saying what is accepted."""
    from datetime import UTC, datetime

    now = int(time.time() * 1000) if now_ms is None else now_ms
    m = _RELATIVE.fullmatch(text)
    if m:
        return now - int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    t = text.strip()
    if t.isdigit():
        return int(t)
    try:
        when = datetime.fromisoformat(t.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"since {text!r} is neither a duration back from now (30s, 10m, 2h, "
                         f"1d), ISO-8601 (2026-11-25T14:00:00Z) nor epoch ms") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1000)


def _short(parts: Sequence[str], limit: int = 8) -> str:
    """``orders:0-0,0-1 other:1-0`` with at most ``limit`` partitions, then ``+N``."""
    if not parts:
        return "-"
    by_topic: dict[str, list[str]] = {}
    for p in parts[:limit]:
        topic, _, name = p.rpartition("/")
        by_topic.setdefault(topic, []).append(name)
    shown = " ".join(f"{t}:{','.join(names)}" for t, names in by_topic.items())
    return shown + (f" +{len(parts) - limit}" if len(parts) > limit else "")


def render_history(records: Sequence[RebalanceRecord],
                   timeline: Mapping[str, Sequence[OwnershipInterval]] | None = None) -> str:
    """The records as a table (one line each) and, when given, the timeline of each
    partition in it (who held it, from when to when, why it came and went)."""
    from zk_layout._render import format_table

    if not records:
        text = "no rebalance history"
    else:
        text = format_table(
            ["time", "member", "gen", "trigger", "took ms", "released", "claimed", "waiting",
             "state", "detail"],
            [[iso_ms(r.time_ms), r.consumer_id, r.generation, r.trigger,
              r.duration_ms, _short(r.released), _short(r.claimed), _short(r.waiting),
              r.state or None,
              (f"DAMAGED {r.path}: {r.error}" if r.damaged else r.detail
               + (" (partition lists truncated)" if r.truncated else "")) or None]
             for r in records])
    if timeline:
        rows = [[p, None if i.start_ms is None else iso_ms(i.start_ms),
                 None if i.end_ms is None else iso_ms(i.end_ms), i.consumer_id,
                 i.trigger_in, i.trigger_out]
                for p, intervals in timeline.items() for i in intervals]
        text += "\n\n" + format_table(["partition", "from", "until", "held by", "came by",
                                       "left by"], rows)
    return text
