"""Retry timing: a capped exponential backoff with jitter, one object per thing retried.

The coordinator keeps one for a failed ZooKeeper step of a rebalance, one for
unexpected failures in a row (the rejoin), and one per claim waiting for a
partition's old owner.  Each counts its own attempts and holds its own next
time, so no loose timer or counter is left beside it.
"""

from __future__ import annotations

import random
import time

__all__ = ["Backoff"]


class Backoff:
    """``failed()`` schedules the next attempt ``first * 2**(attempts-1)`` seconds on
    (at most ``cap``, the doublings at most ``max_doublings``), times a random
    factor in ``jitter``; ``reset()`` forgets the failures.

    :attr:`next_at` (``time.monotonic``) is None while nothing is scheduled."""

    __slots__ = ("first", "cap", "jitter", "max_doublings", "attempts", "next_at")

    def __init__(self, first: float, cap: float, *, jitter: tuple[float, float] = (0.5, 1.5),
                 max_doublings: int = 16) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"backoff needs 0 < first <= cap, got first={first!r} "
                             f"cap={cap!r}")
        lo, hi = jitter
        if not 0 < lo <= hi:
            raise ValueError(f"backoff jitter needs 0 < low <= high, got {jitter!r}")
        self.first = first
        self.cap = cap
        self.jitter = jitter
        self.max_doublings = max_doublings
        self.attempts = 0
        self.next_at: float | None = None

    def failed(self) -> float:
        """One more failure: schedule the next attempt; returns the wait."""
        self.attempts += 1
        lo, hi = self.jitter
        wait = min(self.cap, self.first * 2 ** min(self.attempts - 1, self.max_doublings))
        wait *= lo + (hi - lo) * random.random()
        self.next_at = time.monotonic() + wait
        return wait

    def reset(self) -> None:
        """It worked: no failures, nothing scheduled."""
        self.attempts = 0
        self.next_at = None

    def now(self) -> None:
        """Try at once (what was waited for happened), keeping the count."""
        self.next_at = 0.0

    def defer(self, until: float) -> None:
        """Schedule the next attempt at ``until`` (monotonic), keeping the count."""
        self.next_at = until

    def due(self, now: float) -> bool:
        """An attempt is scheduled and its time has come."""
        return self.next_at is not None and now >= self.next_at

    def waiting(self, now: float) -> bool:
        """An attempt is scheduled for later than ``now``."""
        return self.next_at is not None and now < self.next_at
