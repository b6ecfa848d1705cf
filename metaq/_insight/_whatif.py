"""What-if: the assignment a group would compute after members join or leave, or
after it switched strategy (pure: a Snapshot in, a :class:`WhatIf` out).

:func:`what_if` rebuilds the group's planning inputs (``_model``), changes them
as asked, and runs the strategy as every member would.  Nothing is written.

**Hypothetical members' ids.**  Where a member lands in a plan is its consumer
id's place in Java's string order.  A member configured with a ``consumer_id``
(or a static ``instance_id``) is ``<group>_<that id>``: pass it in ``add_ids`` to
get its exact place.  A member without one gets, in Java Metaq 1.4 and in
metaq-py alike, ``<group>_<ip>-<pid>-<uuid>`` (``ConsumerZooKeeper.getConsumerUUID``:
``RemotingUtils.getLocalHost() + "-" + pid + "-" + UUID.randomUUID()``; no time in
it), so it lands among the members of its host, at a place its pid (compared as a
string) decides and nobody knows before it starts.  ``add=N`` names the
hypothetical ones ``<group>_<host>-whatif-<k>`` (:func:`hypothetical_ids`):
after every other member of that host whose id is the default form (a digit
follows ``<host>-`` there; ``w`` sorts after digits), before any member whose id
sorts after the host's.  For ``default`` and ``roundrobin`` that is exact when
the new member's pid sorts after the others' on its host (pids grow, and
usually keep their digit count), or when it is the only member there; for
``consist`` and ``cooperative`` the id itself places it on a hash ring, so only
``add_ids`` with the real id is exact, and ``add=N`` shows the kind of change
(how many partitions move, the loads).

**Leaving.**  ``remove`` takes members as leaving for good.  A static member that
goes away without leaving for good (``close(leave=False)``, a crash) keeps its
partitions held for its grace, and nothing moves until then; the result's
``notes`` say so for each removed static member.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metaq._errors import ConfigError
from metaq._insight._model import (
    GroupModel,
    assignment,
    group_model,
    infer_strategy,
    strategy_of,
)
from metaq.consumer import Strategy
from zk_layout import Snapshot, check_consumer_id, sort_consumer_ids

__all__ = ["WhatIf", "Move", "what_if", "hypothetical_ids"]


@dataclass(frozen=True, kw_only=True)
class Move:
    """One partition changing owner (``from_owner`` None: nobody owned it)."""

    topic: str
    partition: str
    from_owner: str | None
    to_owner: str | None

    def to_json(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "from": self.from_owner,
                "to": self.to_owner}


@dataclass(frozen=True, kw_only=True)
class WhatIf:
    """The group now and after the change.

    ``current``: topic -> member -> partitions as the owner nodes say;
    ``planned``: the same under the strategy before the change (what the group
    should hold now: equal to ``current`` once settled); ``new``: after the change.
    ``moves``: every partition whose owner in ``new`` differs from its owner now.
    ``load``: member -> partitions in ``new`` (over all topics), every member
    listed, 0 included.
    """

    group: str
    strategy: str
    #: the strategies that explain the current ownership (see ``infer_strategy``)
    current_strategies: tuple[str, ...]
    members: tuple[str, ...]
    new_members: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]
    current: Mapping[str, Mapping[str, list[str]]]
    planned: Mapping[str, Mapping[str, list[str]]]
    new: Mapping[str, Mapping[str, list[str]]]
    moves: tuple[Move, ...]
    load: Mapping[str, int]
    notes: tuple[str, ...] = field(default=())

    @property
    def moved(self) -> int:
        """How many partitions change owner."""
        return len(self.moves)

    @property
    def partitions(self) -> int:
        return sum(len(ps) for per in self.new.values() for ps in per.values())

    def to_json(self) -> dict[str, Any]:
        """Stable field names: ``group, strategy, current_strategies, members,
        new_members, added, removed, current, planned, new, moves, moved, load,
        partitions, notes``."""
        return {"group": self.group, "strategy": self.strategy,
                "current_strategies": list(self.current_strategies),
                "members": list(self.members), "new_members": list(self.new_members),
                "added": list(self.added), "removed": list(self.removed),
                "current": _plain(self.current), "planned": _plain(self.planned),
                "new": _plain(self.new), "moves": [m.to_json() for m in self.moves],
                "moved": self.moved, "load": dict(self.load), "partitions": self.partitions,
                "notes": list(self.notes)}


def _plain(plan: Mapping[str, Mapping[str, list[str]]]) -> dict[str, dict[str, list[str]]]:
    return {t: {m: list(ps) for m, ps in per.items()} for t, per in plan.items()}


def hypothetical_ids(group: str, n: int, *, host: str, taken: Iterable[str] = ()) -> list[str]:
    """``n`` ids ``<group>_<host>-whatif-<k>`` (k from 1, skipping taken ones) for
    members that would start on ``host`` without a configured id (module docstring).

    >>> hypothetical_ids("g", 2, host="10.0.0.5")
    ['g_10.0.0.5-whatif-1', 'g_10.0.0.5-whatif-2']
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"the number of members to add must be an integer >= 0, got {n!r}")
    taken = set(taken)
    out: list[str] = []
    k = 0
    while len(out) < n:
        k += 1
        cid = f"{group}_{host}-whatif-{k}"
        if cid not in taken:
            out.append(check_consumer_id(cid))
    return out


def _resolve(model: GroupModel, name: str) -> str:
    """A member named by its consumer id or by the part after ``<group>_``."""
    for cand in (name, f"{model.group}_{name}"):
        if cand in model.topics_of:
            return cand
    known = ", ".join(model.members) or "none"
    raise ConfigError(f"group {model.group!r} has no member {name!r} (members: {known})")


def what_if(snapshot: Snapshot, group: str, *, add: int = 0, add_ids: Iterable[str] = (),
            remove: Iterable[str] = (), strategy: str | Strategy | None = None,
            host: str = "127.0.0.1", topics: Iterable[str] | None = None) -> WhatIf:
    """The assignment ``group`` would compute after ``remove`` (consumer ids, or the
    part after ``<group>_``) left for good and ``add`` unnamed members (started on
    ``host``, named by :func:`hypothetical_ids`) plus the members ``add_ids``
    joined, under ``strategy`` (default: the one that explains the current
    ownership, :func:`infer_strategy`, else Metaq's ``default``).  Added members
    subscribe to ``topics`` (default: every topic the group's members subscribe to).

    Raises :class:`metaq.ConfigError` for an unknown group, member or strategy, or
    an added id already in the group.
    """
    model = group_model(snapshot, group)
    inferred = infer_strategy(model)
    notes: list[str] = []
    if strategy is None:
        if inferred:
            name = inferred[0]
        else:
            name = "default"
            if model.owners:
                notes.append("no strategy explains the current owners (a rebalance under "
                             "way, or a fault: see describe --audit); assumed default")
        strat = strategy_of(name)
    else:
        strat = strategy_of(strategy)
    removed = tuple(dict.fromkeys(_resolve(model, r) for r in remove))
    statics = set(model.held)
    info = snapshot.group(group)
    if info is not None:
        statics |= {m.consumer_id for m in info.members if m.static}
    for r in removed:
        if r in statics:
            notes.append(f"{r} is a static member: this is the plan once it leaves for good "
                         f"(close with leave=True, or its grace ends); until then its "
                         f"partitions stay held for it and nothing moves")
    all_topics = tuple(sorted({t for ts in model.topics_of.values() for t in ts}))
    new_topics = tuple(all_topics if topics is None else dict.fromkeys(topics))
    named = []
    for cid in add_ids:
        cid = check_consumer_id(cid)
        if cid in model.topics_of and cid not in removed:
            raise ConfigError(f"{cid} is already a member of group {group!r}")
        named.append(cid)
    taken = set(model.topics_of) | set(named)
    added = tuple(dict.fromkeys([*named, *hypothetical_ids(group, add, host=host,
                                                            taken=taken)]))
    topics_of = {m: ts for m, ts in model.topics_of.items() if m not in removed}
    topics_of.update({m: new_topics for m in added})
    if not new_topics and added:
        notes.append("the group subscribes to no topic: added members get nothing")
    planned = assignment(model, strat)
    new = assignment(model, strat, topics_of=topics_of)
    if strategy is None and len(inferred) > 1:
        differ = [n for n in inferred[1:]
                  if assignment(model, n, topics_of=topics_of) != new]
        if differ:
            notes.append(f"the current owners fit {', '.join(inferred)}, which plan this "
                         f"change differently ({', '.join(differ)} unlike {strat.name}); "
                         f"planned with {strat.name}: name the group's strategy to be sure")
    current = model.current()
    moves = []
    for topic in sorted(set(new) | set(current)):
        now = {p: m for m, ps in current.get(topic, {}).items() for p in ps}
        after = {p: m for m, ps in new.get(topic, {}).items() for p in ps}
        for part in model.partitions.get(topic, ()):
            if now.get(part) != after.get(part):
                moves.append(Move(topic=topic, partition=part, from_owner=now.get(part),
                                  to_owner=after.get(part)))
    new_members = tuple(sort_consumer_ids(topics_of))
    load = {m: 0 for m in new_members}
    for per in new.values():
        for m, ps in per.items():
            load[m] = load.get(m, 0) + len(ps)
    return WhatIf(group=group, strategy=strat.name, current_strategies=inferred,
                  members=model.members, new_members=new_members, added=added,
                  removed=removed, current=current, planned=planned, new=new,
                  moves=tuple(moves), load=load, notes=tuple(notes))
