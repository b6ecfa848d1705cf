"""Commit timing: the periodic commit of the owned partitions' offsets.

:class:`Committer` holds the commit timer (every ``commit_period``, or at once when
the user asks), the count of its ticks, and the commit of one partition: only a
position that moved is written, except every :data:`REWRITE_EVERY`-th tick, when
every owned offset is written again, so an offset node damaged under an owner
(garbage written while the partition sat idle) is repaired within that many
periods.  A commit the store refuses because the ownership moved
(:class:`~metaq.consumer._offsets.StaleOwnershipError`) asks for a rebalance.
The coordinator thread runs it; the offset store fences each write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from metaq.consumer._lifecycle import Lifecycle
from metaq.consumer._offsets import OffsetStore, StaleOwnershipError
from metaq.consumer._subscription import PartitionState, SubscriptionState

__all__ = ["Committer", "REWRITE_EVERY"]

log = logging.getLogger(__name__)

#: Every this many commit periods, every owned offset is written even if unchanged.
REWRITE_EVERY = 10


class Committer:
    """The commit timer and its ticks, and committing the owned partitions."""

    def __init__(self, store: OffsetStore, subscriptions: SubscriptionState, period: float,
                 *, life: Lifecycle, on_stale: Callable[[], None]) -> None:
        self._store = store
        self._subs = subscriptions
        self._period = period
        self._life = life
        self._on_stale = on_stale
        #: when the timer next expires (time.monotonic); 0.0: asked for now
        self.next_at = time.monotonic() + period
        #: ticks run so far (connected ones: a tick while disconnected is skipped)
        self.ticks = 0

    def request(self) -> None:
        """Commit at the coordinator's next turn (the caller wakes it)."""
        self.next_at = 0.0

    def expired(self, now: float) -> bool:
        """True once per period: the timer expired, and is set again."""
        if now < self.next_at:
            return False
        self.next_at = time.monotonic() + self._period
        return True

    def tick(self) -> None:
        """One period's commit: the changed offsets, or all of them every
        REWRITE_EVERY-th tick."""
        self.ticks += 1
        self.commit_all(force=self.ticks % REWRITE_EVERY == 0)

    def commit_all(self, force: bool = False) -> None:
        for pf in self._subs.assigned():
            self.commit(pf, force)

    def commit(self, pf: PartitionState, force: bool = False) -> None:
        """Write ``pf``'s position if it moved since its last commit (or ``force``)."""
        now = pf.commit_position()
        if (now == pf.committed and not force) or now[1] < 0:
            return
        try:
            self._store.commit(pf.topic, pf.partition, now[0], now[1], pf.ownership)
        except StaleOwnershipError as e:
            log.warning("%s: %s", self._life.label, e)
            self._on_stale()
            return
        pf.mark_committed(now)
