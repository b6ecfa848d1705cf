"""A time lease on ZooKeeper ownership, so a frozen member never delivers after thawing.

ZooKeeper tells a client its session ended only when the client next hears
from the server.  A process frozen (SIGSTOP, a VM pause, a long GC-like stall)
past its session timeout wakes up still believing it owns its partitions, and
could deliver messages that another member already consumed and committed
before the connection notices anything.

The lease closes that window: the coordinator renews it each time a ZooKeeper
request it sent is answered (a cheap heartbeat when idle), counting from when
the request was *sent* - the session was alive at least until then, and cannot
expire sooner than a session timeout later.  Fetch runners deliver only while
the lease is valid, with a margin of a third of the session timeout.
"""

from __future__ import annotations

import time

__all__ = ["Lease"]


class Lease:
    """``valid()`` is True while ownership cannot have been lost to a session expiry."""

    def __init__(self, session_timeout: float) -> None:
        self.length = session_timeout * 2.0 / 3.0
        self._until = 0.0

    def renewed(self, sent_at: float) -> None:
        """A request sent at ``sent_at`` (time.monotonic) was answered by ZooKeeper."""
        until = sent_at + self.length
        if until > self._until:
            self._until = until

    def revoke(self) -> None:
        self._until = 0.0

    def valid(self) -> bool:
        return time.monotonic() < self._until

    def remaining(self) -> float:
        return self._until - time.monotonic()
