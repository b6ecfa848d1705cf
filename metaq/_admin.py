"""Operator views that join ZooKeeper's tree with the brokers' log ends.

``python -m zk_layout`` shows what ZooKeeper holds; these functions add what
only a broker knows (where each partition's log ends) and derive lag and a
state by Burrow's evaluator rules (github.com/linkedin/Burrow, "Consumer Lag
Evaluation Rules") over a window of two samples (``interval``):

- ``ok``: nothing to consume (lag 0), or the committed offset moved and the lag
  shrank over the window;
- ``warn``: the committed offset moved but the lag did not shrink (not catching up);
- ``stall``: the offset was committed within the window but did not move, lag > 0;
- ``stop``: no commit at all within the window (the offset node's mtime), lag > 0;
- ``rewind``: the committed offset went back;
- ``lagging``: lag > 0 with a single sample (Burrow's rules need a window);
- ours beside Burrow's: ``unowned`` (lag > 0 and no live member owns it; its ``note``
  says when it may be held for an away static member), ``damaged`` (garbage in its
  offset node), ``data lost`` (committed below the log start: retention deleted
  unread bytes), ``out of range`` (committed beyond the log end), ``over transfer
  cap`` (the message at the committed offset is bigger than its broker sends per
  get: a Java broker's ``maxTransferSize``; no consumer can read it), ``unknown``
  (the broker could not be asked).

:attr:`GroupReport.status` sums them up as Burrow does: ``error`` when any
partition is in stall, stop, rewind, data lost, damaged, out of range or over
transfer cap, ``warn``
when any is in warn, lagging or unowned, else ``ok``.  Lag is given in bytes and
in seconds: the age of the oldest unconsumed message, from its msgId time.

Members are listed with their state (:class:`MemberState`): ``live`` (static
ones with their instance id), or for a static member whose id node is gone
``hold_starting``, ``away`` (held until when) or ``hold_expired``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kazoo.client import KazooClient

from metaq._errors import BrokerError, BrokerUnavailableError, ConfigError, MetaqError
from metaq.net import BrokerConnection, header_at, offset_for_time
from zk_layout import (
    GroupInfo,
    GroupTopic,
    Layout,
    NodeDataError,
    StoredOffset,
    broker_address,
    decode_offset,
    encode_offset,
    partition_broker_id,
    read_partitions,
    take_snapshot,
)

__all__ = ["MemberState", "PartitionLag", "GroupReport", "describe_group", "evaluate_group",
           "lag_positions", "log_ends", "position_times", "reset_offsets", "times_to_offsets"]

log = logging.getLogger(__name__)
_LOG_END = 2**63 - 1
#: ``PartitionLag.note`` (and ``metaq topic describe``'s) of a partition a Java broker
#: has never written: it has no storage for it yet and answers 404; taken as empty
UNWRITTEN_NOTE = "empty: never written (its Java broker has no storage for it yet)"
#: ``PartitionLag.note`` of a partition nobody owns whose topic an away static member
#: subscribes to (which partitions it holds is its group's strategy's to say).
HELD_NOTE = "may be held for an away static member"


@dataclass(frozen=True, kw_only=True)
class PartitionLag:
    topic: str
    partition: str
    owner: str | None
    committed: int | None
    msg_id: int | None
    log_start: int | None
    log_end: int | None
    lag: int | None
    state: str
    lag_seconds: float | None = None
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class MemberState:
    """A member as ``group describe`` shows it: ``state`` is ``live``, ``hold_starting``,
    ``away`` or ``hold_expired``; ``text`` says it for people ("live, static (instance
    pod-1)", "away, held until 2026-11-25T21:14:03.120Z (in 12 s)", ...)."""

    consumer_id: str
    state: str
    text: str
    static: bool = False
    instance_id: str | None = None
    host: str | None = None
    topics: tuple[str, ...] = ()
    held_until_ms: int | None = None
    held_until: str | None = None


def member_states(info: GroupInfo) -> tuple[MemberState, ...]:
    """The live members (in Metaq's order), then the static members that are away."""
    statics = {s.consumer_id: s for s in info.static_members}
    out = [MemberState(consumer_id=m.consumer_id, state="live", text=m.state_text,
                       static=m.static, instance_id=m.instance_id,
                       host=(statics[m.consumer_id].host or None)
                       if m.consumer_id in statics else None, topics=m.topics)
           for m in info.members]
    out += [MemberState(consumer_id=s.consumer_id, state=s.state,
                        text=s.state_text(info.read_at_ms), static=True,
                        instance_id=s.instance_id, host=s.host or None, topics=s.topics,
                        held_until_ms=s.held_until_ms, held_until=s.held_until)
            for s in info.away_members]
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class GroupReport:
    group: str
    members: tuple[str, ...]
    partitions: tuple[PartitionLag, ...]
    member_states: tuple[MemberState, ...] = ()

    @property
    def status(self) -> str:
        """The group's status over its partitions' states (see the module docstring)."""
        states = {p.state for p in self.partitions}
        if states & {"stall", "stop", "rewind", "data lost", "damaged", "out of range",
                     "over transfer cap"}:
            return "error"
        if states & {"warn", "lagging", "unowned"}:
            return "warn"
        return "ok"

    @property
    def has_static(self) -> bool:
        return any(m.static for m in self.member_states)

    def as_json(self) -> dict[str, Any]:
        return {"group": self.group, "status": self.status, "members": list(self.members),
                "member_states": [asdict(m) for m in self.member_states],
                "partitions": [asdict(p) for p in self.partitions],
                "total_lag": sum(p.lag or 0 for p in self.partitions)}


def log_ends(client: KazooClient, layout: Layout, topic: str, *, group: str = "metaq-admin",
             timeout: float = 5.0, unwritten: set[str] | None = None
             ) -> dict[str, tuple[int | None, int | None]]:
    """partition -> (log start, log end), asked of each partition's broker; (None, None)
    where the broker did not answer, for that partition alone.

    A partition a Java broker has never written (it answers 404 "... is not exists")
    is empty, ``(0, 0)``, and is added to ``unwritten`` when given, for the caller to
    say so."""
    out: dict[str, tuple[int | None, int | None]] = {}
    by_broker: dict[int, list[str]] = {}
    for p in read_partitions(client, layout, topic):
        by_broker.setdefault(int(p.split("-", 1)[0]), []).append(p)
    for bid, parts in by_broker.items():
        address = broker_address(client, layout, bid)
        if address is None:
            out.update({p: (None, None) for p in parts})
            continue
        try:
            with BrokerConnection(*address, timeout=timeout) as conn:
                for p in parts:
                    index = int(p.split("-", 1)[1])
                    try:
                        out[p] = (conn.offset(topic, group, index, 0),
                                  conn.offset(topic, group, index, _LOG_END))
                    except BrokerError as e:  # this partition only; the others go on
                        log.warning("broker %d at %s:%s could not say where %s/%s ends: %s",
                                    bid, *address, topic, p, e)
                        out[p] = (None, None)
                    if unwritten is not None and (topic, index) in conn.unwritten:
                        unwritten.add(p)
        except BrokerUnavailableError as e:
            log.warning("broker %d at %s:%s did not answer: %s", bid, *address, e)
            out.update({p: (None, None) for p in parts if p not in out})
    return out


def log_damage(client: KazooClient, layout: Layout, topic: str, *,
               timeout: float = 5.0) -> dict[str, tuple[int, int] | None]:
    """partition -> (damaged ranges, damaged bytes) as its broker counts them (the
    ``stats offsets`` of a metaq-py broker); None where the broker does not say
    (unreachable, or a Java Metaq broker)."""
    out: dict[str, tuple[int, int] | None] = {}
    by_broker: dict[int, list[str]] = {}
    for p in read_partitions(client, layout, topic):
        by_broker.setdefault(int(p.split("-", 1)[0]), []).append(p)
    for bid, parts in by_broker.items():
        out.update({p: None for p in parts})
        address = broker_address(client, layout, bid)
        if address is None:
            continue
        try:
            with BrokerConnection(*address, timeout=timeout) as conn:
                text = conn.stats("offsets")
        except (BrokerUnavailableError, BrokerError) as e:
            log.warning("broker %d at %s:%s did not answer: %s", bid, *address, e)
            continue
        for line in text.splitlines():
            f = line.split()
            # STAT <topic> part <n> min_offset a max_offset b closed x damaged c damaged_bytes d
            if len(f) >= 14 and f[1] == topic and f[10] == "damaged" \
                    and f[12] == "damaged_bytes":
                name = f"{bid}-{f[3]}"
                if name in out:
                    try:
                        out[name] = (int(f[11]), int(f[13]))
                    except ValueError:
                        pass
    return out


def _sample(client: KazooClient, layout: Layout, group: str):
    snap = take_snapshot(client, layout)
    info = snap.group(group)
    if info is None:
        raise ConfigError(f"no consumer group {group!r} under {layout.root}")
    return info


def describe_group(client: KazooClient, layout: Layout, group: str, *, interval: float = 0.0,
                   timeout: float = 5.0) -> GroupReport:
    """Per partition: owner, committed offset and msgId, log end, lag in bytes and in
    seconds (the age of the oldest unconsumed message, from its msgId time), and state.

    With ``interval`` > 0 the group is sampled twice that far apart (the window) and
    each partition's state follows Burrow's rules (see the module docstring)."""
    topics_first: dict[str, dict[str, tuple[int | None, int | None]]] = {}
    first = _sample(client, layout, group)
    if interval > 0:
        topics_first = {gt.topic: log_ends(client, layout, gt.topic, timeout=timeout)
                        for gt in first.topics}
        time.sleep(interval)  # the sampling window itself, not synchronisation
        info = _sample(client, layout, group)
    else:
        info = first
    now = time.time()
    ends: dict[str, dict[str, tuple[int | None, int | None]]] = {}
    unwritten: dict[str, set[str]] = {}
    times: dict[str, dict[str, int]] = {}
    capped: dict[str, dict[str, tuple[int, int]]] = {}
    for gt in info.topics:
        unwritten[gt.topic] = set()
        ends[gt.topic] = log_ends(client, layout, gt.topic, timeout=timeout,
                                  unwritten=unwritten[gt.topic])
        capped[gt.topic] = {}
        times[gt.topic] = position_times(client, layout, gt.topic,
                                         lag_positions(gt, ends[gt.topic]), timeout=timeout,
                                         capped=capped[gt.topic])
    return evaluate_group(client, layout, info, ends=ends, times=times, unwritten=unwritten,
                          capped=capped, first=first if interval > 0 else None,
                          ends_first=topics_first, interval=interval, now=now)


def lag_positions(gt: GroupTopic, ends: Mapping[str, tuple[int | None, int | None]]
                  ) -> dict[str, int]:
    """partition -> position (committed offset, else the log start) of the partitions
    of ``gt`` that have something to consume: whose msgId time gives the lag in seconds."""
    out: dict[str, int] = {}
    for ps in gt.partitions:
        name = str(ps.partition)
        start, end = ends.get(name, (None, None))
        position = ps.offset.offset if ps.offset else (start or 0)
        if end is not None and end > position:
            out[name] = position
    return out


def evaluate_group(client: KazooClient, layout: Layout, info: GroupInfo, *,
                   ends: Mapping[str, Mapping[str, tuple[int | None, int | None]]],
                   times: Mapping[str, Mapping[str, int]],
                   unwritten: Mapping[str, Collection[str]] | None = None,
                   capped: Mapping[str, Mapping[str, tuple[int, int]]] | None = None,
                   first: GroupInfo | None = None,
                   ends_first: Mapping[str, Mapping[str, tuple[int | None, int | None]]]
                   | None = None,
                   interval: float = 0.0, now: float | None = None) -> GroupReport:
    """The report of :func:`describe_group` from what was already read: the group as
    read (``info``), per topic each partition's (log start, log end) (``ends``), the
    msgId time at each lagging position (``times``: see :func:`lag_positions`), the
    partitions never written and those over the transfer cap.  With ``first`` (the
    group read ``interval`` seconds earlier) and ``ends_first``, states follow
    Burrow's rules over that window; ``client`` is asked only then, for the mtime of
    an offset node that did not move.  No broker is asked: the dashboard calls this
    with the log ends it samples and a cached view of the tree."""
    now = time.time() if now is None else now
    before = {} if first is None else {(gt.topic, str(ps.partition)): ps.offset
                                       for gt in first.topics for ps in gt.partitions}
    rows: list[PartitionLag] = []
    held = info.held_topics
    for gt in info.topics:
        topic_ends = ends.get(gt.topic, {})
        topic_times = times.get(gt.topic, {})
        topic_unwritten = (unwritten or {}).get(gt.topic, ())
        topic_capped = (capped or {}).get(gt.topic, {})
        for ps in gt.partitions:
            name = str(ps.partition)
            start, end = topic_ends.get(name, (None, None))
            committed = ps.offset.offset if ps.offset else None
            position = committed if committed is not None else (start or 0)
            lag = None if end is None else max(0, end - position)
            msg_id = ps.offset.msg_id if ps.offset else None
            t = topic_times.get(name)
            lag_seconds = (0.0 if lag == 0 else None if t is None or lag is None
                           else round(max(0.0, now - t / 1000), 3))
            prev = before.get((gt.topic, name))
            if ps.errors and committed is None:
                state = "damaged"  # garbage in its offset node (see the errors column)
            elif committed is not None and end is not None and committed > end:
                state = "out of range"  # beyond the log end: nothing can be delivered
                lag = lag_seconds = None
            elif committed is not None and start is not None and committed < start:
                state = "data lost"  # below the log start: retention deleted unread bytes
            elif lag is None:
                state = "unknown"
            elif name in topic_capped:
                state = "over transfer cap"  # its broker never sends the message whole
            elif lag == 0:
                state = "ok"
            elif ps.owner is None:
                state = "unowned"
            elif interval <= 0 or prev is None or committed is None:
                state = "lagging"  # one sample: Burrow's rules need a window (--interval)
            else:
                state = _burrow(client, layout, info.group, gt.topic, name, prev.offset,
                                committed,
                                (ends_first or {}).get(gt.topic, {}).get(name, (None, None))[1],
                                end, lag, interval, now)
            rows.append(PartitionLag(topic=gt.topic, partition=name, owner=ps.owner,
                                     committed=committed, msg_id=msg_id, log_start=start,
                                     log_end=end, lag=lag, lag_seconds=lag_seconds,
                                     state=state,
                                     note=HELD_NOTE if ps.owner is None and gt.topic in held
                                     else UNWRITTEN_NOTE if name in topic_unwritten
                                     else _cap_note(*topic_capped[name])
                                     if name in topic_capped else None))
    return GroupReport(group=info.group, members=tuple(m.consumer_id for m in info.members),
                       partitions=tuple(rows), member_states=member_states(info))


def _cap_note(size: int, sent: int) -> str:
    return (f"the message at the committed offset is {size} bytes; its broker sends at most "
            f"{sent} per get (Java's maxTransferSize): raise it above {size}")


def _burrow(client: KazooClient, layout: Layout, group: str, topic: str, part: str,
            first: int, last: int, end_first: int | None, end: int, lag: int,
            window: float, now: float) -> str:
    """A lagging partition's state over the window, by Burrow's evaluator rules."""
    if last < first:
        return "rewind"  # the committed offset went back
    if last == first:
        stat = client.exists(layout.offset(group, topic, part))
        written = None if stat is None else stat.mtime / 1000
        if written is None or now - written > window:
            return "stop"  # no commit at all within the window
        return "stall"  # committing, but the same offset
    lag_first = None if end_first is None else max(0, end_first - first)
    if lag_first is not None and lag >= lag_first:
        return "warn"  # moving, but not catching up
    return "ok"  # moving and catching up


def position_times(client: KazooClient, layout: Layout, topic: str, positions: dict[str, int],
                   *, group: str = "metaq-admin", timeout: float = 5.0,
                   capped: dict[str, tuple[int, int]] | None = None) -> dict[str, int]:
    """partition -> msgId time (epoch ms) of the message at its position, for those of
    ``positions`` whose broker answered and holds a message there.  With ``capped``,
    also fills it with the partitions whose message there is bigger than its broker
    sends per get (``(message size, bytes sent)``): stuck for every consumer."""
    out: dict[str, int] = {}
    by_broker: dict[int, list[str]] = {}
    for p in positions:
        by_broker.setdefault(partition_broker_id(p), []).append(p)
    for bid, parts in by_broker.items():
        address = broker_address(client, layout, bid)
        if address is None:
            continue
        try:
            with BrokerConnection(*address, timeout=timeout) as conn:
                for p in parts:
                    index = int(p.split("-", 1)[1])
                    head = header_at(conn, topic, index, positions[p], group=group)
                    if head is not None:
                        out[p], need = head
                        if capped is not None and need > _CAP_CHECK_FROM:
                            sent = len(conn.get(topic, group, index, positions[p], need))
                            if sent < need:  # the broker never sends it whole
                                capped[p] = (need, sent)
        except (BrokerUnavailableError, BrokerError) as e:
            log.warning("broker %d at %s:%s did not answer: %s", bid, *address, e)
    return out


#: A message at a position smaller than this is never checked against the broker's
#: transfer cap (a Java broker's is 1 MiB unless set lower); a bigger one is asked for
#: whole once, and when less comes back no consumer can ever read it.
_CAP_CHECK_FROM = 64 * 1024


def reset_offsets(client: KazooClient, layout: Layout, group: str, topic: str, *,
                  to: str | int | tuple[str, int], timeout: float = 5.0,
                  dry_run: bool = False, partitions: Iterable[str] | None = None
                  ) -> dict[str, tuple[int | None, int]]:
    """Set every partition's committed offset to ``earliest``, ``latest``, an offset,
    or ``("time", epoch_ms)``: the first message at or after that time, found by a
    search over each partition's log by msgId time (Java Metaq brokers too).

    Returns partition -> (committed offset before, or None, new offset); with
    ``dry_run`` nothing is written.  ``partitions`` (names such as ``"0-3"``) limits it
    to those (the dashboard's "skip a partition's pending messages": ``to="latest"``).
    Refused while the group has live members: a running member would overwrite the
    reset with its own progress at its next commit.
    """
    members = client.get_children(layout.consumer_ids(group)) if client.exists(
        layout.consumer_ids(group)) else []
    if members and not dry_run:
        raise ConfigError(f"group {group!r} has {len(members)} live member(s) "
                          f"({', '.join(sorted(members))}); stop them before resetting offsets")
    if not (to in ("earliest", "latest") or (isinstance(to, int) and not isinstance(to, bool)
                                              and to >= 0)
            or (isinstance(to, tuple) and len(to) == 2 and to[0] == "time")):
        raise ConfigError(f"reset target must be earliest, latest, an offset >= 0 or a "
                          f"time, got {to!r}")
    if isinstance(to, tuple):
        new = times_to_offsets(client, layout, topic, to[1], timeout=timeout)
    else:
        ends = log_ends(client, layout, topic, timeout=timeout)
        new = {part: (start if to == "earliest" else end if to == "latest" else to)
               for part, (start, end) in ends.items()}
    if not new:
        raise ConfigError(f"topic {topic!r} has no partitions in ZooKeeper")
    if partitions is not None:
        wanted = set(partitions)
        if not wanted or wanted - set(new):
            raise ConfigError(f"topic {topic!r} has no partition(s) "
                              f"{sorted(wanted - set(new)) or '(none given)'}; "
                              f"it has {sorted(new)}")
        new = {part: value for part, value in new.items() if part in wanted}
    out: dict[str, tuple[int | None, int]] = {}
    for part, value in sorted(new.items()):
        if value is None:
            raise MetaqError(f"broker of {topic}/{part} did not answer; nothing was reset")
        path = layout.offset(group, topic, part)
        old = None
        if client.exists(path):
            try:
                old = decode_offset(client.get(path)[0], path).offset
            except NodeDataError:
                old = None  # garbage: replaced
        out[part] = (old, value)
    if dry_run:
        return out
    for part, (_, value) in out.items():
        path = layout.offset(group, topic, part)
        data = encode_offset(StoredOffset(offset=value, msg_id=-1))
        if client.exists(path):
            client.set(path, data)
        else:
            client.create(path, data, makepath=True)
    return out


def times_to_offsets(client: KazooClient, layout: Layout, topic: str, when_ms: int, *,
                     group: str = "metaq-admin", timeout: float = 5.0) -> dict[str, int | None]:
    """partition -> offset of its first message at or after ``when_ms`` (the log end
    when none is), asked of each partition's broker; None where it did not answer."""
    out: dict[str, int | None] = {}
    by_broker: dict[int, list[str]] = {}
    for p in read_partitions(client, layout, topic):
        by_broker.setdefault(partition_broker_id(p), []).append(p)
    for bid, parts in by_broker.items():
        address = broker_address(client, layout, bid)
        if address is None:
            out.update({p: None for p in parts})
            continue
        try:
            with BrokerConnection(*address, timeout=timeout) as conn:
                for p in parts:
                    out[p] = offset_for_time(conn, topic, int(p.split("-", 1)[1]), when_ms,
                                             group=group).offset
        except (BrokerUnavailableError, BrokerError) as e:
            log.warning("broker %d at %s:%s did not answer: %s", bid, *address, e)
            out.update({p: None for p in parts if p not in out})
    return out
