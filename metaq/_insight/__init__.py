"""Insight into a consumer group: what-if assignment, ownership audit, capacity hint.

Pure functions over a zk_layout :class:`~zk_layout.Snapshot` (and, where the
brokers matter, their answers read by :func:`read_logs`), each returning frozen
results with ``to_json()``; ``metaq group what-if`` / ``describe --audit`` /
``describe --catch-up`` and the dashboard call them.  Nothing here writes to
ZooKeeper.

One concept per module:

===============  ===========================================================
``_model``       GroupModel: what the members plan from, as a snapshot shows
                 it; the plan a strategy gives; which strategies explain the
                 current owners
``_whatif``      :func:`what_if`: the assignment after members join or leave
                 or the strategy changes; hypothetical members' ids
``_logs``        :func:`read_logs`: log bounds and message boundaries of the
                 committed offsets, asked of the brokers
``_audit``       :func:`audit`: the ownership and offset faults, as Findings
``_capacity``    :func:`capacity`: catch-up time and members needed, from two
                 Readings
===============  ===========================================================
"""

from metaq._insight._audit import KINDS, Finding, audit
from metaq._insight._capacity import (
    ASSUMPTIONS,
    CapacityHint,
    PartitionReading,
    Reading,
    capacity,
    reading,
    take_reading,
)
from metaq._insight._logs import LogState, read_logs
from metaq._insight._model import GroupModel, assignment, group_model, infer_strategy
from metaq._insight._whatif import Move, WhatIf, hypothetical_ids, what_if

__all__ = [
    "what_if", "WhatIf", "Move", "hypothetical_ids",
    "audit", "Finding", "KINDS",
    "read_logs", "LogState",
    "capacity", "CapacityHint", "Reading", "PartitionReading", "reading", "take_reading",
    "ASSUMPTIONS",
    "GroupModel", "group_model", "assignment", "infer_strategy",
]
