"""Offset ranges: which bytes of which partition one Spark task reads, and how
they are planned from ZooKeeper and the brokers.

A range ``[from_offset, until_offset)`` holds the messages that start in it;
both ends are message boundaries (log bounds, committed offsets, or positions
the broker's ``offset`` command returned), so a reader never starts or stops
inside a message.  Planning resolves an :class:`~metaq.spark._options.OffsetSpec`
per partition, checks it against the log (data deleted by retention is data
loss; an explicit offset beyond the log is an error), and optionally splits
big ranges at boundaries the broker names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metaq._errors import ConfigError, ConnectionClosedError, CoordinationError, DataLossError
from metaq._time import format_time_ms
from metaq._types import BrokerAddress, PartitionKey
from metaq.protocol import MSG_ID_EPOCH_MS
from metaq.spark._cluster import Cluster
from metaq.spark._options import EARLIEST_CODE, LATEST_CODE, OffsetSpec
from zk_layout import NodeDataError, StoredOffset, parse_partition

__all__ = ["OffsetRange", "PartitionOffsets", "resolve", "plan_ranges", "progress_end_offsets",
           "split_range", "cap_offsets", "Backlog", "measure_backlog", "cap_messages",
           "SAMPLE_BYTES"]

log = logging.getLogger(__name__)

#: {topic: {partition name: offset}}: how positions cross Spark's JSON boundary.
PartitionOffsets = dict[str, dict[str, int]]


@dataclass(frozen=True, kw_only=True)
class OffsetRange:
    """Messages of one partition starting in ``[from_offset, until_offset)``.

    ``partition`` is Metaq's name ``"<brokerId>-<index>"``; ``address`` is the
    broker's ``(host, port)`` when planned (a reader re-reads it from
    ZooKeeper when that broker has moved).  Picklable.
    """

    topic: str
    partition: str
    from_offset: int
    until_offset: int
    address: BrokerAddress | None = None

    def __post_init__(self) -> None:
        parse_partition(self.partition)
        if not 0 <= self.from_offset <= self.until_offset:
            raise ConfigError(f"offset range of {self.topic} {self.partition} must have "
                              f"0 <= from <= until, got {self.from_offset}..{self.until_offset}")

    @property
    def broker_id(self) -> int:
        return parse_partition(self.partition).broker_id

    @property
    def index(self) -> int:
        """The partition's index on its broker (the ``<index>`` of the name)."""
        return parse_partition(self.partition).index

    @property
    def size(self) -> int:
        """Bytes in the range (headers included)."""
        return self.until_offset - self.from_offset


def _loss(fail: bool, what: str) -> None:
    if fail:
        raise DataLossError(what + " (set failOnDataLoss=false to skip what is gone)")
    log.warning("%s; skipping it (failOnDataLoss=false)", what)


def resolve(cluster: Cluster, topic: str, partitions: list[str], spec: OffsetSpec, *,
            end: bool, fail_on_data_loss: bool,
            bounds: Mapping[str, tuple[int, int]],
            offset_reset: str | None = None) -> dict[str, int]:
    """Each partition's offset for ``spec`` (a start when ``end`` is false).

    ``bounds`` maps partition -> (log start, log end).  A committed offset or
    explicit start below the log start is data loss; an explicit offset past
    the log end is an error; explicit offsets that are not message boundaries
    are moved back to the boundary the broker names (with a warning).
    """
    committed = cluster.committed(topic, partitions) if spec.kind == "group" else {}
    explicit = spec.per_partition.get(topic, {}) if spec.kind in ("json", "timestamp") else {}
    unknown = sorted(set(explicit) - set(partitions))
    if unknown:
        what = ("endingOffsets" if end else "startingOffsets") + \
            ("ByTimestamp" if spec.kind == "timestamp" else "")
        raise ConfigError(f"{what} names partition(s) "
                          f"{', '.join(unknown)} of topic {topic!r}, which has "
                          f"{', '.join(partitions) or 'no partitions'}")
    if spec.kind == "timestamp":
        return _resolve_times(cluster, topic, partitions, spec, explicit, end=end,
                              fail_on_data_loss=fail_on_data_loss, bounds=bounds,
                              offset_reset=offset_reset)
    out: dict[str, int] = {}
    for part in partitions:
        first, last = bounds[part]
        where = f"{topic} {part} (log {first}..{last})"
        if spec.kind == "earliest":
            offset = first
        elif spec.kind == "latest":
            offset = last
        elif spec.kind == "group":
            offset = _committed_start(cluster, committed.get(part), first, last, where,
                                      fail_on_data_loss, offset_reset)
        else:
            wanted = explicit.get(part, LATEST_CODE if end else EARLIEST_CODE)
            if wanted == EARLIEST_CODE:
                offset = first
            elif wanted == LATEST_CODE:
                offset = last
            elif wanted > last:
                raise ConfigError(f"offset {wanted} asked for {where} is past the log end")
            elif wanted < first:
                _loss(fail_on_data_loss, f"offset {wanted} asked for {where}: bytes "
                                         f"{wanted}..{first} were deleted")
                offset = first
            else:
                offset = wanted
                if first < wanted < last:
                    offset = cluster.nearest(topic, part, wanted)
                    if offset != wanted:
                        log.warning("offset %d of %s is inside a message; using the "
                                    "boundary %d the broker names", wanted, where, offset)
        out[part] = offset
    return out


def _resolve_times(cluster: Cluster, topic: str, partitions: list[str], spec: OffsetSpec,
                   explicit: Mapping[str, int], *, end: bool, fail_on_data_loss: bool,
                   bounds: Mapping[str, tuple[int, int]],
                   offset_reset: str | None) -> dict[str, int]:
    """Each partition's first message at or after its time (Kafka's offsetsForTimes);
    partitions without a time take ``spec.fallback``."""
    out: dict[str, int] = {}
    rest = [p for p in partitions if spec.all_ms is None and p not in explicit]
    if rest:
        out.update(resolve(cluster, topic, rest, spec.fallback or OffsetSpec(kind="latest" if end
                                                                             else "earliest"),
                           end=end, fail_on_data_loss=fail_on_data_loss, bounds=bounds,
                           offset_reset=offset_reset))
    for part in partitions:
        if part in out:
            continue
        when = spec.all_ms if spec.all_ms is not None else explicit[part]
        first, last = bounds[part]
        seek = cluster.offset_for_time(topic, part, when)
        if seek.msg_time_ms is None:  # no message that late
            if not end and spec.strategy == "error":
                raise ConfigError(
                    f"no message of {topic} {part} (log {first}..{last}) is at or after the "
                    f"starting time {format_time_ms(when)}: set option "
                    f"startingOffsetsByTimestampStrategy=latest to start at the log end")
            out[part] = last
        else:
            out[part] = min(max(seek.offset, first), last)
    return {p: out[p] for p in partitions}


def _committed_start(cluster: Cluster, stored: StoredOffset | NodeDataError | None,
                     first: int, last: int, where: str, fail_on_data_loss: bool,
                     offset_reset: str | None) -> int:
    """Where a group position starts: its committed offset, or what offsetReset says
    when that is outside ``first..last`` or its node holds garbage."""
    if stored is None:
        return first
    if isinstance(stored, NodeDataError):
        what = f"group {cluster.group!r} has a damaged committed offset for {where}: {stored}"
        problem, nearest = what, first
    elif stored.offset < first:
        problem = (f"group {cluster.group!r} committed {stored.offset} for {where}: bytes "
                   f"{stored.offset}..{first} were deleted")
        nearest = first
    elif stored.offset > last:
        problem = f"group {cluster.group!r} committed {stored.offset} for {where}, past the log end"
        nearest = last
    else:
        return stored.offset
    if offset_reset is None:  # failOnDataLoss decides, then the nearest end of the log
        _loss(fail_on_data_loss, problem)
        return nearest
    if offset_reset == "fail":
        raise DataLossError(problem + " (offsetReset=fail)")
    log.warning("%s; reading from the log %s (offsetReset=%s)", problem,
                "start" if offset_reset == "earliest" else "end", offset_reset)
    return first if offset_reset == "earliest" else last


def split_range(cluster: Cluster, rng: OffsetRange, max_bytes: int) -> list[OffsetRange]:
    """``rng`` cut into pieces of about ``max_bytes`` at message boundaries the
    broker names (a Java broker names segment starts, so pieces may be fewer)."""
    if rng.size <= max_bytes:
        return [rng]
    pieces = -(-rng.size // max_bytes)
    cuts = [rng.from_offset]
    for k in range(1, pieces):
        target = rng.from_offset + rng.size * k // pieces
        cut = cluster.nearest(rng.topic, rng.partition, target)
        if cuts[-1] < cut < rng.until_offset:
            cuts.append(cut)
    cuts.append(rng.until_offset)
    return [OffsetRange(topic=rng.topic, partition=rng.partition, from_offset=a,
                        until_offset=b, address=rng.address)
            for a, b in zip(cuts, cuts[1:], strict=False)]


def log_bounds(cluster: Cluster, topic: str, partitions: list[str], *,
               skip_unreachable: bool) -> dict[str, tuple[int, int]]:
    """partition -> (log start, log end); unreachable brokers raise, or are left
    out with a warning when ``skip_unreachable``."""
    out = {}
    for part in partitions:
        try:
            out[part] = cluster.bounds(topic, part)
        except ConnectionClosedError as e:
            if not skip_unreachable:
                raise
            log.warning("%s %s: broker unreachable, no new data planned for it: %s",
                        topic, part, e)
    return out


def plan_ranges(cluster: Cluster, topics: tuple[str, ...], start: OffsetSpec,
                end: OffsetSpec, *, fail_on_data_loss: bool,
                max_bytes: int | None = None,
                offset_reset: str | None = None) -> list[OffsetRange]:
    """Batch planning: one range per partition with data (``[]`` for none),
    split at ``max_bytes`` when given."""
    ranges: list[OffsetRange] = []
    for topic in topics:
        parts = cluster.partitions(topic)
        if not parts:
            raise CoordinationError(
                f"topic {topic!r} has no partitions under "
                f"{cluster.layout.topic_sub_dir(topic)}: no broker serves it now")
        bounds = log_bounds(cluster, topic, parts, skip_unreachable=False)
        froms = resolve(cluster, topic, parts, start, end=False,
                        fail_on_data_loss=fail_on_data_loss, bounds=bounds,
                        offset_reset=offset_reset)
        untils = resolve(cluster, topic, parts, end, end=True,
                         fail_on_data_loss=fail_on_data_loss, bounds=bounds,
                         offset_reset=offset_reset)
        for part in parts:
            a, b = froms[part], untils[part]
            if a > b:
                raise ConfigError(f"{topic} {part}: the start {a} ({start.kind}) is after the "
                                  f"end {b} ({end.kind})")
            if a == b:
                continue
            rng = OffsetRange(topic=topic, partition=part, from_offset=a, until_offset=b,
                              address=cluster.address(parse_partition(part).broker_id))
            ranges.extend(split_range(cluster, rng, max_bytes) if max_bytes else [rng])
    return ranges


def cap_offsets(cluster: Cluster, start: PartitionOffsets, latest: PartitionOffsets,
                max_bytes: int) -> PartitionOffsets:
    """End offsets at most ``max_bytes`` past ``start`` in total, shared in
    proportion to each partition's backlog, each at a message boundary; at
    least one message moves when there is any backlog."""
    backlog = {(t, p): latest[t][p] - start.get(t, {}).get(p, latest[t][p])
               for t in latest for p in latest[t]}
    total = sum(b for b in backlog.values() if b > 0)
    if total <= max_bytes:
        return latest
    out = {t: dict(parts) for t, parts in start.items()}
    moved = False
    for (topic, part), waiting in backlog.items():
        a = start.get(topic, {}).get(part, latest[topic][part])
        out.setdefault(topic, {})[part] = a
        if waiting <= 0:
            continue
        share = max_bytes * waiting // total
        if share <= 0:
            continue
        target = cluster.nearest(topic, part, a + share)
        if target > a:
            out[topic][part] = min(target, latest[topic][part])
            moved = True
    if not moved and total:
        (topic, part), _ = max(backlog.items(), key=lambda kv: kv[1])
        a = out[topic][part]
        out[topic][part] = min(cluster.walk_boundary(topic, part, a, max_bytes),
                               latest[topic][part])
    return out


#: Bytes of the one ``get`` per partition that counts messages for
#: maxOffsetsPerTrigger / minOffsetsPerTrigger.
SAMPLE_BYTES = 256 * 1024


@dataclass(frozen=True, kw_only=True)
class Backlog:
    """The messages waiting in one partition between ``start`` and ``end``, from a
    sampled ``get`` at ``start``.  ``bounds`` are the message boundaries the
    sample holds (``start`` first); ``exact`` when the sample reached ``end``, so
    ``messages`` is a count, else an estimate: bytes / the sample's mean size."""

    start: int
    end: int
    bounds: tuple[int, ...]
    first_msg_id: int

    @property
    def exact(self) -> bool:
        return self.bounds[-1] >= self.end

    @property
    def messages(self) -> int:
        whole = sum(1 for b in self.bounds[1:] if b <= self.end)
        if self.exact or len(self.bounds) < 2:
            return whole
        mean = (self.bounds[-1] - self.start) / (len(self.bounds) - 1)
        return max(whole, round((self.end - self.start) / mean))

    @property
    def oldest_ms(self) -> int | None:
        """The msgId time of the first waiting message (None when none waits)."""
        if self.end <= self.start or self.first_msg_id < 0:
            return None
        return (self.first_msg_id >> 22) + MSG_ID_EPOCH_MS

    def cut(self, cluster: Cluster, topic: str, part: str, n: int) -> int:
        """The end of the first ``n`` messages (exact when the sample holds them,
        else the boundary the broker names at or before ``n`` mean sizes, never
        before the sample's last boundary), at most ``end``."""
        if n <= 0:
            return self.start
        if n < len(self.bounds):
            return min(self.bounds[n], self.end)
        mean = (self.bounds[-1] - self.start) / max(len(self.bounds) - 1, 1)
        target = self.start + int(n * mean)
        if target >= self.end:
            return self.end
        return min(max(cluster.nearest(topic, part, target), self.bounds[-1]), self.end)


def measure_backlog(cluster: Cluster, start: PartitionOffsets, latest: PartitionOffsets,
                    *, sample_bytes: int = SAMPLE_BYTES) -> dict[PartitionKey, Backlog]:
    """A :class:`Backlog` per partition with bytes waiting (one ``get`` each)."""
    out = {}
    for topic, parts in latest.items():
        for part, end in parts.items():
            a = start.get(topic, {}).get(part)
            if a is None:  # appeared since: read from its log start
                a = cluster.nearest(topic, part, 0)
            if end <= a:
                continue
            bounds, first_id = cluster.sample(topic, part, a, min(sample_bytes, end - a))
            out[PartitionKey(topic, part)] = Backlog(start=a, end=end, bounds=tuple(bounds),
                                         first_msg_id=first_id)
    return out


def cap_messages(cluster: Cluster, start: PartitionOffsets, latest: PartitionOffsets,
                 backlog: Mapping[PartitionKey, Backlog], max_messages: int
                 ) -> PartitionOffsets:
    """End offsets at most ``max_messages`` past ``start`` in total (Kafka's
    maxOffsetsPerTrigger), shared in proportion to each partition's waiting
    messages (rounded down); at least one message moves when any waits.  Exact
    where a partition's share lies within its sample, else estimated (see
    :class:`Backlog`)."""
    waiting = {key: b.messages for key, b in backlog.items()}
    total = sum(waiting.values())
    if total <= max_messages:
        return latest
    out = {t: dict(parts) for t, parts in latest.items()}
    for topic, parts in latest.items():
        for part in parts:
            b = backlog.get((topic, part))
            if b is not None:
                out[topic][part] = b.cut(cluster, topic, part,
                                         max_messages * waiting[(topic, part)] // total)
    if all(out[t][p] == b.start for (t, p), b in backlog.items()):
        (topic, part), b = max(backlog.items(), key=lambda kv: waiting[kv[0]])
        out[topic][part] = b.cut(cluster, topic, part, 1)
    return out


def progress_end_offsets(query: Any) -> PartitionOffsets:
    """topic -> partition -> end offset of every ``metaq`` source in a streaming query's
    ``lastProgress`` (or a progress mapping given directly); ``{}`` before any progress."""
    progress = query.lastProgress if not isinstance(query, Mapping) else query
    out: PartitionOffsets = {}
    for source in (progress or {}).get("sources", []):
        end = source.get("endOffset")
        if isinstance(end, str):
            try:
                end = json.loads(end)
            except ValueError:
                continue
        if isinstance(end, dict):
            for topic, parts in end.items():
                if isinstance(parts, dict) and all(isinstance(v, int) for v in parts.values()):
                    out.setdefault(topic, {}).update(parts)
    return out
