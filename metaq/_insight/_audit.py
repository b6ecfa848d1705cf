"""Ownership audit: what is wrong with a group's owner and offset nodes (pure).

:func:`audit` compares a snapshot of a group with the plan its strategy gives
(``_model``) and, when given the brokers' answers (``_logs.read_logs``), with
the logs.  Each fault is a :class:`Finding`; kinds (:data:`KINDS`):

``unowned``
    a partition the plan gives to a live member has no owner node (one the plan
    gives to an away static member is held for it: not a finding);
``owner_gone``
    an owner node names a consumer id that has no id node (the member is gone but
    its claim is not);
``misplaced``
    a live member owns a partition its strategy would give another member (or
    nobody);
``damaged``
    a node of the group holds garbage (owner, offset, member id or static record);
``offset_beyond_end``
    the committed offset is past the log end: nothing can be delivered from it;
``offset_below_start``
    the committed offset is below the log start: retention deleted unread bytes;
``offset_not_on_boundary``
    the committed offset is inside a message (no message starts there);
``broker_unreachable``
    the partition's broker did not answer (or is not registered): its offsets could
    not be checked.

The strategy compared with is the one given, else the one that explains the
current ownership, else Metaq's ``default`` (a finding's detail says which).  A
group mid-rebalance shows ``unowned`` and ``misplaced`` partitions that settle by
themselves; run the audit again to tell.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from metaq._insight._logs import LogState
from metaq._insight._model import assignment, group_model, infer_strategy, strategy_of
from metaq._types import PartitionKey
from metaq.consumer import Strategy
from zk_layout import Snapshot

__all__ = ["Finding", "KINDS", "audit"]

#: Every kind of finding, in the order findings are listed.
KINDS = ("damaged", "owner_gone", "unowned", "misplaced", "broker_unreachable",
         "offset_beyond_end", "offset_below_start", "offset_not_on_boundary")


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One fault: ``kind`` (:data:`KINDS`), where (``topic`` and ``partition``, None for
    a group-wide one), the member concerned if any, and ``detail`` for people."""

    kind: str
    topic: str | None
    partition: str | None
    detail: str
    member: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "topic": self.topic, "partition": self.partition,
                "member": self.member, "detail": self.detail}


def audit(snapshot: Snapshot, group: str, *,
          logs: Mapping[PartitionKey, LogState] | Mapping[tuple[str, str], LogState] | None
          = None, strategy: str | Strategy | None = None) -> list[Finding]:
    """The group's faults (module docstring), ordered by kind, topic and partition.
    Without ``logs`` the offsets are not checked against the brokers.
    :class:`metaq.ConfigError` for an unknown group or strategy."""
    model = group_model(snapshot, group)
    info = snapshot.group(group)
    assert info is not None
    out: list[Finding] = []
    if strategy is not None:
        strat, why = strategy_of(strategy), "given"
    else:
        inferred = infer_strategy(model)
        strat = strategy_of(inferred[0] if inferred else "default")
        why = "it explains the current owners" if inferred else \
            "no strategy explains the current owners; Metaq's default assumed"
    plan = assignment(model, strat)
    planned = {t: {p: m for m, ps in per.items() for p in ps} for t, per in plan.items()}
    live = set(model.live)
    held = set(model.held)

    partition_paths = set()
    for gt in info.topics:
        for ps in gt.partitions:
            part = str(ps.partition)
            for err in ps.errors:
                out.append(Finding(kind="damaged", topic=gt.topic, partition=part,
                                   detail=err))
            partition_paths.add((gt.topic, part))
    for d in info.damaged:
        if not any(d.path.endswith(f"/{t}/{p}") for t, p in partition_paths):
            out.append(Finding(kind="damaged", topic=None, partition=None,
                               detail=f"{d.path}: {d.error}"))

    for topic in model.topics:
        ti = snapshot.topic(topic)
        for d in ti.damaged if ti is not None else ():
            out.append(Finding(kind="damaged", topic=topic, partition=None,
                               detail=f"{d.path}: {d.error}"))

    for gt in info.topics:
        listed = set(model.partitions.get(gt.topic, ()))
        want = planned.get(gt.topic, {})
        for ps in gt.partitions:
            part, owner = str(ps.partition), ps.owner
            target = want.get(part)
            if owner is not None and owner not in live:
                out.append(Finding(kind="owner_gone", topic=gt.topic, partition=part,
                                   member=owner,
                                   detail=f"owned by {owner}, which has no id node in the "
                                          f"group"))
            elif owner is None and target is not None and target in live \
                    and not ps.errors:
                out.append(Finding(kind="unowned", topic=gt.topic, partition=part,
                                   member=target,
                                   detail=f"no owner node; {strat.name} gives it to "
                                          f"{target}"))
            elif owner is not None and owner != target:
                to = f"gives it to {target}" if target else (
                    "gives it to nobody" + ("" if part in listed else
                                            " (the topic no longer lists it)"))
                held_note = " (held for that away static member)" if target in held else ""
                out.append(Finding(kind="misplaced", topic=gt.topic, partition=part,
                                   member=owner,
                                   detail=f"owned by {owner}; {strat.name} ({why}) {to}"
                                          f"{held_note}"))

    if logs is not None:
        for gt in info.topics:
            for ps in gt.partitions:
                part = str(ps.partition)
                state = logs.get(PartitionKey(gt.topic, part))  # type: ignore[call-overload]
                if state is None:
                    continue
                c = ps.offset.offset if ps.offset is not None else None
                if state.error is not None:
                    out.append(Finding(kind="broker_unreachable", topic=gt.topic,
                                       partition=part,
                                       detail=state.error + (
                                           f"; committed offset {c} not checked"
                                           if c is not None else "")))
                    continue
                if c is None or state.log_end is None or state.log_start is None:
                    continue
                if c > state.log_end:
                    out.append(Finding(kind="offset_beyond_end", topic=gt.topic,
                                       partition=part,
                                       detail=f"committed {c} > log end {state.log_end}"))
                elif c < state.log_start:
                    out.append(Finding(kind="offset_below_start", topic=gt.topic,
                                       partition=part,
                                       detail=f"committed {c} < log start {state.log_start} "
                                              f"({state.log_start - c} unread bytes deleted)"))
                elif state.on_boundary is False:
                    out.append(Finding(kind="offset_not_on_boundary", topic=gt.topic,
                                       partition=part,
                                       detail=f"committed {c} is inside a message (no "
                                              f"message starts there)"))
    order = {k: i for i, k in enumerate(KINDS)}
    out.sort(key=lambda f: (order[f.kind], f.topic or "", f.partition or ""))
    return out
