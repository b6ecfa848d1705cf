"""Capacity hint: how long a group needs to catch up, and how many members it needs
to do it within a target (pure over two :class:`Reading`\\ s, plus the one reader).

A :class:`Reading` is, at one moment, each partition's owner, committed offset and
log end.  From two readings ``dt`` apart (:func:`capacity`):

- produce rate: the log ends' growth, summed over partitions, over ``dt``;
- consume rate of a member: its partitions' committed offsets' growth over ``dt``
  (a partition that changed owner between the readings counts for nobody);
- lag: log end minus committed offset, summed, at the second reading;
- catch-up time: ``lag / (consume rate - produce rate)``, None when the group is
  not gaining;
- members needed within ``target`` seconds: ``ceil((produce rate + lag / target)
  / per-member rate)``.

All in bytes (Metaq's offsets are byte positions).  **Assumptions** (also in every
hint's ``assumptions``): the produce rate and each member's rate stay as observed;
a member's capacity is observable only while it has a backlog (a member that caught
up consumes only what arrives), so the per-member rate is the mean over members
that were behind at both readings (``busy``), and, when none were, the group keeps
up and its capacity is not measured; the per-member rate scales linearly with the
member count up to the partition count (a partition is consumed by one member, so
more members than partitions add nothing), and partitions are evenly loaded (a
hot partition catches up no faster than its owner alone).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient

from metaq._errors import ConfigError
from metaq._insight._logs import LogState, read_logs
from metaq._types import PartitionKey
from zk_layout import Layout, Snapshot, take_snapshot

__all__ = ["PartitionReading", "Reading", "CapacityHint", "reading", "take_reading",
           "capacity", "ASSUMPTIONS"]

ASSUMPTIONS = (
    "the produce rate and each member's consume rate stay as observed over the window",
    "a member's capacity is measured only while it was behind at both readings; members "
    "that kept up consume only what arrives",
    "the per-member rate scales linearly with the member count up to the partition count "
    "(one member per partition: more members than partitions add nothing)",
    "partitions are evenly loaded (a hot partition catches up no faster than its owner)",
)


@dataclass(frozen=True, kw_only=True)
class PartitionReading:
    owner: str | None = None
    committed: int | None = None
    log_end: int | None = None


@dataclass(frozen=True, kw_only=True)
class Reading:
    """A group at one moment: ``at`` in seconds (any clock; only differences count)."""

    group: str
    at: float
    members: tuple[str, ...] = ()
    partitions: Mapping[PartitionKey, PartitionReading] = field(default_factory=dict)


def reading(snapshot: Snapshot, group: str,
            logs: Mapping[PartitionKey, LogState], *, at: float) -> Reading:
    """A :class:`Reading` from a snapshot and the brokers' answers (``read_logs``)."""
    info = snapshot.group(group)
    if info is None:
        raise ConfigError(f"no consumer group {group!r} under {snapshot.root}")
    parts = {}
    for gt in info.topics:
        for ps in gt.partitions:
            key = PartitionKey(gt.topic, str(ps.partition))
            log = logs.get(key)
            parts[key] = PartitionReading(
                owner=ps.owner, committed=ps.offset.offset if ps.offset else None,
                log_end=None if log is None else log.log_end)
    return Reading(group=group, at=at, members=tuple(m.consumer_id for m in info.members),
                   partitions=parts)


def take_reading(client: KazooClient, layout: Layout, group: str, *,
                 timeout: float = 5.0) -> Reading:
    """Read the tree and the brokers now (``at``: ``time.monotonic()``)."""
    at = time.monotonic()
    snap = take_snapshot(client, layout)
    return reading(snap, group, read_logs(client, layout, snap, group, timeout=timeout), at=at)


@dataclass(frozen=True, kw_only=True)
class CapacityHint:
    """The estimate (module docstring); rates in bytes per second, times in seconds."""

    group: str
    window: float
    produce_rate: float
    consume_rate: float
    member_rates: Mapping[str, float]
    busy_members: tuple[str, ...]
    per_member_rate: float | None
    lag: int
    members: int
    partitions: int
    catch_up_seconds: float | None
    target_seconds: float | None = None
    members_needed: int | None = None
    notes: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ASSUMPTIONS

    def to_json(self) -> dict[str, Any]:
        """Stable field names: the dataclass fields, rates rounded to 0.1 B/s."""
        return {"group": self.group, "window": round(self.window, 3),
                "produce_rate": round(self.produce_rate, 1),
                "consume_rate": round(self.consume_rate, 1),
                "member_rates": {m: round(r, 1) for m, r in self.member_rates.items()},
                "busy_members": list(self.busy_members),
                "per_member_rate": None if self.per_member_rate is None
                else round(self.per_member_rate, 1),
                "lag": self.lag, "members": self.members, "partitions": self.partitions,
                "catch_up_seconds": None if self.catch_up_seconds is None
                else round(self.catch_up_seconds, 1),
                "target_seconds": self.target_seconds, "members_needed": self.members_needed,
                "notes": list(self.notes), "assumptions": list(self.assumptions)}


def capacity(first: Reading, second: Reading, *, target: float | None = None) -> CapacityHint:
    """The capacity hint from two readings of one group (``second`` after ``first``)
    and an optional target catch-up time in seconds."""
    if first.group != second.group:
        raise ConfigError(f"readings of two groups: {first.group!r} and {second.group!r}")
    window = second.at - first.at
    if not window > 0:
        raise ConfigError(f"the second reading must come after the first (window {window})")
    if target is not None and not target > 0:
        raise ConfigError(f"the target catch-up time must be > 0 seconds, got {target!r}")
    notes: list[str] = []
    produced = 0
    lag = 0
    consumed: dict[str, int] = {m: 0 for m in second.members}
    busy: set[str] = set()
    unknown = []
    for key, b in second.partitions.items():
        a = first.partitions.get(key)
        if a is None or a.log_end is None or b.log_end is None:
            unknown.append(key)
            continue
        produced += max(0, b.log_end - a.log_end)
        pos_b = b.committed or 0
        lag += max(0, b.log_end - pos_b)
        if b.owner is None or a.owner != b.owner:
            continue
        pos_a = a.committed or 0
        consumed[b.owner] = consumed.get(b.owner, 0) + max(0, pos_b - pos_a)
        if a.log_end > pos_a and b.log_end > pos_b:
            busy.add(b.owner)
    if unknown:
        notes.append(f"{len(unknown)} partition(s) left out (broker did not answer): "
                     + ", ".join(f"{k[0]}/{k[1]}" for k in sorted(unknown)[:8]))
    rates = {m: c / window for m, c in consumed.items()}
    produce_rate = produced / window
    consume_rate = sum(rates.values())
    busy_members = tuple(m for m in second.members if m in busy)
    per_member = (sum(rates[m] for m in busy_members) / len(busy_members)
                  if busy_members else None)
    partitions = len(second.partitions)
    if len(unknown) == partitions:
        notes.append("no partition could be measured: no estimate")
        return CapacityHint(group=second.group, window=window, produce_rate=0.0,
                            consume_rate=0.0, member_rates={}, busy_members=(),
                            per_member_rate=None, lag=0, members=len(second.members),
                            partitions=partitions, catch_up_seconds=None,
                            target_seconds=target, members_needed=None, notes=tuple(notes))
    if lag == 0:
        catch_up: float | None = 0.0
    elif consume_rate > produce_rate:
        catch_up = lag / (consume_rate - produce_rate)
    else:
        catch_up = None
        notes.append("not catching up: the group consumes no faster than producers write")
    needed = None
    if target is not None:
        if lag == 0 and not busy_members:
            needed = len(second.members)
            notes.append("caught up: the current members keep up (their capacity is not "
                         "measured while they have no backlog)")
        elif per_member is None or per_member <= 0:
            notes.append("no member was both behind and consuming over the window: no "
                         "per-member rate to scale (is the group stuck?)")
        else:
            needed = max(1, math.ceil((produce_rate + lag / target) / per_member))
            if needed > partitions:
                notes.append(f"{needed} members needed but only {partitions} partitions: "
                             f"members beyond {partitions} consume nothing, so the target "
                             f"cannot be met by adding members")
    return CapacityHint(group=second.group, window=window, produce_rate=produce_rate,
                        consume_rate=consume_rate, member_rates=rates,
                        busy_members=busy_members, per_member_rate=per_member, lag=lag,
                        members=len(second.members), partitions=partitions,
                        catch_up_seconds=catch_up, target_seconds=target,
                        members_needed=needed, notes=tuple(notes))
