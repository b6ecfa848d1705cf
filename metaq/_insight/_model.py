"""A consumer group as its members plan it, rebuilt from a zk_layout Snapshot (pure).

Every member of a group computes its share from the same inputs (see
``metaq.consumer``'s ``_plan``): per topic, the live members subscribed to it
(their id nodes' data) plus the away static members still held for (a record
in ``consumers/<group>/static`` whose id node is gone and whose grace has not
ended: states ``away`` and ``hold_starting``), the topic's partitions as
``topics-sub`` lists them, and, for ``sticky``, the current owners.
:func:`group_model` reads exactly those out of a :class:`~zk_layout.Snapshot`;
:func:`assignment` runs a strategy over them the way the members do, so the
result is what the group computes.

The strategy a group runs is not written in ZooKeeper (each member has it in its
config).  :func:`infer_strategy` names the strategies whose plan is exactly the
current ownership: for a settled group that is the one it runs (or several that
happen to agree, ``default`` first when it is among them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from metaq._errors import ConfigError
from metaq.consumer import STRATEGIES, Strategy, get_strategy
from zk_layout import Snapshot, sort_consumer_ids

__all__ = ["GroupModel", "group_model", "assignment", "infer_strategy", "strategy_of",
           "STRATEGY_ORDER"]

#: The order :func:`infer_strategy` tries strategies in: Metaq's default first, the
#: strategies that read nothing but ids next, ``sticky`` (which agrees with whatever
#: the owners are once balanced) last.
STRATEGY_ORDER = ("default", "consist", "roundrobin", "cooperative", "sticky")

#: Static member states whose partitions the group still holds (counted as members).
HELD_STATES = frozenset({"away", "hold_starting"})


@dataclass(frozen=True, kw_only=True)
class GroupModel:
    """What a group's members plan from, as a snapshot shows it."""

    group: str
    #: live members (an id node), in Java's string order
    live: tuple[str, ...] = ()
    #: away static members whose partitions are held for them, in Java's string order
    held: tuple[str, ...] = ()
    #: member (live or held) -> the topics it subscribes to
    topics_of: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: topic -> its partitions (as topics-sub lists them, Metaq's order)
    partitions: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: topic -> partition -> owner consumer id (owner nodes that decode)
    owners: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    @property
    def members(self) -> tuple[str, ...]:
        """Every member the plan counts: live and held, Java-sorted."""
        return tuple(sort_consumer_ids(set(self.live) | set(self.held)))

    @property
    def topics(self) -> tuple[str, ...]:
        """Every topic a member subscribes to or the group has owner nodes for."""
        return tuple(sorted({t for ts in self.topics_of.values() for t in ts}
                            | set(self.owners)))

    def current(self) -> dict[str, dict[str, list[str]]]:
        """topic -> owner -> partitions, as the owner nodes say now."""
        out: dict[str, dict[str, list[str]]] = {}
        for topic, owners in self.owners.items():
            per = out.setdefault(topic, {})
            for part in self.partitions.get(topic, ()):
                if part in owners:
                    per.setdefault(owners[part], []).append(part)
            # owner nodes of partitions the topic no longer lists, after the listed ones
            for part, owner in sorted(owners.items()):
                if part not in self.partitions.get(topic, ()):
                    per.setdefault(owner, []).append(part)
        return out


def group_model(snapshot: Snapshot, group: str) -> GroupModel:
    """The group's planning inputs; :class:`metaq.ConfigError` when the snapshot has
    no such group.  Member id nodes holding garbage count as subscribing to nothing
    (the members skip them too)."""
    info = snapshot.group(group)
    if info is None:
        raise ConfigError(f"no consumer group {group!r} under {snapshot.root}")
    topics_of: dict[str, tuple[str, ...]] = {m.consumer_id: tuple(m.topics)
                                             for m in info.members}
    held = []
    for s in info.static_members:
        if s.state in HELD_STATES and s.consumer_id not in topics_of:
            held.append(s.consumer_id)
            topics_of[s.consumer_id] = tuple(s.topics)
    owners: dict[str, dict[str, str]] = {}
    for gt in info.topics:
        per = {str(ps.partition): ps.owner for ps in gt.partitions if ps.owner is not None}
        if per:
            owners[gt.topic] = per
    wanted = {t for ts in topics_of.values() for t in ts} | set(owners)
    partitions = {}
    for topic in wanted:
        ti = snapshot.topic(topic)
        partitions[topic] = tuple(str(p) for p in ti.partitions) if ti else ()
    return GroupModel(group=group, live=tuple(m.consumer_id for m in info.members),
                      held=tuple(sort_consumer_ids(held)), topics_of=topics_of,
                      partitions=partitions, owners=owners)


def strategy_of(strategy: str | Strategy) -> Strategy:
    """A strategy by name (:class:`metaq.ConfigError` naming the known ones) or as given."""
    return strategy if isinstance(strategy, Strategy) else get_strategy(strategy)


def assignment(model: GroupModel, strategy: str | Strategy, *,
               topics_of: Mapping[str, Iterable[str]] | None = None,
               previous: Mapping[str, Mapping[str, str]] | None = None
               ) -> dict[str, dict[str, list[str]]]:
    """topic -> member -> partitions: the plan every member computes under
    ``strategy`` when the members (live and held) and their topics are ``topics_of``
    (default: the model's) and the owners are ``previous`` (default: the model's;
    only ``sticky`` reads them).  Every member of ``topics_of`` appears under each
    topic it subscribes to, with an empty list when it gets nothing."""
    strat = strategy_of(strategy)
    topics_of = model.topics_of if topics_of is None else topics_of
    previous = model.owners if previous is None else previous
    subscribers: dict[str, list[str]] = {}
    for member, topics in topics_of.items():
        for t in topics:
            subscribers.setdefault(t, []).append(member)
    out: dict[str, dict[str, list[str]]] = {}
    for topic in sorted(subscribers):
        parts = model.partitions.get(topic, ())
        out[topic] = strat.assign_all(subscribers[topic], list(parts),
                                      previous=dict(previous.get(topic, {})) or None)
    return out


def _owned(plan: Mapping[str, Mapping[str, list[str]]]) -> dict[str, dict[str, str]]:
    return {t: {p: m for m, ps in per.items() for p in ps} for t, per in plan.items()}


def infer_strategy(model: GroupModel) -> tuple[str, ...]:
    """The strategies (names, in :data:`STRATEGY_ORDER`) whose plan is exactly the
    current ownership: every partition owned by the member the strategy gives it,
    and nothing else owned.  Empty when none is (a group mid-rebalance, partitions
    unowned, or a fault the audit names); every strategy for a group with no
    partitions."""
    actual = {t: dict(o) for t, o in model.owners.items() if o}
    out = []
    for name in STRATEGY_ORDER:
        if name not in STRATEGIES:
            continue
        planned = {t: o for t, o in _owned(assignment(model, name)).items() if o}
        if planned == actual:
            out.append(name)
    return tuple(out)
